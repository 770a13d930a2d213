// CacheGen's block work on the GPU (kernels.h: cg_*). A CacheGen layer on the device holds
// src/methods/cachegen.cc's stored blocks byte for byte; with group == chunk and values=token
// its codes and (scale, zero) pairs are KIVI's, which the append kernel computes. These kernels
// turn KIVI-layout codes into the coder's symbols (the token deltas, delta=auto's per-channel
// choice), bill the encoded streams, assemble the parts, and on the way back undo the deltas
// into KIVI-layout blocks that the attention kernels read.
#include <cuda_runtime.h>

#include "cuda/device_common.cuh"
#include "cuda/kernels.h"

namespace kvq::cuda {

namespace {

constexpr int kThreads = 128;  // one channel per thread in the per-channel passes

__device__ __forceinline__ uint32_t rd32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 |
         static_cast<uint32_t>(p[2]) << 16 | static_cast<uint32_t>(p[3]) << 24;
}

// One (block, stream, part) per CTA: the stream's codes from its KIVI-layout block into shared
// memory, then its symbols (and with delta=auto its channel mask), as chunk_symbols makes them.
__global__ void __launch_bounds__(kThreads) cg_symbols_kernel(LayerDesc L, int64_t first,
                                                              CgArgs c, CgOut o) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int part = static_cast<int>(blockIdx.y);
  const int64_t S = L.S(), item = blockIdx.x, i = item / S, s = item % S;
  const int64_t T = L.T, D = L.D, TD = T * D;
  const int bits = c.bits, A = 1 << bits;
  const uint32_t m = static_cast<uint32_t>(A - 1);
  const PtrPair blk = L.blocks[first + i];
  const uint8_t* codes = part == 0 ? blk.k + s * L.kcode : blk.v + s * L.vcode;
  uint8_t* cs = smem;  // [T, D]
  for (int64_t e = threadIdx.x; e < TD; e += kThreads)
    cs[e] = static_cast<uint8_t>(code_at(codes, e, bits));
  __syncthreads();
  uint8_t* sym = (part == 0 ? o.sym_k : o.sym_v) + item * TD;
  if (c.delta != 4) {  // none, token, group, anchor: apply_delta (32-bit index arithmetic)
    const uint32_t D32 = static_cast<uint32_t>(D), P32 = static_cast<uint32_t>(c.period);
    for (uint32_t e = threadIdx.x; e < static_cast<uint32_t>(TD); e += kThreads) {
      const uint32_t t = e / D32, d = e - t * D32;
      const uint32_t r0 = P32 ? t / P32 * P32 : 0;
      uint32_t v = cs[e];
      if (c.delta != 0 && t != r0) v = (v - cs[(c.delta == 3 ? r0 : t - 1) * D32 + d]) & m;
      sym[e] = static_cast<uint8_t>(v);
    }
    return;
  }
  // delta=auto (choose_channel_deltas): per channel the histograms of the codes and of the token
  // deltas, u16 counts [2][A][kThreads] after the codes; the delta is used iff its sum of
  // c log2 c (a table the host computed as the CPU does, summed in symbol order without
  // contraction) exceeds the codes' by more than 1e-9.
  uint16_t* hist = reinterpret_cast<uint16_t*>(smem + ((TD + 15) / 16) * 16);
  uint16_t* hc = hist + threadIdx.x;
  uint16_t* hd = hist + static_cast<int64_t>(A) * kThreads + threadIdx.x;
  uint8_t* mask = (part == 0 ? o.mask_k : o.mask_v) + item * ((D + 7) / 8);
  const int lane = threadIdx.x & 31;
  for (int64_t d0 = 0; d0 < D; d0 += kThreads) {
    const int64_t d = d0 + threadIdx.x;
    bool use = false;
    if (d < D && T >= 2) {
      for (int a = 0; a < A; ++a) hc[a * kThreads] = 0, hd[a * kThreads] = 0;
      uint32_t prev = 0;
      for (int64_t t = 0; t < T; ++t) {
        const uint32_t v = cs[t * D + d];
        ++hc[v * kThreads];
        ++hd[(t ? (v - prev) & m : v) * kThreads];
        prev = v;
      }
      double sc = 0, sd = 0;
      for (int a = 0; a < A; ++a) {
        sc = __dadd_rn(sc, c.clogc[hc[a * kThreads]]);
        sd = __dadd_rn(sd, c.clogc[hd[a * kThreads]]);
      }
      use = sd > __dadd_rn(sc, 1e-9);
    }
    const unsigned vote = __ballot_sync(0xffffffffu, use);
    if (lane % 8 == 0 && d < D) mask[d / 8] = static_cast<uint8_t>(vote >> lane);
    if (d < D) {
      uint32_t prev = 0;
      for (int64_t t = 0; t < T; ++t) {
        const uint32_t v = cs[t * D + d];
        sym[t * D + d] = static_cast<uint8_t>(use && t ? (v - prev) & m : v);
        prev = v;
      }
    }
  }
}

