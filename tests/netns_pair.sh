# Sourced by tests that need two network namespaces joined by a veth pair, made here and removed on
# every exit path. After `netns_pair PREFIX`: $ns_a and $ns_b (namespace names), $dev_a and $dev_b
# (their veth ends), $ip_a and $ip_b (addresses on one /24), $work (a scratch directory). A test
# that cannot make them is skipped (exit 77) with the reason. Extra clean-up: netns_on_exit "cmd".

netns_skip() { echo "skipped: $*"; exit 77; }

netns_cleanup_extra=""
netns_on_exit() { netns_cleanup_extra="$netns_cleanup_extra; $1"; }

netns_cleanup() {
  eval "true $netns_cleanup_extra" 2>/dev/null
  wait 2>/dev/null
  [ -n "${ns_a:-}" ] && ip netns del "$ns_a" 2>/dev/null
  [ -n "${ns_b:-}" ] && ip netns del "$ns_b" 2>/dev/null
  [ -n "${work:-}" ] && rm -rf "$work"
}

netns_pair() {
  local prefix=$1 tag err
  [ "$(id -u)" = 0 ] || netns_skip "making network namespaces needs root"
  command -v ip >/dev/null || netns_skip "no ip command (Debian: iproute2)"
  tag="$$$((RANDOM % 1000))"
  work=$(mktemp -d)
  trap netns_cleanup EXIT
  trap 'exit 1' INT TERM
  err="$work/netns.err"
  ns_a="${prefix}_a_$tag"
  ip netns add "$ns_a" 2>"$err" || { ns_a=""; netns_skip "ip netns add failed: $(cat "$err")"; }
  ns_b="${prefix}_b_$tag"
  ip netns add "$ns_b" 2>"$err" || { ns_b=""; netns_skip "ip netns add failed: $(cat "$err")"; }
  dev_a="fa$tag"
  dev_b="fb$tag"
  ip link add "$dev_a" netns "$ns_a" type veth peer name "$dev_b" netns "$ns_b" 2>"$err" ||
    netns_skip "no veth pair: $(cat "$err")"
  local net="10.$((RANDOM % 200 + 20)).$((RANDOM % 250 + 1))"
  ip_a="$net.1"
  ip_b="$net.2"
  ip -n "$ns_a" addr add "$ip_a/24" dev "$dev_a"
  ip -n "$ns_b" addr add "$ip_b/24" dev "$dev_b"
  local ns
  for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
  ip -n "$ns_a" link set "$dev_a" up
  ip -n "$ns_b" link set "$dev_b" up
  # Until both ends have carrier: a program started before (UCX's device list, say) misses them.
  local _
  for _ in $(seq 50); do
    ip -n "$ns_a" link show "$dev_a" | grep -q 'state UP' &&
      ip -n "$ns_b" link show "$dev_b" | grep -q 'state UP' && return 0
    sleep 0.1
  done
  netns_skip "the veth pair did not come up"
}
