#include "kvq/group_quant.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/cpu.h"
#if KVQ_SIMD_X86
#include <immintrin.h>
#endif
#include "kvq/dtype.h"
#include "kvq/status.h"

namespace kvq {

namespace {
constexpr uint16_t kF16MaxBits = 0x7bff;

// Stored layouts put parameters right after packed codes, at any byte offset (e.g. 5 bytes of
// 3-bit codes): parameter arrays are read and written with memcpy, never through a possibly
// misaligned QuantParams lvalue (undefined behaviour that UBSan reports).
QuantParams load_params(const QuantParams* p, int64_t i) {
  QuantParams q;
  std::memcpy(&q, reinterpret_cast<const unsigned char*>(p) + i * static_cast<int64_t>(sizeof q),
              sizeof q);
  return q;
}
void store_params(QuantParams* p, int64_t i, const QuantParams& q) {
  std::memcpy(reinterpret_cast<unsigned char*>(p) + i * static_cast<int64_t>(sizeof q), &q,
              sizeof q);
}

uint16_t f16_next_down(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001;  // +-0 -> smallest negative subnormal
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}
uint16_t f16_next_up(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001;
  return (h & 0x8000u) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}
}  // namespace

uint16_t f16_round_down(float x) {
  uint16_t h = f32_to_f16(x);
  if (f16_to_f32(h) > x) h = f16_next_down(h);
  return h;
}

uint16_t f16_round_up(float x) {
  uint16_t h = f32_to_f16(x);
  if (f16_to_f32(h) < x) h = f16_next_up(h);
  return h;
}

QuantParams fit_range(float lo, float hi, int bits) {
  KVQ_CHECK(bits >= 1 && bits <= 8);
  const float qmax = static_cast<float>((1 << bits) - 1);
  QuantParams p;
  p.zero = f16_round_down(lo);
  const float zero = f16_to_f32(p.zero);
  float scale = std::max((hi - zero) / qmax, kScaleEps);
  p.scale = scale >= kF16Max ? kF16MaxBits : f16_round_up(scale);
  return p;
}

namespace {

// The loops below are compiled once per SIMD level (core/cpu.h): the codes loops vectorise (and
// std::nearbyint becomes one rounding instruction from the AVX2 level on; at the baseline it is
// a library call). Element-wise IEEE arithmetic without contraction: every level stores the same
// codes and parameters.

template <SimdLevel L>
KVQ_ALWAYS_INLINE QuantParams fit_group_body(const float* x, size_t n, ptrdiff_t stride, int bits) {
  KVQ_CHECK(n > 0);
  float lo = x[0], hi = x[0];
  for (size_t i = 1; i < n; ++i) {
    const float v = x[static_cast<ptrdiff_t>(i) * stride];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  return fit_range(lo, hi, bits);
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void quantize_group_body(const float* x, size_t n, ptrdiff_t stride,
                                           QuantParams p, int bits, uint8_t* codes,
                                           ptrdiff_t code_stride) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float zero = f16_to_f32(p.zero);
  const float inv = 1.0f / f16_to_f32(p.scale);
  if (stride == 1 && code_stride == 1) {  // the common case, as a loop that vectorises
    for (size_t i = 0; i < n; ++i)
      codes[i] = static_cast<uint8_t>(std::clamp(std::nearbyint((x[i] - zero) * inv), 0.0f, qmax));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[static_cast<ptrdiff_t>(i) * stride] - zero) * inv);
    codes[static_cast<ptrdiff_t>(i) * code_stride] =
        static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
  }
}

// Branch-free fp16 conversions for fit_ranges_body's scalar loop. Selects are masks (c ? a : b
// with c all ones or zero): GCC's if-conversion gave up on the ternary form ("control flow in
// loop").
KVQ_ALWAYS_INLINE uint32_t mask_of(bool c) { return 0u - static_cast<uint32_t>(c); }
KVQ_ALWAYS_INLINE uint32_t select(uint32_t m, uint32_t a, uint32_t b) { return (m & a) | (~m & b); }
KVQ_ALWAYS_INLINE uint32_t f16_bits_rne(float x) {  // f32_to_f16 for finite |x| < 65520
  const uint32_t b = std::bit_cast<uint32_t>(x);
  const uint32_t sign = (b >> 16) & 0x8000u, ax = b & 0x7fffffffu;
  const uint32_t normal = (ax + 0xc8000fffu + ((ax >> 13) & 1u)) >> 13;
  const uint32_t sub = std::bit_cast<uint32_t>(std::bit_cast<float>(ax) + 0.5f) - 0x3f000000u;
  return sign | select(mask_of(ax < 0x38800000u), sub, normal);
}
KVQ_ALWAYS_INLINE float f16_value(uint32_t h) {  // f16_to_f32 for finite h
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  const float sub = static_cast<float>(mant) * 5.9604644775390625e-8f;
  const uint32_t normal = sign | ((exp + 112u) << 23) | (mant << 13);
  return std::bit_cast<float>(select(mask_of(exp == 0), sign | std::bit_cast<uint32_t>(sub), normal));
}

#if KVQ_SIMD_X86
// Eight fits at once (F16C's conversions round to nearest even, as f32_to_f16 does): the same
// parameters, zeros and inverse scales as the loop below.
KVQ_TARGET_AVX2 inline __m128i to16(__m256 m) {  // 8 x 32-bit masks -> 8 x 16-bit masks
  const __m256i i = _mm256_castps_si256(m);
  return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
}
KVQ_TARGET_AVX2 inline void fit8_avx2(const float* lo, const float* hi, float qmax_s,
                                      QuantParams* p, float* zero, float* inv) {
  const __m256 l = _mm256_loadu_ps(lo), qmax = _mm256_set1_ps(qmax_s);
  __m128i zh = _mm256_cvtps_ph(l, _MM_FROUND_TO_NEAREST_INT);
  const __m128i one = _mm_set1_epi16(1);
  __m128i down = _mm_add_epi16(_mm_sub_epi16(zh, one), _mm_slli_epi16(_mm_srli_epi16(zh, 15), 1));
  down = _mm_blendv_epi8(down, _mm_set1_epi16(static_cast<short>(0x8001)),
                         _mm_cmpeq_epi16(_mm_and_si128(zh, _mm_set1_epi16(0x7fff)),
                                         _mm_setzero_si128()));
  zh = _mm_blendv_epi8(zh, down, to16(_mm256_cmp_ps(_mm256_cvtph_ps(zh), l, _CMP_GT_OQ)));
  const __m256 zf = _mm256_cvtph_ps(zh);
  const __m256 s0 = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(hi), zf), qmax);
  const __m256 eps = _mm256_set1_ps(kScaleEps), fmax = _mm256_set1_ps(kF16Max);
  const __m256 s = _mm256_blendv_ps(s0, eps, _mm256_cmp_ps(s0, eps, _CMP_LT_OQ));
  __m128i sh = _mm256_cvtps_ph(_mm256_min_ps(s, fmax), _MM_FROUND_TO_NEAREST_INT);
  sh = _mm_blendv_epi8(sh, _mm_add_epi16(sh, one),
                       to16(_mm256_cmp_ps(_mm256_cvtph_ps(sh), s, _CMP_LT_OQ)));
  sh = _mm_blendv_epi8(sh, _mm_set1_epi16(static_cast<short>(kF16MaxBits)),
                       to16(_mm256_cmp_ps(s, fmax, _CMP_GE_OQ)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_unpacklo_epi16(sh, zh));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p) + 1, _mm_unpackhi_epi16(sh, zh));
  _mm256_storeu_ps(zero, zf);
  _mm256_storeu_ps(inv, _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_cvtph_ps(sh)));
}

