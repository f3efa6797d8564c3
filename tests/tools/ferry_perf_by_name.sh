#!/bin/sh
# ferry-perf finds its target by name through a real etcd (started here on 127.0.0.1 ports picked
# free): a target published with --publish (on --listen HOST:0) is reached with --find; a name with
# nobody under it, another backend, and options that do not go together are refused with a message;
# a target stopped with SIGTERM withdraws its name at once, a restarted one gets the next
# incarnation, a killed one's name goes with its lease. Every wait is bounded.
#   ferry_perf_by_name.sh FERRY_PERF
set -u
perf=$1
py=/usr/bin/python3
[ -x /usr/bin/etcd ] || { echo "skipped: /usr/bin/etcd not found (Debian: etcd-server)"; exit 77; }
[ -x "$py" ] || { echo "skipped: no /usr/bin/python3 to pick free ports"; exit 77; }
work=$(mktemp -d)
etcd_pid=""
target=""
trap '[ -n "$target" ] && kill -9 "$target" 2>/dev/null; [ -n "$etcd_pid" ] && kill -9 "$etcd_pid" 2>/dev/null; rm -rf "$work"' EXIT
fail() {
  echo "FAILED: $*"
  for f in "$work"/*.log; do echo "--- $f"; cat "$f"; done
  exit 1
}

set -- $("$py" -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')
client=$1; peer=$2
url="http://127.0.0.1:$client"
setpriv --pdeathsig KILL /usr/bin/etcd --name ferry-perf-test --data-dir "$work/etcd" \
  --listen-client-urls "$url" --advertise-client-urls "$url" \
  --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
  --initial-cluster "ferry-perf-test=http://127.0.0.1:$peer" --logger zap >"$work/etcd.log" 2>&1 &
etcd_pid=$!
i=0
until "$py" -c "import urllib.request,sys; urllib.request.urlopen('$url/health', timeout=1)" 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 150 ] || fail "etcd did not answer in 30 s"; sleep 0.2
done

# Starts a target published as $1; waits (bounded) for it to say so.
start_target() {
  "$perf" target --backend tcp --listen 127.0.0.1:0 --etcd "$url" --publish "$1" \
    >"$work/target.log" 2>&1 &
  target=$!
  i=0
  until grep -q "published as $1" "$work/target.log"; do
    i=$((i + 1)); [ $i -lt 100 ] || fail "the target did not publish in 20 s"; sleep 0.2
  done
}

echo "== a run found by name"
start_target perf/target-1
grep -q "published as perf/target-1 (incarnation 1) at 127.0.0.1:" "$work/target.log" ||
  fail "the target did not say where it published"
timeout 60 "$perf" initiator --backend tcp --etcd "$url" --find perf/target-1 --duration 0.3 \
  --block-size 64K --check >"$work/run.log" 2>&1 || fail "the run by name failed"
grep -q "perf/target-1 is at 127.0.0.1:" "$work/run.log" || fail "the initiator did not say where"
grep -q "^64K " "$work/run.log" || fail "no result row"

echo "== refusals"
expect() {  # status, message, command...
  want=$1; says=$2; shift 2
  timeout 60 "$@" >"$work/refused.log" 2>&1; got=$?
  [ "$got" = "$want" ] || fail "$* exited $got, not $want"
  grep -q -- "$says" "$work/refused.log" || fail "$* did not say '$says'"
}
expect 1 "nothing is published under" "$perf" initiator --backend tcp --etcd "$url" --find perf/nobody
expect 1 "runs --backend tcp, not ucx" "$perf" initiator --backend ucx --etcd "$url" --find perf/target-1
expect 2 "needs --etcd URL" "$perf" initiator --backend tcp --find perf/target-1
expect 2 "one of them" "$perf" initiator --backend tcp --connect 127.0.0.1:1 --etcd "$url" --find x
expect 2 "--publish is the target's" "$perf" initiator --backend tcp --etcd "$url" --publish x --connect 127.0.0.1:1
expect 2 "not a directory name" "$perf" initiator --backend tcp --etcd "$url" --find "bad name"
expect 2 "not an http" "$perf" initiator --backend tcp --etcd 127.0.0.1:1 --find x
expect 1 "did not answer" "$perf" initiator --backend tcp --etcd http://127.0.0.1:9 --find x --timeout 0.5

echo "== SIGTERM withdraws the name; a restart is the next incarnation"
kill -TERM "$target"
i=0
while kill -0 "$target" 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 100 ] || fail "the target did not stop on SIGTERM in 20 s"; sleep 0.2
done
wait "$target"; status=$?; target=""
[ "$status" = 0 ] || fail "the target exited $status on SIGTERM"
expect 1 "nothing is published under" "$perf" initiator --backend tcp --etcd "$url" --find perf/target-1
start_target perf/target-1
grep -q "(incarnation 2)" "$work/target.log" || fail "the restarted target is not incarnation 2"

echo "== a killed target's name goes with its lease"
kill -9 "$target"; wait "$target" 2>/dev/null; target=""
i=0
until timeout 30 "$perf" initiator --backend tcp --etcd "$url" --find perf/target-1 \
        >"$work/gone.log" 2>&1 || grep -q "nothing is published under" "$work/gone.log"; do
  i=$((i + 1)); [ $i -lt 60 ] || fail "the name was still there 30 s after its target was killed"
  sleep 0.5
done
grep -q "nothing is published under" "$work/gone.log" || fail "the killed target's name did not go"
echo "ok"
