#include "kvq/group_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/cpu.h"
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

namespace {

// The loops below are compiled once per SIMD level (core/cpu.h): the codes loops vectorise (and
// std::nearbyint becomes one rounding instruction from the AVX2 level on; at the baseline it is
// a library call). Element-wise IEEE arithmetic without contraction: every level stores the same
// codes and parameters.

template <SimdLevel L>
KVQ_ALWAYS_INLINE QuantParams fit_group_body(const float* x, size_t n, ptrdiff_t stride, int bits) {
  KVQ_CHECK(n > 0);
  float lo = x[0], hi = x[0];
  for (size_t i = 1; i < n; ++i) {
    const float v = x[static_cast<ptrdiff_t>(i) * stride];
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  return fit_range(lo, hi, bits);
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void quantize_group_body(const float* x, size_t n, ptrdiff_t stride,
                                           QuantParams p, int bits, uint8_t* codes,
                                           ptrdiff_t code_stride) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  const float zero = f16_to_f32(p.zero);
  const float inv = 1.0f / f16_to_f32(p.scale);
  if (stride == 1 && code_stride == 1) {  // the common case, as a loop that vectorises
    for (size_t i = 0; i < n; ++i)
      codes[i] = static_cast<uint8_t>(std::clamp(std::nearbyint((x[i] - zero) * inv), 0.0f, qmax));
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[static_cast<ptrdiff_t>(i) * stride] - zero) * inv);
    codes[static_cast<ptrdiff_t>(i) * code_stride] =
        static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
  }
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void quantize_per_channel_body(const float* x, int64_t T, int64_t D, int64_t ld,
                                                 int bits, uint8_t* codes, QuantParams* params) {
  // Range per channel in one pass over rows (cache-friendly), then codes row by row.
  thread_local std::vector<float> lo, hi, zero, inv;
  lo.assign(x, x + D);
  hi.assign(x, x + D);
  float* const l = lo.data();
  float* const h = hi.data();
  for (int64_t t = 1; t < T; ++t) {
    const float* row = x + t * ld;
    for (int64_t d = 0; d < D; ++d) {
      l[d] = std::min(l[d], row[d]);
      h[d] = std::max(h[d], row[d]);
    }
  }
  zero.resize(static_cast<size_t>(D));
  inv.resize(static_cast<size_t>(D));
  float* const z = zero.data();
  float* const iv = inv.data();
  for (int64_t d = 0; d < D; ++d) {
    const QuantParams p = fit_range(l[d], h[d], bits);
    store_params(params, d, p);
    z[d] = f16_to_f32(p.zero);
    iv[d] = 1.0f / f16_to_f32(p.scale);
  }
  const float qmax = static_cast<float>((1 << bits) - 1);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = x + t * ld;
    uint8_t* c = codes + t * D;
    for (int64_t d = 0; d < D; ++d) {
      const float q = std::nearbyint((row[d] - z[d]) * iv[d]);
      c[d] = static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
    }
  }
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void dequantize_per_channel_body(const uint8_t* codes, int64_t T, int64_t D,
                                                   const QuantParams* params, float* out) {
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

template <SimdLevel L>
KVQ_ALWAYS_INLINE void quantize_per_token_body(const float* x, int64_t T, int64_t D, int64_t ld,
                                               int64_t G, int bits, uint8_t* codes,
                                               QuantParams* params) {
  const int64_t ng = n_channel_groups(D, G);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t d0 = g * G, n = std::min(G, D - d0);
      const QuantParams p = fit_group_body<L>(x + t * ld + d0, static_cast<size_t>(n), 1, bits);
      store_params(params, t * ng + g, p);
      quantize_group_body<L>(x + t * ld + d0, static_cast<size_t>(n), 1, p, bits,
                             codes + t * D + d0, 1);
    }
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void dequantize_per_token_body(const uint8_t* codes, int64_t T, int64_t D,
                                                 int64_t G, const QuantParams* params, float* out) {
  const int64_t ng = n_channel_groups(D, G);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < ng; ++g) {
      const QuantParams p = load_params(params, t * ng + g);
      const float zero = f16_to_f32(p.zero);
      const float scale = f16_to_f32(p.scale);
      const int64_t d0 = g * G, d1 = std::min(D, d0 + G);
      const uint8_t* c = codes + t * D;
      float* o = out + t * D;
      for (int64_t d = d0; d < d1; ++d) o[d] = zero + static_cast<float>(c[d]) * scale;
    }
}

KVQ_LEVEL_CLONES(QuantParams, fit_group, (const float* x, size_t n, ptrdiff_t stride, int bits),
                 (x, n, stride, bits))
KVQ_LEVEL_CLONES(void, quantize_group,
                 (const float* x, size_t n, ptrdiff_t stride, QuantParams p, int bits,
                  uint8_t* codes, ptrdiff_t code_stride),
                 (x, n, stride, p, bits, codes, code_stride))
KVQ_LEVEL_CLONES(void, quantize_per_channel,
                 (const float* x, int64_t T, int64_t D, int64_t ld, int bits, uint8_t* codes,
                  QuantParams* params),
                 (x, T, D, ld, bits, codes, params))
KVQ_LEVEL_CLONES(void, dequantize_per_channel,
                 (const uint8_t* codes, int64_t T, int64_t D, const QuantParams* params,
                  float* out),
                 (codes, T, D, params, out))
KVQ_LEVEL_CLONES(void, quantize_per_token,
                 (const float* x, int64_t T, int64_t D, int64_t ld, int64_t G, int bits,
                  uint8_t* codes, QuantParams* params),
                 (x, T, D, ld, G, bits, codes, params))
KVQ_LEVEL_CLONES(void, dequantize_per_token,
                 (const uint8_t* codes, int64_t T, int64_t D, int64_t G, const QuantParams* params,
                  float* out),
                 (codes, T, D, G, params, out))

}  // namespace

QuantParams fit_group(const float* x, size_t n, ptrdiff_t stride, int bits) {
  KVQ_LEVEL_DISPATCH(fit_group, (x, n, stride, bits));
}

void quantize_group(const float* x, size_t n, ptrdiff_t stride, QuantParams p, int bits,
                    uint8_t* codes, ptrdiff_t code_stride) {
  KVQ_LEVEL_DISPATCH(quantize_group, (x, n, stride, p, bits, codes, code_stride));
}

void quantize_per_channel(const float* x, int64_t T, int64_t D, int64_t ld, int bits,
                          uint8_t* codes, QuantParams* params) {
  KVQ_LEVEL_DISPATCH(quantize_per_channel, (x, T, D, ld, bits, codes, params));
}

void dequantize_per_channel(const uint8_t* codes, int64_t T, int64_t D, const QuantParams* params,
                            float* out) {
  KVQ_LEVEL_DISPATCH(dequantize_per_channel, (codes, T, D, params, out));
}

void quantize_per_token(const float* x, int64_t T, int64_t D, int64_t ld, int64_t G, int bits,
                        uint8_t* codes, QuantParams* params) {
  KVQ_LEVEL_DISPATCH(quantize_per_token, (x, T, D, ld, G, bits, codes, params));
}

void dequantize_per_token(const uint8_t* codes, int64_t T, int64_t D, int64_t G,
                          const QuantParams* params, float* out) {
  KVQ_LEVEL_DISPATCH(dequantize_per_token, (codes, T, D, G, params, out));
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
