// ferry-perf's verbs backend on the fake adapter. The fake fabric lives in one process, so this
// compiles tools/ferry-perf/main.cpp with the fake provider (FERRY_PERF_VERBS_PROVIDER) and runs
// `ferry-perf target` and `ferry-perf initiator` as two threads of this process: everything but the
// adapter is what the installed ferry-perf runs (the command line, the control connection and the
// verbs side channel over real TCP on 127.0.0.1, the queue pairs' handshake, the measuring loops,
// the JSON, SVG and Prometheus output).
//   ferry_perf_fake_verbs OUTDIR
// writes OUTDIR/{stream,latency,kv,check-write,check-read}.* (ferry_perf_fake_verbs.sh checks them)
// and exits 0 when every run did as expected: the good ones succeed, and --check runs against a
// target that corrupts one byte (the test hook FERRY_PERF_TEST_CORRUPT) fail.

#include <ferry/testing/verbs.hpp>

#define FERRY_PERF_NO_MAIN 1
#define FERRY_PERF_VERBS_PROVIDER ferry::verbs::fake::provider
#define FERRY_PERF_VERBS_PROVIDER_NAME "fake (ferry/testing/verbs.hpp, in-process)"
#include "../../tools/ferry-perf/main.cpp"

namespace {

// A free port on 127.0.0.1, found by binding port 0 (the target binds it again at once).
std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    std::perror("ferry_perf_fake_verbs: free port");
    std::exit(1);
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// Whether something listens on 127.0.0.1:port: binding it then fails with EADDRINUSE.
bool listening(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool in_use = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno == EADDRINUSE;
  ::close(fd);
  return in_use;
}

int run_args(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return ferry_perf::run(static_cast<int>(args.size()), argv.data());
}

// Connects to 127.0.0.1:port and hangs up: a --once target still waiting for its initiator (one
// that failed before it connected) takes that for its run, refuses it and ends.
void hang_up_on(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0) (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  if (fd >= 0) ::close(fd);
}

// One initiator run against a target serving one run (--once), each in its own thread.
int one_run(const std::string& name, std::vector<std::string> initiator_args) {
  const std::uint16_t port = free_port();
  const std::string where = "127.0.0.1:" + std::to_string(port);
  int target_rc = -1;
  std::thread target([&] {
    target_rc = run_args({"ferry-perf", "target", "--backend", "verbs", "--listen", where, "--once",
                          "--device", "fake_target"});
  });
  for (int i = 0; i < 500 && !listening(port); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::vector<std::string> args{"ferry-perf", "initiator", "--backend", "verbs", "--connect", where,
                                "--device", "fake_initiator"};
  args.insert(args.end(), initiator_args.begin(), initiator_args.end());
  std::printf("== %s\n", name.c_str());
  std::fflush(stdout);
  const int rc = run_args(args);
  if (rc != 0) hang_up_on(port);  // ended at once if it never saw the initiator
  target.join();
  std::printf("== %s: initiator exit %d, target exit %d\n", name.c_str(), rc, target_rc);
  return rc != 0 ? rc : target_rc;
}

// A checked run against a target that flips byte 100 of thread 0's block 0: the initiator must
// exit 1 (the run failed its check) and the target `target_expected` (1 when it found the mismatch
// itself, 0 when the initiator did). Returns 0 when both did.
int mismatch_run(const std::string& name, const std::string& op, int target_expected) {
  // Set before the target's thread starts and cleared after it ends: nothing reads it meanwhile.
  ::setenv("FERRY_PERF_TEST_CORRUPT", "100", 1);
  const std::uint16_t port = free_port();
  const std::string where = "127.0.0.1:" + std::to_string(port);
  int target_rc = -1;
  std::thread target([&] {
    target_rc = run_args({"ferry-perf", "target", "--backend", "verbs", "--listen", where, "--once", "--device",
                          "fake_target"});
  });
  for (int i = 0; i < 500 && !listening(port); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::printf("== %s\n", name.c_str());
  std::fflush(stdout);
  const int rc = run_args({"ferry-perf", "initiator", "--backend", "verbs", "--connect", where, "--device",
                           "fake_initiator", "--op", op, "--block-size", "4K", "--threads", "2", "--duration", "0.3",
                           "--check"});
  if (rc != 1) hang_up_on(port);
  target.join();
  ::unsetenv("FERRY_PERF_TEST_CORRUPT");
  std::printf("== %s: initiator exit %d, target exit %d (expected 1 and %d)\n", name.c_str(), rc, target_rc,
              target_expected);
  return rc == 1 && target_rc == target_expected ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: ferry_perf_fake_verbs OUTDIR\n");
    return 2;
  }
  const std::string out = argv[1];
  auto& fabric = ferry::verbs::fake::fabric::instance();
  fabric.add_device("fake_target");
  fabric.add_device("fake_initiator");
  int rc = one_run("stream, write", {"--op", "write", "--block-size", "64K", "--batch", "4", "--depth", "2",
                                     "--threads", "2", "--duration", "0.5", "--json", out + "/stream.json",
                                     "--plot", out + "/stream.svg", "--prometheus", out + "/stream.prom"});
  if (rc == 0) {
    rc = one_run("latency, read", {"--op", "read", "--workload", "latency", "--block-size", "4K", "--duration",
                                   "0.5", "--executor", "busy", "--json", out + "/latency.json", "--plot",
                                   out + "/latency.svg"});
  }
  if (rc == 0) {
    rc = one_run("kv, write", {"--op", "write", "--workload", "kv", "--layers", "4", "--requests", "2", "--batch",
                               "2", "--block-size", "16K", "--duration", "0.5", "--executor", "park", "--json",
                               out + "/kv.json", "--plot", out + "/kv.svg"});
  }
  // A kv layer of 8192 blocks, twice the deepest send queue ferry-perf asks for: it goes out in parts.
  if (rc == 0) {
    rc = one_run("kv, layers larger than the send queue",
                 {"--op", "write", "--workload", "kv", "--layers", "1", "--requests", "2", "--batch", "4096",
                  "--block-size", "4K", "--duration", "0.3"});
  }
  // --check: writes compared on the target after the run, reads by the initiator as they complete.
  for (const char* op : {"write", "read"}) {
    if (rc == 0) {
      rc = one_run(std::string("check, ") + op,
                   {"--op", op, "--block-size", "16K", "--batch", "2", "--depth", "2", "--threads", "2",
                    "--duration", "0.3", "--check", "--json", out + "/check-" + op + ".json"});
    }
  }
  if (rc == 0) {
    rc = one_run("check, kv write", {"--op", "write", "--workload", "kv", "--layers", "3", "--requests", "2",
                                     "--block-size", "8K", "--duration", "0.3", "--check"});
  }
  if (rc == 0) rc = mismatch_run("check, write, one byte corrupted on the target", "write", 1);
  if (rc == 0) rc = mismatch_run("check, read, one byte corrupted on the target", "read", 0);
  // A device that does not exist: the target says so, and the initiator exits 1 naming it.
  if (rc == 0) {
    const std::uint16_t port = free_port();
    const std::string where = "127.0.0.1:" + std::to_string(port);
    int target_rc = -1;
    std::thread target([&] {
      target_rc = run_args({"ferry-perf", "target", "--backend", "verbs", "--listen", where, "--once",
                            "--device", "no_such_adapter"});
    });
    for (int i = 0; i < 500 && !listening(port); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::printf("== a target without its device\n");
    std::fflush(stdout);
    const int bad = run_args({"ferry-perf", "initiator", "--backend", "verbs", "--connect", where, "--duration",
                              "0.5", "--device", "fake_initiator"});
    if (bad != 1) hang_up_on(port);
    target.join();
    // A --once target whose one run failed says so in its exit status.
    std::printf("== a target without its device: initiator exit %d, target exit %d (expected 1 and 1)\n", bad,
                target_rc);
    if (bad != 1 || target_rc != 1) rc = 1;
  }
  return rc;
}
