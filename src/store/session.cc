// PrefixSession: one prompt's prefill against a store (include/kvq/store.h).
#include <algorithm>
#include <chrono>

#include "kvq/store.h"

namespace kvq {

PrefixSession::PrefixSession(std::vector<Binding> bindings, std::span<const int32_t> tokens,
                             StoreWriter* writer)
    : bindings_(std::move(bindings)), tokens_(tokens), writer_(writer) {
  KVQ_CHECK(!bindings_.empty());
  const StoreNamespace& first = bindings_[0].store->ns();
  chunk_ = first.chunk_tokens;
  for (const Binding& b : bindings_) {
    KVQ_CHECK(b.cache && b.store && b.store->ns().chunk_tokens == chunk_ &&
              b.store->ns().batch == first.batch);
    keys_.push_back(chunk_keys(b.store->ns(), tokens_));
  }
  fetches_.resize(bindings_.size());
}

int64_t PrefixSession::reuse(int64_t max_tokens) {
  fetches_.assign(bindings_.size(), PrefixFetch{});
  export_notes_.clear();
  exported_upto_ = 0;
  reused_chunks_ = 0;
  for (const Binding& b : bindings_) b.cache->reset();
  // The longest prefix every cache's store holds: look each up, then fetch; a fetch that comes
  // back shorter (a bad or vanished object) lowers the common length and the others that got
  // more are fetched again at it (rare: it needs a damaged store).
  int64_t k = std::max<int64_t>(0, max_tokens) / chunk_;
  for (size_t s = 0; s < bindings_.size() && k > 0; ++s) {
    auto found = bindings_[s].store->lookup(keys_[s], k, *bindings_[s].cache, fetches_[s]);
    if (!found.ok()) {
      fetches_[s].notes.push_back("lookup: " + found.status().message());
      k = 0;
    } else {
      k = std::min(k, *found);
    }
  }
  std::vector<int64_t> have(bindings_.size(), 0);
  while (k > 0) {
    int64_t common = k;
    for (size_t s = 0; s < bindings_.size(); ++s) {
      if (have[s] == k) continue;
      auto got = bindings_[s].store->fetch(keys_[s], k, *bindings_[s].cache, fetches_[s]);
      if (!got.ok()) fetches_[s].notes.push_back(got.status().message());
      have[s] = got.ok() ? *got : 0;
      common = std::min(common, have[s]);
    }
    if (common == k) break;
    k = common;
  }
  if (k == 0)
    for (const Binding& b : bindings_) b.cache->reset();
  for (PrefixFetch& f : fetches_) {
    f.chunks = k;
    f.tokens = k * chunk_;
  }
  reused_chunks_ = exported_upto_ = k;
  return k * chunk_;
}

int64_t PrefixSession::piece_end(int64_t offset, int64_t max_piece, int64_t end) const {
  const int64_t boundary = (offset / chunk_ + 1) * chunk_;
  return std::min({offset + std::max<int64_t>(1, max_piece), end, boundary});
}

void PrefixSession::reached(int64_t offset) {
  if (!writer_ || offset % chunk_ != 0) return;
  const int64_t i = offset / chunk_ - 1;
  if (i < exported_upto_ || i >= static_cast<int64_t>(keys_[0].size())) return;
  const auto t0 = std::chrono::steady_clock::now();
  bool any = false;
  for (size_t s = 0; s < bindings_.size(); ++s) {
    auto objects = bindings_[s].store->export_chunk(*bindings_[s].cache, keys_[s], i);
    if (!objects.ok()) {
      export_notes_.push_back("exporting chunk " + std::to_string(i) + ": " +
                              objects.status().message());
      continue;
    }
    exported_bytes_ += objects->blocks.size() + objects->tail.size();
    any = true;
    writer_->put(std::move(objects->blocks_key), std::move(objects->blocks));
    writer_->put(std::move(objects->tail_key), std::move(objects->tail));
  }
  if (any) ++exported_chunks_;
  exported_upto_ = i + 1;
  export_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<std::string> PrefixSession::notes() const {
  std::vector<std::string> out;
  for (size_t s = 0; s < fetches_.size(); ++s)
    for (const auto& n : fetches_[s].notes)
      out.push_back((fetches_.size() > 1 ? bindings_[s].store->ns().model_spec + ": " : "") + n);
  out.insert(out.end(), export_notes_.begin(), export_notes_.end());
  return out;
}

}  // namespace kvq
