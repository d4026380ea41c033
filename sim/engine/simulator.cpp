#include "sim/engine/simulator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>

#include "sim/common/error.hpp"
#include "sim/cost/compute_cost.hpp"

namespace dtsim::engine {

namespace {

using lower::Phase;
using lower::Stream;
using lower::TaskKind;

class ModelDurations final : public Durations {
 public:
  // `measured`: a profile whose collective measurements replace the network model (groups
  // inside one node of a size it measured); nullptr for none.
  ModelDurations(cost::ComputeCost& compute, network::NetworkModel& network, const plan::Plan& plan,
                 const cost::Profile* measured)
      : compute_(compute),
        network_(network),
        placement_(plan.degrees(), plan.order),
        measured_(measured) {}
  double compute_s(const lower::Task& task) override { return compute_.task_seconds(task); }
  double collective_s(const lower::Group& group, const lower::Task& task) override {
    // A compressed gradient reduction also runs its codec (plan.grad_compression), which
    // packs and unpacks it; ZeRO's uncompressed ones are staged (ComputeCost::staging_seconds).
    const auto ranks = static_cast<std::int64_t>(group.ranks.size());
    double memory = 0;
    if (task.uncompressed_bytes > 0) {
      memory = compute_.codec_seconds(task.uncompressed_bytes, task.bytes);
    } else if (group.kind == lower::GroupKind::Dp || group.kind == lower::GroupKind::ExpertDp) {
      memory = compute_.staging_seconds(task.collective, task.bytes, ranks);
    }
    // dtexec starts the data-parallel stream's collectives and waits for them later: a CPU
    // profile's started rows time them so (cost::Profile).
    const bool started = task.stream == lower::Stream::Dp;
    if (const auto s = measured(static_cast<int>(task.collective), static_cast<int>(ranks),
                                task.bytes, started)) {
      return *s + memory;
    }
    return network_.collective_s(placement_, group, task.collective, task.bytes) + memory;
  }
  double p2p_s(std::int64_t src, std::int64_t dst, std::uint64_t bytes) override {
    if (const auto s = measured(kSendRecv, 2, bytes)) return *s;
    return network_.p2p_s(placement_, src, dst, bytes);
  }

 private:
  static constexpr int kSendRecv = -1;  // a "kind" for point-to-point transfers

  // The profile's time for a collective kind (or kSendRecv), group size and size; memoized,
  // since the engine asks once per event.
  std::optional<double> measured(int kind, int ranks, std::uint64_t bytes, bool started = false) {
    if (measured_ == nullptr) return std::nullopt;
    const auto key = std::make_tuple(kind, ranks, bytes, started);
    if (const auto it = memo_.find(key); it != memo_.end()) return it->second;
    const std::string name =
        kind == kSendRecv ? "send_recv"
                          : std::string(lower::to_string(static_cast<lower::CollectiveKind>(kind)));
    const auto s = measured_->collective_seconds(name, ranks, static_cast<double>(bytes), started);
    memo_.emplace(key, s);
    return s;
  }

