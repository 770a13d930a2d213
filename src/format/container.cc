// The .kvq container (docs/format.md is normative; section numbers below refer to it).
//
// One parser (Parser) checks records and builds layers; two drivers feed it: a walker over a
// whole buffer (payloads stay where they are) and the incremental ContainerReader (payloads are
// copied out of its input buffer once their record is complete). inspect_container runs the same
// parser without building a cache, and ContainerView reads through the index only.
#include "kvq/container.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <thread>

#include "core/byte_io.h"
#include "core/file_io.h"
#include "kvq/spec.h"
#include "kvq/version.h"

namespace kvq {

namespace {

static_assert(std::endian::native == std::endian::little,
              "the container code assumes a little-endian host");

constexpr uint8_t kMagic[8] = {0x89, 'K', 'V', 'Q', '\r', '\n', 0x1a, '\n'};
constexpr size_t kHeaderBytes = 64;
constexpr size_t kIndexEntryBytes = 48;
constexpr uint32_t kFlagOptional = 1;
constexpr uint64_t kMaxMetaBytes = uint64_t{16} << 20;
constexpr uint32_t kMaxString = 65536;
constexpr uint32_t kMaxLayers = 4096;
constexpr uint32_t kMaxAttributes = 1024;
constexpr uint64_t kMaxTokens = uint64_t{1} << 31;
constexpr uint64_t kMaxBatch = 65536;
// Window chunks' row format (§3.2): 16-bit elements, or q8 rows (kvq's window=q8).
constexpr uint8_t kDtypeNone = 0, kDtypeF16 = 1, kDtypeBF16 = 2, kDtypeQ8 = 3;

constexpr uint32_t fourcc(const char (&s)[5]) {
  return static_cast<uint32_t>(static_cast<uint8_t>(s[0])) |
         static_cast<uint32_t>(static_cast<uint8_t>(s[1])) << 8 |
         static_cast<uint32_t>(static_cast<uint8_t>(s[2])) << 16 |
         static_cast<uint32_t>(static_cast<uint8_t>(s[3])) << 24;
}
constexpr uint32_t kMeta = fourcc("META");
constexpr uint32_t kChnk = fourcc("CHNK");
constexpr uint32_t kIndx = fourcc("INDX");
constexpr uint32_t kEnd = fourcc("END ");

uint64_t xxh(const void* p, size_t n) { return XXH64(p, n, 0); }
uint64_t pad_of(uint64_t n) {
  return (kContainerAlignment - n % kContainerAlignment) % kContainerAlignment;
}

template <class T>
void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

std::string type_name(uint32_t type) {
  std::string s;
  for (int i = 0; i < 4; ++i) {
    const char c = static_cast<char>((type >> (8 * i)) & 0xff);
    if (c >= 0x20 && c < 0x7f) {
      s += c;
    } else {
      static const char* hex = "0123456789abcdef";
      s += "\\x";
      s += hex[(c >> 4) & 0xf];
      s += hex[c & 0xf];
    }
  }
  return s;
}

// *out = the product of `factors`; false on 64-bit overflow.
bool product(uint64_t* out, std::initializer_list<uint64_t> factors) {
  uint64_t p = 1;
  for (uint64_t f : factors)
    if (__builtin_mul_overflow(p, f, &p)) return false;
  *out = p;
  return true;
}

std::string at_offset(uint64_t off) { return " at offset " + std::to_string(off); }

uint8_t dtype_code(DType t, WindowFormat f) {
  return f == WindowFormat::kQ8 ? kDtypeQ8 : t == DType::kBF16 ? kDtypeBF16 : kDtypeF16;
}
// q8 rows' scales are fp16.
DType dtype_of(uint8_t code) { return code == kDtypeBF16 ? DType::kBF16 : DType::kF16; }
WindowFormat format_of(uint8_t code) {
  return code == kDtypeQ8 ? WindowFormat::kQ8 : WindowFormat::k16Bit;
}
bool is_window(ChunkKind k) { return k == ChunkKind::kWindowKeys || k == ChunkKind::kWindowValues; }

// ---- headers ----

void encode_file_header(uint8_t* h) {
  std::memset(h, 0, kHeaderBytes);
  std::memcpy(h, kMagic, 8);
  store<uint16_t>(h + 8, kContainerMajorVersion);
  store<uint16_t>(h + 10, kContainerMinorVersion);
  store<uint32_t>(h + 12, kHeaderBytes);
  store<uint64_t>(h + 56, xxh(h, 56));
}

// `avail` bytes of the file's start are present; checks what they allow (§2.1).
Status check_magic(const uint8_t* p, size_t avail) {
  const size_t n = std::min<size_t>(avail, 8);
  if (n > 0 && std::memcmp(p, kMagic, n) != 0)
    return format_error("not a .kvq file (wrong magic bytes)");
  return ok_status();
}

Status check_file_header(const uint8_t* h, uint16_t& major, uint16_t& minor) {
  KVQ_RETURN_IF_ERROR(check_magic(h, kHeaderBytes));
  major = load<uint16_t>(h + 8);
  minor = load<uint16_t>(h + 10);
  if (major != kContainerMajorVersion)
    return unsupported("format version " + std::to_string(major) + "." + std::to_string(minor) +
                       " is not supported; this kvq (" KVQ_VERSION_STRING ") reads version " +
                       std::to_string(kContainerMajorVersion) + ".x");
  if (load<uint32_t>(h + 12) != kHeaderBytes)
    return format_error("file header size " + std::to_string(load<uint32_t>(h + 12)) +
                        ", expected 64");
  if (load<uint64_t>(h + 56) != xxh(h, 56)) return corrupt("file header checksum mismatch");
  return ok_status();
}

struct RecordHeader {
  uint8_t raw[kHeaderBytes];
  uint32_t type() const { return load<uint32_t>(raw); }
  uint32_t flags() const { return load<uint32_t>(raw + 4); }
  uint64_t size() const { return load<uint64_t>(raw + 8); }
  uint64_t checksum() const { return load<uint64_t>(raw + 16); }
  const uint8_t* fields() const { return raw + 24; }
};

void encode_record_header(uint8_t* h, uint32_t type, uint32_t flags, uint64_t size,
                          uint64_t checksum, const uint8_t* fields32) {
  std::memset(h, 0, kHeaderBytes);
  store<uint32_t>(h, type);
  store<uint32_t>(h + 4, flags);
  store<uint64_t>(h + 8, size);
  store<uint64_t>(h + 16, checksum);
  if (fields32) std::memcpy(h + 24, fields32, 32);
  store<uint64_t>(h + 56, xxh(h, 56));
}

Status decode_record_header(const uint8_t* p, uint64_t offset, RecordHeader& h) {
  std::memcpy(h.raw, p, kHeaderBytes);
  if (load<uint64_t>(h.raw + 56) != xxh(h.raw, 56))
    return corrupt("record header checksum mismatch" + at_offset(offset));
  return ok_status();
}

// The declared payload size against the reader's limits (kLimit) and what is there (kCorrupt).
Status check_record_size(const RecordHeader& h, uint64_t offset, uint64_t available,
                         const ContainerLimits& limits) {
  const uint64_t p = h.size();
  const uint64_t cap = h.type() == kMeta ? kMaxMetaBytes : limits.max_record_bytes;
  if (p > cap)
    return limit_exceeded("record " + type_name(h.type()) + at_offset(offset) + " declares " +
                          std::to_string(p) + " payload bytes, more than the limit of " +
                          std::to_string(cap));
  if (available != UINT64_MAX && (p > available || pad_of(p) > available - p))
    return corrupt("record " + type_name(h.type()) + at_offset(offset) + " declares " +
                   std::to_string(p) + " payload bytes but only " + std::to_string(available) +
                   " bytes follow its header (a truncated file or a corrupt length)");
  return ok_status();
}

// ---- CHNK fields (§3.2) ----

struct ChunkFields {
  uint32_t layer = 0;
  uint8_t kind = 0, dtype = 0;
  uint64_t t0 = 0, tokens = 0, batch = 0;
};

void encode_chunk_fields(uint8_t* f, const ChunkFields& c) {
  std::memset(f, 0, 32);
  store<uint32_t>(f, c.layer);
  f[4] = c.kind;
  f[5] = c.dtype;
  store<uint64_t>(f + 8, c.t0);
  store<uint64_t>(f + 16, c.tokens);
  store<uint64_t>(f + 24, c.batch);
}

ChunkFields decode_chunk_fields(const uint8_t* f) {
  ChunkFields c;
  c.layer = load<uint32_t>(f);
  c.kind = f[4];
  c.dtype = f[5];
  c.t0 = load<uint64_t>(f + 8);
  c.tokens = load<uint64_t>(f + 16);
  c.batch = load<uint64_t>(f + 24);
  return c;
}

Status check_chunk_fields(const ChunkFields& c, uint32_t n_layers, uint64_t offset) {
  const std::string where = "chunk" + at_offset(offset);
  if (c.layer >= n_layers)
    return corrupt(where + " is for layer " + std::to_string(c.layer) + " of a " +
                   std::to_string(n_layers) + "-layer model");
  if (c.kind > static_cast<uint8_t>(ChunkKind::kState))
    return unsupported(where + " has chunk kind " + std::to_string(c.kind) +
                       ", unknown to this kvq (" + KVQ_VERSION_STRING ")");
  const bool window = is_window(static_cast<ChunkKind>(c.kind));
  if (window ? (c.dtype < kDtypeF16 || c.dtype > kDtypeQ8) : c.dtype != kDtypeNone)
    return corrupt(where + " (" + chunk_kind_name(static_cast<ChunkKind>(c.kind)) +
                   ") has element type code " + std::to_string(c.dtype));
  if (c.t0 > kMaxTokens || c.tokens > kMaxTokens || c.t0 + c.tokens > kMaxTokens)
    return corrupt(where + " covers tokens [" + std::to_string(c.t0) + ", +" +
                   std::to_string(c.tokens) + "), beyond the format's 2^31 positions");
  if (c.batch > kMaxBatch)
    return corrupt(where + " has batch size " + std::to_string(c.batch) + " > 65536");
  return ok_status();
}

ContainerChunk to_chunk(const ChunkFields& f, uint64_t offset, uint64_t size, uint64_t checksum) {
  ContainerChunk c;
  c.record_offset = offset;
  c.layer = static_cast<int>(f.layer);
  c.kind = static_cast<ChunkKind>(f.kind);
  c.dtype = dtype_of(f.dtype);
  c.window_format = format_of(f.dtype);
  c.t0 = static_cast<int64_t>(f.t0);
  c.tokens = static_cast<int64_t>(f.tokens);
  c.batch = static_cast<int64_t>(f.batch);
  c.size = size;
  c.checksum = checksum;
  return c;
}

// ---- INDX entries (§3.3) ----

void encode_index_entry(uint8_t* e, uint64_t offset, const ChunkFields& f, uint64_t size,
                        uint64_t checksum) {
  std::memset(e, 0, kIndexEntryBytes);
  store<uint64_t>(e, offset);
  store<uint32_t>(e + 8, f.layer);
  e[12] = f.kind;
  e[13] = f.dtype;
  store<uint64_t>(e + 16, f.t0);
  store<uint64_t>(e + 24, f.tokens);
  store<uint64_t>(e + 32, size);
  store<uint64_t>(e + 40, checksum);
}

bool index_entry_matches(const uint8_t* e, uint64_t offset, const ChunkFields& f, uint64_t size,
                         uint64_t checksum) {
  uint8_t want[kIndexEntryBytes];
  encode_index_entry(want, offset, f, size, checksum);
  // Reserved bytes 14..15 are ignored (§1).
  return std::memcmp(want, e, 14) == 0 &&
         std::memcmp(want + 16, e + 16, kIndexEntryBytes - 16) == 0;
}

// ---- META (§3.1) ----

void put_string(ByteWriter& w, const std::string& s) {
  w.u32(static_cast<uint32_t>(s.size()));
  w.bytes(s.data(), s.size());
}

bool get_string(ByteReader& r, std::string& s, const char* what, Status& err) {
  uint32_t n;
  if (!r.u32(n)) {
    err = corrupt(std::string("metadata ends inside ") + what);
    return false;
  }
  if (n > kMaxString || n > r.remaining()) {
    err = corrupt(std::string("metadata ") + what + " declares " + std::to_string(n) + " bytes (" +
                  std::to_string(r.remaining()) + " remain, at most 65536 allowed)");
    return false;
  }
  const uint8_t* p = nullptr;
  (void)r.view(n, p);
  s.assign(reinterpret_cast<const char*>(p), n);
  if (s.find('\0') != std::string::npos) {
    err = corrupt(std::string("metadata ") + what + " contains a NUL byte");
    return false;
  }
  return true;
}

std::vector<uint8_t> encode_meta(const ContainerMeta& m) {
  std::vector<uint8_t> out;
  ByteWriter w(out);
  w.u32(static_cast<uint32_t>(m.shape.n_layers));
  w.u32(static_cast<uint32_t>(m.overrides.size()));
  w.u32(static_cast<uint32_t>(m.attributes.size()));
  w.u32(0);
  put_string(w, m.kvq_version);
  put_string(w, m.method_spec);
  for (int i = 0; i < m.shape.n_layers; ++i) {
    const LayerShape& l = m.shape.at(i);
    w.u32(static_cast<uint32_t>(l.n_kv_heads));
    w.u32(static_cast<uint32_t>(l.head_dim));
    w.u32(static_cast<uint32_t>(l.n_q_heads));
    w.u32(0);
  }
  for (const auto& [layer, text] : m.overrides) {
    w.u32(static_cast<uint32_t>(layer));
    put_string(w, text);
  }
  for (const auto& [k, v] : m.attributes) {
    put_string(w, k);
    put_string(w, v);
  }
  return out;
}

Result<ContainerMeta> decode_meta(const uint8_t* data, size_t size) {
  ByteReader r(data, size);
  ContainerMeta m;
  uint32_t n_layers, n_over, n_attr, reserved;
  if (!r.u32(n_layers) || !r.u32(n_over) || !r.u32(n_attr) || !r.u32(reserved))
    return corrupt("metadata of " + std::to_string(size) + " bytes is too short");
  if (n_layers < 1 || n_layers > kMaxLayers)
    return corrupt("metadata declares " + std::to_string(n_layers) + " layers (1..4096 allowed)");
  if (n_over > n_layers)
    return corrupt("metadata declares " + std::to_string(n_over) + " overrides for " +
                   std::to_string(n_layers) + " layers");
  if (n_attr > kMaxAttributes)
    return corrupt("metadata declares " + std::to_string(n_attr) +
                   " attributes (at most 1024 allowed)");
  Status err;
  if (!get_string(r, m.kvq_version, "kvq version", err)) return err;
  if (!get_string(r, m.method_spec, "method spec", err)) return err;
  if (r.remaining() / 16 < n_layers) return corrupt("metadata ends inside the layer shapes");
  std::vector<LayerShape> layers(n_layers);
  for (uint32_t i = 0; i < n_layers; ++i) {
    uint32_t h = 0, d = 0, q = 0, res = 0;
    (void)(r.u32(h) && r.u32(d) && r.u32(q) && r.u32(res));
    const std::string where = "metadata, layer " + std::to_string(i) + ": ";
    if (h < 1 || h > 4096)
      return corrupt(where + "n_kv_heads " + std::to_string(h) + " outside [1, 4096]");
    if (d < 1 || d > 4096)
      return corrupt(where + "head_dim " + std::to_string(d) + " outside [1, 4096]");
    if (q > 65536 || q % h != 0)
      return corrupt(where + "n_q_heads " + std::to_string(q) +
                     " is not a multiple of n_kv_heads " + std::to_string(h) + " in [0, 65536]");
    layers[i] = LayerShape{static_cast<int>(h), static_cast<int>(d), static_cast<int>(q)};
  }
  m.shape.n_layers = static_cast<int>(n_layers);
  bool uniform = true;
  for (const auto& l : layers)
    uniform = uniform && l.n_kv_heads == layers[0].n_kv_heads && l.head_dim == layers[0].head_dim &&
              l.n_q_heads == layers[0].n_q_heads;
  if (uniform)
    m.shape.layer = layers[0];
  else
    m.shape.per_layer = std::move(layers);
  int64_t last = -1;
  for (uint32_t i = 0; i < n_over; ++i) {
    uint32_t layer;
    if (!r.u32(layer)) return corrupt("metadata ends inside the overrides");
    if (static_cast<int64_t>(layer) <= last || layer >= n_layers)
      return corrupt("metadata override for layer " + std::to_string(layer) +
                     " is out of order or beyond the model's layers");
    last = layer;
    std::string text;
    if (!get_string(r, text, "override", err)) return err;
    m.overrides[static_cast<int>(layer)] = std::move(text);
  }
  for (uint32_t i = 0; i < n_attr; ++i) {
    std::string k, v;
    if (!get_string(r, k, "attribute key", err) || !get_string(r, v, "attribute value", err))
      return err;
    if (k.empty() || (!m.attributes.empty() && !(m.attributes.rbegin()->first < k)))
      return corrupt("metadata attribute keys must be non-empty and strictly increasing ('" + k +
                     "')");
    m.attributes.emplace(std::move(k), std::move(v));
  }
  if (r.remaining() != 0)
    return corrupt("metadata has " + std::to_string(r.remaining()) + " unexpected trailing bytes");
  return m;
}

// The parameters in which `layer` differs from `base`, as "k=v,k=v" (empty when none).
Status check_attributes(const ContainerAttributes& attrs) {
  if (attrs.size() > kMaxAttributes) return invalid_argument("more than 1024 container attributes");
  for (const auto& [k, v] : attrs) {
    if (k.empty() || k.size() > kMaxString || v.size() > kMaxString ||
        k.find('\0') != std::string::npos || v.find('\0') != std::string::npos)
      return invalid_argument(
          "container attribute '" + k.substr(0, 64) +
          "': keys must be non-empty and keys and values at most 65536 bytes without NUL");
  }
  return ok_status();
}

// The layers' RoPE parameters travel in the reserved attribute "kvq.rope" (absent when no layer
// has RoPE set): one "mode,theta,freq_scale" per layer, ';'-separated, or one for all layers.
constexpr const char* kRopeAttribute = "kvq.rope";

std::string rope_text(const RopeShape& r) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%d,%.17g,%.17g", static_cast<int>(r.mode), r.theta,
                r.freq_scale);
  return buf;
}

