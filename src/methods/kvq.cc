// kvq — kvq's own method: KIVI's grouping (keys per channel over G tokens, values per token over
// groups of channels) with the ideas that the 2024-2026 literature found to pay, each a
// parameter so that every one is ablated on its own (docs/methods/kvq.md):
//
//   rope=pre    keys quantized before RoPE (KVQuant): the cache undoes the layer's rotary
//               embedding on append and redoes it on decode (RopeShape of the layer), so each
//               channel keeps one frequency-free distribution across the tokens of a group.
//   v_rot=on    values rotated by a randomized Walsh-Hadamard transform before their per-token
//               quantization (QuaRot/TurboQuant's idea): outlier channels spread over all.
//   k_rot=on    the same for keys (usually worse with per-channel keys; there for the ablation).
//   sinks=N     the first N tokens (attention sinks) kept exact, out of their group's statistics.
//   outliers=N  N per mille of each block stream's quantized elements (in the quantized basis)
//               kept exact as fp16 with their index, out of their group's range (KVQuant's
//               dense-and-sparse split; pick_outliers below says which).
//   entropy=on  each block stream's codes coded losslessly by kvq's rANS coder and held coded
//               (entropy/symbol_codec.h); every read of the block decodes them.
//   window=q8   the window (the newest `residual` tokens and the unsealed block) held as 8-bit
//               rows with an fp16 scale per 32 values (numerics/q8_rows.h) instead of fp16:
//               what attention sees of a window token is its 8-bit value, and its block is
//               sealed from that value too.
//   group, residual: block length and exact window, as KIVI's.
//
// Stored layout of block i (S = B * H streams, T = group tokens, D = head_dim, ng = ceil(D/Gv)):
//   key part    S x packed_size(T*D, k_bits) codes, S x D {scale, zero} fp16 pairs,
//               block 0 only: S x sinks x D fp16 exact keys (as appended, after RoPE)
//   value part  S x packed_size(T*D, v_bits) codes, S x T x ng pairs,
//               block 0 only: S x sinks x D fp16 exact values
//   either part, outliers=N: S x {k u16 indices (t * D + d, ascending, outside the sink rows),
//               then k fp16 values in the quantized basis}, k = ceil(N * (T - sinks) * D / 1000)
//               (sinks counted in block 0 only); an outlier's code is that of its stand-in.
//   either part, entropy=on: S u32 end offsets in place of the packed codes, the regions above
//               as they are, then the S coded streams ([T, D] token-major, D channels; the
//               offsets count from the end of the regions above).
// A sink row's codes are zero. Pairs are KIVI's (kvq/group_quant.h); codes as kvq/bitpack.h.
// With params=u8 each stream's pairs of a part are one 8-bit set instead (U8Pairs below):
// 6 + 2 n bytes for n pairs in place of 4 n.
// Accounting: codes (coded streams with entropy=on), pairs and outliers as params, the sinks'
// exact values as residual (exact tokens), stream end offsets as meta.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cache/codec.h"
#include "core/cpu.h"
#include "entropy/symbol_codec.h"
#include "kvq/bitpack.h"
#include "kvq/dtype.h"
#include "kvq/group_quant.h"
#include "kvq/spec.h"
#include "numerics/hadamard.h"
#include "numerics/lloyd.h"
#include "numerics/rope_table.h"

namespace kvq {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// y = H x, H the orthonormal Walsh-Hadamard matrix of order n (a power of two), in place.
// Compiled once per SIMD level (core/cpu.h) and dispatched: the library's baseline is SSE2,
// where these butterflies were a third of kvq's encode and decode time (numerics/hadamard.h:
// the same sums in the same order at every level, so every level agrees bit for bit).
template <SimdLevel L>
KVQ_ALWAYS_INLINE void hadamard_body(float* x, int64_t n) {
  hadamard_at<L>(x, n);
}
KVQ_LEVEL_CLONES(void, hadamard, (float* x, int64_t n), (x, n))
void hadamard(float* x, int64_t n) { KVQ_LEVEL_DISPATCH(hadamard, (x, n)); }

// RoPE of `rows` rows x [rows, D] at positions pos0, pos0 + 1, ...: each pair (i0, i1) turned by
// the table's angle (inverse: by minus it). The old per-pair formula with the table's floats,
// sin negated for the inverse (float(-sin) == -float(sin)), so the same bits at every level.
template <SimdLevel L>
KVQ_ALWAYS_INLINE void rope_rows_body(float* x, int64_t rows, int64_t D, const RopeTable* tab,
                                      int64_t pos0, bool adjacent, bool inverse) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < rows; ++t) {
    float* row = x + t * D;
    const float* cs = tab->row(pos0 + t);
    const float* sn = cs + half;
    if (adjacent) {
      for (int64_t i = 0; i < half; ++i) {
        const float c = cs[i], s = inverse ? -sn[i] : sn[i];
        const float x0 = row[2 * i], x1 = row[2 * i + 1];
        row[2 * i] = x0 * c - x1 * s;
        row[2 * i + 1] = x0 * s + x1 * c;
      }
    } else {
      for (int64_t i = 0; i < half; ++i) {
        const float c = cs[i], s = inverse ? -sn[i] : sn[i];
        const float x0 = row[i], x1 = row[i + half];
        row[i] = x0 * c - x1 * s;
        row[i + half] = x0 * s + x1 * c;
      }
    }
  }
}
KVQ_LEVEL_CLONES(void, rope_rows,
                 (float* x, int64_t rows, int64_t D, const RopeTable* tab, int64_t pos0,
                  bool adjacent, bool inverse),
                 (x, rows, D, tab, pos0, adjacent, inverse))
void rope_rows(float* x, int64_t rows, int64_t D, const RopeTable* tab, int64_t pos0,
               bool adjacent, bool inverse) {
  KVQ_LEVEL_DISPATCH(rope_rows, (x, rows, D, tab, pos0, adjacent, inverse));
}

// The u8-pair decode loops, compiled once per SIMD level (core/cpu.h; element-wise IEEE
// arithmetic without contraction, so every level agrees):
//   channels: out[t, d] = zero[d] + codes[t, d] * scale[d]                 codes [T, D]
//   tokens:   out[t, d] = zero[t, g] + codes[t, d] * scale[t, g], g = d / vg  (ng groups a row)
template <SimdLevel L>
KVQ_ALWAYS_INLINE void dequant_u8_channels_body(const uint8_t* codes, int64_t T, int64_t D,
                                                const float* scale, const float* zero,
                                                float* out) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d)
      out[t * D + d] = zero[d] + static_cast<float>(codes[t * D + d]) * scale[d];
}
template <SimdLevel L>
KVQ_ALWAYS_INLINE void dequant_u8_tokens_body(const uint8_t* codes, int64_t T, int64_t D,
                                              int64_t vg, const float* scale, const float* zero,
                                              float* out) {
  const int64_t ng = n_channel_groups(D, vg);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t gi = 0; gi < ng; ++gi) {
      const int64_t d0 = gi * vg, d1 = std::min(D, d0 + vg);
      const float sc = scale[t * ng + gi], ze = zero[t * ng + gi];
      for (int64_t d = d0; d < d1; ++d)
        out[t * D + d] = ze + static_cast<float>(codes[t * D + d]) * sc;
    }
}
KVQ_LEVEL_CLONES(void, dequant_u8_channels,
                 (const uint8_t* codes, int64_t T, int64_t D, const float* scale,
                  const float* zero, float* out),
                 (codes, T, D, scale, zero, out))
KVQ_LEVEL_CLONES(void, dequant_u8_tokens,
                 (const uint8_t* codes, int64_t T, int64_t D, int64_t vg, const float* scale,
                  const float* zero, float* out),
                 (codes, T, D, vg, scale, zero, out))