// EncodeStats' payload of each encoded stream: its size less the mode byte (raw, constant) or
// the mode and precision bytes and the shared-table indices (rANS).
__global__ void cg_payload_kernel(const uint8_t* out, const uint64_t* offsets, int64_t n, int iw,
                                  int n_channels, uint32_t* payload) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n) return;
  const uint64_t size = offsets[i + 1] - offsets[i];
  uint64_t p = 0;
  if (size > 0) {
    const uint8_t b0 = out[offsets[i]];
    const int mode = b0 & 3;
    if (mode == 0)
      p = size - 1;
    else if (mode == 1)
      p = 1;
    else
      p = size - 2 - (static_cast<uint64_t>((b0 >> 5) & 1 ? n_channels : 1) * iw + 7) / 8;
  }
  payload[i] = static_cast<uint32_t>(p);
}

constexpr uint64_t kCopyPiece = 64 * 1024;

__global__ void copy_jobs_kernel(const CopyJob* jobs) {
  const CopyJob j = jobs[blockIdx.x];
  const uint64_t b0 = blockIdx.y * kCopyPiece;
  if (b0 >= j.bytes) return;
  const uint64_t b1 = b0 + kCopyPiece < j.bytes ? b0 + kCopyPiece : j.bytes;
  for (uint64_t b = b0 + threadIdx.x; b < b1; b += blockDim.x) j.dst[b] = j.src[b];
}

// Where the streams of stored blocks [first, first + n) are, relative to `base`.
__global__ void cg_ranges_kernel(const PtrPair* blocks, int64_t first, int64_t n, int64_t S,
                                 CgParts g, const uint8_t* base, uint64_t* begin_k,
                                 uint64_t* end_k, uint64_t* begin_v, uint64_t* end_v) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= 2 * n * S) return;
  const int part = static_cast<int>(e / (n * S));
  const int64_t is = e % (n * S), b = first + is / S, s = is % S;
  const uint8_t* p = part == 0 ? blocks[b].k : blocks[b].v;
  if (b == 0) p += g.prefix0[part];
  const uint8_t* index = p + g.params[part] + static_cast<uint64_t>(S) * g.mask[part];
  const uint8_t* streams = index + 4 * S;
  const uint64_t s0 = s ? rd32(index + 4 * (s - 1)) : 0, s1 = rd32(index + 4 * s);
  const uint64_t at = static_cast<uint64_t>(streams - base);
  (part == 0 ? begin_k : begin_v)[is] = at + s0;
  (part == 0 ? end_k : end_v)[is] = at + s1;
}

