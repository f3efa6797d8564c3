#!/bin/sh
# ferry-perf's control protocol, spoken to a real target and a real initiator over 127.0.0.1 (tcp):
#  - a target told a malformed or out-of-range number (timeout=-1, nan, inf, a negative count, hex,
#    a field missing, twice or unknown, another backend) refuses the run at once, answering "error"
#    with the field and its value, logs one line saying why, and serves the next run;
#  - an initiator given a bad answer (ready port=102393, cpu ... ops=-1 or user_s=nan, through a
#    proxy that rewrites the target's lines) fails the run naming the field and its value;
#  - a failed run (those, and a target killed mid-run) prints no result row and exactly one error
#    line, and exits 1.
# Every wait is bounded (socket timeouts, `timeout`).
#   ferry_perf_control.sh FERRY_PERF
set -u
perf=$1
py=/usr/bin/python3
[ -x "$py" ] || { echo "skipped: no /usr/bin/python3 to speak the protocol"; exit 77; }
work=$(mktemp -d)
target=""
trap '[ -n "$target" ] && kill -9 "$target" 2>/dev/null; rm -rf "$work"' EXIT
fail() { echo "FAILED: $*"; echo "--- target log"; cat "$work/target.log"; exit 1; }

port=$((20000 + $$ % 20000))
proxy_port=$((port + 1))
"$perf" target --backend tcp --listen "127.0.0.1:$port" --timeout 2 >"$work/target.log" 2>&1 &
target=$!
if grep -q "built without it" "$work/target.log" 2>/dev/null; then
  echo "skipped: this ferry-perf was built without tcp"; exit 77
fi

echo "== crafted hellos"
timeout 120 "$py" - "$port" >"$work/hello.out" 2>&1 <<'PY'
import socket, sys, time
port = int(sys.argv[1])
good = {"backend": "tcp", "op": "write", "threads": "1", "slots": "4", "block": "4096", "transport": "tcp",
        "duration": "1", "timeout": "1", "check": "0"}

def hello(**change):
    fields = dict(good)
    for k, v in change.items():
        if v is None:
            fields.pop(k)
        else:
            fields[k] = v
    return "hello " + " ".join("%s=%s" % kv for kv in fields.items())

# (line, what the answer must say)
cases = [
    (hello(timeout="-1"), "timeout='-1'"),
    (hello(timeout="nan"), "timeout='nan'"),
    (hello(timeout="inf"), "timeout='inf'"),
    (hello(timeout="0"), "timeout='0'"),
    (hello(duration="1e999"), "duration='1e999'"),
    (hello(duration="-5"), "duration='-5'"),
    (hello(threads="-1"), "threads='-1'"),
    (hello(threads="x"), "threads='x'"),
    (hello(threads="65"), "threads='65'"),
    (hello(slots="18446744073709551615"), "slots='18446744073709551615'"),
    (hello(slots="18446744073709551616"), "slots='18446744073709551616'"),
    (hello(block="0x10"), "block='0x10'"),
    (hello(block=" 5"), "is not a field"),
    (hello(block=None), "field 'block' is missing"),
    (hello(check="2"), "check='2'"),
    (hello(check="1"), "field 'seed' is missing"),
    (hello(check="1", seed="-3"), "seed='-3'"),
    (hello(op="erase"), "op='erase'"),
    (hello() + " threads=2", "field 'threads' given twice"),
    (hello() + " flavour=mint", "unknown field 'flavour=mint'"),
    (hello(backend="ucx"), "serves --backend tcp, not ucx"),
    (hello(threads="64", slots="8589934592", block="8589934592"), "more memory than the target gives"),
    ("GET / HTTP/1.0", "not a ferry-perf initiator"),
]
bad = 0
for line, want in cases:
    for _ in range(100):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    else:
        sys.exit("the target never listened")
    s.settimeout(10)
    start = time.monotonic()
    s.sendall(line.encode() + b"\n")
    try:
        answer = s.makefile().readline().strip()
    except OSError as e:
        answer = "(no answer: %s)" % e
    took = time.monotonic() - start
    s.close()
    ok = answer.startswith("error ") and want in answer and took < 5
    bad += not ok
    print("%s: %r -> %r (%.2f s)" % ("ok" if ok else "WRONG", line, answer, took))
print("cases: %d" % len(cases))
sys.exit(1 if bad else 0)
PY
rc=$?
cat "$work/hello.out"
[ "$rc" -eq 0 ] || fail "the target did not refuse every crafted hello at once, naming the field"
cases=$(sed -n 's/^cases: //p' "$work/hello.out")
refused=$(grep -c "refused a run from 127.0.0.1:[0-9]*: " "$work/target.log")
[ "$refused" -eq "$cases" ] || fail "the target logged $refused refusals for $cases refused runs"
kill -0 "$target" 2>/dev/null || fail "the target is gone after refusing runs"

