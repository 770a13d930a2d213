#include "numerics/lloyd.h"

#include <cmath>
#include <map>
#include <mutex>
#include <utility>

namespace kvq {

std::vector<float> lloyd_max_levels(const std::function<double(double)>& density, double lo,
                                    double hi, int K) {
  constexpr int kGrid = 1 << 16;
  constexpr int kIterations = 300;
  std::vector<double> t(kGrid), w(kGrid);
  double total = 0;
  for (int i = 0; i < kGrid; ++i) {
    t[static_cast<size_t>(i)] = lo + (hi - lo) * (2.0 * i + 1.0) / (2.0 * kGrid);
    w[static_cast<size_t>(i)] = density(t[static_cast<size_t>(i)]);
    total += w[static_cast<size_t>(i)];
  }
  std::vector<double> level(static_cast<size_t>(K)), sum(static_cast<size_t>(K)),
      mass(static_cast<size_t>(K));
  auto update = [&] {
    for (int j = 0; j < K; ++j)
      if (mass[static_cast<size_t>(j)] > 0)
        level[static_cast<size_t>(j)] = sum[static_cast<size_t>(j)] / mass[static_cast<size_t>(j)];
  };
  // Start: the means of K equal-probability cells.
  double acc = 0;
  for (int i = 0, k = 0; i < kGrid; ++i) {
    while (k < K - 1 && acc >= total * (k + 1) / K) ++k;
    sum[static_cast<size_t>(k)] += w[static_cast<size_t>(i)] * t[static_cast<size_t>(i)];
    mass[static_cast<size_t>(k)] += w[static_cast<size_t>(i)];
    acc += w[static_cast<size_t>(i)];
  }
  update();
  for (int it = 0; it < kIterations; ++it) {
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(mass.begin(), mass.end(), 0.0);
    for (int i = 0, k = 0; i < kGrid; ++i) {
      const double x = t[static_cast<size_t>(i)];
      while (k < K - 1 &&
             x > 0.5 * (level[static_cast<size_t>(k)] + level[static_cast<size_t>(k + 1)]))
        ++k;
      sum[static_cast<size_t>(k)] += w[static_cast<size_t>(i)] * x;
      mass[static_cast<size_t>(k)] += w[static_cast<size_t>(i)];
    }
    update();
  }
  std::vector<float> out(static_cast<size_t>(K));
  for (int j = 0; j < K; ++j) out[static_cast<size_t>(j)] = static_cast<float>(level[static_cast<size_t>(j)]);
  return out;
}

namespace {
std::mutex g_mu;
}  // namespace

const std::vector<float>& gaussian_levels(int bits) {
  static std::map<int, std::vector<float>> memo;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = memo.find(bits);
  if (it == memo.end())
    it = memo.emplace(bits, lloyd_max_levels([](double x) { return std::exp(-0.5 * x * x); }, -8.0,
                                             8.0, 1 << bits))
             .first;
  return it->second;
}

const std::vector<float>& sphere_coordinate_levels(int64_t D, int bits) {
  static std::map<std::pair<int64_t, int>, std::vector<float>> memo;
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = memo.find({D, bits});
  if (it == memo.end()) {
    const double e = (static_cast<double>(D) - 3.0) / 2.0;
    it = memo.emplace(std::make_pair(D, bits),
                      lloyd_max_levels([e](double t) { return e >= 0 ? std::pow(1.0 - t * t, e) : 1.0; },
                                       -1.0, 1.0, 1 << bits))
             .first;
  }
  return it->second;
}

std::vector<float> level_bounds(const std::vector<float>& levels) {
  std::vector<float> b;
  for (size_t k = 0; k + 1 < levels.size(); ++k) b.push_back(0.5f * (levels[k] + levels[k + 1]));
  return b;
}

}  // namespace kvq
