// Small dense kernels for attention over dequantized tiles. Results are not stored, so the
// SIMD versions need not match a scalar order bit for bit; they are tested against plain loops
// within float tolerance.
#pragma once

#include <cstdint>

namespace kvq {

// sum_i a[i] * b[i]
float dot_f32(const float* a, const float* b, int64_t n);
// y[r] = alpha * dot(A[r, :], x) for r < rows; A [rows, n] with row stride lda.
void gemv_f32(const float* A, int64_t rows, int64_t n, int64_t lda, const float* x, float alpha, float* y);
// y[i] += alpha * x[i]
void axpy_f32(float* y, float alpha, const float* x, int64_t n);
// y[i] *= alpha
void scale_f32(float* y, float alpha, int64_t n);

}  // namespace kvq
