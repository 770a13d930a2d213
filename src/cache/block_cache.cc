#include "cache/block_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "numerics/kernels.h"

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
// branch-free pass per row, so the common case costs a fraction of a memcpy.
bool all_within(const TensorView& v, float limit) {
  const int64_t D = v.shape[3];
  thread_local std::vector<float> row;
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = 0; h < v.shape[1]; ++h)
      for (int64_t s = 0; s < v.shape[2]; ++s) {
        const int64_t base = v.offset(b, h, s, 0);
        const float* x;
        if (v.dtype == DType::kF32 && v.d_contiguous()) {
          x = static_cast<const float*>(v.data) + base;
        } else {
          row.resize(static_cast<size_t>(D));
          if (v.d_contiguous() && v.dtype == DType::kF16)
            convert_f16_to_f32(static_cast<const uint16_t*>(v.data) + base, row.data(),
                               static_cast<size_t>(D));
          else
            for (int64_t d = 0; d < D; ++d)
              row[static_cast<size_t>(d)] = load_as_f32(v.data, v.dtype, base + d * v.strides[3]);
          x = row.data();
        }
        int bad = 0;  // an integer sum of comparisons vectorises; NaN compares false
        for (int64_t d = 0; d < D; ++d) bad += !(std::fabs(x[d]) <= limit);
        if (bad) return false;
      }
  return true;
}

Status check_range(const TensorView& v, const char* what) {
  return all_within(v, kF16Max) ? ok_status() : describe_bad_element(v, what);
}

Status check_finite_fast(const TensorView& v, const char* what) {
  return all_within(v, std::numeric_limits<float>::max()) ? ok_status() : check_finite(v, what);
}

}  // namespace

int64_t window_page_tokens(int64_t block_tokens) {
  for (int64_t p = std::min<int64_t>(32, block_tokens); p > 1; --p)
    if (block_tokens % p == 0) return p;
  return 1;
}

Status validate_append(const LayerShape& shape, int64_t batch, const TensorView& k,
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
    KVQ_RETURN_IF_ERROR(check_finite_fast(*q, "q"));
  }
  KVQ_RETURN_IF_ERROR(check_range(k, "k"));
  KVQ_RETURN_IF_ERROR(check_range(v, "v"));
  return ok_status();
}

BlockLayerCache::BlockLayerCache(Spec spec, LayerShape shape, int64_t block_tokens,
                                 int64_t page_tokens, int64_t residual)
    : spec_(std::move(spec)),
      shape_(shape),
      block_tokens_(block_tokens),
      page_tokens_(page_tokens),
      residual_(residual) {
  KVQ_CHECK(block_tokens_ >= 1 && page_tokens_ >= 1 && block_tokens_ % page_tokens_ == 0);
  KVQ_CHECK(residual_ >= 0);
  if (shape_.n_q_heads == 0) shape_.n_q_heads = shape_.n_kv_heads;
}

BlockLayerCache::BlockLayerCache(const BlockLayerCache& o, CloneMemo& memo)
    : LayerCache(),
      spec_(o.spec_),
      shape_(o.shape_),
      block_tokens_(o.block_tokens_),
      page_tokens_(o.page_tokens_),
      residual_(o.residual_),
      batch_(o.batch_),
      offset_(o.offset_),
      window_dtype_(o.window_dtype_),
      k_pages_(o.k_pages_),
      v_pages_(o.v_pages_) {
  blocks_.reserve(o.blocks_.size());
  for (const auto& b : o.blocks_) blocks_.push_back(b->clone(memo));
}

size_t BlockLayerCache::page_bytes() const {
  return static_cast<size_t>(batch_ * shape_.n_kv_heads * page_tokens_ * shape_.head_dim) * 2;
}

