// An Asio server whose KV layers arrive through ferry. A "prefill" peer streams every layer's KV
// blocks over TCP through io_uring (ferry::uring); the server, an Asio application, answers clients
// on an Asio socket: for "layer N" it awaits that layer's blocks with ferry::async_wait_all inside
// its asio::awaitable session and replies with the layer's checksum. Each request has a timeout
// done the Asio way, `async_wait_all(...) || timer.async_wait(...)`: when the timer wins, Asio's
// cancellation ends the ferry wait (the receives go on) and the client is told "timeout".
//
//   asio_kv_server [layers] [blocks-per-layer] [block-KiB] [timeout-ms]   (defaults: 8 4 16 200)
//
// The peer sends every layer but the last, a layer whose prefill node stalled: the request for it
// must time out. A client on the same io_context asks for every layer, pipelined, and checks each
// answer against the checksum it works out itself. Everything runs on 127.0.0.1, in one process:
// the peer on a thread with its own progress executor and ring, as another machine would have.
// Exit status 0 means every layer's answer was right, the stalled one's included.

#include <asio.hpp>
#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ferry/asio.hpp>
#include <ferry/ferry.hpp>
#include <ferry/uring/tcp.hpp>
#include <future>
#include <span>
#include <string>
#include <thread>
#include <variant>
#include <vector>

using namespace std::chrono_literals;
using namespace asio::experimental::awaitable_operators;
namespace uring = ferry::uring;
using asio::ip::tcp;

namespace {

struct shape {
  std::size_t layers = 8;
  std::size_t blocks = 4;  // per layer
  std::size_t block_bytes = 16 << 10;
  std::chrono::milliseconds timeout{200};

  [[nodiscard]] std::uint64_t id(std::size_t layer, std::size_t block) const {
    return layer * blocks + block;
  }
  [[nodiscard]] std::size_t stalled_layer() const { return layers - 1; }
};

std::byte expected(std::uint64_t id, std::size_t i) {
  return static_cast<std::byte>((id * 2654435761u + i * 40503u) >> 7);
}

// FNV-1a over a layer's blocks in order: what the server answers and the client checks.
std::uint64_t checksum(const shape& s, std::size_t layer,
                       const std::vector<std::vector<std::byte>>* kv) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t b = 0; b < s.blocks; ++b) {
    const std::uint64_t id = s.id(layer, b);
    for (std::size_t i = 0; i < s.block_bytes; ++i) {
      const std::byte v = kv != nullptr ? (*kv)[id][i] : expected(id, i);
      h = (h ^ static_cast<std::uint64_t>(v)) * 1099511628211ull;
    }
  }
  return h;
}

// The prefill peer: sends every layer but the stalled one, a few milliseconds apart, and keeps the
// connection open until told to go (a closed connection would fail the stalled receives at once,
// where the point is that they never arrive).
int prefill(const shape& s, std::uint16_t port, std::future<void> go) {
  ferry::progress_executor exec;
  std::vector<std::vector<std::byte>> kv(s.layers * s.blocks,
                                         std::vector<std::byte>(s.block_bytes));
  uring::ring ring(exec);
  uring::tcp_connection conn = uring::tcp_connection::connect(ring, "127.0.0.1", port);
  std::vector<ferry::transfer> sends;
  for (std::size_t layer = 0; layer < s.layers; ++layer) {
    if (layer == s.stalled_layer()) continue;
    for (std::size_t b = 0; b < s.blocks; ++b) {
      const std::uint64_t id = s.id(layer, b);
      for (std::size_t i = 0; i < s.block_bytes; ++i) kv[id][i] = expected(id, i);
      sends.push_back(conn.send(id, kv[id]));
    }
    std::this_thread::sleep_for(3ms);  // prefill computing the next layer
  }
  const ferry::batch_result r = ferry::drain(sends, 30s);
  go.wait();
  conn.close();
  if (!r.ok()) {
    std::fprintf(stderr, "prefill: send %zu failed: %s\n", r.first_failed.value_or(0),
                 r.error.message().c_str());
    return 1;
  }
  return 0;
}

// What the server holds: the receives it posted, per block, and where they land.
struct kv_cache {
  const shape& s;
  std::vector<std::vector<std::byte>> kv;
  std::vector<uring::received_block> got;
  std::vector<ferry::transfer> loads;

  [[nodiscard]] std::span<const ferry::transfer> layer(std::size_t l) const {
    return {loads.data() + l * s.blocks, s.blocks};
  }
};

