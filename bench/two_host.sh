#!/bin/bash
# ferry-perf against the usual tools, on one veth pair between two network namespaces this script
# makes (root; removed on every exit): io_uring TCP write bandwidth against iperf3, UCX put against
# ucx_perftest (UCX_TLS=tcp), at 64 KiB and 1 MiB; and ferry-perf file against fio at queue depth 32
# (O_DIRECT random reads). ferry-perf's tcp runs go with its metrics on and off, interleaved, to show
# what recording costs; its ucx puts both landed (the default) and ending once the source may be
# reused (what ucx_perftest counts); its file reads with the adaptive executor (the default) and the
# parking one. CPU time per operation beside every figure, each side's whole process.
# Each figure is the median of RUNS runs (default 3) of SECONDS (default 3).
# Prints markdown tables for bench/RESULTS.md.
#
#   bench/two_host.sh FERRY_PERF [RUNS] [SECONDS] [FILE_DIR]
# Needs: iproute2, iperf3, ucx-utils (ucx_perftest), fio (scripts/quickstart.sh installs them).
set -u
perf=$(readlink -f "$1")
runs=${2:-3}
secs=${3:-3}
file_dir=${4:-/var/tmp}
py=/usr/bin/python3
[ "$(id -u)" = 0 ] || { echo "two_host.sh: needs root (network namespaces)"; exit 1; }
for t in ip iperf3 ucx_perftest fio; do
  command -v $t >/dev/null || { echo "two_host.sh: $t not found"; exit 1; }
done

tag="$$"
ns_t="ferry_bench_t_$tag"
ns_i="ferry_bench_i_$tag"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  wait 2>/dev/null
  ip netns del "$ns_t" 2>/dev/null
  ip netns del "$ns_i" 2>/dev/null
  rm -rf "$work" "$file_dir/ferry_two_host_$tag.dat"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
ip netns add "$ns_t" && ip netns add "$ns_i" || exit 1
ip link add "fbt$tag" type veth peer name "fbi$tag" || exit 1
ip link set "fbt$tag" netns "$ns_t" && ip link set "fbi$tag" netns "$ns_i"
net="10.214.$((RANDOM % 250 + 1))"
ip -n "$ns_t" addr add "$net.1/24" dev "fbt$tag" && ip -n "$ns_i" addr add "$net.2/24" dev "fbi$tag"
for ns in "$ns_t" "$ns_i"; do ip -n "$ns" link set lo up; done
ip -n "$ns_t" link set "fbt$tag" up && ip -n "$ns_i" link set "fbi$tag" up
T="ip netns exec $ns_t"
I="ip netns exec $ns_i"
res="$work/results.txt"  # lines: TEST SIZE VALUE_MBPS CPU_US_PER_OP_INITIATOR CPU_US_PER_OP_TARGET

# Runs a command and writes the CPU seconds it used (user + system, its children included) to FILE.
cpu_run() {
  local out=$1
  shift
  "$py" -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
r = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write("%f\n" % (r.ru_utime + r.ru_stime))
sys.exit(rc)' "$out" "$@"
}

# Runs a ferry-perf command (its --json added) and appends its figures to the results as row NAME.
perf_row() {
  local name=$1
  shift
  rm -f "$work/f.json"
  "$@" --json "$work/f.json" >/dev/null 2>&1
  [ -s "$work/f.json" ] || { echo "two_host.sh: $name: ferry-perf wrote no JSON" >&2; return; }
  "$py" - "$work/f.json" "$name" >>"$res" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); r = d["results"][0]; c = r["cpu"]
t = c.get("target_us_per_op")
print(sys.argv[2], r["block_size"], r["mb_per_s"], c["initiator_us_per_op"], -1 if t is None else t)
PY
}

for backend in tcp ucx; do
  port=7410
  [ $backend = ucx ] && port=7420
  $T "$perf" target --backend $backend --listen "$net.1:$port" >"$work/target_$backend.log" 2>&1 &
  pids+=($!)
done
sleep 1

for size in 65536 1048576; do
  for r in $(seq "$runs"); do
    # iperf3: one stream, writes of SIZE bytes.
    $T iperf3 -s -1 -p 7500 >/dev/null 2>&1 &
    sleep 0.3
    $I iperf3 -c "$net.1" -p 7500 -t "$secs" -l "$size" -J >"$work/iperf.json" 2>/dev/null
    wait $! 2>/dev/null
    "$py" - "$work/iperf.json" "$size" >>"$res" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); size = int(sys.argv[2])
