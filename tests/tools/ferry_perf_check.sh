#!/bin/sh
# ferry-perf --check, on one host: file reads and writes (io_uring, with and without O_DIRECT) and tcp
# over 127.0.0.1 (a target serving the initiator), each workload. Checked runs pass and say so in
# the JSON; with the test hook FERRY_PERF_TEST_CORRUPT=100 (one byte flipped on the side that holds
# the data: the target, or the file) a checked run fails, exit 1, no result row, one line naming the
# block and the byte, while a run without --check does not notice (it looks at no data). ucx runs
# are checked between namespaces (ferry_perf_two_namespaces.sh), verbs on the fake adapter.
#   ferry_perf_check.sh FERRY_PERF CHECKER
set -u
perf=$1
checker=$2
py=/usr/bin/python3
[ -x "$py" ] || { echo "skipped: no /usr/bin/python3 to check the outputs"; exit 77; }
work=$(mktemp -d)
target=""
trap '[ -n "$target" ] && kill -9 "$target" 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAILED: $*"; [ -f "$work/target.log" ] && { echo "--- target log"; cat "$work/target.log"; }; exit 1; }

run() {
  timeout 120 "$perf" "$@" >"$work/out" 2>"$work/err"
  rc=$?
  cat "$work/out" "$work/err"
  return $rc
}

# A checked run that must fail: exit 1, no row, one line on stderr saying `want`.
mismatch() {
  name=$1
  want=$2
  shift 2
  echo "== $name"
  run "$@"
  rc=$?
  [ "$rc" -eq 1 ] || fail "$name: exit $rc, expected 1"
  [ "$(grep -c . "$work/out")" -eq 2 ] || fail "$name: a failed run printed a result row"
  [ "$(grep -c . "$work/err")" -eq 1 ] || fail "$name: $(grep -c . "$work/err") lines on stderr, expected one"
  grep -q "run failed: check failed.*$want" "$work/err" || fail "$name: the error does not say '$want'"
}

f="$work/data"
for direct in "" --direct; do
  for op in write read; do
    echo "== file $op $direct, checked"
    run file --path "$f" $direct --op "$op" --block-size 4K:8K --file-size 1M --batch 4 --depth 2 --threads 2 \
      --duration 0.3 --check --json "$work/file.json" || fail "file $op $direct --check exited $?"
    "$py" "$checker" json "$work/file.json" file "$op" stream 4096,8192 "$op" "" checked || fail "file $op JSON"
  done
done
echo "== file, kv and latency, checked"
run file --path "$f" --op read --workload kv --layers 3 --requests 2 --batch 2 --block-size 4K --file-size 1M \
  --duration 0.3 --check || fail "file kv --check exited $?"
run file --path "$f" --op write --workload latency --block-size 512 --file-size 64K --duration 0.3 --check \
  || fail "file latency --check exited $?"
export FERRY_PERF_TEST_CORRUPT=100
# Four places of 4K in the file: thousands of blocks in 0.3 s reach the first one.
mismatch "file read, one byte corrupted" "block read at file offset 0: byte 100 of 4096" \
  file --path "$f" --op read --block-size 4K --file-size 16K --duration 0.3 --check
mismatch "file write, one byte corrupted" "block written at file offset 0: byte 100 of 4096" \
  file --path "$f" --op write --block-size 4K --file-size 16K --duration 0.3 --check
echo "== file read, one byte corrupted, not checked"
run file --path "$f" --op read --block-size 4K --file-size 16K --duration 0.3 || fail "an unchecked run failed"
unset FERRY_PERF_TEST_CORRUPT

port=$((20000 + ($$ + 4111) % 20000))
start_target() {
  "$perf" target --backend tcp --listen "127.0.0.1:$port" --timeout 2 >"$work/target.log" 2>&1 &
  target=$!
  for _ in $(seq 100); do
    grep -q "tcp on 127.0.0.1:$port" "$work/target.log" && return 0
    sleep 0.05
  done
  fail "the target did not start"
}
stop_target() {
  kill "$target"
  wait "$target" 2>/dev/null
  target=""
}

start_target
for op in write read; do
  echo "== tcp $op, checked"
  run initiator --backend tcp --connect "127.0.0.1:$port" --op "$op" --block-size 1K:8K --batch 2 --depth 3 \
    --threads 2 --duration 0.3 --check --json "$work/tcp.json" || fail "tcp $op --check exited $?"
  metric_op=send
  [ "$op" = read ] && metric_op=receive
  "$py" "$checker" json "$work/tcp.json" tcp "$op" stream 1024,2048,4096,8192 $metric_op "" checked \
    || fail "tcp $op JSON"
  echo "== tcp $op, kv and latency, checked"
  run initiator --backend tcp --connect "127.0.0.1:$port" --op "$op" --workload kv --layers 3 --requests 2 \
    --block-size 3000 --duration 0.3 --check || fail "tcp $op kv --check exited $?"
  run initiator --backend tcp --connect "127.0.0.1:$port" --op "$op" --workload latency --block-size 1 \
    --duration 0.3 --check || fail "tcp $op latency --check exited $?"
done
stop_target

export FERRY_PERF_TEST_CORRUPT=100
start_target
unset FERRY_PERF_TEST_CORRUPT
mismatch "tcp write, one byte corrupted on the target" "on the target: thread 0 block 0: byte 100 of 4096" \
  initiator --backend tcp --connect "127.0.0.1:$port" --op write --block-size 4K --threads 2 --duration 0.3 --check
grep -q "failed its check: thread 0 block 0: byte 100 of 4096" "$work/target.log" \
  || fail "the target did not log the mismatch it found"
mismatch "tcp read, one byte corrupted on the target" "thread 0 block 0: byte 100 of 4096" \
  initiator --backend tcp --connect "127.0.0.1:$port" --op read --block-size 4K --threads 2 --duration 0.3 --check
echo "== tcp write, one byte corrupted on the target, not checked"
run initiator --backend tcp --connect "127.0.0.1:$port" --op write --block-size 4K --duration 0.3 \
  || fail "an unchecked run failed"
stop_target
echo "ferry-perf --check: ok"
