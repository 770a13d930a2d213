#include "entropy/rans.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VBMI2__) && defined(__BMI2__)
#define KVQ_RANS_AVX512 1
// GCC 12's intrinsic headers initialise "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined (GCC bug 105593); the vectors are fully overwritten.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#else
#define KVQ_RANS_AVX512 0
#endif

namespace kvq::entropy {

namespace {

constexpr uint32_t kWordBits = 16;

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);  // little-endian host (asserted in core/byte_io.h)
  return v;
}
inline void store_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }

// ---------------------------------------------------------------------------------------------
// Scalar reference. Walks i = n-1 .. 0 (encode) or 0 .. n-1 (decode); lane = i % lanes.

// Encodes symbols (i_begin, i_end] downwards, i.e. i = i_end - 1 .. i_begin. Writes words
// backwards from *wp. Returns false on an uncodable symbol.
bool encode_scalar(const RansModel& m, const uint8_t* symbols, size_t i_begin, size_t i_end,
                   int lanes_log2, uint32_t* st, uint8_t*& wp) {
  const int a = m.alphabet();
  const uint32_t nt = static_cast<uint32_t>(m.n_tables);
  const uint32_t p = static_cast<uint32_t>(m.prob_bits);
  const size_t lane_mask = (size_t{1} << lanes_log2) - 1;
  if (i_end <= i_begin) return true;
  uint32_t t = static_cast<uint32_t>((i_end - 1) % nt);
  for (size_t i = i_end; i-- > i_begin;) {
    const uint32_t s = symbols[i];
    if (s >= static_cast<uint32_t>(a)) return false;
    const size_t e = static_cast<size_t>(t) * a + s;
    const uint32_t f = m.freq[e];
    if (f == 0) return false;
    const uint32_t start = m.cum[static_cast<size_t>(t) * (a + 1) + s];
    uint32_t x = st[i & lane_mask];
    if (x >= (f << kWordBits)) {
      wp -= 2;
      store_u16(wp, static_cast<uint16_t>(x));
      x >>= kWordBits;
    }
    x = ((x / f) << p) + (x % f) + start;
    st[i & lane_mask] = x;
    t = (t == 0) ? nt - 1 : t - 1;
  }
  return true;
}

// Decodes symbols [i_begin, n). Reads words from *rp (bounded by end). False on underrun.
bool decode_scalar(const RansModel& m, size_t i_begin, size_t n, int lanes_log2, uint32_t* st,
                   const uint8_t*& rp, const uint8_t* end, uint8_t* out) {
  const int a = m.alphabet();
  const uint32_t nt = static_cast<uint32_t>(m.n_tables);
  const uint32_t p = static_cast<uint32_t>(m.prob_bits);
  const uint32_t mask = (1u << p) - 1u;
  const uint32_t low = 1u << p;
  const size_t lane_mask = (size_t{1} << lanes_log2) - 1;
  uint32_t t = static_cast<uint32_t>(i_begin % nt);
  for (size_t i = i_begin; i < n; ++i) {
    uint32_t x = st[i & lane_mask];
    const uint32_t slot = x & mask;
    const uint16_t* cum = m.cum.data() + static_cast<size_t>(t) * (a + 1);
    // Last s with cum[s] <= slot. Absent symbols share their successor's cum, and cum[a] = M >
    // slot, so the answer is always a present symbol. Branch-free binary search (a is a power of
    // two): a branchy search mispredicts about once per level on real data.
    int s = 0;
    for (int half = a >> 1; half > 0; half >>= 1) s += (cum[s + half] <= slot) ? half : 0;
    const uint32_t f = m.freq[static_cast<size_t>(t) * a + s];
    x = f * (x >> p) + slot - cum[s];
    if (x < low) {
      if (end - rp < 2) return false;
      x = (x << kWordBits) | load_u16(rp);
      rp += 2;
    }
    st[i & lane_mask] = x;
    out[i] = static_cast<uint8_t>(s);
    t = (t + 1 == nt) ? 0 : t + 1;
  }
  return true;
}

