// kvq/spec.h — the method table and spec strings.
//
// Every compression method is one row of one explicit table (src/methods/registry.cc): a name,
// a one-line summary, typed parameters with defaults, bounds and docs, and a factory that builds
// the per-layer caches of a model. The spec parser, `kvq list`, the tests and the benchmarks all
// iterate that table.
//
// A spec string names a method and optionally overrides parameters:
//
//   kivi                                   all defaults
//   kivi:k_bits=2,v_bits=2,group=32        overrides; unlisted parameters keep their defaults
//
// parse_spec() validates names (an unknown method or key names the closest valid one), types and
// bounds (an out-of-range value names the bounds), then the method's own cross-parameter rules.
// Spec::to_string() prints the one canonical form: every parameter, in table order, e.g.
// "kivi:k_bits=2,v_bits=2,group=32,residual=128". parse_spec(s.to_string()) == s always.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/status.h"

namespace kvq {

class BlockCodec;  // src/cache/codec.h: one layer's compression policy and stored layout
struct ModelShape;
class Spec;

enum class ParamType { kInt, kFloat, kEnum };

struct ParamDef {
  std::string name;
  ParamType type = ParamType::kInt;
  double default_value = 0;          // for kEnum: the index into `choices`
  double min = 0, max = 0;           // inclusive bounds (kInt, kFloat)
  std::vector<std::string> choices;  // kEnum only
  std::string doc;                   // one line
};

// Builds the codecs of every layer of a model (the per-model builder), given each layer's spec
// (the model spec with that layer's overrides applied). Methods that share state between layers
// (XQuant) or apply a depth schedule (CacheGen) do it here. Every backend wraps the codecs in
// its own layer caches.
using BuildCodecsFn = Result<std::vector<std::unique_ptr<BlockCodec>>> (*)(
    const std::vector<Spec>& layer_specs, const ModelShape& shape);
// Checks rules that involve several parameters (e.g. lo_bits <= hi_bits). May be null.
using ValidateFn = Status (*)(const Spec& spec);

// One step of a method's bit ladder, for the table-wide checks: assignments applied on top of the
// test settings, the code bits they stand for, and the largest relative reconstruction error
// (sum of squared errors / sum of squares, keys and values each) the row promises for them on
// kvq's committed real K/V (tests/data/smollm2_kv_small.safetensors).
struct BitStep {
  std::string settings;
  int bits = 0;
  double max_rel_error = 0;
};

struct MethodDef {
  // Stable identity: never renumbered or reused, whatever the row order (ids name test data and
  // generated files; the container names methods by `name`).
  uint32_t id = 0;
  std::string name;
  std::string summary;  // one line, for `kvq list`
  std::vector<ParamDef> params;
  BuildCodecsFn build = nullptr;
  ValidateFn validate = nullptr;
  // Assignments that make blocks seal within a few dozen tokens (small windows and blocks), so
  // the conformance tests exercise sealing without knowing the method's parameter names.
  std::string test_settings;
  // Increasing bits; empty for methods without a bit knob (fp16).
  std::vector<BitStep> bit_ladder;
  // In the main job (`kvq ppl` without --method): one row per family, so that its table stays
  // short; the other variants of a family (llama.cpp's q4_1, q5_0, iq4_nl) are left to --method.
  bool in_main_job = true;

  // Index of a parameter or -1.
  int find_param(std::string_view name) const;
};

// The table, in a fixed order. Rows are added in src/methods/registry.cc.
const std::vector<MethodDef>& method_table();
// nullptr when there is no such method.
const MethodDef* find_method(std::string_view name);
const MethodDef* find_method_by_id(uint32_t id);
// The method's defaults with its test_settings applied (small windows and blocks).
Spec test_spec(const MethodDef& m);
// The parameter table of a method as Markdown (name, default, range, meaning): what its
// documentation page carries between <!-- params:begin --> and <!-- params:end -->.
std::string params_markdown(const MethodDef& m);

// A method plus one value per parameter (validated).
class Spec {
 public:
  // The method with every parameter at its default.
  explicit Spec(const MethodDef& method);

  const MethodDef& method() const { return *method_; }
  const std::string& method_name() const { return method_->name; }

  // Typed getters. Asking for a parameter the method does not have, or with the wrong type, is a
  // kvq bug and aborts.
  int64_t get_int(std::string_view name) const;
  double get_float(std::string_view name) const;
  const std::string& get_enum(std::string_view name) const;

  // Sets one parameter from its text form ("2", "0.25", "attn"), checking type and bounds.
  // Leaves the spec unchanged on error. Does not run the method's cross-parameter check.
  Status set(std::string_view name, std::string_view text);
  // Applies "k=v,k=v" assignments, then the method's cross-parameter check. All or nothing.
  Status apply(std::string_view assignments);

  // Canonical form: "name:p1=v1,p2=v2,..." with every parameter in table order ("name" alone
  // when the method has no parameters). Floats print in the shortest form that reads back exactly.
  std::string to_string() const;

  // "k=v,k=v" for the parameters whose values differ from `base` (same method), in table order;
  // empty when none do. base.apply(diff_from(base)) == *this.
  std::string diff_from(const Spec& base) const;

  bool operator==(const Spec& other) const {
    return method_ == other.method_ && values_ == other.values_;
  }

 private:
  const MethodDef* method_;
  std::vector<double> values_;  // one per parameter; enum values store the choice index
};

// Parses and fully validates a spec string against kvq's method table.
Result<Spec> parse_spec(std::string_view text);
// The same against any table (the registry's parse_spec calls it with method_table()).
Result<Spec> parse_spec_in(const std::vector<MethodDef>& table, std::string_view text);
const MethodDef* find_method_in(const std::vector<MethodDef>& table, std::string_view name);

// The text form of one parameter value ("2", "0.25", "attn").
std::string format_param_value(const ParamDef& def, double value);

// Edit distance, for "did you mean" suggestions.
int edit_distance(std::string_view a, std::string_view b);
// The closest of `candidates` to `word` (empty when nothing is reasonably close).
std::string closest_match(std::string_view word, const std::vector<std::string>& candidates);

}  // namespace kvq
