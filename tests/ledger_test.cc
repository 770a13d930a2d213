// The ledger's block accounting (held as runs of equal blocks) against a plain list of blocks,
// under random appends, trims, imports and resets.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "cache/ledger.h"

namespace kvq {
namespace {

CacheBytes sum(const std::vector<CacheBytes>& blocks) {
  CacheBytes t;
  for (const CacheBytes& b : blocks) t += b;
  return t;
}

// Appends n tokens as a backend does, each sealed block billed pick().
template <class Pick>
void append(Ledger& l, std::vector<CacheBytes>& ref, int64_t n, Pick&& pick) {
  l.begin_append(1, n);
  for (int64_t done = 0; done < n;) {
    const int64_t run = l.next_run(n - done);
    l.advance(run);
    done += run;
    while (l.seal_due()) {
      const CacheBytes b = pick();
      ref.push_back(b);
      l.record_block(b, l.keep_exact_of_due_block());
    }
  }
}

void expect_same(const Ledger& l, const std::vector<CacheBytes>& ref) {
  ASSERT_EQ(l.n_blocks(), static_cast<int64_t>(ref.size()));
  for (size_t i = 0; i < ref.size(); ++i)
    ASSERT_EQ(l.block_bytes(static_cast<int64_t>(i)), ref[i]) << "block " << i;
  // Pages of 0 bytes, no extra meta: the blocks' sum, with the represented elements.
  CacheBytes want = sum(ref);
  want.elements = static_cast<uint64_t>(2 * l.batch() * l.offset());
  EXPECT_TRUE(l.bytes(0, 0, 1, 1) == want);
}

TEST(Ledger, BlockAccountingMatchesAPlainList) {
  std::mt19937_64 rng(11);
  const CacheBytes kinds[3] = {{100, 50, 8, 0, 1, 0, 0}, {100, 50, 8, 0, 2, 0, 0},
                               {7, 9, 3, 0, 0, 5, 0}};
  for (int trial = 0; trial < 40; ++trial) {
    Ledger l(LedgerShape{8, 4, static_cast<int64_t>(rng() % 9)});
    std::vector<CacheBytes> ref;
    // Mostly equal neighbours (one run), sometimes a different one: runs of every length.
    const int mix = static_cast<int>(rng() % 3);
    auto pick = [&] { return kinds[mix == 0 ? 0 : rng() % (mix == 1 ? 2 : 3)]; };
    for (int step = 0; step < 60; ++step) {
      const int op = static_cast<int>(rng() % 10);
      if (op < 6) {
        append(l, ref, 1 + static_cast<int64_t>(rng() % (rng() % 4 == 0 ? 80 : 6)), pick);
      } else if (op < 8) {
        auto plan = l.plan_trim(static_cast<int64_t>(rng() % (l.offset() + 1)));
        ASSERT_TRUE(plan.ok());
        l.apply_trim(*plan);
        ref.resize(static_cast<size_t>(plan->keep_blocks));
      } else if (op == 8) {
        const Ledger copy = l;  // a backend plans on a copy: it must be the same ledger
        expect_same(copy, ref);
        std::vector<CacheBytes> blocks(ref.begin(), ref.begin() + static_cast<long>(ref.size() / 2));
        l.assign(1, static_cast<int64_t>(blocks.size()) * 8 + 3, blocks);
        ref = blocks;
      } else if (rng() % 4 == 0) {
        l.reset();
        ref.clear();
      }
      expect_same(l, ref);
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace kvq
