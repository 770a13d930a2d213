#include "entropy/cachegen_codes.h"

#include <algorithm>
#include <cmath>

#include "core/cpu.h"
#include "kvq/bitpack.h"
#include "kvq/dtype.h"

namespace kvq::cachegen {

namespace {

void check_args(int64_t n, int64_t dim, int bits, int64_t group) {
  KVQ_CHECK(n >= 0 && dim >= 1 && bits >= 1 && bits <= 8 && group >= 1);
}

// Restart period of a delta mode in tokens (0 = never restarts).
int64_t period(DeltaMode mode, int64_t group) {
  return mode == DeltaMode::kGroup || mode == DeltaMode::kAnchor ? group : 0;
}

}  // namespace

const char* delta_mode_name(DeltaMode mode) {
  switch (mode) {
    case DeltaMode::kNone:
      return "none";
    case DeltaMode::kToken:
      return "token";
    case DeltaMode::kGroup:
      return "group";
    case DeltaMode::kAnchor:
      return "anchor";
    case DeltaMode::kAuto:
      return "auto";
  }
  return "unknown";
}

int64_t param_count(int64_t n, int64_t dim, int64_t group, Axis axis) {
  return axis == Axis::kChannel ? (n + group - 1) / group * dim : n * n_channel_groups(dim, group);
}

void quantize_to_codes(const float* x, int64_t n, int64_t dim, int bits, int64_t group, Axis axis,
                       uint8_t* codes, QuantParams* params) {
  check_args(n, dim, bits, group);
  if (axis == Axis::kToken) {
    quantize_per_token(x, n, dim, dim, group, bits, codes, params);
    return;
  }
  for (int64_t t0 = 0, g = 0; t0 < n; t0 += group, ++g) {
    const int64_t rows = std::min(group, n - t0);
    quantize_per_channel(x + t0 * dim, rows, dim, dim, bits, codes + t0 * dim, params + g * dim);
  }
}

CodeStream quantize_to_codes(const float* x, int64_t n, int64_t dim, int bits, int64_t group,
                             Axis axis) {
  CodeStream s;
  s.n_rows = n;
  s.dim = dim;
  s.bits = bits;
  s.group = group;
  s.axis = axis;
  s.codes.resize(static_cast<size_t>(n * dim));
  s.params.resize(static_cast<size_t>(param_count(n, dim, group, axis)));
  quantize_to_codes(x, n, dim, bits, group, axis, s.codes.data(), s.params.data());
  return s;
}

void dequant_codes(const uint8_t* codes, int64_t n, int64_t dim, int64_t group, Axis axis,
                   const QuantParams* params, float* out) {
  if (axis == Axis::kToken) {
    dequantize_per_token(codes, n, dim, group, params, out);
    return;
  }
  for (int64_t t0 = 0, g = 0; t0 < n; t0 += group, ++g) {
    const int64_t rows = std::min(group, n - t0);
    dequantize_per_channel(codes + t0 * dim, rows, dim, params + g * dim, out + t0 * dim);
  }
}

void dequant_codes(const CodeStream& s, float* out) {
  dequant_codes(s.codes.data(), s.n_rows, s.dim, s.group, s.axis, s.params.data(), out);
}

namespace {

// The byte loops of the delta transforms are compiled once per SIMD level (core/cpu.h): modular
// byte arithmetic, identical at every width. The argument checks sit inside the bodies so that
// each clone knows the sizes are valid (GCC otherwise warns about copies it cannot bound).

template <SimdLevel L>
KVQ_ALWAYS_INLINE void apply_delta_body(DeltaMode mode, int64_t group, const uint8_t* codes,
                                        int64_t n, int64_t dim, int bits, uint8_t* out) {
  check_args(n, dim, bits,
             std::max<int64_t>(group, 1));  // inside the clones: they then know the sizes are valid
  const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1u);
  const size_t D = static_cast<size_t>(dim);
  if (mode == DeltaMode::kNone || n == 0) {
    if (out != codes) std::copy(codes, codes + n * dim, out);
    return;
  }
  const int64_t per = period(mode, group);
  // Walk backwards so that in-place operation reads every reference row before overwriting it
  // (the previous row for token/group deltas, the run's anchor for anchor deltas).
  for (int64_t t = n - 1; t >= 0; --t) {
    const int64_t run0 = per ? t / per * per : 0;
    if (t == run0) {
      if (out != codes) std::copy(codes + t * dim, codes + (t + 1) * dim, out + t * dim);
      continue;
    }
    const uint8_t* ref = codes + (mode == DeltaMode::kAnchor ? run0 : t - 1) * dim;
    const uint8_t* c = codes + t * dim;
    uint8_t* o = out + t * dim;
    for (size_t d = 0; d < D; ++d) o[d] = static_cast<uint8_t>((c[d] - ref[d]) & mask);
  }
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void invert_delta_body(DeltaMode mode, int64_t group, const uint8_t* symbols,
                                         int64_t n, int64_t dim, int bits, uint8_t* out) {
  check_args(n, dim, bits,
             std::max<int64_t>(group, 1));  // inside the clones: they then know the sizes are valid
  const uint8_t mask = static_cast<uint8_t>((1u << bits) - 1u);
  const size_t D = static_cast<size_t>(dim);
  if (mode == DeltaMode::kNone || n == 0) {
    if (out != symbols) std::copy(symbols, symbols + n * dim, out);
    return;
  }
  const int64_t per = period(mode, group);
  // Forwards: every reference row (previous token, or the run's anchor) is already decoded.
  for (int64_t t = 0; t < n; ++t) {
    const int64_t run0 = per ? t / per * per : 0;
    const uint8_t* s = symbols + t * dim;
    uint8_t* o = out + t * dim;
    if (t == run0) {
      if (out != symbols) std::copy(s, s + D, o);
      continue;
    }
    const uint8_t* ref = out + (mode == DeltaMode::kAnchor ? run0 : t - 1) * dim;
    for (size_t d = 0; d < D; ++d) o[d] = static_cast<uint8_t>((s[d] + ref[d]) & mask);
  }
}

KVQ_LEVEL_CLONES(void, apply_delta,
                 (DeltaMode mode, int64_t group, const uint8_t* codes, int64_t n, int64_t dim,
                  int bits, uint8_t* out),
                 (mode, group, codes, n, dim, bits, out))
KVQ_LEVEL_CLONES(void, invert_delta,
                 (DeltaMode mode, int64_t group, const uint8_t* symbols, int64_t n, int64_t dim,
                  int bits, uint8_t* out),
                 (mode, group, symbols, n, dim, bits, out))

}  // namespace

void apply_delta(DeltaMode mode, int64_t group, const uint8_t* codes, int64_t n, int64_t dim,
                 int bits, uint8_t* out) {
  KVQ_CHECK(mode != DeltaMode::kAuto);  // needs a mask: chunk_symbols
  KVQ_LEVEL_DISPATCH(apply_delta, (mode, group, codes, n, dim, bits, out));
}

void invert_delta(DeltaMode mode, int64_t group, const uint8_t* symbols, int64_t n, int64_t dim,
                  int bits, uint8_t* out) {
  KVQ_CHECK(mode != DeltaMode::kAuto);  // needs a mask: chunk_codes
  KVQ_LEVEL_DISPATCH(invert_delta, (mode, group, symbols, n, dim, bits, out));
}

namespace {

// sum_i c_i log2 c_i for counts c[alphabet]; with n = sum c_i, n log2 n - this is the Shannon
// size in bits. Counts are small integers, so a table serves most of them.
double sum_c_log_c(const uint32_t* c, int alphabet) {
  const std::vector<double>& table = c_log2_c_table();
  double s = 0;
  for (int i = 0; i < alphabet; ++i)
    s += c[i] < table.size() ? table[c[i]]
                             : static_cast<double>(c[i]) * std::log2(static_cast<double>(c[i]));
  return s;
}

}  // namespace

const std::vector<double>& c_log2_c_table() {
  static const auto table = [] {
    std::vector<double> t(4097);
    for (size_t i = 1; i < t.size(); ++i)
      t[i] = static_cast<double>(i) * std::log2(static_cast<double>(i));
    return t;
  }();
  return table;
}

void choose_channel_deltas(const uint8_t* codes, int64_t n, int64_t dim, int bits, uint8_t* mask,
                           uint32_t* counts, Workspace* ws) {
  check_args(n, dim, bits, 1);
  std::fill(mask, mask + mask_bytes(dim), uint8_t{0});
  if (n < 2) {
    if (counts)
      KVQ_CHECK(entropy::count_symbols(codes, static_cast<size_t>(n * dim), bits,
                                       static_cast<int>(dim), counts)
                    .ok());
    return;
  }
  const int a = 1 << bits;
  Workspace local_ws;  // empty until used: only a null ws allocates
  Workspace& w = ws ? *ws : local_ws;
  Workspace::Frame frame(w);
  uint8_t* const deltas = w.alloc<uint8_t>(static_cast<size_t>(n * dim));
  uint32_t* const hc = w.alloc<uint32_t>(static_cast<size_t>(dim * a));
  uint32_t* const hd = w.alloc<uint32_t>(static_cast<size_t>(dim * a));
  token_delta(codes, n, dim, bits, deltas);
  KVQ_CHECK(
      entropy::count_symbols(codes, static_cast<size_t>(n * dim), bits, static_cast<int>(dim), hc)
          .ok());
  KVQ_CHECK(
      entropy::count_symbols(deltas, static_cast<size_t>(n * dim), bits, static_cast<int>(dim), hd)
          .ok());
  // Same n for both, so the smaller entropy is the larger sum of c log c.
  for (int64_t d = 0; d < dim; ++d) {
    const bool use_delta = sum_c_log_c(hd + d * a, a) > sum_c_log_c(hc + d * a, a) + 1e-9;
    if (use_delta) mask[d / 8] = static_cast<uint8_t>(mask[d / 8] | (1u << (d % 8)));
    if (counts) std::copy_n((use_delta ? hd : hc) + d * a, a, counts + d * a);
  }
}

namespace {

// Channels are independent in both transforms, so they run a tile of channels at a time with
// the per-channel select mask (0xFF where the channel is delta coded, else 0: branch-free rows)
// in a stack array: no heap, no caller scratch, results identical to whole rows.
constexpr int64_t kDeltaTile = 256;

inline void select_tile(const uint8_t* mask, int64_t d0, int64_t n, uint8_t* sel) {
  for (int64_t d = 0; d < n; ++d) sel[d] = (mask[(d0 + d) / 8] >> ((d0 + d) % 8)) & 1u ? 0xFF : 0;
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void apply_channel_deltas_body(const uint8_t* mask, const uint8_t* codes,
                                                 int64_t n, int64_t dim, int bits, uint8_t* out) {
  check_args(n, dim, bits, 1);
  const uint8_t m = static_cast<uint8_t>((1u << bits) - 1u);
  uint8_t sel[kDeltaTile], row[kDeltaTile];
  for (int64_t d0 = 0; d0 < dim; d0 += kDeltaTile) {
    const int64_t w = std::min(kDeltaTile, dim - d0);
    select_tile(mask, d0, w, sel);
    const uint8_t* __restrict sl = sel;
    for (int64_t t = n - 1; t >= 1; --t) {
      // Rows t and t - 1 of `codes` are read before row t of `out` is written (in place: row
      // t - 1 is still the input), so the row loop is free of aliasing and vectorizes.
      const uint8_t* __restrict c = codes + t * dim + d0;
      const uint8_t* __restrict p = c - dim;
      uint8_t* __restrict o = out + t * dim + d0;
      if (o == c) {
        std::copy(c, c + w, row);
        const uint8_t* __restrict r = row;
        for (int64_t d = 0; d < w; ++d) o[d] = static_cast<uint8_t>((r[d] - (p[d] & sl[d])) & m);
      } else {
        for (int64_t d = 0; d < w; ++d) o[d] = static_cast<uint8_t>((c[d] - (p[d] & sl[d])) & m);
      }
    }
  }
  if (out != codes && n > 0) std::copy(codes, codes + dim, out);
}

template <SimdLevel L>
KVQ_ALWAYS_INLINE void invert_channel_deltas_body(const uint8_t* mask, const uint8_t* symbols,
                                                  int64_t n, int64_t dim, int bits, uint8_t* out) {
  check_args(n, dim, bits, 1);
  const uint8_t m = static_cast<uint8_t>((1u << bits) - 1u);
  if (out != symbols && n > 0) std::copy(symbols, symbols + dim, out);
  uint8_t sel[kDeltaTile];
  for (int64_t d0 = 0; d0 < dim; d0 += kDeltaTile) {
    const int64_t w = std::min(kDeltaTile, dim - d0);
    select_tile(mask, d0, w, sel);
    const uint8_t* __restrict sl = sel;
    for (int64_t t = 1; t < n; ++t) {
      // Row t of `symbols` may be row t of `out` (in place): each element is read before it is
      // written, so element-wise it is safe, and `p` (row t - 1) never overlaps row t.
      const uint8_t* s = symbols + t * dim + d0;
      const uint8_t* __restrict p = out + (t - 1) * dim + d0;
      uint8_t* o = out + t * dim + d0;
      for (int64_t d = 0; d < w; ++d) o[d] = static_cast<uint8_t>((s[d] + (p[d] & sl[d])) & m);
    }
  }
}

KVQ_LEVEL_CLONES(void, apply_channel_deltas,
                 (const uint8_t* mask, const uint8_t* codes, int64_t n, int64_t dim, int bits,
                  uint8_t* out),
                 (mask, codes, n, dim, bits, out))
KVQ_LEVEL_CLONES(void, invert_channel_deltas,
                 (const uint8_t* mask, const uint8_t* symbols, int64_t n, int64_t dim, int bits,
                  uint8_t* out),
                 (mask, symbols, n, dim, bits, out))

}  // namespace

void apply_channel_deltas(const uint8_t* mask, const uint8_t* codes, int64_t n, int64_t dim,
                          int bits, uint8_t* out) {
  KVQ_LEVEL_DISPATCH(apply_channel_deltas, (mask, codes, n, dim, bits, out));
}

void invert_channel_deltas(const uint8_t* mask, const uint8_t* symbols, int64_t n, int64_t dim,
                           int bits, uint8_t* out) {
  KVQ_LEVEL_DISPATCH(invert_channel_deltas, (mask, symbols, n, dim, bits, out));
}

bool chunk_symbols(DeltaMode mode, int64_t group, const uint8_t* codes, int64_t n, int64_t dim,
                   int bits, uint8_t* symbols, uint8_t* mask, uint32_t* counts, Workspace* ws) {
  if (mode == DeltaMode::kAuto) {
    choose_channel_deltas(codes, n, dim, bits, mask, counts, ws);
    apply_channel_deltas(mask, codes, n, dim, bits, symbols);
    return counts != nullptr;
  }
  apply_delta(mode, group, codes, n, dim, bits, symbols);
  return false;
}

void chunk_codes(DeltaMode mode, int64_t group, const uint8_t* symbols, const uint8_t* mask,
                 int64_t n, int64_t dim, int bits, uint8_t* codes) {
  if (mode == DeltaMode::kAuto)
    invert_channel_deltas(mask, symbols, n, dim, bits, codes);
  else
    invert_delta(mode, group, symbols, n, dim, bits, codes);
}

void token_delta(const uint8_t* codes, int64_t n, int64_t dim, int bits, uint8_t* out) {
  apply_delta(DeltaMode::kToken, 0, codes, n, dim, bits, out);
}

void token_delta_inverse(const uint8_t* symbols, int64_t n, int64_t dim, int bits, uint8_t* out) {
  invert_delta(DeltaMode::kToken, 0, symbols, n, dim, bits, out);
}

double symbol_entropy_bits(const uint8_t* symbols, size_t n) {
  if (n == 0) return 0.0;
  uint64_t counts[256] = {};
  for (size_t i = 0; i < n; ++i) ++counts[symbols[i]];
  double h = 0;
  for (uint64_t c : counts)
    if (c)
      h -= static_cast<double>(c) / static_cast<double>(n) *
           std::log2(static_cast<double>(c) / static_cast<double>(n));
  return h;
}

size_t param_bytes(const CodeStream& s) { return s.params.size() * sizeof(QuantParams); }

namespace {

// Calls fn(t0, rows) for every chunk of the stream.
template <class Fn>
void for_each_chunk(const CodeStream& s, int64_t chunk, Fn&& fn) {
  const int64_t c = chunk > 0 ? chunk : std::max<int64_t>(s.n_rows, 1);
  for (int64_t t0 = 0; t0 < s.n_rows; t0 += c) fn(t0, std::min(c, s.n_rows - t0));
}

int64_t delta_period(const CodeStream& s, const CodingOptions& o) {
  if (o.delta_group > 0) return o.delta_group;
  return s.axis == Axis::kChannel ? s.group : std::max<int64_t>(s.group, 1);
}

}  // namespace

size_t fixed_width_bytes(const CodeStream& s, int64_t chunk) {
  size_t bytes = param_bytes(s);
  for_each_chunk(s, chunk, [&](int64_t, int64_t rows) {
    bytes += packed_size(static_cast<size_t>(rows * s.dim), s.bits);
  });
  return bytes;
}

double shannon_estimate_bytes(const CodeStream& s, const CodingOptions& o) {
  double bits = 0;
  std::vector<uint8_t> sym, mask;
  Workspace ws;  // one for all chunks
  for_each_chunk(s, o.chunk, [&](int64_t t0, int64_t rows) {
    sym.resize(static_cast<size_t>(rows * s.dim));
    mask.resize(mask_bytes(s.dim));
    chunk_symbols(o.delta, delta_period(s, o), s.codes.data() + t0 * s.dim, rows, s.dim, s.bits,
                  sym.data(), mask.data(), nullptr, &ws);
    bits += entropy::shannon_bits(sym.data(), rows, static_cast<int>(s.dim), s.bits,
                                  o.layout != entropy::TableLayout::kPooled);
  });
  return bits / 8.0 + static_cast<double>(param_bytes(s));
}

Result<size_t> entropy_coded_bytes(const CodeStream& s, const CodingOptions& o) {
  size_t bytes = param_bytes(s);
  std::vector<uint8_t> sym, enc, mask;
  entropy::SymbolCodecOptions co = o.codec;
  co.layout = o.layout;
  Status status = ok_status();
  Workspace ws;  // one for all chunks
  for_each_chunk(s, o.chunk, [&](int64_t t0, int64_t rows) {
    if (!status.ok()) return;
    sym.resize(static_cast<size_t>(rows * s.dim));
    mask.resize(mask_bytes(s.dim));
    chunk_symbols(o.delta, delta_period(s, o), s.codes.data() + t0 * s.dim, rows, s.dim, s.bits,
                  sym.data(), mask.data(), nullptr, &ws);
    enc.clear();
    status = entropy::encode_symbols(sym.data(), rows, static_cast<int>(s.dim), s.bits, co, enc,
                                     nullptr, nullptr, nullptr, &ws);
    bytes += enc.size() + (o.delta == DeltaMode::kAuto ? mask.size() : 0);
  });
  KVQ_RETURN_IF_ERROR(status);
  return bytes;
}

int layer_bits(int layer, int n_layers, int base_bits, int n_groups) {
  KVQ_CHECK(n_layers >= 1 && layer >= 0 && layer < n_layers);
  const int g = std::clamp(n_groups, 1, n_layers);
  const int index = static_cast<int>(static_cast<int64_t>(layer) * g / n_layers);
  return std::min(base_bits, std::max(2, base_bits - index));
}

std::vector<int> layer_group_bits(int n_layers, int base_bits, int n_groups) {
  std::vector<int> out;
  for (int l = 0; l < n_layers; ++l) out.push_back(layer_bits(l, n_layers, base_bits, n_groups));
  return out;
}

std::vector<CodeStream> quantize_to_codes_batched(const float* x, int64_t G, int64_t n, int64_t dim,
                                                  int bits, int64_t group, Axis axis) {
  std::vector<CodeStream> out;
  out.reserve(static_cast<size_t>(G));
  for (int64_t g = 0; g < G; ++g)
    out.push_back(quantize_to_codes(x + g * n * dim, n, dim, bits, group, axis));
  return out;
}

void dequant_codes_batched(const std::vector<CodeStream>& streams, float* out) {
  for (const auto& s : streams) {
    dequant_codes(s, out);
    out += s.n_rows * s.dim;
  }
}

void token_delta_batched(const uint8_t* codes, int64_t G, int64_t n, int64_t dim, int bits,
                         uint8_t* out) {
  for (int64_t g = 0; g < G; ++g) token_delta(codes + g * n * dim, n, dim, bits, out + g * n * dim);
}

Result<std::vector<size_t>> entropy_coded_bytes_batched(const std::vector<CodeStream>& streams,
                                                        const CodingOptions& options) {
  std::vector<size_t> out;
  for (const auto& s : streams) {
    KVQ_ASSIGN_OR_RETURN(size_t b, entropy_coded_bytes(s, options));
    out.push_back(b);
  }
  return out;
}

std::vector<size_t> fixed_width_bytes_batched(const std::vector<CodeStream>& streams,
                                              int64_t chunk) {
  std::vector<size_t> out;
  for (const auto& s : streams) out.push_back(fixed_width_bytes(s, chunk));
  return out;
}

}  // namespace kvq::cachegen
