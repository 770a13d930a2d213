// 8-bit window rows (kvq's window=q8): one row is D values of one token and KV head, cut into
// blocks of G = 32 values (G = D when 32 does not divide D), each block stored as llama.cpp's
// q8_0 block is: an fp16 scale d (little-endian), then G int8 codes (two's complement),
//
//   d = fp16(absmax / 127), one fp16 step lower if 127 d would exceed 65504
//   code_i = clamp(round_half_even(x_i / d), -127, 127)   (0 when d == 0)
//   x_i ~ code_i * d
//
// so a row is D + 2 D / G bytes: 8.5 bits per value for G = 32. Every dequantized value is
// finite and within the fp16 range (|code * d| <= 127 d <= 65504), which sealing needs: the
// block codecs encode from these values. The scale is fp16 and the division is IEEE, so the
// codes are the same on every machine; a block whose absmax is below fp16's smallest subnormal
// times 127 (about 7.6e-6) stores d = 0 and reads back zeros.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvq/status.h"

namespace kvq {

// Values per scale of a row of D values: 32, or D when 32 does not divide it.
inline int64_t q8_row_group(int64_t D) { return D % 32 == 0 ? 32 : D; }
// Bytes of one row of D values.
inline size_t q8_row_bytes(int64_t D) { return static_cast<size_t>(D + 2 * (D / q8_row_group(D))); }
// x: D finite values with |x| <= 65504. row: q8_row_bytes(D) bytes.
void quantize_q8_row(const float* x, int64_t D, uint8_t* row);
void dequantize_q8_row(const uint8_t* row, int64_t D, float* out);
// Checks n rows of D values as a reader must (kCorrupt): every scale finite, not negative and
// with 127 d <= 65504; no code -128 (the encoder never writes it, so a row has one encoding).
Status validate_q8_rows(const uint8_t* rows, size_t n, int64_t D);

}  // namespace kvq
