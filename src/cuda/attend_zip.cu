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
// That is the fp32 variant (any width 1-8, any value mode); a tensor-core variant below takes
// cst and routed values at widths 2, 4 and 8 (ZipCache's defaults among them), 1.6x faster.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cfloat>
#include <cmath>

#include "cache/seal_rules.h"
#include "cuda/cuda_util.h"
#include "cuda/device_common.cuh"
#include "cuda/mma_codes.cuh"
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
  const TileRange range = split_tile_range(split, a.split_units, a.window_cost, n_blk, n_tiles);
  const int64_t tile0 = range.begin, tile1 = range.end;

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
          load_params_aligned(kp + 4 * d, sl, zl);
          sh_ = sl * ratio, zh = zl;
        } else {
          sh_ = zh = sl = zl = 0.0f;
          if (n_h > 0) load_params_aligned(kp + 4 * d, sh_, zh);
          if (n_l > 0) load_params_aligned(kp + 4 * (n_h > 0 ? D : 0) + 4 * d, sl, zl);
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

// ---- The tensor-core variant (cst and routed values, widths 2, 4 and 8) ----
//
// ZipCache's keys and values in subset order are two KIVI-like planes per block: the hi rows
// (n_h of them, hi_bits wide) and the lo rows, each with per-channel key pairs and per-token
// value pairs. For each subset the warp folds the query into the key pairs once, in fp32
// (A = q * scale_d split into fp16 hi and lo rows, exact to ~2^-22; bias = sum_d q_d zero_d minus
// the magic numbers' share), so the key operand is the raw codes as M + c (exact in fp16) and the
// scores lose nothing to fp16 but the query's second rounding. Then 16 rows at a time: S = Q K^T
// on the tensor cores (mma.sync m16n8k16; A rows 0-7 the group's query heads, rows 8-15 what
// their fp16 rounding lost; a lane's key chunk is D/4 channels in the permuted order of
// attend_fast.cu, which lets one shift and mask turn a word into half2 pairs), the online
// softmax, and O += P V with the values dequantized in fp16 (one rounding; cst: times the
// channel divisor, a second one). Padding rows past a subset's end read its last row and get
// probability 0. The window runs through the same operands from its fp16 pages.
// Each sealed block's records (this stream's keys past the mask, its values) are copied into one
// of the warp's two shared-memory stages with cp.async while the block before is computed on, so
// the loads of a block's 16-row slices wait on shared memory, not on HBM.
template <int D, int B>
struct ZCfg {
  static constexpr int kW = 32 / B;        // codes per 32-bit word
  static constexpr int kHalf = kW / 2;     // half2 pairs per word
  static constexpr int kRow = D * B / 8;   // bytes of one row of codes
  static constexpr int kLaneK = kRow / 4;  // a lane's key chunk (D/4 channels), bytes
  static constexpr int kWordsK = kLaneK / 4;
  static constexpr int kLaneV = kRow / 8;  // a lane's value chunk (D/8 channels), bytes
  static constexpr int kWordsV = (kLaneV + 3) / 4;
  static constexpr int kPiecesV = kLaneV / 2;  // 16-bit pieces of the value chunk
  static constexpr int kCodesPerPiece = 16 / B;
  static constexpr int kSlices = D / 16;
  // Chunk channels of half2 pair m: (dim_a(m), dim_a(m) + kHalf); slice sl takes pairs 2sl, 2sl+1.
  __host__ __device__ static constexpr int dim_a(int m) { return (m / kHalf) * kW + m % kHalf; }
};

template <int D>
struct ZState {
  float o[D / 8][4];  // n-tile tau, columns 2t, 2t + 1: channels (2t + e) * D/8 + tau; rows g, g + 8
  float m, l;         // per query head g (l: this lane's share until the end)
};

__device__ __forceinline__ uint32_t pack_h2(__half lo, __half hi) {
  return h2_as_u32(__halves2half2(lo, hi));
}

// The exponent e >= 0 that brings a head's largest |x| below 2^14 (fp16's range with room for
// the hi/lo split): 0 for ordinary values, so the fold is then exactly as if unscaled.
__device__ __forceinline__ int fold_exponent(float mx) {
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));  // over the head's four lanes
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  return mx >= 16384.0f && mx <= FLT_MAX ? ilogbf(mx) - 13 : 0;
}

