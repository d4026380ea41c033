// The Program runner (exec/core/runner_internal.hpp): the ops of a compute task, forward and
// backward (experts and their all-to-alls too).
#include "exec/core/runner_internal.hpp"

namespace dtsim::exec::runner_internal {

void Runner::forward(MicroBatch& mb, OpId id) {
  const Op& op = g_.op(id);
  auto& out = mb.out[id];
  switch (op.kind) {
    case OpKind::LatentDown:
      latent_down_forward(mb, id);
      break;
    case OpKind::Embedding: {
      fresh_for_overwrite(out, static_cast<std::int64_t>(T_) * C_);
      // Positions are added once: by tensor-parallel rank 0, before the all-reduce.
      dev_.embedding_forward(out, mb.tokens, param(id, 0).data, t_ == 0 ? bias_in(id) : View{}, B_,
                             Sq_, C_, t_ * Vl_, positions_);
      // Its dropout applies to the whole sum: here on one tensor-parallel rank, else after
      // the Program's reduction (embedding_dropout).
      if (tp_ == 1) embedding_dropout(mb, id);
      break;
    }
    case OpKind::Norm: {
      if (latent_norm(op)) {
        latent_norm_forward(mb, id);
        break;
      }
      // Norms run on this rank's share of the sequence under sequence parallelism.
      fresh_for_overwrite(out, static_cast<std::int64_t>(Ts_) * C_);
      fresh_for_overwrite(mb.aux1[id], Ts_, Dtype::F32);  // mean
      fresh_for_overwrite(mb.aux2[id], Ts_, Dtype::F32);  // 1 / standard deviation
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
      fresh_for_overwrite(out, static_cast<std::int64_t>(T_) * N);
      // A row-parallel op's bias is added once, by tensor-parallel rank 0.
      const View bias = row_parallel(op) && t_ != 0 ? View{} : bias_in(id);
      const bool tied = tied_head(op);
      dev_.matmul_forward(out, gemm_input(mb, id), tied ? tied_table(id).work : param(id, 0).work,
                          bias, T_, K, N, tied);
      if (adds_routed(id)) {
        // The shared experts' down projection adds the routed experts' output: whole, or under
        // moe_local_dispatch the rank's share of the sequence into its rows (the reduce-scatter
        // that follows sums each row over the ranks; the other ranks add none there).
        const View routed = mb.out.at(g_.predecessors(id).at(1));
        dev_.accumulate(routed.size() == out.size() ? out : out.sub(routed_rows(), routed.size()),
                        routed);
      }
      // Sequence parallelism keeps only the rank's share of a column-parallel layer's input:
      // the backward gathers it again (the Program's Backward-phase all-gather).
      // (A latent's up projection: its own gathered latent.)
      if (const auto it = mb.full.find(latent_projection(op) ? id : input(id));
          it != mb.full.end()) {
        dev_.release(it->second);
        mb.full.erase(it);
      }
      break;
    }
    case OpKind::AttentionCore: {
      fresh_for_overwrite(out, static_cast<std::int64_t>(T_) * H_ * Dv_);
      // What the backward reads: the probabilities, or FlashAttention's log-sum-exp of each
      // row (fp32).
      const std::int64_t rows = static_cast<std::int64_t>(B_) * H_ * Sq_;
      if (flash_) {
        fresh_for_overwrite(mb.aux1[id], rows, Dtype::F32);
      } else {
        fresh_for_overwrite(mb.aux1[id], rows * S_);
      }
      View q = mb.out.at(input(id));
      if (m_.mla) {
        // Multi-head latent attention: queries, keys and values packed, their RoPE parts turned.
        auto& packed = mb.aux2[id];
        fresh_for_overwrite(packed, static_cast<std::int64_t>(T_) * H_ * (2 * D_ + Dv_));
        dev_.mla_pack_forward(packed, q, mb.out.at(g_.predecessors(id).at(1)), latent_rope(mb, id),
                              B_, Sq_, H_, Dn_, Dr_, Dv_, m_.rope_theta, positions_);
        q = packed;
      } else if (m_.positions == model::Positions::Rope) {
        // Rotary positions are applied to q and k as the attention core reads them.
        auto& turned = mb.aux2[id];
        fresh_for_overwrite(turned, q.size());
        dev_.rope_forward(turned, q, B_, Sq_, H_, G_, D_, m_.rope_theta, positions_);
        q = turned;
      }
      if (cp_ > 1 || dropout_ > 0 || flash_ || m_.mla) {
        const Device::DropoutSite site = dropout_site(mb, op.layer, kAttentionDropout, 0);
        Device::Attention a = attention_extras(mb, id, dropout_ > 0 ? &site : nullptr);
        if (dropout_ > 0 && !flash_) {
          fresh_for_overwrite(mb.mask[id], mb.aux1[id].size(), Dtype::U8);
          fresh_for_overwrite(mb.dropped[id], mb.aux1[id].size());
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
      fresh_for_overwrite(out, a.size());
      if (dropout_ > 0) {
        // The branch (the attention or MLP block's output) is dropped out, the skip is not.
        const int rows = static_cast<int>(a.size() / C_);
        fresh_for_overwrite(mb.mask[id], a.size(), Dtype::U8);
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
        fresh_for_overwrite(out, in.size());
        dev_.gelu_forward(out, in);
      } else {
        // Experts: the copies they compute on.
        const auto rows = static_cast<int>(op.expert ? expert_copies(mb, router_of(id)) : T_);
        const int F = mlp_width(op);  // (an ep rank's experts may get no rows)
        fresh_for_overwrite(out, static_cast<std::int64_t>(rows) * F);
        dev_.swiglu_forward(out, in, rows, F);
      }
      break;
    }
    case OpKind::LossStatistics: {
      // Over the rank's share of the vocabulary: each row's maximum, then the sums of the
      // exponentials (to that maximum) and the target logits. With tp > 1 a copy of the
      // maxima follows, for loss_statistics to rescale the sums once the maxima are reduced.
      const View logits = mb.out.at(input(id));
      View& stats = mb.aux2[id];
      fresh(stats, (tp_ > 1 ? 4 : 3) * static_cast<std::int64_t>(T_), Dtype::F32);
      const View rowmax = stats.sub(0, T_);
      dev_.cross_entropy_max(rowmax, logits, T_, Vl_);
      dev_.cross_entropy_sums(stats.sub(T_, 2 * T_), logits, rowmax, mb.targets, T_, Vl_, t_ * Vl_);
      break;
    }
    case OpKind::Loss: {
      // From the statistics over the whole vocabulary (reduced over tp by the task before).
      const View logits = mb.out.at(input(id));
      fresh_for_overwrite(mb.aux1[id], logits.size());  // the logits' gradient, kept for backward
      const View stats = mb.aux2.at(statistics_of(id));
      dev_.cross_entropy_sharded(mb.aux1[id], losses_.sub(mb.index, 1), logits, stats.sub(0, T_),
                                 stats.sub(T_, 2 * T_), mb.targets, T_, Vl_, t_ * Vl_);
      break;
    }
    case OpKind::Router:
      router_forward(mb, id);
      break;
  }
}

Device::DropoutSite Runner::dropout_site(const MicroBatch& mb, int layer, int site,
                                         int first_row) const {
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

int Runner::residual_site(OpId branch) const {
  const OpKind kind = g_.op(branch).kind;
  DTSIM_ASSERT(kind == OpKind::AttnOutProj || kind == OpKind::MlpDown,
               "a residual's first input is its block's output");
  return kind == OpKind::AttnOutProj ? kAttnResidual : kMlpResidual;
}

void Runner::embedding_dropout(MicroBatch& mb, OpId id) {
  if (dropout_ == 0) return;
  View& out = mb.out.at(id);
  const int rows = static_cast<int>(out.size() / C_);
  fresh_for_overwrite(mb.mask[id], out.size(), Dtype::U8);
  dev_.dropout_forward(out, mb.mask[id], out,
                       dropout_site(mb, -1, kEmbeddingDropout, rows == T_ ? 0 : t_ * Ts_), rows,
                       C_);
}

Device::Attention Runner::attention_extras(MicroBatch& mb, OpId id,
                                           const Device::DropoutSite* site) {
  Device::Attention a;
  if (cp_ > 1) a.kv = mb.kv.at(id);
  a.cp = cp_;
  a.qpos = positions_;
  a.order = key_order_;
  a.dropout = site;
  a.v_dim = Dv_;
  return a;
}

Runner::Part Runner::part_of(Phase phase) {
  return phase == Phase::BackwardInput    ? Part::Input
         : phase == Phase::BackwardWeight ? Part::Weight
                                          : Part::Both;
}

void Runner::backward(MicroBatch& mb, OpId id, Part part) {
  const Op& op = g_.op(id);
  const bool input_grads = part != Part::Weight;
  const bool weight_grads = part != Part::Input;
  // Ops without weights do all their work in the input pass.
  const bool has_weights = holds_weights(id) || tied_head(op);
  if (!has_weights && !input_grads) return;
  switch (op.kind) {
    case OpKind::LatentDown:
      latent_down_backward(mb, id, part);
      break;
    case OpKind::LossStatistics:  // no backward: the loss's forward wrote the gradient
      break;
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
          dy = allocate(dy.size());  // (dropout_backward adds into it)
          dev_.dropout_backward(dy, mb.mask.at(id), mb.grad.at(id), dropout_);
        }
        dev_.embedding_backward(grad(param(id, 0)), bias_grad(id), dy, mb.tokens, B_, Sq_, C_,
                                t_ * Vl_, positions_);
        if (dropped) dev_.release(dy);
      }
      break;
    case OpKind::Norm:
      if (latent_norm(op)) {
        latent_norm_backward(mb, id, input_grads, weight_grads);
        break;
      }
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
      GradOut din;
      if (input_grads) {
        // The latents' up projections each add into their part of the norm's gradient.
        din = latent_projection(op) ? latent_input_grad(mb, id) : input_grad_to_write(mb, id);
      }
      linear_backward(din, w, weight_grads && !tied ? bias_grad(id) : View{}, mb.grad.at(id),
                      weight_grads ? gemm_input(mb, id) : View{}, T_, K, N, tied, weight_grads);
      if (adds_routed(id) && input_grads) {
        // The routed experts' output gradient is the sum's (its rows, as the forward added).
        const OpId routed = g_.predecessors(id).at(1);
        const View dy = mb.grad.at(id);
        const std::int64_t n = output_size(mb, routed);
        add_to_grad(mb, routed, n == dy.size() ? dy : dy.sub(routed_rows(), n));
      }
      break;
    }
    case OpKind::AttentionCore: {
      const bool rope = m_.positions == model::Positions::Rope;
      const View q = rope ? mb.aux2.at(id) : mb.out.at(input(id));
      // Rotary positions (or latent attention's packing): the gradient of the rotated q and k,
      // turned back into qkv's.
      const View dq = rope ? allocate(q.size()) : grad_of(mb, input(id));
      if (cp_ > 1 || dropout_ > 0 || flash_ || m_.mla) {
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
      if (m_.mla) {
        dev_.mla_pack_backward(grad_of(mb, input(id)), grad_of(mb, g_.predecessors(id).at(1)),
                               latent_rope_grad(mb, id), dq, B_, Sq_, H_, Dn_, Dr_, Dv_,
                               m_.rope_theta, positions_);
        dev_.release(dq);
      } else if (rope) {
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
        add_to_grad(mb, preds[0], mb.grad.at(id));
      }
      add_to_grad(mb, preds[1], mb.grad.at(id));
      break;
    }
    case OpKind::Activation: {
      const View in = mb.out.at(input(id));
      write_grad(mb, input(id), [&](View din) {
        if (m_.activation == model::Activation::Gelu) {
          dev_.gelu_backward(din, in, mb.grad.at(id));
        } else {
          const auto rows = static_cast<int>(op.expert ? expert_copies(mb, router_of(id)) : T_);
          dev_.swiglu_backward(din, in, mb.grad.at(id), rows, mlp_width(op));
        }
      });
      break;
    }
    case OpKind::Router:
      router_backward(mb, id, part);
      break;
  }
}

void Runner::linear_backward(GradOut din, Param& w, View dbias, View dout, View in, int rows, int K,
                             int N, bool tied, bool weight_grads) {
  if (din.unwritten) {
    // The gradient's first contribution: written whole, neither zeroed nor read first.
    dev_.matmul_input_grad(din.v, dout, w.work, rows, K, N, tied);
    din.v = View{};
    if (!weight_grads) return;
  }
  const bool separate = weight_grads && !program_.plan.grad_accumulation_fusion;
  View fresh;
  if (separate) {
    fresh = dev_.allocate(w.n, Dtype::F32);
    dev_.zero(fresh);
  }
  dev_.matmul_backward(din.v, separate ? fresh : (weight_grads ? grad(w) : View{}),
                       weight_grads ? dbias : View{}, dout, weight_grads ? in : View{}, w.work,
                       rows, K, N, tied);
  if (separate) {
    dev_.accumulate(grad(w), fresh);
    dev_.release(fresh);
  }
}

OpId Runner::router_of(OpId id) const {
  OpId r = id;
  while (g_.op(r).kind != OpKind::Router) r = input(r);
  return r;
}

void Runner::router_forward(MicroBatch& mb, OpId id) {
  const int E = static_cast<int>(m_.moe->experts), k = top_k();
  // The whole sequence, or under sequence parallelism the rank's share (moe_local_dispatch).
  const View x = input_of(mb, id);
  const View logits = allocate_for_overwrite(static_cast<std::int64_t>(Tr_) * E);
  dev_.matmul_forward(logits, x, param(id, 0).work, View{}, Tr_, C_, E, false);
  fresh(mb.aux1[id], static_cast<std::int64_t>(Tr_) * k, Dtype::F32);  // gates
  fresh(mb.aux2[id], static_cast<std::int64_t>(Tr_) * k, Dtype::I32);  // experts
  const Gating gates = gating();
  dev_.moe_route(mb.aux2[id], mb.aux1[id], logits, Tr_, E, k, gates);
  // Gates over all experts, or sigmoid scores: their backward reads the logits kept.
  if (!gates.reads_logits()) {
    dev_.release(logits);
  } else {
    dev_.release(mb.logits[id]);  // (the forward's, where a recompute routes again)
    mb.logits[id] = logits;
  }
  fresh(mb.route[id], static_cast<std::int64_t>(Tr_) * k, Dtype::I32);
  fresh_for_overwrite(mb.out[id], static_cast<std::int64_t>(Tr_) * k * C_);
  // Each expert's row count comes back as fp32 (Device::download), exact below 2^24.
  DTSIM_ASSERT(static_cast<std::int64_t>(T_) * k < (std::int64_t{1} << 24),
               "fewer than 2^24 token copies per micro-batch");
  const View rows = dev_.allocate(E, Dtype::F32);
  dev_.moe_dispatch(mb.out[id], mb.route[id], rows, x, mb.aux2[id], Tr_, C_, k, E);
  std::vector<float> counts(static_cast<std::size_t>(E));
  dev_.download(counts.data(), rows);
  dev_.release(rows);
  auto& per_expert = mb.expert_rows[id];
  per_expert.assign(counts.begin(), counts.end());
}

std::int64_t Runner::expert_copies(const MicroBatch& mb, OpId router) const {
  if (ep_ == 1 && !local_dispatch_) return static_cast<std::int64_t>(T_) * top_k();
  const auto& blocks = expert_blocks(mb, router);
  return std::accumulate(blocks.begin(), blocks.end(), std::int64_t{0});
}

void Runner::experts_forward(MicroBatch& mb, OpId id) {
  const Op& op = g_.op(id);
  const OpId router = router_of(id);
  const auto [K, N] = gemm_shape(op);
  const int k = top_k();
  const bool down = op.kind == OpKind::MlpDown;
  const View in = mb.out.at(input(id));
  View& y = down ? mb.aux1[id] : mb.out[id];
  fresh_for_overwrite(y, expert_copies(mb, router) * N);
  // The down GEMMs are row-parallel: their bias is added once, by tensor-parallel rank 0.
  const bool bias_here = !down || t_ == 0;
  for_each_expert(mb, router, [&](int w, std::int64_t at, int n) {
    dev_.matmul_forward(y.sub(at * N, std::int64_t{n} * N), in.sub(at * K, std::int64_t{n} * K),
                        param(id, w).work, bias_here ? bias_in(id, w + 1) : View{}, n, K, N, false);
  });
  // With expert parallelism the copies' outputs go back to their tokens' ranks first (the
  // combine all-to-all, ep_collective), which combine them there; under moe_local_dispatch
  // the partial sums are reduce-scattered over tp first (tp_copies_collective).
  if (down && ep_ == 1 && !local_dispatch_) {
    fresh_for_overwrite(mb.out[id], static_cast<std::int64_t>(T_) * C_);
    dev_.moe_combine(mb.out[id], y, mb.aux1.at(router), mb.route.at(router), T_, C_, k);
  }
}

void Runner::experts_backward(MicroBatch& mb, OpId id, Part part) {
  const Op& op = g_.op(id);
  const bool input_grads = part != Part::Weight;
  const bool weight_grads = part != Part::Input;
  const OpId router = router_of(id);
  const auto [K, N] = gemm_shape(op);
  const int k = top_k();
  const bool down = op.kind == OpKind::MlpDown;
  const std::int64_t copies = static_cast<std::int64_t>(T_) * k;
  // With expert parallelism the combine's backward ran at the tokens' ranks, and the copies'
  // gradients came here by the combine all-to-all (ep_collective): dy is theirs already; so
  // under moe_local_dispatch, all-gathered over tp (tp_copies_collective).
  const bool through_combine = down && ep_ == 1 && !local_dispatch_;
  View dy;
  if (!through_combine) {
    dy = mb.grad.at(id);
  } else if (!input_grads) {
    // Zero-bubble's W pass: the copies' gradients that the B pass's combine backward made.
    dy = mb.copy_grad.at(id);
  } else {
    // Through the combine: each copy's output gradient (its gate times its token's), and the
    // gates' gradient for the router; a B pass keeps the copies' for its W pass (the
    // simulator's W pass keeps them and moves none of the combine's bytes).
    dy = allocate_for_overwrite(copies * N);
    auto& g = mb.gate_grad[router];
    if (g.empty()) fresh(g, copies, Dtype::F32);
    dev_.moe_combine_backward(dy, g, mb.grad.at(id), mb.aux1.at(id), mb.aux1.at(router),
                              mb.route.at(router), T_, C_, k);
    if (!weight_grads) mb.copy_grad[id] = dy;
  }
  const View in = weight_grads ? mb.out.at(input(id)) : View{};
  // The experts' rows cover the input's gradient whole: each expert's GEMM writes its rows
  // where this is the gradient's first contribution.
  const GradOut din = input_grads ? input_grad_to_write(mb, id) : GradOut{};
  for_each_expert(mb, router, [&](int w, std::int64_t at, int n) {
    linear_backward(
        GradOut{din.v.empty() ? View{} : din.v.sub(at * K, std::int64_t{n} * K), din.unwritten},
        param(id, w), bias_grad(id, w + 1), dy.sub(at * N, std::int64_t{n} * N),
        in.empty() ? View{} : in.sub(at * K, std::int64_t{n} * K), n, K, N, false, weight_grads);
  });
  if (through_combine && input_grads && weight_grads) dev_.release(dy);
}

void Runner::ep_collective(const lower::Task& task, MicroBatch& mb, bool alone) {
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
    mb.expert_load += copies / (static_cast<double>(Tr_) * k);
    ++mb.expert_blocks;
  }
  std::vector<int> to(static_cast<std::size_t>(ep_), 0), from(static_cast<std::size_t>(ep_), 0);
  for (int e = 0; e < E; ++e) {
    to[static_cast<std::size_t>(e / local)] += rows[static_cast<std::size_t>(e)];
    from[static_cast<std::size_t>(e / local)] += blocks.at(static_cast<std::size_t>(e));
  }
  // Moves `tensor` (rows of width C_) from the layout of `send` rows per member to that of
  // `receive`, in place of the old; towards the experts (send is `to`) or back from them.
  auto exchange = [&](View& tensor, const std::vector<int>& send, const std::vector<int>& receive) {
    const bool to_experts = &send == &to;
    std::vector<std::int64_t> in(send.begin(), send.end()), out(receive.begin(), receive.end());
    for (auto& n : in) n *= C_;
    for (auto& n : out) n *= C_;
    // Written whole by the all-to-all; replayed alone, this rank's pieces alone (the rest zero).
    const std::int64_t moved_n = std::accumulate(out.begin(), out.end(), std::int64_t{0});
    const View moved = alone ? dev_.allocate(moved_n, tensor.type)
                             : dev_.allocate_for_overwrite(moved_n, tensor.type);
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
    fresh_for_overwrite(mb.out[anchor], static_cast<std::int64_t>(Tr_) * C_);
    dev_.moe_combine(mb.out[anchor], mb.aux1.at(anchor), mb.aux1.at(router), mb.route.at(router),
                     Tr_, C_, k);
    return;
  }
  // The combine's backward at the tokens' rank: the copies' gradients and the gates'.
  const std::int64_t copies = static_cast<std::int64_t>(Tr_) * k;
  View dy = allocate_for_overwrite(copies * C_);
  auto& dgates = mb.gate_grad[router];
  if (dgates.empty()) fresh(dgates, copies, Dtype::F32);
  dev_.moe_combine_backward(dy, dgates, mb.grad.at(anchor), mb.aux1.at(anchor), mb.aux1.at(router),
                            mb.route.at(router), Tr_, C_, k);
  exchange(dy, to, from);
  dev_.release(mb.grad.at(anchor));
  mb.grad[anchor] = dy;
}

void Runner::tp_copies_collective(const lower::Task& task, MicroBatch& mb, bool alone) {
  const auto anchor = static_cast<OpId>(task.op_begin);
  const Op& op = g_.op(anchor);
  DTSIM_ASSERT(
      local_dispatch_ && op.expert && (op.kind == OpKind::MlpUp || op.kind == OpKind::MlpDown),
      "a tp collective of the experts' copies at an expert up or down op");
  const OpId router = router_of(anchor);
  const bool up = op.kind == OpKind::MlpUp;
  // Forward: the up op's input gathered, the down op's output scattered; backward the converse.
  const bool backward = up != (task.collective == CollectiveKind::AllGather);
  const int E = static_cast<int>(m_.moe->experts), k = top_k();
  auto& blocks = mb.tp_blocks[router];
  if (up && !backward) {
    // Every tp rank's blocks (rows per expert, or per (ep sender, local expert)), as fp32
    // (exact below 2^24, as the router's counts).
    const auto& own = own_blocks(mb, router);
    DTSIM_ASSERT(own.size() == static_cast<std::size_t>(E), "a block per expert");
    const std::vector<float> counts(own.begin(), own.end());
    std::vector<float> all(static_cast<std::size_t>(tp_) * E);
    if (alone) {
      for (int j = 0; j < tp_; ++j) std::copy(counts.begin(), counts.end(), all.begin() + j * E);
    } else {
      const View sent = dev_.allocate(E, Dtype::F32), got = dev_.allocate(tp_ * E, Dtype::F32);
      dev_.upload(sent, counts.data());
      const std::vector<int> each(static_cast<std::size_t>(tp_), E);
      comm_.all_gather(task.group, sent, got, each);
      dev_.download(all.data(), got);
      dev_.release(sent);
      dev_.release(got);
    }
    blocks.assign(all.begin(), all.end());
  }
  // Each tp rank's copies, in elements of rows of width C_.
  std::vector<std::int64_t> pieces(static_cast<std::size_t>(tp_), 0);
  for (std::size_t b = 0; b < blocks.size(); ++b)
    pieces[b / static_cast<std::size_t>(E)] += blocks[b];
  for (auto& n : pieces) n *= C_;
  const std::vector<int> counts = collective_counts(pieces, "tp all-gather of expert copies");
  const std::int64_t total = std::accumulate(pieces.begin(), pieces.end(), std::int64_t{0});
  const std::int64_t mine = pieces[static_cast<std::size_t>(t_)];
  const std::int64_t offset = std::accumulate(pieces.begin(), pieces.begin() + t_, std::int64_t{0});
  auto all_gather = [&](View& tensor) {
    DTSIM_ASSERT(tensor.size() == mine, "a tp rank's own copies");
    const View whole = dev_.allocate_for_overwrite(total, tensor.type);  // written whole
    if (alone) {
      for (std::int64_t at = 0; at < total; at += mine) dev_.copy(whole.sub(at, mine), tensor);
    } else {
      comm_.all_gather(task.group, tensor, whole, counts);
    }
    dev_.release(tensor);
    tensor = whole;
  };
  auto reduce_scatter = [&](View& tensor) {
    DTSIM_ASSERT(tensor.size() == total, "every tp rank's copies");
    const View part = dev_.allocate_for_overwrite(mine, tensor.type);
    if (alone) {
      dev_.copy(part, tensor.sub(offset, mine));
    } else {
      comm_.reduce_scatter(task.group, tensor, part, counts);
    }
    dev_.release(tensor);
    tensor = part;
  };
  if (up) {
    if (!backward) {
      all_gather(mb.out.at(router));
    } else {
      reduce_scatter(mb.grad.at(router));
    }
    return;
  }
  if (!backward) {
    // The down GEMMs' partial sums (row-parallel: each tp rank holds a slice of every expert),
    // summed at the copies' tp rank; combined there where no ep all-to-all follows.
    reduce_scatter(mb.aux1.at(anchor));
    if (ep_ == 1) {
      fresh_for_overwrite(mb.out[anchor], static_cast<std::int64_t>(Tr_) * C_);
      dev_.moe_combine(mb.out[anchor], mb.aux1.at(anchor), mb.aux1.at(router), mb.route.at(router),
                       Tr_, C_, k);
    }
    return;
  }
  if (ep_ == 1) {
    // The combine's backward at the tokens first: the copies' gradients and the gates'.
    const std::int64_t copies = static_cast<std::int64_t>(Tr_) * k;
    const View dy = allocate_for_overwrite(copies * C_);
    auto& dgates = mb.gate_grad[router];
    if (dgates.empty()) fresh(dgates, copies, Dtype::F32);
    dev_.moe_combine_backward(dy, dgates, mb.grad.at(anchor), mb.aux1.at(anchor),
                              mb.aux1.at(router), mb.route.at(router), Tr_, C_, k);
    dev_.release(mb.grad.at(anchor));
    mb.grad[anchor] = dy;
  }
  all_gather(mb.grad.at(anchor));
}

void Runner::router_backward(MicroBatch& mb, OpId id, Part part) {
  const bool input_grads = part != Part::Weight;
  const bool weight_grads = part != Part::Input;
  const int E = static_cast<int>(m_.moe->experts), k = top_k();
  // The logits' gradient through the gates' softmax (again in a weight pass).
  const View dlogits = allocate(static_cast<std::int64_t>(Tr_) * E);
  const Gating gates = gating();
  dev_.moe_route_backward(dlogits, mb.gate_grad.at(id), mb.aux1.at(id), mb.aux2.at(id),
                          gates.reads_logits() ? mb.logits.at(id) : View{}, Tr_, E, k, gates);
  const View x = weight_grads ? input_of(mb, id) : View{};
  const View dx = input_grads ? input_grad_of(mb, id) : View{};
  // Every tp rank routes alike: the router's share of the input gradient is added by rank 0
  // alone, as the tp all-reduce that follows sums the ranks' (the experts' shares differ).
  // Under moe_local_dispatch each routes its own tokens, and their gradients are whole.
  linear_backward(GradOut{t_ == 0 || local_dispatch_ ? dx : View{}}, param(id, 0), View{}, dlogits,
                  x, Tr_, C_, E, false, weight_grads);
  dev_.release(dlogits);
  // Each token's copies' gradients back to the token.
  if (input_grads) dev_.moe_dispatch_backward(dx, mb.grad.at(id), mb.route.at(id), Tr_, C_, k);
}

}  // namespace dtsim::exec::runner_internal
