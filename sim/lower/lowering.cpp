#include "sim/lower/lowering.hpp"

#include <fmt/compile.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "sim/common/error.hpp"
#include "sim/lower/schedule.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::lower {

std::string_view LabelText::keep(std::string_view text) {
  constexpr std::size_t kBlock = std::size_t{1} << 16;
  if (text.empty()) return {};
  if (text.size() > left_) {
    const std::size_t size = std::max(kBlock, text.size());
    blocks_.push_back(std::make_unique_for_overwrite<char[]>(size));
    next_ = blocks_.back().get();
    left_ = size;
  }
  std::memcpy(next_, text.data(), text.size());
  const std::string_view kept(next_, text.size());
  next_ += text.size();
  left_ -= text.size();
  return kept;
}

std::size_t Program::task_count() const {
  std::size_t n = 0;
  for (const auto& r : ranks) n += r.tasks.size();
  return n;
}

std::string_view to_string(Stream s) {
  switch (s) {
    case Stream::Compute:
      return "compute";
    case Stream::Tp:
      return "comm_tp";
    case Stream::Cp:
      return "comm_cp";
    case Stream::Ep:
      return "comm_ep";
    case Stream::Dp:
      return "comm_dp";
    case Stream::Pp:
      return "comm_pp";
  }
  return "?";
}

std::string_view to_string(GroupKind k) {
  switch (k) {
    case GroupKind::Tp:
      return "tp";
    case GroupKind::Cp:
      return "cp";
    case GroupKind::Ep:
      return "ep";
    case GroupKind::Dp:
      return "dp";
    case GroupKind::ExpertDp:
      return "expert_dp";
    case GroupKind::Pp:
      return "pp";
  }
  return "?";
}

std::string_view to_string(Phase p) {
  switch (p) {
    case Phase::Forward:
      return "fwd";
    case Phase::Backward:
      return "bwd";
    case Phase::BackwardInput:
      return "bwd_input";
    case Phase::BackwardWeight:
      return "bwd_weight";
    case Phase::Recompute:
      return "recompute";
    case Phase::Optimizer:
      return "optimizer";
    case Phase::GradNorm:
      return "grad_norm";
    case Phase::None:
      return "none";
  }
  return "?";
}

std::string_view to_string(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce:
      return "all_reduce";
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::AllToAll:
      return "all_to_all";
  }
  return "?";
}

std::string_view to_string(TaskKind k) {
  switch (k) {
    case TaskKind::Compute:
      return "compute";
    case TaskKind::Collective:
      return "collective";
    case TaskKind::Send:
      return "send";
    case TaskKind::Recv:
      return "recv";
  }
  return "?";
}

namespace {

using cluster::ParallelDim;
using model::OpId;
using model::OpKind;

// Where a parallel region begins or ends inside a chunk's op sequence.
enum class Marker {
  TpEnter,
  TpExit,
  TpLoss,
  TpGates,
  CpGatherKv,
  CpRegatherKv,
  EpDispatch,
  EpCombine,
  // plan::moe_local_dispatch: the copies an ep rank's experts got, all-gathered over tp
  // (forward; their gradients reduce-scattered in backward), and the experts' outputs
  // reduce-scattered back (forward; their gradients all-gathered in backward).
  TpGatherCopies,
  TpScatterCopies
};

struct Item {
  std::optional<OpId> op;  // an op, or a marker
  Marker marker = Marker::TpEnter;
  int layer = 0;
  // A marker's boundary op, which names the tensor its collective carries: for TpExit the op
  // before it (its output is reduced in forward), for TpEnter the op after it (the gradient of
  // its input is reduced in backward), for TpLoss the loss statistics, for TpGates the
  // experts' up op.
  OpId anchor = 0;
};

// Items (or a layer) by layer, for bisecting a chunk's items.
struct ByLayer {
  bool operator()(const Item& a, const Item& b) const { return a.layer < b.layer; }
  bool operator()(const Item& a, int layer) const { return a.layer < layer; }
  bool operator()(int layer, const Item& b) const { return layer < b.layer; }
};

struct Comm {
  CollectiveKind kind;
  GroupKind group;
  Stream stream;
  std::uint64_t bytes;
  const char* what;
};

class Lowerer {
 public:
  Lowerer(const model::ModelGraph& g, const plan::Plan& plan, const LowerOptions& options)
      : g_(g),
        plan_(plan),
        options_(options),
        placement_(plan.degrees(), plan.order),
        chunks_(plan::chunk_layers(plan, g.spec().layers)),
        // Communicated activations and gradients: in the plan's communication precision when it
        // has one (low-precision communication), else as trained.
        act_bytes_(static_cast<std::uint64_t>(
            plan.comm_precision ? wire_bytes(*plan.comm_precision)
                                : plan::activation_bytes_per_element(plan.precision))),
        grad_bytes_(plan::state_bytes_per_param(plan).gradients),
        grad_comm_scale_(plan::gradient_wire_bytes(plan) / grad_bytes_),
        weight_bytes_(plan::state_bytes_per_param(plan).weights) {
    const model::ModelSpec& m = g.spec();
    tokens_ = static_cast<std::uint64_t>(plan.micro_batch_size * plan.seq_len / plan.cp);
    hidden_bytes_ = tokens_ * static_cast<std::uint64_t>(m.hidden) * act_bytes_;
    DTSIM_ASSERT(g.micro_batch() == plan.micro_batch_size && g.seq_len() == plan.seq_len,
                 "lower: the graph must be built for the plan's micro-batch and sequence length");
  }

  Program run() {
    program_.plan = plan_;
    program_.lowering = options_.mode;
    const std::int64_t ranks = plan_.devices();
    if (options_.mode == Lowering::Representatives) {
      for (int s = 0; s < plan_.pp; ++s) {
        RankProgram rp;
        rp.rank = placement_.rank({0, 0, 0, 0, s});
        rp.stage = s;
        for (std::int64_t r = 0; r < ranks; ++r) {
          if (placement_.coords(r).pp == s) rp.represents.push_back(r);
        }
        program_.ranks.push_back(std::move(rp));
      }
    } else {
      for (std::int64_t r = 0; r < ranks; ++r) {
        RankProgram rp;
        rp.rank = r;
        rp.stage = placement_.coords(r).pp;
        rp.represents = {r};
        program_.ranks.push_back(std::move(rp));
      }
    }
    for (std::size_t i = 0; i < program_.ranks.size(); ++i) {
      lower_rank(static_cast<int>(i));
      most_tasks_ = std::max(most_tasks_, program_.ranks[i].tasks.size());
    }
    return std::move(program_);
  }

 private:
  const model::ModelGraph& g_;
  const plan::Plan& plan_;
  const LowerOptions& options_;
  cluster::Placement placement_;
  std::vector<int> chunks_;
  std::uint64_t act_bytes_;  // per communicated activation element
  double grad_bytes_;        // per gradient element as kept (the buckets' sizes)
  double grad_comm_scale_;   // communicated gradient bytes over kept ones
  double weight_bytes_;
  std::uint64_t tokens_ = 0;        // tokens of one micro-batch on one rank (b·s/cp)
  std::uint64_t hidden_bytes_ = 0;  // one activation tensor of width h
  // Each tp rank routes its share of the sequence (plan::moe_local_dispatch).
  bool local_dispatch_ = plan::moe_local_dispatch(g_.spec(), plan_);
  // Without p2p overlap, whether an exchange holds its sender until its tensors are received
  // (see add and schedule.hpp).
  bool holds_sends_ = exchanges_hold_senders(plan_);
  Program program_;
  fmt::memory_buffer label_buffer_;
  std::map<std::pair<GroupKind, std::vector<std::int64_t>>, std::int32_t> group_ids_;

  // Per-rank state while lowering.
  RankProgram* rp_ = nullptr;
  int prog_ = 0;
  // Per GroupKind (Pp the last), -1 until looked up.
  std::array<std::int32_t, static_cast<std::size_t>(GroupKind::Pp) + 1> rank_groups_{};
  // The most tasks a rank program had so far: the next reserves that many (stages differ by
  // little), so that its tasks are not moved as the vector grows.
  std::size_t most_tasks_ = 0;
  // Pipeline transfers without overlap (plan.overlap_p2p_comm false): the last compute task
  // issued, after which a round's exchange is posted.
  TaskId last_compute_task_ = -1;
  std::vector<TaskId> exchange_;  // the transfers the next compute task waits for (see add)

