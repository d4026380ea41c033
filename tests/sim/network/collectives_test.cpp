#include "sim/network/collectives.hpp"

#include <fmt/format.h>

#include <map>
#include <set>
#include <string>

#include "sim/cluster/placement.hpp"
#include "sim/cluster/topology.hpp"
#include "sim/network/network_model.hpp"
#include "sim/network/platform.hpp"
#include "tests/test_util.hpp"

using dtsim::network::Link;

namespace {
// A pipeline of two stages of one rank: the layout of a pair's transfers.
const dtsim::cluster::Placement kPair({.pp = 2});
// A layout of one stage: where no oversubscribed spine is crossed, a collective's time does
// not depend on the layout.
const dtsim::cluster::Placement kOneStage({.dp = 1024});

// A test cluster of `nodes` nodes of 8 A100s, each with 8 NICs of 25 GB/s (latency 4 us), in
// leaves of `per_leaf` nodes under a spine oversubscribed 4:1: a leaf's uplink carries
// per_leaf x 8 x 25 / 4 GB/s.
dtsim::cluster::Cluster leaf_cluster(const std::string& name, int nodes, int per_leaf,
                                     const std::string& fabric = "fat_tree") {
  const dtsim::test::TempFile file(name + ".json", fmt::format(R"({{
    "name": "{}", "description": "test", "source": "test",
    "device": "a100-sxm4-80gb", "nodes": {}, "devices_per_node": 8,
    "intra_node": {{"fabric": "nvswitch", "latency_s": {{"value": 2e-6, "source": "test"}}}},
    "inter_node": {{"fabric": "{}", "transport": "infiniband", "nics_per_node": 8,
      "nic_bw_bytes_per_s": {{"value": 25e9, "source": "test"}},
      "latency_s": {{"value": 4e-6, "source": "test"}}, "nodes_per_leaf": {},
      "oversubscription": {{"value": 4, "source": "test"}}}}}})",
                                                               name, nodes, fabric, per_leaf));
  return dtsim::cluster::load_cluster(file.path());
}
}  // namespace

TEST_CASE("ring collectives take their alpha-beta time exactly", "[network]") {
  const Link link{100e9, 5e-6};  // B = 100 GB/s, alpha = 5 us
  for (int n : {2, 4, 8, 64, 1024}) {
    for (double s : {1e3, 1e6, 1.0737e9}) {
      // Ring all-reduce: 2(n-1)/n · S/B + 2(n-1)·alpha.
      CHECK(dtsim::network::ring_all_reduce_s(s, n, link) ==
            2.0 * (n - 1) / n * s / link.bw_bytes_per_s + 2.0 * (n - 1) * link.latency_s);
      // All-gather and reduce-scatter: (n-1)/n · S/B + (n-1)·alpha.
      CHECK(dtsim::network::ring_all_gather_s(s, n, link) ==
            (n - 1.0) / n * s / link.bw_bytes_per_s + (n - 1.0) * link.latency_s);
    }
  }
  CHECK(dtsim::network::ring_all_reduce_s(1e9, 1, link) == 0);
}

