// CacheGen benchmarks and the real-KV size report (docs/methods/cachegen.md).
//
// Speed of the entropy stage on real KV symbols (one core; pin it with taskset -c 1):
//   KVQ_KV=kv.safetensors build/kvq_bench --benchmark_filter='Cachegen(Decode|Encode)'
// Without KVQ_KV the symbols come from the synthetic generator (entropy/kv_synth.h).
// Peers on the same streams (zstd, Huffman-only deflate, memcpy):
//   KVQ_KV=kv.safetensors build/kvq_bench --benchmark_filter='CachegenPeer'
// Symbols/s are items_per_second. Chunks are one (layer, head, K|V) stream of `chunk` tokens x
// head_dim channels, transformed exactly as the cache does (numerics/cachegen.h).
//
// Size report (not a speed measurement; one iteration, prints Markdown tables):
//   KVQ_KV=kv.safetensors KVQ_CACHEGEN_SPECS='cachegen;cachegen:delta=auto' \
//     build/kvq_bench --benchmark_filter=CachegenReport
// For each spec: a ModelCache over every layer of the dump (each layer appended in one call),
// then per layer and part: the Shannon estimate of the symbols the coder received (per chunk,
// per channel), the actual coded bytes the cache holds (payload + headers + inline tables +
// stream index/masks + shared tables), fixed-width packed codes, and zstd at its strongest level
// over the same packed codes (all chunks of the layer's part concatenated: zstd gets the whole
// layer as one frame, which favours it). Parameters (fp16 scale/zero) are the same for all four
// and reported once; the fp16 window is not in the table. KVQ_CACHEGEN_CSV=path also writes the
// per-layer rows as CSV.
#include <benchmark/benchmark.h>
#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "entropy/kv_synth.h"
#include "entropy/symbol_codec.h"
#include "kvq/bitpack.h"
#include "kvq/cache.h"
#include "kvq/safetensors.h"
#include "entropy/cachegen_codes.h"

