#include "entropy/rans.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>

#include "core/cpu.h"

#if KVQ_SIMD_X86
// GCC 12's intrinsic headers initialise "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined (GCC bug 105593); the vectors are fully overwritten.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
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

// Table of run r: map[r] when runs name their tables, else r % n_tables.
inline uint32_t run_table(const uint8_t* map, size_t r, uint32_t nt) {
  return map ? map[r] : static_cast<uint32_t>(r % nt);
}

// Table of symbol i, and the position of i inside its run, tracked incrementally.
struct RunCursor {
  size_t run;
  uint32_t nt;
  const uint8_t* map;
  size_t map_runs;  // entries in map
  size_t r;
  uint32_t t;
  size_t pos;
  RunCursor(size_t i, size_t run_len, uint32_t n_tables, const uint8_t* run_map, size_t runs)
      : run(run_len),
        nt(n_tables),
        map(run_map),
        map_runs(runs),
        r(i / run_len),
        t(run_table(run_map, i / run_len, n_tables)),
        pos(i % run_len) {}
  void next() {
    if (++pos == run) {
      pos = 0;
      ++r;
      t = map ? (r < map_runs ? map[r] : 0) : (t + 1 == nt ? 0 : t + 1);
    }
  }
  void prev() {
    if (pos == 0) {
      pos = run - 1;
      if (r > 0) --r;
      t = map ? map[r] : (t == 0 ? nt - 1 : t - 1);
    } else {
      --pos;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Scalar reference. Walks i = n-1 .. 0 (encode) or 0 .. n-1 (decode); lane = i % lanes,
// table = (i / run) % n_tables.

// Encodes symbols [i_begin, i_end) downwards, i.e. i = i_end - 1 .. i_begin. Writes words
// backwards from *wp. Returns false on an uncodable symbol.
bool encode_scalar(const RansModel& m, const uint8_t* symbols, size_t i_begin, size_t i_end,
                   size_t run, const uint8_t* map, size_t runs, int lanes_log2, uint32_t* st,
                   uint8_t*& wp) {
  const int a = m.alphabet();
  const uint32_t p = static_cast<uint32_t>(m.prob_bits);
  const size_t lane_mask = (size_t{1} << lanes_log2) - 1;
  if (i_end <= i_begin) return true;
  RunCursor cur(i_end - 1, run, static_cast<uint32_t>(m.n_tables), map, runs);
  for (size_t i = i_end; i-- > i_begin; cur.prev()) {
    const uint32_t s = symbols[i];
    if (s >= static_cast<uint32_t>(a)) return false;
    const size_t e = static_cast<size_t>(cur.t) * a + s;
    const uint32_t f = m.freq[e];
    if (f == 0) return false;
    const uint32_t start = m.cum[static_cast<size_t>(cur.t) * (a + 1) + s];
    uint32_t x = st[i & lane_mask];
    if (x >= (f << kWordBits)) {
      wp -= 2;
      store_u16(wp, static_cast<uint16_t>(x));
      x >>= kWordBits;
    }
    x = ((x / f) << p) + (x % f) + start;
    st[i & lane_mask] = x;
  }
  return true;
}

// Decodes symbols [i_begin, n). Reads words from *rp (bounded by end). False on underrun.
bool decode_scalar(const RansModel& m, size_t i_begin, size_t n, size_t run, const uint8_t* map,
                   size_t runs, int lanes_log2, uint32_t* st, const uint8_t*& rp,
                   const uint8_t* end, uint8_t* out) {
  const int a = m.alphabet();
  const uint32_t p = static_cast<uint32_t>(m.prob_bits);
  const uint32_t mask = (1u << p) - 1u;
  const uint32_t low = 1u << p;
  const size_t lane_mask = (size_t{1} << lanes_log2) - 1;
  if (i_begin >= n) return true;
  RunCursor cur(i_begin, run, static_cast<uint32_t>(m.n_tables), map, runs);
  for (size_t i = i_begin; i < n; ++i, cur.next()) {
    uint32_t x = st[i & lane_mask];
    const uint32_t slot = x & mask;
    const uint16_t* cum = m.cum.data() + static_cast<size_t>(cur.t) * (a + 1);
    // Last s with cum[s] <= slot. Absent symbols share their successor's cum, and cum[a] = M >
    // slot, so the answer is always a present symbol. Branch-free binary search (a is a power of
    // two): a branchy search mispredicts about once per level on real data.
    int s = 0;
    for (int half = a >> 1; half > 0; half >>= 1) s += (cum[s + half] <= slot) ? half : 0;
    const uint32_t f = m.freq[static_cast<size_t>(cur.t) * a + s];
    x = f * (x >> p) + slot - cum[s];
    if (x < low) {
      if (end - rp < 2) return false;
      x = (x << kWordBits) | load_u16(rp);
      rp += 2;
    }
    st[i & lane_mask] = x;
    out[i] = static_cast<uint8_t>(s);
  }
  return true;
}

// Builds the slot tables of one table (P <= 7): lut[0][j] symbol, lut[1][j] j - cum, lut[2][j] f.
void build_lut_scalar(const uint16_t* freq, const uint16_t* cum, int a, int p, uint8_t* lut) {
  std::memset(lut, 0, 3 * kLutSlots);
  for (int s = 0; s < a; ++s) {
    const int f = freq[s], c = cum[s];
    for (int j = 0; j < f; ++j) {
      lut[c + j] = static_cast<uint8_t>(s);
      lut[kLutSlots + c + j] = static_cast<uint8_t>(j);
      lut[2 * kLutSlots + c + j] = static_cast<uint8_t>(f);
    }
  }
  (void)p;
}

#if KVQ_SIMD_X86
// ---------------------------------------------------------------------------------------------
// AVX-512. G groups of 16 lanes (lanes = 16 G). One "step" is N = 16 G consecutive symbols, one
// per lane; within a step the groups are processed in order (decode) or reverse order (encode),
// which reproduces the scalar word order exactly. Callers guarantee that a step never straddles
// two runs (run % N == 0, or a single table), so a step has one table.

// Slot tables for alphabets <= 64 and P <= 7: 64 byte lanes hold slots j (and j + 64); the
// symbol of slot j is the number of symbols whose range ends at or below j (absent symbols end
// where they start, so they are counted exactly when their successor's range has begun).
// The first a (<= 64) entries of a u16 array as bytes in a register (zero above). Converted in
// registers: staging them through byte stores and a wide load stalls on store forwarding.
KVQ_TARGET_AVX512 inline __m512i u16_to_bytes(const uint16_t* v, int a) {
  const __mmask32 k0 = a >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << a) - 1);
  const __m256i lo = _mm512_cvtepi16_epi8(_mm512_maskz_loadu_epi16(k0, v));
  if (a <= 32) return _mm512_zextsi256_si512(lo);
  const __m256i hi = _mm512_cvtepi16_epi8(_mm512_loadu_si512(v + 32));
  return _mm512_inserti64x4(_mm512_zextsi256_si512(lo), hi, 1);
}

KVQ_TARGET_AVX512 void build_lut_avx512(const uint16_t* freq, const uint16_t* cum, int a, int p,
                                        uint8_t* lut) {
  const __m512i fv = u16_to_bytes(freq, a), cv = u16_to_bytes(cum, a);
  const __m512i iota = _mm512_set_epi8(
      63, 62, 61, 60, 59, 58, 57, 56, 55, 54, 53, 52, 51, 50, 49, 48, 47, 46, 45, 44, 43, 42, 41,
      40, 39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18,
      17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int halves = p > 6 ? 2 : 1;
  for (int hf = 0; hf < 2; ++hf) {
    if (hf >= halves) {
      const __m512i z = _mm512_setzero_si512();
      _mm512_storeu_si512(lut + 64, z);
      _mm512_storeu_si512(lut + kLutSlots + 64, z);
      _mm512_storeu_si512(lut + 2 * kLutSlots + 64, z);
      break;
    }
    const __m512i j = _mm512_add_epi8(iota, _mm512_set1_epi8(static_cast<char>(64 * hf)));
    __m512i sym = _mm512_setzero_si512();
    for (int s = 0; s + 1 < a; ++s) {
      // cum[s + 1] <= j (unsigned; a cum of 128, after the last present symbol, is above every
      // slot).
      const __mmask64 k =
          _mm512_cmple_epu8_mask(_mm512_set1_epi8(static_cast<char>(cum[s + 1])), j);
      sym = _mm512_mask_sub_epi8(sym, k, sym, _mm512_set1_epi8(-1));
    }
    const __mmask64 valid = _mm512_cmplt_epu8_mask(j, _mm512_set1_epi8(static_cast<char>(1 << p)));
    const __m512i f = _mm512_maskz_permutexvar_epi8(valid, sym, fv);
    const __m512i bias = _mm512_maskz_sub_epi8(valid, j, _mm512_permutexvar_epi8(sym, cv));
    _mm512_storeu_si512(lut + 64 * hf, _mm512_maskz_mov_epi8(valid, sym));
    _mm512_storeu_si512(lut + kLutSlots + 64 * hf, bias);
    _mm512_storeu_si512(lut + 2 * kLutSlots + 64 * hf, f);
  }
}

// Renormalizes the lanes of nx below L from the word stream (in lane order) and stores.
KVQ_TARGET_AVX512 inline __m512i renorm(__m512i nx, __m512i low, const uint8_t*& rp) {
  const __mmask16 r = _mm512_cmplt_epu32_mask(nx, low);
  // Lanes in r take the next words in lane order. Expanding 16-bit words and zero-extending
  // keeps the mask in a k register (no round trip through pdep).
  const __m512i words = _mm512_cvtepu16_epi32(_mm256_maskz_expandloadu_epi16(r, rp));
  nx = _mm512_mask_or_epi32(nx, r, _mm512_slli_epi32(nx, 16), words);
  rp += 2 * std::popcount(static_cast<unsigned>(r));
  return nx;
}

// Decodes full steps [0, steps) with the slot tables (P <= 7). Returns the steps done (fewer if
// the word stream could run short; the scalar path finishes and reports it).
template <int G, bool kTwoHalves>
KVQ_TARGET_AVX512 size_t decode_lut_avx512(const RansModel& m, size_t steps, size_t run,
                                           const uint8_t* map, uint32_t* st, const uint8_t*& rp,
                                           const uint8_t* end, uint8_t* out) {
  constexpr size_t kN = 16 * G;
  const int p = m.prob_bits;
  const uint32_t nt = static_cast<uint32_t>(m.n_tables);
  const __m128i sh_p = _mm_cvtsi32_si128(p);
  const __m512i slot_mask = _mm512_set1_epi32(static_cast<int>((1u << p) - 1u));
  const __m512i byte_mask = _mm512_set1_epi32(0xFF);
  const __m512i low = _mm512_set1_epi32(static_cast<int>(1u << p));
  __m512i x[G];
  for (int g = 0; g < G; ++g) x[g] = _mm512_loadu_si512(st + 16 * g);
  const size_t spr = nt == 1 ? std::max<size_t>(steps, 1) : run / kN;  // steps per run
  size_t k = 0;
  while (k < steps) {
    const uint32_t t = nt == 1 ? 0 : run_table(map, k / spr, nt);
    const uint8_t* lut = m.dec_lut.data() + static_cast<size_t>(t) * 3 * kLutSlots;
    const __m512i sym0 = _mm512_loadu_si512(lut), bias0 = _mm512_loadu_si512(lut + kLutSlots),
                  f0 = _mm512_loadu_si512(lut + 2 * kLutSlots);
    __m512i sym1 = sym0, bias1 = bias0, f1 = f0;
    if constexpr (kTwoHalves) {
      sym1 = _mm512_loadu_si512(lut + 64);
      bias1 = _mm512_loadu_si512(lut + kLutSlots + 64);
      f1 = _mm512_loadu_si512(lut + 2 * kLutSlots + 64);
    }
    const size_t k_end = std::min(steps, (k / spr + 1) * spr);
    for (; k < k_end; ++k) {
      if (end - rp < static_cast<ptrdiff_t>(2 * kN)) goto done;
      for (int g = 0; g < G; ++g) {
        const __m512i slot = _mm512_and_si512(x[g], slot_mask);
        __m512i sym, bias, f;
        if constexpr (kTwoHalves) {
          sym = _mm512_permutex2var_epi8(sym0, slot, sym1);
          bias = _mm512_permutex2var_epi8(bias0, slot, bias1);
          f = _mm512_permutex2var_epi8(f0, slot, f1);
        } else {
          sym = _mm512_permutexvar_epi8(slot, sym0);
          bias = _mm512_permutexvar_epi8(slot, bias0);
          f = _mm512_permutexvar_epi8(slot, f0);
        }
        __m512i nx = _mm512_add_epi32(
            _mm512_mullo_epi32(_mm512_and_si512(f, byte_mask), _mm512_srl_epi32(x[g], sh_p)),
            _mm512_and_si512(bias, byte_mask));
        x[g] = renorm(nx, low, rp);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k * kN + 16 * g),
                         _mm512_cvtepi32_epi8(sym));
      }
    }
  }
done:
  for (int g = 0; g < G; ++g) _mm512_storeu_si512(st + 16 * g, x[g]);
  return k;
}

