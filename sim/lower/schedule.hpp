// Pipeline schedules: the order in which one stage runs its forward and backward passes.
#pragma once

#include <vector>

#include "sim/plan/plan.hpp"

namespace dtsim::lower {

enum class PassKind { Forward, Backward, BackwardInput, BackwardWeight };

struct Pass {
  PassKind kind = PassKind::Forward;
  int micro_batch = 0;
  int chunk = 0;  // model chunk of this stage (0 unless interleaved)
  // Passes of one round run back to back: without p2p overlap, Megatron-LM exchanges pipeline
  // tensors between rounds only. One pass per round, except in the interleaved schedule's
  // steady state, where a forward and a backward pass make one round
  // (forward_backward_pipelining_with_interleaving: send_forward_backward_recv_forward_backward
  // after each such pair).
  int round = 0;
};

// The passes of `stage` in execution order:
// - GPipe (Huang et al. 2019): all forwards, then all backwards.
// - 1F1B / PipeDream-Flush (Narayanan et al. 2021): min(pp - stage - 1, m) warm-up forwards,
//   then one forward and one backward alternately, then the remaining backwards.
// - Interleaved 1F1B (Narayanan et al. 2021 §2.2, Megatron-LM's order): virtual micro-batch k
//   runs on chunk (k / pp) % v (backward: v - 1 - that) for micro-batch (k / (pp·v))·pp + k % pp;
//   warm-up 2·(pp - stage - 1) + (v - 1)·pp forwards; each steady-state forward and the
//   backward after it make one round.
// - Zero-bubble ZB-H1 (Qi et al. 2023): each backward split into B (input gradients) and W
//   (weight gradients); W passes are deferred (at most pp pending) to fill the cool-down
//   (see schedule.cpp).
// - PipeDream (asynchronous, Narayanan et al. 2019): the 1F1B order; the engine runs it without
//   the flush between steps.
std::vector<Pass> stage_passes(const plan::Plan& plan, int stage);

// How blocking pipeline exchanges (no p2p overlap: the tensors go between rounds) behave, as the
// lowering emits them and the planner's timeline follows them:
// - Megatron-LM's schedules (1F1B, interleaved; GPipe taken as 1F1B is) hold the sender of an
//   exchange until its tensors are received; zero-bubble and PipeDream, which Megatron-LM does
//   not have, block the receives alone.
bool exchanges_hold_senders(const plan::Plan& plan);
// - Its 1F1B sends, then receives, between two passes of one kind (send_forward, then
//   recv_forward, in the warm-up; send_backward, then recv_backward, in the cool-down), and
//   batches them between a forward and a backward pass; its interleaved schedule batches them
//   everywhere.
bool receives_after_sends_when_alike(const plan::Plan& plan);

}  // namespace dtsim::lower