// One pass of the fold with the query scaled by `down` (a power of two): this lane's A fragments
// into afs, its shares of sum_d q_d zero_d (acc) and of the magic numbers' term (accm); returns
// the lane's largest |x|. qg: the lane's query channels, qg[32 k] = channel t D/4 + k.
template <int D, int B>
__device__ __forceinline__ float fold_pass(const float* qg, const uint8_t* kp, float ratio,
                                           float down, uint4* afs, float& acc, float& accm,
                                           int lane) {
  const int t = lane & 3;
  using C = ZCfg<D, B>;
  const int base = t * (D / 4);
  float mx = 0.0f;
  acc = accm = 0.0f;
#pragma unroll
  for (int sl = 0; sl < C::kSlices; ++sl) {
    uint32_t af[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = 2 * sl + h, p = B * (m % C::kHalf), pl = p + land_fold<B>(p);
      const float M = static_cast<float>(1 << (10 - pl));
      const int d0 = base + C::dim_a(m), d1 = d0 + C::kHalf;
      // {scale, zero} of d0 and d1 from the stage (shared memory), one 32-bit word each.
      const uint32_t p0 = lds32(kp + 4 * d0), p1 = lds32(kp + 4 * d1);
      const float s0 = f16_val(static_cast<uint16_t>(p0)), z0 = f16_val(static_cast<uint16_t>(p0 >> 16));
      const float s1 = f16_val(static_cast<uint16_t>(p1)), z1 = f16_val(static_cast<uint16_t>(p1 >> 16));
      const float q0 = qg[32 * C::dim_a(m)], q1 = qg[32 * (C::dim_a(m) + C::kHalf)];
      const float x0 = q0 * (s0 * ratio) * down, x1 = q1 * (s1 * ratio) * down;
      mx = fmaxf(mx, fmaxf(fabsf(x0), fabsf(x1)));
      const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
      const __half l0 = __float2half_rn(x0 - __half2float(h0));
      const __half l1 = __float2half_rn(x1 - __half2float(h1));
      af[2 * h] = pack_h2(h0, h1);      // row g: columns of pair m
      af[2 * h + 1] = pack_h2(l0, l1);  // row g + 8
      acc = fmaf(q0, z0, acc);
      acc = fmaf(q1, z1, acc);
      accm += M * ((__half2float(h0) + __half2float(l0)) + (__half2float(h1) + __half2float(l1)));
    }
    afs[sl * 32 + lane] = make_uint4(af[0], af[1], af[2], af[3]);
  }
  return mx;
}

// A subset's query fragments (afs[slice * 32 + lane]) and score terms: a score is
// (A K^T) * up + bias, every lane of head g holding that head's up and bias. A = q_d * scale_d
// * 2^-e split into fp16 hi and lo rows (scaled by a power of two, exactly, so that a large query
// against a wide key range stays finite in fp16; up = 2^e). The fold runs unscaled; a second,
// scaled pass only where a head of the warp needs it (never for ordinary values: one vote).
template <int D, int B>
__device__ __forceinline__ void fold_query(const float* qg, const uint8_t* kp, float ratio,
                                           uint4* afs, float& bias, float& up, int lane) {
  float acc, accm;
  const int e = fold_exponent(fold_pass<D, B>(qg, kp, ratio, 1.0f, afs, acc, accm, lane));
  if (__any_sync(0xffffffffu, e != 0))
    fold_pass<D, B>(qg, kp, ratio, ldexpf(1.0f, -e), afs, acc, accm, lane);
  acc += __shfl_xor_sync(0xffffffffu, acc, 1);
  acc += __shfl_xor_sync(0xffffffffu, acc, 2);
  accm += __shfl_xor_sync(0xffffffffu, accm, 1);
  accm += __shfl_xor_sync(0xffffffffu, accm, 2);
  up = ldexpf(1.0f, e);
  bias = acc - accm * up;
}

// The raw query (scaled by `down`) as the window's A fragments in afs, in the chunk's channel
// order (see window_slice); returns the lane's largest |x|.
template <int D>
__device__ __forceinline__ float raw_query_pass(const float* qg, float down, uint4* afs, int lane) {
  float mx = 0.0f;
#pragma unroll
  for (int sl = 0; sl < D / 16; ++sl) {
    uint32_t ar[4];
#pragma unroll
    for (int hpair = 0; hpair < 2; ++hpair) {
      const int k0 = 4 * sl + 2 * hpair;  // channel t * D/4 + k0 and the next
      const float x0 = qg[32 * k0] * down, x1 = qg[32 * (k0 + 1)] * down;
      mx = fmaxf(mx, fmaxf(fabsf(x0), fabsf(x1)));
      const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
      ar[2 * hpair] = pack_h2(h0, h1);
      ar[2 * hpair + 1] = pack_h2(__float2half_rn(x0 - __half2float(h0)),
                                  __float2half_rn(x1 - __half2float(h1)));
    }
    afs[sl * 32 + lane] = make_uint4(ar[0], ar[1], ar[2], ar[3]);
  }
  return mx;
}

