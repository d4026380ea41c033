#include "sim/planner/planner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include "sim/cluster/placement.hpp"
#include "sim/common/error.hpp"
#include "sim/cost/compute_cost.hpp"
#include "sim/engine/engine.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/network/network_model.hpp"
#include "sim/plan/memory_model.hpp"
#include "sim/planner/pass_timeline.hpp"

namespace dtsim::planner {

namespace {

using cluster::ParallelDim;
using lower::CollectiveKind;
using lower::Phase;
using plan::Plan;
using plan::Recompute;
using plan::Schedule;

// Runs work(i) for every i in [0, n) on `threads` threads, each with its own `work` (made by
// make_work() on that thread: an estimator, a network model). Threads take the next few
// indices as they come free: the candidates' costs differ a hundredfold (a pipeline of 64
// stages and 1,024 micro-batches against none), so fixed ranges leave a thread idle. What each
// index computes is the same whatever the thread count. An exception ends its thread; the one
// of the smallest index is rethrown after the join, as if the loop had run on this thread
// (indices are taken in order, so every smaller index was run).
template <class MakeWork>
void parallel_for(std::size_t n, unsigned threads, const MakeWork& make_work) {
  constexpr std::size_t batch = 4;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failing{false};
  struct Failure {
    std::size_t index = 0;
    std::exception_ptr error;
  };
  // No more threads than indices (--threads 2147483647 asks for more than can be made).
  const auto used =
      static_cast<unsigned>(std::min<std::size_t>(threads, std::max<std::size_t>(n, 1)));
  std::vector<Failure> failed(used);
  auto worker = [&](unsigned t) {
    std::size_t i = 0;
    try {
      auto work = make_work();
      while (!failing.load()) {
        const std::size_t begin = next.fetch_add(batch);
        if (begin >= n) break;
        for (i = begin; i < std::min(n, begin + batch); ++i) work(i);
      }
    } catch (...) {
      failed[t] = {i, std::current_exception()};
      failing = true;
    }
  };
  std::vector<std::jthread> pool;  // joined on the way out, should a thread fail to start
  for (unsigned t = 1; t < used; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto& th : pool) th.join();
  const Failure* first = nullptr;
  for (const Failure& f : failed) {
    if (f.error && (!first || f.index < first->index)) first = &f;
  }
  if (first) std::rethrow_exception(first->error);
}

std::vector<int> divisors(std::int64_t n) {
  std::vector<int> out;
  for (std::int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) out.push_back(static_cast<int>(d));
  }
  return out;
}

// Whether a plan's bound differs from its estimate. Detail::Bound leaves out the pipeline
// timeline (the bubble and the pipeline transfers, the costliest part of an estimate), which
// only lengthens a step: the terms it adds are positive, and the dp stream's exposure, which
// they can shrink, at most by as much (the step is window + max(in passes, busy - window, ...)).
bool has_timeline(const Plan& p) {
  return p.pp > 1 && p.schedule != Schedule::PipeDreamAsync;
}

// Closed-form step time of one plan (tier 1). Uses the simulator's compute cost and network
// models per op and per collective, and runs the passes through the schedule's order
// (pass_timeline.hpp) for the bubble and the pipeline transfers.
//
// Stragglers, as the engine models them (sim/engine/engine.hpp): a collective whose ranks come
// together waits cv·E[max of its group's n ranks]·T, T the compute since that group's previous
// collective. Over a step those T add up to the rank's compute, once per group kind.
// Tensor-parallel collectives sit between the ops, so their waits, cv·e(tp)·compute, are all
// exposed; the pipeline transfers' waits for the later end count as the bubble's length of
// compute (a proxy, checked against the simulator in the planner test), or at every round of a
// blocking interleaved schedule (see below). The data-parallel buckets wait on the dp
// stream while the backward pass goes on, which hides their waits unless the stream outlasts
// it (see the dp term below).
class Estimator {
 public:
  Estimator(const cluster::Cluster& cluster, const cost::Profile* profile, double jitter_cv,
            double rank_spread_cv)
      : cluster_(cluster),
        profile_(profile),
        jitter_cv_(jitter_cv),
        rank_spread_cv_(rank_spread_cv),
        net_(network::make_analytical(cluster)) {}

