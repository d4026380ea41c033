// The Program runner (exec/core/runner_internal.hpp): the collectives: gradient reductions, ZeRO's
// weight gathers, tp, cp and sequence-parallel collectives, and the pipeline's receives.
#include "exec/core/runner_internal.hpp"

namespace dtsim::exec::runner_internal {

void Runner::reduce_gradients(const lower::Task& task, const std::vector<Param*>& params,
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
      all_counts.push_back(
          collective_counts(even_parts(size, shards), "ZeRO gradient reduce-scatter"));
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
  finish_reductions();
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

void Runner::loss_statistics(const lower::Task& task, MicroBatch& mb, OpId statistics) {
  const View stats = mb.aux2.at(statistics);
  const View rowmax = stats.sub(0, T_), sums = stats.sub(T_, T_), local = stats.sub(3 * T_, T_);
  dev_.copy(local, rowmax);
  comm_.all_reduce(task.group, rowmax, Reduce::Max);
  // Each rank's sums of exponentials to the maximum over all ranks (exp(x - m) =
  // exp(x - m_rank)·exp(m_rank - m)), then summed with the target logits (one rank's is not 0).
  dev_.cross_entropy_rescale(sums, local, rowmax, T_);
  comm_.all_reduce(task.group, stats.sub(T_, 2 * T_), Reduce::Sum);
}

void Runner::finish_completed() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!it->second.complete) {
      ++it;
      continue;
    }
    if (!comm_.complete(it->second.handle)) break;
    it = finish_pending(it);
  }
}

void Runner::settle(const lower::Task* task) {
  // Blocking pipeline transfers: a task that waits for sends (the next round's compute, see
  // lowering) starts once they are received, as Megatron-LM's exchange waits for its sends.
  if (task != nullptr && !program_.plan.overlap_p2p_comm && !options_.replay_communication &&
      std::any_of(task->deps.begin(), task->deps.end(), [this](lower::TaskId d) {
        return rp_->tasks[static_cast<std::size_t>(d)].kind == TaskKind::Send;
      })) {
    if (watchdog_ != nullptr) watchdog_->waiting_for(Watchdog::kSends);
    comm_.finish_sends();
    if (watchdog_ != nullptr) watchdog_->waiting_for(Watchdog::kNone);
    close_sends();
  }
  auto depends = [task](std::size_t index) {
    return task == nullptr || std::find(task->deps.begin(), task->deps.end(),
                                        static_cast<lower::TaskId>(index)) != task->deps.end();
  };
  std::optional<std::size_t> last_adding, last_dp;
  for (const auto& [index, pending] : pending_) {
    if (pending.complete && depends(index)) last_adding = index;
    if (on_dp_stream(index) && depends(index)) last_dp = index;
  }
  // The data-parallel stream runs its collectives in order, as the simulator's streams do: a
  // task that waits for one waits for those started before it (a unit's dense weight gather,
  // which its first task does not name, before the experts' gather it does).
  for (auto it = pending_.begin(); it != pending_.end();) {
    const bool needed = depends(it->first) ||
                        (it->second.complete && last_adding && it->first <= *last_adding) ||
                        (last_dp && it->first <= *last_dp && on_dp_stream(it->first));
    it = needed ? finish_pending(it) : std::next(it);
  }
}

void Runner::finish_reductions() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = it->second.holds_bucket ? finish_pending(it) : std::next(it);
  }
}