std::string rope_attribute(const ModelShape& shape) {
  bool any = false;
  for (int i = 0; i < shape.n_layers; ++i) any |= shape.at(i).rope.mode != RopeShape::Mode::kNone;
  if (!any) return {};
  if (shape.per_layer.empty()) return rope_text(shape.layer.rope);
  std::string out;
  for (int i = 0; i < shape.n_layers; ++i) out += (i ? ";" : "") + rope_text(shape.at(i).rope);
  return out;
}

// Applies a "kvq.rope" attribute to the shape read from META (kCorrupt when malformed).
Status apply_rope_attribute(const std::string& text, ModelShape& shape) {
  std::vector<RopeShape> ropes;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t end = std::min(text.find(';', at), text.size());
    const std::string item = text.substr(at, end - at);
    RopeShape r;
    int mode = -1;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%d,%lf,%lf%c", &mode, &r.theta, &r.freq_scale, &tail) != 3 ||
        mode < 0 || mode > 2 || !(r.theta > 0) || !std::isfinite(r.theta) || !(r.freq_scale > 0) ||
        !std::isfinite(r.freq_scale))
      return corrupt("container attribute kvq.rope: bad entry '" + item.substr(0, 64) + "'");
    r.mode = static_cast<RopeShape::Mode>(mode);
    ropes.push_back(r);
    at = end + 1;
  }
  if (ropes.size() == 1) {
    if (shape.per_layer.empty()) shape.layer.rope = ropes[0];
    for (auto& l : shape.per_layer) l.rope = ropes[0];
    return ok_status();
  }
  if (ropes.size() != static_cast<size_t>(shape.n_layers))
    return corrupt("container attribute kvq.rope has " + std::to_string(ropes.size()) +
                   " entries for " + std::to_string(shape.n_layers) + " layers");
  if (shape.per_layer.empty())
    shape.per_layer.assign(static_cast<size_t>(shape.n_layers), shape.layer);
  for (size_t i = 0; i < ropes.size(); ++i) shape.per_layer[i].rope = ropes[i];
  return ok_status();
}

