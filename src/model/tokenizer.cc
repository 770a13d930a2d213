#include "model/tokenizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <queue>

#include "core/byte_io.h"
#include "core/file_io.h"
#include "model/unicode.h"

namespace kvq::model {

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id);
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------
// The merge loop shared by both BPE flavours.
//
// Textbook BPE repeatedly merges the best adjacent pair (lowest priority value; the leftmost
// among equals) until no pair can merge. Here every candidate pair sits in a priority queue
// ordered by (priority, position of its left symbol); symbols form a linked list, and a popped
// candidate is used only if both of its symbols are still the ones it was made from. Positions
// keep their order as symbols merge, so the queue picks exactly what the quadratic loop picks.

struct PairInfo {
  double priority;  // smaller merges first
  int32_t result;   // id of the merged token
};

template <class Lookup>  // bool lookup(int32_t left, int32_t right, PairInfo* out)
void merge_symbols(std::vector<int32_t>& ids, const Lookup& lookup) {
  const int n = static_cast<int>(ids.size());
  if (n < 2) return;
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Cand {
    double priority;
    int left;
    int32_t left_id, right_id, result;
  };
  auto worse = [](const Cand& a, const Cand& b) {
    return a.priority != b.priority ? a.priority > b.priority : a.left > b.left;
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(worse)> pq(worse);
  auto push = [&](int left) {
    if (left < 0 || next[left] < 0) return;
    PairInfo info;
    if (lookup(ids[left], ids[next[left]], &info))
      pq.push(Cand{info.priority, left, ids[left], ids[next[left]], info.result});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  std::vector<char> alive(n, 1);
  while (!pq.empty()) {
    const Cand c = pq.top();
    pq.pop();
    const int l = c.left;
    if (!alive[l] || ids[l] != c.left_id) continue;
    const int r = next[l];
    if (r < 0 || ids[r] != c.right_id) continue;
    ids[l] = c.result;
    alive[r] = 0;
    next[l] = next[r];
    if (next[r] >= 0) prev[next[r]] = l;
    push(prev[l]);
    push(l);
  }
  int w = 0;
  for (int i = 0; i >= 0 && i < n; i = next[i]) ids[w++] = ids[i];
  ids.resize(static_cast<size_t>(w));
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizer

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

struct Unit {
  uint32_t begin, len;
  uint32_t cp;
  CharClass cls;
};

CharClass classify(uint32_t cp) {
  if (unicode::is_letter(cp)) return CharClass::kLetter;
  if (unicode::is_number(cp)) return CharClass::kNumber;
  if (unicode::is_whitespace(cp)) return CharClass::kSpace;
  return CharClass::kOther;
}

// GPT-2's pattern on units [a, b):
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
void split_gpt2(const std::vector<Unit>& u, size_t a, size_t b,
                std::vector<std::pair<size_t, size_t>>* out) {
  auto emit = [&](size_t i, size_t k) {
    out->emplace_back(u[i].begin, u[k - 1].begin + u[k - 1].len);
  };
  size_t i = a;
  while (i < b) {
    const uint32_t cp = u[i].cp;
    if (cp == '\'' && i + 1 < b) {
      const uint32_t c1 = u[i + 1].cp;
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
        emit(i, i + 2);
        i += 2;
        continue;
      }
      if (i + 2 < b) {
        const uint32_t c2 = u[i + 2].cp;
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          emit(i, i + 3);
          i += 3;
          continue;
        }
      }
    }
    // ` ?X+` for X = letters, numbers, other: an optional U+0020 then a run of one class.
    size_t j = i;
    if (cp == ' ' && i + 1 < b && u[i + 1].cls != CharClass::kSpace) j = i + 1;
    const CharClass cls = u[j].cls;
    if (cls != CharClass::kSpace) {
      size_t k = j + 1;
      while (k < b && u[k].cls == cls) ++k;
      emit(i, k);
      i = k;
      continue;
    }
    // Whitespace: \s+(?!\S) takes the run but leaves its last character when a non-space
    // follows (that character then prefixes the next piece or stands alone via \s+).
    size_t k = i + 1;
    while (k < b && u[k].cls == CharClass::kSpace) ++k;
    if (k < b && k - i >= 2) k -= 1;
    emit(i, k);
    i = k;
  }
}

}  // namespace

