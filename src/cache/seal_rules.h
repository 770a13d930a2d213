// SealRules — the Ledger's pure seal arithmetic (src/cache/ledger.h), in a header with no
// dependencies so that device code can use the very same rules: a CUDA kernel that needs a
// query's seal boundary calls these functions instead of restating them.
//
// Block i of T tokens seals once offset >= (i + 1) T + R; a query at position p sees tokens below
// max(sealed_at(p + 1), exact_begin) dequantized and every newer token exact.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KVQ_HOST_DEVICE __host__ __device__
#else
#define KVQ_HOST_DEVICE
#endif

namespace kvq {

struct SealRules {
  int64_t block_tokens = 1;  // T
  int64_t residual = 0;      // R

  // The offset at which block i seals: (i + 1) T + R.
  KVQ_HOST_DEVICE int64_t seal_offset(int64_t block) const {
    return (block + 1) * block_tokens + residual;
  }
  // Blocks sealed once `offset` tokens have arrived (by the rule alone).
  KVQ_HOST_DEVICE int64_t blocks_at(int64_t offset) const {
    const int64_t past = offset - residual;
    return past < block_tokens ? 0 : past / block_tokens;
  }
  KVQ_HOST_DEVICE int64_t sealed_tokens_at(int64_t offset) const {
    return blocks_at(offset) * block_tokens;
  }
  // The seal boundary of the query at position p, given the first token still held exact.
  KVQ_HOST_DEVICE int64_t visible_sealed(int64_t p, int64_t exact_begin) const {
    const int64_t s = sealed_tokens_at(p + 1);
    return s > exact_begin ? s : exact_begin;
  }
};

}  // namespace kvq
