#include "sim/engine/simulator.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "sim/cost/compute_cost.hpp"
#include "sim/cost/profile.hpp"
#include "sim/lower/lowering.hpp"
#include "tests/test_util.hpp"

using dtsim::plan::Plan;

namespace {

dtsim::engine::Simulation run(const std::string& model, const std::string& cluster, Plan plan,
                              dtsim::engine::SimulateOptions options = {}) {
  const auto spec = dtsim::model::load_model(model);
  auto c = dtsim::cluster::load_cluster(cluster);
  dtsim::plan::complete_plan(plan, spec, c.devices());
  dtsim::plan::require_valid(plan, spec, c.devices());
  const dtsim::model::ModelGraph g = dtsim::plan::graph_of(spec, plan);
  auto net = dtsim::network::make_analytical(c);
  return dtsim::engine::simulate(g, plan, c, *net, options);
}

// Rank 0's data-parallel collectives: their indices in its program.
std::vector<std::size_t> dp_collectives(const dtsim::engine::Simulation& sim) {
  std::vector<std::size_t> out;
  const auto& tasks = sim.program.ranks[0].tasks;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].kind == dtsim::lower::TaskKind::Collective &&
        tasks[i].stream == dtsim::lower::Stream::Dp) {
      out.push_back(i);
    }
  }
  return out;
}

Plan blank() {
  Plan p;
  p.dp = 0;
  p.global_batch_size = 0;
  p.seq_len = 0;
  return p;
}

}  // namespace

TEST_CASE("one representative per stage predicts exactly what every rank does",
          "[engine][symmetry]") {
  // All ranks of a stage run the same tasks; on a symmetric placement their groups have the
  // same shape, so every member reaches a collective at the same instant. Simulating all ranks
  // must then give the same times as simulating one representative per stage.
  // Gradient clipping's all-reduce over the whole pipeline too (clip).
  for (auto [tp, pp, sched, zero, sp, clip] :
       {std::tuple{2, 2, dtsim::plan::Schedule::OneFOneB, 0, false, false},
        std::tuple{4, 2, dtsim::plan::Schedule::Interleaved, 1, true, true},
        std::tuple{2, 4, dtsim::plan::Schedule::ZeroBubble, 2, false, true},
        std::tuple{1, 2, dtsim::plan::Schedule::GPipe, 3, false, false}}) {
    DYNAMIC_SECTION("tp=" << tp << " pp=" << pp << " zero=" << zero) {
      Plan p = blank();
      p.tp = tp;
      p.pp = pp;
      p.schedule = sched;
      p.zero_stage = zero;
      p.sequence_parallel = sp;
      if (clip) p.clip_grad = 1.0;
      p.seq_len = 512;
      p.global_batch_size = 32;
      if (sched == dtsim::plan::Schedule::Interleaved) p.virtual_stages = 2;
      dtsim::engine::SimulateOptions all;
      all.lower.mode = dtsim::lower::Lowering::AllRanks;
      const auto rep = run("llama2-7b", "default", p);
      const auto full = run("llama2-7b", "default", p, all);
      CHECK(full.program.ranks.size() == 32);
      CHECK(full.prediction.step_time_s == rep.prediction.step_time_s);
      for (std::size_t r = 0; r < full.program.ranks.size(); ++r) {
        const int stage = full.program.ranks[r].stage;
        const auto& mine = full.timeline.tasks[r];
        const auto& theirs = rep.timeline.tasks[static_cast<std::size_t>(stage)];
        REQUIRE(mine.size() == theirs.size());
        for (std::size_t t = 0; t < mine.size(); ++t) {
          CHECK(mine[t].start_s == theirs[t].start_s);
          CHECK(mine[t].end_s == theirs[t].end_s);
        }
      }
    }
  }
}

TEST_CASE("progress counts every simulation of the step, never back, to its total",
          "[engine][progress]") {
  // With stragglers and a slow rank the step is simulated three times (as is, calm, even):
  // the calls run over all three, 3 x the tasks in all, and end there.
  Plan p = blank();
  p.tp = 2;
  p.pp = 2;
  p.global_batch_size = 64;
  dtsim::engine::SimulateOptions o;
  o.jitter_cv = 0.02;
  o.rank_spread_cv = 0.02;
  o.straggler_cost = true;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> calls;
  o.progress = [&](std::uint64_t done, std::uint64_t total) { calls.emplace_back(done, total); };
  const auto sim = run("tiny", "default", p, o);
  const auto tasks = static_cast<std::uint64_t>(sim.program.task_count());
  REQUIRE(calls.size() >= 3);
  for (std::size_t i = 0; i < calls.size(); ++i) {
    INFO("call " << i);
    CHECK(calls[i].second == 3 * tasks);
    CHECK(calls[i].first <= calls[i].second);
    if (i > 0) CHECK(calls[i].first >= calls[i - 1].first);
  }
  CHECK(calls.back().first == 3 * tasks);
}

