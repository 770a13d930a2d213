// The store through the kvq binary, process against process (stories260K, a directory and a
// real redis-server): two processes derive the same keys; one stores, another reuses and
// generates the same text; concurrent writers; a store that is down; a damaged object; ppl;
// kvq store ls|stats|get|put|rm.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "core/json.h"
#include "model/llama.h"
#include "store/store_util.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::read_whole;

struct Outcome {
  int rc = -1;
  std::string out, err;
};

const char* kPrompt =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "sunshine. One day, she saw a big tree in the garden and wanted to climb it. Her mom said "
    "it was too high, so Lily found a ladder and asked her brother Tom to help her.";

class CliStore : public ::testing::Test {
 protected:
  void SetUp() override {
    kvq_ = std::string(KVQ_BINARY_DIR) + "/kvq";
    const std::string dir = testing::shared_dir() + "/models/stories260K";
    if (!testing::file_exists(kvq_)) GTEST_SKIP() << "no kvq binary";
    if (!testing::file_exists(dir + "/stories260K.bin")) GTEST_SKIP() << "stories260K not found";
    model_ = {"--model", dir + "/stories260K.bin", "--tokenizer", dir + "/tok512.bin"};
    auto made = testing::make_test_dir("cli-store");
    ASSERT_TRUE(made.ok()) << made.status().message();
    tmp_ = *made;
  }
  void TearDown() override {
    std::error_code ec;
    if (!tmp_.empty()) std::filesystem::remove_all(tmp_, ec);
  }
  // Runs kvq with `args` in its own process (in `cwd` when given); stdout and stderr captured.
  Outcome kvq(const std::vector<std::string>& args, const std::string& env = "",
              const std::string& tag = "run") const {
    std::string cmd = env + " " + testing::shell_quote(kvq_);
    for (const auto& a : args) cmd += " " + testing::shell_quote(a);
    const std::string out = tmp_ + "/" + tag + ".out", err = tmp_ + "/" + tag + ".err";
    cmd += " > " + testing::shell_quote(out) + " 2> " + testing::shell_quote(err) + " < /dev/null";
    const int st = std::system(cmd.c_str());
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_whole(out), read_whole(err)};
  }
  std::vector<std::string> generate(const std::string& method, const std::string& store = "",
                                    const std::string& prompt = kPrompt) const {
    std::vector<std::string> a = {"generate"};
    a.insert(a.end(), model_.begin(), model_.end());
    a.insert(a.end(), {"--prompt", prompt, "--method", method, "-n", "24"});
    if (!store.empty()) a.insert(a.end(), {"--store", store, "--store-chunk", "16"});
    return a;
  }
  std::string kvq_, tmp_;
  std::vector<std::string> model_;
};

const char* kKivi = "kivi:k_bits=2,v_bits=2,group=8,residual=16";

TEST_F(CliStore, TwoProcessesDeriveTheSameKeysAsTheLibrary) {
  std::vector<std::string> a = {"store", "keys"};
  a.insert(a.end(), model_.begin(), model_.end());
  a.insert(a.end(), {"--prompt", kPrompt, "--method", kKivi, "--store-chunk", "16"});
  // Different processes, environments and working directories: nothing may leak into a key.
  const Outcome one = kvq(a, "", "one");
  const Outcome two = kvq(a, "cd / && MALLOC_PERTURB_=7 PYTHONHASHSEED=123", "two");
  ASSERT_EQ(one.rc, 0) << one.err;
  ASSERT_EQ(two.rc, 0) << two.err;
  EXPECT_EQ(one.out, two.out);
  // And they are the library's keys for the same tokens.
  const std::string dir = testing::shared_dir() + "/models/stories260K";
  auto m = model::LlamaModel::load(dir + "/stories260K.bin", dir + "/tok512.bin");
  ASSERT_TRUE(m.ok());
  std::vector<int32_t> ids;
  if (m->tokenizer()->add_bos()) ids.push_back(m->tokenizer()->bos_id());
  for (int32_t id : m->tokenizer()->encode(kPrompt)) ids.push_back(id);
  auto cache = ModelCache::create(kKivi, m->cache_shape());
  auto fp = fingerprint_files({dir + "/stories260K.bin", dir + "/tok512.bin"});
  ASSERT_TRUE(fp.ok());
  auto ns = make_store_namespace(*cache, *fp, 16, "kvq-engine/1");
  ASSERT_TRUE(ns.ok());
  EXPECT_EQ(one.out.rfind("namespace " + ns->id().hex() + "\n" + ns->descriptor(), 0), 0u)
      << one.out;
  const auto keys = chunk_keys(*ns, ids);
  ASSERT_GE(keys.size(), 3u);
  for (const auto& k : keys)
    EXPECT_NE(one.out.find(store_object_key(*ns, k, StoreObjectKind::kBlocks)), std::string::npos);
}

