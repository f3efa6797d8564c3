#pragma once
// Finding the target by name (--etcd, --publish, --find): the target publishes its control address
// in ferry's etcd directory on a lease its own progress executor renews; the initiator looks the
// name up and connects there. The record is one line,
// "ferry-perf-target version=1 backend=B control=HOST:PORT",
// read back with the same checks as any line from a peer.

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "cli.hpp"
#include "control.hpp"

#if FERRY_PERF_HAVE_ETCD
#include <ferry/directory/etcd.hpp>
#endif

namespace ferry_perf {

#if FERRY_PERF_HAVE_ETCD
// What a target holds while it is published: its executor, its directory and the publication.
struct published_target {
  ferry::progress_executor exec;
  std::unique_ptr<ferry::etcd_directory> dir;
  ferry::publication pub;
};

inline ferry::etcd_options etcd_options_of(const config& c) {
  ferry::etcd_options o;
  o.endpoints = c.etcd;
  o.root = "ferry-perf/";
  o.request_timeout = std::chrono::milliseconds(static_cast<long long>(c.timeout * 1000));
  return o;
}

inline std::unique_ptr<published_target> publish_target(const config& c, const std::string& host,
                                                        std::uint16_t port) {
  auto t = std::make_unique<published_target>();
  t->dir = std::make_unique<ferry::etcd_directory>(t->exec, etcd_options_of(c));
  const std::string control = (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
                              std::to_string(port);
  const std::string line = "ferry-perf-target version=1 backend=" + c.backend + " control=" + control;
  ferry::publish_options po;
  po.lease = std::chrono::milliseconds(5000);
  po.timeout = std::chrono::milliseconds(static_cast<long long>(c.timeout * 1000));
  t->pub = t->dir->publish(c.publish, std::as_bytes(std::span(line.data(), line.size())), po).get();
  std::fprintf(stderr, "ferry-perf target: published as %s (incarnation %llu) at %s\n",
               c.publish.c_str(), static_cast<unsigned long long>(t->pub.incarnation()),
               control.c_str());
  return t;
}

// The control address published under --find, checked: the record is bytes from someone else.
inline std::string find_target(const config& c) {
  ferry::progress_executor exec;
  ferry::etcd_directory dir(exec, etcd_options_of(c));
  const ferry::directory_record r =
      dir.lookup(c.find, std::chrono::milliseconds(static_cast<long long>(c.timeout * 1000))).get();
  const std::string line(reinterpret_cast<const char*>(r.value.data()), r.value.size());
  const control_line l = control_line::parse(line, "ferry-perf-target", {"version", "backend", "control"});
  (void)l.whole("version", 1, 1);
  if (l.text("backend") != c.backend) {
    throw control_error("the target published as " + c.find + " runs --backend " + l.text("backend") +
                        ", not " + c.backend);
  }
  return l.text("control");
}
#else
struct published_target {};
inline std::unique_ptr<published_target> publish_target(const config&, const std::string&, std::uint16_t) {
  throw usage_error("--publish: this ferry-perf was built without the etcd directory (libcurl, nlohmann-json)");
}
inline std::string find_target(const config&) {
  throw usage_error("--find: this ferry-perf was built without the etcd directory (libcurl, nlohmann-json)");
}
#endif

}  // namespace ferry_perf
