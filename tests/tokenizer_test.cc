// Tokenizers: ids of a few thousand words against stored ids from independent references
// (llama.cpp for SmolLM2's byte-level BPE; a Python re-implementation of llama2.c's encoder for
// stories260K — scripts/reference_logits.py regenerates them), plus properties: decode(encode(x))
// == x, the priority-queue merge loop equals the textbook quadratic loop, malformed files fail.
#include "model/tokenizer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <sstream>

#include "core/file_io.h"
#include "model/unicode.h"
#include "test_util.h"

namespace kvq::model {
namespace {

using kvq::testing::file_exists;
using kvq::testing::shared_dir;
using kvq::testing::source_dir;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::vector<int32_t> read_ids(const std::string& path) {
  std::ifstream f(path);
  std::vector<int32_t> ids;
  int32_t x;
  while (f >> x) ids.push_back(x);
  return ids;
}

std::string smollm2_path() { return source_dir() + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"; }
std::string stories_dir() { return shared_dir() + "/models/stories260K"; }

// Index of the first difference, for readable failures on long id lists.
void expect_same_ids(const std::vector<int32_t>& got, const std::vector<int32_t>& want) {
  const size_t n = std::min(got.size(), want.size());
  for (size_t i = 0; i < n; ++i)
    ASSERT_EQ(got[i], want[i]) << "first difference at token " << i << " of " << want.size();
  ASSERT_EQ(got.size(), want.size());
}

class SmolLM2Tokenizer : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!file_exists(smollm2_path())) return;
    auto f = gguf::File::open(smollm2_path());
    ASSERT_TRUE(f.ok()) << f.status().to_string();
    auto t = load_gguf_tokenizer(*f);
    ASSERT_TRUE(t.ok()) << t.status().to_string();
    tok_ = std::move(*t).release();
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (!tok_) GTEST_SKIP() << smollm2_path() << " not found (run scripts/fetch_model.sh)";
  }
  static Tokenizer* tok_;
};
Tokenizer* SmolLM2Tokenizer::tok_ = nullptr;

TEST_F(SmolLM2Tokenizer, MatchesLlamaCppOnThousandsOfWords) {
  const std::string text = slurp(source_dir() + "/tests/data/tokenizer_text.txt");
  const std::vector<int32_t> want =
      read_ids(source_dir() + "/tests/data/smollm2_tokenizer_ids.txt");
  ASSERT_GT(want.size(), 4000u);
  const std::vector<int32_t> got = tok_->encode(text);
  expect_same_ids(got, want);
  EXPECT_EQ(tok_->decode(got), text);
}

TEST_F(SmolLM2Tokenizer, SmallCases) {
  EXPECT_EQ(tok_->vocab_size(), 49152);
  EXPECT_EQ(tok_->bos_id(), 1);
  EXPECT_EQ(tok_->eos_id(), 2);
  EXPECT_FALSE(tok_->add_bos());
  EXPECT_EQ(tok_->encode("Hello world"), (std::vector<int32_t>{19556, 905}));
  // smollm isolates every digit; the space before them is a piece of its own.
  EXPECT_EQ(tok_->encode(" 123 abc"), (std::vector<int32_t>{216, 33, 34, 35, 43239}));
  EXPECT_EQ(tok_->encode("a  b\n\nc"), (std::vector<int32_t>{81, 216, 278, 198, 198, 83}));
  EXPECT_TRUE(tok_->encode("").empty());
  // Special tokens are plain text unless asked for.
  EXPECT_GT(tok_->encode("<|im_start|>").size(), 1u);
  EXPECT_EQ(tok_->encode("<|im_start|>user", true).front(), 1);
  EXPECT_EQ(tok_->token_bytes(1), "<|im_start|>");
  // Invalid UTF-8: each bad byte becomes U+FFFD (token 24211), as in llama.cpp.
  const std::string bytes("\xff\xfe abc \xc3\x28 \xe2\x82", 12);
  EXPECT_EQ(tok_->encode(bytes),
            (std::vector<int32_t>{24211, 24211, 43239, 216, 24211, 24, 216, 24211, 24211}));
}

