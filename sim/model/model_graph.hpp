// ModelGraph: the model as a DAG of operations (Boost.Graph behind this header), each with its
// forward and backward FLOPs, memory traffic, parameters and the activations it saves for the
// backward pass, for one micro-batch of `micro_batch` sequences of `seq_len` tokens.
//
// Conventions (README "Metrics"):
// - FLOPs count multiply and add separately: a GEMM of (m x k) by (k x n) is 2·m·k·n FLOPs.
//   Only matrix multiplications are counted as FLOPs (as Megatron-LM's formula does); norms,
//   activations and residual adds have 0 FLOPs and are costed by their memory traffic.
// - Attention scores are counted dense (no causal halving), as in Megatron-LM's formula.
// - Saved activations follow Korthikanti et al. 2022 §4.1 (16-bit tensors, 1-byte dropout
//   masks), generalised to GQA, SwiGLU and MoE; with FlashAttention the attention core keeps
//   no s² tensor (Dao et al. 2022).
// - Work is for the whole op, before any parallel split; the plan divides it.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sim/model/model_spec.hpp"

namespace dtsim::model {

enum class OpKind {
  Embedding,
  Norm,
  QkvProj,
  AttentionCore,
  AttnOutProj,
  Residual,
  MlpUp,
  Activation,
  MlpDown,
  Router,
  // Multi-head latent attention's down projection to its latents (ModelSpec::latent_width),
  // replicated over tp (MlaSpec).
  LatentDown,
  LmHead,
  LossStatistics,  // the softmax statistics of the logits, which tensor parallelism reduces
  Loss
};

// How Megatron-LM tensor parallelism splits an op: weight columns (QKV, MLP up), weight rows
// (attention output, MLP down), attention heads, the vocabulary, or not at all (norms, residual).
enum class TpSplit { None, Column, Row, Heads, Vocab };

using OpId = std::size_t;

struct Op {
  std::string name;  // "L3.qkv", "embedding", "lm_head"
  OpKind kind = OpKind::Norm;
  int layer = 0;        // -1: before the first block; spec.layers: after the last block
  bool expert = false;  // inside an MoE expert: split over expert-parallel ranks
  TpSplit tp_split = TpSplit::None;

  double fwd_flops = 0;         // matrix-multiply FLOPs of the forward pass
  double bwd_input_flops = 0;   // gradient with respect to the op's inputs
  double bwd_weight_flops = 0;  // gradient with respect to its weights
  double fwd_bytes = 0;         // device-memory bytes read + written by the forward kernels
  // Of fwd_bytes, the weights read (an MoE GEMM: every expert's). Tensor parallelism splits
  // them like the op, expert parallelism an expert's; context parallelism does not (every
  // context-parallel rank reads all its weights).
  double weight_bytes = 0;
  double bwd_bytes = 0;  // same for the backward kernels
  // Bytes that kernels of their own move beside the op's (an MoE's token permutation at its
  // router, the weighted combine at its experts' down projection), whole op: memory-bound,
  // priced after the op's own kernels rather than under their roofline, and split like the
  // tokens they move (over cp, and over tp only with sequence parallelism). The backward's run
  // in the input-gradient pass.
  double fwd_move_bytes = 0;
  double bwd_move_bytes = 0;
  // The FLOPs the kernels execute where they are not the counted ones above (0: as counted):
  // FlashAttention skips the key blocks that the causal mask hides, and its backward computes
  // the scores again. The counted FLOPs stay the model's (Megatron-LM's formula: dense, no
  // recompute), for MFU.
  double kernel_fwd_flops = 0;
  double kernel_bwd_flops = 0;
  // What the kernels execute: kernel_*_flops where set, else the counted FLOPs.
  double executed_fwd_flops() const { return kernel_fwd_flops > 0 ? kernel_fwd_flops : fwd_flops; }
  double executed_bwd_flops() const {
    return kernel_bwd_flops > 0 ? kernel_bwd_flops : bwd_input_flops + bwd_weight_flops;
  }
  std::uint64_t params = 0;
  // Of `params`, those that tensor parallelism does not split (norm weights, biases of
  // row-parallel layers, learned position embeddings): every tp rank holds them whole.
  std::uint64_t tp_replicated_params = 0;
  // The width per token of the tensor that enters the op's tensor-parallel region before it
  // (gathered first under sequence parallelism; its gradient reduced after the op's backward):
  // 0 for the hidden width (the block's normed input); multi-head latent attention's up
  // projections take their latents.
  std::uint64_t tp_enter_width = 0;
  // For matrix multiplications: the forward GEMM's shape, (m x k) by (k x n), whole op.
  double gemm_m = 0, gemm_n = 0, gemm_k = 0;

