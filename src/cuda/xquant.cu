// XQuant's sealing on the GPU (kernels.h: xq_anchor_fit, xq_reuse_seal): what
// src/methods/xquant.cc's encode() computes, bit for bit. The fits restate
// src/numerics/xquant_fit.cc operation by operation: least squares in double with explicitly
// rounded operations (__dadd_rn, __dmul_rn, ... : no FMA contraction, as the host code is built
// with -ffp-contract=off), the result rounded double -> float -> fp16 as the CPU's cast and
// f32_to_f16 do; min/max ranges folded in the CPU's order with its comparisons (fit_range,
// quantize from device_common.cuh, as KIVI's append kernel uses them).
//
// Both kernels read a block's tokens from the window pages (append() has written the new ones;
// the pages are released only when the append commits) as the window rounds them: the values the
// CPU codec encodes.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/device_common.cuh"
#include "cuda/kernels.h"
#include "kvq/status.h"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 256;

// std::clamp(v, -65504, 65504), then the double -> float cast and f32_to_f16 (nearest even).
__device__ __forceinline__ uint16_t f16_nearest_clamped(double v) {
  const double c = v < -65504.0 ? -65504.0 : (65504.0 < v ? 65504.0 : v);
  return __half_as_ushort(__float2half_rn(__double2float_rn(c)));
}

// fit_params_to_codes: least-squares (scale, zero) of n values x[i * xs] on codes c[i * cs].
__device__ void lsq_fit(const float* x, int xs, const uint8_t* c, int cs, int n, uint16_t& scale,
                        uint16_t& zero) {
  double mx = 0, mc = 0;
  for (int i = 0; i < n; ++i) {
    mx = __dadd_rn(mx, static_cast<double>(x[i * xs]));
    mc = __dadd_rn(mc, static_cast<double>(c[i * cs]));
  }
  mx = __ddiv_rn(mx, static_cast<double>(n));
  mc = __ddiv_rn(mc, static_cast<double>(n));
  double sxc = 0, scc = 0;
  for (int i = 0; i < n; ++i) {
    const double dc = __dsub_rn(static_cast<double>(c[i * cs]), mc);
    sxc = __dadd_rn(sxc, __dmul_rn(__dsub_rn(static_cast<double>(x[i * xs]), mx), dc));
    scc = __dadd_rn(scc, __dmul_rn(dc, dc));
  }
  scale = scc > 0 ? f16_nearest_clamped(__ddiv_rn(sxc, scc)) : uint16_t{0};
  const double s = static_cast<double>(f16_val(scale));
  zero = f16_nearest_clamped(__dsub_rn(mx, __dmul_rn(s, mc)));
}

// calibrate_eta: z' = z + eta * s * qmax, s' = (1 - 2 eta) * s (eta = 0: unchanged).
__device__ __forceinline__ void calibrate_eta(uint16_t& scale, uint16_t& zero, int bits,
                                              float eta) {
  if (eta == 0.0f) return;
  const double qmax = static_cast<double>((1 << bits) - 1), e = static_cast<double>(eta);
  const double s = static_cast<double>(f16_val(scale)), z = static_cast<double>(f16_val(zero));
  zero = f16_nearest_clamped(__dadd_rn(z, __dmul_rn(__dmul_rn(e, s), qmax)));
  scale = f16_nearest_clamped(__dmul_rn(__dsub_rn(1.0, __dmul_rn(2.0, e)), s));
}

// fit_group over n values x[i * stride]: the range folded in order, then fit_range.
__device__ __forceinline__ void minmax_fit(const float* x, int stride, int n, int bits,
                                           uint16_t& scale, uint16_t& zero) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < n; ++i) {
    const float v = x[i * stride];
    lo = v < lo ? v : lo;  // std::min(lo, v)
    hi = hi < v ? v : hi;  // std::max(hi, v)
  }
  fit_range(lo, hi, bits, scale, zero);
}

// quantize_group of n values x[i * stride] with a fitted pair into c[i * stride].
__device__ __forceinline__ void quantize_run(const float* x, int stride, int n, int bits,
                                             uint16_t scale, uint16_t zero, uint8_t* c) {
  const float z = f16_val(zero), inv = __fdiv_rn(1.0f, f16_val(scale));
  const float qmax = static_cast<float>((1 << bits) - 1);
  for (int i = 0; i < n; ++i)
    c[i * stride] = static_cast<uint8_t>(quantize(x[i * stride], z, inv, qmax));
}

// Where element (token tt, dim d) of a block stream lives in shared memory: rows of `rs`
// elements, each run of `gc` dims padded by one, so that a warp's threads reading one value run
// each (a token's group of channels) hit distinct banks. gc = rs = D: plain [T, D].
struct Padded {
  int gc, rs;
  __device__ __forceinline__ int at(int tt, int d) const {
    const int g = d / gc;
    return tt * rs + g * (gc + 1) + (d - g * gc);
  }
};

