#include "numerics/rope_table.h"

#include <algorithm>
#include <cmath>

namespace kvq {

RopeTable::RopeTable(double theta, double freq_scale, int64_t head_dim)
    : theta_(theta), freq_scale_(freq_scale), dim_(head_dim), half_(head_dim / 2) {
  inv_freq_.resize(static_cast<size_t>(half_));
  for (int64_t i = 0; i < half_; ++i)
    inv_freq_[static_cast<size_t>(i)] =
        std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
}

RopeTable::RopeTable(const RopeTable& o)
    : RopeTable(o.theta_, o.freq_scale_, o.dim_) {
  ensure(o.size());  // recomputed: the same formula gives the same floats
}

void RopeTable::fill_chunk(float* c, int64_t first) const {
  for (int64_t t = 0; t < kChunk; ++t) {
    const double p = static_cast<double>(first + t) * freq_scale_;
    float* cs = c + t * 2 * half_;
    float* sn = cs + half_;
    for (int64_t i = 0; i < half_; ++i) {
      const double a = p * inv_freq_[static_cast<size_t>(i)];
      cs[i] = static_cast<float>(std::cos(a));
      sn[i] = static_cast<float>(std::sin(a));
    }
  }
}

void RopeTable::grow(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t have = static_cast<int64_t>(chunks_.size());
  const int64_t need = (n + kChunk - 1) / kChunk;
  if (need <= have) return;
  // A directory with room for `need` chunks: the current one, or a new one twice as large (the
  // old one stays allocated: a reader may still hold it).
  if (dirs_.empty() || dir_caps_.back() < need) {
    const int64_t cap = std::max<int64_t>(need, dirs_.empty() ? 8 : 2 * dir_caps_.back());
    auto d = std::make_unique<const float*[]>(static_cast<size_t>(cap));
    for (int64_t i = 0; i < have; ++i) d[static_cast<size_t>(i)] = chunks_[static_cast<size_t>(i)].get();
    for (int64_t i = have; i < cap; ++i) d[static_cast<size_t>(i)] = nullptr;
    dirs_.push_back(std::move(d));
    dir_caps_.push_back(cap);
  }
  const float** dir = dirs_.back().get();
  for (int64_t c = have; c < need; ++c) {
    auto chunk = std::make_unique<float[]>(static_cast<size_t>(kChunk * 2 * half_));
    fill_chunk(chunk.get(), c * kChunk);
    dir[c] = chunk.get();
    chunks_.push_back(std::move(chunk));
  }
  dir_.store(dir, std::memory_order_release);
  size_.store(need * kChunk, std::memory_order_release);
}

uint64_t RopeTable::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t b = static_cast<uint64_t>(chunks_.size()) * kChunk * 2 * half_ * sizeof(float);
  for (int64_t cap : dir_caps_) b += static_cast<uint64_t>(cap) * sizeof(const float*);
  return b;
}

void RopeTable::acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  ++holders_;
}

void RopeTable::release() {
  std::lock_guard<std::mutex> lock(mu_);
  if (--holders_ > 0) return;
  holders_ = 0;
  clear_locked();
}

void RopeTable::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  clear_locked();
}

void RopeTable::clear_locked() {
  size_.store(0, std::memory_order_release);
  dir_.store(nullptr, std::memory_order_release);
  chunks_.clear();
  dirs_.clear();
  dir_caps_.clear();
}

}  // namespace kvq
