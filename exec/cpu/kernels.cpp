#include "exec/cpu/kernels.hpp"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "sim/common/error.hpp"

namespace dtsim::exec::cpu {

void set_gemm_threads(int threads) {
  openblas_set_num_threads(threads);
}

void matmul_forward(Out out, In in, In w, In bias, int T, int K, int N, bool w_transposed) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, w_transposed ? CblasTrans : CblasNoTrans, T, N, K, 1.0f,
              in.data(), K, w.data(), w_transposed ? K : N, 0.0f, out.data(), N);
  if (!bias.empty()) {
    for (int t = 0; t < T; ++t) {
      for (int n = 0; n < N; ++n) out[static_cast<std::size_t>(t) * N + n] += bias[n];
    }
  }
}

namespace {

// din = dout · w^T + beta · din (beta 0: din is not read).
void input_grad(Out din, In dout, In w, int T, int K, int N, bool w_transposed, float beta) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, w_transposed ? CblasNoTrans : CblasTrans, T, K, N, 1.0f,
              dout.data(), N, w.data(), w_transposed ? K : N, beta, din.data(), K);
}

}  // namespace

void matmul_input_grad(Out din, In dout, In w, int T, int K, int N, bool w_transposed) {
  input_grad(din, dout, w, T, K, N, w_transposed, 0.0f);
}

void matmul_backward(Out din, Out dw, Out dbias, In dout, In in, In w, int T, int K, int N,
                     bool w_transposed) {
  if (!din.empty()) input_grad(din, dout, w, T, K, N, w_transposed, 1.0f);
  if (!dw.empty() && w_transposed) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, T, 1.0f, dout.data(), N, in.data(),
                K, 1.0f, dw.data(), K);
  } else if (!dw.empty()) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, N, T, 1.0f, in.data(), K, dout.data(),
                N, 1.0f, dw.data(), N);
  }
  if (!dbias.empty()) {
    for (int t = 0; t < T; ++t) {
      for (int n = 0; n < N; ++n) dbias[n] += dout[static_cast<std::size_t>(t) * N + n];
    }
  }
}

void norm_forward(Out out, Out mean, Out rstd, In in, In w, In b, int T, int C, bool rms) {
  constexpr float kEps = 1e-5f;
  for (int t = 0; t < T; ++t) {
    const float* x = in.data() + static_cast<std::size_t>(t) * C;
    float mu = 0;
    if (!rms) {
      for (int c = 0; c < C; ++c) mu += x[c];
      mu /= static_cast<float>(C);
    }
    float var = 0;
    for (int c = 0; c < C; ++c) var += (x[c] - mu) * (x[c] - mu);
    var /= static_cast<float>(C);
    const float r = 1.0f / std::sqrt(var + kEps);
    float* y = out.data() + static_cast<std::size_t>(t) * C;
    for (int c = 0; c < C; ++c) y[c] = (x[c] - mu) * r * w[c] + (b.empty() ? 0.0f : b[c]);
    mean[t] = mu;
    rstd[t] = r;
  }
}

void norm_backward(Out din, Out dw, Out db, In dout, In in, In w, In mean, In rstd, int T, int C,
                   bool rms) {
  for (int t = 0; t < T; ++t) {
    const float* x = in.data() + static_cast<std::size_t>(t) * C;
    const float* dy = dout.data() + static_cast<std::size_t>(t) * C;
    float* dx = din.empty() ? nullptr : din.data() + static_cast<std::size_t>(t) * C;
    const float mu = mean[t], r = rstd[t];
    // xhat = (x - mu) r; dxhat = dy w; dx = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat))
    // (RMSNorm: no mean(dxhat) term).
    float sum_d = 0, sum_dx = 0;
    for (int c = 0; c < C; ++c) {
      const float xhat = (x[c] - mu) * r;
      const float d = dy[c] * w[c];
      sum_d += d;
      sum_dx += d * xhat;
      if (!dw.empty()) dw[c] += dy[c] * xhat;
      if (!db.empty()) db[c] += dy[c];
    }
    if (din.empty()) continue;  // weight gradients only (zero-bubble's W pass)
    const float mean_d = rms ? 0.0f : sum_d / static_cast<float>(C);
    const float mean_dx = sum_dx / static_cast<float>(C);
    for (int c = 0; c < C; ++c) {
      const float xhat = (x[c] - mu) * r;
      dx[c] += r * (dy[c] * w[c] - mean_d - xhat * mean_dx);
    }
  }
}

namespace {
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)

// 0.5·(1 + tanh(u)) is the logistic function of 2u, so GELU is computed as x / (1 + exp(-2u)):
// the same function, but glibc's expf takes about 3 ns an element whatever its input, where
// its tanhf took 11 to 20 ns, faster near 0. With tanhf the kernel's time followed the
// activations' spread as training moved it, by up to 1.6x, so calibrate could not price it.
// Far out exp(-2u) overflows to inf and the quotient is the limit, -0.
float logistic_of_twice(float u) {
  return 1.0f / (1.0f + std::exp(-2.0f * u));
}
}  // namespace

