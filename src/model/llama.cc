#include "model/llama.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "model/gguf.h"
#include "model/llama2c.h"
#include "model/matmul.h"
#include "model/ops.h"

namespace kvq::model {

namespace {

// Query rows per attention work item on the read path.
constexpr int64_t kQueryBlock = 64;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

Status check_finite(const std::vector<float>& v, const std::string& what) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      return corrupt(what + " has a non-finite weight at element " + std::to_string(i));
  return ok_status();
}

}  // namespace

int64_t LlamaConfig::n_params() const {
  const int64_t per_layer = 2 * int64_t{dim} + int64_t{dim} * (q_dim() + 2 * kv_dim()) +
                            int64_t{q_dim()} * dim + 3 * int64_t{dim} * hidden_dim;
  return int64_t{vocab_size} * dim * (tied_embeddings ? 1 : 2) + dim + n_layers * per_layer;
}

ModelShape LlamaModel::cache_shape() const {
  RopeShape rope;
  rope.mode = RopeShape::Mode::kAdjacent;  // the engine's RoPE (llama.cpp "normal", llama2.c)
  rope.theta = cfg_.rope_theta;
  rope.freq_scale = cfg_.rope_freq_scale;
  return ModelShape::uniform(cfg_.n_layers, cfg_.n_kv_heads, cfg_.head_dim, cfg_.n_heads, rope);
}

// ---------------------------------------------------------------------------------------------
// Loading

Result<LlamaModel> LlamaModel::load(const std::string& path, const std::string& tokenizer_path) {
  KVQ_ASSIGN_OR_RETURN(gguf::MappedFile probe, gguf::MappedFile::open(path));
  const bool is_gguf = probe.size() >= 4 && std::memcmp(probe.data(), "GGUF", 4) == 0;
  if (is_gguf) {
    if (!tokenizer_path.empty())
      return invalid_argument("--tokenizer is for llama2.c checkpoints; " + path +
                              " is a GGUF file and carries its own tokenizer");
    return load_gguf(path);
  }
  return load_llama2c(path, tokenizer_path);
}

