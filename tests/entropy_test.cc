// Tests of the entropy coder: bit I/O, frequency tables, interleaved rANS (scalar reference vs
// AVX-512, bit-exact), the symbol codec (round trips, size guarantees, hostile input).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <vector>

#include "entropy/bit_io.h"
#include "entropy/freq_table.h"
#include "entropy/kv_synth.h"
#include "entropy/rans.h"
#include "entropy/symbol_codec.h"
#include "entropy/transpose.h"
#include "kvq/bitpack.h"

namespace kvq::entropy {
namespace {

std::vector<uint8_t> random_symbols(std::mt19937& rng, size_t n, int bits, double skew = 0.0) {
  // skew > 0: geometric-like distribution (small symbols likely); 0: uniform.
  std::vector<uint8_t> v(n);
  const int a = 1 << bits;
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (auto& s : v) {
    if (skew <= 0) {
      s = static_cast<uint8_t>(rng() % a);
    } else {
      const double x = -std::log(u(rng) + 1e-300) / skew;
      s = static_cast<uint8_t>(std::min<int>(a - 1, static_cast<int>(x)));
    }
  }
  return v;
}

std::vector<uint8_t> encode_ok(const std::vector<uint8_t>& sym, int64_t nt, int nc, int bits,
                               const SymbolCodecOptions& o, EncodeStats* st = nullptr,
                               const SharedTables* shared = nullptr) {
  std::vector<uint8_t> out;
  Status s = encode_symbols(sym.data(), nt, nc, bits, o, out, st, shared);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return out;
}

void expect_round_trip(const std::vector<uint8_t>& sym, int64_t nt, int nc, int bits,
                       const SymbolCodecOptions& o, const SharedTables* shared = nullptr) {
  EncodeStats st;
  auto enc = encode_ok(sym, nt, nc, bits, o, &st, shared);
  ASSERT_EQ(enc.size(), st.total_bytes);
  ASSERT_EQ(st.total_bytes, st.header_bytes + st.table_bytes + st.payload_bytes);
  // The raw-mode guarantee.
  ASSERT_LE(enc.size(), 1 + packed_size(sym.size(), bits));
  for (RansImpl impl : {RansImpl::kAuto, RansImpl::kScalar}) {
    std::vector<uint8_t> dec(sym.size() + 1, 0xEE);
    Status s = decode_symbols(enc.data(), enc.size(), nt, nc, bits, dec.data(), shared, impl);
    ASSERT_TRUE(s.ok()) << s.to_string() << " mode=" << stream_mode_name(st.mode)
                        << " bits=" << bits << " nt=" << nt << " nc=" << nc;
    ASSERT_TRUE(std::equal(sym.begin(), sym.end(), dec.begin()));
    ASSERT_EQ(dec.back(), 0xEE) << "decoder wrote past the end";
  }
}

// --------------------------------------------------------------------------------------------

TEST(EntropyBitIo, RoundTripAndOverrun) {
  std::vector<uint8_t> buf;
  BitWriter w(buf);
  std::mt19937 rng(1);
  std::vector<std::pair<uint32_t, int>> vals;
  for (int i = 0; i < 500; ++i) {
    const int n = static_cast<int>(rng() % 33);
    const uint32_t v = n == 32 ? rng() : (rng() & ((1u << n) - 1u));
    vals.push_back({v, n});
    w.put(v, n);
  }
  w.flush();
  EXPECT_EQ(w.bits() % 8, 0u);
  BitReader r(buf.data(), buf.size());
  for (auto [v, n] : vals) {
    uint32_t got;
    ASSERT_TRUE(r.get(n, got));
    ASSERT_EQ(got, v);
  }
  EXPECT_TRUE(r.finish_byte());
  uint32_t x;
  EXPECT_FALSE(r.get(1, x));
  EXPECT_TRUE(r.failed());
}

TEST(EntropyBitIo, LsbFirstLayoutMatchesBitpack) {
  std::vector<uint8_t> buf;
  BitWriter w(buf);
  for (uint32_t c : {5u, 2u, 7u}) w.put(c, 3);
  w.flush();
  ASSERT_EQ(buf.size(), 2u);
  EXPECT_EQ(buf[0], 0xD5);  // the example in kvq/bitpack.h
  EXPECT_EQ(buf[1], 0x01);
}

TEST(EntropyTables, NormalizeIsOptimalOnSmallCases) {
  // Exhaustive check against every composition of M = 16 into 4 parts.
  std::mt19937 rng(2);
  const int a = 4, p = 4, m = 16;
  for (int trial = 0; trial < 200; ++trial) {
    uint32_t c[4];
    for (auto& v : c) v = (rng() % 3 == 0) ? 0 : rng() % 50;
    if (std::accumulate(c, c + 4, 0u) == 0) c[1] = 3;
    uint16_t f[4];
    ASSERT_TRUE(normalize_counts(c, a, p, false, f));
    int sum = 0;
    for (int s = 0; s < a; ++s) {
      sum += f[s];
      EXPECT_EQ(f[s] > 0, c[s] > 0);
    }
    ASSERT_EQ(sum, m);
    const double got = coded_bits(c, f, a, p);
    double best = 1e300;
    for (int f0 = 0; f0 <= m; ++f0)
      for (int f1 = 0; f0 + f1 <= m; ++f1)
        for (int f2 = 0; f0 + f1 + f2 <= m; ++f2) {
          const uint16_t g[4] = {uint16_t(f0), uint16_t(f1), uint16_t(f2),
                                 uint16_t(m - f0 - f1 - f2)};
          bool ok = true;
          for (int s = 0; s < a; ++s) ok &= (g[s] > 0) == (c[s] > 0);
          if (ok) best = std::min(best, coded_bits(c, g, a, p));
        }
    EXPECT_NEAR(got, best, 1e-9) << c[0] << " " << c[1] << " " << c[2] << " " << c[3];
  }
}

TEST(EntropyTables, NormalizeEdgeCases) {
  uint16_t f[256];
  std::vector<uint32_t> c(256, 0);
  // All zero: single-symbol table of symbol 0.
  ASSERT_TRUE(normalize_counts(c.data(), 256, 8, false, f));
  EXPECT_EQ(f[0], 256);
  // cover_all with no data: every symbol >= 1.
  ASSERT_TRUE(normalize_counts(c.data(), 16, 6, true, f));
  for (int s = 0; s < 16; ++s) EXPECT_GE(f[s], 1);
  // More symbols than slots.
  std::fill(c.begin(), c.end(), 1);
  EXPECT_FALSE(normalize_counts(c.data(), 256, 7, false, f));
  ASSERT_TRUE(normalize_counts(c.data(), 256, 8, false, f));
  for (int s = 0; s < 256; ++s) EXPECT_EQ(f[s], 1);
  // Huge skew: one symbol 10^9 times, others once.
  c.assign(16, 1);
  c[3] = 1000000000u;
  ASSERT_TRUE(normalize_counts(c.data(), 16, 12, false, f));
  EXPECT_EQ(f[3], 4096 - 15);
}

TEST(EntropyTables, SerializeRoundTripAllWidthsAndPrecisions) {
  std::mt19937 rng(3);
  for (int bits = 1; bits <= 8; ++bits)
    for (int p : {1, 4, 8, 11, 12}) {
      const int a = 1 << bits;
      if (a > (1 << p)) continue;
      for (int trial = 0; trial < 20; ++trial) {
        FrequencyTables t;
        t.symbol_bits = bits;
        t.prob_bits = p;
        t.n_tables = 1 + static_cast<int>(rng() % 5);
        t.freq.assign(static_cast<size_t>(t.n_tables) * a, 0);
        for (int i = 0; i < t.n_tables; ++i) {
          std::vector<uint32_t> c(a);
          const double skew = (trial % 3) * 0.7;
          for (auto s : random_symbols(rng, 1 + rng() % 300, bits, skew)) c[s]++;
          ASSERT_TRUE(normalize_counts(c.data(), a, p, trial % 4 == 0, t.table(i)));
        }
        ASSERT_TRUE(validate_tables(t).ok());
        std::vector<uint8_t> bytes;
        serialize_tables(t, bytes);
        EXPECT_EQ(bytes.size(), 3 + (tables_bits(t) + 7) / 8);  // 2 bytes + 1-byte varint
        auto back = deserialize_tables(bytes.data(), bytes.size());
        ASSERT_TRUE(back.ok()) << back.status().to_string();
        EXPECT_EQ(back->freq, t.freq);
        // Every strict prefix fails cleanly.
        for (size_t len = 0; len < bytes.size(); ++len)
          EXPECT_FALSE(deserialize_tables(bytes.data(), len).ok()) << len;
        // Trailing garbage fails.
        bytes.push_back(0);
        EXPECT_FALSE(deserialize_tables(bytes.data(), bytes.size()).ok());
      }
    }
}

TEST(EntropyTables, DeserializeHostileBytesNeverCrashes) {
  std::mt19937 rng(4);
  int accepted = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> b(1 + rng() % 40);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    b[0] = static_cast<uint8_t>(1 + rng() % 8);
    if (b.size() > 1) b[1] = static_cast<uint8_t>(rng() % 14);
    if (b.size() > 2) b[2] = static_cast<uint8_t>(rng() % 4);
    auto t = deserialize_tables(b.data(), b.size());
    if (t.ok()) {
      ++accepted;
      EXPECT_TRUE(validate_tables(*t).ok());
    } else {
      EXPECT_TRUE(t.status().code() == ErrorCode::kCorrupt) << t.status().to_string();
    }
  }
  EXPECT_GT(accepted, 0);
}

TEST(EntropyTables, AdaptivePrecisionNeverWorseThanFixed) {
  // Per-table precision choice minimizes table + coded bits; check it against the fixed-P table.
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    SynthKvOptions so;
    so.seed = seed;
    so.token_delta = seed % 2;
    auto sym = synth_kv_symbols(so);
    std::vector<uint32_t> counts(64 * 16);
    ASSERT_TRUE(count_symbols(sym.data(), sym.size(), 4, 64, counts.data()).ok());
    TableBuildOptions fixed, adaptive;
    fixed.adaptive_precision = false;
    auto tf = build_tables(counts.data(), 64, 4, fixed);
    auto ta = build_tables(counts.data(), 64, 4, adaptive);
    ASSERT_TRUE(tf.ok() && ta.ok());
    auto total = [&](const FrequencyTables& t) {
      double bits = static_cast<double>(tables_bits(t));
      for (int c = 0; c < 64; ++c)
        bits += coded_bits(counts.data() + c * 16, t.table(c), 16, t.prob_bits);
      return bits;
    };
    EXPECT_LT(total(*ta), total(*tf));
  }
}

