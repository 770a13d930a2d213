#include "kvq/bitpack.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>

#include "core/cpu.h"
#include "kvq/status.h"

#if KVQ_SIMD_X86
#include <immintrin.h>
#endif

namespace kvq {

void pack_bits_reference(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  KVQ_CHECK(bits >= 1 && bits <= 8);
  if (n == 0) return;  // out may be null for an empty stream (memset must not see it)
  std::memset(out, 0, packed_size(n, bits));
  const unsigned mask = (1u << bits) - 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned c = codes[i] & mask;
    for (int j = 0; j < bits; ++j) {
      const size_t k = i * static_cast<size_t>(bits) + static_cast<size_t>(j);
      out[k / 8] = static_cast<uint8_t>(out[k / 8] | (((c >> j) & 1u) << (k % 8)));
    }
  }
}

void unpack_bits_reference(const uint8_t* in, size_t n, int bits, uint8_t* codes) {
  KVQ_CHECK(bits >= 1 && bits <= 8);
  for (size_t i = 0; i < n; ++i) {
    unsigned c = 0;
    for (int j = 0; j < bits; ++j) {
      const size_t k = i * static_cast<size_t>(bits) + static_cast<size_t>(j);
      c |= ((in[k / 8] >> (k % 8)) & 1u) << j;
    }
    codes[i] = static_cast<uint8_t>(c);
  }
}

