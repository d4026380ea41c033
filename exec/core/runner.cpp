// The Program runner (exec/core/runner_internal.hpp): the step loop and the execution of a
// task, the parameters and their initialisation, the micro-batches' data, the optimizer; and
// the entry points of exec/core/runner.hpp.
#include "exec/core/runner.hpp"

#include <fmt/ranges.h>

#include "exec/core/runner_internal.hpp"
#include "exec/core/timing_stats.hpp"

namespace dtsim::exec::runner_internal {

Runner::Runner(const model::ModelGraph& g, const lower::Program& program, const RunOptions& options,
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
        fmt::format("{} ranks on {}: this communication backend moves host memory only",
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
  local_dispatch_ = plan::moe_local_dispatch(m_, p_);
  Tr_ = local_dispatch_ ? Ts_ : T_;
  C_ = static_cast<int>(m_.hidden);
  V_ = static_cast<int>(m_.vocab_rows());  // the embedding and LM head's rows (padded)
  tokens_ = static_cast<int>(m_.vocab);    // the data's vocabulary
  H_ = static_cast<int>(m_.heads / tp_);
  G_ = static_cast<int>(m_.kv_heads / tp_);
  D_ = static_cast<int>(m_.head_dim);
  Dv_ = static_cast<int>(m_.v_head_dim());
  if (m_.mla) {
    Rq_ = static_cast<int>(m_.mla->q_lora_rank);
    Rkv_ = static_cast<int>(m_.mla->kv_lora_rank);
    Dn_ = static_cast<int>(m_.mla->qk_nope_head_dim);
    Dr_ = static_cast<int>(m_.mla->qk_rope_head_dim);
  }
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

namespace {

// A value that is not finite, as a person writes it (fmt prints -nan for a NaN with its sign
// bit set, which is meaningless).
std::string not_finite(double v) {
  if (std::isnan(v)) return "NaN";
  return v > 0 ? "+inf" : "-inf";
}

}  // namespace

RunResult Runner::run() {
  RunResult result;
  int first = 0;
  if (!options_.resume_dir.empty()) first = resume(result);
  result.first_step = first;
  t0_ = std::chrono::steady_clock::now();
  result.clock_origin_s = std::chrono::duration<double>(t0_.time_since_epoch()).count();
  records_ = &result.tasks;
  auto now = [&] { return since_start(std::chrono::steady_clock::now()); };
  const auto& tasks = rp_->tasks;
  Watchdog watchdog(options_, *rp_, comm_.size() > 1);
  watchdog_ = &watchdog;
  // (Gone with it, however run() ends.)
  struct Unwatch {
    Watchdog*& watched;
    ~Unwatch() { watched = nullptr; }
  } unwatch{watchdog_};
  if (options_.checkpoint_async && !options_.checkpoint_dir.empty()) prepare_async_saves(result);
  for (int step = first; step < options_.steps; ++step) {
    step_ = step;
    if (me_ == options_.fail_rank && step + 1 == options_.fail_step) std::raise(SIGKILL);
    if (me_ == options_.hang_rank && step + 1 == options_.hang_step &&
        !options_.hang_in_checkpoint) {
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
    // hold a buffer per micro-batch; Megatron-LM posts one ahead too). On a GPU not in the
    // process's first step: cuBLASLt loads its kernels at a GEMM's first use
    // (cuLibraryLoadData), which waits for the whole device, and a receive posted ahead waits
    // there for a peer that may be waiting for this rank's next send. Seen on an H200
    // (2026-12-04, two ranks sharing it, fp32): both ranks' hosts stopped in that load, each
    // in its first forward. The first step (a warm-up one by default) receives when it gets
    // there, and loads every GEMM's kernels.
    const bool loads_kernels = !dev_.host_memory() && step == first;
    if (program_.plan.overlap_p2p_comm && !options_.replay_communication && !loads_kernels) {
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
      comm_.take_transfer_marks();  // numbered before the clear
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
      // A started collective or a send on a stream of the backend's own: its marks there (a
      // compute task's gathers and reductions are its own time).
      const auto transfer = comm_.take_transfer_marks();
      if (queued && timed && transfer && tasks[i].kind != TaskKind::Compute) {
        marks.push_back({static_cast<int>(i), transfer->start, transfer->end});
      } else if (queued && timed) {
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
    // The step's end is watched for a peer that does not come; on a device that queues work,
    // from after its wait for that work (which the backend's own deadline bounds: the NCCL
    // backend's wait_sends, --task-timeout, and a long step on one GPU is no hang).
    if (!queued) watchdog.begin_step_end();
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
      watchdog.begin_step_end();
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
    watchdog.end();
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
    // A checkpoint's writes and the ranks' agreement on them are watched as a step's end is.
    if (async_.active && slowest[1] == 0) {
      watchdog.begin_checkpoint(async_.step);
      put_async_in_place(done, result);
      watchdog.end();
    }
    // A loss or gradient norm that is not finite ends the run, on every rank at once (both
    // are reduced over all ranks), as Megatron-LM's --check-for-nan-in-loss-and-grad does:
    // before this step's line is printed (not a `nan` loss) and its checkpoint written (an
    // earlier asynchronous one, complete, is put in place first). The loss is the forward's,
    // before this step's update: without --clip-grad (no norm) gradients that overflow show in
    // the next step's loss, after this step's checkpoint. (Replayed communication feeds made-up
    // values: its losses mean nothing.)
    const double loss_now = result.losses.back();
    if (!options_.replay_communication && !(std::isfinite(loss_now) && std::isfinite(grad_norm))) {
      const bool loss_bad = !std::isfinite(loss_now);
      throw InputError(fmt::format(
          "step {}: the {} is not finite ({}): training diverged; a smaller --lr (its peak "
          "is {:g}){} may keep it finite",
          done, loss_bad ? "loss" : "gradient norm", not_finite(loss_bad ? loss_now : grad_norm),
          options_.lr.max_lr,
          p_.clip_grad > 0 ? fmt::format(" or a smaller --clip-grad (it is {:g})", p_.clip_grad)
                           : std::string(" or --clip-grad")));
    }
    if (options_.on_step) {
      options_.on_step(done, result.losses.back(), slowest[0], grad_norm);
    }
    if (!options_.checkpoint_dir.empty() &&
        (done == options_.steps ||
         (options_.checkpoint_every > 0 && done % options_.checkpoint_every == 0))) {
      // (The hung rank stops before its own watch: its peers find it.)
      if (me_ == options_.hang_rank && done == options_.hang_step && options_.hang_in_checkpoint) {
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      watchdog.begin_checkpoint(done);
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
      watchdog.end();
    }
  }
  // The last save, if still writing, is waited for: the run ends with it in place.
  if (async_.active) {
    watchdog.begin_checkpoint(async_.step);
    put_async_in_place(options_.steps, result);
    watchdog.end();
  }
  for (auto& mb : batches_) release(mb);
  batches_.clear();
  result.replay_input_bytes =
      static_cast<double>(replay_input_.n) * static_cast<double>(bytes_of(replay_input_.type));
  dev_.release(replay_input_);
  replay_input_ = View{};
  result.step_time_s = median(std::vector<double>(
      result.step_times_s.begin() +
          std::min<std::ptrdiff_t>(options_.warmup_steps,
                                   static_cast<std::ptrdiff_t>(result.step_times_s.size()) - 1),
      result.step_times_s.end()));
  result.expert_load = expert_load_count_ > 0 ? expert_load_sum_ / expert_load_count_ : 0.0;
  result.expert_load_peak = expert_load_peak_;
  return result;
}

int Runner::member_index(GroupKind kind) const {
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

std::vector<OpId> Runner::my_ops() const {
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

std::vector<std::pair<int, Slice>> Runner::slices(const Op& op, int t) const {
  // (The MLP's width: a dense block's, or a mixture's shared experts'.)
  const std::int64_t C = C_, V = V_, F = m_.dense_ffn(op.layer), D = D_;
  const std::int64_t Hf = m_.heads, Gf = m_.kv_heads, H = H_, G = G_, Fl = F / tp_, Vl = Vl_;
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
    case OpKind::Norm: {
      // (Multi-head latent attention's latents' norm: r_q + r_kv wide.)
      const std::int64_t width = latent_norm(op) ? Rq_ + Rkv_ : C;
      out.push_back({0, whole(1, width)});
      if (op.params > static_cast<std::uint64_t>(width)) out.push_back({1, whole(1, width)});
      break;
    }
    case OpKind::LatentDown:  // [h, r_q + r_kv + d_r], the same on every tp rank
      out.push_back({0, whole(C, m_.latent_width())});
      break;
    case OpKind::QkvProj: {
      if (m_.mla) {
        // Column-parallel by heads: a head's query columns (d_n + d_r), or its key and value
        // columns (d_n + d_v), side by side.
        const Projection what = projection(op);
        const std::int64_t head = what == Projection::KvUp ? Dn_ + Dv_ : D;
        const std::int64_t K = what == Projection::QUp ? Rq_ : what == Projection::KvUp ? Rkv_ : C;
        out.push_back({0, cols(K, Hf * head, {{t * H * head, H * head}})});
        break;
      }
      const std::int64_t N = (Hf + 2 * Gf) * D;
      std::vector<std::pair<std::int64_t, std::int64_t>> r = {
          {t * H * D, H * D}, {Hf * D + t * G * D, G * D}, {(Hf + Gf) * D + t * G * D, G * D}};
      out.push_back({0, cols(C, N, r)});
      if (has_bias) out.push_back({1, cols(1, N, r)});
      break;
    }
    case OpKind::AttnOutProj: {
      const std::int64_t Dv = Dv_;
      out.push_back({0, rows(Hf * Dv, C, t * H * Dv, H * Dv)});
      if (has_bias) out.push_back({1, whole(1, C)});
      break;
    }
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

std::vector<float> Runner::initial(OpId id, int which, const Slice& s) const {
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

float Runner::standard_normal(std::uint64_t stream, std::int64_t index) {
  const std::uint64_t bits = counter_hash(stream, static_cast<std::uint64_t>(index), 0x6e6f726dULL);
  const double u1 = (static_cast<double>(bits >> 32) + 1.0) / 4294967296.0;
  const double u2 = (static_cast<double>(bits & 0xffffffffULL) + 1.0) / 4294967296.0;
  constexpr double kTwoPi = 6.283185307179586;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(kTwoPi * u2));
}

void Runner::init_params() {
  const std::map<Key, Param::Flat> flat =
      in_place_ ? plan_flat_layout() : std::map<Key, Param::Flat>{};
  for (OpId id : my_ops()) {
    const Op& op = g_.op(id);
    std::uint64_t have = 0;
    for (auto& [which, slice] : slices(op, t_)) {
      if (op.expert && !local_expert(which / 2)) continue;  // another ep rank's
      Param p;
      p.slice = slice;
      // A tied head's copy starts from (and is saved as) the embedding matrix.
      const OpId source = saved_as(id);
      p.tied_copy = source != id;
      p.norm = op.kind == OpKind::Norm;
      p.sequence_share = p_.sequence_parallel && p_.tp > 1 &&
                         (p.norm || (op.kind == OpKind::Router && local_dispatch_) ||
                          op.kind == OpKind::LatentDown);
      // AdamW's weight decay: matrices and embedding tables (the learned positions are the
      // embedding's second tensor), not biases or norms' weights (Megatron-LM's
      // no_weight_decay_cond: ".bias" and 1-D parameters).
      p.decays = !p.norm && (which % 2 == 0 || op.kind == OpKind::Embedding);
      p.expert = op.expert;
      p.name = tensor_name(source, which);
      const std::vector<float> values = initial(source, which, slice);
      const auto n = static_cast<std::int64_t>(values.size());
      p.n = n;
      const int shards = op.expert ? edp_ : dp_, mine = op.expert ? ed_ : d_;
      p.own_begin = sharded(p) ? n * mine / shards : 0;
      p.own_end = sharded(p) ? n * (mine + 1) / shards : n;
      if (in_place_) {
        p.flat = flat.at({id, which});
        std::tie(p.own_begin, p.own_end) = flat_slice(p, mine);
      }
      const std::int64_t own = p.own_end - p.own_begin;
      p.separate_work = dev_.activations() != Dtype::F32 && gemm_weight(op, which);
      p.work_only = work_only(op, which);
      if (sharded_master(p)) p.shard = dev_.allocate(own, Dtype::F32);
      if (!zero3(p)) {
        // In place, the tensors gathered lie in one buffer per type, in the gradients' order.
        const auto place = [&](View storage, Dtype type) {
          return in_place_ ? storage.sub(p.flat.weight_at, n) : dev_.allocate(n, type);
        };
        p.work = p.separate_work ? (p.work_only ? place(work_storage_, dev_.activations())
                                                : dev_.allocate(n, dev_.activations()))
                                 : View{};
        if (!p.work_only || !sharded(p)) p.data = place(weight_storage_, Dtype::F32);
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
    if (sharded(p)) {
      p.reduced = transient_grads_ ? dev_.allocate(p.own_end - p.own_begin, Dtype::F32)
                                   : p.grad.sub(p.own_begin, p.own_end - p.own_begin);
    }
  }
}

bool Runner::gemm_weight(const Op& op, int which) const {
  return (which == 0 && (op.kind == OpKind::QkvProj || op.kind == OpKind::AttnOutProj ||
                         op.kind == OpKind::LmHead || op.kind == OpKind::Router ||
                         op.kind == OpKind::LatentDown ||
                         (op.kind == OpKind::Embedding && m_.tied_embeddings))) ||
         (which % 2 == 0 && (op.kind == OpKind::MlpUp || op.kind == OpKind::MlpDown));
}

std::map<Key, Param::Flat> Runner::plan_flat_layout() {
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
        DTSIM_ASSERT(flat.at(keys[k]).at == begin + size, "ZeRO in place: a bucket is contiguous");
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
    DTSIM_ASSERT(f.shards > 0,
                 fmt::format("ZeRO in place: {} is in no gradient bucket", g_.op(key.first).name));
  }
  weight_storage_ = dev_.allocate(weights[0], Dtype::F32);
  if (weights[1] > 0) work_storage_ = dev_.allocate(weights[1], dev_.activations());
  return flat;
}

std::pair<std::int64_t, std::int64_t> Runner::flat_slice(const Param& p, int r) {
  const Param::Flat& f = p.flat;
  const std::int64_t lo = f.bucket_begin + f.bucket_size * r / f.shards - f.at;
  const std::int64_t hi = f.bucket_begin + f.bucket_size * (r + 1) / f.shards - f.at;
  const std::int64_t begin = std::clamp<std::int64_t>(lo, 0, p.n);
  return {begin, std::clamp<std::int64_t>(hi, begin, p.n)};
}

void Runner::load_weights(Param& p, const float* full) {
  if (sharded_master(p)) dev_.upload(p.shard, full + p.own_begin);
  if (zero3(p)) return;
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

OpId Runner::saved_as(OpId id) const {
  const Op& op = g_.op(id);
  return op.kind == OpKind::LmHead && op.params == 0 ? g_.layer_ops(-1).front() : id;
}

std::string Runner::tensor_name(OpId id, int which) const {
  const Op& op = g_.op(id);
  return fmt::format("{}.{}{}", op.name, op.expert ? fmt::format("e{}.", which / 2) : "",
                     which % 2 == 0 ? "weight" : "bias");
}

Param& Runner::param(OpId id, int which) {
  Param* p = find(id, which);
  DTSIM_ASSERT(p != nullptr,
               fmt::format("rank {} holds no tensor {} of {}", me_, which, g_.op(id).name));
  return *p;
}

std::vector<Param*> Runner::params_of(std::int32_t begin, std::int32_t end) {
  std::vector<Param*> out;
  for (auto it = params_.lower_bound({static_cast<OpId>(begin), 0});
       it != params_.end() && it->first.first < static_cast<OpId>(end); ++it) {
    out.push_back(&it->second);
  }
  return out;
}

std::vector<Key> Runner::keys_of(std::int32_t begin, std::int32_t end) const {
  std::vector<Key> out;
  for (auto it = params_.lower_bound({static_cast<OpId>(begin), 0});
       it != params_.end() && it->first.first < static_cast<OpId>(end); ++it) {
    out.push_back(it->first);
  }
  return out;
}

bool Runner::holds_weights(OpId id) const {
  const Op& op = g_.op(id);
  const int first = op.expert ? 2 * e_ * static_cast<int>(m_.moe->experts / ep_) : 0;
  return params_.count({id, first}) > 0;
}

std::vector<Param*> Runner::params_for(const lower::Task& task) {
  auto out = task.op_end > task.op_begin ? params_of(task.op_begin, task.op_end)
                                         : params_of(0, static_cast<std::int32_t>(g_.size()));
  std::erase_if(out, [&](const Param* p) { return p->expert != expert_group(task); });
  return out;
}

std::vector<Key> Runner::keys_for(const lower::Task& task) const {
  auto out = keys_of(task.op_begin, task.op_end);
  std::erase_if(out, [&](const Key& k) { return params_.at(k).expert != expert_group(task); });
  return out;
}

void Runner::place_positions() {
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

void Runner::make_batch(MicroBatch& mb, int step, int j) {
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

std::int64_t Runner::output_size(const MicroBatch& mb, OpId id) const {
  const auto out = mb.out.find(id);
  return out != mb.out.end() ? out->second.size() : mb.released_out.at(id);
}

View& Runner::grad_of(MicroBatch& mb, OpId id) {
  auto& gbuf = mb.grad[id];
  if (gbuf.empty()) fresh(gbuf, output_size(mb, id));
  return gbuf;
}

std::pair<View*, std::int64_t> Runner::input_grad_slot(MicroBatch& mb, OpId id) {
  const OpId in = input(id);
  if (gathers_input(g_.op(id))) return {&mb.full_grad[in], static_cast<std::int64_t>(T_) * C_};
  return {&mb.grad[in], output_size(mb, in)};
}

View& Runner::input_grad_of(MicroBatch& mb, OpId id) {
  const auto [g, n] = input_grad_slot(mb, id);
  if (g->empty()) fresh(*g, n);
  return *g;
}

void Runner::add_to_grad(MicroBatch& mb, OpId id, View d) {
  View& g = mb.grad[id];
  if (!g.empty()) {
    dev_.accumulate(g, d);
    return;
  }
  fresh_for_overwrite(g, output_size(mb, id));
  dev_.copy(g, d);
}

Runner::GradOut Runner::input_grad_to_write(MicroBatch& mb, OpId id) {
  const auto [g, n] = input_grad_slot(mb, id);
  if (!g->empty()) return {*g, false};
  fresh_for_overwrite(*g, n);
  return {*g, true};
}

std::pair<int, int> Runner::gemm_shape(const Op& op) const {
  const int u = m_.activation == model::Activation::SwiGlu ? 2 : 1;
  switch (op.kind) {
    case OpKind::QkvProj:
      switch (projection(op)) {
        case Projection::Qkv:
          return {C_, (H_ + 2 * G_) * D_};
        case Projection::QUp:
          return {Rq_, H_ * D_};
        case Projection::QProj:
          return {C_, H_ * D_};
        case Projection::KvUp:
          return {Rkv_, H_ * (Dn_ + Dv_)};
      }
      return {0, 0};
    case OpKind::AttnOutProj:
      return {H_ * Dv_, C_};
    case OpKind::MlpUp:
      return {C_, mlp_width(op) * u};
    case OpKind::MlpDown:
      return {mlp_width(op), C_};
    case OpKind::LmHead:
      return {C_, Vl_};
    default:
      DTSIM_ASSERT(false, "not a linear op");
      return {0, 0};
  }
}

View Runner::norm_share(Param& p) {
  if (!canonical_copy(p)) return {};
  if (sharded(p)) return p.reduced;
  const View g = grad(p);
  const std::int64_t shards = p.expert ? edp_ : dp_, mine = p.expert ? ed_ : d_;
  const std::int64_t begin = g.size() * mine / shards, end = g.size() * (mine + 1) / shards;
  return g.sub(begin, end - begin);
}

void Runner::grad_norm() {
  if (grad_norm_sq_.n == 0) grad_norm_sq_ = dev_.allocate(1, Dtype::F32);
  dev_.zero(grad_norm_sq_);
  for (auto& [key, p] : params_) {
    const View share = norm_share(p);
    if (share.size() > 0) dev_.sum_squares(grad_norm_sq_, share);
  }
}

void Runner::optimizer_step() {
  ++adam_step_;
  const float lr = options_.lr.at(adam_step_);
  const auto clip = static_cast<float>(p_.clip_grad);
  // The gradient buffer cleared for the next step, in one pass as Megatron-LM's
  // zero_grad_buffer clears its contiguous buffer (the simulator's Task::cleared_params); a
  // replay of predicted waits ran no reduce-scatter to clear staged ZeRO-1's.
  const bool clear_all =
      plan::optimizer_clears_gradients(p_) || (options_.replay_communication && !transient_grads_);
  // ZeRO-1's experts on one rank each (dp = ep): no reduce-scatter clears their gradients.
  const bool clear_experts = !clear_all && plan::optimizer_clears_expert_gradients(p_);
  for (auto& [key, p] : params_) {
    const View g = sharded(p) ? p.reduced : grad(p);
    if (clip > 0) dev_.clip_scale(g, grad_norm_sq_, clip);
    dev_.adamw(master_slice(p), g, p.m, p.v, lr, 0.9f, 0.95f, 1e-8f,
               p.decays ? options_.weight_decay : 0.0f, adam_step_);
    // Sharded, the gradients were cleared when their reduce-scatter took its packed copy (a
    // replay of predicted waits runs no reduce-scatter: they are cleared here; in place, the
    // reduce-scatter leaves them where they were).
    if (sharded(p) && !in_place_) dev_.zero(p.reduced);
    if (transient_grads_) drop_grad(p);  // (unsharded experts' too: made again at first write)
    if (p.expert && clear_experts) dev_.zero(p.grad);
    if (!sharded(p)) refresh_work(p);  // sharded: after the all-gather of the updated slices
  }
  if (clear_all) dev_.zero(grad_storage_);
}

View Runner::replayed_input() {
  const auto n = static_cast<std::int64_t>(Ts_) * C_;
  if (replay_input_.n == n) return replay_input_;
  std::vector<float> host(static_cast<std::size_t>(n));
  const std::uint64_t stream = counter_hash(options_.seed, 0x7265706c6179ULL, 0);  // "replay"
  for_pieces(n, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i)
      host[static_cast<std::size_t>(i)] = standard_normal(stream, i);
  });
  dev_.release(replay_input_);
  replay_input_ = allocate(n);
  dev_.upload(replay_input_, host.data());
  return replay_input_;
}

void Runner::replay(const lower::Task& task, std::size_t index) {
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
    View& buffer = transferred(task);
    fresh_for_overwrite(buffer, static_cast<std::int64_t>(Ts_) * C_);
    dev_.copy(buffer, replayed_input());
  } else if (dp && zero3_ && task.collective == CollectiveKind::AllGather &&
             task.op_end > task.op_begin) {
    // ZeRO-3: the chunk's weights take their place (this rank's slice, zeros elsewhere), the
    // reduce-scatters before it finished first, as the real gather finishes them.
    release_replayed(index);
    gather_weights(task, params_for(task), index, /*local=*/true);
  } else if (dp && sharded_ && !in_place_ && task.collective == CollectiveKind::ReduceScatter) {
    // ZeRO's reduce-scatter, in memory: its packed copy of the bucket's gradients and its
    // reduced shard, held until the next task is done, as a started collective holds them
    // until it completes; the bucket's gradients (ZeRO-2/3) are gone once packed. A
    // reduce-scatter started before is finished first, as the real one finishes them (one
    // bucket's buffers at a time): the experts' bucket right after the dense one held both.
    release_replayed(index);
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
             local_dispatch_ && g_.op(static_cast<OpId>(task.op_begin)).expert) {
    // The experts' copies take the shapes the next ops expect.
    tp_copies_collective(task, batches_.at(static_cast<std::size_t>(task.micro_batch)),
                         /*alone=*/true);
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
  }
}

void Runner::execute(const lower::Task& task, std::size_t index) {
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
        throw UnsupportedError(fmt::format("phase {} is not executed yet", to_string(task.phase)));
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
        fresh_for_overwrite(buffer, static_cast<std::int64_t>(Ts_) * C_);
        comm_.recv(peer_rank(task), task.tag, on_the_wire(buffer));
      }
      return;
    }
  }
}

}  // namespace dtsim::exec::runner_internal

namespace dtsim::exec {

using cpu::kDropoutRate;
using runner_internal::Runner;

std::vector<std::string> execution_notes(const model::ModelSpec& spec, const plan::Plan& plan) {
  std::vector<std::string> notes;
  // (The model dtsim prices: a prediction and a measurement of the same maths.)
  std::vector<std::string> without = spec.unmodelled;
  if (spec.unmodelled_sliding_window && plan.seq_len > *spec.unmodelled_sliding_window) {
    without.push_back(fmt::format("its {} of {} tokens (full causal attention instead)",
                                  spec.unmodelled_window_kind, *spec.unmodelled_sliding_window));
  }
  if (spec.dropout && !spec.unmodelled_dropout.empty()) {
    without.push_back(spec.unmodelled_dropout);
  }
  if (!without.empty()) {
    notes.push_back(fmt::format("model {} trains as dtsim models it, without {}", spec.name,
                                fmt::join(without, "; without ")));
  }
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
        "{}; dropless, no load-balancing loss{}{}",
        spec.moe->top_k, spec.moe->experts,
        fmt::format(
            "{}{}{}",
            spec.moe->sigmoid_gates
                ? fmt::format("their logits' sigmoids{} (DeepSeek-V3's scores)",
                              spec.moe->normalize_top_k ? " over their sum" : "")
            : !spec.moe->normalize_top_k
                ? "their probabilities in the softmax over all experts, not renormalized (Switch "
                  "Transformer's; Hugging Face's norm_topk_prob false)"
                : "the softmax of those logits (Mixtral's routing)",
            spec.moe->routed_scale != 1.0 ? fmt::format(", times {:g}", spec.moe->routed_scale)
                                          : "",
            spec.moe->top_k == 1 && spec.moe->normalize_top_k
                ? fmt::format(", which for one expert a token is {:g}: the router does not train",
                              spec.moe->routed_scale)
                : ""),
        spec.shared_ffn() > 0
            ? fmt::format("; and every token through the shared experts (an MLP of width "
                          "{}), their output added to the routed experts'",
                          spec.shared_ffn())
            : "",
        spec.mixed_blocks()
            ? fmt::format("; experts in {} of the {} blocks, a dense MLP of width {} in the others",
                          spec.expert_blocks(), spec.layers, spec.moe->dense_ffn_hidden)
            : ""));
  }
  if (auto padding = plan::vocab_padding_note(spec, plan)) {
    // (The padded rows take part in the softmax, as Megatron-LM's do: the losses are another
    // model's than a run padded otherwise, which a user comparing tp degrees meets first.)
    notes.push_back(fmt::format(
        "{}; tokens are drawn from the first {}, but the softmax runs over all {} rows, so the "
        "losses differ from a run padded to another multiple (another tp): give "
        "--make-vocab-size-divisible-by alike to compare them",
        *padding, spec.vocab, plan::padded_vocab(spec.vocab, plan)));
  }
  if (auto uneven = plan::uneven_layers_note(spec, plan)) notes.push_back(*uneven);
  if (plan.cp > 1) {
    notes.push_back(fmt::format(
        "context parallelism: each rank holds 2 of {} chunks of every sequence (Megatron-LM's "
        "load balancing); K and V all-gathered, their gradients reduce-scattered",
        2 * plan.cp));
  }
  if (spec.mla) {
    notes.push_back(fmt::format(
        "multi-head latent attention: the keys' RoPE part ({} columns) shared by all heads, "
        "turned in the rotate-half layout (DeepSeek's interleaved pairs are a fixed permutation "
        "of those columns), scores scaled by 1/sqrt({})",
        spec.mla->qk_rope_head_dim, spec.head_dim));
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
    throw UnsupportedError(fmt::format("{} is not executed on {} yet", what, device.name()));
  };
  if (program.plan.cp > 1 && !device.has(Device::Feature::ContextParallelism)) {
    lacks(fmt::format("context parallelism (cp {})", program.plan.cp));
  }
  if (m.mla && !device.has(Device::Feature::LatentAttention)) {
    lacks(fmt::format("multi-head latent attention (model {})", m.name));
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
    throw UnsupportedError(fmt::format("{} is not executed yet", what));
  };
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
  if (p.ep > 1 && p.zero_in_place && p.dp / p.ep * p.cp == 1) {
    refuse(fmt::format(
        "ZeRO-1 in place with expert parallelism where each expert has one data-parallel rank "
        "(dp {} / ep {} x cp {}; without --zero-in-place it runs, the experts unsharded)",
        p.dp, p.ep, p.cp));
  }
  if (p.sequence_parallel && (p.micro_batch_size * p.seq_len / p.cp) % p.tp != 0) {
    refuse(fmt::format(
        "sequence parallelism with {} tokens per micro-batch and rank, not divisible by tp {}",
        p.micro_batch_size * p.seq_len / p.cp, p.tp));
  }
  if (p.schedule == plan::Schedule::PipeDreamAsync) refuse("the PipeDream (asynchronous) schedule");
  // (dtsim plans and simulates it.)
  if (m.heads % p.tp != 0 || m.kv_heads % p.tp != 0 || m.ffn_hidden % p.tp != 0 ||
      m.vocab_rows() % p.tp != 0) {
    refuse(fmt::format("tp {} that does not divide heads {}, kv heads {}, ffn {} and vocab {}",
                       p.tp, m.heads, m.kv_heads, m.ffn_hidden, m.vocab_rows()));
  }
  // (A mixture's other MLPs: its shared experts', its dense blocks'.)
  for (const auto& [name, width] : m.mlp_widths()) {
    if (width % p.tp != 0)
      refuse(fmt::format("tp {} that does not divide {} {}", p.tp, name, width));
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
