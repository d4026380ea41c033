// dtsim simulate: predicted step time of a plan, its breakdown, memory, MFU; JSON and a trace.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/common/units.hpp"
#include "sim/cost/compute_cost.hpp"
#include "sim/engine/simulator.hpp"
#include "sim/report/breakdown_json.hpp"
#include "sim/report/json_values.hpp"
#include "sim/report/table.hpp"
#include "sim/report/trace.hpp"

namespace dtsim::cli {

namespace {

using nlohmann::json;

std::string ms(double s) {
  return fmt::format("{:.2f}", s * 1e3);
}
std::string pct(double part, double whole) {
  return fmt::format("{:.1f}%", whole > 0 ? 100.0 * part / whole : 0.0);
}

}  // namespace

int cmd_simulate(const std::vector<std::string>& args) {
  po::options_description desc("dtsim simulate options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/true, "--plan");
  add_plan_options(desc);
  po::options_description sim_opts("Simulation");
  sim_opts.add_options()(
      "network", po::value<std::string>()->default_value("analytical"),
      "network model: analytical (alpha-beta per collective algorithm) or simgrid "
      "(flow-level: concurrent groups contend for NICs and uplinks); without the flag, the one "
      "a --plan file was simulated on (dtsim plan --network simgrid --out writes it)")(
      "trace", po::value<std::string>(), "write a Chrome trace (open in ui.perfetto.dev)")(
      "json", po::bool_switch(), "print JSON instead of tables")(
      "tokens", po::value<double>(),
      "training tokens: the time (and, with the cluster's price, the cost) to train on them, "
      "failure-free and with interruptions (see the reliability flags)");
  add_memory_options(sim_opts);
  sim_opts.add_options()("profile", po::value<std::string>(),
                         "calibration profile (dtexec calibrate) for the compute cost");
  add_jitter_option(sim_opts);
  desc.add(sim_opts);
  po::options_description interruptions("Time to train with interruptions (with --tokens)");
  add_reliability_options(interruptions);
  add_price_option(interruptions);
  desc.add(interruptions);
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtsim simulate --model M --cluster C [plan flags | --plan P.json]\n"
             "                      [--network analytical|simgrid] [--trace T.json] [--json]\n"
             "                      [--tokens N [reliability flags]]\n\n"
             "Predicts one training step of a plan with the discrete-event simulator: step "
             "time, tokens/s, TFLOP/s and MFU per GPU, where the time goes (compute, "
             "recompute, exposed communication per kind, pipeline bubble, optimizer), the "
             "Amdahl bound, and memory per GPU; with --tokens the time and cost to train, "
             "failure-free and with interruptions.",
             vm)) {
    return 0;
  }
  const double tokens = training_tokens(vm);
  const plan::Reliability reliability = reliability_from_options(vm);
  PlanSetup setup = setup_from_options(vm);
  require_symmetric_placement(setup.plan, setup.cluster);
  const model::ModelSpec& spec = setup.spec;
  const cluster::Cluster& cluster = setup.cluster;
  const plan::Plan& plan = setup.plan;
  std::vector<std::string>& notes = setup.notes;
  const std::string network_name = network_argument(vm);
  std::unique_ptr<network::NetworkModel> network;
  if (network_name == "analytical") {
    network = network::make_analytical(cluster);
  } else if (network_name == "simgrid") {
    network = network::make_simgrid(cluster, plan);
    // Said at once: the run that follows may be long.
    if (const auto note = network::simgrid_scale_note(plan)) std::cerr << *note << "\n";
    notes.push_back(
        "simgrid: every distinct collective and pipeline transfer was flow-simulated once, "
        "with all the groups of its kind in its pipeline stage running at the same time (an "
        "all-reduce across nodes as rings, or as NCCL's tree where faster: the rings' transfer "
        "and the tree's latency, not flows of its own)");
  } else {
    throw InputError(
        fmt::format("--network: expected analytical or simgrid, got \"{}\"", network_name));
  }
  engine::SimulateOptions options;
  options.memory = memory_options_from(vm);
  std::optional<cost::Profile> profile;
  if (const auto profile_file = profile_argument(vm)) {
    profile = cost::load_profile(*profile_file);
    options.profile = &*profile;
    for (auto& n : profile_notes(*profile, &cluster)) notes.push_back(std::move(n));
    for (auto& w : profile_warnings(*profile, cluster.device)) notes.push_back(std::move(w));
    for (auto& n :
         cost::ComputeCost(setup.graph, plan, cluster.device, &*profile).profile_coverage())
      notes.push_back(std::move(n));
  }
  // Without a profile or the device's GEMM waves, every GEMM runs at the catalog's rate, the
  // best one over a sweep of shapes: said, as an upper bound for small or odd shapes.
  if (!profile && !cluster.device.efficiency.gemm_waves) {
    notes.push_back(fmt::format(
        "GEMMs at {:.1f}% of peak whatever their shape ({}'s GEMM efficiency, measured on "
        "large ones; no tile or wave quantization without the device's gemm_waves): an upper "
        "bound for small or odd shapes; a dtexec calibrate profile (--profile) times them",
        100 * cluster.device.efficiency.gemm.value, cluster.device.name));
  }
  options.jitter_cv = jitter_from_options(vm);
  options.rank_spread_cv = rank_spread_from_options(vm);
  options.straggler_cost = true;
  // A bar on a terminal for a simulation past a second (a 65,536-GPU plan on SimGrid: 84 s).
  options.progress = progress_bar(std::chrono::steady_clock::now(), "tasks simulated");
  if (vm.count("trace")) check_writable(vm["trace"].as<std::string>(), "--trace", &vm);
  const engine::Simulation sim = engine::simulate(setup.graph, plan, cluster, *network, options);
  const engine::Prediction& p = sim.prediction;
  for (const auto& n : p.notes) notes.push_back(n);
  if (profile && !profile->collectives.empty() && cluster.nodes > 1) {
    // (engine::simulate: measured collectives stand for groups inside one node.)
    notes.push_back(fmt::format(
        "profile {}: its collectives were measured inside one host; on {}'s {} nodes every "
        "collective and transfer is priced by the network model",
        profile->file, cluster.name, cluster.nodes));
  } else if (profile && !profile->collectives.empty()) {
    // Collectives and transfers that the profile times beyond its largest size of their kind
    // and group (a --quick calibration measures up to 64 KiB; a step's gradients are MBs),
    // and those of a kind and group size it did not measure (the network model's).
    std::int64_t beyond = 0;
    double most = 0, measured_most = 0;
    std::string most_what;
    std::set<std::pair<std::string, int>> unmeasured;
    for (const auto& rp : sim.program.ranks) {
      for (const auto& task : rp.tasks) {
        std::string kind;
        int ranks = 2;
        if (task.kind == lower::TaskKind::Collective) {
          kind = std::string(lower::to_string(task.collective));
          ranks = static_cast<int>(
              sim.program.groups.at(static_cast<std::size_t>(task.group)).ranks.size());
        } else if (task.kind == lower::TaskKind::Send) {
          kind = "send_recv";
        } else {
          continue;
        }
        const auto largest = profile->largest_collective_bytes(kind, ranks);
        if (!largest) unmeasured.insert({kind, ranks});
        const auto bytes = static_cast<double>(task.bytes);
        if (!largest || bytes <= *largest) continue;
        ++beyond;
        if (bytes > most) {
          most = bytes;
          measured_most = *largest;
          most_what = fmt::format("{} over {} ranks", kind, ranks);
        }
      }
    }
    if (beyond > 0) {
      notes.push_back(fmt::format(
          "profile {}: {} of the program's collectives and transfers exceed its largest measured "
          "size of their kind and group (the most: {:.3g} bytes of {}, measured up to {:.3g}) "
          "and are priced at that size's throughput: an extrapolation",
          profile->file, beyond, most, most_what, measured_most));
    }
    if (!unmeasured.empty()) {
      std::vector<std::string> what;
      for (const auto& [kind, ranks] : unmeasured)
        what.push_back(fmt::format("{} over {}", kind, ranks));
      notes.push_back(fmt::format(
          "profile {} measured no {} ranks (dtexec calibrate measures groups of 2, 4, ... "
          "that divide its job, and the job): the network model prices those",
          profile->file, fmt::join(what, ", ")));
    }
  }
  if (vm.count("trace")) {
    report::write_chrome_trace(vm["trace"].as<std::string>(), sim.program, sim.timeline,
                               {setup.graph.spec().name, report::kProducedBySimulate,
                                cluster.device.name, std::nullopt, ""});
  }
  // --tokens: the time (and cost, at the cluster's price) to train, failure-free and with
  // interruptions.
  std::optional<plan::TrainingTime> train;
  std::optional<double> cost_usd;
  if (tokens > 0) {
    train = plan::training_time(spec, plan, p.gpus, p.step_time_s, tokens, reliability);
    if (cluster.price_per_device_hour_usd) {
      cost_usd = train->work_s / 3600 * static_cast<double>(p.gpus) *
                 cluster.price_per_device_hour_usd->value;
    }
  }

