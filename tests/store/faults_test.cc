// Faults against real redis-server processes: a server killed in the middle of a reply or of a
// write, a connection cut, a refused connection, eviction under maxmemory, two writers storing
// the same prefix at once, a cluster node killed. Each must end in a bit-exact reuse, a shorter
// reuse or a recompute — never an error that loses the request, never a wrong cache.
#include <gtest/gtest.h>

#include <thread>

#include "store/backends.h"
#include "store/fault_proxy.h"
#include "store/store_util.h"

namespace kvq {
namespace {

using testing::compute_and_store;
using testing::Computed;
using testing::expect_exact_prefix;
using testing::FaultProxy;
using testing::fetch;
using testing::make_kv;
using testing::RedisCluster;
using testing::RedisServer;

const char* kSpec = "kivi:k_bits=2,v_bits=2,group=4,residual=8";
using Dir = FaultProxy::Direction;

// Bytes of a RESP bulk string of n bytes: "$<n>\r\n" <n bytes> "\r\n".
uint64_t bulk(uint64_t n) { return 1 + std::to_string(n).size() + 2 + n + 2; }
// Bytes of SET key value as the client sends it.
uint64_t set_command(const std::string& key, uint64_t value) {
  return 4 /* "*3\r\n" */ + bulk(3) + bulk(key.size()) + bulk(value);
}

// A whole request through a session, as kvq generate runs one: reuse, compute the rest (pieces
// ending at chunk boundaries), store the new chunks through a writer.
struct SessionRun {
  std::vector<uint8_t> cache;
  int64_t reused = 0;
  std::vector<std::string> notes;
  StoreWriter::Report written;
};
SessionRun run_session(const std::string& url, const Computed& r, const testing::KvData& d) {
  SessionRun out;
  auto backend = open_store(url);
  EXPECT_TRUE(backend.ok());
  auto cache = testing::make_cache(kSpec);
  PrefixStore ps(backend->get(), r.ns);
  StoreWriter writer(url, StoreOptions{500, 2000});
  PrefixSession s({{&*cache, &ps}}, r.tokens, &writer);
  int64_t p = out.reused = s.reuse(testing::kS - 1);
  while (p < testing::kS) {
    const int64_t e = s.piece_end(p, 5, testing::kS);
    EXPECT_TRUE(testing::append_tokens(*cache, d, p, e - p).ok());
    s.reached(p = e);
  }
  out.cache = testing::cache_bytes(*cache);
  out.notes = s.notes();
  out.written = writer.flush();
  return out;
}

// Every object of r, chunk by chunk, blocks then tail.
void put_all(StoreWriter& w, const Computed& r) {
  for (const auto& c : r.objects) {
    w.put(c.blocks_key, c.blocks);
    w.put(c.tail_key, c.tail);
  }
}

// Writes every object of r through a proxy to the server at `port` that, halfway into chunk
// 1's blocks (after chunk 0's two SETs and half of the next), runs `action` and cuts the
// connection.
StoreWriter::Report write_cut_halfway(int port, const Computed& r, std::function<void()> action) {
  const auto& o = r.objects;
  const uint64_t after = set_command(o[0].blocks_key, o[0].blocks.size()) +
                         set_command(o[0].tail_key, o[0].tail.size()) +
                         set_command(o[1].blocks_key, o[1].blocks.size()) / 2;
  auto proxy = FaultProxy::start(port);
  EXPECT_TRUE(proxy.ok());
  (*proxy)->arm(Dir::kToServer, after, std::move(action));
  StoreWriter w((*proxy)->url(), StoreOptions{500, 2000});
  put_all(w, r);
  const auto rep = w.flush();
  EXPECT_TRUE((*proxy)->fired());
  return rep;
}

std::vector<uint8_t> computed_whole(const testing::KvData& d) {
  auto c = testing::make_cache(kSpec);
  EXPECT_TRUE(testing::append_tokens(*c, d, 0, testing::kS).ok());
  return testing::cache_bytes(*c);
}

// A fetch of every chunk of r through a proxy to the server at `port` that, once `after` bytes
// of replies have reached the client after the lookup's, runs `action` and cuts the connection.
struct CutFetch {
  std::unique_ptr<FaultProxy> proxy;
  std::unique_ptr<StoreBackend> via;  // the client's store, through the proxy
  testing::Fetched fetched;
};
CutFetch fetch_with_cut(int port, const Computed& r, uint64_t after, std::function<void()> action) {
  auto proxy = FaultProxy::start(port);
  EXPECT_TRUE(proxy.ok());
  auto via = open_store((*proxy)->url());
  auto cache = testing::make_cache(kSpec);
  CutFetch c{std::move(*proxy), std::move(*via), {std::move(*cache), 0, {}}};
  PrefixStore ps(c.via.get(), r.ns);
  const int64_t K = static_cast<int64_t>(r.keys.size());
  auto found = ps.lookup(r.keys, K, c.fetched.cache, c.fetched.report);
  EXPECT_TRUE(found.ok() && *found == K);
  c.proxy->arm(Dir::kToClient, after, std::move(action));
  auto got = ps.fetch(r.keys, K, c.fetched.cache, c.fetched.report);
  EXPECT_TRUE(got.ok());  // a dead store is never an error
  c.fetched.chunks = got.ok() ? *got : -1;
  EXPECT_TRUE(c.proxy->fired());
  return c;
}

class Faults : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!RedisServer::available()) GTEST_SKIP() << "redis-server is not installed";
    auto s = RedisServer::start();
    ASSERT_TRUE(s.ok()) << s.status().to_string();
    server_ = std::move(*s);
    auto b = open_store(server_->url());
    ASSERT_TRUE(b.ok());
    direct_ = std::move(*b);
  }
  std::unique_ptr<RedisServer> server_;
  std::unique_ptr<StoreBackend> direct_;
};

