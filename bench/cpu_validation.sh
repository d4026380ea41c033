#!/bin/bash
# Predicted against measured on this CPU host (issue 5's target: within ±15% for every plan of
# the correctness matrix with no more ranks than cores and at least 0.2 s per step).
#
# A shared host's speed drifts over minutes, so calibration and measurement are spread over
# RUNS rounds, each one:
# 1. dtexec calibrate, once per rank count (ranks measure at once, one GEMM thread each when
#    several, as dtexec run sets them), writing that round's profiles and this host as a
#    cluster;
# 2. for each plan: with CALIBRATE=plan (the default), dtexec calibrate again with the plan's
#    rank count just before its run, so that the profile and the run see the host in the same
#    spell (CALIBRATE=round uses the round's profiles); one dtexec run of STEPS steps; and
#    dtsim simulate of the same plan on that cluster with that profile (its measured jitter
#    drives the straggler model, its ranks' spread the slow rank), again without the slow rank
#    (--rank-spread-cv 0), and without either (--jitter-cv 0 --rank-spread-cv 0).
# Then a table: plan, ranks, predicted (the median over rounds), measured (the median step
# time over all rounds, warm-up left out), the spread of those step times, error, the error
# without stragglers, and memory (the last round's busiest rank's peak of tensors,
# measured/predicted by dtsim memory without its framework allowance, and the prediction's
# error, signed as the times'); and the worst error; and for expert-parallel plans the
# prediction again at the routing's load that the run measured (dtsim --expert-load), and the
# memory at the load of its busiest micro-batch.
#
# ONLY=REGEX runs (and tabulates) only the plans whose flags match it, e.g. ONLY='--cp'.
#
# usage: [RUNS=3] [STEPS=8] [MODEL=cpu-small] [CALIBRATE=plan|round] [TABLE_ONLY=1] [ONLY=REGEX]
#        bench/cpu_validation.sh [BUILD_DIR] [WORK_DIR]
#        (BUILD_DIR defaults to build)
set -euo pipefail
# shellcheck source=bench/setup.sh
source "$(dirname "$0")/setup.sh" "$@"
cores=$(nproc)
steps=${STEPS:-8}
runs=${RUNS:-3}
calibrate=${CALIBRATE:-plan}
case "$calibrate" in
  plan | round) ;;
  *)
    echo "cpu_validation.sh: CALIBRATE: expected plan or round, got '$calibrate'" >&2
    exit 2
    ;;
esac
warmup=2
batch=(--micro-batch-size 4 --global-batch-size 8)

# ranks | plan flags (micro-batch 4, global batch 8): the plan shapes of the correctness
# matrix (tests/exec/mpi/correctness_matrix.sh) with no more than two ranks, and one rank with
# and without recompute; FlashAttention's memory (--attention flash); gradient clipping. The tp plans run with and without --no-overlap-tp-backward: dtexec
# starts the overlapped all-reduce with MPI_Iallreduce, but MPI moves its data only inside MPI
# calls, not during a GEMM (the CPU cluster says so, and dtsim runs its ranks serially).
# Expert parallelism (--ep) needs a mixture of experts: MODEL=bench/models/cpu-small-moe.json.
plans=(
  "1|"
  "1|--recompute full"
  "2|--dp 2"
  "2|--dp 2 --zero-stage 1"
  "2|--dp 2 --zero-stage 1 --overlap-param-gather"
  "2|--dp 2 --zero-stage 1 --zero-in-place"
  "2|--dp 2 --zero-stage 1 --zero-in-place --overlap-param-gather"
  "2|--dp 2 --zero-stage 2"
  "2|--dp 2 --zero-stage 3"
  "2|--dp 2 --zero-stage 3 --recompute full"
  "2|--tp 2"
  "2|--tp 2 --no-overlap-tp-backward"
  "2|--tp 2 --recompute selective --no-overlap-tp-backward"
  "2|--tp 2 --recompute full"
  "2|--tp 2 --sequence-parallel"
  "2|--pp 2 --schedule gpipe"
  "2|--pp 2 --schedule 1f1b"
  "2|--pp 2 --schedule 1f1b --recompute full"
  "2|--pp 2 --schedule 1f1b --overlap-p2p-comm"
  "2|--pp 2 --schedule zero-bubble"
  "2|--pp 2 --schedule interleaved --virtual-stages 2"
  "2|--cp 2"
  "2|--cp 2 --recompute selective"
  "1|--attention flash"
  "2|--tp 2 --attention flash"
  "2|--pp 2 --schedule 1f1b --attention flash"
  "2|--dp 2 --ep 2"
  "2|--dp 2 --ep 2 --zero-stage 2"
  "2|--dp 2 --zero-stage 1 --clip-grad 1"
  "2|--pp 2 --schedule 1f1b --clip-grad 1"
)
# Expert parallelism needs a mixture of experts ($moe): its plans run only with such a MODEL.
# A plan this host runs (no more ranks than cores), its model has what it needs, ONLY asks for.
wanted() {
  [ "$1" -le "$cores" ] && { [ -n "$moe" ] || [[ "$2" != *--ep* ]]; } &&
    { [ -z "${ONLY:-}" ] || [[ "$2" =~ $ONLY ]]; }
}
# The step times after warm-up of one dtexec run --json, one per line.
step_times() { sed -n '/"step_times_s": \[/,/\]/p' | grep -o '[0-9][0-9.eE+-]*' | tail -n +$((warmup + 1)); }
# The median (of an even count, the mean of the middle two: with two rounds, not the lower).
median() {
  sort -g "$1" | awk '{ v[NR] = $1 } END { print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
}

