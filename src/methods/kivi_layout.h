// KIVI's stored layout of one sealed block, shared by the CPU codec (src/methods/kivi.cc) and
// the CUDA backend's kernels (src/cuda), so both address the same bytes by the same arithmetic.
//
// One block: S = B * H streams, T = G tokens, ng = ceil(D / G):
//   key part    S x packed_size(T*D, k_bits) key codes (stream-major, token-major inside),
//               then S x D {scale, zero} fp16 pairs
//   value part  S x packed_size(T*D, v_bits) value codes, then S x T x ng pairs
// Codes are packed as kvq/bitpack.h documents; unused padding bits are zero.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cache/codec.h"
#include "kvq/bitpack.h"
#include "kvq/group_quant.h"

namespace kvq {

struct KiviLayout {
  BlockGeometry g;
  int k_bits, v_bits;
  int64_t vgroup;
  size_t S() const { return static_cast<size_t>(g.streams()); }
  size_t kcode() const { return packed_size(static_cast<size_t>(g.stream_elems()), k_bits); }
  size_t vcode() const { return packed_size(static_cast<size_t>(g.stream_elems()), v_bits); }
  size_t kparam() const { return static_cast<size_t>(g.dim) * sizeof(QuantParams); }
  size_t vparam() const {
    return static_cast<size_t>(g.tokens * n_channel_groups(g.dim, vgroup)) * sizeof(QuantParams);
  }
  size_t key_part() const { return S() * (kcode() + kparam()); }
  size_t value_part() const { return S() * (vcode() + vparam()); }
  CacheBytes bytes() const {
    CacheBytes c;
    c.key_codes = S() * kcode();
    c.value_codes = S() * vcode();
    c.params = S() * (kparam() + vparam());
    return c;
  }
};

}  // namespace kvq
