// The TCP side channel handshake (handshake.hpp) that connects two queue pairs and hands over
// their regions.

#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <ferry/ferry.hpp>
#include <ferry/metrics.hpp>
#include <ferry/testing/verbs.hpp>
#include <ferry/verbs/device.hpp>
#include <ferry/verbs/handshake.hpp>

#include "helpers.hpp"
#include "verbs/verbs_helpers.hpp"

namespace {

using namespace std::chrono_literals;
using namespace ferry_test::verbs;

}  // namespace

namespace {

// Two fake adapters with a region each, connected over the TCP side channel on loopback: `c` is the
// connecting side (exposing nothing), `accepted` the listening side (exposing its region).
struct side_channel_pair {
  explicit side_channel_pair(fv::queue_pair_options o = {}) {
    fv::side_channel_listener listener(0);
    std::thread server([&] {
      const fv::remote_region exposed[] = {b_mem.remote()};
      accepted.emplace(listener.accept(b, std::span<const fv::remote_region>(exposed), o));
    });
    c.emplace(fv::connect(a, "127.0.0.1", listener.port(), std::span<const fv::remote_region>(), o));
    server.join();
  }

  ferry::progress_executor exec;
  device a{exec, fv::device_options{fresh_device("hs_a"), 1, 0, 1024}};
  device b{exec, fv::device_options{fresh_device("hs_b"), 1, 0, 1024}};
  region a_mem = region::allocate(a, 1 << 16);
  region b_mem = region::allocate(b, 1 << 16);
  std::optional<fv::basic_connection<provider>> accepted;
  std::optional<fv::basic_connection<provider>> c;
};

}  // namespace

TEST_CASE("verbs: two queue pairs connect over the TCP side channel and exchange rkeys",
          "[verbs]") {
  side_channel_pair p;
  REQUIRE(p.accepted.has_value());
  REQUIRE(p.c->peer_regions.size() == 1);
  CHECK(p.accepted->peer_regions.empty());
  CHECK(p.c->peer_regions[0].rkey == p.b_mem.rkey());
  fill_pattern(p.a_mem.bytes().first(4096), 11);
  transfer t = p.c->qp.write(p.a_mem.slice(0, 4096), p.c->peer_regions[0].slice(512, 4096));
  REQUIRE(t.wait_for(hang_bound) == transfer_state::success);
  CHECK(has_pattern(p.b_mem.bytes().subspan(512, 4096), 11));
  std::uint64_t v = 0;
  transfer note = p.accepted->qp.receive_notification(v);
  REQUIRE(p.c->qp.send_notification(99).wait_for(hang_bound) == transfer_state::success);
  REQUIRE(note.wait_for(hang_bound) == transfer_state::success);
  CHECK(v == 99);
}

TEST_CASE("verbs: after the handshake, peer checks start before any traffic", "[verbs]") {
  // The handshake's last step tells each side that the other is connected; nothing else has come
  // back from the peer when the wait starts.
  fv::queue_pair_options o;
  o.peer_check = 5ms;
  side_channel_pair p(o);
  std::uint64_t v = 0;
  transfer note = p.c->qp.receive_notification(v);
  p.accepted.reset();
  REQUIRE(note.wait_for(hang_bound) == transfer_state::failed);
  CHECK(note.error() == fv::errc::peer_unreachable);
}

TEST_CASE("verbs: a side channel peer that is not speaking the handshake is refused", "[verbs]") {
  ferry::progress_executor exec;
  device a(exec, fv::device_options{fresh_device("hs_bad"), 1, 0, 1024});
  fv::side_channel_listener listener(0);
  std::thread impostor([&] {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(listener.port());
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0) {
      const char junk[64] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
      [[maybe_unused]] const ssize_t n = ::send(fd, junk, sizeof junk, MSG_NOSIGNAL);
      char sink[256];
      while (::recv(fd, sink, sizeof sink, 0) > 0) {
      }
    }
    ::close(fd);
  });
  try {
    (void)listener.accept(a, std::span<const fv::remote_region>(), {}, 5s);
    FAIL("the handshake accepted a peer that sent junk");
  } catch (const std::system_error& e) {
    CHECK(e.code() == fv::errc::handshake_failed);
    CHECK(std::string(e.what()).find("magic") != std::string::npos);
  }
  impostor.join();
  // Nobody connects: a clear timeout, not a hang.
  fv::side_channel_listener quiet(0);
  CHECK_THROWS_AS(quiet.accept(a, std::span<const fv::remote_region>(), {}, 50ms), std::system_error);
}

TEST_CASE("verbs: the handshake labels a metered queue pair's peer with the side channel's address",
          "[verbs]") {
  ferry::metrics::registry metrics("verbs");
  {
    metered_devices d(metrics, "hs_metrics");
    device& a = d.a;
    device& b = d.b;
    region& a_mem = d.a_mem;
    region& b_mem = d.b_mem;
    fv::side_channel_listener listener(0);
    std::optional<fv::basic_connection<provider>> accepted;
    std::thread server([&] {
      const fv::remote_region exposed[] = {b_mem.remote()};
      accepted.emplace(listener.accept(b, std::span<const fv::remote_region>(exposed)));
    });
    fv::basic_connection<provider> c =
        fv::connect(a, "127.0.0.1", listener.port(), std::span<const fv::remote_region>());
    server.join();
    REQUIRE(c.qp.write(a_mem.slice(0, 64), c.peer_regions[0].slice(0, 64)).wait_for(hang_bound) ==
            transfer_state::success);
    // A name given in the options is kept.
    fv::queue_pair_options named;
    named.peer_name = "prefill-7";
    std::thread server2([&] {
      const fv::remote_region exposed[] = {b_mem.remote()};
      accepted.emplace(listener.accept(b, std::span<const fv::remote_region>(exposed)));
    });
    fv::basic_connection<provider> c2 =
        fv::connect(a, "127.0.0.1", listener.port(), std::span<const fv::remote_region>(), named);
    server2.join();
    REQUIRE(c2.qp.write(a_mem.slice(0, 64), c2.peer_regions[0].slice(0, 64)).wait_for(hang_bound) ==
            transfer_state::success);
  }
  std::vector<std::string> peers;
  for (const auto& op : metrics.snapshot().operations) {
    if (!op.peer.empty()) {
      CHECK(op.succeeded == 1);
      peers.push_back(op.peer);
    }
  }
  CHECK(peers == std::vector<std::string>{"127.0.0.1", "prefill-7"});
}
