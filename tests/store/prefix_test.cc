// Prefix chunks through a store, every method in the table: the cache a fetch of k chunks
// builds is byte-identical to the cache that computed those tokens, and both continue
// identically (bytes and attention outputs). Then damaged stores, on every backend: a bad or
// missing object is a shorter reuse (or none), never an error and never a wrong cache.
#include <gtest/gtest.h>

#include <cstring>

#include "store/objects.h"
#include "store/store_util.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::append_tokens;
using testing::cache_bytes;
using testing::compute_and_store;
using testing::Computed;
using testing::fetch;
using testing::kS;
using testing::KvData;
using testing::make_cache;
using testing::make_kv;
using testing::TestStore;

class EveryMethod : public ::testing::TestWithParam<std::string> {};

TEST_P(EveryMethod, FetchedPrefixIsTheComputedCache) {
  auto store = TestStore::open("dir");
  ASSERT_TRUE(store.ok());
  const KvData d = make_kv(11);
  const Computed r = compute_and_store(GetParam(), d, &(*store)->backend());
  const int64_t K = static_cast<int64_t>(r.bytes_at.size());
  ASSERT_GE(K, 2) << "the test needs at least two chunks";
  auto whole = make_cache(GetParam());
  ASSERT_TRUE(append_tokens(*whole, d, 0, kS).ok());
  const auto whole_bytes = cache_bytes(*whole);
  for (int64_t k = 1; k <= K; ++k) {
    SCOPED_TRACE("k = " + std::to_string(k));
    auto f = fetch(GetParam(), r, (*store)->backend(), k);
    ModelCache& c = f.cache;
    ASSERT_EQ(f.chunks, k) << f.notes();
    EXPECT_TRUE(f.report.notes.empty());
    EXPECT_EQ(c.offset(), k * r.chunk);
    EXPECT_EQ(cache_bytes(c), r.bytes_at[static_cast<size_t>(k - 1)]);
    // The rest computed on top of the fetched prefix: the same cache as computing it all, and
    // the same attention outputs for the last append's queries.
    ASSERT_TRUE(append_tokens(c, d, k * r.chunk, kS - k * r.chunk).ok());
    EXPECT_EQ(cache_bytes(c), whole_bytes);
    const int64_t n = std::min<int64_t>(kS - k * r.chunk, 3);
    if (n > 0) {
      // `whole` saw all tokens in one append: its last n queries are the ones `c` just made.
      std::vector<float> out_a(testing::kB * testing::kHQ * n * testing::kD), out_b(out_a.size());
      for (int l = 0; l < c.n_layers(); ++l) {
        const TensorView q = TensorView::bhsd(d.q[static_cast<size_t>(l)].data(), DType::kF32,
                                              testing::kB, testing::kHQ, kS, testing::kD)
                                 .slice_tokens(kS - n, n);
        auto oa = MutTensorView::bhsd(out_a.data(), DType::kF32, testing::kB, testing::kHQ, n,
                                      testing::kD);
        auto ob = MutTensorView::bhsd(out_b.data(), DType::kF32, testing::kB, testing::kHQ, n,
                                      testing::kD);
        ASSERT_TRUE(c.layer(l).attend(q, 0.17f, oa).ok());
        ASSERT_TRUE(whole->layer(l).attend(q, 0.17f, ob).ok());
        EXPECT_EQ(0, std::memcmp(out_a.data(), out_b.data(), out_a.size() * sizeof(float)))
            << "layer " << l;
      }
    }
  }
  // Asking for more chunks than the prompt has, or none, is not an error.
  auto none = fetch(GetParam(), r, (*store)->backend(), 0);
  EXPECT_EQ(none.chunks, 0);
  EXPECT_EQ(none.cache.offset(), 0);
}

INSTANTIATE_TEST_SUITE_P(AllMethods, EveryMethod, ::testing::ValuesIn(testing::small_specs()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           return p.param.substr(0, p.param.find(':')) + "_" +
                                  std::to_string(p.index);
                         });

// ---- damaged stores, every backend ----

