// Every CPU kernel's backward against central finite differences of its forward: with a fixed
// random projection R of the output, loss = sum(out · R), so dout = R. fp32 kernels, so the
// tolerance is |analytic - numeric| <= 2e-2 · max(1, |numeric|) with a step of 1e-3.
#include "exec/cpu/kernels.hpp"

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <vector>

namespace cpu = dtsim::exec::cpu;

namespace {

std::vector<float> random(std::size_t n, std::uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(gen);
  return v;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// Cross-entropy over the whole vocabulary (one shard), as the runner computes it at tp = 1:
// the mean loss, and the gradient into dlogits.
double whole_cross_entropy(std::vector<float>& dlogits, const std::vector<float>& logits,
                           const std::vector<int>& targets, int T, int V) {
  std::vector<float> stats(3 * static_cast<std::size_t>(T));
  const std::span<float> s = stats;
  cpu::cross_entropy_max(s.first(T), logits, T, V);
  cpu::cross_entropy_sums(s.subspan(T), logits, s.first(T), targets, T, V, 0);
  return cpu::cross_entropy_sharded(dlogits, logits, s.first(T), s.subspan(T), targets, T, V, 0);
}

// Checks `analytic` (d loss / d x) against finite differences of `loss` over x.
void check_gradient(std::vector<float>& x, const std::vector<float>& analytic,
                    const std::function<double()>& loss, const char* what) {
  REQUIRE(analytic.size() == x.size());
  const float h = 1e-3f;
  const std::size_t stride = std::max<std::size_t>(1, x.size() / 23);
  for (std::size_t i = 0; i < x.size(); i += stride) {
    const float keep = x[i];
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    const double numeric = (up - down) / (2.0 * h);
    INFO(what << "[" << i << "]: analytic " << analytic[i] << ", numeric " << numeric);
    CHECK(std::abs(analytic[i] - numeric) <= 2e-2 * std::max(1.0, std::abs(numeric)));
  }
}

}  // namespace

TEST_CASE("matmul backward matches finite differences", "[exec][cpu]") {
  const int T = 5, K = 7, N = 6;
  auto in = random(T * K, 1), w = random(K * N, 2), b = random(N, 3), r = random(T * N, 4);
  std::vector<float> out(T * N);
  auto loss = [&] {
    cpu::matmul_forward(out, in, w, b, T, K, N);
    return dot(out, r);
  };
  loss();
  std::vector<float> din(T * K), dw(K * N), db(N);
  cpu::matmul_backward(din, dw, db, r, in, w, T, K, N);
  check_gradient(in, din, loss, "in");
  check_gradient(w, dw, loss, "w");
  check_gradient(b, db, loss, "bias");
}

TEST_CASE(
    "matmul with a transposed weight (a tied head) matches finite differences and the "
    "untransposed product",
    "[exec][cpu]") {
  const int T = 5, K = 7, N = 6;
  auto in = random(T * K, 11), wt = random(N * K, 12), r = random(T * N, 13);
  std::vector<float> w(K * N);  // wt transposed
  for (int n = 0; n < N; ++n) {
    for (int k = 0; k < K; ++k)
      w[static_cast<std::size_t>(k * N + n)] = wt[static_cast<std::size_t>(n * K + k)];
  }
  std::vector<float> out(T * N), plain(T * N);
  auto loss = [&] {
    cpu::matmul_forward(out, in, wt, {}, T, K, N, /*w_transposed=*/true);
    return dot(out, r);
  };
  loss();
  cpu::matmul_forward(plain, in, w, {}, T, K, N);
  for (std::size_t i = 0; i < out.size(); ++i) CHECK(out[i] == Approx(plain[i]).margin(1e-5));
  std::vector<float> din(T * K), dwt(N * K);
  cpu::matmul_backward(din, dwt, {}, r, in, wt, T, K, N, /*w_transposed=*/true);
  check_gradient(in, din, loss, "in");
  check_gradient(wt, dwt, loss, "w transposed");
}

// The input gradient written whole (a gradient's first contribution): what the buffer held is
// neither read nor kept (NaN there stays out), and equals matmul_backward's added into zeros.
TEST_CASE("matmul input gradient written whole equals the one added into zeros", "[exec][cpu]") {
  const int T = 5, K = 7, N = 6;
  for (const bool transposed : {false, true}) {
    INFO("w transposed: " << transposed);
    const auto w = random(K * N, 21), r = random(T * N, 22);
    std::vector<float> added(T * K, 0.0f), written(T * K, std::nanf(""));
    cpu::matmul_backward(added, {}, {}, r, {}, w, T, K, N, transposed);
    cpu::matmul_input_grad(written, r, w, T, K, N, transposed);
    for (std::size_t i = 0; i < added.size(); ++i) CHECK(written[i] == added[i]);
  }
}

TEST_CASE("layernorm and rmsnorm backward match finite differences", "[exec][cpu]") {
  const int T = 4, C = 9;
  for (bool rms : {false, true}) {
    auto in = random(T * C, 5), w = random(C, 6), b = random(C, 7), r = random(T * C, 8);
    if (rms) b.clear();
    std::vector<float> out(T * C), mean(T), rstd(T);
    auto loss = [&] {
      cpu::norm_forward(out, mean, rstd, in, w, b, T, C, rms);
      return dot(out, r);
    };
    loss();
    std::vector<float> din(T * C), dw(C), db(rms ? 0 : C);
    cpu::norm_backward(din, dw, db, r, in, w, mean, rstd, T, C, rms);
    check_gradient(in, din, loss, rms ? "rms in" : "ln in");
    check_gradient(w, dw, loss, "norm w");
    if (!rms) check_gradient(b, db, loss, "norm b");
  }
}

TEST_CASE("GELU through exp is the tanh approximation, also far out", "[exec][cpu]") {
  // The kernel computes 0.5·x·(1 + tanh(u)) as x / (1 + exp(-2u)); here against the tanh form
  // in double, and its derivative, from the centre to where exp overflows.
  std::vector<float> x;
  for (const float v : {0.0f, 1e-6f, 0.02f, 0.3f, 1.0f, 2.5f, 6.0f, 12.0f, 30.0f, 100.0f, 1e4f}) {
    x.push_back(v);
    x.push_back(-v);
  }
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<float> out(x.size()), din(x.size()), ones(x.size(), 1.0f);
  cpu::gelu_forward(out, x, n);
  cpu::gelu_backward(din, x, ones, n);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double k = std::sqrt(2.0 / std::acos(-1.0));
    const double u = k * (v + 0.044715 * v * v * v);
    const double th = std::tanh(u);
    const double want = 0.5 * v * (1.0 + th);
    const double dwant =
        0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * v * v);
    INFO("x = " << v << ": " << out[i] << " against " << want << ", d " << din[i] << " against "
                << dwant);
    REQUIRE(std::isfinite(out[i]));
    REQUIRE(std::isfinite(din[i]));
    CHECK(std::abs(out[i] - want) <= 1e-6 * std::max(1.0, std::abs(want)));
    CHECK(std::abs(din[i] - dwant) <= 1e-5 * std::max(1.0, std::abs(dwant)));
  }
}

