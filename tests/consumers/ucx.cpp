// A consumer of ferry's UCX backend (ferry::ucx, ferry-ucx): a worker over TCP calls libucp.
#include <ferry/ucx.hpp>

#include <cstdio>

int main() {
  ferry::progress_executor exec;
  ferry::ucx::worker_options options;
  options.transports = "tcp";
  ferry::ucx::worker worker{exec, options};
  std::printf("ucx: a worker\n");
  return 0;
}
