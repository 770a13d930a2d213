// Kernels against the limit and the peers (docs/results.md, "Kernels against the limit and the
// peers"): each kvq kernel beside memcpy of the same input bytes and, built with
// -DKVQ_GGML_DIR=<a ggml build> (CMakeLists.txt), ggml's own row functions on the same floats.
// One core: pin it (taskset -c 1); items are elements (K and V together), so items_per_second
// is elements/s; bytes_per_second is the fp32 bytes those elements are. Rates are per CPU
// second of the benchmark's thread (Google Benchmark's default), so that time the shared core
// spent on other processes is not counted; its caches are still shared.
//
//   KVQ_KV=kv.safetensors taskset -c 1 build/kvq_bench --benchmark_filter='^Kernel/'
//
// Input: every layer of the dump named by KVQ_KV (a `kvq dump-kv` file, layers.N.{k,v}
// [1, H, S, D]; SmolLM2's has 4 layers x 3 heads x 2048 tokens x 64: 3.1 M elements, 12.6 MB of
// fp32, inside L3 and above L2), else 4 synthetic layers of that shape (kvq/synthetic.h).
//   memcpy                       the fp32 K and V copied: reads and writes 4 bytes per element,
//                                more traffic than any kernel below (a quantizer reads 4 and
//                                writes < 1, a dequantizer the reverse)
//   kivi_{2,4}/encode            KIVI's codec, block by block (32 tokens x H x D; keys per
//                                channel, values per token): quantize + pack, parameters, the
//                                block's allocation: what a sealing append runs
//   kivi_{2,4}/quantize, /pack   the two halves of that (group_quant.h on the same blocks; pack_bits
//                                of the codes)
//   kivi_{2,4}/decode            the codec's decode of every stream (unpack + dequantize)
//   {q4_0,q8_0}/kvq_quantize     kvq's rows (methods/ggml_rows.h, no rotation) over token rows of
//                                H x D values (llama.cpp's K/V cache rows)
//   {q4_0,q8_0}/ggml_quantize_ref  ggml's quantize_row_<t>_ref (ggml-base; the bytes kvq matches)
//   {q4_0,q8_0}/ggml_quantize    ggml's CPU from_float (ggml-cpu, -march=native; q8_0 has AVX
//                                code, q4_0 calls the reference)
//   {q4_0,q8_0}/kvq_dequantize, /ggml_dequantize  the reverse (ggml: to_float, ggml-base)
//   append/<spec>                a ModelCache append of every layer in one call, with the dump's
//                                queries (ZipCache's attention saliency needs them): KIVI vs
//                                ZipCache end to end
// The `same_bytes` counter is 1 when kvq's stored bytes equal ggml's reference bytes (dequantize:
// equal floats), checked once per benchmark.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench_io.h"
#include "cache/codec.h"
#include "kvq/bitpack.h"
#include "kvq/cache.h"
#include "kvq/group_quant.h"
#include "kvq/safetensors.h"
#include "kvq/spec.h"
#include "kvq/synthetic.h"
#include "methods/ggml_rows.h"

#if KVQ_HAVE_GGML
#include "ggml-cpu.h"
#include "ggml.h"
#endif

