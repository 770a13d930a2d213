// The chunk attention kernel: several queries per sequence (prefill chunks, speculative
// verification), any layer the backend holds, fp32 arithmetic — the generic kernel's semantics
// (per-query seal boundaries, kvq/cache.h) with the work shared: a CTA takes R query rows of one
// (sequence, KV head) — the group's query heads at up to 64 / group consecutive positions — and
// walks the keys in 32-token tiles, each tile dequantized once into shared memory for all R rows
// (the generic kernel dequantizes every key element once per query row).
//
// A tile whose keys some rows see sealed (dequantized) and others exact (a seal point inside
// the chunk) holds both versions; each (row, key) picks its own.
//
// Work split over keys as the generic kernel's (split_len keys per split, a multiple of 32),
// partials in its layout, merged by the same combine kernel.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "cache/seal_rules.h"
#include "cuda/device_common.cuh"
#include "cuda/kernels.h"
#include "kvq/status.h"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32, kTileKeys = 32;

// Rows per CTA (query heads x positions): 64 up to head_dim 128, 32 above.
__host__ __device__ constexpr int rows_for(int D) { return D <= 128 ? 64 : 32; }

size_t smem_bytes(int D) {
  const int R = rows_for(D);
  // Q [R, D], K and K-exact [32, D + 1], V and V-exact [32, D], P [R, 32], row boundaries [R].
  return sizeof(float) * (static_cast<size_t>(R) * D + 2 * kTileKeys * (D + 1) + 2 * kTileKeys * D +
                          static_cast<size_t>(R) * kTileKeys) +
         sizeof(long long) * static_cast<size_t>(R);
}