// Decodes full steps for P > 7 and alphabets <= 16: the symbol is the number of cum[s] (s >= 1)
// at or below the slot, found with compares against the run's table held in registers.
template <int G, int A>
KVQ_TARGET_AVX512 size_t decode_count_avx512(const RansModel& m, size_t steps, size_t run,
                                             const uint8_t* map, uint32_t* st, const uint8_t*& rp,
                                             const uint8_t* end, uint8_t* out) {
  constexpr size_t kN = 16 * G;
  const int p = m.prob_bits;
  const uint32_t nt = static_cast<uint32_t>(m.n_tables);
  const __m128i sh_p = _mm_cvtsi32_si128(p);
  const __m512i slot_mask = _mm512_set1_epi32(static_cast<int>((1u << p) - 1u));
  const __m512i low = _mm512_set1_epi32(static_cast<int>(1u << p));
  const __m512i minus_one = _mm512_set1_epi32(-1);
  __m512i x[G];
  for (int g = 0; g < G; ++g) x[g] = _mm512_loadu_si512(st + 16 * g);
  const size_t spr = nt == 1 ? std::max<size_t>(steps, 1) : run / kN;
  size_t k = 0;
  while (k < steps) {
    const uint32_t t = nt == 1 ? 0 : run_table(map, k / spr, nt);
    const uint16_t* cum = m.cum.data() + static_cast<size_t>(t) * (A + 1);
    const uint16_t* fr = m.freq.data() + static_cast<size_t>(t) * A;
    alignas(64) uint32_t cbuf[16] = {}, fbuf[16] = {};
    for (int s = 0; s < A; ++s) cbuf[s] = cum[s], fbuf[s] = fr[s];
    const __m512i creg = _mm512_load_si512(cbuf), freg = _mm512_load_si512(fbuf);
    __m512i bound[A > 1 ? A - 1 : 1];
    for (int s = 1; s < A; ++s) bound[s - 1] = _mm512_set1_epi32(cum[s]);
    const size_t k_end = std::min(steps, (k / spr + 1) * spr);
    for (; k < k_end; ++k) {
      if (end - rp < static_cast<ptrdiff_t>(2 * kN)) goto done;
      for (int g = 0; g < G; ++g) {
        const __m512i slot = _mm512_and_si512(x[g], slot_mask);
        __m512i sym = _mm512_setzero_si512();
        for (int s = 1; s < A; ++s)
          sym = _mm512_mask_sub_epi32(sym, _mm512_cmple_epu32_mask(bound[s - 1], slot), sym,
                                      minus_one);
        const __m512i f = _mm512_permutexvar_epi32(sym, freg);
        const __m512i c = _mm512_permutexvar_epi32(sym, creg);
        __m512i nx = _mm512_add_epi32(_mm512_mullo_epi32(f, _mm512_srl_epi32(x[g], sh_p)),
                                      _mm512_sub_epi32(slot, c));
        x[g] = renorm(nx, low, rp);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k * kN + 16 * g),
                         _mm512_cvtepi32_epi8(sym));
      }
    }
  }
