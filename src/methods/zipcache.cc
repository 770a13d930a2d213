// ZipCache (He et al., NeurIPS 2024, arXiv 2405.14256) as a kvq method: every token is
// quantized, salient tokens at hi_bits and the rest at lo_bits, per sealed block.
//
// Saliency (`saliency=`):
//   norm  VeloxQuant-MLX's proxy: key L2 norm.
//   attn  the paper's normalized attention score. Probe queries are chosen by position (a hash
//         of the absolute position, rate `probe`), so the choice does not depend on chunking. When
//         a probe arrives its query (rounded to fp16) and its softmax normalizer over all keys it
//         can see (log-sum-exp per query head) are kept while it can still see unsealed tokens.
//         When a block seals, token j's score is
//             sum over kept probes i >= j, over the query heads sharing j's KV head, of
//             exp(scale * q_i . k_j - lse_i), divided by the number of probes i >= j,
//         i.e. the mean attention j receives from the probes that can see it (scale = 1/sqrt(D)).
//         Without queries (append without q) a block falls back to norm; stats() counts it.
//   A block seals once R newer tokens exist, so decode tokens are classified with the R + T
//   queries that followed them: the paper's periodic re-ranking, once per block. Sealed tokens
//   are never re-quantized: their originals are gone, so promotion is impossible and demotion
//   alone would change a block's fixed layout (see docs/methods/zipcache.md).
//
// Keys: within a block of T tokens, the top round(frac * T) tokens of each (b, h) stream by
// saliency form the hi subset, the others the lo subset; each subset is quantized per channel
// over its tokens (fp16 scale/zero per channel per subset, as VeloxQuant-MLX's channel_quant).
// Values (`values=`): uniform (all tokens at hi_bits, per-token groups of v_group channels, the
// seed's default), routed (per-token groups at each token's bits), or cst (the paper's
// channel-separable token-wise quantization at each token's bits).
//
// Block layout, S = B * H streams, n_h = round(frac * T), n_l = T - n_h:
//   key record   (per stream, S of them, then the value records)
//     mask       ceil(T / 8) bytes, bit t = token t is salient
//     hi codes   packed_size(n_h * D, hi_bits), salient rows in position order
//     lo codes   packed_size(n_l * D, lo_bits)
//     params     D {scale, zero} fp16 pairs for hi (if n_h > 0), then D for lo (if n_l > 0)
//   value record (per stream)
//     codes      uniform: packed_size(T * D, hi_bits) in position order;
//                routed/cst: hi rows then lo rows, as the keys
//     params     T * ceil(D / v_group) {scale, zero} pairs, rows in the same order as the codes
//     cst only   D fp16 channel divisors
// The serialized key part is the S key records, the value part the S value records.
#include "kvq/zipcache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>

#include "cache/codec.h"
#include "core/cpu.h"
#include "kvq/bitpack.h"
#include "kvq/group_quant.h"
#include "kvq/spec.h"
#include "methods/zip_layout.h"
#include "numerics/kernels.h"

namespace kvq {

namespace {

// The stored layout of one block, over its two parts (keys: the S key records; values: the S
// value records). Reading views const data; encode_stream writes into a block being built.
class ZipBlock {
 public:
  ZipBlock(const BlockGeometry& g, const ZipConfig& c, const uint8_t* keys, const uint8_t* values)
      : g_(g),
        c_(c),
        l_(c, g.tokens, g.dim),
        keys_(const_cast<uint8_t*>(keys)),  // written only by encode_stream on a new block
        values_(const_cast<uint8_t*>(values)) {}

  size_t key_part() const { return streams() * l_.key_record(); }
  size_t value_part() const { return streams() * l_.value_record(); }
  const ZipLayout& layout() const { return l_; }

