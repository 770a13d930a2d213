#include "model_args.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iterator>

#include "core/file_io.h"
#include "model/ops.h"

namespace kvq::cli {

std::vector<Option> with_model_options(std::vector<Option> own) {
  std::vector<Option> all = {
      option("model", "PATH",
             std::string("model file: GGUF or llama2.c checkpoint (default models/") +
                 kDefaultModelName + ", see scripts/fetch_model.sh)"),
      option("tokenizer", "PATH", "tokenizer file for llama2.c checkpoints (tokenizer.bin)"),
      option("threads", "N", "worker threads (default: the number of cores)")};
  all.insert(all.end(), std::make_move_iterator(own.begin()), std::make_move_iterator(own.end()));
  return all;
}

namespace {

std::string exe_dir() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.parent_path().string();
}

Result<std::string> resolve_model_path(const ParsedArgs& args) {
  if (auto m = args.get("model")) return *m;
  auto found = find_repo_file(std::string("models/") + kDefaultModelName, "KVQ_MODEL");
  if (found.ok()) return found;
  return not_found("no --model given and the default model is not in place (" +
                   found.status().message() + "); run scripts/fetch_model.sh or pass --model PATH");
}

}  // namespace

Result<std::string> find_repo_file(const std::string& relative, const char* env) {
  if (const char* e = env ? std::getenv(env) : nullptr; e && *e) return std::string(e);
  std::vector<std::string> tried = {relative};
  const std::string dir = exe_dir();
  if (!dir.empty()) {
    tried.push_back(dir + "/" + relative);
    tried.push_back(dir + "/../" + relative);
  }
  std::string list;
  for (const auto& t : tried) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(t, ec)) return t;
    list += (list.empty() ? "" : ", ") + t;
  }
  return not_found("tried " + list);
}

Result<std::vector<std::string>> model_files_from_args(const ParsedArgs& args) {
  KVQ_ASSIGN_OR_RETURN(std::string path, resolve_model_path(args));
  std::vector<std::string> files = {path};
  if (auto t = args.get("tokenizer"); t && !t->empty()) files.push_back(*t);
  return files;
}

Result<model::LlamaModel> load_model_from_args(const ParsedArgs& args, bool need_tokenizer) {
  KVQ_ASSIGN_OR_RETURN(long long threads, args.get_int("threads", 0));
  if (threads < 0 || threads > 1024)
    return invalid_argument("--threads must be in [1, 1024], got " + std::to_string(threads));
  if (threads > 0) model::set_engine_threads(static_cast<int>(threads));
  KVQ_ASSIGN_OR_RETURN(std::string path, resolve_model_path(args));
  KVQ_ASSIGN_OR_RETURN(model::LlamaModel m,
                       model::LlamaModel::load(path, args.get_or("tokenizer", "")));
  if (need_tokenizer && m.tokenizer() == nullptr)
    return invalid_argument(path +
                            " has no tokenizer of its own: pass --tokenizer (llama2.c's "
                            "tokenizer.bin)");
  return m;
}

std::vector<Option> prompt_options() {
  return {option("prompt", "TEXT", "the prompt text"),
          option("prompt-file", "PATH", "read the prompt from a file instead"),
          flag("chat", "wrap the prompt in the model's ChatML turn (instruct models)")};
}

Result<std::string> prompt_from_args(const ParsedArgs& args) {
  if (args.has("prompt") == args.has("prompt-file"))
    return invalid_argument("give the prompt as --prompt TEXT or --prompt-file PATH (one of them)");
  if (auto p = args.get("prompt")) return *p;
  auto text = read_text_file(*args.get("prompt-file"));
  if (!text.ok()) return text.status().with_context("--prompt-file");
  return text;
}

Result<std::vector<int32_t>> encode_prompt(const ParsedArgs& args, const model::Tokenizer& tok,
                                           const std::string& prompt) {
  const bool chat = args.has("chat");
  const std::string text =
      chat ? "<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n" : prompt;
  std::vector<int32_t> ids;
  if (tok.add_bos() && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  for (int32_t id : tok.encode(text, /*parse_special=*/chat)) ids.push_back(id);
  if (ids.empty()) return invalid_argument("the prompt encodes to no tokens");
  return ids;
}

Result<std::string> read_text_file(const std::string& path) {
  KVQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, read_file(path, uint64_t{1} << 32));
  return std::string(bytes.begin(), bytes.end());
}

}  // namespace kvq::cli
