#!/bin/bash
# ferry's UCX backend, a raw UCP loop and ucx_perftest (Debian: ucx-utils) on the same transports
# and sizes, from one script: first ferry_ucx_bench (ferry against the raw loop in one process),
# then ucx_perftest's put bandwidth (ucp_put_bw, a server and a client process on 127.0.0.1) and its
# 8 B put latency (ucp_put_lat) over tcp and over shared memory.
#
#   bench/ucx_compare.sh BUILD_DIR [--quick]
set -eu
build=${1:?usage: bench/ucx_compare.sh BUILD_DIR [--quick]}
quick=${2:-}
bench="$build/bench/ferry_ucx_bench"
[ -x "$bench" ] || { echo "no $bench: build ferry with the UCX backend (Debian: libucx-dev)"; exit 1; }
command -v ucx_perftest >/dev/null || { echo "no ucx_perftest (Debian: ucx-utils)"; exit 1; }
iters=2000
[ "$quick" = --quick ] && iters=300

echo "## ferry_ucx_bench $quick"
"$bench" $quick tcp shm

# One ucx_perftest run: TRANSPORTS TEST SIZE; prints the client's final line's figures.
port=$((20000 + RANDOM % 20000))
perftest() {
  local tls=$1 test=$2 size=$3 n=$iters
  [ "$size" -ge $((4 << 20)) ] && n=$((iters / 10 + 10))
  port=$((port + 1))
  # The server needs tcp for the sockaddr bootstrap that the client connects through.
  UCX_TLS="$tls" timeout 120 ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 0.5
  UCX_TLS="$tls" timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t "$test" -s "$size" -n "$n" -f 2>/dev/null |
    awk 'NF == 8 && $1 ~ /^[0-9]+$/ { last = $0 } END { print last }'
  wait "$server" 2>/dev/null || true
}

echo
echo "## ucx_perftest (ucx-utils), $iters iterations (a tenth at 4 MiB and above)"
for tls in tcp shm; do
  echo
  echo "### $tls"
  echo
  echo "| test | block | MB/s (overall) | latency µs (average) |"
  echo "|---|---|---|---|"
  for size in 4096 65536 1048576 16777216; do
    line=$(perftest "$tls" ucp_put_bw "$size")
    # columns: iterations p50 avg overall bw_avg bw_overall rate_avg rate_overall
    echo "| ucp_put_bw | $size | $(echo "$line" | awk '{print $6}') | |"
  done
  line=$(perftest "$tls" ucp_put_lat 8)
  echo "| ucp_put_lat | 8 | | $(echo "$line" | awk '{print $3}') |"
done
