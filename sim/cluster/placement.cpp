#include "sim/cluster/placement.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <map>
#include <set>

#include "sim/common/error.hpp"

namespace dtsim::cluster {

namespace {
constexpr std::array<ParallelDim, 5> kAllDims = {ParallelDim::Tp, ParallelDim::Cp, ParallelDim::Ep,
                                                 ParallelDim::Dp, ParallelDim::Pp};
std::size_t idx(ParallelDim d) {
  return static_cast<std::size_t>(d);
}
}  // namespace

std::string_view to_string(ParallelDim dim) {
  switch (dim) {
    case ParallelDim::Tp:
      return "tp";
    case ParallelDim::Cp:
      return "cp";
    case ParallelDim::Ep:
      return "ep";
    case ParallelDim::Dp:
      return "dp";
    case ParallelDim::Pp:
      return "pp";
  }
  return "?";
}

std::vector<ParallelDim> Placement::default_order() {
  return {ParallelDim::Tp, ParallelDim::Cp, ParallelDim::Ep, ParallelDim::Dp, ParallelDim::Pp};
}

std::vector<ParallelDim> Placement::parse_order(std::string_view text) {
  std::vector<ParallelDim> order;
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find('-', start), text.size());
    const std::string_view part = text.substr(start, end - start);
    bool found = false;
    for (ParallelDim d : kAllDims) {
      if (cluster::to_string(d) == part) {
        order.push_back(d);
        found = true;
      }
    }
    if (!found) {
      throw InputError(fmt::format(
          "order \"{}\": unknown dimension \"{}\" (expected a permutation of tp-cp-ep-dp-pp, "
          "fastest first)",
          text, part));
    }
    start = end + 1;
  }
  std::set<ParallelDim> unique(order.begin(), order.end());
  if (order.size() != 5 || unique.size() != 5) {
    throw InputError(fmt::format(
        "order \"{}\": expected each of tp, cp, ep, dp, pp exactly once, fastest first", text));
  }
  return order;
}

std::string Placement::to_string(const std::vector<ParallelDim>& order) {
  std::vector<std::string_view> parts;
  for (ParallelDim d : order) parts.push_back(cluster::to_string(d));
  return fmt::format("{}", fmt::join(parts, "-"));
}

Placement::Placement(ParallelDegrees degrees, std::vector<ParallelDim> order)
    : degrees_(degrees), order_(std::move(order)) {
  if (degrees_.tp < 1 || degrees_.cp < 1 || degrees_.ep < 1 || degrees_.dp < 1 || degrees_.pp < 1) {
    throw InputError("parallel degrees must be positive");
  }
  if (degrees_.dp % degrees_.ep != 0) {
    throw InputError(
        fmt::format("ep = {} must divide dp = {} (expert parallelism lives inside "
                    "data parallelism)",
                    degrees_.ep, degrees_.dp));
  }
  std::set<ParallelDim> unique(order_.begin(), order_.end());
  DTSIM_ASSERT(order_.size() == 5 && unique.size() == 5, "order must be a permutation");
  std::int64_t stride = 1;
  for (ParallelDim d : order_) {
    stride_[idx(d)] = stride;
    stride *= extent(d);
  }
}

int Placement::extent(ParallelDim dim) const {
  switch (dim) {
    case ParallelDim::Tp:
      return degrees_.tp;
    case ParallelDim::Cp:
      return degrees_.cp;
    case ParallelDim::Ep:
      return degrees_.ep;
    case ParallelDim::Dp:
      return degrees_.dp / degrees_.ep;
    case ParallelDim::Pp:
      return degrees_.pp;
  }
  return 1;
}

int Placement::coord(const RankCoords& c, ParallelDim dim) const {
  switch (dim) {
    case ParallelDim::Tp:
      return c.tp;
    case ParallelDim::Cp:
      return c.cp;
    case ParallelDim::Ep:
      return c.ep;
    case ParallelDim::Dp:
      return c.dp_outer;
    case ParallelDim::Pp:
      return c.pp;
  }
  return 0;
}

RankCoords Placement::coords(std::int64_t rank) const {
  DTSIM_ASSERT(rank >= 0 && rank < degrees_.ranks(), fmt::format("rank {} out of range", rank));
  auto get = [&](ParallelDim d) { return static_cast<int>((rank / stride_[idx(d)]) % extent(d)); };
  return RankCoords{get(ParallelDim::Tp), get(ParallelDim::Cp), get(ParallelDim::Ep),
                    get(ParallelDim::Dp), get(ParallelDim::Pp)};
}

std::int64_t Placement::rank(const RankCoords& c) const {
  std::int64_t r = 0;
  for (ParallelDim d : kAllDims) {
    DTSIM_ASSERT(coord(c, d) >= 0 && coord(c, d) < extent(d), "coordinate out of range");
    r += coord(c, d) * stride_[idx(d)];
  }
  return r;
}

