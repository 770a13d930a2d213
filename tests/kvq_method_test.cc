// kvq's own method (src/methods/kvq.cc): the properties its design rests on, beyond the contract
// every row meets (cache_contract_test.cc) and the bit ladder (registry_test.cc).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "test_util.h"

namespace kvq {
namespace {

constexpr int H = 2, D = 32, T = 64;

std::vector<float> read_keys(const LayerCache& c) {
  std::vector<float> k, v;
  testing::read_all(c, k, v);
  return k;
}

double max_abs(const std::vector<float>& x) {
  double m = 0;
  for (float f : x) m = std::max(m, std::fabs(static_cast<double>(f)));
  return m;
}

// Keys whose pre-RoPE vector is the same at every position (one vector per head), rotated as the
// model would (`mode`, theta 10000), at positions 0..T-1.
std::vector<float> rotated_constant_keys(RopeShape::Mode mode) {
  std::vector<float> k(static_cast<size_t>(H * T * D));
  for (int h = 0; h < H; ++h)
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < D / 2; ++i) {
        const double a = t * std::pow(10000.0, -2.0 * i / D);
        const int i0 = mode == RopeShape::Mode::kAdjacent ? 2 * i : i;
        const int i1 = mode == RopeShape::Mode::kAdjacent ? 2 * i + 1 : i + D / 2;
        const double x0 = 1.0 + 0.37 * ((h * 7 + i0) % 11), x1 = -0.5 + 0.21 * ((h + i1) % 5);
        float* row = &k[static_cast<size_t>((h * T + t) * D)];
        row[i0] = static_cast<float>(x0 * std::cos(a) - x1 * std::sin(a));
        row[i1] = static_cast<float>(x0 * std::sin(a) + x1 * std::cos(a));
      }
  return k;
}

// rope=pre undoes the layer's RoPE before the per-channel quantization: with a constant pre-RoPE
// key every channel of every group is constant, and 2-bit codes store it to fp16 precision. The
// same keys quantized after RoPE (rope=post), or unrotated with the other pairing, vary along
// every channel and come back far off.
TEST(KvqMethod, PreRopeQuantizesInTheModelsBasis) {
  for (auto mode : {RopeShape::Mode::kAdjacent, RopeShape::Mode::kHalf}) {
    const auto k = rotated_constant_keys(mode);
    const double top = max_abs(k);
    auto error = [&](const std::string& spec, RopeShape::Mode declared) {
      const RopeShape rope{declared, 10000.0, 1.0};
      auto c = ModelCache::create(spec, ModelShape::uniform(1, H, D, H, rope));
      EXPECT_TRUE(c.ok()) << c.status().to_string();
      const auto view = TensorView::bhsd(k.data(), DType::kF32, 1, H, T, D);
      EXPECT_TRUE(c->layer(0).append(view, view).ok());
      EXPECT_EQ(c->layer(0).sealed_tokens(), T);
      const auto got = read_keys(c->layer(0));
      double worst = 0;
      for (size_t i = 0; i < k.size(); ++i)
        worst = std::max(worst, std::fabs(static_cast<double>(got[i] - k[i])));
      return worst / top;
    };
    const std::string base = "kvq:k_bits=2,v_bits=2,group=32,residual=0,sinks=0,k_rot=off";
    const auto other =
        mode == RopeShape::Mode::kHalf ? RopeShape::Mode::kAdjacent : RopeShape::Mode::kHalf;
    EXPECT_LT(error(base + ",rope=pre", mode), 2e-3);
    EXPECT_GT(error(base + ",rope=post", mode), 5e-2);
    EXPECT_GT(error(base + ",rope=pre", other), 5e-2);
  }
}

TEST(KvqMethod, PreRopeNeedsTheModelsRope) {
  auto c = ModelCache::create("kvq:rope=pre", ModelShape::uniform(1, H, D, H));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("rope=pre needs the model's RoPE"), std::string::npos);
  EXPECT_TRUE(ModelCache::create("kvq:rope=post", ModelShape::uniform(1, H, D, H)).ok());
}

struct Outcome {
  CacheBytes bytes;
  double rel_mse_k = 0, rel_mse_v = 0;
};

Outcome run(const std::string& spec, const std::vector<float>& k, const std::vector<float>& v) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  auto c = ModelCache::create(spec, ModelShape::uniform(1, H, D, H, rope));
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  const int64_t S = static_cast<int64_t>(k.size()) / (H * D);
  EXPECT_TRUE(c->layer(0)
                  .append(TensorView::bhsd(k.data(), DType::kF32, 1, H, S, D),
                          TensorView::bhsd(v.data(), DType::kF32, 1, H, S, D))
                  .ok());
  std::vector<float> gk, gv;
  testing::read_all(c->layer(0), gk, gv);
  Outcome r;
  r.bytes = c->bytes();
  double ek = 0, ev = 0, nk = 0, nv = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    ek += (gk[i] - k[i]) * (gk[i] - k[i]);
    ev += (gv[i] - v[i]) * (gv[i] - v[i]);
    nk += k[i] * k[i];
    nv += v[i] * v[i];
  }
  r.rel_mse_k = ek / nk;
  r.rel_mse_v = ev / nv;
  return r;
}