TEST_CASE("gradient clipping costs a read of the gradients and three tiny all-reduces",
          "[engine][clip]") {
  // Llama 2 7B, dp 8 x tp 2 x pp 2 on the default cluster: the norm's sum of squares reads
  // each rank's fp32 gradients once (ComputeCost::grad_norm_seconds), and its 4-byte
  // all-reduces are latency; the step grows by about that and no more.
  Plan p = blank();
  p.tp = 2;
  p.pp = 2;
  p.global_batch_size = 64;
  const auto a = run("llama2-7b", "default", p).prediction;
  p.clip_grad = 1.0;
  const auto sim = run("llama2-7b", "default", p);
  const auto b = sim.prediction;
  const auto dev = dtsim::cluster::load_cluster("default").device;
  double norm_s = 0, params = 0;
  for (std::size_t i = 0; i < sim.program.ranks[0].tasks.size(); ++i) {
    const auto& t = sim.program.ranks[0].tasks[i];
    if (t.phase == dtsim::lower::Phase::GradNorm && t.kind == dtsim::lower::TaskKind::Compute) {
      norm_s = sim.timeline.tasks[0][i].end_s - sim.timeline.tasks[0][i].start_s;
      params = static_cast<double>(t.params);
    }
  }
  REQUIRE(params > 0);
  // fp32 gradients at the element-wise kernels' share of the device's memory bandwidth, plus
  // one launch.
  CHECK(norm_s ==
        Approx(params * 4 / (dev.memory_bw_bytes_per_s.value * dev.efficiency.memory_bw.value) +
               dev.efficiency.launch_overhead_s.value)
            .epsilon(1e-9));
  CHECK(b.step_time_s > a.step_time_s);
  CHECK(b.step_time_s - a.step_time_s < 2 * norm_s + 1e-3);
  CHECK(b.breakdown.optimizer_s > a.breakdown.optimizer_s);
}

TEST_CASE("the backward's tp all-reduces hide behind the weight gradients", "[engine][tp]") {
  // Llama 3 8B, tp 8 inside each of the 4 nodes: Megatron-LM's async all-reduce of a
  // column-parallel layer's input gradient runs while its weight gradient computes. Compute is
  // the same either way, so the step shrinks by exactly the communication no longer exposed:
  // at most the backward's share of the tp time (half of the blocks' all-reduces, and the LM
  // head's), less the dp time that the shorter backward no longer hides.
  Plan p = blank();
  p.tp = 8;
  p.global_batch_size = 4;
  p.seq_len = 4096;
  // 16-bit gradients: their dp reduction fits in the backward either way. With fp32 ones it
  // outlasts the backward, and the step ends with it whether or not tp overlaps.
  p.grad_precision = dtsim::Precision::Bf16;
  Plan plain = p;
  plain.overlap_tp_backward = false;
  const auto a = run("llama3-8b", "default", plain).prediction;
  const auto b = run("llama3-8b", "default", p).prediction;
  INFO("exposed tp: " << a.breakdown.exposed_tp_s << " s without overlap, "
                      << b.breakdown.exposed_tp_s << " s with");
  CHECK(b.breakdown.compute_s == Approx(a.breakdown.compute_s).epsilon(1e-12));
  CHECK(b.breakdown.exposed_tp_s < 0.9 * a.breakdown.exposed_tp_s);
  CHECK(b.breakdown.exposed_tp_s > 0.45 * a.breakdown.exposed_tp_s);
  CHECK(b.step_time_s < a.step_time_s);
  CHECK(a.step_time_s - b.step_time_s ==
        Approx(a.breakdown.exposed_comm_s() - b.breakdown.exposed_comm_s()).epsilon(1e-6));
}

