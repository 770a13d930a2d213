// CacheGen (Liu et al., SIGCOMM 2024, arXiv 2310.07240) as a kvq method: group quantization whose
// codes are delta-transformed along tokens and entropy coded (src/entropy: static per-channel
// tables, interleaved rANS), in chunks of `chunk` tokens that decode independently. The seed
// (`001_69901d89729a9374.txt`) only estimated the coded size; here every byte is real and held.
//
// Numerics: src/numerics/cachegen.h (quantization, deltas, layer schedule). Keys are quantized
// per channel over runs of `group` tokens; values per token over runs of `group` channels
// (values=token, KIVI's grouping) or like the keys (values=channel, the seed's). The entropy stage
// is lossless: what the model sees is exactly the group quantization's reconstruction.
//
// Resident form: sealed chunks are held *coded* and decoded on demand (dequant_keys/values, which
// read() and attend() call per block), so the compression is real in memory; the stored layout
// below is also the transfer form (export_blocks streams it as chunks are sealed).
//
// Depth schedule: the per-model builder gives layer l of L the bits
//   layer_bits(l, L, bits, layer_groups) = min(bits, max(2, bits - floor(l * layer_groups / L)))
// (the seed's base, base-1, ... over contiguous depth groups). The layer's spec() keeps the
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
#include "entropy/cachegen_codes.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cache/block_cache.h"
#include "core/byte_io.h"
#include "entropy/symbol_codec.h"
#include "kvq/bitpack.h"
#include "kvq/group_quant.h"
#include "methods/methods.h"

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

// The layer's shared tables (tables=shared): per part (0 keys, 1 values) one set of up to
// kPrototypes prototype tables, serialized (entropy::serialize_tables). Immutable once built;
// owned (and billed) by block 0, read by every block of the layer.
struct TableStore {
  std::vector<uint8_t> data[2];
  uint64_t bytes() const { return 8 + data[0].size() + data[1].size(); }  // with the u32 lengths
  // Parses a part's set for decoding (and encoding, if `encode`).
  Result<entropy::SharedTables> model(int part, bool encode) const {
    KVQ_ASSIGN_OR_RETURN(entropy::FrequencyTables t,
                         entropy::deserialize_tables(data[part].data(), data[part].size()));
    return entropy::make_shared_tables(
        std::move(t), encode ? entropy::RansModelUse::kBoth : entropy::RansModelUse::kDecode);
  }
};

// The decoder's prepared form of a serialized prototype set, for the calling thread. Reads of a
// layer alternate between its key and value sets, so the two most recent sets are kept, keyed
// by their bytes (a pointer could be reused by another set after a trim). Per-thread scratch
// like the dequantizers' buffers: derived from the held bytes, not held K/V data.
const entropy::SharedTables& decode_tables(const std::vector<uint8_t>& set) {
  struct Entry {
    std::vector<uint8_t> bytes;
    std::optional<entropy::SharedTables> tables;
  };
  thread_local Entry cache[2];
  thread_local int next = 0;
  for (auto& e : cache)
    if (e.tables && e.bytes == set) return *e.tables;
  Entry& e = cache[next];
  next ^= 1;
  auto t = entropy::deserialize_tables(set.data(), set.size());
  KVQ_CHECK(t.ok());  // validated when the block was built or imported
  auto m = entropy::make_shared_tables(std::move(*t), entropy::RansModelUse::kDecode);
  KVQ_CHECK(m.ok());
  e.bytes = set;
  e.tables.emplace(std::move(*m));
  return *e.tables;
}

class CgBlock final : public SealedBlock {
 public:
  CgBlock(const BlockGeometry& g, const CgConfig& c) : g_(g), c_(c) {}