  // Quantizes stream s from k, v [T, D] with its mask (one byte per token).
  void encode_stream(int64_t s, const float* k, const float* v, const uint8_t* mask,
                     Workspace& ws) {
    Workspace::Frame frame(ws);
    const int64_t T = l_.T, D = l_.D;
    uint8_t* kr = key_record(s);
    pack_bits(mask, static_cast<size_t>(T), 1, kr);
    // Keys: hi and lo subsets, each per channel.
    float* rows[2] = {ws.alloc<float>(static_cast<size_t>(l_.n_l * D)),
                      ws.alloc<float>(static_cast<size_t>(l_.n_h * D))};
    int64_t* order = ws.alloc<int64_t>(static_cast<size_t>(T));  // hi rows then lo rows
    int64_t n_order = 0;
    for (int hi = 1; hi >= 0; --hi) {
      int64_t r = 0;
      for (int64_t t = 0; t < T; ++t)
        if ((mask[t] != 0) == (hi != 0)) {
          std::memcpy(rows[hi] + r++ * D, k + t * D, static_cast<size_t>(D) * 4);
          order[n_order++] = t;
        }
    }
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(T * D));
    QuantParams* params = ws.alloc<QuantParams>(static_cast<size_t>(std::max(D, T * l_.ng)));
    uint8_t* code_out = kr + l_.mask;
    uint8_t* param_out = kr + l_.mask + l_.khi + l_.klo;
    if (c_.shared_key_params) {
      // One (scale, zero) per channel over the whole block, fit for lo bits; hi tokens use the
      // same range with qmax_hi levels: scale_hi = scale * qmax_lo / qmax_hi (fp32, exact rule).
      for (int64_t d = 0; d < D; ++d) {
        float lo = k[d], hi = k[d];
        for (int64_t t = 1; t < T; ++t)
          lo = std::min(lo, k[t * D + d]), hi = std::max(hi, k[t * D + d]);
        params[d] = fit_range(lo, hi, c_.lo_bits);
      }
      std::memcpy(param_out, params, static_cast<size_t>(D) * sizeof(QuantParams));
      for (int hi = 1; hi >= 0; --hi) {
        const int64_t n = hi ? l_.n_h : l_.n_l;
        if (n == 0) continue;
        shared_quantize(rows[hi], n, params, hi != 0, codes);
        pack_bits(codes, static_cast<size_t>(n * D), hi ? c_.hi_bits : c_.lo_bits, code_out);
        code_out += hi ? l_.khi : l_.klo;
      }
    } else
      for (int hi = 1; hi >= 0; --hi) {
        const int64_t n = hi ? l_.n_h : l_.n_l;
        const int bits = hi ? c_.hi_bits : c_.lo_bits;
        if (n == 0) continue;
        quantize_per_channel(rows[hi], n, D, D, bits, codes, params);
        pack_bits(codes, static_cast<size_t>(n * D), bits, code_out);
        code_out += hi ? l_.khi : l_.klo;
        std::memcpy(param_out, params, static_cast<size_t>(D) * sizeof(QuantParams));
        param_out += static_cast<size_t>(D) * sizeof(QuantParams);
      }
    // Values. Parameters are built in aligned scratch (their place in the record may be odd).
    uint8_t* vr = value_record(s);
    QuantParams* vp = params;
    if (c_.values == ValueMode::kUniform) {
      quantize_per_token(v, T, D, D, c_.v_group, c_.hi_bits, codes, vp);
      pack_bits(codes, static_cast<size_t>(T * D), c_.hi_bits, vr);
      std::memcpy(vr + l_.vcodes, vp, l_.vparams);
      return;
    }
    float* vrows = ws.alloc<float>(static_cast<size_t>(T * D));
    uint8_t* bits = ws.alloc<uint8_t>(static_cast<size_t>(T));
    for (int64_t i = 0; i < n_order; ++i) {
      std::memcpy(vrows + i * D, v + order[i] * D, static_cast<size_t>(D) * 4);
      bits[i] = static_cast<uint8_t>(mask[order[i]] ? c_.hi_bits : c_.lo_bits);
    }
    if (c_.values == ValueMode::kCst) {
      uint16_t* cst = ws.alloc<uint16_t>(static_cast<size_t>(D));
      cst_quantize(vrows, T, D, D, c_.v_group, bits, cst, codes, vp, ws);
      std::memcpy(vr + l_.vcodes + l_.vparams, cst, static_cast<size_t>(D) * 2);
    } else {
      for (int64_t i = 0; i < T; ++i)
        quantize_per_token(vrows + i * D, 1, D, D, c_.v_group, bits[i], codes + i * D,
                           vp + i * l_.ng);
    }
    std::memcpy(vr + l_.vcodes, vp, l_.vparams);
    if (l_.n_h) pack_bits(codes, static_cast<size_t>(l_.n_h * D), c_.hi_bits, vr);
    if (l_.n_l)
      pack_bits(codes + l_.n_h * D, static_cast<size_t>(l_.n_l * D), c_.lo_bits, vr + l_.khi_v(c_));
  }

