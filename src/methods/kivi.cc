// KIVI (Liu et al., ICML 2024, arXiv 2402.02750): keys quantized per channel over groups of G
// tokens (keys have outlier channels), values per token over runs of G channels, the newest R
// tokens kept in fp16. kvq's yardstick: every other method is compared with it at matched bits.
//
// All-in bits per element once sealed (fp16 scale + zero = 32 bits per group):
//   keys   k_bits + 32 / G        values   v_bits + 32 / min(G, D)   (D = head_dim)
// plus the fp16 window (R to R + G - 1 tokens, whole pages of G tokens) at 16 bits.
#include <cstring>
#include <vector>

#include "cache/block_cache.h"
#include "kvq/bitpack.h"
#include "kvq/group_quant.h"
#include "methods/methods.h"

namespace kvq {

namespace {

// Layout of one block's buffer (S = B * H streams, T = G tokens):
//   key codes    S x packed_size(T*D, k_bits)   stream-major, token-major inside
//   value codes  S x packed_size(T*D, v_bits)
//   key params   S x D x {scale, zero} fp16
//   value params S x T x ceil(D/G) x {scale, zero} fp16
class KiviBlock final : public SealedBlock {
 public:
  KiviBlock(const BlockGeometry& g, int k_bits, int v_bits, int64_t vgroup, const float* k,
            const float* v)
      : KiviBlock(g, k_bits, v_bits, vgroup) {
    const int64_t S = g_.batch * g_.heads, T = g_.tokens, D = g_.dim;
    std::vector<uint8_t> codes(static_cast<size_t>(T * D));
    std::vector<QuantParams> kp(static_cast<size_t>(D)),
        vp(static_cast<size_t>(T * n_channel_groups(D, vgroup_)));
    for (int64_t s = 0; s < S; ++s) {
      quantize_per_channel(k + s * T * D, T, D, D, k_bits_, codes.data(), kp.data());
      pack_bits(codes.data(), codes.size(), k_bits_, key_codes(s));
      std::memcpy(key_params(s), kp.data(), kp.size() * sizeof(QuantParams));
      quantize_per_token(v + s * T * D, T, D, D, vgroup_, v_bits_, codes.data(), vp.data());
      pack_bits(codes.data(), codes.size(), v_bits_, value_codes(s));
      std::memcpy(value_params(s), vp.data(), vp.size() * sizeof(QuantParams));
    }
  }

  // Rebuilds a block from serialized parts: keys = [key codes][key params] and
  // values = [value codes][value params], each region stream-major as in the buffer layout.
  static Result<std::unique_ptr<SealedBlock>> from_parts(const BlockGeometry& g, int k_bits,
                                                         int v_bits, int64_t vgroup,
                                                         const ChunkRef& k, const ChunkRef& v) {
    // Sizes are checked before the block is allocated, so a damaged file cannot make us
    // allocate what its claimed geometry would need.
    const size_t S = static_cast<size_t>(g.batch * g.heads),
                 n = static_cast<size_t>(g.stream_elems());
    const size_t kc = S * packed_size(n, k_bits),
                 kp = S * static_cast<size_t>(g.dim) * sizeof(QuantParams);
    const size_t vc = S * packed_size(n, v_bits),
                 vp = S * static_cast<size_t>(g.tokens * n_channel_groups(g.dim, vgroup)) *
                      sizeof(QuantParams);
    if (k.size != kc + kp || v.size != vc + vp)
      return corrupt("kivi block needs " + std::to_string(kc + kp) + " key and " +
                     std::to_string(vc + vp) + " value bytes, got " + std::to_string(k.size) +
                     " and " + std::to_string(v.size));
    std::unique_ptr<KiviBlock> blk(new KiviBlock(g, k_bits, v_bits, vgroup));
    KVQ_RETURN_IF_ERROR(check_padding(k.data, S, blk->kcode_bytes(), g.stream_elems(), k_bits));
    KVQ_RETURN_IF_ERROR(check_padding(v.data, S, blk->vcode_bytes(), g.stream_elems(), v_bits));
    KVQ_RETURN_IF_ERROR(validate_quant_params(k.data + kc, kp / 4, "kivi key params"));
    KVQ_RETURN_IF_ERROR(validate_quant_params(v.data + vc, vp / 4, "kivi value params"));
    std::memcpy(blk->at(0), k.data, kc);
    std::memcpy(blk->at(blk->vc_off(0)), v.data, vc);
    std::memcpy(blk->at(blk->kp_off(0)), k.data + kc, kp);
    std::memcpy(blk->at(blk->vp_off(0)), v.data + vc, vp);
    return std::unique_ptr<SealedBlock>(std::move(blk));
  }

