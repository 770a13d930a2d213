#include "cache/layer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "numerics/attention.h"
#include "numerics/kernels.h"
#include "numerics/q8_rows.h"

namespace kvq {

namespace {

// The slow path names the first bad element.
Status describe_bad_element(const TensorView& v, const char* what) {
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = 0; h < v.shape[1]; ++h)
      for (int64_t s = 0; s < v.shape[2]; ++s)
        for (int64_t d = 0; d < v.shape[3]; ++d) {
          const float x = v.load(b, h, s, d);
          const std::string at = " at [" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                                 std::to_string(s) + ", " + std::to_string(d) + "]";
          if (!std::isfinite(x))
            return non_finite(std::string(what) + " has " + (std::isnan(x) ? "NaN" : "Inf") + at);
          if (std::fabs(x) > kF16Max)
            return out_of_range(std::string(what) + " value " + std::to_string(x) + at +
                                " exceeds the fp16 range (|x| <= 65504) of kvq's stored window, "
                                "scales and zero points");
        }
  return ok_status();
}

// True when every element is finite with |x| <= limit (NaN fails the comparison). One
// branch-free pass per row, in pieces of a stack buffer, so the common case costs a fraction of
// a memcpy and allocates nothing.
bool all_within(const TensorView& v, float limit) {
  constexpr int64_t kPiece = 256;
  float row[kPiece];
  const int64_t D = v.shape[3];
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = 0; h < v.shape[1]; ++h)
      for (int64_t s = 0; s < v.shape[2]; ++s) {
        const int64_t base = v.offset(b, h, s, 0);
        for (int64_t d0 = 0; d0 < D; d0 += kPiece) {
          const int64_t n = std::min(kPiece, D - d0);
          const float* x;
          if (v.dtype == DType::kF32 && v.d_contiguous()) {
            x = static_cast<const float*>(v.data) + base + d0;
          } else {
            if (v.d_contiguous() && v.dtype == DType::kF16)
              convert_f16_to_f32(static_cast<const uint16_t*>(v.data) + base + d0, row,
                                 static_cast<size_t>(n));
            else
              for (int64_t d = 0; d < n; ++d)
                row[d] = load_as_f32(v.data, v.dtype, base + (d0 + d) * v.strides[3]);
            x = row;
          }
          int bad = 0;  // an integer sum of comparisons vectorises; NaN compares false
          for (int64_t d = 0; d < n; ++d) bad += !(std::fabs(x[d]) <= limit);
          if (bad) return false;
        }
      }
  return true;
}

Status check_range(const TensorView& v, const char* what) {
  return all_within(v, kF16Max) ? ok_status() : describe_bad_element(v, what);
}

Status check_finite_fast(const TensorView& v, const char* what) {
  return all_within(v, std::numeric_limits<float>::max()) ? ok_status() : check_finite(v, what);
}

// Key tiles of attention are at fixed absolute positions [i A, (i + 1) A), so every query sees
// the same tiles whatever the chunking. Blocks of 32 to 4096 tokens are one tile each; longer
// ones (fp16's "never sealed") are cut into tiles of their largest power-of-two divisor up to
// 256; shorter ones (one-token blocks of llama.cpp's formats) are grouped, a whole number of
// blocks per tile of about 64 tokens.
int64_t attention_tile(int64_t T) {
  if (T < 32) return T * ((64 + T - 1) / T);
  if (T <= 4096) return T;
  int64_t a = 1;
  while (a < 256 && T % (2 * a) == 0) a *= 2;
  return a;
}

// A q8 window row of x as an fp16 window would hold it: x rounded to fp16 (into tmp, D floats),
// then quantized, so that f32, f16 and bf16 inputs of the same fp16 values store the same row.
void put_q8_row(const float* x, int64_t D, uint8_t* row, float* tmp) {
  for (int64_t d = 0; d < D; ++d) tmp[d] = f16_to_f32(f32_to_f16(x[d]));
  quantize_q8_row(tmp, D, row);
}

void convert_row(DType window, const uint16_t* src, float* out, int64_t n) {
  if (window == DType::kBF16)
    convert_bf16_to_f32(src, out, static_cast<size_t>(n));
  else
    convert_f16_to_f32(src, out, static_cast<size_t>(n));
}

}  // namespace

Status validate_append_shapes(const LayerShape& shape, int64_t batch, const TensorView& k,
                              const TensorView& v, const TensorView* q) {
  KVQ_RETURN_IF_ERROR(validate_view(k, "k"));
  KVQ_RETURN_IF_ERROR(validate_view(v, "v"));
  if (k.shape != v.shape)
    return shape_mismatch("k " + describe(k) + " and v " + describe(v) + " disagree");
  if (k.shape[0] < 1 || k.shape[2] < 1)
    return shape_mismatch("append needs B >= 1 and S_new >= 1, got k " + describe(k));
  if (k.shape[1] != shape.n_kv_heads || k.shape[3] != shape.head_dim)
    return shape_mismatch("k " + describe(k) + " does not match the layer's [B, " +
                          std::to_string(shape.n_kv_heads) + ", S, " +
                          std::to_string(shape.head_dim) + "]");
  if (batch > 0 && k.shape[0] != batch)
    return shape_mismatch("batch size " + std::to_string(k.shape[0]) +
                          " differs from the cache's " + std::to_string(batch) +
                          " (reset the cache to change it)");
  if (q) {
    KVQ_RETURN_IF_ERROR(validate_view(*q, "q"));
    const int hq = shape.n_q_heads ? shape.n_q_heads : shape.n_kv_heads;
    if (q->shape[0] != k.shape[0] || q->shape[1] != hq || q->shape[2] != k.shape[2] ||
        q->shape[3] != k.shape[3])
      return shape_mismatch("q " + describe(*q) + " does not match [B, " + std::to_string(hq) +
                            ", S_new, D] for k " + describe(k));
  }
  return ok_status();
}

