// kvq's own method (src/methods/kvq.cc): the properties its design rests on, beyond the contract
// every row meets (cache_contract_test.cc) and the bit ladder (registry_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kvq/cache.h"
#include "kvq/container.h"
#include "kvq/dtype.h"
#include "kvq/safetensors.h"
#include "kvq/status.h"
#include "kvq/workspace.h"
#include "core/cpu.h"
#include "numerics/attention.h"
#include "numerics/hadamard.h"
#include "numerics/rope_table.h"
#include "test_util.h"

namespace kvq {
namespace {

constexpr int H = 2, D = 32, T = 64;

// A one-layer cache of `spec` fed `tokens` random tokens (keys from seed sk, values from sv), and
// what it exported (its blocks, then its tail): the chunks are `sink.chunks()`.
struct Exported {
  testing::ChunkCollector sink;
  DType window_dtype = DType::kF16;
};
void export_one_layer(const std::string& spec, const ModelShape& shape, int64_t tokens,
                      uint64_t sk, uint64_t sv, Exported& e) {
  auto c = ModelCache::create(spec, shape);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const auto k = testing::random_kv(1, H, tokens, D, sk, 1.0f);
  const auto v = testing::random_kv(1, H, tokens, D, sv, 1.0f);
  ASSERT_TRUE(c->layer(0)
                  .append(TensorView::bhsd(k.data(), DType::kF32, 1, H, tokens, D),
                          TensorView::bhsd(v.data(), DType::kF32, 1, H, tokens, D))
                  .ok());
  ASSERT_TRUE(c->layer(0).export_blocks(0, e.sink).ok());
  ASSERT_TRUE(c->layer(0).export_tail(e.sink).ok());
  e.window_dtype = c->layer(0).window_dtype();
}

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

// The shared table of RoPE angles holds the floats of the formula the codec used before it (so
// stored bytes and outputs are unchanged), grows while readers read rows already published, and
// is cleared when its last holder lets go.
TEST(KvqMethod, RopeTableHoldsTheFormulaAndGrowsUnderReaders) {
  const double theta = 10000.0, fs = 0.5;
  const int64_t d = 64, half = d / 2;
  RopeTable t(theta, fs, d);
  EXPECT_EQ(t.size(), 0);
  EXPECT_EQ(t.bytes(), 0u);
  t.ensure(1000);
  ASSERT_GE(t.size(), 1000);
  for (int64_t pos : {0, 1, 2, 255, 256, 511, 777, 999}) {
    const float* r = t.row(pos);
    const double p = static_cast<double>(pos) * fs;
    for (int64_t i = 0; i < half; ++i) {
      const double a = p * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
      ASSERT_EQ(r[i], static_cast<float>(std::cos(a))) << pos << " " << i;
      ASSERT_EQ(r[half + i], static_cast<float>(std::sin(a))) << pos << " " << i;
    }
  }
  // Readers of published rows while a writer grows the table (directories replaced on the way).
  RopeTable ref(theta, fs, d), grown(theta, fs, d);
  ref.ensure(40 * 300);
  grown.ensure(300);
  std::atomic<bool> done{false};
  std::atomic<int64_t> bad{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r)
    readers.emplace_back([&, r] {
      uint64_t x = 12345u + static_cast<uint64_t>(r);
      while (!done.load()) {
        const int64_t n = grown.size();
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const int64_t pos = static_cast<int64_t>((x >> 33) % static_cast<uint64_t>(n));
        if (std::memcmp(grown.row(pos), ref.row(pos), 2 * half * sizeof(float)) != 0) ++bad;
      }
    });
  for (int k = 2; k <= 40; ++k) grown.ensure(k * 300);
  done = true;
  for (auto& th : readers) th.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(std::memcmp(grown.row(11999), ref.row(11999), 2 * half * sizeof(float)), 0);
  // Two holders: the first to let go leaves it; the last clears it.
  grown.acquire();
  grown.acquire();
  grown.release();
  EXPECT_GE(grown.size(), 12000);
  grown.release();
  EXPECT_EQ(grown.size(), 0);
  EXPECT_EQ(grown.bytes(), 0u);
}

// One table per model, billed once (tables: held, not in the stored format's bits), cleared by
// reset; a clone holds its own copy.
TEST(KvqMethod, RopeTableIsSharedAndBilledOnce) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  const int L = 3;
  auto c = ModelCache::create("kvq:group=8,residual=8", ModelShape::uniform(L, H, D, H, rope));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const auto k = testing::random_kv(1, H, T, D, 3);
  for (int l = 0; l < L; ++l)
    ASSERT_TRUE(c->layer(l)
                    .append(TensorView::bhsd(k.data(), DType::kF32, 1, H, T, D),
                            TensorView::bhsd(k.data(), DType::kF32, 1, H, T, D))
                    .ok());
  const CacheBytes b = c->bytes();
  // One chunk of 256 positions (cos and sin of D/2 pairs each) and its directory of 8 pointers.
  const uint64_t table = RopeTable::kChunk * D * sizeof(float) + 8 * sizeof(void*);
  EXPECT_EQ(b.tables, table);
  EXPECT_EQ(c->layer(0).bytes().tables, table);
  EXPECT_EQ(c->layer(1).bytes().tables, 0u);
  EXPECT_EQ(c->resident_bytes(), b.total());
  EXPECT_EQ(b.total(), b.stored() + table);
  EXPECT_DOUBLE_EQ(b.bits_per_element(), 8.0 * static_cast<double>(b.stored()) /
                                             static_cast<double>(b.elements));
  ModelCache copy = c->clone();
  EXPECT_EQ(copy.bytes().tables, table);
  c->layer(0).reset();  // the other layers still hold blocks: the table stays
  EXPECT_EQ(c->bytes().tables, table);
  c->reset();
  EXPECT_EQ(c->bytes().total(), 0u);
  EXPECT_EQ(c->resident_bytes(), 0u);
  EXPECT_EQ(copy.bytes().tables, table);  // the clone's own
  std::vector<float> gk, gv;
  testing::read_all(copy.layer(2), gk, gv);  // and it still reads
}

// Attention sums rotated values in their rotated basis and unrotates each output once (and, for
// rotated keys without RoPE after them, rotates the query once instead of unrotating each key).
// Against the old path — every sealed row decoded to the model's basis, then the same kernel over
// the same tiles, emulated here from read() and read_exact() — the outputs differ by rounding
// only: within 1e-5 * (1 + |out|) (measured: about 2e-6 at most, on values ~ 1, 100 to 112
// positions).
TEST(KvqMethod, AttentionInTheRotatedBasisMatchesTheOldPath) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  const int HQ = 2 * H;
  const float scale = 0.3f;
  for (const std::string spec :
       {"kvq:group=8,residual=8,sinks=2", "kvq:group=8,residual=8,sinks=2,k_rot=on,rope=post",
        "kvq:group=8,residual=8,sinks=0,k_rot=on,v_rot=off,rope=post",
        "kvq:group=32,residual=0,sinks=4,k_bits=2,v_bits=2"}) {
    auto c = ModelCache::create(spec, ModelShape::uniform(1, H, D, HQ, rope));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    LayerCache& layer = c->layer(0);
    const int64_t S0 = 100, steps = 12;
    const auto k = testing::random_kv(1, H, S0 + steps, D, 21);
    const auto v = testing::random_kv(1, H, S0 + steps, D, 22);
    const auto q = testing::random_kv(1, HQ, S0 + steps, D, 23);
    auto kv_at = [&](const std::vector<float>& x, int64_t heads, int64_t t0, int64_t n) {
      TensorView view = TensorView::bhsd(x.data(), DType::kF32, 1, heads, S0 + steps, D);
      view.shape[2] = n;
      view.data = x.data() + t0 * D;
      return view;
    };
    ASSERT_TRUE(layer.append(kv_at(k, H, 0, S0), kv_at(v, H, 0, S0)).ok());
    double worst = 0;
    for (int64_t st = 0; st < steps; ++st) {
      const int64_t pos = S0 + st;
      const TensorView qv = kv_at(q, HQ, pos, 1);
      ASSERT_TRUE(layer.append(kv_at(k, H, pos, 1), kv_at(v, H, pos, 1), &qv).ok());
      std::vector<float> got(HQ * D);
      ASSERT_TRUE(layer.attend(qv, scale, MutTensorView::bhsd(got.data(), DType::kF32, 1, HQ, 1, D))
                      .ok());
      // The old path.
      const int64_t n_all = pos + 1, boundary = layer.sealed_tokens_for_query(pos);
      std::vector<float> rk, rv, ek, ev;
      testing::read_all(layer, rk, rv);
      const int64_t eb = layer.exact_begin(), ne = n_all - eb;
      ASSERT_LE(eb, boundary);
      ek.resize(static_cast<size_t>(H * ne * D));
      ev.resize(ek.size());
      ASSERT_TRUE(layer.read_exact(eb, ne, MutTensorView::bhsd(ek.data(), DType::kF32, 1, H, ne, D),
                                   MutTensorView::bhsd(ev.data(), DType::kF32, 1, H, ne, D))
                      .ok());
      const int64_t bt = layer.block_tokens();
      const int64_t A = bt < 32 ? bt * ((64 + bt - 1) / bt) : bt;  // the layer's tile
      Workspace ws;
      for (int64_t h = 0; h < H; ++h) {
        std::vector<float> qr(2 * D), acc(2 * D, 0.0f), kt(A * D), vt(A * D);
        std::vector<float> m(2, -INFINITY), l(2, 0.0f);
        for (int j = 0; j < 2; ++j)
          for (int64_t d = 0; d < D; ++d) qr[j * D + d] = qv.load(0, h * 2 + j, 0, d) * scale;
        for (int64_t p0 = 0; p0 < n_all; p0 += A) {
          const int64_t n = std::min(A, n_all - p0);
          for (int64_t j = 0; j < n; ++j) {
            const int64_t p = p0 + j;
            const float* ks = p < boundary ? &rk[((h * n_all) + p) * D] : &ek[((h * ne) + p - eb) * D];
            const float* vs = p < boundary ? &rv[((h * n_all) + p) * D] : &ev[((h * ne) + p - eb) * D];
            std::memcpy(&kt[j * D], ks, D * 4);
            std::memcpy(&vt[j * D], vs, D * 4);
          }
          const int64_t vis[2] = {n, n};
          attend_tile(qr.data(), 2, D, kt.data(), vt.data(), n, vis, m.data(), l.data(),
                      acc.data(), ws);
        }
        for (int j = 0; j < 2; ++j)
          for (int64_t d = 0; d < D; ++d) {
            const float old = acc[j * D + d] * (1.0f / l[j]);
            const float now = got[(h * 2 + j) * D + d];
            worst = std::max(worst, std::fabs(static_cast<double>(now - old)) / (1 + std::fabs(old)));
          }
      }
    }
    EXPECT_LT(worst, 1e-5) << spec;
    std::printf("%s: max |new - old| / (1 + |old|) = %.3g\n", spec.c_str(), worst);
    EXPECT_GT(worst, 0.0) << spec << ": the basis path should round differently somewhere";
    RecordProperty("max_rel_diff", std::to_string(worst));
  }
}

