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

#include <pybind11/numpy.h>
#include <pybind11/operators.h>

#include "common.hpp"
#include "ferry/kv/handshake.hpp"
#include "ferry/kv/layout.hpp"
#include "ferry/kv/plan.hpp"
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

void add_kv_layouts(py::module_& m);

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
      .value("empty_request", kv::errc::empty_request)
      .value("bad_layout", kv::errc::bad_layout)
      .value("bad_parallelism", kv::errc::bad_parallelism)
      .value("incompatible_layouts", kv::errc::incompatible_layouts)
      .value("bad_block_table", kv::errc::bad_block_table)
      .value("region_out_of_range", kv::errc::region_out_of_range)
      .value("bad_engine_description", kv::errc::bad_engine_description)
      .value("push_failed", kv::errc::push_failed);
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

  add_kv_layouts(m);
}

// --- Cache layouts, transfer plans, the handshake ---

namespace {

using kv::cache_layout;
using kv::layer_layout;
using kv::tensor_layout;
using kv::tp_shard;

// A property read as the field's own integer type and written through int_arg, naming it.
template <class C, class F>
void int_field(py::class_<C>& c, const char* cls, const char* name, F C::*member) {
  c.def_property(
      name, [member](const C& o) { return o.*member; },
      [member, cls, name](C& o, py::handle v) {
        o.*member = int_arg<F>(v, std::string(cls) + "." + name, "value");
      });
}

tp_shard tp_arg(py::handle h, std::string_view who, std::string_view what) {
  if (py::isinstance<tp_shard>(h)) return h.cast<tp_shard>();
  if (PyTuple_Check(h.ptr()) && PyTuple_Size(h.ptr()) == 2) {
    const auto t = py::reinterpret_borrow<py::tuple>(h);
    return {int_arg<std::uint32_t>(t[0], who, std::string(what) + ".rank"),
            int_arg<std::uint32_t>(t[1], who, std::string(what) + ".size")};
  }
  throw_type_error(who, what, "a ferry.kv.TpShard or a (rank, size) tuple", h);
}

const cache_layout& layout_arg(py::handle h, std::string_view who, std::string_view what) {
  return object_arg<cache_layout>(h, who, what, "a ferry.kv.CacheLayout");
}

const kv::transfer_plan& plan_arg(py::handle h, std::string_view who, std::string_view what) {
  return object_arg<kv::transfer_plan>(h, who, what, "a ferry.kv.TransferPlan");
}

std::vector<tensor_layout> tensors_arg(py::handle h, std::string_view who, std::string_view what) {
  std::vector<tensor_layout> out;
  for (py::handle t : iterable_arg(h, who, what, "an iterable of ferry.kv.TensorLayout")) {
    out.push_back(object_arg<tensor_layout>(t, who, item_name(what, out.size()),
                                            "a ferry.kv.TensorLayout"));
  }
  return out;
}

std::vector<layer_layout> layers_arg(py::handle h, std::string_view who, std::string_view what) {
  std::vector<layer_layout> out;
  for (py::handle l : iterable_arg(h, who, what, "an iterable of ferry.kv.LayerLayout")) {
    out.push_back(object_arg<layer_layout>(l, who, item_name(what, out.size()),
                                           "a ferry.kv.LayerLayout"));
  }
  return out;
}

// How a tensor's dimensions are named, by layout kind: the order of (blocks, block_size, heads,
// head_size) in its shape; -1 for a dimension the kind lacks (its count is 1).
struct tensor_kind {
  const char* name;
  int blocks, tokens, heads, dims;
};
constexpr tensor_kind tensor_kinds[] = {
    {"token_major", 0, 1, 2, 4},  // [blocks, block_size, heads, head_size]
    {"head_major", 0, 2, 1, 4},   // [blocks, heads, block_size, head_size]
    {"latent", 0, 1, -1, 3},      // [blocks, block_size, head_size]
    {"state", 0, -1, 1, 3},       // [blocks, heads, head_size]
};

const tensor_kind& kind_arg(py::handle h, std::string_view who) {
  const std::string k = str_arg(h, who, "kind");
  for (const tensor_kind& t : tensor_kinds) {
    if (k == t.name) return t;
  }
  throw py::value_error(std::string(who) +
                        ": kind must be 'token_major', 'head_major', 'latent' or 'state', not '" +
                        k + "'");
}

// A tensor from its shape and byte strides, read as `kind`.
tensor_layout tensor_from(const tensor_kind& kind, const std::vector<std::int64_t>& shape,
                          const std::vector<std::int64_t>& strides, std::uint64_t element_size,
                          std::uint64_t offset, std::uint32_t region, std::string_view who,
                          std::string_view what) {
  const std::string w(who);
  if (shape.size() != static_cast<std::size_t>(kind.dims) || strides.size() != shape.size()) {
    throw py::value_error(w + ": " + std::string(what) + " has " + std::to_string(shape.size()) +
                          " dimensions; a '" + kind.name + "' tensor has " +
                          std::to_string(kind.dims));
  }
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] <= 0 || shape[i] > std::numeric_limits<std::uint32_t>::max()) {
      throw py::value_error(w + ": " + std::string(what) + " dimension " + std::to_string(i) +
                            " is " + std::to_string(shape[i]) + " (must be 1 to 2^32-1)");
    }
    if (strides[i] < 0) {
      throw py::value_error(w + ": " + std::string(what) + " stride " + std::to_string(i) +
                            " is negative (" + std::to_string(strides[i]) +
                            "): pass a tensor with non-negative strides");
    }
  }
  const int last = kind.dims - 1;
  if (shape[last] > 1 && static_cast<std::uint64_t>(strides[last]) != element_size) {
    throw py::value_error(w + ": " + std::string(what) + " head dimension (the last) has stride " +
                          std::to_string(strides[last]) + " bytes, not its element size " +
                          std::to_string(element_size) + ": a head's elements must be contiguous");
  }
  if (element_size == 0 || element_size > std::numeric_limits<std::uint32_t>::max()) {
    throw py::value_error(w + ": element_size is " + std::to_string(element_size));
  }
  const auto dim = [&](int i) { return i < 0 ? 1u : static_cast<std::uint32_t>(shape[i]); };
  const auto stride = [&](int i) { return i < 0 ? 0u : static_cast<std::uint64_t>(strides[i]); };
  tensor_layout t;
  t.region = region;
  t.offset = offset;
  t.element_size = static_cast<std::uint32_t>(element_size);
  t.blocks = dim(kind.blocks);
  t.block_size = dim(kind.tokens);
  t.heads = dim(kind.heads);
  t.head_size = dim(last);
  t.block_stride = stride(kind.blocks);
  t.token_stride = stride(kind.tokens);
  t.head_stride = stride(kind.heads);
  return t;
}