TEST_CASE("GELU and SwiGLU backward match finite differences", "[exec][cpu]") {
  const int T = 3, F = 8;
  auto in = random(T * 2 * F, 9), r = random(T * 2 * F, 10);
  std::vector<float> out(T * 2 * F);
  auto gelu = [&] {
    cpu::gelu_forward(out, in, T * 2 * F);
    return dot(out, r);
  };
  gelu();
  // The backwards write din whole: what it held (NaN here) is not read.
  std::vector<float> din(T * 2 * F, std::nanf(""));
  cpu::gelu_backward(din, in, r, T * 2 * F);
  CHECK(std::all_of(din.begin(), din.end(), [](float v) { return std::isfinite(v); }));
  check_gradient(in, din, gelu, "gelu");

  auto r2 = random(T * F, 11);
  std::vector<float> out2(T * F);
  auto swiglu = [&] {
    cpu::swiglu_forward(out2, in, T, F);
    return dot(out2, r2);
  };
  swiglu();
  std::vector<float> din2(T * 2 * F, std::nanf(""));
  cpu::swiglu_backward(din2, in, r2, T, F);
  CHECK(std::all_of(din2.begin(), din2.end(), [](float v) { return std::isfinite(v); }));
  check_gradient(in, din2, swiglu, "swiglu");
}

TEST_CASE("causal attention with grouped KV heads matches finite differences", "[exec][cpu]") {
  const int B = 2, S = 5, H = 4, G = 2, D = 3;
  const int width = (H + 2 * G) * D;
  auto qkv = random(static_cast<std::size_t>(B) * S * width, 12), r = random(B * S * H * D, 13);
  std::vector<float> out(B * S * H * D), probs(static_cast<std::size_t>(B) * H * S * S);
  auto loss = [&] {
    cpu::attention_forward(out, probs, qkv, B, S, H, G, D);
    return dot(out, r);
  };
  loss();
  // Causality: the first token attends only to itself.
  CHECK(probs[0] == Approx(1.0f));
  std::vector<float> dqkv(qkv.size());
  cpu::attention_backward(dqkv, r, qkv, probs, B, S, H, G, D);
  check_gradient(qkv, dqkv, loss, "qkv");
}

// Multi-head latent attention's values are narrower than its queries and keys (DeepSeek-V3:
// 128 against 192), with or without FlashAttention's memory.
TEST_CASE("attention with values narrower than its keys matches finite differences",
          "[exec][cpu]") {
  const int B = 2, S = 5, H = 2, G = 2, D = 5, Dv = 3;
  const int width = (H + G) * D + G * Dv;
  auto qkv = random(static_cast<std::size_t>(B) * S * width, 14), r = random(B * S * H * Dv, 15);
  std::vector<float> out(r.size()), probs(static_cast<std::size_t>(B) * H * S * S);
  std::vector<float> lse(static_cast<std::size_t>(B) * H * S);
  for (const bool flash : {false, true}) {
    INFO("flash " << flash);
    cpu::AttentionOptions o;
    o.v_dim = Dv;
    if (flash) o.lse = lse;
    auto loss = [&] {
      cpu::attention_forward(out, flash ? cpu::Out{} : cpu::Out{probs}, qkv, B, S, H, G, D, o);
      return dot(out, r);
    };
    loss();
    // The first token attends only to itself: its output is its own values.
    for (int d = 0; d < Dv; ++d) CHECK(out[static_cast<std::size_t>(d)] == qkv[(H + G) * D + d]);
    std::vector<float> dqkv(qkv.size());
    cpu::attention_backward(dqkv, dqkv, r, qkv, flash ? cpu::In{} : cpu::In{probs}, B, S, H, G, D,
                            o);
    check_gradient(qkv, dqkv, loss, "qkv");
  }
}