void dequant_u8_channels(const uint8_t* codes, int64_t T, int64_t D, const float* scale,
                         const float* zero, float* out) {
  KVQ_LEVEL_DISPATCH(dequant_u8_channels, (codes, T, D, scale, zero, out));
}
void dequant_u8_tokens(const uint8_t* codes, int64_t T, int64_t D, int64_t vg, const float* scale,
                       const float* zero, float* out) {
  KVQ_LEVEL_DISPATCH(dequant_u8_tokens, (codes, T, D, vg, scale, zero, out));
}

struct KvqConfig {
  int k_bits = 2, v_bits = 2;
  int64_t group = 32, v_group = 32, residual = 32, sinks = 0;
  bool pre_rope = false, k_rot = false, v_rot = false;
  bool k_gauss = false, v_gauss = false;  // Lloyd-Max levels of the normal distribution
  bool u8 = false;                         // 8-bit pairs (params=u8)
  int64_t outliers = 0;                    // per mille of a stream's quantized elements kept exact
  bool entropy = false;                    // codes rANS-coded per stream (entropy=on)
  bool q8_window = false;                  // window=q8
};

// 8-bit pairs (params=u8): the n (scale, zero) pairs of one stream's part of a block, stored as
//   z0, dz, s0   fp16 (6 bytes), then qz[n], then qs[n] (one byte each)
//   zero_i  = z0 + qz_i * dz          qz_i the largest with zero_i <= lo_i
//   scale_i = s0 * 2^(qs_i / 16)      qs_i the smallest with scale_i >= (hi_i - zero_i) / qmax
// so every group's [lo, hi] stays inside its representable range, as with fp16 pairs: nothing
// clips, and a group's step is at most 2^(1/16) (4.4 %) coarser than its own range needs, plus
// the zero's rounding (at most dz, 1/255 of the spread of the set's minima). Scales span
// 2^(255/16) from s0; s0 is raised so that the largest fits. Powers of two by a 16-entry table
// and ldexp: decoding is exact float arithmetic, the same on every machine.
namespace u8pairs {

constexpr size_t kHeader = 6;
constexpr size_t bytes(int64_t n) { return kHeader + 2 * static_cast<size_t>(n); }

// 2^(j/16), j = 0..15, rounded to float.
constexpr float kPow16[16] = {1.0f,         1.04427378f, 1.09050773f, 1.13878863f,
                              1.18920712f,  1.24185781f, 1.29683955f, 1.35425555f,
                              1.41421356f,  1.47682615f, 1.54221083f, 1.61049033f,
                              1.68179283f,  1.75625216f, 1.83400809f, 1.91520656f};
// ldexp by q >> 4 in [0, 15] as a multiplication by that power of two: exact (s0 * kPow16 is a
// normal float, the product stays finite), so the same bits as std::ldexp, without a call.
inline float scale_of(float s0, int q) {
  return (s0 * kPow16[q & 15]) * static_cast<float>(1 << (q >> 4));
}

void put16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
uint16_t get16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Fits the set to ranges [lo_i, hi_i], writes its bytes to `out`, and the pairs as decoded.
void fit(const float* lo, const float* hi, int64_t n, int bits, uint8_t* out, float* scale,
         float* zero) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  float lmin = lo[0], lmax = lo[0];
  for (int64_t i = 1; i < n; ++i) lmin = std::min(lmin, lo[i]), lmax = std::max(lmax, lo[i]);
  const uint16_t z0h = f16_round_down(lmin);
  const float z0 = f16_to_f32(z0h);
  const uint16_t dzh = lmax > z0 ? f16_round_up(std::min((lmax - z0) / 255.0f, kF16Max)) : 0;
  const float dz = f16_to_f32(dzh);
  float need_max = kScaleEps, need_min = kF16Max;
  for (int64_t i = 0; i < n; ++i) {
    int q = dz > 0 ? static_cast<int>(std::clamp(std::floor((lo[i] - z0) / dz), 0.0f, 255.0f)) : 0;
    while (q > 0 && z0 + static_cast<float>(q) * dz > lo[i]) --q;
    out[kHeader + static_cast<size_t>(i)] = static_cast<uint8_t>(q);
    zero[i] = z0 + static_cast<float>(q) * dz;
    const float need = std::min(std::max((hi[i] - zero[i]) / qmax, kScaleEps), kF16Max);
    scale[i] = need;  // the scale it needs, for now
    need_max = std::max(need_max, need);
    need_min = std::min(need_min, need);
  }
  // s0: the least need, raised until the greatest is within 255 steps (2^(255/16) above).
  uint16_t s0h = f16_round_down(std::max({need_min, need_max / scale_of(1.0f, 255), kScaleEps}));
  while (scale_of(f16_to_f32(s0h), 255) < need_max) s0h = static_cast<uint16_t>(s0h + 1);
  const float s0 = f16_to_f32(s0h);
  for (int64_t i = 0; i < n; ++i) {
    int q = 0;
    const float r = scale[i] / s0;
    if (r > 1.0f) q = std::clamp(static_cast<int>(std::ceil(16.0f * std::log2(r))), 0, 255);
    while (q > 0 && scale_of(s0, q - 1) >= scale[i]) --q;
    while (q < 255 && scale_of(s0, q) < scale[i]) ++q;
    out[kHeader + static_cast<size_t>(n + i)] = static_cast<uint8_t>(q);
    scale[i] = scale_of(s0, q);
  }
  put16(out, z0h);
  put16(out + 2, dzh);
  put16(out + 4, s0h);
}

void expand(const uint8_t* in, int64_t n, float* scale, float* zero) {
  const float z0 = f16_to_f32(get16(in)), dz = f16_to_f32(get16(in + 2));
  const float s0 = f16_to_f32(get16(in + 4));
  for (int64_t i = 0; i < n; ++i) {
    zero[i] = z0 + static_cast<float>(in[kHeader + static_cast<size_t>(i)]) * dz;
    scale[i] = scale_of(s0, in[kHeader + static_cast<size_t>(n + i)]);
  }
}

// A stored set decodes to finite pairs with scales > 0 for any bytes once its header is finite,
// dz >= 0 and s0 > 0 (the largest scale, s0 * 2^(255/16) <= 65504 * 62000, is a finite float).
Status check(const uint8_t* in, const char* what) {
  const float z0 = f16_to_f32(get16(in)), dz = f16_to_f32(get16(in + 2));
  const float s0 = f16_to_f32(get16(in + 4));
  if (!std::isfinite(z0) || !std::isfinite(dz) || !(dz >= 0) || !std::isfinite(s0) || !(s0 > 0))
    return corrupt(std::string(what) + ": 8-bit pair set has z0 " + std::to_string(z0) + ", dz " +
                   std::to_string(dz) + ", s0 " + std::to_string(s0));
  return ok_status();
}

}  // namespace u8pairs

