// The method table owns its conformance: every row needs a stable id, a documentation page whose
// parameter table is the row's own, and a golden .kvq file that the current writer reproduces
// byte for byte — adding a row without them fails here. The table-wide quality checks run every
// row's bit ladder on kvq's committed real K/V: more bits never reconstruct worse, and each step
// stays within the error the row promises.
//
//   KVQ_WRITE_GOLDEN=1 kvq_tests --gtest_filter=MethodGoldens.Write    (re)writes the goldens
//   scripts/update_method_docs.py                                      rewrites the docs' tables
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

#include "container_util.h"
#include "core/file_io.h"
#include "kvq/container.h"
#include "kvq/safetensors.h"
#include "test_util.h"

namespace kvq {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST(Registry, IdsAndNamesAreUniqueAndStable) {
  std::set<uint32_t> ids;
  std::set<std::string> names;
  for (const auto& m : method_table()) {
    EXPECT_TRUE(ids.insert(m.id).second) << "duplicate id " << m.id << " (" << m.name << ")";
    EXPECT_TRUE(names.insert(m.name).second) << m.name;
    EXPECT_LT(m.id, 256u) << "ids travel in one byte (fuzz inputs)";
    EXPECT_EQ(find_method_by_id(m.id), &m);
  }
  // Released ids never change meaning.
  EXPECT_EQ(find_method_by_id(0)->name, "fp16");
  EXPECT_EQ(find_method_by_id(1)->name, "kivi");
  EXPECT_EQ(find_method_by_id(2)->name, "cachegen");
  EXPECT_EQ(find_method_by_id(3)->name, "xquant");
  EXPECT_EQ(find_method_by_id(4)->name, "zipcache");
}

TEST(Registry, EveryRowHasItsDocumentationPage) {
  for (const auto& m : method_table()) {
    const std::string path = testing::source_dir() + "/docs/methods/" + m.name + ".md";
    ASSERT_TRUE(testing::file_exists(path)) << "missing " << path;
    const std::string page = read_text(path);
    const size_t b = page.find("<!-- params:begin"), e = page.find("<!-- params:end -->");
    ASSERT_NE(b, std::string::npos) << path << " has no <!-- params:begin --> marker";
    ASSERT_NE(e, std::string::npos) << path << " has no <!-- params:end --> marker";
    const size_t start = page.find('\n', b) + 1;
    EXPECT_EQ(page.substr(start, e - start), params_markdown(m))
        << path << ": the parameter table differs from the method table; run "
        << "scripts/update_method_docs.py";
  }
}

// The golden cache of a row: 3 layers (so that XQuant pairs and CacheGen's depth schedule
// meet it), batch 2, 45 tokens of deterministic K/V/Q appended in chunks of 7, at the row's test
// settings, then saved.
// head_dim 8, or 32 for formats that need whole blocks of 32 (llama.cpp's). `spec`: the settings
// (a golden file is reproduced from the spec it names, so a later change of a row's defaults does
// not touch it); the row's test settings when empty.
std::vector<uint8_t> golden_of(const MethodDef& m, std::string spec = "") {
  if (spec.empty()) spec = test_spec(m).to_string();
  // head_dim 8 without RoPE where the row accepts it (the first goldens' shape); else 32, with
  // RoPE (formats of blocks of 32; methods that quantize keys before RoPE).
  int64_t D = 8;
  auto c = ModelCache::create(spec, ModelShape::uniform(3, 2, D, 4));
  if (!c.ok())
    c = ModelCache::create(
        spec,
        ModelShape::uniform(3, 2, D = 32, 4, RopeShape{RopeShape::Mode::kAdjacent, 10000.0, 1.0}));
  KVQ_CHECK(c.ok());
  const int64_t B = 2, S = 45;
  for (int64_t s0 = 0; s0 < S; s0 += 7) {
    const int64_t n = std::min<int64_t>(7, S - s0);
    for (int l = 0; l < 3; ++l) {
      const uint64_t seed = 1000 * m.id + 10 * static_cast<uint64_t>(l) + static_cast<uint64_t>(s0);
      const auto k = testing::golden_values(static_cast<size_t>(B * 2 * n * D), D, seed);
      const auto v = testing::golden_values(static_cast<size_t>(B * 2 * n * D), D, seed + 1);
      const auto q = testing::golden_values(static_cast<size_t>(B * 4 * n * D), D, seed + 2);
      const TensorView qv = TensorView::bhsd(q.data(), DType::kF32, B, 4, n, D);
      const Status st =
          c->layer(l).append(TensorView::bhsd(k.data(), DType::kF32, B, 2, n, D),
                             TensorView::bhsd(v.data(), DType::kF32, B, 2, n, D), &qv);
      if (!st.ok()) {
        std::fprintf(stderr, "golden of %s: %s\n", m.name.c_str(), st.to_string().c_str());
        std::abort();
      }
    }
  }
  auto bytes = serialize_cache(*c);
  KVQ_CHECK(bytes.ok());
  return std::move(*bytes);
}

std::string golden_path(const MethodDef& m) {
  return testing::source_dir() + "/tests/data/methods/" + m.name + ".kvq";
}

TEST(MethodGoldens, Write) {
  if (!std::getenv("KVQ_WRITE_GOLDEN")) GTEST_SKIP() << "set KVQ_WRITE_GOLDEN=1 to (re)write";
  // A golden that exists is rewritten from the spec it names (as the test below reproduces it),
  // so that a new parameter only adds itself to the stored spec.
  for (const auto& m : method_table()) {
    std::string spec;
    if (testing::file_exists(golden_path(m))) {
      const std::string stored = read_text(golden_path(m));
      auto loaded = parse_cache(reinterpret_cast<const uint8_t*>(stored.data()), stored.size());
      ASSERT_TRUE(loaded.ok()) << m.name << ": " << loaded.status().to_string();
      spec = loaded->model_spec().to_string();
    }
    const auto bytes = golden_of(m, spec);
    ASSERT_TRUE(write_file_atomic(golden_path(m), bytes.data(), bytes.size()).ok());
  }
}

TEST(Registry, EveryRowHasAGoldenFileTheWriterReproduces) {
  for (const auto& m : method_table()) {
    const std::string path = golden_path(m);
    ASSERT_TRUE(testing::file_exists(path))
        << "missing " << path
        << " (KVQ_WRITE_GOLDEN=1 kvq_tests --gtest_filter=MethodGoldens.Write)";
    const std::string stored = read_text(path);
    auto loaded = parse_cache(reinterpret_cast<const uint8_t*>(stored.data()), stored.size());
    ASSERT_TRUE(loaded.ok()) << m.name << ": " << loaded.status().to_string();
    const auto now = golden_of(m, loaded->model_spec().to_string());
    EXPECT_TRUE(std::string(now.begin(), now.end()) == stored)
        << m.name << ": the current writer no longer reproduces " << path
        << " — a change to the method's stored bytes needs a new format version or a new row";
    auto again = serialize_cache(*loaded);
    ASSERT_TRUE(again.ok());
    EXPECT_TRUE(std::string(again->begin(), again->end()) == stored) << m.name;
    EXPECT_EQ(loaded->resident_bytes(), loaded->bytes().total()) << m.name;
  }
}

// Relative reconstruction errors (sum of squared errors / sum of squares) of keys and values of
// the committed real K/V (4 layers of SmolLM2-135M, 512 tokens) through a cache of `spec`.
std::pair<double, double> real_kv_error(const Spec& spec) {
  static const auto file =
      read_safetensors(testing::source_dir() + "/tests/data/smollm2_kv_small.safetensors");
  KVQ_CHECK(file.ok());
  const std::vector<int> layers = {0, 10, 20, 29};
  // SmolLM2's shape and RoPE (adjacent pairs, theta 100000).
  auto c = ModelCache::create(
      spec, ModelShape::uniform(4, 3, 64, 9, RopeShape{RopeShape::Mode::kAdjacent, 100000.0, 1.0}));
  KVQ_CHECK(c.ok());
  double ek = 0, rk = 0, ev = 0, rv = 0;
  for (int l = 0; l < 4; ++l) {
    const std::string p = "layers." + std::to_string(layers[static_cast<size_t>(l)]) + ".";
    auto k = file->find(p + "k")->view4();
    auto v = file->find(p + "v")->view4();
    KVQ_CHECK(k.ok() && v.ok());
    KVQ_CHECK(c->layer(l).append(*k, *v).ok());
  }
  for (int l = 0; l < 4; ++l) {
    std::vector<float> kr, vr;
    testing::read_all(c->layer(l), kr, vr);
    const std::string p = "layers." + std::to_string(layers[static_cast<size_t>(l)]) + ".";
    auto k = file->find(p + "k")->view4();
    auto v = file->find(p + "v")->view4();
    const int64_t S = k->shape[2];
    for (int64_t h = 0; h < 3; ++h)
      for (int64_t t = 0; t < S; ++t)
        for (int64_t d = 0; d < 64; ++d) {
          const size_t i = static_cast<size_t>((h * S + t) * 64 + d);
          const double x = k->load(0, h, t, d), y = v->load(0, h, t, d);
          ek += (kr[i] - x) * (kr[i] - x), rk += x * x;
          ev += (vr[i] - y) * (vr[i] - y), rv += y * y;
        }
  }
  return {ek / rk, ev / rv};
}

TEST(Registry, MoreBitsNeverReconstructWorseAndStayWithinBudget) {
  for (const auto& m : method_table()) {
    double prev_k = INFINITY, prev_v = INFINITY;
    int prev_bits = 0;
    for (const auto& step : m.bit_ladder) {
      Spec s = test_spec(m);
      if (!step.settings.empty()) {
        ASSERT_TRUE(s.apply(step.settings).ok()) << m.name << ": " << step.settings;
      }
      ASSERT_TRUE(s.apply("residual=0").ok() || m.find_param("residual") < 0);
      const auto [ek, ev] = real_kv_error(s);
      RecordProperty(m.name + "_" + std::to_string(step.bits) + "_k", std::to_string(ek));
      RecordProperty(m.name + "_" + std::to_string(step.bits) + "_v", std::to_string(ev));
      EXPECT_GT(step.bits, prev_bits) << m.name << ": the ladder must climb";
      EXPECT_LE(ek, prev_k) << m.name << " keys at " << step.settings;
      EXPECT_LE(ev, prev_v) << m.name << " values at " << step.settings;
      EXPECT_LE(ek, step.max_rel_error) << m.name << " keys at " << step.settings;
      EXPECT_LE(ev, step.max_rel_error) << m.name << " values at " << step.settings;
      prev_k = ek, prev_v = ev, prev_bits = step.bits;
    }
    // A method with a bit knob climbs at least two steps; a fixed format has its one step.
    const bool knob =
        m.find_param("bits") >= 0 || m.find_param("k_bits") >= 0 || m.find_param("lo_bits") >= 0;
    if (m.name != "fp16") {
      EXPECT_GE(m.bit_ladder.size(), knob ? 2u : 1u) << m.name << " needs a bit ladder";
    }
  }
}

}  // namespace
}  // namespace kvq