TEST(EntropyTranspose, MatchesTheReferenceAtEveryShape) {
  std::mt19937 rng(11);
  for (size_t rows : {0u, 1u, 3u, 15u, 16u, 17u, 33u, 64u, 256u})
    for (size_t cols : {0u, 1u, 2u, 16u, 31u, 64u, 70u}) {
      std::vector<uint8_t> src(rows * cols);
      for (auto& b : src) b = static_cast<uint8_t>(rng());
      std::vector<uint8_t> a(src.size() + 1, 0x77), b(src.size() + 1, 0x77);
      transpose_bytes(src.data(), rows, cols, a.data());
      transpose_bytes_reference(src.data(), rows, cols, b.data());
      ASSERT_EQ(a, b) << rows << "x" << cols;
    }
}

TEST(EntropyRans, ReciprocalIsExact) {
  // q = (x * rcp) >> (31 + l) must equal x / f for all x < 2^28; check the worst cases (just
  // below and at multiples of f) over the whole range for every f.
  std::mt19937 rng(5);
  for (uint32_t f = 1; f <= 4096; ++f) {
    const int l = std::bit_width(f) - 1;
    const uint64_t rcp = ((uint64_t{1} << (31 + l)) + f - 1) / f;
    ASSERT_LT(rcp, uint64_t{1} << 32);
    auto check = [&](uint32_t x) {
      ASSERT_EQ(static_cast<uint32_t>((x * rcp) >> (31 + l)), x / f) << "f=" << f << " x=" << x;
    };
    const uint32_t top = (1u << 28) - 1;
    for (uint32_t k : {1u, 2u, top / f, top / f - 1, 1000u}) {
      if (uint64_t{k} * f > top) continue;
      check(k * f);
      check(k * f - 1);
    }
    check(top);
    for (int i = 0; i < 8; ++i) check(rng() & top);
  }
}

