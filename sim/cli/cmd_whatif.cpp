// dtsim whatif: sweep inputs (GPUs, device, cluster, network, batch, sequence, model) and show,
// for each point, the best plan (or a fixed plan), its step time, scaling efficiency, the Amdahl
// bound, and time, cost and energy to train on a number of tokens.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <type_traits>

#include "sim/cli/commands.hpp"
#include "sim/cli/isolated.hpp"
#include "sim/cli/mpi_split.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/csv.hpp"
#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"
#include "sim/common/units.hpp"
#include "sim/engine/simulator.hpp"
#include "sim/planner/planner.hpp"
#include "sim/report/json_values.hpp"
#include "sim/report/table.hpp"

namespace dtsim::cli {

namespace {

const std::vector<std::string> kKeys = {
    "gpus", "nodes", "device", "cluster", "nic_gbps", "latency_us", "oversubscription",
    "global_batch", "seq_len", "model", "jitter_cv", "rank_spread_cv", "expert_load", "attention",
    // (kReliabilityKeys, options.hpp: time to train with interruptions alone reads them.)
    "interruptions_per_gpu_hour", "restart_minutes", "checkpoint_write_gbs_per_gpu",
    "checkpoint_write_gbs_total", "checkpoint_async_gbs_per_gpu"};

// A value of --vary attention.
model::AttentionKernel attention_value(const std::string& v) {
  model::AttentionKernel a = model::AttentionKernel::Unfused;
  if (!model::parse_attention_kernel(v, a)) {
    throw InputError(fmt::format("--vary attention={}: expected unfused or flash", v));
  }
  return a;
}

struct Axis {
  std::string key;
  std::vector<std::string> values;
};

// A value's text as a finite decimal number, all of it; nullopt where it is not one (std::stod
// also reads hexadecimal, which the plan flags do not take).
std::optional<double> decimal(const std::string& v) {
  if (v.empty() || v.find_first_not_of("0123456789.eE+-") != std::string::npos) {
    return std::nullopt;
  }
  // (strtod, not stod: a value too small for a double reads as one, which the axis's bounds then
  // refuse by name, where stod would throw.)
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (end == v.c_str() + v.size() && std::isfinite(d)) return d;
  return std::nullopt;
}

// A value of --vary jitter_cv or rank_spread_cv (`key`): a fraction in [0, 1).
double spread_value(const std::string& key, const std::string& v) {
  const std::optional<double> cv = decimal(v);
  if (!cv) throw InputError(fmt::format("--vary {}={}: expected a fraction in [0, 1)", key, v));
  return checked_jitter(*cv, fmt::format("--vary {}={}", key, v));
}

double number(const std::string& key, const std::string& v, bool integer) {
  const std::optional<double> d = decimal(v);
  // Integers stay below 2^53, where doubles are exact and the cast to int64 is defined.
  // Other figures keep to the bounds a cluster file's do (in the axis's own unit).
  if (!d || !(*d > 0) || (!integer && !(*d >= kSmallestFigure && *d <= kLargestFigure)) ||
      (integer &&
       (*d >= 9007199254740992.0 || *d != static_cast<double>(static_cast<std::int64_t>(*d))))) {
    throw InputError(fmt::format(
        "--vary {}={}: expected a positive {}", key, v,
        integer ? "integer"
                : fmt::format("number (from {:g} to {:g})", kSmallestFigure, kLargestFigure)));
  }
  return *d;
}

bool is_reliability_key(const std::string& key) {
  return std::find(kReliabilityKeys.begin(), kReliabilityKeys.end(), key) != kReliabilityKeys.end();
}

// Sets a reliability axis's value on `r`, in its flag's unit and checked as the flag's value is;
// checkpoint_async_gbs_per_gpu also takes "sync" (synchronous checkpoints, as without the
// flag). Returns the number (nullopt: sync).
std::optional<double> set_reliability_value(plan::Reliability& r, const std::string& key,
                                            const std::string& v) {
  const bool asynchronous = key == "checkpoint_async_gbs_per_gpu";
  if (asynchronous && v == "sync") {
    r.checkpoint_snapshot_bytes_per_s_per_device.reset();
    return std::nullopt;
  }
  const std::string what = fmt::format("--vary {}={}", key, v);
  const std::optional<double> d = decimal(v);
  if (!d) {
    throw InputError(fmt::format("{}: expected a number{}", what,
                                 asynchronous ? " (GB/s) or sync (synchronous checkpoints)" : ""));
  }
  set_reliability(r, key, *d, what);
  return d;
}

// The flags' reliability figures with a point's own where it varies them.
plan::Reliability reliability_at(plan::Reliability r,
                                 const std::map<std::string, std::string>& point) {
  for (const auto& [key, v] : point) {
    if (is_reliability_key(key)) set_reliability_value(r, key, v);
  }
  return r;
}

// A value of --vary nic_gbps or latency_us, within a cluster file's bounds on the figure it
// sets (beyond them a unit mistake: a cluster file refuses them too), in the axis's unit.
double network_value(const std::string& key, const std::string& v) {
  const double d = number(key, v, false);
  const bool nic = key == "nic_gbps";
  // Bytes/s to Gbit/s; seconds to microseconds.
  const double least = nic ? cluster::kLeastBandwidth * 8 / 1e9 : cluster::kLeastLatency * 1e6;
  const double most = nic ? cluster::kMostBandwidth * 8 / 1e9 : cluster::kMostLatency * 1e6;
  if (!(d >= least && d <= most)) {
    throw InputError(fmt::format("--vary {}={}: expected {} from {:g} to {:g} (a unit mistake?)",
                                 key, v, nic ? "Gbit/s" : "microseconds", least, most));
  }
  return d;
}

// A value of --vary expert_load: at least 1.
double load_value(const std::string& v) {
  const double load = number("expert_load", v, false);
  if (load < 1) {
    throw InputError(fmt::format("--vary expert_load={}: {}", v, plan::kExpertLoadExpected));
  }
  return load;
}

// The number a value of a numeric axis reads as, checked; nullopt on the other axes.
std::optional<double> axis_number(const std::string& key, const std::string& v) {
  if (key == "jitter_cv" || key == "rank_spread_cv") return spread_value(key, v);
  if (key == "expert_load") return load_value(v);
  if (key == "gpus" || key == "nodes" || key == "global_batch" || key == "seq_len") {
    return number(key, v, true);
  }
  if (key == "nic_gbps" || key == "latency_us") return network_value(key, v);
  if (key == "oversubscription") return number(key, v, false);
  return std::nullopt;
}

struct Identity {
  std::string text;
  bool number = false;  // a numeric axis's value: rows and JSON show `text`
};

// What a value of an axis stands for, checked here, before any point runs: the number it reads
// as on the numeric axes (8, 08 and +8 are one), a catalog device's name for a device given by
// name or alias (h100-sxm and H100 are one; a file is its path), an attention kernel's name;
// else the text.
Identity axis_identity(const std::string& key, const std::string& v) {
  if (is_reliability_key(key)) {
    plan::Reliability checked;
    const auto x = set_reliability_value(checked, key, v);
    return x ? Identity{fmt::format("{}", *x == 0 ? 0.0 : *x), true} : Identity{"sync"};
  }
  if (const auto x = axis_number(key, v)) {
    return {fmt::format("{}", *x == 0 ? 0.0 : *x), true};  // (-0 is 0)
  }
  if (key == "attention") return {std::string(model::to_string(attention_value(v)))};
  const bool path = names_a_path(v);
  // A model or cluster by name or by its file's path: the file (tiny-gpt and
  // models/tiny-gpt.json are one).
  if (key == "model" || key == "cluster") {
    try {
      return {data_file(key, v).string()};
    } catch (const InputError& e) {
      throw InputError(fmt::format("--vary {}={}: {}", key, v, e.what()));
    }
  }
  if (key == "device" && !path) {
    try {
      return {cluster::load_device(v).name};
    } catch (const InputError& e) {
      throw InputError(fmt::format("--vary device={}: {}", v, e.what()));
    }
  }
  return {v};
}

// One --vary: a key and its values, or keys varied together ("cluster:gpus=a:512,b:1024": each
// value a tuple, which the points take as one).
struct Vary {
  std::vector<std::string> keys;
  std::vector<std::vector<std::string>> tuples;
};

// Splits `text` at `sep`, keeping empty parts (getline drops a trailing one).
std::vector<std::string> split_keeping(const std::string& text, char sep) {
  std::vector<std::string> parts(1);
  for (const char c : text) {
    if (c == sep) {
      parts.emplace_back();
    } else {
      parts.back() += c;
    }
  }
  return parts;
}

Vary parse_vary(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq + 1 >= text.size()) {
    throw InputError(
        fmt::format("--vary {}: expected KEY=V1,V2,... (keys: {})", text, fmt::join(kKeys, ", ")));
  }
  Vary a;
  a.keys = split_keeping(text.substr(0, eq), ':');
  for (const auto& key : a.keys) {
    if (std::find(kKeys.begin(), kKeys.end(), key) == kKeys.end()) {
      throw InputError(fmt::format("--vary {}: unknown key \"{}\" (keys: {})", text, key,
                                   fmt::join(kKeys, ", ")));
    }
    if (std::count(a.keys.begin(), a.keys.end(), key) > 1) {
      throw InputError(fmt::format("--vary {}: key \"{}\" given twice", text, key));
    }
  }
  std::vector<std::string> given, identities;  // the texts and what they stand for
  for (const std::string& v : split_keeping(text.substr(eq + 1), ',')) {
    if (v.empty()) throw InputError(fmt::format("--vary {}: empty value", text));
    const std::vector<std::string> parts =
        a.keys.size() > 1 ? split_keeping(v, ':') : std::vector<std::string>{v};
    if (parts.size() != a.keys.size()) {
      throw InputError(
          fmt::format("--vary {}: {}: expected {} values joined by ':', one for "
                      "each of {}",
                      text, v, a.keys.size(), fmt::join(a.keys, ", ")));
    }
    std::vector<std::string> tuple, identity_texts;
    for (std::size_t k = 0; k < parts.size(); ++k) {
      if (parts[k].empty()) throw InputError(fmt::format("--vary {}: empty value", text));
      const Identity identity = axis_identity(a.keys[k], parts[k]);
      // A number as it reads; a name or path as given (the rows show what the user wrote).
      tuple.push_back(identity.number ? identity.text : parts[k]);
      identity_texts.push_back(identity.text);
    }
    const std::string identity = fmt::format("{}", fmt::join(identity_texts, "\x1f"));
    for (std::size_t i = 0; i < given.size(); ++i) {
      if (given[i] == v || identities[i] == identity) {
        throw InputError(
            given[i] == v
                ? fmt::format("--vary {}: {} given twice (its rows would be the same)", text, v)
                : fmt::format("--vary {}: {} and {} are the same value (their rows would be the "
                              "same)",
                              text, given[i], v));
      }
    }
    a.tuples.push_back(std::move(tuple));
    given.push_back(v);
    identities.push_back(identity);
  }
  return a;
}

}  // namespace

