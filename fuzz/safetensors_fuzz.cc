// Fuzz target: the safetensors reader (src/format/safetensors.cc) on arbitrary bytes. A file it
// accepts must serialize and parse back to the same tensors and metadata.
#include "fuzz_util.h"
#include "kvq/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvq;
  auto f = parse_safetensors(data, size);
  if (!f.ok()) return 0;
  for (const auto& t : f->tensors) {
    KVQ_FUZZ_CHECK(static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype) == t.data.size());
    (void)t.view4();
  }
  const std::vector<uint8_t> bytes = serialize_safetensors(*f);
  auto g = parse_safetensors(bytes.data(), bytes.size());
  KVQ_FUZZ_CHECK(g.ok());
  KVQ_FUZZ_CHECK(g->tensors.size() == f->tensors.size() && g->metadata == f->metadata);
  for (size_t i = 0; i < f->tensors.size(); ++i) {
    const SafeTensor &a = f->tensors[i], &b = g->tensors[i];
    KVQ_FUZZ_CHECK(a.name == b.name && a.dtype == b.dtype && a.shape == b.shape &&
                   a.data == b.data);
  }
  return 0;
}
