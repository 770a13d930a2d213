// CacheGen: the numerics (quantization identical to the foundation's, delta transforms and their
// inverses, the layer schedule, sizes), and the method in every delta/tables/values variant (the
// contract test covers the defaults; here the variants get the properties that matter most:
// chunk invariance, resident == accounted, bit-exact export/import, clone, trim, damage).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <sstream>

#include "entropy/cachegen_codes.h"
#include "entropy/symbol_codec.h"
#include "kvq/bitpack.h"
#include "kvq/cache.h"
#include "kvq/group_quant.h"
#include "test_util.h"

namespace kvq {
namespace {

using cachegen::Axis;
using cachegen::DeltaMode;

constexpr DeltaMode kModes[] = {DeltaMode::kNone, DeltaMode::kToken, DeltaMode::kGroup,
                                DeltaMode::kAnchor};

std::vector<uint8_t> random_codes(std::mt19937& rng, size_t n, int bits) {
  std::vector<uint8_t> c(n);
  for (auto& x : c) x = static_cast<uint8_t>(rng() & ((1u << bits) - 1));
  return c;
}

// ---------------------------------------------------------------------------------------------
// Numerics

TEST(CachegenNumerics, QuantizationIsTheFoundations) {
  const int64_t n = 70, D = 12;
  const auto x = testing::random_kv(1, 1, n, D, 3);
  for (int bits : {2, 4}) {
    // Per channel over runs of 32 tokens (the last run shorter).
    auto cs = cachegen::quantize_to_codes(x.data(), n, D, bits, 32, Axis::kChannel);
    ASSERT_EQ(cs.params.size(), static_cast<size_t>(3 * D));
    std::vector<float> got(static_cast<size_t>(n * D)), want(got.size());
    cachegen::dequant_codes(cs, got.data());
    for (int64_t t0 = 0; t0 < n; t0 += 32) {
      const int64_t rows = std::min<int64_t>(32, n - t0);
      quant_dequant_per_channel(x.data() + t0 * D, rows, D, bits, want.data() + t0 * D);
    }
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4));
    // Per token over runs of 5 channels.
    auto ct = cachegen::quantize_to_codes(x.data(), n, D, bits, 5, Axis::kToken);
    ASSERT_EQ(ct.params.size(), static_cast<size_t>(n * 3));
    cachegen::dequant_codes(ct, got.data());
    quant_dequant_per_token(x.data(), n, D, 5, bits, want.data());
    EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * 4));
  }
}

TEST(CachegenNumerics, TokenDeltaIsTheSeeds) {
  std::mt19937 rng(1);
  const int64_t n = 9, D = 5;
  const auto c = random_codes(rng, n * D, 3);
  std::vector<uint8_t> s(c.size());
  cachegen::token_delta(c.data(), n, D, 3, s.data());
  for (int64_t d = 0; d < D; ++d) EXPECT_EQ(s[d], c[d]);
  for (int64_t t = 1; t < n; ++t)
    for (int64_t d = 0; d < D; ++d)
      EXPECT_EQ(s[t * D + d], (c[t * D + d] - c[(t - 1) * D + d]) & 7);
  std::vector<uint8_t> back(c.size());
  cachegen::token_delta_inverse(s.data(), n, D, 3, back.data());
  EXPECT_EQ(back, c);
}

TEST(CachegenNumerics, EveryDeltaModeInvertsExactlyInPlaceToo) {
  std::mt19937 rng(2);
  for (int trial = 0; trial < 200; ++trial) {
    const int bits = 1 + static_cast<int>(rng() % 8);
    const int64_t n = static_cast<int64_t>(rng() % 70), D = 1 + static_cast<int64_t>(rng() % 20);
    const int64_t group = 1 + static_cast<int64_t>(rng() % 12);
    const auto c = random_codes(rng, static_cast<size_t>(n * D), bits);
    for (DeltaMode m : kModes) {
      std::vector<uint8_t> s(c.size()), back(c.size());
      cachegen::apply_delta(m, group, c.data(), n, D, bits, s.data());
      for (uint8_t v : s) ASSERT_LT(v, 1u << bits);
      cachegen::invert_delta(m, group, s.data(), n, D, bits, back.data());
      ASSERT_EQ(back, c) << cachegen::delta_mode_name(m);
      auto inplace = c;
      cachegen::apply_delta(m, group, inplace.data(), n, D, bits, inplace.data());
      ASSERT_EQ(inplace, s);
      cachegen::invert_delta(m, group, inplace.data(), n, D, bits, inplace.data());
      ASSERT_EQ(inplace, c);
    }
    // kAuto through the chunk functions, with its mask.
    std::vector<uint8_t> s(c.size()), mask(cachegen::mask_bytes(D), 0xEE), back(c.size());
    cachegen::chunk_symbols(DeltaMode::kAuto, group, c.data(), n, D, bits, s.data(), mask.data());
    if (D % 8) {
      EXPECT_EQ(mask.back() >> (D % 8), 0);  // canonical: no bits beyond D
    }
    cachegen::chunk_codes(DeltaMode::kAuto, group, s.data(), mask.data(), n, D, bits, back.data());
    ASSERT_EQ(back, c);
  }
}

