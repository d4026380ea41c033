// dtsim list: the models, clusters and devices shipped with dtsim.
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/cluster/device_catalog.hpp"
#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"

namespace dtsim::cli {

int cmd_list(const std::vector<std::string>& args) {
  po::options_description desc("dtsim list options");
  desc.add_options()("help,h", "show this help")(
      "what", po::value<std::string>()->default_value("all"), "models, clusters, devices or all")(
      "json", po::bool_switch(),
      "print JSON: {\"clusters\": [...], \"devices\": [...], \"models\": [...]}");
  po::positional_options_description pos;
  pos.add("what", 1);
  po::variables_map vm;
  store_options(args, desc, vm, &pos);
  if (vm.count("help")) {
    std::cout << "usage: dtsim list [models|clusters|devices|all] [--json]\n\n" << desc;
    return 0;
  }
  const std::string what = vm["what"].as<std::string>();
  if (what != "all" && what != "models" && what != "clusters" && what != "devices") {
    throw InputError(fmt::format("expected models, clusters, devices or all, got \"{}\"", what));
  }
  const bool json_out = vm["json"].as<bool>();
  nlohmann::json out = nlohmann::json::object();
  auto show = [&](const char* title, const std::vector<std::string>& names) {
    if (json_out) {
      out[title] = names;
    } else {
      std::cout << fmt::format("{}: {}\n", title, fmt::join(names, " "));
    }
  };
  if (what == "all" || what == "models") show("models", list_data_names("models"));
  if (what == "all" || what == "clusters") show("clusters", list_data_names("topologies"));
  if (what == "all" || what == "devices") show("devices", cluster::list_devices());
  if (json_out) std::cout << out.dump(2) << "\n";
  return 0;
}

}  // namespace dtsim::cli
