#include "model/ops.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>

namespace kvq::model {

void rmsnorm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* o = out + r * n;
    double ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
    for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * scale) * w[i];
  }
}

void softmax_rows_prefix(float* x, int64_t rows, int64_t stride, const int64_t* len) {
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * stride;
    const int64_t n = len[r];
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, xr[i]);
    float sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float e = exp_nonpositive(xr[i] - mx);
      xr[i] = e;
      sum += e;
    }
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; ++i) xr[i] *= inv;
    for (int64_t i = n; i < stride; ++i) xr[i] = 0.0f;
  }
}

void swiglu_rows(const float* gu, float* out, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= kParallelMinWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = gu + r * 2 * n;
    const float* u = g + n;
    float* o = out + r * n;
    for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void sgemm_wt_serial(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                     int64_t ldy, float beta) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.0f, x, static_cast<int>(K), w, static_cast<int>(K), beta, y,
              static_cast<int>(ldy));
}

void matmul_wt(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
               float beta) {
  // Each thread owns a slice of W's rows (output columns), so every weight byte is read by one
  // thread only — what matters when M is small and the product is bound by memory bandwidth.
  // Slices are multiples of 16 columns to keep OpenBLAS's kernels on their full-width paths.
  const int64_t work = M * N * K;
  const int nt = work < 4 * kParallelMinWork ? 1 : omp_get_max_threads();
  if (nt <= 1) {
    sgemm_wt_serial(x, M, K, w, N, y, N, beta);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), n_threads = omp_get_num_threads();
    const int64_t blocks = (N + 15) / 16;
    const int64_t n0 = std::min(N, blocks * t / n_threads * 16);
    const int64_t n1 = std::min(N, blocks * (t + 1) / n_threads * 16);
    if (n1 > n0) sgemm_wt_serial(x, M, K, w + n0 * K, n1 - n0, y + n0, N, beta);
  }
}

void use_single_threaded_blas() { openblas_set_num_threads(1); }

}  // namespace kvq::model