void BlockLayerCache::store_window_token(const TensorView& src, int64_t s, int64_t pos, bool keys) {
  const int64_t w = pos - sealed_tokens();
  auto& pages = keys ? k_pages_ : v_pages_;
  const size_t page = static_cast<size_t>(w / page_tokens_);
  const int64_t slot = w % page_tokens_;
  if (page == pages.size()) pages.emplace_back(page_bytes());
  auto* dst = reinterpret_cast<uint16_t*>(pages[page].data());
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = page_tokens_;
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t h = 0; h < H; ++h) {
      uint16_t* row = dst + ((b * H + h) * P + slot) * D;
      const int64_t base = src.offset(b, h, s, 0);
      if (src.dtype == window_dtype_ && src.d_contiguous()) {
        std::memcpy(row, static_cast<const uint16_t*>(src.data) + base, static_cast<size_t>(D) * 2);
      } else if (src.dtype == DType::kF32 && src.d_contiguous() && window_dtype_ == DType::kF16) {
        convert_f32_to_f16(static_cast<const float*>(src.data) + base, row, static_cast<size_t>(D));
      } else {
        for (int64_t d = 0; d < D; ++d) {
          const float x = load_as_f32(src.data, src.dtype, base + d * src.strides[3]);
          row[d] = window_dtype_ == DType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
        }
      }
    }
}

void BlockLayerCache::window_row_f32(bool keys, int64_t b, int64_t h, int64_t pos,
                                     float* out) const {
  const int64_t w = pos - sealed_tokens();
  const auto& pages = keys ? k_pages_ : v_pages_;
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = page_tokens_;
  const auto* src = reinterpret_cast<const uint16_t*>(pages[static_cast<size_t>(w / P)].data()) +
                    ((b * H + h) * P + w % P) * D;
  if (window_dtype_ == DType::kBF16)
    convert_bf16_to_f32(src, out, static_cast<size_t>(D));
  else
    convert_f16_to_f32(src, out, static_cast<size_t>(D));
}

void BlockLayerCache::window_block_f32(std::vector<float>& k, std::vector<float>& v) const {
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, T = block_tokens_;
  k.resize(static_cast<size_t>(batch_ * H * T * D));
  v.resize(k.size());
  const int64_t t0 = sealed_tokens();
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        window_row_f32(true, b, h, t0 + t, k.data() + ((b * H + h) * T + t) * D);
        window_row_f32(false, b, h, t0 + t, v.data() + ((b * H + h) * T + t) * D);
      }
}

Status BlockLayerCache::append(const TensorView& k, const TensorView& v, const TensorView* q) {
  KVQ_RETURN_IF_ERROR(validate_append(shape_, batch_, k, v, q));
  const int64_t n_new = k.shape[2];
  if (offset_ + n_new > kMaxTokens)
    return limit_exceeded("a layer cache holds at most " + std::to_string(kMaxTokens) +
                          " tokens; appending " + std::to_string(n_new) + " to " +
                          std::to_string(offset_) + " would exceed it");
  KVQ_RETURN_IF_ERROR(precheck_append(k.shape[0], n_new));

  if (batch_ == 0) {
    batch_ = k.shape[0];
    window_dtype_ = k.dtype == DType::kBF16 ? DType::kBF16 : DType::kF16;
  }
  std::vector<float> kb, vb;
  int64_t done = 0;
  while (done < n_new) {
    // The run ends where the next block becomes sealable, so methods see the same runs
    // whatever the chunking.
    const int64_t next_seal_at = (n_blocks() + 1) * block_tokens_ + residual_;
    const int64_t n = std::min(n_new - done, std::max<int64_t>(1, next_seal_at - offset_));
    for (int64_t s = done; s < done + n; ++s) {
      store_window_token(k, s, offset_ + (s - done), true);
      store_window_token(v, s, offset_ + (s - done), false);
    }
    const int64_t pos0 = offset_;
    offset_ += n;
    if (q) {
      const TensorView qs = q->slice_tokens(done, n);
      on_tokens(pos0, n, &qs);
    } else {
      on_tokens(pos0, n, nullptr);
    }
    done += n;
    while (offset_ >= (n_blocks() + 1) * block_tokens_ + residual_) {
      window_block_f32(kb, vb);
      blocks_.push_back(seal(n_blocks(), kb.data(), vb.data()));
      const int64_t pages = block_tokens_ / page_tokens_;
      for (int64_t p = 0; p < pages; ++p) {
        k_pages_.pop_front();
        v_pages_.pop_front();
      }
    }
  }
  on_append_done();
  return ok_status();
}