// Random tables (some symbols absent) and symbols drawn only from present ones.
struct RandomCase {
  FrequencyTables tables;
  std::vector<uint8_t> symbols;
};

RandomCase make_case(std::mt19937& rng, int bits, int p, int n_tables, size_t n, size_t run = 1) {
  RandomCase rc;
  const int a = 1 << bits;
  rc.tables.symbol_bits = bits;
  rc.tables.prob_bits = p;
  rc.tables.n_tables = n_tables;
  rc.tables.freq.assign(static_cast<size_t>(n_tables) * a, 0);
  for (int t = 0; t < n_tables; ++t) {
    std::vector<uint32_t> c(a, 0);
    const int present = 1 + static_cast<int>(rng() % std::min(a, 1 << p));
    for (int k = 0; k < present; ++k) c[rng() % a] += 1 + rng() % 1000;
    if (rng() % 4 == 0) c[rng() % a] += 100000;  // heavy skew
    EXPECT_TRUE(normalize_counts(c.data(), a, p, false, rc.tables.table(t)));
  }
  rc.symbols.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const uint16_t* f = rc.tables.table(static_cast<int>((i / run) % n_tables));
    uint32_t r = rng() % (1u << p), s = 0;
    while (r >= f[s]) r -= f[s], ++s;
    rc.symbols[i] = static_cast<uint8_t>(s);
  }
  return rc;
}

