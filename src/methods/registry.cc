// The method table: every compression method kvq knows, in the order `kvq list` prints them.
//
// Adding a method is one file and one line: src/methods/<name>.cc defines
// `MethodDef make_<name>_method()` (its row: a stable id, parameters, the codec builder, test
// settings and a bit ladder), and its name joins KVQ_METHODS below. Everything else follows
// from the row: spec parsing, `kvq list`, the conformance tests (contract, semantics, container,
// golden files, table-wide quality checks), the fuzz seeds and dictionaries, the benchmarks;
// and the tests fail until the row's documentation page and golden file exist.
#include <cstdio>

#include "kvq/spec.h"

namespace kvq {

#define KVQ_METHODS(X) \
  X(fp16)              \
  X(kivi)              \
  X(cachegen)          \
  X(xquant)            \
  X(zipcache)          \
  X(q8_0)              \
  X(q4_0)              \
  X(q4_1)              \
  X(q5_0)              \
  X(iq4_nl)            \
  X(turboquant)        \
  X(kvq)

#define KVQ_DECLARE_METHOD(name) MethodDef make_##name##_method();
KVQ_METHODS(KVQ_DECLARE_METHOD)
#undef KVQ_DECLARE_METHOD

const std::vector<MethodDef>& method_table() {
#define KVQ_METHOD_ROW(name) make_##name##_method(),
  static const std::vector<MethodDef> table = {KVQ_METHODS(KVQ_METHOD_ROW)};
#undef KVQ_METHOD_ROW
  return table;
}

const MethodDef* find_method(std::string_view name) { return find_method_in(method_table(), name); }

const MethodDef* find_method_by_id(uint32_t id) {
  for (const auto& m : method_table())
    if (m.id == id) return &m;
  return nullptr;
}

Result<Spec> parse_spec(std::string_view text) { return parse_spec_in(method_table(), text); }

Spec test_spec(const MethodDef& m) {
  Spec s(m);
  if (!m.test_settings.empty()) {
    const Status st = s.apply(m.test_settings);
    KVQ_CHECK(st.ok() && "a method's test_settings must parse");
  }
  return s;
}

std::string params_markdown(const MethodDef& m) {
  std::string out = "| name | default | range | meaning |\n|---|---|---|---|\n";
  for (const auto& p : m.params) {
    std::string range;
    if (p.type == ParamType::kEnum) {
      for (size_t i = 0; i < p.choices.size(); ++i)
        range += (i ? ", " : "") + std::string("`") + p.choices[i] + "`";
    } else {
      range = format_param_value(p, p.min) + " – " + format_param_value(p, p.max);
    }
    out += "| `" + p.name + "` | " + format_param_value(p, p.default_value) + " | " + range +
           " | " + p.doc + " |\n";
  }
  if (m.params.empty()) out += "| (none) | | | |\n";
  return out;
}

}  // namespace kvq
