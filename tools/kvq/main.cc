// kvq — command-line entry point. Each subcommand declares itself in its own cmd_*.cc; this
// table is the one list of them (kvq --help prints it in this order).
#include "commands.h"

int main(int argc, char** argv) {
  namespace cli = kvq::cli;
  const std::vector<cli::Command> commands = {
      cli::list_command(),       cli::bench_command(),   cli::ppl_command(),
      cli::generate_command(),   cli::dump_kv_command(), cli::compress_command(),
      cli::decompress_command(), cli::info_command(),    cli::xquant_pairs_command(),
      cli::tokenize_command(),   cli::store_command(),
  };
  return cli::run_tool(commands, argc, argv);
}
