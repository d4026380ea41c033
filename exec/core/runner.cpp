#include "exec/core/runner.hpp"

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
#include "exec/core/slice.hpp"
#include "exec/cpu/device.hpp"
#include "exec/cpu/kernels.hpp"
#include "sim/cluster/placement.hpp"
#include "sim/common/error.hpp"

namespace dtsim::exec {

namespace {

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
  bool expert = false;     // an expert's (its gradient reduces over the expert-dp group)
  bool decays = false;     // AdamW's weight decay applies (a matrix: not a bias or a norm's)
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
  std::map<OpId, std::vector<int>> expert_rows;
  // Expert parallelism, by router (on the host): the copies this rank's experts received, as
  // rows per (sending ep member s, local expert l) at s·E/ep + l, in the order they arrived.
  std::map<OpId, std::vector<int>> ep_blocks;
  // The size of an output released before its gradient was made (the gradient has its shape).
  std::map<OpId, std::int64_t> released_out;
};

// A micro-batch's tensor maps, in the order of Runner::Slot.
constexpr std::array<std::map<OpId, View> MicroBatch::*, 12> kTensorSlots = {
    &MicroBatch::out,  &MicroBatch::grad,      &MicroBatch::aux1,  &MicroBatch::aux2,
    &MicroBatch::full, &MicroBatch::full_grad, &MicroBatch::kv,    &MicroBatch::kv_grad,
    &MicroBatch::mask, &MicroBatch::dropped,   &MicroBatch::route, &MicroBatch::gate_grad};

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
  Watchdog(const RunOptions& options, const lower::RankProgram& rp)
      : timeout_(options.task_timeout_s), on_hang_(options.on_hang), rp_(rp) {
    if (timeout_ <= 0 || !on_hang_) return;
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

  void begin(std::size_t task) {
    if (!thread_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = static_cast<std::int64_t>(task);
    since_ = std::chrono::steady_clock::now();
  }
  void end() {
    if (!thread_.joinable()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = -1;
  }

 private:
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stop_) {
      wake_.wait_for(lock, std::chrono::milliseconds(200));
      if (stop_ || task_ < 0) continue;
      const double held =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count();
      if (held > timeout_) {
        const auto& task = rp_.tasks[static_cast<std::size_t>(task_)];
        on_hang_(
            fmt::format("rank {}: task {} ({}) has not finished after {:.0f} s (timeout {:g} s); "
                        "a peer is missing or hung",
                        rp_.rank, task_, task.label, held, timeout_));
        return;
      }
    }
  }

  double timeout_;
  std::function<void(const std::string&)> on_hang_;
  const lower::RankProgram& rp_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::int64_t task_ = -1;
  std::chrono::steady_clock::time_point since_;
};

class Runner {
 public:
  Runner(const model::ModelGraph& g, const lower::Program& program, const RunOptions& options,
         Comm& comm, Device& device)
      : g_(g),
        m_(g.spec()),
        program_(program),
        p_(program.plan),
        options_(options),
        comm_(comm),
        dev_(device) {
    check_runnable(g, program, options.replay_communication);
    check_device(g, program, device);
    dropout_ = g.spec().dropout ? kDropoutRate : 0.0f;
    flash_ = g.attention() == model::AttentionKernel::Flash;
    if (comm.size() > 1 && !device.host_memory() && !comm.moves_device_memory()) {
      throw UnsupportedError(
          fmt::format("dtexec: {} ranks on {}: this communication backend moves host memory only",
                      comm.size(), device.name()));
    }
    me_ = options.program_index >= 0 ? options.program_index : comm.rank();
    DTSIM_ASSERT(me_ >= 0 && static_cast<std::size_t>(me_) < program.ranks.size(),
                 "rank outside the program");
    rp_ = &program.ranks[static_cast<std::size_t>(me_)];
    tp_ = static_cast<int>(p_.tp);
    dp_ = static_cast<int>(p_.dp * p_.cp);
    t_ = member_index(GroupKind::Tp);
    d_ = member_index(GroupKind::Dp);
    ep_ = static_cast<int>(p_.ep);
    e_ = ep_ > 1 ? member_index(GroupKind::Ep) : 0;
    edp_ = dp_ / ep_;
    ed_ = ep_ > 1 ? member_index(GroupKind::ExpertDp) : d_;
    sharded_ = p_.zero_stage >= 1 && dp_ > 1;
    transient_grads_ = sharded_ && p_.zero_stage >= 2;
    zero3_ = sharded_ && p_.zero_stage >= 3;
    in_place_ = sharded_ && p_.zero_in_place;
    DTSIM_ASSERT(!in_place_ || p_.zero_stage == 1, "ZeRO in place is ZeRO-1's (plan validation)");
    B_ = static_cast<int>(p_.micro_batch_size);
    S_ = static_cast<int>(p_.seq_len);
    cp_ = static_cast<int>(p_.cp);
    Sq_ = S_ / cp_;
    T_ = B_ * Sq_;
    Ts_ = p_.sequence_parallel ? T_ / static_cast<int>(p_.tp) : T_;
    C_ = static_cast<int>(m_.hidden);
    V_ = static_cast<int>(m_.vocab_rows());  // the embedding and LM head's rows (padded)
    tokens_ = static_cast<int>(m_.vocab);    // the data's vocabulary
    H_ = static_cast<int>(m_.heads / tp_);
    G_ = static_cast<int>(m_.kv_heads / tp_);
    D_ = static_cast<int>(m_.head_dim);
    F_ = static_cast<int>(m_.ffn_hidden / tp_);
    Vl_ = V_ / tp_;
    micro_batches_ = static_cast<int>(p_.micro_batches());
    last_stage_ = rp_->stage == p_.pp - 1;
    last_use_.assign(static_cast<std::size_t>(micro_batches_), std::size_t{0});
    for (std::size_t i = 0; i < rp_->tasks.size(); ++i) {
      const int mb = rp_->tasks[i].micro_batch;
      if (mb >= 0 && mb < micro_batches_) last_use_[static_cast<std::size_t>(mb)] = i;
    }
    {
      // The data-parallel replica (whose sequences this rank reads) and the context-parallel
      // rank (which of their positions), from the plan's placement of ranks.
      const cluster::Placement placement(p_.degrees(), p_.order);
      const cluster::RankCoords at = placement.coords(rp_->rank);
      c_ = at.cp;
      replica_ = at.dp_outer * static_cast<int>(p_.ep) + at.ep;
    }
    if (cp_ > 1) place_positions();
    init_params();
    if (!options.keep_tensors) plan_releases();
    plan_receive_streams();
    if (zero3_) plan_weight_releases();
    losses_ = dev_.allocate(micro_batches_, Dtype::F32);
    // A learnable stream: each token is followed by next_[token] nine times in ten.
    next_.resize(static_cast<std::size_t>(tokens_));
    for (int v = 0; v < tokens_; ++v) next_[static_cast<std::size_t>(v)] = v;
    std::mt19937_64 perm(options.seed ^ 0x9e3779b97f4a7c15ULL);
    std::shuffle(next_.begin(), next_.end(), perm);
  }

  RunResult run() {
    RunResult result;
    int first = 0;
    if (!options_.resume_dir.empty()) first = resume(result);
    result.first_step = first;
    t0_ = std::chrono::steady_clock::now();
    result.clock_origin_s = std::chrono::duration<double>(t0_.time_since_epoch()).count();
    records_ = &result.tasks;
    auto now = [&] { return since_start(std::chrono::steady_clock::now()); };
    const auto& tasks = rp_->tasks;
    Watchdog watchdog(options_, *rp_);
    if (options_.checkpoint_async && !options_.checkpoint_dir.empty()) prepare_async_saves(result);
    for (int step = first; step < options_.steps; ++step) {
      step_ = step;
      if (me_ == options_.fail_rank && step + 1 == options_.fail_step) std::raise(SIGKILL);
      if (me_ == options_.hang_rank && step + 1 == options_.hang_step) {
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      // A micro-batch's tensors live from its first task to its last (then released; what a
      // micro-batch without tasks here still holds goes back now).
      for (auto& mb : batches_) release(mb);
      batches_.assign(static_cast<std::size_t>(micro_batches_), MicroBatch{});
      for (int j = 0; j < micro_batches_; ++j)
        make_batch(batches_[static_cast<std::size_t>(j)], step, j);
      // Overlapped pipeline transfers: receives are posted ahead of need, as the simulator has
      // them (a receive without overlap is posted when it is reached): each peer's first now,
      // each next one when the one before it is taken (posting the whole step's at once would
      // hold a buffer per micro-batch; Megatron-LM posts one ahead too).
      if (program_.plan.overlap_p2p_comm && !options_.replay_communication) {
        for (const std::size_t i : first_receives_) posted_[i] = post_receive(tasks[i]);
      }
      dev_.zero(losses_);
      event_ = 0;
      // A device that queues work (a GPU stream) is timed with its own marks (CUDA events)
      // around each task, read once the step is done: no wait inside the step.
      const bool queued = !dev_.host_memory();
      const bool timed = step - first >= options_.warmup_steps;
      std::vector<std::array<int, 3>> marks;  // task, start mark, end mark
      if (queued) {
        dev_.synchronize();
        dev_.clear_marks();
      }
      const double begin = now();
      result.step_begins_s.push_back(begin);
      const int step_mark = queued ? dev_.mark() : -1;
      for (std::size_t i = 0; i < tasks.size(); ++i) {
        watchdog.begin(i);
        // A task starts once what it depends on is done, as the simulator's do: its time
        // leaves out the wait for earlier collectives and sends.
        settle(&tasks[i]);
        const double start = now();
        const int start_mark = queued ? dev_.mark() : -1;
        execute(tasks[i], i);
        if (tasks[i].kind != TaskKind::Compute) retire();
        release_weights(i);
        comm_.progress();
        watchdog.end();
        if (queued && timed) {
          marks.push_back({static_cast<int>(i), start_mark, dev_.mark()});
        } else if (timed) {
          result.tasks.push_back({rp_->rank, static_cast<std::int32_t>(i), start, now(), step});
          // A collective started here, and a blocking send, end when they complete (settle),
          // not when they are handed to the backend.
          if (auto it = pending_.find(i); it != pending_.end()) {
            it->second.record = result.tasks.size() - 1;
          }
          if (tasks[i].kind == TaskKind::Send && !program_.plan.overlap_p2p_comm &&
              !options_.replay_communication) {
            open_sends_.push_back(result.tasks.size() - 1);
          }
        }
        if (tasks[i].micro_batch >= 0 &&
            i == last_use_[static_cast<std::size_t>(tasks[i].micro_batch)]) {
          // Nothing later in the step reads this micro-batch: release its tensors.
          release(batches_[static_cast<std::size_t>(tasks[i].micro_batch)]);
        }
        finish_completed();
        release_replayed(i);
      }
      settle(nullptr);
      DTSIM_ASSERT(release_after_.empty() || event_ == release_after_.size(),
                   "the step's events differ from its plan of releases");
      release_replayed(tasks.size());
      comm_.wait_sends();
      close_sends();
      if (queued) {
        dev_.synchronize();
        for (const auto& [i, a, b] : marks) {
          result.tasks.push_back({rp_->rank, i, begin + dev_.elapsed(step_mark, a),
                                  begin + dev_.elapsed(step_mark, b), step});
        }
      }
      // Reported outside the step's timing and the Program: the step's loss (the mean over
      // micro-batches and data-parallel replicas, known on the last stage, where tensor-parallel
      // rank 0 reports it) and the slowest rank's time.
      std::array<double, 1> loss = {0.0};
      // With an asynchronous save in flight, whether this rank's shard is still being written
      // (reduced with the step's time: every rank learns at once that all are written).
      std::array<double, 2> slowest = {now() - begin, writing() ? 1.0 : 0.0};
      if (last_stage_ && t_ == 0) {
        std::vector<float> each(static_cast<std::size_t>(micro_batches_));
        dev_.download(each.data(), losses_);
        for (float l : each) loss[0] += l;
      }
      comm_.all_ranks(loss, Reduce::Sum);
      comm_.all_ranks(slowest, Reduce::Max);
      result.losses.push_back(loss[0] / (micro_batches_ * dp_));
      result.step_times_s.push_back(slowest[0]);
      double grad_norm = -1;
      if (p_.clip_grad > 0) {
        float squared = 0;
        dev_.download(&squared, grad_norm_sq_);
        grad_norm = std::sqrt(static_cast<double>(squared));
        result.grad_norms.push_back(grad_norm);
      }
      const int done = step + 1;
      if (options_.on_step) {
        options_.on_step(done, result.losses.back(), slowest[0], grad_norm);
      }
      if (async_.active && slowest[1] == 0) put_async_in_place(done, result);
      // A loss or gradient norm that is not finite ends the run, on every rank at once (both
      // are reduced over all ranks), as Megatron-LM's --check-for-nan-in-loss-and-grad does:
      // before this step's checkpoint is written (an earlier asynchronous one, complete, is put
      // in place first). The loss is the forward's, before this step's update: without
      // --clip-grad (no norm) gradients that overflow show in the next step's loss, after
      // this step's checkpoint. (Replayed communication feeds zeros: its losses mean nothing.)
      const double loss_now = result.losses.back();
      if (!options_.replay_communication &&
          !(std::isfinite(loss_now) && std::isfinite(grad_norm))) {
        const bool loss_bad = !std::isfinite(loss_now);
        throw InputError(fmt::format(
            "step {}: the {} is not finite ({}): training diverged; a smaller --lr (its peak "
            "is {:g}) or --clip-grad may keep it finite",
            done, loss_bad ? "loss" : "gradient norm", loss_bad ? loss_now : grad_norm,
            options_.lr.max_lr));
      }
      if (!options_.checkpoint_dir.empty() &&
          (done == options_.steps ||
           (options_.checkpoint_every > 0 && done % options_.checkpoint_every == 0))) {
        if (options_.checkpoint_async) {
          start_async_save(done, result);
        } else {
          const double started = now();
          CheckpointRecord record = save(done, result.losses);
          record.seconds = now() - started;
          record.blocking_s = record.seconds;
          record.write_s = std::max(0.0, record.seconds - record.copy_s);
          record.in_place_after = done;
          checkpoint_done(record, result);
        }
      }
    }
    // The last save, if still writing, is waited for: the run ends with it in place.
    if (async_.active) put_async_in_place(options_.steps, result);
    for (auto& mb : batches_) release(mb);
    batches_.clear();
    std::vector<double> timed(
        result.step_times_s.begin() +
            std::min<std::ptrdiff_t>(options_.warmup_steps,
                                     static_cast<std::ptrdiff_t>(result.step_times_s.size()) - 1),
        result.step_times_s.end());
    std::sort(timed.begin(), timed.end());
    result.step_time_s = timed.empty() ? 0 : timed[timed.size() / 2];
    result.expert_load = expert_load_count_ > 0 ? expert_load_sum_ / expert_load_count_ : 0.0;
    result.expert_load_peak = expert_load_peak_;
    return result;
  }

 private:
  // This rank's position in its group of `kind` (0 when it has none: degree 1).
  int member_index(GroupKind kind) const {
    for (const auto& grp : program_.groups) {
      if (grp.kind != kind) continue;
      const auto it = std::find(grp.ranks.begin(), grp.ranks.end(), rp_->rank);
      if (it != grp.ranks.end() && grp.ranks.size() > 1) {
        if (kind == GroupKind::Tp && static_cast<int>(grp.ranks.size()) != p_.tp) continue;
        if (kind == GroupKind::Dp && static_cast<int>(grp.ranks.size()) != p_.dp * p_.cp) continue;
        if (kind == GroupKind::Cp && static_cast<int>(grp.ranks.size()) != p_.cp) continue;
        return static_cast<int>(it - grp.ranks.begin());
      }
    }
    return 0;
  }

  // ---- parameters ----------------------------------------------------------------------

  // The ops of this rank's chunks (first chunk: the embedding; last: norm, head, loss).
  std::vector<OpId> my_ops() const {
    std::vector<OpId> ops;
    const auto chunks = plan::chunk_layers(p_, m_.layers);
    const int total = static_cast<int>(p_.pp * p_.virtual_stages);
    for (int c = 0; c < p_.virtual_stages; ++c) {
      const int k = c * static_cast<int>(p_.pp) + rp_->stage;
      int first = 0;
      for (int q = 0; q < k; ++q) first += chunks[static_cast<std::size_t>(q)];
      if (k == 0) {
        for (OpId id : g_.layer_ops(-1)) ops.push_back(id);
      }
      for (int l = first; l < first + chunks[static_cast<std::size_t>(k)]; ++l) {
        for (OpId id : g_.layer_ops(l)) ops.push_back(id);
      }
      if (k == total - 1) {
        for (OpId id : g_.layer_ops(static_cast<int>(m_.layers))) ops.push_back(id);
      }
    }
    return ops;
  }

  // The slices of an op's weight and bias on tensor-parallel rank t (empty: no such tensor).
  std::vector<std::pair<int, Slice>> slices(const Op& op, int t) const {
    const std::int64_t C = C_, V = V_, F = m_.ffn_hidden, D = D_;
    const std::int64_t Hf = m_.heads, Gf = m_.kv_heads, H = H_, G = G_, Fl = F_, Vl = Vl_;
    const int u = m_.activation == model::Activation::SwiGlu ? 2 : 1;
    auto cols = [](std::int64_t rows, std::int64_t ncols,
                   std::vector<std::pair<std::int64_t, std::int64_t>> ranges) {
      return Slice{rows, ncols, 0, rows, std::move(ranges)};
    };
    auto rows = [](std::int64_t nrows, std::int64_t ncols, std::int64_t begin, std::int64_t count) {
      return Slice{nrows, ncols, begin, count, {{0, ncols}}};
    };
    std::vector<std::pair<int, Slice>> out;
    const bool has_bias = [&] {
      switch (op.kind) {
        case OpKind::QkvProj:
          return m_.bias.qkv;
        case OpKind::AttnOutProj:
          return m_.bias.attn_out;
        case OpKind::MlpUp:
        case OpKind::MlpDown:
          return m_.bias.mlp;
        default:
          return false;
      }
    }();
    switch (op.kind) {
      case OpKind::Embedding:
        out.push_back({0, rows(V, C, t * Vl, Vl)});
        if (m_.positions == model::Positions::Learned) {
          out.push_back({1, whole(m_.max_positions, C)});
        }
        break;
      case OpKind::Norm:
        out.push_back({0, whole(1, C)});
        if (op.params > static_cast<std::uint64_t>(C)) out.push_back({1, whole(1, C)});
        break;
      case OpKind::QkvProj: {
        const std::int64_t N = (Hf + 2 * Gf) * D;
        std::vector<std::pair<std::int64_t, std::int64_t>> r = {
            {t * H * D, H * D}, {Hf * D + t * G * D, G * D}, {(Hf + Gf) * D + t * G * D, G * D}};
        out.push_back({0, cols(C, N, r)});
        if (has_bias) out.push_back({1, cols(1, N, r)});
        break;
      }
      case OpKind::AttnOutProj:
        out.push_back({0, rows(Hf * D, C, t * H * D, H * D)});
        if (has_bias) out.push_back({1, whole(1, C)});
        break;
      case OpKind::MlpUp:
      case OpKind::MlpDown: {
        // An MoE block's experts: one weight (and bias) each, expert e's as tensors 2e and
        // 2e + 1, each split over tp as the dense MLP's.
        const std::int64_t experts = op.expert ? m_.moe->experts : 1;
        const std::int64_t Fw = op.expert ? m_.moe->expert_ffn_hidden : F;
        const std::int64_t Fwl = op.expert ? Fw / tp_ : Fl;
        for (int e = 0; e < experts; ++e) {
          if (op.kind == OpKind::MlpUp) {
            std::vector<std::pair<std::int64_t, std::int64_t>> r = {{t * Fwl, Fwl}};
            if (u == 2) r.push_back({Fw + t * Fwl, Fwl});
            out.push_back({2 * e, cols(C, Fw * u, r)});
            if (has_bias) out.push_back({2 * e + 1, cols(1, Fw * u, r)});
          } else {
            out.push_back({2 * e, rows(Fw, C, t * Fwl, Fwl)});
            if (has_bias) out.push_back({2 * e + 1, whole(1, C)});
          }
        }
        break;
      }
      case OpKind::LmHead:
        if (op.params == 0) {
          // Tied: the head uses the embedding; on a stage without it, a copy of it.
          if (p_.pp > 1) out.push_back({0, rows(V, C, t * Vl, Vl)});
        } else {
          out.push_back({0, cols(C, V, {{t * Vl, Vl}})});
          if (op.params > static_cast<std::uint64_t>(C * V)) {
            out.push_back({1, cols(1, V, {{t * Vl, Vl}})});
          }
        }
        break;
      case OpKind::Router:  // h x experts, the same on every tensor-parallel rank
        out.push_back({0, whole(C, m_.moe->experts)});
        break;
      default:
        break;
    }
    return out;
  }

  // This rank's slice of a tensor's initial values: N(0, 0.02) for matrices, 1 for norm
  // weights, 0 for biases (GPT-2's initialisation without its residual scaling). Element i of
  // the full tensor is drawn from a counter-based stream of (seed, op, which, i), so that a rank
  // computes only its own slice and every split of the tensor sees the same values.
  std::vector<float> initial(OpId id, int which, const Slice& s) const {
    const Op& op = g_.op(id);
    std::vector<float> local(static_cast<std::size_t>(s.local_size()), 0.0f);
    const bool matrix = op.kind == OpKind::Embedding || (which % 2 == 0 && op.kind != OpKind::Norm);
    if (op.kind == OpKind::Norm) {
      std::fill(local.begin(), local.end(), which == 0 ? 1.0f : 0.0f);
    } else if (matrix) {
      const std::uint64_t stream = counter_hash(options_.seed, static_cast<std::uint64_t>(id),
                                                static_cast<std::uint64_t>(which));
      for_pieces(s.local_size(), [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t i = begin; i < end; ++i) {
          local[static_cast<std::size_t>(i)] = 0.02f * standard_normal(stream, s.full_index(i));
        }
      });
    }
    return local;
  }

