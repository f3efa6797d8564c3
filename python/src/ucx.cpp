// ferry.ucx: one-sided get and put between processes over whatever UCX finds, with region
// descriptors and worker addresses as bytes for the connector's own side channel. Endpoints and
// listeners keep their worker alive, workers their executor; a transfer keeps the local region it
// reads or writes (and the buffer under a registered one) until it has ended.

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "ferry/ucx.hpp"

namespace ferry::python {

namespace {

struct py_worker {
  std::shared_ptr<progress_executor> exec;
  std::unique_ptr<ucx::worker> worker;
  // ~worker may wait up to close_timeout for its endpoints' closes: not holding the GIL.
  ~py_worker() {
    if (!worker) return;
    if (PyGILState_Check() != 0) {
      py::gil_scoped_release released;
      worker.reset();
    } else {
      worker.reset();
    }
  }
};

// A registered or UCX-allocated region. For registered memory, the buffer is held as long as the
// region (and so any transfer using it) is.
struct py_region {
  std::unique_ptr<held_buffer> buffer;  // declared first: released after the region is unmapped
  ucx::memory_region region;
};

struct py_local_slice {
  std::shared_ptr<py_region> region;
  std::size_t offset = 0;
  std::size_t length = 0;

  [[nodiscard]] ucx::local_slice get() const { return region->region.slice(offset, length); }
};

struct py_endpoint {
  std::shared_ptr<py_worker> worker;  // destroyed after the endpoint
  ucx::endpoint endpoint;
};

struct py_listener {
  std::shared_ptr<py_worker> worker;  // destroyed after the listener
  std::optional<ucx::listener> listener;
};

std::vector<ucx::memory_region> regions_of(py::handle expose, const char* who) {
  std::vector<ucx::memory_region> out;
  if (expose.is_none()) return out;
  for (py::handle r : iterable_arg(expose, who, "expose",
                                   "an iterable of ferry.ucx.MemoryRegion or None")) {
    out.push_back(object_arg<py_region>(r, who, item_name("expose", out.size()),
                                        "a ferry.ucx.MemoryRegion")
                      .region);
  }
  return out;
}

std::span<const std::byte> bytes_of(py::handle b, std::unique_ptr<held_buffer>& hold,
                                    const char* who, const char* what) {
  hold = std::make_unique<held_buffer>(b, false, who, what);
  return hold->bytes();
}

ucx::put_completion completion_of(py::handle h, const char* who) {
  const std::string s = str_arg(h, who, "completion");
  if (s == "landed") return ucx::put_completion::landed;
  if (s == "source_reusable") return ucx::put_completion::source_reusable;
  throw py::value_error(std::string(who) +
                        ": completion must be 'landed' or 'source_reusable', not '" + s + "'");
}

const py_local_slice& local_arg(py::handle h, const char* who, std::string_view what) {
  return object_arg<py_local_slice>(h, who, what,
                                    "a ferry.ucx.LocalSlice (MemoryRegion.slice or whole)");
}
const ucx::remote_slice& remote_arg(py::handle h, const char* who, std::string_view what) {
  return object_arg<ucx::remote_slice>(h, who, what,
                                       "a ferry.ucx.RemoteSlice (RemoteMemory.slice)");
}

std::uint16_t port_arg(py::handle h, const char* who) {
  return int_arg<std::uint16_t>(h, who, "port");
}

// A connect or accept's timeout: None is 10 s.
std::chrono::duration<double> connect_timeout(py::handle h, const char* who) {
  return h.is_none() ? std::chrono::duration<double>(10.0) : timeout_arg(h, who);
}

// The keep-alive of a get or put: its local region (and what holds that region's memory).
std::shared_ptr<keep_alive> keep_for(const py_local_slice& local) {
  auto keep = std::make_shared<keep_alive>();
  keep->objects.push_back(py::cast(local.region));
  return keep;
}

py::list rma_batch(py_endpoint& e, py::handle blocks, py::handle timeout, bool put,
                   py::handle completion) {
  const char* const who = put ? "ferry.ucx.Endpoint.put_batch" : "ferry.ucx.Endpoint.get_batch";
  const char* const expected = put ? "a (LocalSlice, RemoteSlice) pair: (src, dst)"
                                   : "a (LocalSlice, RemoteSlice) pair: (dst, src)";
  std::vector<ucx::rma_block> b;
  auto keep = std::make_shared<keep_alive>();
  for (py::handle item : iterable_arg(blocks, who, "blocks",
                                      "an iterable of (LocalSlice, RemoteSlice) pairs")) {
    const std::string what = item_name("blocks", b.size());
    const auto [first, second] = pair_arg(item, who, what, expected);
    const py_local_slice& local = local_arg(first, who, what + "[0]");
    const ucx::remote_slice& remote = remote_arg(second, who, what + "[1]");
    b.push_back({local.get(), remote});
    keep->objects.push_back(py::cast(local.region));
  }
  const auto t = timeout_arg(timeout, who);
  const ucx::put_completion how =
      put ? completion_of(completion, who) : ucx::put_completion::landed;
  std::vector<transfer> out(b.size());
  if (put) {
    e.endpoint.put_batch(b, out, t, how);
  } else {
    e.endpoint.get_batch(b, out, t);
  }
  py::list result;
  for (transfer& tr : out) result.append(py_transfer(std::move(tr), keep));
  return result;
}

}  // namespace

void add_ucx(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "ucx", "The UCX backend: one-sided get and put, notifications, endpoints by address or by "
             "host and port.");

