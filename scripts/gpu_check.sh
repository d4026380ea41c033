#!/usr/bin/env bash
# The GPU checks of issue 5, in one run on a GPU machine (one H200 in this workplace's device
# machines, which have CUDA but none of dtsim's Debian packages), the issue's targets (each
# task's compute against dtsim's prediction) before the multi-rank runs, so that a short lease
# still brings the targets back:
#   1. dtexec devices --selftest and the CUDA unit tests (among them every GPU kernel of the
#      executor against its CPU reference, in fp32 and bf16);
#   2. dtexec run --backend cuda: fp32 on the GPU against fp32 on the CPU (dtexec compare) for
#      tiny models plain, with dropout, with a mixture of experts and with FlashAttention's
#      memory (--attention flash), with multi-head latent attention (DeepSeek-V3's, and without
#      a query latent) and with gradient clipping; a CPU checkpoint resumed on
#      the GPU; GPT-2 124M trained on the
#      GPU in bf16, its measured tasks against dtsim's prediction (dtsim validate: error per
#      task kind, with the catalog and with the H200 profile shipped in validation/, measured
#      by dtexec calibrate on an H200 before); GPT-2 with dropout at cp 2, one rank alone;
#   3. the last pipeline stage of Llama-3 70B at tp8 pp8 and a rank of Mixtral 8x7B at ep 8
#      (--only-rank, communication replaced by the predicted waits), validated as in 2, the
#      70B slice also with a profile calibrated at 70B's shapes, Mixtral also at the expert
#      load its run measured;
#   4. dtexec calibrate --backend cuda: cuBLAS GEMMs (squares, and Llama-3 8B's shapes forward
#      and backward as the executor calls them), copy bandwidth, launch overhead, jitter, the
#      non-GEMM ops with the executor's GPU kernels, and the in_run factors; the catalog's
#      figures against it; single-GPU predictions with it; the runs of 2 and 3 validated again
#      against it (dtsim only);
#   5. GPT-2 calibrated at its own shapes; run with its vocabulary padded (50304, the default)
#      and as it is (50257, --make-vocab-size-divisible-by 1), each validated against that
#      profile, and section 2's GPT-2 runs priced with that profile;
#   6. several ranks on the one GPU over NCCL (mpirun from the bundle, dtexec --share-gpus: each
#      rank a host of its own to NCCL, which moves the data through sockets): dp, ZeRO-3 (dense
#      and a mixture of experts), tp with SP, pp with blocking and overlapped transfers, cp, ep,
#      two 4-rank plans, multi-head latent attention at tp 2 with SP and at cp 2, ZeRO-1
#      gathering at the step's start with FlashAttention's memory, and (where time is left) a
#      mixture of experts whose expert-dp group has 2 ranks, each against the CPU's single-rank
#      run of the same batch;
#   7. GPT-2's loss at --lr 6e-4 in bf16 and fp32 (12 steps), and in bf16 over 200 steps with
#      a 10-step warm-up and a cosine decay to 6e-5 (nanoGPT's GPT-2 rates); a checkpoint's
#      cost, saved synchronously and asynchronously (--checkpoint-async: what training stops
#      for against the write).
# Writes report.txt, the profiles, the traces and the raw outputs into ./gpu-report, or, where
# $OUT is set (the device machines, which bring back at most 8 files from it), into
# /tmp/gpu-report and, however the script ends, report.txt, the profiles measured
# (profile_h200.json, profile_l70.json, profile_gpt2.json, each as soon as it is), the
# sections' start times and one archive of the rest but the checkpoints (gpu-report.tar.xz)
# into $OUT.
#
# Here:  scripts/gpu_bundle.sh                 (gpu-bundle.tar.xz: binaries, mpirun, libraries)
# There: scripts/gpu_check.sh [gpu-bundle.tar.xz]   (run with carry: ["gpu-bundle.tar.xz"], a
#        timeout_s of at least GPU_CHECK_BUDGET + 30, and kind nvidia-h200: the predictions
#        are an H200's)
# GPU_CHECK_SECTIONS="3 6" runs those sections alone (default: 1 2 3 5 6 4 7, the issue's
# targets first, the multi-rank code paths before the calibration that re-prices the runs);
# GPU_CHECK_NCCL_ONLY=TEXT runs the plans of section 6 whose line holds TEXT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
repo=$(pwd)
# The whole check ends by GPU_CHECK_BUDGET seconds (default 520: with the machine's start and
# the transfers, about 11 of a lease's 15 minutes), so that the files come back even when a
# command hangs: a run killed at the device tool's limit brings back only what is already
# under $OUT, which is why the report is written there as it grows.
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-520}))
if [ -n "${OUT:-}" ]; then
  out=/tmp/gpu-report
  rm -rf "$out"
  report=$OUT/report.txt
  bring_back() {
    [ -n "${smi_pid:-}" ] && kill "$smi_pid" 2>/dev/null
    cp -f "$report" "$out/report.txt" 2>/dev/null
    cp -f "$out/profile_h200.json" "$out/profile_l70.json" "$out/profile_gpt2.json" \
      "$OUT/" 2>/dev/null
    # The folders are the runs' checkpoints (1.4 MiB each, which xz does not shrink): with
    # them the archive passed 16 MB and lost its traces; their comparisons are in the report.
    find "$out" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
    export XZ_OPT='-T0 -3'  # seconds, not minutes, on the machine's cores
    tar -C /tmp -cJf "$OUT/gpu-report.tar.xz" gpu-report 2>/dev/null
    # 16 MiB a file comes back: without the predicted traces (dtsim makes them again) if over.
    if [ "$(stat -c %s "$OUT/gpu-report.tar.xz" 2>/dev/null || echo 0)" -gt 16000000 ]; then
      tar -C /tmp -cJf "$OUT/gpu-report.tar.xz" --exclude='*_catalog.json' \
        --exclude='*_profile.json' --exclude='*_waits.json' --exclude='*_own.json' \
        --exclude='*_fresh.json' --exclude='*_gpt2own.json' gpu-report 2>/dev/null
    fi
    # Still over: the measured traces, the logs and the profiles alone (what a later session
    # needs to price the runs again without a GPU).
    if [ "$(stat -c %s "$OUT/gpu-report.tar.xz" 2>/dev/null || echo 0)" -gt 16000000 ]; then
      (cd /tmp && find gpu-report -maxdepth 1 \( -name '*_measured.json' -o -name '*.txt' \
        -o -name 'profile_*.json' \) -print0 | tar -cJf "$OUT/gpu-report.tar.xz" --null -T -)
    fi
  }
  trap bring_back EXIT
  trap 'exit 143' TERM INT  # a signal still brings the files back (the EXIT trap)