TEST_CASE("DDP bucketing hides the gradient all-reduce behind backward", "[engine][ddp]") {
  // Llama 2 7B on 32 A100s, pure data parallelism, one micro-batch of 4 x 4096 tokens per
  // rank: 13.5 GB of bf16 gradients, all-reduced across 4 nodes in less time than backward.
  Plan p = blank();
  p.micro_batch_size = 4;
  p.global_batch_size = 4 * 32;
  dtsim::engine::SimulateOptions one_bucket;
  one_bucket.lower.dp_bucket_bytes = 1ULL << 40;  // everything after backward, nothing hidden
  dtsim::engine::SimulateOptions ddp;             // 25 MB buckets (PyTorch DDP default)
  const auto a = run("llama2-7b", "default", p, one_bucket).prediction;
  const auto b = run("llama2-7b", "default", p, ddp).prediction;
  INFO("exposed dp: one bucket " << a.breakdown.exposed_dp_s << " s, 25 MB buckets "
                                 << b.breakdown.exposed_dp_s << " s; step " << b.step_time_s);
  CHECK(b.breakdown.exposed_dp_s < 0.1 * a.breakdown.exposed_dp_s);
  // Only the last bucket (the embedding's gradient, produced last) stays exposed: ~0.
  CHECK(b.breakdown.exposed_dp_s < 0.01 * b.step_time_s);
  CHECK(a.step_time_s - b.step_time_s ==
        Approx(a.breakdown.exposed_dp_s - b.breakdown.exposed_dp_s).epsilon(1e-6));
}

TEST_CASE("without overlap the gradient reduction follows the whole backward pass",
          "[engine][ddp]") {
  // Same case as above; Megatron-LM's 2021 order: all-reduce after the last backward pass.
  Plan p = blank();
  p.micro_batch_size = 4;
  p.global_batch_size = 4 * 32;
  const auto overlapped = run("llama2-7b", "default", p);
  p.overlap_grad_reduce = false;
  const auto after = run("llama2-7b", "default", p);
  const auto& times = after.timeline.tasks[0];
  const auto& tasks = after.program.ranks[0].tasks;
  REQUIRE(times.size() == tasks.size());
  double last_backward_end = 0, first_bucket_start = 1e30;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].phase == dtsim::lower::Phase::Backward) {
      last_backward_end = std::max(last_backward_end, times[i].end_s);
    }
    if (tasks[i].stream == dtsim::lower::Stream::Dp) {
      first_bucket_start = std::min(first_bucket_start, times[i].start_s);
    }
  }
  REQUIRE(last_backward_end > 0);
  CHECK(first_bucket_start >= last_backward_end);
  // Nothing hidden: the step grows by the reduction the overlapped run hid.
  INFO("exposed dp: overlapped " << overlapped.prediction.breakdown.exposed_dp_s
                                 << " s, after backward " << after.prediction.breakdown.exposed_dp_s
                                 << " s");
  CHECK(after.prediction.breakdown.exposed_dp_s >
        10 * overlapped.prediction.breakdown.exposed_dp_s);
  CHECK(after.prediction.step_time_s > overlapped.prediction.step_time_s);
}

TEST_CASE("the breakdown covers the whole step", "[engine]") {
  Plan p = blank();
  p.tp = 4;
  p.pp = 2;
  p.recompute = dtsim::plan::Recompute::Full;
  p.global_batch_size = 64;
  const auto sim = run("llama3-8b", "default", p);
  const auto& pr = sim.prediction;
  for (const auto& s : pr.stages) {
    const auto& b = s.breakdown;
    CHECK(b.compute_s + b.recompute_s + b.optimizer_s + b.bubble_s + b.exposed_comm_s() ==
          Approx(pr.step_time_s).epsilon(1e-9));
    CHECK(b.straggler_s() == 0);  // no straggler model
  }
  CHECK(pr.breakdown.recompute_s > 0);
  CHECK(pr.breakdown.exposed_tp_s > 0);
  CHECK(pr.hfu > pr.mfu);
  CHECK(pr.tflops_per_gpu == Approx(pr.hardware_flops / pr.step_time_s / 32 / 1e12));
  CHECK(pr.serial_fraction > 0);
  CHECK(pr.max_speedup == Approx(1.0 / pr.serial_fraction));
}