#if KVQ_RANS_AVX512
// ---------------------------------------------------------------------------------------------
// AVX-512. G groups of 16 lanes (lanes = 16 G). One "step" is N = 16 G consecutive symbols, one
// per lane; within a step the groups are processed in order (decode) or reverse order (encode),
// which reproduces the scalar word order exactly.

// Symbol search: each lane compares its slot with the packed entries of its own table (column
// = table index, consecutive lanes = consecutive columns), keeping the last entry whose cum is
// <= slot. Two instructions per alphabet symbol and no table larger than A * (T + 15) words, so
// per-chunk tables cost nothing to prepare (a 2^P-slot lookup table per channel would cost more
// to build than the chunk costs to decode). Entries are non-decreasing in s, so the search runs
// as independent chains of 4 symbols joined by a small tree: the step is latency-bound with 16
// lanes, and one 15-long blend chain would double its critical path.
template <int A>
inline __m512i search_avx512(const uint32_t* tc, size_t w, __m512i key) {
  constexpr int kChain = A < 4 ? A : 4;
  constexpr int kChains = A / kChain;
  __m512i part[kChains];
  __mmask16 head[kChains];
  for (int c = 0; c < kChains; ++c) {
    const __m512i v0 = _mm512_loadu_si512(tc + (c * kChain) * w);
    part[c] = v0;
    head[c] = _mm512_cmple_epu32_mask(v0, key);
    for (int s = c * kChain + 1; s < (c + 1) * kChain; ++s) {
      const __m512i v = _mm512_loadu_si512(tc + s * w);
      part[c] = _mm512_mask_mov_epi32(part[c], _mm512_cmple_epu32_mask(v, key), v);
    }
  }
  if constexpr (kChains == 1) {
    return part[0];
  } else if constexpr (kChains == 2) {
    return _mm512_mask_mov_epi32(part[0], head[1], part[1]);
  } else {
    static_assert(kChains == 4);
    const __m512i lo = _mm512_mask_mov_epi32(part[0], head[1], part[1]);
    const __m512i hi = _mm512_mask_mov_epi32(part[2], head[3], part[3]);
    return _mm512_mask_mov_epi32(lo, head[2], hi);
  }
}

template <int A, int G>
size_t decode_avx512(const RansModel& m, size_t n, uint32_t* st, const uint8_t*& rp,
                     const uint8_t* end, uint8_t* out) {
  constexpr size_t kN = 16 * G;
  const int p = m.prob_bits;
  const uint32_t nt = static_cast<uint32_t>(m.n_tables);
  const size_t w = static_cast<size_t>(m.dec_width);
  const uint32_t* tab = m.dec_packed.data();
  const __m128i sh_key = _mm_cvtsi32_si128(32 - p);
  const __m128i sh_p = _mm_cvtsi32_si128(p);
  const __m512i key_low = _mm512_set1_epi32(static_cast<int>((1u << (32 - p)) - 1u));
  const __m512i slot_mask = _mm512_set1_epi32(static_cast<int>((1u << p) - 1u));
  const __m512i f_mask = _mm512_set1_epi32(static_cast<int>((2u << p) - 1u));
  const __m512i sym_mask = _mm512_set1_epi32(15);
  const __m512i low = _mm512_set1_epi32(static_cast<int>(1u << p));
  __m512i x[G];
  uint32_t col[G];
  for (int g = 0; g < G; ++g) {
    x[g] = _mm512_loadu_si512(st + 16 * g);
    col[g] = static_cast<uint32_t>((16 * g) % nt);
  }
  const uint32_t dstep = static_cast<uint32_t>(kN % nt);
  const size_t steps = n / kN;
  size_t k = 0;
  for (; k < steps && end - rp >= static_cast<ptrdiff_t>(2 * kN); ++k) {
    for (int g = 0; g < G; ++g) {
      const __m512i key = _mm512_or_si512(_mm512_sll_epi32(x[g], sh_key), key_low);
      const __m512i sel = search_avx512<A>(tab + col[g], w, key);
      const __m512i sym = _mm512_and_si512(sel, sym_mask);
      const __m512i f = _mm512_and_si512(_mm512_srli_epi32(sel, 4), f_mask);
      const __m512i start = _mm512_srl_epi32(sel, sh_key);
      const __m512i slot = _mm512_and_si512(x[g], slot_mask);
      __m512i nx = _mm512_add_epi32(_mm512_mullo_epi32(f, _mm512_srl_epi32(x[g], sh_p)),
                                    _mm512_sub_epi32(slot, start));
      const __mmask16 r = _mm512_cmplt_epu32_mask(nx, low);
      // Renormalize: lanes in r take the next words in lane order. Expanding 16-bit words and
      // zero-extending keeps the mask in a k register (no round trip through pdep).
      const __m512i words = _mm512_cvtepu16_epi32(_mm256_maskz_expandloadu_epi16(r, rp));
      nx = _mm512_mask_or_epi32(nx, r, _mm512_slli_epi32(nx, 16), words);
      rp += 2 * std::popcount(static_cast<unsigned>(r));
      x[g] = nx;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k * kN + 16 * g),
                       _mm512_cvtepi32_epi8(sym));
      col[g] += dstep;
      if (col[g] >= nt) col[g] -= nt;
    }
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_si512(st + 16 * g, x[g]);
  return k * kN;
}