__global__ void __launch_bounds__(kThreads) chunk_kernel(LayerDesc L, AttendArgs a, int n_qtiles) {
  extern __shared__ float sm[];
  const int D = L.D, R = rows_for(D), G = L.group, QT = R / G, DP = D + 1;
  float* qs = sm;                   // [R, D] queries * scale * log2(e)
  float* ks = qs + R * D;           // [32, D + 1] keys as sealed (dequantized)
  float* kx = ks + kTileKeys * DP;  // [32, D + 1] keys exact
  float* vs = kx + kTileKeys * DP;  // [32, D] values as sealed
  float* vx = vs + kTileKeys * D;   // [32, D] values exact
  float* ps = vx + kTileKeys * D;   // [R, 32] this tile's probabilities
  long long* bnd = reinterpret_cast<long long*>(ps + R * kTileKeys);  // [R] seal boundaries
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int64_t qtile = blockIdx.x % n_qtiles, bh = blockIdx.x / n_qtiles;
  const int64_t hh = bh % a.nh, b = bh / a.nh, h = a.h0 + hh, s = b * L.H + h;
  const int64_t t0 = qtile * QT, split = blockIdx.y;
  const SealRules rules{L.T, L.R};
  // Row i: query position t0 + i / G (index into the chunk), query head h * G + i % G.
  for (int i = tid; i < R * D; i += kThreads) {
    const int r = i / D, d = i - r * D;
    const int64_t t = t0 + r / G;
    qs[i] =
        t < a.Tq && r < QT * G
            ? load_elem(a.q.data, a.q.dtype, offset_of(a.q, b, h * G + r % G, t, d)) * a.scale_log2
            : 0.0f;
  }
  for (int r = tid; r < R; r += kThreads) {
    const int64_t t = t0 + r / G;
    bnd[r] = t < a.Tq ? rules.visible_sealed(L.offset - a.Tq + t, L.exact_begin) : 0;
  }
  // The keys this CTA sees: up to its last real position, inside this split.
  const int64_t t_last = imin(t0 + QT, a.Tq) - 1;
  const int64_t p_first = L.offset - a.Tq + t0, p_last = L.offset - a.Tq + t_last;
  const int64_t j_begin = split * a.split_len, j_end = imin(j_begin + a.split_len, p_last + 1);
  const int64_t b_lo = rules.visible_sealed(p_first, L.exact_begin);
  const int64_t b_hi = rules.visible_sealed(p_last, L.exact_begin);
  __syncthreads();

  // This warp's rows: kWarps warps x (R / kWarps) rows.
  constexpr int kMaxRows = 8;
  const int RW = R / kWarps;                         // 8 or 4
  float m[kMaxRows], l[kMaxRows], acc[kMaxRows][8];  // acc: dims lane + 32 k, k < D / 32 <= 8
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[r][k] = 0.0f;
  }
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kTileKeys) {
    const int n = static_cast<int>(imin(kTileKeys, j_end - j0));
    // Which versions the tile needs: sealed for keys below the largest boundary, exact for keys
    // at or above the smallest.
    const bool need_sealed = j0<b_hi, need_exact = j0 + n> b_lo;
    __syncthreads();  // the previous tile's reads are done
    for (int i = tid; i < n * D; i += kThreads) {
      const int jj = i / D, d = i - jj * D;
      const int64_t j = j0 + jj;
      if (need_sealed && j < b_hi) {
        ks[jj * DP + d] = sealed_key(L, j / L.T, s, j % L.T, d);
        vs[jj * D + d] = sealed_value(L, j / L.T, s, j % L.T, d);
      }
      if (need_exact && j >= b_lo) {
        kx[jj * DP + d] = exact_elem(L, true, s, j, d);
        vx[jj * D + d] = exact_elem(L, false, s, j, d);
      }
    }
    __syncthreads();
    // Scores: lane = key, one per row of the warp.
    const int64_t j = j0 + lane;
    float sc[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      sc[r] = -INFINITY;
      if (r >= RW) continue;
      const int row = warp * RW + r;
      const int64_t t = t0 + row / G;
      if (lane >= n || t >= a.Tq || j > L.offset - a.Tq + t) continue;
      const float* kr = (j < bnd[row] ? ks : kx) + lane * DP;
      const float* qr = qs + row * D;
      float x = 0.0f;
      for (int d = 0; d < D; ++d) x = fmaf(qr[d], kr[d], x);
      sc[r] = x;
    }
    // Online softmax per row, probabilities to shared memory.
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= RW) continue;
      float mx = sc[r];
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m[r], mx);
      // A row with no visible key yet keeps m = -inf: exp2(-inf - -inf) would be NaN.
      const float corr = m_new == -INFINITY ? 1.0f : exp2f(m[r] - m_new);
      const float p = sc[r] == -INFINITY ? 0.0f : exp2f(sc[r] - m_new);
      float sum = p;
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      l[r] = l[r] * corr + sum;
      m[r] = m_new;
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[r][k] *= corr;
      ps[(warp * RW + r) * kTileKeys + lane] = p;
    }
    __syncwarp();
    // P V: lane = dims lane + 32 k.
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r >= RW) continue;
      const int row = warp * RW + r;
      const float* pr = ps + row * kTileKeys;
      const int64_t bound = bnd[row];
      for (int jj = 0; jj < n; ++jj) {
        const float p = pr[jj];
        if (p == 0.0f) continue;  // warp-uniform: masked keys
        const float* vr = (j0 + jj < bound ? vs : vx) + jj * D;
#pragma unroll
        for (int k = 0; k < 8; ++k)
          if (lane + 32 * k < D) acc[r][k] = fmaf(p, vr[lane + 32 * k], acc[r][k]);
      }
    }
  }
  // Partials in the generic kernel's layout.
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    if (r >= RW) continue;
    const int row = warp * RW + r;
    const int64_t t = t0 + row / G;
    if (t >= a.Tq || row >= QT * G) continue;
    const int64_t g = row % G;
    const int64_t out_row = ((b * a.nh + hh) * G + g) * a.Tq + t;
    float* out = a.part_acc + (out_row * a.n_splits + split) * D;
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if (lane + 32 * k < D) out[lane + 32 * k] = acc[r][k];
    if (lane == 0) {
      a.part_ml[(out_row * a.n_splits + split) * 2] = m[r];
      a.part_ml[(out_row * a.n_splits + split) * 2 + 1] = l[r];
    }
  }
}