  // ---- building ----
  // Encodes one part from fp32 x [B, H, T, D]; `shared` is the part's prototype set
  // (tables=shared).
  void encode_part(int part, const float* x, const entropy::SharedTables* shared) {
    const int64_t S = g_.batch * g_.heads, T = g_.tokens, D = g_.dim;
    const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
    const int64_t np = cachegen::param_count(T, D, c_.group, axis);
    thread_local std::vector<uint8_t> out;  // staging; the block keeps an exact-size copy
    out.clear();
    if (owns_tables_ && tables_) {
      ByteWriter w(out);
      w.u32(static_cast<uint32_t>(tables_->data[part].size()));
      w.bytes(tables_->data[part].data(), tables_->data[part].size());
    }
    const size_t params_at = out.size();
    const size_t masks_at = params_at + static_cast<size_t>(S * np) * sizeof(QuantParams);
    const size_t index_at = masks_at + S * mask_bytes();
    const size_t streams_at = index_at + 4 * static_cast<size_t>(S);
    out.resize(streams_at);
    thread_local std::vector<uint8_t> codes;
    thread_local std::vector<QuantParams> params;
    thread_local std::vector<uint32_t> counts;
    codes.resize(static_cast<size_t>(T * D));
    params.resize(static_cast<size_t>(np));
    counts.resize(static_cast<size_t>(D) << c_.bits);
    const entropy::SymbolCodecOptions o = codec_options(c_);
    Acct& a = acct_[part];
    a = Acct{};
    a.index = (4 + mask_bytes()) * static_cast<uint64_t>(S);
    a.shared = owns_tables_ && tables_ ? table_bytes(part) : 0;
    a.params = static_cast<uint64_t>(S * np) * sizeof(QuantParams);
    for (int64_t s = 0; s < S; ++s) {
      cachegen::quantize_to_codes(x + s * T * D, T, D, c_.bits, c_.group, axis, codes.data(),
                                  params.data());
      std::memcpy(out.data() + params_at + static_cast<size_t>(s * np) * sizeof(QuantParams),
                  params.data(), static_cast<size_t>(np) * sizeof(QuantParams));
      const bool counted = cachegen::chunk_symbols(
          c_.delta, c_.group, codes.data(), T, D, c_.bits, codes.data(),
          out.data() + masks_at + static_cast<size_t>(s) * mask_bytes(), counts.data());
      entropy::EncodeStats st;
      const Status status =
          entropy::encode_symbols(codes.data(), T, static_cast<int>(D), c_.bits, o, out, &st,
                                  shared, counted ? counts.data() : nullptr);
      KVQ_CHECK(status.ok());  // symbols are < 2^bits by construction
      a.add(st.mode, st.header_bytes, st.table_bytes, st.payload_bytes);
      const uint32_t end = static_cast<uint32_t>(out.size() - streams_at);
      std::memcpy(out.data() + index_at + 4 * static_cast<size_t>(s), &end, 4);
    }
    // Hand the part its exact-size buffer: resident bytes are exactly the stored bytes.
    Buffer buf(out.size());
    if (!out.empty()) std::memcpy(buf.data(), out.data(), out.size());
    bufs_[part] = std::move(buf);
    params_at_[part] = params_at;
    masks_at_[part] = masks_at;
    index_at_[part] = index_at;
    streams_at_[part] = streams_at;
  }

  void set_tables(std::shared_ptr<const TableStore> t, bool owns) {
    tables_ = std::move(t);
    owns_tables_ = owns;
  }
  const std::shared_ptr<const TableStore>& tables() const { return tables_; }

  // Rebuilds a block from its serialized parts; validates everything, including a full decode of
  // every stream. `tables` are the layer's shared sets (null unless tables=shared and index > 0);
  // block 0 with tables=shared parses its own (tables() returns them afterwards).
  static Result<std::unique_ptr<SealedBlock>> from_parts(int64_t index, const BlockGeometry& g,
                                                         const CgConfig& c,
                                                         std::shared_ptr<const TableStore> tables,
                                                         const ChunkRef& k, const ChunkRef& v) {
    std::unique_ptr<CgBlock> blk(new CgBlock(g, c));
    const bool owns = c.tables == Tables::kShared && index == 0;
    if (owns) {
      auto store = std::make_shared<TableStore>();
      for (int part = 0; part < 2; ++part) {
        const ChunkRef& ref = part == 0 ? k : v;
        ByteReader r(ref.data, ref.size);
        uint32_t len = 0;
        const uint8_t* p = nullptr;
        if (!r.u32(len) || !r.view(len, p))
          return corrupt("cachegen block 0: truncated shared table set");
        auto t = entropy::deserialize_tables(p, len);
        if (!t.ok()) return t.status().with_context("cachegen shared tables");
        if (t->symbol_bits != c.bits || t->n_tables > kPrototypes)
          return corrupt("cachegen shared tables are " + std::to_string(t->n_tables) +
                         " tables of " + std::to_string(t->symbol_bits) +
                         "-bit symbols, expected at most " + std::to_string(kPrototypes) + " of " +
                         std::to_string(c.bits));
        store->data[part].assign(p, p + len);
      }
      tables = std::move(store);
    } else if (c.tables == Tables::kShared && !tables) {
      return corrupt("cachegen block " + std::to_string(index) +
                     ": the layer's shared tables (block 0) are missing");
    }
    blk->set_tables(std::move(tables), owns);
    for (int part = 0; part < 2; ++part)
      KVQ_RETURN_IF_ERROR(blk->parse_part(part, part == 0 ? k : v));
    return std::unique_ptr<SealedBlock>(std::move(blk));
  }

