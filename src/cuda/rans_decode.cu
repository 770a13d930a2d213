// The GPU decoder of kvq's symbol streams (rans_gpu.h). The parse restates
// entropy/symbol_codec.cc's decode_symbols, entropy/freq_table.cc's read_table and
// entropy/rans.cc's read_states and decode check by check, so a stream the CPU refuses is refused
// here, and the rANS arithmetic is entropy/rans.h's (normative there).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "cuda/cuda_util.h"
#include "cuda/kernels.h"
#include "cuda/rans_gpu.h"

namespace kvq::cuda {

namespace {

constexpr int kWarpsPerCta = 4;
constexpr unsigned kFull = 0xffffffffu;

// LSB-first bit reader over [p, p + nbits / 8), as entropy/bit_io.h's BitReader (the same bits,
// the same failures), buffered: a 64-bit window refilled a byte at a time, so a field costs a
// mask and a shift. Bytes below `cached` come from `cache` (the stream's first bytes, copied to
// shared memory by the warp).
struct DevBits {
  const uint8_t* p;
  uint64_t nbits;
  const uint8_t* cache;
  uint32_t cached;
  uint64_t pos = 0;   // bits consumed
  uint64_t next = 0;  // the next byte to load into the window
  uint64_t buf = 0;
  int avail = 0;
  bool failed = false;
  __device__ bool get(int n, uint32_t& v) {
    v = 0;
    if (failed) return false;
    if (n == 0) return true;
    if (avail < n) {
      const uint64_t nbytes = nbits / 8;
      while (avail <= 56 && next < nbytes) {
        buf |= static_cast<uint64_t>(next < cached ? cache[next] : p[next]) << avail;
        ++next;
        avail += 8;
      }
      if (avail < n) {
        failed = true;
        return false;
      }
    }
    v = static_cast<uint32_t>(buf & ((uint64_t{1} << n) - 1));
    buf >>= n;
    avail -= n;
    pos += static_cast<uint64_t>(n);
    return true;
  }
  __device__ bool finish_byte() {
    if (failed) return false;
    uint32_t v;
    if (!get(static_cast<int>((8 - pos % 8) % 8), v)) return false;
    return v == 0;
  }
};

__device__ int bit_width(uint32_t x) { return x ? 32 - __clz(x) : 0; }

// entropy/freq_table.cc's read_table: false on any error (truncated, inconsistent).
// The table goes into cf[0, A + 1) as frequency << 16 (the cumulative frequencies are added after).
__device__ bool read_table(DevBits& r, int symbol_bits, int prob_bits, uint32_t* cf) {
  const int alphabet = 1 << symbol_bits;
  for (int s = 0; s <= alphabet; ++s) cf[s] = 0;
  int d = 0;
  while (d < prob_bits) {
    uint32_t b;
    if (!r.get(1, b)) return false;
    if (!b) break;
    ++d;
  }
  const int p = prob_bits - d;
  uint32_t mode;
  if (!r.get(symbol_bits, mode)) return false;
  if (p == 0) {
    cf[mode] = (1u << prob_bits) << 16;
    return true;
  }
  uint32_t fmode;
  if (!r.get(p, fmode)) return false;
  fmode += 1;
  cf[mode] = (fmode << d) << 16;
  uint32_t remaining = (1u << p) - fmode;
  for (int j = 1; j < alphabet && remaining > 0; ++j) {
    uint32_t f;
    if (j < alphabet - 1) {
      const uint32_t bound = min(remaining, fmode), n = bound + 1;
      const int k = bit_width(n) - 1;
      const uint32_t u = (2u << k) - n;
      uint32_t x;
      if (!r.get(k, x)) return false;
      if (x < u) {
        f = x;
      } else {
        uint32_t b;
        if (!r.get(1, b)) return false;
        f = 2 * x + b - u;
        if (f > bound) return false;
      }
    } else {
      f = remaining;
      if (f > fmode) return false;
    }
    const int off = (j & 1) ? (j + 1) / 2 : -(j / 2);
    cf[(static_cast<int>(mode) + off + alphabet) & (alphabet - 1)] = (f << d) << 16;
    remaining -= f;
  }
  return remaining == 0;
}

__device__ __forceinline__ size_t round16_dev(size_t x) { return (x + 15) / 16 * 16; }

struct WarpPlan {
  int32_t result;
  int mode, lanes_log2, prob_bits, per_channel;
  uint32_t word_off;  // bytes from the stream's start
  uint32_t states[32];
};

constexpr uint32_t kHeadBytes = 1024;  // a stream's first bytes, copied for the parse

struct Args {
  SymbolStreams s;
  const uint32_t* sh_cf;   // the shared set (cum | freq << 16) [K, A + 1], global memory
  const uint8_t* sh_lut;   // its slot tables [K, 2^P] (P <= 8), or null
  int sh_tables, sh_prob_bits, sh_symbol_bits;
  int sh_smem;             // the shared set (and its slot tables) copied to shared memory
  int inline_smem;         // a stream's inline tables live in the warp's shared memory
  uint8_t* out;            // channel-major [n, C, T] (the token-major order is a second pass)
  int32_t* status;
  uint8_t* scratch;        // global: per half-warp inline tables when not in shared memory
  size_t scratch_per_half;
  size_t smem_per_half;
  int64_t warps;
};

// Element j of a raw stream (token-major) goes to its channel-major place.
__device__ __forceinline__ uint32_t raw_index(uint32_t j, uint32_t T, uint32_t C) {
  return (j % C) * T + j / C;
}

// Where one stream is and what it decodes with.
struct Job {
  const uint8_t* in = nullptr;
  uint32_t size = 0;
  int64_t index = -1;  // -1: no stream
  uint8_t* out = nullptr;
};

__device__ Job job_of(const Args& a, int64_t si) {
  Job j;
  if (si >= a.s.n) return j;
  const uint64_t b0 = a.s.offsets[si], b1 = a.s.ends ? a.s.ends[si] : a.s.offsets[si + 1];
  j.index = si;
  j.in = a.s.data + b0;
  j.size = b1 <= b0 || b1 - b0 > 0xffffffffull ? 0 : static_cast<uint32_t>(b1 - b0);
  j.out = a.out + static_cast<uint64_t>(si) * static_cast<uint64_t>(a.s.n_tokens * a.s.n_channels);
  return j;
}

// Raw and constant streams (and empty ones), by the whole warp; false for rANS streams.
__device__ bool decode_simple(const Args& a, const Job& j, int lane) {
  const uint32_t T = static_cast<uint32_t>(a.s.n_tokens), C = static_cast<uint32_t>(a.s.n_channels);
  const uint32_t n = T * C;
  const int bits = a.s.bits, A = 1 << bits;
  if (j.size == 0) {
    if (lane == 0) a.status[j.index] = kDecodeCorrupt;
    return true;
  }
  const uint8_t h0 = j.in[0];
  const int mode = h0 & 3;
  if (mode == 0) {  // raw: pack_bits of the token-major symbols
    const uint64_t want = 1 + (static_cast<uint64_t>(n) * bits + 7) / 8;
    int32_t r = h0 != 0 ? kDecodeFormat : j.size != want ? kDecodeCorrupt : kDecodedOk;
    const int used = static_cast<int>(static_cast<uint64_t>(n) * bits % 8);
    if (r == kDecodedOk && used && (j.in[j.size - 1] >> used)) r = kDecodeCorrupt;
    if (lane == 0) a.status[j.index] = r;
    if (r != kDecodedOk) return true;
    for (uint32_t k = static_cast<uint32_t>(lane); k < n; k += 32) {
      const uint64_t bit = static_cast<uint64_t>(k) * bits;
      const uint64_t byte = 1 + bit / 8;
      uint32_t w = j.in[byte];
      if ((bit % 8) + bits > 8) w |= static_cast<uint32_t>(j.in[byte + 1]) << 8;
      j.out[raw_index(k, T, C)] = static_cast<uint8_t>((w >> (bit % 8)) & (A - 1));
    }
    return true;
  }
  if (mode == 1) {  // constant
    const int32_t r = h0 != 1 ? kDecodeFormat
                      : j.size != 2 ? kDecodeCorrupt
                      : (j.in[1] >> bits) ? kDecodeCorrupt
                                          : kDecodedOk;
    if (lane == 0) a.status[j.index] = r;
    if (r != kDecodedOk) return true;
    const uint8_t c = j.in[1];
    for (uint32_t k = static_cast<uint32_t>(lane); k < n; k += 32) j.out[k] = c;
    return true;
  }
  return false;
}

// One lane's parse of a rANS stream's header, tables or table indices, and states (the
// stream's first bytes are in `head`); the verdict and what the decode needs go into `plan`.
__device__ void parse_rans(const Args& a, const Job& j, const uint8_t* head, uint8_t* map,
                           uint32_t* cf, WarpPlan& plan) {
  const int bits = a.s.bits, A = 1 << bits;
  const int C = a.s.n_channels;
  const uint8_t h0 = head[0];
  plan.result = kDecodedOk;
  plan.mode = h0 & 3;
  plan.lanes_log2 = (h0 >> 2) & 7;
  plan.per_channel = (h0 >> 5) & 1;
  plan.word_off = 0;
  const uint32_t size = j.size;
  const int P = size >= 2 ? head[1] : 0;
  plan.prob_bits = P;
  if (h0 >> 6) {
    plan.result = kDecodeFormat;
    return;
  }
  if (plan.lanes_log2 > 5 || size < 2 || P > 12) {
    plan.result = kDecodeCorrupt;
    return;
  }
  const int n_tables = plan.per_channel ? C : 1;
  const uint32_t cached = min(size, kHeadBytes);
  DevBits r{j.in + 2, static_cast<uint64_t>(size - 2) * 8, head + 2, cached - 2};
  if (plan.mode == 3) {
    if (!a.sh_cf || a.sh_symbol_bits != bits || a.sh_prob_bits != P || a.sh_tables > 256) {
      plan.result = kDecodeTables;
      return;
    }
    const int iw = bit_width(static_cast<uint32_t>(a.sh_tables - 1));
    for (int i = 0; i < n_tables; ++i) {
      uint32_t v;
      if (!r.get(iw, v) || v >= static_cast<uint32_t>(a.sh_tables)) {
        plan.result = kDecodeCorrupt;
        return;
      }
      map[i] = static_cast<uint8_t>(v);
    }
  } else {
    if (static_cast<uint64_t>(n_tables) * bits > static_cast<uint64_t>(size - 2) * 8) {
      plan.result = kDecodeCorrupt;
      return;
    }
    for (int t = 0; t < n_tables; ++t)
      if (!read_table(r, bits, P, cf + t * (A + 1))) {
        plan.result = kDecodeCorrupt;
        return;
      }
  }
  const int lanes = 1 << plan.lanes_log2;
  for (int k = 0; k < lanes; ++k) {
    uint32_t e, mant;
    if (!r.get(4, e) || !r.get(static_cast<int>(e) + P, mant)) {
      plan.result = kDecodeCorrupt;
      return;
    }
    plan.states[k] = (1u << (static_cast<int>(e) + P)) | mant;
  }
  if (!r.finish_byte()) {
    plan.result = kDecodeCorrupt;
    return;
  }
  const uint64_t off = 2 + (r.pos + 7) / 8;
  if ((size - off) % 2) plan.result = kDecodeCorrupt;
  plan.word_off = static_cast<uint32_t>(off);
}

// The interleaved rANS lanes of a stream (entropy/rans.h's decode, 2^k lanes per step) on the
// lanes [base, base + width) of the warp: width 32 (one stream per warp) or 16 (two streams of at
// most 16 states each, one per half; both halves run the loop together, for the ballots). A is
// the alphabet; cf the tables, cum | freq << 16 [tables, A + 1]; map the shared-table index of each
// channel (or of the stream, pooled), null for inline tables; lut, if not null, the shared
// tables' slot-to-symbol tables [K, 2^P]. `ok` false: this half has nothing to decode (it still
// takes part). Returns the half's verdict.
template <int A, bool kShared, bool kLut, bool kPair, bool kSmem>
__device__ int32_t decode_lanes(const Job& j, bool ok, const WarpPlan& plan, uint32_t T, uint32_t C,
                                const uint8_t* map, const uint32_t* cf, const uint8_t* lut,
                                int lane, int base, unsigned wmask) {
  if (!kPair && !ok) return kDecodedOk;  // the caller reports the parse's verdict
  // Where the tables are in shared memory, say so, so that their loads are shared-memory loads
  // rather than generic ones (the index map always is).
  if constexpr (kShared) __builtin_assume(__isShared(map));
  if constexpr (kSmem) {
    __builtin_assume(__isShared(cf));
    if constexpr (kLut) __builtin_assume(__isShared(lut));
  }
  const int hl = lane - base;
  const int P = plan.prob_bits, L = ok ? 1 << plan.lanes_log2 : 0;
  const uint32_t low = 1u << P, mask = low - 1u;
  const uint32_t n = ok ? T * C : 0;
  const bool lane_on = hl < L;
  const int per_channel = plan.per_channel;
  // Everything the loop reads is held in registers: a byte store through j.out may alias any
  // memory as far as the compiler knows, so fields of `j` (local memory) were reloaded after each
  // step's store (ncu: the reload of j.out was 22 % of the loop's stall samples).
  const uint8_t* const in = j.in;
  const uint32_t size = j.size;
  uint32_t x = lane_on ? plan.states[hl] : 0;
  uint32_t rp = plan.word_off;
  // Addresses of this lane's word of the step and of its symbol, advanced as integers (they may
  // run past the stream between the steps that use them).
  uintptr_t wa = reinterpret_cast<uintptr_t>(in) + rp + 2u * static_cast<uint32_t>(hl);
  uintptr_t oa = reinterpret_cast<uintptr_t>(j.out) + static_cast<uint32_t>(hl);
  const unsigned below = (1u << hl) - 1u;
  int32_t result = kDecodedOk;
  // Symbol i = i0 + hl is token t of channel c (the coder's order is channel-major): both
  // tracked incrementally, so the loop divides nothing. The lane's table row (and slot table)
  // is looked up again only when its table index changes.
  uint32_t t = static_cast<uint32_t>(hl) % T, c = static_cast<uint32_t>(hl) / T;
  const uint32_t Lu = static_cast<uint32_t>(L);
  const uint32_t step_c = Lu / T, step_t = Lu % T;
  uint32_t cur = ~0u;
  const uint32_t* row = cf;
  const uint8_t* lrow = lut;
  bool going = ok;
  for (uint32_t i0 = 0;; i0 += Lu, oa += Lu) {
    if constexpr (kPair) {
      going = going && i0 < n;
      if (!__any_sync(kFull, going)) break;
    } else if (i0 >= n) {
      break;
    }
    const uint32_t i = i0 + static_cast<uint32_t>(hl);
    const bool active = going && lane_on && i < n;
    // The step's words, fetched before they are known to be needed: lane k of the half holds
    // word k from rp, and a lane that needs one takes word (its rank among those that need one).
    uint32_t wv = 0;
    if (going && rp + 2u * static_cast<uint32_t>(hl) + 1 < size) {
      const auto* wp = reinterpret_cast<const uint8_t*>(wa);
      wv = wp[0] | (static_cast<uint32_t>(wp[1]) << 8);
    }
    bool need = false;
    uint32_t s = 0;
    if (active) {
      const uint32_t r = per_channel ? c : 0u;
      if (r != cur) {
        cur = r;
        uint32_t tab = r;
        if constexpr (kShared) tab = map[r];
        row = cf + tab * (A + 1);
        if constexpr (kLut) lrow = lut + (tab << P);
      }
      const uint32_t slot = x & mask;
      if constexpr (kLut) {
        s = lrow[slot];
      } else {
#pragma unroll
        for (int half = A >> 1; half > 0; half >>= 1)
          s += ((row[s + half] & 0xffffu) <= slot) ? static_cast<uint32_t>(half) : 0u;
      }
      const uint32_t e = row[s];
      x = (e >> 16) * (x >> P) + slot - (e & 0xffffu);
      need = x < low;
    }
    const unsigned mine = (__ballot_sync(kFull, need) >> base) & wmask;
    const uint32_t total = static_cast<uint32_t>(__popc(mine));
    const uint32_t w = __shfl_sync(kFull, wv, base + __popc(mine & below));
    if (going && rp + 2u * total > size) {
      result = kDecodeCorrupt;  // the word stream ends early
      if constexpr (!kPair) return result;
      going = false;
      continue;
    }
    if (need) x = (x << 16) | w;
    rp += 2u * total;
    wa += 2u * total;
    if (active) *reinterpret_cast<uint8_t*>(oa) = static_cast<uint8_t>(s);
    t += step_t;
    c += step_c;
    if (t >= T) t -= T, ++c;
  }
  const unsigned bad = (__ballot_sync(kFull, lane_on && x != low) >> base) & wmask;
  if (ok && result == kDecodedOk && (rp != size || bad)) result = kDecodeCorrupt;
  return result;
}

// The decode loop for a stream of `plan`'s mode (both halves of a pair share it).
template <int A, bool kPair>
__device__ int32_t decode_lanes_for(const Args& a, const Job& j, bool ok, const WarpPlan& plan,
                                    bool shared, const uint8_t* map, const uint32_t* inline_cf,
                                    const uint32_t* scf, const uint8_t* slut, int lane, int base,
                                    unsigned wmask) {
  const uint32_t T = static_cast<uint32_t>(a.s.n_tokens), C = static_cast<uint32_t>(a.s.n_channels);
  auto go = [&]<bool kShared, bool kLut, bool kSmem>(const uint32_t* cf, const uint8_t* lut) {
    return decode_lanes<A, kShared, kLut, kPair, kSmem>(j, ok, plan, T, C, map, cf, lut, lane,
                                                        base, wmask);
  };
  if (!shared)
    return a.inline_smem ? go.template operator()<false, false, true>(inline_cf, nullptr)
                         : go.template operator()<false, false, false>(inline_cf, nullptr);
  if (slut)
    return a.sh_smem ? go.template operator()<true, true, true>(scf, slut)
                     : go.template operator()<true, true, false>(scf, slut);
  return a.sh_smem ? go.template operator()<true, false, true>(scf, nullptr)
                   : go.template operator()<true, false, false>(scf, nullptr);
}

// Cumulative frequencies of a parsed stream's inline tables, by the lanes [base, base + width).
__device__ void finish_inline_tables(const Args& a, const WarpPlan& plan, uint32_t* cf, int hl,
                                     int width) {
  if (plan.result != kDecodedOk || plan.mode != 2) return;
  const int A = 1 << a.s.bits, n_tables = plan.per_channel ? a.s.n_channels : 1;
  for (int t = hl; t < n_tables; t += width) {
    uint32_t* row = cf + t * (A + 1);
    uint32_t c = 0;
    for (int s = 0; s <= A; ++s) {
      const uint32_t f = row[s] >> 16;
      row[s] |= c;
      c += f;
    }
  }
}

template <bool kPair>
__device__ int32_t dispatch_lanes(const Args& a, const Job& j, bool ok, const WarpPlan& plan,
                                  bool shared, const uint8_t* map, const uint32_t* inline_cf,
                                  const uint32_t* scf, const uint8_t* slut, int lane, int base,
                                  unsigned wmask) {
#define KVQ_LANES(A) \
  decode_lanes_for<A, kPair>(a, j, ok, plan, shared, map, inline_cf, scf, slut, lane, base, wmask)
  switch (a.s.bits) {
    case 1: return KVQ_LANES(2);
    case 2: return KVQ_LANES(4);
    case 3: return KVQ_LANES(8);
    case 4: return KVQ_LANES(16);
    case 5: return KVQ_LANES(32);
    case 6: return KVQ_LANES(64);
    case 7: return KVQ_LANES(128);
    default: return KVQ_LANES(256);
  }
#undef KVQ_LANES
}

// Per half-warp working memory.
struct Half {
  uint8_t* head;  // kHeadBytes, shared memory
  uint8_t* map;   // C bytes, shared memory
  uint32_t* cf;   // inline tables, shared or global memory
};

// Each warp takes two neighbouring streams at a time. When both are rANS streams of at most 16
// states, each half-warp decodes one (lanes 0 and 16 parse them side by side); otherwise the
// whole warp decodes them one after the other.
__global__ void __launch_bounds__(32 * kWarpsPerCta) decode_kernel(Args a) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ WarpPlan plans[kWarpsPerCta][2];
  __shared__ __align__(16) uint8_t heads[kWarpsPerCta][2][kHeadBytes];
  const int lane = static_cast<int>(threadIdx.x % 32), w = static_cast<int>(threadIdx.x / 32);
  const int A = 1 << a.s.bits;
  const int C = a.s.n_channels;
  // The shared table set (and its slot tables), once per CTA.
  const uint32_t* scf = a.sh_cf;
  const uint8_t* slut = a.sh_lut;
  size_t used = 0;
  if (a.sh_smem) {
    auto* f = reinterpret_cast<uint32_t*>(smem);
    const int ncf = a.sh_tables * (A + 1);
    for (int i = static_cast<int>(threadIdx.x); i < ncf; i += blockDim.x) f[i] = a.sh_cf[i];
    scf = f;
    used = round16_dev(static_cast<size_t>(ncf) * 4);
    if (a.sh_lut) {
      uint8_t* l = smem + used;
      const int nl = a.sh_tables << a.sh_prob_bits;
      for (int i = static_cast<int>(threadIdx.x); i < nl; i += blockDim.x) l[i] = a.sh_lut[i];
      slut = l;
      used += round16_dev(static_cast<size_t>(nl));
    }
  }
  __syncthreads();
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + w;
  if (warp >= a.warps) return;
  Half hs[2];
  for (int h = 0; h < 2; ++h) {
    uint8_t* mine = smem + used + static_cast<size_t>(2 * w + h) * a.smem_per_half;
    hs[h].head = heads[w][h];
    hs[h].map = mine;
    hs[h].cf = reinterpret_cast<uint32_t*>(
        a.inline_smem ? mine + (C + 15) / 16 * 16
                      : a.scratch + static_cast<size_t>(2 * warp + h) * a.scratch_per_half);
  }
  const int half = lane / 16, hl = lane % 16;
  for (int64_t s = 2 * warp; s < a.s.n; s += 2 * a.warps) {
    const Job jobs[2] = {job_of(a, s), job_of(a, s + 1)};
    // Pairable: both present, rANS of the same table kind (shared or inline: one loop for
    // both halves), at most 16 states (all read from the mode bytes).
    bool pair = jobs[1].index >= 0;
    int kind = -1;
    for (int h = 0; h < 2 && pair; ++h) {
      const uint8_t h0 = jobs[h].size ? jobs[h].in[0] : 0;
      pair = jobs[h].size >= 2 && (h0 & 3) >= 2 && (h0 >> 6) == 0 && ((h0 >> 2) & 7) <= 4 &&
             (kind < 0 || (h0 & 3) == kind);
      kind = h0 & 3;
    }
    if (pair) {
      const Job& j = jobs[half];
      const uint32_t cached = min(j.size, kHeadBytes);
      for (uint32_t k = static_cast<uint32_t>(hl); k < cached; k += 16) hs[half].head[k] = j.in[k];
      __syncwarp();
      if (hl == 0) parse_rans(a, j, hs[half].head, hs[half].map, hs[half].cf, plans[w][half]);
      __syncwarp();
      finish_inline_tables(a, plans[w][half], hs[half].cf, hl, 16);
      __syncwarp();
      const WarpPlan& plan = plans[w][half];
      const bool ok = plan.result == kDecodedOk;
      const int32_t r = dispatch_lanes<true>(a, j, ok, plan, kind == 3, hs[half].map, hs[half].cf,
                                             scf, slut, lane, 16 * half, 0xffffu);
      if (hl == 0) a.status[j.index] = ok ? r : plan.result;
      __syncwarp();
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      const Job& j = jobs[h];
      if (j.index < 0) break;
      if (decode_simple(a, j, lane)) continue;
      const uint32_t cached = min(j.size, kHeadBytes);
      for (uint32_t k = static_cast<uint32_t>(lane); k < cached; k += 32) hs[0].head[k] = j.in[k];
      __syncwarp();
      if (lane == 0) parse_rans(a, j, hs[0].head, hs[0].map, hs[0].cf, plans[w][0]);
      __syncwarp();
      finish_inline_tables(a, plans[w][0], hs[0].cf, lane, 32);
      __syncwarp();
      const WarpPlan& plan = plans[w][0];
      const bool ok = plan.result == kDecodedOk;
      const int32_t r = dispatch_lanes<false>(a, j, ok, plan, plan.mode == 3, hs[0].map, hs[0].cf,
                                              scf, slut, lane, 0, 0xffffffffu);
      if (lane == 0) a.status[j.index] = ok ? r : plan.result;
      __syncwarp();
    }
  }
}

// [n, C, T] to [n, T, C] (channel-major to token-major for the decoder, the reverse with the
// roles swapped for the encoder): one CTA per stream, its 32 x 32 tiles one
// after another through shared memory.
__global__ void __launch_bounds__(256) transpose_kernel(const uint8_t* in, uint8_t* out, int64_t T,
                                                        int64_t C) {
  __shared__ uint8_t tile[32][33];
  const int64_t s = blockIdx.x;
  const uint8_t* src = in + s * T * C;
  uint8_t* dst = out + s * T * C;
  for (int64_t c0 = 0; c0 < C; c0 += 32)
    for (int64_t t0 = 0; t0 < T; t0 += 32) {
      for (int k = static_cast<int>(threadIdx.y); k < 32; k += blockDim.y) {
        const int64_t c = c0 + k, t = t0 + threadIdx.x;
        if (c < C && t < T) tile[k][threadIdx.x] = src[c * T + t];
      }
      __syncthreads();
      for (int k = static_cast<int>(threadIdx.y); k < 32; k += blockDim.y) {
        const int64_t t = t0 + k, c = c0 + threadIdx.x;
        if (c < C && t < T) dst[t * C + c] = tile[threadIdx.x][k];
      }
      __syncthreads();
    }
}

constexpr size_t kSmemBudget = 36 * 1024;  // dynamic, below the 48 KiB default with the static ~9.5 KiB (heads, plans)

size_t round16(size_t x) { return (x + 15) / 16 * 16; }
size_t table_bytes(int n_tables, int bits) {
  return static_cast<size_t>(n_tables) * ((size_t{1} << bits) + 1) * 4;
}

struct Layout {
  int sh_smem = 0, inline_smem = 0;
  size_t smem_per_half = 0, scratch_per_half = 0, smem = 0;
  int64_t warps = 0;
};

Layout layout_for(const SymbolStreams& s, const GpuTables* shared) {
  Layout l;
  size_t sh = 0;
  if (shared) {
    sh = round16(table_bytes(shared->n_tables(), shared->symbol_bits()));
    if (shared->lut()) sh += round16(static_cast<size_t>(shared->n_tables()) << shared->prob_bits());
  }
  l.sh_smem = shared && sh <= kSmemBudget / 2;
  const size_t base = l.sh_smem ? sh : 0;
  const size_t map = round16(static_cast<size_t>(s.n_channels));
  const size_t inl = round16(table_bytes(s.n_channels, s.bits));
  l.inline_smem = base + 2 * kWarpsPerCta * (map + inl) <= kSmemBudget;
  l.smem_per_half = map + (l.inline_smem ? inl : 0);
  l.scratch_per_half = l.inline_smem ? 0 : inl;
  l.smem = base + 2 * kWarpsPerCta * l.smem_per_half;
  // Warps in flight (two streams each at a time): enough to fill the device, no more global
  // scratch than 64 MiB.
  const int64_t sms = sm_count();
  int64_t cap = sms * 48;
  if (l.scratch_per_half)
    cap = std::min<int64_t>(
        cap, std::max<int64_t>(sms, static_cast<int64_t>((size_t{32} << 20) / l.scratch_per_half)));
  l.warps = std::max<int64_t>(1, std::min((s.n + 1) / 2, cap));
  return l;
}

}  // namespace

