// XQuant (Yang et al., EMNLP 2025, arXiv 2510.11236): cross-layer sharing of quantized codes.
// Layers are grouped; the first layer of a group (the anchor) quantizes its keys and values like
// KIVI (keys per channel over G tokens, values per token over runs of G channels) and keeps the
// packed codes once. Every other layer of the group (a reuse layer) stores no codes of its own:
// it reads the anchor's codes for the same tokens and keeps only its own (scale, zero) per group,
// fit to its own data (least squares on the shared codes, or VeloxQuant-MLX's min/max), plus an
// optional low-bit residual. The paper's data-free calibration (eta) pulls the anchors' min/max
// reconstruction levels inward. docs/methods/xquant.md has the measurements (on SmolLM2-135M the
// codes of different layers agree no more than chance, so reuse does not pay there) and the
// deviations from the paper and from VeloxQuant-MLX implementation.
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

#include "cache/codec.h"
#include "kvq/bitpack.h"
#include "kvq/dtype.h"
#include "kvq/group_quant.h"
#include "kvq/spec.h"
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
// Block parts (see the stored layout above). An anchor block's BlockData holds its two parts as
// stored; a reuse block's holds its own parts without the hash (added by serialize) and links
// to the anchor's block of the same tokens, whose codes it reads.
struct AnchorView {
  Parts p;
  int k_bits, v_bits;
  size_t kc() const { return p.codes(k_bits); }  // one stream's key codes
  size_t vc() const { return p.codes(v_bits); }
  size_t key_part() const { return p.streams() * (kc() + p.kparams()); }
  size_t value_part() const { return p.streams() * (vc() + p.vparams()); }
  const uint8_t* kcodes(const BlockData& b, size_t s) const { return b.keys.data() + s * kc(); }
  const uint8_t* vcodes(const BlockData& b, size_t s) const { return b.values.data() + s * vc(); }
  size_t kparams_at(size_t s) const { return p.streams() * kc() + s * p.kparams(); }
  size_t vparams_at(size_t s) const { return p.streams() * vc() + s * p.vparams(); }
  CacheBytes bytes() const {
    CacheBytes c;
    c.key_codes = p.streams() * kc();
    c.value_codes = p.streams() * vc();
    c.params = p.streams() * (p.kparams() + p.vparams());
    return c;
  }
  // XXH64 of the block's code bytes: its key code region, then its value code region.
  uint64_t code_hash(const BlockData& b) const {
    XXH64_state_t* st = XXH64_createState();
    XXH64_reset(st, 0);
    XXH64_update(st, b.keys.data(), p.streams() * kc());
    XXH64_update(st, b.values.data(), p.streams() * vc());
    const uint64_t h = XXH64_digest(st);
    XXH64_freeState(st);
    return h;
  }
};

struct ReuseView {
  Parts p;
  int r;  // residual bits (0: none)
  size_t key_part() const {
    return p.streams() * (p.kparams() + (r ? p.codes(r) + p.kparams() : 0));
  }
  size_t value_part() const {
    return p.streams() * (p.vparams() + (r ? p.codes(r) + p.vparams() : 0));
  }
  size_t kp_at(size_t s) const { return s * p.kparams(); }
  size_t krc_at(size_t s) const { return p.streams() * p.kparams() + s * p.codes(r); }
  size_t krp_at(size_t s) const {
    return p.streams() * (p.kparams() + p.codes(r)) + s * p.kparams();
  }
  size_t vp_at(size_t s) const { return s * p.vparams(); }
  size_t vrc_at(size_t s) const { return p.streams() * p.vparams() + s * p.codes(r); }
  size_t vrp_at(size_t s) const {
    return p.streams() * (p.vparams() + p.codes(r)) + s * p.vparams();
  }
  CacheBytes bytes() const {
    const uint64_t S = p.streams();
    CacheBytes c;
    c.params = S * (p.kparams() + p.vparams());
    if (r) {
      c.key_codes = S * p.codes(r);
      c.value_codes = S * p.codes(r);
      c.params += S * (p.kparams() + p.vparams());
    }
    return c;
  }
};

class XqCodec;

