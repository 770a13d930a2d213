// kvq/safetensors.h — reading and writing the safetensors format (F32, F16, BF16 tensors).
//
// Layout (https://huggingface.co/docs/safetensors): u64 little-endian header length N, N bytes
// of JSON {"name": {"dtype": "F16", "shape": [...], "data_offsets": [begin, end]}, ...,
// "__metadata__": {"key": "value"}}, then the data buffer. The reader checks every offset and
// size against the file (overlaps, gaps, overflow, shape x dtype size) and reports kFormat,
// kCorrupt or kUnsupported errors; it never trusts a declared size.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kvq/dtype.h"
#include "kvq/status.h"
#include "kvq/tensor.h"

namespace kvq {

struct SafeTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // little-endian elements, row-major

  int64_t numel() const;
  // A [B, H, S, D] view of a 4-D tensor (error for other ranks).
  Result<TensorView> view4() const;
};

struct SafeTensorsFile {
  std::vector<SafeTensor> tensors;  // in file order
  std::map<std::string, std::string> metadata;

  const SafeTensor* find(const std::string& name) const;
};

Result<SafeTensorsFile> parse_safetensors(const uint8_t* data, size_t size);
Result<SafeTensorsFile> read_safetensors(const std::string& path);
std::vector<uint8_t> serialize_safetensors(const SafeTensorsFile& file);
// Atomic: a failed write leaves any existing file untouched.
Status write_safetensors(const std::string& path, const SafeTensorsFile& file);

// Makes a tensor from fp32 values, converted to dtype (rounding to nearest even).
SafeTensor make_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                       const float* values);

}  // namespace kvq