// The metadata describing `cache`; checks that it rebuilds a cache with the same layer specs.
Result<ContainerMeta> meta_of(const ModelCache& cache, const ContainerAttributes& attrs) {
  KVQ_RETURN_IF_ERROR(check_attributes(attrs));
  if (attrs.count(kRopeAttribute))
    return invalid_argument("container attribute kvq.rope is reserved for the model's RoPE");
  ContainerMeta m;
  m.major_version = kContainerMajorVersion;
  m.minor_version = kContainerMinorVersion;
  m.kvq_version = KVQ_VERSION_STRING;
  m.method_spec = cache.spec().to_string();
  m.shape.n_layers = cache.shape().n_layers;
  m.shape.layer = cache.shape().layer;
  m.shape.per_layer = cache.shape().per_layer;
  m.attributes = attrs;
  if (const std::string rope = rope_attribute(cache.shape()); !rope.empty())
    m.attributes[kRopeAttribute] = rope;
  m.overrides = cache.model_spec().overrides;
  auto rebuilt = ModelCache::create(cache.spec(), cache.shape(), m.overrides);
  bool same = rebuilt.ok() && rebuilt->n_layers() == cache.n_layers();
  for (int i = 0; same && i < cache.n_layers(); ++i)
    same = rebuilt->layer(i).spec() == cache.layer(i).spec();
  if (!same)
    return unsupported("the cache's per-layer specs cannot be described as '" + m.method_spec +
                       "' plus per-layer overrides, so a loaded file would differ");
  return m;
}

