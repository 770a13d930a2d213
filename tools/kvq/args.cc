#include "args.h"

#include <cerrno>
#include <cstdlib>

#include "kvq/spec.h"

namespace kvq::cli {

std::optional<std::string> ParsedArgs::get(const std::string& name) const {
  if (auto it = values_.find(name); it != values_.end() && !it->second.empty())
    return it->second.back();
  if (auto it = defaults_.find(name); it != defaults_.end()) return it->second;
  return std::nullopt;
}

std::string ParsedArgs::get_or(const std::string& name, const std::string& fallback) const {
  auto v = get(name);
  return v ? *v : fallback;
}

std::vector<std::string> ParsedArgs::get_all(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

Result<long long> ParsedArgs::get_int(const std::string& name) const {
  KVQ_CHECK(defaults_.count(name) > 0);
  return get_int(name, 0);
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

Result<double> ParsedArgs::get_double(const std::string& name) const {
  KVQ_CHECK(defaults_.count(name) > 0);
  return get_double(name, 0);
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

Result<DType> ParsedArgs::get_dtype(const std::string& name,
                                    const std::vector<DType>& allowed) const {
  const std::string v = get_or(name, "");
  std::string names;  // "f32, f16 or bf16"
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (v == dtype_name(allowed[i])) return allowed[i];
    if (i > 0) names += i + 1 == allowed.size() ? " or " : ", ";
    names += dtype_name(allowed[i]);
  }
  return invalid_argument("--" + name + " must be " + names + ", got '" + v + "'");
}

namespace {

bool is_short_option(const std::string& a) { return a.size() == 2 && a[0] == '-' && a[1] != '-'; }

Status unknown_option(const std::string& name, const std::vector<Option>& options) {
  std::vector<std::string> names = {"help"};
  for (const auto& o : options) names.push_back(o.name);
  const std::string hint = closest_match(name, names);
  return invalid_argument("unknown option --" + name +
                          (hint.empty() ? "" : " (did you mean --" + hint + "?)"));
}

}  // namespace

Result<ParsedArgs> parse_args(const std::vector<std::string>& args,
                              const std::vector<Option>& options) {
  ParsedArgs out;
  for (const auto& o : options)
    if (!o.def.empty()) out.defaults_[o.name] = o.def;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      out.help_ = true;
      return out;
    }
    // `written` is the option as the user spelt it, for the messages below.
    std::string written = a, value;
    bool has_inline = false;
    const Option* opt = nullptr;
    if (a.size() > 2 && a.compare(0, 2, "--") == 0) {
      std::string name = a.substr(2);
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name.resize(eq);
        written = "--" + name;
        has_inline = true;
      }
      for (const auto& o : options)
        if (o.name == name) opt = &o;
      if (!opt) return unknown_option(name, options);
    } else if (is_short_option(a)) {
      for (const auto& o : options)
        if (o.short_name == a[1]) opt = &o;
      if (!opt) return invalid_argument("unknown option " + a);
    } else {
      // "-" (standard input) and anything else not spelt as an option.
      out.positionals_.push_back(a);
      continue;
    }
    if (opt->takes_value()) {
      if (!has_inline) {
        if (i + 1 >= args.size()) return invalid_argument(written + " needs a value");
        value = args[++i];
      }
    } else if (has_inline) {
      return invalid_argument(written + " takes no value");
    }
    auto& slot = out.values_[opt->name];
    if (!opt->is_repeatable && !slot.empty())
      return invalid_argument("--" + opt->name + " given more than once");
    slot.push_back(value);
  }
  return out;
}

}  // namespace kvq::cli