Status validate_append(const LayerShape& shape, int64_t batch, const TensorView& k,
                       const TensorView& v, const TensorView* q) {
  KVQ_RETURN_IF_ERROR(validate_append_shapes(shape, batch, k, v, q));
  if (q) KVQ_RETURN_IF_ERROR(check_finite_fast(*q, "q"));
  KVQ_RETURN_IF_ERROR(check_range(k, "k"));
  KVQ_RETURN_IF_ERROR(check_range(v, "v"));
  return ok_status();
}

CpuLayer::CpuLayer(std::unique_ptr<BlockCodec> codec, const CacheOptions& options)
    : codec_(std::move(codec)),
      options_(options),
      shape_(codec_->shape()),
      ledger_(LedgerShape{codec_->block_tokens(), codec_->page_tokens(), codec_->residual()}),
      format_(codec_->window_format()),
      row_bytes_(window_row_bytes(format_, shape_.head_dim)) {
  if (shape_.n_q_heads == 0) shape_.n_q_heads = shape_.n_kv_heads;
  if (!options_.workspaces) options_.workspaces = std::make_shared<WorkspacePool>();
}

CpuLayer::CpuLayer(const CpuLayer& o, CloneMemo& memo)
    : LayerCache(),
      LayerReader(),
      codec_(o.codec_->clone(memo)),
      options_(o.options_),
      shape_(o.shape_),
      ledger_(o.ledger_),
      store_(o.store_.clone(memo)),
      window_dtype_(o.window_dtype_),
      format_(o.format_),
      row_bytes_(o.row_bytes_) {
  ledger_.forget_last_append();
}

std::unique_ptr<LayerCache> CpuLayer::clone(CloneMemo& memo) const {
  return std::unique_ptr<LayerCache>(new CpuLayer(*this, memo));
}

const uint8_t* CpuLayer::exact_row_bytes(bool keys, int64_t b, int64_t h, int64_t pos) const {
  const int64_t H = shape_.n_kv_heads, P = ledger_.page_tokens();
  const int64_t sealed = ledger_.sealed_tokens();
  if (pos >= sealed) {
    const int64_t w = pos - sealed;
    return store_.page(keys, w / P) + static_cast<size_t>((b * H + h) * P + w % P) * row_bytes_;
  }
  const int64_t w = pos - ledger_.exact_begin();  // a retired page (the last append's)
  KVQ_CHECK(w >= 0);
  return store_.retired(keys, w / P) + static_cast<size_t>((b * H + h) * P + w % P) * row_bytes_;
}

void CpuLayer::exact_row(bool keys, int64_t b, int64_t h, int64_t pos, float* out) const {
  const uint8_t* row = exact_row_bytes(keys, b, h, pos);
  if (format_ == WindowFormat::kQ8)
    dequantize_q8_row(row, shape_.head_dim, out);
  else
    convert_row(window_dtype_, reinterpret_cast<const uint16_t*>(row), out, shape_.head_dim);
}

void CpuLayer::put_row(const float* x, uint8_t* row, float* scratch) const {
  const int64_t D = shape_.head_dim;
  if (format_ == WindowFormat::kQ8) {
    put_q8_row(x, D, row, scratch);
    return;
  }
  auto* r16 = reinterpret_cast<uint16_t*>(row);
  for (int64_t d = 0; d < D; ++d)
    r16[d] = window_dtype_ == DType::kBF16 ? f32_to_bf16(x[d]) : f32_to_f16(x[d]);
}

void CpuLayer::store_window_token(const TensorView& src, int64_t s, int64_t pos, bool keys,
                                  float* scratch) {
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = ledger_.page_tokens();
  const int64_t w = pos - ledger_.sealed_tokens();
  if (w % P == 0 && keys) store_.open_page();
  uint8_t* page = store_.page(keys, w / P);
  const bool bf16 = window_dtype_ == DType::kBF16;
  for (int64_t b = 0; b < ledger_.batch(); ++b)
    for (int64_t h = 0; h < H; ++h) {
      uint8_t* bytes = page + static_cast<size_t>((b * H + h) * P + w % P) * row_bytes_;
      const int64_t base = src.offset(b, h, s, 0);
      if (format_ == WindowFormat::kQ8) {
        if (src.dtype == DType::kF32 && src.d_contiguous()) {
          put_q8_row(static_cast<const float*>(src.data) + base, D, bytes, scratch);
          continue;
        }
        for (int64_t d = 0; d < D; ++d)
          scratch[D + d] = load_as_f32(src.data, src.dtype, base + d * src.strides[3]);
        put_q8_row(scratch + D, D, bytes, scratch);
        continue;
      }
      auto* row = reinterpret_cast<uint16_t*>(bytes);
      if (src.dtype == window_dtype_ && src.d_contiguous()) {
        std::memcpy(row, static_cast<const uint16_t*>(src.data) + base, static_cast<size_t>(D) * 2);
      } else if (src.dtype == DType::kF32 && src.d_contiguous()) {
        const float* x = static_cast<const float*>(src.data) + base;
        if (bf16)
          for (int64_t d = 0; d < D; ++d) row[d] = f32_to_bf16(x[d]);
        else
          convert_f32_to_f16(x, row, static_cast<size_t>(D));
      } else {
        for (int64_t d = 0; d < D; ++d) {
          const float x = load_as_f32(src.data, src.dtype, base + d * src.strides[3]);
          row[d] = bf16 ? f32_to_bf16(x) : f32_to_f16(x);
        }
      }
    }
}