namespace {

// The packing loops are compiled once per SIMD level (core/cpu.h): pack_bits_body<L> and
// unpack_bits_body<L> below, and every helper they call inlines into them. L also picks the
// intrinsic paths (from kAvx2 on: SSE2 unpacking, BMI2 PDEP).

// Widths that divide 8: whole codes per byte, no code straddles a byte.
template <int B>
KVQ_ALWAYS_INLINE void pack_aligned(const uint8_t* codes, size_t n, uint8_t* out) {
  constexpr int kPer = 8 / B;
  constexpr unsigned kMask = (1u << B) - 1u;
  const size_t full = n / kPer;
  for (size_t i = 0; i < full; ++i) {
    unsigned byte = 0;
    for (int j = 0; j < kPer; ++j) byte |= (codes[i * kPer + j] & kMask) << (j * B);
    out[i] = static_cast<uint8_t>(byte);
  }
  if (full * kPer < n) {
    unsigned byte = 0;
    for (size_t j = 0; full * kPer + j < n; ++j)
      byte |= (codes[full * kPer + j] & kMask) << (j * B);
    out[full] = static_cast<uint8_t>(byte);
  }
}

template <int B>
KVQ_ALWAYS_INLINE void unpack_aligned(const uint8_t* in, size_t n, uint8_t* codes) {
  constexpr int kPer = 8 / B;
  constexpr unsigned kMask = (1u << B) - 1u;
  const size_t full = n / kPer;
  for (size_t i = 0; i < full; ++i) {
    const unsigned byte = in[i];
    for (int j = 0; j < kPer; ++j)
      codes[i * kPer + j] = static_cast<uint8_t>((byte >> (j * B)) & kMask);
  }
  for (size_t j = 0; full * kPer + j < n; ++j)
    codes[full * kPer + j] = static_cast<uint8_t>((in[full] >> (j * B)) & kMask);
}

// Any width: 8 codes make exactly `bits` bytes, so pack groups of 8 through a 64-bit word.
KVQ_ALWAYS_INLINE void pack_generic(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  const unsigned mask = (1u << bits) - 1u;
  const size_t groups = n / 8;
  for (size_t g = 0; g < groups; ++g) {
    uint64_t w = 0;
    for (int j = 0; j < 8; ++j) w |= static_cast<uint64_t>(codes[g * 8 + j] & mask) << (j * bits);
    for (int j = 0; j < bits; ++j) out[g * bits + j] = static_cast<uint8_t>(w >> (8 * j));
  }
  const size_t rest = n - groups * 8;
  if (rest) {
    uint64_t w = 0;
    for (size_t j = 0; j < rest; ++j)
      w |= static_cast<uint64_t>(codes[groups * 8 + j] & mask) << (j * static_cast<size_t>(bits));
    const size_t nbytes = (rest * static_cast<size_t>(bits) + 7) / 8;
    for (size_t j = 0; j < nbytes; ++j) out[groups * bits + j] = static_cast<uint8_t>(w >> (8 * j));
  }
}

KVQ_ALWAYS_INLINE void unpack_generic(const uint8_t* in, size_t n, int bits, uint8_t* codes) {
  const uint64_t mask = (1u << bits) - 1u;
  const size_t groups = n / 8;
  for (size_t g = 0; g < groups; ++g) {
    uint64_t w = 0;
    for (int j = 0; j < bits; ++j) w |= static_cast<uint64_t>(in[g * bits + j]) << (8 * j);
    for (int j = 0; j < 8; ++j) codes[g * 8 + j] = static_cast<uint8_t>((w >> (j * bits)) & mask);
  }
  const size_t rest = n - groups * 8;
  if (rest) {
    uint64_t w = 0;
    const size_t nbytes = (rest * static_cast<size_t>(bits) + 7) / 8;
    for (size_t j = 0; j < nbytes; ++j)
      w |= static_cast<uint64_t>(in[groups * bits + j]) << (8 * j);
    for (size_t j = 0; j < rest; ++j)
      codes[groups * 8 + j] = static_cast<uint8_t>((w >> (j * static_cast<size_t>(bits))) & mask);
  }
}

#if KVQ_SIMD_X86
// The groups of pack_fixed<B> below whose 8-byte store stays inside the output, by one PEXT each
// (BMI2): the low B bits of 8 code bytes are B packed bytes. Each store also writes 8 - B zero
// bytes past its group, which the next group (or the caller's last groups) overwrite. Returns
// the groups done.
template <int B>
KVQ_TARGET_AVX2 inline size_t pack_fixed_pext(const uint8_t* codes, size_t n, uint8_t* out) {
  constexpr uint64_t kGather = ((1u << B) - 1u) * 0x0101010101010101ull;  // low B bits per byte
  const size_t groups = n / 8;
  const size_t bytes = packed_size(n, B);
  const size_t wide = bytes >= 8 ? std::min(groups, (bytes - 8) / B + 1) : 0;
  for (size_t g = 0; g < wide; ++g) {
    uint64_t w;
    std::memcpy(&w, codes + g * 8, 8);
    const uint64_t packed = _pext_u64(w, kGather);  // x86 is little-endian
    std::memcpy(out + g * B, &packed, 8);
  }
  return wide;
}
#endif

// Widths that do not divide 8 (3, 5, 6, 7), known at compile time: 8 codes make B bytes (PEXT
// from the AVX2 level on while an 8-byte store stays inside the output).
template <int B, SimdLevel L>
KVQ_ALWAYS_INLINE void pack_fixed(const uint8_t* codes, size_t n, uint8_t* out) {
  constexpr uint64_t kMask = (1u << B) - 1u;
  const size_t groups = n / 8;
  size_t g = 0;
#if KVQ_SIMD_X86
  if constexpr (L >= SimdLevel::kAvx2) g = pack_fixed_pext<B>(codes, n, out);
#endif
  for (; g < groups; ++g) {
    uint64_t w = 0;
    for (int j = 0; j < 8; ++j) w |= (codes[g * 8 + j] & kMask) << (j * B);
    for (int j = 0; j < B; ++j) out[g * B + j] = static_cast<uint8_t>(w >> (8 * j));
  }
  if (const size_t done = groups * 8; done < n)
    pack_generic(codes + done, n - done, B, out + groups * B);
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void pack_bits_body(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  switch (bits) {
    case 1:
      return pack_aligned<1>(codes, n, out);
    case 2:
      return pack_aligned<2>(codes, n, out);
    case 3:
      return pack_fixed<3, L>(codes, n, out);
    case 4:
      return pack_aligned<4>(codes, n, out);
    case 5:
      return pack_fixed<5, L>(codes, n, out);
    case 6:
      return pack_fixed<6, L>(codes, n, out);
    case 7:
      return pack_fixed<7, L>(codes, n, out);
    case 8:
      if (n) std::memcpy(out, codes, n);
      return;  // n == 0 may come with null pointers
    default:
      return pack_generic(codes, n, bits, out);
  }
}

// Widths dividing 8: one table lookup expands a byte into its 8/B codes (little-endian order,
// so the table entry's bytes are the codes in stream order).
template <int B>
struct ExpandTable {
  static constexpr int kPer = 8 / B;
  using Word =
      std::conditional_t<kPer == 8, uint64_t, std::conditional_t<kPer == 4, uint32_t, uint16_t>>;
  Word entry[256];
  constexpr ExpandTable() : entry() {
    for (unsigned byte = 0; byte < 256; ++byte) {
      Word w = 0;
      for (int j = 0; j < kPer; ++j)
        w |= static_cast<Word>((byte >> (j * B)) & ((1u << B) - 1u)) << (8 * j);
      entry[byte] = w;
    }
  }
};

#if KVQ_SIMD_X86
// 16 packed bytes at a time for widths 2 and 4: mask out each code position, then interleave the
// bytes so that code j of byte i lands at output i * (8 / B) + j (the stream order). SSE2 only,
// but run from the AVX2 level on (compiled for it, so VEX-encoded) so that the scalar level
// stays free of intrinsics. Returns the bytes done.
template <int B>
KVQ_TARGET_AVX2 inline size_t unpack_sse2(const uint8_t* in, size_t bytes, uint8_t* codes) {
  const __m128i mask = _mm_set1_epi8(static_cast<char>((1 << B) - 1));
  size_t i = 0;
  for (; i + 16 <= bytes; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    if constexpr (B == 4) {
      const __m128i c0 = _mm_and_si128(b, mask), c1 = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * i), _mm_unpacklo_epi8(c0, c1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 2 * i + 16), _mm_unpackhi_epi8(c0, c1));
    } else {
      static_assert(B == 2);
      const __m128i c0 = _mm_and_si128(b, mask), c1 = _mm_and_si128(_mm_srli_epi16(b, 2), mask),
                    c2 = _mm_and_si128(_mm_srli_epi16(b, 4), mask),
                    c3 = _mm_and_si128(_mm_srli_epi16(b, 6), mask);
      const __m128i p01l = _mm_unpacklo_epi8(c0, c1), p01h = _mm_unpackhi_epi8(c0, c1);
      const __m128i p23l = _mm_unpacklo_epi8(c2, c3), p23h = _mm_unpackhi_epi8(c2, c3);
      __m128i* out = reinterpret_cast<__m128i*>(codes + 4 * i);
      _mm_storeu_si128(out + 0, _mm_unpacklo_epi16(p01l, p23l));
      _mm_storeu_si128(out + 1, _mm_unpackhi_epi16(p01l, p23l));
      _mm_storeu_si128(out + 2, _mm_unpacklo_epi16(p01h, p23h));
      _mm_storeu_si128(out + 3, _mm_unpackhi_epi16(p01h, p23h));
    }
  }
  return i;
}
#endif