  // ZeRO-3 as FSDP wraps a model: one gather per unit (a block, the embedding, the head) and
  // pass, fetched one unit ahead, with schedules whose backward passes are whole (zero-bubble's
  // weight passes take a chunk's weights at once: it gathers per chunk and pass, and as a stage
  // is one chunk there, once a step; see kept). The units of
  // the rank's passes in the order their compute starts, the gather of each (-1: nothing to
  // gather), the next unit to start, and where the previous one started.
  struct Unit {
    std::size_t pass = 0;
    int chunk = 0;
    int layer = 0;
    int micro_batch = 0;
  };
  bool unit_gathers_ = false;
  // The units gather ZeRO-1/2's updated weights (plan overlap_param_gather) rather than
  // ZeRO-3's.
  bool param_gathers_ = false;
  std::vector<Unit> units_;
  std::vector<TaskId> unit_gather_;
  std::size_t next_unit_ = 0;
  TaskId unit_started_ = -1;
  std::size_t pass_ = 0;  // the pass being lowered
  const std::vector<std::vector<Item>>* rank_items_ = nullptr;
  // Data-parallel gradient buckets being filled (grad_buckets): dense and experts' apart, each
  // sent once it reaches options_.dp_bucket_bytes.
  struct Bucket {
    double bytes = 0;
    TaskId last = -1;
    int index = 0;
    OpId lo = 0, hi = 0;  // the ops whose gradients the bucket carries
  };
  struct GradBuckets {
    int micro_batch = 0;
    std::array<Bucket, 2> open;  // dense, experts
    std::vector<TaskId>* out = nullptr;
    bool per_block = false;  // each block's gradients in buckets of their own (unit gathers)
  };
  // Set while a backward pass's gradients go out as its blocks produce them.
  GradBuckets* block_buckets_ = nullptr;

  int total_chunks() const { return plan_.pp * plan_.virtual_stages; }
  int global_chunk(int chunk) const { return chunk * plan_.pp + rp_->stage; }
  int first_layer(int global) const {
    int first = 0;
    for (int k = 0; k < global; ++k) first += chunks_[static_cast<std::size_t>(k)];
    return first;
  }

  std::int32_t group(GroupKind kind) {
    // Each task names its group: the rank's groups are looked up once.
    std::int32_t& cached = rank_groups_[static_cast<std::size_t>(kind)];
    if (cached < 0) cached = find_group(kind);
    return cached;
  }

  std::int32_t find_group(GroupKind kind) {
    std::vector<std::int64_t> ranks;
    switch (kind) {
      case GroupKind::Tp:
        ranks = placement_.group(ParallelDim::Tp, rp_->rank);
        break;
      case GroupKind::Cp:
        ranks = placement_.group(ParallelDim::Cp, rp_->rank);
        break;
      case GroupKind::Ep:
        ranks = placement_.group(ParallelDim::Ep, rp_->rank);
        break;
      case GroupKind::Dp:  // gradients reduce over dp x cp (Megatron-LM)
        ranks = placement_.gradient_group(rp_->rank);
        break;
      case GroupKind::ExpertDp:  // the ranks holding the same experts
        ranks = placement_.expert_gradient_group(rp_->rank);
        break;
      case GroupKind::Pp:
        ranks = placement_.group(ParallelDim::Pp, rp_->rank);
        break;
    }
    return group_of(kind, ranks);
  }

  // The group of `ranks`, created on first use. Its simulated programs: with AllRanks every
  // member; with Representatives the stage representatives of its members (one per stage).
  std::int32_t group_of(GroupKind kind, const std::vector<std::int64_t>& ranks) {
    const auto key = std::make_pair(kind, ranks);
    auto [it, inserted] =
        group_ids_.try_emplace(key, static_cast<std::int32_t>(program_.groups.size()));
    if (inserted) {
      Group grp;
      grp.kind = kind;
      grp.ranks = ranks;
      if (options_.mode == Lowering::AllRanks) {
        for (std::int64_t r : ranks) grp.programs.push_back(static_cast<std::int32_t>(r));
      } else {
        std::set<std::int32_t> stages;
        for (std::int64_t r : ranks) stages.insert(placement_.coords(r).pp);
        grp.programs.assign(stages.begin(), stages.end());
      }
      program_.groups.push_back(std::move(grp));
    }
    return it->second;
  }

  // The program index running global chunk `k` (its stage) for this rank's other coordinates.
  std::int32_t peer_of_chunk(int k) const {
    const int stage = k % plan_.pp;
    if (options_.mode == Lowering::Representatives) return stage;
    auto c = placement_.coords(rp_->rank);
    c.pp = stage;
    return static_cast<std::int32_t>(placement_.rank(c));
  }

  // A task label, formatted into the Program's label text (a program has millions of tasks).
  template <typename Format, typename... Args>
  std::string_view label(const Format& format, Args&&... args) {
    label_buffer_.clear();
    fmt::format_to(std::back_inserter(label_buffer_), format, std::forward<Args>(args)...);
    return program_.label_text->keep({label_buffer_.data(), label_buffer_.size()});
  }

  TaskId add(Task t) {
    const auto id = static_cast<TaskId>(rp_->tasks.size());
    if (!plan_.overlap_p2p_comm) {
      // Megatron-LM exchanges a stage's tensors in blocking batch_isend_irecv calls between two
      // rounds of passes (lower_rank emits them there), not ahead of need: the sends of the
      // round that ended and the receives of the next are posted when its compute has ended
      // (1F1B: the receives after the sends between passes of one kind, see lower_rank), and
      // the next round starts when they are done. For zero-bubble and PipeDream, which
      // Megatron-LM does not have, the receives block in the same way but the sends do not
      // hold the sender (holds_sends_).
      // Each dependency once: a send's tensor is often the last compute task's, and an
      // exchange's receives are often a pass's inputs already. (The few added here are looked
      // up among the task's own, which an optimizer step has thousands of.)
      auto depend_on = [&t](TaskId d) {
        if (std::find(t.deps.begin(), t.deps.end(), d) == t.deps.end()) t.deps.push_back(d);
      };
      if ((t.kind == TaskKind::Recv || t.kind == TaskKind::Send) && last_compute_task_ >= 0) {
        depend_on(last_compute_task_);
      }
      if (t.kind == TaskKind::Recv || (t.kind == TaskKind::Send && holds_sends_)) {
        exchange_.push_back(id);
      }
      if (t.kind == TaskKind::Compute) {
        for (TaskId x : exchange_) depend_on(x);
        exchange_.clear();
        last_compute_task_ = id;
      }
    }
    rp_->tasks.push_back(std::move(t));
    return id;
  }

  // The op sequence of a global chunk with its parallel-region markers, in forward order.
  std::vector<Item> chunk_items(int k) const {
    std::vector<Item> items;
    const int first = first_layer(k);
    const int last = first + chunks_[static_cast<std::size_t>(k)];
    auto op = [&](OpId id, int layer) { items.push_back({id, Marker::TpEnter, layer, id}); };
    // Markers before an op take it as anchor; markers after one take the op they follow.
    auto marker = [&](Marker m, int layer, OpId anchor) {
      items.push_back({std::nullopt, m, layer, anchor});
    };
    if (k == 0) {
      for (OpId id : g_.layer_ops(-1)) op(id, -1);
      // Vocab-parallel embedding: all-reduce (SP: reduce-scatter) of its output.
      marker(Marker::TpExit, -1, g_.layer_ops(-1).back());
    }
    for (int l = first; l < last; ++l) {
      for (OpId id : g_.layer_ops(l)) {
        const model::Op& o = g_.op(id);
        // Before the experts in forward order: after their backward, before the router's.
        if (o.kind == OpKind::MlpUp && o.expert && plan_.tp > 1 && !local_dispatch_) {
          marker(Marker::TpGates, l, id);
        }
        // A router that routes the rank's share of the sequence has no gathered input.
        if (o.kind == OpKind::QkvProj || plan::mlp_tp_enter(g_.spec(), plan_, o)) {
          marker(Marker::TpEnter, l, id);
        }
        if (o.kind == OpKind::AttentionCore && plan_.cp > 1) marker(Marker::CpGatherKv, l, id);
        if (o.kind == OpKind::MlpUp && o.expert && plan_.ep > 1) marker(Marker::EpDispatch, l, id);
        if (o.kind == OpKind::MlpUp && o.expert && local_dispatch_) {
          marker(Marker::TpGatherCopies, l, id);
        }
        op(id, l);
        // After the core in forward order: before its backward (and selective recompute).
        if (o.kind == OpKind::AttentionCore && plan_.cp > 1) marker(Marker::CpRegatherKv, l, id);
        if (o.kind == OpKind::MlpDown && o.expert && local_dispatch_) {
          marker(Marker::TpScatterCopies, l, id);
        }
        if (o.kind == OpKind::MlpDown && o.expert && plan_.ep > 1) marker(Marker::EpCombine, l, id);
        if (o.kind == OpKind::AttnOutProj || plan::mlp_tp_exit(g_.spec(), plan_, o)) {
          marker(Marker::TpExit, l, id);
        }
      }
    }
    if (k == total_chunks() - 1) {
      const int head = static_cast<int>(g_.spec().layers);
      for (OpId id : g_.layer_ops(head)) {
        if (g_.op(id).kind == OpKind::LmHead) marker(Marker::TpEnter, head, id);
        op(id, head);
        // Vocab-parallel cross-entropy reduces per-token statistics over tp before the loss.
        if (g_.op(id).kind == OpKind::LossStatistics) marker(Marker::TpLoss, head, id);
      }
    }
    return items;
  }

