// The C++ side of python/bench/bench_wait.py: the same batch (n loopback copies of `bytes` each,
// then one wait over them) waited for in C++, so that the Python figures can be read as overhead
// on top of it. The whole run happens with the GIL released.

#include <time.h>

#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.hpp"
#include "ferry/loopback.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/run_loop.hpp"
#include "ferry/wait_all.hpp"
#include "ferry/when_all.hpp"

namespace ferry::python {

namespace {

std::int64_t cpu_ns(clockid_t clock) noexcept {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// A coroutine that awaits one when_all and resumes on a run_loop, as an engine thread's loop would.
struct batch_wait {
  struct promise_type {
    run_loop* loop = nullptr;
    promise_type(run_loop& l, std::span<const transfer>, batch_result*) noexcept : loop(&l) {}
    run_loop& get_scheduler() const noexcept { return *loop; }
    batch_wait get_return_object() noexcept {
      return {std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    std::suspend_never initial_suspend() noexcept { return {}; }
    // Stops the loop from its own thread: the loop runs until the batch is decided.
    auto final_suspend() noexcept {
      struct stop_loop {
        bool await_ready() const noexcept { return false; }
        void await_suspend(std::coroutine_handle<promise_type> h) const noexcept {
          h.promise().loop->stop();
        }
        void await_resume() const noexcept {}
      };
      return stop_loop{};
    }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
  std::coroutine_handle<promise_type> handle;
};

batch_wait await_batch(run_loop&, std::span<const transfer> members, batch_result* out) {
  *out = co_await when_all(members, std::chrono::seconds(10));
}

}  // namespace

void add_bench(py::module_& m) {
  m.def("_bench_cpp",
        [](py::handle executor, py::handle mode_arg, py::handle rounds_arg, py::handle n_arg,
           py::handle bytes_arg) {
          static constexpr const char* who = "ferry._bench_cpp";
          const std::shared_ptr<progress_executor> exec = executor_arg(executor, who);
          const std::string mode = str_arg(mode_arg, who, "mode");
          const int rounds = int_arg<int>(rounds_arg, who, "rounds", 0, 1 << 20);
          const std::size_t n = size_arg(n_arg, who, "n");
          const std::size_t bytes = size_arg(bytes_arg, who, "bytes");
          if (n != 0 && bytes > (std::size_t{1} << 40) / n) {
            throw py::value_error("ferry._bench_cpp: n * bytes must be at most 2^40");
          }
          if (mode != "wait_all" && mode != "when_all") {
            throw py::value_error("ferry._bench_cpp: mode is 'wait_all' or 'when_all'");
          }
          std::vector<std::int64_t> wall(static_cast<std::size_t>(rounds));
          std::vector<std::int64_t> thread_cpu(wall.size());
          std::vector<std::int64_t> process_cpu(wall.size());
          {
            py::gil_scoped_release released;
            loopback_backend backend(*exec);
            std::vector<std::byte> src(n * bytes, std::byte{1});
            std::vector<std::byte> dst(n * bytes);
            std::vector<transfer> batch(n);
            // No idle spin, like asyncio's selector and wait_all's default: both sleep at once.
            run_loop loop(std::chrono::nanoseconds::zero());
            for (std::size_t r = 0; r < wall.size(); ++r) {
              const auto t0 = std::chrono::steady_clock::now();
              const std::int64_t c0 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
              const std::int64_t p0 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID);
              for (std::size_t i = 0; i < n; ++i) {
                batch[i] = backend.copy(std::span(dst).subspan(i * bytes, bytes),
                                        std::span<const std::byte>(src).subspan(i * bytes, bytes));
              }
              bool ok = false;
              if (mode == "wait_all") {
                ok = wait_all(batch, std::chrono::seconds(10)).ok();
              } else {
                batch_result result;
                batch_wait w = await_batch(loop, batch, &result);
                loop.run();  // the coroutine stops it once done, before run() or during it
                w.handle.destroy();
                ok = result.ok();
              }
              const std::int64_t c1 = cpu_ns(CLOCK_THREAD_CPUTIME_ID);
              const std::int64_t p1 = cpu_ns(CLOCK_PROCESS_CPUTIME_ID);
              wall[r] = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
              thread_cpu[r] = c1 - c0;
              process_cpu[r] = p1 - p0;
              if (!ok) throw std::runtime_error("ferry._bench_cpp: a batch did not succeed");
            }
          }
          py::dict d;
          d["wall_ns"] = wall;
          d["thread_cpu_ns"] = thread_cpu;
          d["process_cpu_ns"] = process_cpu;
          return d;
        },
        py::arg("executor"), py::arg("mode"), py::arg("rounds"), py::arg("n"), py::arg("bytes"),
        "Benchmark baseline: rounds of n loopback copies waited for in C++ (wait_all, or a "
        "coroutine awaiting when_all on a run_loop). Per-round wall, thread CPU and process CPU "
        "in nanoseconds.");
}

}  // namespace ferry::python
