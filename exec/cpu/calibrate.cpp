#include "exec/cpu/calibrate.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <ctime>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "exec/core/timing_stats.hpp"
#include "exec/cpu/kernels.hpp"
#include "sim/common/error.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::exec::cpu {

namespace {

// Called before every timed run: under mpirun, a barrier, so that all ranks run the same
// kernel at the same time and share the cores' memory bandwidth as a multi-rank step does.
std::function<void()> g_sync = [] {};

// The median of `repeats` timed runs of f (after one untimed run). Each timed run repeats f
// for at least 20 ms, so that the rate is the sustained one a training step sees rather than a
// short burst's.
template <typename F>
double median_of(int repeats, F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const double once = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int inner = static_cast<int>(std::clamp(0.02 / std::max(once, 1e-9), 1.0, 1e6));
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    g_sync();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < inner; ++i) f();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / inner);
  }
  return median(std::move(times));
}

// How many copies of an op's buffers to cycle through so that they exceed the caches, as a
// training step walks through layers and micro-batches (64 MiB in all, 1 to 64 copies).
int copies_for(std::size_t bytes_per_copy) {
  const std::size_t target = 64u << 20;
  return static_cast<int>(
      std::clamp<std::size_t>(target / std::max<std::size_t>(bytes_per_copy, 1), 1, 64));
}

