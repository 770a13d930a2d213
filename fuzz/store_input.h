// The store fuzz target's fixed world (shared with the test that writes its seeds): a small
// kivi cache, its namespace and prompt keys, the valid objects of its chunk 0, and how fuzz
// bytes become an object. The input is [kind byte][layer sections]; the harness adds the
// header, the descriptor and the checksum of a real chunk 0, so that mutations reach the
// section parser and the import instead of stopping at the checksum.
#pragma once

#include <xxhash.h>

#include <cstring>
#include <vector>

#include "kvq/store.h"
#include "store/objects.h"

namespace kvq::fuzz {

inline constexpr const char* kStoreSpec = "kivi:k_bits=2,v_bits=2,group=4,residual=4";
inline constexpr int64_t kStoreChunk = 8;

inline ModelShape store_shape() { return ModelShape::uniform(2, 2, 8, 2); }

struct StoreWorld {
  StoreNamespace ns;
  std::vector<Hash128> keys;
  ChunkObjects chunk0;  // the valid objects of chunk 0
};

// Built once: 9 tokens of a deterministic cache, chunk 0 exported.
inline const StoreWorld& store_world() {
  static const StoreWorld w = [] {
    StoreWorld s;
    auto c = ModelCache::create(kStoreSpec, store_shape()).value();
    s.ns = make_store_namespace(c, hash128("fuzz", 4), kStoreChunk, "fuzz/1").value();
    std::vector<int32_t> tokens(9);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(7 * i + 1);
    s.keys = chunk_keys(s.ns, tokens);
    std::vector<float> k(2 * kStoreChunk * 8), v(k.size());
    for (size_t i = 0; i < k.size(); ++i) {
      k[i] = static_cast<float>((i * 37) % 17) * 0.25f - 2.0f;
      v[i] = static_cast<float>((i * 11) % 13) * 0.5f - 3.0f;
    }
    for (int l = 0; l < 2; ++l) {
      const auto kt = TensorView::bhsd(k.data(), DType::kF32, 1, 2, kStoreChunk, 8);
      const auto vt = TensorView::bhsd(v.data(), DType::kF32, 1, 2, kStoreChunk, 8);
      (void)c.layer(l).append(kt, vt);
    }
    PrefixStore ps(nullptr, s.ns);
    s.chunk0 = ps.export_chunk(c, s.keys, 0).value();
    return s;
  }();
  return w;
}

// The fuzz input of a valid object: its kind, then its sections.
inline std::vector<uint8_t> store_input_of(const std::vector<uint8_t>& object) {
  const auto info = inspect_store_object(object.data(), object.size()).value();
  const size_t begin = store::kObjectHeaderBytes + 4 + info.descriptor.size();
  std::vector<uint8_t> in(1 + object.size() - 8 - begin);
  in[0] = static_cast<uint8_t>(info.kind);
  std::memcpy(in.data() + 1, object.data() + begin, in.size() - 1);
  return in;
}

// The object a fuzz input stands for: chunk 0's header and descriptor (kind from the first
// byte), the sections, a checksum that matches.
inline std::vector<uint8_t> store_object_of(const uint8_t* data, size_t size) {
  const StoreWorld& w = store_world();
  const bool tail = size > 0 && (data[0] & 1) == 0;
  std::vector<uint8_t> o = tail ? w.chunk0.tail : w.chunk0.blocks;
  const auto info = inspect_store_object(o.data(), o.size()).value();
  o.resize(store::kObjectHeaderBytes + 4 + info.descriptor.size());
  if (size > 1) o.insert(o.end(), data + 1, data + size);
  const uint64_t total = o.size() + 8;
  std::memcpy(o.data() + 56, &total, 8);
  const uint64_t sum = XXH64(o.data(), o.size(), 0);
  o.resize(o.size() + 8);
  std::memcpy(o.data() + o.size() - 8, &sum, 8);
  return o;
}

}  // namespace kvq::fuzz