// min and max of 32 floats (a tree: exact for non-NaN values up to which zero is kept).
KVQ_TARGET_AVX2 inline void range32_avx2(const float* x, float& lo, float& hi) {
  const __m256 a = _mm256_loadu_ps(x), b = _mm256_loadu_ps(x + 8), c = _mm256_loadu_ps(x + 16),
               d = _mm256_loadu_ps(x + 24);
  const __m256 mn = _mm256_min_ps(_mm256_min_ps(a, b), _mm256_min_ps(c, d));
  const __m256 mx = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(mn), _mm256_extractf128_ps(mn, 1));
  __m128 M = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  M = _mm_max_ps(M, _mm_movehl_ps(M, M));
  lo = _mm_cvtss_f32(_mm_min_ss(m, _mm_shuffle_ps(m, m, 1)));
  hi = _mm_cvtss_f32(_mm_max_ss(M, _mm_shuffle_ps(M, M, 1)));
}

// Eight stored {scale, zero} fp16 pairs (any alignment) to floats. F16C's conversion is exact
// and equals f16_to_f32 for every pattern (NaNs quieted alike).
KVQ_TARGET_AVX2 inline void params8_avx2(const unsigned char* p, float* zero, float* scale) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i s32 = _mm256_and_si256(v, _mm256_set1_epi32(0xffff)), z32 = _mm256_srli_epi32(v, 16);
  const __m256i pk = _mm256_permute4x64_epi64(_mm256_packus_epi32(s32, z32), 0xD8);
  _mm256_storeu_ps(scale, _mm256_cvtph_ps(_mm256_castsi256_si128(pk)));
  _mm256_storeu_ps(zero, _mm256_cvtph_ps(_mm256_extracti128_si256(pk, 1)));
}
#endif

