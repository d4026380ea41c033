// Checkpoints of dtexec runs: the full (unsharded) tensors of the model with their AdamW state,
// the step reached and every step's loss, whatever the plan that wrote them, so that a run can
// resume under the same plan and two runs with different plans can be compared.
//
// On disk, a folder: `checkpoint.json` (format, model, plan, step, seed, learning rate and its
// schedule, weight decay, losses,
// tensors with name, shape and offset) and `tensors.bin` (for each tensor its weights, AdamW m
// and v as little-endian fp32). A checkpoint is written to a sibling temporary folder and
// renamed into place, so a reader never sees half of one.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace dtsim::exec {

struct CheckpointTensor {
  std::string name;                 // "<op name>.weight" or "<op name>.bias"
  std::vector<std::int64_t> shape;  // full, unsharded
  std::vector<float> data, m, v;    // product(shape) each
};

struct Checkpoint {
  std::string model;
  nlohmann::json plan;
  int step = 0;  // steps completed
  std::uint64_t seed = 0;
  double learning_rate = 0;  // the schedule's max_lr
  double weight_decay = 0;   // AdamW's (0 in checkpoints written before it was recorded)
  // The learning-rate schedule (exec/core/lr_schedule.hpp's JSON); null in checkpoints written
  // before schedules (a constant learning_rate).
  nlohmann::json lr_schedule;
  std::vector<double> losses;  // one per completed step
  std::vector<CheckpointTensor> tensors;
};

void write_checkpoint(const std::string& dir, const Checkpoint& checkpoint);
// Throws InputError naming the file and field when the folder is not a readable checkpoint.
Checkpoint read_checkpoint(const std::string& dir);

// Differences between two checkpoints of the same model: losses step by step, weights tensor by
// tensor (the largest absolute difference, and the tensor where it occurs).
struct CheckpointDiff {
  int steps_compared = 0;
  double max_loss_diff = 0;
  double max_weight_diff = 0;
  std::string worst_tensor;
  std::vector<std::string> problems;  // mismatched models, steps, names or shapes
};
CheckpointDiff compare_checkpoints(const Checkpoint& a, const Checkpoint& b);

}  // namespace dtsim::exec
