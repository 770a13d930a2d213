// BlockCodec — a method, as one layer's policy and stored layout. Backends (the CPU layer cache
// in src/cache/layer.h; a CUDA twin later) own the rules (Ledger) and the storage; the codec says
// how a block of T tokens becomes bytes and back, and what a method learns from the tokens on
// the way (ZipCache's probe queries, CacheGen's tables, XQuant's anchor codes).
//
// Stored layout. A sealed block is two byte strings, its key part and its value part, in the
// method's documented layout (docs/methods/<name>.md). They are what the cache holds, what
// bytes() bills and what the .kvq container stores, byte for byte, so a block exported by one
// backend imports into another. encode/decode below are the scalar definitions (`_ref` in
// ggml's sense): every faster path (SIMD, CUDA) is tested bit-exact against them for stored
// bytes, and within a stated tolerance for dequantized values.
//
// Shapes: a block holds S = B * H streams; stream s = b * H + h is [T, D] token-major.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "kvq/group_quant.h"
#include "kvq/workspace.h"

namespace kvq {

// A heap buffer of exactly `size` bytes: what it holds is what is resident.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t size) : data_(size ? new uint8_t[size]() : nullptr), size_(size) {}
  Buffer(const uint8_t* p, size_t size) : Buffer(size) {
    if (size_) std::copy(p, p + size, data_.get());
  }
  Buffer(const Buffer& o) : Buffer(o.data(), o.size_) {}
  Buffer& operator=(const Buffer& o) {
    if (this != &o) *this = Buffer(o);
    return *this;
  }
  Buffer(Buffer&&) noexcept = default;
  Buffer& operator=(Buffer&&) noexcept = default;

  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }

 private:
  std::unique_ptr<uint8_t[]> data_;
  size_t size_ = 0;
};

struct BlockGeometry {
  int64_t batch = 0;   // B
  int64_t heads = 0;   // H_kv
  int64_t tokens = 0;  // T, tokens per block
  int64_t dim = 0;     // D
  int64_t streams() const { return batch * heads; }
  int64_t stream_elems() const { return tokens * dim; }
  int64_t elems() const { return batch * heads * tokens * dim; }
};

// One sealed block's bytes. `linked` is another layer's block that this one reads (an XQuant
// reuse block reads its anchor's codes); it is billed by its own layer, never here.
struct BlockData {
  Buffer keys, values;
  std::shared_ptr<const BlockData> linked;
};

// A block as the codec builds it: its bytes and their accounting by kind (elements left 0;
// key_codes + value_codes + params + meta == keys.size() + values.size()).
struct SealedBlock {
  std::shared_ptr<const BlockData> data;
  CacheBytes bytes;
};

// What a codec may read of its layer while tokens arrive (the CPU layer implements it).
class LayerReader {
 public:
  virtual ~LayerReader() = default;
  virtual int64_t batch() const = 0;
  virtual int64_t offset() const = 0;
  virtual int64_t sealed_tokens() const = 0;
  // Keys (keys = true) or values of stream (b, h) at positions [t0, t0 + n) as held now (sealed
  // tokens dequantized, window tokens converted): fp32 [n, D].
  virtual void gather(bool keys, int64_t b, int64_t h, int64_t t0, int64_t n, float* out,
                      Workspace& ws) const = 0;
};

// A run of new tokens [pos0, pos0 + n), in the window and not yet sealed; q: their queries
// [B, H_q, n, D] or null. `append_end` is the offset the whole append will reach, `ws` the
// append's workspace (allocations stay valid until the append ends).
struct TokenRun {
  int64_t pos0 = 0, n = 0, append_end = 0;
  const TensorView* q = nullptr;
};

class BlockCodec {
 public:
  BlockCodec(Spec spec, LayerShape shape, int64_t block_tokens, int64_t residual);
  virtual ~BlockCodec() = default;
  BlockCodec(const BlockCodec&) = default;

  const Spec& spec() const { return spec_; }
  const LayerShape& shape() const { return shape_; }
  int64_t block_tokens() const { return block_tokens_; }
  int64_t residual() const { return residual_; }
  // Window page length (divides block_tokens()).
  virtual int64_t page_tokens() const;
  // How the layer holds its window rows (16-bit, or kvq's window=q8 rows). The sealing path
  // encodes from the rows as held, so a block sealed from q8 rows encodes their 8-bit values.
  virtual WindowFormat window_format() const { return WindowFormat::k16Bit; }

