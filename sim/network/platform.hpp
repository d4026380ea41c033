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
// NCCL's channels do: ring c enters every node at its c-th member and leaves it from another
// one each, so that each member's NIC carries one ring across nodes. Otherwise the group's own
// order is the one ring.
std::vector<std::vector<std::int64_t>> ring_channels(const std::vector<std::int64_t>& group,
                                                     std::int64_t devices_per_node);

// The flows of NCCL's tree all-reduce over a group that spans nodes (devices_per_node devices
// per node): its members on each node form a chain, and the nodes two binary trees (a double
// binary tree: the second the mirror of the first, so that most inner nodes of one are leaves
// of the other), each carrying half of the buffer, reduced up and broadcast down, pipelined:
// every edge carries its half both ways at once. A group with k > 1 members on each node runs
// k channels, each a k-th of the buffer, as its rings do: channel c's chain starts at the
// node's c-th member, where tree 0 enters the node, and ends where tree 1 does, so that each
// member's NIC carries two trees. Empty for a group on one node or of two members (a ring of
// two is as fast).
struct TreeAllReduce {
  // Neighbours in a node's chain and (child's, parent's) entry members of a tree edge, every
  // channel's; each carries flows both ways.
  std::vector<std::pair<std::int64_t, std::int64_t>> chain, edges;
  std::size_t channels = 0;
  int depth = 0;       // the trees' node hops from a leaf to the root
  int chain_hops = 0;  // a chain's hops (members on a node - 1, the most)
};
TreeAllReduce tree_all_reduce(const std::vector<std::int64_t>& group,
                              std::int64_t devices_per_node);

// The device pairs that exchange data under `plan`: ring neighbours (every channel) and tree
// links (both directions) of every tp, cp, dp and expert-dp group, every pair of an ep group,
// and pipeline neighbours (both directions).
std::set<std::pair<std::int64_t, std::int64_t>> plan_pairs(const plan::Plan& plan,
                                                           std::int64_t devices_per_node);
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
