// CudaLayer — the CUDA backend's LayerCache: the same Ledger as the CPU backend (the rules),
// device memory from the model's DevicePool (the bytes, in the codec's stored layout) and the
// kernels of kernels.h. It holds the methods whose stored layout the kernels know (fp16, kivi);
// the CPU codec stays with the layer for what is format, not arithmetic: validating imported
// chunks, serializing blocks, the byte accounting.
//
// Every device operation is enqueued on the model's stream (CacheOptions::stream; null is CUDA's
// default stream). append() waits for its own work once, to report bad elements before it
// commits anything; read() and attend() return as soon as their kernels are enqueued (their
// outputs are ready when the stream reaches them); export and import wait for their copies.
// Inputs must be ready on that stream when the call is made.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "cache/codec.h"
#include "cache/ledger.h"
#include "cuda/device_pool.h"
#include "cuda/kernels.h"
#include "cuda/rans_gpu.h"
#include "kvq/cache.h"
#include "methods/zip_layout.h"

namespace kvq::cuda {

// What a model's layers (and their clones) share.
struct CudaContext {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::shared_ptr<DevicePool> pool;
  int sms = 132;
  // Attention partials: grown on demand, reused by every attend() of the model. The mutex is held
  // while an attend() enqueues the kernels that write and read them.
  std::mutex scratch_mu;
  uint8_t* scratch = nullptr;
  size_t scratch_bytes = 0;
  // CacheGen: the decoded (KIVI-layout) blocks of the layer being attended or read, and the
  // decode's staging; also grown on demand, under scratch_mu.
  uint8_t* mirror = nullptr;
  size_t mirror_bytes = 0;
  double* clogc = nullptr;  // CacheGen's delta=auto: cachegen::c_log2_c_table() on the device
  ~CudaContext();
  Result<uint8_t*> scratch_for(size_t bytes);  // scratch_mu held
  Result<uint8_t*> mirror_for(size_t bytes);   // scratch_mu held
};

// A device array of pointer pairs indexed by absolute block or page index, grown by doubling.
class PtrTable {
 public:
  Status reserve(CudaContext& ctx, int64_t n);
  void set(CudaContext& ctx, int64_t first, const PtrPair* e, int64_t n);
  const PtrPair* data() const { return dev_; }
  void release(CudaContext& ctx);

 private:
  PtrPair* dev_ = nullptr;
  int64_t cap_ = 0;
};

// The method as the kernels see it.
struct GpuMethod {
  bool kivi = false;  // KIVI's block layout: kivi, and xquant's anchors
  int k_bits = 0, v_bits = 0;
  int64_t group = 1;
  // XQuant: xq 1 an anchor, 2 a reuse layer of layer `anchor`; r_bits its residual; `fit` the
  // anchors' fit (fit=, eta) or the reuse layers' (reuse_fit=, eta).
  int xq = 0, layer = 0, anchor = -1, r_bits = 0;
  XqFit fit;
  // ZipCache (src/methods/zip_layout.h).
  bool zip = false;
  ZipConfig zc;
  // CacheGen (group == chunk, values=token, tables=shared): kivi is set too, for the KIVI layout
  // its codes are computed and attended in (k_bits = v_bits = the layer's width); the blocks
  // held are CacheGen's.
  bool cg = false;
  CgArgs cgc;
};

// A CacheGen layer's prototype sets on the device (parsed from block 0's parts), per part: the
// encoder's and the decoder's forms, block 0's table bytes in front of its regions, and the
// bits of a shared-table index.
struct CgTables {
  GpuEncodeTables enc[2];
  GpuTables dec[2];
  uint64_t prefix0[2] = {0, 0};
  int iw[2] = {0, 0};
};

// One sealed block's device parts, freed to the pool when the last owner lets go. An XQuant
// reuse block links to its anchor's block (whose codes it reads), so those codes live as long
// as any block reads them (the CPU codec's shared_ptr<BlockData>, on the device).
struct DevBlock {
  std::shared_ptr<DevicePool> pool;
  PtrPair p;
  size_t kb = 0, vb = 0;
  std::shared_ptr<const DevBlock> linked;
  DevBlock(std::shared_ptr<DevicePool> pl, PtrPair parts, size_t k, size_t v)
      : pool(std::move(pl)), p(parts), kb(k), vb(v) {}
  ~DevBlock() {
    pool->free(p.k, kb);
    pool->free(p.v, vb);
  }
  DevBlock(const DevBlock&) = delete;
  DevBlock& operator=(const DevBlock&) = delete;
};

class CudaLayer;
// The layers of one XQuant group (an anchor and the layers reusing its codes), as xquant.cc's
// XqLink: layers register on construction and leave on destruction.
struct XqGroup {
  CudaLayer* anchor = nullptr;
  std::vector<CudaLayer*> readers;
};

class CudaLayer final : public LayerCache {
 public:
  CudaLayer(std::unique_ptr<BlockCodec> codec, GpuMethod method, std::shared_ptr<CudaContext> ctx,
            const CacheOptions& options, std::shared_ptr<XqGroup> xq = nullptr);
  ~CudaLayer() override;

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
  uint64_t workspace_bytes() const override;

