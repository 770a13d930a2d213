// XQuant across layers: the contract tests run every method on a 1-layer model, where XQuant is a
// lone anchor. These tests cover reuse layers: a whole model appended the way an engine does it
// (layer by layer for every chunk), trim/reset/clone of whole models, export/import in layer
// order, billing of shared codes, errors, and the numerics of the reuse fit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kvq/cache.h"
#include "kvq/dtype.h"
#include "numerics/xquant_fit.h"
#include "test_util.h"

namespace kvq {
namespace {

constexpr int64_t B = 2, H = 2, HQ = 4, D = 16, S = 75;
constexpr int kLayers = 5;
const std::string kSpec = "xquant:group=4,residual=8";  // stride pairs: 0<-1, 2<-3, 4 alone

// Per-layer data [B, H, S, D]. Layer l = rho * layer (l - 1) + noise, so neighbours are related
// as strongly as `rho` says.
struct ModelData {
  std::vector<std::vector<float>> k, v;
  TensorView kv(const std::vector<float>& x, int64_t s0, int64_t n) const {
    return TensorView::bhsd(x.data(), DType::kF32, B, H, S, D).slice_tokens(s0, n);
  }
};

ModelData make_data(uint64_t seed, float rho, int layers = kLayers) {
  ModelData d;
  for (int l = 0; l < layers; ++l) {
    auto k = testing::random_kv(B, H, S, D, seed + 10 * static_cast<uint64_t>(l));
    auto v = testing::random_kv(B, H, S, D, seed + 10 * static_cast<uint64_t>(l) + 1);
    if (l > 0)
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = rho * d.k.back()[i] + std::sqrt(1 - rho * rho) * k[i];
        v[i] = rho * d.v.back()[i] + std::sqrt(1 - rho * rho) * v[i];
      }
    d.k.push_back(std::move(k));
    d.v.push_back(std::move(v));
  }
  return d;
}

ModelShape shape(int layers = kLayers) { return ModelShape::uniform(layers, H, D, HQ); }

ModelCache make(const std::string& spec, int layers = kLayers) {
  auto c = ModelCache::create(spec, shape(layers));
  if (!c.ok()) {
    ADD_FAILURE() << spec << ": " << c.status().to_string();
    std::abort();
  }
  return std::move(*c);
}

// Appends tokens [s0, s0 + n) to every layer in order, as one forward pass does.
Status forward(ModelCache& c, const ModelData& d, int64_t s0, int64_t n) {
  for (int l = 0; l < c.n_layers(); ++l)
    KVQ_RETURN_IF_ERROR(c.layer(l).append(d.kv(d.k[static_cast<size_t>(l)], s0, n),
                                          d.kv(d.v[static_cast<size_t>(l)], s0, n)));
  return ok_status();
}

struct LayerSnap {
  std::vector<float> k, v;
  uint64_t total = 0, resident = 0, key_codes = 0, value_codes = 0, params = 0, meta = 0;
  int64_t offset = 0;
  bool operator==(const LayerSnap& o) const {
    return k == o.k && v == o.v && total == o.total && resident == o.resident &&
           key_codes == o.key_codes && value_codes == o.value_codes && params == o.params &&
           meta == o.meta && offset == o.offset;
  }
};

std::vector<LayerSnap> snap(const ModelCache& c) {
  std::vector<LayerSnap> out;
  for (int l = 0; l < c.n_layers(); ++l) {
    LayerSnap s;
    testing::read_all(c.layer(l), s.k, s.v);
    const CacheBytes b = c.layer(l).bytes();
    s.total = b.total();
    s.key_codes = b.key_codes;
    s.value_codes = b.value_codes;
    s.params = b.params;
    s.meta = b.meta;
    s.resident = c.layer(l).resident_bytes();
    s.offset = c.layer(l).offset();
    out.push_back(std::move(s));
  }
  return out;
}

double rel_err(const std::vector<float>& a, const std::vector<float>& ref, int64_t tokens) {
  // Over the first `tokens` tokens of every (b, h) stream of [B, H, S, D] buffers.
  double e = 0, r = 0;
  for (int64_t bh = 0; bh < B * H; ++bh)
    for (int64_t i = 0; i < tokens * D; ++i) {
      const double x = ref[static_cast<size_t>(bh * S * D + i)],
                   y = a[static_cast<size_t>(bh * S * D + i)];
      e += (x - y) * (x - y);
      r += x * x;
    }
  return e / r;
}

std::string stat(const LayerCache& l, const std::string& key) {
  const std::string s = l.stats();
  const size_t at = s.find(key + "=");
  if (at == std::string::npos) return {};
  const size_t end = s.find('\n', at);
  return s.substr(at + key.size() + 1, end - at - key.size() - 1);
}

TEST(XQuant, RolesFollowStrideAndOverrides) {
  ModelCache c = make(kSpec);
  EXPECT_EQ(stat(c.layer(0), "role"), "anchor");
  EXPECT_EQ(stat(c.layer(1), "role"), "reuse");
  EXPECT_EQ(stat(c.layer(1), "anchor"), "0");
  EXPECT_EQ(stat(c.layer(0), "readers"), "1");
  EXPECT_EQ(stat(c.layer(4), "role"), "anchor");
  EXPECT_EQ(stat(c.layer(4), "readers"), "0");
  ModelCache three = make("xquant:layers=3,group=4,residual=8");
  EXPECT_EQ(stat(three.layer(0), "readers"), "2");
  EXPECT_EQ(stat(three.layer(2), "anchor"), "0");
  EXPECT_EQ(stat(three.layer(3), "role"), "anchor");
  ModelCache ex = make("xquant:pairing=explicit,group=4,residual=8@3:anchor=1@4:anchor=1");
  for (int l : {0, 1, 2}) EXPECT_EQ(stat(ex.layer(l), "role"), "anchor") << l;
  EXPECT_EQ(stat(ex.layer(3), "anchor"), "1");
  EXPECT_EQ(stat(ex.layer(1), "readers"), "2");
  // An override can make a stride reuse layer an anchor.
  ModelCache ov = make(kSpec + "@1:anchor=1");
  EXPECT_EQ(stat(ov.layer(1), "role"), "anchor");
  // layers=1: every layer is an anchor.
  ModelCache none = make("xquant:layers=1,group=4,residual=8");
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(stat(none.layer(l), "role"), "anchor");
}

TEST(XQuant, BuildErrorsAreClear) {
  auto expect_err = [](const std::string& spec, const std::string& needle,
                       ModelShape sh = shape()) {
    auto c = ModelCache::create(spec, sh);
    ASSERT_FALSE(c.ok()) << spec;
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().to_string();
  };
  expect_err("xquant@1:anchor=3", "must be an earlier layer");
  expect_err("xquant:layers=3@2:anchor=1", "itself a reuse layer");
  expect_err("xquant@1:k_bits=3", "k_bits=3 differs");
  expect_err("xquant@1:group=16", "group=16 differs");
  expect_err("xquant@1:residual=64", "below the anchor's");
  ModelShape mixed = shape(4);
  mixed.per_layer = {{2, 16, 4}, {2, 16, 4}, {2, 16, 4}, {1, 16, 2}};
  expect_err("xquant@3:anchor=2", "differ", mixed);
  // Stride pairing never pairs layers of different shapes: layer 3 becomes an anchor.
  auto c = ModelCache::create("xquant", mixed);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(stat(c->layer(3), "role"), "anchor");
  EXPECT_EQ(stat(c->layer(2), "readers"), "0");
}

TEST(XQuant, ChunkInvarianceOfAWholeModel) {
  const ModelData d = make_data(1, 0.6f);
  for (const std::string& spec :
       {kSpec, std::string("xquant:group=4,residual=8,res_bits=2,layers=3"),
        std::string("xquant:group=4,residual=5,fit=lsq,reuse_fit=minmax,eta=0.09@3:residual=9"),
        std::string("xquant:pairing=explicit,group=4,residual=8@2:anchor=0@4:anchor=3")}) {
    ModelCache whole = make(spec), layerwise = make(spec), tok = make(spec), chunks = make(spec);
    ASSERT_TRUE(forward(whole, d, 0, S).ok());
    // Each layer completely before the next (a valid order: anchors come first).
    for (int l = 0; l < kLayers; ++l)
      ASSERT_TRUE(layerwise.layer(l)
                      .append(d.kv(d.k[static_cast<size_t>(l)], 0, S),
                              d.kv(d.v[static_cast<size_t>(l)], 0, S))
                      .ok());
    for (int64_t s = 0; s < S; ++s) ASSERT_TRUE(forward(tok, d, s, 1).ok());
    std::mt19937 rng(3);
    for (int64_t s = 0; s < S;) {
      const int64_t n = std::min<int64_t>(S - s, 1 + static_cast<int64_t>(rng() % 11));
      ASSERT_TRUE(forward(chunks, d, s, n).ok());
      s += n;
    }
    const auto a = snap(whole);
    EXPECT_TRUE(a == snap(layerwise)) << spec;
    EXPECT_TRUE(a == snap(tok)) << spec;
    EXPECT_TRUE(a == snap(chunks)) << spec;
    EXPECT_EQ(whole.resident_bytes(), whole.bytes().total()) << spec;
  }
}

TEST(XQuant, ReuseBeforeAnchorIsAnErrorNotACrash) {
  const ModelData d = make_data(2, 0.5f);
  ModelCache c = make(kSpec);
  // Within the window a reuse layer may run ahead: nothing is sealed yet.
  ASSERT_TRUE(c.layer(1).append(d.kv(d.k[1], 0, 10), d.kv(d.v[1], 0, 10)).ok());
  const auto before = snap(c);
  // Token 12 would seal block 0 (12 >= 4 + 8), which layer 0 has not sealed.
  Status st = c.layer(1).append(d.kv(d.k[1], 10, 5), d.kv(d.v[1], 10, 5));
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("append to the anchor layer first"), std::string::npos)
      << st.message();
  EXPECT_TRUE(snap(c) == before);
  ASSERT_TRUE(c.layer(0).append(d.kv(d.k[0], 0, 15), d.kv(d.v[0], 0, 15)).ok());
  EXPECT_TRUE(c.layer(1).append(d.kv(d.k[1], 10, 5), d.kv(d.v[1], 10, 5)).ok());
  // A different batch size than the anchor's is refused as well.
  ModelCache b = make(kSpec);
  ASSERT_TRUE(b.layer(0).append(d.kv(d.k[0], 0, 20), d.kv(d.v[0], 0, 20)).ok());
  std::vector<float> one = testing::random_kv(1, H, 20, D, 5);
  st = b.layer(1).append(TensorView::bhsd(one.data(), DType::kF32, 1, H, 20, D),
                         TensorView::bhsd(one.data(), DType::kF32, 1, H, 20, D));
  EXPECT_EQ(st.code(), ErrorCode::kShapeMismatch) << st.to_string();
  EXPECT_EQ(b.layer(1).offset(), 0);
}