void CpuLayer::due_block_f32(float* k, float* v) const {
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, T = ledger_.block_tokens();
  const int64_t t0 = ledger_.sealed_tokens();
  for (int64_t b = 0; b < ledger_.batch(); ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        exact_row(true, b, h, t0 + t, k + ((b * H + h) * T + t) * D);
        exact_row(false, b, h, t0 + t, v + ((b * H + h) * T + t) * D);
      }
}

Status CpuLayer::append(const TensorView& k, const TensorView& v, const TensorView* q) {
  KVQ_RETURN_IF_ERROR(require_device(k, options_.device, "k"));
  KVQ_RETURN_IF_ERROR(require_device(v, options_.device, "v"));
  if (q) KVQ_RETURN_IF_ERROR(require_device(*q, options_.device, "q"));
  KVQ_RETURN_IF_ERROR(validate_append(shape_, ledger_.batch(), k, v, q));
  const int64_t n_new = k.shape[2];
  if (ledger_.offset() + n_new > Ledger::kMaxTokens)
    return limit_exceeded("a layer cache holds at most " + std::to_string(Ledger::kMaxTokens) +
                          " tokens; appending " + std::to_string(n_new) + " to " +
                          std::to_string(ledger_.offset()) + " would exceed it");
  KVQ_RETURN_IF_ERROR(
      codec_->precheck_append(k.shape[0], n_new, ledger_.offset(), ledger_.n_blocks()));

  // Validated: from here on the append cannot fail.
  WorkspacePool::Lease lease(*options_.workspaces);
  Workspace& ws = lease.get();
  Workspace::Frame frame(ws);
  store_.drop_retired();
  if (ledger_.batch() == 0) {
    // q8 rows have fp16 scales whatever the input; 16-bit rows keep bf16 input as bf16.
    window_dtype_ =
        k.dtype == DType::kBF16 && format_ == WindowFormat::k16Bit ? DType::kBF16 : DType::kF16;
    store_.set_page_bytes(
        static_cast<size_t>(k.shape[0] * shape_.n_kv_heads * ledger_.page_tokens()) * row_bytes_);
  }
  float* scratch = ws.alloc<float>(static_cast<size_t>(2 * shape_.head_dim));
  ledger_.begin_append(k.shape[0], n_new);
  const int64_t end = ledger_.offset() + n_new;
  const int64_t T = ledger_.block_tokens(), P = ledger_.page_tokens();
  const BlockGeometry g = geometry();
  for (int64_t done = 0; done < n_new;) {
    const int64_t n = ledger_.next_run(n_new - done);
    const int64_t pos0 = ledger_.offset();
    for (int64_t s = done; s < done + n; ++s) {
      store_window_token(k, s, pos0 + (s - done), true, scratch);
      store_window_token(v, s, pos0 + (s - done), false, scratch);
    }
    ledger_.advance(n);
    TokenRun run{pos0, n, end, nullptr};
    TensorView qs;
    if (q) {
      qs = q->slice_tokens(done, n);
      run.q = &qs;
    }
    codec_->on_tokens(run, *this, ws);
    done += n;
    while (ledger_.seal_due()) {
      Workspace::Frame block_frame(ws);
      float* kb = ws.alloc<float>(static_cast<size_t>(g.elems()));
      float* vb = ws.alloc<float>(static_cast<size_t>(g.elems()));
      due_block_f32(kb, vb);
      SealedBlock sb = codec_->encode(ledger_.n_blocks(), g, kb, vb, ws);
      KVQ_CHECK(sb.bytes.total() == sb.data->keys.size() + sb.data->values.size());
      const bool keep = ledger_.keep_exact_of_due_block();
      store_.push_block(std::move(sb.data));
      ledger_.record_block(sb.bytes, keep);
      store_.close_front_pages(T / P, keep);
    }
  }
  codec_->on_append_done();
  return ok_status();
}

void CpuLayer::gather(bool keys, int64_t b, int64_t h, int64_t t0, int64_t n, float* out,
                      Workspace& ws) const {
  const int64_t D = shape_.head_dim, T = ledger_.block_tokens();
  const BlockGeometry g = geometry();
  int64_t t = t0;
  const int64_t end = t0 + n;
  while (t < end && t < ledger_.sealed_tokens()) {
    const int64_t bi = t / T;
    const int64_t lo = t - bi * T, hi = std::min(end - bi * T, T);
    const BlockData& blk = store_.block(bi);
    if (lo == 0 && hi == T) {  // the whole block: no staging copy
      codec_->decode(blk, bi, keys, b, h, g, out + (t - t0) * D, ws);
    } else {
      Workspace::Frame frame(ws);
      float* scratch = ws.alloc<float>(static_cast<size_t>(T * D));
      codec_->decode(blk, bi, keys, b, h, g, scratch, ws);
      std::memcpy(out + (t - t0) * D, scratch + lo * D, static_cast<size_t>((hi - lo) * D) * 4);
    }
    t = bi * T + hi;
  }
  for (; t < end; ++t) exact_row(keys, b, h, t, out + (t - t0) * D);
}