// The median over `repeats` of the time per copy of running f(i) on copies i = 0..copies-1.
template <typename F>
double median_per_copy(int repeats, int copies, F&& f) {
  return median_of(repeats,
                   [&] {
                     for (int i = 0; i < copies; ++i) f(static_cast<std::size_t>(i));
                   }) /
         copies;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

std::vector<float> random_buffer(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(gen);
  return v;
}

std::vector<std::vector<float>> random_buffers(int copies, std::size_t n, std::uint64_t seed) {
  std::vector<std::vector<float>> v;
  for (int i = 0; i < copies; ++i)
    v.push_back(random_buffer(n, seed * 1000 + static_cast<std::uint64_t>(i)));
  return v;
}

// Times the non-GEMM ops of layer 0, the embedding and the loss of `graph` with the executor's
// kernels, forward and backward; returns the "ops" table of the profile.
nlohmann::json time_ops(const model::ModelGraph& graph, int repeats) {
  using model::OpKind;
  const model::ModelSpec& m = graph.spec();
  const int B = static_cast<int>(graph.micro_batch()), S = static_cast<int>(graph.seq_len());
  const int T = B * S, C = static_cast<int>(m.hidden), V = static_cast<int>(m.vocab_rows());
  const int H = static_cast<int>(m.heads), G = static_cast<int>(m.kv_heads),
            D = static_cast<int>(m.head_dim);
  const bool rms = m.norm == model::Norm::RmsNorm;
  const bool gelu = m.activation == model::Activation::Gelu;
  // A model with dropout is timed with it (the runner's masks, at its rate), so that the rates
  // of the attention core, the residuals and the embedding include it.
  Dropout dropout;
  dropout.stream = 1;
  dropout.rate = kDropoutRate;
  dropout.Sq = S;
  const Dropout* drop = m.dropout ? &dropout : nullptr;
  const auto tc = static_cast<std::size_t>(T) * C;
  std::vector<OpTiming> timings;
  auto record = [&](const char* name, double fwd_s, double bwd_s) {
    timings.push_back({name, fwd_s, bwd_s});
  };
  std::vector<int> tokens(static_cast<std::size_t>(T));
  for (int t = 0; t < T; ++t) tokens[static_cast<std::size_t>(t)] = (t * 7919) % V;
  const std::size_t fl = sizeof(float);
  // (One rate each: a block's norms are alike, and so are its activations, the shared
  // experts' beside the routed ones'.)
  bool norm_done = false, activation_done = false;
  for (model::OpId id : graph.layer_ops(0)) {
    const model::Op& op = graph.op(id);
    switch (op.kind) {
      case OpKind::Norm: {
        if (norm_done) break;
        norm_done = true;
        const int n = copies_for(3 * tc * fl);
        auto in = random_buffers(n, tc, 1), dout = random_buffers(n, tc, 4);
        const auto w = random_buffer(static_cast<std::size_t>(C), 2),
                   b = random_buffer(static_cast<std::size_t>(C), 3);
        std::vector<std::vector<float>> out(n, std::vector<float>(tc)),
            din(n, std::vector<float>(tc));
        std::vector<std::vector<float>> mean(n, std::vector<float>(static_cast<std::size_t>(T))),
            rstd(n, std::vector<float>(static_cast<std::size_t>(T)));
        std::vector<float> dw(static_cast<std::size_t>(C)), db(static_cast<std::size_t>(C));
        const double f = median_per_copy(repeats, n, [&](std::size_t i) {
          out[i].assign(tc, 0.0f);
          norm_forward(out[i], mean[i], rstd[i], in[i], w, rms ? In() : In(b), T, C, rms);
        });
        const double bw = median_per_copy(repeats, n, [&](std::size_t i) {
          norm_backward(din[i], dw, rms ? Out() : Out(db), dout[i], in[i], w, mean[i], rstd[i], T,
                        C, rms);
        });
        record(rms ? "rmsnorm" : "layernorm", f, bw);
        break;
      }
      case OpKind::AttentionCore:
        // Both kinds of plan: the probabilities kept (unfused), or FlashAttention's memory.
        for (const bool flash : {false, true}) {
          // Multi-head latent attention: values of their own width, and the packing of the
          // up projections' outputs and the keys' RoPE part (mla_pack_forward) in place of
          // RoPE's turn.
          const bool mla = m.mla.has_value();
          const int Dv = static_cast<int>(m.v_head_dim());
          const int Dn = mla ? static_cast<int>(m.mla->qk_nope_head_dim) : 0;
          const int Dr = mla ? static_cast<int>(m.mla->qk_rope_head_dim) : 0;
          const auto tokens_n = static_cast<std::size_t>(T);
          const auto q = random_buffer(mla ? tokens_n * H * D : 0, 7);
          const auto kv = random_buffer(mla ? tokens_n * H * (Dn + Dv) : 0, 8);
          const auto k_rope = random_buffer(mla ? tokens_n * Dr : 0, 9);
          std::vector<float> dq(q.size()), dkv(kv.size()), dk_rope(k_rope.size());
          const auto width = static_cast<std::size_t>(T) * ((H + G) * D + G * Dv);
          const auto out_n = static_cast<std::size_t>(T) * H * Dv;
          const auto probs_n = static_cast<std::size_t>(B) * H * S * (flash ? 1 : S);
          const int n = copies_for((2 * width + 2 * out_n + probs_n) * fl);
          auto qkv = random_buffers(n, width, 5), dout = random_buffers(n, out_n, 6);
          std::vector<std::vector<float>> out(n), probs(n), dqkv(n, std::vector<float>(width));
          // With RoPE the runner turns q and k before the core and the gradients back after.
          const bool rope = m.positions == model::Positions::Rope;
          std::vector<float> turned(rope ? width : 0), turned_grad(rope ? width : 0);
          // Dropout of the probabilities: a mask and the dropped probabilities per copy (unfused).
          const bool masks = drop != nullptr && !flash;
          std::vector<std::vector<std::uint8_t>> mask(masks ? n : 0,
                                                      std::vector<std::uint8_t>(probs_n));
          std::vector<std::vector<float>> dropped(masks ? n : 0, std::vector<float>(probs_n));
          // probs: the probabilities, or FlashAttention's log-sum-exp per row.
          auto options = [&](std::size_t i) {
            AttentionOptions o;
            o.v_dim = Dv;
            o.dropout = drop;
            if (masks) {
              o.mask = mask[i];
              o.dropped = dropped[i];
            }
            if (flash) o.lse = probs[i];
            return o;
          };
          auto kept = [&](std::size_t i) { return flash ? Out() : Out(probs[i]); };
          const double f = median_per_copy(repeats, n, [&](std::size_t i) {
            out[i].assign(out_n, 0.0f);
            probs[i].assign(probs_n, 0.0f);
            if (mla) {
              mla_pack_forward(turned, q, kv, k_rope, B, S, H, Dn, Dr, Dv, m.rope_theta);
            } else if (rope) {
              rope_forward(turned, qkv[i], B, S, H, G, D, m.rope_theta);
            }
            attention_forward(out[i], kept(i), rope ? In(turned) : In(qkv[i]), B, S, H, G, D,
                              options(i));
          });
          const double bw = median_per_copy(repeats, n, [&](std::size_t i) {
            if (rope) {
              turned_grad.assign(width, 0.0f);
              // The rotated q and k the forward read (of the last copy: the rotation keeps
              // their norms, so the scores' range and the work are the same).
              attention_backward(turned_grad, turned_grad, dout[i], turned, kept(i), B, S, H, G, D,
                                 options(i));
              if (mla) {
                mla_pack_backward(dq, dkv, dk_rope, turned_grad, B, S, H, Dn, Dr, Dv, m.rope_theta);
              } else {
                rope_backward(dqkv[i], turned_grad, B, S, H, G, D, m.rope_theta);
              }
            } else {
              attention_backward(dqkv[i], dqkv[i], dout[i], qkv[i], kept(i), B, S, H, G, D,
                                 options(i));
            }
          });
          record(flash ? "flash_attention" : "attention", f, bw);
        }
        break;
      case OpKind::Activation: {
        if (activation_done) break;
        activation_done = true;
        // At the shape of the op its rate is priced by (op_rate_rows: the block's first
        // activation): a mixture's experts' runs on the top_k copies of each token, a dense
        // block's at its own width.
        const ActivationShape shape = priced_activation(graph);
        const auto rows = static_cast<int>(shape.rows), F = static_cast<int>(shape.width);
        const auto n_in = static_cast<std::size_t>(rows) * F * (gelu ? 1 : 2);
        const auto n_out = static_cast<std::size_t>(rows) * F;
        const int n = copies_for((2 * n_in + 2 * n_out) * fl);
        auto in = random_buffers(n, n_in, 7), dout = random_buffers(n, n_out, 8);
        std::vector<std::vector<float>> out(n), din(n, std::vector<float>(n_in));
        const double f = median_per_copy(repeats, n, [&](std::size_t i) {
          out[i].assign(n_out, 0.0f);
          if (gelu) {
            gelu_forward(out[i], in[i], static_cast<std::int64_t>(n_in));
          } else {
            swiglu_forward(out[i], in[i], rows, F);
          }
        });
        const double bw = median_per_copy(repeats, n, [&](std::size_t i) {
          if (gelu) {
            gelu_backward(din[i], in[i], dout[i], static_cast<std::int64_t>(n_in));
          } else {
            swiglu_backward(din[i], in[i], dout[i], rows, F);
          }
        });
        record(gelu ? "gelu" : "swiglu", f, bw);
        break;
      }
      case OpKind::Residual: {
        if (op.name.find("mlp") != std::string::npos) break;  // both residuals are alike
        const int n = copies_for(5 * tc * fl);
        auto a = random_buffers(n, tc, 9), b = random_buffers(n, tc, 10),
             dout = random_buffers(n, tc, 11);
        std::vector<std::vector<float>> out(n, std::vector<float>(tc)),
            da(n, std::vector<float>(tc)), db(n, std::vector<float>(tc));
        // With dropout the branch (a) is dropped out: its mask is kept per copy.
        std::vector<std::vector<std::uint8_t>> mask(drop ? n : 0, std::vector<std::uint8_t>(tc));
        const double f = median_per_copy(repeats, n, [&](std::size_t i) {
          out[i].resize(tc);
          if (drop) {
            dropout_add_forward(out[i], mask[i], a[i], b[i], *drop, T, C);
          } else {
            add_forward(out[i], a[i], b[i]);
          }
        });
        // As the runner's: each input's gradient made from the output's (a copy, its first
        // contribution), the branch's through its dropout (added into zeros).
        const double bw = median_per_copy(repeats, n, [&](std::size_t i) {
          if (drop) {
            dropout_backward(da[i], mask[i], dout[i], drop->rate);
          } else {
            std::copy(dout[i].begin(), dout[i].end(), da[i].begin());
          }
          std::copy(dout[i].begin(), dout[i].end(), db[i].begin());
        });
        record("residual", f, bw);
        break;
      }
      default:
        break;
    }
  }
  // The embedding (with learned positions if the model has them) and the loss.
  {
    const int n = copies_for(2 * tc * fl);
    const auto wte = random_buffer(static_cast<std::size_t>(V) * C, 12);
    const auto wpe = random_buffer(static_cast<std::size_t>(S) * C, 13);
    auto dout = random_buffers(n, tc, 14);
    std::vector<std::vector<float>> out(n);
    std::vector<float> dwte(wte.size()), dwpe(wpe.size());
    const bool learned = m.positions == model::Positions::Learned;
    // With dropout: on the output, and the gradient through it first (as the runner does).
    std::vector<std::vector<std::uint8_t>> mask(drop ? n : 0, std::vector<std::uint8_t>(tc));
    std::vector<float> dy(drop ? tc : 0);
    const double f = median_per_copy(repeats, n, [&](std::size_t i) {
      out[i].assign(tc, 0.0f);
      embedding_forward(out[i], tokens, wte, learned ? In(wpe) : In(), B, S, C);
      if (drop) dropout_forward(out[i], mask[i], out[i], *drop, T, C);
    });
    const double bw = median_per_copy(repeats, n, [&](std::size_t i) {
      if (drop) {
        dy.assign(tc, 0.0f);
        dropout_backward(dy, mask[i], dout[i], drop->rate);
      }
      embedding_backward(dwte, learned ? Out(dwpe) : Out(), drop ? In(dy) : In(dout[i]), tokens, B,
                         S, C);
    });
    record("embedding", f, bw);
  }
  {  // the loss: its statistics (no backward), then the loss and gradient from them
    const auto logits_n = static_cast<std::size_t>(T) * V;
    const int n = copies_for(3 * logits_n * fl);
    auto logits = random_buffers(n, logits_n, 15);
    std::vector<std::vector<float>> dlogits(n, std::vector<float>(logits_n)),
        grad(n, std::vector<float>(logits_n)),
        stats(n, std::vector<float>(3 * static_cast<std::size_t>(T)));
    auto statistics = [&](std::size_t i) {
      const std::span<float> s = stats[i];
      cross_entropy_max(s.first(T), logits[i], T, V);
      cross_entropy_sums(s.subspan(T), logits[i], s.first(T), tokens, T, V, 0);
    };
    record("loss_statistics", median_per_copy(repeats, n, statistics), 0.0);
    const double f = median_per_copy(repeats, n, [&](std::size_t i) {
      const std::span<const float> s = stats[i];
      cross_entropy_sharded(dlogits[i], logits[i], s.first(T), s.subspan(T), tokens, T, V, 0);
    });
    // The runner's loss backward: the saved gradient, scaled, into the logits' gradient.
    const double bw = median_per_copy(
        repeats, n, [&](std::size_t i) { cpu::accumulate(grad[i], dlogits[i], 0.5f); });
    record("loss", f, bw);
  }
  return op_rate_rows(graph, timings);
}

}  // namespace

