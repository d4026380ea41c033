#include "sim/report/published.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "sim/common/error.hpp"
#include "sim/cost/compute_cost.hpp"
#include "sim/plan/memory_model.hpp"
#include "sim/planner/planner.hpp"

namespace dtsim::report {

model::ModelSpec korthikanti_22b_spec() {
  // Megatron's GPT blocks (GELU, LayerNorm, biases, dropout) at the 22B layer's size.
  auto spec = model::load_model("megatron-18.4b");
  spec.layers = 1;
  spec.hidden = 6144;
  spec.heads = 64;
  spec.kv_heads = 64;
  spec.head_dim = 96;
  spec.ffn_hidden = 4 * 6144;
  return spec;
}

LayerTimes korthikanti_22b_layer(plan::Recompute recompute, bool sequence_parallel) {
  const model::ModelSpec spec = korthikanti_22b_spec();
  plan::Plan plan;
  plan.tp = 8;
  plan.micro_batch_size = 4;
  plan.seq_len = 2048;
  plan.recompute = recompute;
  plan.sequence_parallel = sequence_parallel;
  const model::ModelGraph g = plan::graph_of(spec, plan);
  const auto selene = cluster::with_devices(cluster::load_cluster("selene"), 8);
  cost::ComputeCost cost(g, plan, selene.device);
  auto net = network::make_analytical(selene);
  const cluster::Placement layout(plan.degrees(), plan.order);
  const lower::Group tp{lower::GroupKind::Tp, {0, 1, 2, 3, 4, 5, 6, 7}, {0}};
  // The activations of a micro-batch in 16 bits: b·s·h·2 bytes.
  const std::uint64_t bytes = 4ULL * 2048 * 6144 * 2;
  using K = lower::CollectiveKind;
  // Forward: f and g of the attention and the MLP (all-gathers and reduce-scatters with
  // sequence parallelism, else g's all-reduces).
  const double gather = net->collective_s(layout, tp, K::AllGather, bytes);
  const double comm = sequence_parallel
                          ? 2 * (gather + net->collective_s(layout, tp, K::ReduceScatter, bytes))
                          : 2 * net->collective_s(layout, tp, K::AllReduce, bytes);
  // Backward: g's all-gathers (sequence parallelism), and f's input-gradient collectives, which
  // Megatron-LM of 2022 runs during the QKV and MLP-up weight gradients (plan
  // overlap_tp_backward): only what outlasts those GEMMs adds. With sequence parallelism the
  // QKV and MLP-up inputs are gathered again during their input gradients (lowering:
  // regathers_input): what outlasts those adds too.
  const double f =
      net->collective_s(layout, tp, sequence_parallel ? K::ReduceScatter : K::AllReduce, bytes);
  double bwd_comm = sequence_parallel ? 2 * gather : 0.0;
  double fwd = 0, bwd = 0, attention = 0;
  for (model::OpId id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    fwd += cost.op_seconds(op, lower::Phase::Forward);
    bwd += cost.op_seconds(op, lower::Phase::Backward);
    if (op.kind == model::OpKind::AttentionCore) {
      attention = cost.op_seconds(op, lower::Phase::Forward);
    }
    if (op.kind == model::OpKind::QkvProj || op.kind == model::OpKind::MlpUp) {
      bwd_comm += std::max(0.0, f - cost.op_seconds(op, lower::Phase::BackwardWeight));
      if (sequence_parallel) {
        bwd_comm += std::max(0.0, gather - cost.op_seconds(op, lower::Phase::BackwardInput));
      }
    }
  }
  LayerTimes t{fwd + comm, bwd + bwd_comm};
  if (recompute == plan::Recompute::Full) t.backward_s += fwd + comm;
  if (recompute == plan::Recompute::Selective) t.backward_s += attention;
  return t;
}

Table4Setting table4_setting(std::string_view column) {
  Table4Setting s;
  if (column.find("full") != std::string_view::npos) {
    s.recompute = plan::Recompute::Full;
  } else if (column.find("selective") != std::string_view::npos) {
    s.recompute = plan::Recompute::Selective;
  } else if (column.find("none") == std::string_view::npos) {
    throw InputError(
        fmt::format("Table 4 recompute column \"{}\": expected none, selective or "
                    "full",
                    column));
  }
  s.sequence_parallel =
      column.find("no SP") == std::string_view::npos && column.find("SP") != std::string_view::npos;
  return s;
}

namespace {
// A whole number of a validation row, or an InputError naming the row and the column.
std::int64_t whole(const CsvRow& row, const std::string& column) {
  const std::string& text = row.at(column);
  std::size_t used = 0;
  std::int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size()) {
    throw InputError(fmt::format("validation row {}: {}: expected a whole number, got \"{}\"",
                                 row.at("id"), column, text));
  }
  return v;
}
}  // namespace