TEST(CachegenNumerics, GroupAndAnchorRestartAtEveryGroup) {
  const int64_t n = 8, D = 1;
  const std::vector<uint8_t> c = {1, 2, 4, 7, 3, 3, 5, 6};
  std::vector<uint8_t> s(n);
  cachegen::apply_delta(DeltaMode::kGroup, 4, c.data(), n, D, 3, s.data());
  EXPECT_EQ(s, (std::vector<uint8_t>{1, 1, 2, 3, 3, 0, 2, 1}));
  cachegen::apply_delta(DeltaMode::kAnchor, 4, c.data(), n, D, 3, s.data());
  EXPECT_EQ(s, (std::vector<uint8_t>{1, 1, 3, 6, 3, 0, 2, 3}));
}

TEST(CachegenNumerics, AutoDeltaPicksTheSmallerEntropyPerChannel) {
  // Channel 0 is a slow ramp (deltas are all 1), channel 1 repeats a pattern whose deltas are
  // spread, channel 2 is constant (ties keep no delta).
  const int64_t n = 64, D = 3;
  std::vector<uint8_t> c(static_cast<size_t>(n * D));
  for (int64_t t = 0; t < n; ++t) {
    c[t * D] = static_cast<uint8_t>(t & 15);
    c[t * D + 1] = static_cast<uint8_t>((t * 7) % 3 == 0 ? 0 : 9);
    c[t * D + 2] = 5;
  }
  uint8_t mask = 0;
  cachegen::choose_channel_deltas(c.data(), n, D, 4, &mask);
  EXPECT_EQ(mask & 1, 1);
  EXPECT_EQ((mask >> 2) & 1, 0);
}

TEST(CachegenNumerics, LayerScheduleIsTheSeeds) {
  const auto b = cachegen::layer_group_bits(30, 4, 3);
  for (int l = 0; l < 30; ++l)
    EXPECT_EQ(b[static_cast<size_t>(l)], l < 10 ? 4 : l < 20 ? 3 : 2) << l;
  EXPECT_EQ(cachegen::layer_group_bits(6, 3, 3),
            (std::vector<int>{3, 3, 2, 2, 2, 2}));  // floored at 2
  EXPECT_EQ(cachegen::layer_group_bits(4, 1, 3),
            (std::vector<int>{1, 1, 1, 1}));  // never above base
  EXPECT_EQ(cachegen::layer_group_bits(5, 8, 1), (std::vector<int>{8, 8, 8, 8, 8}));
  EXPECT_EQ(cachegen::layer_group_bits(2, 6, 9),
            (std::vector<int>{6, 5}));  // groups clamped to layers
  // Non-increasing with depth, always.
  for (int L : {1, 7, 30, 64})
    for (int g : {1, 2, 3, 5}) {
      const auto v = cachegen::layer_group_bits(L, 5, g);
      for (size_t i = 1; i < v.size(); ++i) EXPECT_LE(v[i], v[i - 1]);
    }
}