std::vector<std::pair<size_t, size_t>> pre_tokenize(std::string_view text, PreTokenizer kind) {
  std::vector<Unit> units;
  units.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    const size_t len = unicode::utf8_decode(text, i, &cp);
    units.push_back(Unit{static_cast<uint32_t>(i), static_cast<uint32_t>(len), cp, classify(cp)});
    i += len;
  }
  std::vector<std::pair<size_t, size_t>> out;
  if (kind == PreTokenizer::kGpt2) {
    split_gpt2(units, 0, units.size(), &out);
    return out;
  }
  // smollm: every number code point is a piece of its own; the text between them is split by
  // GPT-2's pattern independently (a space before a digit is therefore a piece by itself).
  size_t seg = 0;
  for (size_t i = 0; i <= units.size(); ++i) {
    if (i == units.size() || units[i].cls == CharClass::kNumber) {
      if (seg < i) split_gpt2(units, seg, i, &out);
      if (i < units.size()) out.emplace_back(units[i].begin, units[i].begin + units[i].len);
      seg = i + 1;
    }
  }
  return out;
}

namespace {

// GPT-2's byte-to-unicode table: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100 onwards in byte order, so that every byte is a visible, non-space character.
std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> t{};
  uint32_t extra = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    t[b] = printable ? b : 256 + extra++;
  }
  return t;
}

// Splits text at occurrences of special-token strings: pieces of plain text (id -1) and special
// tokens (their id). The longest special string wins at a position.
std::vector<std::pair<std::string_view, int32_t>> split_specials(
    std::string_view text, const std::vector<std::pair<std::string, int32_t>>& specials) {
  std::vector<std::pair<std::string_view, int32_t>> out;
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    int32_t best = -1;
    size_t best_len = 0;
    for (const auto& [s, id] : specials) {
      if (s.size() > best_len && text.compare(i, s.size(), s) == 0) {
        best = id;
        best_len = s.size();
      }
    }
    if (best < 0) {
      ++i;
      continue;
    }
    if (start < i) out.emplace_back(text.substr(start, i - start), -1);
    out.emplace_back(text.substr(i, best_len), best);
    i += best_len;
    start = i;
  }
  if (start < text.size()) out.emplace_back(text.substr(start), -1);
  return out;
}

class ByteLevelBpe final : public Tokenizer {
 public:
  Status init(const gguf::File& f) {
    KVQ_ASSIGN_OR_RETURN(const std::vector<std::string>* tokens,
                         f.get_string_array("tokenizer.ggml.tokens"));
    if (tokens->empty() || tokens->size() > (size_t{1} << 24))
      return format_error("tokenizer.ggml.tokens has " + std::to_string(tokens->size()) +
                          " entries");
    tokens_ = *tokens;
    vocab_size_ = static_cast<int32_t>(tokens_.size());
    types_.assign(tokens_.size(), 1);
    if (f.has("tokenizer.ggml.token_type")) {
      KVQ_ASSIGN_OR_RETURN(const std::vector<int64_t>* types,
                           f.get_int_array("tokenizer.ggml.token_type"));
      if (types->size() != tokens_.size())
        return format_error("tokenizer.ggml.token_type has " + std::to_string(types->size()) +
                            " entries for " + std::to_string(tokens_.size()) + " tokens");
      for (size_t i = 0; i < types->size(); ++i) types_[i] = static_cast<int>((*types)[i]);
    }
    for (size_t i = 0; i < tokens_.size(); ++i) {
      index_.emplace(tokens_[i], static_cast<int32_t>(i));  // first occurrence wins
      if (types_[i] == 3 || types_[i] == 4)                 // control, user-defined
        specials_.emplace_back(tokens_[i], static_cast<int32_t>(i));
    }

    const auto b2c = byte_to_codepoint();
    for (int b = 0; b < 256; ++b) {
      std::string s;
      unicode::utf8_append(b2c[b], &s);
      auto it = index_.find(s);
      byte_id_[b] = it == index_.end() ? -1 : it->second;
      cp_to_byte_.emplace(b2c[b], static_cast<uint8_t>(b));
    }

    KVQ_ASSIGN_OR_RETURN(const std::vector<std::string>* merges,
                         f.get_string_array("tokenizer.ggml.merges"));
    merges_.reserve(merges->size());
    for (size_t r = 0; r < merges->size(); ++r) {
      const std::string& m = (*merges)[r];
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos)
        return format_error("tokenizer.ggml.merges[" + std::to_string(r) + "] '" + m +
                            "' is not two tokens separated by a space");
      const std::string left = m.substr(0, sp), right = m.substr(sp + 1);
      auto li = index_.find(left), ri = index_.find(right), mi = index_.find(left + right);
      // A merge whose parts or result are not tokens can never fire usefully: skip it.
      if (li == index_.end() || ri == index_.end() || mi == index_.end()) continue;
      merges_.emplace(key(li->second, ri->second), PairInfo{static_cast<double>(r), mi->second});
    }

