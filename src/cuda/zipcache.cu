// ZipCache's sealing on the GPU (kernels.h: zip_probes, zip_seal): what src/methods/zipcache.cc
// computes, bit for bit. The arithmetic restates the CPU's operation by operation with
// explicitly rounded intrinsics (no FMA contraction: the host code is built with
// -ffp-contract=off): dot products in numerics/kernels.cc's defined order (8 fused lanes, the
// reduce8 tree, a fused tail), kvq's own exp_f32 and log_f64 (numerics/kernels.h), double sums
// in the CPU's order (one thread walks them), ranges folded in token or channel order with
// std::min/std::max's comparisons, fit_range and quantize from device_common.cuh.
//
// Both kernels read tokens from the window pages (append() has written the new ones; pages are
// released only when the append commits) and sealed tokens through the block table, as held.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cuda/device_common.cuh"
#include "cuda/kernels.h"
#include "kvq/status.h"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 256;

// numerics/kernels.h's exp_f32, each operation rounded as the host's.
__device__ __forceinline__ float exp_f32_dev(float x) {
  const float cx = x < -87.3f ? -87.3f : (x > 88.0f ? 88.0f : x);
  const float k = rintf(__fmul_rn(cx, 1.44269504088896341f));
  const float r = __fsub_rn(__fsub_rn(cx, __fmul_rn(k, 0.693145751953125f)),
                            __fmul_rn(k, 1.428606765330187e-06f));
  float p = __fdiv_rn(1.0f, 720.0f);
  p = __fadd_rn(__fmul_rn(p, r), __fdiv_rn(1.0f, 120.0f));
  p = __fadd_rn(__fmul_rn(p, r), __fdiv_rn(1.0f, 24.0f));
  p = __fadd_rn(__fmul_rn(p, r), __fdiv_rn(1.0f, 6.0f));
  p = __fadd_rn(__fmul_rn(p, r), 0.5f);
  p = __fadd_rn(__fmul_rn(p, r), 1.0f);
  p = __fadd_rn(__fmul_rn(p, r), 1.0f);
  const int ki = static_cast<int>(k);
  const float scale = __uint_as_float(static_cast<uint32_t>(ki + 127) << 23);
  const float y = __fmul_rn(p, scale);
  return x < -87.3f ? 0.0f : (x > 88.0f ? INFINITY : y);
}

// numerics/kernels.h's log_f64.
__device__ __forceinline__ double log_f64_dev(double x) {
  int e;
  double m = frexp(x, &e);
  if (m < 0.70710678118654752440) {
    m = __dmul_rn(m, 2.0);
    e -= 1;
  }
  const double f = __dsub_rn(m, 1.0);
  const double s = __ddiv_rn(f, __dadd_rn(2.0, f));
  const double s2 = __dmul_rn(s, s);
  double p = __ddiv_rn(1.0, 25.0);
  for (int k = 23; k >= 3; k -= 2) p = __dadd_rn(__dmul_rn(p, s2), __ddiv_rn(1.0, k));
  p = __dadd_rn(__dmul_rn(p, s2), 1.0);
  return __dadd_rn(__dmul_rn(static_cast<double>(e), 0.69314718055994530942),
                   __dmul_rn(__dmul_rn(2.0, s), p));
}

// dot_f32's order: lane l takes elements l, l + 8, ... (fused), reduce8, then a fused tail.
template <class A>
__device__ __forceinline__ float dot8(A a, const float* x, int D) {
  float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int n8 = D - D % 8;
  for (int i = 0; i < n8; i += 8)
#pragma unroll
    for (int k = 0; k < 8; ++k) l[k] = __fmaf_rn(a(i + k), x[i + k], l[k]);
  float sum = __fadd_rn(__fadd_rn(__fadd_rn(l[0], l[4]), __fadd_rn(l[2], l[6])),
                        __fadd_rn(__fadd_rn(l[1], l[5]), __fadd_rn(l[3], l[7])));
  for (int i = n8; i < D; ++i) sum = __fmaf_rn(a(i), x[i], sum);
  return sum;
}

