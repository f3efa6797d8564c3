#pragma once
// ferry-perf's command line: the configuration every mode reads, sizes with K/M/G suffixes and
// power-of-two ranges, and the usage text. A bad argument throws usage_error (exit status 2), naming
// the option and the value; every number is read whole and range-checked (numbers.hpp).

#include <arpa/inet.h>
#include <netinet/in.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "numbers.hpp"

namespace ferry_perf {

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline const char* usage_text() {
  return R"(usage:
  ferry-perf target    --backend tcp|ucx|verbs --listen HOST:PORT [--once]
                       [--etcd URL --publish NAME] [options]
  ferry-perf initiator --backend tcp|ucx|verbs (--connect HOST:PORT | --etcd URL --find NAME)
                       [options]
  ferry-perf file      --path FILE [--direct] [options]
  ferry-perf --help

The target serves initiators one run at a time on HOST:PORT (a control connection; the data goes
over a second port the target picks and tells the initiator). The initiator measures and reports
both sides, the target's CPU time included.

finding the target by name (where ferry-perf was built with the etcd directory):
  --etcd URL[,URL...]        etcd's client URLs (http://127.0.0.1:2379)
  --publish NAME             target: publish its control address under NAME, on a lease its
                             executor renews; the name goes when the target exits. With it,
                             --listen HOST:0 listens on any free port
  --find NAME                initiator: look NAME up and connect to the target published there

options (initiator and file, except where marked; a target takes --executor, --timeout for its
control exchanges, and for verbs --device and --gid-index):
  --op read|write            what each block does (default write). tcp: a write is a framed block
                             sent and acknowledged by the target; a read asks the target for one.
                             ucx: one-sided put (landed) or get. verbs: RDMA WRITE or READ.
                             file: io_uring read or write.
  --block-size S[:S2]        block size, K/M/G suffixes (default 1M); S:S2 sweeps powers of two
  --batch N                  blocks awaited together with one when_all (default 1)
  --depth N                  batches in flight per thread (default 4)
  --threads N                submitting threads, each with its own connection (default 1)
  --executor busy|adaptive|park   the progress executor's mode (default adaptive)
  --duration S               seconds per block size (default 3)
  --workload stream|latency|kv    (default stream)
        stream:  bandwidth and operations per second
        latency: completion -> resume of one block at a time (batch 1, depth 1 per thread):
                 p50, p90, p99, p99.9
        kv:      a step is --layers L layers of --requests R requests of --batch blocks each, all
                 submitted at once; each layer is awaited with when_all and --timeout while later
                 layers stream in. Reports step time and when each layer became ready.
  --layers L --requests R    the kv step's shape (default 8 and 2)
  --timeout S                deadline of every batch, connect and control exchange (default 5)
  --transport T              ucx: UCX's TLS setting (default tcp)
  --put-completion landed|source-reusable
                             initiator, ucx writes: a put ends once its data is in the target's
                             memory (the put and a flush, default), or once only its source may be
                             reused
  --device NAME              verbs, initiator and target: the RDMA device (default: the first one)
  --gid-index N              verbs, initiator and target: the source GID on RoCE (default 0)
  --file-size S              file: bytes of the file the blocks are placed in (default 256M)
  --check                    initiator and file: fill every block written with a pattern made from
                             the run's seed, the thread and the block, and verify every byte moved
                             (reads on the initiator, each block as it completes; writes on the
                             target, or read back from the file, after the run). A mismatch fails
                             the run, naming the block and the byte. Without --check ferry-perf
                             trusts each transfer's completion status and looks at no data. The
                             checking is part of the figures (see docs/ferry-perf.md)
  --no-metrics               do not record ferry's metrics (metrics.hpp) in the backend
  --json FILE                every figure, the configuration and the metrics, as JSON
  --plot FILE.svg            bandwidth against block size, the latency distribution (latency), step
                             times and when each layer was ready (kv)
  --prometheus FILE          the backend's metrics in the Prometheus text format, after the run

backends: tcp (io_uring TCP), ucx (UCX one-sided RMA) and verbs (RC queue pairs on an RDMA
adapter, connected over ferry's TCP side channel; the target's --listen HOST must be numeric),
where ferry was built with them; file is io_uring on one host.

exit status: 0 success, 1 a run failed (the target went away, a deadline passed, --check found a
mismatch), 2 bad arguments. A failed run prints no result row, and one line saying what failed.
)";
}