else
  out=$repo/gpu-report
  report=$out/report.txt
fi
mkdir -p "$out"
: >"$report"
say() { echo "$*" | tee -a "$report"; }
# A command with a time limit, so that one that hangs leaves the lease to the rest (exit 124
# when it ran out, 137 when it had to be killed); never past the deadline (20 s are kept for
# the archive), and skipped when less than half its time is left (it would be cut short).
# A skip returns 125 and goes to the report alone (not to the output, which may be teed there).
limit() {
  local seconds=$1 left=$((deadline - SECONDS - 20))
  shift
  if [ "$left" -lt $((seconds / 2)) ] || [ "$left" -lt 5 ]; then
    echo "skipped (the check's time is spent): $*" >>"$report"
    return 125
  fi
  [ "$left" -lt "$seconds" ] && seconds=$left
  timeout -k 5 "$seconds" "$@"
}

bundle=${1:-gpu-bundle.tar.xz}
tar -C /tmp -xJf "$bundle" || { say "cannot unpack $bundle"; exit 1; }
bin=/tmp/gpu-bundle/bin
# CUDA's libraries from the machine: the toolkit's, and NCCL's (the toolkit or pip's nvidia-nccl).
cuda_libs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && cuda_libs="$cuda_libs:$d"
done
# Any of CUDA's libraries that the loader does not know: from the folders above, the nvidia-*
# wheels of the machine's Python environments, or, last and once, a search.
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  ldconfig -p 2>/dev/null | grep -q "$lib" && continue
  for d in ${cuda_libs//:/ } /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib \
    /usr/local/lib/python3*/dist-packages/nvidia/*/lib /usr/lib/python3/dist-packages/nvidia/*/lib; do
    [ -e "$d/$lib" ] && { cuda_libs="$cuda_libs:$d"; continue 2; }
  done
  found=$(find /usr/local /opt /usr/lib -name "$lib" -print -quit 2>/dev/null)
  [ -n "$found" ] && cuda_libs="$cuda_libs:$(dirname "$found")"
done
export LD_LIBRARY_PATH="/tmp/gpu-bundle/lib$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export DTSIM_DATA_DIR=$repo
missing=$(ldd "$bin/dtexec" | awk '/not found/ {print $1}' | tr '\n' ' ')
[ -z "$missing" ] || { say "dtexec cannot start: $missing not found (LD_LIBRARY_PATH=$LD_LIBRARY_PATH)"; exit 1; }
say "dtsim GPU check, $(date -u +%Y-%m-%dT%H:%MZ), $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
say "host: $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME"), $(ldd --version 2>/dev/null | head -1)"
case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) in
  *H200*) ;;
  *) say "NOTE: this GPU is not an H200, and every prediction below is an H200's (hgx-h200," \
    "devices/h200.json, the shipped H200 profile): the measurements stand, the errors do not" ;;
esac
say "libraries: $(ldd "$bin/dtexec" | awk '/libcudart|libcublas|libnccl/ {print $1 "=" $3}' | tr '\n' ' ')"

