#include "progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace kvq::cli {

Progress::Progress(std::string label, uint64_t total)
    : label_(std::move(label)), total_(total), enabled_(::isatty(STDERR_FILENO) == 1 && total > 0) {
  start_ = last_ = std::chrono::steady_clock::now();
}

Progress::~Progress() { finish(); }

void Progress::update(uint64_t done) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && done < total_ && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  draw(done);
}

void Progress::draw(uint64_t done) {
  constexpr int kWidth = 30;
  done = std::min(done, total_);
  const double frac = static_cast<double>(done) / static_cast<double>(total_);
  const int fill = static_cast<int>(frac * kWidth);
  char bar[kWidth + 1];
  for (int i = 0; i < kWidth; ++i) bar[i] = i < fill ? '#' : '.';
  bar[kWidth] = '\0';
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  std::fprintf(stderr, "\r%s [%s] %3d%%  %.1fs", label_.c_str(), bar, static_cast<int>(frac * 100),
               elapsed);
  if (frac > 0.02 && frac < 1) std::fprintf(stderr, " (~%.0fs left)", elapsed * (1 - frac) / frac);
  std::fprintf(stderr, "\033[K");
  std::fflush(stderr);
  drawn_ = true;
}

void Progress::finish() {
  if (!enabled_ || !drawn_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  drawn_ = false;
}

}  // namespace kvq::cli
