// CacheGen (Liu et al., SIGCOMM 2024, arXiv 2310.07240) as a kvq method: group quantization whose
// codes are delta-transformed along tokens and entropy coded (src/entropy: static per-channel
// tables, interleaved rANS), in chunks of `chunk` tokens that decode independently. VeloxQuant-MLX
// (`001_69901d89729a9374.txt`) only estimated the coded size; here every byte is real and held.
//
// Numerics: src/numerics/cachegen.h (quantization, deltas, layer schedule). Keys are quantized
// per channel over runs of `group` tokens; values per token over runs of `group` channels
// (values=token, KIVI's grouping) or like the keys (values=channel, VeloxQuant-MLX's). The entropy stage
// is lossless: what the model sees is exactly the group quantization's reconstruction.
//
// Resident form: sealed chunks are held *coded* and decoded on demand (dequant_keys/values, which
// read() and attend() call per block), so the compression is real in memory; the stored layout
// below is also the transfer form (export_blocks streams it as chunks are sealed).
//
// Depth schedule: the per-model builder gives layer l of L the bits
//   layer_bits(l, L, bits, layer_groups) = min(bits, max(2, bits - floor(l * layer_groups / L)))
// (VeloxQuant-MLX's base, base-1, ... over contiguous depth groups). The layer's spec() keeps the
// spec's own `bits`; stats() reports the effective width.
//
// Stored layout of one block (tokens [i*T, (i+1)*T), T = chunk, S = B * H streams, D = head_dim).
// The key part, then the value part, each:
//   tables   only in block 0 with tables=shared: u32 LE byte length + entropy::serialize_tables()
//            of the part's prototype set (<= 16 tables, every symbol covered, docs/entropy.md §3),
//            clustered from the per-channel histograms of block 0's symbols (all b and h). Every
//            stream of the layer's part may use them (naming a prototype per channel, 4 bits
//            each, in its stream); they are billed here, once.
//   params   S x P x {scale, zero} fp16; keys: P = (T / group) * D ([T/group, D] per stream);
//            values=token: P = T * ceil(D / group) ([T, ceil(D/group)]); values=channel: as keys.
//   masks    delta=auto only: S x ceil(D / 8) bytes, stream s's channel mask (bit d set =
//            channel d token-delta coded; numerics/cachegen.h). Unused high bits are 0.
//   index    S x u32 LE: end offset of stream s, counted from the start of the streams region
//            (non-decreasing; the last one is the region's size).
//   streams  S entropy streams (entropy/symbol_codec.h, format in docs/entropy.md §1), stream
//            s = b * H + h: the delta symbols of that stream's codes, [T, D] token-major with D
//            channels (the coder codes them channel-major, one table per channel or per stream).
// Accounting: key_codes / value_codes = stream payloads (rANS states and words, packed raw
// symbols, constant symbols); meta = stream headers + inline tables + masks + index + shared
// tables; params = fp16 pairs. Their sum is the block's buffer size (resident == accounted).
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/codec.h"
#include "core/byte_io.h"
#include "entropy/cachegen_codes.h"
#include "entropy/symbol_codec.h"
#include "kvq/bitpack.h"
#include "kvq/group_quant.h"
#include "kvq/spec.h"

