#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine that has CUDA but none of dtsim's
# Debian packages (the device machines of this workplace): dtexec, dtsim and the CUDA unit
# tests built here with the CUDA backend, stripped, and the shared libraries they load that
# are not CUDA's or the C/C++ runtime's, into gpu-bundle.tar.xz (git-ignored).
#   scripts/gpu_bundle.sh [BUILD_DIR]      then carry gpu-bundle.tar.xz to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
grep -q "dtsim: CUDA/NCCL backend: ON" "$build/configure.log" ||
  { echo "gpu_bundle: $build was configured without the CUDA backend" >&2; exit 1; }
cmake --build "$build" --target dtexec dtsim dtexec_cuda_tests
stage=$(mktemp -d)/gpu-bundle
mkdir -p "$stage/bin" "$stage/lib"
for b in exec/cli/dtexec sim/cli/dtsim tests/exec/dtexec_cuda_tests; do
  strip -o "$stage/bin/$(basename "$b")" "$build/$b"
done
# Libraries: everything ldd finds except CUDA's (the GPU machine has its own, matching its
# driver) and the C/C++ runtime (newer there).
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libnccl)'
for b in "$stage"/bin/*; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] && continue
  cp -L "$path" "$stage/lib/$name"
done
tar -C "$(dirname "$stage")" -cJf gpu-bundle.tar.xz gpu-bundle
echo "gpu-bundle.tar.xz: $(du -h gpu-bundle.tar.xz | cut -f1), $(ls "$stage/lib" | wc -l) libraries"