void add_forward(Out out, In a, In b) {
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = a[i] + b[i];
}

void accumulate(Out d, In dout, float scale) {
  for (std::size_t i = 0; i < d.size(); ++i) d[i] += scale * dout[i];
}

void gelu_forward(Out out, In in, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = in[static_cast<std::size_t>(i)];
    out[static_cast<std::size_t>(i)] =
        x * logistic_of_twice(kGeluScale * (x + 0.044715f * x * x * x));
  }
}

void gelu_backward(Out din, In in, In dout, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = in[static_cast<std::size_t>(i)];
    const float u = kGeluScale * (x + 0.044715f * x * x * x);
    // With s = (1 + tanh(u)) / 2: 1 - tanh(u)² = 4·s·(1 - s).
    const float s = logistic_of_twice(u);
    const float du = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    const float grad = s + 2.0f * x * s * (1.0f - s) * du;
    din[static_cast<std::size_t>(i)] = grad * dout[static_cast<std::size_t>(i)];
  }
}

void swiglu_forward(Out out, In in, int T, int F) {
  for (int t = 0; t < T; ++t) {
    const float* g = in.data() + static_cast<std::size_t>(t) * 2 * F;
    const float* u = g + F;
    for (int f = 0; f < F; ++f) {
      const float s = g[f] / (1.0f + std::exp(-g[f]));
      out[static_cast<std::size_t>(t) * F + f] = s * u[f];
    }
  }
}

void swiglu_backward(Out din, In in, In dout, int T, int F) {
  for (int t = 0; t < T; ++t) {
    const float* g = in.data() + static_cast<std::size_t>(t) * 2 * F;
    const float* u = g + F;
    float* dg = din.data() + static_cast<std::size_t>(t) * 2 * F;
    float* du = dg + F;
    for (int f = 0; f < F; ++f) {
      const float sig = 1.0f / (1.0f + std::exp(-g[f]));
      const float silu = g[f] * sig;
      const float dy = dout[static_cast<std::size_t>(t) * F + f];
      du[f] = dy * silu;
      dg[f] = dy * u[f] * (sig + g[f] * sig * (1.0f - sig));
    }
  }
}

bool Dropout::keeps(std::int64_t sequence, std::uint64_t index) const {
  return dropout_keeps(stream, rate, sequence, index);
}

namespace {

int position_of(std::span<const int> positions, int s) {
  return positions.empty() ? s : positions[static_cast<std::size_t>(s)];
}

// Where causal attention finds its queries and its keys and values. Queries: the q columns of
// qkv [B·Sq, (H + G)·D + G·Dv] (Dv: the values' head width, D but where AttentionOptions::v_dim
// says otherwise), query s of a sequence at position qpos[s] (s itself when qpos is empty).
// Keys and values: the S positions of a sequence, from `ranks` blocks of B·(S / ranks) rows
// (rank r's block r-th; one block: qkv itself), key and value head g at columns k_col + g·D
// and v_col + g·Dv of rows `stride` floats apart; the key at position p is row order[p] of
// its sequence's S (p itself when order is empty). Keys are visited in position order, so a
// split over ranks sums in the order of one rank's attention.
struct Attention {
  int B, Sq, S, H, G, D, Dv;
  std::span<const int> qpos, order;
  int ranks;
  std::size_t width, stride, k_col, v_col;  // width: a row of qkv
  const Dropout* dropout;

  Attention(int B_, int Sq_, int H_, int G_, int D_, const AttentionOptions& o)
      : B(B_),
        Sq(Sq_),
        S(Sq_ * o.cp),
        H(H_),
        G(G_),
        D(D_),
        Dv(o.v_dim > 0 ? o.v_dim : D_),
        qpos(o.qpos),
        order(o.order),
        ranks(o.cp),
        dropout(o.dropout) {
    const bool own_keys = o.kv.empty();
    DTSIM_ASSERT(!own_keys || o.cp == 1, "context parallelism reads the keys of every rank");
    width = static_cast<std::size_t>(H + G) * D + static_cast<std::size_t>(G) * Dv;
    stride = own_keys ? width : static_cast<std::size_t>(G) * (D + Dv);
    k_col = own_keys ? static_cast<std::size_t>(H) * D : 0;
    v_col = k_col + static_cast<std::size_t>(G) * D;
  }