    std::string pre = "default";
    if (f.has("tokenizer.ggml.pre")) {
      KVQ_ASSIGN_OR_RETURN(pre, f.get_string("tokenizer.ggml.pre"));
    }
    if (pre == "smollm") {
      pre_ = PreTokenizer::kSmollm;
    } else if (pre == "default" || pre == "gpt2" || pre == "gpt-2") {
      pre_ = PreTokenizer::kGpt2;
    } else {
      return unsupported("pre-tokenizer '" + pre + "' (kvq implements 'smollm' and 'gpt2')");
    }

    auto opt_id = [&](const char* k, int32_t* out) -> Status {
      if (!f.has(k)) return ok_status();
      KVQ_ASSIGN_OR_RETURN(int64_t v, f.get_int(k));
      if (v < 0 || v >= vocab_size_)
        return out_of_range(std::string(k) + " = " + std::to_string(v) + " is not a token id");
      *out = static_cast<int32_t>(v);
      return ok_status();
    };
    KVQ_RETURN_IF_ERROR(opt_id("tokenizer.ggml.bos_token_id", &bos_id_));
    KVQ_RETURN_IF_ERROR(opt_id("tokenizer.ggml.eos_token_id", &eos_id_));
    KVQ_RETURN_IF_ERROR(opt_id("tokenizer.ggml.unknown_token_id", &unk_id_));
    if (f.has("tokenizer.ggml.add_bos_token")) {
      KVQ_ASSIGN_OR_RETURN(add_bos_, f.get_bool("tokenizer.ggml.add_bos_token"));
    }
    return ok_status();
  }

  std::vector<int32_t> encode(std::string_view raw, bool parse_special) const override {
    // Invalid UTF-8 bytes become U+FFFD first, one per byte, as llama.cpp does (the vocabulary
    // has no tokens for bytes that never occur in valid UTF-8, such as 0xFF).
    std::string sanitized;
    bool dirty = false;
    for (size_t i = 0; i < raw.size();) {
      uint32_t cp;
      const size_t len = unicode::utf8_decode(raw, i, &cp);
      if (cp == unicode::kInvalid && !dirty) {
        dirty = true;
        sanitized.assign(raw.substr(0, i));
      }
      if (dirty) {
        if (cp == unicode::kInvalid) {
          sanitized += "\xEF\xBF\xBD";
        } else {
          sanitized.append(raw.substr(i, len));
        }
      }
      i += len;
    }
    const std::string_view text = dirty ? std::string_view(sanitized) : raw;
    std::vector<int32_t> out;
    std::unordered_map<std::string_view, std::vector<int32_t>> cache;  // piece -> ids
    auto encode_plain = [&](std::string_view part) {
      for (const auto& [b, e] : pre_tokenize(part, pre_)) {
        const std::string_view piece = part.substr(b, e - b);
        auto it = cache.find(piece);
        if (it == cache.end()) it = cache.emplace(piece, encode_piece(piece)).first;
        out.insert(out.end(), it->second.begin(), it->second.end());
      }
    };
    if (!parse_special || specials_.empty()) {
      encode_plain(text);
      return out;
    }
    for (const auto& [part, id] : split_specials(text, specials_)) {
      if (id >= 0) {
        out.push_back(id);
      } else {
        encode_plain(part);
      }
    }
    return out;
  }

  std::string token_bytes(int32_t id) const override {
    if (id < 0 || id >= vocab_size_) return {};
    const std::string& t = tokens_[static_cast<size_t>(id)];
    if (types_[static_cast<size_t>(id)] == 3 || types_[static_cast<size_t>(id)] == 4) return t;
    std::string out;
    for (size_t i = 0; i < t.size();) {
      uint32_t cp;
      const size_t len = unicode::utf8_decode(t, i, &cp);
      auto it = cp_to_byte_.find(cp);
      if (it != cp_to_byte_.end()) {
        out.push_back(static_cast<char>(it->second));
      } else {
        out.append(t, i, len);  // not a byte-level character: keep it as it is
      }
      i += len;
    }
    return out;
  }

 private:
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  std::vector<int32_t> encode_piece(std::string_view piece) const {
    std::vector<int32_t> ids;
    ids.reserve(piece.size());
    for (unsigned char c : piece) {
      const int32_t id = byte_id_[c];
      if (id >= 0) {
        ids.push_back(id);
      } else if (unk_id_ >= 0) {
        ids.push_back(unk_id_);
      }
    }
    merge_symbols(ids, [this](int32_t a, int32_t b, PairInfo* info) {
      auto it = merges_.find(key(a, b));
      if (it == merges_.end()) return false;
      *info = it->second;
      return true;
    });
    return ids;
  }

  std::vector<std::string> tokens_;
  std::vector<int> types_;
  std::unordered_map<std::string, int32_t> index_;
  std::unordered_map<uint64_t, PairInfo> merges_;
  std::unordered_map<uint32_t, uint8_t> cp_to_byte_;
  std::array<int32_t, 256> byte_id_{};
  std::vector<std::pair<std::string, int32_t>> specials_;
  PreTokenizer pre_ = PreTokenizer::kGpt2;
  int32_t unk_id_ = -1;
};