GpuTables& GpuTables::operator=(GpuTables&& o) noexcept {
  if (this != &o) {
    cudaFree(cf_);
    cudaFree(lut_);
    cf_ = o.cf_;
    lut_ = o.lut_;
    n_tables_ = o.n_tables_, prob_bits_ = o.prob_bits_, symbol_bits_ = o.symbol_bits_;
    o.cf_ = nullptr;
    o.lut_ = nullptr;
  }
  return *this;
}

GpuTables::~GpuTables() {
  cudaFree(cf_);
  cudaFree(lut_);
}

Result<GpuTables> GpuTables::upload(const entropy::FrequencyTables& t, cudaStream_t st) {
  KVQ_RETURN_IF_ERROR(entropy::validate_tables(t));
  if (t.n_tables > 256)
    return invalid_argument("GPU tables: at most 256 shared tables, got " +
                            std::to_string(t.n_tables));
  const size_t A = static_cast<size_t>(t.alphabet()), K = static_cast<size_t>(t.n_tables);
  std::vector<uint32_t> cf(K * (A + 1));
  for (size_t k = 0; k < K; ++k) {
    uint32_t c = 0;
    for (size_t s = 0; s <= A; ++s) {
      const uint32_t f = s < A ? t.freq[k * A + s] : 0;
      cf[k * (A + 1) + s] = c | (f << 16);
      c += f;
    }
  }
  // Slot tables (slot -> symbol) where the precision is at most 2^8 (CacheGen's is 2^7).
  std::vector<uint8_t> lut;
  if (t.prob_bits <= 8) {
    const size_t M = size_t{1} << t.prob_bits;
    lut.resize(K * M);
    for (size_t k = 0; k < K; ++k) {
      size_t slot = 0;
      for (size_t s = 0; s < A; ++s)
        for (uint32_t f = 0; f < t.freq[k * A + s]; ++f) lut[k * M + slot++] = static_cast<uint8_t>(s);
    }
  }
  GpuTables g;
  if (cudaError_t e = cudaMalloc(&g.cf_, cf.size() * 4); e != cudaSuccess ||
      (!lut.empty() && (e = cudaMalloc(&g.lut_, lut.size())) != cudaSuccess)) {
    (void)cudaGetLastError();
    return cuda_error(e, "allocating the shared tables");
  }
  cudaError_t e = cudaMemcpyAsync(g.cf_, cf.data(), cf.size() * 4, cudaMemcpyHostToDevice, st);
  if (e == cudaSuccess && !lut.empty())
    e = cudaMemcpyAsync(g.lut_, lut.data(), lut.size(), cudaMemcpyHostToDevice, st);
  if (e == cudaSuccess) e = cudaStreamSynchronize(st);
  if (e != cudaSuccess) return cuda_error(e, "copying the shared tables to the GPU");
  g.n_tables_ = t.n_tables;
  g.prob_bits_ = t.prob_bits;
  g.symbol_bits_ = t.symbol_bits;
  return Result<GpuTables>(std::move(g));
}