TEST_CASE("latent attention's packing turns the RoPE parts, one key part for all heads",
          "[exec][cpu]") {
  const int B = 2, S = 4, H = 3, Dn = 2, Dr = 4, Dv = 3, Dqk = Dn + Dr;
  const std::size_t T = static_cast<std::size_t>(B) * S, width = 2 * H * Dqk + H * Dv;
  auto q = random(T * H * Dqk, 40), kv = random(T * H * (Dn + Dv), 41), k_rope = random(T * Dr, 42);
  const auto r = random(T * width, 43);
  std::vector<float> qkv(T * width);
  auto loss = [&] {
    cpu::mla_pack_forward(qkv, q, kv, k_rope, B, S, H, Dn, Dr, Dv, 10000.0);
    return dot(qkv, r);
  };
  loss();
  // Position 0 turns nothing: the row is q, then each head's key columns and the shared part,
  // then the values.
  for (int h = 0; h < H; ++h) {
    for (int d = 0; d < Dqk; ++d) CHECK(qkv[h * Dqk + d] == q[h * Dqk + d]);
    for (int d = 0; d < Dn; ++d) CHECK(qkv[H * Dqk + h * Dqk + d] == kv[h * (Dn + Dv) + d]);
    for (int d = 0; d < Dr; ++d) CHECK(qkv[H * Dqk + h * Dqk + Dn + d] == k_rope[d]);
    for (int d = 0; d < Dv; ++d) CHECK(qkv[2 * H * Dqk + h * Dv + d] == kv[h * (Dn + Dv) + Dn + d]);
  }
  // Position 3 turns the RoPE parts only, the keys' the same in every head; as rope_forward
  // turns a head of Dr (one q head, no k, no v: H 1, G 0).
  const std::size_t row = 3 * width;
  std::vector<float> turned(Dr);
  cpu::rope_forward(turned, std::span<const float>(k_rope).subspan(3 * Dr, Dr), 1, 1, 1, 0, Dr,
                    10000.0, std::vector<int>{3});
  for (int h = 0; h < H; ++h) {
    for (int d = 0; d < Dn; ++d) CHECK(qkv[row + h * Dqk + d] == q[3 * H * Dqk + h * Dqk + d]);
    for (int d = 0; d < Dr; ++d) {
      CHECK(qkv[row + H * Dqk + h * Dqk + Dn + d] == Approx(turned[d]).margin(1e-6));
    }
  }
  CHECK(qkv[row + Dn] != Approx(q[3 * H * Dqk + Dn]));
  // Without q (context parallelism's gather of the keys and values): the same keys and values,
  // the q columns left as they were, and the same gradients of kv and k_rope.
  std::vector<float> alone(qkv.size(), -7.0f);
  cpu::mla_pack_forward(alone, {}, kv, k_rope, B, S, H, Dn, Dr, Dv, 10000.0);
  for (std::size_t t = 0; t < T; ++t) {
    for (std::size_t c = 0; c < width; ++c) {
      CHECK(alone[t * width + c] == (c < H * Dqk ? -7.0f : qkv[t * width + c]));
    }
  }
  std::vector<float> dq(q.size()), dkv(kv.size()), dk_rope(k_rope.size());
  std::vector<float> dkv_alone(kv.size()), dk_rope_alone(k_rope.size());
  cpu::mla_pack_backward({}, dkv_alone, dk_rope_alone, r, B, S, H, Dn, Dr, Dv, 10000.0);
  cpu::mla_pack_backward(dq, dkv, dk_rope, r, B, S, H, Dn, Dr, Dv, 10000.0);
  CHECK(dkv_alone == dkv);
  CHECK(dk_rope_alone == dk_rope);
  check_gradient(q, dq, loss, "q");
  check_gradient(kv, dkv, loss, "kv");
  check_gradient(k_rope, dk_rope, loss, "k_rope");
}

