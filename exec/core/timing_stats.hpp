// Statistics of repeated timings, shared by the CPU and CUDA calibrations (header-only, plain
// C++: the CUDA sources include it too).
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace dtsim::exec {

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The spread of timings as a coefficient of variation, robust to the odd preempted sample:
// 1.4826 x the median absolute deviation over the median (1.4826 = 1/Phi^-1(3/4) makes the MAD
// the standard deviation when the times are normal). Capped below 1, the profile's limit: past
// that a normal spread means nothing. 0 for an empty or zero-time series.
inline double robust_cv(const std::vector<double>& times) {
  const double mid = median(times);
  if (!(mid > 0)) return 0;
  std::vector<double> dev;
  dev.reserve(times.size());
  for (double x : times) dev.push_back(std::abs(x - mid));
  return std::min(1.4826 * median(dev) / mid, 0.99);
}

// One non-GEMM op of a calibration model timed with an executor's own kernels: `op` names it as
// the profile does (layernorm, rmsnorm, attention, gelu, swiglu, residual, embedding, loss).
struct OpTiming {
  std::string op;
  double fwd_s = 0, bwd_s = 0;
};

}  // namespace dtsim::exec
