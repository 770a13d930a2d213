// The engine's dense products, batch-invariant by construction.
//
// matmul() computes y[M, N] = x[M, K] W^T (+ y) where every output element is one fused
// multiply-add chain over k = 0, 1, ..., K - 1, in that order, whatever M is, however the work is
// split over threads, and at every SIMD width (AVX-512, AVX2 and the scalar path give the same
// bits). So the activations of a token do not depend on which other tokens share its forward
// pass: a prompt prefilled in chunks of 256 and the same prompt fed token by token put
// bit-identical keys and values into the caches, and a quality figure never depends on how the
// harness chunked its input. (An optimised BLAS picks other kernels and reduction orders for
// other M: its results differ in the last bits between a 1-row and a 256-row product, and a
// 2-bit quantizer turns such bits into different codes.)
//
// W is packed once at load into panels of 16 outputs ([ceil(N/16)][K][16], zero-padded), so the
// kernel streams each panel contiguously while broadcasting x: the layout of a GEMM micro-kernel
// without splitting K.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvq::model {

class PackedMatrix {
 public:
  static constexpr int64_t kPanel = 16;

  PackedMatrix() = default;
  // W row-major [n_out, n_in].
  PackedMatrix(const float* w, int64_t n_out, int64_t n_in);

  int64_t n_out() const { return n_out_; }
  int64_t n_in() const { return n_in_; }
  int64_t panels() const { return (n_out_ + kPanel - 1) / kPanel; }
  const float* panel(int64_t p) const { return data_.data() + p * n_in_ * kPanel; }
  bool empty() const { return data_.empty(); }
  size_t bytes() const { return data_.size() * sizeof(float); }

 private:
  int64_t n_out_ = 0, n_in_ = 0;
  std::vector<float> data_;
};

// y[M, N] = x[M, K] W^T, or y += x W^T when accumulate. x rows are K apart, y rows N apart.
// Split over the engine's threads by panels of W.
void matmul(const float* x, int64_t M, const PackedMatrix& w, float* y, bool accumulate = false);

// The same on the calling thread, for panels [p0, p1) (testing and callers with their own split).
void matmul_panels(const float* x, int64_t M, const PackedMatrix& w, float* y, bool accumulate,
                   int64_t p0, int64_t p1);

}  // namespace kvq::model
