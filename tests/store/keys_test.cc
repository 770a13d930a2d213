// The key scheme (docs/store.md §2): canonical hashes, the namespace descriptor, chained chunk
// keys, and the chunk-size rule.
#include <gtest/gtest.h>

#include <numeric>

#include "kvq/store.h"

namespace kvq {
namespace {

ModelShape tiny_shape() { return ModelShape::uniform(2, 2, 8, 4); }

StoreNamespace sample_ns() {
  StoreNamespace ns;
  ns.model = hash128("model", 5);
  ns.model_spec = "kivi:k_bits=2,v_bits=2,group=32,residual=128";
  ns.batch = 1;
  ns.chunk_tokens = 4;
  ns.producer = "test/1";
  return ns;
}

TEST(StoreKeys, HashHexRoundTripsAndIsCanonical) {
  const Hash128 h = hash128("abc", 3);
  ASSERT_EQ(h.hex().size(), 32u);
  auto back = Hash128::from_hex(h.hex());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, h);
  uint8_t b[16];
  h.to_bytes(b);
  EXPECT_EQ(b[0], static_cast<uint8_t>(h.hi >> 56));  // big-endian, high half first
  EXPECT_EQ(b[15], static_cast<uint8_t>(h.lo));
  EXPECT_FALSE(Hash128::from_hex("xyz").ok());
  EXPECT_FALSE(Hash128::from_hex(std::string(32, 'G')).ok());
  // XXH3-128 of nothing (xxhash's own test vector): the scheme rests on the library's values.
  EXPECT_EQ(hash128("", 0).hex(), "99aa06d3014798d86001c324468d497f");
}

TEST(StoreKeys, DescriptorIsTheDocumentedText) {
  const StoreNamespace ns = sample_ns();
  EXPECT_EQ(ns.descriptor(), "kvq-store 1\nmodel " + ns.model.hex() +
                                 "\nspec kivi:k_bits=2,v_bits=2,group=32,residual=128\nbatch 1"
                                 "\nchunk 4\nproducer test/1\n");
  EXPECT_EQ(ns.id(), hash128(ns.descriptor().data(), ns.descriptor().size()));
}

TEST(StoreKeys, EveryNamespaceFieldChangesTheId) {
  const StoreNamespace base = sample_ns();
  std::vector<StoreNamespace> variants(5, base);
  variants[0].model = hash128("other", 5);
  variants[1].model_spec = "kivi:k_bits=4,v_bits=2,group=32,residual=128";
  variants[2].batch = 2;
  variants[3].chunk_tokens = 8;
  variants[4].producer = "test/2";
  for (const auto& v : variants) EXPECT_NE(v.id(), base.id()) << v.descriptor();
}

TEST(StoreKeys, KeysChainThroughThePrefix) {
  const StoreNamespace ns = sample_ns();
  std::vector<int32_t> t(18);
  std::iota(t.begin(), t.end(), 100);
  const auto keys = chunk_keys(ns, t);
  ASSERT_EQ(keys.size(), 4u);  // whole chunks only: 18 tokens hold four of 4
  // Changing a token of chunk 2 changes keys 2 and 3, not 0 and 1: a key names the whole prefix.
  auto u = t;
  u[9] = 7;
  const auto k2 = chunk_keys(ns, u);
  EXPECT_EQ(k2[0], keys[0]);
  EXPECT_EQ(k2[1], keys[1]);
  EXPECT_NE(k2[2], keys[2]);
  EXPECT_NE(k2[3], keys[3]);
  // The same chunk after another prefix has another key.
  auto w = t;
  w[0] = 1;
  EXPECT_NE(chunk_keys(ns, w)[3], keys[3]);
  // The tokens after the last whole chunk do not matter.
  auto x = t;
  x[17] = 5;
  EXPECT_EQ(chunk_keys(ns, x), keys);
  // Key 0 is XXH3-128(namespace id || u32 LE ids), as documented.
  std::vector<uint8_t> buf(16 + 16);
  ns.id().to_bytes(buf.data());
  for (int i = 0; i < 4; ++i)
    for (int b = 0; b < 4; ++b) buf[16 + 4 * i + b] = static_cast<uint8_t>(t[i] >> (8 * b));
  EXPECT_EQ(keys[0], hash128(buf.data(), buf.size()));
}

TEST(StoreKeys, GoldenKeysPinTheScheme) {
  // Any change to the descriptor, the chaining or the byte order changes these: stores written
  // by another kvq would silently stop matching (the values were checked against Python's
  // xxhash package, an independent XXH3-128 implementation).
  const StoreNamespace ns = sample_ns();
  std::vector<int32_t> t(8);
  std::iota(t.begin(), t.end(), 0);
  const auto keys = chunk_keys(ns, t);
  ASSERT_EQ(keys.size(), 2u);
  EXPECT_EQ(ns.id().hex(), "dfe460041856f42b76e3b135da435cdc");
  EXPECT_EQ(keys[0].hex(), "ef51a147413804bd4915617dea54c098");
  EXPECT_EQ(keys[1].hex(), "3f802a7db4fd9e5845c85be16fb2e0f7");
}

TEST(StoreKeys, BatchRowsAreHashedRowByRow) {
  StoreNamespace ns = sample_ns();
  ns.batch = 2;
  std::vector<int32_t> t(16);  // [2, 8]
  std::iota(t.begin(), t.end(), 0);
  const auto keys = chunk_keys(ns, t);
  ASSERT_EQ(keys.size(), 2u);
  auto u = t;
  u[12] = 99;  // row 1, chunk 1
  const auto k2 = chunk_keys(ns, u);
  EXPECT_EQ(k2[0], keys[0]);
  EXPECT_NE(k2[1], keys[1]);
}

TEST(StoreKeys, ObjectKeysNameNamespaceChunkAndKind) {
  const StoreNamespace ns = sample_ns();
  const Hash128 k = hash128("k", 1);
  EXPECT_EQ(store_object_key(ns, k, StoreObjectKind::kBlocks),
            "kvq1:" + ns.id().hex() + ":" + k.hex() + ":b");
  EXPECT_EQ(store_object_key(ns, k, StoreObjectKind::kTail),
            "kvq1:" + ns.id().hex() + ":" + k.hex() + ":t");
  EXPECT_EQ(store_key_prefix(), "kvq1:");
  EXPECT_EQ(store_key_prefix(&ns), "kvq1:" + ns.id().hex() + ":");
}

TEST(StoreKeys, ChunkSizeMustBeAMultipleOfEveryLayersBlocks) {
  const Hash128 m = hash128("m", 1);
  auto kivi = ModelCache::create("kivi:group=8@1:group=16", tiny_shape());
  ASSERT_TRUE(kivi.ok());
  EXPECT_TRUE(make_store_namespace(*kivi, m, 32, "p").ok());
  auto bad = make_store_namespace(*kivi, m, 24, "p");  // a multiple of 8, not of layer 1's 16
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("layer 1"), std::string::npos) << bad.status().message();
  auto ns = make_store_namespace(*kivi, m, 32, "p");
  EXPECT_EQ(ns->model_spec, kivi->model_spec().to_string());
  EXPECT_NE(ns->model_spec.find("@1:group=16"), std::string::npos);  // overrides are namespaced
  // fp16 never seals a block: any chunk size is aligned.
  auto fp16 = ModelCache::create("fp16", tiny_shape());
  EXPECT_TRUE(make_store_namespace(*fp16, m, 7, "p").ok());
  EXPECT_FALSE(make_store_namespace(*fp16, m, 0, "p").ok());
  EXPECT_FALSE(make_store_namespace(*fp16, m, 8, "p", 0).ok());
  EXPECT_FALSE(make_store_namespace(*fp16, m, 8, "bad\nproducer").ok());
}

TEST(StoreKeys, FingerprintHashesSizeThenBytesOfEachFile) {
  const std::string a = ::testing::TempDir() + "/kvq_fp_a", b = ::testing::TempDir() + "/kvq_fp_b";
  FILE* f = std::fopen(a.c_str(), "wb");
  std::fputs("hello", f);
  std::fclose(f);
  f = std::fopen(b.c_str(), "wb");
  std::fputs("world!", f);
  std::fclose(f);
  auto fa = fingerprint_files({a}), fab = fingerprint_files({a, b});
  ASSERT_TRUE(fa.ok() && fab.ok());
  uint8_t buf[8 + 5] = {5, 0, 0, 0, 0, 0, 0, 0, 'h', 'e', 'l', 'l', 'o'};
  EXPECT_EQ(*fa, hash128(buf, sizeof buf));
  EXPECT_NE(*fa, *fab);
  EXPECT_NE(*fab, *fingerprint_files({b, a}));
  EXPECT_FALSE(fingerprint_files({"/nonexistent/model.gguf"}).ok());
  EXPECT_FALSE(fingerprint_files({}).ok());
}

}  // namespace
}  // namespace kvq
