#include "cuda/cuda_layer.h"

#include <cuda_runtime_api.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "cache/layer.h"
#include "cuda/cuda_util.h"
#include "cuda/split_rules.h"
#include "entropy/cachegen_codes.h"
#include "kvq/bitpack.h"
#include "methods/kivi_layout.h"

namespace kvq::cuda {

namespace {

DevTensor dev(const TensorView& v) {
  return DevTensor{const_cast<void*>(v.data),
                   static_cast<int>(v.dtype),
                   v.strides[0],
                   v.strides[1],
                   v.strides[2],
                   v.strides[3]};
}
DevTensor dev(const MutTensorView& v) { return dev(as_const(v)); }

constexpr unsigned long long kNoBadElement = ~0ull;

// Units per window tile in the decode kernels' split-K (split_tile_range): `fallback`, or
// KVQ_CUDA_WINDOW_COST (1-16) for benchmarks that compare the balance (1: every tile alike).
int window_cost(int fallback) {
  static const int forced = [] {
    const char* e = std::getenv("KVQ_CUDA_WINDOW_COST");
    const int v = e ? std::atoi(e) : 0;
    return v >= 1 && v <= 16 ? v : 0;
  }();
  return forced ? forced : fallback;
}

// The message the CPU backend gives for the first bad element of `x` (tensor `what`), from the
// kernels' report: linear index [B, H, S, D] * 4 + kind (0 NaN, 1 Inf, 2 beyond fp16).
Status bad_element(const TensorView& x, const char* what, unsigned long long report,
                   cudaStream_t stream) {
  const unsigned long long kind = report % 4, lin = report / 4;
  const int64_t D = x.shape[3], S = x.shape[2], H = x.shape[1];
  const int64_t d = static_cast<int64_t>(lin) % D, s = static_cast<int64_t>(lin) / D % S;
  const int64_t h = static_cast<int64_t>(lin) / (D * S) % H,
                b = static_cast<int64_t>(lin) / (D * S * H);
  const std::string at = " at [" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                         std::to_string(s) + ", " + std::to_string(d) + "]";
  if (kind < 2) return non_finite(std::string(what) + " has " + (kind == 0 ? "NaN" : "Inf") + at);
  uint32_t raw = 0;
  const size_t es = dtype_size(x.dtype);
  KVQ_CUDA_CHECK(cudaMemcpyAsync(
      &raw, static_cast<const char*>(x.data) + x.offset(b, h, s, d) * static_cast<int64_t>(es), es,
      cudaMemcpyDeviceToHost, stream));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(stream));
  const float val = load_as_f32(&raw, x.dtype, 0);
  return out_of_range(std::string(what) + " value " + std::to_string(val) + at +
                      " exceeds the fp16 range (|x| <= 65504) of kvq's stored window, scales and "
                      "zero points");
}

}  // namespace

// ---- CudaContext, PtrTable ----

CudaContext::~CudaContext() {
  if (scratch) pool->free(scratch, scratch_bytes);
  if (mirror) pool->free(mirror, mirror_bytes);
  if (clogc)
    pool->free(reinterpret_cast<uint8_t*>(clogc),
               cachegen::c_log2_c_table().size() * sizeof(double));
}

Result<uint8_t*> CudaContext::mirror_for(size_t bytes) {
  if (bytes <= mirror_bytes) return mirror;
  const size_t want = std::max(bytes, mirror_bytes + mirror_bytes / 2);
  if (mirror) pool->free(mirror, mirror_bytes);  // stream order: earlier kernels finish first
  mirror = nullptr;
  mirror_bytes = 0;
  KVQ_ASSIGN_OR_RETURN(mirror, pool->alloc(want));
  mirror_bytes = want;
  return mirror;
}

Result<uint8_t*> CudaContext::scratch_for(size_t bytes) {
  if (bytes <= scratch_bytes) return scratch;
  const size_t want = std::max(bytes, scratch_bytes * 2);
  KVQ_ASSIGN_OR_RETURN(uint8_t * p, pool->alloc(want));
  if (scratch) pool->free(scratch, scratch_bytes);  // stream order: earlier kernels finish first
  scratch = p;
  scratch_bytes = want;
  return scratch;
}

Status PtrTable::reserve(CudaContext& ctx, int64_t n) {
  if (n <= cap_) return ok_status();
  const int64_t cap = std::max<int64_t>({n, 2 * cap_, 64});
  KVQ_ASSIGN_OR_RETURN(uint8_t * p, ctx.pool->alloc(static_cast<size_t>(cap) * sizeof(PtrPair)));
  if (dev_) {
    KVQ_CUDA_CHECK(cudaMemcpyAsync(p, dev_, static_cast<size_t>(cap_) * sizeof(PtrPair),
                                   cudaMemcpyDeviceToDevice, ctx.stream));
    ctx.pool->free(reinterpret_cast<uint8_t*>(dev_), static_cast<size_t>(cap_) * sizeof(PtrPair));
  }
  dev_ = reinterpret_cast<PtrPair*>(p);
  cap_ = cap;
  return ok_status();
}

void PtrTable::set(CudaContext& ctx, int64_t first, const PtrPair* e, int64_t n) {
  KVQ_CHECK(first >= 0 && first + n <= cap_);
  set_ptrs(dev_, first, e, n, ctx.stream);
}

void PtrTable::release(CudaContext& ctx) {
  if (dev_)
    ctx.pool->free(reinterpret_cast<uint8_t*>(dev_), static_cast<size_t>(cap_) * sizeof(PtrPair));
  dev_ = nullptr;
  cap_ = 0;
}

// ---- CudaLayer ----

CudaLayer::CudaLayer(std::unique_ptr<BlockCodec> codec, GpuMethod method,
                     std::shared_ptr<CudaContext> ctx, const CacheOptions& options,
                     std::shared_ptr<XqGroup> xq)
    : codec_(std::move(codec)),
      method_(method),
      ctx_(std::move(ctx)),
      options_(options),
      shape_(codec_->shape()),
      ledger_(LedgerShape{codec_->block_tokens(), codec_->page_tokens(), codec_->residual()}),
      xq_(std::move(xq)) {
  if (shape_.n_q_heads == 0) shape_.n_q_heads = shape_.n_kv_heads;
  KVQ_CHECK((method_.xq != 0) == (xq_ != nullptr));
  if (method_.xq == 1) xq_->anchor = this;
  if (method_.xq == 2) xq_->readers.push_back(this);
  DeviceGuard guard(ctx_->device);
  auto f = ctx_->pool->alloc(3 * sizeof(unsigned long long));
  KVQ_CHECK(f.ok() && "out of GPU memory creating a layer");
  flags_ = reinterpret_cast<unsigned long long*>(*f);
}

CudaLayer::~CudaLayer() {
  DeviceGuard guard(ctx_->device);
  if (xq_) {
    if (xq_->anchor == this) xq_->anchor = nullptr;
    std::erase(xq_->readers, this);
  }
  release_all();
  block_table_.release(*ctx_);
  page_table_.release(*ctx_);
  link_table_.release(*ctx_);
  ctx_->pool->free(reinterpret_cast<uint8_t*>(flags_), 3 * sizeof(unsigned long long));
}

// An XQuant reuse block's own parts (xquant.cc's stored layout, without the file's hash): per
// stream the layer's pairs, then with r_bits > 0 the residual codes and their pairs.
struct XqReuseLayout {
  KiviLayout kivi;  // the anchor's layout: code sizes, pair counts
  int r;
  size_t rcode() const {
    return r ? packed_size(static_cast<size_t>(kivi.g.stream_elems()), r) : 0;
  }
  size_t key_part() const { return kivi.S() * (kivi.kparam() + (r ? rcode() + kivi.kparam() : 0)); }
  size_t value_part() const {
    return kivi.S() * (kivi.vparam() + (r ? rcode() + kivi.vparam() : 0));
  }
  CacheBytes bytes() const {
    CacheBytes c;
    c.params = kivi.S() * (kivi.kparam() + kivi.vparam()) * (r ? 2 : 1);
    c.key_codes = c.value_codes = kivi.S() * rcode();
    return c;
  }
};

struct CudaLayer::ZipPlan {
  struct Step {
    bool seal = false;   // false: a run's probes; true: consecutive blocks' seals
    int64_t first = 0;   // into the table (probes) or segs (seals)
    int n = 0;           // probes or blocks
    int64_t sealed = 0;  // probes: tokens sealed when the run arrives
  };
  std::vector<Step> steps;
  std::vector<ZipProbe> table;  // each step's probes, in step order
  std::vector<ZipSeg> segs;     // each block sealed, in order
  uint8_t* dev = nullptr;       // the table, then segs
  size_t dev_bytes = 0, probe_bytes = 0;
  const ZipProbe* dev_table() const { return reinterpret_cast<const ZipProbe*>(dev); }
  const ZipSeg* dev_segs() const {
    return reinterpret_cast<const ZipSeg*>(dev + table.size() * sizeof(ZipProbe));
  }
  std::vector<uint8_t*> created;  // pieces this append took from the pool
  std::vector<ZipProbe> held;     // the probes held after it
};

size_t CudaLayer::key_part_bytes(int64_t B) const {
  if (method_.zip) return static_cast<size_t>(B * shape_.n_kv_heads) * zip_layout().key_record();
  if (!method_.kivi) return 0;
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  const KiviLayout K{g, method_.k_bits, method_.v_bits, method_.group};
  return method_.xq == 2 ? XqReuseLayout{K, method_.r_bits}.key_part() : K.key_part();
}
size_t CudaLayer::value_part_bytes(int64_t B) const {
  if (method_.zip) return static_cast<size_t>(B * shape_.n_kv_heads) * zip_layout().value_record();
  if (!method_.kivi) return 0;
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  const KiviLayout K{g, method_.k_bits, method_.v_bits, method_.group};
  return method_.xq == 2 ? XqReuseLayout{K, method_.r_bits}.value_part() : K.value_part();
}
CacheBytes CudaLayer::block_bytes(int64_t B) const {
  if (method_.zip) {  // zipcache.cc's ZipBlock::bytes()
    const ZipLayout z = zip_layout();
    const uint64_t S = static_cast<uint64_t>(B * shape_.n_kv_heads);
    CacheBytes c;
    c.key_codes = S * (z.khi + z.klo);
    c.value_codes = S * z.vcodes;
    c.params = S * (z.kparams + z.vparams + z.vcst);
    c.meta = S * z.mask;
    return c;
  }
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  const KiviLayout K{g, method_.k_bits, method_.v_bits, method_.group};
  return method_.xq == 2 ? XqReuseLayout{K, method_.r_bits}.bytes() : K.bytes();
}
size_t CudaLayer::page_bytes_at(int64_t B) const {
  return static_cast<size_t>(B * shape_.n_kv_heads * ledger_.page_tokens() * shape_.head_dim) * 2;
}