  int position(int s) const { return position_of(qpos, s); }
  // The row of sequence b's key at position p.
  std::size_t key_row(int b, int p) const {
    const int j = order.empty() ? p : order[static_cast<std::size_t>(p)];
    if (ranks == 1) return static_cast<std::size_t>(b) * S + j;
    const int per_rank = S / ranks;
    return (static_cast<std::size_t>(j / per_rank) * B + b) * per_rank + j % per_rank;
  }
  std::size_t k_at(int b, int p, int g) const {
    return key_row(b, p) * stride + k_col + static_cast<std::size_t>(g) * D;
  }
  std::size_t v_at(int b, int p, int g) const {
    return key_row(b, p) * stride + v_col + static_cast<std::size_t>(g) * Dv;
  }
  // The index of the probability of (head h, query position q, key position k) in its
  // sequence, for dropout: over all heads, so that tensor-parallel ranks draw their own.
  std::uint64_t element(int h, int q, int k) const {
    return (static_cast<std::uint64_t>(dropout->head_offset + h) * S + q) * S + k;
  }
};

void attend(const Attention& a, Out out, Out probs, In qkv, In kv, const AttentionOptions& o) {
  const auto [B, Sq, S, H, G, D, Dv] = std::array{a.B, a.Sq, a.S, a.H, a.G, a.D, a.Dv};
  const std::size_t width = a.width;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int group = H / G;
  // FlashAttention: a row's probabilities (and what dropout leaves of them) only here.
  const bool flash = !o.lse.empty();
  std::vector<float> row(flash ? static_cast<std::size_t>(S) : 0);
  std::vector<float> row_dropped(flash && a.dropout ? static_cast<std::size_t>(S) : 0);
  for (int b = 0; b < B; ++b) {
    const std::int64_t sequence = a.dropout ? a.dropout->first_sequence + b : 0;
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      for (int i = 0; i < Sq; ++i) {
        const int last = a.position(i);
        const float* q = qkv.data() + (static_cast<std::size_t>(b) * Sq + i) * width + h * D;
        const std::size_t at = ((static_cast<std::size_t>(b) * H + h) * Sq + i) * S;
        float* p = flash ? row.data() : probs.data() + at;
        float maxv = -INFINITY;
        for (int j = 0; j <= last; ++j) {
          const float* k = kv.data() + a.k_at(b, j, g);
          float s = 0;
          for (int d = 0; d < D; ++d) s += q[d] * k[d];
          p[j] = s * scale;
          maxv = std::max(maxv, p[j]);
        }
        float sum = 0;
        for (int j = 0; j <= last; ++j) {
          p[j] = std::exp(p[j] - maxv);
          sum += p[j];
        }
        for (int j = 0; j < S; ++j) p[j] = j <= last ? p[j] / sum : 0.0f;
        if (flash) o.lse[at / static_cast<std::size_t>(S)] = maxv + std::log(sum);
        // Dropout of the probabilities: the values read them after it.
        const float* weights = p;
        if (a.dropout) {
          float* dropped = flash ? row_dropped.data() : o.dropped.data() + at;
          std::uint8_t* mask = flash ? nullptr : o.mask.data() + at;
          const float keep_scale = a.dropout->scale();
          for (int j = 0; j < S; ++j) {
            const bool keep = j <= last && a.dropout->keeps(sequence, a.element(h, last, j));
            if (mask != nullptr) mask[j] = keep ? 1 : 0;
            dropped[j] = keep ? p[j] * keep_scale : 0.0f;
          }
          weights = dropped;
        }
        float* o_row = out.data() + (static_cast<std::size_t>(b) * Sq + i) * H * Dv + h * Dv;
        for (int d = 0; d < Dv; ++d) o_row[d] = 0;
        for (int j = 0; j <= last; ++j) {
          const float* v = kv.data() + a.v_at(b, j, g);
          for (int d = 0; d < Dv; ++d) o_row[d] += weights[j] * v[d];
        }
      }
    }
  }
}

