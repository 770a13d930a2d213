// Fuzz target: the GGUF reader (src/format/gguf.h) on arbitrary bytes: header, metadata,
// tensor directory, and dequantization of every tensor it accepts (small ones; a tensor's bytes
// are checked against the file by parse, so reading them must never fault).
#include <vector>

#include "fuzz_util.h"
#include "model/gguf.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvq;
  auto f = gguf::File::parse(data, size, "fuzz");
  if (!f.ok()) return 0;
  for (const auto& [key, value] : f->metadata()) {
    (void)f->get_int(key);
    (void)f->get_uint(key);
    (void)f->get_float(key);
    (void)f->get_bool(key);
    (void)f->get_string(key);
    (void)f->get_string_array(key);
    (void)f->get_int_array(key);
    (void)f->get_float_array(key);
  }
  std::vector<float> out;
  for (const auto& t : f->tensors()) {
    KVQ_FUZZ_CHECK(t.data >= data && t.data + t.n_bytes <= data + size);
    if (t.n_elements > (1 << 20)) continue;
    Status st = f->read_f32(t.name, {}, &out);
    if (st.ok()) KVQ_FUZZ_CHECK(out.size() == static_cast<size_t>(t.n_elements));
  }
  return 0;
}
