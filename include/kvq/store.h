// kvq/store.h — a shared store of prompt-prefix caches: compute a prefix once, reuse it from any
// process or machine (docs/store.md is the normative description of keys and objects).
//
// A prompt's tokens are cut into chunks of C tokens (256 by default). Chunk i is keyed by a
// chained 128-bit hash of its token ids and chunk i-1's key, rooted in a namespace that names
// everything the cached bytes depend on (the model's files, the method's canonical spec with
// per-layer overrides, the batch size, C and the store-format version). For chunk i the store
// holds two objects:
//   * blocks: every layer's blocks that became sealed between offsets iC and (i + 1)C;
//   * tail:   every layer's state at offset (i + 1)C (method state, and the window rows of
//             chunk i's tokens that are still in the fp16 window there).
// Reusing k chunks imports the blocks of chunks 0..k-1 and the tail of chunk k-1 (plus the
// window rows of earlier tails, for methods whose window reaches back past one chunk, e.g.
// fp16) through LayerCache::import_chunks, which validates everything.
//
//   auto store = kvq::open_store("redis://127.0.0.1:6379");        // or dir:PATH, a cluster
//   auto ns = kvq::make_store_namespace(cache, model_fingerprint, 256, "my-engine/1");
//   kvq::PrefixStore prefix(store->get(), *ns);
//   kvq::StoreWriter writer("redis://127.0.0.1:6379");              // stores in the background
//   kvq::PrefixSession s({{&cache, &prefix}}, tokens, &writer);
//   int64_t done = s.reuse(tokens.size() - 1);  // tokens imported: compute from here
//   ... compute pieces ending at s.piece_end(...) and call s.reached(offset) after each ...
//
// Nothing a store returns is trusted: every object is checked (checksum, namespace, chunk key,
// index, per-layer sizes) before the cache's own import validates its contents, and a bad or
// missing object is a miss — a shorter reuse or a recompute, reported, never an error that
// loses the request and never a wrong cache. Store failures while writing are reported and
// ignored: the computed result stands.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvq/cache.h"
#include "kvq/status.h"

namespace kvq {

// ---- keys (docs/store.md §2) ----

// The store-format version: part of every namespace (so objects of another version are never
// even looked up) and of every object's header.
inline constexpr uint32_t kStoreFormatVersion = 1;
inline constexpr int64_t kDefaultStoreChunkTokens = 256;

// A 128-bit hash (XXH3-128). hex() is its canonical form: 32 lowercase hex digits, high half
// first, as XXH128_canonicalFromHash writes the bytes.
struct Hash128 {
  uint64_t hi = 0, lo = 0;
  std::string hex() const;
  // The 16 canonical (big-endian) bytes.
  void to_bytes(uint8_t out[16]) const;
  static Hash128 from_bytes(const uint8_t in[16]);
  static Result<Hash128> from_hex(std::string_view hex);
  bool operator==(const Hash128&) const = default;
};

// XXH3-128 (seed 0) of `data`.
Hash128 hash128(const void* data, size_t size);

// The fingerprint of a model given by its files (weights, and a separate tokenizer file where
// there is one): XXH3-128 of, for each file in order, its size as a u64 little-endian then its
// bytes. Read in pieces: a model of any size hashes in constant memory.
Result<Hash128> fingerprint_files(const std::vector<std::string>& paths);

// Everything a cached prefix depends on besides the tokens.
struct StoreNamespace {
  Hash128 model;           // fingerprint_files() of the model
  std::string model_spec;  // ModelCache::model_spec().to_string(): canonical, with overrides
  int64_t batch = 1;       // sequences per cache (the engine's caches hold one)
  int64_t chunk_tokens = kDefaultStoreChunkTokens;
  // What computed the keys and values (an engine and the version of its numerics): caches of
  // two engines that round differently must not mix. Printable ASCII, no newline.
  std::string producer;