// The key of token j of stream s as held with `sealed` tokens sealed, dotted with qf.
__device__ __forceinline__ float key_dot(const LayerDesc& L, int64_t s, int64_t j, int64_t sealed,
                                         const float* qf) {
  if (j < sealed) {
    const ZipKeyRow r = zip_key_row(L, j / L.T, s, j % L.T);
    return dot8([&](int d) { return zip_key_elem(L, r, d); }, qf, L.D);
  }
  const uint16_t* row = page_row(L, true, s, j);
  return dot8([&](int d) { return window_to_f32(row[d], L.bf16_window); }, qf, L.D);
}

__device__ __forceinline__ float block_max(float x, float* red) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  const int w = threadIdx.x / 32;
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[w] = x;
  __syncthreads();
  float m = red[0];
  for (int i = 1; i < static_cast<int>(blockDim.x / 32); ++i) m = fmaxf(m, red[i]);
  return m;
}

// One CTA per (probe, b, hq), probe-major: zipcache.cc's on_tokens for one query row, all the
// threads over its keys (each thread its own keys, dequantized as it goes) and thread 0 adding
// the exps in key order. Serves runs of few probes (a decode step); the tiled kernel below, long ones.
__global__ void __launch_bounds__(kThreads)
    probe_row_kernel(LayerDesc L, DevTensor q, int64_t q_pos0, int64_t sealed,
                     const ZipProbe* probes, int Hq) {
  __shared__ float qf[256];
  __shared__ float e[kThreads];
  __shared__ float red[kThreads / 32];
  const int64_t rows = static_cast<int64_t>(L.B) * Hq;
  const ZipProbe pr = probes[blockIdx.x / rows];
  const int bq = static_cast<int>(blockIdx.x % rows), b = bq / Hq, hq = bq % Hq;
  const int64_t s = static_cast<int64_t>(b) * L.H + hq / L.group, D = L.D;
  const int64_t qbytes = static_cast<int64_t>(L.B) * Hq * D * 2;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    // Rounded to fp16, saturating (zipcache.cc clamps a query beyond +-65504).
    const float x = load_elem(q.data, q.dtype, offset_of(q, b, hq, pr.pos - q_pos0, d));
    const uint16_t h = __half_as_ushort(__float2half_rn(sat_f16_range(x)));
    reinterpret_cast<uint16_t*>(pr.data)[bq * D + d] = h;  // the piece is 256-byte aligned
    qf[d] = f16_val(h);
  }
  __syncthreads();
  const float scale = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(D)));
  const int64_t n = pr.pos + 1;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += kThreads)
    mx = fmaxf(mx, __fmul_rn(scale, key_dot(L, s, j, sealed, qf)));
  mx = block_max(mx, red);
  double sum = 0;  // thread 0's, in index order
  for (int64_t j0 = 0; j0 < n; j0 += kThreads) {
    const int64_t j = j0 + threadIdx.x;
    if (j < n)
      e[threadIdx.x] = exp_f32_dev(__fsub_rn(__fmul_rn(scale, key_dot(L, s, j, sealed, qf)), mx));
    __syncthreads();
    if (threadIdx.x == 0)
      for (int i = 0; i < kThreads && j0 + i < n; ++i)
        sum = __dadd_rn(sum, static_cast<double>(e[i]));
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float lse = __double2float_rn(__dadd_rn(static_cast<double>(mx), log_f64_dev(sum)));
    const uint32_t bits = __float_as_uint(lse);
    uint8_t* o = pr.data + qbytes + bq * 4;
    for (int i = 0; i < 4; ++i) o[i] = static_cast<uint8_t>(bits >> (8 * i));
  }
}

