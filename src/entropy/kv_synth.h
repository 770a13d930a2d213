// entropy/kv_synth.h — deterministic synthetic "KV-like" symbol streams for tests, benchmarks
// and the break-even measurement in docs/entropy.md (real KV replaces them in CacheGen's own
// measurements).
//
// Model: per channel c a mean mu_c and scale sigma_c (lognormal; 5% outlier channels with 5x the
// mean and 4x the scale, as keys have), tokens follow an AR(1) process with correlation
// `locality` (CacheGen's token-wise locality) with occasional 3x shocks, then the foundation's
// asymmetric min/max group quantization to `bits` bits: keys per channel over groups of `group`
// tokens, values per token over groups of `group` channels. Optionally the token delta
// (c[t] - c[t-1]) mod 2^bits (row 0 kept). The generator is self-contained (splitmix64 and
// Box-Muller), so a seed gives the same stream on every platform.
#pragma once

#include <cstdint>
#include <vector>

namespace kvq::entropy {

struct SynthKvOptions {
  int64_t n_tokens = 256;
  int n_channels = 64;
  int bits = 4;
  bool keys = true;  // keys: per-channel groups of tokens; values: per-token groups
  int group = 32;
  double locality = 0.9;  // AR(1) coefficient between neighbouring tokens
  bool token_delta = false;
  uint64_t seed = 1;
};

// symbols [n_tokens, n_channels], token-major, each < 2^bits.
std::vector<uint8_t> synth_kv_symbols(const SynthKvOptions& options);

}  // namespace kvq::entropy
