#!/bin/sh
# ferry-perf's command line: --help prints the usage and exits 0; every bad argument prints what was
# wrong and the usage, and exits 2; a backend it was built without is refused the same way. Numbers
# are read strictly: a negative, NaN, infinite, hexadecimal, signed, padded or overflowing value, or
# buffers larger than a run gets, is refused naming the option and the value. Over verbs on a
# machine without an RDMA adapter, a run ends with exit 1 and says that none was found.
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
bad initiator --connect 127.0.0.1:7000 --gid-index 300
bad initiator --connect 127.0.0.1:7000 --device
bad initiator --connect 127.0.0.1:7000 --put-completion eventually
bad initiator --connect 127.0.0.1:7000 --backend tcp --put-completion landed
bad initiator --connect 127.0.0.1:7000 --backend ucx --device mlx5_0
bad initiator --connect 127.0.0.1:7000 --backend ucx --op read --put-completion landed
bad target --backend ucx --listen 127.0.0.1:7000 --put-completion landed
bad file --path /tmp/x --gid-index 3
bad target --backend verbs --listen localhost:7000
bad target --backend tcp
bad file

# bad_option OPTION ARGS...: refused as bad() is, with a first line naming OPTION and quoting its value.
bad_option() {
  option=$1
  shift
  "$perf" "$@" >"$out" 2>&1
  rc=$?
  first=$(head -n 1 "$out")
  if [ "$rc" -ne 2 ] || ! grep -q "^usage:" "$out" || [ "${first#*"$option"}" = "$first" ]; then
    echo "ferry-perf $*: exit $rc (expected 2, the usage and a first line naming $option):"; cat "$out"; exit 1
  fi
  echo "ok: ferry-perf $* -> 2: $first"
}
c="initiator --connect 127.0.0.1:7000"
bad_option "--duration: 'nan'" $c --duration nan
bad_option "--duration: 'inf'" $c --duration inf
bad_option "--duration: '-1'" $c --duration -1
bad_option "--duration: '0x10'" $c --duration 0x10
bad_option "--duration: '1e-9'" $c --duration 1e-9
bad_option "--duration: '1e999'" $c --duration 1e999
bad_option "--duration: '2s'" $c --duration 2s
bad_option "--timeout: 'NaN'" $c --timeout NaN
bad_option "--timeout: '-0.5'" $c --timeout -0.5
bad_option "--timeout: '86401'" $c --timeout 86401
bad_option "--batch: '99999999999999999999999'" $c --batch 99999999999999999999999
bad_option "--batch: '18446744073709551617'" $c --batch 18446744073709551617
bad_option "--threads: '+2'" $c --threads +2
bad_option "--depth: ' 4'" $c --depth " 4"
bad_option "--depth: '4 '" $c --depth "4 "
bad_option "--layers: '-3'" $c --layers -3
bad_option "--requests: '1.5'" $c --requests 1.5
bad_option "--block-size: '99999999999999999999K'" $c --block-size 99999999999999999999K
bad_option "--block-size: '4KBB'" $c --block-size 4KBB
bad_option "--block-size: '-4K'" $c --block-size -4K
bad_option "--block-size: '2048G'" $c --block-size 2048G
bad_option "--file-size: '-1'" file --path /tmp/x --file-size -1
bad_option "--gid-index: '-1'" $c --backend verbs --gid-index -1
bad_option "--gid-index: '0x1'" $c --backend verbs --gid-index 0x1
bad_option "--connect port: '99999'" initiator --connect 127.0.0.1:99999
bad_option "--connect port: '-1'" initiator --connect 127.0.0.1:-1
bad_option "--listen port: '0'" target --listen 127.0.0.1:0
bad_option "--transport: 'tcp check=1'" $c --backend ucx --transport "tcp check=1"
bad_option "--block-size 1G" $c --block-size 1G --batch 16
bad_option "--block-size 4K" $c --workload kv --layers 1024 --requests 1024 --batch 4096 --block-size 4K
bad_option "--block-size 64M" file --path /tmp/x --block-size 64M --threads 64 --depth 4
bad_option "--check" target --listen 127.0.0.1:7000 --check
bad_option "--check" $c --backend ucx --check --put-completion source-reusable

# verbs without an adapter: the target cannot open one and says so; the initiator reports it, exit 1.
"$perf" initiator --backend verbs --connect 127.0.0.1:1 --duration 0.1 >"$out" 2>&1
rc=$?
if grep -q "built without it" "$out"; then
  echo "ok: this ferry-perf was built without verbs (exit $rc)"
elif [ -n "$(ls /sys/class/infiniband 2>/dev/null)" ]; then
  echo "skipped: this machine has an RDMA adapter; the no-adapter check does not apply"
else
  port=$((20000 + $$ % 20000))
  "$perf" target --backend verbs --listen "127.0.0.1:$port" --once >"$out.target" 2>&1 &
  target=$!
  for _ in $(seq 50); do
    "$perf" initiator --backend verbs --connect "127.0.0.1:$port" --duration 0.1 --timeout 2 >"$out" 2>&1
    rc=$?
    grep -q "control connection" "$out" || break
    sleep 0.1
  done
  kill "$target" 2>/dev/null
  wait "$target" 2>/dev/null
  if [ "$rc" -ne 1 ] || ! grep -q "no RDMA device found" "$out"; then
    echo "verbs without an adapter: exit $rc (expected 1, saying no RDMA device was found):"; cat "$out"
    rm -f "$out.target"; exit 1
  fi
  rm -f "$out.target"
  echo "ok: verbs without an adapter -> 1: $(grep 'no RDMA device' "$out" | head -n 1)"
fi
# A target refuses a run whose sizes would wrap when multiplied (64 x 2^33 x 2^33 bytes is 0 modulo
# 2^64), naming the limit, and logs why; a --once target whose one run was refused exits 1.
port=$((20000 + ($$ + 7919) % 20000))
"$perf" target --backend tcp --listen "127.0.0.1:$port" --once >"$out.target" 2>&1 &
target=$!
answer=$(python3 - "$port" <<'PY'
import socket, sys, time
for _ in range(200):
    try:
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
        break
    except OSError:
        time.sleep(0.05)
else:
    sys.exit("the target never listened")
s.settimeout(10)
s.sendall(b"hello backend=tcp op=write threads=64 slots=8589934592 block=8589934592 transport=tcp duration=1 "
          b"timeout=1 check=0\n")
print(s.makefile().readline().strip())
PY
)
for _ in $(seq 100); do kill -0 "$target" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$target" 2>/dev/null; then
  kill "$target"; echo "a --once target did not end after refusing its run"; cat "$out.target"; exit 1
fi
wait "$target"
trc=$?
if grep -q "built without it" "$out.target"; then
  echo "ok: this ferry-perf was built without tcp (exit $trc)"
elif [ "$trc" -ne 1 ] || [ "${answer#error the run asks for more memory}" = "$answer" ]; then
  echo "a wrapping run: target exit $trc (expected 1), answer '$answer' (expected the memory refusal)"
  cat "$out.target"; rm -f "$out.target"; exit 1
elif ! grep -q "refused a run from 127.0.0.1:[0-9]*: the run asks for more memory" "$out.target"; then
  echo "the target did not log why it refused the run:"; cat "$out.target"; rm -f "$out.target"; exit 1
else
  echo "ok: a run of 64 threads of 2^33 slots of 2^33 B -> '$answer', target exit 1, logged"
fi
rm -f "$out.target"
echo "ferry-perf usage: ok"