TEST(EntropyRans, ScalarAndSimdAreBitExact) {
  // Every precision (slot-table path P <= 7, compare path above), every width, runs that are
  // multiples of the lanes (SIMD) and runs that are not (scalar), single and many tables.
  std::mt19937 rng(6);
  for (int trial = 0; trial < 600; ++trial) {
    const int bits = 1 + static_cast<int>(rng() % 8);
    const int p = std::max(bits, static_cast<int>(rng() % 13));
    const int n_tables = 1 + static_cast<int>(rng() % 70);
    const int lanes_log2 = static_cast<int>(rng() % 6);
    const size_t run = rng() % 3 ? (1 + rng() % 8) << lanes_log2 : 1 + rng() % 300;
    const size_t n = (trial % 5 == 0) ? rng() % 40 : rng() % 3000;
    RandomCase rc = make_case(rng, bits, p, n_tables, n, run);
    for (RansModelUse use : {RansModelUse::kBoth, RansModelUse::kEncode}) {
      auto model = make_rans_model(rc.tables, use);
      ASSERT_TRUE(model.ok());
      std::vector<uint8_t> a, b;
      ASSERT_TRUE(
          rans_encode_stream(*model, rc.symbols.data(), n, run, lanes_log2, a, RansImpl::kAuto)
              .ok());
      ASSERT_TRUE(
          rans_encode_stream(*model, rc.symbols.data(), n, run, lanes_log2, b, RansImpl::kScalar)
              .ok());
      ASSERT_EQ(a, b) << "trial " << trial;
      for (RansImpl impl : {RansImpl::kAuto, RansImpl::kScalar}) {
        std::vector<uint8_t> out(n + 16, 0xAB);
        Status s =
            rans_decode_stream(*model, a.data(), a.size(), n, run, lanes_log2, out.data(), impl);
        ASSERT_TRUE(s.ok()) << s.to_string() << " trial " << trial;
        ASSERT_TRUE(std::equal(rc.symbols.begin(), rc.symbols.end(), out.begin()))
            << "trial " << trial;
        for (size_t i = n; i < out.size(); ++i) ASSERT_EQ(out[i], 0xAB);
      }
      // Damaged copies: both decoders agree on failure or on the symbols.
      for (int d = 0; d < 3 && !a.empty(); ++d) {
        auto bad = a;
        bad[rng() % bad.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        std::vector<uint8_t> o1(n + 1, 0x5A), o2(n + 1, 0x5A);
        Status s1 = rans_decode_stream(*model, bad.data(), bad.size(), n, run, lanes_log2,
                                       o1.data(), RansImpl::kAuto);
        Status s2 = rans_decode_stream(*model, bad.data(), bad.size(), n, run, lanes_log2,
                                       o2.data(), RansImpl::kScalar);
        ASSERT_EQ(s1.ok(), s2.ok());
        if (s1.ok()) {
          ASSERT_EQ(o1, o2);
        }
        ASSERT_EQ(o1.back(), 0x5A);
      }
    }
  }
}

TEST(EntropyRans, RejectsUncodableSymbols) {
  std::mt19937 rng(7);
  RandomCase rc = make_case(rng, 4, 10, 3, 4000);
  auto model = make_rans_model(rc.tables);
  ASSERT_TRUE(model.ok());
  // Find an absent symbol of table 0 (or use an out-of-alphabet one).
  uint8_t bad = 16;
  for (int s = 0; s < 16; ++s)
    if (rc.tables.table(0)[s] == 0) bad = static_cast<uint8_t>(s);
  for (size_t pos : {size_t{0}, size_t{3}, size_t{2001}, size_t{3999}}) {
    auto sym = rc.symbols;
    sym[pos - pos % 3] = bad;
    for (int lanes_log2 : {0, 4, 5})
      for (RansImpl impl : {RansImpl::kAuto, RansImpl::kScalar}) {
        std::vector<uint8_t> out;
        EXPECT_FALSE(
            rans_encode_stream(*model, sym.data(), sym.size(), 1, lanes_log2, out, impl).ok());
      }
  }
}

// --------------------------------------------------------------------------------------------

TEST(EntropyCodec, RoundTripEveryWidthAndLayout) {
  std::mt19937 rng(8);
  for (int bits = 1; bits <= 8; ++bits)
    for (TableLayout layout : {TableLayout::kPerChannel, TableLayout::kPooled, TableLayout::kAuto})
      for (int trial = 0; trial < 6; ++trial) {
        const int nc = 1 + static_cast<int>(rng() % 80);
        const int64_t nt = static_cast<int64_t>(rng() % 200);
        auto sym = random_symbols(rng, static_cast<size_t>(nt) * nc, bits, 0.3 * trial);
        SymbolCodecOptions o;
        o.layout = layout;
        o.prob_bits = std::max(8, 9 + trial % 4);
        expect_round_trip(sym, nt, nc, bits, o);
      }
}

TEST(EntropyCodec, AdversarialInputs) {
  std::mt19937 rng(9);
  SymbolCodecOptions o;
  for (int bits = 1; bits <= 8; ++bits) {
    const int a = 1 << bits;
    // n = 0 and n = 1.
    expect_round_trip({}, 0, 7, bits, o);
    expect_round_trip({static_cast<uint8_t>(a - 1)}, 1, 1, bits, o);
    // All the same symbol (constant mode), both alphabet edges.
    for (uint8_t s : {uint8_t{0}, static_cast<uint8_t>(a - 1)}) {
      std::vector<uint8_t> same(256 * 64, s);
      EncodeStats st;
      encode_ok(same, 256, 64, bits, o, &st);
      EXPECT_EQ(st.mode, StreamMode::kConstant);
      EXPECT_EQ(st.total_bytes, 2u);
      expect_round_trip(same, 256, 64, bits, o);
    }
    // Every symbol once.
    std::vector<uint8_t> each(a);
    std::iota(each.begin(), each.end(), 0);
    expect_round_trip(each, a, 1, bits, o);
    expect_round_trip(each, 1, a, bits, o);
    // Huge skew: one other symbol in a sea of one symbol.
    std::vector<uint8_t> skew(256 * 64, 0);
    skew[777] = static_cast<uint8_t>(a - 1);
    expect_round_trip(skew, 256, 64, bits, o);
    // Alphabet edges only, alternating per channel.
    std::vector<uint8_t> edges(64 * 33);
    for (size_t i = 0; i < edges.size(); ++i) edges[i] = (i * 7 + i / 64) % 3 ? 0 : a - 1;
    expect_round_trip(edges, 64, 33, bits, o);
  }
  // Uniform 8-bit: nothing to gain, must fall back to raw within the header bound.
  auto uni = random_symbols(rng, 256 * 64, 8);
  EncodeStats st;
  encode_ok(uni, 256, 64, 8, o, &st);
  EXPECT_EQ(st.mode, StreamMode::kRaw);
  EXPECT_EQ(st.total_bytes, 1 + uni.size());
  expect_round_trip(uni, 256, 64, 8, o);
  // Per-channel constant (every table single-symbol, P = 0).
  std::vector<uint8_t> cols(256 * 64);
  for (size_t i = 0; i < cols.size(); ++i) cols[i] = static_cast<uint8_t>(i % 64 % 16);
  encode_ok(cols, 256, 64, 4, o, &st);
  EXPECT_EQ(st.mode, StreamMode::kRansInline);
  EXPECT_EQ(st.prob_bits, 0);
  expect_round_trip(cols, 256, 64, 4, o);
}

TEST(EntropyCodec, ForcedLanesAndScalarEncoderAgree) {
  std::mt19937 rng(10);
  for (int lanes_log2 = 0; lanes_log2 <= 5; ++lanes_log2)
    for (int bits : {2, 3, 4, 6}) {
      SynthKvOptions so;
      so.bits = bits;
      so.n_tokens = 100 + rng() % 200;
      so.n_channels = 48;
      so.seed = rng();
      auto sym = synth_kv_symbols(so);
      SymbolCodecOptions o;
      o.lanes_log2 = lanes_log2;
      auto a = encode_ok(sym, so.n_tokens, 48, bits, o);
      o.impl = RansImpl::kScalar;
      auto b = encode_ok(sym, so.n_tokens, 48, bits, o);
      EXPECT_EQ(a, b);
      expect_round_trip(sym, so.n_tokens, 48, bits, o);
    }
}

TEST(EntropyCodec, EncodeTwiceIsDeterministic) {
  SynthKvOptions so;
  so.token_delta = true;
  auto sym = synth_kv_symbols(so);
  SymbolCodecOptions o;
  o.layout = TableLayout::kAuto;
  std::vector<uint8_t> a, b;
  ASSERT_TRUE(encode_symbols(sym.data(), 256, 64, 4, o, a).ok());
  ASSERT_TRUE(encode_symbols(sym.data(), 256, 64, 4, o, b).ok());
  EXPECT_EQ(a, b);
  // Appends: a second stream after the first decodes from its own offset.
  const size_t first = a.size();
  ASSERT_TRUE(encode_symbols(sym.data(), 256, 64, 4, o, a).ok());
  std::vector<uint8_t> dec(sym.size());
  ASSERT_TRUE(decode_symbols(a.data() + first, a.size() - first, 256, 64, 4, dec.data()).ok());
  EXPECT_EQ(dec, sym);
}

TEST(EntropyCodec, SharedTables) {
  const int nc = 64, bits = 4;
  TableAccumulator acc(nc, bits, true);
  std::vector<std::vector<uint8_t>> chunks;
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    SynthKvOptions so;
    so.seed = 42;  // same channel statistics, different tokens
    so.n_tokens = 256 * seed;
    auto all = synth_kv_symbols(so);
    chunks.emplace_back(all.end() - 256 * nc, all.end());
    ASSERT_TRUE(acc.add(chunks.back().data(), 256).ok());
  }
  SymbolCodecOptions o;
  auto tables = acc.build(o);
  ASSERT_TRUE(tables.ok()) << tables.status().to_string();
  std::vector<uint8_t> ser;
  serialize_tables(*tables, ser);
  auto back = deserialize_tables(ser.data(), ser.size());
  ASSERT_TRUE(back.ok());
  auto shared = make_shared_tables(std::move(back).value());
  ASSERT_TRUE(shared.ok());
  for (const auto& c : chunks) {
    EncodeStats st;
    auto enc = encode_ok(c, 256, nc, bits, o, &st, &*shared);
    EXPECT_EQ(st.mode, StreamMode::kRansShared);
    EXPECT_EQ(st.table_bits, 64u * 6u);  // one 6-bit index per channel into the 64-table set
    expect_round_trip(c, 256, nc, bits, o, &*shared);
    // Without the tables the stream cannot be decoded, and says so.
    std::vector<uint8_t> dec(c.size());
    Status s = decode_symbols(enc.data(), enc.size(), 256, nc, bits, dec.data());
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  }
  // A chunk with a symbol the shared tables lack (not cover_all) is still coded (inline/raw).
  auto narrow = acc.build(o, /*cover_all=*/false);
  ASSERT_TRUE(narrow.ok());
  auto sh2 = make_shared_tables(std::move(narrow).value());
  ASSERT_TRUE(sh2.ok());
  std::vector<uint8_t> odd(256 * nc, 0);
  for (size_t i = 0; i < odd.size(); ++i)
    odd[i] = static_cast<uint8_t>(static_cast<uint32_t>(i * 2654435761u) >> 28);
  expect_round_trip(odd, 256, nc, bits, o, &*sh2);
}