namespace kvq {

namespace {

using cachegen::Axis;
using cachegen::DeltaMode;

enum class Tables { kChannel, kPooled, kAuto, kShared };

struct CgConfig {
  int bits = 4;  // effective (after the depth schedule)
  int64_t group = 128, chunk = 128, residual = 128;
  DeltaMode delta = DeltaMode::kAuto;
  Tables tables = Tables::kShared;
  Axis v_axis = Axis::kToken;
};

DeltaMode parse_delta(const std::string& s) {
  return s == "none"     ? DeltaMode::kNone
         : s == "token"  ? DeltaMode::kToken
         : s == "group"  ? DeltaMode::kGroup
         : s == "anchor" ? DeltaMode::kAnchor
                         : DeltaMode::kAuto;
}

Tables parse_tables(const std::string& s) {
  return s == "channel"  ? Tables::kChannel
         : s == "pooled" ? Tables::kPooled
         : s == "auto"   ? Tables::kAuto
                         : Tables::kShared;
}

CgConfig config_from(const Spec& s, int bits) {
  CgConfig c;
  c.bits = bits;
  c.group = s.get_int("group");
  c.chunk = s.get_int("chunk");
  c.residual = s.get_int("residual");
  c.delta = parse_delta(s.get_enum("delta"));
  c.tables = parse_tables(s.get_enum("tables"));
  c.v_axis = s.get_enum("values") == "token" ? Axis::kToken : Axis::kChannel;
  return c;
}

// Prototype tables per part and layer for tables=shared: on real KV 16 captured what 64 did
// (docs/methods/cachegen.md); every stream spends 4 bits per channel naming its prototypes.
constexpr int kPrototypes = 16;

entropy::SymbolCodecOptions codec_options(const CgConfig& c) {
  entropy::SymbolCodecOptions o;
  // Tables at most 2^7 fine: every stream then decodes on the slot-table path (docs/entropy.md
  // §2), and on real KV the finer pooled tables (2^9 at 128 tokens) cost more table bits than
  // they saved (docs/methods/cachegen.md).
  o.prob_bits = entropy::kLutMaxProbBits;
  o.stats_shannon = false;
  // With the layer's prototypes, streams are prototype-coded, raw or constant: building inline
  // tables as well never won on real KV (identical sizes in docs/methods/cachegen.md) and is the
  // slowest part of encoding.
  o.inline_tables = c.tables != Tables::kShared;
  o.layout = c.tables == Tables::kPooled ? entropy::TableLayout::kPooled
             : c.tables == Tables::kAuto ? entropy::TableLayout::kAuto
                                         : entropy::TableLayout::kPerChannel;
  return o;
}

// Byte accounting of one block part by kind (stats() sums them; bytes() bills their sum).
struct Acct {
  uint64_t codes = 0;      // stream payloads
  uint64_t params = 0;     // fp16 pairs
  uint64_t headers = 0;    // stream mode/precision bytes
  uint64_t tables = 0;     // inline tables, or a stream's shared-table indices
  uint64_t index = 0;      // stream index + channel masks
  uint64_t shared = 0;     // shared table sets (block 0 only)
  uint64_t modes[4] = {};  // streams per entropy::StreamMode
  uint64_t meta() const { return headers + tables + index + shared; }
  void add(entropy::StreamMode m, uint64_t header, uint64_t table, uint64_t payload) {
    headers += header;
    tables += table;
    codes += payload;
    ++modes[static_cast<int>(m)];
  }
  void operator+=(const Acct& o) {
    codes += o.codes, params += o.params, headers += o.headers, tables += o.tables;
    index += o.index, shared += o.shared;
    for (int m = 0; m < 4; ++m) modes[m] += o.modes[m];
  }
};

// Where the regions of one part start (see the stored layout above).
struct PartLayout {
  size_t params_at = 0, masks_at = 0, index_at = 0, streams_at = 0;
};

// The prototype sets of a layer (tables=shared) in their prepared forms, parsed from block 0's
// parts: derived from the held bytes, never billed twice.
struct LayerTables {
  std::optional<entropy::SharedTables> decode[2];  // per part
  std::optional<entropy::SharedTables> encode[2];
};

class CgCodec final : public BlockCodec {
 public:
  CgCodec(const Spec& spec, const LayerShape& shape, int bits)
      : BlockCodec(spec, shape, spec.get_int("chunk"), spec.get_int("residual")),
        c_(config_from(spec, bits)) {}
  std::unique_ptr<BlockCodec> clone(CloneMemo&) const override {
    auto c = std::make_unique<CgCodec>(*this);
    c->pending_.reset();
    c->pending_acct_.clear();
    return c;
  }

