// kvq info IN.kvq [--json]
//
// Describes a .kvq file: format and writer versions, method and model shape, attributes, and per
// layer its tokens, sealed blocks, window, bytes in the file and bits per element, with every
// chunk's checksum verified; then loads it to report the bits per element held in memory. Exits
// 1 when anything is wrong with the file (bad checksums or a failed load), after describing it.
#include <cstdio>

#include "commands.h"
#include "container_cli.h"
#include "core/json.h"
#include "kvq/container.h"

namespace kvq::cli {

namespace {

struct LayerRow {
  int64_t batch = 0, tokens = 0, blocks = 0, window_tokens = 0;
  DType window_dtype = DType::kF16;
  WindowFormat window_format = WindowFormat::k16Bit;
  // "f16", "bf16", or "q8" (kvq's 8-bit window rows)
  const char* window_name() const {
    return window_format == WindowFormat::kQ8 ? "q8" : dtype_name(window_dtype);
  }
  uint64_t bytes[5] = {0, 0, 0, 0, 0};  // by ChunkKind
  uint64_t total = 0, elements = 0;
  int bad_checksums = 0;
  double file_bpe() const {
    return elements ? 8.0 * static_cast<double>(total) / static_cast<double>(elements) : 0;
  }
};

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

Status run_info(const ParsedArgs& a) {
  const std::string in = a.positionals()[0];
  auto bytes = read_input(in);
  if (!bytes.ok()) return bytes.status();
  auto info = inspect_container(bytes->data(), bytes->size());
  if (!info.ok()) return info.status().with_context(in);
  auto cache = parse_cache(bytes->data(), bytes->size());

  const ContainerMeta& m = info->meta;
  const int n = m.shape.n_layers;
  std::vector<LayerRow> rows(static_cast<size_t>(n));
  for (const ContainerChunk& c : info->chunks) {
    LayerRow& r = rows[static_cast<size_t>(c.layer)];
    r.batch = c.batch;
    r.bytes[static_cast<int>(c.kind)] += c.size;
    r.total += c.size;
    if (!c.checksum_ok) ++r.bad_checksums;
    if (c.kind == ChunkKind::kBlockKeys) ++r.blocks;
    if (c.kind == ChunkKind::kWindowKeys) {
      r.window_tokens = c.tokens;
      r.window_dtype = c.dtype;
      r.window_format = c.window_format;
    }
    if (c.kind == ChunkKind::kState) r.tokens = c.tokens;
  }
  LayerRow tot;
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    LayerRow& r = rows[static_cast<size_t>(i)];
    const LayerShape& s = m.shape.at(i);
    r.elements = 2 * static_cast<uint64_t>(r.batch) * static_cast<uint64_t>(s.n_kv_heads) *
                 static_cast<uint64_t>(r.tokens) * static_cast<uint64_t>(s.head_dim);
    tot.total += r.total;
    tot.elements += r.elements;
    bad += r.bad_checksums;
  }
  // What is wrong with the file, reported after describing it.
  const Status problem = !cache.ok() ? cache.status()
                         : bad > 0 ? corrupt(std::to_string(bad) + " chunk checksums do not match")
                                   : ok_status();

  if (a.has("json")) {
    json::Value o = json::Value::object();
    o.set("file", json::Value::string(in));
    o.set("file_bytes", json::Value::number(static_cast<double>(info->file_size)));
    o.set("format_version", json::Value::string(std::to_string(m.major_version) + "." +
                                                std::to_string(m.minor_version)));
    o.set("kvq_version", json::Value::string(m.kvq_version));
    o.set("method", json::Value::string(m.method_spec));
    o.set("model_spec", json::Value::string(model_spec_text(m)));
    json::Value ov = json::Value::object();
    for (const auto& [l, t] : m.overrides) ov.set(std::to_string(l), json::Value::string(t));
    o.set("overrides", std::move(ov));
    json::Value at = json::Value::object();
    for (const auto& [k, v] : m.attributes) at.set(k, json::Value::string(v));
    o.set("attributes", std::move(at));
    o.set("n_layers", json::Value::number(n));
    o.set("chunks", json::Value::number(static_cast<double>(info->chunks.size())));
    o.set("checksums_ok", json::Value::boolean(bad == 0));
    o.set("bad_checksums", json::Value::number(bad));
    json::Value sk = json::Value::array();
    for (const auto& s : info->skipped) sk.push(json::Value::string(s));
    o.set("skipped_records", std::move(sk));
    o.set("load", json::Value::string(cache.ok() ? "ok" : cache.status().to_string()));
    json::Value layers = json::Value::array();
    static const char* kinds[] = {"block_keys", "block_values", "window_keys", "window_values",
                                  "state"};
    for (int i = 0; i < n; ++i) {
      const LayerRow& r = rows[static_cast<size_t>(i)];
      const LayerShape& s = m.shape.at(i);
      json::Value l = json::Value::object();
      l.set("layer", json::Value::number(i));
      l.set("n_kv_heads", json::Value::number(s.n_kv_heads));
      l.set("head_dim", json::Value::number(s.head_dim));
      l.set("n_q_heads", json::Value::number(s.n_q_heads ? s.n_q_heads : s.n_kv_heads));
      l.set("batch", json::Value::number(static_cast<double>(r.batch)));
      l.set("tokens", json::Value::number(static_cast<double>(r.tokens)));
      l.set("blocks", json::Value::number(static_cast<double>(r.blocks)));
      l.set("window_tokens", json::Value::number(static_cast<double>(r.window_tokens)));
      l.set("window_dtype", json::Value::string(r.window_name()));
      json::Value by = json::Value::object();
      for (int k = 0; k < 5; ++k)
        by.set(kinds[k], json::Value::number(static_cast<double>(r.bytes[k])));
      by.set("total", json::Value::number(static_cast<double>(r.total)));
      l.set("bytes", std::move(by));
      l.set("elements", json::Value::number(static_cast<double>(r.elements)));
      l.set("file_bits_per_element", json::Value::number(r.file_bpe()));
      if (cache.ok()) {
        l.set("held_bytes",
              json::Value::number(static_cast<double>(cache->layer(i).bytes().total())));
        l.set("held_bits_per_element",
              json::Value::number(cache->layer(i).bytes().bits_per_element()));
      }
      l.set("checksums_ok", json::Value::boolean(r.bad_checksums == 0));
      layers.push(std::move(l));
    }
    o.set("layers", std::move(layers));
    json::Value t = json::Value::object();
    t.set("chunk_bytes", json::Value::number(static_cast<double>(tot.total)));
    t.set("elements", json::Value::number(static_cast<double>(tot.elements)));
    t.set("fp16_bytes", json::Value::number(static_cast<double>(tot.elements * 2)));
    t.set("file_bits_per_element",
          json::Value::number(tot.elements ? 8.0 * static_cast<double>(info->file_size) /
                                                 static_cast<double>(tot.elements)
                                           : 0));
    if (cache.ok()) {
      const CacheBytes cb = cache->bytes();
      t.set("held_bytes", json::Value::number(static_cast<double>(cb.total())));
      t.set("held_bits_per_element", json::Value::number(cb.bits_per_element()));
      t.set("compression_ratio", json::Value::number(cb.compression_ratio()));
    }
    o.set("total", std::move(t));
    std::printf("%s\n", o.dump(2).c_str());
    return problem;
  }