  // A standard normal from (stream, index): two uniforms in (0, 1] from the splitmix64 of the
  // pair, then Box and Muller's transform (1958).
  static float standard_normal(std::uint64_t stream, std::int64_t index) {
    const std::uint64_t bits =
        counter_hash(stream, static_cast<std::uint64_t>(index), 0x6e6f726dULL);
    const double u1 = (static_cast<double>(bits >> 32) + 1.0) / 4294967296.0;
    const double u2 = (static_cast<double>(bits & 0xffffffffULL) + 1.0) / 4294967296.0;
    constexpr double kTwoPi = 6.283185307179586;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
  }

  void init_params() {
    const OpId embedding = g_.layer_ops(-1).front();
    const std::map<Key, Param::Flat> flat =
        in_place_ ? plan_flat_layout() : std::map<Key, Param::Flat>{};
    for (OpId id : my_ops()) {
      const Op& op = g_.op(id);
      std::uint64_t have = 0;
      for (auto& [which, slice] : slices(op, t_)) {
        if (op.expert && !local_expert(which / 2)) continue;  // another ep rank's
        Param p;
        p.slice = slice;
        p.tied_copy = op.kind == OpKind::LmHead && op.params == 0;
        p.norm = op.kind == OpKind::Norm;
        // AdamW's weight decay: matrices and embedding tables (the learned positions are the
        // embedding's second tensor), not biases or norms' weights (Megatron-LM's
        // no_weight_decay_cond: ".bias" and 1-D parameters).
        p.decays = !p.norm && (which % 2 == 0 || op.kind == OpKind::Embedding);
        // The copy starts from (and is saved as) the embedding matrix.
        const OpId source = p.tied_copy ? embedding : id;
        p.expert = op.expert;
        p.name = tensor_name(source, which);
        const std::vector<float> values = initial(source, which, slice);
        const auto n = static_cast<std::int64_t>(values.size());
        p.n = n;
        const int shards = op.expert ? edp_ : dp_, mine = op.expert ? ed_ : d_;
        p.own_begin = sharded_ ? n * mine / shards : 0;
        p.own_end = sharded_ ? n * (mine + 1) / shards : n;
        if (in_place_) {
          p.flat = flat.at({id, which});
          std::tie(p.own_begin, p.own_end) = flat_slice(p, mine);
        }
        const std::int64_t own = p.own_end - p.own_begin;
        p.separate_work = dev_.activations() != Dtype::F32 && gemm_weight(op, which);
        p.work_only = work_only(op, which);
        if (sharded_master(p)) p.shard = dev_.allocate(own, Dtype::F32);
        if (!zero3_) {
          // In place, the tensors gathered lie in one buffer per type, in the gradients' order.
          const auto place = [&](View storage, Dtype type) {
            return in_place_ ? storage.sub(p.flat.weight_at, n) : dev_.allocate(n, type);
          };
          p.work = p.separate_work ? (p.work_only ? place(work_storage_, dev_.activations())
                                                  : dev_.allocate(n, dev_.activations()))
                                   : View{};
          if (!p.work_only || !sharded_) p.data = place(weight_storage_, Dtype::F32);
          if (!p.separate_work) p.work = p.data;
        }
        load_weights(p, values.data());
        p.m = dev_.allocate(own, Dtype::F32);
        p.v = dev_.allocate(own, Dtype::F32);
        p.replicated_over_tp = slice.whole();
        if (!p.tied_copy) have += static_cast<std::uint64_t>(slice.rows * slice.cols);
        params_.emplace(Key{id, which}, std::move(p));
      }
      // An expert op's tensors: this rank's experts only.
      const std::uint64_t expected =
          op.expert ? op.params / static_cast<std::uint64_t>(ep_) : op.params;
      DTSIM_ASSERT(have == expected, fmt::format("parameters of {}: {} allocated, graph says {}",
                                                 op.name, have, expected));
    }
    if (!transient_grads_) {
      std::int64_t total = 0;
      for (const auto& [key, p] : params_) total += p.n;
      grad_storage_ = dev_.allocate(total, Dtype::F32);
      // Dense tensors first, then experts': a bucket of either kind (a range of ops, reduced
      // over its own group) is one contiguous piece.
      std::int64_t at = 0;
      for (const bool experts : {false, true}) {
        for (auto& [key, p] : params_) {
          if (p.expert != experts) continue;
          DTSIM_ASSERT(!in_place_ || p.flat.at == at, "ZeRO in place: the gradient buffer's order");
          p.grad = grad_storage_.sub(at, p.n);
          at += p.n;
        }
      }
    }
    for (auto& [key, p] : params_) {
      if (sharded_) {
        p.reduced = transient_grads_ ? dev_.allocate(p.own_end - p.own_begin, Dtype::F32)
                                     : p.grad.sub(p.own_begin, p.own_end - p.own_begin);
      }
    }
  }

  // The GEMMs' copy, in the activation type, of the weights they read (linear layers and a
  // tied head's table); other tensors are read as their fp32 master.
  bool gemm_weight(const Op& op, int which) const {
    return (which == 0 && (op.kind == OpKind::QkvProj || op.kind == OpKind::AttnOutProj ||
                           op.kind == OpKind::LmHead || op.kind == OpKind::Router ||
                           (op.kind == OpKind::Embedding && m_.tied_embeddings))) ||
           (which % 2 == 0 && (op.kind == OpKind::MlpUp || op.kind == OpKind::MlpDown));
  }
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
  std::map<Key, Param::Flat> plan_flat_layout() {
    struct Tensor {
      std::int64_t n = 0;
      bool expert = false, work_only = false;
    };
    std::map<Key, Tensor> tensors;
    for (OpId id : my_ops()) {
      const Op& op = g_.op(id);
      for (auto& [which, slice] : slices(op, t_)) {
        if (op.expert && !local_expert(which / 2)) continue;
        tensors[{id, which}] = {slice.local_size(), op.expert, work_only(op, which)};
      }
    }
    std::map<Key, Param::Flat> flat;
    std::int64_t at = 0;
    std::array<std::int64_t, 2> weights = {0, 0};  // fp32, working copies
    for (const bool experts : {false, true}) {
      for (const auto& [key, t] : tensors) {
        if (t.expert != experts) continue;
        std::int64_t& w = weights[t.work_only ? 1 : 0];
        flat[key] = {.at = at, .weight_at = w};
        at += t.n;
        w += t.n;
      }
    }
    // The tied embedding table of a pipeline (the first stage's and the last stage's copy,
    // whose reduced slices the stages then sum) is a bucket of its own, so that both stages
    // cut it alike, as Megatron-LM gives its shared embedding a bucket of its own under the
    // distributed optimizer.
    std::set<Key> tied;
    for (const lower::Task& task : rp_->tasks) {
      if (task.kind == TaskKind::Collective &&
          program_.groups.at(static_cast<std::size_t>(task.group)).kind == GroupKind::Pp) {
        tied.insert({static_cast<OpId>(task.op_begin), 0});
      }
    }
    for (const lower::Task& task : rp_->tasks) {
      if (task.kind != TaskKind::Collective || !is_dp_group(task) ||
          task.collective != CollectiveKind::ReduceScatter) {
        continue;
      }
      const std::vector<Key> keys = keys_of_tensors(tensors, task);
      for (std::size_t i = 0; i < keys.size();) {
        // A run of the task's tensors up to a tied table, or the table alone.
        std::size_t j = i + 1;
        if (tied.count(keys[i]) == 0) {
          while (j < keys.size() && tied.count(keys[j]) == 0) ++j;
        }
        const std::int64_t begin = flat.at(keys[i]).at;
        std::int64_t size = 0;
        for (std::size_t k = i; k < j; ++k) {
          DTSIM_ASSERT(flat.at(keys[k]).at == begin + size,
                       "ZeRO in place: a bucket is contiguous");
          size += tensors.at(keys[k]).n;
        }
        for (std::size_t k = i; k < j; ++k) {
          Param::Flat& f = flat.at(keys[k]);
          DTSIM_ASSERT(f.shards == 0 || (f.bucket_begin == begin && f.bucket_size == size),
                       "ZeRO in place: a tensor in two buckets");
          f.bucket_begin = begin;
          f.bucket_size = size;
          f.shards = shards_of(task).first;
        }
        i = j;
      }
    }
    for (const auto& [key, f] : flat) {
      DTSIM_ASSERT(f.shards > 0, fmt::format("ZeRO in place: {} is in no gradient bucket",
                                             g_.op(key.first).name));
    }
    weight_storage_ = dev_.allocate(weights[0], Dtype::F32);
    if (weights[1] > 0) work_storage_ = dev_.allocate(weights[1], dev_.activations());
    return flat;
  }
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
  static std::pair<std::int64_t, std::int64_t> flat_slice(const Param& p, int r) {
    const Param::Flat& f = p.flat;
    const std::int64_t lo = f.bucket_begin + f.bucket_size * r / f.shards - f.at;
    const std::int64_t hi = f.bucket_begin + f.bucket_size * (r + 1) / f.shards - f.at;
    const std::int64_t begin = std::clamp<std::int64_t>(lo, 0, p.n);
    return {begin, std::clamp<std::int64_t>(hi, begin, p.n)};
  }

  // Whether the fp32 master of a tensor is this rank's dp slice only (Param::shard).
  bool sharded_master(const Param& p) const { return zero3_ || (sharded_ && p.work_only); }

  // A tensor's weights set from the whole tp slice `full` (initial, or read from a checkpoint):
  // its master (slice), and what the GEMMs read, except under ZeRO-3 (its gathers make it).
  void load_weights(Param& p, const float* full) {
    if (sharded_master(p)) dev_.upload(p.shard, full + p.own_begin);
    if (zero3_) return;
    if (p.data.empty()) {  // a work_only tensor at ZeRO-1/2: its working copy alone is whole
      const View staging = dev_.allocate_for_overwrite(p.n, Dtype::F32);
      dev_.upload(staging, full);
      dev_.cast(p.work, staging);
      dev_.release(staging);
      return;
    }
    dev_.upload(p.data, full);
    refresh_work(p);
  }

  // A tensor's name in checkpoints and messages: "L3.qkv.weight", "L0.experts_up.e2.bias"
  // (expert e's weight and bias are tensors 2e and 2e + 1).
  std::string tensor_name(OpId id, int which) const {
    const Op& op = g_.op(id);
    return fmt::format("{}.{}{}", op.name, op.expert ? fmt::format("e{}.", which / 2) : "",
                       which % 2 == 0 ? "weight" : "bias");
  }

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
  Param& param(OpId id, int which) {
    Param* p = find(id, which);
    DTSIM_ASSERT(p != nullptr,
                 fmt::format("rank {} holds no tensor {} of {}", me_, which, g_.op(id).name));
    return *p;
  }
  View bias_in(OpId id, int which = 1) {
    Param* b = find(id, which);
    return b ? b->data : View{};
  }
  View bias_grad(OpId id, int which = 1) {
    Param* b = find(id, which);
    return b ? grad(*b) : View{};
  }

  // The parameters of ops [begin, end) that this rank holds, in a fixed order.
  std::vector<Param*> params_of(std::int32_t begin, std::int32_t end) {
    std::vector<Param*> out;
    for (auto it = params_.lower_bound({static_cast<OpId>(begin), 0});
         it != params_.end() && it->first.first < static_cast<OpId>(end); ++it) {
      out.push_back(&it->second);
    }
    return out;
  }
  std::vector<Key> keys_of(std::int32_t begin, std::int32_t end) const {
    std::vector<Key> out;
    for (auto it = params_.lower_bound({static_cast<OpId>(begin), 0});
         it != params_.end() && it->first.first < static_cast<OpId>(end); ++it) {
      out.push_back(it->first);
    }
    return out;
  }
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
  bool holds_weights(OpId id) const {
    const Op& op = g_.op(id);
    const int first = op.expert ? 2 * e_ * static_cast<int>(m_.moe->experts / ep_) : 0;
    return params_.count({id, first}) > 0;
  }
  // Whether expert e is this rank's (expert parallelism gives each ep rank E/ep of them).
  bool local_expert(int e) const { return e / static_cast<int>(m_.moe->experts / ep_) == e_; }
  std::vector<Param*> params_for(const lower::Task& task) {
    auto out = task.op_end > task.op_begin ? params_of(task.op_begin, task.op_end)
                                           : params_of(0, static_cast<std::int32_t>(g_.size()));
    std::erase_if(out, [&](const Param* p) { return p->expert != expert_group(task); });
    return out;
  }
  std::vector<Key> keys_for(const lower::Task& task) const {
    auto out = keys_of(task.op_begin, task.op_end);
    std::erase_if(out, [&](const Key& k) { return params_.at(k).expert != expert_group(task); });
    return out;
  }

  // ---- data ------------------------------------------------------------------------------

