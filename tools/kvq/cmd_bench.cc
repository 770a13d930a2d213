// kvq bench --method SPEC [--input FILE.safetensors | --synthetic] [--json]
//
// Compresses one K/V set (every layer of a dump, or a synthetic set) through a ModelCache and
// reports the canonical spec, all-in bits per element, compression ratio against fp16, the
// normalized MSE of keys and values, and one-thread encode (append) and decode (read)
// throughput in G elements (K and V together) per second.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

#include "commands.h"
#include "core/json.h"
#include "kv_pairs.h"
#include "kvq/cache.h"
#include "kvq/safetensors.h"
#include "kvq/synthetic.h"

namespace kvq::cli {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status run_bench(const ParsedArgs& a) {
  if (a.has("input") && a.has("synthetic"))
    return invalid_argument("--input and --synthetic are exclusive");
  auto spec = parse_spec(*a.get("method"));
  if (!spec.ok()) return spec.status();

  SafeTensorsFile file;
  SyntheticKV syn{};
  std::vector<LayerKV> layers;
  std::string source;
  if (a.has("input")) {
    auto f = read_safetensors(*a.get("input"));
    if (!f.ok()) return f.status();
    file = std::move(*f);
    auto l = pair_layers(file);
    if (!l.ok()) return l.status().with_context(*a.get("input"));
    layers = std::move(*l);
    source = *a.get("input");
  } else {
    SyntheticOptions o;
    auto tokens = a.get_int("tokens"), heads = a.get_int("heads"), dim = a.get_int("dim"),
         nl = a.get_int("layers"), seed = a.get_int("seed");
    for (auto* r : {&tokens, &heads, &dim, &nl, &seed})
      if (!r->ok()) return r->status();
    if (*tokens < 1 || *tokens > (1 << 24) || *heads < 1 || *heads > 256 || *dim < 1 ||
        *dim > 1024 || *nl < 1 || *nl > 256)
      return out_of_range(
          "synthetic sizes must be tokens in [1, 2^24], heads in [1, 256], dim in [1, 1024], "
          "layers in [1, 256]");
    o.tokens = *tokens;
    o.heads = *heads;
    o.dim = *dim;
    o.seed = static_cast<uint64_t>(*seed);
    syn = make_synthetic_kv(o);
    // Each synthetic layer is the same set viewed again; the cache compresses each separately.
    for (int i = 0; i < *nl; ++i) {
      LayerKV l;
      l.name = "synthetic" + std::to_string(i);
      l.k = TensorView::bhsd(syn.k.data(), DType::kF32, 1, o.heads, o.tokens, o.dim);
      l.v = TensorView::bhsd(syn.v.data(), DType::kF32, 1, o.heads, o.tokens, o.dim);
      l.q = TensorView::bhsd(syn.q.data(), DType::kF32, 1, o.heads, o.tokens, o.dim);
      layers.push_back(l);
    }
    source = "synthetic";
  }
  auto min_time = a.get_double("min-time");
  if (!min_time.ok()) return min_time.status();

  ModelShape shape;
  shape.n_layers = static_cast<int>(layers.size());
  for (const auto& l : layers) {
    if (l.k.shape != l.v.shape)
      return shape_mismatch(l.name + ": k " + describe(l.k) + " vs v " + describe(l.v));
    const int hq = l.q ? static_cast<int>(l.q->shape[1]) : 0;
    shape.per_layer.push_back(
        LayerShape{static_cast<int>(l.k.shape[1]), static_cast<int>(l.k.shape[3]), hq});
    // A kvq dump-kv file names the model's RoPE (adjacent pairs, its theta): methods that
    // quantize keys before RoPE need it.
    if (auto it = file.metadata.find("rope_theta"); it != file.metadata.end())
      shape.per_layer.back().rope =
          RopeShape{RopeShape::Mode::kAdjacent, std::strtod(it->second.c_str(), nullptr), 1.0};
  }
  auto cache = ModelCache::create(*spec, shape);
  if (!cache.ok()) return cache.status();

  uint64_t elems = 0;
  for (const auto& l : layers) elems += 2 * static_cast<uint64_t>(l.k.numel());

  // Encode: append every layer in one call; repeated until min_time, fastest run kept.
  double best_enc = 1e30;
  for (double spent = 0; spent < *min_time || best_enc == 1e30;) {
    cache->reset();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < shape.n_layers; ++i) {
      const auto& l = layers[static_cast<size_t>(i)];
      Status st = cache->layer(i).append(l.k, l.v, l.q ? &*l.q : nullptr);
      if (!st.ok()) return st.with_context(l.name);
    }
    const double dt = seconds_since(t0);
    best_enc = std::min(best_enc, dt);
    spent += dt;
  }

