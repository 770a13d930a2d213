// Small dense kernels for attention over dequantized tiles and for ZipCache's saliency scores.
//
// Saliency scores decide which tokens get more bits, i.e. what is stored, so the kernels that
// feed them have one defined arithmetic whatever the CPU: dot products accumulate in 8 lanes
// (lane l takes elements i = l mod 8 below the largest multiple of 8, with fused multiply-add),
// the lanes are summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then the tail is added in order
// with fused multiply-add. The AVX2 paths and the scalar fallback follow exactly this order and
// are tested bit-exact against each other.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#include "core/cpu.h"

namespace kvq {

// sum_i a[i] * b[i], in the defined order above.
float dot_f32(const float* a, const float* b, int64_t n);
float dot_f32_reference(const float* a, const float* b, int64_t n);
// y[r] = alpha * dot_f32(A + r * lda, x, n) for r < rows.
void gemv_f32(const float* A, int64_t rows, int64_t n, int64_t lda, const float* x, float alpha,
              float* y);
// y[i] += alpha * x[i]
void axpy_f32(float* y, float alpha, const float* x, int64_t n);
// y[i] *= alpha
void scale_f32(float* y, float alpha, int64_t n);
// exp(x) to a few ulp for x in [-87.3, 88] (0 below, +inf above), written as plain
// element-wise float arithmetic so vectorised and scalar evaluation agree bit for bit. Inline,
// so that loops compiled per SIMD level (core/cpu.h) vectorise it (std::nearbyint is one
// rounding instruction from the AVX2 level on, a library call at the baseline).
//   exp(x) = 2^k * exp(r), k = round(x / ln2), r = x - k*ln2 (ln2 split in two for accuracy),
//   exp(r) on |r| <= ln2/2 by a degree-6 Taylor polynomial in Horner form.
KVQ_ALWAYS_INLINE float exp_f32(float x) {
  const float cx = x < -87.3f ? -87.3f : (x > 88.0f ? 88.0f : x);
  const float k = std::nearbyint(cx * 1.44269504088896341f);
  const float r = (cx - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t ki = static_cast<int32_t>(k);
  const float scale = std::bit_cast<float>(static_cast<uint32_t>(ki + 127) << 23);
  const float y = p * scale;
  return x < -87.3f ? 0.0f : (x > 88.0f ? INFINITY : y);
}
// Natural log of a positive, finite, normal x, in plain IEEE double operations (no library
// call), so that another backend can compute the same bits: x = m 2^e with m in [sqrt(1/2),
// sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1), by its series to s^25 (|s| <= 0.172:
// the next term is below 2^-64 relative). Within a few ulp of the true log.
inline double log_f64(double x) {
  int e;
  double m = std::frexp(x, &e);
  if (m < 0.70710678118654752440) {
    m = m * 2.0;
    e -= 1;
  }
  const double f = m - 1.0;
  const double s = f / (2.0 + f);
  const double s2 = s * s;
  double p = 1.0 / 25.0;
  for (int k = 23; k >= 3; k -= 2) p = p * s2 + 1.0 / k;
  p = p * s2 + 1.0;
  return static_cast<double>(e) * 0.69314718055994530942 + (2.0 * s) * p;
}
// y[i] = exp_f32(x[i] - shift); returns the sum of the y[i] (in double, in index order).
double exp_sum_f32(const float* x, float shift, int64_t n, float* y);

}  // namespace kvq
