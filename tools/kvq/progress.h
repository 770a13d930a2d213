// A progress bar on stderr for long subcommands, drawn only when stderr is a terminal (so logs
// and pipes stay clean) and at most ~10 times a second.
//
//   Progress p("compress", total_units);
//   ... p.update(done_units); ...
//   p.finish();   // erases the bar (also done by the destructor)
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace kvq::cli {

class Progress {
 public:
  Progress(std::string label, uint64_t total);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void update(uint64_t done);
  void finish();
  bool enabled() const { return enabled_; }

 private:
  void draw(uint64_t done);
  std::string label_;
  uint64_t total_;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace kvq::cli