done:
  for (int g = 0; g < G; ++g) _mm512_storeu_si512(st + 16 * g, x[g]);
  return k;
}

// Per-run encoder lookups: reciprocal and (cum, f, shift) of 16 symbols. kAlpha: 16 (one
// register, A <= 16), 32 (two registers) or 0 (gather, any alphabet).
template <int kAlpha>
struct EncTable {
  __m512i rcp0, rcp1, info0, info1, base;
  const uint32_t* rcp_mem;
  const uint32_t* info_mem;
  KVQ_TARGET_AVX512 void load(const RansModel& m, uint32_t t) {
    const int a = m.alphabet();
    const uint32_t* r = m.enc_rcp.data() + static_cast<size_t>(t) * a;
    const uint32_t* i = m.enc_info.data() + static_cast<size_t>(t) * a;
    rcp_mem = m.enc_rcp.data();
    info_mem = m.enc_info.data();
    base = _mm512_set1_epi32(static_cast<int>(t) * a);
    if constexpr (kAlpha == 16) {
      const __mmask16 k = static_cast<__mmask16>((1u << a) - 1u);
      rcp0 = _mm512_maskz_loadu_epi32(k, r);
      info0 = _mm512_maskz_loadu_epi32(k, i);
    } else if constexpr (kAlpha == 32) {
      rcp0 = _mm512_loadu_si512(r);
      rcp1 = _mm512_loadu_si512(r + 16);
      info0 = _mm512_loadu_si512(i);
      info1 = _mm512_loadu_si512(i + 16);
    }
  }
  KVQ_TARGET_AVX512 void lookup(__m512i sv, __m512i& rcp, __m512i& info) const {
    if constexpr (kAlpha == 16) {
      rcp = _mm512_permutexvar_epi32(sv, rcp0);
      info = _mm512_permutexvar_epi32(sv, info0);
    } else if constexpr (kAlpha == 32) {
      rcp = _mm512_permutex2var_epi32(rcp0, sv, rcp1);
      info = _mm512_permutex2var_epi32(info0, sv, info1);
    } else {
      const __m512i idx = _mm512_add_epi32(base, sv);
      const __m512i zero = _mm512_setzero_si512();
      // The masked form with an explicit source avoids GCC's false -Wmaybe-uninitialized.
      rcp = _mm512_mask_i32gather_epi32(zero, 0xFFFF, idx, rcp_mem, 4);
      info = _mm512_mask_i32gather_epi32(zero, 0xFFFF, idx, info_mem, 4);
    }
  }
};