std::vector<std::int64_t> ints_arg(py::handle h, std::string_view who, std::string_view what) {
  std::vector<std::int64_t> out;
  for (py::handle v : iterable_arg(h, who, what, "a sequence of ints")) {
    out.push_back(signed_arg(v, who, item_name(what, out.size())));
  }
  return out;
}

struct buffer_view {
  Py_buffer view{};
  ~buffer_view() { PyBuffer_Release(&view); }
};

py::object range_tuple_repr(const kv::byte_range& r) {
  return py::str("ferry.kv.ByteRange(src_region={}, dst_region={}, src_offset={}, dst_offset={}, "
                 "length={})")
      .format(r.src_region, r.dst_region, r.src_offset, r.dst_offset, r.length);
}

kv::paged_shape paged_arg(py::handle layers, py::handle blocks, py::handle block_size,
                          py::handle total_heads, py::handle tp_size, py::handle head_size,
                          py::handle element_size, py::handle group, py::handle first_region,
                          py::handle region_per_layer, const std::string& who) {
  kv::paged_shape s;
  s.layers = int_arg<std::uint32_t>(layers, who, "layers");
  s.blocks = int_arg<std::uint32_t>(blocks, who, "blocks");
  s.block_size = int_arg<std::uint32_t>(block_size, who, "block_size");
  s.total_heads = int_arg<std::uint32_t>(total_heads, who, "total_heads");
  s.tp_size = int_arg<std::uint32_t>(tp_size, who, "tp_size");
  s.head_size = int_arg<std::uint32_t>(head_size, who, "head_size");
  s.element_size = int_arg<std::uint32_t>(element_size, who, "element_size");
  s.group = int_arg<std::uint32_t>(group, who, "group");
  s.first_region = int_arg<std::uint32_t>(first_region, who, "first_region");
  s.region_per_layer = bool_arg(region_per_layer, who, "region_per_layer");
  return s;
}

py::bytes to_bytes(std::span<const std::byte> b) {
  return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
}

std::vector<std::byte> bytes_arg(py::handle h, std::string_view who, std::string_view what) {
  const held_buffer b(h, false, who, what);
  return {b.bytes().begin(), b.bytes().end()};
}

}  // namespace

