#!/bin/sh
# Runs a quick-start command as on a fresh Debian 12 machine: in a new minimal Debian 12 (bookworm)
# root made by debootstrap, holding a copy of this checkout (its tracked and untracked, not ignored
# files), all inside a private mount namespace. Packages installed on this machine by hand cannot
# hide a missing install step there.
#   scripts/fresh_debian.sh check       exits 0 if this machine can make such a root (root user,
#                                       mounts in a mount namespace, debootstrap: installed if
#                                       missing)
#   scripts/fresh_debian.sh demo|test   runs scripts/quickstart.sh demo|test in a new root
# Needs root and the network (debootstrap and apt fetch from deb.debian.org).
set -eu
cd "$(dirname "$0")/.."

mode=${1:-}
mirror=http://deb.debian.org/debian
# The checkout may belong to another user than root (a CI runner's): git must still read it.
git_here() { git -c safe.directory="$PWD" "$@"; }

can_make_root() {
  if [ "$(id -u)" -ne 0 ]; then echo "fresh_debian: not root" >&2; return 1; fi
  probe=$(mktemp -d)
  if ! unshare --mount --fork --propagation private \
       sh -c 'mount -t tmpfs fresh_debian_probe "$1"' probe "$probe" 2>/dev/null; then
    rmdir "$probe"
    echo "fresh_debian: cannot mount inside a mount namespace here (unshare --mount)" >&2
    return 1
  fi
  rmdir "$probe"
  if ! command -v git >/dev/null 2>&1 || ! git_here rev-parse --git-dir >/dev/null; then
    echo "fresh_debian: needs git and a git checkout, to copy the checkout's files" >&2; return 1
  fi
  if ! command -v debootstrap >/dev/null 2>&1; then
    echo "fresh_debian: installing debootstrap on this machine"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; } ||
      { echo "fresh_debian: could not install debootstrap" >&2; return 1; }
  fi
}

case "$mode" in
  check) can_make_root; exit ;;
  demo | test) can_make_root ;;
  *) echo "usage: $0 check|demo|test" >&2; exit 2 ;;
esac

work=$(mktemp -d /var/tmp/ferry-fresh-debian.XXXXXX)
# Every mount (debootstrap's own included) lives in the namespace below, never in this one, so none
# is under $work here; --one-file-system guards against removing one that were.
trap 'rm -rf --one-file-system "$work"' EXIT
root=$work/root
mkdir "$root"

# The checkout's files, listed and packed first, so that a failure stops here (sh has no pipefail).
git_here ls-files -z --cached --others --exclude-standard >"$work/files"
tar --null --files-from="$work/files" --ignore-failed-read -cf "$work/checkout.tar"

echo "fresh_debian: making a minimal Debian 12 in $root, then scripts/quickstart.sh $mode in it"
# In a session of its own, so that a signal here (Ctrl-C, a CI timeout) can stop all of it before
# the files go.
setsid unshare --mount --fork --propagation private sh -eu -c '
  work=$1 mode=$2 mirror=$3
  root=$work/root
  if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -n 20 "$work/debootstrap.log" >&2
    echo "fresh_debian: debootstrap failed (log above)" >&2
    exit 1
  fi
  # The package sources of a Debian 12 installation: the release, its updates and security.
  printf "deb %s bookworm main\ndeb %s bookworm-updates main\n" "$mirror" "$mirror" \
    >"$root/etc/apt/sources.list"
  echo "deb http://deb.debian.org/debian-security bookworm-security main" \
    >>"$root/etc/apt/sources.list"
  # As in any chroot: packages never start services.
  printf "#!/bin/sh\nexit 101\n" >"$root/usr/sbin/policy-rc.d"
  chmod 755 "$root/usr/sbin/policy-rc.d"
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  mkdir "$root/root/ferry"
  tar -C "$root/root/ferry" -xf "$work/checkout.tar"
  test -x "$root/root/ferry/scripts/quickstart.sh"
  # debootstrap may leave its own proc and sys mounted (in this namespace only).
  mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
  mountpoint -q "$root/sys" || mount --rbind /sys "$root/sys"
  mountpoint -q "$root/dev" || mount --rbind /dev "$root/dev"
  echo "fresh_debian: scripts/quickstart.sh $mode, as root in the new Debian 12"
  exec chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb FERRY_IN_FRESH_ROOT=1 \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh -c "cd /root/ferry && scripts/quickstart.sh $mode"
' fresh_debian "$work" "$mode" "$mirror" &
child=$!
# The run's mount namespace, once unshare has made it: a process that left the run's session (dpkg
# makes one of its own) is still in it.
here=$(readlink /proc/self/ns/mnt)
ns=$here
for _ in 1 2 3 4 5 6 7 8 9 10; do
  # Gone already: then there is nothing to look for (and $here matches nothing below).
  ns=$(readlink "/proc/$child/ns/mnt" 2>/dev/null) || { ns=$here; break; }
  [ "$ns" != "$here" ] && break
  sleep 0.1
done
in_namespace() {
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/ns/mnt" 2>/dev/null)" = "$ns" ] && echo "${p#/proc/}"
  done
}
stop() {
  kill -TERM "-$child" 2>/dev/null || true  # dash's kill takes no --
  if [ "$ns" != "$here" ]; then
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      left=$(in_namespace)
      [ -z "$left" ] && break
      # shellcheck disable=SC2086
      kill -TERM $left 2>/dev/null || true
      sleep 1
    done
    # shellcheck disable=SC2086
    [ -z "$left" ] || kill -KILL $left 2>/dev/null || true
  fi
  wait "$child" 2>/dev/null || true
  exit "$1"
}
trap 'stop 130' INT
trap 'stop 143' TERM
trap 'stop 129' HUP
status=0
wait "$child" || status=$?
exit "$status"
