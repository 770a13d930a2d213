// The GPU decoder of kvq's symbol streams (src/cuda/rans_gpu.h) against the CPU decoder
// (entropy::decode_symbols): the same symbols from every stream the CPU encoder writes (every
// mode, table layout, lane count, width and odd shape), in both output orders, and a refusal
// wherever the CPU refuses a damaged stream; the GPU encoder against the CPU encoder with shared
// tables: the same bytes (label `gpu`; skips without a CUDA device).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/rans_gpu.h"
#include "entropy/kv_synth.h"
#include "entropy/symbol_codec.h"
#include "kvq/cuda.h"
#include "gpu_test.h"

namespace kvq {
namespace {


struct Dev {
  void* p = nullptr;
  explicit Dev(size_t n) {
    if (cudaMalloc(&p, n ? n : 1) != cudaSuccess) std::abort();
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

struct Streams {
  int64_t T = 0;
  int C = 0, bits = 0;
  std::vector<std::vector<uint8_t>> bytes;  // one per stream
  std::vector<std::vector<uint8_t>> symbols;  // what was encoded
};

// Symbols of one stream: per channel a geometric-like distribution of its own skew, some
// channels constant, some uniform (so that every stream mode and table shape occurs).
std::vector<uint8_t> make_symbols(int64_t T, int C, int bits, int kind, std::mt19937_64& rng) {
  const int A = 1 << bits;
  std::vector<uint8_t> s(static_cast<size_t>(T * C));
  std::uniform_real_distribution<double> u(0, 1);
  for (int c = 0; c < C; ++c) {
    const double p = 0.15 + 0.8 * u(rng);
    const int mode = static_cast<int>(rng() % static_cast<uint64_t>(A));
    for (int64_t t = 0; t < T; ++t) {
      int v;
      if (kind == 0) {  // skewed around a per-channel mode
        int k = 0;
        while (k < A - 1 && u(rng) > p) ++k;
        v = (mode + ((k & 1) ? (k + 1) / 2 : -(k / 2)) + A) % A;
      } else if (kind == 1) {
        v = static_cast<int>(rng() % static_cast<uint64_t>(A));
      } else {
        v = mode;  // constant per channel (kind 2: the whole stream constant when C == 1)
      }
      s[static_cast<size_t>(t * C + c)] = static_cast<uint8_t>(v);
    }
  }
  if (kind == 2) std::fill(s.begin(), s.end(), s[0]);
  return s;
}

struct Decoded {
  std::vector<int32_t> status;
  std::vector<uint8_t> token_major, channel_major;
};

Decoded gpu_decode(const Streams& st, const cuda::GpuTables* shared) {
  std::vector<uint8_t> data;
  std::vector<uint64_t> off{0};
  for (const auto& b : st.bytes) {
    data.insert(data.end(), b.begin(), b.end());
    off.push_back(data.size());
  }
  const int64_t n = static_cast<int64_t>(st.bytes.size()), per = st.T * st.C;
  Dev d(data.size()), o((off.size()) * 8), out(static_cast<size_t>(n * per)), status(static_cast<size_t>(n) * 4);
  EXPECT_EQ(cudaMemcpy(d.p, data.data(), data.size(), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(o.p, off.data(), off.size() * 8, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::SymbolStreams s;
  s.data = static_cast<const uint8_t*>(d.p);
  s.offsets = static_cast<const uint64_t*>(o.p);
  s.n = n;
  s.n_tokens = st.T;
  s.n_channels = st.C;
  s.bits = st.bits;
  const size_t sb = cuda::decode_scratch_bytes(s, shared, true);
  Dev scratch(sb);
  Decoded r;
  for (bool tm : {true, false}) {
    cudaMemset(out.p, 0xee, static_cast<size_t>(n * per));
    const Status ls = cuda::decode_symbol_streams(s, shared, tm, static_cast<uint8_t*>(out.p),
                                                  static_cast<int32_t*>(status.p), scratch.p,
                                                  sb, nullptr);
    EXPECT_TRUE(ls.ok()) << ls.to_string();
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint8_t>& h = tm ? r.token_major : r.channel_major;
    h.resize(static_cast<size_t>(n * per));
    r.status.resize(static_cast<size_t>(n));
    EXPECT_EQ(cudaMemcpy(h.data(), out.p, h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(r.status.data(), status.p, r.status.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  return r;
}

int32_t expected_result(const Status& s) {
  if (s.ok()) return cuda::kDecodedOk;
  if (s.code() == ErrorCode::kFormat) return cuda::kDecodeFormat;
  if (s.code() == ErrorCode::kInvalidArgument) return cuda::kDecodeTables;
  return cuda::kDecodeCorrupt;
}

// Every stream decodes on the GPU exactly as on the CPU (symbols and verdict), in both orders.
void expect_same_as_cpu(const Streams& st, const entropy::SharedTables* shared,
                        const cuda::GpuTables* gshared, const std::string& what) {
  SCOPED_TRACE(what);
  const Decoded g = gpu_decode(st, gshared);
  const int64_t per = st.T * st.C;
  int failed = 0;
  for (size_t i = 0; i < st.bytes.size(); ++i) {
    std::vector<uint8_t> ref(static_cast<size_t>(per));
    const Status cs = entropy::decode_symbols(st.bytes[i].data(), st.bytes[i].size(), st.T, st.C,
                                              st.bits, ref.data(), shared);
    ASSERT_EQ(g.status[i], expected_result(cs)) << "stream " << i << ": CPU says " << cs.to_string();
    if (!cs.ok()) {
      ++failed;
      continue;
    }
    const uint8_t* tm = g.token_major.data() + i * static_cast<size_t>(per);
    const uint8_t* cm = g.channel_major.data() + i * static_cast<size_t>(per);
    ASSERT_EQ(std::memcmp(tm, ref.data(), ref.size()), 0) << "stream " << i << " (token-major)";
    for (int64_t t = 0; t < st.T; ++t)
      for (int c = 0; c < st.C; ++c)
        ASSERT_EQ(cm[c * st.T + t], ref[static_cast<size_t>(t * st.C + c)])
            << "stream " << i << " (channel-major) t " << t << " c " << c;
  }
  if (!st.symbols.empty()) {
    for (size_t i = 0; i < st.bytes.size(); ++i) {
      EXPECT_EQ(std::memcmp(g.token_major.data() + i * static_cast<size_t>(per), st.symbols[i].data(),
                            static_cast<size_t>(per)),
                0)
          << "stream " << i << " does not round-trip";
    }
    EXPECT_EQ(failed, 0);
  }
}

struct Shape {
  int64_t T;
  int C;
};

TEST(CudaRans, DecodesEveryStreamTheCpuEncoderWrites) {
  REQUIRE_GPU();
  std::mt19937_64 rng(7);
  int modes_seen[4] = {0, 0, 0, 0};
  for (int bits : {1, 2, 3, 4, 6, 8})
    for (Shape sh : {Shape{128, 128}, Shape{32, 64}, Shape{7, 5}, Shape{1, 3}, Shape{300, 17}})
      for (auto layout : {entropy::TableLayout::kPerChannel, entropy::TableLayout::kPooled})
        for (int lanes : {-1, 0, 3, 5}) {
          Streams st;
          st.T = sh.T, st.C = sh.C, st.bits = bits;
          entropy::SymbolCodecOptions o;
          o.layout = layout;
          o.lanes_log2 = lanes;
          for (int k = 0; k < 9; ++k) {
            st.symbols.push_back(make_symbols(sh.T, sh.C, bits, k % 3, rng));
            std::vector<uint8_t> out;
            entropy::EncodeStats stats;
            ASSERT_TRUE(entropy::encode_symbols(st.symbols.back().data(), sh.T, sh.C, bits, o, out,
                                                &stats)
                            .ok());
            ++modes_seen[static_cast<int>(stats.mode)];
            st.bytes.push_back(std::move(out));
          }
          expect_same_as_cpu(st, nullptr, nullptr,
                             "bits " + std::to_string(bits) + ", " + std::to_string(sh.T) + " x " +
                                 std::to_string(sh.C) + ", lanes_log2 " + std::to_string(lanes));
        }
  EXPECT_GT(modes_seen[0], 0);  // raw
  EXPECT_GT(modes_seen[1], 0);  // constant
  EXPECT_GT(modes_seen[2], 0);  // rANS, inline tables
}

TEST(CudaRans, SharedTableStreams) {
  REQUIRE_GPU();
  // Per-channel tables, one pooled table, and CacheGen's coding (16 prototypes at precision 2^7,
  // no inline tables: the GPU's slot-table path).
  for (int variant : {0, 1, 2})
    for (int bits : {2, 4, 8}) {
      const bool pooled = variant == 1, prototypes = variant == 2;
      if (prototypes && bits == 8) continue;  // 256 symbols do not all fit 2^7 slots
      const int64_t T = 128;
      const int C = 64;
      // KV-like key chunks (token deltas; the channel statistics are the model's, so one table
      // set serves every chunk, as CacheGen's prototypes do).
      entropy::TableAccumulator acc(C, bits, !pooled);
      std::vector<std::vector<uint8_t>> syms;
      for (int k = 0; k < 12; ++k) {
        entropy::SynthKvOptions so;
        so.n_tokens = T, so.n_channels = C, so.bits = bits, so.keys = true, so.token_delta = true;
        so.seed = 100 + static_cast<uint64_t>(k);
        syms.push_back(entropy::synth_kv_symbols(so));
        ASSERT_TRUE(acc.add(syms.back().data(), T).ok());
      }
      entropy::SymbolCodecOptions o;
      if (pooled) o.layout = entropy::TableLayout::kPooled;
      auto tables = acc.build(o);
      if (prototypes) {
        o.prob_bits = entropy::kLutMaxProbBits;
        o.inline_tables = false;
        const int A = 1 << bits;
        std::vector<uint32_t> hists(syms.size() * C * A, 0);
        for (size_t k = 0; k < syms.size(); ++k)
          for (int64_t t = 0; t < T; ++t)
            for (int c = 0; c < C; ++c) ++hists[(k * C + c) * A + syms[k][static_cast<size_t>(t * C + c)]];
        tables = entropy::build_prototypes(hists.data(), static_cast<int>(syms.size()) * C, bits, 16,
                                           o.prob_bits, 3);
      }
      ASSERT_TRUE(tables.ok());
      auto shared = entropy::make_shared_tables(*tables);
      ASSERT_TRUE(shared.ok());
      auto g = cuda::GpuTables::upload(shared->tables);
      ASSERT_TRUE(g.ok()) << g.status().to_string();
      Streams st;
      st.T = T, st.C = C, st.bits = bits;
      int n_shared = 0;
      for (auto& s : syms) {
        std::vector<uint8_t> out;
        entropy::EncodeStats stats;
        ASSERT_TRUE(entropy::encode_symbols(s.data(), T, C, bits, o, out, &stats, &*shared).ok());
        n_shared += stats.mode == entropy::StreamMode::kRansShared;
        st.symbols.push_back(s);
        st.bytes.push_back(std::move(out));
      }
      if (bits <= 4) {  // at 8 bits these chunks code best raw or inline
        EXPECT_GT(n_shared, 0);
      }
      expect_same_as_cpu(st, &*shared, &*g,
                         std::string(prototypes ? "prototype" : pooled ? "pooled" : "per-channel") +
                             " shared tables, bits " +
                             std::to_string(bits));
      // Without the tables the shared-table streams are refused.
      const Decoded none = gpu_decode(st, nullptr);
      for (size_t i = 0; i < st.bytes.size(); ++i) {
        if ((st.bytes[i][0] & 3) == 3) {
          EXPECT_EQ(none.status[i], cuda::kDecodeTables);
        }
      }
    }
}

// Damaged streams: a flipped byte, a byte cut off, a byte added, a header bit set. The GPU's
// verdict is the CPU's for every one, and where both accept a stream they give the same symbols.
TEST(CudaRans, DamagedStreamsGetTheCpusVerdict) {
  REQUIRE_GPU();
  std::mt19937_64 rng(13);
  for (int bits : {2, 4, 8}) {
    Streams st;
    st.T = 64, st.C = 32, st.bits = bits;
    entropy::SymbolCodecOptions o;
    for (int k = 0; k < 200; ++k) {
      const auto s = make_symbols(st.T, st.C, bits, k % 3 == 1 ? 1 : 0, rng);
      std::vector<uint8_t> out;
      ASSERT_TRUE(entropy::encode_symbols(s.data(), st.T, st.C, bits, o, out).ok());
      switch (k % 5) {
        case 0: out[rng() % out.size()] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: out.pop_back(); break;
        case 2: out.push_back(static_cast<uint8_t>(rng())); break;
        case 3: out[0] |= static_cast<uint8_t>(0x40u << (rng() % 2)); break;
        default: out[std::min<size_t>(out.size() - 1, 2 + rng() % 8)] ^= 0xff; break;
      }
      st.bytes.push_back(std::move(out));
    }
    st.bytes.push_back({});  // an empty stream
    expect_same_as_cpu(st, nullptr, nullptr, "damaged, bits " + std::to_string(bits));
  }
}

TEST(CudaRans, BadArgumentsAreClearErrors) {
  REQUIRE_GPU();
  cuda::SymbolStreams s;
  s.n = 1, s.n_tokens = 4, s.n_channels = 4, s.bits = 9;
  EXPECT_EQ(cuda::decode_symbol_streams(s, nullptr, true, nullptr, nullptr, nullptr, 0, nullptr).code(),
            ErrorCode::kInvalidArgument);
  s.bits = 4;
  Dev d(16), o(16), out(16), status(4);
  s.data = static_cast<const uint8_t*>(d.p);
  s.offsets = static_cast<const uint64_t*>(o.p);
  EXPECT_EQ(cuda::decode_symbol_streams(s, nullptr, true, static_cast<uint8_t*>(out.p),
                                        static_cast<int32_t*>(status.p), nullptr, 0, nullptr)
                .code(),
            ErrorCode::kInvalidArgument);  // no scratch
  entropy::FrequencyTables bad;
  bad.symbol_bits = 2, bad.prob_bits = 4, bad.n_tables = 1, bad.freq = {1, 2, 3, 4};  // sums to 10
  EXPECT_EQ(cuda::GpuTables::upload(bad).status().code(), ErrorCode::kInvalidArgument);
}

// ---- The encoder: the CPU encoder's bytes from the GPU ----

struct Encoded {
  std::vector<int32_t> status;
  std::vector<uint64_t> offsets;
  std::vector<uint8_t> data;
  std::vector<uint8_t> stream(size_t i) const {
    return {data.begin() + static_cast<std::ptrdiff_t>(offsets[i]),
            data.begin() + static_cast<std::ptrdiff_t>(offsets[i + 1])};
  }
};

// Encodes token-major symbol streams on the GPU, given to it token-major or channel-major.
Encoded gpu_encode(const std::vector<std::vector<uint8_t>>& syms, int64_t T, int C, int bits,
                   const cuda::GpuEncodeTables& g, bool token_major, int lanes_log2) {
  const int64_t n = static_cast<int64_t>(syms.size()), per = T * C;
  std::vector<uint8_t> in(static_cast<size_t>(n * per));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c)
        in[static_cast<size_t>(i * per + (token_major ? t * C + c : c * T + t))] =
            syms[static_cast<size_t>(i)][static_cast<size_t>(t * C + c)];
  cuda::SymbolArrays a;
  a.n = n, a.n_tokens = T, a.n_channels = C, a.bits = bits;
  const size_t cap = cuda::encode_capacity(a), sb = cuda::encode_scratch_bytes(a, token_major);
  Dev d(in.size()), out(cap), off(static_cast<size_t>(n + 1) * 8), status(static_cast<size_t>(n) * 4),
      scratch(sb);
  EXPECT_EQ(cudaMemcpy(d.p, in.data(), in.size(), cudaMemcpyHostToDevice), cudaSuccess);
  a.symbols = static_cast<const uint8_t*>(d.p);
  const Status ls = cuda::encode_symbol_streams(a, g, token_major, lanes_log2,
                                                static_cast<uint8_t*>(out.p),
                                                static_cast<uint64_t*>(off.p),
                                                static_cast<int32_t*>(status.p), scratch.p, sb, nullptr);
  EXPECT_TRUE(ls.ok()) << ls.to_string();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Encoded r;
  r.status.resize(static_cast<size_t>(n));
  r.offsets.resize(static_cast<size_t>(n + 1));
  EXPECT_EQ(cudaMemcpy(r.status.data(), status.p, r.status.size() * 4, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(r.offsets.data(), off.p, r.offsets.size() * 8, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_LE(r.offsets.back(), cap);
  r.data.resize(static_cast<size_t>(std::min<uint64_t>(r.offsets.back(), cap)));
  EXPECT_EQ(cudaMemcpy(r.data.data(), out.p, r.data.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return r;
}

// Table sets for the encoder: CacheGen's 16 prototypes at 2^7, a single prototype, per-channel
// tables that leave symbols uncovered (+inf costs: the per-channel choice fails where a channel
// meets an uncovered symbol, so the pooled choice or raw mode must win as on the CPU), and 40
// prototypes at 2^11.
std::vector<std::pair<std::string, entropy::SharedTables>> encoder_table_sets(
    const std::vector<std::vector<uint8_t>>& syms, int64_t T, int C, int bits) {
  std::vector<std::pair<std::string, entropy::SharedTables>> sets;
  const int A = 1 << bits;
  std::vector<uint32_t> hists(syms.size() * C * A, 0);
  for (size_t k = 0; k < syms.size(); ++k)
    for (int64_t t = 0; t < T; ++t)
      for (int c = 0; c < C; ++c) ++hists[(k * C + c) * A + syms[k][static_cast<size_t>(t * C + c)]];
  auto add = [&](const std::string& name, Result<entropy::FrequencyTables> t) {
    if (!t.ok()) return;  // e.g. 256 symbols do not fit 2^7 slots
    auto sh = entropy::make_shared_tables(std::move(*t));
    ASSERT_TRUE(sh.ok()) << sh.status().to_string();
    sets.emplace_back(name, std::move(*sh));
  };
  const int n_hist = static_cast<int>(syms.size()) * C;
  add("16 prototypes at 2^7", entropy::build_prototypes(hists.data(), n_hist, bits, 16, 7, 3));
  add("one prototype at 2^7", entropy::build_prototypes(hists.data(), n_hist, bits, 1, 7, 3));
  add("40 prototypes at 2^11", entropy::build_prototypes(hists.data(), n_hist, bits, 40, 11, 3));
  if (C <= entropy::kMaxSharedTables) {
    entropy::TableAccumulator acc(C, bits, true);
    for (size_t k = 0; k < std::min<size_t>(2, syms.size()); ++k)
      EXPECT_TRUE(acc.add(syms[k].data(), T).ok());
    entropy::SymbolCodecOptions o;
    add("per-channel tables, not covering", acc.build(o, /*cover_all=*/false));
  }
  return sets;
}

TEST(CudaRansEncode, WritesTheCpuEncodersBytes) {
  REQUIRE_GPU();
  std::mt19937_64 rng(17);
  int modes_seen[4] = {0, 0, 0, 0};
  int64_t streams = 0;
  for (int bits : {1, 2, 3, 4, 6, 8})
    for (Shape sh : {Shape{128, 128}, Shape{32, 64}, Shape{7, 5}, Shape{1, 3}, Shape{300, 17},
                     Shape{2048, 1}, Shape{48, 2}}) {
      std::vector<std::vector<uint8_t>> syms;
      for (int k = 0; k < 8; ++k) syms.push_back(make_symbols(sh.T, sh.C, bits, k % 3, rng));
      for (int k = 0; k < 4; ++k) {
        entropy::SynthKvOptions so;
        so.n_tokens = sh.T, so.n_channels = sh.C, so.bits = bits, so.keys = k % 2 == 0;
        so.token_delta = so.keys;
        so.seed = 300 + static_cast<uint64_t>(k);
        syms.push_back(entropy::synth_kv_symbols(so));
      }
      for (auto& [name, shared] : encoder_table_sets(syms, sh.T, sh.C, bits)) {
        auto g = cuda::GpuEncodeTables::upload(shared);
        ASSERT_TRUE(g.ok()) << g.status().to_string();
        for (int lanes : {-1, 0, 5}) {
          entropy::SymbolCodecOptions o;
          o.prob_bits = shared.tables.prob_bits;
          o.inline_tables = false;
          o.stats_shannon = false;
          o.lanes_log2 = lanes;
          std::vector<std::vector<uint8_t>> ref;
          for (const auto& s : syms) {
            std::vector<uint8_t> out;
            entropy::EncodeStats stats;
            ASSERT_TRUE(entropy::encode_symbols(s.data(), sh.T, sh.C, bits, o, out, &stats, &shared)
                            .ok());
            ++modes_seen[static_cast<int>(stats.mode)];
            ref.push_back(std::move(out));
          }
          for (bool token_major : {true, false}) {
            SCOPED_TRACE("bits " + std::to_string(bits) + ", " + std::to_string(sh.T) + " x " +
                         std::to_string(sh.C) + ", " + name + ", lanes_log2 " +
                         std::to_string(lanes) + (token_major ? ", token-major" : ", channel-major"));
            const Encoded e = gpu_encode(syms, sh.T, sh.C, bits, *g, token_major, lanes);
            for (size_t i = 0; i < syms.size(); ++i) {
              ASSERT_EQ(e.status[i], cuda::kEncodedOk) << "stream " << i;
              ASSERT_EQ(e.stream(i), ref[i]) << "stream " << i << " (CPU mode " << (ref[i][0] & 3)
                                             << ", " << ref[i].size() << " bytes)";
            }
            streams += static_cast<int64_t>(syms.size());
          }
        }
      }
    }
  EXPECT_GT(streams, 5000);
  EXPECT_GT(modes_seen[0], 0);  // raw
  EXPECT_GT(modes_seen[1], 0);  // constant
  EXPECT_GT(modes_seen[3], 0);  // rANS with the shared tables
  EXPECT_EQ(modes_seen[2], 0);  // never inline tables (as asked)
}

// CacheGen-shaped streams through the GPU encoder, then the GPU decoder: the symbols come back.
TEST(CudaRansEncode, RoundTripsThroughTheGpuDecoder) {
  REQUIRE_GPU();
  const int64_t T = 128;
  const int C = 128, bits = 3;
  std::vector<std::vector<uint8_t>> syms;
  for (int k = 0; k < 40; ++k) {
    entropy::SynthKvOptions so;
    so.n_tokens = T, so.n_channels = C, so.bits = bits, so.keys = k % 2 == 0;
    so.token_delta = so.keys;
    so.seed = 900 + static_cast<uint64_t>(k);
    syms.push_back(entropy::synth_kv_symbols(so));
  }
  auto sets = encoder_table_sets(syms, T, C, bits);
  ASSERT_FALSE(sets.empty());
  const entropy::SharedTables& shared = sets[0].second;  // CacheGen's 16 prototypes
  auto ge = cuda::GpuEncodeTables::upload(shared);
  auto gd = cuda::GpuTables::upload(shared.tables);
  ASSERT_TRUE(ge.ok() && gd.ok());
  const Encoded e = gpu_encode(syms, T, C, bits, *ge, true, -1);
  Streams st;
  st.T = T, st.C = C, st.bits = bits;
  int n_shared = 0;
  for (size_t i = 0; i < syms.size(); ++i) {
    st.bytes.push_back(e.stream(i));
    st.symbols.push_back(syms[i]);
    n_shared += (st.bytes.back()[0] & 3) == 3;
  }
  EXPECT_GT(n_shared, 30);
  expect_same_as_cpu(st, &shared, &*gd, "GPU-encoded CacheGen chunks");
}

// A stream with a symbol out of range is refused (the CPU's out_of_range) and gets no bytes; its
// neighbours are encoded as usual.
TEST(CudaRansEncode, SymbolsOutOfRangeAreRefusedPerStream) {
  REQUIRE_GPU();
  std::mt19937_64 rng(5);
  const int64_t T = 64;
  const int C = 8, bits = 2;
  std::vector<std::vector<uint8_t>> syms;
  for (int k = 0; k < 3; ++k) syms.push_back(make_symbols(T, C, bits, 0, rng));
  auto sets = encoder_table_sets(syms, T, C, bits);
  ASSERT_FALSE(sets.empty());
  auto g = cuda::GpuEncodeTables::upload(sets[0].second);
  ASSERT_TRUE(g.ok());
  std::vector<uint8_t> bad_copy = syms[1];
  bad_copy[37] = 4;  // >= 2^2
  std::vector<uint8_t> cpu_out;
  entropy::SymbolCodecOptions o;
  o.prob_bits = 7, o.inline_tables = false;
  EXPECT_EQ(entropy::encode_symbols(bad_copy.data(), T, C, bits, o, cpu_out, nullptr,
                                    &sets[0].second)
                .code(),
            ErrorCode::kOutOfRange);
  syms[1] = bad_copy;
  for (bool tm : {true, false}) {
    const Encoded e = gpu_encode(syms, T, C, bits, *g, tm, -1);
    EXPECT_EQ(e.status[0], cuda::kEncodedOk);
    EXPECT_EQ(e.status[1], cuda::kEncodeRange);
    EXPECT_EQ(e.status[2], cuda::kEncodedOk);
    EXPECT_EQ(e.offsets[2], e.offsets[1]);  // no bytes
    for (size_t i : {size_t{0}, size_t{2}}) {
      std::vector<uint8_t> ref;
      ASSERT_TRUE(entropy::encode_symbols(syms[i].data(), T, C, bits, o, ref, nullptr,
                                          &sets[0].second)
                      .ok());
      EXPECT_EQ(e.stream(i), ref);
    }
  }
  Dev st(12);
  const int32_t h[3] = {cuda::kEncodedOk, cuda::kEncodeRange, cuda::kEncodedOk};
  ASSERT_EQ(cudaMemcpy(st.p, h, 12, cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cuda::encode_status(static_cast<const int32_t*>(st.p), 3, nullptr).code(),
            ErrorCode::kOutOfRange);
}

TEST(CudaRansEncode, BadArgumentsAreClearErrors) {
  REQUIRE_GPU();
  std::mt19937_64 rng(3);
  std::vector<std::vector<uint8_t>> syms{make_symbols(16, 4, 2, 0, rng)};
  auto sets = encoder_table_sets(syms, 16, 4, 2);
  ASSERT_FALSE(sets.empty());
  auto g = cuda::GpuEncodeTables::upload(sets[0].second);
  ASSERT_TRUE(g.ok());
  cuda::SymbolArrays a;
  a.n = 1, a.n_tokens = 16, a.n_channels = 4, a.bits = 2;
  Dev d(64), out(64), off(16), status(4), scratch(1 << 20);
  a.symbols = static_cast<const uint8_t*>(d.p);
  auto call = [&](const cuda::SymbolArrays& x, int lanes, size_t sb) {
    return cuda::encode_symbol_streams(x, *g, true, lanes, static_cast<uint8_t*>(out.p),
                                       static_cast<uint64_t*>(off.p),
                                       static_cast<int32_t*>(status.p), scratch.p, sb, nullptr)
        .code();
  };
  EXPECT_EQ(call(a, -1, 1 << 20), ErrorCode::kOk);
  cuda::SymbolArrays b = a;
  b.bits = 3;  // the tables are for 2 bits
  EXPECT_EQ(call(b, -1, 1 << 20), ErrorCode::kInvalidArgument);
  b = a, b.bits = 9;
  EXPECT_EQ(call(b, -1, 1 << 20), ErrorCode::kInvalidArgument);
  b = a, b.n_tokens = 0;
  EXPECT_EQ(call(b, -1, 1 << 20), ErrorCode::kInvalidArgument);
  EXPECT_EQ(call(a, 6, 1 << 20), ErrorCode::kInvalidArgument);
  EXPECT_EQ(call(a, -1, cuda::encode_scratch_bytes(a, true) - 1), ErrorCode::kInvalidArgument);
  b = a, b.symbols = nullptr;
  EXPECT_EQ(call(b, -1, 1 << 20), ErrorCode::kInvalidArgument);
  // Tables prepared for decoding only carry no encoder tables.
  auto dec_only = entropy::make_shared_tables(sets[0].second.tables, entropy::RansModelUse::kDecode);
  ASSERT_TRUE(dec_only.ok());
  EXPECT_EQ(cuda::GpuEncodeTables::upload(*dec_only).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(cuda::encode_symbol_streams(a, cuda::GpuEncodeTables(), true, -1,
                                        static_cast<uint8_t*>(out.p), static_cast<uint64_t*>(off.p),
                                        static_cast<int32_t*>(status.p), scratch.p, 1 << 20, nullptr)
                .code(),
            ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvq
