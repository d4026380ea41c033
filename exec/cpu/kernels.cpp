#include "exec/cpu/kernels.hpp"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

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

void matmul_backward(Out din, Out dw, Out dbias, In dout, In in, In w, int T, int K, int N,
                     bool w_transposed) {
  if (!din.empty()) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, w_transposed ? CblasNoTrans : CblasTrans, T, K, N,
                1.0f, dout.data(), N, w.data(), w_transposed ? K : N, 1.0f, din.data(), K);
  }
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
}

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
        0.5f * x * (1.0f + std::tanh(kGeluScale * (x + 0.044715f * x * x * x)));
  }
}

void gelu_backward(Out din, In in, In dout, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float x = in[static_cast<std::size_t>(i)];
    const float u = kGeluScale * (x + 0.044715f * x * x * x);
    const float th = std::tanh(u);
    const float du = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    const float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    din[static_cast<std::size_t>(i)] += grad * dout[static_cast<std::size_t>(i)];
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
      du[f] += dy * silu;
      dg[f] += dy * u[f] * (sig + g[f] * sig * (1.0f - sig));
    }
  }
}

namespace {

// Where causal attention finds its queries and its keys and values. Queries: the q columns of
// qkv [B·Sq, (H + 2·G)·D], query s of a sequence at position qpos[s] (s itself when qpos is
// empty). Keys and values: the S positions of a sequence, from `ranks` blocks of B·(S / ranks)
// rows (rank r's block r-th; one block: qkv itself), key and value head g at columns k_col +
// g·D and v_col + g·D of rows `stride` floats apart; the key at position p is row order[p] of
// its sequence's S (p itself when order is empty). Keys are visited in position order, so a
// split over ranks sums in the order of one rank's attention.
struct Attention {
  int B, Sq, S, H, G, D;
  std::span<const int> qpos, order;
  int ranks;
  std::size_t stride, k_col, v_col;

  int position(int s) const { return qpos.empty() ? s : qpos[static_cast<std::size_t>(s)]; }
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
    return key_row(b, p) * stride + v_col + static_cast<std::size_t>(g) * D;
  }
};

Attention one_rank(int B, int S, int H, int G, int D) {
  const auto width = static_cast<std::size_t>(H + 2 * G) * D;
  return {B,
          S,
          S,
          H,
          G,
          D,
          {},
          {},
          1,
          width,
          static_cast<std::size_t>(H) * D,
          static_cast<std::size_t>(H + G) * D};
}

Attention context_parallel(int B, int Sq, int cp, int H, int G, int D, std::span<const int> qpos,
                           std::span<const int> order) {
  return {B,       Sq,
          Sq * cp, H,
          G,       D,
          qpos,    order,
          cp,      static_cast<std::size_t>(2 * G) * D,
          0,       static_cast<std::size_t>(G) * D};
}

void attend(const Attention& a, Out out, Out probs, In qkv, In kv) {
  const auto [B, Sq, S, H, G, D] = std::array{a.B, a.Sq, a.S, a.H, a.G, a.D};
  const std::size_t width = static_cast<std::size_t>(H + 2 * G) * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int group = H / G;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      for (int i = 0; i < Sq; ++i) {
        const int last = a.position(i);
        const float* q = qkv.data() + (static_cast<std::size_t>(b) * Sq + i) * width + h * D;
        float* p = probs.data() + ((static_cast<std::size_t>(b) * H + h) * Sq + i) * S;
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
        float* o = out.data() + (static_cast<std::size_t>(b) * Sq + i) * H * D + h * D;
        for (int d = 0; d < D; ++d) o[d] = 0;
        for (int j = 0; j <= last; ++j) {
          const float* v = kv.data() + a.v_at(b, j, g);
          for (int d = 0; d < D; ++d) o[d] += p[j] * v[d];
        }
      }
    }
  }
}

