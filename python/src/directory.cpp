// ferry.directory: peers by name. LocalDirectory (in-process, on a LocalRegistry) and EtcdDirectory
// (etcd v3, where the module was built with libcurl and nlohmann-json) publish this engine's record
// under a name with a lease the executor keeps alive, look names up (one or many at once), and
// watch names come and go. Every call that waits returns a pending object: `await` it on asyncio
// (python/ferry/_directory.py: it awaits the pending's `made` Transfer, which resumes on the loop's
// thread, then takes the value), or get() it (the GIL released while it waits).
//
// Nothing here runs Python on the executor's thread: the directory's work (HTTP to etcd, leases,
// watch events) touches C++ objects only, and values become Python objects in get(), with the GIL.

#include "common.hpp"
#include "directory_binding.hpp"
#include "ferry/directory.hpp"
#ifdef FERRY_PYTHON_ETCD
#include "ferry/directory/etcd.hpp"
#endif

namespace ferry::python {

namespace {

py::bytes bytes_of_value(const std::vector<std::byte>& v) {
  return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
}

std::vector<std::byte> value_arg(py::handle h, const char* who) {
  held_buffer b(h, false, who, "value");
  return {b.bytes().begin(), b.bytes().end()};
}

std::vector<std::byte> value_arg_or_empty(py::handle h, const char* who) {
  if (PyBytes_Check(h.ptr()) && PyBytes_GET_SIZE(h.ptr()) == 0) return {};
  if (PyByteArray_Check(h.ptr()) && PyByteArray_GET_SIZE(h.ptr()) == 0) return {};
  return value_arg(h, who);
}

// A pending value as Python sees it: `made` (a Transfer), get(timeout), ready.
template <class T>
struct py_pending {
  pending_result<T> pending;
  std::string who;
};

template <class T, class Convert>
void bind_pending(py::module_& m, const char* name, const char* doc, Convert convert) {
  py::class_<py_pending<T>, std::shared_ptr<py_pending<T>>>(m, name, doc)
      .def_property_readonly("made",
                             [](const py_pending<T>& p) { return py_transfer(p.pending.made()); },
                             "A ferry.Transfer that ends when the value is made or could not be.")
      .def_property_readonly("ready", [](const py_pending<T>& p) { return p.pending.ready(); })
      .def(
          "get",
          [convert](py_pending<T>& p, py::handle timeout) -> py::object {
            const auto t = timeout_arg(timeout, p.who + ".get");
            const transfer& made = p.pending.made();
            const transfer_state s = wait_released(
                t, [&](std::chrono::nanoseconds slice) { return made.wait_for(slice); },
                [](transfer_state x) { return x != transfer_state::pending; });
            if (s == transfer_state::pending) {
              raise_with_error(exception_types().ferry_error,
                               p.who + ": not made within the timeout",
                               make_error_code(directory_errc::deadline_exceeded));
            }
            return convert(p.pending.get());  // FerryError when it failed
          },
          py::arg("timeout") = py::none(),
          "The value: waits (the GIL released) up to `timeout` seconds (None: as long as it takes). "
          "Raises FerryError with .error a ferry.directory.Errc saying what failed. Taken once.");
}

py::object record_to_py(directory_record r) { return py::cast(std::move(r)); }

std::string name_arg(py::handle h, const char* who, const char* what) {
  return str_arg(h, who, what);
}

}  // namespace

void add_directory(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "directory",
      "Peers by name: publish this engine's record with a lease the executor keeps alive, look "
      "names up, watch them come and go (LocalDirectory in-process; EtcdDirectory on etcd v3).");

  const auto errc_type =
      py::enum_<directory_errc>(m, "Errc", "The directory's error codes (category 'ferry.directory').")
          .value("bad_name", directory_errc::bad_name)
          .value("record_too_large", directory_errc::record_too_large)
          .value("bad_record", directory_errc::bad_record)
          .value("not_found", directory_errc::not_found)
          .value("unavailable", directory_errc::unavailable)
          .value("deadline_exceeded", directory_errc::deadline_exceeded)
          .value("closed", directory_errc::closed)
          .value("lease_lost", directory_errc::lease_lost)
          .value("peer_restarted", directory_errc::peer_restarted)
          .value("peer_gone", directory_errc::peer_gone)
          .value("watch_overflowed", directory_errc::watch_overflowed)
          .value("service_error", directory_errc::service_error);
  register_errc(errc_type, [](py::handle h) -> std::optional<std::error_code> {
    if (!py::isinstance<directory_errc>(h)) return std::nullopt;
    return make_error_code(h.cast<directory_errc>());
  });