  engine::Breakdown estimate(const model::ModelGraph& g, const Plan& p,
                             Detail detail = Detail::Full) {
    const model::ModelSpec& m = g.spec();
    cost::ComputeCost cost(g, p, cluster_.device, profile_);
    const cluster::Placement placement(p.degrees(), p.order);
    auto group = [&](ParallelDim d, lower::GroupKind kind) {
      return lower::Group{kind, placement.group(d, 0), {0}};
    };
    const auto act = static_cast<std::uint64_t>(plan::activation_bytes_per_element(p.precision));
    const std::uint64_t tokens = static_cast<std::uint64_t>(p.micro_batch_size * p.seq_len / p.cp);
    const std::uint64_t hidden_bytes = tokens * static_cast<std::uint64_t>(m.hidden) * act;

    // A block's passes: blocks with experts and dense ones (a mixture's dense blocks, or a
    // dense model's) differ, each kind priced once, on its first block. The backward's tp
    // collectives at the column-parallel layers' inputs (Megatron's f before QKV and before the
    // MLP) cut its backward into segments: each one's compute (before the collective: its
    // stragglers' waits), and the layer's weight gradient, which the collective may run beside
    // (lowering: overlaps_tp_backward; not an MoE router, which tensor parallelism does not
    // split).
    struct Segment {
      double compute = 0, weight = 0, slack = 0;
      bool overlapped = false;
      double input = 0;  // the layer's input gradient
      // With sequence parallelism its backward gathers its input again (lowering:
      // regathers_input): a column-parallel layer's; a router then routes its rank's share
      // (moe_local_dispatch: no segment), and a mixture's experts take the copies the
      // collectives bring them.
      bool regathers = false;
      // The collectives that carry its input (plan::tp_enter_bytes: a hidden tensor, or
      // multi-head latent attention's latents): the input gradient's reduction and, under
      // sequence parallelism, the input's gather, and the weight gradient's input gathered again
      // (plan::tp_regather_bytes).
      double reduce = 0, gather = 0, regather = 0;
      bool attention = false;  // a segment of the attention's projections
    };
    struct BlockCost {
      double lf = 0, lb = 0, lbw = 0, attention = 0;  // compute: forward, backward, weight
      std::vector<Segment> segments;
      double tp_comm = 0, cp_comm = 0, ep_comm = 0;  // a forward's collectives
      double tp_backward = 0, cp_backward = 0;       // a backward's
      double f = 0, b = 0, recompute = 0, recompute_compute = 0;
      double compute = 0;    // lf + lb + recompute_compute
      double back = 0;       // b + recompute: the backward pass
      double regathers = 0;  // its segments' inputs gathered again (Segment::regather)
    };
    // A router that routes the rank's share of the sequence has no tp collective before it.
    const bool local_dispatch = plan::moe_local_dispatch(m, p);
    // With the overlap, what outlasts a segment's weight gradient stays exposed; zero-bubble
    // splits every backward into input- and weight-gradient passes already.
    const bool tp_overlap = p.tp > 1 && p.overlap_tp_backward && p.schedule != Schedule::ZeroBubble;
    // Sequence parallelism gathers a column-parallel layer's input again for its weight
    // gradient (lowering: regathers_input): beside the layer's input gradient with the overlap,
    // else before the layer's backward. Zero-bubble gathers them once the input-gradient pass
    // is done, and its weight pass, which mostly follows at once, waits for them (lowering:
    // emit_regather).
    const auto tp_collective = [&](CollectiveKind kind, std::uint64_t bytes) {
      return net_->collective_s(placement, group(ParallelDim::Tp, lower::GroupKind::Tp), kind,
                                bytes);
    };
    const double regather = p.tp > 1 && p.sequence_parallel
                                ? tp_collective(CollectiveKind::AllGather, hidden_bytes)
                                : 0.0;
    const auto block_cost = [&](int layer) {
      const bool experts = m.has_experts(layer);
      BlockCost c;
      for (model::OpId id : g.layer_ops(layer)) {
        const auto& op = g.op(id);
        const double forward = cost.op_seconds(op, Phase::Forward);
        const double backward = cost.op_seconds(op, Phase::Backward);
        const double weight = cost.op_seconds(op, Phase::BackwardWeight);
        c.lf += forward;
        c.lb += backward;
        c.lbw += weight;
        if (op.kind == model::OpKind::AttentionCore) c.attention = forward;
        // (The experts' collectives before them: the gates' all-reduce, or their copies
        // gathered under moe_local_dispatch.)
        const bool routed = op.kind == model::OpKind::MlpUp && op.expert;
        if (op.kind == model::OpKind::QkvProj || routed || plan::mlp_tp_enter(m, p, op)) {
          const bool column =
              op.kind == model::OpKind::QkvProj || (op.kind == model::OpKind::MlpUp && !routed);
          const std::uint64_t bytes = plan::tp_enter_bytes(m, op, hidden_bytes);
          const std::uint64_t again = plan::tp_regather_bytes(m, op, hidden_bytes);
          const bool sp = p.tp > 1 && p.sequence_parallel;
          c.segments.push_back(
              {.weight = weight,
               .overlapped = column,
               .input = cost.op_seconds(op, Phase::BackwardInput),
               .regathers = column,
               .reduce = p.tp > 1
                             ? tp_collective(p.sequence_parallel ? CollectiveKind::ReduceScatter
                                                                 : CollectiveKind::AllReduce,
                                             bytes)
                             : 0.0,
               .gather = sp ? tp_collective(CollectiveKind::AllGather, bytes) : 0.0,
               .regather = sp ? tp_collective(CollectiveKind::AllGather, again) : 0.0,
               .attention = op.kind == model::OpKind::QkvProj});
        }
        // In forward order, an op's backward runs before the collective of the nearest
        // column-parallel layer at or before it.
        if (!c.segments.empty()) c.segments.back().compute += backward;
      }
      if (p.tp > 1) {
        auto gather_scatter = [&](std::uint64_t bytes) {
          return tp_collective(CollectiveKind::AllGather, bytes) +
                 tp_collective(CollectiveKind::ReduceScatter, bytes);
        };
        // Attention's: its inputs enter (one hidden tensor, or multi-head latent attention's
        // two latents), a hidden tensor leaves. With sequence parallelism the inputs are
        // gathered and the output reduce-scattered, and the converse in the backward; without,
        // the output is all-reduced, and in the backward the inputs' gradients.
        double attention_f = 0, attention_b = 0;
        for (const Segment& seg : c.segments) {
          if (!seg.attention) continue;
          attention_f += seg.gather;
          attention_b += seg.reduce;
        }
        const double out = tp_collective(
            p.sequence_parallel ? CollectiveKind::ReduceScatter : CollectiveKind::AllReduce,
            hidden_bytes);
        if (p.sequence_parallel) {
          attention_f += out;
          attention_b += tp_collective(CollectiveKind::AllGather, hidden_bytes);
        } else {
          attention_f = out;
        }
        // The MLP's; an MoE block's under moe_local_dispatch moves the experts' copies instead
        // of the block's input and output, and its shared experts' input and output besides.
        const bool moves_copies = local_dispatch && experts;
        const double mlp =
            p.sequence_parallel
                ? gather_scatter(moves_copies ? plan::expert_copies_bytes(m, p, hidden_bytes)
                                              : hidden_bytes)
                : out;
        const double shared = p.sequence_parallel && moves_copies && m.shared_ffn() > 0
                                  ? gather_scatter(hidden_bytes)
                                  : 0.0;
        c.tp_comm = attention_f + mlp + shared;
        c.tp_backward = attention_b + mlp + shared;
      }
      if (p.cp > 1) {
        // (This rank's heads' keys and values: lowering's CpGatherKv.)
        const std::uint64_t kv = plan::cp_kv_bytes(m, p, hidden_bytes);
        c.cp_comm = net_->collective_s(placement, group(ParallelDim::Cp, lower::GroupKind::Cp),
                                       CollectiveKind::AllGather, kv);
      }
      if (p.ep > 1 && experts) {
        c.ep_comm = 2 * net_->collective_s(placement, group(ParallelDim::Ep, lower::GroupKind::Ep),
                                           CollectiveKind::AllToAll,
                                           plan::ep_all_to_all_bytes(m, p, hidden_bytes));
      }
      c.f = c.lf + c.tp_comm + c.cp_comm + c.ep_comm;
      // Backward: dK and dV reduce-scattered over cp, and K and V gathered again unless full
      // recompute's forward just gathered them (lowering's CpRegatherKv).
      c.cp_backward = p.recompute == Recompute::Full ? c.cp_comm : 2 * c.cp_comm;
      if (tp_overlap) {
        // Each input-gradient collective beside its layer's weight gradient.
        for (Segment& seg : c.segments) {
          if (!seg.overlapped) continue;
          c.tp_backward -= std::min(seg.reduce, seg.weight);
          seg.slack = std::max(0.0, seg.weight - seg.reduce);
        }
      }
      if (regather > 0) {
        for (const Segment& seg : c.segments) {
          if (!seg.regathers) continue;
          const bool beside_input = tp_overlap && seg.overlapped;
          c.tp_backward += std::max(0.0, seg.regather - (beside_input ? seg.input : 0.0));
        }
      }
      // Each tp rank holds a slice of every expert: the gates' gradients, partial sums, are
      // all-reduced over tp before the router's backward (lowering: TpGates), in fp32; not
      // under moe_local_dispatch, where the copies' outputs are reduce-scattered before the
      // combine.
      if (p.tp > 1 && experts && !local_dispatch) {
        c.tp_backward += net_->collective_s(placement, group(ParallelDim::Tp, lower::GroupKind::Tp),
                                            CollectiveKind::AllReduce,
                                            tokens * static_cast<std::uint64_t>(m.moe->top_k) * 4);
      }
      c.b = c.lb + c.tp_backward + c.cp_backward + c.ep_comm;
      if (p.recompute == Recompute::Full) {
        c.recompute = c.f;
        c.recompute_compute = c.lf;
      }
      if (p.recompute == Recompute::Selective) c.recompute = c.recompute_compute = c.attention;
      c.compute = c.lf + c.lb + c.recompute_compute;
      c.back = c.b + c.recompute;
      for (const Segment& seg : c.segments) {
        if (seg.regathers) c.regathers += seg.regather;
      }
      return c;
    };
    // kinds[0]: the dense blocks, kinds[1]: those with experts (a kind that no block is stays
    // zero); block_kind(l): block l's.
    const auto block_kind = [&](int layer) { return m.has_experts(layer) ? 1 : 0; };
    std::array<BlockCost, 2> kinds;
    for (const std::size_t k : {0, 1}) {
      if (const auto first = m.first_block(k == 1); first >= 0) {
        kinds[k] = block_cost(static_cast<int>(first));
      }
    }
    // Blocks of each kind in each chunk, and a figure of theirs (a member, or a function of a
    // BlockCost) summed over a count of each kind (n[0] x the dense blocks' + n[1] x the
    // others').
    using Count = std::array<double, 2>;
    const std::vector<int> chunks = plan::chunk_layers(p, m.layers);
    std::vector<Count> chunk_kinds(chunks.size(), Count{});
    for (std::size_t k = 0, first = 0; k < chunks.size(); first += chunks[k], ++k) {
      const auto dense = m.dense_blocks_in(static_cast<std::int64_t>(first),
                                           static_cast<std::int64_t>(first) + chunks[k]);
      chunk_kinds[k] = {static_cast<double>(dense), static_cast<double>(chunks[k] - dense)};
    }
    const auto sum = [&](const Count& n, auto figure) {
      return n[0] * std::invoke(figure, kinds[0]) + n[1] * std::invoke(figure, kinds[1]);
    };

    auto group_time = [&](int layer, Phase phase) {
      double s = 0;
      for (model::OpId id : g.layer_ops(layer)) s += cost.op_seconds(g.op(id), phase);
      return s;
    };
    // The vocabulary-parallel embedding's output is all-reduced over tp (with sequence
    // parallelism reduce-scattered, and its gradient all-gathered back); the LM head's input
    // gradient likewise (with sequence parallelism its input all-gathered first), and its
    // cross-entropy all-reduces three statistics per token (lowering: the embedding's TpExit,
    // the head's TpEnter and TpLoss).
    double tp_out = 0, tp_in = 0, tp_loss = 0;
    if (p.tp > 1) {
      const auto tp = group(ParallelDim::Tp, lower::GroupKind::Tp);
      tp_out = net_->collective_s(
          placement, tp,
          p.sequence_parallel ? CollectiveKind::ReduceScatter : CollectiveKind::AllReduce,
          hidden_bytes);
      tp_in = p.sequence_parallel
                  ? net_->collective_s(placement, tp, CollectiveKind::AllGather, hidden_bytes)
                  : 0.0;
      tp_loss = net_->collective_s(placement, tp, CollectiveKind::AllReduce, tokens * 3 * 4);
    }
    const double emb_compute_f = group_time(-1, Phase::Forward);
    const double emb_compute_b = group_time(-1, Phase::Backward);
    const double emb_f = emb_compute_f + tp_out, emb_b = emb_compute_b + tp_in;
    const int head = static_cast<int>(m.layers);
    const double head_compute_f = group_time(head, Phase::Forward);
    const double head_compute_b = group_time(head, Phase::Backward);
    // Their weight gradients, which zero-bubble defers with the blocks'.
    const double emb_weight = group_time(-1, Phase::BackwardWeight);
    const double head_weight = group_time(head, Phase::BackwardWeight);
    const double head_f = head_compute_f + tp_in + tp_loss;
    double head_b = head_compute_b + tp_out;
    if (tp_overlap) {
      for (model::OpId id : g.layer_ops(head)) {
        if (g.op(id).kind == model::OpKind::LmHead) {
          head_b = head_compute_b +
                   std::max(0.0, tp_out - cost.op_seconds(g.op(id), Phase::BackwardWeight));
          head_b += std::max(0.0, regather - cost.op_seconds(g.op(id), Phase::BackwardInput));
        }
      }
    } else {
      // Before the head's backward; zero-bubble's before its weight pass, as the blocks'.
      head_b += regather;
    }

    // One pipeline transfer per hop: hop s from stage s to stage s + 1, the last one from the
    // last stage back to the first (the interleaved schedule's next chunk). Each hop is priced
    // on the links its ranks cross, which differ where stages straddle a node, leaf or pod
    // boundary (an oversubscribed one makes that hop the pipeline's slowest).
    std::vector<double> hop(static_cast<std::size_t>(p.pp), 0.0);
    if (p.pp > 1) {
      const auto pp_ranks = placement.group(ParallelDim::Pp, 0);
      const bool split = p.sequence_parallel || p.scatter_gather_p2p;
      const std::uint64_t bytes = hidden_bytes / static_cast<std::uint64_t>(split ? p.tp : 1);
      const double gather =
          p.scatter_gather_p2p
              ? net_->collective_s(placement, group(ParallelDim::Tp, lower::GroupKind::Tp),
                                   CollectiveKind::AllGather, hidden_bytes)
              : 0.0;
      for (int s = 0; s < p.pp; ++s) {
        hop[static_cast<std::size_t>(s)] =
            net_->p2p_s(placement, pp_ranks[static_cast<std::size_t>(s)],
                        pp_ranks[static_cast<std::size_t>((s + 1) % p.pp)], bytes) +
            gather;
      }
    }
    // The slowest stage's forward and backward per micro-batch, and without p2p overlap the
    // time its receives expose per micro-batch: each is posted when the compute before it ends
    // and waits for the whole transfer (activations for every chunk but the first stage's
    // first, over the hop from the stage before; gradients for every chunk but the last
    // stage's last, over the hop to the stage after).
    double stage_f = 0, stage_b = 0, stage_rec = 0, stage_recv = 0;
    double stage_compute = 0;    // the slowest stage's compute alone, per micro-batch
    double stage_exchanges = 0;  // the slowest stage's receives per micro-batch
    Count stage_blocks{};        // the slowest stage's blocks of each kind
    int stage_index = 0;         // the slowest stage
    // The stage whose breakdown the simulator reports (engine::busiest_stage: the most compute
    // and recompute), its compute per micro-batch and its blocks of each kind.
    double busiest_compute = -1;
    Count busiest_blocks{};
    double stage_params = 0, stage_expert_params = 0;
    // The norms' parameters (and the routers' under moe_local_dispatch), whose gradients
    // sequence parallelism all-reduces over tp at the step's end (the stage with the most).
    double stage_sp_params = 0;
    // The data-parallel buckets of a micro-batch's gradients (the stage's with the most), dense
    // and the experts'.
    const double grad_bytes = plan::state_bytes_per_param(p).gradients;
    const bool per_block = plan::gradient_buckets_per_block(p);
    const std::array<double, 2> block_rate = {block_buckets(g, p, false, grad_bytes, per_block),
                                              block_buckets(g, p, true, grad_bytes, per_block)};
    std::array<double, 2> stage_buckets{};
    for (int s = 0; s < p.pp; ++s) {
      Count blocks{};
      for (int c = 0; c < p.virtual_stages; ++c) {
        for (const std::size_t k : {0, 1}) {
          blocks[k] += chunk_kinds[static_cast<std::size_t>(c * p.pp + s)][k];
        }
      }
      double f = sum(blocks, &BlockCost::f), b = sum(blocks, &BlockCost::b),
             r = sum(blocks, &BlockCost::recompute);
      double compute = sum(blocks, &BlockCost::compute);
      if (s == 0) {
        f += emb_f;
        b += emb_b;
        compute += emb_compute_f + emb_compute_b;
      }
      if (s == p.pp - 1) {
        f += head_f;
        b += head_b;
        compute += head_compute_f + head_compute_b;
      }
      const int from_before = p.virtual_stages - (s == 0 ? 1 : 0);
      const int from_after = p.virtual_stages - (s == p.pp - 1 ? 1 : 0);
      const double recv = p.pp > 1 && !p.overlap_p2p_comm
                              ? from_before * hop[static_cast<std::size_t>((s + p.pp - 1) % p.pp)] +
                                    from_after * hop[static_cast<std::size_t>(s)]
                              : 0.0;
      if (const double busy = compute + sum(blocks, &BlockCost::recompute_compute);
          busy > busiest_compute) {
        busiest_compute = busy;
        busiest_blocks = blocks;
      }
      if (f + b + r + recv > stage_f + stage_b + stage_rec + stage_recv) {
        stage_f = f;
        stage_b = b;
        stage_rec = r;
        stage_recv = recv;
        stage_exchanges = from_before + from_after;
        stage_compute = compute;
        stage_blocks = blocks;
        stage_index = s;
      }
      const StageParams held = stage_param_counts(g, p, s, chunks);
      const double dense = held.dense, experts = held.experts;
      stage_params = std::max(stage_params, dense);
      stage_expert_params = std::max(stage_expert_params, experts);
      if (p.sequence_parallel && p.tp > 1) stage_sp_params = std::max(stage_sp_params, held.sp);
      const Filled edge = edge_buckets(g, p, s, grad_bytes, per_block);
      stage_buckets[0] = std::max(
          stage_buckets[0], (dense - edge.params) * grad_bytes * block_rate[0] + edge.buckets);
      stage_buckets[1] = std::max(stage_buckets[1], experts * grad_bytes * block_rate[1]);
    }
    const double mb = static_cast<double>(p.micro_batches());
    const double per_mb = stage_f + stage_b + stage_rec;
    engine::Breakdown b;
    b.compute_s = mb * (stage_f + stage_b);
    b.recompute_s = mb * stage_rec;
    // The first micro-batch's activations go down the pipeline hop by hop, and the last one's
    // gradients back up.
    double chain = 0;
    for (int s = 0; s + 1 < p.pp; ++s) chain += hop[static_cast<std::size_t>(s)];
    // How long before the pipeline's end the first stage's last pass ends (0 or less): its
    // last buckets, the embedding's, go out then.
    double first_stage_lead = 0;
    // Zero-bubble under sequence parallelism: a block's inputs gathered again, which the weight
    // passes can hide (ChunkPasses::gathers), at most all of the stage's (the bound's).
    double regathers_hidden = 0;
    // Interleaved, from the timeline: how long before the pipeline's end each chunk's last
    // backward pass starts on the first stage and, where it is another, on the slowest one,
    // earliest first (the dp stream's queue below).
    std::vector<std::vector<double>> chunks_before;
    if (has_timeline(p) && detail != Detail::Full && p.schedule == Schedule::ZeroBubble) {
      regathers_hidden = mb * (sum(stage_blocks, &BlockCost::regathers) +
                               (stage_index == p.pp - 1 ? regather : 0));
    }
    if (has_timeline(p) && detail == Detail::Full) {
      // Whether a chunk's last weight pass (every one with ZeRO-2 and up) runs layer by layer
      // (lowering: its buckets reduced beside it).
      const bool layered_weights = p.overlap_grad_reduce && p.dp * p.cp > 1;
      // What an input-gradient pass computes after its last tp collective (zero-bubble under
      // sequence parallelism alone needs it): the embedding's backward, or the first block's
      // ops before its QKV projection (its norm).
      double emb_input = 0, block_input_lead = 0;
      if (p.schedule == Schedule::ZeroBubble && regather > 0) {
        emb_input = group_time(-1, Phase::BackwardInput);
        for (model::OpId id : g.layer_ops(0)) {
          if (g.op(id).kind == model::OpKind::QkvProj) break;
          block_input_lead += cost.op_seconds(g.op(id), Phase::BackwardInput);
        }
      }
      // The bubble: the idle time of the slowest stage in the schedule's order with compute
      // alone; the transfers' share: what the hops add to that (pass_timeline.hpp).
      std::vector<ChunkPasses> passes(chunks.size());
      int chunk_end = 0;  // the block after chunk k's
      for (std::size_t k = 0; k < chunks.size(); ++k) {
        const int layers = chunks[k];
        const Count& blocks = chunk_kinds[k];
        chunk_end += layers;
        ChunkPasses& c = passes[k];
        c.forward = sum(blocks, &BlockCost::f);
        c.backward = sum(blocks, &BlockCost::back);
        if (p.schedule == Schedule::ZeroBubble) {
          c.backward -= sum(blocks, &BlockCost::lbw);
          c.weight = sum(blocks, &BlockCost::lbw);
        }
        if (k == 0) {
          c.forward += emb_f;
          c.backward += emb_b;
        }
        if (k + 1 == chunks.size()) {
          c.forward += head_f;
          c.backward += head_b;
        }
        // Zero-bubble's weight pass takes the whole chunk's weight gradients (lowering: its
        // op range), the embedding's and the LM head's too: GPT-2 124M at pp 8, the head's
        // 2.4 ms of 3.2 a micro-batch, which in the input-gradient pass held up every stage
        // before the last (+12% a step).
        if (p.schedule == Schedule::ZeroBubble) {
          const double edge =
              (k == 0 ? emb_weight : 0.0) + (k + 1 == chunks.size() ? head_weight : 0.0);
          c.backward -= edge;
          c.weight += edge;
          // Sequence parallelism's inputs gathered again go with the weight pass, which waits
          // for them (ChunkPasses::gathers); the head's first where it is the chunk's.
          if (regather > 0) {
            const bool head_here = k + 1 == chunks.size();
            c.gathers = sum(blocks, &BlockCost::regathers) + (head_here ? regather : 0.0);
            // (The head's, or the chunk's last block's: the first its weight pass takes.)
            c.layered_gathers =
                head_here    ? regather
                : layers > 0 ? kinds[static_cast<std::size_t>(block_kind(chunk_end - 1))].regathers
                             : 0.0;
            c.backward -= c.gathers;
            c.last_layered = layered_weights;
            c.all_layered = layered_weights && p.zero_stage >= 2;
            c.input_tail = k == 0 ? emb_input : layers > 0 ? block_input_lead : 0.0;
          }
        }
      }
      const std::vector<double> no_hops(hop.size(), 0.0);
      const PipelineTimeline alone = pipeline_timeline(p, passes, no_hops);
      const double compute_only = alone.makespan_s;
      const PipelineTimeline timed = pipeline_timeline(p, passes, hop);
      const double with_hops = timed.makespan_s;
      first_stage_lead = timed.end_s.front() - with_hops;
      if (p.virtual_stages > 1) {
        const auto add = [&](int stage) {
          auto& before = chunks_before.emplace_back();
          for (const double start : timed.last_backward(stage)) {
            before.push_back(with_hops - start);
          }
          std::sort(before.begin(), before.end(), std::greater<>());
        };
        add(0);
        if (stage_index != 0) add(stage_index);
      }
      // The regathers that weight passes hid (ChunkPasses::gathers), which per_mb counts in
      // full: off the tp communication, where the closed form counts them.
      const double hidden =
          regather > 0
              ? std::max(0.0, mb * per_mb - alone.busy_s[static_cast<std::size_t>(stage_index)])
              : 0.0;
      regathers_hidden = hidden;
      b.bubble_s = std::max(0.0, compute_only - (mb * per_mb - hidden));
      b.exposed_pp_s = std::max(0.0, with_hops - compute_only);
    } else if (p.pp > 1 && !has_timeline(p)) {
      // PipeDream's asynchronous 1F1B has no flush: no bubble, the transfers as 1F1B's.
      b.exposed_pp_s = 2 * chain + mb * stage_recv;
    }
    // One of the slowest stage's transfers.
    const double p2p =
        stage_recv > 0 ? stage_recv / stage_exchanges : (p.pp > 1 ? chain / (p.pp - 1) : 0.0);
    // Stragglers (see the class comment): the waits of one group kind over a step.
    const double step_compute = mb * stage_compute;
    auto straggling = [&](double ranks) {
      return jitter_cv_ > 0 && ranks > 1
                 ? jitter_cv_ * spread(static_cast<std::int64_t>(ranks)) * step_compute
                 : 0.0;
    };

    // Data parallelism: gradients reduced in buckets that overlap the last backward pass, over
    // dp x cp ranks (expert gradients over dp/ep x cp); ZeRO shards over the same groups.
    const auto bytes_per = plan::state_bytes_per_param(p);
    const double shard_group = static_cast<double>(p.dp) * p.cp;
    const double expert_group = static_cast<double>(p.dp / p.ep) * p.cp;
    const double v = std::max(1, p.virtual_stages);
    // The pass whose end makes a chunk's gradients final, which its reductions can overlap: a
    // chunk's backward with its recompute, or zero-bubble's deferred weight-gradient pass (with
    // the embedding's and the head's weight gradients on the stages that hold them).
    const double backward = p.schedule == Schedule::ZeroBubble
                                ? sum(stage_blocks, &BlockCost::lbw) +
                                      (stage_index == 0 ? emb_weight : 0.0) +
                                      (stage_index == p.pp - 1 ? head_weight : 0.0)
                                : (stage_b + stage_rec) / v;
    const CollectiveKind reduce =
        p.zero_stage == 0 ? CollectiveKind::AllReduce : CollectiveKind::ReduceScatter;
    // The dp stream carries every reduction and gather of a step one after another: what the
    // closed forms below expose inside the passes, the stream's busy time in all (which the
    // passes can hide at most), when it can start (the first gradients, after a forward; a
    // gather, at once), and what comes after the optimizer (ZeRO-1/2's gather). The breakdown
    // tells apart, as the simulator's does, a wait for the slowest rank that keeps compute
    // waiting itself (the last reduction's, which outlasts the backward pass): the first
    // reduction's wait, hidden by the pass, shows as the later reductions' delay, in the
    // communication, and so does the stream's in all where it outlasts the passes.
    double dp_in_passes = 0, dp_busy = 0, dp_after = 0, dp_waits_in_passes = 0;
    // How long after the last backward pass the stream's reductions end, where they queue past
    // it: `all` seconds of them, the first waiting `first` for the group's slowest rank. A
    // backward pass hides reductions with its recompute too. Interleaved, a chunk's gradients
    // are final after its own last backward pass, and the drain runs the chunks' last passes
    // about pp backward passes apart (a chunk's share of the last round): the stream starts on
    // the first chunk's (v - 1)·pp passes before the last one, and has at least the last
    // chunk's left when that one starts. The timeline gives when those passes start, blocking
    // transfers' waits between them included (Llama-3 405B at dp 32, tp 8, pp 8, cp 8, v 4:
    // 142 ms apart, not 117); the first stage ends with the pipeline, the slowest one holds the
    // most buckets: the later of the two queues.
    const auto queued_past_backward = [&](double all, double first) {
      double queued = chunks_before.empty()
                          ? std::max(all / v, all + first - (v - 1) * p.pp * backward) - backward
                          : -std::numeric_limits<double>::infinity();
      for (const auto& before : chunks_before) {
        double free = -std::numeric_limits<double>::infinity();
        for (std::size_t i = 0; i < before.size(); ++i) {
          free = std::max(free, -before[i] + (i == 0 ? first : 0.0)) + all / v;
        }
        queued = std::max(queued, free);
      }
      return queued;
    };
    // The reductions of both kinds (dense, experts'), which queue on the one stream as their
    // buckets fill (lowering), and the longer of their first waits (the experts' group is part
    // of the dense one: a wait for its slowest rank is one wait); what each kind's exposes
    // past the passes, summed, without and with its last reduction's wait.
    double reductions = 0, first_waits = 0, reductions_in_passes = 0, reductions_with_waits = 0;
    int kinds_reduced = 0;
    const bool gathers_first =
        p.zero_stage == 3 || ((p.zero_stage == 1 || p.zero_stage == 2) && p.overlap_param_gather);
    const double dp_start = gathers_first ? 0.0 : stage_f / std::max(1, p.virtual_stages);
    // ZeRO-3's units of a chunk on this stage (its blocks, and the embedding and the head where
    // the chunk holds them), on average; zero-bubble gathers a chunk at once.
    const double zero3_units =
        p.schedule == Schedule::ZeroBubble
            ? 1.0
            : std::max(1.0, static_cast<double>(stage_units(p, chunks, stage_index)) / v);
    double zero3_gather = 0;  // a unit's gathers, dense and expert
    // The dense stream's last buckets (see `last` below): the first stage's, and the slowest's.
    const Tail first_tail = tail_buckets(g, p, cost, chunks, grad_bytes, per_block, 0);
    const Tail slowest_tail =
        stage_index == 0 ? first_tail
                         : tail_buckets(g, p, cost, chunks, grad_bytes, per_block, stage_index);
    for (const bool expert : {false, true}) {
      const double params = expert ? stage_expert_params : stage_params;
      const double size = expert ? expert_group : shard_group;
      if (size <= 1 || params <= 0) continue;
      const lower::Group grp{
          expert ? lower::GroupKind::ExpertDp : lower::GroupKind::Dp,
          expert ? placement.expert_gradient_group(0) : placement.gradient_group(0),
          {0}};
      // A collective over the group with its staging passes, as the simulator times it.
      const auto dp_s = [&](CollectiveKind kind, std::uint64_t bytes) {
        return dp_collective_s(placement, grp, static_cast<std::int64_t>(size), cost, kind, bytes);
      };
      const auto grads = static_cast<std::uint64_t>(params * bytes_per.gradients);
      const auto bucket = std::min<std::uint64_t>(grads, plan::kGradientBucketBytes);
      // One collective per bucket, each paying the group's latency (at a dp of thousands a
      // ring's thousands of steps): as many as the stage's blocks, embedding and head fill
      // (stage_buckets).
      const double buckets = std::max(1.0, std::round(stage_buckets[expert ? 1 : 0]));
      const double all =
          buckets * dp_s(reduce, static_cast<std::uint64_t>(static_cast<double>(grads) / buckets));
      // The stream's last collectives, sent as the stage's last backward (zero-bubble: weight)
      // pass ends the tasks that hold their ops (tail_buckets), one after another: how long
      // after the pass's end the last one ends. On the first stage the last is the embedding's
      // gradients (a vocabulary's rows: GPT-2 124M at dp 8, 154 MB, six times a bucket); the
      // first stage ends its passes with the pipeline's end (1F1B, GPipe, interleaved) or
      // before it (zero-bubble, whose last stage defers its weight passes to the end), and the
      // slowest stage with what it leaves open. A bucket that fills at a column-parallel layer
      // goes out with that layer's weight task, the rest of its block before the pass's end
      // (GPT-2 at dp 8 tp 4: +1.6% when sent at the block's end), and a block's buckets sent
      // together at its end queue.
      // (Blocks being alike, their buckets repeat a few sizes: each priced once.)
      std::vector<std::pair<double, double>> priced;
      const auto reduce_s = [&](double bytes) {
        for (const auto& [sent, seconds] : priced) {
          if (sent == bytes) return seconds;
        }
        priced.emplace_back(bytes, dp_s(reduce, static_cast<std::uint64_t>(bytes)));
        return priced.back().second;
      };
      const auto queue_end = [&](const Tail& t) {
        double free = -std::numeric_limits<double>::infinity();
        for (const Tail::Send& send : t.sends) {
          free = std::max(free, -send.before_end) + reduce_s(send.bytes);
        }
        return std::max(0.0, free);
      };
      // (The last one's size, at least a bucket's, scales the stragglers' wait below.)
      const auto tail = expert ? bucket
                               : static_cast<std::uint64_t>(
                                     std::max(static_cast<double>(bucket), slowest_tail.last));
      const double last =
          expert ? dp_s(reduce, tail)
                 : std::max(queue_end(slowest_tail), first_stage_lead + queue_end(first_tail));
      // Stragglers on the dp stream: the first bucket of a reduction waits for the compute
      // since the group's previous one (the step's, or with ZeRO-2/3 a micro-batch's), which the
      // stage's backward pass of that micro-batch (every chunk's) can hide; the later buckets
      // wait for the backward between two buckets, and the last one's outlasts the pass.
      const double waits = straggling(size);
      const double first_wait = waits / (p.zero_stage >= 2 ? mb : 1.0);
      const double last_wait = step_compute > 0
                                   ? waits * (backward / step_compute) *
                                         (static_cast<double>(tail) / static_cast<double>(grads))
                                   : 0.0;
      // The last (with ZeRO-2/3 the last micro-batch's) reduction outlasts its backward pass
      // by this, or the queue of them by more (queued_past_backward); ZeRO-2/3's earlier ones
      // run beside the passes after theirs, as long as the stream keeps up (dp_busy).
      const auto exposed_in_passes = [&](double first, double last_late) {
        return std::max(last + last_late, queued_past_backward(all, first));
      };
      reductions += all;
      first_waits = std::max(first_waits, first_wait);
      ++kinds_reduced;
      reductions_in_passes += exposed_in_passes(first_wait, 0);
      reductions_with_waits += exposed_in_passes(first_wait, last_wait);
      // Each collective on the stream first waits for the group's slowest rank: over a step,
      // the group's waits (see the class comment).
      dp_busy += (p.zero_stage >= 2 ? mb : 1.0) * all + waits;
      const auto weights = static_cast<std::uint64_t>(params * bytes_per.weights);
      if ((p.zero_stage == 1 || p.zero_stage == 2) && p.overlap_param_gather) {
        // A block's gather during the forward of the block before it (lowering: the units of
        // the first forward passes), the first one exposed.
        const double units = std::max(1.0, static_cast<double>(m.layers) / p.pp);
        const double gather =
            dp_s(CollectiveKind::AllGather, static_cast<std::uint64_t>(weights / units));
        dp_in_passes += gather + (units - 1) * std::max(0.0, gather - stage_f / units);
        dp_busy += units * gather;
      } else if (p.zero_stage == 1 || p.zero_stage == 2) {
        dp_after += dp_s(CollectiveKind::AllGather, weights);
      }
      // ZeRO-3: a unit's gather of these weights (its dense ones, or its experts' over their
      // own group), summed below.
      if (p.zero_stage == 3) {
        zero3_gather +=
            dp_s(CollectiveKind::AllGather, static_cast<std::uint64_t>(weights / v / zero3_units));
      }
    }
    // Both kinds' reductions queue on the one stream: where each fits beside the last backward
    // pass alone but not together, the stream outlasts the pass by what they need together
    // (DeepSeek-V2-Lite at dp 64, ep 8, ZeRO-1, in the simulator: 133 ms of the experts'
    // reduce-scatters and 38 of the dense ones, from a backward pass of 104 ms of compute, 117
    // with its all-to-alls' waits, the stream 60 ms past it: -4.4% where each kind was taken
    // to queue alone). (Beside the gathers of overlap_param_gather above, not instead.)
    if (kinds_reduced == 2) {
      const double together = queued_past_backward(reductions, first_waits);
      reductions_in_passes = std::max(reductions_in_passes, together);
      reductions_with_waits = std::max(reductions_with_waits, together);
    }
    dp_in_passes += reductions_in_passes;
    dp_waits_in_passes += reductions_with_waits - reductions_in_passes;
    if (zero3_gather > 0) {
      // One gather per unit and pass, 2 passes per micro-batch and chunk, each hidden behind
      // the unit before it except for the first (lowering: Unit, whose dense and expert gathers
      // queue on the one dp stream), less the units that keep the weights of the one before.
      // Zero-bubble's stage, one chunk, keeps it from its first pass on: one gather. (With
      // pipelining, which the search leaves out for ZeRO-2/3, an approximation: GPT-2 124M at
      // dp 8, pp 4 on 32 A100s, 1F1B and interleaved, 4-7% under the simulation, where
      // exposed gathers delay the pipeline's passes.)
      const double unit = std::min(stage_f, stage_b) / v / zero3_units;
      const double gathers =
          p.schedule == Schedule::ZeroBubble
              ? 1.0
              : 2 * mb * v * zero3_units - kept_unit_weights(p, chunks, stage_index);
      dp_in_passes += zero3_gather + (gathers - 1) * std::max(0.0, zero3_gather - unit);
      dp_busy += gathers * zero3_gather;
    }
    // ZeRO-3 without pipelining, unit by unit (lowering: Unit): one gather per unit (the
    // embedding, each block with its experts, the head) and pass, issued on the dp stream as the
    // unit before it starts and free to start once the unit before that has (lowering:
    // start_unit), and each block's gradients reduce-scattered when its backward ends, in
    // the stream's order. A unit waits for its gather where the stream is behind: after the
    // embedding's and the head's large gathers (a vocabulary's rows) behind passes too short
    // to hide them, and behind the reductions queued before it in the backward.
    const double zero3_exposed =
        p.zero_stage == 3 && p.pp == 1 && shard_group > 1
            ? zero3_unit_exposure(
                  g, p, cost, placement, mb, {kinds[0].f, kinds[1].f}, {kinds[0].b, kinds[1].b},
                  {kinds[0].recompute, kinds[1].recompute}, emb_f, emb_b, head_f, head_b)
            : 0.0;
    // The optimizer updates the rank's dense parameters and its experts' (each ZeRO-sharded
    // over its own data-parallel group), as the lowering's optimizer task.
    const bool sharded = p.zero_stage >= 1;
    const auto updated = static_cast<std::uint64_t>(
        stage_params / (sharded ? shard_group : 1.0) +
        stage_expert_params / (sharded ? std::max(1.0, expert_group) : 1.0));
    b.optimizer_s = cost.optimizer_seconds(updated);
    // The gradient buffer cleared for the next step (the lowering's Task::cleared_params).
    b.optimizer_s += cost.grad_clear_seconds(static_cast<std::uint64_t>(
        (plan::optimizer_clears_gradients(p) ? stage_params : 0.0) +
        (plan::optimizer_clears_expert_gradients(p) ? stage_expert_params : 0.0)));
    // Gradient clipping's read of the rank's share of the gradients (its 4-byte all-reduces:
    // latency, left out).
    if (p.clip_grad > 0) {
      b.optimizer_s += cost.grad_norm_seconds(static_cast<std::uint64_t>(
          stage_params / shard_group + stage_expert_params / std::max(1.0, expert_group)));
    }
    // TP/CP/EP time inside the passes, for the dominant-term report.
    // (A stage's blocks of each kind on average, over the step's micro-batches; with a split of
    // the layers given (uneven), those of the stage the simulator reports.)
    const auto expert_blocks = static_cast<double>(m.expert_blocks());
    const Count average = p.layers_per_stage.empty()
                              ? Count{mb * ((static_cast<double>(m.layers) - expert_blocks) / p.pp),
                                      mb * (expert_blocks / p.pp)}
                              : Count{mb * busiest_blocks[0], mb * busiest_blocks[1]};
    b.exposed_tp_s = sum(average, [](const BlockCost& c) { return c.tp_comm + c.tp_backward; });
    b.exposed_cp_s = sum(average, [](const BlockCost& c) { return c.cp_comm + c.cp_backward; });
    b.exposed_ep_s = sum(average, [](const BlockCost& c) { return 2 * c.ep_comm; });
    b.compute_s -= b.exposed_tp_s + b.exposed_cp_s + b.exposed_ep_s;
    b.exposed_tp_s -= regathers_hidden;
    // Full recompute runs each block's forward collectives again: the simulator counts them as
    // communication, not as recompute (the step is the same either way).
    if (p.recompute == Recompute::Full) {
      const Count again = {mb * stage_blocks[0], mb * stage_blocks[1]};
      b.recompute_s -=
          sum(again, [](const BlockCost& c) { return c.tp_comm + c.cp_comm + c.ep_comm; });
      b.exposed_tp_s += sum(again, &BlockCost::tp_comm);
      b.exposed_cp_s += sum(again, &BlockCost::cp_comm);
      b.exposed_ep_s += sum(again, &BlockCost::ep_comm);
    }
    // A slow rank (the simulator's, on the busiest stage): that stage computes slower, and the
    // step with it. Nothing hides it here; where communication outlasts the compute (ZeRO-3's
    // gathers) the simulator finds part of it hidden.
    if (rank_spread_cv_ > 0 && p.devices() > 1) {
      // engine::slow_rank_factor, with this estimator's memo of E[max of n normals].
      const double slower = rank_spread_cv_ * spread(p.devices());
      b.compute_s += slower * step_compute;
      b.optimizer_s *= 1 + slower;
    }
    double tp_waits = straggling(p.tp);
    if (tp_overlap && jitter_cv_ > 0) {
      // The backward's tp collectives, nearly all of them f's, wait for the backward compute
      // before them; the weight gradient beside each hides that wait up to its slack.
      const double per_compute = jitter_cv_ * spread(p.tp);
      tp_waits -= sum(average, [&](const BlockCost& c) {
        double hidden = 0;
        for (const Segment& seg : c.segments) {
          hidden += std::min(per_compute * seg.compute, seg.slack);
        }
        return hidden;
      });
    }
    // (Where more is hidden than waited, the rest comes off the tp communication, as before
    // the waits were told apart.)
    b.straggler_tp_s = std::max(0.0, tp_waits);
    b.exposed_tp_s += std::min(0.0, tp_waits);
    b.straggler_cp_s = straggling(p.cp);
    b.straggler_ep_s = p.ep > 1 && m.moe ? straggling(p.ep) : 0.0;
    // Pipeline transfers wait for the later of their two ends (pairs). With overlapped transfers
    // the data comes a pass ahead of its use in the steady state, which hides the lateness;
    // elsewhere the bubble's length of compute stands for the exchanges whose two ends come
    // together (the simulator waits nothing where a stage idles long before its data comes).
    // Blocking interleaved transfers (the default) expose it at every round: the exchange waits for
    // both neighbours, one of them late by the spread of the round's compute (the engine's pair
    // wait), less the one transfer time that the stage's second send queues behind its first on the
    // link anyway. With one neighbour per exchange (1F1B, GPipe) or receives alone blocking
    // (zero-bubble), the bubble term stays close to the simulator's (planner test).
    if (p.pp > 1 && jitter_cv_ > 0) {
      const bool every_round = !p.overlap_p2p_comm && p.schedule == Schedule::Interleaved;
      if (every_round) {
        const double rounds = mb * p.virtual_stages;
        const double late = jitter_cv_ * spread(2) * step_compute / rounds;
        b.straggler_pp_s = rounds * std::max(0.0, late - p2p);
      } else {
        b.straggler_pp_s = jitter_cv_ * spread(2) * b.bubble_s;
      }
    }
    // The dp stream outlasts the passes where its work in all does not fit beside them
    // (ZeRO-3's gathers and reduce-scatters at large dp, ZeRO-2's reductions per micro-batch).
    const double window = b.compute_s + b.recompute_s + b.bubble_s + b.exposed_tp_s +
                          b.exposed_cp_s + b.exposed_ep_s + b.exposed_pp_s + b.straggler_tp_s +
                          b.straggler_cp_s + b.straggler_ep_s + b.straggler_pp_s;
    b.exposed_dp_s =
        std::max({dp_in_passes, dp_start + dp_busy - window, zero3_exposed}) + dp_after;
    // With the last reductions' own waits the stream exposes at least as much: the difference
    // is theirs.
    b.straggler_dp_s =
        std::max({dp_in_passes + dp_waits_in_passes, dp_start + dp_busy - window, zero3_exposed}) +
        dp_after - b.exposed_dp_s;
    // The lowering's collectives after the dp stream and before the optimizer, with nothing
    // beside them: a tied embedding's gradients all-reduced between the first and the last
    // stage, then under sequence parallelism the norms' (and routers') over tp.
    const double grad_wire = plan::gradient_wire_bytes(p);
    if (m.tied_embeddings && p.pp > 1) {
      const auto stages = placement.group(ParallelDim::Pp, 0);
      b.exposed_pp_s += net_->collective_s(
          placement, lower::Group{lower::GroupKind::Pp, {stages.front(), stages.back()}, {0}},
          CollectiveKind::AllReduce,
          static_cast<std::uint64_t>(static_cast<double>(m.vocab_rows() * m.hidden) / p.tp *
                                     grad_wire));
    }
    if (stage_sp_params > 0) {
      b.exposed_tp_s += net_->collective_s(placement, group(ParallelDim::Tp, lower::GroupKind::Tp),
                                           CollectiveKind::AllReduce,
                                           static_cast<std::uint64_t>(stage_sp_params * grad_wire));
    }
    return b;
  }