Result<LlamaModel> LlamaModel::load_gguf(const std::string& path) {
  KVQ_ASSIGN_OR_RETURN(gguf::File f, gguf::File::open(path));
  LlamaModel m;
  LlamaConfig& c = m.cfg_;
  KVQ_ASSIGN_OR_RETURN(c.arch, f.get_string("general.architecture"));
  if (c.arch != "llama")
    return unsupported(path + ": architecture '" + c.arch + "' (kvq's engine runs 'llama')");
  c.name = f.has("general.name") ? f.get_string("general.name").value() : path;
  const std::string a = c.arch + ".";
  auto get_pos = [&](const std::string& key, int* out, int64_t max) -> Status {
    KVQ_ASSIGN_OR_RETURN(int64_t v, f.get_int(key));
    if (v <= 0 || v > max)
      return format_error(path + ": " + key + " = " + std::to_string(v) + " out of range");
    *out = static_cast<int>(v);
    return ok_status();
  };
  KVQ_RETURN_IF_ERROR(get_pos(a + "embedding_length", &c.dim, 1 << 16));
  KVQ_RETURN_IF_ERROR(get_pos(a + "feed_forward_length", &c.hidden_dim, 1 << 18));
  KVQ_RETURN_IF_ERROR(get_pos(a + "block_count", &c.n_layers, 1024));
  KVQ_RETURN_IF_ERROR(get_pos(a + "attention.head_count", &c.n_heads, 1024));
  c.n_kv_heads = c.n_heads;
  if (f.has(a + "attention.head_count_kv"))
    KVQ_RETURN_IF_ERROR(get_pos(a + "attention.head_count_kv", &c.n_kv_heads, 1024));
  if (f.has(a + "context_length"))
    KVQ_RETURN_IF_ERROR(get_pos(a + "context_length", &c.context_length, 1 << 24));
  if (c.dim % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0)
    return format_error(path + ": heads (" + std::to_string(c.n_heads) + " query, " +
                        std::to_string(c.n_kv_heads) + " KV) do not divide the width " +
                        std::to_string(c.dim));
  c.head_dim = c.dim / c.n_heads;
  if (f.has(a + "attention.key_length")) {
    KVQ_ASSIGN_OR_RETURN(int64_t kl, f.get_int(a + "attention.key_length"));
    if (kl != c.head_dim) return unsupported(path + ": key_length differs from dim / heads");
  }
  if (c.head_dim % 2 != 0) return format_error(path + ": odd head_dim");
  if (f.has(a + "rope.dimension_count")) {
    KVQ_ASSIGN_OR_RETURN(int64_t rd, f.get_int(a + "rope.dimension_count"));
    if (rd != c.head_dim)
      return unsupported(path + ": partial rotary embedding (rope.dimension_count " +
                         std::to_string(rd) + " of head_dim " + std::to_string(c.head_dim) + ")");
  }
  if (f.has(a + "rope.freq_base")) {
    KVQ_ASSIGN_OR_RETURN(double theta, f.get_float(a + "rope.freq_base"));
    if (!(theta > 1.0) || !std::isfinite(theta)) return format_error(path + ": bad rope.freq_base");
    c.rope_theta = static_cast<float>(theta);
  }
  if (f.has(a + "rope.scaling.type")) {
    KVQ_ASSIGN_OR_RETURN(std::string type, f.get_string(a + "rope.scaling.type"));
    if (type == "linear") {
      KVQ_ASSIGN_OR_RETURN(double factor, f.get_float(a + "rope.scaling.factor"));
      if (!(factor > 0) || !std::isfinite(factor))
        return format_error(path + ": bad rope.scaling.factor");
      c.rope_freq_scale = static_cast<float>(1.0 / factor);
    } else if (type != "none") {
      return unsupported(path + ": RoPE scaling '" + type + "' (kvq implements none and linear)");
    }
  }
  if (f.has(a + "attention.layer_norm_rms_epsilon")) {
    KVQ_ASSIGN_OR_RETURN(double eps, f.get_float(a + "attention.layer_norm_rms_epsilon"));
    if (!(eps > 0) || !std::isfinite(eps)) return format_error(path + ": bad RMSNorm epsilon");
    c.rms_eps = static_cast<float>(eps);
  }
  const gguf::TensorInfo* emb = f.find_tensor("token_embd.weight");
  if (!emb) return format_error(path + ": no token_embd.weight tensor");
  if (emb->dims.size() != 2 || emb->dims[0] != c.dim || emb->dims[1] > (1 << 24))
    return format_error(path + ": token_embd.weight has unexpected dims");
  c.vocab_size = static_cast<int>(emb->dims[1]);
  c.tied_embeddings = f.find_tensor("output.weight") == nullptr;

  const int64_t D = c.dim, F = c.hidden_dim, QD = c.q_dim(), KD = c.kv_dim(), V = c.vocab_size;
  m.tok_emb_.resize(static_cast<size_t>(V * D));
  KVQ_RETURN_IF_ERROR(f.read_f32("token_embd.weight", {D, V}, m.tok_emb_.data(), V * D));
  if (!c.tied_embeddings) {
    m.output_.resize(static_cast<size_t>(V * D));
    KVQ_RETURN_IF_ERROR(f.read_f32("output.weight", {D, V}, m.output_.data(), V * D));
  }
  KVQ_RETURN_IF_ERROR(f.read_f32("output_norm.weight", {D}, &m.final_norm_));
  m.layers_.resize(static_cast<size_t>(c.n_layers));
  // Layers dequantize independently; errors are collected per layer.
  std::vector<Status> st(m.layers_.size());
  parallel_for(c.n_layers, [&](int64_t li) {
    const int l = static_cast<int>(li);
    Layer& L = m.layers_[static_cast<size_t>(l)];
    const std::string p = "blk." + std::to_string(l) + ".";
    L.wqkv.resize(static_cast<size_t>((QD + 2 * KD) * D));
    L.w13.resize(static_cast<size_t>(2 * F * D));
    L.wo.resize(static_cast<size_t>(D * QD));
    L.w2.resize(static_cast<size_t>(D * F));
    Status s = f.read_f32(p + "attn_norm.weight", {D}, &L.attn_norm);
    if (s.ok()) s = f.read_f32(p + "attn_q.weight", {D, QD}, L.wqkv.data(), QD * D);
    if (s.ok()) s = f.read_f32(p + "attn_k.weight", {D, KD}, L.wqkv.data() + QD * D, KD * D);
    if (s.ok()) s = f.read_f32(p + "attn_v.weight", {D, KD}, L.wqkv.data() + (QD + KD) * D, KD * D);
    if (s.ok()) s = f.read_f32(p + "attn_output.weight", {QD, D}, L.wo.data(), D * QD);
    if (s.ok()) s = f.read_f32(p + "ffn_norm.weight", {D}, &L.ffn_norm);
    if (s.ok()) s = f.read_f32(p + "ffn_gate.weight", {D, F}, L.w13.data(), F * D);
    if (s.ok()) s = f.read_f32(p + "ffn_up.weight", {D, F}, L.w13.data() + F * D, F * D);
    if (s.ok()) s = f.read_f32(p + "ffn_down.weight", {F, D}, L.w2.data(), D * F);
    st[static_cast<size_t>(l)] = s;
  });
  for (auto& s : st)
    if (!s.ok()) return s.with_context(path);
  KVQ_ASSIGN_OR_RETURN(m.tokenizer_, load_gguf_tokenizer(f));
  if (m.tokenizer_->vocab_size() != c.vocab_size)
    return format_error(path + ": the tokenizer has " + std::to_string(m.tokenizer_->vocab_size()) +
                        " tokens, the embedding " + std::to_string(c.vocab_size));
  KVQ_RETURN_IF_ERROR(m.finish_init());
  return m;
}