// Context parallelism: cp ranks, each with two of 2·cp chunks of every sequence (c and
// 2·cp-1-c, as the runner places them), give one rank's outputs and dq exactly (the keys are
// visited in position order, and dropout's masks follow positions), and its dk, dv to rounding.
TEST_CASE("attention split over context-parallel ranks equals one rank's", "[exec][cpu]") {
  const int B = 2, cp = 2, S = 8, H = 4, G = 2, D = 3, Sq = S / cp, chunk = S / (2 * cp);
  const int width = (H + 2 * G) * D, kvw = 2 * G * D;
  const auto qkv = random(static_cast<std::size_t>(B) * S * width, 40);
  const auto dout = random(static_cast<std::size_t>(B) * S * H * D, 41);
  cpu::Dropout dropout;
  dropout.stream = 7;
  dropout.rate = 0.3f;
  dropout.first_sequence = 5;
  dropout.head_offset = 4;  // as tensor-parallel rank 1 of 2 with 8 heads

  // Rank c's positions, and each position's key among the all-gathered ones.
  std::vector<std::vector<int>> positions(cp);
  std::vector<int> order(S);
  for (int p = 0; p < S; ++p) {
    const int k = p / chunk, owner = k < cp ? k : 2 * cp - 1 - k;
    order[static_cast<std::size_t>(p)] = owner * Sq + static_cast<int>(positions[owner].size());
    positions[owner].push_back(p);
  }
  // Every rank's rows of a [B·S, w] tensor.
  auto rows_of = [&](const std::vector<float>& full, int c, int w) {
    std::vector<float> mine(static_cast<std::size_t>(B) * Sq * w);
    for (int b = 0; b < B; ++b) {
      for (int s = 0; s < Sq; ++s) {
        std::copy_n(full.data() + (static_cast<std::size_t>(b) * S + positions[c][s]) * w, w,
                    mine.data() + (static_cast<std::size_t>(b) * Sq + s) * w);
      }
    }
    return mine;
  };
  for (const bool with_dropout : {false, true}) {
    INFO((with_dropout ? "with" : "without") << " dropout");
    const std::size_t quad = static_cast<std::size_t>(B) * H * S * S;
    std::vector<float> out(dout.size()), probs(quad), dropped(with_dropout ? quad : 0);
    std::vector<std::uint8_t> mask(with_dropout ? quad : 0);
    std::vector<float> dqkv(qkv.size());
    cpu::AttentionOptions whole;
    if (with_dropout) whole = {{}, 1, {}, {}, &dropout, mask, dropped, {}};
    cpu::attention_forward(out, probs, qkv, B, S, H, G, D, whole);
    cpu::attention_backward(dqkv, dqkv, dout, qkv, probs, B, S, H, G, D, whole);
    if (with_dropout) {
      const auto kept = std::count(mask.begin(), mask.end(), std::uint8_t{1});
      CHECK(kept > 0);
      CHECK(kept < static_cast<std::int64_t>(B * H * S * (S + 1) / 2));  // some were dropped
    }

    std::vector<float> kv(static_cast<std::size_t>(cp) * B * Sq * kvw);
    for (int c = 0; c < cp; ++c) {
      const auto mine = rows_of(qkv, c, width);
      cpu::copy_columns(std::span(kv).subspan(static_cast<std::size_t>(c) * B * Sq * kvw), mine,
                        B * Sq, width, H * D, kvw);
    }
    std::vector<float> dkv(kv.size());
    std::vector<std::vector<float>> dqkv_of(cp);
    for (int c = 0; c < cp; ++c) {
      const auto mine = rows_of(qkv, c, width);
      const std::size_t local_quad = static_cast<std::size_t>(B) * H * Sq * S;
      std::vector<float> o(static_cast<std::size_t>(B) * Sq * H * D), pr(local_quad);
      std::vector<float> dr(with_dropout ? local_quad : 0);
      std::vector<std::uint8_t> m(with_dropout ? local_quad : 0);
      const cpu::AttentionOptions split{
          kv, cp, positions[c], order, with_dropout ? &dropout : nullptr, m, dr, {}};
      cpu::attention_forward(o, pr, mine, B, Sq, H, G, D, split);
      CHECK(o == rows_of(out, c, H * D));
      dqkv_of[c].assign(mine.size(), 0.0f);
      cpu::attention_backward(dqkv_of[c], dkv, rows_of(dout, c, H * D), mine, pr, B, Sq, H, G, D,
                              split);
      // FlashAttention's memory on the rank: the same outputs, and gradients to rounding, with
      // the other ranks' keys (the probabilities and masks made again from their positions).
      std::vector<float> lse(static_cast<std::size_t>(B) * H * Sq), fo(o.size());
      std::vector<float> fdq(mine.size(), 0.0f), fdkv(kv.size(), 0.0f), udq(mine.size(), 0.0f),
          udkv(kv.size(), 0.0f);
      cpu::AttentionOptions flash = split;
      flash.mask = {};
      flash.dropped = {};
      flash.lse = lse;
      cpu::attention_forward(fo, {}, mine, B, Sq, H, G, D, flash);
      CHECK(fo == o);
      cpu::attention_backward(udq, udkv, rows_of(dout, c, H * D), mine, pr, B, Sq, H, G, D, split);
      cpu::attention_backward(fdq, fdkv, rows_of(dout, c, H * D), mine, {}, B, Sq, H, G, D, flash);
      for (std::size_t i = 0; i < fdq.size(); ++i) CHECK(fdq[i] == Approx(udq[i]).margin(1e-5));
      for (std::size_t i = 0; i < fdkv.size(); ++i) CHECK(fdkv[i] == Approx(udkv[i]).margin(1e-5));
    }
    // dkv holds the sum over ranks (what the reduce-scatter makes); each owner adds its block
    // into its qkv gradient's K and V columns.
    for (int c = 0; c < cp; ++c) {
      cpu::add_columns(
          dqkv_of[c],
          std::span<const float>(dkv).subspan(static_cast<std::size_t>(c) * B * Sq * kvw,
                                              static_cast<std::size_t>(B) * Sq * kvw),
          B * Sq, width, H * D, kvw);
      // dq sums in one rank's order (bit for bit); dk and dv are summed on each rank, then
      // over the ranks: another order.
      const auto expected = rows_of(dqkv, c, width);
      REQUIRE(dqkv_of[c].size() == expected.size());
      for (std::size_t i = 0; i < expected.size(); ++i) {
        if (static_cast<int>(i % static_cast<std::size_t>(width)) < H * D) {
          CHECK(dqkv_of[c][i] == expected[i]);
        } else {
          CHECK(dqkv_of[c][i] == Approx(expected[i]).margin(1e-6));
        }
      }
    }
  }
}

