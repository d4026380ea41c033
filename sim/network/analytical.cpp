#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "sim/cluster/placement.hpp"
#include "sim/network/network_model.hpp"

namespace dtsim::network {

namespace {

using lower::CollectiveKind;

class Analytical final : public NetworkModel {
 public:
  explicit Analytical(const cluster::Cluster& c) : c_(c) {}

  std::string name() const override { return "analytical"; }

  double collective_s(const cluster::Placement& placement, const lower::Group& group,
                      CollectiveKind kind, std::uint64_t bytes) override {
    const int n = static_cast<int>(group.ranks.size());
    if (n <= 1 || bytes == 0) return 0;
    // The devices of the groups of this kind that run with this one (those of its pipeline
    // stages, as the SimGrid backend runs them) in the busiest leaf it spans: across an
    // oversubscribed spine they share the leaf's uplink. Elsewhere it never binds.
    const double concurrent = c_.inter.oversubscription.value > 1 && several_leaves()
                                  ? concurrent_in_leaf(placement, group.ranks)
                                  : leaf_devices();
    const Interned& g = intern(group.ranks);
    const auto key = std::make_tuple(g.id, kind, bytes, concurrent);
    if (auto it = memo_.find(key); it != memo_.end()) return it->second;
    const cluster::GroupSpan& span = g.span;
    const int k = static_cast<int>(span.max_devices_per_node);
    const int nodes = static_cast<int>(span.nodes);
    const Link intra{intra_bw(k), c_.intra.latency_s.value};
    // Rings (and the tree and hierarchical phases that stand in for them) send one flow per
    // group out of a leaf; all-to-all sends every member's traffic across.
    const Link inter_ring = inter_link(span, k, Crossing::OnePerGroup, concurrent);
    // The hierarchical all-reduce's phase across nodes: k rings, one per local rank, each its
    // own flow out of the leaf.
    const Link inter_each = inter_link(span, 1, Crossing::OnePerGroup, concurrent, k);
    // Across nodes with k > 1 members on each, the group runs k rings or trees (NCCL's
    // channels, each a k-th of the buffer), each entering and leaving a node at members of its
    // own: a member sends its share inside the node in k - 1 of them and across in one, so its
    // intra-node link carries (k - 1)/k of what the member sends (the SimGrid backend's rings
    // alike, network/platform.hpp: ring_channels).
    // On PCIe the device's one link carries its NIC traffic too (the NIC hangs off the same
    // PCIe tree: GPUDirect RDMA reads the GPU's memory through it), so all of what a member
    // sends crosses it.
    Link channels = intra;
    if (k > 1 && !pcie()) channels.bw_bytes_per_s *= static_cast<double>(k) / (k - 1);
    // The ring's slowest hop.
    Link ring = nodes > 1 ? inter_ring : intra;
    if (nodes > 1 && k > 1) {
      ring.bw_bytes_per_s = std::min(channels.bw_bytes_per_s, inter_ring.bw_bytes_per_s);
    }
    const double s = static_cast<double>(bytes);
    double t = 0;
    switch (kind) {
      case CollectiveKind::AllReduce: {
        t = ring_all_reduce_s(s, n, ring);
        if (nodes > 1) t = std::min(t, node_tree_all_reduce_s(s, k, nodes, channels, inter_ring));
        if (nodes > 1 && k > 1) {
          t = std::min(t, hierarchical_all_reduce_s(s, k, nodes, intra, inter_each));
        }
        break;
      }
      case CollectiveKind::AllGather:
      case CollectiveKind::ReduceScatter:
        t = ring_all_gather_s(s, n, ring);
        break;
      case CollectiveKind::AllToAll: {
        // Each member sends a piece to every other: through its NIC to those on other nodes,
        // and over its leaf's uplink to those in other leaves only (a member's peers in its
        // own leaf's other nodes stay below the spine), every device of the leaf's groups of
        // this kind sending so at once.
        cluster::GroupSpan below = span;
        below.crosses_spine = false;
        t = direct_all_to_all_s(s, n, k, intra,
                                nodes > 1 ? inter_link(below, 1, Crossing::Every) : intra);
        // On PCIe its pieces to the node's members and to other nodes share the device's link.
        if (pcie()) t = std::max(t, network::p2p_s((n - 1) * (s / n), intra));
        if (span.crosses_spine) {
          const Link uplink = inter_link(span, 1, Crossing::Every, concurrent);
          // (A rail-optimized group in one leaf crosses it between rails: every remote peer.)
          const std::int64_t fewest = fewest_in_a_leaf(group.ranks);
          const double across = static_cast<double>(fewest == n ? n - k : n - fewest);
          t = std::max(t, across * (s / n) / uplink.bw_bytes_per_s + uplink.latency_s);
        }
        break;
      }
    }
    memo_.emplace(key, t);
    return t;
  }

