#include "sim/lower/schedule.hpp"

#include <algorithm>
#include <climits>
#include <tuple>
#include <utility>

#include "sim/common/error.hpp"

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

// ZB-H1 by list scheduling with unit times (T_F = T_B = T_W, Qi et al.'s setting): every
// stage, when free, runs the earliest-ready of (in priority order) a backward-input pass B, a
// forward F (at most pp - stage outstanding B's, the 1F1B bound), and a deferred weight pass
// W; a stage runs W at once when pp - 1 W's are pending, which bounds the activations that
// deferred W's keep. B passes thus travel up the pipeline at T_B per stage and the W passes
// fill the cool-down bubble: (p-1)(T_F + T_B - T_W) instead of 1F1B's (p-1)(T_F + T_B + T_W).
std::vector<Pass> zero_bubble_h1(int p, int m, int stage) {
  constexpr int kNone = -1;
  std::vector<std::vector<int>> f_done(p, std::vector<int>(m, kNone));
  std::vector<std::vector<int>> b_done(p, std::vector<int>(m, kNone));
  std::vector<int> free_at(p, 0), fn(p, 0), bn(p, 0), wn(p, 0);
  std::vector<std::vector<Pass>> order(p);
  for (;;) {
    // Among stages with work left, the (start time, priority, stage)-smallest candidate.
    std::tuple<int, int, int> best{INT_MAX, INT_MAX, INT_MAX};
    for (int i = 0; i < p; ++i) {
      if (wn[i] >= m) continue;
      const int t = free_at[i];
      auto consider = [&](int start, int priority) {
        best = std::min(best, std::tuple{start, priority, i});
      };
      if (bn[i] - wn[i] > p - 1) {
        consider(t, 0);  // forced W
        continue;
      }
      if (bn[i] < fn[i]) {
        const int ready = i == p - 1 ? f_done[i][bn[i]] : b_done[i + 1][bn[i]];
        if (ready != kNone) consider(std::max(t, ready), 1);
      }
      if (fn[i] < m && fn[i] - bn[i] < p - i) {
        const int ready = i == 0 ? 0 : f_done[i - 1][fn[i]];
        if (ready != kNone) consider(std::max(t, ready), 2);
      }
      if (wn[i] < bn[i]) consider(t, 3);
    }
    auto [start, priority, i] = best;
    if (start == INT_MAX) break;
    switch (priority) {
      case 1:
        b_done[i][bn[i]] = start + 1;
        order[i].push_back({PassKind::BackwardInput, bn[i]++, 0});
        break;
      case 2:
        f_done[i][fn[i]] = start + 1;
        order[i].push_back({PassKind::Forward, fn[i]++, 0});
        break;
      default:
        order[i].push_back({PassKind::BackwardWeight, wn[i]++, 0});
        break;
    }
    free_at[i] = start + 1;
  }
  return order[static_cast<std::size_t>(stage)];
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

}  // namespace dtsim::lower