  void serialize(bool keys, std::vector<uint8_t>& out) const override {
    const size_t S = streams();
    if (keys) {
      out.insert(out.end(), at(kc_off(0)), at(kc_off(0)) + S * kcode_bytes());
      out.insert(out.end(), at(kp_off(0)), at(kp_off(0)) + S * kparam_bytes());
    } else {
      out.insert(out.end(), at(vc_off(0)), at(vc_off(0)) + S * vcode_bytes());
      out.insert(out.end(), at(vp_off(0)), at(vp_off(0)) + S * vparam_bytes());
    }
  }

  void dequant_keys(int64_t b, int64_t h, float* out) const override {
    const int64_t s = b * g_.heads + h, n = g_.stream_elems();
    thread_local std::vector<uint8_t> codes;
    codes.resize(static_cast<size_t>(n));
    unpack_bits(key_codes(s), static_cast<size_t>(n), k_bits_, codes.data());
    dequantize_per_channel(codes.data(), g_.tokens, g_.dim,
                           reinterpret_cast<const QuantParams*>(key_params(s)), out);
  }
  void dequant_values(int64_t b, int64_t h, float* out) const override {
    const int64_t s = b * g_.heads + h, n = g_.stream_elems();
    thread_local std::vector<uint8_t> codes;
    codes.resize(static_cast<size_t>(n));
    unpack_bits(value_codes(s), static_cast<size_t>(n), v_bits_, codes.data());
    dequantize_per_token(codes.data(), g_.tokens, g_.dim, vgroup_,
                         reinterpret_cast<const QuantParams*>(value_params(s)), out);
  }

  // Unused high bits of each stream's last code byte must be zero (so a block serializes to
  // exactly one byte string).
  static Status check_padding(const uint8_t* codes, size_t streams, size_t stream_bytes, int64_t n,
                              int bits) {
    const size_t used_bits = static_cast<size_t>(n) * static_cast<size_t>(bits);
    if (used_bits % 8 == 0) return ok_status();
    const uint8_t mask = static_cast<uint8_t>(0xFF << (used_bits % 8));
    for (size_t s = 0; s < streams; ++s)
      if (codes[(s + 1) * stream_bytes - 1] & mask)
        return corrupt("non-zero padding bits in packed codes");
    return ok_status();
  }

  CacheBytes bytes() const override {
    const uint64_t S = static_cast<uint64_t>(g_.batch * g_.heads);
    CacheBytes c;
    c.key_codes = S * kcode_bytes();
    c.value_codes = S * vcode_bytes();
    c.params = S * (kparam_bytes() + vparam_bytes());
    return c;
  }
  uint64_t resident_bytes() const override { return buf_.size(); }
  std::unique_ptr<SealedBlock> clone(CloneMemo&) const override {
    return std::make_unique<KiviBlock>(*this);
  }

 private:
  KiviBlock(const BlockGeometry& g, int k_bits, int v_bits, int64_t vgroup)
      : g_(g), k_bits_(k_bits), v_bits_(v_bits), vgroup_(vgroup), buf_(layout_total()) {}

