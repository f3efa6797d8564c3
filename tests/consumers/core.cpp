// A program that uses ferry as another build consumes it (through CMake's ferry::ferry, pkg-config's
// ferry, or Meson's dependency('ferry') with ferry as a subproject): the loopback backend and the
// version macros.
#include <ferry/ferry.hpp>

#include <cstddef>
#include <cstdio>
#include <cstring>

// Built with -DFERRY_CONSUMER_CXX23 in C++23: what ferry's package carries must not lower it.
#if defined(FERRY_CONSUMER_CXX23)
static_assert(__cplusplus > 202002L, "the consumer's C++23 was replaced by an older standard");
#endif

int main() {
  char version[32];
  std::snprintf(version, sizeof version, "%d.%d.%d", FERRY_VERSION_MAJOR, FERRY_VERSION_MINOR,
                FERRY_VERSION_PATCH);
  if (std::strcmp(version, FERRY_VERSION_STRING) != 0) {
    std::fprintf(stderr, "core: FERRY_VERSION_STRING %s, the parts say %s\n", FERRY_VERSION_STRING,
                 version);
    return 1;
  }
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  std::byte src[64]{std::byte{1}}, dst[64]{};
  if (lb.copy(dst, src).wait() != ferry::transfer_state::success || dst[0] != std::byte{1}) {
    std::fprintf(stderr, "core: the loopback copy failed\n");
    return 1;
  }
  std::printf("core: ferry %s, a loopback copy\n", FERRY_VERSION_STRING);
  return 0;
}
