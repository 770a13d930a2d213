// The rows of the method table: one factory function per method file.
#pragma once

#include <memory>
#include <vector>

#include "kvq/cache.h"
#include "kvq/spec.h"

namespace kvq {

MethodDef make_fp16_method();
MethodDef make_kivi_method();
MethodDef make_cachegen_method();
MethodDef make_xquant_method();
MethodDef make_zipcache_method();

// The per-model builder of methods whose layers are independent: one Layer(spec, shape) each.
template <class Layer>
Result<std::vector<std::unique_ptr<LayerCache>>> build_each_layer(const std::vector<Spec>& specs,
                                                                  const ModelShape& shape) {
  std::vector<std::unique_ptr<LayerCache>> layers;
  for (int i = 0; i < shape.n_layers; ++i)
    layers.push_back(std::make_unique<Layer>(specs[static_cast<size_t>(i)], shape.at(i)));
  return layers;
}

}  // namespace kvq
