#include "kvq/dtype.h"

#include "core/cpu.h"

#if KVQ_SIMD_X86
// GCC 12's intrinsic headers initialise "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined (GCC bug 105593); the vectors are fully overwritten.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

namespace kvq {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "?";
}

namespace {

// The plain loops: the fp16 ones are the scalar level and the F16C tails; the bf16 ones are
// compiled once per level (they vectorise well).
KVQ_ALWAYS_INLINE void f32_to_f16_loop(const float* in, uint16_t* out, size_t i, size_t n) {
  for (; i < n; ++i) out[i] = f32_to_f16(in[i]);
}
KVQ_ALWAYS_INLINE void f16_to_f32_loop(const uint16_t* in, float* out, size_t i, size_t n) {
  for (; i < n; ++i) out[i] = f16_to_f32(in[i]);
}
template <SimdLevel L>
KVQ_ALWAYS_INLINE void f32_to_bf16_body(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}
template <SimdLevel L>
KVQ_ALWAYS_INLINE void bf16_to_f32_body(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}
KVQ_LEVEL_CLONES(void, f32_to_bf16, (const float* in, uint16_t* out, size_t n), (in, out, n))
KVQ_LEVEL_CLONES(void, bf16_to_f32, (const uint16_t* in, float* out, size_t n), (in, out, n))

#if KVQ_SIMD_X86
// F16C rounds to nearest even, like f32_to_f16 (tested bit-exact, NaNs included).
KVQ_TARGET_AVX2 void f32_to_f16_f16c(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  f32_to_f16_loop(in, out, i, n);
}

KVQ_TARGET_AVX2 void f16_to_f32_f16c(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  f16_to_f32_loop(in, out, i, n);
}

// The same conversions 16 at a time (vcvtps2ph / vcvtph2ps on zmm registers, same rounding),
// then 8 at a time.
KVQ_TARGET_AVX512 void f32_to_f16_avx512(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
  if (i + 8 <= n) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
    i += 8;
  }
  f32_to_f16_loop(in, out, i, n);
}

KVQ_TARGET_AVX512 void f16_to_f32_avx512(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i));
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(h));
  }
  if (i + 8 <= n) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
    i += 8;
  }
  f16_to_f32_loop(in, out, i, n);
}
#endif

}  // namespace

void convert_f32_to_f16(const float* in, uint16_t* out, size_t n) {
#if KVQ_SIMD_X86
  switch (simd_level()) {
    case SimdLevel::kAvx512:
      return f32_to_f16_avx512(in, out, n);
    case SimdLevel::kAvx2:
      return f32_to_f16_f16c(in, out, n);
    case SimdLevel::kScalar:
      break;
  }
#endif
  f32_to_f16_loop(in, out, 0, n);
}

void convert_f16_to_f32(const uint16_t* in, float* out, size_t n) {
#if KVQ_SIMD_X86
  switch (simd_level()) {
    case SimdLevel::kAvx512:
      return f16_to_f32_avx512(in, out, n);
    case SimdLevel::kAvx2:
      return f16_to_f32_f16c(in, out, n);
    case SimdLevel::kScalar:
      break;
  }
#endif
  f16_to_f32_loop(in, out, 0, n);
}

void convert_f32_to_bf16(const float* in, uint16_t* out, size_t n) {
  KVQ_LEVEL_DISPATCH(f32_to_bf16, (in, out, n));
}

void convert_bf16_to_f32(const uint16_t* in, float* out, size_t n) {
  KVQ_LEVEL_DISPATCH(bf16_to_f32, (in, out, n));
}

}  // namespace kvq
