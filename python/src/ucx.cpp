// ferry.ucx: one-sided get and put between processes over whatever UCX finds, with region
// descriptors and worker addresses as bytes for the connector's own side channel. Endpoints and
// listeners keep their worker alive, workers their executor; a transfer keeps the local region it
// reads or writes (and the buffer under a registered one) until it has ended.

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <cmath>

#include "common.hpp"
#include "directory_binding.hpp"
#include "ferry/kv/connector.hpp"
#include "ferry/kv/ucx_link.hpp"
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

void add_kv_ucx(py::module_& parent);

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
           "get until the worker's close_timeout (default 5 s) to end, then are failed with it.")
      .def("sever",
           [](py_endpoint& e, py::handle why) {
             e.endpoint.sever(error_from(why, "ferry.ucx.Endpoint.sever", "why"));
           },
           py::arg("why"),
           "Ends the endpoint at once: every request on it, out or later, fails with `why` (a "
           "ferry.Error or an Errc value). Does not wait.");

  // NamedPeer: an endpoint to the peer published under a name, bound to its incarnation (the
  // C++ named_peer). `connect(record)` is Python, called on the thread of get() with the GIL; the
  // fence (severing the endpoint when the directory shows a new incarnation or the name gone) is
  // C++ only, on whichever thread delivers the change.
  struct py_named_peer {
    std::shared_ptr<py_directory> dir;
    py::object connect;
    std::shared_ptr<py_worker> worker;  // the last endpoint's, for the handles get() returns
    std::unique_ptr<named_peer<ucx::endpoint>> peer;
    ~py_named_peer() {
      py::gil_scoped_release released;
      peer.reset();
    }
  };
  py::class_<py_named_peer, std::shared_ptr<py_named_peer>>(
      m, "NamedPeer",
      "An Endpoint to the peer published under a name in a ferry.directory, bound to its "
      "incarnation: a new incarnation or the name going severs it at once (its transfers fail "
      "with directory Errc.peer_restarted or Errc.peer_gone); the next get() connects afresh.")
      .def(py::init([](py::handle directory, py::handle name, py::handle connect) {
             static constexpr const char* who = "ferry.ucx.NamedPeer";
             auto p = std::make_shared<py_named_peer>();
             p->dir = shared_arg<py_directory>(directory, who, "directory",
                                               "a ferry.directory.Directory");
             p->connect = callable_arg(connect, who, "connect");
             const std::string n = str_arg(name, who, "name");
             std::weak_ptr<py_named_peer> weak = p;
             p->peer = std::make_unique<named_peer<ucx::endpoint>>(
                 p->dir->get(), n, [weak](const directory_record& r) -> ucx::endpoint {
                   py::gil_scoped_acquire held;
                   auto self = weak.lock();
                   if (!self) throw std::logic_error("ferry.ucx.NamedPeer: gone");
                   py::object made = self->connect(py::cast(r));
                   auto& e = object_arg<py_endpoint>(made, "ferry.ucx.NamedPeer connect",
                                                     "its result", "a ferry.ucx.Endpoint");
                   self->worker = e.worker;
                   return e.endpoint;
                 });
             return p;
           }),
           py::arg("directory"), py::arg("name"), py::arg("connect"))
      .def(
          "get",
          [](py_named_peer& p, py::handle timeout) {
            const auto t = timeout_arg(timeout, "ferry.ucx.NamedPeer.get");
            ucx::endpoint ep;
            {
              py::gil_scoped_release released;
              ep = p.peer->get(t.count() < 0
                                   ? std::chrono::nanoseconds(-1)
                                   : std::chrono::duration_cast<std::chrono::nanoseconds>(t));
            }
            return std::make_shared<py_endpoint>(py_endpoint{p.worker, std::move(ep)});
          },
          py::arg("timeout") = 5.0,
          "The Endpoint to the current incarnation (looked up and connected when there is none).")
      .def_property_readonly("incarnation", [](const py_named_peer& p) { return p.peer->incarnation(); })
      .def_property_readonly("fenced",
                             [](const py_named_peer& p) { return error_or_none(p.peer->fenced()); })
      .def_property_readonly("connects", [](const py_named_peer& p) { return p.peer->connects(); });

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

  add_kv_ucx(parent);
}