TEST(CachegenNumerics, SizesAreConsistent) {
  EXPECT_NEAR(cachegen::symbol_entropy_bits(std::vector<uint8_t>{0, 1, 2, 3}.data(), 4), 2.0,
              1e-12);
  EXPECT_EQ(cachegen::symbol_entropy_bits(std::vector<uint8_t>{7, 7, 7}.data(), 3), 0.0);
  EXPECT_EQ(cachegen::symbol_entropy_bits(nullptr, 0), 0.0);

  const int64_t n = 512, D = 16;
  const auto x = testing::random_kv(1, 1, n, D, 5);
  for (int bits : {2, 4, 8}) {
    auto cs = cachegen::quantize_to_codes(x.data(), n, D, bits, 32, Axis::kChannel);
    const size_t params = cs.params.size() * 4;
    EXPECT_EQ(cachegen::param_bytes(cs), params);
    EXPECT_EQ(cachegen::fixed_width_bytes(cs),
              packed_size(static_cast<size_t>(n * D), bits) + params);
    for (DeltaMode m : {DeltaMode::kNone, DeltaMode::kToken, DeltaMode::kGroup, DeltaMode::kAnchor,
                        DeltaMode::kAuto}) {
      cachegen::CodingOptions o;
      o.delta = m;
      o.chunk = 128;
      auto coded = cachegen::entropy_coded_bytes(cs, o);
      ASSERT_TRUE(coded.ok());
      // Never above fixed width plus one mode byte (and a channel mask) per chunk.
      const size_t slack = 4 * (1 + (m == DeltaMode::kAuto ? cachegen::mask_bytes(D) : 0));
      EXPECT_LE(*coded, cachegen::fixed_width_bytes(cs, 128) + slack);
      const double shannon = cachegen::shannon_estimate_bytes(cs, o);
      EXPECT_GE(shannon, static_cast<double>(params));
      EXPECT_LE(shannon, static_cast<double>(cachegen::fixed_width_bytes(cs)) + 1e-9);
    }
  }
  // Batched variants agree with one stream at a time.
  const auto xb = testing::random_kv(2, 3, 64, 8, 6);
  auto streams = cachegen::quantize_to_codes_batched(xb.data(), 6, 64, 8, 3, 16, Axis::kToken);
  ASSERT_EQ(streams.size(), 6u);
  std::vector<float> all(xb.size()), one(64 * 8);
  cachegen::dequant_codes_batched(streams, all.data());
  for (int64_t g = 0; g < 6; ++g) {
    auto s = cachegen::quantize_to_codes(xb.data() + g * 64 * 8, 64, 8, 3, 16, Axis::kToken);
    EXPECT_EQ(s.codes, streams[static_cast<size_t>(g)].codes);
    cachegen::dequant_codes(s, one.data());
    EXPECT_EQ(0, std::memcmp(one.data(), all.data() + g * 64 * 8, one.size() * 4));
  }
  cachegen::CodingOptions o;
  auto sizes = cachegen::entropy_coded_bytes_batched(streams, o);
  ASSERT_TRUE(sizes.ok());
  const auto fixed = cachegen::fixed_width_bytes_batched(streams);
  for (size_t g = 0; g < streams.size(); ++g) {
    EXPECT_EQ((*sizes)[g], *cachegen::entropy_coded_bytes(streams[g], o));
    EXPECT_EQ(fixed[g], cachegen::fixed_width_bytes(streams[g]));
  }
  std::vector<uint8_t> codes(6 * 64 * 8), d1(codes.size()), d2(64 * 8);
  for (size_t g = 0; g < 6; ++g)
    std::copy(streams[g].codes.begin(), streams[g].codes.end(), codes.begin() + g * 512);
  cachegen::token_delta_batched(codes.data(), 6, 64, 8, 3, d1.data());
  for (int64_t g = 0; g < 6; ++g) {
    cachegen::token_delta(codes.data() + g * 512, 64, 8, 3, d2.data());
    EXPECT_EQ(0, std::memcmp(d2.data(), d1.data() + g * 512, 512));
  }
}

// ---------------------------------------------------------------------------------------------
// The method

constexpr int64_t B = 2, H = 2, D = 16, S = 75;

ModelCache make(const std::string& spec, int layers = 1) {
  auto c = ModelCache::create(spec, ModelShape::uniform(layers, H, D, 2 * H));
  if (!c.ok()) {
    ADD_FAILURE() << spec << ": " << c.status().to_string();
    std::abort();
  }
  return std::move(*c);
}

// Smooth data (strong token locality) so that the coder has something to find.
std::vector<float> smooth_kv(uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(B * H * S * D));
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t d = 0; d < D; ++d) {
      float v = n(rng);
      for (int64_t t = 0; t < S; ++t) {
        v = 0.9f * v + 0.3f * n(rng);
        x[static_cast<size_t>((bh * S + t) * D + d)] = v + 0.2f * static_cast<float>(d % 3);
      }
    }
  return x;
}

TensorView view(const std::vector<float>& x, int64_t s0, int64_t n) {
  return TensorView::bhsd(x.data(), DType::kF32, B, H, S, D).slice_tokens(s0, n);
}

