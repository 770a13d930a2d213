#include "store/objects.h"

#include <xxhash.h>

#include <charconv>
#include <cstring>

#include "core/byte_io.h"

namespace kvq {

std::map<std::string, std::string> descriptor_fields(std::string_view d) {
  std::map<std::string, std::string> f;
  size_t at = 0;
  while (at < d.size()) {
    const size_t nl = d.find('\n', at), sp = d.find(' ', at);
    const size_t end = nl == std::string_view::npos ? d.size() : nl;
    if (sp != std::string_view::npos && sp < end)
      f[std::string(d.substr(at, sp - at))] = std::string(d.substr(sp + 1, end - sp - 1));
    at = end + 1;
  }
  return f;
}

int64_t descriptor_int(const std::map<std::string, std::string>& f, const std::string& key) {
  const auto it = f.find(key);
  if (it == f.end()) return 0;
  int64_t v = 0;
  const auto [end, ec] =
      std::from_chars(it->second.data(), it->second.data() + it->second.size(), v);
  return ec == std::errc() && end == it->second.data() + it->second.size() ? v : 0;
}

Result<StoreObjectInfo> inspect_store_object(const uint8_t* data, size_t size) {
  using namespace store;  // the format's constants
  if (size < 8 || std::memcmp(data, kObjectMagic, 8) != 0)
    return format_error("not a kvq store object (bad magic)");
  ByteReader r(data, size);
  r.skip(8);
  StoreObjectInfo info;
  uint8_t kind = 0, reserved[3], b[16];
  uint32_t chunk = 0, n_layers = 0, dlen = 0;
  if (!r.u16(info.major) || !r.u16(info.minor)) return corrupt("store object: truncated header");
  if (info.major != kObjectMajor)
    return unsupported("store object format version " + std::to_string(info.major) + "." +
                       std::to_string(info.minor) + " is not supported; this kvq reads " +
                       std::to_string(kObjectMajor) + ".x");
  if (!r.u8(kind) || !r.bytes(reserved, 3) || !r.bytes(b, 16))
    return corrupt("store object: truncated header");
  info.ns = Hash128::from_bytes(b);
  if (!r.bytes(b, 16) || !r.u32(chunk) || !r.u32(n_layers) || !r.u64(info.size) || !r.u32(dlen))
    return corrupt("store object: truncated header");
  info.key = Hash128::from_bytes(b);
  // Reserved bytes are zero in 1.0, so that an object has one encoding (as its writer's).
  if (reserved[0] | reserved[1] | reserved[2]) return corrupt("store object: reserved bytes set");
  if (kind != 1 && kind != 2)
    return unsupported("store object: unknown kind " + std::to_string(kind));
  info.kind = static_cast<StoreObjectKind>(kind);
  info.chunk = chunk;
  info.n_layers = n_layers;
  if (dlen > kMaxDescriptorBytes) return corrupt("store object: descriptor too long");
  if (r.remaining() < dlen) return corrupt("store object: truncated descriptor");
  info.descriptor.assign(reinterpret_cast<const char*>(r.cursor()), dlen);
  if (info.size == size) {
    uint64_t sum;
    std::memcpy(&sum, data + size - 8, 8);
    info.checksum_ok =
        size >= kObjectHeaderBytes + 4 + kObjectChecksumBytes && XXH64(data, size - 8, 0) == sum;
  }
  return info;
}

namespace store {

namespace {

// Header, descriptor, then the caller's sections; finish() fills in the size and the checksum.
class ObjectWriter {
 public:
  ObjectWriter(StoreObjectKind kind, const StoreNamespace& ns, const Hash128& key, int64_t chunk,
               size_t n_layers)
      : w_(out_) {
    out_.reserve(
        4096);  // also keeps GCC 12's -Wstringop-overflow from misfiring on an empty vector
    w_.bytes(kObjectMagic, 8);
    w_.u16(kObjectMajor);
    w_.u16(kObjectMinor);
    w_.u8(static_cast<uint8_t>(kind));
    w_.zeros(3);
    uint8_t b[16];
    ns.id().to_bytes(b);
    w_.bytes(b, 16);
    key.to_bytes(b);
    w_.bytes(b, 16);
    w_.u32(static_cast<uint32_t>(chunk));
    w_.u32(static_cast<uint32_t>(n_layers));
    w_.u64(0);  // the size, once known
    const std::string d = ns.descriptor();
    w_.u32(static_cast<uint32_t>(d.size()));
    w_.bytes(d.data(), d.size());
  }
  ByteWriter& w() { return w_; }
  void blob(const std::vector<uint8_t>& b) {
    w_.u64(b.size());
    w_.bytes(b.data(), b.size());
  }
  std::vector<uint8_t> finish() {
    const uint64_t size = out_.size() + kObjectChecksumBytes;
    std::memcpy(out_.data() + 56, &size, 8);
    w_.u64(XXH64(out_.data(), out_.size(), 0));
    return std::move(out_);
  }