  // Dequantization writes each token's row in place from its subset's codes and parameters:
  // one pass, no staging copy (the mask says which subset row comes next). The bodies are
  // compiled once per SIMD level (core/cpu.h) and dequant_keys / dequant_values dispatch: the
  // library's baseline is SSE2, where these uint8 -> float rows made read ~30% slower than
  // at AVX2/AVX-512. Element-wise IEEE arithmetic without contraction: every level agrees.
  void dequant_keys(int64_t b, int64_t h, float* out, Workspace& ws) const;
  void dequant_values(int64_t b, int64_t h, float* out, Workspace& ws) const;

  template <SimdLevel L>
  KVQ_ALWAYS_INLINE void dequant_keys_body(int64_t b, int64_t h, float* out, Workspace& ws) const {
    Workspace::Frame frame(ws);
    const int64_t s = b * g_.heads + h, T = l_.T, D = l_.D;
    const uint8_t* kr = key_record(s);
    uint8_t* mask = ws.alloc<uint8_t>(static_cast<size_t>(T));
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(T * D));
    float* zs = ws.alloc<float>(static_cast<size_t>(4 * D));  // [hi zero|hi scale|lo zero|lo scale]
    unpack_bits(kr, static_cast<size_t>(T), 1, mask);
    if (l_.n_h) unpack_bits(kr + l_.mask, static_cast<size_t>(l_.n_h * D), c_.hi_bits, codes);
    if (l_.n_l)
      unpack_bits(kr + l_.mask + l_.khi, static_cast<size_t>(l_.n_l * D), c_.lo_bits,
                  codes + l_.n_h * D);
    const uint8_t* pp = kr + l_.mask + l_.khi + l_.klo;
    for (int hi = 1; hi >= 0; --hi) {
      const int64_t n = hi ? l_.n_h : l_.n_l;
      float* z = zs + (hi ? 0 : 2 * D);
      if (n == 0) continue;
      for (int64_t d = 0; d < D; ++d) {
        QuantParams q;
        std::memcpy(&q, pp + 4 * d, 4);
        z[d] = f16_to_f32(q.zero);
        z[D + d] = f16_to_f32(q.scale) * (c_.shared_key_params && hi ? hi_ratio() : 1.0f);
      }
      if (!c_.shared_key_params) pp += 4 * D;
    }
    int64_t ih = 0, il = l_.n_h;
    for (int64_t t = 0; t < T; ++t) {
      const bool salient = mask[t] != 0;
      const uint8_t* c = codes + (salient ? ih++ : il++) * D;
      const float* zero = zs + (salient ? 0 : 2 * D);
      const float* scale = zero + D;
      float* o = out + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] = zero[d] + static_cast<float>(c[d]) * scale[d];
    }
  }

  template <SimdLevel L>
  KVQ_ALWAYS_INLINE void dequant_values_body(int64_t b, int64_t h, float* out,
                                             Workspace& ws) const {
    Workspace::Frame frame(ws);
    const int64_t s = b * g_.heads + h, T = l_.T, D = l_.D;
    const uint8_t* vr = value_record(s);
    const uint8_t* vp = vr + l_.vcodes;  // pairs, read with memcpy (may be unaligned)
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(T * D));
    if (c_.values == ValueMode::kUniform) {
      unpack_bits(vr, static_cast<size_t>(T * D), c_.hi_bits, codes);
      dequantize_per_token(codes, T, D, c_.v_group, params_at(vp, l_.vparams, ws), out);
      return;
    }
    if (l_.n_h) unpack_bits(vr, static_cast<size_t>(l_.n_h * D), c_.hi_bits, codes);
    if (l_.n_l)
      unpack_bits(vr + l_.khi_v(c_), static_cast<size_t>(l_.n_l * D), c_.lo_bits,
                  codes + l_.n_h * D);
    uint8_t* mask = ws.alloc<uint8_t>(static_cast<size_t>(T));
    unpack_bits(key_record(s), static_cast<size_t>(T), 1, mask);
    float* cst = ws.alloc<float>(static_cast<size_t>(D));
    std::fill(cst, cst + D, 1.0f);
    if (c_.values == ValueMode::kCst) {
      uint16_t* bits = ws.alloc<uint16_t>(static_cast<size_t>(D));
      std::memcpy(bits, vr + l_.vcodes + l_.vparams, static_cast<size_t>(D) * 2);
      convert_f16_to_f32(bits, cst, static_cast<size_t>(D));
    }
    const int64_t G = c_.v_group;
    int64_t ih = 0, il = l_.n_h;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t r = mask[t] ? ih++ : il++;  // row in subset order
      const uint8_t* c = codes + r * D;
      float* o = out + t * D;
      for (int64_t g = 0; g < l_.ng; ++g) {
        QuantParams q;
        std::memcpy(&q, vp + 4 * (r * l_.ng + g), 4);
        const float zero = f16_to_f32(q.zero), scale = f16_to_f32(q.scale);
        for (int64_t d = g * G; d < std::min(D, (g + 1) * G); ++d)
          o[d] = (zero + static_cast<float>(c[d]) * scale) * cst[d];
      }
    }
  }

  CacheBytes bytes() const {
    const uint64_t S = streams();
    CacheBytes c;
    c.key_codes = S * (l_.khi + l_.klo);
    c.value_codes = S * l_.vcodes;
    c.params = S * (l_.kparams + l_.vparams + l_.vcst);
    c.meta = S * l_.mask;
    return c;
  }
  // Validates serialized parts (sizes first, then every record) and copies them into a block.
  static Result<SealedBlock> load(const BlockGeometry& g, const ZipConfig& c, const ChunkRef& k,
                                  const ChunkRef& v) {
    const ZipBlock view(g, c, k.data, v.data);
    const ZipLayout& l = view.l_;
    const size_t S = view.streams();
    if (k.size != view.key_part() || v.size != view.value_part())
      return corrupt("zipcache block needs " + std::to_string(S * l.key_record()) + " key and " +
                     std::to_string(S * l.value_record()) + " value bytes, got " +
                     std::to_string(k.size) + " and " + std::to_string(v.size));
    std::vector<uint8_t> mask(static_cast<size_t>(l.T));
    for (size_t s = 0; s < S; ++s) {
      const uint8_t* kr = view.key_record(static_cast<int64_t>(s));
      unpack_bits(kr, mask.size(), 1, mask.data());
      int64_t n = 0;
      for (uint8_t m : mask) n += m;
      if (n != l.n_h)
        return corrupt("zipcache mask marks " + std::to_string(n) + " salient tokens, expected " +
                       std::to_string(l.n_h));
      KVQ_RETURN_IF_ERROR(padding_zero(kr, l.mask, l.T));
      KVQ_RETURN_IF_ERROR(padding_zero(kr + l.mask, l.khi, l.n_h * l.D * c.hi_bits));
      KVQ_RETURN_IF_ERROR(padding_zero(kr + l.mask + l.khi, l.klo, l.n_l * l.D * c.lo_bits));
      KVQ_RETURN_IF_ERROR(
          validate_quant_params(kr + l.mask + l.khi + l.klo, l.kparams / 4, "zipcache key params"));
      const uint8_t* vr = view.value_record(static_cast<int64_t>(s));
      if (c.values == ValueMode::kUniform) {
        KVQ_RETURN_IF_ERROR(padding_zero(vr, l.vcodes, l.T * l.D * c.hi_bits));
      } else {
        KVQ_RETURN_IF_ERROR(padding_zero(vr, l.khi_v(c), l.n_h * l.D * c.hi_bits));
        KVQ_RETURN_IF_ERROR(padding_zero(vr + l.khi_v(c), l.klo_v(c), l.n_l * l.D * c.lo_bits));
      }
      KVQ_RETURN_IF_ERROR(
          validate_quant_params(vr + l.vcodes, l.vparams / 4, "zipcache value params"));
      for (size_t d = 0; d < l.vcst / 2; ++d) {
        uint16_t h;
        std::memcpy(&h, vr + l.vcodes + l.vparams + 2 * d, 2);
        const float x = f16_to_f32(h);
        if (!std::isfinite(x) || !(x > 0))
          return corrupt("zipcache channel divisor " + std::to_string(x));
      }
    }
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(k.data, k.size);
    blk->values = Buffer(v.data, v.size);
    return SealedBlock{std::move(blk), view.bytes()};
  }

 private:
  // Shared key params: the stored pair is fit for lo bits; hi codes step by scale * ratio.
  float hi_ratio() const {
    return static_cast<float>((1 << c_.lo_bits) - 1) / static_cast<float>((1 << c_.hi_bits) - 1);
  }
  void shared_quantize(const float* rows, int64_t n, const QuantParams* p, bool hi,
                       uint8_t* codes) const {
    const int64_t D = l_.D;
    const float qmax = static_cast<float>((1 << (hi ? c_.hi_bits : c_.lo_bits)) - 1);
    for (int64_t d = 0; d < D; ++d) {
      QuantParams q;
      std::memcpy(&q, reinterpret_cast<const uint8_t*>(p) + 4 * d, 4);
      const float zero = f16_to_f32(q.zero);
      const float scale = hi ? f16_to_f32(q.scale) * hi_ratio() : f16_to_f32(q.scale);
      const float inv = 1.0f / scale;
      for (int64_t t = 0; t < n; ++t)
        codes[t * D + d] = static_cast<uint8_t>(
            std::clamp(std::nearbyint((rows[t * D + d] - zero) * inv), 0.0f, qmax));
    }
  }
  static Status padding_zero(const uint8_t* p, size_t bytes, int64_t bits) {
    if (bits % 8 == 0 || bytes == 0) return ok_status();
    if (p[bytes - 1] & static_cast<uint8_t>(0xFF << (bits % 8)))
      return corrupt("non-zero padding bits");
    return ok_status();
  }
  size_t streams() const { return static_cast<size_t>(g_.batch * g_.heads); }
  uint8_t* key_record(int64_t s) { return keys_ + static_cast<size_t>(s) * l_.key_record(); }
  const uint8_t* key_record(int64_t s) const {
    return keys_ + static_cast<size_t>(s) * l_.key_record();
  }
  uint8_t* value_record(int64_t s) { return values_ + static_cast<size_t>(s) * l_.value_record(); }
  const uint8_t* value_record(int64_t s) const {
    return values_ + static_cast<size_t>(s) * l_.value_record();
  }

  BlockGeometry g_;
  ZipConfig c_;
  ZipLayout l_;
  uint8_t* keys_;
  uint8_t* values_;
};

