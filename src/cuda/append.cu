// Append, read and trim kernels of the CUDA backend (see kernels.h). The quantizer follows
// kvq/group_quant.h operation by operation: ranges folded in the CPU's order with its
// comparisons (so even the sign of a zero matches), fp16 parameters rounded outward, codes
// rounded half to even from the window's rounded values, packed as kvq/bitpack.h says.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/device_common.cuh"
#include "cuda/kernels.h"
#include "kvq/status.h"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kCopyTokens = 16;  // new window tokens per (copy item, stream)

#define KVQ_LAUNCH_CHECK() KVQ_CHECK(cudaGetLastError() == cudaSuccess)

struct PtrBatch {
  int64_t first;
  int n;
  PtrPair e[32];
};

__global__ void set_ptrs_kernel(PtrPair* table, PtrBatch b) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < b.n) table[b.first + i] = b.e[i];
}

// Reads new element [b, h, j, d] of x, reporting it when it is not a finite fp16-range value.
__device__ __forceinline__ float fetch_new(const DevTensor& x, int64_t b, int64_t h, int64_t j,
                                           int64_t d, int64_t H, int64_t n_new, int64_t D,
                                           unsigned long long* flag) {
  const float val = load_elem(x.data, x.dtype, offset_of(x, b, h, j, d));
  if (!(fabsf(val) <= kF16MaxDev)) {
    const unsigned long long kind = isnan(val) ? 0 : isinf(val) ? 1 : 2;
    const auto lin = static_cast<unsigned long long>(((b * H + h) * n_new + j) * D + d);
    atomicMin(flag, lin * 4 + kind);
  }
  return val;
}

// Four consecutive new elements [b, h, j, d .. d + 3] from p (the address of the first), when
// the tensor is dense along d and p is aligned for one vector load (fp32: 16 bytes, 16-bit
// types: 8); false otherwise (the caller falls back to fetch_new).
__device__ __forceinline__ bool load4(const void* p, int dtype, float (&v)[4]) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (dtype == 0) {
    if (a % 16 != 0) return false;
    const float4 x = *static_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
    return true;
  }
  if (a % 8 != 0) return false;
  const uint2 x = *static_cast<const uint2*>(p);
  const uint16_t h[4] = {static_cast<uint16_t>(x.x), static_cast<uint16_t>(x.x >> 16),
                         static_cast<uint16_t>(x.y), static_cast<uint16_t>(x.y >> 16)};
#pragma unroll
  for (int i = 0; i < 4; ++i)
    v[i] = dtype == 1 ? __half2float(__ushort_as_half(h[i]))
                      : __bfloat162float(__ushort_as_bfloat16(h[i]));
  return true;
}

// Element `d` of new token j of stream (b, h) was not a finite fp16-range value: report it.
__device__ __forceinline__ void report_bad(float val, int64_t b, int64_t h, int64_t j, int64_t d,
                                           int64_t H, int64_t n_new, int64_t D,
                                           unsigned long long* flag) {
  const unsigned long long kind = isnan(val) ? 0 : isinf(val) ? 1 : 2;
  const auto lin = static_cast<unsigned long long>(((b * H + h) * n_new + j) * D + d);
  atomicMin(flag, lin * 4 + kind);
}