namespace kvq {
namespace {

using cachegen::Axis;
using cachegen::DeltaMode;

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

struct Dump {
  SafeTensorsFile file;
  std::vector<std::pair<TensorView, TensorView>> layers;  // k, v [B, H, S, D]
};

// The K/V dump named by KVQ_KV, loaded once (null without it or on error).
const Dump* dump() {
  static const Dump* d = []() -> const Dump* {
    const char* path = env("KVQ_KV");
    if (!path) return nullptr;
    auto f = read_safetensors(path);
    if (!f.ok()) {
      std::fprintf(stderr, "KVQ_KV: %s\n", f.status().to_string().c_str());
      return nullptr;
    }
    auto* out = new Dump{std::move(*f), {}};
    for (int l = 0; l < 4096; ++l) {  // a dump may hold some layers only (0, 10, 20, 29)
      const SafeTensor* k = out->file.find("layers." + std::to_string(l) + ".k");
      const SafeTensor* v = out->file.find("layers." + std::to_string(l) + ".v");
      if (!k || !v) continue;
      out->layers.emplace_back(*k->view4(), *v->view4());
    }
    return out;
  }();
  return d;
}

std::vector<float> to_f32(const TensorView& t, int64_t b, int64_t h, int64_t n) {
  std::vector<float> x(static_cast<size_t>(n * t.shape[3]));
  for (int64_t s = 0; s < n; ++s)
    for (int64_t d = 0; d < t.shape[3]; ++d)
      x[static_cast<size_t>(s * t.shape[3] + d)] = t.load(b, h, s, d);
  return x;
}

// ---------------------------------------------------------------------------------------------
// Speed: symbol chunks as the cache codes them.

struct Chunks {
  std::vector<std::vector<uint8_t>> sym;
  std::vector<int> set;                       // index into `shared` of each chunk's layer part
  std::vector<entropy::SharedTables> shared;  // the cache's prototypes (built from chunk 0)
  int64_t tokens = 0;
  int dim = 0;
};

// Prototype tables of one layer part from its first chunk's streams, as the cache builds them.
entropy::SharedTables prototypes(const std::vector<std::vector<uint8_t>>& first, int64_t tokens,
                                 int dim, int bits) {
  const int a = 1 << bits;
  std::vector<uint32_t> hists(first.size() * static_cast<size_t>(dim * a));
  for (size_t i = 0; i < first.size(); ++i)
    (void)entropy::count_symbols(first[i].data(), static_cast<size_t>(tokens * dim), bits, dim,
                                 hists.data() + i * static_cast<size_t>(dim * a));
  auto t = entropy::build_prototypes(hists.data(), static_cast<int>(first.size()) * dim, bits, 16,
                                     std::max(bits, entropy::kLutMaxProbBits));
  return std::move(*entropy::make_shared_tables(std::move(*t)));
}

// bits, part (0 keys, 1 values), delta mode, chunk tokens, quantization group. Real KV (every
// layer and head, every whole chunk) or synthetic.
Chunks make_chunks(int bits, int part, DeltaMode delta, int64_t chunk, int64_t group) {
  Chunks c;
  c.tokens = chunk;
  const Axis axis = part == 0 ? Axis::kChannel : Axis::kToken;
  if (const Dump* d = dump()) {
    for (const auto& [k, v] : d->layers) {
      const TensorView& t = part == 0 ? k : v;
      const int64_t n = t.shape[2] / chunk * chunk;
      c.dim = static_cast<int>(t.shape[3]);
      std::vector<std::vector<uint8_t>> first;
      for (int64_t h = 0; h < t.shape[1]; ++h) {
        const std::vector<float> x = to_f32(t, 0, h, n);
        for (int64_t t0 = 0; t0 < n; t0 += chunk) {
          auto cs =
              cachegen::quantize_to_codes(x.data() + t0 * c.dim, chunk, c.dim, bits, group, axis);
          std::vector<uint8_t> s(cs.codes.size()), mask(cachegen::mask_bytes(c.dim));
          cachegen::chunk_symbols(delta, group, cs.codes.data(), chunk, c.dim, bits, s.data(),
                                  mask.data());
          if (t0 == 0) first.push_back(s);
          c.sym.push_back(std::move(s));
          c.set.push_back(static_cast<int>(c.shared.size()));
        }
      }
      c.shared.push_back(prototypes(first, chunk, c.dim, bits));
    }
    return c;
  }
  c.dim = 64;
  for (uint64_t seed = 1; seed <= 16; ++seed) {
    entropy::SynthKvOptions o;
    o.bits = bits;
    o.keys = part == 0;
    o.token_delta = delta != DeltaMode::kNone;
    o.n_tokens = chunk;
    o.n_channels = c.dim;
    o.seed = seed;
    c.sym.push_back(entropy::synth_kv_symbols(o));
    c.set.push_back(0);
  }
  c.shared.push_back(prototypes({c.sym[0]}, chunk, c.dim, bits));
  return c;
}

DeltaMode delta_arg(int64_t v) { return static_cast<DeltaMode>(v); }

// The codec options CacheGen uses (src/methods/cachegen.cc): precision <= 2^7; with shared
// (prototype) tables no inline candidates, else inline tables, per channel or pooled.
entropy::SymbolCodecOptions cachegen_codec(bool shared) {
  entropy::SymbolCodecOptions o;
  o.layout = entropy::TableLayout::kAuto;
  o.prob_bits = entropy::kLutMaxProbBits;
  o.stats_shannon = false;
  o.inline_tables = !shared;
  return o;
}

// args: bits, part, delta (DeltaMode index), chunk tokens, group, shared (1 = the layer's
// prototype tables, the default; 0 = inline tables per chunk)
void BM_CachegenDecode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const bool shared = state.range(5) != 0;
  const Chunks c = make_chunks(bits, static_cast<int>(state.range(1)), delta_arg(state.range(2)),
                               state.range(3), state.range(4));
  std::vector<std::vector<uint8_t>> enc(c.sym.size());
  size_t total = 0, coded = 0;
  for (size_t i = 0; i < c.sym.size(); ++i) {
    const entropy::SharedTables* sh = shared ? &c.shared[static_cast<size_t>(c.set[i])] : nullptr;
    if (!entropy::encode_symbols(c.sym[i].data(), c.tokens, c.dim, bits, cachegen_codec(shared),
                                 enc[i], nullptr, sh)
             .ok())
      state.SkipWithError("encode failed");
    total += c.sym[i].size();
    coded += enc[i].size();
  }
  // A decoder holds only the serialized sets: it parses them per stream, as the cache does.
  std::vector<std::vector<uint8_t>> sets(c.shared.size());
  for (size_t i = 0; i < sets.size(); ++i) entropy::serialize_tables(c.shared[i].tables, sets[i]);
  std::vector<uint8_t> out(static_cast<size_t>(c.tokens * c.dim));
  Workspace ws;  // the caller-owned scratch a cache passes: warm after the first chunk
  for (auto _ : state) {
    for (size_t i = 0; i < enc.size(); ++i) {
      std::optional<entropy::SharedTables> sh;
      if (shared && (enc[i][0] & 3) == 3) {
        const auto& set = sets[static_cast<size_t>(c.set[i])];
        sh.emplace(std::move(*entropy::make_shared_tables(
            *entropy::deserialize_tables(set.data(), set.size()), entropy::RansModelUse::kDecode)));
      }
      Status s =
          entropy::decode_symbols(enc[i].data(), enc[i].size(), c.tokens, c.dim, bits, out.data(),
                                  sh ? &*sh : nullptr, entropy::RansImpl::kAuto, nullptr, &ws);
      benchmark::DoNotOptimize(out.data());
      if (!s.ok()) state.SkipWithError("decode failed");
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(total));
  state.counters["bits_per_sym"] = 8.0 * static_cast<double>(coded) / static_cast<double>(total);
  state.counters["chunks"] = static_cast<double>(enc.size());
  // Against the limit of an order-0 coder with these tables: the Shannon bits of each chunk's
  // symbols (per channel, as the size report counts them) plus the serialized shared tables;
  // coded counts the same tables. (Inline tables are inside `coded`: the ratio is then against
  // Shannon alone.)
  double shannon = 0, tables = 0;
  for (const auto& sym : c.sym)
    shannon += entropy::shannon_bits(sym.data(), c.tokens, c.dim, bits, true) / 8.0;
  if (shared)
    for (const auto& set : sets) tables += static_cast<double>(set.size());
  state.counters["shannon_bits_per_sym"] = 8.0 * shannon / static_cast<double>(total);
  state.counters["tables_bits_per_sym"] = 8.0 * tables / static_cast<double>(total);
  state.counters["vs_shannon_tables"] =
      (static_cast<double>(coded) + tables) / (shannon + tables);
}

// Peers on the same symbol streams as BM_CachegenDecode (one byte per symbol, each chunk coded
// on its own, as the cache's chunks are): zstd at levels 1, 3 and 19 (its literals go through
// Huff0 or raw, matches through FSE), deflate in its Huffman-only mode (zlib Z_HUFFMAN_ONLY: one
// order-0 Huffman code per block, no matches), and memcpy of the symbols (the limit).
// args: bits, part, coder (0 zstd-1, 1 zstd-3, 2 zstd-19, 3 huffman-only deflate, 4 memcpy),
// decode (0 encode, 1 decode). Defaults otherwise (delta auto, chunk 128, group 128).
size_t peer_encode(int coder, const std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
  if (coder <= 2) {
    static const int levels[] = {1, 3, 19};
    out.resize(ZSTD_compressBound(in.size()));
    static ZSTD_CCtx* cctx = ZSTD_createCCtx();
    const size_t n =
        ZSTD_compressCCtx(cctx, out.data(), out.size(), in.data(), in.size(), levels[coder]);
    if (ZSTD_isError(n)) std::abort();
    out.resize(n);
    return n;
  }
  if (coder == 3) {
    z_stream z{};
    if (deflateInit2(&z, 9, Z_DEFLATED, -15, 9, Z_HUFFMAN_ONLY) != Z_OK) std::abort();
    out.resize(deflateBound(&z, in.size()));
    z.next_in = const_cast<uint8_t*>(in.data());
    z.avail_in = static_cast<uInt>(in.size());
    z.next_out = out.data();
    z.avail_out = static_cast<uInt>(out.size());
    if (deflate(&z, Z_FINISH) != Z_STREAM_END) std::abort();
    out.resize(z.total_out);
    deflateEnd(&z);
    return out.size();
  }
  out = in;
  return out.size();
}

void peer_decode(int coder, const std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
  if (coder <= 2) {
    static ZSTD_DCtx* dctx = ZSTD_createDCtx();
    const size_t n = ZSTD_decompressDCtx(dctx, out.data(), out.size(), in.data(), in.size());
    if (n != out.size()) std::abort();
    return;
  }
  if (coder == 3) {
    z_stream z{};
    if (inflateInit2(&z, -15) != Z_OK) std::abort();
    z.next_in = const_cast<uint8_t*>(in.data());
    z.avail_in = static_cast<uInt>(in.size());
    z.next_out = out.data();
    z.avail_out = static_cast<uInt>(out.size());
    if (inflate(&z, Z_FINISH) != Z_STREAM_END) std::abort();
    inflateEnd(&z);
    return;
  }
  std::memcpy(out.data(), in.data(), out.size());
}

void BM_CachegenPeer(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const int coder = static_cast<int>(state.range(2));
  const bool decode = state.range(3) != 0;
  const Chunks c = make_chunks(bits, static_cast<int>(state.range(1)), DeltaMode::kAuto, 128, 128);
  size_t total = 0, coded = 0;
  double shannon = 0;
  std::vector<std::vector<uint8_t>> enc(c.sym.size());
  for (size_t i = 0; i < c.sym.size(); ++i) {
    coded += peer_encode(coder, c.sym[i], enc[i]);
    total += c.sym[i].size();
    shannon += entropy::shannon_bits(c.sym[i].data(), c.tokens, c.dim, bits, true) / 8.0;
  }
  std::vector<uint8_t> out(static_cast<size_t>(c.tokens * c.dim)), tmp;
  for (auto _ : state) {
    for (size_t i = 0; i < c.sym.size(); ++i) {
      if (decode)
        peer_decode(coder, enc[i], out);
      else
        peer_encode(coder, c.sym[i], tmp);
      benchmark::DoNotOptimize(out.data());
      benchmark::DoNotOptimize(tmp.data());
    }
  }
  if (decode) {  // the last chunk, checked
    peer_decode(coder, enc.back(), out);
    if (out != c.sym.back()) state.SkipWithError("peer decode differs");
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(total));
  state.counters["bits_per_sym"] = 8.0 * static_cast<double>(coded) / static_cast<double>(total);
  state.counters["shannon_bits_per_sym"] = 8.0 * shannon / static_cast<double>(total);
  state.counters["vs_shannon"] = static_cast<double>(coded) / shannon;
}
BENCHMARK(BM_CachegenPeer)
    ->ArgNames({"bits", "part", "coder", "decode"})
    ->ArgsProduct({{2, 4}, {0, 1}, {0, 1, 2, 3, 4}, {0, 1}})
    ->Unit(benchmark::kMillisecond);

void BM_CachegenEncode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const bool shared = state.range(5) != 0;
  const Chunks c = make_chunks(bits, static_cast<int>(state.range(1)), delta_arg(state.range(2)),
                               state.range(3), state.range(4));
  const entropy::SymbolCodecOptions o = cachegen_codec(shared);
  size_t total = 0, coded = 0;
  for (const auto& s : c.sym) total += s.size();
  std::vector<uint8_t> enc;
  enc.reserve(static_cast<size_t>(c.tokens * c.dim) + 64);
  Workspace ws;
  for (auto _ : state) {
    coded = 0;
    for (size_t i = 0; i < c.sym.size(); ++i) {
      const auto& s = c.sym[i];
      enc.clear();
      Status st = entropy::encode_symbols(
          s.data(), c.tokens, c.dim, bits, o, enc, nullptr,
          shared ? &c.shared[static_cast<size_t>(c.set[i])] : nullptr, nullptr, &ws);
      benchmark::DoNotOptimize(enc.data());
      coded += enc.size();
      if (!st.ok()) state.SkipWithError("encode failed");
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(total));
  state.counters["bits_per_sym"] = 8.0 * static_cast<double>(coded) / static_cast<double>(total);
}

void speed_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bits", "part", "delta", "chunk", "group", "shared"});
  const int kAuto = static_cast<int>(DeltaMode::kAuto);
  for (int bits : {2, 3, 4, 5})
    for (int part : {0, 1}) b->Args({bits, part, kAuto, 128, 128, 1});  // the defaults
  for (int part : {0, 1}) b->Args({4, part, kAuto, 128, 128, 0});       // inline tables
  for (int part : {0, 1}) b->Args({4, part, kAuto, 256, 256, 1});
  for (int part : {0, 1}) b->Args({4, part, kAuto, 256, 32, 1});  // KIVI's grouping
  b->Args({8, 1, static_cast<int>(DeltaMode::kNone), 256, 256, 0});
}

BENCHMARK(BM_CachegenDecode)->Apply(speed_args)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CachegenEncode)->Apply(speed_args)->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// Cache level, side by side with KIVI in one run: append every layer of the dump (encode) and
// read it all back (decode), one thread. items = K and V elements (as `kvq bench` counts them).

