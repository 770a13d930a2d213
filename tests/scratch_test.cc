// Scratch without thread_local: Workspace frames and persistent slots, the coder's use of them (a
// reused workspace must give the same streams and symbols as a fresh one: persistent scratch
// carries no state), and the stack tiles of the pure functions (more channels than one tile).
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "entropy/cachegen_codes.h"
#include "entropy/symbol_codec.h"
#include "kvq/dtype.h"
#include "kvq/group_quant.h"
#include "kvq/workspace.h"
#include "kvq/zipcache.h"

namespace kvq {
namespace {

TEST(Workspace, FramesReuseTheirMemory) {
  Workspace ws;
  for (int i = 0; i < 3; ++i) {
    Workspace::Frame f(ws);
    float* a = ws.alloc<float>(1000);
    uint8_t* b = ws.alloc<uint8_t>(100000);  // more than the first chunk: a second one
    a[0] = 1.0f;
    b[0] = 2;
  }
  const uint64_t warm = ws.allocations();
  for (int i = 0; i < 3; ++i) {
    Workspace::Frame f(ws);
    (void)ws.alloc<float>(1000);
    (void)ws.alloc<uint8_t>(100000);
  }
  EXPECT_EQ(ws.allocations(), warm);  // merged into one chunk on the first close
}

TEST(Workspace, PersistentSlotsAreOnePerTypeAndOutliveFrames) {
  struct A {
    std::vector<int> v;
  };
  struct B {
    int x = 7;
  };
  Workspace ws;
  A* first;
  {
    Workspace::Frame f(ws);
    first = &ws.persistent<A>();
    first->v.assign(100, 3);
  }
  EXPECT_EQ(&ws.persistent<A>(), first);
  EXPECT_EQ(ws.persistent<A>().v.size(), 100u);
  EXPECT_EQ(ws.persistent<B>().x, 7);
  EXPECT_NE(static_cast<void*>(&ws.persistent<B>()), static_cast<void*>(first));
  Workspace other;
  EXPECT_NE(&other.persistent<A>(), first);  // per workspace
  EXPECT_TRUE(other.persistent<A>().v.empty());
  ws.release();
  EXPECT_TRUE(ws.persistent<A>().v.empty());  // destroyed, then made anew
}

std::vector<uint8_t> symbols(std::mt19937& rng, size_t n, int bits, double spread) {
  std::normal_distribution<double> g(0.0, spread);
  std::vector<uint8_t> s(n);
  const int a = 1 << bits;
  for (auto& x : s) x = static_cast<uint8_t>((static_cast<int>(std::lround(g(rng))) % a + a) % a);
  return s;
}

// Streams of different shapes, bits and table layouts, coded one after another with one
// workspace, equal the streams coded with a fresh workspace each (and with none), and decode
// through the same workspace to their symbols.
TEST(Workspace, ReusedByTheCoderGivesTheSameStreams) {
  std::mt19937 rng(11);
  Workspace shared_ws;
  struct Case {
    int64_t tokens;
    int channels, bits;
    double spread;
    entropy::TableLayout layout;
  };
  const Case cases[] = {
      {256, 64, 4, 2.0, entropy::TableLayout::kPerChannel},
      {32, 8, 2, 0.7, entropy::TableLayout::kAuto},
      {1024, 128, 8, 20.0, entropy::TableLayout::kPooled},
      {64, 3, 3, 0.0, entropy::TableLayout::kPerChannel},  // constant stream
      {256, 64, 4, 50.0, entropy::TableLayout::kAuto},     // near uniform: raw mode
      {17, 5, 5, 3.0, entropy::TableLayout::kPerChannel},
  };
  for (int round = 0; round < 2; ++round)
    for (const Case& c : cases) {
      const auto sym = symbols(rng, static_cast<size_t>(c.tokens) * c.channels, c.bits, c.spread);
      entropy::SymbolCodecOptions o;
      o.layout = c.layout;
      std::vector<uint8_t> with_shared, with_fresh, with_none;
      Workspace fresh;
      ASSERT_TRUE(entropy::encode_symbols(sym.data(), c.tokens, c.channels, c.bits, o, with_shared,
                                          nullptr, nullptr, nullptr, &shared_ws)
                      .ok());
      ASSERT_TRUE(entropy::encode_symbols(sym.data(), c.tokens, c.channels, c.bits, o, with_fresh,
                                          nullptr, nullptr, nullptr, &fresh)
                      .ok());
      ASSERT_TRUE(
          entropy::encode_symbols(sym.data(), c.tokens, c.channels, c.bits, o, with_none).ok());
      EXPECT_EQ(with_shared, with_fresh);
      EXPECT_EQ(with_shared, with_none);
      std::vector<uint8_t> back(sym.size());
      ASSERT_TRUE(entropy::decode_symbols(with_shared.data(), with_shared.size(), c.tokens,
                                          c.channels, c.bits, back.data(), nullptr,
                                          entropy::RansImpl::kAuto, nullptr, &shared_ws)
                      .ok());
      EXPECT_EQ(back, sym);
      // The channel-delta choice through the same workspace.
      std::vector<uint8_t> m1(cachegen::mask_bytes(c.channels)), m2(m1.size());
      std::vector<uint8_t> s1(sym.size()), s2(sym.size());
      cachegen::chunk_symbols(cachegen::DeltaMode::kAuto, 0, sym.data(), c.tokens, c.channels,
                              c.bits, s1.data(), m1.data(), nullptr, &shared_ws);
      cachegen::chunk_symbols(cachegen::DeltaMode::kAuto, 0, sym.data(), c.tokens, c.channels,
                              c.bits, s2.data(), m2.data());
      EXPECT_EQ(m1, m2);
      EXPECT_EQ(s1, s2);
    }
}

// Per-channel quantization in tiles of 256 channels equals the definition channel by channel
// (fit_group over the channel's column, quantize_group), for widths that end mid-tile.
TEST(StackTiles, PerChannelQuantizationMatchesTheColumnDefinition) {
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.0f, 3.0f);
  for (int64_t D : {1, 255, 256, 257, 600}) {
    const int64_t T = 9, ld = D + 3;
    std::vector<float> x(static_cast<size_t>(T * ld));
    for (auto& v : x) v = g(rng);
    std::vector<uint8_t> codes(static_cast<size_t>(T * D)), ref(codes.size());
    std::vector<QuantParams> params(static_cast<size_t>(D));
    quantize_per_channel(x.data(), T, D, ld, 3, codes.data(), params.data());
    std::vector<float> out(static_cast<size_t>(T * D));
    dequantize_per_channel(codes.data(), T, D, params.data(), out.data());
    for (int64_t d = 0; d < D; ++d) {
      const QuantParams p = fit_group(x.data() + d, static_cast<size_t>(T), ld, 3);
      EXPECT_EQ(p.scale, params[static_cast<size_t>(d)].scale) << "D " << D << " channel " << d;
      EXPECT_EQ(p.zero, params[static_cast<size_t>(d)].zero) << "D " << D << " channel " << d;
      quantize_group(x.data() + d, static_cast<size_t>(T), ld, p, 3, ref.data() + d, D);
      for (int64_t t = 0; t < T; ++t)
        EXPECT_EQ(out[static_cast<size_t>(t * D + d)],
                  f16_to_f32(p.zero) + static_cast<float>(ref[static_cast<size_t>(t * D + d)]) *
                                           f16_to_f32(p.scale));
    }
    EXPECT_EQ(codes, ref) << "D " << D;
  }
}

// Channel deltas in tiles: every channel delta coded is the token delta, none is the identity,
// and a mixed mask inverts, in place too, across tile boundaries.
TEST(StackTiles, ChannelDeltasAcrossTiles) {
  std::mt19937 rng(6);
  for (int64_t D : {7, 256, 300, 513}) {
    const int64_t n = 5;
    const int bits = 4;
    std::vector<uint8_t> codes(static_cast<size_t>(n * D));
    for (auto& c : codes) c = static_cast<uint8_t>(rng() % 16);
    std::vector<uint8_t> all(cachegen::mask_bytes(D), 0xFF), none(all.size(), 0), mixed(all.size());
    for (auto& m : mixed) m = static_cast<uint8_t>(rng());
    std::vector<uint8_t> out(codes.size()), ref(codes.size());
    cachegen::apply_channel_deltas(all.data(), codes.data(), n, D, bits, out.data());
    cachegen::token_delta(codes.data(), n, D, bits, ref.data());
    EXPECT_EQ(out, ref) << "D " << D;
    cachegen::apply_channel_deltas(none.data(), codes.data(), n, D, bits, out.data());
    EXPECT_EQ(out, codes) << "D " << D;
    cachegen::apply_channel_deltas(mixed.data(), codes.data(), n, D, bits, out.data());
    std::vector<uint8_t> inplace = codes;
    cachegen::apply_channel_deltas(mixed.data(), inplace.data(), n, D, bits, inplace.data());
    EXPECT_EQ(inplace, out) << "D " << D;
    for (int64_t d = 0; d < D; ++d) {  // the definition, per channel
      const bool delta = (mixed[static_cast<size_t>(d / 8)] >> (d % 8)) & 1;
      for (int64_t t = 1; t < n; ++t) {
        const int c = codes[static_cast<size_t>(t * D + d)];
        const int p = delta ? codes[static_cast<size_t>((t - 1) * D + d)] : 0;
        ASSERT_EQ(out[static_cast<size_t>(t * D + d)], (c - p) & 15) << "D " << D << " d " << d;
      }
    }
    cachegen::invert_channel_deltas(mixed.data(), out.data(), n, D, bits, out.data());
    EXPECT_EQ(out, codes) << "D " << D;
  }
}

// Channel-separable values over more channels than a tile: dequantize(quantize(x)) is what the
// per-token parameters and channel scales say, element by element.
TEST(StackTiles, CstDequantizeAcrossTiles) {
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.0f, 2.0f);
  const int64_t S = 4, D = 520, G = 64;
  std::vector<float> x(static_cast<size_t>(S * D));
  for (auto& v : x) v = g(rng);
  std::vector<uint8_t> bits(static_cast<size_t>(S), 4), codes(static_cast<size_t>(S * D));
  std::vector<uint16_t> cs(static_cast<size_t>(D));
  std::vector<QuantParams> params(static_cast<size_t>(S * n_channel_groups(D, G)));
  Workspace ws;
  cst_quantize(x.data(), S, D, D, G, bits.data(), cs.data(), codes.data(), params.data(), ws);
  std::vector<float> out(x.size()), plain(x.size());
  cst_dequantize(codes.data(), S, D, G, cs.data(), params.data(), out.data());
  dequantize_per_token(codes.data(), S, D, G, params.data(), plain.data());
  for (int64_t t = 0; t < S; ++t)
    for (int64_t d = 0; d < D; ++d)
      ASSERT_EQ(out[static_cast<size_t>(t * D + d)],
                plain[static_cast<size_t>(t * D + d)] * f16_to_f32(cs[static_cast<size_t>(d)]));
  // The workspace overload and the allocating one agree.
  std::vector<uint8_t> codes2(codes.size());
  std::vector<uint16_t> cs2(cs.size());
  std::vector<QuantParams> params2(params.size());
  cst_quantize(x.data(), S, D, D, G, bits.data(), cs2.data(), codes2.data(), params2.data());
  EXPECT_EQ(codes, codes2);
  EXPECT_EQ(cs, cs2);
}

}  // namespace
}  // namespace kvq