// Scores of 8 key rows (this lane: row `row`, B operand column g) added to sc.
template <int D, int B>
__device__ __forceinline__ void key_ntile(const uint8_t* codes, int row, const uint4* afs,
                                          float (&sc)[4], int lane) {
  const int t = lane & 3;
  using C = ZCfg<D, B>;
  const uint32_t* w =
      reinterpret_cast<const uint32_t*>(codes + static_cast<size_t>(row) * C::kRow + t * C::kLaneK);
  uint32_t x[C::kWordsK];
#pragma unroll
  for (int i = 0; i < C::kWordsK; ++i) x[i] = w[i];
#pragma unroll
  for (int sl = 0; sl < C::kSlices; ++sl) {
    const int m0 = 2 * sl, m1 = 2 * sl + 1;
    const int p0 = B * (m0 % C::kHalf), p1 = B * (m1 % C::kHalf);
    const uint32_t xw = x[m0 / C::kHalf];  // m1 is in the same word (kHalf is even)
    const uint4 a4 = afs[sl * 32 + lane];
    const uint32_t af[4] = {a4.x, a4.y, a4.z, a4.w};
    mma16816(sc, af, codes_at<B>(xw, p0, land_fold<B>(p0)),
             codes_at<B>(xw, p1, land_fold<B>(p1)));
  }
}

// Scores -> probabilities for 16 rows (two n-tiles), rescaling the accumulators; the P
// fragments of the k-slice (hi rows, lo rows).
template <int D>
__device__ __forceinline__ void slice_softmax(ZState<D>& w, const float (&sc)[2][4], float up,
                                              float bias, const bool (&valid)[4],
                                              uint32_t (&pa)[4]) {
  float s[2][2];
  float mx = -INFINITY;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s[n][e] = valid[2 * n + e] ? fmaf(sc[n][e] + sc[n][e + 2], up, bias) : -INFINITY;
      mx = fmaxf(mx, s[n][e]);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(w.m, mx);  // finite: every slice has a valid row
  const float corr = fast_exp2(w.m - m_new);
  float p[2][2], sum = 0.0f;
#pragma unroll
  for (int n = 0; n < 2; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      p[n][e] = valid[2 * n + e] ? fast_exp2(s[n][e] - m_new) : 0.0f;
      sum += p[n][e];
    }
  w.l = w.l * corr + sum;
  if (__any_sync(0xffffffffu, m_new != w.m)) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) w.o[i][e] *= corr;
  }
  w.m = m_new;
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    const __half2 hi = __floats2half2_rn(p[n][0], p[n][1]);
    const float2 back = __half22float2(hi);
    pa[2 * n] = h2_as_u32(hi);
    pa[2 * n + 1] = h2_as_u32(__floats2half2_rn(p[n][0] - back.x, p[n][1] - back.y));
  }
}

