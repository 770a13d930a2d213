// The model subcommands end to end on stories260K (fast): kvq ppl --json has exactly the
// issue's fields, kvq generate reproduces the reference continuation, kvq dump-kv writes the
// documented tensors; bad arguments exit 1 or 2 with one error line.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>

#include "core/json.h"
#include "kvq/safetensors.h"
#include "model/tokenizer.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::file_exists;
using testing::shared_dir;
using testing::source_dir;

struct RunResult {
  int status = -1;
  std::string out;
};

// Runs the kvq binary with arguments (stdout captured; stderr to stderr or discarded).
RunResult run_kvq(const std::string& args, bool quiet_stderr = true) {
  const std::string cmd =
      std::string(KVQ_BINARY_DIR) + "/kvq " + args + (quiet_stderr ? " 2>/dev/null" : "");
  RunResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

class CliModel : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = shared_dir() + "/models/stories260K";
    if (!file_exists(dir_ + "/stories260K.bin")) GTEST_SKIP() << "stories260K not found";
    if (!file_exists(std::string(KVQ_BINARY_DIR) + "/kvq")) GTEST_SKIP() << "kvq binary not built";
    model_ = " --model " + dir_ + "/stories260K.bin --tokenizer " + dir_ + "/tok512.bin";
  }
  std::string dir_, model_;
};

TEST_F(CliModel, PplJsonHasTheDocumentedFields) {
  const RunResult r = run_kvq(
      "ppl" + model_ + " --text " + source_dir() + "/data/sotu_sample.txt" +
      " --ctx 128 --windows 2 --decode 16 --method kivi:group=8,residual=16 --json --quiet");
  ASSERT_EQ(r.status, 0) << r.out;
  auto j = json::parse(r.out);
  ASSERT_TRUE(j.ok()) << r.out;
  ASSERT_TRUE(j->is_array());
  ASSERT_EQ(j->items().size(), 2u);
  const std::vector<std::string> fields = {
      "method",           "tokens",     "ppl_fp16",        "ppl",
      "kld_mean",         "kld_p99",    "top1_agree",      "bits_per_element",
      "resident_bytes",   "fp16_bytes", "tokens_per_s",    "tokens_decode",
      "ppl_fp16_decode",  "ppl_decode", "kld_mean_decode", "kld_p99_decode",
      "top1_agree_decode"};
  for (const auto& row : j->items()) {
    ASSERT_EQ(row.members().size(), fields.size());
    for (size_t i = 0; i < fields.size(); ++i) EXPECT_EQ(row.members()[i].first, fields[i]);
  }
  const json::Value& ref = j->items()[0];
  const json::Value& kivi = j->items()[1];
  EXPECT_EQ(ref.find("method")->as_string(), "fp16");
  EXPECT_EQ(ref.find("tokens")->as_number(), 2 * 127);
  EXPECT_EQ(ref.find("kld_mean")->as_number(), 0.0);
  EXPECT_EQ(kivi.find("method")->as_string(), "kivi:k_bits=2,v_bits=2,group=8,residual=16");
  EXPECT_GT(kivi.find("kld_mean")->as_number(), 0.0);
  EXPECT_LT(kivi.find("bits_per_element")->as_number(), 16.0);
  EXPECT_EQ(kivi.find("ppl_fp16")->as_number(), ref.find("ppl")->as_number());
  // Decode phase: the last 16 positions of each window less the last, which predicts nothing.
  EXPECT_EQ(ref.find("tokens_decode")->as_number(), 2 * 15);
  EXPECT_EQ(ref.find("kld_mean_decode")->as_number(), 0.0);
  EXPECT_GT(kivi.find("kld_mean_decode")->as_number(), 0.0);
}

// Under the per-query semantics a window fed token by token scores exactly what the default
// protocol (prefill chunks, then decode) scores: the same numbers, not merely close ones.
TEST_F(CliModel, PplDoesNotDependOnChunking) {
  const std::string base = "ppl" + model_ + " --text " + source_dir() +
                           "/data/sotu_sample.txt --ctx 96 --windows 1 --method "
                           "kivi:group=8,residual=16 --method zipcache:group=8,residual=16 --json "
                           "--quiet";
  const RunResult a = run_kvq(base + " --chunk 32 --decode 16");
  const RunResult b = run_kvq(base + " --decode 95");
  ASSERT_EQ(a.status, 0) << a.out;
  ASSERT_EQ(b.status, 0) << b.out;
  auto ja = json::parse(a.out), jb = json::parse(b.out);
  ASSERT_TRUE(ja.ok() && jb.ok());
  for (size_t i = 0; i < ja->items().size(); ++i)
    for (const char* f : {"ppl", "kld_mean", "kld_p99", "top1_agree", "bits_per_element"})
      EXPECT_EQ(ja->items()[i].find(f)->as_number(), jb->items()[i].find(f)->as_number())
          << f << " of row " << i;
}