// A group of n values x[i * stride] quantized to the Lloyd-Max levels g of the standard normal,
// scaled: x ~ mu + s * g[c]. mu is the group's mean, s starts at its RMS deviation and takes one
// least-squares step on the chosen codes; codes are then chosen again with s and mu as stored
// (rounded to fp16), so decoding reproduces exactly what the encoder measured against.
void quantize_gauss(const float* x, int64_t n, int64_t stride, const std::vector<float>& g,
                    const std::vector<float>& bounds, uint8_t* codes, int64_t cstride,
                    QuantParams* p) {
  const int K = static_cast<int>(g.size());
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i * stride];
  const float mu = static_cast<float>(sum / static_cast<double>(n));
  double ss = 0;
  for (int64_t i = 0; i < n; ++i) ss += (x[i * stride] - mu) * (x[i * stride] - mu);
  float s = static_cast<float>(std::sqrt(ss / static_cast<double>(n)));
  auto assign = [&](float scale, float zero) {
    const float inv = scale > 0 ? 1.0f / scale : 0.0f;
    for (int64_t i = 0; i < n; ++i)
      codes[i * cstride] =
          static_cast<uint8_t>(nearest_level_index(bounds.data(), K, (x[i * stride] - zero) * inv));
  };
  if (s > 0) {
    assign(s, mu);
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double gi = g[codes[i * cstride]];
      num += (x[i * stride] - mu) * gi;
      den += gi * gi;
    }
    if (den > 0 && num > 0) s = static_cast<float>(num / den);
  }
  p->scale = f32_to_f16(s);
  p->zero = f32_to_f16(mu);
  assign(f16_to_f32(p->scale), f16_to_f32(p->zero));
}

void dequantize_gauss(const uint8_t* codes, int64_t n, int64_t cstride, const QuantParams& p,
                      const std::vector<float>& g, float* out, int64_t stride) {
  const float s = f16_to_f32(p.scale), mu = f16_to_f32(p.zero);
  for (int64_t i = 0; i < n; ++i) out[i * stride] = mu + s * g[codes[i * cstride]];
}

KvqConfig config_from(const Spec& s, int64_t D) {
  KvqConfig c;
  c.k_bits = static_cast<int>(s.get_int("k_bits"));
  c.v_bits = static_cast<int>(s.get_int("v_bits"));
  c.group = s.get_int("group");
  c.v_group = std::min<int64_t>(s.get_int("v_group"), D);
  c.residual = s.get_int("residual");
  c.sinks = s.get_int("sinks");
  c.pre_rope = s.get_enum("rope") == "pre";
  c.k_rot = s.get_enum("k_rot") == "on";
  c.v_rot = s.get_enum("v_rot") == "on";
  c.k_gauss = s.get_enum("k_levels") == "gauss";
  c.v_gauss = s.get_enum("v_levels") == "gauss";
  c.u8 = s.get_enum("params") == "u8";
  c.outliers = s.get_int("outliers");
  c.entropy = s.get_enum("entropy") == "on";
  c.q8_window = s.get_enum("window") == "q8";
  return c;
}

// Codes of n values x[i] against float pairs: pair i (per channel, stride 1) or pair 0 for all
// (stride 0), as kvq/group_quant.h rounds them. Compiled once per SIMD level (core/cpu.h): at
// the baseline std::nearbyint is a library call per element; the same IEEE operations at every
// level, so the same codes.
template <SimdLevel L>
KVQ_ALWAYS_INLINE void quantize_row_body(const float* x, int64_t n, int64_t pstride,
                                         const float* scale, const float* zero, int bits,
                                         uint8_t* codes) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  if (pstride == 0) {
    const float z = zero[0], inv = 1.0f / scale[0];
    for (int64_t i = 0; i < n; ++i) {
      const float q = std::nearbyint((x[i] - z) * inv);
      codes[i] = static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float q = std::nearbyint((x[i] - zero[i]) * (1.0f / scale[i]));
    codes[i] = static_cast<uint8_t>(std::clamp(q, 0.0f, qmax));
  }
}
KVQ_LEVEL_CLONES(void, quantize_row,
                 (const float* x, int64_t n, int64_t pstride, const float* scale,
                  const float* zero, int bits, uint8_t* codes),
                 (x, n, pstride, scale, zero, bits, codes))
void quantize_row(const float* x, int64_t n, int64_t pstride, const float* scale,
                  const float* zero, int bits, uint8_t* codes) {
  KVQ_LEVEL_DISPATCH(quantize_row, (x, n, pstride, scale, zero, bits, codes));
}

// Sparse outliers (outliers=N, KVQuant's dense-and-sparse split): of a stream's block x [T, D]
// in the quantized basis, rows r0.. (the sinks are not candidates), the k elements farthest from
// their group's mean in units of the group's RMS deviation: keys' groups are channels (over the
// rows), values' are a row's runs of vg channels. A z-score, so that a group's one stray element
// counts as much in a narrow group as in a wide one: what sets a group's step is its range
// relative to its spread. Ties go to the lower index. Writes their indices ascending (into the
// block, t * D + d) and their values as fp16 (saturated to its range: a rotation can leave it),
// then replaces them in x by the midpoint of the rest of their group (0 if none is left), so that
// they widen neither its range nor its scale and zero; decode puts the exact values back.
void pick_outliers(float* x, int64_t T, int64_t D, int64_t r0, bool per_channel, int64_t vg,
                   int64_t k, uint16_t* idx, uint16_t* val, Workspace& ws) {
  Workspace::Frame frame(ws);
  const int64_t ng = n_channel_groups(D, vg), groups = per_channel ? D : T * ng;
  int64_t* cg = ws.alloc<int64_t>(static_cast<size_t>(D));  // channel -> group within a row
  for (int64_t d = 0; d < D; ++d) cg[d] = per_channel ? d : d / vg;
  const int64_t row_step = per_channel ? 0 : ng;  // group of (t, d) = t * row_step + cg[d]
  double* mean = ws.alloc<double>(static_cast<size_t>(groups));
  double* dev = ws.alloc<double>(static_cast<size_t>(groups));
  std::fill(mean, mean + groups, 0.0), std::fill(dev, dev + groups, 0.0);
  // Elements per group: T - r0 rows of a channel, or a run of a row (the last may be shorter).
  auto count = [&](int64_t j) {
    if (per_channel) return static_cast<double>(T - r0);
    const int64_t gi = j % ng;
    return static_cast<double>(std::min(vg, D - gi * vg));
  };
  for (int64_t t = r0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) mean[t * row_step + cg[d]] += x[t * D + d];
  for (int64_t j = per_channel ? 0 : r0 * ng; j < groups; ++j) mean[j] /= count(j);
  for (int64_t t = r0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t j = t * row_step + cg[d];
      const double e = x[t * D + d] - mean[j];
      dev[j] += e * e;
    }
  for (int64_t j = per_channel ? 0 : r0 * ng; j < groups; ++j)
    dev[j] = dev[j] > 0 ? 1.0 / std::sqrt(dev[j] / count(j)) : 0.0;  // now 1 / deviation
  // The k best under (score descending, index ascending), in a heap whose front is the worst
  // kept: one comparison per element once full (k is a few percent of the block at most).
  struct Cand {
    float score;
    uint16_t at;
  };
  auto better = [](const Cand& a, const Cand& b) {
    return a.score != b.score ? a.score > b.score : a.at < b.at;
  };
  Cand* heap = ws.alloc<Cand>(static_cast<size_t>(k));
  int64_t kept = 0;
  for (int64_t t = r0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      const int64_t j = t * row_step + cg[d];
      const Cand c{static_cast<float>(std::fabs(x[t * D + d] - mean[j]) * dev[j]),
                   static_cast<uint16_t>(t * D + d)};
      if (kept < k) {
        heap[kept++] = c;
        std::push_heap(heap, heap + kept, better);
      } else if (better(c, heap[0])) {
        std::pop_heap(heap, heap + k, better);
        heap[k - 1] = c;
        std::push_heap(heap, heap + k, better);
      }
    }
  for (int64_t j = 0; j < k; ++j) idx[j] = heap[j].at;
  std::sort(idx, idx + k);
  // The rest of each group's range (indices ascending: one pass alongside), for the stand-ins.
  float* lo = ws.alloc<float>(static_cast<size_t>(groups));
  float* hi = ws.alloc<float>(static_cast<size_t>(groups));
  std::fill(lo, lo + groups, INFINITY), std::fill(hi, hi + groups, -INFINITY);
  int64_t next = 0;
  for (int64_t t = r0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      if (next < k && idx[next] == t * D + d) {
        ++next;
        continue;
      }
      const int64_t j = t * row_step + cg[d];
      lo[j] = std::min(lo[j], x[t * D + d]), hi[j] = std::max(hi[j], x[t * D + d]);
    }
  for (int64_t j = 0; j < k; ++j) {
    const int64_t at = idx[j], gj = (at / D) * row_step + cg[at % D];
    val[j] = f32_to_f16(std::clamp(x[at], -kF16Max, kF16Max));
    x[at] = lo[gj] <= hi[gj] ? 0.5f * (lo[gj] + hi[gj]) : 0.0f;
  }
}

