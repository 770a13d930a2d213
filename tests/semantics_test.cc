// The attention semantics (kvq/cache.h), for every method and variant in the table, on a model
// of three layers: a query at position p sees exactly what token-by-token appending would hold
// at offset p + 1. Consequences checked here bit for bit: appending in one call, in random
// chunks or token by token gives the same stored bytes and the same attend() outputs for every
// query; the external-attention contract (read, read_exact, sealed_tokens_for_query) reproduces
// attend(); and the exact values an append keeps are workspace, released by the next append.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kvq/cache.h"
#include "numerics/q8_rows.h"
#include "test_util.h"

namespace kvq {
namespace {

constexpr int64_t B = 2, H = 2, HQ = 4, D = 32, S = 61, L = 3;

struct Data {
  // Per layer [B, H, S, D] keys and values and [B, HQ, S, D] queries.
  std::vector<std::vector<float>> k, v, q;
};

Data make_data(uint64_t seed) {
  Data d;
  for (int l = 0; l < L; ++l) {
    d.k.push_back(testing::random_kv(B, H, S, D, seed + 10 * l));
    d.v.push_back(testing::random_kv(B, H, S, D, seed + 10 * l + 1));
    d.q.push_back(testing::random_kv(B, HQ, S, D, seed + 10 * l + 2, 0.3f));
  }
  return d;
}

TensorView view(const std::vector<float>& x, int64_t heads, int64_t s0, int64_t n) {
  return TensorView::bhsd(x.data(), DType::kF32, B, heads, S, D).slice_tokens(s0, n);
}

ModelCache make(const std::string& spec) {
  auto c = ModelCache::create(
      spec, ModelShape::uniform(L, H, D, HQ, RopeShape{RopeShape::Mode::kAdjacent, 10000.0, 1.0}));
  if (!c.ok()) {
    ADD_FAILURE() << spec << ": " << c.status().to_string();
    std::abort();
  }
  return std::move(*c);
}

// Outputs of every query, [L][B, HQ, S, D], filled as the queries arrive.
using Outputs = std::vector<std::vector<float>>;

// Appends tokens [s0, s0 + n) to every layer (in order: XQuant reuse layers read their anchor)
// and attends the chunk's queries, storing their outputs.
void step(ModelCache& c, const Data& d, int64_t s0, int64_t n, Outputs& out) {
  for (int l = 0; l < L; ++l) {
    const TensorView q = view(d.q[static_cast<size_t>(l)], HQ, s0, n);
    const Status st = c.layer(l).append(view(d.k[static_cast<size_t>(l)], H, s0, n),
                                        view(d.v[static_cast<size_t>(l)], H, s0, n), &q);
    ASSERT_TRUE(st.ok()) << st.to_string();
    std::vector<float> o(static_cast<size_t>(B * HQ * n * D));
    ASSERT_TRUE(
        c.layer(l).attend(q, 0.25f, MutTensorView::bhsd(o.data(), DType::kF32, B, HQ, n, D)).ok());
    auto& dst = out[static_cast<size_t>(l)];
    for (int64_t bh = 0; bh < B * HQ; ++bh)
      std::memcpy(&dst[static_cast<size_t>((bh * S + s0) * D)], &o[static_cast<size_t>(bh * n * D)],
                  static_cast<size_t>(n * D) * 4);
  }
}

std::vector<std::vector<uint8_t>> exported(const LayerCache& c) {
  testing::ChunkCollector sink;
  EXPECT_TRUE(c.export_blocks(0, sink).ok());
  EXPECT_TRUE(c.export_tail(sink).ok());
  return sink.store;
}

class Semantics : public ::testing::TestWithParam<std::string> {};

TEST_P(Semantics, OutputsAndBytesDoNotDependOnChunking) {
  const Data d = make_data(21);
  const Outputs zero(L, std::vector<float>(static_cast<size_t>(B * HQ * S * D), 0.0f));
  ModelCache whole = make(GetParam()), chunks = make(GetParam()), tokens = make(GetParam());
  Outputs o_whole = zero, o_chunks = zero, o_tokens = zero;
  step(whole, d, 0, S, o_whole);
  std::mt19937 rng(7);
  for (int64_t s = 0; s < S;) {
    const int64_t n = std::min<int64_t>(S - s, 1 + static_cast<int64_t>(rng() % 17));
    step(chunks, d, s, n, o_chunks);
    s += n;
  }
  for (int64_t s = 0; s < S; ++s) step(tokens, d, s, 1, o_tokens);
  for (int l = 0; l < L; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    // The test is worth something only if blocks sealed (more than one), except for a method
    // that never seals (fp16's blocks are longer than any cache).
    if (tokens.layer(l).block_tokens() <= S) {
      ASSERT_GT(tokens.layer(l).n_blocks(), 1) << GetParam();
    }
    EXPECT_TRUE(exported(whole.layer(l)) == exported(tokens.layer(l))) << GetParam();
    EXPECT_TRUE(exported(chunks.layer(l)) == exported(tokens.layer(l))) << GetParam();
    EXPECT_EQ(whole.layer(l).bytes().total(), tokens.layer(l).bytes().total());
    const auto& a = o_tokens[static_cast<size_t>(l)];
    EXPECT_EQ(0, std::memcmp(a.data(), o_whole[static_cast<size_t>(l)].data(), a.size() * 4))
        << GetParam();
    EXPECT_EQ(0, std::memcmp(a.data(), o_chunks[static_cast<size_t>(l)].data(), a.size() * 4))
        << GetParam();
  }
}

// attend() against the double-precision reference built on the external-attention contract
// (read + read_exact + sealed_tokens_for_query), after every chunk of an append sequence whose
// chunks cross seal points; and the boundary the contract reports is the one token-by-token
// appending reaches.
TEST_P(Semantics, ExternalAttentionContractReproducesAttend) {
  const Data d = make_data(22);
  ModelCache c = make(GetParam()), ref = make(GetParam());
  Outputs sink(L, std::vector<float>(static_cast<size_t>(B * HQ * S * D)));
  std::vector<int64_t> sealed_after(S + 1, 0);  // layer 0's sealed tokens at each offset
  for (int64_t s = 0; s < S; ++s) {
    step(ref, d, s, 1, sink);
    sealed_after[static_cast<size_t>(s + 1)] = ref.layer(0).sealed_tokens();
  }
  bool crossed = false;
  int64_t s = 0;
  for (const int64_t n : {5, 9, 13, 17, 17}) {
    const int64_t before = c.layer(0).sealed_tokens();
    step(c, d, s, n, sink);
    const LayerCache& lc = c.layer(0);
    crossed |= lc.sealed_tokens() > before && n > 1;
    EXPECT_EQ(lc.last_append_tokens(), n);
    // Exact values are kept from the window's start at the append, less the blocks its first
    // token sealed (no query of the append sees those exact).
    EXPECT_GE(lc.exact_begin(), before);
    EXPECT_LE(lc.exact_begin(), sealed_after[static_cast<size_t>(s + 1)]);
    for (int64_t p = s; p < s + n; ++p)
      EXPECT_EQ(lc.sealed_tokens_for_query(p), sealed_after[static_cast<size_t>(p + 1)])
          << GetParam() << " p=" << p;
    for (int l = 0; l < L; ++l) {
      const TensorView q = view(d.q[static_cast<size_t>(l)], HQ, s, n);
      std::vector<float> a(static_cast<size_t>(B * HQ * n * D)), r(a.size());
      ASSERT_TRUE(c.layer(l)
                      .attend(q, 0.25f, MutTensorView::bhsd(a.data(), DType::kF32, B, HQ, n, D))
                      .ok());
      ASSERT_TRUE(reference_attend(c.layer(l), q, 0.25f,
                                   MutTensorView::bhsd(r.data(), DType::kF32, B, HQ, n, D))
                      .ok());
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_NEAR(a[i], r[i], 2e-5f * (1 + std::fabs(r[i]))) << GetParam() << " at " << i;
    }
    s += n;
  }
  ASSERT_EQ(s, S);
  if (c.layer(0).block_tokens() <= S) {
    EXPECT_TRUE(crossed) << "no chunk sealed a block before its last token";
  }
}

TEST_P(Semantics, ExactValuesAreWorkspaceUntilTheNextAppend) {
  const Data d = make_data(23);
  ModelCache c = make(GetParam());
  Outputs sink(L, std::vector<float>(static_cast<size_t>(B * HQ * S * D)));
  step(c, d, 0, 40, sink);  // seals several blocks before its last token
  const LayerCache& lc = c.layer(0);
  if (lc.block_tokens() > S) GTEST_SKIP() << "a method that never seals";
  EXPECT_LT(lc.exact_begin(), lc.sealed_tokens());
  EXPECT_GT(lc.workspace_bytes(), 0u);
  EXPECT_EQ(c.resident_bytes(), c.bytes().total());  // state accounting is unaffected
  // Exact values below exact_begin() are gone; from it on they read back as the window stores
  // them (the input rounded to fp16; for q8 rows, that quantized to 8 bits).
  std::vector<float> k1(static_cast<size_t>(B * H * 1 * D)), v1(k1.size());
  auto kv1 = [&](std::vector<float>& x) {
    return MutTensorView::bhsd(x.data(), DType::kF32, B, H, 1, D);
  };
  if (lc.exact_begin() > 0) {
    EXPECT_EQ(lc.read_exact(lc.exact_begin() - 1, 1, kv1(k1), kv1(v1)).code(),
              ErrorCode::kOutOfRange);
  }
  const int64_t t = lc.exact_begin();
  ASSERT_TRUE(lc.read_exact(t, 1, kv1(k1), kv1(v1)).ok());
  for (int64_t bh = 0; bh < B * H; ++bh) {
    std::vector<float> want(static_cast<size_t>(D));
    for (int64_t x = 0; x < D; ++x)
      want[static_cast<size_t>(x)] =
          f16_to_f32(f32_to_f16(d.k[0][static_cast<size_t>((bh * S + t) * D + x)]));
    if (lc.window_format() == WindowFormat::kQ8) {
      std::vector<uint8_t> row(q8_row_bytes(D));
      quantize_q8_row(want.data(), D, row.data());
      dequantize_q8_row(row.data(), D, want.data());
    }
    for (int64_t x = 0; x < D; ++x)
      EXPECT_EQ(k1[static_cast<size_t>(bh * D + x)], want[static_cast<size_t>(x)]);
  }
  // The next append (one token) releases them; a single decode query needs none.
  step(c, d, 40, 1, sink);
  EXPECT_EQ(lc.workspace_bytes(), 0u);
  EXPECT_EQ(lc.exact_begin(), lc.sealed_tokens());
  // Queries older than the last append whose boundary moved since cannot be served.
  std::vector<float> o(static_cast<size_t>(B * HQ * 20 * D));
  const TensorView q = view(d.q[0], HQ, 21, 20);
  EXPECT_EQ(lc.attend(q, 0.25f, MutTensorView::bhsd(o.data(), DType::kF32, B, HQ, 20, D)).code(),
            ErrorCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(AllMethods, Semantics, ::testing::ValuesIn(testing::small_specs()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           std::string n = p.param.substr(0, p.param.find(':'));
                           return n + "_" + std::to_string(p.index);
                         });

}  // namespace
}  // namespace kvq
