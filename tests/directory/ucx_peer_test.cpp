// Peers found by name over real UCX: an endpoint made from a directory record is bound to the
// peer's incarnation. With etcd, each target is a process of its own (peer_process.hpp) that
// publishes its worker address and region under a name; the tests stop it, kill it, and start a new
// one under the same name in the middle of a batch. With the in-process directory, both workers are
// in this process and a second client publishes under the name. The targets' memory is a memfd this
// process maps too, so that what landed where is checked byte for byte, also after a target died.

#include <catch2/catch.hpp>

#include <signal.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ferry/directory.hpp>
#include <ferry/directory/etcd.hpp>
#include <ferry/ucx.hpp>

#include "directory/etcd_server.hpp"
#include "helpers.hpp"
#include "ucx/peer_process.hpp"

using namespace ferry_test;
using ferry::directory_errc;
using ferry::transfer_state;
namespace ucx = ferry::ucx;
namespace peer = ferry_test::ucx_peer;

namespace {

constexpr std::size_t block = 16 * 1024;
constexpr std::size_t blocks = 64;
constexpr std::size_t region_bytes = block * blocks;

// A target's record: its worker address and its region, each length-prefixed.
std::vector<std::byte> target_record(const std::vector<std::byte>& address,
                                     const std::vector<std::byte>& region) {
  std::vector<std::byte> out;
  for (const auto* part : {&address, &region}) {
    const auto n = static_cast<std::uint32_t>(part->size());
    const auto* p = reinterpret_cast<const std::byte*>(&n);
    out.insert(out.end(), p, p + sizeof n);
    out.insert(out.end(), part->begin(), part->end());
  }
  return out;
}

// The record read back, checked: a record is bytes from another process.
std::pair<std::vector<std::byte>, std::vector<std::byte>> open_target_record(
    const std::vector<std::byte>& v) {
  std::vector<std::vector<std::byte>> parts;
  std::size_t at = 0;
  for (int i = 0; i < 2; ++i) {
    std::uint32_t n = 0;
    if (v.size() - at < sizeof n) throw std::runtime_error("target record cut");
    std::memcpy(&n, v.data() + at, sizeof n);
    at += sizeof n;
    if (v.size() - at < n) throw std::runtime_error("target record cut");
    parts.emplace_back(v.begin() + static_cast<std::ptrdiff_t>(at),
                       v.begin() + static_cast<std::ptrdiff_t>(at + n));
    at += n;
  }
  return {parts[0], parts[1]};
}

// A target process: "TRANSPORTS|ETCD_URL|ROOT|NAME|LEASE_MS". Registers the shared memfd, publishes
// its address and region under NAME, says "ready INCARNATION", then waits for "exit" (or for its
// pipe to close).
int run_directory_target(int in, int out, const std::string& arg) {
  const auto a = peer::split_fields(arg);
  ucx::worker_options o;
  o.transports = a.at(0);
  o.close_timeout = std::chrono::milliseconds(300);
  ferry::etcd_options eo;
  eo.endpoints = {a.at(1)};
  eo.root = a.at(2);
  ferry::progress_executor exec;
  ucx::worker w(exec, o);
  ucx::memory_region mem = w.register_memory(peer::shared_memory::map_inherited(region_bytes));
  ferry::etcd_directory dir(exec, eo);
  ferry::publish_options po;
  po.lease = std::chrono::milliseconds(std::stoll(a.at(4)));
  ferry::publication pub =
      dir.publish(a.at(3), target_record(w.address(), mem.describe().to_bytes()), po).get();
  peer::send(out, "ready " + std::to_string(pub.incarnation()));
  for (;;) {
    const auto command = peer::text(peer::receive(in, std::chrono::hours(1)));
    if (command == "exit" || command.empty()) ::_exit(0);
  }
}

[[maybe_unused]] const bool directory_roles =
    peer::role("directory-target", &run_directory_target);

// What named_peer binds: the endpoint and the target's region imported on it.
struct bound_target {
  ucx::endpoint ep;
  ucx::remote_memory mem;
  void sever(std::error_code why) { ep.sever(why); }
};

std::function<bound_target(const ferry::directory_record&)> connect_with(ucx::worker& w) {
  return [&w](const ferry::directory_record& r) {
    auto [address, region] = open_target_record(r.value);
    bound_target t;
    t.ep = w.connect(address);
    t.mem = t.ep.import(ucx::remote_region::from_bytes(region));
    return t;
  };
}

struct started_target {
  std::unique_ptr<peer::process> proc;
  std::uint64_t incarnation = 0;
};

started_target start_target(const std::string& transports, etcd_server& etcd,
                            const std::string& root, const std::string& name, int lease_ms,
                            peer::shared_memory& mem) {
  started_target t;
  t.proc = std::make_unique<peer::process>(
      "directory-target",
      transports + "|" + etcd.url() + "|" + root + "|" + name + "|" + std::to_string(lease_ms),
      mem.fd());
  const std::string ready = peer::text(t.proc->receive(std::chrono::seconds(30)));
  REQUIRE(ready.rfind("ready ", 0) == 0);
  t.incarnation = std::stoull(ready.substr(6));
  return t;
}

bool all_zero(std::span<const std::byte> b) {
  return std::all_of(b.begin(), b.end(), [](std::byte x) { return x == std::byte{0}; });
}

// A batch of puts into every block of the target, one deadline for all.
std::vector<ferry::transfer> put_all(bound_target& t, const ucx::memory_region& src,
                                     std::chrono::seconds deadline) {
  std::vector<ucx::rma_block> b;
  for (std::size_t i = 0; i < blocks; ++i) {
    b.push_back({src.slice(i * block, block), t.mem.slice(i * block, block)});
  }
  std::vector<ferry::transfer> out(b.size());
  t.ep.put_batch(b, out, deadline);
  return out;
}

// One target over tcp with a 1 s lease, published as `name`, and this side bound to it: the setup
// of the tests of a peer that hangs or dies.
struct one_target {
  explicit one_target(const std::string& name)
      : a(start_target("tcp", shared_etcd(), root, name, 1000, mem_a)),
        w(exec, worker_over("tcp")),
        src_bytes(pattern(region_bytes, 3)),
        src(w.register_memory(src_bytes)),
        dir(exec, directory_at(root)),
        target(dir, name, connect_with(w)),
        t(target.get(std::chrono::seconds(10))) {}

