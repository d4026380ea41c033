#!/usr/bin/env bash
# Quick start (1): install what is missing, build, and run the main job on the shipped default.
# With arguments, runs `dtsim ARGS...` instead of the default job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
mkdir -p build
echo "building dtsim (log in build/build.log) ..."
scripts/build.sh > build/build.log 2>&1 || { tail -50 build/build.log >&2; exit 1; }
dtsim=build/sim/cli/dtsim
if [ $# -gt 0 ]; then
  exec "$dtsim" "$@"
fi
# The default job: plan the default model (Llama 3 8B) on the default cluster (4 DGX A100
# nodes) for a global batch of 256 sequences of 8,192 tokens, print the best plans, and
# simulate the best one step by step.
best="${TMPDIR:-/tmp}/dtsim-best-plan.$$.json"
trap 'rm -f "$best"' EXIT
"$dtsim" plan --model llama3-8b --cluster default --global-batch-size 256 --out "$best"
echo
"$dtsim" simulate --model llama3-8b --cluster default --plan "$best"
