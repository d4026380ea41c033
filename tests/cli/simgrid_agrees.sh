#!/bin/sh
# The step of `dtsim simulate ARGS` on the SimGrid backend against the analytical backend's,
# as `dtsim validate` joins their traces: within TOLERANCE percent, for each ARGS (one string
# each, split on spaces). Traces go to a folder of its own, so that tests can run side by side.
# usage: simgrid_agrees.sh DTSIM TOLERANCE ARGS...
set -u
dtsim=$1
tolerance=$2
shift 2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
for args in "$@"; do
  # shellcheck disable=SC2086 # ARGS is a command line, split on purpose
  "$dtsim" simulate $args --trace "$dir/analytical.json" >/dev/null || exit 1
  # shellcheck disable=SC2086
  "$dtsim" simulate $args --network simgrid --trace "$dir/simgrid.json" >/dev/null || exit 1
  # dtsim validate's step row: step TASKS PREDICTED MEASURED ERROR%
  "$dtsim" validate --predicted "$dir/simgrid.json" --measured "$dir/analytical.json" \
    >"$dir/validate.txt" || { cat "$dir/validate.txt"; exit 1; }
  error=$(awk '$1 == "step" { sub(/%/, "", $5); print $5 }' "$dir/validate.txt")
  # (A number only: validate prints '-' where it has no error to give, which awk reads as 0.)
  if ! awk -v e="$error" -v t="$tolerance" \
    'BEGIN { exit !(e ~ /^[+-]?[0-9.]+$/ && e + 0 < t && e + 0 > -t) }'; then
    echo "simulate $args: SimGrid's step ${error:-?}% off the analytical one (over ${tolerance}%)"
    exit 1
  fi
  echo "simulate $args: ${error}%"
done