int cmd_whatif(const std::vector<std::string>& args) {
  po::options_description desc("dtsim whatif options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/true, "--fixed-plan");
  desc.add_options()(
      "vary", po::value<std::vector<std::string>>()->composing(),
      "KEY=V1,V2,... (repeatable; every combination is a point; KEY1:KEY2=A1:B1,A2:B2 varies "
      "keys together, a point per tuple). Keys: gpus, nodes (whole nodes; "
      "more than the cluster's file has: a larger fat tree or rail-optimized cluster of the same "
      "nodes and leaves), device, cluster, "
      "nic_gbps (per NIC), latency_us (inter-node), oversubscription, global_batch, seq_len, "
      "model, jitter_cv (stragglers: spread of compute times, in [0, 1)), rank_spread_cv (the "
      "slow rank: spread of the ranks' lasting speeds, in [0, 1)), expert_load (expert "
      "parallelism's routing: the busiest ep rank's token copies over the even share, >= 1; "
      "capped at what routing can make at the plan's ep), attention (unfused, flash: the attention "
      "core's kernels); with --tokens, the figures of the time to train with interruptions in "
      "their flags' units: interruptions_per_gpu_hour, restart_minutes, "
      "checkpoint_write_gbs_per_gpu, checkpoint_write_gbs_total, checkpoint_async_gbs_per_gpu "
      "(or sync); points that differ only in these share one search");
  add_global_batch_options(desc, "sequences per step (required unless global_batch is varied)");
  desc.add_options()("seq-len", po::value<std::int64_t>(),
                     "sequence length (default: the model's)")(
      "tokens", po::value<double>(),
      "training tokens, for time, cost and energy to train (the time with interruptions, "
      "checkpoints and restarts as well: see the reliability flags)")(
      "refine", po::value<int>()->default_value(2),
      "plans simulated per point: the candidates the closed form ranks best, each simulated, the "
      "fastest kept (dtsim plan simulates 8: where candidates' estimates lie within a few "
      "percent, as ZeRO stages of one layout often do, a point's plan may differ from plan's "
      "best; --refine 8 gives the same)")(
      "network", po::value<std::string>()->default_value("analytical"),
      "network model of each point's plan: analytical, or simgrid (the plan the search chose, or "
      "--fixed-plan, simulated with flows on SimGrid, each point in a process of its own; the "
      "search ranks plans with the analytical model); without the flag, the one a --fixed-plan "
      "file was simulated on")(
      "precision", po::value<std::string>(),
      "bf16, fp16, fp8, fp32, tf32 (default: a --fixed-plan's own, else bf16; fp16 on a "
      "device without bf16, fp32 on one with neither)")(
      "profile", po::value<std::string>(),
      "calibration profile (dtexec calibrate) for the compute cost at every point (not with "
      "--vary device; its jitter_cv and rank_spread_cv are the straggler model's unless "
      "varied)")(
      "fixed-plan", po::value<std::string>(),
      "simulate this plan file at every point instead of searching (on its own dp x tp x pp x "
      "cp devices, or the cluster's where fewer, unless --gpus or --vary gpus say otherwise: "
      "then its dp is recomputed to fill them; its global batch is the default of "
      "--global-batch-size)")("json", po::bool_switch(), "print JSON")("csv", po::bool_switch(),
                                                                       "print CSV");
  po::options_description search("The search at each point (as dtsim plan's)");
  add_search_space_options(search);
  desc.add(search);
  po::options_description interruptions("Time to train with interruptions (with --tokens)");
  add_reliability_options(interruptions);
  add_price_option(interruptions);
  desc.add(interruptions);
  po::variables_map vm;
  if (!parse(
          args, desc,
          "usage: dtsim whatif --model M --cluster C --global-batch-size B --vary KEY=V1,V2,...\n"
          "                    (or --vary global_batch=B1,B2,... without --global-batch-size;\n"
          "                    with --fixed-plan P.json, its global batch by default)\n"
          "                    [--vary ...] [--tokens N] [--precision P] [--profile P.json]\n"
          "                    [--csv|--json]\n\n"
          "For every combination of the varied inputs: the best plan (or --fixed-plan), step "
          "time, tokens/s, scaling efficiency against the first point, the Amdahl bound, and "
          "with --tokens the time, cost (cluster price) and energy (device power) to train.",
          vm)) {
    return 0;
  }
  check_one_format(vm);
  if (!vm.count("vary")) throw InputError("--vary: give at least one KEY=V1,V2,...");
  if (vm.count("fixed-plan")) {
    for (const char* flag : {"fixed", "max-tp", "max-pp", "max-cp"}) {
      if (vm.count(flag) && !vm[flag].defaulted()) {
        throw InputError(fmt::format("--{}: a search limit, not with --fixed-plan", flag));
      }
    }
  }
  // The --vary's as given, and each key with its values (in their order, once each).
  std::vector<Vary> varies;
  std::vector<Axis> axes;
  for (const auto& v : vm["vary"].as<std::vector<std::string>>()) {
    Vary g = parse_vary(v);
    for (std::size_t k = 0; k < g.keys.size(); ++k) {
      const std::string& key = g.keys[k];
      for (const Axis& b : axes) {
        if (b.key == key) {
          throw InputError(
              fmt::format("--vary {}: key \"{}\" is already varied; give all its values in one "
                          "--vary {}=V1,V2,...",
                          v, key, key));
        }
      }
      Axis a{key, {}};
      for (const auto& tuple : g.tuples) {
        if (std::find(a.values.begin(), a.values.end(), tuple[k]) == a.values.end()) {
          a.values.push_back(tuple[k]);
        }
      }
      axes.push_back(std::move(a));
    }
    varies.push_back(std::move(g));
  }
  auto varied = [&](const char* key) {
    return std::any_of(axes.begin(), axes.end(), [&](const Axis& a) { return a.key == key; });
  };
  if (varied("gpus") && varied("nodes")) {
    throw InputError("--vary nodes: gpus is varied too; give the devices one way");
  }
  if (vm.count("gpus") && varied("nodes")) {
    throw InputError("--gpus: the nodes are varied (--vary nodes=...); give one or the other");
  }
  if (vm.count("attention") && varied("attention")) {
    throw InputError(
        "--attention: the attention kernel is varied (--vary attention=...); give "
        "one or the other");
  }
  const std::string network_name = network_argument(vm);
  if (network_name != "analytical" && network_name != "simgrid") {
    throw InputError(
        fmt::format("--network: expected analytical or simgrid, got \"{}\"", network_name));
  }
  const bool on_simgrid = network_name == "simgrid";
  const int refine = vm["refine"].as<int>();
  if (refine < 1) {
    throw InputError(
        fmt::format("--refine: expected a positive integer (plans simulated per "
                    "point), got {}",
                    refine));
  }
  // --fixed-plan's file, read once for every point.
  const std::optional<plan::Plan> fixed_plan =
      vm.count("fixed-plan") ? std::optional(load_plan_file(vm["fixed-plan"].as<std::string>()))
                             : std::nullopt;
  // Its straggler figures (jitter_cv, rank_spread_cv: a whatif point's), where a point does not
  // vary them.
  std::array<std::optional<double>, 2> fixed_spread;
  if (fixed_plan) {
    const std::string file = vm["fixed-plan"].as<std::string>();
    // (Its cluster_changes are left to the points, but checked as simulate checks them.)
    check_plan_file_cluster(file);
    fixed_spread = {plan::plan_file_spread(plan_file_json(file), file, "jitter_cv"),
                    plan::plan_file_spread(plan_file_json(file), file, "rank_spread_cv")};
  }
  // A --fixed-plan without a precision trains at each point's default, as dtsim simulate --plan
  // does (fp16 on a device without bf16, fp32 on one with neither).
  const bool fixed_precision =
      fixed_plan && JsonReader(plan_file_json(vm["fixed-plan"].as<std::string>()),
                               vm["fixed-plan"].as<std::string>())
                        .has("precision");  // (null: absent, as the plan reads it)
  // The model and cluster of the points that do not vary them: a --fixed-plan file's (dtsim plan
  // --out) where --model and --cluster are not given.
  const std::string default_model =
      varied("model") ? vm["model"].as<std::string>() : data_argument(vm, "model");
  const std::string default_cluster =
      varied("cluster") ? vm["cluster"].as<std::string>() : data_argument(vm, "cluster");
  auto global_batch = global_batch_from_options(vm);
  const bool batch_varied = varied("global_batch");
  // A fixed plan's own global batch, unless given or varied.
  if (!global_batch && !batch_varied && fixed_plan) {
    const std::int64_t own = fixed_plan->global_batch_size;
    if (own > 0) global_batch = own;  // (0: the file has none)
  }
  if (!global_batch && !batch_varied) {
    throw InputError(
        "--global-batch-size: required (or --vary global_batch=..., or a --fixed-plan's)");
  }
  if (global_batch && batch_varied) {
    throw InputError(fmt::format(
        "--{}: the global batch is varied (--vary global_batch=...); give one or the other",
        vm.count("global-batch") ? "global-batch" : "global-batch-size"));
  }
  const double tokens = training_tokens(vm);
  const plan::Reliability reliability = reliability_from_options(vm);
  std::vector<std::string> reliability_axes;
  for (const Axis& a : axes) {
    if (!is_reliability_key(a.key)) continue;
    if (tokens <= 0) {
      throw InputError(fmt::format("--vary {}: only with --tokens (the time to train)", a.key));
    }
    std::string flag = a.key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (vm.count(flag) && !vm[flag].defaulted()) {
      throw InputError(fmt::format("--{}: {} is varied (--vary {}=...); give one or the other",
                                   flag, a.key, a.key));
    }
    reliability_axes.push_back(a.key);
  }

  // A profile times one device: it prices every point, so no other device may come in.
  std::optional<cost::Profile> profile;
  const std::optional<std::string> profile_file = profile_argument(vm);
  if (profile_file) {
    if (varied("device")) {
      throw InputError(fmt::format(
          "{}: a profile prices the device it was measured on; not with --vary device",
          vm.count("profile")
              ? "--profile"
              : fmt::format("{}: profile {}", vm["fixed-plan"].as<std::string>(), *profile_file)));
    }
    profile = cost::load_profile(*profile_file);
  }
  std::optional<Precision> precision;
  if (vm.count("precision")) {
    precision = precision_of_flag("precision", vm["precision"].as<std::string>());
  }
  const MpiSplit split;
  if (profile) {
    // Each device of the points' clusters that is not the profile's, said once. Every rank
    // loads the clusters, so that a bad name ends them all alike.
    std::vector<std::string> clusters = {default_cluster};
    for (const Axis& a : axes) {
      if (a.key == "cluster") clusters = a.values;
    }
    std::vector<std::string> said;
    for (const std::string& name : clusters) {
      const cluster::Cluster c = cluster::load_cluster(name);
      for (const auto& w : profile_warnings(*profile, c.device)) {
        if (std::find(said.begin(), said.end(), w) != said.end()) continue;
        if (split.rank() == 0) std::cerr << w << "\n";
        said.push_back(w);
      }
    }
  }

  // --vary expert_load: refused where no model of the sweep has experts (as plan and simulate
  // refuse --expert-load); a dense model among others keeps its rows, which a note names.
  std::vector<std::string> dense_models;
  for (const Axis& a : axes) {
    if (a.key != "expert_load" ||
        std::all_of(a.values.begin(), a.values.end(),
                    [](const std::string& v) { return load_value(v) == 1; })) {
      continue;
    }
    std::vector<std::string> models = {default_model};
    for (const Axis& b : axes) {
      if (b.key == "model") models = b.values;
    }
    bool experts = false;
    for (const auto& name : models) {
      const model::ModelSpec spec = model::load_model(name);
      if (spec.moe) {
        experts = true;
      } else {
        dense_models.push_back(spec.name);
      }
    }
    if (!experts) {
      throw InputError(fmt::format("--vary expert_load: needs a mixture of experts; {} {} none",
                                   fmt::join(dense_models, ", "),
                                   dense_models.size() == 1 ? "has" : "have"));
    }
  }

  // Every combination, first --vary slowest (keys varied together as one).
  std::vector<std::map<std::string, std::string>> points(1);
  for (const Vary& g : varies) {
    std::vector<std::map<std::string, std::string>> next;
    for (const auto& p : points) {
      for (const auto& tuple : g.tuples) {
        auto q = p;
        for (std::size_t k = 0; k < g.keys.size(); ++k) q[g.keys[k]] = tuple[k];
        next.push_back(q);
      }
    }
    points = std::move(next);
  }

  struct Row {
    std::map<std::string, std::string> point;
    std::string plan;
    nlohmann::json plan_spec;  // the plan in a --plan file's fields (plan::to_json)
    std::string network;       // the network model that timed the plan (Prediction::network)
    std::int64_t gpus = 0;
    double step_s = 0, tokens_per_s = 0, mfu = 0, max_speedup = 0;
    double train_s = 0, cost_usd = -1, energy_kwh = -1;
    // With the straggler model on (--vary jitter_cv, or the profile's): what stragglers add to
    // the step (the step against the same plan's without jitter;
    // engine::Prediction::straggler_cost_s).
    std::optional<double> straggler_cost_s;
    // With the slow rank on (--vary rank_spread_cv, or the profile's): what it adds to the step
    // without jitter (engine::Prediction::slow_rank_cost_s).
    std::optional<double> slow_rank_cost_s;
    // With --tokens: interruptions, checkpoints and restarts (plan/goodput.hpp).
    double goodput = 0, job_mtbf_s = 0, checkpoint_write_s = 0, checkpoint_blocking_s = 0;
    std::int64_t checkpoint_every_steps = 0;
    bool checkpoint_async = false;
    double wall_s() const {
      return goodput > 0 ? train_s / goodput : std::numeric_limits<double>::infinity();
    }
    bool found = false;
    // Why the point has no row: its cluster has not the point's GPUs, or a --fixed-plan is not
    // valid there (its tp does not divide the point's GPUs, its dp x micro-batch the point's
    // global batch, ...); empty where it has one.
    std::string invalid;
    // Without a plan: whether any candidate met the search's constraints (a prime number of
    // GPUs may leave none: no dp dividing the global batch).
    bool valid_candidates = true;
    // With --fixed-plan the plan is simulated whether or not it fits in memory.
    bool fits = true;
    bool priceless = false;       // another device left the cluster's price out
    std::optional<Figure> price;  // the point's price per device-hour, where it has one
    std::string unpriced;  // the cluster, where it has no price (and --price-per-gpu-hour none)
    // Where the point's cluster sets its device's efficiencies itself (selene's 2022 GEMM rate):
    // simulate's note, which tells two clusters of one device and one plan apart.
    std::string own_efficiency;
    // The point's cluster has not its gpus (the row's invalid says why).
    bool gpus_missing = false;
    // Where the point's nodes are more than its cluster's file has: "the cluster's file has N
    // nodes".
    std::string grown;
    // Another device left the cluster's device_efficiency out (its own device's figures).
    bool catalog_efficiency = false;
    // The point sets the inter-node network (nic_gbps, latency_us, oversubscription) of a
    // cluster whose devices are all in one node: nothing travels over it.
    bool network_unused = false;
    // The point sets oversubscription where all the cluster's nodes share one leaf.
    bool uplinks_unused = false;
    // The profile was measured by another number of ranks per host than the point's CPU
    // cluster runs (profile_host_note); empty otherwise.
    std::string profile_host;
    double memory_bytes = 0, capacity_bytes = 0;  // worst rank, device
  };
  // A row's fields by name but its point (which rank 0 has): what a rank sends rank 0 under
  // mpirun, written and read through this one list.
  auto row_fields = [](auto& r, auto&& field) {
    field("plan", r.plan);
    field("plan_spec", r.plan_spec);
    field("network", r.network);
    field("gpus", r.gpus);
    field("step", r.step_s);
    field("tps", r.tokens_per_s);
    field("mfu", r.mfu);
    field("amdahl", r.max_speedup);
    field("train", r.train_s);
    field("cost", r.cost_usd);
    field("energy", r.energy_kwh);
    field("stragglers", r.straggler_cost_s);
    field("slow_rank", r.slow_rank_cost_s);
    field("goodput", r.goodput);
    field("mtbf", r.job_mtbf_s);
    field("ckpt_write", r.checkpoint_write_s);
    field("ckpt_block", r.checkpoint_blocking_s);
    field("ckpt_every", r.checkpoint_every_steps);
    field("ckpt_async", r.checkpoint_async);
    field("found", r.found);
    field("invalid", r.invalid);
    field("valid", r.valid_candidates);
    field("fits", r.fits);
    field("priceless", r.priceless);
    field("unpriced", r.unpriced);
    field("own_efficiency", r.own_efficiency);
    field("gpus_missing", r.gpus_missing);
    field("grown", r.grown);
    field("catalog_efficiency", r.catalog_efficiency);
    field("network_unused", r.network_unused);
    field("uplinks_unused", r.uplinks_unused);
    field("profile_host", r.profile_host);
    field("memory", r.memory_bytes);
    field("capacity", r.capacity_bytes);
  };
  // What a point's search (or fixed plan) gives, which the points that differ only in reliability
  // figures share: the time to train with interruptions alone reads those.
  struct Core {
    Row row;
    std::optional<model::ModelSpec> spec;
    plan::Plan chosen;
  };
  auto evaluate_core = [&](const std::map<std::string, std::string>& point) {
    Core core;
    Row& row = core.row;
    row.point = point;
    const std::string model_name = point.count("model") ? point.at("model") : default_model;
    const model::ModelSpec spec = model_with_options(model::load_model(model_name), vm);
    cluster::Cluster c =
        cluster::load_cluster(point.count("cluster") ? point.at("cluster") : default_cluster);
    if (point.count("device")) {
      // Another device leaves the cluster's price (its own device's rate) out.
      const bool priced = c.price_per_device_hour_usd.has_value();
      const bool tuned = !c.device_efficiency_overrides.empty();
      c = cluster::with_device(std::move(c), cluster::load_device(point.at("device")));
      row.priceless = priced && !c.price_per_device_hour_usd && !vm.count("price-per-gpu-hour");
      row.catalog_efficiency = tuned && c.device_efficiency_overrides.empty();
    }
    apply_price(vm, c);
    if (!c.device_efficiency_overrides.empty()) {
      row.own_efficiency = fmt::format(
          "{} sets the device's {} efficiency itself (its device_efficiency), in place of the "
          "device catalog's",
          c.name, fmt::join(c.device_efficiency_overrides, ", "));
    }
    // A figure the cluster's inter-node network does not read would leave every row as it is:
    // refused, as the cluster's file refuses it (a cluster of one node, without a network,
    // has its rows noted below).
    for (const char* key : {"nic_gbps", "oversubscription"}) {
      if (point.count(key) && !cluster::is_switched(c.inter.fabric) &&
          c.inter.fabric != cluster::InterFabric::None) {
        throw InputError(fmt::format(
            "--vary {}={}: {}'s inter-node fabric is {}, which has no {} (only fat_tree, "
            "rail_optimized and dragonfly do)",
            key, point.at(key), c.name, cluster::to_string(c.inter.fabric),
            std::string_view(key) == "nic_gbps" ? "NICs" : "oversubscribed uplinks"));
      }
    }
    if (point.count("nic_gbps")) {
      c.inter.nic_bw_bytes_per_s = {network_value("nic_gbps", point.at("nic_gbps")) * 1e9 / 8,
                                    "whatif --vary nic_gbps"};
    }
    if (point.count("latency_us")) {
      c.inter.latency_s = {network_value("latency_us", point.at("latency_us")) * 1e-6,
                           "whatif --vary latency_us"};
    }
    if (point.count("oversubscription")) {
      const double o = number("oversubscription", point.at("oversubscription"), false);
      if (!(o >= 1 && o <= cluster::kMostOversubscription)) {
        throw InputError(fmt::format("--vary oversubscription={}: expected a ratio from 1 to {:g}",
                                     point.at("oversubscription"), cluster::kMostOversubscription));
      }
      c.inter.oversubscription = {o, "whatif --vary oversubscription"};
    }
    // A count of devices the point's cluster lacks, which another point's has: the row says why
    // it has no plan, with the count shown (a count no point's cluster has ends the run, below).
    const auto lacks = [&](std::int64_t gpus, std::string why) {
      row.gpus = gpus;
      row.valid_candidates = false;
      row.gpus_missing = true;
      row.invalid = std::move(why);
    };
    if (point.count("gpus")) {
      const auto gpus = static_cast<std::int64_t>(number("gpus", point.at("gpus"), true));
      row.gpus = gpus;
      try {
        c = with_devices_for(c, gpus, fmt::format("--vary gpus={}", point.at("gpus")));
      } catch (const InputError& e) {
        lacks(gpus, e.what());
        return core;
      }
    } else if (point.count("nodes")) {
      const auto nodes = static_cast<std::int64_t>(number("nodes", point.at("nodes"), true));
      const std::int64_t own = c.nodes;
      // (Shown where the cluster cannot have them; 0 past what a cluster may hold.)
      row.gpus = nodes <= cluster::kMaxDevices / c.node_size() ? nodes * c.node_size() : 0;
      try {
        c = cluster::with_nodes(c, nodes);
      } catch (const InputError& e) {
        // (Fewer nodes are --gpus's: its messages without their flag.)
        std::string why = e.what();
        if (why.rfind("--gpus ", 0) == 0 && why.find(": ") != std::string::npos) {
          why = why.substr(why.find(": ") + 2);
        }
        row.valid_candidates = false;
        row.invalid = fmt::format("--vary nodes={}: {}", point.at("nodes"), why);
        return core;
      }
      if (nodes > own) {
        row.grown = fmt::format("{} has {} node{} in its file", c.name, own, own == 1 ? "" : "s");
      }
    } else if (vm.count("gpus")) {
      try {
        c = cluster::with_devices(c, vm["gpus"].as<std::int64_t>());
      } catch (const InputError& e) {
        // (One cluster of a --vary cluster sweep; none with them: every row invalid ends the run.)
        if (!point.count("cluster")) throw;
        lacks(vm["gpus"].as<std::int64_t>(),
              fmt::format("--vary cluster={}: {}", point.at("cluster"), e.what()));
        return core;
      }
    } else if (fixed_plan) {
      // A plan file with its dp runs on its own devices, as dtsim simulate --plan does, where
      // the point's cluster has more.
      const std::int64_t own = fixed_plan->devices();
      if (own > 0 && own < c.devices()) {
        c = with_devices_for(c, own,
                             fmt::format("--fixed-plan {}: its {} devices on {} (or give --gpus "
                                         "or --vary gpus)",
                                         vm["fixed-plan"].as<std::string>(), own, c.name));
      }
    }
    row.network_unused = c.nodes == 1 && (point.count("nic_gbps") || point.count("latency_us") ||
                                          point.count("oversubscription"));
    // Oversubscription slows the uplinks between leaves (and between rails): with every node
    // under one leaf (not rail-optimized) nothing crosses them.
    row.uplinks_unused =
        c.nodes > 1 && point.count("oversubscription") && !cluster::crosses_uplinks(c);
    if (profile) {
      if (auto note = profile_host_note(*profile, c, "the points that run")) {
        row.profile_host = std::move(*note);
      }
    }
    planner::SearchSpace space;
    search_space_from_options(vm, space);
    // As dtsim plan: bf16, else fp16, else fp32 (a CPU host).
    space.precision = precision ? *precision : default_precision(c.device);
    // The profile's precision against the point's: a fixed plan's own where --precision does
    // not say.
    auto check_profile = [&](Precision trained) {
      if (profile && profile->precision != trained) {
        throw InputError(fmt::format(
            "{}: precision: {}, the point trains at {} (give --precision {} if the device has it)",
            profile->file, profile->precision_said(), to_string(trained),
            to_string(profile->precision)));
      }
    };
    const cost::Profile* const priced_by = profile ? &*profile : nullptr;
    space.global_batch_size =
        point.count("global_batch")
            ? static_cast<std::int64_t>(number("global_batch", point.at("global_batch"), true))
            : *global_batch;
    space.seq_len = point.count("seq_len")
                        ? static_cast<std::int64_t>(number("seq_len", point.at("seq_len"), true))
                        : (vm.count("seq-len") ? vm["seq-len"].as<std::int64_t>() : 0);
    if ((vm.count("seq-len") || point.count("seq_len")) &&
        (space.seq_len < 1 || space.seq_len > spec.max_positions)) {
      const std::string flag = point.count("seq_len")
                                   ? fmt::format("--vary seq_len={}", point.at("seq_len"))
                                   : std::string("--seq-len");
      throw InputError(fmt::format("{}: expected 1..{} (max_positions of {}), got {}", flag,
                                   spec.max_positions, spec.name, space.seq_len));
    }
    row.gpus = c.devices();
    // The point's straggler figures, else a --fixed-plan file's (a whatif point's), else the
    // profile's.
    std::optional<double> jitter = fixed_spread[0];
    if (point.count("jitter_cv")) jitter = spread_value("jitter_cv", point.at("jitter_cv"));
    std::optional<double> rank_spread = fixed_spread[1];
    if (point.count("rank_spread_cv")) {
      rank_spread = spread_value("rank_spread_cv", point.at("rank_spread_cv"));
    }
    if (point.count("expert_load")) space.expert_load = load_value(point.at("expert_load"));
    if (point.count("attention")) space.attention = attention_value(point.at("attention"));
    // The straggler model is on where the point varies jitter_cv above 0, or else where the
    // profile measured some.
    const bool stragglers = engine::jitter_cv_of(jitter, priced_by) > 0;
    const bool slow_rank = engine::rank_spread_cv_of(rank_spread, priced_by) > 0 && row.gpus > 1;
    engine::Prediction pred;
    plan::Plan chosen;
    if (fixed_plan) {
      plan::Plan p = *fixed_plan;
      if (point.count("expert_load") && p.ep > 1) {
        p.expert_load = std::min(space.expert_load, plan::max_expert_load(spec, p));
      }
      p.global_batch_size = space.global_batch_size;
      if (precision) {
        p.precision = *precision;
      } else if (!fixed_precision) {
        p.precision = default_precision(c.device);
      }
      check_profile(p.precision);
      if (space.seq_len > 0) p.seq_len = space.seq_len;
      if (vm.count("attention") || point.count("attention")) p.attention = space.attention;
      if (space.overlap_param_gather) p.overlap_param_gather = true;
      if (space.zero_in_place) p.zero_in_place = true;
      if (vm.count("clip-grad")) p.clip_grad = space.clip_grad;
      p.dp = 0;
      try {
        plan::complete_plan(p, spec, c.devices());
        plan::require_valid(p, spec, c.devices());
        c.device.peak_flops_for(p.precision);  // a device without it says so
      } catch (const InternalError&) {
        throw;
      } catch (const Error& e) {  // InputError, UnsupportedError: this point's
        // Which file, and at which point: the plan may be valid at the others, which get
        // their rows (a plan valid at no point ends the run, below).
        std::vector<std::string> at;
        for (const auto& [key, value] : point) at.push_back(fmt::format("{}={}", key, value));
        row.valid_candidates = false;
        row.invalid = fmt::format("--fixed-plan {} at {}: {}", vm["fixed-plan"].as<std::string>(),
                                  fmt::join(at, " "), e.what());
        return core;
      }
      const model::ModelGraph g = plan::graph_of(spec, p);
      auto net = network::make_analytical(c);
      engine::SimulateOptions sim_options;
      sim_options.profile = priced_by;
      sim_options.jitter_cv = jitter;
      sim_options.rank_spread_cv = rank_spread;
      sim_options.straggler_cost = true;
      pred = engine::simulate(g, p, c, *net, sim_options).prediction;
      if (stragglers) row.straggler_cost_s = pred.straggler_cost_s;
      if (slow_rank) row.slow_rank_cost_s = pred.slow_rank_cost_s;
      chosen = p;
      row.plan = plan::summary(p);
      row.plan_spec = plan::to_json(p);
      row.found = true;
    } else {
      check_profile(space.precision);
      c.device.peak_flops_for(space.precision);  // a device without it says so
      planner::SearchOptions options;
      options.refine = refine;
      options.profile = priced_by;
      options.jitter_cv = jitter;
      options.rank_spread_cv = rank_spread;
      options.memory_frontier = false;  // not shown
      const auto r = planner::search(spec, c, space, options);
      row.valid_candidates = r.evaluated > 0;
      if (!r.ranked.empty()) {
        pred = r.ranked.front().prediction;
        chosen = r.ranked.front().plan;
        row.plan = plan::summary(chosen);
        row.plan_spec = plan::to_json(chosen);
        row.found = true;
        if ((stragglers || slow_rank) && !on_simgrid) {
          // What the straggler model adds, as SimulateOptions::straggler_cost finds it: the
          // search simulated the best plan with the model, so only the run without jitter (the
          // slow rank kept) is left, and that run's own without the slow rank.
          auto net = network::make_analytical(c);
          engine::SimulateOptions calm;
          calm.profile = priced_by;
          calm.jitter_cv = 0.0;
          calm.rank_spread_cv = rank_spread;
          calm.straggler_cost = true;
          const engine::Prediction still =
              engine::simulate(plan::graph_of(spec, chosen), chosen, c, *net, calm).prediction;
          if (stragglers) row.straggler_cost_s = pred.step_time_s - still.step_time_s;
          if (slow_rank) row.slow_rank_cost_s = still.slow_rank_cost_s;
        }
      }
    }
    if (row.found && on_simgrid) {
      // The chosen plan again, its collectives and transfers flow-simulated (SimGrid's platform
      // is the point's: a process of its own); its memory as the search or simulation above
      // found it (with the search's memory options).
      engine::SimulateOptions o;
      o.profile = priced_by;
      o.jitter_cv = jitter;
      o.rank_spread_cv = rank_spread;
      o.straggler_cost = true;
      plan::MemoryReport memory = std::move(pred.memory);
      pred = simulate_on_simgrid(spec, chosen, c, o);
      pred.memory = std::move(memory);
      if (stragglers) row.straggler_cost_s = pred.straggler_cost_s;
      if (slow_rank) row.slow_rank_cost_s = pred.slow_rank_cost_s;
    }
    if (row.found) {
      row.network = pred.network;
      row.fits = pred.memory.fits;
      row.memory_bytes = pred.memory.worst().total_bytes;
      row.capacity_bytes = pred.memory.capacity_bytes;
      row.step_s = pred.step_time_s;
      row.tokens_per_s = pred.tokens_per_s;
      row.mfu = pred.mfu;
      row.max_speedup = pred.max_speedup;
      if (tokens > 0) {
        row.train_s = plan::training_steps(tokens, chosen) * row.step_s;
        const double device_hours = row.train_s / 3600 * static_cast<double>(row.gpus);
        if (c.price_per_device_hour_usd) {
          row.cost_usd = device_hours * c.price_per_device_hour_usd->value;
          row.price = c.price_per_device_hour_usd;
        } else if (!row.priceless) {
          row.unpriced = c.name;
        }
        if (c.power_per_device_w)
          row.energy_kwh = device_hours * c.power_per_device_w->value / 1000;
      }
    }
    core.spec = spec;
    core.chosen = chosen;
    return core;
  };
  // A point without its reliability figures: the points of one core share its search.
  auto core_of = [](std::map<std::string, std::string> point) {
    std::erase_if(point, [](const auto& kv) { return is_reliability_key(kv.first); });
    return point;
  };
  std::map<std::map<std::string, std::string>, Core> cores;
  auto evaluate = [&](const std::map<std::string, std::string>& point) {
    const auto key = core_of(point);
    auto it = cores.find(key);
    if (it == cores.end()) it = cores.emplace(key, evaluate_core(key)).first;
    const Core& core = it->second;
    Row row = core.row;
    row.point = point;
    if (row.found && tokens > 0) {
      const auto tt = plan::training_time(*core.spec, core.chosen, row.gpus, row.step_s, tokens,
                                          reliability_at(reliability, point));
      row.goodput = tt.goodput;
      row.job_mtbf_s = tt.job_mtbf_s;
      row.checkpoint_write_s = tt.checkpoint_write_s;
      row.checkpoint_blocking_s = tt.checkpoint_blocking_s;
      row.checkpoint_every_steps = tt.checkpoint_every_steps;
      row.checkpoint_async = tt.asynchronous;
    }
    return row;
  };

  // A GPU count that the one cluster of every point lacks is refused before any point's search
  // (as it would be after them all, below; a sweep of large models took seconds to say so).
  if (varied("gpus") && !varied("cluster")) {
    const cluster::Cluster c = cluster::load_cluster(default_cluster);
    std::set<std::string> checked;
    for (const auto& point : points) {
      const std::string& value = point.at("gpus");
      if (!checked.insert(value).second) continue;
      const auto gpus = static_cast<std::int64_t>(number("gpus", value, true));
      try {
        with_devices_for(c, gpus, fmt::format("--vary gpus={}", value));
      } catch (const InputError& e) {
        // More devices than the file has: --vary nodes grows a switched cluster.
        if (gpus <= c.devices() || !cluster::is_switched(c.inter.fabric)) throw;
        const std::int64_t nodes = (gpus + c.node_size() - 1) / c.node_size();
        throw InputError(fmt::format("{} (or --vary nodes={}: {} grown to {} nodes of {} devices)",
                                     e.what(), nodes, c.name, nodes, c.node_size()));
      }
    }
  }

  // Under mpirun every rank takes every size-th core (with its points, which share its
  // search); rank 0 gathers and prints.
  std::vector<std::size_t> core_index(points.size());
  {
    std::map<std::map<std::string, std::string>, std::size_t> seen;
    for (std::size_t i = 0; i < points.size(); ++i) {
      core_index[i] = seen.try_emplace(core_of(points[i]), seen.size()).first->second;
    }
  }
  std::vector<Row> rows(points.size());
  std::vector<std::string> mine;
  // A bar on a terminal for a sweep past a second (one process: ranks would draw over it).
  const auto bar = split.size() == 1 ? progress_bar(std::chrono::steady_clock::now(), "points")
                                     : std::function<void(std::uint64_t, std::uint64_t)>();
  for (std::size_t i = 0; i < points.size(); ++i) {
    if (bar) bar(i, points.size());
    if (static_cast<int>(core_index[i] % static_cast<std::size_t>(split.size())) != split.rank()) {
      continue;
    }
    try {
      rows[i] = evaluate(points[i]);
    } catch (const std::exception& e) {
      // Alone, the first bad point ends the run. Under mpirun the rank stops here and rank 0
      // reports the first bad point of all (the one a single process would have stopped at),
      // after the gather that every rank reaches.
      if (split.size() == 1) throw;
      mine.push_back(
          json_text(nlohmann::json{{"i", i}, {"error", e.what()}, {"kind", error_kind(e)}}));
      break;
    }
    nlohmann::json sent = {{"i", i}};
    row_fields(rows[i], [&](const char* key, const auto& value) {
      if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::optional<double>>) {
        sent[key] = report::value_or_null(value);
      } else {
        sent[key] = value;
      }
    });
    mine.push_back(json_text(sent));
  }
  if (bar) bar(points.size(), points.size());
  if (split.size() > 1) {
    const std::vector<std::string> all = split.gather(mine);
    // Rank 0 reports every rank's bad point and exits 2. Another rank that exited non-zero
    // here could have mpirun abort the job before rank 0 had printed why.
    if (split.rank() != 0) return 0;
    std::optional<nlohmann::json> first_error;
    for (const std::string& text : all) {
      const auto j = nlohmann::json::parse(text);
      if (j.contains("error")) {
        if (!first_error || j.at("i") < first_error->at("i")) first_error = j;
        continue;
      }
      Row& r = rows[j.at("i").get<std::size_t>()];
      r.point = points[j.at("i").get<std::size_t>()];
      row_fields(r, [&](const char* key, auto& value) {
        using T = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<T, std::optional<double>>) {
          value = j.at(key).is_null() ? std::nullopt : std::optional(j.at(key).get<double>());
        } else {
          value = j.at(key).get<T>();
        }
      });
    }
    if (first_error) {
      rethrow_error(first_error->at("kind").get<std::string>(),
                    first_error->at("error").get<std::string>());
    }
  }
  // No point valid (a fixed plan valid at none): nothing to compare (the first point's reason).
  if (!rows.empty() &&
      std::all_of(rows.begin(), rows.end(), [](const Row& r) { return !r.invalid.empty(); })) {
    throw InputError(rows.front().invalid);
  }
  // A GPU count that no point's cluster has is a mistake, not a point (the first such reason).
  if (varied("gpus")) {
    std::map<std::string, bool> anywhere;  // gpus value: some point's cluster has it
    for (const Row& r : rows) anywhere[r.point.at("gpus")] |= !r.gpus_missing;
    for (const Row& r : rows) {
      if (r.gpus_missing && !anywhere.at(r.point.at("gpus"))) throw InputError(r.invalid);
    }
  }
  // Scaling efficiency: tokens/s per GPU against the first point that has a plan that fits of the
  // same model (another model's tokens are other work: GPT-2's against Mixtral's read 39x), and
  // where gpus is an axis, of the same values on the other axes that move the step (a faster
  // network's gain is not the scaling's: 256 GPUs at 800 Gb/s against 256 at 400 read 100.5%).
  auto model_of = [&](const Row& r) {
    return r.point.count("model") ? r.point.at("model") : default_model;
  };
  // (A device count of one value scales nothing: its rows share one baseline, as without it.)
  const bool gpus_axis = std::any_of(axes.begin(), axes.end(), [](const Axis& a) {
    return (a.key == "gpus" || a.key == "nodes") && a.values.size() > 1;
  });
  std::vector<std::string> baseline_keys;  // the axes a baseline keeps besides the model
  for (const Axis& a : axes) {
    if (gpus_axis && a.key != "gpus" && a.key != "nodes" && a.key != "model" &&
        !is_reliability_key(a.key)) {
      baseline_keys.push_back(a.key);
    }
  }
  auto group_of = [&](const Row& r) {
    // ("llama3-8b with nic_gbps=400, device=h100-sxm": notes name a group so.)
    std::string group = model_of(r);
    for (std::size_t i = 0; i < baseline_keys.size(); ++i) {
      group += fmt::format("{} {}={}", i == 0 ? " with" : ",", baseline_keys[i],
                           r.point.at(baseline_keys[i]));
    }
    return group;
  };
  std::map<std::string, double> base;
  for (const Row& r : rows) {
    if (r.found && r.fits)
      base.try_emplace(group_of(r), r.tokens_per_s / static_cast<double>(r.gpus));
  }
  // None where no point of the group has a plan that fits.
  auto efficiency = [&](const Row& r) -> std::optional<double> {
    const auto it = base.find(group_of(r));
    if (it == base.end() || !r.found) return std::nullopt;
    return r.tokens_per_s / static_cast<double>(r.gpus) / it->second;
  };

  // (stderr, whatever the format: the rows are right, only the axis is idle at them.)
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.network_unused; })) {
    std::cerr << "note: at points whose devices fit in one node the inter-node network that "
                 "nic_gbps, latency_us and oversubscription set carries nothing: their rows do "
                 "not change with them\n";
  }
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.uplinks_unused; })) {
    std::cerr << "note: at points whose nodes all share one leaf switch (the cluster's "
                 "nodes_per_leaf, or none given) no traffic crosses the uplinks that "
                 "oversubscription slows: their rows do not change with it\n";
  }
  if (!dense_models.empty()) {
    std::cerr << fmt::format("note: expert_load leaves the rows of {} as they are: {} no experts\n",
                             fmt::join(dense_models, ", "),
                             dense_models.size() == 1 ? "it has" : "they have");
  }
  // Each line under the table once (a reason a point has no row, a cluster's note: points
  // that differ only in reliability figures, or share a cluster, share theirs).
  std::vector<std::string> said;
  auto first_saying = [&](const std::string& text) {
    if (std::find(said.begin(), said.end(), text) != said.end()) return false;
    said.push_back(text);
    return true;
  };
  std::vector<std::string> keys;
  for (const Axis& a : axes) keys.push_back(a.key);
  if (vm["json"].as<bool>()) {
    nlohmann::json out = nlohmann::json::array();
    for (const Row& r : rows) {
      // The point's values as the axes take them: names for device, cluster and model, numbers
      // for the others (checked as numbers when the point was run).
      nlohmann::json point = nlohmann::json::object();
      for (const auto& [key, value] : r.point) {
        if (key == "device" || key == "cluster" || key == "model" || key == "attention" ||
            value == "sync") {
          point[key] = value;
          continue;
        }
        const double x = std::stod(value);
        // Whole values below 2^53 (exact as doubles, as number() checks) as integers.
        if (x == std::floor(x) && std::abs(x) < 9007199254740992.0) {
          point[key] = static_cast<std::int64_t>(x);
        } else {
          point[key] = x;
        }
      }
      // The point's model and cluster as given (a --vary value, or the flag's or a
      // --fixed-plan's), whether or not they are axes: a row read alone says what it is of.
      nlohmann::json j = {
          {"point", point},
          {"model", model_of(r)},
          {"cluster", r.point.count("cluster") ? r.point.at("cluster") : default_cluster},
          {"gpus", r.gpus},
          {"found", r.found},
          {"profile", profile ? nlohmann::json{{"file", profile->file}, {"source", profile->source}}
                              : nlohmann::json()}};
      if (!r.profile_host.empty()) j["profile"]["note"] = r.profile_host;
      if (!r.found) j["valid_candidates"] = r.valid_candidates;
      if (!r.invalid.empty()) j["invalid_plan"] = r.invalid;
      if (r.found) {
        j["network"] = r.network;
        // plan_spec saved alone is a plan file (dtsim simulate --plan), with the model and
        // cluster it was made for, as plan --out writes them, and what the point changed in that
        // cluster, which its file does not have (said where the plan file is read).
        nlohmann::json spec = r.plan_spec;
        spec["model"] = data_reference("model", j["model"].get<std::string>());
        spec["cluster"] = data_reference("cluster", j["cluster"].get<std::string>());
        nlohmann::json changes = nlohmann::json::object();
        for (const char* key : {"device", "nic_gbps", "latency_us", "oversubscription"}) {
          if (point.contains(key)) changes[key] = point[key];
        }
        // A device file by its absolute path, as the model's and the cluster's.
        if (changes.contains("device")) {
          const std::string device = changes["device"].get<std::string>();
          if (names_a_path(device)) {
            changes["device"] = std::filesystem::absolute(device).lexically_normal().string();
          }
        }
        if (!r.grown.empty()) changes["nodes"] = point["nodes"];
        if (!changes.empty()) spec["cluster_changes"] = changes;
        if (r.network != "analytical") spec["network"] = r.network;
        // The straggler figures the point set, and the profile that timed it, which simulate
        // takes from the file.
        for (int i = 0; i < 2; ++i) {
          const char* key = i == 0 ? "jitter_cv" : "rank_spread_cv";
          if (point.contains(key)) {
            spec[key] = point[key];
          } else if (fixed_spread[static_cast<std::size_t>(i)]) {
            spec[key] = *fixed_spread[static_cast<std::size_t>(i)];  // (the --fixed-plan's)
          }
        }
        if (profile_file) spec["profile"] = std::filesystem::absolute(*profile_file).string();
        if (dropout_off_by(vm)) spec["no_dropout"] = true;
        j.update({{"plan", r.plan},
                  {"plan_spec", spec},
                  {"fits", r.fits},
                  {"step_time_s", r.step_s},
                  {"tokens_per_s", r.tokens_per_s},
                  {"mfu", r.mfu},
                  {"scaling_efficiency", efficiency(r) ? nlohmann::json(*efficiency(r)) : nullptr},
                  {"amdahl_max_speedup", r.max_speedup}});
        if (r.straggler_cost_s) j["straggler_cost_s"] = *r.straggler_cost_s;
        if (r.slow_rank_cost_s) j["slow_rank_cost_s"] = *r.slow_rank_cost_s;
        if (tokens > 0) {
          j["time_to_train_s"] = r.train_s;
          // Infinite (JSON null) when interruptions come faster than the job recovers.
          j["time_to_train_with_interruptions_s"] = report::value_or_null(
              r.goodput > 0 ? std::optional<double>(r.wall_s()) : std::nullopt);
          j["goodput"] = r.goodput;
          j["job_mtbf_s"] = r.job_mtbf_s;
          j["checkpoint_write_s"] = r.checkpoint_write_s;
          j["checkpoint_blocking_s"] = r.checkpoint_blocking_s;
          j["checkpoint_asynchronous"] = r.checkpoint_async;
          j["checkpoint_every_steps"] = r.checkpoint_every_steps;
          // The devices are paid for the wall time. Under plan's and simulate's names, and
          // the names whatif gave them first.
          if (r.cost_usd >= 0) {
            const auto interrupted = report::value_or_null(
                r.goodput > 0 ? std::optional<double>(r.cost_usd / r.goodput) : std::nullopt);
            j["cost_to_train_usd"] = r.cost_usd;
            j["cost_to_train_with_interruptions_usd"] = interrupted;
            j["cost_with_interruptions_usd"] = interrupted;
          }
        }
        if (r.cost_usd >= 0) j["cost_usd"] = r.cost_usd;
        if (r.price) {
          j["price_per_device_hour_usd"] = r.price->value;
          j["price_source"] = r.price->source;
        }
        if (r.energy_kwh >= 0) j["energy_kwh"] = r.energy_kwh;
        j["memory_per_gpu_bytes"] = report::byte_count(r.memory_bytes);
        j["capacity_bytes"] = report::byte_count(r.capacity_bytes);
      }
      out.push_back(j);
    }
    std::cout << json_text(out, 2) << "\n";
    return 0;
  }
  // Why a point has no plan, as the table's plan column says it (empty where it has one).
  auto no_plan_reason = [](const Row& r) -> std::string {
    if (r.found) return "";
    return !r.invalid.empty()   ? "invalid here"
           : r.valid_candidates ? "no plan fits"
                                : "no valid plan";
  };
  if (vm["csv"].as<bool>()) {
    // (Why a fixed plan's row is empty: on stderr, as plan --csv says why nothing fits.)
    for (const Row& r : rows) {
      if (!r.invalid.empty() && first_saying(r.invalid)) {
        std::cerr << fmt::format("invalid here: {}\n", r.invalid);
      }
    }
    std::cout << fmt::format(
        "{},devices,plan,step_time_s,tokens_per_s,mfu,scaling_efficiency,"
        "amdahl_max_speedup,time_to_train_days,cost_usd,energy_mwh,fits,goodput,"
        "time_to_train_with_interruptions_days,checkpoint_every_steps,straggler_cost_s,"
        "cost_with_interruptions_usd,memory_per_gpu_bytes,capacity_bytes,slow_rank_cost_s,"
        "no_plan_reason\n",
        fmt::join(keys, ","));
    for (const Row& r : rows) {
      std::vector<std::string> vals;
      for (const auto& k : keys) vals.push_back(csv_field(r.point.at(k)));
      // Figures in full (the shortest text that reads back as the same double); a point without
      // a plan (none valid, none fits) leaves them empty, as the table's "-" and the JSON's
      // "found": false. Time and cost to train are failure-free, and again with interruptions.
      auto figure = [&](bool known, double v) {
        return r.found && known ? fmt::format("{}", v) : std::string();
      };
      const bool trained = tokens > 0, priced = r.cost_usd >= 0, reached = r.goodput > 0;
      std::cout << fmt::format(
          "{},{},\"{}\",{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
          fmt::join(vals, ","), r.gpus, r.plan, figure(true, r.step_s),
          figure(true, r.tokens_per_s), figure(true, r.mfu),
          figure(efficiency(r).has_value(), efficiency(r).value_or(0)), figure(true, r.max_speedup),
          figure(trained, r.train_s / 86400), figure(priced, r.cost_usd),
          figure(r.energy_kwh >= 0, r.energy_kwh / 1000), r.found ? (r.fits ? "1" : "0") : "",
          figure(trained, r.goodput), figure(trained && reached, r.wall_s() / 86400),
          trained && r.found ? fmt::format("{}", r.checkpoint_every_steps) : "",
          figure(r.straggler_cost_s.has_value(), r.straggler_cost_s.value_or(0)),
          figure(priced && reached, r.cost_usd / r.goodput), figure(true, r.memory_bytes),
          figure(true, r.capacity_bytes),
          figure(r.slow_rank_cost_s.has_value(), r.slow_rank_cost_s.value_or(0)),
          no_plan_reason(r));
    }
    return 0;
  }
  // The stragglers' column where the straggler model is on at some point.
  const bool stragglers = std::any_of(rows.begin(), rows.end(),
                                      [](const Row& r) { return r.straggler_cost_s.has_value(); });
  const bool slow_ranks = std::any_of(rows.begin(), rows.end(),
                                      [](const Row& r) { return r.slow_rank_cost_s.has_value(); });
  // The devices of each point, unless they are an axis already (--vary gpus).
  const bool gpus_column = std::find(keys.begin(), keys.end(), "gpus") == keys.end();
  std::vector<std::string> headers = keys;
  if (gpus_column) headers.push_back("GPUs");
  headers.push_back(vm.count("fixed-plan") ? "plan" : "best plan");
  // Per-GPU throughput against the first point: a scaling efficiency where the points' devices
  // differ; where they do not (a faster network, another sequence length) only a ratio, which
  // may well exceed 100%.
  // (Rows without a plan left out: their counts were never run.)
  std::vector<std::int64_t> run_counts;
  for (const Row& r : rows) {
    if (r.invalid.empty()) run_counts.push_back(r.gpus);
  }
  const bool devices_vary = std::any_of(run_counts.begin(), run_counts.end(),
                                        [&](std::int64_t g) { return g != run_counts.front(); });
  const char* ratio = devices_vary ? "scaling" : "per GPU";
  for (const char* h : {"step", "tokens/s", "MFU", ratio, "Amdahl"}) headers.push_back(h);
  if (stragglers) headers.push_back("stragglers");
  if (slow_ranks) headers.push_back("slow rank");
  for (const char* h : {"goodput", "train", "cost", "energy"}) headers.push_back(h);
  report::Table table(headers);
  std::vector<std::string> units(keys.size() + (gpus_column ? 1 : 0), "");
  for (const char* u : {"", "s", "", "", "vs first", "bound"}) units.push_back(u);
  if (stragglers) units.push_back("of step");
  // (The slow rank's share is of the step without jitter, as simulate gives it: said so where
  // the stragglers' column, of the whole step, stands beside it.)
  if (slow_ranks) units.push_back(stragglers ? "of step w/o jitter" : "of step");
  for (const char* u : {"", "", "USD", ""}) units.push_back(u);
  table.set_units(units);
  table.align_left(keys.size() + (gpus_column ? 1 : 0));
  for (const Row& r : rows) {
    std::vector<std::string> cells;
    for (const auto& k : keys) cells.push_back(r.point.at(k));
    if (gpus_column) cells.push_back(fmt::format("{}", r.gpus));
    if (!r.found) {
      cells.push_back(r.invalid.empty() ? no_plan_reason(r) : "invalid here (below)");
      cells.resize(headers.size(), "-");  // the rest of the row
    } else {
      cells.push_back(r.fits ? r.plan
                             : fmt::format("{} (DOES NOT FIT: needs {:.1f} GiB of {:.1f} GiB)",
                                           r.plan, r.memory_bytes / kGiB, r.capacity_bytes / kGiB));
      cells.push_back(format_seconds(r.step_s));
      cells.push_back(format_rate(r.tokens_per_s));
      cells.push_back(format_percent(r.mfu));
      cells.push_back(efficiency(r) ? fmt::format("{:.1f}%", 100 * *efficiency(r)) : "-");
      cells.push_back(r.max_speedup > 0 ? fmt::format("{:.1f}x", r.max_speedup) : "-");
      if (stragglers) {
        cells.push_back(r.straggler_cost_s
                            ? fmt::format("{:+.1f}%", 100 * *r.straggler_cost_s / r.step_s)
                            : "-");
      }
      if (slow_ranks) {
        // (Of the step without jitter, against which simulate gives it.)
        const double calm = r.step_s - r.straggler_cost_s.value_or(0.0);
        cells.push_back(
            r.slow_rank_cost_s ? fmt::format("{:+.1f}%", 100 * *r.slow_rank_cost_s / calm) : "-");
      }
      cells.push_back(tokens > 0 ? fmt::format("{:.1f}%", 100 * r.goodput) : "-");
      cells.push_back(tokens <= 0 ? "-" : r.goodput <= 0 ? "never" : span_text(r.wall_s()));
      cells.push_back(r.cost_usd < 0   ? "-"
                      : r.goodput <= 0 ? "never"
                                       : format_rate(r.cost_usd / r.goodput));
      // (Three significant digits under 100: a short run's energy and cost do not read 0.)
      cells.push_back(r.energy_kwh < 0       ? "-"
                      : r.energy_kwh >= 1000 ? fmt::format("{:.1f} MWh", r.energy_kwh / 1000)
                                             : format_rate(r.energy_kwh) + " kWh");
    }
    table.add_row(cells);
  }
  std::cout << table.render();
  // Where "vs first" is not simply the first row: a group whose first point has no plan that
  // fits, or several groups.
  std::map<std::string, bool> first_fits;
  for (const Row& r : rows) {
    if (r.invalid.empty()) first_fits.try_emplace(group_of(r), r.found && r.fits);
  }
  std::vector<std::string> none_fit;
  for (const auto& [group, fits] : first_fits) {
    if (!base.count(group)) none_fit.push_back(group);
  }
  if (none_fit.size() < first_fits.size() &&
      (first_fits.size() > 1 || std::any_of(first_fits.begin(), first_fits.end(),
                                            [](const auto& f) { return !f.second; }))) {
    std::vector<std::string> same = {"model"};
    same.insert(same.end(), baseline_keys.begin(), baseline_keys.end());
    std::string same_text = same.back();
    if (same.size() > 1) {
      same.pop_back();
      same_text = fmt::format("{} and {}", fmt::join(same, ", "), same_text);
    }
    std::cout << fmt::format(
        "({}: tokens/s per GPU against the first point of the same {} whose plan fits)\n", ratio,
        same_text);
  }
  if (!none_fit.empty()) {
    std::cout << fmt::format("({}: no point of {} has a plan that fits: no figure)\n", ratio,
                             fmt::join(none_fit, ", "));
  }
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) {
        return !r.found && !r.valid_candidates && r.invalid.empty();
      })) {
    std::cout << "(no valid plan: no tp x pp x cp x dp makes the point's GPUs with dp x "
                 "micro-batch dividing the global batch in at most 2^24 micro-batches; dtsim "
                 "plan at that point names the constraints)\n";
  }
  for (const Row& r : rows) {
    if (!r.invalid.empty() && first_saying(r.invalid)) {
      std::cout << fmt::format("(invalid here: {})\n", r.invalid);
    }
  }
  if (stragglers) {
    std::cout << "(stragglers: what the straggler model adds to the step, against the same plan "
                 "without compute jitter; dtsim simulate --jitter-cv breaks it down)\n";
  }
  if (slow_ranks) {
    std::cout << "(slow rank: what the slowest rank adds to the step without jitter, against "
                 "every rank at one speed; dtsim simulate --rank-spread-cv says which rank)\n";
  }
  if (on_simgrid) {
    std::cout << "(network: SimGrid; each point's plan flow-simulated, the search's ranking by "
                 "the analytical model)\n";
  }
  if (tokens <= 0) std::cout << "(give --tokens N for time, cost and energy to train)\n";
  if (tokens > 0) {
    // What the energy counts, and a point without a power figure said (as one without a price).
    std::cout << "(energy: the devices at their rated power over the failure-free time; hosts, "
                 "network and cooling (PUE) not counted)\n";
    if (std::any_of(rows.begin(), rows.end(),
                    [](const Row& r) { return r.found && r.energy_kwh < 0; })) {
      std::cout << "(energy -: the point's device and cluster give no power_per_device_w / "
                   "power_w)\n";
    }
  }
  if (vm.count("fixed-plan")) {
    std::cout << "(--fixed-plan: its tp, pp, cp, ep and the rest at every point; dp fills each "
                 "point's devices: its own dp x tp x pp x cp unless --gpus or --vary gpus give "
                 "others, or the cluster has fewer)\n";
  }
  if (tokens > 0 &&
      std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.priceless; })) {
    std::cout << "(cost: the cluster's price is its own device's; points with another device "
                 "have none)\n";
  }
  {
    // Each grown cluster once, with the node counts it was grown to.
    std::vector<std::pair<std::string, std::vector<std::string>>> grown;
    for (const Row& r : rows) {
      if (r.grown.empty()) continue;
      auto it = std::find_if(grown.begin(), grown.end(),
                             [&](const auto& g) { return g.first == r.grown; });
      if (it == grown.end()) it = grown.insert(grown.end(), {r.grown, {}});
      const std::string& nodes = r.point.at("nodes");
      if (std::find(it->second.begin(), it->second.end(), nodes) == it->second.end()) {
        it->second.push_back(nodes);
      }
    }
    for (const auto& [cluster, nodes] : grown) {
      // (Grown: more nodes than the file's, at least 2.)
      std::cout << fmt::format(
          "(nodes: {}; {} nodes are more of its nodes in more leaves of its size and "
          "oversubscription: a hypothetical cluster)\n",
          cluster, fmt::join(nodes, ", "));
    }
  }
  for (const Row& r : rows) {
    const std::string line = fmt::format("(device: {})", r.own_efficiency);
    if (!r.own_efficiency.empty() && first_saying(line)) std::cout << line << "\n";
  }
  for (const Row& r : rows) {
    if (tokens > 0 && !r.unpriced.empty() && first_saying(unpriced_note(r.unpriced))) {
      std::cout << unpriced_note(r.unpriced) << "\n";
    }
  }
  if (profile) {
    for (const std::string& n : profile_notes(*profile)) std::cout << "(" << n << ")\n";
    for (const Row& r : rows) {
      if (!r.profile_host.empty() && first_saying(r.profile_host)) {
        std::cout << "(" << r.profile_host << ")\n";
      }
    }
  }
  if (std::any_of(rows.begin(), rows.end(), [](const Row& r) { return r.catalog_efficiency; })) {
    std::cout << "(device: the cluster's device_efficiency is its own device's; points with "
                 "another device take that device's catalog efficiencies)\n";
  }
  if (tokens > 0) {
    std::cout << interruptions_note(reliability) << "\n";
    if (!reliability_axes.empty()) {
      std::cout << fmt::format("({} varied: each row at its own; the note above has the rest)\n",
                               fmt::join(reliability_axes, ", "));
    }
  }
  return 0;
}

}  // namespace dtsim::cli
