#include "entropy/freq_table.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/byte_io.h"
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

// log2(i) for i in [0, 2^kMaxProbBits + 1]; entry 0 is unused (a zero frequency never reaches
// the cost formulas). A table, because normalization runs per table per chunk and std::log2
// would dominate it.
const std::array<double, (1 << kMaxProbBits) + 2>& log2_table() {
  static const auto table = [] {
    std::array<double, (1 << kMaxProbBits) + 2> t{};
    t[0] = 0.0;
    for (size_t i = 1; i < t.size(); ++i) t[i] = std::log2(static_cast<double>(i));
    return t;
  }();
  return table;
}

// Truncated binary code of v in [0, bound]: values below u = 2^(k+1) - (bound+1) take k bits,
// the others k+1, where k = floor(log2(bound+1)). Written as (v+u)>>1 in k bits followed by
// the low bit, so an LSB-first reader can tell after k bits whether a (k+1)-th follows.
struct TruncatedBinary {
  int k;
  uint32_t u;
  explicit TruncatedBinary(uint32_t bound) {
    const uint32_t n = bound + 1;
    k = std::bit_width(n) - 1;
    u = (uint32_t{2} << k) - n;
  }
  int length(uint32_t v) const { return v < u ? k : k + 1; }
};

// Writes or counts the table body; Sink is BitWriter or BitCounter.
struct BitCounter {
  size_t bits = 0;
  void put(uint32_t /*v*/, int n) { bits += static_cast<size_t>(n); }
};

template <class Sink>
void put_truncated(Sink& w, uint32_t v, uint32_t bound) {
  const TruncatedBinary tb(bound);
  // Branch-free: the long form, (v+u)>>1 in k bits then (v+u)&1, is the (k+1)-bit value with
  // the low bit moved to the top (LSB-first), so both forms are one put.
  const uint32_t x = v + tb.u;
  const uint32_t lng = (x >> 1) | ((x & 1u) << tb.k);
  const bool is_long = v >= tb.u;
  w.put(is_long ? lng : v, tb.k + (is_long ? 1 : 0));
}

bool get_truncated(BitReader& r, uint32_t bound, uint32_t& v) {
  const TruncatedBinary tb(bound);
  uint32_t x;
  if (!r.get(tb.k, x)) return false;
  if (x < tb.u) {
    v = x;
    return true;
  }
  uint32_t b;
  if (!r.bit(b)) return false;
  v = 2 * x + b - tb.u;
  return v <= bound;  // always true for a valid k/u; kept as a guard
}

// Symbol visited at step j >= 1 when walking out from the mode: +1, -1, +2, -2, ... (mod A).
inline int visit(int mode, int j, int alphabet) {
  const int off = (j & 1) ? (j + 1) / 2 : -(j / 2);
  return (mode + off + alphabet) & (alphabet - 1);
}

// The table's own precision: P minus the common power of two of its nonzero frequencies.
int own_precision(const uint16_t* freq, int alphabet, int prob_bits) {
  // The lowest set bit of the OR of all frequencies is the smallest power of two dividing
  // every nonzero one (zeros add nothing to the OR).
  unsigned any = 0;
  for (int s = 0; s < alphabet; ++s) any |= freq[s];
  const int shift = any ? std::min(prob_bits, std::countr_zero(any)) : prob_bits;
  return prob_bits - shift;
}

template <class Sink>
void emit_table(Sink& w, const uint16_t* freq, int symbol_bits, int prob_bits) {
  const int alphabet = 1 << symbol_bits;
  const int p = own_precision(freq, alphabet, prob_bits);
  const int d = prob_bits - p;
  w.put((1u << d) - 1u, d + (d < prob_bits ? 1 : 0));  // d ones, then a zero unless d == P
  // The mode (lowest index on ties), without a data-dependent branch per symbol.
  int mode = 0;
  uint32_t best = freq[0];
  for (int s = 1; s < alphabet; ++s) {
    const bool better = freq[s] > best;
    best = better ? freq[s] : best;
    mode = better ? s : mode;
  }
  w.put(static_cast<uint32_t>(mode), symbol_bits);
  if (p == 0) return;
  const uint32_t fmode = freq[mode] >> d;
  w.put(fmode - 1, p);
  uint32_t remaining = (1u << p) - fmode;
  for (int j = 1; j < alphabet && remaining > 0; ++j) {
    const uint32_t f = freq[visit(mode, j, alphabet)] >> d;
    if (j < alphabet - 1) put_truncated(w, f, std::min(remaining, fmode));
    remaining -= f;
  }
}

