// Prefix reuse through the engine, every method in the table: a generation whose prompt prefix
// is fetched from a store gives bit-identical logits (the prompt's last position and every
// decode step) and a byte-identical cache to one that computed everything; storing changes
// nothing either. On stories260K for every method its head_dim (8) admits, on SmolLM2 for the
// rest (llama.cpp's formats need head_dim % 32 == 0).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "model/llama.h"
#include "store/store_util.h"
#include "test_util.h"

namespace kvq {
namespace {

using model::LlamaModel;
using testing::cache_bytes;
using testing::TestStore;

struct Run {
  std::vector<float> logits;  // [1 + steps, vocab]: the prompt's last position, then each step
  std::vector<uint8_t> cache;
  int64_t reused = 0;
};

// Greedy generation as `kvq generate` runs it: the stored prefix, the rest in pieces of at most
// 7 tokens that end at chunk boundaries, then `steps` decode tokens. `store` null: no store.
Run generate(const LlamaModel& m, const std::string& spec, const std::vector<int32_t>& ids,
             TestStore* store, int64_t chunk, int steps) {
  Run r;
  auto cache = ModelCache::create(spec, m.cache_shape());
  EXPECT_TRUE(cache.ok()) << cache.status().to_string();
  ModelCache* cp = &*cache;
  const std::span<ModelCache* const> caches(&cp, 1);
  std::optional<PrefixStore> prefix;
  std::optional<StoreWriter> writer;
  std::optional<PrefixSession> session;
  if (store) {
    auto ns = make_store_namespace(*cache, hash128("model", 5), chunk, "engine-test/1");
    EXPECT_TRUE(ns.ok()) << ns.status().to_string();
    prefix.emplace(&store->backend(), *ns);
    writer.emplace(store->url());
    session.emplace(std::vector<PrefixSession::Binding>{{cp, &*prefix}}, ids, &*writer);
  }
  const int64_t n = static_cast<int64_t>(ids.size()), V = m.config().vocab_size;
  int64_t p = session ? session->reuse(n - 1) : 0;
  r.reused = p;
  std::vector<float> hidden, logits(static_cast<size_t>(V));
  int T = 0;
  while (p < n) {
    const int64_t e = session ? session->piece_end(p, 7, n) : std::min<int64_t>(p + 7, n);
    T = static_cast<int>(e - p);
    EXPECT_TRUE(m.forward(std::span<const int32_t>(ids.data() + p, static_cast<size_t>(T)), T,
                          caches, &hidden)
                    .ok());
    p = e;
    if (session) session->reached(p);
  }
  for (int s = 0; s <= steps; ++s) {
    m.logits(hidden.data() + int64_t{T - 1} * m.config().dim, 1, logits.data());
    r.logits.insert(r.logits.end(), logits.begin(), logits.end());
    if (s == steps) break;
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    T = 1;
    EXPECT_TRUE(m.forward(std::span<const int32_t>(&next, 1), 1, caches, &hidden).ok());
  }
  r.cache = cache_bytes(*cache);
  if (writer) {
    EXPECT_EQ(writer->flush().failed, 0u);
  }
  return r;
}

// Computes and stores the whole prompt, then for prompts cut to end just past each chunk
// boundary (so the reuse ends at every boundary the store holds, and imports every tail's
// state): computing, storing and reusing agree to the bit. `max_cuts` bounds the cuts tried.
void check_reuse(const LlamaModel& m, const std::string& spec, const std::vector<int32_t>& ids,
                 int max_cuts) {
  SCOPED_TRACE(spec);
  auto store = TestStore::open("dir");
  ASSERT_TRUE(store.ok());
  auto probe = ModelCache::create(spec, m.cache_shape());
  ASSERT_TRUE(probe.ok()) << probe.status().to_string();
  const int64_t chunk = testing::aligned_chunk(*probe, 16);
  const int64_t n = static_cast<int64_t>(ids.size()), K = (n - 1) / chunk;
  ASSERT_GE(K, 1);
  const Run plain = generate(m, spec, ids, nullptr, chunk, 4);
  const Run first = generate(m, spec, ids, store->get(), chunk, 4);
  EXPECT_EQ(first.reused, 0);
  EXPECT_EQ(first.logits, plain.logits) << "storing changed the logits";
  EXPECT_TRUE(first.cache == plain.cache) << "storing changed the cache";
  for (int64_t k = std::max<int64_t>(1, K - max_cuts + 1); k <= K; ++k) {
    SCOPED_TRACE("reusing " + std::to_string(k) + " chunks");
    const int64_t cut = std::min(n, k * chunk + 1 + k % 3);
    const std::vector<int32_t> part(ids.begin(), ids.begin() + cut);
    const Run want = cut == n ? plain : generate(m, spec, part, nullptr, chunk, 4);
    const Run got = generate(m, spec, part, store->get(), chunk, 4);
    EXPECT_EQ(got.reused, k * chunk);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    EXPECT_EQ(
        0, std::memcmp(got.logits.data(), want.logits.data(), want.logits.size() * sizeof(float)))
        << "reusing changed the logits";
    EXPECT_TRUE(got.cache == want.cache) << "reusing changed the cache";
  }
}

std::vector<int32_t> prompt_ids(const LlamaModel& m, const std::string& text) {
  std::vector<int32_t> ids;
  if (m.tokenizer()->add_bos() && m.tokenizer()->bos_id() >= 0)
    ids.push_back(m.tokenizer()->bos_id());
  for (int32_t id : m.tokenizer()->encode(text)) ids.push_back(id);
  return ids;
}

const char* kStory =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "sunshine. One day, she saw a big tree in the garden and wanted to climb it. Her mom said "
    "it was too high, so Lily found a ladder and asked her brother Tom to help her. Tom held "
    "the ladder while Lily climbed up to the first branch. From there she could see the whole "
    "street, the park and the river. She waved to her friend Sam, who was playing with his dog. "
    "Then a bird landed next to her and sang a happy song. Lily laughed and sang back.";

class StoriesReuse : public ::testing::TestWithParam<std::string> {
 protected:
  static void SetUpTestSuite() {
    const std::string dir = testing::shared_dir() + "/models/stories260K";
    if (!testing::file_exists(dir + "/stories260K.bin")) return;
    auto m = LlamaModel::load(dir + "/stories260K.bin", dir + "/tok512.bin");
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model_ = new LlamaModel(std::move(m).value());
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static LlamaModel* model_;
};
LlamaModel* StoriesReuse::model_ = nullptr;

// Whether a spec runs on stories260K's layers (head_dim 8).
bool fits_stories(const std::string& spec) {
  return ModelCache::create(spec, ModelShape::uniform(1, 4, 8, 8)).ok();
}

std::vector<std::string> stories_specs() {
  std::vector<std::string> out;
  for (const auto& s : testing::small_specs())
    if (fits_stories(s)) out.push_back(s);
  return out;
}

TEST_P(StoriesReuse, FetchedPrefixIsBitIdentical) {
  if (!model_) GTEST_SKIP() << "stories260K not found under " << testing::shared_dir();
  const auto ids = prompt_ids(*model_, kStory);
  ASSERT_GT(ids.size(), 120u);
  check_reuse(*model_, GetParam(), ids, 100);
}

INSTANTIATE_TEST_SUITE_P(AllMethods, StoriesReuse, ::testing::ValuesIn(stories_specs()),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           return p.param.substr(0, p.param.find(':')) + "_" +
                                  std::to_string(p.index);
                         });

TEST(SmolLM2Reuse, MethodsStoriesCannotRunAreBitIdentical) {
  const std::string path = testing::source_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!testing::file_exists(path)) GTEST_SKIP() << "no " << path << " (scripts/fetch_model.sh)";
  auto m = LlamaModel::load(path);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  const bool stories =
      testing::file_exists(testing::shared_dir() + "/models/stories260K/stories260K.bin");
  const auto ids = prompt_ids(*m,
                              "The State of the Union address is delivered by the President "
                              "to a joint session of Congress each year, and it describes the "
                              "condition of the nation and the agenda for the year ahead.");
  int ran = 0;
  for (const std::string& spec : testing::small_specs()) {
    // What the stories260K suite runs is not repeated here (one kivi as a control).
    if (stories && fits_stories(spec) && spec.rfind("kivi", 0) != 0) continue;
    check_reuse(*m, spec, ids, 2);
    ++ran;
  }
  EXPECT_GE(ran, 2);
  RecordProperty("specs_run", std::to_string(ran));
}

}  // namespace
}  // namespace kvq
