#!/bin/bash
# ferry-perf between two network namespaces joined by a veth pair this script makes: a target in one,
# the initiator in the other, over BACKEND (tcp or ucx). Checks that a stream sweep, a latency run and
# a kv run succeed and that their JSON, SVG and Prometheus outputs hold what the runs did; that
# --check passes on writes and reads and fails, naming the block and byte, against a target that
# corrupts one byte (the test hook FERRY_PERF_TEST_CORRUPT); then that a target killed mid-run ends
# the initiator, well before the run's length, with no result row and one error line, exit 1.
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

# A second target, on port 7302, that flips byte 100 of thread 0's block 0 in checked runs.
corrupt_pid=""
netns_on_exit '[ -n "$corrupt_pid" ] && kill -9 "$corrupt_pid"'
start_corrupting_target() {
  FERRY_PERF_TEST_CORRUPT=100 ip netns exec "$ns_t" "$perf" target --backend "$backend" --listen "$ip_a:7302" \
    >>"$work/corrupt.log" 2>&1 &
  corrupt_pid=$!
  for _ in $(seq 50); do
    ip netns exec "$ns_t" ss -ltn 2>/dev/null | grep -q "$ip_a:7302" && return 0
    sleep 0.1
  done
  echo "the corrupting target did not start listening"; cat "$work/corrupt.log"; exit 1
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
"$py" "$checker" svg "$work/stream.svg" stream || fail "stream SVG"
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

read_op=get
[ "$backend" = tcp ] && read_op=receive
echo "== latency, read"
initiator --op read --workload latency --block-size 4K --duration 0.5 --executor busy \
  --json "$work/latency.json" --plot "$work/latency.svg" || fail "latency run exited $?"
"$py" "$checker" json "$work/latency.json" "$backend" read latency 4096 $read_op || fail "latency JSON"
"$py" "$checker" svg "$work/latency.svg" latency || fail "latency SVG"

echo "== kv"
initiator --op write --workload kv --layers 4 --requests 2 --batch 2 --block-size 16K:32K --duration 0.5 \
  --executor park --json "$work/kv.json" --plot "$work/kv.svg" || fail "kv run exited $?"
"$py" "$checker" json "$work/kv.json" "$backend" write kv 16384,32768 $metric_op || fail "kv JSON"
"$py" "$checker" svg "$work/kv.svg" kv 4 || fail "kv SVG"

for op in write read; do
  echo "== --check, $op"
  initiator --op "$op" --block-size 4K:16K --batch 2 --depth 2 --threads 2 --duration 0.3 --check \
    --json "$work/check.json" || fail "checked $op run exited $?"
  check_op=$metric_op
  [ "$op" = read ] && check_op=$read_op
  "$py" "$checker" json "$work/check.json" "$backend" "$op" stream 4096,8192,16384 $check_op "" checked \
    || fail "checked $op JSON"
done
echo "== --check, kv write"
initiator --op write --workload kv --layers 3 --requests 2 --batch 2 --block-size 8K --duration 0.3 --check \
  || fail "checked kv run exited $?"

start_corrupting_target
for op in write read; do
  echo "== --check, $op, one byte corrupted on the target"
  timeout 120 ip netns exec "$ns_i" "$perf" initiator --backend "$backend" --connect "$ip_a:7302" --op "$op" \
    --block-size 4K --threads 2 --duration 0.3 --check >"$work/c.out" 2>"$work/c.err"
  rc=$?
  cat "$work/c.out" "$work/c.err"
  [ "$rc" -eq 1 ] || fail "a corrupted checked $op run exited $rc, expected 1"
  [ "$(grep -c . "$work/c.out")" -eq 2 ] || fail "the corrupted $op run printed a result row"
  [ "$(grep -c . "$work/c.err")" -eq 1 ] || fail "the corrupted $op run printed $(grep -c . "$work/c.err") error lines"
  grep -q "run failed: check failed.*thread 0 block 0: byte 100 of 4096" "$work/c.err" \
    || fail "the corrupted $op run's error does not name the block and byte"
done

echo "== target killed mid-run"
begin=$(date +%s)
initiator --op write --block-size 64K --duration 30 --timeout 2 >"$work/killed.out" 2>"$work/killed.err" &
initiator_pid=$!
sleep 1.5
kill -9 "$target_pid"
wait "$target_pid" 2>/dev/null
target_pid=""
wait "$initiator_pid"
rc=$?
initiator_pid=""
took=$(( $(date +%s) - begin ))
cat "$work/killed.out" "$work/killed.err"
[ "$rc" -ne 124 ] || fail "the initiator hung until the test's own timeout"
[ "$rc" -eq 1 ] || fail "the initiator exited $rc after its target was killed, expected 1"
[ "$took" -lt 25 ] || fail "the initiator took $took s to notice (deadline 2 s)"
[ "$(grep -c . "$work/killed.out")" -eq 2 ] || fail "the failed run printed a result row"
[ "$(grep -c . "$work/killed.err")" -eq 1 ] || fail "the failed run printed more than one error line"
grep -q "^ferry-perf: 64K run failed: " "$work/killed.err" || fail "the initiator did not say what failed"
! grep -q "failed: failed" "$work/killed.err" || fail "the error is doubled"
echo "ferry-perf over $backend between namespaces: ok (killed target noticed in ${took} s, exit $rc)"
