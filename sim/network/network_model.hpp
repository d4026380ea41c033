// How long communication takes: the interface the engine asks, and the analytical backend.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "sim/cluster/placement.hpp"
#include "sim/cluster/topology.hpp"
#include "sim/lower/program.hpp"
#include "sim/network/collectives.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::network {

class NetworkModel {
 public:
  virtual ~NetworkModel() = default;
  virtual std::string name() const = 0;
  // Seconds for one collective of `kind` over `group` with `bytes` (nccl-tests convention), in
  // a plan laid out as `placement` (whose groups of the same kind in the same pipeline stage
  // run with it).
  virtual double collective_s(const cluster::Placement& placement, const lower::Group& group,
                              lower::CollectiveKind kind, std::uint64_t bytes) = 0;
  // Seconds to send `bytes` from global rank `src` to `dst`, a hop between pipeline stages of
  // a plan laid out as `placement` (every rank of src's stage sends to its peer at once).
  virtual double p2p_s(const cluster::Placement& placement, std::int64_t src, std::int64_t dst,
                       std::uint64_t bytes) = 0;
};

// The analytical backend (alpha-beta). For a group it finds what the ranks cross on the cluster
// (cluster::group_span) and the bandwidth each rank gets:
// - inside a node, the device's link bandwidth and the intra-node latency;
// - across nodes, the node's NICs shared by the groups of the same kind that run at the same
//   time on that node (all of them, by symmetry: devices_per_node / k rings, k = the group's
//   ranks per node, each with one flow leaving the node); where the group spans leaf groups,
//   no more than its share of the leaf's links to the spine (its NICs over the
//   oversubscription), shared with the groups of its kind in its pipeline stage (a tied
//   embedding's: the first and last stage's), one flow per ring, every member's flow for an
//   all-to-all; on a torus, one link per direction. A pipeline hop sends every rank's flow
//   to its peer at once; across an oversubscribed spine it lasts as long as its stage's
//   slowest transfer.
// It then takes the fastest of ring, double binary tree and hierarchical algorithms for an
// all-reduce (as NCCL's tuner picks one), the ring for all-gather and reduce-scatter, direct
// sends for all-to-all. Traffic of different kinds at the same time (a pipeline send during a
// data-parallel all-reduce) does not slow each other here; the SimGrid backend models that.
std::unique_ptr<NetworkModel> make_analytical(const cluster::Cluster& cluster);

// The SimGrid backend (network/simgrid_network.cpp): each distinct collective or pipeline
// transfer is simulated as flows, together with all the groups of its kind that run at the same
// moment, on a flow-level platform of the cluster (network/platform.hpp). SimGrid allows one
// platform per process: a second cluster or plan in the same process is an UnsupportedError.
// Throws UnsupportedError for torus fabrics.
std::unique_ptr<NetworkModel> make_simgrid(const cluster::Cluster& cluster, const plan::Plan& plan);
// What to expect before a long SimGrid run, or nothing: where a pipeline stage holds more than
// 16,384 devices, a collective over all of them is that many flows at once (a ring per node
// member: k times more) and as many SimGrid actors, each with a stack of its own.
std::optional<std::string> simgrid_scale_note(const plan::Plan& plan);

}  // namespace dtsim::network
