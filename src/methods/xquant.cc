// XQuant (Yang et al., EMNLP 2025, arXiv 2510.11236): cross-layer sharing of quantized codes.
// Layers are grouped; the first layer of a group (the anchor) quantizes its keys and values like
// KIVI (keys per channel over G tokens, values per token over runs of G channels) and keeps the
// packed codes once. Every other layer of the group (a reuse layer) stores no codes of its own:
// it reads the anchor's codes for the same tokens and keeps only its own (scale, zero) per group,
// fit to its own data (least squares on the shared codes, or the seed's min/max), plus an
// optional low-bit residual. The paper's data-free calibration (eta) pulls the anchors' min/max
// reconstruction levels inward. docs/methods/xquant.md has the measurements (on SmolLM2-135M the
// codes of different layers agree no more than chance, so reuse does not pay there) and the
// deviations from the paper and from the seed implementation.
//
// Sharing. An anchor's sealed block holds a shared, immutable XqCodes object (its packed K and V
// codes). A reuse layer's block for the same token range holds a shared_ptr to that object, so
// the codes live until the last block that reads them is gone ("free after the last reader").
// The layers of a group meet through an XqLink created by the per-model builder: the anchor
// registers itself there and reuse layers fetch "anchor block i" through it. Clones map codes and
// links through the CloneMemo, so a cloned model shares codes exactly as the original does and
// nothing is shared between two models.
//
// Billing (every byte, once). An anchor block bills its codes and parameters; a reuse block bills
// its parameters and residual codes, never the shared codes. Codes that a reuse layer still holds
// after the anchor dropped them (only possible when one layer is trimmed, reset or imported on its
// own; ModelCache trims and resets from the last layer down, so reuse layers let go first) are
// billed as meta by the anchor layer (or, when the anchor is gone, by the lowest reuse layer of
// the group), so resident == accounted holds for the whole model in every state.
//
// All-in bits per element once sealed, with q = 32 bits of fp16 (scale, zero) per group,
// Gk = G tokens per key group, Gv = min(G, D) channels per value group:
//   anchor  keys  k_bits + q/Gk              values  v_bits + q/Gv
//   reuse   keys  q/Gk (+ r + q/Gk)          values  q/Gv (+ r + q/Gv)      (r = res_bits > 0)
// A stride group of L layers (one anchor, L - 1 reuse layers) averages
//   [k_bits + v_bits + L * (q/Gk + q/Gv) + (L - 1) * (r > 0) * (2 r + q/Gk + q/Gv)] / (2 L)
// plus the fp16 window (R to R + G - 1 tokens at 16 bits, whole pages of G tokens).
//
// Stored layout of one block (S = B * H streams, T = G tokens, ng = ceil(D / G)):
//   anchor keys    S x packed(T*D, k_bits) key codes, then S x D (scale, zero) fp16 pairs
//   anchor values  S x packed(T*D, v_bits) value codes, then S x T x ng pairs
//                  (the kivi layout; codes packed as bitpack.h, padding bits zero)
//   reuse keys     u64 XXH64 of the anchor block's code bytes (its K then V code regions, seed 0)
//                  S x D pairs; if res_bits > 0: S x packed(T*D, r) residual codes, S x D pairs
//   reuse values   S x T x ng pairs; if res_bits > 0: S x packed(T*D, r) codes, S x T x ng pairs
// Pairs are (scale, zero) fp16 little-endian, x' = zero + code * scale; a reuse or least-squares
// scale may be zero or negative. The hash ties a reuse block to the exact anchor codes it was fit
// to: importing it against other codes is kCorrupt (it costs 8 bytes per block in the file only).
#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <unordered_map>
#include <vector>

#include "cache/block_cache.h"
#include "kvq/bitpack.h"
#include "kvq/dtype.h"
#include "kvq/group_quant.h"
#include "methods/methods.h"
#include "numerics/xquant_fit.h"

