// kvq/bitpack.h — packing b-bit codes (b in 1..8) into bytes.
//
// Stored layout (normative; see docs/format.md): the codes form one little-endian bit stream.
// Code i occupies stream bits [i*b, (i+1)*b), its least significant bit first, and stream bit k
// is bit (k % 8) of byte k / 8. Unused high bits of the last byte are zero. The layout never
// depends on the host or on SIMD width; fast paths are tested bit-exact against the reference.
//
// Example, b = 3, codes {5, 2, 7}: stream bits 0..8 are 1,0,1 | 0,1,0 | 1,1,1, so
// byte 0 = 0b11'010'101 = 0xD5 and byte 1 = 0x01.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq {

// Bytes needed for n codes of `bits` bits: ceil(n * bits / 8).
constexpr size_t packed_size(size_t n, int bits) { return (n * static_cast<size_t>(bits) + 7) / 8; }

// Packs n codes (each < 2^bits; higher bits are ignored) into out[packed_size(n, bits)].
// bits must be in 1..8 (checked; a violation is a kvq bug and aborts).
void pack_bits(const uint8_t* codes, size_t n, int bits, uint8_t* out);
// Unpacks n codes from in[packed_size(n, bits)] into codes[n].
void unpack_bits(const uint8_t* in, size_t n, int bits, uint8_t* codes);

// Plain one-code-at-a-time versions that define the layout; the fast versions above must match
// them bit for bit.
void pack_bits_reference(const uint8_t* codes, size_t n, int bits, uint8_t* out);
void unpack_bits_reference(const uint8_t* in, size_t n, int bits, uint8_t* codes);

}  // namespace kvq
