#include "sim/cluster/topology.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <utility>

#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"

namespace dtsim::cluster {

using nlohmann::json;

namespace {

template <typename Enum, std::size_t N>
struct Names {
  std::array<std::pair<Enum, std::string_view>, N> entries;
  std::string_view name(Enum e) const {
    for (const auto& [v, n] : entries) {
      if (v == e) return n;
    }
    return "?";
  }
  Enum parse(const JsonReader& r, std::string_view key) const {
    if (!r.has(key)) r.fail(key, "required field is missing");
    const json& v = r.raw().at(std::string(key));
    std::vector<std::string_view> known;
    for (const auto& [e, n] : entries) known.push_back(n);
    if (v.is_string()) {
      for (const auto& [e, n] : entries) {
        if (v.get<std::string>() == n) return e;
      }
    }
    r.fail(key, fmt::format("expected one of {}, got {}", fmt::join(known, ", "),
                            describe_json_value(v)));
  }
};

constexpr Names<IntraFabric, 7> kIntraNames{{{{IntraFabric::NvSwitch, "nvswitch"},
                                              {IntraFabric::NvlinkMesh, "nvlink_mesh"},
                                              {IntraFabric::Xgmi, "xgmi"},
                                              {IntraFabric::RoceMesh, "roce_mesh"},
                                              {IntraFabric::IciTorus, "ici_torus"},
                                              {IntraFabric::Pcie, "pcie"},
                                              {IntraFabric::SharedMemory, "shared_memory"}}}};
constexpr Names<InterFabric, 5> kInterNames{{{{InterFabric::FatTree, "fat_tree"},
                                              {InterFabric::RailOptimized, "rail_optimized"},
                                              {InterFabric::Torus3d, "torus_3d"},
                                              {InterFabric::Dragonfly, "dragonfly"},
                                              {InterFabric::None, "none"}}}};
constexpr Names<Transport, 7> kTransportNames{{{{Transport::InfiniBand, "infiniband"},
                                                {Transport::RoCE, "roce"},
                                                {Transport::Ethernet, "ethernet"},
                                                {Transport::Efa, "efa"},
                                                {Transport::Slingshot, "slingshot"},
                                                {Transport::Ici, "ici"},
                                                {Transport::None, "none"}}}};

}  // namespace

std::string_view to_string(IntraFabric f) {
  return kIntraNames.name(f);
}
std::string_view to_string(InterFabric f) {
  return kInterNames.name(f);
}
std::string_view to_string(Transport t) {
  return kTransportNames.name(t);
}

void use_device_link(IntraNode& intra, const DeviceSpec& device) {
  intra.bw_bytes_per_s = device.intra_node_bw_bytes_per_s;
  intra.bw_efficiency = device.efficiency.intra_node_bw.value_or(IntraNode{}.bw_efficiency);
}

Cluster cluster_from_json(const json& j, const std::string& file) {
  refuse_other_kind(j, file, "cluster");
  const JsonReader r(j, file);
  r.expect_only({"name", "description", "source", "device", "device_efficiency", "nodes",
                 "devices_per_node", "intra_node", "inter_node", "price_per_device_hour_usd",
                 "power_per_device_w", "communication", "notes"});
  Cluster c;
  c.file = file;
  c.name = r.name("name");
  c.description = r.string("description");
  c.source = r.string("source");
  const std::string device_name = r.string("device");
  try {
    // A device file's relative path is the cluster file's neighbour (as a calibration's
    // --cluster-out folder has it), else as given (from the working folder).
    c.device = load_device(device_name, std::filesystem::path(file).parent_path());
  } catch (const InputError& e) {
    r.fail("device", e.what());
  }
  // The cluster's own software measured other rates than the catalog's (another CUDA, another
  // library): its figures replace the device's, each with its source.
  if (r.has("device_efficiency")) {
    c.device_efficiency_overrides =
        read_efficiency(r.object("device_efficiency"), c.device.efficiency, /*required=*/false);
  }
  if (r.has("communication")) {
    const JsonReader comm = r.object("communication");
    comm.expect_only({"overlaps_compute", "source"});
    if (!comm.boolean("overlaps_compute")) c.serial_ranks_source = comm.string("source");
  }
  c.nodes = r.positive_int_up_to("nodes", kMaxDevices);
  c.devices_per_node = r.positive_int_up_to("devices_per_node", kMaxDevices);
  if (c.devices() > kMaxDevices) {
    r.fail("nodes", fmt::format("nodes x devices_per_node = {} x {} = {} exceeds dtsim's limit of "
                                "{} devices",
                                c.nodes, c.devices_per_node, c.devices(), kMaxDevices));
  }

  const JsonReader intra = r.object("intra_node");
  intra.expect_only({"fabric", "bw_bytes_per_s", "latency_s", "note"});
  c.intra.fabric = kIntraNames.parse(intra, "fabric");
  // The device's intra_node_bw_bytes_per_s is its scale-up link's (NVLink, xGMI, ICI): a node
  // that joins its devices by PCIe or host memory says its own.
  const bool own_link = node_owns_link(c.intra.fabric);
  if (own_link && !intra.has("bw_bytes_per_s")) {
    intra.fail("bw_bytes_per_s",
               fmt::format("required with fabric {} (the device's intra_node_bw_bytes_per_s is "
                           "its scale-up link's, such as NVLink)",
                           to_string(c.intra.fabric)));
  }
  if (intra.has("bw_bytes_per_s")) {
    c.intra.bw_bytes_per_s =
        intra.figure_within("bw_bytes_per_s", kLeastBandwidth, kMostBandwidth, "bytes/s");
  } else {
    use_device_link(c.intra, c.device);
  }
  c.intra.latency_s = intra.figure_within("latency_s", kLeastLatency, kMostLatency, "seconds");

  const JsonReader inter = r.object("inter_node");
  inter.expect_only({"fabric", "transport", "nics_per_node", "nic_bw_bytes_per_s", "latency_s",
                     "nodes_per_leaf", "oversubscription", "torus_dims", "link_bw_bytes_per_s",
                     "note"});
  c.inter.fabric = kInterNames.parse(inter, "fabric");
  c.inter.transport = kTransportNames.parse(inter, "transport");
  const InterFabric f = c.inter.fabric;
  const bool switched = is_switched(f);
  // A field this fabric does not read would be ignored: refused, as a typo is.
  auto only_with = [&](std::initializer_list<const char*> keys, bool read, const char* fabrics) {
    for (const char* key : keys) {
      if (!read && inter.has(key)) {
        inter.fail(key, fmt::format("only with fabric {}; this cluster's is {}, which does not "
                                    "read it",
                                    fabrics, to_string(f)));
      }
    }
  };
  only_with({"torus_dims", "link_bw_bytes_per_s"}, f == InterFabric::Torus3d, "torus_3d");
  only_with({"nics_per_node", "nic_bw_bytes_per_s"}, switched,
            "fat_tree, rail_optimized or dragonfly");
  only_with({"nodes_per_leaf", "oversubscription"}, switched,
            "fat_tree, rail_optimized or dragonfly");
  only_with({"latency_s"}, f != InterFabric::None,
            "fat_tree, rail_optimized, dragonfly or torus_3d (a network between nodes)");
  if (switched && c.inter.transport == Transport::None) {
    inter.fail("transport", fmt::format("a {} network needs a transport (infiniband, roce, "
                                        "ethernet, efa, slingshot), got none",
                                        to_string(f)));
  }
  if (f == InterFabric::None && c.inter.transport != Transport::None) {
    inter.fail("transport", fmt::format("expected none with fabric none (a single node), got {}",
                                        to_string(c.inter.transport)));
  }
  if (f != InterFabric::None) {
    c.inter.latency_s = inter.figure_within("latency_s", kLeastLatency, kMostLatency, "seconds");
  }
  if (switched) {
    // Real nodes have up to a few dozen (AWS p5: 32); the platform holds a link per NIC.
    c.inter.nics_per_node = inter.positive_int_up_to("nics_per_node", 1024);
    c.inter.nic_bw_bytes_per_s =
        inter.figure_within("nic_bw_bytes_per_s", kLeastBandwidth, kMostBandwidth, "bytes/s");
  }
  if (f == InterFabric::FatTree || f == InterFabric::RailOptimized) {
    c.inter.nodes_per_leaf = inter.positive_int("nodes_per_leaf");
    if (c.inter.nodes_per_leaf > c.nodes) {
      inter.fail("nodes_per_leaf", fmt::format("{} nodes per leaf but the cluster has {} nodes",
                                               c.inter.nodes_per_leaf, c.nodes));
    }
  } else if (f == InterFabric::Dragonfly) {
    c.inter.nodes_per_leaf = inter.positive_int_or("nodes_per_leaf", c.nodes);
    if (c.inter.nodes_per_leaf > c.nodes) {
      inter.fail("nodes_per_leaf", fmt::format("{} nodes per group but the cluster has {} nodes",
                                               c.inter.nodes_per_leaf, c.nodes));
    }
  }
  if (inter.has("oversubscription")) {
    c.inter.oversubscription = inter.figure("oversubscription");
    if (!(c.inter.oversubscription.value >= 1.0 &&
          c.inter.oversubscription.value <= kMostOversubscription)) {
      inter.fail("oversubscription",
                 fmt::format("expected a ratio from 1 (non-blocking) to {:g}, got {}",
                             kMostOversubscription, c.inter.oversubscription.value));
    }
  }
  if (f == InterFabric::Torus3d) {
    c.inter.torus_dims = inter.positive_int_array_up_to("torus_dims", kMaxDevices);
    if (c.inter.torus_dims.size() != 3) {
      inter.fail("torus_dims", fmt::format("expected 3 sizes (x, y, z) for a torus_3d, got {}",
                                           c.inter.torus_dims.size()));
    }
    c.inter.link_bw_bytes_per_s =
        inter.figure_within("link_bw_bytes_per_s", kLeastBandwidth, kMostBandwidth, "bytes/s");
    // In double: three sizes up to 2^24 may not fit a 64-bit product.
    const double product =
        std::accumulate(c.inter.torus_dims.begin(), c.inter.torus_dims.end(), 1.0,
                        [](double a, std::int64_t d) { return a * static_cast<double>(d); });
    if (product != static_cast<double>(c.devices())) {
      inter.fail("torus_dims",
                 fmt::format("the torus has {:.0f} devices but nodes x devices_per_node = {}",
                             product, c.devices()));
    }
  }
  if (f == InterFabric::None && c.nodes != 1) {
    inter.fail("fabric", fmt::format("\"none\" needs nodes = 1, got {}", c.nodes));
  }
  if (r.has("price_per_device_hour_usd")) {
    c.price_per_device_hour_usd =
        r.figure_within("price_per_device_hour_usd", kLeastPrice, kMostPrice, "USD per hour");
  }
  if (r.has("power_per_device_w")) {
    c.power_per_device_w = r.figure_within("power_per_device_w", kLeastPower, kMostPower, "W");
  }
  if (!c.power_per_device_w) c.power_per_device_w = c.device.power_w;
  return c;
}

std::vector<std::string> list_clusters() {
  return list_data_names("topologies");
}

Cluster load_cluster(std::string_view name_or_path) {
  const auto path = resolve_data_file("cluster", "topologies", name_or_path);
  return cluster_from_json(JsonReader::parse_file(path), path.string());
}

Cluster with_device(Cluster cluster, DeviceSpec device) {
  // Its own device (the same device file): as the cluster's file has it, with its
  // device_efficiency. Another file of the same name (a calibrated copy) is another device.
  auto same_file = [](const std::string& a, const std::string& b) {
    std::error_code ec1, ec2;
    const auto x = std::filesystem::weakly_canonical(a, ec1);
    const auto y = std::filesystem::weakly_canonical(b, ec2);
    return !ec1 && !ec2 ? x == y : a == b;
  };
  if (device.name == cluster.device.name && same_file(device.file, cluster.device.file)) {
    return cluster;
  }
  cluster.price_per_device_hour_usd.reset();
  cluster.device_efficiency_overrides.clear();
  cluster.device = std::move(device);
  if (!node_owns_link(cluster.intra.fabric)) use_device_link(cluster.intra, cluster.device);
  cluster.power_per_device_w = cluster.device.power_w;
  return cluster;
}

Cluster with_devices(const Cluster& cluster, std::int64_t devices) {
  if (devices <= 0) {
    throw InputError(fmt::format("--gpus: expected a positive number of devices, got {}", devices));
  }
  Cluster c = cluster;
  if (devices == cluster.devices()) return c;
  if (devices > cluster.devices()) {
    // A CPU host's devices are the MPI ranks that dtexec calibrate measured at once.
    const bool host = cluster.intra.fabric == IntraFabric::SharedMemory;
    throw InputError(fmt::format(
        "--gpus {}: cluster {} has {} devices; pick a larger topology or fewer devices{}", devices,
        cluster.name, cluster.devices(),
        host ? fmt::format(" (a CPU host's devices are its MPI ranks: mpirun -np {} dtexec "
                           "calibrate --cluster-out DIR describes this host with {})",
                           devices, devices)
             : std::string()));
  }
  if (cluster.inter.fabric == InterFabric::Torus3d) {
    throw InputError(fmt::format(
        "--gpus {}: cluster {} is a fixed {}-device torus; pick a topology file of that size",
        devices, cluster.name, cluster.devices()));
  }
  const std::int64_t dpn = cluster.devices_per_node;
  if (devices < dpn) {
    c.nodes = 1;
    c.whole_node_devices = cluster.node_size();
    c.devices_per_node = devices;
  } else if (devices % dpn == 0) {
    c.nodes = devices / dpn;
  } else {
    throw InputError(
        fmt::format("--gpus {}: cluster {} has {} devices per node; use fewer than one node or a "
                    "multiple of {}",
                    devices, cluster.name, dpn, dpn));
  }
  // Fewer nodes: a leaf (or dragonfly group) holds at most all of them.
  c.inter.nodes_per_leaf = std::min(c.inter.nodes_per_leaf, c.nodes);
  return c;
}

Cluster with_nodes(const Cluster& cluster, std::int64_t nodes) {
  if (nodes <= 0) {
    throw InputError(fmt::format("nodes: expected a positive number of nodes, got {}", nodes));
  }
  if (nodes <= cluster.nodes) return with_devices(cluster, nodes * cluster.node_size());
  const InterFabric f = cluster.inter.fabric;
  if (f != InterFabric::FatTree && f != InterFabric::RailOptimized) {
    throw InputError(fmt::format(
        "cluster {} has {} node{} and a {} network, which does not grow ({})", cluster.name,
        cluster.nodes, cluster.nodes == 1 ? "" : "s", to_string(f),
        f == InterFabric::None      ? "a single node: nothing connects more"
        : f == InterFabric::Torus3d ? "a torus is of a fixed size"
                                    : "a dragonfly's global links are sized for its groups"));
  }
  if (nodes > kMaxDevices / cluster.node_size()) {
    throw InputError(fmt::format("{} nodes of {} devices: above the {} devices a cluster may have",
                                 nodes, cluster.node_size(), kMaxDevices));
  }
  Cluster c = cluster;
  c.nodes = nodes;
  c.devices_per_node = cluster.node_size();
  c.whole_node_devices = 0;
  return c;
}

}  // namespace dtsim::cluster
