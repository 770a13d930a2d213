#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/byte_io.h"
#include "kvq/dtype.h"

namespace kvq::gguf {

// ---------------------------------------------------------------------------------------------
// MappedFile

Result<MappedFile> MappedFile::open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open '" + path + "': " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    return io_error("cannot stat '" + path + "': " + std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return io_error("'" + path + "' is not a regular file");
  }
  MappedFile m;
  m.path_ = path;
  m.size_ = static_cast<size_t>(st.st_size);
  if (m.size_ > 0) {
    void* p = ::mmap(nullptr, m.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return io_error("cannot map '" + path + "': " + std::strerror(e));
    }
    m.data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return m;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    data_ = o.data_;
    size_ = o.size_;
    path_ = std::move(o.path_);
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

// ---------------------------------------------------------------------------------------------
// Tensor types

namespace {

struct TypeInfo {
  uint32_t type = 0;
  const char* name;
  int64_t block_elems;
  int64_t block_bytes;
  bool dequant;  // dequantize_row() implements it
};

// One row per type kvq knows the size of. Types without a dequantizer can still be listed and
// skipped in a file; reading them gives kUnsupported.
constexpr TypeInfo kTypes[] = {
    {0, "F32", 1, 4, true},        {1, "F16", 1, 2, true},        {2, "Q4_0", 32, 18, true},
    {3, "Q4_1", 32, 20, true},     {6, "Q5_0", 32, 22, true},     {7, "Q5_1", 32, 24, true},
    {8, "Q8_0", 32, 34, true},     {9, "Q8_1", 32, 36, false},    {10, "Q2_K", 256, 84, false},
    {11, "Q3_K", 256, 110, false}, {12, "Q4_K", 256, 144, true},  {13, "Q5_K", 256, 176, true},
    {14, "Q6_K", 256, 210, true},  {15, "Q8_K", 256, 292, false}, {24, "I8", 1, 1, false},
    {25, "I16", 1, 2, false},      {26, "I32", 1, 4, false},      {27, "I64", 1, 8, false},
    {28, "F64", 1, 8, false},      {30, "BF16", 1, 2, true},
};

const TypeInfo* type_info(uint32_t type) {
  for (const auto& t : kTypes)
    if (t.type == type) return &t;
  return nullptr;
}

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// K-quant 6-bit scale/min pairs packed into 12 bytes (Q4_K, Q5_K): pairs 0-3 sit in the low six
// bits of bytes 0-3 (scales) and 4-7 (mins); pairs 4-7 take their low four bits from bytes 8-11
// and their top two bits from the spare top bits of bytes 0-7.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *mn = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

void dq_q4_0(const uint8_t* b, float* y) {  // d, qs[16]
  const float d = h2f(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

void dq_q4_1(const uint8_t* b, float* y) {  // d, m, qs[16]
  const float d = h2f(b), m = h2f(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
    y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

void dq_q5_0(const uint8_t* b, float* y) {  // d, qh[4], qs[16]
  const float d = h2f(b);
  uint32_t qh = 0;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10);
    const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>(((qs[j] & 0x0F) | h0) - 16) * d;
    y[j + 16] = static_cast<float>(((qs[j] >> 4) | h1) - 16) * d;
  }
}

void dq_q5_1(const uint8_t* b, float* y) {  // d, m, qh[4], qs[16]
  const float d = h2f(b), m = h2f(b + 2);
  uint32_t qh = 0;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10);
    const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10);
    y[j] = static_cast<float>((qs[j] & 0x0F) | h0) * d + m;
    y[j + 16] = static_cast<float>((qs[j] >> 4) | h1) * d + m;
  }
}

void dq_q8_0(const uint8_t* b, float* y) {  // d, qs[32]
  const float d = h2f(b);
  const auto* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

void dq_q4_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qs[128]
  const float d = h2f(b), dmin = h2f(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, mn;
    scale_min_k4(is + 0, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    scale_min_k4(is + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    q += 32;
    is += 2;
  }
}

void dq_q5_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qh[32], qs[128]
  const float d = h2f(b), dmin = h2f(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  int is = 0;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0; j < 256; j += 64) {
    uint8_t sc, mn;
    scale_min_k4(is + 0, scales, &sc, &mn);
    const float d1 = d * sc, m1 = dmin * mn;
    scale_min_k4(is + 1, scales, &sc, &mn);
    const float d2 = d * sc, m2 = dmin * mn;
    for (int l = 0; l < 32; ++l)
      *y++ = d1 * static_cast<float>((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l)
      *y++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    ql += 32;
    is += 2;
    u1 = static_cast<uint8_t>(u1 << 2);
    u2 = static_cast<uint8_t>(u2 << 2);
  }
}

void dq_q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], scales[16] (int8), d
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = h2f(b + 208);
  for (int n = 0; n < 256; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l + 0] = d * static_cast<float>(sc[is + 0]) * static_cast<float>(q1);
      y[l + 32] = d * static_cast<float>(sc[is + 2]) * static_cast<float>(q2);
      y[l + 64] = d * static_cast<float>(sc[is + 4]) * static_cast<float>(q3);
      y[l + 96] = d * static_cast<float>(sc[is + 6]) * static_cast<float>(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

}  // namespace

std::string tensor_type_name(uint32_t type) {
  const TypeInfo* t = type_info(type);
  return t ? t->name : "type" + std::to_string(type);
}

bool tensor_type_block(uint32_t type, int64_t* block_elems, int64_t* block_bytes) {
  const TypeInfo* t = type_info(type);
  if (!t) return false;
  *block_elems = t->block_elems;
  *block_bytes = t->block_bytes;
  return true;
}

bool tensor_type_supported(uint32_t type) {
  const TypeInfo* t = type_info(type);
  return t && t->dequant;
}

Status dequantize_row(uint32_t type, const uint8_t* src, float* dst, int64_t n) {
  const TypeInfo* t = type_info(type);
  if (!t || !t->dequant)
    return unsupported("no dequantizer for tensor type " + tensor_type_name(type));
  if (n % t->block_elems != 0)
    return invalid_argument("dequantize: " + std::to_string(n) + " elements is not a multiple of " +
                            tensor_type_name(type) + "'s block of " +
                            std::to_string(t->block_elems));
  const int64_t nb = n / t->block_elems;
  switch (static_cast<TensorType>(type)) {
    case TensorType::kF32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      break;
    case TensorType::kF16:
      convert_f16_to_f32(reinterpret_cast<const uint16_t*>(src), dst, static_cast<size_t>(n));
      break;
    case TensorType::kBF16:
      convert_bf16_to_f32(reinterpret_cast<const uint16_t*>(src), dst, static_cast<size_t>(n));
      break;
    default: {
      void (*fn)(const uint8_t*, float*) = nullptr;
      switch (static_cast<TensorType>(type)) {
        case TensorType::kQ4_0:
          fn = dq_q4_0;
          break;
        case TensorType::kQ4_1:
          fn = dq_q4_1;
          break;
        case TensorType::kQ5_0:
          fn = dq_q5_0;
          break;
        case TensorType::kQ5_1:
          fn = dq_q5_1;
          break;
        case TensorType::kQ8_0:
          fn = dq_q8_0;
          break;
        case TensorType::kQ4_K:
          fn = dq_q4_k;
          break;
        case TensorType::kQ5_K:
          fn = dq_q5_k;
          break;
        case TensorType::kQ6_K:
          fn = dq_q6_k;
          break;
        default:
          break;
      }
      KVQ_CHECK(fn != nullptr);  // the table says this type has a dequantizer
      for (int64_t i = 0; i < nb; ++i) fn(src + i * t->block_bytes, dst + i * t->block_elems);
    }
  }
  return ok_status();
}

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::kU8:
      return "u8";
    case ValueType::kI8:
      return "i8";
    case ValueType::kU16:
      return "u16";
    case ValueType::kI16:
      return "i16";
    case ValueType::kU32:
      return "u32";
    case ValueType::kI32:
      return "i32";
    case ValueType::kF32:
      return "f32";
    case ValueType::kBool:
      return "bool";
    case ValueType::kString:
      return "string";
    case ValueType::kArray:
      return "array";
    case ValueType::kU64:
      return "u64";
    case ValueType::kI64:
      return "i64";
    case ValueType::kF64:
      return "f64";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// Parsing

namespace {

// Size in bytes of a fixed-size value type; 0 for strings, arrays and unknown numbers.
size_t fixed_size(uint32_t t) {
  switch (static_cast<ValueType>(t)) {
    case ValueType::kU8:
    case ValueType::kI8:
    case ValueType::kBool:
      return 1;
    case ValueType::kU16:
    case ValueType::kI16:
      return 2;
    case ValueType::kU32:
    case ValueType::kI32:
    case ValueType::kF32:
      return 4;
    case ValueType::kU64:
    case ValueType::kI64:
    case ValueType::kF64:
      return 8;
    default:
      return 0;
  }
}

bool known_value_type(uint32_t t) { return t <= static_cast<uint32_t>(ValueType::kF64); }

class Parser {
 public:
  Parser(const uint8_t* data, size_t size) : r_(data, size) {}

  Status fail_eof(const std::string& what) const {
    return format_error("truncated file: " + what + " at byte " + std::to_string(r_.position()) +
                        " runs past the end (" + std::to_string(r_.position() + r_.remaining()) +
                        " bytes)");
  }

  Status u32(uint32_t& v, const char* what) { return r_.u32(v) ? ok_status() : fail_eof(what); }
  Status u64(uint64_t& v, const char* what) { return r_.u64(v) ? ok_status() : fail_eof(what); }

  Status string(std::string& s, const char* what) {
    uint64_t n = 0;
    KVQ_RETURN_IF_ERROR(u64(n, what));
    if (n > kMaxStringBytes)
      return limit_exceeded(std::string(what) + " at byte " + std::to_string(r_.position() - 8) +
                            " declares " + std::to_string(n) + " bytes (limit " +
                            std::to_string(kMaxStringBytes) + ")");
    const uint8_t* p;
    if (!r_.view(static_cast<size_t>(n), p)) return fail_eof(what);
    s.assign(reinterpret_cast<const char*>(p), static_cast<size_t>(n));
    return ok_status();
  }

  // Reads one scalar of fixed-size type t into v (integers to i/u, floats to f, bools to i).
  Status scalar(uint32_t t, Value& v, const std::string& key) {
    const size_t n = fixed_size(t);
    uint8_t buf[8] = {};
    if (!r_.bytes(buf, n)) return fail_eof("value of '" + key + "'");
    switch (static_cast<ValueType>(t)) {
      case ValueType::kU8:
        v.u = buf[0];
        v.i = buf[0];
        break;
      case ValueType::kI8:
        v.i = static_cast<int8_t>(buf[0]);
        break;
      case ValueType::kBool:
        if (buf[0] > 1) return corrupt("bool value of '" + key + "' is " + std::to_string(buf[0]));
        v.i = buf[0];
        v.u = buf[0];
        break;
      case ValueType::kU16: {
        uint16_t x;
        std::memcpy(&x, buf, 2);
        v.u = x;
        v.i = x;
        break;
      }
      case ValueType::kI16: {
        int16_t x;
        std::memcpy(&x, buf, 2);
        v.i = x;
        break;
      }
      case ValueType::kU32: {
        uint32_t x;
        std::memcpy(&x, buf, 4);
        v.u = x;
        v.i = x;
        break;
      }
      case ValueType::kI32: {
        int32_t x;
        std::memcpy(&x, buf, 4);
        v.i = x;
        break;
      }
      case ValueType::kF32: {
        float x;
        std::memcpy(&x, buf, 4);
        v.f = x;
        break;
      }
      case ValueType::kU64: {
        uint64_t x = 0;
        std::memcpy(&x, buf, 8);
        v.u = x;
        v.i = x > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                  ? std::numeric_limits<int64_t>::max()
                  : static_cast<int64_t>(x);
        break;
      }
      case ValueType::kI64: {
        int64_t x;
        std::memcpy(&x, buf, 8);
        v.i = x;
        break;
      }
      case ValueType::kF64: {
        double x;
        std::memcpy(&x, buf, 8);
        v.f = x;
        break;
      }
      default:
        KVQ_CHECK(false);
    }
    if (static_cast<ValueType>(t) == ValueType::kI8 ||
        static_cast<ValueType>(t) == ValueType::kI16 ||
        static_cast<ValueType>(t) == ValueType::kI32 ||
        static_cast<ValueType>(t) == ValueType::kI64)
      v.u = v.i >= 0 ? static_cast<uint64_t>(v.i) : 0;
    return ok_status();
  }

  Status value(uint32_t t, Value& v, const std::string& key, int depth) {
    if (!known_value_type(t))
      return format_error("metadata '" + key + "' has unknown value type " + std::to_string(t));
    v.type = static_cast<ValueType>(t);
    if (v.type == ValueType::kString) return string(v.s, ("string value of '" + key + "'").c_str());
    if (v.type != ValueType::kArray) return scalar(t, v, key);

    if (depth >= 4) return limit_exceeded("metadata '" + key + "': arrays nested too deeply");
    uint32_t et = 0;
    uint64_t count = 0;
    KVQ_RETURN_IF_ERROR(u32(et, "array element type"));
    KVQ_RETURN_IF_ERROR(u64(count, "array length"));
    if (!known_value_type(et))
      return format_error("metadata '" + key + "' is an array of unknown type " +
                          std::to_string(et));
    v.is_array = true;
    v.element_type = static_cast<ValueType>(et);
    v.count = count;
    // Every element takes at least this many bytes, so a count larger than the rest of the file
    // allows is rejected before anything is allocated.
    const size_t min_elem = fixed_size(et) ? fixed_size(et) : (et == 8 ? 8 : 12);
    if (count > r_.remaining() / min_elem)
      return format_error("metadata '" + key + "' declares " + std::to_string(count) +
                          " array elements, more than the " + std::to_string(r_.remaining()) +
                          " remaining bytes can hold");
    const auto et_v = static_cast<ValueType>(et);
    if (et_v == ValueType::kString) {
      v.strings.resize(static_cast<size_t>(count));
      for (auto& s : v.strings)
        KVQ_RETURN_IF_ERROR(string(s, ("element of '" + key + "'").c_str()));
    } else if (et_v == ValueType::kArray) {
      for (uint64_t i = 0; i < count; ++i) {  // kept only as validated bytes
        Value inner;
        KVQ_RETURN_IF_ERROR(value(et, inner, key, depth + 1));
      }
    } else if (et_v == ValueType::kF32 || et_v == ValueType::kF64) {
      v.floats.resize(static_cast<size_t>(count));
      Value e;
      for (auto& f : v.floats) {
        KVQ_RETURN_IF_ERROR(scalar(et, e, key));
        f = e.f;
      }
    } else {
      v.ints.resize(static_cast<size_t>(count));
      Value e;
      for (auto& x : v.ints) {
        KVQ_RETURN_IF_ERROR(scalar(et, e, key));
        if (et_v == ValueType::kU64 &&
            e.u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          return unsupported("metadata '" + key + "' holds a u64 element above 2^63-1");
        x = e.i;
      }
    }
    return ok_status();
  }

  ByteReader r_;
};

bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

Result<File> File::open(const std::string& path) {
  KVQ_ASSIGN_OR_RETURN(MappedFile m, MappedFile::open(path));
  File f;
  f.mapping_ = std::make_shared<MappedFile>(std::move(m));
  f.name_ = path;
  Status st = f.parse_impl(f.mapping_->data(), f.mapping_->size());
  if (!st.ok()) return st.with_context("reading GGUF '" + path + "'");
  return f;
}

Result<File> File::parse(const uint8_t* data, size_t size, std::string name) {
  File f;
  f.name_ = std::move(name);
  Status st = f.parse_impl(data, size);
  if (!st.ok()) return st.with_context("reading GGUF '" + f.name_ + "'");
  return f;
}

Status File::parse_impl(const uint8_t* data, size_t size) {
  Parser p(data, size);
  uint8_t magic[4];
  if (!p.r_.bytes(magic, 4) || std::memcmp(magic, "GGUF", 4) != 0)
    return format_error("not a GGUF file (the first 4 bytes are not \"GGUF\")");
  KVQ_RETURN_IF_ERROR(p.u32(version_, "version"));
  if (version_ == 1)
    return unsupported("GGUF version 1 (32-bit counts) is not supported; convert to v3");
  if (version_ != 2 && version_ != 3)
    return unsupported("GGUF version " + std::to_string(version_) + " (kvq reads 2 and 3)");
  uint64_t n_tensors = 0, n_kv = 0;
  KVQ_RETURN_IF_ERROR(p.u64(n_tensors, "tensor count"));
  KVQ_RETURN_IF_ERROR(p.u64(n_kv, "metadata count"));
  if (n_tensors > kMaxTensors)
    return limit_exceeded("file declares " + std::to_string(n_tensors) + " tensors (limit " +
                          std::to_string(kMaxTensors) + ")");
  if (n_kv > kMaxKeys)
    return limit_exceeded("file declares " + std::to_string(n_kv) + " metadata entries (limit " +
                          std::to_string(kMaxKeys) + ")");
  // Smallest possible entries: key (8 + 0) + type (4) + u8 value = 13; tensor info 8+4+8+4+8 = 32.
  if (n_kv > p.r_.remaining() / 13 || n_tensors > p.r_.remaining() / 32)
    return format_error("file declares " + std::to_string(n_kv) + " metadata entries and " +
                        std::to_string(n_tensors) + " tensors, more than its " +
                        std::to_string(size) + " bytes can hold");

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key;
    KVQ_RETURN_IF_ERROR(p.string(key, "metadata key"));
    uint32_t t = 0;
    KVQ_RETURN_IF_ERROR(p.u32(t, "metadata value type"));
    Value v;
    KVQ_RETURN_IF_ERROR(p.value(t, v, key, 0));
    if (kv_.count(key)) return corrupt("metadata key '" + key + "' appears twice");
    kv_.emplace(std::move(key), std::move(v));
  }

  if (const Value* a = find("general.alignment")) {
    if (a->is_array || a->type == ValueType::kString || a->type == ValueType::kF32 ||
        a->type == ValueType::kF64 || a->type == ValueType::kBool)
      return format_error("general.alignment is not an integer");
    if (a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > (1u << 20))
      return format_error("general.alignment " + std::to_string(a->i) +
                          " is not a power of two in [1, 2^20]");
    alignment_ = a->u;
  }

  tensors_.resize(static_cast<size_t>(n_tensors));
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo& ti = tensors_[static_cast<size_t>(i)];
    KVQ_RETURN_IF_ERROR(p.string(ti.name, "tensor name"));
    const std::string where = "tensor '" + ti.name + "'";
    uint32_t n_dims = 0;
    KVQ_RETURN_IF_ERROR(p.u32(n_dims, "tensor dimension count"));
    if (n_dims < 1 || n_dims > static_cast<uint32_t>(kMaxDims))
      return format_error(where + " has " + std::to_string(n_dims) + " dimensions (1 to " +
                          std::to_string(kMaxDims) + " allowed)");
    int64_t n_elem = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      uint64_t dim = 0;
      KVQ_RETURN_IF_ERROR(p.u64(dim, "tensor dimension"));
      if (dim == 0 || dim > (uint64_t{1} << 40))
        return format_error(where + " has dimension " + std::to_string(d) + " = " +
                            std::to_string(dim));
      ti.dims.push_back(static_cast<int64_t>(dim));
      if (mul_overflows(n_elem, static_cast<int64_t>(dim), &n_elem) || n_elem > (int64_t{1} << 48))
        return format_error(where + " has too many elements");
    }
    ti.n_elements = n_elem;
    KVQ_RETURN_IF_ERROR(p.u32(ti.type, "tensor type"));
    int64_t be = 0, bb = 0;
    if (!tensor_type_block(ti.type, &be, &bb))
      return unsupported(where + " has tensor type " + std::to_string(ti.type) +
                         ", unknown to kvq");
    if (ti.dims[0] % be != 0)
      return format_error(where + " (" + tensor_type_name(ti.type) + ") has a first dimension of " +
                          std::to_string(ti.dims[0]) + ", not a multiple of the block size " +
                          std::to_string(be));
    ti.n_bytes = static_cast<uint64_t>(n_elem / be) * static_cast<uint64_t>(bb);
    KVQ_RETURN_IF_ERROR(p.u64(ti.offset, "tensor offset"));
    if (ti.offset % alignment_ != 0)
      return format_error(where + " offset " + std::to_string(ti.offset) +
                          " is not a multiple of the alignment " + std::to_string(alignment_));
    if (tensor_index_.count(ti.name)) return corrupt("tensor name '" + ti.name + "' appears twice");
    tensor_index_.emplace(ti.name, static_cast<size_t>(i));
  }

  const uint64_t pos = p.r_.position();
  const uint64_t data_start = (pos + alignment_ - 1) / alignment_ * alignment_;
  if (data_start > size && n_tensors > 0)
    return format_error("truncated file: the data section would start at byte " +
                        std::to_string(data_start) + " of " + std::to_string(size));
  const uint64_t data_size = data_start <= size ? size - data_start : 0;
  for (auto& ti : tensors_) {
    if (ti.offset > data_size || ti.n_bytes > data_size - ti.offset)
      return format_error("truncated file: tensor '" + ti.name + "' needs bytes [" +
                          std::to_string(ti.offset) + ", " +
                          std::to_string(ti.offset + ti.n_bytes) + ") of a data section of " +
                          std::to_string(data_size) + " bytes");
    ti.data = data + data_start + ti.offset;
  }
  return ok_status();
}

const Value* File::find(std::string_view key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

namespace {
bool is_int_type(ValueType t) {
  switch (t) {
    case ValueType::kU8:
    case ValueType::kI8:
    case ValueType::kU16:
    case ValueType::kI16:
    case ValueType::kU32:
    case ValueType::kI32:
    case ValueType::kU64:
    case ValueType::kI64:
      return true;
    default:
      return false;
  }
}
bool is_unsigned_type(ValueType t) {
  return t == ValueType::kU8 || t == ValueType::kU16 || t == ValueType::kU32 ||
         t == ValueType::kU64;
}
}  // namespace

#define KVQ_GGUF_FIND(v, key)                                                     \
  const Value* v = find(key);                                                     \
  if (!v) return not_found("metadata key '" + std::string(key) + "' is missing"); \
  if (v->is_array)                                                                \
  return format_error("metadata '" + std::string(key) + "' is an array, expected a scalar")

Result<int64_t> File::get_int(std::string_view key) const {
  KVQ_GGUF_FIND(v, key);
  if (!is_int_type(v->type))
    return format_error("metadata '" + std::string(key) + "' is " + value_type_name(v->type) +
                        ", expected an integer");
  if (v->type == ValueType::kU64 &&
      v->u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return out_of_range("metadata '" + std::string(key) + "' is too large");
  return v->i;
}

Result<uint64_t> File::get_uint(std::string_view key) const {
  KVQ_GGUF_FIND(v, key);
  if (!is_int_type(v->type))
    return format_error("metadata '" + std::string(key) + "' is " + value_type_name(v->type) +
                        ", expected an integer");
  if (!is_unsigned_type(v->type) && v->i < 0)
    return out_of_range("metadata '" + std::string(key) + "' is negative (" + std::to_string(v->i) +
                        ")");
  return v->u;
}

Result<double> File::get_float(std::string_view key) const {
  KVQ_GGUF_FIND(v, key);
  if (v->type == ValueType::kF32 || v->type == ValueType::kF64) return v->f;
  if (is_int_type(v->type))
    return is_unsigned_type(v->type) ? static_cast<double>(v->u) : static_cast<double>(v->i);
  return format_error("metadata '" + std::string(key) + "' is " + value_type_name(v->type) +
                      ", expected a number");
}

Result<bool> File::get_bool(std::string_view key) const {
  KVQ_GGUF_FIND(v, key);
  if (v->type != ValueType::kBool)
    return format_error("metadata '" + std::string(key) + "' is " + value_type_name(v->type) +
                        ", expected a bool");
  return v->i != 0;
}

Result<std::string> File::get_string(std::string_view key) const {
  KVQ_GGUF_FIND(v, key);
  if (v->type != ValueType::kString)
    return format_error("metadata '" + std::string(key) + "' is " + value_type_name(v->type) +
                        ", expected a string");
  return v->s;
}

#undef KVQ_GGUF_FIND

Result<const std::vector<std::string>*> File::get_string_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return not_found("metadata key '" + std::string(key) + "' is missing");
  if (!v->is_array || v->element_type != ValueType::kString)
    return format_error("metadata '" + std::string(key) + "' is not an array of strings");
  return &v->strings;
}

Result<const std::vector<int64_t>*> File::get_int_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return not_found("metadata key '" + std::string(key) + "' is missing");
  if (!v->is_array || !(is_int_type(v->element_type) || v->element_type == ValueType::kBool))
    return format_error("metadata '" + std::string(key) + "' is not an array of integers");
  return &v->ints;
}

Result<const std::vector<double>*> File::get_float_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return not_found("metadata key '" + std::string(key) + "' is missing");
  if (!v->is_array || !(v->element_type == ValueType::kF32 || v->element_type == ValueType::kF64))
    return format_error("metadata '" + std::string(key) + "' is not an array of floats");
  return &v->floats;
}

