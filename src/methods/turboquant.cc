// TurboQuant (Zandieh et al., arXiv 2504.19874) as a kvq method — its MSE quantizer: every key and
// value vector x (one token of one head, D channels) is split into its norm and direction, the
// direction is rotated at random, and each coordinate of the rotated unit vector is quantized
// with one fixed Lloyd-Max codebook:
//
//   r = |x|,  y = Pi (x / r),  c_i = argmin_k |y_i - level_k|,  x^ = r * Pi^T level[c]
//
// A coordinate of a uniformly random unit vector in R^D has density proportional to
// (1 - t^2)^((D - 3) / 2) on [-1, 1] (close to a Gaussian of variance 1/D), whatever x was, so one
// codebook per (D, bits) serves every vector: kvq computes it at creation by Lloyd's iterations on
// that density (docs/methods/turboquant.md). The rotation Pi is a randomized Walsh-Hadamard
// transform — random signs (from `seed`) then the orthonormal Hadamard matrix, over blocks of the
// largest power of two dividing D — the structured random rotation such implementations use.
//
// Billing: the paper counts bits per coordinate and leaves the norm out; kvq bills it (an fp16
// norm per vector: 16 / D bits per element). The paper's second stage (a 1-bit QJL sketch of the
// residual, for unbiased inner products) is not implemented: independent reimplementations found
// it hurt quality.
//
// Blocks are one token (each vector is quantized on arrival), so with the default `residual=0`
// every key is quantized before its own query attends, as in serving engines.
//
// Stored layout of one sealed token (S = B * H streams):
//   key part    S x fp16 norm, then S x packed_size(D, bits) codes (kvq/bitpack.h; padding zero)
//   value part  the same
#include <cmath>
#include <cstring>
#include <vector>

#include "cache/codec.h"
#include "core/cpu.h"
#include "kvq/bitpack.h"
#include "kvq/dtype.h"
#include "kvq/spec.h"
#include "numerics/hadamard.h"
#include "numerics/lloyd.h"

namespace kvq {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// y = H x, H the orthonormal Walsh-Hadamard matrix of order n (a power of two), in place
// (numerics/hadamard.h: the same sums in the same order at every SIMD level, so the per-level
// clones below agree bit for bit).
KVQ_ALWAYS_INLINE void hadamard(float* x, int64_t n) { hadamard_inplace(x, n); }

// The rotation's float work of one vector [D], compiled once per SIMD level (core/cpu.h): the
// library's baseline is SSE2, where the butterflies ran several times slower.
//   forward:  y = H (x * inv * signs)          (encode; y then goes to the codebook)
//   inverse:  out = (H levels[codes]) * signs * r   (decode)
template <SimdLevel L>
KVQ_ALWAYS_INLINE void tq_rotate_body(const float* x, float inv, const float* signs, int64_t D,
                                      int64_t rot, float* y) {
  for (int64_t i = 0; i < D; ++i) y[i] = x[i] * inv * signs[i];
  for (int64_t i = 0; i < D; i += rot) hadamard(y + i, rot);
}
template <SimdLevel L>
KVQ_ALWAYS_INLINE void tq_unrotate_body(const float* levels, const uint8_t* codes,
                                        const float* signs, float r, int64_t D, int64_t rot,
                                        float* out) {
  for (int64_t i = 0; i < D; ++i) out[i] = levels[codes[i]];
  for (int64_t i = 0; i < D; i += rot) hadamard(out + i, rot);  // H^T = H
  for (int64_t i = 0; i < D; ++i) out[i] *= signs[i] * r;
}
KVQ_LEVEL_CLONES(void, tq_rotate,
                 (const float* x, float inv, const float* signs, int64_t D, int64_t rot, float* y),
                 (x, inv, signs, D, rot, y))
KVQ_LEVEL_CLONES(void, tq_unrotate,
                 (const float* levels, const uint8_t* codes, const float* signs, float r,
                  int64_t D, int64_t rot, float* out),
                 (levels, codes, signs, r, D, rot, out))
void tq_rotate(const float* x, float inv, const float* signs, int64_t D, int64_t rot, float* y) {
  KVQ_LEVEL_DISPATCH(tq_rotate, (x, inv, signs, D, rot, y));
}
void tq_unrotate(const float* levels, const uint8_t* codes, const float* signs, float r,
                 int64_t D, int64_t rot, float* out) {
  KVQ_LEVEL_DISPATCH(tq_unrotate, (levels, codes, signs, r, D, rot, out));
}

class TurboCodec final : public BlockCodec {
 public:
  TurboCodec(const Spec& spec, const LayerShape& shape)
      : BlockCodec(spec, shape, 1, spec.get_int("residual")),
        bits_(static_cast<int>(spec.get_int("bits"))),
        levels_(sphere_coordinate_levels(shape.head_dim, bits_)),
        bounds_(level_bounds(levels_)) {
    const int64_t D = shape.head_dim;
    rot_ = 1;
    while (D % (2 * rot_) == 0) rot_ *= 2;
    signs_.resize(static_cast<size_t>(D));
    const uint64_t seed = static_cast<uint64_t>(spec.get_int("seed"));
    for (int64_t i = 0; i < D; ++i)
      signs_[static_cast<size_t>(i)] =
          splitmix64(seed * 0x100000001b3ull + static_cast<uint64_t>(i)) >> 63 ? -1.0f : 1.0f;
  }
  std::unique_ptr<BlockCodec> clone(CloneMemo&) const override {
    return std::make_unique<TurboCodec>(*this);
  }

