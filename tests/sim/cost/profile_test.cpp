#include "sim/cost/profile.hpp"

#include <fmt/format.h>

#include <string>

#include "sim/common/error.hpp"
#include "sim/cost/compute_cost.hpp"
#include "sim/engine/simulator.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::test::TempFile;

namespace {
// Two GEMMs: 2·1024³ FLOPs in 1e-4 s (21.5 TFLOP/s) and 2·4096³ in 1e-3 s (137 TFLOP/s).
const char* kProfile = R"({"device": "a100-sxm4-80gb", "source": "test data, not a measurement",
  "precision": "bf16", "memory_bw_bytes_per_s": 1.5e12, "launch_overhead_s": 0,
  "gemm": [{"m": 4096, "n": 4096, "k": 4096, "seconds": 1e-3},
           {"m": 1024, "n": 1024, "k": 1024, "seconds": 1e-4}]})";

// A CPU host's profile (one GEMM) with the given "ops" rows.
std::string profile_with_ops(const std::string& ops) {
  return R"({"device": "cpu-host", "source": "test data",
    "precision": "fp32", "memory_bw_bytes_per_s": 1e10, "launch_overhead_s": 0,
    "gemm": [{"m": 256, "n": 256, "k": 256, "seconds": 1e-3}], "ops": [)" +
         ops + "]}";
}

dtsim::plan::Plan fp32_plan() {
  dtsim::plan::Plan plan;
  plan.micro_batch_size = 2;
  plan.seq_len = 32;
  plan.precision = dtsim::Precision::Fp32;
  return plan;
}

// tiny-gpt at micro-batch 2, sequence 32, in fp32 on an A100, priced with `profile`.
struct TinyGptCost {
  explicit TinyGptCost(const dtsim::cost::Profile& profile)
      : spec(dtsim::model::load_model("tiny-gpt")),
        g(spec, 2, 32, 4),
        plan(fp32_plan()),
        device(dtsim::cluster::load_device("a100-sxm4-80gb")),
        cost(g, plan, device, &profile) {}
  dtsim::model::ModelSpec spec;
  dtsim::model::ModelGraph g;
  dtsim::plan::Plan plan;
  dtsim::cluster::DeviceSpec device;
  dtsim::cost::ComputeCost cost;
};
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

