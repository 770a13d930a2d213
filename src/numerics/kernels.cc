#include "numerics/kernels.h"

#include <bit>
#include <cmath>

#include "core/cpu.h"

#if KVQ_SIMD_X86
#include <immintrin.h>
#endif

namespace kvq {

namespace {

// The defined reduction of 8 lanes: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)).
inline float reduce8(const float* l) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

#if KVQ_SIMD_X86
// Same order as reduce8: add the 128-bit halves (l0+l4 ...), then (x0+x2, x1+x3), then the two.
KVQ_TARGET_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// The AVX2 + FMA kernels. The AVX-512 level runs them too: a 16-lane accumulator would change
// the defined order, and these loops are latency-bound on short rows (head_dim 64..128) anyway.
KVQ_TARGET_AVX2 float dot_f32_avx2(const float* a, const float* b, int64_t n) {
  const int64_t n8 = n - n % 8;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n8; i += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = hsum(acc);
  for (int64_t i = n8; i < n; ++i) sum = std::fma(a[i], b[i], sum);  // one vfmadd (FMA target)
  return sum;
}

KVQ_TARGET_AVX2 void gemv_f32_avx2(const float* A, int64_t rows, int64_t n, int64_t lda,
                                   const float* x, float alpha, float* y) {
  int64_t r = 0;
  if (n % 8 == 0) {
    // Four rows at a time share each load of x; each row keeps dot_f32's order.
    for (; r + 4 <= rows; r += 4) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const float* p0 = A + r * lda;
      for (int64_t i = 0; i < n; i += 8) {
        const __m256 xv = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(p0 + i), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(p0 + lda + i), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(p0 + 2 * lda + i), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(p0 + 3 * lda + i), xv, a3);
      }
      y[r] = alpha * hsum(a0);
      y[r + 1] = alpha * hsum(a1);
      y[r + 2] = alpha * hsum(a2);
      y[r + 3] = alpha * hsum(a3);
    }
  }
  for (; r < rows; ++r) y[r] = alpha * dot_f32_avx2(A + r * lda, x, n);
}
#endif

// Element-wise loops, compiled once per level (auto-vectorised; no contraction, so every width
// computes the same values).
template <SimdLevel L>
KVQ_ALWAYS_INLINE void axpy_body(float* y, float alpha, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}
template <SimdLevel L>
KVQ_ALWAYS_INLINE void scale_body(float* y, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}
KVQ_LEVEL_CLONES(void, axpy, (float* y, float alpha, const float* x, int64_t n), (y, alpha, x, n))
KVQ_LEVEL_CLONES(void, scale, (float* y, float alpha, int64_t n), (y, alpha, n))

}  // namespace

float dot_f32_reference(const float* a, const float* b, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t n8 = n - n % 8;
  for (int64_t i = 0; i < n8; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
  float sum = reduce8(lanes);
  for (int64_t i = n8; i < n; ++i) sum = std::fma(a[i], b[i], sum);
  return sum;
}

float dot_f32(const float* a, const float* b, int64_t n) {
#if KVQ_SIMD_X86
  if (simd_level() >= SimdLevel::kAvx2) return dot_f32_avx2(a, b, n);
#endif
  return dot_f32_reference(a, b, n);
}

void gemv_f32(const float* A, int64_t rows, int64_t n, int64_t lda, const float* x, float alpha,
              float* y) {
#if KVQ_SIMD_X86
  if (simd_level() >= SimdLevel::kAvx2) return gemv_f32_avx2(A, rows, n, lda, x, alpha, y);
#endif
  for (int64_t r = 0; r < rows; ++r) y[r] = alpha * dot_f32_reference(A + r * lda, x, n);
}

void axpy_f32(float* y, float alpha, const float* x, int64_t n) {
  KVQ_LEVEL_DISPATCH(axpy, (y, alpha, x, n));
}

void scale_f32(float* y, float alpha, int64_t n) { KVQ_LEVEL_DISPATCH(scale, (y, alpha, n)); }

namespace {

template <SimdLevel L>
KVQ_ALWAYS_INLINE double exp_sum_body(const float* x, float shift, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_f32(x[i] - shift);  // inlined: vectorised per level
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += y[i];  // in order: not vectorised, at any level
  return s;
}
KVQ_LEVEL_CLONES(double, exp_sum, (const float* x, float shift, int64_t n, float* y),
                 (x, shift, n, y))

}  // namespace

double exp_sum_f32(const float* x, float shift, int64_t n, float* y) {
  KVQ_LEVEL_DISPATCH(exp_sum, (x, shift, n, y));
}

}  // namespace kvq
