// kvq list [--json] — the method table: names, parameters with defaults, bounds and docs.
#include <cstdio>

#include "commands.h"
#include "core/json.h"
#include "kvq/spec.h"

namespace kvq::cli {

namespace {

Status run_list(const ParsedArgs& a) {
  if (auto name = a.get("markdown")) {  // the parameter table of a method's documentation page
    const MethodDef* m = find_method(*name);
    if (!m) return not_found("no method '" + *name + "' (kvq list names them)");
    std::printf("%s", params_markdown(*m).c_str());
    return ok_status();
  }
  if (a.has("json")) {
    json::Value methods = json::Value::array();
    for (const auto& m : method_table()) {
      json::Value jm = json::Value::object();
      jm.set("name", json::Value::string(m.name));
      jm.set("id", json::Value::number(m.id));
      jm.set("summary", json::Value::string(m.summary));
      jm.set("default_spec", json::Value::string(Spec(m).to_string()));
      json::Value params = json::Value::array();
      for (const auto& p : m.params) {
        json::Value jp = json::Value::object();
        jp.set("name", json::Value::string(p.name));
        const char* type = p.type == ParamType::kInt     ? "int"
                           : p.type == ParamType::kFloat ? "float"
                                                         : "enum";
        jp.set("type", json::Value::string(type));
        jp.set("default", json::Value::string(format_param_value(p, p.default_value)));
        if (p.type == ParamType::kEnum) {
          json::Value choices = json::Value::array();
          for (const auto& c : p.choices) choices.push(json::Value::string(c));
          jp.set("choices", std::move(choices));
        } else {
          jp.set("min", json::Value::number(p.min));
          jp.set("max", json::Value::number(p.max));
        }
        jp.set("doc", json::Value::string(p.doc));
        params.push(std::move(jp));
      }
      jm.set("params", std::move(params));
      methods.push(std::move(jm));
    }
    std::printf("%s\n", methods.dump(2).c_str());
    return ok_status();
  }
  for (const auto& m : method_table()) {
    std::printf("%s — %s\n  default: %s\n", m.name.c_str(), m.summary.c_str(),
                Spec(m).to_string().c_str());
    for (const auto& p : m.params) {
      std::string range;
      if (p.type == ParamType::kEnum) {
        for (size_t i = 0; i < p.choices.size(); ++i) range += (i ? "|" : "") + p.choices[i];
      } else {
        range = "[" + format_param_value(p, p.min) + ", " + format_param_value(p, p.max) + "]";
      }
      std::printf("    %-12s = %-8s %-18s %s\n", p.name.c_str(),
                  format_param_value(p, p.default_value).c_str(), range.c_str(), p.doc.c_str());
    }
    std::printf("\n");
  }
  return ok_status();
}

}  // namespace

Command list_command() {
  Command c("list", "print the method table (--json, --markdown METHOD)",
            "[--json | --markdown METHOD]", run_list);
  c.options = {flag("json", "machine-readable output"),
               option("markdown", "METHOD",
                      "print METHOD's parameter table as Markdown (its documentation page's)")};
  return c;
}

}  // namespace kvq::cli
