// kvq decompress IN.kvq -o OUT.safetensors [--dtype f32|f16|bf16]
//
// Writes every layer's K and V, dequantized, as [B, H_kv, S, D] tensors under the names the
// input had when compressed (else layers.<i>.k / layers.<i>.v). IN may be "-": the container is
// then read as a stream from standard input (e.g. from a pipe).
#include <cstdio>

#include "commands.h"
#include "container_cli.h"
#include "kvq/container.h"
#include "kvq/safetensors.h"
#include "progress.h"

namespace kvq::cli {

namespace {

Status run_decompress(const ParsedArgs& a) {
  const std::string in = a.positionals()[0], out = *a.get("output");
  auto dtype = a.get_dtype("dtype", {DType::kF32, DType::kF16, DType::kBF16});
  if (!dtype.ok()) return dtype.status();

  Result<ContainerReader> reader =
      in == "-" ? read_container_fd(0) : [&]() -> Result<ContainerReader> {
    KVQ_ASSIGN_OR_RETURN(auto bytes, read_input(in));
    ContainerReader r;
    KVQ_RETURN_IF_ERROR(r.feed(bytes.data(), bytes.size()));
    KVQ_RETURN_IF_ERROR(r.finish());
    return r;
  }();
  if (!reader.ok()) return reader.status().with_context(in == "-" ? "stdin" : in);
  const ContainerMeta meta = *reader->meta();
  auto cache = reader->take();
  if (!cache.ok()) return cache.status();

  SafeTensorsFile f;
  f.metadata["kvq.method"] = model_spec_text(meta);
  f.metadata["kvq.source"] = in;
  const auto names = tensor_names(meta);
  Progress progress("decompress", static_cast<uint64_t>(cache->n_layers()));
  std::vector<float> k, v;
  for (int i = 0; i < cache->n_layers(); ++i) {
    const LayerCache& l = cache->layer(i);
    const int64_t B = l.batch(), H = l.shape().n_kv_heads, S = l.offset(), D = l.shape().head_dim;
    k.assign(static_cast<size_t>(B * H * S * D), 0.0f);
    v.assign(k.size(), 0.0f);
    if (B > 0 && S > 0) {
      Status st = l.read(0, S, MutTensorView::bhsd(k.data(), DType::kF32, B, H, S, D),
                         MutTensorView::bhsd(v.data(), DType::kF32, B, H, S, D));
      if (!st.ok()) return st.with_context("layer " + std::to_string(i));
    }
    const auto& [kn, vn] = names[static_cast<size_t>(i)];
    f.tensors.push_back(make_tensor(kn, *dtype, {B, H, S, D}, k.data()));
    f.tensors.push_back(make_tensor(vn, *dtype, {B, H, S, D}, v.data()));
    progress.update(static_cast<uint64_t>(i + 1));
  }
  progress.finish();
  Status st = write_safetensors(out, f);
  if (!st.ok()) return st;
  return ok_status();
}

}  // namespace

Command decompress_command() {
  Command c("decompress", "write a .kvq file's K/V, dequantized, to safetensors",
            "IN.kvq -o OUT.safetensors [--dtype f32|f16|bf16]", run_decompress);
  c.options = {option("output", "OUT.safetensors", "the .safetensors file to write")
                   .short_form('o')
                   .required(),
               option("dtype", "TYPE", "element type of the output: f32 (exact), f16 or bf16")
                   .defaults_to("f32")};
  c.positionals = {{"IN.kvq", "the .kvq file to read, or - for standard input"}};
  return c;
}

}  // namespace kvq::cli