  const auto ucx_errc = py::enum_<ucx::errc>(
      m, "Errc", "The UCX backend's error codes (category 'ferry::ucx').")
      .value("deadline_exceeded", ucx::errc::deadline_exceeded)
      .value("endpoint_closed", ucx::errc::endpoint_closed)
      .value("outside_region", ucx::errc::outside_region)
      .value("length_mismatch", ucx::errc::length_mismatch)
      .value("bad_descriptor", ucx::errc::bad_descriptor)
      .value("handshake_failed", ucx::errc::handshake_failed)
      .value("peer_gone", ucx::errc::peer_gone)
      .value("worker_closed", ucx::errc::worker_closed)
      .value("not_executor_safe", ucx::errc::not_executor_safe);
  register_errc(ucx_errc, [](py::handle h) -> std::optional<std::error_code> {
    if (!py::isinstance<ucx::errc>(h)) return std::nullopt;
    return ucx::make_error_code(h.cast<ucx::errc>());
  });

  py::class_<ucx::remote_slice>(m, "RemoteSlice", "A range of a peer's region.")
      .def_readonly("address", &ucx::remote_slice::address)
      .def_readonly("length", &ucx::remote_slice::length)
      .def_readonly("region", &ucx::remote_slice::region);

  py::class_<ucx::remote_memory>(m, "RemoteMemory", "A peer's region imported on an endpoint.")
      .def_readonly("address", &ucx::remote_memory::address)
      .def_readonly("length", &ucx::remote_memory::length)
      .def_readonly("index", &ucx::remote_memory::index)
      .def("slice",
           [](const ucx::remote_memory& r, py::handle offset, py::handle length) {
             static constexpr const char* who = "ferry.ucx.RemoteMemory.slice";
             const std::size_t o = size_arg(offset, who, "offset");
             return r.slice(o, size_arg(length, who, "length"));
           },
           py::arg("offset"), py::arg("length"),
           "Raises IndexError when the range is not inside the region.");

  py::class_<py_local_slice>(m, "LocalSlice", "A range of a local region.")
      .def_readonly("offset", &py_local_slice::offset)
      .def_readonly("length", &py_local_slice::length);

