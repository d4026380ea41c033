// The GPU kernels against their CPU reference (exec/cpu/kernels, itself checked against finite
// differences): the same random inputs through both, in fp32 (the GPU's fp32 GEMMs run without
// TF32, so the two agree to rounding) and in bf16 activations (agreement to bf16's precision).
// Without a GPU each case says so and stops.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <numeric>
#include <optional>
#include <random>
#include <tuple>
#include <vector>

#include "exec/cpu/kernels.hpp"
#include "exec/cuda/gpu_probe.hpp"
#include "exec/cuda/kernels.hpp"

namespace {

namespace cu = dtsim::exec::cuda;
namespace cpu = dtsim::exec::cpu;
using Vec = std::vector<float>;

std::optional<int> first_gpu() {
  const auto p = cu::probe();
  if (p.gpus.empty()) {
    // Catch2 v2 has no SKIP: say why and stop (the machine has no GPU; not a failure).
    WARN("skipped: no GPU on this machine (" << p.why_none << ")");
    return std::nullopt;
  }
  return p.gpus.front().index;
}

Vec random(std::size_t n, unsigned seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  Vec v(n);
  for (auto& x : v) x = normal(gen);
  return v;
}

// The largest difference relative to the largest reference value: robust to entries near 0.
// A value that is not finite is an infinite error (std::max would skip a NaN).
double error(const Vec& got, const Vec& want) {
  REQUIRE(got.size() == want.size());
  double diff = 0, scale = 1e-12;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    diff = std::max(diff, static_cast<double>(std::fabs(got[i] - want[i])));
    scale = std::max(scale, static_cast<double>(std::fabs(want[i])));
  }
  return diff / scale;
}

// fp32 differs from the CPU by summation order only; bf16 keeps 8 bits of mantissa.
double tolerance(cu::Dtype t) {
  return t == cu::Dtype::F32 ? 2e-5 : 3e-2;
}

const char* name(cu::Dtype t) {
  return t == cu::Dtype::F32 ? "fp32" : "bf16";
}

// A device copy of a host vector: activation-typed, or fp32 (weights, statistics).
struct Dev {
  cu::Kernels& k;
  bool f32;
  std::int64_t n;
  cu::DeviceBuffer buf;
  Dev(cu::Kernels& kernels, const Vec& host, bool fp32 = false)
      : k(kernels),
        f32(fp32),
        n(static_cast<std::int64_t>(host.size())),
        buf(host.size() * (fp32 ? 4 : cu::dtype_bytes(kernels.activations()))) {
    if (f32) {
      k.upload_f32(buf.f32(), host.data(), n);
    } else {
      k.upload(buf.get(), host.data(), n);
    }
  }
  void* p() const { return buf.get(); }
  float* f() const { return buf.f32(); }
  Vec host() const {
    Vec h(static_cast<std::size_t>(n));
    if (f32) {
      k.download_f32(h.data(), buf.f32(), n);
    } else {
      k.download(h.data(), buf.get(), n);
    }
    return h;
  }
};

struct Ints {
  cu::DeviceBuffer buf;
  Ints(cu::Kernels& k, const std::vector<int>& host) : buf(host.size() * sizeof(int)) {
    k.upload_i32(buf.i32(), host.data(), static_cast<std::int64_t>(host.size()));
  }
  const int* p() const { return buf.i32(); }
};

// The reference value rounded as the GPU stores it (bf16 inputs), so that both sides start from
// the same numbers.
Vec as_stored(cu::Kernels& k, const Vec& v) {
  return Dev(k, v).host();
}

const cu::Dtype kTypes[] = {cu::Dtype::F32, cu::Dtype::BF16};

// Context parallelism's layout of a sequence over cp ranks of Sq tokens (each rank holds chunks r
// and 2·cp - 1 - r of 2·cp, Megatron-LM's load balance): rank 1's queries' positions qpos[Sq],
// and order[p], position p's key as an index r·Sq + s into the ranks' tokens.
struct CpLayout {
  std::vector<int> qpos, order;
};
CpLayout cp_layout(int cp, int Sq) {
  const int S = cp * Sq, chunk = S / (2 * cp);
  CpLayout l{std::vector<int>(static_cast<std::size_t>(Sq)),
             std::vector<int>(static_cast<std::size_t>(S))};
  for (int p = 0; p < S; ++p) {
    const int c = p / chunk, owner = c < cp ? c : 2 * cp - 1 - c;
    const int s = (c < cp ? 0 : chunk) + p % chunk;
    l.order[static_cast<std::size_t>(p)] = owner * Sq + s;
    if (owner == 1) l.qpos[static_cast<std::size_t>(s)] = p;
  }
  return l;
}

}  // namespace

TEST_CASE("GPU matmul forward and backward match the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int K = 40, N = 56;
  // 200 rows: the bias gradient sums its rows in chunks (7 of 29 rows, the last shorter).
  for (auto [type, T] : {std::pair{cu::Dtype::F32, 24}, std::pair{cu::Dtype::BF16, 24},
                         std::pair{cu::Dtype::F32, 200}, std::pair{cu::Dtype::BF16, 200}}) {
    INFO(name(type) << ", " << T << " rows");
    cu::Kernels k(*gpu, type);
    const Vec in = as_stored(k, random(T * K, 1)), w = as_stored(k, random(K * N, 2, 0.2f));
    const Vec bias = random(N, 3), dout = as_stored(k, random(T * N, 4));
    const Vec din0 = as_stored(k, random(T * K, 5)), dw0 = random(K * N, 6), db0 = random(N, 7);
    Vec out(T * N), din = din0, dw = dw0, db = db0;
    cpu::matmul_forward(out, in, w, bias, T, K, N);
    cpu::matmul_backward(din, dw, db, dout, in, w, T, K, N);

    Dev d_in(k, in), d_w(k, w), d_bias(k, bias, true), d_out(k, Vec(T * N)), d_dout(k, dout);
    Dev d_din(k, din0), d_dw(k, dw0, true), d_db(k, db0, true);
    k.matmul_forward(d_out.p(), d_in.p(), d_w.p(), d_bias.f(), T, K, N);
    k.matmul_backward(d_din.p(), d_dw.f(), d_db.f(), d_dout.p(), d_in.p(), d_w.p(), T, K, N);
    CHECK(error(d_out.host(), out) < tolerance(type));
    CHECK(error(d_din.host(), din) < tolerance(type));
    CHECK(error(d_dw.host(), dw) < tolerance(type));
    CHECK(error(d_db.host(), db) < tolerance(type));
  }
}

TEST_CASE("GPU matmul with a transposed weight (a tied head) matches the CPU",
          "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int T = 24, K = 40, N = 56;
  for (cu::Dtype type : kTypes) {
    INFO(name(type));
    cu::Kernels k(*gpu, type);
    const Vec in = as_stored(k, random(T * K, 91)), wt = as_stored(k, random(N * K, 92, 0.2f));
    const Vec dout = as_stored(k, random(T * N, 93)), din0 = as_stored(k, random(T * K, 94));
    const Vec dw0 = random(N * K, 95);
    Vec out(T * N), din = din0, dw = dw0;
    cpu::matmul_forward(out, in, wt, {}, T, K, N, true);
    cpu::matmul_backward(din, dw, {}, dout, in, wt, T, K, N, true);
    Dev d_in(k, in), d_w(k, wt), d_out(k, Vec(T * N)), d_dout(k, dout), d_din(k, din0),
        d_dw(k, dw0, true);
    k.matmul_forward(d_out.p(), d_in.p(), d_w.p(), nullptr, T, K, N, true);
    k.matmul_backward(d_din.p(), d_dw.f(), nullptr, d_dout.p(), d_in.p(), d_w.p(), T, K, N, true);
    CHECK(error(d_out.host(), out) < tolerance(type));
    CHECK(error(d_din.host(), din) < tolerance(type));
    CHECK(error(d_dw.host(), dw) < tolerance(type));
  }
}

