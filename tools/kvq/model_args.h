// Options shared by the subcommands that run a model (ppl, generate, dump-kv).
#pragma once

#include <string>
#include <vector>

#include "args.h"
#include "kvq/status.h"
#include "model/llama.h"

namespace kvq::cli {

// The file kvq looks for when --model is not given (scripts/fetch_model.sh puts it there).
inline constexpr const char* kDefaultModelName = "SmolLM2-135M-Instruct.Q4_1.gguf";

// The text `kvq ppl` evaluates when --text is not given (public domain, in the repository).
inline constexpr const char* kDefaultTextPath = "data/sotu_sample.txt";

// --model, --tokenizer and --threads, followed by a command's own options.
std::vector<Option> with_model_options(std::vector<Option> own);

// Resolves --model: the given path, else $KVQ_MODEL, else models/<kDefaultModelName> under the
// current directory, then next to and above the kvq executable (build/kvq finds
// <repo>/models/...). Sets the thread count from --threads. Loads the model and its tokenizer;
// `need_tokenizer` makes a model without one (llama2.c without --tokenizer) an error.
Result<model::LlamaModel> load_model_from_args(const ParsedArgs& args, bool need_tokenizer);

// The files that make the model (--model resolved as above, then --tokenizer if given): what a
// store's model fingerprint hashes.
Result<std::vector<std::string>> model_files_from_args(const ParsedArgs& args);

// Resolves a file that ships with the repository (e.g. kDefaultTextPath): `env` if set, else
// the relative path under the current directory, then next to and above the kvq executable.
Result<std::string> find_repo_file(const std::string& relative, const char* env);

// --prompt TEXT, --prompt-file PATH and --chat.
std::vector<Option> prompt_options();
// The prompt the options give (exactly one of --prompt and --prompt-file), as the user wrote it.
Result<std::string> prompt_from_args(const ParsedArgs& args);
// Its token ids: BOS where the tokenizer adds one, then the text (wrapped in the model's ChatML
// turn with --chat, special tokens parsed).
Result<std::vector<int32_t>> encode_prompt(const ParsedArgs& args, const model::Tokenizer& tok,
                                           const std::string& prompt);

// Reads a UTF-8 text file (kNotFound/kIo with the path).
Result<std::string> read_text_file(const std::string& path);

}  // namespace kvq::cli