Status CpuLayer::read_into(bool exact, int64_t t0, int64_t n, const MutTensorView& k_out,
                           const MutTensorView& v_out) const {
  KVQ_RETURN_IF_ERROR(
      validate_read(shape_, ledger_, options_.device, exact, t0, n, k_out, v_out));
  const int64_t D = shape_.head_dim;
  WorkspacePool::Lease lease(*options_.workspaces);
  Workspace& ws = lease.get();
  for (int keys = 1; keys >= 0; --keys) {
    const MutTensorView& o = keys ? k_out : v_out;
    const bool direct = o.dtype == DType::kF32 && o.d_contiguous() && o.strides[2] == D;
    for (int64_t b = 0; b < ledger_.batch(); ++b)
      for (int64_t h = 0; h < shape_.n_kv_heads; ++h) {
        Workspace::Frame frame(ws);
        float* rows = direct ? static_cast<float*>(o.data) + o.offset(b, h, 0, 0)
                             : ws.alloc<float>(static_cast<size_t>(n * D));
        if (exact) {
          for (int64_t t = 0; t < n; ++t) exact_row(keys != 0, b, h, t0 + t, rows + t * D);
        } else {
          gather(keys != 0, b, h, t0, n, rows, ws);
        }
        if (direct) continue;
        const TensorView src = TensorView::bhsd(rows, DType::kF32, 1, 1, n, D);
        MutTensorView dst = o;
        dst.data = static_cast<char*>(o.data) +
                   o.offset(b, h, 0, 0) * static_cast<int64_t>(dtype_size(o.dtype));
        dst.shape = {1, 1, n, D};
        KVQ_RETURN_IF_ERROR(copy_view(src, dst));
      }
  }
  return ok_status();
}

Status CpuLayer::read(int64_t t0, int64_t n, const MutTensorView& k_out,
                      const MutTensorView& v_out) const {
  return read_into(false, t0, n, k_out, v_out);
}

Status CpuLayer::read_exact(int64_t t0, int64_t n, const MutTensorView& k_out,
                            const MutTensorView& v_out) const {
  return read_into(true, t0, n, k_out, v_out);
}

Status validate_attend(const LayerShape& shape, const Ledger& ledger, const Device& device,
                       const TensorView& q, float scale, const MutTensorView& out,
                       int kv_head_begin, int& kv_head_end) {
  KVQ_RETURN_IF_ERROR(validate_view(q, "q"));
  KVQ_RETURN_IF_ERROR(validate_view(as_const(out), "out"));
  KVQ_RETURN_IF_ERROR(require_device(q, device, "q"));
  KVQ_RETURN_IF_ERROR(require_device(as_const(out), device, "out"));
  const int64_t Hq = shape.n_q_heads ? shape.n_q_heads : shape.n_kv_heads, H = shape.n_kv_heads,
                D = shape.head_dim;
  const int64_t Tq = q.shape[2], offset = ledger.offset();
  if (q.shape[0] != ledger.batch() || q.shape[1] != Hq || q.shape[3] != D || Tq < 1 || Tq > offset)
    return shape_mismatch("attend: q " + describe(q) + " must be [" +
                          std::to_string(ledger.batch()) + ", " + std::to_string(Hq) + ", T, " +
                          std::to_string(D) + "] with 1 <= T <= offset (" + std::to_string(offset) +
                          ")");
  if (out.shape != q.shape || out.dtype != DType::kF32)
    return shape_mismatch("attend: out must be f32 with q's shape " + describe(q));
  if (kv_head_end < 0) kv_head_end = static_cast<int>(H);
  if (kv_head_begin < 0 || kv_head_begin > kv_head_end || kv_head_end > H)
    return out_of_range("attend: KV head range [" + std::to_string(kv_head_begin) + ", " +
                        std::to_string(kv_head_end) + ") outside [0, " + std::to_string(H) + ")");
  if (!std::isfinite(scale)) return invalid_argument("attend: scale must be finite");
  // The earliest query must be one whose view the cache can still give (see cache.h).
  const int64_t p0 = offset - Tq;
  if (p0 < offset - ledger.last_append() && ledger.sealed_tokens_at(p0 + 1) < ledger.exact_begin())
    return invalid_argument(
        "attend: the query at position " + std::to_string(p0) + " would see tokens from " +
        std::to_string(ledger.sealed_tokens_at(p0 + 1)) +
        " exact, but the cache holds exact values only from " +
        std::to_string(ledger.exact_begin()) + "; attend the queries of the last append (" +
        std::to_string(ledger.last_append()) + " tokens)");
  return ok_status();
}

Status validate_read(const LayerShape& shape, const Ledger& ledger, const Device& device,
                     bool exact, int64_t t0, int64_t n, const MutTensorView& k_out,
                     const MutTensorView& v_out) {
  const char* what = exact ? "read_exact" : "read";
  const int64_t lo = exact ? ledger.exact_begin() : 0;
  if (t0 < lo || n < 0 || t0 > ledger.offset() || n > ledger.offset() - t0)  // no overflow
    return out_of_range(std::string(what) + " of " + std::to_string(n) + " tokens from " +
                        std::to_string(t0) + " outside [" + std::to_string(lo) + ", " +
                        std::to_string(ledger.offset()) + ")" +
                        (exact ? " (exact values are held from exact_begin())" : ""));
  KVQ_RETURN_IF_ERROR(validate_view(as_const(k_out), "k_out"));
  KVQ_RETURN_IF_ERROR(validate_view(as_const(v_out), "v_out"));
  KVQ_RETURN_IF_ERROR(require_device(as_const(k_out), device, "k_out"));
  KVQ_RETURN_IF_ERROR(require_device(as_const(v_out), device, "v_out"));
  const std::array<int64_t, 4> want{ledger.batch(), shape.n_kv_heads, n, shape.head_dim};
  if (k_out.shape != want || v_out.shape != want)
    return shape_mismatch(std::string(what) + " outputs must be [" +
                          std::to_string(ledger.batch()) + ", " +
                          std::to_string(shape.n_kv_heads) + ", " + std::to_string(n) + ", " +
                          std::to_string(shape.head_dim) + "], got " + describe(as_const(k_out)) +
                          " and " + describe(as_const(v_out)));
  return ok_status();
}

