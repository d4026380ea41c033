// The SimGrid backend: each distinct collective (or pipeline transfer) is simulated once as
// flows on a SimGrid platform (network/platform.hpp), together with every group of its kind
// that runs at the same moment by symmetry (all groups of that kind in the same pipeline
// stage), so that groups sharing a NIC or an oversubscribed uplink slow each other down as
// SimGrid's max-min sharing decides. The only file with SimGrid includes.
//
// Flows per collective (few per rank, as TOOLCHAIN.md advises): a ring all-reduce is one flow
// per rank to its ring successor carrying 2(n-1)/n of the buffer; all-gather and reduce-scatter
// (n-1)/n; all-to-all one flow per ordered pair carrying 1/n. On a mesh of direct links, a group
// inside one node runs n - 1 rings at once, one per link: a flow from each rank to every other
// member carrying 1/(n-1) of the ring's share. The ring's other 2(n-1) - 1
// (all-gather: n - 2) latency steps are added to the simulated time, as the analytical backend
// counts them. Network model CM02 without cross-traffic: textbook max-min sharing.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <simgrid/s4u.hpp>

#include "sim/cluster/placement.hpp"
#include "sim/common/error.hpp"
#include "sim/network/network_model.hpp"
#include "sim/network/platform.hpp"

namespace dtsim::network {

namespace {

namespace sg4 = simgrid::s4u;
using cluster::ParallelDim;
using lower::CollectiveKind;

struct Flow {
  std::int64_t src;
  std::int64_t dst;
  double bytes;
};

// SimGrid allows one engine and one platform per process.
struct World {
  std::unique_ptr<sg4::Engine> engine;
  std::vector<sg4::Host*> hosts;
  std::string key;  // what the platform was built for
};

World& world() {
  static World w;
  return w;
}

class SimGridNetwork final : public NetworkModel {
 public:
  SimGridNetwork(const cluster::Cluster& c, const plan::Plan& plan)
      : c_(c), plan_(plan), placement_(plan.degrees(), plan.order) {
    // SimGrid's Full zone keeps a routing-table slot per ordered pair of hosts (FullZone: a
    // table_size x table_size table of pointers, "the highest memory requirements" in its
    // documentation): 8 bytes x devices^2, 0.5 GiB at 8,192 devices, 4.5 GiB at the 24,576 of
    // h100-roce, 46 GiB at Frontier's 78,848. Beyond 8 GiB (32,768 devices) it is refused here
    // rather than left to exhaust memory after minutes.
    constexpr std::int64_t kMostDevices = 32768;
    if (c.devices() > kMostDevices) {
      throw UnsupportedError(fmt::format(
          "--network simgrid: {} devices; SimGrid's Full routing zone keeps a route slot per "
          "pair of devices, {:.0f} GiB of them here, and dtsim builds it for at most {} "
          "devices: use --network analytical, or --gpus {} or fewer",
          c.devices(),
          8.0 * static_cast<double>(c.devices()) * static_cast<double>(c.devices()) /
              (1024.0 * 1024 * 1024),
          kMostDevices, kMostDevices));
    }
    auto pairs = plan_pairs(plan, c.devices_per_node);
    if (cluster::is_mesh(c.intra.fabric)) pairs.merge(node_pairs(c));
    spec_ = build_platform(c, pairs);
    for (const auto& [pair, links] : spec_.routes) {
      double lat = 0;
      for (std::size_t l : links) lat += spec_.links[l].latency_s;
      latency_[pair] = lat;
    }
    const std::string key = fmt::format("{}|{}|{}", c.name, c.devices(), plan::summary(plan));
    World& w = world();
    if (w.engine) {
      if (w.key != key) {
        throw UnsupportedError(
            "--network simgrid: SimGrid allows one platform per process; this process already "
            "simulated another cluster or plan");
      }
      return;
    }
    static int argc = 4;
    static char arg0[] = "dtsim";
    static char arg1[] = "--cfg=network/model:CM02";
    static char arg2[] = "--cfg=network/crosstraffic:0";
    static char arg3[] = "--log=root.thres:critical";
    static char* argv[] = {arg0, arg1, arg2, arg3, nullptr};
    w.engine = std::make_unique<sg4::Engine>(&argc, argv);
    w.key = key;
    auto* zone = sg4::create_full_zone("cluster");
    for (const auto& name : spec_.hosts) w.hosts.push_back(zone->create_host(name, 1e9)->seal());
    std::vector<const sg4::Link*> links;
    for (const auto& l : spec_.links) {
      links.push_back(
          zone->create_link(l.name, l.bw_bytes_per_s)->set_latency(l.latency_s)->seal());
    }
    for (const auto& [pair, route] : spec_.routes) {
      std::vector<sg4::LinkInRoute> in_route;
      for (std::size_t l : route) in_route.emplace_back(links[l]);
      zone->add_route(w.hosts[static_cast<std::size_t>(pair.first)]->get_netpoint(),
                      w.hosts[static_cast<std::size_t>(pair.second)]->get_netpoint(), nullptr,
                      nullptr, in_route, false);
    }
    zone->seal();
  }