namespace kvq {

namespace {

constexpr size_t kPairBytes = sizeof(QuantParams);  // fp16 scale + fp16 zero
enum class Fit { kMinMax, kLsq };

// Sizes of one stream's parts for a block geometry.
struct Parts {
  BlockGeometry g;
  int64_t vgroup;
  size_t streams() const { return static_cast<size_t>(g.batch * g.heads); }
  size_t codes(int bits) const { return packed_size(static_cast<size_t>(g.stream_elems()), bits); }
  size_t kparams() const { return static_cast<size_t>(g.dim) * kPairBytes; }
  size_t vparams() const {
    return static_cast<size_t>(g.tokens * n_channel_groups(g.dim, vgroup)) * kPairBytes;
  }
};

// Unused high bits of each stream's last code byte must be zero, so a block serializes to
// exactly one byte string.
Status check_padding(const uint8_t* codes, size_t streams, size_t stream_bytes, int64_t n, int bits,
                     const char* what) {
  const size_t used_bits = static_cast<size_t>(n) * static_cast<size_t>(bits);
  if (used_bits % 8 == 0) return ok_status();
  const uint8_t mask = static_cast<uint8_t>(0xFF << (used_bits % 8));
  for (size_t s = 0; s < streams; ++s)
    if (codes[(s + 1) * stream_bytes - 1] & mask)
      return corrupt(std::string("non-zero padding bits in ") + what);
  return ok_status();
}

// Stored pairs must be finite (a least-squares or reuse scale may be zero or negative).
Status check_pairs(const uint8_t* p, size_t n_pairs, const char* what) {
  for (size_t i = 0; i < n_pairs; ++i) {
    uint16_t sc, ze;
    std::memcpy(&sc, p + 4 * i, 2);
    std::memcpy(&ze, p + 4 * i + 2, 2);
    if (!std::isfinite(f16_to_f32(sc)) || !std::isfinite(f16_to_f32(ze)))
      return corrupt(std::string(what) + ": parameter pair " + std::to_string(i) +
                     " is not finite");
  }
  return ok_status();
}

// ---------------------------------------------------------------------------------------------
// One anchor block's packed codes: [S x packed(T*D, k_bits)] then [S x packed(T*D, v_bits)].
// Immutable once sealed; shared by the anchor block and the reuse blocks of the same tokens.
class XqCodes {
 public:
  XqCodes(const BlockGeometry& g, int64_t index, int k_bits, int v_bits)
      : g_(g),
        index_(index),
        k_bits_(k_bits),
        v_bits_(v_bits),
        buf_(streams() * (kbytes() + vbytes())) {}

  const BlockGeometry& geometry() const { return g_; }
  int64_t index() const { return index_; }
  int k_bits() const { return k_bits_; }
  int v_bits() const { return v_bits_; }
  size_t streams() const { return static_cast<size_t>(g_.batch * g_.heads); }
  size_t kbytes() const { return packed_size(static_cast<size_t>(g_.stream_elems()), k_bits_); }
  size_t vbytes() const { return packed_size(static_cast<size_t>(g_.stream_elems()), v_bits_); }
  uint64_t accounted_keys() const { return streams() * kbytes(); }
  uint64_t accounted_values() const { return streams() * vbytes(); }
  uint64_t resident() const { return buf_.size(); }

  uint8_t* keys(size_t s) { return buf_.data() + s * kbytes(); }
  const uint8_t* keys(size_t s) const { return buf_.data() + s * kbytes(); }
  uint8_t* values(size_t s) { return buf_.data() + streams() * kbytes() + s * vbytes(); }
  const uint8_t* values(size_t s) const {
    return buf_.data() + streams() * kbytes() + s * vbytes();
  }
  const uint8_t* data() const { return buf_.data(); }
  uint8_t* data() { return buf_.data(); }
  size_t size() const { return buf_.size(); }

  void unpack_keys(size_t s, uint8_t* out) const {
    unpack_bits(keys(s), static_cast<size_t>(g_.stream_elems()), k_bits_, out);
  }
  void unpack_values(size_t s, uint8_t* out) const {
    unpack_bits(values(s), static_cast<size_t>(g_.stream_elems()), v_bits_, out);
  }
  uint64_t hash() const { return XXH64(buf_.data(), buf_.size(), 0); }

 private:
  BlockGeometry g_;
  int64_t index_;
  int k_bits_, v_bits_;
  Buffer buf_;
};

// Copies a shared object once per memo, so every holder of the original holds the same copy.
template <class T>
std::shared_ptr<T> memo_copy(const T* p, CloneMemo& memo) {
  auto [it, inserted] = memo.copies.try_emplace(p);
  if (inserted) it->second = std::make_shared<T>(*p);
  return std::static_pointer_cast<T>(it->second);
}

// ---------------------------------------------------------------------------------------------
// Anchor block: the shared codes (billed here) and the anchor's own parameters
// [S x D pairs (keys)][S x T x ng pairs (values)].
class AnchorBlock final : public SealedBlock {
 public:
  AnchorBlock(const Parts& p, std::shared_ptr<XqCodes> codes)
      : p_(p), codes_(std::move(codes)), params_(p_.streams() * (p_.kparams() + p_.vparams())) {}

  const std::shared_ptr<XqCodes>& codes() const { return codes_; }
  uint8_t* kparams(size_t s) { return params_.data() + s * p_.kparams(); }
  const uint8_t* kparams(size_t s) const { return params_.data() + s * p_.kparams(); }
  uint8_t* vparams(size_t s) {
    return params_.data() + p_.streams() * p_.kparams() + s * p_.vparams();
  }
  const uint8_t* vparams(size_t s) const {
    return params_.data() + p_.streams() * p_.kparams() + s * p_.vparams();
  }