CalibrationStamp calibration_stamp() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  return {host, date};
}

ActivationShape priced_activation(const model::ModelGraph& graph) {
  const model::ModelSpec& m = graph.spec();
  for (model::OpId id : graph.layer_ops(0)) {
    const model::Op& op = graph.op(id);
    if (op.kind != model::OpKind::Activation) continue;
    const std::int64_t tokens = graph.micro_batch() * graph.seq_len();
    return op.expert ? ActivationShape{tokens * m.moe->top_k, m.moe->expert_ffn_hidden}
                     : ActivationShape{tokens, m.dense_ffn(0)};
  }
  throw InternalError("calibration: no activation op in layer 0");
}

nlohmann::json op_rate_rows(const model::ModelGraph& graph, const std::vector<OpTiming>& timings) {
  using model::OpKind;
  // The op each name stands for.
  auto first_of = [&](int layer, OpKind kind) -> const model::Op& {
    for (model::OpId id : graph.layer_ops(layer)) {
      if (graph.op(id).kind == kind) return graph.op(id);
    }
    throw InternalError(
        fmt::format("calibration: no {} op in layer {}", model::to_string(kind), layer));
  };
  auto named = [&](const std::string& name) -> const model::Op& {
    if (name == "layernorm" || name == "rmsnorm") return first_of(0, OpKind::Norm);
    if (name == "attention" || name == "flash_attention") return first_of(0, OpKind::AttentionCore);
    if (name == "gelu" || name == "swiglu") return first_of(0, OpKind::Activation);
    if (name == "residual") return first_of(0, OpKind::Residual);
    if (name == "embedding") return first_of(-1, OpKind::Embedding);
    const int head = static_cast<int>(graph.spec().layers);
    if (name == "loss_statistics") return first_of(head, OpKind::LossStatistics);
    if (name == "loss") return first_of(head, OpKind::Loss);
    throw InternalError(fmt::format("calibration: no op is called {}", name));
  };
  nlohmann::json ops = nlohmann::json::array();
  for (const OpTiming& t : timings) {
    const model::Op& op = named(t.op);
    const bool flops = op.kind == OpKind::AttentionCore;
    const double fwd_work = flops ? op.fwd_flops : op.fwd_bytes;
    const double bwd_work = flops ? op.bwd_input_flops + op.bwd_weight_flops : op.bwd_bytes;
    const char* unit = flops ? "flops_per_s" : "bytes_per_s";
    ops.push_back(
        {{"op", t.op}, {"phase", "fwd"}, {unit, fwd_work / t.fwd_s}, {"seconds", t.fwd_s}});
    if (bwd_work <= 0) continue;  // no backward (the loss statistics)
    ops.push_back(
        {{"op", t.op}, {"phase", "bwd"}, {unit, bwd_work / t.bwd_s}, {"seconds", t.bwd_s}});
  }
  return ops;
}