// Encodes full steps k = k_end-1 .. 0. Returns false on an uncodable symbol.
template <int G, int kAlpha>
KVQ_TARGET_AVX512 bool encode_avx512(const RansModel& m, const uint8_t* symbols, size_t k_end,
                                     size_t run, const uint8_t* map, uint32_t* st, uint8_t*& wp) {
  constexpr size_t kN = 16 * G;
  const int a = m.alphabet();
  const uint32_t nt = static_cast<uint32_t>(m.n_tables);
  const int p = m.prob_bits;
  const __m512i avec = _mm512_set1_epi32(a);
  const __m512i m12 = _mm512_set1_epi32(0xFFF);
  const __m512i m13 = _mm512_set1_epi32(0x1FFF);
  const __m512i lo64 = _mm512_set1_epi64(0xFFFFFFFFll);
  const __m512i total = _mm512_set1_epi32(1 << p);
  const __m512i zero = _mm512_setzero_si512();
  __m512i x[G];
  for (int g = 0; g < G; ++g) x[g] = _mm512_loadu_si512(st + 16 * g);
  const size_t spr = nt == 1 ? std::max<size_t>(k_end, 1) : run / kN;
  __mmask16 bad = 0;
  EncTable<kAlpha> tab;
  size_t k = k_end;
  while (k > 0) {
    const size_t k_lo = (k - 1) / spr * spr;
    tab.load(m, nt == 1 ? 0 : run_table(map, k_lo / spr, nt));
    for (; k > k_lo; --k) {
      for (int g = G - 1; g >= 0; --g) {
        const __m512i sv = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(symbols + (k - 1) * kN + 16 * g)));
        bad |= _mm512_cmpge_epu32_mask(sv, avec);
        __m512i rcp, info;
        tab.lookup(_mm512_min_epu32(sv, _mm512_set1_epi32(a - 1)), rcp, info);
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
      }
    }
  }
  for (int g = 0; g < G; ++g) _mm512_storeu_si512(st + 16 * g, x[g]);
  return bad == 0;
}

