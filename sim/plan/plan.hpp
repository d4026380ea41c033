// A parallelization plan: Megatron-LM's knobs (DESIGN.md "CLI"), as plain data, its JSON form,
// and its validation against a model and a cluster.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sim/cluster/placement.hpp"
#include "sim/cluster/topology.hpp"
#include "sim/common/precision.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/model/model_spec.hpp"

namespace dtsim::plan {

// Gradient bucket size for data-parallel reduction: PyTorch DDP's default bucket_cap_mb = 25
// (torch.nn.parallel.DistributedDataParallel); Megatron-LM's DDP buckets similarly. The
// lowering's default (lower::LowerOptions), and what ZeRO-2 holds of full gradients.
inline constexpr std::uint64_t kGradientBucketBytes = 25ULL * 1024 * 1024;

enum class Schedule { GPipe, OneFOneB, Interleaved, ZeroBubble, PipeDreamAsync };
enum class Recompute { None, Selective, Full };
enum class Optimizer { Adam, Sgd };

// Sanity bounds (plan files and flags): degrees, virtual stages and blocks per chunk at most
// 2^20, micro-batches per step at most 2^24; one micro-batch's tokens are bounded by
// model::size_problem.
inline constexpr std::int64_t kMaxDegree = std::int64_t{1} << 20;
// --make-vocab-size-divisible-by at most this (a multiple of 65536 rows already pads any
// vocabulary to whole 128 KiB bf16 columns).
inline constexpr std::int64_t kMaxVocabMultiple = 65536;
// Megatron-LM's default --make-vocab-size-divisible-by (megatron/training/arguments.py).
inline constexpr int kDefaultVocabMultiple = 128;
inline constexpr std::int64_t kMaxMicroBatches = std::int64_t{1} << 24;

// The least fraction of gradient bytes a plan may send: PowerSGD at rank 1 sends (n + m) / (n m)
// of an n x m gradient (Vogels et al. 2019), 7.8e-5 for Llama 3 405B's 16384 x 53248 MLP
// projection; a hundred times below that, a typo.
inline constexpr double kLeastGradCompression = 1e-6;

struct Plan {
  int dp = 1;
  int tp = 1;
  int pp = 1;
  int cp = 1;
  int ep = 1;
  std::int64_t micro_batch_size = 1;
  std::int64_t global_batch_size = 1;
  std::int64_t seq_len = 0;
  Schedule schedule = Schedule::OneFOneB;
  int virtual_stages = 1;  // model chunks per pipeline rank (interleaved)
  int zero_stage = 0;
  Recompute recompute = Recompute::None;
  // The attention core's kernels (model::AttentionKernel). Unfused by default: what the
  // published Megatron-LM measurements ran (validation/) and what dtexec's GPU kernels run;
  // FlashAttention (Megatron-LM --use-flash-attn, Transformer Engine's fused attention) is
  // what training runs use today.
  model::AttentionKernel attention = model::AttentionKernel::Unfused;
  bool sequence_parallel = false;
  // Data-parallel gradient reduction overlapped with the backward pass (PyTorch DDP; Megatron-LM
  // --overlap-grad-reduce). False: it starts after the last backward pass, as Megatron-LM did in
  // 2021 (megatron/training.py, train_step: allreduce_gradients after forward_backward_func).
  bool overlap_grad_reduce = true;
  // ZeRO-1/2's all-gather of the updated weights overlapped with the next step's forward, a
  // block's weights gathered while the block before it computes, one block ahead (Megatron-LM
  // --overlap-param-gather with its distributed optimizer, off by default; its forward
  // pre-hooks wait for each bucket's gather). False: one all-gather after the optimizer step,
  // exposed. The simulated step starts with the gathers of the previous step's update (a
  // steady state).
  bool overlap_param_gather = false;
  // ZeRO-1 as Megatron-LM's distributed optimizer (--use-distributed-optimizer) runs it: the
  // gradients reduce-scattered and the updated weights all-gathered in place in contiguous
  // buffers, each rank's shard a contiguous range of them, so that neither collective stages
  // its tensors (no copies in time, ComputeCost::staging_seconds, nor packed buffers in
  // memory). False: staged, as dtexec and PyTorch FSDP2 do. ZeRO-1 only (Megatron-FSDP's
  // ZeRO-2/3 over per-unit buffers is not modelled).
  bool zero_in_place = false;
  // The backward's tensor-parallel collective at a column-parallel layer's input (the input
  // gradient's all-reduce, or its reduce-scatter with sequence parallelism) runs while the
  // layer's weight-gradient GEMM computes (NVIDIA/Megatron-LM,
  // megatron/core/tensor_parallel/layers.py, linear_with_grad_accumulation_and_async_allreduce;
  // the default since late 2021). False: it runs after the whole backward of the layer, as in
  // Megatron-LM's 2021 releases.
  bool overlap_tp_backward = true;
  // Weight gradients accumulate over micro-batches inside their GEMMs (Megatron-LM
  // --gradient-accumulation-fusion, its default since late 2021: the weight-gradient GEMM adds
  // into the fp32 main_grad, megatron/core/tensor_parallel/layers.py). False: each backward
  // writes a fresh gradient that a separate kernel adds into the accumulator, a memory pass per
  // parameter per micro-batch, as PyTorch autograd and Megatron-LM's 2021 DistributedDataParallel
  // do (megatron/model/distributed.py, _make_param_hook: param.main_grad.add_(param.grad)).
  bool grad_accumulation_fusion = true;
  // Pipeline transfers overlapped with compute (Megatron-LM --overlap-p2p-communication): a
  // send starts as soon as its tensor exists and the receiver has posted its receive ahead of
  // need. False, Megatron-LM's default (megatron/core/pipeline_parallel/p2p_communication.py:
  // batch_isend_irecv, wait, torch.cuda.synchronize()): a stage exchanges its tensors between
  // rounds of passes (lower/schedule.hpp), posting its receives once the compute before them
  // has ended; a transfer starts when both ends are ready, the receiver waits for all of it,
  // and with GPipe, 1F1B and interleaved so does the sender (sim/lower/lowering.cpp).
  bool overlap_p2p_comm = false;
  // Megatron-LM's scatter/gather of pipeline transfers (Narayanan et al. SC'21, Sec. 4.1;
  // --scatter-gather-tensors-in-pipeline, on by default in its 2021 releases): each tensor-
  // parallel rank sends and receives 1/tp of the activation tensor, and the receiving ranks
  // all-gather it over tp before use. Needs tp > 1 without sequence parallelism (which splits
  // the tensor already).
  bool scatter_gather_p2p = false;
  // The embedding and LM head's rows: the vocabulary padded to a multiple of this x tp, as
  // Megatron-LM pads it (--make-vocab-size-divisible-by, default 128;
  // megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding), so that its
  // vocab-parallel shards are equal and the LM head's GEMMs have aligned dimensions (GPT-2's
  // 50257 becomes 50304, as nanoGPT/llm.c pad it). The padded rows are classes no target
  // names; their logits enter the softmax, as in Megatron-LM. 1: pad to a multiple of tp only.
  int make_vocab_size_divisible_by = kDefaultVocabMultiple;
  Precision precision = Precision::Bf16;
  // Low-precision communication: activations (tp, cp, ep, pp) and gradients travel in this
  // precision's bytes (unset: the training precision's), as with fp8 or bf16 collectives.
  std::optional<Precision> comm_precision;
  // The weight gradients' precision: what they accumulate in over micro-batches, what the
  // data-parallel reduction sends (unless comm_precision says otherwise) and what memory holds
  // (fp32, bf16 or fp16). Unset: gradient_precision()'s rule.
  std::optional<Precision> grad_precision;
  // Gradient compression of the data-parallel reduction: the fraction of the gradient bytes
  // sent (1: none). Compressing and decompressing a bucket are memory passes over it, charged
  // to its collective (sim/engine/simulator.cpp).
  double grad_compression = 1.0;  // from kLeastGradCompression to 1
  // Expert parallelism's routing: the token copies the busiest ep rank's experts get, over the
  // even share (1: even routing, a well-balanced router's; at most max_expert_load, every token's
  // copies to that rank's experts as far as they hold; Megatron-LM's --moe-expert-capacity-factor
  // caps it where tokens beyond capacity are dropped). That rank's experts compute, keep and
  // receive this many times the even share, and every rank waits for it at the all-to-alls. `dtexec
  // run` measures it (expert_load).
  double expert_load = 1.0;
  Optimizer optimizer = Optimizer::Adam;
  // Gradient clipping by global norm (Megatron-LM --clip-grad; its default is 1.0): before the
  // optimizer step every rank sums the squares of the gradients it owns, the sums are
  // all-reduced (over dp x cp, then tp, then pp) and the gradients scaled by
  // min(1, clip_grad / (norm + 1e-6)). 0: no clipping, no such tasks.
  double clip_grad = 0;
  // Transformer blocks per model chunk (pp x virtual_stages entries), empty = even split.
  std::vector<int> layers_per_stage;
  std::vector<cluster::ParallelDim> order = cluster::Placement::default_order();

