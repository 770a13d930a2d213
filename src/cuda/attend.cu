// The generic attention kernel (any layer, any number of queries, fp32 arithmetic) and the
// combine step shared with the fast decode kernel (attend_fast.cu).
//
// Per-query semantics (kvq/cache.h): the query at position p sees keys [0, p]; those below its
// seal boundary SealRules::visible_sealed(p, exact_begin) come from sealed blocks, dequantized as
// stored, the others exact from the window (or the pages the last append retired). Work is split
// over keys (flash-decoding): CTA (row, split) covers keys [c L, (c + 1) L) of one query row and
// writes an unnormalised partial (m in the log2 domain, l, acc[D]).
#include <cuda_runtime.h>

#include <algorithm>
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

// One CTA per query row: the splits' weights 2^(m_c - M) (0 for empty splits) into shared
// memory, then out[d] = sum_c w_c acc_c[d] / sum_c w_c l_c, the splits shared out among groups
// of threads that each read whole rows of acc (float4 columns where D allows).
//
// Launched as a programmatic dependent of the split-K kernel (PDL): its CTAs may start while the
// split-K kernel's last ones still run, and wait here until that grid has finished and its
// partials are visible.
__global__ void __launch_bounds__(kThreads) combine_kernel(LayerDesc L, AttendArgs a) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  extern __shared__ float wsm[];  // [n_splits] weights, then [kThreads] partial sums
  float* red = wsm + a.n_splits;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t row = blockIdx.x, D = L.D;
  const int64_t t = row % a.Tq, g = (row / a.Tq) % L.group;
  const int64_t hh = (row / (a.Tq * L.group)) % a.nh, b = row / (a.Tq * L.group * a.nh);
  const int64_t hq = (a.h0 + hh) * L.group + g;
  const float* ml = a.part_ml + row * a.n_splits * 2;
  float mx = -INFINITY;
  for (int c = tid; c < a.n_splits; c += kThreads)
    if (ml[2 * c + 1] > 0.0f) mx = fmaxf(mx, ml[2 * c]);
  const float M = block_reduce(mx, true, red);
  float den = 0.0f;
  for (int c = tid; c < a.n_splits; c += kThreads) {
    const float w = ml[2 * c + 1] > 0.0f ? exp2f(ml[2 * c] - M) : 0.0f;
    wsm[c] = w;
    den += w * ml[2 * c + 1];
  }
  den = block_reduce(den, false, red);  // its barriers publish wsm[]
  const float inv = 1.0f / den;
  const float* acc = a.part_acc + row * a.n_splits * D;
  float* out = static_cast<float*>(a.out.data);
  if (D % 4 == 0 && D <= 4 * kThreads) {
    // CTA (row, y) sums float4 columns [y * cols, (y + 1) * cols) of the row.
    const int cols = static_cast<int>(D / 4) / static_cast<int>(gridDim.y),
              groups = kThreads / cols;
    const int col = static_cast<int>(blockIdx.y) * cols + tid % cols, grp = tid / cols;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (grp < groups) {
#pragma unroll 8
      for (int c = grp; c < a.n_splits; c += groups) {
        const float w = wsm[c];
        const float4 x = reinterpret_cast<const float4*>(acc + c * D)[col];
        sum.x += w * x.x, sum.y += w * x.y, sum.z += w * x.z, sum.w += w * x.w;
      }
    }
    // The groups' sums through shared memory (reusing wsm: every thread is past reading it).
    __syncthreads();
    float4* part = reinterpret_cast<float4*>(wsm);
    if (grp < groups) part[grp * cols + tid % cols] = sum;
    __syncthreads();
    if (tid < cols) {
      float4 r = part[tid];
      for (int k = 1; k < groups; ++k) {
        const float4 x = part[k * cols + tid];
        r.x += x.x, r.y += x.y, r.z += x.z, r.w += x.w;
      }
      const int64_t d = 4 * col;
      out[offset_of(a.out, b, hq, t, d)] = r.x * inv;
      out[offset_of(a.out, b, hq, t, d + 1)] = r.y * inv;
      out[offset_of(a.out, b, hq, t, d + 2)] = r.z * inv;
      out[offset_of(a.out, b, hq, t, d + 3)] = r.w * inv;
    }
    return;
  }
  if (blockIdx.y != 0) return;  // the scalar path: one CTA per row
  for (int64_t d = tid; d < D; d += kThreads) {
    float num = 0.0f;
    for (int c = 0; c < a.n_splits; ++c) num += wsm[c] * acc[c * D + d];
    out[offset_of(a.out, b, hq, t, d)] = num * inv;
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
  // Weights, then (reusing them) the groups' float4 sums: at most 4 * kThreads floats.
  const size_t smem =
      (std::max<size_t>(static_cast<size_t>(a.n_splits), 4 * kThreads) + kThreads) * sizeof(float);
  KVQ_CHECK(smem <= 48 * 1024 && "split counts stay far below 12k");
  // Few rows (small batch): the columns of a row spread over up to 4 CTAs, so that enough
  // CTAs read the partials (each re-derives the row's weights, a small cost).
  unsigned ys = 1;
  const int64_t rows = rows_of(L, a);
  if (L.D % 4 == 0)
    while (ys < 4 && rows * ys < 4 * 132 && (L.D / 4) % (2 * ys) == 0 && L.D / 4 / (2 * ys) >= 8)
      ys *= 2;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(rows), ys);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute pdl{};
  pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  pdl.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &pdl;
  cfg.numAttrs = 1;
  KVQ_CHECK(cudaLaunchKernelEx(&cfg, combine_kernel, L, a) == cudaSuccess);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace kvq::cuda