  // Context parallelism splits each sequence into 2·cp chunks and gives cp rank c chunks c and
  // 2·cp-1-c (Megatron-LM's load balancing of causal attention: every rank gets as many early
  // as late positions). positions_: the position of each of the rank's Sq tokens of a sequence;
  // key_order_: for each position, the key's index among a sequence's all-gathered cp·Sq keys.
  void place_positions() {
    const int chunk = S_ / (2 * cp_);
    std::vector<int> positions(static_cast<std::size_t>(Sq_));
    std::vector<int> order(static_cast<std::size_t>(S_));
    for (int p = 0; p < S_; ++p) {
      const int k = p / chunk;
      const int owner = k < cp_ ? k : 2 * cp_ - 1 - k;
      const int s = (k < cp_ ? 0 : chunk) + p % chunk;
      order[static_cast<std::size_t>(p)] = owner * Sq_ + s;
      if (owner == c_) positions[static_cast<std::size_t>(s)] = p;
    }
    positions_ = dev_.allocate(Sq_, Dtype::I32);
    key_order_ = dev_.allocate(S_, Dtype::I32);
    dev_.upload_ints(positions_, positions.data());
    dev_.upload_ints(key_order_, order.data());
    host_positions_ = std::move(positions);
  }

  // Micro-batch j of data-parallel replica d holds sequences (d·m + j)·b ... of the step's
  // global batch, so that any dp and micro-batch split of a global batch sees the same data;
  // under context parallelism a rank keeps its positions of them.
  void make_batch(MicroBatch& mb, int step, int j) {
    mb.index = j;
    std::vector<int> tokens(static_cast<std::size_t>(B_ * S_));
    std::vector<int> targets(static_cast<std::size_t>(B_ * S_));
    for (int b = 0; b < B_; ++b) {
      const auto sequence = static_cast<std::uint64_t>((replica_ * micro_batches_ + j) * B_ + b);
      std::mt19937_64 gen(
          counter_hash(options_.seed, static_cast<std::uint64_t>(step) + 0x5eed, sequence));
      std::uniform_int_distribution<int> token(0, tokens_ - 1);
      std::uniform_real_distribution<float> coin(0.0f, 1.0f);
      int t = token(gen);
      for (int s = 0; s < S_; ++s) {
        const int next = coin(gen) < 0.9f ? next_[static_cast<std::size_t>(t)] : token(gen);
        tokens[static_cast<std::size_t>(b * S_ + s)] = t;
        targets[static_cast<std::size_t>(b * S_ + s)] = next;
        t = next;
      }
    }
    if (cp_ > 1) {
      for (int b = 0; b < B_; ++b) {
        for (int s = 0; s < Sq_; ++s) {
          const auto from = static_cast<std::size_t>(b * S_ + host_positions_[s]);
          tokens[static_cast<std::size_t>(b * Sq_ + s)] = tokens[from];
          targets[static_cast<std::size_t>(b * Sq_ + s)] = targets[from];
        }
      }
    }
    mb.tokens = dev_.allocate(T_, Dtype::I32);
    mb.targets = dev_.allocate(T_, Dtype::I32);
    dev_.upload_ints(mb.tokens, tokens.data());
    dev_.upload_ints(mb.targets, targets.data());
  }

  // ---- compute ---------------------------------------------------------------------------

  View& grad_of(MicroBatch& mb, OpId id) {
    auto& gbuf = mb.grad[id];
    if (gbuf.empty()) {
      const auto out = mb.out.find(id);
      fresh(gbuf, out != mb.out.end() ? out->second.size() : mb.released_out.at(id));
    }
    return gbuf;
  }

  OpId input(OpId id) const { return g_.predecessors(id).front(); }

  // An op's input: the all-gathered copy where sequence parallelism made one.
  View input_of(MicroBatch& mb, OpId id) {
    const OpId in = input(id);
    return gathers_input(g_.op(id)) ? mb.full.at(in) : mb.out.at(in);
  }
  // The gradient buffer of an op's input: the whole sequence's where sequence parallelism
  // gathers that input (the forward may have released the gathered copy: zero-bubble's
  // input-gradient pass runs before it is gathered again).
  View& input_grad_of(MicroBatch& mb, OpId id) {
    const OpId in = input(id);
    if (!gathers_input(g_.op(id))) return grad_of(mb, in);
    auto& g = mb.full_grad[in];
    if (g.empty()) fresh(g, static_cast<std::int64_t>(T_) * C_);
    return g;
  }
  // Sequence parallelism all-gathers the input of a column-parallel layer (the lowering's
  // TpEnter markers: QKV, MLP up, the LM head).
  bool gathers_input(const Op& op) const {
    return Ts_ != T_ && (op.kind == OpKind::QkvProj || (op.kind == OpKind::MlpUp && !op.expert) ||
                         op.kind == OpKind::Router || op.kind == OpKind::LmHead);
  }

  // Local GEMM shape (K, N) of a linear op on this tensor-parallel rank.
  std::pair<int, int> gemm_shape(const Op& op) const {
    const int u = m_.activation == model::Activation::SwiGlu ? 2 : 1;
    switch (op.kind) {
      case OpKind::QkvProj:
        return {C_, (H_ + 2 * G_) * D_};
      case OpKind::AttnOutProj:
        return {H_ * D_, C_};
      case OpKind::MlpUp:
        return {C_, (op.expert ? expert_ffn() : F_) * u};
      case OpKind::MlpDown:
        return {op.expert ? expert_ffn() : F_, C_};
      case OpKind::LmHead:
        return {C_, Vl_};
      default:
        DTSIM_ASSERT(false, "not a linear op");
        return {0, 0};
    }
  }

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

  void forward(MicroBatch& mb, OpId id) {
    const Op& op = g_.op(id);
    auto& out = mb.out[id];
    switch (op.kind) {
      case OpKind::Embedding: {
        fresh(out, static_cast<std::int64_t>(T_) * C_);
        // Positions are added once: by tensor-parallel rank 0, before the all-reduce.
        dev_.embedding_forward(out, mb.tokens, param(id, 0).data, t_ == 0 ? bias_in(id) : View{},
                               B_, Sq_, C_, t_ * Vl_, positions_);
        // Its dropout applies to the whole sum: here on one tensor-parallel rank, else after
        // the Program's reduction (embedding_dropout).
        if (tp_ == 1) embedding_dropout(mb, id);
        break;
      }
      case OpKind::Norm: {
        // Norms run on this rank's share of the sequence under sequence parallelism.
        fresh(out, static_cast<std::int64_t>(Ts_) * C_);
        fresh(mb.aux1[id], Ts_, Dtype::F32);  // mean
        fresh(mb.aux2[id], Ts_, Dtype::F32);  // 1 / standard deviation
        dev_.norm_forward(out, mb.aux1[id], mb.aux2[id], mb.out.at(input(id)), param(id, 0).data,
                          bias_in(id), Ts_, C_, m_.norm == model::Norm::RmsNorm);
        break;
      }
      case OpKind::QkvProj:
      case OpKind::AttnOutProj:
      case OpKind::MlpUp:
      case OpKind::MlpDown:
      case OpKind::LmHead: {
        if (op.expert) {
          experts_forward(mb, id);
          break;
        }
        const auto [K, N] = gemm_shape(op);
        fresh(out, static_cast<std::int64_t>(T_) * N);
        // A row-parallel op's bias is added once, by tensor-parallel rank 0.
        const View bias = row_parallel(op) && t_ != 0 ? View{} : bias_in(id);
        const bool tied = tied_head(op);
        dev_.matmul_forward(out, input_of(mb, id), tied ? tied_table(id).work : param(id, 0).work,
                            bias, T_, K, N, tied);
        // Sequence parallelism keeps only the rank's share of a column-parallel layer's input:
        // the backward gathers it again (the Program's Backward-phase all-gather).
        if (const auto it = mb.full.find(input(id)); it != mb.full.end()) {
          dev_.release(it->second);
          mb.full.erase(it);
        }
        break;
      }
      case OpKind::AttentionCore: {
        fresh(out, static_cast<std::int64_t>(T_) * H_ * D_);
        // What the backward reads: the probabilities, or FlashAttention's log-sum-exp of each
        // row (fp32).
        const std::int64_t rows = static_cast<std::int64_t>(B_) * H_ * Sq_;
        if (flash_) {
          fresh(mb.aux1[id], rows, Dtype::F32);
        } else {
          fresh(mb.aux1[id], rows * S_);
        }
        View q = mb.out.at(input(id));
        if (m_.positions == model::Positions::Rope) {
          // Rotary positions are applied to q and k as the attention core reads them.
          auto& turned = mb.aux2[id];
          fresh(turned, q.size());
          dev_.rope_forward(turned, q, B_, Sq_, H_, G_, D_, m_.rope_theta, positions_);
          q = turned;
        }
        if (cp_ > 1 || dropout_ > 0 || flash_) {
          const Device::DropoutSite site = dropout_site(mb, op.layer, kAttentionDropout, 0);
          Device::Attention a = attention_extras(mb, id, dropout_ > 0 ? &site : nullptr);
          if (dropout_ > 0 && !flash_) {
            fresh(mb.mask[id], mb.aux1[id].size(), Dtype::U8);
            fresh(mb.dropped[id], mb.aux1[id].size());
            a.mask = mb.mask[id];
            a.dropped = mb.dropped[id];
          }
          if (flash_) a.lse = mb.aux1[id];
          dev_.attention_forward_ex(out, flash_ ? View{} : mb.aux1[id], q, B_, Sq_, H_, G_, D_, a);
        } else {
          dev_.attention_forward(out, mb.aux1[id], q, B_, S_, H_, G_, D_);
        }
        break;
      }
      case OpKind::Residual: {
        const auto preds = g_.predecessors(id);
        const View a = mb.out.at(preds[0]);
        const View b = mb.out.at(preds[1]);
        fresh(out, a.size());
        if (dropout_ > 0) {
          // The branch (the attention or MLP block's output) is dropped out, the skip is not.
          const int rows = static_cast<int>(a.size() / C_);
          fresh(mb.mask[id], a.size(), Dtype::U8);
          dev_.dropout_add_forward(
              out, mb.mask[id], a, b,
              dropout_site(mb, op.layer, residual_site(preds[0]), rows == T_ ? 0 : t_ * Ts_), rows,
              C_);
        } else {
          dev_.add_forward(out, a, b);
        }
        break;
      }
      case OpKind::Activation: {
        const View in = mb.out.at(input(id));
        if (m_.activation == model::Activation::Gelu) {
          fresh(out, in.size());
          dev_.gelu_forward(out, in);
        } else {
          // Experts: the copies they compute on.
          const auto rows = static_cast<int>(op.expert ? expert_copies(mb, router_of(id)) : T_);
          const int F = op.expert ? expert_ffn() : F_;  // (an ep rank's experts may get no rows)
          fresh(out, static_cast<std::int64_t>(rows) * F);
          dev_.swiglu_forward(out, in, rows, F);
        }
        break;
      }
      case OpKind::Loss: {
        const View logits = mb.out.at(input(id));
        fresh(mb.aux1[id], logits.size());  // the logits' gradient, kept for backward
        const View loss = losses_.sub(mb.index, 1);
        if (tp_ == 1) {
          dev_.cross_entropy(mb.aux1[id], loss, logits, mb.targets, T_, V_);
        } else {
          // The statistics were reduced over tp by the task before this one.
          const View stats = mb.aux2.at(id);
          dev_.cross_entropy_sharded(mb.aux1[id], loss, logits, stats.sub(0, T_),
                                     stats.sub(T_, 2 * T_), mb.targets, T_, Vl_, t_ * Vl_);
        }
        break;
      }
      case OpKind::Router:
        router_forward(mb, id);
        break;
    }
  }

  // ---- dropout -----------------------------------------------------------------------------

  // A dropout site of micro-batch mb: its stream (seed, step, layer, site), its sequences, and
  // where a residual-stream tensor's rows start among the micro-batch's (sequence parallelism).
  Device::DropoutSite dropout_site(const MicroBatch& mb, int layer, int site, int first_row) const {
    Device::DropoutSite d;
    d.stream = counter_hash(options_.seed ^ 0x64726f706f7574ULL, static_cast<std::uint64_t>(step_),
                            static_cast<std::uint64_t>((layer + 1) * 4 + site));
    d.rate = dropout_;
    d.first_sequence = static_cast<std::int64_t>(replica_ * micro_batches_ + mb.index) * B_;
    d.first_row = first_row;
    d.Sq = Sq_;
    d.positions = positions_;
    d.head_offset = t_ * H_;
    return d;
  }

  int residual_site(OpId branch) const {
    const OpKind kind = g_.op(branch).kind;
    DTSIM_ASSERT(kind == OpKind::AttnOutProj || kind == OpKind::MlpDown,
                 "a residual's first input is its block's output");
    return kind == OpKind::AttnOutProj ? kAttnResidual : kMlpResidual;
  }

  // The embedding's dropout, once its output is whole (after the tensor-parallel reduction;
  // the rank's share of the sequence under sequence parallelism).
  void embedding_dropout(MicroBatch& mb, OpId id) {
    if (dropout_ == 0) return;
    View& out = mb.out.at(id);
    const int rows = static_cast<int>(out.size() / C_);
    fresh(mb.mask[id], out.size(), Dtype::U8);
    dev_.dropout_forward(out, mb.mask[id], out,
                         dropout_site(mb, -1, kEmbeddingDropout, rows == T_ ? 0 : t_ * Ts_), rows,
                         C_);
  }

  // What the attention core adds to attention_forward: context parallelism's keys, and its
  // dropout (`site`, or none; the masks are the caller's).
  Device::Attention attention_extras(MicroBatch& mb, OpId id, const Device::DropoutSite* site) {
    Device::Attention a;
    if (cp_ > 1) a.kv = mb.kv.at(id);
    a.cp = cp_;
    a.qpos = positions_;
    a.order = key_order_;
    a.dropout = site;
    return a;
  }

  // Which gradients a backward computes: both, or (zero-bubble) the input gradients in the B
  // pass and the weight gradients in the later W pass.
  enum class Part { Both, Input, Weight };
  static Part part_of(Phase phase) {
    return phase == Phase::BackwardInput    ? Part::Input
           : phase == Phase::BackwardWeight ? Part::Weight
                                            : Part::Both;
  }

  void backward(MicroBatch& mb, OpId id, Part part = Part::Both) {
    const Op& op = g_.op(id);
    const bool input_grads = part != Part::Weight;
    const bool weight_grads = part != Part::Input;
    // Ops without weights do all their work in the input pass.
    const bool has_weights = holds_weights(id) || tied_head(op);
    if (!has_weights && !input_grads) return;
    switch (op.kind) {
      case OpKind::Loss: {
        // The step's loss is the mean over micro-batches and data-parallel replicas: scale each
        // micro-batch's gradient by 1/(m·dp); the dp reduction sums.
        const float scale = 1.0f / static_cast<float>(micro_batches_ * dp_);
        View& dlogits = mb.grad[input(id)];
        if (dlogits.empty()) {
          // The head's output gradient is the loss's, scaled in place (d += (scale - 1)·d), as
          // Megatron-LM's cross entropy writes its gradient over its softmax: no second
          // logits-sized buffer (dtsim's memory model counts one).
          dlogits = std::exchange(mb.aux1.at(id), View{});
          dev_.accumulate(dlogits, dlogits, scale - 1.0f);
        } else {
          dev_.accumulate(dlogits, mb.aux1.at(id), scale);
        }
        break;
      }
      case OpKind::Embedding:
        // Only weight gradients (the tokens have none).
        if (weight_grads) {
          // Through the embedding's dropout, unless the sequence-parallel all-gather of this
          // gradient went through it (on the rank's share).
          View dy = mb.grad.at(id);
          const bool dropped = dropout_ > 0 && Ts_ == T_;
          if (dropped) {
            dy = allocate(dy.size());
            dev_.dropout_backward(dy, mb.mask.at(id), mb.grad.at(id), dropout_);
          }
          dev_.embedding_backward(grad(param(id, 0)), bias_grad(id), dy, mb.tokens, B_, Sq_, C_,
                                  t_ * Vl_, positions_);
          if (dropped) dev_.release(dy);
        }
        break;
      case OpKind::Norm:
        dev_.norm_backward(input_grads ? grad_of(mb, input(id)) : View{},
                           weight_grads ? grad(param(id, 0)) : View{},
                           weight_grads ? bias_grad(id) : View{}, mb.grad.at(id),
                           mb.out.at(input(id)), param(id, 0).data, mb.aux1.at(id), mb.aux2.at(id),
                           Ts_, C_, m_.norm == model::Norm::RmsNorm);
        break;
      case OpKind::QkvProj:
      case OpKind::AttnOutProj:
      case OpKind::MlpUp:
      case OpKind::MlpDown:
      case OpKind::LmHead: {
        if (op.expert) {
          experts_backward(mb, id, part);
          break;
        }
        const auto [K, N] = gemm_shape(op);
        const bool tied = tied_head(op);
        Param& w = tied ? tied_table(id) : param(id, 0);
        linear_backward(input_grads ? input_grad_of(mb, id) : View{}, w,
                        weight_grads && !tied ? bias_grad(id) : View{}, mb.grad.at(id),
                        weight_grads ? input_of(mb, id) : View{}, T_, K, N, tied, weight_grads);
        break;
      }
      case OpKind::AttentionCore: {
        const bool rope = m_.positions == model::Positions::Rope;
        const View q = rope ? mb.aux2.at(id) : mb.out.at(input(id));
        // Rotary positions: the gradient of the rotated q and k, turned back into qkv's.
        const View dq = rope ? allocate(q.size()) : grad_of(mb, input(id));
        if (cp_ > 1 || dropout_ > 0 || flash_) {
          const Device::DropoutSite site = dropout_site(mb, op.layer, kAttentionDropout, 0);
          Device::Attention a = attention_extras(mb, id, dropout_ > 0 ? &site : nullptr);
          if (dropout_ > 0 && !flash_) {
            a.mask = mb.mask.at(id);
            a.dropped = mb.dropped.at(id);
          }
          if (flash_) a.lse = mb.aux1.at(id);
          // K and V gradients of every cp rank's tokens, reduce-scattered to their owners by
          // the Program's next task (cp_collective).
          if (cp_ > 1) fresh(mb.kv_grad[id], mb.kv.at(id).size());
          dev_.attention_backward_ex(dq, cp_ > 1 ? mb.kv_grad[id] : dq, mb.grad.at(id), q,
                                     flash_ ? View{} : mb.aux1.at(id), B_, Sq_, H_, G_, D_, a);
        } else {
          dev_.attention_backward(dq, mb.grad.at(id), q, mb.aux1.at(id), B_, S_, H_, G_, D_);
        }
        if (rope) {
          dev_.rope_backward(grad_of(mb, input(id)), dq, B_, Sq_, H_, G_, D_, m_.rope_theta,
                             positions_);
          dev_.release(dq);
        }
        break;
      }
      case OpKind::Residual: {
        const auto preds = g_.predecessors(id);
        if (dropout_ > 0) {
          dev_.dropout_backward(grad_of(mb, preds[0]), mb.mask.at(id), mb.grad.at(id), dropout_);
        } else {
          dev_.accumulate(grad_of(mb, preds[0]), mb.grad.at(id));
        }
        dev_.accumulate(grad_of(mb, preds[1]), mb.grad.at(id));
        break;
      }
      case OpKind::Activation: {
        const View in = mb.out.at(input(id));
        if (m_.activation == model::Activation::Gelu) {
          dev_.gelu_backward(grad_of(mb, input(id)), in, mb.grad.at(id));
        } else {
          const auto rows = static_cast<int>(op.expert ? expert_copies(mb, router_of(id)) : T_);
          dev_.swiglu_backward(grad_of(mb, input(id)), in, mb.grad.at(id), rows,
                               op.expert ? expert_ffn() : F_);
        }
        break;
      }
      case OpKind::Router:
        router_backward(mb, id, part);
        break;
    }
  }

