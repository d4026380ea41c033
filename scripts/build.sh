#!/usr/bin/env bash
# Configures (once) and builds dtsim into build/ with Ninja. Incremental when already built.
#   DTSIM_WERROR=OFF to build with warnings not treated as errors (default ON, as CI)
#   BUILD_DIR=...    another build folder
set -euo pipefail
cd "$(dirname "$0")/.."
build_dir="${BUILD_DIR:-build}"
jobs="${JOBS:-$(nproc)}"
mkdir -p "$build_dir"
cmake -S . -B "$build_dir" -G Ninja -DDTSIM_WERROR="${DTSIM_WERROR:-ON}" > "$build_dir/configure.log" 2>&1 \
  || { cat "$build_dir/configure.log" >&2; exit 1; }
grep -E "dtsim: CUDA" "$build_dir/configure.log" || true
cmake --build "$build_dir" -j "$jobs"
