// kvq/cuda.h — the CUDA backend (library kvq_cuda; build option KVQ_CUDA).
//
// Linking kvq_cuda registers the backend: caches created with
//
//   kvq::CacheOptions opt;
//   opt.device = kvq::Device::cuda(0);
//   opt.stream = my_stream;               // optional: a cudaStream_t; null is CUDA's default
//   auto cache = kvq::ModelCache::create("kivi:k_bits=2,v_bits=2", shape, opt);
//
// live on that GPU: blocks in the methods' stored layouts (byte for byte what the CPU backend
// holds, so a cache exported on one backend imports on the other), the window in fp16/bf16
// pages, attention fused over the packed codes. Tensors passed to such a cache must be device
// memory of that GPU, described by views whose `device` says so; the cache's work runs on its
// stream. Methods the backend has no kernels for are refused by create() with kUnsupported
// (today it holds fp16, kivi, xquant and zipcache).
//
// Semantics are the cache contract's (kvq/cache.h) with these notes:
//  * append() validates every element on the device and waits for that check (one stream
//    synchronization per call) so that bad input returns an error and changes nothing;
//  * read(), read_exact() and attend() return once their kernels are enqueued;
//  * attend() of a single decode query runs the fused tensor-core kernel where the layer's
//    shape allows it (docs/cuda.md), otherwise a general fp32 kernel; both follow the per-query
//    seal boundary and agree with the CPU backend within the tolerance docs/cuda.md states;
//  * device memory comes from a pool per model (cudaMalloc in growing chunks, not per
//    append); bytes() == resident_bytes() counts what the cache holds, memory_stats() what the
//    pool has taken from CUDA.
#pragma once

#include <cstdint>

#include "kvq/cache.h"
#include "kvq/status.h"

namespace kvq::cuda {

// Number of CUDA devices visible (0 when there are none or no driver).
int device_count();

struct MemoryStats {
  uint64_t reserved = 0;            // bytes the model's pool took from CUDA
  uint64_t in_use = 0;              // bytes handed out (state, tables, attention scratch)
  uint64_t device_allocations = 0;  // cudaMalloc calls made by the pool so far
};
// The pool of a CUDA model cache (kInvalidArgument for a CPU cache).
Result<MemoryStats> memory_stats(const ModelCache& cache);

}  // namespace kvq::cuda
