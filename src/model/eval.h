// Teacher-forced quality evaluation of cache methods on a real model (`kvq ppl`).
//
// The token stream is cut into consecutive windows of `ctx` tokens. Each window is run through
// the model once for all caches together: sequence 0 uses the fp16 cache (the reference), and
// sequence i > 0 the i-th method's cache, all fed the same tokens. The first ctx - decode tokens
// go in prefill chunks of `chunk` tokens, the last `decode` tokens one at a time. Under the
// caches' per-query semantics and the engine's batch-invariant products the two give identical
// results (a window fed token by token, --decode ctx-1, scores exactly the same); the decode
// figures below are those of the window's late, long-context positions. Every position
// t < ctx - 1 of a window predicts token t + 1:
//   nll      -log p(token t+1) under each cache; ppl = exp(mean nll)
//   kld      KL(p_fp16 || p_method) of the full next-token distributions (nats)
//   top1     whether both caches' most likely next token is the same
// and the same three over the decode phase (positions ctx - decode .. ctx - 2).
// Cache sizes (bits per element, resident bytes, fp16-equivalent bytes) are read at the end of
// each window (the cache then holds ctx tokens) and averaged over windows.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "kvq/status.h"
#include "model/llama.h"

namespace kvq::model {

// Prefix reuse for `kvq ppl --store`, kept engine-agnostic here (the CLI implements it over a
// store): before each window the hook may import a prefix of the window into every cache (the
// same length for all); the window's prefill then starts there, in pieces that do not cross
// the hook's boundaries, and the positions inside the imported prefix are not scored (there
// are no logits for them: the figures cover the positions computed). The hook sees the end of
// every prefill piece, to store the chunks completed.
class PrefillHook {
 public:
  virtual ~PrefillHook() = default;
  // `prefill` is the window's prefill part; the caches are empty. Returns the tokens imported,
  // fewer than prefill.size().
  virtual int64_t begin_window(std::span<const int32_t> prefill,
                               std::span<ModelCache* const> caches) = 0;
  // Prefill pieces end at multiples of this (when they cross one).
  virtual int64_t boundary() const = 0;
  // After each prefill piece: every cache holds `offset` tokens of the window.
  virtual void reached(int64_t offset) = 0;
};

struct PplOptions {
  int ctx = 2048;
  int windows = 0;   // 0: every whole window the tokens allow (from first_window on)
  // Windows are counted from this one (0-based): a long evaluation split over processes, each
  // taking its own windows, covers exactly the windows one process would.
  int first_window = 0;
  int chunk = 256;   // prefill chunk length
  int decode = 128;  // tokens fed one at a time at the end of each window
  // Methods compared with the fp16 reference (spec strings; "fp16" itself is allowed and must
  // come out with kld 0 and top1 1).
  std::vector<std::string> methods;
  // Progress lines ("window 2/8 ...") for stderr; may be empty.
  std::function<void(const std::string&)> progress;
  // Prefix reuse (see PrefillHook); null: every window is computed whole.
  PrefillHook* prefill_hook = nullptr;
};

// One row per cache: the fp16 reference first, then each method in order.
struct PplRow {
  std::string method;     // canonical spec
  int64_t tokens = 0;     // predictions scored
  double ppl_fp16 = 0;    // perplexity with the fp16 cache (same for every row)
  double ppl = 0;         // perplexity with this cache
  double kld_mean = 0;    // mean KL(p_fp16 || p_method), nats
  double kld_p99 = 0;     // 99th percentile of the per-position KL
  double top1_agree = 0;  // fraction of positions with the same argmax
  // The same over the decode phase: the positions fed one at a time (the last `decode` of each
  // window, less the window's last position, which predicts nothing). 0 when decode = 0.
  int64_t tokens_decode = 0;
  double ppl_fp16_decode = 0, ppl_decode = 0;
  double kld_mean_decode = 0, kld_p99_decode = 0, top1_agree_decode = 0;
  double bits_per_element = 0;
  double resident_bytes = 0;  // at the end of a window, averaged over windows
  double fp16_bytes = 0;
  // Tokens per second of this cache's sequence: tokens fed / (its own cache time + an equal
  // share of the time common to all sequences — dense layers, classifier, scoring).
  double tokens_per_s = 0;
};

struct PplResult {
  std::vector<PplRow> rows;
  int windows = 0;
  int64_t tokens_reused = 0;  // prefill tokens imported through the prefill hook, all windows
  double wall_s = 0;
};

// Checks the options against the model and the token count (kInvalidArgument with the reason).
Status validate_ppl_options(const PplOptions& options, int64_t n_tokens);

Result<PplResult> evaluate_ppl(const LlamaModel& model, std::span<const int32_t> tokens,
                               const PplOptions& options);

// Per-position comparison of two logit rows [vocab] (exposed for tests):
// nll of `target` under each, KL(p_ref || p_other) and whether the argmaxes agree.
struct PositionStats {
  double nll_ref = 0, nll_other = 0, kld = 0;
  bool top1_agree = false;
};
PositionStats compare_logits(const float* ref, const float* other, int64_t vocab, int32_t target);

}  // namespace kvq::model
