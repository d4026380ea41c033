#include "sim/plan/memory_model.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "sim/common/error.hpp"
#include "sim/common/units.hpp"
#include "sim/plan/zero_bubble.hpp"

namespace dtsim::plan {

using model::ModelGraph;
using model::Op;
using model::TpSplit;

int activation_bytes_per_element(Precision precision) {
  return precision == Precision::Fp32 || precision == Precision::Tf32 ? 4 : 2;
}

model::ModelGraph graph_of(const model::ModelSpec& spec, const Plan& plan) {
  return model::ModelGraph(with_padded_vocab(spec, plan), plan.micro_batch_size, plan.seq_len,
                           activation_bytes_per_element(plan.precision), plan.attention);
}

StateBytesPerParam state_bytes_per_param(const Plan& plan) {
  const bool full = plan.precision == Precision::Fp32 || plan.precision == Precision::Tf32;
  const double weights = full ? 4 : 2;
  const double gradients = wire_bytes(gradient_precision(plan));
  const double moments = plan.optimizer == Optimizer::Adam ? 8 : 4;  // fp32 momentum (+ variance)
  const double master = full ? 0 : 4;                                // fp32 master weights
  return {weights, gradients, moments + master};
}

double gradient_wire_bytes(const Plan& plan) {
  return plan.comm_precision ? wire_bytes(*plan.comm_precision)
                             : state_bytes_per_param(plan).gradients;
}

ModelStates zero_model_states(double params, int zero_stage, int dp, StateBytesPerParam bytes) {
  DTSIM_ASSERT(dp >= 1 && zero_stage >= 0 && zero_stage <= 3, "bad ZeRO arguments");
  const double n = dp;
  ModelStates s;
  s.weights = params * bytes.weights / (zero_stage >= 3 ? n : 1.0);
  s.gradients = params * bytes.gradients / (zero_stage >= 2 ? n : 1.0);
  s.optimizer = params * bytes.optimizer / (zero_stage >= 1 ? n : 1.0);
  return s;
}

namespace {

// How many ways a saved tensor of `op` is split on one rank.
double activation_divisor(const Op& op, const Plan& plan) {
  const bool tp_split = op.saved_tp_split || plan.sequence_parallel;
  return static_cast<double>(plan.cp) * (tp_split ? plan.tp : 1);
}

// One rank's share of the part of `saved` bytes of `op`'s saved tensors that is not kept
// whole on every tp rank (`saved`: its saved_bytes, or that less a part of the split ones).
// An expert op's tensors are those of the copies the rank's experts got.
double rank_split_bytes(const Op& op, const Plan& plan, double saved) {
  return (saved - static_cast<double>(op.saved_tp_whole_bytes)) / activation_divisor(op, plan) *
         expert_load_of(op, plan);
}

// One rank's share of `saved` bytes of `op`'s saved tensors: the split part, and the part
// every tp rank keeps whole, split over cp only (an expert op's also the copies its experts
// got, but for the down op's outputs, which went back to their tokens' ranks: under
// plan::moe_local_dispatch, to their tokens' tp rank too).
double rank_saved_bytes(const Op& op, const Plan& plan, double saved) {
  const double whole = static_cast<double>(op.saved_tp_whole_bytes) / plan.cp;
  const bool local_dispatch = op.expert && plan.sequence_parallel && plan.tp > 1;
  const double outputs = local_dispatch ? 1.0 / plan.tp : 1.0;
  return rank_split_bytes(op, plan, saved) +
         whole * (op.kind == model::OpKind::MlpDown ? outputs : expert_load_of(op, plan));
}

// Activations of ops outside the blocks (embedding; final norm, LM head, loss).
double extra_activation_bytes(const ModelGraph& g, int group, const Plan& plan) {
  double bytes = 0;
  for (model::OpId id : g.layer_ops(group)) {
    const Op& op = g.op(id);
    bytes += rank_saved_bytes(op, plan, static_cast<double>(op.saved_bytes));
  }
  return bytes;
}

// What a deferred weight-gradient pass (zero-bubble's W) of one micro-batch keeps of `layer`:
// each weight GEMM's input and the gradient of its output, and a norm's with weights (its
// input and its output's gradient, of one shape: dtexec computes the norm's weight and bias
// gradients in the W pass, as the GEMMs'; tiny-llama at pp 2 read -8.5% on its last stage
// without them). A column-parallel GEMM's output is
// split over tp, as the vocabulary-parallel LM head's logits are (Megatron-LM's output layer is a
// ColumnParallelLinear); a row-parallel one's gradient is the whole (all-gathered) tensor.
double weight_pass_bytes(const ModelGraph& g, int layer, const Plan& plan) {
  const double a = activation_bytes_per_element(plan.precision);
  double w = 0;
  for (model::OpId id : g.layer_ops(layer)) {
    const Op& op = g.op(id);
    if (op.kind == model::OpKind::Norm && op.params > 0) {
      w += 2.0 * rank_saved_bytes(op, plan, static_cast<double>(op.saved_bytes));
      continue;
    }
    if (op.bwd_weight_flops <= 0 || op.gemm_m <= 0) continue;
    const bool column = op.tp_split == TpSplit::Column || op.tp_split == TpSplit::Vocab;
    // (A GEMM whose weights tp does not split runs on the rank's share of the sequence under
    // sequence parallelism: multi-head latent attention's down projection, a router.)
    const bool shard = op.tp_split == TpSplit::None && plan.sequence_parallel;
    const double out_split =
        static_cast<double>(plan.cp) * (column || shard ? static_cast<double>(plan.tp) : 1.0);
    // Its input: what it keeps, but an MoE down op's copies' outputs (the B pass used them).
    const auto saved = static_cast<double>(op.saved_bytes);
    w += op.kind == model::OpKind::MlpDown ? rank_split_bytes(op, plan, saved)
                                           : rank_saved_bytes(op, plan, saved);
    w += a * op.gemm_m * op.gemm_n / out_split * expert_load_of(op, plan);
  }
  return w;
}

// What zero-bubble's `stage` keeps at a moment of its pass order, and the passes that keep it.
struct ZbHeld {
  double bytes = 0;
  std::int64_t forwards = 0;
  std::int64_t weight_passes = 0;
};
// The most it keeps at any moment, at a forward's end, and in a B pass. A micro-batch whose
// forward awaits its B pass keeps `per_forward` (its blocks' activations, and the embedding's
// or the head and loss's on the first and last stage), one whose W pass waits keeps
// `per_weight_pass`; a running B pass turns the one into the other block by block, holding
// about the larger of the two besides its working tensors (the backward moment's). dtexec on
// cpu-small at pp 2 with 2 micro-batches of 4 (18.0 MiB a forward, 20.0 and 25.5 a W pass on
// the two stages) held 4.0 and 4.1 MiB above that in its B passes, the MLP activation's
// gradients; counting a B pass as its forward and a block's output gradients, and the
// moments on top of the stage's largest state, had predicted 92.1 MiB on the last stage where
// it held 87.2 (+5.7%).
struct ZbPeaks {
  ZbHeld any, forward_end, in_backward;
  ZbHeld forward_after_weight;  // (forwards 0: no forward follows a W pass)
  ZbHeld after_weight;          // right after a W pass, where its gradients go out
};
ZbPeaks zero_bubble_peaks(const Plan& plan, int stage, double per_forward, double per_weight_pass) {
  ZbPeaks peaks;
  for (const ZbState& state :
       zero_bubble_states(plan.pp, static_cast<int>(plan.micro_batches()), stage)) {
    const bool running = state.at == ZbAt::InBackward;
    const double held = (state.forwards - (running ? 1 : 0)) * per_forward +
                        state.pending * per_weight_pass +
                        (running ? std::max(per_forward, per_weight_pass) : 0.0);
    const ZbHeld h{held, state.forwards, state.pending};
    auto keep = [&](ZbHeld& most) {
      if (held > most.bytes) most = h;
    };
    keep(peaks.any);
    if (state.at == ZbAt::ForwardEnd) keep(peaks.forward_end);
    if (state.at == ZbAt::ForwardAfterWeight) keep(peaks.forward_after_weight);
    if (state.at == ZbAt::WeightEnd) keep(peaks.after_weight);
    if (running) keep(peaks.in_backward);
  }
  return peaks;
}

// A moment that can hold a stage's most memory: what it adds to the kept activations
// (working), takes from them (freed), and holds besides (other: gathered weights, gradients
// in a reduction).
struct Moment {
  const char* name = "";
  double working = 0, freed = 0, other = 0;
  const char* working_what = "";        // what the working bytes are (StageMemory::working_tensors)
  const ZbHeld* zero_bubble = nullptr;  // zero-bubble: the passes held then, where not the most
  // Of the stage's gradients, bytes not yet written then (ZeRO-2/3's unsharded experts' before
  // the step's first backward).
  double unwritten_gradients = 0;
  double extra() const { return working - freed - unwritten_gradients + other; }
};

// A tied LM head (no weights of its own) reads the embedding matrix: this rank's share of it,
// split over tp like the embedding; 0 for any other op.
double tied_table_params(const Op& op, const Plan& plan) {
  return op.kind == model::OpKind::LmHead && op.params == 0 ? op.gemm_k * op.gemm_n / plan.tp : 0.0;
}

// The data-parallel gradient buckets of a stage, filled as the lowering fills them (lower's
// grad_buckets): each chunk's gradients in backward order (its head, its blocks from the last,
// its embedding), an op's whole gradient at a time, until the bucket reaches
// kGradientBucketBytes; dense and expert gradients apart (those whose group has one rank are not
// reduced), and no bucket spans two chunks. So a bucket may pass the cap by an op's gradient:
// an embedding table or an LM head makes one of about its size (GPT-2's 147 MiB against the
// 25 MiB cap). Each bucket goes out once its last op's backward is done (the lowering places it
// after that block), while the blocks below it in its chunk, and the chunks before it, still
// keep a micro-batch's activations (`kept`). `embedding`: it carries the embedding's gradient
// (a tied table's, written by the head's backward, is held until this bucket goes out). The
// list is in the order a micro-batch's backward fills them: the last chunk's first, as the
// interleaved schedule runs a micro-batch's chunks backward from the last, so that a bucket's
// successor in the list is the one that fills while it is reduced.
struct GradientBucket {
  double bytes = 0;
  double kept = 0;
  bool embedding = false;
  int chunk = 0;  // the chunk of this rank it reduces
  // The gradients of the following buckets that the backward task filling this one writes as
  // well (its group's ops past the one that filled it): held when it goes out.
  double spill = 0;
  // It goes out at the end of its chunk's backward (what the chunk's last ops left in the
  // open buckets: dense and experts' both, with a mixture of experts).
  bool ends_pass = false;
};
// A group of a chunk's ops (-1: the embedding, layers: the head, else a block) and what it
// keeps of a micro-batch (its blocks' activations; the embedding's and head's are not counted).
struct OpGroup {
  int id = 0;
  double kept = 0;
};
std::vector<GradientBucket> gradient_buckets(const ModelGraph& g, const Plan& plan,
                                             const std::vector<std::vector<OpGroup>>& chunks,
                                             double bytes_per_param) {
  const auto cap = static_cast<double>(kGradientBucketBytes);
  const int dense_group = plan.dp * plan.cp;
  const int expert_group = dense_group / plan.ep;
  std::vector<GradientBucket> buckets;
  double lower_chunks = 0;  // what the chunks before this one keep
  for (const auto& groups : chunks) {
    for (const OpGroup& group : groups) lower_chunks += group.kept;
  }
  for (auto chunk = chunks.rbegin(); chunk != chunks.rend(); ++chunk) {
    const auto& groups = *chunk;
    const int c = static_cast<int>(chunks.rend() - chunk) - 1;
    double chunk_kept = 0;
    for (const OpGroup& group : groups) chunk_kept += group.kept;
    lower_chunks -= chunk_kept;
    double below = lower_chunks + chunk_kept;  // kept below the group run backward, and it
    std::array<GradientBucket, 2> open;        // dense, experts
    for (auto group = groups.rbegin(); group != groups.rend(); ++group) {
      below -= group->kept;  // freed by its backward, before its bucket goes out
      const auto& ops = g.layer_ops(group->id);
      for (auto id = ops.rbegin(); id != ops.rend(); ++id) {
        const Op& op = g.op(*id);
        if ((op.expert ? expert_group : dense_group) <= 1) continue;
        GradientBucket& b = open[op.expert ? 1 : 0];
        b.bytes += rank_params(op, plan) * bytes_per_param;
        b.embedding = b.embedding || group->id < 0;
        if (b.bytes >= cap) {
          // The group's backward writes its other gradients too, before this bucket goes out.
          double spill = 0;
          for (auto rest = std::next(id); rest != ops.rend(); ++rest) {
            const Op& o = g.op(*rest);
            if ((o.expert ? expert_group : dense_group) > 1) {
              spill += rank_params(o, plan) * bytes_per_param;
            }
          }
          buckets.push_back({b.bytes, below, b.embedding, c, spill});
          b = {};
        }
      }
    }
    const std::size_t closed = buckets.size();
    for (const GradientBucket& b : open) {
      if (b.bytes > 0) buckets.push_back({b.bytes, below, b.embedding, c, 0.0, true});
    }
    // (A bucket filled exactly by the chunk's last op ends it too.)
    if (buckets.size() == closed && !buckets.empty() && buckets.back().chunk == c) {
      buckets.back().ends_pass = true;
    }
  }
  return buckets;
}

}  // namespace

double expert_load_of(const Op& op, const Plan& plan) {
  return op.expert ? plan.expert_load : 1.0;
}

double rank_params(const Op& op, const Plan& plan) {
  // A tied head on a stage without the embedding (pp > 1) keeps its own copy of the embedding
  // matrix (Megatron-LM); with pp = 1 it uses the embedding itself.
  if (const double table = tied_table_params(op, plan); table > 0 && plan.pp > 1) return table;
  const double replicated = static_cast<double>(op.tp_replicated_params);
  const double split = static_cast<double>(op.params) - replicated;
  double p = split / (op.tp_split == TpSplit::None ? 1.0 : plan.tp) + replicated;
  if (op.expert) p /= plan.ep;
  return p;
}

namespace {

// One rank's share of a block's input, a hidden tensor of the micro-batch's tokens (Korthikanti
// Table 2: 2sbh; sharded over tp with sequence parallelism): the input its first norm saves.
double block_input_bytes(const ModelGraph& g, int layer, const Plan& plan) {
  const Op& first = g.op(g.layer_ops(layer).front());
  return static_cast<double>(first.saved_bytes) /
         (static_cast<double>(plan.cp) * (plan.sequence_parallel ? plan.tp : 1));
}

}  // namespace

double block_activation_bytes(const ModelGraph& g, int layer, const Plan& plan) {
  DTSIM_ASSERT(layer >= 0 && layer < g.spec().layers, "not a transformer block");
  // Only the block's input survives the forward pass.
  if (plan.recompute == Recompute::Full) return block_input_bytes(g, layer, plan);
  double bytes = 0;
  for (model::OpId id : g.layer_ops(layer)) {
    const Op& op = g.op(id);
    double saved = static_cast<double>(op.saved_bytes);
    if (plan.recompute == Recompute::Selective)
      saved -= static_cast<double>(op.saved_quadratic_bytes);
    bytes += rank_saved_bytes(op, plan, saved);
  }
  return bytes;
}

std::int64_t in_flight(const Plan& plan, int stage) {
  const std::int64_t m = plan.micro_batches();
  const std::int64_t p = plan.pp;
  if (p == 1) return 1;
  switch (plan.schedule) {
    case Schedule::GPipe:
      return m;
    case Schedule::Interleaved: {
      const std::int64_t v = plan.virtual_stages;
      return std::min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v);
    }
    case Schedule::OneFOneB:
    case Schedule::ZeroBubble:
      return std::min(p - stage, m);
    case Schedule::PipeDreamAsync:
      // Its step time is the steady state's, the pipeline full across steps: as many in flight
      // as stages from this one on, whatever m (their weight versions: weight_versions).
      return p - stage;
  }
  return m;
}

