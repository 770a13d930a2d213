// Fuzz target: LayerCache::import_chunks of every method in the table (the method-level half of
// reading a .kvq file: block layouts, window and state chunks) on arbitrary chunk lists. The
// input format is in import_input.h; seeds are real exports.
//
// Properties of an accepted import: the layer exports exactly the chunks it was given, its
// accounting equals its measured resident bytes, and it can be read, attended, trimmed and
// appended to without fault.
#include <cmath>
#include <vector>

#include "fuzz_util.h"
#include "import_input.h"

namespace {

using namespace kvq;

struct Stored {
  ChunkKind kind;
  int64_t t0, tokens;
  std::vector<uint8_t> bytes;
};

class StoreSink final : public ChunkSink {
 public:
  Status put(const ChunkRef& c) override {
    got.push_back({c.kind, c.t0, c.tokens, std::vector<uint8_t>(c.data, c.data + c.size)});
    return ok_status();
  }
  std::vector<Stored> got;
};

void exercise(LayerCache& layer, const std::vector<ChunkRef>& given) {
  StoreSink sink;
  KVQ_FUZZ_CHECK(layer.export_blocks(0, sink).ok());
  KVQ_FUZZ_CHECK(layer.export_tail(sink).ok());
  KVQ_FUZZ_CHECK(sink.got.size() == given.size());
  for (size_t i = 0; i < given.size(); ++i) {
    const ChunkRef& a = given[i];
    const Stored& b = sink.got[i];
    KVQ_FUZZ_CHECK(a.kind == b.kind && a.t0 == b.t0 && a.tokens == b.tokens &&
                   a.size == b.bytes.size());
    KVQ_FUZZ_CHECK(a.size == 0 || std::memcmp(a.data, b.bytes.data(), a.size) == 0);
  }
  KVQ_FUZZ_CHECK(layer.bytes().total() == layer.resident_bytes());
  const int64_t B = layer.batch(), H = layer.shape().n_kv_heads, S = layer.offset(),
                D = layer.shape().head_dim;
  const int64_t Hq = layer.shape().n_q_heads ? layer.shape().n_q_heads : H;
  if (S > 0) {
    std::vector<float> k(static_cast<size_t>(B * H * S * D)), v(k.size());
    KVQ_FUZZ_CHECK(layer
                       .read(0, S, MutTensorView::bhsd(k.data(), DType::kF32, B, H, S, D),
                             MutTensorView::bhsd(v.data(), DType::kF32, B, H, S, D))
                       .ok());
    for (float x : k) KVQ_FUZZ_CHECK(std::isfinite(x));
    for (float x : v) KVQ_FUZZ_CHECK(std::isfinite(x));
    std::vector<float> q(static_cast<size_t>(B * Hq * D), 0.5f), out(q.size());
    KVQ_FUZZ_CHECK(layer
                       .attend(TensorView::bhsd(q.data(), DType::kF32, B, Hq, 1, D), 0.125f,
                               MutTensorView::bhsd(out.data(), DType::kF32, B, Hq, 1, D))
                       .ok());
    KVQ_FUZZ_CHECK(layer.trim(1).ok());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  fuzz::ImportHeader h;
  h.method = in.u8();
  const MethodDef* method = find_method_by_id(h.method);
  if (!method) return 0;
  const uint8_t flags = in.u8();
  h.bf16 = flags & 1;
  h.q8_window = flags & 2;
  h.heads = 1 + in.u8() % 2;
  h.dim = 1 + in.u8() % 64;  // 32 and 64 reach llama.cpp's formats (blocks of 32)
  h.q_per_kv = 1 + in.u8() % 2;
  h.batch = 1 + in.u8() % 3;
  auto cache = ModelCache::create(fuzz::fuzz_spec(*method, h.q8_window), h.shape());
  if (!cache.ok()) return 0;
  for (int l = 0; l < fuzz::kImportLayers; ++l) {
    const int64_t offset = static_cast<int64_t>(in.varint() & 0xffffffffu);
    const size_t n = in.varint() % 64;
    std::vector<ChunkRef> chunks;
    for (size_t i = 0; i < n; ++i) {
      ChunkRef c;
      c.kind = static_cast<ChunkKind>(in.u8() % 5);
      c.t0 = static_cast<int64_t>(in.varint() & 0xffffffffu);
      c.tokens = static_cast<int64_t>(in.varint() & 0xffffffffu);
      c.data = in.take(static_cast<size_t>(in.varint() & 0xffffff), &c.size);
      chunks.push_back(c);
    }
    LayerCache& layer = cache->layer(l);
    Status st = layer.import_chunks(chunks, h.batch, offset, h.bf16 ? DType::kBF16 : DType::kF16);
    if (!st.ok()) {
      KVQ_FUZZ_CHECK(layer.offset() == 0 && layer.batch() == 0);  // unchanged on error
      continue;
    }
    exercise(layer, chunks);
  }
  // Appending after import (the decode step that follows a load).
  for (int l = 0; l < fuzz::kImportLayers; ++l) {
    LayerCache& layer = cache->layer(l);
    if (layer.batch() == 0) continue;
    const int64_t B = layer.batch(), H = layer.shape().n_kv_heads, D = layer.shape().head_dim;
    std::vector<float> k(static_cast<size_t>(B * H * D), 0.25f);
    (void)layer.append(TensorView::bhsd(k.data(), DType::kF32, B, H, 1, D),
                       TensorView::bhsd(k.data(), DType::kF32, B, H, 1, D));
  }
  return 0;
}
