#!/bin/sh
# ferry's quick start, for a fresh Debian 12 machine (run as root from the checkout):
#   scripts/quickstart.sh demo   installs what is missing, builds, runs the demo and a benchmark summary
#   scripts/quickstart.sh test   installs what is missing, builds every test build, runs the whole suite
#                                (which includes the demo command run in a new minimal Debian 12, where
#                                this machine can make one: tests/fresh_root_demo.sh)
set -eu
cd "$(dirname "$0")/.."

mode=${1:-}
# One set-up for both: everything either command uses (doxygen: the docs target). The tests add the
# second compiler, Catch2, CMake (for the installed-package check), debootstrap (for the
# fresh-root-demo test), meson-python, venv and pip (for the pip-install test) and etcd (the
# directory's tests start one on 127.0.0.1).
packages="g++ meson ninja-build pkg-config liburing-dev libibverbs-dev libucx-dev libamdhip64-dev libasio-dev libcurl4-openssl-dev nlohmann-json3-dev fio iperf3 ucx-utils python3-dev pybind11-dev doxygen"
case "$mode" in
  demo) ;;
  test) packages="$packages clang catch2 cmake debootstrap python3-pytest python3-numpy iproute2 python3-mesonpy python3-venv python3-pip etcd-server" ;;
  *) echo "usage: $0 demo|test" >&2; exit 2 ;;
esac
echo "ferry quick start: scripts/quickstart.sh $mode"

missing=""
for p in $packages; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "installing:$missing"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
fi
echo "set-up: every package present: $packages"

jobs=$(nproc)
# A plain `meson setup` builds nothing of ferry's own (ferry is headers only): the demo asks for the
# examples and benchmarks; the test builds ask for everything with -Ddev=true (tests, benchmarks,
# examples, ferry-perf and the Python module).
if [ "$mode" = demo ]; then
  rm -rf build-demo
  meson setup build-demo --buildtype=release -Dexamples=true -Dbenchmarks=true
  ninja -C build-demo -j "$jobs"
  ./build-demo/examples/inference_engine
  ./build-demo/bench/ferry_bench --quick
  exit 0
fi

# The suite: g++ 12 with warnings as errors, in the sanitizer builds (ThreadSanitizer for every
# concurrency test, AddressSanitizer + UBSan for all of it), then clang 14 building everything and
# running the plain suite (a g++ plain build of the unit suite would only repeat that one).
rm -rf build-test build-clang
meson setup build-test --werror -Ddev=true -Dtest_builds=tsan,asan
ninja -C build-test -j "$jobs"
meson test -C build-test --print-errorlogs --num-processes "$jobs"
CXX=clang++ meson setup build-clang --werror -Ddev=true -Dtest_builds=plain
ninja -C build-clang -j "$jobs"
meson test -C build-clang --print-errorlogs --num-processes "$jobs" --suite plain
echo "all ferry tests passed"
