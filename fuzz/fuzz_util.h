// Helpers shared by the fuzz targets: a consumer of fuzz bytes, and a check that aborts (which
// libFuzzer reports as a finding) when a property of the code under test does not hold.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define KVQ_FUZZ_CHECK(cond)                                                                  \
  do {                                                                                        \
    if (!(cond)) {                                                                            \
      std::fprintf(stderr, "fuzz property failed: %s at %s:%d\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                           \
    }                                                                                         \
  } while (0)

namespace kvq::fuzz {

// Takes values from the front of the input; past its end every value reads as zero.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint32_t u32() { return static_cast<uint32_t>(u16()) | static_cast<uint32_t>(u16()) << 16; }
  // LEB128, at most 10 bytes.
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      const uint8_t b = u8();
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  }
  // The next n bytes (fewer if the input ends first).
  const uint8_t* take(size_t n, size_t* got) {
    *got = n < size_ - pos_ ? n : size_ - pos_;
    const uint8_t* p = data_ + pos_;
    pos_ += *got;
    return p;
  }
  const uint8_t* rest(size_t* n) { return take(size_ - pos_, n); }
  size_t remaining() const { return size_ - pos_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace kvq::fuzz
