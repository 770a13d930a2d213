#include "numerics/attention.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/cpu.h"
#include "numerics/kernels.h"

#if KVQ_SIMD_X86
#include <immintrin.h>
#endif
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 reports its own AVX-512 intrinsics' _mm512_undefined_ps() placeholders as "maybe
// uninitialized" once they are inlined into target-attributed functions (a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kvq {

namespace {

// The softmax update of one row once its scores s[0, nv) are known: the definition, shared by
// the reference and the portable paths. Inlined into the AVX2 clone of the portable path, where
// the fused multiply-adds and exp_f32's rounding are single instructions (at the baseline they
// are library calls).
KVQ_ALWAYS_INLINE void update_row(const float* s, int64_t nv, int64_t D, const float* v, float& m,
                                  float& l, float* acc, float* p) {
  float mx = m;
  for (int64_t j = 0; j < nv; ++j) mx = std::max(mx, s[j]);
  const float c = exp_f32(m - mx);
  for (int64_t j = 0; j < nv; ++j) p[j] = exp_f32(s[j] - mx);
  float lsum = l * c;
  for (int64_t j = 0; j < nv; ++j) lsum += p[j];
  for (int64_t d = 0; d < D; ++d) acc[d] *= c;
  for (int64_t j = 0; j < nv; ++j)
    for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(p[j], v[j * D + d], acc[d]);
  m = mx;
  l = lsum;
}

// Every row of a tile by the definition: scores as one fused multiply-add chain per key, then
// update_row. s and p hold n floats.
KVQ_ALWAYS_INLINE void attend_rows(const float* q, int64_t rows, int64_t D, const float* k,
                                   const float* v, const int64_t* visible, float* m, float* l,
                                   float* acc, float* s, float* p) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t nv = visible[r];
    if (nv == 0) continue;
    for (int64_t j = 0; j < nv; ++j) {
      float x = 0.0f;
      for (int64_t d = 0; d < D; ++d) x = std::fma(q[r * D + d], k[j * D + d], x);
      s[j] = x;
    }
    update_row(s, nv, D, v, m[r], l[r], acc + r * D, p);
  }
}

#if KVQ_SIMD_X86
// exp_f32 (numerics/kernels.h) lane by lane: the same operations in the same order.
KVQ_TARGET_AVX512 inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.0f);
  const __m512 cx = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(cx, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r =
      _mm512_sub_ps(_mm512_sub_ps(cx, _mm512_mul_ps(k, _mm512_set1_ps(0.693145751953125f))),
                    _mm512_mul_ps(k, _mm512_set1_ps(1.428606765330187e-06f)));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(0.5f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.0f));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), y, _mm512_setzero_ps());
  y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ), y,
                           _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  return y;
}

KVQ_TARGET_AVX512 void exp_row_avx512(const float* s, int64_t nv, float mx, float* p) {
  const __m512 m = _mm512_set1_ps(mx);
  for (int64_t j = 0; j < nv; j += 16) {
    const __mmask16 mk = nv - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nv - j)) - 1);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mk, s + j), m);
    _mm512_mask_storeu_ps(p + j, mk, exp16(x));
  }
}

// Scores of up to 4 rows against 16 keys of the transposed tile kt [D, ld].
template <int R>
KVQ_TARGET_AVX512 void scores_avx512(const float* q, int64_t D, const float* kt, int64_t ld,
                                     int64_t j0, float* s, int64_t lds) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kv = _mm512_loadu_ps(kt + d * ld + j0);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * D + d]), kv, a[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(s + r * lds + j0, a[r]);
}