TEST_F(Faults, ServerKilledInTheMiddleOfAReply) {
  const auto d = make_kv(1);
  const Computed r = compute_and_store(kSpec, d, direct_.get());
  const int64_t K = static_cast<int64_t>(r.keys.size());
  ASSERT_GE(K, 4);
  // The server dies once chunks 0 and 1 have arrived and half of chunk 2's blocks.
  const uint64_t after = bulk(r.objects[0].blocks.size()) + bulk(r.objects[1].blocks.size()) +
                         r.objects[2].blocks.size() / 2;
  CutFetch cut = fetch_with_cut(server_->port(), r, after, [&] { server_->kill(); });
  const testing::Fetched& f = cut.fetched;
  // Without the tails (the store died before them) nothing is reusable: a recompute.
  EXPECT_EQ(expect_exact_prefix(f, r), 0);
  EXPECT_NE(f.notes().find("blocks of chunk 2"), std::string::npos) << f.notes();
  // The request itself goes on and computes the same cache as without any store.
  const SessionRun s = run_session(cut.proxy->url(), r, d);
  EXPECT_EQ(s.reused, 0);
  EXPECT_TRUE(s.cache == computed_whole(d));
  EXPECT_GT(s.written.failed, 0u);
}

TEST_F(Faults, ConnectionCutInTheMiddleOfAReplyThenRecovered) {
  const auto d = make_kv(2);
  const Computed r = compute_and_store(kSpec, d, direct_.get());
  const int64_t K = static_cast<int64_t>(r.keys.size());
  // Cut the connection halfway through the last tail; the server stays up.
  uint64_t after = r.objects.back().tail.size() / 2;
  for (const auto& o : r.objects) after += bulk(o.blocks.size());
  CutFetch cut = fetch_with_cut(server_->port(), r, after, [] {});
  EXPECT_EQ(expect_exact_prefix(cut.fetched, r), 0);
  // The next request reconnects and reuses everything.
  auto again = fetch(kSpec, r, *cut.via);
  EXPECT_EQ(expect_exact_prefix(again, r), K) << again.notes();
}

TEST_F(Faults, ServerKilledInTheMiddleOfAWrite) {
  const auto d = make_kv(3);
  const Computed r = compute_and_store(kSpec, d, nullptr);
  const auto& o = r.objects;
  // The server dies halfway through receiving the second chunk's blocks; flush() returns: a
  // dead store does not hang the writer.
  const auto rep = write_cut_halfway(server_->port(), r, [&] { server_->kill(); });
  EXPECT_EQ(rep.objects, 2u);
  EXPECT_EQ(rep.failed, 2 * o.size() - 2);
  ASSERT_FALSE(rep.errors.empty());
  // A restarted (empty) server: whatever reached it is gone, and nothing half-written is seen.
  ASSERT_TRUE(server_->restart().ok());
  auto f = fetch(kSpec, r, *direct_);
  EXPECT_EQ(expect_exact_prefix(f, r), 0);
}

TEST_F(Faults, ConnectionCutInTheMiddleOfAWriteLeavesNoPartialObject) {
  const auto d = make_kv(4);
  const Computed r = compute_and_store(kSpec, d, nullptr);
  const auto& o = r.objects;
  const auto rep = write_cut_halfway(server_->port(), r, [] {});  // the server stays up
  EXPECT_EQ(rep.failed, 1u);  // the one cut; the writer reconnects for the next
  EXPECT_EQ(rep.objects, 2 * o.size() - 1);
  // The server never applied the half-received SET: chunk 1's blocks are absent, not partial.
  EXPECT_FALSE(*direct_->exists(o[1].blocks_key));
  testing::expect_reuse(fetch(kSpec, r, *direct_), r, 1, "blocks of chunk 1");
}

