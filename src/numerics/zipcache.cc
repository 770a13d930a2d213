#include "kvq/zipcache.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kvq/bitpack.h"
#include "kvq/dtype.h"

namespace kvq {

Status validate_zip_params(int hi_bits, int lo_bits, double hi_fraction, int64_t group) {
  if (hi_bits < 1 || hi_bits > 8 || lo_bits < 1 || lo_bits > 8)
    return invalid_argument("zipcache: bits must be in [1, 8], got hi=" + std::to_string(hi_bits) +
                            " lo=" + std::to_string(lo_bits));
  if (lo_bits > hi_bits)
    return invalid_argument("zipcache: lo_bits (" + std::to_string(lo_bits) +
                            ") must not exceed hi_bits (" + std::to_string(hi_bits) + ")");
  if (!(hi_fraction >= 0.0 && hi_fraction <= 1.0))
    return invalid_argument("zipcache: the salient fraction must be in [0, 1], got " +
                            std::to_string(hi_fraction));
  if (group < 1)
    return invalid_argument("zipcache: group must be >= 1, got " + std::to_string(group));
  return ok_status();
}

void token_key_norms(const float* x, int64_t S, int64_t D, float* out) {
  for (int64_t t = 0; t < S; ++t) {
    double s = 0;
    for (int64_t d = 0; d < D; ++d) s += static_cast<double>(x[t * D + d]) * x[t * D + d];
    out[t] = static_cast<float>(std::sqrt(s));
  }
}

std::vector<float> token_key_norms(const float* x, int64_t S, int64_t D) {
  std::vector<float> n(static_cast<size_t>(S));
  token_key_norms(x, S, D, n.data());
  return n;
}

int64_t salient_count(int64_t S, double hi_fraction) {
  return std::clamp<int64_t>(
      static_cast<int64_t>(std::llround(hi_fraction * static_cast<double>(S))), 0, S);
}

void saliency_mask(const float* scores, int64_t S, double hi_fraction, uint8_t* mask,
                   Workspace& ws) {
  Workspace::Frame frame(ws);
  int64_t* order = ws.alloc<int64_t>(static_cast<size_t>(S));
  std::iota(order, order + S, int64_t{0});
  auto key = [&](int64_t i) {
    const float s = scores[i];
    return std::isnan(s) ? -INFINITY : s;
  };
  // Descending score, ties to the earlier token: a total order, so std::sort (which allocates
  // nothing, unlike stable_sort) gives the one deterministic answer.
  std::sort(order, order + S, [&](int64_t a, int64_t b) {
    const float ka = key(a), kb = key(b);
    return ka > kb || (ka == kb && a < b);
  });
  std::fill(mask, mask + S, uint8_t{0});
  const int64_t k = salient_count(S, hi_fraction);
  for (int64_t i = 0; i < k; ++i) mask[order[i]] = 1;
}

std::vector<uint8_t> saliency_mask(const std::vector<float>& scores, double hi_fraction) {
  const int64_t S = static_cast<int64_t>(scores.size());
  std::vector<uint8_t> mask(static_cast<size_t>(S), 0);
  Workspace ws;
  saliency_mask(scores.data(), S, hi_fraction, mask.data(), ws);
  return mask;
}

uint64_t ZipState::bytes() const {
  return mask.size() + hi_codes.size() + lo_codes.size() +
         (hi_params.size() + lo_params.size()) * sizeof(QuantParams);
}

ZipState zip_compress(const float* x, int64_t S, int64_t D, int64_t ld,
                      const std::vector<uint8_t>& mask, int hi_bits, int lo_bits) {
  KVQ_CHECK(static_cast<int64_t>(mask.size()) == S);
  ZipState z;
  z.hi_bits = hi_bits;
  z.lo_bits = lo_bits;
  z.seq_len = S;
  z.head_dim = D;
  std::vector<float> hi, lo;
  for (int64_t t = 0; t < S; ++t) {
    auto& dst = mask[static_cast<size_t>(t)] ? hi : lo;
    dst.insert(dst.end(), x + t * ld, x + t * ld + D);
  }
  z.n_hi = static_cast<int64_t>(hi.size()) / std::max<int64_t>(D, 1);
  const int64_t n_lo = S - z.n_hi;
  z.mask.resize(packed_size(static_cast<size_t>(S), 1));
  pack_bits(mask.data(), static_cast<size_t>(S), 1, z.mask.data());
  std::vector<uint8_t> codes;
  auto encode = [&](const std::vector<float>& rows, int64_t n, int bits,
                    std::vector<uint8_t>& packed, std::vector<QuantParams>& params) {
    if (n == 0) return;
    codes.resize(static_cast<size_t>(n * D));
    params.resize(static_cast<size_t>(D));
    quantize_per_channel(rows.data(), n, D, D, bits, codes.data(), params.data());
    packed.resize(packed_size(codes.size(), bits));
    pack_bits(codes.data(), codes.size(), bits, packed.data());
  };
  encode(hi, z.n_hi, hi_bits, z.hi_codes, z.hi_params);
  encode(lo, n_lo, lo_bits, z.lo_codes, z.lo_params);
  return z;
}

void zip_reconstruct(const ZipState& z, float* out) {
  const int64_t S = z.seq_len, D = z.head_dim, n_lo = S - z.n_hi;
  std::vector<uint8_t> mask(static_cast<size_t>(S));
  unpack_bits(z.mask.data(), static_cast<size_t>(S), 1, mask.data());
  std::vector<uint8_t> codes;
  std::vector<float> hi(static_cast<size_t>(z.n_hi * D)), lo(static_cast<size_t>(n_lo * D));
  if (z.n_hi) {
    codes.resize(hi.size());
    unpack_bits(z.hi_codes.data(), codes.size(), z.hi_bits, codes.data());
    dequantize_per_channel(codes.data(), z.n_hi, D, z.hi_params.data(), hi.data());
  }
  if (n_lo) {
    codes.resize(lo.size());
    unpack_bits(z.lo_codes.data(), codes.size(), z.lo_bits, codes.data());
    dequantize_per_channel(codes.data(), n_lo, D, z.lo_params.data(), lo.data());
  }
  int64_t ih = 0, il = 0;
  for (int64_t t = 0; t < S; ++t) {
    const float* src =
        mask[static_cast<size_t>(t)] ? hi.data() + (ih++) * D : lo.data() + (il++) * D;
    std::copy(src, src + D, out + t * D);
  }
}

uint64_t base_only_bytes(int64_t S, int64_t D, int bits, int64_t group) {
  const int64_t groups = (S + group - 1) / group;
  return packed_size(static_cast<size_t>(S * D), bits) +
         static_cast<uint64_t>(groups * D) * sizeof(QuantParams);
}

void zip_quant_dequant(const float* x, int64_t S, int64_t D, int hi_bits, int lo_bits,
                       double hi_fraction, float* out) {
  const auto mask = saliency_mask(token_key_norms(x, S, D), hi_fraction);
  zip_reconstruct(zip_compress(x, S, D, D, mask, hi_bits, lo_bits), out);
}

void cst_quantize(const float* x, int64_t S, int64_t D, int64_t ld, int64_t group,
                  const uint8_t* bits_per_token, uint16_t* channel_scale, uint8_t* codes,
                  QuantParams* params, Workspace& ws) {
  Workspace::Frame frame(ws);
  float* const c = ws.alloc<float>(static_cast<size_t>(D));
  float* const row = ws.alloc<float>(static_cast<size_t>(D));
  std::fill(c, c + D, 0.0f);
  for (int64_t t = 0; t < S; ++t)
    for (int64_t d = 0; d < D; ++d) c[d] = std::max(c[d], std::fabs(x[t * ld + d]));
  for (int64_t d = 0; d < D; ++d) {
    const float m = c[d];
    channel_scale[d] = m > 0 ? f16_round_up(std::sqrt(m)) : f32_to_f16(1.0f);
    c[d] = 1.0f / f16_to_f32(channel_scale[d]);
  }
  const int64_t ng = n_channel_groups(D, group);
  for (int64_t t = 0; t < S; ++t) {
    for (int64_t d = 0; d < D; ++d) row[d] = x[t * ld + d] * c[d];
    quantize_per_token(row, 1, D, D, group, bits_per_token[t], codes + t * D, params + t * ng);
  }
}

void cst_quantize(const float* x, int64_t S, int64_t D, int64_t ld, int64_t group,
                  const uint8_t* bits_per_token, uint16_t* channel_scale, uint8_t* codes,
                  QuantParams* params) {
  Workspace ws;
  cst_quantize(x, S, D, ld, group, bits_per_token, channel_scale, codes, params, ws);
}

void cst_dequantize(const uint8_t* codes, int64_t S, int64_t D, int64_t group,
                    const uint16_t* channel_scale, const QuantParams* params, float* out) {
  dequantize_per_token(codes, S, D, group, params, out);
  // The channel scales a tile at a time from a stack array (channels are independent).
  constexpr int64_t kTile = 256;
  float c[kTile];
  for (int64_t d0 = 0; d0 < D; d0 += kTile) {
    const int64_t n = std::min(kTile, D - d0);
    convert_f16_to_f32(channel_scale + d0, c, static_cast<size_t>(n));
    for (int64_t t = 0; t < S; ++t) {
      float* o = out + t * D + d0;
      for (int64_t d = 0; d < n; ++d) o[d] *= c[d];
    }
  }
}

}  // namespace kvq
