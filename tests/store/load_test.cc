// A bounded load test on loopback: many clients, each with its own connection, put objects of
// chunk-like sizes and get back their own and each other's, against a real redis-server and a
// real 3-master cluster. Every value read must be the one written under its key (the bytes are
// a function of the key); counts and time are bounded; throughput is printed.
//   KVQ_LOAD_CLIENTS (default 8), KVQ_LOAD_SECONDS (default 3) scale it for a measurement.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "store/store_util.h"

namespace kvq {
namespace {

int env_int(const char* name, int fallback) {
  const char* e = std::getenv(name);
  return e && *e ? std::atoi(e) : fallback;
}

// The value stored under `key`: 4 KiB to 256 KiB of bytes that only this key produces.
std::vector<uint8_t> value_for(const std::string& key) {
  const uint64_t seed = XXH64(key.data(), key.size(), 0);
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v((4u << 10) + static_cast<size_t>(seed % (252u << 10)));
  for (size_t i = 0; i + 8 <= v.size(); i += 8) {
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, 8);
  }
  return v;
}

class Load : public ::testing::TestWithParam<std::string> {};

TEST_P(Load, ConcurrentClientsReadBackWhatWasWritten) {
  auto store = testing::TestStore::open(GetParam());
  if (!store.ok()) GTEST_SKIP() << store.status().message();
  const int clients = std::clamp(env_int("KVQ_LOAD_CLIENTS", 8), 1, 64);
  const double seconds = std::max(1, env_int("KVQ_LOAD_SECONDS", 3));
  // Bounds the server's memory too: at most 1000 puts (about 130 MB) per client.
  constexpr int kMaxOpsPerClient = 2000;
  std::atomic<uint64_t> puts{0}, gets{0}, bytes_out{0}, bytes_in{0}, wrong{0}, errors{0};
  std::atomic<int> written_by[64] = {};
  const auto t0 = std::chrono::steady_clock::now();
  const auto end = t0 + std::chrono::duration<double>(seconds);
  std::vector<std::thread> threads;
  for (int c = 0; c < clients; ++c)
    threads.emplace_back([&, c] {
      auto b = open_store((*store)->url());
      if (!b.ok()) {
        ++errors;
        return;
      }
      std::mt19937 rng(static_cast<unsigned>(c));
      int mine = 0;
      auto key = [](int client, int i) {
        return "kvq1:load:" + std::to_string(client) + ":" + std::to_string(i);
      };
      for (int op = 0; op < kMaxOpsPerClient && std::chrono::steady_clock::now() < end; ++op) {
        if (mine == 0 || rng() % 2 == 0) {  // put a new object
          const std::string k = key(c, mine);
          const auto v = value_for(k);
          if (!(*b)->put(k, v).ok()) {
            ++errors;
            continue;
          }
          ++puts;
          bytes_out += v.size();
          written_by[c % 64] = ++mine;
        } else {  // get one of anyone's, already written
          const int other = static_cast<int>(rng() % static_cast<unsigned>(clients));
          const int n = written_by[other % 64].load();
          if (n == 0) continue;
          const std::string k = key(other, static_cast<int>(rng() % static_cast<unsigned>(n)));
          auto v = (*b)->get(k);
          if (!v.ok()) {
            ++errors;
            continue;
          }
          ++gets;
          bytes_in += v->size();
          if (*v != value_for(k)) ++wrong;
        }
      }
    });
  for (auto& t : threads) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(errors.load(), 0u);
  EXPECT_EQ(wrong.load(), 0u) << "a value read back was not the one written";
  EXPECT_GT(puts.load(), 0u);
  EXPECT_GT(gets.load(), 0u);
  const double mb = static_cast<double>(bytes_out + bytes_in) / 1e6;
  std::printf(
      "load %s: %d clients, %.1f s: %llu puts, %llu gets (all verified), %.0f ops/s, "
      "%.0f MB/s (put %.0f MB/s, get %.0f MB/s)\n",
      GetParam().c_str(), clients, s, static_cast<unsigned long long>(puts.load()),
      static_cast<unsigned long long>(gets.load()), static_cast<double>(puts + gets) / s, mb / s,
      static_cast<double>(bytes_out) / 1e6 / s, static_cast<double>(bytes_in) / 1e6 / s);
  RecordProperty("ops_per_s", std::to_string(static_cast<double>(puts + gets) / s));
  RecordProperty("mb_per_s", std::to_string(mb / s));
}

INSTANTIATE_TEST_SUITE_P(Backends, Load, ::testing::Values("redis", "cluster"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace kvq
