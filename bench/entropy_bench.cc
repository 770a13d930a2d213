// Entropy coder benchmarks (docs/entropy.md reports them). Symbols/s are items_per_second.
//
//   build-entropy/kvq_bench --benchmark_filter='Entropy' --benchmark_min_time=0.5
//
// Streams are synthetic KV-like chunks (entropy/kv_synth.h): kind 0 = key token-deltas
// (per-channel groups of 32 tokens), kind 1 = values (per-token groups of 32 channels), both
// with skewed per-channel distributions. Chunks are [tokens, 64 channels].
#include <benchmark/benchmark.h>

#include <cstdio>
#include <vector>

#include "entropy/kv_synth.h"
#include "entropy/rans.h"
#include "entropy/symbol_codec.h"
#include "entropy/transpose.h"
#include "kvq/bitpack.h"

namespace kvq::entropy {
namespace {

constexpr int kChannels = 64;

std::vector<uint8_t> chunk(int bits, int kind, int64_t tokens, uint64_t seed = 7) {
  SynthKvOptions o;
  o.bits = bits;
  o.keys = kind == 0;
  o.token_delta = kind == 0;
  o.n_tokens = tokens;
  o.n_channels = kChannels;
  o.seed = seed;
  return synth_kv_symbols(o);
}

SymbolCodecOptions options_for(int lanes_log2, RansImpl impl) {
  SymbolCodecOptions o;
  o.lanes_log2 = lanes_log2;
  o.impl = impl;
  return o;
}

// args: bits, kind, tokens, lanes_log2 (-1 auto), impl (0 auto, 1 scalar)
void BM_EntropyDecode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const int kind = static_cast<int>(state.range(1));
  const int64_t tokens = state.range(2);
  const auto impl = state.range(4) ? RansImpl::kScalar : RansImpl::kAuto;
  auto sym = chunk(bits, kind, tokens);
  std::vector<uint8_t> enc;
  EncodeStats st;
  if (!encode_symbols(sym.data(), tokens, kChannels, bits,
                      options_for(static_cast<int>(state.range(3)), impl), enc, &st)
           .ok())
    state.SkipWithError("encode failed");
  std::vector<uint8_t> out(sym.size());
  Workspace ws;  // the caller-owned scratch a cache passes: warm after the first call
  for (auto _ : state) {
    Status s = decode_symbols(enc.data(), enc.size(), tokens, kChannels, bits, out.data(), nullptr,
                              impl, nullptr, &ws);
    benchmark::DoNotOptimize(out.data());
    if (!s.ok()) state.SkipWithError("decode failed");
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(sym.size()));
  state.counters["bits_per_sym"] = 8.0 * st.total_bytes / sym.size();
  state.counters["mode"] = static_cast<double>(st.mode);
  state.counters["lanes"] = st.lanes;
}

void BM_EntropyEncode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const int kind = static_cast<int>(state.range(1));
  const int64_t tokens = state.range(2);
  const auto impl = state.range(4) ? RansImpl::kScalar : RansImpl::kAuto;
  const auto o = options_for(static_cast<int>(state.range(3)), impl);
  auto sym = chunk(bits, kind, tokens);
  std::vector<uint8_t> enc;
  enc.reserve(sym.size() + 64);
  EncodeStats st;
  Workspace ws;
  for (auto _ : state) {
    enc.clear();
    Status s =
        encode_symbols(sym.data(), tokens, kChannels, bits, o, enc, &st, nullptr, nullptr, &ws);
    benchmark::DoNotOptimize(enc.data());
    if (!s.ok()) state.SkipWithError("encode failed");
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(sym.size()));
  state.counters["bits_per_sym"] = 8.0 * st.total_bytes / sym.size();
}

// The rANS core alone: tables prepared, no histogram/normalization/header work.
void BM_EntropyRansCoreDecode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const int64_t tokens = state.range(2);
  const int lanes_log2 = static_cast<int>(state.range(3));
  const auto impl = state.range(4) ? RansImpl::kScalar : RansImpl::kAuto;
  auto sym = chunk(bits, static_cast<int>(state.range(1)), tokens);
  TableAccumulator acc(kChannels, bits, true);
  (void)acc.add(sym.data(), tokens);
  auto tables = acc.build(SymbolCodecOptions{}, false);
  auto model = make_rans_model(*tables);
  std::vector<uint8_t> cm(sym.size());  // the codec's channel-major coding order
  transpose_bytes(sym.data(), static_cast<size_t>(tokens), kChannels, cm.data());
  std::vector<uint8_t> enc;
  (void)rans_encode_stream(*model, cm.data(), cm.size(), static_cast<size_t>(tokens), lanes_log2,
                           enc, impl);
  std::vector<uint8_t> out(sym.size());
  for (auto _ : state) {
    Status s = rans_decode_stream(*model, enc.data(), enc.size(), sym.size(),
                                  static_cast<size_t>(tokens), lanes_log2, out.data(), impl);
    benchmark::DoNotOptimize(out.data());
    if (!s.ok()) state.SkipWithError("decode failed");
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(sym.size()));
}