  SealedBlock encode(int64_t index, const BlockGeometry& g, const float* k, const float* v,
                     Workspace& ws) override {
    const bool shared = c_.tables == Tables::kShared;
    std::vector<uint8_t> table_bytes[2];
    if (shared && index == 0) {
      build_tables(g, k, v, table_bytes, ws);
      for (int part = 0; part < 2; ++part) {
        auto t = entropy::deserialize_tables(table_bytes[part].data(), table_bytes[part].size());
        KVQ_CHECK(t.ok());
        auto m = entropy::make_shared_tables(std::move(*t), entropy::RansModelUse::kBoth);
        KVQ_CHECK(m.ok());
        tables_.encode[part].emplace(*m);
        tables_.decode[part].emplace(std::move(*m));
      }
    }
    auto data = std::make_shared<BlockData>();
    std::array<Acct, 2> acct;
    for (int part = 0; part < 2; ++part) {
      const entropy::SharedTables* st = nullptr;
      if (shared) {
        if (!tables_.encode[part]) {  // imported block 0: prepare the encoder's form once
          KVQ_CHECK(tables_.decode[part].has_value());
          tables_.encode[part].emplace(encoder_tables(*tables_.decode[part]));
        }
        st = &*tables_.encode[part];
      }
      Buffer& out = part == 0 ? data->keys : data->values;
      out = encode_part(part, g, part == 0 ? k : v, st,
                        index == 0 && shared ? &table_bytes[part] : nullptr, acct[part], ws);
    }
    acct_.push_back(acct);
    return {std::move(data), to_bytes(acct)};
  }

  void decode(const BlockData& blk, int64_t index, bool keys, int64_t b, int64_t h,
              const BlockGeometry& g, float* out, Workspace& ws) const override {
    Workspace::Frame frame(ws);
    const int part = keys ? 0 : 1;
    const int64_t T = g.tokens, D = g.dim, s = b * g.heads + h;
    const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
    const Buffer& buf = keys ? blk.keys : blk.values;
    const PartLayout L = layout(index, part, g, buf.data());
    uint32_t begin = 0, end;
    if (s > 0) std::memcpy(&begin, buf.data() + L.index_at + 4 * static_cast<size_t>(s - 1), 4);
    std::memcpy(&end, buf.data() + L.index_at + 4 * static_cast<size_t>(s), 4);
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(T * D));
    const uint8_t* p = buf.data() + L.streams_at + begin;
    const entropy::SharedTables* st =
        (p[0] & 3u) == static_cast<unsigned>(entropy::StreamMode::kRansShared) &&
                tables_.decode[part]
            ? &*tables_.decode[part]
            : nullptr;
    const Status status =
        entropy::decode_symbols(p, end - begin, T, static_cast<int>(D), c_.bits, codes, st,
                                entropy::RansImpl::kAuto, nullptr, &ws);
    KVQ_CHECK(status.ok());  // every stream was decoded once when the block was built or loaded
    cachegen::chunk_codes(c_.delta, c_.group, codes,
                          buf.data() + L.masks_at + static_cast<size_t>(s) * mask_bytes(g.dim), T,
                          D, c_.bits, codes);
    const size_t np = static_cast<size_t>(cachegen::param_count(T, D, c_.group, axis));
    const QuantParams* params =
        params_at(buf.data() + L.params_at + static_cast<size_t>(s) * np * sizeof(QuantParams),
                  np * sizeof(QuantParams), ws);
    cachegen::dequant_codes(codes, T, D, c_.group, axis, params, out);
  }

  // Validates both parts, including a full decode of every stream. Block 0 with tables=shared
  // carries the layer's prototype sets; they are staged for the later blocks of the same import
  // and become the codec's at end_import(true).
  Result<SealedBlock> load(int64_t index, const BlockGeometry& g, const ChunkRef& k,
                           const ChunkRef& v) override {
    const bool shared = c_.tables == Tables::kShared;
    if (index == 0) {
      pending_.reset();
      pending_acct_.clear();
    }
    std::optional<LayerTables> staged;
    if (shared && index == 0) {
      staged.emplace();
      for (int part = 0; part < 2; ++part) {
        const ChunkRef& ref = part == 0 ? k : v;
        ByteReader r(ref.data, ref.size);
        uint32_t len = 0;
        const uint8_t* p = nullptr;
        if (!r.u32(len) || !r.view(len, p))
          return corrupt("cachegen block 0: truncated shared table set");
        auto t = entropy::deserialize_tables(p, len);
        if (!t.ok()) return t.status().with_context("cachegen shared tables");
        if (t->symbol_bits != c_.bits || t->n_tables > kPrototypes)
          return corrupt("cachegen shared tables are " + std::to_string(t->n_tables) +
                         " tables of " + std::to_string(t->symbol_bits) +
                         "-bit symbols, expected at most " + std::to_string(kPrototypes) + " of " +
                         std::to_string(c_.bits));
        auto m = entropy::make_shared_tables(std::move(*t), entropy::RansModelUse::kDecode);
        if (!m.ok()) return m.status().with_context("cachegen shared tables");
        staged->decode[part].emplace(std::move(*m));
      }
    } else if (shared && !pending_) {
      return corrupt("cachegen block " + std::to_string(index) +
                     ": the layer's shared tables (block 0) are missing");
    }
    const LayerTables* tables = staged ? &*staged : pending_ ? &*pending_ : nullptr;
    std::array<Acct, 2> acct;
    for (int part = 0; part < 2; ++part)
      KVQ_RETURN_IF_ERROR(parse_part(index, part, g, part == 0 ? k : v,
                                     tables ? &*tables->decode[part] : nullptr, acct[part]));
    if (staged) pending_ = std::move(staged);
    pending_acct_.push_back(acct);
    auto data = std::make_shared<BlockData>();
    data->keys = Buffer(k.data, k.size);
    data->values = Buffer(v.data, v.size);
    return SealedBlock{std::move(data), to_bytes(acct)};
  }

