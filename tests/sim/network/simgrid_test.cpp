// The SimGrid backend against the analytical one. SimGrid allows one platform per process, so
// every check here shares one cluster and one plan (ctest runs each test case in its own
// process; keep SimGrid checks in this single test case).
#include <nlohmann/json.hpp>

#include "sim/common/error.hpp"
#include "sim/engine/simulator.hpp"
#include "sim/network/network_model.hpp"
#include "sim/network/platform.hpp"
#include "tests/test_util.hpp"

using dtsim::lower::CollectiveKind;
using dtsim::lower::Group;
using dtsim::lower::GroupKind;

TEST_CASE("SimGrid agrees with the analytical model, and shows contention", "[network][simgrid]") {
  // 4 nodes of 1 GPU, 2 nodes per leaf switch, leaf uplinks oversubscribed 2:1: a leaf's uplink
  // carries (2 nodes x 25 GB/s) / 2 = 25 GB/s to the spine.
  dtsim::test::TempFile file("two_leaves.json", R"({
    "name": "two_leaves", "description": "test", "source": "test",
    "device": "a100-sxm4-80gb", "nodes": 4, "devices_per_node": 1,
    "intra_node": {"fabric": "nvswitch", "latency_s": {"value": 2e-6, "source": "test"}},
    "inter_node": {"fabric": "fat_tree", "transport": "infiniband", "nics_per_node": 1,
      "nic_bw_bytes_per_s": {"value": 25e9, "source": "test"},
      "latency_s": {"value": 4e-6, "source": "test"}, "nodes_per_leaf": 2,
      "oversubscription": {"value": 2, "source": "test"}}})");
  const auto cluster = dtsim::cluster::load_cluster(file.path());
  // tp = 2 fastest: tp groups {0,1} and {2,3} stay inside a leaf; dp groups {0,2} and {1,3}
  // both cross from leaf 0 to leaf 1 through the same oversubscribed uplink.
  dtsim::plan::Plan plan;
  plan.tp = 2;
  plan.dp = 2;
  plan.seq_len = 32;
  plan.global_batch_size = 8;
  const auto spec = dtsim::model::load_model("tiny");
  dtsim::plan::require_valid(plan, spec, cluster.devices());

  auto simgrid = dtsim::network::make_simgrid(cluster, plan);
  const dtsim::cluster::Placement layout(plan.degrees(), plan.order);
  auto analytical = dtsim::network::make_analytical(cluster);
  const std::uint64_t bytes = 256ULL << 20;
  const Group tp{GroupKind::Tp, {0, 1}, {0}};
  const Group dp{GroupKind::Dp, {0, 2}, {0}};

  SECTION("where nothing contends, within 2%") {
    for (auto kind :
         {CollectiveKind::AllReduce, CollectiveKind::AllGather, CollectiveKind::ReduceScatter}) {
      const double s = simgrid->collective_s(layout, tp, kind, bytes);
      const double a = analytical->collective_s(layout, tp, kind, bytes);
      INFO("simgrid " << s << " s, analytical " << a << " s");
      CHECK(s == Approx(a).epsilon(0.02));
    }
    CHECK(simgrid->p2p_s(layout, 0, 1, bytes) ==
          Approx(analytical->p2p_s(layout, 0, 1, bytes)).epsilon(0.02));
  }
  SECTION("two dp groups through one oversubscribed uplink: slowdown, matched within 10%") {
    const double alone = simgrid->collective_s(layout, tp, CollectiveKind::AllReduce, bytes);
    const double shared = simgrid->collective_s(layout, dp, CollectiveKind::AllReduce, bytes);
    const double rule = analytical->collective_s(layout, dp, CollectiveKind::AllReduce, bytes);
    INFO("simgrid within a leaf " << alone << " s, across the shared uplink " << shared
                                  << " s; analytical sharing rule " << rule << " s");
    CHECK(shared > 1.8 * alone);  // each group gets half of the uplink
    CHECK(rule == Approx(shared).epsilon(0.10));
  }
  SECTION("a whole step runs on SimGrid") {
    const dtsim::model::ModelGraph g(spec, plan.micro_batch_size, plan.seq_len);
    const auto sim = dtsim::engine::simulate(g, plan, cluster, *simgrid);
    const auto ref = dtsim::engine::simulate(g, plan, cluster, *analytical);
    CHECK(sim.prediction.network == "simgrid");
    CHECK(sim.prediction.step_time_s > 0);
    CHECK(sim.prediction.step_time_s >= 0.9 * ref.prediction.step_time_s);
  }
}

TEST_CASE("the exported platform lists hosts, links and routes", "[network][platform]") {
  const auto cluster = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("default"), 16);
  const auto spec = dtsim::network::build_platform(cluster, dtsim::network::all_pairs(16));
  CHECK(spec.hosts.size() == 16);
  CHECK(spec.routes.size() == 16 * 15);
  // Inside a node: two device ports; across nodes: two NICs (a single leaf here).
  for (const auto& [pair, links] : spec.routes) {
    CHECK(links.size() == 2);
  }
  const std::string xml = dtsim::network::platform_xml(spec);
  CHECK(xml.find("<platform version=\"4.1\">") != std::string::npos);
  CHECK(xml.find("<route src=\"dev0\" dst=\"dev8\" symmetrical=\"NO\">"
                 "<link_ctn id=\"node0_nic0_tx\"/><link_ctn id=\"node1_nic0_rx\"/></route>") !=
        std::string::npos);
  // More NICs than devices (AWS p5: 32 for 8 GPUs): a device's 4 NICs are one link of their
  // summed bandwidth, as the analytical model counts them.
  const auto p5 = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("aws-p5"), 16);
  const auto p5_spec = dtsim::network::build_platform(p5, {{0, 8}});
  bool nic = false;
  for (const auto& l : p5_spec.links) {
    if (l.name != "node0_nic0_tx") continue;
    nic = true;
    CHECK(l.bw_bytes_per_s == Approx(4 * p5.inter.nic_bw_bytes_per_s.value));
  }
  CHECK(nic);
  // A mesh (Gaudi2's RoCE ports): a pair inside a node has its own link, 1/7 of a chip's
  // bandwidth, also when --gpus takes part of the node.
  const auto gaudi =
      dtsim::cluster::with_devices(dtsim::cluster::load_cluster("gaudi2-cluster"), 4);
  const auto mesh = dtsim::network::build_platform(gaudi, {{0, 1}, {1, 0}});
  REQUIRE(mesh.routes.size() == 2);
  REQUIRE(mesh.routes[0].second.size() == 1);
  const auto& link = mesh.links[mesh.routes[0].second[0]];
  CHECK(link.bw_bytes_per_s == Approx(gaudi.intra.effective_bw() / 7));
  CHECK(dtsim::network::node_pairs(gaudi).size() == 4 * 3);
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::network::build_platform(dtsim::cluster::load_cluster("tpu-v4-slice"), {}),
      dtsim::UnsupportedError, "torus");
}

TEST_CASE("SimGrid runs past 16,384 devices a stage are said before they start",
          "[network][simgrid]") {
  dtsim::plan::Plan p;
  p.tp = 8;
  p.pp = 2;
  p.dp = 2048;  // 16,384 devices a stage
  CHECK(!dtsim::network::simgrid_scale_note(p));
  p.dp = 4096;
  const auto note = dtsim::network::simgrid_scale_note(p);
  REQUIRE(note);
  CHECK_THAT(*note, Catch::Matchers::Contains("--network simgrid with 32768 devices in a "
                                              "pipeline stage"));
}
