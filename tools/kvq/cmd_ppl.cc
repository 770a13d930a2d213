// kvq ppl --model PATH [--tokenizer PATH] --text PATH --ctx N [--windows K] [--method SPEC ...]
//         [--chunk N] [--decode N] [--json]
//
// Teacher-forced quality of cache methods on a real model: the fp16 cache and every method run
// side by side over the same windows of the text (see src/model/eval.h for the definitions).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>

#include "commands.h"
#include "core/json.h"
#include "kvq/cache.h"
#include "kvq/spec.h"
#include "kvq/store.h"
#include "model/eval.h"
#include "model_args.h"
#include "store_args.h"

namespace kvq::cli {

namespace {

// --store for kvq ppl: each window's prefill reuses the longest prefix that the reference
// cache and every method's cache all have in the store (each in its own namespace), and stores
// the chunks it computes.
class StoreHook final : public model::PrefillHook {
 public:
  StoreHook(StoreRun& run, std::vector<PrefixStore> stores)
      : run_(run), stores_(std::move(stores)) {}
  ~StoreHook() override { end_window(); }
  int64_t begin_window(std::span<const int32_t> prefill,
                       std::span<ModelCache* const> caches) override {
    end_window();
    std::vector<PrefixSession::Binding> b;
    for (size_t s = 0; s < caches.size(); ++s) b.push_back({caches[s], &stores_[s]});
    session_.emplace(std::move(b), prefill, run_.writer.get());
    tokens_ = static_cast<int64_t>(prefill.size());
    return session_->reuse(tokens_ - 1);
  }
  int64_t boundary() const override { return run_.chunk; }
  void reached(int64_t offset) override { session_->reached(offset); }
  void end_window() {
    if (session_) run_.add(*session_, tokens_);
    session_.reset();
  }

