// bench/bench_io.h — what several benchmarks do with a dumped K/V file (kvq dump-kv).
#pragma once

#include <cstddef>
#include <vector>

#include "kvq/tensor.h"

namespace kvq::bench {

// Batch row 0 of a [B, H, S, D] tensor as fp32 [H, S, D], whatever its dtype and strides.
inline std::vector<float> load_f32(const TensorView& t) {
  std::vector<float> x(static_cast<size_t>(t.numel()));
  size_t i = 0;
  for (int64_t h = 0; h < t.shape[1]; ++h)
    for (int64_t s = 0; s < t.shape[2]; ++s)
      for (int64_t d = 0; d < t.shape[3]; ++d) x[i++] = t.load(0, h, s, d);
  return x;
}

}  // namespace kvq::bench