TEST(EntropyCodec, PrototypeTables) {
  // K prototypes from one chunk's channel histograms code later chunks; every channel names its
  // prototype. Also K = 1 (zero-bit indices), and indices >= K are corrupt.
  const int nc = 64, bits = 4;
  SynthKvOptions so;
  so.seed = 7;
  so.n_tokens = 1024;
  so.keys = false;
  const auto all = synth_kv_symbols(so);
  std::vector<uint32_t> hists(static_cast<size_t>(nc) * 16);
  ASSERT_TRUE(count_symbols(all.data(), 256 * nc, bits, nc, hists.data()).ok());
  for (int k : {1, 5, 16}) {
    auto protos = build_prototypes(hists.data(), nc, bits, k, 7);
    ASSERT_TRUE(protos.ok()) << protos.status().to_string();
    EXPECT_LE(protos->n_tables, k);
    EXPECT_TRUE(validate_tables(*protos).ok());
    for (int t = 0; t < protos->n_tables; ++t)
      for (int sy = 0; sy < 16; ++sy) EXPECT_GT(protos->table(t)[sy], 0) << "every symbol covered";
    auto shared = make_shared_tables(std::move(*protos));
    ASSERT_TRUE(shared.ok());
    SymbolCodecOptions o;
    o.inline_tables = false;
    for (int c = 1; c < 4; ++c) {
      std::vector<uint8_t> chunk(all.begin() + c * 256 * nc, all.begin() + (c + 1) * 256 * nc);
      EncodeStats st;
      auto enc = encode_ok(chunk, 256, nc, bits, o, &st, &*shared);
      EXPECT_NE(st.mode, StreamMode::kRansInline);
      expect_round_trip(chunk, 256, nc, bits, o, &*shared);
      // Not much worse than inline tables built for the chunk itself.
      EncodeStats own;
      encode_ok(chunk, 256, nc, bits, SymbolCodecOptions{}, &own);
      if (k == 16) {
        EXPECT_LT(st.total_bytes, own.total_bytes * 1.05);
      }
      if (st.mode == StreamMode::kRansShared && k > 1) {
        // Set the first index to K (out of range): corrupt, on both paths.
        auto bad = enc;
        const int w = std::bit_width(static_cast<unsigned>(shared->tables.n_tables - 1));
        const uint32_t kidx = (1u << w) - 1;  // the largest w-bit value
        if (kidx >= static_cast<uint32_t>(shared->tables.n_tables)) {
          bad[2] = static_cast<uint8_t>((bad[2] & ~((1u << w) - 1)) | kidx);
          std::vector<uint8_t> dec(chunk.size());
          for (RansImpl impl : {RansImpl::kAuto, RansImpl::kScalar})
            EXPECT_EQ(
                decode_symbols(bad.data(), bad.size(), 256, nc, bits, dec.data(), &*shared, impl)
                    .code(),
                ErrorCode::kCorrupt);
        }
      }
    }
  }
}

