#include "numerics/q8_rows.h"

#include <cmath>
#include <cstring>
#include <string>

#include "kvq/dtype.h"

namespace kvq {

namespace {

// fp16 bits of the scale of a block with this absmax (see the header).
uint16_t q8_scale_bits(float absmax) {
  uint16_t d = f32_to_f16(absmax / 127.0f);
  // Positive finite fp16 bits are ordered like their values: one step down is bits - 1.
  if (f16_to_f32(d) * 127.0f > kF16Max) --d;
  return d;
}

}  // namespace

void quantize_q8_row(const float* x, int64_t D, uint8_t* row) {
  const int64_t G = q8_row_group(D);
  for (int64_t g0 = 0; g0 < D; g0 += G, row += 2 + G) {
    float amax = 0.0f;
    for (int64_t i = 0; i < G; ++i) amax = std::fmax(amax, std::fabs(x[g0 + i]));
    const uint16_t bits = q8_scale_bits(amax);
    std::memcpy(row, &bits, 2);
    const float d = f16_to_f32(bits);
    auto* codes = reinterpret_cast<int8_t*>(row + 2);
    for (int64_t i = 0; i < G; ++i) {
      const float q = d > 0.0f ? std::nearbyint(x[g0 + i] / d) : 0.0f;
      codes[i] = static_cast<int8_t>(std::fmin(127.0f, std::fmax(-127.0f, q)));
    }
  }
}

void dequantize_q8_row(const uint8_t* row, int64_t D, float* out) {
  const int64_t G = q8_row_group(D);
  for (int64_t g0 = 0; g0 < D; g0 += G, row += 2 + G) {
    uint16_t bits;
    std::memcpy(&bits, row, 2);
    const float d = f16_to_f32(bits);
    const auto* codes = reinterpret_cast<const int8_t*>(row + 2);
    for (int64_t i = 0; i < G; ++i) out[g0 + i] = static_cast<float>(codes[i]) * d;
  }
}

Status validate_q8_rows(const uint8_t* rows, size_t n, int64_t D) {
  const int64_t G = q8_row_group(D);
  const size_t rb = q8_row_bytes(D);
  for (size_t r = 0; r < n; ++r) {
    const uint8_t* row = rows + r * rb;
    for (int64_t g0 = 0; g0 < D; g0 += G, row += 2 + G) {
      uint16_t bits;
      std::memcpy(&bits, row, 2);
      const float d = f16_to_f32(bits);
      if (!std::isfinite(d) || (bits & 0x8000u) || d * 127.0f > kF16Max)
        return corrupt("q8 window row " + std::to_string(r) + ": block at " + std::to_string(g0) +
                       " has scale " + std::to_string(d) +
                       " (must be finite, >= 0, and 127 x scale <= 65504)");
      for (int64_t i = 0; i < G; ++i)
        if (row[2 + i] == 0x80)
          return corrupt("q8 window row " + std::to_string(r) + ": code -128 at " +
                         std::to_string(g0 + i) + " (codes are in [-127, 127])");
    }
  }
  return ok_status();
}

}  // namespace kvq
