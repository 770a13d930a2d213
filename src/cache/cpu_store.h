// CpuStore — the CPU backend's block store: sealed blocks on the heap and the window in pages. It
// stores; the Ledger decides. A CUDA store has the same shape with device memory.
//
// Pages: page i of the window holds tokens sealed_tokens + i * P ... as [B, H, P] rows of the
// layer's window format (D 16-bit values, or a q8 row), for keys and for values separately. Pages
// of blocks that the current append sealed before its last token are retired, not freed: their
// tokens' exact values are what the append's own queries see (Ledger::exact_begin). Retired pages
// are workspace, freed at the next append. The page lists are vectors, not deques: the window holds
// a bounded number of pages, so once warm, opening and closing pages moves a few handles and never
// allocates list storage (a deque cycling through push_back/pop_front allocates a node every few
// dozen pages).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "cache/codec.h"

namespace kvq {

class CpuStore {
 public:
  // ---- blocks ----
  int64_t n_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  const BlockData& block(int64_t i) const { return *blocks_[static_cast<size_t>(i)]; }
  const std::vector<std::shared_ptr<const BlockData>>& blocks() const { return blocks_; }
  void push_block(std::shared_ptr<const BlockData> b) {
    allocations_ += 1 + (b->keys.size() > 0) + (b->values.size() > 0);  // the object and its parts
    blocks_.push_back(std::move(b));
  }
  void truncate_blocks(int64_t n) { blocks_.resize(static_cast<size_t>(n)); }
  void set_blocks(std::vector<std::shared_ptr<const BlockData>> b) { blocks_ = std::move(b); }

  // ---- window pages ----
  // page_bytes: one page of K (or of V), B * H * P * window_row_bytes.
  void set_page_bytes(size_t b) { page_bytes_ = b; }
  size_t page_bytes() const { return page_bytes_; }
  int64_t n_pages() const { return static_cast<int64_t>(k_pages_.size()); }
  uint8_t* page(bool keys, int64_t i) {
    return (keys ? k_pages_ : v_pages_)[static_cast<size_t>(i)].data();
  }
  const uint8_t* page(bool keys, int64_t i) const {
    return (keys ? k_pages_ : v_pages_)[static_cast<size_t>(i)].data();
  }
  void open_page() {
    k_pages_.emplace_back(page_bytes_);
    v_pages_.emplace_back(page_bytes_);
    allocations_ += 2;
  }
  // Closes the first n pages (their block sealed); keeps them as retired if `retire`.
  void close_front_pages(int64_t n, bool retire) {
    if (retire)
      for (int64_t i = 0; i < n; ++i) {
        k_retired_.push_back(std::move(k_pages_[static_cast<size_t>(i)]));
        v_retired_.push_back(std::move(v_pages_[static_cast<size_t>(i)]));
      }
    k_pages_.erase(k_pages_.begin(), k_pages_.begin() + n);
    v_pages_.erase(v_pages_.begin(), v_pages_.begin() + n);
  }
  void truncate_pages(int64_t n) {
    k_pages_.resize(static_cast<size_t>(n));
    v_pages_.resize(static_cast<size_t>(n));
  }
  void set_pages(std::vector<Buffer> k, std::vector<Buffer> v) {
    k_pages_ = std::move(k);
    v_pages_ = std::move(v);
  }
  // Retired page i: tokens exact_begin + i * P ...
  const uint8_t* retired(bool keys, int64_t i) const {
    return (keys ? k_retired_ : v_retired_)[static_cast<size_t>(i)].data();
  }
  int64_t n_retired() const { return static_cast<int64_t>(k_retired_.size()); }
  void drop_retired() {
    k_retired_.clear();
    v_retired_.clear();
  }

  void clear() {
    blocks_.clear();
    k_pages_.clear();
    v_pages_.clear();
    drop_retired();
  }

  // Bytes held for K/V state, measured: the blocks' own parts and the open pages.
  uint64_t resident_bytes() const {
    uint64_t r = 0;
    for (const auto& b : blocks_) r += b->keys.size() + b->values.size();
    for (const auto& p : k_pages_) r += p.size();
    for (const auto& p : v_pages_) r += p.size();
    return r;
  }
  uint64_t retired_bytes() const {
    uint64_t r = 0;
    for (const auto& p : k_retired_) r += p.size();
    for (const auto& p : v_retired_) r += p.size();
    return r;
  }
  // Heap allocations the store has made for state (pages opened, blocks added).
  uint64_t allocations() const { return allocations_; }

  // Deep copy; blocks shared with other layers (linked ones) are copied once per memo.
  CpuStore clone(CloneMemo& memo) const;

 private:
  std::vector<std::shared_ptr<const BlockData>> blocks_;
  std::vector<Buffer> k_pages_, v_pages_;      // open pages, oldest first
  std::vector<Buffer> k_retired_, v_retired_;  // cleared (capacity kept) at the next append
  size_t page_bytes_ = 0;
  uint64_t allocations_ = 0;
};

}  // namespace kvq
