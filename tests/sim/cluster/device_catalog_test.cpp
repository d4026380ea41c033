#include "sim/cluster/device_catalog.hpp"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sim/common/error.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::Precision;
using dtsim::cluster::load_device;

TEST_CASE("every catalog device loads, with a source for every figure", "[cluster][catalog]") {
  const auto names = dtsim::cluster::list_devices();
  for (const char* required :
       {"a100-sxm4-40gb", "a100-sxm4-80gb", "h100-sxm", "h200", "b200", "mi250x", "mi300x",
        "gaudi2", "gaudi3", "tpu-v4", "tpu-v5p", "trainium1", "trainium2"}) {
    CHECK(std::find(names.begin(), names.end(), required) != names.end());
  }
  for (const std::string& name : names) {
    DYNAMIC_SECTION(name) {
      const auto d = load_device(name);
      CHECK(d.name == name);
      // Accelerators train in bf16; the CPU host entry (dtexec's CPU backend) in fp32 only.
      CHECK(d.supports(d.vendor == "cpu" ? Precision::Fp32 : Precision::Bf16));
      for (const auto& [p, f] : d.peak_flops) CHECK_FALSE(f.source.empty());
      CHECK(d.memory_bytes.value > 1e9);
      CHECK_FALSE(d.memory_bw_bytes_per_s.source.empty());
      CHECK(d.efficiency.gemm.value <= 1.0);
    }
  }
}

TEST_CASE("devices are found by alias, case-insensitively", "[cluster][catalog]") {
  CHECK(load_device("A100-SXM4-80GB").name == "a100-sxm4-80gb");
  CHECK(load_device("a100-sxm4-80gb").name == "a100-sxm4-80gb");
  // A100 dense bf16 peak: 312 TFLOP/s (NVIDIA A100 datasheet).
  CHECK(load_device("a100-sxm4-80gb").peak_flops_for(Precision::Bf16) == 312e12);
}

TEST_CASE("a precision the device lacks is an unsupported error", "[cluster][catalog]") {
  const auto a100 = load_device("a100-sxm4-80gb");
  REQUIRE_FALSE(a100.supports(Precision::Fp8));
  REQUIRE_THROWS_AS(a100.peak_flops_for(Precision::Fp8), dtsim::UnsupportedError);
  REQUIRE_THROWS_WITH(a100.peak_flops_for(Precision::Fp8),
                      Catch::Matchers::Contains("has no fp8 peak"));
}

namespace {
nlohmann::json valid_device() {
  return nlohmann::json::parse(R"({"name": "x", "display_name": "X", "vendor": "v",
    "peak_flops": {"bf16": {"value": 1e14, "source": "s"}},
    "memory_bytes": {"value": 8e10, "source": "s"},
    "memory_bw_bytes_per_s": {"value": 2e12, "source": "s"},
    "intra_node_bw_bytes_per_s": {"value": 3e11, "source": "s"},
    "efficiency": {"gemm": {"value": 0.8, "source": "s"}, "attention": {"value": 0.6, "source": "s"},
                   "memory_bw": {"value": 0.9, "source": "s"},
                   "launch_overhead_s": {"value": 3e-6, "source": "s"}}})");
}
}  // namespace