namespace {
std::string dims_str(const std::vector<int64_t>& d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}
}  // namespace

Status File::read_f32(std::string_view name, const std::vector<int64_t>& expect_dims, float* out,
                      int64_t capacity) const {
  const TensorInfo* ti = find_tensor(name);
  if (!ti) return not_found("tensor '" + std::string(name) + "' is missing from " + name_);
  if (!expect_dims.empty() && ti->dims != expect_dims)
    return shape_mismatch("tensor '" + ti->name + "' has dims " + dims_str(ti->dims) +
                          ", expected " + dims_str(expect_dims));
  if (ti->n_elements > capacity)
    return shape_mismatch("tensor '" + ti->name + "' has " + std::to_string(ti->n_elements) +
                          " elements, room for " + std::to_string(capacity));
  Status st = dequantize_row(ti->type, ti->data, out, ti->n_elements);
  if (!st.ok()) return st.with_context("tensor '" + ti->name + "'");
  return ok_status();
}

Status File::read_f32(std::string_view name, const std::vector<int64_t>& expect_dims,
                      std::vector<float>* out) const {
  const TensorInfo* ti = find_tensor(name);
  if (!ti) return not_found("tensor '" + std::string(name) + "' is missing from " + name_);
  out->resize(static_cast<size_t>(ti->n_elements));
  return read_f32(name, expect_dims, out->data(), ti->n_elements);
}

}  // namespace kvq::gguf