  cost::ComputeCost& compute_;
  network::NetworkModel& network_;
  const cluster::Placement placement_;
  const cost::Profile* measured_;
  std::map<std::tuple<int, int, std::uint64_t, bool>, std::optional<double>> memo_;
};

}  // namespace

Breakdown breakdown_of(const lower::RankProgram& rank, const std::vector<TaskTime>& times,
                       double step_s) {
  // Boundary sweep: +1/-1 per stream category at task starts and ends. A communication task's
  // straggler wait is the wait category of its kind (kWait after the kind's), the rest of its
  // span its kind's.
  enum Category { Compute, Recompute, Optimizer, Tp, Cp, Ep, Dp, Pp, kCategories = Pp + 6 };
  constexpr int kWait = Pp - Tp + 1;
  struct Edge {
    double t;
    int category;
    int delta;
  };
  std::vector<Edge> edges;
  edges.reserve(rank.tasks.size() * 2);
  auto span = [&](double from, double to, int category) {
    if (to <= from) return;
    edges.push_back({from, category, +1});
    edges.push_back({to, category, -1});
  };
  auto category_of = [](const lower::Task& task) {
    int c = Compute;
    if (task.kind == TaskKind::Compute) {
      // Gradient clipping's sum of squares is part of the optimizer step (Megatron-LM's
      // optimizer.step computes the norm).
      c = task.phase == Phase::Recompute         ? Recompute
          : lower::in_optimizer_step(task.phase) ? Optimizer
                                                 : Compute;
    } else {
      switch (task.stream) {
        case Stream::Tp:
          c = Tp;
          break;
        case Stream::Cp:
          c = Cp;
          break;
        case Stream::Ep:
          c = Ep;
          break;
        case Stream::Dp:
          c = Dp;
          break;
        case Stream::Pp:
          c = Pp;
          break;
        case Stream::Compute:
          c = Compute;
          break;
      }
    }
    return c;
  };
  // What each compute task waited on last: the communication categories (bits from Tp) of
  // its dependencies that ended last, none where a compute task did. Idle time before it is
  // charged to those (a tp all-reduce the next layer waits for), not split over every transfer
  // then in flight (ZeRO-2's reduce-scatters, which run through the step on the dp stream,
  // would take half of every tp wait, and the Amdahl fraction count it serial).
  struct Awaited {
    double start_s;
    unsigned categories;
  };
  std::vector<Awaited> awaited;
  for (std::size_t i = 0; i < rank.tasks.size(); ++i) {
    const auto& task = rank.tasks[i];
    const TaskTime& tt = times[i];
    // (Zero-length ones too: one between a transfer and the next compute task is what waited.)
    if (task.kind != TaskKind::Compute) continue;
    double last = -1;
    unsigned categories = 0;
    for (const lower::TaskId d : task.deps) {
      const double end = times[static_cast<std::size_t>(d)].end_s;
      const int c = category_of(rank.tasks[static_cast<std::size_t>(d)]);
      const unsigned bit = c >= Tp ? 1u << c : 0u;
      if (end > last) {
        last = end;
        categories = bit;
      } else if (end == last) {
        categories |= bit;
      }
    }
    awaited.push_back({tt.start_s, categories});
  }
  std::sort(awaited.begin(), awaited.end(),
            [](const Awaited& a, const Awaited& b) { return a.start_s < b.start_s; });
  std::size_t next_compute = 0;
  for (std::size_t i = 0; i < rank.tasks.size(); ++i) {
    const auto& task = rank.tasks[i];
    const TaskTime& tt = times[i];
    if (tt.end_s <= tt.start_s && tt.wait_s <= 0) continue;
    const int c = category_of(task);
    if (tt.wait_s > 0 && c >= Tp) {
      const double wait_end = tt.wait_from_s + tt.wait_s;
      span(tt.wait_from_s, wait_end, c + kWait);
      span(tt.start_s, std::min(tt.end_s, tt.wait_from_s), c);
      span(std::max(tt.start_s, wait_end), tt.end_s, c);
    } else {
      span(tt.start_s, tt.end_s, c);
    }
  }
  std::sort(edges.begin(), edges.end(), [](const Edge& a, const Edge& b) {
    return std::tie(a.t, a.delta, a.category) < std::tie(b.t, b.delta, b.category);
  });
  std::array<int, kCategories> active{};
  std::array<double, kCategories> share{};
  double bubble = 0, overlapped = 0;
  double t = 0;
  auto account = [&](double until) {
    const double dt = until - t;
    if (dt <= 0) return;
    for (int c : {Compute, Recompute, Optimizer}) {
      if (active[static_cast<std::size_t>(c)] > 0) {
        share[static_cast<std::size_t>(c)] += dt;
        for (int k = Tp; k <= Pp; ++k) {
          if (active[static_cast<std::size_t>(k)] > 0) {
            overlapped += dt;
            break;
          }
        }
        return;
      }
    }
    // The compute task that ends this idle time, and what it waits on: of the transfers now in
    // flight, those of its categories (their straggler waits included) take the time; where
    // none is, all of them share it alike.
    while (next_compute < awaited.size() && awaited[next_compute].start_s < until) ++next_compute;
    const unsigned waited_on =
        next_compute < awaited.size() ? awaited[next_compute].categories : 0u;
    auto is_active = [&](int c) { return active[static_cast<std::size_t>(c)] > 0; };
    auto awaits = [&](int c) { return (waited_on >> (c < Tp + kWait ? c : c - kWait) & 1u) != 0; };
    int comms = 0, blocking = 0;
    for (int c = Tp; c < kCategories; ++c) {
      comms += is_active(c) ? 1 : 0;
      blocking += is_active(c) && awaits(c) ? 1 : 0;
    }
    if (comms == 0) {
      bubble += dt;
      return;
    }
    for (int c = Tp; c < kCategories; ++c) {
      if (!is_active(c)) continue;
      if (blocking == 0) {
        share[static_cast<std::size_t>(c)] += dt / comms;
      } else if (awaits(c)) {
        share[static_cast<std::size_t>(c)] += dt / blocking;
      }
    }
  };
  for (const Edge& e : edges) {
    account(std::min(e.t, step_s));
    t = std::max(t, std::min(e.t, step_s));
    active[static_cast<std::size_t>(e.category)] += e.delta;
  }
  account(step_s);
  Breakdown b;
  b.compute_s = share[Compute];
  b.recompute_s = share[Recompute];
  b.optimizer_s = share[Optimizer];
  b.exposed_tp_s = share[Tp];
  b.exposed_cp_s = share[Cp];
  b.exposed_ep_s = share[Ep];
  b.exposed_dp_s = share[Dp];
  b.exposed_pp_s = share[Pp];
  b.straggler_tp_s = share[Tp + kWait];
  b.straggler_cp_s = share[Cp + kWait];
  b.straggler_ep_s = share[Ep + kWait];
  b.straggler_dp_s = share[Dp + kWait];
  b.straggler_pp_s = share[Pp + kWait];
  b.bubble_s = bubble;
  b.overlapped_s = overlapped;
  return b;
}

std::size_t busiest_stage(const std::vector<StagePrediction>& stages) {
  auto busy = [](const Breakdown& b) { return b.compute_s + b.recompute_s + b.optimizer_s; };
  std::size_t busiest = 0;
  for (std::size_t i = 1; i < stages.size(); ++i) {
    if (busy(stages[i].breakdown) > busy(stages[busiest].breakdown)) busiest = i;
  }
  return busiest;
}

double serial_fraction(const Breakdown& b, const plan::Plan& plan, double step_s) {
  // What more data-parallel replicas at this global batch do not divide. Each replica's
  // micro-batches, and with them their compute and their exposed tp, cp, ep and
  // pipeline-transfer time and their waits for late ranks, divide among the replicas; the
  // data-parallel reduction and its wait for the last replica, the bubble ((pp - 1) passes
  // whatever the micro-batch count) and an unsharded optimizer step do not. (ZeRO-3's
  // per-micro-batch gathers are dp communication that does divide: counted serial, the bound
  // is then low.)
  const bool sharded_optimizer = plan.zero_stage >= 1 && plan.dp > 1;
  return (b.exposed_dp_s + b.straggler_dp_s + b.bubble_s +
          (sharded_optimizer ? 0.0 : b.optimizer_s)) /
         step_s;
}

StepFlops step_flops(const model::ModelGraph& graph, const plan::Plan& plan) {
  const double micro_batches_global =
      static_cast<double>(plan.global_batch_size) / static_cast<double>(plan.micro_batch_size);
  const model::GraphTotals totals = graph.totals();
  StepFlops f;
  f.model = (totals.fwd_flops + totals.bwd_flops) * micro_batches_global;
  double recompute = 0;
  double executed = 0;  // per micro-batch
  for (const model::Op& op : graph.ops()) {
    const bool block = op.layer >= 0 && op.layer < graph.spec().layers;
    const bool recomputed =
        (plan.recompute == plan::Recompute::Full && block) ||
        (plan.recompute == plan::Recompute::Selective && op.kind == model::OpKind::AttentionCore);
    // Megatron-LM's count: the forward again, dense. (FlashAttention's scores computed again in
    // its backward are in `executed` only: Megatron-LM's count leaves them out.)
    if (recomputed) recompute += op.fwd_flops;
    executed += op.executed_fwd_flops() * (recomputed ? 2 : 1) + op.executed_bwd_flops();
  }
  f.hardware = f.model + recompute * micro_batches_global;
  f.executed = executed * micro_batches_global;
  return f;
}

double jitter_cv_of(const std::optional<double>& given, const cost::Profile* profile) {
  return given.value_or(profile != nullptr ? profile->jitter_cv.value_or(0.0) : 0.0);
}

double rank_spread_cv_of(const std::optional<double>& given, const cost::Profile* profile) {
  return given.value_or(profile != nullptr ? profile->rank_spread_cv.value_or(0.0) : 0.0);
}

double slow_rank_factor(double spread, std::int64_t ranks) {
  return 1.0 + spread * expected_max_normal(ranks);
}

namespace {

// The program that computes the most in a step (the pipeline's bottleneck); ties: the first.
std::int32_t busiest_program(const lower::Program& program, cost::ComputeCost& compute) {
  std::int32_t busiest = 0;
  double most = -1;
  for (std::size_t i = 0; i < program.ranks.size(); ++i) {
    double seconds = 0;
    for (const lower::Task& t : program.ranks[i].tasks) {
      if (t.kind == lower::TaskKind::Compute) seconds += compute.task_seconds(t);
    }
    if (seconds > most) {
      most = seconds;
      busiest = static_cast<std::int32_t>(i);
    }
  }
  return busiest;
}

// Each rank program's breakdown of `timeline`, as its stage's.
std::vector<StagePrediction> stage_predictions(const lower::Program& program,
                                               const Timeline& timeline) {
  std::vector<StagePrediction> stages;
  for (std::size_t i = 0; i < program.ranks.size(); ++i) {
    const auto& rp = program.ranks[i];
    stages.push_back({rp.stage, rp.rank, breakdown_of(rp, timeline.tasks[i], timeline.makespan_s)});
  }
  return stages;
}

// PipeDream's asynchronous step (no flush between steps): in steady state the pipeline stays
// full, so a step costs the busiest stage's busy time (the makespan less its bubble; the
// fill/drain bubble is paid once per run, not per step). That stage and its time; ties: the
// first.
std::pair<std::size_t, double> steady_stage(const std::vector<StagePrediction>& stages,
                                            double makespan_s) {
  std::size_t busiest = 0;
  double steady = -1;
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const double busy_s = makespan_s - stages[i].breakdown.bubble_s;
    if (busy_s > steady) {
      steady = busy_s;
      busiest = i;
    }
  }
  return {busiest, steady};
}

}  // namespace