# The profile that prices the predictions: the H200's measured one, shipped in validation/
# (dtexec calibrate on an H200, before this run), until section 4 measures this GPU's.
profile=$out/profile_shipped.json
cp "$repo/validation/h200_llama3-8b_profile.json" "$profile"
# Whether a step ran: says so when it failed or was skipped (exit 125: the time is spent).
ran() {
  local rc=$1 what=$2 log=${3:-}
  [ "$rc" -eq 0 ] && return 0
  if [ "$rc" -eq 125 ]; then
    say "$what: skipped (the check's time is spent)"
  else
    say "$what: failed (exit $rc)${log:+: $(tail -1 "$log")}"
  fi
  return 1
}
gpu_against_cpu() {
  local name=$1 model=$2 flags=${3:-}
  # shellcheck disable=SC2086
  limit 60 "$bin/dtexec" run --model "$model" --steps 5 --warmup 0 $flags \
    --checkpoint "$out/ckpt_cpu_$name" >"$out/ckpt_cpu_$name.txt" 2>&1
  ran $? "$name: the CPU run" "$out/ckpt_cpu_$name.txt" || return
  # The GPU's tensors for overwrite filled with NaN, as the CPU's are (exec/core/device.hpp): a
  # kernel that reads one before writing it shows in the comparison.
  # shellcheck disable=SC2086
  DTEXEC_TEST_POISON_UNWRITTEN=1 limit 60 "$bin/dtexec" run --backend cuda --precision fp32 \
    --model "$model" --steps 5 --warmup 0 $flags --checkpoint "$out/ckpt_gpu_$name" 2>&1 |
    tee "$out/ckpt_gpu_$name.txt" |
    tail -2 | tee -a "$report"
  ran "${PIPESTATUS[0]}" "$name: the GPU run" || return
  "$bin/dtexec" compare "$out/ckpt_cpu_$name" "$out/ckpt_gpu_$name" --loss-tolerance 1e-3 \
    --weight-tolerance 3e-3 2>&1 | tee -a "$report"
}
# One plan: dtexec measures it, dtsim predicts it (catalog, then $profile, then $own_profile
# where the caller sets one: a profile calibrated at the plan's model's own shapes), dtsim
# validate joins. Each plan is kept (validated_plans), so that section 4 can price it again with the
# profile it measures, without running it again.
validated_plans=()
validate_plan() {
  local name=$1 predicted_flags=$2 run_flags=$3 topology=${cluster:-hgx-h200} own=${own_profile:-}
  local with
  validated_plans+=("$name|$topology|$predicted_flags")
  # shellcheck disable=SC2086
  limit 60 "$bin/dtsim" simulate --cluster "$topology" $predicted_flags \
    --trace "$out/${name}_catalog.json" >"$out/${name}_simulate_catalog.txt" 2>&1
  # shellcheck disable=SC2086
  limit 60 "$bin/dtsim" simulate --cluster "$topology" $predicted_flags \
    --profile "$profile" --trace "$out/${name}_profile.json" \
    >"$out/${name}_simulate_profile.txt" 2>&1
  if [ -n "$own" ]; then
    # shellcheck disable=SC2086
    limit 60 "$bin/dtsim" simulate --cluster "$topology" $predicted_flags \
      --profile "$own" --trace "$out/${name}_own.json" >"$out/${name}_simulate_own.txt" 2>&1
  fi
  # shellcheck disable=SC2086
  limit 100 "$bin/dtexec" run --backend cuda $run_flags --trace "$out/${name}_measured.json" \
    >"$out/${name}_run.txt" 2>&1
  local rc=$?
  tail -3 "$out/${name}_run.txt" | tee -a "$report"
  ran $rc "$name: dtexec run" || return
  for with in catalog profile ${own:+own}; do
    say "-- $name: predicted ($with) against measured"
    "$bin/dtsim" validate --predicted "$out/${name}_${with}.json" \
      --measured "$out/${name}_measured.json" 2>&1 | tee -a "$report"
  done
}

# The runs validate_plan kept (those whose name matches PATTERN, default all) priced again
# with PROFILE, without running them again (dtsim only), each against its measured trace.
#   revalidate PROFILE LABEL SUFFIX [PATTERN]
revalidate() {
  local with=$1 label=$2 suffix=$3 pattern=${4:-*} entry name topology flags
  for entry in "${validated_plans[@]}"; do
    IFS='|' read -r name topology flags <<<"$entry"
    # shellcheck disable=SC2053
    [[ $name == $pattern ]] || continue
    [ -s "$out/${name}_measured.json" ] || continue
    # shellcheck disable=SC2086
    limit 60 "$bin/dtsim" simulate --cluster "$topology" $flags --profile "$with" \
      --trace "$out/${name}_$suffix.json" >/dev/null 2>&1 || continue
    say "-- $name: predicted ($label) against measured"
    "$bin/dtsim" validate --predicted "$out/${name}_$suffix.json" \
      --measured "$out/${name}_measured.json" 2>&1 | head -12 | tee -a "$report"
  done
}

section_1() {
say ""
say "== 1. devices and CUDA unit tests"
limit 60 "$bin/dtexec" devices --selftest 2>&1 | tee -a "$report"
limit 90 "$bin/dtexec_cuda_tests" --reporter compact 2>&1 | tee "$out/cuda_tests.txt" |
  grep -v -E '^$' | tail -40 | tee -a "$report"

}

