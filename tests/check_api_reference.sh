#!/bin/sh
# Usage: check_api_reference.sh DOXYFILE
# Runs doxygen with the Doxyfile Meson generated (docs/Doxyfile.in) into a temporary directory and
# fails on any warning: an undocumented public declaration, a broken reference, a markup error.
# Skipped (77) where doxygen is not installed (Debian: doxygen).
doxyfile=$1
if ! command -v doxygen >/dev/null 2>&1; then
  echo "skipped: doxygen not found (Debian: doxygen)"; exit 77
fi
if [ ! -f "$doxyfile" ]; then
  echo "no generated Doxyfile at $doxyfile (reconfigure the build directory)"; exit 1
fi
out=$(mktemp -d "${TMPDIR:-/tmp}/ferry-api-reference.XXXXXX") || exit 1
trap 'rm -rf "$out"' EXIT
# Later settings override earlier ones: the output and the warning log go to the temporary directory.
{ cat "$doxyfile"; printf 'OUTPUT_DIRECTORY = %s\nWARN_LOGFILE = %s\n' "$out" "$out/warnings.log"; } |
  doxygen - >"$out/doxygen.out" 2>&1
rc=$?
warnings=0
[ -f "$out/warnings.log" ] && warnings=$(grep -c . "$out/warnings.log")
if [ "$rc" -ne 0 ] || [ "$warnings" -ne 0 ]; then
  echo "doxygen $(doxygen --version) exited with $rc and $warnings warning(s):"
  [ -f "$out/warnings.log" ] && cat "$out/warnings.log"
  tail -20 "$out/doxygen.out"
  exit 1
fi
if [ ! -f "$out/html/index.html" ]; then
  echo "doxygen wrote no html/index.html"; tail -20 "$out/doxygen.out"; exit 1
fi
echo "API reference built with doxygen $(doxygen --version): no warnings"