void BlockLayerCache::gather(bool keys, int64_t b, int64_t h, int64_t t0, int64_t n,
                             float* out) const {
  const int64_t D = shape_.head_dim, T = block_tokens_;
  thread_local std::vector<float> scratch;
  int64_t t = t0;
  const int64_t end = t0 + n;
  while (t < end && t < sealed_tokens()) {
    const int64_t bi = t / T;
    const int64_t lo = t - bi * T, hi = std::min(end - bi * T, T);
    const SealedBlock& blk = *blocks_[static_cast<size_t>(bi)];
    if (lo == 0 && hi == T) {  // the whole block: no staging copy
      if (keys)
        blk.dequant_keys(b, h, out + (t - t0) * D);
      else
        blk.dequant_values(b, h, out + (t - t0) * D);
      t = bi * T + hi;
      continue;
    }
    scratch.resize(static_cast<size_t>(T * D));
    if (keys)
      blk.dequant_keys(b, h, scratch.data());
    else
      blk.dequant_values(b, h, scratch.data());
    std::memcpy(out + (t - t0) * D, scratch.data() + lo * D,
                static_cast<size_t>((hi - lo) * D) * 4);
    t = bi * T + hi;
  }
  for (; t < end; ++t) window_row_f32(keys, b, h, t, out + (t - t0) * D);
}

Status BlockLayerCache::read(int64_t t0, int64_t n, const MutTensorView& k_out,
                             const MutTensorView& v_out) const {
  if (t0 < 0 || n < 0 || t0 + n > offset_)
    return out_of_range("read of tokens [" + std::to_string(t0) + ", " + std::to_string(t0 + n) +
                        ") outside [0, " + std::to_string(offset_) + ")");
  KVQ_RETURN_IF_ERROR(validate_view(as_const(k_out), "k_out"));
  KVQ_RETURN_IF_ERROR(validate_view(as_const(v_out), "v_out"));
  const std::array<int64_t, 4> want{batch_, shape_.n_kv_heads, n, shape_.head_dim};
  if (k_out.shape != want || v_out.shape != want)
    return shape_mismatch("read outputs must be [" + std::to_string(batch_) + ", " +
                          std::to_string(shape_.n_kv_heads) + ", " + std::to_string(n) + ", " +
                          std::to_string(shape_.head_dim) + "], got " + describe(as_const(k_out)) +
                          " and " + describe(as_const(v_out)));
  const int64_t D = shape_.head_dim;
  std::vector<float> buf;
  for (int keys = 1; keys >= 0; --keys) {
    const MutTensorView& o = keys ? k_out : v_out;
    const bool direct = o.dtype == DType::kF32 && o.d_contiguous() && o.strides[2] == D;
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t h = 0; h < shape_.n_kv_heads; ++h) {
        if (direct) {  // rows of (b, h) are contiguous: dequantize straight into the output
          gather(keys != 0, b, h, t0, n, static_cast<float*>(o.data) + o.offset(b, h, 0, 0));
          continue;
        }
        buf.resize(static_cast<size_t>(n * D));
        gather(keys != 0, b, h, t0, n, buf.data());
        const TensorView src = TensorView::bhsd(buf.data(), DType::kF32, 1, 1, n, D);
        MutTensorView dst = o;
        dst.data = static_cast<char*>(o.data) +
                   o.offset(b, h, 0, 0) * static_cast<int64_t>(dtype_size(o.dtype));
        dst.shape = {1, 1, n, D};
        KVQ_RETURN_IF_ERROR(copy_view(src, dst));
      }
  }
  return ok_status();
}