 private:
  // ZeRO-3's units that keep the weights of the unit before them (lowering: kept): where a
  // stage's pass begins with the layer the pass before it ended with, a forward then a backward
  // pass of one chunk (its top layer) or a backward then a forward (its bottom one), and any two
  // passes in a row of a one-unit chunk (its blocks, and the embedding on the first chunk and
  // the head on the last).
  static double kept_unit_weights(const Plan& p, const std::vector<int>& chunks, int stage) {
    const auto& passes = stage_passes_of(p)[static_cast<std::size_t>(stage)];
    double kept = 0;
    for (std::size_t i = 1; i < passes.size(); ++i) {
      const lower::Pass &a = passes[i - 1], &b = passes[i];
      if (a.chunk == b.chunk &&
          (a.kind != b.kind || chunk_units(chunks, a.chunk * p.pp + stage) == 1)) {
        ++kept;
      }
    }
    return kept;
  }

  // ZeRO-3's units of global chunk k (lowering: Unit): its blocks, the embedding on the first
  // chunk and the head on the last.
  static int chunk_units(const std::vector<int>& chunks, int k) {
    const int last = static_cast<int>(chunks.size()) - 1;
    return chunks[static_cast<std::size_t>(k)] + (k == 0 ? 1 : 0) + (k == last ? 1 : 0);
  }

