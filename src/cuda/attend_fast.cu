// The fast decode kernel: one query per sequence (Tq = 1), split-K flash-decoding over packed
// KIVI codes with the dequantization inside tensor-core dot products (mma.sync m16n8k16, fp16
// operands, fp32 accumulation), the fp16 window in the same kernel.
//
// One warp owns one (batch row, KV head, split): a run of 32-token tiles. Keys and values are the
// MMAs' A operands and the group's query heads the B columns (8 per column block):
//
//   S^T = K Q^T : A = K [16 tokens, 16 dims] per k-slice, B = Q^T [16 dims, 8 columns]; the
//                 order of dims inside a k-slice is permuted (A and B alike) so that each 32-bit
//                 word of packed codes yields its half2 pairs with one shift and mask (codes i
//                 and i + W/2 of a word of W codes land in the two halves).
//   O^T = V^T P^T : A = V^T [16 dims, 16 tokens], two tokens' code words interleaved with one
//                 byte permute so that each half2 holds one dim of two tokens; B = P^T, made
//                 from the scores' accumulators (tokens x columns) by one register transpose
//                 (movmatrix) per 8 x 8 block.
//
// Column 2j of column block b is query head 4b + j rounded to fp16, column 2j + 1 what that
// rounding lost (q - fp16(q)), so the scores keep ~fp32 accuracy in the query and P: a group of up
// to 4 query heads fills one block, up to 8 two. Keys and values are dequantized into fp16
// registers (code * scale + zero with one fp16 rounding: the only error beyond the CPU
// reference's fp32, about 2^-11 of a value). Lane (g, t) does the softmax of query 4b + t over
// tokens g, g + 8 of each 16, and holds the output dims g D/8 + 2i (row g of m-tile i) and + 1
// (row g + 8).
//
// With the queries as A rows instead (an earlier kernel, replaced on Dec 7), a group of 4 filled
// 8 of the 16 rows: twice the score and P.V products, twice the output accumulators (at head_dim
// 128, KIVI 2 and 4 bits: 168 registers and 3 CTAs per SM against 128 and 4 here). Side by side on
// an H100 this kernel took 0.84-0.88x its time at 2 bits, group 4, and 1.02-1.11x at group 8,
// where the earlier one's rows were full (docs/cuda.md, "The transposed kernel").
//
// Sealed tiles stream through shared memory with cp.async (a few tiles in flight per warp);
// window tiles (the last few dozen tokens) are read straight from their pages.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cuda/device_common.cuh"
#include "cuda/kernels.h"
#include "cuda/mma_codes.cuh"
#include "kvq/status.h"

namespace kvq::cuda {

namespace {

// Warps per CTA (they share one split: kernels.h).
template <int D>
__host__ __device__ constexpr int warps_for() {
  return kFastWarps;
}
// Shared-memory stages per warp: tiles in flight while one is computed on. Deeper for the
// smaller 2-bit tiles (3 KiB at head_dim 128); wider codes get 2, so that more CTAs fit in
// shared memory at 4 bits (shared memory, not min_blocks, then sets the CTAs per SM where the
// two are at odds: XQuant reuse layers with a residual at head_dim 128).
template <int KB, int XQ>
__host__ __device__ constexpr int stages_for() {
  return XQ == 2 ? 2 : KB <= 2 ? 4 : 2;  // a two-plane stage (XQ 2) is twice as large
}
// CTAs per SM that __launch_bounds__ asks registers for: 4 (128 registers) for one column block
// of KIVI codes (ptxas, nvcc 13: no spills); 3 for XQuant reuse layers with one column block and
// for two column blocks at head_dim 64 without a residual; 2 for two column blocks otherwise and
// at 8 bits, head_dim 128, where shared memory holds no more (2 stages of 9 KiB per warp).
template <int D, int NQB, int KB, int XQ>
__host__ __device__ constexpr int min_blocks() {
  if constexpr (D == 128 && KB == 8) return 2;
  if constexpr (NQB == 1) return XQ == 0 ? 4 : 3;
  return D == 128 || XQ == 2 ? 2 : 3;
}
constexpr int kTile = 32;

// One warp copies `bytes` (at most MAX, a compile-time bound) from src to dst in 16-byte pieces;
// dst and src already point at this lane's first piece (+ 16 * lane), so the pieces of one lane
// are constant offsets of one address (no per-piece address arithmetic).
template <int MAX>
__device__ __forceinline__ void copy_warp(uint32_t dst, const uint8_t* src, int bytes, int lane) {
#pragma unroll
  for (int c = 0; c < (MAX + 511) / 512; ++c)
    if ((MAX % 512 == 0 && MAX == bytes) || c * 512 + lane * 16 < bytes) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + c * 512),
                   "l"(src + c * 512));
    }
}

template <int D, int KB, int VB>
struct Cfg {
  static constexpr int kW = 32 / KB;        // key codes per 32-bit word
  static constexpr int kHalf = kW / 2;      // half2 pairs per word
  static constexpr int kRowK = D * KB / 8;  // bytes of one token's key codes
  static constexpr int kRowV = D * VB / 8;
  static constexpr int kLaneK = kRowK / 4;  // a lane's key chunk (D/4 dims), bytes
  static constexpr int kLaneV = kRowV / 8;  // a lane's value chunk (D/8 dims), bytes
  static constexpr int kWordsV = (kLaneV + 3) / 4;
  static constexpr int kPiecesV = kLaneV / 2;  // 16-bit pieces of the value chunk
  static constexpr int kCodesPerPiece = 16 / VB;
  static constexpr int kSlices = D / 16;  // k-slices of S^T = K Q^T
  static constexpr int kOffKP =
      kTile * kRowK;  // stage layout: K codes, K params, V codes, V params
  static constexpr int kOffVC = kOffKP + D * 4;
  static constexpr int kOffVP = kOffVC + kTile * kRowV;
  // Local dims (inside the lane's key chunk) of half2 pair m: (dim_a(m), dim_a(m) + kHalf).
  __device__ static constexpr int dim_a(int m) { return (m / kHalf) * kW + m % kHalf; }
};

