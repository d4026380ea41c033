#!/usr/bin/env bash
# Packs what scripts/gpu_check.sh needs on a GPU machine that has CUDA but none of dtsim's
# Debian packages (the device machines of this workplace): dtexec, dtsim and the CUDA unit
# tests built here with the CUDA backend, stripped; OpenMPI's launcher (mpirun, orted, their
# components and help texts, and PMIx's components), which the check runs relocated
# (OPAL_PREFIX) for its multi-rank NCCL runs; and the shared libraries all of them load that
# are not CUDA's or the C/C++ runtime's, into gpu-bundle.tar.xz (git-ignored).
#   scripts/gpu_bundle.sh [BUILD_DIR]      then carry gpu-bundle.tar.xz to the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
grep -q "dtsim: CUDA/NCCL backend: ON" "$build/configure.log" ||
  { echo "gpu_bundle: $build was configured without the CUDA backend" >&2; exit 1; }
cmake --build "$build" --target dtexec dtsim dtexec_cuda_tests
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
stage=$tmp/gpu-bundle
mkdir -p "$stage/bin" "$stage/lib"
for b in exec/cli/dtexec sim/cli/dtsim tests/exec/dtexec_cuda_tests; do
  strip -o "$stage/bin/$(basename "$b")" "$build/$b"
done
# OpenMPI, laid out under mpi/ as under its prefix, so that OPAL_PREFIX=mpi finds it all.
path_of() { ompi_info --parsable --path "$1" | cut -d: -f3; }
prefix=$(path_of prefix)
pkglib=$(path_of pkglibdir)
pkgdata=$(path_of pkgdatadir)
bindir=$(path_of bindir)
mpi=$stage/mpi
mkdir -p "$mpi/bin" "$mpi/${pkglib#"$prefix"/}" "$mpi/${pkgdata#"$prefix"/}"
cp -L "$bindir/orterun" "$bindir/orted" "$mpi/bin/"
ln -s orterun "$mpi/bin/mpirun"
cp -a "$pkglib/." "$mpi/${pkglib#"$prefix"/}/"
cp -a "$pkgdata/." "$mpi/${pkgdata#"$prefix"/}/"
# PMIx's components, beside its library (gpu_check points PMIX_MCA_mca_base_component_path here).
pmix_lib=$(dirname "$(readlink -f "$(ldd "$bindir/orterun" "$pkglib"/mca_pmix_*.so |
  awk '$1 == "libpmix.so.2" {print $3; exit}')")")
mkdir -p "$mpi/pmix/lib"
cp -a "$pmix_lib/pmix" "$mpi/pmix/lib/"
# Libraries: everything ldd finds except CUDA's (the GPU machine has its own, matching its
# driver) and the C/C++ runtime (newer there). A library ldd cannot find here stops the bundle.
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libnccl)'
objects=("$stage"/bin/* "$mpi"/bin/orterun "$mpi"/bin/orted "$mpi/${pkglib#"$prefix"/}"/*.so
  "$mpi"/pmix/lib/pmix/*.so)
missing=$(for b in "${objects[@]}"; do ldd "$b"; done | awk '/not found/ && $1 !~ /^libcuda/ {print $1}' |
  sort -u | tr '\n' ' ')
[ -z "$missing" ] || { echo "gpu_bundle: not found here: $missing" >&2; exit 1; }
for b in "${objects[@]}"; do
  ldd "$b" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  [[ $name =~ $skip ]] && continue
  cp -L "$path" "$stage/lib/$name"
done
tar -C "$tmp" -cJf gpu-bundle.tar.xz gpu-bundle
echo "gpu-bundle.tar.xz: $(du -h gpu-bundle.tar.xz | cut -f1), $(ls "$stage/lib" | wc -l) libraries"
