#!/bin/sh
# Installs the build into a scratch directory, then builds and runs a consumer of every part ferry
# was built with (tests/consumers/: core, and uring, verbs, ucx, gpu-hip, gpu-cuda where built) three
# ways: through the pkg-config modules, through the CMake package (find_package(ferry), ferry::<part>)
# and with ferry as a Meson subproject of a parent project, which must build none of ferry's tests.
# Usage: check_install.sh BUILD_DIR SOURCE_DIR CXX PARTS (comma-separated, e.g. uring,verbs,gpu-hip)
set -eu
build=$1; source=$2; cxx=$3; parts=$(echo "$4" | tr ',' ' ')
consumers="$source/tests/consumers"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
DESTDIR="$scratch/root" meson install -C "$build" --no-rebuild --quiet
prefix=$(find "$scratch/root" -name ferry.hpp -path '*/include/ferry/*' | head -1)
prefix=${prefix%/include/ferry/ferry.hpp}
# Headers only: the pkg-config and CMake files belong under share/, which pkg-config and CMake
# search on every distribution. Under libdir they can land in lib64, which CMake skips on Debian.
for f in pkgconfig/ferry.pc cmake/ferry/ferryConfig.cmake cmake/ferry/ferryConfigVersion.cmake; do
  if [ ! -f "$prefix/share/$f" ]; then
    echo "$f is not installed under $prefix/share" >&2; exit 1
  fi
done
if [ ! -f "$prefix/include/ferry/version.hpp" ]; then
  echo "ferry/version.hpp is not installed" >&2; exit 1
fi
# Every ferry header an installed header includes is installed too (a header added to include/ but
# not to include/meson.build's list breaks only installed consumers).
missing_headers=$(cd "$prefix/include" && grep -ho '#include "ferry/[^"]*"' -r ferry |
  sed 's/#include "\(.*\)"/\1/' | sort -u | while read -r h; do [ -f "$h" ] || echo "$h"; done)
if [ -n "$missing_headers" ]; then
  echo "installed headers include headers that are not installed (add them to include/meson.build):" >&2
  echo "$missing_headers" >&2; exit 1
fi
source_of() { case $1 in gpu-*) echo gpu.cpp ;; *) echo "$1.cpp" ;; esac; }

# An older standard stops at ferry's own message, not somewhere inside the headers.
if "$cxx" -std=c++17 -fsyntax-only -I"$prefix/include" "$consumers/core.cpp" \
     >"$scratch/cxx17.log" 2>&1; then
  echo "a C++17 translation unit compiled <ferry/ferry.hpp>" >&2; exit 1
fi
grep -q "ferry needs C++20" "$scratch/cxx17.log" || {
  cat "$scratch/cxx17.log" >&2; echo "C++17: no 'ferry needs C++20' error (log above)" >&2; exit 1; }

echo "pkg-config consumers"
# The modules name the final prefix; point them at the scratch one. The modules they require
# (liburing, ucx, ...) are the system's.
mkdir "$scratch/pc"
for pc in "$prefix"/share/pkgconfig/ferry*.pc; do
  sed "s|^prefix=.*|prefix=$prefix|" "$pc" >"$scratch/pc/$(basename "$pc")"
done
for p in $parts; do
  [ -f "$scratch/pc/ferry-$p.pc" ] || { echo "ferry-$p.pc is not installed" >&2; exit 1; }
done
for p in $(ls "$scratch/pc" | sed -n 's/^ferry-\(.*\)\.pc$/\1/p'); do
  case " $parts " in *" $p "*) ;; *) echo "ferry-$p.pc installed, but ferry was built without $p" >&2
                                      exit 1 ;; esac
done
pc_build() {  # module, source, output, extra flags
  flags=$(PKG_CONFIG_PATH="$scratch/pc" pkg-config --cflags --libs "$1")
  # shellcheck disable=SC2086
  "$cxx" -Wall -Wextra -Werror $4 "$consumers/$2" $flags -o "$scratch/$3"
}
# The core in C++23 (-std=c++2b: clang 14's name for it): the module adds no -std of its own.
pc_build ferry core.cpp pc_core "-std=c++2b -DFERRY_CONSUMER_CXX23"
"$scratch/pc_core"
for p in $parts; do
  pc_build "ferry-$p" "$(source_of "$p")" "pc_$p" -std=c++20
  "$scratch/pc_$p"
done