// ---- the tensor-core version (head_dim 64 and 128) ----
//
// FlashAttention-2's structure over dequantized tiles: 8 warps x 16 query rows (128 rows: the
// group's query heads at 128 / group consecutive positions), 64-key tiles dequantized (or copied
// from the window) into shared memory as fp16 — keys [key][dim], values transposed [dim][key] —
// then S = Q K^T and O += P V with mma.sync.m16n8k16 (fp16 operands, fp32 accumulation), the
// online softmax in registers, P fed from S's accumulators. A tile that some rows see sealed and
// others exact holds both versions: S is computed against both and each (row, key) takes its
// own, and P V runs twice with P split by the same choice. Queries and probabilities are
// rounded to fp16 (about 2^-11 relative), as the dequantized keys and values are.
constexpr int kMmaWarps = 8, kMmaRows = 16 * kMmaWarps, kKT = 64;

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
// pack_h2 saturated to +-65504, for dequantized values (a group reaching 65504 dequantizes past
// it: see dequant2_half in mma_codes.cuh) and queries (scaled into range first, saturated only
// from 2^126); the probabilities, at most 1, take pack_h2.
__device__ __forceinline__ uint32_t pack_h2_sat(float lo, float hi) {
  return pack_h2(sat_f16_range(lo), sat_f16_range(hi));
}
template <int D>
size_t mma_smem_bytes() {
  // K, K exact, V, V exact: [64][D + 8] halves; the warps' query fragments.
  return 2 * 4 * static_cast<size_t>(kKT) * (D + 8) +
         static_cast<size_t>(kMmaWarps) * D / 16 * 32 * 16;
}

// S[16 rows, 64 keys] of this warp against a key tile [key][dim] (row stride D + 8 halves): the
// k-slices outside, so that the 8 n-tiles' products are independent chains. The query
// fragments are in shared memory ([D / 16][32 lanes] x 16 bytes).
template <int D>
__device__ __forceinline__ void scores(const uint4* qf, const __half* kt, float (&c)[kKT / 8][4],
                                       int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < kKT / 8; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) c[nt][i] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint4 q = qf[kk * 32 + lane];
    const uint32_t a[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int nt = 0; nt < kKT / 8; ++nt) {
      const __half* row = kt + (nt * 8 + g) * (D + 8) + kk * 16 + 2 * t;
      mma16816(c[nt], a, *reinterpret_cast<const uint32_t*>(row),
               *reinterpret_cast<const uint32_t*>(row + 8));
    }
  }
}
// One n-tile of it (the exact version of a tile that holds both, a rare case).
template <int D>
__device__ __forceinline__ void scores8(const uint4* qf, const __half* kt, int nt, float (&c)[4],
                                        int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    const uint4 q = qf[kk * 32 + lane];
    const uint32_t a[4] = {q.x, q.y, q.z, q.w};
    const __half* row = kt + (nt * 8 + g) * (D + 8) + kk * 16 + 2 * t;
    mma16816(c, a, *reinterpret_cast<const uint32_t*>(row),
             *reinterpret_cast<const uint32_t*>(row + 8));
  }
}

// O[16 rows, D] += P[16 rows, 64 keys] V, V [key][dim] (row stride D + 8 halves): the B
// fragments (two keys of one dim per register) by ldmatrix.trans, lanes 0-15 naming the 16 key
// rows of a k-slice.
template <int D>
__device__ __forceinline__ void accumulate(const uint32_t (&pa)[kKT / 16][4], const __half* v,
                                           float (&o)[D / 8][4], int lane) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(v)) +
                        static_cast<uint32_t>((lane % 16) * (D + 8) * 2);
#pragma unroll
  for (int m = 0; m < kKT / 16; ++m)
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      uint32_t b0, b1;
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                   : "=r"(b0), "=r"(b1)
                   : "r"(base + static_cast<uint32_t>((m * 16 * (D + 8) + nd * 8) * 2)));
      mma16816(o[nd], pa[m], b0, b1);
    }
}