// The order-64 Walsh-Hadamard transforms in registers (AVX2, AVX-512) give the generic code's
// bits (the same butterflies in the same stage order).
TEST(KvqMethod, Hadamard64InRegistersMatchesTheGenericCode) {
#if KVQ_SIMD_X86
  const auto x = testing::random_kv(1, 1, 200, 64, 31, 3.0f);
  for (int64_t r = 0; r < 200; ++r) {
    std::vector<float> want(x.begin() + r * 64, x.begin() + (r + 1) * 64), a = want, b = want;
    hadamard_inplace(want.data(), 64);
    if (simd_level() >= SimdLevel::kAvx2) {
      hadamard64_avx2(a.data());
      ASSERT_EQ(0, std::memcmp(a.data(), want.data(), 64 * 4)) << r;
    }
    if (simd_level() >= SimdLevel::kAvx512) {
      hadamard64_avx512(b.data());
      ASSERT_EQ(0, std::memcmp(b.data(), want.data(), 64 * 4)) << r;
    }
  }
#else
  GTEST_SKIP() << "x86 only";
#endif
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
  Exported e;
  ASSERT_NO_FATAL_FAILURE(export_one_layer(spec, shape, 32, 7, 7, e));
  const auto chunks = e.sink.chunks();
  auto fresh = ModelCache::create(spec, shape);
  ASSERT_TRUE(fresh.ok());
  ASSERT_TRUE(fresh->layer(0).import_chunks(chunks, 1, 32, e.window_dtype).ok());
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
    const Status st = target->layer(0).import_chunks(corrupt, 1, 32, e.window_dtype);
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

// Keys or values [1, H, S, D] with 8 planted outliers (40, alternately signed, where the data's
// spread is ~2) per stream and block of 32 tokens, in distinct rows (>= 2, past the sinks) and
// distinct channels; their flat indices in `where`.
std::vector<float> plant_outliers(std::vector<float> x, int64_t S, int shift,
                                  std::vector<size_t>* where) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t b = 0; b < S / 32; ++b)
      for (int j = 0; j < 8; ++j) {
        const int64_t t = b * 32 + 2 + 3 * j + (b + h + shift) % 3;
        const int64_t d = (5 * j + b + shift) % D;
        const size_t i = static_cast<size_t>((h * S + t) * D + d);
        x[i] = j % 2 ? -40.0f : 40.0f;
        where->push_back(i);
      }
  return x;
}