section_2() {
say ""
say "== 2. dtexec run on the GPU"
# A model trained 5 steps in fp32 on the CPU and on the GPU from one seed: the checkpoints
# compared (losses within 1e-3, weights within 3e-3).
say "-- fp32 on the GPU against fp32 on the CPU (tiny-gpt, 5 steps, same seed)"
gpu_against_cpu tiny tiny-gpt
say "-- with dropout (the GPU draws the CPU's masks): fp32 on the GPU against the CPU"
gpu_against_cpu dropout "$repo/tests/exec/mpi/tiny_gpt_dropout.json"
say "-- a mixture of experts (the GPU routes as the CPU): fp32 on the GPU against the CPU"
gpu_against_cpu moe "$repo/tests/exec/mpi/tiny_moe.json"
say "-- a Hugging Face qwen3_moe config (its heads twice as wide as the model): GPU against CPU"
gpu_against_cpu qwen3moe "$repo/tests/exec/mpi/tiny_qwen3_moe.json"
say "-- a Hugging Face qwen2_moe config (experts beside a shared expert): GPU against CPU"
gpu_against_cpu qwen2moe "$repo/tests/exec/mpi/tiny_qwen2_moe.json"
say "-- a Hugging Face llama4 config (one expert a token beside a shared one): GPU against CPU"
gpu_against_cpu llama4 "$repo/tests/exec/mpi/tiny_llama4.json"
say "-- dense blocks between the experts' (a llama4 config laid out as Maverick): GPU against CPU"
gpu_against_cpu maverick "$repo/tests/exec/mpi/tiny_llama4_maverick.json"
say "-- a Hugging Face glm4_moe config (a dense first block, sigmoid gates x 2.5): GPU against CPU"
gpu_against_cpu glm "$repo/tests/exec/mpi/tiny_glm4_moe.json"
say "-- a Hugging Face deepseek_v3 config (multi-head latent attention with a query latent, a"
say "   dense first block, sigmoid-gated experts): GPU against CPU"
gpu_against_cpu dsv3 "$repo/tests/exec/mpi/tiny_deepseek_v3.json"
say "-- multi-head latent attention without a query latent, values wider than the keys, with"
say "   FlashAttention's memory: GPU against CPU"
gpu_against_cpu mla "$repo/tests/exec/mpi/tiny_mla.json" "--attention flash"
say "-- FlashAttention's memory with dropout (probabilities and masks made again): GPU against CPU"
gpu_against_cpu flash "$repo/tests/exec/mpi/tiny_gpt_dropout.json" "--attention flash"
say "-- gradient clipping at norm 0.5 (every step clips): GPU against CPU, and the norms"
gpu_against_cpu clip tiny-gpt "--clip-grad 0.5"
for side in cpu gpu; do
  say "$side: $(grep -s -h -o 'grad norm [0-9.e+-]*' "$out/ckpt_${side}_clip.txt" | tr '\n' ' ')"
done
say "-- a CPU checkpoint (step 3) resumed on the GPU to step 5, against the CPU's 5 steps"
limit 60 "$bin/dtexec" run --model tiny-gpt --steps 3 --warmup 0 --checkpoint "$out/ckpt_cpu_half" \
  >"$out/ckpt_cpu_half.txt" 2>&1
if ran $? "resume: the CPU run" "$out/ckpt_cpu_half.txt"; then
  DTEXEC_TEST_POISON_UNWRITTEN=1 limit 60 "$bin/dtexec" run --backend cuda --precision fp32 \
    --model tiny-gpt --steps 5 --warmup 0 --resume "$out/ckpt_cpu_half" --checkpoint "$out/ckpt_gpu_resumed" 2>&1 | tail -2 |
    tee -a "$report"
  if ran "${PIPESTATUS[0]}" "resume: the GPU run"; then
    "$bin/dtexec" compare "$out/ckpt_cpu_tiny" "$out/ckpt_gpu_resumed" --loss-tolerance 1e-3 \
      --weight-tolerance 3e-3 2>&1 | tee -a "$report"
  fi
fi

say "-- GPT-2 124M on one GPU, bf16, micro-batch 8, sequence 1024"
gpt2="--model gpt2-124m --no-dropout --micro-batch-size 8 --seq-len 1024 --global-batch-size 16"
validate_plan gpt2 "--gpus 1 $gpt2" "$gpt2 --steps 6"

say "-- GPT-2 124M with dropout, cp 2: rank 1 alone (its queries at chunks 1 and 2), bf16"
g2cp="--model gpt2-124m --cp 2 --micro-batch-size 4 --seq-len 1024 --global-batch-size 8"
validate_plan gpt2_cp "--gpus 2 $g2cp" "$g2cp --only-rank 1 --steps 4"

}

section_3() {
say ""
say "== 3. one rank of large plans on the GPU (--only-rank), bf16"
say "-- Llama-3 70B, tp8 pp8 (64 GPUs), its last stage's tp rank 7 alone, bf16, sequence 4096"
# 64 H200: the SuperPOD's fabric with H200 devices (the shipped H200 topology is one node).
python3 - "$repo/topologies/dgx-h100-superpod.json" "$out/h200-pod.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d["name"] = "h200-pod"
d["device"] = "h200"
d["description"] = "dgx-h100-superpod with H200 devices: the fabric of the --only-rank waits"
json.dump(d, open(sys.argv[2], "w"), indent=2)
PY
l70="--model llama3-70b --tp 8 --pp 8 --micro-batch-size 1 --seq-len 4096 --global-batch-size 16"
# shellcheck disable=SC2086
limit 60 "$bin/dtsim" simulate --cluster "$out/h200-pod.json" --gpus 64 $l70 \
  --profile "$profile" --trace "$out/l70_waits.json" >/dev/null 2>&1
cluster="$out/h200-pod.json" validate_plan l70 "--gpus 64 $l70" \
  "$l70 --dp 1 --only-rank 63 --predicted $out/l70_waits.json --steps 3"

say "-- Mixtral 8x7B, tp2 (SP) dp8 ep8 (16 GPUs), rank 0 alone (its experts get 8x its own copies)," \
  "full recompute"
# Full recompute: without it the rank ran out of the H200's memory (2026-12-04) where dtsim
# predicts 95.9 GiB for balanced routing: alone, the rank's experts get 8x the copies its own
# tokens route to them, and at initialisation its tokens did not route evenly (one expert got
# 2,048 of a layer's 8,192 copies, twice the even share, in the allocation that failed). Its
# dense shapes are Llama-3 8B's (hidden 4096, kv 1024, ffn 14336): the shipped profile has them.
mix="--model mixtral-8x7b --tp 2 --sequence-parallel --ep 8 --micro-batch-size 1 --seq-len 4096"
mix="$mix --global-batch-size 16 --recompute full"
cluster="$out/h200-pod.json" validate_plan mixtral "--gpus 16 $mix" \
  "$mix --dp 8 --only-rank 0 --steps 3"
# The routing the rank's experts got (dtexec prints it) against dtsim's even share: the same
# prediction with --expert-load at the measured mean.
load=$(grep -o -m1 'experts got [0-9.]*x' "$out/mixtral_run.txt" | grep -o '[0-9][0-9.]*')
if [ -n "$load" ] && [ -s "$out/mixtral_measured.json" ]; then
  # shellcheck disable=SC2086
  limit 60 "$bin/dtsim" simulate --cluster "$out/h200-pod.json" --gpus 16 $mix --profile "$profile" \
    --expert-load "$load" --trace "$out/mixtral_load.json" >"$out/mixtral_simulate_load.txt" 2>&1
  say "-- mixtral: predicted (profile, --expert-load $load as the run measured) against measured"
  if [ -s "$out/mixtral_load.json" ]; then
    "$bin/dtsim" validate --predicted "$out/mixtral_load.json" \
      --measured "$out/mixtral_measured.json" 2>&1 | tee -a "$report"
  else
    # (dtsim prices the busiest rank: a load below the even share, 1, is refused, and the
    # prediction above, at the even share, is the one to read.)
    say "dtsim simulate --expert-load $load: $(tail -1 "$out/mixtral_simulate_load.txt")"
  fi
fi
# Llama-3 70B's own shapes (hidden 8192; its GEMMs whole and split over tp up to 8, so the
# slice's tp-8 shapes are measured, each pass apart), after the slices, so that a slow
# calibration does not keep them from running: the shipped profile has Llama-3 8B's, and a
# shape it lacks is priced by its FLOPs alone, the same for a layer's input and weight
# gradients. The 70B slice priced with it (dtsim only).
limit 150 "$bin/dtexec" calibrate --backend cuda --model llama3-70b --micro-batch-size 1 \
  --seq-len 4096 --repeats 10 --out "$out/profile_l70.json" >"$out/calibrate_l70.txt" 2>&1
ran $? "calibrate at Llama-3 70B's shapes" "$out/calibrate_l70.txt" &&
  grep -E "in a training step|memory bandwidth" "$out/calibrate_l70.txt" | tee -a "$report"
if [ -s "$out/profile_l70.json" ]; then
  [ -n "${OUT:-}" ] && cp -f "$out/profile_l70.json" "$OUT/"
  revalidate "$out/profile_l70.json" "70B's own shapes" own 'l70'
fi

}

