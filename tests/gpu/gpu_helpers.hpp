#pragma once
// Shared by the GPU copy backend's tests: the backend on the in-process fake runtime, and scoped
// settings of the fake.

#include <chrono>

#include <ferry/ferry.hpp>
#include <ferry/gpu/copy_engine.hpp>
#include <ferry/testing/fake_gpu.hpp>

#include "helpers.hpp"

namespace ferry_test::hip {

namespace fh = ferry::gpu;
using engine = fh::basic_copy_engine<fh::fake::runtime>;
using ferry::transfer;
using ferry::transfer_state;
using ferry_test::hang_bound;

// Sets the fake's copy time for a scope.
struct copy_time {
  explicit copy_time(std::chrono::nanoseconds t) { fh::fake::control::instance().set_copy_time(t); }
  ~copy_time() { fh::fake::control::instance().set_copy_time(std::chrono::microseconds(20)); }
  copy_time(const copy_time&) = delete;
  copy_time& operator=(const copy_time&) = delete;
};

// Sets how many devices the fake has for a scope.
struct device_count {
  explicit device_count(int n) { fh::fake::control::instance().set_devices(n); }
  ~device_count() { fh::fake::control::instance().set_devices(1); }
  device_count(const device_count&) = delete;
  device_count& operator=(const device_count&) = delete;
};

}  // namespace ferry_test::hip
