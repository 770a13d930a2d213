#include "kvq/group_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kvq/dtype.h"
#include "kvq/status.h"

namespace kvq {

namespace {
constexpr uint16_t kF16MaxBits = 0x7bff;

// Stored layouts put parameters right after packed codes, at any byte offset (e.g. 5 bytes of
// 3-bit codes): parameter arrays are read and written with memcpy, never through a possibly
// misaligned QuantParams lvalue (undefined behaviour that UBSan reports).
QuantParams load_params(const QuantParams* p, int64_t i) {
  QuantParams q;
  std::memcpy(&q, reinterpret_cast<const unsigned char*>(p) + i * static_cast<int64_t>(sizeof q),
              sizeof q);
  return q;
}
void store_params(QuantParams* p, int64_t i, const QuantParams& q) {
  std::memcpy(reinterpret_cast<unsigned char*>(p) + i * static_cast<int64_t>(sizeof q), &q,
              sizeof q);
}

uint16_t f16_next_down(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x8001;  // +-0 -> smallest negative subnormal
  return (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
}
uint16_t f16_next_up(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001;
  return (h & 0x8000u) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
}
}  // namespace

uint16_t f16_round_down(float x) {
  uint16_t h = f32_to_f16(x);
  if (f16_to_f32(h) > x) h = f16_next_down(h);
  return h;
}

uint16_t f16_round_up(float x) {
  uint16_t h = f32_to_f16(x);
  if (f16_to_f32(h) < x) h = f16_next_up(h);
  return h;
}

QuantParams fit_range(float lo, float hi, int bits) {
  KVQ_CHECK(bits >= 1 && bits <= 8);
  const float qmax = static_cast<float>((1 << bits) - 1);
  QuantParams p;
  p.zero = f16_round_down(lo);
  const float zero = f16_to_f32(p.zero);
  float scale = std::max((hi - zero) / qmax, kScaleEps);
  p.scale = scale >= kF16Max ? kF16MaxBits : f16_round_up(scale);
  return p;
}

QuantParams fit_group(const float* x, size_t n, ptrdiff_t stride, int bits) {
  KVQ_CHECK(n > 0);
  float lo = x[0], hi = x[0];
  for (size_t i = 1; i < n; ++i) {
    const float v = x[static_cast<ptrdiff_t>(i) * stride];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  return fit_range(lo, hi, bits);
}

void quantize_group(const float* x, size_t n, ptrdiff_t stride, QuantParams p, int bits,
                    uint8_t* codes, ptrdiff_t code_stride) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float zero = f16_to_f32(p.zero);
  const float inv = 1.0f / f16_to_f32(p.scale);
  for (size_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[static_cast<ptrdiff_t>(i) * stride] - zero) * inv);
    codes[static_cast<ptrdiff_t>(i) * code_stride] =
        static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
  }
}

void quantize_per_channel(const float* x, int64_t T, int64_t D, int64_t ld, int bits,
                          uint8_t* codes, QuantParams* params) {
  // Range per channel in one pass over rows (cache-friendly), then codes row by row.
  thread_local std::vector<float> lo, hi, zero, inv;
  lo.assign(x, x + D);
  hi.assign(x, x + D);
  for (int64_t t = 1; t < T; ++t) {
    const float* row = x + t * ld;
    for (int64_t d = 0; d < D; ++d) {
      lo[d] = std::min(lo[d], row[d]);
      hi[d] = std::max(hi[d], row[d]);
    }
  }
  zero.resize(static_cast<size_t>(D));
  inv.resize(static_cast<size_t>(D));
  for (int64_t d = 0; d < D; ++d) {
    const QuantParams p = fit_range(lo[d], hi[d], bits);
    store_params(params, d, p);
    zero[d] = f16_to_f32(p.zero);
    inv[d] = 1.0f / f16_to_f32(p.scale);
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * ld;
    uint8_t* c = codes + t * D;
    for (int64_t d = 0; d < D; ++d) {
      const float q = std::nearbyint((row[d] - zero[d]) * inv[d]);
      c[d] = static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
    }
  }
}

void dequantize_per_channel(const uint8_t* codes, int64_t T, int64_t D, const QuantParams* params,
                            float* out) {
  thread_local std::vector<float> zs;
  zs.resize(static_cast<size_t>(2 * D));
  float* zero = zs.data();
  float* scale = zs.data() + D;
  for (int64_t d = 0; d < D; ++d) {
    const QuantParams p = load_params(params, d);
    zero[d] = f16_to_f32(p.zero);
    scale[d] = f16_to_f32(p.scale);
  }
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* c = codes + t * D;
    float* o = out + t * D;
    for (int64_t d = 0; d < D; ++d) o[d] = zero[d] + static_cast<float>(c[d]) * scale[d];
  }
}

void quantize_per_token(const float* x, int64_t T, int64_t D, int64_t ld, int64_t G, int bits,
                        uint8_t* codes, QuantParams* params) {
  const int64_t ng = n_channel_groups(D, G);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t d0 = g * G, n = std::min(G, D - d0);
      const QuantParams p = fit_group(x + t * ld + d0, static_cast<size_t>(n), 1, bits);
      store_params(params, t * ng + g, p);
      quantize_group(x + t * ld + d0, static_cast<size_t>(n), 1, p, bits, codes + t * D + d0, 1);
    }
}

void dequantize_per_token(const uint8_t* codes, int64_t T, int64_t D, int64_t G,
                          const QuantParams* params, float* out) {
  const int64_t ng = n_channel_groups(D, G);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < ng; ++g) {
      const QuantParams p = load_params(params, t * ng + g);
      const float zero = f16_to_f32(p.zero);
      const float scale = f16_to_f32(p.scale);
      const int64_t d0 = g * G, d1 = std::min(D, d0 + G);
      for (int64_t d = d0; d < d1; ++d)
        out[t * D + d] = zero + static_cast<float>(codes[t * D + d]) * scale;
    }
}

void quant_dequant_per_channel(const float* x, int64_t T, int64_t D, int bits, float* out) {
  std::vector<uint8_t> codes(static_cast<size_t>(T * D));
  std::vector<QuantParams> params(static_cast<size_t>(D));
  quantize_per_channel(x, T, D, D, bits, codes.data(), params.data());
  dequantize_per_channel(codes.data(), T, D, params.data(), out);
}

void quant_dequant_per_token(const float* x, int64_t T, int64_t D, int64_t G, int bits,
                             float* out) {
  std::vector<uint8_t> codes(static_cast<size_t>(T * D));
  std::vector<QuantParams> params(static_cast<size_t>(T * n_channel_groups(D, G)));
  quantize_per_token(x, T, D, D, G, bits, codes.data(), params.data());
  dequantize_per_token(codes.data(), T, D, G, params.data(), out);
}

}  // namespace kvq
