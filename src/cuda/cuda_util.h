// Small host-side helpers of the CUDA backend: CUDA errors as kvq Status values, and a scoped
// current-device switch.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <string>

#include "kvq/status.h"

namespace kvq::cuda {

// A switch from the environment (the backend's KVQ_CUDA_* benchmark switches), read by the caller
// once: set, non-empty and not "0".
inline bool env_flag(const char* name) {
  const char* e = std::getenv(name);
  return e && *e && std::string(e) != "0";
}

// Errors CUDA reports about the caller's situation (no device, out of memory) become a Status;
// anything else from a call kvq makes correctly is a broken invariant (KVQ_CUDA_CHECK).
inline Status cuda_error(cudaError_t e, const char* what) {
  const std::string msg = std::string(what) + ": " + cudaGetErrorName(e) + " (" +
                          cudaGetErrorString(e) + ")";
  if (e == cudaErrorMemoryAllocation) return limit_exceeded("out of GPU memory: " + msg);
  return unsupported("CUDA: " + msg);
}

#define KVQ_CUDA_CHECK(expr)                                                                  \
  do {                                                                                        \
    const cudaError_t kvq_cuda_e_ = (expr);                                                   \
    if (kvq_cuda_e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "kvq: CUDA call failed: %s: %s at %s:%d\n", #expr,                 \
                   cudaGetErrorString(kvq_cuda_e_), __FILE__, __LINE__);                      \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

// Makes `device` current for a scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device_) KVQ_CUDA_CHECK(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && prev_ != device_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int prev_ = -1;
};

}  // namespace kvq::cuda
