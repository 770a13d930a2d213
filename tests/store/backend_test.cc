// The store backends (include/kvq/store.h: StoreBackend) against a directory, a real
// redis-server and a real 3-master Redis Cluster: the same contract on each.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>

#include "store/backends.h"
#include "store/store_util.h"

namespace kvq {
namespace {

using testing::TestStore;

std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

class Backend : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto s = TestStore::open(GetParam());
    if (!s.ok()) GTEST_SKIP() << s.status().message();
    store_ = std::move(*s);
  }
  StoreBackend& b() { return store_->backend(); }
  std::unique_ptr<TestStore> store_;
};

TEST_P(Backend, PutGetExistsRemove) {
  const std::string k = "kvq1:test:one";
  EXPECT_EQ(b().get(k).status().code(), ErrorCode::kNotFound);
  EXPECT_FALSE(*b().exists(k));
  EXPECT_TRUE(b().remove(k).ok());                            // absent is fine
  std::vector<uint8_t> v = {0, 1, 2, 0, 255, '\r', '\n', 0};  // binary-safe
  ASSERT_TRUE(b().put(k, v).ok());
  EXPECT_TRUE(*b().exists(k));
  EXPECT_EQ(*b().get(k), v);
  ASSERT_TRUE(b().put(k, bytes_of("replaced")).ok());
  EXPECT_EQ(*b().get(k), bytes_of("replaced"));
  // A header read: the first bytes only, or all there is.
  EXPECT_EQ(*b().get(k, 3), bytes_of("rep"));
  EXPECT_EQ(*b().get(k, 100), bytes_of("replaced"));
  EXPECT_EQ(b().get("kvq1:test:absent", 3).status().code(), ErrorCode::kNotFound);
  ASSERT_TRUE(b().put(k, std::vector<uint8_t>()).ok());  // empty values are values
  EXPECT_TRUE(*b().exists(k));
  EXPECT_TRUE(b().get(k)->empty());
  ASSERT_TRUE(b().remove(k).ok());
  EXPECT_FALSE(*b().exists(k));
  EXPECT_EQ(b().get(k).status().code(), ErrorCode::kNotFound);
}

TEST_P(Backend, LargeValues) {
  std::vector<uint8_t> v(size_t{24} << 20);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  ASSERT_TRUE(b().put("kvq1:test:large", v).ok());
  auto got = b().get("kvq1:test:large");
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_TRUE(*got == v);
}

TEST_P(Backend, ListAndStatsSeeOnlyThePrefix) {
  std::set<std::string> want;
  uint64_t bytes = 0;
  for (int i = 0; i < 60; ++i) {
    const std::string k = "kvq1:ns" + std::to_string(i % 2) + ":" + std::to_string(1000 + i);
    const std::vector<uint8_t> v(static_cast<size_t>(i + 1), 'x');
    ASSERT_TRUE(b().put(k, v).ok());
    if (i % 2 == 0) {
      want.insert(k);
      bytes += v.size();
    }
  }
  ASSERT_TRUE(b().put("other:key", bytes_of("z")).ok());
  auto list = b().list("kvq1:ns0:");
  ASSERT_TRUE(list.ok()) << list.status().to_string();
  ASSERT_EQ(list->size(), want.size());
  auto it = want.begin();
  for (const StoreEntry& e : *list) {
    EXPECT_EQ(e.key, *it++);  // sorted, each once (a cluster lists every master's keys)
    EXPECT_EQ(e.size, std::stoul(e.key.substr(9)) - 1000 + 1);
  }
  auto stats = b().stats("kvq1:ns0:");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->objects, want.size());
  EXPECT_EQ(stats->bytes, bytes);
  EXPECT_FALSE(stats->details.empty());
  EXPECT_EQ(b().list("kvq1:")->size(), 60u);
  EXPECT_EQ(b().list("nothing*here")->size(), 0u);  // glob characters are literal
}

