// The planner's pipeline timeline: every stage's forward and backward passes, in the order the
// schedule runs them (lower::stage_passes, the same order the lowering gives the simulator),
// each started once its stage is free and its input has come from the neighbouring stage.
//
// It replaces a bubble formula where the stages or the interleaved schedule's chunks are
// uneven: with 96 layers on 32 x 2 chunks (2 and 1 layers), a stage's 1-layer chunk waits for
// the 2-layer chunk before it at every chunk transition, which no per-stage formula sees. It
// times compute and pipeline transfers only (each device's link carrying one transfer at a time
// each way), every pass of a chunk alike: no stragglers, no data-parallel or optimizer work (the
// closed form adds those).
#pragma once

#include <span>
#include <vector>

#include "sim/lower/schedule.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::planner {

// One model chunk's passes of one micro-batch, indexed by virtual stage k = chunk x pp + stage
// (plan::chunk_layers' order). `backward` is the whole backward pass, or under zero-bubble the
// input-gradient pass, with `weight` its deferred weight-gradient pass.
struct ChunkPasses {
  double forward = 0, backward = 0, weight = 0;
  // Zero-bubble under sequence parallelism: the tp all-gathers of the chunk's inputs that its
  // weight pass waits for, queued on the tp stream behind the pass before (lowering:
  // emit_regather). Behind an input-gradient or forward pass, whose own tp collectives end
  // with it, they add their length; behind a weight pass they run beside it. A weight pass
  // run layer by layer (the last micro-batch's, whose gradients are reduced beside it; every
  // one with ZeRO-2 and up) waits for its first layer's alone (`layered_gathers`), the later
  // ones gathered beside the layers before.
  double gathers = 0, layered_gathers = 0;
  bool last_layered = false, all_layered = false;
  // The input-gradient pass's compute after its last tp collective (its first layer's norm, or
  // the embedding's backward), beside which the gathers queued behind it start.
  double input_tail = 0;
};

struct PipelineTimeline {
  double makespan_s = 0;  // from the first forward to the last stage's last pass
  // Each stage's passes summed (the busiest stage's is the least the makespan can be).
  std::vector<double> busy_s;
  // When each stage's last pass ends (its last gradients final: the dp stream's last buckets).
  std::vector<double> end_s;
  // When each stage's last backward pass of each of its chunks starts (zero-bubble's: the
  // weight pass): from then on the pass sends that chunk's last gradient buckets, each chunk's
  // after its own (the interleaved schedule's chunks end their passes rounds apart). Stage s's
  // chunk c at [s x chunks per stage + c]; last_backward(s) gives a stage's.
  std::vector<double> last_backward_s;
  std::span<const double> last_backward(int stage) const {
    const std::size_t per_stage = last_backward_s.size() / end_s.size();
    return std::span(last_backward_s)
        .subspan(static_cast<std::size_t>(stage) * per_stage, per_stage);
  }
};

// hop[s]: one transfer from stage s to stage s + 1 (the last: back to stage 0), either way.
// Blocking transfers (the plan without p2p overlap) start once the receiving stage posts its
// receive, after its round before, and once the sender has produced them; overlapped ones
// start when the sender has produced them, so the receiver waits only for what is left of
// them.
// Every stage's passes (lower::stage_passes), which depend on the schedule, pp, the
// micro-batches and the virtual stages only: a thread keeps the last few it made (the closed form
// times thousands of candidates that share them).
const std::vector<std::vector<lower::Pass>>& stage_passes_of(const plan::Plan& plan);

PipelineTimeline pipeline_timeline(const plan::Plan& plan, const std::vector<ChunkPasses>& chunks,
                                   const std::vector<double>& hop);

}  // namespace dtsim::planner