// O += P V over 16 value rows r0 .. r0 + 15 of a subset of n rows (this lane: rows r0 + 2t,
// + 1, + 8, + 9, channels g * D/8 ...; pairs [rows][ng] {scale, zero} fp16).
template <int D, int B>
struct VRows {
  uint32_t u[4][ZCfg<D, B>::kWordsV], q[4];  // 4 rows' code chunks and {scale, zero} pairs
};
template <int D, int B>
__device__ __forceinline__ void value_load(VRows<D, B>& v, const uint8_t* codes,
                                           const uint8_t* pairs, int64_t ng, int grp, int r0,
                                           int n, int g, int t) {
  using C = ZCfg<D, B>;
  auto& u = v.u;
  auto& q = v.q;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = min(r0 + 2 * t + (r & 1) + (r >> 1) * 8, n - 1);
    const uint8_t* vc = codes + static_cast<size_t>(j) * C::kRow + g * C::kLaneV;
#pragma unroll
    for (int x = 0; x < C::kWordsV; ++x) {
      if constexpr (C::kLaneV >= 4) {
        u[r][x] = reinterpret_cast<const uint32_t*>(vc)[x];
      } else {
        u[r][x] = *reinterpret_cast<const uint16_t*>(vc);
      }
    }
    q[r] = *reinterpret_cast<const uint32_t*>(pairs + (static_cast<int64_t>(j) * ng + grp) * 4);
  }
}
template <int D, int B>
__device__ __forceinline__ void value_mma(ZState<D>& w, const VRows<D, B>& v,
                                          const uint32_t (&pa)[4], bool cst,
                                          const uint32_t (&div)[D / 16]) {
  using C = ZCfg<D, B>;
  const auto& u = v.u;
  const auto& q = v.q;
  // Halved values: codes halved in dequant2_half, zeros here (the output is doubled).
  const uint32_t sA = prmt(q[0], q[1], 0x5410), zA = half_f16x2(prmt(q[0], q[1], 0x7632));
  const uint32_t sB = prmt(q[2], q[3], 0x5410), zB = half_f16x2(prmt(q[2], q[3], 0x7632));
#pragma unroll
  for (int pc = 0; pc < C::kPiecesV; ++pc) {
    const uint32_t sel = (pc & 1) ? 0x7632 : 0x5410;
    const uint32_t cA = prmt(u[0][pc / 2], u[1][pc / 2], sel);
    const uint32_t cB = prmt(u[2][pc / 2], u[3][pc / 2], sel);
#pragma unroll
    for (int i = 0; i < C::kCodesPerPiece; ++i) {
      const int tau = pc * C::kCodesPerPiece + i, p = B * i, sh = land_exact<B>(p);
      const uint32_t mg = magic_at(p + sh);
      uint32_t b0 = dequant2_half(codes_at<B>(cA, p, sh), mg, sA, zA);
      uint32_t b1 = dequant2_half(codes_at<B>(cB, p, sh), mg, sB, zB);
      if (cst) {  // channel tau's divisor in both halves
        const uint32_t d2 = prmt(div[tau / 2], 0, (tau & 1) ? 0x3232 : 0x1010);
        b0 = h2_as_u32(__hmul2(u32_as_h2(b0), u32_as_h2(d2)));
        b1 = h2_as_u32(__hmul2(u32_as_h2(b1), u32_as_h2(d2)));
      }
      mma16816(w.o[tau], pa, b0, b1);
    }
  }
}

// One subset of a sealed block: n rows of B-bit codes, slot0 its first value slot.
template <int D, int B>
__device__ __forceinline__ void zip_subset(ZState<D>& w, const float* qg, uint4* afs,
                                           const uint8_t* kp, float ratio, const uint8_t* kcodes,
                                           const uint8_t* vcodes, const uint8_t* pairs, int64_t ng,
                                           int grp, int n, bool cst, const uint32_t (&div)[D / 16],
                                           int lane) {
  if (n == 0) return;
  const int g = lane >> 2, t = lane & 3;
  float bias, up;
  fold_query<D, B>(qg, kp, ratio, afs, bias, up, lane);
  for (int r0 = 0; r0 < n; r0 += 16) {
    // The slice's value rows are fetched first, in flight while the scores are computed.
    VRows<D, B> v;
    value_load<D, B>(v, vcodes, pairs, ng, grp, r0, n, g, t);
    float sc[2][4] = {};
    bool valid[4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      key_ntile<D, B>(kcodes, min(r0 + 8 * nt + g, n - 1), afs, sc[nt], lane);
#pragma unroll
      for (int e = 0; e < 2; ++e) valid[2 * nt + e] = r0 + 8 * nt + 2 * t + e < n;
    }
    uint32_t pa[4];
    slice_softmax<D>(w, sc, up, bias, valid, pa);
    value_mma<D, B>(w, v, pa, cst, div);
  }
}

