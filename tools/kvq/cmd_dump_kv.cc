// kvq dump-kv [--model PATH] [--tokenizer PATH] --text PATH --ctx N -o OUT.safetensors
//             [--layers 0,5,29] [--dtype f16|bf16|f32] [--no-queries]
//
// Runs the first N tokens of a text through the model (fp16 cache, prefill chunks of 256) and
// writes what enters each layer's cache: post-RoPE keys and values, and the post-RoPE queries of
// the same tokens (ZipCache's saliency needs them), as safetensors tensors
//   layers.<l>.k [1, n_kv_heads, N, head_dim]
//   layers.<l>.v [1, n_kv_heads, N, head_dim]
//   layers.<l>.q [1, n_heads,    N, head_dim]
// with metadata naming the model, text, layers and layout. `kvq bench --input` reads it.
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>

#include "commands.h"
#include "kvq/cache.h"
#include "kvq/safetensors.h"
#include "model_args.h"

namespace kvq::cli {

namespace {

Result<std::vector<int>> parse_layers(const std::string& text, int n_layers) {
  std::vector<int> out;
  if (text == "all") {
    for (int l = 0; l < n_layers; ++l) out.push_back(l);
    return out;
  }
  std::set<int> seen;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < 0 || v >= n_layers)
      return invalid_argument("--layers: '" + item + "' is not a layer index in [0, " +
                              std::to_string(n_layers) + ")");
    if (!seen.insert(static_cast<int>(v)).second)
      return invalid_argument("--layers: layer " + item + " listed twice");
    out.push_back(static_cast<int>(v));
  }
  if (out.empty()) return invalid_argument("--layers: empty list");
  return out;
}