// Encodes full steps k = k_end-1 .. 0. Returns false on an uncodable symbol.
template <int G>
bool encode_avx512(const RansModel& m, const uint8_t* symbols, size_t k_end, uint32_t* st,
                   uint8_t*& wp) {
  constexpr size_t kN = 16 * G;
  const int a = m.alphabet();
  const uint32_t nt = static_cast<uint32_t>(m.n_tables);
  const int p = m.prob_bits;
  const __m512i amask = _mm512_set1_epi32(a - 1);
  const __m512i avec = _mm512_set1_epi32(a);
  const __m512i m12 = _mm512_set1_epi32(0xFFF);
  const __m512i m13 = _mm512_set1_epi32(0x1FFF);
  const __m512i lo64 = _mm512_set1_epi64(0xFFFFFFFFll);
  const __m512i total = _mm512_set1_epi32(1 << p);
  const __m512i zero = _mm512_setzero_si512();
  __m512i x[G];
  uint32_t col[G];
  const uint32_t dstep = static_cast<uint32_t>(kN % nt);
  for (int g = 0; g < G; ++g) {
    x[g] = _mm512_loadu_si512(st + 16 * g);
    // Column of symbol (k_end - 1) * N + 16 g, walked downwards.
    col[g] = k_end ? static_cast<uint32_t>(((k_end - 1) * kN + 16 * g) % nt) : 0;
  }
  __mmask16 bad = 0;
  for (size_t k = k_end; k-- > 0;) {
    for (int g = G - 1; g >= 0; --g) {
      const __m512i sv = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(symbols + k * kN + 16 * g)));
      bad |= _mm512_cmpge_epu32_mask(sv, avec);
      const __m512i idx = _mm512_add_epi32(
          _mm512_loadu_si512(m.enc_base.data() + col[g]), _mm512_and_si512(sv, amask));
      // The masked form with an explicit source avoids GCC's false -Wmaybe-uninitialized.
      const __m512i rcp = _mm512_mask_i32gather_epi32(zero, 0xFFFF, idx, m.enc_rcp.data(), 4);
      const __m512i info = _mm512_mask_i32gather_epi32(zero, 0xFFFF, idx, m.enc_info.data(), 4);
      const __m512i start = _mm512_and_si512(info, m12);
      const __m512i f = _mm512_and_si512(_mm512_srli_epi32(info, 12), m13);
      const __m512i sh = _mm512_srli_epi32(info, 25);
      bad |= _mm512_cmpeq_epi32_mask(f, zero);
      __m512i xv = x[g];
      const __mmask16 r = _mm512_cmpge_epu32_mask(xv, _mm512_slli_epi32(f, 16));
      const unsigned cnt = static_cast<unsigned>(std::popcount(static_cast<unsigned>(r)));
      wp -= 2 * cnt;
      _mm256_mask_storeu_epi16(wp, static_cast<__mmask16>((1u << cnt) - 1u),
                               _mm256_maskz_compress_epi16(r, _mm512_cvtepi32_epi16(xv)));
      xv = _mm512_mask_srli_epi32(xv, r, xv, 16);
      // q = (x * rcp) >> sh in 64-bit arithmetic, even and odd lanes separately.
      const __m512i pe = _mm512_mul_epu32(xv, rcp);
      const __m512i po = _mm512_mul_epu32(_mm512_srli_epi64(xv, 32), _mm512_srli_epi64(rcp, 32));
      const __m512i qe = _mm512_srlv_epi64(pe, _mm512_and_si512(sh, lo64));
      const __m512i qo = _mm512_srlv_epi64(po, _mm512_srli_epi64(sh, 32));
      const __m512i q = _mm512_or_si512(qe, _mm512_slli_epi64(qo, 32));
      xv = _mm512_add_epi32(_mm512_add_epi32(xv, start),
                            _mm512_mullo_epi32(q, _mm512_sub_epi32(total, f)));
      x[g] = xv;
      col[g] = col[g] >= dstep ? col[g] - dstep : col[g] + nt - dstep;
    }
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_si512(st + 16 * g, x[g]);
  return bad == 0;
}

