#include "kvq/synthetic.h"

#include <cmath>
#include <random>

namespace kvq {

SyntheticKV make_synthetic_kv(const SyntheticOptions& o) {
  SyntheticKV out{o.batch, o.heads, o.tokens, o.dim, {}, {}, {}};
  const size_t n = static_cast<size_t>(o.batch * o.heads * o.tokens * o.dim);
  out.k.resize(n);
  out.v.resize(n);
  out.q.resize(n);
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  const double ck = std::sqrt(1 - o.key_locality * o.key_locality);
  const double cv = std::sqrt(1 - o.value_locality * o.value_locality);
  for (int64_t b = 0; b < o.batch; ++b)
    for (int64_t h = 0; h < o.heads; ++h) {
      std::vector<double> kmean(o.dim), kscale(o.dim), vscale(o.dim), kstate(o.dim), vstate(o.dim);
      for (int64_t d = 0; d < o.dim; ++d) {
        kmean[d] = 0.5 * normal(rng);
        kscale[d] = 0.5 + 0.5 * std::fabs(normal(rng));
        vscale[d] = 0.3 + 0.2 * std::fabs(normal(rng));
        kstate[d] = normal(rng);
        vstate[d] = normal(rng);
      }
      for (int i = 0; i < o.outlier_channels && i < o.dim; ++i) {
        const int64_t d = static_cast<int64_t>(rng() % static_cast<uint64_t>(o.dim));
        kscale[d] *= 10.0;
        kmean[d] *= 10.0;
      }
      for (int64_t s = 0; s < o.tokens; ++s) {
        const bool sink = s == 0 || (o.sink_every > 0 && s % o.sink_every == 0);
        const size_t base = static_cast<size_t>(((b * o.heads + h) * o.tokens + s) * o.dim);
        for (int64_t d = 0; d < o.dim; ++d) {
          kstate[d] = o.key_locality * kstate[d] + ck * normal(rng);
          vstate[d] = o.value_locality * vstate[d] + cv * normal(rng);
          double kv = kmean[d] + kscale[d] * kstate[d];
          double vv = vscale[d] * vstate[d];
          if (sink) {
            kv *= 6.0;
            vv *= 0.2;  // sinks: large keys, small values (as observed in real models)
          }
          out.k[base + static_cast<size_t>(d)] = static_cast<float>(kv);
          out.v[base + static_cast<size_t>(d)] = static_cast<float>(vv);
          out.q[base + static_cast<size_t>(d)] =
              static_cast<float>(0.3 * kstate[d] * kscale[d] + 0.8 * normal(rng));
        }
      }
    }
  return out;
}

}  // namespace kvq
