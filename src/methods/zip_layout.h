// ZipCache's configuration and stored block layout, shared by the CPU codec
// (src/methods/zipcache.cc, which documents the layout) and the CUDA backend (src/cuda), so both
// address the same bytes by the same arithmetic.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvq/bitpack.h"
#include "kvq/group_quant.h"
#include "kvq/spec.h"
#include "kvq/zipcache.h"

namespace kvq {

enum class Saliency { kNorm, kAttn };
enum class ValueMode { kUniform, kRouted, kCst };

struct ZipConfig {
  int hi_bits = 4, lo_bits = 2;
  double frac = 0.4;
  int64_t group = 64, v_group = 64, residual = 128;
  Saliency saliency = Saliency::kAttn;
  ValueMode values = ValueMode::kCst;
  double probe = 0.1;
  bool shared_key_params = false;

  // Whether position `pos`'s query is a saliency probe: a hash of the position (splitmix64)
  // against the rate, so the choice does not depend on chunking.
  bool is_probe(int64_t pos) const {
    if (probe >= 1.0) return true;
    uint64_t x = static_cast<uint64_t>(pos) + 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return static_cast<double>(x >> 11) * 0x1.0p-53 < probe;
  }
};

inline ZipConfig config_from(const Spec& s, int64_t head_dim) {
  ZipConfig c;
  c.hi_bits = static_cast<int>(s.get_int("hi_bits"));
  c.lo_bits = static_cast<int>(s.get_int("lo_bits"));
  c.frac = s.get_float("frac");
  c.group = s.get_int("group");
  c.v_group = std::min<int64_t>(s.get_int("v_group"), head_dim);
  c.residual = s.get_int("residual");
  c.saliency = s.get_enum("saliency") == "attn" ? Saliency::kAttn : Saliency::kNorm;
  const std::string& v = s.get_enum("values");
  c.values = v == "uniform"  ? ValueMode::kUniform
             : v == "routed" ? ValueMode::kRouted
                             : ValueMode::kCst;
  c.probe = s.get_float("probe");
  c.shared_key_params = s.get_enum("kparams") == "shared";
  return c;
}

// Sizes of one stream's records.
struct ZipLayout {
  int64_t T, D, n_h, n_l, ng;
  size_t mask, khi, klo, kparams, vcodes, vparams, vcst;
  ZipLayout(const ZipConfig& c, int64_t tokens, int64_t dim) : T(tokens), D(dim) {
    n_h = salient_count(T, c.frac);
    n_l = T - n_h;
    ng = n_channel_groups(D, c.v_group);
    mask = packed_size(static_cast<size_t>(T), 1);
    khi = packed_size(static_cast<size_t>(n_h * D), c.hi_bits);
    klo = packed_size(static_cast<size_t>(n_l * D), c.lo_bits);
    kparams = c.shared_key_params
                  ? static_cast<size_t>(D) * sizeof(QuantParams)
                  : static_cast<size_t>(((n_h > 0) + (n_l > 0)) * D) * sizeof(QuantParams);
    vcodes = c.values == ValueMode::kUniform ? packed_size(static_cast<size_t>(T * D), c.hi_bits)
                                             : khi_v(c) + klo_v(c);
    vparams = static_cast<size_t>(T * ng) * sizeof(QuantParams);
    vcst = c.values == ValueMode::kCst ? static_cast<size_t>(D) * 2 : 0;
  }
  size_t khi_v(const ZipConfig& c) const {
    return packed_size(static_cast<size_t>(n_h * D), c.hi_bits);
  }
  size_t klo_v(const ZipConfig& c) const {
    return packed_size(static_cast<size_t>(n_l * D), c.lo_bits);
  }
  size_t key_record() const { return mask + khi + klo + kparams; }
  size_t value_record() const { return vcodes + vparams + vcst; }
};

}  // namespace kvq