  std::string name() const override { return "simgrid"; }

  double collective_s(const lower::Group& group, CollectiveKind kind,
                      std::uint64_t bytes) override {
    const int n = static_cast<int>(group.ranks.size());
    if (n <= 1 || bytes == 0) return 0;
    const auto key = std::make_tuple(group.ranks, kind, bytes);
    if (auto it = memo_.find(key); it != memo_.end()) return it->second;
    const double s = static_cast<double>(bytes);
    std::vector<Flow> flows;
    double extra_steps = 0;
    double hop_latency = 0;
    for (const auto& g : concurrent_groups(group)) {
      const int m = static_cast<int>(g.size());
      if (kind == CollectiveKind::AllToAll) {
        for (std::int64_t a : g) {
          for (std::int64_t b : g) {
            if (a != b) flows.push_back({a, b, s / m});
          }
        }
        continue;
      }
      const double share = kind == CollectiveKind::AllReduce ? 2.0 * (m - 1) / m : (m - 1.0) / m;
      const std::int64_t node = g.front() / c_.devices_per_node;
      // On a mesh, a group inside one node runs m - 1 rings turned against each other, one over
      // each of a rank's direct links to the group (as NCCL and RCCL build rings over a mesh):
      // a flow to every other member. Either way the ring's hops set its latency steps.
      const bool mesh_rings =
          cluster::is_mesh(c_.intra.fabric) && std::all_of(g.begin(), g.end(), [&](std::int64_t r) {
            return r / c_.devices_per_node == node;
          });
      // (A mesh group lies in one node: one ring.)
      const auto rings = ring_channels(g, c_.devices_per_node);
      for (const auto& ring : rings) {
        for (int i = 0; i < m; ++i) {
          const std::int64_t a = ring[static_cast<std::size_t>(i)];
          const std::int64_t b = ring[static_cast<std::size_t>((i + 1) % m)];
          if (!mesh_rings) flows.push_back({a, b, share * s / static_cast<double>(rings.size())});
          hop_latency = std::max(hop_latency, latency_.at({a, b}));
        }
      }
      if (mesh_rings) {
        for (std::int64_t a : g) {
          for (std::int64_t b : g) {
            if (a != b) flows.push_back({a, b, share * s / (m - 1)});
          }
        }
      }
      extra_steps = kind == CollectiveKind::AllReduce ? 2.0 * (m - 1) - 1 : m - 2.0;
    }
    const double t = run(flows) + extra_steps * hop_latency;
    memo_.emplace(key, t);
    return t;
  }