TEST_CASE("attention dropout's backward matches finite differences", "[exec][cpu]") {
  const int B = 2, S = 5, H = 4, G = 2, D = 3;
  const int width = (H + 2 * G) * D;
  auto qkv = random(static_cast<std::size_t>(B) * S * width, 60), r = random(B * S * H * D, 61);
  const std::size_t quad = static_cast<std::size_t>(B) * H * S * S;
  std::vector<float> out(B * S * H * D), probs(quad), dropped(quad);
  std::vector<std::uint8_t> mask(quad);
  cpu::Dropout dropout;
  dropout.stream = 11;
  dropout.rate = 0.25f;
  const cpu::AttentionOptions o{{}, 1, {}, {}, &dropout, mask, dropped, {}};
  auto loss = [&] {
    cpu::attention_forward(out, probs, qkv, B, S, H, G, D, o);
    return dot(out, r);
  };
  loss();
  // Kept probabilities are scaled by 1/(1 - rate), the others 0.
  for (std::size_t i = 0; i < quad; ++i) {
    CHECK(dropped[i] == (mask[i] ? Approx(probs[i] / 0.75f) : Approx(0.0f)));
  }
  std::vector<float> dqkv(qkv.size());
  cpu::attention_backward(dqkv, dqkv, r, qkv, probs, B, S, H, G, D, o);
  check_gradient(qkv, dqkv, loss, "qkv");
}

// FlashAttention's memory (AttentionOptions::lse): the forward's outputs are the unfused
// kernel's bit for bit, and the backward, from the scores computed again and the rows'
// log-sum-exp (dropout's masks drawn again), gives its gradients to rounding; with 320 keys per
// row, longer than a block of FlashAttention's. (Split over context-parallel ranks: the test
// above.)
TEST_CASE("FlashAttention's memory gives the unfused kernel's outputs and gradients",
          "[exec][cpu]") {
  const int B = 2, H = 4, G = 2, D = 8;
  const int width = (H + 2 * G) * D;
  cpu::Dropout dropout;
  dropout.stream = 5;
  dropout.rate = 0.2f;
  dropout.first_sequence = 3;
  for (const int S : {5, 320}) {
    for (const bool with_dropout : {false, true}) {
      INFO("S " << S << (with_dropout ? " with" : " without") << " dropout");
      const auto qkv = random(static_cast<std::size_t>(B) * S * width, 70);
      const auto dout = random(static_cast<std::size_t>(B) * S * H * D, 71);
      const std::size_t quad = static_cast<std::size_t>(B) * H * S * S;
      std::vector<float> out(dout.size()), probs(quad), dropped(with_dropout ? quad : 0);
      std::vector<std::uint8_t> mask(with_dropout ? quad : 0);
      std::vector<float> dqkv(qkv.size());
      const cpu::AttentionOptions unfused{{},   1,       {}, {}, with_dropout ? &dropout : nullptr,
                                          mask, dropped, {}};
      cpu::attention_forward(out, probs, qkv, B, S, H, G, D, unfused);
      cpu::attention_backward(dqkv, dqkv, dout, qkv, probs, B, S, H, G, D, unfused);

      std::vector<float> lse(static_cast<std::size_t>(B) * H * S), flash_out(out.size());
      std::vector<float> flash_dqkv(qkv.size());
      cpu::AttentionOptions flash;
      flash.dropout = with_dropout ? &dropout : nullptr;
      flash.lse = lse;
      cpu::attention_forward(flash_out, {}, qkv, B, S, H, G, D, flash);
      CHECK(flash_out == out);
      // The first query of a sequence attends to itself alone: its log-sum-exp is its score.
      const float q0k0 = [&] {
        float s = 0;
        for (int d = 0; d < D; ++d) s += qkv[static_cast<std::size_t>(d)] * qkv[H * D + d];
        return s / std::sqrt(static_cast<float>(D));
      }();
      CHECK(lse[0] == Approx(q0k0));
      cpu::attention_backward(flash_dqkv, flash_dqkv, dout, qkv, {}, B, S, H, G, D, flash);
      // The largest difference, relative to the element (at least 1e-2 of the largest).
      const float largest = std::abs(*std::max_element(
          dqkv.begin(), dqkv.end(), [](float a, float b) { return std::abs(a) < std::abs(b); }));
      double worst = 0;
      for (std::size_t i = 0; i < dqkv.size(); ++i) {
        const double scale = std::max(std::abs(dqkv[i]), 1e-2f * largest);
        worst = std::max(worst, std::abs(flash_dqkv[i] - dqkv[i]) / scale);
      }
      CHECK(largest > 0);
      CHECK(worst < 1e-4);
    }
  }
}