  if (vm["json"].as<bool>()) {
    json stages = json::array();
    for (const auto& s : p.stages) stages.push_back(report::stage_json(s));
    json out = {
        {"model", spec.name},
        {"cluster", cluster.name},
        {"network", p.network},
        {"gpus", p.gpus},
        {"step_time_s", p.step_time_s},
        {"tokens_per_s", p.tokens_per_s},
        {"tflops_per_gpu", p.tflops_per_gpu},
        {"model_tflops_per_gpu", p.model_tflops_per_gpu},
        {"mfu", p.mfu},
        {"hfu", p.hfu},
        {"model_flops_per_step", p.model_flops},
        {"hardware_flops_per_step", p.hardware_flops},
        {"executed_flops_per_step", p.executed_flops},
        {"memory_per_gpu_bytes", report::byte_count(p.memory.worst().total_bytes)},
        {"memory_capacity_bytes", report::byte_count(p.memory.capacity_bytes)},
        // (The name plan, memory and whatif give it.)
        {"capacity_bytes", report::byte_count(p.memory.capacity_bytes)},
        {"fits", p.memory.fits},
        {"breakdown", report::breakdown_json(p.breakdown)},
        {"breakdown_stage", p.bottleneck_stage},
        {"per_stage", stages},
        {"amdahl", {{"serial_fraction", p.serial_fraction}, {"max_speedup", p.max_speedup}}},
        {"straggler_cost_s", p.straggler_cost_s.value_or(0.0)},
        {"slow_rank_cost_s", p.slow_rank_cost_s.value_or(0.0)},
        {"plan", plan::to_json(plan)},
        {"simulation", {{"tasks", p.tasks}, {"events", p.events}}},
        {"notes", notes}};
    if (train) {
      out["training"] = training_time_json(*train, cost_usd);
      out["training"]["tokens"] = tokens;
      if (cost_usd) add_price_json(out["training"], cluster);
    }
    std::cout << json_text(out, 2) << "\n";
    return 0;
  }

