// What the CPU and CUDA calibrations time, and the statistics of repeated timings (header-only,
// plain C++: the CUDA sources include it too).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <vector>

namespace dtsim::exec {

// Of an even count, the mean of the middle two (not the upper one: of two steps, their mean).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t mid = v.size() / 2;
  return v.size() % 2 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
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

// The group sizes whose collectives calibrate measures on a job of `ranks` (2 or more): 2, 4,
// ... that divide it, and the job. Each runs in groups of consecutive ranks, as a plan's
// innermost groups (tp) are placed, every group at once, as a plan's groups of a kind run
// (sharing the host); the simulator prices a group by its size's rows.
inline std::vector<int> collective_group_sizes(int ranks) {
  std::vector<int> sizes;
  for (int g = 2; g < ranks; g *= 2) {
    if (ranks % g == 0) sizes.push_back(g);
  }
  sizes.push_back(ranks);
  return sizes;
}

// One GEMM of a linear op [T,K]x[K,N] on one rank, as `dtexec run` calls it: its forward, or
// one of its backward's two of the same FLOPs, the input gradient dout[T,N]·w^T ([T,N]x[N,K])
// and the weight gradient in^T·dout ([K,T]x[T,N]). Each backend times them with its own matmul
// kernels, in their own layouts (transposed operands run at their own speed).
enum class GemmPass { Forward, InputGrad, WeightGrad };
struct ModelGemm {
  int T = 0, K = 0, N = 0;  // the linear op's shape on the rank
  GemmPass pass = GemmPass::Forward;
  // The GEMM as {m, k, n} ([m,k]x[k,n]), as a profile's "gemm" rows name it.
  std::array<int, 3> mkn() const {
    switch (pass) {
      case GemmPass::InputGrad:
        return {T, N, K};
      case GemmPass::WeightGrad:
        return {K, T, N};
      case GemmPass::Forward:
        break;
    }
    return {T, K, N};
  }
};

}  // namespace dtsim::exec
