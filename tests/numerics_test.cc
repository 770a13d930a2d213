#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/bitpack.h"
#include "kvq/dtype.h"
#include "kvq/group_quant.h"

namespace kvq {
namespace {

TEST(BitPack, EveryWidthAndOddLengthsMatchReference) {
  std::mt19937 rng(1);
  for (int bits = 1; bits <= 8; ++bits) {
    for (size_t n : {0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 1001}) {
      std::vector<uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
      std::vector<uint8_t> a(packed_size(n, bits) + 1, 0xAB), b(a.size(), 0xAB);
      pack_bits(codes.data(), n, bits, a.data());
      pack_bits_reference(codes.data(), n, bits, b.data());
      ASSERT_EQ(a, b) << "bits=" << bits << " n=" << n;
      EXPECT_EQ(a.back(), 0xAB) << "wrote past packed_size";
      std::vector<uint8_t> out(n), ref(n);
      unpack_bits(a.data(), n, bits, out.data());
      unpack_bits_reference(a.data(), n, bits, ref.data());
      ASSERT_EQ(out, codes);
      ASSERT_EQ(ref, codes);
    }
  }
}

TEST(BitPack, DocumentedLayout) {
  const uint8_t codes[] = {5, 2, 7};
  uint8_t out[2];
  pack_bits(codes, 3, 3, out);
  EXPECT_EQ(out[0], 0xD5);
  EXPECT_EQ(out[1], 0x01);
  const uint8_t two[] = {1, 2, 3, 0, 3};
  uint8_t o2[2];
  pack_bits(two, 5, 2, o2);
  EXPECT_EQ(o2[0], 0b00111001);
  EXPECT_EQ(o2[1], 0b00000011);
  EXPECT_EQ(packed_size(5, 2), 2u);
  EXPECT_EQ(packed_size(3, 3), 2u);
}

TEST(BitPack, HighBitsIgnored) {
  const uint8_t codes[] = {0xFF, 0xFE};
  uint8_t out[1];
  pack_bits(codes, 2, 2, out);
  EXPECT_EQ(out[0], 0b1011);
}

// Plain reference of the documented formula.
void reference_group(const std::vector<float>& x, int bits, std::vector<float>& out) {
  float lo = x[0], hi = x[0];
  for (float v : x) lo = std::min(lo, v), hi = std::max(hi, v);
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float zero = f16_to_f32(f16_round_down(lo));
  const float scale = f16_to_f32(f16_round_up(std::max((hi - zero) / qmax, kScaleEps)));
  out.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    float q = std::nearbyint((x[i] - zero) * (1.0f / scale));
    q = std::min(std::max(q, 0.0f), qmax);
    out[i] = zero + q * scale;
  }
}

TEST(GroupQuant, PerChannelMatchesReferenceAndBoundsError) {
  std::mt19937 rng(2);
  std::normal_distribution<float> n(0, 1);
  for (int bits = 1; bits <= 8; ++bits) {
    const int64_t T = 32, D = 16;
    std::vector<float> x(T * D);
    for (auto& v : x) v = 3 * n(rng);
    std::vector<float> out(x.size());
    quant_dequant_per_channel(x.data(), T, D, bits, out.data());
    for (int64_t d = 0; d < D; ++d) {
      std::vector<float> col(T), ref;
      for (int64_t t = 0; t < T; ++t) col[t] = x[t * D + d];
      reference_group(col, bits, ref);
      float lo = col[0], hi = col[0];
      for (float v : col) lo = std::min(lo, v), hi = std::max(hi, v);
      const float step = (hi - lo) / ((1 << bits) - 1);
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(out[t * D + d], ref[t]) << "bits " << bits;
        // Half a step, plus the fp16 outward rounding of scale and zero.
        EXPECT_LE(std::fabs(out[t * D + d] - col[t]),
                  0.5f * step * 1.01f + 1e-3f * std::fabs(lo) + 1e-6f);
      }
    }
  }
}

TEST(GroupQuant, PerTokenGroupsOfChannels) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 1);
  const int64_t T = 5, D = 20, G = 8;  // groups of 8, 8 and 4 channels
  std::vector<float> x(T * D);
  for (auto& v : x) v = n(rng);
  std::vector<float> out(x.size());
  quant_dequant_per_token(x.data(), T, D, G, 3, out.data());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g0 = 0; g0 < D; g0 += G) {
      std::vector<float> grp(x.begin() + t * D + g0, x.begin() + t * D + std::min(D, g0 + G)), ref;
      reference_group(grp, 3, ref);
      for (size_t i = 0; i < grp.size(); ++i)
        ASSERT_EQ(out[t * D + g0 + static_cast<int64_t>(i)], ref[i]);
    }
  EXPECT_EQ(n_channel_groups(20, 8), 3);
}