// A gradient's first contribution: the input gradient written whole over what the buffer held
// (random values here, NaN under dtexec's poison), as the CPU's.
TEST_CASE("GPU matmul input gradient written whole matches the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int T = 24, K = 40, N = 56;
  for (cu::Dtype type : kTypes) {
    for (const bool transposed : {false, true}) {
      INFO(name(type) << (transposed ? ", w transposed" : ""));
      cu::Kernels k(*gpu, type);
      const Vec w = as_stored(k, random(K * N, 96, 0.2f)), dout = as_stored(k, random(T * N, 97));
      Vec din(T * K);
      cpu::matmul_input_grad(din, dout, w, T, K, N, transposed);
      Dev d_w(k, w), d_dout(k, dout), d_din(k, as_stored(k, random(T * K, 98)));
      k.matmul_input_grad(d_din.p(), d_dout.p(), d_w.p(), T, K, N, transposed);
      CHECK(error(d_din.host(), din) < tolerance(type));
    }
  }
}

TEST_CASE("GPU LayerNorm and RMSNorm match the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int C = 300;  // more columns than threads per block
  // 97 rows: the weight gradients sum their rows in chunks (3 of 25 and one of 22).
  for (int T : {16, 97}) {
    for (cu::Dtype type : kTypes) {
      for (bool rms : {false, true}) {
        INFO(name(type) << (rms ? " RMSNorm" : " LayerNorm") << ", " << T << " rows");
        cu::Kernels k(*gpu, type);
        const Vec in = as_stored(k, random(T * C, 11, 2.0f)), w = random(C, 12),
                  b = rms ? Vec() : random(C, 13);
        const Vec dout = as_stored(k, random(T * C, 14)), din0 = as_stored(k, random(T * C, 15));
        Vec out(T * C), mean(T), rstd(T), din = din0, dw(C, 0.5f), db(C, -0.5f);
        cpu::norm_forward(out, mean, rstd, in, w, b, T, C, rms);
        cpu::norm_backward(din, dw, rms ? cpu::Out() : cpu::Out(db), dout, in, w, mean, rstd, T, C,
                           rms);

        Dev d_in(k, in), d_w(k, w, true), d_out(k, Vec(T * C)), d_mean(k, Vec(T), true),
            d_rstd(k, Vec(T), true), d_dout(k, dout), d_din(k, din0), d_dw(k, Vec(C, 0.5f), true),
            d_db(k, Vec(C, -0.5f), true);
        std::optional<Dev> d_b;
        if (!rms) d_b.emplace(k, b, true);
        k.norm_forward(d_out.p(), d_mean.f(), d_rstd.f(), d_in.p(), d_w.f(),
                       rms ? nullptr : d_b->f(), T, C, rms);
        k.norm_backward(d_din.p(), d_dw.f(), rms ? nullptr : d_db.f(), d_dout.p(), d_in.p(),
                        d_w.f(), d_mean.f(), d_rstd.f(), T, C, rms);
        CHECK(error(d_out.host(), out) < tolerance(type));
        CHECK(error(d_rstd.host(), rstd) < tolerance(type));
        CHECK(error(d_din.host(), din) < tolerance(type));
        CHECK(error(d_dw.host(), dw) < tolerance(type));
        if (!rms) CHECK(error(d_db.host(), db) < tolerance(type));
      }
    }
  }
}

TEST_CASE("GPU element-wise ops match the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int T = 12, F = 70;
  const std::int64_t n = T * 2 * F;
  for (cu::Dtype type : kTypes) {
    INFO(name(type));
    cu::Kernels k(*gpu, type);
    const Vec a = as_stored(k, random(n, 21)), b = as_stored(k, random(n, 22));
    const Vec d0 = as_stored(k, random(n, 23));
    Vec sum(n), acc = d0, gelu(n), dgelu = d0, swiglu(T * F), dswiglu = d0;
    cpu::add_forward(sum, a, b);
    cpu::accumulate(acc, b);
    cpu::gelu_forward(gelu, a, n);
    cpu::gelu_backward(dgelu, a, b, n);
    const Vec dsw = as_stored(k, random(T * F, 24));
    cpu::swiglu_forward(swiglu, a, T, F);
    cpu::swiglu_backward(dswiglu, a, dsw, T, F);

    Dev d_a(k, a), d_b(k, b), d_sum(k, Vec(n)), d_acc(k, d0), d_gelu(k, Vec(n)), d_dgelu(k, d0),
        d_sw(k, Vec(T * F)), d_dsw(k, dsw), d_dswiglu(k, d0), d_scaled(k, d0);
    k.add_forward(d_sum.p(), d_a.p(), d_b.p(), n);
    k.accumulate(d_acc.p(), d_b.p(), n);
    k.accumulate(d_scaled.p(), d_b.p(), n, 0.25f);
    k.gelu_forward(d_gelu.p(), d_a.p(), n);
    k.gelu_backward(d_dgelu.p(), d_a.p(), d_b.p(), n);
    k.swiglu_forward(d_sw.p(), d_a.p(), T, F);
    k.swiglu_backward(d_dswiglu.p(), d_a.p(), d_dsw.p(), T, F);
    Vec scaled = d0;
    for (std::size_t i = 0; i < scaled.size(); ++i) scaled[i] += 0.25f * b[i];
    CHECK(error(d_sum.host(), sum) < tolerance(type));
    CHECK(error(d_acc.host(), acc) < tolerance(type));
    CHECK(error(d_scaled.host(), scaled) < tolerance(type));
    CHECK(error(d_gelu.host(), gelu) < tolerance(type));
    CHECK(error(d_dgelu.host(), dgelu) < tolerance(type));
    CHECK(error(d_sw.host(), swiglu) < tolerance(type));
    CHECK(error(d_dswiglu.host(), dswiglu) < tolerance(type));
  }
}

TEST_CASE("GPU causal attention matches the CPU, with and without grouped KV heads",
          "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int B = 2, D = 16;
  for (cu::Dtype type : kTypes) {
    // S = 300: rows longer than a block's threads (the softmax loops more than once). The GEMMs
    // batch one head of every kv group where the groups are no larger than their count (4 of
    // 4, 4 of 2), else a kv group's heads (4 of 1, 8 of 2: several kv heads).
    for (auto [S, H, G] : {std::tuple{20, 4, 4}, std::tuple{20, 4, 2}, std::tuple{20, 4, 1},
                           std::tuple{300, 4, 2}, std::tuple{20, 8, 2}}) {
      INFO(name(type) << " sequence " << S << ", heads " << H << ", kv heads " << G);
      cu::Kernels k(*gpu, type);
      const int width = (H + 2 * G) * D;
      const Vec qkv = as_stored(k, random(B * S * width, 31, 0.5f));
      const Vec dout = as_stored(k, random(B * S * H * D, 32));
      const Vec dqkv0 = as_stored(k, random(B * S * width, 33));
      Vec out(B * S * H * D), probs(B * H * S * S), dqkv = dqkv0;
      cpu::attention_forward(out, probs, qkv, B, S, H, G, D);
      cpu::attention_backward(dqkv, dout, qkv, probs, B, S, H, G, D);

      Dev d_qkv(k, qkv), d_out(k, Vec(out.size())), d_probs(k, Vec(probs.size())), d_dout(k, dout),
          d_dqkv(k, dqkv0);
      k.attention_forward(d_out.p(), d_probs.p(), d_qkv.p(), B, S, H, G, D);
      k.attention_backward(d_dqkv.p(), d_dout.p(), d_qkv.p(), d_probs.p(), B, S, H, G, D);
      CHECK(error(d_probs.host(), probs) < tolerance(type));
      CHECK(error(d_out.host(), out) < tolerance(type));
      CHECK(error(d_dqkv.host(), dqkv) < tolerance(type));

      // FlashAttention's memory: the CPU's log-sum-exp per row, the same output and gradients
      // (the probabilities made again in the backward).
      Vec lse(static_cast<std::size_t>(B) * H * S), flash_out(out.size());
      cpu::AttentionOptions f;
      f.lse = lse;
      cpu::attention_forward(flash_out, {}, qkv, B, S, H, G, D, f);
      Dev f_lse(k, Vec(lse.size()), true), f_out(k, Vec(out.size())), f_dqkv(k, dqkv0);
      k.attention_forward(f_out.p(), nullptr, d_qkv.p(), B, S, H, G, D, nullptr, nullptr, nullptr,
                          f_lse.f());
      k.attention_backward(f_dqkv.p(), d_dout.p(), d_qkv.p(), nullptr, B, S, H, G, D, 0.0f, nullptr,
                           nullptr, f_lse.f());
      CHECK(error(f_lse.host(), lse) < tolerance(type));
      CHECK(error(f_out.host(), out) < tolerance(type));
      CHECK(error(f_dqkv.host(), dqkv) < tolerance(type));
    }
  }
}

