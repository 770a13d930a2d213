#include "cache/ledger.h"

#include <algorithm>
#include <bit>

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

void Ledger::push_block(const CacheBytes& bytes) {
  const int64_t n = n_blocks();
  // Room for one run per block until the count doubles, taken when it reaches a power of two:
  // the list grows only at those steps, as a per-block list would (tests/alloc_test.cc holds
  // sealing steps to that), however many runs the blocks make.
  if (std::has_single_bit(static_cast<uint64_t>(n + 1)))
    runs_.reserve(runs_.size() + static_cast<size_t>(n + 1));
  if (!runs_.empty() && runs_.back().bytes == bytes)
    ++runs_.back().end;
  else
    runs_.push_back({bytes, n + 1});
  sealed_ += bytes;
}

void Ledger::recount() {
  sealed_ = CacheBytes{};
  int64_t begin = 0;
  for (const Run& r : runs_) {
    // r.bytes times the run's length, by doubling.
    CacheBytes b = r.bytes;
    for (auto k = static_cast<uint64_t>(r.end - begin); k != 0; k >>= 1) {
      if (k & 1) sealed_ += b;
      b += b;
    }
    begin = r.end;
  }
}

const CacheBytes& Ledger::block_bytes(int64_t i) const {
  KVQ_CHECK(i >= 0 && i < n_blocks());
  const auto it = std::upper_bound(runs_.begin(), runs_.end(), i,
                                   [](int64_t x, const Run& r) { return x < r.end; });
  return it->bytes;
}

void Ledger::record_block(const CacheBytes& bytes, bool exact_kept) {
  push_block(bytes);
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
  if (plan.keep_blocks < n_blocks()) {
    // Drop the runs that begin at or past keep_blocks, then cut the one it falls in.
    auto begin_of_last = [&] { return runs_.size() < 2 ? 0 : runs_[runs_.size() - 2].end; };
    while (!runs_.empty() && begin_of_last() >= plan.keep_blocks) runs_.pop_back();
    if (!runs_.empty()) runs_.back().end = plan.keep_blocks;
    recount();
  }
  offset_ = plan.new_offset;
  forget_last_append();
}

void Ledger::reset() {
  batch_ = offset_ = 0;
  runs_.clear();
  sealed_ = CacheBytes{};
  forget_last_append();
}

void Ledger::assign(int64_t batch, int64_t offset, std::vector<CacheBytes> blocks) {
  batch_ = batch;
  offset_ = offset;
  runs_.clear();
  sealed_ = CacheBytes{};
  for (const CacheBytes& b : blocks) push_block(b);
  forget_last_append();
}

void Ledger::forget_last_append() {
  last_append_ = 0;
  append_start_ = offset_;
  exact_begin_ = sealed_tokens();
}

CacheBytes Ledger::bytes(uint64_t page_bytes, uint64_t extra_meta, int64_t heads,
                         int64_t dim) const {
  CacheBytes total = sealed_;
  total.residual += 2 * static_cast<uint64_t>(window_pages()) * page_bytes;
  total.meta += extra_meta;
  total.elements = static_cast<uint64_t>(2 * batch_ * heads * offset_ * dim);
  return total;
}

}  // namespace kvq
