// Predicted against published: Korthikanti et al. 2022 Table 4 (one 22B layer on TP8) and
// Narayanan et al. SC'21 Table 1 (GPT 1.7B-1T on up to 3,072 A100s), with catalog defaults and
// no per-row tuning. Prints the error on every row and the mean absolute error.
//   build/bench/dtsim_validation [validation-dir]
// These are the issue-3 accuracy targets (Table 4 within 15%, Table 1 within 10% per row and 5%
// mean); until the cost model meets them this is a report, not a test.
#include <fmt/format.h>

#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "sim/common/csv.hpp"
#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"
#include "sim/cost/compute_cost.hpp"
#include "sim/engine/simulator.hpp"

namespace {

using dtsim::lower::Phase;

// One 22B layer (h 6144, 64 heads, s 2048, micro-batch 4) on 8 A100 with tp 8: the compute
// cost of its ops plus its tensor-parallel collectives (2 all-reduces forward and 2 backward;
// with sequence parallelism an all-gather and a reduce-scatter for each). Table 4's backward
// includes the recompute.
std::pair<double, double> layer_22b(dtsim::plan::Recompute recompute, bool sp) {
  auto spec = dtsim::model::load_model("megatron-18.4b");
  spec.layers = 1;
  spec.hidden = 6144;
  spec.heads = 64;
  spec.kv_heads = 64;
  spec.head_dim = 96;
  spec.ffn_hidden = 4 * 6144;
  dtsim::plan::Plan plan;
  plan.tp = 8;
  plan.micro_batch_size = 4;
  plan.seq_len = 2048;
  plan.recompute = recompute;
  plan.sequence_parallel = sp;
  const dtsim::model::ModelGraph g(spec, 4, 2048);
  const auto selene = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("selene"), 8);
  dtsim::cost::ComputeCost cost(g, plan, selene.device);
  auto net = dtsim::network::make_analytical(selene);
  const dtsim::lower::Group tp{dtsim::lower::GroupKind::Tp, {0, 1, 2, 3, 4, 5, 6, 7}, {0}};
  const std::uint64_t bytes = 4ULL * 2048 * 6144 * 2;
  using K = dtsim::lower::CollectiveKind;
  // Per pass: two all-reduces, or two all-gathers and two reduce-scatters with SP.
  const double comm = sp ? 2 * (net->collective_s(tp, K::AllGather, bytes) +
                                net->collective_s(tp, K::ReduceScatter, bytes))
                         : 2 * net->collective_s(tp, K::AllReduce, bytes);
  double fwd = 0, bwd = 0, attention = 0;
  for (dtsim::model::OpId id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    fwd += cost.op_seconds(op, Phase::Forward);
    bwd += cost.op_seconds(op, Phase::Backward);
    if (op.kind == dtsim::model::OpKind::AttentionCore)
      attention = cost.op_seconds(op, Phase::Forward);
  }
  double f = fwd + comm, b = bwd + comm;
  if (recompute == dtsim::plan::Recompute::Full) b += fwd + comm;
  if (recompute == dtsim::plan::Recompute::Selective) b += attention;
  return {f, b};
}

}  // namespace