Status BlockLayerCache::attend(const TensorView& q, float scale, const MutTensorView& out,
                               int kv_head_begin, int kv_head_end) const {
  KVQ_RETURN_IF_ERROR(validate_view(q, "q"));
  KVQ_RETURN_IF_ERROR(validate_view(as_const(out), "out"));
  const int64_t Hq = shape_.n_q_heads, H = shape_.n_kv_heads, D = shape_.head_dim;
  const int64_t Tq = q.shape[2];
  if (q.shape[0] != batch_ || q.shape[1] != Hq || q.shape[3] != D || Tq < 1 || Tq > offset_)
    return shape_mismatch("attend: q " + describe(q) + " must be [" + std::to_string(batch_) +
                          ", " + std::to_string(Hq) + ", T, " + std::to_string(D) +
                          "] with 1 <= T <= offset (" + std::to_string(offset_) + ")");
  if (out.shape != q.shape || out.dtype != DType::kF32)
    return shape_mismatch("attend: out must be f32 with q's shape " + describe(q));
  if (kv_head_end < 0) kv_head_end = static_cast<int>(H);
  if (kv_head_begin < 0 || kv_head_begin > kv_head_end || kv_head_end > H)
    return out_of_range("attend: KV head range [" + std::to_string(kv_head_begin) + ", " +
                        std::to_string(kv_head_end) + ") outside [0, " + std::to_string(H) + ")");
  if (!std::isfinite(scale)) return invalid_argument("attend: scale must be finite");

  const int64_t group = Hq / H, rows = group * Tq, T = block_tokens_;
  const int64_t q_pos0 = offset_ - Tq;
  std::vector<float> qr(static_cast<size_t>(rows * D)), acc(static_cast<size_t>(rows * D));
  std::vector<float> m(static_cast<size_t>(rows)), l(static_cast<size_t>(rows));
  std::vector<float> kt, vt, s;
  for (int64_t b = 0; b < batch_; ++b)
    for (int64_t h = kv_head_begin; h < kv_head_end; ++h) {
      // Rows r = j * Tq + t: query head h * group + j, query token t.
      for (int64_t j = 0; j < group; ++j)
        for (int64_t t = 0; t < Tq; ++t)
          for (int64_t d = 0; d < D; ++d)
            qr[static_cast<size_t>((j * Tq + t) * D + d)] = q.load(b, h * group + j, t, d) * scale;
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      // Key tiles: each sealed block, then the window in tiles of T tokens.
      for (int64_t p0 = 0; p0 < offset_; p0 += T) {
        const int64_t n = std::min(T, offset_ - p0);
        kt.resize(static_cast<size_t>(n * D));
        vt.resize(static_cast<size_t>(n * D));
        s.resize(static_cast<size_t>(n));
        gather(true, b, h, p0, n, kt.data());
        gather(false, b, h, p0, n, vt.data());
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t qpos = q_pos0 + r % Tq;
          const int64_t nv = std::min(n, qpos - p0 + 1);  // causal: keys at positions <= qpos
          if (nv <= 0) continue;
          const float* qv = qr.data() + r * D;
          float mx = m[static_cast<size_t>(r)];
          for (int64_t j = 0; j < nv; ++j) {
            s[static_cast<size_t>(j)] = dot_f32(qv, kt.data() + j * D, D);
            mx = std::max(mx, s[static_cast<size_t>(j)]);
          }
          const float corr = std::exp(m[static_cast<size_t>(r)] - mx);
          float* a = acc.data() + r * D;
          float lsum = l[static_cast<size_t>(r)] * corr;
          scale_f32(a, corr, D);
          for (int64_t j = 0; j < nv; ++j) {
            const float p = std::exp(s[static_cast<size_t>(j)] - mx);
            lsum += p;
            axpy_f32(a, p, vt.data() + j * D, D);
          }
          m[static_cast<size_t>(r)] = mx;
          l[static_cast<size_t>(r)] = lsum;
        }
      }
      for (int64_t j = 0; j < group; ++j)
        for (int64_t t = 0; t < Tq; ++t) {
          const int64_t r = j * Tq + t;
          const float inv = 1.0f / l[static_cast<size_t>(r)];
          float* o = static_cast<float*>(out.data) + out.offset(b, h * group + j, t, 0);
          for (int64_t d = 0; d < D; ++d)
            o[d * out.strides[3]] = acc[static_cast<size_t>(r * D + d)] * inv;
        }
    }
  return ok_status();
}

