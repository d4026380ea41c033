#include "sim/plan/zero_bubble.hpp"

#include <algorithm>
#include <climits>
#include <tuple>

#include "sim/common/error.hpp"

namespace dtsim::plan {

std::vector<ZbPass> zero_bubble_order(int p, int m, int stage) {
  DTSIM_ASSERT(p >= 1 && m >= 1 && stage >= 0 && stage < p, "zero_bubble_order: bad arguments");
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
  return order[static_cast<std::size_t>(stage)];
}

}  // namespace dtsim::plan