  double p2p_s(const cluster::Placement& placement, std::int64_t src, std::int64_t dst,
               std::uint64_t bytes) override {
    const double s = static_cast<double>(bytes);
    const std::int64_t dpn = c_.devices_per_node;
    double t = 0;
    if (src / dpn == dst / dpn) {
      t = network::p2p_s(s, Link{intra_bw(2), c_.intra.latency_s.value});
    } else {
      // Every device of the node sends to its own peer at the same time (pipeline symmetry).
      const std::vector<std::int64_t> pair = {src, dst};
      cluster::GroupSpan span = cluster::group_span(c_, pair);
      // Between leaves of an oversubscribed spine, the leaf's share is counted below (a
      // rail-optimized pair across rails inside one leaf keeps the rule for groups).
      if (c_.inter.oversubscription.value > 1 && leaf_of(src) != leaf_of(dst)) {
        span.crosses_spine = false;
      }
      t = network::p2p_s(s, inter_link(span, 1, Crossing::Every));
    }
    if (c_.inter.oversubscription.value <= 1) return t;
    // Every rank of the sender's stage sends to its peer at once, and the stage's slowest
    // transfer holds the pipeline (its replicas meet at the tp and dp collectives; the SimGrid
    // backend times the hop by its last flow alike). A transfer between leaves gets its node's
    // NIC share and, on its leaf's uplink (the other leaf's downlink), a share among the
    // stage's flows that cross there: a stage smaller than the leaf shares it with fewer than
    // the leaf's devices.
    const std::int64_t crossing = leaf_crossings(placement, src, dst);
    if (crossing == 0) return t;
    cluster::GroupSpan across;  // two nodes, below the spine: the NICs' share
    across.devices = 2;
    across.nodes = 2;
    Link link = inter_link(across, 1, Crossing::Every);
    link.bw_bytes_per_s =
        std::min(link.bw_bytes_per_s, leaf_uplink_bw() / static_cast<double>(crossing));
    return std::max(t, network::p2p_s(s, link));
  }

 private:
  // A node of PCIe devices: a device's one link to the node, which its network traffic
  // crosses too.
  bool pcie() const { return c_.intra.fabric == cluster::IntraFabric::Pcie; }

  // Bandwidth per rank inside a node for a group of k ranks there. A switch (NVSwitch) gives
  // every rank its full link bandwidth; on a mesh of direct links (NVLink mesh, xGMI, Gaudi's
  // RoCE ports) a rank's links are spread over the whole node's other devices (also when --gpus
  // takes part of a node), and a group of k ranks uses the k - 1 links to its members.
  double intra_bw(int k) const {
    const double bw = c_.intra.effective_bw();
    const std::int64_t whole = c_.node_size();
    if (!cluster::is_mesh(c_.intra.fabric) || whole <= 1) return bw;
    return bw * std::max(1, k - 1) / static_cast<double>(whole - 1);
  }

  enum class Crossing { OnePerGroup, Every };

