// The training steps behind `dtexec calibrate`'s in_run factors (sim/cost/profile.hpp): their
// plan, and on a device of bounded memory (a GPU), how much of the calibration model they train.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "sim/common/error.hpp"
#include "sim/common/precision.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::exec {

// One rank, one micro-batch of `graph` per step, in `precision`.
plan::Plan in_run_plan(const model::ModelGraph& graph, Precision precision);

// `spec` at one micro-batch of `micro_batch` x `seq_len` tokens with as many of its blocks as
// dtsim's memory model says fit in `capacity_bytes` (no framework allowance: the caller leaves
// room for it), at most `max_blocks`; nothing when one block does not fit. Every block has the
// same shapes, so a few stand for the model in per-phase ratios (with the head weighing more).
std::optional<model::ModelGraph> in_run_graph(const model::ModelSpec& spec,
                                              std::int64_t micro_batch, std::int64_t seq_len,
                                              Precision precision, double capacity_bytes,
                                              std::int64_t max_blocks = 8);

// The ranks' spread in one phase of the in_run steps, from `seconds[k][r]`: rank k's time in
// round r (every rank the same rounds, at least two ranks), as squared coefficients of
// variation over the grand mean. A two-way table without replication (Montgomery, "Design and
// Analysis of Experiments", the random-effects model's expected mean squares):
// - transient: the interaction's mean square, the variance of x[k][r] - rank k's mean - round
//   r's mean + the grand mean over (ranks - 1)(rounds - 1): what one rank has in a round and the
//   others do not, once the ranks' lasting speeds and each round's pace on all of them are out;
//   none with one round;
// - lasting: the variance of the ranks' means over the rounds, less the transient variance
//   over the rounds that each mean still holds (its expected share, E[MS_ranks] = sigma_e^2 +
//   rounds·sigma_ranks^2); 0 where the ranks' means differ no more than that.
struct PhaseSpread {
  double lasting_cv2 = 0;
  std::optional<double> transient_cv2;
};
PhaseSpread phase_spread(const std::vector<std::vector<double>>& seconds);

// A warning for a calibration on a noisy host, or nothing: where one GEMM's time varies by
// `jitter_cv` (std/mean) from repeat to repeat, or a rank's phase time by `transient_cv` from
// round to round, by 10% or more. Every rate of the profile then carries that noise, and a
// step predicted from it is that uncertain: two thirds of the ±15% step-time target that
// bench/cpu_validation.sh checks (a threshold for saying so, not a model constant; on this
// project's 2-core host calibrations gave 1-5%, and the one at 12% missed that target by 19%).
// And where the ranks' lasting speeds differ by as much (`rank_spread_cv`, the simulator's slow
// rank, which the profile passes on to every prediction): said too, as a slow device or a busy
// host.
std::optional<std::string> noisy_host_warning(double jitter_cv, std::optional<double> transient_cv,
                                              std::optional<double> rank_spread_cv = std::nullopt);

// Measurements too noisy to make a result dtsim reads (a host too busy): neither bad input
// nor a bug. dtexec says it as an error, with exit code 1.
class MeasurementError : public Error {
 public:
  using Error::Error;
};

// Throws where `profile`, about to be written to `path`, is one that dtsim --profile refuses:
// MeasurementError where a spread reached 100% (a GEMM's repeats beside three busy processes
// on this project's host: jitter_cv up to 0.99), which the simulator's straggler model does not
// take; else std::runtime_error (not a bad input: a measurement the reader should take).
void check_profile_readable(const nlohmann::json& profile, const std::string& path);

}  // namespace dtsim::exec
