#include "exec/core/runner.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <random>

#include "exec/cpu/kernels.hpp"
#include "sim/common/error.hpp"

namespace dtsim::exec {

namespace {

using lower::Phase;
using lower::TaskKind;
using model::Op;
using model::OpId;
using model::OpKind;
namespace k = cpu;

struct Param {
  std::vector<float> data, grad, m, v;
  explicit Param(std::size_t n = 0) : data(n), grad(n), m(n), v(n) {}
};

// What one micro-batch keeps between its forward and backward passes.
struct MicroBatch {
  std::vector<int> tokens, targets;
  std::map<OpId, std::vector<float>> out, grad, aux1, aux2;
  double loss = 0;
};

class Runner {
 public:
  Runner(const model::ModelGraph& g, const lower::Program& program, const RunOptions& options)
      : g_(g), m_(g.spec()), program_(program), options_(options), rng_(options.seed) {
    const plan::Plan& p = program.plan;
    if (p.devices() != 1 || program.ranks.size() != 1) {
      throw UnsupportedError(fmt::format(
          "dtexec: plan {} needs {} ranks; this runner executes single-rank plans (the MPI "
          "runner for dp/tp/pp comes next)",
          plan::summary(p), p.devices()));
    }
    if (m_.positions == model::Positions::Rope) {
      throw UnsupportedError(fmt::format("dtexec: model {} uses RoPE, not supported yet", m_.name));
    }
    if (m_.moe)
      throw UnsupportedError(
          fmt::format("dtexec: model {} has experts, not supported yet", m_.name));
    if (p.schedule == plan::Schedule::ZeroBubble) {
      throw UnsupportedError("dtexec: the zero-bubble schedule needs pipelining");
    }
    B_ = static_cast<int>(p.micro_batch_size);
    S_ = static_cast<int>(p.seq_len);
    T_ = B_ * S_;
    C_ = static_cast<int>(m_.hidden);
    V_ = static_cast<int>(m_.vocab);
    micro_batches_ = static_cast<int>(p.micro_batches());
    init_params();
    // A learnable stream: each token is followed by next_[token] nine times in ten.
    next_.resize(static_cast<std::size_t>(V_));
    for (int v = 0; v < V_; ++v) next_[static_cast<std::size_t>(v)] = v;
    std::mt19937_64 perm(options.seed ^ 0x9e3779b97f4a7c15ULL);
    std::shuffle(next_.begin(), next_.end(), perm);
  }

  RunResult run() {
    RunResult result;
    const auto t0 = std::chrono::steady_clock::now();
    auto now = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    const auto& tasks = program_.ranks[0].tasks;
    for (int step = 0; step < options_.steps; ++step) {
      batches_.assign(static_cast<std::size_t>(micro_batches_), MicroBatch{});
      for (auto& mb : batches_) make_batch(mb);
      const double begin = now();
      for (std::size_t i = 0; i < tasks.size(); ++i) {
        const double start = now();
        execute(tasks[i]);
        if (step >= options_.warmup_steps) {
          result.tasks.push_back(
              {program_.ranks[0].rank, static_cast<std::int32_t>(i), start, now(), step});
        }
      }
      result.step_times_s.push_back(now() - begin);
      double loss = 0;
      for (const auto& mb : batches_) loss += mb.loss;
      result.losses.push_back(loss / micro_batches_);
    }
    std::vector<double> timed(
        result.step_times_s.begin() +
            std::min<std::size_t>(static_cast<std::size_t>(options_.warmup_steps),
                                  result.step_times_s.size() - 1),
        result.step_times_s.end());
    std::sort(timed.begin(), timed.end());
    result.step_time_s = timed[timed.size() / 2];
    return result;
  }