class Damaged : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto s = TestStore::open(GetParam());
    if (!s.ok()) GTEST_SKIP() << s.status().message();
    store_ = std::move(*s);
  }
  StoreBackend& backend() { return store_->backend(); }
  std::string key(const Computed& r, int64_t i, StoreObjectKind kind) {
    return store_object_key(r.ns, r.keys[static_cast<size_t>(i)], kind);
  }
  std::vector<uint8_t> object(const std::string& k) {
    auto v = backend().get(k);
    EXPECT_TRUE(v.ok()) << k;
    return v.ok() ? *v : std::vector<uint8_t>();
  }
  // Fetching the longest prefix gives `want` chunks, byte-identical to the computed cache.
  void expect_reuse(const std::string& spec, const Computed& r, int64_t want,
                    const std::string& note) {
    testing::expect_reuse(fetch(spec, r, backend()), r, want, note);
  }
  std::unique_ptr<TestStore> store_;
};

const char* kSpec = "kivi:k_bits=2,v_bits=2,group=4,residual=8";

TEST_P(Damaged, AbsentMiddleBlocksShortenTheReuse) {
  const Computed r = compute_and_store(kSpec, make_kv(1), &backend());
  ASSERT_GE(r.keys.size(), 4u);
  ASSERT_TRUE(backend().remove(key(r, 2, StoreObjectKind::kBlocks)).ok());
  testing::expect_reuse(fetch(kSpec, r, backend()), r, 2, "blocks of chunk 2");
}

TEST_P(Damaged, AbsentTailFallsBackToAnEarlierOne) {
  const Computed r = compute_and_store(kSpec, make_kv(2), &backend());
  const int64_t K = static_cast<int64_t>(r.keys.size());
  ASSERT_TRUE(backend().remove(key(r, K - 1, StoreObjectKind::kTail)).ok());
  expect_reuse(kSpec, r, K - 1, "tail of chunk " + std::to_string(K - 1));
}

TEST_P(Damaged, EveryKindOfCorruptionIsAMiss) {
  const Computed r = compute_and_store(kSpec, make_kv(3), &backend());
  const std::string k1 = key(r, 1, StoreObjectKind::kBlocks);
  const std::vector<uint8_t> good = object(k1);
  ASSERT_GT(good.size(), 200u);
  // A flipped bit anywhere (header, descriptor, sections, checksum), a truncation, a padding,
  // garbage, an empty value: chunk 1 is a miss, the reuse stops at chunk 0.
  std::vector<std::pair<std::string, std::vector<uint8_t>>> bad;
  for (size_t at : {size_t{0}, size_t{13}, size_t{20}, size_t{40}, size_t{50}, size_t{60},
                    size_t{70}, good.size() / 2, good.size() - 9, good.size() - 1}) {
    auto b = good;
    b[at] ^= 0x10;
    bad.emplace_back("bit flip at " + std::to_string(at), b);
  }
  bad.emplace_back("truncated", std::vector<uint8_t>(good.begin(), good.end() - 100));
  auto padded = good;
  padded.push_back(0);
  bad.emplace_back("padded", padded);
  bad.emplace_back("garbage", std::vector<uint8_t>(500, 0x5a));
  bad.emplace_back("empty", std::vector<uint8_t>());
  for (const auto& [what, bytes] : bad) {
    SCOPED_TRACE(what);
    ASSERT_TRUE(backend().put(k1, bytes).ok());
    expect_reuse(kSpec, r, 1, "blocks of chunk 1");
  }
  ASSERT_TRUE(backend().put(k1, good).ok());
  expect_reuse(kSpec, r, static_cast<int64_t>(r.keys.size()), "");
}

TEST_P(Damaged, AnotherChunksObjectUnderTheKeyIsRefused) {
  const Computed r = compute_and_store(kSpec, make_kv(4), &backend());
  // Valid objects, checksums intact, under the wrong key: chunk 2's blocks as chunk 1's, and a
  // tail as blocks. The header names its chunk and prefix; the reader checks both.
  const auto b2 = object(key(r, 2, StoreObjectKind::kBlocks));
  ASSERT_TRUE(backend().put(key(r, 1, StoreObjectKind::kBlocks), b2).ok());
  expect_reuse(kSpec, r, 1, "is chunk 2 of another prefix");
  const auto t1 = object(key(r, 1, StoreObjectKind::kTail));
  ASSERT_TRUE(backend().put(key(r, 1, StoreObjectKind::kBlocks), t1).ok());
  expect_reuse(kSpec, r, 1, "holds a tail object");
}