std::vector<ModelGemm> model_gemms(const model::ModelGraph& graph, int max_tp, int max_cp) {
  std::vector<ModelGemm> gemms;
  auto add = [&](int T, int K, int N) {
    for (const GemmPass pass : {GemmPass::Forward, GemmPass::InputGrad, GemmPass::WeightGrad}) {
      const ModelGemm g{T, K, N, pass};
      const bool seen = std::any_of(gemms.begin(), gemms.end(), [&](const ModelGemm& o) {
        return o.pass == g.pass && o.mkn() == g.mkn();
      });
      if (!seen) gemms.push_back(g);
    }
  };
  const int most = std::max(max_tp, max_cp);  // ranks: tp x cp at most
  // One block's GEMMs are every block's of its kind: block 0's, and where blocks differ (a
  // mixture's dense blocks among those with experts) the first of the other kind's (its router
  // and shared experts); the head's too. Experts are not timed.
  const model::ModelSpec& m = graph.spec();
  const std::int64_t other = m.first_block(!m.has_experts(0));  // (-1: none)
  for (const model::Op& op : graph.ops()) {
    const bool timed_block = op.layer <= 0 || op.layer >= m.layers || op.layer == other;
    if (op.gemm_m <= 0 || op.expert || !timed_block) continue;
    const int T = static_cast<int>(op.gemm_m), K = static_cast<int>(op.gemm_k),
              N = static_cast<int>(op.gemm_n);
    const bool column =
        op.tp_split == model::TpSplit::Column || op.tp_split == model::TpSplit::Vocab;
    const bool row = op.tp_split == model::TpSplit::Row;
    // Context parallelism gives a rank 1/cp of each sequence's tokens (rows); with tp too.
    for (int cp = 1; cp <= max_cp; cp *= 2) {
      if (T % cp != 0) continue;
      const int rows = T / cp;
      add(rows, K, N);
      for (int tp = 2; tp <= max_tp && tp * cp <= most; tp *= 2) {
        if (column && N % tp == 0) add(rows, K, N / tp);
        if (row && K % tp == 0) add(rows, K / tp, N);
      }
    }
  }
  return gemms;
}

