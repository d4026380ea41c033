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
# The default job: the default model (Llama 3 8B) on the default cluster (4 DGX A100 nodes).
# Until the planner exists (issue 4) it describes the model, then checks the memory of one
# Megatron-style plan and simulates a training step of it.
plan=(--model llama3-8b --cluster default --tp 2 --zero-stage 1 --recompute selective
      --sequence-parallel --global-batch-size 256)
"$dtsim" describe --model llama3-8b
echo
"$dtsim" memory "${plan[@]}"
echo
"$dtsim" simulate "${plan[@]}"