e = d["end"]; b = e["sum_received"]["bytes"]; s = e["sum_received"]["seconds"]
cpu = e["cpu_utilization_percent"]; ops = e["sum_sent"]["bytes"] / size
cpu_s = (cpu["host_total"] + cpu["remote_total"]) / 100 * s
print("iperf3", size, b / s / 1e6, cpu["host_total"] / 100 * s / ops * 1e6, cpu["remote_total"] / 100 * s / ops * 1e6)
PY
    for m in on off; do
      flag=""
      [ $m = off ] && flag="--no-metrics"
      perf_row "ferry-perf_tcp_metrics_$m" $I "$perf" initiator --backend tcp --connect "$net.1:7410" \
        --op write --block-size "$size" --depth 4 --duration "$secs" $flag
    done
    # ucx_perftest: put bandwidth over tcp, with its own default window of outstanding puts (no -O).
    # The server is bounded like the client, so a client that never reached it cannot hang the script.
    iters=$(( 2 * 1024 * 1024 * 1024 / size ))
    UCX_TLS=tcp cpu_run "$work/ucx_server.cpu" timeout $((secs * 10 + 30)) $T ucx_perftest -p 7600 \
      >/dev/null 2>&1 &
    server=$!
    sleep 0.5
    UCX_TLS=tcp cpu_run "$work/ucx_client.cpu" timeout $((secs * 10 + 20)) $I ucx_perftest "$net.1" -p 7600 \
      -t ucp_put_bw -s "$size" -n "$iters" -w 100 >"$work/ucx.txt" 2>&1
    wait $server 2>/dev/null
    # "Final:" iterations, 3 latencies, bandwidth average and overall (MiB/s), 2 message rates. CPU
    # per operation: each side's whole process over the iterations (the 100 warm-up ones included).
    awk -v s="$size" -v n="$((iters + 100))" -v c="$(cat "$work/ucx_client.cpu" 2>/dev/null || echo 0)" \
      -v t="$(cat "$work/ucx_server.cpu" 2>/dev/null || echo 0)" \
      '/Final:/ { printf "ucx_perftest %d %f %f %f\n", s, $7 * 1.048576, c / n * 1e6, t / n * 1e6 }' \
      "$work/ucx.txt" >>"$res"
    # ferry's puts as a KV transfer needs them (landed: put and flush), and as ucx_perftest counts its
    # own (ended once the source may be reused).
    for completion in landed source-reusable; do
      perf_row "ferry-perf_ucx_put_$completion" $I "$perf" initiator --backend ucx --connect "$net.1:7420" \
        --op write --block-size "$size" --depth 4 --duration "$secs" --put-completion $completion
    done
    # Files: O_DIRECT random reads at queue depth 32.
    f="$file_dir/ferry_two_host_$tag.dat"
    fio --name=qd32 --filename="$f" --size=256M --rw=randread --bs="$size" --direct=1 \
      --ioengine=io_uring --iodepth=32 --runtime="$secs" --time_based --output-format=json \
      >"$work/fio.json" 2>/dev/null
    "$py" - "$work/fio.json" "$size" >>"$res" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); j = d["jobs"][0]; size = int(sys.argv[2])
ops = j["read"]["total_ios"]; s = j["job_runtime"] / 1000
cpu_s = (j["usr_cpu"] + j["sys_cpu"]) / 100 * s
print("fio", size, j["read"]["bw_bytes"] / 1e6, cpu_s / ops * 1e6 if ops else 0, -1)
PY
    # The default executor (adaptive: it spins a while before it sleeps) and one that sleeps at once.
    for executor in adaptive park; do
      perf_row "ferry-perf_file_$executor" "$perf" file --path "$f" --direct --op read --block-size "$size" \
        --batch 1 --depth 32 --file-size 256M --duration "$secs" --executor $executor
    done
  done
done

"$py" - "$res" "$runs" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) < 4:
        continue
    rows.setdefault((p[0], int(p[1])), []).append([float(x) for x in p[2:]])
def med(test, size, i):
    v = [r[i] for r in rows.get((test, size), []) if len(r) > i]
    return statistics.median(v) if v else float("nan")
def runs(test, size):
    return len(rows.get((test, size), []))
def cpu(test, size):
    i, t = med(test, size, 1), med(test, size, 2)
    if not i == i or i <= 0:
        return "-"
    return "%.1f / %s" % (i, "%.1f" % t if t == t and t >= 0 else "-")
print("| comparison | size | baseline MB/s | ferry-perf MB/s | ratio | ferry CPU us/op (initiator / target) | baseline CPU us/op (initiator / target) | runs |")
print("|---|---|---|---|---|---|---|---|")
for base, ours, what in (("iperf3", "ferry-perf_tcp_metrics_on", "tcp write vs iperf3"),
                         ("ucx_perftest", "ferry-perf_ucx_put_landed", "ucx put, landed, vs ucx_perftest ucp_put_bw"),
                         ("ucx_perftest", "ferry-perf_ucx_put_source-reusable",
                          "ucx put, source reusable, vs ucx_perftest ucp_put_bw"),
                         ("fio", "ferry-perf_file_adaptive", "file randread QD32 O_DIRECT, adaptive executor, vs fio io_uring"),
                         ("fio", "ferry-perf_file_park", "file randread QD32 O_DIRECT, park executor, vs fio io_uring")):
    for size in (65536, 1048576):
        b, o = med(base, size, 0), med(ours, size, 0)
        print("| %s | %d KiB | %.0f | %.0f | %.2f | %s | %s | %d+%d |" % (
            what, size // 1024, b, o, o / b if b else float("nan"), cpu(ours, size), cpu(base, size),
            runs(base, size), runs(ours, size)))
print()
print("| ferry-perf tcp write | size | metrics on MB/s | metrics off MB/s | on/off | CPU us/op on | CPU us/op off |")
print("|---|---|---|---|---|---|---|")
for size in (65536, 1048576):
    a, b = med("ferry-perf_tcp_metrics_on", size, 0), med("ferry-perf_tcp_metrics_off", size, 0)
    print("| | %d KiB | %.0f | %.0f | %.3f | %.1f | %.1f |" % (size // 1024, a, b, a / b if b else float("nan"),
          med("ferry-perf_tcp_metrics_on", size, 1), med("ferry-perf_tcp_metrics_off", size, 1)))
PY
