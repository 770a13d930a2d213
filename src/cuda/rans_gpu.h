// The CUDA decoder of kvq's entropy-coded symbol streams (entropy/symbol_codec.h; the format is
// docs/entropy.md §1): the streams CacheGen blocks hold, decoded on the GPU, bit-compatible with
// the CPU decoder (the same symbols from the same bytes, and an error wherever the CPU decoder
// reports one).
//
// One warp per stream. Lane 0 parses the stream's header, its inline tables or shared-table
// indices and its rANS states (the same checks as the CPU); then the warp decodes the
// interleaved rANS lanes together: lane j runs rANS state j, each step decodes the next 2^k
// symbols (one per state), and the 16-bit renormalization words of one step are handed out in
// lane order by a ballot and a prefix count (the CPU reads them in symbol order, which is the
// same order). Raw and constant streams are unpacked by all lanes.
//
// The tables live in shared memory where they fit (a shared set once per thread block, a stream's
// inline tables per warp), and each step's words are fetched by all lanes before the symbols are
// decoded (lane k loads word k; a lane that needs a word takes it by a shuffle from the lane of its
// rank), so a step waits for no global load that depends on the step before.
//
// Output: per stream n_tokens * n_channels symbols, channel-major (the coder's own order, written
// with coalesced stores: the layout a consumer that reads one channel's tokens at a time wants) or
// token-major (decode_symbols' order: the channel-major result transposed in a second pass
// through shared-memory tiles, from staging in the scratch).
//
// The encoder (encode_symbol_streams) writes, from symbols in device memory, the bytes
// entropy::encode_symbols writes with a shared table set and no inline tables (CacheGen's
// tables=shared, its default): the same choice of table per channel or for the whole stream (the
// same double-precision costs, summed in the same order, without contraction), the same lane
// count, the same fallback to raw or constant mode, so a stream is byte-identical to the CPU's.
// One warp per stream: histograms and table costs per channel (a lane per channel for up to 16
// symbols and 32 tables, CacheGen's case; else the warp per channel, lane t scoring table t);
// then the rANS lanes run one state per lane from the last step to the first, the step's words
// placed by a ballot and a count of the emitting lanes above (the decoder's order read
// backwards), written from the end of the stream's slot; a second pass gathers the header and
// the words of every stream into one buffer at the offsets a scan of the sizes gives.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "entropy/freq_table.h"
#include "entropy/symbol_codec.h"
#include "kvq/status.h"

namespace kvq::cuda {

// Streams in device memory: stream s is data[offsets[s], offsets[s + 1]); every stream codes
// [n_tokens, n_channels] symbols of `bits` bits. The offsets are the caller's (e.g. a CacheGen
// block's index, checked on the host with entropy::check_stream_ends): they must lie within the
// data buffer; a stream whose end is before its start is reported corrupt.
struct SymbolStreams {
  const uint8_t* data = nullptr;
  const uint64_t* offsets = nullptr;  // [n + 1], non-decreasing (the caller's index)
  int64_t n = 0;
  int64_t n_tokens = 0;
  int n_channels = 0;
  int bits = 0;
  // When set, stream s is data[offsets[s], ends[s]) instead (streams need not be adjacent, as
  // the blocks of a cache are not; offsets then needs only [n]).
  const uint64_t* ends = nullptr;
};

// A shared table set (SharedTables::tables) in device memory: [K, A + 1] words cum | freq << 16.
class GpuTables {
 public:
  static Result<GpuTables> upload(const entropy::FrequencyTables& t, cudaStream_t st = nullptr);
  GpuTables() = default;
  GpuTables(GpuTables&& o) noexcept { *this = static_cast<GpuTables&&>(o); }
  GpuTables& operator=(GpuTables&& o) noexcept;
  GpuTables(const GpuTables&) = delete;
  ~GpuTables();
  const uint32_t* cf() const { return cf_; }
  const uint8_t* lut() const { return lut_; }  // [K, 2^P] slot -> symbol when P <= 8, else null
  int n_tables() const { return n_tables_; }
  int prob_bits() const { return prob_bits_; }
  int symbol_bits() const { return symbol_bits_; }

