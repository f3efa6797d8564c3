#pragma once
// What every part of the Python module shares: a transfer as Python sees it (the handle plus what it
// keeps alive), buffers taken through the buffer protocol, timeouts and durations read from Python,
// error codes as Python objects, and the waits that release the GIL.
//
// The one rule behind all of it: nothing that runs on the progress executor's thread (or the timer
// thread, or any thread completing a transfer) touches a Python object. Such threads only complete
// statuses, wake futexes and queue coroutine handles; everything that needs the GIL (releasing a
// buffer, setting a future's result) happens later on a thread that holds it.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "ferry/batch_result.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/frame.hpp"

namespace ferry::python {

namespace py = pybind11;

// A constructor's executor argument. pybind11 passes None as an empty pointer: refuse it by name
// instead of using it (ferry.Loopback(None) crashed the interpreter).
template <class Executor>
Executor& executor_arg(const std::shared_ptr<Executor>& exec, const char* who) {
  if (!exec) throw py::type_error(std::string(who) + ": executor must be a ferry.Executor, not None");
  return *exec;
}

// A Python buffer (bytearray, numpy array, memoryview, mmap, ...) held while a transfer may use its
// memory. While a view is held its exporter keeps the memory where it is: a bytearray refuses to
// resize, a numpy array to be resized in place. Released only with the GIL held.
class held_buffer {
 public:
  // `what` names the argument in errors ("destination", "source"). A destination must be writable.
  held_buffer(py::handle object, bool writable, const char* what);
  held_buffer(const held_buffer&) = delete;
  held_buffer& operator=(const held_buffer&) = delete;
  ~held_buffer() { PyBuffer_Release(&view_); }

  [[nodiscard]] std::span<std::byte> bytes() const noexcept {
    return {static_cast<std::byte*>(view_.buf), static_cast<std::size_t>(view_.len)};
  }

 private:
  Py_buffer view_{};
};

// Everything a transfer needs to outlive it: the buffers it reads or writes, Python objects that own
// backend state (a registered region), and what the backend writes besides the state (bytes moved, a
// received block's id and length, a notification's value). The backend writes those fields from the
// completing thread before the transfer ends; Python reads them only once it has seen it end.
// Destroyed only with the GIL held.
struct keep_alive {
  std::vector<std::unique_ptr<held_buffer>> buffers;
  std::vector<py::object> objects;
  std::size_t transferred = 0;
  bool reports_transferred = false;
  uring::received_block received;
  bool reports_received = false;
  std::uint64_t value = 0;
  bool reports_value = false;
  std::shared_ptr<keep_alive> inner;  // a wrapped transfer's own (the fault injector's inner one)

  std::span<std::byte> hold(py::handle object, bool writable, const char* what) {
    buffers.push_back(std::make_unique<held_buffer>(object, writable, what));
    return buffers.back()->bytes();
  }
};

// ferry.Transfer. A handle dropped by Python while its transfer is still pending hands what it keeps
// alive to the orphan list, swept (with the GIL) as transfers end; a buffer is never released while a
// backend may still write into it.
struct py_transfer {
  transfer t;
  std::shared_ptr<keep_alive> keep;

  py_transfer() = default;
  explicit py_transfer(transfer tr, std::shared_ptr<keep_alive> k = {}) noexcept
      : t(std::move(tr)), keep(std::move(k)) {}
  py_transfer(const py_transfer&) = default;
  py_transfer& operator=(const py_transfer&) = default;
  ~py_transfer();
};

// Releases what orphaned transfers kept alive once they have ended; returns how many are still
// pending. Called with the GIL held (from the module's own calls, or ferry.collect()).
std::size_t sweep_orphans();

// An immutable batch of transfers held in C++ (ferry.Batch): waiting on it copies nothing.
struct batch {
  std::vector<transfer> members;
};

// The members of a wait, from a ferry.Batch (referred to, and held) or any iterable of Transfers
// (copied). Built with the GIL held; usable without it.
class members_of {
 public:
  explicit members_of(py::handle transfers);
  [[nodiscard]] std::span<const transfer> view() const noexcept { return view_; }