Result<ModelCache> build_cache(ContainerMeta m) {
  if (auto it = m.attributes.find(kRopeAttribute); it != m.attributes.end())
    KVQ_RETURN_IF_ERROR(apply_rope_attribute(it->second, m.shape));
  const std::string name = m.method_spec.substr(0, m.method_spec.find(':'));
  if (!find_method(name)) {
    std::string known;
    for (const auto& def : method_table()) known += (known.empty() ? "" : ", ") + def.name;
    return unsupported("the file's method '" + name +
                       "' is unknown to this kvq (" KVQ_VERSION_STRING "), which knows: " + known);
  }
  auto spec = parse_spec(m.method_spec);
  if (!spec.ok())
    return unsupported(
        "the file's method spec '" + m.method_spec +
        "' is not valid for this kvq (" KVQ_VERSION_STRING "): " + spec.status().message());
  auto cache = ModelCache::create(*spec, m.shape, m.overrides);
  if (!cache.ok())
    return unsupported("the file's model cannot be built: " + cache.status().message());
  return cache;
}

// ---- the parser ----

class Parser {
 public:
  enum class Mode { kLoad, kInspect };
  Parser(const ContainerLimits& limits, Mode mode) : limits_(limits), mode_(mode) {}

  Status on_file_header(const uint8_t* h) { return check_file_header(h, major_, minor_); }

  // A whole record: header h at file offset `offset`, payload and padding at `payload` (P +
  // pad(P) bytes). `stable` payloads outlive the parser (else chunk bytes are copied).
  Status on_record(uint64_t offset, const RecordHeader& h, const uint8_t* payload, bool stable) {
    const uint64_t p = h.size();
    for (uint64_t i = 0, n = pad_of(p); i < n; ++i)
      if (payload[p + i] != 0)
        return corrupt("non-zero padding after record " + type_name(h.type()) + at_offset(offset));
    const bool checksum_ok = xxh(payload, p) == h.checksum();
    const uint32_t type = h.type();
    if (ended_) return corrupt("data after the END record" + at_offset(offset));
    if (!meta_ && type != kMeta)
      return format_error("the first record is " + type_name(type) + ", not META");
    if (type != kChnk && !checksum_ok)
      return corrupt("payload checksum mismatch in record " + type_name(type) + at_offset(offset));
    switch (type) {
      case kMeta:
        return on_meta(offset, payload, p);
      case kChnk:
        return on_chunk(offset, h, payload, stable, checksum_ok);
      case kIndx:
        return on_index(offset, h, payload);
      case kEnd:
        return on_end(offset, h);
      default:
        if (!(h.flags() & kFlagOptional))
          return unsupported("record type '" + type_name(type) + "'" + at_offset(offset) +
                             " is required but unknown to this kvq (" KVQ_VERSION_STRING
                             ", format " +
                             std::to_string(kContainerMajorVersion) + "." +
                             std::to_string(kContainerMinorVersion) + ")");
        if (index_seen_)
          return format_error("optional record" + at_offset(offset) + " after the index");
        skipped_.push_back(type_name(type) + at_offset(offset));
        return ok_status();
    }
  }

  bool ended() const { return ended_; }
  const ContainerMeta* meta() const { return meta_ ? &*meta_ : nullptr; }
  int layers_built() const { return next_build_; }
  std::vector<ContainerChunk>& chunks() { return chunks_; }
  std::vector<std::string>& skipped() { return skipped_; }
  std::optional<ModelCache>& cache() { return cache_; }

 private:
  struct Layer {
    std::vector<ChunkRef> chunks;
    std::vector<std::vector<uint8_t>> owned;
    int64_t batch = -1;
    int phase = 0;  // 0 blocks, 1 after BK, 2 after WK, 3 after WV, 4 complete
    int64_t offset = 0;
    DType wdtype = DType::kF16;
    WindowFormat wformat = WindowFormat::k16Bit;
  };

  Status on_meta(uint64_t offset, const uint8_t* payload, uint64_t p) {
    if (meta_) return format_error("a second META record" + at_offset(offset));
    auto m = decode_meta(payload, p);
    if (!m.ok()) return m.status();
    m->major_version = major_;
    m->minor_version = minor_;
    if (mode_ == Mode::kLoad) {
      auto c = build_cache(*m);
      if (!c.ok()) return c.status();
      cache_.emplace(std::move(*c));
    }
    layers_.resize(static_cast<size_t>(m->shape.n_layers));
    meta_ = std::move(*m);
    return ok_status();
  }

  Status on_chunk(uint64_t offset, const RecordHeader& h, const uint8_t* payload, bool stable,
                  bool checksum_ok) {
    if (index_seen_) return format_error("chunk record" + at_offset(offset) + " after the index");
    if (!checksum_ok && mode_ == Mode::kLoad)
      return corrupt("payload checksum mismatch in chunk" + at_offset(offset));
    const ChunkFields f = decode_chunk_fields(h.fields());
    KVQ_RETURN_IF_ERROR(
        check_chunk_fields(f, static_cast<uint32_t>(meta_->shape.n_layers), offset));
    ContainerChunk cc = to_chunk(f, offset, h.size(), h.checksum());
    cc.checksum_ok = checksum_ok;
    Layer& L = layers_[f.layer];
    const std::string where = "layer " + std::to_string(f.layer) + ": chunk" + at_offset(offset) +
                              " (" + chunk_kind_name(cc.kind) + ")";
    if (L.batch >= 0 && static_cast<uint64_t>(L.batch) != f.batch)
      return corrupt(where + " has batch size " + std::to_string(f.batch) +
                     " but earlier chunks have " + std::to_string(L.batch));
    L.batch = static_cast<int64_t>(f.batch);
    const ChunkRef* prev = L.chunks.empty() ? nullptr : &L.chunks.back();
    const ChunkKind k = cc.kind;
    bool ok = false;
    switch (L.phase) {
      case 0:
        ok = k == ChunkKind::kBlockKeys || k == ChunkKind::kWindowKeys;
        break;
      case 1:
        ok = k == ChunkKind::kBlockValues && prev->t0 == cc.t0 && prev->tokens == cc.tokens;
        break;
      case 2:
        ok = k == ChunkKind::kWindowValues && prev->t0 == cc.t0 && prev->tokens == cc.tokens &&
             dtype_of(f.dtype) == L.wdtype && format_of(f.dtype) == L.wformat;
        break;
      case 3:
        ok = k == ChunkKind::kState && cc.t0 == 0;
        break;
      default:
        break;
    }
    if (!ok) {
      static const char* expected[] = {"block keys or window keys", "the values of the same block",
                                       "window values matching the window keys",
                                       "the state (t0 = 0)", "nothing (the layer is complete)"};
      return corrupt(where + " is out of order: expected " + expected[L.phase]);
    }
    switch (k) {
      case ChunkKind::kBlockKeys:
        L.phase = 1;
        break;
      case ChunkKind::kBlockValues:
        L.phase = 0;
        break;
      case ChunkKind::kWindowKeys:
        L.phase = 2;
        L.wdtype = dtype_of(f.dtype);
        L.wformat = format_of(f.dtype);
        break;
      case ChunkKind::kWindowValues:
        L.phase = 3;
        break;
      case ChunkKind::kState:
        L.phase = 4;
        L.offset = cc.tokens;
        break;
    }
    ChunkRef ref{k, cc.t0, cc.tokens, payload, static_cast<size_t>(h.size())};
    if (mode_ == Mode::kLoad && !stable) {
      L.owned.emplace_back(payload, payload + h.size());
      ref.data = L.owned.back().data();
    }
    if (mode_ == Mode::kInspect) ref.data = nullptr;  // nothing is built from it
    L.chunks.push_back(ref);
    chunks_.push_back(cc);
    if (L.phase == 4) {
      KVQ_RETURN_IF_ERROR(complete_layer(static_cast<int>(f.layer)));
      while (next_build_ < static_cast<int>(layers_.size()) &&
             layers_[static_cast<size_t>(next_build_)].phase == 4) {
        KVQ_RETURN_IF_ERROR(build_layer(next_build_));
        ++next_build_;
      }
    }
    return ok_status();
  }

