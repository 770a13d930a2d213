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
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "entropy/freq_table.h"
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

}  // namespace kvq::cuda