 private:
  void init_params() {
    std::normal_distribution<float> normal(0.0f, 0.02f);
    for (OpId id = 0; id < g_.size(); ++id) {
      const Op& op = g_.op(id);
      auto randn = [&](std::size_t n) {
        Param p(n);
        for (auto& x : p.data) x = normal(rng_);
        return p;
      };
      auto fill = [&](std::size_t n, float value) {
        Param p(n);
        std::fill(p.data.begin(), p.data.end(), value);
        return p;
      };
      switch (op.kind) {
        case OpKind::Embedding:
          weight_[id] = randn(static_cast<std::size_t>(V_) * C_);
          if (m_.positions == model::Positions::Learned) {
            bias_[id] = randn(static_cast<std::size_t>(m_.max_positions) * C_);
          }
          break;
        case OpKind::Norm:
          weight_[id] = fill(static_cast<std::size_t>(C_), 1.0f);
          if (op.params > static_cast<std::uint64_t>(C_))
            bias_[id] = fill(static_cast<std::size_t>(C_), 0.0f);
          break;
        case OpKind::QkvProj:
        case OpKind::AttnOutProj:
        case OpKind::MlpUp:
        case OpKind::MlpDown:
        case OpKind::LmHead: {
          const auto kk = static_cast<std::size_t>(op.gemm_k),
                     nn = static_cast<std::size_t>(op.gemm_n);
          if (op.params == 0) break;  // tied head: uses the embedding
          weight_[id] = randn(kk * nn);
          if (op.params > kk * nn) bias_[id] = fill(nn, 0.0f);
          break;
        }
        case OpKind::Router:
          throw UnsupportedError("dtexec: MoE routers are not supported yet");
        default:
          break;
      }
      std::uint64_t have = 0;
      if (weight_.count(id)) have += weight_[id].data.size();
      if (bias_.count(id)) have += bias_[id].data.size();
      DTSIM_ASSERT(have == op.params, fmt::format("parameters of {}: {} allocated, graph says {}",
                                                  op.name, have, op.params));
    }
  }

  void make_batch(MicroBatch& mb) {
    std::uniform_int_distribution<int> token(0, V_ - 1);
    std::uniform_real_distribution<float> coin(0.0f, 1.0f);
    mb.tokens.resize(static_cast<std::size_t>(T_));
    mb.targets.resize(static_cast<std::size_t>(T_));
    for (int b = 0; b < B_; ++b) {
      int t = token(rng_);
      for (int s = 0; s < S_; ++s) {
        const int next = coin(rng_) < 0.9f ? next_[static_cast<std::size_t>(t)] : token(rng_);
        mb.tokens[static_cast<std::size_t>(b * S_ + s)] = t;
        mb.targets[static_cast<std::size_t>(b * S_ + s)] = next;
        t = next;
      }
    }
  }

  std::vector<float>& grad_of(MicroBatch& mb, OpId id) {
    auto& gbuf = mb.grad[id];
    if (gbuf.empty()) gbuf.assign(mb.out.at(id).size(), 0.0f);
    return gbuf;
  }

  OpId input(OpId id) const { return g_.predecessors(id).front(); }

  // The tied head's weight: the embedding transposed, [C, V].
  std::vector<float> head_weight(OpId head) {
    if (weight_.count(head)) return weight_[head].data;
    const auto& wte = weight_.at(0).data;
    std::vector<float> w(static_cast<std::size_t>(C_) * V_);
    for (int v = 0; v < V_; ++v) {
      for (int c = 0; c < C_; ++c)
        w[static_cast<std::size_t>(c) * V_ + v] = wte[static_cast<std::size_t>(v) * C_ + c];
    }
    return w;
  }