// dq into the q columns of dqkv; dk, dv into dkv at the places attend() read k and v.
void attend_backward(const Attention& a, Out dqkv, Out dkv, In dout, In qkv, In kv, In probs,
                     const AttentionOptions& o) {
  const auto [B, Sq, S, H, G, D, Dv] = std::array{a.B, a.Sq, a.S, a.H, a.G, a.D, a.Dv};
  const std::size_t width = a.width;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int group = H / G;
  const float keep_scale = a.dropout ? a.dropout->scale() : 1.0f;
  const bool flash = !o.lse.empty();
  std::vector<float> dp(static_cast<std::size_t>(S));
  std::vector<float> recomputed(flash ? static_cast<std::size_t>(S) : 0);
  for (int b = 0; b < B; ++b) {
    const std::int64_t sequence = a.dropout ? a.dropout->first_sequence + b : 0;
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      for (int i = 0; i < Sq; ++i) {
        const int last = a.position(i);
        const std::size_t row = static_cast<std::size_t>(b) * Sq + i;
        const std::size_t at = ((static_cast<std::size_t>(b) * H + h) * Sq + i) * S;
        const float* q = qkv.data() + row * width + h * D;
        const float* p = flash ? recomputed.data() : probs.data() + at;
        if (flash) {
          // FlashAttention's backward: the scores again, the probabilities from the row's
          // log-sum-exp.
          const float lse = o.lse[at / static_cast<std::size_t>(S)];
          for (int j = 0; j <= last; ++j) {
            const float* k = kv.data() + a.k_at(b, j, g);
            float s = 0;
            for (int d = 0; d < D; ++d) s += q[d] * k[d];
            recomputed[static_cast<std::size_t>(j)] = std::exp(s * scale - lse);
          }
        }
        // What the values read: the probabilities after dropout, if any (FlashAttention: the
        // mask drawn again).
        const float* dropped = a.dropout && !flash ? o.dropped.data() + at : nullptr;
        const std::uint8_t* mask = a.dropout && !flash ? o.mask.data() + at : nullptr;
        const auto kept = [&](int j) {
          return mask != nullptr ? mask[j] != 0 : a.dropout->keeps(sequence, a.element(h, last, j));
        };
        const float* dy = dout.data() + row * H * Dv + h * Dv;
        // dP = dy · v^T (through dropout: masked and scaled); dv += P^T · dy
        float dot = 0;
        for (int j = 0; j <= last; ++j) {
          const float* v = kv.data() + a.v_at(b, j, g);
          float* dv = dkv.data() + a.v_at(b, j, g);
          const bool keep = a.dropout == nullptr || kept(j);
          const float weight = a.dropout == nullptr ? p[j]
                               : dropped != nullptr ? dropped[j]
                               : keep               ? p[j] * keep_scale
                                                    : 0.0f;
          float s = 0;
          for (int d = 0; d < Dv; ++d) {
            s += dy[d] * v[d];
            dv[d] += weight * dy[d];
          }
          if (a.dropout) s = keep ? s * keep_scale : 0.0f;
          dp[static_cast<std::size_t>(j)] = s;
          dot += s * p[j];
        }
        // Softmax backward: dS = P ⊙ (dP - sum(dP ⊙ P)); then through the scaled q·k.
        float* dq = dqkv.data() + row * width + h * D;
        for (int j = 0; j <= last; ++j) {
          const float ds = p[j] * (dp[static_cast<std::size_t>(j)] - dot) * scale;
          const float* k = kv.data() + a.k_at(b, j, g);
          float* dk = dkv.data() + a.k_at(b, j, g);
          for (int d = 0; d < D; ++d) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
          }
        }
      }
    }
  }
}

}  // namespace

void attention_forward(Out out, Out probs, In qkv, int B, int S, int H, int G, int D) {
  attention_forward(out, probs, qkv, B, S, H, G, D, AttentionOptions{});
}

void attention_backward(Out dqkv, In dout, In qkv, In probs, int B, int S, int H, int G, int D) {
  attention_backward(dqkv, dqkv, dout, qkv, probs, B, S, H, G, D, AttentionOptions{});
}

void attention_forward(Out out, Out probs, In qkv, int B, int Sq, int H, int G, int D,
                       const AttentionOptions& o) {
  attend(Attention(B, Sq, H, G, D, o), out, probs, qkv, o.kv.empty() ? qkv : o.kv, o);
}

void attention_backward(Out dqkv, Out dkv, In dout, In qkv, In probs, int B, int Sq, int H, int G,
                        int D, const AttentionOptions& o) {
  attend_backward(Attention(B, Sq, H, G, D, o), dqkv, dkv, dout, qkv, o.kv.empty() ? qkv : o.kv,
                  probs, o);
}

namespace {

// Row r of a residual-stream tensor: its sequence (of the micro-batch) and position.
std::pair<int, int> row_place(const Dropout& d, int r) {
  const int row = d.first_row + r;
  return {row / d.Sq, position_of(d.positions, row % d.Sq)};
}

}  // namespace

void dropout_forward(Out out, std::span<std::uint8_t> mask, In in, const Dropout& d, int T, int C) {
  const float keep_scale = d.scale();
  for (int r = 0; r < T; ++r) {
    const auto [b, position] = row_place(d, r);
    for (int c = 0; c < C; ++c) {
      const std::size_t i = static_cast<std::size_t>(r) * C + c;
      const bool keep = d.keeps(d.first_sequence + b, static_cast<std::uint64_t>(position) * C + c);
      mask[i] = keep ? 1 : 0;
      out[i] = keep ? in[i] * keep_scale : 0.0f;
    }
  }
}

void dropout_add_forward(Out out, std::span<std::uint8_t> mask, In branch, In skip,
                         const Dropout& d, int T, int C) {
  dropout_forward(out, mask, branch, d, T, C);
  for (std::size_t i = 0; i < static_cast<std::size_t>(T) * C; ++i) out[i] += skip[i];
}

void dropout_backward(Out din, std::span<const std::uint8_t> mask, In dout, float rate) {
  const float keep_scale = 1.0f / (1.0f - rate);
  for (std::size_t i = 0; i < din.size(); ++i) {
    if (mask[i]) din[i] += dout[i] * keep_scale;
  }
}