LayerDesc CudaLayer::desc(int64_t B, DType window) const {
  LayerDesc L;
  L.B = static_cast<int>(B);
  L.H = shape_.n_kv_heads;
  L.D = shape_.head_dim;
  L.group = shape_.n_q_heads / shape_.n_kv_heads;
  L.T = ledger_.block_tokens();
  L.P = ledger_.page_tokens();
  L.R = ledger_.residual();
  if (method_.kivi) {
    const BlockGeometry g{B, shape_.n_kv_heads, L.T, shape_.head_dim};
    const KiviLayout K{g, method_.k_bits, method_.v_bits, method_.group};
    L.k_bits = method_.k_bits;
    L.v_bits = method_.v_bits;
    L.vgroup = method_.group;
    L.ng = n_channel_groups(shape_.head_dim, method_.group);
    L.kcode = static_cast<int64_t>(K.kcode());
    L.kparam = static_cast<int64_t>(K.kparam());
    L.vcode = static_cast<int64_t>(K.vcode());
    L.vparam = static_cast<int64_t>(K.vparam());
    L.xq = method_.xq;
    if (method_.xq == 2) {
      L.r_bits = method_.r_bits;
      L.rcode = static_cast<int64_t>(XqReuseLayout{K, method_.r_bits}.rcode());
      L.links = link_table_.data();
    }
  }
  if (method_.zip) {
    const ZipLayout z = zip_layout();
    const ZipConfig& c = method_.zc;
    L.zip = 1;
    L.hi_bits = L.k_bits = L.v_bits = c.hi_bits;
    L.lo_bits = c.lo_bits;
    L.zvalues = c.values == ValueMode::kUniform ? 0 : c.values == ValueMode::kRouted ? 1 : 2;
    L.zshared = c.shared_key_params;
    L.vgroup = c.v_group;
    L.ng = z.ng;
    L.n_h = z.n_h;
    L.zmask = static_cast<int64_t>(z.mask);
    L.zkhi = static_cast<int64_t>(z.khi);
    L.zklo = static_cast<int64_t>(z.klo);
    L.zkrec = static_cast<int64_t>(z.key_record());
    L.zvhi = static_cast<int64_t>(z.khi_v(c));
    L.zvcodes = static_cast<int64_t>(z.vcodes);
    L.zvparams = static_cast<int64_t>(z.vparams);
    L.zvrec = static_cast<int64_t>(z.value_record());
  }
  L.bf16_window = window == DType::kBF16;
  L.blocks = block_table_.data();
  L.pages = page_table_.data();
  L.n_blocks = ledger_.n_blocks();
  L.offset = ledger_.offset();
  L.exact_begin = ledger_.exact_begin();
  return L;
}

void CudaLayer::free_pages(int64_t i0, int64_t i1) {
  i1 = std::min<int64_t>(i1, static_cast<int64_t>(pages_.size()));
  for (int64_t i = std::max<int64_t>(i0, 0); i < i1; ++i) {
    PtrPair& p = pages_[static_cast<size_t>(i)];
    ctx_->pool->free(p.k, page_bytes_);
    ctx_->pool->free(p.v, page_bytes_);
    p = PtrPair{};
  }
}

void CudaLayer::free_blocks_from(int64_t first) {
  // The parts go back to the pool with their last owner (a reuse block may still read them).
  blocks_.resize(static_cast<size_t>(first));
}

Status CudaLayer::alloc_pages(int64_t i0, int64_t i1, size_t bytes, std::vector<PtrPair>& out) {
  out.clear();
  if (i1 <= i0) return ok_status();
  KVQ_RETURN_IF_ERROR(
      ctx_->pool->reserve(static_cast<size_t>(i1 - i0) * 2 * DevicePool::rounded(bytes)));
  for (int64_t i = i0; i < i1; ++i) {
    PtrPair p;
    auto k = ctx_->pool->alloc(bytes);
    auto v = ctx_->pool->alloc(bytes);
    KVQ_CHECK(k.ok() && v.ok());  // reserved above
    p.k = *k;
    p.v = *v;
    out.push_back(p);
  }
  return ok_status();
}

Status CudaLayer::alloc_blocks(int64_t n, int64_t B, std::vector<std::shared_ptr<DevBlock>>& out) {
  return alloc_sized(std::vector<std::pair<size_t, size_t>>(
                         static_cast<size_t>(n), {key_part_bytes(B), value_part_bytes(B)}),
                     out);
}

static std::vector<PtrPair> parts_of(const std::vector<std::shared_ptr<DevBlock>>& blocks,
                                     bool linked) {
  std::vector<PtrPair> out;
  out.reserve(blocks.size());
  for (const auto& b : blocks) out.push_back(linked ? b->linked->p : b->p);
  return out;
}

void CudaLayer::zip_free_probes(size_t from) {
  for (size_t i = from; i < zprobes_.size(); ++i) ctx_->pool->free(zprobes_[i].data, zprobe_bytes_);
  zprobes_.resize(std::min(from, zprobes_.size()));
}

void CudaLayer::release_all() {
  zip_free_probes(0);
  free_pages(0, static_cast<int64_t>(pages_.size()));
  pages_.clear();
  free_blocks_from(0);
}