// zipcache.cc's on_tokens for a run's probes, one CTA per (sequence, KV head, up to kRows
// rows), a row being one probe and one of the KV head's query heads. The keys the rows can see
// ([0, pos]: sealed ones dequantized, the window exact) pass through shared memory in tiles of
// kKeys, each dequantized once for all the rows; every (row, key) score is a dot8 of the row's
// fp16 query with the key. Two passes: the row's maximum, then exp(s - max) of every score, which
// the row's own thread adds to its double sum in key order — the CPU's order.
constexpr int kRows = 32, kKeys = 32;
size_t probe_smem_bytes(int64_t D) {
  return static_cast<size_t>(kRows * D + kKeys * (D + 1) + kRows * kKeys + kRows) * 4 +
         kKeys * sizeof(ZipKeyRow);
}

__global__ void __launch_bounds__(kThreads)
    probe_tile_kernel(LayerDesc L, DevTensor q, int64_t q_pos0, int64_t sealed,
                      const ZipProbe* probes, int n_probes, int Hq) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int64_t D = L.D, DP = D + 1;
  float* qf = reinterpret_cast<float*>(smem);  // [kRows, D] the rows' queries, as fp16 values
  float* kt = qf + kRows * D;                  // [kKeys, DP] a tile of keys
  float* sc = kt + kKeys * DP;                 // [kRows, kKeys] scores, then exps
  float* rmax = sc + kRows * kKeys;            // [kRows] each row's maximum score
  ZipKeyRow* kr = reinterpret_cast<ZipKeyRow*>(rmax + kRows);  // [kKeys]
  const int64_t S = L.S();
  const int sh = static_cast<int>(blockIdx.x % S);  // the stream, b * H + h
  const int b = sh / L.H, h = sh % L.H;
  const int r0 = static_cast<int>(blockIdx.x / S) * kRows;
  const int nr = min(kRows, n_probes * L.group - r0);
  const int64_t qbytes = static_cast<int64_t>(L.B) * Hq * D * 2;
  // Row r: probe (r0 + r) / group, query head h * group + (r0 + r) % group.
  int64_t last = 0;
  for (int r = 0; r < nr; ++r) last = max(last, probes[(r0 + r) / L.group].pos);
  for (int64_t i = threadIdx.x; i < nr * D; i += kThreads) {
    const int r = static_cast<int>(i / D), d = static_cast<int>(i % D);
    const ZipProbe pr = probes[(r0 + r) / L.group];
    const int hq = h * L.group + (r0 + r) % L.group;
    // Rounded to fp16, saturating (zipcache.cc clamps a query beyond +-65504).
    const float x = load_elem(q.data, q.dtype, offset_of(q, b, hq, pr.pos - q_pos0, d));
    const uint16_t hv = __half_as_ushort(__float2half_rn(sat_f16_range(x)));
    reinterpret_cast<uint16_t*>(pr.data)[(static_cast<int64_t>(b) * Hq + hq) * D + d] = hv;
    qf[r * D + d] = f16_val(hv);
  }
  const float scale = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(D)));
  const int me = threadIdx.x;  // the row this thread sums, if < nr
  const int64_t my_pos = me < nr ? probes[(r0 + me) / L.group].pos : -1;
  float mx = -INFINITY;
  double sum = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int64_t j0 = 0; j0 <= last; j0 += kKeys) {
      const int nk = static_cast<int>(imin(kKeys, last + 1 - j0));
      __syncthreads();  // the previous tile is no longer read
      if (threadIdx.x < nk && j0 + threadIdx.x < sealed)
        kr[threadIdx.x] = zip_key_row(L, (j0 + threadIdx.x) / L.T, sh, (j0 + threadIdx.x) % L.T);
      __syncthreads();
      for (int64_t i = threadIdx.x; i < nk * D; i += kThreads) {
        const int jj = static_cast<int>(i / D), d = static_cast<int>(i % D);
        const int64_t j = j0 + jj;
        kt[jj * DP + d] = j < sealed ? zip_key_elem(L, kr[jj], d) : exact_elem(L, true, sh, j, d);
      }
      __syncthreads();
      for (int i = threadIdx.x; i < nr * kKeys; i += kThreads) {
        const int r = i / kKeys, jj = i % kKeys;
        const int64_t pos = probes[(r0 + r) / L.group].pos;
        if (jj >= nk || j0 + jj > pos) continue;
        const float* k = kt + jj * DP;
        const float v =
            __fmul_rn(scale, dot8([&](int d) { return k[d]; }, qf + r * D, static_cast<int>(D)));
        sc[r * kKeys + jj] = pass == 0 ? v : exp_f32_dev(__fsub_rn(v, rmax[r]));
      }
      __syncthreads();
      if (me < nr)
        for (int jj = 0; jj < nk && j0 + jj <= my_pos; ++jj) {
          const float v = sc[me * kKeys + jj];
          if (pass == 0)
            mx = mx < v ? v : mx;
          else
            sum = __dadd_rn(sum, static_cast<double>(v));
        }
    }
    if (pass == 0 && me < nr) rmax[me] = mx;  // read after the next tile's barriers
  }
  if (me < nr) {
    const ZipProbe pr = probes[(r0 + me) / L.group];
    const int hq = h * L.group + (r0 + me) % L.group;
    const float lse = __double2float_rn(__dadd_rn(static_cast<double>(mx), log_f64_dev(sum)));
    const uint32_t bits = __float_as_uint(lse);
    uint8_t* o = pr.data + qbytes + (static_cast<int64_t>(b) * Hq + hq) * 4;
    for (int i = 0; i < 4; ++i) o[i] = static_cast<uint8_t>(bits >> (8 * i));
  }
}

