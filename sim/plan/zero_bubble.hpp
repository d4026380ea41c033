// The zero-bubble ZB-H1 pass order (Qi et al. 2023), shared by the lowering (the order a stage
// runs its passes in) and the memory model (what a stage holds at its peak).
#pragma once

#include <utility>
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

// What `stage` holds as it runs its order: the distinct (micro-batches whose forward awaits its
// B pass, B passes awaiting their W pass) pairs, a B pass counted in both while it runs. The
// stage's held memory peaks at one of them. Orders and states are computed once per (p, m) for
// all stages and kept (thread-safe).
std::vector<std::pair<int, int>> zero_bubble_states(int p, int m, int stage);

}  // namespace dtsim::plan