 private:
  StoreRun& run_;
  std::vector<PrefixStore> stores_;  // one per cache: the reference first, then each method
  std::optional<PrefixSession> session_;
  int64_t tokens_ = 0;
};

// A method as the short table names it: its name and the settings that differ from its defaults.
std::string short_name(const std::string& canonical) {
  auto spec = parse_model_spec(canonical);
  if (!spec.ok()) return canonical;
  const std::string diff = spec->spec.diff_from(Spec(spec->spec.method()));
  std::string out = spec->spec.method_name() + (diff.empty() ? "" : ":" + diff);
  for (const auto& [layer, o] : spec->overrides) out += "@" + std::to_string(layer) + ":" + o;
  return out;
}

// The main job's table: what a newcomer needs to read it (size, quality where the model
// generates, speed), the figures measured in the decode phase when there is one.
void print_short_table(const model::PplResult& res, int ctx) {
  const bool dec = res.rows[0].tokens_decode > 0;
  std::printf("%-34s %6s %7s %10s %7s %8s\n", "method", "bits", "ratio",
              dec ? "kld_decode" : "kld", dec ? "top1" : "top1", "tok/s");
  for (const auto& r : res.rows) {
    const double ratio = r.bits_per_element > 0 ? 16.0 / r.bits_per_element : 0.0;
    std::string name = short_name(r.method);
    if (name.size() > 34) name = name.substr(0, 31) + "...";
    std::printf("%-34s %6.2f %6.2fx %10.4f %7.3f %8.1f\n", name.c_str(), r.bits_per_element, ratio,
                dec ? r.kld_mean_decode : r.kld_mean, dec ? r.top1_agree_decode : r.top1_agree,
                r.tokens_per_s);
  }
  std::printf(
      "\nbits: all-in bits per K/V element held (fp16 = 16; scales, zeros, tables and the exact\n"
      "window included). %s: KL divergence of the next-token distribution from the fp16\n"
      "cache's%s (0 = identical);\ntop1: how often the most likely next token is the same.\n"
      "%lld predictions over %d window(s) of %d tokens in %.0f s. Every column: --wide.\n"
      "Full results, every method at 2 to 4 bits: docs/results.md.\n",
      dec ? "kld_decode" : "kld", dec ? ", on the tokens fed one at a time" : "",
      static_cast<long long>(dec ? res.rows[0].tokens_decode : res.rows[0].tokens), res.windows,
      ctx, res.wall_s);
}

Status run_ppl(const ParsedArgs& a) {
  model::PplOptions o;
  auto ctx = a.get_int("ctx"), windows = a.get_int("windows"), chunk = a.get_int("chunk"),
       decode = a.get_int("decode"), first = a.get_int("first-window");
  for (auto* r : {&ctx, &windows, &chunk, &decode, &first})
    if (!r->ok()) return r->status();
  for (auto* r : {&ctx, &windows, &chunk, &decode, &first})
    if (**r < 0 || **r > (1 << 24))
      return out_of_range(
          "--ctx, --windows, --first-window, --chunk and --decode must be in [0, 2^24]");
  o.ctx = static_cast<int>(*ctx);
  o.windows = static_cast<int>(*windows);
  o.first_window = static_cast<int>(*first);
  o.chunk = static_cast<int>(*chunk);
  // The default decode tail shrinks for tiny windows; an explicit --decode is validated as given.
  o.decode = static_cast<int>(
      a.has("decode") ? *decode : std::min<long long>(*decode, std::max<long long>(*ctx - 1, 0)));
  o.methods = a.get_all("method");
  if (o.methods.empty()) {  // the main job: one row per family, at its defaults
    for (const auto& m : method_table())
      if (m.name != "fp16" && m.in_main_job) o.methods.push_back(Spec(m).to_string());
  }
  for (const auto& m : o.methods) {
    auto spec = parse_model_spec(m);
    if (!spec.ok()) return spec.status().with_context("--method '" + m + "'");
  }
  const bool quiet = a.has("quiet");
  if (!quiet)
    o.progress = [](const std::string& line) {
      std::fprintf(stderr, "kvq ppl: %s\n", line.c_str());
    };

  std::string text_path;
  if (auto t = a.get("text")) {
    text_path = *t;
  } else {
    auto found = find_repo_file(kDefaultTextPath, "KVQ_TEXT");
    if (!found.ok())
      return not_found("no --text given and the default text is not found (" +
                       found.status().message() + ")");
    text_path = *found;
  }
  auto text = read_text_file(text_path);
  if (!text.ok()) return text.status();
  auto m = load_model_from_args(a, /*need_tokenizer=*/true);
  if (!m.ok()) return m.status();
  const std::vector<int32_t> tokens = m->tokenizer()->encode(*text);
  // The default of 2 windows shrinks to what a short text holds; an explicit --windows does not.
  if (!a.has("windows") && o.ctx > 0)
    o.windows = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(o.windows, static_cast<int64_t>(tokens.size()) / o.ctx)));
  const Status valid = model::validate_ppl_options(o, static_cast<int64_t>(tokens.size()));
  if (!valid.ok()) return valid;
  if (!quiet) {
    const int nw = o.windows > 0 ? o.windows
                                 : static_cast<int>(tokens.size() / o.ctx) - o.first_window;
    std::fprintf(stderr,
                 "kvq ppl: %s (%s, %d layers), %s: %zu tokens, %d window(s) of %d "
                 "(prefill chunks of %d, last %d one by one), %zu method(s) + fp16\n",
                 m->config().name.c_str(), m->config().arch.c_str(), m->config().n_layers,
                 text_path.c_str(), tokens.size(), nw, o.ctx, o.chunk, o.decode, o.methods.size());
  }
  auto store = open_store_run(a);
  if (!store.ok()) return store.status();
  std::optional<StoreHook> hook;
  if (*store) {
    std::vector<PrefixStore> stores;
    std::vector<std::string> names = {"fp16"};
    names.insert(names.end(), o.methods.begin(), o.methods.end());
    for (const auto& name : names) {
      auto cache = ModelCache::create(name, m->cache_shape());
      if (!cache.ok()) return cache.status().with_context("--method '" + name + "'");
      auto ps = (*store)->prefix_store(*cache);
      if (!ps.ok()) return ps.status().with_context("--method '" + name + "'");
      stores.push_back(std::move(ps).value());
    }
    hook.emplace(**store, std::move(stores));
    o.prefill_hook = &*hook;
  }
  auto res = model::evaluate_ppl(*m, tokens, o);
  if (!res.ok()) return res.status();
  if (hook) {
    hook->end_window();
    (*store)->report("ppl", a.has("quiet"));
  }