void BM_EntropyRansCoreEncode(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const int64_t tokens = state.range(2);
  const int lanes_log2 = static_cast<int>(state.range(3));
  const auto impl = state.range(4) ? RansImpl::kScalar : RansImpl::kAuto;
  auto sym = chunk(bits, static_cast<int>(state.range(1)), tokens);
  TableAccumulator acc(kChannels, bits, true);
  (void)acc.add(sym.data(), tokens);
  auto tables = acc.build(SymbolCodecOptions{}, false);
  auto model = make_rans_model(*tables);
  std::vector<uint8_t> cm(sym.size());
  transpose_bytes(sym.data(), static_cast<size_t>(tokens), kChannels, cm.data());
  std::vector<uint8_t> enc;
  enc.reserve(2 * sym.size() + 256);
  Workspace ws;
  for (auto _ : state) {
    enc.clear();
    Status s = rans_encode_stream(*model, cm.data(), cm.size(), static_cast<size_t>(tokens),
                                  lanes_log2, enc, impl, &ws);
    benchmark::DoNotOptimize(enc.data());
    if (!s.ok()) state.SkipWithError("encode failed");
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(sym.size()));
}

void speed_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bits", "kind", "tokens", "lanes_log2", "scalar"});
  for (int bits : {2, 3, 4, 8})
    for (int kind : {0, 1}) b->Args({bits, kind, 256, -1, 0});
  for (int bits : {2, 4}) {
    b->Args({bits, 1, 256, 5, 0});    // 32 lanes
    b->Args({bits, 1, 256, 4, 1});    // scalar reference
    b->Args({bits, 1, 4096, -1, 0});  // long chunk
  }
}

void core_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"bits", "kind", "tokens", "lanes_log2", "scalar"});
  for (int bits : {2, 4})
    for (int lanes : {4, 5}) b->Args({bits, 1, 256, lanes, 0});
  b->Args({4, 1, 256, 4, 1});
  b->Args({8, 1, 256, 4, 0});
}

BENCHMARK(BM_EntropyDecode)->Apply(speed_args);
BENCHMARK(BM_EntropyEncode)->Apply(speed_args);
BENCHMARK(BM_EntropyRansCoreDecode)->Apply(core_args);
BENCHMARK(BM_EntropyRansCoreEncode)->Apply(core_args);

// Size study (not a speed measurement): per tokens-per-chunk, bits/symbol of the coded stream,
// its table share, the Shannon estimate and fixed-width packing, averaged over 8 chunks of a
// 4096-token synthetic stream. Counters only; one iteration.
void BM_EntropySizeVsChunk(benchmark::State& state) {
  const int bits = static_cast<int>(state.range(0));
  const int kind = static_cast<int>(state.range(1));
  const int64_t tokens = state.range(2);
  const bool shared = state.range(3) != 0;
  double coded = 0, tables = 0, shannon = 0, n = 0, headers = 0;
  for (auto _ : state) {
    for (uint64_t seed = 1; seed <= 8; ++seed) {
      auto all = chunk(bits, kind, 4096, seed);
      SharedTables sh;
      std::vector<uint8_t> ser;
      if (shared) {  // tables from the whole 4096-token layer, billed once
        TableAccumulator acc(kChannels, bits, true);
        (void)acc.add(all.data(), 4096);
        auto t = acc.build(SymbolCodecOptions{});
        serialize_tables(*t, ser);
        sh = std::move(make_shared_tables(std::move(t).value())).value();
        tables += 8.0 * ser.size();
      }
      for (int64_t t0 = 0; t0 + tokens <= 4096; t0 += tokens) {
        const uint8_t* c = all.data() + t0 * kChannels;
        std::vector<uint8_t> enc;
        EncodeStats st;
        (void)encode_symbols(c, tokens, kChannels, bits, SymbolCodecOptions{}, enc, &st,
                             shared ? &sh : nullptr);
        coded += 8.0 * st.total_bytes;
        tables += 8.0 * st.table_bytes;
        headers += 8.0 * st.header_bytes;
        shannon += shannon_bits(c, tokens, kChannels, bits, true);
        n += static_cast<double>(tokens * kChannels);
      }
      if (shared) coded += 8.0 * ser.size();
    }
  }
  state.counters["coded_bps"] = coded / n;
  state.counters["table_bps"] = tables / n;
  state.counters["shannon_bps"] = shannon / n;
  state.counters["raw_bps"] = bits;
  state.counters["saving_vs_raw"] = 1.0 - coded / (n * bits);
}

BENCHMARK(BM_EntropySizeVsChunk)
    ->ArgNames({"bits", "kind", "tokens", "shared"})
    ->ArgsProduct({{2, 4}, {0, 1}, {16, 32, 64, 128, 256, 512, 1024, 4096}, {0}})
    ->ArgsProduct({{2, 4}, {0, 1}, {64, 256, 1024}, {1}})
    ->Iterations(1);

}  // namespace
}  // namespace kvq::entropy