template <int G>
size_t decode_avx512_dispatch(const RansModel& m, size_t n, uint32_t* st, const uint8_t*& rp,
                              const uint8_t* end, uint8_t* out) {
  switch (m.symbol_bits) {
    case 1: return decode_avx512<2, G>(m, n, st, rp, end, out);
    case 2: return decode_avx512<4, G>(m, n, st, rp, end, out);
    case 3: return decode_avx512<8, G>(m, n, st, rp, end, out);
    case 4: return decode_avx512<16, G>(m, n, st, rp, end, out);
    default: return 0;
  }
}
#endif  // KVQ_RANS_AVX512

}  // namespace

bool rans_simd_available() { return KVQ_RANS_AVX512 != 0; }

Result<RansModel> make_rans_model(const FrequencyTables& tables, RansModelUse use) {
  const bool enc = static_cast<int>(use) & 1, dec = static_cast<int>(use) & 2;
  KVQ_RETURN_IF_ERROR(validate_tables(tables));
  RansModel m;
  m.symbol_bits = tables.symbol_bits;
  m.prob_bits = tables.prob_bits;
  m.n_tables = tables.n_tables;
  const size_t a = static_cast<size_t>(tables.alphabet());
  const size_t nt = static_cast<size_t>(tables.n_tables);
  m.freq = tables.freq;
  m.cum.assign(nt * (a + 1), 0);
  if (enc) {
    m.enc_rcp.assign(nt * a, 0);
    m.enc_info.assign(nt * a, 0);
  }
  for (size_t t = 0; t < nt; ++t) {
    uint32_t c = 0;
    for (size_t s = 0; s < a; ++s) {
      const uint32_t f = m.freq[t * a + s];
      m.cum[t * (a + 1) + s] = static_cast<uint16_t>(c);
      if (f && enc) {
        const int l = std::bit_width(f) - 1;
        const uint64_t rcp = ((uint64_t{1} << (31 + l)) + f - 1) / f;
        m.enc_rcp[t * a + s] = static_cast<uint32_t>(rcp);
        m.enc_info[t * a + s] = c | (f << 12) | (static_cast<uint32_t>(31 + l) << 25);
      }
      c += f;
    }
    m.cum[t * (a + 1) + a] = static_cast<uint16_t>(c);
  }
  if (enc) {
    m.enc_base.resize(nt + 15);
    for (size_t j = 0; j < nt + 15; ++j) m.enc_base[j] = static_cast<uint32_t>((j % nt) * a);
  }
  if (dec && a <= 16 && m.prob_bits >= 1) {
    const int p = m.prob_bits;
    m.dec_width = static_cast<int>(nt + 15);
    m.dec_packed.assign(a * (nt + 15), 0);
    for (size_t j = 0; j < nt + 15; ++j) {
      const size_t t = j % nt;
      uint32_t prev = 0;
      bool have_prev = false;
      // Absent symbols before the first present one take the first present entry (cum 0).
      for (size_t s = 0; s < a && !have_prev; ++s)
        if (m.freq[t * a + s]) prev = (static_cast<uint32_t>(s) | (uint32_t{m.freq[t * a + s]} << 4)),
                               have_prev = true;
      for (size_t s = 0; s < a; ++s) {
        const uint32_t f = m.freq[t * a + s];
        if (f)
          prev = (uint32_t{m.cum[t * (a + 1) + s]} << (32 - p)) | (f << 4) |
                 static_cast<uint32_t>(s);
        m.dec_packed[s * (nt + 15) + j] = prev;
      }
    }
  }
  return m;
}

