// kvq xquant-pairs --input KV.safetensors [--method XQUANT_SPEC] [--reuse N] [--max-cost E]
//                  [--max-tokens N] [--json]
//
// XQuant's calibration pass. For every pair of layers (i < j) of a K/V dump (kvq dump-kv) it
// measures how reusable layer i's codes are for layer j:
//   cos        cosine of the raw tensors (K and V, all heads and tokens flattened)
//   agree      fraction of equal codes when both layers are quantized on their own with the
//              spec's k_bits/v_bits and grouping, and `chance`, the agreement two independent
//              layers with the same code histograms would have (sum_c p_i(c) p_j(c)) — min/max
//              codes crowd into the middle levels, so raw agreement alone overstates similarity
//   reuse      normalized MSE of layer j rebuilt from layer i's codes by the method itself (the
//              spec's fit, eta and res_bits), against `own` (layer j quantized as an anchor) and
//              `mean` (one value per group: what codes carrying no information give)
// then picks reuse pairs greedily by cost = (reuse nmse K + reuse nmse V) / 2, lowest first, each
// reuse layer's anchor an earlier anchor of the same shape, until --reuse layers reuse (default:
// half the layers, the bits of stride pairs) or the cost passes --max-cost. It prints the choice
// as a model spec string (pairing=explicit plus @j:anchor=i overrides) and checks it by
// compressing the whole dump with it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <optional>

#include "commands.h"
#include "core/json.h"
#include "kv_pairs.h"
#include "kvq/cache.h"
#include "kvq/group_quant.h"
#include "kvq/safetensors.h"
#include "model/ops.h"

namespace kvq::cli {

namespace {

struct Layer {
  int index = 0;  // layer number in the model (from "layers.<l>." names, else order)
  int64_t streams = 0, tokens = 0, dim = 0, batch = 0, heads = 0;
  std::vector<float> k, v;      // [streams, tokens, dim]
  std::vector<uint8_t> kc, vc;  // own codes, same layout
};

Result<std::vector<Layer>> load_layers(const SafeTensorsFile& f, int64_t max_tokens) {
  KVQ_ASSIGN_OR_RETURN(std::vector<LayerKV> pairs, pair_layers(f));
  if (pairs.size() < 2) return not_found("need K/V of at least two layers");
  std::vector<Layer> out;
  for (const LayerKV& p : pairs) {
    const TensorView& kv = p.k;
    const TensorView& vv = p.v;
    if (kv.shape != vv.shape) return shape_mismatch(p.k_name + " and " + p.v_name + " disagree");
    Layer l;
    l.index = static_cast<int>(out.size());
    int parsed = 0;
    if (std::sscanf(p.name.c_str(), "layers.%d.", &parsed) == 1) l.index = parsed;
    l.batch = kv.shape[0];
    l.heads = kv.shape[1];
    l.streams = kv.shape[0] * kv.shape[1];
    l.tokens = std::min(kv.shape[2], max_tokens);
    l.dim = kv.shape[3];
    l.k.resize(static_cast<size_t>(l.streams * l.tokens * l.dim));
    l.v.resize(l.k.size());
    size_t i = 0;
    for (int64_t b = 0; b < kv.shape[0]; ++b)
      for (int64_t h = 0; h < kv.shape[1]; ++h)
        for (int64_t s = 0; s < l.tokens; ++s)
          for (int64_t d = 0; d < l.dim; ++d, ++i) {
            l.k[i] = kv.load(b, h, s, d);
            l.v[i] = vv.load(b, h, s, d);
          }
    out.push_back(std::move(l));
  }
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].index <= out[i - 1].index)
      return invalid_argument("layer numbers must increase in depth order, got layer " +
                              std::to_string(out[i].index) + " after " +
                              std::to_string(out[i - 1].index));
  return out;
}

bool same_shape(const Layer& a, const Layer& b) {
  return a.batch == b.batch && a.heads == b.heads && a.tokens == b.tokens && a.dim == b.dim;
}

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return aa > 0 && bb > 0 ? ab / std::sqrt(aa * bb) : 0.0;
}

double nmse(const std::vector<float>& x, const std::vector<float>& ref) {
  double e = 0, r = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    e += (static_cast<double>(x[i]) - ref[i]) * (static_cast<double>(x[i]) - ref[i]);
    r += static_cast<double>(ref[i]) * ref[i];
  }
  return r > 0 ? e / r : 0.0;
}