# TABLE_ONLY=1: print the table of a finished WORK_DIR again, running nothing.
if [ -n "${TABLE_ONLY:-}" ]; then
  runs=0
  echo "the table of $work again (nothing run)"
else
  echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $cores cores; model $model; $runs rounds; calibrated per $calibrate"
fi
if [ "$runs" -gt 0 ]; then
  for i in "${!plans[@]}"; do
    for f in times predicted plain even; do : >"${f}_$i.txt"; done
    # (written for ep plans only: absent means none)
    rm -f "loaded_$i.txt" "load_$i.txt" "loaded_memory_$i.txt"
  done
fi
for round in $(seq "$runs"); do
  # The round's profiles, and this host as a cluster (per plan: the cluster, once).
  if [ "$calibrate" = round ] || [ "$round" -eq 1 ]; then
    "$dtexec" calibrate --model "$model" --out "profile_1_$round.json" >/dev/null
    if [ "$cores" -ge 2 ]; then
      mpirun -np 2 "$dtexec" calibrate --model "$model" --out "profile_2_$round.json" \
        --cluster-out host >/dev/null
    else
      "$dtexec" calibrate --model "$model" --out "profile_2_$round.json" --cluster-out host \
        >/dev/null
    fi
    echo "round $round: compute jitter $(value jitter_cv <"profile_1_$round.json") (1 rank)," \
      "$(value jitter_cv <"profile_2_$round.json") (2 ranks); ranks' speed spread" \
      "$(value rank_spread_cv <"profile_2_$round.json")"
  fi
  for i in "${!plans[@]}"; do
    IFS='|' read -r ranks flags <<<"${plans[$i]}"
    wanted "$ranks" "$flags" || continue
    profile="profile_${ranks}_$round.json"
    if [ "$calibrate" = plan ]; then
      profile="profile_plan${i}_$round.json"
      if [ "$ranks" -gt 1 ]; then
        mpirun -np "$ranks" "$dtexec" calibrate --model "$model" --out "$profile" >/dev/null
      else
        "$dtexec" calibrate --model "$model" --out "$profile" >/dev/null
      fi
    fi
    # shellcheck disable=SC2086
    if [ "$ranks" -gt 1 ]; then
      mpirun -np "$ranks" "$dtexec" run --model "$model" "${batch[@]}" $flags \
        --steps "$steps" --warmup "$warmup" --json >"run_$i.json"
    else
      "$dtexec" run --model "$model" "${batch[@]}" $flags --steps "$steps" \
        --warmup "$warmup" --json >"run_$i.json"
    fi
    step_times <"run_$i.json" >>"times_$i.txt"
    # shellcheck disable=SC2086
    "$dtsim" simulate --model "$model" --cluster host/cpu-host.json --gpus "$ranks" \
      "${batch[@]}" $flags --precision fp32 --profile "$profile" --json |
      value step_time_s >>"predicted_$i.txt"
    # shellcheck disable=SC2086
    "$dtsim" simulate --model "$model" --cluster host/cpu-host.json --gpus "$ranks" \
      "${batch[@]}" $flags --precision fp32 --profile "$profile" --rank-spread-cv 0 --json |
      value step_time_s >>"even_$i.txt"
    # shellcheck disable=SC2086
    "$dtsim" simulate --model "$model" --cluster host/cpu-host.json --gpus "$ranks" \
      "${batch[@]}" $flags --precision fp32 --profile "$profile" --jitter-cv 0 \
      --rank-spread-cv 0 --json | value step_time_s >>"plain_$i.txt"
    # Expert parallelism: predicted again at the routing's measured load (--expert-load).
    if [[ "$flags" == *--ep* ]]; then
      load=$(value expert_load <"run_$i.json")
      # shellcheck disable=SC2086
      "$dtsim" simulate --model "$model" --cluster host/cpu-host.json --gpus "$ranks" \
        "${batch[@]}" $flags --precision fp32 --profile "$profile" --expert-load "$load" \
        --json | value step_time_s >>"loaded_$i.txt"
      echo "$load" >>"load_$i.txt"
      # Memory at the load of the run's busiest micro-batch (dtsim counts every micro-batch in
      # flight at the load given): the last round's.
      peak_load=$(value expert_load_peak <"run_$i.json")
      # shellcheck disable=SC2086
      echo "$peak_load $("$dtsim" memory --model "$model" --cluster host/cpu-host.json \
        --gpus "$ranks" "${batch[@]}" $flags --precision fp32 --framework-overhead-gib 0 \
        --expert-load "$peak_load" --json | last_value total_bytes)" >"loaded_memory_$i.txt"
    fi
  done