TEST(EntropyCodec, GivenCountsGiveTheSameStream) {
  std::mt19937 rng(21);
  for (int bits : {2, 4, 6}) {
    const int nc = 16;
    const int64_t nt = 96;
    auto sym = random_symbols(rng, static_cast<size_t>(nt * nc), bits, 0.7);
    std::vector<uint32_t> counts(static_cast<size_t>(nc) << bits);
    ASSERT_TRUE(count_symbols(sym.data(), sym.size(), bits, nc, counts.data()).ok());
    std::vector<uint8_t> a, b;
    ASSERT_TRUE(encode_symbols(sym.data(), nt, nc, bits, SymbolCodecOptions{}, a).ok());
    ASSERT_TRUE(encode_symbols(sym.data(), nt, nc, bits, SymbolCodecOptions{}, b, nullptr, nullptr,
                               counts.data())
                    .ok());
    EXPECT_EQ(a, b);
    sym[5] = static_cast<uint8_t>(1u << bits);  // out of range: still an error
    std::vector<uint8_t> c;
    EXPECT_EQ(encode_symbols(sym.data(), nt, nc, bits, SymbolCodecOptions{}, c, nullptr, nullptr,
                             counts.data())
                  .code(),
              ErrorCode::kOutOfRange);
    EXPECT_TRUE(c.empty());
  }
}