  static ucx::worker_options worker_over(const std::string& transports) {
    ucx::worker_options o;
    o.transports = transports;
    o.close_timeout = std::chrono::milliseconds(300);
    return o;
  }
  static ferry::etcd_options directory_at(const std::string& root) {
    ferry::etcd_options o;
    o.endpoints = {shared_etcd().url()};
    o.root = root;
    return o;
  }

  std::string root = fresh_root();
  peer::shared_memory mem_a{region_bytes};
  started_target a;
  ferry::progress_executor exec;
  ucx::worker w;
  std::vector<std::byte> src_bytes;
  ucx::memory_region src;
  ferry::etcd_directory dir;
  ferry::named_peer<bound_target> target;
  bound_target t;
};

}  // namespace

TEST_CASE("a peer restarted under its name mid-batch: the old incarnation's transfers fail with "
          "peer_restarted, the new one's memory is untouched, the next use reaches it",
          "[directory-ucx][concurrency]") {
  if (!etcd_or_skip()) return;
  for (const char* transports : {"tcp", "shm"}) {
    SECTION(transports) {
      etcd_server& etcd = shared_etcd();
      const std::string root = fresh_root();
      peer::shared_memory mem_a(region_bytes), mem_b(region_bytes);
      started_target a = start_target(transports, etcd, root, "decode-0", 2000, mem_a);

      ferry::progress_executor exec;
      ucx::worker w(exec, one_target::worker_over(transports));
      std::vector<std::byte> src_bytes = pattern(region_bytes, 7);
      ucx::memory_region src = w.register_memory(src_bytes);
      ferry::etcd_directory dir(exec, one_target::directory_at(root));
      ferry::named_peer<bound_target> target(dir, "decode-0", connect_with(w));

      bound_target first = target.get(std::chrono::seconds(10));
      CHECK(target.incarnation() == a.incarnation);
      REQUIRE(first.ep.put(src.slice(0, block), first.mem.slice(0, block), hang_bound).wait() ==
              transfer_state::success);
      CHECK(std::memcmp(mem_a.bytes().data(), src_bytes.data(), block) == 0);

      // The old peer hangs; a batch goes out to it with a deadline far away.
      a.proc->kill(SIGSTOP);
      std::vector<ferry::transfer> batch = put_all(first, src, std::chrono::seconds(60));
      const auto restarted_at = clock_type::now();
      started_target b = start_target(transports, etcd, root, "decode-0", 2000, mem_b);
      REQUIRE(b.incarnation > a.incarnation);

      for (ferry::transfer& t : batch) {
        REQUIRE(t.wait_for(std::chrono::seconds(30)) != transfer_state::pending);
        if (t.state() == transfer_state::success) {
          // Over shared memory a put needs nothing of the stopped peer: it landed in A.
          CHECK(std::string(transports) == "shm");
        } else {
          CHECK(t.error() == directory_errc::peer_restarted);
        }
      }
      CHECK(ms_since(restarted_at) < 20000);  // not at the batch's 60 s deadline
      // Over shared memory the batch may all have landed before the watch told of the restart.
      CHECK(wait_until([&] { return target.fenced() == directory_errc::peer_restarted; }));
      // What went to the old endpoint after the fence fails too, with the same reason.
      CHECK(first.ep.put(src.slice(0, block), first.mem.slice(0, block), hang_bound).wait() ==
            transfer_state::failed);
      CHECK(all_zero(mem_b.bytes()));  // no old request touched the new incarnation
      // Over shared memory, while UCX still holds emulated puts to the stopped old peer, a put to
      // the new one on the same worker stalled past its deadline in 2 of 55 runs under load (UCX
      // 1.13; 0 of 30 with the old peer resumed first): see docs/ucx.md. The old peer goes on here,
      // its endpoint already severed, before the new one is used.
      if (std::string(transports) == "shm") a.proc->kill(SIGCONT);

      bound_target second = target.get(std::chrono::seconds(10));
      CHECK(target.incarnation() == b.incarnation);
      CHECK(target.connects() == 2);
      ferry::transfer reached = second.ep.put(src.slice(block, block), second.mem.slice(0, block),
                                              hang_bound);
      (void)reached.wait();
      INFO("the put to the new incarnation: " << reached.error().category().name() << ": "
                                               << reached.error().message());
      REQUIRE(reached.state() == transfer_state::success);
      CHECK(std::memcmp(mem_b.bytes().data(), src_bytes.data() + block, block) == 0);
      CHECK(all_zero(mem_b.bytes().subspan(block)));

      a.proc->kill(SIGCONT);
      a.proc->kill(SIGKILL);
      b.proc->send(std::string("exit"));
      CHECK(b.proc->reap() == 0);
    }
  }
}