command -v cmake >/dev/null 2>&1 || { echo "cmake not installed: CMake consumers not checked"; exit 77; }
echo "CMake consumers"
# Ninja, which the quick start installs for Meson: CMake's default generator needs make, which a
# fresh Debian 12 machine does not have.
cmake_parts=$(echo $parts | tr ' -' ';_')
cmake -G Ninja -S "$consumers" -B "$scratch/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_CXX_COMPILER="$cxx" -DFERRY_PARTS="$cmake_parts" >"$scratch/cmake.log" 2>&1 || {
  cat "$scratch/cmake.log" >&2; exit 1; }
cmake --build "$scratch/cmake-build" -j 2 >"$scratch/cmake-build.log" 2>&1 || {
  cat "$scratch/cmake-build.log" >&2; exit 1; }
for p in core $parts; do
  "$scratch/cmake-build/consumer_$(echo "$p" | tr - _)"
done
# The version file: requests the installed version meets, and ones it must refuse.
want() {
  rm -rf "$scratch/cmake-want"
  cmake -G Ninja -S "$source/tests/install" -B "$scratch/cmake-want" \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" -DFERRY_WANT="$1" \
    >"$scratch/want.log" 2>&1
}
version=$(sed -n 's/^set(PACKAGE_VERSION "\(.*\)")$/\1/p' \
  "$prefix/share/cmake/ferry/ferryConfigVersion.cmake")
major=${version%%.*}
for ok in "$version" "$major.0" "$major.0...<$((major + 1))" "$major.0...$version"; do
  want "$ok" || { echo "find_package(ferry $ok) refused ferry $version" >&2; exit 1; }
done
for refused in "$((major + 1)).0" "$major.999" "$((major + 1)).0...$((major + 2)).0" \
               "$major.0...<$major.0.1"; do
  if want "$refused"; then
    echo "find_package(ferry $refused) accepted ferry $version" >&2; exit 1
  fi
  # Refused for its version, not for something else going wrong.
  if ! grep -q "considered but not accepted" "$scratch/want.log"; then
    cat "$scratch/want.log" >&2
    echo "find_package(ferry $refused) failed, but not for the version (log above)" >&2
    exit 1
  fi
done

# A required component ferry lacks is refused with a message that says why: one it does not know,
# and one it was built without (where there is one).
wanting() {
  rm -rf "$scratch/cmake-want"
  cmake -G Ninja -S "$source/tests/install" -B "$scratch/cmake-want" \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" -DFERRY_COMPONENTS="$1" \
    >"$scratch/want.log" 2>&1
}
if wanting bogus; then echo "find_package(ferry COMPONENTS bogus) succeeded" >&2; exit 1; fi
grep -q "ferry has no component 'bogus'" "$scratch/want.log" || {
  cat "$scratch/want.log" >&2; echo "find_package(ferry COMPONENTS bogus) did not say why" >&2; exit 1; }
for p in uring verbs ucx etcd gpu_hip gpu_cuda; do
  case " $parts " in *" $(echo "$p" | tr _ -) "*) continue ;; esac
  if wanting "$p"; then echo "find_package(ferry COMPONENTS $p) succeeded without it" >&2; exit 1; fi
  grep -q "ferry::$p is not available: this ferry was built without" "$scratch/want.log" || {
    cat "$scratch/want.log" >&2; echo "find_package(ferry COMPONENTS $p) did not say why" >&2; exit 1; }
  break
done

echo "Meson subproject consumers"
parent="$scratch/parent"
mkdir -p "$parent/subprojects"
cp "$consumers"/meson.build "$consumers"/meson_options.txt "$consumers"/*.cpp "$parent/"
ln -s "$source" "$parent/subprojects/ferry"
meson_parts=$(echo $parts | tr ' ' ',')
# forcefallback: the subproject, even where a ferry is installed on the machine.
CXX="$cxx" meson setup "$parent/build" "$parent" --wrap-mode=forcefallback \
  -Dparts="$meson_parts" >"$scratch/meson.log" 2>&1 || { cat "$scratch/meson.log" >&2; exit 1; }
# Nothing of ferry's own is built or registered in the parent: no target, no test.
meson introspect --targets --tests "$parent/build" | python3 -c '
import json, sys
info = json.load(sys.stdin)
own = [t["name"] for t in info["targets"] if t.get("subproject")]
if own or info["tests"]:
    sys.exit("ferry as a subproject added targets %s and tests %s" % (own, [t["name"] for t in info["tests"]]))
'
ninja -C "$parent/build" -j 2 >"$scratch/meson-build.log" 2>&1 || {
  cat "$scratch/meson-build.log" >&2; exit 1; }
for p in core $parts; do
  "$parent/build/consumer_$(echo "$p" | tr - _)"
done
echo "installed headers, pkg-config modules, CMake targets and the Meson subproject work"