Status BlockLayerCache::trim(int64_t n) {
  if (n < 0 || n > offset_)
    return out_of_range("trim(" + std::to_string(n) + ") on a cache holding " +
                        std::to_string(offset_) + " tokens");
  if (n == 0) return ok_status();
  const int64_t new_off = offset_ - n;
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = page_tokens_;
  if (new_off >= sealed_tokens()) {
    // Inside the window: exact. Drop whole pages past the new end, zero the rest of the last.
    const int64_t keep_tokens = new_off - sealed_tokens();
    const size_t keep_pages = static_cast<size_t>((keep_tokens + P - 1) / P);
    k_pages_.resize(keep_pages);
    v_pages_.resize(keep_pages);
    if (keep_tokens % P) {
      const int64_t used = keep_tokens % P;
      for (auto* pages : {&k_pages_, &v_pages_}) {
        auto* page = reinterpret_cast<uint16_t*>(pages->back().data());
        for (int64_t bh = 0; bh < batch_ * H; ++bh)
          std::memset(page + (bh * P + used) * D, 0, static_cast<size_t>((P - used) * D) * 2);
      }
    }
  } else {
    // Into sealed blocks: drop whole blocks; a block cut in two is reopened from its
    // dequantized values (its original values are gone).
    const int64_t T = block_tokens_;
    const int64_t kb = new_off / T;
    std::vector<std::vector<float>> kre, vre;  // [b*H + h] -> [T, D]
    const bool reopen = new_off % T != 0;
    if (reopen) {
      for (int64_t b = 0; b < batch_; ++b)
        for (int64_t h = 0; h < H; ++h) {
          kre.emplace_back(static_cast<size_t>(T * D));
          vre.emplace_back(static_cast<size_t>(T * D));
          blocks_[static_cast<size_t>(kb)]->dequant_keys(b, h, kre.back().data());
          blocks_[static_cast<size_t>(kb)]->dequant_values(b, h, vre.back().data());
        }
    }
    blocks_.resize(static_cast<size_t>(kb));
    k_pages_.clear();
    v_pages_.clear();
    if (reopen) {
      for (int64_t t = 0; t < new_off - kb * T; ++t) {
        for (int keys = 1; keys >= 0; --keys) {
          auto& pages = keys ? k_pages_ : v_pages_;
          if (static_cast<size_t>(t / P) == pages.size()) pages.emplace_back(page_bytes());
          auto* dst = reinterpret_cast<uint16_t*>(pages.back().data());
          for (int64_t bh = 0; bh < batch_ * H; ++bh) {
            const float* src = (keys ? kre : vre)[static_cast<size_t>(bh)].data() + t * D;
            uint16_t* row = dst + (bh * P + t % P) * D;
            for (int64_t d = 0; d < D; ++d)
              row[d] = window_dtype_ == DType::kBF16 ? f32_to_bf16(src[d]) : f32_to_f16(src[d]);
          }
        }
      }
    }
  }
  offset_ = new_off;
  on_trim(new_off);
  return ok_status();
}

void BlockLayerCache::reset() {
  blocks_.clear();
  k_pages_.clear();
  v_pages_.clear();
  offset_ = 0;
  batch_ = 0;
  window_dtype_ = DType::kF16;
  on_reset();
}

CacheBytes BlockLayerCache::bytes() const {
  CacheBytes total;
  for (const auto& b : blocks_) total += b->bytes();
  total.residual += static_cast<uint64_t>(k_pages_.size() + v_pages_.size()) * page_bytes();
  total.meta += extra_bytes();
  total.elements =
      static_cast<uint64_t>(2 * batch_ * shape_.n_kv_heads * offset_ * shape_.head_dim);
  return total;
}

uint64_t BlockLayerCache::resident_bytes() const {
  uint64_t r = extra_resident_bytes();
  for (const auto& b : blocks_) r += b->resident_bytes();
  for (const auto& p : k_pages_) r += p.size();
  for (const auto& p : v_pages_) r += p.size();
  return r;
}