// Byte i of `n` codes of `bits` packed as kvq/bitpack.h does (LSB first, zero padding).
__device__ __forceinline__ uint8_t pack_byte(const uint8_t* codes, int64_t n, int bits, int64_t i) {
  int64_t c = i * 8 / bits;
  int off = static_cast<int>(i * 8 - c * bits), got = 0;
  uint32_t out = 0;
  while (got < 8 && c < n) {
    out |= (static_cast<uint32_t>(codes[c]) >> off) << got;
    got += bits - off;
    off = 0;
    ++c;
  }
  return static_cast<uint8_t>(out);
}
__device__ void pack(const uint8_t* codes, int64_t n, int bits, uint8_t* out) {
  const int64_t bytes = (n * bits + 7) / 8;
  for (int64_t i = threadIdx.x; i < bytes; i += kThreads) out[i] = pack_byte(codes, n, bits, i);
}

// quantize_per_token of one row of D values (x[d] * mul[d] when mul is given) at `bits`: the
// range of each run of vgroup channels folded in channel order, fit_range, codes.
__device__ void quantize_row_group(const LayerDesc& L, const float* x, const float* mul, int64_t g,
                                   int bits, uint8_t* codes, uint8_t* pair) {
  const int64_t d0 = g * L.vgroup, d1 = imin(L.D, d0 + L.vgroup);
  auto at = [&](int64_t d) { return mul ? __fmul_rn(x[d], mul[d]) : x[d]; };
  float lo = at(d0), hi = lo;
  for (int64_t d = d0 + 1; d < d1; ++d) {
    const float v = at(d);
    lo = v < lo ? v : lo;
    hi = hi < v ? v : hi;
  }
  uint16_t sc, z;
  fit_range(lo, hi, bits, sc, z);
  store_params(pair, sc, z);
  const float zero = f16_val(z), inv = __fdiv_rn(1.0f, f16_val(sc));
  const float qmax = static_cast<float>((1 << bits) - 1);
  for (int64_t d = d0; d < d1; ++d)
    codes[d] = static_cast<uint8_t>(quantize(at(d), zero, inv, qmax));
}