template <int B, SimdLevel L>
KVQ_ALWAYS_INLINE void unpack_table(const uint8_t* in, size_t n, uint8_t* codes) {
  static constexpr ExpandTable<B> kTable;
  constexpr int kPer = ExpandTable<B>::kPer;
  const size_t full = n / kPer;
  size_t i = 0;
#if KVQ_SIMD_X86
  if constexpr ((B == 2 || B == 4) && L >= SimdLevel::kAvx2) i = unpack_sse2<B>(in, full, codes);
#endif
  for (; i < full; ++i) std::memcpy(codes + i * kPer, &kTable.entry[in[i]], kPer);
  unpack_aligned<B>(in + full, n - full * kPer, codes + full * kPer);
}

#if KVQ_SIMD_X86
// The groups of unpack_fixed<B> below whose 8-byte load stays inside the input, by one PDEP each
// (BMI2): one unaligned load per group; PDEP reads only its low 8 * B bits. Returns the groups
// done.
template <int B>
KVQ_TARGET_AVX2 inline size_t unpack_fixed_pdep(const uint8_t* in, size_t n, uint8_t* codes) {
  constexpr uint64_t kDeposit = ((1u << B) - 1u) * 0x0101010101010101ull;  // low B bits per byte
  const size_t groups = n / 8;
  const size_t bytes = packed_size(n, B);
  const size_t wide = bytes >= 8 ? std::min(groups, (bytes - 8) / B + 1) : 0;
  for (size_t g = 0; g < wide; ++g) {
    uint64_t w;
    std::memcpy(&w, in + g * B, 8);  // x86 is little-endian
    const uint64_t spread = _pdep_u64(w, kDeposit);
    std::memcpy(codes + g * 8, &spread, 8);
  }
  return wide;
}
#endif