TEST_CASE("the analytical model uses the links a group crosses", "[network]") {
  const auto c = dtsim::cluster::load_cluster("default");  // 4 DGX A100, 8 x 200 Gb/s HDR each
  auto model = dtsim::network::make_analytical(c);
  // What collectives reach on NVLink: NCCL's 20 of the link's 25 GB/s (device catalog).
  const double nvlink = c.intra.effective_bw();
  CHECK(nvlink == Approx(0.8 * c.intra.bw_bytes_per_s.value));
  const double alpha = c.intra.latency_s.value;
  const double s = 1024.0 * 1024 * 1024;
  SECTION("inside a node: NVSwitch ring (bandwidth-bound, so the ring is the fastest)") {
    dtsim::lower::Group tp{dtsim::lower::GroupKind::Tp, {0, 1, 2, 3, 4, 5, 6, 7}, {0}};
    CHECK(model->collective_s(kOneStage, tp, dtsim::lower::CollectiveKind::AllReduce, 1ULL << 30) ==
          Approx(dtsim::network::ring_all_reduce_s(s, 8, Link{nvlink, alpha})).epsilon(1e-12));
  }
  SECTION("across nodes, one rank per node: each rank gets one NIC's share") {
    // 8 such groups leave every node at once, sharing its 8 NICs: 25 GB/s each.
    dtsim::lower::Group dp{dtsim::lower::GroupKind::Dp, {0, 8, 16, 24}, {0}};
    const Link nic{c.inter.nic_bw_bytes_per_s.value, c.inter.latency_s.value};
    CHECK(model->collective_s(kOneStage, dp, dtsim::lower::CollectiveKind::AllGather, 1ULL << 30) ==
          Approx(dtsim::network::ring_all_gather_s(s, 4, nic)).epsilon(1e-12));
  }
  SECTION("point to point inside and across nodes") {
    CHECK(model->p2p_s(kPair, 0, 1, 1 << 20) == Approx((1 << 20) / nvlink + alpha).epsilon(1e-12));
    CHECK(model->p2p_s(kPair, 0, 8, 1 << 20) ==
          Approx((1 << 20) / c.inter.nic_bw_bytes_per_s.value + c.inter.latency_s.value)
              .epsilon(1e-12));
  }
}

TEST_CASE("on a mesh of direct links a small group uses only its own links", "[network]") {
  // Gaudi2: 21 of 24 RoCE ports form an all-to-all mesh between the 8 chips of a node, so a
  // pair of chips shares 1/7 of a chip's scale-up bandwidth.
  const auto c = dtsim::cluster::load_cluster("gaudi2-cluster");
  auto model = dtsim::network::make_analytical(c);
  const double bw = c.intra.bw_bytes_per_s.value;
  const double alpha = c.intra.latency_s.value;
  CHECK(model->p2p_s(kPair, 0, 1, 1 << 20) == Approx((1 << 20) / (bw / 7) + alpha).epsilon(1e-12));
  dtsim::lower::Group node{dtsim::lower::GroupKind::Tp, {0, 1, 2, 3, 4, 5, 6, 7}, {0}};
  CHECK(model->collective_s(kOneStage, node, dtsim::lower::CollectiveKind::AllGather, 1ULL << 30) ==
        Approx(dtsim::network::ring_all_gather_s(1073741824.0, 8, Link{bw, alpha})).epsilon(1e-12));
}

TEST_CASE("part of a mesh node keeps the whole node's links", "[network]") {
  // --gpus 4 of an 8-chip Gaudi2 node: each chip still spreads its ports over 7 peers, so a
  // pair is as fast as in the whole node.
  const auto whole = dtsim::cluster::load_cluster("gaudi2-cluster");
  const auto part = dtsim::cluster::with_devices(whole, 4);
  CHECK(part.devices_per_node == 4);
  CHECK(part.node_size() == 8);
  auto a = dtsim::network::make_analytical(whole);
  auto b = dtsim::network::make_analytical(part);
  CHECK(b->p2p_s(kPair, 0, 1, 1 << 20) == Approx(a->p2p_s(kPair, 0, 1, 1 << 20)).epsilon(1e-12));
  const dtsim::lower::Group pair{dtsim::lower::GroupKind::Tp, {0, 1}, {0}};
  CHECK(b->collective_s(kOneStage, pair, dtsim::lower::CollectiveKind::AllReduce, 1 << 26) ==
        Approx(a->collective_s(kOneStage, pair, dtsim::lower::CollectiveKind::AllReduce, 1 << 26))
            .epsilon(1e-12));
}

