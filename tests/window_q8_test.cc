// kvq's 8-bit window (window=q8): what a q8 window holds and seals from, its billing, and how
// import and the container refuse damaged rows (the row format: q8_rows_test.cc). The
// table-wide contract, semantics, allocation, container and store tests run window=q8 too
// (testing::small_specs() takes every enum choice).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "container_util.h"
#include "kvq/cache.h"
#include "kvq/container.h"
#include "numerics/q8_rows.h"
#include "test_util.h"

namespace kvq {
namespace {

const RopeShape kRope{RopeShape::Mode::kAdjacent, 10000.0, 1.0};

ModelCache make(const std::string& spec, int64_t H = 2, int64_t D = 64) {
  auto c = ModelCache::create(
      spec, ModelShape::uniform(1, static_cast<int>(H), static_cast<int>(D), 2 * H, kRope));
  KVQ_CHECK(c.ok());
  return std::move(*c);
}

TEST(KvqWindowQ8, BillsEightAndAHalfBitsAndHoldsThem) {
  const int64_t H = 2, D = 64, S = 32;  // one window page of 32 tokens, nothing sealed
  const auto k = testing::random_kv(1, H, S, D, 11), v = testing::random_kv(1, H, S, D, 12);
  ModelCache f16 = make("kvq:group=32,residual=32"),
             q8 = make("kvq:group=32,residual=32,window=q8");
  for (ModelCache* c : {&f16, &q8})
    ASSERT_TRUE(c->layer(0)
                    .append(TensorView::bhsd(k.data(), DType::kF32, 1, H, S, D),
                            TensorView::bhsd(v.data(), DType::kF32, 1, H, S, D))
                    .ok());
  EXPECT_EQ(q8.layer(0).window_format(), WindowFormat::kQ8);
  EXPECT_EQ(f16.layer(0).window_format(), WindowFormat::k16Bit);
  EXPECT_EQ(f16.bytes().residual, static_cast<uint64_t>(2 * H * S * D * 2));
  EXPECT_EQ(q8.bytes().residual, static_cast<uint64_t>(2 * H * S * (D + 4)));
  EXPECT_DOUBLE_EQ(f16.bytes().bits_per_element(), 16.0);
  EXPECT_DOUBLE_EQ(q8.bytes().bits_per_element(), 8.5);
  EXPECT_EQ(q8.resident_bytes(), q8.bytes().total());
  // And once blocks seal, the window's share drops by the same ratio.
  const int64_t S2 = 200;
  const auto k2 = testing::random_kv(1, H, S2, D, 13), v2 = testing::random_kv(1, H, S2, D, 14);
  ModelCache a = make("kvq:group=32,residual=32"), b = make("kvq:group=32,residual=32,window=q8");
  for (ModelCache* c : {&a, &b})
    ASSERT_TRUE(c->layer(0)
                    .append(TensorView::bhsd(k2.data(), DType::kF32, 1, H, S2, D),
                            TensorView::bhsd(v2.data(), DType::kF32, 1, H, S2, D))
                    .ok());
  EXPECT_EQ(b.resident_bytes(), b.bytes().total());
  EXPECT_EQ(a.bytes().params, b.bytes().params);
  EXPECT_EQ(a.bytes().key_codes, b.bytes().key_codes);
  const uint64_t sinks = 2 * H * 4 * D * 2;  // 4 sinks at fp16 in block 0, billed as residual
  EXPECT_EQ((b.bytes().residual - sinks) * 128, (a.bytes().residual - sinks) * 68);
  EXPECT_LT(b.bytes().bits_per_element(), a.bytes().bits_per_element());
}

// Values on the q8 grid (scale 2^-4, one code +-127 per block) plus noise below half a step: a
// q8 window rounds the noise away, so it holds, attends over and seals exactly what an fp16
// window fed the grid values does. Fed the noisy values, the fp16 window differs.
TEST(KvqWindowQ8, HoldsAndSealsTheEightBitValues) {
  const int64_t H = 2, D = 64, S = 150, HQ = 2 * H;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> code(-126, 126);
  std::uniform_real_distribution<float> noise(-0.4f, 0.4f);
  const float d = 0.0625f;
  std::vector<float> grid[2], noisy[2];
  for (int part = 0; part < 2; ++part) {
    grid[part].resize(static_cast<size_t>(H * S * D));
    noisy[part].resize(grid[part].size());
    for (size_t i = 0; i < grid[part].size(); ++i) {
      const bool peak = i % 32 == (i / 64) % 32;  // one element of each block of 32 at +-127
      const int c = peak ? ((i / 7) % 2 ? 127 : -127) : code(rng);
      grid[part][i] = static_cast<float>(c) * d;
      noisy[part][i] = grid[part][i] + (peak ? 0.0f : noise(rng) * d);
    }
  }
  const auto q = testing::random_kv(1, HQ, S, D, 9, 0.3f);
  const std::string spec = "kvq:group=32,residual=32";
  ModelCache q8 = make(spec + ",window=q8"), exact = make(spec), rounded = make(spec);
  auto feed = [&](ModelCache& c, std::vector<float>* kv) {
    for (int64_t s0 = 0; s0 < S; s0 += 25) {
      std::vector<float> k(static_cast<size_t>(H * 25 * D)), v(k.size()), qq(2 * k.size());
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < 25; ++t)
          for (int64_t x = 0; x < D; ++x) {
            k[static_cast<size_t>((h * 25 + t) * D + x)] =
                kv[0][static_cast<size_t>((h * S + s0 + t) * D + x)];
            v[static_cast<size_t>((h * 25 + t) * D + x)] =
                kv[1][static_cast<size_t>((h * S + s0 + t) * D + x)];
          }
      for (int64_t h = 0; h < HQ; ++h)
        std::memcpy(&qq[static_cast<size_t>(h * 25 * D)], &q[static_cast<size_t>((h * S + s0) * D)],
                    static_cast<size_t>(25 * D) * 4);
      const TensorView qv = TensorView::bhsd(qq.data(), DType::kF32, 1, HQ, 25, D);
      KVQ_CHECK(c.layer(0)
                    .append(TensorView::bhsd(k.data(), DType::kF32, 1, H, 25, D),
                            TensorView::bhsd(v.data(), DType::kF32, 1, H, 25, D), &qv)
                    .ok());
    }
    std::vector<float> out(static_cast<size_t>(HQ * 25 * D));
    const TensorView qv =
        TensorView::bhsd(q.data(), DType::kF32, 1, HQ, S, D).slice_tokens(S - 25, 25);
    KVQ_CHECK(c.layer(0)
                  .attend(qv, 0.125f, MutTensorView::bhsd(out.data(), DType::kF32, 1, HQ, 25, D))
                  .ok());
    return out;
  };
  const auto out_q8 = feed(q8, noisy), out_exact = feed(exact, grid),
             out_rounded = feed(rounded, noisy);
  ASSERT_GT(q8.layer(0).n_blocks(), 2);
  auto chunks = [](const ModelCache& c) {
    testing::ChunkCollector s;
    KVQ_CHECK(c.layer(0).export_blocks(0, s).ok());
    return s.store;
  };
  EXPECT_TRUE(chunks(q8) == chunks(exact)) << "blocks sealed from the 8-bit values";
  EXPECT_FALSE(chunks(rounded) == chunks(exact));
  EXPECT_TRUE(out_q8 == out_exact) << "attention over the 8-bit values";
  EXPECT_FALSE(out_rounded == out_exact);
  std::vector<float> k8, v8, ke, ve;
  testing::read_all(q8.layer(0), k8, v8);
  testing::read_all(exact.layer(0), ke, ve);
  EXPECT_TRUE(k8 == ke && v8 == ve);
}

TEST(KvqWindowQ8, DamagedWindowChunksAreRefused) {
  const int64_t H = 2, D = 64, S = 45;  // one block of 32 sealed (residual 8), 13 in the window
  const std::string spec = "kvq:group=32,residual=8,window=q8";
  ModelCache c = make(spec);
  const auto k = testing::random_kv(1, H, S, D, 21), v = testing::random_kv(1, H, S, D, 22);
  ASSERT_TRUE(c.layer(0)
                  .append(TensorView::bhsd(k.data(), DType::kF32, 1, H, S, D),
                          TensorView::bhsd(v.data(), DType::kF32, 1, H, S, D))
                  .ok());
  testing::ChunkCollector sink;
  ASSERT_TRUE(c.layer(0).export_blocks(0, sink).ok());
  ASSERT_TRUE(c.layer(0).export_tail(sink).ok());
  const auto chunks = sink.chunks();
  ASSERT_EQ(chunks.size(), 5u);
  const size_t rb = q8_row_bytes(D);
  ASSERT_EQ(chunks[2].size, static_cast<size_t>(H * 13) * rb);
  {
    ModelCache fresh = make(spec);
    ASSERT_TRUE(fresh.layer(0).import_chunks(chunks, 1, S, DType::kF16).ok());
    testing::ChunkCollector again;
    ASSERT_TRUE(fresh.layer(0).export_blocks(0, again).ok());
    ASSERT_TRUE(fresh.layer(0).export_tail(again).ok());
    EXPECT_TRUE(again.store == sink.store);
    EXPECT_EQ(fresh.resident_bytes(), fresh.bytes().total());
  }
  auto expect_refused = [&](std::vector<uint8_t> bytes, size_t which, DType dt, const char* what) {
    auto bad = chunks;
    bad[which].data = bytes.data();
    bad[which].size = bytes.size();
    ModelCache target = make(spec);
    const Status st = target.layer(0).import_chunks(bad, 1, S, dt);
    EXPECT_EQ(st.code(), ErrorCode::kCorrupt) << what << ": " << st.to_string();
    EXPECT_EQ(target.layer(0).offset(), 0) << what;
  };
  const std::vector<uint8_t> wk = sink.store[2], wv = sink.store[3];
  for (uint16_t s : {uint16_t{0x7c00}, uint16_t{0xfe00}, uint16_t{0x8400}, f32_to_f16(600.0f)}) {
    std::vector<uint8_t> b = wv;
    std::memcpy(b.data() + 5 * rb + 34, &s, 2);
    expect_refused(b, 3, DType::kF16, "bad scale");
  }
  std::vector<uint8_t> b = wk;
  b[7 * rb + 2 + 3] = 0x80;
  expect_refused(b, 2, DType::kF16, "code -128");
  expect_refused(std::vector<uint8_t>(wk.begin(), wk.end() - 1), 2, DType::kF16, "truncated");
  expect_refused(std::vector<uint8_t>(static_cast<size_t>(H * 13 * D * 2)), 2, DType::kF16,
                 "16-bit sized");
  expect_refused(wk, 2, DType::kBF16, "bf16 scales");
}

// The container: window chunks of a q8 layer carry dtype 3; a file whose window dtype does not
// match its layer's spec is corrupt, whichever way. At head_dim 2 a q8 row (one scale, two codes)
// is as long as a 16-bit one, so only the layer's spec tells the two apart.
TEST(KvqWindowQ8, ContainerCarriesTheRowFormat) {
  const int64_t H = 2, S = 45;
  for (const int64_t D : {64, 2})
    for (const char* spec : {"kvq:group=32,residual=8,window=q8", "kvq:group=32,residual=8"}) {
      SCOPED_TRACE(std::string(spec) + " D=" + std::to_string(D));
      ModelCache c = make(spec, H, D);
      const auto k = testing::random_kv(1, H, S, D, 31), v = testing::random_kv(1, H, S, D, 32);
      ASSERT_TRUE(c.layer(0)
                      .append(TensorView::bhsd(k.data(), DType::kF32, 1, H, S, D),
                              TensorView::bhsd(v.data(), DType::kF32, 1, H, S, D))
                      .ok());
      auto file = serialize_cache(c);
      ASSERT_TRUE(file.ok());
      auto back = parse_cache(file->data(), file->size());
      ASSERT_TRUE(back.ok()) << back.status().to_string();
      EXPECT_EQ(back->layer(0).window_format(), c.layer(0).window_format());
      auto again = serialize_cache(*back);
      ASSERT_TRUE(again.ok());
      EXPECT_TRUE(*again == *file);
      const bool q8 = c.layer(0).window_format() == WindowFormat::kQ8;
      auto info = inspect_container(file->data(), file->size());
      ASSERT_TRUE(info.ok());
      for (const ContainerChunk& ch : info->chunks) {
        if (ch.kind == ChunkKind::kWindowKeys || ch.kind == ChunkKind::kWindowValues) {
          EXPECT_EQ(ch.window_format, c.layer(0).window_format());
        }
      }
      // Relabel both window chunks: 3 -> 1 on the q8 file, 1 -> 3 on the fp16 one.
      auto raw = testing::split_file(*file);
      int relabelled = 0;
      for (auto& rec : raw.records)
        if (rec.type == testing::fourcc("CHNK") && (rec.fields[4] == 2 || rec.fields[4] == 3)) {
          EXPECT_EQ(rec.fields[5], q8 ? 3 : 1);
          rec.fields[5] = q8 ? 1 : 3;
          ++relabelled;
        }
      ASSERT_EQ(relabelled, 2);
      const auto bad = testing::join_file(raw);
      auto r = parse_cache(bad.data(), bad.size());
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.status().code(), ErrorCode::kCorrupt) << r.status().to_string();
    }
}

}  // namespace
}  // namespace kvq
