// entropy/symbol_codec.h — lossless coding of quantized KV symbols, the entry point of CacheGen.
//
// Input: symbols [n_tokens, n_channels] token-major (token t, channel c at t * n_channels + c),
// each < 2^bits, bits in 1..8 (codes or modular token deltas). Output: one self-contained stream
// that decodes without any other chunk. Every inconsistency in a stream is an error, never UB.
//
// The encoder picks the smallest of four stream modes (docs/entropy.md §1 is normative):
//   raw        byte 0 = 0x00, then pack_bits(symbols) (kvq/bitpack.h layout).
//   constant   byte 0 = 0x01, byte 1 = the symbol (every symbol equal).
//   rANS       byte 0 = 2 (tables inline) or 3 (tables shared) | lanes_log2 << 2 | per_channel << 5
//              byte 1 = prob_bits P (0..12);
//              then one LSB-first bit stream: the tables (inline mode: 1 or n_channels tables,
//              entropy/freq_table.h format; shared mode: 1 or n_channels indices into the shared
//              set, bit_width(K - 1) bits each) and the final rANS states (entropy/rans.h state
//              block), zero-padded to a byte; then the 16-bit words. Symbols are coded
//              channel-major: channel c's n_tokens symbols form run c, coded with its table.
// Size guarantee: encode_symbols never appends more than 1 + packed_size(n, bits) bytes (raw
// mode is always a candidate and is used when rANS would not be smaller).
//
// Sizes the caller must keep: n_tokens, n_channels, bits and the stream's byte length are not
// stored in the stream (the container has them); decode_symbols needs all four.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "entropy/freq_table.h"
#include "entropy/rans.h"
#include "kvq/status.h"

namespace kvq::entropy {

enum class StreamMode : uint8_t {
  kRaw = 0,
  kConstant = 1,
  kRansInline = 2,  // tables in the stream
  kRansShared = 3,  // tables passed to encode and decode (billed once by the caller)
};
const char* stream_mode_name(StreamMode mode);

enum class TableLayout {
  kPerChannel,  // one table per channel (symbol i uses table i % n_channels)
  kPooled,      // one table for all channels
  kAuto,        // whichever gives the smaller stream (estimated before coding)
};

struct SymbolCodecOptions {
  int prob_bits = 11;  // maximum table precision P, 1..12
  TableLayout layout = TableLayout::kPerChannel;
  bool adaptive_precision = true;   // per-table precision ~ log2(n)/2 + 2
  bool precision_search = false;    // refine it per table (slower encode, ~0.1%)
  int lanes_log2 = -1;              // interleaved states 2^k (0..5); -1 = by size
  RansImpl impl = RansImpl::kAuto;  // kScalar forces the reference paths
  bool stats_shannon = true;        // fill EncodeStats::shannon_bits (costs ~5%)
  // With shared tables: also try inline tables (false skips building them: faster encoding,
  // and the stream is raw, constant or shared-table coded).
  bool inline_tables = true;
};

struct EncodeStats {
  StreamMode mode = StreamMode::kRaw;
  size_t header_bytes = 0;   // mode byte (+ precision byte for rANS)
  size_t table_bytes = 0;    // ceil(table_bits / 8) for inline tables, 0 otherwise
  size_t payload_bytes = 0;  // everything else: states, words, packed or constant symbol
  size_t total_bytes = 0;    // bytes appended = header + table + payload
  size_t table_bits = 0;     // exact bits of the inline tables
  int n_tables = 0;
  int prob_bits = 0;
  int lanes = 0;
  double shannon_bits = 0;  // if options.stats_shannon: shannon_bits() of the input under the
                            // layout used (per-channel unless the stream uses one pooled table)
};

// Tables shared across streams (e.g. all chunks of one layer's K): build once, bill
// serialize_tables() once, pass to every encode/decode. A set holds K <= 256 tables of any
// shape (e.g. prototypes, build_prototypes()); a stream coded with it names, per channel (or once
// for the stream), the table it uses.
inline constexpr int kMaxSharedTables = 256;
struct SharedTables {
  FrequencyTables tables;
  RansModel model;
  // Encoding only: cost[s * cost_stride + t] = P - log2 f_t[s] bits, +inf when f = 0; the stride
  // is K rounded up to 16 (padding +inf), so small sets are scored in fixed-size registers.
  std::vector<double> cost;
  int cost_stride = 0;
};
// `use` = kDecode skips the encoder tables (a receiver that only decodes).
Result<SharedTables> make_shared_tables(FrequencyTables tables,
                                        RansModelUse use = RansModelUse::kBoth);

// Accumulates per-channel (or pooled) histograms over several chunks, then builds tables with
// every symbol of the alphabet covered (cover_all), so any later chunk is codable with them.
class TableAccumulator {
 public:
  // Fails (at add/build) unless bits in 1..8 and n_channels >= 1.
  TableAccumulator(int n_channels, int bits, bool per_channel);
  Status add(const uint8_t* symbols, int64_t n_tokens);
  Result<FrequencyTables> build(const SymbolCodecOptions& options, bool cover_all = true) const;

