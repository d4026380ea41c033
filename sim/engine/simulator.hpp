// dtsim simulate: lower a plan, run it on the engine with the cost and network models, and
// turn the timeline into the predicted step time and its breakdown (DESIGN.md "JSON results").
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "sim/cluster/topology.hpp"
#include "sim/cost/profile.hpp"
#include "sim/engine/engine.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/network/network_model.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::engine {

// Where a rank's step goes. Every instant of [0, step) is in exactly one term: the compute
// stream's work (split by phase), else the communication, or the straggler model's wait for a
// late rank, that is running while compute waits (shared equally when several run at once),
// else idle (the pipeline bubble).
struct Breakdown {
  double compute_s = 0;    // forward and backward
  double recompute_s = 0;  // forward re-run before backward
  double optimizer_s = 0;
  double bubble_s = 0;
  // Exposed communication by kind: tp, cp, ep, dp (incl. expert dp and ZeRO), pp.
  double exposed_tp_s = 0, exposed_cp_s = 0, exposed_ep_s = 0, exposed_dp_s = 0, exposed_pp_s = 0;
  // Exposed waits for the last rank of a collective or a pipeline transfer, by its kind (the
  // straggler model, engine.hpp; a measured breakdown cannot tell them apart: its waits for
  // peers are in its bubble).
  double straggler_tp_s = 0, straggler_cp_s = 0, straggler_ep_s = 0, straggler_dp_s = 0,
         straggler_pp_s = 0;
  // Of compute_s, recompute_s and optimizer_s, the time this rank's communication was in
  // flight beside it (a transfer, not a wait for a late rank): priced as fast as compute
  // alone, which it is not on a GPU (README "Not modelled"). Inside the step's terms, not one
  // of them.
  double overlapped_s = 0;
  double exposed_comm_s() const {
    return exposed_tp_s + exposed_cp_s + exposed_ep_s + exposed_dp_s + exposed_pp_s;
  }
  double straggler_s() const {
    return straggler_tp_s + straggler_cp_s + straggler_ep_s + straggler_dp_s + straggler_pp_s;
  }
  double total_s() const {  // the step it splits
    return compute_s + recompute_s + optimizer_s + bubble_s + exposed_comm_s() + straggler_s();
  }
};

struct StagePrediction {
  int stage = 0;
  std::int64_t rank = 0;
  Breakdown breakdown;
};

struct Prediction {
  double step_time_s = 0;
  double tokens_per_s = 0;
  double model_flops = 0;     // per step, all devices (no recompute)
  double hardware_flops = 0;  // per step, all devices, with recompute
  double executed_flops = 0;  // per step, all devices, as the kernels run them (StepFlops)
  double tflops_per_gpu = 0;  // hardware FLOP/s per device / 1e12 (Megatron-LM Eq. 3 style)
  double model_tflops_per_gpu = 0;
  double mfu = 0;
  double hfu = 0;
  std::int64_t gpus = 0;
  int bottleneck_stage = 0;  // the stage whose breakdown is reported
  Breakdown breakdown;
  std::vector<StagePrediction> stages;
  // Amdahl over data-parallel replicas at a fixed global batch: (exposed dp communication and
  // its straggler waits + bubble + the optimizer unless ZeRO shards it) / step, and 1 / that
  // (0: nothing serial).
  double serial_fraction = 0;
  double max_speedup = 0;
  // What the straggler model adds to the step: the step less the same simulation's without it
  // (SimulateOptions::straggler_cost; 0 without the model). The breakdown's straggler terms are
  // the part of it where compute waits on a late rank itself; the rest is the communication and
  // passes those waits delay, counted where they show.
  std::optional<double> straggler_cost_s;
  // What the slow rank (SimulateOptions::rank_spread_cv) adds to the step: the step without
  // jitter less the same without the slow rank (SimulateOptions::straggler_cost; 0 without it).
  // straggler_cost_s above keeps the slow rank in both runs.
  std::optional<double> slow_rank_cost_s;
  plan::MemoryReport memory;
  std::string network;
  std::uint64_t tasks = 0;
  std::uint64_t events = 0;
  std::vector<std::string> notes;
};

struct SimulateOptions {
  lower::LowerOptions lower;
  plan::MemoryOptions memory;
  const cost::Profile* profile = nullptr;  // calibration profile for the compute cost
  // Straggler model (engine/engine.hpp): the spread of compute times; unset: the profile's
  // jitter_cv, else none.
  std::optional<double> jitter_cv;
  // The slow rank (engine/engine.hpp): the spread (std/mean) of the ranks' lasting speeds; the
  // slowest of the plan's n ranks, E[max of n standard normals]·spread slower, computes the
  // busiest stage's tasks. Unset: the profile's in_run rank_spread_cv, else none.
  std::optional<double> rank_spread_cv;
  // Also run the program without the straggler model, for Prediction::straggler_cost_s and
  // slow_rank_cost_s (a second simulation where jitter is on, another where a rank is slow).
  bool straggler_cost = false;
  // For a progress bar: (done, total) over every simulation of the step this runs (with
  // straggler_cost, the calm and even ones too); see EngineOptions::progress.
  std::function<void(std::uint64_t done, std::uint64_t total)> progress;
};

// FLOPs of one training step over all devices (Megatron-LM's accounting): `model` counts the
// forward and backward passes, `hardware` adds the forward passes that recompute runs again;
// both count the attention core dense. `executed`: what the kernels run, hardware's but for
// FlashAttention's (model::Op::kernel_fwd_flops: the causal half, its scores computed again in
// the backward).
struct StepFlops {
  double model = 0;
  double hardware = 0;
  double executed = 0;
};
StepFlops step_flops(const model::ModelGraph& graph, const plan::Plan& plan);

// The straggler spread a run uses: as given, else the profile's measured jitter_cv, else 0.
double jitter_cv_of(const std::optional<double>& given, const cost::Profile* profile);
// The ranks' speed spread a run uses: as given, else the profile's rank_spread_cv, else 0.
double rank_spread_cv_of(const std::optional<double>& given, const cost::Profile* profile);
// How much slower the slowest of `ranks` ranks computes: 1 + E[max of n normals]·spread.
double slow_rank_factor(double spread, std::int64_t ranks);

struct Simulation {
  lower::Program program;
  Timeline timeline;
  Prediction prediction;
};

Simulation simulate(const model::ModelGraph& graph, const plan::Plan& plan,
                    const cluster::Cluster& cluster, network::NetworkModel& network,
                    const SimulateOptions& options = {});

// The breakdown of one rank program's timeline over [0, step_s).
Breakdown breakdown_of(const lower::RankProgram& rank, const std::vector<TaskTime>& times,
                       double step_s);

// The stage that computes the most (compute, recompute and optimizer; the pipeline's
// bottleneck), the one a step's breakdown reports; ties: the first. 0 when there is none.
std::size_t busiest_stage(const std::vector<StagePrediction>& stages);

// Amdahl's serial fraction of a step of `step_s` that breaks down as `b`: the share that more
// data-parallel replicas at the same global batch do not divide (the dp exposure and its
// stragglers' waits, the bubble, and an optimizer step that ZeRO does not shard). The speedup
// bound is its inverse.
double serial_fraction(const Breakdown& b, const plan::Plan& plan, double step_s);

}  // namespace dtsim::engine