// One CTA per (block, stream): zipcache.cc's encode() for that stream.
__global__ void __launch_bounds__(kThreads)
    seal_kernel(LayerDesc L, const ZipSeg* segs, const ZipProbe* table, int Hq) {
  extern __shared__ __align__(16) unsigned char smem[];
  const ZipSeg seg = segs[blockIdx.x / L.S()];
  const ZipProbe* probes = table + seg.first;
  const int n_probes = seg.n, attn = seg.attn;
  const int64_t blk = seg.block;
  const int64_t T = L.T, D = L.D, s = blockIdx.x % L.S(), t0 = blk * T;
  const int b = static_cast<int>(s / L.H), h = static_cast<int>(s % L.H);
  double* sum = reinterpret_cast<double*>(smem);          // [T]
  float* kx = reinterpret_cast<float*>(sum + T);          // [T, D]
  float* vx = kx + T * D;                                 // [T, D]
  float* score = vx + T * D;                              // [T]
  float* qf = score + T;                                  // [D]
  float* cinv = qf + D;                                   // [D]
  int* cnt = reinterpret_cast<int*>(cinv + D);            // [T]
  int* order = cnt + T;                                   // [T] row in subset order -> token
  uint8_t* mask = reinterpret_cast<uint8_t*>(order + T);  // [T]
  uint8_t* codes = mask + T;                              // [T, D] in subset order
  for (int64_t i = threadIdx.x; i < T * D; i += kThreads) {
    const int64_t t = i / D, d = i - t * D;
    kx[i] = exact_elem(L, true, s, t0 + t, d);
    vx[i] = exact_elem(L, false, s, t0 + t, d);
  }
  for (int64_t t = threadIdx.x; t < T; t += kThreads) sum[t] = 0, cnt[t] = 0;
  __syncthreads();
  // Saliency.
  if (attn) {
    const int64_t qbytes = static_cast<int64_t>(L.B) * Hq * D * 2;
    const float scale = __fdiv_rn(1.0f, __fsqrt_rn(static_cast<float>(D)));
    for (int i = 0; i < n_probes; ++i) {
      const ZipProbe pr = probes[i];
      if (pr.pos < t0) continue;
      const int64_t visible = imin(T, pr.pos - t0 + 1);
      for (int64_t j = threadIdx.x; j < visible; j += kThreads) ++cnt[j];
      for (int hq = h * L.group; hq < (h + 1) * L.group; ++hq) {
        const int64_t row = static_cast<int64_t>(b) * Hq + hq;
        __syncthreads();  // the previous head's qf is no longer read
        for (int64_t d = threadIdx.x; d < D; d += kThreads) {
          const uint8_t* p = pr.data + (row * D + d) * 2;
          qf[d] = f16_val(static_cast<uint16_t>(p[0] | (p[1] << 8)));
        }
        __syncthreads();
        const uint8_t* lp = pr.data + qbytes + row * 4;
        const float lse = __uint_as_float(static_cast<uint32_t>(lp[0]) | (lp[1] << 8) |
                                          (lp[2] << 16) | (static_cast<uint32_t>(lp[3]) << 24));
        for (int64_t j = threadIdx.x; j < visible; j += kThreads) {
          const float* kr = kx + j * D;
          const float sc =
              __fmul_rn(scale, dot8([&](int d) { return kr[d]; }, qf, static_cast<int>(D)));
          sum[j] = __dadd_rn(sum[j], static_cast<double>(exp_f32_dev(__fsub_rn(sc, lse))));
        }
      }
    }
    __syncthreads();
    for (int64_t t = threadIdx.x; t < T; t += kThreads)
      score[t] =
          cnt[t] ? __double2float_rn(__ddiv_rn(sum[t], static_cast<double>(cnt[t]))) : -INFINITY;
  } else {
    for (int64_t t = threadIdx.x; t < T; t += kThreads) {
      double a = 0;
      for (int64_t d = 0; d < D; ++d) {
        const double x = static_cast<double>(kx[t * D + d]);
        a = __dadd_rn(a, __dmul_rn(x, x));
      }
      score[t] = __double2float_rn(__dsqrt_rn(a));
    }
  }
  __syncthreads();
  // The mask: the top n_h by score, ties to the earlier token, NaN last (saliency_mask).
  for (int64_t t = threadIdx.x; t < T; t += kThreads) {
    const float kt = isnan(score[t]) ? -INFINITY : score[t];
    int64_t rank = 0;
    for (int64_t u = 0; u < T; ++u) {
      const float ku = isnan(score[u]) ? -INFINITY : score[u];
      rank += (ku > kt) || (ku == kt && u < t);
    }
    mask[t] = rank < L.n_h;
  }
  __syncthreads();
  for (int64_t t = threadIdx.x; t < T; t += kThreads) {
    int64_t before = 0;
    for (int64_t u = 0; u < t; ++u) before += mask[u] == mask[t];
    const int r = static_cast<int>(mask[t] ? before : L.n_h + before);
    order[r] = static_cast<int>(t);
  }
  __syncthreads();
  // Keys.
  uint8_t* kr = L.blocks[blk].k + s * L.zkrec;
  for (int64_t i = threadIdx.x; i < L.zmask; i += kThreads) {
    uint32_t byte = 0;
    for (int k = 0; k < 8 && i * 8 + k < T; ++k)
      byte |= static_cast<uint32_t>(mask[i * 8 + k]) << k;
    kr[i] = static_cast<uint8_t>(byte);
  }
  uint8_t* pp = kr + L.zmask + L.zkhi + L.zklo;
  const int64_t n_h = L.n_h, n_l = T - n_h;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    if (L.zshared) {
      // One pair per channel over the whole block, fit for lo bits; hi codes step by
      // scale * qmax_lo / qmax_hi.
      float lo = kx[d], hi = kx[d];
      for (int64_t t = 1; t < T; ++t) {
        const float v = kx[t * D + d];
        lo = v < lo ? v : lo;
        hi = hi < v ? v : hi;
      }
      uint16_t sc, z;
      fit_range(lo, hi, L.lo_bits, sc, z);
      store_params(pp + 4 * d, sc, z);
      const float zero = f16_val(z);
      for (int sub = 1; sub >= 0; --sub) {
        const float step = sub ? __fmul_rn(f16_val(sc), zip_hi_ratio(L)) : f16_val(sc);
        const float inv = __fdiv_rn(1.0f, step);
        const float qmax = static_cast<float>((1 << (sub ? L.hi_bits : L.lo_bits)) - 1);
        const int64_t r0 = sub ? 0 : n_h, r1 = sub ? n_h : T;
        for (int64_t r = r0; r < r1; ++r)
          codes[r * D + d] = static_cast<uint8_t>(quantize(kx[order[r] * D + d], zero, inv, qmax));
      }
    } else {
      for (int sub = 1; sub >= 0; --sub) {
        const int64_t r0 = sub ? 0 : n_h, r1 = sub ? n_h : T;
        if (r1 == r0) continue;
        const int bits = sub ? L.hi_bits : L.lo_bits;
        float lo = kx[order[r0] * D + d], hi = lo;
        for (int64_t r = r0 + 1; r < r1; ++r) {
          const float v = kx[order[r] * D + d];
          lo = v < lo ? v : lo;
          hi = hi < v ? v : hi;
        }
        uint16_t sc, z;
        fit_range(lo, hi, bits, sc, z);
        store_params(pp + (!sub && n_h > 0 ? 4 * D : 0) + 4 * d, sc, z);
        const float zero = f16_val(z), inv = __fdiv_rn(1.0f, f16_val(sc));
        const float qmax = static_cast<float>((1 << bits) - 1);
        for (int64_t r = r0; r < r1; ++r)
          codes[r * D + d] = static_cast<uint8_t>(quantize(kx[order[r] * D + d], zero, inv, qmax));
      }
    }
  }
  __syncthreads();
  if (n_h) pack(codes, n_h * D, L.hi_bits, kr + L.zmask);
  if (n_l) pack(codes + n_h * D, n_l * D, L.lo_bits, kr + L.zmask + L.zkhi);
  __syncthreads();
  // Values.
  uint8_t* vr = L.blocks[blk].v + s * L.zvrec;
  uint8_t* vp = vr + L.zvcodes;
  if (L.zvalues == 2) {  // cst: channel divisors sqrt(max |x|), rounded up to fp16
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      float m = 0.0f;
      for (int64_t t = 0; t < T; ++t) {
        const float a = fabsf(vx[t * D + d]);
        m = m < a ? a : m;
      }
      const uint16_t c = m > 0 ? f16_round_up(__fsqrt_rn(m)) : static_cast<uint16_t>(0x3c00);
      vp[L.zvparams + 2 * d] = static_cast<uint8_t>(c);
      vp[L.zvparams + 2 * d + 1] = static_cast<uint8_t>(c >> 8);
      cinv[d] = __fdiv_rn(1.0f, f16_val(c));
    }
    __syncthreads();
  }
  for (int64_t i = threadIdx.x; i < T * L.ng; i += kThreads) {
    const int64_t r = i / L.ng, g = i - r * L.ng;  // row r: a token (uniform) or a subset row
    const int64_t t = L.zvalues == 0 ? r : order[r];
    const int bits = L.zvalues == 0 || r < n_h ? L.hi_bits : L.lo_bits;
    quantize_row_group(L, vx + t * D, L.zvalues == 2 ? cinv : nullptr, g, bits, codes + r * D,
                       vp + i * 4);
  }
  __syncthreads();
  if (L.zvalues == 0) {
    pack(codes, T * D, L.hi_bits, vr);
  } else {
    if (n_h) pack(codes, n_h * D, L.hi_bits, vr);
    if (n_l) pack(codes + n_h * D, n_l * D, L.lo_bits, vr + L.zvhi);
  }
}

}  // namespace