  void dequant_keys(int64_t b, int64_t h, float* out) const override {
    const size_t s = static_cast<size_t>(b * p_.g.heads + h);
    thread_local std::vector<uint8_t> c;
    c.resize(static_cast<size_t>(p_.g.stream_elems()));
    codes_->unpack_keys(s, c.data());
    dequantize_per_channel(c.data(), p_.g.tokens, p_.g.dim,
                           reinterpret_cast<const QuantParams*>(kparams(s)), out);
  }
  void dequant_values(int64_t b, int64_t h, float* out) const override {
    const size_t s = static_cast<size_t>(b * p_.g.heads + h);
    thread_local std::vector<uint8_t> c;
    c.resize(static_cast<size_t>(p_.g.stream_elems()));
    codes_->unpack_values(s, c.data());
    dequantize_per_token(c.data(), p_.g.tokens, p_.g.dim, p_.vgroup,
                         reinterpret_cast<const QuantParams*>(vparams(s)), out);
  }
  CacheBytes bytes() const override {
    CacheBytes c;
    c.key_codes = codes_->accounted_keys();
    c.value_codes = codes_->accounted_values();
    c.params = p_.streams() * (p_.kparams() + p_.vparams());
    return c;
  }
  uint64_t resident_bytes() const override { return codes_->resident() + params_.size(); }
  std::unique_ptr<SealedBlock> clone(CloneMemo& memo) const override {
    auto blk = std::make_unique<AnchorBlock>(p_, memo_copy(codes_.get(), memo));
    blk->params_ = params_;
    return blk;
  }
  void serialize(bool keys, std::vector<uint8_t>& out) const override {
    const size_t S = p_.streams();
    if (keys) {
      out.insert(out.end(), codes_->keys(0), codes_->keys(0) + S * codes_->kbytes());
      out.insert(out.end(), kparams(0), kparams(0) + S * p_.kparams());
    } else {
      out.insert(out.end(), codes_->values(0), codes_->values(0) + S * codes_->vbytes());
      out.insert(out.end(), vparams(0), vparams(0) + S * p_.vparams());
    }
  }

  static Result<std::unique_ptr<SealedBlock>> from_parts(const Parts& p, int64_t index, int k_bits,
                                                         int v_bits, const ChunkRef& k,
                                                         const ChunkRef& v) {
    auto codes = std::make_shared<XqCodes>(p.g, index, k_bits, v_bits);
    const size_t S = p.streams();
    const size_t kc = S * codes->kbytes(), kp = S * p.kparams();
    const size_t vc = S * codes->vbytes(), vp = S * p.vparams();
    if (k.size != kc + kp || v.size != vc + vp)
      return corrupt("xquant anchor block needs " + std::to_string(kc + kp) + " key and " +
                     std::to_string(vc + vp) + " value bytes, got " + std::to_string(k.size) +
                     " and " + std::to_string(v.size));
    KVQ_RETURN_IF_ERROR(
        check_padding(k.data, S, codes->kbytes(), p.g.stream_elems(), k_bits, "key codes"));
    KVQ_RETURN_IF_ERROR(
        check_padding(v.data, S, codes->vbytes(), p.g.stream_elems(), v_bits, "value codes"));
    KVQ_RETURN_IF_ERROR(check_pairs(k.data + kc, kp / kPairBytes, "xquant anchor key params"));
    KVQ_RETURN_IF_ERROR(check_pairs(v.data + vc, vp / kPairBytes, "xquant anchor value params"));
    std::memcpy(codes->keys(0), k.data, kc);
    std::memcpy(codes->values(0), v.data, vc);
    auto blk = std::make_unique<AnchorBlock>(p, std::move(codes));
    std::memcpy(blk->kparams(0), k.data + kc, kp);
    std::memcpy(blk->vparams(0), v.data + vc, vp);
    return std::unique_ptr<SealedBlock>(std::move(blk));
  }

 private:
  Parts p_;
  std::shared_ptr<XqCodes> codes_;
  Buffer params_;
};

// ---------------------------------------------------------------------------------------------
// Reuse block: the anchor's codes (not billed here) and this layer's own data, one buffer laid
// out exactly as serialized (without the hash):
//   keys part    [S x D pairs] and, when r > 0, [S x packed(T*D, r)] [S x D pairs]
//   values part  [S x T x ng pairs] and, when r > 0, [S x packed(T*D, r)] [S x T x ng pairs]
class ReuseBlock final : public SealedBlock {
 public:
  ReuseBlock(const Parts& p, std::shared_ptr<const XqCodes> codes, int res_bits)
      : p_(p), codes_(std::move(codes)), r_(res_bits), own_(key_part() + value_part()) {}

  const std::shared_ptr<const XqCodes>& codes() const { return codes_; }
  size_t key_part() const {
    return p_.streams() * (p_.kparams() + (r_ ? p_.codes(r_) + p_.kparams() : 0));
  }
  size_t value_part() const {
    return p_.streams() * (p_.vparams() + (r_ ? p_.codes(r_) + p_.vparams() : 0));
  }
  // Regions, stream s.
  uint8_t* kp(size_t s) { return own_.data() + s * p_.kparams(); }
  const uint8_t* kp(size_t s) const { return own_.data() + s * p_.kparams(); }
  size_t krc_off(size_t s) const { return p_.streams() * p_.kparams() + s * p_.codes(r_); }
  size_t krp_off(size_t s) const {
    return p_.streams() * (p_.kparams() + p_.codes(r_)) + s * p_.kparams();
  }
  size_t vp_off(size_t s) const { return key_part() + s * p_.vparams(); }
  size_t vrc_off(size_t s) const {
    return key_part() + p_.streams() * p_.vparams() + s * p_.codes(r_);
  }
  size_t vrp_off(size_t s) const {
    return key_part() + p_.streams() * (p_.vparams() + p_.codes(r_)) + s * p_.vparams();
  }
  uint8_t* at(size_t off) { return own_.data() + off; }
  const uint8_t* at(size_t off) const { return own_.data() + off; }

