// PrefixStore: chunk objects out of a cache (export) and back into one (lookup, fetch, import).
// What a reuse of k chunks needs, per layer l with blocks of T_l tokens (docs/store.md §3.3):
//   * the blocks [0, blocks_at(kC)): the layer's sections of the blocks objects 0..k-1;
//   * the window [W_l, kC), W_l = blocks_at(kC) T_l: rows of the tail objects of the chunks
//     W_l / C .. k-1 (each holds the rows of its own tokens still in the window at its end);
//   * the method state at kC: the tail object of chunk k-1.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>

#include "store/geometry.h"
#include "store/objects.h"

namespace kvq {

namespace {

using store::StoreObject;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct CollectSink final : ChunkSink {
  std::vector<ChunkKind> kinds;
  std::vector<int64_t> t0s, tokens;
  std::vector<std::vector<uint8_t>> data;
  Status put(const ChunkRef& c) override {
    kinds.push_back(c.kind);
    t0s.push_back(c.t0);
    tokens.push_back(c.tokens);
    data.emplace_back(c.data, c.data + c.size);
    return ok_status();
  }
};

std::string chunk_name(int64_t i, int64_t C) {
  return "chunk " + std::to_string(i) + " (tokens " + std::to_string(i * C) + ".." +
         std::to_string((i + 1) * C) + ")";
}

// The first chunk whose tail a reuse of k chunks reads window rows from (k - 1 at the latest,
// for the state).
int64_t first_tail_needed(const ModelCache& cache, int64_t k, int64_t C) {
  int64_t j0 = k - 1;
  for (int l = 0; l < cache.n_layers(); ++l)
    j0 = std::min(j0, window_start_at(cache.layer(l), k * C) / C);
  return j0;
}

Status check_cache(const ModelCache& cache, const StoreNamespace& ns) {
  if (cache.n_layers() > 0 && cache.layer(0).batch() != 0 && cache.layer(0).batch() != ns.batch)
    return invalid_argument("the cache holds batch size " + std::to_string(cache.layer(0).batch()) +
                            ", the store namespace " + std::to_string(ns.batch));
  const std::string spec = cache.model_spec().to_string();
  if (spec != ns.model_spec)
    return invalid_argument("the cache is '" + spec + "', the store namespace '" + ns.model_spec +
                            "'");
  return ok_status();
}

// Blocks object j must hold, per layer, exactly the blocks sealed between jC and (j + 1)C.
Status check_block_ranges(const StoreObject& o, const ModelCache& cache, int64_t j, int64_t C) {
  for (int l = 0; l < cache.n_layers(); ++l) {
    const LayerCache& layer = cache.layer(l);
    const int64_t b0 = blocks_at(layer, j * C), b1 = blocks_at(layer, (j + 1) * C);
    const store::BlocksView& v = o.blocks[static_cast<size_t>(l)];
    if (v.first_block != b0 || static_cast<int64_t>(v.keys.size()) != b1 - b0)
      return corrupt("layer " + std::to_string(l) + " holds blocks [" +
                     std::to_string(v.first_block) + ", +" + std::to_string(v.keys.size()) +
                     ") where the chunk sealed [" + std::to_string(b0) + ", " + std::to_string(b1) +
                     ")");
  }
  return ok_status();
}

// Tail object j must hold, per layer, the rows of chunk j still in the window at (j + 1)C, in
// one window dtype (its 16-bit layers' rows; q8 rows have fp16 scales whatever was appended).
Status check_tail_rows(const StoreObject& o, const ModelCache& cache, int64_t j, int64_t C) {
  const store::TailView* first16 = nullptr;
  for (int l = 0; l < cache.n_layers(); ++l) {
    const int64_t want = std::max(window_start_at(cache.layer(l), (j + 1) * C), j * C);
    const store::TailView& v = o.tails[static_cast<size_t>(l)];
    if (v.rows_t0 != want)
      return corrupt("layer " + std::to_string(l) + " holds window rows from " +
                     std::to_string(v.rows_t0) + ", not " + std::to_string(want));
    if (v.format != WindowFormat::k16Bit) continue;
    if (first16 && v.dtype != first16->dtype) return corrupt("layers disagree on the window dtype");
    first16 = &v;
  }
  return ok_status();
}

}  // namespace

Result<ChunkObjects> PrefixStore::export_chunk(const ModelCache& cache,
                                               std::span<const Hash128> keys, int64_t i) const {
  const int64_t C = ns_.chunk_tokens, end = (i + 1) * C;
  if (i < 0 || i >= static_cast<int64_t>(keys.size()))
    return invalid_argument("no key for chunk " + std::to_string(i));
  KVQ_RETURN_IF_ERROR(check_cache(cache, ns_));
  std::vector<store::BlocksSection> blocks(static_cast<size_t>(cache.n_layers()));
  std::vector<store::TailSection> tails(blocks.size());
  for (int l = 0; l < cache.n_layers(); ++l) {
    const LayerCache& layer = cache.layer(l);
    if (layer.offset() != end || layer.batch() != ns_.batch)
      return invalid_argument("exporting " + chunk_name(i, C) + " needs every layer at offset " +
                              std::to_string(end) + " with batch " + std::to_string(ns_.batch) +
                              "; layer " + std::to_string(l) + " holds " +
                              std::to_string(layer.offset()));
    const int64_t b0 = blocks_at(layer, i * C);
    if (layer.n_blocks() != blocks_at(layer, end))
      return invalid_argument("layer " + std::to_string(l) + " holds " +
                              std::to_string(layer.n_blocks()) +
                              " blocks, not what its offset seals (was it trimmed?)");
    CollectSink bs;
    KVQ_RETURN_IF_ERROR(layer.export_blocks(b0, bs));
    store::BlocksSection& b = blocks[static_cast<size_t>(l)];
    b.first_block = b0;
    for (size_t c = 0; c + 1 < bs.data.size(); c += 2) {
      b.keys.push_back(std::move(bs.data[c]));
      b.values.push_back(std::move(bs.data[c + 1]));
    }
    CollectSink ts;
    KVQ_RETURN_IF_ERROR(layer.export_tail(ts));
    KVQ_CHECK(ts.data.size() == 3 && ts.kinds[0] == ChunkKind::kWindowKeys);
    // The window is [w0, end) as [B, H, n, D]; keep the rows of this chunk's own tokens.
    store::TailSection& t = tails[static_cast<size_t>(l)];
    const int64_t w0 = ts.t0s[0], n = ts.tokens[0];
    const int64_t S = ns_.batch * layer.shape().n_kv_heads, D = layer.shape().head_dim;
    t.dtype = layer.window_dtype();
    t.format = layer.window_format();
    t.rows_t0 = std::max(w0, i * C);
    t.rows_n = end - t.rows_t0;
    const size_t row = window_row_bytes(t.format, D);
    for (int part = 0; part < 2; ++part) {
      const std::vector<uint8_t>& src = ts.data[static_cast<size_t>(part)];
      std::vector<uint8_t>& dst = part == 0 ? t.keys : t.values;
      dst.resize(static_cast<size_t>(S * t.rows_n) * row);
      for (int64_t s = 0; s < S; ++s)
        std::memcpy(dst.data() + static_cast<size_t>(s * t.rows_n) * row,
                    src.data() + static_cast<size_t>(s * n + (t.rows_t0 - w0)) * row,
                    static_cast<size_t>(t.rows_n) * row);
    }
    t.state = std::move(ts.data[2]);
  }
  const Hash128& key = keys[static_cast<size_t>(i)];
  ChunkObjects out;
  out.chunk = i;
  out.blocks_key = store_object_key(ns_, key, StoreObjectKind::kBlocks);
  out.tail_key = store_object_key(ns_, key, StoreObjectKind::kTail);
  out.blocks = store::encode_blocks_object(ns_, key, i, blocks);
  out.tail = store::encode_tail_object(ns_, key, i, tails);
  return out;
}

Result<int64_t> PrefixStore::lookup(std::span<const Hash128> keys, int64_t max_chunks,
                                    const ModelCache& cache, PrefixFetch& report) const {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t limit = std::min<int64_t>(max_chunks, static_cast<int64_t>(keys.size()));
  int64_t m = 0;
  for (; m < limit; ++m) {
    KVQ_ASSIGN_OR_RETURN(bool there,
                         backend_->exists(store_object_key(ns_, keys[static_cast<size_t>(m)],
                                                           StoreObjectKind::kBlocks)));
    if (!there) {
      // Said even when nothing is wrong (the rest was never stored): a miss is never silent.
      report.notes.push_back("blocks of " + chunk_name(m, ns_.chunk_tokens) +
                             ": absent (never stored, or evicted): the reuse stops there");
      break;
    }
  }
  // The longest reuse whose tails are all there (eviction takes objects one by one).
  std::map<int64_t, bool> tail_there;
  int64_t k = m;
  for (; k >= 1; --k) {
    bool ok = true;
    for (int64_t j = k - 1; ok && j >= first_tail_needed(cache, k, ns_.chunk_tokens); --j) {
      if (!tail_there.count(j)) {
        KVQ_ASSIGN_OR_RETURN(tail_there[j],
                             backend_->exists(store_object_key(ns_, keys[static_cast<size_t>(j)],
                                                               StoreObjectKind::kTail)));
      }
      ok = tail_there[j];
    }
    if (ok) break;
  }
  if (k < m)
    report.notes.push_back("tail of " + chunk_name(k, ns_.chunk_tokens) +
                           " absent (evicted?): " + std::to_string(m) +
                           " chunks of blocks found, " + std::to_string(k) + " reusable");
  report.looked_up = k;
  report.lookup_s += seconds_since(t0);
  return k;
}

Result<int64_t> PrefixStore::fetch(std::span<const Hash128> keys, int64_t k, ModelCache& cache,
                                   PrefixFetch& report) const {
  KVQ_RETURN_IF_ERROR(check_cache(cache, ns_));
  const int64_t C = ns_.chunk_tokens;
  k = std::clamp<int64_t>(k, 0, static_cast<int64_t>(keys.size()));
  const auto t0 = std::chrono::steady_clock::now();
  bool unreachable = false;  // after a transport error, no more requests to the store
  auto get = [&](StoreObjectKind kind, int64_t j) -> Result<StoreObject> {
    const Hash128& key = keys[static_cast<size_t>(j)];
    const std::string name = std::string(store_object_kind_name(kind)) + " of " + chunk_name(j, C);
    auto bytes = backend_->get(store_object_key(ns_, key, kind));
    if (!bytes.ok()) {
      if (bytes.status().code() == ErrorCode::kNotFound) {
        report.notes.push_back(name + ": absent (evicted or never stored)");
      } else {
        unreachable = true;
        report.notes.push_back(name + ": " + bytes.status().message());
      }
      return bytes.status();
    }
    report.bytes += bytes->size();
    auto o = store::parse_store_object(std::move(bytes).value(), {&ns_, kind, key, j, &cache});
    Status st = o.ok() ? (kind == StoreObjectKind::kBlocks ? check_block_ranges(*o, cache, j, C)
                                                           : check_tail_rows(*o, cache, j, C))
                       : o.status();
    if (!st.ok()) {
      report.notes.push_back(name + ": " + st.message() + "; treated as a miss");
      return st;
    }
    return o;
  };

  std::vector<StoreObject> blocks;
  while (static_cast<int64_t>(blocks.size()) < k) {
    auto o = get(StoreObjectKind::kBlocks, static_cast<int64_t>(blocks.size()));
    if (!o.ok()) break;
    blocks.push_back(std::move(o).value());
  }
  // The longest reuse whose tails verify, from tails already fetched once the store is gone.
  std::map<int64_t, StoreObject> tails;
  std::set<int64_t> bad;
  int64_t kk = static_cast<int64_t>(blocks.size());
  for (; kk >= 1; --kk) {
    bool ok = true;
    for (int64_t j = kk - 1; ok && j >= first_tail_needed(cache, kk, C); --j) {
      if (tails.count(j)) continue;
      if (bad.count(j) || unreachable) {
        ok = false;
        continue;
      }
      auto o = get(StoreObjectKind::kTail, j);
      if (o.ok()) {
        tails.emplace(j, std::move(o).value());
      } else {
        bad.insert(j);
        ok = false;
      }
    }
    if (ok) break;
  }
  report.fetch_s += seconds_since(t0);
  cache.reset();
  if (kk == 0) return int64_t{0};

  const auto t1 = std::chrono::steady_clock::now();
  const int64_t offset = kk * C, B = ns_.batch;
  // Objects that verified but do not import (a kvq bug, or a 128-bit collision): recompute.
  auto import_failed = [&](int l, const Status& st) -> Result<int64_t> {
    report.notes.push_back("importing " + std::to_string(kk) + " chunks into layer " +
                           std::to_string(l) + " failed: " + st.message() +
                           "; recomputing the prefix");
    cache.reset();
    report.import_s += seconds_since(t1);
    return int64_t{0};
  };
  for (int l = 0; l < cache.n_layers(); ++l) {
    LayerCache& layer = cache.layer(l);
    std::vector<ChunkRef> chunks;
    const int64_t T = layer.block_tokens();
    for (int64_t j = 0; j < kk; ++j) {
      const store::BlocksView& v = blocks[static_cast<size_t>(j)].blocks[static_cast<size_t>(l)];
      for (size_t b = 0; b < v.keys.size(); ++b) {
        const int64_t t = (v.first_block + static_cast<int64_t>(b)) * T;
        chunks.push_back({ChunkKind::kBlockKeys, t, T, v.keys[b].data, v.keys[b].size});
        chunks.push_back({ChunkKind::kBlockValues, t, T, v.values[b].data, v.values[b].size});
      }
    }
    const store::TailView& last = tails.at(kk - 1).tails[static_cast<size_t>(l)];
    // The window [w0, offset) from the tails' rows, [B, H, n, D] in each part.
    const int64_t w0 = window_start_at(layer, offset), n = offset - w0;
    const int64_t S = B * layer.shape().n_kv_heads;
    const size_t row = window_row_bytes(layer.window_format(), layer.shape().head_dim);
    std::vector<uint8_t> window[2];
    for (auto& w : window) w.resize(static_cast<size_t>(S * n) * row);
    for (int64_t j = w0 / C; j < kk; ++j) {
      const store::TailView& v = tails.at(j).tails[static_cast<size_t>(l)];
      const int64_t r0 = std::max(w0, j * C), r1 = (j + 1) * C;
      if (v.dtype != last.dtype) return import_failed(l, corrupt("tails disagree on the dtype"));
      for (int part = 0; part < 2; ++part) {
        const uint8_t* src = part == 0 ? v.keys.data : v.values.data;
        for (int64_t s = 0; s < S; ++s)
          std::memcpy(window[part].data() + static_cast<size_t>(s * n + (r0 - w0)) * row,
                      src + static_cast<size_t>(s * v.rows_n + (r0 - v.rows_t0)) * row,
                      static_cast<size_t>(r1 - r0) * row);
      }
    }
    chunks.push_back({ChunkKind::kWindowKeys, w0, n, window[0].data(), window[0].size()});
    chunks.push_back({ChunkKind::kWindowValues, w0, n, window[1].data(), window[1].size()});
    chunks.push_back({ChunkKind::kState, 0, offset, last.state.data, last.state.size});
    Status st = layer.import_chunks(chunks, B, offset, last.dtype);
    if (!st.ok()) return import_failed(l, st);
  }
  report.import_s += seconds_since(t1);
  report.chunks = kk;
  report.tokens = offset;
  return kk;
}

}  // namespace kvq