  // The collective a marker item stands for in forward (backward = false) or backward.
  std::optional<Comm> comm_for(const Item& it, bool backward) const {
    const bool sp = plan_.sequence_parallel;
    const model::ModelSpec& spec = g_.spec();
    const Marker m = it.marker;
    switch (m) {
      case Marker::TpEnter:
      case Marker::TpExit: {
        if (plan_.tp == 1) return std::nullopt;
        // f (enter) is identity forward / all-reduce backward; g (exit) the converse; with
        // sequence parallelism all-gather and reduce-scatter take their places. What enters
        // is the anchor's input (multi-head latent attention's latents), what leaves a hidden
        // tensor.
        const bool enter = m == Marker::TpEnter;
        const std::uint64_t bytes =
            enter ? plan::tp_enter_bytes(spec, g_.op(it.anchor), hidden_bytes_) : hidden_bytes_;
        if (enter != backward) {  // forward enter, or backward exit
          if (!sp) return std::nullopt;
          return Comm{CollectiveKind::AllGather, GroupKind::Tp, Stream::Tp, bytes, "tp all-gather"};
        }
        return sp ? Comm{CollectiveKind::ReduceScatter, GroupKind::Tp, Stream::Tp, bytes,
                         "tp reduce-scatter"}
                  : Comm{CollectiveKind::AllReduce, GroupKind::Tp, Stream::Tp, bytes,
                         "tp all-reduce"};
      }
      case Marker::TpLoss: {
        if (plan_.tp == 1 || backward) return std::nullopt;
        // Megatron-LM's vocab_parallel_cross_entropy all-reduces three fp32 values per token
        // over tp (the logit maximum, the target logit, the sum of exponentials), priced as one
        // all-reduce (Megatron-LM makes three calls, dtexec two: the maxima, then the sums
        // rescaled to them with the target logits); the gradient needs no communication.
        return Comm{CollectiveKind::AllReduce, GroupKind::Tp, Stream::Tp, tokens_ * 3 * 4,
                    "tp all-reduce loss statistics"};
      }
      case Marker::TpGates: {
        // Each tp rank holds a slice of every expert, so the gates' gradient (a copy's output
        // gradient · its output, per copy) is a partial sum: all-reduced over tp, in fp32,
        // before the router's backward (the router and its routing are the same on every rank).
        if (plan_.tp == 1 || !backward) return std::nullopt;
        return Comm{CollectiveKind::AllReduce, GroupKind::Tp, Stream::Tp,
                    tokens_ * static_cast<std::uint64_t>(spec.moe ? spec.moe->top_k : 1) * 4,
                    "tp all-reduce gate gradients"};
      }
      case Marker::CpGatherKv:
      case Marker::CpRegatherKv: {
        // K and V of every cp rank (this rank's kv heads).
        const std::uint64_t kv = plan::cp_kv_bytes(spec, plan_, hidden_bytes_);
        if (m == Marker::CpRegatherKv) {
          // A rank keeps only its own K and V (memory model): the backward gathers them again,
          // as ring attention passes them around again, unless full recompute just did.
          if (!backward || plan_.recompute == plan::Recompute::Full) return std::nullopt;
          return Comm{CollectiveKind::AllGather, GroupKind::Cp, Stream::Cp, kv,
                      "cp all-gather KV again"};
        }
        return Comm{backward ? CollectiveKind::ReduceScatter : CollectiveKind::AllGather,
                    GroupKind::Cp, Stream::Cp, kv,
                    backward ? "cp reduce-scatter dKV" : "cp all-gather KV"};
      }
      case Marker::EpDispatch:
      case Marker::EpCombine: {
        // The busiest rank's (the others wait for it).
        return Comm{CollectiveKind::AllToAll, GroupKind::Ep, Stream::Ep,
                    plan::ep_all_to_all_bytes(spec, plan_, hidden_bytes_),
                    m == Marker::EpDispatch ? "ep all-to-all dispatch" : "ep all-to-all combine"};
      }
      case Marker::TpGatherCopies:
      case Marker::TpScatterCopies: {
        // The gathered copies (the busiest ep rank's), as the all-gather's output and the
        // reduce-scatter's input.
        const std::uint64_t bytes = plan::expert_copies_bytes(spec, plan_, hidden_bytes_);
        const bool gather = (m == Marker::TpGatherCopies) != backward;
        return Comm{gather ? CollectiveKind::AllGather : CollectiveKind::ReduceScatter,
                    GroupKind::Tp, Stream::Tp, bytes,
                    m == Marker::TpGatherCopies
                        ? (backward ? "tp reduce-scatter expert input gradients"
                                    : "tp all-gather expert inputs")
                        : (backward ? "tp all-gather expert output gradients"
                                    : "tp reduce-scatter expert outputs")};
      }
    }
    return std::nullopt;
  }

  // Emits a chain of tasks for `items` in `phase`; returns the last task (or `after`).
  // `first_dep` is a task the first emitted task depends on (-1: none).
  TaskId emit_chain(const std::vector<Item>& all_items, Phase phase, bool backward, int micro_batch,
                    int chunk, TaskId first_dep, std::vector<std::pair<OpId, TaskId>>* op_tasks,
                    TaskId extra_dep = -1) {
    // Markers that stand for no collective (tp = 1, or the identity half of f/g) do not split
    // the compute.
    std::vector<Item> items;
    for (const Item& it : all_items) {
      if (it.op || comm_for(it, backward)) items.push_back(it);
    }
    TaskId prev = first_dep;
    bool first = true;
    // A weight-gradient task running beside the collective before it: the next task waits
    // for both.
    TaskId beside = -1;
    // A sequence-parallel input gathered again for the next compute task (emit_regather).
    TaskId gathered = -1;
    auto compute = [&](OpId lo, OpId hi, Phase ph, int layer) {
      // The first task of a unit waits for its weights; the next unit's gather comes before it
      // in the rank's order (start_unit).
      const bool starts_unit = unit_gathers_ && next_unit_ < units_.size() &&
                               units_[next_unit_].pass == pass_ &&
                               units_[next_unit_].layer == layer;
      const TaskId weights_gathered = starts_unit ? start_unit() : -1;
      Task t;
      t.kind = TaskKind::Compute;
      t.stream = Stream::Compute;
      t.phase = ph;
      t.micro_batch = micro_batch;
      t.chunk = chunk;
      t.op_begin = static_cast<std::int32_t>(lo);
      t.op_end = static_cast<std::int32_t>(hi + 1);
      t.label = label(FMT_COMPILE("{} {}..{} mb{}"), to_string(ph), g_.op(lo).name, g_.op(hi).name,
                      micro_batch);
      if (prev >= 0) t.deps.push_back(prev);
      if (beside >= 0) t.deps.push_back(beside);
      if (gathered >= 0) t.deps.push_back(gathered);
      if (first && extra_dep >= 0) t.deps.push_back(extra_dep);
      if (weights_gathered >= 0) t.deps.push_back(weights_gathered);
      first = false;
      beside = -1;
      gathered = -1;
      const TaskId id = add(std::move(t));
      if (starts_unit) unit_started_ = id;
      return id;
    };
    std::size_t i = 0;
    while (i < items.size()) {
      if (items[i].op) {
        // Coalesce consecutive ops (contiguous ids in forward; reversed in backward).
        // With a gather per unit, a task holds one unit's ops.
        std::size_t j = i;
        while (j + 1 < items.size() && items[j + 1].op &&
               (!unit_gathers_ || items[j + 1].layer == items[i].layer)) {
          ++j;
        }
        OpId lo = *items[i].op, hi = *items[i].op;
        for (std::size_t q = i; q <= j; ++q) {
          lo = std::min(lo, *items[q].op);
          hi = std::max(hi, *items[q].op);
        }
        // The run ends at a column-parallel layer whose input gradient the next collective
        // reduces: with overlap, the layer's weight gradient is computed during it.
        const OpId last = *items[j].op;
        const bool overlapped = phase == Phase::Backward && j + 1 < items.size() &&
                                overlaps_tp_backward(items[j + 1], last);
        const bool regather =
            phase == Phase::Backward && j + 1 < items.size() && regathers_input(items[j + 1], last);
        if (!overlapped && !regather) {
          prev = compute(lo, hi, phase, items[i].layer);
          if (op_tasks) {
            for (std::size_t q = i; q <= j; ++q) op_tasks->emplace_back(*items[q].op, prev);
          }
          i = j + 1;
          continue;
        }
        // Backward runs in reverse: the layer, first in forward order, comes last in the run.
        DTSIM_ASSERT(last == lo, "a backward run ends at its first op");
        if (lo != hi) {
          prev = compute(last + 1, hi, phase, items[i].layer);
          if (op_tasks) {
            for (std::size_t q = i; q < j; ++q) op_tasks->emplace_back(*items[q].op, prev);
          }
        }
        // With sequence parallelism the layer kept its input sharded: its backward starts by
        // gathering it again for the weight gradient, beside the input gradient when that runs
        // apart; else the layer's backward waits for it.
        const TaskId input = regather ? emit_regather(items[j + 1], micro_batch, chunk, prev) : -1;
        if (!overlapped) {
          gathered = input;
          prev = compute(last, last, phase, items[j].layer);
          if (op_tasks) op_tasks->emplace_back(last, prev);
          i = j + 1;
          continue;
        }
        // The weight gradient follows the input gradient on the compute stream, beside the
        // collective that reduces the input gradient.
        prev = compute(last, last, Phase::BackwardInput, items[j].layer);
        const TaskId collective = emit_collective(items[j + 1], backward, micro_batch, chunk, prev);
        gathered = input;
        const TaskId weight = compute(last, last, Phase::BackwardWeight, items[j].layer);
        if (op_tasks) op_tasks->emplace_back(last, weight);
        prev = collective;
        beside = weight;
        i = j + 2;
        continue;
      }
      if (comm_for(items[i], backward)) {
        prev = emit_collective(items[i], backward, micro_batch, chunk, prev, first ? extra_dep : -1,
                               beside);
        first = false;
        beside = -1;
      }
      ++i;
    }
    return prev;
  }

