// The .kvq subcommands end to end: kvq compress, decompress (from a file and from a pipe), info
// (text and --json), and their errors on damaged input. Runs the built `kvq` binary.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/file_io.h"
#include "core/json.h"
#include "kvq/cache.h"
#include "kvq/container.h"
#include "kvq/safetensors.h"
#include "test_util.h"

namespace kvq {
namespace {

struct CliRun {
  int rc;
  std::string out, err;
};

class ContainerCli : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* t = std::getenv("TMPDIR");
    dir_ = std::string(t ? t : "/tmp") + "/kvq_cli_test_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name();
    ASSERT_EQ(std::system(("rm -rf '" + dir_ + "' && mkdir -p '" + dir_ + "'").c_str()), 0);
    kvq_ = std::string(KVQ_BINARY_DIR) + "/kvq";
    if (!testing::file_exists(kvq_)) GTEST_SKIP() << "no kvq binary at " << kvq_;
  }
  void TearDown() override { (void)std::system(("rm -rf '" + dir_ + "'").c_str()); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  static std::string slurp(const std::string& p) {
    auto b = read_file(p);
    return b.ok() ? std::string(b->begin(), b->end()) : std::string();
  }
  CliRun run(const std::string& args) const {
    const std::string cmd =
        "cd '" + dir_ + "' && " + kvq_ + " " + args + " > stdout.txt 2> stderr.txt";
    const int st = std::system(cmd.c_str());
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, slurp(path("stdout.txt")),
            slurp(path("stderr.txt"))};
  }
  // Input K/V: layers named so that alphabetical order differs from depth order.
  SafeTensorsFile write_input(const std::string& name, DType dtype = DType::kF32) const {
    SafeTensorsFile f;
    for (int l : {0, 1, 10, 2}) {
      const auto k = testing::random_kv(2, 2, 37, 16, 100 + static_cast<uint64_t>(l));
      const auto v = testing::random_kv(2, 2, 37, 16, 200 + static_cast<uint64_t>(l));
      const auto q = testing::random_kv(2, 4, 37, 16, 300 + static_cast<uint64_t>(l), 0.3f);
      const std::string p = "blk." + std::to_string(l) + ".attn_";
      f.tensors.push_back(make_tensor(p + "k", dtype, {2, 2, 37, 16}, k.data()));
      f.tensors.push_back(make_tensor(p + "v", dtype, {2, 2, 37, 16}, v.data()));
      f.tensors.push_back(make_tensor(p + "q", DType::kF32, {2, 4, 37, 16}, q.data()));
    }
    EXPECT_TRUE(write_safetensors(path(name), f).ok());
    return f;
  }

  std::string dir_, kvq_;
};

