// Ledger arithmetic the store needs, from a LayerCache's public block length and residual
// (the same rule as src/cache/ledger.h: block i seals once offset >= (i + 1) T + R).
#pragma once

#include <cstdint>

#include "kvq/cache.h"

namespace kvq {

inline constexpr int64_t kMaxStoreChunkTokens = int64_t{1} << 20;
// Offsets a layer can reach (Ledger::kMaxTokens); blocks longer than that never seal (fp16).
inline constexpr int64_t kMaxLayerTokens = int64_t{1} << 31;

inline bool layer_seals(const LayerCache& l) { return l.block_tokens() <= kMaxLayerTokens; }

// Blocks sealed once `offset` tokens have arrived.
inline int64_t blocks_at(const LayerCache& l, int64_t offset) {
  if (!layer_seals(l)) return 0;
  const int64_t past = offset - l.residual();
  return past < l.block_tokens() ? 0 : past / l.block_tokens();
}

// Where the window starts at `offset`: the tokens before it are sealed.
inline int64_t window_start_at(const LayerCache& l, int64_t offset) {
  return blocks_at(l, offset) * l.block_tokens();
}

}  // namespace kvq