// outliers=N keeps each block stream's most deviant elements exact: in the model's basis
// (rope=post, no rotations) the planted ones read back as their fp16 values, bit for bit; out of
// their groups' ranges they no longer blow up their neighbours' steps; each costs 4 bytes, billed
// with the pairs.
TEST(KvqMethod, OutliersComeBackExactAndCostFourBytes) {
  const int64_t S = 4 * 32;
  std::vector<size_t> kw, vw;
  const auto k = plant_outliers(testing::random_kv(1, H, S, D, 41, 1.0f), S, 0, &kw);
  const auto v = plant_outliers(testing::random_kv(1, H, S, D, 42, 1.0f), S, 1, &vw);
  for (const std::string params : {"f16", "u8"}) {
    const std::string base = "kvq:k_bits=2,v_bits=2,group=32,residual=0,sinks=2,rope=post,"
                             "v_rot=off,params=" + params;
    const Outcome off = run(base, k, v), on = run(base + ",outliers=10", k, v);
    EXPECT_LT(on.rel_mse_k, 0.5 * off.rel_mse_k) << params;
    EXPECT_LT(on.rel_mse_v, 0.5 * off.rel_mse_v) << params;
    // k = ceil(10 / 1000 * quantized elements): 10 in block 0 (30 rows), 11 in the others.
    EXPECT_EQ(on.bytes.params - off.bytes.params, uint64_t{H} * 2 * 4 * (10 + 3 * 11)) << params;
    EXPECT_EQ(on.bytes.key_codes, off.bytes.key_codes);
    EXPECT_EQ(on.bytes.residual, off.bytes.residual);
    auto c = ModelCache::create(base + ",outliers=10", ModelShape::uniform(1, H, D, H));
    ASSERT_TRUE(c.ok()) << c.status().to_string();
    const auto kv = TensorView::bhsd(k.data(), DType::kF32, 1, H, S, D);
    const auto vv = TensorView::bhsd(v.data(), DType::kF32, 1, H, S, D);
    ASSERT_TRUE(c->layer(0).append(kv, vv).ok());
    std::vector<float> gk, gv;
    testing::read_all(c->layer(0), gk, gv);
    for (size_t i : kw) EXPECT_EQ(gk[i], f16_to_f32(f32_to_f16(k[i]))) << params << " key " << i;
    for (size_t i : vw) EXPECT_EQ(gv[i], f16_to_f32(f32_to_f16(v[i]))) << params << " value " << i;
  }
  // At the defaults (pre-RoPE keys, rotated values) the outliers are picked in the quantized
  // basis: a planted key stays sparse there (RoPE turns it within its pair), so keys gain;
  // a rotation spreads a value's outlier over its row, and values lose nothing.
  const std::string base = "kvq:k_bits=2,v_bits=2,group=32,residual=0,sinks=2";
  const Outcome off = run(base, k, v), on = run(base + ",outliers=10", k, v);
  EXPECT_LT(on.rel_mse_k, 0.5 * off.rel_mse_k);
  EXPECT_LE(on.rel_mse_v, off.rel_mse_v);
}

