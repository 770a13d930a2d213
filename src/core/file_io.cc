#include "core/file_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kvq {

namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

Result<std::vector<uint8_t>> read_file(const std::string& path, uint64_t max_size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return io_error("cannot open '" + path + "': " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return io_error("cannot stat '" + path + "': " + errno_text());
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    return io_error("'" + path + "' is a directory");
  }
  std::vector<uint8_t> data;
  if (S_ISREG(st.st_mode)) {
    if (static_cast<uint64_t>(st.st_size) > max_size) {
      ::close(fd);
      return limit_exceeded("'" + path + "' is " + std::to_string(st.st_size) +
                            " bytes, more than the limit of " + std::to_string(max_size));
    }
    data.reserve(static_cast<size_t>(st.st_size));
  }
  uint8_t buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return io_error("cannot read '" + path + "': " + errno_text());
    }
    if (n == 0) break;
    if (data.size() + static_cast<size_t>(n) > max_size) {
      ::close(fd);
      return limit_exceeded("'" + path + "' is larger than the limit of " +
                            std::to_string(max_size));
    }
    data.insert(data.end(), buf, buf + n);
  }
  ::close(fd);
  return data;
}

Result<AtomicFileWriter> AtomicFileWriter::open(const std::string& path) {
  std::string tmp = path + ".tmp.XXXXXX";
  std::vector<char> name(tmp.begin(), tmp.end());
  name.push_back('\0');
  const int fd = ::mkstemp(name.data());
  if (fd < 0)
    return io_error("cannot create a temporary file next to '" + path + "': " + errno_text());
  ::fchmod(fd, 0644);
  return AtomicFileWriter(path, std::string(name.data()), fd);
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& o) noexcept
    : path_(std::move(o.path_)), tmp_(std::move(o.tmp_)), fd_(o.fd_), written_(o.written_) {
  o.fd_ = -1;
  o.tmp_.clear();
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

Status AtomicFileWriter::write(const void* data, size_t size) {
  if (fd_ < 0) return io_error("write to a closed file '" + path_ + "'");
  const auto* p = static_cast<const uint8_t*>(data);
  while (size > 0) {
    const ssize_t n = ::write(fd_, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return io_error("cannot write '" + tmp_ + "': " + errno_text());
    }
    p += n;
    size -= static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
  return ok_status();
}

Status AtomicFileWriter::commit() {
  if (fd_ < 0) return io_error("commit of a closed file '" + path_ + "'");
  if (::fsync(fd_) != 0) return io_error("cannot flush '" + tmp_ + "': " + errno_text());
  if (::close(fd_) != 0) {
    fd_ = -1;
    return io_error("cannot close '" + tmp_ + "': " + errno_text());
  }
  fd_ = -1;
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    return io_error("cannot rename '" + tmp_ + "' to '" + path_ + "': " + errno_text());
  tmp_.clear();
  return ok_status();
}

Status write_file_atomic(const std::string& path, const void* data, size_t size) {
  KVQ_ASSIGN_OR_RETURN(AtomicFileWriter w, AtomicFileWriter::open(path));
  KVQ_RETURN_IF_ERROR(w.write(data, size));
  return w.commit();
}

}  // namespace kvq