Status CudaLayer::append(const TensorView& k, const TensorView& v, const TensorView* q) {
  KVQ_RETURN_IF_ERROR(require_device(k, options_.device, "k"));
  KVQ_RETURN_IF_ERROR(require_device(v, options_.device, "v"));
  if (q) KVQ_RETURN_IF_ERROR(require_device(*q, options_.device, "q"));
  KVQ_RETURN_IF_ERROR(validate_append_shapes(shape_, ledger_.batch(), k, v, q));
  const int64_t n_new = k.shape[2], B = k.shape[0];
  if (ledger_.offset() + n_new > Ledger::kMaxTokens)
    return limit_exceeded("a layer cache holds at most " + std::to_string(Ledger::kMaxTokens) +
                          " tokens; appending " + std::to_string(n_new) + " to " +
                          std::to_string(ledger_.offset()) + " would exceed it");
  // XQuant's reuse rules against the anchor layer's device blocks (the codec's own check reads
  // blocks only the CPU backend gives it).
  KVQ_RETURN_IF_ERROR(
      method_.xq ? xq_precheck(B, n_new)
                 : codec_->precheck_append(B, n_new, ledger_.offset(), ledger_.n_blocks()));
  DeviceGuard guard(ctx_->device);
  cudaStream_t st = ctx_->stream;

  // Plan on a copy of the ledger: the same runs and seal decisions as the CPU backend's append.
  const bool first = ledger_.batch() == 0;
  const DType wdt = first ? (k.dtype == DType::kBF16 ? DType::kBF16 : DType::kF16) : window_dtype_;
  const size_t pbytes = first ? page_bytes_at(B) : page_bytes_;
  Ledger plan = ledger_;
  plan.begin_append(B, n_new);
  const CacheBytes bb = block_bytes(B);
  int64_t n_sealed = 0;
  for (int64_t done = 0; done < n_new;) {
    const int64_t n = plan.next_run(n_new - done);
    plan.advance(n);
    done += n;
    while (plan.seal_due()) {
      plan.record_block(bb, plan.keep_exact_of_due_block());
      ++n_sealed;
    }
  }
  const int64_t P = ledger_.page_tokens(), first_sealed = ledger_.n_blocks();
  const int64_t old_off = ledger_.offset(), end = old_off + n_new;
  const int64_t np0 = (old_off + P - 1) / P, np1 = (end + P - 1) / P;

  // Everything the append writes into, before anything changes (a failure here changes nothing
  // observable: tables only grow, and entries past the committed state are never read).
  KVQ_RETURN_IF_ERROR(page_table_.reserve(*ctx_, np1));
  KVQ_RETURN_IF_ERROR(block_table_.reserve(*ctx_, first_sealed + n_sealed));
  if (method_.xq == 2) KVQ_RETURN_IF_ERROR(link_table_.reserve(*ctx_, first_sealed + n_sealed));
  std::vector<PtrPair> new_pages;
  std::vector<std::shared_ptr<DevBlock>> new_blocks;
  KVQ_RETURN_IF_ERROR(alloc_pages(np0, np1, pbytes, new_pages));
  if (Status s = alloc_blocks(n_sealed, B, new_blocks); !s.ok()) {
    for (auto& p : new_pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
    return s;
  }
  ZipPlan zplan;
  if (method_.zip)
    if (Status s = zip_plan(ledger_, B, n_new, q != nullptr, zplan); !s.ok()) {
      for (auto& p : new_pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
      return s;
    }
  page_table_.set(*ctx_, np0, new_pages.data(), static_cast<int64_t>(new_pages.size()));
  block_table_.set(*ctx_, first_sealed, parts_of(new_blocks, false).data(), n_sealed);
  if (method_.xq == 2) {
    // Each new block reads the anchor's block of the same tokens (xq_precheck: it holds them).
    for (int64_t i = 0; i < n_sealed; ++i)
      new_blocks[static_cast<size_t>(i)]->linked =
          xq_->anchor->blocks_[static_cast<size_t>(first_sealed + i)];
    link_table_.set(*ctx_, first_sealed, parts_of(new_blocks, true).data(), n_sealed);
  }

  LayerDesc L = desc(B, wdt);
  KVQ_CUDA_CHECK(cudaMemsetAsync(flags_, 0xff, 3 * sizeof(unsigned long long), st));
  if (q) check_finite(dev(*q), B, q->shape[1], n_new, shape_.head_dim, flags_ + 2, st);
  AppendArgs a;
  a.k = dev(k);
  a.v = dev(v);
  a.append_start = old_off;
  a.n_new = n_new;
  a.first_sealed = first_sealed;
  a.n_sealed = n_sealed;
  a.flags = flags_;
  if (method_.zip) {
    // Pages first; then the probes and seals in the CPU backend's order.
    AppendArgs pages_only = a;
    pages_only.n_sealed = 0;
    cuda::append(L, pages_only, st);
    zip_launch(L, q, zplan);
  } else if (method_.xq == 2) {
    // A reuse layer has no codes to quantize: append() writes the new tokens' pages, then each
    // block is fit to its anchor's codes from them.
    AppendArgs pages_only = a;
    pages_only.n_sealed = 0;
    cuda::append(L, pages_only, st);
    xq_reuse_seal(L, first_sealed, n_sealed, method_.fit, st);
  } else {
    cuda::append(L, a, st);
    if (method_.xq == 1) xq_anchor_fit(L, first_sealed, n_sealed, method_.fit, st);
  }
  unsigned long long report[3];
  KVQ_CUDA_CHECK(cudaMemcpyAsync(report, flags_, sizeof report, cudaMemcpyDeviceToHost, st));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(st));
  Status bad = ok_status();
  if (report[2] != kNoBadElement)
    bad = bad_element(*q, "q", report[2], st);
  else if (report[0] != kNoBadElement)
    bad = bad_element(k, "k", report[0], st);
  else if (report[1] != kNoBadElement)
    bad = bad_element(v, "v", report[1], st);
  if (!bad.ok()) {
    for (auto& p : new_pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
    zip_unplan(zplan);
    return bad;  // new_blocks go back to the pool with the vector
  }
  std::unique_ptr<BlockCodec> cg_codec;  // CacheGen: block 0's codec copy, its tables
  std::shared_ptr<const CgTables> cg_tables = cg_tables_;
  if (method_.cg && n_sealed > 0) {
    // The blocks sealed so far are KIVI-layout scratch: CacheGen's blocks are made from them,
    // and the plan is made again with each block's own bytes.
    std::vector<std::shared_ptr<DevBlock>> stored;
    std::vector<CacheBytes> sizes;
    if (Status s = cg_seal(L, first_sealed, new_blocks, stored, sizes, cg_codec, cg_tables);
        !s.ok()) {
      for (auto& p : new_pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
      return s;
    }
    new_blocks = std::move(stored);
    block_table_.set(*ctx_, first_sealed, parts_of(new_blocks, false).data(), n_sealed);
    plan = ledger_;
    plan.begin_append(B, n_new);
    size_t j = 0;
    for (int64_t done = 0; done < n_new;) {
      const int64_t n = plan.next_run(n_new - done);
      plan.advance(n);
      done += n;
      while (plan.seal_due()) plan.record_block(sizes[j++], plan.keep_exact_of_due_block());
    }
    KVQ_CHECK(j == sizes.size());
  }
  if (method_.zip) {  // probes seen out (held before, or made and dropped by this append) go
    auto dropped = [&](const ZipProbe& p) {
      return std::none_of(zplan.held.begin(), zplan.held.end(),
                          [&](const ZipProbe& h) { return h.data == p.data; });
    };
    for (const ZipProbe& p : zprobes_)
      if (dropped(p)) ctx_->pool->free(p.data, zprobe_bytes_);
    for (uint8_t* p : zplan.created)
      if (dropped(ZipProbe{0, p})) ctx_->pool->free(p, zplan.probe_bytes);
    zprobes_ = zplan.held;
    zprobe_bytes_ = zplan.probe_bytes;
    zplan.created.clear();  // committed
    zip_unplan(zplan);      // the table
  }

  // Commit. The exact values the previous append kept go first (the CPU's drop_retired), then
  // the pages of blocks sealed now that no query of this append reads exact.
  free_pages(ledger_.exact_begin() / P, ledger_.sealed_tokens() / P);
  if (static_cast<int64_t>(pages_.size()) < np1) pages_.resize(static_cast<size_t>(np1));
  for (int64_t i = np0; i < np1; ++i)
    pages_[static_cast<size_t>(i)] = new_pages[static_cast<size_t>(i - np0)];
  blocks_.insert(blocks_.end(), new_blocks.begin(), new_blocks.end());
  window_dtype_ = wdt;
  page_bytes_ = pbytes;
  const int64_t old_sealed_page = ledger_.sealed_tokens() / P;
  ledger_ = plan;
  free_pages(old_sealed_page, ledger_.exact_begin() / P);
  if (cg_codec) codec_ = std::move(cg_codec);
  cg_tables_ = std::move(cg_tables);
  codec_->on_append_done();
  return ok_status();
}

Status CudaLayer::read(int64_t t0, int64_t n, const MutTensorView& k_out,
                       const MutTensorView& v_out) const {
  KVQ_RETURN_IF_ERROR(validate_read(shape_, ledger_, options_.device, false, t0, n, k_out, v_out));
  DeviceGuard guard(ctx_->device);
  if (method_.cg) {  // the sealed blocks decoded first
    std::lock_guard<std::mutex> lock(ctx_->scratch_mu);
    const int64_t T = ledger_.block_tokens();
    KVQ_ASSIGN_OR_RETURN(const LayerDesc M,
                         cg_mirror(t0 / T, std::min(ledger_.n_blocks(), (t0 + n + T - 1) / T)));
    cuda::read(M, 0, t0, n, dev(k_out), dev(v_out), ctx_->stream);
    return ok_status();
  }
  cuda::read(desc(ledger_.batch(), window_dtype_), 0, t0, n, dev(k_out), dev(v_out), ctx_->stream);
  return ok_status();
}

Status CudaLayer::read_exact(int64_t t0, int64_t n, const MutTensorView& k_out,
                             const MutTensorView& v_out) const {
  KVQ_RETURN_IF_ERROR(validate_read(shape_, ledger_, options_.device, true, t0, n, k_out, v_out));
  DeviceGuard guard(ctx_->device);
  cuda::read(desc(ledger_.batch(), window_dtype_), 1, t0, n, dev(k_out), dev(v_out), ctx_->stream);
  return ok_status();
}

CudaLayer::AttendKernel CudaLayer::attend_kernel(const LayerDesc& L, int Tq) {
  if (fast_supported(L, Tq)) return AttendKernel::kFast;
  // ZipCache's decode goes to its own kernel (attend_zip.cu) where it takes the layer;
  // KVQ_CUDA_ZIP_CHUNK=1 sends it to the chunk kernel instead (benchmarks compare the two).
  static const bool zip_chunk = env_flag("KVQ_CUDA_ZIP_CHUNK");
  if (!zip_chunk && zip_decode_supported(L, Tq)) return AttendKernel::kZip;
  // KVQ_CUDA_NO_CHUNK=1 sends chunks to the generic kernel (benchmarks compare the two).
  static const bool no_chunk = env_flag("KVQ_CUDA_NO_CHUNK");
  if (!no_chunk && chunk_supported(L, Tq)) return AttendKernel::kChunk;
  return AttendKernel::kGeneric;
}

CudaLayer::AttendKernel CudaLayer::attend_kernel(int Tq) const {
  return attend_kernel(desc(ledger_.batch(), window_dtype_), Tq);
}

Status CudaLayer::attend(const TensorView& q, float scale, const MutTensorView& out,
                         int kv_head_begin, int kv_head_end, Workspace*) const {
  KVQ_RETURN_IF_ERROR(
      validate_attend(shape_, ledger_, options_.device, q, scale, out, kv_head_begin, kv_head_end));
  if (kv_head_end == kv_head_begin) return ok_status();
  DeviceGuard guard(ctx_->device);
  std::lock_guard<std::mutex> lock(ctx_->scratch_mu);
  LayerDesc L = desc(ledger_.batch(), window_dtype_);
  if (method_.cg) {  // CacheGen: the blocks decoded into the mirror, attended as KIVI's
    KVQ_ASSIGN_OR_RETURN(L, cg_mirror(0, ledger_.n_blocks()));
  }
  AttendArgs a;
  a.q = dev(q);
  a.out = dev(out);
  a.scale_log2 = static_cast<float>(static_cast<double>(scale) * 1.4426950408889634);
  a.Tq = static_cast<int>(q.shape[2]);
  a.h0 = kv_head_begin;
  a.nh = kv_head_end - kv_head_begin;
  const int64_t rows = static_cast<int64_t>(L.B) * a.nh * L.group * a.Tq;
  const int64_t offset = ledger_.offset();
  const AttendKernel kernel = attend_kernel(L, a.Tq);
  const bool fast = kernel == AttendKernel::kFast, zip = kernel == AttendKernel::kZip;
  const bool chunk = kernel == AttendKernel::kChunk;
  if (fast || zip) {
    // Split-K: enough warps to fill the device a few times over, whole 32-token tiles each.
    const int64_t sealed_tiles = zip ? zip_sealed_tiles(L) : L.n_blocks * L.T / 32;
    const int64_t tiles =
        zip ? zip_decode_tiles(L) : sealed_tiles + (offset - L.n_blocks * L.T + 31) / 32;
    const int64_t per = static_cast<int64_t>(L.B) * a.nh;
    // Split-K: the split count w whose warps (per * w) run in the fewest whole waves of the
    // device's resident warps per unit of work: time ~ ceil(per * w / R) / w.
    int64_t R = resident_warps_.load(std::memory_order_relaxed);
    if (R == 0) {
      R = zip ? zip_resident_warps(L) : fast_resident_warps(L);
      resident_warps_.store(R, std::memory_order_relaxed);
    }
    int64_t want = 1;
    double best = 1e300;
    for (int64_t w = 1; w <= std::min<int64_t>(tiles, 2 * R / per + 2); ++w) {
      const double cost = static_cast<double>((per * w + R - 1) / R) / static_cast<double>(w);
      if (cost < best * (1 - 1e-9)) best = cost, want = w;
    }
    // The decode kernel's CTAs merge their warps' splits into one partial (kFastWarps), fewer
    // partials for the combine pass to read, where a whole number of CTAs per (sequence, KV
    // head) costs at most an eighth of the warps (rounding down: rounding up could cost a second
    // wave); else each warp writes its own (Dec 7, H100: 1 x 131k tokens 7 % faster merged; an
    // XQuant reuse layer at 32 x 8k, 6 splits rounded to 4, 8 % slower).
    const int64_t step = kFastWarps;
    a.merge = fast && (want % step) * 8 <= want;
    if (a.merge) want = want / step * step;
    // The window's tiles cost more than packed ones (split_tile_range): KIVI's decode reads
    // fp16 pages without its pipeline there; ZipCache's sealed tiles are the slower ones.
    a.window_cost = window_cost(zip ? 1 : 4);
    const TileSplitPlan plan = plan_tile_splits(sealed_tiles, tiles, a.window_cost, want);
    a.split_units = plan.split_units;
    a.n_splits = a.merge ? static_cast<int>((plan.n_splits + step - 1) / step) : plan.n_splits;
  } else if (chunk) {
    // CTAs of whole 32-key tiles: about two waves of CTAs over the device.
    const int64_t ctas = static_cast<int64_t>(L.B) * a.nh * chunk_qtiles(L, a.Tq);
    const int64_t want =
        std::clamp<int64_t>((ctx_->sms * 2 + ctas - 1) / ctas, 1, (offset + 255) / 256);
    a.split_len = ((offset + want - 1) / want + 63) / 64 * 64;  // whole 64-key tiles
    a.n_splits = static_cast<int>((offset + a.split_len - 1) / a.split_len);
  } else {
    const int64_t want =
        std::clamp<int64_t>((ctx_->sms * 4 + rows - 1) / rows, 1, (offset + 127) / 128);
    a.split_len = (offset + want - 1) / want;
    a.n_splits = static_cast<int>((offset + a.split_len - 1) / a.split_len);
  }
  const size_t need = static_cast<size_t>(rows) * a.n_splits * (shape_.head_dim + 2) * 4;
  KVQ_ASSIGN_OR_RETURN(uint8_t * scratch, ctx_->scratch_for(need));
  a.part_acc = reinterpret_cast<float*>(scratch);
  a.part_ml = a.part_acc + rows * a.n_splits * shape_.head_dim;
  if (fast)
    attend_fast(L, a, ctx_->stream);
  else if (zip)
    attend_zip(L, a, ctx_->stream);
  else if (chunk)
    attend_chunk(L, a, ctx_->stream);
  else
    attend_generic(L, a, ctx_->stream);
  attend_combine(L, a, ctx_->stream);
  return ok_status();
}

Status CudaLayer::trim(int64_t n) {
  KVQ_ASSIGN_OR_RETURN(const Ledger::TrimPlan plan, ledger_.plan_trim(n));
  if (n == 0) return ok_status();
  DeviceGuard guard(ctx_->device);
  cudaStream_t st = ctx_->stream;
  const int64_t P = ledger_.page_tokens(), T = ledger_.block_tokens(), B = ledger_.batch();
  const int64_t D = shape_.head_dim, H = shape_.n_kv_heads;
  const int64_t sealed_page = ledger_.sealed_tokens() / P;
  const int64_t end_page = (ledger_.offset() + P - 1) / P;
  if (!plan.reopen && plan.keep_blocks == ledger_.n_blocks()) {
    // Inside the window: drop whole pages past the new end, zero the rest of the last one.
    free_pages(ledger_.exact_begin() / P, sealed_page);
    free_pages(sealed_page + plan.keep_window_pages, end_page);
    if (plan.window_tokens % P) {
      const int64_t used = plan.window_tokens % P;
      const PtrPair& pg = pages_[static_cast<size_t>(sealed_page + plan.keep_window_pages - 1)];
      for (uint8_t* base : {pg.k, pg.v})
        KVQ_CUDA_CHECK(cudaMemset2DAsync(base + used * D * 2, static_cast<size_t>(P * D * 2), 0,
                                         static_cast<size_t>((P - used) * D * 2),
                                         static_cast<size_t>(B * H), st));
    }
  } else {
    // Into sealed blocks: whole blocks dropped; a block cut in two goes back to the window from
    // its dequantized values (the kernel runs before the block's memory is released).
    const int64_t kb = plan.keep_blocks, p0 = kb * T / P;
    const int64_t p1 = p0 + ledger_.pages_for(plan.window_tokens);
    std::vector<PtrPair> fresh;  // allocated first: out of memory leaves the cache as it was
    KVQ_RETURN_IF_ERROR(page_table_.reserve(*ctx_, p1));
    KVQ_RETURN_IF_ERROR(alloc_pages(p0, p1, page_bytes_, fresh));
    LayerDesc from = desc(B, window_dtype_);
    std::unique_lock<std::mutex> lock(ctx_->scratch_mu, std::defer_lock);
    if (plan.reopen && method_.cg) {  // CacheGen: the block cut in two, decoded
      lock.lock();
      Result<LayerDesc> M = cg_mirror(kb, kb + 1);
      if (!M.ok()) {
        for (auto& p : fresh)
          ctx_->pool->free(p.k, page_bytes_), ctx_->pool->free(p.v, page_bytes_);
        return M.status();
      }
      from = *M;
    }
    free_pages(ledger_.exact_begin() / P, sealed_page);  // retired pages
    page_table_.set(*ctx_, p0, fresh.data(), static_cast<int64_t>(fresh.size()));
    if (plan.reopen) reopen(from, kb, plan.window_tokens, st);
    if (lock.owns_lock()) lock.unlock();
    free_pages(sealed_page, end_page);
    free_blocks_from(kb);
    if (static_cast<int64_t>(pages_.size()) < p1) pages_.resize(static_cast<size_t>(p1));
    for (int64_t i = p0; i < p1; ++i)
      pages_[static_cast<size_t>(i)] = fresh[static_cast<size_t>(i - p0)];
  }
  ledger_.apply_trim(plan);
  codec_->on_trim(plan.new_offset, plan.keep_blocks);
  if (plan.keep_blocks == 0) cg_tables_.reset();
  size_t keep = 0;  // probes at the new end and beyond go, as zipcache.cc's on_trim
  while (keep < zprobes_.size() && zprobes_[keep].pos < plan.new_offset) ++keep;
  zip_free_probes(keep);
  return ok_status();
}

void CudaLayer::reset() {
  DeviceGuard guard(ctx_->device);
  release_all();
  ledger_.reset();
  window_dtype_ = DType::kF16;
  page_bytes_ = 0;
  cg_tables_.reset();
  codec_->on_reset();
}

std::unique_ptr<LayerCache> CudaLayer::clone(CloneMemo& memo) const {
  DeviceGuard guard(ctx_->device);
  std::shared_ptr<XqGroup> group;
  if (xq_) {  // one new group per memo, as xquant.cc's links
    auto [it, inserted] = memo.copies.try_emplace(xq_.get());
    if (inserted) it->second = std::make_shared<XqGroup>();
    group = std::static_pointer_cast<XqGroup>(it->second);
  }
  auto c = std::make_unique<CudaLayer>(codec_->clone(memo), method_, ctx_, options_, group);
  c->ledger_ = ledger_;
  c->ledger_.forget_last_append();  // the copy keeps no retired exact values
  c->window_dtype_ = window_dtype_;
  c->page_bytes_ = page_bytes_;
  const int64_t P = ledger_.page_tokens();
  const int64_t p0 = ledger_.sealed_tokens() / P, p1 = (ledger_.offset() + P - 1) / P;
  std::vector<PtrPair> pages;
  std::vector<std::shared_ptr<DevBlock>> blocks;
  const Status s1 = c->page_table_.reserve(*ctx_, p1);
  const Status s2 = c->block_table_.reserve(*ctx_, ledger_.n_blocks());
  const Status s3 = c->alloc_pages(p0, p1, page_bytes_, pages);
  std::vector<std::pair<size_t, size_t>> sizes;  // each block's own (CacheGen's differ)
  for (const auto& b : blocks_) sizes.emplace_back(b->kb, b->vb);
  const Status s4 = c->alloc_sized(sizes, blocks);
  const Status s5 =
      method_.xq == 2 ? c->link_table_.reserve(*ctx_, ledger_.n_blocks()) : ok_status();
  if (!s1.ok() || !s2.ok() || !s3.ok() || !s4.ok() || !s5.ok()) {
    std::fprintf(stderr, "kvq: out of GPU memory cloning a cache (%s)\n",
                 (!s1.ok()   ? s1
                  : !s2.ok() ? s2
                  : !s3.ok() ? s3
                  : !s4.ok() ? s4
                             : s5)
                     .to_string()
                     .c_str());
    std::abort();
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    const DevBlock& src = *blocks_[i];
    // Blocks are copied once per memo, so the copies share codes as the originals do: an
    // anchor registers its copies (or takes the copy a reuse layer cloned before it made); a
    // reuse block links to its anchor block's copy, made here when there is none yet.
    if (method_.xq == 1) {
      auto [it, inserted] = memo.copies.try_emplace(&src, blocks[i]);
      if (!inserted) {
        blocks[i] = std::static_pointer_cast<DevBlock>(it->second);  // ours goes back to the pool
        continue;
      }
    }
    KVQ_CUDA_CHECK(
        cudaMemcpyAsync(blocks[i]->p.k, src.p.k, src.kb, cudaMemcpyDeviceToDevice, ctx_->stream));
    KVQ_CUDA_CHECK(
        cudaMemcpyAsync(blocks[i]->p.v, src.p.v, src.vb, cudaMemcpyDeviceToDevice, ctx_->stream));
    if (method_.xq == 2) {
      auto [it, inserted] = memo.copies.try_emplace(src.linked.get());
      if (inserted) {
        const DevBlock& a = *src.linked;
        auto k = ctx_->pool->alloc(a.kb);
        auto v = ctx_->pool->alloc(a.vb);
        if (!k.ok() || !v.ok()) {
          std::fprintf(stderr, "kvq: out of GPU memory cloning a cache\n");
          std::abort();
        }
        auto copy = std::make_shared<DevBlock>(ctx_->pool, PtrPair{*k, *v}, a.kb, a.vb);
        KVQ_CUDA_CHECK(
            cudaMemcpyAsync(copy->p.k, a.p.k, a.kb, cudaMemcpyDeviceToDevice, ctx_->stream));
        KVQ_CUDA_CHECK(
            cudaMemcpyAsync(copy->p.v, a.p.v, a.vb, cudaMemcpyDeviceToDevice, ctx_->stream));
        it->second = copy;
      }
      blocks[i]->linked = std::static_pointer_cast<const DevBlock>(it->second);
    }
  }
  for (int64_t i = p0; i < p1; ++i) {
    const PtrPair& src = pages_[static_cast<size_t>(i)];
    const PtrPair& dst = pages[static_cast<size_t>(i - p0)];
    KVQ_CUDA_CHECK(
        cudaMemcpyAsync(dst.k, src.k, page_bytes_, cudaMemcpyDeviceToDevice, ctx_->stream));
    KVQ_CUDA_CHECK(
        cudaMemcpyAsync(dst.v, src.v, page_bytes_, cudaMemcpyDeviceToDevice, ctx_->stream));
  }
  c->pages_.assign(static_cast<size_t>(p1), PtrPair{});
  for (int64_t i = p0; i < p1; ++i)
    c->pages_[static_cast<size_t>(i)] = pages[static_cast<size_t>(i - p0)];
  c->blocks_ = blocks;
  c->cg_tables_ = cg_tables_;  // immutable once made: shared
  c->zprobe_bytes_ = zprobe_bytes_;
  for (const ZipProbe& p : zprobes_) {
    auto piece = ctx_->pool->alloc(zprobe_bytes_);
    if (!piece.ok()) {
      std::fprintf(stderr, "kvq: out of GPU memory cloning a cache\n");
      std::abort();
    }
    KVQ_CUDA_CHECK(
        cudaMemcpyAsync(*piece, p.data, zprobe_bytes_, cudaMemcpyDeviceToDevice, ctx_->stream));
    c->zprobes_.push_back(ZipProbe{p.pos, *piece});
  }
  c->page_table_.set(*ctx_, p0, pages.data(), static_cast<int64_t>(pages.size()));
  c->block_table_.set(*ctx_, 0, parts_of(blocks, false).data(),
                      static_cast<int64_t>(blocks.size()));
  if (method_.xq == 2)
    c->link_table_.set(*ctx_, 0, parts_of(blocks, true).data(),
                       static_cast<int64_t>(blocks.size()));
  return c;
}

CacheBytes CudaLayer::bytes() const {
  return ledger_.bytes(page_bytes_, codec_->extra_bytes() + xq_orphan_bytes() + zip_probe_total(),
                       shape_.n_kv_heads, shape_.head_dim);
}

uint64_t CudaLayer::resident_bytes() const {
  // Walk what is held: the blocks' parts and the window's pages (not the retired ones).
  uint64_t r = 0;
  for (const auto& b : blocks_) r += b->kb + b->vb;
  const int64_t P = ledger_.page_tokens();
  for (size_t i = static_cast<size_t>(ledger_.sealed_tokens() / P); i < pages_.size(); ++i)
    if (pages_[i].k) r += 2 * page_bytes_;
  return r + codec_->extra_resident_bytes() + xq_orphan_bytes() + zip_probe_total();
}

// ---- ZipCache ----

Status CudaLayer::zip_plan(const Ledger& before, int64_t B, int64_t n_new, bool with_q,
                           ZipPlan& z) const {
  const ZipConfig& c = method_.zc;
  const bool probing = c.saliency == Saliency::kAttn && with_q;
  const int64_t T = before.block_tokens();
  z.probe_bytes = zip_probe_bytes(B);
  z.held = zprobes_;
  // Pieces of probes this append made and already saw out serve its later probes (stream
  // order: the seal that read one is enqueued before the probes that overwrite it), so it holds
  // about as many as the CPU codec does, not one per probe position it passes.
  size_t older = zprobes_.size();  // z.held's first `older` predate this append
  std::vector<uint8_t*> spare;
  Ledger plan = before;
  plan.begin_append(B, n_new);
  const CacheBytes bb = block_bytes(B);
  for (int64_t done = 0; done < n_new;) {
    const int64_t n = plan.next_run(n_new - done), pos0 = plan.offset();
    plan.advance(n);
    done += n;
    if (probing) {  // zipcache.cc's on_tokens
      ZipPlan::Step st;
      st.first = static_cast<int64_t>(z.table.size());
      st.sealed = plan.sealed_tokens();
      for (int64_t p = pos0; p < pos0 + n; ++p) {
        if (!c.is_probe(p)) continue;
        ZipProbe pr{p, nullptr};
        if (!spare.empty()) {
          pr.data = spare.back();
          spare.pop_back();
        } else {
          auto piece = ctx_->pool->alloc(z.probe_bytes);
          if (!piece.ok()) {
            zip_unplan(z);
            return piece.status();
          }
          pr.data = *piece;
          z.created.push_back(pr.data);
        }
        z.table.push_back(pr);
        z.held.push_back(pr);
        ++st.n;
      }
      if (st.n) z.steps.push_back(st);
    }
    while (plan.seal_due()) {  // zipcache.cc's encode, then its drop of probes seen out
      ZipSeg seg;
      seg.block = plan.n_blocks();
      seg.first = static_cast<int64_t>(z.table.size());
      seg.n = static_cast<int>(z.held.size());
      seg.attn = c.saliency == Saliency::kAttn && !z.held.empty();
      z.table.insert(z.table.end(), z.held.begin(), z.held.end());
      if (z.steps.empty() || !z.steps.back().seal) {  // seals in a row go in one launch
        ZipPlan::Step st;
        st.seal = true;
        st.first = static_cast<int64_t>(z.segs.size());
        z.steps.push_back(st);
      }
      ++z.steps.back().n;
      z.segs.push_back(seg);
      plan.record_block(bb, plan.keep_exact_of_due_block());
      const int64_t end = (seg.block + 1) * T;
      size_t drop = 0;
      while (drop < z.held.size() && z.held[drop].pos < end) ++drop;
      for (size_t i = std::min(drop, older); i < drop; ++i) spare.push_back(z.held[i].data);
      older -= std::min(drop, older);
      z.held.erase(z.held.begin(), z.held.begin() + static_cast<std::ptrdiff_t>(drop));
    }
  }
  const size_t tb = z.table.size() * sizeof(ZipProbe), sb = z.segs.size() * sizeof(ZipSeg);
  if (tb + sb > 0) {
    auto t = ctx_->pool->alloc(tb + sb);
    if (!t.ok()) {
      zip_unplan(z);
      return t.status();
    }
    z.dev = *t;
    z.dev_bytes = tb + sb;
    std::vector<uint8_t> host(tb + sb);
    std::memcpy(host.data(), z.table.data(), tb);
    std::memcpy(host.data() + tb, z.segs.data(), sb);
    // Pageable memory: the call returns once the bytes are staged, so `host` may go.
    KVQ_CUDA_CHECK(
        cudaMemcpyAsync(z.dev, host.data(), tb + sb, cudaMemcpyHostToDevice, ctx_->stream));
  }
  return ok_status();
}

void CudaLayer::zip_launch(const LayerDesc& L, const TensorView* q, const ZipPlan& z) const {
  const int Hq = shape_.n_q_heads;
  for (const ZipPlan::Step& st : z.steps) {
    if (st.seal)
      zip_seal(L, z.dev_segs() + st.first, st.n, z.dev_table(), Hq, ctx_->stream);
    else
      zip_probes(L, dev(*q), ledger_.offset(), st.sealed, z.dev_table() + st.first, st.n, Hq,
                 ctx_->stream);
  }
}

void CudaLayer::zip_unplan(ZipPlan& z) const {
  for (uint8_t* p : z.created) ctx_->pool->free(p, z.probe_bytes);
  z.created.clear();
  if (z.dev) ctx_->pool->free(z.dev, z.dev_bytes);
  z.dev = nullptr;
}

Status CudaLayer::zip_state(std::vector<uint8_t>& out) const {
  if (zprobes_.empty()) return ok_status();
  auto put64 = [&](uint64_t x) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(x >> (8 * i)));
  };
  put64(zprobes_.size());
  std::vector<uint8_t> piece;
  for (const ZipProbe& p : zprobes_) {
    put64(static_cast<uint64_t>(p.pos));
    KVQ_RETURN_IF_ERROR(copy_to_host(p.data, zprobe_bytes_, piece));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    out.insert(out.end(), piece.begin(), piece.end());
  }
  return ok_status();
}

// ---- XQuant ----

Status CudaLayer::xq_precheck(int64_t batch, int64_t n_new) const {
  if (method_.xq != 2) return ok_status();
  const int64_t T = ledger_.block_tokens(), R = ledger_.residual(), end = ledger_.offset() + n_new;
  const int64_t will_hold = end >= R + T ? (end - R) / T : 0;
  const CudaLayer* a = xq_->anchor;
  for (int64_t i = ledger_.n_blocks(); i < will_hold; ++i) {
    if (!a || i >= static_cast<int64_t>(a->blocks_.size()))
      return invalid_argument("xquant layer " + std::to_string(method_.layer) + " reuses layer " +
                              std::to_string(method_.anchor) + "'s codes and would seal tokens [" +
                              std::to_string(i * T) + ", " + std::to_string((i + 1) * T) +
                              "), but layer " + std::to_string(method_.anchor) +
                              (a ? "" : " (not part of this model)") +
                              " has not sealed them yet: append to the anchor layer first");
    if (a->ledger_.batch() != batch)
      return shape_mismatch("xquant layer " + std::to_string(method_.layer) + ": batch size " +
                            std::to_string(batch) + " differs from its anchor layer " +
                            std::to_string(method_.anchor) + "'s " +
                            std::to_string(a->ledger_.batch()));
  }
  return ok_status();
}

uint64_t CudaLayer::xq_orphan_bytes() const {
  if (!xq_) return 0;
  const CudaLayer* biller = xq_->anchor;
  if (!biller)
    for (const CudaLayer* r : xq_->readers)
      if (!biller || r->method_.layer < biller->method_.layer) biller = r;
  if (biller != this) return 0;
  const CudaLayer* a = xq_->anchor;
  std::vector<const DevBlock*> seen;
  uint64_t total = 0;
  for (const CudaLayer* reader : xq_->readers)
    for (size_t i = 0; i < reader->blocks_.size(); ++i) {
      const DevBlock* b = reader->blocks_[i]->linked.get();
      if (a && i < a->blocks_.size() && a->blocks_[i].get() == b) continue;
      if (std::find(seen.begin(), seen.end(), b) != seen.end()) continue;
      seen.push_back(b);
      total += b->kb + b->vb;
    }
  return total;
}

// u64 XXH64 (seed 0) of the anchor block's code bytes (its key codes, then its value codes),
// little-endian, then the block's own key part: the serialized key part of a reuse block.
Status CudaLayer::xq_reuse_key_chunk(const DevBlock& blk, std::vector<uint8_t>& out) const {
  const BlockGeometry g{ledger_.batch(), shape_.n_kv_heads, ledger_.block_tokens(),
                        shape_.head_dim};
  const KiviLayout K{g, method_.k_bits, method_.v_bits, method_.group};
  std::vector<uint8_t> kc, vc, own;
  KVQ_RETURN_IF_ERROR(copy_to_host(blk.linked->p.k, K.S() * K.kcode(), kc));
  KVQ_RETURN_IF_ERROR(copy_to_host(blk.linked->p.v, K.S() * K.vcode(), vc));
  KVQ_RETURN_IF_ERROR(copy_to_host(blk.p.k, blk.kb, own));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  XXH64_state_t* st = XXH64_createState();
  XXH64_reset(st, 0);
  XXH64_update(st, kc.data(), kc.size());
  XXH64_update(st, vc.data(), vc.size());
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  out.clear();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(h >> (8 * i)));
  out.insert(out.end(), own.begin(), own.end());
  return ok_status();
}

