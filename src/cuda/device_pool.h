// DevicePool — device memory for one model's caches, so that appends never call cudaMalloc on
// their own: memory is taken from CUDA in chunks (growing geometrically, up to 1 GiB) and handed
// out in pieces rounded to 256 bytes; a freed piece goes to a free list of its size and is
// reused for the next request of that size (a layer's blocks, pages and tables come in a few
// fixed sizes). Chunks go back to CUDA only when the pool is destroyed.
//
// Device work is ordered on the model's one stream, so a piece freed while a kernel enqueued
// earlier still reads it can be handed out at once: whatever the new owner enqueues runs after.
// Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kvq/status.h"

namespace kvq::cuda {

class DevicePool {
 public:
  explicit DevicePool(int device) : device_(device) {}
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // Makes sure that `bytes` (a sum of rounded requests) can be carved without another
  // cudaMalloc; takes one chunk from CUDA if not. kLimit when the device is out of memory
  // (nothing taken).
  Status reserve(size_t bytes);
  // A piece of at least `bytes` bytes (256-aligned), or kLimit.
  Result<uint8_t*> alloc(size_t bytes);
  // Returns a piece (same size as asked for). Null is ignored.
  void free(uint8_t* p, size_t bytes);

  static size_t rounded(size_t bytes) { return (bytes + 255) / 256 * 256; }
  int device() const { return device_; }
  // Bytes taken from CUDA, bytes handed out now, and cudaMalloc calls made so far.
  uint64_t reserved_bytes() const;
  uint64_t in_use_bytes() const;
  uint64_t device_allocations() const;

 private:
  Status grow(size_t bytes);  // mu_ held

  struct Region {
    uint8_t* p;
    size_t left;
  };
  mutable std::mutex mu_;
  int device_;
  std::vector<void*> chunks_;
  std::vector<Region> regions_;  // unused tails of the chunks
  std::unordered_map<size_t, std::vector<uint8_t*>> free_;
  size_t next_chunk_ = size_t{8} << 20;
  uint64_t reserved_ = 0, in_use_ = 0, mallocs_ = 0;
};

}  // namespace kvq::cuda
