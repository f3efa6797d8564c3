#!/bin/sh
# Usage: check_compile_error.sh SOURCE EXPECTED_TEXT COMPILER [ARGS...]
# Succeeds when compiling SOURCE fails and the diagnostics contain EXPECTED_TEXT.
src=$1; expected=$2; shift 2
out=$("$@" -fsyntax-only "$src" 2>&1)
if [ $? -eq 0 ]; then
  echo "expected a compile error from $src, but it compiled"; exit 1
fi
if printf '%s' "$out" | grep -F -q -- "$expected"; then
  echo "compile error as expected: $expected"; exit 0
fi
echo "compile error did not mention: $expected"; printf '%s\n' "$out" | head -40; exit 1