Status CpuLayer::attend(const TensorView& q, float scale, const MutTensorView& out,
                        int kv_head_begin, int kv_head_end, Workspace* ws) const {
  KVQ_RETURN_IF_ERROR(validate_attend(shape_, ledger_, options_.device, q, scale, out,
                                      kv_head_begin, kv_head_end));
  const int64_t heads = kv_head_end - kv_head_begin, items = ledger_.batch() * heads;
  auto item = [&](int64_t it, Workspace& w) {
    attend_head(q, scale, out, it / heads, kv_head_begin + it % heads, w);
  };
  if (options_.pool && items > 1 && !ThreadPool::in_parallel_item()) {
    options_.pool->parallel_for(items, [&](int64_t it) {
      WorkspacePool::Lease lease(*options_.workspaces);
      item(it, lease.get());
    });
  } else if (ws) {
    for (int64_t it = 0; it < items; ++it) item(it, *ws);
  } else {
    WorkspacePool::Lease lease(*options_.workspaces);
    for (int64_t it = 0; it < items; ++it) item(it, lease.get());
  }
  return ok_status();
}

// Online-softmax attention of the query rows of KV head (b, h) over key tiles at fixed absolute
// positions (numerics/attention.h): each row's arithmetic depends only on its own query and the
// tiles it sees, in a fixed order, never on how many other rows there are, so outputs are
// bit-identical whether queries arrive one by one or in chunks. Per query position p the seal
// boundary visible_sealed(p) decides whether a tile is read from its sealed block or exact;
// within one call it moves by whole blocks, so each tile is decoded at most once per version.
// Rows are t-major (r = t * group + j, query token t of query head h * group + j), so the rows
// that see a tile in one version are contiguous.
void CpuLayer::attend_head(const TensorView& q, float scale, const MutTensorView& out, int64_t b,
                           int64_t h, Workspace& ws) const {
  Workspace::Frame frame(ws);
  const int64_t Hq = shape_.n_q_heads, H = shape_.n_kv_heads, D = shape_.head_dim;
  const int64_t Tq = q.shape[2], offset = ledger_.offset(), T = ledger_.block_tokens();
  const int64_t A = attention_tile(T), sealed = ledger_.sealed_tokens();
  const int64_t group = Hq / H, rows = group * Tq, q_pos0 = offset - Tq;
  const BlockGeometry g = geometry();
  const BlockCodec::AttendBasis basis = codec_->attend_basis();
  float* qr = ws.alloc<float>(static_cast<size_t>(rows * D));
  float* acc = ws.alloc<float>(static_cast<size_t>(rows * D));
  // Sealed tiles' queries and value sums in the codec's basis (BlockCodec::attend_basis), and
  // the running maxima before a tile (to rescale the accumulator that tile did not touch).
  float* qb = basis.keys ? ws.alloc<float>(static_cast<size_t>(rows * D)) : qr;
  float* accb = basis.values ? ws.alloc<float>(static_cast<size_t>(rows * D)) : acc;
  float* m_old = basis.values ? ws.alloc<float>(static_cast<size_t>(rows)) : nullptr;
  float* m = ws.alloc<float>(static_cast<size_t>(rows));
  float* l = ws.alloc<float>(static_cast<size_t>(rows));
  int64_t* vis = ws.alloc<int64_t>(static_cast<size_t>(rows));
  int64_t* seen = ws.alloc<int64_t>(static_cast<size_t>(Tq));   // visible_sealed per query
  int64_t* split = ws.alloc<int64_t>(static_cast<size_t>(Tq));  // sealed keys of the tile
  // Sealed and exact versions of a tile (a block longer than a tile is decoded whole once),
  // and a mixed one for queries whose boundary falls inside the tile.
  const int64_t sealed_len = ledger_.n_blocks() == 0 ? 0 : T > A ? T : A;
  float* ks = ws.alloc<float>(static_cast<size_t>(sealed_len * D));
  float* vs = ws.alloc<float>(static_cast<size_t>(sealed_len * D));
  float* ke = ws.alloc<float>(static_cast<size_t>(A * D));
  float* ve = ws.alloc<float>(static_cast<size_t>(A * D));
  float* km = ws.alloc<float>(static_cast<size_t>(A * D));
  float* vm = ws.alloc<float>(static_cast<size_t>(A * D));
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t j = 0; j < group; ++j)
      for (int64_t d = 0; d < D; ++d)
        qr[(t * group + j) * D + d] = q.load(b, h * group + j, t, d) * scale;
  if (basis.keys) {
    std::memcpy(qb, qr, static_cast<size_t>(rows * D) * 4);
    codec_->to_basis(true, qb, rows);
  }
  std::fill(acc, acc + rows * D, 0.0f);
  std::fill(accb, accb + rows * D, 0.0f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.0f);
  for (int64_t t = 0; t < Tq; ++t) seen[t] = ledger_.visible_sealed(q_pos0 + t);
  int64_t decoded = -1;  // the long block ks, vs hold (T > A)
  auto decode_block = [&](int64_t blk, float* k_out, float* v_out) {
    if (basis.keys)
      codec_->decode_in_basis(store_.block(blk), blk, true, b, h, g, k_out, ws);
    else
      codec_->decode(store_.block(blk), blk, true, b, h, g, k_out, ws);
    if (basis.values)
      codec_->decode_in_basis(store_.block(blk), blk, false, b, h, g, v_out, ws);
    else
      codec_->decode(store_.block(blk), blk, false, b, h, g, v_out, ws);
  };
  for (int64_t p0 = 0; p0 < offset; p0 += A) {
    const int64_t n = std::min(A, offset - p0);
    // Query t sees the tile's first nv keys (causal), the first split[t] of them sealed.
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t nv = std::clamp<int64_t>(q_pos0 + t - p0 + 1, 0, n);
      split[t] = std::min(std::clamp<int64_t>(seen[t] - p0, 0, n), nv);
      for (int64_t j = 0; j < group; ++j) vis[t * group + j] = nv;
    }
    const float* sk = nullptr;  // the sealed version's keys and values, filled on first use
    const float* sv = nullptr;
    int64_t exact_from = n;  // exact rows [exact_from, n) are filled
    auto sealed_version = [&] {
      if (sk) return;
      if (T > A) {  // the tile lies inside one long block
        const int64_t blk = p0 / T;
        if (decoded != blk) {
          decode_block(blk, ks, vs);
          decoded = blk;
        }
        sk = ks + (p0 - blk * T) * D;
        sv = vs + (p0 - blk * T) * D;
        return;
      }
      for (int64_t pos = p0; pos < std::min(p0 + n, sealed); pos += T) {
        const int64_t blk = pos / T;
        decode_block(blk, ks + (pos - p0) * D, vs + (pos - p0) * D);
      }
      sk = ks;
      sv = vs;
    };
    auto exact_version = [&](int64_t from) {  // positions from p0 + from are held exact
      for (int64_t j = from; j < exact_from; ++j) {
        exact_row(true, b, h, p0 + j, ke + j * D);
        exact_row(false, b, h, p0 + j, ve + j * D);
      }
      exact_from = std::min(exact_from, from);
    };
    // Runs of queries that see the tile the same way: all of their keys sealed, all exact, or
    // the same mixed boundary.
    for (int64_t t0 = 0; t0 < Tq;) {
      auto kind = [&](int64_t t) -> int64_t {  // -1 none, -2 sealed, else the exact start
        const int64_t v = vis[t * group];
        return v == 0 ? -1 : split[t] >= v ? -2 : split[t];
      };
      const int64_t k0 = kind(t0);
      int64_t t1 = t0 + 1;
      while (t1 < Tq && kind(t1) == k0) ++t1;
      if (k0 != -1) {
        const float *kt, *vt;
        if (k0 == -2) {
          sealed_version();
          kt = sk, vt = sv;
        } else if (k0 == 0) {
          exact_version(0);
          kt = ke, vt = ve;
        } else {  // sealed keys [0, k0), exact from k0
          sealed_version();
          exact_version(k0);
          std::memcpy(km, sk, static_cast<size_t>(k0 * D) * 4);
          std::memcpy(vm, sv, static_cast<size_t>(k0 * D) * 4);
          std::memcpy(km + k0 * D, ke + k0 * D, static_cast<size_t>((n - k0) * D) * 4);
          std::memcpy(vm + k0 * D, ve + k0 * D, static_cast<size_t>((n - k0) * D) * 4);
          if (basis.keys) codec_->to_basis(true, km + k0 * D, n - k0);
          if (basis.values) codec_->to_basis(false, vm + k0 * D, n - k0);
          kt = km, vt = vm;
        }
        // Exact tiles in the model's basis; sealed and mixed ones in the codec's.
        const bool in_basis = k0 != 0;
        const int64_t r0 = t0 * group, nr = (t1 - t0) * group;
        float* into = in_basis ? accb : acc;
        if (basis.values) std::memcpy(m_old + r0, m + r0, static_cast<size_t>(nr) * 4);
        attend_tile((in_basis ? qb : qr) + r0 * D, nr, D, kt, vt, n, vis + r0, m + r0, l + r0,
                    into + r0 * D, ws);
        if (basis.values) {
          // The other accumulator takes the tile's rescaling exp(m_old - m_new) too, bit for bit
          // the factor the kernel applied (numerics/attention.h).
          float* other = in_basis ? acc : accb;
          for (int64_t r = r0; r < r0 + nr; ++r) {
            if (m[r] == m_old[r]) continue;
            const float c = exp_f32(m_old[r] - m[r]);
            for (int64_t d = 0; d < D; ++d) other[r * D + d] *= c;
          }
        }
      }
      t0 = t1;
    }
  }
  for (int64_t t = 0; t < Tq; ++t)
    for (int64_t j = 0; j < group; ++j) {
      const int64_t r = t * group + j;
      const float inv = 1.0f / l[r];
      float* o = static_cast<float*>(out.data) + out.offset(b, h * group + j, t, 0);
      if (basis.values) {  // the sealed rows' sum mapped back once, plus the exact rows' sum
        float* u = accb + r * D;
        codec_->from_basis(false, u);
        for (int64_t d = 0; d < D; ++d) o[d * out.strides[3]] = (acc[r * D + d] + u[d]) * inv;
      } else {
        for (int64_t d = 0; d < D; ++d) o[d * out.strides[3]] = acc[r * D + d] * inv;
      }
    }
}