// Accounted bytes follow the formula of docs/methods/xquant.md exactly.
TEST(XQuant, BillingOfSharedCodes) {
  const ModelData d = make_data(3, 0.5f);
  const int64_t G = 8, T = 64;  // 8 sealed blocks of 8 tokens, residual 0
  for (int r : {0, 1, 3}) {
    ModelCache c =
        make("xquant:group=8,residual=0,k_bits=2,v_bits=3,res_bits=" + std::to_string(r));
    ASSERT_TRUE(forward(c, d, 0, T).ok());
    const uint64_t streams = B * H, elems = static_cast<uint64_t>(T * D) * streams;
    const uint64_t pairs_k = streams * (T / G) * D, pairs_v = streams * T * ((D + G - 1) / G);
    for (int l = 0; l < kLayers; ++l) {
      const CacheBytes b = c.layer(l).bytes();
      EXPECT_EQ(b.residual, 0u);
      EXPECT_EQ(b.meta, 0u);
      EXPECT_EQ(c.layer(l).resident_bytes(), b.total());
      if (l % 2 == 0) {  // anchors: 0, 2, 4
        EXPECT_EQ(b.key_codes, elems * 2 / 8) << l;
        EXPECT_EQ(b.value_codes, elems * 3 / 8) << l;
        EXPECT_EQ(b.params, 4 * (pairs_k + pairs_v)) << l;
      } else {  // reuse layers bill their parameters (and residual), never the shared codes
        EXPECT_EQ(b.key_codes, elems * static_cast<uint64_t>(r) / 8) << l << " r=" << r;
        EXPECT_EQ(b.value_codes, elems * static_cast<uint64_t>(r) / 8) << l;
        EXPECT_EQ(b.params, 4 * (pairs_k + pairs_v) * (r ? 2 : 1)) << l;
      }
    }
    // Keys and values of every layer are represented and billed.
    const CacheBytes all = c.bytes();
    EXPECT_EQ(all.elements, 2 * elems * kLayers);
    EXPECT_EQ(c.resident_bytes(), all.total());
    // All-in bits: 3 anchors at (2 + 3 + 2*32/8) / 2 bits, 2 reuse layers at (2*32/8 + r-part) / 2.
    const double anchor_bits = (2.0 + 3.0 + 32.0 / G + 32.0 / G) / 2;
    const double reuse_bits = (32.0 / G + 32.0 / G + (r ? 2.0 * r + 32.0 / G + 32.0 / G : 0.0)) / 2;
    EXPECT_NEAR(all.bits_per_element(), (3 * anchor_bits + 2 * reuse_bits) / kLayers, 1e-12) << r;
  }
}

