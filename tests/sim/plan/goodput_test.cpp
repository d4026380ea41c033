#include "sim/plan/goodput.hpp"

#include <catch2/catch.hpp>
#include <cmath>

#include "sim/model/model_graph.hpp"
#include "sim/model/model_spec.hpp"
#include "sim/plan/memory_model.hpp"

using dtsim::plan::Reliability;
using dtsim::plan::training_time;

namespace {

dtsim::plan::Plan plan_of(std::int64_t gbs, std::int64_t seq) {
  dtsim::plan::Plan p;
  p.global_batch_size = gbs;
  p.seq_len = seq;
  return p;
}

}  // namespace

TEST_CASE("goodput: Llama 3 405B on 16,384 GPUs, the run the defaults come from",
          "[plan][goodput]") {
  const auto spec = dtsim::model::load_model("llama3-405b");
  const auto p = plan_of(2048, 8192);  // 16.8M tokens per step
  const double step_s = 13.0, tokens = 15.6e12;
  const auto t = training_time(spec, p, 16384, step_s, tokens, Reliability{});
  // 419 interruptions in 54 days: the job's MTBF is 54 x 24 x 3600 / 419 = 11,135 s (3.1 h).
  CHECK(t.job_mtbf_s == Approx(54.0 * 24 * 3600 / 419));
  // The checkpoint: bf16 weights (2) and Adam's fp32 master copy, momentum and variance (12)
  // per parameter, of the padded vocabulary's model; written at 2 TB/s in all.
  const double params =
      static_cast<double>(dtsim::model::count_params(dtsim::plan::with_padded_vocab(spec, p)));
  CHECK(t.checkpoint_bytes == Approx(14 * params));
  CHECK(t.checkpoint_write_s == Approx(14 * params / 2e12));
  // Young: sqrt(2 x 2.8 s x 11,135 s) = 250 s, 19 steps of 13 s.
  const double young = std::sqrt(2 * t.checkpoint_write_s * t.job_mtbf_s);
  CHECK(t.checkpoint_every_steps == std::llround(young / step_s));
  const double interval = static_cast<double>(t.checkpoint_every_steps) * step_s;
  // Each interruption loses half an interval and its write on average (no restart given).
  const double useful = 1 - 0.5 * (interval + t.checkpoint_write_s) / t.job_mtbf_s;
  CHECK(t.steps == Approx(tokens / (2048.0 * 8192)));
  CHECK(t.work_s == Approx(t.steps * step_s));
  CHECK(t.wall_s == Approx(t.work_s * (1 + t.checkpoint_write_s / interval) / useful));
  CHECK(t.goodput == Approx(t.work_s / t.wall_s));
  // About 2% lost without restarts; Meta reports over 90% effective training time with them.
  CHECK(t.goodput > 0.97);
  CHECK(t.goodput < 0.99);
  // Ten minutes per restart: 600 s of every 11,135 more.
  Reliability slow;
  slow.restart_s = 600;
  const auto r = training_time(spec, p, 16384, step_s, tokens, slow);
  CHECK(r.wall_s ==
        Approx(t.work_s * (1 + t.checkpoint_write_s / interval) / (useful - 600 / t.job_mtbf_s)));
}

TEST_CASE("goodput: more devices, interruptions more often, and a job that never finishes",
          "[plan][goodput]") {
  const auto spec = dtsim::model::load_model("llama3-8b");
  const auto p = plan_of(512, 8192);
  const auto small = training_time(spec, p, 64, 2.0, 1e12, Reliability{});
  const auto big = training_time(spec, p, 4096, 2.0, 1e12, Reliability{});
  CHECK(big.job_mtbf_s == Approx(small.job_mtbf_s / 64));
  // With the defaults, each device writing its share at a rate of its own and no restart
  // time, the write, Young's interval and the MTBF all shrink as 1/devices: the fraction lost
  // is the same at any size, but for the interval's rounding to whole steps.
  CHECK(big.checkpoint_write_s == Approx(small.checkpoint_write_s / 64));
  CHECK(big.goodput == Approx(small.goodput).epsilon(1e-4));
  // What does not shrink costs more on more devices: a restart of fixed length, or a storage
  // whose total bandwidth caps the devices' writes.
  Reliability restarts;
  restarts.restart_s = 600;
  CHECK(training_time(spec, p, 4096, 2.0, 1e12, restarts).goodput <
        training_time(spec, p, 64, 2.0, 1e12, restarts).goodput);
  Reliability capped;
  capped.checkpoint_write_bytes_per_s_total = 64 * capped.checkpoint_write_bytes_per_s_per_device;
  CHECK(training_time(spec, p, 4096, 2.0, 1e12, capped).goodput <
        training_time(spec, p, 64, 2.0, 1e12, capped).goodput);
  // A faster store: shorter writes, a shorter interval, more goodput.
  Reliability fast;
  fast.checkpoint_write_bytes_per_s_per_device *= 10;
  const auto quick = training_time(spec, p, 4096, 2.0, 1e12, fast);
  CHECK(quick.checkpoint_write_s == Approx(big.checkpoint_write_s / 10));
  CHECK(quick.checkpoint_every_steps < big.checkpoint_every_steps);
  CHECK(quick.goodput > big.goodput);
  // Restarts longer than the time between interruptions: the job never finishes.
  Reliability hopeless;
  hopeless.restart_s = 2 * big.job_mtbf_s;
  const auto never = training_time(spec, p, 4096, 2.0, 1e12, hopeless);
  CHECK(never.goodput == 0);
  CHECK(std::isinf(never.wall_s));
  // A run shorter than Young's interval checkpoints once, at its end.
  const auto short_run = training_time(spec, p, 8, 2.0, 512.0 * 8192 * 10, Reliability{});
  CHECK(short_run.checkpoint_every_steps == 10);
}

