// kvq's rows of llama.cpp's block formats (src/methods/ggml_formats.cc), exposed for the kernel
// benchmarks (bench/kernels_bench.cc), which run them beside ggml's own row functions: n rows of
// D values each (D a multiple of 32) into ggml blocks, rotated first when rot > 0 (blocks of rot
// values; rot divides D), and back. The codec calls the same functions, one head vector per row.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvq::ggml_rows {

enum class Type { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kIq4Nl };

// Bytes of one ggml block of 32 values.
size_t block_bytes(Type t);
// rot > 0 needs D <= 4096.
void quantize(Type t, const float* x, int64_t n, int64_t D, int64_t rot, uint8_t* out);
void dequantize(Type t, const uint8_t* in, int64_t n, int64_t D, int64_t rot, float* out);

}  // namespace kvq::ggml_rows