// The main job's short table: one line per cache, named by what differs from the method's
// defaults, the decode-phase columns, and the pointer to the wide table and the results page.
TEST_F(CliModel, PplShortTable) {
  const RunResult r = run_kvq("ppl" + model_ + " --text " + source_dir() +
                              "/data/sotu_sample.txt --ctx 64 --windows 1 --decode 8 --quiet "
                              "--method kivi:group=8,residual=16 --method kivi");
  ASSERT_EQ(r.status, 0) << r.out;
  std::vector<std::string> lines;
  for (size_t at = 0; at < r.out.size();) {
    const size_t nl = r.out.find('\n', at);
    lines.push_back(r.out.substr(at, nl - at));
    at = nl + 1;
  }
  ASSERT_GE(lines.size(), 5u) << r.out;
  EXPECT_EQ(lines[0].rfind("method", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find("kld_decode"), std::string::npos);
  EXPECT_EQ(lines[1].rfind("fp16 ", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("kivi:group=8,residual=16 ", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3].rfind("kivi ", 0), 0u) << lines[3];
  EXPECT_NE(r.out.find("Every column: --wide"), std::string::npos);
  const RunResult wide = run_kvq("ppl" + model_ + " --text " + source_dir() +
                                 "/data/sotu_sample.txt --ctx 64 --windows 1 --decode 8 --quiet "
                                 "--method kivi --wide");
  ASSERT_EQ(wide.status, 0);
  EXPECT_NE(wide.out.find("kivi:k_bits=2,v_bits=2,group=32,residual=128"), std::string::npos);
  EXPECT_NE(wide.out.find("kld_p99_d"), std::string::npos);
}

TEST_F(CliModel, GenerateIsGreedy) {
  const RunResult r = run_kvq("generate" + model_ + " --prompt 'Once upon a time' -n 12 --quiet");
  ASSERT_EQ(r.status, 0);
  EXPECT_EQ(r.out, "Once upon a time, there was a little girl named Lily. She\n");
}

// The ids `kvq tokenize` prints are the tokenizer's own, with no BOS (kvq ppl cuts its windows
// from the plain token stream), in both output forms.
TEST_F(CliModel, TokenizePrintsTheEngineIds) {
  const RunResult plain = run_kvq("tokenize" + model_ + " --prompt 'Once upon a time'");
  const RunResult js = run_kvq("tokenize" + model_ + " --prompt 'Once upon a time' --json");
  ASSERT_EQ(plain.status, 0) << plain.out;
  ASSERT_EQ(js.status, 0) << js.out;
  auto arr = json::parse(js.out);
  ASSERT_TRUE(arr.ok() && arr->is_array()) << js.out;
  std::vector<int32_t> ids;
  std::string joined;
  for (const auto& v : arr->items()) {
    ids.push_back(static_cast<int32_t>(v.as_number()));
    joined += (joined.empty() ? "" : " ") + std::to_string(ids.back());
  }
  EXPECT_EQ(plain.out, joined + "\n");
  auto tok = model::load_llama2c_tokenizer(dir_ + "/tok512.bin");
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  EXPECT_EQ(ids, (*tok)->encode("Once upon a time"));
  EXPECT_EQ((*tok)->decode(ids), " Once upon a time");  // SentencePiece's dummy prefix
  EXPECT_EQ(run_kvq("tokenize" + model_).status, 1);  // neither --text nor --prompt
}

TEST_F(CliModel, DumpKvWritesPostRopeTensors) {
  const std::string out = ::testing::TempDir() + "/kvq_dump_test.safetensors";
  const RunResult r = run_kvq("dump-kv" + model_ + " --text " + source_dir() +
                              "/data/sotu_sample.txt --ctx 40 --layers 1,3 --dtype f32 -o " + out);
  ASSERT_EQ(r.status, 0);
  auto f = read_safetensors(out);
  ASSERT_TRUE(f.ok()) << f.status().to_string();
  ASSERT_EQ(f->tensors.size(), 6u);
  EXPECT_EQ(f->tensors[0].name, "layers.1.k");
  EXPECT_EQ(f->tensors[0].shape, (std::vector<int64_t>{1, 4, 40, 8}));
  EXPECT_EQ(f->tensors[2].name, "layers.1.q");
  EXPECT_EQ(f->tensors[2].shape, (std::vector<int64_t>{1, 8, 40, 8}));
  EXPECT_EQ(f->metadata.at("layers"), "1,3");
  EXPECT_EQ(f->metadata.at("tokens"), "40");
  // Position 0 is not rotated: its keys are the plain projection (nonzero), and the file's
  // tokens include BOS (llama2.c models add it).
  float norm = 0;
  auto k = f->tensors[0].view4();
  ASSERT_TRUE(k.ok());
  for (int d = 0; d < 8; ++d) norm += k->load(0, 0, 0, d) * k->load(0, 0, 0, d);
  EXPECT_GT(norm, 0.0f);
}

TEST_F(CliModel, BadArgumentsAreReported) {
  EXPECT_EQ(run_kvq("ppl" + model_ + " --ctx 1").status, 1);
  EXPECT_EQ(run_kvq("ppl" + model_ + " --method kiwi").status, 1);
  EXPECT_EQ(run_kvq("ppl --model " + dir_ + "/stories260K.bin").status, 1);  // no tokenizer
  EXPECT_EQ(run_kvq("ppl" + model_ + " --bogus").status, 1);
  EXPECT_EQ(run_kvq("generate" + model_).status, 1);  // no prompt
  EXPECT_EQ(run_kvq("dump-kv" + model_ + " --text /nonexistent -o /tmp/x").status, 1);
  EXPECT_EQ(run_kvq("ppl --help").status, 0);
}

}  // namespace
}  // namespace kvq
