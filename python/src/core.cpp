// The core seen from Python: the executor, transfers and completers, batches and their verdicts,
// error codes and exceptions, and the waits (releasing the GIL while they wait).

#include <sched.h>

#include <cmath>
#include <memory>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "common.hpp"
#include "ferry/errors.hpp"
#include "ferry/loopback.hpp"
#include "ferry/poll_all.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/wait_all.hpp"

namespace ferry::python {

// --- Arguments ---

std::string type_name(py::handle h) {
  return std::string(py::str(py::type::handle_of(h).attr("__name__")));
}

std::string item_name(std::string_view what, std::size_t index) {
  return std::string(what) + "[" + std::to_string(index) + "]";
}

void throw_type_error(std::string_view who, std::string_view what, std::string_view expected,
                      py::handle got) {
  throw py::type_error(std::string(who) + ": " + std::string(what) + " must be " +
                       std::string(expected) + ", not " + type_name(got));
}

namespace {

[[noreturn]] void throw_value_error(std::string_view who, std::string_view what,
                                    const std::string& why) {
  throw py::value_error(std::string(who) + ": " + std::string(what) + " " + why);
}

// The int behind an integer argument (operator.index of it).
py::int_ index_of(py::handle h, std::string_view who, std::string_view what) {
  if (h.ptr() == nullptr || h.is_none() || PyBool_Check(h.ptr()) || !PyIndex_Check(h.ptr())) {
    throw_type_error(who, what, "an int", h);
  }
  PyObject* i = PyNumber_Index(h.ptr());
  if (i == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::int_>(i);
}

// How an int out of range is shown: its value, or its size when it is too long to print.
std::string int_text(const py::int_& i) {
  int overflow = 0;
  (void)PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow == 0) return std::string(py::str(py::handle(i)));
  const unsigned long long u = PyLong_AsUnsignedLongLong(i.ptr());
  if (!(u == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return std::to_string(u);
  PyErr_Clear();
  const std::string bits = py::str(i.attr("bit_length")());
  return std::string(overflow < 0 ? "a negative" : "an") + " int of " + bits + " bits";
}

[[noreturn]] void throw_out_of_range(std::string_view who, std::string_view what,
                                     const py::int_& i, bool below, const std::string& bound) {
  if (below && bound == "0") {
    throw_value_error(who, what, "must not be negative (got " + int_text(i) + ")");
  }
  throw_value_error(who, what,
                    std::string(below ? "must be at least " : "must be at most ") + bound +
                        " (got " + int_text(i) + ")");
}

}  // namespace

std::int64_t signed_arg(py::handle h, std::string_view who, std::string_view what,
                        std::int64_t lo, std::int64_t hi) {
  const py::int_ i = index_of(h, who, what);
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow < 0 || (overflow == 0 && v < lo)) {
    throw_out_of_range(who, what, i, true, std::to_string(lo));
  }
  if (overflow > 0 || v > hi) throw_out_of_range(who, what, i, false, std::to_string(hi));
  return v;
}

std::uint64_t unsigned_arg(py::handle h, std::string_view who, std::string_view what,
                           std::uint64_t lo, std::uint64_t hi) {
  const py::int_ i = index_of(h, who, what);
  const int negative = PyObject_RichCompareBool(i.ptr(), py::int_(0).ptr(), Py_LT);
  if (negative < 0) throw py::error_already_set();
  if (negative != 0) throw_out_of_range(who, what, i, true, std::to_string(lo));
  const unsigned long long v = PyLong_AsUnsignedLongLong(i.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();  // OverflowError: above every 64-bit value
    throw_out_of_range(who, what, i, false, std::to_string(hi));
  }
  if (v < lo) throw_out_of_range(who, what, i, true, std::to_string(lo));
  if (v > hi) throw_out_of_range(who, what, i, false, std::to_string(hi));
  return v;
}

bool bool_arg(py::handle h, std::string_view who, std::string_view what) {
  if (PyBool_Check(h.ptr())) return h.ptr() == Py_True;
  const char* const type = Py_TYPE(h.ptr())->tp_name;
  if (std::string_view(type) == "numpy.bool_" || std::string_view(type) == "numpy.bool") {
    const int truth = PyObject_IsTrue(h.ptr());
    if (truth < 0) throw py::error_already_set();
    return truth != 0;
  }
  throw_type_error(who, what, "True or False", h);
}

double float_arg(py::handle h, std::string_view who, std::string_view what) {
  if (PyBool_Check(h.ptr()) ||
      !(PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr()) || PyIndex_Check(h.ptr()))) {
    throw_type_error(who, what, "a number", h);
  }
  const double d = PyFloat_AsDouble(h.ptr());
  if (d == -1.0 && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
    PyErr_Clear();
    throw_value_error(who, what, "is too large");
  }
  if (std::isnan(d)) throw_value_error(who, what, "is NaN");
  return d;
}

double rate_arg(py::handle h, std::string_view who, std::string_view what) {
  const double d = float_arg(h, who, what);
  if (d < 0.0 || d > 1.0) {
    throw_value_error(who, what, "must lie in [0, 1] (got " + std::string(py::repr(h)) + ")");
  }
  return d;
}

std::string str_arg(py::handle h, std::string_view who, std::string_view what) {
  if (!PyUnicode_Check(h.ptr())) throw_type_error(who, what, "a str", h);
  Py_ssize_t n = 0;
  const char* s = PyUnicode_AsUTF8AndSize(h.ptr(), &n);
  if (s == nullptr) throw py::error_already_set();
  std::string out(s, static_cast<std::size_t>(n));
  if (out.find('\0') != std::string::npos) throw_value_error(who, what, "holds a NUL character");
  return out;
}

py::object callable_arg(py::handle h, std::string_view who, std::string_view what, bool none_ok) {
  if (none_ok && h.is_none()) return py::none();
  if (h.is_none() || PyCallable_Check(h.ptr()) == 0) {
    throw_type_error(who, what, none_ok ? "callable or None" : "callable", h);
  }
  return py::reinterpret_borrow<py::object>(h);
}

std::shared_ptr<progress_executor> executor_arg(py::handle h, std::string_view who) {
  return shared_arg<progress_executor>(h, who, "executor", "a ferry.Executor");
}

py::iterator iterable_arg(py::handle h, std::string_view who, std::string_view what,
                          std::string_view expected) {
  if (h.is_none()) throw_type_error(who, what, expected, h);
  PyObject* it = PyObject_GetIter(h.ptr());
  if (it == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
    PyErr_Clear();
    throw_type_error(who, what, expected, h);
  }
  return py::reinterpret_steal<py::iterator>(it);
}

std::pair<py::object, py::object> pair_arg(py::handle h, std::string_view who,
                                           std::string_view what, std::string_view expected) {
  if (!(PyTuple_Check(h.ptr()) || PyList_Check(h.ptr()))) throw_type_error(who, what, expected, h);
  const py::sequence seq = py::reinterpret_borrow<py::sequence>(h);
  if (seq.size() != 2) {
    throw py::type_error(std::string(who) + ": " + std::string(what) + " must be " +
                         std::string(expected) + ", not a " + type_name(h) + " of " +
                         std::to_string(seq.size()));
  }
  return {seq[0], seq[1]};
}

// --- Buffers ---

held_buffer::held_buffer(py::handle object, bool writable, std::string_view who,
                         std::string_view what) {
  const int flags = PyBUF_ANY_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(object.ptr(), &view_, flags) == 0) return;
  PyErr_Clear();
  if (!PyObject_CheckBuffer(object.ptr())) {
    throw_type_error(who, what,
                     "a buffer (anything with the buffer protocol: bytearray, memoryview, numpy "
                     "array, mmap" + std::string(writable ? "" : ", bytes") + ")",
                     object);
  }
  // Which of the two it lacks: a read-only view of contiguous memory, or memory with gaps.
  Py_buffer probe{};
  const bool read_only =
      writable && PyObject_GetBuffer(object.ptr(), &probe, PyBUF_WRITABLE | PyBUF_STRIDES) != 0;
  if (read_only) {
    PyErr_Clear();
    throw py::type_error(std::string(who) + ": " + std::string(what) +
                         " must be a writable buffer, not a read-only " + type_name(object) +
                         " (bytes and read-only views cannot be written into: pass a bytearray, "
                         "a writable memoryview or a numpy array)");
  }
  if (writable) PyBuffer_Release(&probe);
  throw py::type_error(std::string(who) + ": " + std::string(what) +
                       " must be a contiguous buffer, not a strided " + type_name(object) +
                       " (a slice with steps of an array or memoryview: pass a contiguous copy)");
}

