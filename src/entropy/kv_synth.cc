#include "entropy/kv_synth.h"

#include <algorithm>
#include <cmath>

namespace kvq::entropy {

namespace {

struct SplitMix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53; }
  double normal() {
    const double u = uniform(), v = uniform();
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
  }
};

}  // namespace

std::vector<uint8_t> synth_kv_symbols(const SynthKvOptions& o) {
  const int64_t nt = std::max<int64_t>(o.n_tokens, 0);
  const int nc = std::max(o.n_channels, 1);
  const int bits = std::clamp(o.bits, 1, 8);
  const int group = std::max(o.group, 1);
  SplitMix rng{o.seed * 0x2545F4914F6CDD1Dull + 12345};
  std::vector<double> mu(nc), sigma(nc), z(nc);
  for (int c = 0; c < nc; ++c) {
    const bool outlier = rng.uniform() < 0.05;
    mu[c] = 2.0 * rng.normal() * (outlier ? 5.0 : 1.0);
    sigma[c] = std::exp(0.5 * rng.normal()) * (outlier ? 4.0 : 1.0);
    z[c] = rng.normal();
  }
  const double rho = std::clamp(o.locality, 0.0, 0.999);
  const double innov = std::sqrt(1.0 - rho * rho);
  std::vector<double> v(static_cast<size_t>(nt) * nc);
  for (int64_t t = 0; t < nt; ++t)
    for (int c = 0; c < nc; ++c) {
      double e = rng.normal();
      if (rng.uniform() < 0.02) e *= 3.0;
      z[c] = rho * z[c] + innov * e;
      v[static_cast<size_t>(t) * nc + c] = mu[c] + sigma[c] * z[c];
    }
  const double levels = static_cast<double>((1 << bits) - 1);
  std::vector<uint8_t> codes(v.size());
  auto quantize = [&](auto index, int64_t count) {
    double lo = v[index(0)], hi = lo;
    for (int64_t k = 1; k < count; ++k)
      lo = std::min(lo, v[index(k)]), hi = std::max(hi, v[index(k)]);
    const double scale = std::max((hi - lo) / levels, 1e-8);
    for (int64_t k = 0; k < count; ++k)
      codes[index(k)] =
          static_cast<uint8_t>(std::clamp(std::nearbyint((v[index(k)] - lo) / scale), 0.0, levels));
  };
  if (o.keys) {
    for (int c = 0; c < nc; ++c)
      for (int64_t t0 = 0; t0 < nt; t0 += group)
        quantize([&](int64_t k) { return static_cast<size_t>(t0 + k) * nc + c; },
                 std::min<int64_t>(group, nt - t0));
  } else {
    for (int64_t t = 0; t < nt; ++t)
      for (int c0 = 0; c0 < nc; c0 += group)
        quantize([&](int64_t k) { return static_cast<size_t>(t) * nc + c0 + k; },
                 std::min<int64_t>(group, nc - c0));
  }
  if (o.token_delta) {
    const unsigned mask = (1u << bits) - 1u;
    for (int64_t t = nt - 1; t >= 1; --t)
      for (int c = 0; c < nc; ++c) {
        const size_t i = static_cast<size_t>(t) * nc + c;
        codes[i] = static_cast<uint8_t>((codes[i] - codes[i - nc]) & mask);
      }
  }
  return codes;
}

}  // namespace kvq::entropy
