// The learning rate of each step: a linear warm-up, then a decay to a floor, as Megatron-LM's
// OptimizerParamScheduler (`--lr-warmup-iters`, `--lr-decay-style`, `--lr-decay-iters`,
// `--min-lr`; megatron/core/optimizer_param_scheduler.py) and nanoGPT / llm.c train GPT-2.
// A pure function of the step, so a resumed run continues the schedule exactly.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace dtsim::exec {

enum class LrDecay { Constant, Linear, Cosine };

std::string_view to_string(LrDecay d);
std::optional<LrDecay> parse_lr_decay(std::string_view s);

struct LrSchedule {
  float max_lr = 1e-3f;  // reached at the end of the warm-up
  // Step s (1-based) of the warm-up takes max_lr x s / warmup_steps: the first step learns (at
  // max_lr / warmup_steps) and the last warm-up step runs at max_lr. Megatron-LM counts from 0
  // (its first step at a rate of 0); nanoGPT and llm.c count as here.
  int warmup_steps = 0;
  // After the warm-up, from max_lr down to min_lr at step decay_steps (linear or half a cosine);
  // min_lr from then on. Constant: max_lr throughout (decay_steps and min_lr unused).
  LrDecay decay = LrDecay::Constant;
  int decay_steps = 0;
  float min_lr = 0.0f;

  // The rate of step `step` (1-based).
  float at(int step) const;
  // Throws InputError naming the flag when a field is out of range.
  void check() const;
  // Constant schedules hold decay_steps 0 and min_lr 0 (as the CLI and a checkpoint make them).
  bool operator==(const LrSchedule&) const = default;
  // A checkpoint's record, and the description printed at the start of a run.
  nlohmann::json to_json() const;
  std::string describe() const;
};

// A rate as the shortest decimal that reads back as the same float, for JSON (0.003, not
// 0.003000000026077032).
double decimal(float rate);

// A checkpoint's schedule (InputError naming `where` and the field when malformed).
LrSchedule lr_schedule_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace dtsim::exec
