// dtsim lower: the Program a plan lowers to, for people to read.
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::cli {

namespace {
// Output beyond which --all-ranks says how large it is (a 64-rank plan of a small model stays
// under it).
constexpr std::size_t kLargeOutputBytes = 64ULL << 20;
}  // namespace

int cmd_lower(const std::vector<std::string>& args) {
  po::options_description desc("dtsim lower options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/true, "--plan");
  add_plan_options(desc);
  desc.add_options()("all-ranks", po::bool_switch(),
                     "one program per rank (default: one per pipeline stage, standing for its "
                     "ranks)")("json", po::bool_switch(), "print JSON (the only format today)");
  po::variables_map vm;
  if (!parse(
          args, desc,
          "usage: dtsim lower --model M --cluster C [plan flags | --plan P.json] [--gpus N]\n"
          "                   [--all-ranks] [--json]\n\n"
          "Prints the Program the plan lowers to, as JSON: per rank, the ordered tasks on its "
          "streams (compute, tp/cp/ep/dp/pp communication) with their dependencies; by default "
          "one program per pipeline stage, standing for the ranks in its \"represented_ranks\". A "
          "compute task's \"ops\" is a half-open range [begin, end) of the model graph's ops "
          "(dtsim describe's per-layer table); a transfer's \"tag\" pairs a send with its "
          "receive; \"chunk\" is the interleaved schedule's model chunk; bytes are per rank. "
          "The README's dtsim lower section lists every field.",
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
  out["notes"] = setup.notes;  // what was derived or defaulted (dp, precision, padding)
  const std::string text = json_text(out, 2);
  std::cout << text << "\n";
  // Every rank's program of a large plan is large: say so where a person sees it.
  if (options.mode == lower::Lowering::AllRanks && program.ranks.size() > 1 &&
      text.size() > kLargeOutputBytes) {
    std::cerr << fmt::format(
        "note: {} programs, {} tasks, {:.0f} MB of JSON; without --all-ranks one program per "
        "pipeline stage stands for its ranks ({} programs)\n",
        program.ranks.size(), program.task_count(), static_cast<double>(text.size()) / 1e6,
        setup.plan.pp);
  }
  return 0;
}

}  // namespace dtsim::cli