template <SimdLevel L>
KVQ_ALWAYS_INLINE void zip_dequant_keys_body(const ZipBlock& z, int64_t b, int64_t h, float* out,
                                             Workspace& ws) {
  z.dequant_keys_body<L>(b, h, out, ws);
}
template <SimdLevel L>
KVQ_ALWAYS_INLINE void zip_dequant_values_body(const ZipBlock& z, int64_t b, int64_t h, float* out,
                                               Workspace& ws) {
  z.dequant_values_body<L>(b, h, out, ws);
}
KVQ_LEVEL_CLONES(void, zip_dequant_keys,
                 (const ZipBlock& z, int64_t b, int64_t h, float* out, Workspace& ws),
                 (z, b, h, out, ws))
KVQ_LEVEL_CLONES(void, zip_dequant_values,
                 (const ZipBlock& z, int64_t b, int64_t h, float* out, Workspace& ws),
                 (z, b, h, out, ws))

void ZipBlock::dequant_keys(int64_t b, int64_t h, float* out, Workspace& ws) const {
  KVQ_LEVEL_DISPATCH(zip_dequant_keys, (*this, b, h, out, ws));
}
void ZipBlock::dequant_values(int64_t b, int64_t h, float* out, Workspace& ws) const {
  KVQ_LEVEL_DISPATCH(zip_dequant_values, (*this, b, h, out, ws));
}