// One new token's row of x (keys or values): rounded to the window type, written to its page
// row `r` and, as floats, to `xs` (null: not kept). Lanes take 4 consecutive channels at a time
// with one vector load and one 8-byte page store where the layout allows (dense along d, aligned),
// else one element at a time; the same values and the same reports either way.
__device__ __forceinline__ void new_row(const DevTensor& x, int64_t b, int64_t h, int64_t j,
                                        int64_t H, int64_t n_new, int D, int bf16, uint16_t* r,
                                        float* xs, unsigned long long* flag, int lane) {
  const int64_t base = offset_of(x, b, h, j, 0);
  const int esize = x.dtype == 0 ? 4 : 2;
  const bool vec = x.s3 == 1 && D % 4 == 0 && reinterpret_cast<uintptr_t>(r) % 8 == 0;
  for (int d = vec ? 4 * lane : lane; d < D; d += vec ? 128 : 32) {
    float v[4];
    if (vec && load4(static_cast<const uint8_t*>(x.data) + (base + d) * esize, x.dtype, v)) {
      uint16_t w[4];
      float f[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        if (!(fabsf(v[i]) <= kF16MaxDev)) report_bad(v[i], b, h, j, d + i, H, n_new, D, flag);
        w[i] = f32_to_window(v[i], bf16);
        f[i] = window_to_f32(w[i], bf16);
      }
      // One 16-byte shared-memory store (rows start on 16 bytes): 4-byte stores at a stride of 4
      // words were 4-way bank conflicts.
      if (xs) *reinterpret_cast<float4*>(xs + d) = make_float4(f[0], f[1], f[2], f[3]);
      *reinterpret_cast<uint2*>(r + d) = make_uint2(w[0] | (static_cast<uint32_t>(w[1]) << 16),
                                                    w[2] | (static_cast<uint32_t>(w[3]) << 16));
    } else {
      for (int i = 0; i < (vec ? 4 : 1); ++i) {
        const uint16_t w = f32_to_window(fetch_new(x, b, h, j, d + i, H, n_new, D, flag), bf16);
        r[d + i] = w;
        if (xs) xs[d + i] = window_to_f32(w, bf16);
      }
    }
  }
}