  if (a.has("json")) {
    json::Value rows = json::Value::array();
    for (const auto& r : res->rows) {
      json::Value j = json::Value::object();
      j.set("method", json::Value::string(r.method));
      j.set("tokens", json::Value::number(static_cast<double>(r.tokens)));
      j.set("ppl_fp16", json::Value::number(r.ppl_fp16));
      j.set("ppl", json::Value::number(r.ppl));
      j.set("kld_mean", json::Value::number(r.kld_mean));
      j.set("kld_p99", json::Value::number(r.kld_p99));
      j.set("top1_agree", json::Value::number(r.top1_agree));
      j.set("bits_per_element", json::Value::number(r.bits_per_element));
      j.set("resident_bytes", json::Value::number(std::round(r.resident_bytes)));
      j.set("fp16_bytes", json::Value::number(std::round(r.fp16_bytes)));
      j.set("tokens_per_s", json::Value::number(r.tokens_per_s));
      j.set("tokens_decode", json::Value::number(static_cast<double>(r.tokens_decode)));
      j.set("ppl_fp16_decode", json::Value::number(r.ppl_fp16_decode));
      j.set("ppl_decode", json::Value::number(r.ppl_decode));
      j.set("kld_mean_decode", json::Value::number(r.kld_mean_decode));
      j.set("kld_p99_decode", json::Value::number(r.kld_p99_decode));
      j.set("top1_agree_decode", json::Value::number(r.top1_agree_decode));
      if (hook)
        j.set("tokens_reused", json::Value::number(static_cast<double>(res->tokens_reused)));
      rows.push(std::move(j));
    }
    std::printf("%s\n", rows.dump(2).c_str());
  } else if (a.has("wide")) {
    // The method's canonical spec goes last: it can be long, and the numbers stay aligned. The
    // decode-phase columns (_d) cover the positions fed one at a time.
    const bool dec = res->rows[0].tokens_decode > 0;
    std::printf("%6s %6s %9s %9s %10s %10s %7s", "bits", "ratio", "ppl", "dppl", "kld_mean",
                "kld_p99", "top1");
    if (dec) std::printf(" %9s %10s %10s %7s", "dppl_d", "kld_mean_d", "kld_p99_d", "top1_d");
    std::printf(" %8s  %s\n", "tok/s", "method");
    for (const auto& r : res->rows) {
      const double ratio = r.bits_per_element > 0 ? 16.0 / r.bits_per_element : 0.0;
      std::printf("%6.3f %6.2f %9.4f %+9.4f %10.3e %10.3e %7.4f", r.bits_per_element, ratio, r.ppl,
                  r.ppl - r.ppl_fp16, r.kld_mean, r.kld_p99, r.top1_agree);
      if (dec)
        std::printf(" %+9.4f %10.3e %10.3e %7.4f", r.ppl_decode - r.ppl_fp16_decode,
                    r.kld_mean_decode, r.kld_p99_decode, r.top1_agree_decode);
      std::printf(" %8.1f  %s\n", r.tokens_per_s, r.method.c_str());
    }
    std::printf("%lld predictions over %d window(s) of %d tokens in %.1f s\n",
                static_cast<long long>(res->rows[0].tokens), res->windows, o.ctx, res->wall_s);
  } else {
    print_short_table(*res, o.ctx);
  }
  if (hook && !a.has("json"))
    std::printf("%lld prefill tokens reused from the store: they are not scored\n",
                static_cast<long long>(res->tokens_reused));
  return ok_status();
}

}  // namespace

Command ppl_command() {
  Command c("ppl", "teacher-forced quality of methods on a real model (KLD, PPL)",
            "[--model PATH] [--tokenizer PATH] [--text PATH] [--ctx N] [--windows K]\n"
            "               [--method SPEC ...] [--json]",
            run_ppl);
  c.description =
      "Runs the fp16 cache and each --method over the same consecutive windows of the text\n"
      "(prefill chunks, then the last --decode tokens one at a time) and reports per cache:\n"
      "perplexity, KL divergence of its next-token distribution from fp16's (mean, p99),\n"
      "top-1 agreement with fp16, all-in bits per element and bytes held, and tokens/s.";
  c.options = with_model_options(
      {option("text", "PATH",
              std::string("UTF-8 text to evaluate on (default ") + kDefaultTextPath + ")"),
       option("ctx", "N", "window length in tokens").defaults_to("1024"),
       option("windows", "K", "number of consecutive windows, 0 = all the text holds")
           .defaults_to("2"),
       option("first-window", "K",
              "start at window K (0-based): split a long run over processes, each its own windows")
           .defaults_to("0"),
       option("method", "SPEC",
              "a method spec to compare with fp16 (repeatable; default: one of each family at "
              "its defaults)")
           .repeatable(),
       option("chunk", "N", "prefill chunk length").defaults_to("256"),
       option("decode", "N", "tokens fed one at a time at the end of each window")
           .defaults_to("128"),
       flag("json", "print a JSON array of rows"),
       flag("wide", "every column: ppl, KLD mean and p99, top-1, over all positions and the "
                    "decode phase, and the full method spec"),
       flag("quiet", "no progress lines on stderr")});
  for (Option& o : store_options()) c.options.push_back(std::move(o));
  return c;
}

}  // namespace kvq::cli
