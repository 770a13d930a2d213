// Decode attention over packed KV on the CPU, every method beside the fp16 cache in one run
// (docs/results.md, "Attention over packed KV"). Not a Google Benchmark measurement: one
// iteration of AttendSweep runs interleaved rounds itself and prints a Markdown table (and, with
// KVQ_ATTEND_JSON=path, one JSON object per row).
//
//   KVQ_KV=kv.safetensors build/kvq_bench --benchmark_filter=AttendSweep
//
// For each shape, context and thread count: one single-layer ModelCache per method holding `ctx`
// tokens, one decode token appended last, then `attend` of that token's query (all query heads,
// batch 1). Each round times every (threads, method) once, in an order rotated from round to
// round: one warm call, then calls until >= KVQ_ATTEND_MS ms (default 60) and at least 2, the
// median call kept. Reported per method: the median over rounds of that time and of its
// ratio to the fp16 cache's time in the same round, the cache's resident bytes per millisecond
// (GB/s of what it holds, read once per attend), and the same two from the calling thread's CPU
// time (the whole work at threads 1; a busy machine's descheduled time is not in it).
//
// Shapes (KVQ_ATTEND_SHAPES, default "smollm2,llama3"):
//   smollm2  9 query / 3 KV heads, head_dim 64: K/V (and the last query) from the dump's layer
//            (KVQ_KV, its layers.10, else its first; without KVQ_KV synthetic), its 2048 tokens
//            appended again and again up to ctx (chunks of 2048)
//   llama3   32 query / 8 KV heads, head_dim 128 (Llama-3-8B's attention): synthetic K/V
//            (kvq/synthetic.h: AR(1) along tokens, 4 outlier key channels per head), 2048 tokens
//            generated once and appended again and again
// The caches are filled without queries (ZipCache's attention saliency then ranks by key norm:
// the stored layout and the attend's work are the same; its probes over a 32k prefill would take
// minutes). Contexts KVQ_ATTEND_CTX (default 4096,16384,32768), threads KVQ_ATTEND_THREADS
// (default 1,2: the cache's ThreadPool, which splits attend over KV heads), rounds
// KVQ_ATTEND_ROUNDS (default 3), methods KVQ_ATTEND_METHODS (';'-separated specs; default
// every row of the method table at its defaults, KIVI at 2/2 and 4/4).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "bench_io.h"
#include "kvq/cache.h"
#include "kvq/safetensors.h"
#include "kvq/spec.h"
#include "kvq/synthetic.h"
#include "kvq/thread_pool.h"

namespace kvq {
namespace {

using bench::load_f32;

const char* env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return v && *v ? v : dflt;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t e = s.find(sep, pos);
    const std::string one = s.substr(pos, e == std::string::npos ? std::string::npos : e - pos);
    if (!one.empty()) out.push_back(one);
    if (e == std::string::npos) break;
    pos = e + 1;
  }
  return out;
}

struct Source {
  std::string name, origin;
  int H = 0, Hq = 0, D = 0;
  int64_t S = 0;               // tokens in one chunk of the source
  std::vector<float> k, v, q;  // [H, S, D], q: [Hq, S, D]
  RopeShape rope;
};

Source synthetic(const std::string& name, int H, int Hq, int D, RopeShape rope) {
  SyntheticOptions o;
  o.heads = H, o.dim = D, o.tokens = 2048, o.seed = 1;
  SyntheticKV s = make_synthetic_kv(o);
  Source r;
  r.name = name, r.origin = "synthetic", r.H = H, r.Hq = Hq, r.D = D, r.S = 2048, r.rope = rope;
  r.k = std::move(s.k), r.v = std::move(s.v);
  r.q.resize(static_cast<size_t>(Hq) * 2048 * D);
  for (int hq = 0; hq < Hq; ++hq)
    std::copy(s.q.begin() + (hq / (Hq / H)) * 2048 * D,
              s.q.begin() + (hq / (Hq / H) + 1) * 2048 * D, r.q.begin() + hq * 2048 * D);
  return r;
}