section_4() {
say ""
say "== 4. calibrate (cuBLAS bf16, Llama-3 8B shapes at micro-batch 1, sequence 4096)"
limit 150 "$bin/dtexec" calibrate --backend cuda --model llama3-8b --micro-batch-size 1 \
  --seq-len 4096 --repeats 10 --out "$out/profile_h200.json" >"$out/calibrate.txt" 2>&1
rc=$?
tee -a "$report" <"$out/calibrate.txt"
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 125 ] && [ $rc -ne 137 ]; then
  # One GPU lease per task: if the training steps of the in_run factors fail, say so and go on
  # with the kernels alone, so that the other checks still run (not when it ran out of time).
  say "calibrate failed (exit $rc); again without the in_run training steps"
  limit 90 "$bin/dtexec" calibrate --backend cuda --model llama3-8b --micro-batch-size 1 \
    --seq-len 4096 --repeats 10 --no-in-run --out "$out/profile_h200.json" >"$out/calibrate_kernels.txt" 2>&1
  rc=$?
  tee -a "$report" <"$out/calibrate_kernels.txt"
  # The runs below still go, priced by the catalog alone.
  [ $rc -eq 0 ] || say "calibrate failed (exit $rc): the comparisons with a profile will fail"
fi

if [ -s "$out/profile_h200.json" ]; then
  [ -n "${OUT:-}" ] && cp -f "$out/profile_h200.json" "$OUT/"
  profile=$out/profile_h200.json
fi
say ""
say "-- catalog against measurement ($(basename "$profile"))"
python3 - "$profile" "$repo/topologies/devices/h200.json" <<'PY' | tee -a "$report"
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
say "-- single-GPU predictions, catalog against profile (hgx-h200, 1 GPU)"
for plan in "--model llama3-8b --seq-len 4096 --recompute full" \
            "--model llama3-8b --seq-len 2048 --micro-batch-size 2 --recompute selective" \
            "--model gpt2-124m --micro-batch-size 16"; do
  for with in "" "--profile $profile"; do
    # shellcheck disable=SC2086
    line=$(limit 60 "$bin/dtsim" simulate --cluster hgx-h200 --gpus 1 $plan $with 2>&1 | sed -n 2p)
    say "$plan ${with:+(profile)}: $line"
  done
done
say ""
say "-- sections 2 and 3: the runs against the profile measured here (dtsim only)"
if [ "$profile" = "$out/profile_h200.json" ]; then
  revalidate "$profile" "this GPU's profile" fresh
else
  say "no profile measured here"
fi
}