  // Plan.overlap_tp_backward: the marker after a backward run is the input-gradient collective
  // of the column-parallel layer `last` (vocab-parallel for the LM head) that ends the run.
  bool overlaps_tp_backward(const Item& marker, OpId last) const {
    if (!plan_.overlap_tp_backward || marker.op || marker.marker != Marker::TpEnter ||
        marker.anchor != last || !comm_for(marker, /*backward=*/true)) {
      return false;
    }
    const model::Op& op = g_.op(last);
    return op.bwd_weight_flops > 0 &&
           (op.tp_split == model::TpSplit::Column || op.tp_split == model::TpSplit::Vocab);
  }

  // Sequence parallelism: a column-parallel layer (the LM head too) saves its input as the
  // rank's share of the sequence, and its backward gathers it again for the weight gradient
  // (Megatron-LM, megatron/core/tensor_parallel/layers.py: the backward of
  // LinearWithGradAccumulationAndAsyncCommunication all-gathers the input, asynchronously,
  // while the input gradient computes). `marker` is the TpEnter marker that follows the
  // backward run ending at `last`.
  bool regathers_input(const Item& marker, OpId last) const {
    if (!plan_.sequence_parallel || plan_.tp == 1 || marker.op ||
        marker.marker != Marker::TpEnter || marker.anchor != last) {
      return false;
    }
    // (A mixture of experts' router reads its rank's share of the sequence under sequence
    // parallelism, plan::moe_local_dispatch: no TpEnter before it.)
    const model::Op& op = g_.op(last);
    return op.bwd_weight_flops > 0 &&
           (op.tp_split == model::TpSplit::Column || op.tp_split == model::TpSplit::Vocab);
  }

  // A layer as task labels name it: "embedding" (layer -1), "L3", "head" (past the blocks).
  std::string layer_name(int layer) const {
    if (layer < 0) return "embedding";
    if (layer == static_cast<int>(g_.spec().layers)) return "head";
    return fmt::format("L{}", layer);
  }

  // The all-gather of regathers_input, after `dep`, on the tp stream: a Backward-phase
  // collective (the forward's all-gather of the same input has no phase).
  TaskId emit_regather(const Item& marker, int micro_batch, int chunk, TaskId dep) {
    Task t;
    t.kind = TaskKind::Collective;
    t.stream = Stream::Tp;
    t.phase = Phase::Backward;
    t.micro_batch = micro_batch;
    t.chunk = chunk;
    t.collective = CollectiveKind::AllGather;
    t.group = group(GroupKind::Tp);
    t.bytes = plan::tp_regather_bytes(g_.spec(), g_.op(marker.anchor), hidden_bytes_);
    t.op_begin = static_cast<std::int32_t>(marker.anchor);
    t.op_end = t.op_begin + 1;
    t.label = label(FMT_COMPILE("tp all-gather input again {} mb{}"), layer_name(marker.layer),
                    micro_batch);
    if (dep >= 0) t.deps.push_back(dep);
    return add(std::move(t));
  }

  // The collective of `marker`, after `dep` (and `extra`, `beside` where >= 0).
  TaskId emit_collective(const Item& marker, bool backward, int micro_batch, int chunk, TaskId dep,
                         TaskId extra = -1, TaskId beside = -1) {
    const auto c = comm_for(marker, backward);
    DTSIM_ASSERT(c.has_value(), "a marker without a collective");
    Task t;
    t.kind = TaskKind::Collective;
    t.stream = c->stream;
    t.phase = Phase::None;
    t.micro_batch = micro_batch;
    t.chunk = chunk;
    t.collective = c->kind;
    t.group = group(c->group);
    t.bytes = c->bytes;
    t.op_begin = static_cast<std::int32_t>(marker.anchor);
    t.op_end = t.op_begin + 1;
    // An expert all-to-all moves tokens one way in the forward pass and back in the backward.
    if (c->group == GroupKind::Ep) t.tag = backward ? 1 : 0;
    t.label = label(FMT_COMPILE("{} {} mb{}"), c->what, layer_name(marker.layer), micro_batch);
    if (dep >= 0) t.deps.push_back(dep);
    if (beside >= 0) t.deps.push_back(beside);
    if (extra >= 0) t.deps.push_back(extra);
    return add(std::move(t));
  }

  // Backward of a chunk: its items reversed, one chain per block, so that data-parallel
  // gradient buckets can follow the blocks whose gradients they carry. Full recompute re-runs
  // each block's forward (with its collectives) right before that block's backward; selective
  // recompute re-runs each attention core right before its backward.
  TaskId emit_backward(const std::vector<Item>& items, Phase phase, int mb, int chunk,
                       TaskId first_dep, std::vector<std::pair<OpId, TaskId>>* op_tasks,
                       TaskId extra_dep) {
    TaskId prev = first_dep;
    const std::size_t start = rp_->tasks.size();
    std::size_t sent = op_tasks != nullptr ? op_tasks->size() : 0;  // gradients in buckets
    // One chain per block only where it matters: when this pass produces the gradients that
    // data parallelism reduces (buckets follow blocks), or for full recompute. Otherwise the
    // chunk's backward is one chain, which keeps programs with many micro-batches small.
    const bool per_block = op_tasks != nullptr || plan_.recompute == plan::Recompute::Full;
    std::vector<std::vector<Item>> by_layer;
    for (const Item& it : items) {
      if (by_layer.empty() || (per_block && by_layer.back().front().layer != it.layer)) {
        by_layer.emplace_back();
      }
      by_layer.back().push_back(it);
    }
    auto is_block = [&](int l) { return l >= 0 && l < g_.spec().layers; };
    for (auto layer = by_layer.rbegin(); layer != by_layer.rend(); ++layer) {
      if (is_block(layer->front().layer) && plan_.recompute == plan::Recompute::Full) {
        prev = emit_chain(*layer, Phase::Recompute, false, mb, chunk, prev, nullptr);
      }
      std::vector<Item> pending;
      for (auto it = layer->rbegin(); it != layer->rend(); ++it) {
        if (is_block(it->layer) && plan_.recompute == plan::Recompute::Selective && it->op &&
            g_.op(*it->op).kind == OpKind::AttentionCore) {
          prev = emit_chain(pending, phase, true, mb, chunk, prev, op_tasks);
          pending.clear();
          prev = emit_chain({*it}, Phase::Recompute, false, mb, chunk, prev, nullptr);
        }
        pending.push_back(*it);
      }
      prev = emit_chain(pending, phase, true, mb, chunk, prev, op_tasks);
      if (block_buckets_ != nullptr && op_tasks != nullptr) {
        // This block's gradients fill the buckets, a full one goes out now (as a framework's
        // hooks send a bucket once its last gradient is written), before the blocks below
        // (with unit gathers, between the gathers of the blocks ahead).
        const std::vector<std::pair<OpId, TaskId>> block(
            op_tasks->begin() + static_cast<std::ptrdiff_t>(sent), op_tasks->end());
        fill_buckets(*block_buckets_, block);
        if (block_buckets_->per_block) flush_buckets(*block_buckets_);
        sent = op_tasks->size();
      }
    }
    if (extra_dep >= 0 && rp_->tasks.size() > start) rp_->tasks[start].deps.push_back(extra_dep);
    return prev;
  }

  // Unit e's compute starts (its first task is added next): the gather of unit e + 1 goes out
  // once unit e - 1's first task is done (one unit ahead). It comes before unit e's first task
  // in the rank's order, which changes no dependency and neither stream's order (no collective
  // of the dp stream lies between), so that an executor that issues a rank's tasks in order
  // (dtexec on a GPU, whose collectives start after the compute queued before them) starts
  // it while unit e computes, as FSDP issues its prefetch before the unit's kernels. Returns
  // unit e's gather (-1: none).
  TaskId start_unit() {
    const TaskId own = unit_gather_[next_unit_];
    ++next_unit_;
    if (next_unit_ < units_.size()) {
      unit_gather_[next_unit_] = gather_unit(next_unit_, unit_started_);
    }
    return own;
  }