// The CPU backend's import rules, on scratch CPU layers: a reuse layer's chunks are checked
// against a CPU copy of its anchor layer as it is now (its codes hash, its blocks, its batch).
Status CudaLayer::validate_import(const std::vector<ChunkRef>& chunks, int64_t batch,
                                  int64_t offset, DType wdtype,
                                  std::vector<CacheBytes>* block_bytes) const {
  CloneMemo memo;  // the scratch codecs share one fresh link, as the originals do
  CacheOptions cpu;
  std::unique_ptr<CpuLayer> anchor;
  if (method_.xq == 2 && xq_->anchor) {
    const CudaLayer& a = *xq_->anchor;
    anchor = std::make_unique<CpuLayer>(a.codec_->clone(memo), cpu);
    struct Collect final : ChunkSink {
      std::vector<std::vector<uint8_t>> store;
      std::vector<ChunkRef> refs;
      Status put(const ChunkRef& c) override {
        store.emplace_back(c.data, c.data + c.size);
        refs.push_back(c);
        return ok_status();
      }
    } sink;
    KVQ_RETURN_IF_ERROR(a.export_blocks(0, sink));
    KVQ_RETURN_IF_ERROR(a.export_tail(sink));
    for (size_t i = 0; i < sink.refs.size(); ++i) sink.refs[i].data = sink.store[i].data();
    if (a.ledger_.batch() > 0)
      KVQ_RETURN_IF_ERROR(
          anchor->import_chunks(sink.refs, a.ledger_.batch(), a.ledger_.offset(), a.window_dtype_));
  }
  CpuLayer scratch(codec_->clone(memo), cpu);
  KVQ_RETURN_IF_ERROR(scratch.import_chunks(chunks, batch, offset, wdtype));
  if (block_bytes)
    for (int64_t i = 0; i < scratch.n_blocks(); ++i)
      block_bytes->push_back(scratch.ledger().block_bytes(i));
  return ok_status();
}

