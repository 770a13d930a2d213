// kvq compress --method SPEC IN.safetensors -o OUT.kvq
//
// Compresses every layer's K/V from a safetensors file (pairs named <x>k/<x>v, <x>key/<x>value
// or <x>keys/<x>values, e.g. from kvq dump-kv; an optional <x>q of queries goes to methods that
// rank tokens by attention) into a .kvq container (docs/format.md), written atomically.
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <optional>

#include "commands.h"
#include "container_cli.h"
#include "core/json.h"
#include "kv_pairs.h"
#include "kvq/cache.h"
#include "kvq/container.h"
#include "kvq/safetensors.h"
#include "progress.h"

namespace kvq::cli {

namespace {

Status run_compress(const ParsedArgs& a) {
  const std::string in = a.positionals()[0], out = *a.get("output");
  auto chunk = a.get_int("chunk");
  if (!chunk.ok()) return chunk.status();
  if (*chunk < 1) return out_of_range("--chunk must be >= 1");

  auto file = read_safetensors(in);
  if (!file.ok()) return file.status();
  auto layers = pair_layers(*file);
  if (!layers.ok()) return layers.status().with_context(in);
  ModelShape shape;
  shape.n_layers = static_cast<int>(layers->size());
  uint64_t total_tokens = 0;
  std::vector<std::pair<std::string, std::string>> names;
  for (const auto& l : *layers) {
    if (l.k.shape != l.v.shape)
      return shape_mismatch(l.name + ": k " + describe(l.k) + " and v " + describe(l.v) +
                            " disagree");
    if (l.k.shape[1] < 1 || l.k.shape[1] > 4096 || l.k.shape[3] < 1 || l.k.shape[3] > 4096)
      return shape_mismatch(l.name + ": k " + describe(l.k) + " needs 1..4096 heads and head_dim");
    const int hq = l.q ? static_cast<int>(l.q->shape[1]) : 0;
    shape.per_layer.push_back(
        LayerShape{static_cast<int>(l.k.shape[1]), static_cast<int>(l.k.shape[3]), hq});
    total_tokens += static_cast<uint64_t>(l.k.shape[2]);
    names.emplace_back(l.k_name, l.v_name);
  }
  auto cache = ModelCache::create(*a.get("method"), shape);
  if (!cache.ok()) return cache.status();

  {
    Progress progress("compress", total_tokens);
    uint64_t done = 0;
    for (int i = 0; i < shape.n_layers; ++i) {
      const LayerKV& l = (*layers)[static_cast<size_t>(i)];
      const int64_t S = l.k.shape[2];
      if (l.k.shape[0] == 0) continue;  // an empty layer (e.g. decompressed from one)
      for (int64_t s0 = 0; s0 < S; s0 += *chunk) {
        const int64_t n = std::min<int64_t>(*chunk, S - s0);
        std::optional<TensorView> q;
        if (l.q) q = l.q->slice_tokens(s0, n);
        Status st = cache->layer(i).append(l.k.slice_tokens(s0, n), l.v.slice_tokens(s0, n),
                                           q ? &*q : nullptr);
        if (!st.ok())
          return st.with_context("layer '" + l.name + "', tokens " + std::to_string(s0));
        done += static_cast<uint64_t>(n);
        progress.update(done);
      }
    }
  }
  const ContainerAttributes attrs = {{kSourceAttribute, in},
                                     {kTensorNamesAttribute, tensor_names_json(names)}};
  Status st = save_cache(*cache, out, attrs);
  if (!st.ok()) return st;
  struct stat sb {};
  const double file_bytes = ::stat(out.c_str(), &sb) == 0 ? static_cast<double>(sb.st_size) : 0.0;
  const CacheBytes b = cache->bytes();
  json::Value r = json::Value::object();
  r.set("output", json::Value::string(out));
  r.set("method", json::Value::string(cache->spec().to_string()));
  r.set("layers", json::Value::number(shape.n_layers));
  r.set("tokens", json::Value::number(static_cast<double>(layers->front().k.shape[2])));
  r.set("file_bytes", json::Value::number(file_bytes));
  r.set("held_bytes", json::Value::number(static_cast<double>(b.total())));
  r.set("fp16_bytes", json::Value::number(static_cast<double>(b.fp16_bytes())));
  r.set("bits_per_element", json::Value::number(b.bits_per_element()));
  r.set("compression_ratio", json::Value::number(b.compression_ratio()));
  if (a.has("json")) {
    std::printf("%s\n", r.dump(2).c_str());
  } else {
    std::printf("wrote %s (%.0f bytes): %s, %d layers, %.4f bits/element all-in (%.2fx vs fp16)\n",
                out.c_str(), file_bytes, cache->spec().to_string().c_str(), shape.n_layers,
                b.bits_per_element(), b.compression_ratio());
  }
  return ok_status();
}

}  // namespace

Command compress_command() {
  Command c("compress", "compress K/V from safetensors into a .kvq file",
            "--method SPEC IN.safetensors -o OUT.kvq", run_compress);
  c.options = {option("method", "SPEC",
                      "method spec, e.g. kivi:k_bits=2 or kivi@0-3:k_bits=4 (see kvq list)")
                   .required(),
               option("output", "OUT.kvq", "the .kvq file to write").short_form('o').required(),
               option("chunk", "N", "tokens appended per call; the result does not depend on it")
                   .defaults_to("4096"),
               flag("json", "print a JSON summary")};
  c.positionals = {{"IN.safetensors", "the K/V to compress (e.g. from kvq dump-kv)"}};
  return c;
}

}  // namespace kvq::cli