double time_gemm(const ModelGemm& g, int repeats) {
  const std::size_t T = static_cast<std::size_t>(g.T), K = static_cast<std::size_t>(g.K),
                    N = static_cast<std::size_t>(g.N);
  const auto in = random_buffer(T * K, 16);
  const auto w = random_buffer(K * N, 17);
  const auto dout = random_buffer(T * N, 18);
  std::vector<float> out(T * N), din(T * K), dw(K * N);
  return median_of(repeats, [&] {
    switch (g.pass) {
      case GemmPass::Forward:
        matmul_forward(out, in, w, {}, g.T, g.K, g.N);
        break;
      case GemmPass::InputGrad:  // written whole, as a step's first contribution is
        matmul_input_grad(din, dout, w, g.T, g.K, g.N);
        break;
      case GemmPass::WeightGrad:
        matmul_backward({}, dw, {}, dout, in, w, g.T, g.K, g.N);
        break;
    }
  });
}

std::vector<ModelGemm> gemms_to_time(const model::ModelGraph& graph, int max_tp,
                                     std::vector<std::array<int, 3>> timed, int max_cp) {
  std::vector<ModelGemm> out;
  for (const ModelGemm& g : model_gemms(graph, max_tp, max_cp)) {
    if (std::find(timed.begin(), timed.end(), g.mkn()) != timed.end()) continue;
    timed.push_back(g.mkn());
    out.push_back(g);
  }
  return out;
}

