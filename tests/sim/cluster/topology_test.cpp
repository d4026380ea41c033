#include "sim/cluster/topology.hpp"

#include <nlohmann/json.hpp>

#include "sim/common/error.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::cluster::load_cluster;

TEST_CASE("every shipped cluster loads", "[cluster][topology]") {
  const auto names = dtsim::cluster::list_clusters();
  for (const char* required : {"selene", "dgx-h100-superpod", "aws-p4d", "aws-p5", "h100-roce",
                               "tpu-v4-slice", "frontier", "gaudi2-cluster", "default"}) {
    CHECK(std::find(names.begin(), names.end(), required) != names.end());
  }
  for (const std::string& name : names) {
    DYNAMIC_SECTION(name) {
      const auto c = load_cluster(name);
      CHECK(c.name == name);
      CHECK(c.devices() >= 1);
      CHECK(c.intra.bw_bytes_per_s.value > 0);
      CHECK_FALSE(c.intra.latency_s.source.empty());
    }
  }
}

TEST_CASE("the default and Selene clusters", "[cluster][topology]") {
  const auto selene = load_cluster("selene");
  CHECK(selene.device.name == "a100-sxm4-80gb");
  CHECK(selene.devices_per_node == 8);
  CHECK(selene.inter.nics_per_node == 8);
  // HDR InfiniBand: 200 Gb/s = 25 GB/s per direction.
  CHECK(selene.inter.nic_bw_bytes_per_s.value == 25e9);
  // Its CUDA 11 software's GEMM rate replaces the catalog's (measured in 2025); the rest stays.
  const auto a100 = dtsim::cluster::load_device("a100-sxm4-80gb");
  CHECK(selene.device_efficiency_overrides == std::vector<std::string>{"gemm"});
  CHECK(selene.device.efficiency.gemm.value == 0.737);
  CHECK(a100.efficiency.gemm.value == 0.869);
  CHECK(selene.device.efficiency.gemm.source.find("CUDA 11.7") != std::string::npos);
  CHECK(selene.device.efficiency.memory_bw.value == a100.efficiency.memory_bw.value);
  CHECK(load_cluster("default").device_efficiency_overrides.empty());
  // GPU clusters overlap communication with compute (NCCL runs on its own streams).
  CHECK(!selene.serial_ranks_source);
}

TEST_CASE("a cluster resized with --gpus keeps whole nodes", "[cluster][topology]") {
  const auto c = load_cluster("selene");  // 560 nodes of 8, 20 nodes per rail group
  CHECK(dtsim::cluster::with_devices(c, 64).nodes == 8);
  CHECK(dtsim::cluster::with_devices(c, 64).inter.nodes_per_leaf == 8);  // one leaf holds all
  CHECK(dtsim::cluster::with_devices(c, 320).inter.nodes_per_leaf == 20);
  CHECK(dtsim::cluster::with_devices(c, 4).devices_per_node == 4);
  // Never larger than the cluster: --gpus must not invent nodes.
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cluster::with_devices(c, 8192), InputError,
                                  "--gpus 8192: cluster selene has 4480 devices");
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cluster::with_devices(c, 0), InputError,
                                  "--gpus: expected a positive number of devices, got 0");
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cluster::with_devices(c, 12), InputError,
                                  "use fewer than one node or a multiple of 8");
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cluster::with_devices(load_cluster("tpu-v4-slice"), 8),
                                  InputError, "fixed");
}

TEST_CASE("a fat tree or rail-optimized cluster grows by whole nodes, others do not",
          "[cluster][topology]") {
  using dtsim::cluster::with_nodes;
  const auto selene = load_cluster("selene");  // 560 nodes of 8, 20 nodes per rail group
  // Fewer nodes: as --gpus; more: the same nodes, leaves and oversubscription.
  CHECK(with_nodes(selene, 8).devices() == 64);
  CHECK(with_nodes(selene, 8).inter.nodes_per_leaf == 8);
  const auto grown = with_nodes(selene, 1120);
  CHECK(grown.devices() == 8960);
  CHECK(grown.inter.nodes_per_leaf == 20);
  CHECK(grown.inter.oversubscription.value == selene.inter.oversubscription.value);
  const auto roce = load_cluster("h100-roce");
  CHECK(with_nodes(roce, 4096).inter.oversubscription.value == roce.inter.oversubscription.value);
  DTSIM_REQUIRE_THROWS_CONTAINING(with_nodes(load_cluster("hgx-h200"), 2), InputError,
                                  "cluster hgx-h200 has 1 node and a none network, which does "
                                  "not grow (a single node");
  DTSIM_REQUIRE_THROWS_CONTAINING(with_nodes(load_cluster("tpu-v4-slice"), 32), InputError,
                                  "a torus is of a fixed size");
  DTSIM_REQUIRE_THROWS_CONTAINING(with_nodes(load_cluster("frontier"), 20000), InputError,
                                  "a dragonfly's global links are sized for its groups");
  DTSIM_REQUIRE_THROWS_CONTAINING(with_nodes(selene, std::int64_t{1} << 22), InputError,
                                  "above the 16777216 devices a cluster may have");
}

