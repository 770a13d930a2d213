// numerics/cachegen.h — CacheGen's pure numerics (VeloxQuant-MLX's API in C++ form): group quantization
// exposing the integer codes, the delta transforms in code space, the layer-wise bit schedule,
// and sizes — the Shannon estimate, fixed-width packing and the *actual* entropy-coded size.
//
// Source: CacheGen (Liu et al., SIGCOMM 2024, arXiv 2310.07240) as adapted by VeloxQuant-MLX
// (`001_69901d89729a9374.txt`); docs/methods/cachegen.md says where kvq deviates and why.
//
// Shapes: one stream is one (batch, head) of keys or values, [n, D] token-major (token t,
// channel d at t * D + d). Batched variants take a leading G = B * H axis, [G, n, D].
//
// Quantization (kvq/group_quant.h, bit-identical to the foundation's): asymmetric min/max with
// fp16 parameters, grouped along one of two axes:
//   kChannel  one (scale, zero) per channel per run of `group` tokens (VeloxQuant-MLX's grouping;
//             KIVI's for keys). params [ceil(n / group), D]; the last run may be shorter.
//   kToken    one (scale, zero) per token per run of `group` channels (KIVI's for values).
//             params [n, ceil(D / group)].
// The entropy stage is lossless, so the values the model sees are exactly these.
//
// Delta transforms act on codes in [0, 2^bits) and produce symbols in the same alphabet (all
// arithmetic mod 2^bits, so the coder's alphabet does not grow):
//   kNone    s[t] = c[t]
//   kToken   s[0] = c[0], s[t] = c[t] - c[t-1]                      (VeloxQuant-MLX's token_delta)
//   kGroup   as kToken, restarted at every multiple of `group` tokens (a quantization group's
//            scale changes at its boundary, so a delta across it means little)
//   kAnchor  the first token of every run of `group` tokens is an anchor kept as is; every other
//            token is coded against its run's anchor: s[t] = c[t] - c[anchor(t)]  (the paper's
//            §5.2 scheme, in code space)
//   kAuto    per channel, kToken or kNone, whichever gives the smaller empirical entropy over
//            the [n, D] matrix; the choice is a D-bit mask (bit d set = channel d is
//            token-delta coded) that travels with the symbols. RoPE rotates key channel pairs at
//            very different rates, so some channels are smooth along tokens and others are not.
// Every transform is a bijection on [n, D] code matrices; *_inverse recovers the codes exactly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "entropy/symbol_codec.h"
#include "kvq/group_quant.h"
#include "kvq/status.h"