std::vector<std::int64_t> Placement::group(ParallelDim dim, std::int64_t rank) const {
  const RankCoords base = coords(rank);
  std::vector<std::int64_t> out;
  auto with = [&](RankCoords c) { out.push_back(this->rank(c)); };
  switch (dim) {
    case ParallelDim::Tp:
      for (int i = 0; i < degrees_.tp; ++i) with({i, base.cp, base.ep, base.dp_outer, base.pp});
      break;
    case ParallelDim::Cp:
      for (int i = 0; i < degrees_.cp; ++i) with({base.tp, i, base.ep, base.dp_outer, base.pp});
      break;
    case ParallelDim::Ep:
      for (int i = 0; i < degrees_.ep; ++i) with({base.tp, base.cp, i, base.dp_outer, base.pp});
      break;
    case ParallelDim::Dp:
      for (int o = 0; o < extent(ParallelDim::Dp); ++o) {
        for (int e = 0; e < degrees_.ep; ++e) with({base.tp, base.cp, e, o, base.pp});
      }
      break;
    case ParallelDim::Pp:
      for (int i = 0; i < degrees_.pp; ++i) with({base.tp, base.cp, base.ep, base.dp_outer, i});
      break;
  }
  return out;
}

std::vector<std::int64_t> Placement::ranks_varying(
    std::int64_t rank, std::initializer_list<ParallelDim> varying) const {
  // From the group's first rank (the varying coordinates 0), the dimensions fastest first: each
  // repeats what the faster ones made at its stride, which exceeds all their span (a mixed
  // radix), so each copy follows the one before.
  const RankCoords base = coords(rank);
  std::int64_t first = rank;
  std::vector<ParallelDim> dims;
  for (ParallelDim d : order_) {
    if (std::find(varying.begin(), varying.end(), d) == varying.end()) continue;
    first -= static_cast<std::int64_t>(coord(base, d)) * stride_[idx(d)];
    dims.push_back(d);
  }
  std::int64_t size = 1;
  for (ParallelDim d : dims) size *= extent(d);
  std::vector<std::int64_t> out;
  out.reserve(static_cast<std::size_t>(size));
  out.push_back(first);
  for (ParallelDim d : dims) {
    const std::size_t made = out.size();
    for (int i = 1; i < extent(d); ++i) {
      const std::int64_t step = i * stride_[idx(d)];
      for (std::size_t j = 0; j < made; ++j) out.push_back(out[j] + step);
    }
  }
  return out;
}

std::vector<std::int64_t> Placement::gradient_group(std::int64_t rank) const {
  return ranks_varying(rank, {ParallelDim::Cp, ParallelDim::Dp, ParallelDim::Ep});
}

std::vector<std::int64_t> Placement::expert_gradient_group(std::int64_t rank) const {
  return ranks_varying(rank, {ParallelDim::Cp, ParallelDim::Dp});
}

bool Placement::first_of_group(ParallelDim dim, std::int64_t rank) const {
  const RankCoords c = coords(rank);
  switch (dim) {
    case ParallelDim::Tp:
      return c.tp == 0;
    case ParallelDim::Cp:
      return c.cp == 0;
    case ParallelDim::Ep:
      return c.ep == 0;
    case ParallelDim::Dp:
      return c.ep == 0 && c.dp_outer == 0;
    case ParallelDim::Pp:
      return c.pp == 0;
  }
  return false;
}

bool Placement::first_of_gradient_group(std::int64_t rank) const {
  const RankCoords c = coords(rank);
  return c.cp == 0 && c.ep == 0 && c.dp_outer == 0;
}

bool Placement::first_of_expert_gradient_group(std::int64_t rank) const {
  const RankCoords c = coords(rank);
  return c.cp == 0 && c.dp_outer == 0;
}

std::vector<std::int64_t> Placement::stage_ranks(int stage) const {
  RankCoords c;
  c.pp = stage;
  return ranks_varying(rank(c),
                       {ParallelDim::Tp, ParallelDim::Cp, ParallelDim::Ep, ParallelDim::Dp});
}

bool Placement::symmetric_on(std::int64_t devices_per_node) const {
  std::int64_t product = 1;
  for (ParallelDim d : order_) {
    product *= extent(d);
    if (devices_per_node % product != 0 && product % devices_per_node != 0) return false;
  }
  return true;
}

std::int64_t torus_hops(std::span<const std::int64_t> dims, std::int64_t a, std::int64_t b) {
  // Shortest path on a torus: per dimension min(|a-b|, n-|a-b|), summed; x fastest.
  std::int64_t hops = 0;
  for (const std::int64_t n : dims) {
    const std::int64_t diff = std::abs(a % n - b % n);
    hops += std::min(diff, n - diff);
    a /= n;
    b /= n;
  }
  return hops;
}

