#!/bin/sh
# ferry-perf over verbs, on the fake adapter (ferry_perf_fake_verbs.cpp runs target and initiator in
# one process), and its outputs checked as the namespace tests check tcp's and ucx's; --check runs
# pass, and find the byte that a corrupting target flipped.
#   ferry_perf_fake_verbs.sh DRIVER CHECKER
set -u
driver=$1
checker=$2
py=/usr/bin/python3
[ -x "$py" ] || { echo "skipped: no /usr/bin/python3 to check the outputs"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAILED: $*"; exit 1; }

timeout 120 "$driver" "$work" >"$work/driver.log" 2>&1
rc=$?
cat "$work/driver.log"
[ "$rc" -ne 124 ] || fail "the runs did not finish within 120 s"
[ "$rc" -eq 0 ] || fail "a run exited $rc"
grep -q "no_such_adapter" "$work/driver.log" || fail "the missing device was not named"

"$py" "$checker" json "$work/stream.json" verbs write stream 65536 write peer || fail "stream JSON"
"$py" "$checker" svg "$work/stream.svg" stream || fail "stream SVG"
"$py" "$checker" prometheus "$work/stream.prom" || fail "Prometheus text"
grep -q 'peer="127.0.0.1"' "$work/stream.prom" || fail "no per-peer series for the side channel's address"
"$py" -c "import json,sys; d=json.load(open(sys.argv[1])); c=d['config']; e=d['environment'];
assert c['threads']==2 and c['batch']==4 and c['transport']=='rc' and c['device']=='fake_initiator', c
assert e['verbs_provider'].startswith('fake'), e" "$work/stream.json" || fail "configuration in the JSON"
"$py" "$checker" json "$work/latency.json" verbs read latency 4096 read || fail "latency JSON"
"$py" "$checker" svg "$work/latency.svg" latency || fail "latency SVG"
"$py" "$checker" json "$work/kv.json" verbs write kv 16384 write || fail "kv JSON"
"$py" "$checker" svg "$work/kv.svg" kv 4 || fail "kv SVG"
"$py" "$checker" json "$work/check-write.json" verbs write stream 16384 write "" checked \
  || fail "checked write JSON"
"$py" "$checker" json "$work/check-read.json" verbs read stream 16384 read "" checked \
  || fail "checked read JSON"
grep -q "^ferry-perf: 4K run failed: check failed on the target: thread 0 block 0: byte 100 of 4096" \
  "$work/driver.log" || fail "a corrupted write was not found by the target's check"
grep -q "^ferry-perf target: the run from 127.0.0.1:[0-9]* failed its check: thread 0 block 0: byte 100" \
  "$work/driver.log" || fail "the target did not log the mismatch it found"
grep -q "^ferry-perf: 4K run failed: check failed: thread 0 block 0: byte 100 of 4096" "$work/driver.log" \
  || fail "a corrupted read was not found by the initiator's check"
echo "ferry-perf over verbs on the fake adapter: ok"
