// kvq/tensor.h — non-owning strided views of 4-D tensors.
//
// Keys, values and queries are viewed with the logical shape [B, H, S, D]
// (batch, heads, tokens, head_dim). Strides are in elements and may be anything non-negative,
// so a [B, S, H, D] buffer (the layout most engines produce) is viewed without a copy:
//
//   auto k = kvq::TensorView::bshd(ptr, kvq::DType::kF16, B, S, H, D);  // logical [B, H, S, D]
//
// Views never own memory; the caller keeps the buffer alive while the view is used. A view says
// where its memory is (`device`): the CPU, or a CUDA device for caches that live there. A cache
// refuses views on another device than its own with a clear error (it never dereferences them).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

#include "kvq/dtype.h"
#include "kvq/status.h"

namespace kvq {

enum class DeviceType : uint8_t { kCpu = 0, kCuda = 1 };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // CUDA device ordinal; 0 for the CPU
  static Device cpu() { return {}; }
  static Device cuda(int i = 0) { return {DeviceType::kCuda, i}; }
  bool operator==(const Device&) const = default;
};
// "cpu", "cuda:0"
std::string device_name(const Device& d);

namespace detail {
template <class Ptr>
struct View4 {
  Ptr data = nullptr;
  DType dtype = DType::kF32;
  std::array<int64_t, 4> shape{0, 0, 0, 0};    // [B, H, S, D]
  std::array<int64_t, 4> strides{0, 0, 0, 0};  // elements between neighbours along each axis
  Device device{};

  int64_t batch() const { return shape[0]; }
  int64_t heads() const { return shape[1]; }
  int64_t tokens() const { return shape[2]; }
  int64_t dim() const { return shape[3]; }
  int64_t numel() const { return shape[0] * shape[1] * shape[2] * shape[3]; }

  // Element offset (in elements) of [b, h, s, d].
  int64_t offset(int64_t b, int64_t h, int64_t s, int64_t d) const {
    return b * strides[0] + h * strides[1] + s * strides[2] + d * strides[3];
  }
  float load(int64_t b, int64_t h, int64_t s, int64_t d) const {
    return load_as_f32(data, dtype, offset(b, h, s, d));
  }
  // True when the D axis is contiguous (the fast paths need it).
  bool d_contiguous() const { return strides[3] == 1; }

  // Tokens [s0, s0 + n) of this view (no copy). Requires 0 <= s0, s0 + n <= tokens().
  View4 slice_tokens(int64_t s0, int64_t n) const {
    View4 v = *this;
    v.data = advance(s0 * strides[2]);
    v.shape[2] = n;
    return v;
  }
  // Heads [h0, h0 + n).
  View4 slice_heads(int64_t h0, int64_t n) const {
    View4 v = *this;
    v.data = advance(h0 * strides[1]);
    v.shape[1] = n;
    return v;
  }

  // A contiguous [B, H, S, D] buffer.
  static View4 bhsd(Ptr p, DType t, int64_t b, int64_t h, int64_t s, int64_t d, Device dev = {}) {
    return View4{p, t, {b, h, s, d}, {h * s * d, s * d, d, 1}, dev};
  }
  // A contiguous [B, S, H, D] buffer viewed as logical [B, H, S, D].
  static View4 bshd(Ptr p, DType t, int64_t b, int64_t s, int64_t h, int64_t d, Device dev = {}) {
    return View4{p, t, {b, h, s, d}, {s * h * d, d, h * d, 1}, dev};
  }

 private:
  Ptr advance(int64_t elems) const {
    using Byte = std::conditional_t<std::is_const_v<std::remove_pointer_t<Ptr>>, const char, char>;
    return static_cast<Ptr>(static_cast<Byte*>(data) +
                            elems * static_cast<int64_t>(dtype_size(dtype)));
  }
};
}  // namespace detail

// Read-only view of K, V or Q: logical [B, H, S, D].
using TensorView = detail::View4<const void*>;
// Writable view (outputs): logical [B, H, S, D].
using MutTensorView = detail::View4<void*>;

inline TensorView as_const(const MutTensorView& m) {
  return TensorView{m.data, m.dtype, m.shape, m.strides, m.device};
}

// "[1, 3, 128, 64] f16" (with " on cuda:0" for device views)
std::string describe(const TensorView& v);

// Checks that a view is usable: non-null data when non-empty, positive dims, non-negative
// strides. `what` names the argument in the error message.
Status validate_view(const TensorView& v, const char* what);

// Checks that a view lives on `device` (caches call it before touching any data).
Status require_device(const TensorView& v, const Device& device, const char* what);

// Checks every element is finite; the error names the first bad element's coordinates.
Status check_finite(const TensorView& v, const char* what);

// Copies src into dst (shapes must match; dtype conversion rounds to nearest even).
Status copy_view(const TensorView& src, const MutTensorView& dst);

}  // namespace kvq
