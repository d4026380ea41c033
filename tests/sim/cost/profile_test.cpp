#include "sim/cost/profile.hpp"

#include "sim/common/error.hpp"
#include "sim/cost/compute_cost.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::test::TempFile;

namespace {
// Two GEMMs: 2·1024³ FLOPs in 1e-4 s (21.5 TFLOP/s) and 2·4096³ in 1e-3 s (137 TFLOP/s).
const char* kProfile = R"({"device": "a100-sxm4-80gb", "source": "test data, not a measurement",
  "precision": "bf16", "memory_bw_bytes_per_s": 1.5e12, "launch_overhead_s": 0,
  "gemm": [{"m": 4096, "n": 4096, "k": 4096, "seconds": 1e-3},
           {"m": 1024, "n": 1024, "k": 1024, "seconds": 1e-4}]})";
}  // namespace

TEST_CASE("GEMM throughput is interpolated in log(FLOPs) between measurements", "[cost][profile]") {
  TempFile f("profile.json", kProfile);
  const auto p = dtsim::cost::load_profile(f.path());
  const double f1 = 2.0 * 1024 * 1024 * 1024, f2 = 2.0 * 4096 * 4096 * 4096;
  const double r1 = f1 / 1e-4, r2 = f2 / 1e-3;
  CHECK(p.gemm_seconds(f1) == Approx(1e-4));
  CHECK(p.gemm_seconds(f2) == Approx(1e-3));
  // Halfway in log(FLOPs): the mean of the two rates.
  const double mid = std::sqrt(f1 * f2);
  CHECK(p.gemm_seconds(mid) == Approx(mid / ((r1 + r2) / 2)));
  // Outside the table: the nearest measured rate.
  CHECK(p.gemm_seconds(f1 / 8) == Approx(f1 / 8 / r1));
  CHECK(p.gemm_seconds(f2 * 8) == Approx(f2 * 8 / r2));
}

TEST_CASE("a profile replaces the catalog's GEMM efficiency and memory bandwidth",
          "[cost][profile]") {
  TempFile f("profile.json", kProfile);
  const auto profile = dtsim::cost::load_profile(f.path());
  const auto spec = dtsim::model::load_model("llama2-7b");
  const dtsim::model::ModelGraph g(spec, 1, 1024);
  dtsim::plan::Plan plan;
  plan.micro_batch_size = 1;
  plan.seq_len = 1024;
  const auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  dtsim::cost::ComputeCost with(g, plan, device, &profile);
  for (auto id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    const double t = with.op_seconds(op, dtsim::lower::Phase::Forward);
    if (op.kind == dtsim::model::OpKind::QkvProj) {
      CHECK(t == Approx(std::max(profile.gemm_seconds(op.fwd_flops), op.fwd_bytes / 1.5e12)));
    }
    if (op.kind == dtsim::model::OpKind::Norm) CHECK(t == Approx(op.fwd_bytes / 1.5e12));
  }
  plan.precision = dtsim::Precision::Fp16;
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::cost::ComputeCost(g, plan, device, &profile), InputError,
      "precision: the profile was measured at bf16, the plan uses fp16");
}

TEST_CASE("bad profiles are rejected naming file and field", "[cost][profile][bad-input]") {
  auto bad = [](const char* text, const char* message) {
    TempFile f("bad_profile.json", text);
    DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cost::load_profile(f.path()), InputError, message);
  };
  bad(R"({"device": "x", "source": "s"})", "bad_profile.json: gemm: expected a non-empty array");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": -1}]})",
      "bad_profile.json: gemm[0].seconds: expected a positive number, got -1");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 0, "n": 1, "k": 1, "seconds": 1}]})",
      "gemm[0].m: expected a positive integer, got 0");
  bad(R"({"source": "s", "gemm": []})", "bad_profile.json: device: required field is missing");
}