// params=u8 bills 6 + 2n bytes for a stream's n pairs (4n in fp16), and costs little accuracy:
// its scales are at most 2^(1/16) coarser than needed and its zeros rounded down by at most
// 1/255 of the spread of the set's minima.
TEST(KvqMethod, EightBitPairsBillWhatTheyHoldAndCostLittle) {
  const int64_t S = 8 * 32;  // 8 blocks of 32 tokens, all sealed (residual 0)
  const auto k = testing::random_kv(1, H, S, D, 5, 1.0f);
  const auto v = testing::random_kv(1, H, S, D, 6, 0.5f);
  for (int bits : {2, 3, 4}) {
    const std::string spec = "kvq:k_bits=" + std::to_string(bits) + ",v_bits=" +
                             std::to_string(bits) + ",group=32,v_group=16,residual=0,sinks=2";
    const Outcome f16 = run(spec + ",params=f16", k, v), u8 = run(spec + ",params=u8", k, v);
    const uint64_t streams_blocks = H * (S / 32);
    const uint64_t kpairs = D, vpairs = 32 * (D / 16);
    EXPECT_EQ(f16.bytes.params, streams_blocks * 4 * (kpairs + vpairs));
    EXPECT_EQ(u8.bytes.params, streams_blocks * (6 + 2 * kpairs + 6 + 2 * vpairs));
    EXPECT_EQ(u8.bytes.key_codes, f16.bytes.key_codes);
    EXPECT_EQ(u8.bytes.residual, f16.bytes.residual);  // the sinks
    EXPECT_LT(u8.rel_mse_k, 1.25 * f16.rel_mse_k) << bits;
    EXPECT_LT(u8.rel_mse_v, 1.25 * f16.rel_mse_v) << bits;
    EXPECT_GT(u8.rel_mse_k, 0.0);
  }
}

// A stored 8-bit pair set with a header that cannot decode (s0 = 0, a NaN zero) is refused on
// import, and the cache importing it is left as it was.
TEST(KvqMethod, EightBitPairHeadersAreChecked) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  const ModelShape shape = ModelShape::uniform(1, H, D, H, rope);
  const std::string spec = "kvq:k_bits=2,v_bits=2,group=32,residual=0,sinks=0,params=u8";
  auto c = ModelCache::create(spec, shape);
  ASSERT_TRUE(c.ok());
  const auto k = testing::random_kv(1, H, 32, D, 7, 1.0f);
  const auto view = TensorView::bhsd(k.data(), DType::kF32, 1, H, 32, D);
  ASSERT_TRUE(c->layer(0).append(view, view).ok());
  testing::ChunkCollector sink;
  ASSERT_TRUE(c->layer(0).export_blocks(0, sink).ok());
  ASSERT_TRUE(c->layer(0).export_tail(sink).ok());
  auto chunks = sink.chunks();
  auto fresh = ModelCache::create(spec, shape);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(fresh->layer(0).import_chunks(chunks, 1, 32, c->layer(0).window_dtype()).ok());
  // The key part: H streams of packed codes, then H sets; the first set's header.
  const size_t header = static_cast<size_t>(H) * (32 * D * 2 / 8);
  for (auto [at, b0, b1] : {std::tuple{4, 0x00, 0x00}, std::tuple{0, 0xff, 0x7f}}) {
    std::vector<uint8_t> bad(chunks[0].data, chunks[0].data + chunks[0].size);
    bad[header + static_cast<size_t>(at)] = static_cast<uint8_t>(b0);
    bad[header + static_cast<size_t>(at) + 1] = static_cast<uint8_t>(b1);
    auto corrupt = chunks;
    corrupt[0].data = bad.data();
    auto target = ModelCache::create(spec, shape);
    ASSERT_TRUE(target.ok());
    const Status st = target->layer(0).import_chunks(corrupt, 1, 32, c->layer(0).window_dtype());
    EXPECT_FALSE(st.ok());
    EXPECT_NE(st.message().find("8-bit pair set"), std::string::npos) << st.to_string();
    EXPECT_EQ(target->layer(0).offset(), 0);
  }
}

TEST(KvqMethod, EightBitPairsAreForUniformLevels) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  auto c =
      ModelCache::create("kvq:params=u8,k_levels=gauss", ModelShape::uniform(1, H, D, H, rope));
  EXPECT_FALSE(c.ok());
  auto s = ModelCache::create("kvq:group=8,sinks=8", ModelShape::uniform(1, H, D, H, rope));
  EXPECT_FALSE(s.ok());  // sinks must leave quantized rows in the first block
}

}  // namespace
}  // namespace kvq