 private:
  int n_channels_;
  int bits_;
  bool per_channel_;
  std::vector<uint64_t> counts_;
};

// Appends one stream for symbols [n_tokens, n_channels] to out. With `shared`, the shared-table
// rANS mode is a candidate too (used only if every symbol is codable with those tables and it is
// the smallest). Errors (nothing appended): invalid_argument for bad sizes/options,
// out_of_range for a symbol >= 2^bits, invalid_argument if shared tables disagree with
// bits/n_channels.
// `counts`, if given, are the per-channel histograms [n_channels, 2^bits] of `symbols` (a caller
// that has them already, e.g. from choosing a transform, saves the encoder its counting pass;
// they must be exact). Symbols are still range-checked.
// Scratch: every temporary comes from `ws` (flat arrays in a frame, the table and model objects
// in its persistent slots), so a caller that passes the same workspace, and an `out` that keeps
// its capacity, allocates nothing once warm. Null: a local workspace per call, which allocates
// (for tests and tools).
Status encode_symbols(const uint8_t* symbols, int64_t n_tokens, int n_channels, int bits,
                      const SymbolCodecOptions& options, std::vector<uint8_t>& out,
                      EncodeStats* stats = nullptr, const SharedTables* shared = nullptr,
                      const uint32_t* counts = nullptr, Workspace* ws = nullptr);

// How a decoded stream splits into header, inline tables and payload: the same split
// EncodeStats reports for it (header_bytes + table_bytes + payload_bytes = the stream's size).
struct StreamInfo {
  StreamMode mode = StreamMode::kRaw;
  size_t header_bytes = 0;
  size_t table_bytes = 0;
  size_t payload_bytes = 0;
};

// Decodes exactly n_tokens * n_channels symbols from in[size] (one whole stream, nothing
// after it). Errors: invalid_argument for bad sizes, format() for an unknown mode or reserved
// bits set, corrupt() for anything inconsistent, invalid_argument if the stream needs shared
// tables and none (or non-matching ones) are given. `impl` = kScalar forces the reference path.
// `info`, if given, receives the stream's split on success. Scratch as for encode_symbols: from
// `ws` (no allocation once warm), or a local workspace per call when null (allocates).
Status decode_symbols(const uint8_t* in, size_t size, int64_t n_tokens, int n_channels, int bits,
                      uint8_t* symbols, const SharedTables* shared = nullptr,
                      RansImpl impl = RansImpl::kAuto, StreamInfo* info = nullptr,
                      Workspace* ws = nullptr);

// The end offsets of n streams laid one after another in a coded region of `region` bytes
// (n little-endian u32 at `ends`: stream s is [ends[s - 1], ends[s]), stream 0 from 0), as the
// methods that hold several streams per block store them: non-decreasing, within the region, the
// last one its end (no region without streams). kCorrupt naming `what` otherwise; the streams
// themselves are the caller's to decode.
Status check_stream_ends(const uint8_t* ends, int64_t n, size_t region, const std::string& what);

// VeloxQuant-MLX's size estimate in bits: per channel, n_tokens * H(empirical distribution of that
// channel) summed over channels (per_channel), or n * H(pooled distribution). Symbols must be
// < 2^bits (higher bits are masked).
double shannon_bits(const uint8_t* symbols, int64_t n_tokens, int n_channels, int bits,
                    bool per_channel = true);

// The lanes the encoder starts from for n symbols when options.lanes_log2 == -1: 1..8 below
// 2048 symbols, else 16; encode_symbols then uses 32 if the rANS stream is estimated >= 4 KiB.
int default_lanes_log2(size_t n);

}  // namespace kvq::entropy