  // The canonical text hashed into id() (docs/store.md §2.1).
  std::string descriptor() const;
  Hash128 id() const { return hash128(descriptor().data(), descriptor().size()); }
};

// A namespace for `cache` (its model spec and layers; any offset), validated: chunk_tokens in
// [1, 2^20] and a multiple of every layer's block_tokens() — layers whose blocks never seal
// (fp16) excepted — so chunk boundaries are block boundaries; batch in [1, 65536]; producer
// printable. kInvalidArgument with the reason otherwise.
Result<StoreNamespace> make_store_namespace(const ModelCache& cache, const Hash128& model,
                                            int64_t chunk_tokens, std::string producer,
                                            int64_t batch = 1);

// The chained keys of the whole chunks of a token sequence. `tokens` is [batch, n] row-major
// (n = tokens.size() / ns.batch); key i covers tokens [0, (i + 1)C) of every row:
//   key_i = XXH3-128(key_{i-1} (16 canonical bytes) || the ids of chunk i of row 0, row 1, ...
//                    as u32 little-endian),   key_{-1} = ns.id().
std::vector<Hash128> chunk_keys(const StoreNamespace& ns, std::span<const int32_t> tokens);

enum class StoreObjectKind : uint8_t { kBlocks = 1, kTail = 2 };
const char* store_object_kind_name(StoreObjectKind k);
// "kvq1:<namespace hex>:<chunk key hex>:b" (blocks) or ":t" (tail).
std::string store_object_key(const StoreNamespace& ns, const Hash128& key, StoreObjectKind kind);
// The prefix every object key of a namespace (or, with no namespace, of this format) starts with.
std::string store_key_prefix(const StoreNamespace* ns = nullptr);

// What an object's header says (inspect_store_object).
struct StoreObjectInfo {
  StoreObjectKind kind = StoreObjectKind::kBlocks;
  uint16_t major = 0, minor = 0;
  Hash128 ns, key;
  int64_t chunk = 0;  // chunk index i: tokens [iC, (i + 1)C)
  int64_t n_layers = 0;
  uint64_t size = 0;         // the object's declared total size
  std::string descriptor;    // the namespace's text (spec, model, batch, C, producer)
  bool checksum_ok = false;  // only checked when the whole object was given
};
// Reads an object's header (and its descriptor) from its first bytes; with the whole object
// also verifies its checksum. kFormat / kUnsupported / kCorrupt like every kvq reader.
Result<StoreObjectInfo> inspect_store_object(const uint8_t* data, size_t size);
// A descriptor's "key value" lines as a map (docs/store.md §2.2), and one numeric field of it:
// 0 when absent or not a number (a damaged object is listed, not trusted).
std::map<std::string, std::string> descriptor_fields(std::string_view descriptor);
int64_t descriptor_int(const std::map<std::string, std::string>& fields, const std::string& key);

// ---- backends ----

struct StoreEntry {
  std::string key;
  uint64_t size = 0;
};

struct StoreStats {
  uint64_t objects = 0, bytes = 0;  // keys under the prefix asked for, and their value bytes
  // Backend details as "name=value" (per Redis node: used_memory, maxmemory, evicted_keys, ...).
  std::vector<std::string> details;
};

struct StoreOptions {
  int connect_timeout_ms = 1000;
  int timeout_ms = 10000;  // any one command (a large object over a slow link needs time)
};

// A key-value store of immutable objects. Values are opaque bytes; keys are printable ASCII
// without spaces (backends may restrict further: see open_store). Calls on one backend object
// must not run concurrently (open one per thread); different objects may.
// Errors: kNotFound for an absent key (get), kIo when the store cannot be reached or fails, with
// the store's own message.
class StoreBackend {
 public:
  virtual ~StoreBackend() = default;
  // The canonical URL (dir:/abs/path, redis://host:port[/db], redis-cluster://host:port,...).
  virtual std::string url() const = 0;
  // The value, or its first `max_bytes` bytes (for headers).
  virtual Result<std::vector<uint8_t>> get(const std::string& key,
                                           uint64_t max_bytes = UINT64_MAX) = 0;
  // Stores (or replaces) a value atomically: a reader sees the old value, the new one or none,
  // never a part.
  virtual Status put(const std::string& key, std::span<const uint8_t> value) = 0;
  virtual Result<bool> exists(const std::string& key) = 0;
  // Removes a key; an absent key is not an error.
  virtual Status remove(const std::string& key) = 0;
  // Keys starting with `prefix`, with their sizes, sorted by key.
  virtual Result<std::vector<StoreEntry>> list(const std::string& prefix) = 0;
  virtual Result<StoreStats> stats(const std::string& prefix) = 0;
};

// Opens a store by URL (docs/store.md §4):
//   dir:PATH                           a local directory (created if missing), no server
//   redis://HOST:PORT[/DB]             one Redis server
//   redis-cluster://HOST:PORT[,HOST:PORT...]   a Redis Cluster, reached through any seed node
// with optional "?connect_timeout_ms=N&timeout_ms=N" after any of them. Redis URLs connect
// lazily: opening one never fails for an unreachable server (its first call does).
Result<std::unique_ptr<StoreBackend>> open_store(std::string_view url,
                                                 const StoreOptions& options = {});
// Whether this build has the Redis backends (kvq_store built with hiredis). Without them
// open_store refuses redis:// and redis-cluster:// URLs (after checking their syntax) with
// kUnsupported; dir:PATH always works.
bool store_has_redis();

// ---- prefixes ----

// What one fetch did.
struct PrefixFetch {
  int64_t chunks = 0, tokens = 0;  // reused: chunks imported and the tokens they cover
  int64_t looked_up = 0;           // chunks found by the lookup (before any fetch)
  uint64_t bytes = 0;              // object bytes fetched (including objects then rejected)
  double lookup_s = 0, fetch_s = 0, import_s = 0;
  // Why the reuse is shorter than it could be (absent, evicted or damaged objects, a store that
  // cannot be reached): one line each, for stderr.
  std::vector<std::string> notes;
};

// The objects of one chunk, ready to be written.
struct ChunkObjects {
  int64_t chunk = 0;
  std::string blocks_key, tail_key;
  std::vector<uint8_t> blocks, tail;
};

// One namespace in one store: looks prefixes up, fetches and imports them, and exports chunks.
class PrefixStore {
 public:
  // `backend` must outlive the PrefixStore.
  PrefixStore(StoreBackend* backend, StoreNamespace ns) : backend_(backend), ns_(std::move(ns)) {}
  const StoreNamespace& ns() const { return ns_; }
  StoreBackend* backend() const { return backend_; }

