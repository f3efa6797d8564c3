#!/bin/sh
# The README's quick-start commands are the ones CI and the scripts run: its second command block
# under "## Quick start" must be the one command .ci/run executes, the suite must run the demo mode
# through scripts/fresh_debian.sh where it can (tests/fresh_root_demo.sh), that script must run
# scripts/quickstart.sh with the mode it is given, and both blocks must name a mode
# scripts/quickstart.sh accepts.
# Usage: check_quickstart.sh SOURCE_ROOT
set -eu
root=$1
block() {
  awk -v want="$1" '
    /^## Quick start/ { in_section = 1; next }
    in_section && /^## / { exit }
    in_section && /^```sh$/ { n++; in_block = 1; next }
    in_section && /^```$/ { in_block = 0; next }
    in_section && in_block && n == want { print }
  ' "$root/README.md"
}
demo=$(block 1)
test_command=$(block 2)
# .ci/run's commands: every line that is not a comment, blank, `set` or the `cd` to the checkout's
# root. There must be exactly one, the README's test command.
ci_commands=$(awk '
  /^#/ || /^[[:space:]]*$/ || /^set / || /^cd / { next }
  { print }
' "$root/.ci/run")
status=0
if [ "$demo" != "./scripts/quickstart.sh demo" ]; then
  echo "README quick start, first command: '$demo', expected './scripts/quickstart.sh demo'" >&2
  status=1
fi
if [ "$test_command" != "./scripts/quickstart.sh test" ]; then
  echo "README quick start, second command: '$test_command', expected './scripts/quickstart.sh test'" >&2
  status=1
fi
if [ "$ci_commands" != "$test_command" ]; then
  echo ".ci/run must run exactly the README's test command '$test_command'; it runs:" >&2
  echo "$ci_commands" >&2
  status=1
fi
# The suite runs the demo command through fresh_debian.sh where it can.
# shellcheck disable=SC2016
if ! grep -Fqx 'exec "$root/scripts/fresh_debian.sh" demo' "$root/tests/fresh_root_demo.sh"; then
  echo "tests/fresh_root_demo.sh does not run the demo mode through scripts/fresh_debian.sh" >&2
  status=1
fi
# shellcheck disable=SC2016
if ! grep -Fqx '    /bin/sh -c "cd /root/ferry && scripts/quickstart.sh $mode"' \
     "$root/scripts/fresh_debian.sh"; then
  echo "scripts/fresh_debian.sh does not run 'scripts/quickstart.sh \$mode' in the new root" >&2
  status=1
fi
[ "$status" -eq 0 ] && echo "README quick start and .ci/run agree: $test_command"
exit "$status"
