// llama.cpp's KV-cache formats as kvq methods: q8_0, q4_0, q4_1, q5_0 and iq4_nl, the block
// types of ggml (llama.cpp's tensor library) that `llama-cli -ctk TYPE -ctv TYPE` stores keys and
// values in. Each token's head vector is cut into blocks of 32 values along head_dim, and each
// block is quantized by ggml's reference definition (its `quantize_row_<type>_ref`), so the bytes
// are byte-for-byte ggml's for the same input (tested against vectors produced by ggml itself):
//
//   type    block bytes  bits/elem  layout (little-endian)          value
//   q8_0    34           8.5        fp16 d, int8 q[32]               d * q
//   q4_0    18           4.5        fp16 d, u8 qs[16]                d * (q - 8)
//   q4_1    20           5.0        fp16 d, fp16 m, u8 qs[16]        d * q + m
//   q5_0    22           5.5        fp16 d, u8 qh[4], u8 qs[16]      d * (q - 16)
//   iq4_nl  18           4.5        fp16 d, u8 qs[16]                d * kvalues_iq4nl[q]
//
// 4-bit codes: qs[j] holds value j in its low nibble and value j + 16 in its high nibble; q5_0's
// fifth bits are bit j of qh (u32) for value j. iq4_nl's 16 levels are ggml's non-uniform table
// (-127 ... 113); its scale is the weighted least-squares fit of the codes chosen with the
// max-based scale (weights x^2), as the reference does without search. (For an all-zero block
// ggml's reference leaves the codes undefined — it packs an array it never wrote — with scale 0;
// kvq writes zero codes, which decode to the same zeros.)
//
// Rotation (`rot=on`, llama.cpp's default since it added attention rotation): keys and values are
// multiplied by the orthonormal Walsh-Hadamard matrix before quantization, keys in blocks of the
// largest power of two >= 64 dividing head_dim, values in blocks of 64 (llama.cpp's choices),
// whenever head_dim is a multiple of 64; LLAMA_ATTN_ROT_DISABLE=1 is `rot=off`. The matrix is
// its own inverse, so decoding applies it again: attention sees the same scores and outputs as
// llama.cpp's rotated queries and outputs, up to float rounding. kvq computes the rotation with
// a fast Walsh-Hadamard transform (llama.cpp: a matrix product), so a rotated vector can differ
// from llama.cpp's in the last bit; the quantizers themselves are exact.
//
// Blocks are one token (every token is quantized on arrival, as in llama.cpp), so with the default
// `residual=0` a query sees its own key quantized — llama.cpp's decode semantics. `residual=R`
// keeps the newest R tokens exact.
//
// Stored layout of one sealed token (S = B * H streams, D = head_dim, nb = D / 32):
//   key part    S x nb ggml blocks of the key type, stream-major
//   value part  S x nb ggml blocks
// Accounting: fp16 d (and m) are params, the rest codes.
#include <cmath>
#include <cstring>

#include "cache/codec.h"
#include "core/cpu.h"
#include "methods/ggml_rows.h"
#include "kvq/dtype.h"
#include "kvq/spec.h"
#include "numerics/hadamard.h"

namespace kvq {

namespace {

enum class GgmlType { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kIq4Nl };

constexpr int kQK = 32;  // values per ggml block

// ggml's non-uniform 4-bit levels (kvalues_iq4nl in ggml-common.h).
constexpr int8_t kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

struct TypeInfo {
  const char* name;
  size_t block_bytes;
  size_t param_bytes;  // fp16 d (and m)
};
constexpr TypeInfo kInfo[] = {
    {"q8_0", 34, 2}, {"q4_0", 18, 2}, {"q4_1", 20, 4}, {"q5_0", 22, 2}, {"iq4_nl", 18, 2}};
const TypeInfo& info(GgmlType t) { return kInfo[static_cast<int>(t)]; }

KVQ_ALWAYS_INLINE void put_f16(uint8_t* p, float x) {
  const uint16_t h = f32_to_f16(x);
  std::memcpy(p, &h, 2);
}
KVQ_ALWAYS_INLINE float get_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// ggml's nearest level of a sorted table (best_index_int8): ties go to the upper level.
KVQ_ALWAYS_INLINE int nearest_level(const int8_t* val, float x) {
  if (x <= val[0]) return 0;
  if (x >= val[15]) return 15;
  int lo = 0, hi = 15;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (x < val[mid])
      hi = mid;
    else
      lo = mid;
  }
  return x - val[hi - 1] < val[hi] - x ? hi - 1 : hi;
}

// max |x| over a block, in 8 lanes (vectorizes; max of non-negative non-NaN values is exact in
// any order, so it equals ggml's sequential loop).
KVQ_ALWAYS_INLINE float block_absmax(const float* x) {
  float m[8];
  for (int l = 0; l < 8; ++l) m[l] = std::fabs(x[l]);
  for (int j = 8; j < kQK; j += 8)
    for (int l = 0; l < 8; ++l) m[l] = std::max(m[l], std::fabs(x[j + l]));
  for (int w = 4; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) m[l] = std::max(m[l], m[l + w]);
  return m[0];
}

// The largest-magnitude value of a block and its sign ("max" in ggml: the first of equal |x|).
KVQ_ALWAYS_INLINE float signed_absmax(const float* x) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQK; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  return max;
}

