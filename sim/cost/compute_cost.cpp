#include "sim/cost/compute_cost.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "sim/common/error.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::cost {

using lower::Phase;
using model::OpKind;

ComputeCost::ComputeCost(const model::ModelGraph& graph, const plan::Plan& plan,
                         const cluster::DeviceSpec& device, const Profile* profile)
    : graph_(graph),
      plan_(plan),
      peak_flops_(device.peak_flops_for(plan.precision)),
      gemm_eff_(device.efficiency.gemm.value),
      attention_eff_(device.efficiency.attention.value),
      hbm_bw_(device.memory_bw_bytes_per_s.value * device.efficiency.memory_bw.value),
      launch_s_(device.efficiency.launch_overhead_s.value),
      waves_(device.efficiency.gemm_waves),
      profile_(profile) {
  if (profile_ != nullptr) {
    if (profile_->precision != plan.precision) {
      throw InputError(fmt::format("{}: precision: {}, the plan uses {}", profile_->file,
                                   profile_->precision_said(), to_string(plan.precision)));
    }
    if (profile_->memory_bw_bytes_per_s) hbm_bw_ = *profile_->memory_bw_bytes_per_s;
    if (profile_->launch_overhead_s) launch_s_ = *profile_->launch_overhead_s;
    // The measured op rates this model's ops use, looked up once (op_seconds runs per
    // candidate in the planner).
    for (int k = 0; k < kOpKinds; ++k) {
      const std::string key = profile_key(static_cast<OpKind>(k));
      if (key.empty()) continue;
      for (const bool forward : {true, false}) {
        const auto it = profile_->ops.find({key, forward ? "fwd" : "bwd"});
        if (it != profile_->ops.end())
          op_rates_[rate_index(static_cast<OpKind>(k), forward)] = it->second;
      }
    }
    if (const auto it = profile_->ops.find({"optimizer", "step"}); it != profile_->ops.end()) {
      optimizer_rate_ = it->second.rate;
    }
  }
}

double ComputeCost::divisor(const model::Op& op) const {
  const bool tp_split = op.tp_split != model::TpSplit::None || plan_.sequence_parallel;
  return static_cast<double>(plan_.cp) * (tp_split ? plan_.tp : 1);
}

std::array<double, 3> ComputeCost::rank_gemm(const model::Op& op) const {
  // The rank's share of the forward GEMM (m x k) by (k x n): context parallelism splits the
  // tokens, column-parallel layers the outputs, row-parallel layers the inputs.
  double m = op.gemm_m / plan_.cp;
  double n = op.gemm_n, k = op.gemm_k;
  if (op.tp_split == model::TpSplit::Column || op.tp_split == model::TpSplit::Vocab) n /= plan_.tp;
  if (op.tp_split == model::TpSplit::Row) k /= plan_.tp;
  // Sequence parallelism splits the tokens of the ops tensor parallelism leaves whole (routers).
  if (op.tp_split == model::TpSplit::None && plan_.sequence_parallel) m /= plan_.tp;
  return {m, k, n};
}

double ComputeCost::profile_gemm_seconds(const model::Op& op, Phase phase) const {
  const double d = divisor(op);
  const auto [m, k, n] = rank_gemm(op);
  // A GEMM of the rank's shape at its measured time, when the op's FLOPs are that GEMM's
  // (not an MoE expert's, whose op counts all experts); else by its FLOPs alone.
  auto gemm = [&](double flops, double gm, double gn, double gk) {
    const bool shaped = !op.expert && std::abs(2.0 * gm * gn * gk - flops) <= 1e-9 * flops;
    return shaped ? profile_->gemm_seconds(gm, gn, gk) : profile_->gemm_seconds(flops);
  };
  // Forward [m,k]x[k,n]; input gradient [m,n]x[n,k]; weight gradient [k,m]x[m,n].
  const auto input = [&] { return gemm(op.bwd_input_flops / d, m, k, n); };
  const auto weight = [&] { return gemm(op.bwd_weight_flops / d, k, n, m); };
  switch (phase) {
    case Phase::Forward:
    case Phase::Recompute:
      return gemm(op.fwd_flops / d, m, n, k);
    case Phase::Backward:
      return (op.bwd_input_flops > 0 ? input() : 0.0) + (op.bwd_weight_flops > 0 ? weight() : 0.0);
    case Phase::BackwardInput:
      return op.bwd_input_flops > 0 ? input() : 0.0;
    case Phase::BackwardWeight:
      return op.bwd_weight_flops > 0 ? weight() : 0.0;
    case Phase::Optimizer:
    case Phase::GradNorm:
    case Phase::None:
      return 0.0;
  }
  return 0.0;
}

