#pragma once
// The etcd v3 directory, for clusters: leases are etcd leases, watches are etcd watches.
//
// It talks to etcd's JSON gateway (the /v3/... HTTP endpoints every etcd 3.4 serves beside gRPC)
// through libcurl's multi interface, driven by the progress executor: the directory is a completion
// source whose descriptor is an epoll set of curl's sockets, and curl's timers are the directory's
// own. Why the gateway and libcurl rather than gRPC: the gateway is the same API (keys, leases,
// transactions, watch streams) with nothing generated at build time; libcurl is in every
// distribution and its multi interface never blocks, so it runs on the executor like any backend;
// gRPC's C++ library would bring its own threads and completion queues, protobuf code generated from
// etcd's .proto files (which Debian does not ship), and a second event loop beside ferry's.
//
// Keys, under options.root (default "ferry/"):
//   <root>records/<name>        the record envelope (record.hpp), attached to the publisher's lease
//   <root>incarnations/<name>   the name's last incarnation, 20 decimal digits
// Publish: claim the next incarnation with a compare-and-swap on the counter; grant a lease; put the
// record on the lease in a transaction that requires the counter to still hold this incarnation (a
// newer publisher always wins: the older one ends with directory_errc::superseded).
// Keepalive: /v3/lease/keepalive every third of the lease (retried after a tenth when etcd did not
// answer); a lease etcd no longer knows (etcd lost its data, or the lease expired while etcd was
// unreachable) is granted again and the record put back under the same incarnation, with the
// counter too if etcd lost it (publication::republished counts it); superseded if a newer
// incarnation holds the name by then.
// Withdraw: revoke the lease, which deletes the record if it is still ours (a newer incarnation's
// record is on its own lease and stays).
// Lookups: transactions of up to 64 range reads, etcd_options::max_connections of them at once
// (more wait in order; a request's timeout counts from when it goes out).
// Watches: one watch stream per directory on <root>records/, its events handed to every watcher
// whose name or prefix matches. When the stream breaks (etcd stopped, restarted, a compaction) it is
// opened again with backoff: all records are read, compared with what watchers were told (gone and
// published events for the differences), and the stream resumes after that read's revision.
// Nothing read from etcd is trusted: values go through decode_record, JSON through a parser that
// does not throw, base64 through a checked decoder.

#include <curl/curl.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/directory/directory.hpp"

namespace ferry {

/// Where an etcd_directory finds etcd, and how it waits for it.
struct etcd_options {
  /// etcd's client URLs ("http://127.0.0.1:2379"); on a failed connection the next one is tried.
  std::vector<std::string> endpoints{"http://127.0.0.1:2379"};
  /// The prefix every key is under, so that several clusters can share one etcd.
  std::string root = "ferry/";
  /// Bounds each request to etcd (a call's own deadline, when sooner, bounds it instead).
  std::chrono::milliseconds request_timeout{3000};
  /// The first wait before the watch stream is opened again after it broke; doubled each failure.
  std::chrono::milliseconds reconnect_min{100};
  /// The longest wait between attempts to open the watch stream again.
  std::chrono::milliseconds reconnect_max{2000};
  /// Requests to etcd at once (a lookup of many names is cut into transactions of 64).
  long max_connections = 8;
};

namespace detail {

inline constexpr char base64_alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

[[nodiscard]] inline std::string base64_encode(std::string_view in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 3 <= in.size(); i += 3) {
    const std::uint32_t v = (std::uint32_t(std::uint8_t(in[i])) << 16) |
                            (std::uint32_t(std::uint8_t(in[i + 1])) << 8) | std::uint8_t(in[i + 2]);
    out += base64_alphabet[(v >> 18) & 63];
    out += base64_alphabet[(v >> 12) & 63];
    out += base64_alphabet[(v >> 6) & 63];
    out += base64_alphabet[v & 63];
  }
  if (i + 1 == in.size()) {
    const std::uint32_t v = std::uint32_t(std::uint8_t(in[i])) << 16;
    out += base64_alphabet[(v >> 18) & 63];
    out += base64_alphabet[(v >> 12) & 63];
    out += "==";
  } else if (i + 2 == in.size()) {
    const std::uint32_t v =
        (std::uint32_t(std::uint8_t(in[i])) << 16) | (std::uint32_t(std::uint8_t(in[i + 1])) << 8);
    out += base64_alphabet[(v >> 18) & 63];
    out += base64_alphabet[(v >> 12) & 63];
    out += base64_alphabet[(v >> 6) & 63];
    out += '=';
  }
  return out;
}

// False for anything that is not canonical padded base64.
[[nodiscard]] inline bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  if (in.size() % 4 != 0) return false;
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.reserve(in.size() / 4 * 3);
  for (std::size_t i = 0; i < in.size(); i += 4) {
    const bool last = i + 4 == in.size();
    const int pad = last ? (in[i + 3] == '=' ? (in[i + 2] == '=' ? 2 : 1) : 0) : 0;
    std::uint32_t v = 0;
    for (std::size_t k = 0; k < 4; ++k) {
      const int d = k >= 4 - static_cast<std::size_t>(pad) ? 0 : value(in[i + k]);
      if (d < 0) return false;
      v = (v << 6) | static_cast<std::uint32_t>(d);
    }
    out += static_cast<char>((v >> 16) & 0xff);
    if (pad < 2) out += static_cast<char>((v >> 8) & 0xff);
    if (pad < 1) out += static_cast<char>(v & 0xff);
  }
  return true;
}