struct config {
  std::string mode;  // target, initiator, file
  std::string backend = "tcp";
  std::string listen;
  std::string connect;
  std::vector<std::string> etcd;  // --etcd: the directory's endpoints
  std::string publish;            // --publish NAME (target)
  std::string find;               // --find NAME (initiator)
  std::string path;
  bool direct = false;
  bool once = false;
  std::string op = "write";
  std::vector<std::size_t> sizes{std::size_t{1} << 20};
  std::string size_text = "1M";
  std::size_t batch = 1;
  std::size_t depth = 4;
  std::size_t threads = 1;
  std::string executor = "adaptive";
  double duration = 3;
  std::string workload = "stream";
  std::size_t layers = 8;
  std::size_t requests = 2;
  double timeout = 5;
  std::string transport = "tcp";
  std::string device;
  int gid_index = 0;
  std::string put_completion = "landed";
  // Given on the command line, so checked against --backend.
  bool put_completion_given = false;
  bool device_given = false;
  bool gid_index_given = false;
  std::size_t file_size = std::size_t{256} << 20;
  bool metrics = true;
  bool check = false;
  std::string json;
  std::string plot;
  std::string prometheus;
  std::vector<std::string> argv;
};

// The most memory the buffers of a run may take on either side: the initiator's threads × blocks
// in flight × block size, and the target's region or buffers of the same size.
constexpr std::uint64_t most_buffer_bytes = std::uint64_t{8} << 30;

// "4096", "4K", "4KB", "4KiB" (K, M and G are powers of 1024); at least 1 byte, at most 1 TiB.
inline std::size_t parse_size(std::string_view text, const std::string& what) {
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  std::string_view suffix = text.substr(digits);
  unsigned shift = 0;
  if (!suffix.empty()) {
    switch (suffix.front()) {
      case 'K': case 'k': shift = 10; break;
      case 'M': case 'm': shift = 20; break;
      case 'G': case 'g': shift = 30; break;
      default: shift = 64;
    }
    suffix.remove_prefix(1);
    if (suffix != "" && suffix != "B" && suffix != "iB") shift = 64;
  }
  const std::optional<std::uint64_t> v = parse_whole(text.substr(0, digits));
  if (!v || shift == 64) {
    throw usage_error(what + ": " + in_quotes(text) + " is not a size (a whole number of bytes, or with K, M or G)");
  }
  if (*v == 0 || *v > (std::uint64_t{1} << 40) >> shift) {
    throw usage_error(what + ": " + in_quotes(text) + " is not a size from 1 byte to 1T");
  }
  return static_cast<std::size_t>(*v << shift);
}

// "4K" or "4K:16M" (powers of two from the first up to at most the second).
inline std::vector<std::size_t> parse_sizes(std::string_view text) {
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) return {parse_size(text, "--block-size")};
  const std::size_t lo = parse_size(text.substr(0, colon), "--block-size");
  const std::size_t hi = parse_size(text.substr(colon + 1), "--block-size");
  if (hi < lo) throw usage_error("--block-size: the range's end is below its start");
  std::vector<std::size_t> out;
  for (std::size_t s = lo; s <= hi; s *= 2) out.push_back(s);
  return out;
}

// UCX's TLS setting ("tcp", "rc,ud", "^shm"). It crosses the control connection as one field of a
// line: no spaces, no '='.
[[nodiscard]] inline bool is_transport_list(const std::string& t) {
  constexpr const char* allowed = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_,^:.-";
  return !t.empty() && t.size() <= 128 && t.find_first_not_of(allowed) == std::string::npos;
}

// Blocks in flight per submitting thread: each has its own slot in the thread's buffers.
[[nodiscard]] inline std::size_t slots_per_thread(const config& c) {
  return c.workload == "kv" ? c.layers * c.requests * c.batch : c.batch * c.depth;
}

inline std::size_t parse_count(const std::string& text, const std::string& what, std::size_t max) {
  const std::optional<std::uint64_t> v = parse_whole(text);
  if (!v || *v == 0 || *v > max) {
    throw usage_error(what + ": " + in_quotes(text) + " is not a whole number from 1 to " + std::to_string(max));
  }
  return static_cast<std::size_t>(*v);
}

// At least a millisecond: the control connection's deadlines count whole milliseconds, and a
// shorter one would expire before it was armed.
inline double parse_seconds(const std::string& text, const std::string& what) {
  const std::optional<double> v = parse_real(text);
  if (!v || *v < 0.001 || *v > 86400) {
    throw usage_error(what + ": " + in_quotes(text) + " is not a number of seconds from 0.001 to 86400");
  }
  return *v;
}

