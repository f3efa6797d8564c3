// ferry.testing: the fault injector, for tests and soak runs of code that must survive failures,
// delays, reordering and lost completions.

#include <memory>
#include <utility>

#include "common.hpp"
#include "ferry/progress_executor.hpp"
#include "ferry/testing/errors.hpp"
#include "ferry/testing/fault_injector.hpp"

namespace ferry::python {

namespace {

struct py_fault_injector {
  std::shared_ptr<progress_executor> exec;
  std::unique_ptr<fault_injector> injector;
};

}  // namespace

void add_testing(py::module_& parent) {
  py::module_ m = parent.def_submodule("testing", "Test doubles: the fault injector.");

  const auto testing_errc = py::enum_<testing::errc>(
      m, "Errc", "The test doubles' error codes (category 'ferry.testing').")
      .value("injected_fault", testing::errc::injected_fault);
  register_errc(testing_errc, [](py::handle h) -> std::optional<std::error_code> {
    if (!py::isinstance<testing::errc>(h)) return std::nullopt;
    return testing::make_error_code(h.cast<testing::errc>());
  });

  py::class_<py_fault_injector, std::shared_ptr<py_fault_injector>>(
      m, "FaultInjector",
      "wrap(t) returns a transfer that ends only after t has ended (so t's buffers are quiescent "
      "when the caller hears of it), with what the caller hears drawn from a seeded generator: a "
      "failure (error), a hang (until release_hung() or the injector goes: then Errc.abandoned), "
      "a delay up to max_delay, or t's own result; with reorder_window > 1 results are released "
      "in shuffled batches.")
      .def(py::init([](py::handle executor, py::handle failure_rate, py::handle hang_rate,
                       py::handle delay_rate, py::handle max_delay, py::handle reorder_window,
                       py::handle reorder_hold, py::handle error, py::handle seed) {
             static constexpr const char* who = "ferry.testing.FaultInjector";
             std::shared_ptr<progress_executor> exec = executor_arg(executor, who);
             fault_profile p;
             p.failure_rate = rate_arg(failure_rate, who, "failure_rate");
             p.hang_rate = rate_arg(hang_rate, who, "hang_rate");
             p.delay_rate = rate_arg(delay_rate, who, "delay_rate");
             p.max_delay = duration_arg(max_delay, who, "max_delay");
             p.reorder_window = size_arg(reorder_window, who, "reorder_window");
             p.reorder_hold = duration_arg(reorder_hold, who, "reorder_hold");
             if (!error.is_none()) p.error = error_from(error, who);
             p.seed = int_arg<std::uint64_t>(seed, who, "seed");
             auto f = std::make_shared<py_fault_injector>();
             f->injector = std::make_unique<fault_injector>(*exec, std::move(p));
             f->exec = std::move(exec);
             return f;
           }),
           py::arg("executor"), py::arg("failure_rate") = 0.0, py::arg("hang_rate") = 0.0,
           py::arg("delay_rate") = 0.0, py::arg("max_delay") = 0.0, py::arg("reorder_window") = 0,
           py::arg("reorder_hold") = 0.001, py::arg("error") = py::none(), py::arg("seed") = 1)
      .def("wrap",
           [](py_fault_injector& f, py::handle transfer) {
             const py_transfer& inner = transfer_arg(transfer, "ferry.testing.FaultInjector.wrap");
             auto keep = std::make_shared<keep_alive>();
             keep->inner = inner.keep;
             return py_transfer(f.injector->wrap(inner.t), std::move(keep));
           },
           py::arg("transfer"))
      .def("release_hung", [](py_fault_injector& f) { return f.injector->release_hung(); },
           "Completes every hung transfer with its inner result; returns how many there were.")
      .def_property_readonly("counters", [](const py_fault_injector& f) {
        const fault_counters c = f.injector->counters();
        py::dict d;
        d["wrapped"] = c.wrapped;
        d["failed"] = c.failed;
        d["hung"] = c.hung;
        d["delayed"] = c.delayed;
        d["forwarded"] = c.forwarded;
        return d;
      });
}

}  // namespace ferry::python