section_5() {
say ""
say "== 5. GPT-2 at its own shapes: vocabulary padded to 50304 (the default) and as it is (50257)"
# Without dropout (as section 2 runs it): a model file, since calibrate trains the model.
python3 - "$repo/models/gpt2-124m.json" "$out/gpt2_nodrop.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
m["dropout"] = False
m["name"] = "gpt2-124m-nodrop"
json.dump(m, open(sys.argv[2], "w"), indent=2)
PY
g2="--model $out/gpt2_nodrop.json --micro-batch-size 8 --seq-len 1024 --global-batch-size 16"
# Calibrated at GPT-2's own shapes (its vocabulary padded, as dtexec runs it by default).
limit 60 "$bin/dtexec" calibrate --backend cuda --model "$out/gpt2_nodrop.json" --micro-batch-size 8 \
  --seq-len 1024 --repeats 10 --out "$out/profile_gpt2.json" >"$out/calibrate_gpt2.txt" 2>&1
grep -E "50304|in a training step|attention|layernorm|gelu|loss" "$out/calibrate_gpt2.txt" |
  tee -a "$report"
[ -n "${OUT:-}" ] && [ -s "$out/profile_gpt2.json" ] && cp -f "$out/profile_gpt2.json" "$OUT/"
# Padded to 50304 (the default: a multiple of 128) against the vocabulary as it is (1).
for multiple in 128 1; do
  flags="$g2 --make-vocab-size-divisible-by $multiple"
  # shellcheck disable=SC2086
  limit 60 "$bin/dtsim" simulate --cluster hgx-h200 --gpus 1 $flags --profile "$out/profile_gpt2.json" \
    --trace "$out/gpt2_m${multiple}_own.json" >/dev/null 2>&1
  # shellcheck disable=SC2086
  limit 60 "$bin/dtexec" run --backend cuda $flags --steps 6 \
    --trace "$out/gpt2_m${multiple}_measured.json" 2>&1 | tail -2 | tee -a "$report"
  ran "${PIPESTATUS[0]}" "GPT-2, vocabulary multiple $multiple" || continue
  [ -s "$out/profile_gpt2.json" ] || { say "no GPT-2 profile: nothing to validate"; continue; }
  say "-- vocabulary multiple $multiple: predicted (GPT-2's own profile) against measured"
  "$bin/dtsim" validate --predicted "$out/gpt2_m${multiple}_own.json" \
    --measured "$out/gpt2_m${multiple}_measured.json" 2>&1 | head -7 | tee -a "$report"
done
# Section 2's GPT-2 runs priced again with GPT-2's own profile (dtsim only; the cp slice has
# dropout, which that profile did not time).
[ -s "$out/profile_gpt2.json" ] &&
  revalidate "$out/profile_gpt2.json" "GPT-2's own profile" gpt2own 'gpt2*'

}

# GPT-2's loss and its checkpoints' cost on the GPU (measured on 2026-12-04: last, as a check).
section_7() {
say ""
say "== 7. GPT-2 trained on the GPU: its loss, and what its checkpoints cost"
g2="--model $out/gpt2_nodrop.json --micro-batch-size 8 --seq-len 1024 --global-batch-size 16"
[ -s "$out/gpt2_nodrop.json" ] || g2="--model gpt2-124m --no-dropout --micro-batch-size 8 --seq-len 1024 --global-batch-size 16"
say "-- GPT-2's loss over 12 steps at --lr 6e-4, bf16 then fp32 (tensors for overwrite poisoned)"
for precision in bf16 fp32; do
  # (Poisoned as the runs against the CPU: a bf16 kernel reading one before writing it would
  # end the run with a non-finite loss.)
  # shellcheck disable=SC2086
  losses=$(DTEXEC_TEST_POISON_UNWRITTEN=1 limit 60 "$bin/dtexec" run --backend cuda \
    --precision $precision $g2 --steps 12 --lr 6e-4 2>&1 | awk '/^step/ {printf "%s ", $4}')
  say "$precision: $losses"
done
# 200 steps (12 barely move it: 10.975 to 10.952 on 2026-12-04; 200 took it to 1.59), with a
# checkpoint at the end (outside $OUT: 1.4 GiB): what it costs, and its copy to host memory,
# the figure for dtsim --checkpoint-async-gbs-per-gpu.
# shellcheck disable=SC2086
limit 90 "$bin/dtexec" run --backend cuda $g2 --steps 200 --lr 6e-4 --lr-warmup-steps 10 \
  --lr-decay-style cosine --min-lr 6e-5 --checkpoint /tmp/gpu_check_gpt2_ckpt \
  >"$out/gpt2_warmup.txt" 2>&1
say "bf16, 200 steps, warm-up 10 steps, cosine decay to 6e-5, every 20th loss:" \
  "$(awk '/^step/ && ($2 == 1 || $2 % 20 == 0) {printf "%s ", $4}' "$out/gpt2_warmup.txt")"
say "$(grep -h 'checkpoint written' "$out/gpt2_warmup.txt")"
rm -rf /tmp/gpu_check_gpt2_ckpt
# Asynchronous saves every 75 steps: what training stops for (the copy to host memory) against
# the write behind it, and the steps' times while it writes. (Every 4 steps, on 2026-12-04,
# each save waited 5.5 s for the write before it: 1.4 GiB at 250 MB/s outlasts 4 steps.)
# shellcheck disable=SC2086
limit 90 "$bin/dtexec" run --backend cuda $g2 --steps 150 --lr 6e-4 \
  --checkpoint /tmp/gpu_check_gpt2_ckpt --checkpoint-every 75 --checkpoint-async \
  >"$out/gpt2_async_ckpt.txt" 2>&1
say "asynchronous saves: step times (ms) of steps 70 to 85" \
  "$(awk '/^step/ && $2 >= 70 && $2 <= 85 {printf "%s ", $5}' "$out/gpt2_async_ckpt.txt")"
grep -h -e '^checkpoint' "$out/gpt2_async_ckpt.txt" | while read -r line; do say "$line"; done
rm -rf /tmp/gpu_check_gpt2_ckpt
}

