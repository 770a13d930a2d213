// A small Llama-family inference engine whose attention reads keys and values only through kvq
// caches. It exists to measure the quality of cache compression on a real model.
//
// Architecture: token embedding -> L x [RMSNorm -> Q/K/V projections -> RoPE on Q and K
// (adjacent pairs, llama.cpp's "normal" mode and llama2.c's convention) -> the cache (K and V
// appended after RoPE) -> grouped-query attention -> output projection, residual; RMSNorm ->
// SwiGLU MLP, residual] -> RMSNorm -> classifier (tied to the embedding unless the file has
// its own).
//
// Several sequences run in one forward pass: sequence s reads and writes caches[s], so many
// cache methods can be evaluated over the same tokens while the weights stream through memory
// once (the decode path is memory-bound). Rows of every activation are [n_seq * T] with the
// sequence-major order row = s * T + t.
//
// Weights are dequantized to fp32 at load; dense products run on packed weights (model/matmul.h),
// softmax and element-wise work on the engine's threads. Every product is batch-invariant
// (model/matmul.h) and so is the cache's attend(), so a token's activations, logits and the
// keys and values it puts into the caches do not depend on how the input was chunked: chunked
// prefill and token-by-token decoding give bit-identical results. Attention takes one of two
// paths through the cache API:
//   * attend: LayerCache::attend() (dequantization fused into the dot products), split over KV
//     heads and sequences — the default, for prefill chunks and decode alike;
//   * read:   LayerCache::read() and read_exact() to fp32, then sgemm-based attention under the
//     per-query semantics — what an engine with its own attention does (tests compare the two).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kvq/cache.h"
#include "kvq/status.h"
#include "model/matmul.h"
#include "model/tokenizer.h"

namespace kvq::model {

struct LlamaConfig {
  std::string arch;  // "llama" (GGUF) or "llama2.c"
  std::string name;  // general.name or the file name
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int vocab_size = 0;
  int context_length = 0;  // the trained context (informational; longer inputs are allowed)
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  float rope_freq_scale = 1.0f;  // linear RoPE scaling: angles use position * rope_freq_scale
  bool tied_embeddings = true;

  int q_dim() const { return n_heads * head_dim; }
  int kv_dim() const { return n_kv_heads * head_dim; }
  int64_t n_params() const;
};

enum class AttentionPath {
  kAttend,  // LayerCache::attend(): fused, batch-invariant (the default)
  kRead,    // read() + read_exact() + sgemm attention: an engine running its own attention
};

// Post-RoPE queries and keys, and values, of one layer as they enter the caches.
struct LayerActivations {
  int layer = 0;
  int n_seq = 0, n_tokens = 0;
  // Rows s * T + t of a [n_seq * T, row_stride] buffer: q at column 0 ([n_heads, head_dim]),
  // k at q_dim ([n_kv_heads, head_dim]), v at q_dim + kv_dim.
  const float* qkv = nullptr;
  int64_t row_stride = 0;
};

struct ForwardOptions {
  AttentionPath attention = AttentionPath::kAttend;
  // Called once per layer after RoPE, before the caches see the tokens (dump-kv, tests).
  std::function<void(const LayerActivations&)> observer;
};

// Time spent in one forward pass, for throughput accounting.
struct ForwardTiming {
  double total_s = 0;
  std::vector<double> cache_s;  // per sequence: append, read/attend and the attention arithmetic
};

class LlamaModel {
 public:
  // Loads a GGUF file (magic "GGUF") or a llama2.c checkpoint (anything else). The tokenizer
  // comes from the GGUF metadata, or from `tokenizer_path` for llama2.c checkpoints (where it is
  // optional: without it, tokenizer() is null and only token ids can be fed).
  static Result<LlamaModel> load(const std::string& path, const std::string& tokenizer_path = "");

  LlamaModel(LlamaModel&&) = default;
  LlamaModel& operator=(LlamaModel&&) = default;

  const LlamaConfig& config() const { return cfg_; }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // The shape every cache fed by this model must have.
  ModelShape cache_shape() const;

  // Runs T = n_tokens new tokens of n_seq sequences through the model.
  //   tokens: [n_seq, T] ids; sequence s continues at position caches[s]->offset().
  //   hidden_out: resized to [n_seq * T, dim], the final-RMSNormed hidden states (the
  //   classifier's input; see logits()).
  // Every cache must have this model's cache_shape(). On error (bad ids, a cache refusing its
  // input) the caches may hold some layers' tokens: reset them before reuse.
  Status forward(std::span<const int32_t> tokens, int n_tokens, std::span<ModelCache* const> caches,
                 std::vector<float>* hidden_out, const ForwardOptions& options = {},
                 ForwardTiming* timing = nullptr) const;

  // Classifier: logits [n_rows, vocab] of hidden rows [n_rows, dim].
  void logits(const float* hidden, int64_t n_rows, float* out) const;

 private:
  LlamaModel() = default;
  static Result<LlamaModel> load_gguf(const std::string& path);
  static Result<LlamaModel> load_llama2c(const std::string& path, const std::string& tok_path);
  Status finish_init();

  struct Layer {
    std::vector<float> attn_norm;  // [dim]
    std::vector<float> wqkv;       // [q_dim + 2 kv_dim, dim] (rows: q, then k, then v)
    std::vector<float> wo;         // [dim, q_dim]
    std::vector<float> ffn_norm;   // [dim]
    std::vector<float> w13;        // [2 hidden, dim] (rows: gate, then up)
    std::vector<float> w2;         // [dim, hidden]
    // The same, packed for matmul() (the row-major copies are dropped after packing).
    PackedMatrix pqkv, pwo, pw13, pw2;
  };

  LlamaConfig cfg_;
  std::vector<float> tok_emb_;     // [vocab, dim]
  std::vector<float> output_;      // [vocab, dim] as loaded; empty when tied (dropped when packed)
  PackedMatrix classifier_;        // the classifier (output_ or tok_emb_) packed
  std::vector<float> final_norm_;  // [dim]
  std::vector<Layer> layers_;
  std::vector<double> inv_freq_;  // [head_dim / 2] RoPE frequencies
  std::unique_ptr<Tokenizer> tokenizer_;
};

}  // namespace kvq::model