// A value plane's words for tokens j0 + (r & 1) + 8 (r >> 1), r = 0..3, from a stage: lane g's
// codes (u[r]), and the {scale, zero / 2} pairs of tokens j0, j0 + 1 (sA, zA) and j0 + 8, j0 + 9
// (sB, zB) for its value group, as half2. Halved values: the codes are halved in dequant2_half,
// the zeros here (the output is doubled).
template <int D, int KB, int VB>
__device__ __forceinline__ void value_words(const uint8_t* st, int j0, int64_t ng, int vgroup_lane,
                                            int g, uint32_t (&u)[4][Cfg<D, KB, VB>::kWordsV],
                                            uint32_t& sA, uint32_t& zA, uint32_t& sB,
                                            uint32_t& zB) {
  using C = Cfg<D, KB, VB>;
  const uint8_t* vc = st + C::kOffVC + g * C::kLaneV;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int j = j0 + (r & 1) + (r >> 1) * 8;
#pragma unroll
    for (int x = 0; x < C::kWordsV; ++x) {
      if constexpr (C::kLaneV >= 4) {
        u[r][x] = lds32(vc + j * C::kRowV + 4 * x);
      } else {
        u[r][x] = *reinterpret_cast<const uint16_t*>(vc + j * C::kRowV);
      }
    }
  }
  const uint8_t* vp = st + C::kOffVP;
  const uint32_t q0 = lds32(vp + (j0 * ng + vgroup_lane) * 4);
  const uint32_t q1 = lds32(vp + ((j0 + 1) * ng + vgroup_lane) * 4);
  const uint32_t q8 = lds32(vp + ((j0 + 8) * ng + vgroup_lane) * 4);
  const uint32_t q9 = lds32(vp + ((j0 + 9) * ng + vgroup_lane) * 4);
  sA = prmt(q0, q1, 0x5410), zA = half_f16x2(prmt(q0, q1, 0x7632));
  sB = prmt(q8, q9, 0x5410), zB = half_f16x2(prmt(q8, q9, 0x7632));
}

// One warp's state: the query fragments, the output accumulators, the softmax statistics of the
// lane's queries (4 b + t of column block b).
template <int D, int NQB>
struct WarpState {
  const uint2* qs;          // [D / 16][NQB][32 lanes] the query's B fragments, in shared memory
  float o[D / 16][NQB][4];  // O^T: m-tile i (dims g D/8 + 2i, + 1) x columns 2t, 2t + 1
  float m[NQB], l[NQB];     // the running maximum (scores' units: true scores / k), and the sum
                            // over this lane's tokens (summed over the warp at the end)
  float k[NQB];             // the scores' unit: 2^e where the query was scaled by 2^-e
};

// An 8 x 8 matrix of 16-bit elements transposed across the warp (lane 4r + c holds row r,
// columns 2c, 2c + 1 before and after).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
// p as (fp16(p), fp16(p - fp16(p))): a column pair's hi and lo parts.
__device__ __forceinline__ uint32_t hi_lo(float p) {
  const __half hi = __float2half_rn(p);
  return h2_as_u32(__halves2half2(hi, __float2half_rn(p - __half2float(hi))));
}

// Scores -> probabilities for this tile, rescaling the accumulators; returns P^T's B fragments
// [k-slice][column block][b0, b1]. sc[mt][b]: rows tokens 16 mt + g (e = 0, 1) and + 8 (e = 2,
// 3), columns query 4b + t's hi (e even) and lo (e odd) parts. HALVE: the fragments hold p / 2
// (window tiles: their values are not halved as the packed tiles' are).
template <int D, int NQB, bool HALVE>
__device__ __forceinline__ void softmax_tile(WarpState<D, NQB>& w, const float (&sc)[2][NQB][4],
                                             const bool (&valid)[4], uint32_t (&pb)[2][NQB][2]) {
#pragma unroll
  for (int b = 0; b < NQB; ++b) {
    float s[4];  // tokens g, g + 8, g + 16, g + 24
    float mx = -INFINITY;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int mt = r >> 1, e = 2 * (r & 1);
      s[r] = valid[r] ? sc[mt][b][e] + sc[mt][b][e + 1] : -INFINITY;
      mx = fmaxf(mx, s[r]);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    const float m_new = fmaxf(w.m[b], mx);
    // exp2(k (s - m)); with k = 1 exactly exp2(s - m).
    const float corr = fast_exp2((w.m[b] - m_new) * w.k[b]), mk = m_new * w.k[b];
    float p[4], sum = 0.0f;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      p[r] = valid[r] ? fast_exp2(fmaf(s[r], w.k[b], -mk)) : 0.0f;
      sum += p[r];
    }
    w.l[b] = w.l[b] * corr + sum;
    // The accumulators are rescaled only when the maximum moved (after the first tiles,
    // rarely): a warp-uniform branch.
    if (__any_sync(0xffffffffu, m_new != w.m[b])) {
#pragma unroll
      for (int i = 0; i < D / 16; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) w.o[i][b][e] *= corr;
    }
    w.m[b] = m_new;
#pragma unroll
    for (int r = 0; r < 4; ++r)  // k-slice r / 2, b0 (tokens 0-7) or b1 (8-15)
      pb[r >> 1][b][r & 1] = transpose8x8(hi_lo(HALVE ? 0.5f * p[r] : p[r]));
  }
}