// FlashAttention against the unfused core at a long sequence: the same model and hardware FLOPs
// (Megatron-LM's counts, for MFU and HFU), its executed FLOPs apart, a faster step and less
// memory (no s² tensors).
TEST_CASE("FlashAttention: Megatron-LM's FLOP counts, its own executed FLOPs, faster, smaller",
          "[engine]") {
  Plan p = blank();
  p.tp = 8;
  p.pp = 2;
  p.seq_len = 8192;
  p.global_batch_size = 16;
  const auto unfused = run("llama3-8b", "default", p).prediction;
  p.attention = dtsim::model::AttentionKernel::Flash;
  const auto flash = run("llama3-8b", "default", p).prediction;
  CHECK(flash.model_flops == unfused.model_flops);
  CHECK(flash.hardware_flops == unfused.hardware_flops);
  CHECK(unfused.executed_flops == unfused.hardware_flops);
  const auto spec = dtsim::model::load_model("llama3-8b");
  // One core's forward: 4·b·a·s²·d, dense.
  const double core = 4.0 * spec.heads * 8192.0 * 8192.0 * spec.head_dim;
  CHECK(flash.step_time_s < unfused.step_time_s);
  CHECK(flash.memory.worst().total_bytes < unfused.memory.worst().total_bytes);
  CHECK(std::any_of(flash.notes.begin(), flash.notes.end(), [](const std::string& n) {
    return n.find("attention: FlashAttention at 60% of the dense peak") != std::string::npos;
  }));
  // The FLOPs executed: the causal half of the cores' dense forward and 2.5x it backward (64
  // blocks of 128 rows: 65/128 of the dense block pairs), the rest as counted.
  const auto g = dtsim::plan::graph_of(spec, p);
  const auto f = dtsim::engine::step_flops(g, p);
  const double executed_core = 3.5 * core * 65.0 / 128.0;
  const double counted_core = 3.0 * core;
  CHECK(f.executed ==
        Approx(f.model + 16 * spec.layers * (executed_core - counted_core)).epsilon(1e-9));
  CHECK(flash.executed_flops == f.executed);
  // Recompute runs a core's forward again: the causal half, as the kernel runs it; selective
  // recompute re-runs only the cores, full recompute whole blocks.
  for (const auto r : {dtsim::plan::Recompute::Selective, dtsim::plan::Recompute::Full}) {
    Plan q = p;
    q.recompute = r;
    const auto fr = dtsim::engine::step_flops(dtsim::plan::graph_of(spec, q), q);
    double block_fwd = 0;
    for (auto id : g.layer_ops(0)) {
      const auto& op = g.op(id);
      if (op.kind != dtsim::model::OpKind::AttentionCore) block_fwd += op.fwd_flops;
    }
    const double rerun =
        core * 65.0 / 128.0 + (r == dtsim::plan::Recompute::Full ? block_fwd : 0.0);
    CHECK(fr.executed == Approx(f.executed + 16 * spec.layers * rerun).epsilon(1e-9));
    CHECK(fr.hardware - fr.model ==
          Approx(16 * spec.layers * (core + (r == dtsim::plan::Recompute::Full ? block_fwd : 0.0)))
              .epsilon(1e-9));
  }
  CHECK(std::any_of(flash.notes.begin(), flash.notes.end(), [](const std::string& n) {
    return n.find("MFU and HFU count the attention core dense") != std::string::npos;
  }));
}

// Amdahl's serial fraction is what more dp replicas at the same global batch do not divide: the
// step's speedup from 2 to 16 replicas of a tp 8, pp 2 plan stays under the bound of the first
// and near Amdahl's law for its serial fraction (its dp all-reduce grows a little with the ring).
// Counting the exposed tp time as serial made the bound 4.4x where the step sped up 7.5x.
TEST_CASE("the Amdahl bound holds for more data-parallel replicas at one global batch",
          "[simulator]") {
  const auto spec = dtsim::model::load_model("llama3-8b");
  auto predict = [&](int dp) {
    Plan p = blank();
    p.tp = 8;
    p.pp = 2;
    p.dp = dp;
    p.sequence_parallel = true;
    p.global_batch_size = 256;
    const auto c = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("aws-p5"), 16 * dp);
    dtsim::plan::complete_plan(p, spec, c.devices());
    dtsim::plan::require_valid(p, spec, c.devices());
    const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len);
    auto net = dtsim::network::make_analytical(c);
    return dtsim::engine::simulate(g, p, c, *net, {}).prediction;
  };
  const auto small = predict(2);
  const auto large = predict(16);
  const double speedup = small.step_time_s / large.step_time_s;
  const double s = small.serial_fraction;
  REQUIRE(s > 0);
  CHECK(speedup <= small.max_speedup);
  CHECK(speedup == Approx(1.0 / (s + (1 - s) / 8)).epsilon(0.05));
}