  py::class_<py_region, std::shared_ptr<py_region>>(
      m, "MemoryRegion", py::buffer_protocol(),
      "Memory registered with (or allocated by) UCX. Supports the buffer protocol: "
      "memoryview(region) reads and writes its bytes.")
      .def_buffer([](py_region& r) {
        const std::span<std::byte> b = r.region.bytes();
        return py::buffer_info(b.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.size())}, {py::ssize_t{1}});
      })
      .def("__len__", [](const py_region& r) { return r.region.bytes().size(); })
      .def_property_readonly("allocated_by_ucx",
                             [](const py_region& r) { return r.region.allocated_by_ucx(); })
      .def("describe",
           [](const py_region& r) {
             const std::vector<std::byte> b = r.region.describe().to_bytes();
             return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           },
           "What a peer needs to reach this region, as bytes for the connector's own channel "
           "(Endpoint.import_region on the other side).")
      .def("slice",
           [](std::shared_ptr<py_region> r, py::handle offset_arg, py::handle length_arg) {
             static constexpr const char* who = "ferry.ucx.MemoryRegion.slice";
             const std::size_t offset = size_arg(offset_arg, who, "offset");
             const std::size_t length = size_arg(length_arg, who, "length");
             (void)r->region.slice(offset, length);  // checked now: IndexError when outside
             return py_local_slice{std::move(r), offset, length};
           },
           py::arg("offset"), py::arg("length"))
      .def("whole", [](std::shared_ptr<py_region> r) {
        const std::size_t n = r->region.bytes().size();
        return py_local_slice{std::move(r), 0, n};
      });

  py::class_<py_endpoint, std::shared_ptr<py_endpoint>>(
      m, "Endpoint",
      "An endpoint to one peer. A timeout (seconds; None: none) bounds a request: past it the "
      "endpoint is force-closed, which ends every request on it.")
      .def("peer_regions", [](const py_endpoint& e) { return e.endpoint.peer_regions(); },
           "The regions the peer exposed when connecting by host and port, in its order.")
      .def("import_region",
           [](py_endpoint& e, py::handle descriptor) {
             std::unique_ptr<held_buffer> hold;
             const ucx::remote_region r =
                 ucx::remote_region::from_bytes(bytes_of(descriptor, hold,
                                                         "ferry.ucx.Endpoint.import_region",
                                                         "descriptor"));
             py::gil_scoped_release released;
             return e.endpoint.import(r);
           },
           py::arg("descriptor"),
           "Imports a region a peer described (MemoryRegion.describe() bytes). Raises FerryError "
           "(Errc.bad_descriptor) for bytes that are not one.")
      .def_property_readonly("error",
                             [](const py_endpoint& e) { return error_or_none(e.endpoint.error()); })
      .def("put",
           [](py_endpoint& e, py::handle src_arg, py::handle dst_arg, py::handle timeout,
              py::handle completion) {
             static constexpr const char* who = "ferry.ucx.Endpoint.put";
             const py_local_slice& src = local_arg(src_arg, who, "src");
             const ucx::remote_slice& dst = remote_arg(dst_arg, who, "dst");
             const auto t = timeout_arg(timeout, who);
             const ucx::put_completion how = completion_of(completion, who);
             auto keep = keep_for(src);
             return py_transfer(e.endpoint.put(src.get(), dst, t, how), std::move(keep));
           },
           py::arg("src"), py::arg("dst"), py::arg("timeout") = py::none(),
           py::arg("completion") = "landed",
           "One-sided put; with completion='landed' it ends once the data is in the peer's memory.")
      .def("get",
           [](py_endpoint& e, py::handle dst_arg, py::handle src_arg, py::handle timeout) {
             static constexpr const char* who = "ferry.ucx.Endpoint.get";
             const py_local_slice& dst = local_arg(dst_arg, who, "dst");
             const ucx::remote_slice& src = remote_arg(src_arg, who, "src");
             const auto t = timeout_arg(timeout, who);
             auto keep = keep_for(dst);
             return py_transfer(e.endpoint.get(dst.get(), src, t), std::move(keep));
           },
           py::arg("dst"), py::arg("src"), py::arg("timeout") = py::none())
      .def("put_batch",
           [](py_endpoint& e, py::handle blocks, py::handle timeout, py::handle completion) {
             return rma_batch(e, blocks, timeout, true, completion);
           },
           py::arg("blocks"), py::arg("timeout") = py::none(), py::arg("completion") = "landed",
           "[(LocalSlice, RemoteSlice), ...] with one deadline; a list of Transfers.")
      .def("get_batch",
           [](py_endpoint& e, py::handle blocks, py::handle timeout) {
             return rma_batch(e, blocks, timeout, false, py::none());
           },
           py::arg("blocks"), py::arg("timeout") = py::none())
      .def("send_notification",
           [](py_endpoint& e, py::handle value, py::handle timeout) {
             static constexpr const char* who = "ferry.ucx.Endpoint.send_notification";
             const auto v = int_arg<std::uint64_t>(value, who, "value");
             return py_transfer(e.endpoint.send_notification(v, timeout_arg(timeout, who)));
           },
           py::arg("value"), py::arg("timeout") = py::none(),
           "Sent once every put before it on this endpoint has landed.")
      .def("receive_notification",
           [](py_endpoint& e, py::handle timeout) {
             const auto deadline = timeout_arg(timeout, "ferry.ucx.Endpoint.receive_notification");
             auto keep = std::make_shared<keep_alive>();
             keep->reports_value = true;
             // The transfer is made first: the keep-alive it writes into is moved afterwards.
             transfer t = e.endpoint.receive_notification(keep->value, deadline);
             return py_transfer(std::move(t), std::move(keep));
           },
           py::arg("timeout") = py::none(),
           "The next notification the peer sent; .value once it succeeded.")
      .def("close",
           [](py_endpoint& e) {
             py::gil_scoped_release released;
             e.endpoint.close();
           },
           "Closes the endpoint: later requests fail with Errc.endpoint_closed; those already out "
           "get until the worker's close_timeout (default 5 s) to end, then are failed with it.");

  py::class_<py_listener, std::shared_ptr<py_listener>>(m, "Listener")
      .def_property_readonly("port", [](const py_listener& l) { return l.listener->port(); })
      .def("accept",
           [](py_listener& l, py::handle timeout) {
             const auto t = connect_timeout(timeout, "ferry.ucx.Listener.accept");
             auto e = std::make_shared<py_endpoint>();
             e->worker = l.worker;
             py::gil_scoped_release released;
             e->endpoint = l.listener->accept(t);
             return e;
           },
           py::arg("timeout") = py::none(),
           "The next peer that connected and told its regions; waits (GIL released) up to "
           "timeout seconds (default 10).");

  py::class_<py_worker, std::shared_ptr<py_worker>>(
      m, "Worker", "A UCX context and worker, progressed by the executor alone.")
      .def(py::init([](py::handle executor, py::handle transports, py::handle devices,
                       py::handle peer_error_handling, py::handle keepalive, py::handle settings,
                       py::handle close_timeout) {
             static constexpr const char* who = "ferry.ucx.Worker";
             std::shared_ptr<progress_executor> exec = executor_arg(executor, who);
             ucx::worker_options o;
             o.transports = str_arg(transports, who, "transports");
             o.devices = str_arg(devices, who, "devices");
             o.peer_error_handling = bool_arg(peer_error_handling, who, "peer_error_handling");
             if (!keepalive.is_none()) {
               o.keepalive = std::chrono::duration_cast<std::chrono::milliseconds>(
                   duration_arg(keepalive, who, "keepalive"));
             }
             if (!close_timeout.is_none()) {
               o.close_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
                   duration_arg(close_timeout, who, "close_timeout"));
             }
             if (!settings.is_none()) {
               // {"UCX_NAME": "value"}: a dict of str to str (a list was silently ignored).
               if (!PyDict_Check(settings.ptr())) {
                 throw_type_error(who, "settings", "a dict of str to str or None", settings);
               }
               for (auto item : py::reinterpret_borrow<py::dict>(settings)) {
                 const std::string key = str_arg(item.first, who, "a settings key");
                 const std::string what = "settings['" + key + "']";
                 o.settings.emplace_back(key, str_arg(item.second, who, what));
               }
             }
             auto w = std::make_shared<py_worker>();
             {
               py::gil_scoped_release released;
               w->worker = std::make_unique<ucx::worker>(*exec, std::move(o));
             }
             w->exec = std::move(exec);
             return w;
           }),
           py::arg("executor"), py::arg("transports") = "tcp,shm", py::arg("devices") = "",
           py::arg("peer_error_handling") = true, py::arg("keepalive") = py::none(),
           py::arg("settings") = py::none(), py::arg("close_timeout") = py::none())
      .def("address",
           [](const py_worker& w) {
             const std::vector<std::byte> a = w.worker->address();
             return py::bytes(reinterpret_cast<const char*>(a.data()), a.size());
           },
           "This worker's address, as bytes for the connector's own channel (connect() on the "
           "peer).")
      .def("register_memory",
           [](py_worker& w, py::handle buffer) {
             auto r = std::make_shared<py_region>();
             r->buffer = std::make_unique<held_buffer>(
                 buffer, true, "ferry.ucx.Worker.register_memory", "buffer");
             r->region = w.worker->register_memory(r->buffer->bytes());
             return r;
           },
           py::arg("buffer"),
           "Registers a writable buffer (held while the region or a transfer using it lives).")
      .def("allocate",
           [](py_worker& w, py::handle nbytes) {
             const std::size_t n = size_arg(nbytes, "ferry.ucx.Worker.allocate", "nbytes", 1);
             auto r = std::make_shared<py_region>();
             r->region = w.worker->allocate(n);
             return r;
           },
           py::arg("nbytes"), "Memory UCX allocates (reached directly over shared memory).")
      .def("connect",
           [](std::shared_ptr<py_worker> w, py::handle address) {
             std::unique_ptr<held_buffer> hold;
             const std::span<const std::byte> a =
                 bytes_of(address, hold, "ferry.ucx.Worker.connect", "address");
             auto e = std::make_shared<py_endpoint>();
             e->worker = w;
             py::gil_scoped_release released;
             e->endpoint = w->worker->connect(a);
             return e;
           },
           py::arg("address"), "An endpoint to the peer whose address() bytes were carried over.")
      .def("connect_to",
           [](std::shared_ptr<py_worker> w, py::handle host_arg, py::handle port,
              py::handle expose, py::handle timeout) {
             static constexpr const char* who = "ferry.ucx.Worker.connect_to";
             const std::string host = str_arg(host_arg, who, "host");
             const std::uint16_t p = port_arg(port, who);
             const std::vector<ucx::memory_region> regions = regions_of(expose, who);
             const auto t = connect_timeout(timeout, who);
             auto e = std::make_shared<py_endpoint>();
             e->worker = w;
             py::gil_scoped_release released;
             e->endpoint = w->worker->connect(host, p, regions, t);
             return e;
           },
           py::arg("host"), py::arg("port"), py::arg("expose") = py::none(),
           py::arg("timeout") = py::none(),
           "Connects to a Listener at host:port, telling the peer the regions in `expose`.")
      .def("listen",
           [](std::shared_ptr<py_worker> w, py::handle host_arg, py::handle port,
              py::handle expose) {
             static constexpr const char* who = "ferry.ucx.Worker.listen";
             const std::string host = str_arg(host_arg, who, "host");
             const std::uint16_t p = port_arg(port, who);
             const std::vector<ucx::memory_region> regions = regions_of(expose, who);
             auto l = std::make_shared<py_listener>();
             l->worker = w;
             py::gil_scoped_release released;
             l->listener.emplace(w->worker->listen(host, p, regions));
             return l;
           },
           py::arg("host"), py::arg("port") = 0, py::arg("expose") = py::none());
}

}  // namespace ferry::python
