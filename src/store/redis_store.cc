// redis:// and redis-cluster:// — the store on Redis through hiredis (Debian's libhiredis-dev),
// with Redis Cluster routing implemented here: hiredis 0.14 has no cluster client and Debian
// packages none for C. The cluster client keeps the slot map from CLUSTER SLOTS, sends each
// command to the master of its key's slot (CRC16 of the key, docs/store.md §4.2), follows MOVED
// (the slot has moved for good: refresh the map) and ASK (the slot is migrating: ASKING, then
// the command, on the node named, once), and retries once after a connection fails (the map is
// refreshed first: a failover may have promoted a replica).
#include <hiredis/hiredis.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "store/backends.h"

namespace kvq::store {

uint16_t redis_key_slot(std::string_view key) {
  // The hash tag: the text between the first '{' and the first '}' after it, if not empty.
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1)
      key = key.substr(open + 1, close - open - 1);
  }
  uint16_t crc = 0;  // CRC16-CCITT (XMODEM): polynomial 0x1021, initial value 0
  for (char c : key) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(c) << 8);
    for (int i = 0; i < 8; ++i)
      crc = static_cast<uint16_t>(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
  }
  return crc & 16383;
}

namespace {

constexpr int kSlots = 16384;
constexpr int kMaxRedirects = 8;

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

using Args = std::vector<std::string_view>;

std::string_view as_view(std::span<const uint8_t> b) {
  return {reinterpret_cast<const char*>(b.data()), b.size()};
}

std::string reply_text(const redisReply* r) {
  return r->str ? std::string(r->str, r->len) : std::string();
}

timeval to_timeval(int ms) { return timeval{ms / 1000, (ms % 1000) * 1000}; }

// One server connection, opened on first use and dropped after any transport error (hiredis
// contexts are unusable after one), so the next command reconnects.
class Node {
 public:
  Node(RedisAddress address, int db, const StoreOptions& options)
      : address_(std::move(address)), db_(db), options_(options) {}
  ~Node() { drop(); }
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  std::string name() const { return address_.host + ":" + std::to_string(address_.port); }

  // The replies of `commands`, sent together (pipelined). kIo when the connection fails; error
  // replies are returned as replies.
  Result<std::vector<Reply>> pipeline(const std::vector<Args>& commands) {
    KVQ_RETURN_IF_ERROR(connect());
    for (const Args& a : commands) {
      std::vector<const char*> argv;
      std::vector<size_t> lens;
      for (std::string_view s : a) {
        argv.push_back(s.data());
        lens.push_back(s.size());
      }
      if (redisAppendCommandArgv(ctx_, static_cast<int>(a.size()), argv.data(), lens.data()) !=
          REDIS_OK)
        return transport_error();
    }
    std::vector<Reply> replies;
    for (size_t i = 0; i < commands.size(); ++i) {
      void* r = nullptr;
      if (redisGetReply(ctx_, &r) != REDIS_OK || r == nullptr) return transport_error();
      replies.emplace_back(static_cast<redisReply*>(r));
    }
    return replies;
  }
  Result<Reply> command(const Args& args) {
    KVQ_ASSIGN_OR_RETURN(auto replies, pipeline({args}));
    return std::move(replies[0]);
  }

 private:
  Status connect() {
    if (ctx_) return ok_status();
    ctx_ = redisConnectWithTimeout(address_.host.c_str(), address_.port,
                                   to_timeval(options_.connect_timeout_ms));
    if (!ctx_ || ctx_->err) return transport_error("cannot connect to ");
    if (redisSetTimeout(ctx_, to_timeval(options_.timeout_ms)) != REDIS_OK)
      return transport_error();
    if (db_ != 0) {
      const std::string db = std::to_string(db_);
      auto r = command({"SELECT", db});
      if (!r.ok()) return r.status();
      if ((*r)->type == REDIS_REPLY_ERROR)
        return io_error("redis " + name() + ": SELECT " + db + ": " + reply_text(r->get()));
    }
    return ok_status();
  }
  Status transport_error(const std::string& what = "") {
    const std::string why =
        ctx_ ? (ctx_->err == REDIS_ERR_EOF ? "the server closed the connection" : ctx_->errstr)
             : "out of memory";
    drop();
    return io_error("redis " + (what.empty() ? name() : what + name()) + ": " + why);
  }
  void drop() {
    if (ctx_) redisFree(ctx_);
    ctx_ = nullptr;
  }