TEST_F(Faults, ConnectionRefused) {
  const auto d = make_kv(5);
  const Computed r = compute_and_store(kSpec, d, nullptr);
  const std::string url = server_->url();
  server_->kill();  // nothing listens on its port now
  const auto t0 = std::chrono::steady_clock::now();
  const SessionRun s = run_session(url, r, d);
  EXPECT_EQ(s.reused, 0);
  EXPECT_TRUE(s.cache == computed_whole(d));
  ASSERT_FALSE(s.notes.empty());
  EXPECT_NE(s.notes[0].find("cannot connect"), std::string::npos) << s.notes[0];
  EXPECT_EQ(s.written.objects, 0u);
  EXPECT_EQ(s.written.failed, 2 * r.objects.size());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 10.0);
}

TEST_F(Faults, EvictionUnderMaxmemory) {
  ASSERT_TRUE(server_->command({"CONFIG", "SET", "maxmemory", "3mb"}).ok());
  ASSERT_TRUE(server_->command({"CONFIG", "SET", "maxmemory-policy", "allkeys-lru"}).ok());
  const auto d = make_kv(6);
  std::vector<Computed> prompts;
  for (uint64_t p = 0; p < 60; ++p)
    prompts.push_back(compute_and_store(kSpec, d, direct_.get(), 16, 1000 + p));
  auto info = server_->command({"INFO", "stats"});
  ASSERT_TRUE(info.ok());
  const size_t at = info->find("evicted_keys:");
  ASSERT_NE(at, std::string::npos);
  EXPECT_GT(std::stoll(info->substr(at + 13)), 0) << "the test did not make Redis evict";
  int whole = 0, shorter = 0;
  for (const Computed& r : prompts) {
    auto f = fetch(kSpec, r, *direct_);
    const int64_t k = expect_exact_prefix(f, r);
    (k == static_cast<int64_t>(r.keys.size()) ? whole : shorter) += 1;
  }
  EXPECT_GT(whole, 0);
  EXPECT_GT(shorter, 0);
  RecordProperty("whole", whole);
  RecordProperty("shorter", shorter);
}

class TwoWriters : public ::testing::TestWithParam<std::string> {};

TEST_P(TwoWriters, StoringTheSamePrefixAtOnce) {
  auto store = testing::TestStore::open(GetParam());
  if (!store.ok()) GTEST_SKIP() << store.status().message();
  const auto d = make_kv(7);
  const Computed r = compute_and_store(kSpec, d, nullptr);
  // Two writers (two connections; for the directory, two renames racing) put every object of
  // the same prefix, in opposite orders, at the same time.
  StoreWriter a((*store)->url()), b((*store)->url());
  std::thread ta([&] {
    for (const auto& c : r.objects) {
      a.put(c.blocks_key, c.blocks);
      a.put(c.tail_key, c.tail);
    }
  });
  std::thread tb([&] {
    for (auto it = r.objects.rbegin(); it != r.objects.rend(); ++it) {
      b.put(it->tail_key, it->tail);
      b.put(it->blocks_key, it->blocks);
    }
  });
  ta.join();
  tb.join();
  EXPECT_EQ(a.flush().failed, 0u);
  EXPECT_EQ(b.flush().failed, 0u);
  auto f = fetch(kSpec, r, (*store)->backend());
  EXPECT_EQ(expect_exact_prefix(f, r), static_cast<int64_t>(r.keys.size())) << f.notes();
}

INSTANTIATE_TEST_SUITE_P(Backends, TwoWriters, ::testing::Values("dir", "redis", "cluster"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

TEST(ClusterFaults, AMasterKilled) {
  if (!RedisServer::available()) GTEST_SKIP() << "redis-server is not installed";
  auto cluster = RedisCluster::start(3);  // its own: this test breaks it
  ASSERT_TRUE(cluster.ok()) << cluster.status().to_string();
  auto b = open_store((*cluster)->url() + "?connect_timeout_ms=500&timeout_ms=2000");
  ASSERT_TRUE(b.ok());
  const auto d = make_kv(8);
  const Computed r = compute_and_store(kSpec, d, b->get());
  // The master holding chunk 1's blocks dies.
  RedisServer* victim = (*cluster)->owner(store::redis_key_slot(r.objects[1].blocks_key));
  ASSERT_NE(victim, nullptr);
  victim->kill();
  const auto t0 = std::chrono::steady_clock::now();
  auto f = fetch(kSpec, r, **b);
  const int64_t k = expect_exact_prefix(f, r);
  EXPECT_LE(k, 1);
  EXPECT_FALSE(f.report.notes.empty());
  // A whole request on the damaged cluster: the same cache as computing it all.
  const SessionRun s = run_session((*cluster)->url() + "?connect_timeout_ms=500", r, d);
  EXPECT_TRUE(s.cache == computed_whole(d));
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
}

}  // namespace
}  // namespace kvq
