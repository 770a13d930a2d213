#include "kvq/safetensors.h"

#include <algorithm>
#include <cstring>

#include "core/file_io.h"
#include "core/json.h"

namespace kvq {

namespace {

constexpr uint64_t kMaxHeader = 100u << 20;  // the reference implementation's limit

const char* st_dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
  }
  return "?";
}

bool mul_overflows(uint64_t a, uint64_t b, uint64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}

}  // namespace

int64_t SafeTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Result<TensorView> SafeTensor::view4() const {
  if (shape.size() != 4)
    return shape_mismatch("tensor '" + name + "' has rank " + std::to_string(shape.size()) +
                          ", expected 4 ([B, H, S, D])");
  return TensorView::bhsd(data.data(), dtype, shape[0], shape[1], shape[2], shape[3]);
}

const SafeTensor* SafeTensorsFile::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

Result<SafeTensorsFile> parse_safetensors(const uint8_t* data, size_t size) {
  if (size < 8)
    return format_error("safetensors: file of " + std::to_string(size) + " bytes has no header");
  uint64_t n = 0;
  std::memcpy(&n, data, 8);
  if (n > kMaxHeader)
    return format_error("safetensors: header length " + std::to_string(n) + " exceeds 100 MiB");
  if (n > size - 8)
    return format_error("safetensors: header length " + std::to_string(n) +
                        " runs past the end of a " + std::to_string(size) + "-byte file");
  KVQ_ASSIGN_OR_RETURN(json::Value header,
                       json::parse(std::string_view(reinterpret_cast<const char*>(data + 8), n)));
  if (!header.is_object()) return format_error("safetensors: header is not a JSON object");
  const uint8_t* buffer = data + 8 + n;
  const uint64_t buffer_size = size - 8 - n;

  SafeTensorsFile file;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : header.members()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return format_error("safetensors: __metadata__ is not an object");
      for (const auto& [k, v] : entry.members()) {
        if (!v.is_string())
          return format_error("safetensors: metadata '" + k + "' is not a string");
        file.metadata[k] = v.as_string();
      }
      continue;
    }
    const std::string where = "safetensors: tensor '" + name + "'";
    if (!entry.is_object()) return format_error(where + " is not an object");
    const json::Value* dt = entry.find("dtype");
    const json::Value* shape = entry.find("shape");
    const json::Value* offs = entry.find("data_offsets");
    if (!dt || !dt->is_string() || !shape || !shape->is_array() || !offs || !offs->is_array() ||
        offs->items().size() != 2)
      return format_error(where + " needs dtype, shape and data_offsets [begin, end]");
    SafeTensor t;
    t.name = name;
    const std::string& d = dt->as_string();
    if (d == "F32")
      t.dtype = DType::kF32;
    else if (d == "F16")
      t.dtype = DType::kF16;
    else if (d == "BF16")
      t.dtype = DType::kBF16;
    else
      return unsupported(where + " has dtype " + d + "; kvq reads F32, F16 and BF16");
    uint64_t numel = 1;
    if (shape->items().size() > 8) return format_error(where + " has more than 8 dimensions");
    for (const auto& dim : shape->items()) {
      if (!dim.is_number() || dim.as_number() < 0 || dim.as_number() > 9.0e15 ||
          dim.as_number() != static_cast<double>(static_cast<uint64_t>(dim.as_number())))
        return format_error(where + " has a bad dimension");
      const uint64_t dv = static_cast<uint64_t>(dim.as_number());
      if (mul_overflows(numel, dv, numel)) return format_error(where + ": shape overflows");
      t.shape.push_back(static_cast<int64_t>(dv));
    }
    uint64_t nbytes;
    if (mul_overflows(numel, dtype_size(t.dtype), nbytes))
      return format_error(where + ": size overflows");
    uint64_t se[2];
    for (int i = 0; i < 2; ++i) {
      const json::Value& o = offs->items()[static_cast<size_t>(i)];
      if (!o.is_number() || o.as_number() < 0 || o.as_number() > 9.0e15 ||
          o.as_number() != static_cast<double>(static_cast<uint64_t>(o.as_number())))
        return format_error(where + " has a bad data offset");
      se[i] = static_cast<uint64_t>(o.as_number());
    }
    if (se[0] > se[1] || se[1] > buffer_size)
      return corrupt(where + " data [" + std::to_string(se[0]) + ", " + std::to_string(se[1]) +
                     ") lies outside the " + std::to_string(buffer_size) + "-byte buffer");
    if (se[1] - se[0] != nbytes)
      return corrupt(where + " holds " + std::to_string(se[1] - se[0]) +
                     " bytes but its shape needs " + std::to_string(nbytes));
    ranges.emplace_back(se[0], se[1]);
    t.data.assign(buffer + se[0], buffer + se[1]);
    file.tensors.push_back(std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i)
    if (ranges[i].first < ranges[i - 1].second) return corrupt("safetensors: tensor data overlap");
  return file;
}