Status CpuLayer::trim(int64_t n) {
  KVQ_ASSIGN_OR_RETURN(const Ledger::TrimPlan plan, ledger_.plan_trim(n));
  if (n == 0) return ok_status();
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = ledger_.page_tokens();
  const int64_t B = ledger_.batch();
  store_.drop_retired();
  if (!plan.reopen && plan.keep_blocks == ledger_.n_blocks()) {
    // Inside the window: exact. Drop whole pages past the new end, zero the rest of the last.
    store_.truncate_pages(plan.keep_window_pages);
    if (plan.window_tokens % P) {
      const int64_t used = plan.window_tokens % P;
      for (bool keys : {true, false}) {
        uint8_t* page = store_.page(keys, plan.keep_window_pages - 1);
        for (int64_t bh = 0; bh < B * H; ++bh)
          std::memset(page + static_cast<size_t>(bh * P + used) * row_bytes_, 0,
                      static_cast<size_t>(P - used) * row_bytes_);
      }
    }
  } else {
    // Into sealed blocks: drop whole blocks; a block cut in two is reopened from its dequantized
    // values (its original values are gone) into the window.
    const int64_t T = ledger_.block_tokens(), kb = plan.keep_blocks;
    const BlockGeometry g = geometry();
    WorkspacePool::Lease lease(*options_.workspaces);
    Workspace& ws = lease.get();
    Workspace::Frame frame(ws);
    float* re = nullptr;  // [2, B * H, T, D]: keys then values of the reopened block
    float* scratch = ws.alloc<float>(static_cast<size_t>(D));
    if (plan.reopen) {
      re = ws.alloc<float>(static_cast<size_t>(2 * B * H * T * D));
      for (int64_t bh = 0; bh < B * H; ++bh) {
        codec_->decode(store_.block(kb), kb, true, bh / H, bh % H, g, re + bh * T * D, ws);
        codec_->decode(store_.block(kb), kb, false, bh / H, bh % H, g, re + (B * H + bh) * T * D,
                       ws);
      }
    }
    store_.truncate_blocks(kb);
    store_.truncate_pages(0);
    for (int64_t t = 0; t < plan.window_tokens; ++t) {
      if (t % P == 0) store_.open_page();
      for (bool keys : {true, false}) {
        uint8_t* dst = store_.page(keys, t / P);
        for (int64_t bh = 0; bh < B * H; ++bh)
          put_row(re + ((keys ? 0 : B * H) + bh) * T * D + t * D,
                  dst + static_cast<size_t>(bh * P + t % P) * row_bytes_, scratch);
      }
    }
  }
  ledger_.apply_trim(plan);
  codec_->on_trim(plan.new_offset, plan.keep_blocks);
  return ok_status();
}

