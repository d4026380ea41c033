// Predicted against published: Korthikanti et al. 2022 Table 4 (one 22B layer on TP8) and
// Narayanan et al. SC'21 Table 1 (GPT 1.7B-1T on up to 3,072 A100s), Llama Team 2024 Table 4
// (Llama 3 405B on up to 16,384 H100s), with catalog defaults and no per-row tuning
// (sim/report/published.hpp). Prints the error on every row and the mean
// absolute error.
//   build/bench/dtsim_validation [--csv] [validation-dir]
// The issue-3 targets: Table 4 within 15%, Table 1 within 10% per row and 5% on average (also
// tests, tests/sim/report/published_test.cpp).
#include <fmt/format.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "sim/common/csv.hpp"
#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"
#include "sim/report/published.hpp"

namespace {

int report(bool csv, const std::string& dir);

}  // namespace

int main(int argc, char** argv) {
  bool csv = false;
  std::string dir = dtsim::data_path("validation").string();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      fmt::print(
          "usage: dtsim_validation [--csv] [VALIDATION_DIR]\n"
          "  the published measurements (default: the repository's validation/) against dtsim's "
          "predictions, as a table (--csv: one row per figure)\n");
      return 0;
    }
    if (arg == "--csv") {
      csv = true;
    } else if (arg.starts_with("-")) {
      fmt::print(stderr, "dtsim_validation: unknown option {} (--help)\n", arg);
      return 2;
    } else {
      dir = arg;
    }
  }
  try {
    return report(csv, dir);
  } catch (const dtsim::Error& e) {
    fmt::print(stderr, "dtsim_validation: error: {}\n", e.what());
    return 2;
  }
}