  void dequant_keys(int64_t b, int64_t h, float* out) const override {
    const size_t s = static_cast<size_t>(b * p_.g.heads + h);
    const int64_t T = p_.g.tokens, D = p_.g.dim;
    thread_local std::vector<uint8_t> c;
    c.resize(static_cast<size_t>(T * D));
    codes_->unpack_keys(s, c.data());
    dequantize_per_channel(c.data(), T, D, reinterpret_cast<const QuantParams*>(kp(s)), out);
    if (r_) {
      thread_local std::vector<float> res;
      res.resize(c.size());
      unpack_bits(at(krc_off(s)), c.size(), r_, c.data());
      dequantize_per_channel(c.data(), T, D, reinterpret_cast<const QuantParams*>(at(krp_off(s))),
                             res.data());
      for (size_t i = 0; i < c.size(); ++i) out[i] += res[i];
    }
  }
  void dequant_values(int64_t b, int64_t h, float* out) const override {
    const size_t s = static_cast<size_t>(b * p_.g.heads + h);
    const int64_t T = p_.g.tokens, D = p_.g.dim;
    thread_local std::vector<uint8_t> c;
    c.resize(static_cast<size_t>(T * D));
    codes_->unpack_values(s, c.data());
    dequantize_per_token(c.data(), T, D, p_.vgroup,
                         reinterpret_cast<const QuantParams*>(at(vp_off(s))), out);
    if (r_) {
      thread_local std::vector<float> res;
      res.resize(c.size());
      unpack_bits(at(vrc_off(s)), c.size(), r_, c.data());
      dequantize_per_token(c.data(), T, D, p_.vgroup,
                           reinterpret_cast<const QuantParams*>(at(vrp_off(s))), res.data());
      for (size_t i = 0; i < c.size(); ++i) out[i] += res[i];
    }
  }
  CacheBytes bytes() const override {
    const uint64_t S = p_.streams();
    CacheBytes c;
    c.params = S * (p_.kparams() + p_.vparams());
    if (r_) {
      c.key_codes = S * p_.codes(r_);
      c.value_codes = S * p_.codes(r_);
      c.params += S * (p_.kparams() + p_.vparams());
    }
    return c;
  }
  uint64_t resident_bytes() const override { return own_.size(); }
  std::unique_ptr<SealedBlock> clone(CloneMemo& memo) const override {
    auto blk = std::make_unique<ReuseBlock>(p_, memo_copy(codes_.get(), memo), r_);
    blk->own_ = own_;
    return blk;
  }
  void serialize(bool keys, std::vector<uint8_t>& out) const override {
    if (keys) {
      const uint64_t h = codes_->hash();
      for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(h >> (8 * i)));
      out.insert(out.end(), at(0), at(0) + key_part());
    } else {
      out.insert(out.end(), at(key_part()), at(key_part()) + value_part());
    }
  }

  static Result<std::unique_ptr<SealedBlock>> from_parts(const Parts& p, int res_bits,
                                                         std::shared_ptr<const XqCodes> codes,
                                                         const ChunkRef& k, const ChunkRef& v) {
    auto blk = std::make_unique<ReuseBlock>(p, std::move(codes), res_bits);
    const size_t S = p.streams();
    if (k.size != 8 + blk->key_part() || v.size != blk->value_part())
      return corrupt("xquant reuse block needs " + std::to_string(8 + blk->key_part()) +
                     " key and " + std::to_string(blk->value_part()) + " value bytes, got " +
                     std::to_string(k.size) + " and " + std::to_string(v.size));
    uint64_t h = 0;
    for (int i = 0; i < 8; ++i) h |= static_cast<uint64_t>(k.data[i]) << (8 * i);
    if (h != blk->codes_->hash())
      return corrupt(
          "xquant reuse block was fit to anchor codes other than those the anchor layer "
          "holds for its tokens (import the anchor layer's matching state first)");
    const uint8_t* kd = k.data + 8;
    KVQ_RETURN_IF_ERROR(check_pairs(kd, S * p.kparams() / kPairBytes, "xquant reuse key params"));
    KVQ_RETURN_IF_ERROR(
        check_pairs(v.data, S * p.vparams() / kPairBytes, "xquant reuse value params"));
    if (res_bits) {
      KVQ_RETURN_IF_ERROR(check_padding(kd + blk->krc_off(0), S, p.codes(res_bits),
                                        p.g.stream_elems(), res_bits, "residual key codes"));
      KVQ_RETURN_IF_ERROR(check_pairs(kd + blk->krp_off(0), S * p.kparams() / kPairBytes,
                                      "xquant residual key params"));
      // The value part starts at key_part() in the block's buffer.
      KVQ_RETURN_IF_ERROR(check_padding(v.data + (blk->vrc_off(0) - blk->key_part()), S,
                                        p.codes(res_bits), p.g.stream_elems(), res_bits,
                                        "residual value codes"));
      KVQ_RETURN_IF_ERROR(check_pairs(v.data + (blk->vrp_off(0) - blk->key_part()),
                                      S * p.vparams() / kPairBytes,
                                      "xquant residual value params"));
    }
    std::memcpy(blk->at(0), kd, blk->key_part());
    std::memcpy(blk->at(blk->key_part()), v.data, blk->value_part());
    return std::unique_ptr<SealedBlock>(std::move(blk));
  }