size_t decode_scratch_bytes(const SymbolStreams& s, const GpuTables* shared, bool token_major) {
  if (shared && shared->symbol_bits() != s.bits) shared = nullptr;  // as decode_symbol_streams
  if (s.n <= 0 || s.n_channels < 1 || s.bits < 1 || s.bits > 8 || s.n_tokens < 1) return 0;
  const Layout l = layout_for(s, shared);
  const size_t tables = static_cast<size_t>(2 * l.warps) * l.scratch_per_half;
  const size_t staging = token_major ? static_cast<size_t>(s.n * s.n_tokens * s.n_channels) : 0;
  return round16(tables) + staging;
}

Status decode_symbol_streams(const SymbolStreams& s, const GpuTables* shared, bool token_major,
                             uint8_t* out, int32_t* status, void* scratch, size_t scratch_bytes,
                             cudaStream_t st) {
  // Tables of another width serve none of these streams: their shared-table streams are refused
  // (kDecodeTables, the CPU's invalid_argument), the others decode as without tables.
  if (shared && shared->symbol_bits() != s.bits) shared = nullptr;
  if (s.bits < 1 || s.bits > 8)
    return invalid_argument("GPU symbol decode: bits " + std::to_string(s.bits) + " outside 1..8");
  if (s.n_channels < 1 || s.n_tokens < 1)
    return invalid_argument("GPU symbol decode: n_tokens and n_channels must be >= 1");
  if (s.n_tokens * s.n_channels > (int64_t{1} << 31))
    return invalid_argument("GPU symbol decode: at most 2^31 symbols per stream");
  if (s.n < 0) return invalid_argument("GPU symbol decode: negative stream count");
  if (s.n == 0) return ok_status();
  if (!s.data || !s.offsets || !out || !status)
    return invalid_argument("GPU symbol decode: null device pointer");
  const size_t need = decode_scratch_bytes(s, shared, token_major);
  if (scratch_bytes < need || (need && !scratch))
    return invalid_argument("GPU symbol decode: scratch of " + std::to_string(scratch_bytes) +
                            " bytes, " + std::to_string(need) + " needed");
  const Layout l = layout_for(s, shared);
  if (l.smem > kSmemBudget + 2 * 1024)  // the per-channel table indices alone outgrow it
    return unsupported("GPU symbol decode: " + std::to_string(s.n_channels) +
                       " channels need " + std::to_string(l.smem) +
                       " bytes of shared memory per thread block; decode on the CPU");
  Args a{};
  a.s = s;
  if (shared) {
    a.sh_cf = shared->cf();
    a.sh_lut = shared->lut();
    a.sh_tables = shared->n_tables();
    a.sh_prob_bits = shared->prob_bits();
    a.sh_symbol_bits = shared->symbol_bits();
  }
  a.sh_smem = l.sh_smem;
  a.inline_smem = l.inline_smem;
  a.status = status;
  a.scratch = static_cast<uint8_t*>(scratch);
  a.scratch_per_half = l.scratch_per_half;
  a.smem_per_half = l.smem_per_half;
  a.warps = l.warps;
  uint8_t* staging =
      static_cast<uint8_t*>(scratch) + round16(static_cast<size_t>(2 * l.warps) * l.scratch_per_half);
  a.out = token_major ? staging : out;
  const unsigned ctas = static_cast<unsigned>((a.warps + kWarpsPerCta - 1) / kWarpsPerCta);
  decode_kernel<<<ctas, 32 * kWarpsPerCta, l.smem, st>>>(a);
  if (token_major) launch_transpose_bytes(staging, out, s.n, s.n_channels, s.n_tokens, st);
  if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return cuda_error(e, "launching the GPU symbol decode");
  return ok_status();
}