TEST_CASE("hidden dropout keeps 1 - rate of the elements, the same mask however rows are split",
          "[exec][cpu]") {
  const int B = 4, Sq = 64, C = 96, T = B * Sq;
  cpu::Dropout d;
  d.stream = 3;
  d.rate = 0.1f;
  d.first_sequence = 8;
  d.Sq = Sq;
  const auto branch = random(static_cast<std::size_t>(T) * C, 70);
  const auto skip = random(branch.size(), 71);
  std::vector<float> out(branch.size());
  std::vector<std::uint8_t> mask(branch.size());
  cpu::dropout_add_forward(out, mask, branch, skip, d, T, C);
  const double kept =
      static_cast<double>(std::count(mask.begin(), mask.end(), std::uint8_t{1})) / mask.size();
  CHECK(kept == Approx(0.9).margin(0.005));  // 24,576 draws: one standard deviation ~ 0.0019
  for (std::size_t i = 0; i < out.size(); ++i) {
    CHECK(out[i] == Approx(skip[i] + (mask[i] ? branch[i] / 0.9f : 0.0f)).margin(1e-6));
  }
  // A tensor-parallel rank's share of the rows under sequence parallelism: the same mask.
  cpu::Dropout second = d;
  second.first_row = T / 2;
  std::vector<float> half(branch.size() / 2);
  std::vector<std::uint8_t> half_mask(half.size());
  cpu::dropout_forward(half, half_mask, std::span(branch).subspan(half.size()), second, T / 2, C);
  CHECK(std::equal(half_mask.begin(), half_mask.end(), mask.begin() + half.size()));
  // Another step (stream) draws another mask; the backward passes the kept gradient, scaled.
  cpu::Dropout next = d;
  next.stream = 4;
  std::vector<std::uint8_t> next_mask(mask.size());
  cpu::dropout_forward(out, next_mask, branch, next, T, C);
  CHECK(next_mask != mask);
  std::vector<float> din(branch.size(), 1.0f);
  cpu::dropout_backward(din, mask, skip, 0.1f);
  for (std::size_t i = 0; i < din.size(); i += 97) {
    CHECK(din[i] == Approx(1.0f + (mask[i] ? skip[i] / 0.9f : 0.0f)).margin(1e-6));
  }
}

// A mixture of experts' routing, dispatch and combine, with each copy's "expert" a fixed
// elementwise scale: the gradients of the logits and of the tokens against finite differences
// (the logits are spread out so that a step of 1e-3 does not change the experts chosen), with
// an expert that gets no token.
TEST_CASE("MoE routing, dispatch and combine backward match finite differences", "[exec][cpu]") {
  // Gates over the top k's softmax (Mixtral's), or their probabilities in the softmax over all
  // experts (Switch's; Hugging Face's norm_topk_prob false), whose gradient reaches every logit;
  // or the chosen logits' sigmoids, over their sum or not, scaled (DeepSeek-V3's, GLM-4.5's).
  // (Variants 0-1: softmax over the k and over all; 2-4: sigmoids over the k, not normalized
  // ×1.5, over the k ×2.5; 5-6: softmax over the k ×2.5, over all ×1.5.)
  const int variant = GENERATE(0, 1, 2, 3, 4, 5, 6);
  dtsim::exec::Gating gating;
  gating.normalize = variant != 1 && variant != 3 && variant != 6;
  gating.sigmoid = variant >= 2 && variant <= 4;
  gating.scale = variant == 4 || variant == 5 ? 2.5f : variant == 3 || variant == 6 ? 1.5f : 1.0f;
  const bool normalize = gating.normalize;
  INFO((gating.sigmoid ? "sigmoids"
        : normalize    ? "top k's softmax"
                       : "softmax over all")
       << (normalize ? ", over the k" : "") << ", scale " << gating.scale);
  const int T = 6, E = 4, k = 2, C = 5;
  auto x = random(static_cast<std::size_t>(T) * C, 80);
  std::vector<float> logits(static_cast<std::size_t>(T) * E);
  // Experts 0-2 at distinct logits; expert 3 far below, so that it gets no token.
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) {
      logits[static_cast<std::size_t>(t * E + e)] = e == 3 ? -5.0f : 0.5f * ((t + 3 * e) % E);
    }
  }
  const auto scale = random(static_cast<std::size_t>(T) * k * C, 81);
  const auto r = random(static_cast<std::size_t>(T) * C, 82);
  std::vector<int> experts(static_cast<std::size_t>(T) * k), order(experts.size()), rows(E);
  std::vector<float> gates(experts.size()), dispatched(experts.size() * C), y(dispatched.size()),
      out(x.size());
  auto loss = [&] {
    cpu::moe_route(experts, gates, logits, T, E, k, gating);
    cpu::moe_dispatch(dispatched, order, rows, x, experts, T, C, k, E);
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = dispatched[i] * scale[i];
    cpu::moe_combine(out, y, gates, order, T, C, k);
    return dot(out, r);
  };
  loss();
  // Each token's k experts are distinct and its gates sum to the scale where normalized over
  // the k (softmax over all experts: less, by the others' probabilities; unnormalized
  // sigmoids: their own sum); the rows add up to T·k.
  for (int t = 0; t < T; ++t) {
    CHECK(experts[static_cast<std::size_t>(t * k)] != experts[static_cast<std::size_t>(t * k + 1)]);
    const float sum =
        gates[static_cast<std::size_t>(t * k)] + gates[static_cast<std::size_t>(t * k + 1)];
    if (normalize) {
      CHECK(sum == Approx(gating.scale));
    } else if (!gating.sigmoid) {
      CHECK(sum < 0.99f * gating.scale);
    } else {
      const auto sigmoid = [&](int j) {
        const float l = logits[static_cast<std::size_t>(t * E + experts[t * k + j])];
        return gating.scale / (1.0f + std::exp(-l));
      };
      CHECK(sum == Approx(sigmoid(0) + sigmoid(1)));
    }
    CHECK(gates[static_cast<std::size_t>(t * k)] >= gates[static_cast<std::size_t>(t * k + 1)]);
  }
  CHECK(std::accumulate(rows.begin(), rows.end(), 0) == T * k);
  CHECK(rows[3] == 0);
  std::vector<float> dy(y.size()), dgates(gates.size()), dlogits(logits.size()), dx(x.size());
  cpu::moe_combine_backward(dy, dgates, r, y, gates, order, T, C, k);
  cpu::moe_route_backward(dlogits, dgates, gates, experts,
                          gating.reads_logits() ? cpu::In(logits) : cpu::In{}, T, E, k, gating);
  for (std::size_t i = 0; i < dy.size(); ++i) dy[i] *= scale[i];
  cpu::moe_dispatch_backward(dx, dy, order, T, C, k);
  check_gradient(logits, dlogits, loss, "logits");
  check_gradient(x, dx, loss, "x");
}