void zip_probes(const LayerDesc& L, const DevTensor& q, int64_t q_pos0, int64_t sealed,
                const ZipProbe* probes, int n_probes, int n_q_heads, cudaStream_t st) {
  if (n_probes == 0) return;
  KVQ_CHECK(L.D <= 256);
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(probe_tile_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(probe_smem_bytes(256))) == cudaSuccess);
    return true;
  }();
  (void)raised;
  // The tiled kernel shares each key tile among 32 rows but runs one CTA per 32 rows; with
  // fewer than 64 such CTAs (one sequence, a few probes per run: a decode step) the per-row
  // kernel, one CTA per row, spreads the work over more of the device. KVQ_CUDA_ZIP_PROBES=row or
  // =tile forces one kernel (benchmarks compare them; both sum in the same order, same bits).
  const int64_t tiles = (static_cast<int64_t>(n_probes) * L.group + kRows - 1) / kRows * L.S();
  static const int mode = [] {  // 0 rows, 1 by the count of tiles (default), 2 tiles
    const char* e = std::getenv("KVQ_CUDA_ZIP_PROBES");
    return !e ? 1 : std::strcmp(e, "row") == 0 ? 0 : std::strcmp(e, "tile") == 0 ? 2 : 1;
  }();
  if (mode == 2 || (mode == 1 && tiles >= 64)) {
    KVQ_CHECK(tiles < (int64_t{1} << 31));
    probe_tile_kernel<<<static_cast<unsigned>(tiles), kThreads, probe_smem_bytes(L.D), st>>>(
        L, q, q_pos0, sealed, probes, n_probes, n_q_heads);
  } else {
    const int64_t ctas = static_cast<int64_t>(n_probes) * L.B * n_q_heads;
    KVQ_CHECK(ctas < (int64_t{1} << 31));
    probe_row_kernel<<<static_cast<unsigned>(ctas), kThreads, 0, st>>>(L, q, q_pos0, sealed, probes,
                                                                       n_q_heads);
  }
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

size_t zip_seal_smem_bytes(const LayerDesc& L) {
  const size_t T = static_cast<size_t>(L.T), D = static_cast<size_t>(L.D);
  return T * 8 + 2 * T * D * 4 + T * 4 + 2 * D * 4 + 2 * T * 4 + T + T * D;
}

void zip_seal(const LayerDesc& L, const ZipSeg* segs, int n_blocks, const ZipProbe* probes,
              int n_q_heads, cudaStream_t st) {
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(seal_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   200 * 1024) == cudaSuccess);
    return true;
  }();
  (void)raised;
  KVQ_CHECK(L.D <= 256);
  if (n_blocks == 0) return;
  seal_kernel<<<static_cast<unsigned>(n_blocks * L.S()), kThreads, zip_seal_smem_bytes(L), st>>>(
      L, segs, probes, n_q_heads);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace kvq::cuda