  void end_import(bool commit) override {
    if (commit) {
      tables_ = pending_ ? std::move(*pending_) : LayerTables{};
      acct_ = std::move(pending_acct_);
    }
    pending_.reset();
    pending_acct_.clear();
  }

  void on_trim(int64_t, int64_t keep_blocks) override {
    acct_.resize(static_cast<size_t>(keep_blocks));
    if (keep_blocks == 0) tables_ = {};  // they lived in block 0
  }
  void on_reset() override {
    acct_.clear();
    tables_ = {};
  }

  // The effective bits and, per part, the byte accounting by kind and the streams per coder mode.
  std::string stats(const std::vector<std::shared_ptr<const BlockData>>&,
                    const BlockGeometry&) const override {
    Acct sum[2];
    for (const auto& a : acct_)
      for (int part = 0; part < 2; ++part) sum[part] += a[static_cast<size_t>(part)];
    std::string out = "bits=" + std::to_string(c_.bits) + "\n";
    for (int part = 0; part < 2; ++part) {
      const std::string p = part == 0 ? "key_" : "value_";
      const auto& a = sum[part];
      out += p + "payload_bytes=" + std::to_string(a.codes) + "\n" + p +
             "header_bytes=" + std::to_string(a.headers) + "\n" + p +
             "inline_table_bytes=" + std::to_string(a.tables) + "\n" + p +
             "shared_table_bytes=" + std::to_string(a.shared) + "\n" + p +
             "index_bytes=" + std::to_string(a.index) + "\n" + p +
             "param_bytes=" + std::to_string(a.params) + "\n";
      for (int m = 0; m < 4; ++m)
        out += p + "streams_" + entropy::stream_mode_name(static_cast<entropy::StreamMode>(m)) +
               "=" + std::to_string(a.modes[m]) + "\n";
    }
    return out;
  }

 private:
  static CacheBytes to_bytes(const std::array<Acct, 2>& a) {
    CacheBytes c;
    c.key_codes = a[0].codes;
    c.value_codes = a[1].codes;
    c.params = a[0].params + a[1].params;
    c.meta = a[0].meta() + a[1].meta();
    return c;
  }

  // Bytes of one stream's channel mask (delta=auto), else 0.
  size_t mask_bytes(int64_t dim) const {
    return c_.delta == DeltaMode::kAuto ? cachegen::mask_bytes(dim) : 0;
  }
  bool owns_tables(int64_t index) const { return c_.tables == Tables::kShared && index == 0; }

  // The regions of part `part` of block `index` (data: the part's bytes, for block 0's table
  // length; sizes were validated when the block was built or loaded).
  PartLayout layout(int64_t index, int part, const BlockGeometry& g, const uint8_t* data) const {
    const int64_t S = g.streams();
    const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
    const int64_t np = cachegen::param_count(g.tokens, g.dim, c_.group, axis);
    PartLayout L;
    if (owns_tables(index)) {
      uint32_t len;
      std::memcpy(&len, data, 4);
      L.params_at = 4 + len;
    }
    L.masks_at = L.params_at + static_cast<size_t>(S * np) * sizeof(QuantParams);
    L.index_at = L.masks_at + static_cast<size_t>(S) * mask_bytes(g.dim);
    L.streams_at = L.index_at + 4 * static_cast<size_t>(S);
    return L;
  }

