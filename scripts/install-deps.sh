#!/usr/bin/env bash
# Installs the Debian 12 packages dtsim needs, only those missing (quick when all are there).
# Run as root (or with sudo). CUDA/NCCL are not installed here: the GPU backend is built when
# the CUDA toolkit is found through CUDA_HOME or /usr/local/cuda.
set -euo pipefail

packages=(
  g++ make cmake ninja-build ccache pkg-config git
  libboost-graph-dev libboost-program-options-dev libsimgrid-dev libfmt-dev nlohmann-json3-dev
  catch2 libopenmpi-dev openmpi-bin libopenblas-dev
  # notebooks (executed headless by the tests)
  python3-matplotlib python3-pandas python3-nbformat python3-nbconvert python3-nbclient
  python3-ipykernel jupyter-nbconvert jupyter-core
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: run as root to install: ${missing[*]}" >&2; exit 1; }
  SUDO="sudo"
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}"
