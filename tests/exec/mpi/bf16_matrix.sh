#!/bin/bash
# The GPU's mixed precision over MPI ranks, emulated on the CPU (`--precision bf16`: bf16
# activations with the GPU device's type checks; the MPI backend moves bf16 tensors and sums
# them in bf16, rounding at each step as NCCL does): plans over dp, tp with and without sequence
# parallelism, pp (GPipe, 1F1B, interleaved, zero-bubble, scatter/gather transfers), cp, ZeRO 1-3,
# recompute, dropout (the GPU's: residual and attention dropout, the CPU's masks), a mixture
# of experts with expert parallelism (bf16 tokens through the all-to-alls) and multi-head latent
# attention (a deepseek_v3 config: its packing and narrower values in bf16) run to the end, and
# K steps train as the single-rank bf16 run of the same batch.
#
# Tolerances (bf16): losses within 5e-3. A split changes where bf16 rounds (a row-parallel
# layer's partial sums are rounded before their all-reduce), about 2^-8 relative per rounding;
# measured: tp 2 moves the losses by 1.2e-3 at most, dp and pp by ~1e-5. Weights within
# 2·K·lr = 0.018: AdamW moves an element by about lr per step whatever its gradient's size, so
# two runs whose roundings differ can part by up to that; this bound only catches a run gone
# wrong (NaN, a lost reduction's drift over steps shows in the losses first).
#
# usage: bf16_matrix.sh DTEXEC MPIRUN [WORKDIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/exec/mpi/plan_matrix.sh
source "$here/plan_matrix.sh"
setup_plan_matrix "$@"
steps=3
common=(--steps "$steps" --lr 3e-3 --warmup 0 --global-batch-size 8 --precision bf16)
tolerances=(--loss-tolerance 5e-3 --weight-tolerance 0.018)
path_of() {
  case "$1" in
    llama) echo "$here/tiny_llama_4l.json" ;;
    dropout) echo "$here/tiny_gpt_dropout.json" ;;
    moe) echo "$here/tiny_moe.json" ;;
    dsv3) echo "$here/tiny_deepseek_v3.json" ;;
    *) echo "$1" ;;
  esac
}

for model in tiny-gpt llama dropout moe dsv3; do
  for mbs in 1 2; do
    rm -rf "ref_${model}_$mbs"
    "$dtexec" run --model "$(path_of "$model")" "${common[@]}" --micro-batch-size "$mbs" \
      --checkpoint "ref_${model}_$mbs" >/dev/null
  done
done

# model | ranks | micro-batch size | plan flags
plans=(
  "tiny-gpt|2|2|--dp 2"
  "tiny-gpt|4|1|--dp 4 --zero-stage 1"
  "tiny-gpt|4|1|--dp 2 --pp 2 --zero-stage 1 --zero-in-place"
  "tiny-gpt|2|1|--dp 2 --zero-stage 3 --recompute full"
  "tiny-gpt|2|2|--tp 2 --no-overlap-tp-backward --no-grad-accumulation-fusion"
  "tiny-gpt|4|1|--tp 2 --pp 2 --schedule 1f1b"
  "tiny-gpt|4|2|--tp 2 --pp 2 --schedule gpipe --scatter-gather-p2p"
  "tiny-gpt|4|2|--dp 2 --tp 2 --sequence-parallel --zero-stage 2 --recompute selective"
  "llama|2|2|--pp 2 --schedule zero-bubble --overlap-p2p-comm"
  "llama|4|2|--tp 2 --pp 2 --sequence-parallel --schedule interleaved --virtual-stages 2"
  "llama|4|1|--dp 2 --tp 2 --zero-stage 3"
  "dropout|2|2|--tp 2 --sequence-parallel --recompute selective"
  "dropout|4|2|--dp 2 --pp 2 --schedule zero-bubble --zero-stage 2"
  "tiny-gpt|2|2|--cp 2"
  "llama|4|2|--cp 2 --tp 2 --sequence-parallel --recompute selective"
  "dropout|2|2|--cp 2"
  "moe|2|2|--tp 2 --sequence-parallel"
  "moe|2|2|--dp 2 --ep 2"
  "moe|4|1|--dp 2 --ep 2 --pp 2 --schedule zero-bubble"
  "dsv3|3|2|--pp 3 --schedule 1f1b --recompute selective"
  "dsv3|2|1|--dp 2 --ep 2 --zero-stage 1 --attention flash"
  "dsv3|2|2|--tp 2 --no-grad-accumulation-fusion"
  "dsv3|2|2|--tp 2 --sequence-parallel"
  "dsv3|2|2|--cp 2"
)
failed=0
run_plan_matrix "${plans[@]}" || failed=1
exit $failed
