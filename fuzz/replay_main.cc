// Runs fuzz inputs through a target's LLVMFuzzerTestOneInput without libFuzzer: each argument is
// a file or a directory of files (e.g. the seed corpus fuzz/corpus/<target>/, or a crash to
// reproduce). A crash, sanitizer report or failed property check aborts, failing the test; an
// empty corpus directory fails too (a replay that runs nothing proves nothing).
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "core/file_io.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

int run_file(const std::string& path) {
  auto bytes = kvq::read_file(path, uint64_t{1} << 30);
  if (!bytes.ok()) {
    std::fprintf(stderr, "replay: %s\n", bytes.status().to_string().c_str());
    return 1;
  }
  // A copy of exactly the input's size, so that ASan sees reads past its end.
  std::vector<uint8_t> input(bytes->begin(), bytes->end());
  LLVMFuzzerTestOneInput(input.empty() ? nullptr : input.data(), input.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE_OR_DIR...\n", argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (!is_dir(arg)) {
      if (run_file(arg)) return 1;
      std::printf("replayed %s\n", arg.c_str());
      continue;
    }
    std::vector<std::string> files;
    if (DIR* d = ::opendir(arg.c_str())) {
      while (dirent* e = ::readdir(d))
        if (e->d_name[0] != '.') files.push_back(arg + "/" + e->d_name);
      ::closedir(d);
    }
    std::sort(files.begin(), files.end());
    size_t n = 0;
    for (const auto& f : files) {
      if (is_dir(f)) continue;
      if (run_file(f)) return 1;
      ++n;
    }
    if (n == 0) {
      std::fprintf(stderr, "replay: no inputs in %s\n", arg.c_str());
      return 1;
    }
    std::printf("replayed %zu inputs from %s\n", n, arg.c_str());
  }
  return 0;
}
