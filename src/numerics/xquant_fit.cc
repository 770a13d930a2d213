#include "numerics/xquant_fit.h"

#include <algorithm>
#include <cmath>

#include "kvq/dtype.h"
#include "kvq/status.h"

namespace kvq {

namespace {

uint16_t f16_nearest_clamped(double v) {
  const double c = std::clamp(v, -static_cast<double>(kF16Max), static_cast<double>(kF16Max));
  return f32_to_f16(static_cast<float>(c));
}

}  // namespace

QuantParams fit_params_to_codes(const float* x, ptrdiff_t xs, const uint8_t* c, ptrdiff_t cs,
                                size_t n) {
  KVQ_CHECK(n > 0);
  // Two passes in double: means, then centred moments (no cancellation for offset-heavy
  // channels such as the outlier channels of keys).
  double mx = 0, mc = 0;
  for (size_t i = 0; i < n; ++i) {
    mx += x[static_cast<ptrdiff_t>(i) * xs];
    mc += c[static_cast<ptrdiff_t>(i) * cs];
  }
  mx /= static_cast<double>(n);
  mc /= static_cast<double>(n);
  double sxc = 0, scc = 0;
  for (size_t i = 0; i < n; ++i) {
    const double dc = c[static_cast<ptrdiff_t>(i) * cs] - mc;
    sxc += (x[static_cast<ptrdiff_t>(i) * xs] - mx) * dc;
    scc += dc * dc;
  }
  QuantParams p;
  p.scale = scc > 0 ? f16_nearest_clamped(sxc / scc) : uint16_t{0};
  const double s = f16_to_f32(p.scale);
  p.zero = f16_nearest_clamped(mx - s * mc);
  return p;
}

QuantParams calibrate_eta(QuantParams p, int bits, float eta) {
  if (eta == 0.0f) return p;
  const double qmax = static_cast<double>((1 << bits) - 1);
  const double s = f16_to_f32(p.scale), z = f16_to_f32(p.zero);
  QuantParams out;
  out.zero = f16_nearest_clamped(z + static_cast<double>(eta) * s * qmax);
  out.scale = f16_nearest_clamped((1.0 - 2.0 * static_cast<double>(eta)) * s);
  return out;
}

void fit_per_channel_to_codes(const float* x, int64_t T, int64_t D, const uint8_t* codes,
                              QuantParams* params) {
  for (int64_t d = 0; d < D; ++d)
    params[d] = fit_params_to_codes(x + d, D, codes + d, D, static_cast<size_t>(T));
}

void fit_per_channel_minmax(const float* x, int64_t T, int64_t D, int bits, QuantParams* params) {
  for (int64_t d = 0; d < D; ++d) params[d] = fit_group(x + d, static_cast<size_t>(T), D, bits);
}

void fit_per_token_to_codes(const float* x, int64_t T, int64_t D, int64_t G, const uint8_t* codes,
                            QuantParams* params) {
  const int64_t ng = n_channel_groups(D, G);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t d0 = g * G, n = std::min(G, D - d0);
      params[t * ng + g] =
          fit_params_to_codes(x + t * D + d0, 1, codes + t * D + d0, 1, static_cast<size_t>(n));
    }
}

void fit_per_token_minmax(const float* x, int64_t T, int64_t D, int64_t G, int bits,
                          QuantParams* params) {
  const int64_t ng = n_channel_groups(D, G);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t d0 = g * G, n = std::min(G, D - d0);
      params[t * ng + g] = fit_group(x + t * D + d0, static_cast<size_t>(n), 1, bits);
    }
}

}  // namespace kvq
