// dtexec compare A B: two checkpoints of the same model, step by step and tensor by tensor.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <iostream>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "exec/cli/commands.hpp"
#include "exec/core/checkpoint.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"

namespace dtsim::exec::cli {

int compare(const std::vector<std::string>& args) {
  po::options_description desc("dtexec compare options");
  desc.add_options()("help,h", "show this help")(
      "loss-tolerance", po::value<double>()->default_value(1e-5, "1e-5"),
      "largest accepted absolute difference of a step's loss")(
      "weight-tolerance", po::value<double>()->default_value(1e-3),
      "largest accepted absolute difference of a weight");
  // A B: the option behind the positional words, left out of --help.
  po::options_description all;
  all.add(desc).add_options()("checkpoints", po::value<std::vector<std::string>>(),
                              "the two checkpoint folders");
  po::positional_options_description positional;
  positional.add("checkpoints", 2);
  po::variables_map vm;
  dtsim::cli::store_options(args, all, vm, &positional);
  if (vm.count("help")) {
    std::cout << "usage: dtexec compare A B [--loss-tolerance X] [--weight-tolerance Y]\n\n"
                 "Compares two checkpoints of the same model, step by step and tensor by tensor;\n"
                 "exit code 1 when they differ by more than the tolerances. fp32 sums in another\n"
                 "order differ by ~1e-7, and AdamW can move an element whose gradient is ~0 by\n"
                 "up to the learning rate: compare weights at a fraction of it.\n\n"
              << desc;
    return 0;
  }
  if (!vm.count("checkpoints") || vm["checkpoints"].as<std::vector<std::string>>().size() != 2) {
    throw dtsim::InputError("give two checkpoint folders: dtexec compare A B");
  }
  const double loss_tolerance = vm["loss-tolerance"].as<double>();
  const double weight_tolerance = vm["weight-tolerance"].as<double>();
  for (auto [name, value] : {std::pair{"--loss-tolerance", loss_tolerance},
                             std::pair{"--weight-tolerance", weight_tolerance}}) {
    if (!(value >= 0 && std::isfinite(value))) {
      throw dtsim::InputError(
          fmt::format("{}: expected a finite number >= 0, got {}", name, value));
    }
  }
  const auto& dirs = vm["checkpoints"].as<std::vector<std::string>>();
  const dtsim::exec::CheckpointReader a(dirs[0]), b(dirs[1]);
  // Another model's tensors would list as mismatches one by one, under "DIFFERENT".
  if (a.info().model != b.info().model) {
    throw dtsim::InputError(
        fmt::format("{} and {}: checkpoints of different models ({} against {}); compare two "
                    "checkpoints of one model",
                    dirs[0], dirs[1], a.info().model, b.info().model));
  }
  // Nor one edited under its name (its top_k, rope_theta or norm changed), where both recorded
  // their architecture.
  if (const auto differ =
          dtsim::exec::architecture_differences(a.info().architecture, b.info().architecture);
      !differ.empty()) {
    throw dtsim::InputError(fmt::format(
        "{} and {}: checkpoints of two models named {}: {} (the first's against the second's); "
        "compare two checkpoints of one model",
        dirs[0], dirs[1], a.info().model, fmt::join(differ, "; ")));
  }
  // Nor one changed under its name (positions, biases or norms dropped): as resuming says it.
  const auto names_a = a.names(), names_b = b.names();
  const std::set<std::string> in_a(names_a.begin(), names_a.end()),
      in_b(names_b.begin(), names_b.end());
  for (const auto& [one, other, dir] :
       {std::tuple{&in_a, &in_b, dirs[0]}, std::tuple{&in_b, &in_a, dirs[1]}}) {
    for (const std::string& name : *one) {
      if (other->count(name) == 0) {
        throw dtsim::InputError(fmt::format(
            "{} and {}: both of model {}, but only {} holds tensor {} (a model changed under "
            "its name?); compare two checkpoints of one model",
            dirs[0], dirs[1], a.info().model, dir, name));
      }
    }
  }
  const auto d = dtsim::exec::compare_checkpoints(a, b);
  for (const auto& p : d.problems) std::cout << "mismatch: " << p << "\n";
  std::cout << fmt::format(
      "{} steps: largest loss difference {:.3g}; largest weight difference {:.3g}{}\n",
      d.steps_compared, d.max_loss_diff, d.max_weight_diff,
      d.worst_tensor.empty() ? "" : " (" + d.worst_tensor + ")");
  const bool same = d.problems.empty() && d.max_loss_diff <= loss_tolerance &&
                    d.max_weight_diff <= weight_tolerance;
  std::cout << fmt::format("{} (tolerances: losses {:g}, weights {:g})\n",
                           same ? "equal" : "DIFFERENT", loss_tolerance, weight_tolerance);
  return same ? 0 : 1;
}

}  // namespace dtsim::exec::cli