// 16 window tokens from j0 (those at or past `offset` masked), exact from their pages. The key
// operand's channel order here is the chunk's own: k columns 2t, 2t + 1 of slice sl are chunk
// channels 4sl, 4sl + 1, columns 2t + 8, 2t + 9 are 4sl + 2, 4sl + 3 (the raw query's A rows alike).
template <int D>
__device__ __forceinline__ void window_slice(ZState<D>& w, const LayerDesc& L, int64_t s, int64_t j0,
                                             const uint4* afs, float up, int g, int t) {
  const int lane = 4 * g + t;
  float sc[2][4] = {};
  bool valid[4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int64_t tok = j0 + 8 * nt + g;
    uint32_t u[D / 8];  // chunk channels t * D/4 ..., two per word
    window_words<D / 8>(L, true, s, tok, t * (D / 4), u);
#pragma unroll
    for (int sl = 0; sl < D / 16; ++sl) {
      const uint4 a4 = afs[sl * 32 + lane];
      const uint32_t af[4] = {a4.x, a4.y, a4.z, a4.w};
      mma16816(sc[nt], af, u[2 * sl], u[2 * sl + 1]);
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) valid[2 * nt + e] = j0 + 8 * nt + 2 * t + e < L.offset;
  }
  uint32_t pa[4];
  slice_softmax<D>(w, sc, up, 0.0f, valid, pa);
  // Halved probabilities, as the packed rows' halved values (half_f16x2; the output is doubled).
#pragma unroll
  for (int i = 0; i < 4; ++i) pa[i] = half_f16x2(pa[i]);
  uint32_t u[4][D / 16];  // 4 tokens x this lane's D/8 channels (2 per word)
  window_value_rows<D>(L, s, j0, g, t, u);
#pragma unroll
  for (int tau = 0; tau < D / 8; ++tau) {
    const uint32_t sel = (tau & 1) ? 0x7632 : 0x5410;
    mma16816(w.o[tau], pa, prmt(u[0][tau / 2], u[1][tau / 2], sel),
             prmt(u[2][tau / 2], u[3][tau / 2], sel));
  }
}

// A sealed block's stage (per warp, two of them: one computed on while the next block's copy is
// in flight): this stream's key record past its mask, then its value record, each copied with
// copy_span_warp. Stage bytes for a layer (a multiple of 16):
__host__ __device__ inline int64_t zip_stage_bytes(const LayerDesc& L) {
  return span_capacity(L.zkrec - L.zmask) + span_capacity(L.zvrec);
}