std::int64_t weight_versions(const Plan& plan, int stage) {
  if (plan.schedule != Schedule::PipeDreamAsync || plan.pp == 1) return 1;
  // The pp - stage micro-batches in flight are consecutive, and the weights change once every
  // m of them: they span at most 1 + ceil((pp - stage - 1) / m) versions.
  const std::int64_t m = plan.micro_batches();
  const std::int64_t k = plan.pp - stage;
  return 1 + (k - 1 + m - 1) / m;
}

std::int64_t end_in_flight(const Plan& plan, int stage) {
  const std::int64_t p = plan.pp;
  if (stage != 0 && stage != p - 1) return 0;
  if (plan.schedule != Schedule::Interleaved || p == 1) return in_flight(plan, stage);
  const std::int64_t m = plan.micro_batches();
  const std::int64_t v = plan.virtual_stages;
  const std::int64_t warmup = 2 * (p - stage - 1) + (v - 1) * p;
  if (m * v <= warmup) return m;
  return stage == p - 1 ? 1 : std::min(2 * p, m);
}

MemoryReport estimate_memory(const ModelGraph& g, const Plan& plan, const cluster::Cluster& cluster,
                             const MemoryOptions& options) {
  const model::ModelSpec& spec = g.spec();
  DTSIM_ASSERT(g.micro_batch() == plan.micro_batch_size && g.seq_len() == plan.seq_len &&
                   g.attention() == plan.attention,
               "the graph must be built for the plan's micro-batch, sequence length and attention");
  const std::vector<int> chunks = chunk_layers(plan, spec.layers);
  const StateBytesPerParam per_param = state_bytes_per_param(plan);
  const int v = plan.virtual_stages;

  MemoryReport report;
  report.capacity_bytes = options.capacity_bytes.value_or(cluster.device.memory_bytes.value);
  const auto& device_allowance = cluster.device.framework_overhead_bytes;
  const double allowance = options.framework_overhead_bytes.value_or(
      device_allowance ? device_allowance->value : kDefaultFrameworkOverheadBytes);
  const std::string allowance_source =
      options.framework_overhead_bytes ? "--framework-overhead-gib"
      : device_allowance               ? fmt::format("the device's: {}", device_allowance->source)
                                       : "assumed; --framework-overhead-gib";
  for (int stage = 0; stage < plan.pp; ++stage) {
    StageMemory s;
    s.stage = stage;
    s.in_flight = in_flight(plan, stage);
    double dense_params = 0;
    double expert_params = 0;
    double block_activations = 0;
    double largest_chunk_activations = 0;  // interleaved: the stage's largest chunk's
    bool equal_chunks = true;
    double weight_pass = 0;           // zero-bubble: what a deferred W pass keeps
    double largest_quadratic = 0;     // selective recompute: one block's recomputed s² tensors
    double largest_mlp_grads = 0;     // an MLP activation's backward: its gradients, in and out
    double last_block_kept = 0;       // what the stage's last block keeps of a micro-batch
    double largest_layer_params = 0;  // for ZeRO-3's gathered-weights buffer
    double largest_block_params = 0;  // of a transformer block alone (not the embedding, head)
    int blocks_here = 0;              // transformer blocks on this stage
    double largest_reduction = 0;     // ZeRO-3: the most parameters a block's reduce-scatter takes
    double tied_table = 0;            // ZeRO-3: a tied head's table, gathered for the embedding
    double embedding_params = 0;      // the first stage's embedding (and positions)
    // Each chunk's groups of ops, in forward order: its blocks, the embedding (-1) before them
    // in the first chunk, the head (layers) after them in the last.
    std::vector<std::vector<OpGroup>> chunk_groups;
    const bool experts_sharded = plan.dp * plan.cp / plan.ep > 1;
    double largest_block_experts = 0;  // a block's expert parameters, the most of any
    // Chunk c of this rank is global chunk c·pp + stage; global chunk k covers the blocks after
    // chunks 0..k-1.
    for (int c = 0; c < v; ++c) {
      const int k = c * plan.pp + stage;
      int first = 0;
      for (int i = 0; i < k; ++i) first += chunks[static_cast<std::size_t>(i)];
      const int count = chunks[static_cast<std::size_t>(k)];
      equal_chunks = equal_chunks && count == chunks[static_cast<std::size_t>(stage)];
      s.layers += count;
      const double before_chunk = block_activations;
      auto& groups = chunk_groups.emplace_back();
      if (k == 0) groups.push_back({-1, 0.0});
      for (int layer = first; layer < first + count; ++layer) {
        double layer_params = 0, layer_expert_params = 0;
        double quadratic = 0;
        // [0]: the dense MLP's or the routed experts'; [1]: the shared experts'.
        std::array<double, 2> mlp_grads{};
        for (model::OpId id : g.layer_ops(layer)) {
          const Op& op = g.op(id);
          // The gradients of the MLP activation's input and output have the shapes of what
          // it and the down GEMM keep (less the copies' outputs an MoE's down op keeps). The
          // shared experts' backward runs before the routed experts' and ends before theirs
          // begins: the larger of the two, not both; beside the shared experts' the gradient
          // of the routed output, which their down projection passes on (dtexec's
          // adds_routed), a hidden tensor of the rank's tokens.
          if (op.kind == model::OpKind::Activation || op.kind == model::OpKind::MlpDown) {
            // (A mixture's dense block has a dense MLP, no shared experts.)
            const bool shared = !op.expert && spec.has_experts(op.layer);
            mlp_grads[shared ? 1 : 0] +=
                rank_split_bytes(op, plan, static_cast<double>(op.saved_bytes));
            if (shared && op.kind == model::OpKind::MlpDown) {
              mlp_grads[1] += block_input_bytes(g, layer, plan);
            }
          }
          const double p = rank_params(op, plan);
          (op.expert ? expert_params : dense_params) += p;
          (op.expert ? layer_expert_params : layer_params) += p;
          if (plan.recompute == Recompute::Selective) {
            quadratic +=
                static_cast<double>(op.saved_quadratic_bytes) / activation_divisor(op, plan);
          }
        }
        // ZeRO-3 gathers and reduces the experts' over their own group, apart from the dense
        // ones; where that is one rank each (dp = ep, cp 1) they stay whole, in the weights.
        const double gathered_experts = experts_sharded ? layer_expert_params : 0.0;
        largest_layer_params = std::max(largest_layer_params, layer_params + gathered_experts);
        largest_block_params = std::max(largest_block_params, layer_params + gathered_experts);
        ++blocks_here;
        largest_reduction = std::max({largest_reduction, layer_params, gathered_experts});
        largest_block_experts = std::max(largest_block_experts, layer_expert_params);
        largest_quadratic = std::max(largest_quadratic, quadratic);
        largest_mlp_grads = std::max({largest_mlp_grads, mlp_grads[0], mlp_grads[1]});
        const double act = block_activation_bytes(g, layer, plan);
        block_activations += act;
        last_block_kept = act;
        groups.push_back({layer, act});
        if (plan.schedule == Schedule::ZeroBubble) weight_pass += weight_pass_bytes(g, layer, plan);
      }
      if (k == v * plan.pp - 1) groups.push_back({static_cast<int>(spec.layers), 0.0});
      largest_chunk_activations =
          std::max(largest_chunk_activations, block_activations - before_chunk);
    }
    // The embedding lives on the first stage, the final norm, head and loss on the last (a tied
    // head's copy of the embedding included, see rank_params).
    // Embedding and head activations, each times the micro-batches in flight at its end.
    const double end_count = static_cast<double>(end_in_flight(plan, stage));
    double extra_activations = 0;
    double logits = 0;          // the head's output, alive while the loss's forward reads it
    double head_params = 0;     // the last stage's: final norm and head
    double head_kept = 0;       // what they keep of one micro-batch
    double embedding_kept = 0;  // what the embedding keeps of one micro-batch
    if (stage == 0) {
      double group_params = 0;
      for (model::OpId id : g.layer_ops(-1)) group_params += rank_params(g.op(id), plan);
      dense_params += group_params;
      embedding_params = group_params;
      embedding_kept = extra_activation_bytes(g, -1, plan);
      extra_activations += embedding_kept * end_count;
      // A tied head on this stage (pp = 1) reads the embedding's own table: the lowering
      // gathers it once per pass, for the embedding's forward, and it stays gathered until the
      // head's backward, while the blocks' weights come and go.
      if (plan.pp == 1) {
        for (model::OpId id : g.layer_ops(static_cast<int>(spec.layers))) {
          tied_table += tied_table_params(g.op(id), plan);
        }
      }
      if (tied_table == 0) largest_layer_params = std::max(largest_layer_params, group_params);
    }
    if (stage == plan.pp - 1) {
      double group_params = 0;
      for (model::OpId id : g.layer_ops(static_cast<int>(spec.layers))) {
        const Op& op = g.op(id);
        group_params += rank_params(op, plan);
        if (op.kind == model::OpKind::LmHead) {
          logits = activation_bytes_per_element(plan.precision) * op.gemm_m * op.gemm_n /
                   (static_cast<double>(plan.tp) * plan.cp);
        }
      }
      dense_params += group_params;
      largest_layer_params = std::max(largest_layer_params, group_params);
      head_params = group_params;
      // A deferred W pass keeps the head's too: its input and its output's (the logits')
      // gradient.
      if (plan.schedule == Schedule::ZeroBubble) {
        weight_pass += weight_pass_bytes(g, static_cast<int>(spec.layers), plan);
      }
      head_kept = extra_activation_bytes(g, static_cast<int>(spec.layers), plan);
      extra_activations += head_kept * end_count;
    }

    // Context-parallel ranks hold the same weights as their data-parallel peers: the
    // distributed optimizer shards over dp x cp (Megatron-LM, --use-distributed-optimizer with
    // --context-parallel-size), experts over their own data-parallel group, dp x cp / ep.
    const int shard = plan.dp * plan.cp;
    const ModelStates dense = zero_model_states(dense_params, plan.zero_stage, shard, per_param);
    const ModelStates experts =
        zero_model_states(expert_params, plan.zero_stage, shard / plan.ep, per_param);
    s.weights_bytes = dense.weights + experts.weights;
    s.gradients_bytes = dense.gradients + experts.gradients;
    s.optimizer_bytes = dense.optimizer + experts.optimizer;
    if (plan.schedule == Schedule::PipeDreamAsync && plan.pp > 1) {
      s.weight_versions = weight_versions(plan, stage);
      s.weights_bytes *= static_cast<double>(s.weight_versions);
    }

    // In-flight micro-batches (interleaved: chunks, each 1/v of the rank's blocks; where the
    // stage's chunks have unequal layers, its largest one's: an upper bound, since the in-flight
    // passes are of every chunk).
    // (A mixture's chunks of equal blocks may hold unequal kinds of them: the largest too.)
    const double per_micro_batch =
        equal_chunks && !spec.mixed_blocks() ? block_activations / v : largest_chunk_activations;
    s.activations_bytes = per_micro_batch * static_cast<double>(s.in_flight);
    // Zero-bubble walks its pass order, each forward awaiting its B pass with the embedding's or
    // the head's activations too (what a W pass keeps of the head is in weight_pass).
    const bool zb_walk = plan.schedule == Schedule::ZeroBubble && plan.pp > 1;
    const double per_forward = per_micro_batch + embedding_kept + head_kept;
    const ZbPeaks zb =
        zb_walk ? zero_bubble_peaks(plan, stage, per_forward, weight_pass) : ZbPeaks{};
    if (zb_walk) {
      s.activations_bytes = zb.any.bytes;
      s.in_flight = zb.any.forwards;
      s.weight_passes_held = zb.any.weight_passes;
      extra_activations = 0;  // (in per_forward)
    }
    s.activations_bytes += extra_activations;
    // Zero-bubble: the most kept right after a W pass, where a weight pass's gradients go out
    // (ZeRO-2's reduce-scatter, ZeRO-3's behind the next pass's gather).
    const ZbHeld& zb_after_weight = zb.after_weight;
    // Beyond what is kept, the most one moment adds, at the forward's end or in the backward
    // (while the in-flight micro-batches are all kept). At the forward's end: the last
    // stage's logits (the loss reads them while writing what it keeps, then they go). In the
    // backward: the gradients an MLP activation's backward reads and writes (the widest of a
    // block's backward), or a block recomputed.
    double backward_working = largest_mlp_grads;
    const char* backward_what = "an MLP activation's gradients";
    if (plan.recompute == Recompute::Selective && largest_quadratic > backward_working) {
      // Backward recomputes one block's attention core and holds its s² tensors meanwhile.
      backward_working = largest_quadratic;
      backward_what = "an attention core's s² tensors, recomputed";
    }
    double recomputed_block = 0;
    if (plan.recompute == Recompute::Full) {
      // Backward recomputes one block at a time and holds its full activations meanwhile,
      // with its MLP activation's gradients at the top of its backward.
      Plan no_recompute = plan;
      no_recompute.recompute = Recompute::None;
      for (int layer = 0; layer < spec.layers; ++layer) {
        recomputed_block =
            std::max(recomputed_block, block_activation_bytes(g, layer, no_recompute));
      }
      backward_working = recomputed_block + largest_mlp_grads;
      backward_what = "a block recomputed, and its MLP activation's gradients";
      if (zb_walk) {
        // A zero-bubble B pass keeps of its recomputed block what the block's W pass keeps (its
        // GEMMs' inputs and its output gradients), already in the larger of the micro-batch's
        // forward and W pass that its state counts: only what the block holds beyond that is
        // added (cpu-small at pp 2, micro-batch 4: dtexec held the MLP's gradients over that
        // state, 9.0 MiB less than the whole recomputed block predicted, +10.3%).
        double excess = 0;
        for (int layer = 0; layer < spec.layers; ++layer) {
          excess = std::max(excess, block_activation_bytes(g, layer, no_recompute) -
                                        weight_pass_bytes(g, layer, plan));
        }
        backward_working = excess + largest_mlp_grads;
        backward_what = excess > 0 ? "a block recomputed beyond what its W pass keeps, and its "
                                     "MLP activation's gradients"
                                   : "an MLP activation's gradients (a block recomputed holds "
                                     "what its W pass keeps)";
      }
    }
    const char* recomputed_what = recomputed_block > 0 ? "a block recomputed" : "";
    // The moments that can hold the most, on top of what is kept; the peak is the first of the
    // largest (the forward's end where they tie). By the backward's first block, the last
    // stage has freed what the head and the loss kept for that micro-batch (head_kept).
    // Zero-bubble's moments are states of its order, each holding less than its most, by what
    // a forward's end or a B pass holds less (a B pass frees the head's tensors in that).
    Moment forward_end{"the forward's end",
                       logits,
                       zb_walk ? zb.any.bytes - zb.forward_end.bytes : 0.0,
                       0,
                       "the last stage's logits while the loss reads them",
                       zb_walk ? &zb.forward_end : nullptr};
    // ZeRO-2/3 with each expert on one rank (dp = ep, cp 1): the experts' gradients are whole
    // and not reduced, made at their first write in the step's first backward (or W pass) and
    // freed after its optimizer step, as ZeRO-2/3's gradients are (dtexec's). Where the stage
    // runs every forward before any backward (one micro-batch per replica, GPipe's order), or
    // no forward after a W pass, none exist at a forward's end; and where the stage's first
    // backward is its fullest (one backward pass a step, or GPipe's), at the backward's moment
    // (its last block's) only that block's have been written, at most the largest block's
    // (cpu-small-moe at dp 2, ep 2, ZeRO-3, one micro-batch per replica: +5.8% with all of
    // them counted).
    // (Whether the stage runs more forwards than it holds in flight: some forward then runs
    // between two backward passes.)
    const bool forward_between = plan.micro_batches() * v > in_flight(plan, stage);
    const bool forward_after_backward =
        zb_walk ? zb.forward_after_weight.forwards > 0 : forward_between;
    const bool transient_experts = plan.zero_stage >= 2 && shard > 1 && !experts_sharded;
    if (transient_experts && !forward_after_backward) {
      forward_end.unwritten_gradients = experts.gradients;
    }
    Moment backward{"the backward",
                    backward_working,
                    zb_walk ? zb.any.bytes - zb.in_backward.bytes : head_kept,
                    0,
                    backward_what,
                    zb_walk ? &zb.in_backward : nullptr};
    const bool first_backward_fullest =
        !zb_walk && (plan.micro_batches() * v == 1 || (plan.schedule == Schedule::GPipe && v == 1));
    if (transient_experts && first_backward_fullest) {
      backward.unwritten_gradients =
          std::max(0.0, experts.gradients - largest_block_experts * per_param.gradients);
    }
    const bool zero3 = plan.zero_stage == 3 && shard > 1;
    if (zero3) {
      // ZeRO-3 gathers a layer's weights (or the embedding's, the head's) before use and
      // prefetches the next one, and a tied table (pp = 1) stays gathered from the
      // embedding's forward to the head's backward: at the forward's end the table and the
      // head's weights, in the backward the table and two layers' weights.
      forward_end.other = (tied_table + head_params) * per_param.weights;
      backward.other = (tied_table + 2.0 * largest_layer_params) * per_param.weights;
    }
    // ZeRO-2 keeps only a shard of each gradient, but a tied head (pp = 1) writes the
    // embedding table's whole gradient in its backward, the first, and it stays until the
    // embedding's bucket, the last, goes out: through the whole backward (bucket-gpt, dp 2:
    // -5.9% before it was counted, -2.6% since; with ZeRO-3 dtexec held less than this adds,
    // +7% over, and it is left out there).
    const bool zero2 = plan.zero_stage == 2 && shard > 1;
    const double table_gradient = zero2 ? tied_table * per_param.gradients : 0.0;
    backward.other += table_gradient;
    Moment peak_moment = forward_end;
    auto consider = [&peak_moment](const Moment& m) {
      if (m.extra() > peak_moment.extra()) peak_moment = m;
    };
    consider(backward);
    if (zero3) {
      // The head's and each block's gradients are reduce-scattered once their backward is
      // done (what they kept is freed), the unsharded gradients, the collective's packed copy
      // of them and the reduced shard held at once (as FSDP2's reduce-scatter copies them into
      // its input buffer), while the next block's backward starts (with full recompute,
      // holding that block recomputed).
      // The head's: its weights go back after its backward and the last block's are gathered
      // before the reduce-scatter packs its gradients; the unsharded ones and their packed copy
      // at once (the shard comes after they are dropped). bucket-gpt at pp 2 dp 2 (a 32 MiB
      // tied head copy): dtexec held 253.0 MiB there on the last stage, where two head-sized
      // groups gathered and (2 + 1/dp) times its gradients predicted 320.7.
      consider({"the head's gradient reduce-scatter", recomputed_block, head_kept,
                tied_table * per_param.weights + largest_block_params * per_param.weights +
                    2.0 * per_param.gradients * head_params,
                recomputed_what});
      // (Zero-bubble gathers and reduces a whole chunk per pass: its own moments below.)
      if (plan.recompute == Recompute::Full && !zb_walk) {
        // With full recompute a block's backward starts with its recompute, and the next
        // block's weights are gathered after it, before the backward proper (as FSDP prefetches
        // the next unit's at a unit's pre-backward): the recomputed block, its weights and the
        // next block's (gathered in place: nothing besides). The block's reduce-scatter then
        // runs beside the next block's recompute, its packed copy and reduced shard held (the
        // unsharded gradients freed once packed) with one block's weights gathered. cpu-small at
        // dp 2, micro-batch 4: dtexec held 50.9 MiB at its peak, the backward's, 51.4 predicted
        // (while dtexec staged its gathers through a packed copy and a gathered chunk it peaked
        // at the gather, 51.9). Blocks' weights, not the embedding's or the head's (gathered at
        // moments of their own); a stage of one block has no next one to gather.
        const double table_held = tied_table * per_param.weights;
        if (blocks_here >= 2) {
          consider({"the next block's weight gather after a block's recompute", recomputed_block,
                    head_kept + last_block_kept,
                    table_held + 2.0 * largest_block_params * per_param.weights, recomputed_what});
        }
        consider({"a block's gradient reduce-scatter beside the next block's recompute",
                  recomputed_block, head_kept + last_block_kept,
                  table_held + largest_block_params * per_param.weights +
                      (1.0 + 1.0 / shard) * per_param.gradients * largest_reduction,
                  recomputed_what});
      } else if (!zb_walk) {
        consider({"a block's gradient reduce-scatter", 0, head_kept + last_block_kept,
                  tied_table * per_param.weights + 2.0 * largest_block_params * per_param.weights +
                      2.0 * per_param.gradients * largest_reduction});
      }
      if (embedding_params > 0) {
        // The backward's last gather, the embedding's (dtexec gathers it again, as FSDP's unit),
        // the kept activations gone: the gathered table (in place: nothing besides it) and a
        // tied table's whole gradient, written by the head's backward. Reduce-scatters before it
        // are done first (the dp stream runs its collectives in order). With full recompute it
        // follows the first block's recompute, which it holds with that block's weights; without,
        // the first block's backward, whose unsharded gradients wait for the reduce-scatter after
        // it (the largest block's taken, an upper bound). bucket-gpt at dp 2 with full recompute
        // held 361.4 MiB there while the table was gathered in 25 MiB chunks; the first block's
        // reduce-scatter in flight and those chunks beside it predicted 376.3.
        const bool full = plan.recompute == Recompute::Full;
        consider({"the embedding's weight gather in the backward", recomputed_block,
                  s.activations_bytes,
                  embedding_params * per_param.weights + tied_table * per_param.gradients +
                      (full ? largest_block_params * per_param.weights
                            : largest_reduction * per_param.gradients),
                  recomputed_what});
      }
    }
    const double kept_at_peak = s.activations_bytes - extra_activations;
    if (zero3 && plan.schedule == Schedule::ZeroBubble) {
      // Zero-bubble gathers a whole chunk (its passes split the backward, which the per-block
      // gathers need whole; lower's run_stage), the stage's one, before its first pass, and
      // keeps it for the step, and it reduce-scatters a weight pass's gradients after it: the
      // weight pass's unsharded gradients, the chunk's gathered weights, the packed copy of the
      // pass's first gradient bucket (packed before its gradients go; the largest bucket taken),
      // and what the stage keeps right after a weight pass (its pass order's states after its W
      // passes, the most of them; the stage is one chunk: zero-bubble does not interleave). dtexec
      // on cpu-small at pp 2 dp 2 held 49.5 MiB there, where the per-block moments above came
      // to 35.6; bucket-gpt at pp 2 dp 2 (micro-batch 4, batch 16; a 32 MiB tied table) held 381.2
      // MiB on the last stage, where this moment without the packed bucket predicted 349.2 (the
      // gathers' staging buffers, counted until 2026-12-07, had stood in for it). (Experts whose
      // group is one rank are whole already, gathered by no one.)
      const int expert_group = shard / plan.ep;
      const double chunk = dense_params + (expert_group > 1 ? expert_params : 0.0);
      double packed = 0;
      for (const GradientBucket& b : gradient_buckets(g, plan, chunk_groups, per_param.gradients)) {
        packed = std::max(packed, b.bytes);
      }
      consider({"a weight pass's end, the chunk's weights gathered", 0,
                std::max(0.0, kept_at_peak - zb_after_weight.bytes),
                chunk * (per_param.gradients + per_param.weights) + packed, "", &zb_after_weight});
      // And the chunk's weights at any pass, the stage's most kept (the last stage's first W,
      // its B passes all done: 79.1 MiB held on cpu-small at micro-batch 4, 77.1 predicted;
      // 87.7 against 92.1 with the gathers staged).
      consider({"a pass with the chunk's weights gathered", 0, 0, chunk * per_param.weights});
    }
    // ZeRO-1/2's buckets (ZeRO-3 reduces each block apart, ZeRO-0 in place).
    const bool bucketed = (plan.zero_stage == 1 || plan.zero_stage == 2) && shard > 1;
    const std::vector<GradientBucket> buckets =
        bucketed ? gradient_buckets(g, plan, chunk_groups, per_param.gradients)
                 : std::vector<GradientBucket>{};
    double largest_bucket = 0, stage_gradients = 0;
    for (const GradientBucket& b : buckets) {
      largest_bucket = std::max(largest_bucket, b.bytes);
      stage_gradients += b.bytes;
    }
    if (plan.zero_stage == 1 && shard > 1 && !plan.zero_in_place) {
      // ZeRO-1 reduce-scatters the accumulated gradients once per step, in the last
      // micro-batch's backward as its blocks fill the buckets (the other micro-batches done):
      // a bucket's packed copy and its reduced shard, beside the full gradients (dtexec packs
      // them, as DeepSpeed copies gradients into its reduction buckets; Megatron-LM's
      // distributed optimizer reduce-scatters its contiguous buffer in place, without the
      // copy: plan zero_in_place), while the blocks below it keep that micro-batch's
      // activations.
      for (const GradientBucket& b : buckets) {
        consider({"the step's gradient reduce-scatter", 0,
                  std::max(0.0, s.activations_bytes - b.kept), (1.0 + 1.0 / shard) * b.bytes});
      }
    }
    // ZeRO-2 keeps a bucket's full gradients from their first write in a micro-batch's
    // backward to the bucket's reduce-scatter (the reduced slice is in gradients_bytes): up to
    // a bucket, at most the rank's gradients. They grow while that backward frees the
    // micro-batch's activations, so only what exceeds those adds to the peak (it does with full
    // recompute, whose kept activations are small). Not with zero-bubble: its B passes write no
    // weight gradients, its W passes write them as they free what they keep, and the moments of
    // their buckets' reduce-scatters count those (cpu-small at pp 2 dp 2 with full recompute,
    // micro-batch 4, 2 micro-batches: the last stage held 75.1 MiB, in B1, where a growing
    // bucket beside it predicted 82.1).
    double zero2_bucket = zero2 && !zb_walk ? std::max(0.0, largest_bucket - per_micro_batch) : 0.0;
    const double growing_bucket = zero2_bucket;
    // A moment when ZeRO-2's growing bucket is gone: the peak where it holds more than the
    // peak so far with that bucket.
    auto consider_without_bucket = [&](const Moment& m) {
      if (m.extra() > peak_moment.extra() + zero2_bucket) {
        peak_moment = m;
        zero2_bucket = 0;
      }
    };
    if (zero2) {
      // And a bucket's reduce-scatter, in every micro-batch's backward: its gradients and their
      // packed copy at once (they are dropped once copied), while the blocks below it keep
      // the micro-batch's activations and the other micro-batches in flight theirs.
      const double others =
          std::max(0.0, s.activations_bytes - extra_activations - per_micro_batch);
      // A tied table's whole gradient is held beside the buckets before the embedding's (whose
      // bytes carry it).
      bool table_sent = false;
      // Zero-bubble's gradients are written by its W passes, whose last bucket goes out at the
      // pass's end: the stage then keeps a state after a W pass, not a micro-batch's forward
      // (cpu-small pp 2 dp 2, micro-batch 2, 2 micro-batches: the last stage held 48.9 MiB
      // at W0's reduce-scatter, W1's tensors kept; 56.6 predicted with the most any state
      // keeps and the next pass's first bucket beside it).
      const double zb_freed = zb_walk ? std::max(0.0, kept_at_peak - zb_after_weight.bytes) : 0.0;
      const ZbHeld* zb_state = zb_walk ? &zb_after_weight : nullptr;
      for (std::size_t i = 0; i < buckets.size(); ++i) {
        const GradientBucket& b = buckets[i];
        const bool pass_end = zb_walk && (b.ends_pass || i + 1 == buckets.size());
        consider_without_bucket(
            {"a gradient bucket's reduce-scatter", 0,
             pass_end ? zb_freed : std::max(0.0, s.activations_bytes - others - b.kept),
             2.0 * b.bytes + b.spill + (table_sent || b.embedding ? 0.0 : table_gradient), "",
             pass_end ? zb_state : nullptr});
        table_sent = table_sent || b.embedding;
        if (i + 1 == buckets.size()) break;
        // Its reduce-scatter may still run when the next bucket is full (the next one's
        // reduce-scatter waits for it, so one is in flight at a time): its packed copy and
        // reduced shard beside the next bucket's gradients, the blocks below that one keeping
        // theirs (bucket-gpt at dp 2 held 441.1 MiB there, on the rank whose reduce-scatter
        // completed later, against 429.6 predicted before this moment).
        const GradientBucket& next = buckets[i + 1];
        consider_without_bucket({"a gradient bucket's reduce-scatter as the next one fills", 0,
                                 std::max(0.0, s.activations_bytes - others - next.kept),
                                 (1.0 + 1.0 / shard) * b.bytes + next.bytes + next.spill +
                                     (table_sent || next.embedding ? 0.0 : table_gradient)});
      }
      // And from one backward pass to the next (the next micro-batch's, or with the
      // interleaved schedule another chunk's): a pass's last bucket may still be reduced while
      // the next pass fills its first (dtexec's reduce-scatter of the last bucket is waited for
      // when the next one starts). Every pair of a chunk's last bucket and a chunk's first:
      // a tied table's gradient, written again by the next pass's head, is held unless that
      // first bucket carries it. Where a forward runs between the passes (the stage runs more
      // forwards than it holds in flight), or the next pass starts without a receive (the
      // last stage); not where backward passes run back to back on an earlier stage, whose
      // next pass first waits for its gradient from the next stage, time in which the
      // reduce-scatter completes (bucket-gpt at pp 2 dp 2: with 8 micro-batches it held
      // 326.1 MiB there, 1F1B, against 313.2 predicted before this moment, interleaved over 2
      // chunks 357.8 against 329.4; with 2 micro-batches, stage 0 running both forwards first,
      // 321.4, as predicted without it).
      const bool last_stage = stage == plan.pp - 1;
      // (Zero-bubble's earlier stages too: a B pass's wait for its gradient did not always
      // see the reduce-scatter through on bucket-gpt, whose first step held it to W1's end.)
      if (plan.micro_batches() * v > 1 && (forward_between || last_stage || zb_walk)) {
        // A chunk's first bucket starts its list; its last ones end its pass.
        std::vector<const GradientBucket*> firsts, lasts;
        for (std::size_t i = 0; i < buckets.size(); ++i) {
          if (i == 0 || buckets[i - 1].chunk != buckets[i].chunk) firsts.push_back(&buckets[i]);
          if (buckets[i].ends_pass) lasts.push_back(&buckets[i]);
        }
        double largest_last = 0;
        for (const GradientBucket* last_bucket : lasts) {
          const GradientBucket& last = *last_bucket;
          largest_last = std::max(largest_last, last.bytes);
          if (zb_walk) {
            // Under zero-bubble the next pass is a W pass from a state after one, and its
            // buckets go out only after it (lower issues a pass's buckets once its gradients
            // exist): the previous pass's last reduce-scatter, where still in flight, sees every
            // gradient of the stage written and the W pass's tensors freed (bucket-gpt at pp 2
            // dp 2, micro-batch 4, 2 micro-batches: stage 0 held 359.3 MiB at W1's end, W0's
            // last reduce-scatter pending; 329.5 predicted with the first bucket filled).
            consider_without_bucket(
                {"a weight pass's last gradient bucket's reduce-scatter as "
                 "the next weight pass writes the stage's gradients",
                 0, zb_freed + std::min(weight_pass, zb_after_weight.bytes),
                 (1.0 + 1.0 / shard) * last.bytes + stage_gradients + table_gradient, "",
                 zb_state});
            continue;
          }
          for (const GradientBucket* first_bucket : firsts) {
            const GradientBucket& first = *first_bucket;
            consider_without_bucket(
                {"a backward pass's last gradient bucket's reduce-scatter as the next pass "
                 "fills its first",
                 0, std::max(0.0, s.activations_bytes - others - first.kept),
                 (1.0 + 1.0 / shard) * last.bytes + first.bytes + first.spill +
                     (first.embedding ? 0.0 : table_gradient)});
          }
        }
        // And through a forward that runs between two backward passes (where the stage runs
        // more forwards than it holds in flight: its warm-up and the steady state's first
        // forward run before any backward): the last bucket's reduce-scatter may still be in
        // flight as that forward ends (on the CPU a forward is one task, inside which MPI makes
        // no progress). cpu-small at dp 2 with 2 micro-batches per replica held 101.8 MiB there
        // against 80.4 predicted before this moment; at pp 2 dp 2 with 2 micro-batches, stage 0
        // runs both forwards first and held 60.4 (68.6 with this moment).
        // Zero-bubble's gradients are written by its W passes: a reduce-scatter in flight at a
        // forward's end is one that a W pass right before it started (cpu-small pp 2 dp 2
        // ZeRO-2: +12.6% with it at a forward that no W pass came before, -4.9% without it at
        // one that did).
        const bool zb_reducing = zb_walk && zb.forward_after_weight.forwards > 0;
        if (zb_walk ? zb_reducing : forward_between) {
          Moment reducing = forward_end;
          reducing.name = "the forward's end, the last gradient bucket's reduce-scatter in flight";
          reducing.other += (1.0 + 1.0 / shard) * largest_last;
          if (zb_walk) {
            reducing.freed = zb.any.bytes - zb.forward_after_weight.bytes;
            reducing.zero_bubble = &zb.forward_after_weight;
          }
          consider_without_bucket(reducing);
          if (!zb_walk) {
            // And on into the next backward pass, until that pass's first reduce-scatter waits
            // for it: its packed copy and reduced shard beside the backward's working tensors,
            // with every micro-batch in flight kept and the pass's bucket growing (tiny-gpt at
            // pp 2 dp 2, 8 micro-batches of 2: stage 0 held 1.80 MiB in a backward, the
            // previous pass's reduce-scatter pending since before the forward between them;
            // 1.64 predicted at the forward's end, -9.0%).
            Moment reducing_backward = backward;
            reducing_backward.name =
                "the backward, the previous pass's last gradient bucket's reduce-scatter in "
                "flight";
            reducing_backward.other += (1.0 + 1.0 / shard) * largest_last + growing_bucket;
            consider_without_bucket(reducing_backward);
          }
        }
      }
    }
    s.peak_moment = peak_moment.name;
    if (peak_moment.zero_bubble != nullptr) {
      s.in_flight = peak_moment.zero_bubble->forwards;
      s.weight_passes_held = peak_moment.zero_bubble->weight_passes;
    }
    s.working_bytes = peak_moment.working;
    s.working_tensors = peak_moment.working > 0 ? peak_moment.working_what : "";
    s.activations_bytes += peak_moment.working - peak_moment.freed;
    s.gradients_bytes -= peak_moment.unwritten_gradients;
    s.other_bytes = allowance + peak_moment.other + zero2_bucket;
    s.total_bytes = s.weights_bytes + s.gradients_bytes + s.optimizer_bytes + s.activations_bytes +
                    s.other_bytes;
    const std::array<std::pair<double, const char*>, 5> terms = {{
        {s.weights_bytes, "weights"},
        {s.gradients_bytes, "gradients"},
        {s.optimizer_bytes, "optimizer states"},
        {s.activations_bytes, "activations"},
        {s.other_bytes, "other"},
    }};
    s.dominant = std::max_element(terms.begin(), terms.end())->second;
    report.stages.push_back(s);
  }
  for (std::size_t i = 0; i < report.stages.size(); ++i) {
    if (report.stages[i].total_bytes > report.worst().total_bytes) {
      report.worst_stage = static_cast<int>(i);
    }
  }
  report.margin_bytes = report.capacity_bytes - report.worst().total_bytes;
  report.fits = report.margin_bytes >= 0;
  report.notes.push_back(
      report.worst().working_bytes > 0
          ? fmt::format("the worst rank peaks at {} (peak_moment); its activations include {} of "
                        "working tensors there (working_bytes: {})",
                        report.worst().peak_moment, format_gib(report.worst().working_bytes),
                        report.worst().working_tensors)
          : fmt::format("the worst rank peaks at {} (peak_moment), with no working tensors "
                        "beyond what it keeps",
                        report.worst().peak_moment));
  report.notes.push_back(
      fmt::format("other = {} framework allowance ({}){}", format_gib(allowance), allowance_source,
                  plan.zero_stage == 3   ? " + ZeRO-3 gathered-weight and reduce-scatter buffers"
                  : plan.zero_stage == 2 ? " + ZeRO-2 gradient buckets beyond the activations "
                                           "their backward frees"
                  : plan.zero_stage == 1 && report.worst().other_bytes > allowance
                      ? " + the step's gradient reduce-scatter buffers"
                      : ""));
  return report;
}

}  // namespace dtsim::plan