const std::vector<std::string>& cache_specs() {
  static const std::vector<std::string> specs = [] {
    std::vector<std::string> v = {"kivi:k_bits=4,v_bits=4", "kivi:k_bits=2,v_bits=2", "cachegen"};
    if (const char* e = env("KVQ_CACHEGEN_SPECS")) {
      std::string all = e;
      for (size_t pos = 0; pos <= all.size();) {
        const size_t semi = all.find(';', pos);
        const std::string one =
            all.substr(pos, semi == std::string::npos ? std::string::npos : semi - pos);
        if (!one.empty()) v.push_back(one);
        if (semi == std::string::npos) break;
        pos = semi + 1;
      }
    }
    return v;
  }();
  return specs;
}

struct CacheInput {
  ModelShape shape;
  std::vector<std::pair<TensorView, TensorView>> layers;
  std::vector<float> synth_k, synth_v;
  uint64_t elems = 0;
};

const CacheInput& cache_input() {
  static const CacheInput in = [] {
    CacheInput c;
    if (const Dump* d = dump()) {
      c.layers = d->layers;
    } else {  // 4 synthetic layers [1, 3, 2048, 64] from the symbol generator's cousin
      const int64_t H = 3, S = 2048, D = 64;
      std::mt19937 rng(1);
      std::normal_distribution<float> n(0.0f, 1.0f);
      c.synth_k.resize(static_cast<size_t>(H * S * D));
      c.synth_v.resize(c.synth_k.size());
      for (auto* x : {&c.synth_k, &c.synth_v})
        for (int64_t hd = 0; hd < H * D; ++hd) {
          float v = n(rng);
          for (int64_t t = 0; t < S; ++t) {
            v = 0.9f * v + 0.4f * n(rng);
            (*x)[static_cast<size_t>(((hd / D) * S + t) * D + hd % D)] = v;
          }
        }
      for (int l = 0; l < 4; ++l)
        c.layers.emplace_back(TensorView::bhsd(c.synth_k.data(), DType::kF32, 1, H, S, D),
                              TensorView::bhsd(c.synth_v.data(), DType::kF32, 1, H, S, D));
    }
    c.shape.n_layers = static_cast<int>(c.layers.size());
    for (const auto& [k, v] : c.layers) {
      c.shape.per_layer.push_back(
          LayerShape{static_cast<int>(k.shape[1]), static_cast<int>(k.shape[3]), 0});
      c.elems += 2 * static_cast<uint64_t>(k.numel());
    }
    return c;
  }();
  return in;
}

