// dtsim export-platform: the SimGrid platform (XML) that --network simgrid simulates.
#include <fmt/format.h>

#include <fstream>
#include <iostream>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/network/platform.hpp"

namespace dtsim::cli {

int cmd_export_platform(const std::vector<std::string>& args) {
  po::options_description desc("dtsim export-platform options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/true, "--plan");
  add_plan_options(desc);
  desc.add_options()("out", po::value<std::string>(), "write the XML here (default: stdout)")(
      "all-pairs", po::bool_switch(),
      "routes between every pair of devices (clusters of at most 256 devices) instead of the "
      "pairs the plan uses");
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtsim export-platform --cluster C [--model M plan flags] [--all-pairs] "
             "[--out P.xml]\n\n"
             "Writes the cluster as a SimGrid 3.32 platform: devices as hosts, one link per "
             "direction for each device port, NIC and leaf uplink, and routes between the "
             "device pairs that the plan's groups use (or all pairs).",
             vm)) {
    return 0;
  }
  // (A folder, a missing one, a file it reads: said as the other commands say, before the work.)
  if (vm.count("out")) check_writable(vm["out"].as<std::string>(), "--out", &vm);
  const cluster::Cluster cluster = cluster_from_options(vm);
  std::set<std::pair<std::int64_t, std::int64_t>> pairs;
  if (vm["all-pairs"].as<bool>()) {
    if (cluster.devices() > 256) {
      throw InputError(
          fmt::format("--all-pairs: cluster {} has {} devices; at most 256 (give a "
                      "plan instead, whose pairs are exported)",
                      cluster.name, cluster.devices()));
    }
    pairs = network::all_pairs(cluster.devices());
  } else {
    const model::ModelSpec spec = model_from_options(vm);
    std::vector<std::string> notes;
    const plan::Plan plan = plan_from_options(vm, spec, cluster.devices(), notes);
    pairs = network::plan_pairs(plan, cluster);
  }
  const std::string xml = network::platform_xml(network::build_platform(cluster, pairs));
  if (vm.count("out")) {
    const std::string path = vm["out"].as<std::string>();
    std::ofstream out(path);
    if (!out || !(out << xml << std::flush))
      throw InputError(fmt::format("--out {}: cannot write", path));
    std::cout << fmt::format("SimGrid platform of {} ({} devices) written to {}\n", cluster.name,
                             cluster.devices(), path);
  } else {
    std::cout << xml;
  }
  return 0;
}

}  // namespace dtsim::cli