// roundf (halves away from zero) of |y| < 2^23, as integer arithmetic that vectorizes (the
// library call does not): t = trunc(y) and y - t are exact.
KVQ_ALWAYS_INLINE int round_half_away(float y) {
  const int t = static_cast<int>(y);
  const float f = y - static_cast<float>(t);
  return t + (f >= 0.5f) - (f <= -0.5f);
}

// One block of 32 values into ggml's bytes. Float operations are ggml's, one rounding each (the
// reference is written without fused multiply-adds; kvq builds with contraction off). Inlined
// into the per-level row clones below (element-wise IEEE arithmetic: every level agrees).
KVQ_ALWAYS_INLINE void quantize_block(GgmlType t, const float* x, uint8_t* out) {
  switch (t) {
    case GgmlType::kQ8_0: {
      const float amax = block_absmax(x);
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      put_f16(out, d);
      for (int j = 0; j < kQK; ++j)
        out[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(round_half_away(x[j] * id)));
      return;
    }
    case GgmlType::kQ4_0: {
      const float d = signed_absmax(x) / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      put_f16(out, d);
      for (int j = 0; j < kQK / 2; ++j) {
        const float x0 = x[j] * id, x1 = x[j + 16] * id;
        const uint8_t q0 =
            static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x0 + 8.5f))));
        const uint8_t q1 =
            static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x1 + 8.5f))));
        out[2 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
      }
      return;
    }
    case GgmlType::kQ4_1: {
      float lo = x[0], hi = x[0];
      for (int j = 1; j < kQK; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
      const float d = (hi - lo) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      put_f16(out, d);
      put_f16(out + 2, lo);
      for (int j = 0; j < kQK / 2; ++j) {
        const float x0 = (x[j] - lo) * id, x1 = (x[j + 16] - lo) * id;
        const uint8_t q0 =
            static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x0 + 0.5f))));
        const uint8_t q1 =
            static_cast<uint8_t>(std::min(15, static_cast<int>(static_cast<int8_t>(x1 + 0.5f))));
        out[4 + j] = static_cast<uint8_t>(q0 | (q1 << 4));
      }
      return;
    }
    case GgmlType::kQ5_0: {
      const float d = signed_absmax(x) / -16.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      put_f16(out, d);
      uint32_t qh = 0;
      for (int j = 0; j < kQK / 2; ++j) {
        const float x0 = x[j] * id, x1 = x[j + 16] * id;
        const uint8_t q0 =
            static_cast<uint8_t>(std::min(31, static_cast<int>(static_cast<int8_t>(x0 + 16.5f))));
        const uint8_t q1 =
            static_cast<uint8_t>(std::min(31, static_cast<int>(static_cast<int8_t>(x1 + 16.5f))));
        out[6 + j] = static_cast<uint8_t>((q0 & 0x0F) | ((q1 & 0x0F) << 4));
        qh |= static_cast<uint32_t>((q0 & 0x10u) >> 4) << j;
        qh |= static_cast<uint32_t>((q1 & 0x10u) >> 4) << (j + 16);
      }
      std::memcpy(out + 2, &qh, 4);
      return;
    }
    case GgmlType::kIq4Nl: {
      std::memset(out + 2, 0, 16);
      float amax = 0.0f, max = 0.0f;
      for (int j = 0; j < kQK; ++j)
        if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), max = x[j];
      if (amax < 1e-15f) {  // ggml's GROUP_MAX_EPS: an all-zero block
        put_f16(out, 0.0f);
        return;
      }
      const float d0 = max / kIq4Levels[0], id = 1.0f / d0;
      uint8_t L[kQK];
      float sumqx = 0.0f, sumq2 = 0.0f;
      for (int j = 0; j < kQK; ++j) {
        const float al = id * x[j];
        L[j] = static_cast<uint8_t>(nearest_level(kIq4Levels, al));
        const float q = kIq4Levels[L[j]], w = x[j] * x[j];
        sumqx += w * q * x[j];
        sumq2 += w * q * q;
      }
      const float d = sumq2 > 0.0f ? sumqx / sumq2 : 0.0f;
      put_f16(out, d);
      for (int j = 0; j < kQK / 2; ++j) out[2 + j] = static_cast<uint8_t>(L[j] | (L[j + 16] << 4));
      return;
    }
  }
}

