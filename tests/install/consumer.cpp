// A program built against an installed ferry, through pkg-config or CMake's find_package.
#include <ferry/ferry.hpp>

int main() {
  ferry::progress_executor exec;
  ferry::loopback_backend lb{exec};
  std::byte src[64]{std::byte{1}}, dst[64]{};
  return lb.copy(dst, src).wait() == ferry::transfer_state::success && dst[0] == std::byte{1} ? 0
                                                                                              : 1;
}
