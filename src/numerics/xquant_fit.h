// Parameter fits used by XQuant (src/methods/xquant.cc) and its calibration tool: pure functions
// on spans that turn given codes into fp16 (scale, zero) pairs. The reconstruction is always the
// group_quant.h formula x' = zero + code * scale (fp32, no fused multiply-add), so
// dequantize_per_channel / dequantize_per_token read these parameters unchanged.
//
// Two ways to choose (scale, zero) once codes are fixed:
//   * min/max (group_quant.h's fit_group), optionally with XQuant's data-free calibration eta:
//       z' = z + eta * s * (2^B - 1),   s' = (1 - 2 eta) * s
//     which pulls the outermost reconstruction levels inward (arXiv 2510.11236, section 3.2);
//   * least squares against the codes: the (scale, zero) minimising sum (x - zero - scale*c)^2.
//     For codes assigned by min/max rounding this is never worse than eta = 0 (the min/max pair
//     is one candidate); for codes taken from another layer (XQuant reuse) it is the best affine
//     map of those codes, and its scale may be zero or negative (uncorrelated or anti-correlated
//     codes).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/group_quant.h"

namespace kvq {

// Least-squares (scale, zero) of n values x[i * xs] on codes c[i * cs]. The scale is rounded to
// the nearest fp16 first, then the zero is refit for the rounded scale and rounded; both are
// clamped to the fp16 range. Codes that are all equal give scale 0 and zero = mean(x).
QuantParams fit_params_to_codes(const float* x, ptrdiff_t xs, const uint8_t* c, ptrdiff_t cs,
                                size_t n);

// XQuant's data-free calibration of min/max parameters for `bits`-bit codes (eta in [0, 0.5)).
// eta = 0 returns p unchanged; otherwise the calibrated pair is rounded to the nearest fp16.
QuantParams calibrate_eta(QuantParams p, int bits, float eta);

// Per-channel layout (keys), x and codes [T, D] token-major, params [D].
void fit_per_channel_to_codes(const float* x, int64_t T, int64_t D, const uint8_t* codes,
                              QuantParams* params);
// Min/max per channel without computing codes (VeloxQuant-MLX's reuse fit), params [D].
void fit_per_channel_minmax(const float* x, int64_t T, int64_t D, int bits, QuantParams* params);

// Per-token layout (values), runs of G channels, params [T, ceil(D / G)].
void fit_per_token_to_codes(const float* x, int64_t T, int64_t D, int64_t G, const uint8_t* codes,
                            QuantParams* params);
void fit_per_token_minmax(const float* x, int64_t T, int64_t D, int64_t G, int bits,
                          QuantParams* params);

}  // namespace kvq