  // Bytes of activations kept from forward to backward. `saved_quadratic_bytes` is the part
  // that grows with seq_len² (softmax, dropout mask and output of attention): what selective
  // recompute drops. `saved_tp_split`: the tensors live inside the tensor-parallel region and
  // are split over tp ranks even without sequence parallelism. `saved_tp_whole_bytes`: the
  // part of `saved_bytes` that every tp rank keeps whole, sequence parallelism or not (split
  // only over cp).
  std::uint64_t saved_bytes = 0;
  std::uint64_t saved_quadratic_bytes = 0;
  std::uint64_t saved_tp_whole_bytes = 0;
  bool saved_tp_split = false;
};

struct GraphTotals {
  std::uint64_t params = 0;
  double fwd_flops = 0;
  double bwd_flops = 0;  // input + weight gradients
  std::uint64_t saved_bytes = 0;
};

class ModelGraph {
 public:
  // activation_bytes: bytes per element of saved activations (2 for bf16/fp16 training);
  // attention: the attention core's kernels (a plan's; plan::graph_of builds a plan's graph).
  ModelGraph(ModelSpec spec, std::int64_t micro_batch, std::int64_t seq_len,
             int activation_bytes = 2, AttentionKernel attention = AttentionKernel::Unfused);
  ~ModelGraph();
  ModelGraph(ModelGraph&&) noexcept;
  ModelGraph& operator=(ModelGraph&&) noexcept;

  const ModelSpec& spec() const { return spec_; }
  std::int64_t micro_batch() const { return micro_batch_; }
  std::int64_t seq_len() const { return seq_len_; }
  AttentionKernel attention() const { return attention_; }

  std::size_t size() const { return ops_.size(); }
  const Op& op(OpId id) const { return ops_.at(id); }
  const std::vector<Op>& ops() const { return ops_; }

  // All ops, each after the ops it depends on.
  const std::vector<OpId>& topological_order() const { return topo_; }
  std::vector<OpId> predecessors(OpId id) const;
  std::vector<OpId> successors(OpId id) const;

  // Ops of one layer group, for pipeline partitioning: -1 = embedding, 0..L-1 = blocks,
  // L = final norm, LM head, loss statistics and loss.
  const std::vector<OpId>& layer_ops(int layer) const;
  GraphTotals layer_totals(int layer) const;
  GraphTotals totals() const;

 private:
  struct Impl;  // the Boost.Graph adjacency list
  ModelSpec spec_;
  std::int64_t micro_batch_;
  std::int64_t seq_len_;
  AttentionKernel attention_;
  std::vector<Op> ops_;
  std::vector<std::vector<OpId>> groups_;  // index layer + 1
  std::vector<OpId> topo_;
  std::unique_ptr<Impl> impl_;
};

// Parameters of the whole model (independent of batch and sequence length).
std::uint64_t count_params(const ModelSpec& spec);

// Whether `params` equals spec.published_params once rounded to the publication's precision
// (exact when the publication gives every digit). False when nothing was published.
bool matches_published_params(const ModelSpec& spec, std::uint64_t params);

// Megatron-LM (Narayanan et al. 2021, Eq. 3 and §5.1) model FLOPs per token for the classic GPT
// block: training without recompute 72·l·h²·(1 + s/(6h) + V/(12·l·h)) and with full recompute
// 96·l·h²·(1 + s/(6h) + V/(16·l·h)). Only meaningful when spec.is_megatron_gpt().
double megatron_train_flops_per_token(const ModelSpec& spec, std::int64_t seq_len,
                                      bool full_recompute);

std::string_view to_string(OpKind kind);

}  // namespace dtsim::model
