// A small argument parser for the subcommands: --flag, --key value, --key=value, positionals.
// Unknown flags are errors that name the closest known one.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvq/status.h"

namespace kvq::cli {

struct OptionDef {
  std::string name;  // without dashes, e.g. "method"
  bool takes_value;  // --name VALUE
  bool repeatable;   // may be given several times (values accumulate)
  std::string help;
};

class ParsedArgs {
 public:
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  // The last value given, if any.
  std::optional<std::string> get(const std::string& name) const;
  std::string get_or(const std::string& name, const std::string& fallback) const;
  // All values of a repeatable option, in order.
  std::vector<std::string> get_all(const std::string& name) const;
  const std::vector<std::string>& positionals() const { return positionals_; }

  Result<long long> get_int(const std::string& name, long long fallback) const;
  Result<double> get_double(const std::string& name, double fallback) const;

 private:
  friend Result<ParsedArgs> parse_args(const std::vector<std::string>&,
                                       const std::vector<OptionDef>&);
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positionals_;
};

Result<ParsedArgs> parse_args(const std::vector<std::string>& args,
                              const std::vector<OptionDef>& defs);

// "Options:\n  --method SPEC   ..." for usage messages.
std::string options_help(const std::vector<OptionDef>& defs);

// Prints "kvq <cmd>: error: <status message>" to stderr and returns 1.
int report_error(const char* cmd, const Status& status);

}  // namespace kvq::cli
