// The store's objects (docs/store.md §3): a blocks object and a tail object per chunk, each a
// framed binary record — a 64-byte header (magic, version, kind, namespace, chunk key and
// index, layer count, size), the namespace's descriptor, one section per layer, and an XXH64 of
// everything before it. Writers build them from a cache's exported chunks; readers check every
// byte before a cache's import sees any.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "kvq/store.h"

namespace kvq::store {

inline constexpr size_t kObjectHeaderBytes = 64;
inline constexpr size_t kObjectChecksumBytes = 8;
inline constexpr uint16_t kObjectMajor = 1, kObjectMinor = 0;
inline constexpr uint8_t kObjectMagic[8] = {0x89, 'K', 'V', 'S', '\r', '\n', 0x1a, '\n'};
// The longest descriptor an object may carry, and the largest object a reader accepts.
inline constexpr uint32_t kMaxDescriptorBytes = 65536;
inline constexpr uint64_t kMaxObjectBytes = uint64_t{1} << 36;

// ---- writing ----

// One layer's sealed blocks [first_block, first_block + keys.size()).
struct BlocksSection {
  int64_t first_block = 0;
  std::vector<std::vector<uint8_t>> keys, values;  // one entry per block: its two parts
};

// One layer's tail: window rows [rows_t0, rows_t0 + rows_n) ([B, H, rows_n] rows of the layer's
// window format each) and the method state at the chunk's end.
struct TailSection {
  DType dtype = DType::kF16;
  WindowFormat format = WindowFormat::k16Bit;
  int64_t rows_t0 = 0, rows_n = 0;
  std::vector<uint8_t> keys, values, state;
};

std::vector<uint8_t> encode_blocks_object(const StoreNamespace& ns, const Hash128& key,
                                          int64_t chunk, const std::vector<BlocksSection>& layers);
std::vector<uint8_t> encode_tail_object(const StoreNamespace& ns, const Hash128& key, int64_t chunk,
                                        const std::vector<TailSection>& layers);

// ---- reading ----

struct Bytes {
  const uint8_t* data = nullptr;
  size_t size = 0;
};
struct BlocksView {
  int64_t first_block = 0;
  std::vector<Bytes> keys, values;
};
struct TailView {
  DType dtype = DType::kF16;
  WindowFormat format = WindowFormat::k16Bit;
  int64_t rows_t0 = 0, rows_n = 0;
  Bytes keys, values, state;
};

// A verified object: the bytes it was parsed from and views into them.
struct StoreObject {
  StoreObjectInfo info;
  std::vector<uint8_t> bytes;
  std::vector<BlocksView> blocks;  // kBlocks: one per layer
  std::vector<TailView> tails;     // kTail: one per layer
};

// What the reader expects: the object of chunk `chunk` with key `key` in namespace `ns`, for
// `cache`'s layers (their shapes bound the window sections' sizes).
struct ObjectExpectation {
  const StoreNamespace* ns = nullptr;
  StoreObjectKind kind = StoreObjectKind::kBlocks;
  Hash128 key;
  int64_t chunk = 0;
  const ModelCache* cache = nullptr;
};

// Parses and verifies an object (checksum, header against `want`, descriptor, every section's
// sizes). kFormat, kUnsupported or kCorrupt with what is wrong.
Result<StoreObject> parse_store_object(std::vector<uint8_t> bytes, const ObjectExpectation& want);

}  // namespace kvq::store
