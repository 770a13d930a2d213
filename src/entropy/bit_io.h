// entropy/bit_io.h — LSB-first bit writer and bounds-checked bit reader.
//
// Bit order (normative for every bit-level structure in docs/entropy.md): stream bit k is bit
// (k % 8) of byte k / 8, and a value of n bits is written least significant bit first, the same
// order as kvq/bitpack.h. A reader never reads past its end: a read that would overrun returns
// false and leaves the reader failed, so decoders of untrusted bytes cannot overrun.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvq/status.h"

namespace kvq::entropy {

class BitWriter {
 public:
  explicit BitWriter(std::vector<uint8_t>& out) : out_(out) {}

  // Bits still in the accumulator are lost unless flush() is called.

  // Appends the low `n` bits of `v` (n in 0..32). Bits collect in a 64-bit accumulator that is
  // spilled 4 bytes at a time (writers emit many short fields: tables, states).
  void put(uint32_t v, int n) {
    KVQ_CHECK(n >= 0 && n <= 32);
    if (fill_ >= 32) spill32();
    acc_ |= static_cast<uint64_t>(v & static_cast<uint32_t>((uint64_t{1} << n) - 1)) << fill_;
    fill_ += n;
    bits_ += static_cast<size_t>(n);
  }
  // Appends the first `nbits` bits of an LSB-first bit string (e.g. one written by another
  // BitWriter).
  void put_bits(const uint8_t* src, size_t nbits) {
    size_t i = 0;
    if (fill_ == 0 && nbits >= 8) {  // byte aligned: whole bytes go in one copy
      const size_t whole = nbits / 8;
      out_.insert(out_.end(), src, src + whole);
      bits_ += 8 * whole;
      i = whole;
    }
    for (; 8 * i + 8 <= nbits; ++i) put(src[i], 8);
    if (8 * i < nbits) put(src[i], static_cast<int>(nbits - 8 * i));
  }
  // Pads with zero bits to the next byte boundary and writes everything out.
  void flush() {
    while (fill_ > 0) {
      out_.push_back(static_cast<uint8_t>(acc_));
      acc_ >>= 8;
      if (fill_ < 8) bits_ += static_cast<size_t>(8 - fill_);
      fill_ = fill_ > 8 ? fill_ - 8 : 0;
    }
    acc_ = 0;
  }
  // Bits written so far (including padding added by flush()).
  size_t bits() const { return bits_; }

 private:
  void spill32() {
    const size_t at = out_.size();
    out_.resize(at + 4);
    const uint32_t lo = static_cast<uint32_t>(acc_);
    std::memcpy(out_.data() + at, &lo, 4);  // little-endian host (core/byte_io.h asserts it)
    acc_ >>= 32;
    fill_ -= 32;
  }

  std::vector<uint8_t>& out_;
  uint64_t acc_ = 0;
  int fill_ = 0;
  size_t bits_ = 0;
};

class BitReader {
 public:
  BitReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  // Reads `n` bits (0..32) into v. False on overrun (the reader stays failed).
  bool get(int n, uint32_t& v) {
    v = 0;
    if (failed_) return false;
    if (n == 0) return true;
    if (static_cast<size_t>(n) > size_ * 8 - pos_) {
      failed_ = true;
      return false;
    }
    uint64_t acc = 0;
    const size_t first = pos_ / 8;
    if (first + 8 <= size_) {  // fast path: one unaligned 8-byte load covers <= 39 bits
      std::memcpy(&acc, data_ + first, 8);  // little-endian host (core/byte_io.h asserts it)
    } else {
      const size_t last = (pos_ + static_cast<size_t>(n) - 1) / 8;
      for (size_t b = last + 1; b-- > first;) acc = (acc << 8) | data_[b];
    }
    acc >>= pos_ % 8;
    v = static_cast<uint32_t>(n == 32 ? acc : (acc & ((uint64_t{1} << n) - 1)));
    pos_ += static_cast<size_t>(n);
    return true;
  }
  bool bit(uint32_t& v) { return get(1, v); }

  // Consumes the padding up to the next byte boundary; false if any padding bit is set (a
  // canonical stream pads with zeros, so set bits mean corruption).
  bool finish_byte() {
    if (failed_) return false;
    const int pad = static_cast<int>((8 - pos_ % 8) % 8);
    uint32_t v;
    if (!get(pad, v)) return false;
    return v == 0;
  }
  size_t bit_position() const { return pos_; }
  size_t byte_position() const { return (pos_ + 7) / 8; }
  bool failed() const { return failed_; }
  // For readers that keep their own bit buffer (entropy/freq_table.cc): the underlying bytes,
  // and a jump forward to `bit_pos` (false, and failed, if beyond the end).
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  bool seek(size_t bit_pos) {
    if (failed_ || bit_pos > size_ * 8) {
      failed_ = true;
      return false;
    }
    pos_ = bit_pos;
    return true;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
  bool failed_ = false;
};

}  // namespace kvq::entropy
