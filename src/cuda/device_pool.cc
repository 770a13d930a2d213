#include "cuda/device_pool.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "cuda/cuda_util.h"

namespace kvq::cuda {

namespace {
constexpr size_t kMaxChunk = size_t{1} << 30;
}

DevicePool::~DevicePool() {
  if (chunks_.empty()) return;
  DeviceGuard guard(device_);
  for (void* c : chunks_) cudaFree(c);  // synchronizes: nothing enqueued can still use them
}

Status DevicePool::grow(size_t bytes) {
  DeviceGuard guard(device_);
  // A chunk of the growing size if the device has it, else just what is needed.
  for (size_t want : {std::max(bytes, next_chunk_), bytes}) {
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, want);
    if (e == cudaSuccess) {
      chunks_.push_back(p);
      regions_.push_back({static_cast<uint8_t*>(p), want});
      reserved_ += want;
      ++mallocs_;
      next_chunk_ = std::min(kMaxChunk, next_chunk_ * 2);
      return ok_status();
    }
    (void)cudaGetLastError();  // an allocation failure is not sticky: clear it
    if (e != cudaErrorMemoryAllocation) return cuda_error(e, "cudaMalloc");
    if (want == bytes) break;
  }
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  return limit_exceeded("out of GPU memory on cuda:" + std::to_string(device_) + ": " +
                        std::to_string(bytes) + " more bytes needed, " + std::to_string(free_b) +
                        " of " + std::to_string(total_b) + " free; this model's caches hold " +
                        std::to_string(in_use_) + " bytes of the " + std::to_string(reserved_) +
                        " they reserved");
}

Status DevicePool::reserve(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  size_t avail = 0;
  for (const Region& r : regions_) avail += r.left;
  if (avail >= bytes) return ok_status();
  return grow(bytes);
}

Result<uint8_t*> DevicePool::alloc(size_t bytes) {
  const size_t n = rounded(std::max<size_t>(bytes, 1));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = free_.find(n);
  if (it != free_.end() && !it->second.empty()) {
    uint8_t* p = it->second.back();
    it->second.pop_back();
    in_use_ += n;
    return p;
  }
  for (int attempt = 0; attempt < 2; ++attempt) {
    for (Region& r : regions_) {
      if (r.left < n) continue;
      uint8_t* p = r.p;
      r.p += n;
      r.left -= n;
      in_use_ += n;
      return p;
    }
    if (attempt == 0) KVQ_RETURN_IF_ERROR(grow(n));
  }
  KVQ_CHECK(false && "a region grown for a request must hold it");
  return Status(ErrorCode::kLimit, "unreachable");
}

void DevicePool::free(uint8_t* p, size_t bytes) {
  if (!p) return;
  const size_t n = rounded(std::max<size_t>(bytes, 1));
  std::lock_guard<std::mutex> lock(mu_);
  free_[n].push_back(p);
  in_use_ -= n;
}

uint64_t DevicePool::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}
uint64_t DevicePool::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}
uint64_t DevicePool::device_allocations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mallocs_;
}

}  // namespace kvq::cuda