block_tables tables_arg(py::handle h, std::string_view who, std::string_view what) {
  block_tables t;
  const auto side = [&](py::handle ids, const std::string& name) {
    std::vector<std::uint32_t> out;
    if (py::isinstance<py::array_t<std::uint32_t>>(ids)) {
      const auto a = py::array_t<std::uint32_t, py::array::c_style>::ensure(ids);
      if (a.ndim() != 1) {
        throw py::value_error(std::string(who) + ": " + name + " must be one-dimensional, not " +
                              std::to_string(a.ndim()) + "-dimensional");
      }
      out.assign(a.data(), a.data() + a.size());
      return out;
    }
    for (py::handle v : iterable_arg(ids, who, name, "an iterable of block ids (ints)")) {
      out.push_back(int_arg<std::uint32_t>(v, who, item_name(name, out.size())));
    }
    return out;
  };
  for (py::handle g : iterable_arg(h, who, what,
                                   "a list with one (src_ids, dst_ids) pair per block group")) {
    const std::string at = item_name(what, t.src.size());
    const auto [src, dst] = pair_arg(g, who, at, "a (src_ids, dst_ids) pair");
    t.src.push_back(side(src, at + "[0]"));
    t.dst.push_back(side(dst, at + "[1]"));
  }
  for (std::size_t g = 0; g < t.src.size(); ++g) t.pairs.push_back({t.src[g], t.dst[g]});
  return t;
}

kv::load_tracker& tracker_arg(py::handle h, std::string_view who, std::string_view what) {
  py_tracker& t = object_arg<py_tracker>(h, who, what, "a ferry.kv.LoadTracker");
  if (t.busy) {
    throw std::runtime_error(std::string(who) +
                             ": the tracker is inside post() or drain_step() on another thread; "
                             "one engine thread calls the tracker");
  }
  return *t.tracker;
}