// Codes of a layer quantized on its own with the method's grouping (keys per channel over
// blocks of G tokens, values per token over runs of G channels).
void own_codes(Layer& l, int64_t G, int k_bits, int v_bits) {
  const int64_t T = l.tokens, D = l.dim;
  l.kc.resize(l.k.size());
  l.vc.resize(l.v.size());
  std::vector<QuantParams> kp(static_cast<size_t>(D)),
      vp(static_cast<size_t>(G * n_channel_groups(D, G)));
  for (int64_t s = 0; s < l.streams; ++s)
    for (int64_t t0 = 0; t0 < T; t0 += G) {
      const size_t off = static_cast<size_t>((s * T + t0) * D);
      quantize_per_channel(l.k.data() + off, G, D, D, k_bits, l.kc.data() + off, kp.data());
      quantize_per_token(l.v.data() + off, G, D, D, G, v_bits, l.vc.data() + off, vp.data());
    }
}

// What codes without information give: each key group (channel x G tokens) and value group
// (token x G channels) replaced by its mean.
double group_mean_nmse(const Layer& l, bool keys, int64_t G) {
  const int64_t T = l.tokens, D = l.dim;
  const auto& x = keys ? l.k : l.v;
  std::vector<float> rec(x.size());
  for (int64_t s = 0; s < l.streams; ++s)
    for (int64_t t0 = 0; t0 < T; t0 += G) {
      const float* blk = x.data() + (s * T + t0) * D;
      float* out = rec.data() + (s * T + t0) * D;
      if (keys) {
        for (int64_t d = 0; d < D; ++d) {
          double m = 0;
          for (int64_t t = 0; t < G; ++t) m += blk[t * D + d];
          for (int64_t t = 0; t < G; ++t)
            out[t * D + d] = static_cast<float>(m / static_cast<double>(G));
        }
      } else {
        for (int64_t t = 0; t < G; ++t)
          for (int64_t d0 = 0; d0 < D; d0 += G) {
            const int64_t n = std::min(G, D - d0);
            double m = 0;
            for (int64_t d = 0; d < n; ++d) m += blk[t * D + d0 + d];
            for (int64_t d = 0; d < n; ++d)
              out[t * D + d0 + d] = static_cast<float>(m / static_cast<double>(n));
          }
      }
    }
  return nmse(rec, x);
}

double agreement(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t same = 0;
  for (size_t i = 0; i < a.size(); ++i) same += a[i] == b[i];
  return a.empty() ? 0.0 : static_cast<double>(same) / static_cast<double>(a.size());
}

double chance_agreement(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  std::vector<double> pa(256, 0.0), pb(256, 0.0);
  for (uint8_t c : a) pa[c] += 1;
  for (uint8_t c : b) pb[c] += 1;
  double s = 0;
  for (int c = 0; c < 256; ++c) s += pa[static_cast<size_t>(c)] * pb[static_cast<size_t>(c)];
  return a.empty() ? 0.0 : s / (static_cast<double>(a.size()) * static_cast<double>(b.size()));
}

LayerShape shape_of(const Layer& l) {
  return LayerShape{static_cast<int>(l.heads), static_cast<int>(l.dim), 0};
}

Status append(LayerCache& c, const Layer& l) {
  return c.append(TensorView::bhsd(l.k.data(), DType::kF32, l.batch, l.heads, l.tokens, l.dim),
                  TensorView::bhsd(l.v.data(), DType::kF32, l.batch, l.heads, l.tokens, l.dim));
}

Status read(const LayerCache& c, const Layer& l, std::vector<float>& k, std::vector<float>& v) {
  k.resize(l.k.size());
  v.resize(l.v.size());
  return c.read(0, l.tokens,
                MutTensorView::bhsd(k.data(), DType::kF32, l.batch, l.heads, l.tokens, l.dim),
                MutTensorView::bhsd(v.data(), DType::kF32, l.batch, l.heads, l.tokens, l.dim));
}

