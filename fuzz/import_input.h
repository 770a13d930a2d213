// The input format of fuzz/import_fuzz.cc, shared with the seed generator
// (tests/fuzz_seeds_test.cc) so that seeds are real exports of every method.
//
//   u8  method id (MethodDef::id, stable whatever the table's order; an unknown id is ignored);
//       the spec is the method's defaults with its test settings (small blocks, test_spec())
//   u8  flags: bit 0 = bf16 window, bit 1 = the method's 8-bit window rows (window=q8) where it
//       has them
//   u8  n_kv_heads - 1 (mod 2), u8 head_dim - 1 (mod 64), u8 query heads per KV head - 1 (mod 2)
//   u8  batch - 1 (mod 3)
//   per layer (2 layers): varint offset, varint n_chunks (mod 64), then n_chunks x
//       { u8 kind (mod 5), varint t0, varint tokens, varint size, size bytes }
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "kvq/spec.h"

namespace kvq::fuzz {

inline constexpr int kImportLayers = 2;

// A method's spec with small windows and blocks, so that small inputs hold sealed blocks; with
// q8_window, its window=q8 (methods without the parameter keep their 16-bit rows).
inline Spec fuzz_spec(const MethodDef& m, bool q8_window = false) {
  Spec s = test_spec(m);
  if (q8_window) (void)s.set("window", "q8");
  return s;
}

struct ImportHeader {
  uint32_t method = 0;  // MethodDef::id
  bool bf16 = false, q8_window = false;
  int heads = 1, dim = 1, q_per_kv = 1, batch = 1;
  // With RoPE, for methods that quantize keys before it (dim must be even for them).
  ModelShape shape() const {
    return ModelShape::uniform(kImportLayers, heads, dim, heads * q_per_kv,
                               RopeShape{RopeShape::Mode::kAdjacent, 10000.0, 1.0});
  }
};

inline void put_varint(std::vector<uint8_t>& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<uint8_t>(v | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<uint8_t>(v));
}

// Encodes a header and each layer's (offset, chunks) as an import_fuzz input.
struct ImportLayerInput {
  int64_t offset = 0;
  std::vector<ChunkRef> chunks;
};
inline std::vector<uint8_t> encode_import_input(const ImportHeader& h,
                                                const std::vector<ImportLayerInput>& layers) {
  std::vector<uint8_t> out = {
      static_cast<uint8_t>(h.method),
      static_cast<uint8_t>((h.bf16 ? 1 : 0) | (h.q8_window ? 2 : 0)),
      static_cast<uint8_t>(h.heads - 1),    static_cast<uint8_t>(h.dim - 1),
      static_cast<uint8_t>(h.q_per_kv - 1), static_cast<uint8_t>(h.batch - 1)};
  for (const auto& l : layers) {
    put_varint(out, static_cast<uint64_t>(l.offset));
    put_varint(out, l.chunks.size());
    for (const auto& c : l.chunks) {
      out.push_back(static_cast<uint8_t>(c.kind));
      put_varint(out, static_cast<uint64_t>(c.t0));
      put_varint(out, static_cast<uint64_t>(c.tokens));
      put_varint(out, c.size);
      out.insert(out.end(), c.data, c.data + c.size);
    }
  }
  return out;
}

}  // namespace kvq::fuzz
