// The CUDA decode kernels' split-K rules (src/cuda/split_rules.h), checked on the CPU: whatever
// the plan, the splits' tile ranges tile [0, n_tiles) in order, and no split holds much more than
// its share of units.
#include "cuda/split_rules.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace kvq::cuda {
namespace {

int64_t units_of(TileRange r, int64_t n_sealed, int cost) {
  const int64_t sealed_end = r.end < n_sealed ? r.end : n_sealed;
  const int64_t sealed = r.begin < sealed_end ? sealed_end - r.begin : 0;
  return sealed + cost * ((r.end - r.begin) - sealed);
}

TEST(SplitRules, RangesTileEveryTileOnceInOrder) {
  int64_t plans = 0;
  for (int64_t n_sealed = 0; n_sealed <= 70; n_sealed += (n_sealed < 12 ? 1 : 7)) {
    for (int64_t window = 0; window <= 9; ++window) {
      const int64_t n_tiles = n_sealed + window;
      if (n_tiles == 0) continue;
      for (int cost = 1; cost <= 8; ++cost) {
        for (int64_t want = 1; want <= 40; ++want) {
          SCOPED_TRACE(::testing::Message() << "sealed " << n_sealed << " tiles " << n_tiles
                                            << " cost " << cost << " want " << want);
          const TileSplitPlan p = plan_tile_splits(n_sealed, n_tiles, cost, want);
          ASSERT_GE(p.n_splits, 1);
          ASSERT_LE(p.n_splits, want);
          ASSERT_GE(p.split_units, 1);
          int64_t next = 0;
          for (int64_t s = 0; s < p.n_splits; ++s) {
            const TileRange r = split_tile_range(s, p.split_units, cost, n_sealed, n_tiles);
            ASSERT_EQ(r.begin, next) << "split " << s;
            ASSERT_LE(r.begin, r.end) << "split " << s;
            // A window tile goes where its first unit lies: a split overruns its share by less
            // than one window tile.
            ASSERT_LE(units_of(r, n_sealed, cost), p.split_units + cost - 1) << "split " << s;
            next = r.end;
          }
          ASSERT_EQ(next, n_tiles);
          // Splits past the plan hold nothing (the decode kernel's last CTA of 4 warps runs up to
          // 3 of them when it merges its warps' splits).
          for (int64_t s = p.n_splits; s < p.n_splits + 8; ++s) {
            const TileRange past = split_tile_range(s, p.split_units, cost, n_sealed, n_tiles);
            ASSERT_EQ(past.begin, past.end) << "split " << s;
          }
          ++plans;
        }
      }
    }
  }
  EXPECT_GT(plans, 10000);
}

TEST(SplitRules, TheWindowSplitTakesFewerSealedTiles) {
  // 100 sealed tiles and 4 window tiles at cost 4: 116 units in 4 splits of 29.
  const TileSplitPlan p = plan_tile_splits(100, 104, 4, 4);
  EXPECT_EQ(p.split_units, 29);
  EXPECT_EQ(p.n_splits, 4);
  const TileRange last = split_tile_range(3, p.split_units, 4, 100, 104);
  EXPECT_EQ(last.begin, 87);  // 13 sealed tiles, then the 4 window tiles
  EXPECT_EQ(last.end, 104);
  const TileRange first = split_tile_range(0, p.split_units, 4, 100, 104);
  EXPECT_EQ(first.begin, 0);
  EXPECT_EQ(first.end, 29);
}

}  // namespace
}  // namespace kvq::cuda