// Decode's half: the outliers' exact values over the dequantized block out [T, D] (basis).
void put_outliers(const uint8_t* at, int64_t k, float* out) {
  for (int64_t j = 0; j < k; ++j) {
    uint16_t i, hb;
    std::memcpy(&i, at + 2 * j, 2);
    std::memcpy(&hb, at + 2 * (k + j), 2);
    out[i] = f16_to_f32(hb);
  }
}

class KvqCodec final : public BlockCodec {
 public:
  KvqCodec(const Spec& spec, const LayerShape& shape)
      : BlockCodec(spec, shape, spec.get_int("group"), spec.get_int("residual")),
        c_(config_from(spec, shape.head_dim)),
        kg_(c_.k_gauss ? gaussian_levels(c_.k_bits) : std::vector<float>{}),
        vg_(c_.v_gauss ? gaussian_levels(c_.v_bits) : std::vector<float>{}),
        kb_(level_bounds(kg_)),
        vb_(level_bounds(vg_)) {
    const int64_t D = shape.head_dim;
    rot_ = 1;
    while (D % (2 * rot_) == 0) rot_ *= 2;
    signs_.resize(static_cast<size_t>(D));
    for (int64_t i = 0; i < D; ++i)
      signs_[static_cast<size_t>(i)] =
          splitmix64(0x6b7671ull + static_cast<uint64_t>(i)) >> 63 ? -1.0f : 1.0f;
  }
  KvqCodec(const KvqCodec&) = default;
  WindowFormat window_format() const override {
    return c_.q8_window ? WindowFormat::kQ8 : WindowFormat::k16Bit;
  }
  ~KvqCodec() override {
    if (holding_) rope_->release();
  }
  // rope=pre: the model's shared table of RoPE angles (build() below); `owner`: this layer bills
  // it (one layer per table).
  void set_rope_table(std::shared_ptr<RopeTable> t, bool owner) {
    rope_ = std::move(t);
    rope_owner_ = owner;
  }
  std::unique_ptr<BlockCodec> clone(CloneMemo& memo) const override {
    auto c = std::make_unique<KvqCodec>(*this);
    c->holding_ = false;
    if (rope_) {  // the copies of a model's layers share one copy of its table
      std::shared_ptr<void>& slot = memo.copies[rope_.get()];
      if (!slot) slot = std::make_shared<RopeTable>(*rope_);
      c->rope_ = std::static_pointer_cast<RopeTable>(slot);
      if (holding_) c->hold_rope(0);
    }
    return c;
  }
  uint64_t table_bytes() const override { return rope_ && rope_owner_ ? rope_->bytes() : 0; }
  void on_reset() override { release_rope(); }
  void end_import(bool commit) override {
    if (commit && staged_rope_ > 0) hold_rope(staged_rope_);
    if (commit && staged_rope_ == 0) release_rope();  // the layer now holds no block
    staged_rope_ = 0;
  }
  void on_trim(int64_t, int64_t keep_blocks) override {
    if (keep_blocks == 0) release_rope();
  }

