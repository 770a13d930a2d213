// kvq/cuda.h, and the registration of the CUDA backend with libkvq (cache/backend.h).
#include "kvq/cuda.h"

#include <cuda_runtime_api.h>

#include "cache/backend.h"
#include "cuda/cuda_layer.h"

namespace kvq::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

Result<MemoryStats> memory_stats(const ModelCache& cache) {
  if (cache.n_layers() == 0) return invalid_argument("memory_stats: a cache without layers");
  const auto* layer = dynamic_cast<const CudaLayer*>(&cache.layer(0));
  if (!layer) return invalid_argument("memory_stats: not a CUDA cache");
  const DevicePool& pool = *layer->context().pool;
  return MemoryStats{pool.reserved_bytes(), pool.in_use_bytes(), pool.device_allocations()};
}

namespace {
// Runs when kvq_cuda is linked into a program (the build links it whole, see CMakeLists.txt).
[[maybe_unused]] const bool kRegistered = [] {
  register_layer_backend(DeviceType::kCuda, &make_cuda_layers);
  return true;
}();
}  // namespace

}  // namespace kvq::cuda