// Ties (common among bf16 logits) go to the lower expert, whose copy comes first: the rule the
// GPU's routing kernel follows and its test plants.
TEST_CASE("MoE routing breaks ties by the lower expert", "[exec][cpu]") {
  const int T = 3, E = 6, k = 2;
  const std::vector<float> logits = {-0.5f, 1.5f,  -0.5f, -0.5f, 1.5f,  -0.5f,   // two maxima
                                     2.0f,  0.25f, 1.0f,  0.25f, 0.25f, 1.0f,    // equal second
                                     0.75f, 0.75f, 0.75f, 0.75f, 0.75f, 0.75f};  // all equal
  std::vector<int> experts(static_cast<std::size_t>(T) * k);
  std::vector<float> gates(experts.size());
  cpu::moe_route(experts, gates, logits, T, E, k, dtsim::exec::Gating{});
  CHECK(experts == std::vector<int>{1, 4, 0, 2, 0, 1});
  CHECK(gates[0] == gates[1]);
  CHECK(gates[4] == gates[5]);
}

TEST_CASE("RoPE and learned positions at a rank's positions equal those rows of the whole",
          "[exec][cpu]") {
  const int B = 2, S = 6, H = 2, G = 1, D = 4, C = 3, V = 5;
  const int width = (H + 2 * G) * D;
  const std::vector<int> positions = {4, 1};  // two rows of each sequence
  const auto qkv = random(static_cast<std::size_t>(B) * S * width, 50);
  std::vector<float> turned(qkv.size());
  cpu::rope_forward(turned, qkv, B, S, H, G, D, 10000.0);
  std::vector<float> mine(static_cast<std::size_t>(B) * 2 * width), mine_turned(mine.size());
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < 2; ++s) {
      std::copy_n(qkv.data() + (static_cast<std::size_t>(b) * S + positions[s]) * width, width,
                  mine.data() + (static_cast<std::size_t>(b) * 2 + s) * width);
    }
  }
  cpu::rope_forward(mine_turned, mine, B, 2, H, G, D, 10000.0, positions);
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < 2; ++s) {
      for (int i = 0; i < width; ++i) {
        CHECK(mine_turned[(static_cast<std::size_t>(b) * 2 + s) * width + i] ==
              turned[(static_cast<std::size_t>(b) * S + positions[s]) * width + i]);
      }
    }
  }
  // The backward turns back by the same positions: rope_backward(rope_forward(x)) = x.
  std::vector<float> back(mine.size());
  cpu::rope_backward(back, mine_turned, B, 2, H, G, D, 10000.0, positions);
  for (std::size_t i = 0; i < back.size(); ++i) CHECK(back[i] == Approx(mine[i]).margin(1e-5));

  const std::vector<int> tokens = {3, 0, 4, 4};
  const auto wte = random(V * C, 51), wpe = random(S * C, 52), dy = random(B * 2 * C, 53);
  std::vector<float> out(static_cast<std::size_t>(B) * 2 * C);
  cpu::embedding_forward(out, tokens, wte, wpe, B, 2, C, 0, positions);
  CHECK(out[static_cast<std::size_t>(C) * 1] == wte[0] + wpe[static_cast<std::size_t>(1) * C]);
  std::vector<float> dwte(wte.size()), dwpe(wpe.size());
  cpu::embedding_backward(dwte, dwpe, dy, tokens, B, 2, C, 0, positions);
  // Position 4 gets the first row of each sequence; positions other than 1 and 4 nothing.
  CHECK(dwpe[static_cast<std::size_t>(4) * C] ==
        Approx(dy[0] + dy[static_cast<std::size_t>(2) * C]));
  CHECK(dwpe[0] == 0.0f);
}

