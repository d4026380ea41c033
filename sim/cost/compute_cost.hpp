// Compute cost model: how long a compute task takes on one device.
//
// Roofline per op (DESIGN.md "Modeling rules"): max(flops / (peak · eff), bytes / (hbm_bw ·
// eff_bw)) + launch overhead per kernel, with `eff` the device catalog's GEMM efficiency for
// matrix multiplications and its attention efficiency for the attention core (over the FLOPs
// its kernels execute: FlashAttention's skip masked blocks and recompute). Each op's FLOPs
// and bytes come from the ModelGraph, divided as the plan splits the op: tensor-parallel ops
// over tp (but the vocabulary-parallel embedding writes its whole output on every tp rank);
// the others (norms, residual adds) over tp only with sequence parallelism; everything over cp
// (each context-parallel rank holds 1/cp of the tokens).
#pragma once

#include <array>
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "sim/cluster/device_catalog.hpp"
#include "sim/cost/profile.hpp"
#include "sim/lower/program.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::cost {

class ComputeCost {
 public:
  // With a calibration profile, GEMM times and the memory bandwidth come from its
  // measurements instead of the catalog's efficiencies (cost/profile.hpp). The profile must
  // outlive this object.
  ComputeCost(const model::ModelGraph& graph, const plan::Plan& plan,
              const cluster::DeviceSpec& device, const Profile* profile = nullptr);

  // Seconds for a compute task (lower::TaskKind::Compute); memoized by (ops, phase).
  double task_seconds(const lower::Task& task);
  // Seconds for one op in one phase on one rank, with the accumulation of its weight gradient
  // when that is a kernel of its own (below), times a profile's in_run factor of the phase.
  double op_seconds(const model::Op& op, lower::Phase phase) const;
  // Without gradient-accumulation fusion (plan grad_accumulation_fusion false), the kernel
  // that adds the weight gradient of one backward pass of `op` into its accumulator: a memory
  // pass over the rank's parameters of the op (0 in other phases and with fusion).
  double accumulation_seconds(const model::Op& op, lower::Phase phase) const;
  // The optimizer step over `params` parameters: memory-bound. Adam reads the gradient (its
  // plan::gradient_precision) and reads and writes the fp32 master weight, momentum and
  // variance; with 16-bit weights it then reads the master again and writes the 16-bit weight:
  // 2 + 8 + 8 + 8 + 4 + 2 = 32 bytes per parameter with 16-bit gradients, 34 with fp32 ones
  // (bf16's default; 30 with a profile calibrated before that read was priced), 4 + 8 + 16 = 28
  // in fp32; SGD with momentum 8 fewer.
  double optimizer_seconds(std::uint64_t params) const;
  // What the profile did not measure of this plan's compute, as notes (none without a
  // profile): a rank's GEMMs of more FLOPs than its largest measured size, or fewer than its
  // smallest, not of a measured shape (priced at that size's throughput, an extrapolation), and
  // the op kinds it has no rate for (priced by the roofline).
  std::vector<std::string> profile_coverage() const;
  // Gradient clipping's sum of squares over `params` gradients: one read of them.
  double grad_norm_seconds(std::uint64_t params) const;
  // Clearing `params` gradients for the next step (lower::Task::cleared_params): one write of
  // them, at the memory bandwidth plus a launch (Megatron-LM's zero_grad_buffer is one memset
  // of the contiguous buffer), times the profile's in_run factor of the optimizer, whose task
  // it is; 0 with a profile whose in_run factor was measured with the clear inside it (one
  // calibrated before 2026-12, Profile::InRun::prices_clear).
  double grad_clear_seconds(std::uint64_t params) const;
  // Gradient compression's codec for one collective: compress (read the uncompressed bytes,
  // write the compressed ones) and decompress the result (the converse), memory-bound passes
  // at the device's (or the profile's) memory bandwidth, two kernels.
  double codec_seconds(std::uint64_t uncompressed, std::uint64_t compressed) const;
  // ZeRO's data-parallel collectives, the memory passes around them as dtexec makes them: a
  // weight all-gather gathers each tensor in place (as DeepSpeed's ZeRO-3 and FSDP1's flat
  // parameters do), copying only this rank's slice of `bytes` (the gathered size) in from its
  // fp32 master (reads and writes bytes / ranks; a cast where the weights are narrower), and
  // nothing where that master slice already lies in the gathered tensor (ZeRO-1/2 in full
  // precision: gather_copies_in); a gradient reduce-scatter packs the bucket (reads and writes
  // bytes) and adds the reduced slice into the rank's accumulator (reads 2 bytes / ranks,
  // writes bytes / ranks), as PyTorch FSDP2's chunk_cat stages it. Memory-bound passes at the
  // device's (or the profile's) memory bandwidth, one kernel for a gather (dtexec launches one
  // per tensor, a few microseconds a block), two for a reduce-scatter; 0 for other kinds, and
  // for a reduce-scatter with plan zero_in_place (Megatron-LM's distributed optimizer reduces
  // in place in its contiguous buffer; its gather casts the updated slice into its bf16
  // buffer, a copy-in as above). Where a framework stages its gathers (FSDP2's copy-out of the
  // gathered tensors), this understates them by a pass over the gathered bytes.
  double staging_seconds(lower::CollectiveKind kind, std::uint64_t bytes, std::int64_t ranks) const;
  // Whether a weight all-gather copies the rank's slice in (see staging_seconds).
  bool gather_copies_in() const;