std::map<std::size_t, PendingCollective>::iterator Runner::finish_pending(
    std::map<std::size_t, PendingCollective>::iterator it) {
  if (watchdog_ != nullptr) watchdog_->waiting_for(static_cast<std::int64_t>(it->first));
  comm_.finish(it->second.handle);
  for (const Comm::Handle h : it->second.also) comm_.finish(h);
  if (watchdog_ != nullptr) watchdog_->waiting_for(Watchdog::kNone);
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

std::vector<int> Runner::collective_counts(const std::vector<std::int64_t>& wide,
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

void Runner::close_sends() {
  const double end = since_start(std::chrono::steady_clock::now());
  for (std::size_t r : open_sends_) (*records_)[r].end_s = std::max((*records_)[r].end_s, end);
  open_sends_.clear();
}

void Runner::gather_weights(const lower::Task& task, const std::vector<Param*>& params,
                            std::size_t index, bool local) {
  if (!sharded_) return;
  if (zero3_ && !local) {
    // The dp stream runs its collectives in order, as the simulator's streams do: a gradient
    // reduce-scatter started before this gather is done before it starts, and its buffers go
    // back before the gathered weights are made. (Left pending, a zero-bubble schedule's
    // reduce-scatter of one micro-batch's weight gradients was held through the next
    // micro-batch's weight pass and the gather after it: cpu-small at pp 2 dp 2 peaked at
    // 62.1 MiB against 37.3 predicted.)
    finish_reductions();
  }
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
  // Each tensor in place, as ZeRO-3's partitioned parameters and FSDP's flat ones are
  // gathered: this rank's slice of the master copied (or cast to the activation type) into
  // its place in the gathered tensor, the other ranks' slices around it. Nothing is packed
  // or copied out, so the gather adds no memory to the tensors it fills (DeepSpeed's
  // allgather_bucket_size chunks, which dtexec copied through before, held a packed copy and
  // a gathered chunk of up to a gradient bucket's bytes besides). The gathers are started,
  // the slices copied in first: they run while the compute queued after them does (on a GPU;
  // between tasks over MPI), and the first task that depends on this one waits for them
  // (settle), as FSDP's prefetch runs ahead of the unit that reads the weights. The ZeRO-1/2
  // gathers of the updated weights are done by the step's end.
  const auto [shards, me] = shards_of(task);
  // This rank's slice of a tensor, at its place in the gathered tensor.
  const auto place = [&](const Param& p) {
    return gathered(p).sub(p.own_begin, p.own_end - p.own_begin);
  };
  std::vector<std::vector<int>> all_counts;  // a moved vector keeps its elements in place
  std::vector<Param*> refreshed;             // fp32 tensors with a working copy to refresh
  for (Param* p : params) {
    DTSIM_ASSERT(p->own_begin == p->n * me / shards && p->own_end == p->n * (me + 1) / shards,
                 "a ZeRO slice is the rank's share of the tensor");
    all_counts.push_back(collective_counts(even_parts(p->n, shards), "ZeRO weight all-gather"));
    const View mine = place(*p), master = master_slice(*p);
    if (mine.p != master.p) copy_in(*p, mine, master);
    if (!p->work_only && p->separate_work) refreshed.push_back(p);
  }
  std::vector<Comm::Handle> handles;
  for (std::size_t i = 0; i < params.size(); ++i) {
    handles.push_back(
        comm_.start_all_gather(task.group, place(*params[i]), gathered(*params[i]), all_counts[i]));
  }
  if (handles.empty()) return;
  std::function<void()> refresh;
  if (!refreshed.empty()) {
    refresh = [this, refreshed] {
      for (Param* p : refreshed) refresh_work(*p);
    };
  }
  pending_[index] = {
      handles.front(),        std::move(refresh),
      std::nullopt,
      /*holds_bucket=*/false, std::vector<Comm::Handle>(handles.begin() + 1, handles.end()),
      std::move(all_counts)};
}

void Runner::gather_in_place(const lower::Task& task, const std::vector<Param*>& params) {
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
        comm_.all_gather(task.group, whole.sub(before, counts[static_cast<std::size_t>(me)]), whole,
                         counts);
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

void Runner::cp_collective(const lower::Task& task, MicroBatch& mb, bool local) {
  const auto core = static_cast<OpId>(task.op_begin);
  DTSIM_ASSERT(g_.op(core).kind == OpKind::AttentionCore, "a cp collective at an attention core");
  const OpId qkv = input(core);
  // (Multi-head latent attention: values d_v wide, K and V packed from kv_up's output and the
  // keys' RoPE part, as the core packs them.)
  const int width = (H_ + G_) * D_ + G_ * Dv_, kv_width = G_ * (D_ + Dv_);
  const std::int64_t mine = static_cast<std::int64_t>(T_) * kv_width;
  const bool rope = m_.positions == model::Positions::Rope;
  const OpId kv_up = m_.mla ? g_.predecessors(core).at(1) : qkv;
  if (task.collective == CollectiveKind::AllGather) {
    const View own = allocate_for_overwrite(mine);
    if (m_.mla) {  // (its q columns left unwritten: not gathered)
      const View packed = allocate_for_overwrite(static_cast<std::int64_t>(T_) * width);
      dev_.mla_pack_forward(packed, View{}, mb.out.at(kv_up), latent_rope(mb, core), B_, Sq_, H_,
                            Dn_, Dr_, Dv_, m_.rope_theta, positions_);
      dev_.copy_columns(own, packed, T_, width, H_ * D_, kv_width);
      dev_.release(packed);
    } else if (rope) {
      const View turned = allocate_for_overwrite(static_cast<std::int64_t>(T_) * width);
      dev_.rope_forward(turned, mb.out.at(qkv), B_, Sq_, H_, G_, D_, m_.rope_theta, positions_);
      dev_.copy_columns(own, turned, T_, width, H_ * D_, kv_width);
      dev_.release(turned);
    } else {
      dev_.copy_columns(own, mb.out.at(qkv), T_, width, H_ * D_, kv_width);
    }
    auto& all = mb.kv[core];
    fresh_for_overwrite(all, mine * cp_);
    gather_shares(task, cp_, own, all, local, "the cp K/V all-gather");
    dev_.release(own);
    return;
  }
  DTSIM_ASSERT(task.collective == CollectiveKind::ReduceScatter, "cp reduce-scatter of dKV");
  const View own = allocate_for_overwrite(mine);
  scatter_shares(task, cp_, c_, mb.kv_grad.at(core), own, local, "the cp dK/dV reduce-scatter");
  dev_.release(mb.kv_grad.at(core));
  mb.kv_grad.erase(core);
  if (m_.mla) {
    const View packed = allocate(static_cast<std::int64_t>(T_) * width);
    dev_.add_columns(packed, own, T_, width, H_ * D_, kv_width);
    dev_.mla_pack_backward(View{}, grad_of(mb, kv_up), latent_rope_grad(mb, core), packed, B_, Sq_,
                           H_, Dn_, Dr_, Dv_, m_.rope_theta, positions_);
    dev_.release(packed);
  } else if (rope) {
    const View turned = allocate(static_cast<std::int64_t>(T_) * width);
    dev_.add_columns(turned, own, T_, width, H_ * D_, kv_width);
    dev_.rope_backward(grad_of(mb, qkv), turned, B_, Sq_, H_, G_, D_, m_.rope_theta, positions_);
    dev_.release(turned);
  } else {
    dev_.add_columns(grad_of(mb, qkv), own, T_, width, H_ * D_, kv_width);
  }
  dev_.release(own);
}

void Runner::gather_shares(const lower::Task& task, int ranks, View share, View whole, bool local,
                           const char* what) {
  DTSIM_ASSERT(whole.size() == share.size() * ranks, "a share per rank");
  if (local) {
    for (int r = 0; r < ranks; ++r) dev_.copy(whole.sub(r * share.size(), share.size()), share);
    return;
  }
  comm_.all_gather(
      task.group, share, whole,
      collective_counts(std::vector<std::int64_t>(static_cast<std::size_t>(ranks), share.size()),
                        what));
}

void Runner::scatter_shares(const lower::Task& task, int ranks, int self, View whole, View share,
                            bool local, const char* what) {
  DTSIM_ASSERT(whole.size() == share.size() * ranks, "a share per rank");
  if (local) {
    dev_.copy(share, whole.sub(self * share.size(), share.size()));
    return;
  }
  comm_.reduce_scatter(
      task.group, whole, share,
      collective_counts(std::vector<std::int64_t>(static_cast<std::size_t>(ranks), share.size()),
                        what));
}

void Runner::sequence_parallel_collective(const lower::Task& task, MicroBatch& mb, OpId anchor,
                                          bool exit, bool local) {
  if (latent_projection(g_.op(anchor))) {
    latent_sp_collective(task, mb, anchor, local);
    return;
  }
  const bool scatter = task.collective == CollectiveKind::ReduceScatter;
  auto reduce_scatter = [&](View in, View out) {
    scatter_shares(task, tp_, t_, in, out, local, "sequence parallelism's reduce-scatter");
  };
  auto all_gather = [&](View in, View out) {
    gather_shares(task, tp_, in, out, local, "sequence parallelism's all-gather");
  };
  const std::int64_t shard_size = static_cast<std::int64_t>(Ts_) * C_;
  const std::int64_t whole_size = static_cast<std::int64_t>(T_) * C_;
  if (exit && scatter) {  // forward g: the row-parallel (or embedding) output, summed
    auto& out = mb.out.at(anchor);
    const View shard = allocate_for_overwrite(shard_size);
    reduce_scatter(out, shard);
    dev_.release(out);
    out = shard;
    if (g_.op(anchor).kind == OpKind::Embedding) embedding_dropout(mb, anchor);
  } else if (exit) {  // backward g: the gradient of that output, gathered
    auto& grad = mb.grad.at(anchor);
    if (g_.op(anchor).kind == OpKind::Embedding && dropout_ > 0) {
      // Through the embedding's dropout first, on the rank's share (as it was applied).
      const View dy = allocate(grad.size());  // (dropout_backward adds into it)
      dev_.dropout_backward(dy, mb.mask.at(anchor), grad, dropout_);
      dev_.release(grad);
      grad = dy;
    }
    const View whole = allocate_for_overwrite(whole_size);
    all_gather(grad, whole);
    dev_.release(grad);
    grad = whole;
  } else if (!scatter) {  // f's all-gather of the column-parallel op's input (forward, and
                          // again in the backward for the weight gradient)
    const OpId in = input(anchor);
    auto& whole = mb.full[in];
    fresh_for_overwrite(whole, whole_size);
    all_gather(mb.out.at(in), whole);
  } else {  // backward f: the gradient of that input, summed and scattered
    const OpId in = input(anchor);
    const View shard = allocate_for_overwrite(shard_size);
    reduce_scatter(mb.full_grad.at(in), shard);
    add_to_grad(mb, in, shard);
    dev_.release(shard);
    dev_.release(mb.full_grad.at(in));
    mb.full_grad.erase(in);
  }
}

void Runner::collective(const lower::Task& task, std::size_t index) {
  const auto& grp = program_.groups.at(static_cast<std::size_t>(task.group));
  if (task.phase == Phase::GradNorm) {  // the squared norm's shares, over dp, tp or pp
    comm_.all_reduce(task.group, grad_norm_sq_, Reduce::Sum);
    return;
  }
  switch (grp.kind) {
    case GroupKind::Tp: {
      if (task.micro_batch < 0) {
        // Sequence parallelism: the norms' weight gradients (and the routers' under
        // moe_local_dispatch), each from a share of the sequence, summed over tp (the
        // dp-reduced slice under ZeRO >= 1).
        std::vector<Param*> norms;
        for (Param* p : params_of(task.op_begin, task.op_end)) {
          if (p->sequence_share) norms.push_back(p);
        }
        std::int64_t total = 0;
        for (Param* p : norms) total += (sharded(*p) ? p->reduced : p->grad).size();
        const View flat = dev_.allocate(total, Dtype::F32);
        std::int64_t at = 0;
        for (Param* p : norms) {
          const View g = sharded(*p) ? p->reduced : p->grad;
          dev_.copy(flat.sub(at, g.size()), g);
          at += g.size();
        }
        comm_.all_reduce(task.group, flat, Reduce::Sum);
        at = 0;
        for (Param* p : norms) {
          const View g = sharded(*p) ? p->reduced : p->grad;
          dev_.copy(g, flat.sub(at, g.size()));
          at += g.size();
        }
        dev_.release(flat);
        return;
      }
      MicroBatch& mb = batches_.at(static_cast<std::size_t>(task.micro_batch));
      const auto anchor = static_cast<OpId>(task.op_begin);
      const Op& op = g_.op(anchor);
      if (op.expert && local_dispatch_) {
        tp_copies_collective(task, mb);
        return;
      }
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
      if (const Projection what = projection(op);
          what == Projection::QUp || what == Projection::KvUp) {
        // f's backward at a latent's up projection: the gradient of its part of the latents'
        // norm output, and at kv_up the keys' RoPE part's (each rank's heads' sum) with it.
        std::vector<View> parts = {
            grad_of(mb, input(anchor))
                .sub(what == Projection::QUp ? 0 : std::int64_t{T_} * Rq_,
                     std::int64_t{T_} * (what == Projection::QUp ? Rq_ : Rkv_))};
        if (what == Projection::KvUp)
          parts.push_back(latent_rope_grad(mb, g_.successors(anchor).at(0)));
        if (program_.plan.overlap_tp_backward &&
            index != last_use_[static_cast<std::size_t>(task.micro_batch)]) {
          std::vector<Comm::Handle> also;
          for (std::size_t i = 1; i < parts.size(); ++i) {
            also.push_back(comm_.start_all_reduce(task.group, parts[i]));
          }
          pending_[index] = {comm_.start_all_reduce(task.group, parts.front()),
                             {},
                             std::nullopt,
                             false,
                             std::move(also)};
        } else {
          for (const View& v : parts) comm_.all_reduce(task.group, v, Reduce::Sum);
        }
        return;
      }
      if (op.kind == OpKind::LossStatistics) {
        loss_statistics(task, mb, anchor);
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
        gather_weights(task, params_for(task), index);
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
      comm_.all_reduce(task.group, sharded(p) ? p.reduced : p.grad, Reduce::Sum);
      return;
    }
    default:
      throw UnsupportedError(
          fmt::format("{} collectives are not executed yet", lower::to_string(grp.kind)));
  }
}

void Runner::plan_receive_streams() {
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

Comm::Handle Runner::post_receive(const lower::Task& task) {
  View& buffer = transferred(task);
  fresh_for_overwrite(buffer, static_cast<std::int64_t>(Ts_) * C_);
  return comm_.start_recv(peer_rank(task), task.tag, on_the_wire(buffer));
}

View Runner::on_the_wire(View tensor) const {
  if (!program_.plan.scatter_gather_p2p) return tensor;
  const std::int64_t part = tensor.n / tp_;
  return tensor.sub(t_ * part, part);
}

void Runner::gather_transferred(const lower::Task& task) {
  View& tensor = transferred(task);
  const View part = on_the_wire(tensor);
  const View mine = dev_.allocate_for_overwrite(part.n, part.type);  // copied whole
  dev_.copy(mine, part);
  const std::vector<int> counts(static_cast<std::size_t>(tp_), static_cast<int>(part.n));
  comm_.all_gather(task.group, mine, tensor, counts);
  dev_.release(mine);
}

View& Runner::transferred(const lower::Task& task) {
  MicroBatch& mb = batches_.at(static_cast<std::size_t>(task.micro_batch));
  const auto id = static_cast<OpId>(task.op_begin);
  return (task.tag & 1) != 0 ? mb.grad[id] : mb.out[id];
}

}  // namespace dtsim::exec::runner_internal