TEST_CASE("simulation is deterministic", "[engine]") {
  Plan p = blank();
  p.tp = 2;
  p.pp = 4;
  p.schedule = dtsim::plan::Schedule::Interleaved;
  p.virtual_stages = 2;
  p.global_batch_size = 64;
  const auto a = run("llama3-8b", "default", p);
  const auto b = run("llama3-8b", "default", p);
  CHECK(a.prediction.step_time_s == b.prediction.step_time_s);
  CHECK(a.timeline.events == b.timeline.events);
}

TEST_CASE("a slow rank paces the step from the busiest stage", "[engine][slow-rank]") {
  // Llama 3 8B over the default cluster's 32 GPUs: the slowest of 32 ranks, E[max of 32
  // normals] = 2.04 spreads slower, computes the busiest stage's share.
  const double spread = 0.02;
  const double slower = spread * dtsim::engine::expected_max_normal(32);
  CHECK(dtsim::engine::slow_rank_factor(spread, 32) == Approx(1 + slower));
  CHECK(dtsim::engine::slow_rank_factor(spread, 1) == 1);
  dtsim::engine::SimulateOptions slow;
  slow.rank_spread_cv = spread;
  SECTION("without a pipeline every compute task of the one stage is slower") {
    Plan p = blank();
    p.tp = 8;
    p.global_batch_size = 16;
    p.seq_len = 2048;
    const auto a = run("llama3-8b", "default", p).prediction;
    const auto b = run("llama3-8b", "default", p, slow).prediction;
    CHECK(b.breakdown.compute_s == Approx(a.breakdown.compute_s * (1 + slower)));
    CHECK(b.breakdown.optimizer_s == Approx(a.breakdown.optimizer_s * (1 + slower)));
    CHECK(b.step_time_s > a.step_time_s);
    CHECK(std::any_of(b.notes.begin(), b.notes.end(), [](const std::string& n) {
      return n.find("slow rank: the ranks' speeds spread 2.0% (std/mean, as given)") == 0;
    }));
  }
  SECTION("with a pipeline the others wait for the slow stage, at most its slowdown") {
    Plan p = blank();
    p.tp = 8;
    p.pp = 4;
    p.global_batch_size = 16;
    p.seq_len = 2048;
    const auto a = run("llama3-8b", "default", p).prediction;
    const auto b = run("llama3-8b", "default", p, slow).prediction;
    // The busiest stage (the last: the LM head) is the slow one, and reported.
    CHECK(b.bottleneck_stage == 3);
    const double busiest = a.stages[3].breakdown.compute_s + a.stages[3].breakdown.recompute_s +
                           a.stages[3].breakdown.optimizer_s;
    const double added = b.step_time_s - a.step_time_s;
    INFO("added " << added << " s; the busiest stage's slowdown " << slower * busiest << " s");
    CHECK(added > 0.5 * slower * busiest);
    CHECK(added < 1.05 * slower * busiest);
    // The other stages compute at their own pace and wait for it.
    CHECK(b.stages[0].breakdown.compute_s == Approx(a.stages[0].breakdown.compute_s));
  }
}

TEST_CASE("what stragglers cost: the step against the same simulation without them",
          "[engine][stragglers]") {
  // Llama 3 8B, dp 4 x tp 4 x pp 2 with 1F1B, at a 3% spread: every kind of wait.
  Plan p = blank();
  p.tp = 4;
  p.pp = 2;
  p.global_batch_size = 32;
  p.seq_len = 2048;
  dtsim::engine::SimulateOptions calm, noisy;
  calm.jitter_cv = 0.0;
  noisy.jitter_cv = 0.03;
  calm.straggler_cost = noisy.straggler_cost = true;
  const auto a = run("llama3-8b", "default", p, calm).prediction;
  const auto b = run("llama3-8b", "default", p, noisy).prediction;
  REQUIRE(a.straggler_cost_s);
  REQUIRE(b.straggler_cost_s);
  CHECK(*a.straggler_cost_s == 0);
  CHECK(a.breakdown.straggler_s() == 0);
  CHECK(*b.straggler_cost_s == Approx(b.step_time_s - a.step_time_s).epsilon(1e-12));
  CHECK(*b.straggler_cost_s > 0);
  // The breakdown's waits are where compute waits on a late rank itself: part of the cost, the
  // rest showing as the work those waits delay.
  CHECK(b.breakdown.straggler_tp_s > 0);
  CHECK(b.breakdown.straggler_s() <= *b.straggler_cost_s);
  for (const auto& s : b.stages) {
    CHECK(s.breakdown.total_s() == Approx(b.step_time_s).epsilon(1e-9));
  }
  // Not asked for: not simulated twice.
  noisy.straggler_cost = false;
  CHECK(!run("llama3-8b", "default", p, noisy).prediction.straggler_cost_s);
}

