// Golden .kvq files (tests/data/container/, listed in its MANIFEST): files of every format
// version that must keep loading with the same decoded content, and damaged files that must
// fail with a specific error code. Also the generator of the fuzz seed corpora (fuzz/corpus/).
//
//   KVQ_WRITE_GOLDEN=1 kvq_tests --gtest_filter=ContainerGolden.Write     (re)writes the goldens
//                                                                          of the current version
//   KVQ_WRITE_FUZZ_SEEDS=1 kvq_tests --gtest_filter=FuzzSeeds.Write        (re)writes the seeds
//
// Goldens of released versions are never rewritten: a new format version adds files.
#include <gtest/gtest.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "../fuzz/import_input.h"
#include "container_util.h"
#include "core/file_io.h"
#include "entropy/symbol_codec.h"
#include "kvq/container.h"
#include "kvq/safetensors.h"
#include "test_util.h"

namespace kvq {
namespace {

std::string golden_dir() { return testing::source_dir() + "/tests/data/container"; }

std::string version_prefix() {
  return "v" + std::to_string(kContainerMajorVersion) + "." +
         std::to_string(kContainerMinorVersion) + "_";
}

// Appends `tokens` deterministic tokens to layer l (16-bit inputs when dtype says so).
void fill(ModelCache& c, int l, int64_t batch, int64_t t0, int64_t tokens, DType dtype,
          uint64_t seed) {
  const LayerShape& s = c.shape().at(l);
  const int64_t H = s.n_kv_heads, D = s.head_dim;
  const size_t n = static_cast<size_t>(batch * H * tokens * D);
  std::vector<float> k = testing::golden_values(n, D, seed * 1000 + static_cast<uint64_t>(t0));
  std::vector<float> v =
      testing::golden_values(n, D, seed * 1000 + 500 + static_cast<uint64_t>(t0));
  std::vector<uint16_t> k16(n), v16(n);
  for (size_t i = 0; i < n; ++i) {
    k16[i] = dtype == DType::kBF16 ? f32_to_bf16(k[i]) : f32_to_f16(k[i]);
    v16[i] = dtype == DType::kBF16 ? f32_to_bf16(v[i]) : f32_to_f16(v[i]);
  }
  Status st = dtype == DType::kF32
                  ? c.layer(l).append(TensorView::bhsd(k.data(), dtype, batch, H, tokens, D),
                                      TensorView::bhsd(v.data(), dtype, batch, H, tokens, D))
                  : c.layer(l).append(TensorView::bhsd(k16.data(), dtype, batch, H, tokens, D),
                                      TensorView::bhsd(v16.data(), dtype, batch, H, tokens, D));
  ASSERT_TRUE(st.ok()) << st.to_string();
}

struct Golden {
  std::string file;
  std::vector<uint8_t> bytes;
  std::string expect;  // "ok" or an error code name
  bool resave = false;
};

// The goldens of the current format version.
std::vector<Golden> make_goldens() {
  std::vector<Golden> out;
  const std::string v = version_prefix();
  {  // fp16: 2 layers, batch 1, fp16 input.
    auto c = ModelCache::create("fp16", ModelShape::uniform(2, 2, 8, 4));
    EXPECT_TRUE(c.ok());
    for (int l = 0; l < 2; ++l) fill(*c, l, 1, 0, 12, DType::kF16, 1 + static_cast<uint64_t>(l));
    out.push_back({v + "fp16.kvq", *serialize_cache(*c), "ok", true});
  }
  std::vector<uint8_t> kivi;
  {  // kivi with a per-layer override, batch 2, a layer that never received a token, attributes.
    auto c = ModelCache::create("kivi:k_bits=2,v_bits=2,group=4,residual=4",
                                ModelShape::uniform(3, 2, 8, 4), {{1, "k_bits=4,v_bits=3"}});
    EXPECT_TRUE(c.ok());
    for (int l = 0; l < 2; ++l) fill(*c, l, 2, 0, 19, DType::kF32, 10 + static_cast<uint64_t>(l));
    kivi = *serialize_cache(*c, {{"kvq.source", "golden"}});
    out.push_back({v + "kivi.kvq", kivi, "ok", true});
  }
  {  // kivi streamed as it grows (chunks of layers interleave), bf16 window, per-layer shapes,
     // plus an optional record of a type this version does not know (must be skipped).
    ModelShape s;
    s.n_layers = 2;
    s.per_layer = {LayerShape{2, 8, 4}, LayerShape{1, 16, 0}};
    auto c = ModelCache::create("kivi:k_bits=3,v_bits=2,group=8,residual=8", s);
    EXPECT_TRUE(c.ok());
    VectorByteSink sink;
    auto w = ContainerWriter::start(*c, sink);
    EXPECT_TRUE(w.ok());
    for (int64_t t = 0; t < 30; t += 5) {
      for (int l = 0; l < 2; ++l) fill(*c, l, 1, t, 5, DType::kBF16, 20 + static_cast<uint64_t>(l));
      EXPECT_TRUE(w->write_new_blocks(*c).ok());
    }
    EXPECT_TRUE(w->finish(*c).ok());
    auto raw = testing::split_file(sink.bytes);
    testing::RawRecord extra;
    extra.type = testing::fourcc("XTRA");
    extra.flags = 1;
    extra.payload = {'f', 'u', 't', 'u', 'r', 'e'};
    raw.records.insert(raw.records.begin() + 3, extra);
    out.push_back({v + "kivi_bf16_streamed.kvq", testing::join_file(raw), "ok", false});
  }

  // Damaged files, each wrong in one way (checksums recomputed where the damage is elsewhere).
  const auto raw = testing::split_file(kivi);
  const int chunk = raw.find("CHNK");
  const size_t chunk_off = testing::record_offset(raw, chunk);
  auto bad = [&](const std::string& name, std::vector<uint8_t> bytes, const char* code) {
    out.push_back({"bad_" + name + ".kvq", std::move(bytes), code, false});
  };
  std::vector<uint8_t> g = kivi;
  g[0] = 'P';
  bad("magic", g, "format");
  g = kivi;
  testing::put<uint16_t>(g.data() + 8, 2);
  testing::rehash_file_header(g.data());
  bad("version_2", g, "unsupported");
  bad("truncated_header", std::vector<uint8_t>(kivi.begin(), kivi.begin() + 40), "corrupt");
  bad("truncated_payload",
      std::vector<uint8_t>(kivi.begin(),
                           kivi.begin() + static_cast<std::ptrdiff_t>(chunk_off + 64 + 10)),
      "corrupt");
  bad("truncated_end", std::vector<uint8_t>(kivi.begin(), kivi.end() - 64), "corrupt");
  g = kivi;
  g[chunk_off + 64 + 5] ^= 0x04;
  bad("bitflip_payload", g, "corrupt");
  g = kivi;
  g[chunk_off + 33] ^= 0x01;  // t0 in a record header
  bad("bitflip_header", g, "corrupt");
  g = kivi;
  testing::put<uint64_t>(g.data() + chunk_off + 8,
                         testing::get<uint64_t>(g.data() + chunk_off + 8) + 4096);
  testing::rehash_record_header(g.data() + chunk_off);
  bad("lying_length", g, "corrupt");
  g = kivi;
  testing::put<uint64_t>(g.data() + chunk_off + 8, uint64_t{1} << 60);
  testing::rehash_record_header(g.data() + chunk_off);
  bad("huge_payload_size", g, "limit");
  g = kivi;
  testing::put<uint64_t>(g.data() + 64 + 8, uint64_t{1} << 32);
  testing::rehash_record_header(g.data() + 64);
  bad("huge_metadata", g, "limit");
  auto r = raw;
  testing::put<uint32_t>(r.records[0].payload.data(), 1u << 30);  // n_layers
  bad("metadata_layers", testing::join_file(r), "corrupt");
  r = raw;
  testing::set_meta_spec(r, "turboquant:bits=1");
  bad("unknown_method", testing::join_file(r), "unsupported");
  r = raw;
  testing::RawRecord req;
  req.type = testing::fourcc("ZSTD");
  req.payload = {1, 2, 3, 4};
  r.records.insert(r.records.begin() + 1, req);
  bad("unknown_required_record", testing::join_file(r), "unsupported");
  r = raw;
  std::swap(r.records[static_cast<size_t>(chunk)], r.records[static_cast<size_t>(chunk) + 1]);
  bad("chunk_order", testing::join_file(r), "corrupt");
  r = raw;
  r.records[static_cast<size_t>(r.find("INDX"))].payload[16] ^= 1;  // entry 0's t0
  bad("index_mismatch", testing::join_file(r, false), "corrupt");
  g = kivi;
  g.insert(g.end(), 64, 0);
  bad("trailing_bytes", g, "corrupt");
  r = raw;
  for (auto& rec : r.records)  // layer 0 claims a huge batch on every chunk (consistently)
    if (rec.type == testing::fourcc("CHNK") && testing::get<uint32_t>(rec.fields.data()) == 0)
      testing::put<uint64_t>(rec.fields.data() + 24, 60000);
  bad("huge_batch", testing::join_file(r), "corrupt");
  r = raw;
  auto& bk = r.records[static_cast<size_t>(chunk)].payload;  // a NaN scale in kivi block 0's keys
  bk[bk.size() - 4] = 0xff;
  bk[bk.size() - 3] = 0xff;
  bad("nan_scale", testing::join_file(r), "corrupt");
  return out;
}

std::string hex64(uint64_t x) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016" PRIx64, x);
  return buf;
}

TEST(ContainerGolden, Write) {
  if (!std::getenv("KVQ_WRITE_GOLDEN"))
    GTEST_SKIP() << "set KVQ_WRITE_GOLDEN=1 to (re)write the goldens";
  const auto goldens = make_goldens();
  // Keep the manifest lines of other versions; replace this version's and the bad files.
  std::vector<std::string> keep;
  {
    std::ifstream in(golden_dir() + "/MANIFEST");
    for (std::string line; std::getline(in, line);)
      if (!line.empty() && line[0] != '#' && line.rfind(version_prefix(), 0) != 0 &&
          line.rfind("bad_", 0) != 0)
        keep.push_back(line);
  }
  std::ostringstream m;
  m << "# Golden .kvq files (docs/format.md), checked by tests/container_golden_test.cc.\n"
       "# file  expected  [digest layers resave]: expected is ok or the error code name; for ok\n"
       "# files, digest is cache_digest() (tests/container_util.h) of the loaded cache, layers "
       "its\n"
       "# layer count, and resave means saving the loaded cache gives the file back byte for "
       "byte.\n";
  for (const auto& l : keep) m << l << "\n";
  for (const auto& g : goldens) {
    ASSERT_TRUE(
        write_file_atomic(golden_dir() + "/" + g.file, g.bytes.data(), g.bytes.size()).ok());
    m << g.file << " " << g.expect;
    if (g.expect == "ok") {
      auto c = parse_cache(g.bytes.data(), g.bytes.size());
      ASSERT_TRUE(c.ok()) << g.file << ": " << c.status().to_string();
      m << " " << hex64(testing::cache_digest(*c)) << " " << c->n_layers()
        << (g.resave ? " resave" : "");
    }
    m << "\n";
  }
  const std::string text = m.str();
  ASSERT_TRUE(write_file_atomic(golden_dir() + "/MANIFEST", text.data(), text.size()).ok());
}

TEST(ContainerGolden, EveryFileLoadsOrFailsAsRecorded) {
  std::ifstream in(golden_dir() + "/MANIFEST");
  ASSERT_TRUE(in.good()) << "missing " << golden_dir() << "/MANIFEST";
  int n_ok = 0, n_bad = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    std::string file, expect, digest, resave;
    int layers = 0;
    ls >> file >> expect;
    SCOPED_TRACE(file);
    auto bytes = read_file(golden_dir() + "/" + file);
    ASSERT_TRUE(bytes.ok()) << bytes.status().to_string();
    auto c = parse_cache(bytes->data(), bytes->size());
    ContainerReader sr;
    Status ss = sr.feed(bytes->data(), bytes->size());
    if (ss.ok()) ss = sr.finish();
    if (expect == "ok") {
      ls >> digest >> layers >> resave;
      ASSERT_TRUE(c.ok()) << c.status().to_string();
      ASSERT_TRUE(ss.ok()) << ss.to_string();
      EXPECT_EQ(c->n_layers(), layers);
      EXPECT_EQ(hex64(testing::cache_digest(*c)), digest) << "decoded content changed";
      ASSERT_NE(sr.meta(), nullptr);
      const ContainerAttributes attrs = sr.meta()->attributes;
      auto taken = sr.take();
      ASSERT_TRUE(taken.ok());
      EXPECT_EQ(hex64(testing::cache_digest(*taken)), digest);
      EXPECT_TRUE(ContainerView::open(bytes->data(), bytes->size()).ok());
      if (resave == "resave") {
        EXPECT_EQ(*serialize_cache(*c, attrs), *bytes) << "saving the loaded cache changed bytes";
      }
      ++n_ok;
    } else {
      ASSERT_FALSE(c.ok());
      EXPECT_EQ(error_code_name(c.status().code()), expect) << c.status().to_string();
      EXPECT_EQ(error_code_name(ss.code()), expect) << ss.to_string();
      ++n_bad;
    }
  }
  EXPECT_GE(n_ok, 3);
  EXPECT_GE(n_bad, 10);
}