// pack_bits: the n = T * D codes of a block stream (code i = token i / D, dim i % D, held in
// layout p) of `bits` bits into out[packed_size(n, bits)], byte j by thread j.
__device__ void pack_codes(const uint8_t* c, int n, int D, Padded p, int bits, uint8_t* out) {
  const int nbytes = (n * bits + 7) / 8;
  for (int j = static_cast<int>(threadIdx.x); j < nbytes; j += kThreads) {
    const int b0 = 8 * j, i0 = b0 / bits, i1 = min(n - 1, (b0 + 7) / bits);
    uint32_t w = 0;
    for (int i = i0; i <= i1; ++i) {
      const int sh = i * bits - b0;
      const uint32_t code = c[p.at(i / D, i % D)];
      w |= sh >= 0 ? code << sh : code >> -sh;
    }
    out[j] = static_cast<uint8_t>(w);
  }
}

// The 16-bit window rows of the block's tokens, as floats, into x (layout p). A warp per row,
// its page found once (positions are below 2^31: 32-bit division).
__device__ void load_rows(const LayerDesc& L, bool keys, int64_t blk, int64_t s, float* x,
                          Padded p) {
  const int T = static_cast<int>(L.T), D = L.D;
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  for (int tt = warp; tt < T; tt += kThreads / 32) {
    const uint32_t pos = static_cast<uint32_t>(blk * L.T + tt), P = static_cast<uint32_t>(L.P);
    const uint32_t page = pos / P;
    const PtrPair pg = L.pages[page];
    const uint16_t* row =
        reinterpret_cast<const uint16_t*>(keys ? pg.k : pg.v) + (s * L.P + (pos - page * P)) * D;
    for (int d = lane; d < D; d += 32) x[p.at(tt, d)] = window_to_f32(row[d], L.bf16_window);
  }
}

// One CTA per (block, stream): the anchor's pairs refit (lsq) or calibrated (eta).
__global__ void __launch_bounds__(kThreads) anchor_fit_kernel(LayerDesc L, int64_t first, XqFit f) {
  extern __shared__ float xs[];                              // [T, D] (lsq only)
  uint8_t* cs = reinterpret_cast<uint8_t*>(xs + L.T * L.D);  // [T, D] codes (lsq only)
  const int64_t S = L.S(), blk = first + blockIdx.x / S, s = blockIdx.x % S;
  const int T = static_cast<int>(L.T), D = L.D, ng = static_cast<int>(L.ng),
            G = static_cast<int>(L.vgroup);
  const int tid = static_cast<int>(threadIdx.x);
  for (int keys = 1; keys >= 0; --keys) {
    uint8_t* part = keys ? L.blocks[blk].k : L.blocks[blk].v;
    const int bits = keys ? L.k_bits : L.v_bits;
    const int64_t code = keys ? L.kcode : L.vcode, param = keys ? L.kparam : L.vparam;
    uint8_t* pairs = part + S * code + s * param;
    if (f.lsq) {
      __syncthreads();  // the previous pass's reads of xs / cs are done
      load_rows(L, keys != 0, blk, s, xs, Padded{D, D});
      for (int i = tid; i < T * D; i += kThreads)
        cs[i] = static_cast<uint8_t>(code_at(part + s * code, i, bits));
      __syncthreads();
    }
    const int n_pairs = keys ? D : T * ng;
    for (int e = tid; e < n_pairs; e += kThreads) {
      uint16_t sc, z;
      if (f.lsq) {
        if (keys) {
          lsq_fit(xs + e, D, cs + e, D, T, sc, z);
        } else {
          const int tt = e / ng, d0 = (e - tt * ng) * G, n = D - d0 < G ? D - d0 : G;
          lsq_fit(xs + tt * D + d0, 1, cs + tt * D + d0, 1, n, sc, z);
        }
      } else {
        sc = static_cast<uint16_t>(pairs[4 * e] | (pairs[4 * e + 1] << 8));
        z = static_cast<uint16_t>(pairs[4 * e + 2] | (pairs[4 * e + 3] << 8));
        calibrate_eta(sc, z, bits, f.eta);
      }
      store_params(pairs + 4 * e, sc, z);
    }
  }
}