  // FLOPs of one op in one phase on one rank (for reports): the counted ones.
  double op_flops(const model::Op& op, lower::Phase phase) const;
  // What its kernels execute (model::Op::kernel_fwd_flops): op_flops but for FlashAttention's.
  double kernel_flops(const model::Op& op, lower::Phase phase) const;
  // Of op_seconds before a profile's in_run factor: the op's token moves
  // (model::Op::fwd_move_bytes), memory-bound kernels of their own.
  double move_seconds(const model::Op& op, lower::Phase phase) const;

 private:
  // A memory-bound pass of the optimizer step over `bytes`: at the profile's measured optimizer
  // rate where it has one, else the memory bandwidth plus a launch; times the profile's in_run
  // factor of the optimizer.
  double optimizer_pass_seconds(double bytes) const;
  // One memory-bound kernel that moves `bytes`: at the device's (or the profile's) memory
  // bandwidth, plus a launch.
  double memory_kernel_seconds(double bytes) const;
  // The profile's in_run factor of the optimizer step (1 without one).
  double optimizer_in_run() const;
  // op_seconds before the profile's in_run factor: the kernels as timed alone.
  double kernel_seconds(const model::Op& op, lower::Phase phase) const;
  double divisor(const model::Op& op) const;
  // How much longer than at the catalog's GEMM efficiency a GEMM op takes in `phase` on one
  // rank, from the device's wave quantization (1 without gemm_waves in the catalog).
  double wave_factor(const model::Op& op, lower::Phase phase) const;
  // The rank's share {m, k, n} of a GEMM op's forward [m,k]x[k,n].
  std::array<double, 3> rank_gemm(const model::Op& op) const;
  // A GEMM op's compute seconds in `phase` from the profile: each GEMM at its measured time
  // where the profile has its shape, else at the throughput of its FLOPs.
  double profile_gemm_seconds(const model::Op& op, lower::Phase phase) const;
  // An op kind's name in a profile's "ops" table ("" for GEMMs and kinds it does not list).
  std::string profile_key(model::OpKind kind) const;
  static constexpr int kOpKinds = static_cast<int>(model::OpKind::Loss) + 1;
  static std::size_t rate_index(model::OpKind kind, bool forward) {
    return static_cast<std::size_t>(kind) * 2 + (forward ? 0 : 1);
  }
  // The profile's measured rates by (op kind, forward or backward), and the optimizer's.
  std::array<std::optional<Profile::OpRate>, 2 * kOpKinds> op_rates_{};
  std::optional<double> optimizer_rate_;
  const model::ModelGraph& graph_;
  const plan::Plan& plan_;
  double peak_flops_;
  double gemm_eff_;
  double attention_eff_;
  double hbm_bw_;
  double launch_s_;
  std::optional<cluster::GemmWaves> waves_;
  const Profile* profile_;
  std::map<std::tuple<std::int32_t, std::int32_t, lower::Phase>, double> memo_;
};

}  // namespace dtsim::cost