// One code plane of a sealed tile's keys (a stage's K codes and K params), its scores added to
// sc. A KIVI tile has one plane; an XQuant reuse tile two (its anchor's codes under its own
// pairs, then its residual codes under theirs), summed: q . (k1 + k2) = q . k1 + q . k2.
template <int D, int NQB, int KB, int VB>
__device__ __forceinline__ void key_plane(const WarpState<D, NQB>& w, const uint8_t* st,
                                          float (&sc)[2][NQB][4], int lane, int g, int t) {
  using C = Cfg<D, KB, VB>;
  // Keys: the per-channel scales are folded into the query (B = q * s, the hi and lo columns
  // each rounded to fp16) and the key operand is the raw magic codes M + c (one LOP3 per pair).
  // Two more products per k-slice give the rest of q . k = sum (q s) c + sum q z: + q . z (A =
  // the zeros in every row, B = q, into bz) and - (q s) . M (A = -M, B = q s, into bm); every
  // row is the column's sum. Two chains of products for one column block, one each for two.
  constexpr int kChains = NQB == 1 ? 2 : 1;
  float bias[NQB][kChains][4] = {};
  const uint8_t* kp = st + C::kOffKP + 4 * (t * (D / 4));
#pragma unroll
  for (int sl = 0; sl < C::kSlices; ++sl) {
    const int m0 = 2 * sl, m1 = 2 * sl + 1;
    const int a0 = C::dim_a(m0);
    // {scale, zero} of dims a0, a1 = a0 + 1 and of their partners (+ kHalf): two 8-byte loads.
    const uint2 pa = *reinterpret_cast<const uint2*>(kp + 4 * a0);
    const uint2 pb = *reinterpret_cast<const uint2*>(kp + 4 * (a0 + C::kHalf));
    static_assert(C::dim_a(1) == C::dim_a(0) + 1, "a k-slice's two pairs are adjacent dims");
    const uint32_t s0 = prmt(pa.x, pb.x, 0x5410), z0 = prmt(pa.x, pb.x, 0x7632);
    const uint32_t s1 = prmt(pa.y, pb.y, 0x5410), z1 = prmt(pa.y, pb.y, 0x7632);
    const int word = m0 / C::kHalf;  // m1 is in the same word (kHalf is even)
    const int p0 = KB * (m0 % C::kHalf), p1 = KB * (m1 % C::kHalf);
    const int sh0 = land_fold<KB>(p0), sh1 = land_fold<KB>(p1);
    uint32_t x[4];  // the word of tokens g, g + 8, g + 16, g + 24
#pragma unroll
    for (int n = 0; n < 4; ++n)
      x[n] = lds32(st + (8 * n + g) * C::kRowK + t * C::kLaneK + 4 * word);
    const uint32_t za[4] = {z0, z0, z1, z1};
    const uint32_t ma[4] = {magic_at(p0 + sh0) | 0x80008000u, magic_at(p0 + sh0) | 0x80008000u,
                            magic_at(p1 + sh1) | 0x80008000u, magic_at(p1 + sh1) | 0x80008000u};
#pragma unroll
    for (int b = 0; b < NQB; ++b) {
      const uint2 q = w.qs[(sl * NQB + b) * 32 + lane];
      const uint32_t f0 = h2_as_u32(__hmul2(u32_as_h2(q.x), u32_as_h2(s0)));
      const uint32_t f1 = h2_as_u32(__hmul2(u32_as_h2(q.y), u32_as_h2(s1)));
      mma16816(bias[b][0], za, q.x, q.y);
      mma16816(bias[b][kChains - 1], ma, f0, f1);
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const uint32_t ka[4] = {
            codes_at<KB>(x[2 * mt], p0, sh0), codes_at<KB>(x[2 * mt + 1], p0, sh0),
            codes_at<KB>(x[2 * mt], p1, sh1), codes_at<KB>(x[2 * mt + 1], p1, sh1)};
        mma16816(sc[mt][b], ka, f0, f1);
      }
    }
  }
#pragma unroll
  for (int b = 0; b < NQB; ++b)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float sum = kChains == 2 ? bias[b][0][e] + bias[b][kChains - 1][e] : bias[b][0][e];
      sc[0][b][e] += sum, sc[1][b][e] += sum;
    }
}