TEST(XQuant, OrphanedCodesStayBilledOnce) {
  const ModelData d = make_data(4, 0.5f);
  ModelCache c = make(kSpec);
  ASSERT_TRUE(forward(c, d, 0, 60).ok());
  const auto reuse_before = snap(c)[1];
  // Trim the anchor alone into its sealed blocks: layer 1 still reads the dropped codes.
  ASSERT_TRUE(c.layer(0).trim(30).ok());
  EXPECT_EQ(c.resident_bytes(), c.bytes().total());
  EXPECT_GT(c.layer(0).bytes().meta, 0u);
  EXPECT_EQ(std::stoull(stat(c.layer(0), "orphan_code_bytes")), c.layer(0).bytes().meta);
  EXPECT_TRUE(snap(c)[1] == reuse_before);
  // Reset the anchor alone: everything layer 1 holds is orphaned, still billed once.
  c.layer(0).reset();
  EXPECT_EQ(c.resident_bytes(), c.bytes().total());
  EXPECT_TRUE(snap(c)[1] == reuse_before);
  // Once the reader lets go, nothing is left.
  c.layer(1).reset();
  EXPECT_EQ(c.layer(0).bytes().total(), 0u);
  EXPECT_EQ(c.layer(0).resident_bytes(), 0u);
  // A reuse layer cloned on its own takes the billing of the codes it holds.
  ModelCache m = make(kSpec);
  ASSERT_TRUE(forward(m, d, 0, 40).ok());
  CloneMemo memo;
  auto lone = m.layer(1).clone(memo);
  EXPECT_EQ(lone->resident_bytes(), lone->bytes().total());
  EXPECT_GT(lone->bytes().meta, 0u);
  std::vector<float> k0, v0, k1, v1;
  testing::read_all(m.layer(1), k0, v0);
  testing::read_all(*lone, k1, v1);
  EXPECT_EQ(k0, k1);
  EXPECT_EQ(v0, v1);
}