struct Snap {
  std::vector<float> k, v;
  CacheBytes bytes;
  uint64_t resident = 0;
  bool operator==(const Snap& o) const {
    return k == o.k && v == o.v && bytes.total() == o.bytes.total() && bytes.meta == o.bytes.meta &&
           bytes.key_codes == o.bytes.key_codes && bytes.value_codes == o.bytes.value_codes &&
           resident == o.resident;
  }
};

Snap snap(const LayerCache& c) {
  Snap s;
  testing::read_all(c, s.k, s.v);
  s.bytes = c.bytes();
  s.resident = c.resident_bytes();
  return s;
}

std::vector<std::string> variant_specs() {
  std::vector<std::string> out;
  for (const char* delta : {"none", "token", "group", "anchor", "auto"})
    for (const char* tables : {"channel", "pooled", "auto", "shared"})
      out.push_back(std::string("cachegen:bits=4,group=4,chunk=16,residual=8,delta=") + delta +
                    ",tables=" + tables);
  out.push_back(
      "cachegen:bits=2,group=8,chunk=32,residual=5,delta=auto,tables=shared,values=channel");
  out.push_back("cachegen:bits=8,group=4,chunk=8,residual=0,delta=token,tables=channel");
  out.push_back("cachegen:bits=1,group=2,chunk=4,residual=3,delta=anchor,tables=shared");
  out.push_back("cachegen:bits=5,group=16,chunk=32,residual=2,delta=auto,tables=auto");
  return out;
}

class CachegenVariant : public ::testing::TestWithParam<std::string> {};

TEST_P(CachegenVariant, ChunkInvarianceAndAccounting) {
  const auto k = smooth_kv(1), v = smooth_kv(2);
  ModelCache one = make(GetParam()), tok = make(GetParam()), chunks = make(GetParam());
  ASSERT_TRUE(one.layer(0).append(view(k, 0, S), view(v, 0, S)).ok());
  for (int64_t s = 0; s < S; ++s)
    ASSERT_TRUE(tok.layer(0).append(view(k, s, 1), view(v, s, 1)).ok());
  std::mt19937 rng(3);
  for (int64_t s = 0; s < S;) {
    const int64_t n = std::min<int64_t>(S - s, 1 + static_cast<int64_t>(rng() % 9));
    ASSERT_TRUE(chunks.layer(0).append(view(k, s, n), view(v, s, n)).ok());
    EXPECT_EQ(chunks.resident_bytes(), chunks.bytes().total());
    s += n;
  }
  const Snap a = snap(one.layer(0));
  EXPECT_TRUE(a == snap(tok.layer(0)));
  EXPECT_TRUE(a == snap(chunks.layer(0)));
  EXPECT_EQ(one.resident_bytes(), one.bytes().total());
  EXPECT_GT(one.layer(0).n_blocks(), 1);
}

TEST_P(CachegenVariant, ValuesSeenAreTheGroupQuantizations) {
  const auto k = smooth_kv(4), v = smooth_kv(5);
  ModelCache c = make(GetParam());
  ASSERT_TRUE(c.layer(0).append(view(k, 0, S), view(v, 0, S)).ok());
  const Spec& s = c.layer(0).spec();
  const int bits = static_cast<int>(s.get_int("bits"));
  const int64_t group = s.get_int("group"), T = s.get_int("chunk");
  const Axis vaxis = s.get_enum("values") == "token" ? Axis::kToken : Axis::kChannel;
  std::vector<float> rk, rv;
  testing::read_all(c.layer(0), rk, rv);
  const int64_t sealed = c.layer(0).sealed_tokens();
  ASSERT_GT(sealed, 0);
  std::vector<float> want(static_cast<size_t>(T * D));
  for (int part = 0; part < 2; ++part) {
    const auto& x = part == 0 ? k : v;
    const auto& got = part == 0 ? rk : rv;
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t t0 = 0; t0 < sealed; t0 += T) {
        // The window rounds to fp16 before sealing: quantize what the cache saw.
        std::vector<float> in(static_cast<size_t>(T * D));
        for (int64_t i = 0; i < T * D; ++i)
          in[static_cast<size_t>(i)] =
              f16_to_f32(f32_to_f16(x[static_cast<size_t>((bh * S + t0) * D + i)]));
        auto cs = cachegen::quantize_to_codes(in.data(), T, D, bits, group,
                                              part == 0 ? Axis::kChannel : vaxis);
        cachegen::dequant_codes(cs, want.data());
        ASSERT_EQ(0, std::memcmp(want.data(), got.data() + (bh * S + t0) * D, want.size() * 4))
            << GetParam() << " part " << part << " stream " << bh << " t0 " << t0;
      }
  }
}

