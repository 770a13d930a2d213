// The CPU attention kernel: one tile of keys and values against a set of query rows, with the
// online-softmax state carried across tiles (flash attention's recurrence).
//
// Defined arithmetic, so that results are bit-identical whatever the number of rows, their
// grouping, and the SIMD width (AVX-512, AVX2 and scalar agree bit for bit):
//   s_j   = q . k_j as one fused multiply-add chain over d = 0..D-1 in order, from 0
//   m'    = max(m, s_0 .. s_{nv-1})                       (exact)
//   c     = exp_f32(m - m'),  p_j = exp_f32(s_j - m')     (numerics/kernels.h's exp_f32)
//   l'    = l * c, then l' += p_j for j = 0..nv-1 in order
//   acc'  = acc * c, then acc'[d] = fma(p_j, v_j[d], acc'[d]) for j = 0..nv-1 in order
// A row's output is acc / l after its last tile. A row depends only on its own query and the
// tiles it sees: a cache whose tiles sit at fixed absolute positions gives the same output for
// a query whether it is attended alone (decode) or among hundreds (a prefill chunk).
#pragma once

#include <cstdint>

#include "kvq/workspace.h"

namespace kvq {

// q [rows, D] (already scaled), k and v [n, D] (row j = key j), visible[r] <= n: how many of the
// tile's keys row r sees (0 = none: the row is left unchanged). m, l [rows] and acc [rows, D]
// are the running state (start: m = -inf, l = 0, acc = 0).
void attend_tile(const float* q, int64_t rows, int64_t D, const float* k, const float* v, int64_t n,
                 const int64_t* visible, float* m, float* l, float* acc, Workspace& ws);

// The scalar definition of the same (tests hold attend_tile to it bit for bit).
void attend_tile_reference(const float* q, int64_t rows, int64_t D, const float* k, const float* v,
                           int64_t n, const int64_t* visible, float* m, float* l, float* acc);

}  // namespace kvq
