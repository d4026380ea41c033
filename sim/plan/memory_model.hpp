// Memory per rank: model states (weights, gradients, optimizer states; ZeRO stages 0-3),
// activations (Korthikanti et al. 2022) times the micro-batches the schedule keeps in flight,
// and other buffers. DESIGN.md "Modeling rules: Memory".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sim/cluster/topology.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::plan {

// Bytes per parameter of each model state. Mixed precision (bf16/fp16/fp8) with Adam follows
// Rajbhandari et al. 2020 (ZeRO) §3.1: 2 (16-bit weights) + 2 (16-bit gradients) + K = 12
// (fp32 master weights, momentum, variance), with the gradients in the plan's gradient
// precision (gradient_precision(): fp32 with bf16, as Megatron-LM keeps them, 4 bytes and 18 per
// parameter in all). fp32 training keeps 4 + 4 and Adam's 8; SGD with momentum keeps one fp32
// state (plus the master copy under mixed precision). fp8 training keeps 16-bit weights
// (Transformer Engine casts to fp8 per GEMM).
struct StateBytesPerParam {
  double weights = 0;
  double gradients = 0;
  double optimizer = 0;
};
StateBytesPerParam state_bytes_per_param(const Plan& plan);
// Bytes per gradient element as a reduction sends it (the dp buckets, the tied embedding's and
// the sequence-parallel norms' all-reduces): the plan's comm_precision where it has one, else as
// the gradients are kept.
double gradient_wire_bytes(const Plan& plan);

// Model-state bytes on one data-parallel rank holding `params` parameters, ZeRO stage 0-3 over
// `dp` ranks (ZeRO Table 1): stage 1 divides optimizer states, 2 also gradients, 3 also weights.
// estimate_memory shards over every rank that holds the same weights, as Megatron-LM's
// distributed optimizer does: dp x cp ranks for dense weights, dp x cp / ep for experts.
struct ModelStates {
  double weights = 0;
  double gradients = 0;
  double optimizer = 0;
  double total() const { return weights + gradients + optimizer; }
};
ModelStates zero_model_states(double params, int zero_stage, int dp, StateBytesPerParam bytes);

// Activations that one transformer block keeps for one micro-batch on one rank (Korthikanti
// et al. Table 2, generalised by summing the ModelGraph's saved tensors): split over tp where
// the tensor lives in the tensor-parallel region (over tp everywhere with sequence
// parallelism), over cp always; selective recompute drops the s² attention terms; full
// recompute keeps only the block's input.
double block_activation_bytes(const model::ModelGraph& graph, int layer, const Plan& plan);

// Micro-batches (for the interleaved schedule: model chunks) whose activations `stage` holds at
// its peak: GPipe m; 1F1B and zero-bubble min(pp - stage, m) (Narayanan et al. 2021); PipeDream
// pp - stage whatever m, as its steady step keeps the pipeline full across steps (Narayanan et
// al. 2019: the next step's micro-batches enter before this one's drain); interleaved
// min(2·(pp - stage - 1) + (v - 1)·pp + 1, m·v) chunks (Megatron-LM's warm-up).
// Without pipelining, one.
std::int64_t in_flight(const Plan& plan, int stage);

// Weight versions `stage` keeps: PipeDream stashes, for the backward of each micro-batch in
// flight, the weights its forward used (Narayanan et al. 2019, weight stashing); its step
// updates the weights once every m micro-batches, as PipeDream-2BW does (Narayanan et al.
// 2021, "Memory-Efficient Pipeline-Parallel DNN Training"), so the pp - stage consecutive
// micro-batches in flight span 1 + ceil((pp - stage - 1) / m) versions: pp - stage at one
// micro-batch a step, 2 (2BW's double buffer) from m >= pp - stage - 1. Other schedules: 1.
std::int64_t weight_versions(const Plan& plan, int stage);

