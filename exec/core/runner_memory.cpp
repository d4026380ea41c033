// The Program runner (exec/core/runner_internal.hpp): when each tensor of a micro-batch and each
// gathered weight is released.
#include "exec/core/runner_internal.hpp"

namespace dtsim::exec::runner_internal {

void Runner::release(MicroBatch& mb) {
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

std::vector<Runner::Use> Runner::forward_uses(OpId id) const {
  const Op& op = g_.op(id);
  std::vector<Use> u;
  auto read = [&u](Slot s, OpId x) { u.push_back({s, x, false}); };
  auto make = [&u](Slot s, OpId x) { u.push_back({s, x, true}); };
  switch (op.kind) {
    case OpKind::LatentDown:
      read(Slot::Out, input(id));
      make(Slot::Out, id);
      break;
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
      if (latent_projection(op) && Ts_ != T_) {
        read(Slot::Full, id);  // its gathered latent
      } else {
        read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
      }
      if (adds_routed(id)) read(Slot::Out, g_.predecessors(id).at(1));
      if (op.kind == OpKind::MlpDown && op.expert) {
        make(Slot::Aux1, id);                   // the copies' outputs
        if (ep_ > 1 || local_dispatch_) break;  // combined after the collectives that follow
        for (Slot s : {Slot::Aux1, Slot::Route}) read(s, router_of(id));
      }
      make(Slot::Out, id);
      break;
    case OpKind::AttentionCore:
      read(Slot::Out, input(id));
      if (m_.mla) {  // the keys and values, and the keys' part with positions
        read(Slot::Out, g_.predecessors(id).at(1));
        read(Ts_ != T_ ? Slot::Full : Slot::Out, latent_down_of(id));
      }
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
    case OpKind::LossStatistics:
      read(Slot::Out, input(id));
      make(Slot::Aux2, id);
      break;
    case OpKind::Loss:
      read(Slot::Out, input(id));
      read(Slot::Aux2, statistics_of(id));
      make(Slot::Aux1, id);
      break;
    case OpKind::Router:
      read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
      for (Slot s : {Slot::Out, Slot::Aux1, Slot::Aux2, Slot::Route}) make(s, id);
      if (gating().reads_logits()) make(Slot::Logits, id);  // read again by the backward
      break;
  }
  return u;
}

std::vector<Runner::Use> Runner::backward_uses(OpId id, Part part) const {
  const Op& op = g_.op(id);
  const bool input_grads = part != Part::Weight;
  const bool weight_grads = part != Part::Input;
  const bool has_weights = holds_weights(id) || tied_head(op);
  std::vector<Use> u;
  if (!has_weights && !input_grads) return u;
  auto read = [&u](Slot s, OpId x) { u.push_back({s, x, false}); };
  switch (op.kind) {
    case OpKind::LatentDown:
      read(Slot::Grad, id);
      if (weight_grads) read(Slot::Out, input(id));
      if (input_grads) read(Slot::Grad, input(id));
      break;
    case OpKind::LossStatistics:  // no backward
      break;
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
      if (op.kind == OpKind::MlpDown && op.expert && ep_ == 1 && !local_dispatch_) {
        if (input_grads) {
          // The combine's backward: the tokens' gradients, the copies' outputs, the gates and
          // their order; a zero-bubble B pass keeps the copies' gradients for its W pass.
          read(Slot::Grad, id);
          read(Slot::Aux1, id);
          for (Slot s : {Slot::Aux1, Slot::Route}) read(s, router_of(id));
          u.push_back({Slot::GateGrad, router_of(id), false});
          if (!weight_grads) u.push_back({Slot::CopyGrad, id, true});
        } else {
          read(Slot::CopyGrad, id);
        }
      } else {
        read(Slot::Grad, id);
      }
      if (latent_projection(op) && Ts_ != T_) {  // its gathered latent, and its gradient
        if (weight_grads) read(Slot::Full, id);
        if (input_grads) read(Slot::FullGrad, id);
        break;
      }
      if (weight_grads) read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
      if (input_grads) read(gathers_input(op) ? Slot::FullGrad : Slot::Grad, input(id));
      if (adds_routed(id) && input_grads) read(Slot::Grad, g_.predecessors(id).at(1));
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
      if (m_.mla) {
        read(Slot::Grad, g_.predecessors(id).at(1));
        read(Ts_ != T_ ? Slot::FullGrad : Slot::Grad, latent_down_of(id));
      }
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
      if (gating().reads_logits()) read(Slot::Logits, id);
      if (input_grads) {
        for (Slot s : {Slot::Grad, Slot::Route}) read(s, id);
        read(gathers_input(op) ? Slot::FullGrad : Slot::Grad, input(id));
      }
      if (weight_grads) read(gathers_input(op) ? Slot::Full : Slot::Out, input(id));
      break;
  }
  return u;
}

std::vector<Runner::Use> Runner::communication_uses(const lower::Task& task) const {
  std::vector<Use> u;
  if (task.micro_batch < 0) return u;
  const auto anchor = static_cast<OpId>(task.op_begin);
  const Slot carried = (task.tag & 1) != 0 ? Slot::Grad : Slot::Out;
  if (task.kind == TaskKind::Send) return {{carried, anchor, false}};
  if (task.kind == TaskKind::Recv) return {{carried, anchor, true}};
  const GroupKind kind = program_.groups.at(static_cast<std::size_t>(task.group)).kind;
  if (kind == GroupKind::Cp) {
    if (m_.mla) {  // K and V from kv_up's output and the keys' RoPE part (cp_collective)
      const OpId kv_up = g_.predecessors(anchor).at(1), down = latent_down_of(anchor);
      const bool sp = Ts_ != T_;
      if (task.collective == CollectiveKind::AllGather) {
        return {{Slot::Out, kv_up, false},
                {sp ? Slot::Full : Slot::Out, down, false},
                {Slot::Kv, anchor, true}};
      }
      return {{Slot::KvGrad, anchor, false},
              {Slot::Grad, kv_up, false},
              {sp ? Slot::FullGrad : Slot::Grad, down, false}};
    }
    if (task.collective == CollectiveKind::AllGather) {
      return {{Slot::Out, input(anchor), false}, {Slot::Kv, anchor, true}};
    }
    return {{Slot::KvGrad, anchor, false}, {Slot::Grad, input(anchor), false}};
  }
  // A collective at an experts' down op that combines the copies' outputs at their tokens
  // (forward) or takes the combine's backward there: the outputs, the gates and the order.
  auto combine = [&](OpId router, bool backward) -> std::vector<Use> {
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
  };
  if (kind == GroupKind::Ep) {
    // ep_collective: what each of the four all-to-alls reads and makes.
    const OpId router = router_of(anchor);
    const bool backward = (task.tag & 1) != 0;
    if (g_.op(anchor).kind == OpKind::MlpUp) {
      return {{backward ? Slot::Grad : Slot::Out, router, false}};
    }
    return combine(router, backward);
  }
  if (kind != GroupKind::Tp) return u;
  const Op& op = g_.op(anchor);
  if (op.expert && local_dispatch_) {
    // tp_copies_collective: the up op's input copies (or their gradients), the down op's
    // outputs (or their gradients), with the combine (or its backward) where ep is 1.
    const OpId router = router_of(anchor);
    const bool gather = task.collective == CollectiveKind::AllGather;
    if (op.kind == OpKind::MlpUp) return {{gather ? Slot::Out : Slot::Grad, router, false}};
    if (ep_ > 1) return {{gather ? Slot::Grad : Slot::Aux1, anchor, false}};
    return combine(router, /*backward=*/gather);
  }
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
    if (latent_projection(op)) {  // latent_sp_collective
      const OpId norm = input(anchor), down = input(norm);
      const bool kv = projection(op) == Projection::KvUp;
      if (scatter) {
        std::vector<Use> reads = {{Slot::FullGrad, anchor, false}, {Slot::Grad, norm, false}};
        if (kv)
          reads.insert(reads.end(), {{Slot::FullGrad, down, false}, {Slot::Grad, down, false}});
        return reads;
      }
      std::vector<Use> gathers = {{Slot::Out, norm, false}, {Slot::Full, anchor, true}};
      if (kv && task.phase != Phase::Backward) {  // not the regather (latent_sp_collective)
        gathers.insert(gathers.end(), {{Slot::Out, down, false}, {Slot::Full, down, true}});
      }
      return gathers;
    }
    if (exit && embedding_dropout) {
      return {{scatter ? Slot::Out : Slot::Grad, anchor, false}, {Slot::Mask, anchor, scatter}};
    }
    if (exit) return {{scatter ? Slot::Out : Slot::Grad, anchor, false}};
    const OpId in = input(anchor);
    if (!scatter) return {{Slot::Out, in, false}, {Slot::Full, in, true}};
    return {{Slot::FullGrad, in, false}, {Slot::Grad, in, false}};
  }
  if (op.kind == OpKind::LossStatistics) return {{Slot::Aux2, anchor, false}};
  if (exit && embedding_dropout) return {{Slot::Out, anchor, false}, {Slot::Mask, anchor, true}};
  if (exit) return {{Slot::Out, anchor, false}};
  // (Multi-head latent attention's kv_up: the keys' RoPE part's gradient too.)
  if (projection(op) == Projection::KvUp) {
    return {{Slot::Grad, input(anchor), false},
            {Slot::Grad, latent_down_of(g_.successors(anchor).at(0)), false}};
  }
  return {{Slot::Grad, input(anchor), false}};
}

void Runner::plan_releases() {
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

void Runner::plan_weight_releases() {
  const auto& tasks = rp_->tasks;
  release_weights_after_.assign(tasks.size(), {});
  const auto is_gather = [&](std::size_t i) {
    const lower::Task& task = tasks[i];
    return task.kind == TaskKind::Collective && is_dp_group(task) &&
           task.collective == CollectiveKind::AllGather && task.op_end > task.op_begin;
  };
  // The ZeRO-3 weights a compute task reads (none for the optimizer's).
  const auto reads = [&](const lower::Task& task) {
    std::vector<Key> read;
    if (task.kind != TaskKind::Compute || lower::in_optimizer_step(task.phase)) return read;
    for (const Key& key : keys_of(task.op_begin, task.op_end)) {
      if (zero3(params_.at(key))) read.push_back(key);  // else an unsharded expert's: resident
    }
    for (auto id = task.op_begin; id < task.op_end; ++id) {
      const auto op = static_cast<OpId>(id);
      if (tied_head(g_.op(op)) && !params_.count({op, 0})) {
        read.push_back({g_.layer_ops(-1).front(), 0});  // the embedding's table
      }
    }
    return read;
  };
  // Each gather's first task that waits for it (the tasks before it do not): that depends on it,
  // or on a later collective of the data-parallel stream, which runs them in order (settle).
  std::vector<std::size_t> first_user(tasks.size(), tasks.size());
  for (std::size_t j = 0; j < tasks.size(); ++j) {
    for (const lower::TaskId d : tasks[j].deps) {
      auto& user = first_user[static_cast<std::size_t>(d)];
      user = std::min(user, j);
    }
  }
  std::size_t later = tasks.size();  // the first user of the dp stream's later collectives
  for (std::size_t i = tasks.size(); i-- > 0;) {
    if (tasks[i].stream != lower::Stream::Dp) continue;
    first_user[i] = std::min(first_user[i], later);
    later = first_user[i];
  }
  std::map<Key, std::size_t> last;  // since the weights' gather
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const lower::Task& task = tasks[i];
    if (is_gather(i)) {
      // No task between this gather and its first user reads its weights: they are gathered
      // in place, started, and undefined until the gather is waited for. (The lowering issues a
      // unit's gather before the unit ahead of it computes, and a unit of the layer that one
      // computes keeps its weights instead of gathering them.)
      std::set<Key> live;
      for (std::size_t k = i + 1; k < first_user[i] && k < tasks.size(); ++k) {
        for (const Key& key : reads(tasks[k])) live.insert(key);
      }
      for (const Key& key : keys_for(task)) {
        DTSIM_ASSERT(live.count(key) == 0,
                     fmt::format("ZeRO-3: task {} gathers {} while a task before its first user "
                                 "reads it",
                                 i, params_.at(key).name));
        if (const auto it = last.find(key); it != last.end()) {
          release_weights_after_[it->second].push_back(key);
        }
        last[key] = i;
      }
      continue;
    }
    for (const Key& key : reads(task)) {
      const auto it = last.find(key);
      DTSIM_ASSERT(it != last.end(), fmt::format("ZeRO-3: {} is read before the Program gathers it",
                                                 params_.at(key).name));
      it->second = i;
    }
  }
  for (const auto& [key, i] : last) release_weights_after_[i].push_back(key);
}

void Runner::release_weights(std::size_t task) {
  if (release_weights_after_.empty()) return;
  for (const Key& key : release_weights_after_[task]) {
    Param& p = params_.at(key);
    if (p.separate_work) dev_.release(p.work);
    dev_.release(p.data);
    p.data = p.work = View{};
  }
}

void Runner::retire() {
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

void Runner::release_replayed(std::size_t index) {
  std::erase_if(replay_held_, [&](const std::pair<std::size_t, View>& held) {
    if (held.first >= index) return false;
    dev_.release(held.second);
    return true;
  });
}

}  // namespace dtsim::exec::runner_internal
