// BlockLayerCache — the machinery every kvq method shares: the fp16 residual window, sealing of
// whole blocks at absolute positions, trim/reset/clone, byte accounting, read and attention.
// A method supplies policy only: how a block of tokens is sealed into packed form (a
// SealedBlock) and, optionally, what it learns from the queries.
//
// Token layout of a layer holding `offset` tokens, with block length T and residual R:
//
//   [ block 0 | block 1 | ... | block n-1 | window pages (fp16/bf16) ........ ]
//   0         T         2T    (n-1)T      nT = sealed_tokens               offset
//
// Block n is sealed as soon as offset >= (n + 1) * T + R: the newest R tokens, and the
// unfinished block, always stay in full precision. Because this depends only on absolute
// positions, appending in one call, in chunks or token by token gives identical blocks.
// The window is held in pages of P tokens (P divides T), allocated when their first token
// arrives and freed when their block is sealed; resident window bytes are whole pages.
#pragma once

#include <deque>
#include <memory>
#include <vector>

#include "kvq/cache.h"

namespace kvq {

// A heap buffer of exactly `size` bytes: what it holds is what is resident.
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(size_t size) : data_(size ? new uint8_t[size]() : nullptr), size_(size) {}
  Buffer(const Buffer& o) : Buffer(o.size_) {
    if (size_) std::copy(o.data_.get(), o.data_.get() + size_, data_.get());
  }
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

// Tokens [t0, t0 + T) of one layer, every (b, h) stream, in a method's packed form.
class SealedBlock {
 public:
  virtual ~SealedBlock() = default;
  // Stream (b, h) dequantized into out [T, D] (fp32, token-major).
  virtual void dequant_keys(int64_t b, int64_t h, float* out) const = 0;
  virtual void dequant_values(int64_t b, int64_t h, float* out) const = 0;
  // Accounting from the block's geometry and parameters (the `elements` field is left 0).
  virtual CacheBytes bytes() const = 0;
  // Sizes of the buffers the block owns, measured. Must equal bytes().total(); tested.
  virtual uint64_t resident_bytes() const = 0;
  virtual std::unique_ptr<SealedBlock> clone(CloneMemo& memo) const = 0;
  // The key (keys = true) or value part in the method's documented stored layout, appended to
  // out. The method's deserialize_block() must rebuild an identical block from the two parts.
  virtual void serialize(bool keys, std::vector<uint8_t>& out) const = 0;
};

// Checks stored fp16 (scale, zero) pairs: finite, scale > 0. `what` names them in errors.
Status validate_quant_params(const uint8_t* params, size_t n_pairs, const char* what);

struct BlockGeometry {
  int64_t batch = 0;   // B
  int64_t heads = 0;   // H_kv
  int64_t tokens = 0;  // T, tokens per block
  int64_t dim = 0;     // D
  int64_t stream_elems() const { return tokens * dim; }
  int64_t elems() const { return batch * heads * tokens * dim; }
};

class BlockLayerCache : public LayerCache {
 public:
  static constexpr int64_t kMaxTokens = int64_t{1} << 31;

  Status append(const TensorView& k, const TensorView& v, const TensorView* q) final;
  int64_t offset() const final { return offset_; }
  int64_t batch() const final { return batch_; }
  const LayerShape& shape() const final { return shape_; }
  Status read(int64_t t0, int64_t n, const MutTensorView& k_out,
              const MutTensorView& v_out) const final;
  Status attend(const TensorView& q, float scale, const MutTensorView& out, int kv_head_begin,
                int kv_head_end) const override;
  Status trim(int64_t n) final;
  void reset() final;
  CacheBytes bytes() const final;
  uint64_t resident_bytes() const final;
  const Spec& spec() const final { return spec_; }

  DType window_dtype() const final { return window_dtype_; }
  int64_t n_blocks() const final { return static_cast<int64_t>(blocks_.size()); }
  Status export_blocks(int64_t first_block, ChunkSink& sink) const final;
  Status export_tail(ChunkSink& sink) const final;
  Status import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                       DType window_dtype) final;

  int64_t block_tokens() const { return block_tokens_; }
  int64_t residual() const { return residual_; }
  int64_t sealed_tokens() const final {
    return static_cast<int64_t>(blocks_.size()) * block_tokens_;
  }
  const SealedBlock& block(int64_t i) const { return *blocks_[static_cast<size_t>(i)]; }
  BlockGeometry geometry() const {
    return {batch_, shape_.n_kv_heads, block_tokens_, shape_.head_dim};
  }