Table1Case megatron_table1_case(const CsvRow& row) {
  static const std::map<std::string, std::string> names = {
      {"1.7", "megatron-1.7b"},     {"3.6", "megatron-3.6b"},     {"7.5", "megatron-7.5b"},
      {"18.4", "megatron-18.4b"},   {"39.1", "megatron-39.1b"},   {"76.1", "megatron-76.1b"},
      {"145.6", "megatron-145.6b"}, {"310.1", "megatron-310.1b"}, {"529.6", "megatron-529.6b"},
      {"1008.0", "megatron-1t"}};
  const auto name = names.find(row.at("params_b"));
  if (name == names.end()) {
    throw InputError(fmt::format("Table 1 row {}: no model for {}B parameters", row.at("id"),
                                 row.at("params_b")));
  }
  Table1Case c;
  c.model = name->second;
  c.spec = model::load_model(c.model);
  c.cluster = cluster::with_devices(cluster::load_cluster("selene"), whole(row, "gpus"));
  const model::ModelSpec& spec = c.spec;
  plan::Plan& p = c.plan;
  p.tp = static_cast<int>(whole(row, "tp"));
  p.pp = static_cast<int>(whole(row, "pp"));
  p.dp = static_cast<int>(whole(row, "dp"));
  // Table 1 does not state the micro-batch size. The same group's configurations on the same
  // cluster a year later (Korthikanti et al. 2022, Table 3) use 4 for the model without
  // pipelining (22B, t = 8, p = 1) and 1 for every pipelined one (175B, 530B, 1T); dtsim takes
  // that rule.
  p.micro_batch_size = p.pp > 1 ? 1 : 4;
  p.global_batch_size = whole(row, "global_batch");
  p.seq_len = whole(row, "seq_len");
  p.recompute = plan::Recompute::Full;
  // fp16 with 16-bit gradients, as the paper's own scripts train (NVIDIA/Megatron-LM,
  // examples/sc21/CONFIG.sh: --fp16; A100's fp16 and bf16 peaks are equal).
  p.precision = Precision::Fp16;
  p.overlap_grad_reduce = false;
  p.overlap_tp_backward = false;
  // Gradients clipped to norm 1: Megatron-LM's default --clip-grad (megatron/arguments.py),
  // which the scripts do not change.
  p.clip_grad = 1.0;
  // Weight gradients added into the main gradients by a kernel of their own (2021's
  // DistributedDataParallel; gradient-accumulation fusion came later that year).
  p.grad_accumulation_fusion = false;
  // The paper's pipelined runs scatter and gather their transfers (Sec. 4.1; Table 1 notes).
  p.scatter_gather_p2p = p.pp > 1 && p.tp > 1;
  if (p.pp > 1) {
    const int per_stage = static_cast<int>(spec.layers / p.pp);
    for (int v = 2; v <= per_stage; ++v) {
      if (per_stage % v == 0) {
        p.virtual_stages = v;
        break;
      }
    }
    if (p.virtual_stages > 1) p.schedule = plan::Schedule::Interleaved;
  }
  plan::require_valid(p, spec, c.cluster.devices());
  return c;
}

engine::Prediction simulate_case(const Table1Case& c) {
  const model::ModelGraph g = plan::graph_of(c.spec, c.plan);
  auto net = network::make_analytical(c.cluster);
  return engine::simulate(g, c.plan, c.cluster, *net).prediction;
}

Table1Run megatron_table1_run(const CsvRow& row) {
  const Table1Case c = megatron_table1_case(row);
  return {c.model, c.plan, simulate_case(c)};
}

Llama3Table4Run llama3_table4_run(const CsvRow& row) {
  // The long-context row with Llama 3.1's 131072-token context (nothing else changes).
  const std::int64_t seq = whole(row, "seq_len");
  model::ModelSpec spec = model::load_model("llama3-405b");
  if (seq > spec.max_positions) spec = model::load_model("llama3.1-405b");
  const auto cluster =
      cluster::with_devices(cluster::load_cluster("h100-roce"), whole(row, "gpus"));
  planner::SearchSpace space;
  space.global_batch_size = whole(row, "global_batch");
  space.seq_len = seq;
  space.attention = model::AttentionKernel::Flash;
  space.fixed_tp = static_cast<int>(whole(row, "tp"));
  space.fixed_pp = static_cast<int>(whole(row, "pp"));
  space.fixed_cp = static_cast<int>(whole(row, "cp"));
  space.fixed_dp = static_cast<int>(whole(row, "dp"));
  space.max_cp = space.fixed_cp;
  const auto found = planner::search(spec, cluster, space, planner::SearchOptions{});
  const auto best = std::find_if(found.ranked.begin(), found.ranked.end(),
                                 [](const planner::Candidate& c) { return c.fits; });
  if (best == found.ranked.end()) {
    throw InputError(fmt::format("Table 4 row {}: no plan at its degrees fits", row.at("id")));
  }
  Llama3Table4Run run;
  run.plan = best->plan;
  const model::ModelGraph g = plan::graph_of(spec, run.plan);
  auto net = network::make_analytical(cluster);
  run.prediction = engine::simulate(g, run.plan, cluster, *net).prediction;
  // The attention core's dense FLOPs per step: per token and layer 4·s·(heads·head_dim) forward
  // (q·k^T and the weighted sum of v), three times that with the backward.
  const double tokens = static_cast<double>(space.global_batch_size) * static_cast<double>(seq);
  const double core = 12.0 * static_cast<double>(spec.layers) * static_cast<double>(seq) *
                      static_cast<double>(spec.heads * spec.head_dim) * tokens;
  const double gpus = static_cast<double>(run.prediction.gpus);
  run.causal_model_tflops_per_gpu =
      (run.prediction.model_flops - core / 2) / (run.prediction.step_time_s * gpus) / 1e12;
  return run;
}

}  // namespace dtsim::report