Result<LlamaModel> LlamaModel::load_llama2c(const std::string& path, const std::string& tok_path) {
  KVQ_ASSIGN_OR_RETURN(llama2c::Checkpoint ck, llama2c::read_checkpoint(path));
  LlamaModel m;
  LlamaConfig& c = m.cfg_;
  c.arch = "llama2.c";
  c.name = path;
  c.dim = ck.dim;
  c.hidden_dim = ck.hidden_dim;
  c.n_layers = ck.n_layers;
  c.n_heads = ck.n_heads;
  c.n_kv_heads = ck.n_kv_heads;
  c.head_dim = ck.head_dim();
  c.vocab_size = ck.vocab_size;
  c.context_length = ck.seq_len;
  c.rms_eps = 1e-5f;        // llama2.c's run.c
  c.rope_theta = 10000.0f;  // llama2.c's run.c (the stored freq_cis tables are not used by it)
  c.tied_embeddings = ck.shared_classifier;
  const size_t D = static_cast<size_t>(c.dim), F = static_cast<size_t>(c.hidden_dim),
               KD = static_cast<size_t>(c.kv_dim());
  m.tok_emb_ = std::move(ck.tok_emb);
  if (!c.tied_embeddings) m.output_ = std::move(ck.wcls);
  m.final_norm_ = std::move(ck.rms_final);
  m.layers_.resize(static_cast<size_t>(c.n_layers));
  for (size_t l = 0; l < m.layers_.size(); ++l) {
    Layer& L = m.layers_[l];
    auto slice = [&](const std::vector<float>& v, size_t n) {
      return std::vector<float>(v.begin() + static_cast<ptrdiff_t>(l * n),
                                v.begin() + static_cast<ptrdiff_t>((l + 1) * n));
    };
    L.attn_norm = slice(ck.rms_att, D);
    L.ffn_norm = slice(ck.rms_ffn, D);
    L.wo = slice(ck.wo, D * D);
    L.w2 = slice(ck.w2, D * F);
    L.wqkv = slice(ck.wq, D * D);
    auto k = slice(ck.wk, KD * D), v = slice(ck.wv, KD * D);
    L.wqkv.insert(L.wqkv.end(), k.begin(), k.end());
    L.wqkv.insert(L.wqkv.end(), v.begin(), v.end());
    L.w13 = slice(ck.w1, F * D);  // gate
    auto up = slice(ck.w3, F * D);
    L.w13.insert(L.w13.end(), up.begin(), up.end());
  }
  if (!tok_path.empty()) {
    KVQ_ASSIGN_OR_RETURN(m.tokenizer_, load_llama2c_tokenizer(tok_path, c.vocab_size));
  }
  KVQ_RETURN_IF_ERROR(m.finish_init());
  return m;
}