TEST_CASE("a peer that hangs loses its lease: its transfers fail with peer_gone within the lease, "
          "not at their deadline",
          "[directory-ucx][concurrency]") {
  if (!etcd_or_skip()) return;
  one_target rig("prefill-3");
  rig.a.proc->kill(SIGSTOP);  // its executor, and so its keepalives, stop with it
  const auto stopped_at = clock_type::now();
  std::vector<ferry::transfer> batch = put_all(rig.t, rig.src, std::chrono::seconds(60));
  for (ferry::transfer& x : batch) {
    REQUIRE(x.wait_for(std::chrono::seconds(30)) == transfer_state::failed);
    CHECK(x.error() == directory_errc::peer_gone);
  }
  // etcd grants at least 2 s for a 1 s lease and expires leases every 500 ms: well under 10 s.
  CHECK(ms_since(stopped_at) < 10000);
  CHECK(rig.target.fenced() == directory_errc::peer_gone);
  try {
    (void)rig.target.get(std::chrono::seconds(5));
    FAIL("a peer whose lease expired was found");
  } catch (const std::system_error& e) {
    CHECK(e.code() == directory_errc::peer_gone);  // it had a peer: not merely not_found
  }
  rig.a.proc->kill(SIGCONT);
  rig.a.proc->kill(SIGKILL);
}

