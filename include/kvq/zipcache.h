// kvq/zipcache.h — ZipCache numerics: saliency-adaptive per-token mixed precision.
//
// ZipCache (He et al., NeurIPS 2024, arXiv 2405.14256) keeps every token quantized but gives the
// salient ones more bits. These are the pure functions behind the `zipcache` method (VeloxQuant-MLX's
// API in C++ form); the cache in src/methods/zipcache.cc owns state and calls them.
//
// Stored form of one [S, D] matrix (a ZipState), all packed:
//   mask      S bits, bit t set = token t is salient (hi bits); bitpack.h layout, 1 bit/token
//   hi codes  [n_hi, D] hi_bits each, the salient tokens in position order
//   lo codes  [n_lo, D] lo_bits each, the others in position order
//   params    per channel, fp16 {scale, zero}: D pairs for the hi tokens, D for the lo tokens
//             (each subset is quantized per channel over all its tokens, group = the block)
#pragma once

#include <cstdint>
#include <vector>

#include "kvq/group_quant.h"
#include "kvq/status.h"
#include "kvq/workspace.h"

namespace kvq {

// Checks hi/lo bits in 1..8 with lo <= hi, fraction in [0, 1], group >= 1.
Status validate_zip_params(int hi_bits, int lo_bits, double hi_fraction, int64_t group);

// L2 norm of each token: x [S, D] -> [S].
std::vector<float> token_key_norms(const float* x, int64_t S, int64_t D);
void token_key_norms(const float* x, int64_t S, int64_t D, float* out);

// Number of salient tokens among S for a fraction: round(fraction * S), so 0 -> none, 1 -> all.
int64_t salient_count(int64_t S, double hi_fraction);

// The top salient_count(S, f) tokens by score are marked (1). Ties go to the earlier token, so
// the mask is deterministic. NaN scores rank last.
std::vector<uint8_t> saliency_mask(const std::vector<float>& scores, double hi_fraction);
// The same into mask [S] (one byte per token), with scratch from ws (no heap allocation).
void saliency_mask(const float* scores, int64_t S, double hi_fraction, uint8_t* mask,
                   Workspace& ws);

struct ZipState {
  int hi_bits = 4, lo_bits = 2;
  int64_t seq_len = 0, head_dim = 0, n_hi = 0;
  std::vector<uint8_t> mask;                      // packed, ceil(S / 8) bytes
  std::vector<uint8_t> hi_codes;                  // packed
  std::vector<uint8_t> lo_codes;                  // packed
  std::vector<QuantParams> hi_params, lo_params;  // [D] each (empty when the subset is empty)

  // Honest stored size: packed codes + fp16 params + the bit mask.
  uint64_t bytes() const;
};

// Compresses x [S, D] (row stride ld) with the given mask (one byte per token, 0/1).
ZipState zip_compress(const float* x, int64_t S, int64_t D, int64_t ld,
                      const std::vector<uint8_t>& mask, int hi_bits, int lo_bits);
// Scatters hi and lo tokens back to their positions: out [S, D].
void zip_reconstruct(const ZipState& s, float* out);

// Size of the same matrix at a single bit width with per-channel fp16 params over groups of
// `group` tokens (the uniform baseline).
uint64_t base_only_bytes(int64_t S, int64_t D, int bits, int64_t group);

// Mask by key norm, compress, reconstruct: out [S, D].
void zip_quant_dequant(const float* x, int64_t S, int64_t D, int hi_bits, int lo_bits,
                       double hi_fraction, float* out);

// Channel-separable token-wise quantization of values (ZipCache §4.3): channel i is divided by
// c_i = sqrt(max_t |x_ti|) (stored fp16, rounded up; 1 for an all-zero channel), each token is
// then quantized over runs of `group` channels with its own (scale, zero), and multiplied back.
// `bits_per_token[t]` chooses each token's width. Codes are unpacked [S, D].
void cst_quantize(const float* x, int64_t S, int64_t D, int64_t ld, int64_t group,
                  const uint8_t* bits_per_token, uint16_t* channel_scale, uint8_t* codes,
                  QuantParams* params);
void cst_dequantize(const uint8_t* codes, int64_t S, int64_t D, int64_t group,
                    const uint16_t* channel_scale, const QuantParams* params, float* out);

}  // namespace kvq