 protected:
  // page_tokens must divide block_tokens. residual >= 0. A block length beyond any reachable
  // offset (e.g. the fp16 method) means nothing is ever sealed.
  BlockLayerCache(Spec spec, LayerShape shape, int64_t block_tokens, int64_t page_tokens,
                  int64_t residual);
  // Deep copy for clone(): blocks are cloned through the memo.
  BlockLayerCache(const BlockLayerCache& other, CloneMemo& memo);

  // ---- method policy ----
  // Seals block `index` (tokens [index*T, (index+1)*T)) from fp32 k, v [B, H, T, D], contiguous.
  // Called only with validated, finite data; must not fail.
  virtual std::unique_ptr<SealedBlock> seal(int64_t index, const float* k, const float* v) = 0;
  // Checks before an append changes anything (e.g. an XQuant reuse layer needs its anchor),
  // given the batch size the append will have (the cache's, or the incoming one on the first
  // append, before it is fixed) and the number of new tokens.
  virtual Status precheck_append(int64_t /*batch*/, int64_t /*n_new*/) const { return ok_status(); }
  // Called for each run of new tokens [pos0, pos0 + n) once they are in the window and before
  // any block they complete is sealed. Runs end at seal points, so what a method sees does not
  // depend on how the caller chunked its appends. q: the run's queries [B, H_q, n, D] or null.
  virtual void on_tokens(int64_t /*pos0*/, int64_t /*n*/, const TensorView* /*q*/) {}
  // Called once at the end of every successful append (methods release per-call scratch here).
  virtual void on_append_done() {}
  virtual void on_trim(int64_t /*new_offset*/) {}
  virtual void on_reset() {}
  // Method state held outside blocks (e.g. ZipCache's saliency probes): accounted as meta, and
  // its measured resident size.
  virtual uint64_t extra_bytes() const { return 0; }
  virtual uint64_t extra_resident_bytes() const { return 0; }
  // Rebuilds block `index` from its serialized parts for a cache of geometry g; validates
  // everything (sizes, padding bits, parameters) and returns kCorrupt on any inconsistency.
  virtual Result<std::unique_ptr<SealedBlock>> deserialize_block(int64_t index,
                                                                 const BlockGeometry& g,
                                                                 const ChunkRef& keys,
                                                                 const ChunkRef& values) const = 0;
  // Method state outside blocks (kState chunk); empty by default.
  virtual void export_state(std::vector<uint8_t>& /*out*/) const {}
  // Validates (commit = false) or applies (commit = true, after a successful validation) a
  // kState chunk for a cache of `batch` sequences holding `offset` tokens.
  virtual Status import_state(const uint8_t* /*data*/, size_t size, int64_t /*batch*/,
                              int64_t /*offset*/, bool /*commit*/) {
    return size == 0 ? ok_status() : corrupt("unexpected method state for " + spec().method_name());
  }

  // ---- helpers for methods ----
  // Keys/values of stream (b, h) at positions [t0, t0 + n), as the model sees them (sealed
  // tokens dequantized, window tokens converted), fp32 [n, D].
  void gather(bool keys, int64_t b, int64_t h, int64_t t0, int64_t n, float* out) const;

 private:
  // fp32 [B, H, T, D] of the first T window tokens (the next block to seal).
  void window_block_f32(std::vector<float>& k, std::vector<float>& v) const;
  size_t page_bytes() const;  // one page of K (or of V)
  void store_window_token(const TensorView& src, int64_t s, int64_t pos, bool keys);
  void window_row_f32(bool keys, int64_t b, int64_t h, int64_t pos, float* out) const;

  Spec spec_;
  LayerShape shape_;
  int64_t block_tokens_;
  int64_t page_tokens_;
  int64_t residual_;

  int64_t batch_ = 0;
  int64_t offset_ = 0;
  DType window_dtype_ = DType::kF16;
  std::vector<std::unique_ptr<SealedBlock>> blocks_;
  std::deque<Buffer> k_pages_, v_pages_;  // page i: tokens sealed_tokens() + i*P ..., [B, H, P, D]
};

// The window page length for blocks of T tokens: the largest divisor of T not above 32, so
// the fp16 window is billed in small pages even when blocks are long.
int64_t window_page_tokens(int64_t block_tokens);

// Shared checks for appended K/V (and optional Q) against a layer shape and batch size.
Status validate_append(const LayerShape& shape, int64_t batch, const TensorView& k,
                       const TensorView& v, const TensorView* q);

}  // namespace kvq
