// kvq_cuda_rans_bench — the GPU decoder and encoder of kvq's symbol streams (src/cuda/rans_gpu.h)
// against the CPU's, on CacheGen-shaped streams: chunks of 128 tokens x 128 channels (CacheGen's
// default chunk, head_dim 128), KV-like symbols (entropy/kv_synth.h: keys token-delta coded,
// values not), at 2, 3 and 4 bits, coded as CacheGen codes them (16 prototype tables per part at
// precision 2^7, tables=shared, its default) and with the symbol codec's per-channel inline
// tables.
//
//   kvq_cuda_rans_bench [--streams N] [--iters N]
//
// Time: the decode kernel alone (CUDA events around 10 launches, median of `iters`), streams
// already in device memory; the encoder (shared tables only, as CacheGen codes) from symbols in
// device memory to the streams packed at their offsets, every stream checked byte for byte
// against the CPU encoder's first. "fp16-equivalent" output counts 2 bytes per decoded symbol (the
// unit of CacheGen's published GPU decoder figure and of the target). The CPU figure is
// one thread of entropy::decode_symbols (AVX-512 paths where the CPU has them) on the same
// streams. One JSON object per line.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cuda/rans_gpu.h"
#include "entropy/kv_synth.h"
#include "entropy/symbol_codec.h"
#include "bench_util.h"