#if KVQ_SIMD_X86
// Histogram of `rows` full rows of nt symbols (token-major) for the A symbol values v0 .. v0+A-1
// (A <= 16) of an alphabet of `stride`: per block of 64 tables, A byte-counter vectors stay in
// registers while the rows stream by (compare + masked increment per symbol value), flushed into
// the 32-bit counts every 255 rows. Returns the OR of all symbols seen (for the range check).
template <int A>
KVQ_TARGET_AVX512 unsigned histogram_avx512(const uint8_t* symbols, size_t rows, size_t nt,
                                            uint32_t* counts, int stride = A, int v0 = 0) {
  __m512i seen = _mm512_setzero_si512();
  const __m512i minus_one = _mm512_set1_epi8(-1);
  alignas(64) uint8_t tmp[64];
  for (size_t cb = 0; cb < nt; cb += 64) {
    const size_t len = std::min<size_t>(64, nt - cb);
    const __mmask64 lm = len == 64 ? ~__mmask64{0} : ((__mmask64{1} << len) - 1);
    for (size_t r0 = 0; r0 < rows; r0 += 255) {
      const size_t r1 = std::min(rows, r0 + 255);
      __m512i acc[A];
      for (int v = 0; v < A; ++v) acc[v] = _mm512_setzero_si512();
      for (size_t r = r0; r < r1; ++r) {
        const __m512i x = _mm512_maskz_loadu_epi8(lm, symbols + r * nt + cb);
        seen = _mm512_or_si512(seen, x);
        for (int v = 0; v < A; ++v) {
          const __mmask64 k =
              _mm512_mask_cmpeq_epi8_mask(lm, x, _mm512_set1_epi8(static_cast<char>(v0 + v)));
          acc[v] = _mm512_mask_sub_epi8(acc[v], k, acc[v], minus_one);
        }
      }
      for (int v = 0; v < A; ++v) {
        _mm512_store_si512(tmp, acc[v]);
        for (size_t j = 0; j < len; ++j)
          counts[(cb + j) * static_cast<size_t>(stride) + static_cast<size_t>(v0 + v)] += tmp[j];
      }
    }
  }
  alignas(64) uint8_t or_bytes[64];
  _mm512_store_si512(or_bytes, seen);
  unsigned any = 0;
  for (uint8_t b : or_bytes) any |= b;
  return any;
}
#endif

// First index of the maximum (minimum) of v[0, n): the plain scans define the answer.
inline int first_max_scalar(const double* v, int n) {
  int best = 0;
  for (int s = 1; s < n; ++s)
    if (v[s] > v[best]) best = s;
  return best;
}

inline int first_min_scalar(const double* v, int n) {
  int best = 0;
  for (int s = 1; s < n; ++s)
    if (v[s] < v[best]) best = s;
  return best;
}

#if KVQ_SIMD_X86
// The same answers as the lowest lane equal to the reduced maximum (minimum). Values are finite
// or +-infinity, never NaN.
KVQ_TARGET_AVX512 inline int first_max_avx512(const double* v, int n) {
  if (n % 8 != 0) return first_max_scalar(v, n);
  __m512d m = _mm512_loadu_pd(v);
  for (int i = 8; i < n; i += 8) m = _mm512_max_pd(m, _mm512_loadu_pd(v + i));
  const __m512d b = _mm512_set1_pd(_mm512_reduce_max_pd(m));
  for (int i = 0; i < n; i += 8) {
    const __mmask8 k = _mm512_cmp_pd_mask(_mm512_loadu_pd(v + i), b, _CMP_EQ_OQ);
    if (k) return i + std::countr_zero(static_cast<unsigned>(k));
  }
  return 0;  // unreachable: some lane holds the maximum
}

KVQ_TARGET_AVX512 inline int first_min_avx512(const double* v, int n) {
  if (n % 8 != 0) return first_min_scalar(v, n);
  __m512d m = _mm512_loadu_pd(v);
  for (int i = 8; i < n; i += 8) m = _mm512_min_pd(m, _mm512_loadu_pd(v + i));
  const __m512d b = _mm512_set1_pd(_mm512_reduce_min_pd(m));
  for (int i = 0; i < n; i += 8) {
    const __mmask8 k = _mm512_cmp_pd_mask(_mm512_loadu_pd(v + i), b, _CMP_EQ_OQ);
    if (k) return i + std::countr_zero(static_cast<unsigned>(k));
  }
  return 0;
}
#endif

// The scans of normalize_body<kAvx512>: the AVX-512 ones only inside its AVX-512 instance, where
// they inline.
template <bool kAvx512>
KVQ_ALWAYS_INLINE int first_max(const double* v, int n) {
#if KVQ_SIMD_X86
  if constexpr (kAvx512) return first_max_avx512(v, n);
#endif
  return first_max_scalar(v, n);
}

template <bool kAvx512>
KVQ_ALWAYS_INLINE int first_min(const double* v, int n) {
#if KVQ_SIMD_X86
  if constexpr (kAvx512) return first_min_avx512(v, n);
#endif
  return first_min_scalar(v, n);
}

}  // namespace