  // Layer-level checks once a layer's state chunk has arrived (§5).
  Status complete_layer(int l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    const std::string where = "layer " + std::to_string(l) + ": ";
    const LayerShape& s = meta_->shape.at(l);
    const int64_t offset = L.offset;
    const size_t nc = L.chunks.size();
    const ChunkRef& wk = L.chunks[nc - 3];
    for (const ChunkRef& c : L.chunks)
      if (c.t0 + c.tokens > offset)
        return corrupt(where + chunk_kind_name(c.kind) + " chunk covers tokens [" +
                       std::to_string(c.t0) + ", " + std::to_string(c.t0 + c.tokens) +
                       ") beyond the " + std::to_string(offset) + " tokens held");
    if (wk.t0 + wk.tokens != offset)
      return corrupt(where + "the window covers [" + std::to_string(wk.t0) + ", " +
                     std::to_string(wk.t0 + wk.tokens) + ") but the layer holds " +
                     std::to_string(offset) + " tokens");
    // Window bytes = B * H * n rows (up to 2^72: an overflow cannot match any real size).
    uint64_t want = 0;
    const bool fits =
        product(&want, {static_cast<uint64_t>(L.batch), static_cast<uint64_t>(s.n_kv_heads),
                        static_cast<uint64_t>(wk.tokens),
                        static_cast<uint64_t>(window_row_bytes(L.wformat, s.head_dim))});
    for (const ChunkRef* w : {&wk, static_cast<const ChunkRef*>(&L.chunks[nc - 2])})
      if (!fits || w->size != want)
        return corrupt(
            where + chunk_kind_name(w->kind) + " holds " + std::to_string(w->size) +
            " bytes; [B=" + std::to_string(L.batch) + ", H=" + std::to_string(s.n_kv_heads) +
            ", n=" + std::to_string(wk.tokens) + ", D=" + std::to_string(s.head_dim) + "] " +
            (L.wformat == WindowFormat::kQ8 ? "q8 rows" : "16-bit") + " needs more or fewer");
    if (L.batch == 0 && (nc != 3 || offset != 0))
      return corrupt(where + "batch size 0 (never appended) but it holds tokens or blocks");
    uint64_t elems = 0;
    if (!product(&elems, {2, static_cast<uint64_t>(L.batch), static_cast<uint64_t>(s.n_kv_heads),
                          static_cast<uint64_t>(offset), static_cast<uint64_t>(s.head_dim)}) ||
        __builtin_add_overflow(elements_, elems, &elements_) || elements_ > limits_.max_elements)
      return limit_exceeded(where + "the file represents more than " +
                            std::to_string(limits_.max_elements) +
                            " K/V elements, the reader's limit");
    return ok_status();
  }

  Status build_layer(int l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    if (mode_ == Mode::kLoad) {
      LayerCache& layer = cache_->layer(l);
      // The row format follows from the layer's spec; a chunk that says otherwise is damaged.
      if (L.wformat != layer.window_format())
        return corrupt("layer " + std::to_string(l) + ": window chunks hold " +
                       (L.wformat == WindowFormat::kQ8 ? "q8" : "16-bit") +
                       " rows but the layer's spec holds " +
                       (layer.window_format() == WindowFormat::kQ8 ? "q8" : "16-bit") + " rows");
      if (L.batch == 0) {
        // A layer that never received a token: its chunks must be what a fresh layer exports.
        struct Collect final : ChunkSink {
          std::vector<std::pair<ChunkRef, std::vector<uint8_t>>> got;
          Status put(const ChunkRef& c) override {
            got.emplace_back(c, std::vector<uint8_t>(c.data, c.data + c.size));
            return ok_status();
          }
        } fresh;
        KVQ_RETURN_IF_ERROR(layer.export_tail(fresh));
        bool same = fresh.got.size() == L.chunks.size() && L.wdtype == layer.window_dtype();
        for (size_t i = 0; same && i < L.chunks.size(); ++i) {
          const ChunkRef& a = L.chunks[i];
          const ChunkRef& b = fresh.got[i].first;
          same = a.kind == b.kind && a.t0 == b.t0 && a.tokens == b.tokens && a.size == b.size &&
                 (a.size == 0 || std::memcmp(a.data, fresh.got[i].second.data(), a.size) == 0);
        }
        if (!same)
          return corrupt("layer " + std::to_string(l) +
                         ": batch size 0 but its chunks are not those of an empty layer");
      } else {
        Status st = layer.import_chunks(L.chunks, L.batch, L.offset, L.wdtype);
        if (!st.ok()) {
          // The method's own checks: report them as corruption of this file, whatever code.
          const ErrorCode c = st.code() == ErrorCode::kLimit || st.code() == ErrorCode::kUnsupported
                                  ? st.code()
                                  : ErrorCode::kCorrupt;
          return Status(c, "layer " + std::to_string(l) + ": " + st.message());
        }
      }
    }
    L.chunks = {};
    L.owned = {};
    return ok_status();
  }

  Status on_index(uint64_t offset, const RecordHeader& h, const uint8_t* payload) {
    if (index_seen_) return format_error("a second INDX record" + at_offset(offset));
    for (size_t l = 0; l < layers_.size(); ++l)
      if (layers_[l].phase != 4)
        return corrupt("the index" + at_offset(offset) + " comes before layer " +
                       std::to_string(l) + " is complete (its state chunk is missing)");
    const uint64_t n = load<uint64_t>(h.fields());
    if (n != chunks_.size() || h.size() != n * kIndexEntryBytes)
      return corrupt("the index lists " + std::to_string(n) + " chunks in " +
                     std::to_string(h.size()) + " bytes; the file has " +
                     std::to_string(chunks_.size()) + " chunk records");
    for (size_t i = 0; i < chunks_.size(); ++i) {
      const ContainerChunk& c = chunks_[i];
      ChunkFields f;
      f.layer = static_cast<uint32_t>(c.layer);
      f.kind = static_cast<uint8_t>(c.kind);
      f.dtype = is_window(c.kind) ? dtype_code(c.dtype, c.window_format) : kDtypeNone;
      f.t0 = static_cast<uint64_t>(c.t0);
      f.tokens = static_cast<uint64_t>(c.tokens);
      if (!index_entry_matches(payload + i * kIndexEntryBytes, c.record_offset, f, c.size,
                               c.checksum))
        return corrupt("index entry " + std::to_string(i) + " does not match the chunk record" +
                       at_offset(c.record_offset));
    }
    index_seen_ = true;
    index_offset_ = offset;
    return ok_status();
  }