// The tiled, vectorized fits of quantize_per_token / quantize_per_channel against the
// one-group definition (fit_group + quantize_group, i.e. fit_range) on inputs that stress the
// fp16 rounding and the min/max ties: signed zeros, subnormals, +-65504, every fp16 pattern.
// Shapes take each path: groups of 32 (the vector range), 20 and 16 (lanes), 64, and G = 1 with
// more groups per token than a tile.
TEST(GroupQuant, TiledFitsEqualTheOneGroupDefinition) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0, 1);
  const int64_t Ds[] = {64, 64, 64, 300, 40, 128}, Gs[] = {32, 64, 20, 1, 16, 32};
  for (int bits : {1, 2, 3, 4, 8})
    for (int trial = 0; trial < 600; ++trial) {
      const int64_t T = 4, D = Ds[trial % 6], G = Gs[trial % 6], ng = n_channel_groups(D, G);
      std::vector<float> x(static_cast<size_t>(T * D));
      const int mode = trial % 5;
      for (auto& v : x) {
        const uint32_t r = rng();
        if (mode == 0) v = std::ldexp(static_cast<float>(static_cast<int>(r % 2001) - 1000), -static_cast<int>(rng() % 30));
        if (mode == 1) v = (r & 1) ? 0.0f : -0.0f, v = rng() % 4 ? v : std::ldexp(1.0f, -static_cast<int>(rng() % 30));
        if (mode == 2) v = f16_to_f32(static_cast<uint16_t>(r & 0xffff)), v = std::isfinite(v) ? v : 65504.0f;
        if (mode == 3) v = r % 3 == 0 ? -65504.0f : r % 3 == 1 ? 65504.0f : 0.0f;
        if (mode == 4) v = n(rng) * std::ldexp(1.0f, static_cast<int>(r % 20) - 10);
      }
      std::vector<uint8_t> c1(x.size()), c2(x.size());
      std::vector<QuantParams> p1(static_cast<size_t>(T * ng)), p2(p1.size());
      quantize_per_token(x.data(), T, D, D, G, bits, c1.data(), p1.data());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < ng; ++g) {
          const int64_t d0 = g * G, m = std::min(G, D - d0);
          p2[t * ng + g] = fit_group(x.data() + t * D + d0, m, 1, bits);
          quantize_group(x.data() + t * D + d0, m, 1, p2[t * ng + g], bits,
                         c2.data() + t * D + d0, 1);
        }
      ASSERT_EQ(c1, c2) << "per token, bits " << bits << " trial " << trial;
      ASSERT_EQ(0, std::memcmp(p1.data(), p2.data(), p1.size() * sizeof(QuantParams)))
          << "per token, bits " << bits << " trial " << trial;
      std::vector<QuantParams> q1(static_cast<size_t>(D)), q2(q1.size());
      quantize_per_channel(x.data(), T, D, D, bits, c1.data(), q1.data());
      for (int64_t d = 0; d < D; ++d) {
        q2[d] = fit_group(x.data() + d, T, D, bits);
        quantize_group(x.data() + d, T, D, q2[d], bits, c2.data() + d, D);
      }
      ASSERT_EQ(c1, c2) << "per channel, bits " << bits << " trial " << trial;
      ASSERT_EQ(0, std::memcmp(q1.data(), q2.data(), q1.size() * sizeof(QuantParams)))
          << "per channel, bits " << bits << " trial " << trial;
    }
}

TEST(GroupQuant, ConstantGroupIsExactAndNeverDividesByZero) {
  for (float c : {0.0f, 1.0f, -3.25f, 1000.0f, 6.1035156e-05f}) {
    std::vector<float> x(64, c), out(64);
    for (int bits = 1; bits <= 8; ++bits) {
      quant_dequant_per_channel(x.data(), 64, 1, bits, out.data());
      for (float o : out) ASSERT_EQ(o, c) << c << " bits " << bits;
      quant_dequant_per_token(x.data(), 1, 64, 32, bits, out.data());
      for (float o : out) ASSERT_EQ(o, c);
    }
  }
  // A value fp16 cannot represent still reconstructs within fp16 resolution.
  std::vector<float> x(8, 0.1f), out(8);
  quant_dequant_per_channel(x.data(), 8, 1, 2, out.data());
  for (float o : out) EXPECT_NEAR(o, 0.1f, 1e-4f);
}

TEST(GroupQuant, StoredParamsCoverTheRange) {
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> u(-100, 100);
  for (int i = 0; i < 10000; ++i) {
    float lo = u(rng), hi = u(rng);
    if (lo > hi) std::swap(lo, hi);
    for (int bits : {1, 2, 4, 8}) {
      const QuantParams p = fit_range(lo, hi, bits);
      const float zero = f16_to_f32(p.zero), scale = f16_to_f32(p.scale);
      ASSERT_LE(zero, lo);
      ASSERT_GE(static_cast<double>(zero) + ((1 << bits) - 1) * static_cast<double>(scale),
                hi - 1e-6 * std::fabs(hi));
      ASSERT_GT(scale, 0.0f);
    }
  }
}

TEST(GroupQuant, DirectedF16Rounding) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-70000, 70000);
  for (int i = 0; i < 100000; ++i) {
    const float x = u(rng) / static_cast<float>(1 << (rng() % 20));
    if (std::fabs(x) > 65504) continue;
    const float d = f16_to_f32(f16_round_down(x)), up = f16_to_f32(f16_round_up(x));
    ASSERT_LE(d, x);
    ASSERT_GE(up, x);
    ASSERT_LE(up - d, std::fabs(x) * 1.0e-3f + 1e-7f);
  }
}

TEST(GroupQuant, MoreBitsNeverWorse) {
  std::mt19937 rng(6);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> x(64 * 32), out(x.size());
  for (auto& v : x) v = n(rng);
  double prev = 1e30;
  for (int bits = 1; bits <= 8; ++bits) {
    quant_dequant_per_channel(x.data(), 64, 32, bits, out.data());
    double err = 0;
    for (size_t i = 0; i < x.size(); ++i) err += (x[i] - out[i]) * (x[i] - out[i]);
    EXPECT_LT(err, prev) << bits;
    prev = err;
  }
}

}  // namespace
}  // namespace kvq