// Stored outliers are checked on import: indices strictly increasing, outside the sink rows and
// inside the block, values finite; anything else is kCorrupt and leaves the importer as it was.
TEST(KvqMethod, StoredOutliersAreChecked) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  const ModelShape shape = ModelShape::uniform(1, H, D, H, rope);
  const std::string spec =
      "kvq:k_bits=2,v_bits=2,group=32,residual=0,sinks=2,params=f16,outliers=10";
  Exported e;
  ASSERT_NO_FATAL_FAILURE(export_one_layer(spec, shape, 32, 43, 43, e));
  const auto chunks = e.sink.chunks();
  // The key part: H x 256 bytes of codes, H x 128 of pairs, H x 128 of sinks, then stream 0's
  // 10 indices and 10 values.
  const size_t at = static_cast<size_t>(H) * (256 + 128 + 128);
  ASSERT_EQ(chunks[0].size, at + static_cast<size_t>(H) * 40);
  auto u16 = [&](size_t i) {
    uint16_t x;
    std::memcpy(&x, chunks[0].data + at + 2 * i, 2);
    return x;
  };
  ASSERT_LT(u16(0), u16(1));
  ASSERT_GE(u16(0), 2 * D);
  {
    auto fresh = ModelCache::create(spec, shape);
    ASSERT_TRUE(fresh->layer(0).import_chunks(chunks, 1, 32, e.window_dtype).ok());
  }
  const std::vector<std::pair<size_t, uint16_t>> bad = {
      {0, u16(1)},                      // not increasing (equal to the next)
      {1, u16(0)},                      // equal to the previous
      {0, static_cast<uint16_t>(2 * D - 1)},  // in a sink row
      {9, static_cast<uint16_t>(32 * D)},     // past the block
      {10, 0x7e00},                           // a NaN value
      {12, 0x7c00},                           // an infinite one
  };
  for (const auto& [i, x] : bad) {
    std::vector<uint8_t> bytes(chunks[0].data, chunks[0].data + chunks[0].size);
    std::memcpy(bytes.data() + at + 2 * i, &x, 2);
    auto corrupt = chunks;
    corrupt[0].data = bytes.data();
    auto target = ModelCache::create(spec, shape);
    ASSERT_TRUE(target.ok());
    const Status st = target->layer(0).import_chunks(corrupt, 1, 32, e.window_dtype);
    EXPECT_EQ(st.code(), ErrorCode::kCorrupt) << i << ": " << st.to_string();
    EXPECT_NE(st.message().find("kvq key outliers"), std::string::npos) << st.to_string();
    EXPECT_EQ(target->layer(0).offset(), 0);
  }
}