template <int G>
KVQ_TARGET_AVX512 bool encode_avx512_dispatch(const RansModel& m, const uint8_t* symbols,
                                              size_t k_end, size_t run, const uint8_t* map,
                                              uint32_t* st, uint8_t*& wp) {
  if (m.alphabet() <= 16) return encode_avx512<G, 16>(m, symbols, k_end, run, map, st, wp);
  if (m.alphabet() == 32) return encode_avx512<G, 32>(m, symbols, k_end, run, map, st, wp);
  return encode_avx512<G, 0>(m, symbols, k_end, run, map, st, wp);
}

template <int G>
KVQ_TARGET_AVX512 size_t decode_avx512_dispatch(const RansModel& m, size_t steps, size_t run,
                                                const uint8_t* map, uint32_t* st,
                                                const uint8_t*& rp, const uint8_t* end,
                                                uint8_t* out) {
  if (!m.dec_lut.empty()) {
    return m.prob_bits > 6 ? decode_lut_avx512<G, true>(m, steps, run, map, st, rp, end, out)
                           : decode_lut_avx512<G, false>(m, steps, run, map, st, rp, end, out);
  }
  switch (m.symbol_bits) {
    case 1:
      return decode_count_avx512<G, 2>(m, steps, run, map, st, rp, end, out);
    case 2:
      return decode_count_avx512<G, 4>(m, steps, run, map, st, rp, end, out);
    case 3:
      return decode_count_avx512<G, 8>(m, steps, run, map, st, rp, end, out);
    case 4:
      return decode_count_avx512<G, 16>(m, steps, run, map, st, rp, end, out);
    default:
      return 0;
  }
}
#endif  // KVQ_SIMD_X86

