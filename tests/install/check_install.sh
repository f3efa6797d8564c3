#!/bin/sh
# Installs the build into a scratch directory, then builds and runs a consumer program twice: through
# the generated pkg-config file and through the CMake package (find_package(ferry), ferry::ferry).
# Usage: check_install.sh BUILD_DIR SOURCE_DIR CXX
set -eu
build=$1; source=$2; cxx=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
DESTDIR="$scratch/root" meson install -C "$build" --no-rebuild --quiet
prefix=$(find "$scratch/root" -name ferry.hpp -path '*/include/ferry/*' | head -1)
prefix=${prefix%/include/ferry/ferry.hpp}
pcdir=$(dirname "$(find "$scratch/root" -name ferry.pc | head -1)")
# Headers only: the pkg-config and CMake files belong under share/, which pkg-config and CMake
# search on every distribution. Under libdir they can land in lib64, which CMake skips on Debian.
for f in pkgconfig/ferry.pc cmake/ferry/ferryConfig.cmake cmake/ferry/ferryConfigVersion.cmake; do
  if [ ! -f "$prefix/share/$f" ]; then
    echo "$f is not installed under $prefix/share" >&2; exit 1
  fi
done

echo "pkg-config consumer"
flags=$(PKG_CONFIG_PATH="$pcdir" PKG_CONFIG_SYSROOT_DIR="$scratch/root" pkg-config --cflags --libs ferry)
# shellcheck disable=SC2086
"$cxx" "$source/tests/install/consumer.cpp" $flags -o "$scratch/consumer_pc"
"$scratch/consumer_pc"

if command -v cmake >/dev/null 2>&1; then
  echo "CMake consumer"
  # Ninja, which the quick start installs for Meson: CMake's default generator needs make, which a
  # fresh Debian 12 machine does not have.
  cmake -G Ninja -S "$source/tests/install" -B "$scratch/cmake-build" \
    -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
  cmake --build "$scratch/cmake-build" >/dev/null
  "$scratch/cmake-build/consumer"
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
else
  echo "cmake not installed: CMake consumer not checked"; exit 77
fi
echo "installed headers, ferry.pc and ferryConfig.cmake work"
