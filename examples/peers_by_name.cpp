// A peer found by name, and fenced when it restarts. A "prefill" engine publishes its UCX worker
// address and its KV region under the name "prefill/0"; a "decode" engine binds to that name with
// ferry::named_peer and reads a block. The prefill engine then restarts under the same name (a new
// worker, new memory, a greater incarnation): the decode side's endpoint to the old one is severed
// at once, a read still going to it fails with directory_errc::peer_restarted, and the next use
// reaches the new engine.
//
// Both engines are in this process, on the in-process directory (nothing to start). With
// `--etcd URL` the same program runs on an etcd v3 at URL instead (where ferry was built with it).
//
//   peers_by_name [--etcd http://127.0.0.1:2379]

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <ferry/directory.hpp>
#include <ferry/ucx.hpp>
#ifdef FERRY_EXAMPLE_ETCD
#include <ferry/directory/etcd.hpp>
#endif

using namespace std::chrono_literals;
namespace ucx = ferry::ucx;

namespace {

constexpr std::size_t block = 4096;

// One prefill engine: its worker, its KV memory (every byte `fill`) and its publication.
struct prefill_engine {
  ferry::progress_executor exec;
  ucx::worker worker{exec, [] {
                       ucx::worker_options o;
                       o.transports = "tcp";
                       return o;
                     }()};
  std::vector<std::byte> kv;
  ucx::memory_region region;
  std::unique_ptr<ferry::directory> dir;
  ferry::publication me;

  prefill_engine(std::byte fill, const std::function<std::unique_ptr<ferry::directory>(
                                      ferry::progress_executor&)>& make_directory)
      : kv(4 * block, fill), region(worker.register_memory(kv)), dir(make_directory(exec)) {
    // The record: the worker address and the region, each with its length first.
    std::vector<std::byte> record;
    for (const std::vector<std::byte>& part : {worker.address(), region.describe().to_bytes()}) {
      const auto n = static_cast<std::uint32_t>(part.size());
      record.insert(record.end(), reinterpret_cast<const std::byte*>(&n),
                    reinterpret_cast<const std::byte*>(&n) + sizeof n);
      record.insert(record.end(), part.begin(), part.end());
    }
    me = dir->publish("prefill/0", record, {.lease = 3s}).get();
  }
};

// What the decode engine binds to the name: the endpoint and the prefill region imported on it.
struct prefill_link {
  ucx::endpoint ep;
  ucx::remote_memory kv;
  void sever(std::error_code why) { ep.sever(why); }
};

// The record read back: checked, since it came from another engine.
std::vector<std::byte> take_part(const std::vector<std::byte>& v, std::size_t& at) {
  std::uint32_t n = 0;
  if (v.size() - at < sizeof n) throw std::runtime_error("prefill record cut short");
  std::memcpy(&n, v.data() + at, sizeof n);
  at += sizeof n;
  if (v.size() - at < n) throw std::runtime_error("prefill record cut short");
  std::vector<std::byte> part(v.begin() + static_cast<std::ptrdiff_t>(at),
                              v.begin() + static_cast<std::ptrdiff_t>(at + n));
  at += n;
  return part;
}

}  // namespace

int main(int argc, char** argv) {
  std::function<std::unique_ptr<ferry::directory>(ferry::progress_executor&)> make_directory;
  auto registry = std::make_shared<ferry::local_registry>();
  make_directory = [registry](ferry::progress_executor& exec) {
    return std::make_unique<ferry::local_directory>(exec, ferry::directory_options{}, registry);
  };
  if (argc == 3 && std::string(argv[1]) == "--etcd") {
#ifdef FERRY_EXAMPLE_ETCD
    ferry::etcd_options o;
    o.endpoints = {argv[2]};
    o.root = "peers-by-name-example/";
    make_directory = [o](ferry::progress_executor& exec) {
      return std::make_unique<ferry::etcd_directory>(exec, o);
    };
#else
    std::fprintf(stderr, "built without the etcd directory (libcurl, nlohmann-json)\n");
    return 2;
#endif
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: %s [--etcd URL]\n", argv[0]);
    return 2;
  }

  // The decode engine: its own executor, worker and directory client.
  ferry::progress_executor exec;
  ucx::worker_options wo;
  wo.transports = "tcp";
  ucx::worker worker(exec, wo);
  std::vector<std::byte> dst(block);
  ucx::memory_region local = worker.register_memory(dst);
  std::unique_ptr<ferry::directory> dir = make_directory(exec);

  auto prefill = std::make_unique<prefill_engine>(std::byte{1}, make_directory);
  std::printf("prefill/0 published, incarnation %llu\n",
              static_cast<unsigned long long>(prefill->me.incarnation()));

  ferry::named_peer<prefill_link> peer(*dir, "prefill/0", [&](const ferry::directory_record& r) {
    std::size_t at = 0;
    const std::vector<std::byte> address = take_part(r.value, at);
    const std::vector<std::byte> region = take_part(r.value, at);
    prefill_link link;
    link.ep = worker.connect(address);
    link.kv = link.ep.import(ucx::remote_region::from_bytes(region));
    return link;
  });

  // Found by name: read a block of its KV cache.
  prefill_link link = peer.get(5s);
  if (link.ep.get(local.whole(), link.kv.slice(0, block), 5s).wait() != ferry::transfer_state::success ||
      dst.front() != std::byte{1}) {
    std::printf("FAILED: the first read\n");
    return 1;
  }
  std::printf("decode read a block from incarnation %llu\n",
              static_cast<unsigned long long>(peer.incarnation()));

  // The prefill engine restarts under its name (the old one still holds its lease: a restart
  // faster than the lease, as orchestrators do it). The decode side is fenced at once.
  auto restarted = std::make_unique<prefill_engine>(std::byte{2}, make_directory);
  std::printf("prefill/0 restarted, incarnation %llu\n",
              static_cast<unsigned long long>(restarted->me.incarnation()));
  // In-process the fence happened inside that publication; with etcd the change comes through the
  // watch stream a moment later.
  for (int i = 0; i < 500 && peer.fenced() != ferry::directory_errc::peer_restarted; ++i) {
    std::this_thread::sleep_for(10ms);
  }
  ferry::transfer stale = link.ep.get(local.whole(), link.kv.slice(0, block), 30s);
  (void)stale.wait_for(10s);
  std::printf("a read still going to the old incarnation: %s (%s)\n",
              stale.state() == ferry::transfer_state::failed ? "failed" : "NOT failed",
              stale.error().message().c_str());
  const bool fenced = stale.state() == ferry::transfer_state::failed &&
                      stale.error() == ferry::directory_errc::peer_restarted;

  // The next use reaches the new engine.
  link = peer.get(5s);
  const bool reached = link.ep.get(local.whole(), link.kv.slice(0, block), 5s).wait() ==
                           ferry::transfer_state::success &&
                       dst.front() == std::byte{2};
  std::printf("decode read a block from incarnation %llu: %s (%llu endpoints made)\n",
              static_cast<unsigned long long>(peer.incarnation()), reached ? "ok" : "FAILED",
              static_cast<unsigned long long>(peer.connects()));
  prefill.reset();
  restarted.reset();
  return fenced && reached ? 0 : 1;
}