  DType window_dtype() const override { return window_dtype_; }
  int64_t n_blocks() const override { return ledger_.n_blocks(); }
  Status export_blocks(int64_t first_block, ChunkSink& sink) const override;
  Status export_tail(ChunkSink& sink) const override;
  Status import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                       DType window_dtype) override;
  const Spec& spec() const override { return codec_->spec(); }

  const CudaContext& context() const { return *ctx_; }

  // The kernel attend() runs for Tq queries per sequence now (tests check that a case reaches
  // the kernel it is about; benchmarks name it).
  enum class AttendKernel { kFast, kZip, kChunk, kGeneric };
  AttendKernel attend_kernel(int Tq) const;

 private:
  // Sizes of one block's parts and of one page (K or V) at batch B.
  size_t key_part_bytes(int64_t B) const;
  size_t value_part_bytes(int64_t B) const;
  size_t page_bytes_at(int64_t B) const;
  CacheBytes block_bytes(int64_t B) const;
  LayerDesc desc(int64_t B, DType window) const;
  static AttendKernel attend_kernel(const LayerDesc& L, int Tq);
  // Pages [i0, i1) of the window, or retired: held entries of pages_ in a range.
  void free_pages(int64_t i0, int64_t i1);
  void free_blocks_from(int64_t first);
  Status alloc_pages(int64_t i0, int64_t i1, size_t bytes, std::vector<PtrPair>& out);
  Status alloc_blocks(int64_t n, int64_t B, std::vector<std::shared_ptr<DevBlock>>& out);
  void release_all();
  Status copy_to_host(const uint8_t* dev, size_t bytes, std::vector<uint8_t>& out) const;
  // Blocks of exact part sizes (CacheGen's vary per block).
  Status alloc_sized(const std::vector<std::pair<size_t, size_t>>& sizes,
                     std::vector<std::shared_ptr<DevBlock>>& out) const;
  // CacheGen. cg_seal turns the KIVI-layout blocks append() sealed into the stored blocks and
  // their byte accounting: block 0 by a copy of the CPU codec (it builds the layer's prototype
  // tables; `codec` and `tables` receive the copy and the tables to commit), the others on the
  // device (symbols, the GPU rANS encoder, the parts assembled). cg_mirror (scratch_mu held)
  // decodes blocks [first, nb) into the context's mirror and returns the KIVI desc that reads them
  // (blocks before `first` are not decoded: not to be read).
  CgParts cg_parts(int64_t B, const CgTables& t) const;
  Status cg_seal(const LayerDesc& L, int64_t first,
                 const std::vector<std::shared_ptr<DevBlock>>& kivi,
                 std::vector<std::shared_ptr<DevBlock>>& out, std::vector<CacheBytes>& bytes,
                 std::unique_ptr<BlockCodec>& codec, std::shared_ptr<const CgTables>& tables) const;
  Result<LayerDesc> cg_mirror(int64_t first, int64_t nb) const;
  static Result<std::shared_ptr<const CgTables>> cg_load_tables(const uint8_t* k, size_t kn,
                                                                const uint8_t* v, size_t vn,
                                                                cudaStream_t st);
  // XQuant: the checks xquant.cc's precheck_append makes, against the anchor layer's blocks;
  // the anchor codes held by reuse layers that the anchor no longer holds (billed as meta by
  // the anchor, or the lowest reuse layer when it is gone); a reuse block's key chunk.
  Status xq_precheck(int64_t batch, int64_t n_new) const;
  uint64_t xq_orphan_bytes() const;
  Status xq_reuse_key_chunk(const DevBlock& blk, std::vector<uint8_t>& out) const;
  // The CPU backend's import rules for these chunks (scratch CPU layers; an XQuant reuse layer's
  // are checked against a CPU copy of its anchor layer).
  Status validate_import(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                         DType wdtype, std::vector<CacheBytes>* block_bytes = nullptr) const;