// The spec named by the benchmark's argument (an index into cache_specs()), or null after
// marking the benchmark skipped.
const std::string* spec_arg(benchmark::State& state) {
  const auto& specs = cache_specs();
  if (static_cast<size_t>(state.range(0)) < specs.size())
    return &specs[static_cast<size_t>(state.range(0))];
  state.SkipWithError("no such spec (KVQ_CACHEGEN_SPECS adds some)");
  for (auto _ : state) {
  }
  return nullptr;
}

void BM_CacheAppend(benchmark::State& state) {
  const std::string* spec_p = spec_arg(state);
  if (!spec_p) return;
  const std::string& spec = *spec_p;
  const CacheInput& in = cache_input();
  auto cache = ModelCache::create(spec, in.shape);
  if (!cache.ok()) {
    state.SkipWithError(cache.status().to_string().c_str());
    return;
  }
  for (auto _ : state) {
    state.PauseTiming();
    cache->reset();
    state.ResumeTiming();
    for (int l = 0; l < in.shape.n_layers; ++l) {
      Status st = cache->layer(l).append(in.layers[static_cast<size_t>(l)].first,
                                         in.layers[static_cast<size_t>(l)].second);
      if (!st.ok()) state.SkipWithError(st.to_string().c_str());
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(in.elems));
  state.SetLabel(cache->spec().to_string());
  state.counters["bits_per_elem"] = cache->bytes().bits_per_element();
}

void BM_CacheRead(benchmark::State& state) {
  const std::string* spec = spec_arg(state);
  if (!spec) return;
  const CacheInput& in = cache_input();
  auto cache = ModelCache::create(*spec, in.shape);
  if (!cache.ok()) {
    state.SkipWithError(cache.status().to_string().c_str());
    return;
  }
  std::vector<std::vector<float>> ko(in.layers.size()), vo(in.layers.size());
  for (int l = 0; l < in.shape.n_layers; ++l) {
    const auto& [k, v] = in.layers[static_cast<size_t>(l)];
    if (!cache->layer(l).append(k, v).ok()) state.SkipWithError("append failed");
    ko[static_cast<size_t>(l)].resize(static_cast<size_t>(k.numel()));
    vo[static_cast<size_t>(l)].resize(static_cast<size_t>(k.numel()));
  }
  for (auto _ : state) {
    for (int l = 0; l < in.shape.n_layers; ++l) {
      const auto& s = in.layers[static_cast<size_t>(l)].first.shape;
      Status st = cache->layer(l).read(0, s[2],
                                       MutTensorView::bhsd(ko[static_cast<size_t>(l)].data(),
                                                           DType::kF32, s[0], s[1], s[2], s[3]),
                                       MutTensorView::bhsd(vo[static_cast<size_t>(l)].data(),
                                                           DType::kF32, s[0], s[1], s[2], s[3]));
      if (!st.ok()) state.SkipWithError(st.to_string().c_str());
    }
    benchmark::DoNotOptimize(ko.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(in.elems));
  state.SetLabel(cache->spec().to_string());
}

// Interleaved (KIVI, CacheGen, KIVI, ...) so a load change on the shared machine hits both.
BENCHMARK(BM_CacheAppend)->DenseRange(0, 5)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CacheRead)->DenseRange(0, 5)->Unit(benchmark::kMillisecond);

// ---------------------------------------------------------------------------------------------
// The size report.

std::map<std::string, std::string> parse_stats(const std::string& s) {
  std::map<std::string, std::string> out;
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return out;
}

struct PartRow {
  double shannon = 0;  // bytes (fractional)
  double coded = 0;    // everything but params
  double tables = 0;   // inline + shared
  double packed = 0;
  double zstd = 0;
  double params = 0;
  double symbols = 0;
  PartRow& operator+=(const PartRow& o) {
    shannon += o.shannon, coded += o.coded, tables += o.tables, packed += o.packed, zstd += o.zstd;
    params += o.params, symbols += o.symbols;
    return *this;
  }
};

void report_spec(const std::string& spec_text, FILE* csv) {
  const Dump* d = dump();
  auto spec = parse_model_spec(spec_text);
  if (!spec.ok()) {
    std::printf("%s: %s\n", spec_text.c_str(), spec.status().to_string().c_str());
    return;
  }
  ModelShape shape;
  shape.n_layers = static_cast<int>(d->layers.size());
  for (const auto& [k, v] : d->layers)
    shape.per_layer.push_back(
        LayerShape{static_cast<int>(k.shape[1]), static_cast<int>(k.shape[3]), 0});
  auto cache = ModelCache::create(spec_text, shape);
  if (!cache.ok()) {
    std::printf("%s: %s\n", spec_text.c_str(), cache.status().to_string().c_str());
    return;
  }
  const Spec& s = spec->spec;
  const int64_t group = s.get_int("group"), chunk = s.get_int("chunk");
  const DeltaMode delta = [&] {
    const std::string& m = s.get_enum("delta");
    return m == "none"     ? DeltaMode::kNone
           : m == "token"  ? DeltaMode::kToken
           : m == "group"  ? DeltaMode::kGroup
           : m == "anchor" ? DeltaMode::kAnchor
                           : DeltaMode::kAuto;
  }();
  const bool pooled = s.get_enum("tables") == "pooled";
  const Axis v_axis = s.get_enum("values") == "token" ? Axis::kToken : Axis::kChannel;
  std::printf("\n### %s\n\n", cache->spec().to_string().c_str());
  std::printf(
      "Bytes per layer, K+V, over the sealed tokens (the fp16 window is not counted). "
      "coded = payload + headers + inline tables + index/masks + shared tables.\n\n");
  std::printf(
      "| layer | bits | Shannon | coded | tables | packed | zstd-%d | params | "
      "coded/(Shannon+tables) | saved vs packed |\n",
      ZSTD_maxCLevel());
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  PartRow total[2];
  int64_t sealed_total = 0;
  for (int l = 0; l < shape.n_layers; ++l) {
    const auto& [kt, vt] = d->layers[static_cast<size_t>(l)];
    LayerCache& layer = cache->layer(l);
    if (!layer.append(kt, vt).ok()) {
      std::printf("append failed\n");
      return;
    }
    const auto st = parse_stats(layer.stats());
    const int bits = std::stoi(st.at("bits"));
    const int64_t sealed = layer.sealed_tokens();
    sealed_total = sealed;
    PartRow row[2];
    for (int part = 0; part < 2; ++part) {
      const std::string p = part == 0 ? "key_" : "value_";
      auto num = [&](const char* k) { return std::stod(st.at(p + k)); };
      PartRow& r = row[part];
      r.coded = num("payload_bytes") + num("header_bytes") + num("inline_table_bytes") +
                num("shared_table_bytes") + num("index_bytes");
      r.tables = num("inline_table_bytes") + num("shared_table_bytes");
      r.params = num("param_bytes");
      const TensorView& t = part == 0 ? kt : vt;
      const Axis axis = part == 0 ? Axis::kChannel : v_axis;
      const int64_t D = t.shape[3];
      std::vector<uint8_t> packed_all;
      std::vector<uint8_t> sym(static_cast<size_t>(chunk * D)), mask(cachegen::mask_bytes(D));
      for (int64_t b = 0; b < t.shape[0]; ++b)
        for (int64_t h = 0; h < t.shape[1]; ++h) {
          if (sealed == 0) continue;
          const std::vector<float> x = to_f32(t, b, h, sealed);
          for (int64_t t0 = 0; t0 < sealed; t0 += chunk) {
            auto cs = cachegen::quantize_to_codes(x.data() + t0 * D, chunk, D, bits, group, axis);
            const size_t at = packed_all.size();
            packed_all.resize(at + packed_size(cs.codes.size(), bits));
            pack_bits(cs.codes.data(), cs.codes.size(), bits, packed_all.data() + at);
            cachegen::chunk_symbols(delta, group, cs.codes.data(), chunk, D, bits, sym.data(),
                                    mask.data());
            r.shannon +=
                entropy::shannon_bits(sym.data(), chunk, static_cast<int>(D), bits, !pooled) / 8.0;
            r.symbols += static_cast<double>(cs.codes.size());
          }
        }
      r.packed = static_cast<double>(packed_all.size());
      std::vector<uint8_t> z(ZSTD_compressBound(packed_all.size()));
      const size_t zn =
          ZSTD_compress(z.data(), z.size(), packed_all.data(), packed_all.size(), ZSTD_maxCLevel());
      r.zstd = ZSTD_isError(zn) ? NAN : static_cast<double>(zn);
      total[part] += r;
    }
    const PartRow kv = PartRow(row[0]) += row[1];
    std::printf("| %d | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.4f | %.1f%% |\n", l, bits,
                kv.shannon, kv.coded, kv.tables, kv.packed, kv.zstd, kv.params,
                kv.coded / (kv.shannon + kv.tables), 100.0 * (1.0 - kv.coded / kv.packed));
    if (csv)
      for (int part = 0; part < 2; ++part)
        std::fprintf(csv, "\"%s\",%d,%s,%d,%.1f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f\n",
                     cache->spec().to_string().c_str(), l, part ? "v" : "k", bits,
                     row[part].shannon, row[part].coded, row[part].tables, row[part].packed,
                     row[part].zstd, row[part].params, row[part].symbols);
  }
  std::printf("\nTotals (%lld sealed tokens per layer):\n\n", static_cast<long long>(sealed_total));
  std::printf(
      "| part | Shannon b/sym | coded b/sym | tables b/sym | packed b/sym | zstd b/sym | "
      "coded/(Shannon+tables) | "
      "saved vs packed | zstd saved vs packed |\n| --- | --- | --- | --- | --- | --- | --- | --- | "
      "--- |\n");
  PartRow all = total[0];
  all += total[1];
  const char* names[3] = {"keys", "values", "K+V"};
  const PartRow* rows[3] = {&total[0], &total[1], &all};
  for (int i = 0; i < 3; ++i) {
    const PartRow& r = *rows[i];
    const double n = r.symbols / 8.0;
    std::printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.4f | %.1f%% | %.1f%% |\n", names[i],
                r.shannon / n, r.coded / n, r.tables / n, r.packed / n, r.zstd / n,
                r.coded / (r.shannon + r.tables), 100.0 * (1.0 - r.coded / r.packed),
                100.0 * (1.0 - r.zstd / r.packed));
  }
  const CacheBytes cb = cache->bytes();
  std::printf(
      "\nAll-in (params, fp16 window and everything else included): %.4f bits/element; "
      "sealed part only (codes + params + meta over sealed elements): %.4f\n",
      cb.bits_per_element(),
      8.0 * static_cast<double>(cb.key_codes + cb.value_codes + cb.params + cb.meta) /
          (all.symbols));
  std::fflush(stdout);
}

void BM_CachegenReport(benchmark::State& state) {
  const Dump* d = dump();
  if (!d || d->layers.empty()) {
    state.SkipWithError("set KVQ_KV to a kvq dump-kv safetensors file");
    for (auto _ : state) {
    }
    return;
  }
  FILE* csv = nullptr;
  if (const char* p = env("KVQ_CACHEGEN_CSV")) {
    csv = std::fopen(p, "a");
  }
  for (auto _ : state) {
    std::string specs = env("KVQ_CACHEGEN_SPECS") ? env("KVQ_CACHEGEN_SPECS") : "cachegen";
    size_t pos = 0;
    while (pos <= specs.size()) {
      const size_t semi = specs.find(';', pos);
      const std::string one =
          specs.substr(pos, semi == std::string::npos ? std::string::npos : semi - pos);
      if (!one.empty()) report_spec(one, csv);
      if (semi == std::string::npos) break;
      pos = semi + 1;
    }
  }
  if (csv) std::fclose(csv);
}

BENCHMARK(BM_CachegenReport)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace
}  // namespace kvq