// The GPU draws the CPU's dropout masks (the same counter hash), bit for bit; the values then
// agree to the type's rounding.
TEST_CASE("GPU dropout, residual and attention, matches the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  cpu::Dropout d;
  d.stream = 0x1234567;
  d.rate = 0.1f;
  d.first_sequence = 6;
  d.Sq = 24;
  d.first_row = 12;  // a share of the rows (sequence parallelism)
  d.head_offset = 4;
  cu::Kernels::DropoutSite site{d.stream,    d.rate, d.first_sequence,
                                d.first_row, d.Sq,   d.head_offset};
  auto bytes_of = [](cu::Kernels& k, const cu::DeviceBuffer& b, std::size_t n) {
    std::vector<std::uint8_t> h(n);
    k.download_bytes(h.data(), b.get(), n);
    return h;
  };
  for (cu::Dtype type : kTypes) {
    INFO(name(type));
    cu::Kernels k(*gpu, type);
    // Residual stream rows [T, C]: dropout_add forward, dropout backward.
    const int T = 20, C = 48;
    const auto n = static_cast<std::size_t>(T) * C;
    const Vec branch = as_stored(k, random(n, 41)), skip = as_stored(k, random(n, 42));
    const Vec dout = as_stored(k, random(n, 43)), din0 = as_stored(k, random(n, 44));
    Vec out(n), din = din0;
    std::vector<std::uint8_t> mask(n);
    cpu::dropout_add_forward(out, mask, branch, skip, d, T, C);
    cpu::dropout_backward(din, mask, dout, d.rate);
    Dev d_branch(k, branch), d_skip(k, skip), d_out(k, Vec(n)), d_dout(k, dout), d_din(k, din0);
    cu::DeviceBuffer d_mask(n);
    k.dropout_forward(d_out.p(), static_cast<std::uint8_t*>(d_mask.get()), d_branch.p(), d_skip.p(),
                      site, T, C);
    k.dropout_backward(d_din.p(), static_cast<std::uint8_t*>(d_mask.get()), d_dout.p(), d.rate,
                       static_cast<std::int64_t>(n));
    CHECK(bytes_of(k, d_mask, n) == mask);
    CHECK(error(d_out.host(), out) < tolerance(type));
    CHECK(error(d_din.host(), din) < tolerance(type));

    // Attention dropout of the probabilities, forward and backward.
    const int B = 2, S = 20, H = 4, G = 2, D = 16, width = (H + 2 * G) * D;
    const auto scores = static_cast<std::size_t>(B) * H * S * S;
    const Vec qkv = as_stored(k, random(static_cast<std::size_t>(B) * S * width, 45, 0.5f));
    const Vec ady = as_stored(k, random(static_cast<std::size_t>(B) * S * H * D, 46));
    Vec aout(static_cast<std::size_t>(B) * S * H * D), probs(scores), dropped(scores);
    Vec dqkv(qkv.size(), 0.0f);
    std::vector<std::uint8_t> amask(scores);
    cpu::AttentionOptions o;
    o.dropout = &d;
    o.mask = amask;
    o.dropped = dropped;
    cpu::attention_forward(aout, probs, qkv, B, S, H, G, D, o);
    cpu::attention_backward(dqkv, dqkv, ady, qkv, probs, B, S, H, G, D, o);
    Dev a_qkv(k, qkv), a_out(k, Vec(aout.size())), a_probs(k, Vec(scores)),
        a_dropped(k, Vec(scores)), a_dy(k, ady), a_dqkv(k, Vec(qkv.size(), 0.0f));
    cu::DeviceBuffer a_mask(scores);
    auto* m = static_cast<std::uint8_t*>(a_mask.get());
    k.attention_forward(a_out.p(), a_probs.p(), a_qkv.p(), B, S, H, G, D, &site, m, a_dropped.p());
    k.attention_backward(a_dqkv.p(), a_dy.p(), a_qkv.p(), a_probs.p(), B, S, H, G, D, d.rate, m,
                         a_dropped.p());
    CHECK(bytes_of(k, a_mask, scores) == amask);
    CHECK(error(a_dropped.host(), dropped) < tolerance(type));
    CHECK(error(a_out.host(), aout) < tolerance(type));
    CHECK(error(a_dqkv.host(), dqkv) < tolerance(type));

    // FlashAttention's memory with dropout (tensor-parallel rank 1's heads): the masks drawn
    // again in the backward give the same gradients. A flash forward of other data between the
    // passes: the backward must make its own probabilities, not find the forward's.
    Vec lse(static_cast<std::size_t>(B) * H * S), flash_out(aout.size());
    cpu::AttentionOptions f;
    f.dropout = &d;
    f.lse = lse;
    cpu::attention_forward(flash_out, {}, qkv, B, S, H, G, D, f);
    Dev f_lse(k, Vec(lse.size()), true), f_out(k, Vec(aout.size())),
        f_dqkv(k, Vec(qkv.size(), 0.0f));
    k.attention_forward(f_out.p(), nullptr, a_qkv.p(), B, S, H, G, D, &site, nullptr, nullptr,
                        f_lse.f());
    const Vec other = as_stored(k, random(qkv.size(), 47, 0.5f));
    Dev o_qkv(k, other), o_out(k, Vec(aout.size())), o_lse(k, Vec(lse.size()), true);
    k.attention_forward(o_out.p(), nullptr, o_qkv.p(), B, S, H, G, D, &site, nullptr, nullptr,
                        o_lse.f());
    k.attention_backward(f_dqkv.p(), a_dy.p(), a_qkv.p(), nullptr, B, S, H, G, D, d.rate, nullptr,
                         nullptr, f_lse.f(), &site);
    CHECK(error(f_lse.host(), lse) < tolerance(type));
    CHECK(error(f_out.host(), aout) < tolerance(type));
    CHECK(error(f_dqkv.host(), dqkv) < tolerance(type));
  }
}