// Where the layers of one group meet: raw pointers to the codecs alive (they register on
// construction and deregister on destruction).
struct XqLink {
  XqCodec* anchor = nullptr;
  std::vector<XqCodec*> readers;
  // The layer that bills codes the anchor no longer holds: the anchor, else the lowest reader.
  const XqCodec* biller() const;
};

class XqCodec final : public BlockCodec {
 public:
  XqCodec(const Spec& spec, const LayerShape& shape, int index, int anchor,
          std::shared_ptr<XqLink> link)
      : BlockCodec(spec, shape, spec.get_int("group"), spec.get_int("residual")),
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
  XqCodec(const XqCodec&) = delete;
  ~XqCodec() override {
    if (link_->anchor == this) link_->anchor = nullptr;
    std::erase(link_->readers, this);
  }
  std::unique_ptr<BlockCodec> clone(CloneMemo& memo) const override {
    // A fresh link per memo: the copies register themselves, nothing points at the original.
    auto [it, inserted] = memo.copies.try_emplace(link_.get());
    if (inserted) it->second = std::make_shared<XqLink>();
    auto c = std::make_unique<XqCodec>(spec(), shape(), index_, anchor_,
                                       std::static_pointer_cast<XqLink>(it->second));
    for (const auto& b : blocks_) c->blocks_.push_back(clone_block(b, memo));
    c->batch_ = batch_;
    return c;
  }

  int index() const { return index_; }
  bool is_anchor() const { return anchor_ == index_; }
  int shared_codes_layer() const override { return is_anchor() ? -1 : anchor_; }
  // Anchor: block i's data, or null.
  std::shared_ptr<const BlockData> block_at(int64_t i) const {
    return i >= 0 && i < static_cast<int64_t>(blocks_.size()) ? blocks_[static_cast<size_t>(i)]
                                                              : nullptr;
  }
  int64_t batch() const { return batch_; }
  // Reuse: the anchor blocks this layer's blocks read, in block order.
  const std::vector<std::shared_ptr<const BlockData>>& held() const { return blocks_; }

  std::string stats(const std::vector<std::shared_ptr<const BlockData>>&,
                    const BlockGeometry&) const override {
    std::string s = "role=" + std::string(is_anchor() ? "anchor" : "reuse") + "\n";
    if (is_anchor())
      s += "readers=" + std::to_string(link_->readers.size()) + "\n";
    else
      s += "anchor=" + std::to_string(anchor_) + "\n";
    s += "orphan_code_bytes=" + std::to_string(orphan_bytes()) + "\n";
    return s;
  }

  Status precheck_append(int64_t batch, int64_t n_new, int64_t offset,
                         int64_t n_blocks) const override {
    if (is_anchor()) return ok_status();
    const int64_t T = block_tokens(), R = residual(), end = offset + n_new;
    const int64_t will_hold = end >= R + T ? (end - R) / T : 0;
    const XqCodec* a = link_->anchor;
    for (int64_t i = n_blocks; i < will_hold; ++i) {
      if (!a || !a->block_at(i))
        return invalid_argument("xquant layer " + std::to_string(index_) + " reuses layer " +
                                std::to_string(anchor_) + "'s codes and would seal tokens [" +
                                std::to_string(i * T) + ", " + std::to_string((i + 1) * T) +
                                "), but layer " + std::to_string(anchor_) +
                                (a ? "" : " (not part of this model)") +
                                " has not sealed them yet: append to the anchor layer first");
      if (a->batch() != batch)
        return shape_mismatch("xquant layer " + std::to_string(index_) + ": batch size " +
                              std::to_string(batch) + " differs from its anchor layer " +
                              std::to_string(anchor_) + "'s " + std::to_string(a->batch()));
    }
    return ok_status();
  }

