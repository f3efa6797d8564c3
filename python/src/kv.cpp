// ferry.kv: the decode side's load tracker and the producer side's release ledger, with the C++
// contracts unchanged: a hybrid request that failed or timed out raises TransferError before
// anything changes, failed blocks are reported once, a request is released once and only when none
// of its transfers may still write.
//
// The tracker is called by one engine thread. Its blocking calls (post's backoff pauses,
// drain_step) release the GIL; while one runs, a call from another Python thread is refused with
// RuntimeError instead of racing it.

#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "ferry/kv/errors.hpp"
#include "ferry/kv/load_tracker.hpp"
#include "ferry/kv/release_ledger.hpp"
#include "ferry/wait_all.hpp"

namespace ferry::python {

namespace {

using kv::load_tracker;

struct py_tracker {
  std::unique_ptr<load_tracker> tracker;
  bool busy = false;  // a call that released the GIL is inside the tracker

  load_tracker& use(const char* what) {
    if (busy) {
      throw std::runtime_error(std::string("ferry.kv.LoadTracker.") + what +
                               ": the tracker is inside post() or drain_step() on another thread; "
                               "one engine thread calls the tracker");
    }
    return *tracker;
  }
};

// Marks the tracker busy while a call runs without the GIL.
struct busy_scope {
  py_tracker& t;
  explicit busy_scope(py_tracker& tr) noexcept : t(tr) { t.busy = true; }
  ~busy_scope() { t.busy = false; }
  busy_scope(const busy_scope&) = delete;
  busy_scope& operator=(const busy_scope&) = delete;
};

// Sets the tracker busy again when submit returns (or raises).
struct busy_again {
  py_tracker& t;
  ~busy_again() { t.busy = true; }
};

py::dict transfer_error_attrs(const kv::transfer_error& e) {
  py::dict d;
  d["request"] = e.request();
  d["member"] = e.member();
  d["layer"] = e.layer();
  d["timed_out"] = e.timed_out();
  return d;
}

std::vector<kv::block_id> blocks_of(py::handle blocks, const char* who) {
  std::vector<kv::block_id> out;
  for (py::handle b : iterable_arg(blocks, who, "blocks", "an iterable of block ids (ints)")) {
    out.push_back(int_arg<kv::block_id>(b, who, item_name("blocks", out.size())));
  }
  return out;
}

kv::request_options options_from(py::handle hybrid, py::handle abort_timeout,
                                 py::handle admission_timeout, const char* who) {
  kv::request_options o;
  o.hybrid = bool_arg(hybrid, who, "hybrid");
  if (!abort_timeout.is_none()) o.abort_timeout = duration_arg(abort_timeout, who, "abort_timeout");
  if (!admission_timeout.is_none()) {
    o.admission_timeout = duration_arg(admission_timeout, who, "admission_timeout");
  }
  return o;
}

// The arguments every tracker call shares.
const load_tracker::request_handle& handle_arg(py::handle h, const char* who) {
  return object_arg<load_tracker::request_handle>(h, who, "handle",
                                                  "a ferry.kv.RequestHandle (add_request's)");
}
kv::request_id id_arg(py::handle h, const char* who) {
  return int_arg<kv::request_id>(h, who, "id");
}
std::size_t layer_arg(py::handle h, const char* who) { return size_arg(h, who, "layer"); }

batch layer_batch(py_tracker& t, py::handle layer, const char* who) {
  const std::size_t l = layer_arg(layer, who);
  const std::span<const transfer> s = t.use("layer_transfers").layer_transfers(l);
  return batch{std::vector<transfer>(s.begin(), s.end())};
}

}  // namespace

void add_kv(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "kv", "The inference-server layer: per-request, per-layer load tracking and the producer's "
            "release ledger.");
  m.attr("TransferError") = exception_types().transfer_error;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kv::transfer_error& e) {
      raise_with_error(exception_types().transfer_error, e.what(), e.error(),
                       transfer_error_attrs(e));
    }
  });

  const auto kv_errc =
      py::enum_<kv::errc>(m, "Errc", "The kv layer's error codes (category 'ferry.kv').")
      .value("empty_request", kv::errc::empty_request);
  register_errc(kv_errc, [](py::handle h) -> std::optional<std::error_code> {
    if (!py::isinstance<kv::errc>(h)) return std::nullopt;
    return kv::make_error_code(h.cast<kv::errc>());
  });

  py::enum_<kv::request_verdict>(m, "RequestVerdict")
      .value("pending", kv::request_verdict::pending)
      .value("success", kv::request_verdict::success)
      .value("failed", kv::request_verdict::failed)
      .value("timed_out", kv::request_verdict::timed_out);

  py::class_<load_tracker::request_handle>(m, "RequestHandle",
                                           "A request being registered (add_request's result).")
      .def_property_readonly("id", &load_tracker::request_handle::id)
      .def("__repr__", [](const load_tracker::request_handle& h) {
        return "ferry.kv.RequestHandle(" + std::to_string(h.id()) + ")";
      });

  py::class_<kv::finished_request>(m, "FinishedRequest",
                                   "A request the tracker let go of: every transfer was terminal.")
      .def_readonly("id", &kv::finished_request::id)
      .def_readonly("verdict", &kv::finished_request::verdict)
      .def_property_readonly("first_failed",
                             [](const kv::finished_request& f) -> py::object {
                               if (!f.first_failed) return py::none();
                               return py::int_(*f.first_failed);
                             })
      .def_property_readonly("error",
                             [](const kv::finished_request& f) { return error_or_none(f.error); })
      .def_readonly("aborted", &kv::finished_request::aborted)
      .def("__repr__", [](const kv::finished_request& f) {
        return "ferry.kv.FinishedRequest(" + std::to_string(f.id) + ", " + to_string(f.verdict) +
               (f.aborted ? ", aborted" : "") + ")";
      });

  py::class_<py_tracker>(
      m, "LoadTracker",
      "The decode side: every request's KV arrives as transfers, one or more per layer. "
      "release(id, verdict) is called from take_finished once per request, when every transfer "
      "of it is terminal; cancel(transfer) asks the backend to end a transfer of a timed-out or "
      "aborted request (e.g. ring.cancel).")
      .def(py::init([](py::handle release_arg, py::handle cancel_arg) {
             // Checked here, not when a request first ends (LoadTracker(release=42) was taken).
             static constexpr const char* who = "ferry.kv.LoadTracker";
             const py::object release = callable_arg(release_arg, who, "release", true);
             const py::object cancel = callable_arg(cancel_arg, who, "cancel", true);
             load_tracker::release_fn r;
             if (!release.is_none()) {
               r = [release](kv::request_id id, kv::request_verdict v) { release(id, v); };
             }
             load_tracker::cancel_fn c;
             if (!cancel.is_none()) {
               c = [cancel](const transfer& t) { cancel(py_transfer(t)); };
             }
             py_tracker t;
             t.tracker = std::make_unique<load_tracker>(std::move(r), std::move(c));
             return t;
           }),
           py::arg("release") = py::none(), py::arg("cancel") = py::none())
      .def("begin_step", [](py_tracker& t) { t.use("begin_step").begin_step(); })
      .def("add_request",
           [](py_tracker& t, py::handle id, py::handle hybrid, py::handle abort_timeout,
              py::handle admission_timeout, py::handle created_ns) {
             static constexpr const char* who = "ferry.kv.LoadTracker.add_request";
             const kv::request_id rid = id_arg(id, who);
             const kv::request_options o =
                 options_from(hybrid, abort_timeout, admission_timeout, who);
             const auto created = time_point_arg(created_ns, who, "created_ns");
             return t.use("add_request").add_request(rid, o, created);
           },
           py::arg("id"), py::arg("hybrid") = false, py::arg("abort_timeout") = py::none(),
           py::arg("admission_timeout") = py::none(), py::arg("created_ns") = py::none(),
           "Starts tracking a request. abort_timeout (default 60 s) and admission_timeout (10 ms) "
           "in seconds; created_ns: its start, in time.monotonic_ns() (default now).")
      .def("add",
           [](py_tracker& t, py::handle handle, py::handle layer, py::handle transfer,
              py::handle blocks) {
             static constexpr const char* who = "ferry.kv.LoadTracker.add";
             const load_tracker::request_handle& h = handle_arg(handle, who);
             const std::size_t l = layer_arg(layer, who);
             const py_transfer& tr = transfer_arg(transfer, who);
             const std::vector<kv::block_id> b = blocks_of(blocks, who);
             t.use("add").add(h, l, tr.t, b);
           },
           py::arg("handle"), py::arg("layer"), py::arg("transfer"), py::arg("blocks"),
           "Registers one transfer of the request: its layer and the destination blocks it "
           "writes. If it raises, nothing was registered.")
      .def("post",
           [](py_tracker& t, py::handle handle, py::handle layer_arg_, py::handle blocks,
              py::handle submit_arg) {
             static constexpr const char* who = "ferry.kv.LoadTracker.post";
             const load_tracker::request_handle& h = handle_arg(handle, who);
             const std::size_t layer = layer_arg(layer_arg_, who);
             const std::vector<kv::block_id> b = blocks_of(blocks, who);
             const py::object submit = callable_arg(submit_arg, who, "submit");
             load_tracker& tracker = t.use("post");
             // What submit returned, held until the tracker has registered it (its buffers then
             // live on in the Transfer, or the orphan list once dropped).
             std::vector<py::object> submitted;
             auto call = [&]() -> std::optional<transfer> {
               py::gil_scoped_acquire gil;
               // submit runs with the GIL, like any call into the tracker from Python: the
               // tracker's own guard refuses submit calling back into it.
               t.busy = false;
               const busy_again again{t};
               py::object r = submit();
               if (r.is_none()) return std::nullopt;
               if (!py::isinstance<py_transfer>(r)) {
                 throw_type_error(who, "what submit() returns", "a ferry.Transfer or None", r);
               }
               const transfer tr = r.cast<const py_transfer&>().t;
               submitted.push_back(std::move(r));
               return tr;
             };
             {
               busy_scope busy(t);
               py::gil_scoped_release released;
               tracker.post(h, layer, b, call);
             }
           },
           py::arg("handle"), py::arg("layer"), py::arg("blocks"), py::arg("submit"),
           "Posts through submit() (a Transfer, or None when the backend's queue is full: retried "
           "with backoff, the GIL released between tries, until the admission deadline; then an "
           "already-failed transfer, Errc.submission_queue_full, is registered). submit must not "
           "call the tracker.")
      .def("seal",
           [](py_tracker& t, py::handle handle) {
             t.use("seal").seal(handle_arg(handle, "ferry.kv.LoadTracker.seal"));
           },
           py::arg("handle"), "Every transfer has been added: only now can the request be done.")
      .def("abort_request",
           [](py_tracker& t, py::handle id) {
             t.use("abort_request").abort_request(id_arg(id, "ferry.kv.LoadTracker.abort_request"));
           },
           py::arg("id"))
      .def("verdict",
           [](py_tracker& t, py::handle id, py::handle now_ns) {
             static constexpr const char* who = "ferry.kv.LoadTracker.verdict";
             const kv::request_id rid = id_arg(id, who);
             return t.use("verdict").verdict(rid, time_point_arg(now_ns, who, "now_ns"));
           },
           py::arg("id"), py::arg("now_ns") = py::none(),
           "Never blocks, changes nothing. Raises TransferError for a hybrid request that failed "
           "or timed out (its age strictly greater than abort_timeout), unless aborted.")
      .def("layer_transfers",
           [](py_tracker& t, py::handle layer) {
             return layer_batch(t, layer, "ferry.kv.LoadTracker.layer_transfers");
           },
           py::arg("layer"), "The step's transfers of `layer`, across every request, as a Batch.")
      .def("_layer_transfers",
           [](py_tracker& t, py::handle layer, const std::string& who) {
             return layer_batch(t, layer, who.c_str());
           },
           py::arg("layer"), py::arg("who"),
           "layer_transfers for when_layer, naming it in errors.")
      .def("wait_layer",
           [](py_tracker& t, py::handle layer, py::handle timeout) {
             static constexpr const char* who = "ferry.kv.LoadTracker.wait_layer";
             const std::size_t l = layer_arg(layer, who);
             const auto deadline = timeout_arg(timeout, who);
             const std::span<const transfer> s = t.use("wait_layer").layer_transfers(l);
             const std::vector<transfer> members(s.begin(), s.end());
             return wait_released(
                 deadline,
                 [&](std::chrono::nanoseconds slice) { return wait_all(members, slice); },
                 [](const batch_result& r) { return r.verdict != verdict::timed_out; });
           },
           py::arg("layer"), py::arg("timeout") = py::none(),
           "wait_all over exactly this layer's transfers, with the GIL released.")
      .def("drain_step",
           [](py_tracker& t, py::handle timeout) {
             const auto deadline = timeout_arg(timeout, "ferry.kv.LoadTracker.drain_step");
             load_tracker& tracker = t.use("drain_step");
             busy_scope busy(t);
             return wait_released(
                 deadline,
                 [&](std::chrono::nanoseconds slice) { return tracker.drain_step(slice); },
                 [](const batch_result& r) { return r.verdict != verdict::timed_out; });
           },
           py::arg("timeout") = py::none(),
           "Waits until every transfer of this step is terminal, or the deadline.")
      .def("take_finished",
           [](py_tracker& t, py::handle now_ns) {
             const auto now =
                 time_point_arg(now_ns, "ferry.kv.LoadTracker.take_finished", "now_ns");
             return t.use("take_finished").take_finished(now);
           },
           py::arg("now_ns") = py::none(),
           "Hands back every sealed request whose transfers are all terminal, calling release "
           "once for each. Raises TransferError, changing nothing, for a hybrid request that "
           "failed or timed out.")
      .def("drain_failed_blocks",
           [](py_tracker& t) { return t.use("drain_failed_blocks").drain_failed_blocks(); },
           "Destination blocks whose load failed, each reported once, once nothing writes them.")
      .def_property_readonly("tracked",
                             [](py_tracker& t) { return t.use("tracked").tracked(); })
      .def("tracks",
           [](py_tracker& t, py::handle id) {
             return t.use("tracks").tracks(id_arg(id, "ferry.kv.LoadTracker.tracks"));
           },
           py::arg("id"));

  py::enum_<kv::ack_result>(m, "AckResult")
      .value("counted", kv::ack_result::counted)
      .value("freed", kv::ack_result::freed)
      .value("duplicate", kv::ack_result::duplicate)
      .value("stale", kv::ack_result::stale)
      .value("early", kv::ack_result::early)
      .value("early_dropped", kv::ack_result::early_dropped);

  py::class_<kv::release_ledger>(
      m, "ReleaseLedger",
      "The producer side: free(transfer_id) is called once per transfer, after the expected "
      "number of consumers acknowledged it. Thread-safe.")
      .def(py::init([](py::handle free_arg, py::handle early_capacity,
                       py::handle finished_capacity) {
             static constexpr const char* who = "ferry.kv.ReleaseLedger";
             const py::object free_blocks = callable_arg(free_arg, who, "free");
             const kv::ledger_options o{size_arg(early_capacity, who, "early_capacity"),
                                        size_arg(finished_capacity, who, "finished_capacity")};
             return std::make_unique<kv::release_ledger>(
                 [free_blocks](kv::transfer_id id) { free_blocks(id); }, o);
           }),
           py::arg("free"), py::arg("early_capacity") = 4096,
           py::arg("finished_capacity") = 65536)
      .def("expect",
           [](kv::release_ledger& l, py::handle id, py::handle consumers) {
             static constexpr const char* who = "ferry.kv.ReleaseLedger.expect";
             const auto tid = int_arg<kv::transfer_id>(id, who, "id");
             return l.expect(tid, int_arg<std::uint32_t>(consumers, who, "consumers"));
           },
           py::arg("id"), py::arg("consumers"))
      .def("acknowledge",
           [](kv::release_ledger& l, py::handle id, py::handle rank) {
             static constexpr const char* who = "ferry.kv.ReleaseLedger.acknowledge";
             const auto tid = int_arg<kv::transfer_id>(id, who, "id");
             return l.acknowledge(tid, int_arg<kv::rank_id>(rank, who, "rank"));
           },
           py::arg("id"), py::arg("rank"))
      .def_property_readonly("open", &kv::release_ledger::open)
      .def_property_readonly("early", &kv::release_ledger::early);
}

}  // namespace ferry::python
