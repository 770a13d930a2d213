#include "core/json.h"

#include <charconv>
#include <cmath>
#include <cstdio>

namespace kvq::json {

Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.bool_ = b;
  return v;
}
Value Value::number(double d) {
  Value v;
  v.kind_ = Kind::kNumber;
  v.number_ = d;
  return v;
}
Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.string_ = std::move(s);
  return v;
}
Value Value::array(std::vector<Value> items) {
  Value v;
  v.kind_ = Kind::kArray;
  v.items_ = std::move(items);
  return v;
}
Value Value::object() {
  Value v;
  v.kind_ = Kind::kObject;
  return v;
}

const Value* Value::find(std::string_view key) const {
  for (const auto& [k, v] : members_)
    if (k == key) return &v;
  return nullptr;
}

Value& Value::push(Value v) {
  KVQ_CHECK(kind_ == Kind::kArray);
  items_.push_back(std::move(v));
  return items_.back();
}

Value& Value::set(std::string key, Value v) {
  KVQ_CHECK(kind_ == Kind::kObject);
  for (auto& [k, old] : members_)
    if (k == key) return old = std::move(v);
  members_.emplace_back(std::move(key), std::move(v));
  return members_.back().second;
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

namespace {
void newline(std::string& out, int indent, int level) {
  if (indent < 0) return;
  out += '\n';
  out.append(static_cast<size_t>(indent * level), ' ');
}
}  // namespace

void Value::dump_to(std::string& out, int indent, int level) const {
  switch (kind_) {
    case Kind::kNull:
      out += "null";
      break;
    case Kind::kBool:
      out += bool_ ? "true" : "false";
      break;
    case Kind::kNumber: {
      if (!std::isfinite(number_)) {
        out += "null";
        break;
      }
      char buf[64];
      auto r = std::to_chars(buf, buf + sizeof buf, number_);
      out.append(buf, r.ptr);
      break;
    }
    case Kind::kString:
      out += quote(string_);
      break;
    case Kind::kArray:
      out += '[';
      for (size_t i = 0; i < items_.size(); ++i) {
        if (i) out += ',';
        newline(out, indent, level + 1);
        items_[i].dump_to(out, indent, level + 1);
      }
      if (!items_.empty()) newline(out, indent, level);
      out += ']';
      break;
    case Kind::kObject:
      out += '{';
      for (size_t i = 0; i < members_.size(); ++i) {
        if (i) out += ',';
        newline(out, indent, level + 1);
        out += quote(members_[i].first);
        out += indent < 0 ? ":" : ": ";
        members_[i].second.dump_to(out, indent, level + 1);
      }
      if (!members_.empty()) newline(out, indent, level);
      out += '}';
      break;
  }
}

std::string Value::dump(int indent) const {
  std::string out;
  dump_to(out, indent, 0);
  return out;
}

namespace {

class Parser {
 public:
  explicit Parser(std::string_view t) : t_(t) {}

  Result<Value> document() {
    Value v;
    KVQ_RETURN_IF_ERROR(value(v, 0));
    ws();
    if (i_ != t_.size()) return err("trailing characters");
    return v;
  }

 private:
  Status err(const std::string& what) const {
    return format_error("JSON: " + what + " at offset " + std::to_string(i_));
  }
  void ws() {
    while (i_ < t_.size() && (t_[i_] == ' ' || t_[i_] == '\t' || t_[i_] == '\n' || t_[i_] == '\r'))
      ++i_;
  }
  bool lit(std::string_view s) {
    if (t_.substr(i_, s.size()) == s) {
      i_ += s.size();
      return true;
    }
    return false;
  }

  Status value(Value& out, int depth) {
    if (depth > 64) return err("nesting deeper than 64");
    ws();
    if (i_ >= t_.size()) return err("unexpected end");
    const char c = t_[i_];
    if (c == '{') return object(out, depth);
    if (c == '[') return array(out, depth);
    if (c == '"') {
      std::string s;
      KVQ_RETURN_IF_ERROR(string(s));
      out = Value::string(std::move(s));
      return ok_status();
    }
    if (lit("true")) {
      out = Value::boolean(true);
      return ok_status();
    }
    if (lit("false")) {
      out = Value::boolean(false);
      return ok_status();
    }
    if (lit("null")) {
      out = Value::null();
      return ok_status();
    }
    return number(out);
  }

  Status number(Value& out) {
    const size_t start = i_;
    if (i_ < t_.size() && t_[i_] == '-') ++i_;
    while (i_ < t_.size() && ((t_[i_] >= '0' && t_[i_] <= '9') || t_[i_] == '.' || t_[i_] == 'e' ||
                              t_[i_] == 'E' || t_[i_] == '+' || t_[i_] == '-'))
      ++i_;
    double d = 0;
    auto r = std::from_chars(t_.data() + start, t_.data() + i_, d);
    if (start == i_ || r.ec != std::errc() || r.ptr != t_.data() + i_) {
      i_ = start;
      return err("invalid value");
    }
    out = Value::number(d);
    return ok_status();
  }

  static void utf8(std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xc0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xe0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      s += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      s += static_cast<char>(0xf0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      s += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  Status hex4(uint32_t& cp) {
    if (i_ + 4 > t_.size()) return err("truncated \\u escape");
    cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = t_[i_++];
      cp <<= 4;
      if (h >= '0' && h <= '9')
        cp |= static_cast<uint32_t>(h - '0');
      else if (h >= 'a' && h <= 'f')
        cp |= static_cast<uint32_t>(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F')
        cp |= static_cast<uint32_t>(h - 'A' + 10);
      else
        return err("bad \\u escape");
    }
    return ok_status();
  }

  Status string(std::string& s) {
    ++i_;  // opening quote
    while (true) {
      if (i_ >= t_.size()) return err("unterminated string");
      const char c = t_[i_++];
      if (c == '"') return ok_status();
      if (static_cast<unsigned char>(c) < 0x20) return err("control character in string");
      if (c != '\\') {
        s += c;
        continue;
      }
      if (i_ >= t_.size()) return err("unterminated escape");
      const char e = t_[i_++];
      switch (e) {
        case '"':
          s += '"';
          break;
        case '\\':
          s += '\\';
          break;
        case '/':
          s += '/';
          break;
        case 'b':
          s += '\b';
          break;
        case 'f':
          s += '\f';
          break;
        case 'n':
          s += '\n';
          break;
        case 'r':
          s += '\r';
          break;
        case 't':
          s += '\t';
          break;
        case 'u': {
          uint32_t cp = 0;
          KVQ_RETURN_IF_ERROR(hex4(cp));
          if (cp >= 0xd800 && cp < 0xdc00) {
            uint32_t lo = 0;
            if (!lit("\\u")) return err("unpaired surrogate");
            KVQ_RETURN_IF_ERROR(hex4(lo));
            if (lo < 0xdc00 || lo >= 0xe000) return err("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          } else if (cp >= 0xdc00 && cp < 0xe000) {
            return err("unpaired surrogate");
          }
          utf8(s, cp);
          break;
        }
        default:
          return err("bad escape");
      }
    }
  }

  Status array(Value& out, int depth) {
    ++i_;
    out = Value::array();
    ws();
    if (lit("]")) return ok_status();
    while (true) {
      Value item;
      KVQ_RETURN_IF_ERROR(value(item, depth + 1));
      out.push(std::move(item));
      ws();
      if (lit(",")) continue;
      if (lit("]")) return ok_status();
      return err("expected ',' or ']'");
    }
  }

  Status object(Value& out, int depth) {
    ++i_;
    out = Value::object();
    ws();
    if (lit("}")) return ok_status();
    while (true) {
      ws();
      if (i_ >= t_.size() || t_[i_] != '"') return err("expected a key");
      std::string key;
      KVQ_RETURN_IF_ERROR(string(key));
      if (out.find(key)) return err("duplicate key '" + key + "'");
      ws();
      if (!lit(":")) return err("expected ':'");
      Value v;
      KVQ_RETURN_IF_ERROR(value(v, depth + 1));
      out.set(std::move(key), std::move(v));
      ws();
      if (lit(",")) continue;
      if (lit("}")) return ok_status();
      return err("expected ',' or '}'");
    }
  }

  std::string_view t_;
  size_t i_ = 0;
};

}  // namespace

Result<Value> parse(std::string_view text) { return Parser(text).document(); }

}  // namespace kvq::json