TEST_CASE("a GEMM of a measured shape takes its own time, forward and backward",
          "[cost][profile]") {
  // tiny-gpt's MLP up on tp 2 (micro-batch 1, sequence 32): [32, 64] x [64, 128] on a rank.
  // The profile holds its forward and its two backward GEMMs at times that the FLOPs
  // interpolation would not give, and a square GEMM for everything else.
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  const dtsim::model::Op* up = nullptr;
  for (auto id : g.layer_ops(0)) {
    if (g.op(id).kind == dtsim::model::OpKind::MlpUp) up = &g.op(id);
  }
  REQUIRE(up != nullptr);
  const int T = static_cast<int>(up->gemm_m), K = static_cast<int>(up->gemm_k),
            N = static_cast<int>(up->gemm_n) / 2;
  const std::string text = fmt::format(
      R"({{"device": "a100-sxm4-80gb", "source": "test data, not a measurement",
  "precision": "bf16", "memory_bw_bytes_per_s": 1e14, "launch_overhead_s": 0,
  "gemm": [{{"m": 1024, "n": 1024, "k": 1024, "seconds": 1e-4}},
           {{"m": {0}, "k": {1}, "n": {2}, "seconds": 3e-6}},
           {{"m": {0}, "k": {2}, "n": {1}, "seconds": 5e-6}},
           {{"m": {1}, "k": {0}, "n": {2}, "seconds": 7e-6}}]}})",
      T, K, N);
  TempFile f("profile.json", text);
  const auto profile = dtsim::cost::load_profile(f.path());
  CHECK(profile.gemm_seconds(T, N, K) == 3e-6);
  // Another shape of the same FLOPs: interpolated, not a measured row's time.
  CHECK(profile.gemm_seconds(4 * T, N / 2, K / 2) == Approx(profile.gemm_seconds(2.0 * T * N * K)));
  dtsim::plan::Plan plan;
  plan.tp = 2;
  plan.seq_len = 32;
  const auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  const dtsim::cost::ComputeCost cost(g, plan, device, &profile);
  using dtsim::lower::Phase;
  CHECK(cost.op_seconds(*up, Phase::Forward) == Approx(3e-6));
  CHECK(cost.op_seconds(*up, Phase::BackwardInput) == Approx(5e-6));
  CHECK(cost.op_seconds(*up, Phase::BackwardWeight) == Approx(7e-6));
  CHECK(cost.op_seconds(*up, Phase::Backward) == Approx(12e-6));
  // Whole (tp 1), the shape was not measured: the FLOPs interpolation prices it.
  plan.tp = 1;
  const dtsim::cost::ComputeCost whole(g, plan, device, &profile);
  CHECK(whole.op_seconds(*up, Phase::Forward) == Approx(profile.gemm_seconds(up->fwd_flops)));
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
  // A combined backward is its two GEMMs, each at its own measured rate: the same time as
  // the input-gradient and weight-gradient passes that zero-bubble runs apart.
  for (auto id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    if (op.kind != dtsim::model::OpKind::MlpUp) continue;
    CHECK(with.op_seconds(op, dtsim::lower::Phase::Backward) ==
          Approx(with.op_seconds(op, dtsim::lower::Phase::BackwardInput) +
                 with.op_seconds(op, dtsim::lower::Phase::BackwardWeight)));
  }
  plan.precision = dtsim::Precision::Fp16;
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::cost::ComputeCost(g, plan, device, &profile), InputError,
      "precision: the profile was measured at bf16, the plan uses fp16");
  // A file without "precision" does not say it was measured at bf16 (it is taken as that).
  auto unstated = profile;
  unstated.precision_stated = false;
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cost::ComputeCost(g, plan, device, &unstated), InputError,
                                  "precision: the profile does not say its precision (taken as "
                                  "bf16; dtexec calibrate writes it), the plan uses fp16");
}

