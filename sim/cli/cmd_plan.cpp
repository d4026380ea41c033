// dtsim plan: search parallel configurations, rank them, and explain the best.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "sim/cli/commands.hpp"
#include "sim/cli/isolated.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/common/launcher.hpp"
#include "sim/common/units.hpp"
#include "sim/cost/compute_cost.hpp"
#include "sim/engine/simulator.hpp"
#include "sim/planner/planner.hpp"
#include "sim/report/breakdown_json.hpp"
#include "sim/report/json_values.hpp"
#include "sim/report/table.hpp"

namespace dtsim::cli {

namespace {

using nlohmann::json;

const engine::Breakdown& breakdown_of(const planner::Candidate& c) {
  return c.refined ? c.prediction.breakdown : c.estimate;
}

// What --tokens asks of each candidate: the tokens, and for the time with interruptions the
// model, the devices and the reliability flags.
struct TrainingGoal {
  double tokens = 0;
  const model::ModelSpec* spec = nullptr;
  std::int64_t devices = 0;
  plan::Reliability reliability;
  plan::TrainingTime of(const planner::Candidate& c) const {
    return plan::training_time(*spec, c.plan, devices, c.step_time_s, tokens, reliability);
  }
};

json candidate_json(const planner::Candidate& c, const TrainingGoal& goal) {
  const double train_tokens = goal.tokens;
  const double tokens = static_cast<double>(c.plan.global_batch_size * c.plan.seq_len);
  json j = {{"plan", plan::to_json(c.plan)},
            {"summary", plan::summary(c.plan)},
            {"step_time_s", c.step_time_s},
            {"estimate_s", c.estimate_s},
            {"simulated", c.refined},
            {"tokens_per_s", tokens / c.step_time_s},
            {"memory_per_gpu_bytes", report::byte_count(c.memory_bytes)},
            {"capacity_bytes", report::byte_count(c.capacity_bytes)},
            {"fits", c.fits},
            {"dominant", planner::dominant_term(breakdown_of(c), c.step_time_s)}};
  j["breakdown"] = report::breakdown_json(breakdown_of(c));
  // (The closed form does not time the overlap: null, not "none".)
  if (!c.refined) j["breakdown"]["overlapped_compute_s"] = nullptr;
  if (c.refined) {
    j["mfu"] = c.prediction.mfu;
    j["network"] = c.prediction.network;  // the network model that simulated it
  }
  if (c.cost_per_step_usd >= 0) j["cost_per_step_usd"] = c.cost_per_step_usd;
  if (train_tokens > 0) {
    const plan::TrainingTime tt = goal.of(c);
    j.update(training_time_json(tt, c.cost_per_step_usd >= 0
                                        ? std::optional(tt.steps * c.cost_per_step_usd)
                                        : std::nullopt));
  }
  return j;
}

// What more memory per device would buy: the memory frontier, by the closed-form estimates,
// thinned to rows faster than the row shown above by at least 1% of the reference (the
// fastest fitting estimate; or when nothing fits the first row, the closest to fitting, always
// shown); the last row, as fast as the fastest over memory, always shown; --json lists every
// one.
void print_memory_frontier(const planner::SearchResult& result) {
  const auto& front = result.memory_frontier;
  const bool none_fits = result.ranked.empty();
  double reference = none_fits ? front.front().estimate_s : std::numeric_limits<double>::infinity();
  for (const auto& c : result.ranked) reference = std::min(reference, c.estimate_s);
  std::cout << (none_fits
                    ? fmt::format(
                          "more memory per GPU would let these run (estimates; the fastest plan "
                          "of those needing at most each figure; none fits in {:.1f} GiB, times "
                          "against the first row's):\n",
                          front.front().capacity_bytes / kGiB)
                    : fmt::format(
                          "more memory per GPU would buy (estimates; the fastest plan of those "
                          "needing at most each figure, against {:.3f} s for the fastest that "
                          "fits in {:.1f} GiB):\n",
                          reference, front.front().capacity_bytes / kGiB));
  report::Table table(
      {"memory/GPU", "estimate", none_fits ? "faster than first" : "faster", "plan"});
  table.set_units({"GiB", "s", "", ""});
  table.align_left(3);
  double shown = none_fits ? std::numeric_limits<double>::infinity() : reference;
  std::size_t left_out = 0;
  for (std::size_t i = 0; i < front.size(); ++i) {
    const auto& c = front[i];
    if (i + 1 < front.size() && shown - c.estimate_s < 0.01 * reference) {
      ++left_out;
      continue;
    }
    shown = c.estimate_s;
    table.add_row(
        {fmt::format("{:.1f}", c.memory_bytes / kGiB), fmt::format("{:.3f}", c.estimate_s),
         fmt::format("{:.1f}%", 100 * (1 - c.estimate_s / reference)), plan::summary(c.plan)});
  }
  std::cout << table.render();
  if (left_out > 0) {
    std::cout << fmt::format(
        "({} more in between, each less than 1% faster than the row shown above; --json lists "
        "them in memory_frontier)\n",
        left_out);
  }
}

// Why the search had no candidate at all: the constraints that apply, the ones that exclude
// everything by themselves first.
std::string explain_no_candidates(const model::ModelSpec& m, const cluster::Cluster& cluster,
                                  const planner::SearchSpace& space, bool max_tp_given) {
  const std::int64_t devices = cluster.devices();
  std::vector<std::string> why;
  const std::pair<const char*, int> fixed[] = {{"tp", space.fixed_tp},
                                               {"pp", space.fixed_pp},
                                               {"dp", space.fixed_dp},
                                               {"cp", space.fixed_cp},
                                               {"ep", space.fixed_ep}};
  std::int64_t product = 1;
  std::vector<std::string> fixed_text;
  for (const auto& [key, value] : fixed) {
    if (value < 0) continue;
    fixed_text.push_back(fmt::format("--fixed {}={}", key, value));
    if (std::string(key) != "ep") product *= value;
    if (devices % value != 0) {
      why.push_back(
          fmt::format("--fixed {}={} does not divide the {} devices", key, value, devices));
    }
  }
  if (why.empty() && devices % product != 0) {
    why.push_back(
        fmt::format("the fixed degrees multiply to {}, which does not divide the {} "
                    "devices",
                    product, devices));
  }
  const int max_tp = space.max_tp > 0 ? space.max_tp : static_cast<int>(cluster.devices_per_node);
  if (space.fixed_tp > max_tp) {
    why.push_back(fmt::format("--fixed tp={} exceeds {} = {}", space.fixed_tp,
                              max_tp_given ? "--max-tp" : "the devices per node (--max-tp)",
                              max_tp));
  }
  // (The MLPs' widths: the shared experts' and the dense blocks' too, where the model has
  // them.)
  std::vector<std::string> widths = {fmt::format("heads ({})", m.heads),
                                     fmt::format("kv_heads ({})", m.kv_heads)};
  std::string mlps;
  const int tp = std::max(1, space.fixed_tp);  // (1 where tp is not fixed)
  bool divides = m.heads % tp == 0 && m.kv_heads % tp == 0;
  for (const auto& [name, width] : m.mlp_widths()) {
    widths.push_back(fmt::format("{} ({})", name, width));
    mlps += fmt::format(", {} {}", name, width);
    divides = divides && width % tp == 0;
  }
  if (space.fixed_tp > 0 && !divides) {
    const std::string last = widths.back();
    widths.pop_back();
    why.push_back(fmt::format("--fixed tp={} must divide the model's {} and {}", space.fixed_tp,
                              fmt::join(widths, ", "), last));
  }
  if (space.fixed_pp > m.layers) {
    why.push_back(
        fmt::format("--fixed pp={} exceeds the model's {} layers", space.fixed_pp, m.layers));
  }
  if (space.fixed_pp > 0 && space.max_pp > 0 && space.fixed_pp > space.max_pp) {
    why.push_back(fmt::format("--fixed pp={} exceeds --max-pp {}", space.fixed_pp, space.max_pp));
  }
  if (space.fixed_ep > 1 && !m.moe) {
    why.push_back(fmt::format("--fixed ep={}: the model has no experts", space.fixed_ep));
  } else if (space.fixed_ep > 0 && m.moe && m.moe->experts % space.fixed_ep != 0) {
    why.push_back(fmt::format("--fixed ep={} must divide the model's {} experts", space.fixed_ep,
                              m.moe->experts));
  }
  if (space.fixed_dp > 0 && space.global_batch_size % space.fixed_dp != 0) {
    why.push_back(fmt::format("--fixed dp={} does not divide --global-batch-size {}",
                              space.fixed_dp, space.global_batch_size));
  }
  // The fewest micro-batches a step can have: the largest micro-batch on every device as dp.
  const std::int64_t largest_mbs =
      space.micro_batch_sizes.empty()
          ? 1
          : *std::max_element(space.micro_batch_sizes.begin(), space.micro_batch_sizes.end());
  const std::int64_t fewest = space.global_batch_size / (largest_mbs * devices);
  if (fewest > plan::kMaxMicroBatches) {
    why.push_back(fmt::format(
        "--global-batch-size {} needs at least {} micro-batches per step (micro-batch {} on all "
        "{} devices as dp), over dtsim's limit of 2^24",
        space.global_batch_size, fewest, largest_mbs, devices));
  }
  std::string text = "no candidate plan to evaluate: ";
  text += why.empty() ? "no combination of degrees meets all the constraints"
                      : fmt::format("{}", fmt::join(why, "; "));
  std::vector<std::string> all;
  all.push_back(fmt::format("{} devices, {} per node (tp x cp x pp x dp = devices)", devices,
                            cluster.devices_per_node));
  if (!fixed_text.empty()) all.push_back(fmt::format("{}", fmt::join(fixed_text, ", ")));
  all.push_back(fmt::format("tp <= {} ({}) and divides heads {}, kv_heads {}{}", max_tp,
                            max_tp_given ? "--max-tp" : "devices per node; --max-tp", m.heads,
                            m.kv_heads, mlps));
  all.push_back(space.max_pp > 0
                    ? fmt::format("pp <= {} (--max-pp) and <= {} layers", space.max_pp, m.layers)
                    : fmt::format("pp <= {} layers", m.layers));
  all.push_back(fmt::format("cp <= {} (--max-cp), 2 x cp divides seq_len", space.max_cp));
  all.push_back(fmt::format(
      "dp x micro-batch ({}) divides --global-batch-size {}, in at most 2^24 micro-batches",
      fmt::join(space.micro_batch_sizes, ", "), space.global_batch_size));
  if (m.moe) all.push_back(fmt::format("ep divides dp and the {} experts", m.moe->experts));
  text += fmt::format("\n  constraints: {}", fmt::join(all, "\n               "));
  return text;
}

// Nothing fits: what the closest plan's memory is made of (its worst rank), and a floor on the
// devices: the model's state alone, sharded evenly over every device (ZeRO-3), before
// activations and the framework's allowance.
struct ClosestToFitting {
  plan::StageMemory worst;
  double bytes_per_param = 0;
  double state_bytes = 0;
  std::int64_t floor_devices = 0;
};

ClosestToFitting closest_memory(const model::ModelSpec& spec, const cluster::Cluster& cluster,
                                const plan::MemoryOptions& memory, const planner::Candidate& c) {
  const model::ModelGraph g = plan::graph_of(spec, c.plan);
  ClosestToFitting out;
  // (With the search's memory options: "other" holds --framework-overhead-gib, as the total.)
  out.worst = plan::estimate_memory(g, c.plan, cluster, memory).worst();
  const auto per_param = plan::state_bytes_per_param(c.plan);
  out.bytes_per_param = per_param.weights + per_param.gradients + per_param.optimizer;
  out.state_bytes = static_cast<double>(g.totals().params) * out.bytes_per_param;
  out.floor_devices =
      static_cast<std::int64_t>(std::ceil(out.state_bytes / std::max(1.0, c.capacity_bytes)));
  return out;
}

// The same in the JSON's closest_not_fitting.
void add_closest_memory(json& out, const ClosestToFitting& m) {
  out["memory"] = {{"weights_bytes", report::byte_count(m.worst.weights_bytes)},
                   {"gradients_bytes", report::byte_count(m.worst.gradients_bytes)},
                   {"optimizer_bytes", report::byte_count(m.worst.optimizer_bytes)},
                   {"activations_bytes", report::byte_count(m.worst.activations_bytes)},
                   {"other_bytes", report::byte_count(m.worst.other_bytes)}};
  out["model_state_bytes"] = report::byte_count(m.state_bytes);
  out["model_state_bytes_per_param"] = m.bytes_per_param;
  out["devices_floor"] = m.floor_devices;
}

// Nothing fits: how far the closest plan is, and what its memory is made of.
std::string closest_to_fitting(const model::ModelSpec& spec, const cluster::Cluster& cluster,
                               const plan::MemoryOptions& memory, const planner::Candidate& c) {
  const ClosestToFitting closest = closest_memory(spec, cluster, memory, c);
  const auto& m = closest.worst;
  // The framework's allowance alone over the device's memory: no plan shrinks it.
  const std::string remedy =
      m.other_bytes >= c.capacity_bytes
          ? fmt::format(
                "the framework's allowance alone (other: the device file's "
                "framework_overhead_bytes, else 1 GiB, or --framework-overhead-gib) is "
                "more than the device's {:.2f} GiB, so no plan fits: give a smaller one",
                c.capacity_bytes / kGiB)
          : std::string("more devices, a larger tp, pp or ZeRO stage, or recompute shrink it");
  return fmt::format(
      "closest to fitting: {} needs {:.1f} GiB of {:.1f} GiB, {:.1f} GiB too much (weights "
      "{:.1f}, gradients {:.1f}, optimizer {:.1f}, activations {:.1f}, other {:.1f} GiB); {}\n"
      "(the model's weights, gradients and optimizer state alone take {:.0f} GiB, {:g} bytes a "
      "parameter: at least {} devices of {:.1f} GiB, before activations; this search has {})",
      plan::summary(c.plan), c.memory_bytes / kGiB, c.capacity_bytes / kGiB,
      (c.memory_bytes - c.capacity_bytes) / kGiB, m.weights_bytes / kGiB, m.gradients_bytes / kGiB,
      m.optimizer_bytes / kGiB, m.activations_bytes / kGiB, m.other_bytes / kGiB, remedy,
      closest.state_bytes / kGiB, closest.bytes_per_param, closest.floor_devices,
      c.capacity_bytes / kGiB, cluster.devices());
}

}  // namespace

int cmd_plan(const std::vector<std::string>& args) {
  po::options_description desc("dtsim plan options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/true);
  add_global_batch_options(desc, "sequences per step (required)");
  desc.add_options()("seq-len", po::value<std::int64_t>(),
                     "sequence length (default: the model's)")(
      "top", po::value<int>()->default_value(5), "plans to show")(
      "distinct", po::bool_switch(),
      "one plan per layout (dp, tp, pp, cp, ep, micro-batch, schedule and virtual stages), the "
      "first of each by the estimate, in the list and among those simulated: the ZeRO-stage, "
      "recompute, sequence-parallel and overlap variants of a layout, which often tie with it, "
      "are left out")(
      "balance-stages", po::value<int>()->default_value(planner::kDefaultBalanceStages),
      "uneven pipeline stages: search the layer split (--layers-per-stage) of this many of the "
      "best candidates with pp > 1, moving one layer at a time between an end chunk and "
      "another while the estimate falls and the plan fits (the first stage carries the "
      "embedding, the last the LM head and the loss); 0: every split even")(
      "objective", po::value<std::string>()->default_value("time"),
      "rank by step time, or by cost per step (time, cost, time-to-train; with a fixed global "
      "batch time-to-train ranks as step time, and on the fixed devices of a search so does "
      "cost, which it adds as a column: dtsim whatif --vary gpus compares device counts)")(
      "tokens", po::value<double>(), "training tokens: report time (and cost) to train")(
      "refine", po::value<int>()->default_value(8),
      "simulate the best K candidates with the discrete-event simulator")(
      "network", po::value<std::string>()->default_value("analytical"),
      "network model of the simulated candidates: analytical, or simgrid (their collectives and "
      "transfers flow-simulated on SimGrid, one after another, each in a process of its own; "
      "the estimates before them use the analytical model)")(
      "memory-headroom", po::value<double>()->default_value(0.0),
      "fraction of device memory to keep free (0-0.9)")(
      "expert-load", po::value<double>()->default_value(1.0),
      "expert parallelism's routing: the token copies the busiest ep rank's experts get over "
      "the even share (at least 1; capped at what routing can make at each candidate's ep, "
      "min(ep, experts / top k); dtexec run measures it)")(
      "precision", po::value<std::string>(),
      "bf16, fp16, fp8, fp32, tf32 (default bf16; fp16 on a device without bf16, fp32 on one "
      "with neither)")("threads", po::value<int>()->default_value(0),
                       "threads for the search (0: all cores)")(
      "json", po::bool_switch(), "print JSON")("csv", po::bool_switch(), "print CSV")(
      "out", po::value<std::string>(), "write the best plan to this file (a --plan file)");
  add_search_space_options(desc);
  add_reliability_options(desc);
  add_price_option(desc, /*objective=*/true);
  add_memory_options(desc);
  desc.add_options()("profile", po::value<std::string>(),
                     "calibration profile (dtexec calibrate) for the compute cost");
  add_jitter_option(desc, ", in both tiers");
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtsim plan --model M --cluster C [--gpus N] --global-batch-size B\n"
             "                  [--seq-len S] [--top K] [--objective time|cost|time-to-train]\n"
             "                  [--json|--csv] [--out P.json]\n\n"
             "Searches tp/pp/dp/cp/ep degrees, micro-batch sizes, schedules, ZeRO stages, "
             "recompute and sequence parallelism; drops what does not fit in memory; ranks the "
             "rest by a closed-form estimate, then simulates the best with the discrete-event "
             "simulator. Also says what more memory per GPU would buy: the plans over memory "
             "faster than all those needing less.",
             vm)) {
    return 0;
  }
  check_one_format(vm);
  const model::ModelSpec spec = model_from_options(vm);
  const cluster::Cluster cluster = cluster_from_options(vm);
  planner::SearchSpace space;
  const auto global_batch = global_batch_from_options(vm);
  if (!global_batch) {
    throw InputError("--global-batch-size: required (sequences per optimizer step)");
  }
  space.global_batch_size = *global_batch;
  if (vm.count("seq-len")) {
    space.seq_len = vm["seq-len"].as<std::int64_t>();
    if (space.seq_len < 1 || space.seq_len > spec.max_positions) {
      throw InputError(
          fmt::format("--seq-len: expected 1..{}, got {}", spec.max_positions, space.seq_len));
    }
  }
  search_space_from_options(vm, space);
  space.memory = memory_options_from(vm);
  space.memory_headroom = vm["memory-headroom"].as<double>();
  if (!(space.memory_headroom >= 0 && space.memory_headroom <= 0.9)) {
    throw InputError(
        fmt::format("--memory-headroom: expected 0..0.9, got {}", space.memory_headroom));
  }
  space.expert_load = vm["expert-load"].as<double>();
  if (!(space.expert_load >= 1 && std::isfinite(space.expert_load))) {
    throw InputError(
        fmt::format("--expert-load: {}, got {}", plan::kExpertLoadExpected, space.expert_load));
  }
  if (space.expert_load != 1 && !spec.moe) {
    throw InputError(fmt::format("--expert-load {:g} needs a mixture of experts; {} has none",
                                 space.expert_load, spec.name));
  }
  // The default precision follows the device: bf16, else fp16, else fp32 (a CPU host).
  space.precision = vm.count("precision")
                        ? precision_of_flag("precision", vm["precision"].as<std::string>())
                        : default_precision(cluster.device);
  cluster.device.peak_flops_for(space.precision);
  planner::SearchOptions options;
  options.refine = vm["refine"].as<int>();
  options.distinct_layouts = vm["distinct"].as<bool>();
  options.balance_stages = vm["balance-stages"].as<int>();
  if (options.balance_stages < 0) {
    throw InputError(
        fmt::format("--balance-stages: expected 0 or more, got {}", options.balance_stages));
  }
  const std::string network_name = vm["network"].as<std::string>();
  if (network_name != "analytical" && network_name != "simgrid") {
    throw InputError(
        fmt::format("--network: expected analytical or simgrid, got \"{}\"", network_name));
  }
  if (network_name == "simgrid") {
    // SimGrid holds one platform per process, and each candidate has its own.
    options.simulate = [&](const plan::Plan& p, const engine::SimulateOptions& o) {
      return simulate_on_simgrid(spec, p, cluster, o);
    };
  }
  options.threads = vm["threads"].as<int>();
  if (options.threads < 0) {
    throw InputError(fmt::format("--threads: expected 0 (all cores) or a positive integer, got {}",
                                 options.threads));
  }
  std::optional<cost::Profile> profile;
  if (vm.count("profile")) {
    profile = cost::load_profile(vm["profile"].as<std::string>());
    // The compute cost checks this too, but inside the search's worker threads; check it here.
    if (profile->precision != space.precision) {
      throw InputError(fmt::format("{}: precision: {}, --precision is {}", profile->file,
                                   profile->precision_said(), to_string(space.precision)));
    }
    options.profile = &*profile;
    for (const auto& w : profile_warnings(*profile, cluster.device)) std::cerr << w << "\n";
  }
  options.jitter_cv = jitter_from_options(vm);
  options.rank_spread_cv = rank_spread_from_options(vm);
  const std::string objective = vm["objective"].as<std::string>();
  if (objective == "cost") {
    if (!cluster.price_per_device_hour_usd) {
      throw InputError(
          fmt::format("--objective cost: cluster {} has no price_per_device_hour_usd "
                      "({}): give --price-per-gpu-hour",
                      cluster.name, cluster.file));
    }
    options.objective = planner::Objective::Cost;
  } else if (objective != "time" && objective != "time-to-train") {
    throw InputError(
        fmt::format("--objective: expected time, cost or time-to-train, got \"{}\"", objective));
  }
  const double train_tokens = training_tokens(vm);
  if (objective == "time-to-train" && train_tokens <= 0 && launcher_rank() == 0) {
    // (It ranks as step time all the same; said, as a time to train was asked for and none
    // will be printed.)
    std::cerr << "note: --objective time-to-train without --tokens: plans ranked by step time "
                 "(as they would be with it, the global batch fixed), no time to train given\n";
  }
  const TrainingGoal goal{train_tokens, &spec, cluster.devices(), reliability_from_options(vm)};
  const int top = vm["top"].as<int>();
  if (top < 1)
    throw InputError(fmt::format("--top: expected at least 1 plan to show, got {}", top));
  if (options.refine < 0) {
    throw InputError(fmt::format("--refine: expected a number of plans to simulate >= 0, got {}",
                                 options.refine));
  }
  if (vm.count("out")) check_writable(vm["out"].as<std::string>(), "--out", &vm);
  // A progress bar on a terminal, for searches longer than a second: the candidates estimated,
  // then the best ones simulated (seconds each for a large model's plans).
  const auto started = std::chrono::steady_clock::now();
  options.progress = progress_bar(started, "candidates");
  options.simulated = progress_bar(started, "simulated");
  const planner::SearchResult result = planner::search(spec, cluster, space, options);
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  // No candidate at all: the constraints exclude every plan (bad input), unlike candidates that
  // were evaluated and do not fit in memory (an outcome, reported below).
  if (result.evaluated == 0) {
    std::string text = explain_no_candidates(spec, cluster, space, vm.count("max-tp") > 0);
    // The whole cluster by default: fewer of its devices may split where all of them do not
    // (aws-p5's 20,000 = 2^5 x 5^4 for a batch of 512 sequences).
    if (!vm.count("gpus") && cluster.inter.fabric != cluster::InterFabric::Torus3d) {
      if (const std::int64_t fewer = planner::largest_searchable_devices(spec, cluster, space)) {
        text += fmt::format(
            "\n  on part of the cluster: --gpus {} is the most devices that these constraints "
            "split",
            fewer);
      }
    }
    throw InputError(text);
  }