// A kept probe: its position, fp16 queries [B, Hq, D] and log-sum-exp [B, Hq].
struct Probe {
  int64_t pos;
  Buffer data;  // B*Hq*D uint16 then B*Hq float
};

class ZipCodec final : public BlockCodec {
 public:
  ZipCodec(const Spec& spec, const LayerShape& shape)
      : BlockCodec(spec, shape, spec.get_int("group"), spec.get_int("residual")),
        c_(config_from(spec, shape.head_dim)) {}
  std::unique_ptr<BlockCodec> clone(CloneMemo&) const override {
    auto c = std::make_unique<ZipCodec>(*this);
    c->mirror_ = nullptr;
    c->mirrored_ = 0;
    return c;
  }

  std::string stats(const std::vector<std::shared_ptr<const BlockData>>&,
                    const BlockGeometry&) const override {
    return "saliency=" + std::string(c_.saliency == Saliency::kAttn ? "attn" : "norm") +
           "\nblocks_ranked_by_attention=" + std::to_string(by_attn_) +
           "\nblocks_ranked_by_norm=" + std::to_string(by_norm_) +
           "\nattn_fallback_blocks_without_probes=" + std::to_string(fallback_) +
           "\nprobes_held=" + std::to_string(probes_.size()) + "\n";
  }

 protected:
  bool is_probe(int64_t pos) const { return c_.is_probe(pos); }

