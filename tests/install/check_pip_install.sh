#!/bin/sh
# `pip install .` through meson-python (pyproject.toml), as docs/python.md gives it for Debian 12: a
# venv that sees the system's site packages (pybind11, meson-python, numpy), no build isolation, no
# network. Then, from outside the source, `import ferry` and one real loopback copy, and the
# installed files are the ferry package alone (no headers, pkg-config or CMake files). One build of
# the module (a minute or two). The checkout is copied first, so that meson-python's working files
# (.mesonpy-*) never appear in it. Skipped (77) where meson-python or venv is missing.
# Usage: check_pip_install.sh SOURCE_DIR PYTHON CXX VERSION
set -eu
source=$1; python=$2; cxx=$3; version=$4
if ! "$python" -c 'import mesonpy' 2>/dev/null; then
  echo "skipped: meson-python is not installed for $python (Debian: python3-mesonpy)"; exit 77
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
if ! "$python" -m venv --system-site-packages "$scratch/venv" >"$scratch/venv.log" 2>&1; then
  cat "$scratch/venv.log"
  echo "skipped: $python -m venv does not work here (Debian: python3-venv)"; exit 77
fi
if [ ! -x "$scratch/venv/bin/pip" ]; then
  echo "skipped: the venv has no pip (Debian: python3-pip, python3-venv)"; exit 77
fi

mkdir "$scratch/src"
(cd "$source" && tar -cf - --exclude=./.git --exclude='./build*' --exclude='./.mesonpy*' \
   --exclude='./subprojects/Catch2-*' --exclude=./subprojects/packagecache .) |
  tar -xf - -C "$scratch/src"

start=$(date +%s)
if ! (cd "$scratch/src" && CXX="$cxx" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INDEX=1 \
      "$scratch/venv/bin/pip" install --no-build-isolation . >"$scratch/pip.log" 2>&1); then
  cat "$scratch/pip.log" >&2
  echo "pip install --no-build-isolation . failed (log above)" >&2
  exit 1
fi
echo "pip install --no-build-isolation . took $(($(date +%s) - start)) s"

cd /
"$scratch/venv/bin/python" - "$scratch/venv" "$version" <<'EOF'
import importlib.metadata, pathlib, sys
venv, version = pathlib.Path(sys.argv[1]).resolve(), sys.argv[2]
import ferry
where = pathlib.Path(ferry.__file__).resolve()
assert venv in where.parents, f"ferry imported from {where}, not from the venv {venv}"
ex = ferry.Executor()
lb = ferry.Loopback(ex)
src, dst = bytearray(b"ferry" * 1000), bytearray(5000)
state = lb.copy(dst, src).wait(5.0)
assert state == ferry.State.success, state
assert dst == src, "the copy's bytes did not land"
got = importlib.metadata.version("ferry")
assert got == version, f"the installed distribution says {got}, meson.build {version}"
files = [str(f) for f in importlib.metadata.files("ferry")]
stray = [f for f in files
         if not (f.startswith("ferry/") or f.startswith(f"ferry-{version}.dist-info/"))]
assert not stray, f"the wheel installed more than the ferry package: {stray}"
assert any(f.startswith("ferry/_ferry.") for f in files), files
print(f"import ferry from {where.parent}: a 5000-byte loopback copy {state}; "
      f"ferry {got}, {len(files)} files, all in the package or its dist-info")
EOF