// llama2.c's tokenizer.
class ScoreBpe final : public Tokenizer {
 public:
  Status init(const std::string& path, int32_t expect_vocab) {
    KVQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, read_file(path, uint64_t{1} << 30));
    ByteReader r(bytes.data(), bytes.size());
    uint32_t max_len_u = 0;
    if (!r.u32(max_len_u))
      return format_error("tokenizer '" + path + "' is shorter than its header");
    const auto max_len = static_cast<int32_t>(max_len_u);
    if (max_len <= 0 || max_len > (1 << 16))
      return format_error("tokenizer '" + path + "': max_token_length " + std::to_string(max_len));
    while (r.remaining() > 0 &&
           (expect_vocab <= 0 || static_cast<int32_t>(tokens_.size()) < expect_vocab)) {
      float score;
      uint32_t len_u = 0;
      const std::string at = "tokenizer '" + path + "', token " + std::to_string(tokens_.size());
      if (!r.f32(score) || !r.u32(len_u)) return format_error(at + ": truncated");
      const auto len = static_cast<int32_t>(len_u);
      if (len < 0 || len > max_len)
        return format_error(at + ": length " + std::to_string(len) + " outside [0, " +
                            std::to_string(max_len) + "]");
      const uint8_t* p;
      if (!r.view(static_cast<size_t>(len), p)) return format_error(at + ": truncated");
      if (!std::isfinite(score)) return corrupt(at + ": score is not finite");
      tokens_.emplace_back(reinterpret_cast<const char*>(p), static_cast<size_t>(len));
      scores_.push_back(score);
    }
    if (expect_vocab > 0 && static_cast<int32_t>(tokens_.size()) != expect_vocab)
      return format_error("tokenizer '" + path + "' has " + std::to_string(tokens_.size()) +
                          " tokens, the model expects " + std::to_string(expect_vocab));
    if (tokens_.size() < 3) return format_error("tokenizer '" + path + "' has too few tokens");
    vocab_size_ = static_cast<int32_t>(tokens_.size());
    for (size_t i = 0; i < tokens_.size(); ++i)
      index_.emplace(tokens_[i], static_cast<int32_t>(i));  // first occurrence wins
    bos_id_ = 1;
    eos_id_ = 2;
    add_bos_ = true;
    return ok_status();
  }

  std::vector<int32_t> encode(std::string_view text, bool /*parse_special*/) const override {
    std::vector<int32_t> ids;
    if (text.empty()) return ids;
    if (auto it = index_.find(" "); it != index_.end()) ids.push_back(it->second);  // dummy prefix
    // One token per code point: a lead byte plus the continuation bytes that follow it (at most
    // 4 bytes, as llama2.c groups them); unknown code points fall back to their bytes (id b + 3).
    for (size_t i = 0; i < text.size();) {
      size_t len = 1;
      while (i + len < text.size() && len < 4 &&
             (static_cast<unsigned char>(text[i + len]) & 0xC0) == 0x80)
        ++len;
      auto it = index_.find(std::string(text.substr(i, len)));
      if (it != index_.end()) {
        ids.push_back(it->second);
      } else {
        for (size_t k = 0; k < len; ++k) {
          const int32_t id = static_cast<unsigned char>(text[i + k]) + 3;
          if (id < vocab_size_) ids.push_back(id);
        }
      }
      i += len;
    }
    std::string buf;
    merge_symbols(ids, [&](int32_t a, int32_t b, PairInfo* info) {
      buf = tokens_[static_cast<size_t>(a)];
      buf += tokens_[static_cast<size_t>(b)];
      auto it = index_.find(buf);
      // llama2.c starts its search at a best score of -1e10: pairs scoring lower never merge.
      if (it == index_.end() || !(scores_[static_cast<size_t>(it->second)] > -1e10f)) return false;
      *info = PairInfo{-static_cast<double>(scores_[static_cast<size_t>(it->second)]), it->second};
      return true;
    });
    return ids;
  }

  std::string token_bytes(int32_t id) const override {
    if (id < 0 || id >= vocab_size_) return {};
    const std::string& t = tokens_[static_cast<size_t>(id)];
    // Raw byte tokens are spelled "<0xAB>".
    if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
      auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
      };
      const int hi = hex(t[3]), lo = hex(t[4]);
      if (hi >= 0 && lo >= 0) return std::string(1, static_cast<char>(hi * 16 + lo));
    }
    return t;
  }

 private:
  std::vector<std::string> tokens_;
  std::vector<float> scores_;
  std::unordered_map<std::string, int32_t> index_;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> load_gguf_tokenizer(const gguf::File& file) {
  std::string model = "gpt2";
  if (file.has("tokenizer.ggml.model")) {
    KVQ_ASSIGN_OR_RETURN(model, file.get_string("tokenizer.ggml.model"));
  }
  if (model != "gpt2")
    return unsupported("tokenizer model '" + model + "' in " + file.name() +
                       " (kvq implements byte-level BPE, 'gpt2')");
  auto t = std::make_unique<ByteLevelBpe>();
  Status st = t->init(file);
  if (!st.ok()) return st.with_context("tokenizer of " + file.name());
  return std::unique_ptr<Tokenizer>(std::move(t));
}

Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer(const std::string& path,
                                                          int32_t vocab_size) {
  auto t = std::make_unique<ScoreBpe>();
  KVQ_RETURN_IF_ERROR(t->init(path, vocab_size));
  return std::unique_ptr<Tokenizer>(std::move(t));
}

}  // namespace kvq::model
