#include "kvq/spec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace kvq {

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out;
}

std::vector<std::string> param_names(const MethodDef& m) {
  std::vector<std::string> v;
  for (const auto& p : m.params) v.push_back(p.name);
  return v;
}

std::string did_you_mean(std::string_view word, const std::vector<std::string>& candidates,
                         const char* quote = "'") {
  std::string best = closest_match(word, candidates);
  return best.empty() ? "" : std::string(" (did you mean ") + quote + best + quote + "?)";
}

}  // namespace

int MethodDef::find_param(std::string_view pname) const {
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].name == pname) return static_cast<int>(i);
  return -1;
}

const MethodDef* find_method_in(const std::vector<MethodDef>& table, std::string_view name) {
  for (const auto& m : table)
    if (m.name == name) return &m;
  return nullptr;
}

int edit_distance(std::string_view a, std::string_view b) {
  std::vector<int> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = static_cast<int>(j);
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = static_cast<int>(i);
    for (size_t j = 1; j <= b.size(); ++j) {
      const int sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest_match(std::string_view word, const std::vector<std::string>& candidates) {
  std::string best;
  int best_d = 1 << 30;
  for (const auto& c : candidates) {
    const int d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  // Only suggest when the word is plausibly a typo of the candidate.
  const int limit = std::max<int>(2, static_cast<int>(std::max(word.size(), best.size()) / 2));
  return best_d <= limit ? best : std::string();
}

std::string format_param_value(const ParamDef& def, double value) {
  switch (def.type) {
    case ParamType::kInt:
      return std::to_string(static_cast<long long>(value));
    case ParamType::kEnum:
      return def.choices.at(static_cast<size_t>(value));
    case ParamType::kFloat: {
      char buf[64];
      auto r = std::to_chars(buf, buf + sizeof(buf), value);  // shortest exact round trip
      return std::string(buf, r.ptr);
    }
  }
  return {};
}

Spec::Spec(const MethodDef& method) : method_(&method) {
  for (const auto& p : method.params) values_.push_back(p.default_value);
}

namespace {
const ParamDef& param_or_die(const MethodDef& m, std::string_view name, ParamType type) {
  const int i = m.find_param(name);
  KVQ_CHECK(i >= 0);
  KVQ_CHECK(m.params[static_cast<size_t>(i)].type == type);
  return m.params[static_cast<size_t>(i)];
}
}  // namespace

int64_t Spec::get_int(std::string_view name) const {
  param_or_die(*method_, name, ParamType::kInt);
  return static_cast<int64_t>(values_[static_cast<size_t>(method_->find_param(name))]);
}

double Spec::get_float(std::string_view name) const {
  param_or_die(*method_, name, ParamType::kFloat);
  return values_[static_cast<size_t>(method_->find_param(name))];
}

const std::string& Spec::get_enum(std::string_view name) const {
  const ParamDef& p = param_or_die(*method_, name, ParamType::kEnum);
  return p.choices[static_cast<size_t>(values_[static_cast<size_t>(method_->find_param(name))])];
}

Status Spec::set(std::string_view name, std::string_view text) {
  const int i = method_->find_param(name);
  if (i < 0) {
    const auto names = param_names(*method_);
    if (names.empty())
      return invalid_argument("method '" + method_->name + "' takes no parameters, got '" +
                              std::string(name) + "'");
    return invalid_argument("unknown parameter '" + std::string(name) + "' for method '" +
                            method_->name + "'" + did_you_mean(name, names) +
                            "; parameters: " + join_names(names));
  }
  const ParamDef& def = method_->params[static_cast<size_t>(i)];
  const std::string where = method_->name + ":" + def.name;
  if (text.empty()) return invalid_argument(where + " has an empty value");
  double value = 0;
  switch (def.type) {
    case ParamType::kInt: {
      long long v = 0;
      auto r = std::from_chars(text.data(), text.data() + text.size(), v);
      if (r.ec != std::errc() || r.ptr != text.data() + text.size())
        return invalid_argument(where + " expects an integer, got '" + std::string(text) + "'");
      value = static_cast<double>(v);
      if (value < def.min || value > def.max)
        return invalid_argument(where + "=" + std::string(text) + " is out of range [" +
                                format_param_value(def, def.min) + ", " +
                                format_param_value(def, def.max) + "]");
      break;
    }
    case ParamType::kFloat: {
      double v = 0;
      auto r = std::from_chars(text.data(), text.data() + text.size(), v);
      if (r.ec != std::errc() || r.ptr != text.data() + text.size() || !std::isfinite(v))
        return invalid_argument(where + " expects a number, got '" + std::string(text) + "'");
      if (v < def.min || v > def.max)
        return invalid_argument(where + "=" + std::string(text) + " is out of range [" +
                                format_param_value(def, def.min) + ", " +
                                format_param_value(def, def.max) + "]");
      value = v;
      break;
    }
    case ParamType::kEnum: {
      auto it = std::find(def.choices.begin(), def.choices.end(), text);
      if (it == def.choices.end())
        return invalid_argument(where + "='" + std::string(text) + "' is not one of: " +
                                join_names(def.choices) + did_you_mean(text, def.choices));
      value = static_cast<double>(it - def.choices.begin());
      break;
    }
  }
  values_[static_cast<size_t>(i)] = value;
  return ok_status();
}

Status Spec::apply(std::string_view assignments) {
  Spec next = *this;
  std::vector<std::string> seen;
  std::string_view rest = assignments;
  while (true) {
    const size_t comma = rest.find(',');
    std::string_view item = trim(rest.substr(0, comma));
    if (item.empty())
      return invalid_argument("empty parameter in '" + std::string(assignments) +
                              "' (expected key=value[,key=value...])");
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      return invalid_argument("expected key=value, got '" + std::string(item) + "' in spec for '" +
                              method_->name + "'");
    const std::string key(trim(item.substr(0, eq)));
    if (std::find(seen.begin(), seen.end(), key) != seen.end())
      return invalid_argument("parameter '" + key + "' given twice");
    seen.push_back(key);
    KVQ_RETURN_IF_ERROR(next.set(key, trim(item.substr(eq + 1))));
    if (comma == std::string_view::npos) break;
    rest = rest.substr(comma + 1);
  }
  if (method_->validate) KVQ_RETURN_IF_ERROR(method_->validate(next));
  *this = next;
  return ok_status();
}

std::string Spec::to_string() const {
  std::string s = method_->name;
  for (size_t i = 0; i < method_->params.size(); ++i) {
    s += (i == 0 ? ":" : ",");
    s += method_->params[i].name + "=" + format_param_value(method_->params[i], values_[i]);
  }
  return s;
}

std::string Spec::diff_from(const Spec& base) const {
  KVQ_CHECK(method_ == base.method_);
  std::string diff;
  for (size_t i = 0; i < method_->params.size(); ++i) {
    if (values_[i] == base.values_[i]) continue;
    const ParamDef& p = method_->params[i];
    diff += (diff.empty() ? "" : ",") + p.name + "=" + format_param_value(p, values_[i]);
  }
  return diff;
}

Result<Spec> parse_spec_in(const std::vector<MethodDef>& table, std::string_view text) {
  text = trim(text);
  const size_t colon = text.find(':');
  const std::string name(trim(text.substr(0, colon)));
  std::vector<std::string> names;
  for (const auto& m : table) names.push_back(m.name);
  if (name.empty())
    return invalid_argument(
        "empty method name; expected METHOD[:key=value,...] with METHOD one of: " +
        join_names(names));
  const MethodDef* m = find_method_in(table, name);
  if (!m)
    return invalid_argument("unknown method '" + name + "'" + did_you_mean(name, names) +
                            "; methods: " + join_names(names));
  Spec spec(*m);
  if (colon != std::string_view::npos && !trim(text.substr(colon + 1)).empty()) {
    KVQ_RETURN_IF_ERROR(spec.apply(text.substr(colon + 1)));
  } else if (m->validate) {
    KVQ_RETURN_IF_ERROR(m->validate(spec));
  }
  return spec;
}

}  // namespace kvq
