// Device helpers shared by the CUDA backend's kernels: element loads and stores, the window's
// 16-bit types, and kvq's group quantization rules (kvq/group_quant.h) restated with
// explicitly rounded operations (__fadd_rn, __fmul_rn, __fdiv_rn, rintf), so that no
// contraction into FMA or approximate division can make a stored byte differ from the CPU's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/kernels.h"
#include "cuda/split_rules.h"

namespace kvq::cuda {

constexpr float kF16MaxDev = 65504.0f;

// x clamped to fp16's finite range, +-65504 (a NaN stays a NaN).
__device__ __forceinline__ float sat_f16_range(float x) {
  return x < -kF16MaxDev ? -kF16MaxDev : (kF16MaxDev < x ? kF16MaxDev : x);
}

// The exponent e >= 0 of the power of two that brings a row's largest |x| below `limit`
// (x 2^-e < limit): `mx` is this lane's share of a row held by four lanes (a quad: lanes 4g ..
// 4g + 3, as in an mma fragment). 0 when the row is within the limit, not finite, or at 2^126 or
// more (left as it is). The query scaling of the decode and chunk kernels.
__device__ __forceinline__ int quad_scale_exponent(float mx, float limit) {
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  int e = 0;
  if (mx > limit && mx < 0x1p126f) frexpf(mx / limit, &e);
  return e;
}
// 2^e, exact, for |e| <= 126.
__device__ __forceinline__ float exp2_int(int e) { return __int_as_float((127 + e) << 23); }

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a < b ? b : a; }
constexpr float kScaleEpsDev = 5.9604644775390625e-8f;  // 2^-24, kvq::kScaleEps

__device__ __forceinline__ float load_elem(const void* p, int dtype, int64_t i) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  if (dtype == 1) return __half2float(__ushort_as_half(bits));
  return __bfloat162float(__ushort_as_bfloat16(bits));
}

