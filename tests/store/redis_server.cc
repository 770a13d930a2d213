#include "store/redis_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <thread>

namespace kvq::testing {

namespace {

using Clock = std::chrono::steady_clock;

bool port_free(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// A random port in [20000, 50000) that is free, and whose cluster bus port (+10000) is too.
int free_port(bool cluster) {
  static std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> pick(20000, 49999);
  for (int i = 0; i < 200; ++i) {
    const int p = pick(rng);
    if (port_free(p) && (!cluster || port_free(p + 10000))) return p;
  }
  return 0;
}

bool on_path(const char* name) {
  const std::string cmd = std::string("command -v ") + name + " > /dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

std::string describe(const redisReply* r) {
  switch (r->type) {
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
      return std::string(r->str, r->len);
    case REDIS_REPLY_ERROR:
      return std::string(r->str, r->len);
    case REDIS_REPLY_INTEGER:
      return std::to_string(r->integer);
    case REDIS_REPLY_NIL:
      return "(nil)";
    case REDIS_REPLY_ARRAY: {
      std::string s;
      for (size_t i = 0; i < r->elements; ++i) s += (i ? "\n" : "") + describe(r->element[i]);
      return s;
    }
  }
  return "?";
}

Result<std::string> command_at(int port, const std::vector<std::string>& args, int timeout_ms) {
  redisContext* c =
      redisConnectWithTimeout("127.0.0.1", port, {timeout_ms / 1000, (timeout_ms % 1000) * 1000});
  if (!c || c->err) {
    const std::string why = c ? c->errstr : "out of memory";
    if (c) redisFree(c);
    return io_error("connect to 127.0.0.1:" + std::to_string(port) + ": " + why);
  }
  redisSetTimeout(c, {timeout_ms / 1000, (timeout_ms % 1000) * 1000});
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const auto& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  auto* r = static_cast<redisReply*>(
      redisCommandArgv(c, static_cast<int>(args.size()), argv.data(), lens.data()));
  if (!r) {
    const std::string why = c->errstr;
    redisFree(c);
    return io_error("command on 127.0.0.1:" + std::to_string(port) + ": " + why);
  }
  std::string out = describe(r);
  freeReplyObject(r);
  redisFree(c);
  return out;
}

}  // namespace

Result<std::string> make_test_dir(const std::string& what) {
  const char* t = std::getenv("TMPDIR");
  const std::string root = t && *t ? t : "/tmp";
  const std::string prefix = "kvq-" + what + "-";
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const long pid = std::strtol(name.c_str() + prefix.size(), nullptr, 10);
    if (pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH)
      std::filesystem::remove_all(e.path(), ec);
  }
  std::string tmpl = root + "/" + prefix + std::to_string(::getpid()) + "-XXXXXX";
  if (!::mkdtemp(tmpl.data())) return io_error("cannot create a directory under " + root);
  return tmpl;
}

bool RedisServer::available() { return on_path("redis-server") && on_path("redis-cli"); }

Result<std::unique_ptr<RedisServer>> RedisServer::start(std::vector<std::string> extra,
                                                        bool cluster) {
  std::unique_ptr<RedisServer> s(new RedisServer());
  KVQ_ASSIGN_OR_RETURN(s->dir_, make_test_dir("redis"));
  s->args_ = {"--bind", "127.0.0.1", "--save",      "",   "--appendonly", "no",
              "--dir",  s->dir_,     "--daemonize", "no", "--loglevel",   "warning"};
  if (cluster)
    s->args_.insert(s->args_.end(), {"--cluster-enabled", "yes", "--cluster-config-file",
                                     s->dir_ + "/nodes.conf", "--cluster-node-timeout", "3000"});
  s->args_.insert(s->args_.end(), extra.begin(), extra.end());
  // A port that was free when picked may be taken before the server binds it: try a few.
  Status st = ok_status();
  for (int attempt = 0; attempt < 5; ++attempt) {
    s->port_ = free_port(cluster);
    if (s->port_ == 0) return io_error("no free port on 127.0.0.1");
    st = s->spawn();
    if (st.ok()) return s;
  }
  return st;
}

Status RedisServer::spawn() {
  std::vector<std::string> args = {"redis-server", "--port", std::to_string(port_)};
  args.insert(args.end(), args_.begin(), args_.end());
  const std::string log = dir_ + "/redis.log";
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) return io_error("fork failed");
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the parent died before prctl
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp("redis-server", argv.data());
    ::_exit(127);
  }
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return io_error("redis-server exited at start (see " + log + ")");
    }
    auto r = command_at(port_, {"PING"}, 200);
    if (r.ok() && *r == "PONG") return ok_status();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill();
  return io_error("redis-server on port " + std::to_string(port_) + " did not answer in 10 s");
}

