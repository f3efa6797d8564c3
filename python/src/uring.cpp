// ferry.uring: io_uring file reads and writes at offsets, and framed blocks over TCP. Connections
// keep their ring alive and rings their executor, so Python's order of destruction is always the
// one the C++ backend requires (connections, then the ring, then the executor).

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.hpp"
#include "ferry/uring.hpp"

namespace ferry::python {

namespace {

struct py_ring {
  std::shared_ptr<progress_executor> exec;
  std::unique_ptr<uring::ring> ring;
};

struct py_connection {
  std::shared_ptr<py_ring> ring;  // destroyed after the connection
  std::optional<uring::tcp_connection> conn;

  uring::tcp_connection& get() { return *conn; }
};

int fd_arg(py::handle h, const char* who) { return int_arg<int>(h, who, "fd", 0); }
std::uint64_t offset_arg(py::handle h, const char* who, std::string_view what = "offset") {
  return int_arg<std::uint64_t>(h, who, what);  // current_position is the largest
}
std::uint16_t port_arg(py::handle h, const char* who) {
  return int_arg<std::uint16_t>(h, who, "port");
}

// A read or write of `buffer` (held, with the count of bytes moved, until it has ended).
py_transfer file_io(py_ring& r, int fd, std::shared_ptr<keep_alive> keep, std::span<std::byte> b,
                    std::uint64_t offset, bool read) {
  keep->reports_transferred = true;
  transfer t = read ? r.ring->read(fd, b, offset, &keep->transferred)
                    : r.ring->write(fd, std::span<const std::byte>(b), offset, &keep->transferred);
  return py_transfer(std::move(t), std::move(keep));
}

py_transfer file_io(py_ring& r, py::handle fd, py::handle buffer, py::handle offset, bool read) {
  const char* const who = read ? "ferry.uring.Ring.read" : "ferry.uring.Ring.write";
  const int f = fd_arg(fd, who);
  const std::uint64_t at = offset_arg(offset, who);
  auto keep = std::make_shared<keep_alive>();
  const std::span<std::byte> b =
      keep->hold(buffer, read, who, read ? "dst (the destination)" : "src (the source)");
  return file_io(r, f, std::move(keep), b, at, read);
}

uring::tcp_options tcp_options_from(py::handle send_buffer, py::handle receive_buffer,
                                    const char* who) {
  uring::tcp_options o;
  o.send_buffer = int_arg<int>(send_buffer, who, "send_buffer", 0);
  o.receive_buffer = int_arg<int>(receive_buffer, who, "receive_buffer", 0);
  return o;
}

std::shared_ptr<py_ring> ring_arg(py::handle h, const char* who) {
  return shared_arg<py_ring>(h, who, "ring", "a ferry.uring.Ring");
}

}  // namespace

void add_uring(py::module_& parent) {
  py::module_ m = parent.def_submodule("uring", "The io_uring backend: files and TCP.");
  m.attr("CURRENT_POSITION") = uring::current_position;

  const auto uring_errc = py::enum_<uring::errc>(
      m, "Errc", "The io_uring backend's error codes (category 'ferry.uring').")
      .value("end_of_file", uring::errc::end_of_file)
      .value("outside_registered_buffer", uring::errc::outside_registered_buffer)
      .value("bad_registered_index", uring::errc::bad_registered_index)
      .value("vector_too_large", uring::errc::vector_too_large)
      .value("connection_closed", uring::errc::connection_closed)
      .value("connection_broken", uring::errc::connection_broken)
      .value("block_too_large", uring::errc::block_too_large)
      .value("bad_frame", uring::errc::bad_frame)
      .value("cancelled_part_way", uring::errc::cancelled_part_way)
      .value("deadline_exceeded", uring::errc::deadline_exceeded)
      .value("listener_closed", uring::errc::listener_closed);
  register_errc(uring_errc, [](py::handle h) -> std::optional<std::error_code> {
    if (!py::isinstance<uring::errc>(h)) return std::nullopt;
    return uring::make_error_code(h.cast<uring::errc>());
  });

  py::class_<py_ring, std::shared_ptr<py_ring>>(
      m, "Ring",
      "An io_uring ring progressed by the executor. Destroying it waits for everything the kernel "
      "still holds, so no buffer is written afterwards.")
      .def(py::init([](py::handle executor, py::handle entries, py::handle submit_batch,
                       py::handle defer_task_work) {
             static constexpr const char* who = "ferry.uring.Ring";
             std::shared_ptr<progress_executor> exec = executor_arg(executor, who);
             uring::ring_options o;
             o.entries = int_arg<unsigned>(entries, who, "entries", 1);
             o.submit_batch = int_arg<unsigned>(submit_batch, who, "submit_batch");
             o.defer_task_work = bool_arg(defer_task_work, who, "defer_task_work");
             auto r = std::make_shared<py_ring>();
             {
               py::gil_scoped_release released;  // enabling the ring waits for the executor
               r->ring = std::make_unique<uring::ring>(*exec, o);
             }
             r->exec = std::move(exec);
             return r;
           }),
           py::arg("executor"), py::arg("entries") = 256, py::arg("submit_batch") = 2,
           py::arg("defer_task_work") = true)
      .def("read",
           [](py_ring& r, py::handle fd, py::handle dst, py::handle offset) {
             return file_io(r, fd, dst, offset, true);
           },
           py::arg("fd"), py::arg("dst"), py::arg("offset"),
           "Reads len(dst) bytes at offset (CURRENT_POSITION: the descriptor's own) into dst; a "
           "file that ends first fails with Errc.end_of_file. .transferred: bytes read.")
      .def("write",
           [](py_ring& r, py::handle fd, py::handle src, py::handle offset) {
             return file_io(r, fd, src, offset, false);
           },
           py::arg("fd"), py::arg("src"), py::arg("offset"))
      .def("read_batch",
           [](py_ring& r, py::handle fd, py::handle blocks) {
             // [(dst, offset), ...]: one transfer each, published together, each with its own
             // count of bytes moved. Every block is checked, and its buffer held, before any read
             // is submitted.
             static constexpr const char* who = "ferry.uring.Ring.read_batch";
             const int f = fd_arg(fd, who);
             std::vector<std::shared_ptr<keep_alive>> keeps;
             std::vector<uring::read_block> bs;
             for (py::handle item : iterable_arg(blocks, who, "blocks",
                                                 "an iterable of (dst, offset) pairs")) {
               const std::string what = item_name("blocks", bs.size());
               const auto [dst, offset] = pair_arg(item, who, what, "a (dst, offset) pair");
               const std::uint64_t at = offset_arg(offset, who, what + " offset");
               auto keep = std::make_shared<keep_alive>();
               const std::span<std::byte> d = keep->hold(dst, true, who, what + " dst");
               keep->reports_transferred = true;
               bs.push_back({d, at, &keep->transferred});
               keeps.push_back(std::move(keep));
             }
             std::vector<transfer> ts(bs.size());
             r.ring->read_batch(f, bs, ts);
             py::list result;
             for (std::size_t i = 0; i < ts.size(); ++i) {
               result.append(py_transfer(std::move(ts[i]), std::move(keeps[i])));
             }
             return result;
           },
           py::arg("fd"), py::arg("blocks"),
           "Reads many blocks ([(dst, offset), ...]), one transfer each, submitted together; a list "
           "of Transfers, each with .transferred once it has ended, as read()'s.")
      .def("cancel",
           [](py_ring& r, py::handle transfer) {
             r.ring->cancel(transfer_arg(transfer, "ferry.uring.Ring.cancel").t);
           },
           py::arg("transfer"),
           "Best effort: asks the kernel to cancel the operation behind the transfer; it ends "
           "cancelled only once the kernel will not touch its buffer again.")
      .def_property_readonly("defers_task_work",
                             [](const py_ring& r) { return r.ring->defers_task_work(); });

  py::class_<py_connection, std::shared_ptr<py_connection>>(
      m, "TcpConnection",
      "Framed blocks (id, length, payload) over TCP through the ring. Sends go out in order, one "
      "at a time, and so do receives.")
      .def_static("connect",
                  [](py::handle ring, py::handle host_arg, py::handle port_arg_,
                     py::handle send_buffer, py::handle receive_buffer) {
                    static constexpr const char* who = "ferry.uring.TcpConnection.connect";
                    std::shared_ptr<py_ring> r = ring_arg(ring, who);
                    const std::string host = str_arg(host_arg, who, "host");
                    const std::uint16_t port = port_arg(port_arg_, who);
                    const uring::tcp_options o = tcp_options_from(send_buffer, receive_buffer, who);
                    auto c = std::make_shared<py_connection>();
                    c->ring = r;
                    py::gil_scoped_release released;
                    c->conn.emplace(uring::tcp_connection::connect(*r->ring, host, port, o));
                    return c;
                  },
                  py::arg("ring"), py::arg("host"), py::arg("port"), py::arg("send_buffer") = 0,
                  py::arg("receive_buffer") = 0,
                  "Connects to host:port (blocking, with the GIL released).")
      .def("send",
           [](py_connection& c, py::handle block_id, py::handle payload) {
             static constexpr const char* who = "ferry.uring.TcpConnection.send";
             const auto id = int_arg<std::uint64_t>(block_id, who, "block_id");
             auto keep = std::make_shared<keep_alive>();
             const std::span<std::byte> p = keep->hold(payload, false, who, "payload");
             return py_transfer(c.get().send(id, p), std::move(keep));
           },
           py::arg("block_id"), py::arg("payload"))
      .def("receive",
           [](py_connection& c, py::handle dst) {
             static constexpr const char* who = "ferry.uring.TcpConnection.receive";
             auto keep = std::make_shared<keep_alive>();
             const std::span<std::byte> d = keep->hold(dst, true, who, "dst (the destination)");
             keep->reports_received = true;
             // The transfer is made first: the keep-alive it writes into is moved afterwards.
             transfer t = c.get().receive(d, keep->received);
             return py_transfer(std::move(t), std::move(keep));
           },
           py::arg("dst"),
           "Receives the next block into the front of dst; .received gives (id, length) once it "
           "succeeded. A block larger than dst fails with Errc.block_too_large.")
      .def("close", [](py_connection& c) { c.get().close(); })
      .def("fileno", [](const py_connection& c) { return c.conn->native_handle(); })
      .def_property_readonly("is_open", [](const py_connection& c) { return c.conn->is_open(); });

  // Not movable once Python holds it; the listening socket closes with it.
  struct py_listener {
    uring::tcp_listener listener;
  };
  py::class_<py_listener>(m, "TcpListener")
      .def(py::init([](py::handle address, py::handle port, py::handle backlog,
                       py::handle send_buffer, py::handle receive_buffer) {
             static constexpr const char* who = "ferry.uring.TcpListener";
             const std::string a = str_arg(address, who, "address");
             const std::uint16_t p = port_arg(port, who);
             const int b = int_arg<int>(backlog, who, "backlog", 0);
             const uring::tcp_options o = tcp_options_from(send_buffer, receive_buffer, who);
             return std::make_unique<py_listener>(py_listener{uring::tcp_listener(a, p, b, o)});
           }),
           py::arg("address") = "127.0.0.1", py::arg("port") = 0, py::arg("backlog") = 64,
           py::arg("send_buffer") = 0, py::arg("receive_buffer") = 0)
      .def_property_readonly("port", [](const py_listener& l) { return l.listener.port(); })
      .def("accept",
           [](py_listener& l, py::handle ring) {
             std::shared_ptr<py_ring> r = ring_arg(ring, "ferry.uring.TcpListener.accept");
             auto c = std::make_shared<py_connection>();
             c->ring = r;
             py::gil_scoped_release released;
             c->conn.emplace(l.listener.accept(*r->ring));
             return c;
           },
           py::arg("ring"), "Blocks (with the GIL released) until a peer connects.")
      .def("fileno", [](const py_listener& l) { return l.listener.native_handle(); });
}

}  // namespace ferry::python