// The first key after every key that starts with `prefix` (etcd's range_end for a prefix).
[[nodiscard]] inline std::string prefix_end(std::string prefix) {
  while (!prefix.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(prefix.back());
    if (c < 0xff) {
      ++c;
      return prefix;
    }
    prefix.pop_back();
  }
  return std::string(1, '\0');  // every key
}

// An int64 etcd sends as a JSON string (or a number); 0 when absent or malformed.
[[nodiscard]] inline std::int64_t json_int(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return 0;
  auto it = j.find(key);
  if (it == j.end()) return 0;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (!it->is_string()) return 0;
  const std::string& s = it->get_ref<const std::string&>();
  std::int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9' || v > (INT64_MAX - 9) / 10) return 0;
    v = v * 10 + (c - '0');
  }
  return v;
}

[[nodiscard]] inline const nlohmann::json* json_member(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() ? nullptr : &*it;
}

[[nodiscard]] inline std::string json_string(const nlohmann::json& j, const char* key) {
  const nlohmann::json* m = json_member(j, key);
  return m != nullptr && m->is_string() ? m->get<std::string>() : std::string{};
}

}  // namespace detail

/// The etcd v3 directory (see the top of this header). Needs libcurl; etcd 3.4 or later.
class etcd_directory final : public directory {
 public:
  /// Connects nothing yet: the first call does. `exec` must outlive it. Throws
  /// std::invalid_argument for options that cannot work, std::runtime_error if curl cannot start.
  explicit etcd_directory(progress_executor& exec, etcd_options options = {},
                          directory_options limits = {})
      : directory(exec, limits), options_(std::move(options)) {
    if (options_.endpoints.empty()) {
      throw std::invalid_argument("ferry::etcd_options: no endpoints");
    }
    for (std::string& e : options_.endpoints) {
      while (!e.empty() && e.back() == '/') e.pop_back();
      if (e.rfind("http://", 0) != 0 && e.rfind("https://", 0) != 0) {
        throw std::invalid_argument("ferry::etcd_options: endpoint '" + e +
                                    "' is not an http:// or https:// URL");
      }
    }
    if (options_.request_timeout <= std::chrono::milliseconds(0) ||
        options_.reconnect_min <= std::chrono::milliseconds(0) ||
        options_.reconnect_max < options_.reconnect_min || options_.max_connections < 1) {
      throw std::invalid_argument(
          "ferry::etcd_options: request_timeout and reconnect_min must be positive, reconnect_max at "
          "least reconnect_min, max_connections at least 1");
    }
    if (std::string why = check_directory_name(options_.root, true); !why.empty()) {
      throw std::invalid_argument("ferry::etcd_options: root '" + options_.root + "': " + why);
    }
    static const CURLcode global = ::curl_global_init(CURL_GLOBAL_DEFAULT);
    if (global != CURLE_OK) throw std::runtime_error("ferry::etcd_directory: curl_global_init failed");
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (epoll_ < 0) throw std::system_error(errno, std::system_category(), "ferry: epoll_create1");
    multi_ = ::curl_multi_init();
    if (multi_ == nullptr) {
      ::close(epoll_);
      throw std::runtime_error("ferry::etcd_directory: curl_multi_init failed");
    }
    ::curl_multi_setopt(multi_, CURLMOPT_SOCKETFUNCTION, &etcd_directory::on_socket);
    ::curl_multi_setopt(multi_, CURLMOPT_SOCKETDATA, this);
    ::curl_multi_setopt(multi_, CURLMOPT_TIMERFUNCTION, &etcd_directory::on_curl_timer);
    ::curl_multi_setopt(multi_, CURLMOPT_TIMERDATA, this);
    // The watch stream holds one connection of its own beyond these.
    ::curl_multi_setopt(multi_, CURLMOPT_MAX_HOST_CONNECTIONS, options_.max_connections + 1);
    start();
  }

  /// Withdraws what it still publishes (waiting up to a second for etcd), ends its watches.
  ~etcd_directory() override {
    stop(std::chrono::milliseconds(1000));
    for (auto& [easy, c] : calls_) {
      ::curl_multi_remove_handle(multi_, easy);
      ::curl_easy_cleanup(easy);
      if (c->headers != nullptr) ::curl_slist_free_all(c->headers);
    }
    calls_.clear();
    ::curl_multi_cleanup(multi_);
    ::close(epoll_);
  }

  /// The options it was made with.
  [[nodiscard]] const etcd_options& etcd() const noexcept { return options_; }

  /// Times the watch stream was opened (1 once it is up; more after etcd went away and came back).
  [[nodiscard]] std::uint64_t watch_streams() const noexcept {
    return streams_opened_.load(std::memory_order_relaxed);
  }

