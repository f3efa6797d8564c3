#!/bin/sh
# Runs a quick-start command as on a fresh Debian 12 machine: in a new minimal Debian 12 (bookworm)
# root made by debootstrap, holding a copy of this checkout (its tracked and untracked, not ignored
# files), inside a private mount namespace. Packages installed on this machine by hand cannot hide
# a missing install step there.
#   scripts/fresh_debian.sh check       exits 0 if this machine can make such a root (root user,
#                                       mount namespaces, debootstrap: installed if missing)
#   scripts/fresh_debian.sh demo|test   runs scripts/quickstart.sh demo|test in a new root
# Needs root and the network (debootstrap and apt fetch from deb.debian.org).
set -eu
cd "$(dirname "$0")/.."

mode=${1:-}
mirror=http://deb.debian.org/debian

can_make_root() {
  if [ "$(id -u)" -ne 0 ]; then echo "fresh_debian: not root" >&2; return 1; fi
  if ! unshare --mount --fork true 2>/dev/null; then
    echo "fresh_debian: no mount namespaces here (unshare --mount failed)" >&2; return 1
  fi
  if ! command -v git >/dev/null 2>&1 || ! git rev-parse --git-dir >/dev/null 2>&1; then
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

root=$(mktemp -d /var/tmp/ferry-fresh-debian.XXXXXX)
# The namespace's mounts end with it, so nothing is mounted under $root by the time this runs;
# --one-file-system guards against removing anything that still were.
trap 'rm -rf --one-file-system "$root"' EXIT

echo "fresh_debian: making a minimal Debian 12 in $root"
if ! debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1; then
  tail -n 20 "$root.log" >&2
  echo "fresh_debian: debootstrap failed (log above)" >&2
  rm -f "$root.log"
  exit 1
fi
rm -f "$root.log"
# The package sources of a Debian 12 installation: the release, its updates and security.
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
EOF
cp /etc/resolv.conf "$root/etc/resolv.conf"

mkdir "$root/root/ferry"
# Files git lists but the working tree lacks (deleted, not yet committed) are skipped.
git ls-files -z --cached --others --exclude-standard |
  tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null | tar -C "$root/root/ferry" -xf -

echo "fresh_debian: scripts/quickstart.sh $mode, as root in the new Debian 12"
unshare --mount --fork --propagation private sh -eu -c '
  root=$1 mode=$2
  mount -t proc proc "$root/proc"
  mount --rbind /sys "$root/sys"
  mount --rbind /dev "$root/dev"
  exec chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb \
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    /bin/sh -c "cd /root/ferry && scripts/quickstart.sh $mode"
' fresh_debian "$root" "$mode"