 private:
  Parts p_;
  std::shared_ptr<const XqCodes> codes_;
  int r_;
  Buffer own_;
};

// ---------------------------------------------------------------------------------------------
class XQuantLayer;

// Where the layers of one group meet. Holds raw pointers to the layers that are alive (they
// register on construction and deregister on destruction) and a registry of the codes handed to
// reuse layers, to bill codes the anchor no longer holds.
struct XqLink {
  XQuantLayer* anchor = nullptr;
  std::vector<XQuantLayer*> readers;
  std::unordered_map<const XqCodes*, std::weak_ptr<const XqCodes>> handed;

  void hand_out(const std::shared_ptr<const XqCodes>& c) { handed[c.get()] = c; }
  void drop_expired() {
    for (auto it = handed.begin(); it != handed.end();)
      it = it->second.expired() ? handed.erase(it) : std::next(it);
  }
  const XQuantLayer* biller() const;
};

class XQuantLayer final : public BlockLayerCache {
 public:
  XQuantLayer(const Spec& spec, const LayerShape& shape, int index, int anchor,
              std::shared_ptr<XqLink> link)
      : BlockLayerCache(spec, shape, spec.get_int("group"),
                        window_page_tokens(spec.get_int("group")), spec.get_int("residual")),
        index_(index),
        anchor_(anchor),
        k_bits_(static_cast<int>(spec.get_int("k_bits"))),
        v_bits_(static_cast<int>(spec.get_int("v_bits"))),
        r_bits_(static_cast<int>(spec.get_int("res_bits"))),
        group_(spec.get_int("group")),
        fit_(spec.get_enum("fit") == "lsq" ? Fit::kLsq : Fit::kMinMax),
        reuse_fit_(spec.get_enum("reuse_fit") == "lsq" ? Fit::kLsq : Fit::kMinMax),
        eta_(static_cast<float>(spec.get_float("eta"))),
        link_(std::move(link)) {
    attach();
  }
  XQuantLayer(const XQuantLayer& o, CloneMemo& memo)
      : BlockLayerCache(o, memo),
        index_(o.index_),
        anchor_(o.anchor_),
        k_bits_(o.k_bits_),
        v_bits_(o.v_bits_),
        r_bits_(o.r_bits_),
        group_(o.group_),
        fit_(o.fit_),
        reuse_fit_(o.reuse_fit_),
        eta_(o.eta_) {
    // A fresh link per memo: the copies register themselves, nothing points at the original.
    auto [it, inserted] = memo.copies.try_emplace(o.link_.get());
    if (inserted) it->second = std::make_shared<XqLink>();
    link_ = std::static_pointer_cast<XqLink>(it->second);
    attach();
  }
  ~XQuantLayer() override {
    if (link_->anchor == this) link_->anchor = nullptr;
    std::erase(link_->readers, this);
  }
  std::unique_ptr<LayerCache> clone(CloneMemo& memo) const override {
    return std::unique_ptr<LayerCache>(new XQuantLayer(*this, memo));
  }

  int index() const { return index_; }
  bool is_anchor() const { return anchor_ == index_; }

  // The codes of this (anchor) layer's block i, or null.
  std::shared_ptr<const XqCodes> codes_at(int64_t i) const {
    if (i < 0 || i >= n_blocks()) return nullptr;
    return static_cast<const AnchorBlock&>(block(i)).codes();
  }
  bool holds(const XqCodes* c) const { return codes_at(c->index()).get() == c; }

  std::string stats() const override {
    std::string s = "role=" + std::string(is_anchor() ? "anchor" : "reuse") + "\n";
    if (is_anchor())
      s += "readers=" + std::to_string(link_->readers.size()) + "\n";
    else
      s += "anchor=" + std::to_string(anchor_) + "\n";
    s += "orphan_code_bytes=" + std::to_string(orphan_bytes(false)) + "\n";
    return s;
  }

 protected:
  Status precheck_append(int64_t batch, int64_t n_new) const override {
    if (is_anchor()) return ok_status();
    const int64_t T = block_tokens(), R = residual(), end = offset() + n_new;
    const int64_t will_hold = end >= R + T ? (end - R) / T : 0;
    for (int64_t i = n_blocks(); i < will_hold; ++i) {
      const auto c = anchor_codes(i);
      if (!c)
        return invalid_argument("xquant layer " + std::to_string(index_) + " reuses layer " +
                                std::to_string(anchor_) + "'s codes and would seal tokens [" +
                                std::to_string(i * T) + ", " + std::to_string((i + 1) * T) +
                                "), but layer " + std::to_string(anchor_) +
                                (link_->anchor ? "" : " (not part of this model)") +
                                " has not sealed them yet: append to the anchor layer first");
      if (c->geometry().batch != batch)
        return shape_mismatch("xquant layer " + std::to_string(index_) + ": batch size " +
                              std::to_string(batch) + " differs from its anchor layer " +
                              std::to_string(anchor_) + "'s " +
                              std::to_string(c->geometry().batch));
    }
    return ok_status();
  }

