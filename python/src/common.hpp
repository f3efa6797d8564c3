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
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

#include "ferry/batch_result.hpp"
#include "ferry/kv/load_tracker.hpp"
#include "ferry/kv/plan.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/task.hpp"
#include "ferry/transfer.hpp"
#include "ferry/uring/frame.hpp"

namespace ferry::python {

namespace py = pybind11;

// --- Arguments ---
//
// Every public function takes its arguments as Python objects and reads them through these helpers,
// so that bad input is a TypeError (wrong type, None where an object is needed) or a ValueError
// (out of range) naming the function (`who`: "ferry.Loopback.copy") and the argument (`what`:
// "nbytes", "blocks[3]"), never a crash or pybind11's "Unable to cast Python instance of type ...".

// The name of h's type, as Python spells it ("NoneType", "str").
[[nodiscard]] std::string type_name(py::handle h);

// "who: what" with the item's index: item_name("blocks", 3) is "blocks[3]".
[[nodiscard]] std::string item_name(std::string_view what, std::size_t index);

// Raises TypeError "who: what must be <expected>, not <h's type>".
[[noreturn]] void throw_type_error(std::string_view who, std::string_view what,
                                   std::string_view expected, py::handle got);

// An integer (an int or anything with __index__, such as a numpy integer; not a bool, a float or
// None) within [lo, hi]: TypeError otherwise, or ValueError naming the bound it is outside of.
[[nodiscard]] std::int64_t signed_arg(py::handle h, std::string_view who, std::string_view what,
                                      std::int64_t lo = INT64_MIN, std::int64_t hi = INT64_MAX);
[[nodiscard]] std::uint64_t unsigned_arg(py::handle h, std::string_view who, std::string_view what,
                                         std::uint64_t lo = 0, std::uint64_t hi = UINT64_MAX);

// The same for any integer type, bounded by the type itself unless told otherwise.
template <class Int>
[[nodiscard]] Int int_arg(py::handle h, std::string_view who, std::string_view what,
                          Int lo = std::numeric_limits<Int>::min(),
                          Int hi = std::numeric_limits<Int>::max()) {
  static_assert(std::is_integral_v<Int> && !std::is_same_v<Int, bool>);
  if constexpr (std::is_signed_v<Int>) {
    return static_cast<Int>(signed_arg(h, who, what, lo, hi));
  } else {
    return static_cast<Int>(unsigned_arg(h, who, what, lo, hi));
  }
}

// A size, count, offset or id: a non-negative integer that fits (at least `lo`).
[[nodiscard]] inline std::size_t size_arg(py::handle h, std::string_view who,
                                          std::string_view what, std::size_t lo = 0) {
  return int_arg<std::size_t>(h, who, what, lo);
}

// True or False (a numpy bool too), nothing else: an int or None is refused, not read as a truth.
[[nodiscard]] bool bool_arg(py::handle h, std::string_view who, std::string_view what);

// A real number (an int, a float or a numpy number; not a bool), not NaN.
[[nodiscard]] double float_arg(py::handle h, std::string_view who, std::string_view what);

// A probability: a number in [0, 1].
[[nodiscard]] double rate_arg(py::handle h, std::string_view who, std::string_view what);

// A str without NUL characters.
[[nodiscard]] std::string str_arg(py::handle h, std::string_view who, std::string_view what);

// Something callable (None too when `none_ok`).
[[nodiscard]] py::object callable_arg(py::handle h, std::string_view who, std::string_view what,
                                      bool none_ok = false);

// An instance of a bound class (`expected` names it: "a ferry.Transfer"), by reference, or by its
// shared holder. None is refused by name (pybind11 would pass an empty holder, and a backend given
// one crashed the interpreter).
template <class T>
[[nodiscard]] T& object_arg(py::handle h, std::string_view who, std::string_view what,
                            std::string_view expected) {
  if (!py::isinstance<T>(h)) throw_type_error(who, what, expected, h);
  return h.cast<T&>();
}
template <class T>
[[nodiscard]] std::shared_ptr<T> shared_arg(py::handle h, std::string_view who,
                                            std::string_view what, std::string_view expected) {
  if (!py::isinstance<T>(h)) throw_type_error(who, what, expected, h);
  auto p = h.cast<std::shared_ptr<T>>();
  if (!p) throw_type_error(who, what, expected, h);
  return p;
}

// The executor argument of a backend's constructor.
[[nodiscard]] std::shared_ptr<progress_executor> executor_arg(py::handle h, std::string_view who);

// An iterator over an iterable argument (a list, a tuple, a generator, ...): TypeError naming it
// for None or anything that cannot be iterated over.
[[nodiscard]] py::iterator iterable_arg(py::handle h, std::string_view who, std::string_view what,
                                        std::string_view expected);

// A pair (a tuple or list of two), the item `what` of a batch: TypeError otherwise.
[[nodiscard]] std::pair<py::object, py::object> pair_arg(py::handle h, std::string_view who,
                                                         std::string_view what,
                                                         std::string_view expected);

// A Python buffer (bytearray, numpy array, memoryview, mmap, ...) held while a transfer may use its
// memory. While a view is held its exporter keeps the memory where it is: a bytearray refuses to
// resize, a numpy array to be resized in place. Released only with the GIL held.
class held_buffer {
 public:
  // `who` and `what` name the function and the argument in errors ("ferry.Loopback.copy",
  // "dst (the destination)"). A destination must be writable.
  held_buffer(py::handle object, bool writable, std::string_view who, std::string_view what);
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