  // A probe's query is kept (rounded to fp16) with its softmax normalizer over the keys as held
  // when it arrives: those of sealed blocks dequantized, the window exact. The block whose seal
  // point this probe reaches is still in the window then (it seals after on_tokens, using this
  // probe), so the normalizer of a run's last position is taken before that block is sealed.
  void on_tokens(const TokenRun& run, const LayerReader& layer, Workspace& ws) override {
    if (c_.saliency != Saliency::kAttn || !run.q) return;
    const TensorView* q = run.q;
    const int64_t pos0 = run.pos0, n = run.n;
    const int64_t B = layer.batch(), H = shape().n_kv_heads, Hq = shape().n_q_heads,
                  D = shape().head_dim;
    batch_ = B;
    const int64_t group = Hq / H;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    int64_t last = -1, first = -1;
    for (int64_t p = pos0; p < pos0 + n; ++p)
      if (is_probe(p)) last = p, first = first < 0 ? p : first;
    if (last < 0) return;
    // Keys as the model sees them now ([0, last], sealed ones dequantized), in a mirror that
    // lives in the append's workspace: sealed blocks are dequantized once per append, so a long
    // prefill does not dequantize its prefix again for every run.
    const int64_t sealed = layer.sealed_tokens();
    if (!mirror_) {
      mirror_ = ws.alloc<float>(static_cast<size_t>(B * H * run.append_end * D));
      mirror_stride_ = run.append_end * D;
      mirrored_ = 0;
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        layer.gather(true, b, h, mirrored_, last + 1 - mirrored_,
                     mirror_ + (b * H + h) * mirror_stride_ + mirrored_ * D, ws);
    mirrored_ = sealed;  // window rows are refreshed on the next run
    const size_t qbytes = static_cast<size_t>(B * Hq * D) * 2;
    Workspace::Frame frame(ws);
    float* qf = ws.alloc<float>(static_cast<size_t>(D));
    float* s = ws.alloc<float>(static_cast<size_t>(last + 1));
    for (int64_t p = first; p <= last; ++p) {
      if (!is_probe(p)) continue;
      Probe pr{p, Buffer(qbytes + static_cast<size_t>(B * Hq) * 4)};
      auto* qh = reinterpret_cast<uint16_t*>(pr.data.data());
      auto* lse = reinterpret_cast<float*>(pr.data.data() + qbytes);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hq = 0; hq < Hq; ++hq) {
          uint16_t* qrow = qh + (b * Hq + hq) * D;
          for (int64_t d = 0; d < D; ++d) {
            // Saturating: a query beyond fp16's range keeps a finite log-sum-exp.
            qrow[d] = f32_to_f16(std::clamp(q->load(b, hq, p - pos0, d), -kF16Max, kF16Max));
            qf[d] = f16_to_f32(qrow[d]);
          }
          const float* kk = mirror_ + (b * H + hq / group) * mirror_stride_;
          float mx = -std::numeric_limits<float>::infinity();
          gemv_f32(kk, p + 1, D, D, qf, scale, s);
          for (int64_t j = 0; j <= p; ++j) mx = std::max(mx, s[j]);
          const double sum = exp_sum_f32(s, mx, p + 1, s);
          // log_f64: kvq's own log, which the CUDA backend computes bit for bit.
          lse[b * Hq + hq] = static_cast<float>(mx + log_f64(sum));
        }
      probes_.push_back(std::move(pr));
    }
  }