done

printf '%-56s %5s %13s %12s %16s %8s %13s %14s %20s\n' plan ranks predicted_ms measured_ms \
  "spread_ms" error "no_slow_rank" "no_stragglers" "memory_MiB"
worst_plain=0
worst=0
within=0
count=0
for i in "${!plans[@]}"; do
  IFS='|' read -r ranks flags <<<"${plans[$i]}"
  wanted "$ranks" "$flags" || continue
  measured=$(median "times_$i.txt")
  predicted=$(median "predicted_$i.txt")
  plain=$(median "plain_$i.txt")
  even=$(median "even_$i.txt")
  spread=$(sort -g "times_$i.txt" |
    awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%.0f-%.0f", lo * 1000, hi * 1000 }')
  error=$(awk -v p="$predicted" -v m="$measured" 'BEGIN { printf "%+.1f", (p / m - 1) * 100 }')
  error_plain=$(awk -v p="$plain" -v m="$measured" 'BEGIN { printf "%+.1f", (p / m - 1) * 100 }')
  error_even=$(awk -v p="$even" -v m="$measured" 'BEGIN { printf "%+.1f", (p / m - 1) * 100 }')
  worst=$(awk -v e="$error" -v w="$worst" 'BEGIN { e = e < 0 ? -e : e; print (e > w ? e : w) }')
  within=$((within + $(awk -v e="$error" 'BEGIN { e = e < 0 ? -e : e; print (e <= 15 ? 1 : 0) }')))
  count=$((count + 1))
  worst_plain=$(awk -v e="$error_plain" -v w="$worst_plain" \
    'BEGIN { e = e < 0 ? -e : e; print (e > w ? e : w) }')
  # Memory (the last round's run): the busiest rank's peak of tensors against dtsim memory.
  memory=$(awk -v m="$(value peak_bytes <"run_$i.json")" \
    -v p="$(value predicted_bytes <"run_$i.json")" \
    'BEGIN { printf "%.1f/%.1f %+.1f%%", m / 1048576, p / 1048576, (p / m - 1) * 100 }')
  printf '%-56s %5s %13.1f %12.1f %16s %7s%% %12s%% %13s%% %20s\n' "${flags:-(one rank)}" \
    "$ranks" "$(awk -v x="$predicted" 'BEGIN { print x * 1000 }')" \
    "$(awk -v x="$measured" 'BEGIN { print x * 1000 }')" "$spread" "$error" "$error_even" \
    "$error_plain" "$memory"
done
echo "within ±15%: $within of $count plans; worst |error|: ${worst}% (target 15%); without the" \
  "straggler model ${worst_plain}%"
for i in "${!plans[@]}"; do
  [ -f "loaded_$i.txt" ] || continue
  IFS='|' read -r ranks flags <<<"${plans[$i]}"
  loaded=$(median "loaded_$i.txt")
  memory=""
  if [ -f "loaded_memory_$i.txt" ]; then  # (not in a work directory from before 2026-12-06)
    read -r peak_load peak_predicted <"loaded_memory_$i.txt"
    memory="; memory at its busiest micro-batch's load ($peak_load): predicted $(awk \
      -v p="$peak_predicted" -v m="$(value peak_bytes <"run_$i.json")" \
      'BEGIN { printf "%.1f MiB, error %+.1f%%", p / 1048576, (p / m - 1) * 100 }')"
  fi
  echo "$flags at the measured expert load (median $(median "load_$i.txt")): predicted" \
    "$(awk -v x="$loaded" 'BEGIN { printf "%.1f", x * 1000 }') ms, error" \
    "$(awk -v p="$loaded" -v m="$(median "times_$i.txt")" \
      'BEGIN { printf "%+.1f%%", (p / m - 1) * 100 }')$memory"
done