TEST_CASE("bad profiles are rejected naming file and field", "[cost][profile][bad-input]") {
  auto bad = [](const char* text, const char* message) {
    TempFile f("bad_profile.json", text);
    DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cost::load_profile(f.path()), InputError, message);
  };
  bad(R"({"device": "x", "source": "s"})", "bad_profile.json: gemm: expected a non-empty array");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": -1}]})",
      "bad_profile.json: gemm[0].seconds: expected a positive number (from 1e-12 to 1e+21), got "
      "-1");
  // Subnormal or absurdly large figures would turn into inf or NaN downstream.
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 5e-324}]})",
      "gemm[0].seconds: expected a positive number (from 1e-12 to 1e+21), got 5e-324");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "memory_bw_bytes_per_s": 1e300})",
      "memory_bw_bytes_per_s: expected bytes/s from 1e+07 to 1e+14, got 1e+300");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 0, "n": 1, "k": 1, "seconds": 1}]})",
      "gemm[0].m: expected a positive integer, got 0");
  bad(R"({"source": "s", "gemm": []})", "bad_profile.json: device: required field is missing");
  // Seconds where a device file takes them (1 ns to 10 ms), not milliseconds or microseconds.
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "launch_overhead_s": 10})",
      "bad_profile.json: launch_overhead_s: expected seconds from 1e-09 to 0.01, or 0, got 10 (a "
      "unit mistake?)");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "jitter_cv": 1.5})",
      "bad_profile.json: jitter_cv: expected a coefficient of variation below 1, got 1.5");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "jitter_cv": -0.1})",
      "bad_profile.json: jitter_cv: expected a number >= 0 (0, or from 1e-12 to 1e+21), got -0.1");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "in_run": {"forward": 0.01, "backward": 1, "optimizer": 1}})",
      "bad_profile.json: in_run.forward: expected a ratio of measured to predicted time in "
      "[0.1, 100], got 0.01");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "in_run": {"forward": 1, "backward": 1}})",
      "bad_profile.json: in_run.optimizer: required field is missing");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "in_run": {"forward": 1, "backward": 1, "optimizer": 1, "rank_spread_cv": 1.2}})",
      "bad_profile.json: in_run.rank_spread_cv: expected a coefficient of variation below 1, "
      "got 1.2");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "in_run": {"forward": 1, "backward": 1, "optimizer": 1, "transient_cv": 2}})",
      "bad_profile.json: in_run.transient_cv: expected a coefficient of variation below 1, "
      "got 2");
  // Fields that the model does not read are still typed as dtexec calibrate writes them.
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "notes": 3})",
      "bad_profile.json: notes: expected a string");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "ranks_per_host": "two"})",
      "bad_profile.json: ranks_per_host: expected a positive integer");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "in_run": {"forward": 1, "backward": 1, "optimizer": 1, "tasks": -4}})",
      "bad_profile.json: in_run.tasks: expected a positive integer, got -4");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "ops": [{"op": "gelu", "phase": "fwd", "bytes_per_s": 1e9, "seconds": "fast"}]})",
      "bad_profile.json: ops[0].seconds: expected a positive number");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "collectives": [{"kind": "all_reduce", "ranks": 2, "bytes": 8, "seconds": 1e-5,
                           "busbw_bytes_per_s": 0}]})",
      "bad_profile.json: collectives[0].busbw_bytes_per_s: expected a positive number");
  // A device named by nothing ("was measured on , the cluster's devices are h200").
  bad(R"({"device": "", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}]})",
      "bad_profile.json: device: expected a name, got an empty string");
  // One time per shape: which of two the simulator took would depend on their order.
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 8, "n": 4, "k": 2, "seconds": 1},
          {"m": 2, "n": 4, "k": 8, "seconds": 1}, {"m": 8, "n": 4, "k": 2, "seconds": 10}]})",
      "bad_profile.json: gemm[2].m: m=8 n=4 k=2 is given twice (also gemm[0]): one time per "
      "shape");
  // Timings no device gives: a GEMM below 1 FLOP/s (1e21 s priced the step at 9e21 s), a
  // collective beyond a device file's bandwidths (2^62 bytes in a picosecond took the dp
  // communication off the step) or below 1 byte/s.
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 32, "n": 32, "k": 32, "seconds": 1e21}]})",
      "bad_profile.json: gemm[0].seconds: m=32 n=32 k=32 in 1e+21 s is 6.55e-17 FLOP/s, below 1 "
      "(a timing error?)");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "collectives": [{"kind": "all_reduce", "ranks": 2, "bytes": 4611686018427387904,
                           "seconds": 1e-12}]})",
      "bad_profile.json: collectives[0].seconds: 4.61169e+18 bytes in 1e-12 s is 4.61e+30 "
      "bytes/s: expected from 1 to 1e+14 (a timing error?)");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "collectives": [{"kind": "all_reduce", "ranks": 2, "bytes": 8, "seconds": 100}]})",
      "bad_profile.json: collectives[0].seconds: 8 bytes in 100 s is 0.08 bytes/s: expected from "
      "1 to 1e+14");
  // A null is not an absent field (it dropped the in_run factors silently, 40% of a step).
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "in_run": null})",
      "bad_profile.json: in_run: expected a value, got null");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "precision": null})",
      "bad_profile.json: precision: expected a value, got null");
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "ops": [{"op": "gelu", "phase": "fwd", "bytes_per_s": 1e9, "seconds": null}]})",
      "bad_profile.json: ops[0].seconds: expected a value, got null");
  // A device file's bounds on bandwidth: beyond them a unit mistake.
  bad(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
          "memory_bw_bytes_per_s": 1e20})",
      "bad_profile.json: memory_bw_bytes_per_s: expected bytes/s from 1e+07 to 1e+14, got 1e+20 "
      "(a unit mistake?)");
}

