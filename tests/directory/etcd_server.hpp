#pragma once
// A real etcd for the directory tests: /usr/bin/etcd (Debian etcd-server) started on 127.0.0.1 with
// client and peer ports it picked, a data directory of its own, its output in a log file there.
// stop() ends it (SIGTERM, or SIGKILL), start() brings it back on the same ports and data, so that
// tests see etcd go away and return. Tests skip, saying why, where etcd is not installed.

#include <catch2/catch.hpp>
#include <curl/curl.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ferry/directory/etcd.hpp>

extern char** environ;

namespace ferry_test {

class etcd_server {
 public:
  static constexpr const char* binary = "/usr/bin/etcd";

  // True where etcd is installed; otherwise the reason to skip, in `why`.
  static bool available(std::string& why) {
    if (::access(binary, X_OK) == 0) return true;
    why = std::string(binary) + " not found (Debian: apt-get install etcd-server): etcd tests skipped";
    return false;
  }

  etcd_server() {
    char tmpl[] = "/tmp/ferry-etcd-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp for etcd");
    dir_ = tmpl;
    client_port_ = free_port();
    peer_port_ = free_port();
    start();
  }
  etcd_server(const etcd_server&) = delete;
  etcd_server& operator=(const etcd_server&) = delete;
  ~etcd_server() {
    stop(SIGKILL);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  [[nodiscard]] std::string url() const {
    return "http://127.0.0.1:" + std::to_string(client_port_);
  }

  // Starts etcd and waits (bounded) until it answers.
  void start() {
    if (pid_ > 0) return;
    const std::string client = url();
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
    // setpriv (util-linux) execs etcd with a parent-death signal: a test binary that crashes
    // takes its etcd with it.
    std::vector<std::string> args = {
        "/usr/bin/setpriv", "--pdeathsig", "KILL", binary,
        "--name", "ferry-test",
        "--data-dir", dir_ + "/data",
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", "ferry-test=" + peer,
        "--logger", "zap",
    };
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    ::posix_spawn_file_actions_init(&fa);
    ::posix_spawn_file_actions_addopen(&fa, 1, (dir_ + "/stdout.log").c_str(),
                                       O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::posix_spawn_file_actions_addopen(&fa, 2, (dir_ + "/stderr.log").c_str(),
                                       O_WRONLY | O_CREAT | O_APPEND, 0644);
    const int rc = ::posix_spawn(&pid_, argv[0], &fa, nullptr, argv.data(), environ);
    ::posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) throw std::runtime_error("posix_spawn etcd failed");
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!answers()) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("etcd exited at start; see " + dir_ + "/stderr.log");
      }
      if (std::chrono::steady_clock::now() > until) {
        throw std::runtime_error("etcd did not answer within 30 s; see " + dir_ + "/stderr.log");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }

  // Stops etcd: SIGTERM (it shuts down cleanly) or SIGKILL; waits for it to go (bounded).
  void stop(int sig = SIGTERM) {
    if (pid_ <= 0) return;
    ::kill(pid_, sig);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    int st = 0;
    while (::waitpid(pid_, &st, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > until) {
        ::kill(pid_, SIGKILL);
        ::waitpid(pid_, &st, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pid_ = -1;
  }

  // Deletes its data while it is stopped: it starts again empty (no records, no leases).
  void wipe() {
    if (pid_ > 0) throw std::logic_error("etcd_server::wipe while it runs");
    std::filesystem::remove_all(dir_ + "/data");
  }

  // One request, blocking: POST `body` to `path`; the HTTP status (0: no answer).
  [[nodiscard]] long post(const std::string& path, const std::string& body,
                          std::string* response = nullptr) const {
    CURL* c = ::curl_easy_init();
    if (c == nullptr) return 0;
    const std::string u = url() + path;
    std::string out;
    ::curl_easy_setopt(c, CURLOPT_URL, u.c_str());
    ::curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
    ::curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, 2000L);
    ::curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    ::curl_easy_setopt(c, CURLOPT_WRITEDATA, &out);
    ::curl_easy_setopt(
        c, CURLOPT_WRITEFUNCTION, +[](char* d, size_t s, size_t n, void* o) -> size_t {
          static_cast<std::string*>(o)->append(d, s * n);
          return s * n;
        });
    long status = 0;
    if (::curl_easy_perform(c) == CURLE_OK) ::curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    ::curl_easy_cleanup(c);
    if (response != nullptr) *response = std::move(out);
    return status;
  }

  // Writes `bytes` under `key` as they are (a foreign writer), no lease.
  void put_raw(const std::string& key, const std::vector<std::byte>& bytes) const {
    const std::string value(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    const std::string body = "{\"key\":\"" + ferry::detail::base64_encode(key) + "\",\"value\":\"" +
                             ferry::detail::base64_encode(value) + "\"}";
    if (post("/v3/kv/put", body) != 200) throw std::runtime_error("etcd put_raw failed");
  }

  [[nodiscard]] bool answers() const {
    return post("/v3/kv/range", "{\"key\":\"" + ferry::detail::base64_encode("ferry-probe") + "\"}") ==
           200;
  }

  [[nodiscard]] pid_t pid() const noexcept { return pid_; }

 private:
  static std::uint16_t free_port() {
    const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    if (s < 0 || ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      if (s >= 0) ::close(s);
      throw std::runtime_error("no free port for etcd");
    }
    socklen_t n = sizeof a;
    ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &n);
    ::close(s);
    return ntohs(a.sin_port);
  }

  std::string dir_;
  std::uint16_t client_port_ = 0;
  std::uint16_t peer_port_ = 0;
  pid_t pid_ = -1;
};

// True where etcd is installed; otherwise says why with a warning (the test then passes, skipped).
inline bool etcd_or_skip() {
  std::string why;
  if (etcd_server::available(why)) return true;
  WARN(why);
  return false;
}

// One etcd for a whole test binary run, started at first use (each test under a root of its own).
inline etcd_server& shared_etcd() {
  static etcd_server server;
  return server;
}

// A root prefix no other test uses.
inline std::string fresh_root() {
  static std::atomic<int> n{0};
  return "t" + std::to_string(::getpid()) + "-" + std::to_string(n.fetch_add(1)) + "/";
}

}  // namespace ferry_test
