#include "model/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "kvq/cache.h"
#include "kvq/spec.h"
#include "model/ops.h"

namespace kvq::model {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct RowStats {
  float max = 0;
  double lse = 0;  // log-sum-exp
  int64_t argmax = 0;
};

// max, first argmax and log-sum-exp of a row; the exponentials are summed in double (8 lanes).
RowStats row_stats(const float* x, int64_t n) {
  RowStats st;
  float mx = x[0];
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, x[i]);
  st.max = mx;
  st.argmax = std::find(x, x + n, mx) - x;
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += exp_nonpositive(x[i + k] - mx);
  for (; i < n; ++i) acc[0] += exp_nonpositive(x[i] - mx);
  double sum = 0;
  for (double v : acc) sum += v;
  st.lse = static_cast<double>(mx) + std::log(sum);
  return st;
}

// p_i = exp(x_i - lse) of a row, as floats.
void row_probs(const float* x, int64_t n, const RowStats& st, float* p) {
  const float shift = static_cast<float>(st.lse - static_cast<double>(st.max));
  for (int64_t i = 0; i < n; ++i) p[i] = exp_nonpositive(x[i] - st.max - shift);
}

// KL(p || q) = sum_i p_i (log p_i - log q_i), with log p_i - log q_i = (x_i - y_i) - (lse_x -
// lse_y) formed per element in double, so that a constant shift between the rows cancels
// exactly instead of through a sum of probabilities. Identical rows give exactly 0.
double kl_row(const float* p, const float* x, const float* y, int64_t n, double dl) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; ++k)
      acc[k] += static_cast<double>(p[i + k]) * (static_cast<double>(x[i + k] - y[i + k]) - dl);
  for (; i < n; ++i) acc[0] += static_cast<double>(p[i]) * (static_cast<double>(x[i] - y[i]) - dl);
  double kl = 0;
  for (double v : acc) kl += v;
  return std::max(0.0, kl);  // KL >= 0; rounding can leave a -1e-12
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / static_cast<double>(v.size());
}

// Nearest-rank 99th percentile (reorders v).
double p99(std::vector<double>& v) {
  if (v.empty()) return 0.0;
  const size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(rank - 1), v.end());
  return v[rank - 1];
}

}  // namespace

PositionStats compare_logits(const float* ref, const float* other, int64_t vocab, int32_t target) {
  const RowStats r = row_stats(ref, vocab), o = row_stats(other, vocab);
  std::vector<float> p(static_cast<size_t>(vocab));
  row_probs(ref, vocab, r, p.data());
  PositionStats st;
  st.nll_ref = r.lse - ref[target];
  st.nll_other = o.lse - other[target];
  st.kld = kl_row(p.data(), ref, other, vocab, r.lse - o.lse);
  st.top1_agree = r.argmax == o.argmax;
  return st;
}

Status validate_ppl_options(const PplOptions& o, int64_t n_tokens) {
  if (o.ctx < 2) return invalid_argument("--ctx must be at least 2, got " + std::to_string(o.ctx));
  if (o.chunk < 1)
    return invalid_argument("--chunk must be at least 1, got " + std::to_string(o.chunk));
  if (o.decode < 0 || o.decode > o.ctx - 1)
    return invalid_argument("--decode must be in [0, ctx - 1 = " + std::to_string(o.ctx - 1) +
                            "], got " + std::to_string(o.decode));
  if (o.windows < 0)
    return invalid_argument("--windows must be >= 0, got " + std::to_string(o.windows));
  const int64_t available = n_tokens / o.ctx;
  if (available < 1)
    return invalid_argument("the text has " + std::to_string(n_tokens) +
                            " tokens, fewer than one window of --ctx " + std::to_string(o.ctx));
  if (o.first_window < 0 || o.first_window >= available)
    return invalid_argument("--first-window must be in [0, " + std::to_string(available - 1) +
                            "] (the text has " + std::to_string(available) + " windows of " +
                            std::to_string(o.ctx) + "), got " + std::to_string(o.first_window));
  if (int64_t{o.first_window} + o.windows > available)
    return invalid_argument("--windows " + std::to_string(o.windows) + " from window " +
                            std::to_string(o.first_window) + " needs " +
                            std::to_string((int64_t{o.first_window} + o.windows) * o.ctx) +
                            " tokens; the text has " + std::to_string(n_tokens) + " (" +
                            std::to_string(available) + " windows of " + std::to_string(o.ctx) +
                            ")");
  for (const auto& m : o.methods) {
    auto spec = parse_model_spec(m);  // per-layer overrides (e.g. XQuant pairings) allowed
    if (!spec.ok()) return spec.status().with_context("--method '" + m + "'");
  }
  return ok_status();
}

