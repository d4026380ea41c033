// A cluster (topologies/*.json, format in topologies/README.md): devices of one kind in nodes,
// the intra-node fabric and the inter-node network.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sim/cluster/device_catalog.hpp"

namespace dtsim::cluster {

// nvswitch: every pair at full link bandwidth through a switch; nvlink_mesh / xgmi / roce_mesh:
// direct links between pairs (NVLink, AMD Infinity Fabric, Gaudi's on-chip RoCE ports).
enum class IntraFabric { NvSwitch, NvlinkMesh, Xgmi, RoceMesh, IciTorus, Pcie, SharedMemory };
// A node that joins its devices by PCIe or host memory: the link is the node's, its rate the
// cluster file's, whatever device sits in it (a device's intra_node_bw_bytes_per_s is its
// scale-up link's, such as NVLink).
constexpr bool node_owns_link(IntraFabric f) {
  return f == IntraFabric::Pcie || f == IntraFabric::SharedMemory;
}
// Direct links between every pair of a node's devices (no switch).
constexpr bool is_mesh(IntraFabric f) {
  return f == IntraFabric::NvlinkMesh || f == IntraFabric::Xgmi || f == IntraFabric::RoceMesh;
}
enum class InterFabric { FatTree, RailOptimized, Torus3d, Dragonfly, None };
// A network of NICs and switches (leaves, uplinks): the fabrics that read nics_per_node,
// nic_bw_bytes_per_s, nodes_per_leaf and oversubscription.
constexpr bool is_switched(InterFabric f) {
  return f == InterFabric::FatTree || f == InterFabric::RailOptimized ||
         f == InterFabric::Dragonfly;
}
enum class Transport { InfiniBand, RoCE, Ethernet, Efa, Slingshot, Ici, None };

// At most 2^24 devices in a cluster (keeps device counts and their products in 64 bits).
inline constexpr std::int64_t kMaxDevices = std::int64_t{1} << 24;
// The largest leaf oversubscription a cluster may give: a sanity bound far past real leaves
// (1:1 to 1:8 or so), not a model constant.
inline constexpr double kMostOversubscription = 1000;

struct IntraNode {
  IntraFabric fabric = IntraFabric::NvSwitch;
  Figure bw_bytes_per_s;  // per device, per direction
  // The fraction of bw_bytes_per_s that collectives reach: the device catalog's
  // efficiency.intra_node_bw when the link rate is the device's, else 1.
  Figure bw_efficiency{1.0, "none given: collectives reach the link rate"};
  Figure latency_s;
  // What the network models use.
  double effective_bw() const { return bw_bytes_per_s.value * bw_efficiency.value; }
};

// The device's own scale-up link: its rate and the fraction of it collectives reach.
void use_device_link(IntraNode& intra, const DeviceSpec& device);

struct InterNode {
  InterFabric fabric = InterFabric::None;
  Transport transport = Transport::None;
  std::int64_t nics_per_node = 0;
  Figure nic_bw_bytes_per_s;  // per NIC, per direction
  Figure latency_s;
  std::int64_t nodes_per_leaf = 0;  // fat_tree, rail_optimized (and dragonfly groups)
  Figure oversubscription{1.0, "non-blocking (default)"};
  std::vector<std::int64_t> torus_dims;  // torus_3d, in devices
  Figure link_bw_bytes_per_s;            // torus_3d, per link per direction
};

struct Cluster {
  std::string name;
  std::string description;
  std::string source;
  std::string file;
  DeviceSpec device;
  // The device efficiencies this cluster's file sets in place of the catalog's (device_efficiency:
  // "gemm", ...).
  std::vector<std::string> device_efficiency_overrides;
  std::int64_t nodes = 0;
  std::int64_t devices_per_node = 0;
  // What one node holds when --gpus takes part of it (devices_per_node is then that part); 0:
  // devices_per_node. A mesh spreads a device's links over the whole node's peers.
  std::int64_t whole_node_devices = 0;
  IntraNode intra;
  InterNode inter;
  std::optional<Figure> price_per_device_hour_usd;
  std::optional<Figure> power_per_device_w;
  // Set (with its source) where a rank's communication makes progress only while the rank is
  // not computing (MPI without an asynchronous progress thread moves a non-blocking
  // collective's data only inside MPI calls): the engine then runs each rank's tasks one at a
  // time, in program order (engine::EngineOptions::serial_ranks). JSON:
  // "communication": {"overlaps_compute": false, "source": "..."}.
  std::optional<std::string> serial_ranks_source;

  std::int64_t devices() const { return nodes * devices_per_node; }
  std::int64_t node_size() const {
    return whole_node_devices > 0 ? whole_node_devices : devices_per_node;
  }
};

Cluster cluster_from_json(const nlohmann::json& j, const std::string& file);
Cluster load_cluster(std::string_view name_or_path);
std::vector<std::string> list_clusters();

// The same cluster with `devices` devices (--gpus): whole nodes, or part of one node, never
// more than the cluster has. Throws InputError when `devices` is neither, exceeds the cluster,
// or is not a torus's fixed size.
Cluster with_devices(const Cluster& cluster, std::int64_t devices);
// The cluster with `nodes` whole nodes: fewer as with_devices; more, a hypothetical larger
// cluster of the same nodes, leaves (nodes_per_leaf) and oversubscription, for a fat tree or a
// rail-optimized network (a torus is of a fixed size, a dragonfly's global links are sized for
// its groups, a single node has no network to grow): InputError for those, or past kMaxDevices.
Cluster with_nodes(const Cluster& cluster, std::int64_t nodes);
// The cluster with another device in its nodes: its scale-up links (not a PCIe or host-memory
// node's, see node_owns_link) and power are the device's;
// its price (an instance type's rate) and its device_efficiency, both its own device's, are
// dropped. Its own device (the same device file) leaves the cluster as it is.
Cluster with_device(Cluster cluster, DeviceSpec device);
// Whether the cluster's nodes hang off more than one leaf switch (else no traffic crosses the
// uplinks that oversubscription slows).
inline bool several_leaves(const Cluster& c) {
  return c.inter.nodes_per_leaf > 0 && c.inter.nodes_per_leaf < c.nodes;
}
// Whether any traffic may cross the uplinks that oversubscription slows: between leaves, and
// on a rail-optimized fabric between rails even inside one leaf (rails meet at the spine, as
// the analytical model prices them; the SimGrid platform has no rails).
inline bool crosses_uplinks(const Cluster& c) {
  return several_leaves(c) || (c.inter.fabric == InterFabric::RailOptimized && c.nodes > 1);
}

std::string_view to_string(IntraFabric f);
std::string_view to_string(InterFabric f);
std::string_view to_string(Transport t);

}  // namespace dtsim::cluster