  // Per-flow bandwidth leaving a node when every device of the node is in a group of this kind
  // with k members per node (devices_per_node / k flows share the node's NICs). A group that
  // spans leaves also shares its leaf's uplinks (nodes_per_leaf x NICs x NIC bandwidth /
  // oversubscription) with the groups of its kind that run with it there, `concurrent` of
  // the leaf's devices in them (by default all): a ring leaves the leaf once (one flow per
  // group, rank order visiting a leaf's members together; `rings_per_group` where a group
  // runs several, the hierarchical all-reduce's k); with Crossing::Every every one of those
  // devices' flows takes the uplink.
  Link inter_link(const cluster::GroupSpan& span, int k, Crossing crossing, double concurrent = 0,
                  int rings_per_group = 1) const {
    const auto& inter = c_.inter;
    if (inter.fabric == cluster::InterFabric::Torus3d) {
      // A ring step between members h hops apart crosses h links and pays h hops of latency.
      // Groups of a kind are strided alike (rank placement), so the h - 1 groups interleaved
      // with this one along those links run their steps over them at the same time: a flow
      // gets 1/h of a link.
      const double h = static_cast<double>(std::max<std::int64_t>(1, span.max_ring_hops));
      return Link{inter.link_bw_bytes_per_s.value / h, inter.latency_s.value * h};
    }
    if (inter.fabric == cluster::InterFabric::None) {
      return Link{c_.intra.effective_bw(), c_.intra.latency_s.value};
    }
    const double node_bw =
        static_cast<double>(inter.nics_per_node) * inter.nic_bw_bytes_per_s.value;
    const double flows = static_cast<double>(c_.devices_per_node) / std::max(k, 1);
    double bw = node_bw / flows;
    // A flow leaves its device through the device's PCIe link on a PCIe node.
    if (pcie()) bw = std::min(bw, c_.intra.effective_bw());
    if (!span.crosses_spine) return Link{bw, inter.latency_s.value};
    if (concurrent <= 0) concurrent = leaf_devices();
    if (crossing == Crossing::Every) {
      bw = std::min(bw, leaf_uplink_bw() / concurrent);
    } else {
      const double members_in_leaf =
          std::ceil(static_cast<double>(span.devices) / static_cast<double>(span.leaf_groups));
      const double groups_in_leaf = std::max(1.0, concurrent / members_in_leaf);
      bw = std::min(bw, leaf_uplink_bw() / (groups_in_leaf * rings_per_group));
    }
    return Link{bw, inter.latency_s.value};
  }

  // A leaf's nodes (the cluster's, where it has fewer than a leaf) and devices.
  std::int64_t leaf_nodes() const {
    const std::int64_t per_leaf = c_.inter.nodes_per_leaf;
    return std::min(per_leaf > 0 ? per_leaf : c_.nodes, c_.nodes);
  }
  double leaf_devices() const { return static_cast<double>(leaf_nodes() * c_.devices_per_node); }

  // What identifies a plan's layout in the memos: its degrees and rank order.
  using Layout = std::tuple<std::array<int, 5>, std::vector<cluster::ParallelDim>>;
  static Layout layout_of(const cluster::Placement& placement) {
    const cluster::ParallelDegrees& d = placement.degrees();
    return {{d.tp, d.cp, d.ep, d.dp, d.pp}, placement.order()};
  }

  // The plan's devices in the pipeline stages of `ranks` (a group, all in one stage but a
  // tied embedding's, in the first and the last), in the busiest of the leaves the group
  // spans: those that run the collectives of the group's kind with it. (The SimGrid backend
  // times the slowest of those groups; a stage's groups of a kind are alike where the
  // placement is symmetric, which simulate and plan require.)
  double concurrent_in_leaf(const cluster::Placement& placement,
                            const std::vector<std::int64_t>& ranks) {
    const Layout layout = layout_of(placement);
    const auto group_key = std::make_tuple(layout, intern(ranks).id);
    if (auto it = concurrent_.find(group_key); it != concurrent_.end()) return it->second;
    double most = leaf_devices();  // a group inside one leaf: what it shares does not bind
    std::set<std::int64_t> leaves;
    std::vector<int> stages;
    for (std::int64_t r : ranks) {
      leaves.insert(leaf_of(r));
      stages.push_back(placement.coords(r).pp);
    }
    if (leaves.size() > 1) {
      std::sort(stages.begin(), stages.end());
      stages.erase(std::unique(stages.begin(), stages.end()), stages.end());
      const auto stages_key = std::make_tuple(layout, stages);
      auto it = stage_devices_.find(stages_key);
      if (it == stage_devices_.end()) {
        std::map<std::int64_t, std::int64_t> by_leaf;
        for (const int stage : stages) {
          for (const std::int64_t r : placement.stage_ranks(stage)) ++by_leaf[leaf_of(r)];
        }
        it = stage_devices_.emplace(stages_key, std::move(by_leaf)).first;
      }
      std::int64_t count = 1;
      for (const std::int64_t leaf : leaves) {
        const auto found = it->second.find(leaf);
        if (found != it->second.end()) count = std::max(count, found->second);
      }
      most = static_cast<double>(count);
    }
    concurrent_.emplace(group_key, most);
    return most;
  }

  // Whether the cluster has more than one leaf (else nothing crosses a spine).
  bool several_leaves() const { return cluster::several_leaves(c_); }

  std::int64_t leaf_of(std::int64_t device) const {
    const std::int64_t node = device / c_.devices_per_node;
    return c_.inter.nodes_per_leaf > 0 ? node / c_.inter.nodes_per_leaf : 0;
  }