 private:
  uint32_t* cf_ = nullptr;
  uint8_t* lut_ = nullptr;
  int n_tables_ = 0, prob_bits_ = 0, symbol_bits_ = 0;
};

// Per-stream results in `status` (device int32 [n]).
enum DecodeResult : int32_t {
  kDecodedOk = 0,
  kDecodeFormat = 1,   // unknown mode or reserved header bits (the CPU's kFormat)
  kDecodeCorrupt = 2,  // anything inconsistent (kCorrupt)
  kDecodeTables = 3,   // needs shared tables, or they do not match (kInvalidArgument)
};

// Device scratch the decode needs: inline tables that do not fit in shared memory (8-bit
// symbols), and for the token-major order the channel-major staging it is transposed from. Ask
// with the same shared tables and order as the decode call (it checks).
size_t decode_scratch_bytes(const SymbolStreams& s, const GpuTables* shared, bool token_major);
// Enqueues the decode of every stream into out[n, n_tokens * n_channels]. `shared` may be null
// (streams that need shared tables then fail with kDecodeTables). Checks the sizes on the host
// (invalid_argument: bits outside 1..8, n_channels < 1, n_tokens < 1, no scratch).
Status decode_symbol_streams(const SymbolStreams& s, const GpuTables* shared, bool token_major,
                             uint8_t* out, int32_t* status, void* scratch, size_t scratch_bytes,
                             cudaStream_t st);
// Waits for the stream and turns the per-stream results into one Status, naming the first
// stream that failed and the CPU's error code for it.
Status decode_status(const int32_t* status, int64_t n, cudaStream_t st);

// ---- Encoder ----

// A shared table set prepared for the encoder (make_shared_tables' result with its encoder
// tables): the per-symbol costs the CPU scores tables with, and per table and symbol the exact
// reciprocal and cum | f << 12 | shift << 25 (entropy::RansModel's enc_rcp and enc_info).
class GpuEncodeTables {
 public:
  static Result<GpuEncodeTables> upload(const entropy::SharedTables& t, cudaStream_t st = nullptr);
  GpuEncodeTables() = default;
  GpuEncodeTables(GpuEncodeTables&& o) noexcept { *this = static_cast<GpuEncodeTables&&>(o); }
  GpuEncodeTables& operator=(GpuEncodeTables&& o) noexcept;
  GpuEncodeTables(const GpuEncodeTables&) = delete;
  ~GpuEncodeTables();
  const double* cost() const { return cost_; }      // [A, cost_stride]
  const uint2* enc() const { return enc_; }         // [K, A]: {rcp, info}
  int n_tables() const { return n_tables_; }
  int cost_stride() const { return cost_stride_; }
  int prob_bits() const { return prob_bits_; }
  int symbol_bits() const { return symbol_bits_; }

 private:
  double* cost_ = nullptr;
  uint2* enc_ = nullptr;
  int n_tables_ = 0, cost_stride_ = 0, prob_bits_ = 0, symbol_bits_ = 0;
};

// Symbols in device memory: n streams of [n_tokens, n_channels] symbols of `bits` bits, each
// stream channel-major ([n_channels, n_tokens], the coder's order) or token-major (the order
// encode_symbols takes; transposed into the scratch first).
struct SymbolArrays {
  const uint8_t* symbols = nullptr;
  int64_t n = 0;
  int64_t n_tokens = 0;
  int n_channels = 0;
  int bits = 0;
};

// Per-stream results of the encoder (device int32 [n]).
enum EncodeResult : int32_t {
  kEncodedOk = 0,
  kEncodeRange = 1,  // a symbol >= 2^bits (the CPU's out_of_range); the stream is left empty
};

// The most bytes the n streams can take (each at most 1 + packed_size(n_tokens * n_channels,
// bits), raw mode's size: the size guarantee of encode_symbols).
size_t encode_capacity(const SymbolArrays& s);
size_t encode_scratch_bytes(const SymbolArrays& s, bool token_major);
// Enqueues the encode of every stream into out[encode_capacity(s)]: stream i is
// out[offsets[i], offsets[i + 1]) (offsets: device uint64 [n + 1], offsets[0] = 0), as
// entropy::encode_symbols writes it with `tables` as its shared tables, inline_tables = false,
// prob_bits and symbol bits the set's, and lanes_log2 (-1: by size, as the CPU). A stream with a
// symbol out of range gets kEncodeRange and no bytes. Checks the arguments on the host
// (invalid_argument; at most 2^30 symbols per stream).
Status encode_symbol_streams(const SymbolArrays& s, const GpuEncodeTables& tables, bool token_major,
                             int lanes_log2, uint8_t* out, uint64_t* offsets, int32_t* status,
                             void* scratch, size_t scratch_bytes, cudaStream_t st);
// Waits for the stream and turns the per-stream results into one Status (the first failure).
Status encode_status(const int32_t* status, int64_t n, cudaStream_t st);

// Internal: [n, rows, cols] bytes to [n, cols, rows] (rans_decode.cu's tiled transpose).
void launch_transpose_bytes(const uint8_t* in, uint8_t* out, int64_t n, int64_t rows, int64_t cols,
                            cudaStream_t st);

}  // namespace kvq::cuda