  SealedBlock encode(int64_t index, const BlockGeometry& g, const float* k, const float* v,
                     Workspace& ws) override {
    Workspace::Frame frame(ws);
    const int64_t T = g.tokens, D = g.dim, S = g.streams(), n = T * D;
    const int64_t ns = index == 0 ? c_.sinks : 0;  // sink rows of this block
    auto blk = std::make_shared<BlockData>();
    const PartLayout Lk = layout(g, index, true), Lv = layout(g, index, false);
    // entropy=off: the parts are their fixed regions, written in place. entropy=on: the fixed
    // regions are staged, the streams appended to their own staging (a stream never exceeds
    // its raw size + 1: reserved once, so no growth after the first block), then both copied
    // into buffers of the exact size.
    uint8_t *kb, *vb;
    if (c_.entropy) {
      kfixed_.assign(Lk.fixed, 0);
      vfixed_.assign(Lv.fixed, 0);
      kcoded_.clear(), vcoded_.clear();
      kcoded_.reserve(static_cast<size_t>(S) * (1 + kcode_bytes(g)));
      vcoded_.reserve(static_cast<size_t>(S) * (1 + vcode_bytes(g)));
      kb = kfixed_.data(), vb = vfixed_.data();
    } else {
      blk->keys = Buffer(Lk.fixed);
      blk->values = Buffer(Lv.fixed);
      kb = blk->keys.data(), vb = blk->values.data();
    }
    const entropy::SymbolCodecOptions eo = codec_options();
    const int64_t no = n_outliers(g, index);
    const size_t ob = outlier_bytes(g, index);
    uint16_t* oidx = ws.alloc<uint16_t>(static_cast<size_t>(2 * no));
    uint16_t* oval = oidx + no;
    float* x = ws.alloc<float>(static_cast<size_t>(n));
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(n));
    const size_t np_v = vparam_bytes(g) / sizeof(QuantParams);
    const size_t np = static_cast<size_t>(std::max<int64_t>(D, static_cast<int64_t>(np_v)));
    auto* params = ws.alloc<QuantParams>(np);
    const size_t nu = static_cast<size_t>(std::max(D, T * n_channel_groups(D, c_.v_group)));
    float* lo = ws.alloc<float>(nu);
    float* hi = ws.alloc<float>(nu);
    float* scale = ws.alloc<float>(nu);
    float* zero = ws.alloc<float>(nu);
    hold_rope((index + 1) * T);
    for (int64_t s = 0; s < S; ++s) {
      // Keys: to the quantized basis, then per channel over the non-sink rows.
      std::memcpy(x, k + s * n, static_cast<size_t>(n) * 4);
      to_key_basis(x, T, index * T);
      if (no) {
        pick_outliers(x, T, D, ns, true, D, no, oidx, oval, ws);
        store_outliers(oidx, oval, no, kb + Lk.outliers + s * ob);
      }
      std::fill(codes, codes + n, uint8_t{0});
      uint8_t* kparams = kb + Lk.params + s * kparam_bytes(g);
      if (c_.u8) {
        for (int64_t d = 0; d < D; ++d) lo[d] = hi[d] = x[ns * D + d];
        for (int64_t t = ns + 1; t < T; ++t)
          for (int64_t d = 0; d < D; ++d)
            lo[d] = std::min(lo[d], x[t * D + d]), hi[d] = std::max(hi[d], x[t * D + d]);
        u8pairs::fit(lo, hi, D, c_.k_bits, kparams, scale, zero);
        for (int64_t t = ns; t < T; ++t)
          quantize_row(x + t * D, D, 1, scale, zero, c_.k_bits, codes + t * D);
      } else if (c_.k_gauss) {
        for (int64_t d = 0; d < D; ++d)
          quantize_gauss(x + ns * D + d, T - ns, D, kg_, kb_, codes + ns * D + d, D, params + d);
      } else {
        quantize_per_channel(x + ns * D, T - ns, D, D, c_.k_bits, codes + ns * D, params);
      }
      put_codes(codes, T, D, c_.k_bits, eo, kb + s * (c_.entropy ? 4 : kcode_bytes(g)), kcoded_,
                ws);
      if (!c_.u8) std::memcpy(kparams, params, kparam_bytes(g));
      // Values: rotated (optionally), then per token.
      std::memcpy(x, v + s * n, static_cast<size_t>(n) * 4);
      if (c_.v_rot)
        for (int64_t t = 0; t < T; ++t) rotate(x + t * D);
      if (no) {
        pick_outliers(x, T, D, ns, false, c_.v_group, no, oidx, oval, ws);
        store_outliers(oidx, oval, no, vb + Lv.outliers + s * ob);
      }
      uint8_t* vparams = vb + Lv.params + s * vparam_bytes(g);
      const int64_t ng = n_channel_groups(D, c_.v_group);
      if (c_.u8) {
        // Sink rows take row ns's ranges: they are stored exact and must not widen the set.
        for (int64_t t = ns; t < T; ++t)
          for (int64_t gi = 0; gi < ng; ++gi) {
            const int64_t d0 = gi * c_.v_group, d1 = std::min(D, d0 + c_.v_group);
            float l = x[t * D + d0], h = l;
            for (int64_t d = d0 + 1; d < d1; ++d)
              l = std::min(l, x[t * D + d]), h = std::max(h, x[t * D + d]);
            lo[t * ng + gi] = l;
            hi[t * ng + gi] = h;
          }
        for (int64_t i = 0; i < ns * ng; ++i) lo[i] = lo[ns * ng + i % ng], hi[i] = hi[ns * ng + i % ng];
        u8pairs::fit(lo, hi, T * ng, c_.v_bits, vparams, scale, zero);
        for (int64_t t = ns; t < T; ++t)
          for (int64_t gi = 0; gi < ng; ++gi) {
            const int64_t d0 = gi * c_.v_group, len = std::min(c_.v_group, D - d0);
            quantize_row(x + t * D + d0, len, 0, scale + t * ng + gi, zero + t * ng + gi,
                         c_.v_bits, codes + t * D + d0);
          }
      } else if (c_.v_gauss) {
        for (int64_t t = 0; t < T; ++t)
          for (int64_t gi = 0; gi < ng; ++gi) {
            const int64_t d0 = gi * c_.v_group, len = std::min(c_.v_group, D - d0);
            quantize_gauss(x + t * D + d0, len, 1, vg_, vb_, codes + t * D + d0, 1,
                           params + t * ng + gi);
          }
      } else {
        quantize_per_token(x, T, D, D, c_.v_group, c_.v_bits, codes, params);
      }
      std::fill(codes, codes + ns * D, uint8_t{0});
      put_codes(codes, T, D, c_.v_bits, eo, vb + s * (c_.entropy ? 4 : vcode_bytes(g)), vcoded_,
                ws);
      if (!c_.u8) std::memcpy(vparams, params, vparam_bytes(g));
      // Sinks: the rows as appended, exact.
      if (ns) {
        store_sinks(k + s * n, kb + Lk.sinks + s * sink_bytes(g), ns * D);
        store_sinks(v + s * n, vb + Lv.sinks + s * sink_bytes(g), ns * D);
      }
    }
    if (c_.entropy) {  // codes at the end of each part, after its fixed regions
      blk->keys = Buffer(Lk.fixed + kcoded_.size());
      blk->values = Buffer(Lv.fixed + vcoded_.size());
      std::memcpy(blk->keys.data(), kfixed_.data(), Lk.fixed);
      std::memcpy(blk->keys.data() + Lk.fixed, kcoded_.data(), kcoded_.size());
      std::memcpy(blk->values.data(), vfixed_.data(), Lv.fixed);
      std::memcpy(blk->values.data() + Lv.fixed, vcoded_.data(), vcoded_.size());
    }
    const CacheBytes bytes = accounting(g, index, blk->keys.size(), blk->values.size());
    return {std::move(blk), bytes};
  }

  void decode(const BlockData& blk, int64_t index, bool keys, int64_t b, int64_t h,
              const BlockGeometry& g, float* out, Workspace& ws) const override {
    decode_stream(blk, index, keys, b, h, g, out, ws, false);
  }

  // Attention takes rotated values in their rotated basis (the kernel sums them there and
  // unrotates each output once), and rotated keys too when RoPE is not redone after the
  // rotation (rope=post): then the query is rotated once instead of every key unrotated.
  AttendBasis attend_basis() const override {
    return {c_.k_rot && !c_.pre_rope, c_.v_rot};
  }
  void decode_in_basis(const BlockData& blk, int64_t index, bool keys, int64_t b, int64_t h,
                       const BlockGeometry& g, float* out, Workspace& ws) const override {
    const AttendBasis a = attend_basis();
    decode_stream(blk, index, keys, b, h, g, out, ws, keys ? a.keys : a.values);
  }
  void to_basis(bool, float* rows, int64_t n) const override {
    for (int64_t t = 0; t < n; ++t) rotate(rows + t * shape().head_dim);
  }
  void from_basis(bool, float* row) const override { unrotate(row); }

  Result<SealedBlock> load(int64_t index, const BlockGeometry& g, const ChunkRef& k,
                           const ChunkRef& v) override {
    const PartLayout Lk = layout(g, index, true), Lv = layout(g, index, false);
    const size_t S = static_cast<size_t>(g.streams());
    if (c_.entropy) {  // sizes first: the fixed regions, then the streams their offsets name
      if (k.size < Lk.fixed || v.size < Lv.fixed)
        return corrupt("kvq block needs at least " + std::to_string(Lk.fixed) + " key and " +
                       std::to_string(Lv.fixed) + " value bytes, got " + std::to_string(k.size) +
                       " and " + std::to_string(v.size));
      KVQ_RETURN_IF_ERROR(check_streams(k, Lk, g, c_.k_bits, "kvq key codes"));
      KVQ_RETURN_IF_ERROR(check_streams(v, Lv, g, c_.v_bits, "kvq value codes"));
    } else {
      if (k.size != Lk.fixed || v.size != Lv.fixed)
        return corrupt("kvq block needs " + std::to_string(Lk.fixed) + " key and " +
                       std::to_string(Lv.fixed) + " value bytes, got " + std::to_string(k.size) +
                       " and " + std::to_string(v.size));
      KVQ_RETURN_IF_ERROR(
          check_padding(k.data, S, kcode_bytes(g), g.stream_elems(), c_.k_bits, "kvq key codes"));
      KVQ_RETURN_IF_ERROR(check_padding(v.data, S, vcode_bytes(g), g.stream_elems(), c_.v_bits,
                                        "kvq value codes"));
    }
    if (c_.u8) {
      for (size_t s = 0; s < S; ++s) {
        KVQ_RETURN_IF_ERROR(
            u8pairs::check(k.data + Lk.params + s * kparam_bytes(g), "kvq key params"));
        KVQ_RETURN_IF_ERROR(
            u8pairs::check(v.data + Lv.params + s * vparam_bytes(g), "kvq value params"));
      }
    } else {
      KVQ_RETURN_IF_ERROR(check_params(k.data + Lk.params, S * kparam_bytes(g) / 4, c_.k_gauss,
                                       "kvq key params"));
      KVQ_RETURN_IF_ERROR(check_params(v.data + Lv.params, S * vparam_bytes(g) / 4, c_.v_gauss,
                                       "kvq value params"));
    }
    const int64_t ns = index == 0 ? c_.sinks : 0, no = n_outliers(g, index);
    for (size_t s = 0; no && s < S; ++s) {
      KVQ_RETURN_IF_ERROR(check_outliers(k.data + Lk.outliers + s * outlier_bytes(g, index), no,
                                         ns * g.dim, g.stream_elems(), "kvq key outliers"));
      KVQ_RETURN_IF_ERROR(check_outliers(v.data + Lv.outliers + s * outlier_bytes(g, index), no,
                                         ns * g.dim, g.stream_elems(), "kvq value outliers"));
    }
    if (index == 0 && c_.sinks)
      for (const ChunkRef* c : {&k, &v}) {
        const size_t at = c == &k ? Lk.sinks : Lv.sinks;
        for (size_t i = 0; i < S * sink_bytes(g) / 2; ++i) {
          uint16_t hb;
          std::memcpy(&hb, c->data + at + 2 * i, 2);
          if (!std::isfinite(f16_to_f32(hb))) return corrupt("kvq sink value is not finite");
        }
      }
    // The table grows once the import commits (end_import), so a failed one changes nothing.
    staged_rope_ = index == 0 ? g.tokens : std::max(staged_rope_, (index + 1) * g.tokens);
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(k.data, k.size);
    blk->values = Buffer(v.data, v.size);
    return SealedBlock{std::move(blk), accounting(g, index, k.size, v.size)};
  }

 private:
  // decode(); `basis`: the stream left rotated (k_rot / v_rot), its sink rows rotated too.
  void decode_stream(const BlockData& blk, int64_t index, bool keys, int64_t b, int64_t h,
                     const BlockGeometry& g, float* out, Workspace& ws, bool basis) const {
    Workspace::Frame frame(ws);
    const int64_t T = g.tokens, D = g.dim, n = T * D, s = b * g.heads + h;
    const int64_t ns = index == 0 ? c_.sinks : 0, no = n_outliers(g, index);
    const PartLayout L = layout(g, index, keys);
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(n));
    if (keys) {
      get_codes(blk.keys, L, s, g, c_.k_bits, codes, ws);
      const uint8_t* kparams = blk.keys.data() + L.params + s * kparam_bytes(g);
      if (c_.u8) {
        float* scale = ws.alloc<float>(static_cast<size_t>(2 * D));
        float* zero = scale + D;
        u8pairs::expand(kparams, D, scale, zero);
        dequant_u8_channels(codes, T, D, scale, zero, out);
      } else if (const QuantParams* kp = params_at(kparams, kparam_bytes(g), ws); c_.k_gauss) {
        for (int64_t d = 0; d < D; ++d) dequantize_gauss(codes + d, T, D, kp[d], kg_, out + d, D);
      } else {
        dequantize_per_channel(codes, T, D, kp, out);
      }
      if (no) put_outliers(blk.keys.data() + L.outliers + s * outlier_bytes(g, index), no, out);
      if (!basis) from_key_basis(out + ns * D, T - ns, index * T + ns);
      if (ns) load_sinks(blk.keys.data() + L.sinks + s * sink_bytes(g), out, ns * D);
      if (basis) to_basis(true, out, ns);
    } else {
      get_codes(blk.values, L, s, g, c_.v_bits, codes, ws);
      const uint8_t* vparams = blk.values.data() + L.params + s * vparam_bytes(g);
      const int64_t ng = n_channel_groups(D, c_.v_group);
      if (c_.u8) {
        float* scale = ws.alloc<float>(static_cast<size_t>(2 * T * ng));
        float* zero = scale + T * ng;
        u8pairs::expand(vparams, T * ng, scale, zero);
        dequant_u8_tokens(codes, T, D, c_.v_group, scale, zero, out);
      } else if (const QuantParams* vp = params_at(vparams, vparam_bytes(g), ws); c_.v_gauss) {
        for (int64_t t = 0; t < T; ++t)
          for (int64_t gi = 0; gi < ng; ++gi) {
            const int64_t d0 = gi * c_.v_group, len = std::min(c_.v_group, D - d0);
            dequantize_gauss(codes + t * D + d0, len, 1, vp[t * ng + gi], vg_, out + t * D + d0, 1);
          }
      } else {
        dequantize_per_token(codes, T, D, c_.v_group, vp, out);
      }
      if (no) put_outliers(blk.values.data() + L.outliers + s * outlier_bytes(g, index), no, out);
      if (c_.v_rot && !basis)
        for (int64_t t = ns; t < T; ++t) unrotate(out + t * D);
      if (ns) load_sinks(blk.values.data() + L.sinks + s * sink_bytes(g), out, ns * D);
      if (basis) to_basis(false, out, ns);
    }
  }

  // Rows x [n, D] at positions pos0.. go to the quantized basis: RoPE undone (rope=pre), then
  // the rotation (k_rot); from_key_basis is the inverse.
  void to_key_basis(float* x, int64_t n, int64_t pos0) const {
    const int64_t D = shape().head_dim;
    if (c_.pre_rope) rope_rows(x, n, D, rope_.get(), pos0, adjacent(), true);
    if (c_.k_rot)
      for (int64_t t = 0; t < n; ++t) rotate(x + t * D);
  }
  void from_key_basis(float* x, int64_t n, int64_t pos0) const {
    const int64_t D = shape().head_dim;
    if (c_.k_rot)
      for (int64_t t = 0; t < n; ++t) unrotate(x + t * D);
    if (c_.pre_rope) rope_rows(x, n, D, rope_.get(), pos0, adjacent(), false);
  }
  bool adjacent() const { return shape().rope.mode == RopeShape::Mode::kAdjacent; }
  // This layer holds sealed blocks up to position `n` (rope=pre): the table has their angles.
  // Decoding never grows the table: every block it reads was encoded, loaded or cloned first.
  void hold_rope(int64_t n) {
    if (!rope_) return;
    if (!holding_) rope_->acquire(), holding_ = true;
    rope_->ensure(n);
  }
  // This layer holds no sealed block any more; the last layer of a table to let go clears it.
  void release_rope() {
    if (holding_) rope_->release(), holding_ = false;
  }
  // Randomized Walsh-Hadamard: y = H (s * x) over blocks of rot_; its inverse x = s * (H y).
  void rotate(float* row) const {
    const int64_t D = shape().head_dim;
    for (int64_t i = 0; i < D; ++i) row[i] *= signs_[static_cast<size_t>(i)];
    for (int64_t i = 0; i < D; i += rot_) hadamard(row + i, rot_);
  }
  void unrotate(float* row) const {
    const int64_t D = shape().head_dim;
    for (int64_t i = 0; i < D; i += rot_) hadamard(row + i, rot_);
    for (int64_t i = 0; i < D; ++i) row[i] *= signs_[static_cast<size_t>(i)];
  }
  static void store_sinks(const float* x, uint8_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t hb = f32_to_f16(x[i]);
      std::memcpy(out + 2 * i, &hb, 2);
    }
  }
  // k indices, then their k fp16 values.
  static void store_outliers(const uint16_t* idx, const uint16_t* val, int64_t k, uint8_t* out) {
    std::memcpy(out, idx, 2 * static_cast<size_t>(k));
    std::memcpy(out + 2 * k, val, 2 * static_cast<size_t>(k));
  }
  // A stream's k outliers: indices strictly increasing in [first, n) (outside the sink rows),
  // values finite.
  static Status check_outliers(const uint8_t* p, int64_t k, int64_t first, int64_t n,
                               const char* what) {
    int64_t prev = first - 1;
    for (int64_t j = 0; j < k; ++j) {
      uint16_t i, hb;
      std::memcpy(&i, p + 2 * j, 2);
      std::memcpy(&hb, p + 2 * (k + j), 2);
      if (i <= prev || i >= n)
        return corrupt(std::string(what) + ": index " + std::to_string(i) + " at " +
                       std::to_string(j) + " is not in (" + std::to_string(prev) + ", " +
                       std::to_string(n) + ")");
      if (!std::isfinite(f16_to_f32(hb)))
        return corrupt(std::string(what) + ": value " + std::to_string(j) + " is not finite");
      prev = i;
    }
    return ok_status();
  }
  static void load_sinks(const uint8_t* in, float* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      uint16_t hb;
      std::memcpy(&hb, in + 2 * i, 2);
      out[i] = f16_to_f32(hb);
    }
  }

  size_t kcode_bytes(const BlockGeometry& g) const {
    return packed_size(static_cast<size_t>(g.stream_elems()), c_.k_bits);
  }
  size_t vcode_bytes(const BlockGeometry& g) const {
    return packed_size(static_cast<size_t>(g.stream_elems()), c_.v_bits);
  }
  size_t kparam_bytes(const BlockGeometry& g) const {
    return c_.u8 ? u8pairs::bytes(g.dim) : static_cast<size_t>(g.dim) * 4;
  }
  size_t vparam_bytes(const BlockGeometry& g) const {
    const int64_t n = g.tokens * n_channel_groups(g.dim, c_.v_group);
    return c_.u8 ? u8pairs::bytes(n) : static_cast<size_t>(n) * 4;
  }
  size_t sink_bytes(const BlockGeometry& g) const {
    return static_cast<size_t>(c_.sinks * g.dim) * 2;
  }
  // Outliers per stream and part of block `index`: `outliers` per mille of its quantized rows'
  // elements, rounded up; each a u16 index and an fp16 value.
  int64_t n_outliers(const BlockGeometry& g, int64_t index) const {
    const int64_t q = (g.tokens - (index == 0 ? c_.sinks : 0)) * g.dim;
    return (c_.outliers * q + 999) / 1000;
  }
  size_t outlier_bytes(const BlockGeometry& g, int64_t index) const {
    return 4 * static_cast<size_t>(n_outliers(g, index));
  }
  // Where the regions of a part start (S streams' worth each). At 0: the packed codes
  // (entropy=off), or the streams' end offsets (entropy=on, u32 each, from the start of the
  // coded region). `fixed`: the size of everything else; with entropy=on the S coded streams
  // follow it, in stream order.
  struct PartLayout {
    size_t params = 0, sinks = 0, outliers = 0, fixed = 0;
  };
  PartLayout layout(const BlockGeometry& g, int64_t index, bool keys) const {
    const size_t S = static_cast<size_t>(g.streams());
    PartLayout L;
    L.params = S * (c_.entropy ? 4 : keys ? kcode_bytes(g) : vcode_bytes(g));
    L.sinks = L.params + S * (keys ? kparam_bytes(g) : vparam_bytes(g));
    L.outliers = L.sinks + (index == 0 ? S * sink_bytes(g) : 0);
    L.fixed = L.outliers + S * outlier_bytes(g, index);
    return L;
  }
  // Bytes by kind of block `index` whose parts hold key_size and value_size bytes. Outliers are
  // billed with the pairs (params): side information of the quantizer, per group. With
  // entropy=on the codes are the coded streams (each with its header and inline tables), their
  // end offsets meta.
  CacheBytes accounting(const BlockGeometry& g, int64_t index, size_t key_size,
                        size_t value_size) const {
    const uint64_t S = static_cast<uint64_t>(g.streams());
    CacheBytes c;
    c.key_codes = c_.entropy ? key_size - layout(g, index, true).fixed : S * kcode_bytes(g);
    c.value_codes = c_.entropy ? value_size - layout(g, index, false).fixed : S * vcode_bytes(g);
    c.params = S * (kparam_bytes(g) + vparam_bytes(g) + 2 * outlier_bytes(g, index));
    c.residual = index == 0 ? 2 * S * sink_bytes(g) : 0;
    c.meta = c_.entropy ? 2 * 4 * S : 0;
    return c;
  }
  // entropy=on: rANS tables at most 2^7 fine, so every stream decodes on the coder's slot-table
  // path (docs/entropy.md §2); per-channel or pooled tables, whichever is smaller (a block's
  // G tokens per channel are few for a table of their own, a stream's pooled ones many).
  static entropy::SymbolCodecOptions codec_options() {
    entropy::SymbolCodecOptions o;
    o.prob_bits = entropy::kLutMaxProbBits;
    o.layout = entropy::TableLayout::kAuto;
    o.stats_shannon = false;
    return o;
  }
  // A stream's codes [T, D] token-major: packed at `at` (entropy=off), or coded, appended to
  // `coded`, and its end offset written at `at` (entropy=on).
  void put_codes(const uint8_t* codes, int64_t T, int64_t D, int bits,
                 const entropy::SymbolCodecOptions& o, uint8_t* at, std::vector<uint8_t>& coded,
                 Workspace& ws) const {
    if (!c_.entropy) {
      pack_bits(codes, static_cast<size_t>(T * D), bits, at);
      return;
    }
    const Status st = entropy::encode_symbols(codes, T, static_cast<int>(D), bits, o, coded,
                                              nullptr, nullptr, nullptr, &ws);
    KVQ_CHECK(st.ok());  // codes are < 2^bits by construction
    const uint32_t end = static_cast<uint32_t>(coded.size());
    std::memcpy(at, &end, 4);
  }
  // Stream s's codes [T, D] of a part (validated when built or loaded).
  void get_codes(const Buffer& part, const PartLayout& L, int64_t s, const BlockGeometry& g,
                 int bits, uint8_t* codes, Workspace& ws) const {
    const size_t n = static_cast<size_t>(g.stream_elems());
    if (!c_.entropy) {
      unpack_bits(part.data() + static_cast<size_t>(s) * packed_size(n, bits), n, bits, codes);
      return;
    }
    uint32_t begin = 0, end;
    if (s > 0) std::memcpy(&begin, part.data() + 4 * static_cast<size_t>(s - 1), 4);
    std::memcpy(&end, part.data() + 4 * static_cast<size_t>(s), 4);
    const Status st =
        entropy::decode_symbols(part.data() + L.fixed + begin, end - begin, g.tokens,
                                static_cast<int>(g.dim), bits, codes, nullptr,
                                entropy::RansImpl::kAuto, nullptr, &ws);
    KVQ_CHECK(st.ok());
  }
  // entropy=on: S end offsets at the part's start (non-decreasing, the last one the size of the
  // coded region after the fixed ones), each stream whole and decodable to T x D codes.
  Status check_streams(const ChunkRef& part, const PartLayout& L, const BlockGeometry& g,
                       int bits, const char* what) const {
    const int64_t S = g.streams();
    KVQ_RETURN_IF_ERROR(entropy::check_stream_ends(part.data, S, part.size - L.fixed, what));
    std::vector<uint8_t> sym(static_cast<size_t>(g.stream_elems()));
    uint32_t prev = 0;
    for (int64_t s = 0; s < S; ++s) {
      uint32_t end;
      std::memcpy(&end, part.data + 4 * static_cast<size_t>(s), 4);
      const Status st = entropy::decode_symbols(part.data + L.fixed + prev, end - prev, g.tokens,
                                                static_cast<int>(g.dim), bits, sym.data());
      if (!st.ok())
        return corrupt(std::string(what) + ", stream " + std::to_string(s) + ": " + st.message());
      prev = end;
    }
    return ok_status();
  }

  // Uniform pairs need scale > 0 (kvq/group_quant.h); Gaussian ones a finite scale >= 0.
  static Status check_params(const uint8_t* p, size_t n, bool gauss, const char* what) {
    if (!gauss) return validate_quant_params(p, n, what);
    for (size_t i = 0; i < n; ++i) {
      QuantParams q;
      std::memcpy(&q, p + 4 * i, 4);
      const float sc = f16_to_f32(q.scale), ze = f16_to_f32(q.zero);
      if (!std::isfinite(sc) || !(sc >= 0) || !std::isfinite(ze))
        return corrupt(std::string(what) + ": pair " + std::to_string(i) + " has scale " +
                       std::to_string(sc) + ", mean " + std::to_string(ze));
    }
    return ok_status();
  }

  KvqConfig c_;
  std::vector<float> kg_, vg_, kb_, vb_;  // Gaussian levels and their midpoints (when used)
  int64_t rot_ = 1;
  std::vector<float> signs_;
  std::shared_ptr<RopeTable> rope_;  // rope=pre: shared by the model's layers with its RoPE
  bool rope_owner_ = false;          // this layer bills the table
  bool holding_ = false;             // this layer holds blocks, so the table's angles
  int64_t staged_rope_ = 0;          // an import's blocks reach this position (until it ends)
  // entropy=on encode scratch, kept at its largest size: the parts' fixed regions and streams.
  std::vector<uint8_t> kfixed_, vfixed_, kcoded_, vcoded_;
};