  // Encodes one part from fp32 x [B, H, T, D]; `shared` is the part's prototype set
  // (tables=shared), `table_set` its serialized form when this block carries it (block 0).
  Buffer encode_part(int part, const BlockGeometry& g, const float* x,
                     const entropy::SharedTables* shared, const std::vector<uint8_t>* table_set,
                     Acct& a, Workspace& ws) {
    Workspace::Frame frame(ws);
    const int64_t S = g.streams(), T = g.tokens, D = g.dim;
    const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
    const int64_t np = cachegen::param_count(T, D, c_.group, axis);
    std::vector<uint8_t>& out = staging_;  // the part is built here, then copied at its size
    out.clear();
    if (table_set) {
      ByteWriter w(out);
      w.u32(static_cast<uint32_t>(table_set->size()));
      w.bytes(table_set->data(), table_set->size());
    }
    const size_t params_at = out.size();
    const size_t masks_at = params_at + static_cast<size_t>(S * np) * sizeof(QuantParams);
    const size_t index_at = masks_at + static_cast<size_t>(S) * mask_bytes(D);
    const size_t streams_at = index_at + 4 * static_cast<size_t>(S);
    out.resize(streams_at);
    // A stream never takes more than its raw mode (encode_symbols' size guarantee), nor does it
    // pass through `out` at a larger size: reserved once, staging stops growing after a block.
    out.reserve(streams_at +
                static_cast<size_t>(S) * (1 + packed_size(static_cast<size_t>(T * D), c_.bits)));
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(T * D));
    QuantParams* params = ws.alloc<QuantParams>(static_cast<size_t>(np));
    uint32_t* counts = ws.alloc<uint32_t>(static_cast<size_t>(D) << c_.bits);
    const entropy::SymbolCodecOptions o = codec_options(c_);
    a = Acct{};
    a.index = (4 + mask_bytes(D)) * static_cast<uint64_t>(S);
    a.shared = table_set ? 4 + table_set->size() : 0;
    a.params = static_cast<uint64_t>(S * np) * sizeof(QuantParams);
    for (int64_t s = 0; s < S; ++s) {
      cachegen::quantize_to_codes(x + s * T * D, T, D, c_.bits, c_.group, axis, codes, params);
      std::memcpy(out.data() + params_at + static_cast<size_t>(s * np) * sizeof(QuantParams),
                  params, static_cast<size_t>(np) * sizeof(QuantParams));
      const bool counted = cachegen::chunk_symbols(
          c_.delta, c_.group, codes, T, D, c_.bits, codes,
          out.data() + masks_at + static_cast<size_t>(s) * mask_bytes(D), counts, &ws);
      entropy::EncodeStats st;
      const Status status = entropy::encode_symbols(codes, T, static_cast<int>(D), c_.bits, o, out,
                                                    &st, shared, counted ? counts : nullptr, &ws);
      KVQ_CHECK(status.ok());  // symbols are < 2^bits by construction
      a.add(st.mode, st.header_bytes, st.table_bytes, st.payload_bytes);
      const uint32_t end = static_cast<uint32_t>(out.size() - streams_at);
      std::memcpy(out.data() + index_at + 4 * static_cast<size_t>(s), &end, 4);
    }
    // The part's own exact-size buffer: resident bytes are exactly the stored bytes.
    return Buffer(out.data(), out.size());
  }