std::int64_t torus_diameter(std::span<const std::int64_t> dims,
                            std::span<const std::int64_t> devices) {
  const auto members = static_cast<double>(devices.size());
  double cells = 1;
  double line_work = 0;  // per cell, one pass along each dimension
  for (const std::int64_t n : dims) {
    cells *= static_cast<double>(n);
    line_work += static_cast<double>(n);
  }
  if (members * (members - 1) / 2 <= cells * line_work) {
    // Few members: every pair.
    std::int64_t most = 0;
    for (std::size_t i = 0; i < devices.size(); ++i) {
      for (std::size_t j = i + 1; j < devices.size(); ++j) {
        most = std::max(most, torus_hops(dims, devices[i], devices[j]));
      }
    }
    return most;
  }
  // Many members: the farthest member from every cell, one dimension at a time (the distance is
  // a sum over dimensions, so the max-plus transform separates), then the largest at a member.
  // Exact, as the pairs are; in cells x (sum of the sizes) steps instead of members^2 / 2.
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::min() / 4;
  const auto size = static_cast<std::size_t>(cells);
  std::vector<std::int64_t> far(size, kNone);
  for (const std::int64_t d : devices) far[static_cast<std::size_t>(d)] = 0;
  std::vector<std::int64_t> line;
  std::int64_t stride = 1;
  for (const std::int64_t n : dims) {
    line.resize(static_cast<std::size_t>(n));
    const std::int64_t block = stride * n;
    for (std::int64_t base = 0; base < static_cast<std::int64_t>(size); base += block) {
      for (std::int64_t offset = 0; offset < stride; ++offset) {
        const auto at = [&](std::int64_t k) {
          return static_cast<std::size_t>(base + offset + k * stride);
        };
        for (std::int64_t i = 0; i < n; ++i) {
          std::int64_t best = kNone;
          for (std::int64_t j = 0; j < n; ++j) {
            if (far[at(j)] == kNone) continue;
            const std::int64_t diff = std::abs(i - j);
            best = std::max(best, far[at(j)] + std::min(diff, n - diff));
          }
          line[static_cast<std::size_t>(i)] = best;
        }
        for (std::int64_t i = 0; i < n; ++i) far[at(i)] = line[static_cast<std::size_t>(i)];
      }
    }
    stride = block;
  }
  std::int64_t most = 0;
  for (const std::int64_t d : devices) most = std::max(most, far[static_cast<std::size_t>(d)]);
  return most;
}

GroupSpan group_span(const Cluster& cluster, std::span<const std::int64_t> devices) {
  GroupSpan span;
  span.devices = static_cast<std::int64_t>(devices.size());
  const std::int64_t dpn = cluster.devices_per_node;
  std::map<std::int64_t, std::int64_t> per_node;
  std::set<std::int64_t> leaves;
  std::set<std::int64_t> locals;
  for (std::int64_t d : devices) {
    DTSIM_ASSERT(d >= 0 && d < cluster.devices(), fmt::format("device {} not in cluster", d));
    const std::int64_t node = d / dpn;
    ++per_node[node];
    locals.insert(d % dpn);
    if (cluster.inter.nodes_per_leaf > 0) leaves.insert(node / cluster.inter.nodes_per_leaf);
  }
  span.nodes = static_cast<std::int64_t>(per_node.size());
  for (const auto& [node, count] : per_node) {
    span.max_devices_per_node = std::max(span.max_devices_per_node, count);
  }
  span.leaf_groups = leaves.empty() ? 1 : static_cast<std::int64_t>(leaves.size());
  span.intra_node_only = span.nodes <= 1;
  span.single_rail = locals.size() <= 1;

  if (span.max_devices_per_node > 1) {
    span.crossed.push_back(fmt::format("intra-node {}", to_string(cluster.intra.fabric)));
  }
  const InterFabric fabric = cluster.inter.fabric;
  if (fabric == InterFabric::Torus3d && span.devices > 1) {
    const auto& dims = cluster.inter.torus_dims;
    span.max_torus_hops = torus_diameter(dims, devices);
    for (std::size_t i = 0; i < devices.size(); ++i) {
      span.max_ring_hops = std::max(
          span.max_ring_hops, torus_hops(dims, devices[i], devices[(i + 1) % devices.size()]));
    }
    span.crossed.push_back(fmt::format("{} torus links (up to {} hops)",
                                       to_string(cluster.inter.transport), span.max_torus_hops));
  } else if (!span.intra_node_only) {
    span.crossed.push_back(fmt::format("NIC ({})", to_string(cluster.inter.transport)));
    if (fabric == InterFabric::RailOptimized) {
      span.crossed.push_back(span.single_rail ? "rail (leaf) switch" : "leaf switches");
      span.crosses_spine = span.leaf_groups > 1 || !span.single_rail;
    } else if (fabric == InterFabric::FatTree) {
      span.crossed.push_back("leaf switch");
      span.crosses_spine = span.leaf_groups > 1;
    } else if (fabric == InterFabric::Dragonfly) {
      span.crossed.push_back("dragonfly group switch");
      span.crosses_spine = span.leaf_groups > 1;
    }
    if (span.crosses_spine) {
      span.crossed.push_back(fabric == InterFabric::Dragonfly ? "dragonfly global links"
                                                              : "spine switch");
    }
  }
  return span;
}

}  // namespace dtsim::cluster
