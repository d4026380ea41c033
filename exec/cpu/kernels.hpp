// CPU kernels of the reference executor: forward and backward of every op of a GPT-style
// decoder, in fp32, written out one op per function (the numerical reference the GPU backend
// is checked against). Shapes are in the comments; T = tokens (batch x sequence), all buffers
// row-major. Backward functions accumulate (+=) into gradient buffers, as autograd does.
#pragma once

#include <cstdint>
#include <span>

#include "exec/core/counter_hash.hpp"
#include "exec/core/gating.hpp"

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
// din[T,K] = dout[T,N] · w^T, written whole (what din held is not read): the input gradient of
// a tensor whose first contribution it is.
void matmul_input_grad(Out din, In dout, In w, int T, int K, int N, bool w_transposed = false);

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

// GELU, tanh approximation (as GPT-2): out = 0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x³))),
// computed through exp (see kernels.cpp).
// The backwards write din whole (the activation is its input's one consumer: the first and only
// contribution to its gradient).
void gelu_forward(Out out, In in, std::int64_t n);
void gelu_backward(Out din, In in, In dout, std::int64_t n);

// SwiGLU: in[T, 2F] = [gate | up] -> out[T, F] = silu(gate) · up.
void swiglu_forward(Out out, In in, int T, int F);
void swiglu_backward(Out din, In in, In dout, int T, int F);

// Causal attention with grouped KV heads. qkv[B·S, (H + 2·G)·D] holds q (H heads), k, v (G
// heads each, G divides H); out[B·S, H·D]; probs[B, H, S, S] keeps the softmax for backward.
void attention_forward(Out out, Out probs, In qkv, int B, int S, int H, int G, int D);
void attention_backward(Out dqkv, In dout, In qkv, In probs, int B, int S, int H, int G, int D);

// Parameters, data and dropout masks come from exec/core/counter_hash.hpp.
using exec::counter_hash;

// The dropout rate of a model with dropout, at every site (the embedding, the attention
// probabilities, both residual branches): GPT-2's embd_pdrop, attn_pdrop and resid_pdrop
// (Hugging Face openai-community/gpt2 config.json) and Megatron-LM's --hidden-dropout and
// --attention-dropout defaults.
inline constexpr float kDropoutRate = 0.1f;

// Dropout (Srivastava et al. 2014) at `rate`, its masks drawn from counter_hash so that every
// split of a micro-batch over ranks (tensor, sequence and context parallelism) and every
// recompute draws the same mask for an element: element `index` of global sequence `sequence`
// is kept when the top 24 bits of counter_hash(stream, sequence, index) over 2^24 are >= rate,
// and kept values are scaled by 1 / (1 - rate). Masks are kept, one byte per element.
struct Dropout {
  std::uint64_t stream = 0;  // one per seed, step, layer and site
  float rate = 0;
  std::int64_t first_sequence = 0;  // global index of the micro-batch's first sequence
  // A residual-stream tensor's rows: its first row among the micro-batch's B·Sq rows (sequence
  // parallelism holds a share), the rows of a sequence, and their positions (empty: 0 ... Sq-1).
  int first_row = 0;
  int Sq = 1;
  std::span<const int> positions;
  int head_offset = 0;  // attention: this rank's first head among all (tensor parallelism)

  bool keeps(std::int64_t sequence, std::uint64_t index) const;
  float scale() const { return 1.0f / (1.0f - rate); }
};

// Rows [T, C] of the residual stream: element (position, c) has index position·C + c.
// out = dropout(in) (out may be in); dropout_add_forward: out = skip + dropout(branch), the
// residual connection after an attention or MLP block. dropout_backward: din += dout ⊙ mask /
// (1 - rate).
void dropout_forward(Out out, std::span<std::uint8_t> mask, In in, const Dropout& d, int T, int C);
void dropout_add_forward(Out out, std::span<std::uint8_t> mask, In branch, In skip,
                         const Dropout& d, int T, int C);
void dropout_backward(Out din, std::span<const std::uint8_t> mask, In dout, float rate);