  py::class_<directory_record>(m, "Record", "What is published under a name.")
      .def_readonly("name", &directory_record::name)
      .def_readonly("incarnation", &directory_record::incarnation,
                    "Grows with each publication under the name; never 0.")
      .def_property_readonly("value",
                             [](const directory_record& r) { return bytes_of_value(r.value); })
      .def("__repr__", [](const directory_record& r) {
        return "ferry.directory.Record(name=" + py::repr(py::str(r.name)).cast<std::string>() +
               ", incarnation=" + std::to_string(r.incarnation) + ", " +
               std::to_string(r.value.size()) + " bytes)";
      });

  py::class_<directory_event>(m, "Event", "A change under a watched name or prefix.")
      .def_property_readonly("kind",
                             [](const directory_event& e) {
                               return e.what == directory_event::kind::published ? "published"
                                                                                 : "gone";
                             },
                             "'published' (a record, .record) or 'gone' (withdrawn or its lease "
                             "expired; .record has the name and the incarnation that went)")
      .def_readonly("record", &directory_event::record);

  py::class_<lookup_result>(m, "LookupResult", "One name's outcome in a lookup of many.")
      .def_readonly("name", &lookup_result::name)
      .def_property_readonly("record",
                             [](const lookup_result& r) -> py::object {
                               return r.record ? py::cast(*r.record) : py::none();
                             })
      .def_property_readonly("error",
                             [](const lookup_result& r) { return error_or_none(r.error); })
      .def_readonly("message", &lookup_result::message);

  bind_pending<publication>(m, "PendingPublication", "A publication being made; await it.",
                            [](publication p) -> py::object {
                              return py::cast(std::make_shared<publication>(std::move(p)));
                            });
  bind_pending<directory_record>(m, "PendingRecord", "A lookup under way; await it.",
                                 &record_to_py);
  bind_pending<std::vector<lookup_result>>(m, "PendingLookups",
                                           "A lookup of many names under way; await it.",
                                           [](std::vector<lookup_result> v) -> py::object {
                                             return py::cast(std::move(v));
                                           });
  bind_pending<directory_event>(m, "PendingEvent", "A watcher's next change; await it.",
                                [](directory_event e) -> py::object {
                                  return py::cast(std::move(e));
                                });