  SealedBlock encode(int64_t index, const BlockGeometry& g, const float* k, const float* v,
                     Workspace& ws) override {
    const int64_t T = g.tokens, D = g.dim, H = g.heads, Hq = shape().n_q_heads, group = Hq / H;
    const int64_t t0 = index * T;
    auto data = std::make_shared<BlockData>();
    ZipBlock sizes(g, c_, nullptr, nullptr);
    data->keys = Buffer(sizes.key_part());
    data->values = Buffer(sizes.value_part());
    ZipBlock blk(g, c_, data->keys.data(), data->values.data());
    const bool attn = c_.saliency == Saliency::kAttn && !probes_.empty();
    if (c_.saliency == Saliency::kAttn) {
      if (attn)
        ++by_attn_;
      else
        ++fallback_;
    } else {
      ++by_norm_;
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const size_t qbytes = static_cast<size_t>(g.batch * Hq * D) * 2;
    Workspace::Frame frame(ws);
    float* qf = ws.alloc<float>(static_cast<size_t>(D));
    float* sc = ws.alloc<float>(static_cast<size_t>(T));
    float* score = ws.alloc<float>(static_cast<size_t>(T));
    double* sum = ws.alloc<double>(static_cast<size_t>(T));
    int64_t* count = ws.alloc<int64_t>(static_cast<size_t>(T));
    uint8_t* mask = ws.alloc<uint8_t>(static_cast<size_t>(T));
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t s = b * H + h;
        const float* ks = k + s * T * D;
        if (attn) {
          std::fill(sum, sum + T, 0.0);
          std::fill(count, count + T, int64_t{0});
          for (const Probe& pr : probes_) {
            if (pr.pos < t0) continue;
            const auto* qh = reinterpret_cast<const uint16_t*>(pr.data.data());
            const auto* lse = reinterpret_cast<const float*>(pr.data.data() + qbytes);
            const int64_t visible = std::min(T, pr.pos - t0 + 1);
            for (int64_t j = 0; j < visible; ++j) ++count[j];
            for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
              const uint16_t* qrow = qh + (b * Hq + hq) * D;
              for (int64_t d = 0; d < D; ++d) qf[d] = f16_to_f32(qrow[d]);
              gemv_f32(ks, visible, D, D, qf, scale, sc);
              exp_sum_f32(sc, lse[b * Hq + hq], visible, sc);
              for (int64_t j = 0; j < visible; ++j) sum[j] += sc[j];
            }
          }
          for (int64_t j = 0; j < T; ++j)  // tokens no probe could see rank last
            score[j] =
                count[j] ? static_cast<float>(sum[j] / static_cast<double>(count[j])) : -INFINITY;
        } else {
          token_key_norms(ks, T, D, score);
        }
        saliency_mask(score, T, c_.frac, mask, ws);
        blk.encode_stream(s, ks, v + s * T * D, mask, ws);
      }
    // Probes that can no longer see an unsealed token are dropped.
    const int64_t sealed_end = t0 + T;
    while (!probes_.empty() && probes_.front().pos < sealed_end) probes_.pop_front();
    return {std::move(data), blk.bytes()};
  }

  void decode(const BlockData& data, int64_t, bool keys, int64_t b, int64_t h,
              const BlockGeometry& g, float* out, Workspace& ws) const override {
    const ZipBlock blk(g, c_, data.keys.data(), data.values.data());
    if (keys)
      blk.dequant_keys(b, h, out, ws);
    else
      blk.dequant_values(b, h, out, ws);
  }

  Result<SealedBlock> load(int64_t, const BlockGeometry& g, const ChunkRef& k,
                           const ChunkRef& v) override {
    return ZipBlock::load(g, c_, k, v);
  }

  void on_append_done() override {
    mirror_ = nullptr;
    mirrored_ = 0;
  }
  void on_trim(int64_t new_offset, int64_t) override {
    while (!probes_.empty() && probes_.back().pos >= new_offset) probes_.pop_back();
  }
  void on_reset() override {
    probes_.clear();
    by_attn_ = by_norm_ = fallback_ = 0;
    batch_ = 0;
  }
  uint64_t extra_bytes() const override {
    const uint64_t per = static_cast<uint64_t>(batch_ * shape().n_q_heads) *
                         (static_cast<uint64_t>(shape().head_dim) * 2 + 4);
    return per * probes_.size();
  }
  uint64_t extra_resident_bytes() const override {
    uint64_t r = 0;
    for (const auto& p : probes_) r += p.data.size();
    return r;
  }

  // State: u64 count, then per probe: u64 position and its buffer.
  void export_state(std::vector<uint8_t>& out) const override {
    if (probes_.empty()) return;
    auto put64 = [&](uint64_t x) {
      for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(x >> (8 * i)));
    };
    put64(probes_.size());
    for (const auto& p : probes_) {
      put64(static_cast<uint64_t>(p.pos));
      out.insert(out.end(), p.data.data(), p.data.data() + p.data.size());
    }
  }
  Status import_state(const uint8_t* data, size_t size, int64_t B, int64_t offset,
                      bool commit) override {
    std::deque<Probe> probes;
    if (size > 0) {
      const int64_t Hq = shape().n_q_heads, D = shape().head_dim;
      const size_t qbytes = static_cast<size_t>(B * Hq * D) * 2,
                   per = qbytes + static_cast<size_t>(B * Hq) * 4;
      auto get64 = [&](size_t at) {
        uint64_t x = 0;
        for (int i = 0; i < 8; ++i) x |= static_cast<uint64_t>(data[at + i]) << (8 * i);
        return x;
      };
      if (size < 8) return corrupt("zipcache state: truncated");
      const uint64_t n = get64(0);
      // No probes is stored as an empty chunk (what export_state writes), so that every accepted
      // state re-exports to the same bytes.
      if (n == 0)
        return corrupt("zipcache state: a probe count of 0 must be stored as an empty chunk");
      if (n > static_cast<uint64_t>(offset) || (size - 8) != n * (8 + per))
        return corrupt("zipcache state: " + std::to_string(n) + " probes do not fit " +
                       std::to_string(size) + " bytes");
      int64_t prev = -1;
      for (uint64_t i = 0; i < n; ++i) {
        const size_t at = 8 + i * (8 + per);
        const int64_t pos = static_cast<int64_t>(get64(at));
        if (pos <= prev || pos >= offset || !is_probe(pos))
          return corrupt("zipcache state: probe position " + std::to_string(pos) +
                         " is not a valid probe");
        prev = pos;
        Probe p{pos, Buffer(per)};
        std::memcpy(p.data.data(), data + at + 8, per);
        for (size_t j = 0; j < per / 2; ++j) {
          uint16_t hbits;
          std::memcpy(&hbits, p.data.data() + 2 * j, 2);
          if (j < qbytes / 2 && !std::isfinite(f16_to_f32(hbits)))
            return corrupt("zipcache state: non-finite query");
        }
        for (size_t j = 0; j < static_cast<size_t>(B * Hq); ++j) {
          float x;
          std::memcpy(&x, p.data.data() + qbytes + 4 * j, 4);
          if (!std::isfinite(x)) return corrupt("zipcache state: non-finite log-sum-exp");
        }
        probes.push_back(std::move(p));
      }
    }
    if (commit) {
      probes_ = std::move(probes);
      batch_ = B;
    }
    return ok_status();
  }

 private:
  ZipConfig c_;
  std::deque<Probe> probes_;
  int64_t batch_ = 0;  // of the probes held
  // Per-append scratch in the append's workspace: per stream [append_end, D] keys as the model
  // sees them, rows [0, mirrored_) valid (sealed, dequantized).
  float* mirror_ = nullptr;
  int64_t mirror_stride_ = 0;
  int64_t mirrored_ = 0;
  int64_t by_attn_ = 0, by_norm_ = 0, fallback_ = 0;
};