Status rans_encode(const RansModel& m, const uint8_t* symbols, size_t n, int lanes_log2,
                   uint32_t* final_states, std::vector<uint8_t>& words, RansImpl impl) {
  if (lanes_log2 < 0 || lanes_log2 > kMaxLanesLog2)
    return invalid_argument("rANS encode: lanes_log2 " + std::to_string(lanes_log2) +
                            " outside 0..5");
  KVQ_CHECK(!m.enc_base.empty());  // model prepared for encoding
  (void)impl;                      // only consulted where the AVX-512 paths are compiled in
  const size_t lanes = size_t{1} << lanes_log2;
  uint32_t st[32];
  for (size_t j = 0; j < lanes; ++j) st[j] = 1u << m.prob_bits;
  // At most one word per symbol; written backwards from the end of a scratch buffer.
  std::vector<uint8_t> buf(2 * n + 64);
  uint8_t* const buf_end = buf.data() + buf.size();
  uint8_t* wp = buf_end;
  bool ok = true;
  size_t done_below = n;  // symbols [done_below, n) still to encode with the scalar path
#if KVQ_RANS_AVX512
  if (impl == RansImpl::kAuto && (lanes == 16 || lanes == 32)) {
    const size_t full = n / lanes;
    ok = encode_scalar(m, symbols, full * lanes, n, lanes_log2, st, wp);
    if (ok) {
      ok = (lanes == 16) ? encode_avx512<1>(m, symbols, full, st, wp)
                         : encode_avx512<2>(m, symbols, full, st, wp);
    }
    done_below = 0;
  }
#endif
  if (done_below > 0) ok = encode_scalar(m, symbols, 0, n, lanes_log2, st, wp);
  if (!ok)
    return invalid_argument("rANS encode: a symbol is >= 2^" + std::to_string(m.symbol_bits) +
                            " or has frequency 0 in its table");
  words.insert(words.end(), wp, buf_end);
  std::copy(st, st + lanes, final_states);
  return ok_status();
}