Status validate_quant_params(const uint8_t* params, size_t n_pairs, const char* what) {
  for (size_t i = 0; i < n_pairs; ++i) {
    uint16_t sc, ze;
    std::memcpy(&sc, params + 4 * i, 2);
    std::memcpy(&ze, params + 4 * i + 2, 2);
    const float scale = f16_to_f32(sc), zero = f16_to_f32(ze);
    if (!std::isfinite(scale) || !(scale > 0) || !std::isfinite(zero))
      return corrupt(std::string(what) + ": parameter pair " + std::to_string(i) + " has scale " +
                     std::to_string(scale) + ", zero " + std::to_string(zero));
  }
  return ok_status();
}

Status BlockLayerCache::export_blocks(int64_t first_block, ChunkSink& sink) const {
  if (first_block < 0 || first_block > n_blocks())
    return out_of_range("export_blocks from block " + std::to_string(first_block) + " of " +
                        std::to_string(n_blocks()));
  std::vector<uint8_t> buf;
  for (int64_t i = first_block; i < n_blocks(); ++i) {
    for (int keys = 1; keys >= 0; --keys) {
      buf.clear();
      blocks_[static_cast<size_t>(i)]->serialize(keys != 0, buf);
      KVQ_RETURN_IF_ERROR(
          sink.put(ChunkRef{keys ? ChunkKind::kBlockKeys : ChunkKind::kBlockValues,
                            i * block_tokens_, block_tokens_, buf.data(), buf.size()}));
    }
  }
  return ok_status();
}

Status BlockLayerCache::export_tail(ChunkSink& sink) const {
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = page_tokens_;
  const int64_t t0 = sealed_tokens(), n = offset_ - t0;
  std::vector<uint8_t> buf(static_cast<size_t>(batch_ * H * n * D) * 2);
  for (int keys = 1; keys >= 0; --keys) {
    const auto& pages = keys ? k_pages_ : v_pages_;
    auto* out = reinterpret_cast<uint16_t*>(buf.data());
    for (int64_t b = 0; b < batch_; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < n; ++t) {
          const auto* src =
              reinterpret_cast<const uint16_t*>(pages[static_cast<size_t>(t / P)].data()) +
              ((b * H + h) * P + t % P) * D;
          std::memcpy(out + ((b * H + h) * n + t) * D, src, static_cast<size_t>(D) * 2);
        }
    KVQ_RETURN_IF_ERROR(sink.put(ChunkRef{keys ? ChunkKind::kWindowKeys : ChunkKind::kWindowValues,
                                          t0, n, buf.data(), buf.size()}));
  }
  std::vector<uint8_t> state;
  export_state(state);
  return sink.put(ChunkRef{ChunkKind::kState, 0, offset_, state.data(), state.size()});
}