  // The units of a stage's chunks, each pass's.
  static int stage_units(const Plan& p, const std::vector<int>& chunks, int stage) {
    int units = 0;
    for (int c = 0; c < p.virtual_stages; ++c) units += chunk_units(chunks, c * p.pp + stage);
    return units;
  }

  // The data-parallel buckets that a layer's ops (dense or experts') fill, as the lowering
  // fills them (grad_buckets): in the backward's order, each sent once it holds
  // plan::kGradientBucketBytes; what the layer leaves open counts as its share of a bucket
  // shared with the next layer, or as a bucket of its own where each unit's gradients go alone
  // (`per_block`, ZeRO-3's unit gathers). With the ops' parameters on this rank.
  struct Filled {
    double params = 0, buckets = 0;
  };
  static Filled fill_buckets(const model::ModelGraph& g, const Plan& p, int layer, bool experts,
                             double grad_bytes, bool per_block) {
    const auto limit = static_cast<double>(plan::kGradientBucketBytes);
    Filled f;
    double open = 0;
    const auto& ops = g.layer_ops(layer);
    for (auto it = ops.rbegin(); it != ops.rend(); ++it) {
      const model::Op& o = g.op(*it);
      if (o.expert != experts) continue;
      const double params = plan::rank_params(o, p);
      f.params += params;
      open += params * grad_bytes;
      if (open >= limit) {
        ++f.buckets;
        open = 0;
      }
    }
    if (open > 0) f.buckets += per_block ? 1.0 : open / limit;
    return f;
  }

