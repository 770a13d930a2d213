// --store and --store-chunk: what the commands that run a model (generate, ppl) need to reuse
// prompt prefixes from a store and to fill it (include/kvq/store.h).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "args.h"
#include "kvq/store.h"

namespace kvq::cli {

// What computed the K/V the CLI stores: kvq's engine and the version of its numerics. Bump it
// when the engine's arithmetic changes, so stores written before are never mixed in.
inline constexpr const char* kEngineProducer = "kvq-engine/1";

// --store URL and --store-chunk N, for a command's options.
std::vector<Option> store_options();

// One run's store: a backend for lookups and fetches, a writer (its own connection, in the
// background) for the chunks the run computes, and the model's fingerprint.
struct StoreRun {
  std::string url;
  std::unique_ptr<StoreBackend> backend;
  std::unique_ptr<StoreWriter> writer;
  Hash128 model;
  int64_t chunk = kDefaultStoreChunkTokens;
  double fingerprint_s = 0;
  // What the run's sessions did, summed.
  int64_t prompts = 0, tokens = 0, reused = 0, chunks_fetched = 0, chunks_exported = 0;
  uint64_t bytes_fetched = 0, bytes_exported = 0;
  double lookup_s = 0, fetch_s = 0, import_s = 0, export_s = 0;
  std::vector<std::string> notes;

  // The namespace of `cache` in this store (kInvalidArgument for a chunk size its blocks do not
  // divide).
  Result<PrefixStore> prefix_store(const ModelCache& cache) const;
  // Adds a finished session's figures; `tokens` is what the session could have reused from.
  void add(const PrefixSession& s, int64_t tokens);
  // Waits for the writer and prints every note (misses and failures: always) and a summary
  // line (unless `quiet`) on stderr, each starting with "kvq <command>: store: ".
  void report(const std::string& command, bool quiet);
};

// The run's store, or null when --store is not given. Fingerprints the model's files.
Result<std::unique_ptr<StoreRun>> open_store_run(const ParsedArgs& args);

}  // namespace kvq::cli
