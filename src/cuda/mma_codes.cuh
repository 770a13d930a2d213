// Packed codes into tensor-core operands: byte permutes, the magic-number conversion of codes to
// fp16 (exact), fp16 dequantization, and the fast 2^x, shared by the decode kernels of KIVI
// (attend_fast.cu) and ZipCache (attend_zip.cu).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_common.cuh"

namespace kvq::cuda {

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
// (a & b) | c in one LOP3 (the compiler otherwise emits two for these constant operands).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ uint32_t h2_as_u32(__half2 h) {
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ __half2 u32_as_h2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// Magic-number conversion of packed codes. A B-bit code at bit p' (p' + B <= 10) of each 16-bit
// half, ORed into the fp16 number M = 2^(10 - p') (mantissa zero), reads as M + code exactly.
// A code at bit p of a half is first moved to such a p' by one shift of the whole word
// (land_*), the same shift serving every code of the word that lands in range; bits that cross
// into the other half are masked away.
//   land_exact: any p' (M up to 1024), for codes that are then made exact by subtracting M;
//   land_fold:  p' >= min(4, 10 - B) (M <= 64 at 2 and 4 bits), for key codes that go into the
//               dot product as M + code, M's share removed afterwards by one product with M
//               (small M keeps that cancellation far below the fp16 roundings).
template <int B>
__host__ __device__ constexpr int land_exact(int p) {
  return p + B <= 10 ? 0 : -8;
}
template <int B>
__host__ __device__ constexpr int land_fold(int p) {
  constexpr int lo = 10 - B < 4 ? 10 - B : 4;
  if (p >= lo && p + B <= 10) return 0;
  if (p < lo) return lo;
  return B == 2 ? -6 : -(p - lo);
}
// (Shift amounts and positions below are compile-time constants once the loops are unrolled.)
__device__ __forceinline__ uint32_t shifted(uint32_t x, int sh) {
  return sh >= 0 ? x << sh : x >> -sh;
}
// half2 (M, M) for codes at bit p' of each half: M = 2^(10 - p'), biased exponent 25 - p'.
__host__ __device__ constexpr uint32_t magic_at(int pl) {
  return static_cast<uint32_t>(25 - pl) * 0x04000400u;
}
template <int B>
__host__ __device__ constexpr uint32_t mask_at(int pl) {
  return (((1u << B) - 1u) << pl) * 0x00010001u;
}
// The pair of B-bit codes at bit p of each half of x, as half2 (M + c0, M + c1), M = magic_at(p').
template <int B>
__device__ __forceinline__ uint32_t codes_at(uint32_t x, int p, int sh) {
  return and_or(shifted(x, sh), mask_at<B>(p + sh), magic_at(p + sh));
}
// Two fp16 values halved (exact but for subnormals). The tensor-core decode kernels' value
// operands are half the values (for the fp16 window: the probabilities are halved instead) and
// their outputs are doubled: with the scale
// rounded outward, the top code of a group that reaches 65504 dequantizes past it (2 bits over
// [0, 65504]: 3 * 21840 = 65520, infinity in fp16, finite in the CPU's fp32), and a cst value
// times its channel divisor can pass it by its quantization error; halved, both stay finite and
// exact (up to 131008).
__device__ __forceinline__ uint32_t half_f16x2(uint32_t x) {
  return h2_as_u32(__hmul2(u32_as_h2(x), __float2half2_rn(0.5f)));
}

// code pair (M + c0, M + c1) and halved zeros -> (c0 * s + z) / 2, (c1 * s' + z') / 2 (fp16, one
// rounding each): the codes are halved exactly ((M + c) / 2 - M / 2), not the scale, which may be
// subnormal (an 8-bit group narrower than ~0.016) and would lose a bit; z2 holds z / 2.
__device__ __forceinline__ uint32_t dequant2_half(uint32_t magic_codes, uint32_t magic,
                                                  uint32_t s2, uint32_t z2_half) {
  const __half2 c = __hfma2(u32_as_h2(magic_codes), __float2half2_rn(0.5f),
                            __hmul2(u32_as_h2(magic), __float2half2_rn(-0.5f)));
  return h2_as_u32(__hfma2(c, u32_as_h2(s2), u32_as_h2(z2_half)));
}

// Two bf16 values -> two fp16 values, saturated to +-65504: a value the append accepted (|x| <=
// 65504) may round up to 65536 in bf16, which is not an fp16 number.
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t u) {
  return h2_as_u32(__floats2half2_rn(sat_f16_range(__uint_as_float(u << 16)),
                                     sat_f16_range(__uint_as_float(u & 0xffff0000u))));
}

// W words of a window page row (two fp16 values each, bf16 windows converted): token tok's keys
// or values from column col on (16-byte aligned), zeros at or past the layer's offset.
template <int W>
__device__ __forceinline__ void window_words(const LayerDesc& L, bool keys, int64_t s, int64_t tok,
                                             int col, uint32_t (&u)[W]) {
  if (tok < L.offset) {
    const uint4* src = reinterpret_cast<const uint4*>(page_row(L, keys, s, tok) + col);
#pragma unroll
    for (int x = 0; x < W / 4; ++x) {
      const uint4 v = src[x];
      u[4 * x] = v.x, u[4 * x + 1] = v.y, u[4 * x + 2] = v.z, u[4 * x + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int x = 0; x < W; ++x) u[x] = 0;
  }
  if (L.bf16_window) {
#pragma unroll
    for (int x = 0; x < W; ++x) u[x] = bf16x2_to_f16x2(u[x]);
  }
}

// A window's values for the value products of the decode kernels: tokens j0 + 2t + (r & 1) +
// 8 (r >> 1) (r = 0..3), this lane's D/8 dims from g D/8 on.
template <int D>
__device__ __forceinline__ void window_value_rows(const LayerDesc& L, int64_t s, int64_t j0, int g,
                                                  int t, uint32_t (&u)[4][D / 16]) {
#pragma unroll
  for (int r = 0; r < 4; ++r)
    window_words<D / 16>(L, false, s, j0 + 2 * t + (r & 1) + (r >> 1) * 8, g * (D / 8), u[r]);
}

__device__ __forceinline__ uint32_t lds32(const uint8_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// 2^x by the special-function unit (ex2.approx.ftz: about 2 ulp, subnormal results flushed to
// zero; 2^-inf = 0), without exp2f's range handling.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace kvq::cuda