// Outlier indices are u16 into a block stream: group * head_dim must stay within 65535.
TEST(KvqMethod, OutliersNeedBlockStreamsThatU16Indexes) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  const ModelShape shape = ModelShape::uniform(1, H, D, H, rope);
  auto big = ModelCache::create("kvq:group=2048,outliers=1", shape);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(big.status().message().find("group * head_dim <= 65535"), std::string::npos)
      << big.status().to_string();
  EXPECT_TRUE(ModelCache::create("kvq:group=2047,outliers=1", shape).ok());
  EXPECT_TRUE(ModelCache::create("kvq:group=2048,outliers=0", shape).ok());
}

// The committed real K/V (4 layers of SmolLM2-135M: 3 KV heads, head_dim 64, 512 tokens)
// through a kvq cache of `spec` with SmolLM2's RoPE.
ModelCache real_cache(const std::string& spec) {
  static const auto file =
      read_safetensors(testing::source_dir() + "/tests/data/smollm2_kv_small.safetensors");
  KVQ_CHECK(file.ok());
  auto c = ModelCache::create(
      spec, ModelShape::uniform(4, 3, 64, 9, RopeShape{RopeShape::Mode::kAdjacent, 100000.0, 1.0}));
  KVQ_CHECK(c.ok());
  int l = 0;
  for (int layer : {0, 10, 20, 29}) {
    const std::string p = "layers." + std::to_string(layer) + ".";
    auto k = file->find(p + "k")->view4();
    auto v = file->find(p + "v")->view4();
    KVQ_CHECK(k.ok() && v.ok());
    KVQ_CHECK(c->layer(l++).append(*k, *v).ok());
  }
  return std::move(*c);
}

