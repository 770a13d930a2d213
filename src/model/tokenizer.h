// Tokenizers of the model engine.
//
//  * Byte-level BPE ("gpt2" in GGUF metadata: SmolLM2, GPT-2, Llama 3, ...): text is split by a
//    pre-tokenizer into pieces, each piece's UTF-8 bytes are mapped to printable code points
//    (GPT-2's byte-to-unicode table) and merged by the ranked merge list.
//    Pre-tokenizers: "default"/"gpt2" (GPT-2's regex) and "smollm" (every \p{N} code point
//    isolated first, then GPT-2's regex on the rest — HF's Digits(individual_digits) followed by
//    ByteLevel).
//  * llama2.c's score-based BPE (tokenizer.bin next to llama2.c checkpoints): a dummy-prefix
//    space, one token per UTF-8 code point (bytes +3 as fallback), then repeatedly the adjacent
//    pair whose concatenation is the highest-scoring vocabulary entry is merged.
//
// Both merge loops use a priority queue, so any input — megabytes of text, a piece of a million
// spaces — encodes in O(n log n) with exactly the result of the textbook quadratic loop.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvq/status.h"
#include "model/gguf.h"

namespace kvq::model {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids of `text` without BOS/EOS. With parse_special, the text of control and
  // user-defined tokens ("<|im_start|>") becomes that token; otherwise it is ordinary text.
  // Byte-level BPE replaces each byte of invalid UTF-8 by U+FFFD first (as llama.cpp does), so
  // decode(encode(x)) == x holds for valid UTF-8 only.
  virtual std::vector<int32_t> encode(std::string_view text, bool parse_special = false) const = 0;
  // The bytes a token stands for (control tokens: their text). Out-of-range ids give "".
  virtual std::string token_bytes(int32_t id) const = 0;
  // Concatenated bytes of a token sequence (may end inside a UTF-8 character).
  std::string decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const { return vocab_size_; }
  int32_t bos_id() const { return bos_id_; }  // -1 when none
  int32_t eos_id() const { return eos_id_; }  // -1 when none
  // Whether sequences conventionally start with BOS (GGUF tokenizer.ggml.add_bos_token).
  bool add_bos() const { return add_bos_; }

 protected:
  int32_t vocab_size_ = 0;
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  bool add_bos_ = false;
};

// The byte-level BPE described by a GGUF file's tokenizer.ggml.* metadata.
Result<std::unique_ptr<Tokenizer>> load_gguf_tokenizer(const gguf::File& file);

// llama2.c's tokenizer.bin: i32 max_token_length, then per token {f32 score, i32 len, bytes}.
// `vocab_size` > 0 requires exactly that many tokens (the checkpoint's vocabulary); 0 reads to
// the end of the file. BOS = 1, EOS = 2, add_bos = true (llama2.c's conventions).
Result<std::unique_ptr<Tokenizer>> load_llama2c_tokenizer(const std::string& path,
                                                          int32_t vocab_size = 0);

// The pre-tokenizer alone (exposed for tests): byte ranges [begin, end) of the pieces of `text`.
enum class PreTokenizer { kGpt2, kSmollm };
std::vector<std::pair<size_t, size_t>> pre_tokenize(std::string_view text, PreTokenizer kind);

}  // namespace kvq::model
