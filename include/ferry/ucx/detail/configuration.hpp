#pragma once
// A UCX context and worker made from worker_options: UCX reads its UCX_* environment variables
// first and the options override them. Options out of range are refused by name.

#include <ucp/api/ucp.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "ferry/ucx/memory_region.hpp"
#include "ferry/ucx/options.hpp"

namespace ferry::ucx::detail {

inline void check_status(ucs_status_t s, const char* what) {
  if (s != UCS_OK) throw_status(s, std::string("ferry::ucx: ") + what);
}

// Throws std::invalid_argument naming the first option out of range.
inline void check_options(const worker_options& o) {
  if (o.close_timeout.count() < 0 || o.close_timeout > std::chrono::hours(1)) {
    throw std::invalid_argument(
        "ferry::ucx::worker_options::close_timeout must be between 0 and 1 h");
  }
  if (o.max_unclaimed_notifications == 0 || o.max_unclaimed_notifications > (std::size_t{1} << 24)) {
    throw std::invalid_argument(
        "ferry::ucx::worker_options::max_unclaimed_notifications must be between 1 and 2^24");
  }
  if (o.handshake_timeout.count() <= 0 || o.handshake_timeout > std::chrono::hours(1)) {
    throw std::invalid_argument(
        "ferry::ucx::worker_options::handshake_timeout must be more than 0 and at most 1 h");
  }
  if (o.liveness_interval.count() < 0 || o.liveness_timeout.count() < 0) {
    throw std::invalid_argument(
        "ferry::ucx::worker_options::liveness_interval and liveness_timeout must not be negative");
  }
}

// Whether a shared-memory transport may load with these transports.
[[nodiscard]] inline bool may_use_shared_memory(const std::string& transports) {
  return transports.find("shm") != std::string::npos ||
         transports.find("posix") != std::string::npos ||
         transports.find("sysv") != std::string::npos || transports == "all";
}

inline std::shared_ptr<context_holder> make_context(const worker_options& options) {
  const auto modify = [](ucp_config_t* c, const std::string& key, const std::string& value) {
    check_status(::ucp_config_modify(c, key.c_str(), value.c_str()),
                 ("setting UCX's " + key + "=" + value).c_str());
  };
  ucp_config_t* config = nullptr;
  check_status(::ucp_config_read(nullptr, nullptr, &config), "reading UCX's configuration");
  auto context = std::make_shared<context_holder>();
  try {
    try {
      modify(config, "TLS", options.transports);
    } catch (const std::system_error& e) {
      throw std::system_error(e.code(), "ferry::ucx::worker_options::transports \"" +
                                            options.transports + "\" is not a UCX TLS setting");
    }
    if (!options.devices.empty()) modify(config, "NET_DEVICES", options.devices);
    bool mm_set = false;
    for (const auto& [k, v] : options.settings) mm_set = mm_set || k == "MM_ERROR_HANDLING";
    // Only where a shared-memory transport may load: elsewhere UCX warns of an unused setting.
    if (options.peer_error_handling && may_use_shared_memory(options.transports) && !mm_set) {
      modify(config, "MM_ERROR_HANDLING", "y");
    }
    if (options.keepalive.count() > 0) {
      modify(config, "KEEPALIVE_INTERVAL", std::to_string(options.keepalive.count()) + "ms");
    }
    for (const auto& [k, v] : options.settings) modify(config, k, v);
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    // Memory is mapped and keys packed on the caller's thread.
    p.mt_workers_shared = 1;
    const ucs_status_t s = ::ucp_init(&p, config, &context->context);
    if (s == UCS_ERR_NO_DEVICE) {
      // UCX took the settings but found nothing usable among them: say which ones.
      check_status(s, ("ucp_init: no usable transport among worker_options::transports \"" +
                       options.transports + "\"" +
                       (options.devices.empty() ? std::string()
                                                : " on worker_options::devices \"" +
                                                      options.devices + "\"") +
                       " (UCX's log above lists those it has)")
                          .c_str());
    }
    check_status(s, "ucp_init");
  } catch (...) {
    ::ucp_config_release(config);
    throw;
  }
  ::ucp_config_release(config);
  return context;
}

// A worker in UCX's single-thread mode: only the progress executor's thread calls into it.
inline ucp_worker_h make_worker(ucp_context_h context) {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  check_status(::ucp_worker_create(context, &wp, &worker), "ucp_worker_create");
  return worker;
}

}  // namespace ferry::ucx::detail