KVQ_ALWAYS_INLINE void dequantize_block(GgmlType t, const uint8_t* in, float* y) {
  const float d = get_f16(in);
  switch (t) {
    case GgmlType::kQ8_0:
      for (int j = 0; j < kQK; ++j) y[j] = d * static_cast<float>(static_cast<int8_t>(in[2 + j]));
      return;
    case GgmlType::kQ4_0:
      for (int j = 0; j < kQK / 2; ++j) {
        y[j] = d * static_cast<float>((in[2 + j] & 0x0F) - 8);
        y[j + 16] = d * static_cast<float>((in[2 + j] >> 4) - 8);
      }
      return;
    case GgmlType::kQ4_1: {
      const float m = get_f16(in + 2);
      for (int j = 0; j < kQK / 2; ++j) {
        y[j] = d * static_cast<float>(in[4 + j] & 0x0F) + m;
        y[j + 16] = d * static_cast<float>(in[4 + j] >> 4) + m;
      }
      return;
    }
    case GgmlType::kQ5_0: {
      uint32_t qh;
      std::memcpy(&qh, in + 2, 4);
      for (int j = 0; j < kQK / 2; ++j) {
        const int q0 = (in[6 + j] & 0x0F) | static_cast<int>(((qh >> j) & 1u) << 4);
        const int q1 = (in[6 + j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
        y[j] = d * static_cast<float>(q0 - 16);
        y[j + 16] = d * static_cast<float>(q1 - 16);
      }
      return;
    }
    case GgmlType::kIq4Nl:
      for (int j = 0; j < kQK / 2; ++j) {
        y[j] = d * static_cast<float>(kIq4Levels[in[2 + j] & 0x0F]);
        y[j + 16] = d * static_cast<float>(kIq4Levels[in[2 + j] >> 4]);
      }
      return;
  }
}

// y = H x for the orthonormal Walsh-Hadamard matrix of order n (a power of two), in place: the
// unnormalized butterflies, then one scaling by 1/sqrt(n) (numerics/hadamard.h: the same sums in
// the same order at every SIMD level, so the clones below agree bit for bit).
KVQ_ALWAYS_INLINE void hadamard(float* x, int64_t n) { hadamard_inplace(x, n); }

// One head vector [D] to its ggml blocks (rotated first when rot > 0) and back, compiled once
// per SIMD level (core/cpu.h): the library's baseline is SSE2, where the butterflies and the
// per-block loops ran several times slower than at AVX2/AVX-512.
template <SimdLevel L>
KVQ_ALWAYS_INLINE void ggml_encode_row_body(GgmlType t, const float* x, int64_t D, int64_t rot,
                                            float* scratch, uint8_t* out) {
  const float* src = x;
  if (rot) {
    std::memcpy(scratch, x, static_cast<size_t>(D) * 4);
    for (int64_t i = 0; i < D; i += rot) hadamard(scratch + i, rot);
    src = scratch;
  }
  const size_t bb = info(t).block_bytes;
  for (int64_t i = 0; i < D / kQK; ++i)
    quantize_block(t, src + i * kQK, out + static_cast<size_t>(i) * bb);
}
template <SimdLevel L>
KVQ_ALWAYS_INLINE void ggml_decode_row_body(GgmlType t, const uint8_t* row, int64_t D, int64_t rot,
                                            float* out) {
  const size_t bb = info(t).block_bytes;
  for (int64_t i = 0; i < D / kQK; ++i)
    dequantize_block(t, row + static_cast<size_t>(i) * bb, out + i * kQK);
  if (rot)
    for (int64_t i = 0; i < D; i += rot) hadamard(out + i, rot);
}
KVQ_LEVEL_CLONES(void, ggml_encode_row,
                 (GgmlType t, const float* x, int64_t D, int64_t rot, float* scratch,
                  uint8_t* out),
                 (t, x, D, rot, scratch, out))
KVQ_LEVEL_CLONES(void, ggml_decode_row,
                 (GgmlType t, const uint8_t* row, int64_t D, int64_t rot, float* out),
                 (t, row, D, rot, out))
void ggml_encode_row(GgmlType t, const float* x, int64_t D, int64_t rot, float* scratch,
                     uint8_t* out) {
  KVQ_LEVEL_DISPATCH(ggml_encode_row, (t, x, D, rot, scratch, out));
}
void ggml_decode_row(GgmlType t, const uint8_t* row, int64_t D, int64_t rot, float* out) {
  KVQ_LEVEL_DISPATCH(ggml_decode_row, (t, row, D, rot, out));
}

}  // namespace

namespace ggml_rows {
static_assert(static_cast<int>(Type::kIq4Nl) == static_cast<int>(GgmlType::kIq4Nl));
size_t block_bytes(Type t) { return info(static_cast<GgmlType>(t)).block_bytes; }
void quantize(Type t, const float* x, int64_t n, int64_t D, int64_t rot, uint8_t* out) {
  KVQ_CHECK(D % kQK == 0 && (rot == 0 || (D <= 4096 && D % rot == 0)));
  float scratch[4096];
  const size_t row = static_cast<size_t>(D / kQK) * block_bytes(t);
  for (int64_t i = 0; i < n; ++i)
    ggml_encode_row(static_cast<GgmlType>(t), x + i * D, D, rot, scratch,
                    out + static_cast<size_t>(i) * row);
}
void dequantize(Type t, const uint8_t* in, int64_t n, int64_t D, int64_t rot, float* out) {
  KVQ_CHECK(D % kQK == 0 && (rot == 0 || D % rot == 0));
  const size_t row = static_cast<size_t>(D / kQK) * block_bytes(t);
  for (int64_t i = 0; i < n; ++i)
    ggml_decode_row(static_cast<GgmlType>(t), in + static_cast<size_t>(i) * row, D, rot,
                    out + i * D);
}
}  // namespace ggml_rows

namespace {

class GgmlCodec final : public BlockCodec {
 public:
  GgmlCodec(const Spec& spec, const LayerShape& shape, GgmlType type)
      : BlockCodec(spec, shape, 1, spec.get_int("residual")), type_(type) {
    const int64_t D = shape.head_dim;
    if (spec.get_enum("rot") == "on" && D % 64 == 0) {
      rot_v_ = 64;
      rot_k_ = 64;
      while (D % (2 * rot_k_) == 0) rot_k_ *= 2;
    }
  }
  std::unique_ptr<BlockCodec> clone(CloneMemo&) const override {
    return std::make_unique<GgmlCodec>(*this);
  }

  SealedBlock encode(int64_t, const BlockGeometry& g, const float* k, const float* v,
                     Workspace& ws) override {
    Workspace::Frame frame(ws);
    const size_t part = part_bytes(g);
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(part);
    blk->values = Buffer(part);
    float* x = ws.alloc<float>(static_cast<size_t>(g.dim));
    for (int64_t s = 0; s < g.streams(); ++s) {  // T = 1: stream s is one head vector
      encode_vector(k + s * g.dim, rot_k_, x,
                    blk->keys.data() + static_cast<size_t>(s) * row_bytes(g));
      encode_vector(v + s * g.dim, rot_v_, x,
                    blk->values.data() + static_cast<size_t>(s) * row_bytes(g));
    }
    return {std::move(blk), accounting(g)};
  }

  void decode(const BlockData& blk, int64_t, bool keys, int64_t b, int64_t h,
              const BlockGeometry& g, float* out, Workspace&) const override {
    const size_t s = static_cast<size_t>(b * g.heads + h);
    const uint8_t* row = (keys ? blk.keys.data() : blk.values.data()) + s * row_bytes(g);
    ggml_decode_row(type_, row, g.dim, keys ? rot_k_ : rot_v_, out);
  }

  Result<SealedBlock> load(int64_t, const BlockGeometry& g, const ChunkRef& k,
                           const ChunkRef& v) override {
    const size_t part = part_bytes(g);
    if (k.size != part || v.size != part)
      return corrupt(std::string(info(type_).name) + " token needs " + std::to_string(part) +
                     " key and value bytes, got " + std::to_string(k.size) + " and " +
                     std::to_string(v.size));
    // Scales (and q4_1's minimum) must be finite: a block's d is its first field.
    for (const ChunkRef* c : {&k, &v})
      for (size_t off = 0; off < part; off += info(type_).block_bytes) {
        const float d = get_f16(c->data + off);
        const float m = type_ == GgmlType::kQ4_1 ? get_f16(c->data + off + 2) : 0.0f;
        if (!std::isfinite(d) || !std::isfinite(m))
          return corrupt(std::string(info(type_).name) + " block scale " + std::to_string(d) +
                         " is not finite");
      }
    auto blk = std::make_shared<BlockData>();
    blk->keys = Buffer(k.data, k.size);
    blk->values = Buffer(v.data, v.size);
    return SealedBlock{std::move(blk), accounting(g)};
  }

 private:
  void encode_vector(const float* x, int64_t rot, float* scratch, uint8_t* out) const {
    ggml_encode_row(type_, x, shape().head_dim, rot, scratch, out);
  }
  size_t row_bytes(const BlockGeometry& g) const {
    return static_cast<size_t>(g.dim / kQK) * info(type_).block_bytes;
  }
  size_t part_bytes(const BlockGeometry& g) const {
    return static_cast<size_t>(g.streams()) * row_bytes(g);
  }
  CacheBytes accounting(const BlockGeometry& g) const {
    const uint64_t blocks = static_cast<uint64_t>(g.streams() * (g.dim / kQK));
    CacheBytes c;
    c.params = 2 * blocks * info(type_).param_bytes;
    c.key_codes = c.value_codes = blocks * (info(type_).block_bytes - info(type_).param_bytes);
    return c;
  }

  GgmlType type_;
  int64_t rot_k_ = 0, rot_v_ = 0;  // rotation block lengths (0: none)
};

template <GgmlType kType>
Result<std::vector<std::unique_ptr<BlockCodec>>> build(const std::vector<Spec>& specs,
                                                       const ModelShape& shape) {
  std::vector<std::unique_ptr<BlockCodec>> layers;
  for (int i = 0; i < shape.n_layers; ++i) {
    if (shape.at(i).head_dim % kQK != 0)
      return invalid_argument(std::string(info(kType).name) + ": head_dim " +
                              std::to_string(shape.at(i).head_dim) + " of layer " +
                              std::to_string(i) + " is not a multiple of ggml's block of 32");
    layers.push_back(
        std::make_unique<GgmlCodec>(specs[static_cast<size_t>(i)], shape.at(i), kType));
  }
  return layers;
}

template <GgmlType kType>
MethodDef make_row(uint32_t id, const char* summary, int bits, double budget) {
  MethodDef m;
  m.id = id;
  m.name = info(kType).name;
  m.summary = summary;
  m.params = {
      {"rot",
       ParamType::kEnum,
       1,
       0,
       0,
       {"off", "on"},
       "llama.cpp's Walsh-Hadamard rotation of keys and values (on: its default when head_dim is "
       "a multiple of 64)"},
      {"residual",
       ParamType::kInt,
       0,
       0,
       1 << 20,
       {},
       "newest tokens kept exact (0: every token quantized on arrival, as llama.cpp)"},
  };
  m.build = build<kType>;
  m.test_settings = "residual=3";
  // One fixed width: the table-wide check holds it to the shared budget 0.4 * 4^(2 - bits).
  m.bit_ladder = {{"", bits, budget}};
  return m;
}

}  // namespace

MethodDef make_q8_0_method() {
  return make_row<GgmlType::kQ8_0>(5, "llama.cpp's q8_0 KV type: 8-bit codes, fp16 scale per 32", 8,
                                   1e-4);
}
MethodDef make_q4_0_method() {
  return make_row<GgmlType::kQ4_0>(6, "llama.cpp's q4_0 KV type: 4-bit codes, fp16 scale per 32", 4,
                                   0.025);
}
MethodDef make_q4_1_method() {
  MethodDef m = make_row<GgmlType::kQ4_1>(
      7, "llama.cpp's q4_1 KV type: 4-bit codes, fp16 scale and min per 32", 4, 0.025);
  m.in_main_job = false;
  return m;
}
MethodDef make_q5_0_method() {
  MethodDef m = make_row<GgmlType::kQ5_0>(
      8, "llama.cpp's q5_0 KV type: 5-bit codes, fp16 scale per 32", 5, 0.00625);
  m.in_main_job = false;
  return m;
}
MethodDef make_iq4_nl_method() {
  MethodDef m = make_row<GgmlType::kIq4Nl>(
      9, "llama.cpp's iq4_nl KV type: non-uniform 4-bit levels, fp16 scale per 32", 4, 0.025);
  m.in_main_job = false;
  return m;
}

}  // namespace kvq