// What attention_forward's general form adds.
// Context parallelism over cp ranks, each holding Sq tokens of every sequence of S = cp·Sq: kv
// holds the keys and values of every rank, [cp·B·Sq, 2·G·D] (rank r's B·Sq rows r-th, each row K
// then V); empty, the keys and values are qkv's own (cp 1). The rank's query s is at position
// qpos[s] of its sequence; order[p] is the key at position p as an index into a sequence's cp·Sq
// keys (rank r's token s: r·Sq + s); empty, the identity. A query attends to the positions up
// to its own, visited in position order, so that a split sequence's outputs and dq sum as one
// rank's, bit for bit (dk and dv are summed on each rank, then over the ranks).
// Dropout of the probabilities (attention dropout) when `dropout` is set: element (head,
// query position, key position) has index (head_offset + h)·S² + q·S + k; mask and dropped
// [B, H, Sq, S] keep its mask and the probabilities after it, which the values read.
// FlashAttention's memory (model::AttentionKernel::Flash) when `lse` is given, [B, H, Sq]: a
// row's probabilities live only while the kernel computes the row; the forward keeps the
// log-sum-exp of its scaled scores, the backward computes the scores again and the
// probabilities as exp(score - lse), and draws the dropout mask again from its counter (probs,
// mask and dropped are then empty). The whole row of keys is one block here, so the forward's
// outputs are those of the unfused kernel, bit for bit; the backward's probabilities differ
// from them by rounding.
struct AttentionOptions {
  In kv;
  int cp = 1;
  std::span<const int> qpos, order;
  const Dropout* dropout = nullptr;
  std::span<std::uint8_t> mask;
  Out dropped;
  Out lse;
  // The values' head width where it is not the queries' and keys' D (multi-head latent
  // attention's, mla_pack_forward); 0: D. qkv's rows are then (H + G)·D + G·v_dim wide, kv's
  // G·D + G·v_dim (K then V), out's H·v_dim; the scores' scale stays 1/sqrt(D).
  int v_dim = 0;
};
// out[B·Sq, H·D]; probs[B, H, Sq, S] by key position. The backward adds dq into dqkv's q
// columns and dk, dv into dkv (kv's layout; dqkv's own k and v columns when kv is empty).
void attention_forward(Out out, Out probs, In qkv, int B, int Sq, int H, int G, int D,
                       const AttentionOptions& options);
void attention_backward(Out dqkv, Out dkv, In dout, In qkv, In probs, int B, int Sq, int H, int G,
                        int D, const AttentionOptions& options);

// Mixture of experts (Mixtral's routing, Jiang et al. 2024): each of T tokens goes to the k of
// E experts with the largest router logits (ties to the lower index), weighted as `gating`
// says (exec/core/gating.hpp: the softmax of those k logits, the softmax over all E experts
// (Switch Transformer's, Fedus et al. 2022), or their sigmoids, normalized over the k or not
// (DeepSeek-V3's), times a scale). Slot j of token t is row t·k + j of the routing tensors:
// experts[T·k] (int) and gates[T·k].
void moe_route(std::span<int> experts, Out gates, In logits, int T, int E, int k,
               const Gating& gating);
// dlogits[T, E] += the gradient through the gates: the softmax over the k (zero for the others,
// `logits` empty), over all E, or the chosen logits' sigmoids; where gating.reads_logits(), from
// logits[T, E] read again.
void moe_route_backward(Out dlogits, In dgates, In gates, std::span<const int> experts, In logits,
                        int T, int E, int k, const Gating& gating);
// The T·k slots sorted by expert (stably: token order within an expert): order[p] is the slot
// at row p, rows[e] how many slots expert e got; dispatched[T·k, C] = x[token of order[p]].
void moe_dispatch(Out dispatched, std::span<int> order, std::span<int> rows, In x,
                  std::span<const int> experts, int T, int C, int k, int E);