  // Chunks of `keys` (chunk_keys() of the prompt) whose objects a reuse of that many chunks
  // needs are all present, at most max_chunks: the longest candidate (existence only).
  // Stops at the first chunk whose blocks are absent. kIo when the store cannot be reached.
  Result<int64_t> lookup(std::span<const Hash128> keys, int64_t max_chunks, const ModelCache& cache,
                         PrefixFetch& report) const;
  // Fetches and verifies the objects of chunks [0, k) for `cache` and imports them, replacing its
  // state; the reuse is shortened (to the longest prefix whose objects all verified and whose
  // tail is present) when an object is absent or bad, each reason a note. Returns the chunks
  // imported (0: the cache is reset). Errors only for a cache that does not fit the namespace.
  Result<int64_t> fetch(std::span<const Hash128> keys, int64_t k, ModelCache& cache,
                        PrefixFetch& report) const;
  // The objects of chunk i of a cache holding exactly (i + 1)C tokens of the sequence `keys`
  // was made from. kInvalidArgument for a cache at another offset.
  Result<ChunkObjects> export_chunk(const ModelCache& cache, std::span<const Hash128> keys,
                                    int64_t i) const;

 private:
  StoreBackend* backend_;
  StoreNamespace ns_;
};

// Writes objects in the background (a thread with its own connection), so that storing new
// chunks never delays the computation. After the first failure that is not about one object
// (the store is unreachable), the rest are dropped and counted, not retried.
class StoreWriter {
 public:
  // Opens its own backend from `url` on first use. `max_queued_bytes` bounds the memory of
  // objects waiting: beyond it, put() waits for the writer.
  explicit StoreWriter(std::string url, StoreOptions options = {},
                       uint64_t max_queued_bytes = uint64_t{1} << 30);
  ~StoreWriter();  // flushes
  StoreWriter(const StoreWriter&) = delete;
  StoreWriter& operator=(const StoreWriter&) = delete;

