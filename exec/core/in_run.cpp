#include "exec/core/in_run.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "sim/cluster/topology.hpp"
#include "sim/common/error.hpp"
#include "sim/cost/profile.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::exec {

PhaseSpread phase_spread(const std::vector<std::vector<double>>& seconds) {
  const std::size_t ranks = seconds.size();
  DTSIM_ASSERT(ranks >= 2, "phase_spread: fewer than two ranks");
  const std::size_t rounds = seconds.front().size();
  DTSIM_ASSERT(rounds >= 1, "phase_spread: no rounds");
  for (const auto& row : seconds) {
    DTSIM_ASSERT(row.size() == rounds, "phase_spread: ranks with different rounds");
  }
  const double n = static_cast<double>(ranks), k = static_cast<double>(rounds);
  std::vector<double> own(ranks, 0.0), pace(rounds, 0.0);
  double mean = 0;
  for (std::size_t i = 0; i < ranks; ++i) {
    for (std::size_t r = 0; r < rounds; ++r) {
      own[i] += seconds[i][r] / k;
      pace[r] += seconds[i][r] / n;
      mean += seconds[i][r] / (n * k);
    }
  }
  double between = 0;  // the variance of the ranks' means
  for (const double o : own) between += (o - mean) * (o - mean) / (n - 1);
  PhaseSpread out;
  if (!(mean > 0)) return out;
  if (rounds < 2) {
    out.lasting_cv2 = between / (mean * mean);
    return out;
  }
  double squares = 0;
  for (std::size_t i = 0; i < ranks; ++i) {
    for (std::size_t r = 0; r < rounds; ++r) {
      const double e = seconds[i][r] - own[i] - pace[r] + mean;
      squares += e * e;
    }
  }
  const double transient = squares / ((n - 1) * (k - 1));
  out.transient_cv2 = transient / (mean * mean);
  out.lasting_cv2 = std::max(0.0, between - transient / k) / (mean * mean);
  return out;
}

plan::Plan in_run_plan(const model::ModelGraph& graph, Precision precision) {
  plan::Plan p;
  p.dp = 1;
  p.micro_batch_size = graph.micro_batch();
  p.global_batch_size = graph.micro_batch();
  p.seq_len = graph.seq_len();
  p.precision = precision;
  p.attention = graph.attention();
  plan::require_valid(p, graph.spec(), 1);
  return p;
}

std::optional<model::ModelGraph> in_run_graph(const model::ModelSpec& spec,
                                              std::int64_t micro_batch, std::int64_t seq_len,
                                              Precision precision, double capacity_bytes,
                                              std::int64_t max_blocks) {
  plan::MemoryOptions memory;
  memory.framework_overhead_bytes = 0;
  memory.capacity_bytes = capacity_bytes;
  const cluster::Cluster any;  // the capacity above is the only figure the estimate reads
  for (std::int64_t blocks = std::min(spec.layers, max_blocks); blocks >= 1; --blocks) {
    model::ModelSpec part = spec;
    part.layers = blocks;
    model::ModelGraph graph(part, micro_batch, seq_len,
                            plan::activation_bytes_per_element(precision));
    if (plan::estimate_memory(graph, in_run_plan(graph, precision), any, memory).fits) {
      return graph;
    }
  }
  return std::nullopt;
}

std::optional<std::string> noisy_host_warning(double jitter_cv, std::optional<double> transient_cv,
                                              std::optional<double> rank_spread_cv) {
  constexpr double kNoisy = 0.10;  // see the header
  std::vector<std::string> said;
  const double worst = std::max(jitter_cv, transient_cv.value_or(0.0));
  if (worst >= kNoisy) {
    const bool gemm = jitter_cv >= transient_cv.value_or(0.0);
    said.push_back(fmt::format(
        "warning: a noisy host: {} varied by {:.1f}% (std/mean) while calibrating. Every rate in "
        "this profile carries that noise, and a step predicted from it is about as uncertain. "
        "Calibrate again when the host is quieter (other jobs stopped), or several times, and "
        "keep the profile with the least jitter_cv",
        gemm ? "one GEMM's time from repeat to repeat" : "a rank's phase time from round to round",
        100 * worst));
  }
  if (rank_spread_cv.value_or(0.0) >= kNoisy) {
    said.push_back(fmt::format(
        "warning: the ranks' speeds differed by {:.1f}% (std/mean) for the whole calibration: a "
        "slower device, or a host busier for some ranks than others. The profile's "
        "rank_spread_cv passes it on to every prediction as a lasting slow rank (dtsim "
        "--rank-spread-cv overrides it); calibrate again if it was the host",
        100 * *rank_spread_cv));
  }
  if (said.empty()) return std::nullopt;
  return fmt::format("{}", fmt::join(said, "\n"));
}

void check_profile_readable(const nlohmann::json& profile, const std::string& path) {
  try {
    cost::profile_from_json(profile, path);
  } catch (const InputError& e) {
    // A spread of 100% or more (the profile reader's bound on each): the host, not dtexec.
    const nlohmann::json in_run = profile.value("in_run", nlohmann::json::object());
    const bool spread = profile.value("jitter_cv", 0.0) >= 1 ||
                        in_run.value("rank_spread_cv", 0.0) >= 1 ||
                        in_run.value("transient_cv", 0.0) >= 1;
    const std::string what = fmt::format(
        "the measurements make a profile that dtsim --profile refuses, so {} was not written: {}",
        path, e.what());
    if (spread) {
      throw MeasurementError(what +
                             ". A spread of 100% or more means a host too busy for a calibration "
                             "(see `uptime`): run it again on a quiet host");
    }
    throw std::runtime_error(what);
  }
}

}  // namespace dtsim::exec