  double p2p_s(std::int64_t src, std::int64_t dst, std::uint64_t bytes) override {
    const auto key = std::make_tuple(src, dst, bytes);
    if (auto it = p2p_memo_.find(key); it != p2p_memo_.end()) return it->second;
    // Every rank of the sender's stage sends to its peer in the receiver's stage at once.
    const int from = placement_.coords(src).pp;
    const int to = placement_.coords(dst).pp;
    std::vector<Flow> flows;
    if (from == to) {
      flows.push_back({src, dst, static_cast<double>(bytes)});
    } else {
      for (std::int64_t r = 0; r < plan_.devices(); ++r) {
        auto c = placement_.coords(r);
        if (c.pp != from) continue;
        c.pp = to;
        flows.push_back({r, placement_.rank(c), static_cast<double>(bytes)});
      }
    }
    const double t = run(flows);
    p2p_memo_.emplace(key, t);
    return t;
  }

 private:
  // The groups of the same kind as `group` in the same pipeline stage (they run together).
  std::vector<std::vector<std::int64_t>> concurrent_groups(const lower::Group& group) const {
    const int stage = placement_.coords(group.ranks.front()).pp;
    std::set<std::vector<std::int64_t>> groups;
    for (std::int64_t r = 0; r < plan_.devices(); ++r) {
      const auto c = placement_.coords(r);
      if (c.pp != stage) continue;
      switch (group.kind) {
        case lower::GroupKind::Tp:
          groups.insert(placement_.group(ParallelDim::Tp, r));
          break;
        case lower::GroupKind::Cp:
          groups.insert(placement_.group(ParallelDim::Cp, r));
          break;
        case lower::GroupKind::Ep:
          groups.insert(placement_.group(ParallelDim::Ep, r));
          break;
        case lower::GroupKind::Dp:
          groups.insert(placement_.gradient_group(r));
          break;
        case lower::GroupKind::ExpertDp:
          groups.insert(placement_.expert_gradient_group(r));
          break;
        case lower::GroupKind::Pp:
          // Pipeline groups: the tied-embedding pair (first and last stage) of every rank.
          groups.insert(
              group.ranks.size() == 2
                  ? std::vector<std::int64_t>{placement_.group(ParallelDim::Pp, r).front(),
                                              placement_.group(ParallelDim::Pp, r).back()}
                  : placement_.group(ParallelDim::Pp, r));
          break;
      }
    }
    return {groups.begin(), groups.end()};
  }

  // Simulates the flows from the current simulated time; returns how long the last one took.
  double run(const std::vector<Flow>& flows) {
    if (flows.empty()) return 0;
    World& w = world();
    const double start = sg4::Engine::get_clock();
    sg4::Actor::create("collective", w.hosts.front(), [&w, &flows]() {
      std::vector<sg4::CommPtr> comms;
      comms.reserve(flows.size());
      for (const Flow& f : flows) {
        comms.push_back(sg4::Comm::sendto_async(w.hosts[static_cast<std::size_t>(f.src)],
                                                w.hosts[static_cast<std::size_t>(f.dst)],
                                                static_cast<std::uint64_t>(f.bytes)));
      }
      sg4::Comm::wait_all(comms);
    });
    w.engine->run();
    ++episodes_;
    return sg4::Engine::get_clock() - start;
  }

  const cluster::Cluster& c_;
  const plan::Plan& plan_;
  cluster::Placement placement_;
  PlatformSpec spec_;
  std::map<std::pair<std::int64_t, std::int64_t>, double> latency_;
  std::map<std::tuple<std::vector<std::int64_t>, CollectiveKind, std::uint64_t>, double> memo_;
  std::map<std::tuple<std::int64_t, std::int64_t, std::uint64_t>, double> p2p_memo_;
  std::uint64_t episodes_ = 0;
};

}  // namespace

std::unique_ptr<NetworkModel> make_simgrid(const cluster::Cluster& cluster,
                                           const plan::Plan& plan) {
  return std::make_unique<SimGridNetwork>(cluster, plan);
}

}  // namespace dtsim::network