// Widths that do not divide 8 (3, 5, 6, 7), with the width known at compile time: each group of
// 8 codes is B bytes, read as one little-endian word and spread to 8 bytes (PDEP from the AVX2
// level on while an 8-byte load stays inside the input; shifts for the last groups and at the
// scalar level).
template <int B, SimdLevel L>
KVQ_ALWAYS_INLINE void unpack_fixed(const uint8_t* in, size_t n, uint8_t* codes) {
  constexpr uint64_t kMask = (1u << B) - 1u;
  const size_t groups = n / 8;
  size_t g = 0;
#if KVQ_SIMD_X86
  if constexpr (L >= SimdLevel::kAvx2) g = unpack_fixed_pdep<B>(in, n, codes);
#endif
  for (; g < groups; ++g) {
    const uint8_t* p = in + g * B;
    uint64_t w = 0;
    for (int j = 0; j < B; ++j) w |= static_cast<uint64_t>(p[j]) << (8 * j);
    uint8_t* out = codes + g * 8;
    for (int j = 0; j < 8; ++j) out[j] = static_cast<uint8_t>((w >> (j * B)) & kMask);
  }
  if (const size_t done = groups * 8; done < n)
    unpack_generic(in + groups * B, n - done, B, codes + done);
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void unpack_bits_body(const uint8_t* in, size_t n, int bits, uint8_t* codes) {
  switch (bits) {
    case 1:
      return unpack_table<1, L>(in, n, codes);
    case 2:
      return unpack_table<2, L>(in, n, codes);
    case 3:
      return unpack_fixed<3, L>(in, n, codes);
    case 4:
      return unpack_table<4, L>(in, n, codes);
    case 5:
      return unpack_fixed<5, L>(in, n, codes);
    case 6:
      return unpack_fixed<6, L>(in, n, codes);
    case 7:
      return unpack_fixed<7, L>(in, n, codes);
    case 8:
      if (n) std::memcpy(codes, in, n);
      return;
    default:
      return unpack_generic(in, n, bits, codes);
  }
}

KVQ_LEVEL_CLONES(void, pack_bits, (const uint8_t* codes, size_t n, int bits, uint8_t* out),
                 (codes, n, bits, out))
KVQ_LEVEL_CLONES(void, unpack_bits, (const uint8_t* in, size_t n, int bits, uint8_t* codes),
                 (in, n, bits, codes))

}  // namespace

void pack_bits(const uint8_t* codes, size_t n, int bits, uint8_t* out) {
  KVQ_CHECK(bits >= 1 && bits <= 8);
  KVQ_LEVEL_DISPATCH(pack_bits, (codes, n, bits, out));
}

void unpack_bits(const uint8_t* in, size_t n, int bits, uint8_t* codes) {
  KVQ_CHECK(bits >= 1 && bits <= 8);
  KVQ_LEVEL_DISPATCH(unpack_bits, (in, n, bits, codes));
}

}  // namespace kvq