namespace kvq::cachegen {

enum class Axis { kChannel, kToken };
enum class DeltaMode { kNone, kToken, kGroup, kAnchor, kAuto };
const char* delta_mode_name(DeltaMode mode);

// Codes plus the parameters needed to dequantize them (VeloxQuant-MLX's CodeStream).
struct CodeStream {
  int64_t n_rows = 0;  // tokens
  int64_t dim = 0;     // D
  int bits = 0;        // 1..8
  int64_t group = 0;   // tokens (kChannel) or channels (kToken) per quantization group
  Axis axis = Axis::kChannel;
  std::vector<uint8_t> codes;  // [n_rows, D]
  std::vector<QuantParams>
      params;  // kChannel: [ceil(n_rows / group), D]; kToken: [n_rows, ceil(D / group)]
};

// Number of (scale, zero) pairs for an [n, D] stream.
int64_t param_count(int64_t n, int64_t dim, int64_t group, Axis axis);

// x [n, D] fp32 (finite, |x| <= 65504) -> codes. bits in 1..8, group >= 1 (checked: a bad
// argument is a caller bug and aborts, like the foundation's quantizers).
CodeStream quantize_to_codes(const float* x, int64_t n, int64_t dim, int bits, int64_t group,
                             Axis axis = Axis::kChannel);
// Same, writing into caller-provided codes [n, D] and params [param_count].
void quantize_to_codes(const float* x, int64_t n, int64_t dim, int bits, int64_t group, Axis axis,
                       uint8_t* codes, QuantParams* params);
// out [n_rows, D] = zero + code * scale, exactly the foundation's dequantization.
void dequant_codes(const CodeStream& stream, float* out);
void dequant_codes(const uint8_t* codes, int64_t n, int64_t dim, int64_t group, Axis axis,
                   const QuantParams* params, float* out);

// VeloxQuant-MLX's token delta over [n, D] codes (row 0 kept), mod 2^bits, and its prefix-sum inverse.
// In place is allowed (out == codes).
void token_delta(const uint8_t* codes, int64_t n, int64_t dim, int bits, uint8_t* out);
void token_delta_inverse(const uint8_t* symbols, int64_t n, int64_t dim, int bits, uint8_t* out);

// Any delta mode but kAuto (see the top of this file); `group` is the restart/anchor period in
// tokens. In place is allowed.
void apply_delta(DeltaMode mode, int64_t group, const uint8_t* codes, int64_t n, int64_t dim,
                 int bits, uint8_t* out);
void invert_delta(DeltaMode mode, int64_t group, const uint8_t* symbols, int64_t n, int64_t dim,
                  int bits, uint8_t* out);

// kAuto. mask_bytes(D) = ceil(D / 8); mask bit d (bit d % 8 of byte d / 8) set = channel d is
// token-delta coded. choose_channel_deltas picks, per channel, the transform with the smaller
// empirical (Shannon) entropy over codes [n, D] (ties: no delta). apply/invert are in-place safe;
// invert ignores mask bits at or above D.
inline size_t mask_bytes(int64_t dim) { return static_cast<size_t>((dim + 7) / 8); }
// i log2 i for i in [0, 4096]: the terms choose_channel_deltas sums, in symbol order (the CUDA
// backend sums the same doubles).
const std::vector<double>& c_log2_c_table();
// `counts`, if given, receives the per-channel histograms [D, 2^bits] of the symbols the choice
// produces (what the coder would count next). Scratch ([n, D] bytes and two [D, 2^bits]
// histograms) from ws; null: a local workspace (allocates). apply/invert use stack scratch.
void choose_channel_deltas(const uint8_t* codes, int64_t n, int64_t dim, int bits, uint8_t* mask,
                           uint32_t* counts = nullptr, Workspace* ws = nullptr);
void apply_channel_deltas(const uint8_t* mask, const uint8_t* codes, int64_t n, int64_t dim,
                          int bits, uint8_t* out);
void invert_channel_deltas(const uint8_t* mask, const uint8_t* symbols, int64_t n, int64_t dim,
                           int bits, uint8_t* out);

// Transforms one chunk of codes [n, D] into the symbols the coder receives, for any mode
// (kAuto chooses and writes mask[mask_bytes(D)]; other modes leave mask untouched). Returns true
// when it also filled `counts` ([D, 2^bits] histograms of the symbols; kAuto computes them on
// the way), false when it did not (or counts is null). Scratch as for choose_channel_deltas.
bool chunk_symbols(DeltaMode mode, int64_t group, const uint8_t* codes, int64_t n, int64_t dim,
                   int bits, uint8_t* symbols, uint8_t* mask, uint32_t* counts = nullptr,
                   Workspace* ws = nullptr);
void chunk_codes(DeltaMode mode, int64_t group, const uint8_t* symbols, const uint8_t* mask,
                 int64_t n, int64_t dim, int bits, uint8_t* codes);

// Shannon entropy in bits per symbol of the empirical distribution of symbols[0, n) (VeloxQuant-MLX's
// symbol_entropy_bits: one pooled distribution). 0 for n == 0. Symbols are full bytes.
double symbol_entropy_bits(const uint8_t* symbols, size_t n);

// How a stream's symbols are entropy coded (the cache's `delta`, `tables`, `chunk` parameters).
struct CodingOptions {
  DeltaMode delta = DeltaMode::kGroup;
  int64_t delta_group = 0;  // restart/anchor period; 0 = the stream's group
  entropy::TableLayout layout = entropy::TableLayout::kPerChannel;
  int64_t chunk = 0;                  // tokens per independently coded chunk; 0 = all
  entropy::SymbolCodecOptions codec;  // layout is taken from `layout` above
};

// Bytes of the fp16 parameters: 4 per (scale, zero) pair.
size_t param_bytes(const CodeStream& stream);
// The baseline: codes packed at a fixed width (kvq/bitpack.h), per chunk as the cache stores
// them, plus the fp16 parameters.
size_t fixed_width_bytes(const CodeStream& stream, int64_t chunk = 0);
// VeloxQuant-MLX's estimate, kept for comparison: sum over chunks of the Shannon bits of the delta
// symbols (per channel, or pooled when options.layout is kPooled), in bytes (fractional), plus
// the fp16 parameters. Tables are not in it.
double shannon_estimate_bytes(const CodeStream& stream, const CodingOptions& options);
// The actual size: every chunk encoded with entropy::encode_symbols (headers, inline tables,
// final states, words) and, with kAuto, its channel mask, plus the fp16 parameters. Never more
// than fixed_width_bytes + 1 byte (+ the mask) per chunk (the coder's raw mode).
Result<size_t> entropy_coded_bytes(const CodeStream& stream, const CodingOptions& options);

// VeloxQuant-MLX's layer-wise schedule: n_layers split into n_groups contiguous depth groups
// (group of layer l = floor(l * n_groups / n_layers), earliest first); group g gets
// base_bits - g bits, floored at 2 and never above base_bits (so base_bits < 2 stays as is).
// n_groups is clamped to [1, n_layers].
int layer_bits(int layer, int n_layers, int base_bits, int n_groups);
std::vector<int> layer_group_bits(int n_layers, int base_bits, int n_groups = 3);

// ---- batched variants over a leading G = B * H axis ----
// x [G, n, D] -> G streams.
std::vector<CodeStream> quantize_to_codes_batched(const float* x, int64_t G, int64_t n, int64_t dim,
                                                  int bits, int64_t group,
                                                  Axis axis = Axis::kChannel);
// out [G, n, D].
void dequant_codes_batched(const std::vector<CodeStream>& streams, float* out);
// codes [G, n, D] -> out [G, n, D], token delta along axis 1.
void token_delta_batched(const uint8_t* codes, int64_t G, int64_t n, int64_t dim, int bits,
                         uint8_t* out);
Result<std::vector<size_t>> entropy_coded_bytes_batched(const std::vector<CodeStream>& streams,
                                                        const CodingOptions& options);
std::vector<size_t> fixed_width_bytes_batched(const std::vector<CodeStream>& streams,
                                              int64_t chunk = 0);

}  // namespace kvq::cachegen
