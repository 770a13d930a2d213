#include "kvq/workspace.h"

#include <algorithm>
#include <cstdlib>
#include <new>

namespace kvq {

namespace {
constexpr size_t kAlign = 64;
constexpr size_t kMinChunk = size_t{64} << 10;
size_t round_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
}  // namespace

void Workspace::Free::operator()(std::byte* p) const { std::free(p); }

Workspace::Chunk Workspace::new_chunk(size_t size) {
  auto* p = static_cast<std::byte*>(std::aligned_alloc(kAlign, size));  // size: a multiple of 64
  if (!p) throw std::bad_alloc();
  return Chunk{std::unique_ptr<std::byte, Free>(p), size};
}

void* Workspace::alloc_bytes(size_t bytes) {
  bytes = round_up(std::max<size_t>(bytes, 1));
  // Find the chunk that holds offset used_ and check the allocation fits in it; allocations never
  // straddle two chunks, so skip to the next chunk's start when it does not.
  size_t base = 0;
  for (auto& c : chunks_) {
    if (used_ < base + c.size) {
      const size_t at = used_ - base;
      if (at + bytes <= c.size) {
        used_ += bytes;
        return c.mem.get() + at;
      }
      used_ = base + c.size;  // the rest of this chunk stays unused until the frame closes
    }
    base += c.size;
  }
  // No room: a new chunk at least as large as everything so far, so chunks grow geometrically.
  const size_t size = round_up(std::max({bytes, kMinChunk, capacity()}));
  chunks_.push_back(new_chunk(size));
  ++allocations_;
  used_ = base + bytes;
  return chunks_.back().mem.get();
}

void Workspace::release_to(size_t mark) {
  used_ = mark;
  if (used_ == 0 && chunks_.size() > 1) {
    // Merge into one chunk of the total size: the next workload of this size fits in one.
    const size_t total = capacity();
    chunks_.clear();
    chunks_.push_back(new_chunk(total));
    ++allocations_;
  }
}

size_t Workspace::capacity() const {
  size_t s = 0;
  for (const auto& c : chunks_) s += c.size;
  return s;
}

void Workspace::release() {
  slots_.clear();
  chunks_.clear();
  used_ = 0;
}

Workspace* WorkspacePool::acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) {
    all_.push_back(std::make_unique<Workspace>());
    return all_.back().get();
  }
  Workspace* ws = free_.back();
  free_.pop_back();
  return ws;
}

void WorkspacePool::release(Workspace* ws) {
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(ws);
}

size_t WorkspacePool::capacity() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t s = 0;
  for (const auto& w : all_) s += w->capacity();
  return s;
}

}  // namespace kvq