// The GPU routes every token as the CPU does (the same top-k, ties and stable order), and its
// dispatch, combine and their backwards agree to the type's rounding. 16 experts take a
// counting block of 736 threads, 372 (most of them empty here) the last that fits, one warp.
TEST_CASE("GPU mixture-of-experts routing, dispatch and combine match the CPU",
          "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int T = 40, k = 2, C = 24;
  const auto slots = static_cast<std::size_t>(T) * k;
  // (Gates over the top k's softmax, or over all experts' without renormalizing; the chosen
  // logits' sigmoids, normalized over the k and scaled, or neither.)
  for (const auto& [E, type, normalize, sigmoid] :
       {std::tuple{6, cu::Dtype::F32, true, false}, std::tuple{6, cu::Dtype::BF16, false, false},
        std::tuple{16, cu::Dtype::BF16, true, false}, std::tuple{372, cu::Dtype::F32, false, false},
        std::tuple{6, cu::Dtype::BF16, true, true}, std::tuple{16, cu::Dtype::F32, false, true},
        std::tuple{16, cu::Dtype::F32, true, false}}) {
    INFO(name(type) << ", " << E << " experts" << (normalize ? "" : ", gates over all")
                    << (sigmoid ? ", sigmoids" : ""));
    dtsim::exec::Gating gating;
    gating.normalize = normalize;
    gating.sigmoid = sigmoid;
    // (Scaled: sigmoids over the k, and the softmax over the k at 16 experts in fp32.)
    gating.scale = (sigmoid && normalize) || (E == 16 && type == cu::Dtype::F32) ? 2.5f : 1.0f;
    cu::Kernels k_(*gpu, type);
    auto ints_of = [&](const cu::DeviceBuffer& b, std::size_t n) {
      std::vector<int> h(n);
      k_.download_bytes(h.data(), b.get(), n * sizeof(int));
      return h;
    };
    // Ties, common in bf16 logits: the lower expert wins (the CPU's order). Row 0: two equal
    // maxima; row 1: the second and third equal; row 2: all equal.
    Vec tied = random(static_cast<std::size_t>(T) * E, 51);
    for (int e = 0; e < E; ++e) {
      tied[static_cast<std::size_t>(e)] = e == 1 || e == 4 ? 1.5f : -0.5f;
      tied[static_cast<std::size_t>(E + e)] = e == 0 ? 2.0f : e == 2 || e == 5 ? 1.0f : 0.25f;
      tied[static_cast<std::size_t>(2 * E + e)] = 0.75f;
    }
    const Vec logits = as_stored(k_, tied);
    const Vec x = as_stored(k_, random(static_cast<std::size_t>(T) * C, 52));
    // CPU: route, dispatch, combine (y: the experts' outputs, here random), and backwards.
    std::vector<int> experts(slots), order(slots), rows(static_cast<std::size_t>(E));
    Vec gates(slots), dispatched(slots * C);
    cpu::moe_route(experts, gates, logits, T, E, k, gating);
    CHECK(std::vector<int>(experts.begin(), experts.begin() + 6) ==
          std::vector<int>{1, 4, 0, 2, 0, 1});  // the planted ties, as the CPU breaks them
    cpu::moe_dispatch(dispatched, order, rows, x, experts, T, C, k, E);
    const Vec y = as_stored(k_, random(slots * C, 53));
    const Vec dout = as_stored(k_, random(static_cast<std::size_t>(T) * C, 54));
    Vec out(static_cast<std::size_t>(T) * C), dy = random(slots * C, 57), dgates(slots, 0.0f);
    cpu::moe_combine(out, y, gates, order, T, C, k);
    cpu::moe_combine_backward(dy, dgates, dout, y, gates, order, T, C, k);
    // The dispatch's backward adds into dx (the router's input gradient is there first), the
    // combine writes out whole and its backward dy: dx starts from the same values on both,
    // out and dy from others.
    const Vec dx0 = as_stored(k_, random(static_cast<std::size_t>(T) * C, 55));
    Vec dx = dx0;
    Vec dlogits(static_cast<std::size_t>(T) * E, 0.0f);
    cpu::moe_dispatch_backward(dx, dy, order, T, C, k);
    cpu::moe_route_backward(dlogits, dgates, gates, experts,
                            gating.reads_logits() ? cpu::In(logits) : cpu::In{}, T, E, k, gating);

    Dev d_logits(k_, logits), d_x(k_, x), d_y(k_, y), d_dout(k_, dout);
    Dev d_gates(k_, Vec(slots), true), d_rows(k_, Vec(static_cast<std::size_t>(E)), true);
    Dev d_dispatched(k_, Vec(slots * C)), d_out(k_, as_stored(k_, random(out.size(), 56))),
        d_dy(k_, as_stored(k_, random(slots * C, 58)));
    Dev d_dgates(k_, Vec(slots, 0.0f), true), d_dx(k_, dx0);
    Dev d_dlogits(k_, Vec(dlogits.size(), 0.0f));
    cu::DeviceBuffer d_experts(slots * sizeof(int)), d_order(slots * sizeof(int));
    k_.moe_route(d_experts.i32(), d_gates.f(), d_logits.p(), T, E, k, gating);
    k_.moe_dispatch(d_dispatched.p(), d_order.i32(), d_rows.f(), d_x.p(), d_experts.i32(), T, C, k,
                    E);
    k_.moe_combine(d_out.p(), d_y.p(), d_gates.f(), d_order.i32(), T, C, k);
    k_.moe_combine_backward(d_dy.p(), d_dgates.f(), d_dout.p(), d_y.p(), d_gates.f(), d_order.i32(),
                            T, C, k);
    k_.moe_dispatch_backward(d_dx.p(), d_dy.p(), d_order.i32(), T, C, k);
    k_.moe_route_backward(d_dlogits.p(), d_dgates.f(), d_gates.f(), d_experts.i32(),
                          gating.reads_logits() ? d_logits.p() : nullptr, T, E, k, gating);
    CHECK(ints_of(d_experts, slots) == experts);
    CHECK(ints_of(d_order, slots) == order);
    const Vec got_rows = d_rows.host();
    for (int e = 0; e < E; ++e)
      CHECK(got_rows[static_cast<std::size_t>(e)] == rows[static_cast<std::size_t>(e)]);
    CHECK(error(d_gates.host(), gates) < 1e-6);
    CHECK(error(d_dispatched.host(), dispatched) == 0);
    CHECK(error(d_out.host(), out) < tolerance(type));
    CHECK(error(d_dy.host(), dy) < tolerance(type));
    CHECK(error(d_dgates.host(), dgates) < tolerance(type));
    CHECK(error(d_dx.host(), dx) < tolerance(type));
    CHECK(error(d_dlogits.host(), dlogits) < tolerance(type));
  }
}

