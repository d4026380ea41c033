// The flow-level view of a cluster that the SimGrid backend simulates and that
// `dtsim export-platform` writes as SimGrid XML: devices as hosts, one link per direction for
// each device's scale-up port, each NIC, and each leaf's uplink to the spine, and explicit
// routes between the device pairs a plan uses.
//   same node:     device tx port -> device rx port (a switch such as NVSwitch: non-blocking
//                  ports); on a mesh of direct links (NVLink mesh, xGMI, RoCE mesh), the pair's
//                  own link, a device's bandwidth / (the whole node's devices - 1)
//   same leaf:     src NIC tx -> dst NIC rx
//   across leaves: src NIC tx -> src leaf uplink -> dst leaf downlink -> dst NIC rx
// A device uses NIC (local index mod nics_per_node); with more NICs than devices, a device's
// nics_per_node / devices_per_node NICs are one link of their summed bandwidth. A leaf uplink
// carries nodes_per_leaf x nics x nic bandwidth / oversubscription. Latencies: the intra-node
// latency split over the two ports (a mesh link: all of it); the inter-node latency split over
// the two NICs.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sim/cluster/topology.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::network {

struct PlatformLink {
  std::string name;
  double bw_bytes_per_s = 0;
  double latency_s = 0;
};

struct PlatformSpec {
  std::vector<std::string> hosts;  // index = device
  std::vector<PlatformLink> links;
  // (src device, dst device) -> link indices, in order.
  std::vector<std::pair<std::pair<std::int64_t, std::int64_t>, std::vector<std::size_t>>> routes;
};

// The rings a group's ring collective runs (devices_per_node devices per node), each carrying
// an equal part of it. A group with k > 1 members on each of several nodes runs k rings, as
// NCCL's channels do, each entering every node at a member of its own and leaving it from
// another, so that each member's NIC carries one ring across nodes. Through a switch (NVSwitch)
// ring c visits a node's members from its c-th on. On a mesh of direct links (`mesh`), where
// each pair of devices has a link of its own, the rings' paths through a node use every link
// once, as NCCL and RCCL search rings over a mesh: for even k, Walecki's zigzag paths (c, c+1,
// c-1, c+2, ..., c+k/2, for c < k/2) and the same paths reversed; for odd k, the rotations
// (whose paths share links). Otherwise the group's own order is the one ring.
std::vector<std::vector<std::int64_t>> ring_channels(const std::vector<std::int64_t>& group,
                                                     std::int64_t devices_per_node, bool mesh);

// The device pairs that exchange data under `plan` on cluster `c`: ring neighbours (every
// channel) of every tp, cp, dp and expert-dp group, every pair of an ep group, and pipeline
// neighbours (both directions); on mesh nodes also every pair inside a node (a group inside one
// runs a ring over each of its direct links).
std::set<std::pair<std::int64_t, std::int64_t>> plan_pairs(const plan::Plan& plan,
                                                           const cluster::Cluster& c);
// Every ordered pair of devices inside each node (what collectives on a mesh use).
std::set<std::pair<std::int64_t, std::int64_t>> node_pairs(const cluster::Cluster& c);
// Every ordered pair of devices (small clusters only).
std::set<std::pair<std::int64_t, std::int64_t>> all_pairs(std::int64_t devices);

// Throws UnsupportedError for fabrics the flow model does not describe (torus_3d).
PlatformSpec build_platform(const cluster::Cluster& cluster,
                            const std::set<std::pair<std::int64_t, std::int64_t>>& pairs);

// SimGrid 3.32 platform XML (DTD version 4.1): one Full zone with the hosts, links and routes.
std::string platform_xml(const PlatformSpec& spec);

}  // namespace dtsim::network
