#include "store_args.h"

#include <chrono>
#include <cstdio>

#include "model_args.h"

namespace kvq::cli {

std::vector<Option> store_options() {
  return {option("store", "URL",
                 "reuse prompt prefixes from this store and store new ones: dir:PATH, "
                 "redis://HOST:PORT, redis-cluster://HOST:PORT,... (docs/store.md)"),
          option("store-chunk", "N",
                 "tokens per stored chunk (a multiple of every layer's block length)")
              .defaults_to(std::to_string(kDefaultStoreChunkTokens))};
}

Result<std::unique_ptr<StoreRun>> open_store_run(const ParsedArgs& args) {
  auto url = args.get("store");
  if (!url) return std::unique_ptr<StoreRun>();
  KVQ_ASSIGN_OR_RETURN(long long chunk, args.get_int("store-chunk"));
  auto run = std::make_unique<StoreRun>();
  run->url = *url;
  run->chunk = chunk;
  auto backend = open_store(*url);
  if (!backend.ok()) return backend.status().with_context("--store");
  run->backend = std::move(backend).value();
  run->writer = std::make_unique<StoreWriter>(*url);
  KVQ_ASSIGN_OR_RETURN(auto files, model_files_from_args(args));
  const auto t0 = std::chrono::steady_clock::now();
  KVQ_ASSIGN_OR_RETURN(run->model, fingerprint_files(files));
  run->fingerprint_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return run;
}

Result<PrefixStore> StoreRun::prefix_store(const ModelCache& cache) const {
  auto ns = make_store_namespace(cache, model, chunk, kEngineProducer);
  if (!ns.ok()) return ns.status().with_context("--store-chunk");
  return PrefixStore(backend.get(), std::move(ns).value());
}

void StoreRun::add(const PrefixSession& s, int64_t n) {
  ++prompts;
  tokens += n;
  reused += s.reused_tokens();
  chunks_fetched += s.reused_tokens() / s.chunk_tokens();
  chunks_exported += s.exported_chunks();
  bytes_exported += s.exported_bytes();
  export_s += s.export_s();
  for (const PrefixFetch& f : s.fetches()) {
    bytes_fetched += f.bytes;
    lookup_s += f.lookup_s;
    fetch_s += f.fetch_s;
    import_s += f.import_s;
  }
  for (auto& note : s.notes()) notes.push_back(std::move(note));
}

void StoreRun::report(const std::string& command, bool quiet) {
  const StoreWriter::Report w = writer->flush();
  const std::string p = "kvq " + command + ": store: ";
  for (const auto& n : notes) std::fprintf(stderr, "%s%s\n", p.c_str(), n.c_str());
  for (const auto& e : w.errors) std::fprintf(stderr, "%snot stored: %s\n", p.c_str(), e.c_str());
  if (quiet) return;
  std::fprintf(stderr,
               "%s%s: reused %lld of %lld tokens (%lld chunks of %lld; fetched %.2f MB: lookup "
               "%.3f s, fetch %.3f s, import %.3f s); stored %lld chunks (%.2f MB, export %.3f s, "
               "written %.3f s in the background, %llu failed); model fingerprint %.3f s\n",
               p.c_str(), url.c_str(), static_cast<long long>(reused),
               static_cast<long long>(tokens), static_cast<long long>(chunks_fetched),
               static_cast<long long>(chunk), static_cast<double>(bytes_fetched) / 1e6, lookup_s,
               fetch_s, import_s, static_cast<long long>(chunks_exported),
               static_cast<double>(bytes_exported) / 1e6, export_s, w.busy_s,
               static_cast<unsigned long long>(w.failed), fingerprint_s);
}

}  // namespace kvq::cli
