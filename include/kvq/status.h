// kvq/status.h — errors as values.
//
// Every entry point that touches user input (tensors, spec strings, files, byte streams) returns
// a Status or a Result<T>. A failed call leaves the object it was called on exactly as it was.
// Broken invariants inside kvq (our bugs, not user input) abort through KVQ_CHECK instead.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

namespace kvq {

// Stable error codes: numbers never change meaning once released (the CLI exits with them and
// the container reader reports them).
enum class ErrorCode : int {
  kOk = 0,
  kInvalidArgument = 1,  // a parameter or spec string is wrong
  kShapeMismatch = 2,    // tensors with the wrong or disagreeing shapes
  kNonFinite = 3,        // NaN or Inf in an input tensor
  kOutOfRange = 4,       // a value or index outside what is representable or allowed
  kIo = 5,               // the operating system refused (open, read, write, rename)
  kFormat = 6,           // bytes are not in the expected format (magic, version, layout)
  kCorrupt = 7,          // bytes are in the format but inconsistent (checksum, lengths, symbols)
  kUnsupported = 8,      // a valid request kvq does not implement (dtype, tensor type, version)
  kNotFound = 9,         // a named thing (method, parameter, tensor, file) does not exist
  kLimit = 10,           // a resource limit would be exceeded (size, count, memory)
};

const char* error_code_name(ErrorCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }

  bool ok() const { return code_ == ErrorCode::kOk; }
  ErrorCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "invalid_argument: unknown method 'kiwi' (did you mean 'kivi'?)"
  std::string to_string() const;

  // Prefixes context to the message: "reading foo.kvq: " + message.
  Status with_context(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  ErrorCode code_ = ErrorCode::kOk;
  std::string message_;
};

inline Status ok_status() { return Status(); }
Status invalid_argument(std::string message);
Status shape_mismatch(std::string message);
Status non_finite(std::string message);
Status out_of_range(std::string message);
Status io_error(std::string message);
Status format_error(std::string message);
Status corrupt(std::string message);
Status unsupported(std::string message);
Status not_found(std::string message);
Status limit_exceeded(std::string message);

// A value or an error. Access to value() on an error aborts (a kvq bug, not a user error).
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT: implicit by design
  Result(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) {
      std::fprintf(stderr, "kvq: Result constructed from an ok Status without a value\n");
      std::abort();
    }
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & {
    check();
    return *value_;
  }
  const T& value() const& {
    check();
    return *value_;
  }
  T&& value() && {
    check();
    return std::move(*value_);
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  void check() const {
    if (!status_.ok()) {
      std::fprintf(stderr, "kvq: value() on an error Result: %s\n", status_.to_string().c_str());
      std::abort();
    }
  }
  Status status_;
  std::optional<T> value_;
};

}  // namespace kvq

#define KVQ_CONCAT_INNER(a, b) a##b
#define KVQ_CONCAT(a, b) KVQ_CONCAT_INNER(a, b)

// Returns the Status of `expr` from the enclosing function if it is an error.
#define KVQ_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::kvq::Status kvq_status_ = (expr);        \
    if (!kvq_status_.ok()) return kvq_status_; \
  } while (0)

// `KVQ_ASSIGN_OR_RETURN(auto x, f());` — unwraps a Result or returns its error.
#define KVQ_ASSIGN_OR_RETURN(lhs, expr) \
  KVQ_ASSIGN_OR_RETURN_IMPL(KVQ_CONCAT(kvq_result_, __LINE__), lhs, expr)
#define KVQ_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                              \
  if (!tmp.ok()) return tmp.status();             \
  lhs = std::move(tmp).value()

// Internal invariant: a failure is a bug in kvq, never a user error. Always on.
#define KVQ_CHECK(cond)                                                                  \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      std::fprintf(stderr, "kvq: internal check failed: %s at %s:%d\n", #cond, __FILE__, \
                   __LINE__);                                                            \
      std::abort();                                                                      \
    }                                                                                    \
  } while (0)