// rcp[f] = ceil(2^(31+l) / f), l = floor(log2 f), for f in 1..2^12: computed once (a 64-bit
// division per symbol per table showed up in per-chunk encoding).
const std::vector<uint32_t>& reciprocals() {
  static const std::vector<uint32_t> table = [] {
    std::vector<uint32_t> t((1u << kMaxProbBits) + 1, 0);
    for (uint32_t f = 1; f < t.size(); ++f) {
      const int l = std::bit_width(f) - 1;
      t[f] = static_cast<uint32_t>(((uint64_t{1} << (31 + l)) + f - 1) / f);
    }
    return t;
  }();
  return table;
}

// The SIMD paths need 16 or 32 lanes and steps that stay inside one run.
[[maybe_unused]] bool simd_shape(size_t lanes, size_t run, int n_tables) {
  return (lanes == 16 || lanes == 32) && (n_tables == 1 || run % lanes == 0);
}

}  // namespace

bool rans_simd_available() { return KVQ_SIMD_X86 && simd_level() >= SimdLevel::kAvx512; }

Status prepare_rans_model(const FrequencyTables& tables, RansModelUse use, RansModel& m) {
  const bool enc = static_cast<int>(use) & 1, dec = static_cast<int>(use) & 2;
  KVQ_RETURN_IF_ERROR(validate_tables(tables));
  m.symbol_bits = tables.symbol_bits;
  m.prob_bits = tables.prob_bits;
  m.n_tables = tables.n_tables;
  const size_t a = static_cast<size_t>(tables.alphabet());
  const size_t nt = static_cast<size_t>(tables.n_tables);
  m.freq.assign(tables.freq.begin(), tables.freq.end());
  m.cum.resize(nt * (a + 1));
  m.enc_rcp.clear();
  m.enc_info.clear();
  m.dec_lut.clear();
  if (enc) {
    m.enc_rcp.assign(nt * a, 0);
    m.enc_info.assign(nt * a, 0);
  }
  for (size_t t = 0; t < nt; ++t) {
    const uint16_t* fr = m.freq.data() + t * a;
    uint16_t* cu = m.cum.data() + t * (a + 1);
    uint32_t c = 0;
    for (size_t s = 0; s < a; ++s) {
      cu[s] = static_cast<uint16_t>(c);
      c += fr[s];
    }
    cu[a] = static_cast<uint16_t>(c);
    if (!enc) continue;
    const auto& rt = reciprocals();
    for (size_t s = 0; s < a; ++s) {
      const uint32_t f = fr[s];
      if (!f) continue;
      const int l = std::bit_width(f) - 1;
      m.enc_rcp[t * a + s] = rt[f];
      m.enc_info[t * a + s] = cu[s] | (f << 12) | (static_cast<uint32_t>(31 + l) << 25);
    }
  }
  if (dec && m.prob_bits <= kLutMaxProbBits) {
    m.dec_lut.resize(nt * 3 * kLutSlots);
    // The same tables either way (a model may be used at any level).
    [[maybe_unused]] const bool simd = simd_level() >= SimdLevel::kAvx512;
    for (size_t t = 0; t < nt; ++t) {
      const uint16_t* f = m.freq.data() + t * a;
      const uint16_t* c = m.cum.data() + t * (a + 1);
      uint8_t* lut = m.dec_lut.data() + t * 3 * kLutSlots;
#if KVQ_SIMD_X86
      if (a <= 64 && simd) {
        build_lut_avx512(f, c, static_cast<int>(a), m.prob_bits, lut);
        continue;
      }
#endif
      build_lut_scalar(f, c, static_cast<int>(a), m.prob_bits, lut);
    }
  }
  return ok_status();
}