template <int D, int BH, int BL>
__global__ void __launch_bounds__(kWarps * 32, D >= 128 ? 2 : 4) zip_tc_kernel(LayerDesc L, AttendArgs a) {
  extern __shared__ __align__(16) float zsm[];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= static_cast<int64_t>(L.B) * a.nh * a.n_splits) return;  // whole warps only
  const int g = lane >> 2, t = lane & 3;
  const int64_t split = item % a.n_splits, bh = item / a.n_splits;
  const int64_t hh = bh % a.nh, b = bh / a.nh, h = a.h0 + hh, s = b * L.H + h;
  const int64_t T = L.T, boundary = zip_boundary(L), n_blk = boundary / T;
  const int64_t n_tiles = zip_tiles(L, boundary);
  const TileRange range = split_tile_range(split, a.split_units, a.window_cost, n_blk, n_tiles);
  const int64_t tile0 = range.begin, tile1 = range.end;
  // The query times scale * log2 e, 0 past the group: lane (g, t) reads only head g's channels
  // t D/4 ... of it, held as [D/4][32 lanes] (qg[32 k] is channel t D/4 + k), so that the lanes'
  // reads of one channel index fall in 32 banks (a [head][D] layout put all of them in one).
  float* qw = zsm + warp * 16 * D;
  uint4* afs = reinterpret_cast<uint4*>(qw + 8 * D);  // [D/16 slices][32 lanes]: a subset's A
  for (int k = 0; k < D / 4; ++k)
    qw[32 * k + lane] =
        g < L.group ? load_elem(a.q.data, a.q.dtype, offset_of(a.q, b, h * L.group + g, 0, t * (D / 4) + k)) *
                          a.scale_log2
                    : 0.0f;
  __syncwarp();
  const float* qg = qw + lane;
  ZState<D> w;
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) w.o[i][e] = 0.0f;
  w.m = -INFINITY;
  w.l = 0.0f;
  const int n_h = static_cast<int>(L.n_h), n_l = static_cast<int>(T - L.n_h);
  const bool cst = L.zvalues == 2;
  const int grp = static_cast<int>(g * (D / 8) / L.vgroup);
  const float ratio = L.zshared ? zip_hi_ratio(L) : 1.0f;

  // Sealed blocks [tile0, ps1) through the warp's two stages: block i + 1's copy is issued
  // before block i is computed on.
  const int64_t ps1 = imin(tile1, n_blk);
  const int nb = static_cast<int>(imax(ps1 - tile0, 0));
  const int64_t kbytes = L.zkrec - L.zmask, kcap = span_capacity(kbytes);
  const int64_t stage_bytes = zip_stage_bytes(L);
  uint8_t* stages = reinterpret_cast<uint8_t*>(zsm + kWarps * 16 * D) + warp * 2 * stage_bytes;
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(stages));
  // Copies block tile0 + i into stage i & 1; the offsets of its key and value data in the stage.
  auto issue = [&](int i, int& koff, int& voff) {
    const PtrPair bp = L.blocks[tile0 + i];
    const uint32_t dst = stage0 + static_cast<uint32_t>((i & 1) * stage_bytes);
    koff = copy_span_warp(dst, bp.k + s * L.zkrec + L.zmask, kbytes, lane);
    voff = static_cast<int>(kcap) + copy_span_warp(dst + static_cast<uint32_t>(kcap),
                                                   bp.v + s * L.zvrec, L.zvrec, lane);
  };
  int koff[2] = {0, 0}, voff[2] = {0, 0};
  if (nb > 0) issue(0, koff[0], voff[0]);
  cp_commit();
  for (int i = 0; i < nb; ++i) {
    cp_wait<0>();
    __syncwarp();  // every lane's copies of block i have landed; stage (i + 1) & 1 is free
    const int ko = (i & 1) ? koff[1] : koff[0], vo = (i & 1) ? voff[1] : voff[0];
    if (i + 1 < nb) {
      if (i & 1) issue(i + 1, koff[0], voff[0]);
      else issue(i + 1, koff[1], voff[1]);
    }
    cp_commit();
    const uint8_t* st = stages + (i & 1) * stage_bytes;
    const uint8_t* kd = st + ko;  // hi key codes, lo key codes, key pairs
    const uint8_t* vd = st + vo;  // the value record
    const uint8_t* kp = kd + L.zkhi + L.zklo;
    uint32_t div[D / 16];  // cst: this lane's D/8 channel divisors, two per word
    if (cst) {
      const uint32_t* cd =
          reinterpret_cast<const uint32_t*>(vd + L.zvcodes + L.zvparams + 2 * (g * (D / 8)));
#pragma unroll
      for (int j = 0; j < D / 16; ++j) div[j] = cd[j];
    } else {
#pragma unroll
      for (int j = 0; j < D / 16; ++j) div[j] = 0;
    }
    const uint8_t* pairs = vd + L.zvcodes;
    // hi rows: their own key pairs (or the shared ones at the hi step); lo rows after them.
    zip_subset<D, BH>(w, qg, afs, kp, ratio, kd, vd, pairs, L.ng, grp, n_h, cst, div, lane);
    const uint8_t* kpl = L.zshared ? kp : kp + (n_h > 0 ? 4 * D : 0);
    zip_subset<D, BL>(w, qg, afs, kpl, 1.0f, kd + L.zkhi, vd + L.zvhi,
                      pairs + static_cast<int64_t>(n_h) * L.ng * 4, L.ng, grp, n_l, cst, div,
                      lane);
  }
  cp_wait<0>();
  for (int64_t tile = imax(tile0, n_blk); tile < tile1; ++tile) {
    // The query itself as fp16 hi/lo rows in afs (bf16 queries may exceed fp16's range:
    // scaled by a power of two as in fold_query, in a second pass only where a head needs it).
    const int ex = fold_exponent(raw_query_pass<D>(qg, 1.0f, afs, lane));
    if (__any_sync(0xffffffffu, ex != 0)) raw_query_pass<D>(qg, ldexpf(1.0f, -ex), afs, lane);
    const float up = ldexpf(1.0f, ex);
    const int64_t j0 = boundary + (tile - n_blk) * kWinTile;
    window_slice<D>(w, L, s, j0, afs, up, g, t);
    if (j0 + 16 < L.offset) window_slice<D>(w, L, s, j0 + 16, afs, up, g, t);
  }
  // The partials of head g (rows (b * nh + hh) * group + g): o's hi and lo rows summed, l over
  // the head's four lanes.
  float l = w.l;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g < L.group) {
    const int64_t row = (b * a.nh + hh) * L.group + g;
    float* out = a.part_acc + (row * a.n_splits + split) * D;
#pragma unroll
    for (int tau = 0; tau < D / 8; ++tau) {
      out[(2 * t) * (D / 8) + tau] = 2.0f * (w.o[tau][0] + w.o[tau][2]);  // values were halved
      out[(2 * t + 1) * (D / 8) + tau] = 2.0f * (w.o[tau][1] + w.o[tau][3]);
    }
    if (t == 0) {
      a.part_ml[(row * a.n_splits + split) * 2] = w.m;
      a.part_ml[(row * a.n_splits + split) * 2 + 1] = l;
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

namespace {

// Shared memory of a tensor-core CTA: per warp the query and a subset's A fragments (16 D
// floats) and two block stages.
size_t tc_smem_bytes(const LayerDesc& L) {
  return static_cast<size_t>(kWarps) * (16 * L.D * 4 + 2 * zip_stage_bytes(L));
}

// The most dynamic shared memory a CTA may ask for on the current device.
size_t smem_optin() {
  int dev = 0, bytes = 0;
  KVQ_CHECK(cudaGetDevice(&dev) == cudaSuccess);
  KVQ_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) ==
            cudaSuccess);
  return static_cast<size_t>(bytes);
}

// The tensor-core variant takes cst and routed values (subset order, like the keys) at widths 2,
// 4 and 8, with each lane's D/8 value channels in one value group, and blocks whose two stages
// per warp fit in shared memory (at 4/2 bits up to 256 tokens at head_dim 64 and about 240 at
// 128); KVQ_CUDA_ZIP_CORES=1 keeps every layer on the fp32 kernel (benchmarks compare the two).
bool tc_supported(const LayerDesc& L) {
  static const bool cores = env_flag("KVQ_CUDA_ZIP_CORES");
  auto w = [](int64_t b) { return b == 2 || b == 4 || b == 8; };
  return !cores && L.zvalues != 0 && w(L.hi_bits) && w(L.lo_bits) && L.vgroup % (L.D / 8) == 0 &&
         tc_smem_bytes(L) <= smem_optin();
}

template <typename F>
void with_w(int64_t bits, F&& f) {
  if (bits == 2) f.template operator()<2>();
  else if (bits == 4) f.template operator()<4>();
  else f.template operator()<8>();
}

// f<D, BH, BL>() for the layer's variant, its shared-memory limit raised to the device's.
template <typename F>
void dispatch_tc(const LayerDesc& L, F&& f) {
  auto go = [&]<int D>() {
    with_w(L.hi_bits, [&]<int BH>() {
      with_w(L.lo_bits, [&]<int BL>() {
        static const bool raised = [] {
          KVQ_CHECK(cudaFuncSetAttribute(zip_tc_kernel<D, BH, BL>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem_optin())) == cudaSuccess);
          return true;
        }();
        (void)raised;
        f.template operator()<D, BH, BL>();
      });
    });
  };
  if (L.D == 64) go.template operator()<64>();
  else go.template operator()<128>();
}

}  // namespace