TEST_F(CliStore, OneProcessStoresAnotherReuses) {
  const Outcome plain = kvq(generate(kKivi));
  ASSERT_EQ(plain.rc, 0) << plain.err;
  std::string why;
  testing::RedisServer* redis = testing::shared_redis(&why);
  std::vector<std::string> urls = {"dir:" + tmp_ + "/store"};
  if (redis) urls.push_back(redis->url());
  for (const std::string& url : urls) {
    SCOPED_TRACE(url);
    const Outcome first = kvq(generate(kKivi, url), "", "first");
    ASSERT_EQ(first.rc, 0) << first.err;
    EXPECT_EQ(first.out, plain.out);
    EXPECT_NE(first.err.find("reused 0 of"), std::string::npos) << first.err;
    const Outcome second = kvq(generate(kKivi, url), "cd / &&", "second");
    ASSERT_EQ(second.rc, 0) << second.err;
    EXPECT_EQ(second.out, plain.out);
    EXPECT_NE(second.err.find("reused 96 of 100"), std::string::npos) << second.err;  // 6 x 16
    EXPECT_NE(second.err.find("stored 0 chunks"), std::string::npos) << second.err;
    // Another method is another namespace: nothing to reuse, then its own chunks.
    const Outcome other = kvq(generate("fp16", url), "", "other");
    ASSERT_EQ(other.rc, 0);
    EXPECT_NE(other.err.find("reused 0 of"), std::string::npos) << other.err;
    const Outcome ls = kvq({"store", "ls", "--store", url});
    ASSERT_EQ(ls.rc, 0) << ls.err;
    size_t namespaces = 0;
    for (size_t at = 0; (at = ls.out.find("namespace ", at)) != std::string::npos; ++at)
      ++namespaces;
    EXPECT_EQ(namespaces, 2u) << ls.out;
    EXPECT_NE(ls.out.find("fp16, model "), std::string::npos) << ls.out;
    EXPECT_NE(ls.out.find("chunk     5  tokens      80..96      tail"), std::string::npos)
        << ls.out;
    const Outcome stats = kvq({"store", "stats", "--store", url});
    EXPECT_NE(stats.out.find("24 objects"), std::string::npos) << stats.out;  // 2 x 6 x 2
    EXPECT_NE(stats.out.find("2 namespaces"), std::string::npos) << stats.out;
    const Outcome rm = kvq({"store", "rm", "--store", url, "--prefix", "kvq1:"});
    EXPECT_EQ(rm.rc, 0);
    EXPECT_EQ(rm.out, "removed 24 keys\n");
  }
}

TEST_F(CliStore, TwoWritersAtOnceThenAReuse) {
  std::string why;
  testing::RedisServer* redis = testing::shared_redis(&why);
  if (!redis) GTEST_SKIP() << why;
  ASSERT_TRUE(redis->command({"FLUSHALL"}).ok());
  const Outcome plain = kvq(generate(kKivi));
  Outcome a, b;
  std::thread ta([&] { a = kvq(generate(kKivi, redis->url()), "", "a"); });
  std::thread tb([&] { b = kvq(generate(kKivi, redis->url()), "", "b"); });
  ta.join();
  tb.join();
  ASSERT_EQ(a.rc, 0) << a.err;
  ASSERT_EQ(b.rc, 0) << b.err;
  EXPECT_EQ(a.out, plain.out);
  EXPECT_EQ(b.out, plain.out);
  const Outcome c = kvq(generate(kKivi, redis->url()), "", "c");
  EXPECT_EQ(c.out, plain.out);
  EXPECT_NE(c.err.find("reused 96 of"), std::string::npos) << c.err;
}

TEST_F(CliStore, AStoreThatIsDownNeverFailsTheRequest) {
  const Outcome plain = kvq(generate(kKivi));
  const Outcome down = kvq(generate(kKivi, "redis://127.0.0.1:1?connect_timeout_ms=300"));
  EXPECT_EQ(down.rc, 0) << down.err;
  EXPECT_EQ(down.out, plain.out);
  EXPECT_NE(down.err.find("kvq generate: store: lookup: redis cannot connect to 127.0.0.1:1"),
            std::string::npos)
      << down.err;
  EXPECT_NE(down.err.find("failed"), std::string::npos);
  // A store URL that is wrong, or a chunk the method's blocks do not divide, is the user's error.
  auto bad = generate(kKivi, "memcached://x");
  const Outcome b = kvq(bad);
  EXPECT_EQ(b.rc, 1);
  EXPECT_NE(b.err.find("kvq generate: error: --store: unknown store URL"), std::string::npos)
      << b.err;
  auto misaligned = generate(kKivi, "dir:" + tmp_ + "/s");
  misaligned.back() = "12";  // --store-chunk 12, blocks of 8
  const Outcome m = kvq(misaligned);
  EXPECT_EQ(m.rc, 1);
  EXPECT_NE(m.err.find("not a multiple of layer 0's 8-token blocks"), std::string::npos) << m.err;
}

