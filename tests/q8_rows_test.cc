// The 8-bit window rows of kvq's window=q8 (numerics/q8_rows.h): round trip within half a
// step, the fp16 range kept, and the checks a reader runs.
#include "numerics/q8_rows.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/dtype.h"

namespace kvq {
namespace {

float scale_of(const uint8_t* row, int64_t block, int64_t D) {
  uint16_t bits;
  std::memcpy(&bits, row + static_cast<size_t>(block) * (2 + q8_row_group(D)), 2);
  return f16_to_f32(bits);
}

TEST(Q8Rows, RoundTripIsWithinHalfAStep) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 2.0f);
  for (int64_t D : {32, 64, 96, 40, 7}) {
    EXPECT_EQ(q8_row_group(D), D % 32 == 0 ? 32 : D);
    EXPECT_EQ(q8_row_bytes(D), static_cast<size_t>(D % 32 == 0 ? D + D / 16 : D + 2));
    for (int r = 0; r < 50; ++r) {
      std::vector<float> x(static_cast<size_t>(D)), y(x.size());
      for (float& v : x) v = n(rng) * (r % 5 == 0 ? 100.0f : 1.0f);
      std::vector<uint8_t> row(q8_row_bytes(D));
      quantize_q8_row(x.data(), D, row.data());
      ASSERT_TRUE(validate_q8_rows(row.data(), 1, D).ok());
      dequantize_q8_row(row.data(), D, y.data());
      const int64_t G = q8_row_group(D);
      for (int64_t g = 0; g < D / G; ++g) {
        const float d = scale_of(row.data(), g, D);
        float amax = 0;
        for (int64_t i = g * G; i < (g + 1) * G; ++i) amax = std::max(amax, std::fabs(x[i]));
        EXPECT_NEAR(d, amax / 127, amax / 127 * 1e-3f);  // fp16's rounding of absmax / 127
        for (int64_t i = g * G; i < (g + 1) * G; ++i)
          ASSERT_LE(std::fabs(y[i] - x[i]), 0.5f * d * (1 + 1e-6f) + amax * 1e-3f / 127)
              << "D " << D << " row " << r << " at " << i;
      }
    }
  }
}

TEST(Q8Rows, ExtremesStayFiniteAndInTheFp16Range) {
  const int64_t D = 32;
  std::vector<uint8_t> row(q8_row_bytes(D));
  std::vector<float> x(D, 0.0f), y(D);
  x[0] = kF16Max;
  x[1] = -kF16Max;
  x[2] = 12345.0f;
  quantize_q8_row(x.data(), D, row.data());
  EXPECT_TRUE(validate_q8_rows(row.data(), 1, D).ok());
  EXPECT_LE(scale_of(row.data(), 0, D) * 127, kF16Max);  // fp16(65504 / 127) * 127 would not be
  dequantize_q8_row(row.data(), D, y.data());
  for (float v : y) EXPECT_LE(std::fabs(v), kF16Max);
  EXPECT_GT(y[0], 65000.0f);
  // A zero row, and one below the smallest scale, read back as zeros.
  for (float tiny : {0.0f, 1e-7f}) {
    std::fill(x.begin(), x.end(), tiny);
    quantize_q8_row(x.data(), D, row.data());
    EXPECT_TRUE(validate_q8_rows(row.data(), 1, D).ok());
    dequantize_q8_row(row.data(), D, y.data());
    for (float v : y) EXPECT_EQ(v, 0.0f);
  }
}

TEST(Q8Rows, ValidationRefusesWhatTheEncoderNeverWrites) {
  const int64_t D = 64;
  std::vector<float> x(D);
  for (int64_t i = 0; i < D; ++i) x[i] = std::sin(0.3f * static_cast<float>(i));
  std::vector<uint8_t> good(2 * q8_row_bytes(D));
  quantize_q8_row(x.data(), D, good.data());
  quantize_q8_row(x.data(), D, good.data() + q8_row_bytes(D));
  ASSERT_TRUE(validate_q8_rows(good.data(), 2, D).ok());
  const size_t second_block = q8_row_bytes(D) + 34;  // row 1, block 1's scale
  for (uint16_t bad : {uint16_t{0x7c00}, uint16_t{0x7e00}, uint16_t{0x8000}, uint16_t{0xbc00},
                       f32_to_f16(516.0f)}) {
    std::vector<uint8_t> r = good;
    std::memcpy(r.data() + second_block, &bad, 2);
    EXPECT_EQ(validate_q8_rows(r.data(), 2, D).code(), ErrorCode::kCorrupt) << bad;
  }
  std::vector<uint8_t> r = good;
  r[second_block + 2 + 5] = 0x80;  // code -128
  EXPECT_EQ(validate_q8_rows(r.data(), 2, D).code(), ErrorCode::kCorrupt);
}

}  // namespace
}  // namespace kvq