Status validate_tables(const FrequencyTables& t) {
  if (t.symbol_bits < 1 || t.symbol_bits > kMaxSymbolBits)
    return invalid_argument("frequency tables: symbol_bits " + std::to_string(t.symbol_bits) +
                            " outside 1..8");
  if (t.prob_bits < 0 || t.prob_bits > kMaxProbBits)
    return invalid_argument("frequency tables: prob_bits " + std::to_string(t.prob_bits) +
                            " outside 0..12");
  if (t.n_tables < 1 || t.n_tables > kMaxTables)
    return invalid_argument("frequency tables: n_tables " + std::to_string(t.n_tables) +
                            " outside 1..2^20");
  if (t.freq.size() != static_cast<size_t>(t.n_tables) * static_cast<size_t>(t.alphabet()))
    return invalid_argument("frequency tables: freq has " + std::to_string(t.freq.size()) +
                            " entries, expected n_tables * 2^symbol_bits");
  for (int i = 0; i < t.n_tables; ++i) {
    uint32_t sum = 0;
    for (int s = 0; s < t.alphabet(); ++s) sum += t.table(i)[s];
    if (sum != (1u << t.prob_bits))
      return invalid_argument("frequency tables: table " + std::to_string(i) + " sums to " +
                              std::to_string(sum) + ", expected 2^" + std::to_string(t.prob_bits));
  }
  return ok_status();
}

Status count_symbols(const uint8_t* symbols, size_t n, int symbol_bits, int n_tables,
                     uint32_t* counts) {
  const size_t alphabet = size_t{1} << symbol_bits;
  const size_t nt = static_cast<size_t>(n_tables);
  std::fill(counts, counts + nt * alphabet, 0u);
  // Any symbol >= alphabet sets bits above the alphabet in `seen`; checked once at the end so
  // the hot loop has no branch.
  unsigned seen = 0;
  size_t i = 0;
#if KVQ_SIMD_X86
  if (alphabet <= 32 && nt >= 16 && simd_level() >= SimdLevel::kAvx512) {
    const size_t rows = n / nt;
    switch (alphabet) {
      case 2:
        seen = histogram_avx512<2>(symbols, rows, nt, counts);
        break;
      case 4:
        seen = histogram_avx512<4>(symbols, rows, nt, counts);
        break;
      case 8:
        seen = histogram_avx512<8>(symbols, rows, nt, counts);
        break;
      case 16:
        seen = histogram_avx512<16>(symbols, rows, nt, counts);
        break;
      default:  // 32 symbols: two passes of 16 values (32 counters would not fit the registers)
        seen = histogram_avx512<16>(symbols, rows, nt, counts, 32, 0) |
               histogram_avx512<16>(symbols, rows, nt, counts, 32, 16);
        break;
    }
    i = rows * nt;
  }
#endif
  while (i < n) {
    const size_t row = std::min(nt, n - i);
    for (size_t t = 0; t < row; ++t) {
      const unsigned s = symbols[i + t];
      seen |= s;
      counts[t * alphabet + (s & (alphabet - 1))] += 1;
    }
    i += row;
  }
  if (seen >> symbol_bits)
    return out_of_range("symbol stream: a symbol is >= 2^" + std::to_string(symbol_bits));
  return ok_status();
}

