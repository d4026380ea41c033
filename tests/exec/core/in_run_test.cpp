// The in_run steps of dtexec calibrate on a device of bounded memory: as many of the model's
// blocks as dtsim memory says fit, at most the cap, none when one does not fit; and the ranks'
// spreads from a table of their phase times.
#include "exec/core/in_run.hpp"

#include <cmath>
#include <stdexcept>
#include <string>

#include "sim/common/error.hpp"
#include "sim/plan/memory_model.hpp"
#include "tests/test_util.hpp"

namespace {

double needs(const dtsim::model::ModelGraph& g) {
  dtsim::plan::MemoryOptions memory;
  memory.framework_overhead_bytes = 0;
  return dtsim::plan::estimate_memory(g, dtsim::exec::in_run_plan(g, dtsim::Precision::Bf16),
                                      dtsim::cluster::Cluster{}, memory)
      .worst()
      .total_bytes;
}

}  // namespace

TEST_CASE("in_run trains as many blocks as fit, up to the cap", "[runner]") {
  const auto spec = dtsim::model::load_model("llama3-8b");
  const double gib = 1024.0 * 1024 * 1024;
  using dtsim::exec::in_run_graph;
  // An H200's 80%: the cap, 8 of 32 blocks, well inside it.
  const auto h200 = in_run_graph(spec, 1, 4096, dtsim::Precision::Bf16, 0.8 * 141 * gib);
  REQUIRE(h200);
  CHECK(h200->spec().layers == 8);
  CHECK(h200->seq_len() == 4096);
  CHECK(needs(*h200) < 0.8 * 141 * gib);
  // 40 GiB: fewer, and the largest count that fits.
  const auto small = in_run_graph(spec, 1, 4096, dtsim::Precision::Bf16, 40 * gib);
  REQUIRE(small);
  const std::int64_t blocks = small->spec().layers;
  CHECK(blocks >= 1);
  CHECK(blocks < 8);
  CHECK(needs(*small) <= 40 * gib);
  auto more = spec;
  more.layers = blocks + 1;
  CHECK(needs(dtsim::model::ModelGraph(more, 1, 4096, 2)) > 40 * gib);
  // 4 GiB: not even the embedding, the head and one block with their AdamW state.
  CHECK_FALSE(in_run_graph(spec, 1, 4096, dtsim::Precision::Bf16, 4 * gib));
  // A model with fewer blocks than the cap trains them all.
  const auto tiny = dtsim::model::load_model("tiny-gpt");
  const auto all = in_run_graph(tiny, 1, 32, dtsim::Precision::Bf16, gib);
  REQUIRE(all);
  CHECK(all->spec().layers == std::min<std::int64_t>(tiny.layers, 8));
}

TEST_CASE("the ranks' lasting and transient spreads from a table of phase times", "[in_run]") {
  using dtsim::exec::phase_spread;
  // Two ranks, one 10% slower and one 10% faster in every round: all lasting.
  auto s = phase_spread({{0.9, 0.9, 0.9}, {1.1, 1.1, 1.1}});
  CHECK(std::sqrt(s.lasting_cv2) == Approx(std::sqrt(0.02)));
  REQUIRE(s.transient_cv2);
  CHECK(*s.transient_cv2 == Approx(0).margin(1e-15));
  // Every rank at each round's pace: neither (the host's drift, which no rank waits for).
  s = phase_spread({{1.0, 1.3, 0.8}, {1.0, 1.3, 0.8}});
  CHECK(s.lasting_cv2 == Approx(0).margin(1e-15));
  CHECK(*s.transient_cv2 == Approx(0).margin(1e-15));
  // Each rank slow in one round and fast in the other: transient only. Interactions +-0.1 over
  // (2 - 1)(2 - 1) degrees of freedom: 0.04; the means are equal, so nothing lasts.
  s = phase_spread({{1.1, 0.9}, {0.9, 1.1}});
  CHECK(*s.transient_cv2 == Approx(0.04));
  CHECK(s.lasting_cv2 == 0);
  // Both: rank means 1.1333 and 0.8667 (variance 0.035556), interactions 0.0667, -0.0333,
  // -0.0333 and their negatives (mean square 0.013333 / 2 = 0.0066667), of which each mean over
  // 3 rounds holds a third: 0.035556 - 0.0022222 = 0.033333 lasting.
  s = phase_spread({{1.2, 1.1, 1.1}, {0.8, 0.9, 0.9}});
  CHECK(*s.transient_cv2 == Approx(0.0066667).epsilon(1e-4));
  CHECK(s.lasting_cv2 == Approx(0.033333).epsilon(1e-4));
  // One round: no interaction to take out.
  s = phase_spread({{0.9}, {1.1}});
  CHECK(!s.transient_cv2);
  CHECK(s.lasting_cv2 == Approx(0.02));
}

TEST_CASE("a calibration on a noisy host says so", "[in_run]") {
  CHECK(!dtsim::exec::noisy_host_warning(0.03, std::nullopt));
  CHECK(!dtsim::exec::noisy_host_warning(0.0999, 0.05));
  const auto gemm = dtsim::exec::noisy_host_warning(0.123, 0.02);
  REQUIRE(gemm);
  CHECK(gemm->find("one GEMM's time from repeat to repeat varied by 12.3%") != std::string::npos);
  const auto ranks = dtsim::exec::noisy_host_warning(0.02, 0.15);
  REQUIRE(ranks);
  CHECK(ranks->find("a rank's phase time from round to round varied by 15.0%") !=
        std::string::npos);
  // The ranks' lasting speeds far apart: said, where nothing else is.
  CHECK(!dtsim::exec::noisy_host_warning(0.02, 0.01, 0.05));
  const auto lasting = dtsim::exec::noisy_host_warning(0.02, 0.01, 0.187);
  REQUIRE(lasting);
  CHECK(lasting->find("the ranks' speeds differed by 18.7% (std/mean) for the whole calibration") !=
        std::string::npos);
  // Both at once: both said.
  const auto both = dtsim::exec::noisy_host_warning(0.123, 0.01, 0.187);
  REQUIRE(both);
  CHECK(both->find("varied by 12.3%") != std::string::npos);
  CHECK(both->find("\nwarning: the ranks' speeds differed by 18.7%") != std::string::npos);
}

TEST_CASE("a calibration's profile is written only where dtsim reads it", "[exec][in_run]") {
  nlohmann::json profile = {{"device", "cpu-host"},
                            {"source", "a test"},
                            {"precision", "fp32"},
                            {"gemm", {{{"m", 64}, {"n", 64}, {"k", 64}, {"seconds", 1e-4}}}},
                            {"memory_bw_bytes_per_s", 1e10},
                            {"launch_overhead_s", 1e-6},
                            {"jitter_cv", 0.05}};
  CHECK_NOTHROW(dtsim::exec::check_profile_readable(profile, "p.json"));
  // A GEMM's repeats spread by 100% on a busy host: refused before anything is written, naming
  // the file, the field and why.
  profile["jitter_cv"] = 1.2;
  try {
    dtsim::exec::check_profile_readable(profile, "p.json");
    FAIL("a profile with jitter_cv 1.2 passed");
  } catch (const dtsim::InputError&) {
    FAIL("reported as bad input, not as a measurement");
  } catch (const dtsim::exec::MeasurementError& e) {  // (dtexec: "error:", not "internal error")
    const std::string what = e.what();
    CHECK(what.find("p.json was not written") != std::string::npos);
    CHECK(what.find("jitter_cv") != std::string::npos);
    CHECK(what.find("below 1, got 1.2") != std::string::npos);
    CHECK(what.find("too busy") != std::string::npos);
  }
}
