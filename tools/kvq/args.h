// The subcommands' argument parser: --flag, --key VALUE, --key=VALUE, declared short forms
// (-o VALUE), --help/-h, and positional arguments. A misspelt option is an error that names the
// closest declared one. Subcommands declare their options (commands.h); the driver parses.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvq/dtype.h"
#include "kvq/status.h"

namespace kvq::cli {

// One option of a command, declared as flag(...) or option(...) and refined by the setters:
//   option("output", "FILE", "the file to write").short_form('o').required()
// (The {} initializers let those two name only the members they set.)
struct Option {
  std::string name{};   // the long name without dashes: "method" for --method
  std::string value{};  // what its argument is called in --help ("SPEC"); empty: a flag
  std::string help{};
  // The value an absent option takes (get() and get_int() return it) and that --help shows.
  // Empty: none; a default that is computed or searched for is described in `help` instead.
  std::string def{};
  char short_name = 0;         // -o as another name for --output; 0: none
  bool is_required = false;    // the command cannot run without it
  bool is_repeatable = false;  // may be given several times; the values accumulate

  bool takes_value() const { return !value.empty(); }
  Option defaults_to(std::string v) && {
    def = std::move(v);
    return std::move(*this);
  }
  Option short_form(char c) && {
    short_name = c;
    return std::move(*this);
  }
  Option required() && {
    is_required = true;
    return std::move(*this);
  }
  Option repeatable() && {
    is_repeatable = true;
    return std::move(*this);
  }
};

// --name, which takes no argument.
inline Option flag(std::string name, std::string help) {
  return {.name = std::move(name), .help = std::move(help)};
}
// --name VALUE; `value` names the argument in --help ("SPEC", "N").
inline Option option(std::string name, std::string value, std::string help) {
  return {.name = std::move(name), .value = std::move(value), .help = std::move(help)};
}

class ParsedArgs {
 public:
  // Given on the command line (a default does not count).
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  // The last value given, else the declared default, else nothing.
  std::optional<std::string> get(const std::string& name) const;
  std::string get_or(const std::string& name, const std::string& fallback) const;
  // All values of a repeatable option, in order (its default is not one of them).
  std::vector<std::string> get_all(const std::string& name) const;
  const std::vector<std::string>& positionals() const { return positionals_; }
  // --help or -h was given: the driver prints the command's help instead of running it.
  bool help() const { return help_; }

  // get(name) as a number. Without `fallback` the option must declare a default (a bug in kvq
  // otherwise); with it, `fallback` is what an option given no value and no default takes.
  Result<long long> get_int(const std::string& name) const;
  Result<long long> get_int(const std::string& name, long long fallback) const;
  Result<double> get_double(const std::string& name) const;
  Result<double> get_double(const std::string& name, double fallback) const;
  // get(name) as one of the element types `allowed`, by name ("f32", "f16", "bf16"); the error
  // lists them in this order.
  Result<DType> get_dtype(const std::string& name, const std::vector<DType>& allowed) const;

 private:
  friend Result<ParsedArgs> parse_args(const std::vector<std::string>&, const std::vector<Option>&);
  std::map<std::string, std::vector<std::string>> values_;
  std::map<std::string, std::string> defaults_;
  std::vector<std::string> positionals_;
  bool help_ = false;
};

// Parses `args` (after the subcommand's name) against `options`. Parsing stops at --help or -h,
// so an error after it does not hide the help. Positionals are collected, not counted.
Result<ParsedArgs> parse_args(const std::vector<std::string>& args,
                              const std::vector<Option>& options);

}  // namespace kvq::cli