double ComputeCost::wave_factor(const model::Op& op, Phase phase) const {
  if (!waves_ || op.gemm_m <= 0 || op.expert) return 1.0;
  const auto [m, k, n] = rank_gemm(op);
  // Useful outputs over the outputs of the waves run: tiles cover the output matrix (the
  // padding of edge tiles is tile quantization) and run sm_count at a time.
  const auto efficiency = [&](double rows, double cols) {
    const double tm = static_cast<double>(waves_->tile_m);
    const double tn = static_cast<double>(waves_->tile_n);
    const double sms = static_cast<double>(waves_->sm_count);
    const double tiles = std::ceil(rows / tm) * std::ceil(cols / tn);
    return rows * cols / (std::ceil(tiles / sms) * sms * tm * tn);
  };
  // Forward writes m x n; the input gradient (m x n)(n x k) writes m x k; the weight gradient
  // (k x m)(m x n) writes k x n. Each backward GEMM has half the backward FLOPs.
  switch (phase) {
    case Phase::Forward:
    case Phase::Recompute:
      return 1.0 / efficiency(m, n);
    case Phase::Backward:
      return 0.5 / efficiency(m, k) + 0.5 / efficiency(k, n);
    case Phase::BackwardInput:
      return 1.0 / efficiency(m, k);
    case Phase::BackwardWeight:
      return 1.0 / efficiency(k, n);
    case Phase::Optimizer:
    case Phase::GradNorm:
    case Phase::None:
      return 1.0;
  }
  return 1.0;
}

double ComputeCost::op_flops(const model::Op& op, Phase phase) const {
  const double d = divisor(op);
  switch (phase) {
    case Phase::Forward:
    case Phase::Recompute:
      return op.fwd_flops / d;
    case Phase::Backward:
      return (op.bwd_input_flops + op.bwd_weight_flops) / d;
    case Phase::BackwardInput:
      return op.bwd_input_flops / d;
    case Phase::BackwardWeight:
      return op.bwd_weight_flops / d;
    case Phase::Optimizer:
    case Phase::GradNorm:
    case Phase::None:
      return 0;
  }
  return 0;
}

double ComputeCost::kernel_flops(const model::Op& op, Phase phase) const {
  if (op.kernel_fwd_flops <= 0 && op.kernel_bwd_flops <= 0) return op_flops(op, phase);
  // Only the attention core has its own (model/model_graph.hpp), with no weight gradient: its
  // whole backward is the input-gradient pass.
  const double d = divisor(op);
  switch (phase) {
    case Phase::Forward:
    case Phase::Recompute:
      return op.executed_fwd_flops() / d;
    case Phase::Backward:
    case Phase::BackwardInput:
      return op.executed_bwd_flops() / d;
    case Phase::BackwardWeight:
    case Phase::Optimizer:
    case Phase::GradNorm:
    case Phase::None:
      return 0;
  }
  return 0;
}

double ComputeCost::op_seconds(const model::Op& op, Phase phase) const {
  // The busiest ep rank's experts compute plan.expert_load times the even share of copies
  // (the whole kernel time scales, its weight traffic too: a slight overestimate where that
  // traffic counts).
  // Its token moves are over the rank's own tokens, however many its experts receive.
  const double s =
      kernel_seconds(op, phase) * plan::expert_load_of(op, plan_) + move_seconds(op, phase);
  if (profile_ == nullptr || !profile_->in_run) return s;
  const bool forward = phase == Phase::Forward || phase == Phase::Recompute;
  return s * (forward ? profile_->in_run->forward : profile_->in_run->backward);
}

