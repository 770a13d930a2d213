// ZipCache's decode attention (one query per sequence) over its packed mixed-width blocks
// (src/methods/zipcache.cc's layout, methods/zip_layout.h), split-K, fp32 arithmetic on the CUDA
// cores. The chunk kernel served ZipCache's decode before: it dequantized every key and value of
// a 64-key tile element by element into shared memory for 128 query rows of which a decode step
// fills `group`; this kernel reads the codes where they lie and never materializes a tile.
//
// One warp owns one (sequence, KV head, split) and walks its tiles: the sealed blocks below the
// query's seal boundary, then the window in tiles of 32 tokens. For a sealed block:
//   1. the mask: each token's subset (salient or not) and its row in it, by ballots;
//   2. the query folded into each subset's per-channel pairs: qs[d][g] = q[g][d] * scale_d and
//      bias[g] = sum_d q[g][d] * zero_d, so that a key's score is bias + sum_d qs[d][g] * code;
//   3. scores, one lane per key row of a subset (the subset's width is the same for all the
//      warp's lanes, so the code extraction is compiled per width), into shared memory in the
//      order the value rows are stored (subset order for routed/cst values, positions for
//      uniform ones);
//   4. the online softmax of the block (per query head, log2 domain as the other kernels);
//   5. P.V, the lanes over channels (D / 32 consecutive channels each), value rows in stored
//      order, each dequantized once for all the group's query heads (cst: times its channel
//      divisor).
// Keys and values are addressed in place: attention does not depend on the order of keys, so
// subset order is as good as position order as long as each key meets its own value.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cache/seal_rules.h"
#include "cuda/device_common.cuh"
#include "cuda/kernels.h"
#include "kvq/status.h"

namespace kvq::cuda {

namespace {

constexpr int kWarps = 4;     // warps per CTA (each its own split)
constexpr int kWinTile = 32;  // window tokens per tile
constexpr int kMaxT = 256;    // block tokens this kernel takes

// Per-warp shared memory, in floats: qraw [D][G] (the query times scale * log2 e), qs [2][D][G]
// (hi, lo folds), bias [2][G], sc [max(T, 32)][G] (scores, then probabilities), map [max(T, 32)]
// (ints: a key row's token within its block).
__host__ __device__ constexpr int64_t warp_floats(int64_t D, int64_t G, int64_t T) {
  const int64_t n = T > kWinTile ? T : kWinTile;
  return (3 * D * G + 2 * G + n * G + n + 3) / 4 * 4;  // whole float4s: the next warp's base
}

// The decode query's seal boundary (tokens below it from sealed blocks, at and above it from the
// window) and the tiles of a split-K pass: one per sealed block, then 32 window tokens each.
__host__ __device__ inline int64_t zip_boundary(const LayerDesc& L) {
  return SealRules{L.T, L.R}.visible_sealed(L.offset - 1, L.exact_begin);
}
__host__ __device__ inline int64_t zip_tiles(const LayerDesc& L, int64_t boundary) {
  return boundary / L.T + (L.offset - boundary + kWinTile - 1) / kWinTile;
}

// Code as a float without a conversion instruction: 2^23 + c as bits, minus 2^23.
__device__ __forceinline__ float code_f(uint32_t c) {
  return __int_as_float(static_cast<int>(0x4B000000u | c)) - 8388608.0f;
}

// qs[d] as a vector of the group's G values.
template <int G>
__device__ __forceinline__ void load_g(const float* p, float* out) {
  if constexpr (G % 4 == 0) {
#pragma unroll
    for (int i = 0; i < G; i += 4) {
      const float4 x = *reinterpret_cast<const float4*>(p + i);
      out[i] = x.x, out[i + 1] = x.y, out[i + 2] = x.z, out[i + 3] = x.w;
    }
  } else if constexpr (G == 2) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    out[0] = x.x, out[1] = x.y;
  } else {
#pragma unroll
    for (int i = 0; i < G; ++i) out[i] = p[i];
  }
}

// Scores of `n` key rows of one subset (codes of BITS bits, rows of D codes, 4-byte aligned),
// lane r taking rows r, r + 32, ...: sc[dest] = bias + sum_d qs[d] * code, dest the row's value
// slot (slot0 + r, or its token for uniform values).
template <int D, int G, int BITS>
__device__ __forceinline__ void key_scores(const uint8_t* codes, int n, int slot0, const float* qs,
                                           const float* bias, const int* map, bool by_token,
                                           float* sc, int lane) {
  constexpr int kWords = D * BITS / 32;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  for (int r = lane; r < n; r += 32) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(codes + static_cast<size_t>(r) * kWords * 4);
    uint32_t x[kWords];
#pragma unroll
    for (int i = 0; i < kWords; ++i) x[i] = __ldg(w + i);
    float acc[G];
#pragma unroll
    for (int g = 0; g < G; ++g) acc[g] = bias[g];
#pragma unroll
    for (int d = 0; d < D; ++d) {
      const int bit = d * BITS, wi = bit >> 5, sh = bit & 31;
      uint32_t c = x[wi] >> sh;
      if (sh + BITS > 32) c |= x[wi + 1] << (32 - sh);
      const float cf = code_f(c & kMask);
      float q[G];
      load_g<G>(qs + d * G, q);
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g] = fmaf(q[g], cf, acc[g]);
    }
    const int slot = slot0 + r;
    const int dest = by_token ? map[slot] : slot;
#pragma unroll
    for (int g = 0; g < G; ++g) sc[dest * G + g] = acc[g];
  }
}