section_6() {
say ""
say "== 6. several ranks on the one GPU over NCCL (mpirun -np N dtexec run --share-gpus)"
# mpirun from the bundle, relocated; each rank a host of its own to NCCL (NCCL_HOSTID), the data
# through sockets over loopback, the GPU time-slicing the ranks' kernels: the multi-GPU code
# paths (communicators split per group, NCCL collectives, grouped all-to-all, pipeline
# transfers, ZeRO's reduce-scatters and all-gathers), not their speed. fp32, 3 steps of a
# global batch of 8, against the CPU's single-rank run of the same batch and micro-batch size.
# MPI carries only the host's side (ids, losses, checkpoints): shared memory between the
# processes, without the kernel's cross-memory attach (containers often forbid it) or UCX.
# NCCL's side is set whatever the machine's environment says (a cloud image's
# NCCL_SOCKET_IFNAME may leave loopback out, a network plugin may be installed), and its
# warnings are printed.
mpi=/tmp/gpu-bundle/mpi
mpirun=(env OPAL_PREFIX="$mpi" PMIX_MCA_mca_base_component_path="$mpi/pmix/lib/pmix"
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
  OMPI_MCA_pml=ob1 "OMPI_MCA_btl=self,vader" OMPI_MCA_btl_vader_single_copy_mechanism=none
  NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_NET=Socket NCCL_DEBUG=WARN
  "$mpi/bin/mpirun" --bind-to none)
say "GPU compute mode: $(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>&1 | head -1);" \
  "/dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR == 2 {print $2 " (" $4 " free)"}')"
if ! limit 20 "${mpirun[@]}" -np 2 true </dev/null >"$out/mpirun_check.txt" 2>&1; then
  say "mpirun from the bundle does not start two processes: $(tail -3 "$out/mpirun_check.txt" |
    tr '\n' ' '); the plans below are skipped"
  nccl_skip=1
fi
nccl_common=(--steps 3 --lr 3e-3 --warmup 0 --global-batch-size 8 --precision fp32)
# model | ranks | micro-batch size | seconds | plan flags (the correctness matrix's shapes; 4
# ranks make more communicators, each split collective over the job, on one time-sliced GPU)
# (First the two whose fixes no GPU has run: overlapped pipeline transfers, which hung on
# 2026-12-04, and the 4-rank MoE plan, whose routing changed since. dp 2 ep 2 ran on ZeRO-0
# then; with ZeRO-2 since the sixty-second session, each expert on one rank: the dense states
# sharded, the experts' whole. The last, dp 4 ep 2, is the one whose experts' gradients reduce
# over an expert-dp group of 2: the others have one rank in theirs. Third and fourth, ZeRO-3,
# whose weight gathers start ahead on the dp stream since the sixty-fourth session, each tensor
# in place, waited for where a unit first reads them: a dense model, and a mixture of experts,
# whose unit gathers its dense and expert weights apart, waiting for the second. Then
# multi-head latent attention, run on no GPU before: tp with sequence parallelism (its latents
# gathered, their gradients reduce-scattered) and cp (its keys and values gathered at their
# widths).)
nccl_plans=(
  "tiny-gpt|2|2|45|--pp 2 --schedule 1f1b --overlap-p2p-comm"
  "moe|4|1|75|--tp 2 --dp 2 --ep 2 --sequence-parallel --schedule zero-bubble --recompute full"
  "tiny-gpt|2|1|45|--dp 2 --zero-stage 3 --recompute full"
  "moe|2|1|45|--dp 2 --zero-stage 3"
  "dsv3|2|2|45|--tp 2 --sequence-parallel"
  "dsv3|2|2|45|--cp 2"
  "tiny-gpt|2|4|45|--dp 2"
  "tiny-gpt|2|2|45|--tp 2 --sequence-parallel"
  "tiny-gpt|2|2|45|--pp 2 --schedule 1f1b"
  "moe|2|2|45|--dp 2 --ep 2 --zero-stage 2"
  "tiny-gpt|2|2|45|--cp 2"
  "tiny-gpt|4|1|75|--dp 2 --tp 2 --zero-stage 1"
  "tiny-gpt|2|2|45|--dp 2 --zero-stage 1 --overlap-param-gather --attention flash"
  "moe|4|1|75|--dp 4 --ep 2 --zero-stage 1"
)
i=0
timeouts=0
# One plan of the list below on NCCL (its fields as the loop reads them).
nccl_run() {
  # shellcheck disable=SC2086
  DTEXEC_TEST_POISON_UNWRITTEN=1 limit "$seconds" "${mpirun[@]}" -np "$ranks" \
    -x DTEXEC_TEST_POISON_UNWRITTEN "$bin/dtexec" run --backend cuda --share-gpus \
    --model "$path" "${nccl_common[@]}" --micro-batch-size "$mbs" $flags \
    --task-timeout $((seconds - 15)) --checkpoint-timeout $((seconds - 15)) \
    --checkpoint "$out/nccl_$i" --trace "$out/nccl_$i.json" \
    </dev/null >"$out/nccl_$i.txt" 2>&1
}
# The measured communication tasks of a trace, by kind: their number and median time. A
# started collective or a send is timed by events on its NCCL stream (since 2026-12-04; before,
# its launch on the compute stream: microseconds); through sockets on a time-sliced GPU they
# are slow, which is the point here: a transfer's time, not a launch's.
comm_times() {
  python3 - "$1" <<'PY'
import json, statistics, sys
kinds = {}
for e in json.load(open(sys.argv[1])).get("traceEvents", []):
    args = e.get("args", {})
    if e.get("ph") == "X" and "phase" not in args:
        kinds.setdefault(args.get("kind", e.get("cat", "?")), []).append(e.get("dur", 0))
print("; ".join(f"{k} {len(v)} tasks, median {statistics.median(v):.0f} us"
                for k, v in sorted(kinds.items())) or "no communication tasks")
PY
}
# Sections 4 and 7 come after this one: 110 s are kept for them.
keep=0
[[ " ${GPU_CHECK_SECTIONS:-1 2 3 5 6 4 7} " == *" 6 "*" 4 "* ]] && keep=110
for entry in "${nccl_plans[@]}"; do
  [[ $entry == *"${GPU_CHECK_NCCL_ONLY:-}"* ]] || continue
  if [ -n "${nccl_skip:-}" ] || [ $timeouts -ge 2 ] || [ $((deadline - SECONDS - keep)) -lt 60 ]; then
    say "skipped: $entry"
    continue
  fi
  IFS='|' read -r model ranks mbs seconds flags <<<"$entry"
  i=$((i + 1))
  path=$model
  [ "$model" = moe ] && path=$repo/tests/exec/mpi/tiny_moe.json
  [ "$model" = dsv3 ] && path=$repo/tests/exec/mpi/tiny_deepseek_v3.json
  ref=$out/nccl_ref_${model}_$mbs
  if [ ! -d "$ref" ]; then
    limit 20 "$bin/dtexec" run --model "$path" "${nccl_common[@]}" --micro-batch-size "$mbs" \
      --checkpoint "$ref" >"$ref.txt" 2>&1
    # A reference cut short is not kept for the plans after.
    ran $? "the CPU reference of $entry" "$ref.txt" || { rm -rf "$ref"; continue; }
  fi
  nccl_run
  rc=$?
  # NCCL's cuMem allocations have not been seen working in every container runtime: if NCCL
  # fails to set up, the rest of the section goes without them (once).
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $rc -ne 125 ] && [ $rc -ne 137 ] &&
    [ -z "${cumem_off:-}" ] &&
    grep -qi 'ncclCommInit\|ncclCommSplit\|cuMem\|ncclUnhandledCudaError\|ncclSystemError' "$out/nccl_$i.txt"; then
    say "NCCL did not set up ($(grep -i -m1 'nccl' "$out/nccl_$i.txt" | cut -c1-160)); again," \
      "and for the plans after, with NCCL_CUMEM_ENABLE=0"
    cumem_off=1
    mpirun=(env NCCL_CUMEM_ENABLE=0 "${mpirun[@]}")
    nccl_run
    rc=$?
  fi
  # (The first four plans are the ones no GPU has run yet: their hangs do not end the section
  # before the eight seen working have run.)
  { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ $i -gt 4 ] && timeouts=$((timeouts + 1))
  if [ $rc -eq 125 ]; then
    say "skipped (the check's time is spent): $entry"
    continue
  elif [ $rc -ne 0 ]; then
    say "FAILED (exit $rc): $model, $ranks ranks, $flags: $(grep -v '^-\|^$' "$out/nccl_$i.txt" |
      grep -i -m4 'error\|failed\|dtexec\|NCCL WARN' | tr '\n' ' ')"
    continue
  fi
  result=$("$bin/dtexec" compare "$ref" "$out/nccl_$i" --loss-tolerance 1e-3 \
    --weight-tolerance 3e-3 2>&1 | tail -1)
  say "$model, $ranks ranks, mbs $mbs, $flags: $(grep -m1 'median step time' "$out/nccl_$i.txt" |
    cut -d'(' -f1); against the CPU: $result"
  [ -s "$out/nccl_$i.json" ] && say "  communication measured: $(comm_times "$out/nccl_$i.json" 2>&1)"
