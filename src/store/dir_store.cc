// dir:PATH — the embedded store: no server, one file per key. A put writes a temporary file next
// to its target, flushes it and renames it into place (core/file_io.h), so a reader sees a whole
// old value, a whole new one or none — also across processes — and a crash leaves at most a
// temporary file, which list() skips.
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/file_io.h"
#include "store/backends.h"
#include "store/objects.h"

namespace kvq::store {

bool valid_dir_key(std::string_view key) {
  if (key.empty() || key.size() > 200 || key[0] == '.') return false;
  for (char c : key)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != ':' &&
        c != '-')
      return false;
  // The temporary files of write_file_atomic are named "<key>.tmp.XXXXXX".
  return key.find(".tmp.") == std::string_view::npos;
}

namespace {

class DirStore final : public StoreBackend {
 public:
  explicit DirStore(std::string dir) : dir_(std::move(dir)) {}
  std::string url() const override { return "dir:" + dir_; }

  Result<std::vector<uint8_t>> get(const std::string& key, uint64_t max_bytes) override {
    KVQ_ASSIGN_OR_RETURN(const std::string path, path_of(key));
    auto absent = [&]() -> Result<std::vector<uint8_t>> {
      return not_found("no key '" + key + "' in " + url());
    };
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) return absent();
      return io_error("cannot stat '" + path + "': " + std::strerror(errno));
    }
    if (max_bytes >= static_cast<uint64_t>(st.st_size)) {
      auto r = read_file(path, kMaxObjectBytes);
      if (!r.ok() && ::access(path.c_str(), F_OK) != 0) return absent();  // removed meanwhile
      return r;
    }
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) return errno == ENOENT ? absent() : io_error("cannot open '" + path + "'");
    std::vector<uint8_t> out(static_cast<size_t>(max_bytes));
    out.resize(std::fread(out.data(), 1, out.size(), f));
    const bool failed = std::ferror(f) != 0;
    std::fclose(f);
    if (failed) return io_error("cannot read '" + path + "'");
    return out;
  }

  Status put(const std::string& key, std::span<const uint8_t> value) override {
    KVQ_ASSIGN_OR_RETURN(const std::string path, path_of(key));
    return write_file_atomic(path, value.data(), value.size());
  }

  Result<bool> exists(const std::string& key) override {
    KVQ_ASSIGN_OR_RETURN(const std::string path, path_of(key));
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) return S_ISREG(st.st_mode);
    if (errno == ENOENT) return false;
    return io_error("cannot stat '" + path + "': " + std::strerror(errno));
  }

  Status remove(const std::string& key) override {
    KVQ_ASSIGN_OR_RETURN(const std::string path, path_of(key));
    if (::unlink(path.c_str()) == 0 || errno == ENOENT) return ok_status();
    return io_error("cannot remove '" + path + "': " + std::strerror(errno));
  }

  Result<std::vector<StoreEntry>> list(const std::string& prefix) override {
    DIR* d = ::opendir(dir_.c_str());
    if (!d) return io_error("cannot list '" + dir_ + "': " + std::strerror(errno));
    std::vector<StoreEntry> out;
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (!valid_dir_key(name) || name.compare(0, prefix.size(), prefix) != 0) continue;
      struct stat st {};
      if (::stat((dir_ + "/" + name).c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      out.push_back({name, static_cast<uint64_t>(st.st_size)});
    }
    ::closedir(d);
    sort_listing(out);
    return out;
  }

  Result<StoreStats> stats(const std::string& prefix) override {
    KVQ_ASSIGN_OR_RETURN(auto entries, list(prefix));
    StoreStats s = sort_listing(entries);
    s.details.push_back("directory=" + dir_);
    return s;
  }

 private:
  Result<std::string> path_of(const std::string& key) const {
    if (!valid_dir_key(key))
      return invalid_argument("'" + key +
                              "' is not a key a directory store can hold (1..200 of "
                              "[A-Za-z0-9._:-], not starting with '.')");
    return dir_ + "/" + key;
  }
  std::string dir_;
};

}  // namespace

Result<std::unique_ptr<StoreBackend>> open_dir_store(const std::string& path) {
  if (path.empty()) return invalid_argument("dir: needs a path (dir:PATH)");
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return io_error("cannot create the store directory '" + path + "': " + ec.message());
  const std::filesystem::path abs = std::filesystem::absolute(path, ec).lexically_normal();
  if (ec || !std::filesystem::is_directory(abs, ec))
    return io_error("'" + path + "' is not a directory");
  std::string dir = abs.string();
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return std::unique_ptr<StoreBackend>(new DirStore(dir));
}

}  // namespace kvq::store
