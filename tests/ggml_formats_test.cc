// llama.cpp's KV formats (src/methods/ggml_formats.cc) against blocks produced by ggml's own
// reference quantizers (tests/data/ggml_reference_blocks.txt), byte for byte, through the cache's
// public path: a token appended to a q*_0 cache without window or rotation is one sealed block of
// ggml's bytes. Then the decode side and the rotation.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "test_util.h"

namespace kvq {
namespace {

// The inputs the reference file was made from (the generator computed exactly this).
float input(int v, int j) {
  uint32_t h = static_cast<uint32_t>(v * 2654435761u) ^ static_cast<uint32_t>(j * 40503u + 12345u);
  h ^= h >> 13;
  h *= 0x5bd1e995u;
  h ^= h >> 15;
  const float u = static_cast<float>(h & 0xFFFFFF) / 16777216.0f - 0.5f;
  const float scale = v % 7 == 0 ? 1e-3f : v % 7 == 1 ? 30.0f : v % 7 == 2 ? 1.0f : 4.0f;
  if (v % 11 == 3) return 0.0f;                                 // an all-zero block
  if (v % 13 == 5 && j == 7) return -9.0f * scale;              // a dominant negative value
  if (v % 17 == 6 && (j == 3 || j == 20)) return 2.0f * scale;  // tied maxima
  return u * scale;
}

constexpr int kVectors = 96;
const char* const kTypes[] = {"q8_0", "q4_0", "q4_1", "q5_0", "iq4_nl"};

std::vector<std::string> reference_lines() {
  std::ifstream f(testing::source_dir() + "/tests/data/ggml_reference_blocks.txt");
  std::vector<std::string> lines;
  for (std::string l; std::getline(f, l);)
    if (!l.empty() && l[0] != '#') lines.push_back(l);
  return lines;
}

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) s += {d[p[i] >> 4], d[p[i] & 15]};
  return s;
}

TEST(GgmlFormats, QuantizersAreByteExactWithGgml) {
  const auto ref = reference_lines();
  ASSERT_EQ(ref.size(), 5u * kVectors);
  std::vector<float> x(kVectors * 32);
  for (int v = 0; v < kVectors; ++v)
    for (int j = 0; j < 32; ++j)  // fp16-exact: the window holds 16-bit values and seals from them
      x[static_cast<size_t>(v * 32 + j)] = f16_to_f32(f32_to_f16(input(v, j)));
  for (int t = 0; t < 5; ++t) {
    auto c = ModelCache::create(std::string(kTypes[t]) + ":rot=off,residual=0",
                                ModelShape::uniform(1, 1, 32, 1));
    ASSERT_TRUE(c.ok());
    const auto view = TensorView::bhsd(x.data(), DType::kF32, 1, 1, kVectors, 32);
    ASSERT_TRUE(c->layer(0).append(view, view).ok());
    ASSERT_EQ(c->layer(0).n_blocks(), kVectors);
    testing::ChunkCollector sink;
    ASSERT_TRUE(c->layer(0).export_blocks(0, sink).ok());
    int mismatches = 0;
    for (int v = 0; v < kVectors; ++v) {
      const auto& keys = sink.store[static_cast<size_t>(2 * v)];
      const auto& values = sink.store[static_cast<size_t>(2 * v + 1)];
      std::string want = ref[static_cast<size_t>(t * kVectors + v)];
      if (std::string(kTypes[t]) == "iq4_nl" && v % 11 == 3) {
        // An all-zero block: ggml's reference leaves its codes undefined (it packs an array it
        // never wrote); its scale is 0, so any codes decode to zeros. kvq writes zero codes.
        ASSERT_EQ(want.substr(0, 4), "0000");
        want = std::string(want.size(), '0');
      }
      EXPECT_EQ(hex(keys.data(), keys.size()), want) << kTypes[t] << " vector " << v;
      EXPECT_EQ(values, keys);
      mismatches += hex(keys.data(), keys.size()) != want;
    }
    EXPECT_EQ(mismatches, 0) << kTypes[t];
  }
}

// Dequantized values follow ggml's definitions; the error is what the format allows.
TEST(GgmlFormats, DecodeIsCloseAndRotationIsItsOwnInverse) {
  const int64_t D = 128, S = 40;
  const std::vector<float> k = testing::random_kv(1, 2, S, D, 5),
                           v = testing::random_kv(1, 2, S, D, 6);
  for (const char* type : kTypes)
    for (const char* rot : {"off", "on"}) {
      auto c =
          ModelCache::create(std::string(type) + ":rot=" + rot, ModelShape::uniform(1, 2, D, 4));
      ASSERT_TRUE(c.ok());
      ASSERT_TRUE(c->layer(0)
                      .append(TensorView::bhsd(k.data(), DType::kF32, 1, 2, S, D),
                              TensorView::bhsd(v.data(), DType::kF32, 1, 2, S, D))
                      .ok());
      std::vector<float> kr, vr;
      testing::read_all(c->layer(0), kr, vr);
      double err = 0, ref = 0;
      for (size_t i = 0; i < k.size(); ++i)
        err += (kr[i] - k[i]) * (kr[i] - k[i]), ref += k[i] * k[i];
      const double budget = std::string(type) == "q8_0"   ? 1e-4
                            : std::string(type) == "q5_0" ? 0.01
                                                          : 0.03;
      EXPECT_LT(err / ref, budget) << type << " rot=" << rot;
      EXPECT_EQ(c->resident_bytes(), c->bytes().total());
    }
}

TEST(GgmlFormats, BillsGgmlsBitsAndRefusesOddHeadDims) {
  const int64_t D = 64, S = 8;
  const std::vector<float> k = testing::random_kv(1, 1, S, D, 7);
  const std::pair<const char*, double> bits[] = {
      {"q8_0", 8.5}, {"q4_0", 4.5}, {"q4_1", 5.0}, {"q5_0", 5.5}, {"iq4_nl", 4.5}};
  for (const auto& [type, b] : bits) {
    auto c = ModelCache::create(type, ModelShape::uniform(1, 1, D, 1));
    ASSERT_TRUE(c.ok());
    const auto view = TensorView::bhsd(k.data(), DType::kF32, 1, 1, S, D);
    ASSERT_TRUE(c->layer(0).append(view, view).ok());
    EXPECT_DOUBLE_EQ(c->bytes().bits_per_element(), b) << type;
    const auto bad = ModelCache::create(type, ModelShape::uniform(1, 1, 48, 1));
    EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument) << type;
  }
}

}  // namespace
}  // namespace kvq
