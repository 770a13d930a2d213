// The store's key scheme (docs/store.md §2): 128-bit hashes, the model fingerprint, namespaces
// and chained chunk keys. Nothing here depends on the process (no salted or pointer hashes), so
// every process on every machine derives the same keys from the same inputs.
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "core/byte_io.h"
#include "kvq/store.h"
#include "store/geometry.h"

namespace kvq {

std::string Hash128::hex() const {
  uint8_t b[16];
  to_bytes(b);
  static const char* kDigits = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[static_cast<size_t>(2 * i)] = kDigits[b[i] >> 4];
    s[static_cast<size_t>(2 * i + 1)] = kDigits[b[i] & 15];
  }
  return s;
}

void Hash128::to_bytes(uint8_t out[16]) const {
  XXH128_canonical_t c;
  XXH128_canonicalFromHash(&c, XXH128_hash_t{lo, hi});
  std::memcpy(out, c.digest, 16);
}

Hash128 Hash128::from_bytes(const uint8_t in[16]) {
  XXH128_canonical_t c;
  std::memcpy(c.digest, in, 16);
  const XXH128_hash_t h = XXH128_hashFromCanonical(&c);
  return Hash128{h.high64, h.low64};
}

Result<Hash128> Hash128::from_hex(std::string_view hex) {
  if (hex.size() != 32)
    return invalid_argument("a 128-bit hash is 32 hex digits, got '" + std::string(hex) + "'");
  uint8_t b[16];
  for (size_t i = 0; i < 32; ++i) {
    const char c = hex[i];
    int v = -1;
    if (c >= '0' && c <= '9') v = c - '0';
    if (c >= 'a' && c <= 'f') v = c - 'a' + 10;
    if (v < 0) return invalid_argument("'" + std::string(hex) + "' is not lowercase hex");
    b[i / 2] = static_cast<uint8_t>(i % 2 ? (b[i / 2] | v) : (v << 4));
  }
  return from_bytes(b);
}

Hash128 hash128(const void* data, size_t size) {
  const XXH128_hash_t h = XXH3_128bits(data, size);
  return Hash128{h.high64, h.low64};
}

Result<Hash128> fingerprint_files(const std::vector<std::string>& paths) {
  if (paths.empty()) return invalid_argument("a model fingerprint needs at least one file");
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), XXH3_freeState);
  if (!st || XXH3_128bits_reset(st.get()) != XXH_OK)
    return limit_exceeded("cannot allocate a hash state");
  std::vector<uint8_t> buf(size_t{1} << 20);
  for (const std::string& path : paths) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return io_error("cannot open '" + path + "': " + std::strerror(errno));
    const off_t size = ::lseek(fd, 0, SEEK_END);
    if (size < 0 || ::lseek(fd, 0, SEEK_SET) != 0) {
      ::close(fd);
      return io_error("cannot read '" + path + "': not a regular file");
    }
    std::vector<uint8_t> len;
    ByteWriter(len).u64(static_cast<uint64_t>(size));
    XXH3_128bits_update(st.get(), len.data(), len.size());
    uint64_t total = 0;
    while (true) {
      const ssize_t n = ::read(fd, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        const std::string why = std::strerror(errno);
        ::close(fd);
        return io_error("cannot read '" + path + "': " + why);
      }
      if (n == 0) break;
      XXH3_128bits_update(st.get(), buf.data(), static_cast<size_t>(n));
      total += static_cast<uint64_t>(n);
    }
    ::close(fd);
    // The size is hashed first; a file that changed under us would make the hash lie.
    if (total != static_cast<uint64_t>(size))
      return io_error("'" + path + "' changed while it was being read");
  }
  const XXH128_hash_t h = XXH3_128bits_digest(st.get());
  return Hash128{h.high64, h.low64};
}

std::string StoreNamespace::descriptor() const {
  return "kvq-store " + std::to_string(kStoreFormatVersion) + "\nmodel " + model.hex() + "\nspec " +
         model_spec + "\nbatch " + std::to_string(batch) + "\nchunk " +
         std::to_string(chunk_tokens) + "\nproducer " + producer + "\n";
}

Result<StoreNamespace> make_store_namespace(const ModelCache& cache, const Hash128& model,
                                            int64_t chunk_tokens, std::string producer,
                                            int64_t batch) {
  if (chunk_tokens < 1 || chunk_tokens > kMaxStoreChunkTokens)
    return invalid_argument("store chunk size must be in [1, " +
                            std::to_string(kMaxStoreChunkTokens) + "] tokens, got " +
                            std::to_string(chunk_tokens));
  if (batch < 1 || batch > 65536)
    return invalid_argument("store batch size must be in [1, 65536], got " + std::to_string(batch));
  for (char c : producer)
    if (c < 0x20 || c > 0x7e) return invalid_argument("the store producer must be printable ASCII");
  for (int l = 0; l < cache.n_layers(); ++l) {
    const LayerCache& layer = cache.layer(l);
    if (!layer_seals(layer)) continue;  // fp16: every chunk boundary is as good as another
    if (chunk_tokens % layer.block_tokens() != 0)
      return invalid_argument(
          "store chunk size " + std::to_string(chunk_tokens) + " is not a multiple of layer " +
          std::to_string(l) + "'s " + std::to_string(layer.block_tokens()) + "-token blocks (" +
          layer.spec().to_string() + "): chunk boundaries must be block boundaries");
  }
  StoreNamespace ns;
  ns.model = model;
  ns.model_spec = cache.model_spec().to_string();
  ns.batch = batch;
  ns.chunk_tokens = chunk_tokens;
  ns.producer = std::move(producer);
  return ns;
}

std::vector<Hash128> chunk_keys(const StoreNamespace& ns, std::span<const int32_t> tokens) {
  const int64_t B = ns.batch, C = ns.chunk_tokens;
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  std::vector<Hash128> keys;
  std::vector<uint8_t> buf;
  Hash128 prev = ns.id();
  for (int64_t i = 0; (i + 1) * C <= n; ++i) {
    buf.clear();
    ByteWriter w(buf);
    uint8_t b[16];
    prev.to_bytes(b);
    w.bytes(b, 16);
    for (int64_t row = 0; row < B; ++row)
      for (int64_t t = i * C; t < (i + 1) * C; ++t)
        w.u32(static_cast<uint32_t>(tokens[static_cast<size_t>(row * n + t)]));
    prev = hash128(buf.data(), buf.size());
    keys.push_back(prev);
  }
  return keys;
}

const char* store_object_kind_name(StoreObjectKind k) {
  switch (k) {
    case StoreObjectKind::kBlocks:
      return "blocks";
    case StoreObjectKind::kTail:
      return "tail";
  }
  return "unknown";
}

std::string store_key_prefix(const StoreNamespace* ns) {
  std::string p = "kvq" + std::to_string(kStoreFormatVersion) + ":";
  if (ns) p += ns->id().hex() + ":";
  return p;
}

std::string store_object_key(const StoreNamespace& ns, const Hash128& key, StoreObjectKind kind) {
  return store_key_prefix(&ns) + key.hex() + (kind == StoreObjectKind::kBlocks ? ":b" : ":t");
}

}  // namespace kvq
