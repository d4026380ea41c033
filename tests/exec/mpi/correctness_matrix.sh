#!/bin/bash
# The executor's correctness matrix (issue 5): for plans over dp, tp, pp, cp, ep, ZeRO stages
# (ZeRO-1 also in place, --zero-in-place),
# schedules (GPipe, 1F1B, interleaved, zero-bubble; pipeline receives posted when reached or,
# with --overlap-p2p-comm, ahead of need), micro-batch counts, recompute and FlashAttention's
# memory (against the unfused single rank), K steps of ten tiny models (GPT, Llama, GPT with
# dropout, a mixture of experts, GPT with an odd vocabulary that the plans pad, Hugging Face
# qwen3_moe, qwen2_moe and llama4 configs, one llama4 with dense blocks between the experts',
# a glm4_moe with a dense first block, multi-head latent attention in a model file and in a
# deepseek_v3 config)
# under mpirun give the losses and final weights of the single-rank run of the same global
# batch (the first plan: one rank under mpirun, as without it).
#
# Tolerances (fp32): losses within 1e-5 (sums in another order differ by ~1e-7); weights within
# lr/3 = 1e-3. AdamW divides each gradient by its own running RMS, so an element whose gradient
# is ~0 moves by up to ~lr in one run and less in another when rounding differs: re-splitting
# the same batch into other micro-batches on ONE rank already moves weights by ~3e-4.
#
# usage: correctness_matrix.sh DTEXEC MPIRUN [WORKDIR]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/exec/mpi/plan_matrix.sh
source "$here/plan_matrix.sh"
setup_plan_matrix "$@"
steps=3
# A clipping limit no step reaches: the runs compute their gradients' global norm (and clip
# nothing), so that each step's norm is compared too, relative 1e-5 as clip_matrix.sh's (the
# losses and weights cannot see a gradient scaled by a constant: plan_matrix.sh).
common=(--steps "$steps" --lr 3e-3 --warmup 0 --global-batch-size 8 --clip-grad 1e20)
tolerances=(--loss-tolerance 1e-5 --weight-tolerance 1e-3)
norm_tolerance=1e-5
# tiny-gpt: GELU, LayerNorm, biases, tied embeddings (2 layers). The Llama-style fixture:
# SwiGLU, RMSNorm, grouped-query attention, untied head, 4 layers (pp 2 x 2 chunks). The dropout
# fixture: tiny-gpt with dropout (its masks follow each element's sequence and position, so
# every split draws the single rank's). The mixture of experts: 4 SwiGLU experts, top 2 (each
# expert's GEMMs on the rows the router sent it).
llama="$here/tiny_llama_4l.json"
dropout="$here/tiny_gpt_dropout.json"
moe="$here/tiny_moe.json"
# An odd vocabulary (251), padded to 256 rows by every plan (a multiple of 128 x tp): tp 2 splits
# the padded rows, and the runs train the single rank's model.
vocab251="$here/tiny_gpt_vocab251.json"
# A Hugging Face qwen3_moe config, as Qwen3-30B-A3B's: its heads twice as wide in all as the
# hidden size (the q, k and v projections widen the residual stream, o narrows it back),
# experts of moe_intermediate_size.
qwen3moe="$here/tiny_qwen3_moe.json"
# A Hugging Face qwen2_moe config, as Qwen1.5-MoE's: experts beside a shared expert, which adds
# their output to its own before the tp reduction (under sequence parallelism a region of its
# own: the block's input gathered, the sum reduce-scattered).
qwen2moe="$here/tiny_qwen2_moe.json"
# A Hugging Face llama4 config, as Llama 4 Scout's: its language model under text_config, each
# token to one expert beside a shared expert of the same width.
llama4="$here/tiny_llama4.json"
# A Hugging Face llama4 config, as Llama 4 Maverick's: experts in every other block, dense MLPs
# twice as wide between them.
maverick="$here/tiny_llama4_maverick.json"
# A Hugging Face glm4_moe config, as GLM-4.5's: a dense first block, then experts beside a
# shared one, q/k/v biases.
glm="$here/tiny_glm4_moe.json"
# Multi-head latent attention (DeepSeek-V2's): without a query latent and values wider than the
# keys (a model file, 4 layers); and a Hugging Face deepseek_v3 config, as DeepSeek-V3's: a query
# latent, a dense first block, then experts (sigmoid scores) beside a shared one.
mla="$here/tiny_mla.json"
dsv3="$here/tiny_deepseek_v3.json"
path_of() {
  case "$1" in
    llama) echo "$llama" ;;
    vocab251) echo "$vocab251" ;;
    qwen3moe) echo "$qwen3moe" ;;
    qwen2moe) echo "$qwen2moe" ;;
    llama4) echo "$llama4" ;;
    maverick) echo "$maverick" ;;
    glm) echo "$glm" ;;
    mla) echo "$mla" ;;
    dsv3) echo "$dsv3" ;;
    dropout) echo "$dropout" ;;
    moe) echo "$moe" ;;
    *) echo "$1" ;;
  esac
}

