#!/bin/bash
# dtexec calibrate --backend cuda: on a GPU machine it writes a profile that dtsim simulate
# prices a GPU plan with (and one of a model with multi-head latent attention); elsewhere it
# says why it cannot run (exit 2) and this test is skipped (exit 77, ctest's
# SKIP_RETURN_CODE), printing the reason.
# usage: calibrate_cuda.sh DTEXEC DTSIM
set -u
dtexec=$1
dtsim=$2
out=$("$dtexec" calibrate --backend cuda --quick --out gpu_profile.json 2>&1)
rc=$?
if [ $rc -eq 2 ] && echo "$out" | grep -Eq "no GPU on this machine|built without the CUDA backend"; then
  echo "skipped: $out"
  exit 77
fi
if [ $rc -ne 0 ]; then
  echo "dtexec calibrate --backend cuda failed (exit $rc): $out"
  exit 1
fi
grep -q '"gemm"' gpu_profile.json || { echo "no gemm table in the profile"; exit 1; }
grep -q '"op": "attention"' gpu_profile.json || { echo "no op rates in the profile"; exit 1; }
grep -q '"in_run"' gpu_profile.json || { echo "no in_run factors in the profile"; exit 1; }
"$dtsim" simulate --model gpt2-124m --gpus 1 --micro-batch-size 4 --profile gpu_profile.json |
  grep -q 'compute cost from calibration profile' || { echo "dtsim did not apply the profile"; exit 1; }
# Multi-head latent attention: its core timed at the model's shapes (the packing, values of
# their own width).
mla=$(cd "$(dirname "$0")/../mpi" && pwd)/tiny_mla.json
out=$("$dtexec" calibrate --backend cuda --quick --model "$mla" --out gpu_mla_profile.json 2>&1) ||
  { echo "dtexec calibrate --backend cuda of $mla failed: $out"; exit 1; }
grep -q '"op": "attention"' gpu_mla_profile.json || { echo "no attention rate for $mla"; exit 1; }
echo "calibrated and applied: $(grep -o '"source": "[^"]*"' gpu_profile.json)"