// P.V over `n` value rows of BITS bits (rows of D codes, 4-byte aligned; pairs [rows][ng] fp16
// {scale, zero}), probabilities sc[(slot0 + r) * G + g]: acc[g][i] += p * (zero + scale * code)
// for the lane's channels c0 + i (cst: times the channel divisor div[i]).
template <int D, int G, int BITS>
__device__ __forceinline__ void value_rows(const uint8_t* codes, const uint8_t* pairs, int64_t ng,
                                           int grp, int n, int slot0, const float* sc, bool cst,
                                           const float (&div)[D / 32], float (&acc)[G][D / 32],
                                           int lane) {
  constexpr int C = D / 32;
  constexpr int kRowBytes = D * BITS / 8;
  constexpr uint32_t kMask = (1u << BITS) - 1u;
  const int sb = lane * C * BITS, wi = sb >> 5, sh = sb & 31;
  const bool two = sh + C * BITS > 32;
  for (int r = 0; r < n; ++r) {
    const uint32_t* w = reinterpret_cast<const uint32_t*>(codes + static_cast<size_t>(r) * kRowBytes);
    uint32_t x = __ldg(w + wi) >> sh;
    if (two) x |= __ldg(w + wi + 1) << (32 - sh);
    const uint32_t pr =
        __ldg(reinterpret_cast<const uint32_t*>(pairs + (static_cast<int64_t>(r) * ng + grp) * 4));
    const float scale = f16_val(static_cast<uint16_t>(pr & 0xffffu));
    const float zero = f16_val(static_cast<uint16_t>(pr >> 16));
    float p[G];
    load_g<G>(sc + (slot0 + r) * G, p);
#pragma unroll
    for (int i = 0; i < C; ++i) {
      float v = fmaf(code_f((x >> (i * BITS)) & kMask), scale, zero);
      if (cst) v *= div[i];
#pragma unroll
      for (int g = 0; g < G; ++g) acc[g][i] = fmaf(p[g], v, acc[g][i]);
    }
  }
}