// Context parallelism: rank 1 of cp 2 (Megatron-LM's load balancing: chunks 1 and 2 of 4),
// its queries against every rank's keys, with and without attention dropout; and the ops that
// read positions (rotary, learned positions and their gradient, residual dropout) and the
// column copies of the KV exchange. Both head batchings of the attention GEMMs
// (kernels_attention.cu, head_batches: several query heads per kv head; Llama-3 70B's tp-8 shard, 8
// query heads on one kv head), and rows longer than a block of the softmax kernels (S = 320).
TEST_CASE("GPU attention with context parallelism matches the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  for (const auto& [H, G, Sq] : {std::tuple{4, 2, 8}, std::tuple{8, 1, 160}}) {
    const int cp = 2, B = 2, S = cp * Sq, D = 16;
    const int width = (H + 2 * G) * D, kv_width = 2 * G * D;
    const CpLayout layout = cp_layout(cp, Sq);
    const std::vector<int>&qpos = layout.qpos, &order = layout.order;
    cpu::Dropout d;
    d.stream = 77;
    d.rate = 0.1f;
    d.first_sequence = 2;
    d.Sq = Sq;
    d.positions = qpos;
    for (cu::Dtype type : kTypes) {
      for (const bool drop : {false, true}) {
        INFO(name(type) << ", " << H << " heads on " << G << " kv heads, " << Sq << " rows"
                        << (drop ? ", with dropout" : ""));
        cu::Kernels k(*gpu, type);
        const auto scores = static_cast<std::size_t>(B) * H * Sq * S;
        const Vec qkv = as_stored(k, random(static_cast<std::size_t>(B) * Sq * width, 61, 0.5f));
        const Vec kv =
            as_stored(k, random(static_cast<std::size_t>(cp) * B * Sq * kv_width, 62, 0.5f));
        const Vec dout = as_stored(k, random(static_cast<std::size_t>(B) * Sq * H * D, 63));
        Vec out(static_cast<std::size_t>(B) * Sq * H * D), probs(scores), dropped(scores);
        Vec dqkv(qkv.size(), 0.0f), dkv(kv.size(), 0.0f);
        std::vector<std::uint8_t> mask(scores);
        cpu::AttentionOptions o;
        o.kv = kv;
        o.cp = cp;
        o.qpos = qpos;
        o.order = order;
        if (drop) {
          o.dropout = &d;
          o.mask = mask;
          o.dropped = dropped;
        }
        cpu::attention_forward(out, probs, qkv, B, Sq, H, G, D, o);
        cpu::attention_backward(dqkv, dkv, dout, qkv, probs, B, Sq, H, G, D, o);

        Dev g_qkv(k, qkv), g_kv(k, kv), g_out(k, Vec(out.size())), g_probs(k, Vec(scores)),
            g_dropped(k, Vec(scores)), g_dout(k, dout), g_dqkv(k, Vec(qkv.size(), 0.0f)),
            g_dkv(k, Vec(kv.size(), 0.0f));
        Ints g_qpos(k, qpos), g_order(k, order);
        cu::DeviceBuffer g_mask(scores);
        cu::Kernels::DropoutSite site{d.stream, d.rate, d.first_sequence, 0, Sq, 0, g_qpos.p()};
        auto* m = drop ? static_cast<std::uint8_t*>(g_mask.get()) : nullptr;
        k.attention_forward_cp(g_out.p(), g_probs.p(), g_qkv.p(), g_kv.p(), g_qpos.p(), g_order.p(),
                               cp, B, Sq, H, G, D, drop ? &site : nullptr, m,
                               drop ? g_dropped.p() : nullptr);
        k.attention_backward_cp(g_dqkv.p(), g_dkv.p(), g_dout.p(), g_qkv.p(), g_kv.p(), g_probs.p(),
                                g_qpos.p(), g_order.p(), cp, B, Sq, H, G, D, drop ? d.rate : 0.0f,
                                m, drop ? g_dropped.p() : nullptr);
        if (drop) {
          std::vector<std::uint8_t> got(scores);
          k.download_bytes(got.data(), g_mask.get(), scores);
          CHECK(got == mask);
        }
        CHECK(error(g_probs.host(), probs) < tolerance(type));
        CHECK(error(g_out.host(), out) < tolerance(type));
        CHECK(error(g_dqkv.host(), dqkv) < tolerance(type));
        CHECK(error(g_dkv.host(), dkv) < tolerance(type));

        // FlashAttention's memory: the CPU's log-sum-exp per row, the same output and
        // gradients, the probabilities and dropout's masks made again in the backward.
        Vec lse(static_cast<std::size_t>(B) * H * Sq), flash_out(out.size());
        cpu::AttentionOptions f = o;
        f.mask = {};
        f.dropped = {};
        f.lse = lse;
        cpu::attention_forward(flash_out, {}, qkv, B, Sq, H, G, D, f);
        Dev f_lse(k, Vec(lse.size()), true), f_out(k, Vec(out.size())),
            f_dqkv(k, Vec(qkv.size(), 0.0f)), f_dkv(k, Vec(kv.size(), 0.0f));
        k.attention_forward_cp(f_out.p(), nullptr, g_qkv.p(), g_kv.p(), g_qpos.p(), g_order.p(), cp,
                               B, Sq, H, G, D, drop ? &site : nullptr, nullptr, nullptr, f_lse.f());
        k.attention_backward_cp(f_dqkv.p(), f_dkv.p(), g_dout.p(), g_qkv.p(), g_kv.p(), nullptr,
                                g_qpos.p(), g_order.p(), cp, B, Sq, H, G, D, drop ? d.rate : 0.0f,
                                nullptr, nullptr, f_lse.f(), drop ? &site : nullptr);
        CHECK(error(f_lse.host(), lse) < tolerance(type));
        CHECK(error(f_out.host(), out) < tolerance(type));
        CHECK(error(f_dqkv.host(), dqkv) < tolerance(type));
        CHECK(error(f_dkv.host(), dkv) < tolerance(type));
      }
      // Rotary positions and learned positions at the rank's positions; the KV columns.
      INFO(name(type) << ": rotary, positions, columns");
      cu::Kernels k(*gpu, type);
      const Vec x = as_stored(k, random(static_cast<std::size_t>(B) * Sq * width, 64));
      Vec rot(x.size()), back(x.size(), 0.0f);
      cpu::rope_forward(rot, x, B, Sq, H, G, D, 10000.0, qpos);
      cpu::rope_backward(back, x, B, Sq, H, G, D, 10000.0, qpos);
      Ints g_qpos(k, qpos);
      Dev g_x(k, x), g_rot(k, Vec(x.size())), g_back(k, Vec(x.size(), 0.0f));
      k.rope_forward(g_rot.p(), g_x.p(), B, Sq, H, G, D, 10000.0, g_qpos.p());
      k.rope_backward(g_back.p(), g_x.p(), B, Sq, H, G, D, 10000.0, g_qpos.p());
      CHECK(error(g_rot.host(), rot) < tolerance(type));
      CHECK(error(g_back.host(), back) < tolerance(type));
      Vec cols(static_cast<std::size_t>(B) * Sq * kv_width), added = x;
      cpu::copy_columns(cols, x, B * Sq, width, H * D, kv_width);
      cpu::add_columns(added, cols, B * Sq, width, H * D, kv_width);
      Dev g_cols(k, Vec(cols.size())), g_added(k, x);
      k.copy_columns(g_cols.p(), g_x.p(), B * Sq, width, H * D, kv_width);
      k.add_columns(g_added.p(), g_cols.p(), B * Sq, width, H * D, kv_width);
      CHECK(error(g_cols.host(), cols) == 0);
      CHECK(error(g_added.host(), added) < tolerance(type));

      // Residual dropout at the rank's positions, its rows across a sequence's end (a row's mask
      // index is its position's, not its row's).
      {
        cpu::Dropout rd = d;
        rd.first_row = Sq - 4;
        const int T = 12, C = 24;
        const auto n = static_cast<std::size_t>(T) * C;
        const Vec branch = as_stored(k, random(n, 65)), skip = as_stored(k, random(n, 66));
        Vec rout(n);
        std::vector<std::uint8_t> rmask(n);
        cpu::dropout_add_forward(rout, rmask, branch, skip, rd, T, C);
        Dev g_branch(k, branch), g_skip(k, skip), g_rout(k, Vec(n));
        cu::DeviceBuffer g_rmask(n);
        const cu::Kernels::DropoutSite rsite{rd.stream, rd.rate, rd.first_sequence, rd.first_row,
                                             Sq,        0,       g_qpos.p()};
        k.dropout_forward(g_rout.p(), static_cast<std::uint8_t*>(g_rmask.get()), g_branch.p(),
                          g_skip.p(), rsite, T, C);
        std::vector<std::uint8_t> got(n);
        k.download_bytes(got.data(), g_rmask.get(), n);
        CHECK(got == rmask);
        CHECK(error(g_rout.host(), rout) < tolerance(type));
      }
      // Learned positions at the rank's positions (wpe has all S), and their gradient.
      {
        const int V = 40, C = 24;
        std::vector<int> tokens(static_cast<std::size_t>(B) * Sq);
        for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int>((i * 7) % V);
        const Vec wte = random(static_cast<std::size_t>(V) * C, 67);
        const Vec wpe = random(static_cast<std::size_t>(S) * C, 68);
        const Vec edout = as_stored(k, random(static_cast<std::size_t>(B) * Sq * C, 69));
        Vec eout(static_cast<std::size_t>(B) * Sq * C), dwte(wte.size(), 0.0f),
            dwpe(wpe.size(), 0.0f);
        cpu::embedding_forward(eout, tokens, wte, wpe, B, Sq, C, 0, qpos);
        cpu::embedding_backward(dwte, dwpe, edout, tokens, B, Sq, C, 0, qpos);
        Dev g_wte(k, wte, true), g_wpe(k, wpe, true), g_eout(k, Vec(eout.size())),
            g_edout(k, edout), g_dwte(k, Vec(wte.size(), 0.0f), true),
            g_dwpe(k, Vec(wpe.size(), 0.0f), true);
        Ints g_tokens(k, tokens);
        k.embedding_forward(g_eout.p(), g_tokens.p(), g_wte.f(), V, g_wpe.f(), B, Sq, C, 0,
                            g_qpos.p());
        k.embedding_backward(g_dwte.f(), V, g_dwpe.f(), g_edout.p(), g_tokens.p(), B, Sq, C, 0,
                             g_qpos.p());
        CHECK(error(g_eout.host(), eout) < tolerance(type));
        CHECK(error(g_dwte.host(), dwte) < tolerance(type));
        CHECK(error(g_dwpe.host(), dwpe) < tolerance(type));
      }
    }
  }
}