  // ---- SealedBlock ----
  void dequant_keys(int64_t b, int64_t h, float* out) const override {
    dequant(0, b * g_.heads + h, out);
  }
  void dequant_values(int64_t b, int64_t h, float* out) const override {
    dequant(1, b * g_.heads + h, out);
  }

  CacheBytes bytes() const override {
    CacheBytes c;
    c.key_codes = acct_[0].codes;
    c.value_codes = acct_[1].codes;
    c.params = acct_[0].params + acct_[1].params;
    c.meta = acct_[0].meta() + acct_[1].meta();
    return c;
  }
  uint64_t resident_bytes() const override { return bufs_[0].size() + bufs_[1].size(); }

  std::unique_ptr<SealedBlock> clone(CloneMemo& memo) const override {
    auto copy = std::make_unique<CgBlock>(*this);
    if (tables_) {  // one copy of the layer's tables per memo, shared by the copied blocks
      auto it = memo.copies.find(tables_.get());
      if (it == memo.copies.end())
        it = memo.copies.emplace(tables_.get(), std::make_shared<TableStore>(*tables_)).first;
      copy->tables_ = std::static_pointer_cast<const TableStore>(it->second);
    }
    return copy;
  }

  void serialize(bool keys, std::vector<uint8_t>& out) const override {
    const Buffer& b = bufs_[keys ? 0 : 1];
    out.insert(out.end(), b.data(), b.data() + b.size());
  }

  // Byte accounting of one part, by kind (also reported by stats()).
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
  };
  const Acct& acct(int part) const { return acct_[part]; }

 private:
  // Bytes of one stream's channel mask (delta=auto), else 0.
  size_t mask_bytes() const {
    return c_.delta == DeltaMode::kAuto ? cachegen::mask_bytes(g_.dim) : 0;
  }

  uint64_t table_bytes(int part) const { return 4 + tables_->data[part].size(); }

  Status parse_part(int part, const ChunkRef& ref) {
    const int64_t S = g_.batch * g_.heads, T = g_.tokens, D = g_.dim;
    const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
    const int64_t np = cachegen::param_count(T, D, c_.group, axis);
    const size_t tb = owns_tables_ ? table_bytes(part) : 0;
    const size_t pb = static_cast<size_t>(S * np) * sizeof(QuantParams);
    const char* what = part == 0 ? "cachegen key part" : "cachegen value part";
    const size_t mb = S * mask_bytes();
    if (ref.size < tb + pb + mb + 4 * static_cast<size_t>(S))
      return corrupt(std::string(what) + ": " + std::to_string(ref.size) + " bytes cannot hold " +
                     std::to_string(S) + " streams' parameters and index");
    params_at_[part] = tb;
    masks_at_[part] = tb + pb;
    index_at_[part] = tb + pb + mb;
    streams_at_[part] = index_at_[part] + 4 * static_cast<size_t>(S);
    KVQ_RETURN_IF_ERROR(validate_quant_params(ref.data + tb, pb / 4, what));
    if (mask_bytes() && g_.dim % 8) {  // canonical masks: bits at or above D are zero
      const uint8_t high = static_cast<uint8_t>(0xFF << (g_.dim % 8));
      for (int64_t s = 0; s < S; ++s)
        if (ref.data[masks_at_[part] + (static_cast<size_t>(s) + 1) * mask_bytes() - 1] & high)
          return corrupt(std::string(what) + ": stream " + std::to_string(s) +
                         "'s channel mask has bits set beyond D");
    }
    const size_t region = ref.size - streams_at_[part];
    Acct& a = acct_[part];
    a = Acct{};
    a.params = pb;
    a.index = mb + 4 * static_cast<uint64_t>(S);
    a.shared = tb;
    thread_local std::vector<uint8_t> sym;
    sym.resize(static_cast<size_t>(T * D));
    Result<entropy::SharedTables> shared = corrupt("no shared tables");
    if (tables_) {
      shared = tables_->model(part, false);
      if (!shared.ok()) return shared.status().with_context(what);
    }
    uint32_t prev = 0;
    for (int64_t s = 0; s < S; ++s) {
      uint32_t end;
      std::memcpy(&end, ref.data + index_at_[part] + 4 * static_cast<size_t>(s), 4);
      if (end < prev || end > region)
        return corrupt(std::string(what) + ": stream " + std::to_string(s) + " ends at " +
                       std::to_string(end) + ", outside [" + std::to_string(prev) + ", " +
                       std::to_string(region) + "]");
      if (s == S - 1 && end != region)
        return corrupt(std::string(what) + ": " + std::to_string(region - end) +
                       " bytes after the last stream");
      entropy::StreamInfo info;
      const uint8_t* p = ref.data + streams_at_[part] + prev;
      const Status st =
          entropy::decode_symbols(p, end - prev, T, static_cast<int>(D), c_.bits, sym.data(),
                                  tables_ ? &*shared : nullptr, entropy::RansImpl::kAuto, &info);
      if (!st.ok()) {
        // A shared-table stream without shared tables is a damaged file here, not a bad call.
        return corrupt(std::string(what) + ", stream " + std::to_string(s) + ": " + st.message());
      }
      a.add(info.mode, info.header_bytes, info.table_bytes, info.payload_bytes);
      prev = end;
    }
    Buffer buf(ref.size);
    if (ref.size) std::memcpy(buf.data(), ref.data, ref.size);
    bufs_[part] = std::move(buf);
    return ok_status();
  }

  void dequant(int part, int64_t s, float* out) const {
    const int64_t T = g_.tokens, D = g_.dim;
    const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
    const Buffer& buf = bufs_[part];
    uint32_t begin = 0, end;
    if (s > 0)
      std::memcpy(&begin, buf.data() + index_at_[part] + 4 * static_cast<size_t>(s - 1), 4);
    std::memcpy(&end, buf.data() + index_at_[part] + 4 * static_cast<size_t>(s), 4);
    thread_local std::vector<uint8_t> codes;
    codes.resize(static_cast<size_t>(T * D));
    const uint8_t* p = buf.data() + streams_at_[part] + begin;
    Status st;
    if (tables_ && (p[0] & 3u) == static_cast<unsigned>(entropy::StreamMode::kRansShared)) {
      st = entropy::decode_symbols(p, end - begin, T, static_cast<int>(D), c_.bits, codes.data(),
                                   &decode_tables(tables_->data[part]));
    } else {
      st = entropy::decode_symbols(p, end - begin, T, static_cast<int>(D), c_.bits, codes.data());
    }
    KVQ_CHECK(st.ok());  // every stream was decoded once when the block was built or imported
    cachegen::chunk_codes(c_.delta, c_.group, codes.data(),
                          buf.data() + masks_at_[part] + static_cast<size_t>(s) * mask_bytes(), T,
                          D, c_.bits, codes.data());
    const auto* params = reinterpret_cast<const QuantParams*>(buf.data() + params_at_[part]) +
                         s * cachegen::param_count(T, D, c_.group, axis);
    cachegen::dequant_codes(codes.data(), T, D, c_.group, axis, params, out);
  }

  BlockGeometry g_;
  CgConfig c_;
  Buffer bufs_[2];
  size_t params_at_[2] = {}, masks_at_[2] = {}, index_at_[2] = {}, streams_at_[2] = {};
  Acct acct_[2];
  std::shared_ptr<const TableStore> tables_;
  bool owns_tables_ = false;
};

