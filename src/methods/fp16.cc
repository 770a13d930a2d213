// fp16 — the uncompressed baseline: every token stays in the fp16 window (pages of 16 tokens).
// It is the reference every quality figure is measured against.
#include "cache/block_cache.h"
#include "methods/methods.h"

namespace kvq {

namespace {

constexpr int64_t kPageTokens = 16;
constexpr int64_t kNever = int64_t{1} << 32;  // block length no cache reaches: nothing seals

class Fp16Layer final : public BlockLayerCache {
 public:
  Fp16Layer(const Spec& spec, const LayerShape& shape)
      : BlockLayerCache(spec, shape, kNever, kPageTokens, 0) {}
  Fp16Layer(const Fp16Layer& o, CloneMemo& memo) : BlockLayerCache(o, memo) {}
  std::unique_ptr<LayerCache> clone(CloneMemo& memo) const override {
    return std::unique_ptr<LayerCache>(new Fp16Layer(*this, memo));
  }

 protected:
  std::unique_ptr<SealedBlock> seal(int64_t, const float*, const float*) override {
    KVQ_CHECK(false && "the fp16 cache never seals");
    return nullptr;
  }
  Result<std::unique_ptr<SealedBlock>> deserialize_block(int64_t, const BlockGeometry&,
                                                         const ChunkRef&,
                                                         const ChunkRef&) const override {
    return corrupt("the fp16 cache holds no sealed blocks");
  }
};

}  // namespace

MethodDef make_fp16_method() {
  MethodDef m;
  m.name = "fp16";
  m.summary = "uncompressed fp16 cache (the quality reference), 16 bits per element";
  m.build = build_each_layer<Fp16Layer>;
  return m;
}

}  // namespace kvq