  RedisAddress address_;
  int db_;
  StoreOptions options_;
  redisContext* ctx_ = nullptr;
};

Result<RedisAddress> parse_address(std::string_view text, std::string_view fallback_host) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos)
    return io_error("bad node address '" + std::string(text) + "'");
  RedisAddress a;
  a.host = std::string(text.substr(0, colon));
  if (a.host.empty()) a.host = std::string(fallback_host);
  try {
    a.port = std::stoi(std::string(text.substr(colon + 1)));
  } catch (...) {
    return io_error("bad node address '" + std::string(text) + "'");
  }
  return a;
}

class RedisStore final : public StoreBackend {
 public:
  RedisStore(std::vector<RedisAddress> seeds, bool cluster, int db, const StoreOptions& options)
      : cluster_(cluster), db_(db), options_(options), slot_node_(kSlots, -1) {
    for (auto& s : seeds) node_index(s);
    seeds_ = nodes_.size();
  }

  std::string url() const override {
    std::string u = cluster_ ? "redis-cluster://" : "redis://";
    for (size_t i = 0; i < seeds_; ++i) u += (i ? "," : "") + nodes_[i]->name();
    if (db_ != 0) u += "/" + std::to_string(db_);
    return u;
  }

  Result<std::vector<uint8_t>> get(const std::string& key, uint64_t max_bytes) override {
    if (max_bytes != UINT64_MAX) {  // a header: GETRANGE, which cannot tell absent from empty
      KVQ_ASSIGN_OR_RETURN(bool there, exists(key));
      if (!there) return not_found("no key '" + key + "' in " + url());
      if (max_bytes == 0) return std::vector<uint8_t>();
      const std::string end = std::to_string(max_bytes - 1);
      KVQ_ASSIGN_OR_RETURN(Reply r, keyed(key, {"GETRANGE", key, "0", end}));
      return string_reply(r.get(), "GETRANGE");
    }
    KVQ_ASSIGN_OR_RETURN(Reply r, keyed(key, {"GET", key}));
    if (r->type == REDIS_REPLY_NIL) return not_found("no key '" + key + "' in " + url());
    return string_reply(r.get(), "GET");
  }

  Status put(const std::string& key, std::span<const uint8_t> value) override {
    KVQ_ASSIGN_OR_RETURN(Reply r, keyed(key, {"SET", key, as_view(value)}));
    if (r->type != REDIS_REPLY_STATUS) return unexpected("SET", r.get());
    return ok_status();
  }

  Result<bool> exists(const std::string& key) override {
    KVQ_ASSIGN_OR_RETURN(Reply r, keyed(key, {"EXISTS", key}));
    if (r->type != REDIS_REPLY_INTEGER) return unexpected("EXISTS", r.get());
    return r->integer > 0;
  }

  Status remove(const std::string& key) override {
    KVQ_ASSIGN_OR_RETURN(Reply r, keyed(key, {"DEL", key}));
    if (r->type != REDIS_REPLY_INTEGER) return unexpected("DEL", r.get());
    return ok_status();
  }

  Result<std::vector<StoreEntry>> list(const std::string& prefix) override {
    KVQ_ASSIGN_OR_RETURN(std::vector<int> masters, master_nodes());
    std::vector<StoreEntry> out;
    for (int n : masters)
      KVQ_RETURN_IF_ERROR(scan_node(*nodes_[static_cast<size_t>(n)], prefix, out));
    sort_listing(out);
    return out;
  }

  Result<StoreStats> stats(const std::string& prefix) override {
    KVQ_ASSIGN_OR_RETURN(auto entries, list(prefix));
    StoreStats s = sort_listing(entries);
    KVQ_ASSIGN_OR_RETURN(std::vector<int> masters, master_nodes());
    for (int n : masters) {
      Node& node = *nodes_[static_cast<size_t>(n)];
      KVQ_ASSIGN_OR_RETURN(auto replies,
                           node.pipeline({{"INFO", "memory"}, {"INFO", "stats"}, {"DBSIZE"}}));
      std::string line = "node " + node.name() + ":";
      for (int i = 0; i < 2; ++i) {
        if (replies[static_cast<size_t>(i)]->type != REDIS_REPLY_STRING)
          return unexpected("INFO", replies[static_cast<size_t>(i)].get());
        const std::string info = reply_text(replies[static_cast<size_t>(i)].get());
        for (const char* field : {"used_memory", "maxmemory", "maxmemory_policy", "evicted_keys"}) {
          const std::string f = std::string("\n") + field + ":";
          const size_t at = info.find(f);
          if (at == std::string::npos) continue;
          const size_t end = info.find_first_of("\r\n", at + f.size());
          line += " " + std::string(field) + "=" + info.substr(at + f.size(), end - at - f.size());
        }
      }
      if (replies[2]->type == REDIS_REPLY_INTEGER)
        line += " keys=" + std::to_string(replies[2]->integer);
      s.details.push_back(line);
    }
    return s;
  }

