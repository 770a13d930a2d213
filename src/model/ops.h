// Element-wise and reduction operations of the model engine (fp32, OpenMP across rows).
#pragma once

#include <bit>
#include <cstdint>
#include <functional>

#include "kvq/thread_pool.h"

namespace kvq::model {

// The engine's threads: one process-wide pool (hardware concurrency unless set), which the engine
// also hands to its caches (CacheOptions::pool) so that the whole forward pass shares one set.
ThreadPool& engine_pool();
// Sets the engine pool's thread count (>= 1) before its first use, or rebuilds it; not safe
// while a forward pass runs.
void set_engine_threads(int n);
inline int pool_threads() { return engine_pool().threads(); }
inline void parallel_for(int64_t n, FunctionRef fn) { engine_pool().parallel_for(n, fn); }

// Below this many elements (or multiply-adds) per operation, work stays on the calling thread:
// waking a second thread costs more than it saves, and on a busy machine every parallel region
// can wait milliseconds for a descheduled worker.
inline constexpr int64_t kParallelMinWork = int64_t{1} << 16;

// exp(x) for x <= 0 (softmax after max subtraction), relative error < 2e-7; exactly 0 below
// -87.3. Written branch-free so that loops over it vectorize (glibc's expf does not without
// -ffast-math).
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;
  const float kLog2e = 1.44269504088896341f;
  const float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * kLog2e + kRound) - kRound;
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // x - n ln2
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(n) + 127;
  const float y = p * std::bit_cast<float>(static_cast<uint32_t>(e) << 23);
  return x <= -87.3f ? 0.0f : y;
}

// out[r] = x[r] / rms(x[r]) * w for rows of length n (the mean square accumulated in double).
void rmsnorm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t n, float eps);

// In-place softmax of each row's first `len[r]` entries; entries at or beyond len[r] become 0.
// Rows are `stride` apart. Runs on the calling thread (callers parallelize over heads).
void softmax_rows_prefix(float* x, int64_t rows, int64_t stride, const int64_t* len);

// g[r, i] = silu(g[r, i]) * u[r, i]: gate and up are the two halves of each row of gu
// [rows, 2n]; the result goes to out [rows, n].
void swiglu_rows(const float* gu, float* out, int64_t rows, int64_t n);

// fn(r0, r1) over blocks of rows, in parallel when rows * row_work is large enough.
void parallel_rows(int64_t rows, int64_t row_work, const std::function<void(int64_t, int64_t)>& fn);

// Threading: the engine has one set of threads, engine_pool(). OpenBLAS runs single-threaded
// inside work items of each product. (Two pools — OpenBLAS's pthreads and the engine's — on a
// 2-core machine spin-wait against each other between products: a decode step measured 7x
// slower that way.)
void use_single_threaded_blas();

// y[M, N] = x[M, K] * W[N, K]^T + beta * y with W row-major [out, in], split over OpenMP
// threads by slices of W's rows, each product an OpenBLAS sgemm.
void matmul_wt(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
               float beta = 0.0f);
// The same on the calling thread only, with a row stride ldy for y.
void sgemm_wt_serial(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y,
                     int64_t ldy, float beta = 0.0f);

}  // namespace kvq::model
