// The CLI driver end to end (tools/kvq/driver.cc): kvq --help lists the commands of the one
// table, every command's --help/-h works, and every argument error is one line
// "kvq <cmd>: error: ..." with the documented exit status (2: no such command; 1: anything a
// command rejects, its arguments included). Runs the built `kvq` binary.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/json.h"
#include "test_util.h"

namespace kvq {
namespace {

using testing::read_whole;
using testing::shell_quote;

struct Outcome {
  int rc = -1;
  std::string out, err;
};

class CliDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    kvq_ = std::string(KVQ_BINARY_DIR) + "/kvq";
    if (!testing::file_exists(kvq_)) GTEST_SKIP() << "no kvq binary at " << kvq_;
    const char* t = std::getenv("TMPDIR");
    base_ = std::string(t ? t : "/tmp") + "/kvq_driver_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
  }
  void TearDown() override {
    std::remove((base_ + ".out").c_str());
    std::remove((base_ + ".err").c_str());
  }

  Outcome kvq(const std::vector<std::string>& args) const {
    std::string cmd = shell_quote(kvq_);
    for (const auto& a : args) cmd += " " + shell_quote(a);
    cmd +=
        " > " + shell_quote(base_ + ".out") + " 2> " + shell_quote(base_ + ".err") + " < /dev/null";
    const int st = std::system(cmd.c_str());
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_whole(base_ + ".out"),
            read_whole(base_ + ".err")};
  }

  // A failure: status `rc`, nothing on stdout, and stderr exactly `line` and a newline.
  void expect_error(const std::vector<std::string>& args, int rc, const std::string& line) const {
    const Outcome r = kvq(args);
    std::string shown;
    for (const auto& a : args) shown += " " + a;
    EXPECT_EQ(r.rc, rc) << "kvq" << shown;
    EXPECT_EQ(r.err, line + "\n") << "kvq" << shown;
    EXPECT_EQ(r.out, "") << "kvq" << shown;
  }

  // The command names from kvq --help's "Commands:" section: the table main.cc declares.
  std::vector<std::string> listed_commands() const {
    const Outcome r = kvq({"--help"});
    std::vector<std::string> names;
    std::istringstream lines(r.out);
    bool in_list = false;
    for (std::string line; std::getline(lines, line);) {
      if (line == "Commands:") {
        in_list = true;
      } else if (in_list && line.empty()) {
        break;
      } else if (in_list) {
        std::istringstream words(line);
        std::string name;
        words >> name;
        names.push_back(name);
      }
    }
    return names;
  }

  std::string kvq_, base_;
};

TEST_F(CliDriver, ToolHelpListsEveryCommand) {
  const std::vector<std::string> want = {"list",         "bench",    "ppl",        "generate",
                                         "dump-kv",      "compress", "decompress", "info",
                                         "xquant-pairs", "tokenize", "store"};
  EXPECT_EQ(listed_commands(), want);
  const Outcome help = kvq({"--help"});
  EXPECT_EQ(help.rc, 0);
  EXPECT_EQ(help.err, "");
  EXPECT_EQ(help.out.rfind("kvq ", 0), 0u) << help.out;
  for (const char* same : {"-h", "help"}) {
    const Outcome r = kvq({same});
    EXPECT_EQ(r.rc, 0) << same;
    EXPECT_EQ(r.out, help.out) << same;
  }
  // No command at all is a usage error: the same help, on stderr.
  const Outcome none = kvq({});
  EXPECT_EQ(none.rc, 2);
  EXPECT_EQ(none.out, "");
  EXPECT_EQ(none.err, help.out);
  const Outcome version = kvq({"--version"});
  EXPECT_EQ(version.rc, 0);
  EXPECT_EQ(version.out.rfind("kvq ", 0), 0u) << version.out;
}

TEST_F(CliDriver, EveryCommandHasHelp) {
  for (const std::string& c : listed_commands()) {
    const Outcome help = kvq({c, "--help"});
    EXPECT_EQ(help.rc, 0) << c;
    EXPECT_EQ(help.err, "") << c;
    EXPECT_EQ(help.out.rfind("Usage: kvq " + c + " ", 0), 0u) << help.out;
    EXPECT_NE(help.out.find("\nOptions:\n"), std::string::npos) << help.out;
    EXPECT_NE(help.out.find("  -h, --help  "), std::string::npos) << help.out;
    for (const std::vector<std::string>& same :
         {std::vector<std::string>{c, "-h"}, {"help", c}, {c, "--help", "--no-such-option"}}) {
      const Outcome r = kvq(same);
      EXPECT_EQ(r.rc, 0) << c;
      EXPECT_EQ(r.out, help.out) << c << " (" << same[0] << " " << same[1] << ")";
    }
  }
}