// nmse of layer j (K, V) compressed as a reuse layer of anchor i (i < 0: as an anchor).
Result<std::pair<double, double>> measure(const Spec& base, const Layer* anchor, const Layer& l) {
  ModelShape sh;
  sh.n_layers = anchor ? 2 : 1;
  if (anchor)
    sh.per_layer = {shape_of(*anchor), shape_of(l)};
  else
    sh.per_layer = {shape_of(l)};
  LayerOverrides ov;
  if (anchor) ov[1] = "anchor=0";
  KVQ_ASSIGN_OR_RETURN(ModelCache c, ModelCache::create(base, sh, ov));
  if (anchor) KVQ_RETURN_IF_ERROR(append(c.layer(0), *anchor));
  LayerCache& me = c.layer(anchor ? 1 : 0);
  KVQ_RETURN_IF_ERROR(append(me, l));
  std::vector<float> k, v;
  KVQ_RETURN_IF_ERROR(read(me, l, k, v));
  return std::make_pair(nmse(k, l.k), nmse(v, l.v));
}

json::Value matrix(const std::vector<std::vector<std::optional<double>>>& m) {
  json::Value rows = json::Value::array();
  for (const auto& r : m) {
    json::Value row = json::Value::array();
    for (const auto& x : r) row.push(x ? json::Value::number(*x) : json::Value::null());
    rows.push(std::move(row));
  }
  return rows;
}

