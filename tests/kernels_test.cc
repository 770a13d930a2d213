#include "numerics/kernels.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <vector>

namespace kvq {
namespace {

TEST(Kernels, DotIsBitExactWithItsReference) {
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0, 3);
  for (int64_t len : {0, 1, 7, 8, 9, 16, 63, 64, 65, 128, 1000}) {
    std::vector<float> a(static_cast<size_t>(len)), b(a.size());
    for (auto& x : a) x = n(rng);
    for (auto& x : b) x = n(rng);
    const float d = dot_f32(a.data(), b.data(), len),
                r = dot_f32_reference(a.data(), b.data(), len);
    ASSERT_EQ(std::bit_cast<uint32_t>(d), std::bit_cast<uint32_t>(r)) << len;
    double exact = 0;
    for (int64_t i = 0; i < len; ++i)
      exact += static_cast<double>(a[static_cast<size_t>(i)]) * b[static_cast<size_t>(i)];
    EXPECT_NEAR(d, exact, 1e-4 * (1 + std::fabs(exact)));
  }
}

TEST(Kernels, GemvRowsEqualDots) {
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0, 1);
  for (int64_t cols : {8, 13, 64}) {
    const int64_t rows = 11, lda = cols + 3;
    std::vector<float> A(static_cast<size_t>(rows * lda)), x(static_cast<size_t>(cols)),
        y(static_cast<size_t>(rows));
    for (auto& v : A) v = n(rng);
    for (auto& v : x) v = n(rng);
    gemv_f32(A.data(), rows, cols, lda, x.data(), 0.5f, y.data());
    for (int64_t r = 0; r < rows; ++r)
      ASSERT_EQ(
          std::bit_cast<uint32_t>(y[static_cast<size_t>(r)]),
          std::bit_cast<uint32_t>(0.5f * dot_f32_reference(A.data() + r * lda, x.data(), cols)));
  }
}

TEST(Kernels, ExpIsAccurateAndElementwiseDeterministic) {
  double worst = 0;
  for (float x = -87.0f; x <= 88.0f; x += 0.0137f) {
    const double want = std::exp(static_cast<double>(x));
    worst = std::max(worst, std::fabs(exp_f32(x) - want) / want);
  }
  EXPECT_LT(worst, 2e-6);
  EXPECT_EQ(exp_f32(-100.0f), 0.0f);
  EXPECT_EQ(exp_f32(0.0f), 1.0f);
  EXPECT_TRUE(std::isinf(exp_f32(100.0f)));
  // The vectorised loop computes what the scalar function computes.
  std::vector<float> xs(1001), ys(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = -20.0f + 0.02f * static_cast<float>(i);
  const double s = exp_sum_f32(xs.data(), 1.5f, static_cast<int64_t>(xs.size()), ys.data());
  double want = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(ys[i]), std::bit_cast<uint32_t>(exp_f32(xs[i] - 1.5f)));
    want += ys[i];
  }
  EXPECT_EQ(s, want);
}

// kvq's own log (the one the CUDA backend restates bit for bit): within a few ulp of libm's over
// the range a softmax normalizer takes (a sum of exps whose largest is 1), exact at powers of 2.
TEST(Kernels, LogIsAccurate) {
  double worst = 0;
  for (double x = 1.0; x < 1e7; x *= 1.0137) {
    for (double y : {x, std::nextafter(x, 0.0), x * 1.41421356, x * 0.70710678}) {
      const double want = std::log(y);
      worst = std::max(worst, std::fabs(log_f64(y) - want) / std::max(std::fabs(want), 1e-300));
    }
  }
  EXPECT_LT(worst, 1e-15);
  EXPECT_EQ(log_f64(1.0), 0.0);
  EXPECT_NEAR(log_f64(0.5), -0.69314718055994530942, 1e-16);
  for (int e = -20; e <= 40; ++e)
    EXPECT_NEAR(log_f64(std::ldexp(1.0, e)), e * 0.69314718055994530942, 1e-13) << e;
}

}  // namespace
}  // namespace kvq