  std::cout << fmt::format("{} on {} ({} x {}), plan {}\n", spec.name, cluster.name, p.gpus,
                           cluster.device.display_name, plan::summary(plan));
  // TFLOP/s, or GFLOP/s on a device that computes under one TFLOP/s (a CPU rank).
  const bool giga = p.tflops_per_gpu < 1;
  const double unit = giga ? 1e3 : 1;
  // A CPU cluster's devices are ranks (MPI processes).
  const char* per = cluster.device.vendor == "cpu" ? "rank" : "GPU";
  // A tenth or more to a tenth; below, three significant digits (a one-layer toy's 1.5e-05
  // TFLOP/s read "0.0 GFLOP/s"; MFU and HFU alike, by format_percent).
  const auto small = [](double v) {
    return v >= 0.1 ? fmt::format("{:.1f}", v) : fmt::format("{:.3g}", v);
  };
  // Counted dense (Megatron-LM's formula), FlashAttention's FLOPs can put them past the peak at
  // long sequences: said on the line, with the share of the peak the kernels execute.
  const std::string past_peak =
      p.hfu > 1 ? fmt::format(
                      "  (counted dense, past the peak: {:.1f}% of it by the FLOPs "
                      "executed)",
                      100 * p.hfu * p.executed_flops / p.hardware_flops)
                : "";
  std::cout << fmt::format(
      "step time {} s   {} tokens/s   {} {}FLOP/s per {} (model {})   MFU {}   HFU {}{}\n",
      format_seconds(p.step_time_s), format_rate(p.tokens_per_s), small(unit * p.tflops_per_gpu),
      giga ? "G" : "T", per, small(unit * p.model_tflops_per_gpu), format_percent(p.mfu),
      format_percent(p.hfu), past_peak);
  std::cout << fmt::format(
      "memory per {} {} of {} ({})\n\n", per, format_gib(p.memory.worst().total_bytes),
      format_gib(p.memory.capacity_bytes), p.memory.fits ? "fits" : "DOES NOT FIT");
  const engine::Breakdown& b = p.breakdown;
  report::Table table({"where the step goes", "time", "share"});
  table.set_units({fmt::format("(stage {})", p.bottleneck_stage), "ms", "of step"});
  table.align_left(0);
  auto row = [&](const char* what, double s) {
    if (s > 0) table.add_row({what, ms(s), pct(s, p.step_time_s)});
  };
  row("compute (forward + backward)", b.compute_s);
  row("recompute", b.recompute_s);
  row("exposed TP communication", b.exposed_tp_s);
  row("exposed CP communication", b.exposed_cp_s);
  row("exposed EP communication", b.exposed_ep_s);
  row("exposed DP communication", b.exposed_dp_s);
  row("exposed PP communication", b.exposed_pp_s);
  row("straggler waits at TP", b.straggler_tp_s);
  row("straggler waits at CP", b.straggler_cp_s);
  row("straggler waits at EP", b.straggler_ep_s);
  row("straggler waits at DP", b.straggler_dp_s);
  row("straggler waits at PP", b.straggler_pp_s);
  row("pipeline bubble", b.bubble_s);
  row("optimizer", b.optimizer_s);
  std::cout << table.render();
  // The compute that ran beside communication, priced as if alone (README "Not modelled"):
  // what a GPU's contention would slow. (None on a CPU cluster: its ranks run serially.)
  const double busy = b.compute_s + b.recompute_s + b.optimizer_s;
  if (b.overlapped_s > 0 && busy > 0) {
    // What that average would add were all of it on the step's path: a first-order figure for
    // the reader, not a term of the step.
    const double stretch = kMeanOverlapSlowdown * b.overlapped_s;
    std::cout << fmt::format(
        "\ncommunication in flight beside compute: {} of the stage's {} of compute ({:.1f}%), "
        "priced as fast as alone; GPUs slow compute that overlaps communication ({:.1f}% on "
        "average in Lee et al. 2025), which dtsim does not model: at that rate, up to {} "
        "({:+.1f}%) more a step\n",
        format_duration(b.overlapped_s), format_duration(busy), 100 * b.overlapped_s / busy,
        100 * kMeanOverlapSlowdown, format_duration(stretch), 100 * stretch / p.step_time_s);
  }
  if (p.straggler_cost_s && *p.straggler_cost_s != 0) {
    // (A cost below the waits, even negative, is possible: the waits can reorder the transfers
    // on a link.)
    const double cost = *p.straggler_cost_s;
    std::cout << fmt::format(
        "\nstragglers: the step is {}{} ({:+.1f}%) against {} without them; compute waits on a "
        "late rank for {} (the straggler rows), and those waits delay other work\n",
        cost < 0 ? "-" : "+", format_duration(std::abs(cost)),
        100 * cost / (p.step_time_s - cost),  // (of the figure it is against)
        format_duration(p.step_time_s - cost), format_duration(b.straggler_s()));
  }
  if (p.slow_rank_cost_s && *p.slow_rank_cost_s != 0) {
    const double cost = *p.slow_rank_cost_s;
    const double calm = p.step_time_s - p.straggler_cost_s.value_or(0.0);
    const bool jittered = p.straggler_cost_s.value_or(0.0) != 0;  // (its line is above)
    std::cout << fmt::format(
        "{}slow rank: the step{} is {}{} ({:+.1f}%) against {} with every rank at one speed\n",
        jittered ? "" : "\n", jittered ? " without jitter" : "", cost < 0 ? "-" : "+",
        format_duration(std::abs(cost)), 100 * cost / (calm - cost), format_duration(calm - cost));
  }
  const std::string bound = p.max_speedup > 0
                                ? fmt::format("serial fraction {:.1f}% -> speedup bound {:.1f}x",
                                              100 * p.serial_fraction, p.max_speedup)
                                : std::string("nothing serial, no bound");
  std::cout << "\nAmdahl (more dp replicas, this global batch): " << bound << "\n";
  std::cout << fmt::format("simulated {} tasks ({} events), {} network\n", p.tasks, p.events,
                           p.network);
  if (train) {
    // (A plan that does not fit is timed all the same: said on the line whose figures a reader
    // may take for a budget.)
    std::cout << fmt::format("time to train on {:.3g} tokens{}: {}\n", tokens,
                             p.memory.fits ? "" : " (if it fitted: it DOES NOT FIT)",
                             training_time_text(*train, cost_usd))
              << interruptions_note(reliability) << "\n";
    if (!cost_usd) std::cout << unpriced_note(cluster.name) << "\n";
  }
  for (const auto& n : notes) std::cout << report::note_line(n) << "\n";
  return 0;
}

}  // namespace dtsim::cli