// Parameters i0 .. i0 + n - 1 as floats.
template <SimdLevel L>
KVQ_ALWAYS_INLINE void params_to_f32_body(const QuantParams* params, int64_t i0, int64_t n,
                                          float* zero, float* scale) {
  int64_t i = 0;
#if KVQ_SIMD_X86
  if constexpr (L != SimdLevel::kScalar)
    for (; i + 8 <= n; i += 8)
      params8_avx2(reinterpret_cast<const unsigned char*>(params) +
                       static_cast<size_t>(i0 + i) * sizeof(QuantParams),
                   zero + i, scale + i);
#endif
  for (; i < n; ++i) {
    const QuantParams p = load_params(params, i0 + i);
    zero[i] = f16_to_f32(p.zero);
    scale[i] = f16_to_f32(p.scale);
  }
}

// fit_range over arrays: parameters p, and the zeros and inverse scales the codes loop uses (the
// scalar fit_range, with its branchy fp16 conversions, was a third of KIVI's encode). The same
// arithmetic as fit_range for finite |lo|, |hi| <= 65504 (the inputs a cache accepts): fp16
// conversions that round to nearest even (normal and subnormal results), the next fp16 down or
// up where that rounding went the wrong way, the scale clamped to kScaleEps and to fp16's max.
// From the AVX2 level, 8 at a time with F16C (fit8_avx2); the rest, and the scalar level, one
// at a time without branches.
template <SimdLevel L>
KVQ_ALWAYS_INLINE void fit_ranges_body(const float* lo, const float* hi, int64_t n, int bits,
                                       QuantParams* p, float* zero, float* inv) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  int64_t i = 0;
#if KVQ_SIMD_X86
  if constexpr (L != SimdLevel::kScalar)
    for (; i + 8 <= n; i += 8)
      fit8_avx2(lo + i, hi + i, qmax, p + i, zero + i, inv + i);
#endif
  for (; i < n; ++i) {
    uint32_t zh = f16_bits_rne(lo[i]);  // f16_round_down(lo): the next fp16 down if above lo
    const uint32_t zdown =
        select(mask_of((zh & 0x7fffu) == 0), 0x8001u, zh - 1 + 2 * (zh >> 15));
    zh = select(mask_of(f16_value(zh) > lo[i]), zdown, zh);
    const float zf = f16_value(zh);
    const float s0 = (hi[i] - zf) / qmax;
    const float s = s0 < kScaleEps ? kScaleEps : s0;  // std::max(s0, kScaleEps)
    uint32_t sh = f16_bits_rne(std::min(s, kF16Max));  // f16_round_up(s): s > 0
    sh = select(mask_of(f16_value(sh) < s), sh + 1, sh);
    sh = select(mask_of(s >= kF16Max), kF16MaxBits, sh);
    p[i].scale = static_cast<uint16_t>(sh);
    p[i].zero = static_cast<uint16_t>(zh);
    zero[i] = zf;
    inv[i] = 1.0f / f16_value(sh);
  }
}

