#include "store/store_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <random>

#include "kvq/container.h"
#include "test_util.h"

namespace kvq::testing {

ModelShape store_shape() {
  return ModelShape::uniform(kLayers, kH, kD, kHQ,
                             RopeShape{RopeShape::Mode::kAdjacent, 10000.0, 1.0});
}

Result<ModelCache> make_cache(const std::string& spec) {
  return ModelCache::create(spec, store_shape());
}

KvData make_kv(uint64_t seed) {
  KvData d;
  for (int l = 0; l < kLayers; ++l) {
    const uint64_t s = seed + 10 * static_cast<uint64_t>(l);
    d.k.push_back(random_kv(kB, kH, kS, kD, s));
    d.v.push_back(random_kv(kB, kH, kS, kD, s + 1));
    d.q.push_back(random_kv(kB, kHQ, kS, kD, s + 2, 0.3f));
  }
  return d;
}

Status append_tokens(ModelCache& c, const KvData& d, int64_t s0, int64_t n) {
  for (int l = 0; l < c.n_layers(); ++l) {
    const size_t L = static_cast<size_t>(l);
    const TensorView k =
        TensorView::bhsd(d.k[L].data(), DType::kF32, kB, kH, kS, kD).slice_tokens(s0, n);
    const TensorView v =
        TensorView::bhsd(d.v[L].data(), DType::kF32, kB, kH, kS, kD).slice_tokens(s0, n);
    const TensorView q =
        TensorView::bhsd(d.q[L].data(), DType::kF32, kB, kHQ, kS, kD).slice_tokens(s0, n);
    KVQ_RETURN_IF_ERROR(c.layer(l).append(k, v, &q));
  }
  return ok_status();
}

int64_t aligned_chunk(const ModelCache& c, int64_t at_least) {
  for (int64_t C = at_least;; ++C) {
    bool ok = true;
    for (int l = 0; l < c.n_layers(); ++l) {
      const int64_t T = c.layer(l).block_tokens();
      if (T <= (int64_t{1} << 31) && C % T != 0) ok = false;
    }
    if (ok) return C;
  }
}

std::vector<int32_t> token_ids(int64_t rows, int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(rows * n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % 50000);
  return t;
}

std::vector<uint8_t> cache_bytes(const ModelCache& c) {
  auto b = serialize_cache(c);
  if (!b.ok()) return {};
  return std::move(b).value();
}

Computed compute_and_store(const std::string& spec, const KvData& d, StoreBackend* backend,
                           int64_t min_chunk, uint64_t token_seed) {
  Computed r;
  auto c = make_cache(spec);
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  r.chunk = aligned_chunk(*c, min_chunk);
  auto ns = make_store_namespace(*c, hash128("test model", 10), r.chunk, "store-test/1", kB);
  EXPECT_TRUE(ns.ok()) << ns.status().to_string();
  r.ns = *ns;
  r.tokens = token_ids(kB, kS, token_seed);
  r.keys = chunk_keys(r.ns, r.tokens);
  PrefixStore store(backend, r.ns);
  for (int64_t p = 0; p < kS;) {
    const int64_t boundary = (p / r.chunk + 1) * r.chunk;
    const int64_t e = std::min({p + 5, boundary, kS});
    EXPECT_TRUE(append_tokens(*c, d, p, e - p).ok());
    p = e;
    if (p % r.chunk != 0) continue;
    auto o = store.export_chunk(*c, r.keys, p / r.chunk - 1);
    EXPECT_TRUE(o.ok()) << o.status().to_string();
    if (backend) {
      EXPECT_TRUE(backend->put(o->blocks_key, o->blocks).ok());
      EXPECT_TRUE(backend->put(o->tail_key, o->tail).ok());
    }
    r.objects.push_back(std::move(*o));
    r.bytes_at.push_back(cache_bytes(*c));
  }
  return r;
}

Fetched fetch(const std::string& spec, const Computed& r, StoreBackend& backend, int64_t k) {
  auto c = make_cache(spec);
  EXPECT_TRUE(c.ok());
  Fetched f{std::move(*c), 0, {}};
  PrefixStore store(&backend, r.ns);
  auto found = store.lookup(r.keys, k, f.cache, f.report);
  if (!found.ok()) {
    f.report.notes.push_back("lookup: " + found.status().message());
    return f;
  }
  auto got = store.fetch(r.keys, *found, f.cache, f.report);
  EXPECT_TRUE(got.ok()) << got.status().to_string();  // only a caller's bug is an error
  f.chunks = got.ok() ? *got : -1;
  return f;
}

std::string Fetched::notes() const {
  std::string s;
  for (const auto& n : report.notes) s += n + "\n";
  return s;
}

int64_t expect_exact_prefix(const Fetched& f, const Computed& r) {
  EXPECT_GE(f.chunks, 0);
  EXPECT_LE(f.chunks, static_cast<int64_t>(r.bytes_at.size()));
  EXPECT_EQ(f.cache.offset(), f.chunks * r.chunk);
  if (f.chunks > 0 && f.chunks <= static_cast<int64_t>(r.bytes_at.size())) {
    EXPECT_TRUE(cache_bytes(f.cache) == r.bytes_at[static_cast<size_t>(f.chunks - 1)])
        << "a wrong cache after reusing " << f.chunks << " chunks";
  }
  return f.chunks;
}

void expect_reuse(const Fetched& f, const Computed& r, int64_t want, const std::string& note) {
  EXPECT_EQ(f.chunks, want) << f.notes();
  expect_exact_prefix(f, r);
  EXPECT_NE(f.notes().find(note), std::string::npos) << "notes:\n" << f.notes();
}

namespace {

std::unique_ptr<RedisServer>& redis_slot() {
  static std::unique_ptr<RedisServer> s;
  return s;
}
std::unique_ptr<RedisCluster>& cluster_slot() {
  static std::unique_ptr<RedisCluster> c;
  return c;
}

}  // namespace

RedisServer* shared_redis(std::string* why) {
  if (!RedisServer::available()) {
    *why = "redis-server is not installed (scripts/setup.sh installs it)";
    return nullptr;
  }
  if (!redis_slot()) {
    auto s = RedisServer::start();
    if (!s.ok()) {
      *why = s.status().to_string();
      return nullptr;
    }
    redis_slot() = std::move(*s);
  }
  return redis_slot().get();
}

RedisCluster* shared_cluster(std::string* why) {
  if (!RedisServer::available()) {
    *why = "redis-server is not installed (scripts/setup.sh installs it)";
    return nullptr;
  }
  if (!cluster_slot()) {
    auto c = RedisCluster::start(3);
    if (!c.ok()) {
      *why = c.status().to_string();
      return nullptr;
    }
    cluster_slot() = std::move(*c);
  }
  return cluster_slot().get();
}

Result<std::unique_ptr<TestStore>> TestStore::open(const std::string& kind) {
  auto t = std::unique_ptr<TestStore>(new TestStore());
  t->kind_ = kind;
  std::string why;
  if (kind == "dir") {
    KVQ_ASSIGN_OR_RETURN(t->dir_, make_test_dir("store"));
    t->url_ = "dir:" + t->dir_;
  } else if (kind == "redis") {
    t->server_ = shared_redis(&why);
    if (!t->server_) return not_found(why);
    t->url_ = t->server_->url();
  } else if (kind == "cluster") {
    RedisCluster* c = shared_cluster(&why);
    if (!c) return not_found(why);
    t->url_ = c->url();
  } else {
    return invalid_argument("unknown test store " + kind);
  }
  KVQ_RETURN_IF_ERROR(t->on_every_node({"FLUSHALL"}));
  KVQ_ASSIGN_OR_RETURN(t->backend_, open_store(t->url_));
  return t;
}

TestStore::~TestStore() {
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

Status TestStore::on_every_node(const std::vector<std::string>& args) const {
  std::vector<RedisServer*> nodes;
  std::string why;
  if (kind_ == "redis") nodes.push_back(server_);
  if (kind_ == "cluster")
    for (auto& n : shared_cluster(&why)->nodes) nodes.push_back(n.get());
  for (RedisServer* n : nodes) {
    auto r = n->command(args);
    if (!r.ok()) return r.status();
    if (r->rfind("ERR", 0) == 0) return io_error(*r);
  }
  return ok_status();
}

}  // namespace kvq::testing
