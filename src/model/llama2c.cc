#include "model/llama2c.h"

#include <cmath>
#include <cstring>

#include "core/file_io.h"

namespace kvq::llama2c {

Result<Checkpoint> parse_checkpoint(const uint8_t* data, size_t size, const std::string& name) {
  const std::string where = "llama2.c checkpoint '" + name + "'";
  if (size < 28) return format_error(where + " is shorter than its 28-byte header");
  int32_t h[7];
  std::memcpy(h, data, sizeof(h));
  if (static_cast<uint32_t>(h[0]) == 0x616b3432u)  // "ak42": the newer versioned exports
    return unsupported(where +
                       " uses llama2.c's versioned export format; kvq reads the legacy "
                       "(version 0) format");
  Checkpoint c;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  const int64_t vocab = h[5] < 0 ? -static_cast<int64_t>(h[5]) : h[5];  // no overflow at INT_MIN
  c.vocab_size = vocab > (1 << 24) ? 0 : static_cast<int>(vocab);
  c.shared_classifier = h[5] > 0;
  c.seq_len = h[6];
  auto bad = [&](const std::string& what) {
    return format_error(
        where + ": " + what + " (header dim=" + std::to_string(h[0]) +
        " hidden_dim=" + std::to_string(h[1]) + " n_layers=" + std::to_string(h[2]) +
        " n_heads=" + std::to_string(h[3]) + " n_kv_heads=" + std::to_string(h[4]) +
        " vocab_size=" + std::to_string(h[5]) + " seq_len=" + std::to_string(h[6]) + ")");
  };
  if (c.dim <= 0 || c.dim > (1 << 16)) return bad("dim out of range");
  if (c.hidden_dim <= 0 || c.hidden_dim > (1 << 18)) return bad("hidden_dim out of range");
  if (c.n_layers <= 0 || c.n_layers > 1024) return bad("n_layers out of range");
  if (c.n_heads <= 0 || c.dim % c.n_heads != 0) return bad("n_heads does not divide dim");
  if (c.n_kv_heads <= 0 || c.n_heads % c.n_kv_heads != 0)
    return bad("n_kv_heads does not divide n_heads");
  if (c.head_dim() % 2 != 0) return bad("head_dim is odd (RoPE rotates pairs)");
  if (c.vocab_size <= 0 || c.vocab_size > (1 << 24)) return bad("vocab_size out of range");
  if (c.seq_len <= 0 || c.seq_len > (1 << 22)) return bad("seq_len out of range");

  const uint64_t L = static_cast<uint64_t>(c.n_layers), D = static_cast<uint64_t>(c.dim),
                 F = static_cast<uint64_t>(c.hidden_dim), V = static_cast<uint64_t>(c.vocab_size),
                 KV = static_cast<uint64_t>(c.kv_dim()),
                 R = static_cast<uint64_t>(c.seq_len) * static_cast<uint64_t>(c.head_dim() / 2);
  struct Part {
    std::vector<float>* dst;
    uint64_t n;
  };
  std::vector<Part> parts = {{&c.tok_emb, V * D},  {&c.rms_att, L * D}, {&c.wq, L * D * D},
                             {&c.wk, L * KV * D},  {&c.wv, L * KV * D}, {&c.wo, L * D * D},
                             {&c.rms_ffn, L * D},  {&c.w1, L * F * D},  {&c.w2, L * D * F},
                             {&c.w3, L * F * D},   {&c.rms_final, D},   {&c.freq_cis_real, R},
                             {&c.freq_cis_imag, R}};
  if (!c.shared_classifier) parts.push_back({&c.wcls, V * D});
  uint64_t total = 0;
  for (const auto& p : parts) total += p.n;  // each term < 2^62 given the bounds above
  const uint64_t expect = 28 + 4 * total;
  if (size != expect)
    return bad("the header implies " + std::to_string(expect) + " bytes, the file has " +
               std::to_string(size));
  const uint8_t* p = data + 28;
  for (const auto& part : parts) {
    part.dst->resize(part.n);
    std::memcpy(part.dst->data(), p, part.n * 4);
    p += part.n * 4;
  }
  for (const auto& part : parts) {
    for (uint64_t i = 0; i < part.n; ++i) {
      if (!std::isfinite((*part.dst)[i]))
        return corrupt(where + ": non-finite weight at float " + std::to_string(i) +
                       " of tensor #" + std::to_string(&part - parts.data()));
    }
  }
  return c;
}

Result<Checkpoint> read_checkpoint(const std::string& path) {
  KVQ_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, read_file(path, uint64_t{1} << 34));
  return parse_checkpoint(bytes.data(), bytes.size(), path);
}

}  // namespace kvq::llama2c
