// Placement of a plan's ranks on a cluster's devices, and what a group of ranks crosses.
//
// A rank has coordinates (tp, cp, ep, dp, pp). Expert parallelism lives inside data
// parallelism (Megatron-LM): the data-parallel degree dp = ep x (dp / ep), and the plan's data
// -parallel group spans both. Ranks are numbered by mixing the coordinates in `order`, fastest
// first (Megatron's default tp, cp, ep, dp, pp), and rank r runs on device r (devices are
// numbered node by node), so the fastest dimension stays inside a node.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sim/cluster/topology.hpp"

namespace dtsim::cluster {

enum class ParallelDim { Tp, Cp, Ep, Dp, Pp };

struct ParallelDegrees {
  int tp = 1;
  int cp = 1;
  int ep = 1;  // divides dp
  int dp = 1;  // data-parallel degree including ep
  int pp = 1;
  std::int64_t ranks() const { return std::int64_t{tp} * cp * dp * pp; }
};

struct RankCoords {
  int tp = 0;
  int cp = 0;
  int ep = 0;        // index inside the expert-parallel group
  int dp_outer = 0;  // index among expert-parallel groups: dp = dp_outer * ep_degree + ep
  int pp = 0;
};

class Placement {
 public:
  // Throws InputError if ep does not divide dp or `order` is not a permutation of the five.
  Placement(ParallelDegrees degrees, std::vector<ParallelDim> order = default_order());

  static std::vector<ParallelDim> default_order();
  // "tp-cp-ep-dp-pp" (fastest first); throws InputError naming the expected form.
  static std::vector<ParallelDim> parse_order(std::string_view text);
  static std::string to_string(const std::vector<ParallelDim>& order);

  const ParallelDegrees& degrees() const { return degrees_; }
  const std::vector<ParallelDim>& order() const { return order_; }

  RankCoords coords(std::int64_t rank) const;
  std::int64_t rank(const RankCoords& c) const;
  // The ranks that share every coordinate with `rank` except `dim` (Dp spans ep x dp_outer;
  // Ep only the expert-parallel ranks), in increasing order of that coordinate.
  std::vector<std::int64_t> group(ParallelDim dim, std::int64_t rank) const;
  // The ranks that hold the same dense weights as `rank` and reduce their gradients together:
  // data-parallel and context-parallel (Megatron-LM reduces over dp x cp), in order.
  std::vector<std::int64_t> gradient_group(std::int64_t rank) const;
  // The same for expert weights: the ranks with the same experts (same ep index), dp/ep x cp.
  std::vector<std::int64_t> expert_gradient_group(std::int64_t rank) const;
  // Whether `rank` is the first (smallest) rank of its group(dim), gradient_group or
  // expert_gradient_group: the coordinates the group varies are 0 there. Walking each group
  // once from its first rank takes time linear in the ranks, where building every rank's group
  // takes ranks x group size (6e9 steps for a dp of 78,848).
  bool first_of_group(ParallelDim dim, std::int64_t rank) const;
  bool first_of_gradient_group(std::int64_t rank) const;
  bool first_of_expert_gradient_group(std::int64_t rank) const;
  // The ranks of pipeline stage `stage`, found without walking the other stages' (all the
  // stages together cost a walk of the ranks), in increasing order.
  std::vector<std::int64_t> stage_ranks(int stage) const;
  // Whether every group of every kind has the same shape on nodes of `devices_per_node`
  // devices: each product of the dimensions in order (fastest first) divides the node or is a
  // multiple of it. Then all ranks of a pipeline stage see identical surroundings.
  bool symmetric_on(std::int64_t devices_per_node) const;

 private:
  int extent(ParallelDim dim) const;  // size of the dimension in the mixed radix
  int coord(const RankCoords& c, ParallelDim dim) const;
  // The ranks that share `rank`'s coordinates but those of `varying`, in increasing order,
  // made in that order (a sort of a dp of 131,072 ranks per candidate was a fifth of a
  // search's time).
  std::vector<std::int64_t> ranks_varying(std::int64_t rank,
                                          std::initializer_list<ParallelDim> varying) const;
  ParallelDegrees degrees_;
  std::vector<ParallelDim> order_;
  std::array<std::int64_t, 5> stride_{};  // indexed by ParallelDim
};

// Which parts of the cluster a group of devices uses.
struct GroupSpan {
  std::int64_t devices = 0;
  std::int64_t nodes = 0;  // distinct nodes
  std::int64_t max_devices_per_node = 0;
  std::int64_t leaf_groups = 0;  // distinct leaf (rail / dragonfly) groups
  bool intra_node_only = true;
  bool crosses_spine = false;       // between leaf groups (fat tree, rail-optimized)
  bool single_rail = true;          // every device has the same local index
  std::int64_t max_torus_hops = 0;  // torus_3d: largest shortest-path hop count
  // torus_3d: the largest hop count between members next to each other in the group's order
  // (a ring's steps, the last member back to the first included).
  std::int64_t max_ring_hops = 0;
  std::vector<std::string> crossed;  // human-readable: "NVSwitch", "NIC (infiniband)", ...
};

GroupSpan group_span(const Cluster& cluster, std::span<const std::int64_t> devices);

// torus_3d: the shortest-path hop count between devices a and b of a torus of these sizes (x
// fastest), and the largest between two of the devices (exact, by whichever of two ways costs
// less).
std::int64_t torus_hops(std::span<const std::int64_t> dims, std::int64_t a, std::int64_t b);
std::int64_t torus_diameter(std::span<const std::int64_t> dims,
                            std::span<const std::int64_t> devices);

std::string_view to_string(ParallelDim dim);

}  // namespace dtsim::cluster
