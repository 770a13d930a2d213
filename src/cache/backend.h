// Device backends. libkvq holds the CPU backend (CpuLayer) and a table of the others: a backend
// built as a library of its own (the CUDA backend, kvq_cuda) registers itself when it is linked,
// and ModelCache::create hands it the method's codecs for caches whose CacheOptions::device is
// of its type. Every backend runs the same Ledger rules and the same codecs' stored layouts, so
// backends differ in where bytes live and which kernels run, never in semantics.
#pragma once

#include <memory>
#include <vector>

#include "cache/codec.h"
#include "kvq/cache.h"

namespace kvq {

// Wraps one codec per layer (the method's per-model builder made them) in the backend's layer
// caches. Returns an error (nothing built) when the backend cannot hold these layers: a method
// it has no kernels for, a device that is not there.
using LayerBackend = Result<std::vector<std::unique_ptr<LayerCache>>> (*)(
    std::vector<std::unique_ptr<BlockCodec>> codecs, const ModelShape& shape,
    const CacheOptions& options);

// One backend per device type (kCpu is built in and cannot be replaced); a later registration
// replaces an earlier one. Safe to call from static initializers.
void register_layer_backend(DeviceType type, LayerBackend backend);
// The backend registered for `type`, or null.
LayerBackend find_layer_backend(DeviceType type);

}  // namespace kvq