void launch_transpose_bytes(const uint8_t* in, uint8_t* out, int64_t n, int64_t rows, int64_t cols,
                            cudaStream_t st) {
  const int64_t per = rows * cols;
  for (int64_t s0 = 0; s0 < n; s0 += int64_t{1} << 30) {
    const int64_t m = std::min<int64_t>(int64_t{1} << 30, n - s0);
    transpose_kernel<<<static_cast<unsigned>(m), dim3(32, 8), 0, st>>>(in + s0 * per,
                                                                       out + s0 * per, cols, rows);
  }
}

Status decode_status(const int32_t* status, int64_t n, cudaStream_t st) {
  std::vector<int32_t> h(static_cast<size_t>(std::max<int64_t>(n, 0)));
  if (n > 0) {
    cudaError_t e = cudaMemcpyAsync(h.data(), status, h.size() * 4, cudaMemcpyDeviceToHost, st);
    if (e == cudaSuccess) e = cudaStreamSynchronize(st);
    if (e != cudaSuccess) return cuda_error(e, "reading the GPU symbol decode's results");
  }
  for (int64_t i = 0; i < n; ++i) {
    const std::string at = "symbol stream " + std::to_string(i) + " (GPU decode): ";
    switch (h[static_cast<size_t>(i)]) {
      case kDecodedOk: break;
      case kDecodeFormat: return format_error(at + "unknown mode or reserved header bits set");
      case kDecodeTables: return invalid_argument(at + "needs shared tables that match it");
      default: return corrupt(at + "inconsistent stream");
    }
  }
  return ok_status();
}

}  // namespace kvq::cuda