  py::class_<publication, std::shared_ptr<publication>>(
      m, "Publication",
      "A record published under a name, its lease renewed by the directory's executor until "
      "withdrawn (withdraw(), close(), the with block's end, or the object going).")
      .def_property_readonly("name", &publication::name)
      .def_property_readonly("incarnation", &publication::incarnation)
      .def_property_readonly("health",
                             [](const publication& p) { return error_or_none(p.health()); },
                             "None while the lease is held; else why not (Errc.lease_lost, "
                             "Errc.unavailable).")
      .def_property_readonly("republished", &publication::republished)
      .def(
          "withdraw",
          [](publication& p, py::handle timeout) {
            const auto t = timeout_arg(timeout, "ferry.directory.Publication.withdraw");
            return py_transfer(
                p.withdraw(std::chrono::duration_cast<std::chrono::nanoseconds>(t)));
          },
          py::arg("timeout") = 5.0, "Withdraws the name; a Transfer that ends once it is done.")
      .def("close", [](publication& p) { p = publication(); }, "Withdraws without waiting.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](publication& p, py::args) { p = publication(); });

  py::class_<watcher, std::shared_ptr<watcher>>(
      m, "Watcher", "Every change under a name or prefix, in order; close() ends it.")
      .def(
          "next",
          [](watcher& w, py::handle timeout) {
            const auto t = timeout_arg(timeout, "ferry.directory.Watcher.next");
            auto p = std::make_shared<py_pending<directory_event>>();
            p->who = "ferry.directory.Watcher.next";
            p->pending = w.next(t.count() < 0 ? std::chrono::nanoseconds(-1)
                                              : std::chrono::duration_cast<std::chrono::nanoseconds>(t));
            return p;
          },
          py::arg("timeout") = py::none(),
          "The next change, waiting up to `timeout` seconds (None: no deadline): a PendingEvent.")
      .def("try_next",
           [](watcher& w) -> py::object {
             auto e = w.try_next();
             return e ? py::cast(std::move(*e)) : py::none();
           })
      .def("close", [](watcher& w) { w = watcher(); })
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](watcher& w, py::args) { w = watcher(); });

  py::class_<local_registry, std::shared_ptr<local_registry>>(
      m, "LocalRegistry",
      "The in-process store LocalDirectory clients share (records, incarnations, leases).")
      .def(py::init<>())
      .def_static("process_wide", &local_registry::process_wide)
      .def(
          "put_raw",
          [](local_registry& r, py::handle name, py::handle bytes) {
            static constexpr const char* who = "ferry.directory.LocalRegistry.put_raw";
            r.put_raw(name_arg(name, who, "name"), value_arg_or_empty(bytes, who));
          },
          py::arg("name"), py::arg("value"),
          "Writes bytes under a name as they are (for tests of what readers refuse).")
      .def_property_readonly("leases", &local_registry::leases);

  py::class_<py_directory, std::shared_ptr<py_directory>>(
      m, "Directory",
      "Peers by name (LocalDirectory, EtcdDirectory). Every method may be called from any thread.")
      .def(
          "publish",
          [](py_directory& d, py::handle name, py::handle value, py::handle lease,
             py::handle timeout) {
            static constexpr const char* who = "ferry.directory.Directory.publish";
            const std::string n = name_arg(name, who, "name");
            const std::vector<std::byte> v = value_arg_or_empty(value, who);
            publish_options o;
            o.lease = std::chrono::duration_cast<std::chrono::milliseconds>(
                duration_arg(lease, who, "lease"));
            if (o.lease.count() <= 0) {
              throw py::value_error(std::string(who) + ": lease must be at least a millisecond");
            }
            const auto t = timeout_arg(timeout, who);
            o.timeout = t.count() < 0 ? std::chrono::nanoseconds(-1)
                                      : std::chrono::duration_cast<std::chrono::nanoseconds>(t);
            auto p = std::make_shared<py_pending<publication>>();
            p->who = who;
            p->pending = d.get().publish(n, v, o);
            return p;
          },
          py::arg("name"), py::arg("value"), py::arg("lease") = 5.0, py::arg("timeout") = 10.0,
          "Publishes `value` (bytes-like) under `name` with a lease of `lease` seconds: a "
          "PendingPublication.")
      .def(
          "lookup",
          [](py_directory& d, py::handle name, py::handle timeout) {
            static constexpr const char* who = "ferry.directory.Directory.lookup";
            const std::string n = name_arg(name, who, "name");
            const auto t = timeout_arg(timeout, who);
            auto p = std::make_shared<py_pending<directory_record>>();
            p->who = who;
            p->pending = d.get().lookup(
                n, t.count() < 0 ? std::chrono::nanoseconds(-1)
                                 : std::chrono::duration_cast<std::chrono::nanoseconds>(t));
            return p;
          },
          py::arg("name"), py::arg("timeout") = 5.0, "The record under `name`: a PendingRecord.")
      .def(
          "lookup_many",
          [](py_directory& d, py::handle names, py::handle timeout) {
            static constexpr const char* who = "ferry.directory.Directory.lookup_many";
            std::vector<std::string> ns;
            for (py::handle h : iterable_arg(names, who, "names", "an iterable of str")) {
              ns.push_back(str_arg(h, who, item_name("names", ns.size())));
            }
            const auto t = timeout_arg(timeout, who);
            auto p = std::make_shared<py_pending<std::vector<lookup_result>>>();
            p->who = who;
            p->pending = d.get().lookup(
                std::move(ns), t.count() < 0 ? std::chrono::nanoseconds(-1)
                                             : std::chrono::duration_cast<std::chrono::nanoseconds>(t));
            return p;
          },
          py::arg("names"), py::arg("timeout") = 5.0,
          "Every name looked up at once under one deadline: a PendingLookups whose value is a "
          "list of LookupResult, in order.")
      .def(
          "watch",
          [](py_directory& d, py::handle key, py::handle prefix) {
            static constexpr const char* who = "ferry.directory.Directory.watch";
            const std::string k = str_arg(key, who, "key");
            const bool p = bool_arg(prefix, who, "prefix");
            return std::make_shared<watcher>(d.get().watch(k, p));
          },
          py::arg("key"), py::arg("prefix") = false,
          "A Watcher of `key` (prefix=True: every name starting with it).")
      .def("close", [](py_directory& d) { d.close(); },
           "Withdraws what it publishes and ends its watches; later calls raise.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](py_directory& d, py::args) { d.close(); });

  py::class_<py_local_directory, py_directory, std::shared_ptr<py_local_directory>>(
      m, "LocalDirectory", "The in-process directory: one client of a LocalRegistry.")
      .def(py::init([](py::handle executor, py::handle registry, py::handle max_record_bytes) {
             static constexpr const char* who = "ferry.directory.LocalDirectory";
             auto d = std::make_shared<py_local_directory>();
             d->exec = executor_arg(executor, who);
             std::shared_ptr<local_registry> r =
                 registry.is_none()
                     ? local_registry::process_wide()
                     : shared_arg<local_registry>(registry, who, "registry",
                                                  "a ferry.directory.LocalRegistry or None");
             directory_options o;
             o.max_record_bytes = size_arg(max_record_bytes, who, "max_record_bytes", 1);
             d->local = std::make_unique<local_directory>(*d->exec, o, std::move(r));
             d->dir = d->local.get();
             return d;
           }),
           py::arg("executor"), py::arg("registry") = py::none(),
           py::arg("max_record_bytes") = default_max_record_bytes)
      .def("abandon",
           [](py_local_directory& d) {
             d.get();
             py::gil_scoped_release released;
             d.local->abandon();
           },
           "Stops renewing its leases without withdrawing, as a process that died would.");

#ifdef FERRY_PYTHON_ETCD
  py::class_<py_etcd_directory, py_directory, std::shared_ptr<py_etcd_directory>>(
      m, "EtcdDirectory", "The etcd v3 directory (etcd's JSON gateway through libcurl).")
      .def(py::init([](py::handle executor, py::handle endpoints, py::handle root,
                       py::handle request_timeout, py::handle max_record_bytes) {
             static constexpr const char* who = "ferry.directory.EtcdDirectory";
             auto d = std::make_shared<py_etcd_directory>();
             d->exec = executor_arg(executor, who);
             etcd_options o;
             o.endpoints.clear();
             if (PyUnicode_Check(endpoints.ptr())) {
               o.endpoints.push_back(str_arg(endpoints, who, "endpoints"));
             } else {
               for (py::handle h :
                    iterable_arg(endpoints, who, "endpoints", "a str or an iterable of str")) {
                 o.endpoints.push_back(str_arg(h, who, item_name("endpoints", o.endpoints.size())));
               }
             }
             o.root = str_arg(root, who, "root");
             o.request_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
                 duration_arg(request_timeout, who, "request_timeout"));
             directory_options limits;
             limits.max_record_bytes = size_arg(max_record_bytes, who, "max_record_bytes", 1);
             try {
               d->etcd = std::make_unique<etcd_directory>(*d->exec, std::move(o), limits);
             } catch (const std::invalid_argument& e) {
               throw py::value_error(std::string(who) + ": " + e.what());
             }
             d->dir = d->etcd.get();
             return d;
           }),
           py::arg("executor"), py::arg("endpoints") = "http://127.0.0.1:2379",
           py::arg("root") = "ferry/", py::arg("request_timeout") = 3.0,
           py::arg("max_record_bytes") = default_max_record_bytes)
      .def_property_readonly("watch_streams", [](py_etcd_directory& d) {
        d.get();
        return d.etcd->watch_streams();
      });
  m.attr("HAS_ETCD") = true;
#else
  m.attr("HAS_ETCD") = false;
#endif
}

}  // namespace ferry::python
