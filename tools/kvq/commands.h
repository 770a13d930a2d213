// The kvq command-line tool: one file per subcommand, registered in main.cc's table.
#pragma once

#include <string>
#include <vector>

namespace kvq::cli {

// Every subcommand receives its arguments (without the program and subcommand names) and
// returns the process exit status: 0 on success, 1 on a user error (after printing one line
// "kvq <cmd>: error: ..." to stderr), 2 on a usage error.
using Args = std::vector<std::string>;

int cmd_list(const Args& args);
int cmd_bench(const Args& args);
int cmd_ppl(const Args& args);
int cmd_generate(const Args& args);
int cmd_dump_kv(const Args& args);
int cmd_compress(const Args& args);
int cmd_decompress(const Args& args);
int cmd_info(const Args& args);
int cmd_xquant_pairs(const Args& args);

}  // namespace kvq::cli
