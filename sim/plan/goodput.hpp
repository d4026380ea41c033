// Time to train with failures: the failure-free time of a number of steps, stretched by the
// checkpoints a job writes and the work it loses and the time it takes to restart after each
// interruption. First-order model (Young 1974, "A first order approximation to the optimum
// checkpoint interval"; Daly 2006): interruptions arrive at random at a constant rate, every
// rank's state is written at once (synchronously, as Megatron-LM's default save; or
// asynchronously, training stopped only for a copy to host memory, as Megatron-LM's
// --async-save), and a job restarts from its last complete checkpoint.
#pragma once

#include <cstdint>
#include <optional>

#include "sim/model/model_spec.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::plan {

// Llama 3's 405B pre-training (Dubey et al. 2024, "The Llama 3 Herd of Models", Sec. 3.3.4 and
// Table 5): 419 unexpected interruptions in a 54-day snapshot on 16,384 H100 GPUs, of every
// cause (GPUs and their HBM, network, hosts, software): 1.97e-5 per GPU and hour, a job of
// 16,384 GPUs interrupted every 3.1 hours.
inline constexpr double kLlama3InterruptionsPerDeviceHour = 419.0 / (16384.0 * 54.0 * 24.0);
// The same paper, Sec. 3.3.1: its storage (Tectonic) sustains 2 TB/s of checkpoint writes,
// shared by the run's 16,384 GPUs: 122 MB/s per GPU, scaled here with the job's devices.
inline constexpr double kLlama3CheckpointWriteBytesPerSPerDevice = 2e12 / 16384.0;

struct Reliability {
  double interruptions_per_device_hour = kLlama3InterruptionsPerDeviceHour;
  // Detecting the failure, replacing the node, starting the job, loading the checkpoint: no
  // published figure to take as a default, so not counted unless given.
  double restart_s = 0;
  double checkpoint_write_bytes_per_s_per_device = kLlama3CheckpointWriteBytesPerSPerDevice;
  // The storage system's sustained write bandwidth in all, when it caps the devices' sum
  // (unset: the per-device figure scales with the job).
  std::optional<double> checkpoint_write_bytes_per_s_total;
  // Asynchronous checkpoints: training stops only while each device copies its state to host
  // memory at this rate; the write to storage runs behind the next steps. Unset: synchronous.
  std::optional<double> checkpoint_snapshot_bytes_per_s_per_device;
};

struct TrainingTime {
  double steps = 0;             // whole steps: the tokens over a step's, rounded up
  double work_s = 0;            // steps x step time: the failure-free time
  double job_mtbf_s = 0;        // mean time between the job's interruptions
  double checkpoint_bytes = 0;  // weights and optimizer state, one copy (not per dp replica)
  double checkpoint_write_s = 0;
  // What stops training per checkpoint: the write, or with asynchronous checkpoints the copy to
  // host memory.
  double checkpoint_blocking_s = 0;
  bool asynchronous = false;
  // Young's interval sqrt(2 x blocking time x MTBF), in whole steps: asynchronous, no shorter
  // than a write (which must end before the next begins); at least 1, and at most the run,
  // which takes precedence (a run shorter than either checkpoints once, at its end).
  std::int64_t checkpoint_every_steps = 1;
  // The checkpoints written: one every interval and the last at the run's end (steps / interval
  // rounded up).
  double checkpoints = 1;
  // Expected wall time: (work + checkpoints x blocking) / (1 - lost / MTBF), each interruption
  // losing the restart and on average half an interval and its write (synchronous: half the
  // write, a failure during it losing the interval before; asynchronous: the whole write, the
  // newest checkpoint not durable until it ends). Infinite (and goodput 0) when interruptions
  // come faster than that.
  double wall_s = 0;
  double goodput = 0;  // work_s / wall_s
};

// The steps that train on `tokens`: whole ones (the tokens over a step's, rounded up: a run does
// its last step whole, however few of its tokens it still needs).
double training_steps(double tokens, const Plan& plan);

TrainingTime training_time(const model::ModelSpec& spec, const Plan& plan, std::int64_t devices,
                           double step_time_s, double tokens, const Reliability& reliability);

}  // namespace dtsim::plan
