// Alpha-beta costs of collective algorithms (Thakur, Rabenseifner & Gropp 2005; Patarasuk &
// Yuan 2009 for the bandwidth-optimal ring; NCCL's double binary trees, Sanders et al. 2009).
// `bytes` follows nccl-tests: the all-reduce buffer, the all-gather output (n pieces), the
// reduce-scatter input (n pieces), the all-to-all send buffer.
#pragma once

#include <cstdint>

namespace dtsim::network {

struct Link {
  double bw_bytes_per_s = 0;  // per rank, per direction, on the slowest hop
  double latency_s = 0;       // per step on the slowest hop
};

// Ring all-reduce: reduce-scatter then all-gather, 2(n-1) steps of bytes/n:
// 2(n-1)/n · S/B + 2(n-1)·α.
double ring_all_reduce_s(double bytes, int n, Link link);
// Ring all-gather or reduce-scatter: (n-1)/n · S/B + (n-1)·α.
double ring_all_gather_s(double bytes, int n, Link link);
// Double binary tree all-reduce (NCCL): pipelined reduce up and broadcast down two trees that
// each carry half the data, about 2·S/B on the bandwidth side (each rank sends and receives
// each byte twice over its links), on the slower of the two links. The trees span the `nodes`
// nodes, and inside a node the `local` ranks form a chain: latency 2·((local - 1)·α inside +
// ceil(log2 nodes)·α across). NCCL builds no tree inside a single node (0 there: none).
double node_tree_all_reduce_s(double bytes, int local, int nodes, Link intra, Link inter);
// Hierarchical all-reduce: reduce-scatter inside each node (k ranks), all-reduce of 1/k of the
// data across `nodes` (each of the k ranks in its own ring), all-gather inside the node.
double hierarchical_all_reduce_s(double bytes, int k, int nodes, Link intra, Link inter);
// Direct all-to-all: every rank sends S/n to each other rank at once; `local` of them share the
// node (intra link), the rest cross the network.
double direct_all_to_all_s(double bytes, int n, int local, Link intra, Link inter);
// Point-to-point: S/B + α.
double p2p_s(double bytes, Link link);

}  // namespace dtsim::network
