// Ledger — the rules of one layer cache, in integers only: which tokens are sealed into blocks,
// how the fp16 window is paged, what a trim undoes, and how many bytes are held. Every backend
// (the CPU heap now, a CUDA pool later) keeps one Ledger per layer and stores only what it says,
// so backends cannot disagree on semantics or accounting.
//
// Token layout of a layer holding `offset` tokens, block length T, residual R, page length P:
//
//   [ block 0 | block 1 | ... | block n-1 | window: pages of P tokens ............ ]
//   0         T         2T    (n-1)T      nT = sealed_tokens()                 offset
//
// Block i is sealed (handed to the method to compress) as soon as offset >= (i + 1) T + R, so
// the newest R tokens and the unfinished block always stay in full precision. Because that
// depends only on absolute positions, appending in one call, in chunks or token by token seals
// the same blocks from the same tokens. The window lives in pages of P tokens (P divides T),
// opened when their first token arrives and closed when their block seals.
//
// Attention semantics. A query at absolute position p sees exactly what token-by-token appending
// would hold at offset p + 1: tokens [0, visible_sealed(p)) dequantized from their blocks, every
// newer token exact (as the window stores it). Within one append the boundary moves by one block
// every T tokens; the blocks an append sealed before its last token keep their exact values
// (exact_begin()) until the next mutating call, so the append's own queries can see them exact.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/seal_rules.h"
#include "kvq/cache.h"

namespace kvq {

struct LedgerShape {
  int64_t block_tokens = 1;  // T
  int64_t page_tokens = 1;   // P, divides T
  int64_t residual = 0;      // R
};

class Ledger {
 public:
  static constexpr int64_t kMaxTokens = int64_t{1} << 31;

  explicit Ledger(LedgerShape shape);

  const LedgerShape& shape() const { return shape_; }
  int64_t block_tokens() const { return shape_.block_tokens; }
  int64_t page_tokens() const { return shape_.page_tokens; }
  int64_t residual() const { return shape_.residual; }

  // ---- pure rules (cache/seal_rules.h, shared with device code) ----
  SealRules rules() const { return {shape_.block_tokens, shape_.residual}; }
  // The offset at which block i seals: (i + 1) T + R.
  int64_t seal_offset(int64_t block) const { return rules().seal_offset(block); }
  // Blocks sealed once `offset` tokens have arrived (by the rule alone).
  int64_t blocks_at(int64_t offset) const { return rules().blocks_at(offset); }
  int64_t sealed_tokens_at(int64_t offset) const { return rules().sealed_tokens_at(offset); }
  // Pages that hold `window_tokens` tokens.
  int64_t pages_for(int64_t window_tokens) const;

  // ---- state ----
  int64_t batch() const { return batch_; }
  int64_t offset() const { return offset_; }
  int64_t n_blocks() const { return runs_.empty() ? 0 : runs_.back().end; }
  int64_t sealed_tokens() const { return n_blocks() * block_tokens(); }
  int64_t window_tokens() const { return offset_ - sealed_tokens(); }
  int64_t window_pages() const { return pages_for(window_tokens()); }
  // Tokens of the last append (0 after a trim, reset, import or clone).
  int64_t last_append() const { return last_append_; }
  // First token whose exact value is still held: the window start before the last append.
  int64_t exact_begin() const { return exact_begin_; }
  // Blocks sealed by the last append whose exact values are kept (their pages are retired, not
  // freed): [exact_begin() / T, n_blocks()).
  int64_t retired_blocks() const { return (sealed_tokens() - exact_begin_) / block_tokens(); }
  // The seal boundary a query at position p (one of the last append's) sees: tokens below it
  // come from sealed blocks, tokens at or above it are exact. Blocks kept sealed through a trim
  // stay sealed for later queries, hence the max with the boundary at the append's start.
  int64_t visible_sealed(int64_t p) const { return rules().visible_sealed(p, exact_begin_); }

  // ---- append ----
  // An append of n tokens runs in pieces that end where the next block becomes sealable, so what
  // a method sees (queries, runs) does not depend on how the caller chunked its appends.
  // Returns the length of the next run starting at offset(), given `left` tokens to go.
  int64_t next_run(int64_t left) const;
  // True when the block after the sealed ones is due (offset >= its seal offset).
  bool seal_due() const { return offset_ >= seal_offset(n_blocks()); }
  // Whether the block sealed now (by the token that made it due) must keep its exact values
  // for the current append's queries: yes unless the append's first token sealed it.
  bool keep_exact_of_due_block() const;
  void begin_append(int64_t batch, int64_t n_new);
  void advance(int64_t n) { offset_ += n; }
  // Records that block n_blocks() was sealed, with its accounting (elements left 0), and whether
  // its exact values were kept (keep_exact_of_due_block()). A block sealed without them moves
  // exact_begin() past it: no query of the append can need it exact (the rule covers it).
  void record_block(const CacheBytes& bytes, bool exact_kept);

  // ---- trim ----
  struct TrimPlan {
    int64_t new_offset = 0;
    int64_t keep_blocks = 0;    // blocks that survive whole
    bool reopen = false;        // block keep_blocks is cut: its first tokens go back to the window
    int64_t window_tokens = 0;  // tokens in the window afterwards
    int64_t keep_window_pages = 0;  // when !reopen and nothing sealed is dropped: pages kept
  };
  // Checks 0 <= n <= offset() (kOutOfRange otherwise).
  Result<TrimPlan> plan_trim(int64_t n) const;
  void apply_trim(const TrimPlan& plan);

  void reset();
  // Replaces the state (import): `blocks` with their accounting, `offset` tokens held.
  void assign(int64_t batch, int64_t offset, std::vector<CacheBytes> blocks);
  // Forgets the last append (clone, import): no retired exact values.
  void forget_last_append();

  // ---- accounting ----
  // Blocks' bytes, the window's pages (page_bytes for one page of K or of V), extra meta.
  CacheBytes bytes(uint64_t page_bytes, uint64_t extra_meta, int64_t heads, int64_t dim) const;
  // Block i's accounting (0 <= i < n_blocks()).
  const CacheBytes& block_bytes(int64_t i) const;

 private:
  // Consecutive blocks with the same accounting, as one run: blocks [previous run's end, end).
  // Methods whose blocks all bill the same bytes (KIVI, XQuant, ZipCache) hold one run, so a
  // copy of the ledger (a backend plans an append on one) costs nothing per block.
  struct Run {
    CacheBytes bytes;
    int64_t end = 0;
  };
  void push_block(const CacheBytes& bytes);
  void recount();  // sealed_ from runs_

  LedgerShape shape_;
  int64_t batch_ = 0;
  int64_t offset_ = 0;
  int64_t last_append_ = 0;
  int64_t append_start_ = 0;  // offset before the last append
  int64_t exact_begin_ = 0;
  std::vector<Run> runs_;
  CacheBytes sealed_;  // the sum over the blocks
};

// The window page length for blocks of T tokens: the largest divisor of T not above 32, so
// the fp16 window is billed in small pages even when blocks are long.
int64_t window_page_tokens(int64_t block_tokens);

}  // namespace kvq