  // ZeRO-3: unit e computes with the weights of the unit before it, which are its own (the same
  // layer of the same chunk, a pass later: the head's forward then backward, a stage's top
  // block at 1F1B's turn from a forward to a backward pass and its bottom one back, the
  // embedding from one micro-batch's backward to the next's forward). They stay gathered for
  // it, as FSDP keeps the root unit's weights from its forward for the backward that follows
  // (its _post_forward_reshard) and DeepSpeed's ZeRO-3 keeps weights that are used again
  // within its max_reuse_distance; gathering them again would send the same values.
  bool kept(std::size_t e) const {
    return !param_gathers_ && e > 0 && units_[e].layer == units_[e - 1].layer &&
           units_[e].chunk == units_[e - 1].chunk;
  }

  // The all-gathers of unit e's weights (ZeRO-3's, or ZeRO-1/2's updated ones), after `after`
  // (see gather_weights); none for a unit that keeps the weights of the one before (kept).
  TaskId gather_unit(std::size_t e, TaskId after) {
    const Unit& u = units_[e];
    if (kept(e)) return -1;
    // The unit's layer by bisection: a chunk's items run in layer order (checked where they are
    // made); a scan of the chunk per unit was quadratic in its layers (a copy of llama3-8b of
    // 8,192 layers at ZeRO-3: 7.8 s, 83% of it here).
    const std::vector<Item>& items = (*rank_items_)[static_cast<std::size_t>(u.chunk)];
    const auto [first, last] = std::equal_range(items.begin(), items.end(), u.layer, ByLayer{});
    std::vector<Item> ops;
    for (auto it = first; it != last; ++it) {
      if (it->op) ops.push_back(*it);
    }
    return gather_weights(ops, u.micro_batch, u.chunk, layer_name(u.layer), after);
  }

  // Parameters of a chunk on this rank (tensor-parallel share), dense or expert.
  double chunk_params(const std::vector<Item>& items, bool experts) const {
    double p = 0;
    for (const Item& it : items) {
      if (it.op && g_.op(*it.op).expert == experts) p += plan::rank_params(g_.op(*it.op), plan_);
    }
    return p;
  }

  // The op range [first, last + 1) of a chunk's items.
  static std::pair<OpId, OpId> op_range(const std::vector<Item>& items, OpId none) {
    OpId lo = none, hi = 0;
    for (const Item& it : items) {
      if (it.op) {
        lo = std::min(lo, *it.op);
        hi = std::max(hi, *it.op);
      }
    }
    return {lo, hi + 1};
  }

  // Ranks that reduce a gradient (dense: dp x cp; experts: their own data-parallel group).
  int dp_group_size(bool experts) const {
    return (experts ? plan_.dp / plan_.ep : plan_.dp) * plan_.cp;
  }

  // An all-gather of `params` weights over the dp (or expert-dp) group, in the weights'
  // precision, on the dp stream.
  Task weight_gather(bool experts, double params) {
    Task ag;
    ag.kind = TaskKind::Collective;
    ag.stream = Stream::Dp;
    ag.collective = CollectiveKind::AllGather;
    ag.group = group(experts ? GroupKind::ExpertDp : GroupKind::Dp);
    ag.bytes = static_cast<std::uint64_t>(params * weight_bytes_);
    return ag;
  }

  // Data-parallel gradient reduction of the ops in `produced` (in the order backward produced
  // them), in buckets; returns the collectives' task ids. Dense gradients go over the dp group,
  // expert gradients over the expert-dp group, each in its own buckets, issued in the order the
  // buckets fill (so that an expert bucket does not wait for every dense one).
  std::vector<TaskId> grad_buckets(const std::vector<std::pair<OpId, TaskId>>& produced,
                                   int micro_batch) {
    std::vector<TaskId> out;
    GradBuckets buckets{.micro_batch = micro_batch, .open = {}, .out = &out, .per_block = false};
    fill_buckets(buckets, produced);
    flush_buckets(buckets);
    return out;
  }

  // Adds the gradients of `produced` to the open buckets, sending each that reaches the size.
  void fill_buckets(GradBuckets& buckets, const std::vector<std::pair<OpId, TaskId>>& produced) {
    for (const auto& [op, task] : produced) {
      const model::Op& o = g_.op(op);
      const double params = plan::rank_params(o, plan_);
      if (params <= 0 || dp_group_size(o.expert) <= 1) continue;
      Bucket& b = buckets.open[o.expert ? 1 : 0];
      if (b.bytes <= 0) {
        b.lo = static_cast<OpId>(g_.size());
        b.hi = 0;
      }
      b.bytes += params * grad_bytes_;
      b.lo = std::min(b.lo, op);
      b.hi = std::max(b.hi, op);
      b.last = task;
      if (b.bytes >= static_cast<double>(options_.dp_bucket_bytes)) send_bucket(buckets, o.expert);
    }
  }

  // Sends what the open buckets hold.
  void flush_buckets(GradBuckets& buckets) {
    send_bucket(buckets, false);
    send_bucket(buckets, true);
  }

  void send_bucket(GradBuckets& buckets, bool experts) {
    Bucket& b = buckets.open[experts ? 1 : 0];
    if (b.bytes <= 0) return;
    const CollectiveKind kind =
        plan_.zero_stage == 0 ? CollectiveKind::AllReduce : CollectiveKind::ReduceScatter;
    Task t;
    t.kind = TaskKind::Collective;
    t.stream = Stream::Dp;
    t.collective = kind;
    t.group = group(experts ? GroupKind::ExpertDp : GroupKind::Dp);
    // Sent: in the communication precision, compressed (the codec's passes over the
    // uncompressed bytes are the collective's, see Task::uncompressed_bytes). Whole bytes,
    // rounded up: a bucket compressed below one byte still sends one.
    const double sent = b.bytes * grad_comm_scale_;
    t.bytes = static_cast<std::uint64_t>(std::ceil(sent * plan_.grad_compression));
    if (plan_.grad_compression < 1) t.uncompressed_bytes = static_cast<std::uint64_t>(sent);
    t.micro_batch = buckets.micro_batch;
    t.op_begin = static_cast<std::int32_t>(b.lo);
    t.op_end = static_cast<std::int32_t>(b.hi + 1);
    t.deps.push_back(b.last);
    t.label = label(FMT_COMPILE("{} {} bucket {}"), experts ? "expert-dp" : "dp", to_string(kind),
                    b.index++);
    buckets.out->push_back(add(std::move(t)));
    b.bytes = 0;
  }

  // The ZeRO-3 all-gathers of the weights of `items` (a unit's or a chunk's ops; the gathered
  // size, as nccl-tests count): dense weights over the dp group, expert weights over the
  // expert-dp group, issued after `after`. Returns the last one (the dp stream runs them in
  // order), or -1 when there is nothing to gather.
  TaskId gather_weights(const std::vector<Item>& items, int micro_batch, int chunk,
                        const std::string& what, TaskId after) {
    TaskId last = -1;
    for (const bool experts : {false, true}) {
      const double params = chunk_params(items, experts);
      if (params <= 0 || dp_group_size(experts) <= 1) continue;
      Task ag = weight_gather(experts, params);
      ag.micro_batch = micro_batch;
      ag.chunk = chunk;
      const auto [lo, hi] = op_range(items, g_.size());
      ag.op_begin = static_cast<std::int32_t>(lo);
      ag.op_end = static_cast<std::int32_t>(hi);
      if (after >= 0) ag.deps.push_back(after);
      ag.label = param_gathers_
                     ? label(FMT_COMPILE("zero all-gather updated {}weights {} (for mb{})"),
                             experts ? "expert " : "", what, micro_batch)
                     : label(FMT_COMPILE("zero-3 all-gather {}weights {} mb{}"),
                             experts ? "expert " : "", what, micro_batch);
      last = add(std::move(ag));
    }
    return last;
  }

