// The GPU decoder of kvq's symbol streams (src/cuda/rans_gpu.h) against the CPU decoder
// (entropy::decode_symbols): the same symbols from every stream the CPU encoder writes (every
// mode, table layout, lane count, width and odd shape), in both output orders, and a refusal
// wherever the CPU refuses a damaged stream (label `gpu`; skips without a CUDA device).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace kvq