TEST_P(Backend, ReadersSeeWholeValuesWhileAWriterReplacesThem) {
  // A put is atomic: a reader sees the old value, the new one or none, never a mix or a part.
  const std::string k = "kvq1:test:atomic";
  const std::vector<uint8_t> a(size_t{1} << 20, 'a'), c(size_t{1} << 20, 'c');
  ASSERT_TRUE(b().put(k, a).ok());
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0}, bad{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t)
    readers.emplace_back([&] {
      auto r = open_store(store_->url());
      if (!r.ok()) {
        ++bad;
        return;
      }
      while (!stop) {
        auto v = (*r)->get(k);
        if (!v.ok() || !(*v == a || *v == c)) ++bad;
        ++reads;
      }
    });
  auto w = open_store(store_->url());
  ASSERT_TRUE(w.ok());
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(800);
  for (int i = 0; std::chrono::steady_clock::now() < end; ++i)
    ASSERT_TRUE((*w)->put(k, i % 2 ? a : c).ok());
  stop = true;
  for (auto& t : readers) t.join();
  EXPECT_GT(reads.load(), 10);
  EXPECT_EQ(bad.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(Backends, Backend, ::testing::Values("dir", "redis", "cluster"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(StoreUrl, ParsesAndRefuses) {
  struct Bad {
    const char* url;
    const char* message;
  };
  for (const Bad& bad : std::vector<Bad>{
           {"memcached://x", "unknown store URL"},
           {"redis://", "no host"},
           {"redis://127.0.0.1:99999", "the port"},
           {"redis://127.0.0.1:6379,127.0.0.1:6380", "redis-cluster://"},
           {"redis-cluster://127.0.0.1:7000/1", "no databases"},
           {"redis://127.0.0.1:6379?timeout=5", "unknown store URL option 'timeout'"},
           {"redis://127.0.0.1:6379?timeout_ms=0", "timeout_ms"},
           {"redis://127.0.0.1:6379/x", "database"},
           {"dir:", "needs a path"},
       }) {
    auto s = open_store(bad.url);
    ASSERT_FALSE(s.ok()) << bad.url;
    EXPECT_NE(s.status().message().find(bad.message), std::string::npos)
        << bad.url << ": " << s.status().message();
  }
  EXPECT_EQ((*open_store("redis://localhost"))->url(), "redis://localhost:6379");
  EXPECT_EQ((*open_store("redis://10.0.0.1:7000/3?timeout_ms=50"))->url(),
            "redis://10.0.0.1:7000/3");
  EXPECT_EQ((*open_store("redis-cluster://a:1,b:2"))->url(), "redis-cluster://a:1,b:2");
}

TEST(StoreUrl, AnUnreachableServerIsAnIoErrorNotAHang) {
  // Nothing listens on port 1; opening is lazy and every call reports the refusal at once.
  auto s = open_store("redis://127.0.0.1:1?connect_timeout_ms=500");
  ASSERT_TRUE(s.ok());
  const auto t0 = std::chrono::steady_clock::now();
  auto g = (*s)->get("kvq1:x");
  EXPECT_EQ(g.status().code(), ErrorCode::kIo);
  EXPECT_NE(g.status().message().find("cannot connect"), std::string::npos) << g.status().message();
  EXPECT_EQ((*s)->put("kvq1:x", bytes_of("v")).code(), ErrorCode::kIo);
  EXPECT_EQ((*s)->list("kvq1:").status().code(), ErrorCode::kIo);
  auto c = open_store("redis-cluster://127.0.0.1:1,127.0.0.1:2?connect_timeout_ms=500");
  EXPECT_EQ((*c)->exists("kvq1:x").status().code(), ErrorCode::kIo);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
}

TEST(DirStore, KeysAreFileNamesAndTemporaryFilesAreSkipped) {
  auto store = TestStore::open("dir");
  ASSERT_TRUE(store.ok());
  StoreBackend& b = (*store)->backend();
  for (const char* bad : {"", "../escape", ".hidden", "a/b", "a b", "x.tmp.123456"})
    EXPECT_EQ(b.put(bad, bytes_of("v")).code(), ErrorCode::kInvalidArgument) << bad;
  ASSERT_TRUE(b.put("kvq1:ok", bytes_of("v")).ok());
  const std::string dir = (*store)->url().substr(4);
  // What an interrupted put leaves behind (core/file_io.h names it <key>.tmp.XXXXXX).
  FILE* f = std::fopen((dir + "/kvq1:partial.tmp.Ab12Cd").c_str(), "wb");
  std::fputs("half", f);
  std::fclose(f);
  auto list = b.list("kvq1:");
  ASSERT_EQ(list->size(), 1u);
  EXPECT_EQ((*list)[0].key, "kvq1:ok");
  EXPECT_FALSE(store::valid_dir_key(std::string(201, 'a')));
}

}  // namespace
}  // namespace kvq