Source smollm2() {
  const RopeShape rope{RopeShape::Mode::kAdjacent, 100000.0, 1.0};
  const char* path = std::getenv("KVQ_KV");
  if (!path || !*path) return synthetic("smollm2", 3, 9, 64, rope);
  auto f = read_safetensors(path);
  if (!f.ok()) {
    std::fprintf(stderr, "KVQ_KV: %s\n", f.status().to_string().c_str());
    std::abort();
  }
  std::string layer = "layers.10.";
  if (!f->find(layer + "k"))
    for (int l = 0; l < 4096; ++l)
      if (f->find("layers." + std::to_string(l) + ".k")) {
        layer = "layers." + std::to_string(l) + ".";
        break;
      }
  const SafeTensor* k = f->find(layer + "k");
  const SafeTensor* v = f->find(layer + "v");
  const SafeTensor* q = f->find(layer + "q");
  if (!k || !v || !q) std::abort();
  Source r;
  const TensorView kv = *k->view4(), qv = *q->view4();
  r.name = "smollm2", r.origin = std::string(path) + ":" + layer.substr(0, layer.size() - 1);
  r.H = static_cast<int>(kv.shape[1]), r.S = kv.shape[2], r.D = static_cast<int>(kv.shape[3]);
  r.Hq = static_cast<int>(qv.shape[1]), r.rope = rope;
  r.k = load_f32(kv), r.v = load_f32(*v->view4()), r.q = load_f32(qv);
  return r;
}