// Multi-head latent attention: the packing of the queries, the keys' and values' up projection
// and the keys' RoPE part (at a cp rank's positions, and without the queries as cp's gather packs
// them), then the core with values narrower and wider than the keys, unfused, with
// FlashAttention's memory and with context parallelism's gathered keys.
TEST_CASE("GPU multi-head latent attention matches the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int B = 2, S = 24, H = 4, Dn = 8, Dr = 4, D = Dn + Dr;
  const double theta = 10000.0;
  // Positions as a cp rank's (rank 1 of 2: its chunks 1 and 2 of 4).
  std::vector<int> positions(static_cast<std::size_t>(S));
  for (int s = 0; s < S; ++s)
    positions[static_cast<std::size_t>(s)] = s < S / 2 ? S / 2 + s : S + s;
  for (cu::Dtype type : kTypes) {
    for (const int Dv : {6, 16}) {
      INFO(name(type) << ", values " << Dv << " wide, keys " << D);
      cu::Kernels k(*gpu, type);
      const auto T = static_cast<std::size_t>(B) * S;
      const std::size_t width = T * (2 * H * D + H * Dv), kv_n = T * H * (Dn + Dv);
      const Vec q = as_stored(k, random(T * H * D, 81, 0.5f));
      const Vec kv = as_stored(k, random(kv_n, 82, 0.5f));
      const Vec k_rope = as_stored(k, random(T * Dr, 83, 0.5f));
      const Vec before = as_stored(k, random(width, 84));
      Dev g_q(k, q), g_kv(k, kv), g_rope(k, k_rope);
      Ints g_positions(k, positions);
      {  // the packing, at positions, and without the queries
        Vec packed = before, keys_only = before;
        cpu::mla_pack_forward(packed, q, kv, k_rope, B, S, H, Dn, Dr, Dv, theta, positions);
        cpu::mla_pack_forward(keys_only, {}, kv, k_rope, B, S, H, Dn, Dr, Dv, theta, positions);
        Dev g_packed(k, before), g_keys(k, before);
        k.mla_pack_forward(g_packed.p(), g_q.p(), g_kv.p(), g_rope.p(), B, S, H, Dn, Dr, Dv, theta,
                           g_positions.p());
        k.mla_pack_forward(g_keys.p(), nullptr, g_kv.p(), g_rope.p(), B, S, H, Dn, Dr, Dv, theta,
                           g_positions.p());
        CHECK(error(g_packed.host(), packed) < tolerance(type));
        CHECK(error(g_keys.host(), keys_only) < tolerance(type));
        const Vec grad = as_stored(k, random(width, 85));
        const Vec dq0 = as_stored(k, random(q.size(), 86)), dkv0 = as_stored(k, random(kv_n, 87)),
                  dr0 = as_stored(k, random(k_rope.size(), 88));
        Vec dq = dq0, dkv = dkv0, dr = dr0, dkv_alone = dkv0, dr_alone = dr0;
        cpu::mla_pack_backward(dq, dkv, dr, grad, B, S, H, Dn, Dr, Dv, theta, positions);
        cpu::mla_pack_backward({}, dkv_alone, dr_alone, grad, B, S, H, Dn, Dr, Dv, theta,
                               positions);
        Dev g_grad(k, grad), g_dq(k, dq0), g_dkv(k, dkv0), g_dr(k, dr0), g_dkv_alone(k, dkv0),
            g_dr_alone(k, dr0);
        k.mla_pack_backward(g_dq.p(), g_dkv.p(), g_dr.p(), g_grad.p(), B, S, H, Dn, Dr, Dv, theta,
                            g_positions.p());
        k.mla_pack_backward(nullptr, g_dkv_alone.p(), g_dr_alone.p(), g_grad.p(), B, S, H, Dn, Dr,
                            Dv, theta, g_positions.p());
        CHECK(error(g_dq.host(), dq) < tolerance(type));
        CHECK(error(g_dkv.host(), dkv) < tolerance(type));
        CHECK(error(g_dr.host(), dr) < tolerance(type));
        CHECK(error(g_dkv_alone.host(), dkv_alone) < tolerance(type));
        CHECK(error(g_dr_alone.host(), dr_alone) < tolerance(type));
      }
      // The core on the packed rows (positions 0 ... S-1), unfused and with FlashAttention's
      // memory, and the packing's backward after it.
      Vec qkv(width);
      cpu::mla_pack_forward(qkv, q, kv, k_rope, B, S, H, Dn, Dr, Dv, theta);
      qkv = as_stored(k, qkv);
      const Vec dout = as_stored(k, random(T * H * Dv, 89));
      for (const bool flash : {false, true}) {
        INFO((flash ? "FlashAttention's memory" : "probabilities kept"));
        const std::size_t probs_n = static_cast<std::size_t>(B) * H * S * (flash ? 1 : S);
        Vec out(T * H * Dv), probs(probs_n), dqkv(width, 0.0f);
        cpu::AttentionOptions o;
        o.v_dim = Dv;
        if (flash) o.lse = probs;  // the rows' log-sum-exp in place of the probabilities
        const cpu::Out kept = flash ? cpu::Out() : cpu::Out(probs);
        cpu::attention_forward(out, kept, qkv, B, S, H, H, D, o);
        cpu::attention_backward(dqkv, dqkv, dout, qkv, kept, B, S, H, H, D, o);
        Vec dq(q.size(), 0.0f), dkv(kv_n, 0.0f), dr(k_rope.size(), 0.0f);
        cpu::mla_pack_backward(dq, dkv, dr, dqkv, B, S, H, Dn, Dr, Dv, theta);

        Dev g_qkv(k, qkv), g_out(k, Vec(out.size())), g_probs(k, Vec(probs_n), flash),
            g_dout(k, dout), g_dqkv(k, Vec(width, 0.0f)), g_dq(k, Vec(q.size(), 0.0f)),
            g_dkv(k, Vec(kv_n, 0.0f)), g_dr(k, Vec(k_rope.size(), 0.0f));
        void* p = flash ? nullptr : g_probs.p();
        float* lse = flash ? g_probs.f() : nullptr;
        k.attention_forward(g_out.p(), p, g_qkv.p(), B, S, H, H, D, nullptr, nullptr, nullptr, lse,
                            Dv);
        k.attention_backward(g_dqkv.p(), g_dout.p(), g_qkv.p(), p, B, S, H, H, D, 0.0f, nullptr,
                             nullptr, lse, nullptr, Dv);
        k.mla_pack_backward(g_dq.p(), g_dkv.p(), g_dr.p(), g_dqkv.p(), B, S, H, Dn, Dr, Dv, theta);
        CHECK(error(g_probs.host(), probs) < tolerance(type));
        CHECK(error(g_out.host(), out) < tolerance(type));
        CHECK(error(g_dqkv.host(), dqkv) < tolerance(type));
        CHECK(error(g_dq.host(), dq) < tolerance(type));
        CHECK(error(g_dkv.host(), dkv) < tolerance(type));
        CHECK(error(g_dr.host(), dr) < tolerance(type));
      }
      {  // context parallelism: rank 1 of 2, its keys and values gathered (K then V a row)
        INFO("context parallelism");
        const int cp = 2, Sq = S / cp, St = cp * Sq;
        const CpLayout layout = cp_layout(cp, Sq);
        const std::vector<int>&qpos = layout.qpos, &order = layout.order;
        const auto rows = static_cast<std::size_t>(B) * Sq;
        const std::size_t q_width = rows * (2 * H * D + H * Dv);
        const Vec cq = as_stored(k, random(q_width, 90, 0.5f));
        const Vec ckv = as_stored(k, random(cp * rows * H * (D + Dv), 91, 0.5f));
        const Vec cdout = as_stored(k, random(rows * H * Dv, 92));
        const auto scores = rows * H * St;
        Vec out(rows * H * Dv), probs(scores), dqkv(q_width, 0.0f), dkv(ckv.size(), 0.0f);
        cpu::AttentionOptions o;
        o.kv = ckv;
        o.cp = cp;
        o.qpos = qpos;
        o.order = order;
        o.v_dim = Dv;
        cpu::attention_forward(out, probs, cq, B, Sq, H, H, D, o);
        cpu::attention_backward(dqkv, dkv, cdout, cq, probs, B, Sq, H, H, D, o);
        Dev g_qkv(k, cq), g_ckv(k, ckv), g_out(k, Vec(out.size())), g_probs(k, Vec(scores)),
            g_dout(k, cdout), g_dqkv(k, Vec(q_width, 0.0f)), g_dkv(k, Vec(ckv.size(), 0.0f));
        Ints g_qpos(k, qpos), g_order(k, order);
        k.attention_forward_cp(g_out.p(), g_probs.p(), g_qkv.p(), g_ckv.p(), g_qpos.p(),
                               g_order.p(), cp, B, Sq, H, H, D, nullptr, nullptr, nullptr, nullptr,
                               Dv);
        k.attention_backward_cp(g_dqkv.p(), g_dkv.p(), g_dout.p(), g_qkv.p(), g_ckv.p(),
                                g_probs.p(), g_qpos.p(), g_order.p(), cp, B, Sq, H, H, D, 0.0f,
                                nullptr, nullptr, nullptr, nullptr, Dv);
        CHECK(error(g_probs.host(), probs) < tolerance(type));
        CHECK(error(g_out.host(), out) < tolerance(type));
        CHECK(error(g_dqkv.host(), dqkv) < tolerance(type));
        CHECK(error(g_dkv.host(), dkv) < tolerance(type));
      }
    }
  }
}