void CpuLayer::reset() {
  store_.clear();
  ledger_.reset();
  window_dtype_ = DType::kF16;
  codec_->on_reset();
}

CacheBytes CpuLayer::bytes() const {
  CacheBytes c = ledger_.bytes(store_.page_bytes(), codec_->extra_bytes(), shape_.n_kv_heads,
                               shape_.head_dim);
  c.tables = codec_->table_bytes();
  return c;
}

uint64_t CpuLayer::resident_bytes() const {
  return store_.resident_bytes() + codec_->extra_resident_bytes() + codec_->table_bytes();
}

std::string CpuLayer::stats() const { return codec_->stats(store_.blocks(), geometry()); }

Status CpuLayer::export_blocks(int64_t first_block, ChunkSink& sink) const {
  if (first_block < 0 || first_block > n_blocks())
    return out_of_range("export_blocks from block " + std::to_string(first_block) + " of " +
                        std::to_string(n_blocks()));
  const int64_t T = ledger_.block_tokens();
  std::vector<uint8_t> buf;
  for (int64_t i = first_block; i < n_blocks(); ++i) {
    for (int keys = 1; keys >= 0; --keys) {
      buf.clear();
      codec_->serialize(store_.block(i), keys != 0, buf);
      KVQ_RETURN_IF_ERROR(sink.put(ChunkRef{keys ? ChunkKind::kBlockKeys : ChunkKind::kBlockValues,
                                            i * T, T, buf.data(), buf.size()}));
    }
  }
  return ok_status();
}

Status CpuLayer::export_tail(ChunkSink& sink) const {
  const int64_t H = shape_.n_kv_heads, B = ledger_.batch();
  const int64_t t0 = ledger_.sealed_tokens(), n = ledger_.window_tokens();
  std::vector<uint8_t> buf(static_cast<size_t>(B * H * n) * row_bytes_);
  for (int keys = 1; keys >= 0; --keys) {
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < n; ++t)
          std::memcpy(buf.data() + static_cast<size_t>((b * H + h) * n + t) * row_bytes_,
                      exact_row_bytes(keys != 0, b, h, t0 + t), row_bytes_);
    KVQ_RETURN_IF_ERROR(sink.put(ChunkRef{keys ? ChunkKind::kWindowKeys : ChunkKind::kWindowValues,
                                          t0, n, buf.data(), buf.size()}));
  }
  std::vector<uint8_t> state;
  codec_->export_state(state);
  return sink.put(ChunkRef{ChunkKind::kState, 0, ledger_.offset(), state.data(), state.size()});
}