TEST_CASE("a profile's GEMMs of equal FLOPs price alike whatever their order in the file",
          "[cost][profile]") {
  const char* ab = R"({"device": "a100-sxm4-80gb", "source": "s", "precision": "bf16",
    "gemm": [{"m": 8, "n": 4, "k": 2, "seconds": 1e-6}, {"m": 2, "n": 4, "k": 8, "seconds": 3e-6},
             {"m": 64, "n": 64, "k": 64, "seconds": 1e-5}]})";
  const char* ba = R"({"device": "a100-sxm4-80gb", "source": "s", "precision": "bf16",
    "gemm": [{"m": 64, "n": 64, "k": 64, "seconds": 1e-5}, {"m": 2, "n": 4, "k": 8, "seconds": 3e-6},
             {"m": 8, "n": 4, "k": 2, "seconds": 1e-6}]})";
  TempFile fa("ab.json", ab), fb("ba.json", ba);
  const auto a = dtsim::cost::load_profile(fa.path()), b = dtsim::cost::load_profile(fb.path());
  for (double flops : {64.0, 100.0, 1000.0, 1e5, 1e6}) {
    INFO(flops);
    CHECK(a.gemm_seconds(flops) == b.gemm_seconds(flops));
  }
}

TEST_CASE("a size measured in several layouts is priced at their median throughput",
          "[cost][profile]") {
  // calibrate times each size in three layouts; which one stood for the size (the first by
  // shape inside the table, the last beyond it) moved a quick profile's GPT-2 step by 27%.
  const char* three = R"({"device": "a100-sxm4-80gb", "source": "s", "precision": "bf16",
    "gemm": [{"m": 16, "n": 16, "k": 16, "seconds": 1e-6},
             {"m": 64, "n": 32, "k": 32, "seconds": 1e-5}, {"m": 32, "n": 64, "k": 32, "seconds": 2e-5},
             {"m": 32, "n": 32, "k": 64, "seconds": 4e-5}]})";
  TempFile f("three.json", three);
  const auto p = dtsim::cost::load_profile(f.path());
  const double top = 2.0 * 64 * 32 * 32;
  const double median_rate = top / 2e-5, small_rate = 2.0 * 16 * 16 * 16 / 1e-6;
  CHECK(p.gemm_seconds(top) == Approx(2e-5));
  CHECK(p.gemm_seconds(8 * top) == Approx(8 * top / median_rate));  // beyond: the median's rate
  const double mid = std::sqrt(top * 2.0 * 16 * 16 * 16);
  CHECK(p.gemm_seconds(mid) == Approx(mid / ((small_rate + median_rate) / 2)));
  // A measured shape still takes its own time.
  CHECK(p.gemm_seconds(32, 32, 64) == Approx(4e-5));
}

TEST_CASE("a profile names what it did not measure of a plan's compute", "[cost][profile]") {
  // One GEMM size, 256³, and no op rates: tiny-gpt's GEMMs at micro-batch 2, sequence 32 are
  // all smaller (64 tokens), and its norms, GELU, attention, residuals, embedding and loss have
  // no rate.
  TempFile f("narrow.json", profile_with_ops(""));
  const auto profile = dtsim::cost::load_profile(f.path());
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 2, 32, 4);
  const auto plan = fp32_plan();
  const auto device = dtsim::cluster::load_device("cpu-host");
  const auto notes = dtsim::cost::ComputeCost(g, plan, device, &profile).profile_coverage();
  REQUIRE(notes.size() == 2);
  CHECK_THAT(notes[0], Catch::Contains("are below its smallest measured size (3.36e+07 FLOPs"));
  CHECK_THAT(notes[0], Catch::Contains("an extrapolation"));
  CHECK_THAT(notes[1], Catch::Contains("has no rate for embedding fwd, embedding bwd, layernorm "
                                       "fwd, layernorm bwd, attention fwd"));
  CHECK_THAT(notes[1], Catch::Contains("optimizer step"));
  CHECK_THAT(notes[1], Catch::Contains("priced by the roofline"));
  // Without a profile: nothing to say.
  CHECK(dtsim::cost::ComputeCost(g, plan, device).profile_coverage().empty());
}