namespace {
nlohmann::json valid_cluster() {
  return nlohmann::json::parse(R"({"name": "c", "description": "d", "source": "s",
    "device": "a100-sxm4-80gb", "nodes": 2, "devices_per_node": 8,
    "intra_node": {"fabric": "nvswitch", "latency_s": {"value": 2e-6, "source": "s"}},
    "inter_node": {"fabric": "fat_tree", "transport": "infiniband", "nics_per_node": 8,
                   "nic_bw_bytes_per_s": {"value": 25e9, "source": "s"},
                   "latency_s": {"value": 4e-6, "source": "s"}, "nodes_per_leaf": 2}})");
}
}  // namespace

TEST_CASE("bad cluster files are rejected naming file and field",
          "[cluster][topology][bad-input]") {
  auto expect = [](nlohmann::json j, const std::string& message) {
    dtsim::test::TempFile f("cl.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_cluster(f.path()), InputError, "cl.json: " + message);
  };
  SECTION("a device efficiency override above 1, or of an unknown figure") {
    auto j = valid_cluster();
    j["device_efficiency"] = {{"gemm", {{"value", 1.5}, {"source", "s"}}}};
    expect(j, "device_efficiency.gemm: expected a fraction in (0, 1], got 1.5");
    j["device_efficiency"] = {{"gemm", {{"value", 0.7}}}};
    expect(j, "device_efficiency.gemm.source: required field is missing");
    j["device_efficiency"] = {{"tflops", {{"value", 0.7}, {"source", "s"}}}};
    expect(j, "device_efficiency.tflops: unknown field (known fields: gemm, attention");
    j["device_efficiency"] = {{"gemm", {{"value", 1e-11}, {"source", "s"}}}};
    expect(j, "device_efficiency.gemm: expected a fraction of peak from 0.01 to 1, got 1e-11");
  }
  SECTION("a price or power per device out of any device's range") {
    auto j = valid_cluster();
    j["price_per_device_hour_usd"] = {{"value", 1e19}, {"source", "s"}};
    expect(j,
           "price_per_device_hour_usd.value: expected USD per hour from 1e-06 to 10000, got 1e+19 "
           "(a unit mistake?)");
    j = valid_cluster();
    j["power_per_device_w"] = {{"value", 0.7}, {"source", "kW"}};
    expect(j, "power_per_device_w.value: expected W from 1 to 100000, got 0.7");
  }
  SECTION("communication that says neither whether it overlaps nor why") {
    auto j = valid_cluster();
    j["communication"] = {{"overlaps_compute", "no"}, {"source", "s"}};
    expect(j, "communication.overlaps_compute: expected true or false");
    j["communication"] = {{"overlaps_compute", false}};
    expect(j, "communication.source: required field is missing");
  }
  SECTION("negative node count") {
    auto j = valid_cluster();
    j["nodes"] = -1;
    expect(j, "nodes: expected a positive integer, got -1");
  }
  SECTION("unknown fabric lists the known ones") {
    auto j = valid_cluster();
    j["inter_node"]["fabric"] = "butterfly";
    expect(j,
           "inter_node.fabric: expected one of fat_tree, rail_optimized, torus_3d, dragonfly, "
           "none, got \"butterfly\"");
  }
  SECTION("unknown device") {
    auto j = valid_cluster();
    j["device"] = "v100";
    expect(j, "device: unknown device \"v100\"");
  }
  SECTION("missing NIC bandwidth for a fat tree") {
    auto j = valid_cluster();
    j["inter_node"].erase("nic_bw_bytes_per_s");
    expect(j, "inter_node.nic_bw_bytes_per_s: required field is missing");
  }
  SECTION("oversubscription below 1") {
    auto j = valid_cluster();
    j["inter_node"]["oversubscription"] = {{"value", 0.5}, {"source", "s"}};
    expect(j, "inter_node.oversubscription: expected a ratio from 1 (non-blocking) to 1000");
  }
  SECTION("oversubscription far past any leaf") {
    auto j = valid_cluster();
    j["inter_node"]["oversubscription"] = {{"value", 1e9}, {"source", "s"}};
    expect(j,
           "inter_node.oversubscription: expected a ratio from 1 (non-blocking) to 1000, got "
           "1000000000");
  }
  SECTION("a field the fabric does not read") {
    auto j = valid_cluster();
    j["inter_node"]["torus_dims"] = {2, 2, 4};
    expect(j,
           "inter_node.torus_dims: only with fabric torus_3d; this cluster's is fat_tree, which "
           "does not read it");
    j = valid_cluster();
    j["inter_node"]["link_bw_bytes_per_s"] = {{"value", 5e10}, {"source", "s"}};
    expect(j, "inter_node.link_bw_bytes_per_s: only with fabric torus_3d");
    // One node: no network between nodes, so no latency to read.
    j = valid_cluster();
    j["nodes"] = 1;
    j["inter_node"] = {
        {"fabric", "none"}, {"transport", "none"}, {"latency_s", {{"value", 5}, {"source", "s"}}}};
    expect(j,
           "inter_node.latency_s: only with fabric fat_tree, rail_optimized, dragonfly or "
           "torus_3d (a network between nodes); this cluster's is none");
  }
  SECTION("values in another unit") {
    auto j = valid_cluster();
    j["inter_node"]["nic_bw_bytes_per_s"] = {{"value", 400}, {"source", "400 Gbit/s"}};
    expect(j,
           "inter_node.nic_bw_bytes_per_s.value: expected bytes/s from 1e+07 to 1e+14, got 400 "
           "(a unit mistake?)");
    j = valid_cluster();
    j["inter_node"]["latency_s"] = {{"value", 5}, {"source", "5 us"}};
    expect(j, "inter_node.latency_s.value: expected seconds from 1e-09 to 0.01, got 5");
  }
  SECTION("PCIe or host memory between the devices needs its own bandwidth") {
    auto j = valid_cluster();
    j["intra_node"]["fabric"] = "pcie";
    j["intra_node"].erase("bw_bytes_per_s");
    expect(j,
           "intra_node.bw_bytes_per_s: required with fabric pcie (the device's "
           "intra_node_bw_bytes_per_s is its scale-up link's");
  }
  SECTION("torus size differs from the device count") {
    auto j = valid_cluster();
    j["inter_node"] = nlohmann::json::parse(R"({"fabric": "torus_3d", "transport": "ici",
      "latency_s": {"value": 1e-6, "source": "s"}, "torus_dims": [2, 2, 2],
      "link_bw_bytes_per_s": {"value": 5e10, "source": "s"}})");
    expect(j, "inter_node.torus_dims: the torus has 8 devices but nodes x devices_per_node = 16");
  }
  SECTION("a torus needs three sizes") {
    auto j = valid_cluster();
    j["inter_node"] = nlohmann::json::parse(R"({"fabric": "torus_3d", "transport": "ici",
      "latency_s": {"value": 1e-6, "source": "s"}, "torus_dims": [4, 4],
      "link_bw_bytes_per_s": {"value": 5e10, "source": "s"}})");
    expect(j, "inter_node.torus_dims: expected 3 sizes (x, y, z) for a torus_3d, got 2");
  }
  SECTION("a switched network needs a transport") {
    for (const char* fabric : {"fat_tree", "rail_optimized", "dragonfly"}) {
      auto j = valid_cluster();
      j["inter_node"]["fabric"] = fabric;
      j["inter_node"]["transport"] = "none";
      expect(j, "inter_node.transport: a " + std::string(fabric) + " network needs a transport");
    }
  }
  SECTION("no inter-node network, no transport") {
    auto j = valid_cluster();
    j["nodes"] = 1;
    j["inter_node"] = {{"fabric", "none"}, {"transport", "infiniband"}};
    expect(j,
           "inter_node.transport: expected none with fabric none (a single node), got "
           "infiniband");
  }
  SECTION("a leaf larger than the cluster") {
    auto j = valid_cluster();
    j["inter_node"]["nodes_per_leaf"] = 4;
    expect(j, "inter_node.nodes_per_leaf: 4 nodes per leaf but the cluster has 2 nodes");
  }
  SECTION("a dragonfly group larger than the cluster") {
    auto j = valid_cluster();
    j["inter_node"]["fabric"] = "dragonfly";
    j["inter_node"]["nodes_per_leaf"] = 4;
    expect(j, "inter_node.nodes_per_leaf: 4 nodes per group but the cluster has 2 nodes");
  }
  SECTION("at most 1024 NICs per node") {
    auto j = valid_cluster();
    j["inter_node"]["nics_per_node"] = std::int64_t{1} << 40;
    expect(j, "inter_node.nics_per_node: expected at most 1024, got 1099511627776");
  }
  SECTION("at most 2^24 devices") {
    auto j = valid_cluster();
    j["nodes"] = 1 << 22;
    expect(j,
           "nodes: nodes x devices_per_node = 4194304 x 8 = 33554432 exceeds dtsim's limit of "
           "16777216 devices");
    j["nodes"] = std::int64_t{1} << 40;
    expect(j, "nodes: expected at most 16777216, got 1099511627776");
  }
  SECTION("malformed JSON names the file") {
    dtsim::test::TempFile f("cl.json", R"({"name": "c", "nodes": 2,)");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_cluster(f.path()), InputError, "cl.json: malformed JSON");
  }
  SECTION("unknown cluster name lists the known ones") {
    DTSIM_REQUIRE_THROWS_CONTAINING(load_cluster("summit"), InputError, "unknown cluster");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_cluster("summit"), InputError, "selene");
  }
}

