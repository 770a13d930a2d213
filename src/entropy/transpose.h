// entropy/transpose.h — byte matrix transpose, the reordering between the symbol codec's
// token-major input ([n_tokens, n_channels]) and the channel-major order its rANS streams code.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::entropy {

// dst[c * rows + r] = src[r * cols + c] for r < rows, c < cols. src and dst must not overlap.
void transpose_bytes(const uint8_t* src, size_t rows, size_t cols, uint8_t* dst);
// The plain loop that defines it (tests compare the fast version with it).
void transpose_bytes_reference(const uint8_t* src, size_t rows, size_t cols, uint8_t* dst);

}  // namespace kvq::entropy
