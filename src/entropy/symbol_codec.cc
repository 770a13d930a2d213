#include "entropy/symbol_codec.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/cpu.h"
#include "entropy/transpose.h"
#include "kvq/bitpack.h"

#if KVQ_SIMD_X86
// GCC 12's intrinsic headers initialise "undefined" vectors with themselves, which trips
// -Wmaybe-uninitialized once inlined (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

namespace kvq::entropy {

namespace {

constexpr size_t kRansHeaderBytes = 2;
constexpr double kWideLanesMinBytes = 4096;  // estimated stream size for 32 lanes

Status check_shape(int64_t n_tokens, int n_channels, int bits, size_t& n) {
  if (bits < 1 || bits > kMaxSymbolBits)
    return invalid_argument("symbol codec: bits " + std::to_string(bits) + " outside 1..8");
  if (n_channels < 1 || n_channels > kMaxTables)
    return invalid_argument("symbol codec: n_channels " + std::to_string(n_channels) +
                            " outside 1..2^20");
  if (n_tokens < 0 || n_tokens > (int64_t{1} << 40) / n_channels)
    return invalid_argument("symbol codec: n_tokens " + std::to_string(n_tokens) +
                            " negative or too large");
  n = static_cast<size_t>(n_tokens) * static_cast<size_t>(n_channels);
  return ok_status();
}

// c * log2(c), from a table for the small counts that chunks have.
inline double c_log2_c(uint64_t c) {
  static const auto table = [] {
    std::vector<double> t(8193, 0.0);
    for (size_t i = 1; i < t.size(); ++i)
      t[i] = static_cast<double>(i) * std::log2(static_cast<double>(i));
    return t;
  }();
  return c < table.size() ? table[c] : static_cast<double>(c) * std::log2(static_cast<double>(c));
}

// Coded bits of a histogram c[a] under each of 16 tables: acc[t] = sum over present symbols sy
// of c[sy] * cost[sy * 16 + t], summed in symbol order.
inline void costs16(const uint32_t* c, int a, const double* cost, double* acc) {
  double r[16] = {};
  for (int sy = 0; sy < a; ++sy) {
    if (!c[sy]) continue;
    const double cs = c[sy];
    const double* row = cost + static_cast<size_t>(sy) * 16;
    for (int t = 0; t < 16; ++t) r[t] += cs * row[t];
  }
  std::copy(r, r + 16, acc);
}

#if KVQ_SIMD_X86
// Per lane the same products and sums in the same order as costs16, in two registers.
KVQ_TARGET_AVX512 void costs16_avx512(const uint32_t* c, int a, const double* cost, double* acc) {
  __m512d r0 = _mm512_setzero_pd(), r1 = _mm512_setzero_pd();
  for (int sy = 0; sy < a; ++sy) {
    if (!c[sy]) continue;
    const __m512d cs = _mm512_set1_pd(static_cast<double>(c[sy]));
    const double* row = cost + static_cast<size_t>(sy) * 16;
    r0 = _mm512_add_pd(r0, _mm512_mul_pd(cs, _mm512_loadu_pd(row)));
    r1 = _mm512_add_pd(r1, _mm512_mul_pd(cs, _mm512_loadu_pd(row + 8)));
  }
  _mm512_storeu_pd(acc, r0);
  _mm512_storeu_pd(acc + 8, r1);
}
#endif

// Shannon size in bits of a histogram: n log2 n - sum c log2 c.
template <class Count>
double entropy_bits(const Count* counts, int alphabet) {
  uint64_t n = 0;
  double s = 0;
  for (int i = 0; i < alphabet; ++i) {
    n += counts[i];
    s += c_log2_c(counts[i]);
  }
  return n ? std::max(0.0, c_log2_c(n) - s) : 0.0;
}

// Everything needed to write one rANS candidate.
struct RansPlan {
  bool valid = false;
  bool per_channel = false;
  FrequencyTables tables;          // inline candidate only
  std::vector<uint8_t> table_buf;  // the tables, written once (LSB-first bits, zero-padded)
  size_t table_bits = 0;
  double est_bytes = std::numeric_limits<double>::infinity();