Simulation simulate(const model::ModelGraph& graph, const plan::Plan& plan,
                    const cluster::Cluster& cluster, network::NetworkModel& network,
                    const SimulateOptions& options) {
  Simulation sim;
  sim.program = lower::lower(graph, plan, options.lower);
  cost::ComputeCost compute(graph, plan, cluster.device, options.profile);
  // Measured collectives stand for groups inside one node (where the profile measured them).
  const bool one_node = cluster.nodes == 1;
  ModelDurations durations(compute, network, plan,
                           options.profile != nullptr && one_node ? options.profile : nullptr);
  EngineOptions engine;
  engine.jitter_cv = jitter_cv_of(options.jitter_cv, options.profile);
  engine.serial_ranks = cluster.serial_ranks_source.has_value();
  const double rank_spread = rank_spread_cv_of(options.rank_spread_cv, options.profile);
  if (rank_spread > 0 && plan.devices() > 1) {
    engine.slow_program = busiest_program(sim.program, compute);
    engine.slow_factor = slow_rank_factor(rank_spread, plan.devices());
  }
  // The progress of every simulation this runs, one after the other: this one, and with
  // straggler_cost the calm and even ones.
  const std::uint64_t runs = options.straggler_cost ? 1 + (engine.jitter_cv > 0 ? 1 : 0) +
                                                          (engine.slow_program >= 0 ? 1 : 0)
                                                    : 1;
  std::uint64_t run_index = 0;
  const auto progress_of_run = [&]() -> std::function<void(std::uint64_t, std::uint64_t)> {
    if (!options.progress) return {};
    const std::uint64_t k = run_index++;
    return [&options, k, runs](std::uint64_t done, std::uint64_t total) {
      options.progress(k * total + done, runs * total);
    };
  };
  engine.progress = progress_of_run();
  sim.timeline = run(sim.program, durations, engine);

  Prediction& p = sim.prediction;
  p.network = network.name();
  p.gpus = plan.devices();
  p.tasks = sim.program.task_count();
  p.events = sim.timeline.events;
  p.stages = stage_predictions(sim.program, sim.timeline);
  p.bottleneck_stage = static_cast<int>(busiest_stage(p.stages));
  p.breakdown = p.stages[static_cast<std::size_t>(p.bottleneck_stage)].breakdown;
  p.step_time_s = sim.timeline.makespan_s;
  const bool pipedream = plan.schedule == plan::Schedule::PipeDreamAsync && plan.pp > 1;
  if (pipedream) {
    // The stage that sets the step is the one reported, so that its breakdown, less the bubble,
    // sums to the step time.
    const auto [stage, steady] = steady_stage(p.stages, sim.timeline.makespan_s);
    p.bottleneck_stage = static_cast<int>(stage);
    p.step_time_s = steady;
    // Every stage runs at that pace in steady state: its bubble is what it waits of the steady
    // step (the flushed run's, less the fill and drain), so that each stage's breakdown sums to
    // the step time, as the synchronous schedules' do.
    const double fill_drain = sim.timeline.makespan_s - steady;
    for (StagePrediction& s : p.stages) {
      s.breakdown.bubble_s = std::max(0.0, s.breakdown.bubble_s - fill_drain);
    }
    p.breakdown = p.stages[static_cast<std::size_t>(p.bottleneck_stage)].breakdown;
    p.breakdown.bubble_s = 0;
    p.notes.push_back(
        "pipedream: asynchronous steady state (no flush); step time and each stage's breakdown "
        "exclude the one-time pipeline fill and drain, which the trace's run includes");
  }
  if (plan.attention == model::AttentionKernel::Unfused) {
    // Where the unfused kernel's s² tensors weigh, say that another kernel exists.
    double quadratic = 0, saved = 0;
    for (model::OpId id : graph.layer_ops(0)) {
      quadratic += static_cast<double>(graph.op(id).saved_quadratic_bytes);
      saved += static_cast<double>(graph.op(id).saved_bytes);
    }
    // Over a quarter: a threshold of dtsim's for saying so, not a modelling figure.
    if (saved > 0 && quadratic > 0.25 * saved) {
      p.notes.push_back(fmt::format(
          "attention: unfused (the default, as in Megatron-LM's published runs): its s² tensors "
          "are {:.0f}% of what a block keeps without recompute; --attention flash prices "
          "FlashAttention",
          100 * quadratic / saved));
    }
  }
  if (plan.attention == model::AttentionKernel::Flash) {
    const bool measured =
        options.profile != nullptr && options.profile->ops.count({"flash_attention", "fwd"}) != 0;
    p.notes.push_back(
        measured
            ? std::string("attention: FlashAttention's memory, at the profile's measured rate of "
                          "dtexec's kernels (on a GPU: cuBLAS over one sequence's scratch, not "
                          "FlashAttention's fused kernel)")
            : fmt::format(
                  "attention: FlashAttention at {:.0f}% of the dense peak (the "
                  "device's attention efficiency) over the FLOPs it executes: the "
                  "causal mask's blocks skipped, the scores computed again in the "
                  "backward{}",
                  100 * cluster.device.efficiency.attention.value,
                  options.profile != nullptr ? "; the profile has no flash_attention rate"
                  : cluster.device.efficiency.attention.source.rfind("dtexec calibrate", 0) == 0
                      ? "; that efficiency is dtexec's unfused kernel's, in dense FLOPs: a "
                        "dtexec calibrate profile prices FlashAttention's"
                      : ""));
  }
  if (!cluster.device_efficiency_overrides.empty()) {
    p.notes.push_back(fmt::format(
        "{} sets the device's {} efficiency itself (its device_efficiency), in place of the "
        "device catalog's",
        cluster.name, fmt::join(cluster.device_efficiency_overrides, ", ")));
  }
  if (plan.pp > 1) {
    p.notes.push_back(
        plan.overlap_p2p_comm
            ? "pipeline transfers overlap compute (--overlap-p2p-comm): receives are posted "
              "ahead of need"
            : "pipeline transfers block, as Megatron-LM's do by default: between rounds of "
              "passes a stage posts its receives once its compute has ended and waits for them "
              "(with GPipe, 1F1B and interleaved, for its sends to be received too); "
              "--overlap-p2p-comm overlaps them");
  }
  if (engine.serial_ranks) {
    p.notes.push_back(fmt::format(
        "{} says its communication does not progress while a rank computes ({}): each rank runs "
        "its tasks one at a time, in program order",
        cluster.file.empty() ? cluster.name : cluster.file, *cluster.serial_ranks_source));
  }
  if (engine.jitter_cv > 0) {
    p.notes.push_back(fmt::format(
        "stragglers: compute time spread {:.1f}% (std/mean, {}); each collective and pipeline "
        "transfer waits for the last of its ranks, each early or late by that spread of its "
        "compute since they last met, modelled as independent normal spreads (an "
        "approximation)",
        100 * engine.jitter_cv, options.jitter_cv ? "as given" : "the profile's jitter_cv"));
  }

  if (engine.slow_program >= 0) {
    p.notes.push_back(fmt::format(
        "slow rank: the ranks' speeds spread {:.1f}% (std/mean, {}); the slowest of {} computes "
        "{:.1f}% slower, on stage {} (the busiest), and the others wait for it (an "
        "approximation: normal, independent speeds)",
        100 * rank_spread, options.rank_spread_cv ? "as given" : "the profile's rank_spread_cv",
        plan.devices(), 100 * (engine.slow_factor - 1),
        sim.program.ranks[static_cast<std::size_t>(engine.slow_program)].stage));
  }

  const StepFlops flops = step_flops(graph, plan);
  p.model_flops = flops.model;
  p.hardware_flops = flops.hardware;
  p.executed_flops = flops.executed;
  const double gpus = static_cast<double>(p.gpus);
  const double peak = cluster.device.peak_flops_for(plan.precision);
  p.tokens_per_s = static_cast<double>(plan.global_batch_size * plan.seq_len) / p.step_time_s;
  p.tflops_per_gpu = p.hardware_flops / (p.step_time_s * gpus) / 1e12;
  p.model_tflops_per_gpu = p.model_flops / (p.step_time_s * gpus) / 1e12;
  p.mfu = p.model_flops / (p.step_time_s * gpus * peak);
  p.hfu = p.hardware_flops / (p.step_time_s * gpus * peak);
  if (graph.attention() == model::AttentionKernel::Flash) {
    p.notes.push_back(fmt::format(
        "MFU and HFU count the attention core dense, as Megatron-LM's formula does; the step's "
        "kernels execute {:.0f}% of the hardware FLOPs (FlashAttention skips the causal mask's "
        "blocks and computes its scores again in the backward): {:.1f}% of the peak by the "
        "FLOPs executed (executed_flops_per_step)",
        100 * flops.executed / flops.hardware,
        100 * flops.executed / (p.step_time_s * gpus * peak)));
  }
  if (options.straggler_cost) {
    auto step_with = [&](EngineOptions o) {
      o.progress = progress_of_run();
      const Timeline t = run(sim.program, durations, o);
      return pipedream ? steady_stage(stage_predictions(sim.program, t), t.makespan_s).second
                       : t.makespan_s;
    };
    EngineOptions calm = engine;
    calm.jitter_cv = 0;
    const double calm_step = engine.jitter_cv > 0 ? step_with(calm) : p.step_time_s;
    p.straggler_cost_s = p.step_time_s - calm_step;
    p.slow_rank_cost_s = 0.0;
    if (engine.slow_program >= 0) {
      EngineOptions even = calm;
      even.slow_program = -1;
      even.slow_factor = 1.0;
      p.slow_rank_cost_s = calm_step - step_with(even);
    }
  }
  p.serial_fraction = serial_fraction(p.breakdown, plan, p.step_time_s);
  p.max_speedup = p.serial_fraction > 0 ? 1.0 / p.serial_fraction : 0.0;
  p.memory = plan::estimate_memory(graph, plan, cluster, options.memory);
  return sim;
}

}  // namespace dtsim::engine