TEST(XQuant, TrimOfAWholeModelKeepsGroupsConsistent) {
  const ModelData d = make_data(5, 0.7f);
  for (const std::string& spec :
       {kSpec, std::string("xquant:group=4,residual=8,res_bits=1,layers=3")}) {
    // Inside the window: exact rollback.
    ModelCache ref = make(spec), c = make(spec);
    ASSERT_TRUE(forward(ref, d, 0, 40).ok());
    ASSERT_TRUE(forward(c, d, 0, 40).ok());
    ASSERT_TRUE(forward(c, d, 40, 3).ok());
    ASSERT_TRUE(c.trim(3).ok());
    EXPECT_TRUE(snap(ref) == snap(c)) << spec;
    // Into sealed blocks (a block cut in two): every layer drops and reopens the same blocks.
    ASSERT_TRUE(c.trim(21).ok());
    EXPECT_EQ(c.offset(), 19);
    EXPECT_EQ(c.resident_bytes(), c.bytes().total());
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(c.layer(l).sealed_tokens(), 16) << l;  // 4 whole blocks; block 4 reopened
      EXPECT_EQ(c.layer(l).bytes().meta, 0u) << l;     // no orphans: reuse layers let go first
    }
    // Re-appending re-seals anchors first; reuse layers fit against the new codes, so an
    // export/import round trip (which checks the codes each reuse block was fit to) is exact.
    ASSERT_TRUE(forward(c, d, 19, S - 19).ok());
    EXPECT_EQ(c.resident_bytes(), c.bytes().total());
    std::vector<float> k, v;
    testing::read_all(c.layer(1), k, v);
    EXPECT_LT(rel_err(k, d.k[1], S), 0.5);
    ModelCache fresh = make(spec);
    ASSERT_TRUE(forward(fresh, d, 0, S).ok());
    // Blocks untouched by the trim are identical to a fresh model's.
    const auto a = snap(c), b = snap(fresh);
    for (int l = 0; l < kLayers; ++l)
      for (int64_t bh = 0; bh < B * H; ++bh)
        for (int64_t i = 0; i < 16 * D; ++i)
          ASSERT_EQ(a[static_cast<size_t>(l)].k[static_cast<size_t>(bh * S * D + i)],
                    b[static_cast<size_t>(l)].k[static_cast<size_t>(bh * S * D + i)])
              << spec << " layer " << l;
    c.reset();
    EXPECT_EQ(c.bytes().total(), 0u);
    EXPECT_EQ(c.resident_bytes(), 0u);
    ASSERT_TRUE(forward(c, d, 0, S).ok());
    EXPECT_TRUE(snap(c) == snap(fresh)) << spec << ": nothing survives a reset";
  }
}