 private:
  // One HTTP request to etcd.
  struct call {
    etcd_directory* owner = nullptr;
    std::string url;  // the endpoint it went to, and the path
    std::string path;  // "/v3/kv/put"
    std::string body;
    std::string response;
    curl_slist* headers = nullptr;
    bool stream = false;  // the watch: lines handed to on_line as they arrive
    std::size_t max_response = 64u << 20;
    // Ends the call: transport error text (empty on success), HTTP status, the parsed body.
    std::function<void(const std::string& failure, long status, const nlohmann::json& body)> done;
  };

  using json = nlohmann::json;

  // ---- HTTP through curl's multi interface (executor thread)
  // A request waiting for one of the max_connections: its timeout counts from when it goes out, not
  // from when it was queued (curl's would count the wait for a connection too).
  struct queued_request {
    std::string path;
    json body;
    clock::time_point deadline;
    std::function<void(const std::string&, long, const json&)> done;
  };

  void request(std::string path, const json& body, clock::time_point deadline,
               std::function<void(const std::string&, long, const json&)> done,
               bool stream = false) {
    if (!stream && in_flight_ >= options_.max_connections) {
      waiting_.push_back({std::move(path), body, deadline, std::move(done)});
      return;
    }
    if (!stream) ++in_flight_;
    auto c = std::make_unique<call>();
    c->path = std::move(path);
    c->body = body.dump();
    c->done = std::move(done);
    c->stream = stream;
    c->owner = this;
    CURL* easy = ::curl_easy_init();
    if (easy == nullptr) {
      if (!stream) --in_flight_;
      c->done("curl_easy_init failed", 0, json());
      return;
    }
    c->url = options_.endpoints[endpoint_index_ % options_.endpoints.size()] + c->path;
    const std::string& url = c->url;
    c->headers = ::curl_slist_append(nullptr, "Content-Type: application/json");
    // The watch: etcd closes it when its member loses the cluster's leader (rather than serving a
    // stream no event will come through), so that it is opened again on a member that has one.
    if (stream) c->headers = ::curl_slist_append(c->headers, "Grpc-Metadata-hasleader: true");
    ::curl_easy_setopt(easy, CURLOPT_URL, url.c_str());
    ::curl_easy_setopt(easy, CURLOPT_HTTPHEADER, c->headers);
    ::curl_easy_setopt(easy, CURLOPT_POSTFIELDS, c->body.c_str());
    ::curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, static_cast<long>(c->body.size()));
    ::curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    ::curl_easy_setopt(easy, CURLOPT_TCP_KEEPALIVE, 1L);
    // A connection gone quiet (a peer host gone, a half-open socket) is noticed in seconds.
    ::curl_easy_setopt(easy, CURLOPT_TCP_KEEPIDLE, 5L);
    ::curl_easy_setopt(easy, CURLOPT_TCP_KEEPINTVL, 2L);
    ::curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.request_timeout.count()));
    if (!stream) {
      auto bound = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
      if (deadline == clock::time_point::max() || bound > options_.request_timeout) {
        bound = options_.request_timeout;
      }
      ::curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, std::max<long>(1, static_cast<long>(bound.count())));
    }
    ::curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, &etcd_directory::on_data);
    ::curl_easy_setopt(easy, CURLOPT_WRITEDATA, c.get());
    calls_.emplace(easy, std::move(c));
    if (::curl_multi_add_handle(multi_, easy) != CURLM_OK) {
      finish(easy, CURLE_FAILED_INIT);
    }
  }

  // curl's write callback (inside curl_multi_socket_action, on the executor thread).
  static size_t on_data(char* data, size_t size, size_t n, void* call_ptr) {
    auto* c = static_cast<call*>(call_ptr);
    const std::size_t bytes = size * n;
    if (c->response.size() + bytes > c->max_response) return 0;  // curl fails the transfer
    c->response.append(data, bytes);
    // A watch etcd cancelled (a compaction, or the server's own reasons) fails the transfer: the
    // stream is then opened again after a resync.
    if (c->stream && !c->owner->drain_stream_lines(*c)) return 0;
    return bytes;
  }

  void finish(CURL* easy, CURLcode result) {
    auto it = calls_.find(easy);
    if (it == calls_.end()) return;
    std::unique_ptr<call> c = std::move(it->second);
    calls_.erase(it);
    if (!c->stream) {
      --in_flight_;
      start_waiting();
    }
    long status = 0;
    ::curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
    ::curl_multi_remove_handle(multi_, easy);
    ::curl_easy_cleanup(easy);
    if (c->headers != nullptr) ::curl_slist_free_all(c->headers);
    if (result == CURLE_COULDNT_CONNECT || result == CURLE_OPERATION_TIMEDOUT) {
      ++endpoint_index_;  // try the next endpoint next time
    }
    std::string failure;
    if (result != CURLE_OK) failure = c->url + ": " + ::curl_easy_strerror(result);
    json body = c->stream ? json() : json::parse(c->response, nullptr, false);
    c->done(failure, status, body);
  }

  // Sends the requests that waited for a connection, as connections free up; one whose deadline
  // passed while it waited ends as unanswered.
  void start_waiting() {
    while (!waiting_.empty() && in_flight_ < options_.max_connections) {
      queued_request q = std::move(waiting_.front());
      waiting_.pop_front();
      if (q.deadline != clock::time_point::max() && q.deadline <= clock::now()) {
        q.done(options_.endpoints[endpoint_index_ % options_.endpoints.size()] + q.path +
                   ": the deadline passed while it waited for a connection",
               0, json());
        continue;
      }
      request(std::move(q.path), q.body, q.deadline, std::move(q.done));
    }
  }

  // ---- the completion source (executor thread)
  std::size_t poll_io(std::size_t) noexcept override {
    if (sockets_.empty() && !curl_due_) return 0;
    // Directory traffic is rare and not latency-critical: while the executor spins for transfers,
    // look at curl's sockets at most every 50 us (one epoll_wait); parked, the executor's epoll wakes
    // on ours.
    const auto now = clock::now();
    if (now < next_look_) return 0;
    next_look_ = now + std::chrono::microseconds(50);
    std::size_t n = 0;
    epoll_event events[32];
    const int ready = ::epoll_wait(epoll_, events, 32, 0);
    for (int i = 0; i < ready; ++i) {
      int flags = 0;
      if ((events[i].events & EPOLLIN) != 0) flags |= CURL_CSELECT_IN;
      if ((events[i].events & EPOLLOUT) != 0) flags |= CURL_CSELECT_OUT;
      if ((events[i].events & (EPOLLERR | EPOLLHUP)) != 0) flags |= CURL_CSELECT_ERR;
      act(events[i].data.fd, flags);
      ++n;
    }
    if (curl_due_ && *curl_due_ <= now) {
      curl_due_.reset();
      act(CURL_SOCKET_TIMEOUT, 0);
      ++n;
    }
    reap();
    return n;
  }

  [[nodiscard]] int io_fd() const noexcept override { return epoll_; }

  void act(curl_socket_t s, int flags) {
    int running = 0;
    ::curl_multi_socket_action(multi_, s, flags, &running);
  }

  void reap() {
    int left = 0;
    while (CURLMsg* m = ::curl_multi_info_read(multi_, &left)) {
      if (m->msg == CURLMSG_DONE) finish(m->easy_handle, m->data.result);
    }
  }

  static int on_socket(CURL*, curl_socket_t s, int what, void* self_ptr, void*) {
    auto* self = static_cast<etcd_directory*>(self_ptr);
    if (what == CURL_POLL_REMOVE) {
      ::epoll_ctl(self->epoll_, EPOLL_CTL_DEL, s, nullptr);
      self->sockets_.erase(s);
      return 0;
    }
    epoll_event ev{};
    ev.data.fd = s;
    ev.events = (what == CURL_POLL_IN || what == CURL_POLL_INOUT ? EPOLLIN : 0u) |
                (what == CURL_POLL_OUT || what == CURL_POLL_INOUT ? EPOLLOUT : 0u);
    const bool known = self->sockets_.count(s) != 0;
    ::epoll_ctl(self->epoll_, known ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s, &ev);
    self->sockets_.insert(s);
    return 0;
  }

  static int on_curl_timer(CURLM*, long timeout_ms, void* self_ptr) {
    auto* self = static_cast<etcd_directory*>(self_ptr);
    if (self->curl_timer_) self->cancel(*self->curl_timer_);
    self->curl_timer_.reset();
    self->curl_due_.reset();
    if (timeout_ms < 0) return 0;
    const auto when = clock::now() + std::chrono::milliseconds(timeout_ms);
    self->curl_due_ = when;
    self->curl_timer_ = self->at(when, [self] {
      self->curl_timer_.reset();
      self->curl_due_.reset();
      self->act(CURL_SOCKET_TIMEOUT, 0);
      self->reap();
    });
    return 0;
  }

  // ---- what a call's answer says
  // Empty when the answer is a JSON object from etcd; else why not, in words, and its error code.
  [[nodiscard]] static std::pair<std::error_code, std::string> judge(const std::string& failure,
                                                                     long status, const json& body,
                                                                     const std::string& what) {
    if (!failure.empty()) {
      return {make_error_code(directory_errc::unavailable),
              "ferry directory: " + what + ": etcd did not answer (" + failure + ")"};
    }
    if (body.is_discarded() || !body.is_object()) {
      return {make_error_code(directory_errc::service_error),
              "ferry directory: " + what + ": etcd answered HTTP " + std::to_string(status) +
                  " with no JSON object"};
    }
    if (status != 200 || body.contains("error")) {
      std::string said = detail::json_string(body, "message");
      if (said.empty()) said = detail::json_string(body, "error");
      return {make_error_code(directory_errc::service_error),
              "ferry directory: " + what + ": etcd answered HTTP " + std::to_string(status) + ": " +
                  said};
    }
    return {};
  }

  [[nodiscard]] std::string record_key(const std::string& name) const {
    return options_.root + "records/" + name;
  }
  [[nodiscard]] std::string counter_key(const std::string& name) const {
    return options_.root + "incarnations/" + name;
  }
  [[nodiscard]] static std::int64_t ttl_seconds(std::chrono::milliseconds lease) {
    return std::max<std::int64_t>(1, (lease.count() + 999) / 1000);
  }

  // ---- publish
  // The counter's value: the name's last incarnation as 20 decimal digits, so that byte order is
  // number order.
  [[nodiscard]] static std::string counter_text(std::uint64_t n) {
    std::string digits = std::to_string(n);
    return std::string(20 - digits.size(), '0') + digits;
  }

  // A compare of a transaction on `key`.
  [[nodiscard]] static json compare(const std::string& key, const char* target, json value) {
    json c{{"key", detail::base64_encode(key)}, {"target", target}, {"result", "EQUAL"}};
    if (std::string(target) == "VALUE") {
      c["value"] = detail::base64_encode(value.get<std::string>());
    } else if (std::string(target) == "VERSION") {
      c["version"] = std::move(value);
    } else {
      c["mod_revision"] = std::move(value);
    }
    return c;
  }

  [[nodiscard]] static bool succeeded(const json& body) {
    const json* s = detail::json_member(body, "succeeded");  // etcd leaves out a false one
    return s != nullptr && s->is_boolean() && s->get<bool>();
  }

  // ---- publish: claim the next incarnation (a compare-and-swap on the counter), grant a lease, put
  // the record only while the counter still says this incarnation (a newer publisher wins).
  void start_publish(std::shared_ptr<detail::publication_state> p, clock::time_point deadline,
                     done_fn done) override {
    claim_incarnation(std::move(p), deadline, std::move(done), 0);
  }

  void claim_incarnation(std::shared_ptr<detail::publication_state> p, clock::time_point deadline,
                         done_fn done, int attempt) {
    json range{{"key", detail::base64_encode(counter_key(p->name))}};
    request("/v3/kv/range", range, deadline,
            [this, p, deadline, done, attempt](const std::string& f, long status, const json& body) {
              auto [ec, why] = judge(f, status, body, "publish '" + p->name + "'");
              if (ec) return done(ec, why);
              std::uint64_t last = 0;
              std::int64_t mod = 0;
              const json* kvs = detail::json_member(body, "kvs");
              if (kvs != nullptr && kvs->is_array() && !kvs->empty()) {
                std::string text;
                const bool ok = detail::base64_decode(detail::json_string((*kvs)[0], "value"), text) &&
                                text.size() == 20 &&
                                text.find_first_not_of("0123456789") == std::string::npos;
                if (!ok) {
                  return done(make_error_code(directory_errc::bad_record),
                              "ferry directory: the incarnation counter of '" + p->name +
                                  "' in etcd is not a ferry counter");
                }
                last = std::stoull(text);
                mod = detail::json_int((*kvs)[0], "mod_revision");
              }
              const std::uint64_t next = last + 1;
              const std::string key = counter_key(p->name);
              json txn{{"compare", json::array({mod == 0 ? compare(key, "VERSION", "0")
                                                         : compare(key, "MOD", std::to_string(mod))})},
                       {"success", json::array({{{"request_put",
                                                  {{"key", detail::base64_encode(key)},
                                                   {"value", detail::base64_encode(counter_text(next))}}}}})}};
              request("/v3/kv/txn", txn, deadline,
                      [this, p, deadline, done, attempt, next](const std::string& f2, long s2,
                                                                const json& b2) {
                        auto [ec2, why2] = judge(f2, s2, b2, "publish '" + p->name + "'");
                        if (ec2) return done(ec2, why2);
                        if (!succeeded(b2)) {  // another publisher took it first: read again
                          if (attempt >= 32) {
                            return done(make_error_code(directory_errc::service_error),
                                        "ferry directory: publish '" + p->name +
                                            "': 32 other publications under the name got there first");
                          }
                          return claim_incarnation(p, deadline, done, attempt + 1);
                        }
                        p->incarnation = next;
                        grant_and_put(p, deadline, done, false);
                      });
            });
  }

  // Grants a lease and puts the record on it, only while the counter still holds p's incarnation.
  // `restore` (putting it back after the lease was lost): a counter etcd no longer has (it lost its
  // data) is put back too, so that later publications count on from this incarnation.
  void grant_and_put(std::shared_ptr<detail::publication_state> p, clock::time_point deadline,
                     done_fn done, bool restore) {
    json grant{{"TTL", std::to_string(ttl_seconds(p->lease))}};
    request("/v3/lease/grant", grant, deadline,
            [this, p, deadline, done, restore](const std::string& f, long status, const json& body) {
              auto [ec, why] = judge(f, status, body, "grant a lease for '" + p->name + "'");
              if (ec) return done(ec, why);
              const std::int64_t id = detail::json_int(body, "ID");
              if (id == 0) {
                return done(make_error_code(directory_errc::service_error),
                            "ferry directory: etcd granted no lease for '" + p->name + "'");
              }
              if (p->withdrawn) {  // withdrawn while the lease was being granted
                revoke(id);
                return done(make_error_code(directory_errc::closed),
                            "ferry directory: '" + p->name + "' was withdrawn");
              }
              p->lease_id = id;
              put_record(p, deadline, done,
                         restore ? counter_check::ours_or_restore : counter_check::ours);
            });
  }

  // How put_record checks the counter: it holds this incarnation (`ours`); that, or else it is gone
  // and goes back with the record (`ours_or_restore`, after a lost lease); it is gone (`restore`).
  enum class counter_check { ours, ours_or_restore, restore };

  void put_record(std::shared_ptr<detail::publication_state> p, clock::time_point deadline,
                  done_fn done, counter_check check) {
    const std::vector<std::byte> env = encode_record(p->incarnation, p->value);
    const std::string counter = counter_key(p->name);
    json ops = json::array({{{"request_put",
                              {{"key", detail::base64_encode(record_key(p->name))},
                               {"value", detail::base64_encode(std::string_view(
                                             reinterpret_cast<const char*>(env.data()), env.size()))},
                               {"lease", std::to_string(p->lease_id)}}}}});
    json cmp;
    if (check == counter_check::restore) {
      cmp = compare(counter, "VERSION", "0");
      ops.push_back({{"request_put",
                      {{"key", detail::base64_encode(counter)},
                       {"value", detail::base64_encode(counter_text(p->incarnation))}}}});
    } else {
      cmp = compare(counter, "VALUE", counter_text(p->incarnation));
    }
    json txn{{"compare", json::array({cmp})}, {"success", ops}};
    request("/v3/kv/txn", txn, deadline,
            [this, p, deadline, done, check](const std::string& f, long status, const json& body) {
              auto [ec, why] = judge(f, status, body, "publish '" + p->name + "'");
              if (ec) return done(ec, why);
              if (succeeded(body)) return done({}, {});
              if (check == counter_check::ours_or_restore) {
                return put_record(p, deadline, done, counter_check::restore);
              }
              // A newer incarnation holds the name: this publication has lost it for good.
              revoke(p->lease_id);
              p->withdrawn = true;
              p->set_health(make_error_code(directory_errc::superseded));
              done(make_error_code(directory_errc::superseded),
                   "ferry directory: '" + p->name + "': incarnation " +
                       std::to_string(p->incarnation) + " was superseded by a newer one");
            });
  }

  void revoke(std::int64_t lease) {
    json body{{"ID", std::to_string(lease)}};
    request("/v3/lease/revoke", body, clock::now() + options_.request_timeout,
            [](const std::string&, long, const json&) {});
  }

  void start_keepalive(std::shared_ptr<detail::publication_state> p, done_fn done) override {
    json body{{"ID", std::to_string(p->lease_id)}};
    // Bounded by a third of the lease, so that a slow answer leaves time to try again before the
    // lease ends.
    const auto bound = clock::now() + std::min<clock::duration>(options_.request_timeout, p->lease / 3);
    request("/v3/lease/keepalive", body, bound,
            [this, p, done](const std::string& f, long status, const json& b) {
              auto [ec, why] = judge(f, status, b, "renew the lease of '" + p->name + "'");
              if (ec) return done(ec, why);
              const json* result = detail::json_member(b, "result");
              if (result != nullptr && detail::json_int(*result, "TTL") > 0) return done({}, {});
              // etcd no longer knows the lease: put the record back under the same incarnation,
              // unless a newer one holds the name by now.
              if (p->withdrawn) return done({}, {});
              grant_and_put(p, clock::now() + options_.request_timeout,
                            [p, done](std::error_code e2, std::string w2) {
                              if (!e2) {
                                std::lock_guard lock(p->mutex);
                                ++p->republished;
                              }
                              done(e2 ? e2 : make_error_code(directory_errc::lease_lost), w2);
                            },
                            true);
            });
  }

  void start_withdraw(std::shared_ptr<detail::publication_state> p, clock::time_point deadline,
                      std::function<void(std::error_code)> done) override {
    if (p->lease_id == 0) return done({});
    json body{{"ID", std::to_string(p->lease_id)}};
    request("/v3/lease/revoke", body, deadline,
            [done](const std::string& f, long status, const json& b) {
              if (!f.empty()) return done(make_error_code(directory_errc::unavailable));
              // A lease etcd no longer knows is withdrawn already.
              (void)b;
              done(status == 200 || status == 404 || status == 400
                       ? std::error_code{}
                       : make_error_code(directory_errc::service_error));
            });
  }

  // ---- lookups
  struct lookup_batch {
    std::vector<lookup_result> out;
    std::size_t left = 0;
    std::error_code failure;
    std::string failure_what;
    lookup_fn done;
  };

  void start_lookup(std::vector<std::string> names, clock::time_point deadline,
                    lookup_fn done) override {
    constexpr std::size_t per_txn = 64;
    auto b = std::make_shared<lookup_batch>();
    b->out.resize(names.size());
    for (std::size_t i = 0; i < names.size(); ++i) b->out[i].name = names[i];
    b->done = std::move(done);
    b->left = (names.size() + per_txn - 1) / per_txn;
    for (std::size_t first = 0; first < names.size(); first += per_txn) {
      const std::size_t last = std::min(names.size(), first + per_txn);
      json ops = json::array();
      for (std::size_t i = first; i < last; ++i) {
        ops.push_back({{"request_range", {{"key", detail::base64_encode(record_key(names[i]))}}}});
      }
      json txn{{"success", std::move(ops)}};
      request("/v3/kv/txn", txn, deadline,
              [this, b, first, last](const std::string& f, long status, const json& body) {
                take_lookup(*b, first, last, f, status, body);
                if (--b->left == 0) {
                  if (b->failure) {
                    b->done({}, b->failure, b->failure_what);
                  } else {
                    b->done(std::move(b->out), {}, {});
                  }
                }
              });
    }
  }

  void take_lookup(lookup_batch& b, std::size_t first, std::size_t last, const std::string& f,
                   long status, const json& body) {
    auto [ec, why] = judge(f, status, body, "look up " + std::to_string(b.out.size()) + " names");
    if (ec) {
      if (!b.failure) {
        b.failure = ec;
        b.failure_what = why;
      }
      return;
    }
    const json* responses = detail::json_member(body, "responses");
    for (std::size_t i = first; i < last; ++i) {
      lookup_result& r = b.out[i];
      const json* kv = nullptr;
      if (responses != nullptr && responses->is_array() && i - first < responses->size()) {
        const json* range = detail::json_member((*responses)[i - first], "response_range");
        const json* kvs = range != nullptr ? detail::json_member(*range, "kvs") : nullptr;
        if (kvs != nullptr && kvs->is_array() && !kvs->empty()) kv = &(*kvs)[0];
      }
      if (kv == nullptr) {
        r.error = make_error_code(directory_errc::not_found);
        r.message = "ferry directory: nothing is published under '" + r.name + "'";
        continue;
      }
      r = open_value(r.name, *kv);
    }
  }

  // A kv from etcd, its value checked as a record.
  [[nodiscard]] lookup_result open_value(const std::string& name, const json& kv) const {
    std::string raw;
    if (!detail::base64_decode(detail::json_string(kv, "value"), raw)) {
      lookup_result r;
      r.name = name;
      r.error = make_error_code(directory_errc::bad_record);
      r.message = "ferry directory: the value etcd holds under '" + name + "' is not base64";
      return r;
    }
    return decode_record(name, std::as_bytes(std::span(raw.data(), raw.size())),
                         options().max_record_bytes);
  }

  // ---- the watch stream
  void begin_watch(std::shared_ptr<detail::watch_state> w, std::function<void()> ready) override {
    watchers_.push_back(w);
    if (synced_) return ready();
    waiting_ready_.push_back(std::move(ready));
    if (!stream_wanted_) {
      stream_wanted_ = true;
      resync();
    }
  }

  void stop_watch(const std::shared_ptr<detail::watch_state>& w) override {
    std::erase(watchers_, w);
  }

  // Reads every record, tells watchers the differences from what they knew, then opens the stream
  // after that read's revision.
  void resync() {
    synced_ = false;
    const std::string prefix = options_.root + "records/";
    json range{{"key", detail::base64_encode(prefix)},
               {"range_end", detail::base64_encode(detail::prefix_end(prefix))}};
    request("/v3/kv/range", range, clock::now() + options_.request_timeout,
            [this, prefix](const std::string& f, long status, const json& body) {
              auto [ec, why] = judge(f, status, body, "read the records to watch");
              if (ec) return retry_stream();
              std::map<std::string, std::uint64_t> now;
              std::vector<directory_record> current;
              if (const json* kvs = detail::json_member(body, "kvs"); kvs && kvs->is_array()) {
                for (const json& kv : *kvs) {
                  std::string key;
                  if (!detail::base64_decode(detail::json_string(kv, "key"), key)) continue;
                  if (key.rfind(prefix, 0) != 0) continue;
                  lookup_result r = open_value(key.substr(prefix.size()), kv);
                  if (!r.record) continue;
                  now[r.name] = r.record->incarnation;
                  current.push_back(std::move(*r.record));
                }
              }
              // Differences from what watchers were told (nothing, the first time).
              if (told_once_) {
                for (auto& [name, inc] : known_) {
                  if (now.count(name) == 0) emit_gone(name, inc);
                }
                for (directory_record& r : current) {
                  auto it = known_.find(r.name);
                  if (it == known_.end() || it->second != r.incarnation) emit_published(r);
                }
              }
              known_ = std::move(now);
              told_once_ = true;
              const json* header = detail::json_member(body, "header");
              const std::int64_t rev = header != nullptr ? detail::json_int(*header, "revision") : 0;
              open_stream(rev + 1);
            });
  }

  void open_stream(std::int64_t from) {
    const std::string prefix = options_.root + "records/";
    json create{{"create_request",
                 {{"key", detail::base64_encode(prefix)},
                  {"range_end", detail::base64_encode(detail::prefix_end(prefix))},
                  {"start_revision", std::to_string(from)},
                  {"prev_kv", true}}}};
    request("/v3/watch", create, clock::time_point::max(),
            [this](const std::string&, long, const json&) { retry_stream(); }, true);
  }

  // The stream ended or could not start: watchers keep what they have; try again with backoff.
  void retry_stream() {
    synced_ = false;
    // Watchers waiting for the stream are let go: their watch is registered, and what changes
    // meanwhile reaches them as differences once the stream is back. Told nothing yet, they learn
    // every record then (as published).
    if (!waiting_ready_.empty()) told_once_ = true;
    for (auto& r : std::exchange(waiting_ready_, {})) r();
    backoff_ = backoff_.count() == 0 ? options_.reconnect_min
                                     : std::min(backoff_ * 2, options_.reconnect_max);
    (void)at(clock::now() + backoff_, [this] { resync(); });
  }

  // False once etcd cancelled the watch.
  bool drain_stream_lines(call& c) {
    std::size_t start = 0;
    bool live = true;
    for (;;) {
      const std::size_t nl = c.response.find('\n', start);
      if (nl == std::string::npos) break;
      live = on_stream_message(std::string_view(c.response).substr(start, nl - start)) && live;
      start = nl + 1;
    }
    c.response.erase(0, start);
    return live;
  }

  // False when the message says etcd cancelled the watch.
  bool on_stream_message(std::string_view line) {
    if (line.empty()) return true;
    json msg = json::parse(line, nullptr, false);
    const json* result = msg.is_discarded() ? nullptr : detail::json_member(msg, "result");
    // An error line, or anything else: the stream is opened again.
    if (result == nullptr) return false;
    const json* canceled = detail::json_member(*result, "canceled");
    if ((canceled != nullptr && canceled->is_boolean() && canceled->get<bool>()) ||
        detail::json_int(*result, "compact_revision") > 0) {
      return false;
    }
    if (const json* created = detail::json_member(*result, "created");
        created != nullptr && created->is_boolean() && created->get<bool>()) {
      synced_ = true;
      backoff_ = std::chrono::milliseconds(0);
      streams_opened_.fetch_add(1, std::memory_order_relaxed);
      for (auto& r : std::exchange(waiting_ready_, {})) r();
    }
    const json* events = detail::json_member(*result, "events");
    if (events == nullptr || !events->is_array()) return true;
    const std::string prefix = options_.root + "records/";
    for (const json& e : *events) {
      const json* kv = detail::json_member(e, "kv");
      if (kv == nullptr) continue;
      std::string key;
      if (!detail::base64_decode(detail::json_string(*kv, "key"), key)) continue;
      if (key.rfind(prefix, 0) != 0) continue;
      const std::string name = key.substr(prefix.size());
      if (detail::json_string(e, "type") == "DELETE") {
        std::uint64_t inc = 0;
        if (auto it = known_.find(name); it != known_.end()) inc = it->second;
        if (const json* prev = detail::json_member(e, "prev_kv")) {
          lookup_result r = open_value(name, *prev);
          if (r.record) inc = r.record->incarnation;
        }
        known_.erase(name);
        emit_gone(name, inc);
      } else {
        lookup_result r = open_value(name, *kv);
        if (!r.record) continue;  // garbage is not an event; a lookup reports it
        known_[name] = r.record->incarnation;
        emit_published(*r.record);
      }
    }
    return true;
  }

  void emit_published(const directory_record& r) {
    directory_event ev;
    ev.what = directory_event::kind::published;
    ev.record = r;
    for (auto& w : std::vector(watchers_)) {
      if (w->matches(r.name)) w->deliver(ev);
    }
  }

  void emit_gone(const std::string& name, std::uint64_t incarnation) {
    directory_event ev;
    ev.what = directory_event::kind::gone;
    ev.record.name = name;
    ev.record.incarnation = incarnation;
    for (auto& w : std::vector(watchers_)) {
      if (w->matches(name)) w->deliver(ev);
    }
  }

  etcd_options options_;
  int epoll_ = -1;
  CURLM* multi_ = nullptr;
  std::map<CURL*, std::unique_ptr<call>> calls_;
  std::deque<queued_request> waiting_;  // requests beyond max_connections, in order
  long in_flight_ = 0;                  // requests out, the watch stream aside
  std::set<curl_socket_t> sockets_;
  std::optional<clock::time_point> curl_due_;
  std::optional<timer_key> curl_timer_;
  clock::time_point next_look_{};
  std::size_t endpoint_index_ = 0;
  // The watch stream.
  std::vector<std::shared_ptr<detail::watch_state>> watchers_;
  std::vector<std::function<void()>> waiting_ready_;
  std::map<std::string, std::uint64_t> known_;  // name -> incarnation, as watchers were told
  bool stream_wanted_ = false;
  bool synced_ = false;
  bool told_once_ = false;
  std::chrono::milliseconds backoff_{0};
  std::atomic<std::uint64_t> streams_opened_{0};
};

}  // namespace ferry