double ComputeCost::kernel_seconds(const model::Op& op, Phase phase) const {
  const double d = divisor(op);
  const double flops = op_flops(op, phase);
  // The rank's share of the op's traffic: activations split like its work (d), weights split
  // over tp like the op and over ep for experts, never over cp. The backward moves the same mix
  // bwd_bytes / fwd_bytes times.
  const double weight_split =
      (op.tp_split == model::TpSplit::None ? 1.0 : static_cast<double>(plan_.tp)) *
      (op.expert ? static_cast<double>(plan_.ep) : 1.0);
  double fwd_share = (op.fwd_bytes - op.weight_bytes) / d + op.weight_bytes / weight_split;
  double bwd_share = op.fwd_bytes > 0 ? op.bwd_bytes / op.fwd_bytes * fwd_share : op.bwd_bytes / d;
  if (op.kind == OpKind::Embedding && plan_.tp > 1) {
    // A vocabulary-parallel embedding looks up only its shard's rows of the table, but every
    // tp rank writes the whole output, zeros for the other shards' tokens, for the reduction
    // to sum (Megatron-LM's VocabParallelEmbedding; dtexec's too), with or without sequence
    // parallelism. In units of the output (p = 1 with learned positions, added on one tp rank
    // in dtexec, the busiest): the forward reads 1/tp of rows and p of positions and writes 1,
    // of the op's 2 + p; the backward reads the output gradient's rows of the shard's tokens
    // (all of them where the positions' gradient needs them) and updates the shard's rows of
    // the table gradient (2/tp) and the positions' (2p), of the op's 3 + 2p.
    const double p = graph_.spec().positions == model::Positions::Learned ? 1.0 : 0.0;
    const double tp = plan_.tp;
    fwd_share = op.fwd_bytes / plan_.cp * (1.0 / tp + p + 1.0) / (2.0 + p);
    bwd_share =
        op.bwd_bytes / plan_.cp * ((p > 0 ? 1.0 : 1.0 / tp) + 2.0 / tp + 2.0 * p) / (3.0 + 2.0 * p);
  }
  double bytes = 0;
  int kernels = 1;
  switch (phase) {
    case Phase::Forward:
    case Phase::Recompute:
      bytes = fwd_share;
      break;
    case Phase::Backward:
      bytes = bwd_share;
      kernels = op.bwd_weight_flops > 0 ? 2 : 1;
      break;
    case Phase::BackwardInput:
    case Phase::BackwardWeight: {
      // A GEMM's backward is two GEMMs of equal size: each takes half the traffic. Ops without
      // weights do all their backward work in the input-gradient pass.
      const bool has_weight_grad = op.bwd_weight_flops > 0;
      if (!has_weight_grad && phase == Phase::BackwardWeight) return 0;
      bytes = (has_weight_grad ? 0.5 : 1.0) * bwd_share;
      break;
    }
    case Phase::Optimizer:
    case Phase::GradNorm:
    case Phase::None:
      return 0;
  }
  // A pass without work (the loss statistics' backward) runs no kernel.
  if (bytes <= 0 && flops <= 0 && kernel_flops(op, phase) <= 0) return 0;
  // A measured rate for this op kind and phase, in the graph's own units.
  const bool forward = phase == Phase::Forward || phase == Phase::Recompute;
  if (const auto& rate = op_rates_[rate_index(op.kind, forward)]) {
    return (rate->flops ? flops : bytes) / rate->rate + accumulation_seconds(op, phase);
  }
  const bool attention = op.kind == OpKind::AttentionCore;
  const double eff = attention ? attention_eff_ : gemm_eff_;
  const double executed = kernel_flops(op, phase);
  double compute_s = executed > 0 ? executed / (peak_flops_ * eff) * wave_factor(op, phase) : 0.0;
  // A profile's GEMM times were measured: they hold whatever quantization the shapes had. A
  // combined backward is two GEMMs (input and weight gradients), each priced at its own shape.
  if (profile_ != nullptr && flops > 0 && op.gemm_m > 0)
    compute_s = profile_gemm_seconds(op, phase);
  const double memory_s = bytes / hbm_bw_;
  return std::max(compute_s, memory_s) + launch_s_ * kernels + accumulation_seconds(op, phase);
}

double ComputeCost::move_seconds(const model::Op& op, Phase phase) const {
  double bytes = 0;
  switch (phase) {
    case Phase::Forward:
    case Phase::Recompute:
      bytes = op.fwd_move_bytes;
      break;
    case Phase::Backward:
    case Phase::BackwardInput:
      bytes = op.bwd_move_bytes;
      break;
    case Phase::BackwardWeight:
    case Phase::Optimizer:
    case Phase::GradNorm:
    case Phase::None:
      return 0;
  }
  if (bytes <= 0) return 0;
  // The rank's tokens: its cp share, and its tp share only where each tp rank dispatches its
  // own (plan::moe_local_dispatch, under sequence parallelism); else every tp rank moves them
  // all.
  const double split = static_cast<double>(plan_.cp) *
                       (plan::moe_local_dispatch(graph_.spec(), plan_) ? plan_.tp : 1);
  return memory_kernel_seconds(bytes / split);
}

