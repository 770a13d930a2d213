#include "cache/ledger.h"

#include <algorithm>

namespace kvq {

int64_t window_page_tokens(int64_t block_tokens) {
  for (int64_t p = std::min<int64_t>(32, block_tokens); p > 1; --p)
    if (block_tokens % p == 0) return p;
  return 1;
}

Ledger::Ledger(LedgerShape shape) : shape_(shape) {
  KVQ_CHECK(shape_.block_tokens >= 1 && shape_.page_tokens >= 1 &&
            shape_.block_tokens % shape_.page_tokens == 0 && shape_.residual >= 0);
}

int64_t Ledger::pages_for(int64_t window_tokens) const {
  return (window_tokens + shape_.page_tokens - 1) / shape_.page_tokens;
}

int64_t Ledger::next_run(int64_t left) const {
  return std::min(left, std::max<int64_t>(1, seal_offset(n_blocks()) - offset_));
}

bool Ledger::keep_exact_of_due_block() const {
  // The due block seals at offset seal_offset(i) = offset_. A query of this append at p sees it
  // exact iff p + 1 < seal_offset(i), i.e. some query at p <= offset_ - 2 belongs to the append.
  return offset_ - 2 >= append_start_;
}

void Ledger::begin_append(int64_t batch, int64_t n_new) {
  if (batch_ == 0) batch_ = batch;
  append_start_ = offset_;
  last_append_ = n_new;
  exact_begin_ = sealed_tokens();
}

void Ledger::record_block(const CacheBytes& bytes, bool exact_kept) {
  block_bytes_.push_back(bytes);
  if (!exact_kept) exact_begin_ = sealed_tokens();
}

Result<Ledger::TrimPlan> Ledger::plan_trim(int64_t n) const {
  if (n < 0 || n > offset_)
    return out_of_range("trim(" + std::to_string(n) + ") on a cache holding " +
                        std::to_string(offset_) + " tokens");
  TrimPlan p;
  p.new_offset = offset_ - n;
  if (p.new_offset >= sealed_tokens()) {
    p.keep_blocks = n_blocks();
    p.window_tokens = p.new_offset - sealed_tokens();
    p.keep_window_pages = pages_for(p.window_tokens);
  } else {
    p.keep_blocks = p.new_offset / block_tokens();
    p.reopen = p.new_offset % block_tokens() != 0;
    p.window_tokens = p.new_offset - p.keep_blocks * block_tokens();
  }
  return p;
}

void Ledger::apply_trim(const TrimPlan& plan) {
  block_bytes_.resize(static_cast<size_t>(plan.keep_blocks));
  offset_ = plan.new_offset;
  forget_last_append();
}

void Ledger::reset() {
  batch_ = offset_ = 0;
  block_bytes_.clear();
  forget_last_append();
}

void Ledger::assign(int64_t batch, int64_t offset, std::vector<CacheBytes> blocks) {
  batch_ = batch;
  offset_ = offset;
  block_bytes_ = std::move(blocks);
  forget_last_append();
}

void Ledger::forget_last_append() {
  last_append_ = 0;
  append_start_ = offset_;
  exact_begin_ = sealed_tokens();
}

CacheBytes Ledger::bytes(uint64_t page_bytes, uint64_t extra_meta, int64_t heads,
                         int64_t dim) const {
  CacheBytes total;
  for (const auto& b : block_bytes_) total += b;
  total.residual += 2 * static_cast<uint64_t>(window_pages()) * page_bytes;
  total.meta += extra_meta;
  total.elements = static_cast<uint64_t>(2 * batch_ * heads * offset_ * dim);
  return total;
}

}  // namespace kvq