  void lower_rank(int index) {
    prog_ = index;
    rp_ = &program_.ranks[static_cast<std::size_t>(index)];
    rank_groups_.fill(-1);
    rp_->tasks.reserve(most_tasks_ + most_tasks_ / 16);
    last_compute_task_ = -1;
    exchange_.clear();
    const int v = plan_.virtual_stages;
    const int last_global = total_chunks() - 1;
    std::vector<std::vector<Item>> items(static_cast<std::size_t>(v));
    for (int c = 0; c < v; ++c) {
      items[static_cast<std::size_t>(c)] = chunk_items(global_chunk(c));
      DTSIM_ASSERT(std::is_sorted(items[static_cast<std::size_t>(c)].begin(),
                                  items[static_cast<std::size_t>(c)].end(), ByLayer{}),
                   "a chunk's items run in layer order");
    }

    const std::vector<Pass> passes = stage_passes(plan_, rp_->stage);
    // The last backward (or weight-gradient) pass of each chunk produces the final gradients.
    std::vector<int> final_pass(static_cast<std::size_t>(v), -1);
    for (std::size_t i = 0; i < passes.size(); ++i) {
      if (passes[i].kind == PassKind::Backward || passes[i].kind == PassKind::BackwardWeight) {
        final_pass[static_cast<std::size_t>(passes[i].chunk)] = static_cast<int>(i);
      }
    }
    const int grad_group = plan_.dp * plan_.cp;
    const bool zero3 = plan_.zero_stage == 3 && grad_group > 1;
    const bool per_micro_batch_grads = plan_.zero_stage >= 2;
    std::map<std::pair<int, int>, TaskId> input_grad_done;  // (mb, chunk) -> last B task
    std::vector<TaskId> dp_tasks;
    std::vector<TaskId> embedding_grads_done;  // final backward of the embedding / tied head
    std::vector<TaskId> final_grads_done;      // final backward of each chunk
    // Without overlap, the gradients of each pass that reduces them, held until the backward
    // passes end: (micro-batch, ops in the order backward produced them).
    std::vector<std::pair<int, std::vector<OpId>>> held_grads;
    TaskId last_compute = -1;
    // ZeRO-3: per unit and pass, one unit ahead (see Unit); with zero-bubble, a chunk's weights
    // are gathered while the pass before runs (after its first task, ahead of its gradient
    // buckets on the data-parallel stream) where that pass computes another chunk, which a
    // stage of one chunk never does: its weights are gathered before its first pass.
    TaskId weights = -1;
    rank_items_ = &items;
    const bool zero3_units = zero3 && plan_.schedule != plan::Schedule::ZeroBubble;
    // ZeRO-1/2 with overlap_param_gather: the step starts with the all-gathers of the previous
    // step's updated weights, a block ahead of the first forward pass of each chunk (a steady
    // state: the optimizer step at the end gathers nothing).
    param_gathers_ = (plan_.zero_stage == 1 || plan_.zero_stage == 2) &&
                     plan_.overlap_param_gather && grad_group > 1;
    unit_gathers_ = zero3_units || param_gathers_;
    units_.clear();
    next_unit_ = 0;
    unit_started_ = -1;
    if (unit_gathers_) {
      // ZeRO-3: the blocks of every pass (a backward's in reverse); ZeRO-1/2's overlapped
      // gathers: the blocks of each chunk's first forward pass.
      std::vector<bool> seen(static_cast<std::size_t>(v), false);
      for (std::size_t i = 0; i < passes.size(); ++i) {
        const auto c = static_cast<std::size_t>(passes[i].chunk);
        if (param_gathers_) {
          if (passes[i].kind != PassKind::Forward || seen[c]) continue;
          seen[c] = true;
        }
        DTSIM_ASSERT(passes[i].kind == PassKind::Forward || passes[i].kind == PassKind::Backward,
                     "unit gathers need whole backward passes");
        std::vector<int> layers;
        for (const Item& it : items[c]) {
          if (it.op && (layers.empty() || layers.back() != it.layer)) layers.push_back(it.layer);
        }
        if (passes[i].kind == PassKind::Backward) std::reverse(layers.begin(), layers.end());
        for (int layer : layers) {
          units_.push_back({i, passes[i].chunk, layer, passes[i].micro_batch});
        }
      }
      unit_gather_.assign(units_.size(), -1);
      if (!units_.empty()) unit_gather_[0] = gather_unit(0, -1);
    } else if (zero3 && !passes.empty()) {
      weights =
          gather_weights(items[static_cast<std::size_t>(passes[0].chunk)], passes[0].micro_batch,
                         passes[0].chunk, fmt::format("chunk {}", passes[0].chunk), -1);
    }

    // Without p2p overlap, transfers are exchanged between rounds (see add): the sends of a
    // round wait for its end, and the receives of a round are posted at its start.
    const bool between_rounds = !plan_.overlap_p2p_comm;
    std::vector<PendingSend> round_sends;
    // Per pass: its receive, posted with its round (-1: none).
    std::vector<TaskId> received(passes.size(), -1);
    const auto flush_sends = [&] {
      std::vector<TaskId> sent;
      for (const PendingSend& s : round_sends) sent.push_back(send(s));
      round_sends.clear();
      return sent;
    };
    // 1F1B receives after it sends between two passes of one kind (schedule.hpp).
    const bool in_turn_when_alike = receives_after_sends_when_alike(plan_);
    // With unit gathers, a backward pass's gradients go out block by block, in order with the
    // gathers of the blocks ahead on the data-parallel stream.
    const bool buckets_per_block = plan::gradient_buckets_per_block(plan_) && grad_group > 1;

    for (std::size_t i = 0; i < passes.size(); ++i) {
      const Pass& pass = passes[i];
      pass_ = i;
      const int c = pass.chunk;
      const int k = global_chunk(c);
      const auto& chunk = items[static_cast<std::size_t>(c)];
      const bool last_micro_batch_grads =
          static_cast<int>(i) == final_pass[static_cast<std::size_t>(c)];
      if (between_rounds && (i == 0 || pass.round != passes[i - 1].round)) {
        const std::vector<TaskId> sent = flush_sends();
        const bool in_turn = in_turn_when_alike && i > 0 && passes[i - 1].kind == pass.kind;
        for (std::size_t j = i; j < passes.size() && passes[j].round == pass.round; ++j) {
          const TaskId r = receive(passes[j], items[static_cast<std::size_t>(passes[j].chunk)],
                                   in_turn ? sent : std::vector<TaskId>{});
          received[j] = r;
        }
      }
      const std::size_t pass_start = rp_->tasks.size();
      const TaskId dep = between_rounds ? received[i] : receive(pass, chunk);
      std::vector<std::pair<OpId, TaskId>> produced;
      const bool wants_grads = last_micro_batch_grads || per_micro_batch_grads;
      // A backward pass's buckets: each sent as soon as its blocks fill it, what is left once
      // the pass's sends are out (where all its buckets went before).
      GradBuckets buckets{.micro_batch = pass.micro_batch,
                          .open = {},
                          .out = &dp_tasks,
                          .per_block = buckets_per_block};
      TaskId pass_end = -1;
      // The tensors crossing stage boundaries: the output of the op before the chunk's first
      // (received activations, sent gradients) and of the chunk's last op (sent activations,
      // received gradients).
      const auto [first_op, end_op] = op_range(chunk, g_.size());
      const OpId before_chunk = first_op - 1, last_op = end_op - 1;
      switch (pass.kind) {
        case PassKind::Forward: {
          pass_end =
              emit_chain(chunk, Phase::Forward, false, pass.micro_batch, c, dep, nullptr, weights);
          if (k < last_global) {
            round_sends.push_back({pass_end, k + 1, pass.micro_batch, false, c, last_op});
          }
          break;
        }
        case PassKind::Backward:
        case PassKind::BackwardInput: {
          const Phase phase =
              pass.kind == PassKind::Backward ? Phase::Backward : Phase::BackwardInput;
          if (pass.kind == PassKind::Backward && wants_grads && plan_.overlap_grad_reduce) {
            block_buckets_ = &buckets;
          }
          pass_end = emit_backward(
              chunk, phase, pass.micro_batch, c, dep,
              pass.kind == PassKind::Backward && wants_grads ? &produced : nullptr, weights);
          block_buckets_ = nullptr;
          input_grad_done[{pass.micro_batch, c}] = pass_end;
          if (k > 0) {
            round_sends.push_back({pass_end, k - 1, pass.micro_batch, true, c, before_chunk});
          }
          break;
        }
        case PassKind::BackwardWeight: {
          // One task for the chunk; where this pass's gradients are reduced beside it, one per
          // layer in the backward's order, so that each bucket goes out once its layers are
          // done (as Megatron-LM's gradient hooks send it during the weight pass) and not all of
          // them after the pass. With sequence parallelism the column-parallel layers' inputs,
          // kept sharded, are gathered again once the input-gradient pass is done
          // (emit_regather), each before its layer's task.
          const bool per_layer =
              wants_grads && plan_.overlap_grad_reduce && dp_group_size(/*experts=*/false) > 1;
          const TaskId input_grads = input_grad_done.at({pass.micro_batch, c});
          struct Run {
            int layer;
            OpId lo, hi;
            std::vector<TaskId> inputs;
            std::vector<OpId> ops;  // in the backward's order
          };
          std::vector<Run> runs;
          std::vector<TaskId> inputs;  // gathered for the run begun next
          for (auto it = chunk.rbegin(); it != chunk.rend(); ++it) {
            if (it->op) {
              if (runs.empty() || (per_layer && it->layer != runs.back().layer)) {
                runs.push_back({it->layer, *it->op, *it->op, std::exchange(inputs, {}), {}});
              }
              runs.back().lo = std::min(runs.back().lo, *it->op);
              runs.back().hi = std::max(runs.back().hi, *it->op);
              runs.back().ops.push_back(*it->op);
            } else if (regathers_input(*it, it->anchor)) {
              const TaskId input = emit_regather(*it, pass.micro_batch, c, input_grads);
              (runs.empty() ? inputs : runs.back().inputs).push_back(input);
            }
          }
          DTSIM_ASSERT(!runs.empty() && inputs.empty(), "a weight pass over a chunk's ops");
          for (const Run& run : runs) {
            Task w;
            w.kind = TaskKind::Compute;
            w.stream = Stream::Compute;
            w.phase = Phase::BackwardWeight;
            w.micro_batch = pass.micro_batch;
            w.chunk = c;
            w.op_begin = static_cast<std::int32_t>(run.lo);
            w.op_end = static_cast<std::int32_t>(run.hi + 1);
            w.deps.push_back(pass_end >= 0 ? pass_end : input_grads);
            w.deps.insert(w.deps.end(), run.inputs.begin(), run.inputs.end());
            if (weights >= 0 && pass_end < 0) w.deps.push_back(weights);
            w.label = per_layer
                          ? label(FMT_COMPILE("bwd_weight {} mb{}"), layer_name(run.layer),
                                  pass.micro_batch)
                          : label(FMT_COMPILE("bwd_weight chunk {} mb{}"), c, pass.micro_batch);
            pass_end = add(std::move(w));
            if (wants_grads) {
              for (const OpId op : run.ops) produced.emplace_back(op, pass_end);
            }
          }
          break;
        }
      }
      if (!between_rounds) flush_sends();  // overlapped: sent at once
      const TaskId first_of_pass =
          rp_->tasks.size() > pass_start ? static_cast<TaskId>(pass_start) : pass_end;
      if (zero3 && !unit_gathers_ && i + 1 < passes.size()) {
        // Zero-bubble: a chunk per pass, one pass ahead (after this pass's first task), but a
        // pass of the chunk this one computes keeps its weights (kept): a stage is one chunk,
        // so its first pass gathers them for the step.
        const Pass& next = passes[i + 1];
        weights =
            next.chunk == pass.chunk
                ? -1
                : gather_weights(items[static_cast<std::size_t>(next.chunk)], next.micro_batch,
                                 next.chunk, fmt::format("chunk {}", next.chunk), first_of_pass);
      }
      if (pass_end >= 0) last_compute = pass_end;
      if ((per_micro_batch_grads || last_micro_batch_grads) && !plan_.overlap_grad_reduce) {
        std::vector<OpId> ops;
        for (const auto& [op, task] : produced) ops.push_back(op);
        if (!ops.empty()) held_grads.emplace_back(pass.micro_batch, std::move(ops));
      } else if ((per_micro_batch_grads || last_micro_batch_grads) &&
                 pass.kind == PassKind::Backward) {
        flush_buckets(buckets);  // the rest of what the blocks filled
      } else if (per_micro_batch_grads || last_micro_batch_grads) {
        // Buckets go out as soon as this pass's gradients exist.
        for (TaskId t : grad_buckets(produced, pass.micro_batch)) dp_tasks.push_back(t);
      }
      const bool has_embedding = k == 0 || (k == last_global && g_.spec().tied_embeddings);
      if (last_micro_batch_grads && has_embedding && pass.kind != PassKind::Forward) {
        embedding_grads_done.push_back(pass_end);
      }
      if (last_micro_batch_grads && pass.kind != PassKind::Forward) {
        final_grads_done.push_back(pass_end);
      }
    }

    flush_sends();  // the last round's
    DTSIM_ASSERT(!unit_gathers_ || next_unit_ == units_.size(),
                 "every ZeRO-3 unit's first task waited for its gather");

    // Without overlap every bucket waits for the rank's last backward task.
    for (const auto& [micro_batch, ops] : held_grads) {
      std::vector<std::pair<OpId, TaskId>> produced;
      for (OpId op : ops) produced.emplace_back(op, last_compute);
      for (TaskId t : grad_buckets(produced, micro_batch)) dp_tasks.push_back(t);
    }

    // Tied embeddings across stages: the first and the last stage each hold the embedding
    // matrix and all-reduce its gradients before the optimizer (Megatron-LM).
    const model::ModelSpec& spec = g_.spec();
    if (spec.tied_embeddings && plan_.pp > 1 && !embedding_grads_done.empty()) {
      auto first = placement_.coords(rp_->rank);
      auto last = first;
      first.pp = 0;
      last.pp = plan_.pp - 1;
      Task ar;
      ar.kind = TaskKind::Collective;
      ar.stream = Stream::Pp;
      ar.collective = CollectiveKind::AllReduce;
      ar.group = group_of(GroupKind::Pp, {placement_.rank(first), placement_.rank(last)});
      ar.bytes = static_cast<std::uint64_t>(static_cast<double>(spec.vocab_rows() * spec.hidden) /
                                            plan_.tp * grad_bytes_ * grad_comm_scale_);
      // After the dp reduction of the embedding's gradients (Megatron-LM: finalize_model_grads
      // reduces over dp, then all-reduces the embedding between the first and last stage).
      ar.deps.assign(embedding_grads_done.begin(), embedding_grads_done.end());
      ar.deps.insert(ar.deps.end(), dp_tasks.begin(), dp_tasks.end());
      // The embedding on the first stage, the head's copy of it on the last.
      OpId holder = g_.layer_ops(-1).front();
      if (rp_->stage != 0) {
        for (OpId id : g_.layer_ops(static_cast<int>(spec.layers))) {
          if (g_.op(id).kind == OpKind::LmHead) holder = id;
        }
      }
      ar.op_begin = static_cast<std::int32_t>(holder);
      ar.op_end = ar.op_begin + 1;
      ar.label = "all-reduce tied embedding gradients";
      dp_tasks.push_back(add(std::move(ar)));
    }

    // Sequence parallelism: each tp rank computed the norms' weight gradients on its share of
    // the sequence only; they are all-reduced over tp before the step (Megatron-LM,
    // finalize_model_grads: _allreduce_layernorm_grads), after the dp reduction; so are the
    // routers' where each tp rank routes its share (Megatron-Core marks the router's weight
    // sequence_parallel under moe_local_dispatch's dispatcher).
    if (plan_.sequence_parallel && plan_.tp > 1) {
      double norm_params = 0;
      bool routers = false, latents = false;
      for (const auto& chunk : items) {
        for (const Item& it : chunk) {
          if (!it.op) continue;
          const model::Op& o = g_.op(*it.op);
          if (plan::sp_partial_gradients(g_.spec(), plan_, o)) {
            norm_params += static_cast<double>(o.params);
          }
          routers = routers || (o.kind == OpKind::Router && local_dispatch_);
          latents = latents || o.kind == OpKind::LatentDown;
        }
      }
      if (norm_params > 0) {
        Task ar;
        ar.kind = TaskKind::Collective;
        ar.stream = Stream::Tp;
        ar.collective = CollectiveKind::AllReduce;
        ar.group = group(GroupKind::Tp);
        ar.bytes = static_cast<std::uint64_t>(norm_params * grad_bytes_ * grad_comm_scale_);
        ar.deps.assign(final_grads_done.begin(), final_grads_done.end());
        ar.deps.insert(ar.deps.end(), dp_tasks.begin(), dp_tasks.end());
        ar.op_begin = 0;
        ar.op_end = static_cast<std::int32_t>(g_.size());
        ar.label = label(FMT_COMPILE("tp all-reduce sequence-parallel norm{}{} gradients"),
                         latents ? ", latent down projection" : "", routers ? " and router" : "");
        dp_tasks.push_back(add(std::move(ar)));
      }
    }

    // Optimizer step over this rank's parameters (its shard under ZeRO >= 1: dense parameters
    // over dp x cp ranks, expert parameters over dp/ep x cp).
    double dense = 0, experts = 0;
    for (const auto& chunk : items) {
      dense += chunk_params(chunk, false);
      experts += chunk_params(chunk, true);
    }
    const bool sharded = plan_.zero_stage >= 1;
    const double dense_shard = sharded ? static_cast<double>(grad_group) : 1.0;
    const double expert_shard = sharded ? static_cast<double>(dp_group_size(true)) : 1.0;
    const auto update_params =
        static_cast<std::uint64_t>(dense / dense_shard + experts / expert_shard);
    if (plan_.clip_grad > 0) {
      // Each rank of a data-parallel group sums the squares of its share of the gradients (its
      // ZeRO slice; without ZeRO, an equal part of the replicated gradients), so that the dp
      // all-reduce counts each once: dtexec's way. (Megatron-LM without its distributed
      // optimizer has every rank read all of its gradients and reduces over tp and pp only; the
      // README says so.)
      const auto norm_params =
          static_cast<std::uint64_t>(dense / static_cast<double>(grad_group) +
                                     experts / static_cast<double>(dp_group_size(true)));
      dp_tasks = {grad_norm(norm_params, dp_tasks)};
    }
    Task opt;
    opt.kind = TaskKind::Compute;
    opt.stream = Stream::Compute;
    opt.phase = Phase::Optimizer;
    opt.params = update_params;
    opt.cleared_params = static_cast<std::uint64_t>(
        (plan::optimizer_clears_gradients(plan_) ? dense : 0.0) +
        (plan::optimizer_clears_expert_gradients(plan_) ? experts : 0.0));
    opt.deps.assign(dp_tasks.begin(), dp_tasks.end());
    opt.label = "optimizer step";
    const TaskId opt_id = add(std::move(opt));
    if ((plan_.zero_stage == 1 || plan_.zero_stage == 2) && !param_gathers_) {
      // Every rank gathers the updated weights of the others.
      for (const bool expert : {false, true}) {
        const double shard = expert ? expert_shard : dense_shard;
        const double params = expert ? experts : dense;
        if (shard <= 1 || params <= 0) continue;
        Task ag = weight_gather(expert, params);
        ag.deps.push_back(opt_id);
        ag.label =
            expert ? "zero all-gather updated expert weights" : "zero all-gather updated weights";
        add(std::move(ag));
      }
    }
  }

