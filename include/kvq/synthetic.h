// kvq/synthetic.h — a deterministic generator of K/V tensors with the statistics that make KV
// compression hard or easy in real models, for benchmarks and tests without a model:
//  * keys have a few outlier channels with large magnitude (why KIVI quantizes keys per channel),
//  * attention-sink tokens (token 0, and every token at a multiple of `sink_every` if set) have
//    large norms,
//  * token-wise locality: each channel follows an AR(1) process along tokens (CacheGen's delta
//    coding exploits this),
//  * values are smoother, with weaker outliers.
// Real dumps (`kvq dump-kv`) are preferred for any figure that is reported.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq {

struct SyntheticOptions {
  int64_t batch = 1, heads = 4, tokens = 4096, dim = 128;
  uint64_t seed = 1;
  double key_locality = 0.9;    // AR(1) coefficient along tokens for keys
  double value_locality = 0.6;  // ... for values
  int outlier_channels = 4;     // key channels per head with ~10x magnitude
  int64_t sink_every = 0;       // 0: only token 0 is a sink
};

struct SyntheticKV {
  int64_t batch, heads, tokens, dim;
  std::vector<float> k, v;  // [B, H, S, D] each
  std::vector<float> q;     // [B, H, S, D] queries correlated with keys (one per KV head)
};

SyntheticKV make_synthetic_kv(const SyntheticOptions& opt);

}  // namespace kvq
