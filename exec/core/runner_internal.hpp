// The Program runner's class (exec/core/runner.hpp runs it): private to exec/core, whose
// runner*.cpp define its members by what they do: runner.cpp the step loop, parameters and
// micro-batches, and the optimizer; runner_ops.cpp the ops forward and backward (experts
// too); runner_collectives.cpp the collectives, gradient reductions, weight gathers and
// pipeline receives; runner_memory.cpp when each tensor is released; runner_checkpoint.cpp
// saving and resuming.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <thread>
#include <utility>

#include "exec/core/checkpoint.hpp"
#include "exec/core/device.hpp"
#include "exec/core/for_pieces.hpp"
#include "exec/core/runner.hpp"
#include "exec/core/slice.hpp"
#include "exec/cpu/device.hpp"
#include "exec/cpu/kernels.hpp"
#include "sim/cluster/placement.hpp"
#include "sim/common/error.hpp"

namespace dtsim::exec::runner_internal {

using lower::CollectiveKind;
using lower::GroupKind;
using lower::Phase;
using lower::TaskKind;
using model::Op;
using model::OpId;
using model::OpKind;

// Parameters, data and dropout masks come from cpu::counter_hash streams of (seed, a, b): they
// do not depend on which rank creates them or in which order.
using cpu::counter_hash;
using cpu::kDropoutRate;
// Dropout sites of a layer (its stream: the seed, the step and (layer + 1)·4 + site).
enum DropoutSiteKind : int {
  kEmbeddingDropout = 0,
  kAttentionDropout,
  kAttnResidual,
  kMlpResidual
};

// A weight or bias of this rank, on the device: the fp32 master and its AdamW state, the copy
// the GEMMs read (in the activation type; the master itself when that is fp32), and its
// gradient.
//
// What is held follows the plan's ZeRO stage (dp > 1): from stage 1 the AdamW state m, v is
// this rank's dp slice only; from stage 2 the gradient exists from the first weight gradient
// of a micro-batch's backward to its bucket's reduce-scatter (the Program reduce-scatters
// every micro-batch's), and the reduced slice accumulates; at stage 3 the fp32 master is the
// slice (`shard`), and `data` (with `work`; `work` alone for a `work_only` tensor) holds the
// whole tensor from an all-gather of the Program to the last compute task that reads it. With
// ZeRO-1/2, a `work_only` tensor's master is its slice too, and `work` its whole tensor (the
// gathers fill it), as Megatron-LM's distributed optimizer keeps an fp32 shard beside full
// 16-bit weights.
struct Param {
  std::string name;
  Slice slice;
  std::int64_t n = 0;  // elements of the tensor on this tp rank (slice.local_size())
  View data, m, v;
  View work;
  bool separate_work = false;  // work is a copy of the weights in the activation type
  // Of a separate working copy, only it is read (a GEMM's weight, not a tied embedding table,
  // whose fp32 rows the embedding reads): ZeRO gathers it in the activation type, and ZeRO-3
  // makes no full fp32 copy of it.
  bool work_only = false;
  View shard;  // ZeRO-3, and a work_only tensor's at ZeRO-1/2: this rank's dp slice of the master
  // Without ZeRO, and at ZeRO-1: a view into the rank's one gradient buffer, where the tensors
  // lie in (op, weight/bias) order: a dp bucket (a range of ops) is one contiguous piece,
  // reduced in place. ZeRO-2/3: a buffer of its own while it exists (empty otherwise).
  View grad;
  // ZeRO >= 1: the reduced gradient of this rank's dp slice (at ZeRO-1, that slice of grad:
  // the step's one reduce-scatter adds into it after packing and clearing the buffer).
  View reduced;
  std::int64_t own_begin = 0, own_end = 0;  // this rank's dp slice (ZeRO >= 1), local indices
  // ZeRO-1 in place (plan zero_in_place): where the tensor lies in the gradient buffer and in
  // the weight buffer of its gathered type, and its bucket (see Runner::plan_flat_layout).
  struct Flat {
    std::int64_t at = 0, weight_at = 0;
    std::int64_t bucket_begin = 0, bucket_size = 0;
    int shards = 0;  // 0: in no bucket yet
  } flat;
  bool replicated_over_tp = false;
  bool tied_copy = false;  // the last stage's copy of the embedding (pipeline, tied head)
  bool norm = false;       // a norm's weight or bias
  // Its gradient comes from the rank's share of the sequence and is all-reduced over tp before
  // the step: a norm's under sequence parallelism, a router's under plan::moe_local_dispatch.
  bool sequence_share = false;
  bool expert = false;  // an expert's (its gradient reduces over the expert-dp group)
  bool decays = false;  // AdamW's weight decay applies (a matrix: not a bias or a norm's)
};

// What one micro-batch keeps between its forward and backward passes (device views).
struct MicroBatch {
  int index = 0;
  View tokens, targets;  // int32
  // Expert parallelism: the sum over its MoE blocks of the copies this rank's experts got over
  // the even share, and the blocks counted (RunResult::expert_load).
  double expert_load = 0;
  int expert_blocks = 0;
  std::map<OpId, View> out, grad, aux1, aux2;
  // Sequence parallelism: the all-gathered (full-sequence) copy of an op's output that the
  // tensor-parallel region reads, and the gradient of that copy before it is reduce-scattered.
  std::map<OpId, View> full, full_grad;
  // Context parallelism, by attention core: the K and V of every cp rank (all-gathered before
  // the core reads them), and their gradients before they are reduce-scattered to their owners.
  std::map<OpId, View> kv, kv_grad;
  // Dropout: by op, the mask of its output's dropout (the embedding's, a residual's branch,
  // an attention core's probabilities) and the attention probabilities after it.
  std::map<OpId, View> mask, dropped;
  // Mixture of experts, by router: the order of the tokens' copies (sorted by expert), the
  // gradient of the gates, and (on the host) each expert's number of copies.
  std::map<OpId, View> route, gate_grad;
  // By router whose gates' backward reads its logits again (Gating::reads_logits: gates over
  // all experts, or sigmoid scores): its logits.
  std::map<OpId, View> logits;
  // Zero-bubble, by experts' down op whose combine runs at it (ep 1, no moe_local_dispatch):
  // its copies' output gradients, from its B pass's combine backward to its W pass.
  std::map<OpId, View> copy_grad;
  std::map<OpId, std::vector<int>> expert_rows;
  // Expert parallelism, by router (on the host): the copies this rank's experts received, as
  // rows per (sending ep member s, local expert l) at s·E/ep + l, in the order they arrived.
  std::map<OpId, std::vector<int>> ep_blocks;
  // plan::moe_local_dispatch, by router (on the host): the copies the experts compute on, all
  // tp ranks' blocks (expert_rows, or ep_blocks with ep) one rank after the other.
  std::map<OpId, std::vector<int>> tp_blocks;
  // The size of an output released before its gradient was made (the gradient has its shape).
  std::map<OpId, std::int64_t> released_out;
};

// A micro-batch's tensor maps, in the order of Runner::Slot.
inline constexpr std::array<std::map<OpId, View> MicroBatch::*, 14> kTensorSlots = {
    &MicroBatch::out,       &MicroBatch::grad,      &MicroBatch::aux1,  &MicroBatch::aux2,
    &MicroBatch::full,      &MicroBatch::full_grad, &MicroBatch::kv,    &MicroBatch::kv_grad,
    &MicroBatch::mask,      &MicroBatch::dropped,   &MicroBatch::route, &MicroBatch::gate_grad,
    &MicroBatch::copy_grad, &MicroBatch::logits};

using Key = std::pair<OpId, int>;  // (op, 0 weight / 1 bias)

// A reduce-scatter in flight: its packed input, its counts and its output must live until it
// finishes.
struct ScatterBuffers {
  View in, out;
  std::vector<int> counts;
};

struct PendingCollective {
  Comm::Handle handle = -1;
  std::function<void()> complete;  // what to do with the result (may be empty)
  // The measured task whose end is the collective's completion (timed steps on the host).
  std::optional<std::size_t> record;
  // A ZeRO gradient reduce-scatter, which holds its bucket's packed copy and reduced shard.
  bool holds_bucket = false;
  // More collectives of the same task, finished with it (ZeRO in place: a bucket's pieces).
  std::vector<Comm::Handle> also = {};
  // Per-member counts that the started collectives read until they finish (MPI's rule for
  // non-blocking vector collectives).
  std::vector<std::vector<int>> counts = {};
};

// Watches the task in progress from a second thread; one that outlasts the timeout is reported
// through RunOptions::on_hang (which is expected not to return).
class Watchdog {
 public:
  // What is watched or waited for besides a task: nothing, the step's end, pipeline sends.
  static constexpr std::int64_t kNone = -1, kStepEnd = -2, kSends = -3, kCheckpoint = -4;