  void forward(MicroBatch& mb, OpId id) {
    const Op& op = g_.op(id);
    auto& out = mb.out[id];
    switch (op.kind) {
      case OpKind::Embedding:
        out.assign(static_cast<std::size_t>(T_) * C_, 0.0f);
        k::embedding_forward(out, mb.tokens, weight_.at(id).data,
                             bias_.count(id) ? k::In(bias_.at(id).data) : k::In(), B_, S_, C_);
        break;
      case OpKind::Norm: {
        out.assign(static_cast<std::size_t>(T_) * C_, 0.0f);
        mb.aux1[id].assign(static_cast<std::size_t>(T_), 0.0f);
        mb.aux2[id].assign(static_cast<std::size_t>(T_), 0.0f);
        k::norm_forward(out, mb.aux1[id], mb.aux2[id], mb.out.at(input(id)), weight_.at(id).data,
                        bias_.count(id) ? k::In(bias_.at(id).data) : k::In(), T_, C_,
                        m_.norm == model::Norm::RmsNorm);
        break;
      }
      case OpKind::QkvProj:
      case OpKind::AttnOutProj:
      case OpKind::MlpUp:
      case OpKind::MlpDown:
      case OpKind::LmHead: {
        const int K = static_cast<int>(op.gemm_k), N = static_cast<int>(op.gemm_n);
        out.assign(static_cast<std::size_t>(T_) * N, 0.0f);
        const std::vector<float> w =
            op.kind == OpKind::LmHead ? head_weight(id) : std::vector<float>();
        k::matmul_forward(out, mb.out.at(input(id)),
                          op.kind == OpKind::LmHead ? k::In(w) : k::In(weight_.at(id).data),
                          bias_.count(id) ? k::In(bias_.at(id).data) : k::In(), T_, K, N);
        break;
      }
      case OpKind::AttentionCore: {
        const int H = static_cast<int>(m_.heads), G = static_cast<int>(m_.kv_heads),
                  D = static_cast<int>(m_.head_dim);
        out.assign(static_cast<std::size_t>(T_) * H * D, 0.0f);
        mb.aux1[id].assign(static_cast<std::size_t>(B_) * H * S_ * S_, 0.0f);
        k::attention_forward(out, mb.aux1[id], mb.out.at(input(id)), B_, S_, H, G, D);
        break;
      }
      case OpKind::Residual: {
        const auto preds = g_.predecessors(id);
        const auto& a = mb.out.at(preds[0]);
        const auto& b = mb.out.at(preds[1]);
        out.resize(a.size());
        for (std::size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
        break;
      }
      case OpKind::Activation: {
        const auto& in = mb.out.at(input(id));
        if (m_.activation == model::Activation::Gelu) {
          out.assign(in.size(), 0.0f);
          k::gelu_forward(out, in, static_cast<std::int64_t>(in.size()));
        } else {
          const int F = static_cast<int>(in.size() / static_cast<std::size_t>(T_) / 2);
          out.assign(static_cast<std::size_t>(T_) * F, 0.0f);
          k::swiglu_forward(out, in, T_, F);
        }
        break;
      }
      case OpKind::Loss: {
        const auto& logits = mb.out.at(input(id));
        mb.aux1[id].assign(logits.size(), 0.0f);
        mb.loss = k::cross_entropy(mb.aux1[id], logits, mb.targets, T_, V_);
        out.assign(1, static_cast<float>(mb.loss));
        break;
      }
      case OpKind::Router:
        throw UnsupportedError("dtexec: MoE routers are not supported yet");
    }
  }

  void backward(MicroBatch& mb, OpId id) {
    const Op& op = g_.op(id);
    switch (op.kind) {
      case OpKind::Loss: {
        // The step's loss is the mean over micro-batches: scale each one's gradient by 1/m.
        auto& dlogits = grad_of(mb, input(id));
        const auto& d = mb.aux1.at(id);
        const float scale = 1.0f / static_cast<float>(micro_batches_);
        for (std::size_t i = 0; i < d.size(); ++i) dlogits[i] += d[i] * scale;
        break;
      }
      case OpKind::Embedding:
        k::embedding_backward(weight_.at(id).grad,
                              bias_.count(id) ? k::Out(bias_.at(id).grad) : k::Out(),
                              mb.grad.at(id), mb.tokens, B_, S_, C_);
        break;
      case OpKind::Norm:
        k::norm_backward(grad_of(mb, input(id)), weight_.at(id).grad,
                         bias_.count(id) ? k::Out(bias_.at(id).grad) : k::Out(), mb.grad.at(id),
                         mb.out.at(input(id)), weight_.at(id).data, mb.aux1.at(id), mb.aux2.at(id),
                         T_, C_, m_.norm == model::Norm::RmsNorm);
        break;
      case OpKind::QkvProj:
      case OpKind::AttnOutProj:
      case OpKind::MlpUp:
      case OpKind::MlpDown:
      case OpKind::LmHead: {
        const int K = static_cast<int>(op.gemm_k), N = static_cast<int>(op.gemm_n);
        const bool tied = op.kind == OpKind::LmHead && !weight_.count(id);
        const std::vector<float> w = tied ? head_weight(id) : std::vector<float>();
        std::vector<float> dw_tied(tied ? w.size() : 0, 0.0f);
        k::matmul_backward(
            grad_of(mb, input(id)), tied ? k::Out(dw_tied) : k::Out(weight_.at(id).grad),
            bias_.count(id) ? k::Out(bias_.at(id).grad) : k::Out(), mb.grad.at(id),
            mb.out.at(input(id)), tied ? k::In(w) : k::In(weight_.at(id).data), T_, K, N);
        if (tied) {
          auto& dwte = weight_.at(0).grad;
          for (int v = 0; v < V_; ++v) {
            for (int c = 0; c < C_; ++c) {
              dwte[static_cast<std::size_t>(v) * C_ + c] +=
                  dw_tied[static_cast<std::size_t>(c) * V_ + v];
            }
          }
        }
        break;
      }
      case OpKind::AttentionCore:
        k::attention_backward(grad_of(mb, input(id)), mb.grad.at(id), mb.out.at(input(id)),
                              mb.aux1.at(id), B_, S_, static_cast<int>(m_.heads),
                              static_cast<int>(m_.kv_heads), static_cast<int>(m_.head_dim));
        break;
      case OpKind::Residual:
        for (OpId pred : g_.predecessors(id)) {
          auto& d = grad_of(mb, pred);
          const auto& dout = mb.grad.at(id);
          for (std::size_t i = 0; i < d.size(); ++i) d[i] += dout[i];
        }
        break;
      case OpKind::Activation: {
        const auto& in = mb.out.at(input(id));
        if (m_.activation == model::Activation::Gelu) {
          k::gelu_backward(grad_of(mb, input(id)), in, mb.grad.at(id),
                           static_cast<std::int64_t>(in.size()));
        } else {
          k::swiglu_backward(grad_of(mb, input(id)), in, mb.grad.at(id), T_,
                             static_cast<int>(in.size() / static_cast<std::size_t>(T_) / 2));
        }
        break;
      }
      case OpKind::Router:
        throw UnsupportedError("dtexec: MoE routers are not supported yet");
    }
  }

  void execute(const lower::Task& task) {
    switch (task.kind) {
      case TaskKind::Compute: {
        if (task.phase == Phase::Optimizer) {
          ++adam_step_;
          for (auto* params : {&weight_, &bias_}) {
            for (auto& [id, p] : *params) {
              k::adamw(p.data, p.grad, p.m, p.v, static_cast<std::int64_t>(p.data.size()),
                       options_.learning_rate, 0.9f, 0.95f, 1e-8f, 0.0f, adam_step_);
              std::fill(p.grad.begin(), p.grad.end(), 0.0f);
            }
          }
          return;
        }
        MicroBatch& mb = batches_.at(static_cast<std::size_t>(task.micro_batch));
        if (task.phase == Phase::Forward || task.phase == Phase::Recompute) {
          for (auto id = task.op_begin; id < task.op_end; ++id) forward(mb, static_cast<OpId>(id));
        } else if (task.phase == Phase::Backward) {
          for (auto id = task.op_end; id-- > task.op_begin;) backward(mb, static_cast<OpId>(id));
        } else {
          throw UnsupportedError(
              fmt::format("dtexec: phase {} is not supported yet", to_string(task.phase)));
        }
        return;
      }
      case TaskKind::Collective:
      case TaskKind::Send:
      case TaskKind::Recv:
        throw UnsupportedError("dtexec: communication tasks need the MPI runner");
    }
  }

  const model::ModelGraph& g_;
  const model::ModelSpec& m_;
  const lower::Program& program_;
  RunOptions options_;
  std::mt19937_64 rng_;
  std::map<OpId, Param> weight_, bias_;
  std::vector<int> next_;
  std::vector<MicroBatch> batches_;
  int B_ = 0, S_ = 0, T_ = 0, C_ = 0, V_ = 0, micro_batches_ = 1, adam_step_ = 0;
};

}  // namespace

RunResult run_program(const model::ModelGraph& graph, const lower::Program& program,
                      const RunOptions& options) {
  DTSIM_ASSERT(options.steps >= 1, "at least one step");
  return Runner(graph, program, options).run();
}

}  // namespace dtsim::exec