uint64_t CudaLayer::workspace_bytes() const {
  const int64_t P = ledger_.page_tokens();
  uint64_t r = 0;
  for (int64_t i = ledger_.exact_begin() / P; i < ledger_.sealed_tokens() / P; ++i)
    if (i < static_cast<int64_t>(pages_.size()) && pages_[static_cast<size_t>(i)].k)
      r += 2 * page_bytes_;
  return r;
}

Status CudaLayer::copy_to_host(const uint8_t* p, size_t bytes, std::vector<uint8_t>& out) const {
  out.resize(bytes);
  if (bytes)
    KVQ_CUDA_CHECK(cudaMemcpyAsync(out.data(), p, bytes, cudaMemcpyDeviceToHost, ctx_->stream));
  return ok_status();
}

Status CudaLayer::export_blocks(int64_t first_block, ChunkSink& sink) const {
  if (first_block < 0 || first_block > n_blocks())
    return out_of_range("export_blocks from block " + std::to_string(first_block) + " of " +
                        std::to_string(n_blocks()));
  DeviceGuard guard(ctx_->device);
  const int64_t T = ledger_.block_tokens();
  std::vector<uint8_t> kh, vh, buf;
  for (int64_t i = first_block; i < n_blocks(); ++i) {
    const DevBlock& db = *blocks_[static_cast<size_t>(i)];
    if (method_.xq == 2) {
      KVQ_RETURN_IF_ERROR(xq_reuse_key_chunk(db, buf));
      KVQ_RETURN_IF_ERROR(
          sink.put(ChunkRef{ChunkKind::kBlockKeys, i * T, T, buf.data(), buf.size()}));
      KVQ_RETURN_IF_ERROR(copy_to_host(db.p.v, db.vb, vh));
      KVQ_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
      KVQ_RETURN_IF_ERROR(
          sink.put(ChunkRef{ChunkKind::kBlockValues, i * T, T, vh.data(), vh.size()}));
      continue;
    }
    KVQ_RETURN_IF_ERROR(copy_to_host(db.p.k, db.kb, kh));
    KVQ_RETURN_IF_ERROR(copy_to_host(db.p.v, db.vb, vh));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
    BlockData blk;
    blk.keys = Buffer(kh.data(), kh.size());
    blk.values = Buffer(vh.data(), vh.size());
    for (int keys = 1; keys >= 0; --keys) {
      buf.clear();
      codec_->serialize(blk, keys != 0, buf);
      KVQ_RETURN_IF_ERROR(sink.put(ChunkRef{keys ? ChunkKind::kBlockKeys : ChunkKind::kBlockValues,
                                            i * T, T, buf.data(), buf.size()}));
    }
  }
  return ok_status();
}