  std::unique_ptr<SealedBlock> seal(int64_t index, const float* k, const float* v) override {
    link_->drop_expired();
    const Parts p{geometry(), group_};
    const int64_t T = p.g.tokens, D = p.g.dim, n = T * D;
    const size_t S = p.streams();
    std::vector<uint8_t> c(static_cast<size_t>(n));
    std::vector<QuantParams> kp(static_cast<size_t>(D)), vp(p.vparams() / kPairBytes);
    if (is_anchor()) {
      auto codes = std::make_shared<XqCodes>(p.g, index, k_bits_, v_bits_);
      auto blk = std::make_unique<AnchorBlock>(p, codes);
      for (size_t s = 0; s < S; ++s) {
        const float* ks = k + static_cast<int64_t>(s) * n;
        const float* vs = v + static_cast<int64_t>(s) * n;
        quantize_per_channel(ks, T, D, D, k_bits_, c.data(), kp.data());
        if (fit_ == Fit::kLsq)
          fit_per_channel_to_codes(ks, T, D, c.data(), kp.data());
        else
          calibrate(kp, k_bits_);
        pack_bits(c.data(), c.size(), k_bits_, codes->keys(s));
        std::memcpy(blk->kparams(s), kp.data(), p.kparams());
        quantize_per_token(vs, T, D, D, group_, v_bits_, c.data(), vp.data());
        if (fit_ == Fit::kLsq)
          fit_per_token_to_codes(vs, T, D, group_, c.data(), vp.data());
        else
          calibrate(vp, v_bits_);
        pack_bits(c.data(), c.size(), v_bits_, codes->values(s));
        std::memcpy(blk->vparams(s), vp.data(), p.vparams());
      }
      return blk;
    }
    auto codes = anchor_codes(index);
    KVQ_CHECK(codes && codes->geometry().batch == p.g.batch);  // guaranteed by precheck
    link_->hand_out(codes);
    auto blk = std::make_unique<ReuseBlock>(p, codes, r_bits_);
    std::vector<float> rec(static_cast<size_t>(n)), res(static_cast<size_t>(n));
    std::vector<uint8_t> rc(static_cast<size_t>(n));
    for (size_t s = 0; s < S; ++s) {
      const float* ks = k + static_cast<int64_t>(s) * n;
      const float* vs = v + static_cast<int64_t>(s) * n;
      // Keys: own per-channel params on the anchor's codes, then the optional residual.
      codes->unpack_keys(s, c.data());
      if (reuse_fit_ == Fit::kLsq) {
        fit_per_channel_to_codes(ks, T, D, c.data(), kp.data());
      } else {
        fit_per_channel_minmax(ks, T, D, k_bits_, kp.data());
        calibrate(kp, k_bits_);
      }
      std::memcpy(blk->kp(s), kp.data(), p.kparams());
      if (r_bits_) {
        dequantize_per_channel(c.data(), T, D, kp.data(), rec.data());
        residual_of(ks, rec, res);
        quantize_per_channel(res.data(), T, D, D, r_bits_, rc.data(), kp.data());
        if (reuse_fit_ == Fit::kLsq)
          fit_per_channel_to_codes(res.data(), T, D, rc.data(), kp.data());
        pack_bits(rc.data(), rc.size(), r_bits_, blk->at(blk->krc_off(s)));
        std::memcpy(blk->at(blk->krp_off(s)), kp.data(), p.kparams());
      }
      // Values: own per-token params on the anchor's codes, then the optional residual.
      codes->unpack_values(s, c.data());
      if (reuse_fit_ == Fit::kLsq) {
        fit_per_token_to_codes(vs, T, D, group_, c.data(), vp.data());
      } else {
        fit_per_token_minmax(vs, T, D, group_, v_bits_, vp.data());
        calibrate(vp, v_bits_);
      }
      std::memcpy(blk->at(blk->vp_off(s)), vp.data(), p.vparams());
      if (r_bits_) {
        dequantize_per_token(c.data(), T, D, group_, vp.data(), rec.data());
        residual_of(vs, rec, res);
        quantize_per_token(res.data(), T, D, D, group_, r_bits_, rc.data(), vp.data());
        if (reuse_fit_ == Fit::kLsq)
          fit_per_token_to_codes(res.data(), T, D, group_, rc.data(), vp.data());
        pack_bits(rc.data(), rc.size(), r_bits_, blk->at(blk->vrc_off(s)));
        std::memcpy(blk->at(blk->vrp_off(s)), vp.data(), p.vparams());
      }
    }
    return blk;
  }