namespace {

// normalize_counts, compiled twice: the scans below run once or twice per unit moved, for every
// table of every chunk, so the AVX-512 instance keeps them inline and vectorised.
template <bool kAvx512>
KVQ_ALWAYS_INLINE bool normalize_body(const uint32_t* counts, int alphabet, int prob_bits,
                                      bool cover_all, uint16_t* freq) {
  const auto& lg = log2_table();
  const uint32_t total = 1u << prob_bits;
  uint64_t n = 0;
  int needed = 0;
  for (int s = 0; s < alphabet; ++s) {
    n += counts[s];
    needed += (counts[s] > 0 || cover_all) ? 1 : 0;
  }
  if (needed == 0) {  // no data: the single-symbol table of symbol 0
    std::fill(freq, freq + alphabet, uint16_t{0});
    freq[0] = static_cast<uint16_t>(total);
    return true;
  }
  if (static_cast<uint32_t>(needed) > total) return false;

  // Start from rounded proportional shares (each needed symbol at least 1).
  // Uninitialized on purpose: only [0, alphabet) is used, and zeroing 5 KB per call showed up
  // as a sixth of the encoder's table-building time.
  std::array<uint32_t, 256> f;
  std::array<double, 256> gain, loss;
  std::array<bool, 256> need;
  uint32_t sum = 0;
  // A double multiply instead of a 64-bit division per symbol (the divisions dominated the
  // whole normalization). Any starting point works: the moves below reach the same optimum.
  const double scale = n ? static_cast<double>(total) / static_cast<double>(n) : 0.0;
  for (int s = 0; s < alphabet; ++s) {
    need[s] = counts[s] > 0 || cover_all;
    f[s] = 0;
    if (!need[s]) continue;
    const double share = std::min(counts[s] * scale + 0.5, static_cast<double>(total));
    f[s] = std::max<uint32_t>(1, static_cast<uint32_t>(share));
    sum += f[s];
  }
  // gain[s]: coded bits saved by f[s] + 1; loss[s]: bits added by f[s] - 1 (infinite at 1 or for
  // symbols without a slot). Only the two entries of a moved symbol change after a move.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  auto refresh = [&](int s) {
    if (!need[s]) {
      gain[s] = -kInf;
      loss[s] = kInf;
      return;
    }
    gain[s] = f[s] < total ? counts[s] * (lg[f[s] + 1] - lg[f[s]]) : -kInf;
    loss[s] = f[s] > 1 ? counts[s] * (lg[f[s]] - lg[f[s] - 1]) : kInf;
  };
  for (int s = 0; s < alphabet; ++s) refresh(s);
  // The first index of the largest gain / smallest loss.
  while (sum > total) {  // terminates: needed <= total, so some f[s] > 1 exists
    const int s = first_min<kAvx512>(loss.data(), alphabet);
    --f[s];
    --sum;
    refresh(s);
  }
  while (sum < total) {
    const int s = first_max<kAvx512>(gain.data(), alphabet);
    ++f[s];
    ++sum;
    refresh(s);
  }
  // Exchange steps: the objective is separable and convex in each f[s], so a state where no
  // single unit move from one symbol to another helps is the global optimum. Each accepted move
  // strictly decreases the objective, so the loop ends; the bound is a belt and braces.
  for (int iter = 0; iter < 4 * alphabet + 64; ++iter) {
    const int up = first_max<kAvx512>(gain.data(), alphabet);
    const int down = first_min<kAvx512>(loss.data(), alphabet);
    if (up == down || !(gain[up] > loss[down] + 1e-12)) break;
    ++f[up];
    --f[down];
    refresh(up);
    refresh(down);
  }
  for (int s = 0; s < alphabet; ++s) freq[s] = static_cast<uint16_t>(f[s]);
  return true;
}

#if KVQ_SIMD_X86
KVQ_TARGET_AVX512 bool normalize_avx512(const uint32_t* counts, int alphabet, int prob_bits,
                                        bool cover_all, uint16_t* freq) {
  return normalize_body<true>(counts, alphabet, prob_bits, cover_all, freq);
}
#endif

}  // namespace

bool normalize_counts(const uint32_t* counts, int alphabet, int prob_bits, bool cover_all,
                      uint16_t* freq) {
#if KVQ_SIMD_X86
  if (simd_level() >= SimdLevel::kAvx512)
    return normalize_avx512(counts, alphabet, prob_bits, cover_all, freq);
#endif
  return normalize_body<false>(counts, alphabet, prob_bits, cover_all, freq);
}

double coded_bits(const uint32_t* counts, const uint16_t* freq, int alphabet, int prob_bits) {
  const auto& lg = log2_table();
  double bits = 0.0;
  for (int s = 0; s < alphabet; ++s) {
    if (!counts[s]) continue;
    if (!freq[s]) return std::numeric_limits<double>::infinity();
    bits += counts[s] * (prob_bits - lg[freq[s]]);
  }
  return bits;
}

size_t table_bits(const uint16_t* freq, int symbol_bits, int prob_bits) {
  BitCounter c;
  emit_table(c, freq, symbol_bits, prob_bits);
  return c.bits;
}

void write_table(BitWriter& w, const uint16_t* freq, int symbol_bits, int prob_bits) {
  emit_table(w, freq, symbol_bits, prob_bits);
}

Status read_table(BitReader& r, int symbol_bits, int prob_bits, uint16_t* freq) {
  const int alphabet = 1 << symbol_bits;
  std::fill(freq, freq + alphabet, uint16_t{0});
  auto overrun = [] { return corrupt("frequency table: truncated"); };
  int d = 0;
  while (d < prob_bits) {
    uint32_t b;
    if (!r.bit(b)) return overrun();
    if (!b) break;
    ++d;
  }
  const int p = prob_bits - d;
  uint32_t mode;
  if (!r.get(symbol_bits, mode)) return overrun();
  if (p == 0) {
    freq[mode] = static_cast<uint16_t>(1u << prob_bits);
    return ok_status();
  }
  uint32_t fmode;
  if (!r.get(p, fmode)) return overrun();
  fmode += 1;
  freq[mode] = static_cast<uint16_t>(fmode << d);
  uint32_t remaining = (1u << p) - fmode;
  for (int j = 1; j < alphabet && remaining > 0; ++j) {
    uint32_t f;
    if (j < alphabet - 1) {
      if (!get_truncated(r, std::min(remaining, fmode), f)) return overrun();
    } else {
      f = remaining;
      if (f > fmode) return corrupt("frequency table: implied frequency exceeds the mode's");
    }
    freq[visit(static_cast<int>(mode), j, alphabet)] = static_cast<uint16_t>(f << d);
    remaining -= f;
  }
  if (remaining != 0) return corrupt("frequency table: frequencies do not sum to 2^p");
  return ok_status();
}

