// File helpers with errors as values. Writes are atomic: data goes to a temporary file in the
// same directory, is flushed, then renamed over the target, so a failed or interrupted write
// never replaces a good file with a partial one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/status.h"

namespace kvq {

// Reads a whole file. Files larger than max_size are refused with kLimit.
Result<std::vector<uint8_t>> read_file(const std::string& path,
                                       uint64_t max_size = uint64_t{1} << 36);
Status write_file_atomic(const std::string& path, const void* data, size_t size);

// Writes a file piece by piece, atomically (temp file + rename on commit()). Destroying an
// uncommitted writer removes the temp file.
class AtomicFileWriter {
 public:
  static Result<AtomicFileWriter> open(const std::string& path);
  AtomicFileWriter(AtomicFileWriter&& o) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&&) = delete;
  ~AtomicFileWriter();
  Status write(const void* data, size_t size);
  uint64_t bytes_written() const { return written_; }
  Status commit();

 private:
  AtomicFileWriter(std::string path, std::string tmp, int fd)
      : path_(std::move(path)), tmp_(std::move(tmp)), fd_(fd) {}
  std::string path_, tmp_;
  int fd_ = -1;
  uint64_t written_ = 0;
};

}  // namespace kvq
