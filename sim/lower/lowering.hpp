// Plan + ModelGraph -> Program (DESIGN.md "The Program").
#pragma once

#include <cstdint>

#include "sim/lower/program.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::lower {

struct LowerOptions {
  Lowering mode = Lowering::Representatives;
  // Gradient bucket size for data-parallel reduction (plan::kGradientBucketBytes).
  std::uint64_t dp_bucket_bytes = plan::kGradientBucketBytes;
};

// `graph` must be built for the plan's micro-batch size and sequence length; the plan must be
// valid (plan::require_valid). What each rank does:
// - forward and backward passes in the schedule's order (lower/schedule.hpp), each a chain of
//   compute tasks over ModelGraph op ranges with Megatron-LM's tensor-parallel collectives
//   between them: all-reduce after row-parallel layers in forward and before column-parallel
//   layers in backward; with sequence parallelism all-gather / reduce-scatter instead;
//   context parallelism all-gathers K and V before attention (reduce-scatters their gradients
//   in backward); expert parallelism all-to-alls tokens before and after the experts;
// - pipeline sends and receives of activations (forward) and gradients (backward);
// - recompute: full re-runs each block's forward (with its collectives) before its backward;
//   selective re-runs the attention core;
// - data parallelism: gradients in buckets of dp_bucket_bytes, in the order backward produces
//   them, all-reduced (ZeRO-0) or reduce-scattered (ZeRO >= 1) after the last micro-batch
//   (ZeRO-2/3: after every micro-batch), overlapping the rest of the backward pass (zero-
//   bubble: of the weight pass, then a task per layer; or, with plan.overlap_grad_reduce
//   false, all after the rank's last backward task); then the
//   optimizer step and, for ZeRO-1/2, an all-gather of the updated weights; ZeRO-3 all-gathers
//   each chunk's weights before every pass, one pass ahead.
Program lower(const model::ModelGraph& graph, const plan::Plan& plan,
              const LowerOptions& options = {});

// The most tasks a lowered program may have: past them a step takes the simulator minutes and
// gigabytes (a sanity bound, not a model constant).
inline constexpr double kMostProgramTasks = 5e7;
// About how many tasks lowering `plan` of a `layers`-block model makes (about 10 per block per
// pass, up to three passes per micro-batch, per simulated program).
double program_tasks(std::int64_t layers, const plan::Plan& plan, Lowering mode);
// What lower() checks first: InputError saying why where program_tasks exceeds the bound.
void check_program_size(std::int64_t layers, const plan::Plan& plan, Lowering mode);

}  // namespace dtsim::lower