// The goldens of the current version are what this build writes (the writer is deterministic;
// if this fails after an intended change to a method's encoder, the format is unchanged only if
// the old goldens still load — then regenerate: KVQ_WRITE_GOLDEN=1).
TEST(ContainerGolden, CurrentWriterReproducesTheGoldens) {
  for (const auto& g : make_goldens()) {
    if (g.expect != "ok") continue;
    auto bytes = read_file(golden_dir() + "/" + g.file);
    ASSERT_TRUE(bytes.ok()) << g.file;
    EXPECT_EQ(*bytes, g.bytes) << g.file;
  }
}

// ---- fuzz seed corpora ----

void write_seed(const std::string& target, const std::string& name,
                const std::vector<uint8_t>& bytes) {
  const std::string dir = testing::source_dir() + "/fuzz/corpus/" + target;
  ASSERT_EQ(std::system(("mkdir -p '" + dir + "'").c_str()), 0);
  ASSERT_TRUE(write_file_atomic(dir + "/" + name, bytes.data(), bytes.size()).ok());
}

std::vector<uint8_t> bytes_of(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}

// The spec fuzzer's dictionary: every method name, parameter (as "name=") and enum choice of
// the table, and the spec syntax's punctuation.
std::string spec_dictionary() {
  std::set<std::string> words;
  for (const auto& m : method_table()) {
    words.insert(m.name);
    for (const auto& p : m.params) {
      words.insert(p.name + "=");
      for (const auto& c : p.choices) words.insert(c);
    }
  }
  std::string out =
      "# libFuzzer dictionary for spec_fuzz, generated from the method table by\n"
      "# KVQ_WRITE_FUZZ_SEEDS=1 kvq_tests --gtest_filter=FuzzSeeds.Write: methods, parameters,\n"
      "# enum choices, punctuation.\n";
  for (const auto& w : words) out += "\"" + w + "\"\n";
  for (const char* p : {":", ",", "=", "@", "-"}) out += std::string("\"") + p + "\"\n";
  return out;
}