  Status on_end(uint64_t offset, const RecordHeader& h) {
    if (!index_seen_) return format_error("END record" + at_offset(offset) + " before the index");
    if (h.size() != 0) return corrupt("END record with a payload");
    const uint8_t* f = h.fields();
    if (load<uint64_t>(f) != index_offset_ || load<uint64_t>(f + 8) != chunks_.size() ||
        load<uint64_t>(f + 16) != offset + kHeaderBytes)
      return corrupt("END record" + at_offset(offset) + " disagrees with the file (index offset " +
                     std::to_string(load<uint64_t>(f)) + ", " +
                     std::to_string(load<uint64_t>(f + 8)) + " chunks, size " +
                     std::to_string(load<uint64_t>(f + 16)) + ")");
    if (mode_ == Mode::kLoad) KVQ_CHECK(next_build_ == static_cast<int>(layers_.size()));
    ended_ = true;
    return ok_status();
  }

  ContainerLimits limits_;
  Mode mode_;
  uint16_t major_ = 0, minor_ = 0;
  std::optional<ContainerMeta> meta_;
  std::optional<ModelCache> cache_;
  std::vector<Layer> layers_;
  std::vector<ContainerChunk> chunks_;
  std::vector<std::string> skipped_;
  uint64_t elements_ = 0;
  int next_build_ = 0;
  bool index_seen_ = false, ended_ = false;
  uint64_t index_offset_ = 0;
};

// Runs the parser over a whole file in memory.
Status walk(const uint8_t* data, size_t size, Parser& p, const ContainerLimits& limits) {
  KVQ_RETURN_IF_ERROR(check_magic(data, size));
  if (size < kHeaderBytes)
    return corrupt("truncated: a .kvq file of " + std::to_string(size) + " bytes");
  KVQ_RETURN_IF_ERROR(p.on_file_header(data));
  uint64_t pos = kHeaderBytes;
  while (!p.ended()) {
    if (size - pos < kHeaderBytes)
      return corrupt("truncated: the file ends" + at_offset(size) + " without an END record");
    RecordHeader h;
    KVQ_RETURN_IF_ERROR(decode_record_header(data + pos, pos, h));
    KVQ_RETURN_IF_ERROR(check_record_size(h, pos, size - pos - kHeaderBytes, limits));
    KVQ_RETURN_IF_ERROR(p.on_record(pos, h, data + pos + kHeaderBytes, true));
    pos += kHeaderBytes + h.size() + pad_of(h.size());
  }
  if (pos != size)
    return corrupt(std::to_string(size - pos) + " bytes after the END record" + at_offset(pos));
  return ok_status();
}

class FnSink final : public ChunkSink {
 public:
  explicit FnSink(std::function<Status(const ChunkRef&)> fn) : fn_(std::move(fn)) {}
  Status put(const ChunkRef& c) override { return fn_(c); }

 private:
  std::function<Status(const ChunkRef&)> fn_;
};

std::string fingerprint(const ModelCache& cache) {
  std::string s = cache.spec().to_string();
  for (int i = 0; i < cache.n_layers(); ++i) {
    const LayerShape& l = cache.shape().at(i);
    s += "|" + std::to_string(l.n_kv_heads) + "," + std::to_string(l.head_dim) + "," +
         std::to_string(l.n_q_heads) + ":" + cache.layer(i).spec().to_string();
  }
  return s;
}

}  // namespace

// ---- writer ----

Status VectorByteSink::write(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  bytes.insert(bytes.end(), p, p + size);
  return ok_status();
}

Status FdByteSink::write(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(std::string("cannot write the container stream: ") + std::strerror(errno));
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return ok_status();
}

struct AtomicFileByteSink::Impl {
  AtomicFileWriter writer;
};

AtomicFileByteSink::AtomicFileByteSink(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
AtomicFileByteSink::~AtomicFileByteSink() = default;

Result<std::unique_ptr<AtomicFileByteSink>> AtomicFileByteSink::open(const std::string& path) {
  KVQ_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::open(path));
  return std::unique_ptr<AtomicFileByteSink>(
      new AtomicFileByteSink(std::make_unique<Impl>(Impl{std::move(w)})));
}

Status AtomicFileByteSink::write(const void* data, size_t size) {
  return impl_->writer.write(data, size);
}
Status AtomicFileByteSink::close() { return impl_->writer.commit(); }

Result<ContainerWriter> ContainerWriter::start(const ModelCache& cache, ByteSink& out,
                                               const ContainerAttributes& attributes) {
  KVQ_ASSIGN_OR_RETURN(ContainerMeta meta, meta_of(cache, attributes));
  ContainerWriter w(out, cache.n_layers());
  w.meta_fingerprint_ = fingerprint(cache);
  uint8_t h[kHeaderBytes];
  encode_file_header(h);
  KVQ_RETURN_IF_ERROR(out.write(h, sizeof h));
  w.pos_ = kHeaderBytes;
  const std::vector<uint8_t> payload = encode_meta(meta);
  if (payload.size() > kMaxMetaBytes) return invalid_argument("container metadata exceeds 16 MiB");
  encode_record_header(h, kMeta, 0, payload.size(), xxh(payload.data(), payload.size()), nullptr);
  KVQ_RETURN_IF_ERROR(w.write_record(h, payload.data(), payload.size()));
  w.written_batch_.assign(static_cast<size_t>(cache.n_layers()), 0);
  return w;
}

Status ContainerWriter::check_cache(const ModelCache& cache) const {
  if (finished_) return invalid_argument("the container stream is already finished");
  if (failed_) return io_error("the container stream failed earlier; its output is incomplete");
  if (fingerprint(cache) != meta_fingerprint_)
    return invalid_argument(
        "the cache's spec or shape differs from the one the container stream started with");
  return ok_status();
}

Status ContainerWriter::write_record(const uint8_t header[64], const uint8_t* payload,
                                     uint64_t size) {
  static const uint8_t zeros[kContainerAlignment] = {};
  Status st = out_->write(header, kHeaderBytes);
  if (st.ok() && size) st = out_->write(payload, size);
  if (st.ok() && pad_of(size)) st = out_->write(zeros, pad_of(size));
  if (!st.ok()) {
    failed_ = true;
    return st;
  }
  pos_ += kHeaderBytes + size + pad_of(size);
  return ok_status();
}

Status ContainerWriter::write_chunk(int layer, int64_t batch, DType wdtype, WindowFormat wformat,
                                    const ChunkRef& c) {
  ChunkFields f;
  f.layer = static_cast<uint32_t>(layer);
  f.kind = static_cast<uint8_t>(c.kind);
  f.dtype = is_window(c.kind) ? dtype_code(wdtype, wformat) : kDtypeNone;
  f.t0 = static_cast<uint64_t>(c.t0);
  f.tokens = static_cast<uint64_t>(c.tokens);
  f.batch = static_cast<uint64_t>(batch);
  uint8_t fields[32], h[kHeaderBytes];
  encode_chunk_fields(fields, f);
  const uint64_t sum = xxh(c.data, c.size);
  encode_record_header(h, kChnk, 0, c.size, sum, fields);
  index_.push_back(IndexEntry{pos_, f.layer, f.kind, f.dtype, c.t0, c.tokens, c.size, sum});
  return write_record(h, c.data, c.size);
}