Status CpuLayer::import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch, int64_t offset,
                               DType wdtype) {
  Status st = [&]() -> Status {
    const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = ledger_.page_tokens(),
                  T = ledger_.block_tokens();
    if (batch < 1 || batch > 65536)
      return corrupt("import: batch size " + std::to_string(batch) + " out of range");
    if (offset < 0 || offset > Ledger::kMaxTokens)
      return corrupt("import: token count " + std::to_string(offset) + " out of range");
    if (wdtype != DType::kF16 && wdtype != DType::kBF16)
      return corrupt("import: window dtype must be f16 or bf16");
    if (format_ == WindowFormat::kQ8 && wdtype != DType::kF16)
      return corrupt("import: q8 window rows have fp16 scales, not " +
                     std::string(dtype_name(wdtype)));
    if (chunks.size() < 3 || (chunks.size() - 3) % 2 != 0)
      return corrupt("import: expected block pairs, two window chunks and a state chunk, got " +
                     std::to_string(chunks.size()) + " chunks");
    const int64_t nb = static_cast<int64_t>((chunks.size() - 3) / 2);
    if (nb > offset / T)
      return corrupt("import: " + std::to_string(nb) + " blocks of " + std::to_string(T) +
                     " tokens exceed the " + std::to_string(offset) + " tokens held");
    const BlockGeometry g{batch, H, T, D};
    std::vector<std::shared_ptr<const BlockData>> blocks;
    std::vector<CacheBytes> accounting;
    for (int64_t i = 0; i < nb; ++i) {
      const ChunkRef& k = chunks[static_cast<size_t>(2 * i)];
      const ChunkRef& v = chunks[static_cast<size_t>(2 * i + 1)];
      if (k.kind != ChunkKind::kBlockKeys || v.kind != ChunkKind::kBlockValues || k.t0 != i * T ||
          v.t0 != i * T || k.tokens != T || v.tokens != T)
        return corrupt("import: chunk pair " + std::to_string(i) + " is not block " +
                       std::to_string(i) + " (tokens [" + std::to_string(i * T) + ", " +
                       std::to_string((i + 1) * T) + "))");
      auto blk = codec_->load(i, g, k, v);
      if (!blk.ok()) return blk.status().with_context("block " + std::to_string(i));
      blocks.push_back(std::move(blk->data));
      accounting.push_back(blk->bytes);
    }
    const int64_t t0 = nb * T, n = offset - t0;
    const ChunkRef& wk = chunks[static_cast<size_t>(2 * nb)];
    const ChunkRef& wv = chunks[static_cast<size_t>(2 * nb + 1)];
    const ChunkRef& sc = chunks[static_cast<size_t>(2 * nb + 2)];
    int64_t rows = 0;  // B * H * n rows; their bytes overflow int64 for the largest batch, offset
    size_t wbytes = 0;
    if (__builtin_mul_overflow(batch * H, n, &rows) ||
        __builtin_mul_overflow(static_cast<size_t>(rows), row_bytes_, &wbytes))
      return corrupt("import: a window of " + std::to_string(n) + " tokens at batch size " +
                     std::to_string(batch) + " is too large");
    for (const ChunkRef* w : {&wk, &wv}) {
      const ChunkKind want = w == &wk ? ChunkKind::kWindowKeys : ChunkKind::kWindowValues;
      if (w->kind != want || w->t0 != t0 || w->tokens != n || w->size != wbytes)
        return corrupt(std::string("import: expected ") + chunk_kind_name(want) + " of tokens [" +
                       std::to_string(t0) + ", " + std::to_string(offset) + ") in " +
                       std::to_string(wbytes) + " bytes, got " + chunk_kind_name(w->kind) + " [" +
                       std::to_string(w->t0) + ", +" + std::to_string(w->tokens) + ") in " +
                       std::to_string(w->size));
      if (format_ == WindowFormat::kQ8) {
        KVQ_RETURN_IF_ERROR(validate_q8_rows(w->data, static_cast<size_t>(rows), D)
                                .with_context(std::string("import: ") + chunk_kind_name(want)));
        continue;
      }
      for (size_t i = 0; i < wbytes / 2; ++i) {
        uint16_t bits;
        std::memcpy(&bits, w->data + 2 * i, 2);
        const float x = wdtype == DType::kBF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
        if (!std::isfinite(x) || std::fabs(x) > kF16Max)
          return corrupt(std::string("import: window value ") + std::to_string(x) +
                         " is not a finite fp16-range value");
      }
    }
    if (sc.kind != ChunkKind::kState || sc.t0 != 0 || sc.tokens != offset)
      return corrupt("import: the last chunk must be the method state of tokens [0, " +
                     std::to_string(offset) + ")");
    KVQ_RETURN_IF_ERROR(codec_->import_state(sc.data, sc.size, batch, offset, false));

    // Everything validated: build the window pages, then commit.
    const size_t pbytes = static_cast<size_t>(batch * H * P) * row_bytes_;
    std::vector<Buffer> kp, vp;
    for (int keys = 1; keys >= 0; --keys) {
      auto& pages = keys ? kp : vp;
      const uint8_t* src = (keys ? wk : wv).data;
      for (int64_t t = 0; t < n; ++t) {
        if (t % P == 0) pages.emplace_back(pbytes);
        uint8_t* dst = pages.back().data();
        for (int64_t bh = 0; bh < batch * H; ++bh)
          std::memcpy(dst + static_cast<size_t>(bh * P + t % P) * row_bytes_,
                      src + static_cast<size_t>(bh * n + t) * row_bytes_, row_bytes_);
      }
    }
    store_.clear();
    store_.set_page_bytes(pbytes);
    store_.set_blocks(std::move(blocks));
    store_.set_pages(std::move(kp), std::move(vp));
    ledger_.assign(batch, offset, std::move(accounting));
    window_dtype_ = wdtype;
    KVQ_CHECK(codec_->import_state(sc.data, sc.size, batch, offset, true).ok());
    return ok_status();
  }();
  codec_->end_import(st.ok());
  return st;
}

}  // namespace kvq