TEST_CASE("a profile's in_run factors scale its compute times by phase", "[cost][profile]") {
  const std::string base = R"("device": "a100-sxm4-80gb", "source": "test data",
    "precision": "bf16", "memory_bw_bytes_per_s": 1.5e12, "launch_overhead_s": 0,
    "gemm": [{"m": 1024, "n": 1024, "k": 1024, "seconds": 1e-4}])";
  TempFile plain_file("plain.json", "{" + base + "}");
  TempFile run_file("in_run.json", "{" + base +
                                       R"(, "in_run": {"forward": 1.1, "backward": 1.3,
                                                        "optimizer": 1.5, "tasks": 12,
                                                        "rank_spread_cv": 0.03,
                                                        "transient_cv": 0.01}})");
  const auto plain = dtsim::cost::load_profile(plain_file.path());
  const auto in_run = dtsim::cost::load_profile(run_file.path());
  REQUIRE(in_run.in_run);
  // The ranks' measured spread is the slow rank's unless one is given.
  CHECK(!plain.rank_spread_cv);
  CHECK(in_run.rank_spread_cv == 0.03);
  CHECK(dtsim::engine::rank_spread_cv_of(std::nullopt, &in_run) == 0.03);
  CHECK(dtsim::engine::rank_spread_cv_of(0.0, &in_run) == 0);
  CHECK(dtsim::engine::rank_spread_cv_of(std::nullopt, &plain) == 0);
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  dtsim::plan::Plan plan;
  plan.seq_len = 32;
  const auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  const dtsim::cost::ComputeCost a(g, plan, device, &plain), b(g, plan, device, &in_run);
  using dtsim::lower::Phase;
  for (auto id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    INFO(op.name);
    CHECK(b.op_seconds(op, Phase::Forward) == Approx(1.1 * a.op_seconds(op, Phase::Forward)));
    CHECK(b.op_seconds(op, Phase::Recompute) == Approx(1.1 * a.op_seconds(op, Phase::Recompute)));
    CHECK(b.op_seconds(op, Phase::Backward) == Approx(1.3 * a.op_seconds(op, Phase::Backward)));
    CHECK(b.op_seconds(op, Phase::BackwardWeight) ==
          Approx(1.3 * a.op_seconds(op, Phase::BackwardWeight)));
  }
  // bf16 weights: the step's 34 bytes per parameter (fp32 gradients 4, Adam 24, the 16-bit
  // copy's second read of the master 4 and its write 2) without in_run; a factor measured
  // before that read was priced holds it, so the price leaves it out (30 bytes).
  REQUIRE(plan.precision == dtsim::Precision::Bf16);
  CHECK(b.optimizer_seconds(1000000) == Approx(1.5 * 30.0 / 34.0 * a.optimizer_seconds(1000000)));
  // The gradient buffer's clear: scaled as the optimizer where the factor was measured against
  // a prediction that priced it, else left out (the factor holds it: an older calibration).
  TempFile priced_file("in_run_clear.json",
                       "{" + base +
                           R"(, "in_run": {"forward": 1.1, "backward": 1.3, "optimizer": 1.5,
                                           "optimizer_prices_clear": true,
                                           "optimizer_prices_master_copy": true}})");
  const auto priced = dtsim::cost::load_profile(priced_file.path());
  const dtsim::cost::ComputeCost c(g, plan, device, &priced);
  REQUIRE(a.grad_clear_seconds(1000000) > 0);
  CHECK(c.grad_clear_seconds(1000000) == Approx(1.5 * a.grad_clear_seconds(1000000)));
  CHECK(b.grad_clear_seconds(1000000) == 0);
  CHECK(c.optimizer_seconds(1000000) == Approx(1.5 * a.optimizer_seconds(1000000)));
  // In fp32 there is no 16-bit copy: the factor scales the same 28 bytes either way.
  dtsim::plan::Plan fp32 = plan;
  fp32.precision = dtsim::Precision::Fp32;
  auto plain32 = plain, in_run32 = in_run;
  plain32.precision = in_run32.precision = dtsim::Precision::Fp32;
  const dtsim::cost::ComputeCost a32(g, fp32, device, &plain32), b32(g, fp32, device, &in_run32);
  CHECK(b32.optimizer_seconds(1000000) == Approx(1.5 * a32.optimizer_seconds(1000000)));
}