  // A linear layer's backward on `rows` rows: din += dout·w^T (when din is given), and with
  // weight_grads w's gradient (and dbias) += in^T·dout. Without gradient-accumulation fusion
  // (plan grad_accumulation_fusion false) the GEMM writes a fresh weight gradient that a
  // kernel of its own adds into the accumulator, the pass the simulator prices
  // (cost::ComputeCost::accumulation_seconds).
  void linear_backward(View din, Param& w, View dbias, View dout, View in, int rows, int K, int N,
                       bool tied, bool weight_grads) {
    const bool separate = weight_grads && !program_.plan.grad_accumulation_fusion;
    View fresh;
    if (separate) {
      fresh = dev_.allocate(w.n, Dtype::F32);
      dev_.zero(fresh);
    }
    dev_.matmul_backward(din, separate ? fresh : (weight_grads ? grad(w) : View{}),
                         weight_grads ? dbias : View{}, dout, weight_grads ? in : View{}, w.work,
                         rows, K, N, tied);
    if (separate) {
      dev_.accumulate(grad(w), fresh);
      dev_.release(fresh);
    }
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
  int expert_ffn() const { return static_cast<int>(m_.moe->expert_ffn_hidden / tp_); }
  // The router of an expert op (up <- router; down <- activation <- up <- router).
  OpId router_of(OpId id) const {
    OpId r = id;
    while (g_.op(r).kind != OpKind::Router) r = input(r);
    return r;
  }

  void router_forward(MicroBatch& mb, OpId id) {
    const int E = static_cast<int>(m_.moe->experts), k = top_k();
    const View x = input_of(mb, id);  // the whole sequence (all-gathered under SP)
    const View logits = allocate(static_cast<std::int64_t>(T_) * E);
    dev_.matmul_forward(logits, x, param(id, 0).work, View{}, T_, C_, E, false);
    fresh(mb.aux1[id], static_cast<std::int64_t>(T_) * k, Dtype::F32);  // gates
    fresh(mb.aux2[id], static_cast<std::int64_t>(T_) * k, Dtype::I32);  // experts
    dev_.moe_route(mb.aux2[id], mb.aux1[id], logits, T_, E, k);
    dev_.release(logits);
    fresh(mb.route[id], static_cast<std::int64_t>(T_) * k, Dtype::I32);
    fresh(mb.out[id], static_cast<std::int64_t>(T_) * k * C_);
    // Each expert's row count comes back as fp32 (Device::download), exact below 2^24.
    DTSIM_ASSERT(static_cast<std::int64_t>(T_) * k < (std::int64_t{1} << 24),
                 "fewer than 2^24 token copies per micro-batch");
    const View rows = dev_.allocate(E, Dtype::F32);
    dev_.moe_dispatch(mb.out[id], mb.route[id], rows, x, mb.aux2[id], T_, C_, k, E);
    std::vector<float> counts(static_cast<std::size_t>(E));
    dev_.download(counts.data(), rows);
    dev_.release(rows);
    auto& per_expert = mb.expert_rows[id];
    per_expert.assign(counts.begin(), counts.end());
    // Sequence parallelism keeps only the rank's share of the input (gathered again for the
    // backward), as for the other column-parallel layers.
    if (const auto it = mb.full.find(input(id)); it != mb.full.end()) {
      dev_.release(it->second);
      mb.full.erase(it);
    }
  }

  // fn(w, at, n) for each expert with rows: its weight's tensor number w, and its n rows of
  // the copies from row `at`.
  // With expert parallelism the rows are those this rank's experts received, a block per
  // (sender, expert) in arrival order: an expert's GEMMs run once per sender's block.
  template <typename Fn>
  void for_each_expert(MicroBatch& mb, OpId router, Fn&& fn) {
    std::int64_t at = 0;
    if (ep_ > 1) {
      const auto& blocks = mb.ep_blocks.at(router);
      const int local = static_cast<int>(blocks.size()) / ep_;
      for (std::size_t b = 0; b < blocks.size(); ++b) {
        const int e = e_ * local + static_cast<int>(b) % local;
        if (blocks[b] > 0) fn(2 * e, at, blocks[b]);
        at += blocks[b];
      }
      return;
    }
    const auto& rows = mb.expert_rows.at(router);
    for (std::size_t e = 0; e < rows.size(); ++e) {
      if (rows[e] > 0) fn(2 * static_cast<int>(e), at, rows[e]);
      at += rows[e];
    }
  }

  // The copies this rank's experts compute on: all T·k of its tokens' (ep 1), or what the
  // ep all-to-all brought.
  std::int64_t expert_copies(const MicroBatch& mb, OpId router) const {
    if (ep_ == 1) return static_cast<std::int64_t>(T_) * top_k();
    const auto& blocks = mb.ep_blocks.at(router);
    return std::accumulate(blocks.begin(), blocks.end(), std::int64_t{0});
  }

  // The experts' GEMMs of an up or down op, each on its rows of the copies.
  void experts_forward(MicroBatch& mb, OpId id) {
    const Op& op = g_.op(id);
    const OpId router = router_of(id);
    const auto [K, N] = gemm_shape(op);
    const int k = top_k();
    const bool down = op.kind == OpKind::MlpDown;
    const View in = mb.out.at(input(id));
    View& y = down ? mb.aux1[id] : mb.out[id];
    fresh(y, expert_copies(mb, router) * N);
    // The down GEMMs are row-parallel: their bias is added once, by tensor-parallel rank 0.
    const bool bias_here = !down || t_ == 0;
    for_each_expert(mb, router, [&](int w, std::int64_t at, int n) {
      dev_.matmul_forward(y.sub(at * N, std::int64_t{n} * N), in.sub(at * K, std::int64_t{n} * K),
                          param(id, w).work, bias_here ? bias_in(id, w + 1) : View{}, n, K, N,
                          false);
    });
    // With expert parallelism the copies' outputs go back to their tokens' ranks first (the
    // combine all-to-all, ep_collective), which combine them there.
    if (down && ep_ == 1) {
      fresh(mb.out[id], static_cast<std::int64_t>(T_) * C_);
      dev_.moe_combine(mb.out[id], y, mb.aux1.at(router), mb.route.at(router), T_, C_, k);
    }
  }

  void experts_backward(MicroBatch& mb, OpId id, Part part) {
    const Op& op = g_.op(id);
    const bool input_grads = part != Part::Weight;
    const bool weight_grads = part != Part::Input;
    const OpId router = router_of(id);
    const auto [K, N] = gemm_shape(op);
    const int k = top_k();
    const bool down = op.kind == OpKind::MlpDown;
    const std::int64_t copies = static_cast<std::int64_t>(T_) * k;
    View dy = mb.grad.at(id);
    // With expert parallelism the combine's backward ran at the tokens' ranks, and the copies'
    // gradients came here by the combine all-to-all (ep_collective): dy is theirs already.
    const bool through_combine = down && ep_ == 1;
    if (through_combine) {
      // Through the combine: each copy's output gradient (its gate times its token's), and
      // (once, with the input gradients) the gates' gradient for the router.
      dy = allocate(copies * N);
      View dgates;
      if (input_grads) {
        auto& g = mb.gate_grad[router];
        if (g.empty()) fresh(g, copies, Dtype::F32);
        dgates = g;
      } else {
        dgates = dev_.allocate(copies, Dtype::F32);
      }
      dev_.moe_combine_backward(dy, dgates, mb.grad.at(id), mb.aux1.at(id), mb.aux1.at(router),
                                mb.route.at(router), T_, C_, k);
      if (!input_grads) dev_.release(dgates);
    }
    const View in = weight_grads ? mb.out.at(input(id)) : View{};
    const View din = input_grads ? grad_of(mb, input(id)) : View{};
    for_each_expert(mb, router, [&](int w, std::int64_t at, int n) {
      linear_backward(din.empty() ? View{} : din.sub(at * K, std::int64_t{n} * K), param(id, w),
                      bias_grad(id, w + 1), dy.sub(at * N, std::int64_t{n} * N),
                      in.empty() ? View{} : in.sub(at * K, std::int64_t{n} * K), n, K, N, false,
                      weight_grads);
    });
    if (through_combine) dev_.release(dy);
  }

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
  void ep_collective(const lower::Task& task, MicroBatch& mb, bool alone = false) {
    const auto anchor = static_cast<OpId>(task.op_begin);
    const Op& op = g_.op(anchor);
    DTSIM_ASSERT(op.expert && (op.kind == OpKind::MlpUp || op.kind == OpKind::MlpDown),
                 "an ep all-to-all at an expert up or down op");
    const OpId router = router_of(anchor);
    const bool backward = task.tag == 1;
    const int E = static_cast<int>(m_.moe->experts), local = E / ep_, k = top_k();
    // Copies this rank's tokens send each member (in the router's sorted order), and what its
    // experts got from each member.
    const auto& rows = mb.expert_rows.at(router);
    auto& blocks = mb.ep_blocks[router];
    if (op.kind == OpKind::MlpUp && !backward) {
      // The rows per expert first, as fp32 (exact below 2^24, as the router's counts).
      const std::vector<float> counts(rows.begin(), rows.end());
      std::vector<float> received(static_cast<std::size_t>(E));
      if (alone) {
        for (int s = 0; s < ep_; ++s) {
          for (int l = 0; l < local; ++l) {
            received[static_cast<std::size_t>(s * local + l)] =
                counts[static_cast<std::size_t>(e_ * local + l)];
          }
        }
      } else {
        const View sent = dev_.allocate(E, Dtype::F32), got = dev_.allocate(E, Dtype::F32);
        dev_.upload(sent, counts.data());
        const std::vector<int> each(static_cast<std::size_t>(ep_), local);
        comm_.all_to_all(task.group, sent, each, got, each);
        dev_.download(received.data(), got);
        dev_.release(sent);
        dev_.release(got);
      }
      blocks.assign(received.begin(), received.end());
      const double copies = std::accumulate(received.begin(), received.end(), 0.0);
      mb.expert_load += copies / (static_cast<double>(T_) * k);
      ++mb.expert_blocks;
    }
    std::vector<int> to(static_cast<std::size_t>(ep_), 0), from(static_cast<std::size_t>(ep_), 0);
    for (int e = 0; e < E; ++e) {
      to[static_cast<std::size_t>(e / local)] += rows[static_cast<std::size_t>(e)];
      from[static_cast<std::size_t>(e / local)] += blocks.at(static_cast<std::size_t>(e));
    }
    // Moves `tensor` (rows of width C_) from the layout of `send` rows per member to that of
    // `receive`, in place of the old; towards the experts (send is `to`) or back from them.
    auto exchange = [&](View& tensor, const std::vector<int>& send,
                        const std::vector<int>& receive) {
      const bool to_experts = &send == &to;
      std::vector<std::int64_t> in(send.begin(), send.end()), out(receive.begin(), receive.end());
      for (auto& n : in) n *= C_;
      for (auto& n : out) n *= C_;
      const View moved =
          dev_.allocate(std::accumulate(out.begin(), out.end(), std::int64_t{0}), tensor.type);
      if (alone) {
        // This rank's own piece, into every piece its size (the copies to its experts, as each
        // peer's) or into its own (what comes back to it; the rest stays zero).
        const auto mine = static_cast<std::size_t>(e_);
        const std::int64_t offset = std::accumulate(in.begin(), in.begin() + e_, std::int64_t{0});
        std::int64_t at = 0;
        for (std::size_t r = 0; r < out.size(); ++r) {
          if (to_experts || r == mine) {
            DTSIM_ASSERT(out[r] == in[mine], "a replayed ep piece of this rank's size");
            dev_.copy(moved.sub(at, out[r]), tensor.sub(offset, in[mine]));
          }
          at += out[r];
        }
      } else {
        comm_.all_to_all(task.group, tensor, collective_counts(in, "ep all-to-all"), moved,
                         collective_counts(out, "ep all-to-all"));
      }
      dev_.release(tensor);
      tensor = moved;
    };
    if (op.kind == OpKind::MlpUp) {
      // Forward: the copies to the experts; backward: their gradients back to the tokens.
      if (!backward) {
        exchange(mb.out.at(router), to, from);
      } else {
        exchange(mb.grad.at(router), from, to);
      }
      return;
    }
    if (!backward) {
      // The copies' outputs back to their tokens, combined there.
      exchange(mb.aux1.at(anchor), from, to);
      fresh(mb.out[anchor], static_cast<std::int64_t>(T_) * C_);
      dev_.moe_combine(mb.out[anchor], mb.aux1.at(anchor), mb.aux1.at(router), mb.route.at(router),
                       T_, C_, k);
      return;
    }
    // The combine's backward at the tokens' rank: the copies' gradients and the gates'.
    const std::int64_t copies = static_cast<std::int64_t>(T_) * k;
    View dy = allocate(copies * C_);
    auto& dgates = mb.gate_grad[router];
    if (dgates.empty()) fresh(dgates, copies, Dtype::F32);
    dev_.moe_combine_backward(dy, dgates, mb.grad.at(anchor), mb.aux1.at(anchor),
                              mb.aux1.at(router), mb.route.at(router), T_, C_, k);
    exchange(dy, to, from);
    dev_.release(mb.grad.at(anchor));
    mb.grad[anchor] = dy;
  }

  void router_backward(MicroBatch& mb, OpId id, Part part) {
    const bool input_grads = part != Part::Weight;
    const bool weight_grads = part != Part::Input;
    const int E = static_cast<int>(m_.moe->experts), k = top_k();
    // The logits' gradient through the gates' softmax (again in a weight pass).
    const View dlogits = allocate(static_cast<std::int64_t>(T_) * E);
    dev_.moe_route_backward(dlogits, mb.gate_grad.at(id), mb.aux1.at(id), mb.aux2.at(id), T_, E, k);
    const View x = weight_grads ? input_of(mb, id) : View{};
    const View dx = input_grads ? input_grad_of(mb, id) : View{};
    // Every tp rank routes alike: the router's share of the input gradient is added by rank 0
    // alone, as the tp all-reduce that follows sums the ranks' (the experts' shares differ).
    linear_backward(t_ == 0 ? dx : View{}, param(id, 0), View{}, dlogits, x, T_, C_, E, false,
                    weight_grads);
    dev_.release(dlogits);
    // Each token's copies' gradients back to the token.
    if (input_grads) dev_.moe_dispatch_backward(dx, mb.grad.at(id), mb.route.at(id), T_, C_, k);
  }

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
  View norm_share(Param& p) {
    if (!canonical_copy(p)) return {};
    if (sharded_) return p.reduced;
    const View g = grad(p);
    const std::int64_t shards = p.expert ? edp_ : dp_, mine = p.expert ? ed_ : d_;
    const std::int64_t begin = g.size() * mine / shards, end = g.size() * (mine + 1) / shards;
    return g.sub(begin, end - begin);
  }

  // The rank's share of the gradients' squared norm, which the Program's grad-norm
  // all-reduces then sum over the ranks.
  void grad_norm() {
    if (grad_norm_sq_.n == 0) grad_norm_sq_ = dev_.allocate(1, Dtype::F32);
    dev_.zero(grad_norm_sq_);
    for (auto& [key, p] : params_) {
      const View share = norm_share(p);
      if (share.size() > 0) dev_.sum_squares(grad_norm_sq_, share);
    }
  }

  void optimizer_step() {
    ++adam_step_;
    const float lr = options_.lr.at(adam_step_);
    const auto clip = static_cast<float>(p_.clip_grad);
    for (auto& [key, p] : params_) {
      if (clip > 0) dev_.clip_scale(sharded_ ? p.reduced : grad(p), grad_norm_sq_, clip);
      dev_.adamw(master_slice(p), sharded_ ? p.reduced : grad(p), p.m, p.v, lr, 0.9f, 0.95f, 1e-8f,
                 p.decays ? options_.weight_decay : 0.0f, adam_step_);
      // Sharded, the gradients were cleared when their reduce-scatter took its packed copy (a
      // replay of predicted waits runs no reduce-scatter: they are cleared here; in place, the
      // reduce-scatter leaves them where they were).
      if (sharded_ && !in_place_) dev_.zero(p.reduced);
      if (transient_grads_) drop_grad(p);
      if (!sharded_) refresh_work(p);  // sharded: after the all-gather of the updated slices
    }
    // The gradient buffer cleared for the next step, in one pass as Megatron-LM's
    // zero_grad_buffer clears its contiguous buffer (the simulator's Task::cleared_params); a
    // replay of predicted waits ran no reduce-scatter to clear staged ZeRO-1's.
    if (plan::optimizer_clears_gradients(p_) ||
        (options_.replay_communication && !transient_grads_)) {
      dev_.zero(grad_storage_);
    }
  }

  // ---- communication -----------------------------------------------------------------------

  // Gradients of `params` over the dp group: summed in place (ZeRO-0), or reduce-scattered into
  // each rank's slice accumulator (ZeRO >= 1), the full gradient buffers then cleared.
  // The reduction starts here and finishes when a later task depends on it (the Program's
  // dp stream overlapping the rest of the backward pass).
  void reduce_gradients(const lower::Task& task, const std::vector<Param*>& params,
                        std::size_t index) {
    if (task.collective == CollectiveKind::AllReduce) {
      if (params.empty()) return;
      // The bucket's tensors are contiguous in the gradient buffer.
      const std::int64_t begin = offset_in_grads(params.front()->grad);
      const std::int64_t end = offset_in_grads(params.back()->grad) + params.back()->grad.size();
      pending_[index] = {comm_.start_all_reduce(task.group, grad_storage_.sub(begin, end - begin)),
                         {},
                         std::nullopt};
      return;
    }
    DTSIM_ASSERT(task.collective == CollectiveKind::ReduceScatter && sharded_,
                 "dp gradient reduction");
    if (in_place_) {
      // The bucket's sums land where this rank's part of its gradients was: its tensors'
      // reduced slices (Param::reduced), cleared after the optimizer step. No copy, no buffer.
      // One reduce-scatter per bucket of the layout: the task's, or its pieces where a tied
      // embedding table is a bucket of its own (plan_flat_layout).
      const auto [shards, mine] = shards_of(task);
      std::vector<Comm::Handle> handles;
      std::vector<std::vector<int>> all_counts;  // a moved vector keeps its elements in place
      for (std::size_t i = 0; i < params.size();) {
        const Param::Flat& f = params[i]->flat;
        DTSIM_ASSERT(f.at == f.bucket_begin, "ZeRO in place: a reduce-scatter carries its buckets");
        std::int64_t size = 0;
        for (; i < params.size() && params[i]->flat.bucket_begin == f.bucket_begin; ++i) {
          size += params[i]->n;
        }
        DTSIM_ASSERT(size == f.bucket_size, "ZeRO in place: a reduce-scatter carries its buckets");
        std::vector<std::int64_t> wide(static_cast<std::size_t>(shards));
        for (int r = 0; r < shards; ++r) {
          wide[static_cast<std::size_t>(r)] = size * (r + 1) / shards - size * r / shards;
        }
        all_counts.push_back(collective_counts(wide, "ZeRO gradient reduce-scatter"));
        const std::vector<int>& counts = all_counts.back();
        const View bucket = grad_storage_.sub(f.bucket_begin, size);
        handles.push_back(comm_.start_reduce_scatter(
            task.group, bucket,
            bucket.sub(size * mine / shards, counts[static_cast<std::size_t>(mine)]), counts));
      }
      if (handles.empty()) return;
      pending_[index] = {
          handles.front(),        {},
          std::nullopt,
          /*holds_bucket=*/false, std::vector<Comm::Handle>(handles.begin() + 1, handles.end()),
          std::move(all_counts)};
      return;
    }
    // One bucket's reduction buffers at a time, as the memory model counts them and as a
    // framework bounds its reduction buckets: the reduce-scatters started before this one are
    // finished first (their buffers go back before this bucket's are made; on the host a wait,
    // on a GPU the compute stream waits for them). Left to pile up, they held every bucket of
    // the step at once wherever the buckets are issued faster than they complete (as they are
    // back to back after the last backward with --no-overlap-grad-reduce).
    for (auto it = pending_.begin(); it != pending_.end();) {
      it = it->second.holds_bucket ? finish_pending(it) : std::next(it);
    }
    const auto [shards, mine] = shards_of(task);
    std::vector<std::int64_t> wide(static_cast<std::size_t>(shards), 0);
    std::int64_t total = 0;
    for (Param* p : params) total += p->n;
    auto buffers = std::make_shared<ScatterBuffers>();
    buffers->in = dev_.allocate_for_overwrite(total, Dtype::F32);  // packed whole below
    std::int64_t at = 0;
    for (int r = 0; r < shards; ++r) {
      for (Param* p : params) {
        const std::int64_t n = p->n;
        const std::int64_t b = n * r / shards, e = n * (r + 1) / shards;
        dev_.copy(buffers->in.sub(at, e - b), grad(*p).sub(b, e - b));
        at += e - b;
        wide[static_cast<std::size_t>(r)] += e - b;
      }
    }
    std::vector<int> counts = collective_counts(wide, "ZeRO gradient reduce-scatter");
    // The packed copy is the collective's: the gradients start again from zero at once (or,
    // ZeRO-2/3, are gone until the next backward writes them).
    for (Param* p : params) {
      if (transient_grads_) {
        drop_grad(*p);
      } else {
        dev_.zero(p->grad);
      }
    }
    buffers->counts = std::move(counts);
    buffers->out =
        dev_.allocate_for_overwrite(buffers->counts[static_cast<std::size_t>(mine)], Dtype::F32);
    const Comm::Handle handle =
        comm_.start_reduce_scatter(task.group, buffers->in, buffers->out, buffers->counts);
    pending_[index] = {handle,
                       [this, params, buffers] {
                         std::int64_t from = 0;
                         for (Param* p : params) {
                           dev_.accumulate(p->reduced, buffers->out.sub(from, p->reduced.size()));
                           from += p->reduced.size();
                         }
                         dev_.release(buffers->in);
                         dev_.release(buffers->out);
                       },
                       std::nullopt, /*holds_bucket=*/true};
  }

  // Vocab-parallel cross-entropy (Megatron-LM): the row maxima reduced with max, then the sums
  // of exponentials and the target logits with sum, over tp (local only for --only-rank).
  void loss_statistics(const lower::Task& task, MicroBatch& mb, OpId loss, bool reduce) {
    const View logits = mb.out.at(input(loss));
    auto& stats = mb.aux2[loss];
    fresh(stats, 3 * static_cast<std::int64_t>(T_), Dtype::F32);
    const View rowmax = stats.sub(0, T_), sums = stats.sub(T_, 2 * T_);
    dev_.cross_entropy_max(rowmax, logits, T_, Vl_);
    if (reduce) comm_.all_reduce(task.group, rowmax, Reduce::Max);
    dev_.cross_entropy_sums(sums, logits, rowmax, mb.targets, T_, Vl_, t_ * Vl_);
    if (reduce) comm_.all_reduce(task.group, sums, Reduce::Sum);
  }

  // Started collectives whose results are added somewhere (ZeRO's reduce-scatters, into the
  // reduced slices) finish as soon as the backend has seen them complete, so that their
  // buffers go back then, as a framework frees them; and always in the order they started, so
  // that the sums are added in one order whatever the timing. (On a GPU they are complete once
  // the device has run them, which is often after the host queued the rest of the step: those
  // finish when a task needs them.)
  void finish_completed() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (!it->second.complete) {
        ++it;
        continue;
      }
      if (!comm_.complete(it->second.handle)) break;
      it = finish_pending(it);
    }
  }