  // Gradient clipping (Megatron-LM clip_grad_norm_fp32): the squares of the rank's `params`
  // gradients summed once every gradient is final (`after`), the sums all-reduced over
  // the ranks that hold other parts of the model: dp x cp (ZeRO's shards, and experts over ep),
  // tp, then the pipeline's stages. 4 bytes each; returns the last task, which the optimizer
  // step waits for.
  TaskId grad_norm(std::uint64_t params, const std::vector<TaskId>& after) {
    Task sum;
    sum.kind = TaskKind::Compute;
    sum.stream = Stream::Compute;
    sum.phase = Phase::GradNorm;
    sum.params = params;
    sum.deps.assign(after.begin(), after.end());
    sum.label = "grad norm";
    TaskId last = add(std::move(sum));
    const std::pair<GroupKind, int> reductions[] = {
        {GroupKind::Dp, plan_.dp * plan_.cp}, {GroupKind::Tp, plan_.tp}, {GroupKind::Pp, plan_.pp}};
    for (const auto& [kind, size] : reductions) {
      if (size <= 1) continue;
      Task ar;
      ar.kind = TaskKind::Collective;
      ar.stream = kind == GroupKind::Dp   ? Stream::Dp
                  : kind == GroupKind::Tp ? Stream::Tp
                                          : Stream::Pp;
      ar.phase = Phase::GradNorm;
      ar.collective = CollectiveKind::AllReduce;
      ar.group = group(kind);
      ar.bytes = sizeof(float);
      ar.deps = {last};
      ar.label = label(FMT_COMPILE("{} all-reduce grad norm"), to_string(kind));
      last = add(std::move(ar));
    }
    return last;
  }

