// kvq store ls|stats|get|put|rm|keys — inspecting a prefix store (docs/store.md): what it holds,
// raw objects in and out, and the keys a prompt has (to compare two instances that should agree).
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <tuple>

#include "commands.h"
#include "core/file_io.h"
#include "core/json.h"
#include "kvq/spec.h"
#include "kvq/store.h"
#include "model_args.h"
#include "store_args.h"

namespace kvq::cli {

namespace {

// An object's header and its namespace's text are in its first bytes; this reads enough for
// any descriptor a writer produces.
constexpr uint64_t kHeaderRead = 1024;

Option store_url_option() {
  return option("store", "URL", "the store: dir:PATH, redis://HOST:PORT, redis-cluster://...")
      .required();
}

Result<std::unique_ptr<StoreBackend>> open_from(const ParsedArgs& a) {
  auto b = open_store(*a.get("store"));
  if (!b.ok()) return b.status().with_context("--store");
  return b;
}

struct Listed {
  StoreEntry entry;
  bool known = false;  // a kvq object whose header parsed
  StoreObjectInfo info;
  std::string error;  // why the header did not parse
};

Status run_ls(const ParsedArgs& a) {
  KVQ_ASSIGN_OR_RETURN(auto b, open_from(a));
  KVQ_ASSIGN_OR_RETURN(auto entries, b->list(a.get_or("prefix", store_key_prefix())));
  const bool verify = a.has("verify");
  std::vector<Listed> rows;
  for (auto& e : entries) {
    Listed r;
    r.entry = e;
    auto bytes = b->get(e.key, verify ? UINT64_MAX : kHeaderRead);
    if (!bytes.ok()) {
      r.error = bytes.status().message();  // e.g. evicted since the listing
    } else {
      auto info = inspect_store_object(bytes->data(), bytes->size());
      r.known = info.ok();
      if (info.ok()) r.info = *info;
      if (!info.ok()) r.error = info.status().message();
      if (info.ok() && verify && !info->checksum_ok) r.error = "checksum mismatch";
    }
    rows.push_back(std::move(r));
  }
  // Namespace by namespace, chunks in order, blocks before tails.
  std::stable_sort(rows.begin(), rows.end(), [](const Listed& x, const Listed& y) {
    return std::make_tuple(!x.known, x.info.ns.hex(), x.info.chunk, x.info.kind) <
           std::make_tuple(!y.known, y.info.ns.hex(), y.info.chunk, y.info.kind);
  });
  if (a.has("json")) {
    json::Value out = json::Value::array();
    for (const Listed& r : rows) {
      json::Value j = json::Value::object();
      j.set("key", json::Value::string(r.entry.key));
      j.set("size", json::Value::number(static_cast<double>(r.entry.size)));
      if (r.known) {
        const auto f = descriptor_fields(r.info.descriptor);
        const double C = static_cast<double>(descriptor_int(f, "chunk"));
        j.set("kind", json::Value::string(store_object_kind_name(r.info.kind)));
        j.set("chunk", json::Value::number(static_cast<double>(r.info.chunk)));
        j.set("token_begin", json::Value::number(static_cast<double>(r.info.chunk) * C));
        j.set("token_end", json::Value::number(static_cast<double>(r.info.chunk + 1) * C));
        j.set("namespace", json::Value::string(r.info.ns.hex()));
        for (const char* k : {"spec", "model", "batch", "producer"})
          j.set(k, json::Value::string(f.count(k) ? f.at(k) : ""));
        if (verify) j.set("checksum_ok", json::Value::boolean(r.info.checksum_ok));
      }
      if (!r.error.empty()) j.set("error", json::Value::string(r.error));
      out.push(std::move(j));
    }
    std::printf("%s\n", out.dump(2).c_str());
    return ok_status();
  }
  std::string ns;
  for (const Listed& r : rows) {
    if (r.known && r.info.ns.hex() != ns) {
      ns = r.info.ns.hex();
      auto f = descriptor_fields(r.info.descriptor);
      std::printf("namespace %s: %s, model %s, batch %s, chunk %s tokens, producer %s\n",
                  ns.c_str(), f["spec"].c_str(), f["model"].c_str(), f["batch"].c_str(),
                  f["chunk"].c_str(), f["producer"].c_str());
    }
    if (!r.known) {
      std::printf("  %10llu B  %s  (%s)\n", static_cast<unsigned long long>(r.entry.size),
                  r.entry.key.c_str(), r.error.c_str());
      continue;
    }
    const long long C = descriptor_int(descriptor_fields(r.info.descriptor), "chunk");
    std::printf("  chunk %5lld  tokens %7lld..%-7lld %-6s %10llu B  %s%s\n",
                static_cast<long long>(r.info.chunk), r.info.chunk * C, (r.info.chunk + 1) * C,
                store_object_kind_name(r.info.kind), static_cast<unsigned long long>(r.entry.size),
                r.entry.key.c_str(), r.error.empty() ? "" : ("  (" + r.error + ")").c_str());
  }
  std::printf("%zu objects\n", rows.size());
  return ok_status();
}

Status run_stats(const ParsedArgs& a) {
  KVQ_ASSIGN_OR_RETURN(auto b, open_from(a));
  const std::string prefix = a.get_or("prefix", store_key_prefix());
  KVQ_ASSIGN_OR_RETURN(StoreStats s, b->stats(prefix));
  KVQ_ASSIGN_OR_RETURN(auto entries, b->list(prefix));
  // Kinds and namespaces from the keys alone ("kvq1:<ns>:<key>:b|t"): no object is read.
  uint64_t n[3] = {0, 0, 0}, bytes[3] = {0, 0, 0};
  std::map<std::string, uint64_t> namespaces;
  for (const auto& e : entries) {
    const char kind = e.key.size() > 2 && e.key[e.key.size() - 2] == ':' ? e.key.back() : '?';
    const int i = kind == 'b' ? 0 : kind == 't' ? 1 : 2;
    ++n[i];
    bytes[i] += e.size;
    if (e.key.rfind(store_key_prefix(), 0) == 0 && i < 2)
      ++namespaces[e.key.substr(store_key_prefix().size(), 32)];
  }
  std::printf(
      "%s: %llu objects, %llu bytes under '%s' (blocks %llu objects %llu bytes; tails "
      "%llu objects %llu bytes; other %llu objects %llu bytes); %zu namespaces\n",
      b->url().c_str(), static_cast<unsigned long long>(s.objects),
      static_cast<unsigned long long>(s.bytes), prefix.c_str(),
      static_cast<unsigned long long>(n[0]), static_cast<unsigned long long>(bytes[0]),
      static_cast<unsigned long long>(n[1]), static_cast<unsigned long long>(bytes[1]),
      static_cast<unsigned long long>(n[2]), static_cast<unsigned long long>(bytes[2]),
      namespaces.size());
  for (const auto& d : s.details) std::printf("  %s\n", d.c_str());
  return ok_status();
}

Status run_get(const ParsedArgs& a) {
  KVQ_ASSIGN_OR_RETURN(auto b, open_from(a));
  const std::string& key = a.positionals()[0];
  KVQ_ASSIGN_OR_RETURN(auto value, b->get(key));
  const std::string out = *a.get("output");
  if (out == "-") {
    if (std::fwrite(value.data(), 1, value.size(), stdout) != value.size())
      return io_error("cannot write to standard output");
    return ok_status();
  }
  return write_file_atomic(out, value.data(), value.size());
}

Status run_put(const ParsedArgs& a) {
  KVQ_ASSIGN_OR_RETURN(auto b, open_from(a));
  KVQ_ASSIGN_OR_RETURN(auto value, read_file(a.positionals()[1]));
  return b->put(a.positionals()[0], value);
}

Status run_rm(const ParsedArgs& a) {
  KVQ_ASSIGN_OR_RETURN(auto b, open_from(a));
  const std::string& key = a.positionals()[0];
  if (!a.has("prefix")) return b->remove(key);
  if (key.empty()) return invalid_argument("rm --prefix needs a non-empty prefix");
  KVQ_ASSIGN_OR_RETURN(auto entries, b->list(key));
  for (const auto& e : entries) KVQ_RETURN_IF_ERROR(b->remove(e.key));
  std::printf("removed %zu keys\n", entries.size());
  return ok_status();
}

Status run_keys(const ParsedArgs& a) {
  auto spec = parse_model_spec(*a.get("method"));
  if (!spec.ok()) return spec.status();
  KVQ_ASSIGN_OR_RETURN(std::string prompt, prompt_from_args(a));
  KVQ_ASSIGN_OR_RETURN(auto files, model_files_from_args(a));
  KVQ_ASSIGN_OR_RETURN(model::LlamaModel m, load_model_from_args(a, /*need_tokenizer=*/true));
  KVQ_ASSIGN_OR_RETURN(std::vector<int32_t> ids, encode_prompt(a, *m.tokenizer(), prompt));
  KVQ_ASSIGN_OR_RETURN(ModelCache cache, ModelCache::create(spec->to_string(), m.cache_shape()));
  KVQ_ASSIGN_OR_RETURN(Hash128 model, fingerprint_files(files));
  KVQ_ASSIGN_OR_RETURN(long long chunk, a.get_int("store-chunk"));
  auto ns = make_store_namespace(cache, model, chunk, kEngineProducer);
  if (!ns.ok()) return ns.status().with_context("--store-chunk");
  std::printf("namespace %s\n%s", ns->id().hex().c_str(), ns->descriptor().c_str());
  const auto keys = chunk_keys(*ns, ids);
  std::printf("%zu tokens, %zu whole chunks\n", ids.size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i)
    std::printf("chunk %zu tokens %lld..%lld %s %s\n", i, static_cast<long long>(i) * chunk,
                static_cast<long long>(i + 1) * chunk,
                store_object_key(*ns, keys[i], StoreObjectKind::kBlocks).c_str(),
                store_object_key(*ns, keys[i], StoreObjectKind::kTail).c_str());
  return ok_status();
}

}  // namespace

Command store_command() {
  Command g("store", "inspect a prefix store: ls, stats, get, put, rm, keys", "<command>", nullptr);
  g.description =
      "A store holds the compressed K/V of prompt prefixes in chunks (kvq generate and kvq ppl\n"
      "fill and reuse it with --store URL; docs/store.md).";
  const Option prefix = option("prefix", "P", "only keys starting with P").defaults_to("kvq1:");

  Command ls("ls", "list the objects with their sizes and what they hold", "--store URL", run_ls);
  ls.options = {store_url_option(), prefix,
                flag("verify", "read every object whole and check its checksum"),
                flag("json", "print a JSON array")};
  Command stats("stats", "count the objects and bytes (and the servers' memory)", "--store URL",
                run_stats);
  stats.options = {store_url_option(), prefix};
  Command get("get", "write one object's bytes to a file", "--store URL KEY -o FILE", run_get);
  get.options = {store_url_option(),
                 option("output", "FILE", "where to write them, - for standard output")
                     .short_form('o')
                     .required()};
  get.positionals = {{"KEY", "the object's key (kvq store ls lists them)"}};
  Command put("put", "store a file's bytes under a key", "--store URL KEY FILE", run_put);
  put.options = {store_url_option()};
  put.positionals = {{"KEY", "the key"}, {"FILE", "the file whose bytes to store"}};
  Command rm("rm", "remove a key (or, with --prefix, every key starting with it)",
             "--store URL [--prefix] KEY", run_rm);
  rm.options = {store_url_option(), flag("prefix", "KEY is a prefix: remove every key under it")};
  rm.positionals = {{"KEY", "the key or prefix"}};
  Command keys("keys", "print the namespace and chunk keys of a prompt (no store needed)",
               "[--model PATH] (--prompt TEXT | --prompt-file PATH) [--method SPEC]", run_keys);
  keys.options =
      with_model_options({option("method", "SPEC", "cache method spec").defaults_to("fp16")});
  for (auto* more : {&prompt_options, &store_options})
    for (Option& o : (*more)())
      if (o.name != "store") keys.options.push_back(std::move(o));
  g.subcommands = {ls, stats, get, put, rm, keys};
  return g;
}

}  // namespace kvq::cli