// Blocks [0, n_sealed * S): one (sealed block, stream) each. The rest: (chunk of new window
// tokens past the sealed blocks, stream).
__global__ void __launch_bounds__(kThreads) append_kernel(LayerDesc L, AppendArgs a) {
  extern __shared__ float sm[];
  const int64_t S = L.S(), D = L.D, T = L.T, H = L.H;
  const int64_t item = blockIdx.x;
  const int tid = static_cast<int>(threadIdx.x);
  const int bf16 = L.bf16_window;
  const int warp = tid / 32, lane = tid % 32;
  constexpr int kWarpsPerCta = kThreads / 32;
  if (item < a.n_sealed * S) {
    const int64_t blk = a.first_sealed + item / S, s = item % S, b = s / H, h = s % H;
    // Sizes inside one block fit 32-bit arithmetic (T * D <= 2^16 by make_cuda_layers' limit on
    // shared memory), and the loops are laid out so that no element needs a 64-bit division.
    const int Ti = static_cast<int>(T), Di = static_cast<int>(D), TD = Ti * Di;
    const int ng = static_cast<int>(L.ng), G = static_cast<int>(L.vgroup);
    float* xk = sm;             // [T, D] keys as the window rounds them
    // Value rows are padded by 4 floats (16-byte aligned still): the value-range fold below has
    // the 4 groups of 8 tokens of a warp reading one channel each, which without the padding all
    // fall into one shared-memory bank (a 32-way conflict; 4-way with it).
    const int DP = Di + 4;
    float* xv = xk + TD;        // [T, D + 4] values
    float* zk = xv + Ti * DP;   // [D] key zero points
    float* ik = zk + D;         // [D] 1 / key scale
    float* zv = ik + D;         // [T, ng] value zero points
    float* iv = zv + T * ng;    // [T, ng] 1 / value scale
    // One warp per token, lanes over channels.
    for (int tt = warp; tt < Ti; tt += kWarpsPerCta) {
      const int64_t pos = blk * T + tt;
      uint16_t* rk = page_row(L, true, s, pos);
      uint16_t* rv = page_row(L, false, s, pos);
      const bool fresh = pos >= a.append_start;  // a new token: from the input, into its page
      const int64_t j = pos - a.append_start;
      if (fresh) {
        new_row(a.k, b, h, j, H, a.n_new, Di, bf16, rk, xk + tt * Di, a.flags, lane);
        new_row(a.v, b, h, j, H, a.n_new, Di, bf16, rv, xv + tt * DP, a.flags + 1, lane);
      } else {
        for (int d = lane; d < Di; d += 32) {
          xk[tt * Di + d] = window_to_f32(rk[d], bf16);
          xv[tt * DP + d] = window_to_f32(rv[d], bf16);
        }
      }
    }
    __syncthreads();
    uint8_t* kp = L.blocks[blk].k;
    uint8_t* vp = L.blocks[blk].v;
    // Keys: one range per channel over the block's tokens, folded in token order.
    for (int d = tid; d < Di; d += kThreads) {
      float lo = xk[d], hi = xk[d];
      for (int tt = 1; tt < Ti; ++tt) {
        const float x = xk[tt * Di + d];
        lo = x < lo ? x : lo;  // std::min(lo, x)
        hi = hi < x ? x : hi;  // std::max(hi, x)
      }
      uint16_t sc, z;
      fit_range(lo, hi, L.k_bits, sc, z);
      store_params(kp + S * L.kcode + s * L.kparam + d * 4, sc, z);
      zk[d] = f16_val(z);
      ik[d] = __fdiv_rn(1.0f, f16_val(sc));
    }
    // Values: one range per token per run of G channels, folded in channel order.
    for (int e = tid; e < Ti * ng; e += kThreads) {
      const int tt = e / ng, d0 = (e - tt * ng) * G, n = Di - d0 < G ? Di - d0 : G;
      const float* row = xv + tt * DP + d0;
      float lo = row[0], hi = row[0];
      for (int i = 1; i < n; ++i) {
        lo = row[i] < lo ? row[i] : lo;
        hi = hi < row[i] ? row[i] : hi;
      }
      uint16_t sc, z;
      fit_range(lo, hi, L.v_bits, sc, z);
      store_params(vp + S * L.vcode + s * L.vparam + e * 4, sc, z);
      zv[e] = f16_val(z);
      iv[e] = __fdiv_rn(1.0f, f16_val(sc));
    }
    __syncthreads();
    // Codes, 8 at a time: 8 codes of b bits are exactly b bytes of the stream.
    const int kb = L.k_bits, vb = L.v_bits;
    const float kq = static_cast<float>((1 << kb) - 1), vq = static_cast<float>((1 << vb) - 1);
    const int groups = (TD + 7) / 8;
    uint8_t* kc = kp + s * L.kcode;
    uint8_t* vc = vp + s * L.vcode;
    // The usual layout (D and G multiples of 8, power-of-two widths): a run of 8 codes is one
    // token's channels [d0, d0 + 8) in one value group, stored with one aligned store per part.
    if (Di % 8 == 0 && G % 8 == 0 && (kb == 2 || kb == 4 || kb == 8) &&
        (vb == 2 || vb == 4 || vb == 8)) {
      for (int gi = tid; gi < groups; gi += kThreads) {
        const int i0 = gi * 8, tt = i0 / Di, d0 = i0 - tt * Di, e = tt * ng + d0 / G;
        // Two 16-byte loads of each row piece (rows are 16-byte aligned, d0 % 8 == 0).
        const float4* pk = reinterpret_cast<const float4*>(xk + i0);
        const float4* pv = reinterpret_cast<const float4*>(xv + tt * DP + d0);
        const float4 k0 = pk[0], k1 = pk[1], v0 = pv[0], v1 = pv[1];
        const float xkr[8] = {k0.x, k0.y, k0.z, k0.w, k1.x, k1.y, k1.z, k1.w};
        const float xvr[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
        const float4* pz = reinterpret_cast<const float4*>(zk + d0);  // zk, ik: 16-byte aligned
        const float4* pi = reinterpret_cast<const float4*>(ik + d0);
        const float4 z0 = pz[0], z1 = pz[1], i0v = pi[0], i1v = pi[1];
        const float zkr[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
        const float ikr[8] = {i0v.x, i0v.y, i0v.z, i0v.w, i1v.x, i1v.y, i1v.z, i1v.w};
        unsigned long long wk = 0, wv = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          wk |= static_cast<unsigned long long>(quantize(xkr[j], zkr[j], ikr[j], kq))
                << (j * kb);
          wv |= static_cast<unsigned long long>(quantize(xvr[j], zv[e], iv[e], vq)) << (j * vb);
        }
        uint8_t* ok = kc + gi * kb;  // kb bytes at a multiple of kb (kcode = kb * T * D / 8)
        uint8_t* ov = vc + gi * vb;
        if (kb == 2) *reinterpret_cast<uint16_t*>(ok) = static_cast<uint16_t>(wk);
        if (kb == 4) *reinterpret_cast<uint32_t*>(ok) = static_cast<uint32_t>(wk);
        if (kb == 8) *reinterpret_cast<unsigned long long*>(ok) = wk;
        if (vb == 2) *reinterpret_cast<uint16_t*>(ov) = static_cast<uint16_t>(wv);
        if (vb == 4) *reinterpret_cast<uint32_t*>(ov) = static_cast<uint32_t>(wv);
        if (vb == 8) *reinterpret_cast<unsigned long long*>(ov) = wv;
      }
      return;
    }
    for (int gi = tid; gi < groups; gi += kThreads) {
      const int i0 = gi * 8, cnt = TD - i0 < 8 ? TD - i0 : 8;
      int tt = i0 / Di, d = i0 - tt * Di;
      unsigned long long wk = 0, wv = 0;
      for (int j = 0; j < cnt; ++j) {
        const int i = i0 + j;
        wk |= static_cast<unsigned long long>(quantize(xk[i], zk[d], ik[d], kq)) << (j * kb);
        const int e = tt * ng + d / G;
        wv |= static_cast<unsigned long long>(quantize(xv[tt * DP + d], zv[e], iv[e], vq))
              << (j * vb);
        if (++d == Di) d = 0, ++tt;
      }
      uint8_t* ok = kc + gi * kb;
      uint8_t* ov = vc + gi * vb;
      for (int j = 0; j < (cnt * kb + 7) / 8; ++j) ok[j] = static_cast<uint8_t>(wk >> (8 * j));
      for (int j = 0; j < (cnt * vb + 7) / 8; ++j) ov[j] = static_cast<uint8_t>(wv >> (8 * j));
    }
    return;
  }
  // New tokens that stay in the window: one warp per token, lanes over channels.
  const int64_t ci = item - a.n_sealed * S, s = ci % S, b = s / H, h = s % H;
  const int64_t copy_begin = imax(a.append_start, (a.first_sealed + a.n_sealed) * T);
  const int64_t pos0 = copy_begin + (ci / S) * kCopyTokens;
  const int64_t ntok = imin(kCopyTokens, a.append_start + a.n_new - pos0);
  for (int64_t t = warp; t < ntok; t += kWarpsPerCta) {
    const int64_t pos = pos0 + t, j = pos - a.append_start;
    uint16_t* rk = page_row(L, true, s, pos);
    uint16_t* rv = page_row(L, false, s, pos);
    new_row(a.k, b, h, j, H, a.n_new, static_cast<int>(D), bf16, rk, nullptr, a.flags, lane);
    new_row(a.v, b, h, j, H, a.n_new, static_cast<int>(D), bf16, rv, nullptr, a.flags + 1, lane);
  }
}

__global__ void check_finite_kernel(DevTensor q, int64_t B, int64_t Hq, int64_t Tq, int64_t D,
                                    unsigned long long* flag) {
  const int64_t n = B * Hq * Tq * D;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, t = (i / D) % Tq, h = (i / (D * Tq)) % Hq, b = i / (D * Tq * Hq);
    const float x = load_elem(q.data, q.dtype, offset_of(q, b, h, t, d));
    if (!isfinite(x)) atomicMin(flag, static_cast<unsigned long long>(i) * 4 + (isnan(x) ? 0 : 1));
  }
}

