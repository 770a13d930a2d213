// A small JSON reader and writer: enough for safetensors headers, the .kvq container's
// metadata and the CLI's --json output. The reader is hardened for untrusted input: bounded
// nesting depth, every index checked, errors as values.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/status.h"

namespace kvq::json {

class Value {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  Value() = default;
  static Value null() { return Value(); }
  static Value boolean(bool b);
  static Value number(double d);
  static Value string(std::string s);
  static Value array(std::vector<Value> items = {});
  static Value object();

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }

  bool as_bool() const { return bool_; }
  double as_number() const { return number_; }
  const std::string& as_string() const { return string_; }
  const std::vector<Value>& items() const { return items_; }
  // Object members in insertion order.
  const std::vector<std::pair<std::string, Value>>& members() const { return members_; }
  // nullptr when absent (or not an object).
  const Value* find(std::string_view key) const;

  // Builders.
  Value& push(Value v);
  Value& set(std::string key, Value v);  // replaces an existing key

  // Compact when indent < 0, else pretty with that many spaces.
  std::string dump(int indent = -1) const;

 private:
  void dump_to(std::string& out, int indent, int level) const;
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::string string_;
  std::vector<Value> items_;
  std::vector<std::pair<std::string, Value>> members_;
};

// Parses one JSON document (surrounding whitespace allowed). Depth is limited to 64.
Result<Value> parse(std::string_view text);

// Escapes s as a JSON string literal including quotes.
std::string quote(std::string_view s);

}  // namespace kvq::json