  // Where the lowering's backward pass (not zero-bubble's input- and weight-gradient passes)
  // ends a compute task inside `layer`: ends[i] says whether the task that produces op i's
  // gradients ends with op i, the backward running the ops from last to first. Lowering:
  // emit_chain runs consecutive ops as one task up to the next marker that stands for a
  // backward collective (chunk_items, comm_for); a column-parallel layer whose weight gradient
  // runs beside its input gradient's collective, or waits for its input gathered again, is a
  // task (two) of its own; selective recompute ends the task before the attention core; and
  // the pass that produces the reduced gradients runs one chain per block (emit_backward).
  static std::vector<bool> backward_task_ends(const model::ModelGraph& g, const Plan& p,
                                              int layer) {
    const auto& ops = g.layer_ops(layer);
    const std::size_t n = ops.size();
    const bool tp = p.tp > 1, sp = tp && p.sequence_parallel, cp = p.cp > 1, ep = p.ep > 1;
    const bool local_dispatch = plan::moe_local_dispatch(g.spec(), p);
    const bool block = layer >= 0 && layer < g.spec().layers;
    std::vector<bool> ends(n, false);
    if (n > 0) ends[0] = true;  // the layer's chain ends with it
    for (std::size_t i = 0; i < n; ++i) {
      const model::Op& o = g.op(ops[i]);
      // A collective before op i in forward order, after it in the backward.
      const bool enter =
          tp && (o.kind == model::OpKind::QkvProj || o.kind == model::OpKind::LmHead ||
                 plan::mlp_tp_enter(g.spec(), p, o));
      const bool before = enter || (o.kind == model::OpKind::AttentionCore && cp) ||
                          (o.kind == model::OpKind::MlpUp && o.expert &&
                           ((tp && !local_dispatch) || ep || local_dispatch));
      if (before && i > 0) ends[i] = true;
      // A collective after op i in forward order, before it in the backward.
      const bool after =
          (o.kind == model::OpKind::AttentionCore && cp && p.recompute != Recompute::Full) ||
          (o.kind == model::OpKind::MlpDown && o.expert && (local_dispatch || ep)) ||
          (sp && (o.kind == model::OpKind::AttnOutProj || plan::mlp_tp_exit(g.spec(), p, o)));
      if (after && i + 1 < n) ends[i + 1] = true;
      // A column-parallel layer of its own: the ops after it in forward order end before it.
      const bool own =
          enter && o.bwd_weight_flops > 0 &&
          (o.tp_split == model::TpSplit::Column || o.tp_split == model::TpSplit::Vocab) &&
          (p.overlap_tp_backward || sp);
      if (own && i + 1 < n) ends[i + 1] = true;
      // Selective recompute: what comes after the core in forward order ends before it.
      if (block && p.recompute == Recompute::Selective && o.kind == model::OpKind::AttentionCore &&
          i + 1 < n) {
        ends[i + 1] = true;
      }
    }
    return ends;
  }

  // Gradient buckets filled as the lowering fills them (fill_buckets, send_bucket): ops in the
  // backward's order, each op's gradients whole into its kind's open bucket (dense, or its
  // experts'), one that reaches plan::kGradientBucketBytes sent when the task holding its last
  // op ends; `flush` sends what is open, the dense before the experts' (flush_buckets).
  struct BucketFill {
    struct Sent {
      bool experts;
      double bytes, clock;  // clock: the compute before its send
    };
    std::array<double, 2> open{};
    std::vector<Sent> full, sent;
    double clock = 0;
    void add(bool experts, double bytes, double seconds, bool task_ends) {
      double& bucket = open[experts ? 1 : 0];
      bucket += bytes;
      clock += seconds;
      if (bucket >= static_cast<double>(plan::kGradientBucketBytes)) {
        full.push_back({experts, bucket, 0});
        bucket = 0;
      }
      if (task_ends) {
        for (const Sent& b : full) sent.push_back({b.experts, b.bytes, clock});
        full.clear();
      }
    }
    void flush() {
      for (const bool experts : {false, true}) {
        double& bucket = open[experts ? 1 : 0];
        if (bucket > 0) sent.push_back({experts, bucket, clock});
        bucket = 0;
      }
    }
  };

  // The compute of a block's first forward task: its ops up to the first collective among
  // them (lowering: chunk_items' markers and comm_for's forward collectives: sequence
  // parallelism's gathers before QKV and the MLP, tp's reductions after the attention's and
  // the MLP's output projections, cp's gather of K and V before the core, the experts' copies
  // gathered or sent before them and combined after).
  static double first_forward_task(const model::ModelGraph& g, const Plan& p,
                                   const cost::ComputeCost& cost, int layer) {
    const bool tp = p.tp > 1, sp = tp && p.sequence_parallel, cp = p.cp > 1, ep = p.ep > 1;
    const bool local_dispatch = plan::moe_local_dispatch(g.spec(), p);
    double s = 0;
    const auto& ops = g.layer_ops(layer);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const model::Op& o = g.op(ops[i]);
      const bool before =
          (sp && (o.kind == model::OpKind::QkvProj || plan::mlp_tp_enter(g.spec(), p, o))) ||
          (cp && o.kind == model::OpKind::AttentionCore) ||
          (o.kind == model::OpKind::MlpUp && o.expert && (local_dispatch || ep));
      if (before && i > 0) break;
      s += cost.op_seconds(o, Phase::Forward);
      const bool after =
          (tp && (o.kind == model::OpKind::AttnOutProj || plan::mlp_tp_exit(g.spec(), p, o))) ||
          (o.kind == model::OpKind::MlpDown && o.expert && (local_dispatch || ep));
      if (after) break;
    }
    return s;
  }

  // A stage's last dense buckets of a backward pass (up to kTailSends), each with its bytes and
  // the compute from its send to the pass's end: its first chunk's gradients filled in the
  // order the backward produces them (the head's where the chunk is the model's last, the blocks',
  // the embedding's last on the first stage), as the lowering fills them (grad_buckets); a bucket
  // goes out when the task holding its last op ends (backward_task_ends; zero-bubble's weight pass,
  // where the gradients are reduced beside it, runs a task per layer), what is open at the end on
  // its own. Zero-bubble's weight pass produces them, else the backward pass.
  struct Tail {
    struct Send {
      double bytes = 0;
      double before_end = 0;  // compute seconds from the send to the pass's end
    };
    std::vector<Send> sends;  // the last kTailSends, in the order sent
    double last = 0;          // the last one's bytes
  };
  // Enough for the buckets a block's ops send at once (each op's gradients go into one bucket:
  // a dense block has 6 ops with weights, one with experts up to 9 with shared experts, and
  // latent attention 3 more), with the stream's backlog before them left to the closed form's
  // whole-stream term (a block's ninth and later sends with it).
  static constexpr std::size_t kTailSends = 8;
  static Tail tail_buckets(const model::ModelGraph& g, const Plan& p, const cost::ComputeCost& cost,
                           const std::vector<int>& chunks, double grad_bytes, bool per_block,
                           int stage) {
    const bool zero_bubble = p.schedule == Schedule::ZeroBubble;
    const Phase phase = zero_bubble ? Phase::BackwardWeight : Phase::Backward;
    // A layer's ops in the backward's order: their dense gradient bytes, compute seconds, and
    // whether their task ends with them (a block's priced once, all blocks being alike).
    struct Priced {
      double bytes, seconds;
      bool ends;
    };
    const auto priced = [&](int layer) {
      std::vector<Priced> out;
      const auto& ops = g.layer_ops(layer);
      const std::vector<bool> ends =
          zero_bubble ? std::vector<bool>{} : backward_task_ends(g, p, layer);
      for (std::size_t i = ops.size(); i-- > 0;) {
        const model::Op& o = g.op(ops[i]);
        out.push_back({o.expert ? 0.0 : plan::rank_params(o, p) * grad_bytes,
                       cost.op_seconds(o, phase), i == 0 || (!zero_bubble && ends[i])});
      }
      return out;
    };
    BucketFill fill;
    const auto fill_layer = [&](const std::vector<Priced>& ops) {
      for (const Priced& op : ops) fill.add(false, op.bytes, op.seconds, op.ends);
      if (per_block) fill.flush();
    };
    const auto k = static_cast<std::size_t>(stage);
    if (k + 1 == chunks.size()) fill_layer(priced(static_cast<int>(g.spec().layers)));
    // Its blocks last to first, each kind (dense, with experts) priced once.
    std::array<std::optional<std::vector<Priced>>, 2> block;
    const int first = std::accumulate(chunks.begin(), chunks.begin() + stage, 0);
    for (int l = first + chunks[k]; l-- > first;) {
      auto& kind = block[g.spec().has_experts(l) ? 1 : 0];
      if (!kind) kind = priced(l);
      fill_layer(*kind);
    }
    if (k == 0) fill_layer(priced(-1));
    fill.flush();
    Tail t;
    if (!fill.sent.empty()) t.last = fill.sent.back().bytes;
    const std::size_t from = fill.sent.size() > kTailSends ? fill.sent.size() - kTailSends : 0;
    for (std::size_t i = from; i < fill.sent.size(); ++i) {
      t.sends.push_back({fill.sent[i].bytes, fill.clock - fill.sent[i].clock});
    }
    return t;
  }

