// CpuLayer — the CPU backend's LayerCache: a Ledger (the rules), a CpuStore (the bytes) and a
// BlockCodec (the method). Every method runs through this one class; a method is a codec.
#pragma once

#include <memory>
#include <vector>

#include "cache/codec.h"
#include "cache/cpu_store.h"
#include "cache/ledger.h"

namespace kvq {

class CpuLayer final : public LayerCache, private LayerReader {
 public:
  CpuLayer(std::unique_ptr<BlockCodec> codec, const CacheOptions& options);

  Status append(const TensorView& k, const TensorView& v, const TensorView* q) override;
  int64_t offset() const override { return ledger_.offset(); }
  int64_t sealed_tokens() const override { return ledger_.sealed_tokens(); }
  int64_t block_tokens() const override { return ledger_.block_tokens(); }
  int64_t residual() const override { return ledger_.residual(); }
  int64_t last_append_tokens() const override { return ledger_.last_append(); }
  int64_t exact_begin() const override { return ledger_.exact_begin(); }
  int64_t sealed_tokens_for_query(int64_t p) const override { return ledger_.visible_sealed(p); }
  int64_t batch() const override { return ledger_.batch(); }
  const LayerShape& shape() const override { return shape_; }
  Status read(int64_t t0, int64_t n, const MutTensorView& k_out,
              const MutTensorView& v_out) const override;
  Status read_exact(int64_t t0, int64_t n, const MutTensorView& k_out,
                    const MutTensorView& v_out) const override;
  Status attend(const TensorView& q, float scale, const MutTensorView& out, int kv_head_begin,
                int kv_head_end, Workspace* ws) const override;
  Status trim(int64_t n) override;
  void reset() override;
  std::unique_ptr<LayerCache> clone(CloneMemo& memo) const override;
  CacheBytes bytes() const override;
  uint64_t resident_bytes() const override;
  uint64_t workspace_bytes() const override { return store_.retired_bytes(); }

  DType window_dtype() const override { return window_dtype_; }
  WindowFormat window_format() const override { return format_; }
  int64_t n_blocks() const override { return ledger_.n_blocks(); }
  const Ledger& ledger() const { return ledger_; }
  Status export_blocks(int64_t first_block, ChunkSink& sink) const override;
  Status export_tail(ChunkSink& sink) const override;
  Status import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                       DType window_dtype) override;
  const Spec& spec() const override { return codec_->spec(); }
  std::string stats() const override;

  const BlockCodec& codec() const { return *codec_; }
  BlockGeometry geometry() const {
    return {ledger_.batch(), shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  }
  // Heap allocations made for state so far (pages and blocks), for the allocation tests.
  uint64_t store_allocations() const { return store_.allocations(); }

 private:
  CpuLayer(const CpuLayer& o, CloneMemo& memo);

  // LayerReader (for the codec's hooks; offset, batch and sealed_tokens are shared above)
  void gather(bool keys, int64_t b, int64_t h, int64_t t0, int64_t n, float* out,
              Workspace& ws) const override;

  // Row `pos` of stream (b, h) of the window (or of the retired pages), fp32 [D]: the 16-bit
  // values converted, or a q8 row dequantized.
  void exact_row(bool keys, int64_t b, int64_t h, int64_t pos, float* out) const;
  // The stored bytes of that row (row_bytes_ of them).
  const uint8_t* exact_row_bytes(bool keys, int64_t b, int64_t h, int64_t pos) const;
  // Token s of src into the window at position pos; `scratch`: 2 D floats (for q8 rows).
  void store_window_token(const TensorView& src, int64_t s, int64_t pos, bool keys, float* scratch);
  // One row of D fp32 values (finite, fp16 range) into the window format; `scratch`: D floats.
  void put_row(const float* x, uint8_t* row, float* scratch) const;
  // fp32 [B, H, T, D] of the T window tokens from sealed_tokens() (the block due to seal).
  void due_block_f32(float* k, float* v) const;
  Status read_into(bool exact, int64_t t0, int64_t n, const MutTensorView& k_out,
                   const MutTensorView& v_out) const;
  // attend over KV heads [h0, h1) of batch row b.
  void attend_head(const TensorView& q, float scale, const MutTensorView& out, int64_t b, int64_t h,
                   Workspace& ws) const;

  std::unique_ptr<BlockCodec> codec_;
  CacheOptions options_;
  LayerShape shape_;
  Ledger ledger_;
  CpuStore store_;
  DType window_dtype_ = DType::kF16;
  WindowFormat format_ = WindowFormat::k16Bit;  // the codec's, fixed
  size_t row_bytes_ = 0;                        // window_row_bytes(format_, D)
};

// Shared checks for appended K/V (and optional Q) against a layer shape and batch size: shapes
// and views, then every element (q finite, k and v finite within the fp16 range).
Status validate_append(const LayerShape& shape, int64_t batch, const TensorView& k,
                       const TensorView& v, const TensorView* q);
// The shape and view checks alone (a backend whose data the host cannot read checks the
// elements on its device, with the same messages).
Status validate_append_shapes(const LayerShape& shape, int64_t batch, const TensorView& k,
                              const TensorView& v, const TensorView* q);
// The checks of attend() (kv_head_end < 0 becomes n_kv_heads) and of read()/read_exact(), shared
// by every backend.
Status validate_attend(const LayerShape& shape, const Ledger& ledger, const Device& device,
                       const TensorView& q, float scale, const MutTensorView& out,
                       int kv_head_begin, int& kv_head_end);
Status validate_read(const LayerShape& shape, const Ledger& ledger, const Device& device,
                     bool exact, int64_t t0, int64_t n, const MutTensorView& k_out,
                     const MutTensorView& v_out);

}  // namespace kvq