// One (block, stream) of one part per CTA: channel-major symbols back to codes (chunk_codes),
// packed into the KIVI-layout block M.blocks[first + i] with the stream's pairs copied beside.
__global__ void __launch_bounds__(kThreads) cg_unpack_kernel(LayerDesc M, const PtrPair* stored,
                                                             int part, int64_t first, CgArgs c,
                                                             CgParts g, const uint8_t* sym) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int64_t S = M.S(), item = blockIdx.x, i = item / S, s = item % S, b = first + i;
  // The codes [T, D] in rows of DP = D + 4 bytes: the transposing writes (consecutive threads,
  // consecutive tokens) then fall in different banks.
  // Index arithmetic in 32 bits (a 64-bit division per element cost more than the rest).
  const uint32_t T = static_cast<uint32_t>(M.T), D = static_cast<uint32_t>(M.D), TD = T * D,
                 DP = D + 4;
  const int bits = c.bits;
  const uint32_t m = (1u << bits) - 1u;
  const uint8_t* in = sym + item * static_cast<int64_t>(TD);  // [D, T]
  if (T % 4 == 0) {  // four tokens of a channel per 32-bit load (rows are 4-byte aligned)
    const uint32_t T4 = T / 4;
    const uint32_t* in4 = reinterpret_cast<const uint32_t*>(in);
    for (uint32_t w = threadIdx.x; w < TD / 4; w += kThreads) {
      const uint32_t d = w / T4, t = (w - d * T4) * 4, x = in4[w];
      smem[t * DP + d] = static_cast<uint8_t>(x);
      smem[(t + 1) * DP + d] = static_cast<uint8_t>(x >> 8);
      smem[(t + 2) * DP + d] = static_cast<uint8_t>(x >> 16);
      smem[(t + 3) * DP + d] = static_cast<uint8_t>(x >> 24);
    }
  } else {
    for (uint32_t e = threadIdx.x; e < TD; e += kThreads) {
      const uint32_t d = e / T, t = e - d * T;
      smem[t * DP + d] = in[e];
    }
  }
  const uint8_t* sp = part == 0 ? stored[b].k : stored[b].v;
  if (b == 0) sp += g.prefix0[part];
  const uint8_t* mask = sp + g.params[part] + s * g.mask[part];
  __syncthreads();
  const uint32_t P32 = static_cast<uint32_t>(c.period);
  for (uint32_t d = threadIdx.x; d < D; d += kThreads) {  // inverse deltas, a channel per thread
    if (c.delta == 0) break;
    const bool on = c.delta != 4 || ((mask[d / 8] >> (d % 8)) & 1);
    if (!on) continue;
    for (uint32_t t = 1; t < T; ++t) {
      const uint32_t r0 = c.delta == 4 || !P32 ? 0 : t / P32 * P32;
      if (t == r0) continue;
      const uint32_t ref = smem[(c.delta == 3 ? r0 : t - 1) * DP + d];
      smem[t * DP + d] = static_cast<uint8_t>((smem[t * DP + d] + ref) & m);
    }
  }
  __syncthreads();
  uint8_t* mp = part == 0 ? M.blocks[b].k : M.blocks[b].v;
  const int64_t code_bytes = part == 0 ? M.kcode : M.vcode;
  const int64_t param_bytes = part == 0 ? M.kparam : M.vparam;
  uint8_t* out = mp + s * code_bytes;
  for (uint32_t gi = threadIdx.x; gi < (TD + 7) / 8; gi += kThreads) {  // 8 codes: `bits` bytes
    const uint32_t i0 = gi * 8;
    const int cnt = TD - i0 < 8 ? static_cast<int>(TD - i0) : 8;
    uint32_t t = i0 / D, d = i0 - t * D;
    unsigned long long w = 0;
    for (int j = 0; j < cnt; ++j) {
      w |= static_cast<unsigned long long>(smem[t * DP + d]) << (j * bits);
      if (++d == D) d = 0, ++t;
    }
    for (int j = 0; j < (cnt * bits + 7) / 8; ++j)
      out[gi * bits + j] = static_cast<uint8_t>(w >> (8 * j));
  }
  const uint8_t* pin = sp + s * param_bytes;
  uint8_t* pout = mp + S * code_bytes + s * param_bytes;
  for (int64_t e = threadIdx.x; e < param_bytes; e += kThreads) pout[e] = pin[e];
}

