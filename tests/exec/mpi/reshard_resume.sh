#!/bin/bash
# A checkpoint resumes under another plan (after losing nodes, or to change the split): each
# rank reads its slices of the full tensors from the shards that another plan's ranks wrote.
# Each chain trains 6 steps in three legs of two, each leg under another plan (tp, pp,
# interleaving, sequence and context parallelism, ZeRO 1-3, ZeRO-1 in place (whose slices cut
# tensors where a bucket's parts end), experts over ep), resuming the
# previous leg's checkpoint, with a warm-up and a cosine decay over the whole run; its final
# checkpoint equals the uninterrupted single-rank run's within the correctness matrix's fp32
# tolerances (losses 1e-5, weights 1e-3: the sums run in other orders, so not bitwise).
#
# usage: reshard_resume.sh DTEXEC MPIRUN [WORKDIR]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/exec/mpi/plan_matrix.sh
source "$here/plan_matrix.sh"
setup_plan_matrix "$@"
common=(--warmup 0 --global-batch-size 8 --lr-warmup-steps 2 --lr-decay-style cosine
  --lr-decay-steps 6 --min-lr 3e-4)
path_of() {
  case "$1" in
    llama) echo "$here/tiny_llama_4l.json" ;;
    moe) echo "$here/tiny_moe.json" ;;
    *) echo "$1" ;;
  esac
}
# model | micro-batch size | three legs "ranks:plan flags"
chains=(
  "tiny-gpt|2|4:--dp 2 --pp 2 --zero-stage 1 --zero-in-place|4:--tp 2 --dp 2 --sequence-parallel --zero-stage 3|1:"
  "llama|2|4:--tp 2 --pp 2 --schedule interleaved --virtual-stages 2|4:--dp 4 --zero-stage 2|2:--cp 2"
  "moe|1|4:--dp 4 --ep 2 --zero-stage 1|4:--tp 2 --dp 2 --ep 2 --sequence-parallel|2:--pp 2"
  "tiny-gpt|1|2:--dp 2 --zero-stage 1|4:--dp 4 --zero-stage 1 --zero-in-place|2:--dp 2 --zero-stage 1 --zero-in-place"
)
failed=0
for chain in "${chains[@]}"; do
  IFS='|' read -r model mbs leg1 leg2 leg3 <<<"$chain"
  rm -rf ref resumed resumed.old
  "$dtexec" run --model "$(path_of "$model")" "${common[@]}" --steps 6 --micro-batch-size "$mbs" \
    --checkpoint ref >/dev/null || { echo "FAILED: $model single rank"; failed=1; continue; }
  steps=0
  for leg in "$leg1" "$leg2" "$leg3"; do
    ranks=${leg%%:*}
    flags=${leg#*:}
    steps=$((steps + 2))
    resume=()
    [ "$steps" -gt 2 ] && resume=(--resume resumed)
    # shellcheck disable=SC2086
    if ! timeout 300 "$mpirun" -np "$ranks" "$dtexec" run --model "$(path_of "$model")" \
        "${common[@]}" --steps "$steps" --micro-batch-size "$mbs" $flags "${resume[@]}" \
        --checkpoint resumed >leg.log 2>&1 </dev/null; then
      echo "FAILED: $model, leg to step $steps ($ranks ranks, $flags)"
      cat leg.log
      failed=1
      continue 2
    fi
    if [ "$steps" -gt 2 ] && ! grep -q "note: resuming a checkpoint of another plan" leg.log; then
      echo "FAILED: $model, leg to step $steps: no note of the plan change"
      cat leg.log
      failed=1
    fi
  done
  if out=$("$dtexec" compare ref resumed --loss-tolerance 1e-5 --weight-tolerance 1e-3); then
    result=ok
  else
    result=DIFFERENT
    failed=1
  fi
  printf '%-9s %s -> %s -> %s: %s  %s\n' "$model" "$leg1" "$leg2" "$leg3" \
    "$(tr '\n' ' ' <<<"$out")" "$result"
done
exit $failed