TEST_P(CachegenVariant, ExportImportCloneTrim) {
  const auto k = smooth_kv(6), v = smooth_kv(7);
  ModelCache c = make(GetParam());
  ASSERT_TRUE(c.layer(0).append(view(k, 0, 61), view(v, 0, 61)).ok());
  testing::ChunkCollector sink;
  ASSERT_TRUE(c.layer(0).export_blocks(0, sink).ok());
  ASSERT_TRUE(c.layer(0).export_tail(sink).ok());
  ModelCache fresh = make(GetParam());
  Status st = fresh.layer(0).import_chunks(sink.chunks(), B, 61, c.layer(0).window_dtype());
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(snap(fresh.layer(0)) == snap(c.layer(0)));
  EXPECT_EQ(fresh.resident_bytes(), fresh.bytes().total());
  testing::ChunkCollector again;
  ASSERT_TRUE(fresh.layer(0).export_blocks(0, again).ok());
  ASSERT_TRUE(fresh.layer(0).export_tail(again).ok());
  EXPECT_EQ(again.store, sink.store);
  // Both continue identically (the imported cache codes new chunks with the same tables).
  ASSERT_TRUE(c.layer(0).append(view(k, 61, S - 61), view(v, 61, S - 61)).ok());
  ASSERT_TRUE(fresh.layer(0).append(view(k, 61, S - 61), view(v, 61, S - 61)).ok());
  EXPECT_TRUE(snap(fresh.layer(0)) == snap(c.layer(0)));

  // Clone: independent deep copy, same bytes.
  ModelCache copy = c.clone();
  EXPECT_TRUE(snap(copy.layer(0)) == snap(c.layer(0)));
  const Snap before = snap(c.layer(0));
  ASSERT_TRUE(copy.trim(S - 20).ok());
  ASSERT_TRUE(copy.layer(0).append(view(k, 20, S - 20), view(v, 20, S - 20)).ok());
  EXPECT_TRUE(snap(c.layer(0)) == before);
  EXPECT_EQ(copy.resident_bytes(), copy.bytes().total());
  c.reset();
  EXPECT_EQ(copy.resident_bytes(), copy.bytes().total());  // the copy does not share with c

  // Trim to nothing and rebuild: the same as a fresh cache (block 0 and its tables rebuilt).
  ModelCache t = make(GetParam()), ref = make(GetParam());
  ASSERT_TRUE(t.layer(0).append(view(k, 0, S), view(v, 0, S)).ok());
  ASSERT_TRUE(t.trim(S).ok());
  EXPECT_EQ(t.bytes().total(), 0u);
  EXPECT_EQ(t.resident_bytes(), 0u);
  ASSERT_TRUE(t.layer(0).append(view(k, 0, S), view(v, 0, S)).ok());
  ASSERT_TRUE(ref.layer(0).append(view(k, 0, S), view(v, 0, S)).ok());
  EXPECT_TRUE(snap(t.layer(0)) == snap(ref.layer(0)));
}

TEST_P(CachegenVariant, DamagedBlocksAreRejectedWithoutChange) {
  const auto k = smooth_kv(8), v = smooth_kv(9);
  ModelCache c = make(GetParam());
  ASSERT_TRUE(c.layer(0).append(view(k, 0, S), view(v, 0, S)).ok());
  testing::ChunkCollector sink;
  ASSERT_TRUE(c.layer(0).export_blocks(0, sink).ok());
  ASSERT_TRUE(c.layer(0).export_tail(sink).ok());
  ModelCache target = make(GetParam());
  ASSERT_TRUE(target.layer(0).append(view(k, 0, 10), view(v, 0, 10)).ok());
  const Snap before = snap(target.layer(0));
  const auto good = sink.chunks();
  const size_t n_block_chunks = good.size() - 3;
  std::mt19937 rng(10);
  int rejected = 0, accepted = 0;
  for (size_t i = 0; i < n_block_chunks; ++i) {
    for (int trial = 0; trial < 12; ++trial) {
      auto chunks = good;
      std::vector<uint8_t> bytes(good[i].data, good[i].data + good[i].size);
      if (bytes.empty()) continue;
      if (trial % 3 == 0) {
        bytes.resize(rng() % bytes.size());  // truncated
      } else {
        bytes[rng() % bytes.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));  // one bit flipped
      }
      chunks[i].data = bytes.data();
      chunks[i].size = bytes.size();
      Status st = target.layer(0).import_chunks(chunks, B, S, c.layer(0).window_dtype());
      if (st.ok()) {
        // A flip the format cannot detect (a parameter or a raw symbol): still a valid cache.
        ++accepted;
        EXPECT_EQ(target.resident_bytes(), target.bytes().total());
        ASSERT_TRUE(target.layer(0).import_chunks(good, B, S, c.layer(0).window_dtype()).ok());
        target.reset();
        ASSERT_TRUE(target.layer(0).append(view(k, 0, 10), view(v, 0, 10)).ok());
      } else {
        ++rejected;
        EXPECT_TRUE(snap(target.layer(0)) == before) << st.to_string();
      }
    }
  }
  EXPECT_GT(rejected, 0);
}