Result<std::vector<std::unique_ptr<BlockCodec>>> build(const std::vector<Spec>& specs,
                                                       const ModelShape& shape) {
  for (int i = 0; i < shape.n_layers; ++i) {
    const Spec& s = specs[static_cast<size_t>(i)];
    const std::string where = "kvq layer " + std::to_string(i) + ": ";
    if (s.get_enum("rope") == "pre" && shape.at(i).rope.mode == RopeShape::Mode::kNone)
      return invalid_argument(where +
                              "rope=pre needs the model's RoPE in the cache shape "
                              "(LayerShape::rope; kvq's engine and kvq.hf set it), or rope=post");
    if (s.get_enum("rope") == "pre" && shape.at(i).head_dim % 2 != 0)
      return invalid_argument(where + "rope=pre needs an even head_dim");
    if (s.get_int("outliers") > 0 && s.get_int("group") * shape.at(i).head_dim > 65535)
      return invalid_argument(where + "outliers need group * head_dim <= 65535 (u16 indices into "
                              "a block stream), got group=" + std::to_string(s.get_int("group")) +
                              " * head_dim " + std::to_string(shape.at(i).head_dim));
  }
  // One table of RoPE angles per distinct (theta, scaling, head_dim), shared by its layers and
  // billed by the first of them.
  std::vector<std::unique_ptr<BlockCodec>> layers;
  std::vector<std::shared_ptr<RopeTable>> tables;
  for (int i = 0; i < shape.n_layers; ++i) {
    const Spec& s = specs[static_cast<size_t>(i)];
    const LayerShape& ls = shape.at(i);
    auto c = std::make_unique<KvqCodec>(s, ls);
    if (s.get_enum("rope") == "pre") {
      std::shared_ptr<RopeTable> t;
      for (const auto& u : tables)
        if (u->theta() == ls.rope.theta && u->freq_scale() == ls.rope.freq_scale &&
            u->head_dim() == ls.head_dim)
          t = u;
      const bool owner = !t;
      if (owner)
        tables.push_back(t = std::make_shared<RopeTable>(ls.rope.theta, ls.rope.freq_scale,
                                                         ls.head_dim));
      c->set_rope_table(std::move(t), owner);
    }
    layers.push_back(std::move(c));
  }
  return layers;
}