// ZeRO-1's weight all-gather overlapped with the next step's forward (Megatron-LM
// --overlap-param-gather): less exposed data-parallel time, a shorter step, and the planner's
// closed form sees the same saving.
TEST_CASE("an overlapped ZeRO weight gather hides behind the forward", "[engine]") {
  Plan p = blank();
  p.dp = 32;
  p.zero_stage = 1;
  p.global_batch_size = 64;
  const auto plain = run("llama3-8b", "default", p).prediction;
  p.overlap_param_gather = true;
  const auto overlapped = run("llama3-8b", "default", p).prediction;
  INFO("exposed dp: " << plain.breakdown.exposed_dp_s << " s, overlapped "
                      << overlapped.breakdown.exposed_dp_s << " s");
  CHECK(overlapped.breakdown.exposed_dp_s < 0.5 * plain.breakdown.exposed_dp_s);
  CHECK(overlapped.step_time_s < plain.step_time_s);
  CHECK(overlapped.model_flops == plain.model_flops);
}

TEST_CASE("ZeRO's gathers and reduce-scatters pay their staging copies, an all-reduce none",
          "[engine][zero]") {
  // Llama 2 7B at dp 32 on the default cluster: each data-parallel collective lasts
  // the network's time plus ComputeCost::staging_seconds, which is 0 for ZeRO-0's in-place
  // all-reduce and, for ZeRO's, memory passes: a gather copies the rank's slice in (a cast of
  // its fp32 master to bf16 here), a reduce-scatter packs the bucket and adds the slice.
  const auto spec = dtsim::model::load_model("llama2-7b");
  const auto cluster = dtsim::cluster::load_cluster("default");
  const auto dev = cluster.device;
  const double bw = dev.memory_bw_bytes_per_s.value * dev.efficiency.memory_bw.value;
  const double launch = dev.efficiency.launch_overhead_s.value;
  for (const int stage : {0, 1, 2, 3}) {
    INFO("ZeRO-" << stage);
    Plan p = blank();
    p.zero_stage = stage;
    p.global_batch_size = 64;
    const auto sim = run("llama2-7b", "default", p);
    const auto net = dtsim::network::make_analytical(cluster);
    const dtsim::model::ModelGraph g = dtsim::plan::graph_of(spec, sim.program.plan);
    const dtsim::cost::ComputeCost cost(g, sim.program.plan, dev);
    const dtsim::cluster::Placement layout(sim.program.plan.degrees(), sim.program.plan.order);
    int gathers = 0, reductions = 0;
    for (const std::size_t i : dp_collectives(sim)) {
      const auto& t = sim.program.ranks[0].tasks[i];
      INFO(t.label);
      const auto& group = sim.program.groups.at(static_cast<std::size_t>(t.group));
      const double b = static_cast<double>(t.bytes);
      const auto n = static_cast<std::int64_t>(group.ranks.size());
      REQUIRE(n == 32);
      double staging = 0;
      if (t.collective == dtsim::lower::CollectiveKind::AllGather) {
        staging = 2 * (b / 32) / bw + launch;  // copy-in of the slice, each tensor in place
        ++gathers;
      } else if (t.collective == dtsim::lower::CollectiveKind::ReduceScatter) {
        staging = (2 * b + 3 * b / 32) / bw + 2 * launch;  // pack, then add the slice
        ++reductions;
      } else {
        REQUIRE(t.collective == dtsim::lower::CollectiveKind::AllReduce);
        CHECK(stage == 0);
      }
      CHECK(cost.staging_seconds(t.collective, t.bytes, n) == Approx(staging).epsilon(1e-12));
      const auto& time = sim.timeline.tasks[0][i];
      CHECK(
          time.end_s - time.start_s ==
          Approx(net->collective_s(layout, group, t.collective, t.bytes) + staging).epsilon(1e-9));
    }
    if (stage == 1) {
      // Megatron-LM's distributed optimizer reduces in place: a reduce-scatter takes the
      // network's time alone; its gather casts the updated slice into the bf16 buffer (the
      // staged gather's copy-in); the same FLOPs.
      Plan q = p;
      q.zero_in_place = true;
      const auto in_place = run("llama2-7b", "default", q);
      REQUIRE(in_place.program.ranks[0].tasks.size() == sim.program.ranks[0].tasks.size());
      const dtsim::cluster::Placement in_place_layout(in_place.program.plan.degrees(),
                                                      in_place.program.plan.order);
      int checked = 0;
      for (const std::size_t i : dp_collectives(in_place)) {
        const auto& t = in_place.program.ranks[0].tasks[i];
        const auto& group = in_place.program.groups.at(static_cast<std::size_t>(t.group));
        const auto& time = in_place.timeline.tasks[0][i];
        const double b = static_cast<double>(t.bytes);
        const double copy_in = t.collective == dtsim::lower::CollectiveKind::AllGather
                                   ? 2 * (b / 32) / bw + launch
                                   : 0;
        CHECK(time.end_s - time.start_s ==
              Approx(net->collective_s(in_place_layout, group, t.collective, t.bytes) + copy_in)
                  .epsilon(1e-9));
        ++checked;
      }
      CHECK(checked == gathers + reductions);
      CHECK(in_place.prediction.model_flops == sim.prediction.model_flops);
    }
    if (stage == 0) {
      CHECK(gathers == 0);
      CHECK(reductions == 0);
    } else {
      CHECK(reductions > 0);
      // ZeRO-1/2: the updated weights at once; ZeRO-3: each block's, in both passes of both
      // micro-batches.
      if (stage == 3) {
        CHECK(gathers > 2 * 2 * 32);
      } else {
        CHECK(gathers == 1);
      }
    }
  }
}