  // The blocks' buckets per byte of their gradients; 0 when they have none. Blocks alike are
  // priced on the first; a mixture's dense blocks and those with experts each on its first,
  // weighted by their counts.
  static double block_buckets(const model::ModelGraph& g, const Plan& p, bool experts,
                              double grad_bytes, bool per_block) {
    const model::ModelSpec& m = g.spec();
    if (!m.mixed_blocks()) {
      const Filled f = fill_buckets(g, p, 0, experts, grad_bytes, per_block);
      return f.params > 0 ? f.buckets / (f.params * grad_bytes) : 0.0;
    }
    const auto block = [&](bool with_experts) {
      return fill_buckets(g, p, static_cast<int>(m.first_block(with_experts)), experts, grad_bytes,
                          per_block);
    };
    const Filled d = block(false), e = block(true);
    const auto n_dense = static_cast<double>(m.layers - m.expert_blocks());
    const auto n_experts = static_cast<double>(m.expert_blocks());
    const double params = n_dense * d.params + n_experts * e.params;
    return params > 0 ? (n_dense * d.buckets + n_experts * e.buckets) / (params * grad_bytes) : 0.0;
  }

  // The embedding's gradients on the first stage, the final norm's and the head's on the last,
  // filled on their own: the vocabulary's rows are a bucket of their own, which a block's rate
  // of buckets per byte would count as many.
  static Filled edge_buckets(const model::ModelGraph& g, const Plan& p, int stage,
                             double grad_bytes, bool per_block) {
    Filled e;
    for (const int layer : {static_cast<int>(g.spec().layers), -1}) {
      if (layer == -1 ? stage != 0 : stage != p.pp - 1) continue;
      const Filled f = fill_buckets(g, p, layer, false, grad_bytes, per_block);
      e.params += f.params;
      e.buckets += f.buckets;
    }
    return e;
  }

  // A data-parallel collective over `ranks` with its staging passes, as the simulator times it.
  double dp_collective_s(const cluster::Placement& placement, const lower::Group& grp,
                         std::int64_t ranks, const cost::ComputeCost& cost, CollectiveKind kind,
                         std::uint64_t bytes) {
    return net_->collective_s(placement, grp, kind, bytes) +
           cost.staging_seconds(kind, bytes, ranks);
  }

  // The time ZeRO-3's units wait for the dp stream over a step without pipelining: the
  // micro-batches' passes unit by unit (forward: embedding, blocks, head; backward the other
  // way), each unit's gather issued when the unit before it starts and started once the one
  // before that has (the first two at the step's start), each block's reduce-scatters (its gradient
  // buckets) when its backward ends.
  double zero3_unit_exposure(const model::ModelGraph& g, const Plan& p,
                             const cost::ComputeCost& cost, const cluster::Placement& placement,
                             double micro_batches, std::array<double, 2> block_f,
                             std::array<double, 2> block_b, std::array<double, 2> block_recompute,
                             double emb_f, double emb_b, double head_f, double head_b) {
    const auto bytes_per = plan::state_bytes_per_param(p);
    // A layer's parameters on this rank: its dense ones, or its experts'.
    const auto params = [&](int layer, bool experts) {
      double n = 0;
      for (model::OpId id : g.layer_ops(layer)) {
        if (g.op(id).expert == experts) n += plan::rank_params(g.op(id), p);
      }
      return n;
    };
    // The dense weights are sharded over dp x cp, the experts' over (dp / ep) x cp; a unit's
    // gathers and reductions of both queue on the one dp stream (lowering: Unit).
    struct Sharding {
      lower::Group group;
      std::int64_t ranks;
    };
    const Sharding dense{{lower::GroupKind::Dp, placement.gradient_group(0), {0}},
                         static_cast<std::int64_t>(p.dp) * p.cp};
    const Sharding experts{
        {lower::GroupKind::ExpertDp,
         g.spec().moe ? placement.expert_gradient_group(0) : std::vector<std::int64_t>{},
         {0}},
        g.spec().moe ? static_cast<std::int64_t>(p.dp / p.ep) * p.cp : 1};
    const auto dp_s = [&](const Sharding& over, CollectiveKind kind, double bytes) {
      return over.ranks > 1 && bytes > 0 ? dp_collective_s(placement, over.group, over.ranks, cost,
                                                           kind, static_cast<std::uint64_t>(bytes))
                                         : 0.0;
    };
    const int layers = static_cast<int>(g.spec().layers);
    // A unit's reductions, each sent some time before the unit's end.
    struct Send {
      double before_end, seconds;
    };
    struct Unit {
      double compute, gather;
      const std::vector<Send>* reduce;  // (blocks share theirs)
      double first = 0;                 // its first task's compute
    };
    // A block's buckets of its own (gradient_buckets_per_block), dense and its experts', each
    // sent when the task holding its last gradients ends (backward_task_ends: with tp the
    // MLP's bucket goes out at its up projection, the attention's backward before the block's
    // end), the block's backward pass after its recompute; what is open at its end last, the
    // dense before the experts' (lowering: flush_buckets). Each kind of block (dense, with
    // experts) priced on its first.
    const auto kind = [&](int layer) {
      return static_cast<std::size_t>(g.spec().has_experts(layer) ? 1 : 0);
    };
    std::array<double, 2> block_gather{}, first_forward{}, first_backward{};
    std::array<std::vector<Send>, 2> block_reduce;
    for (const std::size_t k : {0, 1}) {
      const auto first = g.spec().first_block(k == 1);
      if (first < 0) continue;
      const int layer = static_cast<int>(first);
      const auto& ops = g.layer_ops(layer);
      const std::vector<bool> ends = backward_task_ends(g, p, layer);
      // The block's first tasks (the next unit's gather waits for them): the forward's up to
      // its first collective, and the backward's, after full recompute's forward again.
      first_forward[k] = first_forward_task(g, p, cost, layer);
      for (std::size_t i = ops.size(); i-- > 0;) {
        first_backward[k] += cost.op_seconds(g.op(ops[i]), Phase::Backward);
        if (i == 0 || ends[i]) break;
      }
      if (p.recompute == Recompute::Full) first_backward[k] = first_forward[k];
      BucketFill fill;
      for (std::size_t i = ops.size(); i-- > 0;) {
        const model::Op& o = g.op(ops[i]);
        fill.add(o.expert, plan::rank_params(o, p) * bytes_per.gradients,
                 cost.op_seconds(o, Phase::Backward), i == 0 || ends[i]);
      }
      fill.flush();
      const double clock = fill.clock;
      // The compute's share of the pass (its tp collectives spread over it alike).
      const double stretch = clock > 0 ? block_b[k] / clock : 0.0;
      for (const BucketFill::Sent& b : fill.sent) {
        block_reduce[k].push_back(
            {(clock - b.clock) * stretch,
             dp_s(b.experts ? experts : dense, CollectiveKind::ReduceScatter, b.bytes)});
      }
      for (const bool expert : {false, true}) {
        block_gather[k] += dp_s(expert ? experts : dense, CollectiveKind::AllGather,
                                params(layer, expert) * bytes_per.weights);
      }
    }
    const double emb_gather =
        dp_s(dense, CollectiveKind::AllGather, params(-1, false) * bytes_per.weights);
    const double head_gather =
        dp_s(dense, CollectiveKind::AllGather, params(layers, false) * bytes_per.weights);
    const std::vector<Send> none,
        head_reduce{{0.0, dp_s(dense, CollectiveKind::ReduceScatter,
                               params(layers, false) * bytes_per.gradients)}},
        emb_reduce{{0.0, dp_s(dense, CollectiveKind::ReduceScatter,
                              params(-1, false) * bytes_per.gradients)}};
    // The head's backward keeps the weights of its forward, the next micro-batch's embedding
    // those of its backward (lowering: kept): no gather.
    std::vector<Unit> units;
    units.push_back({emb_f, 0.0, &none});
    for (int l = 0; l < layers; ++l) {
      units.push_back({block_f[kind(l)], block_gather[kind(l)], &none, first_forward[kind(l)]});
    }
    units.push_back({head_f, head_gather, &none});
    units.push_back({head_b, 0.0, &head_reduce});
    for (int l = layers; l-- > 0;) {
      units.push_back({block_b[kind(l)] + block_recompute[kind(l)], block_gather[kind(l)],
                       &block_reduce[kind(l)], first_backward[kind(l)]});
    }
    units.push_back({emb_b, emb_gather, &emb_reduce});
    // The gather of unit i + 1 goes out when unit i is issued, and may start once unit i - 1's
    // first task has ended (lowering: start_unit; a block's first task is its whole pass where
    // no collective cuts it: a dense block between experts' at tp 1), behind what the stream
    // holds already; a unit without one waits for nothing on the stream. The step's first unit
    // gathers the embedding (whose and the head's first tasks count as their starts).
    double stream = emb_gather, ready = stream, compute = 0, busy = 0, previous = 0;
    const auto passes = static_cast<std::int64_t>(micro_batches);
    for (std::int64_t mb = 0; mb < passes; ++mb) {
      for (std::size_t i = 0; i < units.size(); ++i) {
        const double start = std::max(compute, ready);
        const bool last = mb + 1 == passes && i + 1 == units.size();
        const double next = units[(i + 1) % units.size()].gather;
        if (!last && next > 0) {
          stream = std::max(stream, previous) + next;
          ready = stream;
        } else {
          ready = 0;
        }
        previous = start + units[i].first;
        compute = start + units[i].compute;
        busy += units[i].compute;
        for (const Send& send : *units[i].reduce) {
          stream = std::max(stream, compute - send.before_end) + send.seconds;
        }
      }
    }
    return std::max(compute, stream) - busy;
  }

  // A pipeline stage's parameters on a rank, dense and its experts' (their blocks, every
  // chunk's; the embedding's on the first stage, the head's and the final norm's on the last,
  // as the lowering's gradient buckets hold them: a tied head with pp = 1 has none of its own),
  // and those whose gradients sequence parallelism all-reduces over tp, whole
  // (plan::sp_partial_gradients). One walk of the stage's ops.
  struct StageParams {
    double dense = 0, experts = 0, sp = 0;
  };
  static StageParams stage_param_counts(const model::ModelGraph& g, const Plan& p, int stage,
                                        const std::vector<int>& chunks) {
    StageParams held;
    auto add = [&](model::OpId id) {
      const model::Op& o = g.op(id);
      (o.expert ? held.experts : held.dense) += plan::rank_params(o, p);
      if (plan::sp_partial_gradients(g.spec(), p, o)) {
        held.sp += static_cast<double>(o.params);
      }
    };
    for (int c = 0; c < p.virtual_stages; ++c) {
      const int k = c * p.pp + stage;
      int first = 0;
      for (int i = 0; i < k; ++i) first += chunks[static_cast<std::size_t>(i)];
      for (int l = first; l < first + chunks[static_cast<std::size_t>(k)]; ++l) {
        for (model::OpId id : g.layer_ops(l)) add(id);
      }
    }
    if (stage == 0) {
      for (model::OpId id : g.layer_ops(-1)) add(id);
    }
    if (stage == p.pp - 1) {
      for (model::OpId id : g.layer_ops(static_cast<int>(g.spec().layers))) add(id);
    }
    return held;
  }

  // E[max of n standard normals], memoised per estimator (one per search thread: the shared
  // memo of engine::expected_max_normal takes a lock, once per candidate and group here).
  double spread(std::int64_t n) {
    auto it = spread_.find(n);
    if (it == spread_.end()) it = spread_.emplace(n, engine::expected_max_normal(n)).first;
    return it->second;
  }

  const cluster::Cluster& cluster_;
  const cost::Profile* profile_;
  double jitter_cv_;
  double rank_spread_cv_;
  std::unique_ptr<network::NetworkModel> net_;
  std::map<std::int64_t, double> spread_;
};