  Status parse_part(int64_t index, int part, const BlockGeometry& g, const ChunkRef& ref,
                    const entropy::SharedTables* shared, Acct& a) const {
    const int64_t S = g.streams(), T = g.tokens, D = g.dim;
    const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
    const int64_t np = cachegen::param_count(T, D, c_.group, axis);
    size_t tb = 0;
    if (owns_tables(index)) {
      uint32_t len;
      std::memcpy(&len, ref.data, 4);  // checked by load() before
      tb = 4 + static_cast<size_t>(len);
    }
    const size_t pb = static_cast<size_t>(S * np) * sizeof(QuantParams);
    const char* what = part == 0 ? "cachegen key part" : "cachegen value part";
    const size_t mb = static_cast<size_t>(S) * mask_bytes(D);
    if (ref.size < tb + pb + mb + 4 * static_cast<size_t>(S))
      return corrupt(std::string(what) + ": " + std::to_string(ref.size) + " bytes cannot hold " +
                     std::to_string(S) + " streams' parameters and index");
    PartLayout L;
    L.params_at = tb;
    L.masks_at = tb + pb;
    L.index_at = tb + pb + mb;
    L.streams_at = L.index_at + 4 * static_cast<size_t>(S);
    KVQ_RETURN_IF_ERROR(validate_quant_params(ref.data + tb, pb / 4, what));
    if (mask_bytes(D) && D % 8) {  // canonical masks: bits at or above D are zero
      const uint8_t high = static_cast<uint8_t>(0xFF << (D % 8));
      for (int64_t s = 0; s < S; ++s)
        if (ref.data[L.masks_at + (static_cast<size_t>(s) + 1) * mask_bytes(D) - 1] & high)
          return corrupt(std::string(what) + ": stream " + std::to_string(s) +
                         "'s channel mask has bits set beyond D");
    }
    const size_t region = ref.size - L.streams_at;
    a = Acct{};
    a.params = pb;
    a.index = mb + 4 * static_cast<uint64_t>(S);
    a.shared = tb;
    KVQ_RETURN_IF_ERROR(entropy::check_stream_ends(ref.data + L.index_at, S, region, what));
    std::vector<uint8_t> sym(static_cast<size_t>(T * D));
    uint32_t prev = 0;
    for (int64_t s = 0; s < S; ++s) {
      uint32_t end;
      std::memcpy(&end, ref.data + L.index_at + 4 * static_cast<size_t>(s), 4);
      entropy::StreamInfo info;
      const uint8_t* p = ref.data + L.streams_at + prev;
      const Status st =
          entropy::decode_symbols(p, end - prev, T, static_cast<int>(D), c_.bits, sym.data(),
                                  shared, entropy::RansImpl::kAuto, &info);
      if (!st.ok()) {
        // A shared-table stream without shared tables is a damaged file here, not a bad call.
        return corrupt(std::string(what) + ", stream " + std::to_string(s) + ": " + st.message());
      }
      a.add(info.mode, info.header_bytes, info.table_bytes, info.payload_bytes);
      prev = end;
    }
    return ok_status();
  }

  // Shared tables from block 0: per part, kPrototypes prototypes clustered from the per-channel
  // histograms of every stream (all b and h) of block 0's symbols, serialized into out[part].
  void build_tables(const BlockGeometry& g, const float* k, const float* v,
                    std::vector<uint8_t> out[2], Workspace& ws) const {
    Workspace::Frame frame(ws);
    const int64_t T = g.tokens, D = g.dim, S = g.streams();
    const int a = 1 << c_.bits;
    uint8_t* codes = ws.alloc<uint8_t>(static_cast<size_t>(T * D));
    uint8_t* mask = ws.alloc<uint8_t>(cachegen::mask_bytes(D));
    uint32_t* hists = ws.alloc<uint32_t>(static_cast<size_t>(S * D * a));
    std::fill(hists, hists + S * D * a, 0u);
    for (int part = 0; part < 2; ++part) {
      const float* x = part == 0 ? k : v;
      const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
      QuantParams* params =
          ws.alloc<QuantParams>(static_cast<size_t>(cachegen::param_count(T, D, c_.group, axis)));
      std::fill(hists, hists + S * D * a, 0u);
      for (int64_t s = 0; s < S; ++s) {
        cachegen::quantize_to_codes(x + s * T * D, T, D, c_.bits, c_.group, axis, codes, params);
        uint32_t* h = hists + static_cast<size_t>(s * D * a);
        if (!cachegen::chunk_symbols(c_.delta, c_.group, codes, T, D, c_.bits, codes, mask, h, &ws))
          KVQ_CHECK(entropy::count_symbols(codes, static_cast<size_t>(T * D), c_.bits,
                                           static_cast<int>(D), h)
                        .ok());
      }
      // 3 k-means rounds: on real KV the coded size moved by 0.1% between 0 and 16 rounds.
      auto t = entropy::build_prototypes(hists, static_cast<int>(S * D), c_.bits, kPrototypes,
                                         std::max(c_.bits, entropy::kLutMaxProbBits), 3);
      KVQ_CHECK(t.ok());
      entropy::serialize_tables(*t, out[part]);
    }
  }

