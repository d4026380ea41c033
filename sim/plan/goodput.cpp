#include "sim/plan/goodput.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "sim/common/error.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::plan {

double training_steps(double tokens, const Plan& plan) {
  return std::ceil(tokens / static_cast<double>(plan.global_batch_size * plan.seq_len));
}

TrainingTime training_time(const model::ModelSpec& spec, const Plan& plan, std::int64_t devices,
                           double step_time_s, double tokens, const Reliability& reliability) {
  DTSIM_ASSERT(devices > 0 && step_time_s > 0 && tokens > 0, "bad training-time arguments");
  TrainingTime t;
  t.steps = training_steps(tokens, plan);  // (3e6 tokens at 256 x 8192 a step: 2, not 1.43)
  t.work_s = t.steps * step_time_s;
  const double n = static_cast<double>(devices);
  t.job_mtbf_s = 3600.0 / (reliability.interruptions_per_device_hour * n);
  // A checkpoint holds the weights and the optimizer's state (with mixed precision the fp32
  // master copy too: 2 + 12 bytes per parameter with Adam), not the gradients.
  const auto per_param = state_bytes_per_param(plan);
  t.checkpoint_bytes = static_cast<double>(model::count_params(with_padded_vocab(spec, plan))) *
                       (per_param.weights + per_param.optimizer);
  double write_rate = reliability.checkpoint_write_bytes_per_s_per_device * n;
  if (reliability.checkpoint_write_bytes_per_s_total) {
    write_rate = std::min(write_rate, *reliability.checkpoint_write_bytes_per_s_total);
  }
  t.checkpoint_write_s = t.checkpoint_bytes / write_rate;
  const auto& snapshot = reliability.checkpoint_snapshot_bytes_per_s_per_device;
  t.asynchronous = snapshot.has_value();
  t.checkpoint_blocking_s =
      t.asynchronous ? t.checkpoint_bytes / (*snapshot * n) : t.checkpoint_write_s;
  const double young_s = std::sqrt(2.0 * t.checkpoint_blocking_s * t.job_mtbf_s);
  // No more than the run: a run shorter than the interval checkpoints once, at its end.
  // (Counts of steps from doubles, clamped before the cast: absurd token counts or write
  // rates, which the options accept as finite, would overflow a 64-bit integer.)
  auto steps_of = [](double x) {
    return static_cast<std::int64_t>(std::clamp(std::isnan(x) ? 1.0 : x, 1.0, 0x1p62));
  };
  const std::int64_t run_steps = steps_of(std::ceil(t.steps));
  const std::int64_t write_steps =
      t.asynchronous ? steps_of(std::ceil(t.checkpoint_write_s / step_time_s)) : 1;
  t.checkpoint_every_steps =
      std::min(std::max(steps_of(std::round(young_s / step_time_s)), write_steps), run_steps);
  const double interval_s = static_cast<double>(t.checkpoint_every_steps) * step_time_s;
  const double lost_per_interruption_s =
      reliability.restart_s + (t.asynchronous ? 0.5 * interval_s + t.checkpoint_write_s
                                              : 0.5 * (interval_s + t.checkpoint_write_s));
  // Whole checkpoints: a run a little longer than an interval writes two (a fraction of one
  // made a run of one step and a token cost less than a run of one step). (The 1e-9 keeps a
  // whole multiple of the interval, rounded a hair above it by the division, at its count.)
  t.checkpoints =
      std::max(1.0, std::ceil(t.steps / static_cast<double>(t.checkpoint_every_steps) - 1e-9));
  const double useful = 1.0 - lost_per_interruption_s / t.job_mtbf_s;
  if (useful <= 0) {
    t.wall_s = std::numeric_limits<double>::infinity();
    t.goodput = 0;
    return t;
  }
  t.wall_s = (t.work_s + t.checkpoints * t.checkpoint_blocking_s) / useful;
  t.goodput = t.work_s / t.wall_s;
  return t;
}

}  // namespace dtsim::plan
