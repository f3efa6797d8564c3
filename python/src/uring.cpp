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

py_transfer file_io(py_ring& r, int fd, py::handle buffer, std::uint64_t offset, bool read) {
  auto keep = std::make_shared<keep_alive>();
  const std::span<std::byte> b =
      keep->hold(buffer, read, read ? "destination" : "source");
  keep->reports_transferred = true;
  transfer t = read ? r.ring->read(fd, b, offset, &keep->transferred)
                    : r.ring->write(fd, std::span<const std::byte>(b), offset, &keep->transferred);
  return py_transfer(std::move(t), std::move(keep));
}

uring::tcp_options tcp_options_from(int send_buffer, int receive_buffer) {
  uring::tcp_options o;
  o.send_buffer = send_buffer;
  o.receive_buffer = receive_buffer;
  return o;
}

}  // namespace

void add_uring(py::module_& parent) {
  py::module_ m = parent.def_submodule("uring", "The io_uring backend: files and TCP.");
  m.attr("CURRENT_POSITION") = uring::current_position;

  py::enum_<uring::errc>(m, "Errc", "The io_uring backend's error codes (category 'ferry.uring').")
      .value("end_of_file", uring::errc::end_of_file)
      .value("outside_registered_buffer", uring::errc::outside_registered_buffer)
      .value("bad_registered_index", uring::errc::bad_registered_index)
      .value("vector_too_large", uring::errc::vector_too_large)
      .value("connection_closed", uring::errc::connection_closed)
      .value("connection_broken", uring::errc::connection_broken)
      .value("block_too_large", uring::errc::block_too_large)
      .value("bad_frame", uring::errc::bad_frame)
      .value("cancelled_part_way", uring::errc::cancelled_part_way);
  register_errc([](py::handle h) -> std::optional<std::error_code> {
    if (!py::isinstance<uring::errc>(h)) return std::nullopt;
    return uring::make_error_code(h.cast<uring::errc>());
  });

  py::class_<py_ring, std::shared_ptr<py_ring>>(
      m, "Ring",
      "An io_uring ring progressed by the executor. Destroying it waits for everything the kernel "
      "still holds, so no buffer is written afterwards.")
      .def(py::init([](std::shared_ptr<progress_executor> exec, unsigned entries,
                       unsigned submit_batch, bool defer_task_work) {
             executor_arg(exec, "ferry.uring.Ring");
             auto r = std::make_shared<py_ring>();
             uring::ring_options o;
             o.entries = entries;
             o.submit_batch = submit_batch;
             o.defer_task_work = defer_task_work;
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
           [](py_ring& r, int fd, py::handle dst, std::uint64_t offset) {
             return file_io(r, fd, dst, offset, true);
           },
           py::arg("fd"), py::arg("dst"), py::arg("offset"),
           "Reads len(dst) bytes at offset (CURRENT_POSITION: the descriptor's own) into dst; a "
           "file that ends first fails with Errc.end_of_file. .transferred: bytes read.")
      .def("write",
           [](py_ring& r, int fd, py::handle src, std::uint64_t offset) {
             return file_io(r, fd, src, offset, false);
           },
           py::arg("fd"), py::arg("src"), py::arg("offset"))
      .def("read_batch",
           [](py_ring& r, int fd, py::handle blocks) {
             // [(dst, offset), ...]: one transfer each, published together.
             auto keep = std::make_shared<keep_alive>();
             std::vector<uring::read_block> rb;
             for (py::handle item : py::iter(blocks)) {
               const py::tuple pair = py::reinterpret_borrow<py::tuple>(item);
               if (pair.size() != 2) throw py::value_error("ferry.uring.Ring.read_batch: blocks are (dst, offset) pairs");
               rb.push_back({keep->hold(pair[0], true, "destination"), pair[1].cast<std::uint64_t>()});
             }
             std::vector<transfer> out(rb.size());
             r.ring->read_batch(fd, rb, out);
             py::list result;
             for (transfer& t : out) result.append(py_transfer(std::move(t), keep));
             return result;
           },
           py::arg("fd"), py::arg("blocks"),
           "Reads many blocks ([(dst, offset), ...]) as one submission; a list of Transfers.")
      .def("cancel", [](py_ring& r, const py_transfer& t) { r.ring->cancel(t.t); },
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
                  [](std::shared_ptr<py_ring> r, const std::string& host, std::uint16_t port,
                     int send_buffer, int receive_buffer) {
                    auto c = std::make_shared<py_connection>();
                    c->ring = r;
                    const uring::tcp_options o = tcp_options_from(send_buffer, receive_buffer);
                    py::gil_scoped_release released;
                    c->conn.emplace(uring::tcp_connection::connect(*r->ring, host, port, o));
                    return c;
                  },
                  py::arg("ring"), py::arg("host"), py::arg("port"), py::arg("send_buffer") = 0,
                  py::arg("receive_buffer") = 0,
                  "Connects to host:port (blocking, with the GIL released).")
      .def("send",
           [](py_connection& c, std::uint64_t block_id, py::handle payload) {
             auto keep = std::make_shared<keep_alive>();
             const std::span<std::byte> p = keep->hold(payload, false, "payload");
             return py_transfer(c.get().send(block_id, p), std::move(keep));
           },
           py::arg("block_id"), py::arg("payload"))
      .def("receive",
           [](py_connection& c, py::handle dst) {
             auto keep = std::make_shared<keep_alive>();
             const std::span<std::byte> d = keep->hold(dst, true, "destination");
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
      .def(py::init([](const std::string& address, std::uint16_t port, int backlog,
                       int send_buffer, int receive_buffer) {
             return std::make_unique<py_listener>(py_listener{uring::tcp_listener(
                 address, port, backlog, tcp_options_from(send_buffer, receive_buffer))});
           }),
           py::arg("address") = "127.0.0.1", py::arg("port") = 0, py::arg("backlog") = 64,
           py::arg("send_buffer") = 0, py::arg("receive_buffer") = 0)
      .def_property_readonly("port", [](const py_listener& l) { return l.listener.port(); })
      .def("accept",
           [](py_listener& l, std::shared_ptr<py_ring> r) {
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