// min and max of x[0, n) exactly as the sequential std::min/std::max loop finds them: groups of
// 32 by an AVX2 tree (from the AVX2 level), others of >= 16 in 8 lanes (vectorizes), then again
// sequentially when a result is zero (only then can a tree have kept a different one of +0 and
// -0 than the first-seen the loop keeps).
template <SimdLevel L>
KVQ_ALWAYS_INLINE void range_body(const float* x, int64_t n, float& lo_out, float& hi_out) {
  float lo, hi;
#if KVQ_SIMD_X86
  if constexpr (L != SimdLevel::kScalar)
    if (n == 32) {
      range32_avx2(x, lo, hi);
      if (lo != 0.0f && hi != 0.0f) {
        lo_out = lo, hi_out = hi;
        return;
      }
    }
#endif
  if (n >= 16 && n != 32) {
    float l[8], h[8];
    for (int k = 0; k < 8; ++k) l[k] = h[k] = x[k];
    int64_t i = 8;
    for (; i + 8 <= n; i += 8)
      for (int k = 0; k < 8; ++k) {
        l[k] = std::min(l[k], x[i + k]);
        h[k] = std::max(h[k], x[i + k]);
      }
    for (; i < n; ++i) l[0] = std::min(l[0], x[i]), h[0] = std::max(h[0], x[i]);
    for (int w = 4; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) l[k] = std::min(l[k], l[k + w]), h[k] = std::max(h[k], h[k + w]);
    lo = l[0], hi = h[0];
    if (lo != 0.0f && hi != 0.0f) {
      lo_out = lo, hi_out = hi;
      return;
    }
  }
  lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
  lo_out = lo, hi_out = hi;
}

// Per-channel parameters live in stack arrays of one tile of channels at a time (channels are
// independent, so tiling changes no result), so these public functions need neither a heap nor
// caller scratch.
constexpr int64_t kChannelTile = 256;

