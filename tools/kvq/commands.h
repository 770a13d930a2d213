// The kvq command-line tool. Each subcommand declares itself — name, summary, usage, options,
// positional arguments and a run function — in its own cmd_*.cc, and main.cc lists the
// declarations in one table. The driver (driver.cc) does the rest for all of them alike:
// parsing, --help, the checks the declaration implies, error lines and exit codes.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "args.h"
#include "kvq/status.h"

namespace kvq::cli {

struct Positional {
  std::string name;  // as --help and the errors show it, e.g. "IN.kvq"
  std::string help;
};

struct Command {
  // What every command has; the rest is set after, where a command has it.
  Command(std::string cmd_name, std::string cmd_summary, std::string cmd_usage,
          Status (*cmd_run)(const ParsedArgs& args))
      : name(std::move(cmd_name)),
        summary(std::move(cmd_summary)),
        usage(std::move(cmd_usage)),
        run(cmd_run) {}

  std::string name;     // kvq <name>
  std::string summary;  // its line in kvq --help
  std::string usage;    // the synopsis after "Usage: kvq <name> "
  // Printed between the usage line and the options in --help; empty for none.
  std::string description;
  std::vector<Option> options;          // --help and -h are every command's, added by the driver
  std::vector<Positional> positionals;  // each one required, in this order, and no others
  // Runs with arguments that passed the declaration's checks. An error is printed as one line
  // "kvq <name>: error: <message>" and the tool exits 1; anything printed before stays.
  // Null for a group.
  Status (*run)(const ParsedArgs& args);
  // A group (kvq store ls|get|...): the first argument names one of these, which then runs as
  // "kvq <name> <sub>" with the rest. A group has no options or positionals of its own.
  std::vector<Command> subcommands;
};

Command list_command();
Command bench_command();
Command ppl_command();
Command generate_command();
Command dump_kv_command();
Command compress_command();
Command decompress_command();
Command info_command();
Command xquant_pairs_command();
Command tokenize_command();
Command store_command();

// The whole tool: `kvq <command> [arguments]` dispatched to one of `commands`, plus kvq --help,
// kvq help <command>, kvq --version. Returns the exit status: 0 on success; 2 when the command
// line names no known command; 1 for every error a command reports, the errors in its
// arguments included (scripts and tests rely on that 1, so the split stays at the command).
int run_tool(const std::vector<Command>& commands, int argc, char** argv);

}  // namespace kvq::cli
