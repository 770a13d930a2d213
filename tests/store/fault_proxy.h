// A TCP proxy on 127.0.0.1 in front of a real server, for faults at an exact point of a
// transfer: once a given number of bytes has passed in one direction, it runs an action (kill
// the server, say) and cuts every connection. So "the server died after sending 10 kB of a
// 300 kB reply" happens every time, not when a timer happens to fire then.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "kvq/status.h"

namespace kvq::testing {

class FaultProxy {
 public:
  enum class Direction { kToServer, kToClient };
  static Result<std::unique_ptr<FaultProxy>> start(int server_port);
  ~FaultProxy();

  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  // After `after` more bytes in `dir` (the bytes up to that point are delivered, none after),
  // runs `action` on the proxy's thread, then closes every connection. Connections made after
  // that are forwarded again.
  void arm(Direction dir, uint64_t after, std::function<void()> action);
  bool fired() const { return fired_; }
  uint64_t bytes(Direction dir) const;

 private:
  FaultProxy() = default;
  void run();
  int server_port_ = 0, port_ = 0, listen_fd_ = -1, wake_[2] = {-1, -1};
  std::thread thread_;
  mutable std::mutex mu_;
  bool armed_ = false;
  Direction dir_ = Direction::kToClient;
  uint64_t trigger_at_ = 0;
  uint64_t passed_[2] = {0, 0};
  std::function<void()> action_;
  std::atomic<bool> fired_{false};
};

}  // namespace kvq::testing
