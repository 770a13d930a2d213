#include "cache/backend.h"

#include <array>
#include <atomic>

namespace kvq {

namespace {
// Function-local, so registrations from other libraries' static initializers find it built.
std::array<std::atomic<LayerBackend>, 2>& backends() {
  static std::array<std::atomic<LayerBackend>, 2> table{};
  return table;
}
}  // namespace

void register_layer_backend(DeviceType type, LayerBackend backend) {
  const auto i = static_cast<size_t>(type);
  KVQ_CHECK(type != DeviceType::kCpu && i < backends().size());
  backends()[i].store(backend);
}

LayerBackend find_layer_backend(DeviceType type) {
  const auto i = static_cast<size_t>(type);
  return i < backends().size() ? backends()[i].load() : nullptr;
}

}  // namespace kvq
