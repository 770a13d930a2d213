// Redis Cluster routing on a real 3-master cluster: kvq's CRC16 slots are the servers' own,
// keys spread over every master, and the client follows MOVED (a resharded slot) and ASK (a slot
// in migration) without losing a request.
#include <gtest/gtest.h>

#include <random>

#include "store/backends.h"
#include "store/store_util.h"

namespace kvq {
namespace {

using testing::RedisCluster;
using testing::RedisServer;

class Cluster : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    cluster_ = testing::shared_cluster(&why);
    if (!cluster_) GTEST_SKIP() << why;
    for (auto& n : cluster_->nodes) ASSERT_TRUE(n->command({"FLUSHALL"}).ok());
    auto s = open_store(cluster_->url());
    ASSERT_TRUE(s.ok());
    store_ = std::move(*s);
  }
  // Moves `slot` to another master (the way redis-cli --cluster reshard does, one slot): the
  // target imports, the source migrates, every key moves, and then — unless `finish` is false,
  // which leaves the slot mid-migration — every node is told the new owner.
  void move_slot(int slot, bool finish, RedisServer** to = nullptr) {
    std::string src_id;
    RedisServer* src = cluster_->owner(slot, &src_id);
    ASSERT_NE(src, nullptr);
    RedisServer* dst = nullptr;
    for (auto& n : cluster_->nodes)
      if (n.get() != src) dst = n.get();
    const std::string dst_id = cluster_->node_id(*dst), s = std::to_string(slot);
    ASSERT_EQ(*dst->command({"CLUSTER", "SETSLOT", s, "IMPORTING", src_id}), "OK");
    ASSERT_EQ(*src->command({"CLUSTER", "SETSLOT", s, "MIGRATING", dst_id}), "OK");
    auto keys = src->command({"CLUSTER", "GETKEYSINSLOT", s, "1000"});
    ASSERT_TRUE(keys.ok());
    size_t at = 0;
    while (at < keys->size()) {
      const size_t nl = keys->find('\n', at);
      const std::string k = keys->substr(at, nl == std::string::npos ? nl : nl - at);
      at = nl == std::string::npos ? keys->size() : nl + 1;
      if (k.empty()) continue;
      auto r = src->command({"MIGRATE", "127.0.0.1", std::to_string(dst->port()), k, "0", "5000"});
      ASSERT_TRUE(r.ok() && *r == "OK") << (r.ok() ? *r : r.status().message());
    }
    if (finish) {
      for (auto& n : cluster_->nodes)
        ASSERT_EQ(*n->command({"CLUSTER", "SETSLOT", s, "NODE", dst_id}), "OK");
    }
    if (to) *to = dst;
  }
  RedisCluster* cluster_ = nullptr;
  std::unique_ptr<StoreBackend> store_;
};

TEST(RedisSlots, Crc16OfTheSpec) {
  // The Redis Cluster specification's test vector, and its hash-tag rules.
  EXPECT_EQ(store::redis_key_slot("123456789"), 0x31C3 & 16383);
  EXPECT_EQ(store::redis_key_slot("{user1000}.following"), store::redis_key_slot("user1000"));
  EXPECT_EQ(store::redis_key_slot("foo{}{bar}"), store::redis_key_slot("foo{}{bar}"));
  EXPECT_NE(store::redis_key_slot("foo{}{bar}"), store::redis_key_slot("bar"));  // empty tag
  EXPECT_EQ(store::redis_key_slot("foo{{bar}}zap"), store::redis_key_slot("{bar"));
  EXPECT_EQ(store::redis_key_slot("foo{bar}{zap}"), store::redis_key_slot("bar"));
}

TEST_F(Cluster, SlotsAgreeWithTheServers) {
  std::mt19937 rng(5);
  const std::string alphabet = "abcxyz{}:019";
  for (int i = 0; i < 300; ++i) {
    std::string k;
    const int n = 1 + static_cast<int>(rng() % 24);
    for (int j = 0; j < n; ++j) k += alphabet[rng() % alphabet.size()];
    auto r = cluster_->nodes[0]->command({"CLUSTER", "KEYSLOT", k});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(std::to_string(store::redis_key_slot(k)), *r) << k;
  }
}

TEST_F(Cluster, KeysSpreadOverEveryMaster) {
  for (int i = 0; i < 200; ++i)
    ASSERT_TRUE(
        store_->put("kvq1:spread:" + std::to_string(i), std::vector<uint8_t>{1, 2, 3}).ok());
  for (auto& n : cluster_->nodes) {
    auto size = n->command({"DBSIZE"});
    ASSERT_TRUE(size.ok());
    EXPECT_GT(std::stoi(*size), 20) << n->address();  // about a third each
  }
  EXPECT_EQ(store_->list("kvq1:spread:")->size(), 200u);
  EXPECT_EQ(store_->stats("kvq1:spread:")->details.size(), 3u);  // one line per master
}

TEST_F(Cluster, FollowsMovedAfterAReshard) {
  const std::string k = "kvq1:moved:key";
  ASSERT_TRUE(
      store_->put(k, std::vector<uint8_t>{7, 7, 7}).ok());  // the client now has the slot map
  RedisServer* dst = nullptr;
  move_slot(store::redis_key_slot(k), /*finish=*/true, &dst);
  // The client's map still names the old owner, which answers MOVED.
  auto v = store_->get(k);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, (std::vector<uint8_t>{7, 7, 7}));
  ASSERT_TRUE(store_->put(k, std::vector<uint8_t>{8}).ok());
  EXPECT_EQ(*dst->command({"GET", k}), std::string(1, 8));  // written where the slot is now
}

TEST_F(Cluster, FollowsAskDuringAMigration) {
  const std::string k = "kvq1:asked:key";
  ASSERT_TRUE(store_->put(k, std::vector<uint8_t>{4, 2}).ok());
  move_slot(store::redis_key_slot(k), /*finish=*/false);
  // The source still owns the slot but no longer has the key: it answers ASK, and the client
  // asks the importing node (ASKING first) for this one command.
  auto v = store_->get(k);
  ASSERT_TRUE(v.ok()) << v.status().to_string();
  EXPECT_EQ(*v, (std::vector<uint8_t>{4, 2}));
  EXPECT_TRUE(*store_->exists(k));
  // Finish the migration so the cluster is whole again for the next test.
  std::string id;
  RedisServer* src = cluster_->owner(store::redis_key_slot(k), &id);
  ASSERT_NE(src, nullptr);
  std::string dst_id;
  for (auto& n : cluster_->nodes)
    if (n.get() != src) dst_id = cluster_->node_id(*n);
  for (auto& n : cluster_->nodes)
    ASSERT_EQ(*n->command(
                  {"CLUSTER", "SETSLOT", std::to_string(store::redis_key_slot(k)), "NODE", dst_id}),
              "OK");
  EXPECT_EQ(*store_->get(k), (std::vector<uint8_t>{4, 2}));
}

}  // namespace
}  // namespace kvq