double ComputeCost::accumulation_seconds(const model::Op& op, Phase phase) const {
  if (plan_.grad_accumulation_fusion) return 0;
  // The pass that computes the weight gradient: the weight-gradient GEMM's, or, for ops
  // without one (norms, the embedding), the one pass of their backward.
  const Phase weight_pass = op.bwd_weight_flops > 0 ? Phase::BackwardWeight : Phase::BackwardInput;
  if (phase != Phase::Backward && phase != weight_pass) return 0;
  const double params = plan::rank_params(op, plan_);
  if (params <= 0) return 0;
  // Read the fresh gradient (the training precision's width) and the accumulator, write the
  // accumulator: one memory-bound kernel.
  const double bytes = params * (plan::activation_bytes_per_element(plan_.precision) +
                                 2 * plan::state_bytes_per_param(plan_).gradients);
  return memory_kernel_seconds(bytes);
}

double ComputeCost::codec_seconds(std::uint64_t uncompressed, std::uint64_t compressed) const {
  return 2.0 * static_cast<double>(uncompressed + compressed) / hbm_bw_ + 2 * launch_s_;
}

bool ComputeCost::gather_copies_in() const {
  return plan_.zero_stage >= 3 || plan::state_bytes_per_param(plan_).weights < 4;
}

double ComputeCost::staging_seconds(lower::CollectiveKind kind, std::uint64_t bytes,
                                    std::int64_t ranks) const {
  if (ranks <= 1) return 0;
  const double b = static_cast<double>(bytes), slice = b / static_cast<double>(ranks);
  switch (kind) {
    case lower::CollectiveKind::AllGather:
      return gather_copies_in() ? 2 * slice / hbm_bw_ + launch_s_ : 0;
    case lower::CollectiveKind::ReduceScatter:
      return plan_.zero_in_place ? 0 : (2 * b + 3 * slice) / hbm_bw_ + 2 * launch_s_;
    default:
      return 0;
  }
}

double ComputeCost::task_seconds(const lower::Task& task) {
  DTSIM_ASSERT(task.kind == lower::TaskKind::Compute, "task_seconds needs a compute task");
  if (task.phase == Phase::Optimizer) {
    return optimizer_seconds(task.params) + grad_clear_seconds(task.cleared_params);
  }
  if (task.phase == Phase::GradNorm) return grad_norm_seconds(task.params);
  const auto key = std::make_tuple(task.op_begin, task.op_end, task.phase);
  if (auto it = memo_.find(key); it != memo_.end()) return it->second;
  double s = 0;
  for (std::int32_t id = task.op_begin; id < task.op_end; ++id) {
    s += op_seconds(graph_.op(static_cast<model::OpId>(id)), task.phase);
  }
  memo_.emplace(key, s);
  return s;
}

std::vector<std::string> ComputeCost::profile_coverage() const {
  std::vector<std::string> notes;
  if (profile_ == nullptr) return notes;
  const double smallest = profile_->gemm.front().flops(), largest = profile_->gemm.back().flops();
  int above = 0, below = 0;
  double most = 0, least = 0;
  std::vector<std::string> unrated;
  auto unrated_pass = [&](const std::string& what) {
    if (std::find(unrated.begin(), unrated.end(), what) == unrated.end()) unrated.push_back(what);
  };
  for (const model::Op& op : graph_.ops()) {
    if (op.gemm_m > 0) {
      const double d = divisor(op);
      const auto [m, k, n] = rank_gemm(op);
      // The forward, input-gradient and weight-gradient GEMMs, as profile_gemm_seconds prices
      // them (an expert's by its FLOPs alone).
      const std::array<std::tuple<double, double, double, double>, 3> passes = {{
          {op.fwd_flops / d, m, n, k},
          {op.bwd_input_flops / d, m, k, n},
          {op.bwd_weight_flops / d, k, n, m},
      }};
      for (const auto& [flops, gm, gn, gk] : passes) {
        if (flops <= 0) continue;
        const bool shaped = !op.expert && std::abs(2.0 * gm * gn * gk - flops) <= 1e-9 * flops;
        const bool measured = shaped && std::any_of(profile_->gemm.begin(), profile_->gemm.end(),
                                                    [&](const GemmSample& s) {
                                                      return s.m == gm && s.n == gn && s.k == gk;
                                                    });
        if (measured) continue;
        if (flops > largest) {
          ++above;
          most = std::max(most, flops);
        } else if (flops < smallest) {
          ++below;
          least = least == 0 ? flops : std::min(least, flops);
        }
      }
      continue;
    }
    const std::string key = profile_key(op.kind);
    if (key.empty()) continue;
    if (!op_rates_[rate_index(op.kind, true)]) unrated_pass(key + " fwd");
    if (op.kind != OpKind::LossStatistics && !op_rates_[rate_index(op.kind, false)]) {
      unrated_pass(key + " bwd");
    }
  }
  if (!optimizer_rate_) unrated_pass("optimizer step");
  if (above > 0) {
    notes.push_back(fmt::format(
        "profile {}: {} of the model's GEMM passes (forward, input and weight gradients, at a "
        "rank's share) exceed its largest measured size ({:.3g} FLOPs; the most {:.3g}) and are "
        "priced at that size's throughput: an extrapolation (dtexec calibrate without --quick "
        "measures larger ones)",
        profile_->file, above, largest, most));
  }
  if (below > 0) {
    notes.push_back(fmt::format(
        "profile {}: {} of the model's GEMM passes (at a rank's share) are below its smallest "
        "measured size ({:.3g} FLOPs; the least {:.3g}) and are priced at that size's "
        "throughput: an extrapolation",
        profile_->file, below, smallest, least));
  }
  if (!unrated.empty()) {
    notes.push_back(fmt::format(
        "profile {} has no rate for {}: priced by the roofline at {} memory bandwidth (it was "
        "measured on a model without them)",
        profile_->file, fmt::join(unrated, ", "),
        profile_->memory_bw_bytes_per_s ? "the profile's" : "the device's"));
  }
  return notes;
}