model::ModelGraph calibration_graph(const CalibrateOptions& options) {
  // The vocabulary padded as a one-device plan pads it: the shapes `dtexec run` trains.
  const model::ModelSpec spec =
      plan::with_padded_vocab(model::load_model(options.model), plan::Plan{});
  const std::int64_t seq = options.seq_len > 0 ? options.seq_len : spec.seq_len;
  const std::int64_t mbs = options.quick ? 1 : options.micro_batch_size;
  return model::ModelGraph(spec, mbs, options.quick ? std::min<std::int64_t>(seq, 32) : seq,
                           4);  // fp32 activations
}

nlohmann::json calibrate(const CalibrateOptions& options) {
  using nlohmann::json;
  if (options.gemm_threads > 0) set_gemm_threads(options.gemm_threads);
  g_sync = options.sync ? options.sync : [] {};
  const model::ModelGraph graph = calibration_graph(options);
  const model::ModelSpec& spec = graph.spec();
  const int repeats = options.quick ? 2 : options.repeats;

  // Square GEMMs, and the calibration model's GEMMs as the executor runs them: forward
  // [T,K]x[K,N], and the backward's input gradient dout·w^T and weight gradient in^T·dout,
  // each with its own layout (transposed operands run at their own speed), whole and split
  // over tp, over cp (their rows) and over both, up to the ranks measuring at once. dtsim
  // prices a GEMM of a measured shape by its own time (sim/cost/profile.hpp); with cp 2's
  // GEMMs interpolated from other sizes, cpu-small's cp 2 compute was -10.1% against a run's
  // trace, -3.6% with their shapes measured (2026-12-07).
  std::vector<ModelGemm> timed;
  if (options.quick) {
    timed = {{32, 32, 32, GemmPass::Forward}, {128, 128, 128, GemmPass::Forward}};
  } else {
    for (int s : {64, 128, 256, 512, 1024}) timed.push_back({s, s, s, GemmPass::Forward});
  }
  std::vector<std::array<int, 3>> squares;
  for (const ModelGemm& g : timed) squares.push_back(g.mkn());
  const int ranks = std::max(1, options.ranks_per_host);
  for (const ModelGemm& g : gemms_to_time(graph, ranks, squares, ranks)) {
    timed.push_back(g);
  }
  // Round-robin: each round times every shape once, and a shape's time is its median over the
  // rounds, so that a spell of the host (tens of percent on a shared one) weighs on every shape
  // alike instead of on the few timed during it: the ratios between shapes, which the
  // in_run factors do not correct, stay steady.
  std::vector<std::vector<double>> samples(timed.size());
  for (int r = 0; r < repeats; ++r) {
    for (std::size_t i = 0; i < timed.size(); ++i) samples[i].push_back(time_gemm(timed[i], 1));
  }
  json gemm = json::array();
  for (std::size_t i = 0; i < timed.size(); ++i) {
    const auto [m, k, n] = timed[i].mkn();
    gemm.push_back({{"m", m}, {"n", n}, {"k", k}, {"seconds", median(samples[i])}});
  }
  // Jitter: the spread of one compute segment's time, timed again and again (every rank at
  // once under mpirun, after a barrier). The segment is the calibration model's largest forward
  // GEMM, about what a rank computes between two collectives, repeated to last at least 1 ms.
  // The spread is robust to the odd preempted sample (exec/core/timing_stats.hpp).
  double jitter_cv = 0;
  {
    std::array<int, 3> big{0, 0, 0};
    for (model::OpId id = 0; id < graph.size(); ++id) {
      const model::Op& op = graph.op(id);
      if (op.gemm_m <= 0 || op.layer < 0 || op.layer >= spec.layers) continue;
      if (op.fwd_flops > 2.0 * big[0] * big[1] * big[2]) {
        big = {static_cast<int>(op.gemm_m), static_cast<int>(op.gemm_k),
               static_cast<int>(op.gemm_n)};
      }
    }
    const auto [m, k, n] = big;
    if (m > 0) {
      const auto a = random_buffer(static_cast<std::size_t>(m) * k, 20);
      const auto b = random_buffer(static_cast<std::size_t>(k) * n, 21);
      std::vector<float> c(static_cast<std::size_t>(m) * n);
      const auto t0 = std::chrono::steady_clock::now();
      matmul_forward(c, a, b, {}, m, k, n);
      const double once =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const int inner = static_cast<int>(std::clamp(1e-3 / std::max(once, 1e-9), 1.0, 1e5));
      std::vector<double> t;
      for (int r = 0; r < std::max(20, 6 * repeats); ++r) {
        g_sync();
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < inner; ++i) matmul_forward(c, a, b, {}, m, k, n);
        t.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      jitter_cv = robust_cv(t);
    }
  }
  json ops = time_ops(graph, repeats);
  {
    // AdamW over a buffer of 1M parameters (4M quick: 256k): 28 bytes per parameter.
    const std::size_t n = options.quick ? (1u << 18) : (1u << 20);
    auto p = random_buffer(n, 18), g = random_buffer(n, 19);
    std::vector<float> mom(n, 0.0f), var(n, 0.0f);
    int t = 0;
    const double s = median_of(repeats, [&] {
      adamw(p, g, mom, var, static_cast<std::int64_t>(n), 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, ++t);
    });
    ops.push_back({{"op", "optimizer"},
                   {"phase", "step"},
                   {"bytes_per_s", 28.0 * static_cast<double>(n) / s},
                   {"seconds", s}});
  }
  // Streaming bandwidth: copy a buffer much larger than the caches (read + write).
  const std::size_t n = options.quick ? (4u << 20) : (32u << 20);
  std::vector<float> src(n, 1.0f), dst(n);
  const double copy_s = median_of(repeats, [&] { std::copy(src.begin(), src.end(), dst.begin()); });
  const double bw = 2.0 * static_cast<double>(n) * sizeof(float) / copy_s;
  std::vector<float> x(64, 1.0f), y(64);
  const double tiny_s = median_of(repeats * 10, [&] { matmul_forward(y, x, x, {}, 8, 8, 8); });
  const auto [host, date] = calibration_stamp();
  return {{"device", "cpu-host"},
          {"source",
           fmt::format("dtexec calibrate --backend cpu on {} ({}), {}: {} rank(s) per host "
                       "measuring at once, OpenBLAS sgemm with {} thread(s), op shapes of {} "
                       "(micro-batch {}, sequence {}{}), medians of {}",
                       host, cpu_name(), date, options.ranks_per_host,
                       options.gemm_threads > 0 ? std::to_string(options.gemm_threads)
                                                : std::string("its default"),
                       spec.name, graph.micro_batch(), graph.seq_len(),
                       spec.dropout ? "; attention, residuals and embedding with its dropout" : "",
                       repeats)},
          {"precision", "fp32"},
          {"ranks_per_host", options.ranks_per_host},
          {"gemm", gemm},
          {"ops", ops},
          {"memory_bw_bytes_per_s", bw},
          {"launch_overhead_s", tiny_s},
          {"jitter_cv", jitter_cv}};
}

}  // namespace dtsim::exec::cpu