// One code plane of a sealed tile's values (a stage's V codes and V params): V^T P^T added to
// the output accumulators (P . (v1 + v2) = P . v1 + P . v2).
template <int D, int NQB, int KB, int VB>
__device__ __forceinline__ void value_plane(WarpState<D, NQB>& w, const uint8_t* st,
                                            const uint32_t (&pb)[2][NQB][2], int64_t ng,
                                            int vgroup_lane, int g, int t) {
  using C = Cfg<D, KB, VB>;
  static_assert(C::kCodesPerPiece % 2 == 0, "an m-tile's two dims come from one piece");
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int j0 = 16 * k + 2 * t;  // tokens j0, j0 + 1 (a0, a1) and j0 + 8, j0 + 9 (a2, a3)
    uint32_t u[4][C::kWordsV], sA, zA, sB, zB;
    value_words<D, KB, VB>(st, j0, ng, vgroup_lane, g, u, sA, zA, sB, zB);
#pragma unroll
    for (int pc = 0; pc < C::kPiecesV; ++pc) {
      const uint32_t sel = (pc & 1) ? 0x7632 : 0x5410;
      const uint32_t cA = prmt(u[0][pc / 2], u[1][pc / 2], sel);
      const uint32_t cB = prmt(u[2][pc / 2], u[3][pc / 2], sel);
#pragma unroll
      for (int i = 0; i < C::kCodesPerPiece; i += 2) {  // dims 2 mi, 2 mi + 1 of the lane
        const int mi = (pc * C::kCodesPerPiece + i) / 2;
        const int pa = VB * i, sha = land_exact<VB>(pa);
        const int pz = VB * (i + 1), shz = land_exact<VB>(pz);
        const uint32_t mga = magic_at(pa + sha), mgz = magic_at(pz + shz);
        const uint32_t va[4] = {dequant2_half(codes_at<VB>(cA, pa, sha), mga, sA, zA),
                                dequant2_half(codes_at<VB>(cA, pz, shz), mgz, sA, zA),
                                dequant2_half(codes_at<VB>(cB, pa, sha), mga, sB, zB),
                                dequant2_half(codes_at<VB>(cB, pz, shz), mgz, sB, zB)};
#pragma unroll
        for (int b = 0; b < NQB; ++b) mma16816(w.o[mi][b], va, pb[k][b][0], pb[k][b][1]);
      }
    }
  }
}

// A sealed tile from its shared-memory stage: NP planes of stage_bytes / NP bytes each.
template <int D, int NQB, int KB, int VB, int NP>
__device__ __forceinline__ void packed_tile(WarpState<D, NQB>& w, const uint8_t* st,
                                            int plane_bytes, int64_t ng, int vgroup_lane, int lane,
                                            int g, int t) {
  float sc[2][NQB][4] = {};
  key_plane<D, NQB, KB, VB>(w, st, sc, lane, g, t);
  if constexpr (NP == 2) key_plane<D, NQB, KB, VB>(w, st + plane_bytes, sc, lane, g, t);
  const bool valid[4] = {true, true, true, true};
  uint32_t pb[2][NQB][2];
  softmax_tile<D, NQB, false>(w, sc, valid, pb);
  value_plane<D, NQB, KB, VB>(w, st, pb, ng, vgroup_lane, g, t);
  if constexpr (NP == 2)
    value_plane<D, NQB, KB, VB>(w, st + plane_bytes, pb, ng, vgroup_lane, g, t);
}

// A window tile [p0, p0 + 32) straight from its pages (tokens at or past `offset` masked).
template <int D, int NQB, int KB, int VB>
__device__ __forceinline__ void window_tile(WarpState<D, NQB>& w, const LayerDesc& L, int64_t s,
                                            int64_t p0, int lane, int g, int t) {
  using C = Cfg<D, KB, VB>;
  float sc[2][NQB][4] = {};
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    uint32_t u[2][D / 8];  // tokens 16 mt + g, + 8: dims t * D/4 ... as 2 x 16-bit each
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // This lane's key rows (A rows g, g + 8).
      window_words<D / 8>(L, true, s, p0 + 16 * mt + 8 * r + g, t * (D / 4), u[r]);
    }
#pragma unroll
    for (int sl = 0; sl < C::kSlices; ++sl) {
      const int a0 = C::dim_a(2 * sl), a1 = C::dim_a(2 * sl + 1);
      const uint32_t s0 = (a0 & 1) ? 0x7632 : 0x5410, s1 = (a1 & 1) ? 0x7632 : 0x5410;
      const uint32_t ka[4] = {prmt(u[0][a0 / 2], u[0][(a0 + C::kHalf) / 2], s0),
                              prmt(u[1][a0 / 2], u[1][(a0 + C::kHalf) / 2], s0),
                              prmt(u[0][a1 / 2], u[0][(a1 + C::kHalf) / 2], s1),
                              prmt(u[1][a1 / 2], u[1][(a1 + C::kHalf) / 2], s1)};
#pragma unroll
      for (int b = 0; b < NQB; ++b) {
        const uint2 q = w.qs[(sl * NQB + b) * 32 + lane];
        mma16816(sc[mt][b], ka, q.x, q.y);
      }
    }
  }
  bool valid[4];  // tokens g, g + 8, g + 16, g + 24 of the tile
#pragma unroll
  for (int r = 0; r < 4; ++r) valid[r] = p0 + 8 * r + g < L.offset;
  uint32_t pb[2][NQB][2];
  softmax_tile<D, NQB, true>(w, sc, valid, pb);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    uint32_t u[4][D / 16];  // 4 tokens x this lane's D/8 dims (2 per word)
    window_value_rows<D>(L, s, p0 + 16 * k, g, t, u);
#pragma unroll
    for (int mi = 0; mi < D / 16; ++mi) {  // dims 2 mi (low halves), 2 mi + 1 (high halves)
      const uint32_t va[4] = {prmt(u[0][mi], u[1][mi], 0x5410), prmt(u[0][mi], u[1][mi], 0x7632),
                              prmt(u[2][mi], u[3][mi], 0x5410), prmt(u[2][mi], u[3][mi], 0x7632)};
#pragma unroll
      for (int b = 0; b < NQB; ++b) mma16816(w.o[mi][b], va, pb[k][b][0], pb[k][b][1]);
    }
  }
}