// entropy=on is lossless: the same reads and attention outputs bit for bit, the same pairs,
// outliers and sinks; on real K/V fewer code bytes (measured at the defaults: keys 0.994, values
// 0.933 of packed; min/max codes of a 32-token group are close to uniform, and rotated 4-bit
// keys take their raw stream), never more than the raw stream and its mode byte; 4 bytes of end
// offset per stream and part billed as meta; resident == billed; a .kvq file of it reads back
// and rewrites to the same bytes.
TEST(KvqMethod, EntropyCodingIsLosslessAndBillsWhatItHolds) {
  for (const std::string base :
       {"kvq:residual=0", "kvq:k_bits=2,v_bits=2,residual=8,outliers=10",
        "kvq:k_bits=4,v_bits=4,params=f16,k_rot=on,rope=post,residual=0",
        "kvq:k_bits=8,v_bits=8,residual=0"}) {
    ModelCache off = real_cache(base), on = real_cache(base + ",entropy=on");
    const CacheBytes a = off.bytes(), b = on.bytes();
    const int64_t blocks = 4 * on.layer(0).sealed_tokens() / on.layer(0).block_tokens();
    EXPECT_EQ(b.params, a.params) << base;
    EXPECT_EQ(b.residual, a.residual) << base;
    EXPECT_EQ(b.elements, a.elements) << base;
    EXPECT_EQ(b.meta, a.meta + uint64_t{8} * 3 * static_cast<uint64_t>(blocks)) << base;
    // A stream never takes more than its packed codes and a mode byte; below 8 bits the codes
    // of a block (keys and values) take fewer bytes than packed.
    EXPECT_LE(b.key_codes, a.key_codes + 3 * static_cast<uint64_t>(blocks)) << base;
    EXPECT_LE(b.value_codes, a.value_codes + 3 * static_cast<uint64_t>(blocks)) << base;
    if (base.find("bits=8") == std::string::npos) {
      EXPECT_LT(b.key_codes + b.value_codes, a.key_codes + a.value_codes) << base;
    }
    EXPECT_EQ(on.resident_bytes(), b.total()) << base;
    std::printf("%s: key codes %.3f, value codes %.3f of packed; %.3f -> %.3f bits/element\n",
                base.c_str(), static_cast<double>(b.key_codes) / static_cast<double>(a.key_codes),
                static_cast<double>(b.value_codes) / static_cast<double>(a.value_codes),
                a.bits_per_element(), b.bits_per_element());
    const auto q = testing::random_kv(1, 9, 1, 64, 44, 0.3f);
    const TensorView qv = TensorView::bhsd(q.data(), DType::kF32, 1, 9, 1, 64);
    for (int l = 0; l < 4; ++l) {
      std::vector<float> ka, va, kb, vb;
      testing::read_all(off.layer(l), ka, va);
      testing::read_all(on.layer(l), kb, vb);
      EXPECT_TRUE(ka == kb && va == vb) << base << " layer " << l;
      std::vector<float> oa(9 * 64), ob(9 * 64);
      ASSERT_TRUE(
          off.layer(l).attend(qv, 0.125f, MutTensorView::bhsd(oa.data(), DType::kF32, 1, 9, 1, 64))
              .ok());
      ASSERT_TRUE(
          on.layer(l).attend(qv, 0.125f, MutTensorView::bhsd(ob.data(), DType::kF32, 1, 9, 1, 64))
              .ok());
      EXPECT_EQ(0, std::memcmp(oa.data(), ob.data(), oa.size() * 4)) << base << " layer " << l;
    }
    auto file = serialize_cache(on);
    ASSERT_TRUE(file.ok()) << file.status().to_string();
    auto back = parse_cache(file->data(), file->size());
    ASSERT_TRUE(back.ok()) << back.status().to_string();
    auto again = serialize_cache(*back);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(*again == *file) << base;
    EXPECT_EQ(back->resident_bytes(), back->bytes().total()) << base;
    std::vector<float> kc, vc, kd, vd;
    testing::read_all(on.layer(3), kc, vc);
    testing::read_all(back->layer(3), kd, vd);
    EXPECT_TRUE(kc == kd && vc == vd) << base;
  }
}