TEST_CASE("a ring across leaves shares the uplinks with the groups of its leaf", "[network]") {
  // 4 nodes of 8 GPUs, 2 nodes per leaf, 8 x 25 GB/s NICs per node, uplinks oversubscribed 4:1:
  // a leaf's uplink carries 2 x 8 x 25 / 4 = 100 GB/s.
  const auto c = leaf_cluster("two_leaves_8", 4, 2);
  auto model = dtsim::network::make_analytical(c);
  const double s = 1 << 30;
  const double alpha = 4e-6;
  const dtsim::cluster::Placement tp8_dp4({.tp = 8, .dp = 4});
  // One rank per node, 8 such groups: each group's ring leaves a leaf once, 8 flows share the
  // 100 GB/s uplink (12.5 GB/s each, below a NIC's 25), not 25 / 4.
  const dtsim::lower::Group dp{dtsim::lower::GroupKind::Dp, {0, 8, 16, 24}, {0}};
  CHECK(model->collective_s(tp8_dp4, dp, dtsim::lower::CollectiveKind::AllGather, 1ULL << 30) ==
        Approx(dtsim::network::ring_all_gather_s(s, 4, Link{12.5e9, alpha})).epsilon(1e-12));
  // Inside one leaf nothing is shared: a NIC each.
  const dtsim::lower::Group near{dtsim::lower::GroupKind::Dp, {0, 8}, {0}};
  CHECK(model->collective_s(tp8_dp4, near, dtsim::lower::CollectiveKind::AllGather, 1ULL << 30) ==
        Approx(dtsim::network::ring_all_gather_s(s, 2, Link{25e9, alpha})).epsilon(1e-12));
  // A pipeline transfer across leaves: every device of the stage sends at once. Two stages of
  // a leaf each: the leaf's 16 flows share its uplink, 100 / 16 = 25 / 4 GB/s each.
  const double mib = 1 << 20;
  const dtsim::cluster::Placement two_stages({.dp = 16, .pp = 2});
  CHECK(model->p2p_s(two_stages, 0, 16, 1 << 20) == Approx(mib / 6.25e9 + alpha).epsilon(1e-12));
  CHECK(model->p2p_s(two_stages, 31, 15, 1 << 20) == Approx(mib / 6.25e9 + alpha).epsilon(1e-12));
  // Four stages of a node each: a hop between leaves is 8 flows, 100 / 8 = 12.5 GB/s (a NIC's
  // 25 would allow more); between the two nodes of a leaf, a NIC each.
  const dtsim::cluster::Placement four_stages({.dp = 8, .pp = 4});
  CHECK(model->p2p_s(four_stages, 8, 16, 1 << 20) == Approx(mib / 12.5e9 + alpha).epsilon(1e-12));
  CHECK(model->p2p_s(four_stages, 24, 0, 1 << 20) == Approx(mib / 12.5e9 + alpha).epsilon(1e-12));
  CHECK(model->p2p_s(four_stages, 0, 8, 1 << 20) == Approx(mib / 25e9 + alpha).epsilon(1e-12));
  // Stages of half a node (tp 4, pp 8): the hop from the second node's upper half to the third
  // node's lower half crosses with 4 flows (100 / 4 = 25 GB/s: a NIC's share binds).
  const dtsim::cluster::Placement eight_stages({.tp = 4, .pp = 8});
  CHECK(model->p2p_s(eight_stages, 12, 16, 1 << 20) == Approx(mib / 25e9 + alpha).epsilon(1e-12));
  // A tied embedding's all-reduce between the first stage and the last (node 0 and node 3):
  // the groups of its kind that run with it are those of the two stages, 8 in each leaf, not
  // 16 (100 / 8 = 12.5 GB/s for the one flow of each ring leaving the leaf).
  const dtsim::lower::Group tied{dtsim::lower::GroupKind::Pp, {0, 24}, {0}};
  CHECK(
      model->collective_s(four_stages, tied, dtsim::lower::CollectiveKind::AllReduce, 1ULL << 30) ==
      Approx(dtsim::network::ring_all_reduce_s(s, 2, Link{12.5e9, alpha})).epsilon(1e-12));
  CHECK(model->collective_s(tp8_dp4, tied, dtsim::lower::CollectiveKind::AllReduce, 1ULL << 30) ==
        Approx(dtsim::network::ring_all_reduce_s(s, 2, Link{6.25e9, alpha})).epsilon(1e-12));
}