  // `peers`: whether the run has other ranks (a run of one has none to blame).
  Watchdog(const RunOptions& options, const lower::RankProgram& rp, bool peers)
      : task_timeout_(options.task_timeout_s),
        checkpoint_timeout_(options.checkpoint_timeout_s),
        on_hang_(options.on_hang),
        rp_(rp),
        peers_(peers) {
    if ((task_timeout_ <= 0 && checkpoint_timeout_ <= 0) || !on_hang_) return;
    thread_ = std::thread([this] { watch(); });
  }
  ~Watchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void begin(std::size_t task) { begin_at(static_cast<std::int64_t>(task)); }
  // The step's end: its started collectives and sends finished, its loss and time reduced.
  void begin_step_end() { begin_at(kStepEnd); }
  // The checkpoint after step `step`: its shards written and the ranks' agreement that they are
  // (a peer that never writes its shard holds the others in that agreement), watched with the
  // checkpoint's own timeout.
  void begin_checkpoint(int step) {
    begin_at(kCheckpoint);
    if (!thread_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    checkpoint_step_ = step;
  }
  // What is watched now waits for started collective `task` (the message names it: the task
  // that waits is often a compute task, the optimizer's step), or for its pipeline sends to be
  // received (kSends); kNone: no longer.
  void waiting_for(std::int64_t task) {
    if (!thread_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_ = task;
  }
  void end() {
    if (!thread_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = kNone;
    waiting_ = kNone;
  }

 private:
  void watch() {
    // Every 0.2 s, or a tenth of a shorter timeout (at least every millisecond), so that a
    // timeout below 0.2 s is kept to about its length.
    double every_s = 0.2;
    for (const double t : {task_timeout_, checkpoint_timeout_}) {
      if (t > 0) every_s = std::min(every_s, t / 10);
    }
    const auto every = std::chrono::duration<double>(std::max(every_s, 1e-3));
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, every);
      if (stop_ || task_ == kNone) continue;
      const double timeout = task_ == kCheckpoint ? checkpoint_timeout_ : task_timeout_;
      if (timeout <= 0) continue;
      const double held =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count();
      if (held > timeout) {
        auto named = [this](std::int64_t i) {
          return fmt::format("task {} ({})", i, rp_.tasks[static_cast<std::size_t>(i)].label);
        };
        on_hang_(fmt::format(
            "rank {}: {} has not finished after {} s (timeout {:g} s){}; {}{}", rp_.rank,
            task_ == kStepEnd ? std::string("the step's end (its collectives, sends and loss)")
            : task_ == kCheckpoint
                ? fmt::format("the checkpoint after step {} (its shards' writes and the "
                              "ranks' agreement on them)",
                              checkpoint_step_)
                : named(task_),
            // (To the millisecond under a timeout below a second.)
            timeout < 1 ? fmt::format("{:.3f}", held) : fmt::format("{:.0f}", held), timeout,
            waiting_ >= 0        ? ", waiting for " + named(waiting_)
            : waiting_ == kSends ? ", waiting for its pipeline sends to be received"
                                 : "",
            peers_ ? "a peer is missing or hung"
                   : "the run has no other rank: the task is hung, or slower than the timeout "
                     "allows",
            task_ == kCheckpoint
                ? ", or the checkpoint's storage slower than --checkpoint-timeout allows"
                : ""));
        return;
      }
    }
  }
  void begin_at(std::int64_t what) {
    if (!thread_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = what;
    waiting_ = kNone;
    since_ = std::chrono::steady_clock::now();
  }

  double task_timeout_, checkpoint_timeout_;
  std::function<void(const std::string&)> on_hang_;
  const lower::RankProgram& rp_;
  bool peers_ = true;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::int64_t task_ = kNone;     // a task's index, kStepEnd, or kNone (nothing watched)
  std::int64_t waiting_ = kNone;  // the started collective it waits for, or kSends
  int checkpoint_step_ = 0;       // with kCheckpoint: the step the checkpoint is after
  std::chrono::steady_clock::time_point since_;
};

class Runner {
 public:
  Runner(const model::ModelGraph& g, const lower::Program& program, const RunOptions& options,
         Comm& comm, Device& device);

  RunResult run();

 private:
  // This rank's position in its group of `kind` (0 when it has none: degree 1).
  int member_index(GroupKind kind) const;

  // ---- parameters ----------------------------------------------------------------------

  // The ops of this rank's chunks (first chunk: the embedding; last: norm, head, loss).
  std::vector<OpId> my_ops() const;

  // The slices of an op's weight and bias on tensor-parallel rank t (empty: no such tensor).
  std::vector<std::pair<int, Slice>> slices(const Op& op, int t) const;

  // This rank's slice of a tensor's initial values: N(0, 0.02) for matrices, 1 for norm
  // weights, 0 for biases (GPT-2's initialisation without its residual scaling). Element i of
  // the full tensor is drawn from a counter-based stream of (seed, op, which, i), so that a rank
  // computes only its own slice and every split of the tensor sees the same values.
  std::vector<float> initial(OpId id, int which, const Slice& s) const;

  // A standard normal from (stream, index): two uniforms in (0, 1] from the splitmix64 of the
  // pair, then Box and Muller's transform (1958).
  static float standard_normal(std::uint64_t stream, std::int64_t index);
  // --only-rank: the values a replayed receive holds, one tensor of a transfer's size made
  // once: standard normal, not zeros, since a GEMM of zeros draws less power and runs at
  // higher clocks than one of a real peer's activations or gradients.
  View replayed_input();

  void init_params();

  // The GEMMs' copy, in the activation type, of the weights they read (linear layers and a
  // tied head's table); other tensors are read as their fp32 master.
  bool gemm_weight(const Op& op, int which) const;
  // Param::work_only: a separate working copy (not fp32 activations) of a GEMM's weight that
  // only the GEMMs read (not the tied embedding table, whose fp32 rows the embedding reads).
  bool work_only(const Op& op, int which) const {
    return dev_.activations() != Dtype::F32 && gemm_weight(op, which) &&
           op.kind != OpKind::Embedding;
  }

  // ZeRO-1 in place (plan zero_in_place), as Megatron-LM's distributed optimizer lays out its
  // buffers: the gradients lie in one buffer (dense tensors, then experts', each in key order,
  // as init_params places them), where a dp bucket (the ops of one of the Program's gradient
  // reduce-scatters) is one contiguous range, cut into one contiguous part per dp rank (rank
  // r's: elements [size·r/n, size·(r+1)/n) of it). A tensor's slice is what of it falls in the
  // rank's part: a whole tensor, a piece, or nothing. The reduce-scatter then leaves the rank's
  // part of the sums where its gradients were, and the weights, laid out alike (one buffer per
  // type a gather moves), gather in place after the optimizer step. Allocates the weight
  // buffers; returns each tensor's places.
  std::map<Key, Param::Flat> plan_flat_layout();
  template <class Tensors>
  std::vector<Key> keys_of_tensors(const Tensors& tensors, const lower::Task& task) const {
    std::vector<Key> out;
    for (auto it = tensors.lower_bound({static_cast<OpId>(task.op_begin), 0});
         it != tensors.end() && it->first.first < static_cast<OpId>(task.op_end); ++it) {
      if (it->second.expert == expert_group(task)) out.push_back(it->first);
    }
    return out;
  }

  // ZeRO-1 in place: the elements [begin, end) of a tensor in dp rank r's part of its bucket.
  static std::pair<std::int64_t, std::int64_t> flat_slice(const Param& p, int r);

  // n elements split over `shards` ranks as ZeRO splits them, rank r's n·r/shards up to
  // n·(r+1)/shards: each rank's count.
  static std::vector<std::int64_t> even_parts(std::int64_t n, int shards) {
    std::vector<std::int64_t> parts(static_cast<std::size_t>(shards));
    for (int r = 0; r < shards; ++r) {
      parts[static_cast<std::size_t>(r)] = n * (r + 1) / shards - n * r / shards;
    }
    return parts;
  }

  // Whether task `index` of this rank runs on the data-parallel stream (which runs its
  // collectives in order).
  bool on_dp_stream(std::size_t index) const {
    return rp_->tasks[index].stream == lower::Stream::Dp;
  }

  // Whether ZeRO shards a tensor: the dense ones over dp x cp, an expert's over its own
  // data-parallel group (dp / ep x cp), which may be one rank (dp = ep, cp 1: each expert on
  // one rank, as Megatron-LM's distributed optimizer leaves it whole), where the Program
  // reduces and gathers nothing and the tensor is trained as without ZeRO.
  bool sharded(const Param& p) const { return sharded_ && (!p.expert || edp_ > 1); }
  // ZeRO-3's: a sharded tensor's weights exist only between its gathers and last reads.
  bool zero3(const Param& p) const { return zero3_ && sharded(p); }
  // Whether the fp32 master of a tensor is this rank's dp slice only (Param::shard).
  bool sharded_master(const Param& p) const { return zero3(p) || (sharded(p) && p.work_only); }

  // A tensor's weights set from the whole tp slice `full` (initial, or read from a checkpoint):
  // its master (slice), and what the GEMMs read, except under ZeRO-3 (its gathers make it).
  void load_weights(Param& p, const float* full);

  // A tensor's name in checkpoints and messages: "L3.qkv.weight", "L0.experts_up.e2.bias"
  // (expert e's weight and bias are tensors 2e and 2e + 1).
  std::string tensor_name(OpId id, int which) const;
  // The op whose tensors `id`'s are, in checkpoints and initialisation: the embedding for a tied
  // LM head (its weight a copy of the table), else `id` itself.
  OpId saved_as(OpId id) const;

  // The GEMMs' copy of a weight, after its master changed (a no-op when they are one).
  void refresh_work(Param& p) {
    if (p.separate_work) dev_.cast(p.work, p.data);
  }

  // A weight's gradient, made (zeros) at its first write where it does not live through the
  // step (ZeRO-2/3).
  View grad(Param& p) {
    if (p.grad.empty()) p.grad = dev_.allocate(p.n, Dtype::F32);
    return p.grad;
  }
  void drop_grad(Param& p) {
    dev_.release(p.grad);
    p.grad = View{};
  }

  // This rank's dp slice of a tensor's fp32 master (the whole tensor without ZeRO).
  View master_slice(const Param& p) const {
    return sharded_master(p) ? p.shard : p.data.sub(p.own_begin, p.own_end - p.own_begin);
  }

  Param* find(OpId id, int which) {
    auto it = params_.find({id, which});
    return it == params_.end() ? nullptr : &it->second;
  }
  Param& param(OpId id, int which);
  View bias_in(OpId id, int which = 1) {
    Param* b = find(id, which);
    return b ? b->data : View{};
  }
  View bias_grad(OpId id, int which = 1) {
    Param* b = find(id, which);
    return b ? grad(*b) : View{};
  }

  // The parameters of ops [begin, end) that this rank holds, in a fixed order.
  std::vector<Param*> params_of(std::int32_t begin, std::int32_t end);
  std::vector<Key> keys_of(std::int32_t begin, std::int32_t end) const;
  // What a dp-group task (a gradient bucket, a ZeRO gather) carries: the tensors of its ops
  // (of every op for ZeRO-1/2's closing all-gather), dense ones over the dp group and experts'
  // over the expert-dp group.
  bool is_dp_group(const lower::Task& task) const {
    const GroupKind kind = program_.groups.at(static_cast<std::size_t>(task.group)).kind;
    return kind == GroupKind::Dp || kind == GroupKind::ExpertDp;
  }
  bool expert_group(const lower::Task& task) const {
    return program_.groups.at(static_cast<std::size_t>(task.group)).kind == GroupKind::ExpertDp;
  }
  // How many ZeRO shards the tensors of a dp-group task have, and which is this rank's.
  std::pair<int, int> shards_of(const lower::Task& task) const {
    return expert_group(task) ? std::pair{edp_, ed_} : std::pair{dp_, d_};
  }
  // Whether this rank holds tensors of op id (an expert op's: those of its experts, the first
  // of which is tensor 2·e_·E/ep).
  bool holds_weights(OpId id) const;
  // Whether expert e is this rank's (expert parallelism gives each ep rank E/ep of them).
  bool local_expert(int e) const { return e / static_cast<int>(m_.moe->experts / ep_) == e_; }
  std::vector<Param*> params_for(const lower::Task& task);
  std::vector<Key> keys_for(const lower::Task& task) const;

  // ---- data ------------------------------------------------------------------------------

  // Context parallelism splits each sequence into 2·cp chunks and gives cp rank c chunks c and
  // 2·cp-1-c (Megatron-LM's load balancing of causal attention: every rank gets as many early
  // as late positions). positions_: the position of each of the rank's Sq tokens of a sequence;
  // key_order_: for each position, the key's index among a sequence's all-gathered cp·Sq keys.
  void place_positions();

  // Micro-batch j of data-parallel replica d holds sequences (d·m + j)·b ... of the step's
  // global batch, so that any dp and micro-batch split of a global batch sees the same data;
  // under context parallelism a rank keeps its positions of them.
  void make_batch(MicroBatch& mb, int step, int j);

  // ---- compute ---------------------------------------------------------------------------

  View& grad_of(MicroBatch& mb, OpId id);

  OpId input(OpId id) const { return g_.predecessors(id).front(); }
  // The loss's other input: the op that computed its softmax statistics.
  OpId statistics_of(OpId loss) const { return g_.predecessors(loss).at(1); }

  // An op's input: the all-gathered copy where sequence parallelism made one.
  View input_of(MicroBatch& mb, OpId id) {
    const OpId in = input(id);
    return gathers_input(g_.op(id)) ? mb.full.at(in) : mb.out.at(in);
  }
  // The gradient buffer of an op's input: the whole sequence's where sequence parallelism
  // gathers that input (the forward may have released the gathered copy: zero-bubble's
  // input-gradient pass runs before it is gathered again).
  View& input_grad_of(MicroBatch& mb, OpId id);
  // A gradient an op writes into: `unwritten` where this op makes it first (allocated for
  // overwrite, Device::allocate_for_overwrite: the op writes it whole), else it adds into it.
  struct GradOut {
    View v;
    bool unwritten = false;
  };
  // As input_grad_of, for a GEMM's input gradient (Device::matmul_input_grad where unwritten).
  GradOut input_grad_to_write(MicroBatch& mb, OpId id);
  // The gradient of op id's output += d; where this is its first contribution, a copy of d
  // (from the pool without zeros: no memset, no read of them).
  void add_to_grad(MicroBatch& mb, OpId id, View d);
  // The gradient of op id's output from `write`, a kernel that writes its output whole: into the
  // gradient itself where this is its first contribution (no zeros first), else into a tensor
  // of its own added to it.
  template <class Write>
  void write_grad(MicroBatch& mb, OpId id, const Write& write) {
    View& g = mb.grad[id];
    if (g.empty()) {
      fresh_for_overwrite(g, output_size(mb, id));
      write(g);
      return;
    }
    const View part = dev_.allocate_for_overwrite(g.size(), g.type);
    write(part);
    dev_.accumulate(g, part);
    dev_.release(part);
  }
  // Where input_grad_of's gradient is kept, and its size (made or not).
  std::pair<View*, std::int64_t> input_grad_slot(MicroBatch& mb, OpId id);
  // The size of op id's output (kept, or released after the forward).
  std::int64_t output_size(const MicroBatch& mb, OpId id) const;
  // Sequence parallelism all-gathers the input of a column-parallel layer (the lowering's
  // TpEnter markers: QKV, MLP up, the LM head; not a router, which routes its rank's share of
  // the sequence, plan::moe_local_dispatch).
  // (Multi-head latent attention's up projections gather their latents: gemm_input.)
  bool gathers_input(const Op& op) const {
    return Ts_ != T_ && ((op.kind == OpKind::QkvProj && !latent_projection(op)) ||
                         (op.kind == OpKind::MlpUp && !op.expert) || op.kind == OpKind::LmHead);
  }

  // Local GEMM shape (K, N) of a linear op on this tensor-parallel rank.
  std::pair<int, int> gemm_shape(const Op& op) const;

  // The shared experts' down projection, which adds the routed experts' output (its second
  // input) to its own; and where the rank's share of that output lies in its rows under
  // moe_local_dispatch.
  bool adds_routed(OpId id) const {
    const Op& op = g_.op(id);
    return op.kind == OpKind::MlpDown && !op.expert && m_.has_experts(op.layer) &&
           m_.shared_ffn() > 0;
  }
  std::int64_t routed_rows() const { return static_cast<std::int64_t>(t_) * Ts_ * C_; }

  bool row_parallel(const Op& op) const {
    return op.kind == OpKind::AttnOutProj || op.kind == OpKind::MlpDown;
  }

  // A tied head reads the embedding table [V/tp, C] as its transposed weight: the embedding's
  // own on a single stage, else the last stage's copy of it; its gradient goes there too.
  Param& tied_table(OpId head) {
    Param* copy = find(head, 0);
    return copy ? *copy : param(g_.layer_ops(-1).front(), 0);
  }
  bool tied_head(const Op& op) const { return op.kind == OpKind::LmHead && op.params == 0; }

  void forward(MicroBatch& mb, OpId id);

  // ---- dropout -----------------------------------------------------------------------------

  // A dropout site of micro-batch mb: its stream (seed, step, layer, site), its sequences, and
  // where a residual-stream tensor's rows start among the micro-batch's (sequence parallelism).
  Device::DropoutSite dropout_site(const MicroBatch& mb, int layer, int site, int first_row) const;

  int residual_site(OpId branch) const;

  // The embedding's dropout, once its output is whole (after the tensor-parallel reduction;
  // the rank's share of the sequence under sequence parallelism).
  void embedding_dropout(MicroBatch& mb, OpId id);

  // What the attention core adds to attention_forward: context parallelism's keys, and its
  // dropout (`site`, or none; the masks are the caller's).
  Device::Attention attention_extras(MicroBatch& mb, OpId id, const Device::DropoutSite* site);

  // Which gradients a backward computes: both, or (zero-bubble) the input gradients in the B
  // pass and the weight gradients in the later W pass.
  enum class Part { Both, Input, Weight };
  static Part part_of(Phase phase);

  void backward(MicroBatch& mb, OpId id, Part part = Part::Both);

  // A linear layer's backward on `rows` rows: din += dout·w^T (when din is given; din = dout·w^T
  // where it is unwritten), and with weight_grads w's gradient (and dbias) += in^T·dout.
  // Without gradient-accumulation fusion (plan grad_accumulation_fusion false) the GEMM writes
  // a fresh weight gradient that a kernel of its own adds into the accumulator, the pass the
  // simulator prices (cost::ComputeCost::accumulation_seconds).
  void linear_backward(GradOut din, Param& w, View dbias, View dout, View in, int rows, int K,
                       int N, bool tied, bool weight_grads);

  // ---- multi-head latent attention ----------------------------------------------------------
  //
  // DeepSeek-V2's attention as the model graph has it (sim/model/model_graph.cpp): the down
  // projection (OpKind::LatentDown) of the block's normed input to the queries' latent, the keys'
  // and values' latent and the keys' part with positions, one GEMM (its weight [h, r_q + r_kv +
  // d_r]: Hugging Face's q_a_proj and kv_a_proj_with_mqa side by side), its output's three parts
  // then copied apart, one after another ([T, r_q], [T, r_kv], [T, d_r]); the latents' RMSNorms
  // (one Norm op, its weights r_q then r_kv, its output the two normed latents one after another);
  // the up projections of the queries (from their latent, or from the block's input where r_q is 0)
  // and of the keys and values (QkvProj ops); the core reads them through mla_pack_forward, the
  // keys' part with positions from the down projection's output.
  enum class Projection { Qkv, QUp, QProj, KvUp };
  Projection projection(const Op& op) const;
  // An up projection from a latent (q_up, kv_up). Under sequence parallelism its latent (and
  // kv_up's the keys' RoPE part) is all-gathered into the op's own Full slot (the down
  // projection's for the RoPE part), their gradients made there (FullGrad) and reduce-scattered
  // back (latent_sp_collective).
  bool latent_projection(const Op& op) const {
    const Projection p = projection(op);
    return p == Projection::QUp || p == Projection::KvUp;
  }
  // (Both known by the graph's names for them.)
  bool latent_norm(const Op& op) const {
    return m_.mla && op.kind == OpKind::Norm && op.name.ends_with(".latent_norm");
  }
  // The down projection's parts (and the latents' norm's segments): their widths and where each
  // begins in a row of the three.
  struct Segment {
    int begin = 0, width = 0;
  };
  std::vector<Segment> latent_segments(bool normed) const;
  // A GEMM's input: the op's input, or the part of the latents' norm output it reads (gathered
  // under sequence parallelism); and where an up projection from a latent adds its input's
  // gradient (zeros where it is the first).
  View gemm_input(MicroBatch& mb, OpId id);
  GradOut latent_input_grad(MicroBatch& mb, OpId id);
  // Sequence parallelism at a latent's up projection: the forward's all-gather of its latent
  // (kv_up's with the keys' RoPE part), the backward's again for the weight gradient (the
  // latent alone), and the reduce-scatter of their gradients.
  void latent_sp_collective(const lower::Task& task, MicroBatch& mb, OpId anchor, bool local);
  // The down projection that attention core `core` reads the keys' part with positions from
  // (the third of its output's parts: latent_rope).
  OpId latent_down_of(OpId core) const;
  void latent_down_forward(MicroBatch& mb, OpId id);
  void latent_down_backward(MicroBatch& mb, OpId id, Part part);
  void latent_norm_forward(MicroBatch& mb, OpId id);
  void latent_norm_backward(MicroBatch& mb, OpId id, bool input_grads, bool weight_grads);
  // (Under sequence parallelism all-gathered into the down projection's Full slot.)
  View latent_rope(MicroBatch& mb, OpId core) {
    const OpId down = latent_down_of(core);
    if (Ts_ != T_) return mb.full.at(down);
    return mb.out.at(down).sub(static_cast<std::int64_t>(T_) * (Rq_ + Rkv_),
                               static_cast<std::int64_t>(T_) * Dr_);
  }
  // Its gradient (made, zeros, where this is its first contribution; each tp rank's heads' sum).
  View latent_rope_grad(MicroBatch& mb, OpId core) {
    const OpId down = latent_down_of(core);
    if (Ts_ != T_) {
      View& g = mb.full_grad[down];
      if (g.empty()) fresh(g, static_cast<std::int64_t>(T_) * Dr_);
      return g;
    }
    return grad_of(mb, down).sub(static_cast<std::int64_t>(T_) * (Rq_ + Rkv_),
                                 static_cast<std::int64_t>(T_) * Dr_);
  }

  // ---- mixture of experts --------------------------------------------------------------------
  //
  // Mixtral's MoE block (Jiang et al. 2024) as the model graph has it: the router (its output:
  // each token's top_k copies, sorted by expert), the experts' up GEMMs, their activation, and
  // their down GEMMs (whose output is the copies' outputs weighted by their gates and summed
  // per token). Each expert's GEMMs run on its own rows, as many as the router sent it: real
  // routing, not the balanced load the simulator assumes. The router keeps the gates (aux1),
  // the chosen experts (aux2) and the copies' order (route); the down op keeps the copies'
  // outputs (aux1) for the gates' gradient.

  int top_k() const { return static_cast<int>(m_.moe->top_k); }
  // How the router weights a token's experts (MoeSpec's gates).
  Gating gating() const {
    Gating g;
    g.sigmoid = m_.moe->sigmoid_gates;
    g.normalize = m_.moe->normalize_top_k;
    g.scale = static_cast<float>(m_.moe->routed_scale);
    return g;
  }
  int expert_ffn() const { return static_cast<int>(m_.moe->expert_ffn_hidden / tp_); }
  // The rank's share of an MLP op's width: an expert's, or the dense MLP's of its block (a
  // dense model's, a mixture's dense block's, or its shared experts').
  int mlp_width(const Op& op) const {
    return op.expert ? expert_ffn() : static_cast<int>(m_.dense_ffn(op.layer) / tp_);
  }
  // The router of an expert op (up <- router; down <- activation <- up <- router).
  OpId router_of(OpId id) const;

  void router_forward(MicroBatch& mb, OpId id);

  // The blocks of copies the experts compute on, by router: the rows per expert of this
  // rank's tokens (expert_rows), with expert parallelism those per (sender, local expert) that
  // this rank's experts received (ep_blocks), under plan::moe_local_dispatch either of them
  // from every tp rank (tp_blocks). Block b holds copies for local expert b mod E/ep.
  const std::vector<int>& expert_blocks(const MicroBatch& mb, OpId router) const {
    return local_dispatch_ ? mb.tp_blocks.at(router) : own_blocks(mb, router);
  }
  // This tp rank's blocks before the tp all-gather: expert_rows, or ep_blocks with ep.
  const std::vector<int>& own_blocks(const MicroBatch& mb, OpId router) const {
    return ep_ > 1 ? mb.ep_blocks.at(router) : mb.expert_rows.at(router);
  }

  // fn(w, at, n) for each expert with rows: its weight's tensor number w, and its n rows of
  // the copies from row `at`. An expert's GEMMs run once per run of its adjacent blocks (once
  // in all where a rank holds one expert, whose blocks are all adjacent; per block where it
  // holds several, whose blocks alternate: per sender's with ep, per tp rank's gathered).
  template <typename Fn>
  void for_each_expert(MicroBatch& mb, OpId router, Fn&& fn) {
    const auto& blocks = expert_blocks(mb, router);
    const int local = static_cast<int>(m_.moe->experts) / ep_;
    std::int64_t at = 0, run_at = 0;
    int run_expert = -1, run_rows = 0;
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      if (blocks[b] == 0) continue;  // an empty block leaves its neighbours adjacent
      const int e = e_ * local + static_cast<int>(b) % local;
      if (e != run_expert) {
        if (run_rows > 0) fn(2 * run_expert, run_at, run_rows);
        run_expert = e;
        run_at = at;
        run_rows = 0;
      }
      run_rows += blocks[b];
      at += blocks[b];
    }
    if (run_rows > 0) fn(2 * run_expert, run_at, run_rows);
  }

  // The copies this rank's experts compute on: all T·k of its tokens' (ep 1), what the ep
  // all-to-all brought, or under plan::moe_local_dispatch those of every tp rank.
  std::int64_t expert_copies(const MicroBatch& mb, OpId router) const;

  // The experts' GEMMs of an up or down op, each on its rows of the copies.
  void experts_forward(MicroBatch& mb, OpId id);

  void experts_backward(MicroBatch& mb, OpId id, Part part);

  // Expert parallelism (the lowering's ep all-to-alls, GShard's dispatch and combine): ep rank r
  // holds experts [r·E/ep, (r+1)·E/ep). Forward, before the up GEMMs, each rank sends every
  // member its tokens' copies for that member's experts (the router sorted them by expert, so
  // they are consecutive), after the rows per expert; the received copies replace the router's
  // output, in blocks per (sender, expert) (ep_blocks). After the down GEMMs the copies'
  // outputs go back the same way and are combined at their tokens' rank. Backward, the
  // combine's gradient (and the gates') is taken at the tokens' rank and its copies' gradients
  // sent to the experts, replacing the down op's output gradient; after the up GEMMs' input
  // gradient the copies' gradients go back, replacing the router's output gradient.
  //
  // Alone (--only-rank) there are no peers: each is taken to route its tokens as this
  // rank does (every member sends this rank's experts what this rank's own tokens send them,
  // the expected load when replicas see alike data), the copies received are this rank's own,
  // and what would come back from other ranks' experts is zeros. Shapes and work are a rank's;
  // the values mean nothing (as every --only-rank loss).
  void ep_collective(const lower::Task& task, MicroBatch& mb, bool alone = false);

  // plan::moe_local_dispatch (the lowering's TpGatherCopies and TpScatterCopies): each tp rank
  // routes its share of the sequence, and its copies (after the ep all-to-all, those its ep
  // rank's experts got from its ep peers' shares) are all-gathered over tp before the up GEMMs,
  // the tp ranks' blocks one after the other (tp_blocks, their counts gathered first); the
  // down GEMMs' partial outputs are reduce-scattered back to each tp rank's own copies, and
  // combined at their tokens (ep 1) or sent home by the ep all-to-all. Backward: the gradients
  // the other way (the combine's backward first, with ep 1).
  //
  // Alone (--only-rank) every tp rank is taken to send this rank's copies, and the
  // reduce-scatter keeps this rank's piece.
  void tp_copies_collective(const lower::Task& task, MicroBatch& mb, bool alone = false);

  void router_backward(MicroBatch& mb, OpId id, Part part);

  // Whether this rank's copy of a tensor is the one that counts across tp ranks and pipeline
  // stages (the gradient norm, checkpoints): not the last stage's copy of a tied embedding, and
  // a tp-replicated tensor (a norm, a row-parallel bias) on tp rank 0 only.
  bool canonical_copy(const Param& p) const {
    return !(p.tied_copy || (p.replicated_over_tp && t_ != 0));
  }

  // Gradient clipping: what this rank adds to the global norm, each gradient element counted
  // on one rank only: the rank's ZeRO slice of the reduced gradient (sharded), else its equal
  // part of the replicated one (by its index in the dp x cp group, or in the expert-dp group
  // for an expert's, other ep ranks holding other experts); a tp-replicated tensor on tp rank
  // 0 only; the tied embedding on the first stage (the last stage's copy is equal after their
  // all-reduce). Empty: nothing.
  View norm_share(Param& p);

  // The rank's share of the gradients' squared norm, which the Program's grad-norm
  // all-reduces then sum over the ranks.
  void grad_norm();

  void optimizer_step();

  // ---- communication -----------------------------------------------------------------------

  // Gradients of `params` over the dp group: summed in place (ZeRO-0), or reduce-scattered into
  // each rank's slice accumulator (ZeRO >= 1), the full gradient buffers then cleared.
  // The reduction starts here and finishes when a later task depends on it (the Program's
  // dp stream overlapping the rest of the backward pass).
  void reduce_gradients(const lower::Task& task, const std::vector<Param*>& params,
                        std::size_t index);

  // Vocab-parallel cross-entropy (Megatron-LM): the statistics that op `statistics` computed
  // over the rank's share of the vocabulary, reduced over tp: the row maxima with max, then the
  // sums of exponentials (rescaled to those maxima) and the target logits with sum.
  void loss_statistics(const lower::Task& task, MicroBatch& mb, OpId statistics);

  // Started collectives whose results are added somewhere (ZeRO's reduce-scatters, into the
  // reduced slices) finish as soon as the backend has seen them complete, so that their
  // buffers go back then, as a framework frees them; and always in the order they started, so
  // that the sums are added in one order whatever the timing. (On a GPU they are complete once
  // the device has run them, which is often after the host queued the rest of the step: those
  // finish when a task needs them.)
  void finish_completed();

  // Finishes the started collectives that `task` depends on (all of them for nullptr), and
  // the ones that add results started before the last such one it depends on.
  void settle(const lower::Task* task);

  std::map<std::size_t, PendingCollective>::iterator finish_pending(
      std::map<std::size_t, PendingCollective>::iterator it);
  // Finishes the ZeRO gradient reduce-scatters started so far (their buffers go back).
  void finish_reductions();

  // Per-member counts of a collective, which the communication backends take as int (MPI's
  // counts are); a buffer of 2^31 elements or more is refused, naming the collective.
  static std::vector<int> collective_counts(const std::vector<std::int64_t>& wide,
                                            const char* what);

  // The blocking sends recorded since the last wait end now: their receivers have them.
  void close_sends();

  double since_start(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration<double>(t - t0_).count();
  }

  // Every dp rank's updated slice of `params`, gathered into the full weights (ZeRO-3: into
  // buffers made here, which live to the last compute task that reads them), each tensor in
  // place; started, pending as task `index` until a task that depends on it (settle). A tensor
  // of which only the working copy is read (Param::work_only) is gathered in the activation
  // type straight into it, as Megatron-LM and FSDP2 gather 16-bit weights (half the bytes of
  // its fp32 master); the others in fp32, their working copies cast once gathered. With
  // `local` (--only-rank) the other slices stay zeros, nothing started.
  void gather_weights(const lower::Task& task, const std::vector<Param*>& params, std::size_t index,
                      bool local = false);

  // ZeRO-1 in place (plan_flat_layout): the weights of `params` gathered where they lie, one
  // all-gather per bucket and type, each rank's part the updated master slices it holds
  // there (cast into it first where the working copy is gathered: the fp32 ones are there
  // already). A bucket's tensors of one type are consecutive in their buffer, and every rank's
  // part of them is one range there, the ranks' in rank order.
  void gather_in_place(const lower::Task& task, const std::vector<Param*>& params);

  // Context parallelism (the lowering's all-gather variant, as Llama 3's): before an attention
  // core, the K and V of this rank's tokens (rotated, with rotary positions) all-gathered over
  // cp, in forward and again before the backward (unless a full recompute gathers them); after
  // its backward, the gradients of every rank's K and V reduce-scattered to their owners and
  // added into the gradient of this rank's qkv. With `local` (--only-rank) the shapes change as
  // they would, the data is this rank's own.
  void cp_collective(const lower::Task& task, MicroBatch& mb, bool local = false);

  // A collective of equal shares over task.group's `ranks`: this rank's share all-gathered into
  // whole (rank r's r-th), or whole reduce-scattered into its share (written). With `local`
  // (--only-rank) the shapes are as they would be, the data this rank's own: its share copied
  // into every rank's place, or its own place of whole (the `self`-th) copied out. `what` names
  // the collective where its share overflows an int's count.
  void gather_shares(const lower::Task& task, int ranks, View share, View whole, bool local,
                     const char* what);
  void scatter_shares(const lower::Task& task, int ranks, int self, View whole, View share,
                      bool local, const char* what);

  // Sequence parallelism (Korthikanti et al. 2022): g is a reduce-scatter over the sequence in
  // forward and an all-gather in backward, f the converse. Rank r holds rows [r·Ts, (r+1)·Ts).
  // With `local` (--only-rank) the shapes change as they would, the data is this rank's own.
  void sequence_parallel_collective(const lower::Task& task, MicroBatch& mb, OpId anchor, bool exit,
                                    bool local = false);

  void collective(const lower::Task& task, std::size_t index);

  // A micro-batch's tensors go back to the device, whose pool later tensors reuse, so memory
  // stays what the schedule keeps in flight without the cost of fresh pages every step.
  void release(MicroBatch& mb);

  // ---- tensor lifetimes ----------------------------------------------------------------
  //
  // A micro-batch's tensor goes back to the device as soon as nothing later in the step reads
  // it, as autograd frees a saved tensor once the backward that saved it ran: an op's output
  // after the last backward that reads it, an output's gradient after its op's backward (both
  // passes, under zero-bubble), a tensor that a Recompute task makes again after the forward
  // that read it last (so the forward keeps only what the backward reads without recomputing:
  // the layer inputs under full recompute, all but the attention core's tensors under
  // selective). The points come from the rank's Program, once: an event is one op of a compute
  // task (forward, recompute, a backward pass) or one communication task, in program order,
  // and each names the tensors it reads or makes (what forward(), backward() and the
  // communication tasks touch; a test runs plans with and without the early releases and finds
  // the same losses bit for bit).

  enum class Slot : std::uint8_t {
    Out,
    Grad,
    Aux1,
    Aux2,
    Full,
    FullGrad,
    Kv,
    KvGrad,
    Mask,
    Dropped,
    Route,
    GateGrad,
    CopyGrad,
    Logits
  };
  struct Use {
    Slot slot;
    OpId id;
    bool make;  // the event makes it afresh (an earlier copy is dead before it)
  };
  struct TensorRef {
    int micro_batch;
    Slot slot;
    OpId id;
    auto operator<=>(const TensorRef&) const = default;
  };

  static std::map<OpId, View>& slot_map(MicroBatch& mb, Slot slot) {
    return mb.*kTensorSlots[static_cast<std::size_t>(slot)];
  }

  // What forward(mb, id) reads and makes.
  std::vector<Use> forward_uses(OpId id) const;

  // What backward(mb, id, part) reads (gradients it adds into count as reads).
  std::vector<Use> backward_uses(OpId id, Part part) const;

  // What a communication task of a micro-batch reads and makes (a replayed one: the same).
  std::vector<Use> communication_uses(const lower::Task& task) const;

  // release_after_[e]: the tensors that event e reads last (nothing later in the step reads
  // them, or a later event makes them afresh first).
  void plan_releases();

  // ZeRO-3: release_weights_after_[i] names the weights that task i reads last before the
  // Program gathers them again (or the step ends): the compute tasks of their ops, and a tied
  // head's of the embedding table it reads. Checks that no task reads a gather's weights
  // before its first user waits for it.
  void plan_weight_releases();

  void release_weights(std::size_t task);

  // The end of an event: what it read last goes back to the device.
  void retire();

  // n zeros of the activation type.
  View allocate(std::int64_t n) { return dev_.allocate(n, dev_.activations()); }
  // n values of the activation type that the caller writes whole (Device::allocate_for_overwrite).
  View allocate_for_overwrite(std::int64_t n) {
    return dev_.allocate_for_overwrite(n, dev_.activations());
  }

  // v = n zeros (of the activation type, or `type`); what v held goes back to the device.
  void fresh(View& v, std::int64_t n, std::optional<Dtype> type = std::nullopt) {
    dev_.release(v);
    v = dev_.allocate(n, type.value_or(dev_.activations()));
  }
  // As fresh, for an op's output that its kernel writes whole: no zeros first (a pass over
  // memory that no framework's allocator makes and that dtsim does not price).
  void fresh_for_overwrite(View& v, std::int64_t n, std::optional<Dtype> type = std::nullopt) {
    dev_.release(v);
    v = dev_.allocate_for_overwrite(n, type.value_or(dev_.activations()));
  }

  // --only-rank: the buffers of replayed collectives started before task `index`, back to the
  // device (a collective's complete, as far as memory goes, once the task after it is done).
  void release_replayed(std::size_t index);

  // first_receives_ and next_receive_ from this rank's tasks.
  void plan_receive_streams();

  // A pipeline receive posted ahead of need, into its micro-batch's tensor.
  Comm::Handle post_receive(const lower::Task& task);

  // What a pipeline transfer of `tensor` sends and receives: all of it, or with scatter/gather
  // (plan.scatter_gather_p2p) this tp rank's 1/tp of it.
  View on_the_wire(View tensor) const;

  // Scatter/gather: the received slices of a pipeline tensor, all-gathered over tp into it.
  void gather_transferred(const lower::Task& task);

  // The tensor a send or receive carries: activations (even tags) are an op's output, gradients
  // (odd tags) the gradient of it.
  View& transferred(const lower::Task& task);

  // The global rank at the other end of a send or receive.
  int peer_rank(const lower::Task& task) const {
    return static_cast<int>(program_.ranks.at(static_cast<std::size_t>(task.peer)).rank);
  }

  // Where a gradient view starts in the rank's gradient buffer.
  std::int64_t offset_in_grads(View g) const {
    return (static_cast<const char*>(g.p) - static_cast<const char*>(grad_storage_.p)) /
           static_cast<std::int64_t>(bytes_of(Dtype::F32));
  }

  // --only-rank: a communication task waits its predicted length and moves no data.
  void replay(const lower::Task& task, std::size_t index);

  void execute(const lower::Task& task, std::size_t index);

  // ---- checkpoints -------------------------------------------------------------------------

  // Every rank writes its part of each full tensor (its tensor-parallel slice; its dp slice under
  // ZeRO >= 1, where only the owner's weights and AdamW state are current) to a shard of its
  // own; rank 0 then writes the index. The tied copy is the embedding and is not written twice;
  // unsharded, the first replica writes (an expert's: the first of its expert-dp group).
  bool in_checkpoint(const Param& p) const {
    return canonical_copy(p) && (sharded(p) || (p.expert ? ed_ : d_) == 0);
  }

  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }

  // A synchronous save: returns the step, and on rank 0 the bytes of the shards and their number.
  CheckpointRecord save(int steps_done, const std::vector<double>& losses);

  // Every rank's shard written (`index` this rank's): gathers the indices, which also says that
  // every shard is written, and the slowest rank's times; rank 0 writes checkpoint.json and
  // moves the folder into place.
  CheckpointRecord put_in_place(int step, const nlohmann::json& index, double copy_s,
                                double copied_bytes, double write_s, double blocking_s,
                                const std::vector<double>& losses);

  void checkpoint_done(const CheckpointRecord& record, RunResult& result) {
    result.checkpoints.push_back(record);
    if (options_.on_checkpoint) options_.on_checkpoint(record);
  }

  // An asynchronous save: the rank's pieces copied to host memory (training waits for this
  // alone), then written to its shard by a thread that touches nothing but that copy and the
  // file, so that every collective of the save stays on the training thread (no MPI from two
  // threads): each step's end tells every rank at once whether all shards are written
  // (writing()), and the first that does puts the checkpoint in place (put_async_in_place).
  // A parameter's piece (its name, slice and offset do not change during a run, so the writer
  // reads them too): weights at host[at], m at host[at + n], v at host[at + 2n].
  struct SnapshotPiece {
    const Param* p = nullptr;
    std::size_t at = 0, n = 0;
  };
  struct AsyncSave {
    bool active = false;  // a save between its copy and its index
    int step = 0;
    std::vector<double> losses;
    std::chrono::steady_clock::time_point started;
    double copy_s = 0, blocking_s = 0;
    std::vector<SnapshotPiece> pieces;
    // The copy, kept from one save to the next (as an asynchronous save keeps its host buffers).
    std::vector<float> host;
    // Set by the writer before `written`.
    nlohmann::json index;
    std::exception_ptr error;
    double write_s = 0;
    std::atomic<bool> written{false};
    std::jthread writer;  // declared last: joined before what it reads goes
  };