// --- Orphans ---

namespace {

struct orphan {
  transfer t;
  std::shared_ptr<keep_alive> keep;
};

// Never destroyed: at interpreter exit, what pending transfers hold stays held (releasing a buffer
// then would need a GIL that is gone, and a backend might still write into it).
std::vector<orphan>& orphans() {
  static auto* list = new std::vector<orphan>;
  return *list;
}
std::size_t sweep_at = 64;

}  // namespace

py_transfer::~py_transfer() {
  if (!keep || t.done()) return;
  try {
    std::vector<orphan>& list = orphans();
    list.push_back({t, std::move(keep)});
    if (list.size() >= sweep_at) {
      const std::size_t left = sweep_orphans();
      sweep_at = std::max<std::size_t>(64, 2 * left);
    }
  } catch (...) {
    // No memory to remember it: keep its buffers for ever rather than free them under live I/O.
    new (std::nothrow) std::shared_ptr<keep_alive>(std::move(keep));
  }
}

std::size_t sweep_orphans() {
  std::vector<orphan>& list = orphans();
  std::erase_if(list, [](const orphan& o) { return o.t.done(); });
  return list.size();
}

// --- Members of a wait ---

members_of::members_of(py::handle transfers, std::string_view who, std::string_view what) {
  if (py::isinstance<batch>(transfers)) {
    hold_ = py::reinterpret_borrow<py::object>(transfers);
    view_ = transfers.cast<const batch&>().members;
    return;
  }
  const py::iterator items =
      iterable_arg(transfers, who, what, "a ferry.Batch or an iterable of ferry.Transfer");
  if (PyList_Check(transfers.ptr()) || PyTuple_Check(transfers.ptr())) {
    const py::sequence seq = py::reinterpret_borrow<py::sequence>(transfers);
    own_.reserve(seq.size());
  }
  for (py::handle item : items) {
    own_.push_back(transfer_arg(item, who, item_name(what, own_.size())).t);
  }
  view_ = own_;
}