// The uneven split of candidate c's layers (SearchOptions::balance_stages): from the even split
// over the model's chunks (pp x virtual stages), the move of one layer between an end chunk and
// another chunk that lowers the estimate most and still fits, while one does,
// kMostBalanceRounds rounds at most. The candidate with it (its estimate and memory) where it
// saves kBalanceGain of c's estimate or more, else none.
std::optional<Candidate> balance(Estimator& estimator, const model::ModelGraph& g,
                                 const Candidate& c, const cluster::Cluster& cluster,
                                 const plan::MemoryOptions& memory) {
  Plan split = c.plan;
  split.layers_per_stage = plan::chunk_layers(c.plan, g.spec().layers);
  double split_s = c.estimate_s;
  std::optional<Candidate> found;
  const int chunks = c.plan.pp * c.plan.virtual_stages, last = chunks - 1;
  for (int round = 0; round < kMostBalanceRounds; ++round) {
    std::optional<Candidate> move;
    for (int from = 0; from < chunks; ++from) {
      if (split.layers_per_stage[static_cast<std::size_t>(from)] <= 1) continue;
      for (int to = 0; to < chunks; ++to) {
        // (Moves to or from an end chunk, where the embedding and the head are: about 4 x
        // chunks of them a round, not chunks².)
        const bool end = from == 0 || to == 0 || from == last || to == last;
        if (to == from || !end) continue;
        Candidate t = c;
        t.plan = split;
        --t.plan.layers_per_stage[static_cast<std::size_t>(from)];
        ++t.plan.layers_per_stage[static_cast<std::size_t>(to)];
        t.estimate = estimator.estimate(g, t.plan, Detail::Full);
        t.estimate_s = t.estimate.total_s();
        // (A move worth a part in 10^6 of the step at least: not a rounding.)
        const double beat = move ? move->estimate_s : split_s * (1 - 1e-6);
        if (!(t.estimate_s < beat)) continue;
        const plan::MemoryReport r = plan::estimate_memory(g, t.plan, cluster, memory);
        if (!r.fits) continue;
        t.memory_bytes = r.worst().total_bytes;
        t.capacity_bytes = r.capacity_bytes;
        t.fits = true;
        move = std::move(t);
      }
    }
    if (!move) break;
    split = move->plan;
    split_s = move->estimate_s;
    found = std::move(move);
  }
  // (An uneven split is a layout to carry over to the training's configuration: only one that
  // saves kBalanceGain of the step at least.)
  if (found && found->estimate_s <= c.estimate_s * (1 - kBalanceGain)) return found;
  return std::nullopt;
}

bool allowed(int fixed, int value) {
  return fixed < 0 || fixed == value;
}

