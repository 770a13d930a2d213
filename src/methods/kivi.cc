// KIVI (Liu et al., ICML 2024, arXiv 2402.02750): keys quantized per channel over groups of G
// tokens (keys have outlier channels), values per token over runs of G channels, the newest R
// tokens kept in fp16. kvq's yardstick: every other method is compared with it at matched bits.
//
// All-in bits per element once sealed (fp16 scale + zero = 32 bits per group):
//   keys   k_bits + 32 / G        values   v_bits + 32 / min(G, D)   (D = head_dim)
// plus the fp16 window (R to R + G - 1 tokens, whole pages of G tokens) at 16 bits.
#include <algorithm>
#include <cstring>
#include <vector>

#include "cache/codec.h"
#include "methods/kivi_layout.h"
#include "kvq/bitpack.h"
#include "kvq/group_quant.h"
#include "kvq/spec.h"

namespace kvq {

namespace {

// The stored layout is methods/kivi_layout.h (shared with the CUDA backend).
class KiviCodec final : public BlockCodec {
 public:
  KiviCodec(const Spec& spec, const LayerShape& shape)
      : BlockCodec(spec, shape, spec.get_int("group"), spec.get_int("residual")),
        k_bits_(static_cast<int>(spec.get_int("k_bits"))),
        v_bits_(static_cast<int>(spec.get_int("v_bits"))),
        group_(spec.get_int("group")) {}
  std::unique_ptr<BlockCodec> clone(CloneMemo&) const override {
    return std::make_unique<KiviCodec>(*this);
  }

  SealedBlock encode(int64_t, const BlockGeometry& g, const float* k, const float* v,
                     Workspace& ws) override {
    const KiviLayout L = layout(g);
    const int64_t T = g.tokens, D = g.dim;
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(L.key_part());
    blk->values = Buffer(L.value_part());
    Workspace::Frame frame(ws);
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(T * D));
    // Parameters go through an aligned staging row: their place in the part may be odd.
    auto* params = ws.alloc<QuantParams>(std::max(L.kparam(), L.vparam()) / sizeof(QuantParams));
    uint8_t* kp = blk->keys.data() + L.S() * L.kcode();
    uint8_t* vp = blk->values.data() + L.S() * L.vcode();
    for (size_t s = 0; s < L.S(); ++s) {
      const size_t off = s * static_cast<size_t>(T * D);
      quantize_per_channel(k + off, T, D, D, k_bits_, codes, params);
      std::memcpy(kp + s * L.kparam(), params, L.kparam());
      pack_bits(codes, static_cast<size_t>(T * D), k_bits_, blk->keys.data() + s * L.kcode());
      quantize_per_token(v + off, T, D, D, group_, v_bits_, codes, params);
      std::memcpy(vp + s * L.vparam(), params, L.vparam());
      pack_bits(codes, static_cast<size_t>(T * D), v_bits_, blk->values.data() + s * L.vcode());
    }
    return {std::move(blk), L.bytes()};
  }

  void decode(const BlockData& blk, int64_t, bool keys, int64_t b, int64_t h,
              const BlockGeometry& g, float* out, Workspace& ws) const override {
    const KiviLayout L = layout(g);
    const size_t s = static_cast<size_t>(b * g.heads + h),
                 n = static_cast<size_t>(g.stream_elems());
    Workspace::Frame frame(ws);
    uint8_t* codes = ws.alloc<uint8_t>(n);
    if (keys) {
      unpack_bits(blk.keys.data() + s * L.kcode(), n, k_bits_, codes);
      const QuantParams* p =
          params_at(blk.keys.data() + L.S() * L.kcode() + s * L.kparam(), L.kparam(), ws);
      dequantize_per_channel(codes, g.tokens, g.dim, p, out);
    } else {
      unpack_bits(blk.values.data() + s * L.vcode(), n, v_bits_, codes);
      const QuantParams* p =
          params_at(blk.values.data() + L.S() * L.vcode() + s * L.vparam(), L.vparam(), ws);
      dequantize_per_token(codes, g.tokens, g.dim, group_, p, out);
    }
  }

  Result<SealedBlock> load(int64_t, const BlockGeometry& g, const ChunkRef& k,
                           const ChunkRef& v) override {
    // Sizes are checked before anything is allocated, so a damaged file cannot make us
    // allocate what its claimed geometry would need.
    const KiviLayout L = layout(g);
    if (k.size != L.key_part() || v.size != L.value_part())
      return corrupt("kivi block needs " + std::to_string(L.key_part()) + " key and " +
                     std::to_string(L.value_part()) + " value bytes, got " +
                     std::to_string(k.size) + " and " + std::to_string(v.size));
    KVQ_RETURN_IF_ERROR(
        check_padding(k.data, L.S(), L.kcode(), g.stream_elems(), k_bits_, "kivi key codes"));
    KVQ_RETURN_IF_ERROR(
        check_padding(v.data, L.S(), L.vcode(), g.stream_elems(), v_bits_, "kivi value codes"));
    KVQ_RETURN_IF_ERROR(validate_quant_params(k.data + L.S() * L.kcode(), L.S() * L.kparam() / 4,
                                              "kivi key params"));
    KVQ_RETURN_IF_ERROR(validate_quant_params(v.data + L.S() * L.vcode(), L.S() * L.vparam() / 4,
                                              "kivi value params"));
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(k.data, k.size);
    blk->values = Buffer(v.data, v.size);
    return SealedBlock{std::move(blk), L.bytes()};
  }

 private:
  KiviLayout layout(const BlockGeometry& g) const { return {g, k_bits_, v_bits_, group_}; }

  int k_bits_, v_bits_;
  int64_t group_;
};

}  // namespace

MethodDef make_kivi_method() {
  MethodDef m;
  m.id = 1;
  m.name = "kivi";
  // Budget: 0.4 * 4^(2 - bits) relative squared error, the rate of uniform quantization.
  m.bit_ladder = {{"group=32,k_bits=2,v_bits=2", 2, 0.4},
                  {"group=32,k_bits=3,v_bits=3", 3, 0.1},
                  {"group=32,k_bits=4,v_bits=4", 4, 0.025},
                  {"group=32,k_bits=8,v_bits=8", 8, 1e-4}};
  m.test_settings = "group=4,residual=8";
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
  m.build = build_each_layer<KiviCodec>;
  return m;
}

}  // namespace kvq