TEST_CASE("on a rail-optimized fabric a hop across rails inside a leaf pays the spine",
          "[network]") {
  // Rails meet at the spine: a transfer from one rail to another goes up even inside a leaf,
  // and every device of the leaf may send at once (25 / 4 GB/s), as before the hops between
  // leaves were counted.
  const auto c = leaf_cluster("rails_two_leaves", 4, 2, "rail_optimized");
  auto model = dtsim::network::make_analytical(c);
  const dtsim::cluster::Placement stages({.tp = 4, .pp = 8});
  const double mib = 1 << 20;
  CHECK(model->p2p_s(stages, 4, 8, 1 << 20) == Approx(mib / 6.25e9 + 4e-6).epsilon(1e-12));
}

TEST_CASE("a pipeline hop takes as long as its stage's slowest transfer", "[network]") {
  // 6 nodes of 8 GPUs, 3 per leaf, uplinks 3 x 8 x 25 / 4 = 150 GB/s; stages of two nodes, so
  // that stage 1 straddles the leaves.
  const auto c = leaf_cluster("three_per_leaf", 6, 3);
  auto model = dtsim::network::make_analytical(c);
  const double mib = 1 << 20, alpha = 4e-6;
  const dtsim::cluster::Placement stages({.dp = 16, .pp = 3});
  // Hop 0 -> 1: node 0 to node 2 stays in leaf 0, node 1 to node 3 crosses with 8 flows (150 /
  // 8 = 18.75 GB/s): rank 0's own transfer, which does not cross, waits as long, as the
  // SimGrid backend times the hop by its last flow.
  CHECK(model->p2p_s(stages, 0, 16, 1 << 20) == Approx(mib / 18.75e9 + alpha).epsilon(1e-12));
  CHECK(model->p2p_s(stages, 8, 24, 1 << 20) == Approx(mib / 18.75e9 + alpha).epsilon(1e-12));
  // The interleaved schedule's hop from the last stage to the first: both of its nodes cross,
  // 16 flows on leaf 1's uplink (9.375 GB/s).
  CHECK(model->p2p_s(stages, 32, 0, 1 << 20) == Approx(mib / 9.375e9 + alpha).epsilon(1e-12));
}

TEST_CASE("NCCL's tree spans nodes, and inside one node the ring is the algorithm", "[network]") {
  const auto c = dtsim::cluster::load_cluster("default");  // 4 nodes of 8 A100
  auto model = dtsim::network::make_analytical(c);
  const Link nvlink{c.intra.effective_bw(), c.intra.latency_s.value};
  const Link nic{c.inter.nic_bw_bytes_per_s.value, c.inter.latency_s.value};
  // A small all-reduce inside a node: the ring's 2 x 7 latency steps (no tree inside a node).
  const dtsim::lower::Group tp{dtsim::lower::GroupKind::Tp, {0, 1, 2, 3, 4, 5, 6, 7}, {0}};
  CHECK(model->collective_s(kOneStage, tp, dtsim::lower::CollectiveKind::AllReduce, 4096) ==
        Approx(dtsim::network::ring_all_reduce_s(4096, 8, nvlink)).epsilon(1e-12));
  // Across the 4 nodes, one rank each: the tree's 2 x log2(4) steps beat the ring's 2 x 3.
  const dtsim::lower::Group dp{dtsim::lower::GroupKind::Dp, {0, 8, 16, 24}, {0}};
  CHECK(model->collective_s(kOneStage, dp, dtsim::lower::CollectiveKind::AllReduce, 4096) ==
        Approx(dtsim::network::node_tree_all_reduce_s(4096, 1, 4, nvlink, nic)).epsilon(1e-12));
  CHECK(dtsim::network::node_tree_all_reduce_s(4096, 1, 4, nvlink, nic) ==
        Approx(2.0 * 4096 / nic.bw_bytes_per_s + 2 * 2 * nic.latency_s));
  // Two ranks per node: a chain of 2 inside each node on the way up and down.
  CHECK(dtsim::network::node_tree_all_reduce_s(4096, 2, 4, nvlink, nic) ==
        Approx(2.0 * 4096 / std::min(nvlink.bw_bytes_per_s, nic.bw_bytes_per_s) +
               2 * (nvlink.latency_s + 2 * nic.latency_s)));
}