size_t tables_bits(const FrequencyTables& t) {
  size_t bits = 0;
  for (int i = 0; i < t.n_tables; ++i) bits += table_bits(t.table(i), t.symbol_bits, t.prob_bits);
  return bits;
}

namespace {

// A table's bits collected in local 64-bit words (no stores into the output vector per field,
// which kept the writer's state in memory and serialized every field on it), then appended.
struct LocalBits {
  uint64_t words[56];  // >= the largest table: 13 + 8 + 12 + 254 * 13 bits
  size_t n_words = 0;
  uint64_t acc = 0;  // the word being filled, in a register
  int fill = 0;
  void put(uint32_t v, int n) {
    const uint64_t x = static_cast<uint64_t>(v & static_cast<uint32_t>((uint64_t{1} << n) - 1));
    acc |= x << fill;
    fill += n;
    if (fill >= 64) {  // fill was > 0 here, since n <= 32
      words[n_words++] = acc;
      fill -= 64;
      acc = x >> (n - fill);
    }
  }
  size_t finish() {  // total bits; the last partial word is stored
    if (fill > 0) words[n_words] = acc;
    return 64 * n_words + static_cast<size_t>(fill);
  }
};

}  // namespace

void write_tables(BitWriter& w, const FrequencyTables& t) {
  for (int i = 0; i < t.n_tables; ++i) {
    LocalBits lb;
    emit_table(lb, t.table(i), t.symbol_bits, t.prob_bits);
    const size_t nbits = lb.finish();
    w.put_bits(reinterpret_cast<const uint8_t*>(lb.words), nbits);  // little-endian host
  }
}

namespace {

// A 64-bit bit buffer over the table bits: each field is a mask and a shift of a register
// instead of a bounds-checked load (decoders parse one table set per chunk, ~16 fields a table,
// so the reader is a visible part of decoding). Refills with one unaligned 8-byte load while
// 8 bytes remain, byte by byte at the end; a field beyond the end sets `overrun`.
class TableBitReader {
 public:
  TableBitReader(const uint8_t* data, size_t size, size_t bit_pos)
      : p_(data + bit_pos / 8), end_(data + size), skip_(static_cast<int>(bit_pos % 8)) {
    refill();
    consume(skip_);
    consumed_ = 0;
  }
  // At least 57 bits buffered (or everything left).
  void refill() {
    if (end_ - p_ >= 8) {
      uint64_t w;
      std::memcpy(&w, p_, 8);  // little-endian host
      buf_ |= w << avail_;
      const int take = (63 - avail_) >> 3;
      p_ += take;
      avail_ += 8 * take;
    } else {
      while (avail_ <= 56 && p_ < end_) {
        buf_ |= static_cast<uint64_t>(*p_++) << avail_;
        avail_ += 8;
      }
    }
  }
  uint64_t peek() const { return buf_; }
  // Consumes n bits (n <= 32); false if fewer are left.
  bool consume(int n) {
    if (n > avail_) {
      overrun_ = true;
      return false;
    }
    buf_ = n == 64 ? 0 : buf_ >> n;
    avail_ -= n;
    consumed_ += static_cast<size_t>(n);
    return true;
  }
  bool get(int n, uint32_t& v) {
    if (avail_ < n) refill();
    v = static_cast<uint32_t>(buf_ & ((uint64_t{1} << n) - 1));
    return consume(n);
  }
  bool overrun() const { return overrun_; }
  size_t consumed() const { return consumed_; }  // bits, from the start position