// dq into the q columns of dqkv; dk, dv into dkv at the places attend() read k and v.
void attend_backward(const Attention& a, Out dqkv, Out dkv, In dout, In qkv, In kv, In probs) {
  const auto [B, Sq, S, H, G, D] = std::array{a.B, a.Sq, a.S, a.H, a.G, a.D};
  const std::size_t width = static_cast<std::size_t>(H + 2 * G) * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int group = H / G;
  std::vector<float> dp(static_cast<std::size_t>(S));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int g = h / group;
      for (int i = 0; i < Sq; ++i) {
        const int last = a.position(i);
        const std::size_t row = static_cast<std::size_t>(b) * Sq + i;
        const float* p = probs.data() + ((static_cast<std::size_t>(b) * H + h) * Sq + i) * S;
        const float* dy = dout.data() + row * H * D + h * D;
        // dP = dy · v^T; dv += P^T · dy
        float dot = 0;
        for (int j = 0; j <= last; ++j) {
          const float* v = kv.data() + a.v_at(b, j, g);
          float* dv = dkv.data() + a.v_at(b, j, g);
          float s = 0;
          for (int d = 0; d < D; ++d) {
            s += dy[d] * v[d];
            dv[d] += p[j] * dy[d];
          }
          dp[static_cast<std::size_t>(j)] = s;
          dot += s * p[j];
        }
        // Softmax backward: dS = P ⊙ (dP - sum(dP ⊙ P)); then through the scaled q·k.
        const float* q = qkv.data() + row * width + h * D;
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
  attend(one_rank(B, S, H, G, D), out, probs, qkv, qkv);
}

void attention_backward(Out dqkv, In dout, In qkv, In probs, int B, int S, int H, int G, int D) {
  attend_backward(one_rank(B, S, H, G, D), dqkv, dqkv, dout, qkv, qkv, probs);
}

void attention_forward_cp(Out out, Out probs, In qkv, In kv, std::span<const int> qpos,
                          std::span<const int> order, int B, int Sq, int cp, int H, int G, int D) {
  attend(context_parallel(B, Sq, cp, H, G, D, qpos, order), out, probs, qkv, kv);
}

void attention_backward_cp(Out dqkv, Out dkv, In dout, In qkv, In kv, In probs,
                           std::span<const int> qpos, std::span<const int> order, int B, int Sq,
                           int cp, int H, int G, int D) {
  attend_backward(context_parallel(B, Sq, cp, H, G, D, qpos, order), dqkv, dkv, dout, qkv, kv,
                  probs);
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
int position_of(std::span<const int> positions, int s) {
  return positions.empty() ? s : positions[static_cast<std::size_t>(s)];
}

// Turns the q and k heads of one row by the angles of position s; sign -1 turns back.
void rotate_row(float* out, const float* in, int s, int heads, int D, double theta, float sign) {
  const int half = D / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = s * std::pow(theta, -2.0 * i / D);
    const auto c = static_cast<float>(std::cos(angle));
    const auto sn = sign * static_cast<float>(std::sin(angle));
    for (int h = 0; h < heads; ++h) {
      const float* x = in + static_cast<std::size_t>(h) * D;
      float* y = out + static_cast<std::size_t>(h) * D;
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
      for (int c = 0; c < C; ++c) {
        y[c] = (e ? e[c] : 0.0f) + (wpe.empty() ? 0.0f : wpe[pos * C + c]);
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
      for (int c = 0; c < C; ++c) {
        if (de) de[c] += dy[c];
        if (!dwpe.empty()) dwpe[pos * C + c] += dy[c];
      }
    }
  }
}

double cross_entropy(Out dlogits, In logits, std::span<const int> targets, int T, int V) {
  double loss = 0;
  for (int t = 0; t < T; ++t) {
    const float* z = logits.data() + static_cast<std::size_t>(t) * V;
    float* dz = dlogits.data() + static_cast<std::size_t>(t) * V;
    const float maxv = *std::max_element(z, z + V);
    double sum = 0;
    for (int v = 0; v < V; ++v) sum += std::exp(static_cast<double>(z[v] - maxv));
    const int y = targets[static_cast<std::size_t>(t)];
    loss += std::log(sum) - static_cast<double>(z[y] - maxv);
    for (int v = 0; v < V; ++v) {
      const double p = std::exp(static_cast<double>(z[v] - maxv)) / sum;
      dz[v] = static_cast<float>((p - (v == y ? 1.0 : 0.0)) / T);
    }
  }
  return loss / T;
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
