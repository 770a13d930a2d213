#include "entropy/transpose.h"

#include "core/cpu.h"

#if KVQ_SIMD_X86
#include <emmintrin.h>
#endif

namespace kvq::entropy {

void transpose_bytes_reference(const uint8_t* src, size_t rows, size_t cols, uint8_t* dst) {
  for (size_t r = 0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

namespace {

#if KVQ_SIMD_X86
// One 16 x 16 tile: four rounds of interleaving row i with row i + 8 (a perfect shuffle of the
// rows' bytes) turn rows into columns. SSE2, run from the AVX2 level on (core/cpu.h).
KVQ_TARGET_AVX2 inline void tile16(const uint8_t* src, size_t src_stride, uint8_t* dst,
                                   size_t dst_stride) {
  __m128i a[16], b[16];
  for (int i = 0; i < 16; ++i)
    a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * src_stride));
  for (int round = 0; round < 4; ++round) {
    for (int i = 0; i < 8; ++i) {
      b[2 * i] = _mm_unpacklo_epi8(a[i], a[i + 8]);
      b[2 * i + 1] = _mm_unpackhi_epi8(a[i], a[i + 8]);
    }
    for (int i = 0; i < 16; ++i) a[i] = b[i];
  }
  for (int i = 0; i < 16; ++i)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i * dst_stride), a[i]);
}

// The whole 16-row bands: tiles, then the last cols % 16 columns of those rows. Returns the rows
// done.
KVQ_TARGET_AVX2 size_t transpose_tiles(const uint8_t* src, size_t rows, size_t cols, uint8_t* dst) {
  const size_t rt = rows / 16 * 16, ct = cols / 16 * 16;
  for (size_t r0 = 0; r0 < rt; r0 += 16)
    for (size_t c0 = 0; c0 < ct; c0 += 16)
      tile16(src + r0 * cols + c0, cols, dst + c0 * rows + r0, rows);
  for (size_t r = 0; r < rt; ++r)
    for (size_t c = ct; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  return rt;
}
#endif

}  // namespace

void transpose_bytes(const uint8_t* src, size_t rows, size_t cols, uint8_t* dst) {
  size_t r0 = 0;
#if KVQ_SIMD_X86
  if (simd_level() >= SimdLevel::kAvx2) r0 = transpose_tiles(src, rows, cols, dst);
#endif
  // The rows left (all of them at the scalar level): the last rows % 16.
  for (size_t r = r0; r < rows; ++r)
    for (size_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace kvq::entropy
