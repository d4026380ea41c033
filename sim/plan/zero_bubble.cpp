#include "sim/plan/zero_bubble.hpp"

#include <algorithm>
#include <climits>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "sim/common/error.hpp"

namespace dtsim::plan {

namespace {

// Every stage's order: the list scheduling runs the whole pipeline at once.
std::vector<std::vector<ZbPass>> all_orders(int p, int m) {
  constexpr int kNone = -1;
  std::vector<std::vector<int>> f_done(p, std::vector<int>(m, kNone));
  std::vector<std::vector<int>> b_done(p, std::vector<int>(m, kNone));
  std::vector<int> free_at(p, 0), fn(p, 0), bn(p, 0), wn(p, 0);
  std::vector<std::vector<ZbPass>> order(static_cast<std::size_t>(p));
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
        order[static_cast<std::size_t>(i)].push_back({ZbKind::BackwardInput, bn[i]++});
        break;
      case 2:
        f_done[i][fn[i]] = start + 1;
        order[static_cast<std::size_t>(i)].push_back({ZbKind::Forward, fn[i]++});
        break;
      default:
        order[static_cast<std::size_t>(i)].push_back({ZbKind::BackwardWeight, wn[i]++});
        break;
    }
    free_at[i] = start + 1;
  }
  return order;
}

// The orders of every stage and the states each passes through (what a stage holds as it
// runs), built once per (p, m): the lowering asks for every stage in turn and the planner for
// thousands of candidates.
struct ZbSchedule {
  std::vector<std::vector<ZbPass>> orders;
  std::vector<std::vector<ZbState>> states;
};

ZbSchedule build(int p, int m) {
  ZbSchedule out{all_orders(p, m), {}};
  for (const auto& order : out.orders) {
    std::set<ZbState> seen;
    int forwards = 0, pending = 0;
    bool after_weight = false;
    for (const ZbPass& pass : order) {
      switch (pass.kind) {
        case ZbKind::Forward:
          ++forwards;
          seen.insert({forwards, pending, ZbAt::ForwardEnd});
          if (after_weight) seen.insert({forwards, pending, ZbAt::ForwardAfterWeight});
          break;
        case ZbKind::BackwardInput:
          seen.insert({forwards, pending, ZbAt::InBackward});
          --forwards;
          ++pending;
          seen.insert({forwards, pending, ZbAt::PassEnd});
          break;
        case ZbKind::BackwardWeight:
          --pending;  // (holds less than the pass before it, but its gradients go out here)
          seen.insert({forwards, pending, ZbAt::WeightEnd});
          break;
      }
      after_weight = pass.kind == ZbKind::BackwardWeight;
    }
    out.states.emplace_back(seen.begin(), seen.end());
  }
  return out;
}

// The schedule of (p, m), kept (thread-safe; entries are never removed, so references stay).
const ZbSchedule& schedule(int p, int m, int stage) {
  DTSIM_ASSERT(p >= 1 && m >= 1 && stage >= 0 && stage < p, "zero-bubble: bad stage or m");
  static std::mutex mutex;
  static std::map<std::pair<int, int>, ZbSchedule> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find({p, m});
  if (it == cache.end()) it = cache.emplace(std::pair{p, m}, build(p, m)).first;
  return it->second;
}

}  // namespace

std::vector<ZbPass> zero_bubble_order(int p, int m, int stage) {
  return schedule(p, m, stage).orders[static_cast<std::size_t>(stage)];
}

std::vector<ZbState> zero_bubble_states(int p, int m, int stage) {
  return schedule(p, m, stage).states[static_cast<std::size_t>(stage)];
}

}  // namespace dtsim::plan