TEST_CASE("PipeDream's steady step: every stage's breakdown sums to it", "[engine][pipedream]") {
  // The asynchronous schedule's step leaves out the one-time fill and drain; each stage's
  // breakdown leaves them out too (its bubble is what it waits of the steady step), and the
  // stage that sets the step waits none. Fewer micro-batches than stages: the flushed run's
  // bubbles are most of it.
  for (const std::int64_t batch : {std::int64_t{8}, std::int64_t{128}}) {  // 1 and 16 per pipeline
    DYNAMIC_SECTION("global batch " << batch) {
      Plan p = blank();
      p.pp = 4;  // dp 8 on the default 32 GPUs
      p.schedule = dtsim::plan::Schedule::PipeDreamAsync;
      p.global_batch_size = batch;
      const auto sim = run("gpt2-124m", "default", p);
      const auto& pred = sim.prediction;
      REQUIRE(pred.step_time_s < sim.timeline.makespan_s);
      for (const auto& stage : pred.stages) {
        INFO("stage " << stage.stage);
        CHECK(stage.breakdown.total_s() == Approx(pred.step_time_s));
        CHECK(stage.breakdown.bubble_s >= 0);
      }
      CHECK(pred.stages[static_cast<std::size_t>(pred.bottleneck_stage)].breakdown.bubble_s ==
            Approx(0).margin(1e-12));
      CHECK(pred.breakdown.total_s() == Approx(pred.step_time_s));
    }
  }
}