Status validate(const Spec& s) {
  return validate_zip_params(static_cast<int>(s.get_int("hi_bits")),
                             static_cast<int>(s.get_int("lo_bits")), s.get_float("frac"),
                             s.get_int("group"));
}

}  // namespace

MethodDef make_zipcache_method() {
  MethodDef m;
  m.id = 4;
  m.name = "zipcache";
  // Budget: 0.4 * 4^(2 - bits) relative squared error, the rate of uniform quantization.
  m.bit_ladder = {{"group=64,lo_bits=2,hi_bits=4", 2, 0.4},
                  {"group=64,lo_bits=3,hi_bits=5", 3, 0.1},
                  {"group=64,lo_bits=4,hi_bits=6", 4, 0.025},
                  {"group=64,lo_bits=8,hi_bits=8", 8, 1e-4}};
  m.test_settings = "group=4,residual=8";
  m.summary = "ZipCache: salient tokens (normalized attention) at hi bits, the rest at lo bits";
  m.params = {
      {"hi_bits", ParamType::kInt, 4, 1, 8, {}, "bits for salient tokens"},
      {"lo_bits", ParamType::kInt, 2, 1, 8, {}, "bits for the other tokens (<= hi_bits)"},
      {"frac",
       ParamType::kFloat,
       0.4,
       0,
       1,
       {},
       "fraction of each block's tokens that are salient"},
      {"group",
       ParamType::kInt,
       64,
       1,
       4096,
       {},
       "tokens per block: key groups and saliency decisions"},
      {"v_group",
       ParamType::kInt,
       64,
       1,
       4096,
       {},
       "channels per value group (capped at head_dim)"},
      {"residual", ParamType::kInt, 128, 0, 1 << 20, {}, "newest tokens kept in fp16"},
      {"saliency",
       ParamType::kEnum,
       1,
       0,
       0,
       {"norm", "attn"},
       "token ranking: key norm or normalized attention"},
      {"values",
       ParamType::kEnum,
       2,
       0,
       0,
       {"uniform", "routed", "cst"},
       "values: all at hi bits, routed by saliency, or channel-separable token-wise (routed)"},
      {"probe",
       ParamType::kFloat,
       0.1,
       0,
       1,
       {},
       "fraction of positions whose query is a saliency probe"},
      {"kparams",
       ParamType::kEnum,
       0,
       0,
       0,
       {"split", "shared"},
       "key scale/zero per channel: one pair per subset (hi, lo) or one shared pair per block"},
  };
  m.build = build_each_layer<ZipCodec>;
  m.validate = validate;
  return m;
}

}  // namespace kvq