// Median over `iters` timings of 10 launches back to back between two events, per launch.
template <class Launch>
double median_ms(int iters, cudaEvent_t e0, cudaEvent_t e1, const Launch& launch) {
  std::vector<float> ms;
  for (int it = 0; it < iters; ++it) {
    CHECK_CUDA(cudaEventRecord(e0));
    for (int r = 0; r < 10; ++r) launch();
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t / 10);
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  using namespace kvq;
  int64_t n_streams = 4096;
  int iters = 7;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--streams") n_streams = std::atoll(argv[i + 1]);
    else if (a == "--iters") iters = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: kvq_cuda_rans_bench [--streams N] [--iters N]\n");
      return 2;
    }
  }
  const int64_t T = 128;
  const int C = 128;
  const int64_t per = T * C;
  for (int bits : {2, 3, 4})
    for (bool keys : {true, false})
      for (bool shared_tables : {true, false}) {
        // Symbols: 64 distinct synthetic chunks (different seeds), repeated to n_streams.
        std::vector<std::vector<uint8_t>> syms;
        for (int k = 0; k < 64; ++k) {
          entropy::SynthKvOptions o;
          o.n_tokens = T, o.n_channels = C, o.bits = bits, o.keys = keys;
          o.token_delta = keys;
          o.seed = 1000 + static_cast<uint64_t>(k) * 7 + static_cast<uint64_t>(bits);
          syms.push_back(entropy::synth_kv_symbols(o));
        }
        // "shared": CacheGen's own coding (src/methods/cachegen.cc): 16 prototype tables
        // clustered from every chunk's per-channel histograms, precision 2^7, no inline tables
        // (streams are prototype-coded, raw or constant). "inline": the symbol codec's defaults
        // (per-channel tables in each stream, precision up to 2^11).
        entropy::SymbolCodecOptions co;
        std::optional<entropy::SharedTables> shared;
        if (shared_tables) {
          co.prob_bits = entropy::kLutMaxProbBits;
          co.inline_tables = false;
          const int A = 1 << bits;
          std::vector<uint32_t> hists(syms.size() * C * A, 0);
          for (size_t k = 0; k < syms.size(); ++k)
            for (int64_t t = 0; t < T; ++t)
              for (int c = 0; c < C; ++c)
                ++hists[(k * C + c) * A + syms[k][static_cast<size_t>(t * C + c)]];
          auto t = entropy::build_prototypes(hists.data(), static_cast<int>(syms.size()) * C, bits,
                                             16, co.prob_bits, 3);
          check(t.status(), "prototypes");
          auto st = entropy::make_shared_tables(*t);
          check(st.status(), "shared tables");
          shared = std::move(*st);
        }
        std::vector<std::vector<uint8_t>> coded(syms.size());
        int modes[4] = {0, 0, 0, 0};
        for (size_t k = 0; k < syms.size(); ++k) {
          entropy::EncodeStats stats;
          check(entropy::encode_symbols(syms[k].data(), T, C, bits, co, coded[k], &stats,
                                        shared ? &*shared : nullptr),
                "encode");
          ++modes[static_cast<int>(stats.mode)];
        }
        std::vector<uint8_t> data;
        std::vector<uint64_t> off{0};
        for (int64_t s = 0; s < n_streams; ++s) {
          const auto& c = coded[static_cast<size_t>(s) % coded.size()];
          data.insert(data.end(), c.begin(), c.end());
          off.push_back(data.size());
        }
        // One JSON line per timed configuration.
        auto print_row = [&](const char* bench, const char* tables, bool token_major, double t_ms,
                             double cpu_gbps) {
          const double syms_total = static_cast<double>(n_streams) * static_cast<double>(per);
          std::printf(
              "{\"bench\": \"%s\", \"bits\": %d, \"part\": \"%s\", \"tables\": \"%s\", "
              "\"order\": \"%s\", \"streams\": %lld, \"symbols\": %.0f, \"coded_bytes\": %zu, "
              "\"bits_per_symbol\": %.4f, \"modes\": [%d, %d, %d, %d], \"gpu_ms\": %.4f, "
              "\"gpu_fp16_gbps\": %.1f, \"gpu_coded_gbps\": %.1f, \"cpu_1t_fp16_gbps\": %.3f}\n",
              bench, bits, keys ? "keys" : "values", tables, token_major ? "token" : "channel",
              static_cast<long long>(n_streams), syms_total, data.size(),
              8.0 * static_cast<double>(data.size()) / syms_total, modes[0], modes[1], modes[2],
              modes[3], t_ms, 2.0 * syms_total / (t_ms * 1e6),
              static_cast<double>(data.size()) / (t_ms * 1e6), cpu_gbps);
          std::fflush(stdout);
        };
        // CPU: one thread, every distinct stream a few times.
        std::vector<uint8_t> ref(static_cast<size_t>(per));
        const auto c0 = std::chrono::steady_clock::now();
        int64_t cpu_symbols = 0;
        for (int rep = 0; rep < 4; ++rep)
          for (const auto& c : coded) {
            check(entropy::decode_symbols(c.data(), c.size(), T, C, bits, ref.data(),
                                          shared ? &*shared : nullptr),
                  "CPU decode");
            cpu_symbols += per;
          }
        const double cpu_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count();

        void *d_data, *d_off, *d_out, *d_status, *d_scratch;
        CHECK_CUDA(cudaMalloc(&d_data, data.size()));
        CHECK_CUDA(cudaMalloc(&d_off, off.size() * 8));
        CHECK_CUDA(cudaMalloc(&d_out, static_cast<size_t>(n_streams * per)));
        CHECK_CUDA(cudaMalloc(&d_status, static_cast<size_t>(n_streams) * 4));
        CHECK_CUDA(cudaMemcpy(d_data, data.data(), data.size(), cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(d_off, off.data(), off.size() * 8, cudaMemcpyHostToDevice));
        cuda::SymbolStreams ss;
        ss.data = static_cast<const uint8_t*>(d_data);
        ss.offsets = static_cast<const uint64_t*>(d_off);
        ss.n = n_streams, ss.n_tokens = T, ss.n_channels = C, ss.bits = bits;
        std::optional<cuda::GpuTables> g;
        if (shared) {
          auto r = cuda::GpuTables::upload(shared->tables);
          check(r.status(), "upload tables");
          g = std::move(*r);
        }
        const size_t scratch = cuda::decode_scratch_bytes(ss, g ? &*g : nullptr, true);
        CHECK_CUDA(cudaMalloc(&d_scratch, scratch ? scratch : 1));
        cudaEvent_t e0, e1;
        CHECK_CUDA(cudaEventCreate(&e0));
        CHECK_CUDA(cudaEventCreate(&e1));
        for (bool token_major : {false, true}) {
          auto launch = [&] {
            check(cuda::decode_symbol_streams(ss, g ? &*g : nullptr, token_major,
                                              static_cast<uint8_t*>(d_out),
                                              static_cast<int32_t*>(d_status), d_scratch, scratch,
                                              nullptr),
                  "GPU decode");
          };
          launch();
          check(cuda::decode_status(static_cast<const int32_t*>(d_status), n_streams, nullptr),
                "GPU decode result");
          // Spot check against the CPU: the first distinct streams.
          std::vector<uint8_t> got(static_cast<size_t>(per));
          for (size_t k = 0; k < 4; ++k) {
            CHECK_CUDA(cudaMemcpy(got.data(), static_cast<uint8_t*>(d_out) + k * per, got.size(),
                                  cudaMemcpyDeviceToHost));
            for (int64_t t = 0; t < T; ++t)
              for (int c = 0; c < C; ++c) {
                const uint8_t v = token_major ? got[static_cast<size_t>(t * C + c)]
                                              : got[static_cast<size_t>(c * T + t)];
                if (v != syms[k][static_cast<size_t>(t * C + c)]) {
                  std::fprintf(stderr, "mismatch: stream %zu t %lld c %d\n", k,
                               static_cast<long long>(t), c);
                  return 1;
                }
              }
          }
          print_row("rans_decode", shared_tables ? "shared" : "inline", token_major,
                    median_ms(iters, e0, e1, launch),
                    2.0 * static_cast<double>(cpu_symbols) / (cpu_s * 1e9));
        }
        if (shared) {
          // The GPU encoder (shared tables, as CacheGen codes): the symbols in device memory,
          // token-major (encode_symbols' order, a transpose first) or channel-major (the coder's).
          const auto c1 = std::chrono::steady_clock::now();
          int64_t cpu_enc_symbols = 0;
          for (int rep = 0; rep < 2; ++rep)
            for (const auto& sy : syms) {
              std::vector<uint8_t> o;
              check(entropy::encode_symbols(sy.data(), T, C, bits, co, o, nullptr, &*shared),
                    "CPU encode");
              cpu_enc_symbols += per;
            }
          const double cpu_enc_s =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - c1).count();
          auto ge = cuda::GpuEncodeTables::upload(*shared);
          check(ge.status(), "upload encoder tables");
          cuda::SymbolArrays sa;
          sa.n = n_streams, sa.n_tokens = T, sa.n_channels = C, sa.bits = bits;
          const size_t cap = cuda::encode_capacity(sa);
          const size_t esb = cuda::encode_scratch_bytes(sa, true);
          void *d_sym, *d_enc, *d_eoff, *d_escratch;
          CHECK_CUDA(cudaMalloc(&d_sym, static_cast<size_t>(n_streams * per)));
          CHECK_CUDA(cudaMalloc(&d_enc, cap));
          CHECK_CUDA(cudaMalloc(&d_eoff, static_cast<size_t>(n_streams + 1) * 8));
          CHECK_CUDA(cudaMalloc(&d_escratch, esb));
          sa.symbols = static_cast<const uint8_t*>(d_sym);
          for (bool token_major : {true, false}) {
            std::vector<uint8_t> in(static_cast<size_t>(n_streams * per));
            for (int64_t s = 0; s < n_streams; ++s) {
              const auto& sy = syms[static_cast<size_t>(s) % syms.size()];
              for (int64_t t = 0; t < T; ++t)
                for (int c = 0; c < C; ++c)
                  in[static_cast<size_t>(s * per + (token_major ? t * C + c : c * T + t))] =
                      sy[static_cast<size_t>(t * C + c)];
            }
            CHECK_CUDA(cudaMemcpy(d_sym, in.data(), in.size(), cudaMemcpyHostToDevice));
            auto launch = [&] {
              check(cuda::encode_symbol_streams(sa, *ge, token_major, -1,
                                                static_cast<uint8_t*>(d_enc),
                                                static_cast<uint64_t*>(d_eoff),
                                                static_cast<int32_t*>(d_status), d_escratch, esb,
                                                nullptr),
                    "GPU encode");
            };
            launch();
            check(cuda::encode_status(static_cast<const int32_t*>(d_status), n_streams, nullptr),
                  "GPU encode result");
            // Every stream is the CPU's bytes.
            std::vector<uint64_t> eoff(static_cast<size_t>(n_streams + 1));
            CHECK_CUDA(cudaMemcpy(eoff.data(), d_eoff, eoff.size() * 8, cudaMemcpyDeviceToHost));
            if (eoff.back() != data.size()) {
              std::fprintf(stderr, "GPU encode: %llu bytes, the CPU %zu\n",
                           static_cast<unsigned long long>(eoff.back()), data.size());
              return 1;
            }
            std::vector<uint8_t> got(data.size());
            CHECK_CUDA(cudaMemcpy(got.data(), d_enc, got.size(), cudaMemcpyDeviceToHost));
            if (got != data || eoff != off) {
              std::fprintf(stderr, "GPU encode: bytes differ from the CPU's\n");
              return 1;
            }
            print_row("rans_encode", "shared", token_major, median_ms(iters, e0, e1, launch),
                      2.0 * static_cast<double>(cpu_enc_symbols) / (cpu_enc_s * 1e9));
          }
          cudaFree(d_sym), cudaFree(d_enc), cudaFree(d_eoff), cudaFree(d_escratch);
        }
        cudaFree(d_data), cudaFree(d_off), cudaFree(d_out), cudaFree(d_status), cudaFree(d_scratch);
        cudaEventDestroy(e0), cudaEventDestroy(e1);
      }
  return 0;
}
