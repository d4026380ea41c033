#!/bin/bash
# Shared by the executor benchmarks (sourced as `source bench/setup.sh "$@"` after set -euo
# pipefail): the build directory ($1, default build) and its binaries ($dtexec, $dtsim), a work
# directory ($2, default a fresh temporary one) made the current one, MODEL ($model, default
# cpu-small; a file named relative to the caller's directory stays found) and whether it is a
# mixture of experts ($moe: 1 or empty), mpirun allowed as root and oversubscribed, and
# value KEY (the first number of "KEY": in a JSON text on standard input).
# shellcheck disable=SC2034  # (the variables are the sourcing script's)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:-$root/build}" && pwd)
work=${2:-$(mktemp -d)}
mkdir -p "$work"
if [ -f "${MODEL:-}" ]; then MODEL=$(cd "$(dirname "$MODEL")" && pwd)/$(basename "$MODEL"); fi
cd "$work" || exit 1
dtexec=$build/exec/cli/dtexec
dtsim=$build/sim/cli/dtsim
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
model=${MODEL:-cpu-small}
model_file=$model
[ -f "$model_file" ] || model_file=$root/models/$model.json
moe=""
if grep -q '"moe"' "$model_file" 2>/dev/null; then moe=1; fi
value() { sed -n "s/.*\"$1\": \([0-9.eE+-]*\).*/\1/p" | head -1; }
# The same field's last occurrence: dtsim memory --json's worst-stage total_bytes, after its
# per_stage list's.
last_value() { sed -n "s/.*\"$1\": \([0-9.eE+-]*\).*/\1/p" | tail -1; }
