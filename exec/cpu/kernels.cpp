#include "exec/cpu/kernels.hpp"

#include <cblas.h>

#include <algorithm>
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

void attention_forward(Out out, Out probs, In qkv, int B, int S, int H, int G, int D) {
  const int width = (H + 2 * G) * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int group = H / G;
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int kv = h / group;
      for (int i = 0; i < S; ++i) {
        const float* q = qkv.data() + (static_cast<std::size_t>(b) * S + i) * width + h * D;
        float* p = probs.data() + ((static_cast<std::size_t>(b) * H + h) * S + i) * S;
        float maxv = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const float* k =
              qkv.data() + (static_cast<std::size_t>(b) * S + j) * width + (H + kv) * D;
          float s = 0;
          for (int d = 0; d < D; ++d) s += q[d] * k[d];
          p[j] = s * scale;
          maxv = std::max(maxv, p[j]);
        }
        float sum = 0;
        for (int j = 0; j <= i; ++j) {
          p[j] = std::exp(p[j] - maxv);
          sum += p[j];
        }
        for (int j = 0; j < S; ++j) p[j] = j <= i ? p[j] / sum : 0.0f;
        float* o = out.data() + (static_cast<std::size_t>(b) * S + i) * H * D + h * D;
        for (int d = 0; d < D; ++d) o[d] = 0;
        for (int j = 0; j <= i; ++j) {
          const float* v =
              qkv.data() + (static_cast<std::size_t>(b) * S + j) * width + (H + G + kv) * D;
          for (int d = 0; d < D; ++d) o[d] += p[j] * v[d];
        }
      }
    }
  }
}

void attention_backward(Out dqkv, In dout, In qkv, In probs, int B, int S, int H, int G, int D) {
  const int width = (H + 2 * G) * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const int group = H / G;
  std::vector<float> dp(static_cast<std::size_t>(S));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const int kv = h / group;
      for (int i = 0; i < S; ++i) {
        const std::size_t row = static_cast<std::size_t>(b) * S + i;
        const float* p = probs.data() + ((static_cast<std::size_t>(b) * H + h) * S + i) * S;
        const float* dy = dout.data() + row * H * D + h * D;
        // dP = dy · v^T; dv += P^T · dy
        float dot = 0;
        for (int j = 0; j <= i; ++j) {
          const std::size_t rj = static_cast<std::size_t>(b) * S + j;
          const float* v = qkv.data() + rj * width + (H + G + kv) * D;
          float* dv = dqkv.data() + rj * width + (H + G + kv) * D;
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
        for (int j = 0; j <= i; ++j) {
          const float ds = p[j] * (dp[static_cast<std::size_t>(j)] - dot) * scale;
          const std::size_t rj = static_cast<std::size_t>(b) * S + j;
          const float* k = qkv.data() + rj * width + (H + kv) * D;
          float* dk = dqkv.data() + rj * width + (H + kv) * D;
          for (int d = 0; d < D; ++d) {
            dq[d] += ds * k[d];
            dk[d] += ds * q[d];
          }
        }
      }
    }
  }
}

namespace {
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

void rope_forward(Out out, In qkv, int B, int S, int H, int G, int D, double theta) {
  const std::size_t width = static_cast<std::size_t>(H + 2 * G) * D;
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = (static_cast<std::size_t>(b) * S + s) * width;
      rotate_row(out.data() + row, qkv.data() + row, s, H + G, D, theta, 1.0f);  // q and k
      std::copy_n(qkv.data() + row + static_cast<std::size_t>(H + G) * D,
                  static_cast<std::size_t>(G) * D,
                  out.data() + row + static_cast<std::size_t>(H + G) * D);  // v
    }
  }
}

void rope_backward(Out dqkv, In dout, int B, int S, int H, int G, int D, double theta) {
  const std::size_t width = static_cast<std::size_t>(H + 2 * G) * D;
  std::vector<float> turned(static_cast<std::size_t>(H + G) * D);
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = (static_cast<std::size_t>(b) * S + s) * width;
      rotate_row(turned.data(), dout.data() + row, s, H + G, D, theta, -1.0f);
      for (std::size_t i = 0; i < turned.size(); ++i) dqkv[row + i] += turned[i];
      for (std::size_t i = turned.size(); i < width; ++i) dqkv[row + i] += dout[row + i];
    }
  }
}

void embedding_forward(Out out, std::span<const int> tokens, In wte, In wpe, int B, int S, int C,
                       int vocab_begin) {
  const auto rows = static_cast<int>(wte.size() / static_cast<std::size_t>(C));
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = static_cast<std::size_t>(b) * S + s;
      const int local = tokens[row] - vocab_begin;
      const float* e =
          local >= 0 && local < rows ? wte.data() + static_cast<std::size_t>(local) * C : nullptr;
      float* y = out.data() + row * C;
      for (int c = 0; c < C; ++c) {
        y[c] = (e ? e[c] : 0.0f) + (wpe.empty() ? 0.0f : wpe[static_cast<std::size_t>(s) * C + c]);
      }
    }
  }
}

void embedding_backward(Out dwte, Out dwpe, In dout, std::span<const int> tokens, int B, int S,
                        int C, int vocab_begin) {
  const auto rows = static_cast<int>(dwte.size() / static_cast<std::size_t>(C));
  for (int b = 0; b < B; ++b) {
    for (int s = 0; s < S; ++s) {
      const std::size_t row = static_cast<std::size_t>(b) * S + s;
      const float* dy = dout.data() + row * C;
      const int local = tokens[row] - vocab_begin;
      float* de =
          local >= 0 && local < rows ? dwte.data() + static_cast<std::size_t>(local) * C : nullptr;
      for (int c = 0; c < C; ++c) {
        if (de) de[c] += dy[c];
        if (!dwpe.empty()) dwpe[static_cast<std::size_t>(s) * C + c] += dy[c];
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
