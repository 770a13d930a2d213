// Lloyd-Max scalar quantizers: the level sets that minimise mean squared error for a known
// density, computed once per (density, size) and shared.
//
// The computation is deterministic on every machine: the density is sampled on 2^16 cells of its
// interval, levels start at the means of equal-probability cells and take a fixed number of
// Lloyd iterations, all in double precision in a fixed order, then round to float.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace kvq {

// K ascending levels for `density` (unnormalised, >= 0) on [lo, hi].
std::vector<float> lloyd_max_levels(const std::function<double(double)>& density, double lo,
                                    double hi, int K);

// Levels for the standard normal distribution, 2^bits of them (bits in 1..8); memoised.
const std::vector<float>& gaussian_levels(int bits);
// Levels for one coordinate of a uniformly random unit vector in R^D, whose density is
// (1 - t^2)^((D - 3) / 2) on [-1, 1] (TurboQuant's codebook); memoised.
const std::vector<float>& sphere_coordinate_levels(int64_t D, int bits);

// The index of the level nearest to x, given the K - 1 midpoints between adjacent levels
// (`bounds`, ascending): the number of midpoints strictly below x.
inline int nearest_level_index(const float* bounds, int K, float x) {
  if (K <= 16) {
    int c = 0;
    for (int i = 0; i + 1 < K; ++i) c += x > bounds[i];
    return c;
  }
  int lo = 0, hi = K - 1;  // binary search for the first midpoint >= x
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (x > bounds[mid]) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// Midpoints between adjacent levels.
std::vector<float> level_bounds(const std::vector<float>& levels);

}  // namespace kvq