  // Finishes the started collectives that `task` depends on (all of them for nullptr), and
  // the ones that add results started before the last such one it depends on.
  void settle(const lower::Task* task) {
    // Blocking pipeline transfers: a task that waits for sends (the next round's compute, see
    // lowering) starts once they are received, as Megatron-LM's exchange waits for its sends.
    if (task != nullptr && !program_.plan.overlap_p2p_comm && !options_.replay_communication &&
        std::any_of(task->deps.begin(), task->deps.end(), [this](lower::TaskId d) {
          return rp_->tasks[static_cast<std::size_t>(d)].kind == TaskKind::Send;
        })) {
      comm_.finish_sends();
      close_sends();
    }
    auto depends = [task](std::size_t index) {
      return task == nullptr || std::find(task->deps.begin(), task->deps.end(),
                                          static_cast<lower::TaskId>(index)) != task->deps.end();
    };
    std::optional<std::size_t> last_adding;
    for (const auto& [index, pending] : pending_) {
      if (pending.complete && depends(index)) last_adding = index;
    }
    for (auto it = pending_.begin(); it != pending_.end();) {
      const bool needed =
          depends(it->first) || (it->second.complete && last_adding && it->first <= *last_adding);
      it = needed ? finish_pending(it) : std::next(it);
    }
  }

  std::map<std::size_t, PendingCollective>::iterator finish_pending(
      std::map<std::size_t, PendingCollective>::iterator it) {
    comm_.finish(it->second.handle);
    for (const Comm::Handle h : it->second.also) comm_.finish(h);
    if (it->second.record) {
      TaskRecord& r = (*records_)[*it->second.record];
      for (const Comm::Handle h : it->second.also) {
        const auto done = comm_.completed_at(h);
        if (done) r.end_s = std::max(r.end_s, since_start(*done));
      }
      const auto done = comm_.completed_at(it->second.handle);
      r.end_s = std::max(r.end_s, since_start(done ? *done : std::chrono::steady_clock::now()));
    }
    if (it->second.complete) it->second.complete();
    return pending_.erase(it);
  }

  // Per-member counts of a collective, which the communication backends take as int (MPI's
  // counts are); a buffer of 2^31 elements or more is refused, naming the collective.
  static std::vector<int> collective_counts(const std::vector<std::int64_t>& wide,
                                            const char* what) {
    const std::int64_t total = std::accumulate(wide.begin(), wide.end(), std::int64_t{0});
    if (total > std::numeric_limits<int>::max()) {
      throw UnsupportedError(fmt::format(
          "{} of {} elements: the communication backends take at most 2^31 - 1 elements per "
          "call (not split into pieces yet); use more pipeline or tensor-parallel ranks",
          what, total));
    }
    return {wide.begin(), wide.end()};
  }

  // The blocking sends recorded since the last wait end now: their receivers have them.
  void close_sends() {
    const double end = since_start(std::chrono::steady_clock::now());
    for (std::size_t r : open_sends_) (*records_)[r].end_s = std::max((*records_)[r].end_s, end);
    open_sends_.clear();
  }

  double since_start(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration<double>(t - t0_).count();
  }

  // Every dp rank's updated slice of `params`, gathered into the full weights (ZeRO-3: into
  // buffers made here, which live to the last compute task that reads them). A tensor of which
  // only the working copy is read (Param::work_only) is gathered in the activation type straight
  // into it, as Megatron-LM and FSDP2 gather 16-bit weights (half the bytes of its fp32
  // master); the others in fp32, their working copies cast after. With `local` (--only-rank)
  // the other slices stay zeros.
  void gather_weights(const lower::Task& task, const std::vector<Param*>& params,
                      bool local = false) {
    if (!sharded_) return;
    if (zero3_) {
      // Written whole below (every rank's slice), except with `local`, whose other slices
      // stay zeros.
      const auto make = [&](std::int64_t n, Dtype type) {
        return local ? dev_.allocate(n, type) : dev_.allocate_for_overwrite(n, type);
      };
      for (Param* p : params) {
        if (!p->work.empty()) continue;
        if (!p->work_only) p->data = make(p->n, Dtype::F32);
        p->work = p->separate_work ? make(p->n, dev_.activations()) : p->data;
      }
    }
    // Where a gather puts a tensor, and its copy of this rank's master slice into a view.
    const auto gathered = [](const Param& p) { return p.work_only ? p.work : p.data; };
    const auto copy_in = [this](const Param& p, View to, View from) {
      if (p.work_only) {
        dev_.cast(to, from);
      } else {
        dev_.copy(to, from);
      }
    };
    if (local) {
      for (Param* p : params) {
        copy_in(*p, gathered(*p).sub(p->own_begin, p->shard.size()), p->shard);
      }
      for (Param* p : params) {
        if (!p->work_only) refresh_work(*p);
      }
      return;
    }
    if (in_place_) {
      gather_in_place(task, params);
      return;
    }
    // In chunks of at most a gradient bucket's bytes (plan::kGradientBucketBytes), as
    // DeepSpeed gathers in buckets of allgather_bucket_size (Megatron-LM gathers in place into
    // its contiguous buffer): the packed copy of the rank's slices and the gathered chunk are
    // all the memory the gather adds, whatever the model's size (one gather of every updated
    // weight held 1.5x the weights: GPT-2 124M's 712 MiB at dp 2). A tensor larger than a
    // chunk goes in parts: part i of P of every rank's slice of it. The fp32 tensors go first,
    // then those gathered in the activation type (one type per collective).
    const auto [shards, me] = shards_of(task);
    struct Slab {
      Param* p;
      std::int64_t i, of;
    };
    // Elements [b, e) of the full tensor: rank r's slice's part.
    const auto range = [shards](const Slab& part, int r) {
      const std::int64_t n = part.p->n;
      const std::int64_t b = n * r / shards, length = n * (r + 1) / shards - b;
      return std::pair{b + length * part.i / part.of, b + length * (part.i + 1) / part.of};
    };
    for (const bool work : {false, true}) {
      const Dtype type = work ? dev_.activations() : Dtype::F32;
      const auto budget = static_cast<std::int64_t>(plan::kGradientBucketBytes / bytes_of(type));
      std::vector<Slab> chunk;
      std::int64_t chunk_size = 0;
      const auto flush = [&] {
        if (chunk.empty()) return;
        std::vector<std::int64_t> wide(static_cast<std::size_t>(shards), 0);
        for (const Slab& part : chunk) {
          for (int r = 0; r < shards; ++r) {
            const auto [b, e] = range(part, r);
            wide[static_cast<std::size_t>(r)] += e - b;
          }
        }
        const std::vector<int> counts = collective_counts(wide, "ZeRO weight all-gather");
        const View mine = dev_.allocate_for_overwrite(counts[static_cast<std::size_t>(me)], type);
        const View all = dev_.allocate_for_overwrite(
            std::accumulate(wide.begin(), wide.end(), std::int64_t{0}), type);
        std::int64_t at = 0;
        for (const Slab& part : chunk) {
          const auto [b, e] = range(part, me);
          copy_in(*part.p, mine.sub(at, e - b),
                  master_slice(*part.p).sub(b - part.p->own_begin, e - b));
          at += e - b;
        }
        comm_.all_gather(task.group, mine, all, counts);
        at = 0;
        for (int r = 0; r < shards; ++r) {
          for (const Slab& part : chunk) {
            const auto [b, e] = range(part, r);
            dev_.copy(gathered(*part.p).sub(b, e - b), all.sub(at, e - b));
            at += e - b;
          }
        }
        dev_.release(mine);
        dev_.release(all);
        chunk.clear();
        chunk_size = 0;
      };
      for (Param* p : params) {
        if (p->work_only != work) continue;
        const std::int64_t parts = std::max<std::int64_t>(1, (p->n + budget - 1) / budget);
        for (std::int64_t i = 0; i < parts; ++i) {
          const std::int64_t size = p->n * (i + 1) / parts - p->n * i / parts;
          if (chunk_size + size > budget) flush();
          chunk.push_back({p, i, parts});
          chunk_size += size;
        }
      }
      flush();
    }
    for (Param* p : params) {
      if (!p->work_only) refresh_work(*p);
    }
  }