TEST(FuzzSeeds, DictionaryIsTheTables) {
  std::ifstream f(testing::source_dir() + "/fuzz/spec.dict", std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  EXPECT_EQ(ss.str(), spec_dictionary())
      << "fuzz/spec.dict is not the method table's: KVQ_WRITE_FUZZ_SEEDS=1 kvq_tests "
         "--gtest_filter=FuzzSeeds.Write";
}

TEST(FuzzSeeds, Write) {
  if (!std::getenv("KVQ_WRITE_FUZZ_SEEDS"))
    GTEST_SKIP() << "set KVQ_WRITE_FUZZ_SEEDS=1 to (re)write the seeds";
  // container: the goldens, and a small file of every method.
  for (const auto& g : make_goldens()) write_seed("container", g.file, g.bytes);
  const auto& table = method_table();
  for (size_t m = 0; m < table.size(); ++m) {
    const Spec spec = fuzz::fuzz_spec(table[m]);
    auto c = ModelCache::create(spec, ModelShape::uniform(2, 1, 4, 2));
    if (!c.ok())
      c = ModelCache::create(
          spec,
          ModelShape::uniform(2, 1, 32, 2, RopeShape{RopeShape::Mode::kAdjacent, 10000.0, 1.0}));
    ASSERT_TRUE(c.ok());
    for (int l = 0; l < 2; ++l) fill(*c, l, 1, 0, 14, DType::kF32, 30 + m);
    write_seed("container", "method_" + table[m].name + ".kvq", *serialize_cache(*c));

    // import: real exports of both layers, at a few sizes; a fourth with 8-bit window rows
    // (blocks of 32 values) for methods that have them.
    const bool q8 = fuzz::fuzz_spec(table[m], true).to_string() != spec.to_string();
    for (int variant = 0; variant < (q8 ? 4 : 3); ++variant) {
      fuzz::ImportHeader h;
      h.method = table[m].id;
      h.bf16 = variant == 2;
      h.q8_window = variant == 3;
      h.heads = 1 + variant % 2;
      h.dim = variant == 0 ? 4 : variant == 3 ? 32 : 8;
      if (!ModelCache::create(spec, h.shape()).ok()) h.dim = 32;  // llama.cpp's blocks of 32
      h.q_per_kv = 1 + (variant == 1);
      h.batch = 1 + (variant == 1);
      const Spec vspec = fuzz::fuzz_spec(table[m], h.q8_window);
      auto ic = ModelCache::create(vspec, h.shape());
      ASSERT_TRUE(ic.ok());
      const int64_t tokens = variant == 0 ? 5 : variant == 1 ? 13 : variant == 2 ? 27 : 45;
      for (int l = 0; l < fuzz::kImportLayers; ++l)
        fill(*ic, l, h.batch, 0, tokens, h.bf16 ? DType::kBF16 : DType::kF32, 40 + m);
      struct Keep final : ChunkSink {
        std::vector<std::vector<uint8_t>> store;
        std::vector<ChunkRef> refs;
        Status put(const ChunkRef& c) override {
          store.emplace_back(c.data, c.data + c.size);
          refs.push_back(c);
          return ok_status();
        }
      };
      std::vector<Keep> sinks(fuzz::kImportLayers);
      std::vector<fuzz::ImportLayerInput> layers;
      for (int l = 0; l < fuzz::kImportLayers; ++l) {
        Keep& k = sinks[static_cast<size_t>(l)];
        ASSERT_TRUE(ic->layer(l).export_blocks(0, k).ok());
        ASSERT_TRUE(ic->layer(l).export_tail(k).ok());
        for (size_t i = 0; i < k.refs.size(); ++i) k.refs[i].data = k.store[i].data();
        layers.push_back({ic->layer(l).offset(), k.refs});
      }
      write_seed("import", table[m].name + "_" + std::to_string(variant),
                 fuzz::encode_import_input(h, layers));
    }
  }

  // safetensors
  {
    std::vector<float> x = testing::golden_values(2 * 3 * 5 * 4, 4, 7);
    SafeTensorsFile f;
    f.metadata["format"] = "pt";
    f.tensors.push_back(make_tensor("layers.0.k", DType::kF16, {1, 2, 5, 4}, x.data()));
    f.tensors.push_back(make_tensor("layers.0.v", DType::kBF16, {1, 2, 5, 4}, x.data() + 40));
    f.tensors.push_back(make_tensor("layers.0.q", DType::kF32, {1, 3, 5, 4}, x.data()));
    write_seed("safetensors", "kv.safetensors", serialize_safetensors(f));
    SafeTensorsFile e;
    write_seed("safetensors", "empty.safetensors", serialize_safetensors(e));
    SafeTensorsFile s;
    s.tensors.push_back(make_tensor("scalar", DType::kF32, {}, x.data()));
    s.tensors.push_back(make_tensor("zero", DType::kF16, {0, 3}, x.data()));
    write_seed("safetensors", "scalar.safetensors", serialize_safetensors(s));
  }

  // spec: seeds named after the rows, and the dictionary generated from the table.
  for (const auto& m : table) {
    write_seed("spec", "canonical_" + m.name, bytes_of(Spec(m).to_string()));
    write_seed("spec", "small_" + m.name, bytes_of(fuzz::fuzz_spec(m).to_string()));
    write_seed("spec", "name_" + m.name, bytes_of(m.name));
    write_seed("spec", "override_" + m.name,
               bytes_of(m.name + "@0-3:" + (m.params.empty() ? "x=1" : m.params[0].name + "=2") +
                        "@5:" + (m.params.empty() ? "y=1" : m.params.back().name + "=1")));
  }
  {
    const std::string dict = spec_dictionary();
    ASSERT_TRUE(
        write_file_atomic(testing::source_dir() + "/fuzz/spec.dict", dict.data(), dict.size())
            .ok());
  }
  write_seed("spec", "typo", bytes_of("kiwi:k_bitz=2,,v_bits=-1"));
  write_seed("spec", "float", bytes_of("kivi:k_bits=2.5e0,residual=0x10"));

  // entropy: decode-mode inputs (real streams of every mode) and round-trip inputs.
  {
    using namespace entropy;
    auto header = [](uint8_t mode, int bits, int channels, int tokens) {
      std::vector<uint8_t> h = {
          mode, static_cast<uint8_t>(bits - 1), static_cast<uint8_t>(channels - 1),
          static_cast<uint8_t>(tokens & 0xff), static_cast<uint8_t>(tokens >> 8)};
      return h;
    };
    int n = 0;
    for (int bits : {1, 2, 4, 8})
      for (int tokens : {1, 40, 300}) {
        const int channels = bits == 8 ? 3 : 16;
        std::vector<uint8_t> sym(static_cast<size_t>(tokens * channels));
        const auto vals =
            testing::golden_values(sym.size(), channels, 100 + static_cast<uint64_t>(bits));
        for (size_t j = 0; j < sym.size(); ++j)
          sym[j] =
              static_cast<uint8_t>(static_cast<int>(std::fabs(vals[j]) * 2) & ((1 << bits) - 1));
        if (tokens == 1) std::fill(sym.begin(), sym.end(), uint8_t{1});  // constant mode
        std::vector<uint8_t> stream;
        ASSERT_TRUE(
            encode_symbols(sym.data(), tokens, channels, bits, SymbolCodecOptions{}, stream).ok());
        auto in = header(0, bits, channels, tokens);
        in.insert(in.end(), stream.begin(), stream.end());
        write_seed("entropy", "decode_" + std::to_string(n), in);
        // Shared tables.
        TableAccumulator acc(channels, bits, true);
        ASSERT_TRUE(acc.add(sym.data(), tokens).ok());
        auto tables = acc.build(SymbolCodecOptions{});
        ASSERT_TRUE(tables.ok());
        std::vector<uint8_t> tbytes;
        serialize_tables(*tables, tbytes);
        auto shared = make_shared_tables(*tables);
        ASSERT_TRUE(shared.ok());
        stream.clear();
        ASSERT_TRUE(encode_symbols(sym.data(), tokens, channels, bits, SymbolCodecOptions{}, stream,
                                   nullptr, &*shared)
                        .ok());
        in = header(2, bits, channels, tokens);
        in.push_back(static_cast<uint8_t>(tbytes.size() & 0xff));
        in.push_back(static_cast<uint8_t>(tbytes.size() >> 8));
        in.insert(in.end(), tbytes.begin(), tbytes.end());
        in.insert(in.end(), stream.begin(), stream.end());
        write_seed("entropy", "shared_" + std::to_string(n), in);
        // Round trip of the same symbols.
        std::vector<uint8_t> rt = {1, static_cast<uint8_t>(bits - 1),
                                   static_cast<uint8_t>(channels - 1), 10, 0x04};
        rt.insert(rt.end(), sym.begin(), sym.end());
        write_seed("entropy", "roundtrip_" + std::to_string(n), rt);
        ++n;
      }
  }

  // gguf: a minimal version-3 file: two metadata entries and one F32 tensor of 8 elements.
  {
    std::vector<uint8_t> g;
    auto u32 = [&](uint32_t v) {
      for (int b = 0; b < 4; ++b) g.push_back(static_cast<uint8_t>(v >> (8 * b)));
    };
    auto u64 = [&](uint64_t v) {
      for (int b = 0; b < 8; ++b) g.push_back(static_cast<uint8_t>(v >> (8 * b)));
    };
    auto str = [&](const std::string& s) {
      u64(s.size());
      g.insert(g.end(), s.begin(), s.end());
    };
    g.insert(g.end(), {'G', 'G', 'U', 'F'});
    u32(3);
    u64(1);  // tensors
    u64(2);  // metadata entries
    str("general.architecture");
    u32(8);  // string
    str("llama");
    str("llama.block_count");
    u32(4);  // u32
    u32(2);
    str("w");
    u32(1);  // dims
    u64(8);
    u32(0);  // F32
    u64(0);  // offset
    while (g.size() % 32) g.push_back(0);
    const auto vals = testing::golden_values(8, 8, 5);
    for (float f : vals) {
      uint32_t b;
      std::memcpy(&b, &f, 4);
      u32(b);
    }
    write_seed("gguf", "minimal.gguf", g);
  }
}

}  // namespace
}  // namespace kvq