TEST_F(CliDriver, HelpShowsDeclaredArgumentsAndDefaults) {
  const Outcome r = kvq({"compress", "--help"});
  EXPECT_NE(r.out.find("Arguments:\n  IN.safetensors  "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("  -o, --output OUT.kvq  the .kvq file to write (required)"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("(default 4096)"), std::string::npos) << r.out;
}

TEST_F(CliDriver, GroupsDispatchToTheirCommands) {
  // kvq store is a group: its help lists its commands, each of which has the usual help and
  // errors under the name "kvq store <command>".
  const Outcome g = kvq({"store", "--help"});
  EXPECT_EQ(g.rc, 0);
  EXPECT_NE(g.out.find("\nCommands:\n  ls  "), std::string::npos) << g.out;
  const Outcome none = kvq({"store"});
  EXPECT_EQ(none.rc, 2);
  EXPECT_EQ(none.err, g.out);
  const Outcome ls = kvq({"store", "ls", "--help"});
  EXPECT_EQ(ls.rc, 0);
  EXPECT_EQ(ls.out.rfind("Usage: kvq store ls ", 0), 0u) << ls.out;
  EXPECT_EQ(kvq({"help", "store", "ls"}).out, ls.out);
  EXPECT_EQ(kvq({"help", "store"}).out, g.out);
  expect_error({"store", "lz"}, 2, "kvq store: error: unknown command 'lz' (did you mean 'ls'?)");
  expect_error({"store", "ls"}, 1,
               "kvq store ls: error: --store is required (see kvq store ls --help)");
  expect_error({"store", "get", "--store", "dir:/tmp"}, 1,
               "kvq store get: error: missing KEY: the object's key (kvq store ls lists them)");
}

TEST_F(CliDriver, UnknownCommand) {
  expect_error({"frobnicate"}, 2, "kvq: error: unknown command 'frobnicate' (see kvq --help)");
  expect_error({"benhc"}, 2, "kvq: error: unknown command 'benhc' (did you mean 'bench'?)");
  expect_error({"help", "compres"}, 2,
               "kvq: error: unknown command 'compres' (did you mean 'compress'?)");
}

TEST_F(CliDriver, UnknownOptionSuggestsTheClosest) {
  expect_error({"bench", "--metod", "kivi"}, 1,
               "kvq bench: error: unknown option --metod (did you mean --method?)");
  expect_error({"info", "x.kvq", "--jsn"}, 1,
               "kvq info: error: unknown option --jsn (did you mean --json?)");
  expect_error({"list", "--hlep"}, 1,
               "kvq list: error: unknown option --hlep (did you mean --help?)");
  expect_error({"list", "--zzzzzzzz"}, 1, "kvq list: error: unknown option --zzzzzzzz");
  expect_error({"compress", "-x"}, 1, "kvq compress: error: unknown option -x");
}

TEST_F(CliDriver, OptionValues) {
  expect_error({"bench", "--method"}, 1, "kvq bench: error: --method needs a value");
  expect_error({"decompress", "in.kvq", "-o"}, 1, "kvq decompress: error: -o needs a value");
  expect_error({"list", "--json=yes"}, 1, "kvq list: error: --json takes no value");
  expect_error({"bench", "--seed", "1", "--seed", "2"}, 1,
               "kvq bench: error: --seed given more than once");
  expect_error({"bench", "--tokens", "many"}, 1,
               "kvq bench: error: --tokens expects an integer, got 'many'");
  expect_error({"bench", "--min-time=soon"}, 1,
               "kvq bench: error: --min-time expects a number, got 'soon'");
}

TEST_F(CliDriver, PositionalsAndRequiredOptions) {
  expect_error({"info"}, 1,
               "kvq info: error: missing IN.kvq: the .kvq file to describe, or - for standard "
               "input");
  expect_error({"info", "a.kvq", "b.kvq"}, 1, "kvq info: error: unexpected argument 'b.kvq'");
  expect_error({"list", "extra"}, 1, "kvq list: error: unexpected argument 'extra'");
  expect_error({"compress", "in.safetensors", "-o", "out.kvq"}, 1,
               "kvq compress: error: --method is required (see kvq compress --help)");
  expect_error({"decompress", "in.kvq"}, 1,
               "kvq decompress: error: --output (-o) is required (see kvq decompress --help)");
}

TEST_F(CliDriver, DefaultsInlineValuesAndShortForms) {
  // --key=value, and the declared default of --method (kivi at its defaults).
  const Outcome r = kvq({"bench", "--tokens=64", "--heads", "1", "--dim", "8", "--layers=1",
                         "--min-time", "0", "--json"});
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = json::parse(r.out);
  ASSERT_TRUE(j.ok()) << r.out;
  EXPECT_EQ(j->find("method")->as_string(), "kivi:k_bits=2,v_bits=2,group=32,residual=128");
  EXPECT_EQ(j->find("tokens")->as_number(), 64);
  // A short form is an option only where an option may stand: as a value it is the value.
  expect_error({"compress", "--method", "-o", "in.safetensors"}, 1,
               "kvq compress: error: --output (-o) is required (see kvq compress --help)");
}

}  // namespace
}  // namespace kvq
