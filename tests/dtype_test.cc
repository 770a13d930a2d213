#include "kvq/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace kvq {
namespace {

// Reference: round to nearest even by exhaustive comparison against neighbouring fp16 values.
uint16_t f16_reference(float x) {
  if (std::isnan(x)) return 0x7e00;
  // Candidate set: all finite fp16 and +-inf; choose nearest, ties to even mantissa.
  static std::vector<std::pair<double, uint16_t>> table = [] {
    std::vector<std::pair<double, uint16_t>> t;
    for (uint32_t h = 0; h < 0x10000; ++h) {
      const uint32_t e = (h >> 10) & 0x1f;
      if (e == 0x1f) continue;
      t.emplace_back(static_cast<double>(f16_to_f32(static_cast<uint16_t>(h))),
                     static_cast<uint16_t>(h));
    }
    std::sort(t.begin(), t.end());
    return t;
  }();
  const double v = x;
  if (v >= 65520.0) return 0x7c00;
  if (v <= -65520.0) return 0xfc00;
  if (v > 65504.0) return 0x7bff;
  if (v < -65504.0) return 0xfbff;
  auto above = std::lower_bound(table.begin(), table.end(), std::make_pair(v, uint16_t{0}));
  uint16_t h;
  if (above->first == v) {
    h = above->second;
  } else {
    auto below = above - 1;
    const double d1 = v - below->first, d2 = above->first - v;
    if (d1 < d2)
      h = below->second;
    else if (d2 < d1)
      h = above->second;
    else
      h = (below->second & 1) == 0 ? below->second : above->second;
  }
  if (f16_to_f32(h) == 0.0f) h = std::signbit(x) ? 0x8000 : 0x0000;
  return h;
}

TEST(DType, F16RoundTripAllValues) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << h;
  }
}

TEST(DType, F16RoundsToNearestEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mag(-20.0f, 17.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = (rng() & 1 ? -1.0f : 1.0f) * std::exp2(mag(rng));
    ASSERT_EQ(f32_to_f16(x), f16_reference(x)) << x;
  }
  // Exact ties: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10 -> even (1.0).
  EXPECT_EQ(f32_to_f16(1.0f + std::exp2(-11.0f)), 0x3c00);
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::exp2(-11.0f)), 0x3c02);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(f32_to_f16(std::exp2(-25.0f)), 0x0000);  // tie below the smallest subnormal
  EXPECT_EQ(f32_to_f16(std::exp2(-25.0f) * 1.5f), 0x0001);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)), 0x3f80);  // tie -> even
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)), 0x3f82);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808001u)), 0x3f81);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_bf16(f), h);
  }
}

TEST(DType, BulkConversionsMatchScalar) {
  std::mt19937 rng(3);
  std::vector<float> x(1003);
  for (auto& v : x) v = std::bit_cast<float>(static_cast<uint32_t>(rng()));
  x[5] = std::numeric_limits<float>::quiet_NaN();
  std::vector<uint16_t> h(x.size()), b(x.size());
  convert_f32_to_f16(x.data(), h.data(), x.size());
  convert_f32_to_bf16(x.data(), b.data(), x.size());
  std::vector<float> back(x.size());
  convert_f16_to_f32(h.data(), back.data(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i])) continue;
    ASSERT_EQ(h[i], f32_to_f16(x[i])) << i;
    ASSERT_EQ(b[i], f32_to_bf16(x[i])) << i;
    ASSERT_EQ(std::bit_cast<uint32_t>(back[i]), std::bit_cast<uint32_t>(f16_to_f32(h[i])));
  }
}

}  // namespace
}  // namespace kvq
