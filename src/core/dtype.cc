#include "kvq/dtype.h"

#include "core/cpu.h"

#if KVQ_SIMD_X86
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
#endif

}  // namespace

void convert_f32_to_f16(const float* in, uint16_t* out, size_t n) {
#if KVQ_SIMD_X86
  if (simd_level() >= SimdLevel::kAvx2) return f32_to_f16_f16c(in, out, n);
#endif
  f32_to_f16_loop(in, out, 0, n);
}

void convert_f16_to_f32(const uint16_t* in, float* out, size_t n) {
#if KVQ_SIMD_X86
  if (simd_level() >= SimdLevel::kAvx2) return f16_to_f32_f16c(in, out, n);
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
