// The generic attention kernel (any layer, any number of queries, fp32 arithmetic) and the
// combine step shared with the fast decode kernel (attend_fast.cu).
//
// Per-query semantics (kvq/cache.h): the query at position p sees keys [0, p]; those below its
// seal boundary SealRules::visible_sealed(p, exact_begin) come from sealed blocks, dequantized as
// stored, the others exact from the window (or the pages the last append retired). Work is split
// over keys (flash-decoding): CTA (row, split) covers keys [c L, (c + 1) L) of one query row and
// writes an unnormalised partial (m in the log2 domain, l, acc[D]).
#include <cuda_runtime.h>

#include <cmath>

#include "cache/seal_rules.h"
#include "cuda/device_common.cuh"
#include "cuda/kernels.h"
#include "kvq/status.h"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 128;

__device__ __forceinline__ float block_reduce(float x, bool is_max, float* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  __syncthreads();  // red[] may still be read from the previous reduction
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
  for (int w = 1; w < kThreads / 32; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

__global__ void __launch_bounds__(kThreads) generic_kernel(LayerDesc L, AttendArgs a) {
  extern __shared__ float sh[];
  const int64_t D = L.D;
  float* qs = sh;            // [D] the query, times scale * log2(e)
  float* acc = qs + D;       // [D]
  float* pr = acc + D;       // [kThreads] scores, then probabilities
  float* red = pr + kThreads;  // [kThreads / 32]
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x, split = blockIdx.y;
  const int64_t t = row % a.Tq, g = (row / a.Tq) % L.group;
  const int64_t hh = (row / (a.Tq * L.group)) % a.nh, b = row / (a.Tq * L.group * a.nh);
  const int64_t h = a.h0 + hh, hq = h * L.group + g, s = b * L.H + h;
  const int64_t p = L.offset - a.Tq + t;  // the query's position
  const SealRules rules{L.T, L.R};
  const int64_t boundary = rules.visible_sealed(p, L.exact_begin);
  for (int64_t d = tid; d < D; d += kThreads) {
    qs[d] = load_elem(a.q.data, a.q.dtype, offset_of(a.q, b, hq, t, d)) * a.scale_log2;
    acc[d] = 0.0f;
  }
  __syncthreads();
  const int64_t j_begin = split * a.split_len;
  const int64_t j_end = imin(j_begin + a.split_len, p + 1);
  float m = -INFINITY, l = 0.0f;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kThreads) {
    const int64_t j = j0 + tid;
    float sc = -INFINITY;
    if (j < j_end) {
      float x = 0.0f;
      if (j < boundary) {
        for (int64_t d = 0; d < D; ++d) x = fmaf(qs[d], sealed_key(L, j / L.T, s, j % L.T, d), x);
      } else {
        for (int64_t d = 0; d < D; ++d) x = fmaf(qs[d], exact_elem(L, true, s, j, d), x);
      }
      sc = x;
    }
    const float mx = block_reduce(sc, true, red);
    const float m_new = fmaxf(m, mx);
    const float corr = exp2f(m - m_new);
    const float pj = j < j_end ? exp2f(sc - m_new) : 0.0f;
    pr[tid] = pj;
    l = l * corr + block_reduce(pj, false, red);  // the reduction's barriers publish pr[]
    const int64_t cnt = imin(kThreads, j_end - j0);
    for (int64_t d = tid; d < D; d += kThreads) {
      float v = acc[d] * corr;
      for (int64_t jj = 0; jj < cnt; ++jj) {
        const int64_t pos = j0 + jj;
        const float x = pos < boundary ? sealed_value(L, pos / L.T, s, pos % L.T, d)
                                       : exact_elem(L, false, s, pos, d);
        v = fmaf(pr[jj], x, v);
      }
      acc[d] = v;
    }
    m = m_new;
    __syncthreads();  // pr[] is rewritten by the next chunk
  }
  float* out = a.part_acc + (row * a.n_splits + split) * D;
  for (int64_t d = tid; d < D; d += kThreads) out[d] = acc[d];
  if (tid == 0) {
    a.part_ml[(row * a.n_splits + split) * 2] = m;
    a.part_ml[(row * a.n_splits + split) * 2 + 1] = l;
  }
}

__global__ void __launch_bounds__(kThreads) combine_kernel(LayerDesc L, AttendArgs a) {
  const int64_t row = blockIdx.x, D = L.D;
  const int64_t t = row % a.Tq, g = (row / a.Tq) % L.group;
  const int64_t hh = (row / (a.Tq * L.group)) % a.nh, b = row / (a.Tq * L.group * a.nh);
  const int64_t hq = (a.h0 + hh) * L.group + g;
  const float* ml = a.part_ml + row * a.n_splits * 2;
  float M = -INFINITY;
  for (int c = 0; c < a.n_splits; ++c)
    if (ml[2 * c + 1] > 0.0f) M = fmaxf(M, ml[2 * c]);
  float den = 0.0f;
  for (int c = 0; c < a.n_splits; ++c)
    if (ml[2 * c + 1] > 0.0f) den += exp2f(ml[2 * c] - M) * ml[2 * c + 1];
  const float inv = 1.0f / den;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float num = 0.0f;
    for (int c = 0; c < a.n_splits; ++c)
      if (ml[2 * c + 1] > 0.0f) num += exp2f(ml[2 * c] - M) * a.part_acc[(row * a.n_splits + c) * D + d];
    static_cast<float*>(a.out.data)[offset_of(a.out, b, hq, t, d)] = num * inv;
  }
}

int64_t rows_of(const LayerDesc& L, const AttendArgs& a) {
  return static_cast<int64_t>(L.B) * a.nh * L.group * a.Tq;
}

}  // namespace

void attend_generic(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  const size_t smem = (2 * static_cast<size_t>(L.D) + kThreads + kThreads / 32) * sizeof(float);
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(generic_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   64 * 1024) == cudaSuccess);
    return true;
  }();
  (void)raised;
  const dim3 grid(static_cast<unsigned>(rows_of(L, a)), static_cast<unsigned>(a.n_splits));
  generic_kernel<<<grid, kThreads, smem, st>>>(L, a);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

void attend_combine(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  combine_kernel<<<static_cast<unsigned>(rows_of(L, a)), kThreads, 0, st>>>(L, a);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace kvq::cuda
