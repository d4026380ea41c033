// Every CPU kernel's backward against central finite differences of its forward: with a fixed
// random projection R of the output, loss = sum(out · R), so dout = R. fp32 kernels, so the
// tolerance is |analytic - numeric| <= 2e-2 · max(1, |numeric|) with a step of 1e-3.
#include "exec/cpu/kernels.hpp"

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <random>
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

TEST_CASE("GELU and SwiGLU backward match finite differences", "[exec][cpu]") {
  const int T = 3, F = 8;
  auto in = random(T * 2 * F, 9), r = random(T * 2 * F, 10);
  std::vector<float> out(T * 2 * F);
  auto gelu = [&] {
    cpu::gelu_forward(out, in, T * 2 * F);
    return dot(out, r);
  };
  gelu();
  std::vector<float> din(T * 2 * F);
  cpu::gelu_backward(din, in, r, T * 2 * F);
  check_gradient(in, din, gelu, "gelu");

  auto r2 = random(T * F, 11);
  std::vector<float> out2(T * F);
  auto swiglu = [&] {
    cpu::swiglu_forward(out2, in, T, F);
    return dot(out2, r2);
  };
  swiglu();
  std::vector<float> din2(T * 2 * F);
  cpu::swiglu_backward(din2, in, r2, T, F);
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
  auto xent = [&] { return cpu::cross_entropy(scratch, logits, tokens, B * S, V); };
  const double l = cpu::cross_entropy(dlogits, logits, tokens, B * S, V);
  CHECK(l > 0);
  check_gradient(logits, dlogits, xent, "logits");
}

TEST_CASE("AdamW takes the first step of size lr along -sign(grad)", "[exec][cpu]") {
  // At t = 1 the bias-corrected moments are g and g², so the update is lr · g / (|g| + eps).
  std::vector<float> p = {1.0f, -2.0f}, g = {0.5f, -4.0f}, m(2), v(2);
  cpu::adamw(p, g, m, v, 2, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
  CHECK(p[0] == Approx(0.9f));
  CHECK(p[1] == Approx(-1.9f));
}
