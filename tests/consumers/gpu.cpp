// A consumer of ferry's GPU backend, built once per runtime (ferry::gpu_hip / ferry-gpu-hip,
// ferry::gpu_cuda / ferry-gpu-cuda): the package's defines pick the runtime <ferry/gpu.hpp> maps,
// and counting devices calls it (a machine without a GPU gets an error code, not a crash).
#include <ferry/gpu.hpp>

#include <cstdio>

int main() {
  int devices = 0;
  const int rc = ferry::gpu::gpu_runtime::device_count(devices);
#if defined(FERRY_GPU_CUDA)
  const char* runtime = "CUDA";
#else
  const char* runtime = "HIP";
#endif
  std::printf("gpu: %s runtime, device count call returned %d (%d devices)\n", runtime, rc,
              rc == 0 ? devices : 0);
  return 0;
}