TEST_F(CliStore, ADamagedObjectIsAShorterReuseReported) {
  const std::string url = "dir:" + tmp_ + "/store";
  const Outcome plain = kvq(generate(kKivi));
  ASSERT_EQ(kvq(generate(kKivi, url)).rc, 0);
  const Outcome ls = kvq({"store", "ls", "--store", url, "--json"});
  auto j = json::parse(ls.out);
  ASSERT_TRUE(j.ok()) << ls.out;
  std::string chunk1;
  for (const auto& row : j->items())
    if (row.find("chunk")->as_number() == 1 && row.find("kind")->as_string() == "blocks")
      chunk1 = row.find("key")->as_string();
  ASSERT_FALSE(chunk1.empty()) << ls.out;
  // Out, one byte flipped, back in.
  ASSERT_EQ(kvq({"store", "get", "--store", url, chunk1, "-o", tmp_ + "/obj"}).rc, 0);
  std::string bytes = read_whole(tmp_ + "/obj");
  ASSERT_GT(bytes.size(), 100u);
  bytes[bytes.size() / 2] ^= 1;
  std::ofstream(tmp_ + "/obj", std::ios::binary) << bytes;
  ASSERT_EQ(kvq({"store", "put", "--store", url, chunk1, tmp_ + "/obj"}).rc, 0);
  const Outcome verify = kvq({"store", "ls", "--store", url, "--verify"});
  EXPECT_NE(verify.out.find("(checksum mismatch)"), std::string::npos) << verify.out;
  const Outcome again = kvq(generate(kKivi, url));
  EXPECT_EQ(again.rc, 0);
  EXPECT_EQ(again.out, plain.out);
  EXPECT_NE(again.err.find("blocks of chunk 1 (tokens 16..32): blocks object of chunk 1: "
                           "checksum mismatch; treated as a miss"),
            std::string::npos)
      << again.err;
  EXPECT_NE(again.err.find("reused 16 of"), std::string::npos) << again.err;
  // The run stored chunk 1 again: the store is repaired.
  const Outcome repaired = kvq(generate(kKivi, url));
  EXPECT_NE(repaired.err.find("reused 96 of"), std::string::npos) << repaired.err;
  EXPECT_EQ(kvq({"store", "rm", "--store", url, chunk1}).rc, 0);
  EXPECT_EQ(kvq({"store", "get", "--store", url, chunk1, "-o", "-"}).rc, 1);
}

TEST_F(CliStore, PplReusesPrefixesAndScoresTheRest) {
  std::vector<std::string> a = {"ppl"};
  a.insert(a.end(), model_.begin(), model_.end());
  a.insert(a.end(), {"--text", testing::source_dir() + "/data/sotu_sample.txt", "--ctx", "128",
                     "--windows", "2", "--decode", "16", "--method", kKivi, "--json", "--quiet"});
  const Outcome plain = kvq(a, "", "plain");
  ASSERT_EQ(plain.rc, 0) << plain.err;
  auto with = a;
  with.insert(with.end(), {"--store", "dir:" + tmp_ + "/ppl", "--store-chunk", "32"});
  const Outcome first = kvq(with, "", "first");
  const Outcome second = kvq(with, "", "second");
  ASSERT_EQ(first.rc, 0) << first.err;
  ASSERT_EQ(second.rc, 0) << second.err;
  auto p = json::parse(plain.out), f = json::parse(first.out), s = json::parse(second.out);
  ASSERT_TRUE(p.ok() && f.ok() && s.ok());
  for (size_t row = 0; row < 2; ++row) {
    const json::Value &pr = p->items()[row], &fr = f->items()[row], &sr = s->items()[row];
    // An empty store: the same figures. A full one: the prefill's first 96 tokens of each window
    // are imported, not scored; the decode phase is scored alike.
    for (const char* k : {"ppl", "kld_mean", "top1_agree", "tokens"})
      EXPECT_EQ(fr.find(k)->as_number(), pr.find(k)->as_number()) << k;
    EXPECT_EQ(fr.find("tokens_reused")->as_number(), 0);
    EXPECT_EQ(sr.find("tokens_reused")->as_number(), 2 * 96);
    EXPECT_EQ(sr.find("tokens")->as_number(), pr.find("tokens")->as_number() - 2 * 96);
    for (const char* k : {"ppl_decode", "kld_mean_decode", "top1_agree_decode", "bits_per_element"})
      EXPECT_EQ(sr.find(k)->as_number(), pr.find(k)->as_number()) << k;
  }
}

}  // namespace
}  // namespace kvq