TEST_CASE("goodput: asynchronous checkpoints stop training only for the copy to host memory",
          "[plan][goodput]") {
  const auto spec = dtsim::model::load_model("llama3-405b");
  const auto p = plan_of(2048, 8192);
  const double step_s = 13.0, tokens = 15.6e12;
  const auto sync = training_time(spec, p, 16384, step_s, tokens, Reliability{});
  Reliability async;
  async.checkpoint_snapshot_bytes_per_s_per_device = 25e9;  // a device-to-host copy
  const auto t = training_time(spec, p, 16384, step_s, tokens, async);
  CHECK_FALSE(sync.asynchronous);
  CHECK(sync.checkpoint_blocking_s == sync.checkpoint_write_s);
  CHECK(t.asynchronous);
  CHECK(t.checkpoint_write_s == Approx(sync.checkpoint_write_s));
  // 5.7 TB over 16,384 devices at 25 GB/s each: 14 ms.
  CHECK(t.checkpoint_blocking_s == Approx(t.checkpoint_bytes / (25e9 * 16384)));
  // Young's interval on the copy: sqrt(2 x 14 ms x 11,135 s) = 17.6 s, 1 step of 13 s; no
  // shorter than a write (2.8 s: 1 step).
  const double young = std::sqrt(2 * t.checkpoint_blocking_s * t.job_mtbf_s);
  CHECK(t.checkpoint_every_steps == std::max<std::int64_t>(1, std::llround(young / step_s)));
  const double interval = static_cast<double>(t.checkpoint_every_steps) * step_s;
  // A failure loses half an interval and the whole write (the newest checkpoint is not durable
  // until it ends).
  const double useful = 1 - (0.5 * interval + t.checkpoint_write_s) / t.job_mtbf_s;
  CHECK(t.wall_s == Approx(t.work_s * (1 + t.checkpoint_blocking_s / interval) / useful));
  CHECK(t.goodput > sync.goodput);
  CHECK(t.goodput > 0.99);
  // A write longer than Young's interval: checkpoints no closer than one write apart.
  Reliability slow_store = async;
  slow_store.checkpoint_write_bytes_per_s_per_device /= 100;  // 284 s a write
  const auto slow = training_time(spec, p, 16384, step_s, tokens, slow_store);
  CHECK(static_cast<double>(slow.checkpoint_every_steps) * step_s >= slow.checkpoint_write_s);
  CHECK(slow.checkpoint_every_steps ==
        static_cast<std::int64_t>(std::ceil(slow.checkpoint_write_s / step_s)));
}

TEST_CASE("goodput: a storage system's total write bandwidth caps the devices' sum",
          "[plan][goodput]") {
  const auto spec = dtsim::model::load_model("llama3-70b");
  const auto p = plan_of(1024, 8192);
  Reliability capped;
  capped.checkpoint_write_bytes_per_s_total = 500e9;
  for (const std::int64_t gpus : {1024, 16384}) {
    const auto free = training_time(spec, p, gpus, 5.0, 1.5e13, Reliability{});
    const auto t = training_time(spec, p, gpus, 5.0, 1.5e13, capped);
    // 0.122 GB/s per GPU: 125 GB/s in all on 1,024 (under the cap), 2 TB/s on 16,384 (over).
    const double sum =
        Reliability{}.checkpoint_write_bytes_per_s_per_device * static_cast<double>(gpus);
    CHECK(t.checkpoint_write_s == Approx(t.checkpoint_bytes / std::min(sum, 500e9)));
    if (sum <= 500e9) {
      CHECK(t.goodput == free.goodput);
    } else {
      CHECK(t.checkpoint_write_s > free.checkpoint_write_s);
      CHECK(t.goodput < free.goodput);
    }
  }
}

// Whole checkpoints: a run a token longer than one step writes no fewer checkpoints than the
// step alone (a fraction of one made it 14 s shorter, with 29 s checkpoints); more tokens never
// take less time.
TEST_CASE("goodput: more tokens never take less time", "[plan][goodput]") {
  const auto spec = dtsim::model::load_model("llama3-8b");
  const auto p = plan_of(256, 8192);  // 2,097,152 tokens per step
  const double step_s = 25.3, per_step = 256.0 * 8192;
  double before = 0;
  for (double tokens :
       {per_step, per_step + 1, 2 * per_step, 2 * per_step + 1, 3 * per_step, 1e9, 1e9 + 1, 1e12}) {
    INFO(tokens);
    const auto t = training_time(spec, p, 8, step_s, tokens, Reliability{});
    CHECK(t.checkpoints ==
          std::max(1.0, std::ceil(t.steps / static_cast<double>(t.checkpoint_every_steps))));
    CHECK(t.wall_s >= before);
    before = t.wall_s;
  }
  const auto one = training_time(spec, p, 8, step_s, per_step, Reliability{});
  CHECK(one.checkpoints == 1);
  CHECK(one.wall_s == Approx((one.work_s + one.checkpoint_write_s) /
                             (1 - 0.5 * (step_s + one.checkpoint_write_s) / one.job_mtbf_s)));
}
