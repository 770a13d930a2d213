// kvq/group_quant.h — asymmetric min/max group quantization (the numerics every method shares).
//
// For a group of values x with b-bit codes (qmax = 2^b - 1):
//   lo = min(x), hi = max(x)                               (fp32)
//   zero  = largest fp16 <= lo                             (stored fp16, rounded down)
//   scale = smallest fp16 >= max((hi - zero) / qmax, eps)  (stored fp16, rounded up)
//   code  = clamp(round_half_even((x - zero) * (1 / scale)), 0, qmax)
//   x'    = zero + code * scale                            (fp32, no fused multiply-add)
// This is VeloxQuant-MLX's formula (scale = max((max-min)/(2^b-1), eps), code = clip(round((x-min)/
// scale))) with the stored fp16 parameters rounded outward, so [lo, hi] stays inside the
// representable range and nothing clips. eps = 2^-24 (the smallest fp16 step) keeps a constant
// group from dividing by zero; a constant group whose value is fp16-representable reconstructs
// exactly (code 0, x' = zero). Scales are capped at 65504: a group spanning more than
// 65504 * qmax (only possible with |x| near fp16 max at 1 bit) clips.
//
// Two groupings of a [T, D] token-major block (row stride `ld` elements):
//   per channel  (KIVI keys):   one (scale, zero) per channel over all T tokens of the block;
//                               params [D].
//   per token    (KIVI values): one (scale, zero) per token per run of G channels;
//                               params [T, ceil(D / G)], the last run may be shorter.
// Codes are written unpacked (one byte each), token-major [T, D]; pack them with bitpack.h.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq {

inline constexpr float kScaleEps = 5.9604644775390625e-8f;  // 2^-24

struct QuantParams {
  uint16_t scale = 0;  // fp16 bits
  uint16_t zero = 0;   // fp16 bits
};

// Largest fp16 <= x and smallest fp16 >= x, for finite |x| <= 65504.
uint16_t f16_round_down(float x);
uint16_t f16_round_up(float x);

// Fits (scale, zero) to n values x[i * stride].
QuantParams fit_group(const float* x, size_t n, ptrdiff_t stride, int bits);
// Fits (scale, zero) to a known [lo, hi] range.
QuantParams fit_range(float lo, float hi, int bits);

// Quantizes n values x[i * stride] with given params into codes[i * code_stride].
void quantize_group(const float* x, size_t n, ptrdiff_t stride, QuantParams p, int bits,
                    uint8_t* codes, ptrdiff_t code_stride);

// The params arrays below may start at any byte address (stored layouts place them right after
// packed codes); they are accessed bytewise, never as aligned QuantParams objects.
// Per-channel grouping: x [T, D] (row stride ld) -> codes [T, D], params[D].
void quantize_per_channel(const float* x, int64_t T, int64_t D, int64_t ld, int bits,
                          uint8_t* codes, QuantParams* params);
void dequantize_per_channel(const uint8_t* codes, int64_t T, int64_t D, const QuantParams* params,
                            float* out);

// Per-token grouping with runs of G channels: x [T, D] -> codes [T, D],
// params [T, n_groups(D, G)].
constexpr int64_t n_channel_groups(int64_t D, int64_t G) { return (D + G - 1) / G; }
void quantize_per_token(const float* x, int64_t T, int64_t D, int64_t ld, int64_t G, int bits,
                        uint8_t* codes, QuantParams* params);
void dequantize_per_token(const uint8_t* codes, int64_t T, int64_t D, int64_t G,
                          const QuantParams* params, float* out);

// Quantize then dequantize in place semantics (for error measurements): out = x'.
void quant_dequant_per_channel(const float* x, int64_t T, int64_t D, int bits, float* out);
void quant_dequant_per_token(const float* x, int64_t T, int64_t D, int64_t G, int bits, float* out);

}  // namespace kvq
