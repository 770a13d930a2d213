// entropy/rans.h — interleaved rANS with 32-bit states and 16-bit renormalization.
//
// READ ME FIRST (the one non-obvious contract). rANS is last-in first-out: the encoder walks the
// symbols from the last to the first and writes its 16-bit renormalization words backwards, so
// that the decoder walks forwards and reads forwards. Symbol i is coded by state (lane)
// i % lanes with table (i / run) % n_tables: the symbols come in runs of `run` symbols that share
// a table (the symbol codec orders a chunk channel-major, so a run is one channel's tokens).
// lanes = 2^lanes_log2 (1..32). Every lane starts the encoder at L = 2^P (P = prob_bits) and the
// decoder must end every lane at L again; with the word stream consumed exactly this is the
// end-of-stream integrity check.
//
// Arithmetic (normative; docs/entropy.md §2). M = 2^P, states live in [L, L * 2^16) = [2^P,
// 2^(P+16)) which fits 32 bits because P <= 12.
//   decode: slot = x mod M; s = the symbol with cum[s] <= slot < cum[s] + f[s];
//           x = f[s] * (x >> P) + slot - cum[s]; if x < L: x = (x << 16) | next_word().
//   encode: if x >= f[s] << 16: emit x & 0xFFFF, x >>= 16;  x = (x / f) * M + x % f + cum[s].
// One word at most per symbol in each direction, which keeps both loops branch-free enough to
// vectorize. Words are little-endian u16 in decoder read order: for i = 0, 1, ..., the word (if
// any) read after decoding symbol i.
//
// The scalar code defines the results. The AVX-512 paths (16 or 32 lanes, runs a multiple of the
// lanes or a single table; run when simd_level() is kAvx512) are bit-exact with it and tested
// against it: every SIMD step codes `lanes` consecutive symbols of one run, so all lanes share
// one table and look it up with register permutes instead of per-lane searches or gathers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "entropy/bit_io.h"
#include "entropy/freq_table.h"
#include "kvq/status.h"

namespace kvq::entropy {

inline constexpr int kMaxLanesLog2 = 5;  // at most 32 interleaved states

enum class RansImpl {
  kAuto,    // the fastest path the CPU and the parameters allow
  kScalar,  // the portable reference
};

// True when kAuto runs the AVX-512 (F, BW, VL, VBMI, VBMI2) paths: simd_level() is kAvx512
// (core/cpu.h; they are compiled into every x86-64 build and chosen at run time).
bool rans_simd_available();

// Slot lookup tables (decoder fast path) exist for tables of precision P <= kLutMaxProbBits:
// 2^P slots fit two 64-byte registers, so a lookup is one byte permute per field.
inline constexpr int kLutMaxProbBits = 7;
inline constexpr int kLutSlots = 1 << kLutMaxProbBits;

// Coding tables derived from a FrequencyTables; build once, use for any number of streams.
struct RansModel {
  int symbol_bits = 0;
  int prob_bits = 0;
  int n_tables = 0;
  std::vector<uint16_t> freq;  // [n_tables, A]
  std::vector<uint16_t> cum;   // [n_tables, A + 1]; cum[A] = 2^P
  // Encoder: exact reciprocals, q = (x * rcp) >> shift == x / f for every x < 2^28
  // (Granlund–Montgomery with rcp = ceil(2^(31+l) / f), l = floor(log2 f), shift = 31 + l).
  std::vector<uint32_t> enc_rcp;   // [n_tables, A]
  std::vector<uint32_t> enc_info;  // [n_tables, A]: cum | f << 12 | shift << 25
  // Decoder slot tables (P <= 7 only): [n_tables, 3, 128] bytes; for slot j < 2^P of table t:
  // [t][0][j] = the symbol s with cum[s] <= j < cum[s + 1], [t][1][j] = j - cum[s], [t][2][j] =
  // f[s] (f <= 128 fits a byte). Slots >= 2^P are 0.
  std::vector<uint8_t> dec_lut;

  int alphabet() const { return 1 << symbol_bits; }
};

// What a model is prepared for: the encoder tables and the decoder's packed search table each
// cost a pass over the tables, so per-chunk (inline-table) streams build only what they use.
enum class RansModelUse { kEncode = 1, kDecode = 2, kBoth = 3 };

// Validates the tables (invalid_argument) and prepares them. rans_encode needs kEncode or
// kBoth, rans_decode works with any (the slot tables only enable its fast path).
Result<RansModel> make_rans_model(const FrequencyTables& tables,
                                  RansModelUse use = RansModelUse::kBoth);
// The same into an existing model, reusing its buffers (decoders of many small streams).
Status prepare_rans_model(const FrequencyTables& tables, RansModelUse use, RansModel& model);

// Encodes symbols[0, n) with runs of `run` (>= 1) symbols per table. Appends the words (decoder
// order) to `words` and stores the encoder's final states in final_states[lanes]. Errors:
// invalid_argument for lanes_log2 outside 0..5, run < 1, a symbol >= 2^symbol_bits or with
// frequency 0 in its table (nothing is appended then). `run_tables`, if given, names the table
// of every run (run r uses table run_tables[r] < n_tables, ceil(n / run) entries) instead of
// r % n_tables.
Status rans_encode(const RansModel& model, const uint8_t* symbols, size_t n, size_t run,
                   int lanes_log2, uint32_t* final_states, std::vector<uint8_t>& words,
                   RansImpl impl = RansImpl::kAuto, const uint8_t* run_tables = nullptr);

// Decodes exactly n symbols into out[n]. initial_states[lanes] are the encoder's final states,
// words[size] the word stream. Safe on any input: returns corrupt() if a state is outside
// [L, 2^16 L), the words run out, words are left over, or a final state is not L. On error the
// contents of out are unspecified (but nothing outside out[n] is written).
Status rans_decode(const RansModel& model, const uint32_t* initial_states, const uint8_t* words,
                   size_t size, size_t n, size_t run, int lanes_log2, uint8_t* out,
                   RansImpl impl = RansImpl::kAuto, const uint8_t* run_tables = nullptr);

// State block: each state x as e = floor(log2 x) - P in 4 bits, then the e + P bits of x below
// its leading one. Final states are roughly log-uniform, so this saves ~4.5 bits per lane over
// fixed (P + 16)-bit fields.
size_t states_bits(const uint32_t* states, int lanes, int prob_bits);
void write_states(BitWriter& w, const uint32_t* states, int lanes, int prob_bits);
Status read_states(BitReader& r, uint32_t* states, int lanes, int prob_bits);

// Self-contained form: [state block, zero-padded to a byte][words]. The words region is the rest
// of the input and must have even length.
Status rans_encode_stream(const RansModel& model, const uint8_t* symbols, size_t n, size_t run,
                          int lanes_log2, std::vector<uint8_t>& out,
                          RansImpl impl = RansImpl::kAuto);
Status rans_decode_stream(const RansModel& model, const uint8_t* in, size_t size, size_t n,
                          size_t run, int lanes_log2, uint8_t* out,
                          RansImpl impl = RansImpl::kAuto);

}  // namespace kvq::entropy