  std::printf("file          %s (%llu bytes)\n", in.c_str(),
              static_cast<unsigned long long>(info->file_size));
  std::printf("format        .kvq %u.%u, written by kvq %s\n", m.major_version, m.minor_version,
              m.kvq_version.c_str());
  std::printf("method        %s\n", m.method_spec.c_str());
  if (!m.overrides.empty()) std::printf("model spec    %s\n", model_spec_text(m).c_str());
  if (m.shape.per_layer.empty()) {
    const LayerShape& s = m.shape.layer;
    std::printf("model         %d layers, %d KV heads, head_dim %d, %d query heads\n", n,
                s.n_kv_heads, s.head_dim, s.n_q_heads ? s.n_q_heads : s.n_kv_heads);
  } else {
    std::printf("model         %d layers (shapes per layer below)\n", n);
  }
  for (const auto& [k, v] : m.attributes)
    std::printf("attribute     %s = %s\n", k.c_str(),
                v.size() > 200 ? (v.substr(0, 200) + "...").c_str() : v.c_str());
  for (const auto& s : info->skipped) std::printf("skipped       optional record %s\n", s.c_str());
  std::printf("chunks        %zu, checksums %s\n", info->chunks.size(),
              bad == 0 ? "all ok" : (std::to_string(bad) + " BAD").c_str());
  std::printf("load          %s\n\n", cache.ok() ? "ok" : cache.status().to_string().c_str());
  std::printf("%5s %5s %8s %7s %8s %6s %12s %10s %10s %s\n", "layer", "batch", "tokens", "blocks",
              "window", "shape", "file bytes", "bits/elem", "held b/e", "checksums");
  for (int i = 0; i < n; ++i) {
    const LayerRow& r = rows[static_cast<size_t>(i)];
    const LayerShape& s = m.shape.at(i);
    const std::string shape = std::to_string(s.n_kv_heads) + "x" + std::to_string(s.head_dim);
    const std::string held =
        cache.ok() && r.elements ? fmt("%.4f", cache->layer(i).bytes().bits_per_element()) : "-";
    std::printf("%5d %5lld %8lld %7lld %8lld %6s %12llu %10s %10s %s\n", i,
                static_cast<long long>(r.batch), static_cast<long long>(r.tokens),
                static_cast<long long>(r.blocks), static_cast<long long>(r.window_tokens),
                shape.c_str(), static_cast<unsigned long long>(r.total),
                r.elements ? fmt("%.4f", r.file_bpe()).c_str() : "-", held.c_str(),
                r.bad_checksums ? (std::to_string(r.bad_checksums) + " BAD").c_str() : "ok");
  }
  std::printf("\ntotal         %llu chunk bytes for %llu K/V elements (%llu fp16 bytes)\n",
              static_cast<unsigned long long>(tot.total),
              static_cast<unsigned long long>(tot.elements),
              static_cast<unsigned long long>(tot.elements * 2));
  if (tot.elements) {
    std::printf("bits/element  %.4f in the file (all records), %.4f in chunk payloads",
                8.0 * static_cast<double>(info->file_size) / static_cast<double>(tot.elements),
                tot.file_bpe());
    if (cache.ok())
      std::printf(", %.4f held in memory (%.2fx vs fp16)", cache->bytes().bits_per_element(),
                  cache->bytes().compression_ratio());
    std::printf("\n");
  }
  return problem;
}

}  // namespace

Command info_command() {
  Command c("info", "describe a .kvq file: method, layers, sizes, checksums (--json)",
            "IN.kvq [--json]", run_info);
  c.options = {flag("json", "print one JSON object")};
  c.positionals = {{"IN.kvq", "the .kvq file to describe, or - for standard input"}};
  return c;
}

}  // namespace kvq::cli