  size_t kcode_bytes() const {
    return packed_size(static_cast<size_t>(g_.stream_elems()), k_bits_);
  }
  size_t vcode_bytes() const {
    return packed_size(static_cast<size_t>(g_.stream_elems()), v_bits_);
  }
  size_t kparam_bytes() const { return static_cast<size_t>(g_.dim) * sizeof(QuantParams); }
  size_t vparam_bytes() const {
    return static_cast<size_t>(g_.tokens * n_channel_groups(g_.dim, vgroup_)) * sizeof(QuantParams);
  }
  size_t streams() const { return static_cast<size_t>(g_.batch * g_.heads); }
  size_t layout_total() const {
    return streams() * (kcode_bytes() + vcode_bytes() + kparam_bytes() + vparam_bytes());
  }
  uint8_t* at(size_t off) { return buf_.data() + off; }
  const uint8_t* at(size_t off) const { return buf_.data() + off; }
  size_t kc_off(int64_t s) const { return static_cast<size_t>(s) * kcode_bytes(); }
  size_t vc_off(int64_t s) const {
    return streams() * kcode_bytes() + static_cast<size_t>(s) * vcode_bytes();
  }
  size_t kp_off(int64_t s) const {
    return streams() * (kcode_bytes() + vcode_bytes()) + static_cast<size_t>(s) * kparam_bytes();
  }
  size_t vp_off(int64_t s) const {
    return streams() * (kcode_bytes() + vcode_bytes() + kparam_bytes()) +
           static_cast<size_t>(s) * vparam_bytes();
  }
  uint8_t* key_codes(int64_t s) { return at(kc_off(s)); }
  const uint8_t* key_codes(int64_t s) const { return at(kc_off(s)); }
  uint8_t* value_codes(int64_t s) { return at(vc_off(s)); }
  const uint8_t* value_codes(int64_t s) const { return at(vc_off(s)); }
  uint8_t* key_params(int64_t s) { return at(kp_off(s)); }
  const uint8_t* key_params(int64_t s) const { return at(kp_off(s)); }
  uint8_t* value_params(int64_t s) { return at(vp_off(s)); }
  const uint8_t* value_params(int64_t s) const { return at(vp_off(s)); }

  BlockGeometry g_;
  int k_bits_, v_bits_;
  int64_t vgroup_;
  Buffer buf_;
};

class KiviLayer final : public BlockLayerCache {
 public:
  KiviLayer(const Spec& spec, const LayerShape& shape)
      : BlockLayerCache(spec, shape, spec.get_int("group"),
                        window_page_tokens(spec.get_int("group")), spec.get_int("residual")),
        k_bits_(static_cast<int>(spec.get_int("k_bits"))),
        v_bits_(static_cast<int>(spec.get_int("v_bits"))),
        group_(spec.get_int("group")) {}
  KiviLayer(const KiviLayer& o, CloneMemo& memo)
      : BlockLayerCache(o, memo), k_bits_(o.k_bits_), v_bits_(o.v_bits_), group_(o.group_) {}
  std::unique_ptr<LayerCache> clone(CloneMemo& memo) const override {
    return std::unique_ptr<LayerCache>(new KiviLayer(*this, memo));
  }

 protected:
  std::unique_ptr<SealedBlock> seal(int64_t, const float* k, const float* v) override {
    return std::make_unique<KiviBlock>(geometry(), k_bits_, v_bits_, group_, k, v);
  }
  Result<std::unique_ptr<SealedBlock>> deserialize_block(int64_t, const BlockGeometry& g,
                                                         const ChunkRef& k,
                                                         const ChunkRef& v) const override {
    return KiviBlock::from_parts(g, k_bits_, v_bits_, group_, k, v);
  }

 private:
  int k_bits_, v_bits_;
  int64_t group_;
};

}  // namespace

MethodDef make_kivi_method() {
  MethodDef m;
  m.name = "kivi";
  m.summary = "KIVI: keys per-channel, values per-token group quantization, fp16 residual window";
  m.params = {
      {"k_bits", ParamType::kInt, 2, 1, 8, {}, "bits per key code"},
      {"v_bits", ParamType::kInt, 2, 1, 8, {}, "bits per value code"},
      {"group",
       ParamType::kInt,
       32,
       1,
       4096,
       {},
       "tokens per key group (one scale/zero per channel) and channels per value group"},
      {"residual", ParamType::kInt, 128, 0, 1 << 20, {}, "newest tokens kept in fp16"},
  };
  m.build = build_each_layer<KiviLayer>;
  return m;
}

}  // namespace kvq