TEST_CASE("another device takes the cluster's links and power, and leaves its price", "[cluster]") {
  const auto p5 = dtsim::cluster::load_cluster("aws-p5");
  REQUIRE(p5.price_per_device_hour_usd);
  const auto same = dtsim::cluster::with_device(p5, p5.device);
  CHECK(same.price_per_device_hour_usd);
  const auto b200 = dtsim::cluster::with_device(p5, dtsim::cluster::load_device("b200"));
  CHECK(b200.device.name == "b200");
  CHECK_FALSE(b200.price_per_device_hour_usd);
  CHECK(b200.intra.bw_bytes_per_s.value == b200.device.intra_node_bw_bytes_per_s.value);
  REQUIRE(b200.power_per_device_w);
  REQUIRE(b200.device.power_w);
  CHECK(b200.power_per_device_w->value == b200.device.power_w->value);
}

TEST_CASE("another device in a PCIe or host-memory node keeps the node's link", "[cluster]") {
  // The link is the node's (a PCIe switch, a host's memory), not the device's NVLink: whatif
  // --vary device=h100-sxm on a PCIe cluster priced its tp collectives at NVLink's rate.
  auto pcie = dtsim::cluster::load_cluster("cpu-host");
  REQUIRE(dtsim::cluster::node_owns_link(pcie.intra.fabric));
  const auto host_bw = pcie.intra.bw_bytes_per_s.value;
  const auto host_eff = pcie.intra.bw_efficiency.value;
  const auto h100 = dtsim::cluster::load_device("h100-sxm");
  REQUIRE(h100.intra_node_bw_bytes_per_s.value != host_bw);
  const auto on_host = dtsim::cluster::with_device(pcie, h100);
  CHECK(on_host.intra.bw_bytes_per_s.value == host_bw);
  CHECK(on_host.intra.bw_efficiency.value == host_eff);
  pcie.intra.fabric = dtsim::cluster::IntraFabric::Pcie;
  pcie.intra.bw_bytes_per_s.value = 25e9;
  const auto on_pcie = dtsim::cluster::with_device(pcie, h100);
  CHECK(on_pcie.device.name == "h100-sxm");
  CHECK(on_pcie.intra.bw_bytes_per_s.value == 25e9);
  // An NVSwitch node takes the new device's NVLink (as above, aws-p5 with a B200).
  pcie.intra.fabric = dtsim::cluster::IntraFabric::NvSwitch;
  CHECK(dtsim::cluster::with_device(pcie, h100).intra.bw_bytes_per_s.value ==
        h100.intra_node_bw_bytes_per_s.value);
}