Status BlockLayerCache::import_chunks(const std::vector<ChunkRef>& chunks, int64_t batch,
                                      int64_t offset, DType wdtype) {
  const int64_t H = shape_.n_kv_heads, D = shape_.head_dim, P = page_tokens_, T = block_tokens_;
  if (batch < 1 || batch > 65536)
    return corrupt("import: batch size " + std::to_string(batch) + " out of range");
  if (offset < 0 || offset > kMaxTokens)
    return corrupt("import: token count " + std::to_string(offset) + " out of range");
  if (wdtype != DType::kF16 && wdtype != DType::kBF16)
    return corrupt("import: window dtype must be f16 or bf16");
  if (chunks.size() < 3 || (chunks.size() - 3) % 2 != 0)
    return corrupt("import: expected block pairs, two window chunks and a state chunk, got " +
                   std::to_string(chunks.size()) + " chunks");
  const int64_t nb = static_cast<int64_t>((chunks.size() - 3) / 2);
  if (nb > offset / T)
    return corrupt("import: " + std::to_string(nb) + " blocks of " + std::to_string(T) +
                   " tokens exceed the " + std::to_string(offset) + " tokens held");
  const BlockGeometry g{batch, H, T, D};
  std::vector<std::unique_ptr<SealedBlock>> blocks;
  for (int64_t i = 0; i < nb; ++i) {
    const ChunkRef& k = chunks[static_cast<size_t>(2 * i)];
    const ChunkRef& v = chunks[static_cast<size_t>(2 * i + 1)];
    if (k.kind != ChunkKind::kBlockKeys || v.kind != ChunkKind::kBlockValues || k.t0 != i * T ||
        v.t0 != i * T || k.tokens != T || v.tokens != T)
      return corrupt("import: chunk pair " + std::to_string(i) + " is not block " +
                     std::to_string(i) + " (tokens [" + std::to_string(i * T) + ", " +
                     std::to_string((i + 1) * T) + "))");
    auto blk = deserialize_block(i, g, k, v);
    if (!blk.ok()) return blk.status().with_context("block " + std::to_string(i));
    blocks.push_back(std::move(*blk));
  }
  const int64_t t0 = nb * T, n = offset - t0;
  const ChunkRef& wk = chunks[static_cast<size_t>(2 * nb)];
  const ChunkRef& wv = chunks[static_cast<size_t>(2 * nb + 1)];
  const ChunkRef& st = chunks[static_cast<size_t>(2 * nb + 2)];
  int64_t welems = 0;  // B * H * n * D overflows int64 for the largest batch and offset
  if (__builtin_mul_overflow(batch * H, n, &welems) || __builtin_mul_overflow(welems, D, &welems))
    return corrupt("import: a window of " + std::to_string(n) + " tokens at batch size " +
                   std::to_string(batch) + " is too large");
  const size_t wbytes = static_cast<size_t>(welems) * 2;
  for (const ChunkRef* w : {&wk, &wv}) {
    const ChunkKind want = w == &wk ? ChunkKind::kWindowKeys : ChunkKind::kWindowValues;
    if (w->kind != want || w->t0 != t0 || w->tokens != n || w->size != wbytes)
      return corrupt(std::string("import: expected ") + chunk_kind_name(want) + " of tokens [" +
                     std::to_string(t0) + ", " + std::to_string(offset) + ") in " +
                     std::to_string(wbytes) + " bytes, got " + chunk_kind_name(w->kind) + " [" +
                     std::to_string(w->t0) + ", +" + std::to_string(w->tokens) + ") in " +
                     std::to_string(w->size));
    for (size_t i = 0; i < wbytes / 2; ++i) {
      uint16_t bits;
      std::memcpy(&bits, w->data + 2 * i, 2);
      const float x = wdtype == DType::kBF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
      if (!std::isfinite(x) || std::fabs(x) > kF16Max)
        return corrupt(std::string("import: window value ") + std::to_string(x) +
                       " is not a finite fp16-range value");
    }
  }
  if (st.kind != ChunkKind::kState || st.t0 != 0 || st.tokens != offset)
    return corrupt("import: the last chunk must be the method state of tokens [0, " +
                   std::to_string(offset) + ")");
  KVQ_RETURN_IF_ERROR(import_state(st.data, st.size, batch, offset, false));

  // Everything validated: build the window pages, then commit.
  const size_t pbytes = static_cast<size_t>(batch * H * P * D) * 2;
  std::deque<Buffer> kp, vp;
  for (int keys = 1; keys >= 0; --keys) {
    auto& pages = keys ? kp : vp;
    const auto* src = reinterpret_cast<const uint16_t*>((keys ? wk : wv).data);
    for (int64_t t = 0; t < n; ++t) {
      if (t % P == 0) pages.emplace_back(pbytes);
      auto* dst = reinterpret_cast<uint16_t*>(pages.back().data());
      for (int64_t bh = 0; bh < batch * H; ++bh)
        std::memcpy(dst + (bh * P + t % P) * D, src + (bh * n + t) * D, static_cast<size_t>(D) * 2);
    }
  }
  batch_ = batch;
  offset_ = offset;
  window_dtype_ = wdtype;
  blocks_ = std::move(blocks);
  k_pages_ = std::move(kp);
  v_pages_ = std::move(vp);
  KVQ_CHECK(import_state(st.data, st.size, batch, offset, true).ok());
  return ok_status();
}

}  // namespace kvq