 private:
  const uint8_t* p_;
  const uint8_t* end_;
  int skip_;
  uint64_t buf_ = 0;
  int avail_ = 0;
  bool overrun_ = false;
  size_t consumed_ = 0;
};

// read_table on the fast reader; identical results and errors.
Status read_table_fast(TableBitReader& r, int symbol_bits, int prob_bits, uint16_t* freq) {
  const int alphabet = 1 << symbol_bits;
  auto overrun = [] { return corrupt("frequency table: truncated"); };
  r.refill();
  // d: up to P one-bits, then a zero unless d == P.
  const uint64_t ones = r.peek() & ((uint64_t{1} << prob_bits) - 1);
  int d = std::countr_one(ones);
  if (d >= prob_bits) {
    d = prob_bits;
    if (!r.consume(d)) return overrun();
  } else if (!r.consume(d + 1)) {
    return overrun();
  }
  const int p = prob_bits - d;
  uint32_t mode;
  if (!r.get(symbol_bits, mode)) return overrun();
  std::fill(freq, freq + alphabet, uint16_t{0});
  if (p == 0) {
    freq[mode] = static_cast<uint16_t>(1u << prob_bits);
    return ok_status();
  }
  uint32_t fmode;
  if (!r.get(p, fmode)) return overrun();
  fmode += 1;
  freq[mode] = static_cast<uint16_t>(fmode << d);
  uint32_t remaining = (1u << p) - fmode;
  const int last = alphabet - 1;
  for (int j = 1; j < alphabet && remaining > 0; ++j) {
    uint32_t f;
    if (j < last) {
      // Truncated binary over [0, bound]: k bits, or k + 1 when the k-bit prefix is >= u.
      const uint32_t n = std::min(remaining, fmode) + 1;
      const int k = std::bit_width(n) - 1;
      const uint32_t u = (uint32_t{2} << k) - n;
      r.refill();
      // Branch-free: which length applies is data, and mispredicting it per field costs more
      // than computing both.
      const uint64_t bits = r.peek();
      const uint32_t x = static_cast<uint32_t>(bits & ((uint64_t{1} << k) - 1));
      const uint32_t longer = x >= u ? 1u : 0u;
      const uint32_t lng = 2 * x + static_cast<uint32_t>((bits >> k) & 1) - u;
      f = longer ? lng : x;
      if (!r.consume(k + static_cast<int>(longer))) return overrun();
    } else {
      f = remaining;
      if (f > fmode) return corrupt("frequency table: implied frequency exceeds the mode's");
    }
    freq[visit(static_cast<int>(mode), j, alphabet)] = static_cast<uint16_t>(f << d);
    remaining -= f;
  }
  if (remaining != 0) return corrupt("frequency table: frequencies do not sum to 2^p");
  return ok_status();
}

}  // namespace

Status read_tables(BitReader& r, FrequencyTables& t) {
  t.freq.assign(static_cast<size_t>(t.n_tables) * static_cast<size_t>(t.alphabet()), 0);
  if (r.failed()) return corrupt("frequency table: truncated");
  TableBitReader fast(r.data(), r.size(), r.bit_position());
  for (int i = 0; i < t.n_tables; ++i) {
    Status s = read_table_fast(fast, t.symbol_bits, t.prob_bits, t.table(i));
    if (!s.ok()) {
      r.seek(r.size() * 8 + 1);  // leave the caller's reader failed
      return s.with_context("table " + std::to_string(i));
    }
  }
  r.seek(r.bit_position() + fast.consumed());
  return ok_status();
}

