#!/bin/sh
# ferry-perf's command line: --help prints the usage and exits 0; every bad argument prints what was
# wrong and the usage, and exits 2; a backend it was built without, or verbs, is refused the same way.
#   ferry_perf_usage.sh FERRY_PERF
set -u
perf=$1
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$perf" --help >"$out" 2>&1 || { echo "--help exited $?"; exit 1; }
grep -q "^usage:" "$out" || { echo "--help printed no usage"; exit 1; }
bad() {
  "$perf" "$@" >"$out" 2>&1
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "^usage:" "$out"; then
    echo "ferry-perf $*: exit $rc (expected 2 and the usage):"; cat "$out"; exit 1
  fi
  echo "ok: ferry-perf $* -> 2: $(head -n 1 "$out")"
}
bad
bad bogus
bad initiator
bad initiator --backend tcp
bad initiator --connect 127.0.0.1
bad initiator --connect 127.0.0.1:99999
bad initiator --connect 127.0.0.1:7000 --backend carrier-pigeon
bad initiator --connect 127.0.0.1:7000 --block-size 4X
bad initiator --connect 127.0.0.1:7000 --block-size 64K:4K
bad initiator --connect 127.0.0.1:7000 --block-size 0
bad initiator --connect 127.0.0.1:7000 --batch 0
bad initiator --connect 127.0.0.1:7000 --depth -1
bad initiator --connect 127.0.0.1:7000 --threads many
bad initiator --connect 127.0.0.1:7000 --executor sometimes
bad initiator --connect 127.0.0.1:7000 --workload bulk
bad initiator --connect 127.0.0.1:7000 --op erase
bad initiator --connect 127.0.0.1:7000 --duration 0
bad initiator --connect 127.0.0.1:7000 --duration
bad initiator --connect 127.0.0.1:7000 --no-such-option
bad initiator --connect 127.0.0.1:7000 --backend verbs
bad target --backend tcp
bad file
echo "ferry-perf usage: ok"