  SealedBlock encode(int64_t index, const BlockGeometry& g, const float* k, const float* v,
                     Workspace& ws) override {
    Workspace::Frame frame(ws);
    const Parts p{g, group_};
    const int64_t T = g.tokens, D = g.dim, n = T * D;
    const size_t S = p.streams();
    uint8_t* c = ws.alloc<uint8_t>(static_cast<size_t>(n));
    QuantParams* kp = ws.alloc<QuantParams>(static_cast<size_t>(D));
    QuantParams* vp = ws.alloc<QuantParams>(p.vparams() / kPairBytes);
    const size_t nvp = p.vparams() / kPairBytes;
    auto data = std::make_shared<BlockData>();
    batch_ = g.batch;
    if (is_anchor()) {
      const AnchorView a{p, k_bits_, v_bits_};
      data->keys = Buffer(a.key_part());
      data->values = Buffer(a.value_part());
      for (size_t s = 0; s < S; ++s) {
        const float* ks = k + static_cast<int64_t>(s) * n;
        const float* vs = v + static_cast<int64_t>(s) * n;
        quantize_per_channel(ks, T, D, D, k_bits_, c, kp);
        if (fit_ == Fit::kLsq)
          fit_per_channel_to_codes(ks, T, D, c, kp);
        else
          calibrate(kp, static_cast<size_t>(D), k_bits_);
        pack_bits(c, static_cast<size_t>(n), k_bits_, data->keys.data() + s * a.kc());
        std::memcpy(data->keys.data() + a.kparams_at(s), kp, p.kparams());
        quantize_per_token(vs, T, D, D, group_, v_bits_, c, vp);
        if (fit_ == Fit::kLsq)
          fit_per_token_to_codes(vs, T, D, group_, c, vp);
        else
          calibrate(vp, nvp, v_bits_);
        pack_bits(c, static_cast<size_t>(n), v_bits_, data->values.data() + s * a.vc());
        std::memcpy(data->values.data() + a.vparams_at(s), vp, p.vparams());
      }
      blocks_.push_back(data);
      return {std::move(data), a.bytes()};
    }
    auto anchor = link_->anchor ? link_->anchor->block_at(index) : nullptr;
    KVQ_CHECK(anchor && link_->anchor->batch() == g.batch);  // guaranteed by precheck
    const AnchorView a{p, k_bits_, v_bits_};
    const ReuseView r{p, r_bits_};
    data->keys = Buffer(r.key_part());
    data->values = Buffer(r.value_part());
    data->linked = anchor;
    float* rec = ws.alloc<float>(static_cast<size_t>(n));
    float* res = ws.alloc<float>(static_cast<size_t>(n));
    uint8_t* rc = ws.alloc<uint8_t>(static_cast<size_t>(n));
    for (size_t s = 0; s < S; ++s) {
      const float* ks = k + static_cast<int64_t>(s) * n;
      const float* vs = v + static_cast<int64_t>(s) * n;
      // Keys: own per-channel params on the anchor's codes, then the optional residual.
      unpack_bits(a.kcodes(*anchor, s), static_cast<size_t>(n), k_bits_, c);
      if (reuse_fit_ == Fit::kLsq) {
        fit_per_channel_to_codes(ks, T, D, c, kp);
      } else {
        fit_per_channel_minmax(ks, T, D, k_bits_, kp);
        calibrate(kp, static_cast<size_t>(D), k_bits_);
      }
      std::memcpy(data->keys.data() + r.kp_at(s), kp, p.kparams());
      if (r_bits_) {
        dequantize_per_channel(c, T, D, kp, rec);
        residual_of(ks, rec, res, n);
        quantize_per_channel(res, T, D, D, r_bits_, rc, kp);
        if (reuse_fit_ == Fit::kLsq) fit_per_channel_to_codes(res, T, D, rc, kp);
        pack_bits(rc, static_cast<size_t>(n), r_bits_, data->keys.data() + r.krc_at(s));
        std::memcpy(data->keys.data() + r.krp_at(s), kp, p.kparams());
      }
      // Values: own per-token params on the anchor's codes, then the optional residual.
      unpack_bits(a.vcodes(*anchor, s), static_cast<size_t>(n), v_bits_, c);
      if (reuse_fit_ == Fit::kLsq) {
        fit_per_token_to_codes(vs, T, D, group_, c, vp);
      } else {
        fit_per_token_minmax(vs, T, D, group_, v_bits_, vp);
        calibrate(vp, nvp, v_bits_);
      }
      std::memcpy(data->values.data() + r.vp_at(s), vp, p.vparams());
      if (r_bits_) {
        dequantize_per_token(c, T, D, group_, vp, rec);
        residual_of(vs, rec, res, n);
        quantize_per_token(res, T, D, D, group_, r_bits_, rc, vp);
        if (reuse_fit_ == Fit::kLsq) fit_per_token_to_codes(res, T, D, group_, rc, vp);
        pack_bits(rc, static_cast<size_t>(n), r_bits_, data->values.data() + r.vrc_at(s));
        std::memcpy(data->values.data() + r.vrp_at(s), vp, p.vparams());
      }
    }
    blocks_.push_back(anchor);
    return {std::move(data), r.bytes()};
  }