namespace {

// What a sum of sigmoid scores starts from (DeepSeek-V3's and GLM-4.5's routers' 1e-20).
constexpr double kSigmoidFloor = 1e-20;

// A router logit's sigmoid score, in double (as the softmax's exponentials).
double sigmoid_of(float logit) {
  return 1.0 / (1.0 + std::exp(-static_cast<double>(logit)));
}

}  // namespace

void moe_route(std::span<int> experts, Out gates, In logits, int T, int E, int k,
               const Gating& gating) {
  const bool normalize = gating.normalize;
  std::vector<int> best(static_cast<std::size_t>(E));
  for (int t = 0; t < T; ++t) {
    const float* l = logits.data() + static_cast<std::size_t>(t) * E;
    for (int e = 0; e < E; ++e) best[static_cast<std::size_t>(e)] = e;
    std::partial_sort(best.begin(), best.begin() + k, best.end(),
                      [l](int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    if (gating.sigmoid) {
      // Each chosen logit's sigmoid (the order of the logits), over their sum or not (plus
      // 1e-20, as DeepSeek-V3's and GLM-4.5's routers add: logits below -745 have 0).
      double sum = kSigmoidFloor;
      for (int j = 0; j < k; ++j) sum += sigmoid_of(l[best[static_cast<std::size_t>(j)]]);
      for (int j = 0; j < k; ++j) {
        const std::size_t slot = static_cast<std::size_t>(t) * k + j;
        const double s = sigmoid_of(l[best[static_cast<std::size_t>(j)]]);
        experts[slot] = best[static_cast<std::size_t>(j)];
        gates[slot] = static_cast<float>(gating.scale * (normalize ? s / sum : s));
      }
      continue;
    }
    const float top = l[best[0]];
    double sum = 0;
    for (int j = 0; j < (normalize ? k : E); ++j) {
      sum +=
          std::exp(static_cast<double>(l[normalize ? best[static_cast<std::size_t>(j)] : j] - top));
    }
    for (int j = 0; j < k; ++j) {
      const std::size_t slot = static_cast<std::size_t>(t) * k + j;
      experts[slot] = best[static_cast<std::size_t>(j)];
      const double p = std::exp(static_cast<double>(l[best[j]] - top)) / sum;
      gates[slot] = static_cast<float>(gating.scale == 1.0f ? p : gating.scale * p);
    }
  }
}

void moe_route_backward(Out dlogits, In dgates, In gates, std::span<const int> experts, In logits,
                        int T, int E, int k, const Gating& gating) {
  // One expert a token, its gate normalized over the k: a constant (the scale), no gradient
  // (none computed: a rounding residue would move the router).
  if (gating.normalize && k == 1) return;
  for (int t = 0; t < T; ++t) {
    const std::size_t first = static_cast<std::size_t>(t) * k;
    float dot = 0;
    for (int j = 0; j < k; ++j) dot += gates[first + j] * dgates[first + j];
    float* dl = dlogits.data() + static_cast<std::size_t>(t) * E;
    // Sigmoid scores s of the chosen, g_j = c s_j / S (S = Σ_i s_i over them) or c s_j:
    // dL/ds_j = (c dg_j − Σ_i g_i dg_i) / S, or c dg_j; and ds/dl = s (1 − s). The others'
    // logits get none.
    if (gating.sigmoid) {
      const float* l = logits.data() + static_cast<std::size_t>(t) * E;
      double sum = kSigmoidFloor;
      for (int j = 0; j < k; ++j) sum += sigmoid_of(l[experts[first + j]]);
      for (int j = 0; j < k; ++j) {
        const int e = experts[first + j];
        const double s = sigmoid_of(l[e]);
        const double ds = gating.normalize
                              ? (gating.scale * static_cast<double>(dgates[first + j]) - dot) / sum
                              : gating.scale * static_cast<double>(dgates[first + j]);
        dl[e] += static_cast<float>(ds * s * (1.0 - s));
      }
      continue;
    }
    // g = c softmax(l) restricted to the chosen: dg_i/dl_e = g_i (δ_ie − p_e), so dl_e gains
    // p_e (dg_e [e chosen] c − Σ_i g_i dg_i); over the k alone p is the gates over c.
    if (!logits.empty()) {
      const float* l = logits.data() + static_cast<std::size_t>(t) * E;
      const float top = *std::max_element(l, l + E);
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += std::exp(static_cast<double>(l[e] - top));
      for (int e = 0; e < E; ++e) {
        dl[e] -= static_cast<float>(std::exp(static_cast<double>(l[e] - top)) / sum) * dot;
      }
      for (int j = 0; j < k; ++j) dl[experts[first + j]] += gates[first + j] * dgates[first + j];
      continue;
    }
    const float per_gate = gating.scale == 1.0f ? dot : dot / gating.scale;
    for (int j = 0; j < k; ++j) {
      dl[experts[first + j]] += gates[first + j] * (dgates[first + j] - per_gate);
    }
  }
}

void moe_dispatch(Out dispatched, std::span<int> order, std::span<int> rows, In x,
                  std::span<const int> experts, int T, int C, int k, int E) {
  std::fill(rows.begin(), rows.end(), 0);
  const std::size_t slots = static_cast<std::size_t>(T) * k;
  for (std::size_t i = 0; i < slots; ++i) ++rows[static_cast<std::size_t>(experts[i])];
  std::vector<int> next(static_cast<std::size_t>(E), 0);
  for (int e = 1; e < E; ++e) {
    next[static_cast<std::size_t>(e)] = next[e - 1] + rows[static_cast<std::size_t>(e - 1)];
  }
  for (std::size_t i = 0; i < slots; ++i) {
    const int p = next[static_cast<std::size_t>(experts[i])]++;
    order[static_cast<std::size_t>(p)] = static_cast<int>(i);
    std::copy_n(x.data() + (i / k) * C, C, dispatched.data() + static_cast<std::size_t>(p) * C);
  }
}

void moe_dispatch_backward(Out dx, In ddispatched, std::span<const int> order, int T, int C,
                           int k) {
  const std::size_t slots = static_cast<std::size_t>(T) * k;
  for (std::size_t p = 0; p < slots; ++p) {
    float* d = dx.data() + static_cast<std::size_t>(order[p] / k) * C;
    const float* g = ddispatched.data() + p * C;
    for (int c = 0; c < C; ++c) d[c] += g[c];
  }
}

void moe_combine(Out out, In y, In gates, std::span<const int> order, int T, int C, int k) {
  std::fill(out.begin(), out.end(), 0.0f);
  const std::size_t slots = static_cast<std::size_t>(T) * k;
  for (std::size_t p = 0; p < slots; ++p) {
    const auto slot = static_cast<std::size_t>(order[p]);
    float* o = out.data() + (slot / k) * C;
    const float* row = y.data() + p * C;
    for (int c = 0; c < C; ++c) o[c] += gates[slot] * row[c];
  }
}

void moe_combine_backward(Out dy, Out dgates, In dout, In y, In gates, std::span<const int> order,
                          int T, int C, int k) {
  const std::size_t slots = static_cast<std::size_t>(T) * k;
  for (std::size_t p = 0; p < slots; ++p) {
    const auto slot = static_cast<std::size_t>(order[p]);
    const float* d = dout.data() + (slot / k) * C;
    const float* row = y.data() + p * C;
    float* out = dy.data() + p * C;
    float dot = 0;
    for (int c = 0; c < C; ++c) {
      out[c] = gates[slot] * d[c];
      dot += d[c] * row[c];
    }
    dgates[slot] += dot;
  }
}

void copy_columns(Out dst, In src, int T, int src_width, int begin, int width) {
  for (int t = 0; t < T; ++t) {
    std::copy_n(src.data() + static_cast<std::size_t>(t) * src_width + begin, width,
                dst.data() + static_cast<std::size_t>(t) * width);
  }
}

void add_columns(Out dst, In src, int T, int dst_width, int begin, int width) {
  for (int t = 0; t < T; ++t) {
    float* d = dst.data() + static_cast<std::size_t>(t) * dst_width + begin;
    const float* x = src.data() + static_cast<std::size_t>(t) * width;
    for (int c = 0; c < width; ++c) d[c] += x[c];
  }
}

namespace {
// Turns the q and k heads of one row by the angles of position s; sign -1 turns back. Head h's
// D turned columns start at h·stride (stride 0: D, heads side by side).
void rotate_row(float* out, const float* in, int s, int heads, int D, double theta, float sign,
                int stride = 0) {
  const int half = D / 2;
  const auto step = static_cast<std::size_t>(stride > 0 ? stride : D);
  for (int i = 0; i < half; ++i) {
    const double angle = s * std::pow(theta, -2.0 * i / D);
    const auto c = static_cast<float>(std::cos(angle));
    const auto sn = sign * static_cast<float>(std::sin(angle));
    for (int h = 0; h < heads; ++h) {
      const float* x = in + static_cast<std::size_t>(h) * step;
      float* y = out + static_cast<std::size_t>(h) * step;
      const float a = x[i], b = x[i + half];
      y[i] = a * c - b * sn;
      y[i + half] = a * sn + b * c;
    }
  }
}
}  // namespace

void rope_forward(Out out, In qkv, int B, int S, int H, int G, int D, double theta,
                  std::span<const int> positions) {
  const std::size_t width = static_cast<std::size_t>(H + 2 * G) * D;
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = (static_cast<std::size_t>(b) * S + s) * width;
      rotate_row(out.data() + row, qkv.data() + row, position_of(positions, s), H + G, D, theta,
                 1.0f);  // q and k
      std::copy_n(qkv.data() + row + static_cast<std::size_t>(H + G) * D,
                  static_cast<std::size_t>(G) * D,
                  out.data() + row + static_cast<std::size_t>(H + G) * D);  // v
    }
  }
}