Result<RansModel> make_rans_model(const FrequencyTables& tables, RansModelUse use) {
  RansModel m;
  KVQ_RETURN_IF_ERROR(prepare_rans_model(tables, use, m));
  return m;
}

Status rans_encode(const RansModel& m, const uint8_t* symbols, size_t n, size_t run, int lanes_log2,
                   uint32_t* final_states, std::vector<uint8_t>& words, RansImpl impl,
                   const uint8_t* map) {
  if (lanes_log2 < 0 || lanes_log2 > kMaxLanesLog2)
    return invalid_argument("rANS encode: lanes_log2 " + std::to_string(lanes_log2) +
                            " outside 0..5");
  if (run < 1) return invalid_argument("rANS encode: run must be >= 1");
  KVQ_CHECK(!m.enc_rcp.empty());  // model prepared for encoding
  (void)impl;                     // only consulted on x86-64
  const size_t runs = (n + run - 1) / run;
  const size_t lanes = size_t{1} << lanes_log2;
  uint32_t st[32];
  for (size_t j = 0; j < lanes; ++j) st[j] = 1u << m.prob_bits;
  // At most one word per symbol, written backwards from the end of a scratch buffer that the
  // encoder keeps between calls (its size would otherwise be allocated and zeroed per stream).
  thread_local std::vector<uint8_t> buf;
  if (buf.size() < 2 * n + 64) buf.resize(2 * n + 64);
  uint8_t* const buf_end = buf.data() + 2 * n + 64;
  uint8_t* wp = buf_end;
  bool ok = true;
  size_t done_below = n;  // symbols [0, done_below) still to encode with the scalar path
#if KVQ_SIMD_X86
  if (impl == RansImpl::kAuto && simd_shape(lanes, run, m.n_tables) &&
      simd_level() >= SimdLevel::kAvx512) {
    const size_t full = n / lanes;
    ok = encode_scalar(m, symbols, full * lanes, n, run, map, runs, lanes_log2, st, wp);
    if (ok) {
      ok = (lanes == 16) ? encode_avx512_dispatch<1>(m, symbols, full, run, map, st, wp)
                         : encode_avx512_dispatch<2>(m, symbols, full, run, map, st, wp);
    }
    done_below = 0;
  }
#endif
  if (done_below > 0) ok = encode_scalar(m, symbols, 0, n, run, map, runs, lanes_log2, st, wp);
  if (!ok)
    return invalid_argument("rANS encode: a symbol is >= 2^" + std::to_string(m.symbol_bits) +
                            " or has frequency 0 in its table");
  words.insert(words.end(), wp, buf_end);
  std::copy(st, st + lanes, final_states);
  return ok_status();
}

