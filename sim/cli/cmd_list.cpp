// dtsim list: the models, clusters and devices shipped with dtsim, each with the figures that
// tell them apart (a model's size and shape, a cluster's devices and network, a device's peak).
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/cluster/device_catalog.hpp"
#include "sim/cluster/topology.hpp"
#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"
#include "sim/common/units.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/report/json_values.hpp"
#include "sim/report/table.hpp"

namespace dtsim::cli {

namespace {

// The files that did not load, said after the tables (exit 2): one broken file of a user's does
// not hide the others.
std::vector<std::string> g_unreadable;

// A row for a file that did not load: its name, "does not load", and dashes.
std::vector<std::string> unreadable_row(const std::string& name, std::size_t columns,
                                        const std::exception& e) {
  g_unreadable.push_back(e.what());
  std::vector<std::string> row(columns, "-");
  row[0] = name;
  row[1] = "(does not load: below)";
  return row;
}

// A count in the largest unit it fills: 8.03B, 124M.
std::string count_text(double n) {
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.0f}M", n / 1e6);
  return fmt::format("{:.0f}", n);
}

// Three significant figures, or the whole number from 100 up (2250, not 2.25e+03).
std::string figure_text(double x) {
  return x >= 100 ? fmt::format("{:.0f}", x) : fmt::format("{:.3g}", x);
}

// A device's dense peak at the precision it trains in by default (bf16; fp16 or fp32 where it
// has no bf16), FLOP/s, and that precision's name.
std::pair<double, Precision> headline_peak(const cluster::DeviceSpec& d) {
  const Precision p = default_precision(d);
  return {d.peak_flops_for(p), p};
}

void list_models(nlohmann::json* out) {
  report::Table t({"model", "params", "layers", "hidden", "heads", "kv heads", "ffn", "vocab",
                   "seq", "experts"});
  t.align_left(0);
  for (const auto& name : list_data_names("models")) {
    model::ModelSpec spec;
    try {
      spec = model::load_model(name);
    } catch (const InputError& e) {
      t.add_row(unreadable_row(name, 10, e));
      continue;
    }
    const double params = static_cast<double>(model::ModelGraph(spec, 1, 1).totals().params);
    // (And the shared experts' width beside them, and the dense blocks among theirs, where
    // there are some.)
    const std::string experts =
        spec.moe
            ? fmt::format(
                  "{} (top {}){}{}", spec.moe->experts, spec.moe->top_k,
                  spec.shared_ffn() > 0 ? fmt::format(" + shared {}", spec.shared_ffn()) : "",
                  spec.mixed_blocks() ? fmt::format(" in {} blocks", spec.expert_blocks()) : "")
            : "-";
    t.add_row({name, count_text(params), fmt::format("{}", spec.layers),
               fmt::format("{}", spec.hidden), fmt::format("{}", spec.heads),
               fmt::format("{}", spec.kv_heads), fmt::format("{}", spec.ffn_hidden),
               fmt::format("{}", spec.vocab), fmt::format("{}", spec.seq_len), experts});
    if (out) {
      nlohmann::json j = {{"name", name},
                          {"params", report::byte_count(params)},
                          {"layers", spec.layers},
                          {"hidden", spec.hidden},
                          {"heads", spec.heads},
                          {"kv_heads", spec.kv_heads},
                          {"ffn_hidden", spec.ffn_hidden},
                          {"vocab", spec.vocab},
                          {"seq_len", spec.seq_len}};
      if (spec.moe) j["experts"] = spec.moe->experts;
      if (spec.shared_ffn() > 0) j["shared_ffn_hidden"] = spec.shared_ffn();
      if (spec.mixed_blocks()) {
        j["expert_blocks"] = spec.expert_blocks();
        j["dense_ffn_hidden"] = spec.moe->dense_ffn_hidden;
      }
      (*out)["models"].push_back(j);
    }
  }
  if (!out) std::cout << "models\n" << t.render();
}

void list_clusters(nlohmann::json* out) {
  report::Table t(
      {"cluster", "device", "devices", "nodes", "scale-up", "network", "NIC", "oversub", "price"});
  t.set_units({"", "", "", "x per node", "GB/s per GPU", "", "Gb/s per GPU", "", "USD/GPU-h"});
  t.align_left(0);
  t.align_left(1);
  t.align_left(5);
  for (const auto& name : list_data_names("topologies")) {
    cluster::Cluster c;
    try {
      c = cluster::load_cluster(name);
    } catch (const InputError& e) {
      t.add_row(unreadable_row(name, 9, e));
      continue;
    }
    const bool inter = c.inter.fabric != cluster::InterFabric::None;
    // The NIC bandwidth one device has: the node's NICs shared by its devices.
    const double nic_gbps = inter && c.devices_per_node > 0
                                ? c.inter.nic_bw_bytes_per_s.value * 8 / 1e9 *
                                      static_cast<double>(c.inter.nics_per_node) /
                                      static_cast<double>(c.node_size())
                                : 0.0;
    const std::string network =
        inter ? fmt::format("{} {}", to_string(c.inter.fabric), to_string(c.inter.transport)) : "-";
    t.add_row(
        {name, c.device.name, fmt::format("{}", c.devices()),
         fmt::format("{} x {}", c.nodes, c.devices_per_node),
         figure_text(c.intra.bw_bytes_per_s.value / 1e9), network,
         inter && nic_gbps > 0 ? fmt::format("{:.0f}", nic_gbps) : "-",
         inter && c.inter.torus_dims.empty() ? fmt::format("{:g}", c.inter.oversubscription.value)
                                             : "-",
         c.price_per_device_hour_usd ? fmt::format("{:.2f}", c.price_per_device_hour_usd->value)
                                     : "-"});
    if (out) {
      nlohmann::json j = {{"name", name},
                          {"device", c.device.name},
                          {"devices", c.devices()},
                          {"nodes", c.nodes},
                          {"devices_per_node", c.devices_per_node},
                          {"intra_node_bw_bytes_per_s", c.intra.bw_bytes_per_s.value},
                          {"inter_node_fabric", to_string(c.inter.fabric)}};
      if (inter && c.inter.torus_dims.empty()) {  // (a switched network's: a torus has no NICs)
        j["nic_bw_bytes_per_s"] = c.inter.nic_bw_bytes_per_s.value;
        j["nics_per_node"] = c.inter.nics_per_node;
        j["oversubscription"] = c.inter.oversubscription.value;
      }
      if (c.price_per_device_hour_usd) {
        j["price_per_device_hour_usd"] = c.price_per_device_hour_usd->value;
      }
      (*out)["clusters"].push_back(j);
    }
  }
  if (!out) std::cout << "clusters\n" << t.render();
}

void list_devices(nlohmann::json* out) {
  report::Table t({"device", "name", "peak", "memory", "bandwidth", "scale-up", "power"});
  t.set_units({"", "", "TFLOP/s dense", "GiB", "TB/s", "GB/s", "W"});
  t.align_left(0);
  t.align_left(1);
  for (const auto& name : cluster::list_devices()) {
    cluster::DeviceSpec d;
    try {
      d = cluster::load_device(name);
    } catch (const InputError& e) {
      t.add_row(unreadable_row(name, 7, e));
      continue;
    }
    const auto [peak, precision] = headline_peak(d);
    // (Three figures: a CPU rank's are a thousandth of a GPU's.)
    t.add_row({name, d.display_name,
               fmt::format("{} {}", figure_text(peak / 1e12), to_string(precision)),
               figure_text(d.memory_bytes.value / kGiB),
               figure_text(d.memory_bw_bytes_per_s.value / 1e12),
               figure_text(d.intra_node_bw_bytes_per_s.value / 1e9),
               d.power_w ? fmt::format("{:.0f}", d.power_w->value) : "-"});
    if (out) {
      nlohmann::json j = {{"name", name},
                          {"display_name", d.display_name},
                          {"peak_flops", peak},
                          {"peak_precision", to_string(precision)},
                          {"memory_bytes", report::byte_count(d.memory_bytes.value)},
                          {"memory_bw_bytes_per_s", d.memory_bw_bytes_per_s.value},
                          {"intra_node_bw_bytes_per_s", d.intra_node_bw_bytes_per_s.value}};
      if (d.power_w) j["power_w"] = d.power_w->value;
      (*out)["devices"].push_back(j);
    }
  }
  if (!out) std::cout << "devices\n" << t.render();
}

}  // namespace