Status validate(const Spec& s) {
  if (s.get_int("sinks") >= s.get_int("group"))
    return invalid_argument("kvq: sinks=" + std::to_string(s.get_int("sinks")) +
                            " must leave quantized rows in the first block (group=" +
                            std::to_string(s.get_int("group")) + ")");
  if (s.get_enum("params") == "u8" &&
      (s.get_enum("k_levels") == "gauss" || s.get_enum("v_levels") == "gauss"))
    return invalid_argument("kvq: params=u8 is for uniform levels (k_levels, v_levels=uniform)");
  return ok_status();
}

}  // namespace

MethodDef make_kvq_method() {
  MethodDef m;
  m.id = 11;
  m.name = "kvq";
  m.summary =
      "kvq's own: pre-RoPE per-channel keys, rotated per-token values, exact attention sinks";
  m.params = {
      {"k_bits", ParamType::kInt, 3, 1, 8, {}, "bits per key code"},
      {"v_bits", ParamType::kInt, 3, 1, 8, {}, "bits per value code"},
      {"group",
       ParamType::kInt,
       32,
       1,
       4096,
       {},
       "tokens per key group (one scale/zero per channel): the block length"},
      {"v_group",
       ParamType::kInt,
       64,
       1,
       4096,
       {},
       "channels per value group (capped at head_dim)"},
      {"residual", ParamType::kInt, 32, 0, 1 << 20, {}, "newest tokens kept exact"},
      {"sinks",
       ParamType::kInt,
       4,
       0,
       4096,
       {},
       "first tokens kept exact (attention sinks), out of their group's statistics"},
      {"rope",
       ParamType::kEnum,
       1,
       0,
       0,
       {"post", "pre"},
       "keys quantized after RoPE (as appended) or before it (undone and redone by the cache)"},
      {"k_rot",
       ParamType::kEnum,
       0,
       0,
       0,
       {"off", "on"},
       "randomized Walsh-Hadamard rotation of keys before their per-channel quantization"},
      {"k_levels",
       ParamType::kEnum,
       0,
       0,
       0,
       {"uniform", "gauss"},
       "key code levels: uniform over each group's range, or the normal distribution's Lloyd-Max "
       "levels scaled by the group's mean and deviation"},
      {"v_levels",
       ParamType::kEnum,
       0,
       0,
       0,
       {"uniform", "gauss"},
       "value code levels (as k_levels)"},
      {"v_rot",
       ParamType::kEnum,
       1,
       0,
       0,
       {"off", "on"},
       "randomized Walsh-Hadamard rotation of values before their per-token quantization"},
      {"params",
       ParamType::kEnum,
       1,
       0,
       0,
       {"f16", "u8"},
       "scale/zero pairs in fp16, or 8-bit codes of each stream's set (log-spaced scales, "
       "uniform zeros, a 6-byte header)"},
      {"outliers",
       ParamType::kInt,
       0,
       0,
       100,
       {},
       "per mille of each block stream's quantized elements kept exact (fp16 and a u16 index), "
       "the farthest from their group's mean in its deviations, out of its range"},
      {"entropy",
       ParamType::kEnum,
       0,
       0,
       0,
       {"off", "on"},
       "codes of each sealed block stream packed, or rANS-coded (kvq's coder: raw, constant or "
       "inline per-channel/pooled tables, whichever is smallest) and held coded"},
      {"window",
       ParamType::kEnum,
       0,
       0,
       0,
       {"f16", "q8"},
       "the exact window (residual and unsealed tokens) in 16 bits, or as 8-bit codes with an "
       "fp16 scale per 32 values (8.5 bits)"},
  };
  m.build = build;
  m.validate = validate;
  m.test_settings = "group=4,residual=8,sinks=2";
  // Budget: 0.4 * 4^(2 - bits) relative squared error, the rate of uniform quantization.
  m.bit_ladder = {{"group=32,k_bits=2,v_bits=2", 2, 0.4},
                  {"group=32,k_bits=3,v_bits=3", 3, 0.1},
                  {"group=32,k_bits=4,v_bits=4", 4, 0.025},
                  {"group=32,k_bits=8,v_bits=8", 8, 1e-4}};
  return m;
}

}  // namespace kvq