// Eight values (dims d0 .. d0 + 7) of one key or value row, as fp16, into `dst` (16 bytes):
// exact ones from the window page (one 16-byte load), sealed ones dequantized as stored.
__device__ __forceinline__ void put8(__half* dst, const float (&x)[8]) {
  uint4 w;
  w.x = pack_h2_sat(x[0], x[1]);
  w.y = pack_h2_sat(x[2], x[3]);
  w.z = pack_h2_sat(x[4], x[5]);
  w.w = pack_h2_sat(x[6], x[7]);
  *reinterpret_cast<uint4*>(dst) = w;
}
// Positions are below Ledger::kMaxTokens = 2^31: 32-bit division (a 64-bit one is a long
// subroutine, once per 8 values here).
__device__ __forceinline__ void exact8(const LayerDesc& L, bool keys, int64_t s, int64_t pos,
                                       int d0, __half* dst) {
  const uint32_t p32 = static_cast<uint32_t>(pos), P = static_cast<uint32_t>(L.P);
  const uint32_t page = p32 / P, in_page = p32 - page * P;
  const PtrPair pg = L.pages[page];
  const uint16_t* row =
      reinterpret_cast<const uint16_t*>(keys ? pg.k : pg.v) + (s * L.P + in_page) * L.D + d0;
  const uint4 w = *reinterpret_cast<const uint4*>(row);  // rows are 16-byte aligned (D % 8 == 0)
  if (!L.bf16_window) {
    *reinterpret_cast<uint4*>(dst) = w;
    return;
  }
  const uint32_t u[4] = {w.x, w.y, w.z, w.w};
  float x[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(u[i] << 16);
    x[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
  }
  put8(dst, x);
}
// KIVI's layout (and XQuant anchors) at 2, 4 or 8 bits with 4-byte aligned pairs: eight codes
// are one aligned 2-, 4- or 8-byte word; pairs are read as 32-bit words. The arithmetic is
// dequantize()'s (zero + code * scale in fp32), the same values as sealed_key/sealed_value.
__device__ __forceinline__ bool words_ok(const LayerDesc& L) {
  const bool bits_ok = (L.k_bits == 2 || L.k_bits == 4 || L.k_bits == 8) && L.k_bits == L.v_bits;
  return L.xq != 2 && !L.zip && bits_ok && L.kcode % 4 == 0 && L.vcode % 4 == 0 &&
         L.kparam % 4 == 0 && L.vparam % 4 == 0 && L.vgroup % 8 == 0;
}
__device__ __forceinline__ uint64_t code_word(const uint8_t* codes, int64_t first, int bits) {
  const uint8_t* p = codes + first * bits / 8;
  if (bits == 2) return *reinterpret_cast<const uint16_t*>(p);
  if (bits == 4) return *reinterpret_cast<const uint32_t*>(p);
  return *reinterpret_cast<const unsigned long long*>(p);
}
__device__ __forceinline__ float half_lo(uint32_t w) { return f16_val(static_cast<uint16_t>(w)); }
__device__ __forceinline__ float half_hi(uint32_t w) {
  return f16_val(static_cast<uint16_t>(w >> 16));
}

__device__ __forceinline__ void sealed8(const LayerDesc& L, bool keys, int64_t s, int64_t pos,
                                        int d0, __half* dst) {
  const uint32_t p32 = static_cast<uint32_t>(pos), T = static_cast<uint32_t>(L.T);
  const int64_t blk = p32 / T, tt = p32 - static_cast<uint32_t>(blk) * T;
  float x[8];
  if (words_ok(L)) {
    const int bits = L.k_bits;
    const uint32_t mask = (1u << bits) - 1u;
    if (keys) {
      const uint8_t* part = L.blocks[blk].k;
      const uint64_t w = code_word(part + s * L.kcode, tt * L.D + d0, bits);
      const uint32_t* pairs =
          reinterpret_cast<const uint32_t*>(part + L.S() * L.kcode + s * L.kparam) + d0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint32_t pr = pairs[i];
        x[i] = dequantize(static_cast<uint32_t>(w >> (i * bits)) & mask, half_lo(pr), half_hi(pr));
      }
    } else {
      const uint8_t* part = L.blocks[blk].v;
      const uint64_t w = code_word(part + s * L.vcode, tt * L.D + d0, bits);
      const uint32_t pr = reinterpret_cast<const uint32_t*>(
          part + L.S() * L.vcode + s * L.vparam)[tt * L.ng + d0 / L.vgroup];
      const float sc = half_lo(pr), z = half_hi(pr);
#pragma unroll
      for (int i = 0; i < 8; ++i)
        x[i] = dequantize(static_cast<uint32_t>(w >> (i * bits)) & mask, sc, z);
    }
  } else if (L.zip) {  // the row's place in its subset found once for its eight channels
    if (keys) {
      const ZipKeyRow r = zip_key_row(L, blk, s, tt);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = zip_key_elem(L, r, d0 + i);
    } else {
      const ZipValueRow r = zip_value_row(L, blk, s, tt);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[i] = zip_value_elem(L, r, d0 + i);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      x[i] = keys ? sealed_key(L, blk, s, tt, d0 + i) : sealed_value(L, blk, s, tt, d0 + i);
  }
  put8(dst, x);
}

template <int D>
__global__ void __launch_bounds__(kMmaWarps * 32, 2)
    chunk_mma_kernel(LayerDesc L, AttendArgs a, int n_qtiles) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  constexpr int KS = D + 8;  // row stride (halves): 16-byte rows, conflict-free fragment loads
  __half* ks = reinterpret_cast<__half*>(smem_raw);      // [64][D + 8] keys as sealed
  __half* kx = ks + kKT * KS;                            // keys exact
  __half* vs = kx + kKT * KS;                            // values as sealed
  __half* vx = vs + kKT * KS;                            // values exact
  uint4* qsm = reinterpret_cast<uint4*>(vx + kKT * KS);  // [warp][D / 16][32 lanes] Q fragments
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const int g = lane >> 2, t = lane & 3;
  const int G = L.group, QT = kMmaRows / G;
  const int64_t qtile = blockIdx.x % n_qtiles, bh = blockIdx.x / n_qtiles;
  const int64_t hh = bh % a.nh, b = bh / a.nh, h = a.h0 + hh, s = b * L.H + h;
  const int64_t t0 = qtile * QT, split = blockIdx.y;
  const SealRules rules{L.T, L.R};
  // This lane's two rows: warp * 16 + g and + 8; row r is query position t0 + r / G (index
  // into the chunk), query head h * G + r % G.
  int64_t pos[2], bnd[2];
  bool act[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = warp * 16 + g + 8 * e;
    const int64_t tq = t0 + r / G;
    act[e] = r < QT * G && tq < a.Tq;
    pos[e] = L.offset - a.Tq + tq;
    bnd[e] = act[e] ? rules.visible_sealed(pos[e], L.exact_begin) : 0;
  }
  // Query fragments (rows g, g + 8; dims 2t, 2t + 1 and + 8), scaled, in fp16, kept in shared
  // memory (registers hold the output accumulators and scores). A row whose largest |q| passes
  // fp16's range is scaled by 2^-e into it (exact; its scores then in units of k = 2^e) rather
  // than saturated: the warp packs its fragments again, scaled, when one of its rows needs it
  // (rarely; then `scaled` takes the softmax through k). A row of 2^126 or more is left as it is
  // (saturated).
  uint4* qf = qsm + warp * (D / 16) * 32;
  float qk[2] = {1.0f, 1.0f}, qmul[2] = {1.0f, 1.0f}, qmax[2] = {0.0f, 0.0f};
  auto pack_query = [&] {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t f[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = i & 1, d = kk * 16 + 2 * t + (i >> 1) * 8;
        const int r = warp * 16 + g + 8 * e;
        float x0 = 0.0f, x1 = 0.0f;
        if (act[e]) {
          const int64_t tq = t0 + r / G, hq = h * G + r % G;
          x0 = load_elem(a.q.data, a.q.dtype, offset_of(a.q, b, hq, tq, d)) * a.scale_log2;
          x1 = load_elem(a.q.data, a.q.dtype, offset_of(a.q, b, hq, tq, d + 1)) * a.scale_log2;
          qmax[e] = fmaxf(qmax[e], fmaxf(fabsf(x0), fabsf(x1)));
        }
        f[i] = pack_h2_sat(x0 * qmul[e], x1 * qmul[e]);
      }
      qf[kk * 32 + lane] = make_uint4(f[0], f[1], f[2], f[3]);
    }
  };
  pack_query();
  bool need = false;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int x = quad_scale_exponent(qmax[e], kF16MaxDev);
    qk[e] = exp2_int(x);
    qmul[e] = exp2_int(-x);
    need |= x != 0;
  }
  const bool scaled = __any_sync(0xffffffffu, need);
  if (scaled) {
    __syncwarp();
    pack_query();
  }
  __syncwarp();
  const int64_t t_last = imin(t0 + QT, a.Tq) - 1;
  const int64_t p_first = L.offset - a.Tq + t0, p_last = L.offset - a.Tq + t_last;
  const int64_t j_begin = split * a.split_len, j_end = imin(j_begin + a.split_len, p_last + 1);
  const int64_t b_lo = rules.visible_sealed(p_first, L.exact_begin);
  const int64_t b_hi = rules.visible_sealed(p_last, L.exact_begin);

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nd][e] = 0.0f;

  // Warps whose 16 rows are all past the chunk's queries only help fill the tiles.
  const bool warp_active = __any_sync(0xffffffffu, act[0] || act[1]);
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKT) {
    const int n = static_cast<int>(imin(kKT, j_end - j0));
    const bool need_sealed = j0<b_hi, need_exact = j0 + n> b_lo;
    __syncthreads();  // the previous tile's reads are done
    // Fill: item i is key i / (D / 8), dims 8 (i % (D / 8)) ..: consecutive threads, consecutive
    // 16-byte pieces of a row. Keys past the tile's end, or of a version no row reads, are zeros
    // (a zero value times a zero probability must not be NaN).
    for (int i = tid; i < kKT * (D / 8); i += kMmaWarps * 32) {
      const int jj = i / (D / 8), d0 = (i - jj * (D / 8)) * 8;
      const int64_t j = j0 + jj;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      if (need_sealed) {
        if (jj < n && j < b_hi) {
          sealed8(L, true, s, j, d0, ks + jj * KS + d0);
          sealed8(L, false, s, j, d0, vs + jj * KS + d0);
        } else {
          *reinterpret_cast<uint4*>(ks + jj * KS + d0) = zero;
          *reinterpret_cast<uint4*>(vs + jj * KS + d0) = zero;
        }
      }
      if (need_exact) {
        if (jj < n && j >= b_lo) {
          exact8(L, true, s, j, d0, kx + jj * KS + d0);
          exact8(L, false, s, j, d0, vx + jj * KS + d0);
        } else {
          *reinterpret_cast<uint4*>(kx + jj * KS + d0) = zero;
          *reinterpret_cast<uint4*>(vx + jj * KS + d0) = zero;
        }
      }
    }
    __syncthreads();
    if (!warp_active) continue;  // no row of this warp is a query (few queries: decode)
    // Scores against the version most keys use (sealed when the tile has it), then, for a tile
    // that holds both, the exact version of each n-tile where a row takes it; each (row, key)
    // takes its own (sealed below the row's boundary), then the causal mask and the tile's end.
    // Positions relative to the tile, in 32 bits: keys kj in [0, 64), row limits clamped.
    int lim[2], cut[2];  // row e: keys kj <= lim[e] visible; kj < cut[e] sealed
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      lim[e] = act[e] ? static_cast<int>(imax(-1, imin(pos[e] - j0, n - 1))) : -1;
      cut[e] = !need_exact    ? kKT
               : !need_sealed ? 0
                              : static_cast<int>(imax(0, imin(bnd[e] - j0, kKT)));
    }
    float sc[kKT / 8][4];
    scores<D>(qf, need_sealed ? ks : kx, sc, lane);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < kKT / 8; ++nt) {
      if (need_sealed && need_exact) {
        float cx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        scores8<D>(qf, kx, nt, cx, lane);
#pragma unroll
        for (int i = 0; i < 4; ++i)
          if (nt * 8 + 2 * t + (i & 1) >= cut[i >> 1]) sc[nt][i] = cx[i];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int e = i >> 1, kj = nt * 8 + 2 * t + (i & 1);
        if (kj > lim[e]) sc[nt][i] = -INFINITY;
        mx[e] = fmaxf(mx[e], sc[nt][i]);
      }
    }
    float corr[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 1));
      mx[e] = fmaxf(mx[e], __shfl_xor_sync(0xffffffffu, mx[e], 2));
      const float m_new = fmaxf(m[e], mx[e]);
      corr[e] = m_new == -INFINITY ? 1.0f : exp2f(scaled ? (m[e] - m_new) * qk[e] : m[e] - m_new);
      m[e] = m_new;
      l[e] *= corr[e];
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      o[nd][0] *= corr[0], o[nd][1] *= corr[0];
      o[nd][2] *= corr[1], o[nd][3] *= corr[1];
    }
    float(&p)[kKT / 8][4] = sc;  // probabilities in place of the scores
    if (scaled) {  // (a uniform branch: the common case keeps one subtraction per score)
#pragma unroll
      for (int nt = 0; nt < kKT / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int e = i >> 1;
          p[nt][i] = sc[nt][i] == -INFINITY ? 0.0f : exp2f((sc[nt][i] - m[e]) * qk[e]);
          l[e] += p[nt][i];
        }
    } else {
#pragma unroll
      for (int nt = 0; nt < kKT / 8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int e = i >> 1;
          p[nt][i] = sc[nt][i] == -INFINITY ? 0.0f : exp2f(sc[nt][i] - m[e]);
          l[e] += p[nt][i];
        }
    }
    // P as A fragments (k-slice mm: n-tiles 2 mm and 2 mm + 1), split by version when both.
    for (int pass = 0; pass < 2; ++pass) {
      const bool want_sealed = pass == 0;
      if (want_sealed ? !need_sealed : !need_exact) continue;
      uint32_t pa[kKT / 16][4];
#pragma unroll
      for (int mm = 0; mm < kKT / 16; ++mm)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int nt = 2 * mm + (i >> 1), c = (i & 1) * 2, e = i & 1;
          const int kj = nt * 8 + 2 * t;
          const float p0 = (kj < cut[e]) == want_sealed ? p[nt][c] : 0.0f;
          const float p1 = (kj + 1 < cut[e]) == want_sealed ? p[nt][c + 1] : 0.0f;
          pa[mm][i] = pack_h2(p0, p1);
        }
      accumulate<D>(pa, want_sealed ? vs : vx, o, lane);
    }
  }
  // The rows' sums over the quad, then the partials in the generic kernel's layout.
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 1);
    l[e] += __shfl_xor_sync(0xffffffffu, l[e], 2);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    if (!act[e]) continue;
    const int r = warp * 16 + g + 8 * e;
    const int64_t tq = t0 + r / G, gq = r % G;
    const int64_t out_row = ((b * a.nh + hh) * G + gq) * a.Tq + tq;
    float* out = a.part_acc + (out_row * a.n_splits + split) * D;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      out[nd * 8 + 2 * t] = o[nd][2 * e];
      out[nd * 8 + 2 * t + 1] = o[nd][2 * e + 1];
    }
    if (t == 0) {
      a.part_ml[(out_row * a.n_splits + split) * 2] = m[e] * qk[e];  // in true units
      a.part_ml[(out_row * a.n_splits + split) * 2 + 1] = l[e];
    }
  }
}