Status CudaLayer::export_tail(ChunkSink& sink) const {
  DeviceGuard guard(ctx_->device);
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, B = ledger_.batch();
  const int64_t P = ledger_.page_tokens(), t0 = ledger_.sealed_tokens(),
                n = ledger_.window_tokens();
  const int64_t p0 = t0 / P, np = ledger_.window_pages();
  // The window's pages, K then V, as [page][B, H, P, D].
  std::vector<uint8_t> host(static_cast<size_t>(2 * np) * page_bytes_);
  for (int64_t i = 0; i < np; ++i) {
    const PtrPair& pg = pages_[static_cast<size_t>(p0 + i)];
    KVQ_CUDA_CHECK(cudaMemcpyAsync(host.data() + static_cast<size_t>(i) * page_bytes_, pg.k,
                                   page_bytes_, cudaMemcpyDeviceToHost, ctx_->stream));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(host.data() + static_cast<size_t>(np + i) * page_bytes_, pg.v,
                                   page_bytes_, cudaMemcpyDeviceToHost, ctx_->stream));
  }
  KVQ_CUDA_CHECK(cudaStreamSynchronize(ctx_->stream));
  std::vector<uint8_t> buf(static_cast<size_t>(B * H * n * D) * 2);
  for (int keys = 1; keys >= 0; --keys) {
    auto* out = reinterpret_cast<uint16_t*>(buf.data());
    const auto* pages = reinterpret_cast<const uint16_t*>(
        host.data() + static_cast<size_t>(keys ? 0 : np) * page_bytes_);
    const int64_t page_elems = B * H * P * D;
    for (int64_t bh = 0; bh < B * H; ++bh)
      for (int64_t t = 0; t < n; ++t)
        std::memcpy(out + (bh * n + t) * D, pages + (t / P) * page_elems + (bh * P + t % P) * D,
                    static_cast<size_t>(D) * 2);
    KVQ_RETURN_IF_ERROR(sink.put(ChunkRef{keys ? ChunkKind::kWindowKeys : ChunkKind::kWindowValues,
                                          t0, n, buf.data(), buf.size()}));
  }
  std::vector<uint8_t> state;
  if (method_.zip)
    KVQ_RETURN_IF_ERROR(zip_state(state));
  else
    codec_->export_state(state);
  return sink.put(ChunkRef{ChunkKind::kState, 0, ledger_.offset(), state.data(), state.size()});
}

Status CudaLayer::import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                                DType wdtype) {
  // Everything about the chunks is validated by the CPU backend's import into a scratch layer
  // (the one set of import rules); the device copy is made from the same chunks after.
  std::vector<CacheBytes> block_bytes_cpu;  // each block's accounting, as the CPU backend's
  KVQ_RETURN_IF_ERROR(validate_import(chunks, batch, offset, wdtype, &block_bytes_cpu));
  KVQ_RETURN_IF_ERROR(
      codec_->import_state(chunks.back().data, chunks.back().size, batch, offset, false));
  // ZipCache's probes (validated above): zipcache.cc's state, u64 count, then per probe its u64
  // position and piece, onto the device.
  std::vector<ZipProbe> probes;
  const size_t zbytes = method_.zip ? zip_probe_bytes(batch) : 0;
  if (method_.zip && chunks.back().size > 0) {
    const uint8_t* p = chunks.back().data;
    auto get64 = [&](size_t at) {
      uint64_t x = 0;
      for (int i = 0; i < 8; ++i) x |= static_cast<uint64_t>(p[at + i]) << (8 * i);
      return x;
    };
    const uint64_t n = get64(0);
    for (uint64_t i = 0; i < n; ++i) {
      auto piece = ctx_->pool->alloc(zbytes);
      if (!piece.ok()) {
        for (auto& z : probes) ctx_->pool->free(z.data, zbytes);
        return piece.status();
      }
      const size_t at = 8 + i * (8 + zbytes);
      probes.push_back(ZipProbe{static_cast<int64_t>(get64(at)), *piece});
      KVQ_CUDA_CHECK(
          cudaMemcpyAsync(*piece, p + at + 8, zbytes, cudaMemcpyHostToDevice, ctx_->stream));
    }
  }
  auto drop_probes = [&] {
    for (auto& z : probes) ctx_->pool->free(z.data, zbytes);
  };
  DeviceGuard guard(ctx_->device);
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = ledger_.page_tokens(),
                T = ledger_.block_tokens();
  const int64_t nb = static_cast<int64_t>((chunks.size() - 3) / 2), n = offset - nb * T;
  const int64_t p0 = nb * T / P, p1 = p0 + (n + P - 1) / P;
  const size_t pbytes = page_bytes_at(batch);
  std::vector<PtrPair> pages;
  std::vector<std::shared_ptr<DevBlock>> blocks;
  Status room = page_table_.reserve(*ctx_, p1);
  if (room.ok()) room = block_table_.reserve(*ctx_, nb);
  if (room.ok() && method_.xq == 2) room = link_table_.reserve(*ctx_, nb);
  if (room.ok()) room = alloc_pages(p0, p1, pbytes, pages);
  if (!room.ok()) {
    drop_probes();
    return room;
  }
  std::shared_ptr<const CgTables> cg_tables;
  Status got = ok_status();
  if (method_.cg) {
    std::vector<std::pair<size_t, size_t>> sizes;
    for (int64_t i = 0; i < nb; ++i)
      sizes.emplace_back(chunks[static_cast<size_t>(2 * i)].size,
                         chunks[static_cast<size_t>(2 * i + 1)].size);
    got = alloc_sized(sizes, blocks);
    if (got.ok() && nb > 0) {
      auto t = cg_load_tables(chunks[0].data, chunks[0].size, chunks[1].data, chunks[1].size,
                              ctx_->stream);
      if (t.ok())
        cg_tables = *t;
      else
        got = t.status();
    }
  } else {
    got = alloc_blocks(nb, batch, blocks);
  }
  if (!got.ok()) {
    for (auto& p : pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
    drop_probes();
    return got;
  }
  cudaStream_t st = ctx_->stream;
  for (int64_t i = 0; i < nb; ++i) {
    // For the methods this backend holds, a serialized part is the stored part (an XQuant reuse
    // block's key part after the 8-byte hash of the anchor codes it reads: the anchor's block i,
    // as the validation checked).
    const ChunkRef& kc = chunks[static_cast<size_t>(2 * i)];
    const ChunkRef& vc = chunks[static_cast<size_t>(2 * i + 1)];
    const size_t skip = method_.xq == 2 ? 8 : 0;
    DevBlock& db = *blocks[static_cast<size_t>(i)];
    KVQ_CHECK(kc.size == skip + db.kb && vc.size == db.vb);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(db.p.k, kc.data + skip, db.kb, cudaMemcpyHostToDevice, st));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(db.p.v, vc.data, db.vb, cudaMemcpyHostToDevice, st));
    if (method_.xq == 2) db.linked = xq_->anchor->blocks_[static_cast<size_t>(i)];
  }
  // The window chunks [B, H, n, D] into pages [B, H, P, D] (unused page rows zero).
  std::vector<uint8_t> staging(pbytes * static_cast<size_t>(std::max<int64_t>(p1 - p0, 0)) * 2);
  std::memset(staging.data(), 0, staging.size());
  for (int keys = 1; keys >= 0; --keys) {
    const auto* src = reinterpret_cast<const uint16_t*>(
        chunks[static_cast<size_t>(2 * nb + (keys ? 0 : 1))].data);
    for (int64_t t = 0; t < n; ++t) {
      auto* page = reinterpret_cast<uint16_t*>(
          staging.data() +
          (static_cast<size_t>(keys ? 0 : p1 - p0) + static_cast<size_t>(t / P)) * pbytes);
      for (int64_t bh = 0; bh < batch * H; ++bh)
        std::memcpy(page + (bh * P + t % P) * D, src + (bh * n + t) * D,
                    static_cast<size_t>(D) * 2);
    }
  }
  for (int64_t i = 0; i < p1 - p0; ++i) {
    KVQ_CUDA_CHECK(cudaMemcpyAsync(pages[static_cast<size_t>(i)].k,
                                   staging.data() + static_cast<size_t>(i) * pbytes, pbytes,
                                   cudaMemcpyHostToDevice, st));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(pages[static_cast<size_t>(i)].v,
                                   staging.data() + static_cast<size_t>(p1 - p0 + i) * pbytes,
                                   pbytes, cudaMemcpyHostToDevice, st));
  }
  KVQ_CUDA_CHECK(cudaStreamSynchronize(st));  // the caller may free the chunks on return
  // Commit.
  release_all();
  pages_.assign(static_cast<size_t>(p1), PtrPair{});
  for (int64_t i = p0; i < p1; ++i)
    pages_[static_cast<size_t>(i)] = pages[static_cast<size_t>(i - p0)];
  blocks_ = blocks;
  page_table_.set(*ctx_, p0, pages.data(), static_cast<int64_t>(pages.size()));
  block_table_.set(*ctx_, 0, parts_of(blocks, false).data(), nb);
  if (method_.xq == 2) link_table_.set(*ctx_, 0, parts_of(blocks, true).data(), nb);
  ledger_.assign(batch, offset,
                 method_.cg ? block_bytes_cpu
                            : std::vector<CacheBytes>(static_cast<size_t>(nb), block_bytes(batch)));
  cg_tables_ = std::move(cg_tables);
  window_dtype_ = wdtype;
  page_bytes_ = pbytes;
  if (method_.zip) {  // the probes live on the device, not in the codec
    zprobes_ = std::move(probes);
    zprobe_bytes_ = zbytes;
    return ok_status();
  }
  KVQ_CHECK(codec_->import_state(chunks.back().data, chunks.back().size, batch, offset, true).ok());
  return ok_status();
}

// ---- CacheGen ----

namespace {

// Device memory taken from the pool for the length of one call.
struct PoolPiece {
  DevicePool* pool = nullptr;
  uint8_t* p = nullptr;
  size_t n = 0;
  PoolPiece() = default;
  PoolPiece(const PoolPiece&) = delete;
  PoolPiece& operator=(const PoolPiece&) = delete;
  ~PoolPiece() {
    if (p) pool->free(p, n);  // stream order: the kernels enqueued before run first
  }
  Status take(DevicePool& pl, size_t bytes) {
    pool = &pl;
    n = bytes;
    KVQ_ASSIGN_OR_RETURN(p, pl.alloc(bytes));
    return ok_status();
  }
};

size_t round256(size_t n) { return DevicePool::rounded(n); }

}  // namespace

Status CudaLayer::alloc_sized(const std::vector<std::pair<size_t, size_t>>& sizes,
                              std::vector<std::shared_ptr<DevBlock>>& out) const {
  out.clear();
  size_t total = 0;
  for (const auto& [k, v] : sizes) total += DevicePool::rounded(k) + DevicePool::rounded(v);
  KVQ_RETURN_IF_ERROR(ctx_->pool->reserve(total));
  for (const auto& [kb, vb] : sizes) {
    auto k = ctx_->pool->alloc(kb);
    auto v = ctx_->pool->alloc(vb);
    KVQ_CHECK(k.ok() && v.ok());  // reserved above
    out.push_back(std::make_shared<DevBlock>(ctx_->pool, PtrPair{*k, *v}, kb, vb));
  }
  return ok_status();
}

CgParts CudaLayer::cg_parts(int64_t B, const CgTables& t) const {
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  const KiviLayout K{g, method_.k_bits, method_.v_bits, method_.group};
  CgParts c;
  c.params[0] = K.S() * K.kparam();
  c.params[1] = K.S() * K.vparam();
  c.mask[0] = c.mask[1] = method_.cgc.delta == 4 ? cachegen::mask_bytes(shape_.head_dim) : 0;
  c.prefix0[0] = t.prefix0[0];
  c.prefix0[1] = t.prefix0[1];
  return c;
}

