// The Program runner (exec/core/runner_internal.hpp): multi-head latent attention's down
// projection, its latents' norms and the parts of them that the up projections read.
#include "exec/core/runner_internal.hpp"

namespace dtsim::exec::runner_internal {

Runner::Projection Runner::projection(const Op& op) const {
  if (!m_.mla || op.kind != OpKind::QkvProj) return Projection::Qkv;
  if (op.name.ends_with(".q_up")) return Projection::QUp;
  if (op.name.ends_with(".q_proj")) return Projection::QProj;
  DTSIM_ASSERT(op.name.ends_with(".kv_up"), "latent attention's projections: q_up, q_proj, kv_up");
  return Projection::KvUp;
}

std::vector<Runner::Segment> Runner::latent_segments(bool normed) const {
  std::vector<Segment> segments;
  int at = 0;
  for (const int width : {Rq_, Rkv_, normed ? 0 : Dr_}) {
    if (width > 0) segments.push_back({at, width});
    at += width;
  }
  return segments;
}

View Runner::gemm_input(MicroBatch& mb, OpId id) {
  const Op& op = g_.op(id);
  if (!latent_projection(op)) return input_of(mb, id);
  if (Ts_ != T_) return mb.full.at(id);
  const View in = mb.out.at(input(id));
  const std::int64_t rows = T_;
  return projection(op) == Projection::QUp ? in.sub(0, rows * Rq_)
                                           : in.sub(rows * Rq_, rows * Rkv_);
}

Runner::GradOut Runner::latent_input_grad(MicroBatch& mb, OpId id) {
  const bool q = projection(g_.op(id)) == Projection::QUp;
  const std::int64_t rows = T_, width = q ? Rq_ : Rkv_;
  if (Ts_ != T_) {
    // The gathered latent's gradient: this op's alone, written whole by its GEMM.
    View& g = mb.full_grad[id];
    if (!g.empty()) return {g, false};
    fresh_for_overwrite(g, rows * width);
    return {g, true};
  }
  return {grad_of(mb, input(id)).sub(q ? 0 : rows * Rq_, rows * width), false};
}

void Runner::latent_sp_collective(const lower::Task& task, MicroBatch& mb, OpId anchor,
                                  bool local) {
  const bool q = projection(g_.op(anchor)) == Projection::QUp;
  const OpId norm = input(anchor), down = input(norm);
  const std::int64_t rows = Ts_;
  // (The rank's share of the latents' norm output: its latent; of the down projection's: the
  // keys' RoPE part.)
  const std::int64_t latent_at = q ? 0 : rows * Rq_, rope_at = rows * (Rq_ + Rkv_);
  const int width = q ? Rq_ : Rkv_;
  auto gather = [&](View share, View& whole, int w) {
    fresh_for_overwrite(whole, static_cast<std::int64_t>(T_) * w);
    gather_shares(task, tp_, share, whole, local, "a latent's all-gather");
  };
  auto scatter = [&](std::map<OpId, View>& grads, OpId key, View share) {
    View& whole = grads.at(key);
    const View mine = allocate_for_overwrite(share.size());
    scatter_shares(task, tp_, t_, whole, mine, local, "a latent's reduce-scatter");
    dev_.accumulate(share, mine);
    dev_.release(mine);
    dev_.release(whole);
    grads.erase(key);
  };
  if (task.collective == CollectiveKind::AllGather) {
    gather(mb.out.at(norm).sub(latent_at, rows * width), mb.full[anchor], width);
    // The keys' RoPE part for the core, in the forward; the weight gradient's gather again
    // (the lowering's regather, its one tp collective of the Backward phase) wants the latent
    // alone (plan::tp_regather_bytes).
    if (!q && task.phase != Phase::Backward) {
      gather(mb.out.at(down).sub(rope_at, rows * Dr_), mb.full[down], Dr_);
    }
    return;
  }
  DTSIM_ASSERT(task.collective == CollectiveKind::ReduceScatter, "a latent's tp collective");
  scatter(mb.full_grad, anchor, grad_of(mb, norm).sub(latent_at, rows * width));
  if (!q) scatter(mb.full_grad, down, grad_of(mb, down).sub(rope_at, rows * Dr_));
}

OpId Runner::latent_down_of(OpId core) const {
  const OpId kv_up = g_.predecessors(core).at(1);
  const OpId down = input(input(kv_up));
  DTSIM_ASSERT(g_.op(down).kind == OpKind::LatentDown, "kv_up reads the normed latent");
  return down;
}

void Runner::latent_down_forward(MicroBatch& mb, OpId id) {
  const std::int64_t rows = Ts_;  // (the rank's share under sequence parallelism)
  const int width = static_cast<int>(m_.latent_width());
  // One GEMM, as the model prices it, its output's parts then copied apart.
  const View whole = allocate_for_overwrite(rows * width);
  dev_.matmul_forward(whole, input_of(mb, id), param(id, 0).work, View{}, Ts_, C_, width, false);
  View& out = mb.out[id];
  fresh_for_overwrite(out, rows * width);
  for (const Segment& s : latent_segments(false)) {
    dev_.copy_columns(out.sub(rows * s.begin, rows * s.width), whole, Ts_, width, s.begin, s.width);
  }
  dev_.release(whole);
}

void Runner::latent_down_backward(MicroBatch& mb, OpId id, Part part) {
  const bool input_grads = part != Part::Weight, weight_grads = part != Part::Input;
  const std::int64_t rows = Ts_;
  const int width = static_cast<int>(m_.latent_width());
  // The parts' gradients side by side again, for the one GEMM's backward.
  const View dy = mb.grad.at(id), whole = allocate(rows * width);
  for (const Segment& s : latent_segments(false)) {
    dev_.add_columns(whole, dy.sub(rows * s.begin, rows * s.width), Ts_, width, s.begin, s.width);
  }
  linear_backward(input_grads ? input_grad_to_write(mb, id) : GradOut{}, param(id, 0), View{},
                  whole, weight_grads ? input_of(mb, id) : View{}, Ts_, C_, width, false,
                  weight_grads);
  dev_.release(whole);
}

void Runner::latent_norm_forward(MicroBatch& mb, OpId id) {
  const std::int64_t rows = Ts_;  // (the rank's share under sequence parallelism)
  const View in = mb.out.at(input(id));
  const std::vector<Segment> segments = latent_segments(true);
  const auto n = static_cast<std::int64_t>(segments.size());
  View& out = mb.out[id];
  fresh_for_overwrite(out, rows * (Rq_ + Rkv_));
  fresh_for_overwrite(mb.aux1[id], rows * n, Dtype::F32);  // each segment's means
  fresh_for_overwrite(mb.aux2[id], rows * n, Dtype::F32);  // and 1 / standard deviations
  const View w = param(id, 0).data, b = bias_in(id);
  for (std::int64_t i = 0; i < n; ++i) {
    const Segment& s = segments[static_cast<std::size_t>(i)];
    dev_.norm_forward(out.sub(rows * s.begin, rows * s.width), mb.aux1[id].sub(rows * i, rows),
                      mb.aux2[id].sub(rows * i, rows), in.sub(rows * s.begin, rows * s.width),
                      w.sub(s.begin, s.width), b.empty() ? View{} : b.sub(s.begin, s.width), Ts_,
                      s.width, m_.norm == model::Norm::RmsNorm);
  }
}

void Runner::latent_norm_backward(MicroBatch& mb, OpId id, bool input_grads, bool weight_grads) {
  const std::int64_t rows = Ts_;  // (the rank's share under sequence parallelism)
  const View in = mb.out.at(input(id)), dy = mb.grad.at(id);
  const View din = input_grads ? grad_of(mb, input(id)) : View{};
  const View w = param(id, 0).data;
  const View dw = weight_grads ? grad(param(id, 0)) : View{};
  const View db = weight_grads ? bias_grad(id) : View{};
  const std::vector<Segment> segments = latent_segments(true);
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    const auto rows_of = [&](View v) { return v.sub(rows * s.begin, rows * s.width); };
    const auto at = static_cast<std::int64_t>(i) * rows;
    dev_.norm_backward(input_grads ? rows_of(din) : View{},
                       weight_grads ? dw.sub(s.begin, s.width) : View{},
                       db.empty() ? View{} : db.sub(s.begin, s.width), rows_of(dy), rows_of(in),
                       w.sub(s.begin, s.width), mb.aux1.at(id).sub(at, rows),
                       mb.aux2.at(id).sub(at, rows), Ts_, s.width, m_.norm == model::Norm::RmsNorm);
  }
}

}  // namespace dtsim::exec::runner_internal