  // Invalid, keeping the containers' storage.
  void reset() {
    valid = false;
    per_channel = false;
    table_buf.clear();
    table_bits = 0;
    est_bytes = std::numeric_limits<double>::infinity();
  }
};

// The coder's scratch objects, one set per workspace (Workspace::persistent): their containers
// keep their capacity between streams, so a warm encoder or decoder allocates nothing.
struct EncodeScratch {
  RansPlan plans[2];  // the candidates with inline tables (per channel, pooled)
  RansModel model;    // the chosen inline tables, prepared for encoding
  std::vector<uint8_t> words;
};
struct DecodeScratch {
  FrequencyTables tables;  // a stream's inline tables
  RansModel model;
};

// Bits the final-state block is expected to take: e + P + 4 per lane with e ~ uniform in
// [0, 15] for long lanes; a lane with few symbols ends lower, so this slightly over-estimates.
double est_state_bits(int lanes, int prob_bits) { return lanes * (prob_bits + 4 + 7.5); }

// Fills `plan` (reset first) with the inline-table candidate for these histograms.
void plan_inline(const uint32_t* counts, int n_tables, int bits, const SymbolCodecOptions& o,
                 int lanes, bool per_channel, RansPlan& plan, Workspace& ws) {
  plan.reset();
  TableBuildOptions tbo;
  tbo.max_prob_bits = o.prob_bits;
  tbo.adaptive_precision = o.adaptive_precision;
  tbo.precision_search = o.precision_search;
  // e.g. P too small for the alphabet: not a candidate
  if (!build_tables_into(counts, n_tables, bits, tbo, plan.tables, &ws).ok()) return;
  const int a = 1 << bits;
  double payload = 0;
  for (int t = 0; t < n_tables; ++t)
    payload += coded_bits(counts + static_cast<size_t>(t) * a, plan.tables.table(t), a,
                          plan.tables.prob_bits);
  {
    BitWriter w(plan.table_buf);
    write_tables(w, plan.tables);
    plan.table_bits = w.bits();
    w.flush();
  }
  plan.est_bytes = kRansHeaderBytes +
                   (plan.table_bits + est_state_bits(lanes, plan.tables.prob_bits)) / 8.0 +
                   payload / 8.0;
  plan.per_channel = per_channel;
  plan.valid = true;
}

}  // namespace

const char* stream_mode_name(StreamMode mode) {
  switch (mode) {
    case StreamMode::kRaw:
      return "raw";
    case StreamMode::kConstant:
      return "constant";
    case StreamMode::kRansInline:
      return "rans";
    case StreamMode::kRansShared:
      return "rans-shared";
  }
  return "unknown";
}

int default_lanes_log2(size_t n) {
  // 16 lanes feed the AVX-512 paths; below ~2K symbols the per-lane state flush (~P + 3.5 bits)
  // outweighs speed, so use fewer lanes (scalar path), about one lane per 128-256 symbols.
  // encode_symbols raises 16 to 32 for streams estimated at >= 4 KiB.
  if (n >= 2048) return 4;
  int k = 0;
  while (k < 3 && (size_t{256} << k) <= n) ++k;
  return k;
}

Result<SharedTables> make_shared_tables(FrequencyTables tables, RansModelUse use) {
  if (tables.n_tables > kMaxSharedTables)
    return invalid_argument("shared tables: " + std::to_string(tables.n_tables) +
                            " tables, at most " + std::to_string(kMaxSharedTables));
  KVQ_ASSIGN_OR_RETURN(RansModel model, make_rans_model(tables, use));
  SharedTables s;
  const int a = tables.alphabet(), k = tables.n_tables;
  // The encoder's per-symbol costs (a decoder has no use for them).
  if (use != RansModelUse::kDecode) {
    s.cost_stride = (k + 15) / 16 * 16;
    s.cost.assign(static_cast<size_t>(a) * s.cost_stride, std::numeric_limits<double>::infinity());
    for (int t = 0; t < k; ++t)
      for (int sy = 0; sy < a; ++sy) {
        const uint16_t f = tables.table(t)[sy];
        if (f)
          s.cost[static_cast<size_t>(sy) * s.cost_stride + t] =
              tables.prob_bits - std::log2(static_cast<double>(f));
      }
  }
  s.tables = std::move(tables);
  s.model = std::move(model);
  return s;
}

TableAccumulator::TableAccumulator(int n_channels, int bits, bool per_channel)
    : n_channels_(n_channels), bits_(bits), per_channel_(per_channel) {
  if (bits >= 1 && bits <= kMaxSymbolBits && n_channels >= 1 && n_channels <= kMaxTables)
    counts_.assign(static_cast<size_t>(per_channel ? n_channels : 1) << bits, 0);
}

Status TableAccumulator::add(const uint8_t* symbols, int64_t n_tokens) {
  size_t n;
  KVQ_RETURN_IF_ERROR(check_shape(n_tokens, n_channels_, bits_, n));
  const int nt = per_channel_ ? n_channels_ : 1;
  std::vector<uint32_t> c(counts_.size());
  KVQ_RETURN_IF_ERROR(count_symbols(symbols, n, bits_, nt, c.data()));
  for (size_t i = 0; i < c.size(); ++i) counts_[i] += c[i];
  return ok_status();
}

Result<FrequencyTables> TableAccumulator::build(const SymbolCodecOptions& o, bool cover_all) const {
  size_t n;
  KVQ_RETURN_IF_ERROR(check_shape(0, n_channels_, bits_, n));
  // Scale 64-bit totals into 32 bits without losing any nonzero count.
  uint64_t mx = 0;
  for (uint64_t v : counts_) mx = std::max(mx, v);
  const int shift = mx >> 31 ? std::bit_width(mx >> 31) : 0;
  std::vector<uint32_t> c(counts_.size());
  for (size_t i = 0; i < c.size(); ++i)
    c[i] = counts_[i] ? static_cast<uint32_t>(std::max<uint64_t>(1, counts_[i] >> shift)) : 0;
  TableBuildOptions tbo;
  tbo.max_prob_bits = o.prob_bits;
  tbo.adaptive_precision = o.adaptive_precision;
  tbo.precision_search = o.precision_search;
  tbo.cover_all = cover_all;
  return build_tables(c.data(), per_channel_ ? n_channels_ : 1, bits_, tbo);
}

Status encode_symbols(const uint8_t* symbols, int64_t n_tokens, int n_channels, int bits,
                      const SymbolCodecOptions& o, std::vector<uint8_t>& out, EncodeStats* stats,
                      const SharedTables* shared, const uint32_t* given_counts, Workspace* wsp) {
  size_t n;
  KVQ_RETURN_IF_ERROR(check_shape(n_tokens, n_channels, bits, n));
  if (o.prob_bits < 1 || o.prob_bits > kMaxProbBits)
    return invalid_argument("symbol codec: prob_bits " + std::to_string(o.prob_bits) +
                            " outside 1..12");
  if (o.lanes_log2 < -1 || o.lanes_log2 > kMaxLanesLog2)
    return invalid_argument("symbol codec: lanes_log2 outside -1..5");
  if (shared) {
    const int nt = shared->tables.n_tables;
    if (shared->tables.symbol_bits != bits || nt > kMaxSharedTables ||
        shared->model.n_tables != nt || shared->cost_stride < nt ||
        shared->cost.size() != static_cast<size_t>(shared->cost_stride) << bits)
      return invalid_argument(
          "symbol codec: shared tables do not match bits (or are not from make_shared_tables)");
    if (shared->model.enc_rcp.empty())
      return invalid_argument("symbol codec: shared tables were prepared for decoding only");
  }
  const int a = 1 << bits;
  int lanes_log2 = o.lanes_log2 >= 0 ? o.lanes_log2 : default_lanes_log2(n);
  int lanes = 1 << lanes_log2;

  Workspace local_ws;  // empty until used: only a null ws allocates
  Workspace& ws = wsp ? *wsp : local_ws;
  Workspace::Frame frame(ws);
  EncodeScratch& scratch = ws.persistent<EncodeScratch>();

  // Histograms per channel (also validates every symbol < 2^bits).
  const size_t n_counts = static_cast<size_t>(n_channels) * a;
  uint32_t* const counts = ws.alloc<uint32_t>(n_counts);
  if (given_counts) {
    uint8_t any = 0;  // range check: one OR over the symbols
    for (size_t i = 0; i < n; ++i) any = static_cast<uint8_t>(any | symbols[i]);
    if (any >> bits) return out_of_range("symbol stream: a symbol is >= 2^" + std::to_string(bits));
    std::copy(given_counts, given_counts + n_counts, counts);
  } else {
    KVQ_RETURN_IF_ERROR(count_symbols(symbols, n, bits, n_channels, counts));
  }
  uint32_t pooled[1 << kMaxSymbolBits] = {};
  for (int c = 0; c < n_channels; ++c)
    for (int s = 0; s < a; ++s) pooled[s] += counts[static_cast<size_t>(c) * a + s];
  int distinct = 0, only = 0;
  for (int s = 0; s < a; ++s)
    if (pooled[s]) ++distinct, only = s;

  const size_t start = out.size();
  const size_t raw_bytes = 1 + packed_size(n, bits);
  EncodeStats st;

  auto emit_raw = [&] {
    out.resize(start + raw_bytes);
    out[start] = static_cast<uint8_t>(StreamMode::kRaw);
    if (n) pack_bits(symbols, n, bits, out.data() + start + 1);
    st = EncodeStats{};
    st.mode = StreamMode::kRaw;
    st.header_bytes = 1;
    st.payload_bytes = raw_bytes - 1;
  };

  bool done = false;
  if (n == 0) {
    emit_raw();
    done = true;
  } else if (distinct == 1) {
    out.push_back(static_cast<uint8_t>(StreamMode::kConstant));
    out.push_back(static_cast<uint8_t>(only));
    st.mode = StreamMode::kConstant;
    st.header_bytes = 1;
    st.payload_bytes = 1;
    done = true;
  }

  if (!done) {
    // Candidates: inline tables (per-channel and/or pooled) and shared tables.
    RansPlan* best_plan = &scratch.plans[0];
    RansPlan* other_plan = &scratch.plans[1];
    best_plan->reset();
    const bool try_inline = o.inline_tables || !shared;
    if (try_inline && o.layout != TableLayout::kPooled)
      plan_inline(counts, n_channels, bits, o, lanes, true, *best_plan, ws);
    if (try_inline && o.layout != TableLayout::kPerChannel) {
      plan_inline(pooled, 1, bits, o, lanes, false, *other_plan, ws);
      if (other_plan->valid && other_plan->est_bytes < best_plan->est_bytes)
        std::swap(best_plan, other_plan);
    }
    RansPlan& best = *best_plan;
    // Shared tables: every channel (or the whole stream) picks the set's cheapest table for its
    // histogram; the choices cost bit_width(K - 1) bits each.
    bool use_shared = false;
    bool shared_per_channel = true;
    uint8_t* const shared_index = ws.alloc<uint8_t>(static_cast<size_t>(n_channels));
    if (shared) {
      const int k = shared->tables.n_tables;
      const int w = std::bit_width(static_cast<unsigned>(k - 1));
      const int stride = shared->cost_stride;
      [[maybe_unused]] const bool avx512 = simd_level() >= SimdLevel::kAvx512;
      auto pick = [&](const uint32_t* c, double& bits_out) {
        // Coded bits of the histogram under every table: sum over present symbols of count x
        // cost (padding tables cost +inf). Sixteen tables or fewer: accumulators in registers.
        double acc[kMaxSharedTables];
        if (stride == 16) {
#if KVQ_SIMD_X86
          if (avx512)
            costs16_avx512(c, a, shared->cost.data(), acc);
          else
#endif
            costs16(c, a, shared->cost.data(), acc);
        } else {
          std::fill(acc, acc + stride, 0.0);
          for (int sy = 0; sy < a; ++sy) {
            if (!c[sy]) continue;
            const double cs = c[sy];
            const double* row = shared->cost.data() + static_cast<size_t>(sy) * stride;
            for (int t = 0; t < stride; ++t) acc[t] += cs * row[t];
          }
        }
        int bt = 0;
        for (int t = 1; t < k; ++t)
          if (acc[t] < acc[bt]) bt = t;
        bits_out = acc[bt];
        return static_cast<uint8_t>(bt);
      };
      double pc_payload = 0;
      for (int c = 0; c < n_channels; ++c) {
        double b = 0;
        shared_index[c] = pick(counts + static_cast<size_t>(c) * a, b);
        pc_payload += b;
      }
      double pool_payload = 0;
      const uint8_t pool_index = pick(pooled, pool_payload);
      const double st_bits = est_state_bits(lanes, shared->tables.prob_bits);
      const double est_pc =
          kRansHeaderBytes + (static_cast<double>(w) * n_channels + st_bits + pc_payload) / 8.0;
      const double est_pool = kRansHeaderBytes + (w + st_bits + pool_payload) / 8.0;
      if (n_channels > 1 && std::isfinite(est_pool) && est_pool <= est_pc) {
        shared_per_channel = false;
        shared_index[0] = pool_index;
      }
      const double est = shared_per_channel ? est_pc : est_pool;
      if (std::isfinite(est) && est < best.est_bytes && est < static_cast<double>(raw_bytes)) {
        use_shared = true;
        best.est_bytes = est;
      }
    }
    if (use_shared || (best.valid && best.est_bytes < static_cast<double>(raw_bytes))) {
      // 32 lanes decode ~1.5x faster than 16 (the 16-lane step is latency-bound) but flush 16
      // more states (~P + 3.5 bits each); take them once that costs <= ~0.5% of the stream.
      if (o.lanes_log2 < 0 && lanes_log2 == 4 && best.est_bytes >= kWideLanesMinBytes) {
        lanes_log2 = 5;
        lanes = 32;
      }
      const FrequencyTables& tables = use_shared ? shared->tables : best.tables;
      const bool per_channel = use_shared ? shared_per_channel : tables.n_tables != 1;
      // The SIMD paths need every step of `lanes` symbols inside one channel's run.
      if (o.lanes_log2 < 0 && per_channel && lanes_log2 == 5 && n_tokens % 32 != 0) lanes_log2 = 4;
      if (o.lanes_log2 < 0 && per_channel && lanes_log2 == 4 && n_tokens % 16 != 0) lanes_log2 = 3;
      lanes = 1 << lanes_log2;
      const RansModel* model = use_shared ? &shared->model : &scratch.model;
      if (!use_shared) {
        KVQ_CHECK(prepare_rans_model(tables, RansModelUse::kEncode, scratch.model).ok());
        model = &scratch.model;
      }
      // Coding order: channel-major (every channel's tokens form one run with one table).
      uint8_t* const cm = ws.alloc<uint8_t>(n);
      transpose_bytes(symbols, static_cast<size_t>(n_tokens), static_cast<size_t>(n_channels), cm);
      uint32_t states[32];
      std::vector<uint8_t>& words = scratch.words;
      words.clear();
      words.reserve(2 * n);  // at most one 16-bit word per symbol: no regrowth for this size
      const size_t run = per_channel ? static_cast<size_t>(n_tokens) : n;
      KVQ_RETURN_IF_ERROR(rans_encode(*model, cm, n, run, lanes_log2, states, words, o.impl,
                                      use_shared ? shared_index : nullptr, &ws));
      const StreamMode mode = use_shared ? StreamMode::kRansShared : StreamMode::kRansInline;
      // The stream's size before writing it: when it is not smaller than raw mode, `out` never
      // holds it, so it grows by at most raw_bytes per stream (a caller can reserve that).
      const int n_idx = per_channel ? n_channels : 1;
      const int iw = std::bit_width(static_cast<unsigned>(tables.n_tables - 1));
      const size_t head_bits = use_shared ? static_cast<size_t>(iw) * n_idx : best.table_bits;
      const size_t total = kRansHeaderBytes +
                           (head_bits + states_bits(states, lanes, tables.prob_bits) + 7) / 8 +
                           words.size();
      if (total >= raw_bytes) {
        emit_raw();
      } else {
        out.push_back(static_cast<uint8_t>(static_cast<unsigned>(mode) |
                                           static_cast<unsigned>(lanes_log2) << 2 |
                                           (per_channel ? 1u : 0u) << 5));
        out.push_back(static_cast<uint8_t>(tables.prob_bits));
        BitWriter w(out);
        if (use_shared) {
          for (int c = 0; c < n_idx; ++c) w.put(shared_index[c], iw);
        } else {
          w.put_bits(best.table_buf.data(), best.table_bits);
        }
        const size_t tbits = w.bits();
        write_states(w, states, lanes, tables.prob_bits);
        w.flush();
        out.insert(out.end(), words.begin(), words.end());
        KVQ_CHECK(out.size() - start == total);
        st.mode = mode;
        st.header_bytes = kRansHeaderBytes;
        st.table_bits = tbits;
        st.table_bytes = (tbits + 7) / 8;
        st.payload_bytes = total - kRansHeaderBytes - st.table_bytes;
        st.n_tables = use_shared ? (per_channel ? n_channels : 1) : tables.n_tables;
        st.prob_bits = tables.prob_bits;
        st.lanes = lanes;
      }
    } else {
      emit_raw();
    }
  }
  if (stats) {
    st.total_bytes = out.size() - start;
    const bool pooled_used = st.n_tables == 1 && n_channels > 1;
    // From the histograms already taken (the same as shannon_bits() of the input).
    double sh = 0;
    if (!o.stats_shannon) {
    } else if (pooled_used) {
      sh = entropy_bits(pooled, a);
    } else {
      for (int c = 0; c < n_channels; ++c)
        sh += entropy_bits(counts + static_cast<size_t>(c) * a, a);
    }
    st.shannon_bits = sh;
    *stats = st;
  }
  return ok_status();
}

Status decode_symbols(const uint8_t* in, size_t size, int64_t n_tokens, int n_channels, int bits,
                      uint8_t* symbols, const SharedTables* shared, RansImpl impl, StreamInfo* info,
                      Workspace* wsp) {
  size_t n;
  KVQ_RETURN_IF_ERROR(check_shape(n_tokens, n_channels, bits, n));
  if (size < 1) return corrupt("symbol stream: empty");
  const uint8_t head = in[0];
  const auto mode = static_cast<StreamMode>(head & 3u);
  switch (mode) {
    case StreamMode::kRaw: {
      if (head != 0) return format_error("symbol stream: reserved header bits set");
      const size_t want = 1 + packed_size(n, bits);
      if (size != want)
        return corrupt("symbol stream: raw mode needs " + std::to_string(want) + " bytes, got " +
                       std::to_string(size));
      if (n == 0) {
        if (info) *info = StreamInfo{StreamMode::kRaw, 1, 0, 0};
        return ok_status();
      }
      const size_t used_bits = n * static_cast<size_t>(bits) % 8;
      if (used_bits && (in[size - 1] >> used_bits))
        return corrupt("symbol stream: nonzero padding bits in raw mode");
      unpack_bits(in + 1, n, bits, symbols);
      if (info) *info = StreamInfo{StreamMode::kRaw, 1, 0, size - 1};
      return ok_status();
    }
    case StreamMode::kConstant: {
      if (head != 1) return format_error("symbol stream: reserved header bits set");
      if (size != 2) return corrupt("symbol stream: constant mode needs 2 bytes");
      if (in[1] >> bits) return corrupt("symbol stream: constant symbol >= 2^bits");
      std::fill(symbols, symbols + n, in[1]);
      if (info) *info = StreamInfo{StreamMode::kConstant, 1, 0, 1};
      return ok_status();
    }
    case StreamMode::kRansInline:
    case StreamMode::kRansShared: {
      if (head >> 6) return format_error("symbol stream: reserved header bits set");
      const int lanes_log2 = (head >> 2) & 7;
      if (lanes_log2 > kMaxLanesLog2) return corrupt("symbol stream: more than 32 lanes");
      const bool per_channel = (head >> 5) & 1;
      if (size < kRansHeaderBytes) return corrupt("symbol stream: truncated header");
      const int prob_bits = in[1];
      if (prob_bits > kMaxProbBits) return corrupt("symbol stream: prob_bits above 12");
      const int n_tables = per_channel ? n_channels : 1;
      BitReader r(in + kRansHeaderBytes, size - kRansHeaderBytes);
      Workspace local_ws;  // empty until used: only a null ws allocates
      Workspace& ws = wsp ? *wsp : local_ws;
      Workspace::Frame frame(ws);
      DecodeScratch& scratch = ws.persistent<DecodeScratch>();
      const RansModel* model = nullptr;
      const uint8_t* map = nullptr;
      if (mode == StreamMode::kRansShared) {
        if (!shared) return invalid_argument("symbol stream: needs the shared tables");
        const FrequencyTables& t = shared->tables;
        if (t.symbol_bits != bits || t.prob_bits != prob_bits || t.n_tables > kMaxSharedTables)
          return invalid_argument("symbol stream: shared tables do not match the stream");
        // One table index per channel (or one for the stream), bit_width(K - 1) bits each.
        const int iw = std::bit_width(static_cast<unsigned>(t.n_tables - 1));
        uint8_t* const run_index = ws.alloc<uint8_t>(static_cast<size_t>(n_tables));
        for (int i = 0; i < n_tables; ++i) {
          uint8_t& idx = run_index[i];
          uint32_t v;
          if (!r.get(iw, v)) return corrupt("symbol stream: truncated shared-table indices");
          if (v >= static_cast<uint32_t>(t.n_tables))
            return corrupt("symbol stream: shared-table index " + std::to_string(v) +
                           " >= " + std::to_string(t.n_tables));
          idx = static_cast<uint8_t>(v);
        }
        map = run_index;
        model = &shared->model;
      } else {
        FrequencyTables& t = scratch.tables;
        t.symbol_bits = bits;
        t.prob_bits = prob_bits;
        t.n_tables = n_tables;
        // Each table takes at least symbol_bits bits: bound n_tables by the data first.
        if (static_cast<uint64_t>(n_tables) * bits > (size - kRansHeaderBytes) * 8)
          return corrupt("symbol stream: too short for its tables");
        KVQ_RETURN_IF_ERROR(read_tables(r, t).with_context("symbol stream"));
        Status ms = prepare_rans_model(t, RansModelUse::kDecode, scratch.model);
        if (!ms.ok()) return corrupt("symbol stream: " + ms.message());
        model = &scratch.model;
      }
      const size_t tbits = r.bit_position();
      uint32_t states[32];
      KVQ_RETURN_IF_ERROR(read_states(r, states, 1 << lanes_log2, prob_bits));
      if (!r.finish_byte()) return corrupt("symbol stream: nonzero padding bits");
      const size_t off = kRansHeaderBytes + r.byte_position();
      if ((size - off) % 2) return corrupt("symbol stream: odd number of word bytes");
      uint8_t* const cm = ws.alloc<uint8_t>(n);
      const size_t run = per_channel ? static_cast<size_t>(n_tokens) : n;
      KVQ_RETURN_IF_ERROR(rans_decode(*model, states, in + off, size - off, n,
                                      std::max<size_t>(run, 1), lanes_log2, cm, impl, map));
      transpose_bytes(cm, static_cast<size_t>(n_channels), static_cast<size_t>(n_tokens), symbols);
      if (info) {
        const size_t tbytes = (tbits + 7) / 8;
        *info = StreamInfo{mode, kRansHeaderBytes, tbytes, size - kRansHeaderBytes - tbytes};
      }
      return ok_status();
    }
  }
  return format_error("symbol stream: unknown mode");
}

double shannon_bits(const uint8_t* symbols, int64_t n_tokens, int n_channels, int bits,
                    bool per_channel) {
  if (bits < 1 || bits > kMaxSymbolBits || n_channels < 1 || n_tokens <= 0) return 0.0;
  const int a = 1 << bits;
  const size_t nt = per_channel ? static_cast<size_t>(n_channels) : 1;
  std::vector<uint64_t> counts(nt * a, 0);
  const size_t nc = static_cast<size_t>(n_channels);
  for (int64_t t = 0; t < n_tokens; ++t)
    for (size_t c = 0; c < nc; ++c)
      counts[(per_channel ? c : 0) * a + (symbols[t * nc + c] & (a - 1))] += 1;
  double total = 0;
  for (size_t i = 0; i < nt; ++i) total += entropy_bits(counts.data() + i * a, a);
  return total;
}

Status check_stream_ends(const uint8_t* ends, int64_t n, size_t region, const std::string& what) {
  if (n == 0 && region != 0) return corrupt(what + ": bytes after no stream");
  uint32_t prev = 0;
  for (int64_t s = 0; s < n; ++s) {
    uint32_t end;
    std::memcpy(&end, ends + 4 * static_cast<size_t>(s), 4);
    if (end < prev || end > region)
      return corrupt(what + ": stream " + std::to_string(s) + " ends at " + std::to_string(end) +
                     ", outside [" + std::to_string(prev) + ", " + std::to_string(region) + "]");
    if (s == n - 1 && end != region)
      return corrupt(what + ": " + std::to_string(region - end) + " bytes after the last stream");
    prev = end;
  }
  return ok_status();
}

}  // namespace kvq::entropy