  void decode(const BlockData& blk, int64_t, bool keys, int64_t b, int64_t h,
              const BlockGeometry& g, float* out, Workspace& ws) const override {
    Workspace::Frame frame(ws);
    const Parts p{g, group_};
    const size_t s = static_cast<size_t>(b * g.heads + h);
    const int64_t T = g.tokens, D = g.dim, n = T * D;
    const AnchorView a{p, k_bits_, v_bits_};
    uint8_t* c = ws.alloc<uint8_t>(static_cast<size_t>(n));
    if (is_anchor()) {
      if (keys) {
        unpack_bits(a.kcodes(blk, s), static_cast<size_t>(n), k_bits_, c);
        dequantize_per_channel(c, T, D,
                               params_at(blk.keys.data() + a.kparams_at(s), p.kparams(), ws), out);
      } else {
        unpack_bits(a.vcodes(blk, s), static_cast<size_t>(n), v_bits_, c);
        dequantize_per_token(c, T, D, group_,
                             params_at(blk.values.data() + a.vparams_at(s), p.vparams(), ws), out);
      }
      return;
    }
    const ReuseView r{p, r_bits_};
    const BlockData& anchor = *blk.linked;
    if (keys) {
      unpack_bits(a.kcodes(anchor, s), static_cast<size_t>(n), k_bits_, c);
      dequantize_per_channel(c, T, D, params_at(blk.keys.data() + r.kp_at(s), p.kparams(), ws),
                             out);
      if (r_bits_) {
        float* res = ws.alloc<float>(static_cast<size_t>(n));
        unpack_bits(blk.keys.data() + r.krc_at(s), static_cast<size_t>(n), r_bits_, c);
        dequantize_per_channel(c, T, D, params_at(blk.keys.data() + r.krp_at(s), p.kparams(), ws),
                               res);
        for (int64_t i = 0; i < n; ++i) out[i] += res[i];
      }
    } else {
      unpack_bits(a.vcodes(anchor, s), static_cast<size_t>(n), v_bits_, c);
      dequantize_per_token(c, T, D, group_,
                           params_at(blk.values.data() + r.vp_at(s), p.vparams(), ws), out);
      if (r_bits_) {
        float* res = ws.alloc<float>(static_cast<size_t>(n));
        unpack_bits(blk.values.data() + r.vrc_at(s), static_cast<size_t>(n), r_bits_, c);
        dequantize_per_token(c, T, D, group_,
                             params_at(blk.values.data() + r.vrp_at(s), p.vparams(), ws), res);
        for (int64_t i = 0; i < n; ++i) out[i] += res[i];
      }
    }
  }