__global__ void read_kernel(LayerDesc L, int exact, int64_t t0, int64_t n, DevTensor ko,
                            DevTensor vo) {
  const int64_t D = L.D, H = L.H, total = L.S() * n * D, sealed = L.n_blocks * L.T;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, t = (i / D) % n, s = i / (D * n), pos = t0 + t;
    float kv, vv;
    if (!exact && pos < sealed) {
      kv = sealed_key(L, pos / L.T, s, pos % L.T, d);
      vv = sealed_value(L, pos / L.T, s, pos % L.T, d);
    } else {
      kv = exact_elem(L, true, s, pos, d);
      vv = exact_elem(L, false, s, pos, d);
    }
    store_elem(ko.data, ko.dtype, offset_of(ko, s / H, s % H, t, d), kv);
    store_elem(vo.data, vo.dtype, offset_of(vo, s / H, s % H, t, d), vv);
  }
}

__global__ void reopen_kernel(LayerDesc L, int64_t blk, int64_t n) {
  const int64_t D = L.D, total = L.S() * n * D;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t d = i % D, t = (i / D) % n, s = i / (D * n), pos = blk * L.T + t;
    page_row(L, true, s, pos)[d] = f32_to_window(sealed_key(L, blk, s, t, d), L.bf16_window);
    page_row(L, false, s, pos)[d] = f32_to_window(sealed_value(L, blk, s, t, d), L.bf16_window);
  }
}

unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + threads - 1) / threads, 1, 1 << 20));
}

}  // namespace

void set_ptrs(PtrPair* table, int64_t first, const PtrPair* host, int64_t n, cudaStream_t st) {
  for (int64_t i0 = 0; i0 < n; i0 += 32) {
    PtrBatch b{};
    b.first = first + i0;
    b.n = static_cast<int>(std::min<int64_t>(32, n - i0));
    for (int i = 0; i < b.n; ++i) b.e[i] = host[i0 + i];
    set_ptrs_kernel<<<1, 32, 0, st>>>(table, b);
    KVQ_LAUNCH_CHECK();
  }
}

size_t append_smem_bytes(const LayerDesc& L, int64_t n_sealed) {
  if (n_sealed == 0) return 0;
  return static_cast<size_t>(2 * L.T * L.D + 4 * L.T + 2 * L.D + 2 * L.T * L.ng) * sizeof(float);
}

void append_prepare() {
  static const bool done = [] {
    KVQ_CHECK(cudaFuncSetAttribute(append_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   200 * 1024) == cudaSuccess);
    return true;
  }();
  (void)done;
}

void append(const LayerDesc& L, const AppendArgs& a, cudaStream_t st) {
  const int64_t S = L.S();
  const int64_t copy_begin = std::max(a.append_start, (a.first_sealed + a.n_sealed) * L.T);
  const int64_t copy_tokens = std::max<int64_t>(0, a.append_start + a.n_new - copy_begin);
  const int64_t items = (a.n_sealed + (copy_tokens + kCopyTokens - 1) / kCopyTokens) * S;
  if (items == 0) return;
  append_prepare();
  append_kernel<<<static_cast<unsigned>(items), kThreads, append_smem_bytes(L, a.n_sealed), st>>>(
      L, a);
  KVQ_LAUNCH_CHECK();
}

void check_finite(const DevTensor& q, int64_t B, int64_t Hq, int64_t Tq, int64_t D,
                  unsigned long long* flag, cudaStream_t st) {
  check_finite_kernel<<<grid_for(B * Hq * Tq * D, 256), 256, 0, st>>>(q, B, Hq, Tq, D, flag);
  KVQ_LAUNCH_CHECK();
}

void read(const LayerDesc& L, int exact, int64_t t0, int64_t n, const DevTensor& k_out,
          const DevTensor& v_out, cudaStream_t st) {
  if (n == 0 || L.S() == 0) return;
  read_kernel<<<grid_for(L.S() * n * L.D, 256), 256, 0, st>>>(L, exact, t0, n, k_out, v_out);
  KVQ_LAUNCH_CHECK();
}

void reopen(const LayerDesc& L, int64_t block, int64_t n, cudaStream_t st) {
  if (n == 0) return;
  reopen_kernel<<<grid_for(L.S() * n * L.D, 256), 256, 0, st>>>(L, block, n);
  KVQ_LAUNCH_CHECK();
}

int sm_count() {
  int dev = 0, n = 0;
  KVQ_CHECK(cudaGetDevice(&dev) == cudaSuccess);
  KVQ_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess);
  return n;
}

}  // namespace kvq::cuda