RedisServer::~RedisServer() {
  kill();
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

void RedisServer::kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
}

void RedisServer::pause() {
  if (pid_ > 0) ::kill(pid_, SIGSTOP);
}

void RedisServer::resume() {
  if (pid_ > 0) ::kill(pid_, SIGCONT);
}

Status RedisServer::restart() {
  kill();
  return spawn();
}

Result<std::string> RedisServer::command(const std::vector<std::string>& args) const {
  return command_at(port_, args, 5000);
}

Result<std::unique_ptr<RedisCluster>> RedisCluster::start(int masters) {
  auto c = std::make_unique<RedisCluster>();
  std::string cmd = "timeout 60 redis-cli --cluster create";
  for (int i = 0; i < masters; ++i) {
    KVQ_ASSIGN_OR_RETURN(auto n, RedisServer::start({}, /*cluster=*/true));
    cmd += " " + n->address();
    c->nodes.push_back(std::move(n));
  }
  cmd += " --cluster-replicas 0 --cluster-yes > " + c->nodes[0]->dir() + "/create.log 2>&1";
  if (std::system(cmd.c_str()) != 0)
    return io_error("redis-cli --cluster create failed (see " + c->nodes[0]->dir() +
                    "/create.log)");
  // Every node must see the whole cluster before the tests start.
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  for (const auto& n : c->nodes) {
    while (true) {
      auto info = n->command({"CLUSTER", "INFO"});
      if (info.ok() && info->find("cluster_state:ok") != std::string::npos &&
          info->find("cluster_known_nodes:" + std::to_string(masters)) != std::string::npos)
        break;
      if (Clock::now() > deadline) return io_error("the cluster did not become ready in 30 s");
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return c;
}

std::string RedisCluster::url() const {
  std::string u = "redis-cluster://";
  for (size_t i = 0; i < nodes.size(); ++i) u += (i ? "," : "") + nodes[i]->address();
  return u;
}

std::string RedisCluster::node_id(const RedisServer& n) const {
  auto id = n.command({"CLUSTER", "MYID"});
  return id.ok() ? *id : std::string();
}

RedisServer* RedisCluster::owner(int slot, std::string* id) const {
  for (const auto& n : nodes) {
    auto nodes_text = n->command({"CLUSTER", "NODES"});
    if (!nodes_text.ok()) continue;
    // Lines: <id> <ip:port@bus> <flags> <master> <ping> <pong> <epoch> <state> <slot ranges...>
    std::istringstream in(*nodes_text);
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string nid, addr, flags, master, ping, pong, epoch, state, range;
      f >> nid >> addr >> flags >> master >> ping >> pong >> epoch >> state;
      while (f >> range) {
        if (range[0] == '[') continue;  // a migrating or importing slot
        const size_t dash = range.find('-');
        const int lo = std::stoi(range.substr(0, dash));
        const int hi = dash == std::string::npos ? lo : std::stoi(range.substr(dash + 1));
        if (slot < lo || slot > hi) continue;
        const std::string port =
            addr.substr(addr.find(':') + 1, addr.find('@') - addr.find(':') - 1);
        for (const auto& cand : nodes)
          if (std::to_string(cand->port()) == port) {
            if (id) *id = nid;
            return cand.get();
          }
      }
    }
    return nullptr;
  }
  return nullptr;
}

}  // namespace kvq::testing