void rope_backward(Out dqkv, In dout, int B, int S, int H, int G, int D, double theta,
                   std::span<const int> positions) {
  const std::size_t width = static_cast<std::size_t>(H + 2 * G) * D;
  std::vector<float> turned(static_cast<std::size_t>(H + G) * D);
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = (static_cast<std::size_t>(b) * S + s) * width;
      rotate_row(turned.data(), dout.data() + row, position_of(positions, s), H + G, D, theta,
                 -1.0f);
      for (std::size_t i = 0; i < turned.size(); ++i) dqkv[row + i] += turned[i];
      for (std::size_t i = turned.size(); i < width; ++i) dqkv[row + i] += dout[row + i];
    }
  }
}

void mla_pack_forward(Out qkv, In q, In kv, In k_rope, int B, int S, int H, int Dn, int Dr, int Dv,
                      double theta, std::span<const int> positions) {
  const int Dqk = Dn + Dr;
  const auto heads = static_cast<std::size_t>(H);
  const std::size_t q_width = heads * Dqk, kv_width = heads * (Dn + Dv);
  const std::size_t width = 2 * q_width + heads * Dv;
  std::vector<float> turned(static_cast<std::size_t>(Dr));
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t t = static_cast<std::size_t>(b) * S + s;
      const int position = position_of(positions, s);
      const float* qr = q.empty() ? nullptr : q.data() + t * q_width;
      const float* kvr = kv.data() + t * kv_width;
      float* out = qkv.data() + t * width;
      rotate_row(turned.data(), k_rope.data() + t * Dr, position, 1, Dr, theta, 1.0f);
      for (std::size_t h = 0; h < heads; ++h) {
        if (qr != nullptr) std::copy_n(qr + h * Dqk, Dn, out + h * Dqk);
        std::copy_n(kvr + h * (Dn + Dv), Dn, out + q_width + h * Dqk);
        std::copy(turned.begin(), turned.end(), out + q_width + h * Dqk + Dn);
        std::copy_n(kvr + h * (Dn + Dv) + Dn, Dv, out + 2 * q_width + h * Dv);
      }
      if (qr != nullptr) rotate_row(out + Dn, qr + Dn, position, H, Dr, theta, 1.0f, Dqk);
    }
  }
}

