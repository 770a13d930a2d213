// The GPU encoder of kvq's symbol streams (rans_gpu.h). It restates entropy/symbol_codec.cc's
// encode_symbols for a shared table set without inline tables decision by decision (table costs
// and size estimates in double precision, in the CPU's order, without contraction), and
// entropy/rans.cc's scalar encoder (normative in entropy/rans.h) state by state, so every stream
// comes out byte-identical to the CPU's.
#include <cuda_runtime.h>

#include <algorithm>
#include <cub/device/device_scan.cuh>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_util.h"
#include "cuda/kernels.h"
#include "cuda/rans_gpu.h"
#include "kvq/bitpack.h"

namespace kvq::cuda {

namespace {

constexpr int kWarpsPerCta = 4;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kMaxAlphabet = 1 << entropy::kMaxSymbolBits;
constexpr int kStepsPerChunk = 32;  // encode steps whose symbols a warp stages at a time
// Up to 16 symbols and 32 tables (CacheGen's 2-4 bits and 16 prototypes), a lane scores whole
// channels; otherwise the warp scores one channel at a time.
constexpr int kSmallAlphabet = 16;
constexpr int kSmallTables = 32;

struct Args {
  const uint8_t* cm;  // [n, C, T] channel-major symbols
  int64_t n, T;
  int C, bits, lanes_log2;  // lanes_log2: -1 = by size
  const double* cost;       // [A, stride]
  const uint2* enc;         // [K, A]
  int K, stride, P;
  uint8_t* slots;  // [n, cap]
  size_t cap;
  uint8_t* idx;     // [n, C] table per channel
  uint32_t* head;   // [n] bytes at the start of a slot
  uint32_t* tail;   // [n] word bytes at the end of a slot
  uint64_t* sizes;  // [n] head + tail
  int32_t* status;
  int64_t warps;
};

// LSB-first bit writer (entropy/bit_io.h's order) into device bytes.
struct DevBitWriter {
  uint8_t* p;
  uint64_t acc = 0;
  int fill = 0;
  __device__ void put(uint32_t v, int n) {
    if (n == 0) return;
    acc |= static_cast<uint64_t>(n == 32 ? v : v & ((1u << n) - 1u)) << fill;
    fill += n;
    while (fill >= 8) {
      *p++ = static_cast<uint8_t>(acc);
      acc >>= 8;
      fill -= 8;
    }
  }
  __device__ void flush() {
    if (fill > 0) *p++ = static_cast<uint8_t>(acc);
    acc = 0;
    fill = 0;
  }
};

__device__ __forceinline__ int bit_width_u32(uint32_t v) { return v ? 32 - __clz(v) : 0; }

// The cheapest table of the set for the histogram cnt[A] and its coded bits: the CPU's pick()
// (acc[t] = sum over present symbols, in symbol order, of count x cost; the first minimum).
// Every lane returns the same result.
__device__ int pick_table(const uint32_t* cnt, const Args& a, double& bits_out) {
  const int lane = static_cast<int>(threadIdx.x & 31), A = 1 << a.bits;
  double best = __longlong_as_double(0x7ff0000000000000ll);  // +inf
  int bt = a.K;                                              // none yet
  for (int t = lane; t < a.K; t += 32) {
    double acc = 0.0;
    for (int sy = 0; sy < A; ++sy) {
      const uint32_t c = cnt[sy];
      if (c)
        acc = __dadd_rn(acc, __dmul_rn(static_cast<double>(c), __ldg(a.cost + sy * a.stride + t)));
    }
    if (bt == a.K || acc < best) best = acc, bt = t;
  }
  // Smallest cost, then smallest index: the first minimum of the CPU's scan (costs are never NaN).
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const double ob = __shfl_xor_sync(kFull, best, o);
    const int ot = __shfl_xor_sync(kFull, bt, o);
    if (ob < best || (ob == best && ot < bt)) best = ob, bt = ot;
  }
  bits_out = best;
  return bt;
}

__global__ void __launch_bounds__(32 * kWarpsPerCta) encode_kernel(Args a) {
  __shared__ uint32_t counts_sm[kWarpsPerCta][kMaxAlphabet];
  __shared__ uint32_t pooled_sm[kWarpsPerCta][kMaxAlphabet];
  __shared__ uint8_t stage_sm[kWarpsPerCta][kStepsPerChunk * 32];
  __shared__ uint32_t hist_sm[kWarpsPerCta][kSmallAlphabet * 32];
  __shared__ double cost_sm[kSmallAlphabet * kSmallTables];
  const int w = static_cast<int>(threadIdx.x >> 5), lane = static_cast<int>(threadIdx.x & 31);
  uint32_t* const counts = counts_sm[w];
  uint32_t* const pooled = pooled_sm[w];
  uint8_t* const stage = stage_sm[w];
  const int A = 1 << a.bits, C = a.C;
  const int64_t T = a.T, n_sym = T * C;
  const int64_t raw_bytes = 1 + (n_sym * a.bits + 7) / 8;  // 1 + packed_size
  const bool lane_per_channel = A <= kSmallAlphabet && a.stride <= kSmallTables;
  if (lane_per_channel) {
    for (int k = static_cast<int>(threadIdx.x); k < A * a.stride; k += blockDim.x)
      cost_sm[k] = a.cost[k];
    __syncthreads();
  }
  // 16-byte rows: a channel's tokens start on 16 bytes (T a multiple of 16, an aligned buffer).
  const bool vec16 = T % 16 == 0 && reinterpret_cast<uintptr_t>(a.cm) % 16 == 0;
  for (int64_t j = blockIdx.x * int64_t{kWarpsPerCta} + w; j < a.n; j += a.warps) {
    const uint8_t* x = a.cm + j * n_sym;
    uint8_t* slot = a.slots + static_cast<size_t>(j) * a.cap;
    uint8_t* ix = a.idx + j * C;
    bool bad = false;
    double pc_payload = 0.0;  // lane 0's running sum of the channels' bits, in channel order
    if (lane_per_channel) {
      // Small alphabets and sets: lane l takes channels l, l + 32, ...: its histogram in a
      // column of shared memory, then every table's cost in its registers.
      uint32_t* hist = hist_sm[w];
      uint32_t pool[kSmallAlphabet] = {};
      for (int c0 = 0; c0 < C; c0 += 32) {
        const int c = c0 + lane;
        double b = 0.0;
        int bt = 0;
        if (c < C) {
#pragma unroll
          for (int s = 0; s < kSmallAlphabet; ++s) hist[s * 32 + lane] = 0;
          const uint8_t* row = x + static_cast<int64_t>(c) * T;
          int64_t t = 0;
          if (vec16) {
            for (; t < T; t += 16) {
              const uint4 q = *reinterpret_cast<const uint4*>(row + t);
              const uint32_t wds[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
              for (int k = 0; k < 16; ++k) {
                const uint32_t v = (wds[k >> 2] >> (8 * (k & 3))) & 0xFFu;
                if (v < static_cast<uint32_t>(A))
                  ++hist[v * 32 + lane];
                else
                  bad = true;
              }
            }
          }
          for (; t < T; ++t) {
            const uint32_t v = row[t];
            if (v < static_cast<uint32_t>(A))
              ++hist[v * 32 + lane];
            else
              bad = true;
          }
          double cd[kSmallAlphabet];
#pragma unroll
          for (int s = 0; s < kSmallAlphabet; ++s) {
            const uint32_t n = s < A ? hist[s * 32 + lane] : 0;
            pool[s] += n;
            cd[s] = static_cast<double>(n);
          }
          for (int tb = 0; tb < a.K; ++tb) {
            double acc = 0.0;
#pragma unroll
            for (int s = 0; s < kSmallAlphabet; ++s)
              if (cd[s] != 0.0) acc = __dadd_rn(acc, __dmul_rn(cd[s], cost_sm[s * a.stride + tb]));
            if (tb == 0 || acc < b) b = acc, bt = tb;
          }
          ix[c] = static_cast<uint8_t>(bt);
        }
        // The channels' bits summed in channel order (lane 0).
        const int nc = C - c0 < 32 ? C - c0 : 32;
        for (int k = 0; k < nc; ++k) {
          const double bk = __shfl_sync(kFull, b, k);
          if (lane == 0) pc_payload = __dadd_rn(pc_payload, bk);
        }
      }
#pragma unroll
      for (int s = 0; s < kSmallAlphabet; ++s) {
        uint32_t v = pool[s];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
        if (lane == 0 && s < A) pooled[s] = v;
      }
      __syncwarp();
    } else {
      // Per channel, the warp together: a histogram, then the cheapest table (lane t scores t).
      for (int s = lane; s < A; s += 32) pooled[s] = 0;  // (ordered by the __syncwarp below)
      for (int c = 0; c < C; ++c) {
        for (int s = lane; s < A; s += 32) counts[s] = 0;
        __syncwarp();
        for (int64_t t0 = 0; t0 < T; t0 += 32) {
          const int64_t t = t0 + lane;
          uint32_t v = t < T ? x[c * T + t] : 0x100u;  // 0x100: no symbol
          if (t < T && v >= static_cast<uint32_t>(A)) bad = true, v = 0x100u;
          const unsigned same = __match_any_sync(kFull, v);
          if (v < 0x100u && lane == __ffs(same) - 1) counts[v] += __popc(same);  // one per value
          __syncwarp();
        }
        for (int s = lane; s < A; s += 32) pooled[s] += counts[s];
        double b;
        const int bt = pick_table(counts, a, b);
        if (lane == 0) {
          ix[c] = static_cast<uint8_t>(bt);
          pc_payload = __dadd_rn(pc_payload, b);
        }
        __syncwarp();
      }
    }
    if (__any_sync(kFull, bad)) {
      if (lane == 0) a.status[j] = kEncodeRange, a.head[j] = 0, a.tail[j] = 0, a.sizes[j] = 0;
      continue;
    }
    pc_payload = __shfl_sync(kFull, pc_payload, 0);
    double pool_payload;
    const int pool_index = pick_table(pooled, a, pool_payload);
    int distinct = 0, only = 0;
    for (int s0 = 0; s0 < A; s0 += 32) {
      const unsigned m = __ballot_sync(kFull, s0 + lane < A && pooled[s0 + lane] != 0);
      distinct += __popc(m);
      if (m) only = s0 + 31 - __clz(m);
    }
    // The CPU's decisions (encode_symbols): constant, else the shared-table estimate against raw.
    int mode = 0;  // 0 raw, 1 constant, 3 rANS with shared tables
    bool per_channel = true;
    int lanes_log2 = a.lanes_log2;
    const int iw = bit_width_u32(static_cast<uint32_t>(a.K - 1));
    if (distinct == 1) {
      mode = 1;
    } else {
      if (lanes_log2 < 0) {  // default_lanes_log2
        if (n_sym >= 2048) {
          lanes_log2 = 4;
        } else {
          lanes_log2 = 0;
          while (lanes_log2 < 3 && (int64_t{256} << lanes_log2) <= n_sym) ++lanes_log2;
        }
      }
      const double lanes_d = static_cast<double>(1 << lanes_log2);
      const double st_bits = __dmul_rn(lanes_d, __dadd_rn(static_cast<double>(a.P + 4), 7.5));
      const double est_pc = __dadd_rn(
          2.0,
          __ddiv_rn(__dadd_rn(__dadd_rn(__dmul_rn(static_cast<double>(iw), static_cast<double>(C)),
                                        st_bits),
                              pc_payload),
                    8.0));
      const double est_pool = __dadd_rn(
          2.0,
          __ddiv_rn(__dadd_rn(__dadd_rn(static_cast<double>(iw), st_bits), pool_payload), 8.0));
      if (C > 1 && isfinite(est_pool) && est_pool <= est_pc) per_channel = false;
      const double est = per_channel ? est_pc : est_pool;
      if (isfinite(est) && est < static_cast<double>(raw_bytes)) {
        mode = 3;
        if (a.lanes_log2 < 0) {
          if (lanes_log2 == 4 && est >= 4096.0) lanes_log2 = 5;
          if (per_channel && lanes_log2 == 5 && T % 32 != 0) lanes_log2 = 4;
          if (per_channel && lanes_log2 == 4 && T % 16 != 0) lanes_log2 = 3;
        }
      }
    }
    if (!per_channel && lane == 0) ix[0] = static_cast<uint8_t>(pool_index);
    __syncwarp();
    uint32_t head = 0, tail = 0;
    if (mode == 3) {
      // rANS, from the last step to the first; the words go backwards from the slot's end, in
      // each step the highest emitting lane last (the decoder reads a step's words in lane order).
      const int L = 1 << lanes_log2;
      const uint32_t low = 1u << a.P;
      uint32_t xs = low;
      // 32-bit positions (a stream holds at most 2^30 symbols).
      const int n32 = static_cast<int>(n_sym), T32 = static_cast<int>(T);
      const int steps = (n32 + L - 1) / L;
      const uint32_t max_words = static_cast<uint32_t>((raw_bytes - 3) / 2);  // 2 + 2W < raw
      uint32_t words = 0;
      bool full = false;
      // This lane's position: symbol i = s L + lane, channel c = i / T, r = i - c T.
      int c = 0, r = 0;
      if (lane < L && per_channel) {
        const uint32_t i0 = static_cast<uint32_t>(steps - 1) * L + lane;
        c = static_cast<int>(i0 / static_cast<uint32_t>(T32));
        r = static_cast<int>(i0 - static_cast<uint32_t>(c) * T32);
      }
      int c_loaded = -1;
      uint32_t tb = 0;
      for (int s_hi = steps - 1; s_hi >= 0 && !full; s_hi -= kStepsPerChunk) {
        const int s_lo = s_hi - kStepsPerChunk + 1 > 0 ? s_hi - kStepsPerChunk + 1 : 0;
        const int base = s_lo * L;
        const int len = (n32 < (s_hi + 1) * L ? n32 : (s_hi + 1) * L) - base;
        __syncwarp();
        for (int k = lane; k < len; k += 32) stage[k] = x[base + k];
        __syncwarp();
        for (int s = s_hi; s >= s_lo; --s) {
          const int i = s * L + lane;
          const bool act = lane < L && i < n32;
          uint32_t f = 0, cum = 0, shift = 0, rcp = 0;
          if (act) {
            if (c != c_loaded) tb = ix[c], c_loaded = c;
            const uint2 e = __ldg(a.enc + tb * A + stage[i - base]);
            rcp = e.x;
            cum = e.y & 0xFFFu;
            f = (e.y >> 12) & 0x1FFFu;
            shift = e.y >> 25;
          }
          const bool emit = act && xs >= (f << 16);
          const unsigned m = __ballot_sync(kFull, emit);
          if (emit) {
            const uint32_t from_end = words + static_cast<uint32_t>(__popc(m >> lane) - 1);
            if (from_end < max_words) {
              const size_t at = a.cap - 2 * (static_cast<size_t>(from_end) + 1);
              slot[at] = static_cast<uint8_t>(xs);
              slot[at + 1] = static_cast<uint8_t>(xs >> 8);
            }
            xs >>= 16;
          }
          words += static_cast<uint32_t>(__popc(m));
          if (act) {
            const uint32_t q = static_cast<uint32_t>((static_cast<uint64_t>(xs) * rcp) >> shift);
            xs = (q << a.P) + (xs - q * f) + cum;
          }
          if (per_channel && lane < L) {
            r -= L;
            while (r < 0) r += T32, --c;
          }
          if (words > max_words) {
            full = true;
            break;
          }
        }
      }
      if (!full) {
        // Size: header, table indices, the state block (4 + top bits per lane), padding, words.
        const int n_idx = per_channel ? C : 1;
        int sb = lane < L ? 4 + (bit_width_u32(xs) - 1) : 0;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sb += __shfl_xor_sync(kFull, sb, o);
        const int64_t hb = (static_cast<int64_t>(iw) * n_idx + sb + 7) / 8;
        if (2 + hb + 2 * static_cast<int64_t>(words) < raw_bytes) {
          DevBitWriter bw{slot + 2};
          if (lane == 0) {
            slot[0] = static_cast<uint8_t>(3u | static_cast<unsigned>(lanes_log2) << 2 |
                                           (per_channel ? 1u : 0u) << 5);
            slot[1] = static_cast<uint8_t>(a.P);
            for (int k = 0; k < n_idx; ++k) bw.put(ix[k], iw);
          }
          for (int k = 0; k < L; ++k) {
            const uint32_t xk = __shfl_sync(kFull, xs, k);
            if (lane == 0) {
              const int top = bit_width_u32(xk) - 1;
              bw.put(static_cast<uint32_t>(top - a.P), 4);
              bw.put(xk, top);
            }
          }
          if (lane == 0) bw.flush();
          head = static_cast<uint32_t>(2 + hb);
          tail = 2 * words;
        } else {
          mode = 0;
        }
      } else {
        mode = 0;
      }
    }
    __syncwarp();
    if (mode == 1) {
      if (lane == 0) slot[0] = 1, slot[1] = static_cast<uint8_t>(only);
      head = 2;
    } else if (mode == 0) {
      // Raw: pack_bits of the token-major order (symbol k = t C + c at bit k * bits).
      const int64_t nb = raw_bytes - 1;
      for (int64_t b = lane; b < nb; b += 32) {
        const int64_t k0 = 8 * b / a.bits, k1 = (8 * b + 7) / a.bits;
        uint32_t v = 0;
        for (int64_t k = k0; k <= k1 && k < n_sym; ++k) {
          const int64_t t = k / C, ch = k - t * C;
          const uint32_t sy = x[ch * T + t];
          const int64_t sh = k * a.bits - 8 * b;
          v |= sh >= 0 ? sy << sh : sy >> -sh;
        }
        slot[1 + b] = static_cast<uint8_t>(v);
      }
      if (lane == 0) slot[0] = 0;
      head = static_cast<uint32_t>(raw_bytes);
      tail = 0;
    }
    if (lane == 0) {
      a.status[j] = kEncodedOk;
      a.head[j] = head;
      a.tail[j] = tail;
      a.sizes[j] = static_cast<uint64_t>(head) + tail;
    }
    __syncwarp();
  }
}

// Stream j's head (slot start) and tail (slot end) to out[offsets[j], offsets[j + 1]).
__global__ void __launch_bounds__(32 * kWarpsPerCta)
    gather_kernel(const uint8_t* slots, size_t cap, const uint32_t* head, const uint32_t* tail,
                  const uint64_t* offsets, int64_t n, uint8_t* out) {
  const int64_t j = blockIdx.x * int64_t{kWarpsPerCta} + (threadIdx.x >> 5);
  if (j >= n) return;
  const int lane = static_cast<int>(threadIdx.x & 31);
  const uint8_t* slot = slots + static_cast<size_t>(j) * cap;
  uint8_t* dst = out + offsets[j];
  const uint32_t h = head[j], tl = tail[j];
  for (uint32_t k = static_cast<uint32_t>(lane); k < h; k += 32) dst[k] = slot[k];
  const uint8_t* src = slot + cap - tl;
  for (uint32_t k = static_cast<uint32_t>(lane); k < tl; k += 32) dst[h + k] = src[k];
}

size_t round16(size_t x) { return (x + 15) / 16 * 16; }

struct Plan {
  size_t cap = 0, slots = 0, idx = 0, words = 0, sizes = 0, cub = 0, staging = 0;
  size_t total() const { return slots + idx + words + sizes + cub + staging; }
};

Plan plan_for(const SymbolArrays& s, bool token_major) {
  Plan p;
  const size_t n = static_cast<size_t>(s.n), per = static_cast<size_t>(s.n_tokens) * s.n_channels;
  p.cap = round16(1 + packed_size(per, s.bits));
  p.slots = n * p.cap;
  p.idx = round16(n * static_cast<size_t>(s.n_channels));
  p.words = round16(2 * n * 4);  // head, tail
  p.sizes = round16(n * 8);
  size_t cub_bytes = 0;
  cub::DeviceScan::InclusiveSum(nullptr, cub_bytes, static_cast<const uint64_t*>(nullptr),
                                static_cast<uint64_t*>(nullptr), static_cast<int>(s.n));
  p.cub = round16(cub_bytes);
  p.staging = token_major ? round16(n * per) : 0;
  return p;
}

bool shape_ok(const SymbolArrays& s) {
  return s.bits >= 1 && s.bits <= entropy::kMaxSymbolBits && s.n_channels >= 1 &&
         s.n_channels <= entropy::kMaxTables && s.n_tokens >= 1 &&
         s.n_tokens * s.n_channels <= (int64_t{1} << 30) && s.n >= 0 && s.n < (int64_t{1} << 31);
}

}  // namespace

GpuEncodeTables& GpuEncodeTables::operator=(GpuEncodeTables&& o) noexcept {
  if (this != &o) {
    cudaFree(cost_);
    cudaFree(enc_);
    cost_ = std::exchange(o.cost_, nullptr);
    enc_ = std::exchange(o.enc_, nullptr);
    n_tables_ = o.n_tables_, cost_stride_ = o.cost_stride_;
    prob_bits_ = o.prob_bits_, symbol_bits_ = o.symbol_bits_;
  }
  return *this;
}

GpuEncodeTables::~GpuEncodeTables() {
  cudaFree(cost_);
  cudaFree(enc_);
}

Result<GpuEncodeTables> GpuEncodeTables::upload(const entropy::SharedTables& t, cudaStream_t st) {
  const int K = t.tables.n_tables, bits = t.tables.symbol_bits;
  if (bits < 1 || bits > entropy::kMaxSymbolBits || K < 1 || K > entropy::kMaxSharedTables ||
      t.model.n_tables != K || t.cost_stride < K ||
      t.cost.size() != static_cast<size_t>(t.cost_stride) << bits)
    return invalid_argument(
        "GPU encode tables: not a shared table set from make_shared_tables (1..256 tables)");
  const size_t A = size_t{1} << bits;
  if (t.model.enc_rcp.size() != K * A || t.model.enc_info.size() != K * A)
    return invalid_argument("GPU encode tables: the set was prepared for decoding only");
  std::vector<uint2> enc(K * A);
  for (size_t i = 0; i < enc.size(); ++i)
    enc[i] = make_uint2(t.model.enc_rcp[i], t.model.enc_info[i]);
  GpuEncodeTables g;
  if (cudaError_t e = cudaMalloc(&g.cost_, t.cost.size() * sizeof(double));
      e != cudaSuccess || (e = cudaMalloc(&g.enc_, enc.size() * sizeof(uint2))) != cudaSuccess) {
    (void)cudaGetLastError();
    return cuda_error(e, "allocating the encoder's tables");
  }
  cudaError_t e = cudaMemcpyAsync(g.cost_, t.cost.data(), t.cost.size() * sizeof(double),
                                  cudaMemcpyHostToDevice, st);
  if (e == cudaSuccess)
    e = cudaMemcpyAsync(g.enc_, enc.data(), enc.size() * sizeof(uint2), cudaMemcpyHostToDevice, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e != cudaSuccess) return cuda_error(e, "copying the encoder's tables to the GPU");
  g.n_tables_ = K;
  g.cost_stride_ = t.cost_stride;
  g.prob_bits_ = t.tables.prob_bits;
  g.symbol_bits_ = bits;
  return Result<GpuEncodeTables>(std::move(g));
}

size_t encode_capacity(const SymbolArrays& s) {
  if (!shape_ok(s)) return 0;
  const size_t per = static_cast<size_t>(s.n_tokens) * s.n_channels;
  return static_cast<size_t>(s.n) * (1 + packed_size(per, s.bits));
}

size_t encode_scratch_bytes(const SymbolArrays& s, bool token_major) {
  if (!shape_ok(s) || s.n == 0) return 0;
  return plan_for(s, token_major).total();
}

Status encode_symbol_streams(const SymbolArrays& s, const GpuEncodeTables& tables, bool token_major,
                             int lanes_log2, uint8_t* out, uint64_t* offsets, int32_t* status,
                             void* scratch, size_t scratch_bytes, cudaStream_t st) {
  if (!shape_ok(s))
    return invalid_argument(
        "GPU symbol encode: bits outside 1..8, n_tokens or n_channels < 1, more than 2^30 "
        "symbols per stream, 2^31 or more streams, or a negative stream count");
  if (!tables.enc()) return invalid_argument("GPU symbol encode: no tables");
  if (tables.symbol_bits() != s.bits)
    return invalid_argument("GPU symbol encode: the shared tables are for " +
                            std::to_string(tables.symbol_bits()) + "-bit symbols, not " +
                            std::to_string(s.bits));
  if (lanes_log2 < -1 || lanes_log2 > entropy::kMaxLanesLog2)
    return invalid_argument("GPU symbol encode: lanes_log2 outside -1..5");
  if (!offsets) return invalid_argument("GPU symbol encode: null device pointer");
  if (s.n == 0) {
    if (const cudaError_t e = cudaMemsetAsync(offsets, 0, 8, st); e != cudaSuccess)
      return cuda_error(e, "clearing the offsets");
    return ok_status();
  }
  if (!s.symbols || !out || !status)
    return invalid_argument("GPU symbol encode: null device pointer");
  const Plan p = plan_for(s, token_major);
  if (!scratch || scratch_bytes < p.total())
    return invalid_argument("GPU symbol encode: scratch of " + std::to_string(scratch_bytes) +
                            " bytes, " + std::to_string(p.total()) + " needed");
  uint8_t* sc = static_cast<uint8_t*>(scratch);
  Args a{};
  a.n = s.n, a.T = s.n_tokens, a.C = s.n_channels, a.bits = s.bits, a.lanes_log2 = lanes_log2;
  a.cost = tables.cost();
  a.enc = tables.enc();
  a.K = tables.n_tables(), a.stride = tables.cost_stride(), a.P = tables.prob_bits();
  a.cap = p.cap;
  a.slots = sc;
  a.idx = sc + p.slots;
  a.head = reinterpret_cast<uint32_t*>(a.idx + p.idx);
  a.tail = a.head + s.n;
  a.sizes = reinterpret_cast<uint64_t*>(reinterpret_cast<uint8_t*>(a.head) + p.words);
  void* cub_tmp = reinterpret_cast<uint8_t*>(a.sizes) + p.sizes;
  a.status = status;
  a.cm = s.symbols;
  if (token_major) {
    uint8_t* staging = static_cast<uint8_t*>(cub_tmp) + p.cub;
    launch_transpose_bytes(s.symbols, staging, s.n, s.n_tokens, s.n_channels, st);
    a.cm = staging;
  }
  a.warps = std::max<int64_t>(kWarpsPerCta, std::min<int64_t>(s.n, sm_count() * int64_t{64}));
  a.warps = (a.warps + kWarpsPerCta - 1) / kWarpsPerCta * kWarpsPerCta;
  encode_kernel<<<static_cast<unsigned>(a.warps / kWarpsPerCta), 32 * kWarpsPerCta, 0, st>>>(a);
  if (cudaError_t e = cudaMemsetAsync(offsets, 0, 8, st); e != cudaSuccess)
    return cuda_error(e, "clearing the offsets");
  size_t cub_bytes = p.cub;
  if (cudaError_t e =
          cub::DeviceScan::InclusiveSum(cub_tmp, cub_bytes, static_cast<const uint64_t*>(a.sizes),
                                        offsets + 1, static_cast<int>(s.n), st);
      e != cudaSuccess)
    return cuda_error(e, "scanning the stream sizes");
  gather_kernel<<<static_cast<unsigned>((s.n + kWarpsPerCta - 1) / kWarpsPerCta), 32 * kWarpsPerCta,
                  0, st>>>(a.slots, a.cap, a.head, a.tail, offsets, s.n, out);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return cuda_error(e, "launching the GPU symbol encode");
  return ok_status();
}

Status encode_status(const int32_t* status, int64_t n, cudaStream_t st) {
  std::vector<int32_t> h(static_cast<size_t>(std::max<int64_t>(n, 0)));
  if (n > 0) {
    cudaError_t e = cudaMemcpyAsync(h.data(), status, h.size() * 4, cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st);
    if (e != cudaSuccess) return cuda_error(e, "reading the GPU symbol encode's results");
  }
  for (int64_t i = 0; i < n; ++i)
    if (h[static_cast<size_t>(i)] != kEncodedOk)
      return out_of_range("symbol stream " + std::to_string(i) +
                          " (GPU encode): a symbol is >= 2^bits");
  return ok_status();
}

}  // namespace kvq::cuda