// One client connection: a line per request, a line per answer.
asio::awaitable<void> session(tcp::socket socket, const kv_cache& cache) {
  const shape& s = cache.s;
  std::string in;
  for (;;) {
    auto [ec, n] = co_await asio::async_read_until(
        socket, asio::dynamic_buffer(in), '\n', asio::experimental::as_tuple(asio::use_awaitable));
    if (ec) co_return;  // the client is done
    const std::string line = in.substr(0, n - 1);
    in.erase(0, n);
    std::size_t layer = 0;
    if (std::sscanf(line.c_str(), "layer %zu", &layer) != 1 || layer >= s.layers) {
      const std::string bad = "error: expected \"layer N\" with N below " +
                              std::to_string(s.layers) + ", got \"" + line + "\"\n";
      co_await asio::async_write(socket, asio::buffer(bad), asio::use_awaitable);
      continue;
    }
    // No ferry deadline: the request's timeout is the timer, and Asio's cancellation of the
    // losing operation ends the ferry wait.
    asio::steady_timer timer(socket.get_executor(), s.timeout);
    const std::variant<ferry::batch_result, std::monostate> outcome =
        co_await (ferry::async_wait_all(cache.layer(layer), -1ms, asio::use_awaitable) ||
                  timer.async_wait(asio::use_awaitable));
    std::string reply = "layer " + std::to_string(layer) + " ";
    if (outcome.index() == 1) {
      reply += "timeout\n";
    } else if (const ferry::batch_result& r = std::get<0>(outcome); !r.ok()) {
      reply += std::string("failed: ") + r.error.message() + "\n";
    } else {
      bool framed = true;
      for (std::size_t b = 0; b < s.blocks; ++b) {
        const std::uint64_t id = s.id(layer, b);
        framed = framed && cache.got[id].id == id && cache.got[id].length == s.block_bytes;
      }
      reply += framed ? "ok " + std::to_string(checksum(s, layer, &cache.kv)) + "\n"
                      : "failed: blocks out of order\n";
    }
    co_await asio::async_write(socket, asio::buffer(reply), asio::use_awaitable);
  }
}

asio::awaitable<void> serve(tcp::acceptor& acceptor, const kv_cache& cache) {
  for (;;) {
    auto [ec, socket] =
        co_await acceptor.async_accept(asio::experimental::as_tuple(asio::use_awaitable));
    if (ec) co_return;  // the acceptor was closed
    asio::co_spawn(acceptor.get_executor(), session(std::move(socket), cache), asio::detached);
  }
}

// Asks for every layer at once, then reads and checks each answer.
asio::awaitable<bool> client(const shape& s, tcp::endpoint server) {
  tcp::socket socket(co_await asio::this_coro::executor);
  co_await socket.async_connect(server, asio::use_awaitable);
  std::string requests;
  for (std::size_t layer = 0; layer < s.layers; ++layer) {
    requests += "layer " + std::to_string(layer) + "\n";
  }
  co_await asio::async_write(socket, asio::buffer(requests), asio::use_awaitable);
  bool ok = true;
  std::string in;
  for (std::size_t layer = 0; layer < s.layers; ++layer) {
    const std::size_t n = co_await asio::async_read_until(socket, asio::dynamic_buffer(in), '\n',
                                                          asio::use_awaitable);
    const std::string line = in.substr(0, n - 1);
    in.erase(0, n);
    const std::string want =
        "layer " + std::to_string(layer) + " " +
        (layer == s.stalled_layer() ? std::string("timeout")
                                    : "ok " + std::to_string(checksum(s, layer, nullptr)));
    std::printf("client: %s%s\n", line.c_str(),
                line == want ? "" : ("  (expected " + want + ")").c_str());
    ok = ok && line == want;
  }
  co_return ok;
}

}  // namespace

int main(int argc, char** argv) {
  shape s;
  if (argc > 1) s.layers = std::strtoul(argv[1], nullptr, 10);
  if (argc > 2) s.blocks = std::strtoul(argv[2], nullptr, 10);
  if (argc > 3) s.block_bytes = std::strtoul(argv[3], nullptr, 10) << 10;
  if (argc > 4) s.timeout = std::chrono::milliseconds(std::strtoul(argv[4], nullptr, 10));
  if (s.layers < 2 || s.blocks == 0 || s.block_bytes == 0 || s.timeout <= 0ms) {
    std::fprintf(
        stderr,
        "usage: %s [layers >= 2] [blocks-per-layer] [block-KiB] [timeout-ms], all at least "
        "1\n",
        argv[0]);
    return 2;
  }

  ferry::progress_executor exec;
  kv_cache cache{s,
                 std::vector<std::vector<std::byte>>(s.layers * s.blocks,
                                                     std::vector<std::byte>(s.block_bytes)),
                 std::vector<uring::received_block>(s.layers * s.blocks),
                 {}};
  // After the buffers, so that the ring (freed first) waits out whatever the kernel still holds.
  uring::ring ring(exec);
  uring::tcp_listener listener("127.0.0.1", 0);
  std::promise<void> peer_may_go;
  std::future<int> peer = std::async(std::launch::async, prefill, std::cref(s), listener.port(),
                                     peer_may_go.get_future());
  uring::tcp_connection conn = listener.accept(ring);
  // Every layer's receives up front; they complete in order as the peer sends.
  for (std::size_t id = 0; id < cache.kv.size(); ++id) {
    cache.loads.push_back(conn.receive(cache.kv[id], cache.got[id]));
  }

  asio::io_context io;
  tcp::acceptor acceptor(io, tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
  asio::co_spawn(io, serve(acceptor, cache), asio::detached);
  bool answers_ok = false;
  asio::co_spawn(io, client(s, acceptor.local_endpoint()), [&](std::exception_ptr e, bool ok) {
    if (e) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "client: %s\n", ex.what());
      }
    }
    answers_ok = !e && ok;
    acceptor.close();  // the server stops once its sessions end
  });
  io.run();

  // The stalled layer's receives are still waiting: closing the connection ends them.
  conn.close();
  peer_may_go.set_value();
  const bool peer_ok = peer.get() == 0;
  std::printf("asio_kv_server: %zu layers x %zu blocks of %zu KiB, %s\n", s.layers, s.blocks,
              s.block_bytes >> 10, answers_ok && peer_ok ? "every answer right" : "FAILED");
  return answers_ok && peer_ok ? 0 : 1;
}
