// kvq/dtype.h — element types and exact conversions.
//
// fp16 (IEEE binary16) and bf16 conversions from fp32 round to nearest, ties to even, handle
// subnormals, overflow to infinity and keep NaNs quiet — the same results as F16C / AVX-512 BF16
// hardware conversions. Conversions to fp32 are exact, except that fp16 NaNs come back quiet
// (payload kept, quiet bit set), as F16C returns them; bf16 to fp32 is a plain shift.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvq {

enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr size_t dtype_size(DType t) { return t == DType::kF32 ? 4 : 2; }
// "f32", "f16", "bf16"
const char* dtype_name(DType t);

// Largest finite fp16 value. Scales, zero points and the residual window are stored in fp16, so
// fp32 inputs beyond it are rejected with kOutOfRange instead of silently becoming infinity.
inline constexpr float kF16Max = 65504.0f;

inline uint16_t f32_to_f16(float f) {
  uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // Inf stays Inf; NaN stays a quiet NaN with its top payload bits.
    return static_cast<uint16_t>(sign | 0x7c00u |
                                 (ax > 0x7f800000u ? (0x200u | ((ax >> 13) & 0x3ffu)) : 0u));
  }
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (ax < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5f makes the FPU round at 2^-24, the fp16
    // subnormal step, with ties to even; the low bits of the sum are then the fp16 mantissa.
    const float t = std::bit_cast<float>(ax) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(t) - 0x3f000000u));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  const uint32_t odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + odd;
  return static_cast<uint16_t>(sign | (ax >> 13));
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f)  // Inf, or NaN made quiet like F16C's (vcvtph2ps) so every level agrees
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
  if (exp == 0) {
    const float m = static_cast<float>(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    return sign ? -m : m;
  }
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // qNaN
  const uint32_t odd = (x >> 16) & 1u;
  return static_cast<uint16_t>((x + 0x7fffu + odd) >> 16);
}

inline float bf16_to_f32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

// Bulk conversions of n elements (vectorised where the CPU allows; bit-identical to the scalar
// functions above).
void convert_f32_to_f16(const float* in, uint16_t* out, size_t n);
void convert_f16_to_f32(const uint16_t* in, float* out, size_t n);
void convert_f32_to_bf16(const float* in, uint16_t* out, size_t n);
void convert_bf16_to_f32(const uint16_t* in, float* out, size_t n);

// Loads element i of a buffer of type t as fp32.
inline float load_as_f32(const void* data, DType t, ptrdiff_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kF16:
      return f16_to_f32(static_cast<const uint16_t*>(data)[i]);
    case DType::kBF16:
      return bf16_to_f32(static_cast<const uint16_t*>(data)[i]);
  }
  return 0.0f;
}

// Stores an fp32 value as element i of a buffer of type t (rounding to nearest even).
inline void store_from_f32(void* data, DType t, ptrdiff_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(data)[i] = v;
      break;
    case DType::kF16:
      static_cast<uint16_t*>(data)[i] = f32_to_f16(v);
      break;
    case DType::kBF16:
      static_cast<uint16_t*>(data)[i] = f32_to_bf16(v);
      break;
  }
}

}  // namespace kvq