// Blocks of 4 rows share every load of the tile: scores against the transposed keys, then the
// value accumulation with the 4 rows' accumulators in registers (64 channels at a time). A row's
// probabilities beyond its visible keys are exact zeros, and fma(0, v, acc) == acc bit for bit
// (acc is never -0: it starts at +0 and an exact-zero sum rounds to +0), so sharing the loop
// over the block's longest row changes no bit of the shorter rows.
KVQ_TARGET_AVX512 void attend_tile_avx512(const float* q, int64_t rows, int64_t D, const float* k,
                                          const float* v, int64_t n, const int64_t* visible,
                                          float* m, float* l, float* acc, Workspace& ws) {
  Workspace::Frame frame(ws);
  const int64_t ld = (n + 15) / 16 * 16;
  float* kt = ws.alloc<float>(static_cast<size_t>(D * ld));
  for (int64_t d = 0; d < D; ++d) {
    float* row = kt + d * ld;
    for (int64_t j = 0; j < n; ++j) row[j] = k[j * D + d];
    for (int64_t j = n; j < ld; ++j) row[j] = 0.0f;
  }
  constexpr int64_t kR = 4;
  float* s = ws.alloc<float>(static_cast<size_t>(kR * ld));
  float* p = ws.alloc<float>(static_cast<size_t>(kR * ld));
  float c[kR];
  for (int64_t r0 = 0; r0 < rows; r0 += kR) {
    const int64_t R = std::min(kR, rows - r0);
    int64_t need = 0;  // keys any of these rows sees
    for (int64_t r = 0; r < R; ++r) need = std::max(need, visible[r0 + r]);
    if (need == 0) continue;
    for (int64_t j0 = 0; j0 < need; j0 += 16) switch (R) {
        case 4:
          scores_avx512<4>(q + r0 * D, D, kt, ld, j0, s, ld);
          break;
        case 3:
          scores_avx512<3>(q + r0 * D, D, kt, ld, j0, s, ld);
          break;
        case 2:
          scores_avx512<2>(q + r0 * D, D, kt, ld, j0, s, ld);
          break;
        default:
          scores_avx512<1>(q + r0 * D, D, kt, ld, j0, s, ld);
          break;
      }
    // Per row: the new max, the correction, the probabilities (zero past the row's keys).
    for (int64_t r = 0; r < R; ++r) {
      const int64_t nv = visible[r0 + r];
      float* pr = p + r * ld;
      if (nv == 0) {
        c[r] = 1.0f;
        std::fill(pr, pr + need, 0.0f);
        continue;
      }
      const float* sr = s + r * ld;
      __m512 mv = _mm512_set1_ps(m[r0 + r]);
      for (int64_t j = 0; j < nv; j += 16) {
        const __mmask16 mk = nv - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nv - j)) - 1);
        mv = _mm512_mask_max_ps(mv, mk, mv, _mm512_maskz_loadu_ps(mk, sr + j));
      }
      const float mx = _mm512_reduce_max_ps(mv);
      c[r] = exp_f32(m[r0 + r] - mx);
      exp_row_avx512(sr, nv, mx, pr);
      std::fill(pr + nv, pr + need, 0.0f);
      m[r0 + r] = mx;
    }
    // l' = l c + p_0 + p_1 + ... in order; the rows' chains interleave.
    float lsum[kR];
    for (int64_t r = 0; r < R; ++r) lsum[r] = l[r0 + r] * c[r];
    for (int64_t j = 0; j < need; ++j)
      for (int64_t r = 0; r < R; ++r)
        if (j < visible[r0 + r]) lsum[r] += p[r * ld + j];
    for (int64_t r = 0; r < R; ++r)
      if (visible[r0 + r] > 0) l[r0 + r] = lsum[r];
    // acc' = acc c + sum_j p_j v_j, 64 channels at a time, rows' accumulators in registers.
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int64_t nd = std::min<int64_t>(64, D - d0);
      const int64_t chunks = (nd + 15) / 16;
      __mmask16 mk[4];
      for (int64_t x = 0; x < 4; ++x) {
        const int64_t left = nd - 16 * x;
        mk[x] = left >= 16 ? 0xFFFF : left > 0 ? static_cast<__mmask16>((1u << left) - 1) : 0;
      }
      __m512 a[kR][4];
      for (int64_t r = 0; r < R; ++r)
        for (int64_t x = 0; x < chunks; ++x)
          a[r][x] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk[x], acc + (r0 + r) * D + d0 + 16 * x),
                                  _mm512_set1_ps(c[r]));
      for (int64_t j = 0; j < need; ++j) {
        __m512 vj[4];
        for (int64_t x = 0; x < chunks; ++x)
          vj[x] = _mm512_maskz_loadu_ps(mk[x], v + j * D + d0 + 16 * x);
        for (int64_t r = 0; r < R; ++r) {
          const __m512 pj = _mm512_set1_ps(p[r * ld + j]);
          for (int64_t x = 0; x < chunks; ++x) a[r][x] = _mm512_fmadd_ps(pj, vj[x], a[r][x]);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        if (visible[r0 + r] == 0) continue;
        for (int64_t x = 0; x < chunks; ++x)
          _mm512_mask_storeu_ps(acc + (r0 + r) * D + d0 + 16 * x, mk[x], a[r][x]);
      }
    }
  }
}

// The portable path for AVX2 machines (no AVX2 kernel of its own yet): the definition compiled
// with FMA and AVX2, the same bits.
KVQ_TARGET_AVX2 void attend_tile_avx2(const float* q, int64_t rows, int64_t D, const float* k,
                                      const float* v, int64_t n, const int64_t* visible, float* m,
                                      float* l, float* acc, Workspace& ws) {
  Workspace::Frame frame(ws);
  float* s = ws.alloc<float>(static_cast<size_t>(n));
  float* p = ws.alloc<float>(static_cast<size_t>(n));
  attend_rows(q, rows, D, k, v, visible, m, l, acc, s, p);
}
#endif

}  // namespace

void attend_tile_reference(const float* q, int64_t rows, int64_t D, const float* k, const float* v,
                           int64_t n, const int64_t* visible, float* m, float* l, float* acc) {
  float* s = new float[static_cast<size_t>(std::max<int64_t>(n, 1))];
  float* p = new float[static_cast<size_t>(std::max<int64_t>(n, 1))];
  attend_rows(q, rows, D, k, v, visible, m, l, acc, s, p);
  delete[] s;
  delete[] p;
}

void attend_tile(const float* q, int64_t rows, int64_t D, const float* k, const float* v, int64_t n,
                 const int64_t* visible, float* m, float* l, float* acc, Workspace& ws) {
#if KVQ_SIMD_X86
  switch (simd_level()) {
    case SimdLevel::kAvx512:
      return attend_tile_avx512(q, rows, D, k, v, n, visible, m, l, acc, ws);
    case SimdLevel::kAvx2:
      return attend_tile_avx2(q, rows, D, k, v, n, visible, m, l, acc, ws);
    case SimdLevel::kScalar:
      break;
  }
#endif
  // Portable path: the definition, with scratch from the workspace.
  Workspace::Frame frame(ws);
  float* s = ws.alloc<float>(static_cast<size_t>(n));
  float* p = ws.alloc<float>(static_cast<size_t>(n));
  attend_rows(q, rows, D, k, v, visible, m, l, acc, s, p);
}

}  // namespace kvq
