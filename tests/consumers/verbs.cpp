// A consumer of ferry's RDMA verbs backend (ferry::verbs, ferry-verbs): listing the adapters calls
// libibverbs (a machine without one lists none).
#include <ferry/verbs.hpp>

#include <cstdio>

int main() {
  const auto names = ferry::verbs::real_provider::device_names();
  std::printf("verbs: %zu RDMA adapter(s)\n", names.size());
  return 0;
}