TEST_CASE("on a torus a ring's steps pay for the hops between neighbours", "[network]") {
  // TPU v4 slice: 4 x 4 x 4 chips, x fastest, a host holds one x row of 4. A group along y
  // takes one hop per step (the torus closes the ring); one strided by 2 in y takes two hops
  // per step, and the other group interleaved with it shares those links.
  const auto c = dtsim::cluster::load_cluster("tpu-v4-slice");
  auto model = dtsim::network::make_analytical(c);
  const double b = c.inter.link_bw_bytes_per_s.value;
  const double alpha = c.inter.latency_s.value;
  const double s = 1 << 26;
  using dtsim::lower::CollectiveKind;
  const dtsim::lower::Group line{dtsim::lower::GroupKind::Dp, {0, 4, 8, 12}, {0}};
  const dtsim::lower::Group strided{dtsim::lower::GroupKind::Dp, {0, 8}, {0}};
  CHECK(dtsim::cluster::group_span(c, line.ranks).max_ring_hops == 1);
  CHECK(dtsim::cluster::group_span(c, strided.ranks).max_ring_hops == 2);
  CHECK(model->collective_s(kOneStage, line, CollectiveKind::AllGather, 1 << 26) ==
        Approx(dtsim::network::ring_all_gather_s(s, 4, Link{b, alpha})).epsilon(1e-12));
  CHECK(model->collective_s(kOneStage, strided, CollectiveKind::AllGather, 1 << 26) ==
        Approx(dtsim::network::ring_all_gather_s(s, 2, Link{b / 2, 2 * alpha})).epsilon(1e-12));
}

// 2 nodes of 4 PCIe GPUs (25 GB/s each, what collectives reach) with 4 NICs of 50 GB/s each.
dtsim::cluster::Cluster pcie_cluster() {
  const dtsim::test::TempFile file("pcie_nodes.json", R"({
    "name": "pcie_nodes", "description": "test", "source": "test",
    "device": "a100-sxm4-80gb", "nodes": 2, "devices_per_node": 4,
    "intra_node": {"fabric": "pcie", "bw_bytes_per_s": {"value": 25e9, "source": "test"},
      "latency_s": {"value": 2e-6, "source": "test"}},
    "inter_node": {"fabric": "fat_tree", "transport": "infiniband", "nics_per_node": 4,
      "nic_bw_bytes_per_s": {"value": 50e9, "source": "test"},
      "latency_s": {"value": 4e-6, "source": "test"}, "nodes_per_leaf": 2,
      "oversubscription": {"value": 1, "source": "test"}}})");
  return dtsim::cluster::load_cluster(file.path());
}