  // ZeRO-1 in place (plan_flat_layout): the weights of `params` gathered where they lie, one
  // all-gather per bucket and type, each rank's part the updated master slices it holds
  // there (cast into it first where the working copy is gathered: the fp32 ones are there
  // already). A bucket's tensors of one type are consecutive in their buffer, and every rank's
  // part of them is one range there, the ranks' in rank order.
  void gather_in_place(const lower::Task& task, const std::vector<Param*>& params) {
    const auto [shards, me] = shards_of(task);
    for (Param* p : params) {
      if (p->work_only && p->own_end > p->own_begin) {
        dev_.cast(p->work.sub(p->own_begin, p->own_end - p->own_begin), p->shard);
      }
    }
    for (const bool work : {false, true}) {
      const View storage = work ? work_storage_ : weight_storage_;
      std::vector<std::int64_t> wide(static_cast<std::size_t>(shards), 0);
      std::int64_t begin = -1, size = 0, mine_at = -1, bucket = -1;
      const auto flush = [&] {
        if (size > 0) {
          const std::vector<int> counts = collective_counts(wide, "ZeRO weight all-gather");
          std::int64_t before = 0;
          for (int r = 0; r < me; ++r) before += counts[static_cast<std::size_t>(r)];
          DTSIM_ASSERT(mine_at < 0 || mine_at == before,
                       "ZeRO in place: the ranks' parts of a gather follow one another");
          const View whole = storage.sub(begin, size);
          comm_.all_gather(task.group, whole.sub(before, counts[static_cast<std::size_t>(me)]),
                           whole, counts);
        }
        std::fill(wide.begin(), wide.end(), 0);
        begin = -1;
        size = 0;
        mine_at = -1;
      };
      for (Param* p : params) {
        if (p->work_only != work) continue;
        if (p->flat.bucket_begin != bucket) {
          flush();
          bucket = p->flat.bucket_begin;
        }
        if (begin < 0) begin = p->flat.weight_at;
        DTSIM_ASSERT(p->flat.weight_at == begin + size, "ZeRO in place: a gather is contiguous");
        for (int r = 0; r < shards; ++r) {
          const auto [b, e] = flat_slice(*p, r);
          wide[static_cast<std::size_t>(r)] += e - b;
          if (r == me && e > b && mine_at < 0) mine_at = size + b;
        }
        size += p->n;
      }
      flush();
    }
    for (Param* p : params) {
      if (!p->work_only) refresh_work(*p);
    }
  }

  // Context parallelism (the lowering's all-gather variant, as Llama 3's): before an attention
  // core, the K and V of this rank's tokens (rotated, with rotary positions) all-gathered over
  // cp, in forward and again before the backward (unless a full recompute gathers them); after
  // its backward, the gradients of every rank's K and V reduce-scattered to their owners and
  // added into the gradient of this rank's qkv. With `local` (--only-rank) the shapes change as
  // they would, the data is this rank's own.
  void cp_collective(const lower::Task& task, MicroBatch& mb, bool local = false) {
    const auto core = static_cast<OpId>(task.op_begin);
    DTSIM_ASSERT(g_.op(core).kind == OpKind::AttentionCore, "a cp collective at an attention core");
    const OpId qkv = input(core);
    const int width = (H_ + 2 * G_) * D_, kv_width = 2 * G_ * D_;
    const std::int64_t mine = static_cast<std::int64_t>(T_) * kv_width;
    const bool rope = m_.positions == model::Positions::Rope;
    const std::vector<int> counts = collective_counts(
        std::vector<std::int64_t>(static_cast<std::size_t>(cp_), mine), "the cp K/V all-gather");
    if (task.collective == CollectiveKind::AllGather) {
      const View own = allocate(mine);
      if (rope) {
        const View turned = allocate(static_cast<std::int64_t>(T_) * width);
        dev_.rope_forward(turned, mb.out.at(qkv), B_, Sq_, H_, G_, D_, m_.rope_theta, positions_);
        dev_.copy_columns(own, turned, T_, width, H_ * D_, kv_width);
        dev_.release(turned);
      } else {
        dev_.copy_columns(own, mb.out.at(qkv), T_, width, H_ * D_, kv_width);
      }
      auto& all = mb.kv[core];
      fresh(all, mine * cp_);
      if (local) {
        for (int r = 0; r < cp_; ++r) dev_.copy(all.sub(r * mine, mine), own);
      } else {
        comm_.all_gather(task.group, own, all, counts);
      }
      dev_.release(own);
      return;
    }
    DTSIM_ASSERT(task.collective == CollectiveKind::ReduceScatter, "cp reduce-scatter of dKV");
    const View own = allocate(mine);
    if (local) {
      dev_.copy(own, mb.kv_grad.at(core).sub(c_ * mine, mine));
    } else {
      comm_.reduce_scatter(task.group, mb.kv_grad.at(core), own, counts);
    }
    dev_.release(mb.kv_grad.at(core));
    mb.kv_grad.erase(core);
    if (rope) {
      const View turned = allocate(static_cast<std::int64_t>(T_) * width);
      dev_.add_columns(turned, own, T_, width, H_ * D_, kv_width);
      dev_.rope_backward(grad_of(mb, qkv), turned, B_, Sq_, H_, G_, D_, m_.rope_theta, positions_);
      dev_.release(turned);
    } else {
      dev_.add_columns(grad_of(mb, qkv), own, T_, width, H_ * D_, kv_width);
    }
    dev_.release(own);
  }

  // Sequence parallelism (Korthikanti et al. 2022): g is a reduce-scatter over the sequence in
  // forward and an all-gather in backward, f the converse. Rank r holds rows [r·Ts, (r+1)·Ts).
  // With `local` (--only-rank) the shapes change as they would, the data is this rank's own.
  void sequence_parallel_collective(const lower::Task& task, MicroBatch& mb, OpId anchor, bool exit,
                                    bool local = false) {
    const std::vector<int> counts(static_cast<std::size_t>(tp_), Ts_ * C_);
    const bool scatter = task.collective == CollectiveKind::ReduceScatter;
    auto reduce_scatter = [&](View in, View out) {
      if (local) {
        dev_.copy(out, in.sub(0, out.size()));
      } else {
        comm_.reduce_scatter(task.group, in, out, counts);
      }
    };
    auto all_gather = [&](View in, View out) {
      if (local) {
        for (std::int64_t at = 0; at < out.size(); at += in.size()) {
          const std::int64_t n = std::min(in.size(), out.size() - at);
          dev_.copy(out.sub(at, n), in.sub(0, n));
        }
      } else {
        comm_.all_gather(task.group, in, out, counts);
      }
    };
    const std::int64_t shard_size = static_cast<std::int64_t>(Ts_) * C_;
    const std::int64_t whole_size = static_cast<std::int64_t>(T_) * C_;
    if (exit && scatter) {  // forward g: the row-parallel (or embedding) output, summed
      auto& out = mb.out.at(anchor);
      const View shard = allocate(shard_size);
      reduce_scatter(out, shard);
      dev_.release(out);
      out = shard;
      if (g_.op(anchor).kind == OpKind::Embedding) embedding_dropout(mb, anchor);
    } else if (exit) {  // backward g: the gradient of that output, gathered
      auto& grad = mb.grad.at(anchor);
      if (g_.op(anchor).kind == OpKind::Embedding && dropout_ > 0) {
        // Through the embedding's dropout first, on the rank's share (as it was applied).
        const View dy = allocate(grad.size());
        dev_.dropout_backward(dy, mb.mask.at(anchor), grad, dropout_);
        dev_.release(grad);
        grad = dy;
      }
      const View whole = allocate(whole_size);
      all_gather(grad, whole);
      dev_.release(grad);
      grad = whole;
    } else if (!scatter) {  // f's all-gather of the column-parallel op's input (forward, and
                            // again in the backward for the weight gradient)
      const OpId in = input(anchor);
      auto& whole = mb.full[in];
      fresh(whole, whole_size);
      all_gather(mb.out.at(in), whole);
    } else {  // backward f: the gradient of that input, summed and scattered
      const OpId in = input(anchor);
      const View shard = allocate(shard_size);
      reduce_scatter(mb.full_grad.at(in), shard);
      dev_.accumulate(grad_of(mb, in), shard);
      dev_.release(shard);
      dev_.release(mb.full_grad.at(in));
      mb.full_grad.erase(in);
    }
  }

  void collective(const lower::Task& task, std::size_t index) {
    const auto& grp = program_.groups.at(static_cast<std::size_t>(task.group));
    if (task.phase == Phase::GradNorm) {  // the squared norm's shares, over dp, tp or pp
      comm_.all_reduce(task.group, grad_norm_sq_, Reduce::Sum);
      return;
    }
    switch (grp.kind) {
      case GroupKind::Tp: {
        if (task.micro_batch < 0) {
          // Sequence parallelism: the norms' weight gradients, each from a share of the
          // sequence, summed over tp (the dp-reduced slice under ZeRO >= 1).
          std::vector<Param*> norms;
          for (Param* p : params_of(task.op_begin, task.op_end)) {
            if (p->norm) norms.push_back(p);
          }
          std::int64_t total = 0;
          for (Param* p : norms) total += (sharded_ ? p->reduced : p->grad).size();
          const View flat = dev_.allocate(total, Dtype::F32);
          std::int64_t at = 0;
          for (Param* p : norms) {
            const View g = sharded_ ? p->reduced : p->grad;
            dev_.copy(flat.sub(at, g.size()), g);
            at += g.size();
          }
          comm_.all_reduce(task.group, flat, Reduce::Sum);
          at = 0;
          for (Param* p : norms) {
            const View g = sharded_ ? p->reduced : p->grad;
            dev_.copy(g, flat.sub(at, g.size()));
            at += g.size();
          }
          dev_.release(flat);
          return;
        }
        MicroBatch& mb = batches_.at(static_cast<std::size_t>(task.micro_batch));
        const auto anchor = static_cast<OpId>(task.op_begin);
        const Op& op = g_.op(anchor);
        if (op.kind == OpKind::MlpUp && op.expert) {
          // The gates' gradient, a partial sum on each rank of the experts' slices.
          comm_.all_reduce(task.group, mb.gate_grad.at(router_of(anchor)), Reduce::Sum);
          return;
        }
        const bool exit = op.kind == OpKind::Embedding || row_parallel(op);
        if (program_.plan.scatter_gather_p2p && task.collective == CollectiveKind::AllGather) {
          gather_transferred(task);  // no sequence parallelism: the only tp all-gather
          return;
        }
        if (task.collective == CollectiveKind::ReduceScatter ||
            task.collective == CollectiveKind::AllGather) {
          sequence_parallel_collective(task, mb, anchor, exit);
          return;
        }
        DTSIM_ASSERT(task.collective == CollectiveKind::AllReduce, "tp collective");
        if (op.kind == OpKind::Loss) {
          loss_statistics(task, mb, anchor, /*reduce=*/true);
        } else if (exit) {
          comm_.all_reduce(task.group, mb.out.at(anchor), Reduce::Sum);  // forward: g
          if (op.kind == OpKind::Embedding) embedding_dropout(mb, anchor);
        } else if (program_.plan.overlap_tp_backward &&
                   index != last_use_[static_cast<std::size_t>(task.micro_batch)]) {
          // f's backward, overlapped: it runs while the layer's weight gradient computes and
          // finishes before the first task that depends on it (settle).
          pending_[index] = {
              comm_.start_all_reduce(task.group, mb.grad.at(input(anchor))), {}, std::nullopt};
        } else {
          comm_.all_reduce(task.group, mb.grad.at(input(anchor)), Reduce::Sum);  // f
        }
        return;
      }
      case GroupKind::Dp:
      case GroupKind::ExpertDp: {  // the same ranks while ep is 1 (check_runnable)
        if (task.collective == CollectiveKind::AllGather) {
          // ZeRO-3: one chunk's weights before a pass; ZeRO-1/2: all weights after the step.
          gather_weights(task, params_for(task));
        } else {
          reduce_gradients(task, params_for(task), index);
        }
        return;
      }
      case GroupKind::Cp:
        cp_collective(task, batches_.at(static_cast<std::size_t>(task.micro_batch)));
        return;
      case GroupKind::Ep:
        ep_collective(task, batches_.at(static_cast<std::size_t>(task.micro_batch)));
        return;
      case GroupKind::Pp: {
        // The tied embedding: first stage's matrix and last stage's copy, gradients summed
        // (the already dp-reduced slice under ZeRO >= 1: both stages slice it alike).
        Param& p = param(static_cast<OpId>(task.op_begin), 0);
        comm_.all_reduce(task.group, sharded_ ? p.reduced : p.grad, Reduce::Sum);
        return;
      }
      default:
        throw UnsupportedError(
            fmt::format("dtexec: {} collectives are not executed yet", lower::to_string(grp.kind)));
    }
  }

  // A micro-batch's tensors go back to the device, whose pool later tensors reuse, so memory
  // stays what the schedule keeps in flight without the cost of fresh pages every step.
  void release(MicroBatch& mb) {
    if (mb.expert_blocks > 0) {
      const double load = mb.expert_load / mb.expert_blocks;
      expert_load_peak_ = std::max(expert_load_peak_, load);
      expert_load_sum_ += load;
      ++expert_load_count_;
      mb.expert_load = 0;
      mb.expert_blocks = 0;
    }
    for (const auto slot : kTensorSlots) {
      for (auto& [id, v] : mb.*slot) dev_.release(v);
      (mb.*slot).clear();
    }
    dev_.release(mb.tokens);
    dev_.release(mb.targets);
    mb.tokens = mb.targets = View{};
  }

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
    GateGrad
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
  std::vector<Use> forward_uses(OpId id) const {
    const Op& op = g_.op(id);
    std::vector<Use> u;
    auto read = [&u](Slot s, OpId x) { u.push_back({s, x, false}); };
    auto make = [&u](Slot s, OpId x) { u.push_back({s, x, true}); };
    switch (op.kind) {
      case OpKind::Embedding:
        make(Slot::Out, id);
        if (dropout_ > 0 && tp_ == 1) make(Slot::Mask, id);
        break;
      case OpKind::Norm:
        read(Slot::Out, input(id));
        for (Slot s : {Slot::Out, Slot::Aux1, Slot::Aux2}) make(s, id);
        break;
      case OpKind::QkvProj:
      case OpKind::AttnOutProj:
      case OpKind::MlpUp:
      case OpKind::MlpDown:
      case OpKind::LmHead:
        read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
        if (op.kind == OpKind::MlpDown && op.expert) {
          make(Slot::Aux1, id);  // the copies' outputs
          if (ep_ > 1) break;    // combined by the ep all-to-all that follows
          for (Slot s : {Slot::Aux1, Slot::Route}) read(s, router_of(id));
        }
        make(Slot::Out, id);
        break;
      case OpKind::AttentionCore:
        read(Slot::Out, input(id));
        if (cp_ > 1) read(Slot::Kv, id);
        make(Slot::Out, id);
        make(Slot::Aux1, id);
        if (dropout_ > 0) {
          make(Slot::Mask, id);
          make(Slot::Dropped, id);
        }
        if (m_.positions == model::Positions::Rope) make(Slot::Aux2, id);
        break;
      case OpKind::Residual:
        for (OpId pred : g_.predecessors(id)) read(Slot::Out, pred);
        make(Slot::Out, id);
        if (dropout_ > 0) make(Slot::Mask, id);
        break;
      case OpKind::Activation:
        read(Slot::Out, input(id));
        make(Slot::Out, id);
        break;
      case OpKind::Loss:
        read(Slot::Out, input(id));
        if (tp_ > 1) read(Slot::Aux2, id);
        make(Slot::Aux1, id);
        break;
      case OpKind::Router:
        read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
        for (Slot s : {Slot::Out, Slot::Aux1, Slot::Aux2, Slot::Route}) make(s, id);
        break;
    }
    return u;
  }

  // What backward(mb, id, part) reads (gradients it adds into count as reads).
  std::vector<Use> backward_uses(OpId id, Part part) const {
    const Op& op = g_.op(id);
    const bool input_grads = part != Part::Weight;
    const bool weight_grads = part != Part::Input;
    const bool has_weights = holds_weights(id) || tied_head(op);
    std::vector<Use> u;
    if (!has_weights && !input_grads) return u;
    auto read = [&u](Slot s, OpId x) { u.push_back({s, x, false}); };
    switch (op.kind) {
      case OpKind::Loss:
        read(Slot::Aux1, id);
        read(Slot::Grad, input(id));
        break;
      case OpKind::Embedding:
        if (weight_grads) read(Slot::Grad, id);
        if (weight_grads && dropout_ > 0 && Ts_ == T_) read(Slot::Mask, id);
        break;
      case OpKind::Norm:
        for (Slot s : {Slot::Grad, Slot::Aux1, Slot::Aux2}) read(s, id);
        read(Slot::Out, input(id));
        if (input_grads) read(Slot::Grad, input(id));
        break;
      case OpKind::QkvProj:
      case OpKind::AttnOutProj:
      case OpKind::MlpUp:
      case OpKind::MlpDown:
      case OpKind::LmHead:
        read(Slot::Grad, id);
        if (op.kind == OpKind::MlpDown && op.expert && ep_ == 1) {
          read(Slot::Aux1, id);
          for (Slot s : {Slot::Aux1, Slot::Route}) read(s, router_of(id));
          if (input_grads) u.push_back({Slot::GateGrad, router_of(id), false});
        }
        if (weight_grads) read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
        if (input_grads) read(gathers_input(op) ? Slot::FullGrad : Slot::Grad, input(id));
        break;
      case OpKind::AttentionCore:
        read(Slot::Grad, id);
        read(Slot::Aux1, id);
        if (cp_ > 1) {
          read(Slot::Kv, id);
          u.push_back({Slot::KvGrad, id, true});
        }
        if (dropout_ > 0) {
          read(Slot::Mask, id);
          read(Slot::Dropped, id);
        }
        read(m_.positions == model::Positions::Rope ? Slot::Aux2 : Slot::Out,
             m_.positions == model::Positions::Rope ? id : input(id));
        read(Slot::Grad, input(id));
        break;
      case OpKind::Residual:
        read(Slot::Grad, id);
        for (OpId pred : g_.predecessors(id)) read(Slot::Grad, pred);
        if (dropout_ > 0) read(Slot::Mask, id);
        break;
      case OpKind::Activation:
        read(Slot::Out, input(id));
        read(Slot::Grad, id);
        read(Slot::Grad, input(id));
        break;
      case OpKind::Router:
        // Both passes take the logits' gradient from the gates'; the input pass also sends
        // the copies' gradients back to their tokens, the weight pass reads the input.
        for (Slot s : {Slot::GateGrad, Slot::Aux1, Slot::Aux2}) read(s, id);
        if (input_grads) {
          for (Slot s : {Slot::Grad, Slot::Route}) read(s, id);
          read(gathers_input(op) ? Slot::FullGrad : Slot::Grad, input(id));
        }
        if (weight_grads) read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
        break;
    }
    return u;
  }

