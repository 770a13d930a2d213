// Little-endian byte writer and bounds-checked reader, shared by every format in kvq (entropy
// streams, the .kvq container, safetensors, GGUF). The reader never reads past its end: each
// read reports failure instead, so decoders of outside bytes cannot overrun.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/status.h"

namespace kvq {

class ByteWriter {
 public:
  explicit ByteWriter(std::vector<uint8_t>& out) : out_(out) {}
  void u8(uint8_t v) { out_.push_back(v); }
  void u16(uint16_t v) { put(&v, 2); }
  void u32(uint32_t v) { put(&v, 4); }
  void u64(uint64_t v) { put(&v, 8); }
  void f32(float v) { put(&v, 4); }
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }
  // LEB128 unsigned varint (7 bits a byte, low group first).
  void varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<uint8_t>(v | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<uint8_t>(v));
  }
  void zeros(size_t n) { out_.insert(out_.end(), n, 0); }
  size_t size() const { return out_.size(); }

 private:
  void put(const void* p, size_t n) {
    static_assert(std::endian::native == std::endian::little, "kvq assumes a little-endian host");
    bytes(p, n);
  }
  std::vector<uint8_t>& out_;
};

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  size_t remaining() const { return size_ - pos_; }
  size_t position() const { return pos_; }
  const uint8_t* cursor() const { return data_ + pos_; }

  bool u8(uint8_t& v) { return get(&v, 1); }
  bool u16(uint16_t& v) { return get(&v, 2); }
  bool u32(uint32_t& v) { return get(&v, 4); }
  bool u64(uint64_t& v) { return get(&v, 8); }
  bool f32(float& v) { return get(&v, 4); }
  bool bytes(void* p, size_t n) { return get(p, n); }
  bool skip(size_t n) {
    if (n > remaining()) return false;
    pos_ += n;
    return true;
  }
  // A view of the next n bytes, consumed.
  bool view(size_t n, const uint8_t*& p) {
    if (n > remaining()) return false;
    p = data_ + pos_;
    pos_ += n;
    return true;
  }
  // LEB128; rejects encodings longer than 10 bytes or overflowing 64 bits.
  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!u8(b)) return false;
      if (shift == 63 && (b & 0x7e)) return false;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }

 private:
  bool get(void* p, size_t n) {
    if (n > remaining()) return false;
    std::memcpy(p, data_ + pos_, n);
    pos_ += n;
    return true;
  }
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace kvq