// ferry.kv over UCX: the link, pull and its releases, push. Objects the C++ API takes by reference
// (the link, the ledger, the receiver, a pushed request's plan) are held by whoever uses them: a
// release function holds its link, an awaited task what it refers to, a transfer its link.
namespace {

struct py_link {
  std::shared_ptr<py_endpoint> ep;                  // keeps the worker; Endpoint.close ends it
  std::vector<std::shared_ptr<py_region>> regions;  // this side's, held as long as the link
  std::optional<kv::ucx_link> link;
};

std::shared_ptr<py_link> link_arg(py::handle h, const char* who) {
  return shared_arg<py_link>(h, who, "link", "a ferry.kv.UcxLink");
}

// A kv timeout: None, negative or infinite waits forever; otherwise seconds (or a timedelta).
std::chrono::nanoseconds kv_timeout(py::handle h, const char* who) {
  const double s = timeout_arg(h, who).count();
  if (s < 0.0 || std::isinf(s)) return std::chrono::nanoseconds(-1);
  if (s > 9.2e9) throw py::value_error(std::string(who) + ": timeout is too long");
  return std::chrono::round<std::chrono::nanoseconds>(std::chrono::duration<double>(s));
}

std::vector<std::shared_ptr<py_region>> local_regions_arg(py::handle h, const char* who) {
  std::vector<std::shared_ptr<py_region>> out;
  for (py::handle r : iterable_arg(h, who, "local_regions",
                                   "a list of ferry.ucx.MemoryRegion, one per region number")) {
    out.push_back(shared_arg<py_region>(r, who, item_name("local_regions", out.size()),
                                        "a ferry.ucx.MemoryRegion"));
  }
  return out;
}

std::shared_ptr<py_link> make_link(const std::shared_ptr<py_endpoint>& ep,
                                   std::vector<std::shared_ptr<py_region>> regions,
                                   const kv::engine_description* peer) {
  auto l = std::make_shared<py_link>();
  l->ep = ep;
  l->regions = std::move(regions);
  std::vector<ucx::memory_region> local;
  for (const auto& r : l->regions) local.push_back(r->region);
  py::gil_scoped_release released;
  if (peer != nullptr) {
    l->link.emplace(kv::ucx_link::to_peer(ep->endpoint, std::move(local), *peer));
  } else {
    l->link.emplace(ep->endpoint, std::move(local), ep->endpoint.peer_regions());
  }
  return l;
}

// Transfers that read or write the link's local regions: dropped at once, each still pending hands
// the link (its regions, their buffers) to the orphan list until it ends.
void guard(const std::shared_ptr<py_link>& l, std::span<const transfer> ts) {
  auto keep = std::make_shared<keep_alive>();
  keep->objects.push_back(py::cast(l));
  for (const transfer& t : ts) {
    const py_transfer guarded(t, keep);
  }
}

struct py_pushed {
  std::shared_ptr<py_link> link;
  std::unique_ptr<kv::transfer_plan> plan;
  std::optional<kv::pushed_request<kv::ucx_link>> request;
  std::vector<bool> written;
  bool finishing = false;
};

constexpr std::uint64_t max_request_id = kv::push_notice::failed_bit - 1;

}  // namespace

