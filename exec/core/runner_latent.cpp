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
  const View in = input_of(mb, id);
  const Projection what = projection(g_.op(id));
  const std::int64_t rows = T_;  // (tp 1: check_runnable)
  if (what == Projection::QUp) return in.sub(0, rows * Rq_);
  if (what == Projection::KvUp) return in.sub(rows * Rq_, rows * Rkv_);
  return in;
}

OpId Runner::latent_down_of(OpId core) const {
  const OpId kv_up = g_.predecessors(core).at(1);
  const OpId down = input(input(kv_up));
  DTSIM_ASSERT(g_.op(down).kind == OpKind::LatentDown, "kv_up reads the normed latent");
  return down;
}

void Runner::latent_down_forward(MicroBatch& mb, OpId id) {
  const View x = input_of(mb, id);
  const std::int64_t rows = T_;
  View& out = mb.out[id];
  fresh_for_overwrite(out, rows * static_cast<std::int64_t>(m_.latent_width()));
  const View w = param(id, 0).work;
  for (const Segment& s : latent_segments(false)) {
    dev_.matmul_forward(out.sub(rows * s.begin, rows * s.width), x,
                        w.sub(std::int64_t{C_} * s.begin, std::int64_t{C_} * s.width), View{}, T_,
                        C_, s.width, false);
  }
}

void Runner::latent_down_backward(MicroBatch& mb, OpId id, Part part) {
  const bool input_grads = part != Part::Weight, weight_grads = part != Part::Input;
  const std::int64_t rows = T_;
  const View dy = mb.grad.at(id);
  Param& w = param(id, 0);
  GradOut din = input_grads ? input_grad_to_write(mb, id) : GradOut{};
  const View x = weight_grads ? input_of(mb, id) : View{};
  const View dw = weight_grads ? grad(w) : View{};
  for (const Segment& s : latent_segments(false)) {
    const std::int64_t at = std::int64_t{C_} * s.begin, n = std::int64_t{C_} * s.width;
    linear_backward(din, w.work.sub(at, n), weight_grads ? dw.sub(at, n) : View{}, View{},
                    dy.sub(rows * s.begin, rows * s.width), x, T_, C_, s.width, false);
    din.unwritten = false;  // the parts after the first add into it
  }
}

void Runner::latent_norm_forward(MicroBatch& mb, OpId id) {
  const std::int64_t rows = T_;
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
                      w.sub(s.begin, s.width), b.empty() ? View{} : b.sub(s.begin, s.width), T_,
                      s.width, m_.norm == model::Norm::RmsNorm);
  }
}

void Runner::latent_norm_backward(MicroBatch& mb, OpId id, bool input_grads, bool weight_grads) {
  const std::int64_t rows = T_;
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
                       mb.aux2.at(id).sub(at, rows), T_, s.width, m_.norm == model::Norm::RmsNorm);
  }
}

}  // namespace dtsim::exec::runner_internal