  std::unique_ptr<BlockCodec> codec_;
  GpuMethod method_;
  std::shared_ptr<CudaContext> ctx_;
  CacheOptions options_;
  LayerShape shape_;
  Ledger ledger_;
  DType window_dtype_ = DType::kF16;
  size_t page_bytes_ = 0;
  std::vector<std::shared_ptr<DevBlock>> blocks_;  // [block] the device parts
  std::vector<PtrPair> pages_;  // [absolute page index] held pages (window and retired)
  PtrTable block_table_, page_table_;
  PtrTable link_table_;  // XQuant reuse: [block] the anchor's parts its block reads
  std::shared_ptr<XqGroup> xq_;
  std::shared_ptr<const CgTables> cg_tables_;  // CacheGen, once block 0 is held
  // ZipCache's saliency probes (zipcache.cc's Probe: position, then [B, Hq, D] fp16 queries and
  // [B, Hq] fp32 log-sum-exps in one device piece of zip_probe_bytes()), oldest first.
  std::vector<ZipProbe> zprobes_;
  size_t zprobe_bytes_ = 0;  // each piece's size
  size_t zip_probe_bytes(int64_t B) const {
    return static_cast<size_t>(B * shape_.n_q_heads) *
           (static_cast<size_t>(shape_.head_dim) * 2 + 4);
  }
  void zip_free_probes(size_t from);  // drops zprobes_[from, end)
  ZipLayout zip_layout() const {
    return ZipLayout(method_.zc, ledger_.block_tokens(), shape_.head_dim);
  }
  // ZipCache's append, after append() wrote the pages: zip_plan replays the CPU backend's runs
  // and seals on the host and takes the memory they need (probe pieces, the probe tables), so
  // that zip_launch, which enqueues the kernels in that order, cannot fail.
  struct ZipPlan;
  Status zip_plan(const Ledger& before, int64_t B, int64_t n_new, bool with_q, ZipPlan& plan) const;
  void zip_launch(const LayerDesc& L, const TensorView* q, const ZipPlan& plan) const;
  void zip_unplan(ZipPlan& plan) const;  // returns the memory of a plan not committed
  uint64_t zip_probe_total() const { return zprobes_.size() * zprobe_bytes_; }
  Status zip_state(std::vector<uint8_t>& out) const;  // zipcache.cc's export_state
  unsigned long long* flags_ = nullptr;               // device [3]: k, v, q bad-element reports
  mutable std::atomic<int64_t> resident_warps_{0};    // the decode kernel's, once asked
};

// The backend for DeviceType::kCuda (registered when kvq_cuda is linked).
Result<std::vector<std::unique_ptr<LayerCache>>> make_cuda_layers(
    std::vector<std::unique_ptr<BlockCodec>> codecs, const ModelShape& shape,
    const CacheOptions& options);

}  // namespace kvq::cuda
