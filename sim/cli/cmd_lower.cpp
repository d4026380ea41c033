// dtsim lower: the Program a plan lowers to, for people to read.
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::cli {

int cmd_lower(const std::vector<std::string>& args) {
  po::options_description desc("dtsim lower options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/true);
  add_plan_options(desc);
  desc.add_options()("all-ranks", po::bool_switch(),
                     "one program per rank (default: one per pipeline stage, standing for its "
                     "ranks)")("json", po::bool_switch(), "print JSON (the only format today)");
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtsim lower --model M --cluster C [plan flags | --plan P.json] [--json]\n\n"
             "Prints the Program the plan lowers to: per rank, the ordered tasks on its streams "
             "(compute, tp/cp/ep/dp/pp communication) with their dependencies.",
             vm)) {
    return 0;
  }
  const PlanSetup setup = setup_from_options(vm);
  require_symmetric_placement(setup.plan, setup.cluster);
  lower::LowerOptions options;
  if (vm["all-ranks"].as<bool>()) options.mode = lower::Lowering::AllRanks;
  const lower::Program program = lower::lower(setup.graph, setup.plan, options);
  nlohmann::json out = lower::to_json(program);
  out["plan"] = plan::to_json(setup.plan);
  out["model"] = setup.spec.name;
  std::cout << out.dump(2) << "\n";
  return 0;
}

}  // namespace dtsim::cli