Result<std::shared_ptr<const CgTables>> CudaLayer::cg_load_tables(const uint8_t* k, size_t kn,
                                                                  const uint8_t* v, size_t vn,
                                                                  cudaStream_t st) {
  auto t = std::make_shared<CgTables>();
  const uint8_t* parts[2] = {k, v};
  const size_t sizes[2] = {kn, vn};
  for (int part = 0; part < 2; ++part) {
    uint32_t len = 0;
    if (sizes[part] < 4) return corrupt("cachegen block 0: no table set");
    std::memcpy(&len, parts[part], 4);
    if (len > sizes[part] - 4) return corrupt("cachegen block 0: table set past the part");
    KVQ_ASSIGN_OR_RETURN(entropy::FrequencyTables ft,
                         entropy::deserialize_tables(parts[part] + 4, len));
    KVQ_ASSIGN_OR_RETURN(entropy::SharedTables sh,
                         entropy::make_shared_tables(std::move(ft), entropy::RansModelUse::kBoth));
    KVQ_ASSIGN_OR_RETURN(t->enc[part], GpuEncodeTables::upload(sh, st));
    KVQ_ASSIGN_OR_RETURN(t->dec[part], GpuTables::upload(sh.tables, st));
    t->prefix0[part] = 4 + static_cast<uint64_t>(len);
    t->iw[part] = std::bit_width(static_cast<unsigned>(sh.tables.n_tables - 1));
  }
  return std::shared_ptr<const CgTables>(std::move(t));
}

Status CudaLayer::cg_seal(const LayerDesc& L, int64_t first,
                          const std::vector<std::shared_ptr<DevBlock>>& kivi,
                          std::vector<std::shared_ptr<DevBlock>>& out,
                          std::vector<CacheBytes>& bytes, std::unique_ptr<BlockCodec>& codec,
                          std::shared_ptr<const CgTables>& tables) const {
  cudaStream_t st = ctx_->stream;
  DevicePool& pool = *ctx_->pool;
  const int64_t n = static_cast<int64_t>(kivi.size()), S = L.S(), T = L.T, D = L.D, TD = T * D;
  const int64_t B = L.B, H = L.H;
  out.clear();
  bytes.clear();
  std::vector<std::pair<size_t, size_t>> sizes;
  int64_t i0 = 0;
  SealedBlock b0;  // block 0's bytes, until their upload is done
  if (first == 0) {
    // Block 0 carries the layer's prototype tables, which the CPU codec builds from it: it is
    // encoded on the host, from the window's values read back, by a copy of the codec that the
    // append commits (the same bytes as the CPU backend's by construction).
    const size_t elems = static_cast<size_t>(S * TD);
    PoolPiece f32;
    KVQ_RETURN_IF_ERROR(f32.take(pool, 2 * elems * 4));
    const DevTensor kt{f32.p, 0, H * TD, TD, D, 1};
    const DevTensor vt{f32.p + elems * 4, 0, H * TD, TD, D, 1};
    cuda::read(L, 1, 0, T, kt, vt, st);
    std::vector<float> host(2 * elems);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(host.data(), f32.p, 2 * elems * 4, cudaMemcpyDeviceToHost, st));
    KVQ_CUDA_CHECK(cudaStreamSynchronize(st));
    CloneMemo memo;
    codec = codec_->clone(memo);
    Workspace ws;
    b0 = codec->encode(0, BlockGeometry{B, H, T, D}, host.data(), host.data() + elems, ws);
    const Buffer& kb = b0.data->keys;
    const Buffer& vb = b0.data->values;
    KVQ_ASSIGN_OR_RETURN(tables, cg_load_tables(kb.data(), kb.size(), vb.data(), vb.size(), st));
    sizes.emplace_back(kb.size(), vb.size());
    bytes.push_back(b0.bytes);
    i0 = 1;
  }
  KVQ_CHECK(tables != nullptr);  // block 0 is held, or sealed above
  const int64_t m = n - i0, ns = m * S;
  const CgParts parts = cg_parts(B, *tables);
  const uint64_t mb = parts.mask[0];
  // The device work for blocks [first + i0, first + n): symbols and masks, the encoded streams
  // with their offsets, results and payloads, per part; then the parts' sizes on the host.
  const SymbolArrays sa{nullptr, ns, T, static_cast<int>(D), method_.cgc.bits};
  const size_t sym_b = round256(static_cast<size_t>(ns * TD)), mask_b = round256(ns * mb);
  const size_t cap = round256(ns ? encode_capacity(sa) : 0);
  const size_t escr = round256(ns ? encode_scratch_bytes(sa, true) : 0);
  const size_t off_b = round256(static_cast<size_t>(ns + 1) * 8), st_b = round256(ns * 4);
  const size_t per_part = sym_b + mask_b + cap + off_b + 2 * st_b;
  PoolPiece work;
  std::vector<uint64_t> off[2];
  std::vector<int32_t> res[2];
  std::vector<uint32_t> pay[2];
  auto at = [&](int part, size_t o) { return work.p + part * per_part + o; };
  if (ns > 0) {
    KVQ_RETURN_IF_ERROR(work.take(pool, 2 * per_part + escr));
    CgOut o{at(0, 0), at(1, 0), at(0, sym_b), at(1, sym_b)};
    cg_symbols(L, first + i0, m, method_.cgc, o, st);
    for (int part = 0; part < 2; ++part) {
      SymbolArrays a = sa;
      a.symbols = at(part, 0);
      uint8_t* enc = at(part, sym_b + mask_b);
      auto* offs = reinterpret_cast<uint64_t*>(at(part, sym_b + mask_b + cap));
      auto* status = reinterpret_cast<int32_t*>(at(part, sym_b + mask_b + cap + off_b));
      auto* payload = reinterpret_cast<uint32_t*>(at(part, sym_b + mask_b + cap + off_b + st_b));
      KVQ_RETURN_IF_ERROR(encode_symbol_streams(a, tables->enc[part], true, -1, enc, offs, status,
                                                work.p + 2 * per_part, escr, st));
      cg_payload(enc, offs, ns, tables->iw[part], static_cast<int>(D), payload, st);
      off[part].resize(static_cast<size_t>(ns + 1));
      res[part].resize(static_cast<size_t>(ns));
      pay[part].resize(static_cast<size_t>(ns));
      KVQ_CUDA_CHECK(cudaMemcpyAsync(off[part].data(), offs, off[part].size() * 8,
                                     cudaMemcpyDeviceToHost, st));
      KVQ_CUDA_CHECK(cudaMemcpyAsync(res[part].data(), status, res[part].size() * 4,
                                     cudaMemcpyDeviceToHost, st));
      KVQ_CUDA_CHECK(cudaMemcpyAsync(pay[part].data(), payload, pay[part].size() * 4,
                                     cudaMemcpyDeviceToHost, st));
    }
    KVQ_CUDA_CHECK(cudaStreamSynchronize(st));
    for (int part = 0; part < 2; ++part)  // symbols are < 2^bits by construction, as on the CPU
      for (int32_t r : res[part]) KVQ_CHECK(r == kEncodedOk);
    for (int64_t j = 0; j < m; ++j) {
      size_t ps[2];
      for (int part = 0; part < 2; ++part)
        ps[part] =
            parts.params[part] + static_cast<size_t>(S) * (mb + 4) +
            (off[part][static_cast<size_t>((j + 1) * S)] - off[part][static_cast<size_t>(j * S)]);
      sizes.emplace_back(ps[0], ps[1]);
    }
  }
  KVQ_RETURN_IF_ERROR(alloc_sized(sizes, out));
  if (i0 == 1) {
    KVQ_CUDA_CHECK(
        cudaMemcpyAsync(out[0]->p.k, b0.data->keys.data(), out[0]->kb, cudaMemcpyHostToDevice, st));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(out[0]->p.v, b0.data->values.data(), out[0]->vb,
                                   cudaMemcpyHostToDevice, st));
  }
  if (ns > 0) {
    // The parts assembled: pairs (from the KIVI blocks), masks, index (from the host), streams.
    std::vector<CopyJob> jobs;
    std::vector<uint32_t> index(static_cast<size_t>(2 * ns));
    for (int64_t j = 0; j < m; ++j) {
      const DevBlock& src = *kivi[static_cast<size_t>(i0 + j)];
      DevBlock& dst = *out[static_cast<size_t>(i0 + j)];
      CacheBytes c;
      c.params = parts.params[0] + parts.params[1];
      for (int part = 0; part < 2; ++part) {
        const uint64_t o0 = off[part][static_cast<size_t>(j * S)];
        uint64_t codes = 0;
        for (int64_t s = 0; s < S; ++s) {
          const size_t i = static_cast<size_t>(j * S + s);
          index[static_cast<size_t>(part * ns) + i] = static_cast<uint32_t>(off[part][i + 1] - o0);
          codes += pay[part][i];
        }
        (part == 0 ? c.key_codes : c.value_codes) = codes;
        uint8_t* d = part == 0 ? dst.p.k : dst.p.v;
        const uint8_t* kv = part == 0 ? src.p.k + S * L.kcode : src.p.v + S * L.vcode;
        jobs.push_back(CopyJob{kv, d, parts.params[part]});
        d += parts.params[part];
        if (mb) jobs.push_back(CopyJob{at(part, sym_b) + j * S * mb, d, S * mb});
        d += S * mb;
        jobs.push_back(CopyJob{nullptr, d, static_cast<uint64_t>(4 * S)});  // src set below
        d += 4 * S;
        jobs.push_back(CopyJob{at(part, sym_b + mask_b) + o0, d,
                               off[part][static_cast<size_t>((j + 1) * S)] - o0});
      }
      c.meta = dst.kb + dst.vb - c.params - c.key_codes - c.value_codes;
      bytes.push_back(c);
    }
    // Jobs and index in one upload; the index jobs read from it.
    const size_t jobs_b = round256(jobs.size() * sizeof(CopyJob));
    PoolPiece stage;
    KVQ_RETURN_IF_ERROR(stage.take(pool, jobs_b + index.size() * 4));
    const uint8_t* index_dev = stage.p + jobs_b;
    size_t k = 0;
    uint64_t largest = 0;
    for (int64_t j = 0; j < m; ++j)
      for (int part = 0; part < 2; ++part) {
        k += mb ? 2 : 1;  // pairs, masks
        jobs[k].src = index_dev + (static_cast<size_t>(part * ns) + static_cast<size_t>(j * S)) * 4;
        k += 2;
      }
    for (const CopyJob& j : jobs) largest = std::max(largest, j.bytes);
    std::vector<uint8_t> up(jobs_b + index.size() * 4);
    std::memcpy(up.data(), jobs.data(), jobs.size() * sizeof(CopyJob));
    std::memcpy(up.data() + jobs_b, index.data(), index.size() * 4);
    KVQ_CUDA_CHECK(cudaMemcpyAsync(stage.p, up.data(), up.size(), cudaMemcpyHostToDevice, st));
    copy_jobs(reinterpret_cast<const CopyJob*>(stage.p), static_cast<int64_t>(jobs.size()), largest,
              st);
    KVQ_CUDA_CHECK(cudaStreamSynchronize(st));  // `up` and the host bytes of block 0
    return ok_status();
  }
  KVQ_CUDA_CHECK(cudaStreamSynchronize(st));
  return ok_status();
}

