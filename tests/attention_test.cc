// The CPU attention kernel (numerics/attention.h) against its scalar definition, bit for bit, on
// odd shapes: rows not a multiple of the kernel's block, tiles not a multiple of 16, head dims
// not a multiple of 64, rows that see none, some or all of a tile, and several tiles in a row.
#include "numerics/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace kvq {
namespace {

TEST(AttentionKernel, MatchesItsDefinitionBitForBit) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Workspace ws;
  for (int64_t D : {8, 16, 64, 80, 128})
    for (int64_t rows : {1, 3, 4, 5, 9})
      for (int64_t n : {1, 15, 16, 33, 130}) {
        std::vector<float> q(static_cast<size_t>(rows * D)), k(static_cast<size_t>(n * D)),
            v(k.size());
        for (auto& x : q) x = 0.3f * nd(rng);
        for (auto& x : k) x = nd(rng);
        for (auto& x : v) x = nd(rng);
        std::vector<float> m1(static_cast<size_t>(rows), -std::numeric_limits<float>::infinity()),
            l1(static_cast<size_t>(rows), 0.0f), a1(static_cast<size_t>(rows * D), 0.0f);
        std::vector<float> m2 = m1, l2 = l1, a2 = a1;
        // Three tiles in a row, each row seeing a different prefix (0 = none) of each.
        for (int tile = 0; tile < 3; ++tile) {
          std::vector<int64_t> vis(static_cast<size_t>(rows));
          for (auto& x : vis) x = static_cast<int64_t>(rng() % static_cast<uint32_t>(n + 1));
          vis[0] = n;
          attend_tile(q.data(), rows, D, k.data(), v.data(), n, vis.data(), m1.data(), l1.data(),
                      a1.data(), ws);
          attend_tile_reference(q.data(), rows, D, k.data(), v.data(), n, vis.data(), m2.data(),
                                l2.data(), a2.data());
        }
        const std::string at = "D " + std::to_string(D) + ", rows " + std::to_string(rows) +
                               ", n " + std::to_string(n);
        EXPECT_EQ(0, std::memcmp(m1.data(), m2.data(), m1.size() * 4)) << at;
        EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.size() * 4)) << at;
        EXPECT_EQ(0, std::memcmp(a1.data(), a2.data(), a1.size() * 4)) << at;
      }
}

TEST(AttentionKernel, IsASoftmaxAverage) {
  // One tile, one row: acc / l equals softmax(q k^T) v computed in double.
  const int64_t D = 32, n = 40;
  std::mt19937 rng(4);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> q(D), k(n * D), v(n * D);
  for (auto& x : q) x = 0.2f * nd(rng);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  float m = -std::numeric_limits<float>::infinity(), l = 0;
  std::vector<float> acc(D, 0.0f);
  const int64_t vis = n;
  Workspace ws;
  attend_tile(q.data(), 1, D, k.data(), v.data(), n, &vis, &m, &l, acc.data(), ws);
  std::vector<double> s(n);
  double mx = -INFINITY, sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t d = 0; d < D; ++d) s[j] += static_cast<double>(q[d]) * k[j * D + d];
    mx = std::max(mx, s[j]);
  }
  for (auto& x : s) sum += (x = std::exp(x - mx));
  for (int64_t d = 0; d < D; ++d) {
    double want = 0;
    for (int64_t j = 0; j < n; ++j) want += s[j] * v[j * D + d];
    EXPECT_NEAR(acc[d] / l, want / sum, 1e-5);
  }
}

}  // namespace
}  // namespace kvq