  Result<std::unique_ptr<SealedBlock>> deserialize_block(int64_t index, const BlockGeometry& g,
                                                         const ChunkRef& k,
                                                         const ChunkRef& v) const override {
    const Parts p{g, group_};
    if (is_anchor()) return AnchorBlock::from_parts(p, index, k_bits_, v_bits_, k, v);
    auto codes = anchor_codes(index);
    if (!codes)
      return corrupt("xquant reuse layer " + std::to_string(index_) + " needs block " +
                     std::to_string(index) + " of its anchor layer " + std::to_string(anchor_) +
                     ", which does not hold it (import layers in order)");
    const BlockGeometry& a = codes->geometry();
    if (a.batch != g.batch || a.heads != g.heads || a.tokens != g.tokens || a.dim != g.dim)
      return corrupt("xquant reuse layer " + std::to_string(index_) + ": block " +
                     std::to_string(index) + " has batch " + std::to_string(g.batch) +
                     " but its anchor layer " + std::to_string(anchor_) + "'s has batch " +
                     std::to_string(a.batch));
    return ReuseBlock::from_parts(p, r_bits_, std::move(codes), k, v);
  }

  Status import_state(const uint8_t* /*data*/, size_t size, int64_t, int64_t,
                      bool commit) override {
    if (size != 0) return corrupt("unexpected method state for xquant");
    if (commit) {
      // The imported blocks hold codes now: register them (and forget codes no one holds).
      link_->drop_expired();
      if (!is_anchor())
        for (int64_t i = 0; i < n_blocks(); ++i)
          link_->hand_out(static_cast<const ReuseBlock&>(block(i)).codes());
    }
    return ok_status();
  }

  void on_trim(int64_t) override { link_->drop_expired(); }
  void on_reset() override { link_->drop_expired(); }
  uint64_t extra_bytes() const override { return orphan_bytes(false); }
  uint64_t extra_resident_bytes() const override { return orphan_bytes(true); }

 private:
  void attach() {
    if (is_anchor()) {
      link_->anchor = this;
    } else {
      link_->readers.push_back(this);
      for (int64_t i = 0; i < n_blocks(); ++i)
        link_->hand_out(static_cast<const ReuseBlock&>(block(i)).codes());
    }
  }

  std::shared_ptr<const XqCodes> anchor_codes(int64_t i) const {
    return link_->anchor ? link_->anchor->codes_at(i) : nullptr;
  }

  // eta calibrates min/max fits at the anchors' bit widths: anchor parameters (fit=minmax) and
  // reuse parameters (reuse_fit=minmax). Least-squares fits need no calibration.
  void calibrate(std::vector<QuantParams>& params, int bits) const {
    if (eta_ == 0.0f) return;
    for (auto& q : params) q = calibrate_eta(q, bits, eta_);
  }

  // res = x - rec, kept inside the fp16 range the residual's parameters can represent.
  static void residual_of(const float* x, const std::vector<float>& rec, std::vector<float>& res) {
    for (size_t i = 0; i < rec.size(); ++i) res[i] = std::clamp(x[i] - rec[i], -kF16Max, kF16Max);
  }

  // Codes handed to reuse layers that the anchor no longer holds, billed by one layer of the
  // group (accounted from the geometry, or measured from the buffers).
  uint64_t orphan_bytes(bool measured) const {
    if (link_->biller() != this) return 0;
    uint64_t total = 0;
    for (const auto& [ptr, weak] : link_->handed) {
      const auto c = weak.lock();
      if (!c || (link_->anchor && link_->anchor->holds(c.get()))) continue;
      total += measured ? c->resident() : c->accounted_keys() + c->accounted_values();
    }
    return total;
  }