TEST(XQuant, CloneSharesCodesLikeTheOriginalAndNothingElse) {
  const ModelData d = make_data(6, 0.6f);
  ModelCache c = make("xquant:group=4,residual=8,layers=3,res_bits=1");
  ASSERT_TRUE(forward(c, d, 0, 50).ok());
  ModelCache copy = c.clone();
  const auto before = snap(c);
  EXPECT_TRUE(snap(copy) == before);
  EXPECT_EQ(copy.resident_bytes(), c.resident_bytes());
  // The copy's reuse layers read the copy's anchor codes: none of them is an orphan there.
  EXPECT_EQ(stat(copy.layer(0), "orphan_code_bytes"), "0");
  EXPECT_EQ(stat(copy.layer(0), "readers"), "2");
  // The copy moves on alone; resetting the original leaves the copy whole.
  ASSERT_TRUE(forward(copy, d, 50, S - 50).ok());
  EXPECT_TRUE(snap(c) == before);
  c.reset();
  EXPECT_EQ(c.resident_bytes(), 0u);
  EXPECT_EQ(copy.resident_bytes(), copy.bytes().total());
  ModelCache fresh = make("xquant:group=4,residual=8,layers=3,res_bits=1");
  ASSERT_TRUE(forward(fresh, d, 0, S).ok());
  EXPECT_TRUE(snap(copy) == snap(fresh));
}