TEST_CASE("measured op rates price the non-GEMM ops in the graph's own units", "[cost][profile]") {
  // Attention forward at 2 GFLOP/s of the graph's FLOPs, LayerNorm backward at 3 GB/s of the
  // graph's bytes, the optimizer at 6 GB/s of 28 bytes per parameter; the rest as before.
  TempFile f("profile_ops.json",
             profile_with_ops(R"({"op": "attention", "phase": "fwd", "flops_per_s": 2e9},
            {"op": "layernorm", "phase": "bwd", "bytes_per_s": 3e9, "seconds": 1e-4},
            {"op": "loss_statistics", "phase": "fwd", "bytes_per_s": 4e9},
            {"op": "optimizer", "phase": "step", "bytes_per_s": 6e9})"));
  const auto profile = dtsim::cost::load_profile(f.path());
  TinyGptCost t(profile);
  const auto& spec = t.spec;
  const auto& g = t.g;
  const auto& cost = t.cost;
  using dtsim::lower::Phase;
  int checked = 0;
  for (auto id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    if (op.kind == dtsim::model::OpKind::AttentionCore) {
      CHECK(cost.op_seconds(op, Phase::Forward) == Approx(op.fwd_flops / 2e9));
      CHECK(cost.op_seconds(op, Phase::Recompute) == Approx(op.fwd_flops / 2e9));
      ++checked;
    }
    if (op.kind == dtsim::model::OpKind::Norm) {
      CHECK(cost.op_seconds(op, Phase::Backward) == Approx(op.bwd_bytes / 3e9));
      // No forward rate: the roofline with the profile's bandwidth.
      CHECK(cost.op_seconds(op, Phase::Forward) == Approx(op.fwd_bytes / 1e10));
      ++checked;
    }
  }
  CHECK(checked == 3);  // one attention core, two norms
  // The loss statistics: the measured forward rate; a backward without work costs nothing.
  for (auto id : g.layer_ops(static_cast<int>(spec.layers))) {
    const auto& op = g.op(id);
    if (op.kind != dtsim::model::OpKind::LossStatistics) continue;
    CHECK(cost.op_seconds(op, Phase::Forward) == Approx(op.fwd_bytes / 4e9));
    CHECK(cost.op_seconds(op, Phase::Backward) == 0);
    ++checked;
  }
  CHECK(checked == 4);
  CHECK(cost.optimizer_seconds(1000000) == Approx(28e6 / 6e9));
}

TEST_CASE("bad op rates in a profile are rejected naming the entry", "[cost][profile][bad-input]") {
  auto bad = [](const char* ops, const char* message) {
    TempFile f(
        "bad_ops.json",
        std::string(
            R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}], "ops": )") +
            ops + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cost::load_profile(f.path()), InputError, message);
  };
  bad(R"([{"op": "softmax", "phase": "fwd", "bytes_per_s": 1}])",
      "bad_ops.json: ops[0].op: expected one of");
  bad(R"([{"op": "gelu", "phase": "fwd", "bytes_per_s": 1, "flops_per_s": 1}])",
      "ops[0].flops_per_s: give exactly one of flops_per_s and bytes_per_s");
  // Its own bounds (it read "a positive number (from 1e-12 to 1e+21)" for 0).
  bad(R"([{"op": "gelu", "phase": "fwd", "bytes_per_s": 0}])",
      "ops[0].bytes_per_s: expected bytes/s from 1 to 1e+14, got 0");
  bad(R"([{"op": "gelu", "phase": "fwd", "bytes_per_s": "fast"}])",
      "ops[0].bytes_per_s: expected a positive number");
  // Faster than a device file's bandwidth or peak: a unit or timing mistake.
  bad(R"([{"op": "gelu", "phase": "fwd", "bytes_per_s": 1e20}])",
      "bad_ops.json: ops[0].bytes_per_s: expected bytes/s from 1 to 1e+14, got 1e+20");
  bad(R"([{"op": "attention", "phase": "fwd", "flops_per_s": 1e20}])",
      "bad_ops.json: ops[0].flops_per_s: expected FLOP/s from 1 to 1e+17, got 1e+20");
  bad(R"({"op": "gelu"})", "bad_ops.json: ops: expected an array");
  // A rate nothing reads, or read as the wrong quantity, or given twice.
  bad(R"([{"op": "rmsnorm", "phase": "step", "bytes_per_s": 1}])",
      "ops[0].phase: rmsnorm has no \"step\" rate (its phases: fwd, bwd)");
  bad(R"([{"op": "optimizer", "phase": "fwd", "bytes_per_s": 1}])",
      "ops[0].phase: optimizer has no \"fwd\" rate (its phases: step)");
  bad(R"([{"op": "loss_statistics", "phase": "bwd", "bytes_per_s": 1}])",
      "ops[0].phase: loss_statistics has no \"bwd\" rate (its phases: fwd)");
  bad(R"([{"op": "loss", "phase": "fwd", "flops_per_s": 1}])",
      "ops[0].flops_per_s: loss is rated in bytes_per_s");
  bad(R"([{"op": "attention", "phase": "fwd", "bytes_per_s": 1}])",
      "ops[0].bytes_per_s: attention is rated in flops_per_s");
  bad(R"([{"op": "gelu", "phase": "fwd", "bytes_per_s": 1},
          {"op": "gelu", "phase": "bwd", "bytes_per_s": 1},
          {"op": "gelu", "phase": "fwd", "bytes_per_s": 2}])",
      "bad_ops.json: ops[2].op: gelu fwd is given twice");
}