bool mma_ok(const LayerDesc& L) { return L.D == 64 || L.D == 128; }

}  // namespace

// Decode (Tq = 1) of the layers the decode kernel does not take comes here too: the tiles are
// dequantized once for the group's query heads instead of once per head and key by the generic
// kernel.
bool chunk_supported(const LayerDesc& L, int Tq) {
  return Tq >= 1 && L.D <= 256 && L.group >= 1 && L.group <= rows_for(L.D);
}

int chunk_qtiles(const LayerDesc& L, int Tq) {
  const int QT = (mma_ok(L) ? kMmaRows : rows_for(L.D)) / L.group;
  return (Tq + QT - 1) / QT;
}

template <int D>
void launch_mma(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(chunk_mma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   200 * 1024) == cudaSuccess);
    return true;
  }();
  (void)raised;
  const int nq = chunk_qtiles(L, a.Tq);
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(L.B) * a.nh * nq),
                  static_cast<unsigned>(a.n_splits));
  chunk_mma_kernel<D><<<grid, kMmaWarps * 32, mma_smem_bytes<D>(), st>>>(L, a, nq);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

void attend_chunk(const LayerDesc& L, const AttendArgs& a, cudaStream_t st) {
  if (L.D == 128) return launch_mma<128>(L, a, st);
  if (L.D == 64) return launch_mma<64>(L, a, st);
  static const bool raised = [] {
    KVQ_CHECK(cudaFuncSetAttribute(chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   200 * 1024) == cudaSuccess);
    return true;
  }();
  (void)raised;
  const int nq = chunk_qtiles(L, a.Tq);
  const dim3 grid(static_cast<unsigned>(static_cast<int64_t>(L.B) * a.nh * nq),
                  static_cast<unsigned>(a.n_splits));
  chunk_kernel<<<grid, kThreads, smem_bytes(L.D), st>>>(L, a, nq);
  KVQ_CHECK(cudaGetLastError() == cudaSuccess);
}

}  // namespace kvq::cuda
