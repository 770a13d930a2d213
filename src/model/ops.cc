#include "model/ops.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>

namespace kvq::model {

namespace {
std::mutex g_pool_mu;
std::unique_ptr<ThreadPool> g_pool;
}  // namespace

ThreadPool& engine_pool() {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool) g_pool = std::make_unique<ThreadPool>(hardware_threads());
  return *g_pool;
}

void set_engine_threads(int n) {
  std::lock_guard<std::mutex> lock(g_pool_mu);
  if (!g_pool || g_pool->threads() != std::max(1, n))
    g_pool = std::make_unique<ThreadPool>(std::max(1, n));
}

void parallel_rows(int64_t rows, int64_t row_work,
                   const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t total = rows * row_work;
  if (total < kParallelMinWork || rows < 2) {
    fn(0, rows);
    return;
  }
  // Blocks of at least ~kParallelMinWork / 4 work, at most 4 per thread (spare blocks let the
  // threads that are running take over from one that is not).
  const int64_t max_blocks = std::min<int64_t>(rows, 4 * pool_threads());
  const int64_t blocks = std::max<int64_t>(1, std::min(max_blocks, total / (kParallelMinWork / 4)));
  parallel_for(blocks, [&](int64_t b) { fn(rows * b / blocks, rows * (b + 1) / blocks); });
}

void rmsnorm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps) {
  parallel_rows(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * n;
      float* o = out + r * n;
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(xr[i]) * xr[i];
      const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
      for (int64_t i = 0; i < n; ++i) o[i] = (xr[i] * scale) * w[i];
    }
  });
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
  parallel_rows(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gu + r * 2 * n;
      const float* u = g + n;
      float* o = out + r * n;
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
}

void sgemm_wt_serial(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                     int64_t ldy, float beta) {
  if (M == 1) {
    // One row (single-sequence decode): OpenBLAS's gemv streams W without gemm's packing of it,
    // measured ~1.5x faster on SmolLM2's shapes.
    cblas_sgemv(CblasRowMajor, CblasNoTrans, static_cast<int>(N), static_cast<int>(K), 1.0f, w,
                static_cast<int>(K), x, 1, beta, y, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.0f, x, static_cast<int>(K), w, static_cast<int>(K), beta, y,
              static_cast<int>(ldy));
}

void matmul_wt(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
               float beta) {
  // Work items are slices of W's rows (output columns), so every weight byte is read by one
  // thread only — what matters when M is small and the product is bound by memory bandwidth.
  // Slices are multiples of 16 columns (OpenBLAS's kernels' full width), about 4 per thread.
  const int64_t work = M * N * K;
  const int64_t groups = (N + 15) / 16;
  const int64_t slices =
      work < 4 * kParallelMinWork ? 1 : std::min<int64_t>(groups, 4 * pool_threads());
  if (slices <= 1) {
    sgemm_wt_serial(x, M, K, w, N, y, N, beta);
    return;
  }
  parallel_for(slices, [&](int64_t i) {
    const int64_t n0 = std::min(N, groups * i / slices * 16);
    const int64_t n1 = std::min(N, groups * (i + 1) / slices * 16);
    if (n1 > n0) sgemm_wt_serial(x, M, K, w + n0 * K, n1 - n0, y + n0, N, beta);
  });
}

void use_single_threaded_blas() { openblas_set_num_threads(1); }

}  // namespace kvq::model