// --- Time ---

namespace {

double seconds_of(py::handle h, std::string_view who, std::string_view what) {
  static const py::object timedelta = py::module_::import("datetime").attr("timedelta");
  if (py::isinstance(h, timedelta)) return h.attr("total_seconds")().cast<double>();
  if (PyBool_Check(h.ptr()) || !(PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr()))) {
    throw_type_error(who, what, "a number of seconds or a datetime.timedelta", h);
  }
  const double s = PyFloat_AsDouble(h.ptr());
  if (s == -1.0 && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
    PyErr_Clear();
    throw_value_error(who, what, "is too long");
  }
  if (std::isnan(s)) throw_value_error(who, what, "is NaN");
  return s;
}

}  // namespace

std::chrono::duration<double> timeout_arg(py::handle h, std::string_view who,
                                          std::string_view what) {
  if (h.is_none()) return std::chrono::duration<double>(-1.0);
  return std::chrono::duration<double>(seconds_of(h, who, what));
}

std::chrono::nanoseconds duration_arg(py::handle h, std::string_view who, std::string_view what) {
  const double s = seconds_of(h, who, what);
  if (s < 0.0) {
    throw py::value_error(std::string(who) + ": negative " + std::string(what) + " (" +
                          std::string(py::repr(h)) + "): a length of time is 0 or more");
  }
  if (std::isinf(s) || s > 9.2e9) {
    throw_value_error(who, what, "is too long (" + std::string(py::repr(h)) + ")");
  }
  return std::chrono::round<std::chrono::nanoseconds>(std::chrono::duration<double>(s));
}

std::chrono::steady_clock::time_point time_point_arg(py::handle h, std::string_view who,
                                                     std::string_view what) {
  if (h.is_none()) return std::chrono::steady_clock::now();
  if (!PyLong_Check(h.ptr()) && PyIndex_Check(h.ptr()) == 0) {
    throw_type_error(who, what, "integer nanoseconds of time.monotonic_ns() or None", h);
  }
  return std::chrono::steady_clock::time_point(
      std::chrono::nanoseconds(signed_arg(h, who, what, 0)));
}

// --- Errors ---