TEST_P(Damaged, ObjectsOfAnotherMethodOrModelAreNeverSeen) {
  const Computed r = compute_and_store(kSpec, make_kv(5), &backend());
  // The same tokens under another method or model: other namespaces, so other keys.
  Computed other = r;
  other.ns.model_spec = "kivi:k_bits=4,v_bits=2,group=4,residual=8";
  other.keys = chunk_keys(other.ns, other.tokens);
  EXPECT_NE(other.keys[0], r.keys[0]);
  auto c = make_cache(other.ns.model_spec);
  PrefixFetch rep;
  EXPECT_EQ(*PrefixStore(&backend(), other.ns).lookup(other.keys, 100, *c, rep), 0);
  // A namespace that claims another method than the cache's is refused outright (a caller's
  // bug, not a miss).
  auto wrong = make_cache(kSpec);
  EXPECT_EQ(PrefixStore(&backend(), other.ns).fetch(other.keys, 1, *wrong, rep).status().code(),
            ErrorCode::kInvalidArgument);
}

TEST_P(Damaged, Fp16WindowsSpanEveryChunkTail) {
  // fp16 never seals: its window at kC is every token, so each tail object holds its own
  // chunk's rows and a reuse of k chunks reads all k tails. Losing tail j limits it to j.
  const Computed r = compute_and_store("fp16", make_kv(6), &backend());
  ASSERT_GE(r.keys.size(), 4u);
  ASSERT_TRUE(backend().remove(key(r, 1, StoreObjectKind::kTail)).ok());
  expect_reuse("fp16", r, 1, "tail of chunk 1");
}

INSTANTIATE_TEST_SUITE_P(Backends, Damaged, ::testing::Values("dir", "redis", "cluster"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

// ---- the object format itself ----

TEST(StoreObjects, EverySingleBitFlipAndTruncationIsRejected) {
  auto store = TestStore::open("dir");
  ASSERT_TRUE(store.ok());
  const Computed r = compute_and_store(kSpec, make_kv(8), &(*store)->backend());
  auto c = make_cache(kSpec);
  for (StoreObjectKind kind : {StoreObjectKind::kBlocks, StoreObjectKind::kTail}) {
    auto obj = (*store)->backend().get(store_object_key(r.ns, r.keys[0], kind));
    ASSERT_TRUE(obj.ok());
    const store::ObjectExpectation want{&r.ns, kind, r.keys[0], 0, &*c};
    ASSERT_TRUE(store::parse_store_object(*obj, want).ok());
    for (size_t i = 0; i < obj->size(); ++i)
      for (int bit = 0; bit < 8; bit += 3) {
        auto b = *obj;
        b[i] ^= static_cast<uint8_t>(1 << bit);
        ASSERT_FALSE(store::parse_store_object(b, want).ok()) << "byte " << i << " bit " << bit;
      }
    for (size_t n = 0; n < obj->size(); n += 7) {
      std::vector<uint8_t> b(obj->begin(), obj->begin() + static_cast<ptrdiff_t>(n));
      ASSERT_FALSE(store::parse_store_object(b, want).ok()) << "truncated to " << n;
    }
    auto info = inspect_store_object(obj->data(), 1024);  // a header read, as `kvq store ls` does
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->kind, kind);
    EXPECT_EQ(info->chunk, 0);
    EXPECT_EQ(info->size, obj->size());
    EXPECT_FALSE(info->checksum_ok);  // not the whole object
    EXPECT_EQ(info->descriptor, r.ns.descriptor());
  }
}

TEST(StoreObjects, NewerMajorVersionIsUnsupported) {
  auto store = TestStore::open("dir");
  ASSERT_TRUE(store.ok());
  const Computed r = compute_and_store(kSpec, make_kv(9), &(*store)->backend());
  auto obj = *(*store)->backend().get(store_object_key(r.ns, r.keys[0], StoreObjectKind::kTail));
  obj[8] = 2;
  auto info = inspect_store_object(obj.data(), obj.size());
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), ErrorCode::kUnsupported);
  EXPECT_EQ(inspect_store_object(obj.data(), 3).status().code(), ErrorCode::kFormat);
}

}  // namespace
}  // namespace kvq