  // The fewest members of `ranks` in one of the leaves they span: n less that is the most
  // peers a member has in other leaves.
  std::int64_t fewest_in_a_leaf(const std::vector<std::int64_t>& ranks) const {
    std::map<std::int64_t, std::int64_t> by_leaf;
    for (const std::int64_t r : ranks) ++by_leaf[leaf_of(r)];
    std::int64_t fewest = static_cast<std::int64_t>(ranks.size());
    for (const auto& [leaf, count] : by_leaf) fewest = std::min(fewest, count);
    return fewest;
  }

  // A leaf's bandwidth to the spine, each way: its nodes' NICs over the oversubscription
  // (network/platform.cpp's leaf links alike).
  double leaf_uplink_bw() const {
    const auto& inter = c_.inter;
    return static_cast<double>(leaf_nodes() * inter.nics_per_node) *
           inter.nic_bw_bytes_per_s.value / inter.oversubscription.value;
  }

  // The most flows of the pipeline hop from src's stage to dst's that share a leaf's uplink
  // or downlink with a flow between leaves (0: none crosses): each rank of the stage sends to
  // the rank of the other stage with its coordinates, as the SimGrid backend runs the hop.
  // Counted once per hop and layout. src and dst are ranks of the placement.
  std::int64_t leaf_crossings(const cluster::Placement& placement, std::int64_t src,
                              std::int64_t dst) {
    if (!several_leaves()) return 0;
    const int from = placement.coords(src).pp, to = placement.coords(dst).pp;
    const auto key = std::make_tuple(layout_of(placement), from, to);
    if (auto it = crossings_.find(key); it != crossings_.end()) return it->second;
    std::map<std::int64_t, std::int64_t> out, in;  // by leaf
    std::set<std::pair<std::int64_t, std::int64_t>> crossed;
    for (const std::int64_t r : placement.stage_ranks(from)) {
      cluster::RankCoords c = placement.coords(r);
      c.pp = to;
      const std::int64_t a = leaf_of(r), b = leaf_of(placement.rank(c));
      if (a == b) continue;
      ++out[a];
      ++in[b];
      crossed.emplace(a, b);
    }
    std::int64_t worst = 0;
    for (const auto& [a, b] : crossed) worst = std::max({worst, out[a], in[b]});
    crossings_.emplace(key, worst);
    return worst;
  }

  // A group's ranks, seen once: the memos below key on its number, and its span is found once
  // (a search asks for a dp group of 131,072 ranks at many sizes; keyed by the ranks, each
  // lookup compared them).
  struct Interned {
    std::size_t id = 0;
    std::vector<std::int64_t> ranks;
    cluster::GroupSpan span;
  };
  const Interned& intern(const std::vector<std::int64_t>& ranks) {
    // Hashed by its size and eight members (FNV-1a); the ranks themselves are compared.
    std::uint64_t hash = 14695981039346656037ull;
    const auto mix = [&](std::uint64_t x) { hash = (hash ^ x) * 1099511628211ull; };
    mix(ranks.size());
    for (std::size_t i = 0; i < 8 && !ranks.empty(); ++i) {
      mix(static_cast<std::uint64_t>(ranks[i * (ranks.size() - 1) / 7]));
    }
    auto& bucket = interned_[hash];
    for (const std::size_t i : bucket) {
      if (groups_[i]->ranks == ranks) return *groups_[i];
    }
    groups_.push_back(std::make_unique<Interned>(
        Interned{groups_.size(), ranks, cluster::group_span(c_, ranks)}));
    bucket.push_back(groups_.back()->id);
    return *groups_.back();
  }

  const cluster::Cluster& c_;
  std::vector<std::unique_ptr<Interned>> groups_;
  std::unordered_map<std::uint64_t, std::vector<std::size_t>> interned_;
  std::map<std::tuple<std::size_t, CollectiveKind, std::uint64_t, double>, double> memo_;
  std::map<std::tuple<Layout, std::vector<int>>, std::map<std::int64_t, std::int64_t>>
      stage_devices_;
  std::map<std::tuple<Layout, std::size_t>, double> concurrent_;
  std::map<std::tuple<Layout, int, int>, std::int64_t> crossings_;
};

}  // namespace

std::unique_ptr<NetworkModel> make_analytical(const cluster::Cluster& cluster) {
  return std::make_unique<Analytical>(cluster);
}

}  // namespace dtsim::network