namespace kvq {
namespace {

using bench::load_f32;

constexpr int64_t kBlock = 32;  // KIVI's default group: tokens per sealed block

struct Layer {
  int64_t H = 0, S = 0, D = 0, Hq = 0;
  std::vector<float> k, v, q;  // [H, S, D] (q: [Hq, S, D], may be empty)
};

struct Input {
  std::vector<Layer> layers;
  std::string source;
  int64_t elems = 0;  // K and V
  // The same elements three ways: as stored in the dump ([layer][K|V][H][S][D]), in KIVI blocks
  // ([layer][block][K|V][H][T][D]) and as token rows ([layer][K|V][S][H * D], llama.cpp's).
  std::vector<float> flat, blocks, rows;
};

const Input& input() {
  static const Input in = [] {
    Input r;
    const char* path = std::getenv("KVQ_KV");
    if (path && *path) {
      auto f = read_safetensors(path);
      if (!f.ok()) {
        std::fprintf(stderr, "KVQ_KV: %s\n", f.status().to_string().c_str());
        std::abort();
      }
      for (int l = 0; l < 4096; ++l) {
        const std::string p = "layers." + std::to_string(l) + ".";
        const SafeTensor* k = f->find(p + "k");
        const SafeTensor* v = f->find(p + "v");
        if (!k || !v) continue;
        const SafeTensor* q = f->find(p + "q");
        Layer L;
        const TensorView kv = *k->view4();
        L.H = kv.shape[1], L.S = kv.shape[2], L.D = kv.shape[3];
        L.k = load_f32(kv);
        L.v = load_f32(*v->view4());
        if (q) {
          const TensorView qv = *q->view4();
          L.Hq = qv.shape[1];
          L.q = load_f32(qv);
        }
        r.layers.push_back(std::move(L));
      }
      r.source = path;
    } else {
      for (uint64_t seed = 1; seed <= 4; ++seed) {
        SyntheticOptions o;
        o.heads = 3, o.dim = 64, o.tokens = 2048, o.seed = seed;
        SyntheticKV s = make_synthetic_kv(o);
        Layer L;
        L.H = 3, L.S = 2048, L.D = 64, L.Hq = 9;
        L.k = std::move(s.k), L.v = std::move(s.v);
        L.q.resize(static_cast<size_t>(9 * L.S * L.D));
        for (int64_t hq = 0; hq < 9; ++hq)
          std::copy(s.q.begin() + (hq / 3) * L.S * L.D, s.q.begin() + (hq / 3 + 1) * L.S * L.D,
                    L.q.begin() + hq * L.S * L.D);
        r.layers.push_back(std::move(L));
      }
      r.source = "synthetic";
    }
    for (const Layer& L : r.layers) {
      const int64_t n = L.H * L.S * L.D;
      r.elems += 2 * n;
      for (const auto* x : {&L.k, &L.v}) r.flat.insert(r.flat.end(), x->begin(), x->end());
      for (int64_t b = 0; b < L.S / kBlock; ++b)
        for (const auto* x : {&L.k, &L.v})
          for (int64_t h = 0; h < L.H; ++h) {
            const float* src = x->data() + (h * L.S + b * kBlock) * L.D;
            r.blocks.insert(r.blocks.end(), src, src + kBlock * L.D);
          }
      for (const auto* x : {&L.k, &L.v})
        for (int64_t s = 0; s < L.S; ++s)
          for (int64_t h = 0; h < L.H; ++h) {
            const float* src = x->data() + (h * L.S + s) * L.D;
            r.rows.insert(r.rows.end(), src, src + L.D);
          }
    }
    return r;
  }();
  return in;
}

void finish(benchmark::State& st) {
  const int64_t n = input().elems;
  st.SetItemsProcessed(st.iterations() * n);
  st.SetBytesProcessed(st.iterations() * n * 4);
}

// ---- the limit ----------------------------------------------------------------------------

void BM_Memcpy(benchmark::State& st) {
  const Input& in = input();
  std::vector<float> out(in.flat.size());
  for (auto _ : st) {
    std::memcpy(out.data(), in.flat.data(), in.flat.size() * 4);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  finish(st);
}

// ---- KIVI ---------------------------------------------------------------------------------

std::unique_ptr<BlockCodec> codec(const std::string& text, const Layer& L) {
  auto spec = parse_spec(text);
  if (!spec.ok()) std::abort();
  auto c = spec->method().build({*spec}, ModelShape::uniform(1, static_cast<int>(L.H),
                                                             static_cast<int>(L.D),
                                                             static_cast<int>(L.Hq)));
  if (!c.ok()) std::abort();
  return std::move((*c)[0]);
}

std::string kivi_spec(int bits) {
  return "kivi:k_bits=" + std::to_string(bits) + ",v_bits=" + std::to_string(bits) + ",group=32";
}

void BM_KiviEncode(benchmark::State& st, int bits) {
  const Input& in = input();
  const Layer& L0 = in.layers[0];
  auto c = codec(kivi_spec(bits), L0);
  const BlockGeometry g{1, L0.H, kBlock, L0.D};
  const int64_t nb = L0.S / kBlock, half = g.elems();
  std::vector<SealedBlock> out(in.layers.size() * static_cast<size_t>(nb));
  Workspace ws;
  for (auto _ : st) {
    const float* x = in.blocks.data();
    for (size_t i = 0; i < out.size(); ++i, x += 2 * half)
      out[i] = c->encode(static_cast<int64_t>(i) % nb, g, x, x + half, ws);
    benchmark::DoNotOptimize(out.data());
  }
  finish(st);
}

void BM_KiviDecode(benchmark::State& st, int bits) {
  const Input& in = input();
  const Layer& L0 = in.layers[0];
  auto c = codec(kivi_spec(bits), L0);
  const BlockGeometry g{1, L0.H, kBlock, L0.D};
  const int64_t nb = L0.S / kBlock, half = g.elems();
  std::vector<SealedBlock> blk(in.layers.size() * static_cast<size_t>(nb));
  Workspace ws;
  const float* x = in.blocks.data();
  for (size_t i = 0; i < blk.size(); ++i, x += 2 * half)
    blk[i] = c->encode(static_cast<int64_t>(i) % nb, g, x, x + half, ws);
  std::vector<float> out(in.blocks.size());
  for (auto _ : st) {
    float* o = out.data();
    for (size_t i = 0; i < blk.size(); ++i)
      for (bool keys : {true, false})
        for (int64_t h = 0; h < g.heads; ++h, o += g.stream_elems())
          c->decode(*blk[i].data, static_cast<int64_t>(i) % nb, keys, 0, h, g, o, ws);
    benchmark::DoNotOptimize(out.data());
  }
  double err = 0, ref = 0;
  for (size_t i = 0; i < out.size(); ++i)
    err += (out[i] - in.blocks[i]) * (out[i] - in.blocks[i]), ref += in.blocks[i] * in.blocks[i];
  st.counters["nmse"] = err / ref;
  finish(st);
}

// The quantization half of KIVI's encode: codes and parameters of every block, nothing packed.
void BM_KiviQuantize(benchmark::State& st, int bits) {
  const Input& in = input();
  const Layer& L0 = in.layers[0];
  const int64_t T = kBlock, D = L0.D, n = T * D;
  std::vector<uint8_t> codes(in.blocks.size());
  std::vector<QuantParams> params(static_cast<size_t>(T * D));
  for (auto _ : st) {
    const float* x = in.blocks.data();
    uint8_t* c = codes.data();
    for (size_t s = 0; s < in.blocks.size() / static_cast<size_t>(n); s += 2 * L0.H)
      for (int64_t h = 0; h < 2 * L0.H; ++h, x += n, c += n)
        if (h < L0.H)
          quantize_per_channel(x, T, D, D, bits, c, params.data());
        else
          quantize_per_token(x, T, D, D, 32, bits, c, params.data());
    benchmark::DoNotOptimize(codes.data());
    benchmark::DoNotOptimize(params.data());
  }
  finish(st);
}

// The packing half: every block's codes, stream by stream, as the codec packs them.
void BM_KiviPack(benchmark::State& st, int bits) {
  const Input& in = input();
  const int64_t n = kBlock * in.layers[0].D;
  std::vector<uint8_t> codes(in.blocks.size());
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>((i * 7 + i / 13) % (1u << bits));
  std::vector<uint8_t> out(packed_size(static_cast<size_t>(n), bits) * (codes.size() / static_cast<size_t>(n)));
  for (auto _ : st) {
    const size_t ps = packed_size(static_cast<size_t>(n), bits);
    for (size_t s = 0; s < codes.size() / static_cast<size_t>(n); ++s)
      pack_bits(codes.data() + s * static_cast<size_t>(n), static_cast<size_t>(n), bits,
                out.data() + s * ps);
    benchmark::DoNotOptimize(out.data());
  }
  finish(st);
}

// ---- llama.cpp's formats: kvq's rows and ggml's -----------------------------------------------

struct Fmt {
  ggml_rows::Type kvq;
  int ggml;  // enum ggml_type
  const char* name;
};
#if KVQ_HAVE_GGML
constexpr Fmt kFmts[] = {{ggml_rows::Type::kQ4_0, GGML_TYPE_Q4_0, "q4_0"},
                         {ggml_rows::Type::kQ8_0, GGML_TYPE_Q8_0, "q8_0"}};
#else
constexpr Fmt kFmts[] = {{ggml_rows::Type::kQ4_0, 2, "q4_0"}, {ggml_rows::Type::kQ8_0, 8, "q8_0"}};
#endif

int64_t row_len() { return input().layers[0].H * input().layers[0].D; }
size_t coded_bytes(const Fmt& f) {
  return input().rows.size() / 32 * ggml_rows::block_bytes(f.kvq);
}

#if KVQ_HAVE_GGML
void ggml_init_once() {
  static const bool done = [] {
    ggml_cpu_init();
    return true;
  }();
  (void)done;
}
std::vector<uint8_t> ggml_ref_bytes(const Fmt& f) {
  ggml_init_once();
  const int64_t R = row_len();
  std::vector<uint8_t> out(coded_bytes(f));
  const size_t rb = static_cast<size_t>(R / 32) * ggml_rows::block_bytes(f.kvq);
  const auto* tr = ggml_get_type_traits(static_cast<ggml_type>(f.ggml));
  for (size_t r = 0; r < input().rows.size() / static_cast<size_t>(R); ++r)
    tr->from_float_ref(input().rows.data() + r * static_cast<size_t>(R), out.data() + r * rb, R);
  return out;
}
#endif

std::vector<uint8_t> kvq_bytes(const Fmt& f) {
  const int64_t R = row_len();
  std::vector<uint8_t> out(coded_bytes(f));
  ggml_rows::quantize(f.kvq, input().rows.data(), static_cast<int64_t>(input().rows.size()) / R, R,
                      0, out.data());
  return out;
}

void BM_KvqRowQuantize(benchmark::State& st, Fmt f) {
  const Input& in = input();
  const int64_t R = row_len(), n = static_cast<int64_t>(in.rows.size()) / R;
  std::vector<uint8_t> out(coded_bytes(f));
  for (auto _ : st) {
    ggml_rows::quantize(f.kvq, in.rows.data(), n, R, 0, out.data());
    benchmark::DoNotOptimize(out.data());
  }
#if KVQ_HAVE_GGML
  st.counters["same_bytes"] = out == ggml_ref_bytes(f) ? 1 : 0;
#endif
  finish(st);
}

void BM_KvqRowDequantize(benchmark::State& st, Fmt f) {
  const Input& in = input();
  const int64_t R = row_len(), n = static_cast<int64_t>(in.rows.size()) / R;
  const std::vector<uint8_t> q = kvq_bytes(f);
  std::vector<float> out(in.rows.size());
  for (auto _ : st) {
    ggml_rows::dequantize(f.kvq, q.data(), n, R, 0, out.data());
    benchmark::DoNotOptimize(out.data());
  }
#if KVQ_HAVE_GGML
  std::vector<float> ref(out.size());
  ggml_get_type_traits(static_cast<ggml_type>(f.ggml))
      ->to_float(q.data(), ref.data(), static_cast<int64_t>(ref.size()));
  st.counters["same_bytes"] = std::memcmp(ref.data(), out.data(), out.size() * 4) == 0 ? 1 : 0;
#endif
  finish(st);
}

#if KVQ_HAVE_GGML
// ref = 1: ggml_get_type_traits(t)->from_float_ref; 0: the CPU backend's from_float.
void BM_GgmlRowQuantize(benchmark::State& st, Fmt f, bool ref) {
  ggml_init_once();
  const Input& in = input();
  const int64_t R = row_len();
  const size_t rows = in.rows.size() / static_cast<size_t>(R);
  const size_t rb = static_cast<size_t>(R / 32) * ggml_rows::block_bytes(f.kvq);
  std::vector<uint8_t> out(coded_bytes(f));
  const auto t = static_cast<ggml_type>(f.ggml);
  const ggml_from_float_t fn =
      ref ? ggml_get_type_traits(t)->from_float_ref : ggml_get_type_traits_cpu(t)->from_float;
  for (auto _ : st) {
    for (size_t r = 0; r < rows; ++r)
      fn(in.rows.data() + r * static_cast<size_t>(R), out.data() + r * rb, R);
    benchmark::DoNotOptimize(out.data());
  }
  st.counters["same_bytes"] = out == ggml_ref_bytes(f) ? 1 : 0;
  finish(st);
}

void BM_GgmlRowDequantize(benchmark::State& st, Fmt f) {
  ggml_init_once();
  const Input& in = input();
  const int64_t R = row_len();
  const size_t rows = in.rows.size() / static_cast<size_t>(R);
  const size_t rb = static_cast<size_t>(R / 32) * ggml_rows::block_bytes(f.kvq);
  const std::vector<uint8_t> q = ggml_ref_bytes(f);
  std::vector<float> out(in.rows.size());
  const ggml_to_float_t fn = ggml_get_type_traits(static_cast<ggml_type>(f.ggml))->to_float;
  for (auto _ : st) {
    for (size_t r = 0; r < rows; ++r) fn(q.data() + r * rb, out.data() + r * static_cast<size_t>(R), R);
    benchmark::DoNotOptimize(out.data());
  }
  finish(st);
}
#endif

// ---- whole appends: KIVI vs ZipCache -------------------------------------------------------

void BM_Append(benchmark::State& st, std::string spec) {
  const Input& in = input();
  const Layer& L0 = in.layers[0];
  auto c = ModelCache::create(spec, ModelShape::uniform(static_cast<int>(in.layers.size()),
                                                        static_cast<int>(L0.H),
                                                        static_cast<int>(L0.D),
                                                        static_cast<int>(L0.Hq)));
  if (!c.ok()) {
    st.SkipWithError(c.status().to_string().c_str());
    return;
  }
  for (auto _ : st) {
    c->reset();
    for (size_t l = 0; l < in.layers.size(); ++l) {
      const Layer& L = in.layers[l];
      const TensorView q = TensorView::bhsd(L.q.data(), DType::kF32, 1, L.Hq, L.S, L.D);
      Status s = c->layer(static_cast<int>(l))
                     .append(TensorView::bhsd(L.k.data(), DType::kF32, 1, L.H, L.S, L.D),
                             TensorView::bhsd(L.v.data(), DType::kF32, 1, L.H, L.S, L.D),
                             L.q.empty() ? nullptr : &q);
      if (!s.ok()) st.SkipWithError(s.to_string().c_str());
    }
  }
  st.counters["bits"] = c->bytes().bits_per_element();
  finish(st);
}

int register_all() {
  auto reg = [](const std::string& name, auto fn, auto... args) {
    benchmark::RegisterBenchmark(("Kernel/" + name).c_str(), fn, args...)
        ->Unit(benchmark::kMillisecond);
  };
  reg("memcpy", BM_Memcpy);
  for (int bits : {2, 4}) {
    const std::string k = "kivi_" + std::to_string(bits) + "/";
    reg(k + "encode", BM_KiviEncode, bits);
    reg(k + "quantize", BM_KiviQuantize, bits);
    reg(k + "pack", BM_KiviPack, bits);
    reg(k + "decode", BM_KiviDecode, bits);
  }
  for (const Fmt& f : kFmts) {
    const std::string n = std::string(f.name) + "/";
    reg(n + "kvq_quantize", BM_KvqRowQuantize, f);
#if KVQ_HAVE_GGML
    reg(n + "ggml_quantize_ref", BM_GgmlRowQuantize, f, true);
    reg(n + "ggml_quantize", BM_GgmlRowQuantize, f, false);
#endif
    reg(n + "kvq_dequantize", BM_KvqRowDequantize, f);
#if KVQ_HAVE_GGML
    reg(n + "ggml_dequantize", BM_GgmlRowDequantize, f);
#endif
  }
  for (const char* s : {"kivi:k_bits=2,v_bits=2,group=32", "zipcache", "zipcache:saliency=norm"})
    reg(std::string("append/") + s, BM_Append, std::string(s));
  return 0;
}
const int registered = register_all();

}  // namespace
}  // namespace kvq