// GCC turns the min/max updates of a local array into conditional scalar stores (legal for
// memory nothing else can see) and then cannot vectorize the loop (measured: per-channel
// quantization 3x slower). Hiding the arrays' provenance keeps the unconditional, vectorized
// form the loop had when its scratch was on the heap.
template <class T>
KVQ_ALWAYS_INLINE T* opaque(T* p) {
#if defined(__GNUC__)
  asm("" : "+r"(p));
#endif
  return p;
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void quantize_per_channel_body(const float* x, int64_t T, int64_t D, int64_t ld,
                                                 int bits, uint8_t* codes, QuantParams* params) {
  // Per tile: the range per channel in one pass over rows (cache-friendly), then codes row by row.
  float l_tile[kChannelTile], h_tile[kChannelTile], z[kChannelTile], iv[kChannelTile];
  float* const l = opaque(l_tile);
  float* const h = opaque(h_tile);
  const float qmax = static_cast<float>((1 << bits) - 1);
  for (int64_t d0 = 0; d0 < D; d0 += kChannelTile) {
    const int64_t n = std::min(kChannelTile, D - d0);
    const float* const x0 = x + d0;
    std::copy(x0, x0 + n, l);
    std::copy(x0, x0 + n, h);
    for (int64_t t = 1; t < T; ++t) {
      const float* row = x0 + t * ld;
      for (int64_t d = 0; d < n; ++d) {
        l[d] = std::min(l[d], row[d]);
        h[d] = std::max(h[d], row[d]);
      }
    }
    QuantParams p[kChannelTile];
    fit_ranges_body<L>(l, h, n, bits, p, z, iv);
    for (int64_t d = 0; d < n; ++d) store_params(params, d0 + d, p[d]);
    for (int64_t t = 0; t < T; ++t) {
      const float* row = x0 + t * ld;
      uint8_t* c = codes + t * D + d0;
      for (int64_t d = 0; d < n; ++d) {
        const float q = std::nearbyint((row[d] - z[d]) * iv[d]);
        c[d] = static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
      }
    }
  }
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void dequantize_per_channel_body(const uint8_t* codes, int64_t T, int64_t D,
                                                   const QuantParams* params, float* out) {
  float zero[kChannelTile], scale[kChannelTile];
  for (int64_t d0 = 0; d0 < D; d0 += kChannelTile) {
    const int64_t n = std::min(kChannelTile, D - d0);
    params_to_f32_body<L>(params, d0, n, zero, scale);
    for (int64_t t = 0; t < T; ++t) {
      const uint8_t* c = codes + t * D + d0;
      float* o = out + t * D + d0;
      for (int64_t d = 0; d < n; ++d) o[d] = zero[d] + static_cast<float>(c[d]) * scale[d];
    }
  }
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void quantize_per_token_body(const float* x, int64_t T, int64_t D, int64_t ld,
                                               int64_t G, int bits, uint8_t* codes,
                                               QuantParams* params) {
  // Per tile of tokens: the ranges of their groups, then the parameters together (vectorized),
  // then the codes group by group.
  const int64_t ng = n_channel_groups(D, G);
  if (ng > kChannelTile) {  // more groups per token than a tile (G < D / 256): one at a time
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t d0 = g * G, n = std::min(G, D - d0);
        const QuantParams q = fit_group_body<L>(x + t * ld + d0, static_cast<size_t>(n), 1, bits);
        store_params(params, t * ng + g, q);
        quantize_group_body<L>(x + t * ld + d0, static_cast<size_t>(n), 1, q, bits,
                               codes + t * D + d0, 1);
      }
    return;
  }
  const int64_t tile = kChannelTile / ng;
  const float qmax = static_cast<float>((1 << bits) - 1);
  float lo[kChannelTile], hi[kChannelTile], z[kChannelTile], iv[kChannelTile];
  QuantParams p[kChannelTile];
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t nt = std::min(tile, T - t0);
    for (int64_t t = 0, i = 0; t < nt; ++t)
      for (int64_t d0 = 0; d0 < D; d0 += G, ++i)
        range_body<L>(x + (t0 + t) * ld + d0, std::min(G, D - d0), lo[i], hi[i]);
    fit_ranges_body<L>(lo, hi, nt * ng, bits, p, z, iv);
    for (int64_t t = 0, i = 0; t < nt; ++t)
      for (int64_t g = 0, d0 = 0; g < ng; ++g, d0 += G, ++i) {
        store_params(params, (t0 + t) * ng + g, p[i]);
        const int64_t m = std::min(G, D - d0);
        const float* xr = x + (t0 + t) * ld + d0;
        uint8_t* c = codes + (t0 + t) * D + d0;
        const float zi = z[i], ivi = iv[i];
        for (int64_t d = 0; d < m; ++d)
          c[d] = static_cast<uint8_t>(std::clamp(std::nearbyint((xr[d] - zi) * ivi), 0.0f, qmax));
      }
  }
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void dequantize_per_token_body(const uint8_t* codes, int64_t T, int64_t D,
                                                 int64_t G, const QuantParams* params, float* out) {
  // Per tile of tokens: their parameters converted together (vectorized), then the values.
  const int64_t ng = n_channel_groups(D, G);
  float zs[kChannelTile], ss[kChannelTile];
  auto row = [&](int64_t t, int64_t g0, int64_t m, const float* z, const float* sc) {
    for (int64_t g = g0; g < g0 + m; ++g) {
      const float zero = z[g - g0], scale = sc[g - g0];
      const int64_t d0 = g * G, d1 = std::min(D, d0 + G);
      const uint8_t* c = codes + t * D;
      float* o = out + t * D;
      for (int64_t d = d0; d < d1; ++d) o[d] = zero + static_cast<float>(c[d]) * scale;
    }
  };
  if (ng > kChannelTile) {  // more groups per token than a tile: a tile of groups at a time
    for (int64_t t = 0; t < T; ++t)
      for (int64_t g0 = 0; g0 < ng; g0 += kChannelTile) {
        const int64_t m = std::min(kChannelTile, ng - g0);
        params_to_f32_body<L>(params, t * ng + g0, m, zs, ss);
        row(t, g0, m, zs, ss);
      }
    return;
  }
  const int64_t tile = kChannelTile / ng;
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t nt = std::min(tile, T - t0);
    params_to_f32_body<L>(params, t0 * ng, nt * ng, zs, ss);
    for (int64_t t = 0; t < nt; ++t) row(t0 + t, 0, ng, zs + t * ng, ss + t * ng);
  }
}

KVQ_LEVEL_CLONES(QuantParams, fit_group, (const float* x, size_t n, ptrdiff_t stride, int bits),
                 (x, n, stride, bits))
KVQ_LEVEL_CLONES(void, quantize_group,
                 (const float* x, size_t n, ptrdiff_t stride, QuantParams p, int bits,
                  uint8_t* codes, ptrdiff_t code_stride),
                 (x, n, stride, p, bits, codes, code_stride))
KVQ_LEVEL_CLONES(void, quantize_per_channel,
                 (const float* x, int64_t T, int64_t D, int64_t ld, int bits, uint8_t* codes,
                  QuantParams* params),
                 (x, T, D, ld, bits, codes, params))
KVQ_LEVEL_CLONES(void, dequantize_per_channel,
                 (const uint8_t* codes, int64_t T, int64_t D, const QuantParams* params,
                  float* out),
                 (codes, T, D, params, out))
KVQ_LEVEL_CLONES(void, quantize_per_token,
                 (const float* x, int64_t T, int64_t D, int64_t ld, int64_t G, int bits,
                  uint8_t* codes, QuantParams* params),
                 (x, T, D, ld, G, bits, codes, params))
KVQ_LEVEL_CLONES(void, dequantize_per_token,
                 (const uint8_t* codes, int64_t T, int64_t D, int64_t G, const QuantParams* params,
                  float* out),
                 (codes, T, D, G, params, out))

}  // namespace

