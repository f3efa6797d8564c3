#!/bin/bash
# ferry-perf's UCX puts at one block size with each executor mode (busy, adaptive, park) on both
# sides, landed and source-reusable, against ucx_perftest -t ucp_put_bw (UCX_TLS=tcp), in
# interleaved rounds on one veth pair between two network namespaces this script makes (root;
# removed on exit). Prints one line per run: MB/s and CPU µs per put of each side (the target's
# as ferry-perf reports it). bench/two_host.sh is the wider comparison; this one answers which
# executor mode to run UCX with where both processes share the host's CPUs.
#
#   bench/ucx_executor_modes.sh FERRY_PERF [ROUNDS] [SECONDS] [BLOCK_SIZE]
set -u
perf=$(readlink -f "$1")
rounds=${2:-5}
secs=${3:-2}
size=${4:-1048576}
[ "$(id -u)" = 0 ] || { echo "ucx_executor_modes.sh: needs root (network namespaces)"; exit 1; }
command -v ucx_perftest >/dev/null || { echo "ucx_executor_modes.sh: ucx_perftest not found"; exit 1; }
tag=$$
ns_t="ferry_modes_t_$tag"
ns_i="ferry_modes_i_$tag"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$ns_t" 2>/dev/null
  ip netns del "$ns_i" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
ip netns add "$ns_t" && ip netns add "$ns_i" || exit 1
ip link add "fmt$tag" type veth peer name "fmi$tag" || exit 1
ip link set "fmt$tag" netns "$ns_t" && ip link set "fmi$tag" netns "$ns_i"
net="10.215.$((RANDOM % 250 + 1))"
ip -n "$ns_t" addr add "$net.1/24" dev "fmt$tag" && ip -n "$ns_i" addr add "$net.2/24" dev "fmi$tag"
for ns in "$ns_t" "$ns_i"; do ip -n "$ns" link set lo up; done
ip -n "$ns_t" link set "fmt$tag" up && ip -n "$ns_i" link set "fmi$tag" up
T="ip netns exec $ns_t"
I="ip netns exec $ns_i"
modes="busy adaptive park"

port=7430
for m in $modes; do  # a target per mode: a target runs its own --executor
  $T "$perf" target --backend ucx --listen "$net.1:$port" --executor $m >"$work/target_$m.log" 2>&1 &
  pids+=($!)
  port=$((port + 1))
done
sleep 1
for r in $(seq "$rounds"); do
  UCX_TLS=tcp $T timeout $((secs * 10 + 30)) ucx_perftest -p 7600 >/dev/null 2>&1 &
  server=$!
  sleep 0.5
  UCX_TLS=tcp $I timeout $((secs * 10 + 20)) ucx_perftest "$net.1" -p 7600 -t ucp_put_bw -s "$size" \
    -n $((secs * 1100)) -w 100 2>&1 | awk -v r="$r" '/Final:/ { printf "round %d ucx_perftest %.0f MB/s\n", r, $7 * 1.048576 }'
  wait $server 2>/dev/null
  port=7430
  for m in $modes; do
    for c in landed source-reusable; do
      rm -f "$work/f.json"
      $I "$perf" initiator --backend ucx --connect "$net.1:$port" --op write --block-size "$size" \
        --depth 4 --duration "$secs" --executor $m --put-completion $c --json "$work/f.json" >/dev/null 2>&1
      python3 - "$work/f.json" "$r" "$m" "$c" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1])); x = d["results"][0]; c = x["cpu"]
except (OSError, ValueError, KeyError, IndexError):
    print("round", sys.argv[2], sys.argv[3], sys.argv[4], "no result"); sys.exit()
t = c.get("target_us_per_op")
print("round %s %s %s %.0f MB/s, CPU us/put %.0f / %s%s" % (sys.argv[2], sys.argv[3], sys.argv[4],
      x["mb_per_s"], c["initiator_us_per_op"], "-" if t is None else "%.0f" % t,
      "" if "error" not in x else " error: " + x["error"]))
PY
    done
    port=$((port + 1))
  done
done
for m in $modes; do
  grep -q Fatal "$work/target_$m.log" && { echo "the $m target aborted:"; grep -m1 Fatal "$work/target_$m.log"; }
done
exit 0