void mla_pack_backward(Out dq, Out dkv, Out dk_rope, In dqkv, int B, int S, int H, int Dn, int Dr,
                       int Dv, double theta, std::span<const int> positions) {
  const int Dqk = Dn + Dr;
  const auto heads = static_cast<std::size_t>(H);
  const std::size_t q_width = heads * Dqk, kv_width = heads * (Dn + Dv);
  const std::size_t width = 2 * q_width + heads * Dv;
  std::vector<float> summed(static_cast<std::size_t>(Dr)), turned(q_width);
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t t = static_cast<std::size_t>(b) * S + s;
      const int position = position_of(positions, s);
      const float* g = dqkv.data() + t * width;
      float* dqr = dq.empty() ? nullptr : dq.data() + t * q_width;
      float* dkvr = dkv.data() + t * kv_width;
      std::fill(summed.begin(), summed.end(), 0.0f);
      if (dqr != nullptr)
        rotate_row(turned.data() + Dn, g + Dn, position, H, Dr, theta, -1.0f, Dqk);
      for (std::size_t h = 0; h < heads; ++h) {
        for (int d = 0; d < Dn; ++d) {
          if (dqr != nullptr) dqr[h * Dqk + d] += g[h * Dqk + d];
          dkvr[h * (Dn + Dv) + d] += g[q_width + h * Dqk + d];
        }
        for (int d = 0; d < Dr; ++d) {
          if (dqr != nullptr) dqr[h * Dqk + Dn + d] += turned[h * Dqk + Dn + d];
          summed[static_cast<std::size_t>(d)] += g[q_width + h * Dqk + Dn + d];
        }
        for (int d = 0; d < Dv; ++d) dkvr[h * (Dn + Dv) + Dn + d] += g[2 * q_width + h * Dv + d];
      }
      rotate_row(turned.data(), summed.data(), position, 1, Dr, theta, -1.0f);
      for (int d = 0; d < Dr; ++d) dk_rope[t * Dr + d] += turned[static_cast<std::size_t>(d)];
    }
  }
}