Status run_xquant_pairs(const ParsedArgs& a) {
  auto spec = parse_spec(*a.get("method"));
  if (!spec.ok()) return spec.status();
  if (spec->method_name() != "xquant")
    return invalid_argument("--method must be an xquant spec, got " + spec->method_name());
  auto max_tokens = a.get_int("max-tokens", int64_t{1} << 40);
  if (!max_tokens.ok()) return max_tokens.status();
  if (*max_tokens < 1) return out_of_range("--max-tokens must be >= 1");
  auto max_cost = a.get_double("max-cost", 1e300);
  if (!max_cost.ok()) return max_cost.status();

  auto file = read_safetensors(*a.get("input"));
  if (!file.ok()) return file.status();
  auto loaded = load_layers(*file, *max_tokens);
  if (!loaded.ok()) return loaded.status().with_context(*a.get("input"));
  std::vector<Layer> layers = std::move(*loaded);
  const int L = static_cast<int>(layers.size());
  const int64_t G = spec->get_int("group");
  const int kb = static_cast<int>(spec->get_int("k_bits")),
            vb = static_cast<int>(spec->get_int("v_bits"));
  for (auto& l : layers) {
    l.tokens = l.tokens / G * G;  // whole blocks only: everything measured is sealed
    if (l.tokens == 0) return out_of_range("fewer tokens than one group of " + std::to_string(G));
    l.k.resize(static_cast<size_t>(l.streams * l.tokens * l.dim));
    l.v.resize(l.k.size());
    own_codes(l, G, kb, vb);
  }
  auto reuse_n = a.get_int("reuse", L / 2);
  if (!reuse_n.ok()) return reuse_n.status();
  if (*reuse_n < 0 || *reuse_n >= L)
    return out_of_range("--reuse must be in [0, " + std::to_string(L - 1) + "]");

  // Measurement spec: everything sealed (no window), layer roles set per measurement.
  Spec meas = *spec;
  if (Status st = meas.apply("residual=0,pairing=explicit,anchor=-1"); !st.ok()) return st;

  using Mat = std::vector<std::vector<std::optional<double>>>;
  const auto n = static_cast<size_t>(L);
  Mat cos_k(n, std::vector<std::optional<double>>(n)),
      cos_v = cos_k, agree_k = cos_k, agree_v = cos_k, chance_k = cos_k, chance_v = cos_k,
      reuse_k = cos_k, reuse_v = cos_k;
  std::vector<double> own_k(n), own_v(n), mean_k(n), mean_v(n);
  std::vector<Status> errors(n * n);
  model::parallel_for(int64_t{L} * L, [&](int64_t p) {
    const size_t i = static_cast<size_t>(p / L), j = static_cast<size_t>(p % L);
    if (i == j) {
      auto own = measure(meas, nullptr, layers[j]);
      if (!own.ok()) {
        errors[static_cast<size_t>(p)] = own.status();
        return;
      }
      own_k[j] = own->first;
      own_v[j] = own->second;
      mean_k[j] = group_mean_nmse(layers[j], true, G);
      mean_v[j] = group_mean_nmse(layers[j], false, G);
      return;
    }
    if (i > j || !same_shape(layers[i], layers[j])) return;
    cos_k[i][j] = cos_k[j][i] = cosine(layers[i].k, layers[j].k);
    cos_v[i][j] = cos_v[j][i] = cosine(layers[i].v, layers[j].v);
    agree_k[i][j] = agree_k[j][i] = agreement(layers[i].kc, layers[j].kc);
    agree_v[i][j] = agree_v[j][i] = agreement(layers[i].vc, layers[j].vc);
    chance_k[i][j] = chance_k[j][i] = chance_agreement(layers[i].kc, layers[j].kc);
    chance_v[i][j] = chance_v[j][i] = chance_agreement(layers[i].vc, layers[j].vc);
    auto r = measure(meas, &layers[i], layers[j]);
    if (!r.ok()) {
      errors[static_cast<size_t>(p)] = r.status();
      return;
    }
    reuse_k[i][j] = r->first;
    reuse_v[i][j] = r->second;
  });

  for (const Status& st : errors)
    if (!st.ok()) return st;

  // Greedy choice: cheapest pairs first; a reuse layer's anchor must stay an anchor.
  struct Cand {
    double cost;
    size_t i, j;
  };
  std::vector<Cand> cands;
  for (size_t i = 0; i < n; ++i)
    for (size_t j = i + 1; j < n; ++j)
      if (reuse_k[i][j]) cands.push_back({(*reuse_k[i][j] + *reuse_v[i][j]) / 2, i, j});
  std::stable_sort(cands.begin(), cands.end(),
                   [](const Cand& x, const Cand& y) { return x.cost < y.cost; });
  enum Role { kFree, kAnchor, kReuse };
  std::vector<Role> role(n, kFree);
  std::vector<Cand> chosen;
  for (const Cand& c : cands) {
    if (static_cast<int64_t>(chosen.size()) >= *reuse_n || c.cost > *max_cost) break;
    if (role[c.j] != kFree || role[c.i] == kReuse) continue;
    role[c.i] = kAnchor;
    role[c.j] = kReuse;
    chosen.push_back(c);
  }
  std::sort(chosen.begin(), chosen.end(), [](const Cand& x, const Cand& y) { return x.j < y.j; });

  // The choice as a spec string (layer numbers of the model), checked on the whole dump.
  Spec out_spec = *spec;
  (void)out_spec.apply("pairing=explicit,anchor=-1");
  std::string spec_text = out_spec.to_string();
  LayerOverrides ov;
  for (const Cand& c : chosen) {
    spec_text +=
        "@" + std::to_string(layers[c.j].index) + ":anchor=" + std::to_string(layers[c.i].index);
    ov[static_cast<int>(c.j)] = "anchor=" + std::to_string(c.i);
  }
  ModelShape sh;
  sh.n_layers = L;
  for (const auto& l : layers) sh.per_layer.push_back(shape_of(l));
  auto check = ModelCache::create(meas, sh, ov);
  if (!check.ok()) return check.status();
  double ek = 0, ev = 0;
  for (int l = 0; l < L; ++l) {
    const Layer& ly = layers[static_cast<size_t>(l)];
    if (Status st = append(check->layer(l), ly); !st.ok()) return st;
    std::vector<float> k, v;
    if (Status st = read(check->layer(l), ly, k, v); !st.ok()) return st;
    ek += nmse(k, ly.k) / L;
    ev += nmse(v, ly.v) / L;
  }
  const double bits = check->bytes().bits_per_element();

  if (a.has("json")) {
    json::Value r = json::Value::object();
    r.set("input", json::Value::string(*a.get("input")));
    r.set("method", json::Value::string(spec->to_string()));
    r.set("tokens", json::Value::number(static_cast<double>(layers[0].tokens)));
    json::Value idx = json::Value::array();
    for (const auto& l : layers) idx.push(json::Value::number(l.index));
    r.set("layers", std::move(idx));
    r.set("cos_k", matrix(cos_k));
    r.set("cos_v", matrix(cos_v));
    r.set("agree_k", matrix(agree_k));
    r.set("agree_v", matrix(agree_v));
    r.set("chance_k", matrix(chance_k));
    r.set("chance_v", matrix(chance_v));
    r.set("reuse_nmse_k", matrix(reuse_k));
    r.set("reuse_nmse_v", matrix(reuse_v));
    auto vec = [](const std::vector<double>& x) {
      json::Value v = json::Value::array();
      for (double d : x) v.push(json::Value::number(d));
      return v;
    };
    r.set("own_nmse_k", vec(own_k));
    r.set("own_nmse_v", vec(own_v));
    r.set("mean_nmse_k", vec(mean_k));
    r.set("mean_nmse_v", vec(mean_v));
    json::Value pairs = json::Value::array();
    for (const Cand& c : chosen) {
      json::Value p = json::Value::object();
      p.set("anchor", json::Value::number(layers[c.i].index));
      p.set("layer", json::Value::number(layers[c.j].index));
      p.set("cost", json::Value::number(c.cost));
      pairs.push(std::move(p));
    }
    r.set("pairs", std::move(pairs));
    r.set("spec", json::Value::string(spec_text));
    r.set("bits_per_element", json::Value::number(bits));
    r.set("nmse_k", json::Value::number(ek));
    r.set("nmse_v", json::Value::number(ev));
    std::printf("%s\n", r.dump(1).c_str());
    return ok_status();
  }
  std::printf("input   %s (%d layers x %lld tokens)\nmethod  %s\n\n", a.get("input")->c_str(), L,
              static_cast<long long>(layers[0].tokens), spec->to_string().c_str());
  std::printf(
      "Adjacent layers (nmse: normalized MSE; own = quantized as an anchor, mean = one value per "
      "group)\n");
  std::printf("%5s %7s %7s %13s %13s %10s %10s %10s %10s %10s %10s\n", "i->j", "cos_k", "cos_v",
              "agree_k/chn", "agree_v/chn", "reuse_k", "reuse_v", "own_k", "own_v", "mean_k",
              "mean_v");
  for (size_t j = 1; j < n; ++j) {
    const size_t i = j - 1;
    if (!reuse_k[i][j]) continue;
    std::printf(
        "%2d->%-2d %7.3f %7.3f   %5.3f/%5.3f   %5.3f/%5.3f %10.3e %10.3e %10.3e %10.3e %10.3e "
        "%10.3e\n",
        layers[i].index, layers[j].index, *cos_k[i][j], *cos_v[i][j], *agree_k[i][j],
        *chance_k[i][j], *agree_v[i][j], *chance_v[i][j], *reuse_k[i][j], *reuse_v[i][j], own_k[j],
        own_v[j], mean_k[j], mean_v[j]);
  }
  std::printf("\nBest earlier anchor per layer (lowest mean K/V reuse nmse)\n");
  for (size_t j = 1; j < n; ++j) {
    std::optional<size_t> best;
    for (size_t i = 0; i < j; ++i)
      if (reuse_k[i][j] &&
          (!best || *reuse_k[i][j] + *reuse_v[i][j] < *reuse_k[*best][j] + *reuse_v[*best][j]))
        best = i;
    if (best)
      std::printf(
          "  layer %2d <- %2d   reuse_k %.3e  reuse_v %.3e   (max |cos_k| over anchors %.3f)\n",
          layers[j].index, layers[*best].index, *reuse_k[*best][j], *reuse_v[*best][j], [&] {
            double m = 0;
            for (size_t i = 0; i < j; ++i)
              if (cos_k[i][j]) m = std::max(m, std::fabs(*cos_k[i][j]));
            return m;
          }());
  }
  std::printf("\nChosen: %zu reuse layer(s)\n", chosen.size());
  for (const Cand& c : chosen)
    std::printf("  layer %2d reuses layer %2d   cost %.3e\n", layers[c.j].index, layers[c.i].index,
                c.cost);
  std::printf("\nspec    %s\n", spec_text.c_str());
  std::printf("check   %.4f bits/element without the fp16 window; mean nmse K %.3e, V %.3e\n", bits,
              ek, ev);
  return ok_status();
}

}  // namespace

Command xquant_pairs_command() {
  Command c("xquant-pairs", "measure cross-layer K/V similarity and choose XQuant pairs",
            "--input KV.safetensors [--method SPEC] [--reuse N] [--max-cost E] [--json]",
            run_xquant_pairs);
  c.description =
      "Measures cross-layer similarity of a K/V dump (raw cosine, code agreement, "
      "reuse error)\nand prints the XQuant pairing it implies as a model spec string.";
  c.options = {
      option("input", "KV.safetensors", "safetensors K/V dump of every layer (kvq dump-kv)")
          .required(),
      option("method", "SPEC", "xquant spec whose bits, group, fit, eta and res_bits are measured")
          .defaults_to("xquant"),
      option("reuse", "N", "number of reuse layers to choose (default: half the layers)"),
      option("max-cost", "E", "stop choosing once the reuse cost (mean K/V nmse) exceeds this"),
      option("max-tokens", "N", "use at most this many tokens of the dump"),
      flag("json", "print one JSON object with every table")};
  return c;
}

}  // namespace kvq::cli