  SealedBlock encode(int64_t, const BlockGeometry& g, const float* k, const float* v,
                     Workspace& ws) override {
    Workspace::Frame frame(ws);
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(part_bytes(g));
    blk->values = Buffer(part_bytes(g));
    float* y = ws.alloc<float>(static_cast<size_t>(g.dim));
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(g.dim));
    for (int64_t s = 0; s < g.streams(); ++s) {
      encode_vector(k + s * g.dim, y, codes, blk->keys.data(), s, g);
      encode_vector(v + s * g.dim, y, codes, blk->values.data(), s, g);
    }
    return {std::move(blk), accounting(g)};
  }

  void decode(const BlockData& blk, int64_t, bool keys, int64_t b, int64_t h,
              const BlockGeometry& g, float* out, Workspace& ws) const override {
    Workspace::Frame frame(ws);
    const int64_t s = b * g.heads + h, D = g.dim;
    const uint8_t* part = keys ? blk.keys.data() : blk.values.data();
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(D));
    unpack_bits(part + norms_bytes(g) + static_cast<size_t>(s) * code_bytes(),
                static_cast<size_t>(D), bits_, codes);
    uint16_t nb;
    std::memcpy(&nb, part + 2 * s, 2);
    const float r = f16_to_f32(nb);
    tq_unrotate(levels_.data(), codes, signs_.data(), r, D, rot_, out);
  }

  Result<SealedBlock> load(int64_t, const BlockGeometry& g, const ChunkRef& k,
                           const ChunkRef& v) override {
    const size_t part = part_bytes(g);
    if (k.size != part || v.size != part)
      return corrupt("turboquant token needs " + std::to_string(part) +
                     " key and value bytes, got " + std::to_string(k.size) + " and " +
                     std::to_string(v.size));
    for (const ChunkRef* c : {&k, &v}) {
      for (int64_t s = 0; s < g.streams(); ++s) {
        uint16_t nb;
        std::memcpy(&nb, c->data + 2 * s, 2);
        const float r = f16_to_f32(nb);
        if (!std::isfinite(r) || r < 0)
          return corrupt("turboquant norm " + std::to_string(r) + " is not finite and >= 0");
      }
      KVQ_RETURN_IF_ERROR(check_padding(c->data + norms_bytes(g), static_cast<size_t>(g.streams()),
                                        code_bytes(), g.dim, bits_, "turboquant codes"));
    }
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(k.data, k.size);
    blk->values = Buffer(v.data, v.size);
    return SealedBlock{std::move(blk), accounting(g)};
  }

 private:
  void encode_vector(const float* x, float* y, uint8_t* codes, uint8_t* part, int64_t s,
                     const BlockGeometry& g) const {
    const int64_t D = g.dim;
    double nn = 0;
    for (int64_t i = 0; i < D; ++i) nn += static_cast<double>(x[i]) * x[i];
    const float r = static_cast<float>(std::sqrt(nn));
    const uint16_t rb = f32_to_f16(r);
    std::memcpy(part + 2 * s, &rb, 2);
    const float inv = r > 0 ? 1.0f / r : 0.0f;
    tq_rotate(x, inv, signs_.data(), D, rot_, y);
    const int K = static_cast<int>(levels_.size());
    for (int64_t i = 0; i < D; ++i)
      codes[i] = static_cast<uint8_t>(nearest_level_index(bounds_.data(), K, y[i]));
    pack_bits(codes, static_cast<size_t>(D), bits_,
              part + norms_bytes(g) + static_cast<size_t>(s) * code_bytes());
  }
  size_t code_bytes() const { return packed_size(static_cast<size_t>(shape().head_dim), bits_); }
  size_t norms_bytes(const BlockGeometry& g) const { return 2 * static_cast<size_t>(g.streams()); }
  size_t part_bytes(const BlockGeometry& g) const {
    return norms_bytes(g) + static_cast<size_t>(g.streams()) * code_bytes();
  }
  CacheBytes accounting(const BlockGeometry& g) const {
    CacheBytes c;
    c.key_codes = c.value_codes = static_cast<uint64_t>(g.streams()) * code_bytes();
    c.params = 2 * norms_bytes(g);  // the norms, keys and values
    return c;
  }

  int bits_;
  std::vector<float> levels_, bounds_;
  std::vector<float> signs_;
  int64_t rot_ = 1;
};

}  // namespace

MethodDef make_turboquant_method() {
  MethodDef m;
  m.id = 10;
  m.name = "turboquant";
  m.summary =
      "TurboQuant: random rotation, one Lloyd-Max codebook per coordinate, fp16 norm billed";
  m.params = {
      {"bits", ParamType::kInt, 3, 1, 8, {}, "bits per rotated coordinate"},
      {"residual",
       ParamType::kInt,
       0,
       0,
       1 << 20,
       {},
       "newest tokens kept exact (0: every vector quantized on arrival)"},
      {"seed", ParamType::kInt, 1, 0, 1 << 30, {}, "seed of the rotation's random signs"},
  };
  m.build = build_each_layer<TurboCodec>;
  m.test_settings = "residual=3";
  // Budget: 0.4 * 4^(2 - bits) relative squared error, the rate of uniform quantization.
  m.bit_ladder = {
      {"bits=2", 2, 0.4}, {"bits=3", 3, 0.1}, {"bits=4", 4, 0.025}, {"bits=8", 8, 1e-4}};
  return m;
}

}  // namespace kvq