// Tiles [tile0, tile1) of stream s: the sealed ones through per-warp shared-memory stages with
// cp.async (packed(stage, plane_bytes, vgroup_lane) on each), then the window ones from their
// pages (window(first token)).
template <int D, int KB, int VB, int XQ, class Packed, class Window>
__device__ __forceinline__ void run_tiles(const LayerDesc& L, int64_t s, int64_t tile0,
                                          int64_t tile1, int64_t n_sealed_tiles, uint8_t* stages,
                                          int stage_bytes, int lane, int g, Packed&& packed,
                                          Window&& window) {
  using C = Cfg<D, KB, VB>;
  constexpr int kStages = stages_for<KB, XQ>();
  constexpr int kPlanes = XQ == 2 ? 2 : 1;
  const int64_t ps0 = tile0, ps1 = imin(tile1, n_sealed_tiles);
  const int vgroup_lane = static_cast<int>((g * (D / 8)) / L.vgroup);
  const int64_t S = L.S(), tiles_per_block = L.T / kTile;
  // Block pointers, 32 tiles at a time: lane i loads tile (base + i)'s, shuffles hand them out,
  // so that no copy waits on a dependent load of the table. Tiles are counted from ps0 in 32 bits.
  int ptr_base = -1;
  unsigned long long my_k = 0, my_v = 0, my_lk = 0, my_lv = 0;
  // The tile's block parts, and (XQuant reuse) its anchor block's parts in `link`.
  auto block_of = [&](int i, PtrPair& link) {
    const int base = i & ~31;
    if (base != ptr_base) {
      ptr_base = base;
      const int64_t mine = ps0 + base + lane;
      if (mine < ps1) {
        const PtrPair p = L.blocks[mine / tiles_per_block];
        my_k = reinterpret_cast<unsigned long long>(p.k);
        my_v = reinterpret_cast<unsigned long long>(p.v);
        if constexpr (XQ != 0) {
          const PtrPair q = L.links[mine / tiles_per_block];
          my_lk = reinterpret_cast<unsigned long long>(q.k);
          my_lv = reinterpret_cast<unsigned long long>(q.v);
        }
      }
    }
    PtrPair p;
    p.k = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, my_k, i & 31));
    p.v = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, my_v, i & 31));
    if constexpr (XQ != 0) {
      link.k = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, my_lk, i & 31));
      link.v = reinterpret_cast<uint8_t*>(__shfl_sync(0xffffffffu, my_lv, i & 31));
    }
    return p;
  };
  // This stream's parts inside a block, and this lane's first 16-byte piece of each, hoisted out
  // of the loop (a tile adds its block's base pointer and, for blocks of several tiles, its
  // index within the block).
  // A KIVI block holds codes then pairs; an XQuant reuse block holds its pairs (the codes are
  // its anchor's block's, at the same offsets as in a KIVI block), then with a residual the
  // residual codes and their pairs (the second plane).
  const int64_t off_kc = s * L.kcode + lane * 16, off_vc = s * L.vcode + lane * 16;
  const int64_t off_kp = (XQ == 0 ? S * L.kcode : 0) + s * L.kparam + lane * 16;
  const int64_t off_vp = (XQ == 0 ? S * L.vcode : 0) + s * L.vparam + lane * 16;
  const int64_t off_rkc = S * L.kparam + s * L.rcode + lane * 16;
  const int64_t off_rkp = S * (L.kparam + L.rcode) + s * L.kparam + lane * 16;
  const int64_t off_rvc = S * L.vparam + s * L.rcode + lane * 16;
  const int64_t off_rvp = S * (L.vparam + L.rcode) + s * L.vparam + lane * 16;
  const int plane_bytes = stage_bytes / kPlanes;
  const int vp_bytes = static_cast<int>(kTile * L.ng * 4);  // ng <= 8: at most 1 KiB
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(stages)) + lane * 16;
  auto issue = [&](int i, int stage) {
    PtrPair link;
    const PtrPair bp = block_of(i, link);
    const uint8_t* kcodes = XQ == 0 ? bp.k : link.k;
    const uint8_t* vcodes = XQ == 0 ? bp.v : link.v;
    const int tb = tiles_per_block == 1 ? 0 : static_cast<int>((ps0 + i) % tiles_per_block);
    const uint32_t dst = stage0 + stage * stage_bytes;
    copy_warp<kTile * C::kRowK>(dst, kcodes + off_kc + tb * (kTile * C::kRowK), kTile * C::kRowK,
                                lane);
    copy_warp<D * 4>(dst + C::kOffKP, bp.k + off_kp, D * 4, lane);
    copy_warp<kTile * C::kRowV>(dst + C::kOffVC, vcodes + off_vc + tb * (kTile * C::kRowV),
                                kTile * C::kRowV, lane);
    copy_warp<kTile * 8 * 4>(dst + C::kOffVP, bp.v + off_vp + tb * vp_bytes, vp_bytes, lane);
    if constexpr (XQ == 2) {  // residual codes of KB bits: the same stage layout
      const uint32_t d2 = dst + plane_bytes;
      copy_warp<kTile * C::kRowK>(d2, bp.k + off_rkc + tb * (kTile * C::kRowK), kTile * C::kRowK,
                                  lane);
      copy_warp<D * 4>(d2 + C::kOffKP, bp.k + off_rkp, D * 4, lane);
      copy_warp<kTile * C::kRowV>(d2 + C::kOffVC, bp.v + off_rvc + tb * (kTile * C::kRowV),
                                  kTile * C::kRowV, lane);
      copy_warp<kTile * 8 * 4>(d2 + C::kOffVP, bp.v + off_rvp + tb * vp_bytes, vp_bytes, lane);
    }
  };
  const int nt = static_cast<int>(ps1 - ps0);  // this warp's sealed tiles
  for (int i = 0; i < kStages - 1; ++i) {
    if (i < nt) issue(i, i);
    cp_commit();
  }
  for (int i = 0; i < nt; ++i) {
    cp_wait<kStages - 2>();
    __syncwarp();  // every lane's copies of this tile have landed; the stage read last is free
    if (i + kStages - 1 < nt) issue(i + kStages - 1, (i + kStages - 1) % kStages);
    cp_commit();
    packed(stages + (i % kStages) * stage_bytes, plane_bytes, vgroup_lane);
  }
  cp_wait<0>();
  for (int64_t tile = imax(tile0, n_sealed_tiles); tile < tile1; ++tile) window(tile * kTile);
}

