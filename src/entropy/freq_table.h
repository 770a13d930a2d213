// entropy/freq_table.h — static frequency tables for the rANS coder: counting, optimal
// normalization, per-table precision choice, and the compact bit-level serialized form.
//
// A FrequencyTables holds n_tables tables over an alphabet of 2^symbol_bits symbols (1..8 bits:
// quantized codes or their modular token deltas). Every table sums to exactly 2^prob_bits; a
// symbol with frequency 0 cannot be coded with that table.
//
// Serialized form of one table (normative; docs/entropy.md §3 has the worked example). Bits are
// LSB-first (entropy/bit_io.h). P is the common prob_bits of the set, A = 2^symbol_bits.
//   d      unary, d one-bits then a zero-bit (the zero is omitted when d == P): the table is
//          stored at its own precision p = P - d, i.e. every frequency is a multiple of 2^d.
//   mode   symbol_bits bits: the most frequent symbol (lowest index on ties).
//   if p == 0: the table is the single symbol `mode` (frequency 2^P). Done.
//   fmode  p bits: f[mode] - 1 at precision p.
//   then the other symbols in the order mode+1, mode-1, mode+2, mode-2, ... (mod A), while the
//   remaining mass R = 2^p - (sum so far) is > 0: the last symbol of that order takes R
//   implicitly; every other one is coded in truncated binary over [0, min(R, f[mode])].
//   Symbols not reached have frequency 0. Frequencies at precision P are f << d.
// Coding the mode first and walking outwards makes the large frequencies come first, so the
// remaining mass (and with it the width of each later code) shrinks fast; bounding by f[mode]
// saves ~2 bits on each of the first neighbours. A decoded table always sums to 2^P.
//
// Serialized form of a whole set (serialize_tables, for tables shared across streams):
//   u8 symbol_bits (1..8), u8 prob_bits (0..12), LEB128 n_tables (1..2^20), then the tables
//   back to back as one bit stream, zero-padded to a byte. Nothing may follow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "entropy/bit_io.h"
#include "kvq/status.h"
#include "kvq/workspace.h"

namespace kvq::entropy {

inline constexpr int kMaxSymbolBits = 8;
inline constexpr int kMaxProbBits = 12;     // the rANS state arithmetic relies on P <= 12
inline constexpr int kMaxTables = 1 << 20;  // sanity bound for untrusted table counts

struct FrequencyTables {
  int symbol_bits = 0;         // alphabet = 2^symbol_bits, 1..8
  int prob_bits = 0;           // every table sums to 2^prob_bits, 0..12
  int n_tables = 0;            // >= 1
  std::vector<uint16_t> freq;  // [n_tables, 2^symbol_bits]

  int alphabet() const { return 1 << symbol_bits; }
  const uint16_t* table(int t) const { return freq.data() + static_cast<size_t>(t) * alphabet(); }
  uint16_t* table(int t) { return freq.data() + static_cast<size_t>(t) * alphabet(); }
};

// Checks the invariants above (sizes, ranges, every table sums to 2^prob_bits).
// Returns invalid_argument naming the first violation.
Status validate_tables(const FrequencyTables& tables);

// counts[(i % n_tables) * 2^symbol_bits + symbols[i]] += 1 for i < n (counts is zeroed first,
// size n_tables << symbol_bits). Returns out_of_range if a symbol is >= 2^symbol_bits.
Status count_symbols(const uint8_t* symbols, size_t n, int symbol_bits, int n_tables,
                     uint32_t* counts);

// Normalizes counts[alphabet] to freq[alphabet] summing to 2^prob_bits, minimizing the coded size
// sum_s counts[s] * log2(2^prob_bits / freq[s]) (exactly: greedy unit moves on a separable convex
// objective, finished with exchange steps until no move helps). Symbols with a count get
// freq >= 1; with cover_all every symbol does (so any later data is codable). All-zero counts
// without cover_all give the single-symbol table {0: 2^prob_bits}.
// Returns false (freq untouched) if more symbols need a slot than 2^prob_bits provides.
bool normalize_counts(const uint32_t* counts, int alphabet, int prob_bits, bool cover_all,
                      uint16_t* freq);

// sum_s counts[s] * log2(2^prob_bits / freq[s]); +infinity if a counted symbol has freq 0.
double coded_bits(const uint32_t* counts, const uint16_t* freq, int alphabet, int prob_bits);

struct TableBuildOptions {
  int max_prob_bits = 11;          // 1..12: the precision never exceeds this
  bool adaptive_precision = true;  // per-table precision (below max) instead of max_prob_bits
  // With adaptive precision: false = p = clamp((bit_width(n) + 4) / 2), the measured optimum
  // for most KV-like tables (one normalization per table); true = hill-climb from there on
  // (table bits + coded bits), ~3x the table-building time for ~0.1% smaller streams.
  bool precision_search = false;
  bool cover_all = false;  // every symbol gets freq >= 1 (for tables shared across chunks)
};

// Builds one table per histogram (counts [n_tables, 2^symbol_bits]). With adaptive precision each
// table gets its own precision p <= max_prob_bits (frequencies need about sqrt(n) resolution, so
// p ~ log2(n)/2 + 2 balances table bits against coded bits); the set's prob_bits is the largest
// p chosen and the other tables are scaled up to it (exact).
// Returns invalid_argument on bad parameters or when 2^max_prob_bits cannot give every needed
// symbol a slot.
Result<FrequencyTables> build_tables(const uint32_t* counts, int n_tables, int symbol_bits,
                                     const TableBuildOptions& options);
// The same into `out`, reusing its storage (a warm caller allocates nothing); scratch from ws
// (null: a local workspace, which allocates). On error `out` is unspecified.
Status build_tables_into(const uint32_t* counts, int n_tables, int symbol_bits,
                         const TableBuildOptions& options, FrequencyTables& out,
                         Workspace* ws = nullptr);

// Up to k prototype tables for n histograms [n, 2^symbol_bits] (e.g. every channel of a chunk):
// k-means under the coded-size cost (a histogram's cost against a table is its cross-entropy),
// deterministic (initial centres: the histograms at k evenly spaced ranks of entropy), smoothed
// centres, `iterations` rounds; then each cluster's summed histogram is normalized at prob_bits
// with every symbol covered, so any histogram is codable with any prototype. Fewer than k
// tables when there are fewer distinct histograms than k. invalid_argument on bad sizes.
Result<FrequencyTables> build_prototypes(const uint32_t* hists, int n, int symbol_bits, int k,
                                         int prob_bits, int iterations = 8);

// Bit-level table body (format above). table_bits counts exactly what write_table writes.
size_t table_bits(const uint16_t* freq, int symbol_bits, int prob_bits);
void write_table(BitWriter& w, const uint16_t* freq, int symbol_bits, int prob_bits);
// Reads one table into freq[2^symbol_bits]; corrupt() on overrun or inconsistent values.
Status read_table(BitReader& r, int symbol_bits, int prob_bits, uint16_t* freq);

// All tables of a set back to back (no header, no padding). read_tables expects symbol_bits,
// prob_bits and n_tables set in `tables` and fills freq.
size_t tables_bits(const FrequencyTables& tables);
void write_tables(BitWriter& w, const FrequencyTables& tables);
Status read_tables(BitReader& r, FrequencyTables& tables);

// Standalone serialized set (format above), for tables shared by several streams.
void serialize_tables(const FrequencyTables& tables, std::vector<uint8_t>& out);
Result<FrequencyTables> deserialize_tables(const uint8_t* in, size_t size);

}  // namespace kvq::entropy