TEST_CASE("bad device files are rejected naming file and field", "[cluster][catalog][bad-input]") {
  SECTION("efficiency above 1") {
    auto j = valid_device();
    j["efficiency"]["gemm"]["value"] = 1.5;
    dtsim::test::TempFile f("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(f.path()), InputError,
                                    "dev.json: efficiency.gemm: expected a fraction in (0, 1]");
  }
  SECTION("an efficiency under 1% of peak, a power or an alias that cannot be") {
    auto j = valid_device();
    j["efficiency"]["attention"]["value"] = 1e-11;
    dtsim::test::TempFile f("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_device(f.path()), InputError,
        "dev.json: efficiency.attention: expected a fraction of peak from 0.01 to 1, got 1e-11");
    j = valid_device();
    for (const double watts : {1e20, 0.7}) {
      j["power_w"] = {{"value", watts}, {"source", "s"}};
      dtsim::test::TempFile g("dev.json", j.dump());
      DTSIM_REQUIRE_THROWS_CONTAINING(load_device(g.path()), InputError,
                                      "dev.json: power_w.value: expected W from 1 to 100000");
    }
    j = valid_device();
    j["aliases"] = {"x1", ""};
    dtsim::test::TempFile h("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(h.path()), InputError,
                                    "dev.json: aliases: expected names, got an empty one");
  }
  SECTION("a link efficiency above 1") {
    auto j = valid_device();
    j["efficiency"]["intra_node_bw"] = {{"value", 1.2}, {"source", "s"}};
    dtsim::test::TempFile f("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_device(f.path()), InputError,
        "dev.json: efficiency.intra_node_bw: expected a fraction in (0, 1]");
  }
  SECTION("GEMM waves without a tile size or source") {
    auto j = valid_device();
    j["efficiency"]["gemm_waves"] = {{"sm_count", 108}, {"tile_m", 256}, {"source", "s"}};
    dtsim::test::TempFile f("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(f.path()), InputError,
                                    "dev.json: efficiency.gemm_waves.tile_n: required field");
    j["efficiency"]["gemm_waves"] = {
        {"sm_count", 0}, {"tile_m", 256}, {"tile_n", 128}, {"source", "s"}};
    dtsim::test::TempFile g("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(g.path()), InputError,
                                    "efficiency.gemm_waves.sm_count: expected a positive integer");
    j["efficiency"]["gemm_waves"] = {{"sm_count", 108}, {"tile_m", 256}, {"tile_n", 128}};
    dtsim::test::TempFile h("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(h.path()), InputError,
                                    "efficiency.gemm_waves.source: required field");
  }
  SECTION("a figure without a source") {
    auto j = valid_device();
    j["memory_bytes"].erase("source");
    dtsim::test::TempFile f("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(f.path()), InputError,
                                    "dev.json: memory_bytes.source: required field is missing");
  }
  SECTION("a negative bandwidth") {
    auto j = valid_device();
    j["memory_bw_bytes_per_s"]["value"] = -1;
    dtsim::test::TempFile f("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(f.path()), InputError,
                                    "memory_bw_bytes_per_s.value: expected bytes/s from 1e+07 to "
                                    "1e+14, got -1");
  }
  SECTION("an unknown precision") {
    auto j = valid_device();
    j["peak_flops"]["fp4"] = {{"value", 1e15}, {"source", "s"}};
    dtsim::test::TempFile f("dev.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(f.path()), InputError, "peak_flops.fp4: unknown");
  }
  SECTION("malformed JSON names the file and line") {
    dtsim::test::TempFile f("dev.json", "{\n  \"name\": \"x\",\n  \"memory_bytes\": }");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(f.path()), InputError, "dev.json: malformed JSON");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device(f.path()), InputError, "line 3");
  }
  SECTION("an unknown name lists the known ones") {
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device("v100"), InputError, "unknown device \"v100\"");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_device("v100"), InputError, "h100-sxm");
  }
}

TEST_CASE("a DTSIM_DATA_DIR's devices are found first, by name and by alias",
          "[cluster][catalog]") {
  // A user's own device that shares an alias with a shipped one (its "H100" for a tuned
  // copy) is the one an alias finds; the shipped ones stay known beside it.
  const auto root =
      std::filesystem::temp_directory_path() / ("dtsim_data_" + std::to_string(::getpid()));
  std::filesystem::create_directories(root / "topologies" / "devices");
  auto j = valid_device();
  j["name"] = "zz-my-h100";
  j["aliases"] = {"H100"};
  std::ofstream(root / "topologies" / "devices" / "zz-my-h100.json") << j.dump();
  const char* before = std::getenv("DTSIM_DATA_DIR");
  const std::string saved = before != nullptr ? before : "";
  ::setenv("DTSIM_DATA_DIR", root.c_str(), 1);
  const auto by_alias = load_device("h100");
  const auto shipped = load_device("h100-sxm");
  const auto own = load_device("zz-my-h100");
  if (before != nullptr) {
    ::setenv("DTSIM_DATA_DIR", saved.c_str(), 1);
  } else {
    ::unsetenv("DTSIM_DATA_DIR");
  }
  std::filesystem::remove_all(root);
  CHECK(by_alias.name == "zz-my-h100");
  CHECK(shipped.name == "h100-sxm");
  CHECK(own.name == "zz-my-h100");
}