 private:
  py::object hold_;
  std::vector<transfer> own_;
  std::span<const transfer> view_;
};

// A timeout argument: None or negative waits forever, 0 looks once, positive waits up to that long
// (seconds as a number, or a datetime.timedelta). NaN is refused with ValueError.
[[nodiscard]] std::chrono::duration<double> timeout_arg(py::handle h, const char* what);

// A non-negative length of time for an option (seconds or timedelta), to the nanosecond.
[[nodiscard]] std::chrono::nanoseconds duration_arg(py::handle h, const char* what);

// A steady-clock time point given as integer nanoseconds of time.monotonic_ns() (the same clock on
// Linux: CLOCK_MONOTONIC), or now when None.
[[nodiscard]] std::chrono::steady_clock::time_point time_point_arg(py::handle h);

// ferry.Error: a std::error_code as Python sees it.
struct py_error {
  std::error_code code;
};

// An error code from Python: a ferry.Error, an errc value of any ferry layer, an int (an errno value,
// system category) or None (empty).
[[nodiscard]] std::error_code error_from(py::handle h);

// The Error for `ec`, or None when it is empty.
[[nodiscard]] py::object error_or_none(std::error_code ec);

// Registers an errc enum of some layer so that Error compares equal to its values and Completer.fail
// accepts them.
using errc_matcher = std::optional<std::error_code> (*)(py::handle);
void register_errc(errc_matcher m);

// The exception types, made by the core part and used by the others.
struct exceptions {
  py::object ferry_error;      // FerryError(RuntimeError): a std::system_error; .error
  py::object transfer_failed;  // TransferFailed(FerryError): check() on a failed transfer or batch
  py::object transfer_error;   // TransferError(FerryError): a hybrid kv request failed or timed out
};
exceptions& exception_types();

// Raises `type` (a FerryError subclass) with `message`, its .error set to `ec`; extra attributes
// from `attrs`. Returns only by throwing py::error_already_set.
[[noreturn]] void raise_with_error(const py::object& type, const std::string& message,
                                   std::error_code ec, const py::dict& attrs = {});

// How often a long wait takes the GIL back for a moment to let signal handlers (KeyboardInterrupt)
// run. The wait itself is one ferry wait per slice: its verdict is what ferry decides, its deadline
// the one the caller gave.
inline constexpr std::chrono::milliseconds signal_check_interval{100};

// Runs `wait(slice)` with the GIL released, slice by slice, until `decided(result)` or the deadline
// of `timeout` (read as ferry reads every timeout). A zero timeout is one look, with the GIL held.
// Between slices it checks for signals; a signal handler's exception propagates.
template <class Wait, class Decided>
auto wait_released(std::chrono::duration<double> timeout, Wait wait, Decided decided) {
  using clock = std::chrono::steady_clock;
  const detail::timeout t = detail::make_timeout(timeout);
  if (t.is_look()) return wait(std::chrono::nanoseconds::zero());
  const bool forever = t.is_forever();
  const clock::time_point deadline = forever ? clock::time_point::max() : t.deadline();
  std::chrono::nanoseconds left = t.length;  // bounded: what is left of the caller's timeout
  for (;;) {
    // The slice that reaches the caller's deadline is the last: its verdict (timed out, if nothing
    // was decided) is the answer.
    const bool last = !forever && left <= signal_check_interval;
    const std::chrono::nanoseconds slice = last ? left : signal_check_interval;
    auto r = [&] {
      py::gil_scoped_release released;
      return wait(slice);
    }();
    if (last || decided(r)) return r;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (!forever) {
      left = std::chrono::ceil<std::chrono::nanoseconds>(deadline - clock::now());
      // The slice ran to its own deadline, and the caller's has passed too: timed out.
      if (left <= std::chrono::nanoseconds::zero()) return r;
    }
  }
}

// Parts of the module, each adding its classes and functions.
void add_core(py::module_& m);
void add_asyncio(py::module_& m);
void add_testing(py::module_& m);
void add_kv(py::module_& m);
void add_bench(py::module_& m);
#ifdef FERRY_PYTHON_URING
void add_uring(py::module_& m);
#endif
#ifdef FERRY_PYTHON_UCX
void add_ucx(py::module_& m);
#endif

}  // namespace ferry::python