  void serialize(const BlockData& blk, bool keys, std::vector<uint8_t>& out) const override {
    if (keys && !is_anchor()) {
      const uint64_t h =
          AnchorView{Parts{geometry_of(blk), group_}, k_bits_, v_bits_}.code_hash(*blk.linked);
      for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(h >> (8 * i)));
    }
    BlockCodec::serialize(blk, keys, out);
  }

  Result<SealedBlock> load(int64_t index, const BlockGeometry& g, const ChunkRef& k,
                           const ChunkRef& v) override {
    if (index == 0) pending_.clear();
    const Parts p{g, group_};
    const size_t S = p.streams();
    const AnchorView a{p, k_bits_, v_bits_};
    auto data = std::make_shared<BlockData>();
    if (is_anchor()) {
      if (k.size != a.key_part() || v.size != a.value_part())
        return corrupt("xquant anchor block needs " + std::to_string(a.key_part()) + " key and " +
                       std::to_string(a.value_part()) + " value bytes, got " +
                       std::to_string(k.size) + " and " + std::to_string(v.size));
      KVQ_RETURN_IF_ERROR(check_padding(k.data, S, a.kc(), g.stream_elems(), k_bits_, "key codes"));
      KVQ_RETURN_IF_ERROR(
          check_padding(v.data, S, a.vc(), g.stream_elems(), v_bits_, "value codes"));
      KVQ_RETURN_IF_ERROR(check_pairs(k.data + a.kparams_at(0), S * p.kparams() / kPairBytes,
                                      "xquant anchor key params"));
      KVQ_RETURN_IF_ERROR(check_pairs(v.data + a.vparams_at(0), S * p.vparams() / kPairBytes,
                                      "xquant anchor value params"));
      data->keys = Buffer(k.data, k.size);
      data->values = Buffer(v.data, v.size);
      pending_.push_back(data);
      return SealedBlock{std::move(data), a.bytes()};
    }
    const XqCodec* an = link_->anchor;
    auto anchor = an ? an->block_at(index) : nullptr;
    if (!anchor)
      return corrupt("xquant reuse layer " + std::to_string(index_) + " needs block " +
                     std::to_string(index) + " of its anchor layer " + std::to_string(anchor_) +
                     ", which does not hold it (import layers in order)");
    if (an->batch() != g.batch)
      return corrupt("xquant reuse layer " + std::to_string(index_) + ": block " +
                     std::to_string(index) + " has batch " + std::to_string(g.batch) +
                     " but its anchor layer " + std::to_string(anchor_) + "'s has batch " +
                     std::to_string(an->batch()));
    const ReuseView r{p, r_bits_};
    if (k.size != 8 + r.key_part() || v.size != r.value_part())
      return corrupt("xquant reuse block needs " + std::to_string(8 + r.key_part()) + " key and " +
                     std::to_string(r.value_part()) + " value bytes, got " +
                     std::to_string(k.size) + " and " + std::to_string(v.size));
    uint64_t h = 0;
    for (int i = 0; i < 8; ++i) h |= static_cast<uint64_t>(k.data[i]) << (8 * i);
    if (h != a.code_hash(*anchor))
      return corrupt(
          "xquant reuse block was fit to anchor codes other than those the anchor layer "
          "holds for its tokens (import the anchor layer's matching state first)");
    const uint8_t* kd = k.data + 8;
    KVQ_RETURN_IF_ERROR(check_pairs(kd, S * p.kparams() / kPairBytes, "xquant reuse key params"));
    KVQ_RETURN_IF_ERROR(
        check_pairs(v.data, S * p.vparams() / kPairBytes, "xquant reuse value params"));
    if (r_bits_) {
      KVQ_RETURN_IF_ERROR(check_padding(kd + r.krc_at(0), S, p.codes(r_bits_), g.stream_elems(),
                                        r_bits_, "residual key codes"));
      KVQ_RETURN_IF_ERROR(check_pairs(kd + r.krp_at(0), S * p.kparams() / kPairBytes,
                                      "xquant residual key params"));
      KVQ_RETURN_IF_ERROR(check_padding(v.data + r.vrc_at(0), S, p.codes(r_bits_), g.stream_elems(),
                                        r_bits_, "residual value codes"));
      KVQ_RETURN_IF_ERROR(check_pairs(v.data + r.vrp_at(0), S * p.vparams() / kPairBytes,
                                      "xquant residual value params"));
    }
    data->keys = Buffer(kd, r.key_part());
    data->values = Buffer(v.data, v.size);
    data->linked = anchor;
    pending_.push_back(anchor);
    return SealedBlock{std::move(data), r.bytes()};
  }

  void end_import(bool commit) override {
    if (commit) {
      blocks_ = std::move(pending_);
      batch_ = pending_batch_;
    }
    pending_.clear();
  }
  Status import_state(const uint8_t*, size_t size, int64_t batch, int64_t, bool commit) override {
    if (size != 0) return corrupt("unexpected method state for xquant");
    if (commit) pending_batch_ = batch;
    return ok_status();
  }

  void on_trim(int64_t, int64_t keep_blocks) override {
    // Shrink only: a backend that holds the blocks itself (CUDA) never gives this codec any,
    // and a trim must not fill the list with null blocks.
    if (static_cast<size_t>(keep_blocks) < blocks_.size())
      blocks_.resize(static_cast<size_t>(keep_blocks));
  }
  void on_reset() override {
    blocks_.clear();
    batch_ = 0;
  }
  uint64_t extra_bytes() const override { return orphan_bytes(); }
  uint64_t extra_resident_bytes() const override { return orphan_bytes(); }

 private:
  void attach() {
    if (is_anchor())
      link_->anchor = this;
    else
      link_->readers.push_back(this);
  }

  BlockGeometry geometry_of(const BlockData&) const {
    return {batch_, shape().n_kv_heads, block_tokens(), shape().head_dim};
  }

  // eta calibrates min/max fits at the anchors' bit widths: anchor parameters (fit=minmax) and
  // reuse parameters (reuse_fit=minmax). Least-squares fits need no calibration.
  void calibrate(QuantParams* params, size_t n, int bits) const {
    if (eta_ == 0.0f) return;
    for (size_t i = 0; i < n; ++i) params[i] = calibrate_eta(params[i], bits, eta_);
  }

  // res = x - rec, kept inside the fp16 range the residual's parameters can represent.
  static void residual_of(const float* x, const float* rec, float* res, int64_t n) {
    for (int64_t i = 0; i < n; ++i) res[i] = std::clamp(x[i] - rec[i], -kF16Max, kF16Max);
  }

  // Anchor blocks that reuse layers still read but the anchor no longer holds (after a trim,
  // reset or import of the anchor layer alone), billed whole by one layer of the group. They
  // stay alive through the reuse blocks' links; resident and accounted are their sizes.
  uint64_t orphan_bytes() const {
    if (link_->biller() != this) return 0;
    const XqCodec* a = link_->anchor;
    std::vector<const BlockData*> seen;
    uint64_t total = 0;
    for (const XqCodec* reader : link_->readers)
      for (size_t i = 0; i < reader->held().size(); ++i) {
        const BlockData* b = reader->held()[i].get();
        if (!b) continue;
        if (a && a->block_at(static_cast<int64_t>(i)).get() == b) continue;
        if (std::find(seen.begin(), seen.end(), b) != seen.end()) continue;
        seen.push_back(b);
        total += b->keys.size() + b->values.size();
      }
    return total;
  }

  int index_, anchor_;
  int k_bits_, v_bits_, r_bits_;
  int64_t group_;
  Fit fit_, reuse_fit_;
  float eta_;
  std::shared_ptr<XqLink> link_;
  // Anchor: its sealed blocks. Reuse: the anchor blocks its sealed blocks read (one per block).
  std::vector<std::shared_ptr<const BlockData>> blocks_;
  int64_t batch_ = 0;  // of the sealed blocks
  // Import staging.
  std::vector<std::shared_ptr<const BlockData>> pending_;
  int64_t pending_batch_ = 0;
};