TEST(EntropyCodec, CorruptAndTruncatedStreamsFailCleanly) {
  std::mt19937 rng(11);
  for (bool delta : {false, true})
    for (int bits : {2, 4, 7}) {
      SynthKvOptions so;
      so.bits = bits;
      so.n_tokens = 40;
      so.n_channels = 32;
      so.token_delta = delta;
      auto sym = synth_kv_symbols(so);
      SymbolCodecOptions o;
      EncodeStats st;
      auto enc = encode_ok(sym, 40, 32, bits, o, &st);
      std::vector<uint8_t> dec(sym.size() + 64);
      // Truncation at every length fails (sizes are exact in every mode).
      for (size_t len = 0; len < enc.size(); ++len)
        for (RansImpl impl : {RansImpl::kAuto, RansImpl::kScalar})
          EXPECT_FALSE(
              decode_symbols(enc.data(), len, 40, 32, bits, dec.data(), nullptr, impl).ok())
              << "len " << len << " of " << enc.size();
      // Extra bytes fail.
      auto longer = enc;
      longer.push_back(0);
      longer.push_back(0);
      EXPECT_FALSE(decode_symbols(longer.data(), longer.size(), 40, 32, bits, dec.data()).ok());
      // Byte flips: never crash, never write past the output; scalar and SIMD agree.
      int detected = 0, flips = 0;
      for (size_t pos = 0; pos < enc.size(); ++pos)
        for (int k = 0; k < 3; ++k) {
          auto bad = enc;
          bad[pos] ^= static_cast<uint8_t>(1u << (rng() % 8));
          std::vector<uint8_t> d1(sym.size() + 64, 0x5A), d2(sym.size() + 64, 0x5A);
          Status s1 = decode_symbols(bad.data(), bad.size(), 40, 32, bits, d1.data());
          Status s2 = decode_symbols(bad.data(), bad.size(), 40, 32, bits, d2.data(), nullptr,
                                     RansImpl::kScalar);
          ASSERT_EQ(s1.ok(), s2.ok());
          if (s1.ok()) {
            ASSERT_TRUE(std::equal(d1.begin(), d1.begin() + sym.size(), d2.begin()));
          }
          for (size_t i = sym.size(); i < d1.size(); ++i) ASSERT_EQ(d1[i], 0x5A);
          detected += !s1.ok();
          ++flips;
        }
      if (st.mode == StreamMode::kRansInline) {
        EXPECT_GT(detected, flips * 9 / 10);
      }
    }
}

