#!/usr/bin/env bash
# Builds and runs ferry's GPU checks on this machine in one go: the GPU tests (tests/gpu/gpu_hardware_test.cpp:
# every copy kind byte-exact, 1000 copies in flight, a when_all over a layer, an invalid pointer, the
# layer gate with eager waits and inside a captured graph replayed 1000 times with failures and
# timeouts injected) and the GPU benchmark (bench/gpu_bench.cpp: device-to-device bandwidth against
# the raw runtime, completion → resume against a blocking event synchronize, and the layer gate's
# wake-up against a raw stream wait and a host-mediated wait), then prints a short table last.
# Without a GPU it builds both, says that nothing ran, and exits non-zero.
#
# Planned for an NVIDIA H200 with CUDA 13 and no network: it needs only a C++20 compiler (g++ 11+ or
# clang++ 14+) and the CUDA toolkit's headers and libcudart (or, on AMD, the HIP runtime). No Meson,
# no packages, no downloads.
#
#   bash bench/gpu_check.sh            # full benchmark
#   bash bench/gpu_check.sh --quick    # fewer iterations
#
# CUDA_HOME (default: from nvcc, else /usr/local/cuda) and CXX may be set; FERRY_GPU_OUT names the
# build directory (default: a temporary one).
set -euo pipefail
cd "$(dirname "$0")/.."
quick="${1:-}"
out="${FERRY_GPU_OUT:-$(mktemp -d)}"
mkdir -p "$out"

pick_compiler() {
  if [[ -n "${CXX:-}" ]]; then echo "$CXX"; return; fi
  # What ferry needs of the compiler: C++20 coroutines, concepts and <span>.
  local probe='#include <coroutine>
#include <concepts>
#include <span>
template <std::integral T> int f(std::span<T> s) { return static_cast<int>(s.size()); }
int main() { int a[1]{}; std::coroutine_handle<> h; (void)h; return f(std::span<int>(a)) - 1; }'
  for c in g++-14 g++-13 g++-12 g++-11 g++ clang++; do
    if command -v "$c" >/dev/null 2>&1 &&
       echo "$probe" | "$c" -std=c++20 -x c++ - -o /dev/null >/dev/null 2>&1; then
      echo "$c"; return
    fi
  done
  echo "no C++20 compiler found (set CXX)" >&2
  exit 1
}
cxx="$(pick_compiler)"

if [[ -z "${CUDA_HOME:-}" ]] && command -v nvcc >/dev/null 2>&1; then
  CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
fi
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [[ -f "$CUDA_HOME/include/cuda_runtime_api.h" ]]; then
  runtime="CUDA ($CUDA_HOME)"
  libdir="$CUDA_HOME/lib64"
  [[ -d "$libdir" ]] || libdir="$CUDA_HOME/targets/$(uname -m | sed 's/aarch64/sbsa/')-linux/lib"
  flags=(-DFERRY_GPU_CUDA -I"$CUDA_HOME/include" -L"$libdir" -Wl,-rpath,"$libdir" -lcudart)
elif [[ -f /usr/include/hip/hip_runtime_api.h || -f /opt/rocm/include/hip/hip_runtime_api.h ]]; then
  runtime="HIP"
  flags=(-D__HIP_PLATFORM_AMD__ -I/opt/rocm/include -L/opt/rocm/lib -Wl,-rpath,/opt/rocm/lib -lamdhip64)
  # hiprtc (the layer gate's kernel is compiled at run time) is its own library from ROCm 5.3 on.
  if [[ -e /opt/rocm/lib/libhiprtc.so || -e /usr/lib/x86_64-linux-gnu/libhiprtc.so ]]; then flags+=(-lhiprtc); fi
else
  echo "neither the CUDA toolkit (cuda_runtime_api.h under $CUDA_HOME) nor the HIP runtime was found" >&2
  exit 1
fi

echo "# ferry GPU check: $runtime, compiler $cxx ($("$cxx" -dumpversion)), build in $out"
common=(-std=c++20 -O2 -pthread -Iinclude)
"$cxx" "${common[@]}" tests/gpu/gpu_hardware_test.cpp -o "$out/gpu_hardware_test" "${flags[@]}"
"$cxx" "${common[@]}" bench/gpu_bench.cpp -o "$out/gpu_bench" "${flags[@]}"

gpu="unknown GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed -n 1p || true)"
  [[ -n "$gpu" ]] || gpu="unknown GPU"
fi

set +e
"$out/gpu_hardware_test" | tee "$out/tests.log"
test_rc=${PIPESTATUS[0]}
"$out/gpu_bench" $quick | tee "$out/bench.log"
bench_rc=${PIPESTATUS[0]}
set -e

verdict() { case "$1" in 0) echo passed ;; 77) echo skipped ;; *) echo "FAILED ($1)" ;; esac; }
target() {
  local line
  line="$(grep -F "$1" "$out/bench.log" | awk -F'|' '{gsub(/^ +| +$/, "", $3); gsub(/^ +| +$/, "", $4); print $3 " — " $4}' | sed -n 1p)"
  echo "${line:-not measured}"
}

echo
echo "## Summary ($gpu)"
echo
echo "| check | result |"
echo "|---|---|"
echo "| GPU tests | $(verdict "$test_rc") |"
echo "| GPU benchmark | $(verdict "$bench_rc") |"
echo "| bandwidth >= 95% of raw at >= 1 MiB | $(target 'bandwidth >= 95%') |"
echo "| completion noticed within 10 us | $(target 'completion noticed') |"
if [[ "$test_rc" == 77 && "$bench_rc" == 77 ]]; then
  echo
  echo "No GPU was found: both programs built, and nothing ran on a GPU." >&2
  exit 3
fi
echo
grep -F -A5 'layer released' "$out/bench.log" || echo "(the layer gate's wake-up was not measured)"
[[ "$test_rc" == 0 && "$bench_rc" == 0 ]]
