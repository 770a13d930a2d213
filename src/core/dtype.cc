#include "kvq/dtype.h"

#if defined(__F16C__) && defined(__AVX2__)
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

void convert_f32_to_f16(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  // F16C rounds to nearest even, like f32_to_f16 (tested bit-exact, NaNs included).
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
#endif
  for (; i < n; ++i) out[i] = f32_to_f16(in[i]);
}

void convert_f16_to_f32(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) out[i] = f16_to_f32(in[i]);
}

void convert_f32_to_bf16(const float* in, uint16_t* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}

void convert_bf16_to_f32(const uint16_t* in, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}

}  // namespace kvq