int main(int argc, char** argv) {
  // build/bench/dtsim_validation [--csv] [validation-dir]
  bool csv = false;
  std::string dir = (dtsim::data_dir() / "validation").string();
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--csv") {
      csv = true;
    } else {
      dir = argv[i];
    }
  }
  std::vector<std::string> csv_rows;
  using R = dtsim::plan::Recompute;

  if (!csv)
    fmt::print(
        "Korthikanti et al. 2022, Table 4: one 22B layer, TP8, micro-batch 4 (A100, Selene)\n");
  if (!csv)
    fmt::print("{:<20} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}\n", "recompute, SP", "fwd ms", "paper",
               "error", "bwd ms", "paper", "error");
  double k_sum = 0;
  int k_n = 0;
  std::map<std::string, std::map<std::string, double>> table4;
  for (const auto& row : dtsim::read_csv(dir + "/korthikanti_table4_layer_22b.csv")) {
    table4[row.at("recompute")][row.at("metric")] = std::stod(row.at("value"));
  }
  for (const auto& [name, metrics] : table4) {
    const R r = name.find("full") != std::string::npos        ? R::Full
                : name.find("selective") != std::string::npos ? R::Selective
                                                              : R::None;
    const bool sp = name.find("no SP") == std::string::npos && name.find("SP") != std::string::npos;
    const auto [f, b] = layer_22b(r, sp);
    const double pf = metrics.at("layer_forward_time"), pb = metrics.at("layer_backward_time");
    const double ef = 100 * (f * 1e3 / pf - 1), eb = 100 * (b * 1e3 / pb - 1);
    k_sum += std::abs(ef) + std::abs(eb);
    k_n += 2;
    if (!csv) {
      fmt::print("{:<20} {:>8.2f} {:>8.1f} {:>+7.1f}% {:>8.2f} {:>8.1f} {:>+7.1f}%\n", name,
                 f * 1e3, pf, ef, b * 1e3, pb, eb);
    }
    csv_rows.push_back(
        fmt::format("korthikanti_table4,\"{} fwd\",{:.6g},{},ms", name, f * 1e3, pf));
    csv_rows.push_back(
        fmt::format("korthikanti_table4,\"{} bwd\",{:.6g},{},ms", name, b * 1e3, pb));
  }
  if (!csv)
    fmt::print("mean absolute error {:.1f}% (target: every value within 15%)\n\n", k_sum / k_n);

  if (!csv)
    fmt::print("Narayanan et al. SC'21, Table 1: achieved TFLOP/s per GPU (Selene, A100 80GB)\n");
  if (!csv)
    fmt::print(
        "plans: the paper's tp/pp/dp and batch; micro-batch 1; interleaved 1F1B with the\n"
        "smallest v >= 2 that gives equal chunks (1F1B without pipelining); full recompute;\n"
        "pipeline transfers whole (the paper's scatter/gather optimisation is not modelled);\n"
        "dp gradients all-reduced after the last backward pass, as Megatron-LM did in 2021\n");
  if (!csv)
    fmt::print("{:<16} {:>4} {:>4} {:>4} {:>3} {:>10} {:>9} {:>8}\n", "model", "tp", "pp", "dp",
               "v", "predicted", "paper", "error");
  double m_sum = 0, m_max = 0;
  int m_n = 0;
  const std::map<std::string, std::string> names = {
      {"1.7", "megatron-1.7b"},     {"3.6", "megatron-3.6b"},     {"7.5", "megatron-7.5b"},
      {"18.4", "megatron-18.4b"},   {"39.1", "megatron-39.1b"},   {"76.1", "megatron-76.1b"},
      {"145.6", "megatron-145.6b"}, {"310.1", "megatron-310.1b"}, {"529.6", "megatron-529.6b"},
      {"1008.0", "megatron-1t"}};
  for (const auto& row : dtsim::read_csv(dir + "/megatron_sc21_table1.csv")) {
    if (row.at("metric") != "achieved_tflops_per_gpu") continue;
    const auto spec = dtsim::model::load_model(names.at(row.at("params_b")));
    const int gpus = std::stoi(row.at("gpus"));
    const auto cluster = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("selene"), gpus);
    dtsim::plan::Plan p;
    p.tp = std::stoi(row.at("tp"));
    p.pp = std::stoi(row.at("pp"));
    p.dp = std::stoi(row.at("dp"));
    p.micro_batch_size = 1;
    p.global_batch_size = std::stoll(row.at("global_batch"));
    p.seq_len = std::stoll(row.at("seq_len"));
    p.recompute = R::Full;
    p.sequence_parallel = false;
    // Megatron-LM in 2021 all-reduced the gradients after the last backward pass
    // (megatron/training.py, train_step).
    p.overlap_grad_reduce = false;
    if (p.pp > 1) {
      const int per_stage = static_cast<int>(spec.layers / p.pp);
      for (int v = 2; v <= per_stage; ++v) {
        if (per_stage % v == 0) {
          p.virtual_stages = v;
          break;
        }
      }
      if (p.virtual_stages > 1) p.schedule = dtsim::plan::Schedule::Interleaved;
    }
    dtsim::plan::require_valid(p, spec, cluster.devices());
    const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len);
    auto net = dtsim::network::make_analytical(cluster);
    const auto sim = dtsim::engine::simulate(g, p, cluster, *net);
    const double paper = std::stod(row.at("value"));
    const double err = 100 * (sim.prediction.tflops_per_gpu / paper - 1);
    m_sum += std::abs(err);
    m_max = std::max(m_max, std::abs(err));
    ++m_n;
    if (!csv) {
      fmt::print("{:<16} {:>4} {:>4} {:>4} {:>3} {:>10.1f} {:>9.0f} {:>+7.1f}%\n", spec.name, p.tp,
                 p.pp, p.dp, p.virtual_stages, sim.prediction.tflops_per_gpu, paper, err);
    }
    csv_rows.push_back(fmt::format("megatron_sc21_table1,{},{:.6g},{},TFLOP/s per GPU", spec.name,
                                   sim.prediction.tflops_per_gpu, paper));
  }
  if (!csv)
    fmt::print(
        "mean absolute error {:.1f}%, worst {:.1f}% (target: every row within 10%, mean 5%)\n",
        m_sum / m_n, m_max);
  if (csv) {
    fmt::print("table,row,predicted,published,unit\n");
    for (const auto& r : csv_rows) fmt::print("{}\n", r);
  }
  return 0;
}