// XQ: 0 a KIVI layer (or an XQuant anchor); 1 an XQuant reuse layer without a residual (its
// anchor's codes, its own pairs: one plane); 2 one with a residual of KB bits (two planes).
// NQB: column blocks of 4 query heads (1 for groups of up to 4, 2 up to 8).
template <int D, int NQB, int KB, int VB, int XQ>
__global__ void __launch_bounds__(warps_for<D>() * 32, min_blocks<D, NQB, KB, XQ>())
    fast_kernel(LayerDesc L, AttendArgs a, int stage_bytes) {
  using C = Cfg<D, KB, VB>;
  constexpr int kStages = stages_for<KB, XQ>();
  constexpr int kPlanes = XQ == 2 ? 2 : 1;
  constexpr int kWarps = warps_for<D>();
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = static_cast<int>(threadIdx.x) % 32, warp = static_cast<int>(threadIdx.x) / 32;
  const int g = lane >> 2, t = lane & 3;
  // The combine kernel may be scheduled now (it waits for this grid's end before reading).
  asm volatile("griddepcontrol.launch_dependents;");
  constexpr int kQBytes = C::kSlices * NQB * 32 * 8;  // the query fragments, then the stages
  const int warp_bytes = kQBytes + kStages * stage_bytes;
  uint8_t* stages = smem + warp * warp_bytes + kQBytes;
  const int64_t item =
      a.merge ? static_cast<int64_t>(blockIdx.x) : static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (!a.merge && item >= static_cast<int64_t>(L.B) * a.nh * a.n_splits) return;  // whole warps
  const int64_t split = item % a.n_splits, bh = item / a.n_splits;
  const int64_t hh = bh % a.nh, b = bh / a.nh, h = a.h0 + hh, s = b * L.H + h;
  const int64_t sealed = L.n_blocks * L.T;
  const int64_t n_sealed_tiles = sealed / kTile;
  const int64_t n_tiles = n_sealed_tiles + (L.offset - sealed + kTile - 1) / kTile;
  const TileRange range = split_tile_range(a.merge ? split * kWarps + warp : split, a.split_units,
                                           a.window_cost, n_sealed_tiles, n_tiles);
  const int64_t tile0 = range.begin, tile1 = range.end;

  WarpState<D, NQB> w;
#pragma unroll
  for (int cb = 0; cb < NQB; ++cb) w.m[cb] = -INFINITY, w.l[cb] = 0.0f;
#pragma unroll
  for (int i = 0; i < D / 16; ++i)
#pragma unroll
    for (int cb = 0; cb < NQB; ++cb)
#pragma unroll
      for (int e = 0; e < 4; ++e) w.o[i][cb][e] = 0.0f;
  // Query fragments: lane (g, t) builds column g of each block cb, the hi (g even) or lo part of
  // query head h * group + 4 cb + g / 2, over its dims (t's chunk).
  // key_plane multiplies the query by the key scales in fp16 (q s), and a key scale can be any
  // finite fp16 number: min/max scales stay below 131072 / (2^KB - 1), but least-squares fits
  // (XQuant's reuse layers by default, `fit=lsq` anchors) are only clamped to 65504. A query
  // whose largest |q| passes 1 is therefore scaled by 2^-e to at most 1, so that every q s stays
  // within fp16, and its scores are then in units of k = 2^e. The scaling is exact but where
  // fp16(q 2^-e) or q s falls below fp16's normal range (2^-14): an absolute error of at most
  // 2^-25 next to the query's largest |q| of about 1. A query of 2^126 or more is left as it is.
  {
    uint2* qs = reinterpret_cast<uint2*>(smem + warp * warp_bytes);
#pragma unroll
    for (int cb = 0; cb < NQB; ++cb) {
      const int qi = 4 * cb + (g >> 1);
      const bool real = qi < L.group;
      const int64_t hq = h * L.group + (real ? qi : 0);
      float qv[D / 4];
      float qmax = 0.0f;
#pragma unroll
      for (int x = 0; x < D / 4; ++x) {
        qv[x] = real ? load_elem(a.q.data, a.q.dtype, offset_of(a.q, b, hq, 0, t * (D / 4) + x)) *
                           a.scale_log2
                     : 0.0f;
        qmax = fmaxf(qmax, fabsf(qv[x]));
      }
      const int e = quad_scale_exponent(qmax, 1.0f);
      // This lane's softmax is query 4 cb + t's, whose exponent lane 4 (2 t) computed.
      w.k[cb] = exp2_int(__shfl_sync(0xffffffffu, e, 8 * t));
      const float qmul = exp2_int(-e);
#pragma unroll
      for (int x = 0; x < D / 4; ++x) qv[x] *= qmul;
#pragma unroll
      for (int sl = 0; sl < C::kSlices; ++sl) {
        uint32_t bq[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // r = 0: b0 (pair 2 sl), r = 1: b1 (pair 2 sl + 1)
          const int da = C::dim_a(2 * sl + r), db = da + C::kHalf;
          const __half2 hi = __floats2half2_rn(qv[da], qv[db]);
          const float2 back = __half22float2(hi);
          bq[r] = (g & 1) ? h2_as_u32(__floats2half2_rn(qv[da] - back.x, qv[db] - back.y))
                          : h2_as_u32(hi);
        }
        qs[(sl * NQB + cb) * 32 + lane] = make_uint2(bq[0], bq[1]);
      }
    }
    w.qs = qs;
    __syncwarp();
  }
  run_tiles<D, KB, VB, XQ>(
      L, s, tile0, tile1, n_sealed_tiles, stages, stage_bytes, lane, g,
      [&](const uint8_t* st, int plane_bytes, int vgroup_lane) {
        packed_tile<D, NQB, KB, VB, kPlanes>(w, st, plane_bytes, L.ng, vgroup_lane, lane, g, t);
      },
      [&](int64_t p0) { window_tile<D, NQB, KB, VB>(w, L, s, p0, lane, g, t); });

  // Each query's sum over the warp, then the CTA's warps merged into the split's partial through
  // shared memory (the stages are done with): lane (g, t) holds dims g D/8 + 2i and + 1 of query
  // 4 cb + t, as the hi and lo columns' sum; its maximum in true units is m k.
#pragma unroll
  for (int cb = 0; cb < NQB; ++cb) {
    w.l[cb] += __shfl_xor_sync(0xffffffffu, w.l[cb], 4);
    w.l[cb] += __shfl_xor_sync(0xffffffffu, w.l[cb], 8);
    w.l[cb] += __shfl_xor_sync(0xffffffffu, w.l[cb], 16);
  }
  if (!a.merge) {  // this warp's split is the partial
#pragma unroll
    for (int cb = 0; cb < NQB; ++cb) {
      const int qi = 4 * cb + t;
      if (qi >= L.group) continue;
      const int64_t row = (b * a.nh + hh) * L.group + qi;
      float* acc = a.part_acc + (row * a.n_splits + split) * D + g * (D / 8);
#pragma unroll
      for (int i = 0; i < D / 16; ++i)  // doubled: the value operands were halved
        *reinterpret_cast<float2*>(acc + 2 * i) = make_float2(
            2.0f * (w.o[i][cb][0] + w.o[i][cb][1]), 2.0f * (w.o[i][cb][2] + w.o[i][cb][3]));
      if (g == 0) {  // the maximum in true units
        a.part_ml[(row * a.n_splits + split) * 2] = tile0 < tile1 ? w.m[cb] * w.k[cb] : -INFINITY;
        a.part_ml[(row * a.n_splits + split) * 2 + 1] = tile0 < tile1 ? w.l[cb] : 0.0f;
      }
    }
    return;
  }
  constexpr int kQ = 4 * NQB;
  __syncthreads();
  float* ml = reinterpret_cast<float*>(smem);  // [kWarps][kQ][2]: m (true units), l
  float* ob = ml + kWarps * kQ * 2;            // [kWarps][kQ][D]
#pragma unroll
  for (int cb = 0; cb < NQB; ++cb) {
    const int qi = 4 * cb + t;
    float* o = ob + (warp * kQ + qi) * D + g * (D / 8);
#pragma unroll
    for (int i = 0; i < D / 16; ++i)  // doubled: the value operands were halved
      *reinterpret_cast<float2*>(o + 2 * i) = make_float2(2.0f * (w.o[i][cb][0] + w.o[i][cb][1]),
                                                          2.0f * (w.o[i][cb][2] + w.o[i][cb][3]));
    if (g == 0) {
      const bool any = tile0 < tile1;  // l > 0 then (the maximum's own term is 1)
      ml[(warp * kQ + qi) * 2] = any ? w.m[cb] * w.k[cb] : -INFINITY;
      ml[(warp * kQ + qi) * 2 + 1] = any ? w.l[cb] : 0.0f;
    }
  }
  __syncthreads();
  // out = sum_w 2^(m_w - M) o_w, l = sum_w 2^(m_w - M) l_w over the warps that saw a token.
  for (int e = static_cast<int>(threadIdx.x); e < L.group * D; e += kWarps * 32) {
    const int qi = e / D, d = e % D;
    float M = -INFINITY;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) M = fmaxf(M, ml[(v * kQ + qi) * 2]);
    float acc = 0.0f, l = 0.0f;
#pragma unroll
    for (int v = 0; v < kWarps; ++v) {
      const float lv = ml[(v * kQ + qi) * 2 + 1];
      const float wt = lv > 0.0f ? exp2f(ml[(v * kQ + qi) * 2] - M) : 0.0f;
      acc += wt * ob[(v * kQ + qi) * D + d];
      l += wt * lv;
    }
    const int64_t row = (b * a.nh + hh) * L.group + qi;
    a.part_acc[(row * a.n_splits + split) * D + d] = acc;
    if (d == 0) {
      a.part_ml[(row * a.n_splits + split) * 2] = l > 0.0f ? M : -INFINITY;
      a.part_ml[(row * a.n_splits + split) * 2 + 1] = l;
    }
  }
}