  // The host copy of an asynchronous save, allocated and touched once before the first step
  // (the first touch of fresh memory is slow: on this VM 1.4 GiB take 4 s), as a saver keeps
  // its (pinned) host buffers; its pieces are the same at every save.
  void prepare_async_saves(RunResult& result);

  bool writing() const { return async_.active && !async_.written.load(std::memory_order_acquire); }

  void start_async_save(int steps_done, RunResult& result);

  // Every rank's shard of the save in flight written (or, at its next save or the run's end,
  // waited for): puts it in place at the end of step `done`. A rank whose writer failed throws
  // its error here (the CLI then ends every rank).
  void put_async_in_place(int done, RunResult& result);

  int resume(RunResult& result);

  const model::ModelGraph& g_;
  const model::ModelSpec& m_;
  const lower::Program& program_;
  const plan::Plan& p_;
  RunOptions options_;
  Comm& comm_;
  Device& dev_;
  const lower::RankProgram* rp_ = nullptr;
  std::map<Key, Param> params_;
  View grad_storage_;  // every Param::grad, contiguous
  // ZeRO-1 in place: the weights gathered, in fp32 and as working copies (plan_flat_layout).
  View weight_storage_, work_storage_;
  View losses_;  // each micro-batch's mean loss (last stage)
  // Per micro-batch, the last task that reads it.
  std::vector<std::size_t> last_use_;
  // Collectives started and not yet finished, by task index.
  std::map<std::size_t, PendingCollective> pending_;
  // Measured times: the run's start, its task records, and the records of blocking sends not
  // yet known to be received.
  std::chrono::steady_clock::time_point t0_;
  std::vector<TaskRecord>* records_ = nullptr;
  Watchdog* watchdog_ = nullptr;  // run()'s, while it runs
  std::vector<std::size_t> open_sends_;
  // Receives posted ahead of need (overlapped pipeline transfers), by task index.
  std::map<std::size_t, Comm::Handle> posted_;
  // --only-rank: buffers of replayed collectives, by the task that started them.
  std::vector<std::pair<std::size_t, View>> replay_held_;
  // --only-rank: what a replayed receive gets, made once (replayed_input).
  View replay_input_;
  // Overlapped pipeline receives come in streams, one per peer, each in program order (NCCL
  // matches a peer's receives to its sends in the order they are issued, without tags): the
  // first task of each, and each task's next one.
  static constexpr std::size_t kNoTask = std::numeric_limits<std::size_t>::max();
  std::vector<std::size_t> first_receives_;
  std::vector<std::size_t> next_receive_;
  std::vector<int> next_;
  std::vector<MicroBatch> batches_;
  // The tensors each event of a step reads last (empty with RunOptions::keep_tensors), and the
  // step's next event.
  std::vector<std::vector<TensorRef>> release_after_;
  std::vector<std::vector<Key>> release_weights_after_;  // ZeRO-3, by task index
  std::size_t event_ = 0;
  int me_ = 0, tp_ = 1, dp_ = 1, t_ = 0, d_ = 0;
  // Expert parallelism: the degree and this rank's place in its ep group (it holds experts
  // [e_·E/ep_, (e_ + 1)·E/ep_)), and its expert-dp group (the ranks holding the same experts,
  // over which their gradients reduce and ZeRO shards them): size and place.
  int ep_ = 1, e_ = 0, edp_ = 1, ed_ = 0;
  // RunResult::expert_load and expert_load_peak: the micro-batches' loads so far.
  double expert_load_sum_ = 0, expert_load_peak_ = 0;
  std::int64_t expert_load_count_ = 0;
  // Context parallelism: the degree, this rank's place in it, its tokens of a sequence and
  // their positions, the keys' order (place_positions; empty views without cp); and the data
  // -parallel replica whose sequences the rank reads.
  int cp_ = 1, c_ = 0, Sq_ = 0, replica_ = 0;
  float dropout_ = 0;  // the model's dropout rate (kDropoutRate, or 0 without dropout)
  // The plan's attention is FlashAttention: the cores keep each row's log-sum-exp, not the
  // probabilities (Device::Attention::lse).
  bool flash_ = false;
  int step_ = 0;  // the step being run (dropout masks differ per step)
  View positions_, key_order_;
  std::vector<int> host_positions_;
  bool sharded_ = false, last_stage_ = false;
  bool transient_grads_ = false;  // ZeRO-2/3 (see Param)
  bool zero3_ = false;
  bool in_place_ = false;  // ZeRO-1 in place (plan zero_in_place)
  int Ts_ = 0;             // tokens of the sequence-parallel regions on this rank (T / tp with SP)
  // plan::moe_local_dispatch: each tp rank routes its Ts_ tokens (Tr_), else all T_ of them.
  bool local_dispatch_ = false;
  int Tr_ = 0;
  int B_ = 0, S_ = 0, T_ = 0, C_ = 0, V_ = 0, H_ = 0, G_ = 0, D_ = 0, Vl_ = 0;
  int Dv_ = 0;  // the values' head width (D_, but multi-head latent attention's)
  // Multi-head latent attention's widths (model::MlaSpec; 0 without it): the queries' and the
  // keys' and values' latents, a head's query and key columns without and with positions.
  int Rq_ = 0, Rkv_ = 0, Dn_ = 0, Dr_ = 0;
  int tokens_ = 0;
  int micro_batches_ = 1, adam_step_ = 0;
  View grad_norm_sq_;  // gradient clipping: the squared norm (fp32, one element)
  // Last: its writer is joined before anything else of the runner goes.
  AsyncSave async_;
};

}  // namespace dtsim::exec::runner_internal
