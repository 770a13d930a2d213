#include "numerics/kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace kvq {

float dot_f32(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8)
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  sum = _mm_cvtss_f32(s);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void axpy_f32(float* y, float alpha, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void scale_f32(float* y, float alpha, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

#if defined(__AVX2__) && defined(__FMA__)
namespace {
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
}  // namespace
#endif

void gemv_f32(const float* A, int64_t rows, int64_t n, int64_t lda, const float* x, float alpha, float* y) {
  int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n % 8 == 0) {
    // Four rows at a time share each load of x.
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
#endif
  for (; r < rows; ++r) y[r] = alpha * dot_f32(A + r * lda, x, n);
}

}  // namespace kvq