Status run_dump_kv(const ParsedArgs& a) {
  auto ctx = a.get_int("ctx");
  if (!ctx.ok()) return ctx.status();
  if (*ctx < 1 || *ctx > (1 << 20))
    return out_of_range("--ctx must be in [1, 2^20], got " + std::to_string(*ctx));
  auto dtype = a.get_dtype("dtype", {DType::kF16, DType::kBF16, DType::kF32});
  if (!dtype.ok()) return dtype.status();
  const bool queries = !a.has("no-queries");

  auto text = read_text_file(*a.get("text"));
  if (!text.ok()) return text.status();
  auto m = load_model_from_args(a, /*need_tokenizer=*/true);
  if (!m.ok()) return m.status();
  const model::LlamaConfig& cfg = m->config();
  auto layers = parse_layers(*a.get("layers"), cfg.n_layers);
  if (!layers.ok()) return layers.status();

  std::vector<int32_t> ids;
  if (m->tokenizer()->add_bos() && m->tokenizer()->bos_id() >= 0)
    ids.push_back(m->tokenizer()->bos_id());
  for (int32_t id : m->tokenizer()->encode(*text)) ids.push_back(id);
  if (static_cast<int64_t>(ids.size()) < *ctx)
    return invalid_argument("the text has " + std::to_string(ids.size()) +
                            " tokens, fewer than --ctx " + std::to_string(*ctx));
  const int64_t N = *ctx, HD = cfg.head_dim, Hq = cfg.n_heads, Hkv = cfg.n_kv_heads;

  // Per selected layer: [H, N, HD] fp32 buffers of q, k, v, filled by the forward observer.
  std::vector<int> slot(static_cast<size_t>(cfg.n_layers), -1);
  for (size_t i = 0; i < layers->size(); ++i)
    slot[static_cast<size_t>((*layers)[i])] = static_cast<int>(i);
  std::vector<std::vector<float>> qs(layers->size()), ks(layers->size()), vs(layers->size());
  for (size_t i = 0; i < layers->size(); ++i) {
    if (queries) qs[i].resize(static_cast<size_t>(Hq * N * HD));
    ks[i].resize(static_cast<size_t>(Hkv * N * HD));
    vs[i].resize(static_cast<size_t>(Hkv * N * HD));
  }
  int64_t pos = 0;  // absolute position of the current chunk's first token
  model::ForwardOptions fo;
  fo.observer = [&](const model::LayerActivations& act) {
    const int i = slot[static_cast<size_t>(act.layer)];
    if (i < 0) return;
    for (int t = 0; t < act.n_tokens; ++t) {
      const float* row = act.qkv + int64_t{t} * act.row_stride;
      auto put = [&](std::vector<float>& dst, const float* src, int64_t heads) {
        for (int64_t h = 0; h < heads; ++h)
          std::copy(src + h * HD, src + (h + 1) * HD, dst.begin() + ((h * N) + pos + t) * HD);
      };
      if (queries) put(qs[static_cast<size_t>(i)], row, Hq);
      put(ks[static_cast<size_t>(i)], row + cfg.q_dim(), Hkv);
      put(vs[static_cast<size_t>(i)], row + cfg.q_dim() + cfg.kv_dim(), Hkv);
    }
  };
  auto cache = ModelCache::create("fp16", m->cache_shape());
  if (!cache.ok()) return cache.status();
  ModelCache* cp = &*cache;
  std::vector<float> hidden;
  for (pos = 0; pos < N; pos += 256) {
    const int T = static_cast<int>(std::min<int64_t>(256, N - pos));
    Status st = m->forward(std::span<const int32_t>(ids.data() + pos, static_cast<size_t>(T)), T,
                           std::span<ModelCache* const>(&cp, 1), &hidden, fo);
    if (!st.ok()) return st;
  }

  SafeTensorsFile out;
  std::string layer_list;
  for (size_t i = 0; i < layers->size(); ++i) {
    const std::string p = "layers." + std::to_string((*layers)[i]) + ".";
    out.tensors.push_back(make_tensor(p + "k", *dtype, {1, Hkv, N, HD}, ks[i].data()));
    out.tensors.push_back(make_tensor(p + "v", *dtype, {1, Hkv, N, HD}, vs[i].data()));
    if (queries) out.tensors.push_back(make_tensor(p + "q", *dtype, {1, Hq, N, HD}, qs[i].data()));
    layer_list += (i ? "," : "") + std::to_string((*layers)[i]);
  }
  out.metadata["format"] = "kvq-kv-dump";
  out.metadata["layout"] = "[B, H, S, D]; keys and queries after RoPE (adjacent-pair rotation)";
  out.metadata["model"] = cfg.name;
  out.metadata["model_file"] =
      std::filesystem::path(a.get_or("model", kDefaultModelName)).filename().string();
  out.metadata["text"] = std::filesystem::path(*a.get("text")).filename().string();
  out.metadata["tokens"] = std::to_string(N);
  out.metadata["layers"] = layer_list;
  out.metadata["n_layers"] = std::to_string(cfg.n_layers);
  out.metadata["n_heads"] = std::to_string(Hq);
  out.metadata["n_kv_heads"] = std::to_string(Hkv);
  out.metadata["head_dim"] = std::to_string(HD);
  out.metadata["rope_theta"] = std::to_string(cfg.rope_theta);
  Status st = write_safetensors(*a.get("output"), out);
  if (!st.ok()) return st;
  std::fprintf(stderr, "kvq dump-kv: wrote %zu layer(s) x %lld tokens (%s%s) to %s\n",
               layers->size(), static_cast<long long>(N), dtype_name(*dtype),
               queries ? ", with queries" : "", a.get("output")->c_str());
  return ok_status();
}

}  // namespace

Command dump_kv_command() {
  Command c("dump-kv", "write a model's real post-RoPE K/V to safetensors",
            "[--model PATH] --text PATH --ctx N -o OUT.safetensors [--layers LIST] "
            "[--dtype f16|bf16|f32]",
            run_dump_kv);
  c.options = with_model_options(
      {option("text", "PATH", "UTF-8 text whose first --ctx tokens are run").required(),
       option("ctx", "N", "tokens to run").defaults_to("512"),
       option("output", "OUT.safetensors", "output .safetensors file").short_form('o').required(),
       option("layers", "LIST", "comma-separated layer indices, or 'all'").defaults_to("all"),
       option("dtype", "TYPE", "f16, bf16 or f32").defaults_to("f16"),
       flag("no-queries", "leave out the queries")});
  return c;
}

}  // namespace kvq::cli