void add_kv_ucx(py::module_& parent) {
  py::module_ m = parent.attr("kv").cast<py::module_>();

  py::class_<py_link, std::shared_ptr<py_link>>(
      m, "UcxLink",
      "A peer engine over a ferry.ucx.Endpoint, by region number: local_regions[r] is this "
      "side's region r, the peer's come from its EngineDescription (UcxLink(...)) or from the "
      "regions it exposed when it connected (UcxLink.from_peer_regions). One engine thread uses "
      "a link; close its endpoint to end the receive loops on it.")
      .def(py::init([](py::handle endpoint, py::handle local_regions, py::handle peer) {
             static constexpr const char* who = "ferry.kv.UcxLink";
             auto ep = shared_arg<py_endpoint>(endpoint, who, "endpoint", "a ferry.ucx.Endpoint");
             auto regions = local_regions_arg(local_regions, who);
             const auto& d = object_arg<kv::engine_description>(
                 peer, who, "peer_description", "a ferry.kv.EngineDescription");
             return make_link(ep, std::move(regions), &d);
           }),
           py::arg("endpoint"), py::arg("local_regions"), py::arg("peer_description"),
           "Imports every region the peer's description names on the endpoint (the consumer's "
           "side of a handshake).")
      .def_static(
          "from_peer_regions",
          [](py::handle endpoint, py::handle local_regions) {
            static constexpr const char* who = "ferry.kv.UcxLink.from_peer_regions";
            auto ep = shared_arg<py_endpoint>(endpoint, who, "endpoint", "a ferry.ucx.Endpoint");
            return make_link(ep, local_regions_arg(local_regions, who), nullptr);
          },
          py::arg("endpoint"), py::arg("local_regions"),
          "The peer's regions are those it exposed when it connected by host and port "
          "(Endpoint.peer_regions(), in its region order): the producer's side of an accept.")
      .def_property_readonly("endpoint", [](const py_link& l) { return l.ep; });

  m.def(
      "pull",
      [](py::handle link, py::handle plan, py::handle dst_layout, py::handle groups,
         py::handle tracker, py::handle request, py::handle timeout) {
        static constexpr const char* who = "ferry.kv.pull";
        const auto l = link_arg(link, who);
        const auto& p = object_arg<kv::transfer_plan>(plan, who, "plan", "a ferry.kv.TransferPlan");
        const auto& layout =
            object_arg<kv::cache_layout>(dst_layout, who, "dst_layout", "a ferry.kv.CacheLayout");
        const block_tables t = tables_arg(groups, who, "groups");
        kv::load_tracker& tr = tracker_arg(tracker, who, "tracker");
        const auto& h = object_arg<kv::load_tracker::request_handle>(
            request, who, "request", "a ferry.kv.RequestHandle (add_request's)");
        const auto ns = kv_timeout(timeout, who);
        kv::pull(*l->link, p, layout, t.pairs, tr, h, ns);
        for (std::size_t layer = 0; layer < p.layers.size(); ++layer) {
          if (!p.layers[layer].empty()) guard(l, tr.layer_transfers(layer));
        }
      },
      py::arg("link"), py::arg("plan"), py::arg("dst_layout"), py::arg("groups"),
      py::arg("tracker"), py::arg("request"), py::arg("timeout") = py::none(),
      "Reads every layer of the request with `plan` over the link and adds each layer's "
      "transfers to `tracker` under `request` (the layer's destination blocks from `groups`). "
      "The caller seals the request. timeout bounds each read.");

  m.def(
      "release_to",
      [](py::handle link, py::handle timeout) {
        static constexpr const char* who = "ferry.kv.release_to";
        const auto l = link_arg(link, who);
        const auto ns = kv_timeout(timeout, who);
        return py::cpp_function(
            [l, ns](py::handle id, py::handle) {
              const auto rid = int_arg<std::uint64_t>(id, "ferry.kv.release_to(...)", "id");
              (void)l->link->notify(rid, ns);
            },
            py::arg("id"), py::arg("verdict"));
      },
      py::arg("link"), py::arg("timeout") = py::none(),
      "The release function for a consumer's LoadTracker (LoadTracker(release=...)): tells the "
      "producer behind the link that a request is done with, so that its serve_releases "
      "acknowledges it. Holds the link.");

  m.def(
      "serve_releases",
      [](py::handle link, py::handle ledger, py::handle rank) {
        static constexpr const char* who = "ferry.kv.serve_releases";
        const auto l = link_arg(link, who);
        auto& lg = object_arg<kv::release_ledger>(ledger, who, "ledger", "a ferry.kv.ReleaseLedger");
        const auto r = int_arg<kv::rank_id>(rank, who, "rank");
        auto t = std::make_shared<py_task>();
        t->who = who;
        auto out = std::make_shared<std::optional<std::error_code>>();
        kv::ucx_link* lp = &*l->link;
        kv::release_ledger* lgp = &lg;
        t->make = [lp, lgp, r, out] { return store_result(kv::serve_releases(*lp, *lgp, r), out); };
        t->result = [out] { return error_or_none(out->value_or(std::error_code())); };
        t->keep = {py::cast(l), py::reinterpret_borrow<py::object>(ledger)};
        return t;
      },
      py::arg("link"), py::arg("ledger"), py::arg("rank"),
      "Awaitable (on the producer): acknowledges in `ledger`, as consumer `rank`, every release "
      "the consumer behind the link sends, until the link fails or its endpoint is closed; the "
      "await then returns that error (a ferry.Error). Runs on the awaiting loop's thread.");

  py::class_<py_pushed, std::shared_ptr<py_pushed>>(
      m, "PushedRequest",
      "Push, on the producer: one request written to one consumer layer by layer "
      "(layer_computed), then confirmed with one notification (await finish()).")
      .def(py::init([](py::handle link, py::handle request_id, py::handle plan,
                       py::handle timeout) {
             static constexpr const char* who = "ferry.kv.PushedRequest";
             auto p = std::make_shared<py_pushed>();
             p->link = link_arg(link, who);
             const auto id = int_arg<std::uint64_t>(request_id, who, "request_id", 0,
                                                    max_request_id);
             p->plan = std::make_unique<kv::transfer_plan>(
                 object_arg<kv::transfer_plan>(plan, who, "plan", "a ferry.kv.TransferPlan"));
             const auto ns = kv_timeout(timeout, who);
             p->request.emplace(*p->link->link, id, *p->plan, ns);
             p->written.assign(p->plan->layers.size(), false);
             return p;
           }),
           py::arg("link"), py::arg("request_id"), py::arg("plan"),
           py::arg("timeout") = py::none(), "timeout bounds each write and the notification.")
      .def(
          "layer_computed",
          [](const std::shared_ptr<py_pushed>& p, py::handle layer) {
            static constexpr const char* who = "ferry.kv.PushedRequest.layer_computed";
            const std::size_t l = size_arg(layer, who, "layer");
            if (l >= p->written.size()) {
              throw py::value_error(std::string(who) + ": layer " + std::to_string(l) +
                                    " is not below the plan's " +
                                    std::to_string(p->written.size()) + " layers");
            }
            if (p->written[l]) {
              throw std::runtime_error(std::string(who) + ": layer " + std::to_string(l) +
                                       " was written already");
            }
            const std::size_t before = p->request->writes().size();
            p->request->layer_computed(l);
            p->written[l] = true;
            guard(p->link, p->request->writes().subspan(before));
          },
          py::arg("layer"), "Writes layer `layer`'s ranges now; each layer once.")
      .def(
          "finish",
          [](const std::shared_ptr<py_pushed>& p) {
            static constexpr const char* who = "ferry.kv.PushedRequest.finish";
            for (std::size_t l = 0; l < p->written.size(); ++l) {
              if (!p->written[l]) {
                throw std::runtime_error(std::string(who) + ": layer " + std::to_string(l) +
                                         " was never written (layer_computed)");
              }
            }
            if (p->finishing) throw std::runtime_error(std::string(who) + ": called already");
            p->finishing = true;
            auto t = std::make_shared<py_task>();
            t->who = who;
            auto out = std::make_shared<std::optional<batch_result>>();
            kv::pushed_request<kv::ucx_link>* r = &*p->request;
            t->make = [r, out] { return store_result(r->finish(), out); };
            t->result = [out] { return py::cast(**out); };
            t->keep = {py::cast(p)};
            return t;
          },
          "Awaitable: once every write has ended, tells the consumer whether they all landed "
          "(one notification); returns the writes' BatchResult. The notification is notice.")
      .def_property_readonly(
          "writes",
          [](const py_pushed& p) {
            const auto w = p.request->writes();
            return batch{std::vector<transfer>(w.begin(), w.end())};
          },
          "Every write so far, as a Batch: the source blocks are in use until each is terminal.")
      .def_property_readonly("notice",
                             [](const py_pushed& p) { return py_transfer(p.request->notice()); })
      .def_property_readonly("id", [](const py_pushed& p) { return p.request->id(); });

  py::class_<kv::push_receiver, std::shared_ptr<kv::push_receiver>>(
      m, "PushReceiver",
      "Push, on the consumer: tracks pushed requests in a LoadTracker (one transfer per layer), "
      "ended by the producer's notifications, which `await receive(link)` takes. Give the "
      "tracker cancel as its cancel function (LoadTracker(cancel=receiver.cancel)) so that a "
      "request whose notification never comes fails by its abort_timeout.")
      .def(py::init([] { return std::make_shared<kv::push_receiver>(); }))
      .def(
          "expect",
          [](kv::push_receiver& r, py::handle tracker, py::handle request, py::handle id,
             py::handle dst_layout, py::handle groups) {
            static constexpr const char* who = "ferry.kv.PushReceiver.expect";
            kv::load_tracker& tr = tracker_arg(tracker, who, "tracker");
            const auto& h = object_arg<kv::load_tracker::request_handle>(
                request, who, "request", "a ferry.kv.RequestHandle (add_request's)");
            const auto rid = int_arg<std::uint64_t>(id, who, "id", 0, max_request_id);
            const auto& layout = object_arg<kv::cache_layout>(dst_layout, who, "dst_layout",
                                                              "a ferry.kv.CacheLayout");
            const block_tables t = tables_arg(groups, who, "groups");
            r.expect(tr, h, rid, layout, t.pairs);
          },
          py::arg("tracker"), py::arg("request"), py::arg("id"), py::arg("dst_layout"),
          py::arg("groups"),
          "Expects request `id` (added to the tracker as `request`): one transfer per layer, "
          "ended by the producer's notification. The caller seals the request.")
      .def(
          "cancel",
          [](kv::push_receiver& r, py::handle t) {
            r.cancel(transfer_arg(t, "ferry.kv.PushReceiver.cancel").t);
          },
          py::arg("transfer"), "The tracker's cancel function.")
      .def(
          "receive",
          [](const std::shared_ptr<kv::push_receiver>& r, py::handle link) {
            static constexpr const char* who = "ferry.kv.PushReceiver.receive";
            const auto l = link_arg(link, who);
            auto t = std::make_shared<py_task>();
            t->who = who;
            auto out = std::make_shared<std::optional<std::error_code>>();
            kv::ucx_link* lp = &*l->link;
            kv::push_receiver* rp = r.get();
            t->make = [lp, rp, out] { return store_result(rp->receive(*lp), out); };
            t->result = [out] { return error_or_none(out->value_or(std::error_code())); };
            t->keep = {py::cast(r), py::cast(l)};
            return t;
          },
          py::arg("link"),
          "Awaitable: takes the producer's notifications and ends the requests they name, until "
          "the link fails or its endpoint is closed; then every request still expected fails "
          "with that error, which the await returns. Runs on the awaiting loop's thread.")
      .def_property_readonly("expected", &kv::push_receiver::expected)
      .def_property_readonly("stale", &kv::push_receiver::stale)
      .def_property_readonly("draining", &kv::push_receiver::draining,
                             "Requests that timed out and wait for their late notice (or the "
                             "link's failure) before the tracker lets go of their blocks.");
}

}  // namespace ferry::python