  // ---- the codec proper ----
  // Seals block `index` from k, v fp32 [B, H, T, D], contiguous, finite, |x| <= 65504.
  // Must not fail (input is validated by the layer).
  virtual SealedBlock encode(int64_t index, const BlockGeometry& g, const float* k, const float* v,
                             Workspace& ws) = 0;
  // Stream (b, h) of block `index`'s keys (keys = true) or values, dequantized: out fp32 [T, D].
  virtual void decode(const BlockData& blk, int64_t index, bool keys, int64_t b, int64_t h,
                      const BlockGeometry& g, float* out, Workspace& ws) const = 0;
  // Attention in the codec's basis (optional). A codec whose decoded keys or values are M^T y
  // for an orthonormal M applied per row (kvq's Walsh-Hadamard rotations) lets the attention
  // kernel skip the per-row M^T for sealed blocks: scores against keys in the basis take the
  // query in it (q . M^T y = (M q) . y), and softmax-weighted values are summed in it and mapped
  // back once per output row (sum_t p_t M^T y_t = M^T sum_t p_t y_t). Exact (window) rows stay
  // in the model's basis and are accumulated apart; a tile that mixes sealed and exact rows maps
  // its exact rows into the basis. The result differs from decode-then-attend by rounding only.
  struct AttendBasis {
    bool keys = false, values = false;
  };
  virtual AttendBasis attend_basis() const { return {}; }
  // decode(), with the stream left in the basis: y = M x for every row (exact rows mapped in).
  virtual void decode_in_basis(const BlockData& blk, int64_t index, bool keys, int64_t b,
                               int64_t h, const BlockGeometry& g, float* out,
                               Workspace& ws) const {
    decode(blk, index, keys, b, h, g, out, ws);
  }
  // rows [n, D] <- M rows, and one row <- M^T row (keys or values' basis).
  virtual void to_basis(bool /*keys*/, float* /*rows*/, int64_t /*n*/) const {}
  virtual void from_basis(bool /*keys*/, float* /*row*/) const {}
  // The key or value part in the stored layout, appended to out (default: the part itself).
  virtual void serialize(const BlockData& blk, bool keys, std::vector<uint8_t>& out) const;
  // Rebuilds block `index` from its serialized parts for geometry g. Validates everything
  // (sizes before allocating, padding bits, parameters, coded streams) and returns kCorrupt on
  // any inconsistency; a successful load re-serializes to the same bytes. During an import,
  // blocks arrive in order from 0; a codec may stage what later blocks need (CacheGen's tables)
  // and must make it current only in end_import(true).
  virtual Result<SealedBlock> load(int64_t index, const BlockGeometry& g, const ChunkRef& keys,
                                   const ChunkRef& values) = 0;
  // Ends an import: commit = true when every chunk validated and the layer now holds the loaded
  // blocks; false when the import failed and the layer kept its previous state.
  virtual void end_import(bool /*commit*/) {}

  // ---- policy hooks (defaults: nothing) ----
  // Checks before an append changes anything (e.g. an XQuant reuse layer needs its anchor),
  // given the batch the append will have, its token count and the layer's ledger state.
  virtual Status precheck_append(int64_t batch, int64_t n_new, int64_t offset,
                                 int64_t n_blocks) const;
  // Each run of new tokens, once in the window and before any block it completes is sealed.
  // Runs end at seal points, so what a codec sees does not depend on the caller's chunking.
  virtual void on_tokens(const TokenRun& run, const LayerReader& layer, Workspace& ws);
  // Called at the end of every successful append.
  virtual void on_append_done() {}
  // After a trim to new_offset that keeps `keep_blocks` sealed blocks, and after reset.
  virtual void on_trim(int64_t new_offset, int64_t keep_blocks);
  virtual void on_reset() {}
  // Method state held outside blocks (e.g. saliency probes): billed as meta, and its measured
  // resident size (the two must agree).
  virtual uint64_t extra_bytes() const { return 0; }
  virtual uint64_t extra_resident_bytes() const { return 0; }
  // Lookup tables derived from the shape that the codec keeps to run (CacheBytes::tables):
  // measured heap bytes; a table shared by several layers is billed by one of them.
  virtual uint64_t table_bytes() const { return 0; }
  // Method state outside blocks (the kState chunk); empty by default.
  virtual void export_state(std::vector<uint8_t>& out) const;
  // Validates (commit = false) or applies (commit = true, after a successful validation) a state
  // chunk for a layer of `batch` sequences holding `offset` tokens.
  virtual Status import_state(const uint8_t* data, size_t size, int64_t batch, int64_t offset,
                              bool commit);
  // "key=value" lines for stats(); `blocks` are the layer's sealed blocks.
  virtual std::string stats(const std::vector<std::shared_ptr<const BlockData>>& blocks,
                            const BlockGeometry& g) const;

  // The layer whose stored codes this layer's sealed blocks read (an XQuant reuse layer's
  // anchor), or -1 when its blocks are self-contained. Backends that hold blocks themselves (the
  // CUDA backend) link a reuse layer's blocks to that layer's.
  virtual int shared_codes_layer() const { return -1; }

  // Deep copy for ModelCache::clone (shared state through the memo).
  virtual std::unique_ptr<BlockCodec> clone(CloneMemo& memo) const = 0;

 private:
  Spec spec_;
  LayerShape shape_;
  int64_t block_tokens_, residual_;
};

// Helpers shared by codecs.
// Checks stored fp16 (scale, zero) pairs: finite, scale > 0. `what` names them in errors.
Status validate_quant_params(const uint8_t* params, size_t n_pairs, const char* what);
// Unused high bits of each of `streams` packed streams of `stream_bytes` bytes (n codes of `bits`
// bits each) must be zero, so a block serializes to exactly one byte string.
Status check_padding(const uint8_t* codes, size_t streams, size_t stream_bytes, int64_t n, int bits,
                     const char* what);
// Stored fp16 parameter pairs as an aligned array: `p` itself when aligned, else a copy in ws.
const QuantParams* params_at(const uint8_t* p, size_t bytes, Workspace& ws);
// A deep copy of a block through the memo: every block (and what it links to) is copied once
// per memo, so copies share exactly as the originals do.
std::shared_ptr<const BlockData> clone_block(const std::shared_ptr<const BlockData>& b,
                                             CloneMemo& memo);
// The per-model builder of methods whose layers are independent: one Codec(spec, shape) each.
template <class Codec>
Result<std::vector<std::unique_ptr<BlockCodec>>> build_each_layer(const std::vector<Spec>& specs,
                                                                  const ModelShape& shape) {
  std::vector<std::unique_ptr<BlockCodec>> layers;
  for (int i = 0; i < shape.n_layers; ++i)
    layers.push_back(std::make_unique<Codec>(specs[static_cast<size_t>(i)], shape.at(i)));
  return layers;
}

}  // namespace kvq
