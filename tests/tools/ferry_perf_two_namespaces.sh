#!/bin/bash
# ferry-perf between two network namespaces joined by a veth pair this script makes: a target in one,
# the initiator in the other, over BACKEND (tcp or ucx). Checks that a stream sweep, a latency run and
# a kv run succeed and that their JSON, SVG and Prometheus outputs hold what the runs did; then that
# a target killed mid-run ends the initiator with an error, non-zero, well before the run's length.
# Skipped (exit 77, saying why) where namespaces cannot be made. Everything it made goes on any exit.
#
#   ferry_perf_two_namespaces.sh BACKEND FERRY_PERF CHECKER
set -u
backend=$1
perf=$2
checker=$3
py=/usr/bin/python3

[ -x "$py" ] || { echo "skipped: no /usr/bin/python3 to check the outputs"; exit 77; }

. "$(dirname "$0")/../netns_pair.sh"
netns_pair ferry_perf
ns_t=$ns_a
ns_i=$ns_b
target_pid=""
initiator_pid=""
netns_on_exit '[ -n "$initiator_pid" ] && kill -9 "$initiator_pid"'
netns_on_exit '[ -n "$target_pid" ] && kill -9 "$target_pid"'
addr="$ip_a:7301"

start_target() {
  ip netns exec "$ns_t" "$perf" target --backend "$backend" --listen "$addr" >>"$work/target.log" 2>&1 &
  target_pid=$!
  for _ in $(seq 50); do
    ip netns exec "$ns_t" ss -ltn 2>/dev/null | grep -q "$ip_a:7301" && return 0
    sleep 0.1
  done
  echo "the target did not start listening"; cat "$work/target.log"; exit 1
}

initiator() {
  timeout 120 ip netns exec "$ns_i" "$perf" initiator --backend "$backend" --connect "$addr" "$@"
}

fail() { echo "FAILED: $*"; echo "--- target log"; cat "$work/target.log"; exit 1; }

metric_op=put
[ "$backend" = tcp ] && metric_op=send
peer=peer  # both backends label their series per peer too

start_target
echo "== stream sweep, write"
initiator --op write --block-size 4K:64K --batch 2 --depth 2 --threads 2 --duration 0.5 \
  --json "$work/stream.json" --plot "$work/stream.svg" --prometheus "$work/stream.prom" \
  || fail "stream run exited $?"
"$py" "$checker" json "$work/stream.json" "$backend" write stream 4096,8192,16384,32768,65536 $metric_op $peer \
  || fail "stream JSON"
"$py" "$checker" svg "$work/stream.svg" || fail "stream SVG"
"$py" "$checker" prometheus "$work/stream.prom" || fail "Prometheus text"
"$py" -c "import json,sys; d=json.load(open(sys.argv[1])); assert d['config']['threads']==2 and d['config']['batch']==2, d['config']" \
  "$work/stream.json" || fail "configuration in the JSON"

if [ "$backend" = ucx ]; then
  echo "== stream, puts that end when their source may be reused"
  initiator --op write --block-size 64K --put-completion source-reusable --duration 0.5 \
    --json "$work/reusable.json" || fail "source-reusable run exited $?"
  "$py" "$checker" json "$work/reusable.json" ucx write stream 65536 put || fail "source-reusable JSON"
  "$py" -c "import json,sys; c=json.load(open(sys.argv[1]))['config']; assert c['put_completion']=='source-reusable', c" \
    "$work/reusable.json" || fail "put_completion in the JSON"
fi

echo "== latency, read"
initiator --op read --workload latency --block-size 4K --duration 0.5 --executor busy \
  --json "$work/latency.json" --plot "$work/latency.svg" || fail "latency run exited $?"
read_op=get
[ "$backend" = tcp ] && read_op=receive
"$py" "$checker" json "$work/latency.json" "$backend" read latency 4096 $read_op || fail "latency JSON"
"$py" "$checker" svg "$work/latency.svg" || fail "latency SVG"

echo "== kv"
initiator --op write --workload kv --layers 4 --requests 2 --batch 2 --block-size 16K --duration 0.5 \
  --executor park --json "$work/kv.json" || fail "kv run exited $?"
"$py" "$checker" json "$work/kv.json" "$backend" write kv 16384 $metric_op || fail "kv JSON"

echo "== target killed mid-run"
begin=$(date +%s)
initiator --op write --block-size 64K --duration 30 --timeout 2 >"$work/killed.out" 2>&1 &
initiator_pid=$!
sleep 1.5
kill -9 "$target_pid"
wait "$target_pid" 2>/dev/null
target_pid=""
wait "$initiator_pid"
rc=$?
initiator_pid=""
took=$(( $(date +%s) - begin ))
cat "$work/killed.out"
[ "$rc" -ne 0 ] || fail "the initiator exited 0 after its target was killed"
[ "$rc" -ne 124 ] || fail "the initiator hung until the test's own timeout"
[ "$took" -lt 25 ] || fail "the initiator took $took s to notice (deadline 2 s)"
grep -q "run failed" "$work/killed.out" || fail "the initiator did not say what failed"
echo "ferry-perf over $backend between namespaces: ok (killed target noticed in ${took} s, exit $rc)"