std::vector<Plan> enumerate(const model::ModelSpec& m, std::int64_t devices,
                            std::int64_t devices_per_node, const SearchSpace& space) {
  std::vector<Plan> out;
  const int max_tp = space.max_tp > 0 ? space.max_tp : static_cast<int>(devices_per_node);
  const std::int64_t seq = space.seq_len > 0 ? space.seq_len : m.seq_len;
  const auto widths = m.mlp_widths();
  for (int tp : divisors(devices)) {
    if (tp > max_tp || !allowed(space.fixed_tp, tp)) continue;
    if (m.heads % tp != 0 || m.kv_heads % tp != 0 ||
        std::any_of(widths.begin(), widths.end(), [tp](const auto& w) { return w.second % tp; })) {
      continue;
    }
    for (int cp : divisors(devices / tp)) {
      if (cp > space.max_cp || !allowed(space.fixed_cp, cp) || !plan::cp_splits_sequence(seq, cp))
        continue;
      for (int pp : divisors(devices / tp / cp)) {
        if (pp > m.layers || (space.max_pp > 0 && pp > space.max_pp) ||
            !allowed(space.fixed_pp, pp))
          continue;
        const int dp = static_cast<int>(devices / tp / cp / pp);
        if (!allowed(space.fixed_dp, dp)) continue;
        std::vector<int> eps = {1};
        if (m.moe) {
          eps.clear();
          for (int ep : divisors(dp)) {
            if (m.moe->experts % ep == 0) eps.push_back(ep);
          }
        }
        for (int ep : eps) {
          if (!allowed(space.fixed_ep, ep)) continue;
          for (std::int64_t mbs : space.micro_batch_sizes) {
            if (space.global_batch_size % (mbs * dp) != 0) continue;
            const std::int64_t micro_batches = space.global_batch_size / (mbs * dp);
            for (Schedule s : space.schedules) {
              if (pp == 1 && s != Schedule::OneFOneB) continue;
              std::vector<int> vs = {1};
              if (s == Schedule::Interleaved) {
                vs.clear();
                // Chunks of unequal layers where pp x v does not divide them, as pipeline
                // stages are (plan::chunk_layers: the first chunks take one more; Llama 3
                // 405B's 126 layers ran on 16 interleaved stages, Dubey et al. 2024, Sec. 3.3.2).
                for (int v : space.virtual_stages) {
                  if (micro_batches % pp == 0 && std::int64_t{pp} * v <= m.layers) {
                    vs.push_back(v);
                  }
                }
              }
              for (int v : vs) {
                for (int zero : space.zero_stages) {
                  if (zero >= 2 && pp > 1) continue;  // allowed, but not worth searching
                  if (zero > 0 && dp * cp == 1) continue;
                  for (Recompute r : space.recomputes) {
                    // FlashAttention keeps no s² tensor for selective recompute to drop.
                    if (r == Recompute::Selective &&
                        space.attention == model::AttentionKernel::Flash) {
                      continue;
                    }
                    for (bool sp : {false, true}) {
                      if (sp && tp == 1) continue;
                      Plan p;
                      p.tp = tp;
                      p.cp = cp;
                      p.pp = pp;
                      p.dp = dp;
                      p.ep = ep;
                      if (ep > 1)
                        p.expert_load = std::min(space.expert_load, plan::max_expert_load(m, p));
                      p.micro_batch_size = mbs;
                      p.global_batch_size = space.global_batch_size;
                      p.seq_len = seq;
                      p.schedule = s;
                      p.virtual_stages = v;
                      p.zero_stage = zero;
                      p.recompute = r;
                      p.sequence_parallel = sp;
                      p.precision = space.precision;
                      p.attention = space.attention;
                      p.overlap_param_gather =
                          space.overlap_param_gather && (zero == 1 || zero == 2);
                      p.zero_in_place = space.zero_in_place && zero == 1;
                      p.clip_grad = space.clip_grad;
                      if (!cluster::Placement(p.degrees(), p.order)
                               .symmetric_on(devices_per_node)) {
                        continue;
                      }
                      out.push_back(p);
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  return out;
}

}  // namespace

std::string dominant_term(const engine::Breakdown& b, double step_s) {
  const std::pair<double, const char*> terms[] = {
      {b.compute_s, "compute"},
      {b.recompute_s, "recompute"},
      {b.bubble_s, "pipeline bubble"},
      {b.exposed_tp_s, "exposed TP communication"},
      {b.exposed_cp_s, "exposed CP communication"},
      {b.exposed_ep_s, "exposed EP communication"},
      {b.exposed_dp_s, "exposed DP communication"},
      {b.exposed_pp_s, "exposed PP communication"},
      {b.straggler_s(), "straggler waits"},
      {b.optimizer_s, "optimizer"},
  };
  // The largest term other than compute: what the plan pays for parallelism.
  const auto* best = &terms[1];
  for (const auto& t : terms) {
    if (t.second != terms[0].second && t.first > best->first) best = &t;
  }
  // A share under 1% to a tenth; under a twentieth of one, none.
  const double percent = 100.0 * best->first / step_s;
  if (!(percent >= 0.05)) return "compute only";
  return percent < 1 ? fmt::format("{} {:.1f}%", best->second, percent)
                     : fmt::format("{} {:.0f}%", best->second, percent);
}

double estimate_s(const model::ModelGraph& graph, const plan::Plan& plan,
                  const cluster::Cluster& cluster, const SearchOptions& options, Detail detail) {
  Estimator estimator(cluster, options.profile,
                      engine::jitter_cv_of(options.jitter_cv, options.profile),
                      engine::rank_spread_cv_of(options.rank_spread_cv, options.profile));
  return estimator.estimate(graph, plan, detail).total_s();
}

std::optional<BalancedSplit> balanced_split(const model::ModelGraph& graph, const plan::Plan& plan,
                                            const cluster::Cluster& cluster,
                                            const SearchOptions& options,
                                            const plan::MemoryOptions& memory) {
  if (plan.pp < 2 || plan.schedule == Schedule::PipeDreamAsync) return std::nullopt;
  Estimator estimator(cluster, options.profile,
                      engine::jitter_cv_of(options.jitter_cv, options.profile),
                      engine::rank_spread_cv_of(options.rank_spread_cv, options.profile));
  Candidate even;
  even.plan = plan;
  even.plan.layers_per_stage.clear();
  even.estimate_s = estimator.estimate(graph, even.plan, Detail::Full).total_s();
  const auto found = balance(estimator, graph, even, cluster, memory);
  if (!found) return std::nullopt;
  return BalancedSplit{found->plan.layers_per_stage, found->estimate_s, even.estimate_s};
}

std::int64_t largest_searchable_devices(const model::ModelSpec& model,
                                        const cluster::Cluster& cluster, const SearchSpace& space) {
  // As --gpus takes them: whole nodes, or part of one node.
  const std::int64_t per_node = cluster.devices_per_node;
  for (std::int64_t nodes = cluster.devices() / per_node - 1; nodes >= 1; --nodes) {
    if (!enumerate(model, nodes * per_node, per_node, space).empty()) return nodes * per_node;
  }
  for (std::int64_t devices = std::min(per_node, cluster.devices()) - 1; devices >= 1; --devices) {
    if (!enumerate(model, devices, per_node, space).empty()) return devices;
  }
  return 0;
}

double ranking_key(double key) {
  int exponent = 0;
  const double mantissa = std::frexp(key, &exponent);
  return std::ldexp(std::round(std::ldexp(mantissa, 30)), exponent - 30);
}

SearchResult search(const model::ModelSpec& m, const cluster::Cluster& cluster,
                    const SearchSpace& space, const SearchOptions& options) {
  if (space.global_batch_size < 1) {
    throw InputError(
        "--global-batch-size: the planner needs the global batch (sequences per step)");
  }
  std::vector<Plan> plans = enumerate(m, cluster.devices(), cluster.devices_per_node, space);
  // Plans the simulator could not run (more tasks than it handles: a global batch of a billion
  // sequences in micro-batches of one) are left out before any is estimated, as their
  // timelines would take minutes and gigabytes; where that leaves none, the one with the fewest
  // tasks says why, as simulate would.
  {
    std::optional<Plan> fewest;
    double fewest_tasks = std::numeric_limits<double>::infinity();
    std::erase_if(plans, [&](const Plan& p) {
      const double tasks = lower::program_tasks(m.layers, p, lower::Lowering::Representatives);
      if (tasks <= lower::kMostProgramTasks) return false;
      // (An invalid plan says its own reason, past 2^24 micro-batches say: not this one.)
      if (tasks < fewest_tasks && plan::check_plan(p, m, cluster.devices()).ok()) {
        fewest_tasks = tasks;
        fewest = p;
      }
      return true;
    });
    if (plans.empty() && fewest) {
      lower::check_program_size(m.layers, *fewest, lower::Lowering::Representatives);
    }
  }
  // One graph per micro-batch size and padded vocabulary (it follows tp), shared read-only by
  // the threads.
  using GraphKey = std::pair<std::int64_t, std::int64_t>;
  auto graph_key = [&](const Plan& p) -> GraphKey {
    return {p.micro_batch_size, plan::padded_vocab(m.vocab, p)};
  };
  std::map<GraphKey, std::unique_ptr<model::ModelGraph>> graphs;
  for (const Plan& p : plans) {
    auto& g = graphs[graph_key(p)];
    if (!g) {
      g = std::make_unique<model::ModelGraph>(plan::graph_of(m, p));
    }
  }
  struct Evaluated {
    bool valid = false;
    bool bound = false;  // c.estimate is Detail::Bound's
    Candidate c;
  };
  std::vector<Evaluated> results(plans.size());
  plan::MemoryOptions memory = space.memory;
  memory.capacity_bytes = space.memory.capacity_bytes.value_or(cluster.device.memory_bytes.value) *
                          (1.0 - space.memory_headroom);
  const double price =
      cluster.price_per_device_hour_usd ? cluster.price_per_device_hour_usd->value : -1;
  // Stragglers in both tiers, by the simulator's rule.
  const double jitter_cv = engine::jitter_cv_of(options.jitter_cv, options.profile);
  const double rank_spread_cv = engine::rank_spread_cv_of(options.rank_spread_cv, options.profile);
  std::atomic<std::uint64_t> done{0};
  const unsigned threads = std::max(1U, options.threads > 0 ? static_cast<unsigned>(options.threads)
                                                            : std::thread::hardware_concurrency());
  // A step's price on the whole cluster, when the cluster has one.
  auto price_step = [&](Candidate& c) {
    if (price > 0) c.cost_per_step_usd = c.step_time_s * cluster.devices() * price / 3600;
  };
  auto estimate = [&](Estimator& estimator, Evaluated& e, Detail detail) {
    e.c.estimate = estimator.estimate(*graphs.at(graph_key(e.c.plan)), e.c.plan, detail);
    e.bound = detail == Detail::Bound && has_timeline(e.c.plan);
    e.c.estimate_s = e.c.estimate.total_s();
    e.c.step_time_s = e.c.estimate_s;
    price_step(e.c);
  };
  auto make_estimator = [&] {
    return Estimator(cluster, options.profile, jitter_cv, rank_spread_cv);
  };
  // Every candidate's memory, and the estimate of those that fit. Over memory only the fastest
  // and the one closest to fitting are shown, so they get a bound first and an estimate below
  // only where the bound leaves them in the running (most of a large model's candidates do
  // not fit). Bad input found while estimating ends the search with the error of the earliest
  // candidate that meets it, whatever the thread count.
  parallel_for(plans.size(), threads, [&] {
    return [&, estimator = make_estimator()](std::size_t i) mutable {
      const Plan& p = plans[i];
      Evaluated& e = results[i];
      if (plan::check_plan(p, m, cluster.devices()).ok()) {
        e.valid = true;
        e.c.plan = p;
        const plan::MemoryReport r =
            plan::estimate_memory(*graphs.at(graph_key(p)), p, cluster, memory);
        e.c.memory_bytes = r.worst().total_bytes;
        e.c.capacity_bytes = r.capacity_bytes;
        e.c.fits = r.fits;
        estimate(estimator, e, r.fits ? Detail::Full : Detail::Bound);
      }
      const std::uint64_t n = ++done;
      if (options.progress && (n % 256 == 0 || n == plans.size()))
        options.progress(n, plans.size());
    };
  });

  SearchResult out;
  std::vector<Candidate> feasible;
  std::vector<std::size_t> over;  // candidates over memory
  for (std::size_t i = 0; i < results.size(); ++i) {
    const Evaluated& e = results[i];
    if (!e.valid) continue;
    ++out.evaluated;
    if (e.c.fits) {
      feasible.push_back(e.c);
    } else {
      over.push_back(i);
    }
  }
  out.feasible = feasible.size();
  // The fastest over memory: estimated in the order of their bounds, each only while its bound
  // is at most the fastest estimate yet; whichever thread finds which, a candidate left out was
  // bound above an estimate, so slower than the fastest. (The margin: a bound equal to its
  // estimate may come out a rounding above it, summed in another order.) Bad input was met in
  // the first pass; an internal error in an estimate here may depend on the thread count.
  std::vector<std::size_t> by_bound = over;
  std::stable_sort(by_bound.begin(), by_bound.end(), [&](std::size_t a, std::size_t b) {
    return results[a].c.estimate_s < results[b].c.estimate_s;
  });
  std::atomic<double> fastest{std::numeric_limits<double>::infinity()};
  parallel_for(by_bound.size(), threads, [&] {
    return [&, estimator = make_estimator()](std::size_t j) mutable {
      Evaluated& e = results[by_bound[j]];
      if (e.bound) {
        if (e.c.estimate_s > fastest.load() * (1 + 1e-12)) return;
        estimate(estimator, e, Detail::Full);
      }
      for (double was = fastest.load();
           e.c.estimate_s < was && !fastest.compare_exchange_weak(was, e.c.estimate_s);) {
      }
    };
  });
  // The closest to fitting: the least memory, then the fastest.
  double least = std::numeric_limits<double>::infinity();
  for (const std::size_t i : over) least = std::min(least, results[i].c.memory_bytes);
  Estimator estimator = make_estimator();
  for (const std::size_t i : over) {
    Evaluated& e = results[i];
    if (e.c.memory_bytes > least) continue;
    if (e.bound) estimate(estimator, e, Detail::Full);
    const auto& closest = out.closest_not_fitting;
    if (!closest || std::tie(e.c.memory_bytes, e.c.estimate_s) <
                        std::tie(closest->memory_bytes, closest->estimate_s)) {
      out.closest_not_fitting = e.c;
    }
  }
  for (const std::size_t i : over) {
    const Evaluated& e = results[i];
    if (e.bound) continue;
    if (!out.best_not_fitting || e.c.estimate_s < out.best_not_fitting->estimate_s) {
      out.best_not_fitting = e.c;
    }
  }
  // The memory frontier: over memory, in order of memory, each candidate whose estimate beats
  // the fastest fitting estimate and all those before it (estimate against estimate, both
  // closed form; the objective does not matter, a step's price being its time on the same
  // devices). A chunk at a time: the bounds above the best yet are skipped, since they cannot
  // beat it; the others are estimated in full on the threads, then walked in order, so
  // the front does not depend on the thread count (which ones get estimated does).
  // When nothing fits, the front starts at the closest to fitting.
  double best = std::numeric_limits<double>::infinity();
  for (const Candidate& c : feasible) best = std::min(best, c.estimate_s);
  std::vector<std::size_t> by_memory;
  if (options.memory_frontier) by_memory = over;
  // By memory alone: which estimates are full yet depends on the threads.
  std::stable_sort(by_memory.begin(), by_memory.end(), [&](std::size_t a, std::size_t b) {
    return results[a].c.memory_bytes < results[b].c.memory_bytes;
  });
  // A bound that may still beat `best`. A bound may come out a rounding above its estimate
  // (summed in another order): the same margin as the fastest's pass above.
  auto in_running = [&best](const Evaluated& e) {
    return e.bound && e.c.estimate_s <= best * (1 + 1e-12);
  };
  const std::size_t chunk = 8 * static_cast<std::size_t>(threads);
  for (std::size_t from = 0; from < by_memory.size(); from += chunk) {
    const std::size_t n = std::min(chunk, by_memory.size() - from);
    if (std::any_of(by_memory.begin() + static_cast<std::ptrdiff_t>(from),
                    by_memory.begin() + static_cast<std::ptrdiff_t>(from + n),
                    [&](std::size_t i) { return in_running(results[i]); })) {
      parallel_for(n, threads, [&] {
        return [&, estimator = make_estimator()](std::size_t j) mutable {
          Evaluated& e = results[by_memory[from + j]];
          if (in_running(e)) estimate(estimator, e, Detail::Full);
        };
      });
    }
    for (std::size_t j = 0; j < n; ++j) {
      const Evaluated& e = results[by_memory[from + j]];
      if (e.bound || !(e.c.estimate_s < best)) continue;
      // Of two needing the same memory, the faster (the first of equals): it replaces the one
      // before it.
      auto& front = out.memory_frontier;
      if (!front.empty() && front.back().memory_bytes == e.c.memory_bytes) front.pop_back();
      front.push_back(e.c);
      best = e.c.estimate_s;
    }
  }
  auto key = [&](const Candidate& c) {
    return options.objective == Objective::Cost && c.cost_per_step_usd >= 0 ? c.cost_per_step_usd
                                                                            : c.step_time_s;
  };
  // Keys that tie (ranking_key) rank by memory, the less first.
  auto by_key = [&](const Candidate& a, const Candidate& b) {
    const double x = ranking_key(key(a)), y = ranking_key(key(b));
    if (x != y) return x < y;
    if (a.memory_bytes != b.memory_bytes) return a.memory_bytes < b.memory_bytes;
    return plan::summary(a.plan) < plan::summary(b.plan);
  };
  std::sort(feasible.begin(), feasible.end(), by_key);
  // Uneven pipeline stages: the layer split of the best candidates with pp > 1, searched by the
  // estimate (Megatron-LM sets it by hand: --decoder-first-pipeline-num-layers and
  // --decoder-last-pipeline-num-layers, as the first stage carries the embedding and the last
  // the LM head and the loss). From the even split over the model's chunks (pp x virtual
  // stages), the move of one layer between an end chunk and another chunk that lowers the
  // estimate most and still fits, while one does, kMostBalanceRounds rounds at most; each
  // candidate on its own, so the result does not depend on the thread count. Those that
  // improve by kBalanceGain or more replace their even split, and the ranking is made again.
  if (options.balance_stages > 0) {
    std::vector<std::size_t> to_balance;
    for (std::size_t i = 0; i < feasible.size() &&
                            to_balance.size() < static_cast<std::size_t>(options.balance_stages);
         ++i) {
      const Plan& p = feasible[i].plan;
      if (p.pp > 1 && p.layers_per_stage.empty() && p.schedule != Schedule::PipeDreamAsync &&
          p.pp * p.virtual_stages <= kMostBalancedChunks) {
        to_balance.push_back(i);
      }
    }
    parallel_for(to_balance.size(), threads, [&] {
      return [&, estimator = make_estimator()](std::size_t j) mutable {
        Candidate& c = feasible[to_balance[j]];
        if (auto found = balance(estimator, *graphs.at(graph_key(c.plan)), c, cluster, memory)) {
          c = std::move(*found);
          c.step_time_s = c.estimate_s;
          price_step(c);
        }
      };
    });
    std::sort(feasible.begin(), feasible.end(), by_key);
  }
  if (options.distinct_layouts) {
    std::set<std::tuple<int, int, int, int, int, std::int64_t, plan::Schedule, int>> seen;
    std::erase_if(feasible, [&](const Candidate& c) {
      const plan::Plan& p = c.plan;
      return !seen.insert({p.dp, p.tp, p.pp, p.cp, p.ep, p.micro_batch_size, p.schedule,
                           p.virtual_stages})
                  .second;
    });
  }

  // Tier 2: the discrete-event simulator on the best `refine` candidates.
  // Each thread simulates with a network model of its own (the analytical model memoizes).
  const int refine = std::clamp<int>(options.refine, 0, static_cast<int>(feasible.size()));
  engine::SimulateOptions sim_options;
  sim_options.memory = memory;
  sim_options.profile = options.profile;
  sim_options.jitter_cv = options.jitter_cv;
  sim_options.rank_spread_cv = options.rank_spread_cv;
  std::atomic<std::uint64_t> simulations_done{0};
  const auto refined = [&](Candidate& c) {
    c.step_time_s = c.prediction.step_time_s;
    c.refined = true;
    price_step(c);
    const std::uint64_t n = ++simulations_done;
    if (options.simulated) options.simulated(n, static_cast<std::uint64_t>(refine));
  };
  if (options.simulate) {
    for (int i = 0; i < refine; ++i) {
      Candidate& c = feasible[static_cast<std::size_t>(i)];
      c.prediction = options.simulate(c.plan, sim_options);
      refined(c);
    }
  } else {
    parallel_for(static_cast<std::size_t>(refine), threads, [&] {
      return [&, net = network::make_analytical(cluster)](std::size_t i) {
        Candidate& c = feasible[i];
        c.prediction =
            engine::simulate(*graphs.at(graph_key(c.plan)), c.plan, cluster, *net, sim_options)
                .prediction;
        refined(c);
      };
    });
  }
  for (int i = 0; i < refine; ++i) {
    const Candidate& c = feasible[static_cast<std::size_t>(i)];
    out.max_estimate_error =
        std::max(out.max_estimate_error, std::abs(c.estimate_s / c.step_time_s - 1));
  }
  // Pairs the two tiers order the opposite way; a tie in either tier (to a part in 10^9: ZeRO-1
  // and ZeRO-2 plans often take the same time) orders nothing.
  const auto order = [](double x, double y) {
    const double tie = 1e-9 * std::max(std::abs(x), std::abs(y));
    return x < y - tie ? -1 : (x > y + tie ? 1 : 0);
  };
  for (int i = 0; i < refine; ++i) {
    for (int j = i + 1; j < refine; ++j) {
      const auto& a = feasible[static_cast<std::size_t>(i)];
      const auto& b = feasible[static_cast<std::size_t>(j)];
      const int by_estimate = order(a.estimate_s, b.estimate_s);
      const int simulated = order(a.step_time_s, b.step_time_s);
      if (by_estimate != 0 && simulated != 0 && by_estimate != simulated) {
        ++out.order_disagreements;
        out.max_disagreement_gap = std::max(
            out.max_disagreement_gap,
            std::max(a.step_time_s, b.step_time_s) / std::min(a.step_time_s, b.step_time_s) - 1);
      }
    }
  }
  std::sort(feasible.begin(), feasible.begin() + refine, by_key);
  out.refined = refine;
  out.ranked = std::move(feasible);
  return out;
}

}  // namespace dtsim::planner
