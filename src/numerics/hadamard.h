// The orthonormal Walsh-Hadamard transform of order n (a power of two), in place: the
// unnormalized butterflies (a, b) -> (a + b, a - b) at strides 1, 2, 4, ..., then one scaling by
// 1/sqrt(n). Shared by the methods that rotate (kvq, turboquant, llama.cpp's formats).
//
// Every function here is KVQ_ALWAYS_INLINE plain C++: it compiles into the per-level clones of
// its caller (core/cpu.h). Each output is the same IEEE sums, with the same operand order, in
// the same stage order whatever the loop order or vector width, so every level (and the loop
// this replaced) gives the same bits. Strides 1 and 2 are done with 4-lane shuffles (a strided
// butterfly does not auto-vectorise), strides >= 4 with whole 4-, 8- or 16-lane vectors (GCC
// vector extensions, lowered to each clone's widest registers; auto-vectorisation fell back to
// scalar code at strides below the vector width); the usual orders (64, 128) get a fixed-length
// copy.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/cpu.h"

#if KVQ_SIMD_X86
#include <immintrin.h>
#endif

namespace kvq {

namespace hadamard_detail {

// Strides 1 and 2 over [n] (n a multiple of 4): within each group of 4 values
// (x0, x1, x2, x3) -> (x0 + x1, x0 - x1, x2 + x3, x2 - x3) -> then pairs (0, 2), (1, 3).
KVQ_ALWAYS_INLINE void stages_1_2(float* x, int64_t n) {
  typedef float v4 __attribute__((vector_size(16)));
  for (int64_t i = 0; i < n; i += 4) {
    v4 v;
    std::memcpy(&v, x + i, 16);
    v4 sw = __builtin_shufflevector(v, v, 1, 0, 3, 2);
    v = __builtin_shufflevector(v + sw, sw - v, 0, 5, 2, 7);  // lane 1: x0 - x1, lane 3: x2 - x3
    sw = __builtin_shufflevector(v, v, 2, 3, 0, 1);
    v = __builtin_shufflevector(v + sw, sw - v, 0, 1, 6, 7);  // lanes 2, 3: x0 - x2, x1 - x3
    std::memcpy(x + i, &v, 16);
  }
}

// One stride-h butterfly stage over [n] with W-lane vectors (h a multiple of W): both halves
// are contiguous runs, so whole vectors go through a + b and a - b.
template <int W>
KVQ_ALWAYS_INLINE void stage_vec(float* x, int64_t n, int64_t h) {
  typedef float vw __attribute__((vector_size(4 * W)));
  for (int64_t i = 0; i < n; i += 2 * h)
    for (int64_t j = i; j < i + h; j += W) {
      vw a, b;
      std::memcpy(&a, x + j, 4 * W);
      std::memcpy(&b, x + j + h, 4 * W);
      const vw s = a + b, d = a - b;
      std::memcpy(x + j, &s, 4 * W);
      std::memcpy(x + j + h, &d, 4 * W);
    }
}

// Strides h0, 2 h0, ... < n (h0 >= 4 a power of two, or 1 for tiny n with the scalar loop).
KVQ_ALWAYS_INLINE void stages_from(float* x, int64_t n, int64_t h0) {
  int64_t h = h0;
  if (h >= 4) {
    for (; h < n && h < 8; h *= 2) stage_vec<4>(x, n, h);
    for (; h < n && h < 16; h *= 2) stage_vec<8>(x, n, h);
    for (; h < n; h *= 2) stage_vec<16>(x, n, h);
    return;
  }
  for (; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
}

template <int64_t N>
KVQ_ALWAYS_INLINE void fixed(float* x) {
  stages_1_2(x, N);
  stages_from(x, N, 4);
  const float s = 1.0f / std::sqrt(static_cast<float>(N));
  for (int64_t i = 0; i < N; ++i) x[i] *= s;
}

}  // namespace hadamard_detail

// y = H x in place, H the orthonormal Walsh-Hadamard matrix of order n (a power of two).
KVQ_ALWAYS_INLINE void hadamard_inplace(float* x, int64_t n) {
  if (n == 64) return hadamard_detail::fixed<64>(x);
  if (n == 128) return hadamard_detail::fixed<128>(x);
  if (n >= 4) {
    hadamard_detail::stages_1_2(x, n);
    hadamard_detail::stages_from(x, n, 4);
  } else {
    hadamard_detail::stages_from(x, n, 1);
  }
  const float s = 1.0f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

#if KVQ_SIMD_X86
// Order 64 in registers (4 zmm / 8 ymm): the same stages in the same order, each output of a
// stage x[j] + x[j + h] (lower half) or x[j] - x[j + h] (upper half), so the bits of
// hadamard_inplace. Within a register the partner comes from a permute: the lower lanes take
// v + partner, the upper ones partner - v. (The generic code's narrow stores read back as wide
// loads stall store forwarding; here nothing goes through memory between stages.)
KVQ_TARGET_AVX512 inline __m512 wht_lane_stage512(__m512 v, __m512 partner, __mmask16 upper) {
  return _mm512_mask_blend_ps(upper, _mm512_add_ps(v, partner), _mm512_sub_ps(partner, v));
}
KVQ_TARGET_AVX512 inline void hadamard64_avx512(float* x) {
  __m512 r[4];
  for (int i = 0; i < 4; ++i) {
    __m512 v = _mm512_loadu_ps(x + 16 * i);
    // (The masked forms with every lane set: GCC 12 warns about the plain forms' undefined
    // pass-through operand once inlined.)
    v = wht_lane_stage512(v, _mm512_mask_permute_ps(v, 0xFFFF, v, 0xB1), 0xAAAA);  // h = 1
    v = wht_lane_stage512(v, _mm512_mask_permute_ps(v, 0xFFFF, v, 0x4E), 0xCCCC);  // h = 2
    v = wht_lane_stage512(v, _mm512_mask_shuffle_f32x4(v, 0xFFFF, v, v, 0xB1), 0xF0F0);  // h = 4
    v = wht_lane_stage512(v, _mm512_mask_shuffle_f32x4(v, 0xFFFF, v, v, 0x4E), 0xFF00);  // h = 8
    r[i] = v;
  }
  for (int i = 0; i < 4; i += 2) {  // h = 16
    const __m512 a = r[i], b = r[i + 1];
    r[i] = _mm512_add_ps(a, b);
    r[i + 1] = _mm512_sub_ps(a, b);
  }
  for (int i = 0; i < 2; ++i) {  // h = 32
    const __m512 a = r[i], b = r[i + 2];
    r[i] = _mm512_add_ps(a, b);
    r[i + 2] = _mm512_sub_ps(a, b);
  }
  const __m512 s = _mm512_set1_ps(1.0f / std::sqrt(64.0f));
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(x + 16 * i, _mm512_mul_ps(r[i], s));
}
KVQ_TARGET_AVX2 inline __m256 wht_lane_stage256(__m256 v, __m256 partner, __m256 upper) {
  return _mm256_blendv_ps(_mm256_add_ps(v, partner), _mm256_sub_ps(partner, v), upper);
}
KVQ_TARGET_AVX2 inline void hadamard64_avx2(float* x) {
  const __m256 m1 = _mm256_castsi256_ps(_mm256_setr_epi32(0, -1, 0, -1, 0, -1, 0, -1));
  const __m256 m2 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, -1, -1, 0, 0, -1, -1));
  const __m256 m4 = _mm256_castsi256_ps(_mm256_setr_epi32(0, 0, 0, 0, -1, -1, -1, -1));
  __m256 r[8];
  for (int i = 0; i < 8; ++i) {
    __m256 v = _mm256_loadu_ps(x + 8 * i);
    v = wht_lane_stage256(v, _mm256_permute_ps(v, 0xB1), m1);              // h = 1
    v = wht_lane_stage256(v, _mm256_permute_ps(v, 0x4E), m2);              // h = 2
    v = wht_lane_stage256(v, _mm256_permute2f128_ps(v, v, 0x01), m4);      // h = 4
    r[i] = v;
  }
  for (int h = 1; h < 8; h *= 2)  // h = 8, 16, 32 (in registers of 8)
    for (int i = 0; i < 8; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const __m256 a = r[j], b = r[j + h];
        r[j] = _mm256_add_ps(a, b);
        r[j + h] = _mm256_sub_ps(a, b);
      }
  const __m256 s = _mm256_set1_ps(1.0f / std::sqrt(64.0f));
  for (int i = 0; i < 8; ++i) _mm256_storeu_ps(x + 8 * i, _mm256_mul_ps(r[i], s));
}
#endif

// hadamard_inplace for the body of a per-level clone (core/cpu.h): order 64 in registers at the
// AVX2 and AVX-512 levels, the generic code otherwise. The same bits at every level.
template <SimdLevel L>
KVQ_ALWAYS_INLINE void hadamard_at(float* x, int64_t n) {
#if KVQ_SIMD_X86
  if constexpr (L == SimdLevel::kAvx512) {
    if (n == 64) return hadamard64_avx512(x);
  } else if constexpr (L == SimdLevel::kAvx2) {
    if (n == 64) return hadamard64_avx2(x);
  }
#endif
  hadamard_inplace(x, n);
}

}  // namespace kvq
