// dtsim memory: memory per rank of a plan, per pipeline stage, and whether it fits.
#include <fmt/format.h>

#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/common/units.hpp"
#include "sim/plan/memory_model.hpp"
#include "sim/report/json_values.hpp"
#include "sim/report/table.hpp"

namespace dtsim::cli {

namespace {

using nlohmann::json;

json stage_json(const plan::StageMemory& s) {
  return {{"stage", s.stage},
          {"layers", s.layers},
          {"in_flight_micro_batches", s.in_flight},
          {"weight_passes_held", s.weight_passes_held},
          {"weight_versions", s.weight_versions},
          {"weights_bytes", report::byte_count(s.weights_bytes)},
          {"gradients_bytes", report::byte_count(s.gradients_bytes)},
          {"optimizer_bytes", report::byte_count(s.optimizer_bytes)},
          {"activations_bytes", report::byte_count(s.activations_bytes)},
          {"working_bytes", report::byte_count(s.working_bytes)},
          {"working_tensors", s.working_tensors},
          {"peak_moment", s.peak_moment},
          {"other_bytes", report::byte_count(s.other_bytes)},
          {"total_bytes", report::byte_count(s.total_bytes)},
          {"dominant", s.dominant}};
}

// The table's unit: MiB where the worst rank needs under a GiB (a CPU rank's model).
double table_unit(double worst_bytes) {
  return worst_bytes < kGiB ? kMiB : kGiB;
}

}  // namespace

int cmd_memory(const std::vector<std::string>& args) {
  po::options_description desc("dtsim memory options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/true, "--plan");
  add_plan_options(desc);
  po::options_description mem("Memory model");
  add_memory_options(mem);
  mem.add_options()("json", po::bool_switch(), "print JSON instead of tables");
  desc.add(mem);
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtsim memory --model M --cluster C [plan flags | --plan P.json] [--json]\n\n"
             "Peak memory per rank of a plan: weights, gradients, optimizer states (ZeRO 0-3), "
             "activations (Korthikanti et al. 2022) for the micro-batches the schedule keeps in "
             "flight, and other buffers; per pipeline stage, with the worst rank against the "
             "device's capacity.",
             vm)) {
    return 0;
  }
  PlanSetup setup = setup_from_options(vm);
  const model::ModelSpec& spec = setup.spec;
  const cluster::Cluster& cluster = setup.cluster;
  const plan::Plan& plan = setup.plan;
  const model::ModelGraph& graph = setup.graph;
  std::vector<std::string>& notes = setup.notes;
  const plan::MemoryOptions options = memory_options_from(vm);
  const plan::MemoryReport report = plan::estimate_memory(graph, plan, cluster, options);
  for (const auto& n : report.notes) notes.push_back(n);
  const plan::StageMemory& worst = report.worst();

  if (vm["json"].as<bool>()) {
    json out = stage_json(worst);
    out["worst_stage"] = report.worst_stage;
    out["capacity_bytes"] = report::byte_count(report.capacity_bytes);
    out["fits"] = report.fits;
    out["margin_bytes"] = report::byte_count(report.margin_bytes);
    json stages = json::array();
    for (const auto& s : report.stages) {
      json stage = stage_json(s);
      stage["capacity_bytes"] = report::byte_count(report.capacity_bytes);
      stage["fits"] = s.total_bytes <= report.capacity_bytes;
      stage["margin_bytes"] = report::byte_count(report.capacity_bytes - s.total_bytes);
      stages.push_back(std::move(stage));
    }
    out["per_stage"] = stages;
    out["plan"] = plan::to_json(plan);
    out["model"] = spec.name;
    out["cluster"] = cluster.name;
    out["gpus"] = cluster.devices();
    out["notes"] = notes;
    std::cout << json_text(out, 2) << "\n";
    return 0;
  }

  std::cout << fmt::format("memory per rank: {} on {} ({} x {}), plan {}\n\n", spec.name,
                           cluster.name, cluster.devices(), cluster.device.display_name,
                           plan::summary(plan));
  report::Table table({"stage", "layers", "in flight", "weights", "gradients", "optimizer",
                       "activations", "other", "total", "dominant"});
  // Interleaving keeps model chunks in flight, each 1/v of the rank's blocks for one micro-batch.
  const bool chunks = plan.schedule == plan::Schedule::Interleaved && plan.virtual_stages > 1;
  const std::string in_flight_unit =
      chunks ? fmt::format("chunks (1/{})", plan.virtual_stages) : "micro-batches";
  const double unit = table_unit(worst.total_bytes);
  const std::string u = unit == kGiB ? "GiB" : "MiB";
  table.set_units({"", "", in_flight_unit, u, u, u, u, u, u, ""});
  table.align_left(9);
  auto gib = [&](double bytes) {
    return fmt::format("{:.{}f}", bytes / unit, unit == kGiB ? 2 : 1);
  };
  for (const auto& s : report.stages) {
    table.add_row({fmt::format("{}", s.stage), fmt::format("{}", s.layers),
                   fmt::format("{}", s.in_flight), gib(s.weights_bytes), gib(s.gradients_bytes),
                   gib(s.optimizer_bytes), gib(s.activations_bytes), gib(s.other_bytes),
                   gib(s.total_bytes), s.dominant});
  }
  std::cout << table.render() << "\n";
  if (report.fits) {
    std::cout << fmt::format(
        "fits: worst rank (stage {}) needs {} of {}; margin {} (dominant: "
        "{})\n",
        report.worst_stage, format_gib(worst.total_bytes), format_gib(report.capacity_bytes),
        format_gib(report.margin_bytes), worst.dominant);
  } else {
    std::cout << fmt::format(
        "DOES NOT FIT: worst rank (stage {}) needs {} of {}, {} too much "
        "(dominant: {})\n",
        report.worst_stage, format_gib(worst.total_bytes), format_gib(report.capacity_bytes),
        format_gib(-report.margin_bytes), worst.dominant);
  }
  for (const auto& n : notes) std::cout << report::note_line(n) << "\n";
  return 0;
}

}  // namespace dtsim::cli
