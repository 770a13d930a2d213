// Store URLs (docs/store.md §4): dir:PATH, redis://HOST:PORT[/DB], redis-cluster://HOST:PORT,...
// with "?connect_timeout_ms=N&timeout_ms=N" after the Redis forms.
#include <algorithm>
#include <charconv>

#include "store/backends.h"

namespace kvq {

namespace store {

StoreStats sort_listing(std::vector<StoreEntry>& entries) {
  std::sort(entries.begin(), entries.end(),
            [](const StoreEntry& a, const StoreEntry& b) { return a.key < b.key; });
  entries.erase(
      std::unique(entries.begin(), entries.end(),
                  [](const StoreEntry& a, const StoreEntry& b) { return a.key == b.key; }),
      entries.end());
  StoreStats s;
  for (const auto& e : entries) {
    ++s.objects;
    s.bytes += e.size;
  }
  return s;
}

}  // namespace store

namespace {

Result<long long> parse_number(std::string_view text, long long lo, long long hi,
                               const std::string& what) {
  long long v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi)
    return invalid_argument(what + " must be a number in [" + std::to_string(lo) + ", " +
                            std::to_string(hi) + "], got '" + std::string(text) + "'");
  return v;
}

Status parse_query(std::string_view query, StoreOptions& o) {
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    const size_t eq = kv.find('=');
    const std::string key(kv.substr(0, eq));
    const std::string_view value = eq == std::string_view::npos ? "" : kv.substr(eq + 1);
    int* target = key == "connect_timeout_ms" ? &o.connect_timeout_ms
                  : key == "timeout_ms"       ? &o.timeout_ms
                                              : nullptr;
    if (!target)
      return invalid_argument("unknown store URL option '" + key +
                              "' (known: connect_timeout_ms, timeout_ms)");
    KVQ_ASSIGN_OR_RETURN(long long v, parse_number(value, 1, 600000, key));
    *target = static_cast<int>(v);
  }
  return ok_status();
}

Result<store::RedisAddress> parse_host_port(std::string_view text) {
  store::RedisAddress a;
  const size_t colon = text.rfind(':');
  a.host = std::string(text.substr(0, colon));
  a.port = 6379;
  if (colon != std::string_view::npos) {
    KVQ_ASSIGN_OR_RETURN(long long p, parse_number(text.substr(colon + 1), 1, 65535,
                                                   "the port in '" + std::string(text) + "'"));
    a.port = static_cast<int>(p);
  }
  if (a.host.empty()) return invalid_argument("no host in '" + std::string(text) + "'");
  return a;
}

}  // namespace

Result<std::unique_ptr<StoreBackend>> open_store(std::string_view url,
                                                 const StoreOptions& options) {
  const std::string usage =
      " (use dir:PATH, redis://HOST:PORT[/DB] or redis-cluster://HOST:PORT[,HOST:PORT...])";
  if (url.rfind("dir:", 0) == 0) return store::open_dir_store(std::string(url.substr(4)));
  const bool cluster = url.rfind("redis-cluster://", 0) == 0;
  if (!cluster && url.rfind("redis://", 0) != 0)
    return invalid_argument("unknown store URL '" + std::string(url) + "'" + usage);
  std::string_view rest = url.substr(cluster ? 16 : 8);
  StoreOptions o = options;
  if (const size_t q = rest.find('?'); q != std::string_view::npos) {
    KVQ_RETURN_IF_ERROR(parse_query(rest.substr(q + 1), o));
    rest = rest.substr(0, q);
  }
  int db = 0;
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    if (cluster) return invalid_argument("a Redis Cluster has no databases: drop the /DB");
    KVQ_ASSIGN_OR_RETURN(long long d,
                         parse_number(rest.substr(slash + 1), 0, 1 << 20, "the database number"));
    db = static_cast<int>(d);
    rest = rest.substr(0, slash);
  }
  std::vector<store::RedisAddress> nodes;
  while (true) {
    const size_t comma = rest.find(',');
    auto a = parse_host_port(rest.substr(0, comma));
    if (!a.ok()) return a.status().with_context("store URL '" + std::string(url) + "'");
    nodes.push_back(std::move(*a));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  if (nodes.size() > 1 && !cluster)
    return invalid_argument("redis:// names one server; a cluster is redis-cluster://" + usage);
#ifdef KVQ_STORE_REDIS
  return store::open_redis_store(std::move(nodes), cluster, db, o);
#else
  static_cast<void>(db);  // parsed, so that a malformed URL is refused as such
  return unsupported("store URL '" + std::string(url) +
                     "': this build of kvq has no Redis backend (it was built without hiredis: "
                     "install libhiredis-dev and rebuild); dir:PATH works");
#endif
}

bool store_has_redis() {
#ifdef KVQ_STORE_REDIS
  return true;
#else
  return false;
#endif
}

}  // namespace kvq
