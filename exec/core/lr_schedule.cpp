#include "exec/core/lr_schedule.hpp"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <numbers>
#include <string>

#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"

namespace dtsim::exec {

std::string_view to_string(LrDecay d) {
  switch (d) {
    case LrDecay::Constant:
      return "constant";
    case LrDecay::Linear:
      return "linear";
    case LrDecay::Cosine:
      return "cosine";
  }
  return "?";
}

std::optional<LrDecay> parse_lr_decay(std::string_view s) {
  for (auto d : {LrDecay::Constant, LrDecay::Linear, LrDecay::Cosine}) {
    if (s == to_string(d)) return d;
  }
  return std::nullopt;
}

float LrSchedule::at(int step) const {
  const double max = max_lr, min = min_lr;
  if (warmup_steps > 0 && step <= warmup_steps)
    return static_cast<float>(max * step / warmup_steps);
  if (decay == LrDecay::Constant) return max_lr;
  if (step >= decay_steps) return min_lr;
  const double ratio =
      static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps - warmup_steps);
  const double coeff =
      decay == LrDecay::Linear ? 1.0 - ratio : 0.5 * (1.0 + std::cos(std::numbers::pi * ratio));
  return static_cast<float>(min + coeff * (max - min));
}

void LrSchedule::check() const {
  if (!(std::isfinite(max_lr) && max_lr > 0)) {
    throw InputError(fmt::format("--lr: expected a positive learning rate, got {}", max_lr));
  }
  if (warmup_steps < 0) {
    throw InputError(fmt::format("--lr-warmup-steps: expected 0 or more, got {}", warmup_steps));
  }
  if (decay == LrDecay::Constant) return;
  if (!(std::isfinite(min_lr) && min_lr >= 0 && min_lr <= max_lr)) {
    throw InputError(
        fmt::format("--min-lr: expected a rate from 0 to --lr ({}), got {}", max_lr, min_lr));
  }
  if (decay_steps <= warmup_steps) {
    throw InputError(fmt::format(
        "--lr-decay-steps {} (default: --steps): expected more than --lr-warmup-steps ({}), "
        "the decay running from the end of the warm-up to that step",
        decay_steps, warmup_steps));
  }
}

double decimal(float rate) {
  return std::stod(fmt::format("{}", rate));
}

nlohmann::json LrSchedule::to_json() const {
  nlohmann::json j{{"max_lr", decimal(max_lr)},
                   {"warmup_steps", warmup_steps},
                   {"decay_style", std::string(to_string(decay))}};
  if (decay != LrDecay::Constant) {
    j["decay_steps"] = decay_steps;
    j["min_lr"] = decimal(min_lr);
  }
  return j;
}

std::string LrSchedule::describe() const {
  std::string s = warmup_steps > 0 ? fmt::format("linear warm-up to {} over {} step{}", max_lr,
                                                 warmup_steps, warmup_steps == 1 ? "" : "s")
                                   : fmt::format("{}", max_lr);
  if (decay == LrDecay::Constant) return s + (warmup_steps > 0 ? ", then constant" : ", constant");
  return s + fmt::format(", {} decay to {} at step {}", to_string(decay), min_lr, decay_steps);
}

LrSchedule lr_schedule_from_json(const nlohmann::json& j, const std::string& where) {
  LrSchedule s;
  const JsonReader r(j, where, "lr_schedule");
  s.max_lr = static_cast<float>(r.positive_number("max_lr"));
  s.warmup_steps =
      static_cast<int>(r.non_negative_int_up_to("warmup_steps", std::numeric_limits<int>::max()));
  const auto style = r.string("decay_style");
  const auto decay = parse_lr_decay(style);
  if (!decay) {
    r.fail("decay_style", fmt::format("expected constant, linear or cosine, got \"{}\"", style));
  }
  s.decay = *decay;
  // (A field the schedule does not read, a constant one's decay_steps included, is refused.)
  if (s.decay == LrDecay::Constant) {
    r.expect_only({"max_lr", "warmup_steps", "decay_style"});
  } else {
    r.expect_only({"max_lr", "warmup_steps", "decay_style", "decay_steps", "min_lr"});
  }
  if (s.decay != LrDecay::Constant) {
    s.decay_steps =
        static_cast<int>(r.positive_int_up_to("decay_steps", std::numeric_limits<int>::max()));
    s.min_lr = static_cast<float>(r.non_negative_number("min_lr"));
  }
  try {
    s.check();
  } catch (const InputError& e) {
    throw InputError(fmt::format("{}: lr_schedule: {}", where, e.what()));
  }
  return s;
}

}  // namespace dtsim::exec
