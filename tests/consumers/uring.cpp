// A consumer of ferry's io_uring backend (ferry::uring, ferry-uring): opening a ring calls liburing,
// so this links only if the package brought liburing along.
#include <ferry/uring.hpp>

#include <cstdio>

int main() {
  ferry::progress_executor exec;
  ferry::uring::ring ring{exec, ferry::uring::ring_options{.entries = 8}};
  std::printf("uring: a ring of 8 entries\n");
  return 0;
}