class CgLayer final : public BlockLayerCache {
 public:
  CgLayer(const Spec& spec, const LayerShape& shape, int bits)
      : BlockLayerCache(spec, shape, spec.get_int("chunk"),
                        window_page_tokens(spec.get_int("chunk")), spec.get_int("residual")),
        c_(config_from(spec, bits)) {}
  CgLayer(const CgLayer& o, CloneMemo& memo) : BlockLayerCache(o, memo), c_(o.c_) {}
  std::unique_ptr<LayerCache> clone(CloneMemo& memo) const override {
    return std::unique_ptr<LayerCache>(new CgLayer(*this, memo));
  }

  // The effective bits and, per part, the byte accounting by kind and the streams per coder mode.
  std::string stats() const override {
    CgBlock::Acct sum[2];
    for (int64_t i = 0; i < n_blocks(); ++i) {
      const auto& b = static_cast<const CgBlock&>(block(i));
      for (int part = 0; part < 2; ++part) {
        const auto& a = b.acct(part);
        sum[part].codes += a.codes;
        sum[part].params += a.params;
        sum[part].headers += a.headers;
        sum[part].tables += a.tables;
        sum[part].index += a.index;
        sum[part].shared += a.shared;
        for (int m = 0; m < 4; ++m) sum[part].modes[m] += a.modes[m];
      }
    }
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

 protected:
  std::unique_ptr<SealedBlock> seal(int64_t index, const float* k, const float* v) override {
    auto blk = std::make_unique<CgBlock>(geometry(), c_);
    if (c_.tables == Tables::kShared) {
      std::shared_ptr<const TableStore> store =
          index == 0 ? build_tables(k, v) : static_cast<const CgBlock&>(block(0)).tables();
      KVQ_CHECK(store != nullptr);
      blk->set_tables(store, index == 0);
    }
    for (int part = 0; part < 2; ++part) {
      if (c_.tables == Tables::kShared) {
        auto m = blk->tables()->model(part, true);
        KVQ_CHECK(m.ok());
        blk->encode_part(part, part == 0 ? k : v, &*m);
      } else {
        blk->encode_part(part, part == 0 ? k : v, nullptr);
      }
    }
    return blk;
  }

  Result<std::unique_ptr<SealedBlock>> deserialize_block(int64_t index, const BlockGeometry& g,
                                                         const ChunkRef& k,
                                                         const ChunkRef& v) const override {
    if (index == 0) import_tables_.reset();
    auto blk = CgBlock::from_parts(index, g, c_, import_tables_, k, v);
    if (blk.ok() && index == 0 && c_.tables == Tables::kShared)
      import_tables_ = static_cast<const CgBlock&>(**blk).tables();
    return blk;
  }

  Status import_state(const uint8_t*, size_t size, int64_t, int64_t, bool) override {
    import_tables_.reset();  // every block is parsed by now; the blocks hold the tables
    return size == 0 ? ok_status() : corrupt("unexpected method state for cachegen");
  }

 private:
  // Shared tables from block 0: per part, kPrototypes prototypes clustered from the per-channel
  // histograms of every stream (all b and h) of block 0's symbols.
  std::shared_ptr<const TableStore> build_tables(const float* k, const float* v) const {
    const BlockGeometry g = geometry();
    const int64_t T = g.tokens, D = g.dim, S = g.batch * g.heads;
    const int a = 1 << c_.bits;
    auto store = std::make_shared<TableStore>();
    std::vector<uint8_t> codes(static_cast<size_t>(T * D)), mask(cachegen::mask_bytes(D));
    std::vector<uint32_t> hists(static_cast<size_t>(S * D * a));
    for (int part = 0; part < 2; ++part) {
      const float* x = part == 0 ? k : v;
      const Axis axis = part == 0 ? Axis::kChannel : c_.v_axis;
      std::vector<QuantParams> params(
          static_cast<size_t>(cachegen::param_count(T, D, c_.group, axis)));
      for (int64_t s = 0; s < S; ++s) {
        cachegen::quantize_to_codes(x + s * T * D, T, D, c_.bits, c_.group, axis, codes.data(),
                                    params.data());
        uint32_t* h = hists.data() + static_cast<size_t>(s * D * a);
        if (!cachegen::chunk_symbols(c_.delta, c_.group, codes.data(), T, D, c_.bits, codes.data(),
                                     mask.data(), h))
          KVQ_CHECK(entropy::count_symbols(codes.data(), static_cast<size_t>(T * D), c_.bits,
                                           static_cast<int>(D), h)
                        .ok());
      }
      // 3 k-means rounds: on real KV the coded size moved by 0.1% between 0 and 16 rounds.
      auto t =
          entropy::build_prototypes(hists.data(), static_cast<int>(S * D), c_.bits, kPrototypes,
                                    std::max(c_.bits, entropy::kLutMaxProbBits), 3);
      KVQ_CHECK(t.ok());
      entropy::serialize_tables(*t, store->data[part]);
    }
    return store;
  }

  CgConfig c_;
  // Import scratch: block 0's shared tables while the later blocks of the same import_chunks call
  // are parsed (deserialize_block is called in block order). Cleared by import_state.
  mutable std::shared_ptr<const TableStore> import_tables_;
};

Result<std::vector<std::unique_ptr<LayerCache>>> build(const std::vector<Spec>& specs,
                                                       const ModelShape& shape) {
  std::vector<std::unique_ptr<LayerCache>> layers;
  const int L = shape.n_layers;
  for (int i = 0; i < L; ++i) {
    const Spec& s = specs[static_cast<size_t>(i)];
    const int bits = cachegen::layer_bits(i, L, static_cast<int>(s.get_int("bits")),
                                          static_cast<int>(s.get_int("layer_groups")));
    layers.push_back(std::make_unique<CgLayer>(s, shape.at(i), bits));
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
  m.name = "cachegen";
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
       "code-space delta along tokens: none, token (the seed's), group (restarted every group "
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
       "contiguous depth groups of the seed's bit schedule: group g gets bits - g (floored at 2); "
       "1 = every layer at bits"},
      {"residual", ParamType::kInt, 128, 0, 1 << 20, {}, "newest tokens kept in fp16"},
  };
  m.build = build;
  m.validate = validate;
  return m;
}

}  // namespace kvq