  void put(std::string key, std::vector<uint8_t> value);
  struct Report {
    uint64_t objects = 0, bytes = 0;  // written
    uint64_t failed = 0;              // not written (errors, or dropped after a store failure)
    std::vector<std::string> errors;  // the first few, one line each
    double busy_s = 0;                // time spent writing
  };
  // Waits until every queued object is written or dropped, and returns the totals so far.
  Report flush();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One prompt's prefill against a store, for one or several caches fed the same tokens (kvq ppl
// runs a reference cache and several methods side by side; each has its own namespace):
//
//   PrefixSession s(caches, tokens, &writer);
//   for (int64_t p = s.reuse(tokens.size() - 1); p < end;) {      // import the common prefix
//     const int64_t e = s.piece_end(p, max_piece, end);           // pieces end at boundaries
//     compute tokens [p, e) through every cache;
//     s.reached(p = e);                                           // export completed chunks
//   }
class PrefixSession {
 public:
  struct Binding {
    ModelCache* cache = nullptr;
    const PrefixStore* store = nullptr;
  };
  // Every store's namespace must have the same chunk_tokens and batch; `tokens` is
  // [batch, n] row-major, as chunk_keys() takes it. `writer` may be null (nothing is stored).
  PrefixSession(std::vector<Binding> bindings, std::span<const int32_t> tokens,
                StoreWriter* writer);

  int64_t chunk_tokens() const { return chunk_; }
  // Resets every cache and imports the longest prefix of whole chunks that every cache's store
  // holds, at most max_tokens tokens (pass n - 1 so that the last token is computed and has
  // logits). Returns the tokens imported (0: nothing; the caches are empty). Never fails: a miss
  // or a bad object is a shorter reuse, noted in report().
  int64_t reuse(int64_t max_tokens);
  // The end of the next piece to compute from `offset`: at most max_piece tokens, at most `end`,
  // and never past the next chunk boundary (so that every boundary can be exported).
  int64_t piece_end(int64_t offset, int64_t max_piece, int64_t end) const;
  // Every cache now holds `offset` tokens: exports (and queues for the writer) each chunk that
  // ends exactly there and was not reused. Export failures are noted, never fatal.
  void reached(int64_t offset);

  // Reuse of the last reuse() (per binding, same order; chunks and tokens are the common ones),
  // and what was exported since (chunks of the prompt, bytes of every cache's objects).
  const std::vector<PrefixFetch>& fetches() const { return fetches_; }
  int64_t reused_tokens() const { return reused_chunks_ * chunk_; }
  int64_t exported_chunks() const { return exported_chunks_; }
  uint64_t exported_bytes() const { return exported_bytes_; }
  double export_s() const { return export_s_; }
  // Every note of the fetches and exports, in order, for stderr.
  std::vector<std::string> notes() const;

 private:
  std::vector<Binding> bindings_;
  std::span<const int32_t> tokens_;
  StoreWriter* writer_;
  int64_t chunk_ = kDefaultStoreChunkTokens;
  std::vector<std::vector<Hash128>> keys_;  // per binding
  std::vector<PrefixFetch> fetches_;
  std::vector<std::string> export_notes_;
  int64_t reused_chunks_ = 0, exported_upto_ = 0, exported_chunks_ = 0;
  uint64_t exported_bytes_ = 0;
  double export_s_ = 0;
};

}  // namespace kvq