namespace {

std::vector<errc_matcher>& matchers() {
  static std::vector<errc_matcher> list;
  return list;
}

std::optional<std::error_code> match_errc(py::handle h) {
  for (errc_matcher m : matchers()) {
    if (std::optional<std::error_code> ec = m(h)) return ec;
  }
  return std::nullopt;
}

std::string error_repr(const std::error_code& ec) {
  if (!ec) return "ferry.Error()";
  return std::string("ferry.Error(") + ec.category().name() + ":" + std::to_string(ec.value()) +
         ", '" + ec.message() + "')";
}

// An errc value compared with `other`: equal to a ferry.Error with exactly its code and to a value
// of its own enum with the same number; never to another category's value. NotImplemented for
// anything else (an int, say: Python then answers unequal, as pybind11's own comparison did).
py::object compare_errc(py::handle self, py::handle other, bool equal) {
  const std::optional<std::error_code> mine = match_errc(self);
  std::optional<std::error_code> theirs;
  if (py::isinstance<py_error>(other)) {
    theirs = other.cast<const py_error&>().code;
  } else {
    theirs = match_errc(other);
  }
  if (!mine || !theirs) return py::reinterpret_borrow<py::object>(Py_NotImplemented);
  return py::bool_((*mine == *theirs) == equal);
}

}  // namespace

void register_errc(py::handle enum_type, errc_matcher m) {
  matchers().push_back(m);
  // pybind11's enum __eq__ answers False for any other type, so Python never asks the Error's
  // own __eq__: Errc.x == error and `error in (Errc.x, ...)` were False. Replaced, with __ne__;
  // the hash stays the value's, as Error's is.
  const py::object type = py::reinterpret_borrow<py::object>(enum_type);
  type.attr("__eq__") = py::cpp_function(
      [](py::handle self, py::handle other) { return compare_errc(self, other, true); },
      py::name("__eq__"), py::is_method(type), py::arg("other"));
  type.attr("__ne__") = py::cpp_function(
      [](py::handle self, py::handle other) { return compare_errc(self, other, false); },
      py::name("__ne__"), py::is_method(type), py::arg("other"));
}

std::error_code error_from(py::handle h, std::string_view who, std::string_view what) {
  if (h.is_none()) return {};
  if (py::isinstance<py_error>(h)) return h.cast<const py_error&>().code;
  if (std::optional<std::error_code> ec = match_errc(h)) return *ec;
  if ((PyLong_Check(h.ptr()) || PyIndex_Check(h.ptr()) != 0) && !PyBool_Check(h.ptr())) {
    return {int_arg<int>(h, who, what, 0), std::system_category()};
  }
  throw_type_error(who, what,
                   "a ferry.Error, an Errc value of a ferry layer, an errno number or None", h);
}

py::object error_or_none(std::error_code ec) {
  if (!ec) return py::none();
  return py::cast(py_error{ec});
}

exceptions& exception_types() {
  static auto* types = new exceptions;
  return *types;
}

void raise_with_error(const py::object& type, const std::string& message, std::error_code ec,
                      const py::dict& attrs) {
  py::object exc = type(message);
  exc.attr("error") = error_or_none(ec);
  for (auto item : attrs) exc.attr(item.first) = item.second;
  PyErr_SetObject(type.ptr(), exc.ptr());
  throw py::error_already_set();
}

// --- Results ---

namespace {

py::object first_failed_of(const batch_result& r) {
  if (!r.first_failed) return py::none();
  return py::int_(*r.first_failed);
}

std::string batch_repr(const batch_result& r) {
  std::ostringstream s;
  s << "ferry.BatchResult(" << to_string(r.verdict);
  if (r.first_failed) s << ", first_failed=" << *r.first_failed << ", error='" << r.error.message() << "'";
  s << ", pending=" << r.pending << ")";
  return s.str();
}

void raise_failed_transfer(const transfer& t) {
  const std::error_code ec = t.error();
  raise_with_error(exception_types().transfer_failed,
                   std::string("ferry: transfer ") + to_string(t.state()) + ": " + ec.message(), ec);
}

executor_options executor_options_from(py::handle mode_arg, py::handle spin_budget,
                                       py::handle in_flight_spin, py::handle poll_budget,
                                       py::handle cpu) {
  static constexpr const char* who = "ferry.Executor";
  const std::string mode = str_arg(mode_arg, who, "mode");
  executor_options o;
  if (mode == "adaptive") {
    o.mode = progress_mode::adaptive;
  } else if (mode == "busy") {
    o.mode = progress_mode::busy;
  } else if (mode == "park") {
    o.mode = progress_mode::park;
  } else {
    throw py::value_error("ferry.Executor: mode must be 'adaptive', 'busy' or 'park', not '" +
                          mode + "'");
  }
  if (!spin_budget.is_none()) o.spin_budget = duration_arg(spin_budget, who, "spin_budget");
  if (!in_flight_spin.is_none()) {
    o.in_flight_spin = duration_arg(in_flight_spin, who, "in_flight_spin");
  }
  o.poll_budget = size_arg(poll_budget, who, "poll_budget", 1);
  o.cpu = int_arg<int>(cpu, who, "cpu", -1, CPU_SETSIZE - 1);  // -1: not pinned
  return o;
}

batch_result wait_batch_released(const members_of& m, py::handle timeout, bool drain_mode,
                                 const char* who) {
  const auto t = timeout_arg(timeout, who);
  return wait_released(
      t,
      [&](std::chrono::nanoseconds slice) {
        return drain_mode ? ferry::drain(m.view(), slice) : ferry::wait_all(m.view(), slice);
      },
      [](const batch_result& r) { return r.verdict != verdict::timed_out; });
}

}  // namespace