int64_t zip_resident_warps(const LayerDesc& L) {
  if (tc_supported(L)) {
    int blocks = 0, dev = 0, sms = 0;
    dispatch_tc(L, [&]<int D, int BH, int BL>() {
      KVQ_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, zip_tc_kernel<D, BH, BL>,
                                                              kWarps * 32, tc_smem_bytes(L)) ==
                cudaSuccess);
    });
    KVQ_CHECK(cudaGetDevice(&dev) == cudaSuccess);
    KVQ_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess);
    return static_cast<int64_t>(std::max(blocks, 1)) * kWarps * sms;
  }
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
int64_t zip_sealed_tiles(const LayerDesc& L) { return zip_boundary(L) / L.T; }

void attend_zip(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  const int64_t warps = static_cast<int64_t>(L.B) * a.nh * a.n_splits;
  if (tc_supported(L)) {
    dispatch_tc(L, [&]<int D, int BH, int BL>() {
      zip_tc_kernel<D, BH, BL><<<static_cast<unsigned>((warps + kWarps - 1) / kWarps),
                                 kWarps * 32, tc_smem_bytes(L), st>>>(L, a);
    });
    KVQ_CHECK(cudaGetLastError() == cudaSuccess);
    return;
  }
  dispatch(L, [&]<int D, int G>() {
    raise_smem<D, G>();
    zip_decode_kernel<D, G><<<static_cast<unsigned>((warps + kWarps - 1) / kWarps), kWarps * 32,
                              smem_bytes(L), st>>>(L, a);
    KVQ_CHECK(cudaGetLastError() == cudaSuccess);
  });
}

}  // namespace kvq::cuda