const XqCodec* XqLink::biller() const {
  if (anchor) return anchor;
  const XqCodec* best = nullptr;
  for (const XqCodec* r : readers)
    if (!best || r->index() < best->index()) best = r;
  return best;
}

// ---------------------------------------------------------------------------------------------
// The per-model builder: decides every layer's anchor and wires the groups.
Result<std::vector<std::unique_ptr<BlockCodec>>> build(const std::vector<Spec>& specs,
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
      // Layer i is an anchor iff i % layers == 0 (VeloxQuant-MLX's rule); a layer whose stride anchor
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
  std::vector<std::unique_ptr<BlockCodec>> layers;
  for (int i = 0; i < L; ++i) {
    const int a = anchor[static_cast<size_t>(i)];
    auto& link = links[static_cast<size_t>(a)];
    if (!link) link = std::make_shared<XqLink>();
    layers.push_back(
        std::make_unique<XqCodec>(specs[static_cast<size_t>(i)], shape.at(i), i, a, link));
  }
  return layers;
}

}  // namespace

MethodDef make_xquant_method() {
  MethodDef m;
  m.id = 3;
  m.name = "xquant";
  // Reuse layers decode another layer's codes: their error (not the anchors') dominates and
  // barely moves with the bits (docs/methods/xquant.md), so the budget is the same at every step.
  m.bit_ladder = {{"group=32,k_bits=2,v_bits=2", 2, 0.9},
                  {"group=32,k_bits=3,v_bits=3", 3, 0.9},
                  {"group=32,k_bits=4,v_bits=4", 4, 0.9},
                  {"group=32,k_bits=8,v_bits=8", 8, 0.9}};
  m.test_settings = "group=4,residual=8";
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
       2,
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
       "min/max of their own data (VeloxQuant-MLX; eta applies)"},
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