TEST_F(SmolLM2Tokenizer, LongRunsEncodeQuickly) {
  // One piece of 200k spaces, one of 100k punctuation marks: the merge loop is O(n log n).
  const std::string spaces(200000, ' ');
  EXPECT_EQ(tok_->decode(tok_->encode(spaces)), spaces);
  const std::string punct(100000, '=');
  EXPECT_EQ(tok_->decode(tok_->encode(punct)), punct);
}

TEST(PreTokenizer, Gpt2AndSmollmSplits) {
  auto pieces = [](std::string_view s, PreTokenizer k) {
    std::vector<std::string> out;
    for (auto [b, e] : pre_tokenize(s, k)) out.emplace_back(s.substr(b, e - b));
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world", PreTokenizer::kGpt2), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("don't I'M", PreTokenizer::kGpt2), (V{"don", "'t", " I", "'", "M"}));
  EXPECT_EQ(pieces("x   \n  y", PreTokenizer::kGpt2), (V{"x", "   \n ", " y"}));
  EXPECT_EQ(pieces("a\n\nb", PreTokenizer::kGpt2), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces("end  ", PreTokenizer::kGpt2), (V{"end", "  "}));
  EXPECT_EQ(pieces("?'s !!", PreTokenizer::kGpt2), (V{"?'", "s", " !!"}));
  EXPECT_EQ(pieces(" 2024 ab", PreTokenizer::kGpt2), (V{" 2024", " ab"}));
  EXPECT_EQ(pieces(" 2024 ab", PreTokenizer::kSmollm), (V{" ", "2", "0", "2", "4", " ab"}));
  EXPECT_EQ(pieces("caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac", PreTokenizer::kGpt2),
            (V{"caf\xc3\xa9", " \xe6\x97\xa5\xe6\x9c\xac"}));
  // Every byte belongs to exactly one piece, in order.
  const std::string mixed = "a\xff\xfe b\xc3 1\t\t2";
  size_t next = 0;
  for (auto [b, e] : pre_tokenize(mixed, PreTokenizer::kSmollm)) {
    EXPECT_EQ(b, next);
    EXPECT_GT(e, b);
    next = e;
  }
  EXPECT_EQ(next, mixed.size());
}

TEST(Unicode, Classes) {
  using namespace kvq::unicode;
  EXPECT_TRUE(is_letter('a'));
  EXPECT_TRUE(is_letter(0x00E9));  // é
  EXPECT_TRUE(is_letter(0x65E5));  // 日
  EXPECT_FALSE(is_letter('1'));
  EXPECT_TRUE(is_number(0x0663));  // Arabic-Indic three
  EXPECT_TRUE(is_number(0x00B2));  // superscript two
  EXPECT_FALSE(is_number('a'));
  EXPECT_TRUE(is_whitespace(0x3000));
  EXPECT_FALSE(is_whitespace(0x200B));  // zero-width space is not White_Space
  uint32_t cp;
  EXPECT_EQ(utf8_decode("\xc0\xaf", 0, &cp), 1u);  // overlong: invalid, one byte
  EXPECT_EQ(cp, kInvalid);
  EXPECT_EQ(utf8_decode("\xf0\x9f\x99\x82", 0, &cp), 4u);
  EXPECT_EQ(cp, 0x1F642u);
}

// ---------------------------------------------------------------------------------------------
// llama2.c

TEST(Llama2cTokenizer, MatchesReferenceEncoder) {
  const std::string tok_path = stories_dir() + "/tok512.bin";
  if (!file_exists(tok_path)) GTEST_SKIP() << tok_path << " not found";
  auto tok = load_llama2c_tokenizer(tok_path, 512);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  const std::string text = slurp(source_dir() + "/tests/data/tokenizer_text.txt");
  const std::vector<int32_t> want =
      read_ids(source_dir() + "/tests/data/stories260k_tokenizer_ids.txt");
  ASSERT_GT(want.size(), 4000u);
  expect_same_ids((*tok)->encode(text), want);
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_TRUE((*tok)->add_bos());
  EXPECT_EQ((*tok)->token_bytes(13), "\n");  // "<0x0A>"
}

// The textbook loop: repeatedly merge the leftmost best-scoring pair.
std::vector<int32_t> naive_merge(std::vector<int32_t> ids, const std::vector<std::string>& vocab,
                                 const std::vector<float>& scores) {
  std::unordered_map<std::string, int32_t> index;
  for (size_t i = 0; i < vocab.size(); ++i) index.emplace(vocab[i], static_cast<int32_t>(i));
  while (true) {
    float best = -1e10f;
    int best_i = -1, best_id = -1;
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      auto it =
          index.find(vocab[static_cast<size_t>(ids[i])] + vocab[static_cast<size_t>(ids[i + 1])]);
      if (it != index.end() && scores[static_cast<size_t>(it->second)] > best) {
        best = scores[static_cast<size_t>(it->second)];
        best_i = static_cast<int>(i);
        best_id = it->second;
      }
    }
    if (best_i < 0) return ids;
    ids[static_cast<size_t>(best_i)] = best_id;
    ids.erase(ids.begin() + best_i + 1);
  }
}