TEST_CASE("on PCIe nodes a device's network traffic crosses its PCIe link too", "[network]") {
  // A member's share goes through its one PCIe link whether its next hop is in the node or
  // behind the NIC: an all-reduce over both nodes can go no faster than every member sending
  // 2(n-1)/n of the buffer at 25 GB/s (the NVLink rule, which gives the intra link k/(k-1) of
  // itself, made the reviewer's 8 x 4 L40S cluster's dp all-reduce 2x too fast).
  const auto c = pcie_cluster();
  auto model = dtsim::network::make_analytical(c);
  const double s = 1024.0 * 1024 * 1024, pcie = 25e9;
  const dtsim::lower::Group all{dtsim::lower::GroupKind::Dp, {0, 1, 2, 3, 4, 5, 6, 7}, {0}};
  const double floor = 2.0 * 7 / 8 * s / pcie;
  CHECK(model->collective_s(kOneStage, all, dtsim::lower::CollectiveKind::AllReduce, 1ULL << 30) >=
        floor);
  CHECK(model->collective_s(kOneStage, all, dtsim::lower::CollectiveKind::AllGather, 1ULL << 30) >=
        7.0 / 8 * s / pcie);
  // An all-to-all's pieces to the node and to the other node share the link.
  CHECK(model->collective_s(kOneStage, all, dtsim::lower::CollectiveKind::AllToAll, 1ULL << 30) >=
        7.0 / 8 * s / pcie);
  // A transfer to another node: the NIC's 50 GB/s, behind the device's 25.
  CHECK(model->p2p_s(kPair, 0, 4, 1 << 30) >= s / pcie);
  // The flow-level platform routes it through the device's port links as well.
  const auto spec = dtsim::network::build_platform(c, {{0, 4}});
  REQUIRE(spec.routes.size() == 1);
  std::vector<std::string> route;
  for (std::size_t i : spec.routes[0].second) route.push_back(spec.links[i].name);
  CHECK(route ==
        std::vector<std::string>{"dev0_port_tx", "node0_nic0_tx", "node1_nic0_rx", "dev4_port_rx"});
}

TEST_CASE("a group with several members per node runs one ring per member, as NCCL's channels",
          "[network]") {
  // 2 nodes of 4: ring c enters each node at its c-th member and leaves from another one, so
  // that each member's NIC carries one ring across nodes.
  const std::vector<std::int64_t> g = {0, 1, 2, 3, 4, 5, 6, 7};
  const auto rings = dtsim::network::ring_channels(g, 4, false);
  REQUIRE(rings.size() == 4);
  std::set<std::int64_t> leaving;
  for (const auto& ring : rings) {
    CHECK(std::set<std::int64_t>(ring.begin(), ring.end()).size() == 8);
    for (std::size_t i = 0; i < ring.size(); ++i) {
      const auto a = ring[i], b = ring[(i + 1) % ring.size()];
      if (a / 4 != b / 4 && a < 4) leaving.insert(a);
    }
  }
  CHECK(leaving == std::set<std::int64_t>{0, 1, 2, 3});
  // One member per node, or uneven nodes: the group's own ring.
  CHECK(dtsim::network::ring_channels({0, 4}, 4, false) ==
        std::vector<std::vector<std::int64_t>>{{0, 4}});
  CHECK(dtsim::network::ring_channels({0, 1, 4}, 4, false).size() == 1);
}

TEST_CASE("on a mesh node, a group's rings use each direct link once (Walecki's paths)",
          "[network]") {
  for (const std::int64_t k : {2, 4, 6, 8}) {
    // Three nodes of k devices, all in the group.
    std::vector<std::int64_t> g;
    for (std::int64_t d = 0; d < 3 * k; ++d) g.push_back(d);
    const auto rings = dtsim::network::ring_channels(g, k, true);
    REQUIRE(rings.size() == static_cast<std::size_t>(k));
    std::map<std::pair<std::int64_t, std::int64_t>, int> uses;  // inside node 1
    std::set<std::int64_t> entering, leaving;                   // node 1's members
    for (const auto& ring : rings) {
      CHECK(std::set<std::int64_t>(ring.begin(), ring.end()).size() == g.size());
      for (std::size_t i = 0; i < ring.size(); ++i) {
        const auto a = ring[i], b = ring[(i + 1) % ring.size()];
        if (a / k == 1 && b / k == 1) ++uses[{a, b}];
        if (a / k != 1 && b / k == 1) entering.insert(b);
        if (a / k == 1 && b / k != 1) leaving.insert(a);
      }
    }
    INFO("k = " << k);
    CHECK(uses.size() == static_cast<std::size_t>(k * (k - 1)));  // every directed link
    for (const auto& [link, n] : uses) CHECK(n == 1);
    CHECK(entering.size() == static_cast<std::size_t>(k));  // every member's NIC, once
    CHECK(leaving.size() == static_cast<std::size_t>(k));
  }
  // Odd k: the rotations, as through a switch.
  CHECK(dtsim::network::ring_channels({0, 1, 2, 3, 4, 5}, 3, true) ==
        dtsim::network::ring_channels({0, 1, 2, 3, 4, 5}, 3, false));
}

