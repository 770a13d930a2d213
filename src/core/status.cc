#include "kvq/status.h"

namespace kvq {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kShapeMismatch:
      return "shape_mismatch";
    case ErrorCode::kNonFinite:
      return "non_finite";
    case ErrorCode::kOutOfRange:
      return "out_of_range";
    case ErrorCode::kIo:
      return "io";
    case ErrorCode::kFormat:
      return "format";
    case ErrorCode::kCorrupt:
      return "corrupt";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kNotFound:
      return "not_found";
    case ErrorCode::kLimit:
      return "limit";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (ok()) return "ok";
  return std::string(error_code_name(code_)) + ": " + message_;
}

Status invalid_argument(std::string m) { return Status(ErrorCode::kInvalidArgument, std::move(m)); }
Status shape_mismatch(std::string m) { return Status(ErrorCode::kShapeMismatch, std::move(m)); }
Status non_finite(std::string m) { return Status(ErrorCode::kNonFinite, std::move(m)); }
Status out_of_range(std::string m) { return Status(ErrorCode::kOutOfRange, std::move(m)); }
Status io_error(std::string m) { return Status(ErrorCode::kIo, std::move(m)); }
Status format_error(std::string m) { return Status(ErrorCode::kFormat, std::move(m)); }
Status corrupt(std::string m) { return Status(ErrorCode::kCorrupt, std::move(m)); }
Status unsupported(std::string m) { return Status(ErrorCode::kUnsupported, std::move(m)); }
Status not_found(std::string m) { return Status(ErrorCode::kNotFound, std::move(m)); }
Status limit_exceeded(std::string m) { return Status(ErrorCode::kLimit, std::move(m)); }

}  // namespace kvq