Result<FrequencyTables> build_tables(const uint32_t* counts, int n_tables, int symbol_bits,
                                     const TableBuildOptions& o) {
  if (symbol_bits < 1 || symbol_bits > kMaxSymbolBits)
    return invalid_argument("build_tables: symbol_bits must be in 1..8");
  if (o.max_prob_bits < 1 || o.max_prob_bits > kMaxProbBits)
    return invalid_argument("build_tables: max_prob_bits must be in 1..12");
  if (n_tables < 1 || n_tables > kMaxTables)
    return invalid_argument("build_tables: n_tables must be in 1..2^20");
  const int alphabet = 1 << symbol_bits;
  FrequencyTables out;
  out.symbol_bits = symbol_bits;
  out.n_tables = n_tables;
  out.freq.assign(static_cast<size_t>(n_tables) * alphabet, 0);
  std::vector<int> precision(static_cast<size_t>(n_tables), 0);
  std::array<uint16_t, 256> trial{};
  int max_p = 0;
  for (int t = 0; t < n_tables; ++t) {
    const uint32_t* c = counts + static_cast<size_t>(t) * alphabet;
    uint16_t* f = out.table(t);
    uint64_t n = 0;
    int present = 0;
    for (int s = 0; s < alphabet; ++s) n += c[s], present += (c[s] > 0 || o.cover_all);
    int p = o.max_prob_bits;
    if (present <= 1) {
      p = 0;  // one symbol (or none): 2^0 = 1 slot, coded in zero bits
      if (!normalize_counts(c, alphabet, 0, o.cover_all, f)) KVQ_CHECK(false);
    } else if (!o.adaptive_precision) {
      if (!normalize_counts(c, alphabet, p, o.cover_all, f))
        return invalid_argument("build_tables: 2^" + std::to_string(p) + " slots cannot hold " +
                                std::to_string(present) + " symbols");
    } else {
      // Precisions above ceil(log2 n) + 1 cannot reduce the coded bits measurably but cost
      // table bits; below ceil(log2 present) the symbols do not fit. The total cost is close to
      // convex in p with its minimum near log2(n)/2 + 2 (frequencies need about sqrt(n)
      // resolution), so hill-climb from there: typically three evaluations.
      const int p_lo = std::bit_width(static_cast<unsigned>(present - 1));
      const int p_hi =
          std::max(p_lo, std::min(o.max_prob_bits, static_cast<int>(std::bit_width(n - 1)) + 1));
      if (p_lo > o.max_prob_bits)
        return invalid_argument("build_tables: 2^" + std::to_string(o.max_prob_bits) +
                                " slots cannot hold " + std::to_string(present) + " symbols");
      // Table bits are counted as if stored at P = max_prob_bits (the unary precision code can
      // only get shorter once the set's common precision is known).
      auto cost = [&](int q) {
        if (!normalize_counts(c, alphabet, q, o.cover_all, trial.data()))
          return std::numeric_limits<double>::infinity();
        return coded_bits(c, trial.data(), alphabet, q) +
               static_cast<double>(table_bits(trial.data(), symbol_bits, q)) +
               (o.max_prob_bits - q);
      };
      // The measured optimum on KV-like data is this p0 for most tables (docs/entropy.md).
      const int p0 = std::clamp((static_cast<int>(std::bit_width(n)) + 4) / 2, p_lo, p_hi);
      double best = o.precision_search ? cost(p0) : 0.0;
      if (!o.precision_search && !normalize_counts(c, alphabet, p0, o.cover_all, trial.data()))
        KVQ_CHECK(false);  // p0 >= p_lo, so every needed symbol has a slot
      p = p0;
      std::copy(trial.begin(), trial.begin() + alphabet, f);
      for (int dir : {+1, -1}) {
        if (!o.precision_search) break;
        bool moved = false;
        for (int q = p0 + dir; q >= p_lo && q <= p_hi; q += dir) {
          const double cq = cost(q);
          if (!(cq < best)) break;
          best = cq;
          p = q;
          std::copy(trial.begin(), trial.begin() + alphabet, f);
          moved = true;
        }
        if (moved) break;  // convex: improving upwards means downwards cannot help
      }
    }
    precision[static_cast<size_t>(t)] = p;
    max_p = std::max(max_p, p);
  }
  out.prob_bits = max_p;
  for (int t = 0; t < n_tables; ++t) {
    const int shift = max_p - precision[static_cast<size_t>(t)];
    uint16_t* f = out.table(t);
    for (int s = 0; s < alphabet; ++s) f[s] = static_cast<uint16_t>(f[s] << shift);
  }
  return out;
}

