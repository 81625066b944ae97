// Child processes for the multi-process tests: spawning with a stdout pipe, and a real
// redis-server on a free loopback port.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace kvbridge::testing {

struct Child {
  pid_t pid = -1;
  int out = -1;  // read end of the child's stdout, or -1
};

/// Starts argv[0] (a path) with `argv`; its stdout goes to a pipe when `capture`, else to
/// /dev/null. Returns pid -1 when it cannot be started.
inline Child spawn(const std::vector<std::string>& argv, bool capture) {
  Child child;
  int fds[2] = {-1, -1};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (capture) {
    if (::pipe2(fds, O_CLOEXEC) != 0) return child;
    posix_spawn_file_actions_adddup2(&actions, fds[1], 1);
  } else {
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
  }
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (capture) ::close(fds[1]);
  if (rc != 0) {
    if (capture) ::close(fds[0]);
    return child;
  }
  child.pid = pid;
  child.out = capture ? fds[0] : -1;
  return child;
}

/// One line from fd (without the newline); false at end of file.
inline bool read_line(int fd, std::string* line) {
  line->clear();
  char c;
  while (true) {
    const ssize_t r = ::read(fd, &c, 1);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return !line->empty();
    if (c == '\n') return true;
    line->push_back(c);
  }
}

/// Everything the child writes to its stdout, then its exit status (-1 if it did not exit).
inline int wait_exit(Child& child, std::string* output = nullptr) {
  if (child.out >= 0) {
    std::string line;
    while (read_line(child.out, &line))
      if (output) *output += line + "\n";
    ::close(child.out);
    child.out = -1;
  }
  int status = 0;
  if (::waitpid(child.pid, &status, 0) != child.pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

inline std::string find_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = std::string(path ? path : "") + ":/usr/bin:/usr/local/bin:/usr/sbin";
  size_t start = 0;
  while (start <= dirs.size()) {
    const size_t end = dirs.find(':', start);
    const std::string dir = dirs.substr(start, end == std::string::npos ? end : end - start);
    if (!dir.empty() && ::access((dir + "/" + name).c_str(), X_OK) == 0) return dir + "/" + name;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return "";
}

/// A port nobody listens on now (the kernel's pick for an ephemeral bind).
inline int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  int port = -1;
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
      ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len) == 0)
    port = ntohs(a.sin_port);
  ::close(s);
  return port;
}

/// A real redis-server on 127.0.0.1, without persistence, killed on destruction.
class RedisServer {
 public:
  static std::string binary() { return find_program("redis-server"); }

  RedisServer() : port_(free_port()) {}
  ~RedisServer() { stop(); }
  RedisServer(const RedisServer&) = delete;
  RedisServer& operator=(const RedisServer&) = delete;

  /// Starts it (on the same port as before after a stop()); true once it answers PING.
  bool start() {
    child_ = spawn({binary(), "--port", std::to_string(port_), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", "/tmp", "--daemonize", "no",
                    "--protected-mode", "no"},
                   false);
    if (child_.pid < 0) return false;
    for (int i = 0; i < 500; ++i) {  // up to 5 s
      if (ping()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  void stop() {
    if (child_.pid < 0) return;
    ::kill(child_.pid, SIGCONT);
    ::kill(child_.pid, SIGKILL);
    int status;
    ::waitpid(child_.pid, &status, 0);
    child_.pid = -1;
  }
  void pause() { ::kill(child_.pid, SIGSTOP); }
  void resume() { ::kill(child_.pid, SIGCONT); }

  int port() const { return port_; }
  std::string url() const { return "redis://127.0.0.1:" + std::to_string(port_); }

  bool ping() const {
    timeval tv{0, 200000};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    bool ok = false;
    if (c && !c->err) {
      redisSetTimeout(c, tv);
      auto* r = static_cast<redisReply*>(redisCommand(c, "PING"));
      ok = r && r->type == REDIS_REPLY_STATUS;
      if (r) freeReplyObject(r);
    }
    if (c) redisFree(c);
    return ok;
  }

  /// Runs one command on a fresh connection; the reply is freed by the caller.
  redisReply* command(const std::vector<std::string>& args) const {
    timeval tv{2, 0};
    redisContext* c = redisConnectWithTimeout("127.0.0.1", port_, tv);
    if (!c || c->err) {
      if (c) redisFree(c);
      return nullptr;
    }
    std::vector<const char*> argv;
    std::vector<size_t> lens;
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    auto* r = static_cast<redisReply*>(
        redisCommandArgv(c, static_cast<int>(argv.size()), argv.data(), lens.data()));
    redisFree(c);
    return r;
  }

 private:
  int port_;
  Child child_;
};

}  // namespace kvbridge::testing
