#!/usr/bin/env bash
# The GPU checks of issue 5, in one run on a GPU machine (one H200 in this workplace's device
# machines, which have CUDA but none of dtsim's Debian packages):
#   1. dtexec devices --selftest and the CUDA unit tests (among them every GPU kernel of the
#      executor against its CPU reference, in fp32 and bf16);
#   2. dtexec calibrate --backend cuda: cuBLAS GEMMs (squares and Llama-3 8B's shapes), copy
#      bandwidth, launch overhead, jitter, and the non-GEMM ops with the executor's GPU kernels;
#   3. the catalog's figures against the measurement: the best GEMM rate against
#      peak x efficiency.gemm, the copy bandwidth against memory_bw x efficiency.memory_bw;
#   4. dtsim simulate of single-GPU plans with the catalog and with the measured profile.
# Writes report.txt, the profile and the raw outputs under $OUT (or ./gpu-report).
# Not covered yet: measured GPU steps (dtexec run does not drive the GPU kernels yet), so no
# per-task comparison; the report says so.
#
# Here:  scripts/gpu_bundle.sh                 (gpu-bundle.tar.xz: binaries + libraries)
# There: scripts/gpu_check.sh [gpu-bundle.tar.xz]   (run with carry: ["gpu-bundle.tar.xz"])
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out=${OUT:-$repo/gpu-report}
mkdir -p "$out"
report=$out/report.txt
: >"$report"
say() { echo "$*" | tee -a "$report"; }

bundle=${1:-gpu-bundle.tar.xz}
tar -C /tmp -xJf "$bundle" || { say "cannot unpack $bundle"; exit 1; }
bin=/tmp/gpu-bundle/bin
# CUDA's libraries from the machine: the toolkit's, and NCCL's (the toolkit or pip's nvidia-nccl).
cuda_libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && cuda_libs="$cuda_libs:$d"
done
# Any of CUDA's libraries that the loader does not know: from wherever the machine has them
# (the toolkit, or the nvidia-* wheels of its Python environment).
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  ldconfig -p 2>/dev/null | grep -q "$lib" && continue
  found=$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -1)
  [ -n "$found" ] && cuda_libs="$cuda_libs:$(dirname "$found")"
done
export LD_LIBRARY_PATH="/tmp/gpu-bundle/lib$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DTSIM_DATA_DIR=$repo
say "dtsim GPU check, $(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"

say ""
say "== 1. devices and CUDA unit tests"
"$bin/dtexec" devices --selftest 2>&1 | tee -a "$report"
"$bin/dtexec_cuda_tests" 2>&1 | tail -3 | tee -a "$report"

say ""
say "== 2. calibrate (cuBLAS bf16, Llama-3 8B shapes at micro-batch 1, sequence 4096)"
"$bin/dtexec" calibrate --backend cuda --model llama3-8b --micro-batch-size 1 --seq-len 4096 \
  --repeats 10 --out "$out/profile_h200.json" >"$out/calibrate.txt" 2>&1
rc=$?
tee -a "$report" <"$out/calibrate.txt"
[ $rc -eq 0 ] || { say "calibrate failed (exit $rc)"; exit 1; }

say ""
say "== 3. catalog against measurement"
python3 - "$out/profile_h200.json" "$repo/topologies/devices/h200.json" <<'PY' | tee -a "$report"
import json, sys
p = json.load(open(sys.argv[1]))
d = json.load(open(sys.argv[2]))
peak = d["peak_flops"]["bf16"]["value"]
eff = d["efficiency"]["gemm"]["value"]
best = max(2 * g["m"] * g["n"] * g["k"] / g["seconds"] for g in p["gemm"])
print(f"GEMM: best measured {best/1e12:.0f} TFLOP/s; catalog peak x gemm efficiency "
      f"{peak*eff/1e12:.0f} TFLOP/s ({eff:.3f}); measured/peak {best/peak:.3f}")
bw = d["memory_bw_bytes_per_s"]["value"] * d["efficiency"]["memory_bw"]["value"]
print(f"copy: measured {p['memory_bw_bytes_per_s']/1e12:.2f} TB/s; catalog "
      f"{bw/1e12:.2f} TB/s; launch overhead {p['launch_overhead_s']*1e6:.2f} us "
      f"(catalog {d['efficiency']['launch_overhead_s']['value']*1e6:.2f}); jitter {p['jitter_cv']*100:.2f}%")
for g in p["gemm"]:
    f = 2 * g["m"] * g["n"] * g["k"]
    print(f"  gemm {g['m']:>6} x {g['k']:>6} x {g['n']:>6}: {f/g['seconds']/1e12:7.1f} TFLOP/s")
for o in p.get("ops", []):
    rate = (f"{o['flops_per_s']/1e12:8.1f} TFLOP/s" if "flops_per_s" in o
            else f"{o['bytes_per_s']/1e12:8.2f} TB/s")
    print(f"  {o['op']:>10} {o['phase']:>4}: {rate}  {o['seconds']*1e3:8.3f} ms")
PY

say ""
say "== 4. single-GPU predictions, catalog against profile (hgx-h200, 1 GPU)"
for plan in "--model llama3-8b --seq-len 4096 --recompute full" \
            "--model llama3-8b --seq-len 2048 --micro-batch-size 2 --recompute selective" \
            "--model gpt2-124m --micro-batch-size 16"; do
  for with in "" "--profile $out/profile_h200.json"; do
    # shellcheck disable=SC2086
    line=$("$bin/dtsim" simulate --cluster hgx-h200 --gpus 1 $plan $with 2>&1 | sed -n 2p)
    say "$plan ${with:+(profile)}: $line"
  done
done
say ""
say "not covered: measured GPU training steps and per-task errors (dtexec run does not drive the GPU kernels yet)"
