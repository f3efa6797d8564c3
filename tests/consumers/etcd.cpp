// A consumer of ferry's etcd directory (ferry::etcd, ferry-etcd): libcurl and nlohmann-json come
// with the part. Nothing listens on the discard port, so the lookup fails with unavailable.
#include <ferry/directory/etcd.hpp>

#include <cstdio>

int main() {
  ferry::progress_executor exec;
  ferry::etcd_options options;
  options.endpoints = {"http://127.0.0.1:9"};
  options.request_timeout = std::chrono::milliseconds(200);
  ferry::etcd_directory dir{exec, options};
  try {
    (void)dir.lookup("nobody", std::chrono::seconds(2)).get();
  } catch (const std::system_error& e) {
    std::printf("etcd: %s\n", e.code() == ferry::directory_errc::unavailable ? "unavailable, as "
                                                                              "expected" : e.what());
    return e.code() == ferry::directory_errc::unavailable ? 0 : 1;
  }
  return 1;
}