// The core with values of their own width under grouped KV heads (the per-head batches of
// head_batches both ways: one head of every group, and a group's heads), and with dropout:
// v_dim is the kernels' general parameter, not latent attention's alone.
TEST_CASE("GPU attention with values of their own width matches the CPU, grouped heads",
          "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int B = 2, S = 20, D = 12;
  cpu::Dropout d;
  d.stream = 78;
  d.rate = 0.1f;
  d.Sq = S;
  for (cu::Dtype type : kTypes) {
    for (auto [H, G] : {std::tuple{4, 2}, std::tuple{8, 1}}) {
      for (const int Dv : {6, 16}) {
        for (const bool drop : {false, true}) {
          INFO(name(type) << ", " << H << " heads on " << G << " kv heads, values " << Dv << " wide"
                          << (drop ? ", with dropout" : ""));
          cu::Kernels k(*gpu, type);
          const auto T = static_cast<std::size_t>(B) * S;
          const std::size_t width = T * ((H + G) * D + G * Dv), scores = T * H * S;
          const Vec qkv = as_stored(k, random(width, 93, 0.5f));
          const Vec dout = as_stored(k, random(T * H * Dv, 94));
          Vec out(T * H * Dv), probs(scores), dropped(scores), dqkv(width, 0.0f);
          std::vector<std::uint8_t> mask(scores);
          cpu::AttentionOptions o;
          o.v_dim = Dv;
          if (drop) {
            o.dropout = &d;
            o.mask = mask;
            o.dropped = dropped;
          }
          cpu::attention_forward(out, probs, qkv, B, S, H, G, D, o);
          cpu::attention_backward(dqkv, dqkv, dout, qkv, probs, B, S, H, G, D, o);
          Dev g_qkv(k, qkv), g_out(k, Vec(out.size())), g_probs(k, Vec(scores)),
              g_dropped(k, Vec(scores)), g_dout(k, dout), g_dqkv(k, Vec(width, 0.0f));
          cu::DeviceBuffer g_mask(scores);
          const cu::Kernels::DropoutSite site{d.stream, d.rate, d.first_sequence, 0, S, 0, nullptr};
          auto* m = drop ? static_cast<std::uint8_t*>(g_mask.get()) : nullptr;
          k.attention_forward(g_out.p(), g_probs.p(), g_qkv.p(), B, S, H, G, D,
                              drop ? &site : nullptr, m, drop ? g_dropped.p() : nullptr, nullptr,
                              Dv);
          k.attention_backward(g_dqkv.p(), g_dout.p(), g_qkv.p(), g_probs.p(), B, S, H, G, D,
                               drop ? d.rate : 0.0f, m, drop ? g_dropped.p() : nullptr, nullptr,
                               nullptr, Dv);
          CHECK(error(g_probs.host(), probs) < tolerance(type));
          CHECK(error(g_out.host(), out) < tolerance(type));
          CHECK(error(g_dqkv.host(), dqkv) < tolerance(type));
        }
      }
    }
  }
}

TEST_CASE("GPU rotary embedding matches the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int B = 2, S = 9, H = 4, G = 2, D = 8;
  const int width = (H + 2 * G) * D;
  for (cu::Dtype type : kTypes) {
    INFO(name(type));
    cu::Kernels k(*gpu, type);
    const Vec qkv = as_stored(k, random(B * S * width, 41));
    const Vec dout = as_stored(k, random(B * S * width, 42));
    const Vec d0 = as_stored(k, random(B * S * width, 43));
    Vec out(qkv.size()), dqkv = d0;
    cpu::rope_forward(out, qkv, B, S, H, G, D, 10000.0);
    cpu::rope_backward(dqkv, dout, B, S, H, G, D, 10000.0);
    Dev d_qkv(k, qkv), d_out(k, Vec(qkv.size())), d_dout(k, dout), d_dqkv(k, d0);
    k.rope_forward(d_out.p(), d_qkv.p(), B, S, H, G, D, 10000.0);
    k.rope_backward(d_dqkv.p(), d_dout.p(), B, S, H, G, D, 10000.0);
    CHECK(error(d_out.host(), out) < tolerance(type));
    CHECK(error(d_dqkv.host(), dqkv) < tolerance(type));
  }
}

TEST_CASE("GPU embedding of a vocabulary shard matches the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int B = 2, S = 7, V = 50, rows = 25, begin = 25;
  // Rows of this shard (local = token - 25): 1 three times, 17 twice, 0, 5, 8, 16, 20, 21, 24;
  // 3 and 10 belong to another shard.
  const std::vector<int> tokens = {26, 42, 26, 3, 30, 46, 42, 25, 49, 41, 26, 10, 33, 45};
  REQUIRE(tokens.size() == static_cast<std::size_t>(B * S));
  REQUIRE(*std::max_element(tokens.begin(), tokens.end()) < V);
  // 4096 columns: 16 slices of the shard's 25 rows, rows 1 and 17 in one (24 columns: a slice
  // per row).
  for (int C : {24, 4096}) {
    for (cu::Dtype type : kTypes) {
      INFO(name(type) << ", " << C << " columns");
      cu::Kernels k(*gpu, type);
      const Vec wte = random(rows * C, 51), wpe = random(S * C, 52);
      const Vec dout = as_stored(k, random(B * S * C, 53));
      Vec out(B * S * C), dwte(rows * C, 0.1f), dwpe(S * C, -0.1f);
      cpu::embedding_forward(out, tokens, wte, wpe, B, S, C, begin);
      cpu::embedding_backward(dwte, dwpe, dout, tokens, B, S, C, begin);
      Dev d_wte(k, wte, true), d_wpe(k, wpe, true), d_out(k, Vec(out.size())), d_dout(k, dout),
          d_dwte(k, Vec(rows * C, 0.1f), true), d_dwpe(k, Vec(S * C, -0.1f), true);
      Ints d_tokens(k, tokens);
      k.embedding_forward(d_out.p(), d_tokens.p(), d_wte.f(), rows, d_wpe.f(), B, S, C, begin);
      k.embedding_backward(d_dwte.f(), rows, d_dwpe.f(), d_dout.p(), d_tokens.p(), B, S, C, begin);
      CHECK(error(d_out.host(), out) < tolerance(type));
      CHECK(error(d_dwte.host(), dwte) < tolerance(type));
      CHECK(error(d_dwpe.host(), dwpe) < tolerance(type));
    }
  }
}