// The width dispatch: f.template operator()<BITS>() for bits 1..8.
template <typename F>
__device__ __forceinline__ void with_bits(int bits, F&& f) {
  switch (bits) {
    case 1: f.template operator()<1>(); break;
    case 2: f.template operator()<2>(); break;
    case 3: f.template operator()<3>(); break;
    case 4: f.template operator()<4>(); break;
    case 5: f.template operator()<5>(); break;
    case 6: f.template operator()<6>(); break;
    case 7: f.template operator()<7>(); break;
    default: f.template operator()<8>(); break;
  }
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int D, int G>
struct Softmax {
  float m[G], l[G];
  float acc[G][D / 32];
  // The tile's scores sc[0, n) -> probabilities; the state rescaled to the new maxima.
  __device__ __forceinline__ void step(float* sc, int n, int lane) {
    __syncwarp();
    float mx[G];
#pragma unroll
    for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
    for (int i = lane; i < n; i += 32)
#pragma unroll
      for (int g = 0; g < G; ++g) mx[g] = fmaxf(mx[g], sc[i * G + g]);
    float mnew[G], sum[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      mnew[g] = fmaxf(m[g], warp_max(mx[g]));
      sum[g] = 0.0f;
    }
    __syncwarp();
    for (int i = lane; i < n; i += 32)
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = exp2f(sc[i * G + g] - mnew[g]);
        sc[i * G + g] = p;
        sum[g] += p;
      }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      const float corr = exp2f(m[g] - mnew[g]);  // 0 while m is -inf (scores are finite)
      l[g] = l[g] * corr + warp_sum(sum[g]);
#pragma unroll
      for (int i = 0; i < D / 32; ++i) acc[g][i] *= corr;
      m[g] = mnew[g];
    }
    __syncwarp();
  }
};

template <int D, int G>
__global__ void __launch_bounds__(kWarps * 32) zip_decode_kernel(LayerDesc L, AttendArgs a) {
  constexpr int C = D / 32;
  extern __shared__ __align__(16) float zsm[];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= static_cast<int64_t>(L.B) * a.nh * a.n_splits) return;  // whole warps only
  const int64_t T = L.T;
  float* qraw = zsm + warp * warp_floats(D, G, T);  // [D][G]
  float* qs = qraw + D * G;                          // [2][D][G]
  float* bias = qs + 2 * D * G;                      // [2][G]
  float* sc = bias + 2 * G;                          // [max(T, 32)][G]
  int* map = reinterpret_cast<int*>(sc + (T > kWinTile ? T : kWinTile) * G);
  const int64_t split = item % a.n_splits, bh = item / a.n_splits;
  const int64_t hh = bh % a.nh, b = bh / a.nh, h = a.h0 + hh, s = b * L.H + h;
  const int64_t boundary = zip_boundary(L), n_blk = boundary / T;
  const int64_t n_tiles = zip_tiles(L, boundary);
  const int64_t tile0 = split * a.split_tiles, tile1 = imin(n_tiles, tile0 + a.split_tiles);

  for (int d = lane; d < D; d += 32)
