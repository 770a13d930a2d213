// Just enough Unicode for tokenizers: UTF-8 decoding and the character classes the GPT-2 style
// pre-tokenizer regex uses (\p{L}, \p{N}, \s).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvq::unicode {

struct CodepointRange {
  uint32_t first, last;  // inclusive
};
// Generated tables (unicode_tables.cc), sorted and disjoint.
extern const CodepointRange kLetterRanges[];
extern const size_t kLetterRangesCount;
extern const CodepointRange kNumberRanges[];
extern const size_t kNumberRangesCount;

bool is_letter(uint32_t cp);  // general category L*
bool is_number(uint32_t cp);  // general category N*
// The Unicode White_Space property (what \s matches in Unicode-aware regex engines).
bool is_whitespace(uint32_t cp);

// Decodes one code point from s at i and returns its byte length (1-4). Invalid or truncated
// sequences decode as a single byte with the value 0xFFFFFFFF (a "code point" of no class), so
// that every byte of any input belongs to exactly one unit and nothing is lost.
inline constexpr uint32_t kInvalid = 0xFFFFFFFFu;
size_t utf8_decode(std::string_view s, size_t i, uint32_t* cp);
void utf8_append(uint32_t cp, std::string* out);

}  // namespace kvq::unicode
