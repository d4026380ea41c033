#include "sim/lower/schedule.hpp"

#include <algorithm>

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

std::vector<Pass> zero_bubble_h1(int p, int m, int stage) {
  // 1F1B with B and W split; W of micro-batch i runs right after B of micro-batch i + d, where
  // d = pp - 1 - stage (capped by m), and the last d W passes close the step.
  std::vector<Pass> out;
  const int delay = std::min(p - 1 - stage, m);
  int next_w = 0;
  for (const Pass& pass : one_f_one_b(p, m, stage)) {
    if (pass.kind == PassKind::Forward) {
      out.push_back(pass);
      continue;
    }
    out.push_back({PassKind::BackwardInput, pass.micro_batch, 0});
    if (pass.micro_batch >= delay) out.push_back({PassKind::BackwardWeight, next_w++, 0});
  }
  while (next_w < m) out.push_back({PassKind::BackwardWeight, next_w++, 0});
  return out;
}

std::vector<Pass> interleaved(int p, int m, int v, int stage) {
  const int total = m * v;
  const int warmup = std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  auto micro_batch = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto fwd_chunk = [&](int k) { return (k / p) % v; };
  auto bwd_chunk = [&](int k) { return v - 1 - (k / p) % v; };
  std::vector<Pass> out;
  for (int k = 0; k < warmup; ++k) out.push_back({PassKind::Forward, micro_batch(k), fwd_chunk(k)});
  for (int k = 0; k < total - warmup; ++k) {
    const int f = warmup + k;
    out.push_back({PassKind::Forward, micro_batch(f), fwd_chunk(f)});
    out.push_back({PassKind::Backward, micro_batch(k), bwd_chunk(k)});
  }
  for (int k = total - warmup; k < total; ++k) {
    out.push_back({PassKind::Backward, micro_batch(k), bwd_chunk(k)});
  }
  return out;
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
      return out;
    }
    case Schedule::OneFOneB:
    case Schedule::PipeDreamAsync: return one_f_one_b(p, m, stage);
    case Schedule::ZeroBubble: return zero_bubble_h1(p, m, stage);
    case Schedule::Interleaved: return interleaved(p, m, plan.virtual_stages, stage);
  }
  return {};
}

}  // namespace dtsim::lower