#pragma unroll
    for (int g = 0; g < G; ++g)
      qraw[d * G + g] =
          g < L.group ? load_elem(a.q.data, a.q.dtype, offset_of(a.q, b, h * L.group + g, 0, d)) *
                            a.scale_log2
                      : 0.0f;
  Softmax<D, G> st;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    st.m[g] = -INFINITY;
    st.l[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < C; ++i) st.acc[g][i] = 0.0f;
  }
  const int c0 = lane * C;
  const int n_h = static_cast<int>(L.n_h), n_l = static_cast<int>(T - L.n_h);
  const bool uniform = L.zvalues == 0;
  const int grp = static_cast<int>(c0 / L.vgroup);
  __syncwarp();

  for (int64_t tile = tile0; tile < tile1; ++tile) {
    if (tile < n_blk) {
      const uint8_t* kr = L.blocks[tile].k + s * L.zkrec;
      const uint8_t* vr = L.blocks[tile].v + s * L.zvrec;
      // 1. The mask: map[key row's slot] = its token (hi rows first, then lo rows).
      int hi_before = 0;
      for (int t0 = 0; t0 < T; t0 += 32) {
        const int tt = t0 + lane;
        const bool hi = tt < T && ((kr[tt >> 3] >> (tt & 7)) & 1u);
        const uint32_t bal = __ballot_sync(0xffffffffu, hi);
        const int before = hi_before + __popc(bal & ((1u << lane) - 1u));
        if (tt < T) map[hi ? before : n_h + (tt - before)] = tt;
        hi_before += __popc(bal);
      }
      // 2. The query folded into each subset's pairs.
      const uint8_t* kp = kr + L.zmask + L.zkhi + L.zklo;
      float bh_[G], bl_[G];
#pragma unroll
      for (int g = 0; g < G; ++g) bh_[g] = bl_[g] = 0.0f;
      const float ratio = L.zshared ? zip_hi_ratio(L) : 1.0f;
      for (int d = lane; d < D; d += 32) {
        float sh_, zh, sl, zl;
        if (L.zshared) {
          load_params(kp + 4 * d, sl, zl);
          sh_ = sl * ratio, zh = zl;
        } else {
          sh_ = zh = sl = zl = 0.0f;
          if (n_h > 0) load_params(kp + 4 * d, sh_, zh);
          if (n_l > 0) load_params(kp + 4 * (n_h > 0 ? D : 0) + 4 * d, sl, zl);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
          const float q = qraw[d * G + g];
          qs[d * G + g] = q * sh_;
          qs[D * G + d * G + g] = q * sl;
          bh_[g] = fmaf(q, zh, bh_[g]);
          bl_[g] = fmaf(q, zl, bl_[g]);
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float x = warp_sum(bh_[g]), y = warp_sum(bl_[g]);
        if (lane == 0) bias[g] = x, bias[G + g] = y;
      }
      __syncwarp();
      // 3. Scores into value-slot order, one subset (one width) at a time.
      for (int sub = 0; sub < 2; ++sub) {
        const uint8_t* codes = kr + L.zmask + (sub ? L.zkhi : 0);
        const int n = sub ? n_l : n_h, slot0 = sub ? n_h : 0;
        with_bits(sub ? L.lo_bits : L.hi_bits, [&]<int BITS>() {
          key_scores<D, G, BITS>(codes, n, slot0, qs + sub * D * G, bias + sub * G, map, uniform,
                                 sc, lane);
        });
      }
      // 4. Softmax.
      st.step(sc, static_cast<int>(T), lane);
      // 5. P.V in stored order.
      const bool cst = L.zvalues == 2;
      const uint8_t* cd = vr + L.zvcodes + L.zvparams + 2 * c0;  // the lane's channel divisors
      float div[C];
#pragma unroll
      for (int i = 0; i < C; ++i)
        div[i] = cst ? f16_val(static_cast<uint16_t>(cd[2 * i] | (cd[2 * i + 1] << 8))) : 1.0f;
      // Uniform values: one pass of T rows at hi bits in position order; routed and cst: the
      // hi rows, then the lo rows.
      for (int sub = 0; sub < (uniform ? 1 : 2); ++sub) {
        const int n = uniform ? static_cast<int>(T) : sub ? n_l : n_h, slot0 = sub ? n_h : 0;
        const uint8_t* codes = vr + (sub ? L.zvhi : 0);
        const uint8_t* pairs = vr + L.zvcodes + static_cast<int64_t>(slot0) * L.ng * 4;
        with_bits(sub ? L.lo_bits : L.hi_bits, [&]<int BITS>() {
          value_rows<D, G, BITS>(codes, pairs, L.ng, grp, n, slot0, sc, cst, div, st.acc, lane);
        });
      }
      __syncwarp();  // sc and map are rewritten by the next tile
    } else {
      // A window tile: tokens [j0, j0 + n), exact from their pages.
      const int64_t j0 = boundary + (tile - n_blk) * kWinTile;
      const int n = static_cast<int>(imin(kWinTile, L.offset - j0));
      if (lane < n) {
        const uint16_t* row = page_row(L, true, s, j0 + lane);
        float acc[G];
#pragma unroll
        for (int g = 0; g < G; ++g) acc[g] = 0.0f;
#pragma unroll 4
        for (int d0 = 0; d0 < D; d0 += 8) {
          const uint4 u = *reinterpret_cast<const uint4*>(row + d0);
          const uint16_t* hv = reinterpret_cast<const uint16_t*>(&u);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float k = window_to_f32(hv[e], L.bf16_window);
            float q[G];
            load_g<G>(qraw + (d0 + e) * G, q);
#pragma unroll
            for (int g = 0; g < G; ++g) acc[g] = fmaf(q[g], k, acc[g]);
          }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) sc[lane * G + g] = acc[g];
      }
      st.step(sc, n, lane);
      for (int j = 0; j < n; ++j) {
        const uint16_t* row = page_row(L, false, s, j0 + j) + c0;
        float pj[G];
        load_g<G>(sc + j * G, pj);
#pragma unroll
        for (int i = 0; i < C; ++i) {
          const float v = window_to_f32(row[i], L.bf16_window);
#pragma unroll
          for (int g = 0; g < G; ++g) st.acc[g][i] = fmaf(pj[g], v, st.acc[g][i]);
        }
      }
      __syncwarp();
    }
  }
  // The partials of the group's real query heads (rows (b * nh + hh) * group + g, Tq = 1).
  for (int g = 0; g < L.group && g < G; ++g) {
    const int64_t row = (b * a.nh + hh) * L.group + g;
    float* out = a.part_acc + (row * a.n_splits + split) * D;
#pragma unroll
    for (int i = 0; i < C; ++i) out[c0 + i] = st.acc[g][i];
    if (lane == 0) {
      a.part_ml[(row * a.n_splits + split) * 2] = st.m[g];
      a.part_ml[(row * a.n_splits + split) * 2 + 1] = st.l[g];
    }
  }
}

