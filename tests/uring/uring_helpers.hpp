#pragma once
// For the io_uring tests: a temporary directory that removes itself, byte patterns, and a check that
// the kernel lets this process use io_uring at all.

#include <cerrno>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

#include <ferry/uring/ring.hpp>

namespace ferry_test {

// Empty when io_uring works here; otherwise why not (the tests then say so and skip).
inline std::string uring_unavailable() {
  io_uring probe{};
  const int r = ::io_uring_queue_init(4, &probe, 0);
  if (r < 0) {
    return "io_uring is not available to this process (" +
           std::error_code(-r, std::system_category()).message() + "); io_uring tests skipped";
  }
  ::io_uring_queue_exit(&probe);
  return {};
}

#define FERRY_REQUIRE_URING()                         \
  do {                                                \
    const std::string why = ferry_test::uring_unavailable(); \
    if (!why.empty()) {                               \
      WARN(why);                                      \
      return;                                         \
    }                                                 \
  } while (false)

class temp_dir {
 public:
  temp_dir() {
    std::string pattern = (std::filesystem::temp_directory_path() / "ferry-test-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw std::system_error(errno, std::system_category(), "mkdtemp");
    }
    path_ = pattern;
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;

  [[nodiscard]] std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// An open descriptor that closes itself.
class fd_guard {
 public:
  explicit fd_guard(int fd = -1) noexcept : fd_(fd) {}
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  ~fd_guard() {
    if (fd_ >= 0) ::close(fd_);
  }
  [[nodiscard]] int get() const noexcept { return fd_; }
  void reset(int fd = -1) noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

// One pipe, both ends closed with the object.
struct one_pipe {
  fd_guard rd;
  fd_guard wr;
  one_pipe() {
    int p[2];
    REQUIRE(::pipe2(p, O_CLOEXEC) == 0);
    rd.reset(p[0]);
    wr.reset(p[1]);
  }
};

// `n` pipes, every end closed with the object (or earlier, by resetting its guard: a reader whose
// writer is closed sees the end of the file).
struct pipe_set {
  std::vector<fd_guard> read_ends;
  std::vector<fd_guard> write_ends;

  explicit pipe_set(std::size_t n) : read_ends(n), write_ends(n) {
    for (std::size_t i = 0; i < n; ++i) {
      int p[2];
      if (::pipe2(p, O_CLOEXEC) != 0) {
        throw std::system_error(errno, std::system_category(), "pipe2");
      }
      read_ends[i].reset(p[0]);
      write_ends[i].reset(p[1]);
    }
  }
};

inline std::vector<std::byte> byte_pattern(std::size_t n, unsigned seed) {
  std::vector<std::byte> v(n);
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v[i] = static_cast<std::byte>(x & 0xff);
  }
  return v;
}

// Opens (by default creates) a file for a test, or throws.
inline int open_file(const std::string& path, int flags = O_RDWR | O_CREAT) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC, 0600);
  if (fd < 0) throw std::system_error(errno, std::system_category(), "open " + path);
  return fd;
}

inline std::span<const std::byte> cview(const std::vector<std::byte>& v) { return v; }

}  // namespace ferry_test