  // What a communication task of a micro-batch reads and makes (a replayed one: the same).
  std::vector<Use> communication_uses(const lower::Task& task) const {
    std::vector<Use> u;
    if (task.micro_batch < 0) return u;
    const auto anchor = static_cast<OpId>(task.op_begin);
    const Slot carried = (task.tag & 1) != 0 ? Slot::Grad : Slot::Out;
    if (task.kind == TaskKind::Send) return {{carried, anchor, false}};
    if (task.kind == TaskKind::Recv) return {{carried, anchor, true}};
    const GroupKind kind = program_.groups.at(static_cast<std::size_t>(task.group)).kind;
    if (kind == GroupKind::Cp) {
      if (task.collective == CollectiveKind::AllGather) {
        return {{Slot::Out, input(anchor), false}, {Slot::Kv, anchor, true}};
      }
      return {{Slot::KvGrad, anchor, false}, {Slot::Grad, input(anchor), false}};
    }
    if (kind == GroupKind::Ep) {
      // ep_collective: what each of the four all-to-alls reads and makes.
      const OpId router = router_of(anchor);
      const bool backward = (task.tag & 1) != 0;
      if (g_.op(anchor).kind == OpKind::MlpUp) {
        return {{backward ? Slot::Grad : Slot::Out, router, false}};
      }
      if (!backward) {
        return {{Slot::Aux1, anchor, false},
                {Slot::Aux1, router, false},
                {Slot::Route, router, false},
                {Slot::Out, anchor, true}};
      }
      return {{Slot::Grad, anchor, false},
              {Slot::Aux1, anchor, false},
              {Slot::Aux1, router, false},
              {Slot::Route, router, false},
              {Slot::GateGrad, router, false}};
    }
    if (kind != GroupKind::Tp) return u;
    const Op& op = g_.op(anchor);
    if (op.kind == OpKind::MlpUp && op.expert) return {{Slot::GateGrad, router_of(anchor), false}};
    const bool exit = op.kind == OpKind::Embedding || row_parallel(op);
    // The embedding's dropout: applied after its forward reduction, undone (sequence
    // parallelism) before its backward all-gather.
    const bool embedding_dropout = op.kind == OpKind::Embedding && dropout_ > 0;
    if (program_.plan.scatter_gather_p2p && task.collective == CollectiveKind::AllGather) {
      return {{carried, anchor, false}};
    }
    if (task.collective == CollectiveKind::ReduceScatter ||
        task.collective == CollectiveKind::AllGather) {
      const bool scatter = task.collective == CollectiveKind::ReduceScatter;
      if (exit && embedding_dropout) {
        return {{scatter ? Slot::Out : Slot::Grad, anchor, false}, {Slot::Mask, anchor, scatter}};
      }
      if (exit) return {{scatter ? Slot::Out : Slot::Grad, anchor, false}};
      const OpId in = input(anchor);
      if (!scatter) return {{Slot::Out, in, false}, {Slot::Full, in, true}};
      return {{Slot::FullGrad, in, false}, {Slot::Grad, in, false}};
    }
    if (op.kind == OpKind::Loss)
      return {{Slot::Out, input(anchor), false}, {Slot::Aux2, anchor, true}};
    if (exit && embedding_dropout) return {{Slot::Out, anchor, false}, {Slot::Mask, anchor, true}};
    if (exit) return {{Slot::Out, anchor, false}};
    return {{Slot::Grad, input(anchor), false}};
  }

  // release_after_[e]: the tensors that event e reads last (nothing later in the step reads
  // them, or a later event makes them afresh first).
  void plan_releases() {
    struct Seen {
      std::size_t event;
      bool make;
    };
    std::map<TensorRef, std::vector<Seen>> seen;
    std::size_t event = 0;
    auto note = [&](int mb, const std::vector<Use>& uses) {
      for (const Use& x : uses) seen[{mb, x.slot, x.id}].push_back({event, x.make});
      ++event;
    };
    for (const lower::Task& task : rp_->tasks) {
      if (task.kind != TaskKind::Compute) {
        note(task.micro_batch, communication_uses(task));
      } else if (lower::in_optimizer_step(task.phase)) {
        note(-1, {});
      } else if (task.phase == Phase::Forward || task.phase == Phase::Recompute) {
        for (auto id = task.op_begin; id < task.op_end; ++id) {
          note(task.micro_batch, forward_uses(static_cast<OpId>(id)));
        }
      } else {
        for (auto id = task.op_end; id-- > task.op_begin;) {
          note(task.micro_batch, backward_uses(static_cast<OpId>(id), part_of(task.phase)));
        }
      }
    }
    release_after_.assign(event, {});
    for (const auto& [tensor, at] : seen) {
      for (std::size_t k = 0; k < at.size(); ++k) {
        if (k + 1 == at.size() || at[k + 1].make) release_after_[at[k].event].push_back(tensor);
      }
    }
  }

  // ZeRO-3: release_weights_after_[i] names the weights that task i reads last before the
  // Program gathers them again (or the step ends): the compute tasks of their ops, and a tied
  // head's of the embedding table it reads.
  void plan_weight_releases() {
    const auto& tasks = rp_->tasks;
    release_weights_after_.assign(tasks.size(), {});
    std::map<Key, std::size_t> last;  // since the weights' gather
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      const lower::Task& task = tasks[i];
      const bool gather = task.kind == TaskKind::Collective && is_dp_group(task) &&
                          task.collective == CollectiveKind::AllGather &&
                          task.op_end > task.op_begin;
      if (gather) {
        for (const Key& key : keys_for(task)) {
          if (const auto it = last.find(key); it != last.end()) {
            release_weights_after_[it->second].push_back(key);
          }
          last[key] = i;
        }
        continue;
      }
      if (task.kind != TaskKind::Compute || lower::in_optimizer_step(task.phase)) continue;
      std::vector<Key> read = keys_of(task.op_begin, task.op_end);
      for (auto id = task.op_begin; id < task.op_end; ++id) {
        const auto op = static_cast<OpId>(id);
        if (tied_head(g_.op(op)) && !params_.count({op, 0})) {
          read.push_back({g_.layer_ops(-1).front(), 0});  // the embedding's table
        }
      }
      for (const Key& key : read) {
        const auto it = last.find(key);
        DTSIM_ASSERT(
            it != last.end(),
            fmt::format("ZeRO-3: {} is read before the Program gathers it", params_.at(key).name));
        it->second = i;
      }
    }
    for (const auto& [key, i] : last) release_weights_after_[i].push_back(key);
  }

  void release_weights(std::size_t task) {
    if (release_weights_after_.empty()) return;
    for (const Key& key : release_weights_after_[task]) {
      Param& p = params_.at(key);
      if (p.separate_work) dev_.release(p.work);
      dev_.release(p.data);
      p.data = p.work = View{};
    }
  }

  // The end of an event: what it read last goes back to the device.
  void retire() {
    if (release_after_.empty()) return;
    DTSIM_ASSERT(event_ < release_after_.size(), "more events than the plan of releases has");
    for (const TensorRef& t : release_after_[event_]) {
      auto& tensors = slot_map(batches_.at(static_cast<std::size_t>(t.micro_batch)), t.slot);
      if (const auto it = tensors.find(t.id); it != tensors.end()) {
        if (t.slot == Slot::Out) {
          batches_[static_cast<std::size_t>(t.micro_batch)].released_out[t.id] = it->second.size();
        }
        dev_.release(it->second);
        tensors.erase(it);
      }
    }
    ++event_;
  }

  // n zeros of the activation type (or `type`).
  View allocate(std::int64_t n) { return dev_.allocate(n, dev_.activations()); }

  // v = n zeros (of the activation type, or `type`); what v held goes back to the device.
  void fresh(View& v, std::int64_t n, std::optional<Dtype> type = std::nullopt) {
    dev_.release(v);
    v = dev_.allocate(n, type.value_or(dev_.activations()));
  }

  // --only-rank: the buffers of replayed collectives started before task `index`, back to the
  // device (a collective's complete, as far as memory goes, once the task after it is done).
  void release_replayed(std::size_t index) {
    std::erase_if(replay_held_, [&](const std::pair<std::size_t, View>& held) {
      if (held.first >= index) return false;
      dev_.release(held.second);
      return true;
    });
  }

  // first_receives_ and next_receive_ from this rank's tasks.
  void plan_receive_streams() {
    const auto& tasks = rp_->tasks;
    next_receive_.assign(tasks.size(), kNoTask);
    std::map<std::int64_t, std::size_t> last;  // peer -> its latest receive task
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      if (tasks[i].kind != TaskKind::Recv) continue;
      const auto [it, first] = last.try_emplace(tasks[i].peer, i);
      if (first) {
        first_receives_.push_back(i);
      } else {
        next_receive_[it->second] = i;
        it->second = i;
      }
    }
  }

  // A pipeline receive posted ahead of need, into its micro-batch's tensor.
  Comm::Handle post_receive(const lower::Task& task) {
    View& buffer = transferred(task);
    fresh(buffer, static_cast<std::int64_t>(Ts_) * C_);
    return comm_.start_recv(peer_rank(task), task.tag, on_the_wire(buffer));
  }

  // What a pipeline transfer of `tensor` sends and receives: all of it, or with scatter/gather
  // (plan.scatter_gather_p2p) this tp rank's 1/tp of it.
  View on_the_wire(View tensor) const {
    if (!program_.plan.scatter_gather_p2p) return tensor;
    const std::int64_t part = tensor.n / tp_;
    return tensor.sub(t_ * part, part);
  }

  // Scatter/gather: the received slices of a pipeline tensor, all-gathered over tp into it.
  void gather_transferred(const lower::Task& task) {
    View& tensor = transferred(task);
    const View part = on_the_wire(tensor);
    const View mine = dev_.allocate(part.n, part.type);
    dev_.copy(mine, part);
    const std::vector<int> counts(static_cast<std::size_t>(tp_), static_cast<int>(part.n));
    comm_.all_gather(task.group, mine, tensor, counts);
    dev_.release(mine);
  }

  // The tensor a send or receive carries: activations (even tags) are an op's output, gradients
  // (odd tags) the gradient of it.
  View& transferred(const lower::Task& task) {
    MicroBatch& mb = batches_.at(static_cast<std::size_t>(task.micro_batch));
    const auto id = static_cast<OpId>(task.op_begin);
    return (task.tag & 1) != 0 ? mb.grad[id] : mb.out[id];
  }

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
  void replay(const lower::Task& task, std::size_t index) {
    const double wait =
        index < options_.predicted_comm_s.size() ? options_.predicted_comm_s[index] : 0.0;
    // The wait comes after the device's queued work, one after the other, as the simulator
    // has them.
    if (wait > 0 && !dev_.host_memory()) dev_.synchronize();
    if (wait > 0) {
      // Sleep most of a long wait, spin the rest: sleeps overshoot by tens of microseconds,
      // more than many collectives last.
      const auto deadline = std::chrono::steady_clock::now() +
                            std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(wait));
      if (wait > 1e-3) {
        std::this_thread::sleep_for(std::chrono::duration<double>(wait - 5e-4));
      }
      while (std::chrono::steady_clock::now() < deadline) {
      }
    }
    const bool dp = task.kind == TaskKind::Collective && is_dp_group(task);
    if (task.kind == TaskKind::Recv) {
      fresh(transferred(task), static_cast<std::int64_t>(Ts_) * C_);
    } else if (dp && zero3_ && task.collective == CollectiveKind::AllGather &&
               task.op_end > task.op_begin) {
      // ZeRO-3: the chunk's weights take their place (this rank's slice, zeros elsewhere).
      gather_weights(task, params_for(task), /*local=*/true);
    } else if (dp && sharded_ && !in_place_ && task.collective == CollectiveKind::ReduceScatter) {
      // ZeRO's reduce-scatter, in memory: its packed copy of the bucket's gradients and its
      // reduced shard, held until the next task is done, as a started collective holds them
      // until it completes; the bucket's gradients (ZeRO-2/3) are gone once packed.
      std::int64_t total = 0;
      for (Param* p : params_for(task)) total += p->n;
      const View packed = dev_.allocate(total, Dtype::F32);
      if (transient_grads_) {
        for (Param* p : params_for(task)) drop_grad(*p);
      }
      replay_held_.push_back({index, packed});
      replay_held_.push_back({index, dev_.allocate(total / shards_of(task).first, Dtype::F32)});
    } else if (task.kind == TaskKind::Collective && task.micro_batch >= 0 &&
               program_.groups.at(static_cast<std::size_t>(task.group)).kind == GroupKind::Tp &&
               !program_.plan.scatter_gather_p2p &&
               (task.collective == CollectiveKind::AllGather ||
                task.collective == CollectiveKind::ReduceScatter)) {
      // Sequence parallelism: the tensors take the shapes the next ops expect.
      const auto anchor = static_cast<OpId>(task.op_begin);
      const Op& op = g_.op(anchor);
      sequence_parallel_collective(task, batches_.at(static_cast<std::size_t>(task.micro_batch)),
                                   anchor, op.kind == OpKind::Embedding || row_parallel(op),
                                   /*local=*/true);
    } else if (task.kind == TaskKind::Collective && task.micro_batch >= 0 &&
               program_.groups.at(static_cast<std::size_t>(task.group)).kind == GroupKind::Tp &&
               task.collective == CollectiveKind::AllReduce &&
               g_.op(static_cast<OpId>(task.op_begin)).kind == OpKind::Embedding) {
      // The embedding's dropout follows its (here skipped) reduction.
      embedding_dropout(batches_.at(static_cast<std::size_t>(task.micro_batch)),
                        static_cast<OpId>(task.op_begin));
    } else if (task.kind == TaskKind::Collective &&
               program_.groups.at(static_cast<std::size_t>(task.group)).kind == GroupKind::Cp) {
      cp_collective(task, batches_.at(static_cast<std::size_t>(task.micro_batch)),
                    /*local=*/true);
    } else if (task.kind == TaskKind::Collective &&
               program_.groups.at(static_cast<std::size_t>(task.group)).kind == GroupKind::Ep) {
      ep_collective(task, batches_.at(static_cast<std::size_t>(task.micro_batch)),
                    /*local=*/true);
    } else if (task.kind == TaskKind::Collective && task.micro_batch >= 0 &&
               program_.groups.at(static_cast<std::size_t>(task.group)).kind == GroupKind::Tp &&
               g_.op(static_cast<OpId>(task.op_begin)).kind == OpKind::Loss) {
      // The loss still needs its softmax statistics: the local ones.
      loss_statistics(task, batches_.at(static_cast<std::size_t>(task.micro_batch)),
                      static_cast<OpId>(task.op_begin), /*reduce=*/false);
    }
  }

  void execute(const lower::Task& task, std::size_t index) {
    if (options_.replay_communication && task.kind != TaskKind::Compute) {
      replay(task, index);
      return;
    }
    switch (task.kind) {
      case TaskKind::Compute: {
        if (task.phase == Phase::Optimizer) {
          optimizer_step();
          retire();
          return;
        }
        if (task.phase == Phase::GradNorm) {
          grad_norm();
          retire();
          return;
        }
        MicroBatch& mb = batches_.at(static_cast<std::size_t>(task.micro_batch));
        // Each op is an event of the plan of releases: what it read last goes back at once.
        if (task.phase == Phase::Forward || task.phase == Phase::Recompute) {
          for (auto id = task.op_begin; id < task.op_end; ++id) {
            forward(mb, static_cast<OpId>(id));
            retire();
          }
        } else if (task.phase == Phase::Backward || task.phase == Phase::BackwardInput ||
                   task.phase == Phase::BackwardWeight) {
          const Part part = part_of(task.phase);
          for (auto id = task.op_end; id-- > task.op_begin;) {
            backward(mb, static_cast<OpId>(id), part);
            retire();
          }
        } else {
          throw UnsupportedError(
              fmt::format("dtexec: phase {} is not executed yet", to_string(task.phase)));
        }
        return;
      }
      case TaskKind::Collective:
        collective(task, index);
        return;
      case TaskKind::Send:
      case TaskKind::Recv: {
        View& buffer = transferred(task);
        if (task.kind == TaskKind::Send) {
          comm_.send(peer_rank(task), task.tag, on_the_wire(buffer));
        } else if (const auto posted = posted_.find(index); posted != posted_.end()) {
          comm_.finish(posted->second);
          posted_.erase(posted);
          if (const std::size_t next = next_receive_[index]; next != kNoTask) {
            posted_[next] = post_receive(rp_->tasks[next]);
          }
        } else {
          fresh(buffer, static_cast<std::int64_t>(Ts_) * C_);
          comm_.recv(peer_rank(task), task.tag, on_the_wire(buffer));
        }
        return;
      }
    }
  }

  // ---- checkpoints -------------------------------------------------------------------------

  // Every rank writes its part of each full tensor (its tensor-parallel slice; its dp slice under
  // ZeRO >= 1, where only the owner's weights and AdamW state are current) to a shard of its
  // own; rank 0 then writes the index. The tied copy is the embedding and is not written twice;
  // unsharded, the first replica writes (an expert's: the first of its expert-dp group).
  bool in_checkpoint(const Param& p) const {
    return canonical_copy(p) && (sharded_ || (p.expert ? ed_ : d_) == 0);
  }

  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }

  // A synchronous save: returns the step, and on rank 0 the bytes of the shards and their number.
  CheckpointRecord save(int steps_done, const std::vector<double>& losses) {
    if (comm_.rank() == 0) begin_checkpoint(options_.checkpoint_dir);
    comm_.barrier();
    // Each piece copied to host memory, then written. The copies are timed apart: they are what
    // an asynchronous save stops training for (dtsim --checkpoint-async-gbs-per-gpu), into
    // buffers sized once, as such a save keeps its host buffers from one checkpoint to the next.
    ShardWriter shard(options_.checkpoint_dir, comm_.rank());
    std::size_t largest = 0;
    for (const auto& [key, p] : params_) {
      if (in_checkpoint(p)) {
        largest = std::max(largest, static_cast<std::size_t>(p.own_end - p.own_begin));
      }
    }
    std::vector<float> weights(largest), m(largest), v(largest);
    double copy_s = 0, copied_bytes = 0;
    for (const auto& [key, p] : params_) {
      if (!in_checkpoint(p)) continue;
      const auto n = static_cast<std::size_t>(p.own_end - p.own_begin);
      const auto copy_start = std::chrono::steady_clock::now();
      for (auto [host, part] : {std::pair{&weights, master_slice(p)}, {&m, p.m}, {&v, p.v}}) {
        dev_.download(host->data(), part);
      }
      copy_s += seconds_since(copy_start);
      copied_bytes += 3.0 * sizeof(float) * static_cast<double>(n);
      shard.add(p.name, p.slice, p.own_begin, std::span(weights).first(n), std::span(m).first(n),
                std::span(v).first(n));
    }
    return put_in_place(steps_done, shard.close(), copy_s, copied_bytes, 0.0, 0.0, losses);
  }

  // Every rank's shard written (`index` this rank's): gathers the indices, which also says that
  // every shard is written, and the slowest rank's times; rank 0 writes checkpoint.json and
  // moves the folder into place.
  CheckpointRecord put_in_place(int step, const nlohmann::json& index, double copy_s,
                                double copied_bytes, double write_s, double blocking_s,
                                const std::vector<double>& losses) {
    const auto indices = comm_.gather_to_root(index.dump());
    CheckpointRecord record{.step = step};
    // The slowest rank's copy, write and wait, and the lowest rate of a rank that copied anything.
    std::array<double, 4> slowest = {copy_s,
                                     copy_s > 0 && copied_bytes > 0
                                         ? -copied_bytes / copy_s
                                         : -std::numeric_limits<double>::infinity(),
                                     write_s, blocking_s};
    comm_.all_ranks(slowest, Reduce::Max);
    record.copy_s = slowest[0];
    record.copy_bytes_per_s = std::isfinite(slowest[1]) ? -slowest[1] : 0.0;  // 0: none copied
    record.write_s = slowest[2];
    record.blocking_s = slowest[3];
    if (comm_.rank() != 0) return record;
    std::vector<nlohmann::json> shards;
    for (const auto& shard : indices) {
      shards.push_back(nlohmann::json::parse(shard));
      if (!shards.back().is_null()) ++record.shards;
    }
    CheckpointInfo c;
    c.model = m_.name;
    c.plan = plan::to_json(p_);
    c.step = step;
    c.seed = options_.seed;
    c.learning_rate = options_.lr.max_lr;
    c.weight_decay = options_.weight_decay;
    c.lr_schedule = options_.lr.to_json();
    c.losses = losses;
    record.bytes = finish_checkpoint(options_.checkpoint_dir, c, shards);
    return record;
  }

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
  void prepare_async_saves(RunResult& result) {
    const auto started = std::chrono::steady_clock::now();
    std::size_t total = 0;
    for (const auto& [key, p] : params_) {
      if (!in_checkpoint(p)) continue;
      const auto n = static_cast<std::size_t>(p.own_end - p.own_begin);
      async_.pieces.push_back({&p, total, n});
      total += 3 * n;
    }
    async_.host.assign(total, 0.0f);
    std::array<double, 2> largest = {sizeof(float) * static_cast<double>(total),
                                     seconds_since(started)};
    comm_.all_ranks(largest, Reduce::Max);
    result.checkpoint_host_bytes = largest[0];
    result.checkpoint_host_seconds = largest[1];
  }

  bool writing() const { return async_.active && !async_.written.load(std::memory_order_acquire); }

  void start_async_save(int steps_done, RunResult& result) {
    // The save before it still writing: training waits for it here (its blocking time).
    if (async_.active) put_async_in_place(steps_done, result);
    const auto started = std::chrono::steady_clock::now();
    if (comm_.rank() == 0) begin_checkpoint(options_.checkpoint_dir);
    comm_.barrier();
    const auto copy_start = std::chrono::steady_clock::now();
    for (const SnapshotPiece& piece : async_.pieces) {
      float* at = async_.host.data() + piece.at;
      dev_.download(at, master_slice(*piece.p));
      dev_.download(at + piece.n, piece.p->m);
      dev_.download(at + 2 * piece.n, piece.p->v);
    }
    async_.copy_s = seconds_since(copy_start);
    async_.step = steps_done;
    async_.losses = result.losses;
    async_.started = started;
    async_.index = nullptr;
    async_.error = nullptr;
    async_.write_s = 0;
    async_.written.store(false);
    async_.active = true;
    async_.blocking_s = seconds_since(started);
    async_.writer = std::jthread([this, dir = options_.checkpoint_dir, rank = comm_.rank()] {
      const auto start = std::chrono::steady_clock::now();
      try {
        ShardWriter shard(dir, rank);
        for (const auto& piece : async_.pieces) {
          const std::span<const float> all(async_.host.data() + piece.at, 3 * piece.n);
          shard.add(piece.p->name, piece.p->slice, piece.p->own_begin, all.first(piece.n),
                    all.subspan(piece.n, piece.n), all.subspan(2 * piece.n, piece.n));
        }
        async_.index = shard.close();
      } catch (...) {
        async_.error = std::current_exception();
      }
      async_.write_s = seconds_since(start);
      async_.written.store(true, std::memory_order_release);
    });
  }

  // Every rank's shard of the save in flight written (or, at its next save or the run's end,
  // waited for): puts it in place at the end of step `done`. A rank whose writer failed throws
  // its error here (the CLI then ends every rank).
  void put_async_in_place(int done, RunResult& result) {
    const auto started = std::chrono::steady_clock::now();
    async_.writer.join();
    async_.active = false;
    if (async_.error) std::rethrow_exception(async_.error);
    CheckpointRecord record = put_in_place(async_.step, async_.index, async_.copy_s,
                                           sizeof(float) * static_cast<double>(async_.host.size()),
                                           async_.write_s, async_.blocking_s, async_.losses);
    record.asynchronous = true;
    record.blocking_s += seconds_since(started);
    record.seconds = seconds_since(async_.started);
    record.in_place_after = done;
    checkpoint_done(record, result);
  }

  int resume(RunResult& result) {
    const CheckpointReader checkpoint(options_.resume_dir);
    const CheckpointInfo& c = checkpoint.info();
    const std::string& where = checkpoint.where();
    if (c.model != m_.name) {
      throw InputError(fmt::format("{}: model: the checkpoint is of {}, this run trains {}", where,
                                   c.model, m_.name));
    }
    // The data stream and its token mapping come from the seed, and the optimizer from the
    // learning rate: a run resumed with others would not continue the checkpointed one.
    if (c.seed != options_.seed) {
      throw InputError(
          fmt::format("{}: seed: the checkpoint was trained with --seed {}, this run "
                      "has --seed {}; give --seed {} to continue it",
                      where, c.seed, options_.seed, c.seed));
    }
    if (static_cast<float>(c.learning_rate) != options_.lr.max_lr) {
      throw InputError(
          fmt::format("{}: learning_rate: the checkpoint was trained with --lr {}, "
                      "this run has --lr {}; give --lr {} to continue it",
                      where, static_cast<float>(c.learning_rate), options_.lr.max_lr,
                      static_cast<float>(c.learning_rate)));
    }
    if (static_cast<float>(c.weight_decay) != options_.weight_decay) {
      throw InputError(
          fmt::format("{}: weight_decay: the checkpoint was trained with --weight-decay {}, "
                      "this run has --weight-decay {}; give --weight-decay {} to continue it",
                      where, static_cast<float>(c.weight_decay), options_.weight_decay,
                      static_cast<float>(c.weight_decay)));
    }
    const double clipped = c.plan.is_object() ? c.plan.value("clip_grad", 0.0) : 0.0;
    if (clipped != p_.clip_grad) {
      throw InputError(fmt::format(
          "{}: clip_grad: the checkpoint was trained with --clip-grad {:g}, this run has "
          "--clip-grad {:g}; give --clip-grad {:g} to continue it",
          where, clipped, p_.clip_grad, clipped));
    }
    // Checkpoints from before schedules trained at a constant rate.
    LrSchedule trained;
    trained.max_lr = static_cast<float>(c.learning_rate);
    if (!c.lr_schedule.is_null()) trained = lr_schedule_from_json(c.lr_schedule, where);
    if (!(trained == options_.lr)) {
      throw InputError(fmt::format(
          "{}: lr_schedule: the checkpoint was trained with a learning rate of {}, this run "
          "has {}; give the same --lr-warmup-steps, --lr-decay-style, --lr-decay-steps and "
          "--min-lr to continue it",
          where, trained.describe(), options_.lr.describe()));
    }
    if (c.step >= options_.steps) {
      throw InputError(
          fmt::format("{}: step: the checkpoint is at step {}; --steps {} leaves "
                      "nothing to run",
                      where, c.step, options_.steps));
    }
    // Each tensor's tp slice read from the pieces that hold it, whatever plan wrote them (one
    // tensor at a time: a rank never holds the whole checkpoint, nor reads other tp slices).
    for (auto& [key, p] : params_) {
      const auto* shape = checkpoint.shape(p.name);
      if (shape == nullptr || *shape != std::vector<std::int64_t>{p.slice.rows, p.slice.cols}) {
        throw InputError(fmt::format("{}: tensors: no {} of shape [{}, {}]", where, p.name,
                                     p.slice.rows, p.slice.cols));
      }
      const CheckpointTensor t = checkpoint.read_slice(p.name, p.slice);
      // Of its tp slice, each rank keeps its dp slice where it holds only that.
      load_weights(p, t.data.data());
      dev_.upload(p.m, t.m.data() + p.own_begin);
      dev_.upload(p.v, t.v.data() + p.own_begin);
    }
    adam_step_ = c.step;
    result.losses = c.losses;
    return c.step;
  }

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
  std::vector<std::size_t> open_sends_;
  // Receives posted ahead of need (overlapped pipeline transfers), by task index.
  std::map<std::size_t, Comm::Handle> posted_;
  // --only-rank: buffers of replayed collectives, by the task that started them.
  std::vector<std::pair<std::size_t, View>> replay_held_;
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
  int B_ = 0, S_ = 0, T_ = 0, C_ = 0, V_ = 0, H_ = 0, G_ = 0, D_ = 0, F_ = 0, Vl_ = 0;
  int tokens_ = 0;
  int micro_batches_ = 1, adam_step_ = 0;
  View grad_norm_sq_;  // gradient clipping: the squared norm (fp32, one element)
  // Last: its writer is joined before anything else of the runner goes.
  AsyncSave async_;
};

}  // namespace

