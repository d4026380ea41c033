// dtexec calibrate --backend cuda: the non-GEMM ops, timed with the executor's own GPU kernels
// (exec/cuda/kernels.hpp) at a calibration model's shapes, as the CPU backend times its own.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <vector>

#include "exec/core/timing_stats.hpp"
#include "exec/cuda/calibrate_cuda.hpp"
#include "exec/cuda/kernels.hpp"

namespace dtsim::exec::cuda {

namespace {

// The median GPU time of `run` over `repeats` runs after one warm-up, CUDA events around each.
double median_time(Kernels& k, int repeats, const std::function<void()>& run) {
  run();
  k.clear_marks();
  std::vector<std::pair<int, int>> marks;
  for (int r = 0; r < std::max(repeats, 1); ++r) {
    const int a = k.mark();
    run();
    marks.emplace_back(a, k.mark());
  }
  std::vector<double> times;
  for (const auto& [a, b] : marks) times.push_back(k.seconds(a, b));
  return median(std::move(times));
}

}  // namespace

OpTimes time_ops(int gpu, GemmPrecision precision, const OpShapes& s, int repeats,
                 std::int64_t adamw_params) {
  const Dtype type = precision == GemmPrecision::Bf16 ? Dtype::BF16 : Dtype::F32;
  Kernels k(gpu, type);
  const std::size_t e = dtype_bytes(type);
  const std::int64_t T = static_cast<std::int64_t>(s.B) * s.S;
  const std::int64_t TC = T * s.C;
  unsigned seed = 1;
  // A buffer of n activation-typed values (or fp32), filled with varied data.
  auto act = [&](std::int64_t n) {
    DeviceBuffer b(static_cast<std::size_t>(n) * e);
    k.fill_random(b.get(), n, seed++);
    return b;
  };
  auto f32 = [&](std::int64_t n, float scale = 1.0f) {
    DeviceBuffer b(static_cast<std::size_t>(n) * 4);
    k.fill_random_f32(b.f32(), n, seed++, scale);
    return b;
  };
  OpTimes out;
  {  // the block's first norm
    DeviceBuffer in = act(TC), dout = act(TC), o = act(TC), din = act(TC);
    DeviceBuffer w = f32(s.C), b = f32(s.C), mean = f32(T), rstd = f32(T), dw = f32(s.C),
                 db = f32(s.C);
    const double f = median_time(k, repeats, [&] {
      k.norm_forward(o.get(), mean.f32(), rstd.f32(), in.get(), w.f32(), s.rms ? nullptr : b.f32(),
                     static_cast<int>(T), s.C, s.rms);
    });
    const double bw = median_time(k, repeats, [&] {
      k.norm_backward(din.get(), dw.f32(), s.rms ? nullptr : db.f32(), dout.get(), in.get(),
                      w.f32(), mean.f32(), rstd.f32(), static_cast<int>(T), s.C, s.rms);
    });
    out.ops.push_back({s.rms ? "rmsnorm" : "layernorm", f, bw});
  }
  // The attention core, with the rotation of q and k where the model has RoPE (multi-head
  // latent attention: the packing of its queries, keys and values, values Dv wide): the
  // probabilities kept (unfused), and FlashAttention's memory (the rows' log-sum-exp kept).
  for (const bool flash : {false, true}) {
    const bool mla = s.Dn > 0;
    const int Dv = mla ? s.Dv : s.D;
    const std::int64_t width = T * ((s.H + s.G) * s.D + s.G * Dv), o_n = T * s.H * Dv;
    const std::int64_t rows = static_cast<std::int64_t>(s.B) * s.H * s.S;
    DeviceBuffer qkv = act(width), dout = act(o_n), o = act(o_n),
                 probs = act(flash ? 1 : rows * s.S), lse = f32(flash ? rows : 1),
                 dqkv = act(width);
    void* p = flash ? nullptr : probs.get();
    float* l = flash ? lse.f32() : nullptr;
    const bool turn = s.rope || mla;
    DeviceBuffer turned = act(turn ? width : 1), turned_grad = act(turn ? width : 1);
    // The up projections' outputs and the keys' RoPE part, and their gradients.
    const std::int64_t q_n = mla ? T * s.H * s.D : 1, kv_n = mla ? T * s.H * (s.Dn + Dv) : 1,
                       rope_n = mla ? T * s.Dr : 1;
    DeviceBuffer q = act(q_n), kv = act(kv_n), k_rope = act(rope_n), dq = act(q_n), dkv = act(kv_n),
                 dk_rope = act(rope_n);
    const double f = median_time(k, repeats, [&] {
      if (mla) {
        k.mla_pack_forward(turned.get(), q.get(), kv.get(), k_rope.get(), s.B, s.S, s.H, s.Dn, s.Dr,
                           Dv, s.rope_theta);
      } else if (s.rope) {
        k.rope_forward(turned.get(), qkv.get(), s.B, s.S, s.H, s.G, s.D, s.rope_theta);
      }
      k.attention_forward(o.get(), p, turn ? turned.get() : qkv.get(), s.B, s.S, s.H, s.G, s.D,
                          nullptr, nullptr, nullptr, l, Dv);
    });
    const double bw = median_time(k, repeats, [&] {
      if (turn) {
        k.zero(turned_grad.get(), static_cast<std::size_t>(width) * e);
        k.attention_backward(turned_grad.get(), dout.get(), turned.get(), p, s.B, s.S, s.H, s.G,
                             s.D, 0.0f, nullptr, nullptr, l, nullptr, Dv);
        if (mla) {
          k.mla_pack_backward(dq.get(), dkv.get(), dk_rope.get(), turned_grad.get(), s.B, s.S, s.H,
                              s.Dn, s.Dr, Dv, s.rope_theta);
        } else {
          k.rope_backward(dqkv.get(), turned_grad.get(), s.B, s.S, s.H, s.G, s.D, s.rope_theta);
        }
      } else {
        k.attention_backward(dqkv.get(), dout.get(), qkv.get(), p, s.B, s.S, s.H, s.G, s.D, 0.0f,
                             nullptr, nullptr, l);
      }
    });
    out.ops.push_back({flash ? "flash_attention" : "attention", f, bw});
  }
  {  // the MLP's activation
    const std::int64_t rows = s.activation_rows > 0 ? s.activation_rows : T;
    const std::int64_t n_in = rows * s.F * (s.gelu ? 1 : 2), n_out = rows * s.F;
    DeviceBuffer in = act(n_in), dout = act(n_out), o = act(n_out), din = act(n_in);
    const int Ti = static_cast<int>(rows);
    const double f = median_time(k, repeats, [&] {
      if (s.gelu) {
        k.gelu_forward(o.get(), in.get(), n_in);
      } else {
        k.swiglu_forward(o.get(), in.get(), Ti, s.F);
      }
    });
    const double bw = median_time(k, repeats, [&] {
      if (s.gelu) {
        k.gelu_backward(din.get(), in.get(), dout.get(), n_in);
      } else {
        k.swiglu_backward(din.get(), in.get(), dout.get(), Ti, s.F);
      }
    });
    out.ops.push_back({s.gelu ? "gelu" : "swiglu", f, bw});
  }
  {  // a residual add; its backward passes the gradient to both inputs (copies: the runner's
     // first contribution to each)
    DeviceBuffer a = act(TC), b = act(TC), o = act(TC), dout = act(TC), da = act(TC), db = act(TC);
    const double f = median_time(k, repeats, [&] { k.add_forward(o.get(), a.get(), b.get(), TC); });
    const double bw = median_time(k, repeats, [&] {
      k.copy(da.get(), dout.get(), static_cast<std::size_t>(TC) * e);
      k.copy(db.get(), dout.get(), static_cast<std::size_t>(TC) * e);
    });
    out.ops.push_back({"residual", f, bw});
  }
  std::vector<int> host_tokens(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < T; ++t) host_tokens[static_cast<std::size_t>(t)] = (t * 7919) % s.V;
  DeviceBuffer tokens(static_cast<std::size_t>(T) * sizeof(int));
  k.upload_i32(tokens.i32(), host_tokens.data(), T);
  {  // the token (and learned position) embedding
    DeviceBuffer wte = f32(static_cast<std::int64_t>(s.V) * s.C, 0.04f);
    DeviceBuffer wpe = f32(s.learned_positions ? static_cast<std::int64_t>(s.S) * s.C : 1);
    DeviceBuffer o = act(TC), dout = act(TC);
    DeviceBuffer dwte = f32(static_cast<std::int64_t>(s.V) * s.C);
    DeviceBuffer dwpe = f32(s.learned_positions ? static_cast<std::int64_t>(s.S) * s.C : 1);
    const double f = median_time(k, repeats, [&] {
      k.embedding_forward(o.get(), tokens.i32(), wte.f32(), s.V,
                          s.learned_positions ? wpe.f32() : nullptr, s.B, s.S, s.C, 0);
    });
    const double bw = median_time(k, repeats, [&] {
      k.embedding_backward(dwte.f32(), s.V, s.learned_positions ? dwpe.f32() : nullptr, dout.get(),
                           tokens.i32(), s.B, s.S, s.C, 0);
    });
    out.ops.push_back({"embedding", f, bw});
  }
  {  // the loss: its statistics (no backward), then the loss from them, whose backward is the
     // runner's scaled add of the saved gradient to the logits'
    const std::int64_t n = T * s.V;
    const int rows_n = static_cast<int>(T);
    DeviceBuffer logits = act(n), dlogits = act(n), grad = act(n), rows = f32(T),
                 stats = f32(3 * T);
    const double statistics = median_time(k, repeats, [&] {
      k.cross_entropy_max(stats.f32(), logits.get(), rows_n, s.V);
      k.cross_entropy_sums(stats.f32() + T, logits.get(), stats.f32(), tokens.i32(), rows_n, s.V,
                           0);
    });
    out.ops.push_back({"loss_statistics", statistics, 0.0});
    const double f = median_time(k, repeats, [&] {
      k.cross_entropy_sharded(dlogits.get(), rows.f32(), logits.get(), stats.f32(), stats.f32() + T,
                              tokens.i32(), rows_n, s.V, 0);
    });
    const double bw =
        median_time(k, repeats, [&] { k.accumulate(grad.get(), dlogits.get(), n, 0.5f); });
    out.ops.push_back({"loss", f, bw});
  }
  {  // AdamW on fp32 masters
    const std::int64_t n = adamw_params;
    DeviceBuffer p = f32(n), g = f32(n, 0.01f), m = f32(n, 0.0f), v = f32(n, 0.0f);
    int t = 0;
    out.adamw_s = median_time(k, repeats, [&] {
      k.adamw(p.f32(), g.f32(), m.f32(), v.f32(), n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, ++t);
    });
    out.adamw_params = n;
  }
  return out;
}

std::vector<double> time_model_gemms(int gpu, GemmPrecision precision,
                                     const std::vector<ModelGemm>& gemms, int repeats) {
  const Dtype type = precision == GemmPrecision::Bf16 ? Dtype::BF16 : Dtype::F32;
  Kernels k(gpu, type);
  const std::size_t e = dtype_bytes(type);
  unsigned seed = 101;
  auto act = [&](std::int64_t n) {
    DeviceBuffer b(static_cast<std::size_t>(n) * e);
    k.fill_random(b.get(), n, seed++);
    return b;
  };
  std::vector<double> seconds;
  seconds.reserve(gemms.size());
  for (const ModelGemm& g : gemms) {
    const std::int64_t T = g.T, K = g.K, N = g.N;
    double s = 0;
    switch (g.pass) {
      case GemmPass::Forward: {
        DeviceBuffer in = act(T * K), w = act(K * N), out = act(T * N);
        s = median_time(k, repeats, [&] {
          k.matmul_forward(out.get(), in.get(), w.get(), nullptr, g.T, g.K, g.N);
        });
        break;
      }
      case GemmPass::InputGrad: {
        DeviceBuffer dout = act(T * N), w = act(K * N), din = act(T * K);
        s = median_time(k, repeats, [&] {
          k.matmul_input_grad(din.get(), dout.get(), w.get(), g.T, g.K, g.N);
        });
        break;
      }
      case GemmPass::WeightGrad: {
        DeviceBuffer dout = act(T * N), in = act(T * K);
        DeviceBuffer dw(static_cast<std::size_t>(K * N) * 4);
        k.fill_random_f32(dw.f32(), K * N, seed++, 0.01f);
        s = median_time(k, repeats, [&] {
          k.matmul_backward(nullptr, dw.f32(), nullptr, dout.get(), in.get(), nullptr, g.T, g.K,
                            g.N);
        });
        break;
      }
    }
    seconds.push_back(s);
  }
  return seconds;
}

}  // namespace dtsim::exec::cuda