Result<LayerDesc> CudaLayer::cg_mirror(int64_t first, int64_t nb) const {
  cudaStream_t st = ctx_->stream;
  const int64_t B = ledger_.batch();
  LayerDesc M = desc(B, window_dtype_);
  const int64_t S = M.S(), TD = M.T * M.D;
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  const KiviLayout K{g, method_.k_bits, method_.v_bits, method_.group};
  const size_t kb = round256(K.key_part()), stride = kb + round256(K.value_part());
  const int64_t n = std::max<int64_t>(nb - first, 0);
  // At most 64 MiB of symbols per decode (blocks at a time).
  const int64_t per = std::clamp<int64_t>((int64_t{64} << 20) / std::max<int64_t>(S * TD, 1), 1,
                                          std::max<int64_t>(n, 1));
  const int64_t ns = per * S;
  SymbolStreams probe;  // the sizes the scratch depends on
  probe.n = ns;
  probe.n_tokens = M.T;
  probe.n_channels = M.D;
  probe.bits = method_.cgc.bits;
  size_t dscr = 0;
  if (cg_tables_)
    for (int part = 0; part < 2; ++part)
      dscr = std::max(dscr, decode_scratch_bytes(probe, &cg_tables_->dec[part], false));
  const size_t table_b = round256(static_cast<size_t>(std::max<int64_t>(nb, 1)) * sizeof(PtrPair));
  const size_t ranges_b = round256(static_cast<size_t>(ns) * 8);
  const size_t total = table_b + static_cast<size_t>(std::max<int64_t>(nb, 0)) * stride +
                       4 * ranges_b + round256(static_cast<size_t>(ns) * 4) + round256(dscr) +
                       round256(static_cast<size_t>(ns * TD));
  KVQ_ASSIGN_OR_RETURN(uint8_t * base, ctx_->mirror_for(total));
  auto* table = reinterpret_cast<PtrPair*>(base);
  uint8_t* blocks = base + table_b;
  uint8_t* work = blocks + static_cast<size_t>(std::max<int64_t>(nb, 0)) * stride;
  auto* rk0 = reinterpret_cast<uint64_t*>(work);
  auto* rk1 = reinterpret_cast<uint64_t*>(work + ranges_b);
  auto* rv0 = reinterpret_cast<uint64_t*>(work + 2 * ranges_b);
  auto* rv1 = reinterpret_cast<uint64_t*>(work + 3 * ranges_b);
  auto* status = reinterpret_cast<int32_t*>(work + 4 * ranges_b);
  uint8_t* dscratch = work + 4 * ranges_b + round256(static_cast<size_t>(ns) * 4);
  uint8_t* sym = dscratch + round256(dscr);
  cg_mirror_table(table, blocks, nb, kb, stride, st);
  M.blocks = table;
  if (n == 0) return M;
  KVQ_CHECK(cg_tables_ != nullptr);
  const CgParts parts = cg_parts(B, *cg_tables_);
  // Offsets are taken from the lowest part address of the blocks decoded.
  const uint8_t* low = blocks_[static_cast<size_t>(first)]->p.k;
  for (int64_t i = first; i < nb; ++i)
    low = std::min({low, static_cast<const uint8_t*>(blocks_[static_cast<size_t>(i)]->p.k),
                    static_cast<const uint8_t*>(blocks_[static_cast<size_t>(i)]->p.v)});
  for (int64_t b0 = first; b0 < nb; b0 += per) {
    const int64_t c = std::min(per, nb - b0);
    cg_ranges(block_table_.data(), b0, c, S, parts, low, rk0, rk1, rv0, rv1, st);
    for (int part = 0; part < 2; ++part) {
      SymbolStreams ss{low, part == 0 ? rk0 : rv0, c * S, M.T, M.D, method_.cgc.bits};
      ss.ends = part == 0 ? rk1 : rv1;
      // The per-stream results are not waited for: these streams were written by cg_seal or
      // checked by the CPU backend's import before they were uploaded.
      KVQ_RETURN_IF_ERROR(decode_symbol_streams(ss, &cg_tables_->dec[part], false, sym, status,
                                                dscratch, dscr, st));
      cg_unpack(M, block_table_.data(), part, b0, c, method_.cgc, parts, sym, st);
    }
  }
  return M;
}

// ---- the backend ----

Result<std::vector<std::unique_ptr<LayerCache>>> make_cuda_layers(
    std::vector<std::unique_ptr<BlockCodec>> codecs, const ModelShape& shape,
    const CacheOptions& options) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    (void)cudaGetLastError();
    return unsupported(std::string("a cache on ") + device_name(options.device) +
                       " needs a CUDA device, and none is visible" +
                       (e != cudaSuccess ? std::string(" (") + cudaGetErrorString(e) + ")" : ""));
  }
  if (options.device.index < 0 || options.device.index >= count)
    return invalid_argument("no device " + device_name(options.device) + ": " +
                            std::to_string(count) + " CUDA device(s) visible");
  std::vector<GpuMethod> methods;
  for (size_t i = 0; i < codecs.size(); ++i) {
    const Spec& s = codecs[i]->spec();
    GpuMethod m;
    m.layer = static_cast<int>(i);
    const std::string name = s.method_name();
    if (name == "kivi" || name == "xquant") {
      m.kivi = true;
      m.k_bits = static_cast<int>(s.get_int("k_bits"));
      m.v_bits = static_cast<int>(s.get_int("v_bits"));
      m.group = s.get_int("group");
      const LayerShape& ls = shape.at(static_cast<int>(i));
      const int64_t T = codecs[i]->block_tokens(), D = ls.head_dim;
      const int64_t ng = n_channel_groups(D, m.group);
      // append_smem_bytes, and xq_reuse_smem_bytes for an XQuant reuse layer.
      const int64_t TP = T * ng * (std::min(m.group, D) + 1);  // xq_reuse_smem_bytes' padded rows
      const int64_t smem = std::max((2 * T * D + 4 * T + 2 * D + 2 * T * ng) * 4,
                                    name == "xquant" ? 10 * TP + 8 * std::max(D, T * ng) : 0);
      if (smem > 200 * 1024)
        return unsupported(
            name + " on the GPU seals a block in one thread block's shared memory: " +
            std::string("group ") + std::to_string(T) + " x head_dim " + std::to_string(D) +
            " needs " + std::to_string(smem) +
            " bytes (at most 204800); use a smaller group (layer " + std::to_string(i) + ")");
      if (name == "xquant") {
        m.anchor = codecs[i]->shared_codes_layer();
        m.xq = m.anchor < 0 ? 1 : 2;
        if (m.anchor < 0) m.anchor = static_cast<int>(i);
        m.r_bits = static_cast<int>(s.get_int("res_bits"));
        m.fit.lsq = s.get_enum(m.xq == 1 ? "fit" : "reuse_fit") == "lsq";
        m.fit.eta = static_cast<float>(s.get_float("eta"));
      }
    } else if (name == "zipcache") {
      const LayerShape& ls = shape.at(static_cast<int>(i));
      m.zip = true;
      m.zc = config_from(s, ls.head_dim);
      LayerDesc L;
      L.T = codecs[i]->block_tokens();
      L.D = ls.head_dim;
      const size_t smem = zip_seal_smem_bytes(L);
      if (ls.head_dim > 256 || smem > 200 * 1024)
        return unsupported(
            "zipcache on the GPU seals a block in one thread block's shared "
            "memory, with head_dim <= 256: group " +
            std::to_string(L.T) + " x head_dim " + std::to_string(L.D) + " needs " +
            std::to_string(smem) + " bytes (at most 204800); use a smaller group (layer " +
            std::to_string(i) + ")");
    } else if (name == "cachegen") {
      // Held when its codes are KIVI's (group == chunk, values=token) and its tables the
      // layer's shared prototypes (tables=shared, the coder the GPU encodes).
      const LayerShape& ls = shape.at(static_cast<int>(i));
      const int64_t T = codecs[i]->block_tokens(), D = ls.head_dim;
      const int bits = cachegen::layer_bits(static_cast<int>(i), shape.n_layers,
                                            static_cast<int>(s.get_int("bits")),
                                            static_cast<int>(s.get_int("layer_groups")));
      const std::string delta = s.get_enum("delta");
      m.cgc.bits = bits;
      m.cgc.delta = delta == "none"     ? 0
                    : delta == "token"  ? 1
                    : delta == "group"  ? 2
                    : delta == "anchor" ? 3
                                        : 4;
      LayerDesc L;  // the shared memory of the append's and the symbols' thread blocks
      L.T = T;
      L.D = static_cast<int>(D);
      L.ng = n_channel_groups(D, T);
      const int64_t smem =
          static_cast<int64_t>(std::max(append_smem_bytes(L, 1), cg_symbols_smem_bytes(L, m.cgc)));
      std::string why;
      if (s.get_int("group") != T)
        why = "group == chunk (group " + std::to_string(s.get_int("group")) + ", chunk " +
              std::to_string(T) + ")";
      else if (s.get_enum("values") != "token")
        why = "values=token";
      else if (s.get_enum("tables") != "shared")
        why = "tables=shared";
      else if (T > 4096 || smem > 200 * 1024)
        why =
            "chunk <= 4096 and a block that fits one thread block's shared memory (chunk x "
            "head_dim " +
            std::to_string(T) + " x " + std::to_string(D) + " needs " + std::to_string(smem) +
            " bytes, at most 204800)";
      if (!why.empty())
        return unsupported("cachegen on the GPU needs " + why + " (layer " + std::to_string(i) +
                           "); use the CPU backend for other settings");
      m.kivi = true;
      m.cg = true;
      m.k_bits = m.v_bits = bits;
      m.group = T;
      m.cgc.period = m.cgc.delta == 2 || m.cgc.delta == 3 ? T : 0;
    } else if (name != "fp16") {
      return unsupported(
          "method '" + name + "' has no CUDA codec yet: caches on " + device_name(options.device) +
          " hold fp16, kivi, xquant, zipcache and cachegen (use the CPU backend for " + name + ")");
    }
    methods.push_back(m);
  }
  auto ctx = std::make_shared<CudaContext>();
  ctx->device = options.device.index;
  ctx->stream = static_cast<cudaStream_t>(options.stream);
  ctx->pool = std::make_shared<DevicePool>(ctx->device);
  {
    DeviceGuard guard(ctx->device);
    ctx->sms = sm_count();
    if (std::any_of(methods.begin(), methods.end(), [](const GpuMethod& m) { return m.cg; })) {
      const std::vector<double>& t = cachegen::c_log2_c_table();
      KVQ_ASSIGN_OR_RETURN(uint8_t * p, ctx->pool->alloc(t.size() * sizeof(double)));
      ctx->clogc = reinterpret_cast<double*>(p);
      KVQ_CUDA_CHECK(
          cudaMemcpy(ctx->clogc, t.data(), t.size() * sizeof(double), cudaMemcpyHostToDevice));
      for (GpuMethod& m : methods) m.cgc.clogc = ctx->clogc;
    }
  }
  // XQuant groups, by anchor layer (the builder made every reuse layer's anchor an earlier
  // xquant anchor).
  std::vector<std::shared_ptr<XqGroup>> groups(codecs.size());
  std::vector<std::unique_ptr<LayerCache>> layers;
  for (size_t i = 0; i < codecs.size(); ++i) {
    std::shared_ptr<XqGroup> g;
    if (methods[i].xq) {
      auto& slot = groups[static_cast<size_t>(methods[i].anchor)];
      if (!slot) slot = std::make_shared<XqGroup>();
      g = slot;
    }
    layers.push_back(
        std::make_unique<CudaLayer>(std::move(codecs[i]), methods[i], ctx, options, g));
  }
  return layers;
}

}  // namespace kvq::cuda
