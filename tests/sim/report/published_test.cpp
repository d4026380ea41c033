// The issue-3 accuracy targets: Korthikanti et al. 2022, Table 4, and Narayanan et al. SC'21,
// Table 1.
#include "sim/report/published.hpp"

#include <fmt/format.h>

#include <cmath>

#include "sim/common/error.hpp"
#include "tests/test_util.hpp"

TEST_CASE("Korthikanti Table 4: one 22B layer's forward and backward within 15%",
          "[report][validation]") {
  const auto rows =
      dtsim::read_csv(dtsim::test::repo_dir() / "validation" / "korthikanti_table4_layer_22b.csv");
  int checked = 0;
  std::string table = fmt::format("{:<20} {:<22} {:>10} {:>8} {:>8}\n", "recompute, SP", "metric",
                                  "predicted", "paper", "error");
  for (const auto& row : rows) {
    const std::string metric = row.at("metric");
    if (metric != "layer_forward_time" && metric != "layer_backward_time") continue;
    const auto s = dtsim::report::table4_setting(row.at("recompute"));
    const auto t = dtsim::report::korthikanti_22b_layer(s.recompute, s.sequence_parallel);
    const double predicted_ms = 1e3 * (metric == "layer_forward_time" ? t.forward_s : t.backward_s);
    const double paper_ms = std::stod(row.at("value"));
    const double error = predicted_ms / paper_ms - 1;
    table += fmt::format("{:<20} {:<22} {:>10.2f} {:>8.1f} {:>+7.1f}%\n", row.at("recompute"),
                         metric, predicted_ms, paper_ms, 100 * error);
    INFO(row.at("id") << ": predicted " << predicted_ms << " ms, published " << paper_ms << " ms");
    CHECK(std::abs(error) <= 0.15);
    ++checked;
  }
  fmt::print("{}", table);
  CHECK(checked == 10);  // five settings, forward and backward
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::report::table4_setting("sometimes"), dtsim::InputError,
                                  "expected none, selective or full");
}

TEST_CASE("Megatron Table 1: every row within 10%, the mean within 5%", "[report][validation]") {
  // Catalog defaults (selene.json's CUDA 11 GEMM rate), the paper's plans as Megatron-LM ran
  // them in 2021 (sim/report/published.cpp), no per-row tuning. The issue-3 targets: 10% per
  // row and 5% on average (2.2% when this was written, worst +6.1%).
  const auto rows =
      dtsim::read_csv(dtsim::test::repo_dir() / "validation" / "megatron_sc21_table1.csv");
  double sum = 0;
  int n = 0;
  std::string table = fmt::format("{:<16} {:>4} {:>4} {:>4} {:>3} {:>10} {:>7} {:>8}\n", "model",
                                  "tp", "pp", "dp", "v", "predicted", "paper", "error");
  for (const auto& row : rows) {
    if (row.at("metric") != "achieved_tflops_per_gpu") continue;
    const auto run = dtsim::report::megatron_table1_run(row);
    const double paper = std::stod(row.at("value"));
    const double error = run.prediction.tflops_per_gpu / paper - 1;
    table += fmt::format("{:<16} {:>4} {:>4} {:>4} {:>3} {:>10.1f} {:>7.0f} {:>+7.1f}%\n",
                         run.model, run.plan.tp, run.plan.pp, run.plan.dp, run.plan.virtual_stages,
                         run.prediction.tflops_per_gpu, paper, 100 * error);
    INFO(run.model << ": predicted " << run.prediction.tflops_per_gpu << " TFLOP/s, published "
                   << paper);
    CHECK(std::abs(error) <= 0.10);
    sum += std::abs(error);
    ++n;
  }
  table += fmt::format("mean absolute error {:.1f}%\n", 100 * sum / n);
  fmt::print("{}", table);
  REQUIRE(n == 10);
  CHECK(sum / n <= 0.05);
}

TEST_CASE("Llama 3 405B, Table 4: the planner's best plan at the paper's degrees within 20%",
          "[report][validation]") {
  // 8,192 and 16,384 H100s of Meta's RoCE cluster (catalog defaults, no per-row tuning). The
  // paper's tp, cp, pp, dp and batch; the rest (schedule, virtual stages, ZeRO, recompute,
  // micro-batch) the planner's choice among the plans that fit, with FlashAttention: what a user
  // of dtsim would get. 20%: the paper leaves those choices and its own schedule's changes
  // unstated. It does not say how it counts the attention core's FLOPs either: dense (as
  // Megatron-LM's formula, dtsim's model TFLOP/s) or causal (what FlashAttention computes), 29%
  // lower on the 131,072-token row, 4% on the others. The error is the paper's figure against
  // the nearer of the two counts (none between them).
  // When this was written: 8,192 GPUs -4.4%, 16,384 -8.7%, 131,072 tokens +18.8% (dense);
  // counted causal -8.1%, -12.2%, -15.2%. Once pipeline hops across pods shared the pod's
  // uplink with their stage's flows only (2026-12-05, as the SimGrid backend runs them; a
  // 1,024-GPU stage had been charged as though the pod's 3,072 GPUs all crossed): dense +0.5%,
  // -3.6%, +22.5%; causal -3.4%, -7.3%, -12.5%.
  const auto rows =
      dtsim::read_csv(dtsim::test::repo_dir() / "validation" / "llama3_table4_scaling.csv");
  std::string table =
      fmt::format("{:>6} {:>7} {:>4} {:<80} {:>9} {:>7} {:>7} {:>8} {:>8}\n", "gpus", "seq", "cp",
                  "plan (planner's)", "predicted", "causal", "paper", "dense", "causal");
  int n = 0;
  for (const auto& row : rows) {
    if (row.at("metric") != "achieved_tflops_per_gpu") continue;
    const auto run = dtsim::report::llama3_table4_run(row);
    const double paper = std::stod(row.at("value"));
    const double predicted = run.prediction.model_tflops_per_gpu;
    const double causal = run.causal_model_tflops_per_gpu;
    const double error = paper > predicted ? predicted / paper - 1
                         : paper < causal  ? causal / paper - 1
                                           : 0.0;
    table += fmt::format(
        "{:>6} {:>7} {:>4} {:<80} {:>9.1f} {:>7.1f} {:>7.0f} {:>+7.1f}% {:>+7.1f}%\n",
        row.at("gpus"), row.at("seq_len"), row.at("cp"), dtsim::plan::summary(run.plan), predicted,
        causal, paper, 100 * (predicted / paper - 1), 100 * (causal / paper - 1));
    INFO(row.at("id") << ": " << dtsim::plan::summary(run.plan) << " predicted " << predicted
                      << " TFLOP/s, published " << paper);
    CHECK(run.plan.tp == 8);
    CHECK(run.plan.pp == 16);
    CHECK(run.prediction.memory.fits);
    CHECK(std::abs(error) <= 0.20);
    CHECK(causal < predicted);
    ++n;
  }
  fmt::print("{}", table);
  CHECK(n == 3);
}
