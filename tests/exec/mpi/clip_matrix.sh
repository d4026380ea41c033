#!/bin/bash
# Gradient clipping by global norm (--clip-grad) under mpirun: for plans that split the
# gradients every way the norm must count them once (ZeRO slices, dp replicas, tp-split and
# tp-replicated tensors, sequence-parallel norms, the tied embedding on two stages, experts
# over ep and their expert-dp replicas, cp), each step's norm before clipping equals the
# single rank's (relative 1e-5: fp32 sums in another order), and the losses and weights of K
# clipped steps equal its too (the correctness matrix's tolerances). The limit, 0.5, is under
# every step's norm, so every step clips. AdamW's weight decay (0.1, on matrices only) is on:
# its choice of tensors must hold on every split of them too.
#
# usage: clip_matrix.sh DTEXEC MPIRUN [WORKDIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/exec/mpi/plan_matrix.sh
source "$here/plan_matrix.sh"
setup_plan_matrix "$@"
common=(--steps 3 --lr 3e-3 --warmup 0 --global-batch-size 8 --clip-grad 0.5 --weight-decay 0.1)
tolerances=(--loss-tolerance 1e-5 --weight-tolerance 1e-3)
path_of() {
  case "$1" in
    llama) echo "$here/tiny_llama_4l.json" ;;
    moe) echo "$here/tiny_moe.json" ;;
    *) echo "$1" ;;
  esac
}

plans=(
  "tiny-gpt|2|2|--dp 2"
  "tiny-gpt|2|2|--dp 2 --zero-stage 1"
  "tiny-gpt|2|2|--dp 2 --zero-stage 3"
  "tiny-gpt|2|2|--tp 2"
  "tiny-gpt|2|2|--tp 2 --sequence-parallel"
  "tiny-gpt|2|2|--pp 2 --schedule 1f1b"
  "tiny-gpt|4|1|--dp 2 --tp 2 --zero-stage 1"
  "tiny-gpt|4|1|--dp 2 --pp 2 --zero-stage 2"
  "tiny-gpt|4|2|--tp 2 --pp 2 --sequence-parallel"
  "tiny-gpt|4|1|--cp 2 --dp 2 --zero-stage 1"
  "llama|4|2|--tp 2 --pp 2 --schedule interleaved --virtual-stages 2"
  "llama|4|2|--dp 2 --tp 2 --zero-stage 3"
  "moe|2|2|--dp 2 --ep 2"
  "moe|4|1|--dp 4 --ep 2 --zero-stage 1"
  "moe|4|1|--tp 2 --dp 2 --ep 2 --sequence-parallel"
  "moe|4|1|--dp 2 --ep 2 --cp 2"
)
failed=0
rm -rf ref_* run  # a reused work folder's references may be another version's
printf '%-9s %-62s %9s %9s  %s\n' model plan norm_diff loss_diff result
for entry in "${plans[@]}"; do
  IFS='|' read -r model ranks mbs flags <<<"$entry"
  ref="ref_${model}_$mbs"
  if [ ! -d "$ref" ]; then
    "$dtexec" run --model "$(path_of "$model")" "${common[@]}" --micro-batch-size "$mbs" \
      --checkpoint "$ref" --json >"$ref.log" </dev/null
  fi
  rm -rf run
  # shellcheck disable=SC2086
  if ! timeout 300 "$mpirun" -np "$ranks" "$dtexec" run --model "$(path_of "$model")" \
      "${common[@]}" --micro-batch-size "$mbs" $flags --checkpoint run --json >run.log 2>&1 \
      </dev/null; then
    echo "FAILED to run: $model $flags"
    cat run.log
    failed=1
    continue
  fi
  # Each step's norm against the single rank's; every step clipped (norm over 0.5).
  norm_diff=$(norm_diff "$(norms "$ref.log")" "$(norms run.log)" 0.5)
  result=ok
  if [ "$(norms "$ref.log" | wc -w)" -ne 3 ] || ! within "$norm_diff" 1e-5; then result=DIFFERENT; fi
  if ! out=$("$dtexec" compare "$ref" run "${tolerances[@]}"); then result=DIFFERENT; fi
  loss=$(sed -n 's/.*largest loss difference \([^;]*\);.*/\1/p' <<<"$out")
  [ "$result" = ok ] || failed=1
  printf '%-9s %-62s %9s %9s  %s\n' "$model" "$flags --micro-batch-size $mbs" "$norm_diff" \
    "$loss" "$result"
done
exit $failed
