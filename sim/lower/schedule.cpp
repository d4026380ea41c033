#include "sim/lower/schedule.hpp"

#include <algorithm>
#include <climits>
#include <tuple>
#include <utility>

#include "sim/common/error.hpp"
#include "sim/plan/zero_bubble.hpp"

namespace dtsim::lower {

namespace {

using plan::Schedule;

std::vector<Pass> one_f_one_b(int p, int m, int stage) {
  const int warmup = std::min(p - stage - 1, m);
  std::vector<Pass> out;
  for (int i = 0; i < warmup; ++i) out.push_back({PassKind::Forward, i, 0});
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back({PassKind::Forward, warmup + i, 0});
    out.push_back({PassKind::Backward, i, 0});
  }
  for (int i = m - warmup; i < m; ++i) out.push_back({PassKind::Backward, i, 0});
  return out;
}

// ZB-H1: the order plan::zero_bubble_order gives (shared with the memory model).
std::vector<Pass> zero_bubble_h1(int p, int m, int stage) {
  std::vector<Pass> out;
  for (const plan::ZbPass& z : plan::zero_bubble_order(p, m, stage)) {
    const PassKind kind = z.kind == plan::ZbKind::Forward         ? PassKind::Forward
                          : z.kind == plan::ZbKind::BackwardInput ? PassKind::BackwardInput
                                                                  : PassKind::BackwardWeight;
    out.push_back({kind, z.micro_batch, 0});
  }
  return out;
}

std::vector<Pass> interleaved(int p, int m, int v, int stage) {
  const int total = m * v;
  const int warmup = std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  auto micro_batch = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto fwd_chunk = [&](int k) { return (k / p) % v; };
  auto bwd_chunk = [&](int k) { return v - 1 - (k / p) % v; };
  std::vector<Pass> out;
  int round = 0;
  for (int k = 0; k < warmup; ++k) {
    out.push_back({PassKind::Forward, micro_batch(k), fwd_chunk(k), round++});
  }
  for (int k = 0; k < total - warmup; ++k) {
    const int f = warmup + k;
    out.push_back({PassKind::Forward, micro_batch(f), fwd_chunk(f), round});
    out.push_back({PassKind::Backward, micro_batch(k), bwd_chunk(k), round++});
  }
  for (int k = total - warmup; k < total; ++k) {
    out.push_back({PassKind::Backward, micro_batch(k), bwd_chunk(k), round++});
  }
  return out;
}

// One pass per round.
std::vector<Pass> singles(std::vector<Pass> passes) {
  for (std::size_t i = 0; i < passes.size(); ++i) passes[i].round = static_cast<int>(i);
  return passes;
}

}  // namespace

std::vector<Pass> stage_passes(const plan::Plan& plan, int stage) {
  const int p = plan.pp;
  const int m = static_cast<int>(plan.micro_batches());
  DTSIM_ASSERT(stage >= 0 && stage < p && m >= 1, "stage_passes: bad stage or micro-batches");
  // Without pipelining every schedule is gradient accumulation, one micro-batch's forward then
  // its backward (Megatron-LM's forward_backward_no_pipelining): GPipe's forwards all first
  // would hold all m micro-batches for nothing.
  if (p == 1 && plan.schedule == Schedule::GPipe) return singles(one_f_one_b(1, m, 0));
  switch (plan.schedule) {
    case Schedule::GPipe: {
      std::vector<Pass> out;
      for (int i = 0; i < m; ++i) out.push_back({PassKind::Forward, i, 0});
      for (int i = m - 1; i >= 0; --i) out.push_back({PassKind::Backward, i, 0});
      return singles(std::move(out));
    }
    case Schedule::OneFOneB:
    case Schedule::PipeDreamAsync:
      return singles(one_f_one_b(p, m, stage));
    case Schedule::ZeroBubble:
      return singles(zero_bubble_h1(p, m, stage));
    case Schedule::Interleaved:
      return interleaved(p, m, plan.virtual_stages, stage);
  }
  return {};
}

bool exchanges_hold_senders(const plan::Plan& plan) {
  return !plan.overlap_p2p_comm &&
         (plan.schedule == Schedule::GPipe || plan.schedule == Schedule::OneFOneB ||
          plan.schedule == Schedule::Interleaved);
}

bool receives_after_sends_when_alike(const plan::Plan& plan) {
  return !plan.overlap_p2p_comm &&
         (plan.schedule == Schedule::GPipe || plan.schedule == Schedule::OneFOneB);
}

}  // namespace dtsim::lower
