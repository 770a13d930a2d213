// Helpers shared by the store tests: synthetic K/V for caches of every method, and the stores
// the tests run against (a directory, a real redis-server, a real Redis Cluster).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "kvq/store.h"
#include "store/redis_server.h"

namespace kvq::testing {

// A small model: 3 layers, batch 2, 2 KV heads and 4 query heads of 32 (every method in the
// table accepts it), with RoPE.
inline constexpr int64_t kB = 2, kH = 2, kHQ = 4, kD = 32, kS = 90;
inline constexpr int kLayers = 3;
ModelShape store_shape();
Result<ModelCache> make_cache(const std::string& spec);

// Per-layer K, V [B, H, S, D] and Q [B, HQ, S, D], fp32.
struct KvData {
  std::vector<std::vector<float>> k, v, q;
};
KvData make_kv(uint64_t seed);
// Appends tokens [s0, s0 + n) to every layer, with their queries.
Status append_tokens(ModelCache& c, const KvData& d, int64_t s0, int64_t n);
// The smallest multiple of every sealing layer's block length that is >= at_least.
int64_t aligned_chunk(const ModelCache& c, int64_t at_least);
// Token ids [B, S] row-major (only their hashes matter here).
std::vector<int32_t> token_ids(int64_t rows, int64_t n, uint64_t seed);
// serialize_cache() of a cache: everything it holds, byte for byte.
std::vector<uint8_t> cache_bytes(const ModelCache& c);

// A cache computed chunk by chunk (pieces of up to 5 tokens ending at every boundary, as the
// engine cuts them), each chunk exported; with `backend`, put there too.
struct Computed {
  int64_t chunk = 0;
  std::vector<int32_t> tokens;  // [kB, kS]
  std::vector<Hash128> keys;
  std::vector<std::vector<uint8_t>> bytes_at;  // [i]: serialize_cache at offset (i + 1) C
  std::vector<ChunkObjects> objects;           // [i]: chunk i's two objects
  StoreNamespace ns;
};
Computed compute_and_store(const std::string& spec, const KvData& d, StoreBackend* backend,
                           int64_t min_chunk = 16, uint64_t token_seed = 7);

// Looks up and fetches at most k chunks of r's prompt into a new cache (a lookup that fails is
// noted and reuses nothing, as a session does).
struct Fetched {
  ModelCache cache;
  int64_t chunks = 0;
  PrefixFetch report;
  std::string notes() const;
};
Fetched fetch(const std::string& spec, const Computed& r, StoreBackend& backend, int64_t k = 1000);

// The fetch reused exactly `want` chunks (0: none, the cache is empty), its cache is
// byte-identical to the computed one at that length, and a note mentions `note`.
void expect_reuse(const Fetched& f, const Computed& r, int64_t want, const std::string& note);
// The fetch reused some chunks k (possibly 0) and its cache is byte-identical to the computed
// one at k: the outcome every fault must end in. Returns k.
int64_t expect_exact_prefix(const Fetched& f, const Computed& r);

// A store for one test: "dir" (a fresh temporary directory), "redis" (a redis-server of the
// suite, flushed) or "cluster" (a 3-master Redis Cluster of the suite, flushed). Servers start
// on first use and stop at exit.
class TestStore {
 public:
  static Result<std::unique_ptr<TestStore>> open(const std::string& kind);
  ~TestStore();
  const std::string& url() const { return url_; }
  StoreBackend& backend() { return *backend_; }
  // The server of a "redis" store (null otherwise).
  RedisServer* server() const { return server_; }
  // Runs a command on every server node (FLUSHALL, CONFIG SET, ...).
  Status on_every_node(const std::vector<std::string>& args) const;

 private:
  std::string kind_, url_, dir_;
  RedisServer* server_ = nullptr;
  std::unique_ptr<StoreBackend> backend_;
};
// Shared servers for the whole test binary, or null with `why` set when redis-server is missing.
RedisServer* shared_redis(std::string* why);
RedisCluster* shared_cluster(std::string* why);

}  // namespace kvq::testing