done
}

# The GPU's clock and power through the check (every 200 ms), summed up per section at the
# end: GEMMs of random values load an H200 to its power cap and lower its clock, which a
# profile's rates carry (exec/README.md, 2026-12-04).
smi_pid=""
if command -v nvidia-smi >/dev/null; then
  # (clocks_event_reasons since driver 535; clocks_throttle_reasons before.)
  reasons=clocks_event_reasons.active
  nvidia-smi --query-gpu=$reasons --format=csv,noheader >/dev/null 2>&1 ||
    reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,$reasons \
    --format=csv,noheader,nounits -lms 200 >"$out/smi.csv" 2>"$out/smi_errors.txt" &
  smi_pid=$!
fi
# (Also into $OUT as it grows: a run cut off at the device tool's limit keeps it.)
stamp() {
  echo "$1 $(date '+%Y/%m/%d %H:%M:%S.%3N')" >>"$out/sections.txt"
  [ -n "${OUT:-}" ] && cp -f "$out/sections.txt" "$OUT/"
}
for section in ${GPU_CHECK_SECTIONS:-1 2 3 5 6 4 7}; do
  stamp "$section"
  case $section in
    [1-7]) "section_$section" ;;
    *) say "GPU_CHECK_SECTIONS: no section $section (1 to 7)" ;;
  esac
done
stamp end
if [ -n "$smi_pid" ]; then
  kill "$smi_pid" 2>/dev/null
  say ""
  say "== the GPU's SM clock and power per section (nvidia-smi every 200 ms)"
  [ -s "$out/smi.csv" ] || say "nvidia-smi recorded nothing: $(head -2 "$out/smi_errors.txt")"
  python3 - "$out/smi.csv" "$out/sections.txt" <<'PY' | tee -a "$report"
import sys
from datetime import datetime
def when(text):
    return datetime.strptime(text.strip(), "%Y/%m/%d %H:%M:%S.%f")
samples = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        samples.append((when(f[0]), float(f[1]), float(f[2]), int(f[3], 16)))
    except (ValueError, IndexError):
        continue
marks = [(l.split(" ", 1)[0], when(l.split(" ", 1)[1])) for l in open(sys.argv[2])]
for (name, begin), (_, end) in zip(marks, marks[1:]):
    s = [x for x in samples if begin <= x[0] < end]
    if not s:
        continue
    busy = [x for x in s if x[2] > 150]  # above idle power
    capped = sum(1 for x in s if x[3] & 0x4)  # software power cap
    if busy:
        print(f"section {name}: {len(s)} samples, {len(busy)} busy: SM clock mean "
              f"{sum(x[1] for x in busy) / len(busy):.0f} MHz (min {min(x[1] for x in busy):.0f}), "
              f"power mean {sum(x[2] for x in busy) / len(busy):.0f} W "
              f"(max {max(x[2] for x in busy):.0f}); power-capped in {capped}")
    else:
        print(f"section {name}: {len(s)} samples, none above 150 W")
PY
fi