TEST_CASE("across an oversubscribed spine each of a group's flows takes its share of the uplink",
          "[network]") {
  // 4 nodes of 8 GPUs, 2 nodes per leaf, a leaf's uplink 100 GB/s (leaf_cluster).
  const auto c = leaf_cluster("two_leaves_flows", 4, 2);
  auto model = dtsim::network::make_analytical(c);
  const double s = 1 << 30, alpha = 4e-6;
  SECTION("the hierarchical all-reduce runs a ring per local rank across nodes") {
    // dp 32 over the 4 nodes: between nodes 8 rings (one per local rank) each leave the leaf,
    // 100 / 8 = 12.5 GB/s each (it was priced as one flow, at a NIC's 25).
    const dtsim::cluster::Placement dp32({.dp = 32});
    std::vector<std::int64_t> all(32);
    for (std::int64_t r = 0; r < 32; ++r) all[static_cast<std::size_t>(r)] = r;
    const dtsim::lower::Group dp{dtsim::lower::GroupKind::Dp, all, {0}};
    // The ring and the tree: one flow of the node's 200 GB/s per group, 100 through the
    // uplink; inside the node a member's link carries 7/8 of what it sends (8 channels).
    const Link intra{c.intra.effective_bw(), 2e-6};
    const Link channels{intra.bw_bytes_per_s * 8 / 7, 2e-6}, across{100e9, alpha};
    const double ring = dtsim::network::ring_all_reduce_s(
        s, 32, Link{std::min(channels.bw_bytes_per_s, 100e9), alpha});
    const double tree = dtsim::network::node_tree_all_reduce_s(s, 8, 4, channels, across);
    const double hierarchical =
        dtsim::network::hierarchical_all_reduce_s(s, 8, 4, intra, Link{12.5e9, alpha});
    const double t =
        model->collective_s(dp32, dp, dtsim::lower::CollectiveKind::AllReduce, 1ULL << 30);
    CHECK(t == Approx(std::min({ring, tree, hierarchical})).epsilon(1e-12));
    // (At a NIC's 25 GB/s the hierarchical one was the fastest, by a quarter.)
    CHECK(dtsim::network::hierarchical_all_reduce_s(s, 8, 4, intra, Link{25e9, alpha}) < 0.8 * t);
  }
  SECTION("an all-to-all's peers in the member's own leaf do not cross the spine") {
    // One member per node: of its 3 peers, 2 are in the other leaf. Through the NIC 3 pieces
    // at 25 GB/s; over the uplink, shared by the leaf's 16 devices (6.25 GB/s each), 2.
    const dtsim::cluster::Placement tp8_dp4({.tp = 8, .dp = 4});
    const dtsim::lower::Group ep{dtsim::lower::GroupKind::Ep, {0, 8, 16, 24}, {0}};
    const double piece = s / 4;
    CHECK(model->collective_s(tp8_dp4, ep, dtsim::lower::CollectiveKind::AllToAll, 1ULL << 30) ==
          Approx(std::max(3 * piece / 25e9, 2 * piece / 6.25e9) + alpha).epsilon(1e-12));
  }
}