TEST_CASE("idle compute is charged to the transfer it waits on, not to every one in flight",
          "[engine][breakdown]") {
  using dtsim::lower::Stream;
  using dtsim::lower::Task;
  using dtsim::lower::TaskKind;
  auto compute = [](std::initializer_list<dtsim::lower::TaskId> deps) {
    Task t;
    t.phase = dtsim::lower::Phase::Forward;
    t.deps.assign(deps.begin(), deps.end());
    return t;
  };
  auto collective = [](Stream stream, dtsim::lower::TaskId dep) {
    Task t;
    t.kind = TaskKind::Collective;
    t.stream = stream;
    t.deps.push_back(dep);
    return t;
  };
  // A forward [0, 1); a dp reduce-scatter [1, 5) (ZeRO-2's, through the step) and a tp
  // all-reduce [1, 2) after it; the next forward [2, 3) needs the tp one, the last [5, 6) both.
  dtsim::lower::RankProgram rank;
  rank.tasks = {compute({}), collective(Stream::Dp, 0), collective(Stream::Tp, 0), compute({2}),
                compute({1, 3})};
  std::vector<dtsim::engine::TaskTime> times(5);
  const std::pair<double, double> spans[] = {{0, 1}, {1, 5}, {1, 2}, {2, 3}, {5, 6}};
  for (std::size_t i = 0; i < times.size(); ++i) {
    times[i].start_s = spans[i].first;
    times[i].end_s = spans[i].second;
  }
  SECTION("the wait for the tp all-reduce is tp's; what only the reduce-scatter covers, dp's") {
    const auto b = dtsim::engine::breakdown_of(rank, times, 6);
    CHECK(b.compute_s == Approx(3));
    CHECK(b.exposed_tp_s == Approx(1));  // (split alike with dp before: 0.5)
    CHECK(b.exposed_dp_s == Approx(2));
    CHECK(b.bubble_s == 0);
    // The forward [2, 3) ran beside the reduce-scatter; the others beside nothing.
    CHECK(b.overlapped_s == Approx(1));
  }
  SECTION("a zero-length compute task between the transfer and the forward passes it on") {
    // The forward [2, 3) waits on a zero-length task at 2 that waits on the tp all-reduce.
    rank.tasks.insert(rank.tasks.begin() + 3, compute({2}));
    rank.tasks[4].deps = {3};
    rank.tasks[5].deps = {1, 4};
    times.insert(times.begin() + 3, dtsim::engine::TaskTime{});
    times[3].start_s = times[3].end_s = 2;
    const auto b = dtsim::engine::breakdown_of(rank, times, 6);
    CHECK(b.exposed_tp_s == Approx(1));
    CHECK(b.exposed_dp_s == Approx(2));
  }
  SECTION("a wait for neither (the forward needs no transfer) is split over both alike") {
    rank.tasks[3].deps = {0};
    const auto b = dtsim::engine::breakdown_of(rank, times, 6);
    CHECK(b.exposed_tp_s == Approx(0.5));
    CHECK(b.exposed_dp_s == Approx(2.5));
  }
}

TEST_CASE("the data-parallel stream's collectives take a profile's started rows", "[engine]") {
  // dtexec starts them (MPI_Iallreduce, waited for later), which Open MPI runs slower than the
  // blocking call that the tp and cp collectives make: a CPU profile times both, and the
  // simulator prices the dp stream's by the started rows, the others by the blocking ones.
  const auto profile_with = [](double started_s) {
    nlohmann::json j = {
        {"device", "cpu-host"},
        {"source", "test data"},
        {"precision", "fp32"},
        {"gemm", {{{"m", 64}, {"n", 64}, {"k", 64}, {"seconds", 1e-5}}}},
        {"collectives",
         {{{"kind", "all_reduce"}, {"ranks", 2}, {"bytes", 4096}, {"seconds", 1e-5}},
          {{"kind", "all_reduce"}, {"ranks", 2}, {"bytes", 1 << 20}, {"seconds", 1e-3}}}}};
    if (started_s > 0) {  // the rows above, started_s / 1e-3 times as long
      for (const auto& [bytes, seconds] : {std::pair{4096, 1e-5}, std::pair{1 << 20, 1e-3}}) {
        j["collectives"].push_back({{"kind", "all_reduce"},
                                    {"ranks", 2},
                                    {"bytes", bytes},
                                    {"seconds", seconds * started_s / 1e-3},
                                    {"started", true}});
      }
    }
    return dtsim::cost::profile_from_json(j, "test profile");
  };
  Plan p = blank();
  p.dp = 2;
  p.tp = 1;
  p.precision = dtsim::Precision::Fp32;
  p.micro_batch_size = 4;
  p.global_batch_size = 8;
  const auto blocking = profile_with(0), started = profile_with(4e-3);
  dtsim::engine::SimulateOptions o;
  o.profile = &blocking;
  const auto a = run("tiny-gpt", "cpu-host", p, o);
  o.profile = &started;
  const auto b = run("tiny-gpt", "cpu-host", p, o);
  const auto dp = dp_collectives(a);
  REQUIRE(dp.size() == 1);  // tiny-gpt's gradients, one bucket
  const auto length = [&](const dtsim::engine::Simulation& s) {
    const auto& t = s.timeline.tasks[0][dp.front()];
    return t.end_s - t.start_s;
  };
  // Its ~0.5 MB at the started rows' rate, a quarter of the blocking rows'.
  CHECK(length(b) == Approx(4 * length(a)).epsilon(1e-6));
  // The tp-less, cp-less plan's other collectives: none; the rest of the step alike.
  CHECK(b.prediction.step_time_s - a.prediction.step_time_s ==
        Approx(length(b) - length(a)).epsilon(1e-6));
}