TEST_CASE("a peer killed outright: its transfers fail at once, its name goes with its lease",
          "[directory-ucx][concurrency]") {
  if (!etcd_or_skip()) return;
  one_target rig("prefill-4");
  ferry::watcher gone = rig.dir.watch("prefill-4");
  rig.a.proc->kill(SIGKILL);
  const auto killed_at = clock_type::now();
  std::vector<ferry::transfer> batch = put_all(rig.t, rig.src, std::chrono::seconds(60));
  for (ferry::transfer& x : batch) {
    // UCX sees a peer on this host exit (its pidfd) before the lease goes; elsewhere the lease
    // would end it: either way a peer-gone failure, long before the deadline.
    REQUIRE(x.wait_for(std::chrono::seconds(30)) == transfer_state::failed);
    const std::error_code ec = x.error();
    INFO(ec.category().name() << ": " << ec.message());
    CHECK((ec == directory_errc::peer_gone || ec == ucx::errc::peer_gone));
  }
  const ferry::directory_event ev = gone.next(std::chrono::seconds(15)).get();
  CHECK(ev.what == ferry::directory_event::kind::gone);
  CHECK(ev.record.incarnation == rig.a.incarnation);
  CHECK(ms_since(killed_at) < 15000);
  CHECK(wait_until([&] { return rig.target.fenced() == directory_errc::peer_gone; }));
}

TEST_CASE("in-process directory: a UCX endpoint bound by name is fenced when a new incarnation is "
          "published, and the next use reaches the new worker",
          "[directory-ucx][concurrency]") {
  auto registry = std::make_shared<ferry::local_registry>();
  ferry::progress_executor exec_a, exec_b, exec_c;
  ucx::worker_options o;
  o.transports = "tcp";
  o.close_timeout = std::chrono::milliseconds(300);
  ucx::worker wa(exec_a, o), wb(exec_b, o), wc(exec_c, o);
  std::vector<std::byte> ma(region_bytes), mb(region_bytes);
  ucx::memory_region ra = wa.register_memory(ma), rb = wb.register_memory(mb);
  std::vector<std::byte> src_bytes = pattern(region_bytes, 9);
  ucx::memory_region src = wc.register_memory(src_bytes);

  ferry::local_directory da(exec_a, {}, registry), db(exec_b, {}, registry), dc(exec_c, {}, registry);
  ferry::publication pa =
      da.publish("engine", target_record(wa.address(), ra.describe().to_bytes())).get();
  ferry::named_peer<bound_target> target(dc, "engine", connect_with(wc));
  bound_target first = target.get(std::chrono::seconds(10));
  REQUIRE(first.ep.put(src.slice(0, block), first.mem.slice(0, block), hang_bound).wait() ==
          transfer_state::success);
  CHECK(std::memcmp(ma.data(), src_bytes.data(), block) == 0);

  // The engine restarts under the same name (here: a second client publishes while the first's
  // lease is still live). The fence happens inside the publication.
  ferry::publication pb =
      db.publish("engine", target_record(wb.address(), rb.describe().to_bytes())).get();
  CHECK(pb.incarnation() > pa.incarnation());
  CHECK(target.fenced() == directory_errc::peer_restarted);
  ferry::transfer late = first.ep.put(src.slice(0, block), first.mem.slice(block, block), hang_bound);
  REQUIRE(late.wait_for(hang_bound) == transfer_state::failed);
  CHECK(late.error() == directory_errc::peer_restarted);
  CHECK(all_zero(std::span(ma).subspan(block)));

  bound_target second = target.get(std::chrono::seconds(10));
  CHECK(target.incarnation() == pb.incarnation());
  REQUIRE(second.ep.put(src.slice(block, block), second.mem.slice(0, block), hang_bound).wait() ==
          transfer_state::success);
  CHECK(std::memcmp(mb.data(), src_bytes.data() + block, block) == 0);

  // Withdrawn: the endpoint is fenced with peer_gone.
  REQUIRE(pb.withdraw().wait() == transfer_state::success);
  CHECK(target.fenced() == directory_errc::peer_gone);
  ferry::transfer after = second.ep.put(src.slice(0, block), second.mem.slice(0, block), hang_bound);
  REQUIRE(after.wait_for(hang_bound) == transfer_state::failed);
  CHECK(after.error() == directory_errc::peer_gone);
}
