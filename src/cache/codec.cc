#include "cache/codec.h"

#include <cmath>
#include <cstring>

#include "cache/cpu_store.h"
#include "cache/ledger.h"

namespace kvq {

BlockCodec::BlockCodec(Spec spec, LayerShape shape, int64_t block_tokens, int64_t residual)
    : spec_(std::move(spec)), shape_(shape), block_tokens_(block_tokens), residual_(residual) {
  if (shape_.n_q_heads == 0) shape_.n_q_heads = shape_.n_kv_heads;
}

int64_t BlockCodec::page_tokens() const { return window_page_tokens(block_tokens_); }

void BlockCodec::serialize(const BlockData& blk, bool keys, std::vector<uint8_t>& out) const {
  const Buffer& b = keys ? blk.keys : blk.values;
  out.insert(out.end(), b.data(), b.data() + b.size());
}

Status BlockCodec::precheck_append(int64_t, int64_t, int64_t, int64_t) const { return ok_status(); }

void BlockCodec::on_tokens(const TokenRun&, const LayerReader&, Workspace&) {}

void BlockCodec::on_trim(int64_t, int64_t) {}

void BlockCodec::export_state(std::vector<uint8_t>&) const {}

Status BlockCodec::import_state(const uint8_t*, size_t size, int64_t, int64_t, bool) {
  return size == 0 ? ok_status() : corrupt("unexpected method state for " + spec_.method_name());
}

std::string BlockCodec::stats(const std::vector<std::shared_ptr<const BlockData>>&,
                              const BlockGeometry&) const {
  return {};
}

Status validate_quant_params(const uint8_t* params, size_t n_pairs, const char* what) {
  for (size_t i = 0; i < n_pairs; ++i) {
    uint16_t sc, ze;
    std::memcpy(&sc, params + 4 * i, 2);
    std::memcpy(&ze, params + 4 * i + 2, 2);
    const float scale = f16_to_f32(sc), zero = f16_to_f32(ze);
    if (!std::isfinite(scale) || !(scale > 0) || !std::isfinite(zero))
      return corrupt(std::string(what) + ": parameter pair " + std::to_string(i) + " has scale " +
                     std::to_string(scale) + ", zero " + std::to_string(zero));
  }
  return ok_status();
}

Status check_padding(const uint8_t* codes, size_t streams, size_t stream_bytes, int64_t n, int bits,
                     const char* what) {
  const size_t used_bits = static_cast<size_t>(n) * static_cast<size_t>(bits);
  if (used_bits % 8 == 0) return ok_status();
  const uint8_t mask = static_cast<uint8_t>(0xFF << (used_bits % 8));
  for (size_t s = 0; s < streams; ++s)
    if (codes[(s + 1) * stream_bytes - 1] & mask)
      return corrupt(std::string("non-zero padding bits in ") + what);
  return ok_status();
}

const QuantParams* params_at(const uint8_t* p, size_t bytes, Workspace& ws) {
  if (reinterpret_cast<uintptr_t>(p) % alignof(QuantParams) == 0)
    return reinterpret_cast<const QuantParams*>(p);
  auto* copy = ws.alloc<QuantParams>(bytes / sizeof(QuantParams));
  std::memcpy(copy, p, bytes);
  return copy;
}

std::shared_ptr<const BlockData> clone_block(const std::shared_ptr<const BlockData>& b,
                                             CloneMemo& memo) {
  if (!b) return nullptr;
  auto it = memo.copies.find(b.get());
  if (it != memo.copies.end()) return std::static_pointer_cast<const BlockData>(it->second);
  auto copy = std::make_shared<BlockData>();
  copy->keys = b->keys;
  copy->values = b->values;
  copy->linked = clone_block(b->linked, memo);
  memo.copies.emplace(b.get(), copy);
  return copy;
}

CpuStore CpuStore::clone(CloneMemo& memo) const {
  CpuStore c;
  c.blocks_.reserve(blocks_.size());
  for (const auto& b : blocks_) c.blocks_.push_back(clone_block(b, memo));
  c.k_pages_ = k_pages_;
  c.v_pages_ = v_pages_;
  c.page_bytes_ = page_bytes_;
  return c;
}

}  // namespace kvq