TEST_CASE("measured collectives: throughput interpolated in log(bytes), latency below the table",
          "[cost][profile]") {
  TempFile f("profile_coll.json", R"({"device": "cpu-host", "source": "test data",
    "precision": "fp32", "gemm": [{"m": 8, "n": 8, "k": 8, "seconds": 1e-6}],
    "collectives": [{"kind": "all_reduce", "ranks": 2, "bytes": 4096, "seconds": 1e-5},
                    {"kind": "all_reduce", "ranks": 2, "bytes": 1048576, "seconds": 1e-3,
                     "algbw_bytes_per_s": 1, "busbw_bytes_per_s": 1}]})");
  const auto p = dtsim::cost::load_profile(f.path());
  CHECK(p.collective_seconds("all_reduce", 2, 4096) == Approx(1e-5));
  CHECK(p.collective_seconds("all_reduce", 2, 1048576) == Approx(1e-3));
  CHECK(p.collective_seconds("all_reduce", 2, 100) == Approx(1e-5));      // latency floor
  CHECK(p.collective_seconds("all_reduce", 2, 4194304) == Approx(4e-3));  // last rate
  const double mid = std::sqrt(4096.0 * 1048576.0);
  const double r1 = 4096 / 1e-5, r2 = 1048576 / 1e-3;
  CHECK(p.collective_seconds("all_reduce", 2, mid) == Approx(mid / ((r1 + r2) / 2)));
  CHECK_FALSE(p.collective_seconds("all_reduce", 4, 4096).has_value());
  CHECK_FALSE(p.collective_seconds("all_gather", 2, 4096).has_value());
  TempFile bad("bad_coll.json",
               R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
    "collectives": [{"kind": "all_reduce", "ranks": 1, "bytes": 8, "seconds": 1}]})");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::cost::load_profile(bad.path()), InputError,
      "bad_coll.json: collectives[0].ranks: expected at least 2, got 1");
  TempFile twice("twice_coll.json",
                 R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1, "seconds": 1}],
    "collectives": [{"kind": "all_reduce", "ranks": 2, "bytes": 8, "seconds": 1},
                    {"kind": "all_gather", "ranks": 2, "bytes": 8, "seconds": 1},
                    {"kind": "all_reduce", "ranks": 2, "bytes": 8, "seconds": 2}]})");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::cost::load_profile(twice.path()), InputError,
      "twice_coll.json: collectives[2].bytes: all_reduce over 2 ranks at 8 bytes is given twice");
}

