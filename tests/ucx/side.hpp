#pragma once
// One side of a UCX test: its own executor and worker, as a process of its own would have, and the
// worker options for a transport list. Shared by the UCX tests.

#include <string>

#include <ferry/ferry.hpp>
#include <ferry/ucx.hpp>

namespace ferry_test::ucx_side {

/// Worker options using only `transports` (UCX_TLS syntax: "tcp", "shm", "tcp,shm").
inline ferry::ucx::worker_options over(const std::string& transports) {
  ferry::ucx::worker_options o;
  o.transports = transports;
  return o;
}

/// An executor and a worker on it.
struct side {
  explicit side(const std::string& transports) : side(over(transports)) {}
  explicit side(const ferry::ucx::worker_options& options) : exec(), worker(exec, options) {}
  ferry::progress_executor exec;
  ferry::ucx::worker worker;
};

}  // namespace ferry_test::ucx_side