namespace {

int report(bool csv, const std::string& dir) {
  std::vector<std::string> csv_rows;

  if (!csv) {
    fmt::print(
        "Korthikanti et al. 2022, Table 4: one 22B layer, TP8, micro-batch 4 (A100, Selene)\n");
    fmt::print("{:<20} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}\n", "recompute, SP", "fwd ms", "paper",
               "error", "bwd ms", "paper", "error");
  }
  double k_sum = 0;
  int k_n = 0;
  std::map<std::string, std::map<std::string, double>> table4;
  for (const auto& row : dtsim::read_csv(dir + "/korthikanti_table4_layer_22b.csv")) {
    table4[row.at("recompute")][row.at("metric")] = std::stod(row.at("value"));
  }
  for (const auto& [name, metrics] : table4) {
    const auto setting = dtsim::report::table4_setting(name);
    const auto t =
        dtsim::report::korthikanti_22b_layer(setting.recompute, setting.sequence_parallel);
    const double f = t.forward_s * 1e3, b = t.backward_s * 1e3;
    const double pf = metrics.at("layer_forward_time"), pb = metrics.at("layer_backward_time");
    const double ef = 100 * (f / pf - 1), eb = 100 * (b / pb - 1);
    k_sum += std::abs(ef) + std::abs(eb);
    k_n += 2;
    if (!csv) {
      fmt::print("{:<20} {:>8.2f} {:>8.1f} {:>+7.1f}% {:>8.2f} {:>8.1f} {:>+7.1f}%\n", name, f, pf,
                 ef, b, pb, eb);
    }
    csv_rows.push_back(fmt::format("korthikanti_table4,\"{} fwd\",{:.6g},{},ms", name, f, pf));
    csv_rows.push_back(fmt::format("korthikanti_table4,\"{} bwd\",{:.6g},{},ms", name, b, pb));
  }
  if (!csv) {
    fmt::print("mean absolute error {:.1f}% (target: every value within 15%)\n\n", k_sum / k_n);
    fmt::print("Narayanan et al. SC'21, Table 1: achieved TFLOP/s per GPU (Selene, A100 80GB)\n");
    fmt::print(
        "plans: the paper's tp/pp/dp and batch; micro-batch 1 with pipelining and 4 without\n"
        "(unstated in Table 1; the rule of Korthikanti et al. 2022, Table 3, same group and\n"
        "cluster); interleaved 1F1B with the smallest v >= 2 that gives equal chunks (1F1B\n"
        "without pipelining); full recompute;\n"
        "pipeline transfers blocking (Megatron-LM's batch_isend_irecv), scattered and gathered\n"
        "over tp as the paper's were (1/tp of the tensor sent, then a tp all-gather);\n"
        "dp gradients all-reduced after the last backward pass and tp input-gradient\n"
        "all-reduces after the weight gradients (no overlap), and weight gradients added\n"
        "into the main gradients by a kernel of their own per micro-batch, as Megatron-LM\n"
        "did in 2021; gradients clipped to norm 1 (Megatron-LM's default); GEMMs at\n"
        "selene.json's CUDA 11 rate (73.7% of peak)\n");
    fmt::print("{:<16} {:>4} {:>4} {:>4} {:>3} {:>10} {:>9} {:>8}\n", "model", "tp", "pp", "dp",
               "v", "predicted", "paper", "error");
  }
  double m_sum = 0, m_max = 0;
  int m_n = 0;
  for (const auto& row : dtsim::read_csv(dir + "/megatron_sc21_table1.csv")) {
    if (row.at("metric") != "achieved_tflops_per_gpu") continue;
    const auto run = dtsim::report::megatron_table1_run(row);
    const double predicted = run.prediction.tflops_per_gpu;
    const double paper = std::stod(row.at("value"));
    const double err = 100 * (predicted / paper - 1);
    m_sum += std::abs(err);
    m_max = std::max(m_max, std::abs(err));
    ++m_n;
    if (!csv) {
      fmt::print("{:<16} {:>4} {:>4} {:>4} {:>3} {:>10.1f} {:>9.0f} {:>+7.1f}%\n", run.model,
                 run.plan.tp, run.plan.pp, run.plan.dp, run.plan.virtual_stages, predicted, paper,
                 err);
    }
    csv_rows.push_back(fmt::format("megatron_sc21_table1,{},{:.6g},{},TFLOP/s per GPU", run.model,
                                   predicted, paper));
  }
  if (!csv) {
    fmt::print(
        "mean absolute error {:.1f}%, worst {:.1f}% (target: every row within 10%, mean 5%)\n\n",
        m_sum / m_n, m_max);
    fmt::print(
        "Llama Team 2024, Table 4: Llama 3 405B, model TFLOP/s per GPU (Meta's RoCE cluster, "
        "H100)\n"
        "plans: the paper's tp, cp, pp, dp and batch; schedule, virtual stages, ZeRO, recompute\n"
        "and micro-batch chosen by dtsim's planner among the plans that fit, FlashAttention\n"
        "(assumed); the paper does not give its FLOP count: 'dense' counts the attention core\n"
        "as Megatron-LM's formula, 'causal' half of it\n");
    fmt::print("{:>6} {:>7} {:>3} {:<82} {:>7} {:>7} {:>6} {:>8} {:>8}\n", "gpus", "seq", "cp",
               "plan", "dense", "causal", "paper", "error", "causal");
  }
  double l_sum = 0;
  int l_n = 0;
  for (const auto& row : dtsim::read_csv(dir + "/llama3_table4_scaling.csv")) {
    if (row.at("metric") != "achieved_tflops_per_gpu") continue;
    const auto run = dtsim::report::llama3_table4_run(row);
    const double dense = run.prediction.model_tflops_per_gpu;
    const double paper = std::stod(row.at("value"));
    const double err = 100 * (dense / paper - 1);
    const double causal_err = 100 * (run.causal_model_tflops_per_gpu / paper - 1);
    l_sum += std::abs(err);
    ++l_n;
    if (!csv) {
      fmt::print("{:>6} {:>7} {:>3} {:<82} {:>7.1f} {:>7.1f} {:>6.0f} {:>+7.1f}% {:>+7.1f}%\n",
                 row.at("gpus"), row.at("seq_len"), row.at("cp"), dtsim::plan::summary(run.plan),
                 dense, run.causal_model_tflops_per_gpu, paper, err, causal_err);
    }
    csv_rows.push_back(fmt::format("llama3_table4,\"{} GPUs, {} tokens\",{:.6g},{},TFLOP/s per GPU",
                                   row.at("gpus"), row.at("seq_len"), dense, paper));
  }
  if (!csv) {
    fmt::print(
        "mean absolute error {:.1f}% (dense count; test: every row within 20% by the nearer of the "
        "two counts)\n",
        l_sum / l_n);
  } else {
    fmt::print("table,row,predicted,published,unit\n");
    for (const auto& r : csv_rows) fmt::print("{}\n", r);
  }
  return 0;
}

}  // namespace
