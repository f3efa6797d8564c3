#!/bin/sh
# What a user gets from `meson setup build --prefix=... && meson install -C build`, with nothing
# else: a fresh build directory configured from the source with only --prefix, installed with
# DESTDIR. It must compile nothing (ferry is headers only; its tests, benchmarks, examples, ferry-perf
# and the Python module are opt-in), install the headers, the pkg-config modules of the parts found
# and the CMake package, and nothing else. Reports how long the two commands took; the only bound on
# it is a generous one (5 minutes: a step compiling the suite would take far longer).
# Usage: check_default_install.sh SOURCE_DIR CXX PARTS (comma-separated, e.g. uring,verbs,gpu-hip)
set -eu
source=$1; cxx=$2; parts=$(echo "$3" | tr ',' ' ')
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
build="$scratch/build"
prefix=/opt/ferry-default-install
now() { date +%s.%N; }

start=$(now)
CXX="$cxx" meson setup "$build" "$source" --prefix="$prefix" >"$scratch/setup.log" 2>&1 || {
  cat "$scratch/setup.log" >&2; echo "meson setup with only --prefix failed (log above)" >&2; exit 1; }
configured=$(now)
# Before installing: the build has nothing to do.
ninja -C "$build" -n >"$scratch/dry-run.log" 2>&1
if ! grep -q "ninja: no work to do" "$scratch/dry-run.log"; then
  cat "$scratch/dry-run.log" >&2
  echo "a plain setup has something to build (above); it must build nothing" >&2
  exit 1
fi
DESTDIR="$scratch/root" meson install -C "$build" >"$scratch/install.log" 2>&1 || {
  cat "$scratch/install.log" >&2; echo "meson install failed (log above)" >&2; exit 1; }
done_at=$(now)

objects=$(find "$build" -name '*.o' | head -5)
if [ -n "$objects" ]; then
  echo "the default install compiled something: $objects" >&2; exit 1
fi
root="$scratch/root$prefix"
expected="include/ferry/ferry.hpp include/ferry/version.hpp include/ferry/kv.hpp
  include/ferry/testing.hpp share/pkgconfig/ferry.pc share/cmake/ferry/ferryConfig.cmake
  share/cmake/ferry/ferryConfigVersion.cmake"
for p in $parts; do
  expected="$expected share/pkgconfig/ferry-$p.pc"
done
for f in $expected; do
  [ -f "$root/$f" ] || { echo "$f is not installed under the prefix" >&2; exit 1; }
done
# Nothing but the library: no ferry-perf (bin/), no Python module, nothing outside the prefix.
(cd "$scratch/root" && find . -type f) >"$scratch/installed.txt"
others=$(grep -v -e "^.$prefix/include/ferry/" -e "^.$prefix/share/pkgconfig/ferry[-a-z]*\.pc$" \
  -e "^.$prefix/share/cmake/ferry/" "$scratch/installed.txt" || true)
if [ -n "$others" ]; then
  echo "the default install installed more than the library:" >&2; echo "$others" >&2; exit 1
fi

setup_s=$(echo "$configured $start" | awk '{ printf "%.1f", $1 - $2 }')
install_s=$(echo "$done_at $configured" | awk '{ printf "%.1f", $1 - $2 }')
total_s=$(echo "$done_at $start" | awk '{ printf "%.1f", $1 - $2 }')
headers=$(find "$root/include" -name '*.hpp' | wc -l)
echo "default setup + install: $total_s s (setup $setup_s s, install $install_s s), nothing compiled;"
modules=$(find "$root/share/pkgconfig" -name 'ferry*.pc' | wc -l)
echo "installed $headers headers, $modules pkg-config modules, the CMake package"
if awk -v t="$total_s" 'BEGIN { exit !(t >= 300) }'; then
  echo "the default setup and install took $total_s s: over 5 minutes" >&2; exit 1
fi