Result<FrequencyTables> build_prototypes(const uint32_t* hists, int n, int symbol_bits, int k,
                                         int prob_bits, int iterations) {
  if (symbol_bits < 1 || symbol_bits > kMaxSymbolBits || n < 1 || k < 1 ||
      prob_bits < symbol_bits || prob_bits > kMaxProbBits || iterations < 0)
    return invalid_argument("build_prototypes: bad arguments");
  const int a = 1 << symbol_bits;
  const size_t A = static_cast<size_t>(a);
  // Order the histograms by entropy; the initial centres are evenly spaced ranks (distinct
  // histograms only, so no two centres start equal).
  std::vector<double> ent(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const uint32_t* h = hists + static_cast<size_t>(i) * A;
    uint64_t tot = 0;
    for (int s = 0; s < a; ++s) tot += h[s];
    double e = 0;
    for (int s = 0; s < a; ++s)
      if (h[s]) e -= h[s] * std::log2(static_cast<double>(h[s]) / static_cast<double>(tot));
    ent[static_cast<size_t>(i)] = tot ? e / static_cast<double>(tot) : 0.0;
  }
  std::vector<int> order(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<size_t>(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
    return ent[static_cast<size_t>(x)] < ent[static_cast<size_t>(y)];
  });
  std::vector<int> seeds;
  for (int j = 0; j < k; ++j) {
    const int cand = order[static_cast<size_t>((2 * static_cast<int64_t>(j) + 1) * n / (2 * k))];
    bool dup = false;
    for (int sd : seeds)
      dup = dup ||
            std::equal(hists + static_cast<size_t>(sd) * A, hists + static_cast<size_t>(sd + 1) * A,
                       hists + static_cast<size_t>(cand) * A);
    if (!dup) seeds.push_back(cand);
  }
  const int kk = static_cast<int>(seeds.size());
  // Centres as smoothed probabilities -> per-symbol costs -log2 p.
  std::vector<double> cost(static_cast<size_t>(kk) * A), sum(static_cast<size_t>(kk) * A);
  auto set_centre = [&](int c, const double* counts) {
    double tot = 0;
    for (int s = 0; s < a; ++s) tot += counts[s] + 0.5;
    for (int s = 0; s < a; ++s)
      cost[static_cast<size_t>(c) * A + s] = -std::log2((counts[s] + 0.5) / tot);
  };
  std::vector<double> tmp(A);
  for (int c = 0; c < kk; ++c) {
    for (int s = 0; s < a; ++s)
      tmp[static_cast<size_t>(s)] =
          hists[static_cast<size_t>(seeds[static_cast<size_t>(c)]) * A + s];
    set_centre(c, tmp.data());
  }
  std::vector<int> assign(static_cast<size_t>(n), 0);
  for (int it = 0; it <= iterations; ++it) {
    for (int i = 0; i < n; ++i) {
      const uint32_t* h = hists + static_cast<size_t>(i) * A;
      double best = std::numeric_limits<double>::infinity();
      for (int c = 0; c < kk; ++c) {
        double v = 0;
        for (int s = 0; s < a; ++s) v += h[s] * cost[static_cast<size_t>(c) * A + s];
        if (v < best) best = v, assign[static_cast<size_t>(i)] = c;
      }
    }
    std::fill(sum.begin(), sum.end(), 0.0);
    std::vector<int> members(static_cast<size_t>(kk), 0);
    for (int i = 0; i < n; ++i) {
      const int c = assign[static_cast<size_t>(i)];
      ++members[static_cast<size_t>(c)];
      for (int s = 0; s < a; ++s)
        sum[static_cast<size_t>(c) * A + s] += hists[static_cast<size_t>(i) * A + s];
    }
    if (it == iterations) break;
    for (int c = 0; c < kk; ++c)
      if (members[static_cast<size_t>(c)]) set_centre(c, sum.data() + static_cast<size_t>(c) * A);
  }
  // Final tables from the clusters' summed histograms (empty clusters keep their seed's).
  FrequencyTables out;
  out.symbol_bits = symbol_bits;
  out.prob_bits = prob_bits;
  out.n_tables = kk;
  out.freq.assign(static_cast<size_t>(kk) * A, 0);
  std::vector<uint32_t> counts(A);
  for (int c = 0; c < kk; ++c) {
    bool empty = true;
    for (int s = 0; s < a; ++s) empty = empty && sum[static_cast<size_t>(c) * A + s] == 0.0;
    const double peak = *std::max_element(sum.begin() + static_cast<ptrdiff_t>(c * A),
                                          sum.begin() + static_cast<ptrdiff_t>((c + 1) * A));
    // Scale huge sums into 32 bits (ratios are all that matter).
    const double scale = peak > 1e9 ? 1e9 / peak : 1.0;
    for (int s = 0; s < a; ++s) {
      const double v = empty ? hists[static_cast<size_t>(seeds[static_cast<size_t>(c)]) * A + s]
                             : sum[static_cast<size_t>(c) * A + s] * scale;
      counts[static_cast<size_t>(s)] = static_cast<uint32_t>(v);
    }
    if (!normalize_counts(counts.data(), a, prob_bits, /*cover_all=*/true, out.table(c)))
      return invalid_argument("build_prototypes: 2^prob_bits cannot cover the alphabet");
  }
  return out;
}

void serialize_tables(const FrequencyTables& t, std::vector<uint8_t>& out) {
  KVQ_CHECK(validate_tables(t).ok());
  ByteWriter bw(out);
  bw.u8(static_cast<uint8_t>(t.symbol_bits));
  bw.u8(static_cast<uint8_t>(t.prob_bits));
  bw.varint(static_cast<uint64_t>(t.n_tables));
  BitWriter w(out);
  write_tables(w, t);
  w.flush();
}

Result<FrequencyTables> deserialize_tables(const uint8_t* in, size_t size) {
  ByteReader br(in, size);
  uint8_t sb, pb;
  uint64_t nt;
  if (!br.u8(sb) || !br.u8(pb) || !br.varint(nt)) return corrupt("table set: truncated header");
  if (sb < 1 || sb > kMaxSymbolBits) return corrupt("table set: symbol_bits outside 1..8");
  if (pb > kMaxProbBits) return corrupt("table set: prob_bits outside 0..12");
  if (nt < 1 || nt > static_cast<uint64_t>(kMaxTables))
    return corrupt("table set: n_tables outside 1..2^20");
  // Every table takes at least 1 + symbol_bits bits unless d == P; bound the allocation by the
  // input size before trusting n_tables.
  if (nt > br.remaining() * 8) return corrupt("table set: n_tables larger than the data");
  FrequencyTables t;
  t.symbol_bits = sb;
  t.prob_bits = pb;
  t.n_tables = static_cast<int>(nt);
  BitReader r(br.cursor(), br.remaining());
  KVQ_RETURN_IF_ERROR(read_tables(r, t).with_context("table set"));
  if (!r.finish_byte()) return corrupt("table set: nonzero padding bits");
  if (r.byte_position() != br.remaining()) return corrupt("table set: trailing bytes");
  return t;
}

}  // namespace kvq::entropy