TEST_CASE("GPU cross-entropy, whole and vocab-parallel, matches the CPU", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const int T = 10, V = 300, begin = 300;  // the shard holds columns [300, 600) of 600
  std::vector<int> targets(T), shard_targets(T);
  for (int t = 0; t < T; ++t) {
    targets[static_cast<std::size_t>(t)] = (t * 37) % V;
    shard_targets[static_cast<std::size_t>(t)] = (t * 71) % (2 * V);  // half in the shard
  }
  for (cu::Dtype type : kTypes) {
    INFO(name(type));
    cu::Kernels k(*gpu, type);
    const Vec logits = as_stored(k, random(T * V, 61, 2.0f));
    // The whole vocabulary: the three kernels on one shard, as the runner runs them at tp = 1.
    Vec dz(T * V), whole(3 * T);
    const std::span<float> w = whole;
    cpu::cross_entropy_max(w.first(T), logits, T, V);
    cpu::cross_entropy_sums(w.subspan(T), logits, w.first(T), targets, T, V, 0);
    const double loss =
        cpu::cross_entropy_sharded(dz, logits, w.first(T), w.subspan(T), targets, T, V, 0);
    Dev d_logits(k, logits), d_dz(k, Vec(T * V)), d_rows(k, Vec(T), true),
        d_whole(k, Vec(3 * T), true);
    Ints d_targets(k, targets);
    k.cross_entropy_max(d_whole.f(), d_logits.p(), T, V);
    k.cross_entropy_sums(d_whole.f() + T, d_logits.p(), d_whole.f(), d_targets.p(), T, V, 0);
    k.cross_entropy_sharded(d_dz.p(), d_rows.f(), d_logits.p(), d_whole.f(), d_whole.f() + T,
                            d_targets.p(), T, V, 0);
    const Vec rows = d_rows.host();
    const double gpu_loss = std::accumulate(rows.begin(), rows.end(), 0.0) / T;
    CHECK(std::fabs(gpu_loss - loss) / loss < tolerance(type));
    CHECK(error(d_dz.host(), dz) < tolerance(type));

    // One shard of two: the statistics as the CPU computes them, then the loss from them.
    Vec rowmax(T), sums(2 * T), sdz(T * V);
    cpu::cross_entropy_max(rowmax, logits, T, V);
    cpu::cross_entropy_sums(sums, logits, rowmax, shard_targets, T, V, begin);
    const double shard_loss =
        cpu::cross_entropy_sharded(sdz, logits, rowmax, sums, shard_targets, T, V, begin);
    Dev d_max(k, Vec(T), true), d_sums(k, Vec(2 * T), true), d_sdz(k, Vec(T * V));
    Ints d_shard_targets(k, shard_targets);
    k.cross_entropy_max(d_max.f(), d_logits.p(), T, V);
    k.cross_entropy_sums(d_sums.f(), d_logits.p(), d_max.f(), d_shard_targets.p(), T, V, begin);
    CHECK(error(d_max.host(), rowmax) < tolerance(type));
    CHECK(error(d_sums.host(), sums) < tolerance(type));
    // The sums rescaled to a larger maximum (another shard's), in fp32 whatever the type.
    Vec global(rowmax), rescaled(sums.begin(), sums.begin() + T);
    for (int t = 0; t < T; ++t)
      global[static_cast<std::size_t>(t)] += 0.25f * static_cast<float>(t);
    cpu::cross_entropy_rescale(rescaled, rowmax, global, T);
    Dev d_local(k, rowmax, true), d_global(k, global, true), d_rescaled(k, Vec(sums), true);
    k.cross_entropy_rescale(d_rescaled.f(), d_local.f(), d_global.f(), T);
    const Vec gpu_rescaled = d_rescaled.host();
    CHECK(error(Vec(gpu_rescaled.begin(), gpu_rescaled.begin() + T), rescaled) < 1e-6);
    // The loss from the CPU's statistics, so that only the last kernel is compared.
    Dev c_max(k, rowmax, true), c_sums(k, sums, true);
    k.cross_entropy_sharded(d_sdz.p(), d_rows.f(), d_logits.p(), c_max.f(), c_sums.f(),
                            d_shard_targets.p(), T, V, begin);
    const Vec shard_rows = d_rows.host();
    const double gpu_shard = std::accumulate(shard_rows.begin(), shard_rows.end(), 0.0) / T;
    CHECK(std::fabs(gpu_shard - shard_loss) / std::fabs(shard_loss) < tolerance(type));
    CHECK(error(d_sdz.host(), sdz) < tolerance(type));
  }
}

TEST_CASE("GPU AdamW matches the CPU over three steps", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  const std::int64_t n = 1000;
  cu::Kernels k(*gpu, cu::Dtype::BF16);  // the optimizer is fp32 whatever the activations
  Vec params = random(n, 71), m(n, 0.0f), v(n, 0.0f);
  Dev d_params(k, params, true), d_m(k, m, true), d_v(k, v, true);
  for (int t = 1; t <= 3; ++t) {
    const Vec grads = random(n, 72 + static_cast<unsigned>(t));
    Dev d_grads(k, grads, true);
    cpu::adamw(params, grads, m, v, n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    k.adamw(d_params.f(), d_grads.f(), d_m.f(), d_v.f(), n, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
  }
  CHECK(error(d_params.host(), params) < 1e-5);
  CHECK(error(d_m.host(), m) < 1e-5);
  CHECK(error(d_v.host(), v) < 1e-5);
}

TEST_CASE("GPU gradient clipping matches the CPU and repeats bit for bit", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  cu::Kernels k(*gpu, cu::Dtype::BF16);  // gradients are fp32 whatever the activations
  // Two tensors (one larger than the fixed grid covers in one pass), summed into one norm.
  const Vec a = random(100003, 81), b = random(777, 82, 3.0f);
  const double want = cpu::sum_squares(a, 100003) + cpu::sum_squares(b, 777);
  Dev d_a(k, a, true), d_b(k, b, true), acc(k, Vec{0.0f}, true);
  k.sum_squares(acc.f(), d_a.f(), 100003);
  k.sum_squares(acc.f(), d_b.f(), 777);
  const float got = acc.host()[0];
  CHECK(got == Approx(want).epsilon(1e-6));
  Dev again(k, Vec{0.0f}, true);
  k.sum_squares(again.f(), d_a.f(), 100003);
  k.sum_squares(again.f(), d_b.f(), 777);
  CHECK(again.host()[0] == got);  // a fixed order of sums: the same bits
  // Scaled as the CPU scales, from the same squared norm: bit for bit.
  Vec ref = a;
  cpu::clip_scale(ref, 100003, std::sqrt(static_cast<double>(got)), 1.0f);
  k.clip_scale(d_a.f(), 100003, acc.f(), 1.0f);
  CHECK(d_a.host() == ref);
  // A limit above the norm leaves the gradients alone.
  Vec same = b;
  k.clip_scale(d_b.f(), 777, acc.f(), 1e9f);
  CHECK(d_b.host() == same);
}

TEST_CASE("GPU kernels repeat bit for bit", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  // The column reductions run in a fixed order (no atomics): the same inputs, the same bits.
  const int T = 64, C = 96;
  cu::Kernels k(*gpu, cu::Dtype::BF16);
  const Vec in = random(T * C, 81), dout = random(T * C, 82), w = random(C, 83);
  auto once = [&] {
    Dev d_in(k, in), d_dout(k, dout), d_w(k, w, true), d_out(k, Vec(T * C)),
        d_mean(k, Vec(T), true), d_rstd(k, Vec(T), true), d_dw(k, Vec(C), true),
        d_db(k, Vec(C), true);
    k.norm_forward(d_out.p(), d_mean.f(), d_rstd.f(), d_in.p(), d_w.f(), nullptr, T, C, false);
    k.norm_backward(nullptr, d_dw.f(), d_db.f(), d_dout.p(), d_in.p(), d_w.f(), d_mean.f(),
                    d_rstd.f(), T, C, false);
    Vec all = d_dw.host();
    const Vec db = d_db.host();
    all.insert(all.end(), db.begin(), db.end());
    return all;
  };
  CHECK(once() == once());
}

TEST_CASE("GPU out of memory is its own error, and the GPU works after it", "[exec][cuda][gpu]") {
  const auto gpu = first_gpu();
  if (!gpu) return;
  cu::Kernels k(*gpu, cu::Dtype::F32);
  // More than any GPU has (1 PiB), in the stream's pool and by cudaMalloc: the one failure the
  // executor retries after freeing its cached buffers; other CUDA errors stay CudaError only.
  const std::size_t too_much = std::size_t{1} << 50;
  CHECK_THROWS_AS(cu::DeviceBuffer(too_much, k.allocation_stream()), cu::CudaOutOfMemory);
  CHECK_THROWS_AS(cu::DeviceBuffer(too_much), cu::CudaOutOfMemory);
  try {
    cu::DeviceBuffer b(too_much);
  } catch (const cu::CudaOutOfMemory& e) {
    CHECK_THAT(e.what(), Catch::Contains("bytes on GPU"));
  }
  // The failed allocation is not the "last error" of the next launch.
  const Vec x = random(257, 91);
  Dev d(k, x, true), acc(k, Vec{0.0f}, true);
  k.sum_squares(acc.f(), d.f(), 257);
  CHECK(acc.host()[0] == Approx(cpu::sum_squares(x, 257)).epsilon(1e-6));
}