 private:
  std::vector<uint8_t> out_;
  ByteWriter w_;
};

}  // namespace

std::vector<uint8_t> encode_blocks_object(const StoreNamespace& ns, const Hash128& key,
                                          int64_t chunk, const std::vector<BlocksSection>& layers) {
  ObjectWriter o(StoreObjectKind::kBlocks, ns, key, chunk, layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    const BlocksSection& s = layers[l];
    o.w().u32(static_cast<uint32_t>(l));
    o.w().u32(static_cast<uint32_t>(s.keys.size()));
    o.w().u64(static_cast<uint64_t>(s.first_block));
    for (size_t b = 0; b < s.keys.size(); ++b) {
      o.blob(s.keys[b]);
      o.blob(s.values[b]);
    }
  }
  return o.finish();
}

std::vector<uint8_t> encode_tail_object(const StoreNamespace& ns, const Hash128& key, int64_t chunk,
                                        const std::vector<TailSection>& layers) {
  ObjectWriter o(StoreObjectKind::kTail, ns, key, chunk, layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    const TailSection& s = layers[l];
    o.w().u32(static_cast<uint32_t>(l));
    o.w().u8(s.format == WindowFormat::kQ8 ? 3 : s.dtype == DType::kBF16 ? 2 : 1);
    o.w().zeros(3);
    o.w().u64(static_cast<uint64_t>(s.rows_t0));
    o.w().u64(static_cast<uint64_t>(s.rows_n));
    o.w().u64(s.keys.size());
    o.w().bytes(s.keys.data(), s.keys.size());
    o.w().bytes(s.values.data(), s.values.size());
    o.blob(s.state);
  }
  return o.finish();
}

namespace {

Status check_info(const StoreObjectInfo& info, size_t size, const ObjectExpectation& want) {
  const std::string what = std::string(store_object_kind_name(want.kind)) + " object of chunk " +
                           std::to_string(want.chunk);
  if (info.size != size)
    return corrupt(what + ": " + std::to_string(size) + " bytes where its header says " +
                   std::to_string(info.size) + " (truncated or padded)");
  if (!info.checksum_ok) return corrupt(what + ": checksum mismatch");
  if (info.kind != want.kind)
    return corrupt(what + ": holds a " + store_object_kind_name(info.kind) + " object");
  if (!(info.ns == want.ns->id()) ||
      hash128(info.descriptor.data(), info.descriptor.size()) != info.ns)
    return corrupt(what + ": belongs to another namespace");
  if (!(info.key == want.key) || info.chunk != want.chunk)
    return corrupt(what + ": is chunk " + std::to_string(info.chunk) + " of another prefix");
  if (info.n_layers != want.cache->n_layers())
    return corrupt(what + ": has " + std::to_string(info.n_layers) + " layers, the cache " +
                   std::to_string(want.cache->n_layers()));
  return ok_status();
}

bool read_blob(ByteReader& r, Bytes& out) {
  uint64_t n;
  if (!r.u64(n) || n > r.remaining()) return false;
  out.size = static_cast<size_t>(n);
  return r.view(out.size, out.data);
}

}  // namespace

Result<StoreObject> parse_store_object(std::vector<uint8_t> bytes, const ObjectExpectation& want) {
  StoreObject o;
  KVQ_ASSIGN_OR_RETURN(o.info, inspect_store_object(bytes.data(), bytes.size()));
  KVQ_RETURN_IF_ERROR(check_info(o.info, bytes.size(), want));
  o.bytes = std::move(bytes);
  ByteReader r(o.bytes.data(), o.bytes.size() - kObjectChecksumBytes);
  r.skip(kObjectHeaderBytes + 4 + o.info.descriptor.size());
  const std::string what = std::string(store_object_kind_name(want.kind)) + " object of chunk " +
                           std::to_string(want.chunk);
  const int64_t B = want.ns->batch;
  for (int l = 0; l < want.cache->n_layers(); ++l) {
    const std::string where = what + ", layer " + std::to_string(l) + ": ";
    uint32_t layer = 0;
    if (!r.u32(layer) || layer != static_cast<uint32_t>(l))
      return corrupt(where + "missing or out of order");
    if (want.kind == StoreObjectKind::kBlocks) {
      BlocksView v;
      uint32_t n = 0;
      uint64_t first = 0;
      if (!r.u32(n) || !r.u64(first) || first > (uint64_t{1} << 31) || n > r.remaining() / 16)
        return corrupt(where + "bad block range");
      v.first_block = static_cast<int64_t>(first);
      v.keys.resize(n);
      v.values.resize(n);
      for (uint32_t b = 0; b < n; ++b)
        if (!read_blob(r, v.keys[b]) || !read_blob(r, v.values[b]))
          return corrupt(where + "block " + std::to_string(first + b) + " runs past the end");
      o.blocks.push_back(std::move(v));
    } else {
      TailView v;
      uint8_t dtype = 0, reserved[3];
      uint64_t t0 = 0, n = 0, row_bytes = 0;
      if (!r.u8(dtype) || !r.bytes(reserved, 3) || !r.u64(t0) || !r.u64(n) || !r.u64(row_bytes))
        return corrupt(where + "truncated");
      if (dtype < 1 || dtype > 3) return corrupt(where + "window dtype must be 1, 2 or 3");
      if (reserved[0] | reserved[1] | reserved[2]) return corrupt(where + "reserved bytes set");
      v.dtype = dtype == 2 ? DType::kBF16 : DType::kF16;
      v.format = dtype == 3 ? WindowFormat::kQ8 : WindowFormat::k16Bit;
      const LayerCache& lc = want.cache->layer(l);
      const LayerShape& s = lc.shape();
      if (v.format != lc.window_format())
        return corrupt(where + "window rows of another format than the layer's");
      const uint64_t end = static_cast<uint64_t>((want.chunk + 1) * want.ns->chunk_tokens);
      if (t0 > end || n != end - t0)
        return corrupt(where + "window rows [" + std::to_string(t0) + ", +" + std::to_string(n) +
                       ") do not end at the chunk's end " + std::to_string(end));
      const uint64_t want_bytes =
          static_cast<uint64_t>(B * s.n_kv_heads) * n * window_row_bytes(v.format, s.head_dim);
      if (row_bytes != want_bytes || row_bytes > r.remaining() / 2)
        return corrupt(where + "window rows hold " + std::to_string(row_bytes) + " bytes, not " +
                       std::to_string(want_bytes));
      v.rows_t0 = static_cast<int64_t>(t0);
      v.rows_n = static_cast<int64_t>(n);
      v.keys.size = v.values.size = static_cast<size_t>(row_bytes);
      r.view(v.keys.size, v.keys.data);
      r.view(v.values.size, v.values.data);
      if (!read_blob(r, v.state)) return corrupt(where + "state runs past the end");
      o.tails.push_back(v);
    }
  }
  if (r.remaining() != 0)
    return corrupt(what + ": " + std::to_string(r.remaining()) + " bytes after the last layer");
  return o;
}

}  // namespace store
}  // namespace kvq