  int index_, anchor_;
  int k_bits_, v_bits_, r_bits_;
  int64_t group_;
  Fit fit_, reuse_fit_;
  float eta_;
  std::shared_ptr<XqLink> link_;
};

const XQuantLayer* XqLink::biller() const {
  if (anchor) return anchor;
  const XQuantLayer* best = nullptr;
  for (const XQuantLayer* r : readers)
    if (!best || r->index() < best->index()) best = r;
  return best;
}

// ---------------------------------------------------------------------------------------------
// The per-model builder: decides every layer's anchor and wires the groups.
Result<std::vector<std::unique_ptr<LayerCache>>> build(const std::vector<Spec>& specs,
                                                       const ModelShape& shape) {
  const int L = shape.n_layers;
  std::vector<int> anchor(static_cast<size_t>(L));
  auto same_shape = [&](int a, int b) {
    return shape.at(a).n_kv_heads == shape.at(b).n_kv_heads &&
           shape.at(a).head_dim == shape.at(b).head_dim;
  };
  for (int i = 0; i < L; ++i) {
    const Spec& s = specs[static_cast<size_t>(i)];
    const int64_t a = s.get_int("anchor");
    const std::string where = "xquant layer " + std::to_string(i) + ": ";
    if (a > i)
      return invalid_argument(where + "anchor=" + std::to_string(a) +
                              " must be an earlier layer (or the layer itself, " +
                              std::to_string(i) +
                              ", to make it an anchor): layers are appended in order");
    if (a >= 0) {
      if (!same_shape(static_cast<int>(a), i))
        return invalid_argument(where + "cannot reuse layer " + std::to_string(a) +
                                "'s codes: their n_kv_heads/head_dim differ");
      anchor[static_cast<size_t>(i)] = static_cast<int>(a);
    } else if (s.get_enum("pairing") == "stride") {
      // Layer i is an anchor iff i % layers == 0 (the seed's rule); a layer whose stride anchor
      // has another shape is never paired and becomes an anchor itself.
      const int g = static_cast<int>(s.get_int("layers"));
      const int st = i - i % g;
      anchor[static_cast<size_t>(i)] = same_shape(st, i) ? st : i;
    } else {
      anchor[static_cast<size_t>(i)] = i;  // explicit pairing: anchors unless told otherwise
    }
  }
  for (int i = 0; i < L; ++i) {
    const int a = anchor[static_cast<size_t>(i)];
    if (a == i) continue;
    const std::string where =
        "xquant layer " + std::to_string(i) + " (reusing layer " + std::to_string(a) + "): ";
    if (anchor[static_cast<size_t>(a)] != a)
      return invalid_argument(
          where + "layer " + std::to_string(a) + " is itself a reuse layer (of layer " +
          std::to_string(anchor[static_cast<size_t>(a)]) + "); reuse its anchor instead");
    const Spec& s = specs[static_cast<size_t>(i)];
    const Spec& as = specs[static_cast<size_t>(a)];
    for (const char* p : {"k_bits", "v_bits", "group"})
      if (s.get_int(p) != as.get_int(p))
        return invalid_argument(where + p + "=" + std::to_string(s.get_int(p)) +
                                " differs from the anchor's " + std::to_string(as.get_int(p)) +
                                " (the codes and blocks are the anchor's)");
    if (s.get_int("residual") < as.get_int("residual"))
      return invalid_argument(where + "residual=" + std::to_string(s.get_int("residual")) +
                              " is below the anchor's " + std::to_string(as.get_int("residual")) +
                              ": it would seal blocks before the anchor has them");
  }
  std::vector<std::shared_ptr<XqLink>> links(static_cast<size_t>(L));
  std::vector<std::unique_ptr<LayerCache>> layers;
  for (int i = 0; i < L; ++i) {
    const int a = anchor[static_cast<size_t>(i)];
    auto& link = links[static_cast<size_t>(a)];
    if (!link) link = std::make_shared<XqLink>();
    layers.push_back(
        std::make_unique<XQuantLayer>(specs[static_cast<size_t>(i)], shape.at(i), i, a, link));
  }
  return layers;
}

}  // namespace

MethodDef make_xquant_method() {
  MethodDef m;
  m.name = "xquant";
  m.summary =
      "XQuant: groups of layers share one layer's packed 2-bit codes, own scale/zero per layer";
  m.params = {
      {"k_bits",
       ParamType::kInt,
       2,
       1,
       8,
       {},
       "bits per key code (anchors; reuse layers read them)"},
      {"v_bits",
       ParamType::kInt,
       2,
       1,
       8,
       {},
       "bits per value code (anchors; reuse layers read them)"},
      {"res_bits",
       ParamType::kInt,
       0,
       0,
       8,
       {},
       "bits of a reuse layer's own residual codes (0 = pure reuse: parameters only)"},
      {"layers",
       ParamType::kInt,
       2,
       1,
       64,
       {},
       "pairing=stride: layers per group (layer i is an anchor iff i % layers == 0; 1 = no reuse)"},
      {"pairing",
       ParamType::kEnum,
       0,
       0,
       0,
       {"stride", "explicit"},
       "stride: groups of `layers`; explicit: every layer is an anchor unless its `anchor` says "
       "otherwise (the form `kvq xquant-pairs` prints)"},
      {"anchor",
       ParamType::kInt,
       -1,
       -1,
       4095,
       {},
       "per-layer override (@5:anchor=4): the earlier layer whose codes this layer reuses, or its "
       "own index to make it an anchor; -1 follows `pairing`"},
      {"fit",
       ParamType::kEnum,
       0,
       0,
       0,
       {"minmax", "lsq"},
       "anchors' scale/zero for their min/max codes: the min/max range (eta applies) or a "
       "least-squares refit"},
      {"reuse_fit",
       ParamType::kEnum,
       1,
       0,
       0,
       {"minmax", "lsq"},
       "reuse layers' scale/zero on the shared codes, and their residuals': least squares, or "
       "min/max of their own data (the seed; eta applies)"},
      {"eta",
       ParamType::kFloat,
       0.045,
       0,
       0.49,
       {},
       "data-free calibration of min/max fits: z += eta*s*(2^B-1), s *= 1-2*eta (paper: 0.045-0.09 "
       "at 2 bits, 1/6-2/6 at 1 bit); no effect on least-squares fits"},
      {"group",
       ParamType::kInt,
       32,
       1,
       4096,
       {},
       "tokens per key group (the block length) and channels per value group"},
      {"residual", ParamType::kInt, 128, 0, 1 << 20, {}, "newest tokens kept in fp16"},
  };
  m.build = build;
  return m;
}

}  // namespace kvq