  // No plan to write is the job's failure for a script that reads --out next: exit code 2
  // once the output says why.
  const bool out_unwritten = vm.count("out") && result.ranked.empty();
  if (out_unwritten) {
    std::cerr << fmt::format("no plan fits: --out {} not written\n", vm["out"].as<std::string>());
  }
  const int rc = out_unwritten ? 2 : 0;
  // The search's wall time goes to stderr, whatever the format: stdout is the same for the
  // same input.
  std::cerr << fmt::format("dtsim plan: searched in {:.2f} s\n", elapsed);
  if (vm.count("out") && !result.ranked.empty()) {
    const std::string path = vm["out"].as<std::string>();
    std::ofstream out(path);
    // With the model and cluster it was made for, which dtsim simulate --plan (and the other
    // commands) take where --model and --cluster are not given.
    json file = plan::to_json(result.ranked.front().plan);
    file["model"] = data_reference("model", vm["model"].as<std::string>());
    file["cluster"] = data_reference("cluster", vm["cluster"].as<std::string>());
    // And what else priced it, which simulate takes from the file where its flags are not given.
    if (vm.count("profile")) {
      file["profile"] = std::filesystem::absolute(vm["profile"].as<std::string>()).string();
    }
    if (vm["no-dropout"].as<bool>()) file["no_dropout"] = true;
    // The network model that simulated it (none where only the closed form ranked it).
    if (result.ranked.front().refined && network_name != "analytical") {
      file["network"] = network_name;
    }
    for (const auto& [flag, field] :
         {std::pair{"device-memory-gib", "device_memory_gib"},
          std::pair{"framework-overhead-gib", "framework_overhead_gib"}}) {
      if (vm.count(flag)) file[field] = vm[flag].as<double>();
    }
    if (vm.count("jitter-cv")) file["jitter_cv"] = vm["jitter-cv"].as<double>();
    if (vm.count("rank-spread-cv")) file["rank_spread_cv"] = vm["rank-spread-cv"].as<double>();
    if (!out || !(out << json_text(file, 2) << "\n" << std::flush)) {
      throw InputError(fmt::format("--out {}: cannot write", path));
    }
  }
  const int shown = std::min<int>(top, static_cast<int>(result.ranked.size()));
  if (vm["json"].as<bool>()) {
    json cands = json::array();
    for (int i = 0; i < shown; ++i)
      cands.push_back(candidate_json(result.ranked[static_cast<std::size_t>(i)], goal));
    json out = {{"model", spec.name},
                {"cluster", cluster.name},
                {"gpus", cluster.devices()},
                {"evaluated", result.evaluated},
                {"feasible", result.feasible},
                {"refined", result.refined},
                {"network", network_name},
                {"tier_order_disagreements", result.order_disagreements},
                {"tier_max_disagreement_gap", result.max_disagreement_gap},
                {"tier_max_estimate_error", result.max_estimate_error},
                {"candidates", cands}};
    add_price_json(out, cluster);
    if (profile) {
      // What simulate's notes say of it: its in_run factors, and for #1 what it did not measure.
      json notes = profile_notes(*profile, &cluster);
      if (!result.ranked.empty()) {
        const plan::Plan& best = result.ranked.front().plan;
        const model::ModelGraph g = plan::graph_of(spec, best);
        for (std::string& n :
             cost::ComputeCost(g, best, cluster.device, &*profile).profile_coverage()) {
          notes.push_back("#1: " + n);
        }
      }
      out["profile"] = {{"file", profile->file}, {"source", profile->source}, {"notes", notes}};
    } else {
      out["profile"] = json();
    }
    if (result.best_not_fitting) {
      out["best_not_fitting"] = candidate_json(*result.best_not_fitting, goal);
    }
    if (result.closest_not_fitting) {
      json closest = candidate_json(*result.closest_not_fitting, goal);
      add_closest_memory(closest,
                         closest_memory(spec, cluster, space.memory, *result.closest_not_fitting));
      out["closest_not_fitting"] = std::move(closest);
    }
    json frontier = json::array();
    for (const auto& c : result.memory_frontier) frontier.push_back(candidate_json(c, goal));
    out["memory_frontier"] = frontier;
    std::cout << json_text(out, 2) << "\n";
    return rc;
  }
  if (vm["csv"].as<bool>()) {
    // Only a header on stdout: stderr says why, as the text output would.
    if (result.ranked.empty()) {
      std::cerr << fmt::format("no plan fits in memory: {} candidates evaluated\n",
                               result.evaluated);
      if (result.closest_not_fitting) {
        std::cerr << closest_to_fitting(spec, cluster, space.memory, *result.closest_not_fitting)
                  << "\n";
      }
    }
    // The first seven columns as they always were; then MFU (simulated plans), capacity, and
    // with --tokens the time (and, with a price, cost) to train, failure-free, then the
    // goodput and the time with interruptions; empty where there is none; then the plan's
    // knobs one a column (a --plan file's names), for scripts that group by them. Figures in
    // full (the shortest text that reads back as the same double), as whatif's CSV.
    constexpr const char* kKnobs[] = {"dp",         "tp",
                                      "pp",         "cp",
                                      "ep",         "micro_batch_size",
                                      "schedule",   "virtual_stages",
                                      "zero_stage", "recompute",
                                      "attention",  "sequence_parallel"};
    std::cout << fmt::format(
        "rank,plan,step_time_s,simulated,tokens_per_s,memory_per_gpu_bytes,dominant,"
        "mfu,capacity_bytes,cost_per_step_usd,time_to_train_s,cost_to_train_usd,"
        "goodput,time_to_train_with_interruptions_s,{}\n",
        fmt::join(kKnobs, ","));
    auto cell = [](bool has, double v) { return has ? fmt::format("{}", v) : std::string(); };
    for (int i = 0; i < shown; ++i) {
      const auto& c = result.ranked[static_cast<std::size_t>(i)];
      const double tokens = static_cast<double>(c.plan.global_batch_size * c.plan.seq_len);
      const bool priced = c.cost_per_step_usd >= 0;
      const plan::TrainingTime tt = train_tokens > 0 ? goal.of(c) : plan::TrainingTime{};
      const double steps = tt.steps;  // whole steps (0 without --tokens)
      const json knobs = plan::to_json(c.plan);
      std::vector<std::string> knob_cells;
      for (const char* k : kKnobs) {
        const json& v = knobs.at(k);
        knob_cells.push_back(v.is_string()    ? v.get<std::string>()
                             : v.is_boolean() ? (v.get<bool>() ? "1" : "0")
                                              : json_text(v));
      }
      std::cout << fmt::format(
          "{},\"{}\",{},{},{},{:.0f},\"{}\",{},{:.0f},{},{},{},{},{},{}\n", i + 1,
          plan::summary(c.plan), c.step_time_s, c.refined ? 1 : 0, tokens / c.step_time_s,
          c.memory_bytes, planner::dominant_term(breakdown_of(c), c.step_time_s),
          cell(c.refined, c.prediction.mfu), c.capacity_bytes, cell(priced, c.cost_per_step_usd),
          cell(steps > 0, steps * c.step_time_s),
          cell(steps > 0 && priced, steps * c.cost_per_step_usd), cell(steps > 0, tt.goodput),
          cell(steps > 0 && tt.goodput > 0, tt.wall_s), fmt::join(knob_cells, ","));
    }
    return rc;
  }
  std::cout << fmt::format("{} on {} ({} x {}), global batch {} x {} tokens\n", spec.name,
                           cluster.name, cluster.devices(), cluster.device.display_name,
                           space.global_batch_size,
                           space.seq_len > 0 ? space.seq_len : spec.seq_len);
  std::cout << fmt::format("{} candidates evaluated, {} fit in memory; the best {} simulated\n",
                           result.evaluated, result.feasible, result.refined);
  if (profile) {
    for (const std::string& n : profile_notes(*profile, &cluster)) std::cout << n << "\n";
  }
  const double jitter = engine::jitter_cv_of(options.jitter_cv, options.profile);
  if (jitter > 0) {
    std::cout << fmt::format(
        "stragglers: compute time spread {:.1f}% (std/mean, {}); in both tiers every collective "
        "waits for its slowest rank (normal, independent ranks: an approximation)\n",
        100 * jitter, options.jitter_cv ? "as given" : "the profile's jitter_cv");
  }
  const double rank_spread = engine::rank_spread_cv_of(options.rank_spread_cv, options.profile);
  if (rank_spread > 0) {
    std::cout << fmt::format(
        "slow rank: the ranks' speeds spread {:.1f}% (std/mean, {}); in both tiers the slowest "
        "of a plan's n ranks computes E[max of n normals] x that slower, on its busiest stage "
        "(normal, independent speeds: an approximation)\n",
        100 * rank_spread, options.rank_spread_cv ? "as given" : "the profile's rank_spread_cv");
  }
  std::cout << "\n";
  if (result.ranked.empty()) {
    std::cout << "no plan fits.\n";
  } else {
    // Ranked by cost: what a step costs, the figure it ranks by.
    const bool by_cost = options.objective == planner::Objective::Cost;
    std::vector<std::string> headers = {"#", "plan", "step"};
    std::vector<std::string> units = {"", "", "s"};
    if (by_cost) {
      headers.push_back("cost/step");
      units.push_back("USD");
    }
    for (const char* h : {"tokens/s", "MFU", "memory/GPU", "margin", "largest"}) {
      headers.push_back(h);
    }
    // Memory in MiB where every row's is under a GiB (a CPU host's small models read 0.0 GiB).
    double most = 0;
    for (int i = 0; i < shown; ++i) {
      most = std::max(most, result.ranked[static_cast<std::size_t>(i)].memory_bytes);
    }
    const bool mib = most < kGiB;
    for (const char* u : {"", "", mib ? "MiB" : "GiB", "GiB", "overhead"}) units.push_back(u);
    report::Table table(headers);
    table.set_units(units);
    table.align_left(1);
    table.align_left(headers.size() - 1);
    for (int i = 0; i < shown; ++i) {
      const auto& c = result.ranked[static_cast<std::size_t>(i)];
      const double tokens = static_cast<double>(c.plan.global_batch_size * c.plan.seq_len);
      std::vector<std::string> cells = {fmt::format("{}", i + 1), plan::summary(c.plan),
                                        format_seconds(c.step_time_s) + (c.refined ? "" : "*")};
      if (by_cost) cells.push_back(fmt::format("{:#.4g}", c.cost_per_step_usd));
      for (std::string cell : {format_rate(tokens / c.step_time_s),
                               c.refined ? format_percent(c.prediction.mfu) : std::string("-"),
                               fmt::format("{:.1f}", c.memory_bytes / (mib ? kMiB : kGiB)),
                               fmt::format("{:.1f}", (c.capacity_bytes - c.memory_bytes) / kGiB),
                               planner::dominant_term(breakdown_of(c), c.step_time_s)}) {
        cells.push_back(std::move(cell));
      }
      table.add_row(cells);
    }
    std::cout << table.render();
    bool estimates = false;
    for (int i = 0; i < shown; ++i)
      estimates = estimates || !result.ranked[static_cast<std::size_t>(i)].refined;
    if (estimates) std::cout << "(* closed-form estimate, not simulated)\n";
    // What the table leaves out or prices at its best: said, as simulate says it.
    if (!profile && !cluster.device.efficiency.gemm_waves) {
      std::cout << fmt::format(
          "(MFU: GEMMs at {:.1f}% of peak whatever their shape, {}'s best over large ones: an "
          "upper bound for small or odd shapes; --profile times them)\n",
          100 * cluster.device.efficiency.gemm.value, cluster.device.name);
    }
    if (auto note = plan::uneven_layers_note(spec, result.ranked.front().plan)) {
      std::cout << "#1: " << *note << "\n";
    }
    if (profile) {
      // What the profile did not measure of #1's compute (simulate's note).
      const plan::Plan& best = result.ranked.front().plan;
      const model::ModelGraph g = plan::graph_of(spec, best);
      for (const std::string& n :
           cost::ComputeCost(g, best, cluster.device, &*profile).profile_coverage()) {
        std::cout << "#1: " << n << "\n";
      }
    }
    if (auto note = plan::sliding_window_note(spec, result.ranked.front().plan.seq_len)) {
      std::cout << "(" << *note << ")\n";
    }
    // FlashAttention executes fewer FLOPs than MFU counts (simulate's note, for #1).
    if (const auto& best = result.ranked.front();
        best.refined && best.plan.attention == model::AttentionKernel::Flash &&
        best.prediction.hardware_flops > 0) {
      // HFU's share of the peak, counted in the FLOPs executed.
      const double executed =
          best.prediction.hfu * best.prediction.executed_flops / best.prediction.hardware_flops;
      std::cout << fmt::format(
          "(MFU counts the attention core dense, as Megatron-LM's formula does; FlashAttention "
          "skips the causal mask's blocks: #1's kernels execute {:.1f}% of the peak)\n",
          100 * executed);
    }
    if (result.ranked.size() > 1 && result.ranked[0].refined && result.ranked[1].refined) {
      const auto& a = result.ranked[0].prediction.breakdown;
      const auto& b = result.ranked[1].prediction.breakdown;
      const std::pair<double, const char*> diffs[] = {
          {b.compute_s - a.compute_s, "compute"},
          {b.recompute_s - a.recompute_s, "recompute"},
          {b.bubble_s - a.bubble_s, "pipeline bubble"},
          {b.exposed_tp_s - a.exposed_tp_s, "exposed TP communication"},
          {b.exposed_cp_s - a.exposed_cp_s, "exposed CP communication"},
          {b.exposed_ep_s - a.exposed_ep_s, "exposed EP communication"},
          {b.exposed_dp_s - a.exposed_dp_s, "exposed DP communication"},
          {b.exposed_pp_s - a.exposed_pp_s, "exposed PP communication"},
          {b.straggler_s() - a.straggler_s(), "straggler waits"},
          {b.optimizer_s - a.optimizer_s, "optimizer"}};
      const double faster = result.ranked[1].step_time_s - result.ranked[0].step_time_s;
      // The terms #2 spends more and less on, largest first; a term under 5% of the difference
      // is not named (a wording choice, not a model constant).
      std::vector<std::pair<double, const char*>> more, less;
      double unnamed = faster;  // what the named terms leave of the difference
      for (const auto& d : diffs) {
        if (d.first >= 0.05 * faster) more.push_back(d);
        if (d.first <= -0.05 * faster) less.push_back({-d.first, d.second});
        if (std::abs(d.first) >= 0.05 * faster) unnamed -= d.first;
      }
      auto list = [](std::vector<std::pair<double, const char*>> terms, const char* how) {
        std::stable_sort(terms.begin(), terms.end(),
                         [](const auto& x, const auto& y) { return x.first > y.first; });
        std::vector<std::string> said;
        for (const auto& [seconds, what] : terms) {
          said.push_back(fmt::format("{} {} on {}", format_duration(seconds), how, what));
        }
        if (said.size() <= 1) return said.empty() ? std::string() : said.front();
        const std::string last = said.back();
        said.pop_back();
        return fmt::format("{} and {}", fmt::join(said, ", "), last);
      };
      // #2 is never faster: both were simulated and ranked by step time (or by its cost, in
      // proportion). Where the ranking's keys tie, the one that needs less memory is first.
      if (planner::ranking_key(result.ranked[0].step_time_s) ==
          planner::ranking_key(result.ranked[1].step_time_s)) {
        const double saved = result.ranked[1].memory_bytes - result.ranked[0].memory_bytes;
        std::cout << fmt::format(
            "\n#1 and #2 take the same time per step (to about a part in 10^9){}\n",
            saved > 0 ? fmt::format("; #1 needs {:.1f} GiB less per GPU", saved / kGiB) : "");
      } else if (more.empty() && less.empty()) {
        std::cout << fmt::format(
            "\nwhy #1 beats #2: {} faster per step, spread over terms that each differ by less "
            "than 5% of it\n",
            format_duration(faster));
      } else if (more.size() == 1 && less.empty() && more.front().first <= faster) {
        std::cout << fmt::format("\nwhy #1 beats #2: {} faster per step, most of it ({}) in {}\n",
                                 format_duration(faster), format_duration(more.front().first),
                                 more.front().second);
      } else {
        // Every term that weighs: with what #2 wins back, they add up to the difference.
        // Terms each too small to name may still weigh together: said as one, so that the
        // sentence adds up (Llama 3 405B on 512 GPUs: TP communication and recompute, 8% of
        // the difference between them).
        std::vector<std::string> parts;
        if (!more.empty()) parts.push_back(list(more, "more"));
        if (!less.empty()) parts.push_back(list(less, "less"));
        if (std::abs(unnamed) >= 0.05 * faster) {
          parts.push_back(fmt::format("{} {} on terms under 5% of it each",
                                      format_duration(std::abs(unnamed)),
                                      unnamed > 0 ? "more" : "less"));
        }
        std::cout << fmt::format("\nwhy #1 beats #2: {} faster per step: #2 spends {}\n",
                                 format_duration(faster), fmt::join(parts, ", and "));
      }
      // Where #1 hides more communication behind its compute than #2, by enough that the
      // average slowdown of such compute on a GPU, which dtsim does not model, would undo its
      // lead: said, since the ranking may not hold on the hardware.
      const double extra = a.overlapped_s - b.overlapped_s;
      if (faster > 0 && extra > 0 && kMeanOverlapSlowdown * extra >= faster) {
        std::cout << fmt::format(
            "(#1 runs {} more of its compute beside communication than #2, priced as fast as "
            "alone; GPUs slow such compute, {:.1f}% on average in Lee et al. 2025, which dtsim "
            "does not model: at that rate up to {} a step, more than #1's lead)\n",
            format_duration(extra), 100 * kMeanOverlapSlowdown,
            format_duration(kMeanOverlapSlowdown * extra));
      }
    }
  }
  if (train_tokens > 0 && !result.ranked.empty()) {
    const auto& best = result.ranked.front();
    const plan::TrainingTime tt = goal.of(best);
    std::cout << fmt::format(
                     "time to train on {:.3g} tokens with #1: {}\n", train_tokens,
                     training_time_text(tt, best.cost_per_step_usd >= 0
                                                ? std::optional(tt.steps * best.cost_per_step_usd)
                                                : std::nullopt))
              << interruptions_note(goal.reliability) << "\n";
    if (best.cost_per_step_usd < 0) std::cout << unpriced_note(cluster.name) << "\n";
  }
  if (result.ranked.empty() && result.closest_not_fitting) {
    std::cout << closest_to_fitting(spec, cluster, space.memory, *result.closest_not_fitting)
              << "\n";
  }
  if (!result.memory_frontier.empty()) {
    // Its last row is as fast as the fastest plan that does not fit (the same plan but for a
    // tie in time, where the front keeps the one needing less memory).
    print_memory_frontier(result);
  } else if (result.best_not_fitting) {
    const auto& c = *result.best_not_fitting;
    std::cout << fmt::format(
        "fastest plan that does not fit: {} (estimate {:.3f} s) needs {:.1f} GiB "
        "of {:.1f} GiB, {:.1f} GiB too much\n",
        plan::summary(c.plan), c.estimate_s, c.memory_bytes / kGiB, c.capacity_bytes / kGiB,
        (c.memory_bytes - c.capacity_bytes) / kGiB);
  }
  if (result.refined > 1) {
    std::cout << fmt::format(
        "tiers: {} of {} pairs of simulated plans ordered differently by the "
        "estimate{}; largest estimate error {:.1f}%\n",
        result.order_disagreements, result.refined * (result.refined - 1) / 2,
        result.order_disagreements > 0
            ? fmt::format(" (simulated at most {:.1f}% apart)", 100 * result.max_disagreement_gap)
            : "",
        100 * result.max_estimate_error);
  }
  if (network_name == "simgrid" && result.refined > 0) {
    std::cout << fmt::format(
        "network: the {} simulated plans' collectives and transfers flow-simulated on SimGrid; "
        "the estimates with the analytical model\n",
        result.refined);
  }
  if (vm.count("out") && !result.ranked.empty()) {
    std::cout << "best plan written to " << vm["out"].as<std::string>() << "\n";
  }
  return rc;
}

}  // namespace dtsim::cli
