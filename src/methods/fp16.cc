// fp16 — the uncompressed baseline: every token stays in the fp16 window (pages of 16 tokens).
// It is the reference every quality figure is measured against.
#include "cache/codec.h"
#include "kvq/spec.h"

namespace kvq {

namespace {

constexpr int64_t kPageTokens = 16;
constexpr int64_t kNever = int64_t{1} << 32;  // a block length no cache reaches: nothing seals

class Fp16Codec final : public BlockCodec {
 public:
  Fp16Codec(const Spec& spec, const LayerShape& shape) : BlockCodec(spec, shape, kNever, 0) {}
  int64_t page_tokens() const override { return kPageTokens; }
  std::unique_ptr<BlockCodec> clone(CloneMemo&) const override {
    return std::make_unique<Fp16Codec>(*this);
  }
  SealedBlock encode(int64_t, const BlockGeometry&, const float*, const float*,
                     Workspace&) override {
    KVQ_CHECK(false && "the fp16 cache never seals");
    return {};
  }
  void decode(const BlockData&, int64_t, bool, int64_t, int64_t, const BlockGeometry&, float*,
              Workspace&) const override {
    KVQ_CHECK(false && "the fp16 cache holds no sealed blocks");
  }
  Result<SealedBlock> load(int64_t, const BlockGeometry&, const ChunkRef&,
                           const ChunkRef&) override {
    return corrupt("the fp16 cache holds no sealed blocks");
  }
};

}  // namespace

MethodDef make_fp16_method() {
  MethodDef m;
  m.id = 0;
  m.name = "fp16";
  m.summary = "uncompressed fp16 cache (the quality reference), 16 bits per element";
  m.build = build_each_layer<Fp16Codec>;
  return m;
}

}  // namespace kvq
