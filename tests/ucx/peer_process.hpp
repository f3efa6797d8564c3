#pragma once
// A UCX peer in a process of its own: the test binary runs itself again (posix_spawn of
// /proc/self/exe, safe from a process whose executor threads are running) with FERRY_UCX_PEER_ROLE
// naming what the copy does; a static initializer there runs the role and _exits before Catch's
// main. The two talk over the child's stdin and stdout in length-prefixed messages; a memfd given
// as the child's fd 3 is memory both map, so that the parent can check what landed in the child's
// region even after the child has died.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

extern char** environ;

namespace ferry_test::ucx_peer {

// ---- messages over a pipe, bounded in time
inline bool write_all(int fd, const void* p, std::size_t n) {
  const auto* b = static_cast<const char*>(p);
  while (n != 0) {
    const ssize_t w = ::write(fd, b, n);
    if (w <= 0) return false;
    b += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

inline bool read_all(int fd, void* p, std::size_t n, std::chrono::milliseconds bound) {
  auto* b = static_cast<char*>(p);
  const auto until = std::chrono::steady_clock::now() + bound;
  while (n != 0) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pf{fd, POLLIN, 0};
    if (::poll(&pf, 1, static_cast<int>(left.count())) != 1) return false;
    const ssize_t r = ::read(fd, b, n);
    if (r <= 0) return false;
    b += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

inline bool send(int fd, std::span<const std::byte> m) {
  const auto n = static_cast<std::uint32_t>(m.size());
  return write_all(fd, &n, sizeof n) && write_all(fd, m.data(), m.size());
}
inline bool send(int fd, const std::string& s) {
  return send(fd, std::span(reinterpret_cast<const std::byte*>(s.data()), s.size()));
}

inline std::optional<std::vector<std::byte>> receive(
    int fd, std::chrono::milliseconds bound = std::chrono::seconds(30)) {
  std::uint32_t n = 0;
  if (!read_all(fd, &n, sizeof n, bound) || n > (64u << 20)) return std::nullopt;
  std::vector<std::byte> m(n);
  if (!read_all(fd, m.data(), n, bound)) return std::nullopt;
  return m;
}
inline std::string text(const std::optional<std::vector<std::byte>>& m) {
  return m ? std::string(reinterpret_cast<const char*>(m->data()), m->size()) : std::string();
}

// A role's argument: fields separated by '|' (transports themselves hold commas: "tcp,shm").
inline std::vector<std::string> split_fields(const std::string& s) {
  std::vector<std::string> out;
  std::size_t at = 0;
  for (;;) {
    const std::size_t bar = s.find('|', at);
    out.push_back(s.substr(at, bar - at));
    if (bar == std::string::npos) return out;
    at = bar + 1;
  }
}

// ---- the child's side: roles by name, run before main
using role_fn = int (*)(int in, int out, const std::string& arg);

inline std::map<std::string, role_fn>& roles() {
  static std::map<std::string, role_fn> r;
  return r;
}

// Registers `fn` as role `name`, and runs it now (exiting the process) when this process was
// spawned for it. Returns whether it registered, for a static initializer.
inline bool role(const char* name, role_fn fn) {
  roles()[name] = fn;
  const char* asked = std::getenv("FERRY_UCX_PEER_ROLE");
  if (asked != nullptr && std::string(asked) == name) {
    const char* arg = std::getenv("FERRY_UCX_PEER_ARG");
    int rc = 1;
    try {
      rc = fn(0, 1, arg != nullptr ? arg : "");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ucx peer %s: %s\n", name, e.what());
    }
    ::_exit(rc);
  }
  return true;
}

// ---- the parent's side
class process {
 public:
  // Spawns this binary as role `name` with `arg`; `shared_fd`, when not -1, becomes its fd 3.
  process(const std::string& name, const std::string& arg = {}, int shared_fd = -1) {
    int in[2], out[2];
    REQUIRE(::pipe2(in, O_CLOEXEC) == 0);
    REQUIRE(::pipe2(out, O_CLOEXEC) == 0);
    posix_spawn_file_actions_t fa;
    ::posix_spawn_file_actions_init(&fa);
    ::posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    ::posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    if (shared_fd >= 0) ::posix_spawn_file_actions_adddup2(&fa, shared_fd, 3);
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::strncmp(*e, "FERRY_UCX_PEER_", 15) != 0) env_strings.emplace_back(*e);
    }
    env_strings.push_back("FERRY_UCX_PEER_ROLE=" + name);
    env_strings.push_back("FERRY_UCX_PEER_ARG=" + arg);
    std::vector<char*> env;
    for (auto& s : env_strings) env.push_back(s.data());
    env.push_back(nullptr);
    char self[] = "/proc/self/exe";
    char* argv[] = {self, nullptr};
    const int rc = ::posix_spawn(&pid_, "/proc/self/exe", &fa, nullptr, argv, env.data());
    ::posix_spawn_file_actions_destroy(&fa);
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
    REQUIRE(rc == 0);
  }
  process(const process&) = delete;
  process& operator=(const process&) = delete;
  ~process() {
    kill(SIGKILL);
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
  }

  bool send(std::span<const std::byte> m) { return ucx_peer::send(to_, m); }
  bool send(const std::string& s) { return ucx_peer::send(to_, s); }
  std::optional<std::vector<std::byte>> receive(
      std::chrono::milliseconds bound = std::chrono::seconds(30)) {
    return ucx_peer::receive(from_, bound);
  }

  // Sends `sig`; SIGKILL also reaps it (a zombie still counts as alive to shared memory).
  void kill(int sig) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    if (sig == SIGKILL) reap();
  }
  // Waits for it to exit (bounded); its exit status, or -1.
  int reap(std::chrono::milliseconds bound = std::chrono::seconds(30)) {
    if (pid_ <= 0) return status_;
    const auto until = std::chrono::steady_clock::now() + bound;
    for (;;) {
      int st = 0;
      const pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        return status_;
      }
      if (std::chrono::steady_clock::now() > until) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        pid_ = -1;
        return status_ = -1;
      }
      ::usleep(1000);
    }
  }
  [[nodiscard]] bool running() {
    if (pid_ <= 0) return false;
    int st = 0;
    const pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return false;
    }
    return true;
  }
  [[nodiscard]] pid_t pid() const noexcept { return pid_; }

 private:
  pid_t pid_ = -1;
  int status_ = -1;
  int to_ = -1;
  int from_ = -1;
};

// Memory both processes map: a memfd of `bytes`.
class shared_memory {
 public:
  explicit shared_memory(std::size_t bytes) : bytes_(bytes) {
    fd_ = ::memfd_create("ferry-ucx-test", 0);  // inherited by a spawned child as its fd 3
    REQUIRE(fd_ >= 0);
    REQUIRE(::ftruncate(fd_, static_cast<off_t>(bytes)) == 0);
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    REQUIRE(p != MAP_FAILED);
    base_ = static_cast<std::byte*>(p);
  }
  shared_memory(const shared_memory&) = delete;
  shared_memory& operator=(const shared_memory&) = delete;
  ~shared_memory() {
    ::munmap(base_, bytes_);
    ::close(fd_);
  }
  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {base_, bytes_}; }

  // The child's view: fd 3, mapped.
  static std::span<std::byte> map_inherited(std::size_t bytes) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, 3, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mapping the shared memory (fd 3)");
    return {static_cast<std::byte*>(p), bytes};
  }

 private:
  std::size_t bytes_;
  int fd_ = -1;
  std::byte* base_ = nullptr;
};

}  // namespace ferry_test::ucx_peer
