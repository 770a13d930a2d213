#include "store/fault_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <vector>

namespace kvq::testing {

namespace {

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

int connect_local(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

Result<std::unique_ptr<FaultProxy>> FaultProxy::start(int server_port) {
  std::unique_ptr<FaultProxy> p(new FaultProxy());
  p->server_port_ = server_port;
  p->listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = 0;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (p->listen_fd_ < 0 || ::bind(p->listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::listen(p->listen_fd_, 16) != 0 ||
      ::getsockname(p->listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0 ||
      ::pipe(p->wake_) != 0)
    return io_error("cannot set up the fault proxy");
  p->port_ = ntohs(a.sin_port);
  p->thread_ = std::thread([q = p.get()] { q->run(); });
  return p;
}

FaultProxy::~FaultProxy() {
  if (wake_[1] >= 0 && ::write(wake_[1], "x", 1) < 0) {
  }
  if (thread_.joinable()) thread_.join();
  for (int fd : {listen_fd_, wake_[0], wake_[1]})
    if (fd >= 0) ::close(fd);
}

void FaultProxy::arm(Direction dir, uint64_t after, std::function<void()> action) {
  std::lock_guard<std::mutex> lock(mu_);
  armed_ = true;
  dir_ = dir;
  trigger_at_ = passed_[static_cast<int>(dir)] + after;
  action_ = std::move(action);
}

uint64_t FaultProxy::bytes(Direction dir) const {
  std::lock_guard<std::mutex> lock(mu_);
  return passed_[static_cast<int>(dir)];
}

void FaultProxy::run() {
  struct Pair {
    int client, server;
  };
  std::vector<Pair> pairs;
  std::vector<char> buf(1 << 16);
  auto close_all = [&] {
    for (const Pair& p : pairs) {
      ::close(p.client);
      ::close(p.server);
    }
    pairs.clear();
  };
  while (true) {
    std::vector<pollfd> fds = {{wake_[0], POLLIN, 0}, {listen_fd_, POLLIN, 0}};
    for (const Pair& p : pairs) {
      fds.push_back({p.client, POLLIN, 0});
      fds.push_back({p.server, POLLIN, 0});
    }
    if (::poll(fds.data(), fds.size(), 1000) < 0) continue;
    if (fds[0].revents) break;
    if (fds[1].revents & POLLIN) {
      const int c = ::accept(listen_fd_, nullptr, nullptr);
      const int s = c >= 0 ? connect_local(server_port_) : -1;
      if (s >= 0) {
        pairs.push_back({c, s});
      } else if (c >= 0) {
        ::close(c);  // the server is gone: refuse as it would
      }
      continue;
    }
    bool cut = false;
    for (size_t i = 0; i < pairs.size() && !cut; ++i) {
      for (int side = 0; side < 2 && !cut; ++side) {
        const pollfd& f = fds[2 + 2 * i + static_cast<size_t>(side)];
        if (!(f.revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const Pair& p = pairs[i];
        const int from = side == 0 ? p.client : p.server, to = side == 0 ? p.server : p.client;
        const int dir = side == 0 ? 0 : 1;  // 0: to the server, 1: to the client
        const ssize_t n = ::recv(from, buf.data(), buf.size(), 0);
        if (n <= 0) {  // one side closed: close the pair
          ::close(p.client);
          ::close(p.server);
          pairs.erase(pairs.begin() + static_cast<ptrdiff_t>(i));
          cut = true;  // fds no longer match pairs: poll again
          break;
        }
        size_t pass = static_cast<size_t>(n);
        std::function<void()> action;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (armed_ && static_cast<int>(dir_) == dir && passed_[dir] + pass >= trigger_at_) {
            pass = static_cast<size_t>(trigger_at_ - passed_[dir]);
            action = std::move(action_);
            armed_ = false;
          }
          passed_[dir] += pass;
        }
        write_all(to, buf.data(), pass);
        if (action) {
          action();
          fired_ = true;
          close_all();
          cut = true;
        }
      }
    }
  }
  close_all();
}

}  // namespace kvq::testing
