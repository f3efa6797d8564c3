// Wake-ups of io_uring's completions: file reads and TCP round trips with the executor parking
// (see check_round_trips_wake in helpers.hpp). With deferred task work on a parked executor (the
// set-up every ring had before it was chosen by executor mode), each of these round trips waited
// for the kernel's lazily signalled eventfd: 8-16 ms.

#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <vector>

#include <ferry/uring/aligned_buffer.hpp>
#include <ferry/uring/ring.hpp>
#include <ferry/uring/tcp.hpp>

#include "helpers.hpp"
#include "uring_helpers.hpp"

using namespace ferry_test;
namespace uring = ferry::uring;

TEST_CASE("uring: a parked executor is woken by each file read's completion", "[wakeup]") {
  FERRY_REQUIRE_URING();
  temp_dir dir;
  const std::string path = dir.file("wakeup");
  {
    const int w = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    REQUIRE(w >= 0);
    const std::vector<std::byte> bytes = pattern(std::size_t{1} << 20, 3);
    REQUIRE(::write(w, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()));
    ::fsync(w);
    ::close(w);
  }
  // O_DIRECT where the file system takes it, so that reads go to the device and complete later,
  // not inside the call that submits them.
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  if (fd < 0) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  for (const ferry::progress_mode mode : wakeup_modes) {
    ferry::progress_executor exec(executor_in(mode));
    uring::ring r(exec);
    CHECK_FALSE(r.defers_task_work());  // an executor that parks gets the plain set-up
    uring::aligned_buffer buf(4096);
    std::uint64_t block = 0;
    check_round_trips_wake(
        "4 KiB file read", mode, [&] { return exec.counters().parks; },
        [&] {
          ferry::transfer t = r.read(fd, buf.span(), (block++ % 256) * 4096);
          REQUIRE(t.wait_for(hang_bound) == ferry::transfer_state::success);
        });
  }
  ::close(fd);
}

TEST_CASE("tcp: parked executors are woken by each framed block of a ping-pong", "[wakeup]") {
  FERRY_REQUIRE_URING();
  for (const ferry::progress_mode mode : wakeup_modes) {
    // Each side on its own executor, as two engines would be.
    ferry::progress_executor client_exec(executor_in(mode)), server_exec(executor_in(mode));
    uring::ring client_ring(client_exec), server_ring(server_exec);
    uring::tcp_listener listener("127.0.0.1", 0);
    uring::tcp_connection client = uring::tcp_connection::connect(client_ring, "127.0.0.1",
                                                                  listener.port());
    uring::tcp_connection server = listener.accept(server_ring);
    const std::vector<std::byte> block = pattern(4096, 5);
    std::vector<std::byte> at_server(4096), at_client(4096);
    std::uint64_t id = 0;
    check_round_trips_wake(
        "4 KiB ping-pong", mode,
        [&] { return client_exec.counters().parks + server_exec.counters().parks; },
        [&] {
          uring::received_block got{}, back{};
          ferry::transfer in = server.receive(at_server, got);
          ferry::transfer reply_in = client.receive(at_client, back);
          ferry::transfer out = client.send(++id, block);
          REQUIRE(in.wait_for(hang_bound) == ferry::transfer_state::success);
          ferry::transfer reply = server.send(got.id, std::span<const std::byte>(at_server).first(got.length));
          REQUIRE(reply.wait_for(hang_bound) == ferry::transfer_state::success);
          REQUIRE(reply_in.wait_for(hang_bound) == ferry::transfer_state::success);
          REQUIRE(out.wait_for(hang_bound) == ferry::transfer_state::success);
          REQUIRE(back.id == id);
        });
    CHECK(at_client == block);
  }
}
