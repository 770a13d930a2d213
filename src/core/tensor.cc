#include "kvq/tensor.h"

#include <cmath>
#include <cstring>

namespace kvq {

std::string device_name(const Device& d) {
  return d.type == DeviceType::kCpu ? "cpu" : "cuda:" + std::to_string(d.index);
}

std::string describe(const TensorView& v) {
  return "[" + std::to_string(v.shape[0]) + ", " + std::to_string(v.shape[1]) + ", " +
         std::to_string(v.shape[2]) + ", " + std::to_string(v.shape[3]) + "] " +
         dtype_name(v.dtype) + (v.device == Device{} ? "" : " on " + device_name(v.device));
}

Status require_device(const TensorView& v, const Device& device, const char* what) {
  if (v.device == device) return ok_status();
  return invalid_argument(std::string(what) + " is on " + device_name(v.device) +
                          " but the cache lives on " + device_name(device));
}

Status validate_view(const TensorView& v, const char* what) {
  for (int i = 0; i < 4; ++i) {
    if (v.shape[i] < 0)
      return shape_mismatch(std::string(what) + ": negative dimension in " + describe(v));
    if (v.strides[i] < 0) return shape_mismatch(std::string(what) + ": negative stride");
  }
  if (v.dtype != DType::kF32 && v.dtype != DType::kF16 && v.dtype != DType::kBF16)
    return unsupported(std::string(what) + ": unknown dtype");
  if (v.numel() > 0 && v.data == nullptr)
    return invalid_argument(std::string(what) + ": null data");
  return ok_status();
}

Status check_finite(const TensorView& v, const char* what) {
  for (int64_t b = 0; b < v.shape[0]; ++b)
    for (int64_t h = 0; h < v.shape[1]; ++h)
      for (int64_t s = 0; s < v.shape[2]; ++s) {
        const int64_t base = v.offset(b, h, s, 0);
        for (int64_t d = 0; d < v.shape[3]; ++d) {
          const float x = load_as_f32(v.data, v.dtype, base + d * v.strides[3]);
          if (!std::isfinite(x)) {
            return non_finite(std::string(what) + " has " + (std::isnan(x) ? "NaN" : "Inf") +
                              " at [" + std::to_string(b) + ", " + std::to_string(h) + ", " +
                              std::to_string(s) + ", " + std::to_string(d) + "]");
          }
        }
      }
  return ok_status();
}

Status copy_view(const TensorView& src, const MutTensorView& dst) {
  if (src.shape != dst.shape)
    return shape_mismatch("copy: source " + describe(src) + " vs destination " +
                          describe(as_const(dst)));
  for (int64_t b = 0; b < src.shape[0]; ++b)
    for (int64_t h = 0; h < src.shape[1]; ++h)
      for (int64_t s = 0; s < src.shape[2]; ++s) {
        const int64_t si = src.offset(b, h, s, 0), di = dst.offset(b, h, s, 0);
        if (src.dtype == dst.dtype && src.d_contiguous() && dst.d_contiguous()) {
          std::memcpy(
              static_cast<char*>(dst.data) + di * static_cast<int64_t>(dtype_size(dst.dtype)),
              static_cast<const char*>(src.data) + si * static_cast<int64_t>(dtype_size(src.dtype)),
              static_cast<size_t>(src.shape[3]) * dtype_size(src.dtype));
          continue;
        }
        for (int64_t d = 0; d < src.shape[3]; ++d)
          store_from_f32(dst.data, dst.dtype, di + d * dst.strides[3],
                         load_as_f32(src.data, src.dtype, si + d * src.strides[3]));
      }
  return ok_status();
}

}  // namespace kvq
