// Real redis-server processes for the store tests: each on 127.0.0.1 at a free port, in its own
// temporary directory, no persistence. The destructor kills the server and removes the
// directory; the kernel kills it too if the test process dies first (PR_SET_PDEATHSIG), so a
// failing or crashing test leaves nothing behind. Every wait is bounded.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "kvq/status.h"

namespace kvq::testing {

// A new directory $TMPDIR/kvq-<what>-<pid>-XXXXXX (/tmp without TMPDIR) for one test. First
// removes the directories of this kind that processes no longer alive left behind (a test killed
// by its time limit has no chance to clean up), so nothing accumulates.
Result<std::string> make_test_dir(const std::string& what);

class RedisServer {
 public:
  // Whether redis-server (and redis-cli) can be run; tests skip with a message without them.
  static bool available();
  // Starts a server; `extra` are more redis-server arguments ("--maxmemory", "1mb", ...).
  // cluster: a cluster-enabled node (needs its port + 10000 free too).
  static Result<std::unique_ptr<RedisServer>> start(std::vector<std::string> extra = {},
                                                    bool cluster = false);
  ~RedisServer();

  int port() const { return port_; }
  pid_t pid() const { return pid_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  std::string url() const { return "redis://" + address(); }
  const std::string& dir() const { return dir_; }

  // SIGKILL, and wait for it: the server is gone, connections to it break.
  void kill();
  // SIGSTOP / SIGCONT: the server stops answering (connections stay open) / resumes.
  void pause();
  void resume();
  // A fresh server on the same port (after kill()): empty, as a restarted cache server is.
  Status restart();

  // One command (binary-safe arguments); the reply as text: a string or status, an integer in
  // decimal, an error as "ERR ...", nil as "(nil)", an array as its elements one per line.
  Result<std::string> command(const std::vector<std::string>& args) const;

 private:
  RedisServer() = default;
  Status spawn();
  std::vector<std::string> args_;
  std::string dir_;
  int port_ = 0;
  pid_t pid_ = -1;
};

// A Redis Cluster of `masters` masters (no replicas) made by redis-cli --cluster create.
class RedisCluster {
 public:
  static Result<std::unique_ptr<RedisCluster>> start(int masters = 3);
  std::string url() const;  // redis-cluster://127.0.0.1:P1,127.0.0.1:P2,...
  std::vector<std::unique_ptr<RedisServer>> nodes;
  // The node serving `slot` and its node id.
  RedisServer* owner(int slot, std::string* node_id = nullptr) const;
  std::string node_id(const RedisServer& n) const;
};

}  // namespace kvq::testing