int cmd_list(const std::vector<std::string>& args) {
  po::options_description desc("dtsim list options");
  desc.add_options()("help,h", "show this help")(
      "what", po::value<std::string>()->default_value("all"), "models, clusters, devices or all")(
      "json", po::bool_switch(),
      "print JSON: {\"clusters\": [...], \"devices\": [...], \"models\": [...]} (the names), and "
      "under \"details\" each one's figures");
  po::positional_options_description pos;
  pos.add("what", 1);
  po::variables_map vm;
  store_options(args, desc, vm, &pos);
  if (vm.count("help")) {
    std::cout << "usage: dtsim list [models|clusters|devices|all] [--json]\n\n"
                 "The shipped models (parameters and shape), clusters (device, size, scale-up "
                 "and inter-node network, price) and devices (dense peak, memory, power).\n\n"
              << desc;
    return 0;
  }
  const std::string what = vm["what"].as<std::string>();
  if (what != "all" && what != "models" && what != "clusters" && what != "devices") {
    throw InputError(fmt::format("expected models, clusters, devices or all, got \"{}\"", what));
  }
  const bool json_out = vm["json"].as<bool>();
  nlohmann::json out = nlohmann::json::object();
  nlohmann::json details = nlohmann::json::object();
  nlohmann::json* detail = json_out ? &details : nullptr;
  bool first = true;
  auto section = [&](const char* title, std::vector<std::string> names,
                     void (*list)(nlohmann::json*)) {
    if (json_out) {
      out[title] = std::move(names);
      details[title] = nlohmann::json::array();
    } else if (!first) {
      std::cout << "\n";
    }
    first = false;
    list(detail);
  };
  if (what == "all" || what == "models") {
    section("models", list_data_names("models"), list_models);
  }
  if (what == "all" || what == "clusters") {
    section("clusters", list_data_names("topologies"), list_clusters);
  }
  if (what == "all" || what == "devices") {
    section("devices", cluster::list_devices(), list_devices);
  }
  if (json_out) {
    out["details"] = details;
    std::cout << json_text(out, 2) << "\n";
  }
  if (!g_unreadable.empty()) {
    throw InputError(fmt::format("{} file{} did not load:\n  {}", g_unreadable.size(),
                                 g_unreadable.size() == 1 ? "" : "s",
                                 fmt::join(g_unreadable, "\n  ")));
  }
  return 0;
}

}  // namespace dtsim::cli