__global__ void cg_mirror_table_kernel(PtrPair* table, uint8_t* base, int64_t n, uint64_t k_bytes,
                                       uint64_t stride) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) table[i] = PtrPair{base + i * stride, base + i * stride + k_bytes};
}

unsigned blocks_for(int64_t n, int per) { return static_cast<unsigned>((n + per - 1) / per); }

}  // namespace

size_t cg_symbols_smem_bytes(const LayerDesc& L, const CgArgs& c) {
  const size_t codes = static_cast<size_t>((L.T * L.D + 15) / 16 * 16);
  return codes + (c.delta == 4 ? size_t{2} * (size_t{1} << c.bits) * kThreads * 2 : 0);
}

void cg_symbols(const LayerDesc& L, int64_t first, int64_t n, const CgArgs& c, const CgOut& o,
                cudaStream_t st) {
  if (n == 0) return;
  const size_t smem = cg_symbols_smem_bytes(L, c);
  static const bool opted = [] {
    return cudaFuncSetAttribute(cg_symbols_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                200 * 1024) == cudaSuccess;
  }();
  (void)opted;
  cg_symbols_kernel<<<dim3(static_cast<unsigned>(n * L.S()), 2), kThreads, smem, st>>>(L, first, c,
                                                                                    o);
}

void cg_payload(const uint8_t* out, const uint64_t* offsets, int64_t n, int iw, int n_channels,
                uint32_t* payload, cudaStream_t st) {
  if (n == 0) return;
  cg_payload_kernel<<<blocks_for(n, 256), 256, 0, st>>>(out, offsets, n, iw, n_channels, payload);
}

void copy_jobs(const CopyJob* jobs, int64_t n, uint64_t max_bytes, cudaStream_t st) {
  if (n == 0 || max_bytes == 0) return;
  const unsigned pieces = static_cast<unsigned>((max_bytes + kCopyPiece - 1) / kCopyPiece);
  copy_jobs_kernel<<<dim3(static_cast<unsigned>(n), pieces), 256, 0, st>>>(jobs);
}

void cg_ranges(const PtrPair* blocks, int64_t first, int64_t n, int64_t S, const CgParts& g,
               const uint8_t* base, uint64_t* begin_k, uint64_t* end_k, uint64_t* begin_v,
               uint64_t* end_v, cudaStream_t st) {
  if (n == 0) return;
  cg_ranges_kernel<<<blocks_for(2 * n * S, 256), 256, 0, st>>>(blocks, first, n, S, g, base,
                                                               begin_k, end_k, begin_v, end_v);
}

void cg_unpack(const LayerDesc& M, const PtrPair* stored, int part, int64_t first, int64_t n,
               const CgArgs& c, const CgParts& g, const uint8_t* sym, cudaStream_t st) {
  if (n == 0) return;
  const size_t smem = static_cast<size_t>(M.T * (M.D + 4));
  static const bool opted = [] {
    return cudaFuncSetAttribute(cg_unpack_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                200 * 1024) == cudaSuccess;
  }();
  (void)opted;
  cg_unpack_kernel<<<static_cast<unsigned>(n * M.S()), kThreads, smem, st>>>(M, stored, part, first,
                                                                             c, g, sym);
}

void cg_mirror_table(PtrPair* table, uint8_t* base, int64_t n, uint64_t k_bytes, uint64_t stride,
                     cudaStream_t st) {
  if (n == 0) return;
  cg_mirror_table_kernel<<<blocks_for(n, 256), 256, 0, st>>>(table, base, n, k_bytes, stride);
}

}  // namespace kvq::cuda