  std::uint64_t activation_bytes() const {
    // Megatron-LM sends the block output; with sequence parallelism, or its scatter/gather, a
    // tp rank sends 1/tp of it.
    const bool split = plan_.sequence_parallel || plan_.scatter_gather_p2p;
    return hidden_bytes_ / static_cast<std::uint64_t>(split ? plan_.tp : 1);
  }

  // Unique per (micro-batch, receiving or sending chunk, direction) across the step.
  std::int64_t tag(int micro_batch, int k, bool gradient) const {
    return (static_cast<std::int64_t>(micro_batch) * total_chunks() + k) * 2 + (gradient ? 1 : 0);
  }

  // A pipeline transfer out of a pass, emitted when its round's exchange is.
  struct PendingSend {
    TaskId after;  // the task producing the tensor
    int to_chunk;  // the receiving global chunk: k+1 for activations, k-1 for gradients
    int micro_batch;
    bool gradient;
    int chunk;
    OpId tensor;
  };

  TaskId send(const PendingSend& p) {
    Task s;
    s.op_begin = static_cast<std::int32_t>(p.tensor);
    s.op_end = s.op_begin + 1;
    s.kind = TaskKind::Send;
    s.stream = Stream::Pp;
    s.peer = peer_of_chunk(p.to_chunk);
    s.tag = tag(p.micro_batch, p.to_chunk, p.gradient);
    s.bytes = activation_bytes();
    s.micro_batch = p.micro_batch;
    s.chunk = p.chunk;
    s.deps.push_back(p.after);
    s.label = label(FMT_COMPILE("send {} mb{} chunk {}"), p.gradient ? "gradients" : "activations",
                    p.micro_batch, p.chunk);
    return add(std::move(s));
  }

  // The receive a pass of this rank needs (activations into a forward pass, gradients into a
  // backward one), posted after `after` too, or -1 at the ends of the pipeline and for
  // weight-gradient passes.
  TaskId receive(const Pass& pass, const std::vector<Item>& chunk,
                 const std::vector<TaskId>& after = {}) {
    const int k = global_chunk(pass.chunk);
    const bool gradient = pass.kind == PassKind::Backward || pass.kind == PassKind::BackwardInput;
    if (pass.kind == PassKind::BackwardWeight) return -1;
    if (gradient ? k == total_chunks() - 1 : k == 0) return -1;
    // The tensor: the output of the op before the chunk's first (activations), or of the
    // chunk's last op (gradients).
    const auto [first_op, end_op] = op_range(chunk, g_.size());
    Task recv;
    recv.kind = TaskKind::Recv;
    recv.stream = Stream::Pp;
    recv.peer = peer_of_chunk(gradient ? k + 1 : k - 1);
    recv.tag = tag(pass.micro_batch, k, gradient);
    recv.bytes = activation_bytes();
    recv.micro_batch = pass.micro_batch;
    recv.chunk = pass.chunk;
    recv.op_begin = static_cast<std::int32_t>(gradient ? end_op - 1 : first_op - 1);
    recv.op_end = recv.op_begin + 1;
    recv.label = label(FMT_COMPILE("recv {} mb{} chunk {}"), gradient ? "gradients" : "activations",
                       pass.micro_batch, pass.chunk);
    recv.deps.assign(after.begin(), after.end());
    const TaskId received = add(std::move(recv));
    if (!plan_.scatter_gather_p2p) return received;
    // Scatter/gather: the tp ranks all-gather their slices into the whole tensor before the
    // pass uses it (Megatron-LM's gather_split_1d_tensor).
    Task ag;
    ag.kind = TaskKind::Collective;
    ag.stream = Stream::Tp;
    ag.collective = CollectiveKind::AllGather;
    ag.group = group(GroupKind::Tp);
    ag.bytes = hidden_bytes_;
    ag.micro_batch = pass.micro_batch;
    ag.chunk = pass.chunk;
    ag.op_begin = static_cast<std::int32_t>(gradient ? end_op - 1 : first_op - 1);
    ag.op_end = ag.op_begin + 1;
    ag.tag = tag(pass.micro_batch, k, gradient);  // names the tensor, as the receive's does
    ag.deps.push_back(received);
    ag.label = label(FMT_COMPILE("tp all-gather received {} mb{} chunk {}"),
                     gradient ? "gradients" : "activations", pass.micro_batch, pass.chunk);
    return add(std::move(ag));
  }
};

}  // namespace

namespace {
// The rank programs lowering `plan` makes: every rank's, or a representative per stage.
double simulated_programs(const plan::Plan& plan, Lowering mode) {
  return mode == Lowering::AllRanks ? static_cast<double>(plan.devices()) : plan.pp;
}
}  // namespace

double program_tasks(std::int64_t layers, const plan::Plan& plan, Lowering mode) {
  const double programs = simulated_programs(plan, mode);
  const double blocks = static_cast<double>(layers) / plan.pp + 2;
  return programs * static_cast<double>(plan.micro_batches()) * 3 * blocks * 10;
}

void check_program_size(std::int64_t layers, const plan::Plan& plan, Lowering mode) {
  const double tasks = program_tasks(layers, plan, mode);
  if (tasks <= kMostProgramTasks) return;
  if (mode == Lowering::AllRanks && plan.micro_batches() == 1) {
    // One micro-batch: the ranks are what is too many (dtsim lower --all-ranks).
    throw InputError(fmt::format(
        "{} ranks lowered each (all ranks) would need about {:.2g} tasks, more than the {:.0e} "
        "the simulator handles; lower the representative ranks (without --all-ranks) or fewer "
        "devices",
        plan.devices(), tasks, kMostProgramTasks));
  }
  throw InputError(fmt::format(
      "--global-batch-size: {} micro-batches per step ({} simulated programs of {} blocks) "
      "would need about {:.2g} tasks, more than the {:.0e} the simulator handles; use a larger "
      "--micro-batch-size or a smaller global batch",
      plan.micro_batches(), simulated_programs(plan, mode), layers / plan.pp, tasks,
      kMostProgramTasks));
}

Program lower(const model::ModelGraph& graph, const plan::Plan& plan, const LowerOptions& options) {
  check_program_size(graph.spec().layers, plan, options.mode);
  return Lowerer(graph, plan, options).run();
}

}  // namespace dtsim::lower