TEST_CASE("a profile's started collectives price the collectives asked for started",
          "[cost][profile]") {
  // dtexec starts the data-parallel stream's collectives (MPI_Iallreduce and MPI_Wait), which
  // Open MPI runs slower than the blocking calls: a CPU calibration times both.
  TempFile f("profile_started.json", R"({"device": "cpu-host", "source": "test data",
    "precision": "fp32", "gemm": [{"m": 8, "n": 8, "k": 8, "seconds": 1e-6}],
    "collectives": [{"kind": "all_reduce", "ranks": 2, "bytes": 4096, "seconds": 1e-5},
                    {"kind": "all_reduce", "ranks": 2, "bytes": 4096, "seconds": 3e-5,
                     "started": true},
                    {"kind": "all_gather", "ranks": 2, "bytes": 4096, "seconds": 2e-5,
                     "started": false}]})");
  const auto p = dtsim::cost::load_profile(f.path());
  CHECK(p.collective_seconds("all_reduce", 2, 4096) == Approx(1e-5));
  CHECK(p.collective_seconds("all_reduce", 2, 4096, true) == Approx(3e-5));
  // Without started rows of a kind, a started one takes the blocking rows.
  CHECK(p.collective_seconds("all_gather", 2, 4096, true) == Approx(2e-5));
  CHECK_FALSE(p.collective_seconds("reduce_scatter", 2, 4096, true).has_value());
  auto bad = [](const char* collectives, const char* message) {
    TempFile b("bad_started.json",
               std::string(R"({"device": "x", "source": "s", "gemm": [{"m": 1, "n": 1, "k": 1,
                 "seconds": 1}], "collectives": )") +
                   collectives + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cost::load_profile(b.path()), InputError, message);
  };
  bad(R"([{"kind": "send_recv", "ranks": 2, "bytes": 8, "seconds": 1, "started": true}])",
      "bad_started.json: collectives[0].started: send_recv is not a collective that dtexec "
      "starts");
  bad(R"([{"kind": "all_reduce", "ranks": 2, "bytes": 8, "seconds": 1, "started": 1}])",
      "bad_started.json: collectives[0].started");
  bad(R"([{"kind": "all_reduce", "ranks": 2, "bytes": 8, "seconds": 1, "started": true},
         {"kind": "all_reduce", "ranks": 2, "bytes": 8, "seconds": 2, "started": true}])",
      "collectives[1].bytes: all_reduce (started) over 2 ranks at 8 bytes is given twice");
}

TEST_CASE("a profile that times the cross-entropy whole splits it between its two ops",
          "[cost][profile]") {
  // dtexec calibrate before 2026-12-03: "loss" timed the statistics and the loss together.
  TempFile f("profile_fused_loss.json",
             profile_with_ops(R"({"op": "loss", "phase": "fwd", "bytes_per_s": 5e9},
                                 {"op": "loss", "phase": "bwd", "bytes_per_s": 7e9})"));
  const auto profile = dtsim::cost::load_profile(f.path());
  CHECK(profile.loss_split_evenly);
  TinyGptCost t(profile);
  const auto& spec = t.spec;
  const auto& g = t.g;
  const auto& cost = t.cost;
  using dtsim::lower::Phase;
  const auto head = g.layer_ops(static_cast<int>(spec.layers));
  const auto& statistics = g.op(head[2]);
  const auto& loss = g.op(head[3]);
  REQUIRE(loss.kind == dtsim::model::OpKind::Loss);
  // The measured whole: the old graph's loss forward (8 bytes per logit) at the profile's rate.
  const double whole = loss.fwd_bytes / 5e9;
  CHECK(cost.op_seconds(statistics, Phase::Forward) == Approx(whole / 2));
  CHECK(cost.op_seconds(loss, Phase::Forward) == Approx(whole / 2));
  CHECK(cost.op_seconds(loss, Phase::Backward) == Approx(loss.bwd_bytes / 7e9));

  // A profile that times them apart keeps both rates.
  TempFile apart("profile_split_loss.json",
                 profile_with_ops(R"({"op": "loss_statistics", "phase": "fwd", "bytes_per_s": 4e9},
                                     {"op": "loss", "phase": "fwd", "bytes_per_s": 5e9})"));
  const auto measured = dtsim::cost::load_profile(apart.path());
  CHECK(!measured.loss_split_evenly);
  CHECK(measured.ops.at({"loss", "fwd"}).rate == 5e9);
  CHECK(measured.ops.at({"loss_statistics", "fwd"}).rate == 4e9);
}
