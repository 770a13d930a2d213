// The one driver behind every subcommand (commands.h): what a declaration implies is done here,
// so that every command parses, helps and fails the same way.
#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "commands.h"
#include "kvq/spec.h"
#include "kvq/version.h"

namespace kvq::cli {

namespace {

constexpr int kExitOk = 0;
constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

// "  -o, --output FILE" / "      --json": long names line up whether or not a short one exists.
std::string option_synopsis(const Option& o) {
  std::string s = o.short_name ? std::string("  -") + o.short_name + ", --" : "      --";
  s += o.name;
  if (o.takes_value()) s += " " + o.value;
  return s;
}

std::string option_help(const Option& o) {
  if (o.is_required) return o.help + " (required)";
  return o.def.empty() ? o.help : o.help + " (default " + o.def + ")";
}

// Rows of "<left>  <right>", the right column aligned after the widest left one.
std::string two_columns(const std::vector<std::pair<std::string, std::string>>& rows) {
  size_t width = 0;
  for (const auto& [left, right] : rows) width = std::max(width, left.size());
  std::string s;
  for (auto [left, right] : rows) {
    left.resize(width, ' ');
    s += left + "  " + right + "\n";
  }
  return s;
}

void print_help(const Command& c) {
  std::string s = "Usage: kvq " + c.name + " " + c.usage + "\n\n";
  if (!c.description.empty()) s += c.description + "\n\n";
  if (!c.positionals.empty()) {
    std::vector<std::pair<std::string, std::string>> rows;
    for (const auto& p : c.positionals) rows.emplace_back("  " + p.name, p.help);
    s += "Arguments:\n" + two_columns(rows) + "\n";
  }
  std::vector<std::pair<std::string, std::string>> rows;
  for (const auto& o : c.options) rows.emplace_back(option_synopsis(o), option_help(o));
  // --help and -h are parsed by parse_args; this row only documents them.
  const Option help = flag("help", "show this help").short_form('h');
  rows.emplace_back(option_synopsis(help), option_help(help));
  s += "Options:\n" + two_columns(rows);
  std::fputs(s.c_str(), stdout);
}

// A group's help: its commands, then the one option every group has.
void print_group_help(const Command& g, FILE* f) {
  std::vector<std::pair<std::string, std::string>> rows;
  for (const auto& c : g.subcommands) rows.emplace_back("  " + c.name, c.summary);
  std::string s = "Usage: kvq " + g.name + " <command> [options]\n\n";
  if (!g.description.empty()) s += g.description + "\n\n";
  s += "Commands:\n" + two_columns(rows) + "\n";
  const Option help = flag("help", "show this help (kvq " + g.name +
                                       " <command> --help: a "
                                       "command's own)")
                          .short_form('h');
  s += "Options:\n" + two_columns({{option_synopsis(help), option_help(help)}});
  std::fputs(s.c_str(), f);
}

void print_tool_help(const std::vector<Command>& commands, FILE* f) {
  std::vector<std::pair<std::string, std::string>> rows;
  for (const auto& c : commands) rows.emplace_back("  " + c.name, c.summary);
  std::fprintf(f,
               "kvq %s — KV-cache compression\n\nUsage: kvq <command> [options]\n\nCommands:\n%s\n"
               "  kvq --version    print the version\n"
               "  kvq <command> --help  (or kvq help <command>)\n",
               KVQ_VERSION_STRING, two_columns(rows).c_str());
}

// What the declaration promises the run function: its positionals, its required options.
Status check_declared(const Command& c, const ParsedArgs& a) {
  const auto& pos = a.positionals();
  if (pos.size() > c.positionals.size())
    return invalid_argument("unexpected argument '" + pos[c.positionals.size()] + "'");
  if (pos.size() < c.positionals.size()) {
    const Positional& p = c.positionals[pos.size()];
    return invalid_argument("missing " + p.name + ": " + p.help);
  }
  for (const auto& o : c.options)
    if (o.is_required && !a.has(o.name))
      return invalid_argument("--" + o.name +
                              (o.short_name ? std::string(" (-") + o.short_name + ")" : "") +
                              " is required (see kvq " + c.name + " --help)");
  return ok_status();
}

Status parse_and_run(const Command& c, const std::vector<std::string>& args) {
  KVQ_ASSIGN_OR_RETURN(const ParsedArgs a, parse_args(args, c.options));
  if (a.help()) {
    print_help(c);
    return ok_status();
  }
  KVQ_RETURN_IF_ERROR(check_declared(c, a));
  return c.run(a);
}

int run_command(const Command& c, const std::vector<std::string>& args) {
  const Status st = parse_and_run(c, args);
  if (st.ok()) return kExitOk;
  std::fprintf(stderr, "kvq %s: error: %s\n", c.name.c_str(), st.message().c_str());
  return kExitError;
}

std::string unknown_command(const std::string& where, const std::string& name,
                            const std::vector<Command>& commands, const std::string& help) {
  std::vector<std::string> names;
  for (const auto& c : commands) names.push_back(c.name);
  const std::string hint = closest_match(name, names);
  return where + ": error: unknown command '" + name + "' (" +
         (hint.empty() ? "see " + help : "did you mean '" + hint + "'?") + ")";
}

int run_group(const Command& g, const std::vector<std::string>& args) {
  if (args.empty()) {
    print_group_help(g, stderr);
    return kExitUsage;
  }
  if (args[0] == "--help" || args[0] == "-h") {
    print_group_help(g, stdout);
    return kExitOk;
  }
  for (const auto& c : g.subcommands) {
    if (c.name != args[0]) continue;
    Command named = c;  // errors and help say "kvq <group> <command>"
    named.name = g.name + " " + c.name;
    return run_command(named, std::vector<std::string>(args.begin() + 1, args.end()));
  }
  std::fprintf(stderr, "%s\n",
               unknown_command("kvq " + g.name, args[0], g.subcommands, "kvq " + g.name + " --help")
                   .c_str());
  return kExitUsage;
}

}  // namespace

int run_tool(const std::vector<Command>& commands, int argc, char** argv) {
  if (argc < 2) {
    print_tool_help(commands, stderr);
    return kExitUsage;
  }
  std::string name = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (name == "--version" || name == "version") {
    std::printf("kvq %s\n", KVQ_VERSION_STRING);
    return kExitOk;
  }
  if (name == "--help" || name == "-h" || name == "help") {
    if (name != "help" || args.empty()) {
      print_tool_help(commands, stdout);
      return kExitOk;
    }
    name = args[0];  // kvq help <command> [<sub>] is kvq <command> [<sub>] --help
    args.erase(args.begin());
    args.push_back("--help");
  }
  for (const auto& c : commands) {
    if (c.name != name) continue;
    return c.subcommands.empty() ? run_command(c, args) : run_group(c, args);
  }
  std::fprintf(stderr, "%s\n", unknown_command("kvq", name, commands, "kvq --help").c_str());
  return kExitUsage;
}

}  // namespace kvq::cli