Status LlamaModel::finish_init() {
  use_single_threaded_blas();
  KVQ_RETURN_IF_ERROR(check_finite(tok_emb_, "token embedding"));
  KVQ_RETURN_IF_ERROR(check_finite(output_, "classifier"));
  KVQ_RETURN_IF_ERROR(check_finite(final_norm_, "final norm"));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    const std::string w = "layer " + std::to_string(l);
    for (const auto* v : {&L.attn_norm, &L.wqkv, &L.wo, &L.ffn_norm, &L.w13, &L.w2})
      KVQ_RETURN_IF_ERROR(check_finite(*v, w));
  }
  // Pack every product's weights for matmul() (model/matmul.h) and drop the row-major copies.
  const int64_t D = cfg_.dim, QD = cfg_.q_dim(), KD = cfg_.kv_dim(), F = cfg_.hidden_dim;
  for (Layer& L : layers_) {
    L.pqkv = PackedMatrix(L.wqkv.data(), QD + 2 * KD, D);
    L.pwo = PackedMatrix(L.wo.data(), D, QD);
    L.pw13 = PackedMatrix(L.w13.data(), 2 * F, D);
    L.pw2 = PackedMatrix(L.w2.data(), D, F);
    L.wqkv = {}, L.wo = {}, L.w13 = {}, L.w2 = {};
  }
  classifier_ =
      PackedMatrix(cfg_.tied_embeddings ? tok_emb_.data() : output_.data(), cfg_.vocab_size, D);
  output_ = {};
  // RoPE: pair i of a head rotates by position * theta^(-2i / head_dim).
  inv_freq_.resize(static_cast<size_t>(cfg_.head_dim / 2));
  for (size_t i = 0; i < inv_freq_.size(); ++i)
    inv_freq_[i] = std::pow(static_cast<double>(cfg_.rope_theta),
                            -2.0 * static_cast<double>(i) / cfg_.head_dim);
  return ok_status();
}

// ---------------------------------------------------------------------------------------------
// Forward pass

void LlamaModel::logits(const float* hidden, int64_t n_rows, float* out) const {
  matmul(hidden, n_rows, classifier_, out);
}

