#include "sim/network/platform.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "sim/cluster/placement.hpp"
#include "sim/common/error.hpp"

namespace dtsim::network {

using cluster::ParallelDim;

std::vector<std::vector<std::int64_t>> ring_channels(const std::vector<std::int64_t>& g,
                                                     std::int64_t devices_per_node, bool mesh) {
  std::vector<std::vector<std::int64_t>> nodes;  // members per node, in ring order
  for (std::int64_t r : g) {
    if (nodes.empty() || nodes.back().front() / devices_per_node != r / devices_per_node) {
      nodes.emplace_back();
    }
    nodes.back().push_back(r);
  }
  const std::size_t k = nodes.empty() ? 0 : nodes.front().size();
  const bool regular = nodes.size() > 1 && k > 1 &&
                       std::all_of(nodes.begin(), nodes.end(),
                                   [&](const auto& members) { return members.size() == k; });
  if (!regular) return {g};
  // Ring c's order through a node's k members.
  std::vector<std::vector<std::size_t>> paths(k);
  for (std::size_t c = 0; c < k; ++c) {
    for (std::size_t i = 0; i < k; ++i) paths[c].push_back((c + i) % k);
  }
  if (mesh && k % 2 == 0) {
    const std::size_t half = k / 2;
    for (std::size_t c = 0; c < half; ++c) {
      auto& path = paths[c];
      for (std::size_t i = 1; i < k; ++i) {
        // c + 1, c - 1, c + 2, c - 2, ... (mod k), ending at c + k/2.
        path[i] = i % 2 == 1 ? (c + (i + 1) / 2) % k : (c + k - i / 2) % k;
      }
      paths[c + half].assign(path.rbegin(), path.rend());
    }
  }
  std::vector<std::vector<std::int64_t>> rings(k);
  for (std::size_t c = 0; c < k; ++c) {
    for (const auto& members : nodes) {
      for (std::size_t i : paths[c]) rings[c].push_back(members[i]);
    }
  }
  return rings;
}

std::set<std::pair<std::int64_t, std::int64_t>> plan_pairs(const plan::Plan& plan,
                                                           const cluster::Cluster& c) {
  const std::int64_t devices_per_node = c.devices_per_node;
  const bool mesh = cluster::is_mesh(c.intra.fabric);
  const cluster::Placement placement(plan.degrees(), plan.order);
  std::set<std::pair<std::int64_t, std::int64_t>> pairs;
  auto ring = [&](const std::vector<std::int64_t>& g) {
    if (g.size() < 2) return;
    for (const auto& channel : ring_channels(g, devices_per_node, mesh)) {
      for (std::size_t i = 0; i < channel.size(); ++i) {
        pairs.emplace(channel[i], channel[(i + 1) % channel.size()]);
      }
    }
  };
  // Each group is walked once: from its first (smallest) rank.
  const std::int64_t ranks = plan.devices();
  for (std::int64_t r = 0; r < ranks; ++r) {
    if (placement.first_of_group(ParallelDim::Tp, r)) ring(placement.group(ParallelDim::Tp, r));
    if (placement.first_of_group(ParallelDim::Cp, r)) ring(placement.group(ParallelDim::Cp, r));
    if (placement.first_of_gradient_group(r)) ring(placement.gradient_group(r));
    if (placement.first_of_expert_gradient_group(r)) ring(placement.expert_gradient_group(r));
    if (placement.first_of_group(ParallelDim::Ep, r)) {
      const auto ep = placement.group(ParallelDim::Ep, r);
      for (std::int64_t a : ep) {
        for (std::int64_t b : ep) {
          if (a != b) pairs.emplace(a, b);
        }
      }
    }
    if (placement.first_of_group(ParallelDim::Pp, r) && plan.pp > 1) {
      const auto pp = placement.group(ParallelDim::Pp, r);
      for (std::size_t i = 0; i + 1 < pp.size(); ++i) {
        pairs.emplace(pp[i], pp[i + 1]);
        pairs.emplace(pp[i + 1], pp[i]);
      }
      // Interleaved schedules and tied embeddings: the last stage talks to the first.
      pairs.emplace(pp.back(), pp.front());
      pairs.emplace(pp.front(), pp.back());
    }
  }
  if (mesh) pairs.merge(node_pairs(c));
  return pairs;
}

std::set<std::pair<std::int64_t, std::int64_t>> all_pairs(std::int64_t devices) {
  std::set<std::pair<std::int64_t, std::int64_t>> pairs;
  for (std::int64_t a = 0; a < devices; ++a) {
    for (std::int64_t b = 0; b < devices; ++b) {
      if (a != b) pairs.emplace(a, b);
    }
  }
  return pairs;
}

PlatformSpec build_platform(const cluster::Cluster& c,
                            const std::set<std::pair<std::int64_t, std::int64_t>>& pairs) {
  const auto fabric = c.inter.fabric;
  if (fabric == cluster::InterFabric::Torus3d) {
    throw UnsupportedError(fmt::format(
        "cluster {} ({}) is a torus, which the flow-level (SimGrid) platform does not describe "
        "yet; use the analytical network model",
        c.name, c.file));
  }
  PlatformSpec spec;
  const std::int64_t n = c.devices();
  const std::int64_t dpn = c.devices_per_node;
  for (std::int64_t d = 0; d < n; ++d) spec.hosts.push_back(fmt::format("dev{}", d));
  auto add_link = [&](std::string name, double bw, double lat) {
    spec.links.push_back({std::move(name), bw, lat});
    return spec.links.size() - 1;
  };
  const double port_bw = c.intra.effective_bw();
  const double port_lat = c.intra.latency_s.value / 2;
  const bool mesh = cluster::is_mesh(c.intra.fabric) && c.node_size() > 1;
  std::vector<std::size_t> tx(static_cast<std::size_t>(n)), rx(static_cast<std::size_t>(n));
  if (!mesh) {
    for (std::int64_t d = 0; d < n; ++d) {
      tx[static_cast<std::size_t>(d)] =
          add_link(fmt::format("dev{}_port_tx", d), port_bw, port_lat);
      rx[static_cast<std::size_t>(d)] =
          add_link(fmt::format("dev{}_port_rx", d), port_bw, port_lat);
    }
  }
  // On a mesh, the direct link of each ordered pair that talks: a device's bandwidth spread
  // over the whole node's other devices.
  const double pair_bw = mesh ? port_bw / static_cast<double>(c.node_size() - 1) : 0.0;
  const bool networked = fabric != cluster::InterFabric::None && c.nodes > 1;
  // A node's NICs: one per device at most, each device's own NICs taken together when it has
  // several (nics_per_node / devices_per_node of them); devices share NICs when there are fewer.
  const std::int64_t nics =
      std::min(std::max<std::int64_t>(c.inter.nics_per_node, 1), std::max<std::int64_t>(dpn, 1));
  const double nics_per_device =
      std::max(1.0, static_cast<double>(c.inter.nics_per_node) / static_cast<double>(dpn));
  const std::int64_t per_leaf = c.inter.nodes_per_leaf > 0 ? c.inter.nodes_per_leaf : c.nodes;
  std::map<std::int64_t, std::size_t> nic_tx, nic_rx, leaf_up, leaf_down;
  if (networked) {
    const double nic_bw = c.inter.nic_bw_bytes_per_s.value * nics_per_device;
    const double nic_lat = c.inter.latency_s.value / 2;
    for (std::int64_t node = 0; node < c.nodes; ++node) {
      for (std::int64_t i = 0; i < nics; ++i) {
        nic_tx[node * nics + i] =
            add_link(fmt::format("node{}_nic{}_tx", node, i), nic_bw, nic_lat);
        nic_rx[node * nics + i] =
            add_link(fmt::format("node{}_nic{}_rx", node, i), nic_bw, nic_lat);
      }
    }
    const std::int64_t leaves = (c.nodes + per_leaf - 1) / per_leaf;
    const double uplink = static_cast<double>(per_leaf * c.inter.nics_per_node) *
                          c.inter.nic_bw_bytes_per_s.value / c.inter.oversubscription.value;
    for (std::int64_t l = 0; l < leaves && leaves > 1; ++l) {
      leaf_up[l] = add_link(fmt::format("leaf{}_up", l), uplink, 0);
      leaf_down[l] = add_link(fmt::format("leaf{}_down", l), uplink, 0);
    }
  }
  for (const auto& [a, b] : pairs) {
    DTSIM_ASSERT(a >= 0 && a < n && b >= 0 && b < n, "pair outside the cluster");
    std::vector<std::size_t> route;
    const std::int64_t na = a / dpn, nb = b / dpn;
    if (na == nb && mesh) {
      route = {add_link(fmt::format("dev{}_to_dev{}", a, b), pair_bw, 2 * port_lat)};
    } else if (na == nb) {
      route = {tx[static_cast<std::size_t>(a)], rx[static_cast<std::size_t>(b)]};
    } else {
      DTSIM_ASSERT(networked, "nodes without a network");
      // On a PCIe node the device's link to the node is the way to its NIC too.
      const bool pcie = c.intra.fabric == cluster::IntraFabric::Pcie && !mesh;
      if (pcie) route.push_back(tx[static_cast<std::size_t>(a)]);
      route.push_back(nic_tx.at(na * nics + (a % dpn) % nics));
      const std::int64_t la = na / per_leaf, lb = nb / per_leaf;
      if (la != lb) {
        route.push_back(leaf_up.at(la));
        route.push_back(leaf_down.at(lb));
      }
      route.push_back(nic_rx.at(nb * nics + (b % dpn) % nics));
      if (pcie) route.push_back(rx[static_cast<std::size_t>(b)]);
    }
    spec.routes.push_back({{a, b}, std::move(route)});
  }
  return spec;
}

std::set<std::pair<std::int64_t, std::int64_t>> node_pairs(const cluster::Cluster& c) {
  std::set<std::pair<std::int64_t, std::int64_t>> pairs;
  const std::int64_t dpn = c.devices_per_node;
  for (std::int64_t node = 0; node < c.nodes; ++node) {
    for (std::int64_t a = node * dpn; a < (node + 1) * dpn; ++a) {
      for (std::int64_t b = node * dpn; b < (node + 1) * dpn; ++b) {
        if (a != b) pairs.emplace(a, b);
      }
    }
  }
  return pairs;
}

std::string platform_xml(const PlatformSpec& spec) {
  std::string xml =
      "<?xml version='1.0'?>\n"
      "<!DOCTYPE platform SYSTEM \"https://simgrid.org/simgrid.dtd\">\n"
      "<!-- written by dtsim export-platform; bandwidths in Bps, latencies in s -->\n"
      "<platform version=\"4.1\">\n  <zone id=\"cluster\" routing=\"Full\">\n";
  for (const auto& h : spec.hosts) xml += fmt::format("    <host id=\"{}\" speed=\"1Gf\"/>\n", h);
  for (const auto& l : spec.links) {
    xml += fmt::format("    <link id=\"{}\" bandwidth=\"{:.6g}Bps\" latency=\"{:.6g}s\"/>\n",
                       l.name, l.bw_bytes_per_s, l.latency_s);
  }
  for (const auto& [pair, links] : spec.routes) {
    xml += fmt::format("    <route src=\"{}\" dst=\"{}\" symmetrical=\"NO\">",
                       spec.hosts[static_cast<std::size_t>(pair.first)],
                       spec.hosts[static_cast<std::size_t>(pair.second)]);
    for (std::size_t i : links) xml += fmt::format("<link_ctn id=\"{}\"/>", spec.links[i].name);
    xml += "</route>\n";
  }
  xml += "  </zone>\n</platform>\n";
  return xml;
}

}  // namespace dtsim::network