  // The encoder's form of a prepared decode set (after an import).
  static entropy::SharedTables encoder_tables(const entropy::SharedTables& dec) {
    auto m = entropy::make_shared_tables(dec.tables, entropy::RansModelUse::kBoth);
    KVQ_CHECK(m.ok());
    return std::move(*m);
  }

  CgConfig c_;
  LayerTables tables_;
  std::vector<std::array<Acct, 2>> acct_;  // per sealed block, for stats()
  std::optional<LayerTables> pending_;     // import staging
  std::vector<std::array<Acct, 2>> pending_acct_;
  std::vector<uint8_t> staging_;  // encode scratch, kept at its largest size
};

Result<std::vector<std::unique_ptr<BlockCodec>>> build(const std::vector<Spec>& specs,
                                                       const ModelShape& shape) {
  std::vector<std::unique_ptr<BlockCodec>> layers;
  const int L = shape.n_layers;
  for (int i = 0; i < L; ++i) {
    const Spec& s = specs[static_cast<size_t>(i)];
    const int bits = cachegen::layer_bits(i, L, static_cast<int>(s.get_int("bits")),
                                          static_cast<int>(s.get_int("layer_groups")));
    layers.push_back(std::make_unique<CgCodec>(s, shape.at(i), bits));
  }
  return layers;
}

Status validate(const Spec& s) {
  const int64_t g = s.get_int("group"), c = s.get_int("chunk");
  if (c % g != 0)
    return invalid_argument("cachegen: chunk=" + std::to_string(c) +
                            " must be a multiple of group=" + std::to_string(g) +
                            " (chunks hold whole quantization groups)");
  return ok_status();
}

}  // namespace

MethodDef make_cachegen_method() {
  MethodDef m;
  m.id = 2;
  m.name = "cachegen";
  // Budget: 0.4 * 4^(2 - bits) relative squared error, the rate of uniform quantization.
  m.bit_ladder = {{"group=128,chunk=128,bits=2", 2, 0.4},
                  {"group=128,chunk=128,bits=3", 3, 0.1},
                  {"group=128,chunk=128,bits=4", 4, 0.025},
                  {"group=128,chunk=128,bits=8", 8, 1e-4}};
  m.test_settings = "group=4,chunk=8,residual=8";
  m.summary =
      "CacheGen: group quantization, code-space deltas, per-channel rANS in independent chunks";
  m.params = {
      {"bits",
       ParamType::kInt,
       4,
       1,
       8,
       {},
       "bits per code (the shallowest layers' width with layer_groups > 1)"},
      {"group",
       ParamType::kInt,
       128,
       1,
       4096,
       {},
       "tokens per key quantization group (per channel); channels per value group (values=token, "
       "capped at head_dim)"},
      {"chunk",
       ParamType::kInt,
       128,
       1,
       65536,
       {},
       "tokens per independently decodable coded chunk (the sealed block; a multiple of group)"},
      {"delta",
       ParamType::kEnum,
       4,
       0,
       0,
       {"none", "token", "group", "anchor", "auto"},
       "code-space delta along tokens: none, token (VeloxQuant-MLX's), group (restarted every group "
       "tokens), "
       "anchor (against each group's first token, the paper's), auto (token or none per channel)"},
      {"tables",
       ParamType::kEnum,
       3,
       0,
       0,
       {"channel", "pooled", "auto", "shared"},
       "rANS tables: inline per channel in each chunk, one pooled, the smaller of the two, or "
       "shared: "
       "16 prototype tables per layer and K/V clustered from its first chunk (billed once), each "
       "chunk's channels naming theirs"},
      {"values",
       ParamType::kEnum,
       0,
       0,
       0,
       {"token", "channel"},
       "value grouping: per token over group channels (KIVI) or per channel over group tokens (the "
       "seed)"},
      {"layer_groups",
       ParamType::kInt,
       1,
       1,
       64,
       {},
       "contiguous depth groups of VeloxQuant-MLX's bit schedule: group g gets bits - g (floored at 2); "
       "1 = every layer at bits"},
      {"residual", ParamType::kInt, 128, 0, 1 << 20, {}, "newest tokens kept in fp16"},
  };
  m.build = build;
  m.validate = validate;
  return m;
}

}  // namespace kvq
