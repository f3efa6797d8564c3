#!/bin/sh
# The README's demo command as on a fresh Debian 12 machine: scripts/fresh_debian.sh demo, in a new
# minimal Debian 12 holding a copy of the checkout, so that a package installed on this machine by
# hand cannot hide a step the demo's set-up misses. Skipped (77) where this machine cannot make
# such a root (not root, no mount namespace, no network for debootstrap), and inside one.
# Usage: fresh_root_demo.sh SOURCE_ROOT
set -eu
root=$1
if [ -n "${FERRY_IN_FRESH_ROOT:-}" ]; then
  echo "skipped: already inside a fresh Debian 12 root"
  exit 77
fi
if ! "$root/scripts/fresh_debian.sh" check; then
  echo "skipped: this machine cannot make a fresh Debian 12 root (the reason is above)"
  exit 77
fi
exec "$root/scripts/fresh_debian.sh" demo
