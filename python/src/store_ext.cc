// kvq._kvq's prefix store (include/kvq/store.h, docs/store.md): stores opened by URL with the
// inspection verbs of `kvq store` (ls, stats, get, put, rm, keys), namespaces and chunk keys,
// and prefix reuse — PrefixStore (lookup, fetch into a ModelCache, export), StoreWriter (stores
// in the background) and PrefixSession (one prompt's prefill against a store).
//
// Threads: every call that may wait on a store or work on a cache releases the GIL first, then
// takes the locks it needs in one global order — a session's, then stores' (a StoreBackend runs
// one call at a time), then caches' (PyModel::mu) — each set in address order, so two Python
// threads cannot deadlock. Store failures are exceptions carrying kvq's message (an unreachable
// server: kvq.IoError, an OSError); a PrefixSession never fails on a store (a shorter reuse or
// a recompute, noted), as in C++.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ext.h"
#include "kvq/store.h"

using namespace nb::literals;

namespace kvq {
namespace {

// An object's header and its namespace's text are in its first bytes (as `kvq store ls` reads).
constexpr uint64_t kHeaderRead = 1024;

// ---- stores ----

// A backend, what opened it, and the lock that keeps its calls one at a time.
struct StoreShared {
  std::string url;  // as given (with its ?options), for writers of the same store
  StoreOptions options;
  std::unique_ptr<StoreBackend> backend;
  std::mutex mu;
};

struct PyStore {
  std::shared_ptr<StoreShared> s;
};

// Runs f without the GIL, under the store's lock.
template <class F>
auto run_on_store(StoreShared& s, F&& f) {
  nb::gil_scoped_release release;
  std::lock_guard lock(s.mu);
  return f();
}

StoreOptions make_options(std::optional<int> connect_timeout_ms, std::optional<int> timeout_ms) {
  auto set = [](std::optional<int> value, int& target, const char* name) {
    if (!value) return;
    if (*value < 1 || *value > 600000)
      raise_status(invalid_argument(std::string(name) + " must be in [1, 600000], got " +
                                    std::to_string(*value)));
    target = *value;
  };
  StoreOptions o;
  set(connect_timeout_ms, o.connect_timeout_ms, "connect_timeout_ms");
  set(timeout_ms, o.timeout_ms, "timeout_ms");
  return o;
}

std::shared_ptr<StoreShared> open_shared(const std::string& url, const StoreOptions& options) {
  Result<std::unique_ptr<StoreBackend>> r = [&] {
    nb::gil_scoped_release release;
    return open_store(url, options);
  }();
  auto s = std::make_shared<StoreShared>();
  s->backend = unwrap(std::move(r));
  s->url = url;
  s->options = options;
  return s;
}

nb::bytes to_bytes(const std::vector<uint8_t>& v) {
  return nb::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

// What an object's header says, as a dict (the fields of `kvq store ls --json`).
nb::dict info_dict(const StoreObjectInfo& info) {
  const auto f = descriptor_fields(info.descriptor);
  const int64_t C = descriptor_int(f, "chunk");
  nb::dict d;
  d["kind"] = store_object_kind_name(info.kind);
  d["version"] = nb::make_tuple(info.major, info.minor);
  d["namespace"] = info.ns.hex();
  d["chunk_key"] = info.key.hex();
  d["chunk"] = info.chunk;
  d["token_begin"] = info.chunk * C;
  d["token_end"] = (info.chunk + 1) * C;
  d["n_layers"] = info.n_layers;
  d["object_size"] = info.size;
  for (const char* k : {"spec", "model", "producer"}) d[k] = f.count(k) ? f.at(k) : std::string();
  d["batch"] = descriptor_int(f, "batch");
  d["chunk_tokens"] = C;
  d["descriptor"] = info.descriptor;
  return d;
}

// ---- token ids ----

// A prompt's ids as chunk_keys() takes them: [batch, n] row-major int32. Accepts a 1-D or 2-D
// integer array or tensor on the CPU (any strides) or a list of ints (or of lists of ints); a
// 1-D sequence is one row.
std::vector<int32_t> token_ids(nb::handle obj, int64_t batch) {
  std::vector<int64_t> flat;
  int64_t rows = 1;
  nb::ndarray<nb::ro> a;
  if (nb::try_cast(obj, a, /*convert=*/false)) {
    const auto t = a.dtype();
    const bool is_int = t.lanes == 1 &&
                        (t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int) ||
                         t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::UInt)) &&
                        (t.bits == 8 || t.bits == 16 || t.bits == 32 || t.bits == 64);
    if (!is_int) raise_type_error("token ids must be an integer array or tensor");
    if (a.device_type() != nb::device::cpu::value)
      raise_status(invalid_argument("token ids must be on the CPU"));
    if (a.ndim() != 1 && a.ndim() != 2)
      raise_status(shape_mismatch("token ids must be 1-D [n] or 2-D [batch, n], got " +
                                  std::to_string(a.ndim()) + "-D"));
    rows = a.ndim() == 2 ? static_cast<int64_t>(a.shape(0)) : 1;
    const int64_t cols = static_cast<int64_t>(a.shape(a.ndim() - 1));
    const int64_t s0 = a.ndim() == 2 ? a.stride(0) : 0, s1 = a.stride(a.ndim() - 1);
    const auto* base = static_cast<const uint8_t*>(a.data());
    const bool is_signed = t.code == static_cast<uint8_t>(nb::dlpack::dtype_code::Int);
    const int64_t size = t.bits / 8;
    flat.reserve(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t* p = base + (r * s0 + c * s1) * size;
        int64_t v = 0;
        switch (t.bits) {
          case 8:
            v = is_signed ? *reinterpret_cast<const int8_t*>(p) : *p;
            break;
          case 16:
            v = is_signed ? *reinterpret_cast<const int16_t*>(p)
                          : *reinterpret_cast<const uint16_t*>(p);
            break;
          case 32:
            v = is_signed ? *reinterpret_cast<const int32_t*>(p)
                          : *reinterpret_cast<const uint32_t*>(p);
            break;
          default: {
            const uint64_t u = *reinterpret_cast<const uint64_t*>(p);
            if (!is_signed && u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
              raise_status(out_of_range("token id " + std::to_string(u) + " is not an int32"));
            v = static_cast<int64_t>(u);
          }
        }
        flat.push_back(v);
      }
  } else if (std::vector<int64_t> ids; nb::try_cast(obj, ids)) {
    flat = std::move(ids);
  } else if (std::vector<std::vector<int64_t>> nested; nb::try_cast(obj, nested)) {
    rows = static_cast<int64_t>(nested.size());
    for (const auto& row : nested) {
      if (row.size() != nested[0].size())
        raise_status(shape_mismatch("token id rows of different lengths"));
      flat.insert(flat.end(), row.begin(), row.end());
    }
  } else {
    raise_type_error(std::string("token ids must be an integer array, tensor or list, got ") +
                     nb::inst_name(obj).c_str());
  }
  if (rows != batch)
    raise_status(shape_mismatch("token ids have " + std::to_string(rows) +
                                " rows, the namespace's batch is " + std::to_string(batch) +
                                (rows == 1 ? " (give them as [batch, n])" : "")));
  std::vector<int32_t> out;
  out.reserve(flat.size());
  for (const int64_t v : flat) {
    if (v < std::numeric_limits<int32_t>::min() || v > std::numeric_limits<int32_t>::max())
      raise_status(out_of_range("token id " + std::to_string(v) + " is not an int32"));
    out.push_back(static_cast<int32_t>(v));
  }
  return out;
}

std::vector<Hash128> chunk_keys_of(const StoreNamespace& ns, nb::handle tokens) {
  const std::vector<int32_t> ids = token_ids(tokens, ns.batch);
  return chunk_keys(ns, ids);
}

StoreObjectKind parse_kind(std::string_view kind) {
  if (kind == "blocks") return StoreObjectKind::kBlocks;
  if (kind == "tail") return StoreObjectKind::kTail;
  raise_status(
      invalid_argument("object kind must be 'blocks' or 'tail', got '" + std::string(kind) + "'"));
}

// ---- prefixes ----

PyModel& model_of(nb::handle cache) {
  PyModel* m = nullptr;
  if (!nb::try_cast(cache, m) || !m)
    raise_type_error(std::string("expected a kvq.ModelCache, got ") + nb::inst_name(cache).c_str());
  return *m;
}

// One namespace in one store (kvq::PrefixStore); keeps its store alive.
struct PyPrefixStore {
  PyPrefixStore(std::shared_ptr<StoreShared> shared, StoreNamespace ns)
      : s(std::move(shared)), prefix(s->backend.get(), std::move(ns)) {}
  std::shared_ptr<StoreShared> s;
  PrefixStore prefix;
};

// Locks taken for one call, in the global order (stores, then caches; each set by address).
struct CallLocks {
  std::vector<std::unique_lock<std::mutex>> stores;
  std::vector<std::unique_lock<std::shared_mutex>> caches;
  CallLocks(std::vector<std::mutex*> store_mus, std::vector<std::shared_mutex*> cache_mus) {
    auto unique_sorted = [](auto& v) {
      std::sort(v.begin(), v.end());
      v.erase(std::unique(v.begin(), v.end()), v.end());
    };
    unique_sorted(store_mus);
    unique_sorted(cache_mus);
    for (std::mutex* m : store_mus) stores.emplace_back(*m);
    for (std::shared_mutex* m : cache_mus) caches.emplace_back(*m);
  }
};

// A StoreWriter, shared with the sessions that store through it (close() cannot pull it from
// under one).
struct PyWriter {
  std::shared_ptr<StoreWriter> writer;
};

// One prompt's prefill against stores (kvq::PrefixSession), owning its token ids and keeping the
// caches, prefix stores and writer it points to alive.
struct PySession {
  std::vector<nb::object> keep_alive;  // the caches and prefix stores
  std::shared_ptr<StoreWriter> writer;
  std::vector<std::mutex*> store_mus;
  std::vector<std::shared_mutex*> cache_mus;
  std::vector<int32_t> tokens;
  std::unique_ptr<PrefixSession> session;
  std::mutex mu;  // one call at a time
};

template <class F>
auto run_session(PySession& s, bool with_stores, F&& f) {
  nb::gil_scoped_release release;
  std::lock_guard lock(s.mu);
  CallLocks locks(with_stores ? s.store_mus : std::vector<std::mutex*>{}, s.cache_mus);
  return f();
}

void init_session(PySession* self, nb::handle bindings, nb::handle tokens, nb::handle writer) {
  std::vector<nb::object> keep;
  std::vector<PrefixSession::Binding> list;
  std::vector<std::mutex*> store_mus;
  std::vector<std::shared_mutex*> cache_mus;
  const StoreNamespace* first = nullptr;
  if (!nb::isinstance<nb::list>(bindings) && !nb::isinstance<nb::tuple>(bindings))
    raise_type_error("bindings must be a list of (ModelCache, PrefixStore) pairs");
  for (nb::handle item : nb::iter(bindings)) {
    if ((!nb::isinstance<nb::tuple>(item) && !nb::isinstance<nb::list>(item)) || nb::len(item) != 2)
      raise_type_error("bindings must be a list of (ModelCache, PrefixStore) pairs");
    const nb::object pair = nb::borrow(item);
    PyModel& model = model_of(pair[0]);
    PyPrefixStore* prefix = nullptr;
    if (!nb::try_cast(pair[1], prefix) || !prefix)
      raise_type_error(std::string("expected a kvq.PrefixStore, got ") +
                       nb::inst_name(pair[1]).c_str());
    const StoreNamespace& ns = prefix->prefix.ns();
    if (!first) first = &ns;
    if (ns.chunk_tokens != first->chunk_tokens || ns.batch != first->batch)
      raise_status(invalid_argument(
          "every namespace of a session needs the same chunk_tokens and batch (" +
          std::to_string(first->chunk_tokens) + ", " + std::to_string(first->batch) + " vs " +
          std::to_string(ns.chunk_tokens) + ", " + std::to_string(ns.batch) + ")"));
    if (std::find(cache_mus.begin(), cache_mus.end(), &model.mu) != cache_mus.end())
      raise_status(invalid_argument("a cache appears twice in the session's bindings"));
    list.push_back({&model.cache, &prefix->prefix});
    store_mus.push_back(&prefix->s->mu);
    cache_mus.push_back(&model.mu);
    keep.emplace_back(pair[0]);
    keep.emplace_back(pair[1]);
  }
  if (list.empty()) raise_status(invalid_argument("a session needs at least one binding"));
  std::shared_ptr<StoreWriter> w;
  if (!writer.is_none()) {
    PyWriter* pw = nullptr;
    if (!nb::try_cast(writer, pw) || !pw)
      raise_type_error(std::string("writer must be a kvq.StoreWriter or None, got ") +
                       nb::inst_name(writer).c_str());
    if (!pw->writer) raise_status(invalid_argument("the StoreWriter is closed"));
    w = pw->writer;
  }
  std::vector<int32_t> ids = token_ids(tokens, first->batch);
  // Nothing below raises: the session is built in place.
  auto* s = new (self) PySession();
  s->tokens = std::move(ids);
  s->writer = std::move(w);
  s->keep_alive = std::move(keep);
  s->store_mus = std::move(store_mus);
  s->cache_mus = std::move(cache_mus);
  nb::gil_scoped_release release;  // the chunk keys hash every token
  s->session = std::make_unique<PrefixSession>(std::move(list), s->tokens, s->writer.get());
}

nb::list strings(const std::vector<std::string>& v) {
  nb::list l;
  for (const auto& s : v) l.append(s);
  return l;
}

}  // namespace

void bind_store(nb::module_& m) {
  m.attr("STORE_FORMAT_VERSION") = kStoreFormatVersion;
  m.attr("DEFAULT_STORE_CHUNK_TOKENS") = kDefaultStoreChunkTokens;
  m.def(
      "store_has_redis", [] { return store_has_redis(); },
      "Whether this build has the store's Redis backends (redis://, redis-cluster://; hiredis "
      "found when the module was built). Without them those URLs raise kvq.UnsupportedError.");
  m.def(
      "hash128",
      [](nb::handle data) {
        Buffer buf(data);
        nb::gil_scoped_release release;
        return hash128(buf.data(), buf.size()).hex();
      },
      "data"_a,
      "XXH3-128 (seed 0) of a bytes-like object, as 32 lowercase hex digits (canonical: high half "
      "first), the hash of every store key (docs/store.md §2).");
  m.def(
      "fingerprint_files",
      [](const std::vector<std::string>& paths) {
        Result<Hash128> r = [&] {
          nb::gil_scoped_release release;
          return fingerprint_files(paths);
        }();
        return unwrap(std::move(r)).hex();
      },
      "paths"_a,
      "The model fingerprint kvq's engine uses (docs/store.md §2.1): XXH3-128 over each file's "
      "size (u64 LE) and bytes, in order; hex.");

  // ---- namespaces and keys ----
  nb::class_<StoreNamespace>(m, "StoreNamespace",
                             "Everything a stored prefix depends on besides its tokens "
                             "(docs/store.md §2.2): the model's fingerprint, the cache's canonical "
                             "model spec, the batch size, the chunk size and the producer.")
      .def(
          "__init__",
          [](StoreNamespace* self, const PyModel& c, std::string_view model, int64_t chunk_tokens,
             std::string producer, int64_t batch) {
            const Hash128 fp = unwrap(Hash128::from_hex(model));
            std::shared_lock lock(c.mu);
            new (self) StoreNamespace(unwrap(
                make_store_namespace(c.cache, fp, chunk_tokens, std::move(producer), batch)));
          },
          "cache"_a, "model"_a, "chunk_tokens"_a = kDefaultStoreChunkTokens, nb::kw_only(),
          "producer"_a, "batch"_a = 1,
          "The namespace of `cache` (its canonical model spec; any offset): `model` is the "
          "model's fingerprint (32 hex digits), `producer` names what computes the keys and "
          "values (printable ASCII; caches of engines that round differently must not mix). "
          "chunk_tokens must be a multiple of every layer's block length.")
      .def_prop_ro("model", [](const StoreNamespace& n) { return n.model.hex(); })
      .def_ro("model_spec", &StoreNamespace::model_spec)
      .def_ro("batch", &StoreNamespace::batch)
      .def_ro("chunk_tokens", &StoreNamespace::chunk_tokens)
      .def_ro("producer", &StoreNamespace::producer)
      .def_prop_ro("descriptor", &StoreNamespace::descriptor, "The text hashed into id.")
      .def_prop_ro(
          "id", [](const StoreNamespace& n) { return n.id().hex(); },
          "XXH3-128 of the descriptor, hex.")
      .def("__eq__", [](const StoreNamespace& a,
                        const StoreNamespace& b) { return a.descriptor() == b.descriptor(); })
      .def("__repr__", [](const StoreNamespace& n) {
        return "<kvq.StoreNamespace " + n.id().hex() + ": " + n.model_spec + ", chunk " +
               std::to_string(n.chunk_tokens) + ">";
      });
  m.def(
      "chunk_keys",
      [](const StoreNamespace& ns, nb::handle tokens) {
        std::vector<std::string> out;
        for (const Hash128& k : chunk_keys_of(ns, tokens)) out.push_back(k.hex());
        return out;
      },
      "namespace"_a, "tokens"_a,
      nb::sig("def chunk_keys(namespace: StoreNamespace, tokens: object) -> list[str]"),
      "The chained keys of the whole chunks of `tokens` (1-D [n], or [batch, n]; ints), hex: key "
      "i names tokens [0, (i + 1) C) in the namespace (docs/store.md §2.3).");
  m.def(
      "store_object_key",
      [](const StoreNamespace& ns, std::string_view key, std::string_view kind) {
        return store_object_key(ns, unwrap(Hash128::from_hex(key)), parse_kind(kind));
      },
      "namespace"_a, "key"_a, "kind"_a,
      "'kvq1:<namespace>:<chunk key>:b' (kind 'blocks') or ':t' ('tail').");
  m.def(
      "store_key_prefix", [](const StoreNamespace* ns) { return store_key_prefix(ns); },
      "namespace"_a = nb::none(),
      "The prefix of every object key of a namespace, or of kvq's format ('kvq1:').");
  m.def(
      "inspect_store_object",
      [](nb::handle data) {
        Buffer buf(data);
        Result<StoreObjectInfo> r = [&] {
          nb::gil_scoped_release release;
          return inspect_store_object(buf.data(), buf.size());
        }();
        const StoreObjectInfo info = unwrap(std::move(r));
        nb::dict d = info_dict(info);
        d["checksum_ok"] = info.checksum_ok;
        return d;
      },
      "data"_a,
      "What a store object's header says (kind, namespace, chunk, token range, spec, model, "
      "...), from its first bytes; checksum_ok is checked only when the whole object is given. "
      "kvq.FormatError / UnsupportedError / CorruptError for bytes that are not one.");

  // ---- stores ----
  nb::class_<PyStore>(m, "Store",
                      "A prefix store opened by URL (kvq::StoreBackend): dir:PATH, "
                      "redis://HOST:PORT[/DB], redis-cluster://HOST:PORT[,HOST:PORT...], each "
                      "with optional ?connect_timeout_ms=N&timeout_ms=N. Redis URLs connect "
                      "lazily: opening never fails for an unreachable server, its first call "
                      "does (kvq.IoError, an OSError). Calls release the GIL and run one at a "
                      "time per Store.")
      .def(
          "__init__",
          [](PyStore* self, const std::string& url, std::optional<int> connect_timeout_ms,
             std::optional<int> timeout_ms) {
            new (self) PyStore{open_shared(url, make_options(connect_timeout_ms, timeout_ms))};
          },
          "url"_a, "connect_timeout_ms"_a = nb::none(), "timeout_ms"_a = nb::none(),
          "Opens a store (a directory is created if missing). The timeouts (ms) are defaults "
          "that the URL's own options override.")
      .def_prop_ro(
          "url", [](const PyStore& s) { return s.s->backend->url(); },
          "The canonical URL (dir:/abs/path, redis://host:port[/db], ...).")
      .def(
          "get",
          [](PyStore& s, const std::string& key, std::optional<uint64_t> max_bytes) {
            auto r = run_on_store(
                *s.s, [&] { return s.s->backend->get(key, max_bytes.value_or(UINT64_MAX)); });
            return to_bytes(unwrap(std::move(r)));
          },
          "key"_a, "max_bytes"_a = nb::none(),
          "The value of `key` (or its first max_bytes bytes). kvq.NotFoundError for an absent "
          "key.")
      .def(
          "put",
          [](PyStore& s, const std::string& key, nb::handle data) {
            Buffer buf(data);
            check(run_on_store(*s.s, [&] {
              return s.s->backend->put(key, std::span<const uint8_t>(buf.data(), buf.size()));
            }));
          },
          "key"_a, "data"_a,
          "Stores (or replaces) a value atomically; `data`: any bytes-like object.")
      .def(
          "exists",
          [](PyStore& s, const std::string& key) {
            return unwrap(run_on_store(*s.s, [&] { return s.s->backend->exists(key); }));
          },
          "key"_a)
      .def(
          "rm",
          [](PyStore& s, const std::string& key, bool prefix) -> std::optional<size_t> {
            if (!prefix) {
              check(run_on_store(*s.s, [&] { return s.s->backend->remove(key); }));
              return std::nullopt;
            }
            if (key.empty())
              raise_status(invalid_argument("rm(prefix=True) needs a non-empty prefix"));
            Result<size_t> r = run_on_store(*s.s, [&]() -> Result<size_t> {
              KVQ_ASSIGN_OR_RETURN(auto entries, s.s->backend->list(key));
              for (const auto& e : entries) KVQ_RETURN_IF_ERROR(s.s->backend->remove(e.key));
              return entries.size();
            });
            return unwrap(std::move(r));
          },
          "key"_a, "prefix"_a = false,
          "Removes a key (an absent one is not an error); with prefix=True every key starting "
          "with `key`, returning how many.")
      .def(
          "list",
          [](PyStore& s, const std::string& prefix) {
            auto entries = unwrap(run_on_store(*s.s, [&] { return s.s->backend->list(prefix); }));
            std::vector<std::pair<std::string, uint64_t>> out;
            for (auto& e : entries) out.emplace_back(std::move(e.key), e.size);
            return out;
          },
          "prefix"_a = "kvq1:", "(key, size) of every key starting with `prefix`, sorted by key.")
      .def(
          "ls",
          [](PyStore& s, const std::string& prefix, bool verify) {
            struct Row {
              StoreEntry entry;
              Result<StoreObjectInfo> info = unsupported("not read");
              std::string error;
            };
            Result<std::vector<Row>> r = run_on_store(*s.s, [&]() -> Result<std::vector<Row>> {
              KVQ_ASSIGN_OR_RETURN(auto entries, s.s->backend->list(prefix));
              std::vector<Row> rows;
              for (auto& e : entries) {
                Row row;
                row.entry = std::move(e);
                auto bytes = s.s->backend->get(row.entry.key, verify ? UINT64_MAX : kHeaderRead);
                if (!bytes.ok()) {
                  row.error = bytes.status().message();  // e.g. evicted since the listing
                } else {
                  row.info = inspect_store_object(bytes->data(), bytes->size());
                  if (!row.info.ok())
                    row.error = row.info.status().message();
                  else if (verify && !row.info->checksum_ok)
                    row.error = "checksum mismatch";
                }
                rows.push_back(std::move(row));
              }
              // Namespace by namespace, chunks in order, blocks before tails (as `kvq store
              // ls`); what is not a kvq object last.
              std::stable_sort(rows.begin(), rows.end(), [](const Row& x, const Row& y) {
                auto order = [](const Row& row) {
                  return row.info.ok() ? std::make_tuple(false, row.info->ns.hex(), row.info->chunk,
                                                         row.info->kind)
                                       : std::make_tuple(true, std::string(), int64_t{0},
                                                         StoreObjectKind::kBlocks);
                };
                return order(x) < order(y);
              });
              return rows;
            });
            nb::list out;
            for (const Row& row : unwrap(std::move(r))) {
              nb::dict d = row.info.ok() ? info_dict(*row.info) : nb::dict();
              d["key"] = row.entry.key;
              d["size"] = row.entry.size;
              if (row.info.ok() && verify) d["checksum_ok"] = row.info->checksum_ok;
              if (!row.error.empty()) d["error"] = row.error;
              out.append(d);
            }
            return out;
          },
          "prefix"_a = "kvq1:", "verify"_a = false,
          nb::sig("def ls(self, prefix: str = 'kvq1:', verify: bool = False) -> list[dict]"),
          "`kvq store ls`: every object under `prefix`, sorted by key, as a dict: key, size and, "
          "for a kvq object whose header parses, kind ('blocks'/'tail'), chunk, token_begin, "
          "token_end, namespace, spec, model, batch, chunk_tokens, producer, ...; `error` says "
          "why a header did not parse. verify=True reads every object whole and adds "
          "checksum_ok.")
      .def(
          "stats",
          [](PyStore& s, const std::string& prefix) {
            Result<std::pair<StoreStats, std::vector<StoreEntry>>> r =
                run_on_store(*s.s, [&]() -> Result<std::pair<StoreStats, std::vector<StoreEntry>>> {
                  KVQ_ASSIGN_OR_RETURN(StoreStats st, s.s->backend->stats(prefix));
                  KVQ_ASSIGN_OR_RETURN(auto entries, s.s->backend->list(prefix));
                  return std::make_pair(std::move(st), std::move(entries));
                });
            auto [st, entries] = unwrap(std::move(r));
            // Kinds and namespaces from the keys alone ("kvq1:<ns>:<key>:b|t"), as the CLI.
            uint64_t n[3] = {0, 0, 0}, bytes[3] = {0, 0, 0};
            std::map<std::string, uint64_t> namespaces;
            const std::string kvq_prefix = store_key_prefix();
            for (const auto& e : entries) {
              const char kind =
                  e.key.size() > 2 && e.key[e.key.size() - 2] == ':' ? e.key.back() : '?';
              const int i = kind == 'b' ? 0 : kind == 't' ? 1 : 2;
              ++n[i];
              bytes[i] += e.size;
              if (e.key.rfind(kvq_prefix, 0) == 0 && i < 2 &&
                  e.key.size() >= kvq_prefix.size() + 32)
                ++namespaces[e.key.substr(kvq_prefix.size(), 32)];
            }
            nb::dict d;
            d["url"] = s.s->backend->url();
            d["prefix"] = prefix;
            d["objects"] = st.objects;
            d["bytes"] = st.bytes;
            d["blocks_objects"] = n[0];
            d["blocks_bytes"] = bytes[0];
            d["tail_objects"] = n[1];
            d["tail_bytes"] = bytes[1];
            d["other_objects"] = n[2];
            d["other_bytes"] = bytes[2];
            d["namespaces"] = namespaces.size();
            d["details"] = strings(st.details);
            return d;
          },
          "prefix"_a = "kvq1:", nb::sig("def stats(self, prefix: str = 'kvq1:') -> dict"),
          "`kvq store stats`: objects and bytes under `prefix`, by kind (blocks, tail, other), "
          "the number of namespaces, and the backend's details ('name=value': a Redis server's "
          "used_memory, maxmemory, eviction policy, evicted_keys, ...).")
      .def(
          "keys",
          [](const PyStore&, const StoreNamespace& ns, nb::handle tokens) {
            const std::vector<int32_t> ids = token_ids(tokens, ns.batch);
            const auto keys = chunk_keys(ns, ids);
            nb::list chunks;
            for (size_t i = 0; i < keys.size(); ++i) {
              nb::dict c;
              c["chunk"] = i;
              c["token_begin"] = static_cast<int64_t>(i) * ns.chunk_tokens;
              c["token_end"] = static_cast<int64_t>(i + 1) * ns.chunk_tokens;
              c["key"] = keys[i].hex();
              c["blocks_key"] = store_object_key(ns, keys[i], StoreObjectKind::kBlocks);
              c["tail_key"] = store_object_key(ns, keys[i], StoreObjectKind::kTail);
              chunks.append(c);
            }
            nb::dict d;
            d["namespace"] = ns.id().hex();
            d["descriptor"] = ns.descriptor();
            d["tokens"] = ids.size() / static_cast<size_t>(ns.batch);
            d["chunks"] = chunks;
            return d;
          },
          "namespace"_a, "tokens"_a,
          nb::sig("def keys(self, namespace: StoreNamespace, tokens: object) -> dict"),
          "`kvq store keys`: a prompt's namespace id and descriptor, and per whole chunk its "
          "token range, chunk key and object keys (computed; nothing is read from the store).")
      .def(
          "writer",
          [](const PyStore& s, uint64_t max_queued_bytes) {
            return PyWriter{
                std::make_shared<StoreWriter>(s.s->url, s.s->options, max_queued_bytes)};
          },
          "max_queued_bytes"_a = uint64_t{1} << 30,
          "A StoreWriter of this store (its own connection and thread).")
      .def("__repr__", [](const PyStore& s) { return "<kvq.Store " + s.s->backend->url() + ">"; });

  // ---- prefixes ----
  nb::class_<PrefixFetch>(m, "PrefixFetch", "What one fetch (or a session's reuse) did.")
      .def_ro("chunks", &PrefixFetch::chunks, "Chunks imported.")
      .def_ro("tokens", &PrefixFetch::tokens, "Tokens those chunks cover.")
      .def_ro("looked_up", &PrefixFetch::looked_up, "Chunks the lookup found.")
      .def_ro("bytes", &PrefixFetch::bytes, "Object bytes fetched (rejected ones included).")
      .def_ro("lookup_s", &PrefixFetch::lookup_s)
      .def_ro("fetch_s", &PrefixFetch::fetch_s)
      .def_ro("import_s", &PrefixFetch::import_s)
      .def_ro("notes", &PrefixFetch::notes,
              "Why the reuse is shorter than it could be (absent, evicted or damaged objects, an "
              "unreachable store), one line each.")
      .def("__repr__", [](const PrefixFetch& f) {
        return "<kvq.PrefixFetch " + std::to_string(f.chunks) + " chunks, " +
               std::to_string(f.tokens) + " tokens, " + std::to_string(f.bytes) + " bytes>";
      });

  nb::class_<PyPrefixStore>(m, "PrefixStore",
                            "One namespace in one store (kvq::PrefixStore): looks a prompt's "
                            "prefixes up, fetches and imports them into a ModelCache, exports "
                            "chunks. Keeps its Store alive.")
      .def(
          "__init__",
          [](PyPrefixStore* self, const PyStore& store, const StoreNamespace& ns) {
            new (self) PyPrefixStore(store.s, ns);
          },
          "store"_a, "namespace"_a)
      .def_prop_ro("namespace", [](const PyPrefixStore& p) { return p.prefix.ns(); })
      .def(
          "lookup",
          [](PyPrefixStore& p, nb::handle tokens, PyModel& c, std::optional<int64_t> max_chunks) {
            const auto keys = chunk_keys_of(p.prefix.ns(), tokens);
            const int64_t k = max_chunks.value_or(static_cast<int64_t>(keys.size()));
            if (k < 0) raise_status(invalid_argument("max_chunks must be >= 0"));
            PrefixFetch report;
            Result<int64_t> r = [&] {
              nb::gil_scoped_release release;
              std::lock_guard store_lock(p.s->mu);
              std::shared_lock cache_lock(c.mu);
              return p.prefix.lookup(keys, k, c.cache, report);
            }();
            return unwrap(std::move(r));
          },
          "tokens"_a, "cache"_a, "max_chunks"_a = nb::none(),
          "How many whole chunks of `tokens` a reuse could take (every object it needs is "
          "present; existence only), at most max_chunks. kvq.IoError when the store cannot be "
          "reached.")
      .def(
          "fetch",
          [](PyPrefixStore& p, nb::handle tokens, int64_t k, PyModel& c) {
            const auto keys = chunk_keys_of(p.prefix.ns(), tokens);
            if (k < 0 || k > static_cast<int64_t>(keys.size()))
              raise_status(out_of_range("fetch of " + std::to_string(k) +
                                        " chunks: the tokens "
                                        "have " +
                                        std::to_string(keys.size()) + " whole chunks"));
            PrefixFetch report;
            Result<int64_t> r = [&] {
              nb::gil_scoped_release release;
              std::lock_guard store_lock(p.s->mu);
              std::unique_lock cache_lock(c.mu);
              return p.prefix.fetch(keys, k, c.cache, report);
            }();
            report.chunks = unwrap(std::move(r));
            report.tokens = report.chunks * p.prefix.ns().chunk_tokens;
            return report;
          },
          "tokens"_a, "k"_a, "cache"_a,
          "Fetches, verifies and imports chunks [0, k) of `tokens` into `cache`, replacing its "
          "state. A bad, absent or unreachable object shortens the reuse (to 0: the cache is "
          "reset), with the reason in notes; never a wrong cache. Raises only for a cache that "
          "does not fit the namespace.")
      .def(
          "export_chunk",
          [](PyPrefixStore& p, PyModel& c, nb::handle tokens, int64_t i) {
            const auto keys = chunk_keys_of(p.prefix.ns(), tokens);
            Result<ChunkObjects> r = [&] {
              nb::gil_scoped_release release;
              std::shared_lock cache_lock(c.mu);
              return p.prefix.export_chunk(c.cache, keys, i);
            }();
            ChunkObjects o = unwrap(std::move(r));
            nb::dict d;
            d["chunk"] = o.chunk;
            d["blocks_key"] = o.blocks_key;
            d["blocks"] = to_bytes(o.blocks);
            d["tail_key"] = o.tail_key;
            d["tail"] = to_bytes(o.tail);
            return d;
          },
          "cache"_a, "tokens"_a, "i"_a,
          nb::sig("def export_chunk(self, cache: ModelCache, tokens: object, i: int) -> dict"),
          "The objects of chunk i of a cache holding exactly (i + 1) C tokens of `tokens`: "
          "{chunk, blocks_key, blocks, tail_key, tail} (put them with Store.put or a "
          "StoreWriter).")
      .def("__repr__", [](const PyPrefixStore& p) {
        return "<kvq.PrefixStore " + p.s->backend->url() + " " + p.prefix.ns().id().hex() + ">";
      });

  nb::class_<PyWriter>(m, "StoreWriter",
                       "Writes objects in the background (kvq::StoreWriter: a thread with its "
                       "own connection), so storing never delays the computation. After a "
                       "failure that is not about one object (the store is gone) the rest are "
                       "dropped and counted, never retried. Deleting it waits for what is "
                       "queued; close() does that without holding the GIL.")
      .def(
          "__init__",
          [](PyWriter* self, const std::string& url, std::optional<int> connect_timeout_ms,
             std::optional<int> timeout_ms, uint64_t max_queued_bytes) {
            const StoreOptions o = make_options(connect_timeout_ms, timeout_ms);
            open_shared(url, o);  // the URL is checked here, not in the background
            new (self) PyWriter{std::make_shared<StoreWriter>(url, o, max_queued_bytes)};
          },
          "url"_a, "connect_timeout_ms"_a = nb::none(), "timeout_ms"_a = nb::none(),
          "max_queued_bytes"_a = uint64_t{1} << 30,
          "A writer to the store at `url`; max_queued_bytes bounds the memory of objects "
          "waiting (beyond it, put() waits).")
      .def(
          "put",
          [](PyWriter& w, std::string key, nb::handle data) {
            if (!w.writer) raise_status(invalid_argument("the StoreWriter is closed"));
            Buffer buf(data);
            std::vector<uint8_t> value(buf.data(), buf.data() + buf.size());
            nb::gil_scoped_release release;
            w.writer->put(std::move(key), std::move(value));
          },
          "key"_a, "data"_a, "Queues a value (copied) for the writer.")
      .def(
          "flush",
          [](PyWriter& w) {
            if (!w.writer) raise_status(invalid_argument("the StoreWriter is closed"));
            StoreWriter::Report r = [&] {
              nb::gil_scoped_release release;
              return w.writer->flush();
            }();
            nb::dict d;
            d["objects"] = r.objects;
            d["bytes"] = r.bytes;
            d["failed"] = r.failed;
            d["errors"] = strings(r.errors);
            d["busy_s"] = r.busy_s;
            return d;
          },
          nb::sig("def flush(self) -> dict"),
          "Waits until every queued object is written or dropped; returns the totals so far: "
          "objects and bytes written, failed (errors, or dropped after a store failure), the "
          "first few errors, busy_s.")
      .def(
          "close",
          [](PyWriter& w) {
            std::shared_ptr<StoreWriter> gone = std::move(w.writer);
            nb::gil_scoped_release release;
            if (gone) gone->flush();
            gone.reset();
          },
          "Flushes and releases the writer (idempotent); its thread stops once no session "
          "stores through it.");

  nb::class_<PySession>(m, "PrefixSession",
                        "One prompt's prefill against stores (kvq::PrefixSession), for one or "
                        "several caches fed the same tokens:\n\n"
                        "    s = kvq.PrefixSession([(cache, prefix_store)], tokens, writer)\n"
                        "    p = s.reuse(n - 1)                    # tokens imported\n"
                        "    while p < n:\n"
                        "        e = s.piece_end(p, max_piece, n)  # pieces end at boundaries\n"
                        "        ... compute tokens [p, e) into every cache ...\n"
                        "        s.reached(p := e)                 # stores completed chunks\n\n"
                        "Never fails on a store: a miss, a damaged object or an unreachable "
                        "server is a shorter reuse (or none), noted in notes.")
      .def("__init__", &init_session, "bindings"_a, "tokens"_a, "writer"_a = nb::none(),
           nb::sig("def __init__(self, bindings: list[tuple[ModelCache, PrefixStore]], "
                   "tokens: object, writer: StoreWriter | None = None) -> None"),
           "`bindings`: (ModelCache, PrefixStore) pairs whose namespaces have the same chunk "
           "size and batch; `tokens`: the prompt's ids, [n] or [batch, n]; `writer`: where "
           "completed chunks are stored (None: nothing is stored).")
      .def_prop_ro("chunk_tokens", [](PySession& s) { return s.session->chunk_tokens(); })
      .def(
          "reuse",
          [](PySession& s, int64_t max_tokens) {
            return run_session(s, true, [&] { return s.session->reuse(max_tokens); });
          },
          "max_tokens"_a,
          "Resets every cache and imports the longest prefix of whole chunks that every store "
          "holds, at most max_tokens tokens (pass n - 1: the last token must be computed for "
          "its logits). Returns the tokens imported (0: the caches are empty).")
      .def(
          "piece_end",
          [](PySession& s, int64_t offset, int64_t max_piece, int64_t end) {
            return s.session->piece_end(offset, max_piece, end);
          },
          "offset"_a, "max_piece"_a, "end"_a,
          "The end of the next piece to compute from `offset`: at most max_piece tokens, at "
          "most `end`, never past the next chunk boundary.")
      .def(
          "reached",
          [](PySession& s, int64_t offset) {
            run_session(s, false, [&] { s.session->reached(offset); });
          },
          "offset"_a,
          "Every cache now holds `offset` tokens: exports each chunk that ends there and was "
          "not reused, and queues it for the writer. Failures are noted, never raised.")
      .def_prop_ro(
          "fetches",
          [](PySession& s) { return run_session(s, false, [&] { return s.session->fetches(); }); },
          "The last reuse per binding (chunks and tokens: the common ones).")
      .def_prop_ro("reused_tokens",
                   [](PySession& s) {
                     return run_session(s, false, [&] { return s.session->reused_tokens(); });
                   })
      .def_prop_ro("exported_chunks",
                   [](PySession& s) {
                     return run_session(s, false, [&] { return s.session->exported_chunks(); });
                   })
      .def_prop_ro("exported_bytes",
                   [](PySession& s) {
                     return run_session(s, false, [&] { return s.session->exported_bytes(); });
                   })
      .def_prop_ro(
          "export_s",
          [](PySession& s) { return run_session(s, false, [&] { return s.session->export_s(); }); })
      .def_prop_ro(
          "notes",
          [](PySession& s) { return run_session(s, false, [&] { return s.session->notes(); }); },
          "Every note of the fetches and exports, in order.");
}

}  // namespace kvq