void add_kv_layouts(py::module_& m) {
  static constexpr const char* tl_name = "ferry.kv.TensorLayout";
  py::class_<tp_shard> tp(m, "TpShard", "A tensor-parallel position: rank `rank` of `size`.");
  tp.def(py::init([](py::handle rank, py::handle size) {
           static constexpr const char* who = "ferry.kv.TpShard";
           return tp_shard{int_arg<std::uint32_t>(rank, who, "rank"),
                           int_arg<std::uint32_t>(size, who, "size")};
         }),
         py::arg("rank") = 0, py::arg("size") = 1)
      .def(py::self == py::self)
      .def("__repr__", [](const tp_shard& t) {
        return "ferry.kv.TpShard(rank=" + std::to_string(t.rank) +
               ", size=" + std::to_string(t.size) + ")";
      });
  int_field(tp, "ferry.kv.TpShard", "rank", &tp_shard::rank);
  int_field(tp, "ferry.kv.TpShard", "size", &tp_shard::size);

  py::class_<tensor_layout> tl(
      m, "TensorLayout",
      "One tensor of a layer in one rank's registered memory: element (block b, token t, head h, "
      "dim 0) is at byte offset + b*block_stride + t*token_stride + h*head_stride of region "
      "`region`, a head's head_size elements contiguous. Build one field by field, from an array "
      "(from_array), or from a framework tensor's shape and strides (from_strides).");
  tl.def(py::init([](py::handle region, py::handle offset, py::handle element_size,
                     py::handle blocks, py::handle block_size, py::handle heads,
                     py::handle head_size, py::handle block_stride, py::handle token_stride,
                     py::handle head_stride) {
           static constexpr const char* who = tl_name;
           tensor_layout t;
           t.region = int_arg<std::uint32_t>(region, who, "region");
           t.offset = int_arg<std::uint64_t>(offset, who, "offset");
           t.element_size = int_arg<std::uint32_t>(element_size, who, "element_size");
           t.blocks = int_arg<std::uint32_t>(blocks, who, "blocks");
           t.block_size = int_arg<std::uint32_t>(block_size, who, "block_size");
           t.heads = int_arg<std::uint32_t>(heads, who, "heads");
           t.head_size = int_arg<std::uint32_t>(head_size, who, "head_size");
           t.block_stride = int_arg<std::uint64_t>(block_stride, who, "block_stride");
           t.token_stride = int_arg<std::uint64_t>(token_stride, who, "token_stride");
           t.head_stride = int_arg<std::uint64_t>(head_stride, who, "head_stride");
           return t;
         }),
         py::arg("region") = 0, py::arg("offset") = 0, py::arg("element_size") = 2,
         py::arg("blocks") = 0, py::arg("block_size") = 0, py::arg("heads") = 0,
         py::arg("head_size") = 0, py::arg("block_stride") = 0, py::arg("token_stride") = 0,
         py::arg("head_stride") = 0)
      .def_static(
          "from_array",
          [](py::handle array, py::handle kind_h, py::handle region, py::handle base) {
            static constexpr const char* who = "ferry.kv.TensorLayout.from_array";
            const tensor_kind& kind = kind_arg(kind_h, who);
            const auto r = int_arg<std::uint32_t>(region, who, "region");
            buffer_view a;
            if (PyObject_GetBuffer(array.ptr(), &a.view, PyBUF_STRIDES | PyBUF_FORMAT) != 0) {
              PyErr_Clear();
              throw_type_error(who, "array", "a buffer-protocol object (a numpy array)", array);
            }
            std::vector<std::int64_t> shape(a.view.shape, a.view.shape + a.view.ndim);
            std::vector<std::int64_t> strides(a.view.strides, a.view.strides + a.view.ndim);
            std::uint64_t offset = 0;
            if (!base.is_none()) {
              buffer_view b;
              if (PyObject_GetBuffer(base.ptr(), &b.view, PyBUF_ANY_CONTIGUOUS) != 0) {
                PyErr_Clear();
                throw_type_error(who, "base", "a contiguous buffer (the registered memory) or None",
                                 base);
              }
              const auto* p = static_cast<const char*>(a.view.buf);
              const auto* start = static_cast<const char*>(b.view.buf);
              if (p < start || p >= start + b.view.len) {
                throw py::value_error(std::string(who) +
                                      ": array does not start inside base (the registered "
                                      "buffer its offset is counted from)");
              }
              offset = static_cast<std::uint64_t>(p - start);
            }
            return tensor_from(kind, shape, strides, static_cast<std::uint64_t>(a.view.itemsize),
                               offset, r, who, "array");
          },
          py::arg("array"), py::arg("kind"), py::arg("region") = 0, py::arg("base") = py::none(),
          "A tensor from an array's shape and byte strides, read as `kind`: 'token_major' "
          "[blocks, block_size, heads, head_size] (vLLM's K or V), 'head_major' [blocks, heads, "
          "block_size, head_size], 'latent' [blocks, block_size, head_size] (MLA), 'state' "
          "[blocks, heads, head_size] (a recurrent state). The element size is the item size; "
          "the offset is where the array starts in `base` (the buffer registered as region "
          "`region`), 0 without one. Negative strides, and heads whose elements are not "
          "contiguous, are refused.")
      .def_static(
          "from_strides",
          [](py::handle kind_h, py::handle shape_h, py::handle strides_h, py::handle element_size,
             py::handle offset, py::handle region) {
            static constexpr const char* who = "ferry.kv.TensorLayout.from_strides";
            const tensor_kind& kind = kind_arg(kind_h, who);
            const std::vector<std::int64_t> shape = ints_arg(shape_h, who, "shape");
            std::vector<std::int64_t> strides = ints_arg(strides_h, who, "strides");
            const auto es = int_arg<std::uint32_t>(element_size, who, "element_size", 1,
                                                   kv::layout_limits::element_size);
            for (std::int64_t& s : strides) {
              if (s > std::numeric_limits<std::int64_t>::max() / es) {
                throw py::value_error(std::string(who) + ": strides overflow in bytes");
              }
              s *= es;
            }
            return tensor_from(kind, shape, strides, es, int_arg<std::uint64_t>(offset, who, "offset"),
                               int_arg<std::uint32_t>(region, who, "region"), who, "shape");
          },
          py::arg("kind"), py::arg("shape"), py::arg("strides"), py::arg("element_size"),
          py::arg("offset"), py::arg("region") = 0,
          "A tensor with no buffer (a framework tensor): `shape` and `strides` in ELEMENTS, as "
          "torch gives them, read as `kind` (see from_array). For a torch tensor t that lives in "
          "the memory registered as region r starting at base pointer p: "
          "from_strides(kind, t.shape, t.stride(), t.element_size(), t.data_ptr() - p, r). "
          "Byte strides are the element strides times element_size.")
      .def(py::self == py::self)
      .def_property_readonly("head_bytes", &tensor_layout::head_bytes)
      .def("__repr__", [](const tensor_layout& t) {
        return py::str("ferry.kv.TensorLayout(region={}, offset={}, element_size={}, blocks={}, "
                       "block_size={}, heads={}, head_size={}, block_stride={}, token_stride={}, "
                       "head_stride={})")
            .format(t.region, t.offset, t.element_size, t.blocks, t.block_size, t.heads,
                    t.head_size, t.block_stride, t.token_stride, t.head_stride);
      });
  int_field(tl, tl_name, "region", &tensor_layout::region);
  int_field(tl, tl_name, "offset", &tensor_layout::offset);
  int_field(tl, tl_name, "element_size", &tensor_layout::element_size);
  int_field(tl, tl_name, "blocks", &tensor_layout::blocks);
  int_field(tl, tl_name, "block_size", &tensor_layout::block_size);
  int_field(tl, tl_name, "heads", &tensor_layout::heads);
  int_field(tl, tl_name, "head_size", &tensor_layout::head_size);
  int_field(tl, tl_name, "block_stride", &tensor_layout::block_stride);
  int_field(tl, tl_name, "token_stride", &tensor_layout::token_stride);
  int_field(tl, tl_name, "head_stride", &tensor_layout::head_stride);

  static constexpr const char* ll_name = "ferry.kv.LayerLayout";
  py::class_<layer_layout> ll(m, "LayerLayout",
                              "One layer: its block group, its heads in the model, whether they "
                              "are split across ranks, and its tensors (K then V, ...).");
  ll.def(py::init([](py::handle group, py::handle total_heads, py::handle heads_sharded,
                     py::handle tensors) {
           static constexpr const char* who = ll_name;
           layer_layout l;
           l.group = int_arg<std::uint32_t>(group, who, "group");
           l.total_heads = int_arg<std::uint32_t>(total_heads, who, "total_heads");
           l.heads_sharded = bool_arg(heads_sharded, who, "heads_sharded");
           l.tensors = tensors_arg(tensors, who, "tensors");
           return l;
         }),
         py::arg("group") = 0, py::arg("total_heads") = 1,
         py::arg("heads_sharded") = true, py::arg("tensors") = py::list())
      .def(py::self == py::self)
      .def_property(
          "heads_sharded", [](const layer_layout& l) { return l.heads_sharded; },
          [](layer_layout& l, py::handle v) {
            l.heads_sharded = bool_arg(v, "ferry.kv.LayerLayout.heads_sharded", "value");
          })
      .def_property(
          "tensors", [](const layer_layout& l) { return l.tensors; },
          [](layer_layout& l, py::handle v) {
            l.tensors = tensors_arg(v, "ferry.kv.LayerLayout.tensors", "value");
          },
          "A copy of the tensors: assign a list to change them.");
  int_field(ll, ll_name, "group", &layer_layout::group);
  int_field(ll, ll_name, "total_heads", &layer_layout::total_heads);

  py::class_<cache_layout> cl(
      m, "CacheLayout",
      "One tensor-parallel rank's paged cache, as data: per layer its tensors in registered "
      "memory. The named constructors build the common layouts (and check them); check() a "
      "layout built by hand.");
  cl.def(py::init([](py::handle layers) {
           cache_layout c;
           if (!layers.is_none()) c.layers = layers_arg(layers, "ferry.kv.CacheLayout", "layers");
           return c;
         }),
         py::arg("layers") = py::none())
      .def_property(
          "layers", [](const cache_layout& c) { return c.layers; },
          [](cache_layout& c, py::handle v) {
            c.layers = layers_arg(v, "ferry.kv.CacheLayout.layers", "value");
          },
          "A copy of the layers: assign a list to change them.")
      .def(py::self == py::self)
      .def("__repr__",
           [](const cache_layout& c) {
             return "ferry.kv.CacheLayout(" + std::to_string(c.layers.size()) + " layers)";
           })
      .def(
          "check",
          [](const cache_layout& c, py::handle tp_h) {
            if (tp_h.is_none()) {
              c.check();
            } else {
              c.check(tp_arg(tp_h, "ferry.kv.CacheLayout.check", "tp"));
            }
          },
          py::arg("tp") = py::none(),
          "Raises FerryError (Errc.bad_layout; Errc.bad_parallelism for a tp that cannot hold "
          "its heads) naming the layer, tensor and field at fault.")
      .def(
          "bytes_needed",
          [](const cache_layout& c, py::handle region) {
            return c.bytes_needed(
                int_arg<std::uint32_t>(region, "ferry.kv.CacheLayout.bytes_needed", "region"));
          },
          py::arg("region") = 0, "Bytes region `region` must have (0 when no tensor is in it).")
      .def_property_readonly("region_count", &cache_layout::region_count)
      .def_property_readonly("group_count", &cache_layout::group_count)
      .def(
          "append",
          [](cache_layout& c, py::handle more) -> cache_layout& {
            return c.append(layout_arg(more, "ferry.kv.CacheLayout.append", "more"));
          },
          py::arg("more"), py::return_value_policy::reference_internal,
          "Adds `more`'s layers after these; returns self, unchecked.");

  using paged_fn = cache_layout (*)(const kv::paged_shape&);
  const auto paged = [&cl](const char* name, paged_fn make, const char* doc) {
    cl.def_static(
        name,
        [name, make](py::handle layers, py::handle blocks, py::handle block_size,
                     py::handle total_heads, py::handle tp_size, py::handle head_size,
                     py::handle element_size, py::handle group, py::handle first_region,
                     py::handle region_per_layer) {
          const std::string who = std::string("ferry.kv.CacheLayout.") + name;
          return make(paged_arg(layers, blocks, block_size, total_heads, tp_size, head_size,
                                element_size, group, first_region, region_per_layer, who));
        },
        py::arg("layers"), py::arg("blocks"), py::arg("block_size") = 16,
        py::arg("total_heads") = 1, py::arg("tp_size") = 1, py::arg("head_size") = 128,
        py::arg("element_size") = 2, py::arg("group") = 0, py::arg("first_region") = 0,
        py::arg("region_per_layer") = true, doc);
  };
  paged("kv_split", &cache_layout::kv_split,
        "K and V per layer, [2, blocks, block_size, heads, head_size] (vLLM FlashAttention).");
  paged("kv_interleaved", &cache_layout::kv_interleaved,
        "[blocks, 2, block_size, heads, head_size]: block b's K then its V (FlashInfer).");
  paged("head_major", &cache_layout::head_major,
        "K and V each [blocks, heads, block_size, head_size].");
  paged("mla", &cache_layout::mla,
        "One latent per token, [blocks, block_size, head_size], the same on every rank.");
  paged("cross_layer", &cache_layout::cross_layer,
        "[blocks, layers, 2, block_size, heads, head_size] in one region.");
  cl.def_static(
      "recurrent_state",
      [](py::handle layers, py::handle blocks, py::handle total_heads, py::handle tp_size,
         py::handle heads_sharded, py::handle head_sizes, py::handle element_size,
         py::handle group, py::handle first_region, py::handle region_per_layer) {
        static constexpr const char* who = "ferry.kv.CacheLayout.recurrent_state";
        kv::state_shape s;
        s.layers = int_arg<std::uint32_t>(layers, who, "layers");
        s.blocks = int_arg<std::uint32_t>(blocks, who, "blocks");
        s.total_heads = int_arg<std::uint32_t>(total_heads, who, "total_heads");
        s.tp_size = int_arg<std::uint32_t>(tp_size, who, "tp_size");
        s.heads_sharded = bool_arg(heads_sharded, who, "heads_sharded");
        s.head_sizes.clear();
        for (py::handle v : iterable_arg(head_sizes, who, "head_sizes", "a sequence of ints")) {
          s.head_sizes.push_back(
              int_arg<std::uint32_t>(v, who, item_name("head_sizes", s.head_sizes.size())));
        }
        s.element_size = int_arg<std::uint32_t>(element_size, who, "element_size");
        s.group = int_arg<std::uint32_t>(group, who, "group");
        s.first_region = int_arg<std::uint32_t>(first_region, who, "first_region");
        s.region_per_layer = bool_arg(region_per_layer, who, "region_per_layer");
        return cache_layout::recurrent_state(s);
      },
      py::arg("layers"), py::arg("blocks"), py::arg("total_heads") = 1, py::arg("tp_size") = 1,
      py::arg("heads_sharded") = true, py::arg("head_sizes") = std::vector<std::uint32_t>{1},
      py::arg("element_size") = 2, py::arg("group") = 1, py::arg("first_region") = 0,
      py::arg("region_per_layer") = true,
      "A recurrent state's layers, each tensor [blocks, heads, head_size] (one per head_sizes "
      "entry). Add them beside attention layers with append().");

  py::class_<kv::byte_range>(m, "ByteRange",
                             "length bytes from src_offset of the source's region src_region to "
                             "dst_offset of the destination's region dst_region.")
      .def_readonly("src_region", &kv::byte_range::src_region)
      .def_readonly("dst_region", &kv::byte_range::dst_region)
      .def_readonly("src_offset", &kv::byte_range::src_offset)
      .def_readonly("dst_offset", &kv::byte_range::dst_offset)
      .def_readonly("length", &kv::byte_range::length)
      .def(py::self == py::self)
      .def("__repr__", &range_tuple_repr);

  py::class_<kv::transfer_plan>(
      m, "TransferPlan",
      "What to move for one request between one source rank and one destination rank: per "
      "layer, byte ranges (empty for a layer this source does not supply).")
      .def_property_readonly(
          "layers", [](const kv::transfer_plan& p) { return p.layers; },
          "A copy: a list per layer of ByteRange. layer_array(l) is cheaper for large plans.")
      .def(
          "layer_array",
          [](const kv::transfer_plan& p, py::handle layer) {
            static constexpr const char* who = "ferry.kv.TransferPlan.layer_array";
            const std::size_t l = size_arg(layer, who, "layer");
            if (l >= p.layers.size()) {
              throw py::value_error(std::string(who) + ": layer " + std::to_string(l) +
                                    " is not below the plan's " + std::to_string(p.layers.size()) +
                                    " layers");
            }
            const auto& rs = p.layers[l];
            py::array_t<std::uint64_t> a({static_cast<py::ssize_t>(rs.size()), py::ssize_t{5}});
            auto w = a.mutable_unchecked<2>();
            for (std::size_t i = 0; i < rs.size(); ++i) {
              const auto k = static_cast<py::ssize_t>(i);
              w(k, 0) = rs[i].src_region;
              w(k, 1) = rs[i].dst_region;
              w(k, 2) = rs[i].src_offset;
              w(k, 3) = rs[i].dst_offset;
              w(k, 4) = rs[i].length;
            }
            return a;
          },
          py::arg("layer"),
          "Layer `layer`'s ranges as a uint64 array of shape (n, 5): src_region, dst_region, "
          "src_offset, dst_offset, length.")
      .def_property_readonly("layer_count",
                             [](const kv::transfer_plan& p) { return p.layers.size(); })
      .def_readonly("ranges", &kv::transfer_plan::ranges)
      .def_readonly("bytes", &kv::transfer_plan::bytes)
      .def("__repr__", [](const kv::transfer_plan& p) {
        return "ferry.kv.TransferPlan(" + std::to_string(p.layers.size()) + " layers, " +
               std::to_string(p.ranges) + " ranges, " + std::to_string(p.bytes) + " bytes)";
      });

  py::class_<kv::transfer_planner>(
      m, "TransferPlanner",
      "Plans transfers from src (at src_tp) to dst (at dst_tp): checks the layouts once "
      "(FerryError: Errc.bad_layout, bad_parallelism, incompatible_layouts).")
      .def(py::init([](py::handle src, py::handle src_tp, py::handle dst, py::handle dst_tp) {
             static constexpr const char* who = "ferry.kv.TransferPlanner";
             const cache_layout& s = layout_arg(src, who, "src");
             const tp_shard st = tp_arg(src_tp, who, "src_tp");
             const cache_layout& d = layout_arg(dst, who, "dst");
             const tp_shard dt = tp_arg(dst_tp, who, "dst_tp");
             return kv::transfer_planner(s, st, d, dt);
           }),
           py::arg("src"), py::arg("src_tp"), py::arg("dst"), py::arg("dst_tp"))
      .def(
          "plan",
          [](const kv::transfer_planner& p, py::handle groups) {
            const block_tables t = tables_arg(groups, "ferry.kv.TransferPlanner.plan", "groups");
            return p.plan(t.pairs);
          },
          py::arg("groups"),
          "groups: one (src_ids, dst_ids) pair per block group (lists of ints or numpy uint32 "
          "arrays). FerryError (Errc.bad_block_table) names the group and pair at fault.")
      .def_property_readonly("group_count", &kv::transfer_planner::group_count)
      .def_property_readonly("layer_count", &kv::transfer_planner::layer_count)
      .def(
          "ranges_per_block",
          [](const kv::transfer_planner& p, py::handle layer) {
            static constexpr const char* who = "ferry.kv.TransferPlanner.ranges_per_block";
            const std::size_t l = size_arg(layer, who, "layer");
            if (l >= p.layer_count()) {
              throw py::value_error(std::string(who) + ": layer " + std::to_string(l) +
                                    " is not below " + std::to_string(p.layer_count()));
            }
            return p.ranges_per_block(l);
          },
          py::arg("layer"));

  m.def(
      "apply_plan",
      [](py::handle plan, py::handle src, py::handle dst) {
        static constexpr const char* who = "ferry.kv.apply_plan";
        const kv::transfer_plan& p = plan_arg(plan, who, "plan");
        std::vector<std::unique_ptr<held_buffer>> hold;
        std::vector<std::span<const std::byte>> s;
        std::vector<std::span<std::byte>> d;
        for (py::handle b : iterable_arg(src, who, "src", "a list of buffers, one per region")) {
          hold.push_back(std::make_unique<held_buffer>(b, false, who, item_name("src", s.size())));
          s.push_back(hold.back()->bytes());
        }
        for (py::handle b : iterable_arg(dst, who, "dst", "a list of buffers, one per region")) {
          hold.push_back(std::make_unique<held_buffer>(b, true, who, item_name("dst", d.size())));
          d.push_back(hold.back()->bytes());
        }
        kv::apply_plan(p, s, d);
      },
      py::arg("plan"), py::arg("src"), py::arg("dst"),
      "Carries out the plan with memcpy: src[r] and dst[r] are the two sides' region r (buffers). "
      "FerryError (Errc.region_out_of_range) names a range outside them; nothing is copied then.");

  m.def(
      "heads_held",
      [](py::handle total_heads, py::handle tp_h) {
        static constexpr const char* who = "ferry.kv.heads_held";
        const auto h = int_arg<std::uint32_t>(total_heads, who, "total_heads");
        const kv::head_range r = kv::heads_held(h, tp_arg(tp_h, who, "tp"));
        return py::make_tuple(r.first, r.count);
      },
      py::arg("total_heads"), py::arg("tp"), "(first, count) of the heads rank tp holds.");
  m.def(
      "tp_sources",
      [](py::handle total_heads, py::handle heads_sharded, py::handle src_size, py::handle dst) {
        static constexpr const char* who = "ferry.kv.tp_sources";
        const auto h = int_arg<std::uint32_t>(total_heads, who, "total_heads");
        const bool sharded = bool_arg(heads_sharded, who, "heads_sharded");
        const auto size = int_arg<std::uint32_t>(src_size, who, "src_size");
        py::list out;
        for (const kv::tp_source& s : kv::tp_sources(h, sharded, size, tp_arg(dst, who, "dst"))) {
          out.append(py::make_tuple(s.src_rank, s.heads.first, s.heads.count));
        }
        return out;
      },
      py::arg("total_heads"), py::arg("heads_sharded"), py::arg("src_size"), py::arg("dst"),
      "[(src_rank, first_head, head_count), ...]: which source ranks destination rank `dst` "
      "reads a layer from, and which heads.");
  m.def(
      "tp_source_ranks",
      [](py::handle layout, py::handle src_size, py::handle dst) {
        static constexpr const char* who = "ferry.kv.tp_source_ranks";
        const cache_layout& l = layout_arg(layout, who, "layout");
        const auto size = int_arg<std::uint32_t>(src_size, who, "src_size");
        return kv::tp_source_ranks(l, size, tp_arg(dst, who, "dst"));
      },
      py::arg("layout"), py::arg("src_size"), py::arg("dst"),
      "Every source rank destination rank `dst` reads from: the peers it needs a handshake with.");

  py::class_<kv::engine_description> ed(
      m, "EngineDescription",
      "What an engine (one tensor-parallel rank) tells its peers: id, incarnation, tp position, "
      "cache layout and one opaque descriptor per region (MemoryRegion.describe() bytes).");
  ed.def(py::init([](py::handle engine_id, py::handle incarnation, py::handle tp_h,
                     py::handle layout, py::handle regions) {
           static constexpr const char* who = "ferry.kv.EngineDescription";
           kv::engine_description d;
           d.engine_id = str_arg(engine_id, who, "engine_id");
           d.incarnation = int_arg<std::uint64_t>(incarnation, who, "incarnation");
           d.tp = tp_arg(tp_h, who, "tp");
           d.layout = layout_arg(layout, who, "layout");
           for (py::handle r : iterable_arg(regions, who, "regions", "a list of bytes")) {
             d.regions.push_back(bytes_arg(r, who, item_name("regions", d.regions.size())));
           }
           return d;
         }),
         py::arg("engine_id"), py::arg("incarnation"), py::arg("tp"), py::arg("layout"),
         py::arg("regions"))
      .def_readonly("engine_id", &kv::engine_description::engine_id)
      .def_readonly("incarnation", &kv::engine_description::incarnation)
      .def_readonly("tp", &kv::engine_description::tp)
      .def_readonly("layout", &kv::engine_description::layout)
      .def_property_readonly("regions",
                             [](const kv::engine_description& d) {
                               py::list out;
                               for (const auto& r : d.regions) out.append(to_bytes(r));
                               return out;
                             })
      .def(py::self == py::self)
      .def("check", &kv::engine_description::check,
           "Raises FerryError (Errc.bad_engine_description) naming what is wrong.")
      .def(
          "encode",
          [](const kv::engine_description& d) { return to_bytes(kv::encode(d)); },
          "The record to send to a peer (bytes). Raises FerryError "
          "(Errc.bad_engine_description) for a description that fails check().")
      .def_static(
          "decode",
          [](py::handle b) {
            return kv::decode(bytes_arg(b, "ferry.kv.EngineDescription.decode", "data"));
          },
          py::arg("data"),
          "A peer's encode() bytes, checked; FerryError (Errc.bad_engine_description) names "
          "what is wrong with anything else.")
      .def(
          "check_compatible",
          [](const kv::engine_description& src, py::handle dst) {
            kv::check_compatible(src, object_arg<kv::engine_description>(
                                          dst, "ferry.kv.EngineDescription.check_compatible",
                                          "dst", "a ferry.kv.EngineDescription"));
          },
          py::arg("dst"),
          "Raises FerryError unless this engine's blocks can move to dst's "
          "(Errc.incompatible_layouts naming the difference, Errc.bad_parallelism).");

  m.def(
      "check_compatible",
      [](py::handle src, py::handle src_tp, py::handle dst, py::handle dst_tp) {
        static constexpr const char* who = "ferry.kv.check_compatible";
        const cache_layout& s = layout_arg(src, who, "src");
        const tp_shard st = tp_arg(src_tp, who, "src_tp");
        const cache_layout& d = layout_arg(dst, who, "dst");
        kv::check_compatible(s, st, d, tp_arg(dst_tp, who, "dst_tp"));
      },
      py::arg("src"), py::arg("src_tp"), py::arg("dst"), py::arg("dst_tp"),
      "Raises FerryError unless blocks can move from layout src (at src_tp) to dst (at dst_tp).");
}

}  // namespace ferry::python