TEST(XQuant, ModelsDoNotShare) {
  const ModelData d1 = make_data(7, 0.6f), d2 = make_data(8, 0.6f);
  ModelCache a = make(kSpec), b = make(kSpec), alone = make(kSpec);
  // Interleave two models' forward passes; each must equal the same model run alone.
  for (int64_t s = 0; s < S; s += 5) {
    ASSERT_TRUE(forward(a, d1, s, 5).ok());
    ASSERT_TRUE(forward(b, d2, s, 5).ok());
  }
  ASSERT_TRUE(forward(alone, d1, 0, S).ok());
  EXPECT_TRUE(snap(a) == snap(alone));
  // A reuse layer never finds another model's anchor.
  ModelCache empty = make(kSpec);
  EXPECT_FALSE(empty.layer(1).append(d1.kv(d1.k[1], 0, S), d1.kv(d1.v[1], 0, S)).ok());
}

TEST(XQuant, ExportImportInLayerOrder) {
  const ModelData d = make_data(9, 0.6f);
  const std::string spec = "xquant:group=4,residual=8,res_bits=2";
  ModelCache c = make(spec);
  ASSERT_TRUE(forward(c, d, 0, 57).ok());
  std::vector<testing::ChunkCollector> sinks(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    ASSERT_TRUE(c.layer(l).export_blocks(0, sinks[static_cast<size_t>(l)]).ok());
    ASSERT_TRUE(c.layer(l).export_tail(sinks[static_cast<size_t>(l)]).ok());
  }
  const DType wd = c.layer(0).window_dtype();
  // A reuse layer before its anchor: a clear error, nothing changed.
  ModelCache fresh = make(spec);
  Status st = fresh.layer(1).import_chunks(sinks[1].chunks(), B, 57, wd);
  EXPECT_EQ(st.code(), ErrorCode::kCorrupt);
  EXPECT_NE(st.message().find("import layers in order"), std::string::npos) << st.message();
  EXPECT_EQ(fresh.layer(1).offset(), 0);
  for (int l = 0; l < kLayers; ++l) {
    st = fresh.layer(l).import_chunks(sinks[static_cast<size_t>(l)].chunks(), B, 57, wd);
    ASSERT_TRUE(st.ok()) << l << ": " << st.to_string();
  }
  EXPECT_TRUE(snap(fresh) == snap(c));
  EXPECT_EQ(fresh.resident_bytes(), fresh.bytes().total());
  // Both continue identically.
  ASSERT_TRUE(forward(c, d, 57, S - 57).ok());
  ASSERT_TRUE(forward(fresh, d, 57, S - 57).ok());
  EXPECT_TRUE(snap(fresh) == snap(c));
  // Reuse blocks against other anchor codes are refused (the stored hash does not match).
  const ModelData other = make_data(10, 0.6f);
  ModelCache wrong = make(spec);
  ASSERT_TRUE(wrong.layer(0).append(other.kv(other.k[0], 0, 57), other.kv(other.v[0], 0, 57)).ok());
  st = wrong.layer(1).import_chunks(sinks[1].chunks(), B, 57, wd);
  EXPECT_EQ(st.code(), ErrorCode::kCorrupt) << st.to_string();
  EXPECT_NE(st.message().find("anchor codes"), std::string::npos) << st.message();
  EXPECT_EQ(wrong.layer(1).offset(), 0);
  // Importing a new anchor state while the old reuse layer still holds the old codes keeps
  // the books balanced (the old codes are billed until layer 1 is re-imported).
  ModelCache busy = make(spec);
  ASSERT_TRUE(forward(busy, other, 0, 40).ok());
  ASSERT_TRUE(busy.layer(0).import_chunks(sinks[0].chunks(), B, 57, wd).ok());
  EXPECT_EQ(busy.resident_bytes(), busy.bytes().total());
  ASSERT_TRUE(busy.layer(1).import_chunks(sinks[1].chunks(), B, 57, wd).ok());
  EXPECT_EQ(busy.layer(0).bytes().meta, 0u);
  EXPECT_EQ(busy.resident_bytes(), busy.bytes().total());
}

