// Helpers shared by the .kvq subcommands (compress, decompress, info).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "kvq/container.h"

namespace kvq::cli {

// The attribute that records the input's tensor names: a JSON array of [k_name, v_name] pairs.
inline constexpr const char* kTensorNamesAttribute = "kvq.tensor_names";
inline constexpr const char* kSourceAttribute = "kvq.source";
std::string tensor_names_json(const std::vector<std::pair<std::string, std::string>>& names);
// The names recorded in `meta` when they are valid (one distinct pair per layer), else
// "layers.<i>.k" / "layers.<i>.v".
std::vector<std::pair<std::string, std::string>> tensor_names(const ContainerMeta& meta);

// The model spec in the "method@layer:k=v" form (the method spec plus per-layer overrides).
std::string model_spec_text(const ContainerMeta& meta);

// Reads a whole input: a path, or "-" for standard input.
Result<std::vector<uint8_t>> read_input(const std::string& path);

}  // namespace kvq::cli
