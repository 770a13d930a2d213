// RopeTable — the rotary embedding's cos and sin per position, computed once and shared by the
// layers of a model that have the same RoPE (theta, linear scaling, head_dim), so that a cache
// that quantizes keys before RoPE (kvq's rope=pre) turns its keys with table lookups instead of
// a double-precision cos and sin per pair per token at every attention step.
//
// Entries are the formula the cache used before the table, so results are bit-identical:
//   a = (pos * freq_scale) * theta^(-2 i / D)     in double, i = 0 .. D/2 - 1
//   cos_i = float(cos(a)), sin_i = float(sin(a))
//
// Storage: chunks of kChunk positions that never move once written, found through a directory
// of chunk pointers. ensure(n) grows the table (under a mutex; a bigger directory replaces the
// old one, which is kept until clear() or destruction, so a reader holding it stays valid), and
// publishes the new size with release order; row(pos) is lock-free for every pos below a size
// the reader has seen (through ensure or size()). Readers never see a reallocation.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

namespace kvq {

class RopeTable {
 public:
  static constexpr int64_t kChunk = 256;  // positions per chunk

  RopeTable(double theta, double freq_scale, int64_t head_dim);
  // A deep copy of the positions `o` holds now, with no holders (for clones of a cache).
  RopeTable(const RopeTable& o);
  RopeTable& operator=(const RopeTable&) = delete;
  ~RopeTable() = default;

  // Positions [0, n) are readable once this returns. Thread-safe.
  void ensure(int64_t n) {
    if (n > size_.load(std::memory_order_acquire)) grow(n);
  }
  // Positions held (a multiple of kChunk).
  int64_t size() const { return size_.load(std::memory_order_acquire); }
  // cos of position pos's D/2 pairs, then their sin: 2 * (D / 2) floats. pos < a size seen.
  const float* row(int64_t pos) const {
    const float* const* dir = dir_.load(std::memory_order_acquire);
    return dir[pos / kChunk] + (pos % kChunk) * 2 * half_;
  }
  int64_t pairs() const { return half_; }
  double theta() const { return theta_; }
  double freq_scale() const { return freq_scale_; }
  int64_t head_dim() const { return dim_; }
  // Heap bytes held: every chunk and every directory (the current one and the retired ones).
  uint64_t bytes() const;
  // Drops every position. No reader may use the table meanwhile.
  void clear();
  // Users that hold positions (a cache layer with sealed blocks): the table is cleared when the
  // last one releases it, so an emptied cache holds no angles. Thread-safe.
  void acquire();
  void release();

 private:
  void grow(int64_t n);
  void fill_chunk(float* c, int64_t first) const;
  void clear_locked();

  double theta_, freq_scale_;
  int64_t dim_, half_;
  std::vector<double> inv_freq_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<float[]>> chunks_;                // guarded by mu_
  std::vector<std::unique_ptr<const float*[]>> dirs_;           // the last one is current
  std::vector<int64_t> dir_caps_;                               // their capacities (chunks)
  std::atomic<const float* const*> dir_{nullptr};
  std::atomic<int64_t> size_{0};
  int64_t holders_ = 0;  // guarded by mu_
};

}  // namespace kvq
