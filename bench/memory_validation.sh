#!/bin/bash
# dtsim memory against what dtexec holds, plan by plan, on this CPU host: for each plan, one
# short dtexec run (fp32; its busiest rank's peak of tensor bytes, read from --json) beside
# the figure dtexec prints from dtsim's memory model for the same plan (its busiest stage,
# without the framework allowance). Memory is exact bookkeeping, not a timing, so two steps
# and one round are enough; the whole table takes a few minutes on two cores.
#
# The plans cover what changes the memory model's terms: the in-flight micro-batches of each
# schedule at 2 and 8 micro-batches, pipeline receives posted ahead, recompute, ZeRO 1-3,
# tensor, sequence, context and expert parallelism, and FlashAttention's memory. With a mixture-of-experts MODEL the MoE
# terms (the copies' outputs kept for the gates' gradient, routing) are in play too.
#
# usage: [MODEL=cpu-small] [ONLY=REGEX] bench/memory_validation.sh [BUILD_DIR] [WORK_DIR]
set -euo pipefail
# shellcheck source=bench/setup.sh
source "$(dirname "$0")/setup.sh" "$@"

# ranks | global batch (micro-batch 4) | plan flags
plans=(
  "1|8|"
  "1|8|--recompute selective"
  "1|8|--recompute full"
  "2|8|--dp 2"
  "2|8|--dp 2 --zero-stage 1"
  "2|8|--dp 2 --zero-stage 1 --overlap-param-gather"
  "2|8|--dp 2 --zero-stage 1 --recompute full"
  "2|8|--dp 2 --zero-stage 2"
  "2|16|--dp 2"
  "2|16|--dp 2 --zero-stage 1"
  "2|16|--dp 2 --zero-stage 2"
  "2|16|--dp 2 --zero-stage 3"
  "4|16|--pp 2 --dp 2 --zero-stage 2"
  "4|32|--pp 2 --dp 2 --schedule interleaved --virtual-stages 2 --zero-stage 2"
  "2|8|--dp 2 --zero-stage 3"
  "2|8|--dp 2 --zero-stage 3 --recompute full"
  "2|8|--tp 2"
  "2|8|--tp 2 --sequence-parallel"
  "2|8|--tp 2 --recompute full"
  "2|8|--pp 2 --schedule gpipe"
  "2|8|--pp 2 --schedule 1f1b"
  "2|8|--pp 2 --schedule 1f1b --recompute full"
  "2|8|--pp 2 --schedule zero-bubble"
  "2|32|--pp 2 --schedule 1f1b"
  "2|32|--pp 2 --schedule 1f1b --overlap-p2p-comm"
  "2|32|--pp 2 --schedule gpipe"
  "2|32|--pp 2 --schedule zero-bubble"
  "2|32|--pp 2 --schedule interleaved --virtual-stages 2"
  "2|8|--cp 2"
  "1|8|--attention flash"
  "2|8|--pp 2 --schedule 1f1b --attention flash"
  "2|8|--tp 2 --sequence-parallel --attention flash"
  "2|8|--dp 2 --ep 2"
  "4|8|--tp 2 --dp 2 --ep 2"
)

printf '%-52s %5s %4s %12s %13s %8s\n' plan ranks gbs measured_MiB predicted_MiB error
worst=0
for i in "${!plans[@]}"; do
  IFS='|' read -r ranks gbs flags <<<"${plans[$i]}"
  if [ -z "$moe" ] && [[ "$flags" == *--ep* ]]; then continue; fi
  if [ -n "${ONLY:-}" ] && ! [[ "$flags" =~ $ONLY ]]; then continue; fi
  # shellcheck disable=SC2086
  if ! mpirun -np "$ranks" "$dtexec" run --model "$model" --micro-batch-size 4 \
    --global-batch-size "$gbs" $flags --steps 2 --warmup 1 --json >"run_$i.json" \
    2>"run_$i.err" </dev/null; then
    echo "memory_validation.sh: dtexec run failed for '$flags' (see $work/run_$i.err)" >&2
    exit 1
  fi
  measured=$(value peak_bytes <"run_$i.json")
  predicted=$(value predicted_bytes <"run_$i.json")
  error=$(awk -v p="$predicted" -v m="$measured" 'BEGIN { printf "%+.1f", (p / m - 1) * 100 }')
  worst=$(awk -v e="$error" -v w="$worst" 'BEGIN { e = e < 0 ? -e : e; print (e > w ? e : w) }')
  printf '%-52s %5s %4s %12.2f %13.2f %7s%%\n' "${flags:-(one rank)}" "$ranks" "$gbs" \
    "$(awk -v x="$measured" 'BEGIN { print x / 1048576 }')" \
    "$(awk -v x="$predicted" 'BEGIN { print x / 1048576 }')" "$error"
done
echo "worst |error| (predicted against measured): ${worst}%"
