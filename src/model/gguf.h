// GGUF reader (versions 2 and 3): metadata, tensor directory and dequantization to fp32.
//
// The file is memory-mapped read-only; tensors are views into the mapping, dequantized on demand.
// Every length, count, offset and dimension read from the file is checked against the bytes that
// are actually there before it is used, so a truncated or corrupted file gives a Status naming
// what is wrong and where, never a crash or an allocation sized by an untrusted number.
//
// Layout (all little-endian):
//   "GGUF" u32 version  u64 n_tensors  u64 n_kv
//   n_kv   x { string key, u32 value_type, value }
//   n_tensors x { string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset }
//   padding to `general.alignment` (default 32), then the data section; tensor offsets are
//   relative to the data section and aligned.
//   string = u64 length + bytes (no terminator); array = u32 element type, u64 count, elements.
// dims[0] is the fastest-varying axis (ggml's ne0): a matrix [rows, cols] in row-major order is
// stored with dims = {cols, rows}.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/status.h"

namespace kvq::gguf {

// A read-only memory mapping of a whole file (move-only; unmaps on destruction).
class MappedFile {
 public:
  static Result<MappedFile> open(const std::string& path);
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept { *this = std::move(o); }
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  std::string path_;
};

// ggml tensor types (the numbers are part of the GGUF format).
enum class TensorType : uint32_t {
  kF32 = 0,
  kF16 = 1,
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ8_1 = 9,
  kQ2_K = 10,
  kQ3_K = 11,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
  kQ8_K = 15,
  kBF16 = 30,
};

// Name ("Q4_1") of a type number, or "type<N>" for numbers kvq does not know.
std::string tensor_type_name(uint32_t type);
// Elements per block and bytes per block of a type; false for unknown types.
bool tensor_type_block(uint32_t type, int64_t* block_elems, int64_t* block_bytes);
// Whether dequantize_row() implements the type.
bool tensor_type_supported(uint32_t type);

// Dequantizes n elements (a multiple of the type's block size) starting at `src` into `dst`.
// Semantics follow ggml's reference ("_ref") dequantizers: e.g. Q4_1 x = d * q + m with
// q = low nibble for the first 16 elements of a block, high nibble for the last 16.
// Returns kUnsupported for types without a dequantizer. The caller guarantees the bytes exist.
Status dequantize_row(uint32_t type, const uint8_t* src, float* dst, int64_t n);

// Metadata value types (numbers are part of the format).
enum class ValueType : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};
const char* value_type_name(ValueType t);

// One metadata value. Scalars fill exactly one of i/u/f/b/s (by type); arrays of numbers fill
// `ints` (signed and unsigned integers and bools, as int64; u64 values above INT64_MAX are
// rejected) or `floats`, arrays of strings fill `strings`. Arrays of arrays are skipped: their
// `is_array` is set and `element_type` is kArray, with no elements kept.
struct Value {
  ValueType type = ValueType::kU8;          // the scalar type, or kArray
  ValueType element_type = ValueType::kU8;  // arrays only
  bool is_array = false;
  int64_t i = 0;   // integer scalars that fit int64, bools (0/1)
  uint64_t u = 0;  // unsigned integer scalars (and non-negative signed ones)
  double f = 0;    // float scalars
  std::string s;   // string scalars
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<std::string> strings;
  uint64_t count = 0;  // array element count
};

struct TensorInfo {
  std::string name;
  uint32_t type = 0;
  std::vector<int64_t> dims;  // ne0 first (fastest varying)
  uint64_t offset = 0;        // relative to the data section
  int64_t n_elements = 0;
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;  // into the mapping
};

// Limits on what a file may declare before kvq refuses it (kLimit): far above real models,
// low enough that nothing malformed can make the reader allocate without bound.
inline constexpr uint64_t kMaxTensors = 1u << 20;
inline constexpr uint64_t kMaxKeys = 1u << 20;
inline constexpr uint64_t kMaxStringBytes = 1u << 26;
inline constexpr int kMaxDims = 4;  // ggml's GGML_MAX_DIMS

class File {
 public:
  // Opens and validates a GGUF file: header, every metadata entry, every tensor's type, shape,
  // alignment and byte range. The data itself is not read until dequantized.
  static Result<File> open(const std::string& path);
  // Same for bytes already in memory (tests, fuzzing). The bytes must outlive the File.
  static Result<File> parse(const uint8_t* data, size_t size, std::string name = "<memory>");

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::string& name() const { return name_; }

  const std::map<std::string, Value, std::less<>>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }

  // Typed getters: kNotFound when absent, kFormat when the stored type does not fit (e.g. a
  // string where an integer is expected, or a negative value for get_uint).
  Result<int64_t> get_int(std::string_view key) const;
  Result<uint64_t> get_uint(std::string_view key) const;
  Result<double> get_float(std::string_view key) const;  // integers are accepted too
  Result<bool> get_bool(std::string_view key) const;
  Result<std::string> get_string(std::string_view key) const;
  // Arrays; the pointer stays valid as long as the File.
  Result<const std::vector<std::string>*> get_string_array(std::string_view key) const;
  Result<const std::vector<int64_t>*> get_int_array(std::string_view key) const;
  Result<const std::vector<double>*> get_float_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;

  // Dequantizes a whole tensor into `out` (resized to n_elements). When `expect_dims` is not
  // empty the tensor's dims must equal it (kShapeMismatch otherwise, naming both).
  Status read_f32(std::string_view name, const std::vector<int64_t>& expect_dims,
                  std::vector<float>* out) const;
  // Same into caller memory of `capacity` floats (kShapeMismatch when the tensor is larger).
  Status read_f32(std::string_view name, const std::vector<int64_t>& expect_dims, float* out,
                  int64_t capacity) const;

 private:
  File() = default;
  Status parse_impl(const uint8_t* data, size_t size);

  std::shared_ptr<MappedFile> mapping_;  // null for parse()
  std::string name_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, Value, std::less<>> kv_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> tensor_index_;
};

}  // namespace kvq::gguf