Result<SafeTensorsFile> read_safetensors(const std::string& path) {
  KVQ_ASSIGN_OR_RETURN(auto bytes, read_file(path));
  auto r = parse_safetensors(bytes.data(), bytes.size());
  if (!r.ok()) return r.status().with_context(path);
  return r;
}

std::vector<uint8_t> serialize_safetensors(const SafeTensorsFile& file) {
  json::Value header = json::Value::object();
  if (!file.metadata.empty()) {
    json::Value meta = json::Value::object();
    for (const auto& [k, v] : file.metadata) meta.set(k, json::Value::string(v));
    header.set("__metadata__", std::move(meta));
  }
  uint64_t off = 0;
  for (const auto& t : file.tensors) {
    json::Value e = json::Value::object();
    e.set("dtype", json::Value::string(st_dtype_name(t.dtype)));
    json::Value shape = json::Value::array();
    for (int64_t d : t.shape) shape.push(json::Value::number(static_cast<double>(d)));
    e.set("shape", std::move(shape));
    json::Value offs = json::Value::array();
    offs.push(json::Value::number(static_cast<double>(off)));
    off += t.data.size();
    offs.push(json::Value::number(static_cast<double>(off)));
    e.set("data_offsets", std::move(offs));
    header.set(t.name, std::move(e));
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h += ' ';  // align the data buffer to 8 bytes
  size_t total = 8 + h.size();
  for (const auto& t : file.tensors) total += t.data.size();
  std::vector<uint8_t> out(total);
  const uint64_t n = h.size();
  std::memcpy(out.data(), &n, 8);
  std::memcpy(out.data() + 8, h.data(), h.size());
  size_t pos = 8 + h.size();
  for (const auto& t : file.tensors) {
    if (!t.data.empty()) std::memcpy(out.data() + pos, t.data.data(), t.data.size());
    pos += t.data.size();
  }
  return out;
}

Status write_safetensors(const std::string& path, const SafeTensorsFile& file) {
  for (const auto& t : file.tensors) {
    uint64_t need = static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype);
    if (need != t.data.size())
      return invalid_argument("tensor '" + t.name + "' has " + std::to_string(t.data.size()) +
                              " bytes for a shape that needs " + std::to_string(need));
  }
  const auto bytes = serialize_safetensors(file);
  return write_file_atomic(path, bytes.data(), bytes.size());
}

SafeTensor make_tensor(std::string name, DType dtype, std::vector<int64_t> shape,
                       const float* values) {
  SafeTensor t;
  t.name = std::move(name);
  t.dtype = dtype;
  t.shape = std::move(shape);
  const int64_t n = t.numel();
  t.data.resize(static_cast<size_t>(n) * dtype_size(dtype));
  for (int64_t i = 0; i < n; ++i) store_from_f32(t.data.data(), dtype, i, values[i]);
  return t;
}

}  // namespace kvq