std::string ComputeCost::profile_key(OpKind kind) const {
  const model::ModelSpec& m = graph_.spec();
  switch (kind) {
    case OpKind::AttentionCore:
      // What dtexec calibrate timed: its attention kernels of either kind.
      return graph_.attention() == model::AttentionKernel::Flash ? "flash_attention" : "attention";
    case OpKind::Norm:
      return m.norm == model::Norm::RmsNorm ? "rmsnorm" : "layernorm";
    case OpKind::Activation:
      return m.activation == model::Activation::SwiGlu ? "swiglu" : "gelu";
    case OpKind::Residual:
      return "residual";
    case OpKind::Embedding:
      return "embedding";
    case OpKind::LossStatistics:
      return "loss_statistics";
    case OpKind::Loss:
      return "loss";
    default:
      return "";
  }
}

double ComputeCost::optimizer_seconds(std::uint64_t params) const {
  const plan::StateBytesPerParam state = plan::state_bytes_per_param(plan_);
  // With 16-bit weights the step then casts the fp32 master to them, a pass of its own that
  // reads the master again (4 bytes) and writes the 16-bit copy: Megatron-LM's
  // _copy_main_params_to_model_params (megatron/optimizer/distrib_optimizer.py), dtexec's
  // refresh of the working weights. A profile whose optimizer factor was measured against a
  // price without that read holds it in the factor (Profile::InRun::prices_master_copy).
  const bool mixed = state.weights < 4;
  const bool master_read =
      profile_ == nullptr || !profile_->in_run || profile_->in_run->prices_master_copy;
  const double copy = mixed ? state.weights + (master_read ? 4.0 : 0.0) : 0.0;
  const double bytes_per_param =
      state.gradients + (plan_.optimizer == plan::Optimizer::Adam ? 24.0 : 16.0) + copy;
  return optimizer_pass_seconds(static_cast<double>(params) * bytes_per_param);
}

double ComputeCost::memory_kernel_seconds(double bytes) const {
  return bytes / hbm_bw_ + launch_s_;
}

double ComputeCost::optimizer_in_run() const {
  return profile_ != nullptr && profile_->in_run ? profile_->in_run->optimizer : 1.0;
}

double ComputeCost::optimizer_pass_seconds(double bytes) const {
  if (optimizer_rate_) return bytes / *optimizer_rate_ * optimizer_in_run();
  return memory_kernel_seconds(bytes) * optimizer_in_run();
}

double ComputeCost::grad_clear_seconds(std::uint64_t params) const {
  if (params == 0) return 0;
  // An older profile's optimizer factor holds the clear already (Profile::InRun::prices_clear).
  if (profile_ != nullptr && profile_->in_run && !profile_->in_run->prices_clear) return 0;
  const double bytes = static_cast<double>(params) * plan::state_bytes_per_param(plan_).gradients;
  return memory_kernel_seconds(bytes) * optimizer_in_run();
}

double ComputeCost::grad_norm_seconds(std::uint64_t params) const {
  // One read of the gradients (Megatron-LM's multi_tensor_l2norm), at the optimizer's measured
  // rate of state bytes where a profile has one. Scaling them when the norm is over the limit
  // (a pass on the steps that clip) is not counted.
  return optimizer_pass_seconds(static_cast<double>(params) *
                                plan::state_bytes_per_param(plan_).gradients);
}

}  // namespace dtsim::cost