std::vector<std::string> execution_notes(const model::ModelSpec& spec, const plan::Plan& plan) {
  std::vector<std::string> notes;
  if (spec.dropout) {
    notes.push_back(fmt::format(
        "dropout at rate {:g} on the embedding, the attention probabilities and both residual "
        "branches (GPT-2's and Megatron-LM's rate), its masks a hash of each element's sequence "
        "and position",
        kDropoutRate));
  }
  if (spec.moe) {
    notes.push_back(fmt::format(
        "mixture of experts: each token to its top {} of {} experts by router logit, weighted by "
        "the softmax of those logits (Mixtral's routing); dropless, no load-balancing loss",
        spec.moe->top_k, spec.moe->experts));
  }
  if (auto padding = plan::vocab_padding_note(spec, plan)) {
    notes.push_back(*padding + "; tokens are drawn from the first " + std::to_string(spec.vocab));
  }
  if (auto uneven = plan::uneven_layers_note(spec, plan)) notes.push_back(*uneven);
  if (plan.cp > 1) {
    notes.push_back(fmt::format(
        "context parallelism: each rank holds 2 of {} chunks of every sequence (Megatron-LM's "
        "load balancing); K and V all-gathered, their gradients reduce-scattered",
        2 * plan.cp));
  }
  if (plan.attention == model::AttentionKernel::Flash) {
    notes.push_back(
        "attention: FlashAttention's memory and recompute (each row's log-sum-exp kept, the "
        "scores and dropout masks computed again in the backward); the CPU kernel takes a "
        "query's whole row of keys at once, not FlashAttention's tiles");
  }
  if (plan.expert_load != 1) {
    notes.push_back(fmt::format(
        "expert load {:g}: dtsim's figures beside the run assume it; the run routes its tokens "
        "for real (expert_load in --json says how unevenly)",
        plan.expert_load));
  }
  return notes;
}

void check_device(const model::ModelGraph& graph, const lower::Program& program,
                  const Device& device) {
  const model::ModelSpec& m = graph.spec();
  auto lacks = [&](const std::string& what) {
    throw UnsupportedError(
        fmt::format("dtexec: {} is not executed on {} yet", what, device.name()));
  };
  if (program.plan.cp > 1 && !device.has(Device::Feature::ContextParallelism)) {
    lacks(fmt::format("context parallelism (cp {})", program.plan.cp));
  }
  if (m.dropout && !device.has(Device::Feature::Dropout)) {
    lacks(
        fmt::format("dropout (model {}; --no-dropout trains the model without it, and dtsim "
                    "--no-dropout predicts that)",
                    m.name));
  }
  if (m.moe && !device.has(Device::Feature::MixtureOfExperts)) {
    lacks(fmt::format("a mixture of experts (model {})", m.name));
  }
  if (program.plan.clip_grad > 0 && !device.has(Device::Feature::GradClip)) {
    lacks(fmt::format("gradient clipping (--clip-grad {:g})", program.plan.clip_grad));
  }
  if (graph.attention() == model::AttentionKernel::Flash &&
      !device.has(Device::Feature::FlashAttention)) {
    lacks("FlashAttention's memory (plan attention flash; --attention unfused runs without it)");
  }
}

void check_runnable(const model::ModelGraph& graph, const lower::Program& program,
                    bool one_program_alone) {
  const model::ModelSpec& m = graph.spec();
  const plan::Plan& p = program.plan;
  auto refuse = [&](const std::string& what) {
    throw UnsupportedError(fmt::format("dtexec: {} is not executed yet", what));
  };
  if (p.cp > 1 && p.seq_len % (2 * p.cp) != 0) {
    refuse(
        fmt::format("context parallelism cp {} with sequence length {}, not divisible by 2·cp "
                    "(each rank takes two of 2·cp chunks)",
                    p.cp, p.seq_len));
  }
  if (p.grad_compression < 1) {
    refuse(fmt::format("gradient compression ({:g} of the bytes)", p.grad_compression));
  }
  if (p.comm_precision && *p.comm_precision != p.precision) {
    refuse(fmt::format("communication in {} while training in {}", to_string(*p.comm_precision),
                       to_string(p.precision)));
  }
  if (plan::gradient_precision(p) != Precision::Fp32) {
    refuse(fmt::format("{} gradients (dtexec accumulates and reduces them in fp32)",
                       to_string(plan::gradient_precision(p))));
  }
  if (p.ep > 1 && p.zero_stage >= 1 && p.dp / p.ep * p.cp == 1) {
    refuse(
        fmt::format("ZeRO-{} with expert parallelism where each expert has one data-parallel "
                    "rank (dp {} / ep {} x cp {})",
                    p.zero_stage, p.dp, p.ep, p.cp));
  }
  if (p.sequence_parallel && (p.micro_batch_size * p.seq_len / p.cp) % p.tp != 0) {
    refuse(fmt::format(
        "sequence parallelism with {} tokens per micro-batch and rank, not divisible by tp {}",
        p.micro_batch_size * p.seq_len / p.cp, p.tp));
  }
  if (p.schedule == plan::Schedule::PipeDreamAsync) refuse("the PipeDream (asynchronous) schedule");
  if (m.heads % p.tp != 0 || m.kv_heads % p.tp != 0 || m.ffn_hidden % p.tp != 0 ||
      m.vocab_rows() % p.tp != 0) {
    refuse(fmt::format("tp {} that does not divide heads {}, kv heads {}, ffn {} and vocab {}",
                       p.tp, m.heads, m.kv_heads, m.ffn_hidden, m.vocab_rows()));
  }
  if (p.devices() > 1 && program.lowering != lower::Lowering::AllRanks && !one_program_alone) {
    throw InternalError("a multi-rank run needs the program lowered for all ranks");
  }
}

RunResult run_program(const model::ModelGraph& graph, const lower::Program& program,
                      const RunOptions& options, Comm& comm, Device& device) {
  DTSIM_ASSERT(options.steps >= 1, "at least one step");
  return Runner(graph, program, options, comm, device).run();
}

RunResult run_program(const model::ModelGraph& graph, const lower::Program& program,
                      const RunOptions& options, Comm& comm) {
  cpu::CpuDevice device;
  return run_program(graph, program, options, comm, device);
}

}  // namespace dtsim::exec
