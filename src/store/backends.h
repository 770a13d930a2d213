// The store's backends (include/kvq/store.h: StoreBackend), opened by open_store().
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kvq/store.h"

namespace kvq::store {

// dir:PATH — one file per key in PATH, written to a temporary file and renamed into place.
Result<std::unique_ptr<StoreBackend>> open_dir_store(const std::string& path);

// redis://HOST:PORT[/DB] and redis-cluster://HOST:PORT,...: `nodes` are the server or the
// cluster's seed nodes.
struct RedisAddress {
  std::string host;
  int port = 0;
};
std::unique_ptr<StoreBackend> open_redis_store(std::vector<RedisAddress> nodes, bool cluster,
                                               int db, const StoreOptions& options);

// Redis Cluster's hash slot of a key: CRC16 (XMODEM) of the key, or of its hash tag (the text
// between the first '{' and the next '}', when not empty), modulo 16384.
uint16_t redis_key_slot(std::string_view key);

// Sorts a listing by key, keeps each key once (a cluster's SCAN may repeat one), and returns
// it with its totals (StoreStats without details), for list() and stats() of every backend.
StoreStats sort_listing(std::vector<StoreEntry>& entries);

// Whether a key is one a directory store can hold (its file name): 1..200 characters of
// [A-Za-z0-9._:-], not starting with '.'.
bool valid_dir_key(std::string_view key);

}  // namespace kvq::store
