// CPU kernels of the reference executor: forward and backward of every op of a GPT-style
// decoder, in fp32, written out one op per function (the numerical reference the GPU backend
// is checked against). Shapes are in the comments; T = tokens (batch x sequence), all buffers
// row-major. Backward functions accumulate (+=) into gradient buffers, as autograd does.
#pragma once

#include <cstdint>
#include <span>

namespace dtsim::exec::cpu {

using In = std::span<const float>;
using Out = std::span<float>;

// OpenBLAS threads per process (one per rank when several ranks share the cores).
void set_gemm_threads(int threads);

// out[T,N] = in[T,K] · w[K,N] (+ bias[N]). OpenBLAS sgemm. With w_transposed the weight is
// stored as [N,K] (a head tied to the embedding table reads the table as it is).
void matmul_forward(Out out, In in, In w, In bias, int T, int K, int N, bool w_transposed = false);
// din[T,K] += dout[T,N] · w^T;  dw[K,N] += in^T · dout (transposed: dw[N,K] += dout^T · in);
// dbias[N] += sum over T of dout. Any of din, dw, dbias may be empty (not wanted).
void matmul_backward(Out din, Out dw, Out dbias, In dout, In in, In w, int T, int K, int N,
                     bool w_transposed = false);

// LayerNorm over C (eps 1e-5): out = (in - mean) * rstd * w + b; keeps mean[T] and rstd[T].
// With `rms` true it is RMSNorm (no mean, no bias): out = in * rstd * w.
void norm_forward(Out out, Out mean, Out rstd, In in, In w, In b, int T, int C, bool rms);
// din, dw and db may each be empty (not wanted).
void norm_backward(Out din, Out dw, Out db, In dout, In in, In w, In mean, In rstd, int T, int C,
                   bool rms);

// Residual connection: out[n] = a + b; its backward accumulates: d[n] += dout (scaled: the
// loss gradient's 1/(micro-batches x dp)).
void add_forward(Out out, In a, In b);
void accumulate(Out d, In dout, float scale = 1.0f);

// GELU, tanh approximation (as GPT-2): out = 0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x³))).
void gelu_forward(Out out, In in, std::int64_t n);
void gelu_backward(Out din, In in, In dout, std::int64_t n);

// SwiGLU: in[T, 2F] = [gate | up] -> out[T, F] = silu(gate) · up.
void swiglu_forward(Out out, In in, int T, int F);
void swiglu_backward(Out din, In in, In dout, int T, int F);

// Causal attention with grouped KV heads. qkv[B·S, (H + 2·G)·D] holds q (H heads), k, v (G
// heads each, G divides H); out[B·S, H·D]; probs[B, H, S, S] keeps the softmax for backward.
void attention_forward(Out out, Out probs, In qkv, int B, int S, int H, int G, int D);
void attention_backward(Out dqkv, In dout, In qkv, In probs, int B, int S, int H, int G, int D);

// Context parallelism over cp ranks, each holding Sq tokens of every sequence of S = cp·Sq:
// this rank's queries (the q columns of qkv[B·Sq, (H + 2·G)·D]; query s at position qpos[s] of
// its sequence) against the keys and values of every rank, kv[cp·B·Sq, 2·G·D] (rank r's B·Sq
// rows r-th, each row K then V). order[p] is the key at position p as an index into a
// sequence's cp·Sq keys (rank r's token s: r·Sq + s). A query attends to the positions up to
// its own, in position order (so that the sums are those of one rank's attention_forward);
// out[B·Sq, H·D]; probs[B, H, Sq, S] by key position. The backward adds dq into dqkv's q
// columns and dk, dv into dkv (the layout of kv).
void attention_forward_cp(Out out, Out probs, In qkv, In kv, std::span<const int> qpos,
                          std::span<const int> order, int B, int Sq, int cp, int H, int G, int D);
void attention_backward_cp(Out dqkv, Out dkv, In dout, In qkv, In kv, In probs,
                           std::span<const int> qpos, std::span<const int> order, int B, int Sq,
                           int cp, int H, int G, int D);

// Columns [begin, begin + width) of src[T, src_width] into dst[T, width]; and back, added:
// dst[T, dst_width]'s columns [begin, begin + width) += src[T, width].
void copy_columns(Out dst, In src, int T, int src_width, int begin, int width);
void add_columns(Out dst, In src, int T, int dst_width, int begin, int width);

// Rotary position embedding (Su et al. 2021) in the rotate-half layout of Hugging Face's Llama:
// in each q and k head of qkv[B·S, (H + 2·G)·D], the pair (x_i, x_{i+D/2}) at position s turns
// by s·theta^(-2i/D). out gets the rotated q and k and an unchanged v. The backward turns the
// gradients back (the transpose of a rotation) and accumulates them into dqkv. Row s of a
// sequence is at position positions[s] (s itself when positions is empty: context parallelism
// gives a rank other positions).
void rope_forward(Out out, In qkv, int B, int S, int H, int G, int D, double theta,
                  std::span<const int> positions = {});
void rope_backward(Out dqkv, In dout, int B, int S, int H, int G, int D, double theta,
                   std::span<const int> positions = {});

// Token (and learned position) embedding: out[B·S, C] = wte[token] (+ wpe[position of s], as
// rope's). With vocabulary parallelism wte holds rows [vocab_begin, vocab_begin + rows) and
// other tokens contribute 0.
void embedding_forward(Out out, std::span<const int> tokens, In wte, In wpe, int B, int S, int C,
                       int vocab_begin = 0, std::span<const int> positions = {});
void embedding_backward(Out dwte, Out dwpe, In dout, std::span<const int> tokens, int B, int S,
                        int C, int vocab_begin = 0, std::span<const int> positions = {});

// Softmax cross-entropy: logits[T, V], targets[T] -> returns the mean loss; dlogits[T, V] =
// (softmax - onehot) / T (the gradient of the mean).
double cross_entropy(Out dlogits, In logits, std::span<const int> targets, int T, int V);

// Vocab-parallel cross-entropy (Megatron-LM's vocab_parallel_cross_entropy), logits[T, V] being
// columns [vocab_begin, vocab_begin + V) of the full vocabulary:
// 1. rowmax[T] = the local maximum of each row (then all-reduced with max);
// 2. sums[2T] = the sum of exp(z - rowmax) and the target logit where this shard holds the
//    target, else 0 (then all-reduced with sum);
// 3. returns the mean loss and writes dlogits[T, V] = (softmax - onehot) / T for the shard.
void cross_entropy_max(Out rowmax, In logits, int T, int V);
void cross_entropy_sums(Out sums, In logits, In rowmax, std::span<const int> targets, int T, int V,
                        int vocab_begin);
double cross_entropy_sharded(Out dlogits, In logits, In rowmax, In sums,
                             std::span<const int> targets, int T, int V, int vocab_begin);

// AdamW (Loshchilov & Hutter 2019), step t >= 1, decoupled weight decay.
void adamw(Out params, In grads, Out m, Out v, std::int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, int t);

}  // namespace dtsim::exec::cpu