// The kernel's XQ for a layer (see fast_kernel).
int xq_variant(const LayerDesc& L) { return L.xq != 2 ? 0 : L.r_bits == 0 ? 1 : 2; }

int stage_bytes_of(const LayerDesc& L) {
  if (L.k_bits == 0) return 0;  // a window-only layer stages nothing
  const int rk = L.D * std::max(L.k_bits, 2) / 8, rv = L.D * std::max(L.v_bits, 2) / 8;
  const int plane = kTile * rk + L.D * 4 + kTile * rv + static_cast<int>(kTile * L.ng * 4);
  return xq_variant(L) == 2 ? 2 * plane : plane;
}

template <int D, int NQB, int KB, int VB, int XQ>
size_t smem_of(const LayerDesc& L) {
  const size_t q_bytes = D / 16 * NQB * 32 * 8;
  const size_t merge = static_cast<size_t>(warps_for<D>()) * 4 * NQB * (D + 2) * sizeof(float);
  return std::max(merge,
                  static_cast<size_t>(warps_for<D>()) *
                      (q_bytes + static_cast<size_t>(stages_for<KB, XQ>()) * stage_bytes_of(L)));
}

template <int D, int NQB, int KB, int VB, int XQ>
void raise_smem() {
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(fast_kernel<D, NQB, KB, VB, XQ>,
                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   200 * 1024) == cudaSuccess);
    return true;
  }();
  (void)raised;
}