// dx[T, C] += the gradients of each token's dispatched rows.
void moe_dispatch_backward(Out dx, In ddispatched, std::span<const int> order, int T, int C, int k);
// out[T, C] = sum over a token's slots of gate · y[row of the slot] (y in dispatched order).
void moe_combine(Out out, In y, In gates, std::span<const int> order, int T, int C, int k);
// dy[T·k, C] = gate · dout[token]; dgates[slot] += dout[token] · y[row].
void moe_combine_backward(Out dy, Out dgates, In dout, In y, In gates, std::span<const int> order,
                          int T, int C, int k);

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

// Multi-head latent attention (DeepSeek-V2, Liu et al. 2024): its queries, keys and values
// packed for the attention core (attention_forward with v_dim = Dv, G = H, D = Dn + Dr) as
// qkv[B·S, H·(Dn + Dr) + H·(Dn + Dr) + H·Dv]. q[B·S, H·(Dn + Dr)]: each head's Dn columns
// without positions, then its Dr columns that RoPE turns (rope_forward's rotate-half layout
// over those Dr); kv[B·S, H·(Dn + Dv)]: each head's key columns without positions, then its
// values (kv_b_proj's layout in Hugging Face's DeepSeek-V3); k_rope[B·S, Dr]: the keys' part
// with positions, one for all heads, turned and copied into each head's key. The backward adds
// the gradients into dq, dkv and dk_rope (summed over the heads), turned back. Positions as
// rope's. q (and dq) may be empty: the keys and values alone (context parallelism's gather;
// qkv's q columns then left as they were).
void mla_pack_forward(Out qkv, In q, In kv, In k_rope, int B, int S, int H, int Dn, int Dr, int Dv,
                      double theta, std::span<const int> positions = {});
void mla_pack_backward(Out dq, Out dkv, Out dk_rope, In dqkv, int B, int S, int H, int Dn, int Dr,
                       int Dv, double theta, std::span<const int> positions = {});

// Token (and learned position) embedding: out[B·S, C] = wte[token] (+ wpe[position of s], as
// rope's). With vocabulary parallelism wte holds rows [vocab_begin, vocab_begin + rows) and
// other tokens contribute 0.
void embedding_forward(Out out, std::span<const int> tokens, In wte, In wpe, int B, int S, int C,
                       int vocab_begin = 0, std::span<const int> positions = {});
void embedding_backward(Out dwte, Out dwpe, In dout, std::span<const int> tokens, int B, int S,
                        int C, int vocab_begin = 0, std::span<const int> positions = {});

// Softmax cross-entropy, vocab-parallel (Megatron-LM's vocab_parallel_cross_entropy), logits[T,
// V] being columns [vocab_begin, vocab_begin + V) of the full vocabulary (the whole of it: 0, V):
// 1. rowmax[T] = the local maximum of each row;
// 2. sums[2T] = the sum of exp(z - rowmax) and the target logit where this shard holds the
//    target, else 0;
//    over tensor-parallel ranks: the maxima all-reduced with max, each rank's sums rescaled to
//    them (cross_entropy_rescale: sums[T] *= exp(local - global)), then all-reduced with sum;
// 3. returns the mean loss and writes dlogits[T, V] = (softmax - onehot) / T (the gradient of
//    the mean) for the shard.
void cross_entropy_max(Out rowmax, In logits, int T, int V);
void cross_entropy_sums(Out sums, In logits, In rowmax, std::span<const int> targets, int T, int V,
                        int vocab_begin);
void cross_entropy_rescale(Out sums, In local_max, In global_max, int T);
double cross_entropy_sharded(Out dlogits, In logits, In rowmax, In sums,
                             std::span<const int> targets, int T, int V, int vocab_begin);

// Gradient clipping by global norm (Megatron-LM clip_grad_norm_fp32): the sum of the squares
// of x (accumulated in double, in order), and x scaled by min(1, max_norm / (norm + 1e-6)).
double sum_squares(In x, std::int64_t n);
void clip_scale(Out x, std::int64_t n, double norm, float max_norm);

// AdamW (Loshchilov & Hutter 2019), step t >= 1, decoupled weight decay.
void adamw(Out params, In grads, Out m, Out v, std::int64_t n, float lr, float beta1, float beta2,
           float eps, float weight_decay, int t);

}  // namespace dtsim::exec::cpu
