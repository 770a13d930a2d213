// kvq_cuda_bench — the CUDA backend's decode-attention and append speed, and what fits.
//
//   kvq_cuda_bench [--shapes B,Hq,Hkv,D,S;...] [--methods spec;spec;...] [--iters N]
//                  [--model B,S|none]
//
// For every shape and method: a one-layer cache on cuda:0 is filled with S tokens of random
// fp16 K/V in appends of `chunk` tokens (timed: append throughput on bytes read + written),
// then one decode query per sequence is attended (timed with CUDA events around 20 calls back
// to back, median of `iters` such timings). Effective bandwidth is the bytes the cache holds over
// the time. XQuant specs get a two-layer cache (an anchor and a layer reusing its codes) and one
// row per layer ("spec" gets " [anchor]" / " [reuse]"; held bytes are the layer's own). Then a
// Llama-3-8B-shaped 32-layer decode step (--model, default 16 sequences of 32768 tokens). One JSON
// object per line on stdout (bench/cuda/sdpa_compare.py reads them next to torch's SDPA timings and
// prints the table of docs/results.md).
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "kvq/cache.h"
#include "kvq/cuda.h"

namespace {

struct Shape {
  int64_t B, Hq, Hkv, D, S;
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

// Random fp16 [B, H, n, D] on the device (values ~N(0, 1) with per-channel offsets, as keys have).
void* random_device(int64_t B, int64_t H, int64_t n, int64_t D, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> chan(static_cast<size_t>(D));
  for (auto& c : chan) c = 2.0f * nd(rng);
  std::vector<__half> h(static_cast<size_t>(B * H * n * D));
  for (size_t i = 0; i < h.size(); ++i) h[i] = __float2half(nd(rng) + chan[i % chan.size()]);
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, h.size() * 2));
  CHECK_CUDA(cudaMemcpy(p, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  return p;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string shapes_arg = "16,32,8,128,32768;1,32,8,128,131072;32,32,8,128,8192";
  std::string methods_arg = "fp16;kivi:k_bits=2,v_bits=2,group=32;kivi:k_bits=4,v_bits=4,group=32";
  std::string model_arg = "16,32768";                // B,S of the 32-layer step ("" to skip)
  std::string prefill_arg = "1,32,8,128,8192,2048";  // B,Hq,Hkv,D,S,Tq ("" to skip)
  int iters = 15;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--shapes")
      shapes_arg = argv[i + 1];
    else if (a == "--methods")
      methods_arg = argv[i + 1];
    else if (a == "--iters")
      iters = std::atoi(argv[i + 1]);
    else if (a == "--model")
      model_arg = argv[i + 1] == std::string("none") ? "" : argv[i + 1];
    else if (a == "--prefill")
      prefill_arg = argv[i + 1] == std::string("none") ? "" : argv[i + 1];
    else {
      std::fprintf(stderr,
                   "usage: kvq_cuda_bench [--shapes B,Hq,Hkv,D,S;...] [--methods a;b] [--iters N] "
                   "[--model B,S|none] [--prefill B,Hq,Hkv,D,S,Tq|none]\n");
      return 2;
    }
  }
  if (kvq::cuda::device_count() == 0) {
    std::fprintf(stderr, "kvq_cuda_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  size_t free_b = 0, total_b = 0;
  CHECK_CUDA(cudaMemGetInfo(&free_b, &total_b));
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"total_bytes\": %zu}\n", prop.name,
              prop.multiProcessorCount, total_b);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));