  // Decode: read every layer back to fp32.
  std::vector<std::vector<float>> kout(layers.size()), vout(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    kout[i].resize(static_cast<size_t>(layers[i].k.numel()));
    vout[i].resize(kout[i].size());
  }
  double best_dec = 1e30;
  for (double spent = 0; spent < *min_time || best_dec == 1e30;) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < shape.n_layers; ++i) {
      const auto& l = layers[static_cast<size_t>(i)];
      const auto& s = l.k.shape;
      Status st = cache->layer(i).read(0, s[2],
                                       MutTensorView::bhsd(kout[static_cast<size_t>(i)].data(),
                                                           DType::kF32, s[0], s[1], s[2], s[3]),
                                       MutTensorView::bhsd(vout[static_cast<size_t>(i)].data(),
                                                           DType::kF32, s[0], s[1], s[2], s[3]));
      if (!st.ok()) return st;
    }
    const double dt = seconds_since(t0);
    best_dec = std::min(best_dec, dt);
    spent += dt;
  }

  double kerr = 0, kref = 0, verr = 0, vref = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& l = layers[i];
    const auto& s = l.k.shape;
    size_t idx = 0;
    for (int64_t b = 0; b < s[0]; ++b)
      for (int64_t h = 0; h < s[1]; ++h)
        for (int64_t t = 0; t < s[2]; ++t)
          for (int64_t d = 0; d < s[3]; ++d, ++idx) {
            const double k = l.k.load(b, h, t, d), v = l.v.load(b, h, t, d);
            kerr += (k - kout[i][idx]) * (k - kout[i][idx]);
            verr += (v - vout[i][idx]) * (v - vout[i][idx]);
            kref += k * k;
            vref += v * v;
          }
  }
  const CacheBytes bytes = cache->bytes();
  json::Value r = json::Value::object();
  r.set("method", json::Value::string(spec->to_string()));
  r.set("input", json::Value::string(source));
  r.set("layers", json::Value::number(shape.n_layers));
  r.set("tokens", json::Value::number(static_cast<double>(layers[0].k.shape[2])));
  r.set("bits_per_element", json::Value::number(bytes.bits_per_element()));
  r.set("compression_ratio", json::Value::number(bytes.compression_ratio()));
  r.set("key_nmse", json::Value::number(kref > 0 ? kerr / kref : 0));
  r.set("value_nmse", json::Value::number(vref > 0 ? verr / vref : 0));
  r.set("encode_gelem_s", json::Value::number(static_cast<double>(elems) / best_enc / 1e9));
  r.set("decode_gelem_s", json::Value::number(static_cast<double>(elems) / best_dec / 1e9));
  r.set("resident_bytes", json::Value::number(static_cast<double>(cache->resident_bytes())));
  r.set("fp16_bytes", json::Value::number(static_cast<double>(bytes.fp16_bytes())));
  json::Value br = json::Value::object();
  br.set("key_codes", json::Value::number(static_cast<double>(bytes.key_codes)));
  br.set("value_codes", json::Value::number(static_cast<double>(bytes.value_codes)));
  br.set("params", json::Value::number(static_cast<double>(bytes.params)));
  br.set("residual", json::Value::number(static_cast<double>(bytes.residual)));
  br.set("meta", json::Value::number(static_cast<double>(bytes.meta)));
  br.set("tables", json::Value::number(static_cast<double>(bytes.tables)));
  r.set("bytes", std::move(br));
  if (a.has("json")) {
    std::printf("%s\n", r.dump(2).c_str());
  } else {
    std::printf("method            %s\ninput             %s (%d layers x %lld tokens)\n",
                spec->to_string().c_str(), source.c_str(), shape.n_layers,
                static_cast<long long>(layers[0].k.shape[2]));
    std::printf("bits/element      %.4f (all-in)\ncompression       %.3fx vs fp16\n",
                bytes.bits_per_element(), bytes.compression_ratio());
    std::printf("key nmse          %.3e\nvalue nmse        %.3e\n", kref > 0 ? kerr / kref : 0,
                vref > 0 ? verr / vref : 0);
    std::printf("encode            %.3f G elem/s (one thread)\ndecode            %.3f G elem/s\n",
                static_cast<double>(elems) / best_enc / 1e9,
                static_cast<double>(elems) / best_dec / 1e9);
    std::printf(
        "bytes             codes K %llu V %llu, params %llu, residual %llu, meta %llu, "
        "tables %llu (held, not stored)\n",
                static_cast<unsigned long long>(bytes.key_codes),
                static_cast<unsigned long long>(bytes.value_codes),
                static_cast<unsigned long long>(bytes.params),
                static_cast<unsigned long long>(bytes.residual),
                static_cast<unsigned long long>(bytes.meta),
                static_cast<unsigned long long>(bytes.tables));
  }
  return ok_status();
}

}  // namespace

Command bench_command() {
  Command c("bench", "compress one K/V set and report size, error and speed",
            "--method SPEC [--input FILE.safetensors | --synthetic] [--json]", run_bench);
  c.options = {option("method", "SPEC", "method spec").defaults_to("kivi"),
               option("input", "FILE", "safetensors file of K/V (e.g. from kvq dump-kv)"),
               flag("synthetic", "use the built-in synthetic K/V generator (the default)"),
               option("tokens", "N", "synthetic: tokens").defaults_to("4096"),
               option("heads", "N", "synthetic: KV heads").defaults_to("4"),
               option("dim", "N", "synthetic: head_dim").defaults_to("128"),
               option("layers", "N", "synthetic: layers").defaults_to("4"),
               option("seed", "N", "synthetic: seed").defaults_to("1"),
               option("min-time", "S", "seconds to repeat each timing for").defaults_to("0.3"),
               flag("json", "print one JSON object")};
  return c;
}

}  // namespace kvq::cli