// Port 0 (`any_port`: a target that publishes its address by name) means any free port.
inline void split_host_port(const std::string& text, const std::string& what, std::string& host,
                            std::uint16_t& port, bool any_port = false) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    throw usage_error(what + ": '" + text + "' is not HOST:PORT");
  }
  host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (any_port && text.substr(colon + 1) == "0") {
    port = 0;
    return;
  }
  const std::size_t p = parse_count(text.substr(colon + 1), what + " port", 65535);
  port = static_cast<std::uint16_t>(p);
}

inline config parse(int argc, char** argv) {
  config c;
  for (int i = 0; i < argc; ++i) c.argv.emplace_back(argv[i]);
  if (argc < 2) throw usage_error("a mode is needed: target, initiator or file");
  c.mode = argv[1];
  if (c.mode != "target" && c.mode != "initiator" && c.mode != "file") {
    throw usage_error("unknown mode '" + c.mode + "'");
  }
  for (int i = 2; i < argc; ++i) {
    std::string key = argv[i];
    std::string value;
    const bool has_inline = key.rfind("--", 0) == 0 && key.find('=') != std::string::npos;
    if (has_inline) {
      value = key.substr(key.find('=') + 1);
      key = key.substr(0, key.find('='));
    }
    auto need = [&]() -> std::string {
      if (has_inline) return value;
      if (i + 1 >= argc) throw usage_error(key + " needs a value");
      return argv[++i];
    };
    if (key == "--backend") {
      c.backend = need();
      if (c.backend != "tcp" && c.backend != "ucx" && c.backend != "verbs") {
        throw usage_error("--backend: '" + c.backend + "' is not tcp, ucx or verbs");
      }
    } else if (key == "--listen") {
      c.listen = need();
    } else if (key == "--connect") {
      c.connect = need();
    } else if (key == "--etcd") {
      const std::string v = need();
      c.etcd.clear();
      for (std::size_t at = 0; at <= v.size();) {
        const std::size_t comma = std::min(v.find(',', at), v.size());
        const std::string url = v.substr(at, comma - at);
        if (url.rfind("http://", 0) != 0 && url.rfind("https://", 0) != 0) {
          throw usage_error("--etcd: " + in_quotes(url) + " is not an http:// or https:// URL");
        }
        c.etcd.push_back(url);
        at = comma + 1;
      }
    } else if (key == "--publish") {
      c.publish = need();
    } else if (key == "--find") {
      c.find = need();
    } else if (key == "--path") {
      c.path = need();
    } else if (key == "--direct") {
      c.direct = true;
    } else if (key == "--once") {
      c.once = true;
    } else if (key == "--op") {
      c.op = need();
      if (c.op != "read" && c.op != "write") throw usage_error("--op: '" + c.op + "' is not read or write");
    } else if (key == "--block-size") {
      c.size_text = need();
      c.sizes = parse_sizes(c.size_text);
    } else if (key == "--batch") {
      c.batch = parse_count(need(), "--batch", 4096);
    } else if (key == "--depth") {
      c.depth = parse_count(need(), "--depth", 1024);
    } else if (key == "--threads") {
      c.threads = parse_count(need(), "--threads", 64);
    } else if (key == "--executor") {
      c.executor = need();
      if (c.executor != "busy" && c.executor != "adaptive" && c.executor != "park") {
        throw usage_error("--executor: '" + c.executor + "' is not busy, adaptive or park");
      }
    } else if (key == "--duration") {
      c.duration = parse_seconds(need(), "--duration");
    } else if (key == "--workload") {
      c.workload = need();
      if (c.workload != "stream" && c.workload != "latency" && c.workload != "kv") {
        throw usage_error("--workload: '" + c.workload + "' is not stream, latency or kv");
      }
    } else if (key == "--layers") {
      c.layers = parse_count(need(), "--layers", 1024);
    } else if (key == "--requests") {
      c.requests = parse_count(need(), "--requests", 1024);
    } else if (key == "--timeout") {
      c.timeout = parse_seconds(need(), "--timeout");
    } else if (key == "--transport") {
      c.transport = need();
      if (!is_transport_list(c.transport)) {
        throw usage_error("--transport: " + in_quotes(c.transport) +
                          " is not a UCX transport list (letters, digits and _ , ^ : . -)");
      }
    } else if (key == "--put-completion") {
      c.put_completion = need();
      c.put_completion_given = true;
      if (c.put_completion != "landed" && c.put_completion != "source-reusable") {
        throw usage_error("--put-completion: '" + c.put_completion + "' is not landed or source-reusable");
      }
    } else if (key == "--device") {
      c.device = need();
      c.device_given = true;
    } else if (key == "--gid-index") {
      const std::string v = need();
      const std::optional<std::uint64_t> n = parse_whole(v);
      if (!n || *n > 255) throw usage_error("--gid-index: " + in_quotes(v) + " is not a GID index from 0 to 255");
      c.gid_index = static_cast<int>(*n);
      c.gid_index_given = true;
    } else if (key == "--file-size") {
      c.file_size = parse_size(need(), "--file-size");
    } else if (key == "--check") {
      c.check = true;
    } else if (key == "--no-metrics") {
      c.metrics = false;
    } else if (key == "--json") {
      c.json = need();
    } else if (key == "--plot") {
      c.plot = need();
    } else if (key == "--prometheus") {
      c.prometheus = need();
    } else {
      throw usage_error("unknown option '" + key + "'");
    }
  }
  if (c.mode == "target" && c.listen.empty()) throw usage_error("target needs --listen HOST:PORT");
  if (c.mode == "initiator" && c.connect.empty() == c.find.empty()) {
    throw usage_error("initiator needs --connect HOST:PORT or --find NAME (one of them)");
  }
  if (!c.publish.empty() && c.mode != "target") throw usage_error("--publish is the target's");
  if (!c.find.empty() && c.mode != "initiator") throw usage_error("--find is the initiator's");
  if ((!c.publish.empty() || !c.find.empty()) && c.etcd.empty()) {
    throw usage_error(std::string(c.publish.empty() ? "--find" : "--publish") +
                      " needs --etcd URL: the directory the name is in");
  }
  for (const std::string* name : {&c.publish, &c.find}) {
    for (const char ch : *name) {
      const bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                      ch == '.' || ch == '_' || ch == '-' || ch == ':' || ch == '/';
      if (!ok || name->size() > 255) {
        throw usage_error(in_quotes(*name) + " is not a directory name (1 to 255 of A-Z a-z 0-9 . _ - : /)");
      }
    }
  }
  if (c.mode == "file" && c.path.empty()) throw usage_error("file needs --path FILE");
  const std::string used = c.mode == "file" ? "file" : c.backend;
  if (c.put_completion_given && used != "ucx") {
    throw usage_error("--put-completion applies to --backend ucx, not " + used);
  }
  if (c.put_completion_given && c.mode != "initiator") {
    throw usage_error("--put-completion is the initiator's: the target's memory takes the puts either way");
  }
  if (c.put_completion_given && c.op != "write") {
    throw usage_error("--put-completion applies to --op write (puts), not " + c.op);
  }
  if ((c.device_given || c.gid_index_given) && used != "verbs") {
    throw usage_error(std::string(c.device_given ? "--device" : "--gid-index") +
                      " applies to --backend verbs, not " + used);
  }
  if (c.mode == "target" && c.backend == "verbs") {
    std::string host;
    std::uint16_t port = 0;
    split_host_port(c.listen, "--listen", host, port, !c.publish.empty());
    in6_addr any{};
    if (::inet_pton(AF_INET, host.c_str(), &any) != 1 && ::inet_pton(AF_INET6, host.c_str(), &any) != 1) {
      throw usage_error("--listen: a verbs target needs a numeric address to listen on, not '" + host + "'");
    }
  }
  if (c.check && c.mode == "target") {
    throw usage_error("--check is the initiator's: a target checks the runs whose initiator asks it to");
  }
  if (c.check && c.put_completion == "source-reusable") {
    throw usage_error("--check needs --put-completion landed: a put that ended when its source could be reused "
                      "may not be in the target's memory yet when the target checks it");
  }
  if (c.workload == "latency") {
    c.batch = 1;
    c.depth = 1;
  }
  if (c.mode != "target") {
    // Each factor checked against what is left, so that the product cannot wrap.
    const std::uint64_t block = *std::max_element(c.sizes.begin(), c.sizes.end());
    const std::uint64_t slots = slots_per_thread(c);
    if (slots > most_buffer_bytes / block || c.threads > most_buffer_bytes / (slots * block)) {
      const std::string in_flight = c.workload == "kv" ? "--layers × --requests × --batch" : "--batch × --depth";
      throw usage_error("--block-size " + c.size_text + ": blocks of " + std::to_string(block) + " bytes × " +
                        std::to_string(slots) + " in flight per thread (" + in_flight + ") × " +
                        std::to_string(c.threads) + " --threads need more than the 8 GiB of buffers ferry-perf "
                        "gives a run");
    }
  }
  return c;
}

}  // namespace ferry_perf