TEST(Llama2cTokenizer, PriorityQueueMergeEqualsQuadraticLoop) {
  // A synthetic vocabulary with ties, overlapping pairs and spaces inside tokens.
  std::vector<std::string> vocab = {"<unk>", "<s>", "</s>"};
  std::vector<float> scores = {0, 0, 0};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    vocab.push_back(name);
    scores.push_back(0);
  }
  const std::vector<std::pair<std::string, float>> extra = {
      {" ", -1},  {"a", -1},    {"b", -1},  {"c", -1},   {"aa", -2},
      {"ab", -2}, {"ba", -3},   {"bb", -2}, {"aaa", -2}, {"a b", -4},
      {" a", -5}, {"abab", -1}, {"cc", -6}, {"c c", -6}, {"bab", -3}};
  for (const auto& [s, sc] : extra) {
    vocab.push_back(s);
    scores.push_back(sc);
  }
  const std::string path = ::testing::TempDir() + "/kvq_tok_test.bin";
  {
    std::ofstream f(path, std::ios::binary);
    const int32_t max_len = 8;
    f.write(reinterpret_cast<const char*>(&max_len), 4);
    for (size_t i = 0; i < vocab.size(); ++i) {
      const int32_t len = static_cast<int32_t>(vocab[i].size());
      f.write(reinterpret_cast<const char*>(&scores[i]), 4);
      f.write(reinterpret_cast<const char*>(&len), 4);
      f.write(vocab[i].data(), len);
    }
  }
  auto tok = load_llama2c_tokenizer(path);
  ASSERT_TRUE(tok.ok()) << tok.status().to_string();
  std::mt19937 rng(3);
  const char alphabet[] = "ab c";
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) s += alphabet[rng() % 4];
    const std::vector<int32_t> got = (*tok)->encode(s);
    // Unmerged ids: the dummy prefix, then one id per character.
    std::vector<int32_t> start = {static_cast<int32_t>(259)};  // " "
    for (char c : s) {
      const std::string one(1, c);
      start.push_back(
          static_cast<int32_t>(std::find(vocab.begin(), vocab.end(), one) - vocab.begin()));
    }
    ASSERT_EQ(got, naive_merge(start, vocab, scores)) << "input '" << s << "'";
  }
}

TEST(Llama2cTokenizer, MalformedFilesAreErrors) {
  const std::string tok_path = stories_dir() + "/tok512.bin";
  if (!file_exists(tok_path)) GTEST_SKIP() << tok_path << " not found";
  const std::string bytes = slurp(tok_path);
  const std::string cut = ::testing::TempDir() + "/kvq_tok_cut.bin";
  for (size_t n : {size_t{0}, size_t{3}, size_t{9}, bytes.size() / 2, bytes.size() - 1}) {
    std::ofstream(cut, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(n));
    auto t = load_llama2c_tokenizer(cut, 512);
    EXPECT_FALSE(t.ok()) << "prefix of " << n << " bytes";
  }
  EXPECT_EQ(load_llama2c_tokenizer(tok_path, 1000).status().code(), ErrorCode::kFormat);
  EXPECT_EQ(load_llama2c_tokenizer("/nonexistent/tok.bin").status().code(), ErrorCode::kIo);
}

}  // namespace
}  // namespace kvq::model