TEST(XQuant, ReuseQualityFollowsSimilarityAndResidualBits) {
  const int64_t sealed = 64;  // residual 8, group 8: tokens [0, 64) sealed
  auto reuse_err = [&](float rho, const std::string& extra) {
    const ModelData d = make_data(11, rho, 2);
    ModelCache c = make("xquant:group=8,residual=8" + extra, 2);
    EXPECT_TRUE(forward(c, d, 0, S).ok());
    std::vector<float> k, v;
    testing::read_all(c.layer(1), k, v);
    return (rel_err(k, d.k[1], sealed) + rel_err(v, d.v[1], sealed)) / 2;
  };
  // Strongly related neighbours reuse well; unrelated ones do not.
  EXPECT_LT(reuse_err(0.99f, ""), 0.05);
  EXPECT_GT(reuse_err(0.0f, ""), 4 * reuse_err(0.99f, ""));
  // Least squares is never worse than min/max on the same shared codes.
  for (float rho : {0.0f, 0.5f, 0.9f})
    EXPECT_LE(reuse_err(rho, ",reuse_fit=lsq"), reuse_err(rho, ",reuse_fit=minmax,eta=0") * 1.0001)
        << rho;
  // More residual bits, less error.
  double last = 1e9;
  for (int r = 0; r <= 4; ++r) {
    const double e = reuse_err(0.3f, ",res_bits=" + std::to_string(r));
    EXPECT_LT(e, last) << r;
    last = e;
  }
}

TEST(XQuantFit, LeastSquaresAndCalibration) {
  // Exact affine data are recovered up to fp16 rounding.
  const uint8_t c[6] = {0, 1, 2, 3, 1, 2};
  float x[6];
  for (int i = 0; i < 6; ++i) x[i] = 0.5f - 0.25f * c[i];
  QuantParams p = fit_params_to_codes(x, 1, c, 1, 6);
  EXPECT_EQ(f16_to_f32(p.scale), -0.25f);
  EXPECT_EQ(f16_to_f32(p.zero), 0.5f);
  // Constant codes: scale 0, zero = mean.
  const uint8_t z[3] = {2, 2, 2};
  const float y[3] = {1.0f, 2.0f, 3.0f};
  p = fit_params_to_codes(y, 1, z, 1, 3);
  EXPECT_EQ(f16_to_f32(p.scale), 0.0f);
  EXPECT_EQ(f16_to_f32(p.zero), 2.0f);
  // Data-free calibration: z' = z + eta*s*qmax, s' = (1 - 2 eta) s.
  QuantParams q{f32_to_f16(1.0f), f32_to_f16(-2.0f)};
  EXPECT_EQ(calibrate_eta(q, 2, 0.0f).scale, q.scale);
  const QuantParams cq = calibrate_eta(q, 1, 0.25f);
  EXPECT_EQ(f16_to_f32(cq.zero), -1.75f);
  EXPECT_EQ(f16_to_f32(cq.scale), 0.5f);
  // On min/max codes, the least-squares refit never raises the error of a group.
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int trial = 0; trial < 200; ++trial) {
    float g[32];
    uint8_t codes[32];
    for (auto& v : g) v = n(rng);
    for (int bits : {1, 2, 3}) {
      const QuantParams mm = fit_group(g, 32, 1, bits);
      quantize_group(g, 32, 1, mm, bits, codes, 1);
      const QuantParams ls = fit_params_to_codes(g, 1, codes, 1, 32);
      double e_mm = 0, e_ls = 0;
      for (int i = 0; i < 32; ++i) {
        const float a = f16_to_f32(mm.zero) + codes[i] * f16_to_f32(mm.scale);
        const float b = f16_to_f32(ls.zero) + codes[i] * f16_to_f32(ls.scale);
        e_mm += (a - g[i]) * (a - g[i]);
        e_ls += (b - g[i]) * (b - g[i]);
      }
      EXPECT_LE(e_ls, e_mm * 1.001 + 1e-6) << trial << " bits " << bits;
    }
  }
}

}  // namespace
}  // namespace kvq