QuantParams fit_group(const float* x, size_t n, ptrdiff_t stride, int bits) {
  KVQ_LEVEL_DISPATCH(fit_group, (x, n, stride, bits));
}

void quantize_group(const float* x, size_t n, ptrdiff_t stride, QuantParams p, int bits,
                    uint8_t* codes, ptrdiff_t code_stride) {
  KVQ_LEVEL_DISPATCH(quantize_group, (x, n, stride, p, bits, codes, code_stride));
}

void quantize_per_channel(const float* x, int64_t T, int64_t D, int64_t ld, int bits,
                          uint8_t* codes, QuantParams* params) {
  KVQ_LEVEL_DISPATCH(quantize_per_channel, (x, T, D, ld, bits, codes, params));
}

void dequantize_per_channel(const uint8_t* codes, int64_t T, int64_t D, const QuantParams* params,
                            float* out) {
  KVQ_LEVEL_DISPATCH(dequantize_per_channel, (codes, T, D, params, out));
}

void quantize_per_token(const float* x, int64_t T, int64_t D, int64_t ld, int64_t G, int bits,
                        uint8_t* codes, QuantParams* params) {
  KVQ_LEVEL_DISPATCH(quantize_per_token, (x, T, D, ld, G, bits, codes, params));
}

void dequantize_per_token(const uint8_t* codes, int64_t T, int64_t D, int64_t G,
                          const QuantParams* params, float* out) {
  KVQ_LEVEL_DISPATCH(dequantize_per_token, (codes, T, D, G, params, out));
}

void quant_dequant_per_channel(const float* x, int64_t T, int64_t D, int bits, float* out) {
  std::vector<uint8_t> codes(static_cast<size_t>(T * D));
  std::vector<QuantParams> params(static_cast<size_t>(D));
  quantize_per_channel(x, T, D, D, bits, codes.data(), params.data());
  dequantize_per_channel(codes.data(), T, D, params.data(), out);
}

void quant_dequant_per_token(const float* x, int64_t T, int64_t D, int64_t G, int bits,
                             float* out) {
  std::vector<uint8_t> codes(static_cast<size_t>(T * D));
  std::vector<QuantParams> params(static_cast<size_t>(T * n_channel_groups(D, G)));
  quantize_per_token(x, T, D, D, G, bits, codes.data(), params.data());
  dequantize_per_token(codes.data(), T, D, G, params.data(), out);
}

}  // namespace kvq