INSTANTIATE_TEST_SUITE_P(Variants, CachegenVariant, ::testing::ValuesIn(variant_specs()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           return "v" + std::to_string(p.index);
                         });

TEST(CachegenMethod, SpecRulesAndCanonicalForm) {
  EXPECT_FALSE(parse_spec("cachegen:group=32,chunk=48").ok());  // chunk not a multiple of group
  EXPECT_FALSE(parse_spec("cachegen:delta=sideways").ok());
  EXPECT_FALSE(parse_spec("cachegen:bits=9").ok());
  auto s = parse_spec("cachegen");
  ASSERT_TRUE(s.ok());
  auto again = parse_spec(s->to_string());
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again == *s);
}

std::map<std::string, std::string> stats_of(const LayerCache& l) {
  std::map<std::string, std::string> out;
  std::istringstream in(l.stats());
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

TEST(CachegenMethod, BuilderAppliesTheDepthSchedule) {
  ModelCache c = make("cachegen:bits=5,layer_groups=3,group=4,chunk=8", 6);
  const int want[6] = {5, 5, 4, 4, 3, 3};
  for (int l = 0; l < 6; ++l) {
    EXPECT_EQ(stats_of(c.layer(l))["bits"], std::to_string(want[l])) << l;
    EXPECT_EQ(c.layer(l).spec().get_int("bits"), 5);  // the spec keeps the base
  }
  // A per-layer override sets that layer's base; the schedule still applies to it.
  ModelCache o = make("cachegen:bits=4,layer_groups=2,group=4,chunk=8@3:bits=6", 4);
  EXPECT_EQ(stats_of(o.layer(0))["bits"], "4");
  EXPECT_EQ(stats_of(o.layer(2))["bits"], "3");
  EXPECT_EQ(stats_of(o.layer(3))["bits"], "5");
}

TEST(CachegenMethod, SharedTablesAreBilledOnceAndCodingIsResident) {
  const auto k = smooth_kv(11), v = smooth_kv(12);
  ModelCache c = make("cachegen:bits=4,group=4,chunk=16,residual=0,tables=shared,delta=auto");
  ASSERT_TRUE(c.layer(0).append(view(k, 0, S), view(v, 0, S)).ok());
  const auto st = stats_of(c.layer(0));
  const uint64_t shared =
      std::stoull(st.at("key_shared_table_bytes")) + std::stoull(st.at("value_shared_table_bytes"));
  EXPECT_GT(shared, 0u);
  EXPECT_GT(std::stoull(st.at("key_streams_rans-shared")) +
                std::stoull(st.at("value_streams_rans-shared")),
            0u);
  // Accounting is by kind and complete.
  const CacheBytes b = c.bytes();
  const uint64_t meta =
      shared + std::stoull(st.at("key_header_bytes")) + std::stoull(st.at("value_header_bytes")) +
      std::stoull(st.at("key_inline_table_bytes")) +
      std::stoull(st.at("value_inline_table_bytes")) + std::stoull(st.at("key_index_bytes")) +
      std::stoull(st.at("value_index_bytes"));
  EXPECT_EQ(b.meta, meta);
  EXPECT_EQ(b.key_codes, std::stoull(st.at("key_payload_bytes")));
  EXPECT_EQ(c.resident_bytes(), b.total());
  // Smooth data codes below fixed width: the coded form is what is held.
  const uint64_t sealed_elems = static_cast<uint64_t>(B * H * c.layer(0).sealed_tokens() * D);
  EXPECT_LT(b.key_codes + b.value_codes, 2 * packed_size(sealed_elems, 4));
}

}  // namespace
}  // namespace kvq
