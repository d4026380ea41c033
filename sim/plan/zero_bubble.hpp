// The zero-bubble ZB-H1 pass order (Qi et al. 2023), shared by the lowering (the order a stage
// runs its passes in) and the memory model (what a stage holds at its peak).
#pragma once

#include <compare>
#include <vector>

namespace dtsim::plan {

enum class ZbKind { Forward, BackwardInput, BackwardWeight };

struct ZbPass {
  ZbKind kind = ZbKind::Forward;
  int micro_batch = 0;
};

// The passes of `stage` of `p` stages over `m` micro-batches, by list scheduling with unit
// times (T_F = T_B = T_W, Qi et al.'s setting): every stage, when free, runs the earliest-ready
// of (in priority order) a backward-input pass B, a forward F (at most p - stage outstanding
// B's, the 1F1B bound), and a deferred weight pass W; a stage runs W at once when p W's are
// pending, which bounds the activations that deferred W's keep. B passes thus travel up the
// pipeline at T_B per stage and the W passes fill the cool-down bubble: (p-1)(T_F + T_B - T_W)
// instead of 1F1B's (p-1)(T_F + T_B + T_W).
std::vector<ZbPass> zero_bubble_order(int p, int m, int stage);

// Where in its order a stage is: at a forward's end (the last stage's loss still reads the
// logits), at the end of a forward that follows a W pass (which is also a forward's end: a
// gradient reduction that W pass started may still run), inside a B pass (turning its
// forward's activations into what its W keeps, block by block), at a W pass's end (where its
// gradients go out), or after a B pass.
enum class ZbAt { ForwardEnd, ForwardAfterWeight, InBackward, WeightEnd, PassEnd };

// A moment of a stage's order: micro-batches whose forward awaits its B pass (one of them in
// its B pass at InBackward), and B passes awaiting their W pass.
struct ZbState {
  int forwards = 0;
  int pending = 0;
  ZbAt at = ZbAt::PassEnd;
  auto operator<=>(const ZbState&) const = default;
};

// What `stage` holds as it runs its order: the distinct states after each pass and while each
// B pass runs. The stage's held memory peaks at one of them. Orders and states are computed
// once per (p, m) for all stages and kept (thread-safe).
std::vector<ZbState> zero_bubble_states(int p, int m, int stage);

}  // namespace dtsim::plan
