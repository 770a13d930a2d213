// Fuzz target: the store's object reader and import (docs/store.md §3) on arbitrary sections.
//
// The input becomes chunk 0's blocks or tail object (store_input.h: real header, descriptor
// and checksum around fuzzed sections), stored beside chunk 0's valid other object in an
// in-memory store, then fetched into a cache; the raw input is also read as an object header.
// Every step must return, never crash. Properties: a fetch imports 0 or 1 chunk and leaves the
// cache at that offset; a chunk that imports re-exports to exactly the objects it came from
// (an object has one encoding).
#include <map>

#include "fuzz_util.h"
#include "store_input.h"

namespace {

// The store the fetch reads: a map (this is a fuzz harness, not a test of any backend).
class MemoryStore final : public kvq::StoreBackend {
 public:
  std::string url() const override { return "memory:"; }
  kvq::Result<std::vector<uint8_t>> get(const std::string& key, uint64_t) override {
    auto it = m_.find(key);
    if (it == m_.end()) return kvq::not_found(key);
    return it->second;
  }
  kvq::Status put(const std::string& key, std::span<const uint8_t> v) override {
    m_[key].assign(v.begin(), v.end());
    return kvq::ok_status();
  }
  kvq::Result<bool> exists(const std::string& key) override { return m_.count(key) > 0; }
  kvq::Status remove(const std::string& key) override {
    m_.erase(key);
    return kvq::ok_status();
  }
  kvq::Result<std::vector<kvq::StoreEntry>> list(const std::string&) override {
    return std::vector<kvq::StoreEntry>();
  }
  kvq::Result<kvq::StoreStats> stats(const std::string&) override { return kvq::StoreStats(); }

 private:
  std::map<std::string, std::vector<uint8_t>> m_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvq;
  const fuzz::StoreWorld& w = fuzz::store_world();
  auto cache = ModelCache::create(fuzz::kStoreSpec, fuzz::store_shape()).value();
  (void)inspect_store_object(data, size);

  const std::vector<uint8_t> object = fuzz::store_object_of(data, size);
  const bool tail = size > 0 && (data[0] & 1) == 0;
  MemoryStore store;
  (void)store.put(tail ? w.chunk0.tail_key : w.chunk0.blocks_key, object);
  (void)store.put(tail ? w.chunk0.blocks_key : w.chunk0.tail_key,
                  tail ? w.chunk0.blocks : w.chunk0.tail);
  PrefixStore ps(&store, w.ns);
  PrefixFetch report;
  auto got = ps.fetch(w.keys, 1, cache, report);
  KVQ_FUZZ_CHECK(got.ok());
  KVQ_FUZZ_CHECK(*got == 0 || *got == 1);
  KVQ_FUZZ_CHECK(cache.offset() == *got * fuzz::kStoreChunk);
  if (*got == 1) {
    auto again = ps.export_chunk(cache, w.keys, 0);
    KVQ_FUZZ_CHECK(again.ok());
    KVQ_FUZZ_CHECK(again->blocks == (tail ? w.chunk0.blocks : object));
    KVQ_FUZZ_CHECK(again->tail == (tail ? object : w.chunk0.tail));
  }
  return 0;
}