Status rans_decode(const RansModel& m, const uint32_t* initial_states, const uint8_t* words,
                   size_t size, size_t n, int lanes_log2, uint8_t* out, RansImpl impl) {
  if (lanes_log2 < 0 || lanes_log2 > kMaxLanesLog2)
    return invalid_argument("rANS decode: lanes_log2 " + std::to_string(lanes_log2) +
                            " outside 0..5");
  const size_t lanes = size_t{1} << lanes_log2;
  const uint32_t low = 1u << m.prob_bits;
  const uint64_t high = uint64_t{low} << kWordBits;
  uint32_t st[32];
  for (size_t j = 0; j < lanes; ++j) {
    if (initial_states[j] < low || initial_states[j] >= high)
      return corrupt("rANS stream: initial state of lane " + std::to_string(j) + " out of range");
    st[j] = initial_states[j];
  }
  const uint8_t* rp = words;
  const uint8_t* const end = words + size;
  size_t done = 0;
#if KVQ_RANS_AVX512
  if (impl == RansImpl::kAuto && !m.dec_packed.empty() && (lanes == 16 || lanes == 32)) {
    done = (lanes == 16) ? decode_avx512_dispatch<1>(m, n, st, rp, end, out)
                         : decode_avx512_dispatch<2>(m, n, st, rp, end, out);
  }
#else
  (void)impl;
#endif
  if (!decode_scalar(m, done, n, lanes_log2, st, rp, end, out))
    return corrupt("rANS stream: word stream ends early");
  if (rp != end)
    return corrupt("rANS stream: " + std::to_string(end - rp) + " bytes left after decoding");
  for (size_t j = 0; j < lanes; ++j)
    if (st[j] != low)
      return corrupt("rANS stream: final state of lane " + std::to_string(j) +
                     " is not the initial state");
  return ok_status();
}

size_t states_bits(const uint32_t* states, int lanes, int prob_bits) {
  size_t bits = 0;
  for (int j = 0; j < lanes; ++j) bits += 4 + static_cast<size_t>(std::bit_width(states[j]) - 1);
  (void)prob_bits;
  return bits;
}

void write_states(BitWriter& w, const uint32_t* states, int lanes, int prob_bits) {
  for (int j = 0; j < lanes; ++j) {
    const int top = std::bit_width(states[j]) - 1;  // in [P, P + 15]
    KVQ_CHECK(top >= prob_bits && top < prob_bits + 16);
    w.put(static_cast<uint32_t>(top - prob_bits), 4);
    w.put(states[j], top);  // the bits below the leading one
  }
}

Status read_states(BitReader& r, uint32_t* states, int lanes, int prob_bits) {
  for (int j = 0; j < lanes; ++j) {
    uint32_t e, mant;
    if (!r.get(4, e)) return corrupt("rANS stream: truncated state block");
    const int top = static_cast<int>(e) + prob_bits;
    if (!r.get(top, mant)) return corrupt("rANS stream: truncated state block");
    states[j] = (1u << top) | mant;
  }
  return ok_status();
}

Status rans_encode_stream(const RansModel& m, const uint8_t* symbols, size_t n, int lanes_log2,
                          std::vector<uint8_t>& out, RansImpl impl) {
  uint32_t st[32];
  std::vector<uint8_t> words;
  KVQ_RETURN_IF_ERROR(rans_encode(m, symbols, n, lanes_log2, st, words, impl));
  BitWriter w(out);
  write_states(w, st, 1 << lanes_log2, m.prob_bits);
  w.flush();
  out.insert(out.end(), words.begin(), words.end());
  return ok_status();
}

Status rans_decode_stream(const RansModel& m, const uint8_t* in, size_t size, size_t n,
                          int lanes_log2, uint8_t* out, RansImpl impl) {
  if (lanes_log2 < 0 || lanes_log2 > kMaxLanesLog2)
    return invalid_argument("rANS decode: lanes_log2 outside 0..5");
  uint32_t st[32];
  BitReader r(in, size);
  KVQ_RETURN_IF_ERROR(read_states(r, st, 1 << lanes_log2, m.prob_bits));
  if (!r.finish_byte()) return corrupt("rANS stream: nonzero padding after the state block");
  const size_t off = r.byte_position();
  if ((size - off) % 2) return corrupt("rANS stream: odd number of word bytes");
  return rans_decode(m, st, in + off, size - off, n, lanes_log2, out, impl);
}

}  // namespace kvq::entropy