// One CTA per (block, stream) of a reuse layer: keys, then values.
__global__ void __launch_bounds__(kThreads) reuse_seal_kernel(LayerDesc L, int64_t first, XqFit f) {
  extern __shared__ float sm[];
  const int T = static_cast<int>(L.T), D = L.D, TD = T * D;
  const int ng = static_cast<int>(L.ng), G = static_cast<int>(L.vgroup);
  const int Gc = G < D ? G : D;  // channels per value run
  const Padded pl{Gc, ng * (Gc + 1)};
  const int TP = T * pl.rs;                     // elements of one padded [T, D] array
  float* x = sm;                                // [T, D] the layer's own rows (padded)
  float* res = x + TP;                          // [T, D] what the reuse misses
  float* psc = res + TP;                        // [max(D, T ng)] reuse scales
  float* pz = psc + (D > T * ng ? D : T * ng);  // zeros
  uint8_t* c = reinterpret_cast<uint8_t*>(pz + (D > T * ng ? D : T * ng));  // [T, D] anchor's
  uint8_t* rc = c + TP;                                                     // [T, D] residual codes
  const int64_t S = L.S(), blk = first + blockIdx.x / S, s = blockIdx.x % S;
  const int tid = static_cast<int>(threadIdx.x);
  const int r = L.r_bits;
  for (int keys = 1; keys >= 0; --keys) {
    const int bits = keys ? L.k_bits : L.v_bits;
    uint8_t* own = keys ? L.blocks[blk].k : L.blocks[blk].v;
    const uint8_t* anchor_codes =
        (keys ? L.links[blk].k : L.links[blk].v) + s * (keys ? L.kcode : L.vcode);
    const int64_t param = keys ? L.kparam : L.vparam;
    __syncthreads();  // the key pass is done with x, c, rc
    load_rows(L, keys != 0, blk, s, x, pl);
    for (int i = tid; i < TD; i += kThreads)
      c[pl.at(i / D, i % D)] = static_cast<uint8_t>(code_at(anchor_codes, i, bits));
    __syncthreads();
    // A run: keys one channel over the tokens (stride: a row), values one token's run of Gc
    // channels (contiguous).
    const int n_runs = keys ? D : T * ng;
    auto run_of = [&](int e, int& start, int& stride, int& n) {
      if (keys) {
        start = pl.at(0, e), stride = pl.rs, n = T;
      } else {
        const int tt = e / ng, d0 = (e - tt * ng) * Gc;
        start = pl.at(tt, d0), stride = 1, n = D - d0 < Gc ? D - d0 : Gc;
      }
    };
    for (int e = tid; e < n_runs; e += kThreads) {
      int start, stride, n;
      run_of(e, start, stride, n);
      uint16_t sc, z;
      if (f.lsq) {
        lsq_fit(x + start, stride, c + start, stride, n, sc, z);
      } else {
        minmax_fit(x + start, stride, n, bits, sc, z);
        calibrate_eta(sc, z, bits, f.eta);
      }
      store_params(own + s * param + 4 * e, sc, z);
      psc[e] = f16_val(sc);
      pz[e] = f16_val(z);
    }
    if (r == 0) continue;
    __syncthreads();
    // res = clamp(x - (zero + code * scale), -65504, 65504).
    for (int i = tid; i < TD; i += kThreads) {
      const int tt = i / D, d = i - tt * D, e = keys ? d : tt * ng + d / Gc, k = pl.at(tt, d);
      const float v = __fsub_rn(x[k], dequantize(c[k], psc[e], pz[e]));
      res[k] = sat_f16_range(v);
    }
    __syncthreads();
    for (int e = tid; e < n_runs; e += kThreads) {
      int start, stride, n;
      run_of(e, start, stride, n);
      uint16_t sc, z;
      minmax_fit(res + start, stride, n, r, sc, z);
      quantize_run(res + start, stride, n, r, sc, z, rc + start);
      if (f.lsq) lsq_fit(res + start, stride, rc + start, stride, n, sc, z);
      store_params(own + S * (param + L.rcode) + s * param + 4 * e, sc, z);
    }
    __syncthreads();
    pack_codes(rc, TD, D, pl, r, own + S * param + s * L.rcode);
  }
}

}  // namespace

void xq_anchor_fit(const LayerDesc& L, int64_t first, int64_t n, XqFit f, cudaStream_t st) {
  if (n == 0 || (!f.lsq && f.eta == 0.0f)) return;
  const size_t smem = f.lsq ? static_cast<size_t>(L.T * L.D) * (sizeof(float) + 1) : 0;
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(anchor_fit_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   200 * 1024) == cudaSuccess);
    return true;
  }();
  (void)raised;
  anchor_fit_kernel<<<static_cast<unsigned>(n * L.S()), kThreads, smem, st>>>(L, first, f);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

size_t xq_reuse_smem_bytes(const LayerDesc& L) {
  // Two padded [T, D] float arrays (rows of ng (Gc + 1)), the run pairs, two padded code arrays.
  const int64_t TP = L.T * L.ng * (std::min<int64_t>(L.vgroup, L.D) + 1);
  const int64_t runs = std::max<int64_t>(L.D, L.T * L.ng);
  return static_cast<size_t>(2 * TP + 2 * runs) * sizeof(float) + static_cast<size_t>(2 * TP);
}

void xq_reuse_seal(const LayerDesc& L, int64_t first, int64_t n, XqFit f, cudaStream_t st) {
  if (n == 0) return;
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(reuse_seal_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   200 * 1024) == cudaSuccess);
    return true;
  }();
  (void)raised;
  reuse_seal_kernel<<<static_cast<unsigned>(n * L.S()), kThreads, xq_reuse_smem_bytes(L), st>>>(
      L, first, f);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace kvq::cuda
