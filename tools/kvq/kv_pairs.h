// Finding per-layer K/V tensor pairs in a safetensors file (e.g. one written by `kvq dump-kv`),
// shared by the subcommands that read K/V (bench, compress).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "kvq/safetensors.h"
#include "kvq/status.h"
#include "kvq/tensor.h"

namespace kvq::cli {

struct LayerKV {
  std::string name;             // the common prefix, e.g. "layers.3."
  std::string k_name, v_name;   // the tensor names
  TensorView k, v;              // [B, H_kv, S, D] views into the file's tensors
  std::optional<TensorView> q;  // "<prefix>q" when present: the queries [B, H_q, S, D]
};

// Pairs "<x>k"/"<x>v" (and "<x>keys"/"<x>values", "<x>key"/"<x>value"), with an optional "<x>q".
// Layers are ordered by their prefix in natural order ("layers.2." before "layers.10."), so
// files whose writers sort names alphabetically still give layers in depth order. kNotFound
// when there is no pair; kShapeMismatch for tensors that are not 4-D. The views point into `f`.
Result<std::vector<LayerKV>> pair_layers(const SafeTensorsFile& f);

// a < b in natural order: digit runs compare as numbers.
bool natural_less(const std::string& a, const std::string& b);

}  // namespace kvq::cli