  std::int64_t devices() const { return std::int64_t{dp} * tp * pp * cp; }
  std::int64_t micro_batches() const { return global_batch_size / (micro_batch_size * dp); }
  cluster::ParallelDegrees degrees() const { return {tp, cp, ep, dp, pp}; }
};

// A Hugging Face config's sliding window that a sequence of seq_len tokens outgrows: dtsim
// prices full causal attention (ModelSpec::unmodelled_sliding_window). None within it.
std::optional<std::string> sliding_window_note(const model::ModelSpec& model, std::int64_t seq_len);

// The vocabulary padded as the plan pads it (Plan::make_vocab_size_divisible_by), and the model
// with that many embedding and LM-head rows: what a plan's ModelGraph is built from.
std::int64_t padded_vocab(std::int64_t vocab, const Plan& plan);
model::ModelSpec with_padded_vocab(model::ModelSpec spec, const Plan& plan);
// "vocabulary 50257 padded to 50304 (...)" when the plan pads it, else nothing.
std::optional<std::string> vocab_padding_note(const model::ModelSpec& spec, const Plan& plan);
// When the layers do not split evenly over pp x virtual stages (and layers_per_stage does not
// set them): how chunk_layers splits them.
std::optional<std::string> uneven_layers_note(const model::ModelSpec& spec, const Plan& plan);

// One broken rule, with a message that names it ("tp = 3 does not divide 64 attention heads").
struct PlanViolation {
  std::string rule;
  std::string message;
};

struct PlanCheck {
  std::vector<PlanViolation> errors;
  std::vector<std::string> warnings;  // allowed but unusual (ZeRO-2/3 with pp > 1)
  bool ok() const { return errors.empty(); }
};

PlanCheck check_plan(const Plan& plan, const model::ModelSpec& model, std::int64_t devices);
// Throws InputError listing every violation; returns the warnings.
std::vector<std::string> require_valid(const Plan& plan, const model::ModelSpec& model,
                                       std::int64_t devices);

// Blocks of each model chunk (pp x virtual_stages), the explicit split or the even one (earlier
// chunks take the remainder). Chunk c of a rank r is global chunk c*pp + r (Megatron order).
std::vector<int> chunk_layers(const Plan& plan, std::int64_t layers);

// The plan's gradient precision: as set, else Megatron-LM's rule: with bf16 (and fp8, which
// Megatron-LM runs on bf16 parameters) gradients accumulate and all-reduce in fp32
// (megatron/training/arguments.py: "bfloat16 requires gradient accumulation and all-reduce to
// be done in fp32", unless --grad-reduce-in-bf16); otherwise the training precision (fp16
// keeps 16-bit gradients, as in ZeRO's 16 bytes per parameter; fp32 and tf32, fp32).
Precision gradient_precision(const Plan& plan);

// Whether the optimizer step clears the rank's gradient buffer for the next step: where every
// gradient lives in one buffer through the step, reduced in place (ZeRO-0, ZeRO-1 in place, or
// a dp x cp group of one), as Megatron-LM's zero_grad_buffer memsets it each step. Staged
// ZeRO-1 clears a bucket when its reduce-scatter packs it; ZeRO-2/3 free their gradients.
inline bool optimizer_clears_gradients(const Plan& plan) {
  return plan.zero_stage == 0 || plan.zero_in_place || plan.dp * plan.cp <= 1;
}
// The same of the experts' gradients, reduced over their own data-parallel group (dp x cp /
// ep): also under staged ZeRO-1 where that is one rank each (dp = ep, cp 1), as no
// reduce-scatter packs them then (ZeRO-2/3 free them after the step all the same).
inline bool optimizer_clears_expert_gradients(const Plan& plan) {
  return optimizer_clears_gradients(plan) ||
         (plan.zero_stage == 1 && plan.dp / plan.ep * plan.cp <= 1);
}

// Whether each block's data-parallel gradients go out in buckets of their own (a block's
// gradients never share a bucket with the next block's): with ZeRO-3's gathers per block,
// which the zero-bubble schedule does per chunk instead, and the reduction overlapped with the
// backward pass, the reduce-scatters take their turns on the dp stream between the gathers of
// the blocks ahead (lowering; the planner's bucket count).
inline bool gradient_buckets_per_block(const Plan& plan) {
  return plan.zero_stage == 3 && plan.schedule != Schedule::ZeroBubble && plan.overlap_grad_reduce;
}

// What an expert load is (plan.expert_load), for messages about a value below 1.
inline constexpr std::string_view kExpertLoadExpected =
    "expected the busiest ep rank's token copies over the even share, at least 1";

// Megatron-LM balances the causal mask's work over cp: each cp rank takes two of 2·cp chunks of
// every sequence (the cost model's even split, and dtexec's layout), so 2·cp divides seq_len.
inline bool cp_splits_sequence(std::int64_t seq_len, int cp) {
  return cp == 1 || seq_len % (2 * static_cast<std::int64_t>(cp)) == 0;
}

// The largest expert_load that routing can make: a token sends at most one copy to each expert,
// so at most min(top_k, experts / ep) of its copies to one ep rank: min(ep, experts / top_k)
// times the even share (1 without experts or ep).
double max_expert_load(const model::ModelSpec& spec, const Plan& plan);

// Megatron-Core's all-to-all token dispatcher under sequence parallelism (tp > 1): each tp
// rank routes and dispatches only its 1/tp of the sequence (megatron/core/transformer/moe/
// token_dispatcher.py, MoEAlltoAllTokenDispatcher: num_local_tokens = S/TP*B); the copies that
// reach an expert's ranks are all-gathered over tp, since each tp rank holds a slice of every
// expert, and the experts' outputs reduce-scattered back before the all-to-all home. The routed
// experts then have no all-gather of their input, no reduce-scatter of their output and no
// all-reduce of the gates' gradients over tp (shared experts beside them have both, in a tp
// region of their own: mlp_tp_enter, mlp_tp_exit); the router's weight gradient, from a share of
// the tokens, is all-reduced over tp with the norms'. Without sequence parallelism every tp rank
// routes the whole sequence (its input is whole there) and sends its copies to its ep peers.
bool moe_local_dispatch(const model::ModelSpec& spec, const Plan& plan);

// Where a block's MLP enters the tensor-parallel region (Megatron-LM's f, before the op) and
// leaves it (g, after the op), as the lowering places them and the planner's closed form
// prices them: a dense MLP (a mixture's dense block's too) at its up and down projections; a
// mixture of experts at its router unless under moe_local_dispatch, and at the experts' down
// projection, or with shared experts at the shared down projection, which adds the routed
// output to its own; under moe_local_dispatch the shared experts enter at their up projection
// (the routed copies move by plan::expert_copies_bytes' collectives instead).
bool mlp_tp_enter(const model::ModelSpec& spec, const Plan& plan, const model::Op& op);
bool mlp_tp_exit(const model::ModelSpec& spec, const Plan& plan, const model::Op& op);

// The bytes of the tensor that enters `op`'s tensor-parallel region (model::Op::tp_enter_width
// per token: the block's normed input, or multi-head latent attention's latents), where
// `hidden_bytes` is one activation tensor of width h of the same tokens.
std::uint64_t tp_enter_bytes(const model::ModelSpec& spec, const model::Op& op,
                             std::uint64_t hidden_bytes);
// The bytes that sequence parallelism gathers again for a column-parallel `op`'s weight
// gradient: its GEMM's input (gemm_k a token; multi-head latent attention's key-value latent
// without the keys' RoPE part, which entered with it).
std::uint64_t tp_regather_bytes(const model::ModelSpec& spec, const model::Op& op,
                                std::uint64_t hidden_bytes);

// Whether `op`'s weight gradients are computed from the rank's share of the sequence under
// sequence parallelism, with weights whole on every tp rank, so that they are all-reduced over
// tp before the step (Megatron-LM's finalize_model_grads): the norms', multi-head latent
// attention's down projections' (Megatron-Core marks them sequence_parallel), and the routers'
// under moe_local_dispatch.
bool sp_partial_gradients(const model::ModelSpec& spec, const Plan& plan, const model::Op& op);

// Bytes of context parallelism's gather of K and V (and of their gradients' reduce-scatter):
// every cp rank's keys and values of this tp rank's heads (kv_width / tp and v_width / tp a
// token), of `hidden_bytes`' tokens (one activation tensor of width h). The lowering and the
// planner's closed form both price this.
std::uint64_t cp_kv_bytes(const model::ModelSpec& spec, const Plan& plan,
                          std::uint64_t hidden_bytes);

// Bytes one ep all-to-all of an MoE block moves for the busiest ep rank, one way: its tokens'
// top_k copies of width h, plan.expert_load times the even share. `hidden_bytes`: one
// activation tensor of the micro-batch's tokens on the rank (whole over tp); under
// moe_local_dispatch a tp rank's tokens are 1/tp of them. The lowering and the planner's
// closed form both price this.
std::uint64_t ep_all_to_all_bytes(const model::ModelSpec& spec, const Plan& plan,
                                  std::uint64_t hidden_bytes);

// Bytes of the copies an ep rank's experts got, all-gathered over tp under
// moe_local_dispatch (and their outputs reduce-scattered back): every tp rank's, so the
// whole sequence's share, plan.expert_load times the even one.
std::uint64_t expert_copies_bytes(const model::ModelSpec& spec, const Plan& plan,
                                  std::uint64_t hidden_bytes);

nlohmann::json to_json(const Plan& plan);
// Reads a plan file; fields are those of to_json(). Throws InputError naming file and field.
Plan plan_from_json(const nlohmann::json& j, const std::string& file);
Plan load_plan(const std::string& path);
// A plan file's straggler figure, `key` "jitter_cv" or "rank_spread_cv" (a dtsim whatif
// point's, which simulate takes where its flag is not given): a fraction in [0, 1); none where
// the file has none. InputError naming the file and field.
std::optional<double> plan_file_spread(const nlohmann::json& j, const std::string& file,
                                       std::string_view key);

std::string_view to_string(Schedule s);
std::string_view to_string(Recompute r);
std::string_view to_string(Optimizer o);
// Why `norm` cannot be a plan's clip_grad, or nothing: 0 (none), or a norm in the plan file's
// range (kSmallestFigure to kLargestFigure), so that every plan written can be read back (a
// checkpoint of dtexec run --clip-grad 1e30 could be neither resumed nor compared).
std::optional<std::string> clip_grad_problem(double norm);

bool parse_schedule(std::string_view text, Schedule& out);
bool parse_recompute(std::string_view text, Recompute& out);
bool parse_optimizer(std::string_view text, Optimizer& out);
// "dp=4 tp=8 pp=2 mbs=1 gbs=512 1f1b zero=1 recompute=full sp"
std::string summary(const Plan& plan);

}  // namespace dtsim::plan

namespace dtsim::plan {
// Fills what the user left unset (0): dp = devices / (tp·pp·cp), seq_len = the model's,
// global batch = micro-batch x dp x m with m = 1 without pipelining and 4·pp with it (so the
// 1F1B bubble (pp-1)/m stays under 25%). Returns one note per defaulted field. Throws
// InputError when dp cannot be derived, listing as well every rule the plan breaks whatever its
// dp (as require_valid does).
std::vector<std::string> complete_plan(Plan& plan, const model::ModelSpec& model,
                                       std::int64_t devices);
}  // namespace dtsim::plan
