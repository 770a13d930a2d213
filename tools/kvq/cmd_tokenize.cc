// kvq tokenize [--model PATH] [--tokenizer PATH] (--text PATH | --prompt TEXT) [--json]
//
// The token ids kvq's engine feeds the model for a text, as `kvq ppl` and `kvq generate` cut it:
// what another engine needs to reproduce kvq's protocol on the same tokens
// (scripts/hf_crossval.py).
#include <cstdio>

#include "commands.h"
#include "core/json.h"
#include "model_args.h"

namespace kvq::cli {

namespace {

Status run_tokenize(const ParsedArgs& a) {
  std::string text;
  if (auto t = a.get("text")) {
    auto r = read_text_file(*t);
    if (!r.ok()) return r.status();
    text = std::move(*r);
  } else if (auto p = a.get("prompt")) {
    text = *p;
  } else {
    return invalid_argument("give --text PATH or --prompt TEXT");
  }
  auto m = load_model_from_args(a, /*need_tokenizer=*/true);
  if (!m.ok()) return m.status();
  const std::vector<int32_t> ids = m->tokenizer()->encode(text);
  if (a.has("json")) {
    json::Value arr = json::Value::array();
    for (int32_t id : ids) arr.push(json::Value::number(id));
    std::printf("%s\n", arr.dump(0).c_str());
  } else {
    for (size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i ? " " : "", ids[i]);
    std::printf("\n");
  }
  return ok_status();
}

}  // namespace

Command tokenize_command() {
  Command c("tokenize", "the token ids kvq's engine feeds the model for a text",
            "[--model PATH] (--text PATH | --prompt TEXT) [--json]", run_tokenize);
  c.options = with_model_options({option("text", "PATH", "the text file to tokenize"),
                                  option("prompt", "TEXT", "a text given inline"),
                                  flag("json", "a JSON array instead of space-separated ids")});
  return c;
}

}  // namespace kvq::cli
