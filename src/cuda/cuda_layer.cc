#include "cuda/cuda_layer.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "cache/layer.h"
#include "cuda/cuda_util.h"
#include "methods/kivi_layout.h"

namespace kvq::cuda {

namespace {

DevTensor dev(const TensorView& v) {
  return DevTensor{const_cast<void*>(v.data), static_cast<int>(v.dtype), v.strides[0],
                   v.strides[1], v.strides[2], v.strides[3]};
}
DevTensor dev(const MutTensorView& v) { return dev(as_const(v)); }

constexpr unsigned long long kNoBadElement = ~0ull;

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
  KVQ_CUDA_CHECK(cudaMemcpyAsync(&raw,
                                 static_cast<const char*>(x.data) +
                                     x.offset(b, h, s, d) * static_cast<int64_t>(es),
                                 es, cudaMemcpyDeviceToHost, stream));
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
  if (dev_) ctx.pool->free(reinterpret_cast<uint8_t*>(dev_), static_cast<size_t>(cap_) * sizeof(PtrPair));
  dev_ = nullptr;
  cap_ = 0;
}

// ---- CudaLayer ----

CudaLayer::CudaLayer(std::unique_ptr<BlockCodec> codec, GpuMethod method,
                     std::shared_ptr<CudaContext> ctx, const CacheOptions& options)
    : codec_(std::move(codec)),
      method_(method),
      ctx_(std::move(ctx)),
      options_(options),
      shape_(codec_->shape()),
      ledger_(LedgerShape{codec_->block_tokens(), codec_->page_tokens(), codec_->residual()}) {
  if (shape_.n_q_heads == 0) shape_.n_q_heads = shape_.n_kv_heads;
  DeviceGuard guard(ctx_->device);
  auto f = ctx_->pool->alloc(3 * sizeof(unsigned long long));
  KVQ_CHECK(f.ok() && "out of GPU memory creating a layer");
  flags_ = reinterpret_cast<unsigned long long*>(*f);
}

CudaLayer::~CudaLayer() {
  DeviceGuard guard(ctx_->device);
  release_all();
  block_table_.release(*ctx_);
  page_table_.release(*ctx_);
  ctx_->pool->free(reinterpret_cast<uint8_t*>(flags_), 3 * sizeof(unsigned long long));
}

size_t CudaLayer::key_part_bytes(int64_t B) const {
  if (!method_.kivi) return 0;
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  return KiviLayout{g, method_.k_bits, method_.v_bits, method_.group}.key_part();
}
size_t CudaLayer::value_part_bytes(int64_t B) const {
  if (!method_.kivi) return 0;
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  return KiviLayout{g, method_.k_bits, method_.v_bits, method_.group}.value_part();
}
CacheBytes CudaLayer::block_bytes(int64_t B) const {
  const BlockGeometry g{B, shape_.n_kv_heads, ledger_.block_tokens(), shape_.head_dim};
  return KiviLayout{g, method_.k_bits, method_.v_bits, method_.group}.bytes();
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
  const size_t kb = key_part_bytes(ledger_.batch()), vb = value_part_bytes(ledger_.batch());
  for (size_t i = static_cast<size_t>(first); i < blocks_.size(); ++i) {
    ctx_->pool->free(blocks_[i].k, kb);
    ctx_->pool->free(blocks_[i].v, vb);
  }
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

Status CudaLayer::alloc_blocks(int64_t n, int64_t B, std::vector<PtrPair>& out) {
  out.clear();
  if (n == 0) return ok_status();
  const size_t kb = key_part_bytes(B), vb = value_part_bytes(B);
  KVQ_RETURN_IF_ERROR(ctx_->pool->reserve(
      static_cast<size_t>(n) * (DevicePool::rounded(kb) + DevicePool::rounded(vb))));
  for (int64_t i = 0; i < n; ++i) {
    auto k = ctx_->pool->alloc(kb);
    auto v = ctx_->pool->alloc(vb);
    KVQ_CHECK(k.ok() && v.ok());
    out.push_back(PtrPair{*k, *v});
  }
  return ok_status();
}

void CudaLayer::release_all() {
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
  KVQ_RETURN_IF_ERROR(codec_->precheck_append(B, n_new, ledger_.offset(), ledger_.n_blocks()));
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
  std::vector<PtrPair> new_pages, new_blocks;
  KVQ_RETURN_IF_ERROR(alloc_pages(np0, np1, pbytes, new_pages));
  if (Status s = alloc_blocks(n_sealed, B, new_blocks); !s.ok()) {
    for (auto& p : new_pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
    return s;
  }
  page_table_.set(*ctx_, np0, new_pages.data(), static_cast<int64_t>(new_pages.size()));
  block_table_.set(*ctx_, first_sealed, new_blocks.data(), n_sealed);

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
  cuda::append(L, a, st);
  unsigned long long report[3];
  KVQ_CUDA_CHECK(cudaMemcpyAsync(report, flags_, sizeof report, cudaMemcpyDeviceToHost, st));
  KVQ_CUDA_CHECK(cudaStreamSynchronize(st));
  Status bad = ok_status();
  if (report[2] != kNoBadElement) bad = bad_element(*q, "q", report[2], st);
  else if (report[0] != kNoBadElement) bad = bad_element(k, "k", report[0], st);
  else if (report[1] != kNoBadElement) bad = bad_element(v, "v", report[1], st);
  if (!bad.ok()) {
    for (auto& p : new_pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
    const size_t kb = key_part_bytes(B), vb = value_part_bytes(B);
    for (auto& p : new_blocks) ctx_->pool->free(p.k, kb), ctx_->pool->free(p.v, vb);
    return bad;
  }

  // Commit. The exact values the previous append kept go first (the CPU's drop_retired), then
  // the pages of blocks sealed now that no query of this append reads exact.
  free_pages(ledger_.exact_begin() / P, ledger_.sealed_tokens() / P);
  if (static_cast<int64_t>(pages_.size()) < np1) pages_.resize(static_cast<size_t>(np1));
  for (int64_t i = np0; i < np1; ++i) pages_[static_cast<size_t>(i)] = new_pages[static_cast<size_t>(i - np0)];
  blocks_.insert(blocks_.end(), new_blocks.begin(), new_blocks.end());
  window_dtype_ = wdt;
  page_bytes_ = pbytes;
  const int64_t old_sealed_page = ledger_.sealed_tokens() / P;
  ledger_ = plan;
  free_pages(old_sealed_page, ledger_.exact_begin() / P);
  codec_->on_append_done();
  return ok_status();
}

Status CudaLayer::read(int64_t t0, int64_t n, const MutTensorView& k_out,
                       const MutTensorView& v_out) const {
  KVQ_RETURN_IF_ERROR(
      validate_read(shape_, ledger_, options_.device, false, t0, n, k_out, v_out));
  DeviceGuard guard(ctx_->device);
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

Status CudaLayer::attend(const TensorView& q, float scale, const MutTensorView& out,
                         int kv_head_begin, int kv_head_end, Workspace*) const {
  KVQ_RETURN_IF_ERROR(validate_attend(shape_, ledger_, options_.device, q, scale, out,
                                      kv_head_begin, kv_head_end));
  if (kv_head_end == kv_head_begin) return ok_status();
  DeviceGuard guard(ctx_->device);
  const LayerDesc L = desc(ledger_.batch(), window_dtype_);
  AttendArgs a;
  a.q = dev(q);
  a.out = dev(out);
  a.scale_log2 = static_cast<float>(static_cast<double>(scale) * 1.4426950408889634);
  a.Tq = static_cast<int>(q.shape[2]);
  a.h0 = kv_head_begin;
  a.nh = kv_head_end - kv_head_begin;
  const int64_t rows = static_cast<int64_t>(L.B) * a.nh * L.group * a.Tq;
  const int64_t offset = ledger_.offset();
  const bool fast = fast_supported(L, a.Tq);
  if (fast) {
    // Split-K: enough warps to fill the device a few times over, whole 32-token tiles each.
    const int64_t sealed = ledger_.sealed_tokens();
    const int64_t tiles = sealed / 32 + (offset - sealed + 31) / 32;
    const int64_t per = static_cast<int64_t>(L.B) * a.nh;
    // Split-K: the split count w whose warps (per * w) run in the fewest whole waves of the
    // device's resident warps per unit of work: time ~ ceil(per * w / R) / w.
    int64_t R = resident_warps_.load(std::memory_order_relaxed);
    if (R == 0) {
      R = fast_resident_warps(L);
      resident_warps_.store(R, std::memory_order_relaxed);
    }
    int64_t want = 1;
    double best = 1e300;
    for (int64_t w = 1; w <= std::min<int64_t>(tiles, 2 * R / per + 2); ++w) {
      const double cost = static_cast<double>((per * w + R - 1) / R) / static_cast<double>(w);
      if (cost < best * (1 - 1e-9)) best = cost, want = w;
    }
    a.split_tiles = (tiles + want - 1) / want;
    a.n_splits = static_cast<int>((tiles + a.split_tiles - 1) / a.split_tiles);
  } else {
    const int64_t want =
        std::clamp<int64_t>((ctx_->sms * 4 + rows - 1) / rows, 1, (offset + 127) / 128);
    a.split_len = (offset + want - 1) / want;
    a.n_splits = static_cast<int>((offset + a.split_len - 1) / a.split_len);
  }
  const size_t need = static_cast<size_t>(rows) * a.n_splits * (shape_.head_dim + 2) * 4;
  std::lock_guard<std::mutex> lock(ctx_->scratch_mu);
  KVQ_ASSIGN_OR_RETURN(uint8_t * scratch, ctx_->scratch_for(need));
  a.part_acc = reinterpret_cast<float*>(scratch);
  a.part_ml = a.part_acc + rows * a.n_splits * shape_.head_dim;
  if (fast)
    attend_fast(L, a, ctx_->stream);
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
    free_pages(ledger_.exact_begin() / P, sealed_page);  // retired pages
    page_table_.set(*ctx_, p0, fresh.data(), static_cast<int64_t>(fresh.size()));
    if (plan.reopen) reopen(desc(B, window_dtype_), kb, plan.window_tokens, st);
    free_pages(sealed_page, end_page);
    free_blocks_from(kb);
    if (static_cast<int64_t>(pages_.size()) < p1) pages_.resize(static_cast<size_t>(p1));
    for (int64_t i = p0; i < p1; ++i) pages_[static_cast<size_t>(i)] = fresh[static_cast<size_t>(i - p0)];
  }
  ledger_.apply_trim(plan);
  codec_->on_trim(plan.new_offset, plan.keep_blocks);
  return ok_status();
}

void CudaLayer::reset() {
  DeviceGuard guard(ctx_->device);
  release_all();
  ledger_.reset();
  window_dtype_ = DType::kF16;
  page_bytes_ = 0;
  codec_->on_reset();
}

std::unique_ptr<LayerCache> CudaLayer::clone(CloneMemo& memo) const {
  DeviceGuard guard(ctx_->device);
  auto c = std::make_unique<CudaLayer>(codec_->clone(memo), method_, ctx_, options_);
  c->ledger_ = ledger_;
  c->ledger_.forget_last_append();  // the copy keeps no retired exact values
  c->window_dtype_ = window_dtype_;
  c->page_bytes_ = page_bytes_;
  const int64_t B = ledger_.batch(), P = ledger_.page_tokens();
  const int64_t p0 = ledger_.sealed_tokens() / P, p1 = (ledger_.offset() + P - 1) / P;
  std::vector<PtrPair> pages, blocks;
  const Status s1 = c->page_table_.reserve(*ctx_, p1);
  const Status s2 = c->block_table_.reserve(*ctx_, ledger_.n_blocks());
  const Status s3 = c->alloc_pages(p0, p1, page_bytes_, pages);
  const Status s4 = c->alloc_blocks(ledger_.n_blocks(), B, blocks);
  if (!s1.ok() || !s2.ok() || !s3.ok() || !s4.ok()) {
    std::fprintf(stderr, "kvq: out of GPU memory cloning a cache (%s)\n",
                 (!s1.ok() ? s1 : !s2.ok() ? s2 : !s3.ok() ? s3 : s4).to_string().c_str());
    std::abort();
  }
  const size_t kb = key_part_bytes(B), vb = value_part_bytes(B);
  for (size_t i = 0; i < blocks.size(); ++i) {
    KVQ_CUDA_CHECK(cudaMemcpyAsync(blocks[i].k, blocks_[i].k, kb, cudaMemcpyDeviceToDevice, ctx_->stream));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(blocks[i].v, blocks_[i].v, vb, cudaMemcpyDeviceToDevice, ctx_->stream));
  }
  for (int64_t i = p0; i < p1; ++i) {
    const PtrPair& src = pages_[static_cast<size_t>(i)];
    const PtrPair& dst = pages[static_cast<size_t>(i - p0)];
    KVQ_CUDA_CHECK(cudaMemcpyAsync(dst.k, src.k, page_bytes_, cudaMemcpyDeviceToDevice, ctx_->stream));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(dst.v, src.v, page_bytes_, cudaMemcpyDeviceToDevice, ctx_->stream));
  }
  c->pages_.assign(static_cast<size_t>(p1), PtrPair{});
  for (int64_t i = p0; i < p1; ++i) c->pages_[static_cast<size_t>(i)] = pages[static_cast<size_t>(i - p0)];
  c->blocks_ = blocks;
  c->page_table_.set(*ctx_, p0, pages.data(), static_cast<int64_t>(pages.size()));
  c->block_table_.set(*ctx_, 0, blocks.data(), static_cast<int64_t>(blocks.size()));
  return c;
}

CacheBytes CudaLayer::bytes() const {
  return ledger_.bytes(page_bytes_, codec_->extra_bytes(), shape_.n_kv_heads, shape_.head_dim);
}

uint64_t CudaLayer::resident_bytes() const {
  // Walk what is held: the blocks' parts and the window's pages (not the retired ones).
  uint64_t r = blocks_.size() * (key_part_bytes(ledger_.batch()) + value_part_bytes(ledger_.batch()));
  const int64_t P = ledger_.page_tokens();
  for (size_t i = static_cast<size_t>(ledger_.sealed_tokens() / P); i < pages_.size(); ++i)
    if (pages_[i].k) r += 2 * page_bytes_;
  return r + codec_->extra_resident_bytes();
}

uint64_t CudaLayer::workspace_bytes() const {
  const int64_t P = ledger_.page_tokens();
  uint64_t r = 0;
  for (int64_t i = ledger_.exact_begin() / P; i < ledger_.sealed_tokens() / P; ++i)
    if (i < static_cast<int64_t>(pages_.size()) && pages_[static_cast<size_t>(i)].k) r += 2 * page_bytes_;
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
  const int64_t T = ledger_.block_tokens(), B = ledger_.batch();
  std::vector<uint8_t> kh, vh, buf;
  for (int64_t i = first_block; i < n_blocks(); ++i) {
    KVQ_RETURN_IF_ERROR(copy_to_host(blocks_[static_cast<size_t>(i)].k, key_part_bytes(B), kh));
    KVQ_RETURN_IF_ERROR(copy_to_host(blocks_[static_cast<size_t>(i)].v, value_part_bytes(B), vh));
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
  const int64_t P = ledger_.page_tokens(), t0 = ledger_.sealed_tokens(), n = ledger_.window_tokens();
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
  codec_->export_state(state);
  return sink.put(ChunkRef{ChunkKind::kState, 0, ledger_.offset(), state.data(), state.size()});
}

Status CudaLayer::import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                                DType wdtype) {
  // Everything about the chunks is validated by the CPU backend's import into a scratch layer
  // (the one set of import rules); the device copy is made from the same chunks after.
  {
    CloneMemo memo;
    CacheOptions cpu;
    CpuLayer scratch(codec_->clone(memo), cpu);
    KVQ_RETURN_IF_ERROR(scratch.import_chunks(chunks, batch, offset, wdtype));
  }
  KVQ_RETURN_IF_ERROR(codec_->import_state(chunks.back().data, chunks.back().size, batch, offset,
                                           false));
  DeviceGuard guard(ctx_->device);
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = ledger_.page_tokens(),
                T = ledger_.block_tokens();
  const int64_t nb = static_cast<int64_t>((chunks.size() - 3) / 2), n = offset - nb * T;
  const int64_t p0 = nb * T / P, p1 = p0 + (n + P - 1) / P;
  const size_t pbytes = page_bytes_at(batch);
  KVQ_RETURN_IF_ERROR(page_table_.reserve(*ctx_, p1));
  KVQ_RETURN_IF_ERROR(block_table_.reserve(*ctx_, nb));
  std::vector<PtrPair> pages, blocks;
  KVQ_RETURN_IF_ERROR(alloc_pages(p0, p1, pbytes, pages));
  if (Status s = alloc_blocks(nb, batch, blocks); !s.ok()) {
    for (auto& p : pages) ctx_->pool->free(p.k, pbytes), ctx_->pool->free(p.v, pbytes);
    return s;
  }
  cudaStream_t st = ctx_->stream;
  for (int64_t i = 0; i < nb; ++i) {
    // For the methods this backend holds, a serialized part is the stored part.
    const ChunkRef& kc = chunks[static_cast<size_t>(2 * i)];
    const ChunkRef& vc = chunks[static_cast<size_t>(2 * i + 1)];
    KVQ_CHECK(kc.size == key_part_bytes(batch) && vc.size == value_part_bytes(batch));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(blocks[static_cast<size_t>(i)].k, kc.data, kc.size,
                                   cudaMemcpyHostToDevice, st));
    KVQ_CUDA_CHECK(cudaMemcpyAsync(blocks[static_cast<size_t>(i)].v, vc.data, vc.size,
                                   cudaMemcpyHostToDevice, st));
  }
  // The window chunks [B, H, n, D] into pages [B, H, P, D] (unused page rows zero).
  std::vector<uint8_t> staging(pbytes * static_cast<size_t>(std::max<int64_t>(p1 - p0, 0)) * 2);
  std::memset(staging.data(), 0, staging.size());
  for (int keys = 1; keys >= 0; --keys) {
    const auto* src = reinterpret_cast<const uint16_t*>(chunks[static_cast<size_t>(2 * nb + (keys ? 0 : 1))].data);
    for (int64_t t = 0; t < n; ++t) {
      auto* page = reinterpret_cast<uint16_t*>(
          staging.data() + (static_cast<size_t>(keys ? 0 : p1 - p0) + static_cast<size_t>(t / P)) * pbytes);
      for (int64_t bh = 0; bh < batch * H; ++bh)
        std::memcpy(page + (bh * P + t % P) * D, src + (bh * n + t) * D, static_cast<size_t>(D) * 2);
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
  for (int64_t i = p0; i < p1; ++i) pages_[static_cast<size_t>(i)] = pages[static_cast<size_t>(i - p0)];
  blocks_ = blocks;
  page_table_.set(*ctx_, p0, pages.data(), static_cast<int64_t>(pages.size()));
  block_table_.set(*ctx_, 0, blocks.data(), nb);
  ledger_.assign(batch, offset, std::vector<CacheBytes>(static_cast<size_t>(nb), block_bytes(batch)));
  window_dtype_ = wdtype;
  page_bytes_ = pbytes;
  KVQ_CHECK(codec_->import_state(chunks.back().data, chunks.back().size, batch, offset, true).ok());
  return ok_status();
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
    if (s.method_name() == "kivi") {
      m.kivi = true;
      m.k_bits = static_cast<int>(s.get_int("k_bits"));
      m.v_bits = static_cast<int>(s.get_int("v_bits"));
      m.group = s.get_int("group");
      const LayerShape& ls = shape.at(static_cast<int>(i));
      const int64_t T = codecs[i]->block_tokens(), D = ls.head_dim;
      const int64_t ng = n_channel_groups(D, m.group);
      const int64_t smem = (2 * T * D + 4 * T + 2 * D + 2 * T * ng) * 4;  // append_smem_bytes
      if (smem > 200 * 1024)
        return unsupported("kivi on the GPU seals a block in one thread block's shared memory: " +
                           std::string("group ") + std::to_string(T) + " x head_dim " +
                           std::to_string(D) + " needs " + std::to_string(smem) +
                           " bytes (at most 204800); use a smaller group (layer " +
                           std::to_string(i) + ")");
    } else if (s.method_name() != "fp16") {
      return unsupported("method '" + s.method_name() +
                         "' has no CUDA codec yet: caches on " + device_name(options.device) +
                         " hold fp16 and kivi (use the CPU backend for " + s.method_name() + ")");
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
  }
  std::vector<std::unique_ptr<LayerCache>> layers;
  for (size_t i = 0; i < codecs.size(); ++i)
    layers.push_back(std::make_unique<CudaLayer>(std::move(codecs[i]), methods[i], ctx, options));
  return layers;
}

}  // namespace kvq::cuda