 private:
  int node_index(const RedisAddress& a) {
    const std::string name = a.host + ":" + std::to_string(a.port);
    for (size_t i = 0; i < nodes_.size(); ++i)
      if (nodes_[i]->name() == name) return static_cast<int>(i);
    nodes_.push_back(std::make_unique<Node>(a, db_, options_));
    return static_cast<int>(nodes_.size() - 1);
  }

  Status unexpected(const char* cmd, const redisReply* r) const {
    return io_error("redis " + url() + ": " + cmd + ": " +
                    (r->type == REDIS_REPLY_ERROR
                         ? reply_text(r)
                         : "unexpected reply type " + std::to_string(r->type)));
  }
  Result<std::vector<uint8_t>> string_reply(const redisReply* r, const char* cmd) const {
    if (r->type != REDIS_REPLY_STRING) return unexpected(cmd, r);
    const auto* p = reinterpret_cast<const uint8_t*>(r->str);
    return std::vector<uint8_t>(p, p + r->len);
  }

  // The slot map from the first node that gives one.
  Status refresh_slots() {
    std::string errors;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      Node& node = *nodes_[i];
      auto r = node.command({"CLUSTER", "SLOTS"});
      if (!r.ok()) {
        errors += (errors.empty() ? "" : "; ") + r.status().message();
        continue;
      }
      const redisReply* slots = r->get();
      if (slots->type != REDIS_REPLY_ARRAY) {
        errors += (errors.empty() ? "" : "; ") + unexpected("CLUSTER SLOTS", slots).message();
        continue;
      }
      std::vector<int> map(kSlots, -1);
      const std::string host = node.name().substr(0, node.name().rfind(':'));
      for (size_t j = 0; j < slots->elements; ++j) {
        const redisReply* e = slots->element[j];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
            e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
          return io_error("redis " + node.name() + ": malformed CLUSTER SLOTS reply");
        RedisAddress a;
        a.host = reply_text(e->element[2]->element[0]);
        // An empty or "?" endpoint means "the address you reached me at" (Redis 7).
        if (a.host.empty() || a.host == "?") a.host = host;
        a.port = static_cast<int>(e->element[2]->element[1]->integer);
        const int n = node_index(a);
        const long long lo = std::max(0LL, e->element[0]->integer);
        const long long hi = std::min<long long>(kSlots - 1, e->element[1]->integer);
        for (long long s = lo; s <= hi; ++s) map[static_cast<size_t>(s)] = n;
      }
      slot_node_ = std::move(map);
      slots_known_ = true;
      return ok_status();
    }
    return io_error("redis cluster " + url() + ": no node gave its slot map (" + errors + ")");
  }

  Result<int> node_for_slot(uint16_t slot) {
    if (!slots_known_) KVQ_RETURN_IF_ERROR(refresh_slots());
    const int n = slot_node_[slot];
    if (n < 0)
      return io_error("redis cluster " + url() + ": no node serves slot " + std::to_string(slot) +
                      " (is the cluster down?)");
    return n;
  }

  // One command on the key's node: the only node of a standalone server; in a cluster the
  // master of the key's slot, following redirections.
  Result<Reply> keyed(std::string_view key, const Args& args) {
    if (!cluster_) {
      KVQ_ASSIGN_OR_RETURN(Reply r, nodes_[0]->command(args));
      if (r->type == REDIS_REPLY_ERROR) return Result<Reply>(unexpected(args[0].data(), r.get()));
      return r;
    }
    const uint16_t slot = redis_key_slot(key);
    KVQ_ASSIGN_OR_RETURN(int n, node_for_slot(slot));
    bool asking = false, retried = false;
    for (int attempt = 0; attempt < kMaxRedirects; ++attempt) {
      Node& node = *nodes_[static_cast<size_t>(n)];
      Result<std::vector<Reply>> rs =
          asking ? node.pipeline({{"ASKING"}, args}) : node.pipeline({args});
      if (!rs.ok()) {
        if (retried) return rs.status();
        retried = true;  // a node went away: ask the others where the slot lives now
        if (!refresh_slots().ok()) return rs.status();
        KVQ_ASSIGN_OR_RETURN(n, node_for_slot(slot));
        asking = false;
        continue;
      }
      Reply r = std::move(rs->back());
      if (r->type != REDIS_REPLY_ERROR) return r;
      const std::string err = reply_text(r.get());
      const bool moved = err.rfind("MOVED ", 0) == 0, ask = err.rfind("ASK ", 0) == 0;
      if (moved || ask) {
        // "MOVED <slot> <host>:<port>" / "ASK <slot> <host>:<port>"
        const size_t sp = err.rfind(' ');
        KVQ_ASSIGN_OR_RETURN(RedisAddress a,
                             parse_address(std::string_view(err).substr(sp + 1),
                                           node.name().substr(0, node.name().rfind(':'))));
        n = node_index(a);
        asking = ask;
        if (moved) {
          slot_node_[slot] = n;
          // Slots rarely move alone: learn the new map now rather than one MOVED at a time.
          (void)refresh_slots();
          if (slot_node_[slot] < 0) slot_node_[slot] = n;
          n = slot_node_[slot];
        }
        continue;
      }
      if (err.rfind("TRYAGAIN", 0) == 0 || err.rfind("CLUSTERDOWN", 0) == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20 * (attempt + 1)));
        asking = false;
        continue;
      }
      return Result<Reply>(unexpected(args[0].data(), r.get()));
    }
    return io_error("redis cluster " + url() + ": too many redirections for key '" +
                    std::string(key) + "'");
  }

  // The nodes that hold keys: the server, or every master of the cluster.
  Result<std::vector<int>> master_nodes() {
    if (!cluster_) return std::vector<int>{0};
    KVQ_RETURN_IF_ERROR(refresh_slots());
    std::vector<int> m(slot_node_.begin(), slot_node_.end());
    std::sort(m.begin(), m.end());
    m.erase(std::unique(m.begin(), m.end()), m.end());
    if (!m.empty() && m[0] < 0) m.erase(m.begin());
    return m;
  }

  // Keys of one node starting with `prefix` (SCAN with MATCH) and their sizes (STRLEN,
  // pipelined a batch at a time).
  Status scan_node(Node& node, const std::string& prefix, std::vector<StoreEntry>& out) {
    std::string pattern;
    for (char c : prefix) {
      if (c == '*' || c == '?' || c == '[' || c == ']' || c == '\\') pattern += '\\';
      pattern += c;
    }
    pattern += '*';
    std::string cursor = "0";
    do {
      KVQ_ASSIGN_OR_RETURN(Reply r,
                           node.command({"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"}));
      if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
          r->element[0]->type != REDIS_REPLY_STRING || r->element[1]->type != REDIS_REPLY_ARRAY)
        return unexpected("SCAN", r.get());
      cursor = reply_text(r->element[0]);
      const redisReply* keys = r->element[1];
      std::vector<Args> strlens;
      std::vector<std::string> names;
      for (size_t i = 0; i < keys->elements; ++i) {
        if (keys->element[i]->type != REDIS_REPLY_STRING) return unexpected("SCAN", keys);
        names.push_back(reply_text(keys->element[i]));
      }
      for (const auto& k : names) strlens.push_back({"STRLEN", k});
      if (strlens.empty()) continue;
      KVQ_ASSIGN_OR_RETURN(auto sizes, node.pipeline(strlens));
      for (size_t i = 0; i < names.size(); ++i)
        if (sizes[i]->type == REDIS_REPLY_INTEGER)
          out.push_back({names[i], static_cast<uint64_t>(sizes[i]->integer)});
    } while (cursor != "0");
    return ok_status();
  }

  bool cluster_;
  int db_;
  StoreOptions options_;
  std::vector<std::unique_ptr<Node>> nodes_;
  size_t seeds_ = 0;  // nodes_[0, seeds_) are the ones the URL named
  bool slots_known_ = false;
  std::vector<int> slot_node_;
};

}  // namespace

std::unique_ptr<StoreBackend> open_redis_store(std::vector<RedisAddress> nodes, bool cluster,
                                               int db, const StoreOptions& options) {
  return std::make_unique<RedisStore>(std::move(nodes), cluster, db, options);
}

}  // namespace kvq::store