echo "== the target serves the next run"
timeout 60 "$perf" initiator --backend tcp --connect "127.0.0.1:$port" --block-size 4K --duration 0.2 \
  --timeout 2 >"$work/run.out" 2>&1 || { cat "$work/run.out"; fail "a good run after the refusals exited $?"; }
grep -q "^4K " "$work/run.out" || { cat "$work/run.out"; fail "the good run printed no row"; }

# The initiator's side: a proxy between it and the target rewrites one of the target's lines.
proxy() {
  rm -f "$work/proxy.listening"
  "$py" - "$proxy_port" "$port" "$1" "$2" "$work/proxy.listening" <<'PY' &
import re, socket, sys, threading
listen_port, target_port, match, replace = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", listen_port))
srv.listen(1)
open(sys.argv[5], "w").close()
srv.settimeout(30)
c, _ = srv.accept()
t = socket.create_connection(("127.0.0.1", target_port), timeout=30)
c.settimeout(60)
t.settimeout(60)

def pump(a, b, rewrite):
    buf = b""
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode()
                if rewrite and re.match(match, text):
                    text = re.sub(match, replace, text)
                b.sendall(text.encode() + b"\n")
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

threads = [threading.Thread(target=pump, args=(c, t, False)), threading.Thread(target=pump, args=(t, c, True))]
for th in threads:
    th.start()
for th in threads:
    th.join(90)
PY
  proxy_pid=$!
  for _ in $(seq 200); do
    [ -e "$work/proxy.listening" ] && return 0
    sleep 0.05
  done
  fail "the proxy did not listen"
}

# One initiator run that must fail: exit 1, no result row, one error line saying `want`.
failed_run() {
  name=$1
  want=$2
  shift 2
  echo "== $name"
  timeout 60 "$perf" initiator --backend tcp --block-size 4K --timeout 2 "$@" >"$work/out" 2>"$work/err"
  rc=$?
  echo "exit $rc; stdout:"; cat "$work/out"; echo "stderr:"; cat "$work/err"
  [ "$rc" -eq 1 ] || fail "$name: exit $rc, expected 1"
  [ "$(grep -c . "$work/out")" -eq 2 ] || fail "$name: a failed run printed a result row (or lost its header)"
  [ "$(grep -c . "$work/err")" -eq 1 ] || fail "$name: $(grep -c . "$work/err") lines on stderr, expected one"
  grep -q "^ferry-perf: 4K run failed: .*$want" "$work/err" || fail "$name: the error does not say '$want'"
  ! grep -q "failed: failed\|stoul\|stod\|stoull" "$work/err" || fail "$name: a doubled or raw error"
}

proxy '^ready port=[0-9]*' 'ready port=102393'
failed_run "ready with port 102393" "port='102393' is not a whole number from 1 to 65535" \
  --connect "127.0.0.1:$proxy_port" --duration 0.2
kill "$proxy_pid" 2>/dev/null
wait "$proxy_pid" 2>/dev/null
# The target waits its --timeout for the data connections that never come, then serves the next run.
for _ in $(seq 100); do
  grep -q "data connections did not arrive" "$work/target.log" && break
  sleep 0.05
done

proxy '^cpu .*' 'cpu user_s=0.5 system_s=0.25 ops=-1'
failed_run "cpu with ops=-1" "ops='-1' is not a whole number" --connect "127.0.0.1:$proxy_port" --duration 0.2
wait "$proxy_pid" 2>/dev/null

proxy '^cpu .*' 'cpu user_s=nan system_s=0 ops=5'
failed_run "cpu with user_s=nan" "user_s='nan' is not a number of seconds" --connect "127.0.0.1:$proxy_port" \
  --duration 0.2
wait "$proxy_pid" 2>/dev/null

proxy '^cpu .*' 'cpu'
failed_run "cpu without its fields" "field 'user_s' is missing" --connect "127.0.0.1:$proxy_port" --duration 0.2
wait "$proxy_pid" 2>/dev/null

# A run cut by the target's death: the batch's failure, said once.
kill -9 "$target"
wait "$target" 2>/dev/null
# The log already holds the first target's "tcp on" line: wait for one more.
listening=$(grep -c "tcp on 127.0.0.1:$port" "$work/target.log")
"$perf" target --backend tcp --listen "127.0.0.1:$port" --timeout 2 >>"$work/target.log" 2>&1 &
target=$!
for _ in $(seq 100); do
  [ "$(grep -c "tcp on 127.0.0.1:$port" "$work/target.log")" -gt "$listening" ] && break
  sleep 0.05
done
( sleep 1.5; kill -9 "$target" ) &
begin=$(date +%s)
failed_run "target killed mid-run" "transfer [0-9]* of a batch of [0-9]*: \|timed out after" --connect "127.0.0.1:$port" \
  --duration 20 --op read
took=$(( $(date +%s) - begin ))
wait "$target" 2>/dev/null
target=""
[ "$took" -lt 15 ] || fail "the initiator took $took s to notice its target's death"
echo "ferry-perf control protocol: ok"