TEST_F(ContainerCli, CompressInfoDecompress) {
  const SafeTensorsFile in = write_input("kv.safetensors");
  CliRun r = run(
      "compress --method kivi:group=4,residual=8@1:k_bits=4 kv.safetensors -o kv.kvq --chunk 5");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("wrote kv.kvq"), std::string::npos) << r.out;
  EXPECT_TRUE(r.err.empty()) << r.err;  // no progress bar when stderr is not a terminal

  // The file holds what the library builds from the same tensors (chunk size does not matter).
  auto loaded = load_cache(path("kv.kvq"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  ASSERT_EQ(loaded->n_layers(), 4);
  EXPECT_EQ(loaded->layer(1).spec().get_int("k_bits"), 4);
  EXPECT_EQ(loaded->layer(2).spec().get_int("k_bits"), 2);
  ModelShape shape = ModelShape::uniform(4, 2, 16, 4);
  auto direct = ModelCache::create("kivi:group=4,residual=8@1:k_bits=4", shape);
  ASSERT_TRUE(direct.ok());
  const char* order[] = {"blk.0.attn_", "blk.1.attn_", "blk.2.attn_",
                         "blk.10.attn_"};  // depth order
  for (int l = 0; l < 4; ++l) {
    const std::string p = order[l];
    const TensorView q = *in.find(p + "q")->view4();
    ASSERT_TRUE(
        direct->layer(l).append(*in.find(p + "k")->view4(), *in.find(p + "v")->view4(), &q).ok());
  }
  EXPECT_EQ(*serialize_cache(*loaded), *serialize_cache(*direct));

  r = run("info kv.kvq");
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("kivi:k_bits=2,v_bits=2,group=4,residual=8"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("@1:k_bits=4"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("checksums all ok"), std::string::npos) << r.out;

  r = run("info kv.kvq --json");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = json::parse(r.out);
  ASSERT_TRUE(j.ok()) << r.out;
  EXPECT_EQ(j->find("format_version")->as_string(), "1.0");
  EXPECT_EQ(j->find("n_layers")->as_number(), 4);
  EXPECT_TRUE(j->find("checksums_ok")->as_bool());
  EXPECT_EQ(j->find("load")->as_string(), "ok");
  const auto& layers = j->find("layers")->items();
  ASSERT_EQ(layers.size(), 4u);
  EXPECT_EQ(layers[0].find("tokens")->as_number(), 37);
  EXPECT_EQ(layers[0].find("batch")->as_number(), 2);
  EXPECT_DOUBLE_EQ(layers[2].find("held_bits_per_element")->as_number(),
                   direct->layer(2).bytes().bits_per_element());
  EXPECT_DOUBLE_EQ(j->find("total")->find("held_bits_per_element")->as_number(),
                   direct->bytes().bits_per_element());

  // Decompress: the input's names, the cache's dequantized values.
  r = run("decompress kv.kvq -o out.safetensors");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto out = read_safetensors(path("out.safetensors"));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  ASSERT_EQ(out->tensors.size(), 8u);
  EXPECT_EQ(out->metadata.at("kvq.method"), "kivi:k_bits=2,v_bits=2,group=4,residual=8@1:k_bits=4");
  for (int l = 0; l < 4; ++l) {
    const SafeTensor* k = out->find(std::string(order[l]) + "k");
    const SafeTensor* v = out->find(std::string(order[l]) + "v");
    ASSERT_TRUE(k && v) << order[l];
    EXPECT_EQ(k->shape, (std::vector<int64_t>{2, 2, 37, 16}));
    std::vector<float> dk, dv;
    testing::read_all(direct->layer(l), dk, dv);
    ASSERT_EQ(k->data.size(), dk.size() * 4);
    EXPECT_EQ(0, std::memcmp(k->data.data(), dk.data(), k->data.size()));
    EXPECT_EQ(0, std::memcmp(v->data.data(), dv.data(), v->data.size()));
  }
  // From a pipe, as bf16.
  r = run("decompress - -o piped.safetensors --dtype bf16 < kv.kvq");
  ASSERT_EQ(r.rc, 0) << r.err;
  auto piped = read_safetensors(path("piped.safetensors"));
  ASSERT_TRUE(piped.ok());
  EXPECT_EQ(piped->tensors[0].dtype, DType::kBF16);
  // Decompressed output compresses again (fp16 keeps it exactly).
  r = run("compress --method fp16 out.safetensors -o again.kvq");
  ASSERT_EQ(r.rc, 0) << r.err;
}

TEST_F(ContainerCli, Errors) {
  write_input("kv.safetensors");
  CliRun r = run("compress kv.safetensors -o kv.kvq");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("--method is required"), std::string::npos) << r.err;
  r = run("compress --method kiwi kv.safetensors -o kv.kvq");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("did you mean 'kivi'"), std::string::npos) << r.err;
  ASSERT_EQ(run("compress --method kivi kv.safetensors -o kv.kvq").rc, 0);
  const std::string good = slurp(path("kv.kvq"));

  // A failed compress leaves the existing output as it was.
  ASSERT_TRUE(write_file_atomic(path("bad.safetensors"), "garbage!", 8).ok());
  r = run("compress --method kivi bad.safetensors -o kv.kvq");
  EXPECT_EQ(r.rc, 1);
  EXPECT_EQ(slurp(path("kv.kvq")), good);

  r = run("info bad.safetensors");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("not a .kvq file"), std::string::npos) << r.err;
  ASSERT_TRUE(write_file_atomic(path("trunc.kvq"), good.data(), good.size() / 2).ok());
  r = run("decompress trunc.kvq -o x.safetensors");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("truncated"), std::string::npos) << r.err;
  EXPECT_FALSE(testing::file_exists(path("x.safetensors")));

  // A damaged chunk payload: info still describes the file, flags the chunk, exits 1.
  auto info = inspect_container(reinterpret_cast<const uint8_t*>(good.data()), good.size());
  ASSERT_TRUE(info.ok());
  std::string bad = good;
  bad[info->chunks[0].record_offset + 64] ^= 0x20;
  ASSERT_TRUE(write_file_atomic(path("flip.kvq"), bad.data(), bad.size()).ok());
  r = run("info flip.kvq");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("1 BAD"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("checksum"), std::string::npos) << r.err;
  r = run("info flip.kvq --json");
  EXPECT_EQ(r.rc, 1);
  auto j = json::parse(r.out);
  ASSERT_TRUE(j.ok());
  EXPECT_FALSE(j->find("checksums_ok")->as_bool());
  EXPECT_NE(j->find("load")->as_string().find("corrupt"), std::string::npos);
}

}  // namespace
}  // namespace kvq