std::vector<std::string> methods() {
  if (const char* m = std::getenv("KVQ_ATTEND_METHODS"); m && *m) return split(m, ';');
  std::vector<std::string> out;
  for (const auto& m : method_table()) {
    out.push_back(Spec(m).to_string());
    if (m.name == "kivi") out.push_back("kivi:k_bits=4,v_bits=4");
  }
  return out;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double thread_cpu_ms() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  const size_t n = x.size();
  return n == 0 ? NAN : n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

struct Entry {
  std::string spec;
  int threads = 1;
  std::unique_ptr<ThreadPool> pool;
  std::unique_ptr<ModelCache> cache;
  std::vector<double> ms, ratio, cpu_ms, cpu_ratio;
  std::string error;
};

// Fills a cache with ctx tokens: ctx - 1 from the source in chunks, then one decode token.
Status fill(ModelCache& c, const Source& src, int64_t ctx) {
  auto view = [&](const std::vector<float>& x, int h, int64_t s0, int64_t n) {
    return TensorView::bhsd(x.data(), DType::kF32, 1, h, src.S, src.D).slice_tokens(s0, n);
  };
  for (int64_t done = 0; done < ctx - 1;) {
    const int64_t n = std::min(src.S, ctx - 1 - done);
    if (Status s = c.layer(0).append(view(src.k, src.H, 0, n), view(src.v, src.H, 0, n)); !s.ok())
      return s;
    done += n;
  }
  return c.layer(0).append(view(src.k, src.H, src.S - 1, 1), view(src.v, src.H, src.S - 1, 1));
}

void run_config(const Source& src, int64_t ctx, const std::vector<int>& threads,
                const std::vector<std::string>& specs, int rounds, double min_ms, FILE* json) {
  const ModelShape shape = ModelShape::uniform(1, src.H, src.D, src.Hq, src.rope);
  std::vector<Entry> es;
  for (int t : threads)
    for (const auto& s : specs) {
      Entry e;
      e.spec = s, e.threads = t;
      CacheOptions o;
      if (t > 1) {
        e.pool = std::make_unique<ThreadPool>(t);
        o.pool = e.pool.get();
      }
      auto c = ModelCache::create(s, shape, o);
      if (!c.ok()) {
        e.error = c.status().to_string();
      } else {
        e.cache = std::make_unique<ModelCache>(std::move(*c));
        if (Status st = fill(*e.cache, src, ctx); !st.ok()) e.error = st.to_string();
      }
      es.push_back(std::move(e));
    }
  const TensorView q = TensorView::bhsd(src.q.data(), DType::kF32, 1, src.Hq, src.S, src.D)
                           .slice_tokens(src.S - 1, 1);
  std::vector<float> out(static_cast<size_t>(src.Hq) * src.D);
  const MutTensorView o = MutTensorView::bhsd(out.data(), DType::kF32, 1, src.Hq, 1, src.D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(src.D));
  const size_t n = es.size();
  for (int r = 0; r < rounds; ++r) {
    std::vector<double> this_round(n, NAN), this_cpu(n, NAN);
    for (size_t j = 0; j < n; ++j) {
      Entry& e = es[(j + static_cast<size_t>(r) * 5) % n];
      if (!e.cache) continue;
      for (int w = 0; w < 1; ++w)
        if (Status s = e.cache->layer(0).attend(q, scale, o); !s.ok()) {
          e.error = s.to_string();
          e.cache.reset();
          break;
        }
      if (!e.cache) continue;
      std::vector<double> calls, cpu;
      const double t_end = now_ms() + min_ms;
      while (calls.size() < 2 || now_ms() < t_end) {
        const double t0 = now_ms(), c0 = thread_cpu_ms();
        (void)e.cache->layer(0).attend(q, scale, o);
        cpu.push_back(thread_cpu_ms() - c0);
        calls.push_back(now_ms() - t0);
        benchmark::DoNotOptimize(out.data());
      }
      this_round[static_cast<size_t>(&e - es.data())] = median(calls);
      this_cpu[static_cast<size_t>(&e - es.data())] = median(cpu);
      e.ms.push_back(median(calls));
      e.cpu_ms.push_back(median(cpu));
    }
    for (size_t i = 0; i < n; ++i) {
      // The fp16 entry of the same thread count in this round.
      for (size_t f = 0; f < n; ++f)
        if (es[f].threads == es[i].threads && es[f].spec.rfind("fp16", 0) == 0 &&
            !std::isnan(this_round[f]) && !std::isnan(this_round[i]))
          es[i].ratio.push_back(this_round[i] / this_round[f]),
              es[i].cpu_ratio.push_back(this_cpu[i] / this_cpu[f]);
    }
  }
  std::printf("\n#### %s, %lld tokens (%s)\n\n", src.name.c_str(), static_cast<long long>(ctx),
              src.origin.c_str());
  std::printf(
      "| method | threads | bits/elem | resident MB | attend ms | vs fp16 | GB/s held | "
      "CPU ms (caller) | vs fp16 (CPU) |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Entry& e : es) {
    if (!e.cache) {
      std::printf("| `%s` | %d | error: %s |\n", e.spec.c_str(), e.threads, e.error.c_str());
      continue;
    }
    const double ms = median(e.ms), ratio = median(e.ratio);
    const double mb = static_cast<double>(e.cache->resident_bytes()) / 1e6;
    const std::string canon = e.cache->spec().to_string();
    std::printf("| `%s` | %d | %.2f | %.1f | %.3f | %.2fx | %.2f | %.3f | %.2fx |\n",
                canon.c_str(), e.threads, e.cache->bytes().bits_per_element(), mb, ms, ratio,
                mb / ms, median(e.cpu_ms), median(e.cpu_ratio));
    if (json)
      std::fprintf(json,
                   "{\"shape\": \"%s\", \"source\": \"%s\", \"ctx\": %lld, \"method\": \"%s\", "
                   "\"threads\": %d, \"bits_per_element\": %.4f, \"resident_bytes\": %llu, "
                   "\"attend_ms_median\": %.5f, \"vs_fp16_median\": %.4f, \"cpu_ms_median\": %.5f, "
                   "\"cpu_vs_fp16_median\": %.4f, \"rounds_ms\": [",
                   src.name.c_str(), src.origin.c_str(), static_cast<long long>(ctx),
                   canon.c_str(), e.threads, e.cache->bytes().bits_per_element(),
                   static_cast<unsigned long long>(e.cache->resident_bytes()), ms, ratio,
                   median(e.cpu_ms), median(e.cpu_ratio));
    if (json) {
      for (size_t i = 0; i < e.ms.size(); ++i) std::fprintf(json, "%s%.5f", i ? ", " : "", e.ms[i]);
      std::fprintf(json, "]}\n");
    }
  }
  std::fflush(stdout);
  if (json) std::fflush(json);
}

void BM_AttendSweep(benchmark::State& state) {
  for (auto _ : state) {
    const auto specs = methods();
    std::vector<int> threads;
    for (const auto& t : split(env_or("KVQ_ATTEND_THREADS", "1,2"), ',')) threads.push_back(std::stoi(t));
    const int rounds = std::stoi(env_or("KVQ_ATTEND_ROUNDS", "3"));
    const double min_ms = std::stod(env_or("KVQ_ATTEND_MS", "60"));
    FILE* json = nullptr;
    if (const char* p = std::getenv("KVQ_ATTEND_JSON"); p && *p) json = std::fopen(p, "a");
    for (const auto& shape : split(env_or("KVQ_ATTEND_SHAPES", "smollm2,llama3"), ',')) {
      const Source src =
          shape == "llama3"
              ? synthetic("llama3", 8, 32, 128, RopeShape{RopeShape::Mode::kHalf, 500000.0, 1.0})
              : smollm2();
      for (const auto& c : split(env_or("KVQ_ATTEND_CTX", "4096,16384,32768"), ','))
        run_config(src, std::stoll(c), threads, specs, rounds, min_ms, json);
    }
    if (json) std::fclose(json);
  }
}
BENCHMARK(BM_AttendSweep)->Iterations(1)->Unit(benchmark::kSecond);

}  // namespace
}  // namespace kvq
