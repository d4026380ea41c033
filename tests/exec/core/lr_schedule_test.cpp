#include "exec/core/lr_schedule.hpp"

#include <catch2/catch.hpp>
#include <cmath>
#include <numbers>

#include "sim/common/error.hpp"

using dtsim::exec::LrDecay;
using dtsim::exec::LrSchedule;

namespace {

LrSchedule schedule(int warmup, LrDecay decay, int decay_steps, float min_lr) {
  LrSchedule s;
  s.max_lr = 1e-3f;
  s.warmup_steps = warmup;
  s.decay = decay;
  s.decay_steps = decay_steps;
  s.min_lr = min_lr;
  s.check();
  return s;
}

}  // namespace

TEST_CASE("lr schedule: constant, with and without a warm-up", "[exec][lr]") {
  const auto flat = schedule(0, LrDecay::Constant, 0, 0);
  CHECK(flat.at(1) == 1e-3f);
  CHECK(flat.at(1000) == 1e-3f);
  // Warm-up over 4 steps: step s at max x s / 4, the fourth at max, then max.
  const auto warm = schedule(4, LrDecay::Constant, 0, 0);
  CHECK(warm.at(1) == Approx(0.25e-3));
  CHECK(warm.at(2) == Approx(0.5e-3));
  CHECK(warm.at(4) == 1e-3f);
  CHECK(warm.at(5) == 1e-3f);
}

TEST_CASE("lr schedule: linear and cosine decay after the warm-up", "[exec][lr]") {
  // Warm-up 2, decay to 1e-4 at step 12: the decay runs over steps 2..12 (ratio (s - 2) / 10).
  const auto lin = schedule(2, LrDecay::Linear, 12, 1e-4f);
  CHECK(lin.at(2) == Approx(1e-3));
  CHECK(lin.at(7) == Approx(1e-4 + 0.5 * 9e-4));  // ratio 0.5
  CHECK(lin.at(12) == Approx(1e-4));
  CHECK(lin.at(50) == 1e-4f);  // the floor after the decay
  const auto cos = schedule(2, LrDecay::Cosine, 12, 1e-4f);
  CHECK(cos.at(7) == Approx(1e-4 + 0.5 * 9e-4));  // half a cosine: the mean at the midpoint
  // Step 5, ratio 0.3: 0.5 (1 + cos(0.3 pi)) of the range above the floor.
  CHECK(cos.at(5) == Approx(1e-4 + 0.5 * (1 + std::cos(std::numbers::pi * 0.3)) * 9e-4));
  CHECK(cos.at(12) == Approx(1e-4));
  // Falls monotonically from the end of the warm-up.
  for (int s = 3; s <= 12; ++s) CHECK(cos.at(s) < cos.at(s - 1));
}

TEST_CASE("lr schedule: out-of-range fields name their flag", "[exec][lr]") {
  LrSchedule s;
  s.max_lr = 0;
  CHECK_THROWS_WITH(s.check(), "--lr: expected a positive learning rate, got 0");
  s.max_lr = 1e-3f;
  s.warmup_steps = -1;
  CHECK_THROWS_WITH(s.check(), "--lr-warmup-steps: expected 0 or more, got -1");
  s.warmup_steps = 5;
  s.decay = LrDecay::Cosine;
  s.decay_steps = 5;
  CHECK_THROWS_WITH(s.check(),
                    Catch::Contains("--lr-decay-steps 5 (default: --steps): expected more "
                                    "than --lr-warmup-steps (5)"));
  s.decay_steps = 6;
  s.min_lr = 2e-3f;
  CHECK_THROWS_WITH(s.check(), Catch::Contains("--min-lr: expected a rate from 0 to --lr"));
}

TEST_CASE("lr schedule: a checkpoint's JSON reads back as the same schedule", "[exec][lr]") {
  const auto s = schedule(3, LrDecay::Cosine, 20, 3e-5f);
  const auto j = s.to_json();
  CHECK(j.at("max_lr").get<double>() == 0.001);  // the shortest decimal of the float
  CHECK(dtsim::exec::lr_schedule_from_json(j, "ck/checkpoint.json") == s);
  auto bad = j;
  bad["decay_style"] = "step";
  CHECK_THROWS_WITH(dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json"),
                    "ck/checkpoint.json: lr_schedule.decay_style: expected constant, linear or "
                    "cosine, got \"step\"");
  bad = j;
  bad.erase("warmup_steps");
  CHECK_THROWS_WITH(dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json"),
                    "ck/checkpoint.json: lr_schedule.warmup_steps: required field is missing");
  bad["warmup_steps"] = 1.5;
  CHECK_THROWS_WITH(dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json"),
                    "ck/checkpoint.json: lr_schedule.warmup_steps: expected a whole number "
                    "from 0 to 2147483647, got 1.5");
  bad["warmup_steps"] = -1;
  CHECK_THROWS_WITH(dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json"),
                    Catch::Contains("lr_schedule.warmup_steps: expected a whole number from 0"));
  bad["warmup_steps"] = 0;
  CHECK(dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json").warmup_steps == 0);
  bad = j;
  bad["decay_steps"] = "20";
  CHECK_THROWS_WITH(dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json"),
                    Catch::Contains("lr_schedule.decay_steps: expected a positive integer"));
  bad = j;
  bad["min_lr"] = 1.0;
  CHECK_THROWS_WITH(dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json"),
                    Catch::Contains("ck/checkpoint.json: lr_schedule: --min-lr: expected"));
  // A field the schedule does not read (a hand edit, another version's) is refused, as the
  // index's own unknown fields are: a constant schedule's decay_steps too.
  bad = j;
  bad["warmup_iters"] = 3;
  CHECK_THROWS_WITH(
      dtsim::exec::lr_schedule_from_json(bad, "ck/checkpoint.json"),
      Catch::StartsWith("ck/checkpoint.json: lr_schedule.warmup_iters: unknown field"));
  auto constant = schedule(0, LrDecay::Constant, 0, 0).to_json();
  CHECK_FALSE(constant.contains("decay_steps"));
  constant["decay_steps"] = 20;
  CHECK_THROWS_WITH(
      dtsim::exec::lr_schedule_from_json(constant, "ck/checkpoint.json"),
      Catch::StartsWith("ck/checkpoint.json: lr_schedule.decay_steps: unknown field"));
  CHECK(dtsim::exec::parse_lr_decay("linear") == LrDecay::Linear);
  CHECK_FALSE(dtsim::exec::parse_lr_decay("Cosine"));
}
