// The CUDA backend's kernels, as the host code (cuda_layer.cc) launches them. Plain structs only,
// so this header compiles under the host compiler and nvcc alike.
//
// Memory a layer holds on the device (all from its model's DevicePool):
//   blocks  one {key part, value part} pair per sealed block, in the method's stored layout
//           (methods/kivi_layout.h), byte for byte what the CPU backend holds;
//   pages   the fp16/bf16 window in pages of P tokens: page i holds tokens [i P, (i + 1) P) as
//           [B, H, P, D] 16-bit values, one page for K and one for V;
//   tables  device arrays of those pointers indexed by absolute block and page index, which the
//           kernels read (entries past what the ledger has committed are never read).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cache/seal_rules.h"  // KVQ_HOST_DEVICE

namespace kvq::cuda {

struct PtrPair {
  uint8_t* k = nullptr;
  uint8_t* v = nullptr;
};

// A [B, H, S, D] tensor: data, dtype (the kvq::DType value: 0 f32, 1 f16, 2 bf16) and element
// strides.
struct DevTensor {
  void* data = nullptr;
  int dtype = 0;
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
};

// What kernels know of a layer. Byte counts are per stream (s = b * H + h).
struct LayerDesc {
  int B = 0, H = 0, D = 0, group = 1;  // batch, KV heads, head_dim, query heads per KV head
  int64_t T = 1, P = 1, R = 0;         // block tokens, page tokens, residual
  int k_bits = 0, v_bits = 0;          // 0 for a method without sealed blocks (fp16)
  int64_t vgroup = 1, ng = 1;          // value channel group and groups per token
  int64_t kcode = 0, kparam = 0, vcode = 0, vparam = 0;
  int bf16_window = 0;
  // XQuant (docs/methods/xquant.md): 0 none, 1 an anchor (KIVI's layout), 2 a reuse layer. A
  // reuse block's own parts hold its (scale, zero) pairs and, with r_bits > 0, residual codes
  // (rcode bytes per stream) and their pairs; its codes are its anchor's block's, at
  // links[block] (kcode, vcode: the anchor's code bytes per stream; kparam, vparam: the pairs).
  int xq = 0, r_bits = 0;
  int64_t rcode = 0;
  const PtrPair* links = nullptr;  // [absolute block index] the anchor's parts (xq == 2)
  // ZipCache (src/methods/zipcache.cc's block layout; k_bits = v_bits = hi_bits there): per
  // stream a key record (mask, hi codes, lo codes, pairs) and a value record (codes, pairs,
  // channel divisors), zkrec and zvrec bytes; n_h salient tokens per stream and block.
  int zip = 0, hi_bits = 0, lo_bits = 0;
  int zvalues = 0;  // 0 uniform, 1 routed, 2 cst
  int zshared = 0;  // kparams=shared: one pair per channel, fit for lo bits
  int64_t n_h = 0, zmask = 0, zkhi = 0, zklo = 0, zkrec = 0, zvhi = 0, zvcodes = 0, zvparams = 0,
          zvrec = 0;
  const PtrPair* blocks = nullptr;  // [absolute block index]
  const PtrPair* pages = nullptr;   // [absolute page index]
  int64_t n_blocks = 0, offset = 0, exact_begin = 0;
  KVQ_HOST_DEVICE int64_t S() const { return static_cast<int64_t>(B) * H; }
};

// Writes host-side pointer pairs into a device table at [first, first + n) (through kernel
// parameters, so nothing waits and no staging buffer must outlive the call).
void set_ptrs(PtrPair* table, int64_t first, const PtrPair* host, int64_t n, cudaStream_t st);

// One append, in one launch: every new token is read once from k and v, rounded to the window
// type and written to its page; every block the append seals is quantized and packed from the
// rounded values (new tokens from the input, older ones from their pages) into its parts. Bad
// elements (NaN, Inf, |x| > 65504) are reported in flags[0] (k) and flags[1] (v) as the smallest
// linear index [B, H, n_new, D] * 4 + kind (0 NaN, 1 Inf, 2 out of range); nothing is reported
// as ~0.
struct AppendArgs {
  DevTensor k, v;
  int64_t append_start = 0, n_new = 0;
  int64_t first_sealed = 0, n_sealed = 0;  // blocks [first_sealed, first_sealed + n_sealed)
  unsigned long long* flags = nullptr;
};
// Shared memory the append needs (0 when it seals nothing); > 48 KiB needs the opt-in that
// append_prepare() makes.
size_t append_smem_bytes(const LayerDesc& L, int64_t n_sealed);
void append_prepare();
void append(const LayerDesc& L, const AppendArgs& a, cudaStream_t st);
// XQuant (src/cuda/xquant.cu), enqueued after append() on the same stream, before the append
// commits; the blocks' tokens are in their pages then. Blocks [first, first + n):
//   anchors: the pairs append() stored are refit to the codes by least squares (lsq) or
//            calibrated with eta (eta = 0 and !lsq: nothing to do);
//   reuse layers (append() ran with n_sealed = 0: it only wrote the pages): each block's own
//            pairs fit to its anchor's codes (least squares, or min/max + eta), then the residual
//            codes and pairs, as src/methods/xquant.cc's encode() does, bit for bit.
struct XqFit {
  bool lsq = false;  // anchors: fit=lsq; reuse layers: reuse_fit=lsq
  float eta = 0;
};
void xq_anchor_fit(const LayerDesc& L, int64_t first, int64_t n, XqFit f, cudaStream_t st);
size_t xq_reuse_smem_bytes(const LayerDesc& L);
void xq_reuse_seal(const LayerDesc& L, int64_t first, int64_t n, XqFit f, cudaStream_t st);

// ZipCache (src/cuda/zipcache.cu), enqueued after append() wrote the new tokens' pages (it ran
// with n_sealed = 0), in the CPU backend's order of runs and seals:
//   zip_probes  a run's probe queries: for probe i, (b, hq), its query rounded to fp16
//               (saturating) and its log-sum-exp over keys [0, pos] as held with `sealed`
//               tokens sealed, into probes[i].data (zipcache.cc's Probe layout: [B, Hq, D]
//               fp16, then [B, Hq] fp32);
//   zip_seal    blocks, one per ZipSeg: saliency (key norm, or the mean normalized attention of
//               the segment's probes, as zipcache.cc's encode), the mask, codes and pairs, bit
//               for bit.
struct ZipProbe {
  int64_t pos = 0;
  uint8_t* data = nullptr;
};
void zip_probes(const LayerDesc& L, const DevTensor& q, int64_t q_pos0, int64_t sealed,
                const ZipProbe* probes, int n_probes, int n_q_heads, cudaStream_t st);
// One block to seal: its index, its probes (probes[first, first + n) of the table) and whether
// it is ranked by them (attn) or by key norm.
struct ZipSeg {
  int64_t block = 0, first = 0;
  int n = 0, attn = 0;
};
size_t zip_seal_smem_bytes(const LayerDesc& L);
void zip_seal(const LayerDesc& L, const ZipSeg* segs, int n_blocks, const ZipProbe* probes,
              int n_q_heads, cudaStream_t st);

// CacheGen (src/cuda/cachegen.cu): src/methods/cachegen.cc's blocks with group == chunk and
// values=token, whose codes and pairs are KIVI's (append() computes them into KIVI-layout
// blocks). delta is cachegen::DeltaMode's value (0 none, 1 token, 2 group, 3 anchor, 4 auto),
// period the tokens per run of group and anchor deltas; clogc[i] = i log2 i for i <= T (delta=auto,
// the CPU's table).
struct CgArgs {
  int bits = 0, delta = 0;
  int64_t period = 0;
  const double* clogc = nullptr;
};
// Per (block i, stream s) item i * S + s: symbols [T, D] token-major, and with delta=auto the
// channel mask (ceil(D / 8) bytes), of the keys and of the values.
struct CgOut {
  uint8_t *sym_k = nullptr, *sym_v = nullptr, *mask_k = nullptr, *mask_v = nullptr;
};
// A stored part's regions, per part (0 keys, 1 values): block 0's table set in front (prefix0
// bytes), the pairs (params bytes), masks (mask bytes per stream), the index, the streams.
struct CgParts {
  uint64_t prefix0[2] = {0, 0};
  uint64_t params[2] = {0, 0};
  uint64_t mask[2] = {0, 0};
};
// chunk_symbols of blocks [first, first + n) of L's KIVI-layout blocks.
size_t cg_symbols_smem_bytes(const LayerDesc& L, const CgArgs& c);
void cg_symbols(const LayerDesc& L, int64_t first, int64_t n, const CgArgs& c, const CgOut& o,
                cudaStream_t st);
// Each encoded stream's payload (EncodeStats' split: its size less the mode byte, or the mode
// and precision bytes and iw-bit shared-table indices per channel or stream).
void cg_payload(const uint8_t* out, const uint64_t* offsets, int64_t n, int iw, int n_channels,
                uint32_t* payload, cudaStream_t st);
// n copies in one launch (jobs in device memory; max_bytes the largest).
struct CopyJob {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  uint64_t bytes = 0;
};
void copy_jobs(const CopyJob* jobs, int64_t n, uint64_t max_bytes, cudaStream_t st);
// The streams of stored blocks [first, first + n) (blocks: their parts), as offsets from `base`:
// item (i * S + s) of begin/end per part.
void cg_ranges(const PtrPair* blocks, int64_t first, int64_t n, int64_t S, const CgParts& g,
               const uint8_t* base, uint64_t* begin_k, uint64_t* end_k, uint64_t* begin_v,
               uint64_t* end_v, cudaStream_t st);
// Decoded channel-major symbols of part `part` of blocks [first, first + n) (item i * S + s),
// back to codes (chunk_codes, masks read from the stored parts), packed into M's KIVI-layout
// blocks with the stored pairs beside them.
void cg_unpack(const LayerDesc& M, const PtrPair* stored, int part, int64_t first, int64_t n,
               const CgArgs& c, const CgParts& g, const uint8_t* sym, cudaStream_t st);
// table[i] = {base + i * stride, base + i * stride + k_bytes} for i < n.
void cg_mirror_table(PtrPair* table, uint8_t* base, int64_t n, uint64_t k_bytes, uint64_t stride,
                     cudaStream_t st);

// q [B, Hq, Tq, D]: the first non-finite element into *flag (index * 4 + kind, as above).
void check_finite(const DevTensor& q, int64_t B, int64_t Hq, int64_t Tq, int64_t D,
                  unsigned long long* flag, cudaStream_t st);

// read (exact = 0: sealed tokens dequantized, the rest from the window) or read_exact (exact =
// 1: every token from the pages) of tokens [t0, t0 + n) into k_out, v_out [B, H, n, D].
void read(const LayerDesc& L, int exact, int64_t t0, int64_t n, const DevTensor& k_out,
          const DevTensor& v_out, cudaStream_t st);
// Decodes tokens [0, n) of block `block` into the window pages (a trim that reopens a block).
void reopen(const LayerDesc& L, int64_t block, int64_t n, cudaStream_t st);

// Attention. Rows r = ((b * nh + hh) * group + g) * Tq + t stand for query head
// (h0 + hh) * group + g of batch row b at query token t. Each (row, split) writes an
// unnormalised partial: m (log2 domain), l and acc[D]; combine() merges the splits.
struct AttendArgs {
  DevTensor q, out;
  float scale_log2 = 0;  // softmax scale * log2(e)
  int Tq = 1, h0 = 0, nh = 0;
  int n_splits = 1;
  int64_t split_len = 0;      // generic kernel: keys per split
  int64_t split_units = 0;    // decode kernels: tile units per split (split_tile_range)
  int window_cost = 1;        // decode kernels: units per window tile (a sealed tile is 1)
  bool merge = false;         // attend_fast: a CTA's warps share one split (see kFastWarps)
  float* part_acc = nullptr;  // [rows, n_splits, D]
  float* part_ml = nullptr;   // [rows, n_splits, 2]
};
// Any layer, any query count: per query its own seal boundary (SealRules), fp32 arithmetic.
void attend_generic(const LayerDesc& L, const AttendArgs& a, cudaStream_t st);
// Prefill chunks, and decode of the layers attend_fast does not take: the generic kernel's
// semantics, a CTA per
// (sequence, KV head, run of query positions), each key tile dequantized once into shared memory
// for all its query rows (64-key tiles on tensor cores at head_dim 64 and 128, 32-key tiles in
// fp32 otherwise); split-K by split_len (a multiple of 64) as the generic kernel.
bool chunk_supported(const LayerDesc& L, int Tq);
void attend_chunk(const LayerDesc& L, const AttendArgs& a, cudaStream_t st);
// CTAs per (sequence, KV head) of the chunk kernel.
int chunk_qtiles(const LayerDesc& L, int Tq);
// The decode kernel (Tq = 1): tensor-core dot products over packed codes dequantized in
// registers, split-K; the layers fast_supported() accepts. Each warp takes split_units tile
// units (split_tile_range). With AttendArgs::merge, a CTA's kFastWarps warps take warp splits
// kFastWarps * split + warp of one (sequence, KV head) and merge them into split's partial
// (n_splits then counts CTAs per (sequence, KV head)); without, warp w of CTA c is split
// (c kFastWarps + w) % n_splits of (sequence, KV head) (c kFastWarps + w) / n_splits.
constexpr int kFastWarps = 4;
bool fast_supported(const LayerDesc& L, int Tq);
void attend_fast(const LayerDesc& L, const AttendArgs& a, cudaStream_t st);
// Warps of the decode kernel for this layer that the device holds at once (one wave).
int64_t fast_resident_warps(const LayerDesc& L);
// ZipCache's decode (Tq = 1; src/cuda/attend_zip.cu): a warp per (sequence, KV head, split)
// reading the mixed-width codes in place, split_units tile units per split (a sealed block each,
// then the window in tiles of 32 tokens; zip_decode_tiles of them in all), on the tensor cores for
// cst and routed values at widths 2, 4 and 8, in fp32 otherwise.
bool zip_decode_supported(const LayerDesc& L, int Tq);
int64_t zip_decode_tiles(const LayerDesc& L);
int64_t zip_sealed_tiles(const LayerDesc& L);  // the first zip_sealed_tiles are sealed blocks
int64_t zip_resident_warps(const LayerDesc& L);
void attend_zip(const LayerDesc& L, const AttendArgs& a, cudaStream_t st);
void attend_combine(const LayerDesc& L, const AttendArgs& a, cudaStream_t st);

// Multiprocessors of the current device.
int sm_count();

}  // namespace kvq::cuda