int g_tier(int group) { return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8; }

template <typename F>
auto dispatch(const LayerDesc& L, F&& f) {
  const int gt = g_tier(L.group);
  if (L.D == 64) {
    if (gt == 1) return f.template operator()<64, 1>();
    if (gt == 2) return f.template operator()<64, 2>();
    if (gt == 4) return f.template operator()<64, 4>();
    return f.template operator()<64, 8>();
  }
  if (gt == 1) return f.template operator()<128, 1>();
  if (gt == 2) return f.template operator()<128, 2>();
  if (gt == 4) return f.template operator()<128, 4>();
  return f.template operator()<128, 8>();
}

size_t smem_bytes(const LayerDesc& L) {
  return static_cast<size_t>(kWarps * warp_floats(L.D, g_tier(L.group), L.T)) * 4;
}

template <int D, int G>
void raise_smem() {
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(zip_decode_kernel<D, G>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   static_cast<int>(kWarps * warp_floats(D, G, kMaxT) * 4)) ==
              cudaSuccess);
    return true;
  }();
  (void)raised;
}

}  // namespace

bool zip_decode_supported(const LayerDesc& L, int Tq) {
  if (Tq != 1 || !L.zip || (L.D != 64 && L.D != 128) || L.group < 1 || L.group > 8) return false;
  if (L.T > kMaxT || L.P < 1) return false;
  // Codes are read as 32-bit words and pairs as one: every record part starts on 4 bytes.
  const int C = L.D / 32;
  if (L.vgroup % C != 0) return false;  // a lane's channels share one value pair
  return L.zkrec % 4 == 0 && L.zmask % 4 == 0 && L.zkhi % 4 == 0 && L.zklo % 4 == 0 &&
         L.zvrec % 4 == 0 && L.zvhi % 4 == 0 && L.zvcodes % 4 == 0 && L.zvparams % 4 == 0;
}

int64_t zip_resident_warps(const LayerDesc& L) {
  return dispatch(L, [&]<int D, int G>() -> int64_t {
    raise_smem<D, G>();
    int blocks = 0, dev = 0, sms = 0;
    KVQ_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, zip_decode_kernel<D, G>,
                                                            kWarps * 32, smem_bytes(L)) ==
              cudaSuccess);
    KVQ_CHECK(cudaGetDevice(&dev) == cudaSuccess);
    KVQ_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess);
    return static_cast<int64_t>(std::max(blocks, 1)) * kWarps * sms;
  });
}

int64_t zip_decode_tiles(const LayerDesc& L) { return zip_tiles(L, zip_boundary(L)); }

void attend_zip(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  dispatch(L, [&]<int D, int G>() {
    raise_smem<D, G>();
    const int64_t warps = static_cast<int64_t>(L.B) * a.nh * a.n_splits;
    zip_decode_kernel<D, G><<<static_cast<unsigned>((warps + kWarps - 1) / kWarps), kWarps * 32,
                              smem_bytes(L), st>>>(L, a);
    KVQ_CHECK(cudaGetLastError() == cudaSuccess);
  });
}

}  // namespace kvq::cuda