void embedding_forward(Out out, std::span<const int> tokens, In wte, In wpe, int B, int S, int C,
                       int vocab_begin, std::span<const int> positions) {
  const auto rows = static_cast<int>(wte.size() / static_cast<std::size_t>(C));
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = static_cast<std::size_t>(b) * S + s;
      const int local = tokens[row] - vocab_begin;
      const float* e =
          local >= 0 && local < rows ? wte.data() + static_cast<std::size_t>(local) * C : nullptr;
      float* y = out.data() + row * C;
      const auto pos = static_cast<std::size_t>(position_of(positions, s));
      // The row (zeros for another shard's token), then its position: loops without a branch.
      if (e) {
        std::copy_n(e, C, y);
      } else {
        std::fill_n(y, C, 0.0f);
      }
      if (!wpe.empty()) {
        const float* p = wpe.data() + pos * C;
        for (int c = 0; c < C; ++c) y[c] += p[c];
      }
    }
  }
}

void embedding_backward(Out dwte, Out dwpe, In dout, std::span<const int> tokens, int B, int S,
                        int C, int vocab_begin, std::span<const int> positions) {
  const auto rows = static_cast<int>(dwte.size() / static_cast<std::size_t>(C));
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = static_cast<std::size_t>(b) * S + s;
      const float* dy = dout.data() + row * C;
      const auto pos = static_cast<std::size_t>(position_of(positions, s));
      const int local = tokens[row] - vocab_begin;
      float* de =
          local >= 0 && local < rows ? dwte.data() + static_cast<std::size_t>(local) * C : nullptr;
      // Loops without a branch; each element still sums the tokens in their order.
      if (de) {
        for (int c = 0; c < C; ++c) de[c] += dy[c];
      }
      if (!dwpe.empty()) {
        float* dp = dwpe.data() + pos * C;
        for (int c = 0; c < C; ++c) dp[c] += dy[c];
      }
    }
  }
}

void cross_entropy_max(Out rowmax, In logits, int T, int V) {
  for (int t = 0; t < T; ++t) {
    const float* z = logits.data() + static_cast<std::size_t>(t) * V;
    rowmax[static_cast<std::size_t>(t)] = *std::max_element(z, z + V);
  }
}

void cross_entropy_sums(Out sums, In logits, In rowmax, std::span<const int> targets, int T, int V,
                        int vocab_begin) {
  for (int t = 0; t < T; ++t) {
    const float* z = logits.data() + static_cast<std::size_t>(t) * V;
    const auto k = static_cast<std::size_t>(t);
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(z[v] - rowmax[k]));
    sums[k] = static_cast<float>(sum);
    const int y = targets[k] - vocab_begin;
    sums[static_cast<std::size_t>(T) + k] = y >= 0 && y < V ? z[y] : 0.0f;
  }
}

void cross_entropy_rescale(Out sums, In local_max, In global_max, int T) {
  for (std::size_t t = 0; t < static_cast<std::size_t>(T); ++t) {
    sums[t] = static_cast<float>(static_cast<double>(sums[t]) *
                                 std::exp(static_cast<double>(local_max[t] - global_max[t])));
  }
}

double cross_entropy_sharded(Out dlogits, In logits, In rowmax, In sums,
                             std::span<const int> targets, int T, int V, int vocab_begin) {
  double loss = 0;
  for (int t = 0; t < T; ++t) {
    const auto k = static_cast<std::size_t>(t);
    const float* z = logits.data() + k * V;
    float* dz = dlogits.data() + k * V;
    const double sum = sums[k];
    loss += std::log(sum) - static_cast<double>(sums[static_cast<std::size_t>(T) + k] - rowmax[k]);
    const int y = targets[k] - vocab_begin;
    for (int v = 0; v < V; ++v) {
      const double p = std::exp(static_cast<double>(z[v] - rowmax[k])) / sum;
      dz[v] = static_cast<float>((p - (v == y ? 1.0 : 0.0)) / T);
    }
  }
  return loss / T;
}

double sum_squares(In x, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = x[static_cast<std::size_t>(i)];
    s += v * v;
  }
  return s;
}

void clip_scale(Out x, std::int64_t n, double norm, float max_norm) {
  // Megatron-LM's coefficient: max_norm / (total_norm + 1e-6), applied when below 1.
  const double coeff = static_cast<double>(max_norm) / (norm + 1e-6);
  if (!(coeff < 1.0)) return;
  const auto c = static_cast<float>(coeff);
  for (std::int64_t i = 0; i < n; ++i) x[static_cast<std::size_t>(i)] *= c;
}

void adamw(Out params, In grads, Out m, Out v, std::int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, int t) {
  const float c1 = 1.0f - std::pow(beta1, static_cast<float>(t));
  const float c2 = 1.0f - std::pow(beta2, static_cast<float>(t));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    m[k] = beta1 * m[k] + (1 - beta1) * grads[k];
    v[k] = beta2 * v[k] + (1 - beta2) * grads[k] * grads[k];
    const float mhat = m[k] / c1, vhat = v[k] / c2;
    params[k] -= lr * (mhat / (std::sqrt(vhat) + eps) + weight_decay * params[k]);
  }
}

}  // namespace dtsim::exec::cpu