TEST_CASE("RoPE turns q and k, keeps v and the norms, and its backward matches", "[exec][cpu]") {
  const int B = 2, S = 6, H = 2, G = 1, D = 4;
  const int width = (H + 2 * G) * D;
  auto qkv = random(static_cast<std::size_t>(B) * S * width, 30), r = random(qkv.size(), 31);
  std::vector<float> out(qkv.size());
  auto loss = [&] {
    cpu::rope_forward(out, qkv, B, S, H, G, D, 10000.0);
    return dot(out, r);
  };
  loss();
  // Position 0 is not turned; v is never turned; a rotation keeps each pair's length.
  for (int i = 0; i < width; ++i)
    CHECK(out[static_cast<std::size_t>(i)] == qkv[static_cast<std::size_t>(i)]);
  const std::size_t row3 = 3 * static_cast<std::size_t>(width);
  for (int i = (H + G) * D; i < width; ++i) CHECK(out[row3 + i] == qkv[row3 + i]);
  const double before = std::hypot(qkv[row3 + 0], qkv[row3 + 2]);
  CHECK(std::hypot(out[row3 + 0], out[row3 + 2]) == Approx(before).epsilon(1e-5));
  CHECK(out[row3 + 0] != Approx(qkv[row3 + 0]));
  std::vector<float> dqkv(qkv.size());
  cpu::rope_backward(dqkv, r, B, S, H, G, D, 10000.0);
  check_gradient(qkv, dqkv, loss, "qkv");
}

TEST_CASE("embedding and cross-entropy backward match finite differences", "[exec][cpu]") {
  const int B = 2, S = 3, C = 4, V = 6;
  const std::vector<int> tokens = {1, 5, 2, 0, 3, 5};
  auto wte = random(V * C, 14), wpe = random(S * C, 15), r = random(B * S * C, 16);
  std::vector<float> out(B * S * C);
  auto emb = [&] {
    cpu::embedding_forward(out, tokens, wte, wpe, B, S, C);
    return dot(out, r);
  };
  emb();
  std::vector<float> dwte(V * C), dwpe(S * C);
  cpu::embedding_backward(dwte, dwpe, r, tokens, B, S, C);
  check_gradient(wte, dwte, emb, "wte");
  check_gradient(wpe, dwpe, emb, "wpe");

  auto logits = random(B * S * V, 17);
  std::vector<float> dlogits(logits.size()), scratch(logits.size());
  auto xent = [&] { return whole_cross_entropy(scratch, logits, tokens, B * S, V); };
  const double l = whole_cross_entropy(dlogits, logits, tokens, B * S, V);
  CHECK(l > 0);
  check_gradient(logits, dlogits, xent, "logits");
}

TEST_CASE("vocab-parallel cross-entropy over two shards equals the whole", "[exec][cpu]") {
  // The dtexec runner's tp = 2 loss: each shard's statistics to its own maximum; the maxima
  // reduced with max, each shard's sums rescaled to them, the sums and target logits summed.
  const int T = 5, V = 8, half = V / 2;
  const std::vector<int> targets = {0, 7, 3, 4, 6};  // in either shard
  auto logits = random(T * V, 18);
  logits[2 * V + 6] = 9.0f;  // a row whose maximum only the second shard holds
  std::vector<float> dwhole(logits.size());
  const double whole = whole_cross_entropy(dwhole, logits, targets, T, V);

  std::vector<std::vector<float>> shard(2), stats(2, std::vector<float>(3 * T)), local(2);
  for (int r = 0; r < 2; ++r) {
    for (int t = 0; t < T; ++t) {
      const auto row = logits.begin() + t * V + r * half;
      shard[r].insert(shard[r].end(), row, row + half);
    }
    const std::span<float> s = stats[r];
    cpu::cross_entropy_max(s.first(T), shard[r], T, half);
    cpu::cross_entropy_sums(s.subspan(T), shard[r], s.first(T), targets, T, half, r * half);
    local[r].assign(s.begin(), s.begin() + T);
  }
  std::vector<float> reduced(3 * T, 0.0f);
  for (int t = 0; t < T; ++t) reduced[t] = std::max(stats[0][t], stats[1][t]);
  for (int r = 0; r < 2; ++r) {
    cpu::cross_entropy_rescale(std::span<float>(stats[r]).subspan(T, T), local[r],
                               std::span<const float>(reduced).first(T), T);
    for (int i = T; i < 3 * T; ++i) reduced[i] += stats[r][i];
  }
  const std::span<const float> g = reduced;
  for (int r = 0; r < 2; ++r) {
    std::vector<float> dshard(shard[r].size());
    const double l = cpu::cross_entropy_sharded(dshard, shard[r], g.first(T), g.subspan(T), targets,
                                                T, half, r * half);
    CHECK(l == Approx(whole).epsilon(1e-6));
    for (int t = 0; t < T; ++t) {
      for (int v = 0; v < half; ++v) {
        CHECK(dshard[t * half + v] == Approx(dwhole[t * V + r * half + v]).margin(1e-7));
      }
    }
  }
}

TEST_CASE("AdamW takes the first step of size lr along -sign(grad)", "[exec][cpu]") {
  // At t = 1 the bias-corrected moments are g and g², so the update is lr · g / (|g| + eps).
  std::vector<float> p = {1.0f, -2.0f}, g = {0.5f, -4.0f}, m(2), v(2);
  cpu::adamw(p, g, m, v, 2, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
  CHECK(p[0] == Approx(0.9f));
  CHECK(p[1] == Approx(-1.9f));
}