Status rans_decode(const RansModel& m, const uint32_t* initial_states, const uint8_t* words,
                   size_t size, size_t n, size_t run, int lanes_log2, uint8_t* out, RansImpl impl,
                   const uint8_t* map) {
  if (lanes_log2 < 0 || lanes_log2 > kMaxLanesLog2)
    return invalid_argument("rANS decode: lanes_log2 " + std::to_string(lanes_log2) +
                            " outside 0..5");
  if (run < 1) return invalid_argument("rANS decode: run must be >= 1");
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
#if KVQ_SIMD_X86
  if (impl == RansImpl::kAuto && simd_shape(lanes, run, m.n_tables) &&
      (!m.dec_lut.empty() || m.symbol_bits <= 4) && simd_level() >= SimdLevel::kAvx512) {
    const size_t steps = n / lanes;
    done =
        lanes * ((lanes == 16) ? decode_avx512_dispatch<1>(m, steps, run, map, st, rp, end, out)
                               : decode_avx512_dispatch<2>(m, steps, run, map, st, rp, end, out));
  }
#else
  (void)impl;
#endif
  if (!decode_scalar(m, done, n, run, map, (n + run - 1) / run, lanes_log2, st, rp, end, out))
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

Status rans_encode_stream(const RansModel& m, const uint8_t* symbols, size_t n, size_t run,
                          int lanes_log2, std::vector<uint8_t>& out, RansImpl impl) {
  uint32_t st[32];
  std::vector<uint8_t> words;
  KVQ_RETURN_IF_ERROR(rans_encode(m, symbols, n, run, lanes_log2, st, words, impl));
  BitWriter w(out);
  write_states(w, st, 1 << lanes_log2, m.prob_bits);
  w.flush();
  out.insert(out.end(), words.begin(), words.end());
  return ok_status();
}

Status rans_decode_stream(const RansModel& m, const uint8_t* in, size_t size, size_t n, size_t run,
                          int lanes_log2, uint8_t* out, RansImpl impl) {
  if (lanes_log2 < 0 || lanes_log2 > kMaxLanesLog2)
    return invalid_argument("rANS decode: lanes_log2 outside 0..5");
  uint32_t st[32];
  BitReader r(in, size);
  KVQ_RETURN_IF_ERROR(read_states(r, st, 1 << lanes_log2, m.prob_bits));
  if (!r.finish_byte()) return corrupt("rANS stream: nonzero padding after the state block");
  const size_t off = r.byte_position();
  if ((size - off) % 2) return corrupt("rANS stream: odd number of word bytes");
  return rans_decode(m, st, in + off, size - off, n, run, lanes_log2, out, impl);
}

}  // namespace kvq::entropy