// Warps of the kernel resident on the whole device at once.
template <int D, int NQB, int KB, int VB, int XQ>
int64_t resident(const LayerDesc& L) {
  raise_smem<D, NQB, KB, VB, XQ>();
  int blocks = 0, dev = 0, sms = 0;
  KVQ_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                &blocks, fast_kernel<D, NQB, KB, VB, XQ>, warps_for<D>() * 32,
                smem_of<D, NQB, KB, VB, XQ>(L)) == cudaSuccess);
  KVQ_CHECK(cudaGetDevice(&dev) == cudaSuccess);
  KVQ_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess);
  return static_cast<int64_t>(std::max(blocks, 1)) * warps_for<D>() * sms;
}

template <int D, int NQB, int KB, int VB, int XQ>
void launch(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  const int stage = stage_bytes_of(L);
  const size_t smem = smem_of<D, NQB, KB, VB, XQ>(L);
  raise_smem<D, NQB, KB, VB, XQ>();
  const int64_t splits = static_cast<int64_t>(L.B) * a.nh * a.n_splits;
  const int64_t ctas = a.merge ? splits : (splits + warps_for<D>() - 1) / warps_for<D>();
  fast_kernel<D, NQB, KB, VB, XQ>
      <<<static_cast<unsigned>(ctas), warps_for<D>() * 32, smem, st>>>(L, a, stage);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace

bool fast_supported(const LayerDesc& L, int Tq) {
  if (Tq != 1 || (L.D != 64 && L.D != 128) || L.group < 1 || L.group > 8) return false;
  if (L.T % kTile != 0 || L.P < 1) return false;
  if (L.k_bits == 0 && L.v_bits == 0) return true;  // a window-only layer (fp16)
  if (L.zip) return false;                          // ZipCache's mixed widths: the chunk kernel
  if (L.k_bits != L.v_bits || (L.k_bits != 2 && L.k_bits != 4 && L.k_bits != 8)) return false;
  // XQuant reuse layers: 2- and 4-bit codes, with no residual or one of as many bits.
  if (L.xq == 2 && (L.k_bits == 8 || (L.r_bits != 0 && L.r_bits != L.k_bits))) return false;
  const int64_t vg = std::min<int64_t>(L.vgroup, L.D);
  if (vg % (L.D / 8) != 0) return false;
  // cp.async moves 16-byte pieces: every part the kernel copies must start on 16 bytes.
  return L.kcode % 16 == 0 && L.vcode % 16 == 0 && L.kparam % 16 == 0 && L.vparam % 16 == 0 &&
         L.rcode % 16 == 0;
}

namespace {
// The kernel for a layer: f.operator()<D, NQB, KB, VB, XQ>() (XQuant reuse variants at 2 and 4
// bits; one column block for groups of up to 4 query heads, two up to 8).
template <int D, int NQB, int B, class F>
auto by_variant(int xq, F& f) {
  if constexpr (B != 8) {
    if (xq == 1) return f.template operator()<D, NQB, B, B, 1>();
    if (xq == 2) return f.template operator()<D, NQB, B, B, 2>();
  }
  return f.template operator()<D, NQB, B, B, 0>();
}
template <int D, int NQB, class F>
auto by_bits(int bits, int xq, F& f) {
  if (bits == 2) return by_variant<D, NQB, 2>(xq, f);
  if (bits == 4) return by_variant<D, NQB, 4>(xq, f);
  return by_variant<D, NQB, 8>(xq, f);
}
template <int D, class F>
auto by_blocks(const LayerDesc& L, int bits, int xq, F& f) {
  if (L.group > 4) return by_bits<D, 2>(bits, xq, f);
  return by_bits<D, 1>(bits, xq, f);
}
template <class F>
auto dispatch(const LayerDesc& L, F f) {
  const int bits = L.k_bits == 0 ? 2 : L.k_bits, xq = xq_variant(L);
  return L.D == 128 ? by_blocks<128>(L, bits, xq, f) : by_blocks<64>(L, bits, xq, f);
}
}  // namespace

int64_t fast_resident_warps(const LayerDesc& L) {
  return dispatch(
      L, [&]<int D, int NQB, int KB, int VB, int XQ>() { return resident<D, NQB, KB, VB, XQ>(L); });
}

void attend_fast(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  dispatch(L,
           [&]<int D, int NQB, int KB, int VB, int XQ>() { launch<D, NQB, KB, VB, XQ>(L, a, st); });
}

}  // namespace kvq::cuda
