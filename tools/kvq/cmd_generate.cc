// kvq generate [--model PATH] [--tokenizer PATH] --prompt TEXT [--method SPEC] [-n N] [--chat]
//              [--store URL [--store-chunk N]]
//
// Greedy generation with the K/V cache of any method: the prompt is prefilled in chunks, then
// each new token is decoded one at a time. The continuation streams to stdout; speed and cache
// size go to stderr. With --store, the longest stored prefix of the prompt (whole chunks, never
// the last token) is imported instead of computed, the rest is prefilled in pieces that end at
// chunk boundaries, and every chunk the prompt completes is stored, in the background.
#include <chrono>
#include <cstdio>
#include <optional>

#include "commands.h"
#include "kvq/cache.h"
#include "kvq/spec.h"
#include "kvq/store.h"
#include "model_args.h"
#include "store_args.h"

namespace kvq::cli {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

Status run_generate(const ParsedArgs& a) {
  auto n_new = a.get_int("tokens");
  if (!n_new.ok()) return n_new.status();
  if (*n_new < 0 || *n_new > (1 << 20))
    return out_of_range("-n must be in [0, 2^20], got " + std::to_string(*n_new));
  auto spec = parse_model_spec(*a.get("method"));
  if (!spec.ok()) return spec.status();

  auto prompt = prompt_from_args(a);
  if (!prompt.ok()) return prompt.status();
  auto m = load_model_from_args(a, /*need_tokenizer=*/true);
  if (!m.ok()) return m.status();
  auto store = open_store_run(a);
  if (!store.ok()) return store.status();
  const model::Tokenizer& tok = *m->tokenizer();
  const bool chat = a.has("chat");
  auto encoded = encode_prompt(a, tok, *prompt);
  if (!encoded.ok()) return encoded.status();
  const std::vector<int32_t> ids = std::move(encoded).value();

  auto cache = ModelCache::create(spec->to_string(), m->cache_shape());
  if (!cache.ok()) return cache.status();
  ModelCache* cp = &*cache;
  const std::span<ModelCache* const> caches(&cp, 1);
  const int64_t V = m->config().vocab_size, D = m->config().dim;
  std::vector<float> hidden, logits(static_cast<size_t>(V));

  auto argmax_last = [&](int T) {
    m->logits(hidden.data() + int64_t{T - 1} * D, 1, logits.data());
    int32_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (logits[static_cast<size_t>(i)] > logits[static_cast<size_t>(best)])
        best = static_cast<int32_t>(i);
    return best;
  };

  std::optional<PrefixStore> prefix;
  if (*store) {
    auto ps = (*store)->prefix_store(*cache);
    if (!ps.ok()) return ps.status();
    prefix.emplace(std::move(ps).value());
  }

  // Prefill: the stored prefix first, then the rest in pieces (ending at chunk boundaries, each
  // of which is stored).
  const auto t0 = std::chrono::steady_clock::now();
  constexpr int64_t kChunk = 256;
  const int64_t n = static_cast<int64_t>(ids.size());
  std::optional<PrefixSession> session;
  int64_t p = 0;
  if (prefix) {
    session.emplace(std::vector<PrefixSession::Binding>{{cp, &*prefix}}, ids,
                    (*store)->writer.get());
    p = session->reuse(n - 1);
  }
  int last_T = 0;
  while (p < n) {
    const int64_t e = session ? session->piece_end(p, kChunk, n) : std::min(p + kChunk, n);
    last_T = static_cast<int>(e - p);
    Status st = m->forward(std::span<const int32_t>(ids.data() + p, static_cast<size_t>(last_T)),
                           last_T, caches, &hidden);
    if (!st.ok()) return st;
    p = e;
    if (session) session->reached(p);
  }
  int32_t next = argmax_last(last_T);
  const double prefill_s = seconds_since(t0);

  // Decode.
  if (!chat) std::fputs(prompt->c_str(), stdout);
  const auto t1 = std::chrono::steady_clock::now();
  int64_t generated = 0, steps = 0;
  for (int64_t i = 0; i < *n_new; ++i) {
    if (next == tok.eos_id()) break;
    const std::string bytes = tok.token_bytes(next);
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    std::fflush(stdout);
    ++generated;
    if (i + 1 == *n_new) break;
    const int32_t in = next;
    Status st = m->forward(std::span<const int32_t>(&in, 1), 1, caches, &hidden);
    if (!st.ok()) return st;
    next = argmax_last(1);
    ++steps;
  }
  std::fputc('\n', stdout);
  std::fflush(stdout);  // before the statistics on stderr
  const double decode_s = seconds_since(t1);
  if (!a.has("quiet")) {
    const CacheBytes b = cache->bytes();
    std::fprintf(stderr,
                 "kvq generate: %s; prompt %zu tokens in %.2f s (%.1f tok/s), %lld new tokens in "
                 "%.2f s (%.1f tok/s); cache %lld tokens, %.3f bits/element, %llu bytes held\n",
                 spec->to_string().c_str(), ids.size(), prefill_s,
                 static_cast<double>(ids.size()) / prefill_s, static_cast<long long>(generated),
                 decode_s, steps > 0 ? static_cast<double>(steps) / decode_s : 0.0,
                 static_cast<long long>(cache->offset()), b.bits_per_element(),
                 static_cast<unsigned long long>(cache->resident_bytes()));
  }
  if (session) {
    (*store)->add(*session, n);
    // Store problems are reported, never fatal: the continuation above is right either way.
    (*store)->report("generate", a.has("quiet"));
  }
  return ok_status();
}

}  // namespace

Command generate_command() {
  Command c(
      "generate", "greedy generation through a compressed cache",
      "[--model PATH] [--tokenizer PATH] (--prompt TEXT | --prompt-file PATH) [--method SPEC]\n"
      "                    [-n N] [--chat] [--store URL [--store-chunk N]]",
      run_generate);
  c.options = with_model_options(
      {option("method", "SPEC", "cache method spec").defaults_to("fp16"),
       option("tokens", "N", "tokens to generate").defaults_to("64").short_form('n'),
       flag("quiet", "no statistics on stderr")});
  for (auto* more : {&prompt_options, &store_options})
    for (Option& o : (*more)()) c.options.push_back(std::move(o));
  return c;
}

}  // namespace kvq::cli