Result<PplResult> evaluate_ppl(const LlamaModel& model, std::span<const int32_t> tokens,
                               const PplOptions& o) {
  KVQ_RETURN_IF_ERROR(validate_ppl_options(o, static_cast<int64_t>(tokens.size())));
  const int64_t V = model.config().vocab_size, Dm = model.config().dim;
  const int n_windows = o.windows > 0
                            ? o.windows
                            : static_cast<int>(tokens.size() / o.ctx) - o.first_window;
  std::vector<std::string> names = {"fp16"};
  for (const auto& m : o.methods) names.push_back(parse_model_spec(m).value().to_string());
  const int n_seq = static_cast<int>(names.size());

  std::vector<ModelCache> caches;
  for (const auto& name : names) {
    auto c = ModelCache::create(name, model.cache_shape());
    if (!c.ok()) return c.status().with_context("creating the cache '" + name + "'");
    caches.push_back(std::move(c).value());
  }
  std::vector<ModelCache*> cache_ptrs;
  for (auto& c : caches) cache_ptrs.push_back(&c);

  struct Acc {
    double nll = 0;
    int64_t agree = 0;
    std::vector<double> kld;
    // The same over decode-phase positions (those fed one at a time).
    double nll_dec = 0;
    int64_t agree_dec = 0;
    std::vector<double> kld_dec;
    double bits = 0, resident = 0, fp16 = 0;
    double cache_s = 0;
  };
  std::vector<Acc> acc(static_cast<size_t>(n_seq));
  double nll_ref = 0, nll_ref_dec = 0, shared_s = 0;
  int64_t scored = 0, scored_dec = 0, total_reused = 0;
  const double t_start = now_s();

  const int64_t prefill_len = o.ctx - o.decode;
  std::vector<float> hidden, logits_all, logits_ref, logits_other, ref_probs;
  std::vector<RowStats> ref_stats;
  std::vector<int32_t> batch;
  for (int w = 0; w < n_windows; ++w) {
    const double tw = now_s();
    const int32_t* win = tokens.data() + (int64_t{o.first_window} + w) * o.ctx;
    for (auto& c : caches) c.reset();
    double win_cache_s = 0, win_total_s = 0;
    PrefillHook* hook = o.prefill_hook;
    // At most ctx - 2 tokens are reused, so that some position of the window is scored.
    const size_t reusable = static_cast<size_t>(std::min<int64_t>(prefill_len, o.ctx - 1));
    const int64_t reused =
        hook ? hook->begin_window(std::span<const int32_t>(win, reusable), cache_ptrs) : 0;
    total_reused += reused;
    for (int64_t pos = reused; pos < o.ctx;) {
      int64_t piece = pos < prefill_len ? std::min<int64_t>(o.chunk, prefill_len - pos) : 1;
      if (hook && pos < prefill_len && hook->boundary() > 0)
        piece = std::min(piece, (pos / hook->boundary() + 1) * hook->boundary() - pos);
      const int T = static_cast<int>(piece);
      batch.resize(static_cast<size_t>(n_seq) * T);
      for (int s = 0; s < n_seq; ++s)
        std::copy(win + pos, win + pos + T, batch.begin() + int64_t{s} * T);
      ForwardTiming timing;
      const double tf = now_s();
      KVQ_RETURN_IF_ERROR(model.forward(batch, T, cache_ptrs, &hidden, {}, &timing));
      for (int s = 0; s < n_seq; ++s) {
        acc[static_cast<size_t>(s)].cache_s += timing.cache_s[static_cast<size_t>(s)];
        win_cache_s += timing.cache_s[static_cast<size_t>(s)];
      }

      // Positions pos .. pos+T-1 predict the next token when it lies inside the window.
      const int n_pred = static_cast<int>(std::min<int64_t>(T, o.ctx - 1 - pos));
      // Logits of all sequences at once when that fits in ~256 MB (decode steps, few methods);
      // otherwise the reference's, then each method's in turn.
      const bool all_at_once = int64_t{n_seq} * T * V <= (int64_t{64} << 20);
      auto logits_of = [&](int s) -> const float* {
        if (all_at_once) return logits_all.data() + int64_t{s} * T * V;
        if (s == 0) return logits_ref.data();
        logits_other.resize(static_cast<size_t>(T * V));
        model.logits(hidden.data() + int64_t{s} * T * Dm, T, logits_other.data());
        return logits_other.data();
      };
      if (all_at_once) {
        logits_all.resize(static_cast<size_t>(int64_t{n_seq} * T * V));
        model.logits(hidden.data(), int64_t{n_seq} * T, logits_all.data());
      } else {
        logits_ref.resize(static_cast<size_t>(T * V));
        model.logits(hidden.data(), T, logits_ref.data());
      }
      // The reference's statistics and probabilities once per position, then one pass over
      // each method's logits (the fp16 row itself needs none: KL 0, same argmax).
      const float* ref = logits_of(0);
      ref_stats.resize(static_cast<size_t>(n_pred));
      ref_probs.resize(static_cast<size_t>(int64_t{n_pred} * V));
      parallel_rows(n_pred, V, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t) {
          ref_stats[static_cast<size_t>(t)] = row_stats(ref + t * V, V);
          row_probs(ref + t * V, V, ref_stats[static_cast<size_t>(t)],
                    &ref_probs[static_cast<size_t>(t * V)]);
        }
      });
      auto in_decode = [&](int64_t t) { return pos + t >= prefill_len; };
      for (int64_t t = 0; t < n_pred; ++t) {
        const double nll = ref_stats[static_cast<size_t>(t)].lse - ref[t * V + win[pos + t + 1]];
        nll_ref += nll;
        acc[0].nll += nll;
        acc[0].agree += 1;
        acc[0].kld.push_back(0.0);
        if (in_decode(t)) {
          nll_ref_dec += nll;
          acc[0].nll_dec += nll;
          acc[0].agree_dec += 1;
          acc[0].kld_dec.push_back(0.0);
          ++scored_dec;
        }
      }
      std::vector<PositionStats> st(static_cast<size_t>(n_pred));
      for (int s = 1; s < n_seq; ++s) {
        const float* other = logits_of(s);
        parallel_rows(n_pred, V, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) {
            const RowStats& r = ref_stats[static_cast<size_t>(t)];
            const RowStats q = row_stats(other + t * V, V);
            PositionStats& p = st[static_cast<size_t>(t)];
            p.nll_other = q.lse - other[t * V + win[pos + t + 1]];
            p.kld = kl_row(&ref_probs[static_cast<size_t>(t * V)], ref + t * V, other + t * V, V,
                           r.lse - q.lse);
            p.top1_agree = r.argmax == q.argmax;
          }
        });
        Acc& a = acc[static_cast<size_t>(s)];
        for (int64_t t = 0; t < n_pred; ++t) {
          const PositionStats& p = st[static_cast<size_t>(t)];
          a.nll += p.nll_other;
          a.agree += p.top1_agree ? 1 : 0;
          a.kld.push_back(p.kld);
          if (in_decode(t)) {
            a.nll_dec += p.nll_other;
            a.agree_dec += p.top1_agree ? 1 : 0;
            a.kld_dec.push_back(p.kld);
          }
        }
      }
      scored += n_pred;
      win_total_s += now_s() - tf;
      pos += T;
      if (hook && pos <= prefill_len) hook->reached(pos);
    }
    shared_s += win_total_s - win_cache_s;
    for (int s = 0; s < n_seq; ++s) {
      const CacheBytes b = caches[static_cast<size_t>(s)].bytes();
      Acc& a = acc[static_cast<size_t>(s)];
      a.bits += b.bits_per_element();
      a.resident += static_cast<double>(caches[static_cast<size_t>(s)].resident_bytes());
      a.fp16 += static_cast<double>(b.fp16_bytes());
    }
    if (o.progress) {
      char line[256];
      std::snprintf(line, sizeof(line), "window %d/%d: %.1fs, ppl(fp16) so far %.4f", w + 1,
                    n_windows, now_s() - tw, std::exp(nll_ref / static_cast<double>(scored)));
      std::string msg = line;
      for (int s = 1; s < n_seq; ++s) {
        const Acc& a = acc[static_cast<size_t>(s)];
        double kl = 0;
        for (double k : a.kld) kl += k;
        std::snprintf(
            line, sizeof(line), "; %s: ppl %.4f kld %.2e", names[static_cast<size_t>(s)].c_str(),
            std::exp(a.nll / static_cast<double>(scored)), kl / static_cast<double>(a.kld.size()));
        msg += line;
      }
      o.progress(msg);
    }
  }

  PplResult res;
  res.windows = n_windows;
  res.tokens_reused = total_reused;
  res.wall_s = now_s() - t_start;
  const double ppl_fp16 = std::exp(nll_ref / static_cast<double>(scored));
  const double fed = static_cast<double>(n_windows) * o.ctx;
  for (int s = 0; s < n_seq; ++s) {
    Acc& a = acc[static_cast<size_t>(s)];
    PplRow r;
    r.method = names[static_cast<size_t>(s)];
    r.tokens = scored;
    r.ppl_fp16 = ppl_fp16;
    r.ppl = std::exp(a.nll / static_cast<double>(scored));
    r.kld_mean = mean(a.kld);
    r.kld_p99 = p99(a.kld);
    r.top1_agree = static_cast<double>(a.agree) / static_cast<double>(scored);
    r.tokens_decode = scored_dec;
    if (scored_dec > 0) {
      r.ppl_fp16_decode = std::exp(nll_ref_dec / static_cast<double>(scored_dec));
      r.ppl_decode = std::exp(a.nll_dec / static_cast<double>(scored_dec));
      r.kld_mean_decode = mean(a.kld_dec);
      r.kld_p99_decode = p99(a.kld_dec);
      r.top1_agree_decode = static_cast<double>(a.agree_dec) / static_cast<double>(scored_dec);
    }
    r.bits_per_element = a.bits / n_windows;
    r.resident_bytes = a.resident / n_windows;
    r.fp16_bytes = a.fp16 / n_windows;
    const double t = shared_s / n_seq + a.cache_s;
    r.tokens_per_s = t > 0 ? fed / t : 0;
    res.rows.push_back(std::move(r));
  }
  return res;
}

}  // namespace kvq::model