TEST(EntropyCodec, RandomGarbageNeverCrashes) {
  std::mt19937 rng(12);
  std::vector<uint8_t> dec(64 * 64 + 64);
  for (int trial = 0; trial < 3000; ++trial) {
    std::vector<uint8_t> b(rng() % 300);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    if (!b.empty()) b[0] = static_cast<uint8_t>((b[0] & 0x3F) | 2);  // mostly rANS modes
    const int bits = 1 + static_cast<int>(rng() % 8);
    Status s = decode_symbols(b.data(), b.size(), 64, 64, bits, dec.data(), nullptr,
                              trial % 2 ? RansImpl::kScalar : RansImpl::kAuto);
    (void)s;
  }
}

TEST(EntropyCodec, BadArgumentsAreErrors) {
  std::vector<uint8_t> sym(64, 3), out;
  SymbolCodecOptions o;
  EXPECT_EQ(encode_symbols(sym.data(), 8, 8, 0, o, out).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(encode_symbols(sym.data(), 8, 8, 9, o, out).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(encode_symbols(sym.data(), -1, 8, 4, o, out).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(encode_symbols(sym.data(), 8, 0, 4, o, out).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(encode_symbols(sym.data(), 8, 8, 1, o, out).code(), ErrorCode::kOutOfRange);
  o.prob_bits = 13;
  EXPECT_EQ(encode_symbols(sym.data(), 8, 8, 4, o, out).code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(out.empty());
  const uint8_t reserved[] = {0x40, 0};
  EXPECT_EQ(decode_symbols(reserved, 2, 1, 1, 4, sym.data()).code(), ErrorCode::kFormat);
}

TEST(EntropyCodec, SizeCloseToShannonPlusTables) {
  // Realistic chunks (skewed per-channel distributions: key deltas, values): coded bytes within
  // 2% of (Shannon estimate + table bytes) + header. Keys without delta are near-uniform after
  // per-group min/max quantization; there the only requirement is the raw-mode bound.
  for (int bits : {2, 3, 4}) {
    for (int kind = 0; kind < 4; ++kind) {
      SynthKvOptions so;
      so.bits = bits;
      so.keys = kind < 2;
      so.token_delta = kind % 2 == 1;
      so.n_tokens = 1024;
      so.seed = 100 + bits;
      auto sym = synth_kv_symbols(so);
      SymbolCodecOptions o;
      EncodeStats st;
      encode_ok(sym, so.n_tokens, 64, bits, o, &st);
      EXPECT_LE(st.total_bytes, 1 + packed_size(sym.size(), bits));
      if (kind == 0) continue;
      ASSERT_EQ(st.mode, StreamMode::kRansInline);
      const double bound = 1.02 * (st.shannon_bits / 8 + st.table_bytes) + st.header_bytes;
      EXPECT_LE(static_cast<double>(st.total_bytes), bound)
          << "bits=" << bits << " kind=" << kind << " shannon=" << st.shannon_bits / 8
          << " tables=" << st.table_bytes;
    }
  }
}

}  // namespace
}  // namespace kvq::entropy