# One single-rank reference per model and micro-batch size.
for model in tiny-gpt llama dropout moe vocab251 qwen3moe qwen2moe llama4 maverick glm mla dsv3; do
  path=$(path_of "$model")
  for mbs in 1 2 4 8; do
    if [[ "$model" =~ ^(vocab251|qwen3moe|qwen2moe|llama4|maverick|glm|mla|dsv3)$ ]] &&
      [ "$mbs" != 2 ]; then
      continue
    fi
    rm -rf "ref_${model}_$mbs"
    "$dtexec" run --model "$path" "${common[@]}" --micro-batch-size "$mbs" \
      --checkpoint "ref_${model}_$mbs" --json >"ref_${model}_$mbs.json"
  done
done

# model | ranks | micro-batch size | plan flags   (micro-batches per replica = 8 / (mbs x dp))
plans=(
  "tiny-gpt|1|2|"
  "tiny-gpt|2|4|--dp 2"
  "tiny-gpt|4|2|--dp 4 --zero-stage 1"
  "tiny-gpt|2|1|--dp 2 --zero-stage 2"
  "tiny-gpt|2|1|--dp 2 --zero-stage 3 --recompute full"
  "tiny-gpt|4|1|--dp 4 --zero-stage 3"
  "tiny-gpt|2|8|--tp 2"
  "tiny-gpt|2|2|--tp 2 --recompute selective"
  "tiny-gpt|2|2|--tp 2 --no-overlap-tp-backward"
  "tiny-gpt|2|2|--pp 2 --schedule gpipe"
  "tiny-gpt|2|2|--pp 2 --schedule 1f1b --recompute full"
  "tiny-gpt|2|8|--pp 2 --schedule 1f1b"
  "tiny-gpt|2|2|--pp 2 --schedule 1f1b --overlap-p2p-comm"
  "tiny-gpt|4|1|--dp 2 --tp 2 --zero-stage 1"
  "tiny-gpt|4|1|--dp 2 --pp 2 --zero-stage 2"
  "tiny-gpt|4|1|--dp 2 --pp 2 --no-overlap-grad-reduce"
  "tiny-gpt|4|1|--tp 2 --pp 2 --schedule 1f1b --no-grad-accumulation-fusion"
  "tiny-gpt|4|2|--dp 2 --pp 2 --schedule gpipe"
  "tiny-gpt|4|2|--tp 2 --pp 2 --schedule gpipe --recompute selective"
  "tiny-gpt|4|1|--tp 2 --pp 2 --schedule 1f1b"
  "tiny-gpt|4|2|--tp 2 --pp 2 --schedule 1f1b --scatter-gather-p2p"
  "tiny-gpt|2|2|--tp 2 --sequence-parallel"
  "tiny-gpt|4|2|--dp 2 --tp 2 --sequence-parallel --zero-stage 2 --recompute full"
  "tiny-gpt|4|1|--tp 2 --pp 2 --sequence-parallel --schedule 1f1b"
  "tiny-gpt|2|2|--pp 2 --schedule zero-bubble"
  "tiny-gpt|4|1|--dp 2 --pp 2 --schedule zero-bubble --zero-stage 2"
  "tiny-gpt|4|1|--dp 2 --pp 2 --schedule zero-bubble --zero-stage 3"
  "llama|2|8|--tp 2"
  "llama|4|2|--tp 2 --pp 2 --schedule zero-bubble --sequence-parallel"
  "llama|4|2|--tp 2 --pp 2 --sequence-parallel --schedule interleaved --virtual-stages 2"
  "llama|2|2|--tp 2 --recompute full"
  "llama|2|2|--pp 2 --schedule 1f1b --layers-per-stage 3,1"
  "llama|2|2|--pp 2 --schedule zero-bubble --layers-per-stage 1,3"
  "llama|2|2|--pp 2 --schedule interleaved --virtual-stages 2"
  "llama|4|1|--dp 2 --pp 2 --schedule interleaved --virtual-stages 2 --zero-stage 1"
  "llama|4|1|--dp 2 --pp 2 --schedule interleaved --virtual-stages 2 --zero-stage 3"
  "llama|4|1|--dp 2 --pp 2 --schedule interleaved --virtual-stages 2 --overlap-p2p-comm"
  "llama|4|2|--dp 2 --tp 2 --zero-stage 3"
  "llama|4|4|--tp 2 --pp 2 --schedule gpipe"
  "tiny-gpt|2|2|--cp 2"
  "tiny-gpt|4|1|--cp 2 --dp 2 --zero-stage 1"
  "tiny-gpt|4|2|--cp 2 --tp 2 --sequence-parallel"
  "llama|2|2|--cp 2 --recompute selective"
  "llama|4|2|--cp 2 --pp 2 --schedule 1f1b --recompute full"
  "llama|4|1|--cp 2 --dp 2 --zero-stage 3"
  "llama|4|2|--cp 4"
  "dropout|2|8|--tp 2"
  "dropout|2|2|--tp 2 --sequence-parallel --recompute selective"
  "dropout|2|2|--pp 2 --schedule 1f1b --recompute full"
  "dropout|4|2|--tp 2 --cp 2 --sequence-parallel"
  "dropout|4|1|--dp 2 --pp 2 --schedule zero-bubble --zero-stage 2"
  "moe|2|4|--dp 2"
  "moe|2|4|--dp 2 --zero-stage 1"
  "moe|2|1|--dp 2 --zero-stage 3 --recompute full"
  "moe|2|2|--pp 2 --schedule zero-bubble"
  "moe|2|2|--cp 2 --no-grad-accumulation-fusion"
  "moe|4|1|--dp 2 --pp 2 --schedule 1f1b --zero-stage 2"
  "moe|2|2|--tp 2"
  "moe|4|1|--tp 2 --pp 2 --schedule zero-bubble --recompute full"
  "moe|4|1|--tp 2 --dp 2 --zero-stage 1"
  "moe|2|2|--tp 2 --sequence-parallel --recompute selective"
  "moe|4|1|--tp 2 --dp 2 --sequence-parallel --zero-stage 2"
  "moe|2|2|--dp 2 --ep 2"
  "moe|4|1|--tp 2 --dp 2 --ep 2 --sequence-parallel --schedule zero-bubble --recompute full"
  "moe|4|1|--tp 2 --pp 2 --sequence-parallel --schedule zero-bubble"
  "moe|4|1|--tp 2 --cp 2 --sequence-parallel"
  "moe|4|1|--dp 4 --ep 2 --zero-stage 1"
  "moe|4|1|--dp 4 --ep 2 --zero-stage 3 --recompute full"
  "moe|4|2|--dp 4 --ep 4 --no-grad-accumulation-fusion"
  "moe|4|1|--dp 2 --ep 2 --pp 2 --schedule zero-bubble"
  "moe|4|1|--dp 2 --ep 2 --cp 2"
  "moe|2|2|--dp 2 --ep 2 --zero-stage 1"
  "moe|2|1|--dp 2 --ep 2 --zero-stage 3 --recompute full"
  "moe|4|1|--dp 2 --ep 2 --pp 2 --schedule zero-bubble --zero-stage 2"
  "tiny-gpt|2|2|--dp 2 --zero-stage 1 --overlap-param-gather"
  "tiny-gpt|4|2|--dp 4 --zero-stage 1 --zero-in-place"
  "tiny-gpt|4|1|--dp 2 --pp 2 --zero-stage 1 --zero-in-place"
  "llama|4|2|--dp 2 --tp 2 --sequence-parallel --zero-stage 1 --zero-in-place --overlap-param-gather"
  "moe|4|1|--dp 4 --ep 2 --zero-stage 1 --zero-in-place"
  "tiny-gpt|4|1|--cp 2 --dp 2 --zero-stage 1 --zero-in-place"
  "moe|4|1|--dp 4 --ep 2 --zero-stage 2 --overlap-param-gather"
  "dropout|2|2|--tp 2 --sequence-parallel --attention flash"
  "llama|4|2|--cp 2 --pp 2 --schedule 1f1b --attention flash"
  "tiny-gpt|2|2|--pp 2 --schedule 1f1b --recompute selective --attention flash"
  "vocab251|2|2|--tp 2"
  "vocab251|4|2|--tp 2 --pp 2 --sequence-parallel"
  "qwen3moe|2|2|--tp 2"
  "qwen3moe|4|2|--tp 2 --dp 2 --ep 2 --sequence-parallel --zero-stage 1"
  "qwen3moe|4|2|--cp 2 --pp 2 --schedule 1f1b"
  "qwen2moe|2|2|--tp 2"
  "qwen2moe|2|2|--tp 2 --sequence-parallel --recompute selective"
  "qwen2moe|4|2|--tp 2 --dp 2 --ep 2 --sequence-parallel --zero-stage 1"
  "qwen2moe|4|2|--tp 2 --pp 2 --sequence-parallel --schedule zero-bubble"
  "llama4|4|2|--tp 2 --dp 2 --ep 2 --sequence-parallel --zero-stage 1"
  "llama4|4|2|--tp 2 --pp 2 --sequence-parallel --schedule 1f1b"
  "maverick|4|2|--tp 2 --dp 2 --ep 2 --sequence-parallel --zero-stage 1"
  "maverick|4|2|--tp 2 --pp 2 --sequence-parallel --schedule zero-bubble"
  "maverick|4|2|--dp 4 --ep 2 --zero-stage 3 --recompute full"
  "glm|4|2|--tp 2 --dp 2 --ep 2 --sequence-parallel --zero-stage 1"
  "glm|3|2|--pp 3 --schedule 1f1b"
  "mla|2|2|--dp 2 --zero-stage 1"
  "mla|2|2|--pp 2 --schedule zero-bubble --recompute full"
  "mla|4|2|--dp 2 --pp 2 --schedule interleaved --virtual-stages 2 --zero-stage 3"
  "mla|2|2|--dp 2 --zero-stage 2 --recompute selective --attention flash"
  "dsv3|4|2|--dp 4 --ep 2 --zero-stage 1"
  "dsv3|3|2|--pp 3 --schedule 1f1b --overlap-p2p-comm"
  "dsv3|2|2|--dp 2 --ep 2 --zero-stage 3 --recompute full"
  "mla|2|2|--tp 2 --recompute selective"
  "mla|4|2|--tp 2 --pp 2 --schedule zero-bubble"
  "dsv3|4|2|--tp 2 --dp 2 --ep 2 --zero-stage 1"
  "mla|2|2|--tp 2 --sequence-parallel --recompute full"
  "mla|4|2|--tp 2 --pp 2 --sequence-parallel --schedule zero-bubble"
  "mla|4|2|--tp 2 --dp 2 --sequence-parallel --zero-stage 3"
  "dsv3|2|2|--tp 2 --sequence-parallel --recompute selective --no-overlap-tp-backward"
  "dsv3|4|2|--tp 2 --dp 2 --ep 2 --sequence-parallel --zero-stage 1"
  "mla|2|2|--cp 2"
  "mla|2|2|--cp 2 --attention flash --recompute full"
  "mla|4|2|--cp 2 --tp 2 --sequence-parallel --recompute selective"
  "dsv3|4|2|--cp 2 --dp 2 --ep 2 --zero-stage 1"
)
failed=0
# Dropout's masks and the experts' routing follow each token, not the micro-batch: one rank's
# runs with micro-batches of 1 and 8 sequences train alike.
for model in dropout moe; do
  if ! "$dtexec" compare "ref_${model}_1" "ref_${model}_8" --loss-tolerance 1e-5 \
      --weight-tolerance 1e-3 >/dev/null; then
    echo "DIFFERENT: $model, one rank, micro-batch 1 against 8"
    failed=1
  fi
done
run_plan_matrix "${plans[@]}" || failed=1
exit $failed