TEST_CASE("the cluster's own device keeps its device_efficiency, and another takes the catalog's",
          "[cluster]") {
  using dtsim::cluster::load_device;
  const auto selene = dtsim::cluster::load_cluster("selene");
  REQUIRE_FALSE(selene.device_efficiency_overrides.empty());
  const auto catalog_a100 = load_device("a100-sxm4-80gb");
  REQUIRE(selene.device.efficiency.gemm.value != catalog_a100.efficiency.gemm.value);
  // Named again (whatif --vary device=a100-sxm4-80gb on Selene): the same cluster.
  const auto same = dtsim::cluster::with_device(selene, catalog_a100);
  CHECK(same.device.efficiency.gemm.value == selene.device.efficiency.gemm.value);
  CHECK(same.device_efficiency_overrides == selene.device_efficiency_overrides);
  // A copy of its device file under the same name (a calibration's) is another device.
  auto copy = catalog_a100;
  copy.file = "elsewhere/devices/a100-sxm4-80gb.json";
  copy.efficiency.gemm.value = 0.5;
  const auto copied = dtsim::cluster::with_device(selene, copy);
  CHECK(copied.device.efficiency.gemm.value == 0.5);
  CHECK(copied.device_efficiency_overrides.empty());
  const auto h100 = dtsim::cluster::with_device(selene, load_device("h100-sxm"));
  CHECK(h100.device.efficiency.gemm.value == load_device("h100-sxm").efficiency.gemm.value);
  CHECK(h100.device_efficiency_overrides.empty());
}