Status ContainerWriter::write_new_blocks(const ModelCache& cache) {
  KVQ_RETURN_IF_ERROR(check_cache(cache));
  for (int l = 0; l < cache.n_layers(); ++l) {
    const LayerCache& layer = cache.layer(l);
    int64_t& done = written_blocks_[static_cast<size_t>(l)];
    const int64_t n = layer.n_blocks();
    if (n < done || (done > 0 && layer.batch() != written_batch_[static_cast<size_t>(l)]))
      return invalid_argument(
          "layer " + std::to_string(l) + " no longer holds the " + std::to_string(done) +
          " blocks already streamed (trimmed or reset); a stream cannot take chunks back");
    if (n == done) continue;
    const int64_t batch = layer.batch();
    FnSink sink([&](const ChunkRef& c) {
      return write_chunk(l, batch, layer.window_dtype(), layer.window_format(), c);
    });
    KVQ_RETURN_IF_ERROR(layer.export_blocks(done, sink));
    done = n;
    written_batch_[static_cast<size_t>(l)] = batch;
  }
  return ok_status();
}

Status ContainerWriter::finish(const ModelCache& cache) {
  KVQ_RETURN_IF_ERROR(write_new_blocks(cache));
  for (int l = 0; l < cache.n_layers(); ++l) {
    const LayerCache& layer = cache.layer(l);
    const int64_t batch = layer.batch();
    FnSink sink([&](const ChunkRef& c) {
      return write_chunk(l, batch, layer.window_dtype(), layer.window_format(), c);
    });
    KVQ_RETURN_IF_ERROR(layer.export_tail(sink));
  }
  std::vector<uint8_t> index(index_.size() * kIndexEntryBytes);
  for (size_t i = 0; i < index_.size(); ++i) {
    const IndexEntry& e = index_[i];
    ChunkFields f;
    f.layer = e.layer;
    f.kind = e.kind;
    f.dtype = e.dtype;
    f.t0 = static_cast<uint64_t>(e.t0);
    f.tokens = static_cast<uint64_t>(e.tokens);
    encode_index_entry(index.data() + i * kIndexEntryBytes, e.offset, f, e.size, e.checksum);
  }
  uint8_t fields[32] = {}, h[kHeaderBytes];
  store<uint64_t>(fields, index_.size());
  encode_record_header(h, kIndx, 0, index.size(), xxh(index.data(), index.size()), fields);
  const uint64_t index_offset = pos_;
  KVQ_RETURN_IF_ERROR(write_record(h, index.data(), index.size()));
  std::memset(fields, 0, sizeof fields);
  store<uint64_t>(fields, index_offset);
  store<uint64_t>(fields + 8, index_.size());
  store<uint64_t>(fields + 16, pos_ + kHeaderBytes);
  encode_record_header(h, kEnd, 0, 0, xxh(nullptr, 0), fields);
  KVQ_RETURN_IF_ERROR(write_record(h, nullptr, 0));
  finished_ = true;
  Status st = out_->close();
  if (!st.ok()) failed_ = true;
  return st;
}

Result<std::vector<uint8_t>> serialize_cache(const ModelCache& cache,
                                             const ContainerAttributes& attributes) {
  VectorByteSink out;
  KVQ_ASSIGN_OR_RETURN(ContainerWriter w, ContainerWriter::start(cache, out, attributes));
  // Layer by layer: all of a layer's blocks, then (in finish) every layer's tail.
  KVQ_RETURN_IF_ERROR(w.finish(cache));
  return std::move(out.bytes);
}

Status save_cache(const ModelCache& cache, const std::string& path,
                  const ContainerAttributes& attributes) {
  KVQ_ASSIGN_OR_RETURN(auto sink, AtomicFileByteSink::open(path));
  KVQ_ASSIGN_OR_RETURN(ContainerWriter w, ContainerWriter::start(cache, *sink, attributes));
  return w.finish(cache).with_context("writing '" + path + "'");
}

// ---- whole-file reading ----

Result<ModelCache> parse_cache(const uint8_t* data, size_t size, const ContainerLimits& limits) {
  Parser p(limits, Parser::Mode::kLoad);
  KVQ_RETURN_IF_ERROR(walk(data, size, p, limits));
  return std::move(*p.cache());
}

Result<ModelCache> load_cache(const std::string& path, const ContainerLimits& limits) {
  KVQ_ASSIGN_OR_RETURN(auto bytes, read_file(path));
  auto r = parse_cache(bytes.data(), bytes.size(), limits);
  if (!r.ok()) return r.status().with_context(path);
  return r;
}

bool ContainerInfo::checksums_ok() const {
  return std::all_of(chunks.begin(), chunks.end(),
                     [](const ContainerChunk& c) { return c.checksum_ok; });
}

Result<ContainerInfo> inspect_container(const uint8_t* data, size_t size,
                                        const ContainerLimits& limits) {
  Parser p(limits, Parser::Mode::kInspect);
  KVQ_RETURN_IF_ERROR(walk(data, size, p, limits));
  ContainerInfo info;
  info.meta = *p.meta();
  info.chunks = std::move(p.chunks());
  info.skipped = std::move(p.skipped());
  info.file_size = size;
  return info;
}

// ---- streaming reader ----

struct ContainerReader::Impl {
  explicit Impl(const ContainerLimits& l) : limits(l), parser(l, Parser::Mode::kLoad) {}
  Status step();

  ContainerLimits limits;
  Parser parser;
  Status error;
  std::vector<uint8_t> buf;  // unconsumed input, from buf[head]
  size_t head = 0;
  uint64_t file_pos = 0;  // file offset of buf[head]
  uint64_t received = 0;
  bool have_file_header = false;
  bool have_record_header = false;
  RecordHeader record;
  bool taken = false;
};

// Consumes as many complete units (file header, records) as the buffer holds.
Status ContainerReader::Impl::step() {
  while (true) {
    const size_t avail = buf.size() - head;
    const uint8_t* p = buf.data() + head;
    if (!have_file_header) {
      KVQ_RETURN_IF_ERROR(check_magic(p, avail));
      if (avail < kHeaderBytes) return ok_status();
      KVQ_RETURN_IF_ERROR(parser.on_file_header(p));
      have_file_header = true;
      head += kHeaderBytes;
      file_pos += kHeaderBytes;
      continue;
    }
    if (parser.ended()) {
      if (avail) return corrupt("bytes after the END record" + at_offset(file_pos));
      return ok_status();
    }
    if (!have_record_header) {
      if (avail < kHeaderBytes) break;
      KVQ_RETURN_IF_ERROR(decode_record_header(p, file_pos, record));
      KVQ_RETURN_IF_ERROR(check_record_size(record, file_pos, UINT64_MAX, limits));
      have_record_header = true;
    }
    const uint64_t need = kHeaderBytes + record.size() + pad_of(record.size());
    if (avail < need) break;
    KVQ_RETURN_IF_ERROR(parser.on_record(file_pos, record, p + kHeaderBytes, false));
    have_record_header = false;
    head += need;
    file_pos += need;
  }
  // Drop consumed bytes once they dominate the buffer (amortized O(1) per byte).
  if (head > 0 && head >= buf.size() / 2) {
    buf.erase(buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(head));
    head = 0;
  }
  return ok_status();
}

ContainerReader::ContainerReader(const ContainerLimits& limits)
    : impl_(std::make_unique<Impl>(limits)) {}
ContainerReader::~ContainerReader() = default;
ContainerReader::ContainerReader(ContainerReader&&) noexcept = default;
ContainerReader& ContainerReader::operator=(ContainerReader&&) noexcept = default;