// --- The module's core ---

void add_core(py::module_& m) {
  exceptions& ex = exception_types();
  ex.ferry_error = py::reinterpret_steal<py::object>(
      PyErr_NewExceptionWithDoc("ferry.FerryError",
                                "A ferry operation failed; .error is the ferry.Error saying why.",
                                PyExc_RuntimeError, nullptr));
  ex.transfer_failed = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "ferry.TransferFailed", "check() on a transfer or batch that failed; .error says why.",
      ex.ferry_error.ptr(), nullptr));
  ex.transfer_error = py::reinterpret_steal<py::object>(PyErr_NewExceptionWithDoc(
      "ferry.TransferError",
      "A hybrid kv request failed or timed out; raised before the tracker changed anything. "
      ".request, .member, .layer, .error, .timed_out.",
      ex.ferry_error.ptr(), nullptr));
  m.attr("FerryError") = ex.ferry_error;
  m.attr("TransferFailed") = ex.transfer_failed;
  m.attr("TransferError") = ex.transfer_error;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      raise_with_error(exception_types().ferry_error, e.what(), e.code());
    }
  });

  py::enum_<transfer_state>(m, "State", "A transfer's state: pending, then exactly one terminal state.")
      .value("pending", transfer_state::pending)
      .value("success", transfer_state::success)
      .value("failed", transfer_state::failed)
      .value("cancelled", transfer_state::cancelled);

  py::enum_<verdict>(m, "Verdict", "A batch's verdict.")
      .value("success", verdict::success)
      .value("failed", verdict::failed)
      .value("pending", verdict::pending)
      .value("timed_out", verdict::timed_out);

  const auto ferry_errc =
      py::enum_<errc>(m, "Errc", "ferry's own error conditions (category 'ferry').")
      .value("empty_transfer", errc::empty_transfer)
      .value("abandoned", errc::abandoned)
      .value("cancelled", errc::cancelled)
      .value("destination_too_small", errc::destination_too_small)
      .value("source_too_small", errc::source_too_small)
      .value("overlapping_buffers", errc::overlapping_buffers)
      .value("backend_shut_down", errc::backend_shut_down)
      .value("unspecified_failure", errc::unspecified_failure)
      .value("batch_too_large", errc::batch_too_large)
      .value("empty_buffer", errc::empty_buffer)
      .value("submission_queue_full", errc::submission_queue_full);
  register_errc(ferry_errc, [](py::handle h) -> std::optional<std::error_code> {
    if (!py::isinstance<errc>(h)) return std::nullopt;
    return make_error_code(h.cast<errc>());
  });

  py::class_<py_error>(m, "Error",
                       "Why a transfer failed: a std::error_code (category, value, message). "
                       "Compares equal, both ways and with the same hash, to the Errc value of "
                       "its own layer (ferry.Errc, ferry.uring.Errc, ...), never to another "
                       "layer's value with the same number.")
      .def(py::init([](py::handle h) { return py_error{error_from(h, "ferry.Error", "code")}; }),
           py::arg("code"))
      .def_property_readonly("category",
                             [](const py_error& e) { return std::string(e.code.category().name()); })
      .def_property_readonly("value", [](const py_error& e) { return e.code.value(); })
      .def_property_readonly("message", [](const py_error& e) { return e.code.message(); })
      .def_property_readonly("errno",
                             [](const py_error& e) -> py::object {
                               if (e.code.category() == std::system_category() ||
                                   e.code.category() == std::generic_category()) {
                                 return py::int_(e.code.value());
                               }
                               return py::none();
                             })
      .def("__bool__", [](const py_error& e) { return static_cast<bool>(e.code); })
      .def("__str__", [](const py_error& e) { return e.code.message(); })
      .def("__repr__", [](const py_error& e) { return error_repr(e.code); })
      // The value's hash, as an Errc value's is (pybind11 hashes an enum value as its int): an
      // Error and the Errc value it equals land in the same set slot and dict entry.
      .def("__hash__", [](const py_error& e) { return py::hash(py::int_(e.code.value())); })
      .def("__eq__",
           [](const py_error& e, py::handle other) -> py::object {
             if (py::isinstance<py_error>(other)) {
               return py::bool_(e.code == other.cast<const py_error&>().code);
             }
             if (std::optional<std::error_code> ec = match_errc(other)) {
               return py::bool_(e.code == *ec);
             }
             return py::reinterpret_borrow<py::object>(Py_NotImplemented);
           },
           py::arg("other"))
      .def("__ne__",
           [](const py_error& e, py::handle other) -> py::object {
             if (py::isinstance<py_error>(other)) {
               return py::bool_(e.code != other.cast<const py_error&>().code);
             }
             if (std::optional<std::error_code> ec = match_errc(other)) {
               return py::bool_(e.code != *ec);
             }
             return py::reinterpret_borrow<py::object>(Py_NotImplemented);
           },
           py::arg("other"));

  py::class_<batch_result>(m, "BatchResult",
                           "A batch's verdict: success iff every member succeeded; failed if any "
                           "failed (first_failed: the failure first in time); pending or timed_out "
                           "otherwise.")
      .def_property_readonly("verdict", [](const batch_result& r) { return r.verdict; })
      .def_property_readonly("first_failed", &first_failed_of)
      .def_property_readonly("error", [](const batch_result& r) { return error_or_none(r.error); })
      .def_property_readonly("pending", [](const batch_result& r) { return r.pending; })
      .def_property_readonly("ok", &batch_result::ok)
      .def("__bool__", &batch_result::ok)
      .def("__repr__", &batch_repr)
      .def("check",
           [](const batch_result& r) -> const batch_result& {
             if (r.verdict == verdict::failed) {
               py::dict attrs;
               attrs["first_failed"] = first_failed_of(r);
               raise_with_error(exception_types().transfer_failed,
                                "ferry: batch failed at member " +
                                    (r.first_failed ? std::to_string(*r.first_failed) : "?") +
                                    ": " + r.error.message(),
                                r.error, attrs);
             }
             if (r.verdict == verdict::timed_out) {
               PyErr_SetString(PyExc_TimeoutError,
                               ("ferry: batch timed out with " + std::to_string(r.pending) +
                                " member(s) pending")
                                   .c_str());
               throw py::error_already_set();
             }
             return r;
           },
           py::return_value_policy::copy,
           "Returns the result if it did not fail or time out; raises TransferFailed (with .error "
           "and .first_failed) or TimeoutError.");

  py::class_<py_transfer>(m, "Transfer",
                          "One data movement. state is one atomic load; never blocks, never drives "
                          "progress. Awaitable: `await t` gives its terminal State on the awaiting "
                          "event loop's thread.")
      .def(py::init<>(), "An empty handle: failed, with Errc.empty_transfer.")
      .def_property_readonly("state", [](const py_transfer& t) { return t.t.state(); })
      .def_property_readonly("done", [](const py_transfer& t) { return t.t.done(); })
      .def_property_readonly("valid", [](const py_transfer& t) { return t.t.valid(); })
      .def_property_readonly("error", [](const py_transfer& t) { return error_or_none(t.t.error()); })
      .def_property_readonly(
          "transferred",
          [](const py_transfer& t) -> py::object {
            if (!t.keep || !t.keep->reports_transferred || !t.t.done()) return py::none();
            return py::int_(t.keep->transferred);
          },
          "Bytes that moved (io_uring reads and writes), once the transfer has ended; else None.")
      .def_property_readonly(
          "received",
          [](const py_transfer& t) -> py::object {
            if (!t.keep || !t.keep->reports_received || t.t.state() != transfer_state::success) {
              return py::none();
            }
            return py::make_tuple(t.keep->received.id, t.keep->received.length);
          },
          "(block id, length) of a received TCP block, once it succeeded; else None.")
      .def_property_readonly(
          "value",
          [](const py_transfer& t) -> py::object {
            if (!t.keep || !t.keep->reports_value || t.t.state() != transfer_state::success) {
              return py::none();
            }
            return py::int_(t.keep->value);
          },
          "A received UCX notification's value, once it succeeded; else None.")
      .def("wait",
           [](const py_transfer& self, py::handle timeout) {
             const transfer t = self.t;
             return wait_released(
                 timeout_arg(timeout, "ferry.Transfer.wait"),
                 [&](std::chrono::nanoseconds slice) { return t.wait_for(slice); },
                 [](transfer_state s) { return s != transfer_state::pending; });
           },
           py::arg("timeout") = py::none(),
           "Blocks, with the GIL released, until terminal or the timeout (None or negative: no "
           "deadline; 0: look once; positive: up to that many seconds). Returns the State.")
      .def("check",
           [](const py_transfer& t) {
             const transfer_state s = t.t.state();
             if (s == transfer_state::failed || s == transfer_state::cancelled) raise_failed_transfer(t.t);
             return s;
           },
           "Returns the state, or raises TransferFailed if it failed or was cancelled.")
      // Anything but a Transfer is unequal (t == None was a TypeError).
      .def("__eq__",
           [](const py_transfer& a, py::handle b) -> py::object {
             if (!py::isinstance<py_transfer>(b)) {
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             }
             return py::bool_(a.t == b.cast<const py_transfer&>().t);
           },
           py::arg("other"))
      .def("__ne__",
           [](const py_transfer& a, py::handle b) -> py::object {
             if (!py::isinstance<py_transfer>(b)) {
               return py::reinterpret_borrow<py::object>(Py_NotImplemented);
             }
             return py::bool_(!(a.t == b.cast<const py_transfer&>().t));
           },
           py::arg("other"))
      .def("__hash__", [](const py_transfer& t) { return std::hash<const void*>{}(t.t.status()); })
      .def("__repr__", [](const py_transfer& t) {
        std::string s = std::string("ferry.Transfer(") + to_string(t.t.state());
        if (t.t.done() && t.t.state() != transfer_state::success) s += ", '" + t.t.error().message() + "'";
        return s + ")";
      });

  py::class_<completer>(m, "Completer",
                        "The completing side of a manual transfer. The first terminal call wins; "
                        "later calls return False. The last completer dropped before completing "
                        "fails the transfer with Errc.abandoned.")
      .def("succeed", &completer::succeed)
      .def("fail",
           [](completer& c, py::handle error) {
             return c.fail(error_from(error, "ferry.Completer.fail"));
           },
           py::arg("error") = py::none(),
           "Fails with `error` (an Errc value, a ferry.Error or an errno); None gives "
           "Errc.unspecified_failure.")
      .def("cancel", &completer::cancel)
      .def("transfer", [](const completer& c) { return py_transfer(c.get_transfer()); })
      .def_property_readonly("valid", &completer::valid);

  m.def("make_manual_transfer",
        [] {
          auto [t, c] = make_manual_transfer();
          return py::make_tuple(py_transfer(std::move(t)), std::move(c));
        },
        "A pending transfer and the Completer that ends it.");
  m.def("make_completed_transfer",
        [](py::handle state, py::handle error) {
          static constexpr const char* who = "ferry.make_completed_transfer";
          const transfer_state s = object_arg<transfer_state>(state, who, "state", "a ferry.State");
          if (s == transfer_state::pending) {
            throw py::value_error("ferry.make_completed_transfer: the state must be terminal");
          }
          return py_transfer(make_completed_transfer(s, error_from(error, who)));
        },
        py::arg("state"), py::arg("error") = py::none());

  py::class_<batch>(m, "Batch",
                    "An immutable batch of transfers held in C++: poll_all, wait_all, drain and "
                    "when_all take it without copying (they also take any iterable of Transfers).")
      .def(py::init([](py::handle transfers) {
             members_of mem(transfers, "ferry.Batch");
             return batch{std::vector<transfer>(mem.view().begin(), mem.view().end())};
           }),
           py::arg("transfers"))
      .def("__len__", [](const batch& b) { return b.members.size(); })
      .def("__getitem__",
           [](const batch& b, py::handle index) {
             std::int64_t i = signed_arg(index, "ferry.Batch.__getitem__", "index");
             const auto n = static_cast<std::int64_t>(b.members.size());
             if (i < 0) i += n;
             if (i < 0 || i >= n) throw py::index_error("ferry.Batch index out of range");
             return py_transfer(b.members[static_cast<std::size_t>(i)]);
           });

  m.def("poll_all",
        [](py::handle transfers) {
          return poll_all(members_of(transfers, "ferry.poll_all").view());
        },
        py::arg("transfers"),
        "The verdict now: success iff every member succeeded; failed if any failed or was "
        "cancelled, even with others pending; else pending. Empty: success. Never blocks.");
  m.def("wait_all",
        [](py::handle transfers, py::handle timeout) {
          const members_of mem(transfers, "ferry.wait_all");
          return wait_batch_released(mem, timeout, false, "ferry.wait_all");
        },
        py::arg("transfers"), py::arg("timeout") = py::none(),
        "Blocks with the GIL released: failed the moment any member fails, success when the last "
        "succeeds, timed_out at the one shared deadline. None or negative: no deadline; 0: exactly "
        "poll_all; positive: up to that many seconds.");
  m.def("drain",
        [](py::handle transfers, py::handle timeout) {
          const members_of mem(transfers, "ferry.drain");
          return wait_batch_released(mem, timeout, true, "ferry.drain");
        },
        py::arg("transfers"), py::arg("timeout") = py::none(),
        "Blocks with the GIL released until every member is terminal (failures included), so "
        "every buffer is quiescent; timed_out if the deadline passes first.");
  m.def("collect", &sweep_orphans,
        "Releases the buffers of dropped transfers that have ended since; returns how many "
        "dropped transfers are still pending (their buffers stay held).");

  py::class_<progress_executor, std::shared_ptr<progress_executor>>(
      m, "Executor",
      "The progress executor: one thread that polls every backend registered with it. Backends "
      "keep their executor alive; it stops once the last of them is gone.")
      .def(py::init([](py::handle mode, py::handle spin_budget, py::handle in_flight_spin,
                       py::handle poll_budget, py::handle cpu) {
             return std::make_shared<progress_executor>(
                 executor_options_from(mode, spin_budget, in_flight_spin, poll_budget, cpu));
           }),
           py::arg("mode") = "adaptive", py::arg("spin_budget") = py::none(),
           py::arg("in_flight_spin") = py::none(), py::arg("poll_budget") = 256,
           py::arg("cpu") = -1)
      .def_property_readonly("counters", [](const progress_executor& e) {
        const executor_counters c = e.counters();
        py::dict d;
        d["completions"] = c.completions;
        d["rounds"] = c.rounds;
        d["parks"] = c.parks;
        d["wakeups"] = c.wakeups;
        d["timers_fired"] = c.timers_fired;
        return d;
      });

  // The in-memory backend: copies performed and completed on the executor's thread.
  struct py_loopback {
    std::shared_ptr<progress_executor> exec;
    std::unique_ptr<loopback_backend> backend;
  };
  py::class_<py_loopback, std::shared_ptr<py_loopback>>(
      m, "Loopback", "Copies between buffers of this process, completed by the executor.")
      .def(py::init([](py::handle executor, py::handle queue_depth) {
             static constexpr const char* who = "ferry.Loopback";
             std::shared_ptr<progress_executor> exec = executor_arg(executor, who);
             const loopback_options o{size_arg(queue_depth, who, "queue_depth", 1)};
             auto l = std::make_shared<py_loopback>();
             l->backend = std::make_unique<loopback_backend>(*exec, o);
             l->exec = std::move(exec);
             return l;
           }),
           py::arg("executor"), py::arg("queue_depth") = 16384)
      .def("copy",
           [](py_loopback& l, py::handle dst, py::handle src, py::handle nbytes) {
             static constexpr const char* who = "ferry.Loopback.copy";
             const std::optional<std::size_t> n =
                 nbytes.is_none() ? std::nullopt
                                  : std::optional<std::size_t>(size_arg(nbytes, who, "nbytes"));
             auto keep = std::make_shared<keep_alive>();
             const std::span<std::byte> d = keep->hold(dst, true, who, "dst (the destination)");
             const std::span<std::byte> s = keep->hold(src, false, who, "src (the source)");
             return py_transfer(l.backend->copy(d, s, n.value_or(s.size())), std::move(keep));
           },
           py::arg("dst"), py::arg("src"), py::arg("nbytes") = py::none(),
           "Copies the first nbytes (default: all) of src into the front of dst. Both buffers are "
           "held until the copy has ended.");
}

}  // namespace ferry::python
