#!/usr/bin/env bash
# Quick start (2): install what is missing, build with warnings as errors, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
scripts/build.sh
cd "${BUILD_DIR:-build}"
ctest -j "$(nproc)" --output-on-failure
