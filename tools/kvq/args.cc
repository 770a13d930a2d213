#include "args.h"

#include <cstdio>
#include <cstdlib>

#include "kvq/spec.h"

namespace kvq::cli {

std::optional<std::string> ParsedArgs::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

std::string ParsedArgs::get_or(const std::string& name, const std::string& fallback) const {
  auto v = get(name);
  return v ? *v : fallback;
}

std::vector<std::string> ParsedArgs::get_all(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

Result<long long> ParsedArgs::get_int(const std::string& name, long long fallback) const {
  auto v = get(name);
  if (!v) return fallback;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v->c_str(), &end, 10);
  if (v->empty() || *end != '\0' || errno != 0)
    return invalid_argument("--" + name + " expects an integer, got '" + *v + "'");
  return x;
}

Result<double> ParsedArgs::get_double(const std::string& name, double fallback) const {
  auto v = get(name);
  if (!v) return fallback;
  char* end = nullptr;
  const double x = std::strtod(v->c_str(), &end);
  if (v->empty() || *end != '\0')
    return invalid_argument("--" + name + " expects a number, got '" + *v + "'");
  return x;
}

Result<ParsedArgs> parse_args(const std::vector<std::string>& args,
                              const std::vector<OptionDef>& defs) {
  ParsedArgs out;
  auto find = [&](const std::string& name) -> const OptionDef* {
    for (const auto& d : defs)
      if (d.name == name) return &d;
    return nullptr;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() > 2 && a.compare(0, 2, "--") == 0) {
      std::string name = a.substr(2), value;
      bool has_inline = false;
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
        has_inline = true;
      }
      const OptionDef* def = find(name);
      if (!def) {
        std::vector<std::string> names;
        for (const auto& d : defs) names.push_back(d.name);
        std::string hint = closest_match(name, names);
        return invalid_argument("unknown option --" + name +
                                (hint.empty() ? "" : " (did you mean --" + hint + "?)"));
      }
      if (def->takes_value) {
        if (!has_inline) {
          if (i + 1 >= args.size()) return invalid_argument("--" + name + " needs a value");
          value = args[++i];
        }
      } else if (has_inline) {
        return invalid_argument("--" + name + " takes no value");
      }
      auto& slot = out.values_[name];
      if (!def->repeatable && !slot.empty())
        return invalid_argument("--" + name + " given more than once");
      slot.push_back(value);
    } else {
      out.positionals_.push_back(a);
    }
  }
  return out;
}

std::string options_help(const std::vector<OptionDef>& defs) {
  std::string s = "Options:\n";
  for (const auto& d : defs) {
    std::string left = "  --" + d.name + (d.takes_value ? " VALUE" : "");
    if (left.size() < 26) left.resize(26, ' ');
    s += left + " " + d.help + "\n";
  }
  return s;
}

int report_error(const char* cmd, const Status& status) {
  std::fprintf(stderr, "kvq %s: error: %s\n", cmd, status.message().c_str());
  return 1;
}

}  // namespace kvq::cli