Status LlamaModel::forward(std::span<const int32_t> tokens, int n_tokens,
                           std::span<ModelCache* const> caches, std::vector<float>* hidden_out,
                           const ForwardOptions& options, ForwardTiming* timing) const {
  const double t_start = now_s();
  const int n_seq = static_cast<int>(caches.size());
  const int T = n_tokens;
  if (n_seq < 1) return invalid_argument("forward: no caches (one per sequence)");
  if (T < 1) return invalid_argument("forward: no tokens");
  if (tokens.size() != static_cast<size_t>(n_seq) * static_cast<size_t>(T))
    return shape_mismatch("forward: " + std::to_string(tokens.size()) + " token ids for " +
                          std::to_string(n_seq) + " sequences of " + std::to_string(T));
  for (int32_t id : tokens)
    if (id < 0 || id >= cfg_.vocab_size)
      return out_of_range("forward: token id " + std::to_string(id) +
                          " outside the vocabulary [0, " + std::to_string(cfg_.vocab_size) + ")");
  std::vector<int64_t> pos0(static_cast<size_t>(n_seq));
  for (int s = 0; s < n_seq; ++s) {
    const ModelCache* c = caches[static_cast<size_t>(s)];
    if (!c) return invalid_argument("forward: null cache");
    if (c->n_layers() != cfg_.n_layers)
      return shape_mismatch("forward: cache has " + std::to_string(c->n_layers()) +
                            " layers, the model " + std::to_string(cfg_.n_layers));
    for (int l = 0; l < cfg_.n_layers; ++l) {
      const LayerShape& sh = c->layer(l).shape();
      const int q_heads = sh.n_q_heads ? sh.n_q_heads : sh.n_kv_heads;
      if (sh.n_kv_heads != cfg_.n_kv_heads || sh.head_dim != cfg_.head_dim ||
          q_heads != cfg_.n_heads)
        return shape_mismatch("forward: cache layer " + std::to_string(l) +
                              " does not have the model's attention shape");
      if (c->layer(l).offset() != c->layer(0).offset())
        return invalid_argument(
            "forward: cache layers hold different numbers of tokens "
            "(an earlier forward failed half-way; reset the cache)");
    }
    pos0[static_cast<size_t>(s)] = c->offset();
  }

  const int64_t D = cfg_.dim, HD = cfg_.head_dim, Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads;
  const int64_t QD = cfg_.q_dim(), KD = cfg_.kv_dim(), F = cfg_.hidden_dim;
  const int64_t M = int64_t{n_seq} * T;
  const int64_t QKV = QD + 2 * KD;
  const int64_t rep = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(HD));

  std::vector<float> x(static_cast<size_t>(M * D)), xn(static_cast<size_t>(M * D));
  std::vector<float> qkv(static_cast<size_t>(M * QKV)), attn(static_cast<size_t>(M * QD));
  std::vector<float> gu(static_cast<size_t>(M * 2 * F)), act(static_cast<size_t>(M * F));
  for (int64_t r = 0; r < M; ++r)
    std::memcpy(&x[static_cast<size_t>(r * D)],
                &tok_emb_[static_cast<size_t>(tokens[static_cast<size_t>(r)]) * D],
                static_cast<size_t>(D) * sizeof(float));

  // RoPE angles per row: [M, HD/2] cos and sin.
  std::vector<float> rope_cos(static_cast<size_t>(M * HD / 2)), rope_sin(rope_cos.size());
  for (int s = 0; s < n_seq; ++s)
    for (int t = 0; t < T; ++t) {
      const double p = static_cast<double>(pos0[static_cast<size_t>(s)] + t) * cfg_.rope_freq_scale;
      const size_t base = static_cast<size_t>((int64_t{s} * T + t) * (HD / 2));
      for (int64_t i = 0; i < HD / 2; ++i) {
        const double a = p * inv_freq_[static_cast<size_t>(i)];
        rope_cos[base + static_cast<size_t>(i)] = static_cast<float>(std::cos(a));
        rope_sin[base + static_cast<size_t>(i)] = static_cast<float>(std::sin(a));
      }
    }

  const bool use_attend = options.attention == AttentionPath::kAttend;
  std::vector<double> cache_s(static_cast<size_t>(n_seq), 0.0);
  std::vector<std::vector<float>> kv_f32;    // read path: per sequence [2, Hkv, n, HD]
  std::vector<std::vector<float>> kv_exact;  // per sequence [2, Hkv, n - exact_begin, HD]

  for (int l = 0; l < cfg_.n_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    rmsnorm_rows(x.data(), L.attn_norm.data(), xn.data(), M, D, cfg_.rms_eps);
    matmul(xn.data(), M, L.pqkv, qkv.data());
    // RoPE on the query heads and key heads of every row (adjacent pairs).
    parallel_rows(M, (Hq + Hkv) * HD, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float* row = &qkv[static_cast<size_t>(r * QKV)];
        const float* cs = &rope_cos[static_cast<size_t>(r * (HD / 2))];
        const float* sn = &rope_sin[static_cast<size_t>(r * (HD / 2))];
        for (int64_t h = 0; h < Hq + Hkv; ++h) {
          float* v = row + h * HD;  // q heads then k heads: contiguous at the row's start
          for (int64_t i = 0; i < HD / 2; ++i) {
            const float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * cs[i] - b * sn[i];
            v[2 * i + 1] = a * sn[i] + b * cs[i];
          }
        }
      }
    });
    if (options.observer) options.observer(LayerActivations{l, n_seq, T, qkv.data(), QKV});

    // Views of sequence s: logical [1, H, T, HD] over rows s*T .. s*T+T-1 of qkv / attn.
    auto q_view = [&](int s) {
      return TensorView{&qkv[static_cast<size_t>(int64_t{s} * T * QKV)],
                        DType::kF32,
                        {1, Hq, T, HD},
                        {T * QKV, HD, QKV, 1}};
    };
    auto k_view = [&](int s) {
      return TensorView{&qkv[static_cast<size_t>(int64_t{s} * T * QKV + QD)],
                        DType::kF32,
                        {1, Hkv, T, HD},
                        {T * QKV, HD, QKV, 1}};
    };
    auto v_view = [&](int s) {
      return TensorView{&qkv[static_cast<size_t>(int64_t{s} * T * QKV + QD + KD)],
                        DType::kF32,
                        {1, Hkv, T, HD},
                        {T * QKV, HD, QKV, 1}};
    };
    auto out_view = [&](int s) {
      return MutTensorView{&attn[static_cast<size_t>(int64_t{s} * T * QD)],
                           DType::kF32,
                           {1, Hq, T, HD},
                           {T * QD, HD, QD, 1}};
    };

    for (int s = 0; s < n_seq; ++s) {
      const double t0 = now_s();
      const TensorView q = q_view(s);
      Status st = caches[static_cast<size_t>(s)]->layer(l).append(k_view(s), v_view(s), &q);
      cache_s[static_cast<size_t>(s)] += now_s() - t0;
      if (!st.ok())
        return st.with_context("layer " + std::to_string(l) + ", sequence " + std::to_string(s));
    }

    if (use_attend) {
      // One work item per (sequence, KV head); attend() is const and thread-safe.
      const int n_items = n_seq * static_cast<int>(Hkv);
      std::vector<Status> item_status(static_cast<size_t>(n_items));
      std::vector<double> item_s(static_cast<size_t>(n_items), 0.0);
      const double t0 = now_s();
      const int64_t work = int64_t{n_seq} * T * Hq * HD * (caches[0]->layer(l).offset() + 1);
      auto attend_item = [&](int64_t it) {
        const int s = static_cast<int>(it / Hkv), g = static_cast<int>(it % Hkv);
        const double ti = now_s();
        item_status[static_cast<size_t>(it)] = caches[static_cast<size_t>(s)]->layer(l).attend(
            q_view(s), scale, out_view(s), g, g + 1);
        item_s[static_cast<size_t>(it)] = now_s() - ti;
      };
      if (work >= 4 * kParallelMinWork) {
        parallel_for(n_items, attend_item);
      } else {
        for (int it = 0; it < n_items; ++it) attend_item(it);
      }
      const double wall = now_s() - t0;
      double cpu = 0;
      for (double v : item_s) cpu += v;
      for (int it = 0; it < n_items; ++it) {
        if (!item_status[static_cast<size_t>(it)].ok())
          return item_status[static_cast<size_t>(it)].with_context("layer " + std::to_string(l));
        // Wall time of the parallel section, shared out by each item's share of the work.
        cache_s[static_cast<size_t>(it / Hkv)] +=
            cpu > 0 ? wall * item_s[static_cast<size_t>(it)] / cpu : 0.0;
      }
    } else {
      // Read every sequence's whole history to fp32, then attention by matrix products, under
      // the caches' per-query semantics (kvq/cache.h): a query at position p sees keys below
      // sealed_tokens_for_query(p) dequantized (read) and the newer ones exact (read_exact).
      // Work items are (sequence, KV head, block of queries that share one seal boundary): each
      // needs only the keys its last query can see, and the items keep both threads busy even
      // for one sequence.
      const double t0 = now_s();
      std::vector<Status> read_status(static_cast<size_t>(n_seq));
      std::vector<double> seq_cpu(static_cast<size_t>(n_seq), 0.0);
      kv_f32.resize(static_cast<size_t>(n_seq));
      kv_exact.resize(static_cast<size_t>(n_seq));
      auto read_seq = [&](int64_t si) {
        const int s = static_cast<int>(si);
        const double ti = now_s();
        const LayerCache& lc = caches[static_cast<size_t>(s)]->layer(l);
        const int64_t n = lc.offset(), eb = lc.exact_begin(), ne = n - eb;
        auto& buf = kv_f32[static_cast<size_t>(s)];
        buf.resize(static_cast<size_t>(2 * Hkv * n * HD));
        Status st =
            lc.read(0, n, MutTensorView::bhsd(buf.data(), DType::kF32, 1, Hkv, n, HD),
                    MutTensorView::bhsd(buf.data() + Hkv * n * HD, DType::kF32, 1, Hkv, n, HD));
        auto& ex = kv_exact[static_cast<size_t>(s)];
        ex.resize(static_cast<size_t>(2 * Hkv * ne * HD));
        if (st.ok())
          st = lc.read_exact(
              eb, ne, MutTensorView::bhsd(ex.data(), DType::kF32, 1, Hkv, ne, HD),
              MutTensorView::bhsd(ex.data() + Hkv * ne * HD, DType::kF32, 1, Hkv, ne, HD));
        read_status[static_cast<size_t>(s)] = st;
        seq_cpu[static_cast<size_t>(s)] += now_s() - ti;
      };
      if (n_seq > 1 && caches[0]->layer(l).offset() * KD >= kParallelMinWork) {
        parallel_for(n_seq, read_seq);
      } else {
        for (int s = 0; s < n_seq; ++s) read_seq(s);
      }
      for (int s = 0; s < n_seq; ++s)
        if (!read_status[static_cast<size_t>(s)].ok())
          return read_status[static_cast<size_t>(s)].with_context(
              "layer " + std::to_string(l) + ", sequence " + std::to_string(s));
      // Query blocks per sequence: runs of at most kQueryBlock queries with one seal boundary.
      struct QueryBlock {
        int s;
        int64_t t0, tb, boundary;
      };
      std::vector<QueryBlock> qblocks;
      for (int s = 0; s < n_seq; ++s) {
        const LayerCache& lc = caches[static_cast<size_t>(s)]->layer(l);
        const int64_t p0 = lc.offset() - T;
        for (int64_t t = 0; t < T;) {
          const int64_t bnd = lc.sealed_tokens_for_query(p0 + t);
          int64_t e = t + 1;
          while (e < T && e - t < kQueryBlock && lc.sealed_tokens_for_query(p0 + e) == bnd) ++e;
          qblocks.push_back({s, t, e - t, bnd});
          t = e;
        }
      }
      const int64_t n_items = static_cast<int64_t>(qblocks.size()) * Hkv;
      std::vector<double> item_s(static_cast<size_t>(n_items), 0.0);
      const int64_t work = int64_t{n_seq} * T * Hq * HD * (caches[0]->layer(l).offset() + 1);
      auto attention_item = [&](int64_t it) {
        thread_local std::vector<float> qg, sc, og;  // per-thread scratch, kept between calls
        thread_local std::vector<int64_t> lens;
        const double ti = now_s();
        const QueryBlock& qb = qblocks[static_cast<size_t>(it / Hkv)];
        const int s = qb.s;
        const int64_t g = it % Hkv, t0b = qb.t0, tb = qb.tb;
        const LayerCache& lc = caches[static_cast<size_t>(s)]->layer(l);
        const int64_t n = lc.offset(), eb = lc.exact_begin(), ne = n - eb;
        const int64_t n_vis = n - T + t0b + tb;          // keys the block's last query sees
        const int64_t S = std::min(qb.boundary, n_vis);  // keys [0, S) dequantized, rest exact
        const float* kg = kv_f32[static_cast<size_t>(s)].data() + g * n * HD;
        const float* vg = kv_f32[static_cast<size_t>(s)].data() + (Hkv + g) * n * HD;
        const float* kx = kv_exact[static_cast<size_t>(s)].data() + (g * ne + (S - eb)) * HD;
        const float* vx =
            kv_exact[static_cast<size_t>(s)].data() + ((Hkv + g) * ne + (S - eb)) * HD;
        const int64_t rows = rep * tb;  // the block's queries of the KV head's query heads
        qg.resize(static_cast<size_t>(rows * HD));
        sc.resize(static_cast<size_t>(rows * n_vis));
        og.resize(static_cast<size_t>(rows * HD));
        lens.resize(static_cast<size_t>(rows));
        for (int64_t j = 0; j < rep; ++j)
          for (int64_t t = 0; t < tb; ++t) {
            const int64_t row = int64_t{s} * T + t0b + t;
            std::memcpy(&qg[static_cast<size_t>((j * tb + t) * HD)],
                        &qkv[static_cast<size_t>(row * QKV + (g * rep + j) * HD)],
                        static_cast<size_t>(HD) * sizeof(float));
            lens[static_cast<size_t>(j * tb + t)] = n - T + t0b + t + 1;  // causal
          }
        const int r = static_cast<int>(rows), ld = static_cast<int>(n_vis),
                  hd = static_cast<int>(HD);
        // scores [rows, n_vis] = scale * qg [rows, HD] . [kg[0, S) | kx[S, n_vis)]^T
        if (S > 0)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, static_cast<int>(S), hd, scale,
                      qg.data(), hd, kg, hd, 0.0f, sc.data(), ld);
        if (n_vis > S)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, static_cast<int>(n_vis - S), hd,
                      scale, qg.data(), hd, kx, hd, 0.0f, sc.data() + S, ld);
        softmax_rows_prefix(sc.data(), rows, n_vis, lens.data());
        // og [rows, HD] = probabilities [rows, n_vis] . [vg[0, S) ; vx[S, n_vis)]
        if (S > 0)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, hd, static_cast<int>(S), 1.0f,
                      sc.data(), ld, vg, hd, 0.0f, og.data(), hd);
        if (n_vis > S)
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, hd, static_cast<int>(n_vis - S),
                      1.0f, sc.data() + S, ld, vx, hd, S > 0 ? 1.0f : 0.0f, og.data(), hd);
        for (int64_t j = 0; j < rep; ++j)
          for (int64_t t = 0; t < tb; ++t)
            std::memcpy(
                &attn[static_cast<size_t>((int64_t{s} * T + t0b + t) * QD + (g * rep + j) * HD)],
                &og[static_cast<size_t>((j * tb + t) * HD)],
                static_cast<size_t>(HD) * sizeof(float));
        item_s[static_cast<size_t>(it)] = now_s() - ti;
      };
      if (work >= 4 * kParallelMinWork) {
        parallel_for(n_items, attention_item);
      } else {
        for (int64_t it = 0; it < n_items; ++it) attention_item(it);
      }
      for (int64_t it = 0; it < n_items; ++it)
        seq_cpu[static_cast<size_t>(qblocks[static_cast<size_t>(it / Hkv)].s)] +=
            item_s[static_cast<size_t>(it)];
      const double wall = now_s() - t0;
      double cpu = 0;
      for (double v : seq_cpu) cpu += v;
      for (int s = 0; s < n_seq; ++s)
        cache_s[static_cast<size_t>(s)] +=
            cpu > 0 ? wall * seq_cpu[static_cast<size_t>(s)] / cpu : 0.0;
    }

    matmul(attn.data(), M, L.pwo, x.data(), true);  // x += attn . wo^T
    rmsnorm_rows(x.data(), L.ffn_norm.data(), xn.data(), M, D, cfg_.rms_eps);
    matmul(xn.data(), M, L.pw13, gu.data());
    swiglu_rows(gu.data(), act.data(), M, F);
    matmul(act.data(), M, L.pw2, x.data(), true);  // x += act . w2^T
  }
  hidden_out->resize(static_cast<size_t>(M * D));
  rmsnorm_rows(x.data(), final_norm_.data(), hidden_out->data(), M, D, cfg_.rms_eps);
  if (timing) {
    timing->total_s = now_s() - t_start;
    timing->cache_s = std::move(cache_s);
  }
  return ok_status();
}

}  // namespace kvq::model