  for (const std::string& sh : split(shapes_arg, ';')) {
    const auto f = split(sh, ',');
    if (f.size() != 5) {
      std::fprintf(stderr, "bad shape '%s'\n", sh.c_str());
      return 2;
    }
    const Shape s{std::stoll(f[0]), std::stoll(f[1]), std::stoll(f[2]), std::stoll(f[3]),
                  std::stoll(f[4])};
    // Appends of `chunk` tokens from one random buffer (reused along the sequence).
    const int64_t chunk =
        std::min<int64_t>(s.S, std::max<int64_t>(256, (int64_t{1} << 25) / (s.B * s.Hkv * s.D)));
    void* kbuf = random_device(s.B, s.Hkv, chunk, s.D, 1);
    void* vbuf = random_device(s.B, s.Hkv, chunk, s.D, 2);
    void* qbuf = random_device(s.B, s.Hq, 1, s.D, 3);
    void* qchunk = nullptr;  // queries given with the appends (ZipCache's attention saliency)
    float* out = nullptr;
    CHECK_CUDA(
        cudaMalloc(reinterpret_cast<void**>(&out), static_cast<size_t>(s.B * s.Hq * s.D) * 4));
    const kvq::Device gpu = kvq::Device::cuda(0);
    for (const std::string& spec : split(methods_arg, ';')) {
      kvq::CacheOptions opt;
      opt.device = gpu;
      opt.stream = stream;
      const bool xq = spec.rfind("xquant", 0) == 0;
      // ZipCache ranks tokens by the attention of probe queries unless saliency=norm: its
      // appends get queries.
      const bool with_q =
          spec.rfind("zipcache", 0) == 0 && spec.find("saliency=norm") == std::string::npos;
      if (with_q && !qchunk) qchunk = random_device(s.B, s.Hq, chunk, s.D, 4);
      auto made = kvq::ModelCache::create(
          spec,
          kvq::ModelShape::uniform(xq ? 2 : 1, static_cast<int>(s.Hkv), static_cast<int>(s.D),
                                   static_cast<int>(s.Hq)),
          opt);
      check(made.status(), spec.c_str());
      kvq::ModelCache cache = std::move(*made);
      for (int li = 0; li < cache.n_layers(); ++li) {
        kvq::LayerCache& layer = cache.layer(li);
        const std::string label = !xq ? spec : spec + (li == 0 ? " [anchor]" : " [reuse]");
        // Fill, timing the appends (each waits for its own validation, so host time is device
        // time).
        CHECK_CUDA(cudaStreamSynchronize(stream));
        double append_ms = 0, first_append_ms = -1;  // the first: CacheGen's block 0 on the host
        for (int64_t t = 0; t < s.S; t += chunk) {
          const int64_t n = std::min(chunk, s.S - t);
          const auto kv = kvq::TensorView::bhsd(kbuf, kvq::DType::kF16, s.B, s.Hkv, chunk, s.D, gpu)
                              .slice_tokens(0, n);
          const auto vv = kvq::TensorView::bhsd(vbuf, kvq::DType::kF16, s.B, s.Hkv, chunk, s.D, gpu)
                              .slice_tokens(0, n);
          const auto qv = kvq::TensorView::bhsd(qchunk, kvq::DType::kF16, s.B, s.Hq, chunk, s.D, gpu)
                              .slice_tokens(0, n);
          CHECK_CUDA(cudaEventRecord(e0, stream));
          check(layer.append(kv, vv, with_q ? &qv : nullptr), "append");
          CHECK_CUDA(cudaEventRecord(e1, stream));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          append_ms += ms;
          if (first_append_ms < 0) first_append_ms = ms;
        }
        const uint64_t held = layer.resident_bytes();
        const double in_bytes = 2.0 * s.B * s.Hkv * s.S * s.D * 2;  // K and V, fp16
        // Decode attention.
        const auto q = kvq::TensorView::bhsd(qbuf, kvq::DType::kF16, s.B, s.Hq, 1, s.D, gpu);
        const auto o = kvq::MutTensorView::bhsd(out, kvq::DType::kF32, s.B, s.Hq, 1, s.D, gpu);
        const float scale = 1.0f / std::sqrt(static_cast<float>(s.D));
        for (int i = 0; i < 5; ++i) check(layer.attend(q, scale, o), "attend");
        // `reps` calls back to back between two events (the queue stays full, so host-side
        // launch work is hidden as it is in a serving loop), `iters` such timings, median.
        const int reps = 20;
        std::vector<double> times;
        for (int i = 0; i < iters; ++i) {
          CHECK_CUDA(cudaEventRecord(e0, stream));
          for (int r = 0; r < reps; ++r) check(layer.attend(q, scale, o), "attend");
          CHECK_CUDA(cudaEventRecord(e1, stream));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          times.push_back(ms / reps);
        }
        CHECK_CUDA(cudaGetLastError());
        const double ms = median(times);
        // Sanity: the output is finite.
        std::vector<float> host(static_cast<size_t>(s.B * s.Hq * s.D));
        CHECK_CUDA(cudaMemcpy(host.data(), out, host.size() * 4, cudaMemcpyDeviceToHost));
        int bad = 0;
        for (float x : host) bad += !std::isfinite(x);
        auto stats = kvq::cuda::memory_stats(cache);
        std::printf(
            "{\"B\": %lld, \"Hq\": %lld, \"Hkv\": %lld, \"D\": %lld, \"S\": %lld, \"spec\": "
            "\"%s\", "
            "\"attend_ms\": %.5f, \"attend_min_ms\": %.5f, \"held_bytes\": %llu, \"held_GBps\": "
            "%.1f, "
            "\"bytes_per_token\": %.2f, \"append_ms\": %.3f, \"append_first_ms\": %.3f, "
            "\"append_GBps\": %.1f, "
            "\"pool_reserved\": %llu, \"nonfinite\": %d}\n",
            static_cast<long long>(s.B), static_cast<long long>(s.Hq),
            static_cast<long long>(s.Hkv), static_cast<long long>(s.D), static_cast<long long>(s.S),
            label.c_str(), ms, *std::min_element(times.begin(), times.end()),
            static_cast<unsigned long long>(held), held / ms / 1e6,
            static_cast<double>(held) / (s.B * s.S), append_ms, first_append_ms,
            (in_bytes + held) / append_ms / 1e6,
            static_cast<unsigned long long>(stats.ok() ? stats->reserved : 0), bad);
        std::fflush(stdout);
      }
    }
    CHECK_CUDA(cudaFree(kbuf));
    CHECK_CUDA(cudaFree(vbuf));
    CHECK_CUDA(cudaFree(qbuf));
    if (qchunk) CHECK_CUDA(cudaFree(qchunk));
    CHECK_CUDA(cudaFree(out));
  }
  // A prefill chunk: S - Tq tokens in the cache, then Tq more appended with their queries and
  // attended at once (each query sees its own causal prefix and seal boundary); attention
  // timed with events around 5 calls, median of `iters`. The last layer of the model is timed
  // (XQuant: a reuse layer).
  if (!prefill_arg.empty()) {
    const auto f = split(prefill_arg, ',');
    const int64_t B = std::stoll(f.at(0)), Hq = std::stoll(f.at(1)), Hkv = std::stoll(f.at(2)),
                  D = std::stoll(f.at(3)), S = std::stoll(f.at(4)), Tq = std::stoll(f.at(5));
    const int64_t chunk =
        std::min<int64_t>(S, std::max<int64_t>(Tq, (int64_t{1} << 25) / (B * Hkv * D)));
    void* kbuf = random_device(B, Hkv, chunk, D, 7);
    void* vbuf = random_device(B, Hkv, chunk, D, 8);
    void* qbuf = random_device(B, Hq, Tq, D, 9);
    float* out = nullptr;
    CHECK_CUDA(
        cudaMalloc(reinterpret_cast<void**>(&out), static_cast<size_t>(B * Hq * Tq * D) * 4));
    const kvq::Device gpu = kvq::Device::cuda(0);
    for (const std::string& spec : split(methods_arg, ';')) {
      kvq::CacheOptions opt;
      opt.device = gpu;
      opt.stream = stream;
      const bool xq = spec.rfind("xquant", 0) == 0;
      auto made = kvq::ModelCache::create(
          spec,
          kvq::ModelShape::uniform(xq ? 2 : 1, static_cast<int>(Hkv), static_cast<int>(D),
                                   static_cast<int>(Hq)),
          opt);
      check(made.status(), spec.c_str());
      kvq::ModelCache cache = std::move(*made);
      const auto q = kvq::TensorView::bhsd(qbuf, kvq::DType::kF16, B, Hq, Tq, D, gpu);
      for (int li = 0; li < cache.n_layers(); ++li) {
        kvq::LayerCache& layer = cache.layer(li);
        for (int64_t t = 0; t < S;) {
          const bool last = t >= S - Tq;
          const int64_t n = last ? Tq : std::min(chunk, S - Tq - t);
          const auto kv = kvq::TensorView::bhsd(kbuf, kvq::DType::kF16, B, Hkv, chunk, D, gpu)
                              .slice_tokens(0, n);
          const auto vv = kvq::TensorView::bhsd(vbuf, kvq::DType::kF16, B, Hkv, chunk, D, gpu)
                              .slice_tokens(0, n);
          check(layer.append(kv, vv, last ? &q : nullptr), "append");
          t += n;
        }
      }
      kvq::LayerCache& layer = cache.layer(cache.n_layers() - 1);
      const auto o = kvq::MutTensorView::bhsd(out, kvq::DType::kF32, B, Hq, Tq, D, gpu);
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      check(layer.attend(q, scale, o), "attend");
      std::vector<double> times;
      for (int i = 0; i < iters; ++i) {
        CHECK_CUDA(cudaEventRecord(e0, stream));
        for (int r = 0; r < 5; ++r) check(layer.attend(q, scale, o), "attend");
        CHECK_CUDA(cudaEventRecord(e1, stream));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        times.push_back(ms / 5);
      }
      std::printf(
          "{\"prefill\": true, \"B\": %lld, \"Hq\": %lld, \"Hkv\": %lld, \"D\": %lld, "
          "\"S\": %lld, \"Tq\": %lld, \"spec\": \"%s\", \"attend_ms\": %.4f}\n",
          static_cast<long long>(B), static_cast<long long>(Hq), static_cast<long long>(Hkv),
          static_cast<long long>(D), static_cast<long long>(S), static_cast<long long>(Tq),
          (xq ? spec + " [reuse]" : spec).c_str(), median(times));
      std::fflush(stdout);
    }
    CHECK_CUDA(cudaFree(kbuf));
    CHECK_CUDA(cudaFree(vbuf));
    CHECK_CUDA(cudaFree(qbuf));
    CHECK_CUDA(cudaFree(out));
  }
  // A Llama-3-8B-shaped decode step: 32 layers of (Hq 32, Hkv 8, D 128) at `model_shape`'s batch
  // and context. Per layer one token is appended (with its query; append validates on the device
  // and waits for that) and attended; the step is timed on the host around all 32 layers
  // (synchronized at its end), and the attention alone with events around 32 back-to-back calls.
  if (!model_arg.empty()) {
    const auto f = split(model_arg, ',');
    const int64_t B = std::stoll(f.at(0)), S = std::stoll(f.at(1)), Hq = 32, Hkv = 8, D = 128;
    const int L = 32;
    const int64_t chunk =
        std::min<int64_t>(S, std::max<int64_t>(256, (int64_t{1} << 25) / (B * Hkv * D)));
    void* kbuf = random_device(B, Hkv, chunk, D, 4);
    void* vbuf = random_device(B, Hkv, chunk, D, 5);
    void* qbuf = random_device(B, Hq, 1, D, 6);
    float* out = nullptr;
    CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&out), static_cast<size_t>(B * Hq * D) * 4));
    const kvq::Device gpu = kvq::Device::cuda(0);
    for (const std::string& spec : split(methods_arg, ';')) {
      kvq::CacheOptions opt;
      opt.device = gpu;
      opt.stream = stream;
      auto made = kvq::ModelCache::create(spec, kvq::ModelShape::uniform(L, Hkv, D, Hq), opt);
      check(made.status(), spec.c_str());
      kvq::ModelCache cache = std::move(*made);
      for (int l = 0; l < L; ++l)
        for (int64_t t = 0; t < S; t += chunk) {
          const int64_t n = std::min(chunk, S - t);
          check(cache.layer(l).append(
                    kvq::TensorView::bhsd(kbuf, kvq::DType::kF16, B, Hkv, chunk, D, gpu)
                        .slice_tokens(0, n),
                    kvq::TensorView::bhsd(vbuf, kvq::DType::kF16, B, Hkv, chunk, D, gpu)
                        .slice_tokens(0, n)),
                "append");
        }
      const auto k1 =
          kvq::TensorView::bhsd(kbuf, kvq::DType::kF16, B, Hkv, chunk, D, gpu).slice_tokens(0, 1);
      const auto v1 =
          kvq::TensorView::bhsd(vbuf, kvq::DType::kF16, B, Hkv, chunk, D, gpu).slice_tokens(0, 1);
      const auto q = kvq::TensorView::bhsd(qbuf, kvq::DType::kF16, B, Hq, 1, D, gpu);
      const auto o = kvq::MutTensorView::bhsd(out, kvq::DType::kF32, B, Hq, 1, D, gpu);
      const float scale = 1.0f / std::sqrt(static_cast<float>(D));
      std::vector<double> steps, attends;
      for (int it = 0; it < 12; ++it) {
        CHECK_CUDA(cudaStreamSynchronize(stream));
        const auto t0 = std::chrono::steady_clock::now();
        for (int l = 0; l < L; ++l) {
          check(cache.layer(l).append(k1, v1, &q), "decode append");
          check(cache.layer(l).attend(q, scale, o), "attend");
        }
        CHECK_CUDA(cudaStreamSynchronize(stream));
        steps.push_back(
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                .count());
        CHECK_CUDA(cudaEventRecord(e0, stream));
        for (int l = 0; l < L; ++l) check(cache.layer(l).attend(q, scale, o), "attend");
        CHECK_CUDA(cudaEventRecord(e1, stream));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
        attends.push_back(ms);
      }
      std::printf(
          "{\"model\": \"llama3-8b-shaped\", \"layers\": %d, \"B\": %lld, \"S\": %lld, "
          "\"spec\": \"%s\", \"step_ms\": %.4f, \"attend_32_layers_ms\": %.4f, "
          "\"held_bytes\": %llu}\n",
          L, static_cast<long long>(B), static_cast<long long>(S), spec.c_str(), median(steps),
          median(attends), static_cast<unsigned long long>(cache.resident_bytes()));
      std::fflush(stdout);
    }
    CHECK_CUDA(cudaFree(kbuf));
    CHECK_CUDA(cudaFree(vbuf));
    CHECK_CUDA(cudaFree(qbuf));
    CHECK_CUDA(cudaFree(out));
  }
  return 0;
}
