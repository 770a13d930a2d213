// Split-K rules of the decode kernels (attend_fast.cu, attend_zip.cu): how a row's 32-token tiles
// divide among splits. In a header with no dependencies so that the host's plan, the kernels and
// a CPU test use the very same arithmetic.
//
// Tiles are costed in units: a sealed tile 1, a window tile `window_cost` (it reads its fp16
// pages, several times a packed tile's bytes, without the sealed tiles' pipeline). Split i takes
// units [i u, (i + 1) u), so the split that holds the window takes fewer sealed tiles. A window
// tile belongs to the split where its first unit lies; a split may come out empty (its partial
// then has l = 0).
#pragma once

#include <cstdint>

#include "cache/seal_rules.h"  // KVQ_HOST_DEVICE

namespace kvq::cuda {

struct TileRange {
  int64_t begin, end;  // tiles [begin, end)
};

// Split `split`'s tiles, of n_tiles of which the first n_sealed are sealed.
KVQ_HOST_DEVICE inline TileRange split_tile_range(int64_t split, int64_t split_units,
                                                  int window_cost, int64_t n_sealed,
                                                  int64_t n_tiles) {
  auto at = [&](int64_t unit) {  // the first tile whose first unit is at or past `unit`
    if (unit <= n_sealed) return unit;
    const int64_t t = n_sealed + (unit - n_sealed + window_cost - 1) / window_cost;
    return t < n_tiles ? t : n_tiles;
  };
  return {at(split * split_units), at((split + 1) * split_units)};
}

struct TileSplitPlan {
  int64_t split_units;  // units per split
  int n_splits;         // splits that hold at least one unit
};

// The plan for about `want` splits (want >= 1, n_tiles >= 1): every split but the last holds
// split_units units, so n_splits <= want.
inline TileSplitPlan plan_tile_splits(int64_t n_sealed, int64_t n_tiles, int window_cost,
                                      int64_t want) {
  const int64_t units = n_sealed + window_cost * (n_tiles - n_sealed);
  const int64_t per = (units + want - 1) / want;
  return {per, static_cast<int>((units + per - 1) / per)};
}

}  // namespace kvq::cuda
