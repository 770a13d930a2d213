#include "model/matmul.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "model/ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KVQ_X86 1
#endif

namespace kvq::model {

PackedMatrix::PackedMatrix(const float* w, int64_t n_out, int64_t n_in)
    : n_out_(n_out), n_in_(n_in), data_(static_cast<size_t>(panels() * n_in * kPanel), 0.0f) {
  for (int64_t n = 0; n < n_out; ++n) {
    float* dst = data_.data() + (n / kPanel) * n_in * kPanel + n % kPanel;
    const float* src = w + n * n_in;
    for (int64_t k = 0; k < n_in; ++k) dst[k * kPanel] = src[k];
  }
}

namespace {

// Rows per micro-tile: 8 rows x 2 panels = 16 accumulators of 16 floats.
constexpr int64_t kRows = 8;

// The definition every path follows: acc = fma(x[k], w[k], acc) for k = 0..K-1, from 0.
void tile_scalar(const float* x, int64_t rows, int64_t K, const float* const* panel,
                 int64_t n_panels, float* y, int64_t ldy, int64_t n_valid, bool accumulate) {
  constexpr int64_t P = PackedMatrix::kPanel;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n_panels; ++j)
      for (int64_t l = 0; l < P; ++l) {
        const int64_t col = j * P + l;
        if (col >= n_valid) continue;
        float acc = 0.0f;
        for (int64_t k = 0; k < K; ++k) acc = std::fma(x[r * K + k], panel[j][k * P + l], acc);
        float* out = y + r * ldy + col;
        *out = accumulate ? *out + acc : acc;
      }
}

#if KVQ_X86
template <int R, int NP>
__attribute__((target("avx512f"))) void tile_avx512(const float* x, int64_t K,
                                                    const float* const* panel, float* y,
                                                    int64_t ldy, int64_t n_valid, bool accumulate) {
  __m512 acc[R][NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NP];
    for (int j = 0; j < NP; ++j) b[j] = _mm512_loadu_ps(panel[j] + k * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      for (int j = 0; j < NP; ++j) acc[r][j] = _mm512_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NP; ++j) {
      const int64_t col = j * 16;
      const int64_t left = std::min<int64_t>(16, n_valid - col);
      if (left <= 0) continue;
      const __mmask16 m = left == 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
      float* out = y + r * ldy + col;
      __m512 v = acc[r][j];
      if (accumulate) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, out), v);
      _mm512_mask_storeu_ps(out, m, v);
    }
}

template <int R, int NP>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t K,
                                                   const float* const* panel, float* y, int64_t ldy,
                                                   int64_t n_valid, bool accumulate) {
  // Each 16-wide panel as two 8-lane halves.
  __m256 acc[R][2 * NP];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * NP; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 b[2 * NP];
    for (int j = 0; j < NP; ++j) {
      b[2 * j] = _mm256_loadu_ps(panel[j] + k * 16);
      b[2 * j + 1] = _mm256_loadu_ps(panel[j] + k * 16 + 8);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_set1_ps(x[r * K + k]);
      for (int j = 0; j < 2 * NP; ++j) acc[r][j] = _mm256_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 2 * NP; ++j) {
      const int64_t col = j * 8;
      float tmp[8];
      _mm256_storeu_ps(tmp, acc[r][j]);
      float* out = y + r * ldy + col;
      for (int64_t l = 0; l < 8 && col + l < n_valid; ++l)
        out[l] = accumulate ? out[l] + tmp[l] : tmp[l];
    }
}

enum class Isa { kScalar, kAvx2, kAvx512 };
Isa isa() {
  static const Isa i = __builtin_cpu_supports("avx512f") ? Isa::kAvx512
                       : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                           ? Isa::kAvx2
                           : Isa::kScalar;
  return i;
}

template <int R>
void tile_rows(Isa i, const float* x, int64_t K, const float* const* panel, int64_t n_panels,
               float* y, int64_t ldy, int64_t n_valid, bool accumulate) {
  if (i == Isa::kAvx512) {
    if (n_panels == 2)
      tile_avx512<R, 2>(x, K, panel, y, ldy, n_valid, accumulate);
    else
      tile_avx512<R, 1>(x, K, panel, y, ldy, n_valid, accumulate);
  } else {
    if (n_panels == 2)
      tile_avx2<R, 2>(x, K, panel, y, ldy, n_valid, accumulate);
    else
      tile_avx2<R, 1>(x, K, panel, y, ldy, n_valid, accumulate);
  }
}
#endif

}  // namespace

void matmul_panels(const float* x, int64_t M, const PackedMatrix& w, float* y, bool accumulate,
                   int64_t p0, int64_t p1) {
  const int64_t K = w.n_in(), N = w.n_out();
  constexpr int64_t P = PackedMatrix::kPanel;
#if KVQ_X86
  const Isa i = isa();
#endif
  // Pairs of panels, each against every tile of rows (the pair stays in cache across tiles).
  for (int64_t p = p0; p < p1; p += 2) {
    const int64_t np = std::min<int64_t>(2, p1 - p);
    const float* panel[2] = {w.panel(p), np > 1 ? w.panel(p + 1) : nullptr};
    const int64_t n_valid = std::min(N - p * P, np * P);
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const int64_t rows = std::min(kRows, M - m0);
      const float* xr = x + m0 * K;
      float* yr = y + m0 * N + p * P;
#if KVQ_X86
      if (i != Isa::kScalar) {
        switch (rows) {
          case 8:
            tile_rows<8>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
          case 7:
            tile_rows<7>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
          case 6:
            tile_rows<6>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
          case 5:
            tile_rows<5>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
          case 4:
            tile_rows<4>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
          case 3:
            tile_rows<3>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
          case 2:
            tile_rows<2>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
          default:
            tile_rows<1>(i, xr, K, panel, np, yr, N, n_valid, accumulate);
            break;
        }
        continue;
      }
#endif
      tile_scalar(xr, rows, K, panel, np, yr, N, n_valid, accumulate);
    }
  }
}

void matmul(const float* x, int64_t M, const PackedMatrix& w, float* y, bool accumulate) {
  // Work items are ranges of panel pairs (output columns), so every weight byte is read by one
  // thread only — what matters when M is small and the product is bound by memory bandwidth —
  // about 4 per thread so a running thread can take over from a descheduled one.
  const int64_t pairs = (w.panels() + 1) / 2;
  const int64_t work = M * w.n_out() * w.n_in();
  const int64_t items =
      work < 4 * kParallelMinWork ? 1 : std::min<int64_t>(pairs, 4 * pool_threads());
  if (items <= 1) {
    matmul_panels(x, M, w, y, accumulate, 0, w.panels());
    return;
  }
  parallel_for(items, [&](int64_t it) {
    const int64_t a = pairs * it / items * 2,
                  b = std::min(w.panels(), pairs * (it + 1) / items * 2);
    if (b > a) matmul_panels(x, M, w, y, accumulate, a, b);
  });
}

}  // namespace kvq::model
