// kvq — command-line entry point. Each subcommand lives in its own cmd_*.cc file and is one row
// of the table below.
#include <cstdio>
#include <cstring>
#include <string>

#include "commands.h"
#include "kvq/version.h"

namespace {

struct Command {
  const char* name;
  int (*run)(const kvq::cli::Args&);
  const char* summary;
};

constexpr Command kCommands[] = {
    {"list", kvq::cli::cmd_list, "print the method table (--json)"},
    {"bench", kvq::cli::cmd_bench, "compress one K/V set and report size, error and speed"},
    {"ppl", kvq::cli::cmd_ppl, "teacher-forced quality of methods on a real model (KLD, PPL)"},
    {"generate", kvq::cli::cmd_generate, "greedy generation through a compressed cache"},
    {"dump-kv", kvq::cli::cmd_dump_kv, "write a model's real post-RoPE K/V to safetensors"},
    {"compress", kvq::cli::cmd_compress, "compress K/V from safetensors into a .kvq file"},
    {"decompress", kvq::cli::cmd_decompress,
     "write a .kvq file's K/V, dequantized, to safetensors"},
    {"info", kvq::cli::cmd_info, "describe a .kvq file: method, layers, sizes, checksums (--json)"},
    {"xquant-pairs", kvq::cli::cmd_xquant_pairs,
     "measure cross-layer K/V similarity and choose XQuant pairs"},
};

void usage(FILE* f) {
  std::fprintf(f, "kvq %s — KV-cache compression\n\nUsage: kvq <command> [options]\n\nCommands:\n",
               KVQ_VERSION_STRING);
  for (const auto& c : kCommands) std::fprintf(f, "  %-10s %s\n", c.name, c.summary);
  std::fprintf(f, "\n  kvq --version    print the version\n  kvq <command> --help\n");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  if (cmd == "--version" || cmd == "version") {
    std::printf("kvq %s\n", KVQ_VERSION_STRING);
    return 0;
  }
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    usage(stdout);
    return 0;
  }
  for (const auto& c : kCommands) {
    if (cmd == c.name) return c.run(kvq::cli::Args(argv + 2, argv + argc));
  }
  std::fprintf(stderr, "kvq: error: unknown command '%s' (see kvq --help)\n", cmd.c_str());
  return 2;
}