// Micro-batches whose embedding activations (stage 0) or head and loss activations (the last
// stage) `stage` holds at its peak; 0 on the stages between. Without interleaving, in_flight().
// Interleaved, from Megatron-LM's order (forward k runs chunk (k/pp) % v, backward k chunk
// v-1 - (k/pp) % v; stage s warms up with 2·(pp-s-1) + (v-1)·pp forwards):
// - last stage: its warm-up covers chunks 0..v-2 only; from then on each step's forward and
//   backward are of the same chunk, so a head-chunk forward is followed by its backward: 1.
// - stage 0: micro-batches 0..pp-1 of chunk 0 run as forwards 0..pp-1, pp..2pp-1 as forwards
//   v·pp..(v+1)·pp-1; the first chunk-0 backward (backward (v-1)·pp) comes after forward
//   2·v·pp-2, so all 2·pp are in flight, and the next chunk-0 forward (2·v·pp) comes after it:
//   min(2·pp, m).
// When the warm-up covers all m·v forwards, every chunk holds all m.
std::int64_t end_in_flight(const Plan& plan, int stage);

// The framework allowance where neither the options nor the device give one: 1 GiB for the
// CUDA context, library workspaces (cuBLAS, NCCL) and allocator fragmentation. A dtsim
// assumption, not a measurement.
inline constexpr double kDefaultFrameworkOverheadBytes = 1.0 * 1024 * 1024 * 1024;

struct MemoryOptions {
  // An allowance for what a rank holds beside its tensors; unset: the device's
  // (DeviceSpec::framework_overhead_bytes), else kDefaultFrameworkOverheadBytes. Override with
  // --framework-overhead-gib, or calibrate on the target system.
  std::optional<double> framework_overhead_bytes;
  std::optional<double> capacity_bytes;  // overrides the device's memory
};

struct StageMemory {
  int stage = 0;
  int layers = 0;  // transformer blocks on this rank
  std::int64_t in_flight = 0;
  // Zero-bubble: deferred weight-gradient passes held at the stage's peak (each keeps its GEMMs'
  // inputs and output gradients); 0 for the other schedules.
  std::int64_t weight_passes_held = 0;
  // PipeDream: weight versions stashed (weights_bytes counts them all); 1 for the others.
  std::int64_t weight_versions = 1;
  double weights_bytes = 0;
  double gradients_bytes = 0;
  double optimizer_bytes = 0;
  double activations_bytes = 0;
  // The moment of the stage's peak: "the forward's end", "the backward", or with ZeRO a
  // gradient reduce-scatter's (ZeRO-3: a block's or the head's; ZeRO-1: the step's, when
  // the stage keeps no activations).
  std::string peak_moment;
  // What that moment adds to activations_bytes beyond the tensors kept from forward to
  // backward: at the forward's end, the last stage's logits while the loss reads them; in the
  // backward, an MLP activation's gradients or a block recomputed (there the last stage has
  // freed one micro-batch's head and loss tensors, which activations_bytes leaves out).
  double working_bytes = 0;
  // What they are at that moment, in words ("an MLP activation's gradients"); empty with none.
  std::string working_tensors;
  double other_bytes = 0;
  double total_bytes = 0;
  std::string dominant;  // the largest term
};

struct MemoryReport {
  std::vector<StageMemory> stages;  // one per pipeline stage (ranks of a stage are alike)
  int worst_stage = 0;
  double capacity_bytes = 0;
  bool fits = false;
  double margin_bytes = 0;  // capacity - worst total (negative when it does not fit)
  std::vector<std::string> notes;
  const StageMemory& worst() const { return stages.at(static_cast<std::size_t>(worst_stage)); }
};

// `graph` must be built for the plan (graph_of: its micro-batch, sequence length and attention
// kernel). The plan must be valid.
MemoryReport estimate_memory(const model::ModelGraph& graph, const Plan& plan,
                             const cluster::Cluster& cluster, const MemoryOptions& options = {});

int activation_bytes_per_element(Precision precision);

// The graph a plan runs: `spec` with the plan's padded vocabulary (with_padded_vocab), its
// micro-batch, sequence length, activation width and attention kernel.
model::ModelGraph graph_of(const model::ModelSpec& spec, const Plan& plan);

// Parameters of `op` held by one rank: tensor-parallel ops split all but their replicated part
// over tp; expert ops are spread over ep; a tied LM head holds a copy of the embedding matrix
// when it sits on another pipeline stage (pp > 1).
double rank_params(const model::Op& op, const Plan& plan);

// How many times the even share of token copies the busiest ep rank's share of an expert op
// works on and keeps (plan.expert_load; 1 for other ops).
double expert_load_of(const model::Op& op, const Plan& plan);

}  // namespace dtsim::plan