  std::span<std::byte> hold(py::handle object, bool writable, std::string_view who,
                            std::string_view what) {
    buffers.push_back(std::make_unique<held_buffer>(object, writable, who, what));
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

// A ferry.Transfer argument.
[[nodiscard]] inline const py_transfer& transfer_arg(py::handle h, std::string_view who,
                                                     std::string_view what = "transfer") {
  return object_arg<py_transfer>(h, who, what, "a ferry.Transfer");
}

// Releases what orphaned transfers kept alive once they have ended; returns how many are still
// pending. Called with the GIL held (from the module's own calls, or ferry.collect()).
std::size_t sweep_orphans();

// An immutable batch of transfers held in C++ (ferry.Batch): waiting on it copies nothing.
struct batch {
  std::vector<transfer> members;
};

// The members of a wait, from a ferry.Batch (referred to, and held) or any iterable of Transfers
// (copied). Built with the GIL held; usable without it. Anything else is a TypeError naming `who`.
class members_of {
 public:
  members_of(py::handle transfers, std::string_view who, std::string_view what = "transfers");
  [[nodiscard]] std::span<const transfer> view() const noexcept { return view_; }

 private:
  py::object hold_;
  std::vector<transfer> own_;
  std::span<const transfer> view_;
};

// A timeout argument: None or negative waits forever, 0 looks once, positive waits up to that long
// (seconds as a number, or a datetime.timedelta). NaN is refused with ValueError.
[[nodiscard]] std::chrono::duration<double> timeout_arg(py::handle h, std::string_view who,
                                                        std::string_view what = "timeout");

// A non-negative length of time for an option (seconds or timedelta), to the nanosecond. Negative
// is refused with ValueError.
[[nodiscard]] std::chrono::nanoseconds duration_arg(py::handle h, std::string_view who,
                                                    std::string_view what);

// A steady-clock time point given as integer nanoseconds of time.monotonic_ns() (the same clock on
// Linux: CLOCK_MONOTONIC), or now when None.
[[nodiscard]] std::chrono::steady_clock::time_point time_point_arg(py::handle h,
                                                                   std::string_view who,
                                                                   std::string_view what);

// ferry.Error: a std::error_code as Python sees it.
struct py_error {
  std::error_code code;
};

// An error code from Python: a ferry.Error, an errc value of any ferry layer, an int (an errno value,
// system category) or None (empty). Anything else is a TypeError naming `who` and `what`.
[[nodiscard]] std::error_code error_from(py::handle h, std::string_view who,
                                         std::string_view what = "error");

// The Error for `ec`, or None when it is empty.
[[nodiscard]] py::object error_or_none(std::error_code ec);

// Registers an errc enum of some layer (its Python type and how to read its values) so that Error
// compares equal to its values, both ways (Errc.x == error as error == Errc.x, and so `in` a tuple
// or a set), and Completer.fail accepts them. A value never equals another category's error.
using errc_matcher = std::optional<std::error_code> (*)(py::handle);
void register_errc(py::handle enum_type, errc_matcher m);

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

// ferry._Task: a C++ coroutine (a ferry::task: serve_releases, PushReceiver.receive,
// PushedRequest.finish) that Python awaits. Awaiting it starts it on the awaiting event loop's
// thread: aio.cpp spawns it on a scheduler whose queue the loop's notifier runs (with the GIL) when
// its eventfd fires, so every await inside it resumes there, never on the executor's thread. Once
// it ends, `result` (called with the GIL) gives its value, or its exception is raised.
struct py_task {
  std::string who;                      // names it in errors ("ferry.kv.serve_releases")
  std::function<task<void>()> make;     // the task; it stores its own result for `result`
  std::function<py::object()> result;   // its value as Python sees it, once it ended normally
  std::vector<py::object> keep;         // what the task refers to, held until it ends
  bool started = false;
  bool done = false;
  std::exception_ptr error;
};

// Runs `t` and keeps its value in `out`: a ferry::task whose value a py_task hands back.
template <class T>
task<void> store_result(task<T> t, std::shared_ptr<std::optional<T>> out) {
  T value = co_await std::move(t);
  out->emplace(std::move(value));
}

// Block tables from Python (kv.cpp): one (src_ids, dst_ids) pair per group, each an iterable of
// ints or a numpy uint32 array; `pairs` views `src` and `dst`.
struct block_tables {
  std::vector<std::vector<std::uint32_t>> src, dst;
  std::vector<kv::block_pairs> pairs;
};
[[nodiscard]] block_tables tables_arg(py::handle h, std::string_view who, std::string_view what);

// A ferry.kv.LoadTracker argument's tracker (kv.cpp), refused while another thread is inside it.
[[nodiscard]] kv::load_tracker& tracker_arg(py::handle h, std::string_view who,
                                            std::string_view what);

// Parts of the module, each adding its classes and functions.
void add_core(py::module_& m);
void add_asyncio(py::module_& m);
void add_testing(py::module_& m);
void add_kv(py::module_& m);
void add_directory(py::module_& m);
void add_bench(py::module_& m);
#ifdef FERRY_PYTHON_URING
void add_uring(py::module_& m);
#endif
#ifdef FERRY_PYTHON_UCX
void add_ucx(py::module_& m);
#endif

}  // namespace ferry::python