__device__ __forceinline__ void store_elem(void* p, int dtype, int64_t i, float v) {
  if (dtype == 0) {
    static_cast<float*>(p)[i] = v;
  } else if (dtype == 1) {
    static_cast<uint16_t*>(p)[i] = __half_as_ushort(__float2half_rn(v));
  } else {
    static_cast<uint16_t*>(p)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
}

__device__ __forceinline__ int64_t offset_of(const DevTensor& t, int64_t b, int64_t h, int64_t s,
                                             int64_t d) {
  return b * t.s0 + h * t.s1 + s * t.s2 + d * t.s3;
}

__device__ __forceinline__ float window_to_f32(uint16_t bits, int bf16) {
  return bf16 ? __bfloat162float(__ushort_as_bfloat16(bits)) : __half2float(__ushort_as_half(bits));
}
// Round to nearest even, as the CPU window stores it (f32_to_f16 / f32_to_bf16).
__device__ __forceinline__ uint16_t f32_to_window(float x, int bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}

// ---- group quantization (kvq/group_quant.h), bit for bit ----
__device__ __forceinline__ float f16_val(uint16_t h) { return __half2float(__ushort_as_half(h)); }
__device__ __forceinline__ uint16_t f16_round_down(float x) {
  uint16_t h = __half_as_ushort(__float2half_rn(x));
  if (f16_val(h) > x) {
    if ((h & 0x7fffu) == 0) return 0x8001;
    h = (h & 0x8000u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h - 1);
  }
  return h;
}
__device__ __forceinline__ uint16_t f16_round_up(float x) {
  uint16_t h = __half_as_ushort(__float2half_rn(x));
  if (f16_val(h) < x) {
    if ((h & 0x7fffu) == 0) return 0x0001;
    h = (h & 0x8000u) ? static_cast<uint16_t>(h - 1) : static_cast<uint16_t>(h + 1);
  }
  return h;
}
// fit_range: zero = largest fp16 <= lo, scale = smallest fp16 >= max((hi - zero) / qmax, eps).
__device__ __forceinline__ void fit_range(float lo, float hi, int bits, uint16_t& scale,
                                          uint16_t& zero) {
  const float qmax = static_cast<float>((1 << bits) - 1);
  zero = f16_round_down(lo);
  const float q = __fdiv_rn(__fsub_rn(hi, f16_val(zero)), qmax);
  const float s = q < kScaleEpsDev ? kScaleEpsDev : q;  // std::max(q, eps)
  scale = s >= kF16MaxDev ? static_cast<uint16_t>(0x7bff) : f16_round_up(s);
}
// code = clamp(round_half_even((x - zero) * inv), 0, qmax), inv = 1 / scale.
__device__ __forceinline__ uint32_t quantize(float x, float zero, float inv, float qmax) {
  float q = rintf(__fmul_rn(__fsub_rn(x, zero), inv));
  q = q < 0.0f ? 0.0f : (qmax < q ? qmax : q);  // std::clamp
  return static_cast<uint32_t>(q);
}
__device__ __forceinline__ float dequantize(uint32_t code, float scale, float zero) {
  return __fadd_rn(zero, __fmul_rn(static_cast<float>(code), scale));
}

// Parameters are fp16 {scale, zero} pairs at any byte offset: read and written bytewise.
__device__ __forceinline__ void load_params(const uint8_t* p, float& scale, float& zero) {
  scale = f16_val(static_cast<uint16_t>(p[0] | (p[1] << 8)));
  zero = f16_val(static_cast<uint16_t>(p[2] | (p[3] << 8)));
}
// load_params from a 4-byte aligned address: one 32-bit load instead of four byte loads.
__device__ __forceinline__ void load_params_aligned(const uint8_t* p, float& scale, float& zero) {
  const uint32_t w = __ldg(reinterpret_cast<const uint32_t*>(p));
  scale = f16_val(static_cast<uint16_t>(w & 0xffffu));
  zero = f16_val(static_cast<uint16_t>(w >> 16));
}
__device__ __forceinline__ void store_params(uint8_t* p, uint16_t scale, uint16_t zero) {
  p[0] = static_cast<uint8_t>(scale);
  p[1] = static_cast<uint8_t>(scale >> 8);
  p[2] = static_cast<uint8_t>(zero);
  p[3] = static_cast<uint8_t>(zero >> 8);
}

// Code i of a packed little-endian bit stream of `bits`-bit codes (kvq/bitpack.h). A code spans
// at most two bytes; the second is read only when it does.
__device__ __forceinline__ uint32_t code_at(const uint8_t* codes, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const int sh = static_cast<int>(bit & 7);
  uint32_t w = codes[bit >> 3];
  if (sh + bits > 8) w |= static_cast<uint32_t>(codes[(bit >> 3) + 1]) << 8;
  return (w >> sh) & ((1u << bits) - 1u);
}

// ---- ZipCache's block layout (src/methods/zipcache.cc) ----
// Token tt's row in its subset (salient rows first, then the others, each in position order)
// from the stream's key record: the set mask bits before it, or the clear ones.
__device__ __forceinline__ int64_t zip_subset_row(const uint8_t* krec, int64_t tt, bool& salient) {
  int64_t before = 0;
  for (int64_t i = 0; i < (tt >> 3); ++i) before += __popc(krec[i]);
  const uint32_t byte = krec[tt >> 3];
  before += __popc(byte & ((1u << (tt & 7)) - 1u));
  salient = (byte >> (tt & 7)) & 1u;
  return salient ? before : tt - before;
}
// hi codes step by scale * (qmax_lo / qmax_hi) when the pair is shared (fit for lo bits).
__device__ __forceinline__ float zip_hi_ratio(const LayerDesc& L) {
  return __fdiv_rn(static_cast<float>((1 << L.lo_bits) - 1),
                   static_cast<float>((1 << L.hi_bits) - 1));
}
// A stream's key row tt, resolved once: codes, bits and the pair of each channel.
struct ZipKeyRow {
  const uint8_t* codes;
  const uint8_t* pairs;
  int64_t row;
  int bits;
  float mult;  // the shared pair's hi step (1: the stored scale)
};
__device__ __forceinline__ ZipKeyRow zip_key_row(const LayerDesc& L, int64_t blk, int64_t s,
                                                 int64_t tt) {
  const uint8_t* kr = L.blocks[blk].k + s * L.zkrec;
  bool hi;
  ZipKeyRow r;
  r.row = zip_subset_row(kr, tt, hi);
  r.bits = hi ? L.hi_bits : L.lo_bits;
  r.codes = kr + L.zmask + (hi ? 0 : L.zkhi);
  r.pairs = kr + L.zmask + L.zkhi + L.zklo;
  r.mult = 1.0f;
  if (L.zshared) {
    if (hi) r.mult = zip_hi_ratio(L);
  } else if (!hi && L.n_h > 0) {
    r.pairs += 4 * L.D;
  }
  return r;
}
__device__ __forceinline__ float zip_key_elem(const LayerDesc& L, const ZipKeyRow& r, int64_t d) {
  float sc, z;
  load_params(r.pairs + 4 * d, sc, z);
  if (L.zshared) sc = __fmul_rn(sc, r.mult);
  return dequantize(code_at(r.codes, r.row * L.D + d, r.bits), sc, z);
}
// A stream's value row tt, resolved once: uniform values are in position order at hi bits;
// routed and cst ones in subset order at each subset's bits (cst: times the channel divisors).
struct ZipValueRow {
  const uint8_t* codes;
  const uint8_t* pairs;  // the row's pairs, one per run of vgroup channels
  const uint8_t* cst;    // the channel divisors, or null
  int64_t row;
  int bits;
};
__device__ __forceinline__ ZipValueRow zip_value_row(const LayerDesc& L, int64_t blk, int64_t s,
                                                     int64_t tt) {
  const uint8_t* vr = L.blocks[blk].v + s * L.zvrec;
  ZipValueRow r;
  r.cst = nullptr;
  if (L.zvalues == 0) {
    r.codes = vr;
    r.row = tt;
    r.bits = L.hi_bits;
    r.pairs = vr + L.zvcodes + tt * L.ng * 4;
    return r;
  }
  bool hi;
  r.row = zip_subset_row(L.blocks[blk].k + s * L.zkrec, tt, hi);
  r.codes = hi ? vr : vr + L.zvhi;
  r.bits = hi ? L.hi_bits : L.lo_bits;
  r.pairs = vr + L.zvcodes + (hi ? r.row : L.n_h + r.row) * L.ng * 4;
  if (L.zvalues == 2) r.cst = vr + L.zvcodes + L.zvparams;
  return r;
}
__device__ __forceinline__ float zip_value_elem(const LayerDesc& L, const ZipValueRow& r,
                                                int64_t d) {
  float sc, z;
  load_params(r.pairs + (d / L.vgroup) * 4, sc, z);
  const float x = dequantize(code_at(r.codes, r.row * L.D + d, r.bits), sc, z);
  if (!r.cst) return x;
  return __fmul_rn(x, f16_val(static_cast<uint16_t>(r.cst[2 * d] | (r.cst[2 * d + 1] << 8))));
}
__device__ __forceinline__ float zip_value(const LayerDesc& L, int64_t blk, int64_t s, int64_t tt,
                                           int64_t d) {
  return zip_value_elem(L, zip_value_row(L, blk, s, tt), d);
}

// Sealed key / value (d) of token tt of block blk, stream s, dequantized as the CPU codec does.
// An XQuant reuse block (L.xq == 2): its pairs on its anchor's codes, plus its residual
// (zero + code * scale each, summed in fp32 as xquant.cc's decode() does).
__device__ __forceinline__ float sealed_key(const LayerDesc& L, int64_t blk, int64_t s, int64_t tt,
                                            int64_t d) {
  if (L.zip) return zip_key_elem(L, zip_key_row(L, blk, s, tt), d);
  const uint8_t* part = L.blocks[blk].k;
  float sc, z;
  if (L.xq == 2) {
    load_params(part + s * L.kparam + d * 4, sc, z);
    float x = dequantize(code_at(L.links[blk].k + s * L.kcode, tt * L.D + d, L.k_bits), sc, z);
    if (L.r_bits) {
      load_params(part + L.S() * (L.kparam + L.rcode) + s * L.kparam + d * 4, sc, z);
      x = __fadd_rn(
          x, dequantize(code_at(part + L.S() * L.kparam + s * L.rcode, tt * L.D + d, L.r_bits), sc,
                        z));
    }
    return x;
  }
  load_params(part + L.S() * L.kcode + s * L.kparam + d * 4, sc, z);
  return dequantize(code_at(part + s * L.kcode, tt * L.D + d, L.k_bits), sc, z);
}
__device__ __forceinline__ float sealed_value(const LayerDesc& L, int64_t blk, int64_t s,
                                              int64_t tt, int64_t d) {
  if (L.zip) return zip_value(L, blk, s, tt, d);
  const uint8_t* part = L.blocks[blk].v;
  const int64_t e = (tt * L.ng + d / L.vgroup) * 4;
  float sc, z;
  if (L.xq == 2) {
    load_params(part + s * L.vparam + e, sc, z);
    float x = dequantize(code_at(L.links[blk].v + s * L.vcode, tt * L.D + d, L.v_bits), sc, z);
    if (L.r_bits) {
      load_params(part + L.S() * (L.vparam + L.rcode) + s * L.vparam + e, sc, z);
      x = __fadd_rn(
          x, dequantize(code_at(part + L.S() * L.vparam + s * L.rcode, tt * L.D + d, L.r_bits), sc,
                        z));
    }
    return x;
  }
  load_params(part + L.S() * L.vcode + s * L.vparam + e, sc, z);
  return dequantize(code_at(part + s * L.vcode, tt * L.D + d, L.v_bits), sc, z);
}

// C += A B on the tensor cores: mma.sync m16n8k16, fp16 A (4 registers: rows g, g + 8 x
// columns 2t, 2t + 1, + 8) and B (2 registers), fp32 C [4] (PTX ISA's fragment layouts; sm_80+).
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// cp.async (sm_80+): copies into shared memory that complete asynchronously, in commit groups.
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() {  // until at most N of this thread's groups are pending
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}
// One warp copies [src, src + n) to shared memory at dst (a 16-byte aligned shared address) in
// 16-byte pieces from the 16-byte boundary at or below src, so the bytes land at dst + (src & 15);
// the copy reads up to 15 bytes either side of the range (device pool pieces are 256-byte
// aligned and sized: they stay inside the piece). Returns the offset of src's first byte at dst.
__device__ __forceinline__ int copy_span_warp(uint32_t dst, const uint8_t* src, int64_t n,
                                              int lane) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(src);
  const uintptr_t base = a & ~uintptr_t{15}, end = (a + static_cast<uintptr_t>(n) + 15) & ~uintptr_t{15};
  const int count = static_cast<int>(end - base);
  const uint8_t* from = reinterpret_cast<const uint8_t*>(base);
  for (int off = lane * 16; off < count; off += 512)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + off), "l"(from + off));
  return static_cast<int>(a & 15);
}
// The shared memory copy_span_warp may fill for n bytes: at most n + 30, in whole 16-byte pieces.
__host__ __device__ constexpr int64_t span_capacity(int64_t n) { return ((n + 15) / 16 + 1) * 16; }

// The window row of token `pos`, stream s (16-bit values of the page that holds it).
__device__ __forceinline__ uint16_t* page_row(const LayerDesc& L, bool keys, int64_t s,
                                              int64_t pos) {
  const PtrPair pg = L.pages[pos / L.P];
  return reinterpret_cast<uint16_t*>(keys ? pg.k : pg.v) + (s * L.P + pos % L.P) * L.D;
}
__device__ __forceinline__ float exact_elem(const LayerDesc& L, bool keys, int64_t s, int64_t pos,
                                            int64_t d) {
  return window_to_f32(page_row(L, keys, s, pos)[d], L.bf16_window);
}

}  // namespace kvq::cuda
