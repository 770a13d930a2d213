// Reader of llama2.c checkpoints (Karpathy's llama2.c "legacy" export, version 0).
//
// Layout (little-endian): seven i32 — dim, hidden_dim, n_layers, n_heads, n_kv_heads,
// vocab_size (negative: the classifier is not tied to the embedding), seq_len — then f32 tensors
// in this order, each row-major [out, in] for matrices:
//   tok_emb [vocab, dim], rms_att [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim],
//   wv [L, kv_dim, dim], wo [L, dim, dim], rms_ffn [L, dim], w1 [L, hidden, dim],
//   w2 [L, dim, hidden], w3 [L, hidden, dim], rms_final [dim],
//   freq_cis_real [seq_len, head_dim/2], freq_cis_imag [seq_len, head_dim/2], [wcls [vocab, dim]]
// with kv_dim = dim * n_kv_heads / n_heads. The file size must match exactly what the header
// implies; every number is validated before anything is allocated.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/status.h"

namespace kvq::llama2c {

struct Checkpoint {
  int dim = 0, hidden_dim = 0, n_layers = 0, n_heads = 0, n_kv_heads = 0, vocab_size = 0,
      seq_len = 0;
  bool shared_classifier = true;
  int head_dim() const { return n_heads ? dim / n_heads : 0; }
  int kv_dim() const { return head_dim() * n_kv_heads; }

  std::vector<float> tok_emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final;
  std::vector<float> freq_cis_real, freq_cis_imag;
  std::vector<float> wcls;  // empty when shared_classifier
};

// Reads and validates a checkpoint (kIo, kFormat for wrong sizes/headers, kCorrupt for
// non-finite weights).
Result<Checkpoint> read_checkpoint(const std::string& path);
// Same for bytes in memory (tests).
Result<Checkpoint> parse_checkpoint(const uint8_t* data, size_t size, const std::string& name);

}  // namespace kvq::llama2c