// Coded streams are checked on import: end offsets (in order, inside the part, the last at its
// end), each stream whole and decodable; anything else is kCorrupt and the importer untouched.
TEST(KvqMethod, CodedStreamsAreChecked) {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};
  const ModelShape shape = ModelShape::uniform(1, H, D, H, rope);
  const std::string spec = "kvq:group=32,residual=0,sinks=2,entropy=on";
  Exported e;
  ASSERT_NO_FATAL_FAILURE(export_one_layer(spec, shape, 64, 45, 46, e));
  const auto chunks = e.sink.chunks();
  const DType wd = e.window_dtype;
  {
    auto fresh = ModelCache::create(spec, shape);
    ASSERT_TRUE(fresh->layer(0).import_chunks(chunks, 1, 64, wd).ok());
  }
  // Block 0's key part: H end offsets, H 8-bit pair sets (6 + 2 * 32 bytes), H x 2 sink rows,
  // then the streams.
  const size_t fixed = static_cast<size_t>(H) * (4 + 6 + 2 * D + 2 * 2 * D);
  const size_t region = chunks[0].size - fixed;
  uint32_t end0, end1;
  std::memcpy(&end0, chunks[0].data, 4);
  std::memcpy(&end1, chunks[0].data + 4, 4);
  ASSERT_EQ(end1, region);
  ASSERT_LT(end0, end1);
  struct Damage {
    const char* what;
    size_t at;  // a byte offset into the part, or SIZE_MAX to cut its last byte
    std::vector<uint8_t> bytes;
  };
  auto le = [](uint32_t x) {
    std::vector<uint8_t> b(4);
    std::memcpy(b.data(), &x, 4);
    return b;
  };
  const std::vector<Damage> damage = {
      {"first stream past the second", 0, le(end1 + 1)},
      {"offset beyond the part", 0, le(0xffffffffu)},
      {"last stream short of the end", 4, le(end1 - 1)},
      {"a byte moved between streams", 0, le(end0 + 1)},
      {"empty first stream", 0, le(0)},
      {"unknown mode byte", fixed, {0xff}},
      {"truncated part", SIZE_MAX, {}},
  };
  for (const auto& d : damage) {
    std::vector<uint8_t> bytes(chunks[0].data, chunks[0].data + chunks[0].size);
    if (d.at == SIZE_MAX)
      bytes.pop_back();
    else
      std::memcpy(bytes.data() + d.at, d.bytes.data(), d.bytes.size());
    auto bad = chunks;
    bad[0].data = bytes.data();
    bad[0].size = bytes.size();
    auto target = ModelCache::create(spec, shape);
    ASSERT_TRUE(target.ok());
    const Status st = target->layer(0).import_chunks(bad, 1, 64, wd);
    EXPECT_EQ(st.code(), ErrorCode::kCorrupt) << d.what << ": " << st.to_string();
    EXPECT_NE(st.message().find("kvq key codes"), std::string::npos) << st.to_string();
    EXPECT_EQ(target->layer(0).offset(), 0) << d.what;
  }
}

}  // namespace
}  // namespace kvq
