#include "sim/network/collectives.hpp"

#include <algorithm>
#include <cmath>

namespace dtsim::network {

double ring_all_reduce_s(double bytes, int n, Link link) {
  if (n <= 1) return 0;
  const double steps = 2.0 * (n - 1);
  return steps / n * bytes / link.bw_bytes_per_s + steps * link.latency_s;
}

double ring_all_gather_s(double bytes, int n, Link link) {
  if (n <= 1) return 0;
  const double steps = n - 1.0;
  return steps / n * bytes / link.bw_bytes_per_s + steps * link.latency_s;
}

double node_tree_all_reduce_s(double bytes, int local, int nodes, Link intra, Link inter) {
  if (nodes <= 1) return 0;
  const double bw =
      local > 1 ? std::min(intra.bw_bytes_per_s, inter.bw_bytes_per_s) : inter.bw_bytes_per_s;
  const double depth = std::ceil(std::log2(static_cast<double>(nodes)));
  return 2.0 * bytes / bw + 2.0 * ((local - 1) * intra.latency_s + depth * inter.latency_s);
}

double hierarchical_all_reduce_s(double bytes, int k, int nodes, Link intra, Link inter) {
  return ring_all_gather_s(bytes, k, intra) + ring_all_reduce_s(bytes / k, nodes, inter) +
         ring_all_gather_s(bytes, k, intra);
}

double direct_all_to_all_s(double bytes, int n, int local, Link intra, Link inter) {
  if (n <= 1) return 0;
  const double piece = bytes / n;
  const double intra_s = (local - 1) * piece / intra.bw_bytes_per_s + intra.latency_s;
  const double remote = n - local;
  const double inter_s = remote > 0 ? remote * piece / inter.bw_bytes_per_s + inter.latency_s : 0;
  return std::max(intra_s, inter_s);
}

double p2p_s(double bytes, Link link) {
  return bytes / link.bw_bytes_per_s + link.latency_s;
}

}  // namespace dtsim::network