Status ContainerReader::feed(const uint8_t* data, size_t size) {
  Impl& s = *impl_;
  if (!s.error.ok()) return s.error;
  if (size > s.limits.max_stream_bytes - std::min(s.received, s.limits.max_stream_bytes)) {
    s.error = limit_exceeded("the container stream exceeds the reader's limit of " +
                             std::to_string(s.limits.max_stream_bytes) + " bytes");
    return s.error;
  }
  s.received += size;
  if (s.parser.ended() && size) {
    s.error = corrupt("bytes after the END record" + at_offset(s.file_pos));
    return s.error;
  }
  s.buf.insert(s.buf.end(), data, data + size);
  s.error = s.step();
  return s.error;
}

Status ContainerReader::finish() {
  Impl& s = *impl_;
  if (!s.error.ok()) return s.error;
  if (!s.parser.ended()) {
    s.error = corrupt("truncated: the stream ended after " + std::to_string(s.received) +
                      " bytes, before the END record");
  }
  return s.error;
}

bool ContainerReader::done() const { return impl_->error.ok() && impl_->parser.ended(); }
uint64_t ContainerReader::bytes_consumed() const { return impl_->file_pos; }
const ContainerMeta* ContainerReader::meta() const { return impl_->parser.meta(); }
int ContainerReader::layers_ready() const { return impl_->parser.layers_built(); }

Result<ModelCache> ContainerReader::take() {
  if (!done()) return invalid_argument("the container stream is not complete");
  if (impl_->taken) return invalid_argument("the cache was already taken from this reader");
  impl_->taken = true;
  return std::move(*impl_->parser.cache());
}

Result<ContainerReader> read_container_fd(int fd, const ReadFdOptions& options) {
  ContainerReader reader(options.limits);
  std::vector<uint8_t> buf(size_t{1} << 20);
  auto idle_since = std::chrono::steady_clock::now();
  while (true) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error(std::string("cannot read the container stream: ") + std::strerror(errno));
    }
    if (n > 0) {
      KVQ_RETURN_IF_ERROR(reader.feed(buf.data(), static_cast<size_t>(n)));
      idle_since = std::chrono::steady_clock::now();
      if (options.follow && reader.done()) break;
      continue;
    }
    // End of file: a pipe is finished; a followed file may still grow.
    if (!options.follow || reader.done()) break;
    const auto idle = std::chrono::steady_clock::now() - idle_since;
    if (idle > std::chrono::milliseconds(options.idle_timeout_ms)) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(options.poll_interval_ms));
  }
  KVQ_RETURN_IF_ERROR(reader.finish());
  return reader;
}

// ---- random access ----

Result<ContainerView> ContainerView::open(const uint8_t* data, size_t size,
                                          const ContainerLimits& limits) {
  KVQ_RETURN_IF_ERROR(check_magic(data, size));
  if (size < 3 * kHeaderBytes || size % kContainerAlignment != 0)
    return corrupt("truncated: a .kvq file of " + std::to_string(size) + " bytes");
  uint16_t major, minor;
  KVQ_RETURN_IF_ERROR(check_file_header(data, major, minor));
  // END: the last 64 bytes.
  const uint64_t end_off = size - kHeaderBytes;
  RecordHeader end;
  KVQ_RETURN_IF_ERROR(decode_record_header(data + end_off, end_off, end));
  if (end.type() != kEnd || end.size() != 0)
    return corrupt("truncated or damaged: the last 64 bytes are not an END record");
  const uint64_t index_off = load<uint64_t>(end.fields()),
                 n_chunks = load<uint64_t>(end.fields() + 8);
  if (load<uint64_t>(end.fields() + 16) != size)
    return corrupt("the END record gives a file size of " +
                   std::to_string(load<uint64_t>(end.fields() + 16)) + ", the file has " +
                   std::to_string(size) + " bytes");
  if (index_off % kContainerAlignment || index_off < 2 * kHeaderBytes ||
      index_off > end_off - kHeaderBytes)
    return corrupt("the END record points to an index" + at_offset(index_off) +
                   " outside the file");
  RecordHeader idx;
  KVQ_RETURN_IF_ERROR(decode_record_header(data + index_off, index_off, idx));
  if (idx.type() != kIndx) return corrupt("no INDX record" + at_offset(index_off));
  KVQ_RETURN_IF_ERROR(
      check_record_size(idx, index_off, end_off - index_off - kHeaderBytes, limits));
  if (load<uint64_t>(idx.fields()) != n_chunks || idx.size() != n_chunks * kIndexEntryBytes ||
      index_off + kHeaderBytes + idx.size() + pad_of(idx.size()) != end_off)
    return corrupt("the index and the END record disagree");
  const uint8_t* entries = data + index_off + kHeaderBytes;
  if (xxh(entries, idx.size()) != idx.checksum()) return corrupt("index checksum mismatch");
  // META at offset 64.
  RecordHeader mh;
  KVQ_RETURN_IF_ERROR(decode_record_header(data + kHeaderBytes, kHeaderBytes, mh));
  if (mh.type() != kMeta)
    return format_error("the first record is " + type_name(mh.type()) + ", not META");
  KVQ_RETURN_IF_ERROR(check_record_size(mh, kHeaderBytes, index_off - 2 * kHeaderBytes, limits));
  const uint8_t* mp = data + 2 * kHeaderBytes;
  if (xxh(mp, mh.size()) != mh.checksum())
    return corrupt("payload checksum mismatch in record META");
  KVQ_ASSIGN_OR_RETURN(ContainerMeta meta, decode_meta(mp, mh.size()));
  meta.major_version = major;
  meta.minor_version = minor;

  ContainerView v;
  v.data_ = data;
  v.size_ = size;
  v.meta_ = std::move(meta);
  uint64_t next_free = 2 * kHeaderBytes + mh.size() + pad_of(mh.size());
  for (uint64_t i = 0; i < n_chunks; ++i) {
    const uint8_t* e = entries + i * kIndexEntryBytes;
    const uint64_t off = load<uint64_t>(e);
    if (off % kContainerAlignment || off < next_free || off > index_off - kHeaderBytes)
      return corrupt("index entry " + std::to_string(i) + " points" + at_offset(off) +
                     ", not to an aligned record after the previous one");
    RecordHeader h;
    KVQ_RETURN_IF_ERROR(decode_record_header(data + off, off, h));
    if (h.type() != kChnk)
      return corrupt("index entry " + std::to_string(i) + " points to a " + type_name(h.type()) +
                     " record");
    KVQ_RETURN_IF_ERROR(check_record_size(h, off, index_off - off - kHeaderBytes, limits));
    const ChunkFields f = decode_chunk_fields(h.fields());
    KVQ_RETURN_IF_ERROR(check_chunk_fields(f, static_cast<uint32_t>(v.meta_.shape.n_layers), off));
    if (!index_entry_matches(e, off, f, h.size(), h.checksum()))
      return corrupt("index entry " + std::to_string(i) + " does not match the chunk record" +
                     at_offset(off));
    v.chunks_.push_back(to_chunk(f, off, h.size(), h.checksum()));
    next_free = off + kHeaderBytes + h.size() + pad_of(h.size());
  }
  return v;
}

Result<ChunkRef> ContainerView::chunk(size_t i) const {
  if (i >= chunks_.size())
    return out_of_range("chunk " + std::to_string(i) + " of " + std::to_string(chunks_.size()));
  const ContainerChunk& c = chunks_[i];
  const uint8_t* p = data_ + c.record_offset + kHeaderBytes;
  if (xxh(p, c.size) != c.checksum)
    return corrupt("payload checksum mismatch in chunk" + at_offset(c.record_offset));
  return ChunkRef{c.kind, c.t0, c.tokens, p, static_cast<size_t>(c.size)};
}

}  // namespace kvq
