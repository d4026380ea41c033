#include "sim/model/model_graph.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/topological_sort.hpp>
#include <cmath>
#include <iterator>

#include "sim/common/error.hpp"

namespace dtsim::model {

struct ModelGraph::Impl {
  // Vertex i is ops_[i]; an edge u -> v means v consumes u's output.
  boost::adjacency_list<boost::vecS, boost::vecS, boost::bidirectionalS> graph;
};

std::string_view to_string(OpKind kind) {
  switch (kind) {
    case OpKind::Embedding:
      return "embedding";
    case OpKind::Norm:
      return "norm";
    case OpKind::QkvProj:
      return "qkv_proj";
    case OpKind::AttentionCore:
      return "attention_core";
    case OpKind::AttnOutProj:
      return "attn_out_proj";
    case OpKind::Residual:
      return "residual";
    case OpKind::MlpUp:
      return "mlp_up";
    case OpKind::Activation:
      return "activation";
    case OpKind::MlpDown:
      return "mlp_down";
    case OpKind::Router:
      return "router";
    case OpKind::LatentDown:
      return "latent_down";
    case OpKind::LmHead:
      return "lm_head";
    case OpKind::LossStatistics:
      return "loss_statistics";
    case OpKind::Loss:
      return "loss";
  }
  return "?";
}

namespace {

using u64 = std::uint64_t;

// FlashAttention's tile of queries and of keys: FlashAttention-2 (Dao 2023, Sec. 3.3) uses
// blocks of {64, 128} x {64, 128} by head dimension and shared memory; 128 for the head
// dimensions of 64 and 128 that GPT and Llama models have. Its causal skipping works a query
// block at a time.
constexpr double kFlashBlock = 128;

// Builds the ops of the model in dependency order; `add` returns the new op's id.
class Builder {
 public:
  Builder(const ModelSpec& m, std::int64_t b, std::int64_t s, int act_bytes,
          AttentionKernel attention)
      : m_(m),
        attention_(attention),
        tokens_(static_cast<double>(b) * static_cast<double>(s)),
        b_(static_cast<u64>(b)),
        s_(static_cast<u64>(s)),
        act_(static_cast<u64>(act_bytes)) {}

  std::vector<Op> ops;
  std::vector<std::pair<OpId, OpId>> edges;

  void build() {
    const int layers = static_cast<int>(m_.layers);
    OpId x = embedding();
    for (int l = 0; l < layers; ++l) x = block(l, x);
    const OpId fn = norm("final_norm", layers, x);
    const OpId head = lm_head(layers, fn);
    loss(layers, head, loss_statistics(layers, head));
  }

 private:
  const ModelSpec& m_;
  AttentionKernel attention_;
  double tokens_;  // b·s
  u64 b_, s_, act_;

  u64 T() const { return b_ * s_; }
  u64 h() const { return static_cast<u64>(m_.hidden); }

  OpId add(Op op, std::initializer_list<OpId> inputs) {
    ops.push_back(std::move(op));
    const OpId id = ops.size() - 1;
    for (OpId in : inputs) edges.emplace_back(in, id);
    return id;
  }

  // A GEMM of (tokens x in) by (in x out): forward, input-gradient and weight-gradient each
  // 2·tokens·in·out FLOPs; traffic reads input and weights, writes output (backward ~2x).
  void gemm(Op& op, double tokens, double in, double out) const {
    op.fwd_flops = 2.0 * tokens * in * out;
    op.gemm_m = tokens;
    op.gemm_k = in;
    op.gemm_n = out;
    op.bwd_input_flops = op.fwd_flops;
    op.bwd_weight_flops = op.fwd_flops;
    const double a = static_cast<double>(act_);
    op.weight_bytes = a * in * out;
    op.fwd_bytes = a * (tokens * in + tokens * out) + op.weight_bytes;
    op.bwd_bytes = 2.0 * op.fwd_bytes;
  }

  // Element-wise op over `elems` elements reading `reads` and writing `writes` tensors.
  void elementwise(Op& op, double elems, double reads, double writes) const {
    const double a = static_cast<double>(act_);
    op.fwd_bytes = a * elems * (reads + writes);
    op.bwd_bytes = 1.5 * op.fwd_bytes;  // reads saved input + upstream grad, writes grad
  }

  // A GEMM of a block's normed input to `width` outputs whose weights every tp rank holds whole
  // (a router; latent attention's down projection), keeping its input (2sbh); not yet added.
  Op replicated_gemm(std::string name, OpKind kind, int l, u64 width) const {
    Op op;
    op.name = std::move(name);
    op.kind = kind;
    op.layer = l;
    op.params = h() * width;
    op.tp_replicated_params = op.params;
    gemm(op, tokens_, static_cast<double>(h()), static_cast<double>(width));
    op.saved_bytes = act_ * T() * h();
    return op;
  }

  u64 norm_params(u64 width) const {
    return width * (m_.norm == Norm::LayerNorm && m_.bias.norm ? 2 : 1);
  }
  u64 norm_params() const { return norm_params(h()); }

  OpId embedding() {
    Op op;
    op.name = "embedding";
    op.kind = OpKind::Embedding;
    op.layer = -1;
    op.tp_split = TpSplit::Vocab;
    op.params = static_cast<u64>(m_.vocab_rows()) * h();
    if (m_.positions == Positions::Learned) {
      op.tp_replicated_params = static_cast<u64>(m_.max_positions) * h();
      op.params += op.tp_replicated_params;
    }
    const double pos_reads = m_.positions == Positions::Learned ? 1.0 : 0.0;
    elementwise(op, tokens_ * static_cast<double>(h()), 1.0 + pos_reads, 1.0);
    // Korthikanti et al. §4.3: the embedding dropout keeps a 1-byte mask of s·b·h.
    if (m_.dropout) op.saved_bytes = T() * h();
    return add(std::move(op), {});
  }

  OpId norm(std::string name, int layer, OpId in) {
    Op op;
    op.name = std::move(name);
    op.kind = OpKind::Norm;
    op.layer = layer;
    op.params = norm_params();
    op.tp_replicated_params = op.params;
    elementwise(op, tokens_ * static_cast<double>(h()), 1.0, 1.0);
    op.saved_bytes = act_ * T() * h();  // its input (2sbh)
    return add(std::move(op), {in});
  }

  OpId residual(std::string name, int layer, OpId branch, OpId skip) {
    Op op;
    op.name = std::move(name);
    op.kind = OpKind::Residual;
    op.layer = layer;
    elementwise(op, tokens_ * static_cast<double>(h()), 2.0, 1.0);
    if (m_.dropout) op.saved_bytes = T() * h();  // dropout mask, 1 byte (sbh)
    return add(std::move(op), {branch, skip});
  }

  // The attention core as FlashAttention runs it (FlashAttention-2, Dao 2023, Algorithms 1
  // and 2): blocks of queries against blocks of keys on chip, the softmax online. Widths of
  // its queries, keys, values and output.
  void flash(Op& core, u64 qw, u64 kw, u64 vw, u64 ow) const {
    // Causal: the key blocks wholly after a query block are skipped (Sec. 3.1.1): with n
    // blocks of rows, n(n+1)/2 of the n² block pairs run.
    const double n = std::ceil(static_cast<double>(s_) / kFlashBlock);
    const double causal = (n + 1) / (2 * n);
    core.kernel_fwd_flops = causal * core.fwd_flops;
    // The backward's five GEMMs per block pair (S = QK^T again, dV = P^T dO, dP = dO V^T,
    // dQ = dS K, dK = dS^T Q) against the forward's two: 2.5x (Sec. 4.1's FLOP count) where
    // queries, keys and values are alike wide; three over the queries' and keys' head width and
    // two over the values' against one of each (multi-head latent attention's 192 and 128).
    const double dqk = static_cast<double>(m_.head_dim);
    const double dv = static_cast<double>(m_.v_head_dim());
    core.kernel_bwd_flops = (3 * dqk + 2 * dv) / (dqk + dv) * core.kernel_fwd_flops;
    // Traffic: read Q, K, V, write the output and the log-sum-exp (fp32, a row per head);
    // backward: read Q, K, V, the output, its gradient and the log-sum-exp, write dQ, dK, dV
    // and read and write the rows' sum of dO ∘ O (fp32). A kernel's re-reads of K and V per
    // query block are in its measured rate (the device's attention efficiency).
    const double a = static_cast<double>(act_);
    const double rows =
        static_cast<double>(b_) * static_cast<double>(m_.heads) * static_cast<double>(s_);
    core.fwd_bytes = a * tokens_ * static_cast<double>(qw + kw + vw + ow) + 4.0 * rows;
    core.bwd_bytes = a * tokens_ * static_cast<double>(2 * (qw + kw + vw + ow)) + 12.0 * rows;
    // Saved: Q, K, V and the log-sum-exp. Attention dropout's mask is drawn again in the
    // backward from its seed (FlashAttention's Philox offsets), not kept.
    core.saved_quadratic_bytes = 0;
    core.saved_bytes = act_ * T() * (qw + kw + vw) + 4 * b_ * static_cast<u64>(m_.heads) * s_;
  }

  // The projections that make the attention core's queries, keys and values from the block's
  // normed input `in`: one QKV GEMM, or multi-head latent attention's (MlaSpec): the latents'
  // down projection and norm, then the queries' and the keys' and values' up projections, each
  // entering tensor parallelism's region with its latent. Returns the ops the core reads.
  std::vector<OpId> attention_inputs(int l, OpId in) {
    const auto name = [l](std::string_view what) { return fmt::format("L{}.{}", l, what); };
    // A projection split by heads (column-parallel) from `width` inputs to `out`, keeping
    // nothing yet.
    const auto projection = [&](std::string_view what, u64 width, u64 out) {
      Op op;
      op.name = name(what);
      op.kind = OpKind::QkvProj;
      op.layer = l;
      op.tp_split = TpSplit::Column;
      op.params = width * out;
      gemm(op, tokens_, static_cast<double>(width), static_cast<double>(out));
      return op;
    };
    const u64 qw = static_cast<u64>(m_.q_width());
    if (!m_.mla) {
      const u64 out = qw + 2 * static_cast<u64>(m_.kv_width());
      Op qkv = projection("qkv", h(), out);
      if (m_.bias.qkv) qkv.params += out;
      qkv.saved_bytes = act_ * T() * h();  // its input, the norm output (2sbh)
      return {add(std::move(qkv), {in})};
    }
    const MlaSpec& a = *m_.mla;
    const u64 rq = static_cast<u64>(a.q_lora_rank), rkv = static_cast<u64>(a.kv_lora_rank);
    const u64 rope = static_cast<u64>(a.qk_rope_head_dim);
    const u64 latent = static_cast<u64>(m_.latent_width());

    const OpId d = add(replicated_gemm(name("latent_down"), OpKind::LatentDown, l, latent), {in});

    // The RMSNorms of the queries' and the keys' and values' latents (not the keys' RoPE part).
    Op norm;
    norm.name = name("latent_norm");
    norm.kind = OpKind::Norm;
    norm.layer = l;
    norm.params = norm_params(rq + rkv);
    norm.tp_replicated_params = norm.params;
    elementwise(norm, tokens_ * static_cast<double>(rq + rkv), 1.0, 1.0);
    norm.saved_bytes = act_ * T() * (rq + rkv);  // its input
    const OpId n = add(std::move(norm), {d});

    // The queries: from their latent, or from the block's input where there is none.
    Op q = projection(rq > 0 ? "q_up" : "q_proj", rq > 0 ? rq : h(), qw);
    // Its input: the query latent, or the block's normed input, which the down projection
    // keeps already (one tensor: Megatron-Core's linear_q_proj and linear_kv_down_proj read it).
    q.saved_bytes = rq > 0 ? act_ * T() * rq : 0;
    q.tp_enter_width = rq > 0 ? rq : 0;
    const OpId qo = add(std::move(q), {rq > 0 ? n : in});

    // The keys' parts without positions and the values, per head, from their latent; the
    // keys' RoPE part (one for all heads, from the down projection) enters tp's region with it
    // (its own collective in Megatron-Core: one more launch, not priced), and is not gathered
    // again for the weight gradient (the GEMM's input, gemm_k, is).
    const u64 kv_out =
        static_cast<u64>(m_.heads * a.qk_nope_head_dim) + static_cast<u64>(m_.v_width());
    Op kv = projection("kv_up", rkv, kv_out);
    kv.saved_bytes = act_ * T() * rkv;  // its input
    kv.tp_enter_width = rkv + rope;
    const OpId kvo = add(std::move(kv), {n});
    return {qo, kvo};
  }

  OpId block(int l, OpId x) {
    const auto name = [l](std::string_view what) { return fmt::format("L{}.{}", l, what); };
    const double hd = static_cast<double>(h());
    const u64 qw = static_cast<u64>(m_.q_width());
    const u64 kw = static_cast<u64>(m_.kv_width());
    const u64 vw = static_cast<u64>(m_.v_width());
    const u64 ow = static_cast<u64>(m_.o_width());

    const OpId n1 = norm(name("norm1"), l, x);
    const std::vector<OpId> qkv = attention_inputs(l, n1);

    Op core;
    core.name = name("attention");
    core.kind = OpKind::AttentionCore;
    core.layer = l;
    core.tp_split = TpSplit::Heads;
    core.saved_tp_split = true;
    // Q·K^T and P·V: 2 GEMMs of 2·b·a·s²·d each (d: the queries' and keys' head width, then
    // the values'); backward needs 4 such GEMMs.
    const double bas2 = static_cast<double>(b_) * static_cast<double>(m_.heads) *
                        static_cast<double>(s_) * static_cast<double>(s_);
    core.fwd_flops = 2.0 * bas2 * static_cast<double>(m_.head_dim + m_.v_head_dim());
    core.bwd_input_flops = 2.0 * core.fwd_flops;
    // Traffic of an unfused-softmax implementation (Megatron-LM 2021): read Q, K, V, write the
    // output, and write scores, read them, write probabilities, read them (4 passes over b·a·s²).
    const double a = static_cast<double>(act_);
    core.fwd_bytes = a * (tokens_ * static_cast<double>(qw + kw + vw + ow) + 4.0 * bas2);
    if (m_.dropout) core.fwd_bytes += bas2 * (1.0 + 2.0 * a);
    core.bwd_bytes = 2.0 * core.fwd_bytes;
    // Saved: Q, K, V (Korthikanti: 4sbh for Q, K and 2sbh for V when kv = heads), and the
    // quadratic terms: softmax output 2·a·s²·b, dropout mask a·s²·b, dropout output 2·a·s²·b.
    const u64 quad_elems = b_ * static_cast<u64>(m_.heads) * s_ * s_;
    core.saved_quadratic_bytes = act_ * quad_elems + (m_.dropout ? (1 + act_) * quad_elems : 0);
    core.saved_bytes = act_ * T() * (qw + kw + vw) + core.saved_quadratic_bytes;
    if (attention_ == AttentionKernel::Flash) flash(core, qw, kw, vw, ow);
    const OpId c = add(std::move(core), {qkv.front()});
    for (std::size_t i = 1; i < qkv.size(); ++i) edges.emplace_back(qkv[i], c);

    Op out;
    out.name = name("attn_out");
    out.kind = OpKind::AttnOutProj;
    out.layer = l;
    out.tp_split = TpSplit::Row;
    out.params = ow * h() + (m_.bias.attn_out ? h() : 0);
    out.tp_replicated_params = m_.bias.attn_out ? h() : 0;
    gemm(out, tokens_, static_cast<double>(ow), hd);
    out.saved_bytes = act_ * T() * ow;  // its input (2sbh)
    out.saved_tp_split = true;
    const OpId o = add(std::move(out), {c});

    const OpId r1 = residual(name("attn_residual"), l, o, x);
    const OpId n2 = norm(name("norm2"), l, r1);

    OpId mlp_in = n2;
    u64 f = static_cast<u64>(m_.dense_ffn(l));  // (a mixture's dense block's)
    u64 copies = 1;                             // token copies through the MLP (top_k for MoE)
    bool expert = false;
    u64 experts = 1;
    if (m_.has_experts(l)) {
      f = static_cast<u64>(m_.moe->expert_ffn_hidden);
      copies = static_cast<u64>(m_.moe->top_k);
      experts = static_cast<u64>(m_.moe->experts);
      expert = true;
      Op router = replicated_gemm(name("router"), OpKind::Router, l, experts);
      // Saved: its input (2sbh) and the routing probabilities in fp32.
      router.saved_bytes += 4 * T() * experts;
      // The dispatch (Megatron-LM's permute; dtexec's moe_dispatch) copies each token to its
      // top_k experts' rows: reads s·b·h, writes top_k of them; its backward sums the copies'
      // gradients back into their tokens (reads top_k, writes one).
      router.fwd_move_bytes = a * tokens_ * hd * (1.0 + static_cast<double>(copies));
      router.bwd_move_bytes = router.fwd_move_bytes;
      mlp_in = add(std::move(router), {n2});
    }
    auto [up, act, down] = mlp(l, expert ? "experts" : "mlp", f, copies, experts, expert);
    // An MoE's experts read every token's copies: each tp rank keeps them whole (under sequence
    // parallelism all-gathered over tp, plan::moe_local_dispatch).
    if (expert) up.saved_tp_whole_bytes = up.saved_bytes;
    const OpId u = add(std::move(up), {mlp_in});
    const OpId ac = add(std::move(act), {u});
    if (expert) {
      // And the copies' outputs, for the gates' gradient (y = sum_j g_j E_j(x), so
      // dL/dg_j = <dL/dy, E_j(x)>; Megatron-LM's unpermute keeps them for the same reason).
      // Each tp rank holds its row-parallel partial sums at full width until the combine,
      // so these are not split over tp without sequence parallelism; with it they are
      // reduce-scattered back to their tokens' tp rank first (plan::moe_local_dispatch), and
      // the memory model splits them.
      down.saved_tp_whole_bytes = act_ * T() * copies * h();
      down.saved_bytes += down.saved_tp_whole_bytes;
      // The combine (unpermute) sums each token's top_k outputs, weighted by their gates:
      // reads top_k copies, writes one. Its backward reads the output gradient and the kept
      // copies (for the gates' gradient) and writes the copies' gradients.
      const double k = static_cast<double>(copies);
      down.fwd_move_bytes = a * tokens_ * hd * (1.0 + k);
      down.bwd_move_bytes = a * tokens_ * hd * (1.0 + 2.0 * k);
    }
    OpId d = add(std::move(down), {ac});
    if (expert && m_.shared_ffn() > 0) d = shared_experts(l, n2, d);

    return residual(name("mlp_residual"), l, d, r1);
  }

  // An MLP's up projection, activation and down projection (names "<prefix>_up", ...), unadded:
  // over `copies` copies of each token, as `experts` MLPs of width f (`expert`: an MoE's,
  // whose GEMMs read every expert's weights). Each keeps its input.
  struct MlpOps {
    Op up, act, down;
  };
  MlpOps mlp(int l, std::string_view prefix, u64 f, u64 copies, u64 experts, bool expert) const {
    const auto name = [&](std::string_view what) {
      return fmt::format("L{}.{}_{}", l, prefix, what);
    };
    const double hd = static_cast<double>(h());
    const double a = static_cast<double>(act_);
    const bool swiglu = m_.activation == Activation::SwiGlu;
    const u64 up_width = swiglu ? 2 * f : f;  // gate and up projections for SwiGLU
    const double rows = tokens_ * static_cast<double>(copies);
    MlpOps o;
    o.up.name = name("up");
    o.up.kind = OpKind::MlpUp;
    o.up.layer = l;
    o.up.expert = expert;
    o.up.tp_split = TpSplit::Column;
    o.up.params = experts * (h() * up_width + (m_.bias.mlp ? up_width : 0));
    gemm(o.up, rows, hd, static_cast<double>(up_width));
    o.up.saved_bytes = act_ * T() * copies * h();  // its input (2sbh per copy)

    o.act.name = name("act");
    o.act.kind = OpKind::Activation;
    o.act.layer = l;
    o.act.expert = expert;
    o.act.tp_split = TpSplit::Column;
    o.act.saved_tp_split = true;
    elementwise(o.act, rows * static_cast<double>(f), swiglu ? 2.0 : 1.0, 1.0);
    o.act.saved_bytes = act_ * T() * copies * up_width;  // GELU input 8sbh; SwiGLU gate and up

    o.down.name = name("down");
    o.down.kind = OpKind::MlpDown;
    o.down.layer = l;
    o.down.expert = expert;
    o.down.tp_split = TpSplit::Row;
    o.down.params = experts * (f * h() + (m_.bias.mlp ? h() : 0));
    o.down.tp_replicated_params = experts * (m_.bias.mlp ? h() : 0);
    gemm(o.down, rows, static_cast<double>(f), hd);
    o.down.saved_bytes = act_ * T() * copies * f;  // its input (8sbh for GELU with f = 4h)
    o.down.saved_tp_split = true;
    if (expert) {  // every expert's weights, not one
      for (Op* op : {&o.up, &o.down}) {
        op->fwd_bytes += a * static_cast<double>(op->params) - op->weight_bytes;
        op->weight_bytes = a * static_cast<double>(op->params);
      }
    }
    return o;
  }

  // The shared experts (MoeSpec::shared_ffn_hidden): a dense MLP over every token of the
  // block's MLP input `in`, after the routed experts in forward order. Its down projection
  // adds the routed experts' output `routed` to its own, so that one tensor-parallel
  // reduction sums both (Megatron-LM's MoE layer adds the shared experts' output to the
  // routed one likewise).
  OpId shared_experts(int l, OpId in, OpId routed) {
    auto [up, act, down] = mlp(l, "shared", static_cast<u64>(m_.shared_ffn()), 1, 1, false);
    // Its input is the router's, which the router keeps already: nothing saved of its own.
    up.saved_bytes = 0;
    const OpId u = add(std::move(up), {in});
    const OpId ac = add(std::move(act), {u});
    // The sum with the routed output: reads both, writes one; its backward copies the output's
    // gradient to the routed experts' output.
    const double bytes = static_cast<double>(act_) * tokens_ * static_cast<double>(h());
    down.fwd_move_bytes = 3.0 * bytes;
    down.bwd_move_bytes = 2.0 * bytes;
    return add(std::move(down), {ac, routed});
  }

  OpId lm_head(int layer, OpId in) {
    Op op;
    op.name = "lm_head";
    op.kind = OpKind::LmHead;
    op.layer = layer;
    op.tp_split = TpSplit::Vocab;
    // A tied head reuses the embedding matrix: no parameters of its own.
    op.params = m_.tied_embeddings ? 0 : static_cast<u64>(m_.vocab_rows()) * h();
    gemm(op, tokens_, static_cast<double>(h()), static_cast<double>(m_.vocab_rows()));
    op.saved_bytes = act_ * T() * h();  // its input (2sbh)
    return add(std::move(op), {in});
  }

  // Cross-entropy in fp32 over the logits, in two ops: each row's statistics over the rank's
  // share of the vocabulary (its maximum, the sum of the exponentials, the target's logit),
  // which tensor parallelism all-reduces (the values Megatron-LM's vocab_parallel_cross_entropy
  // reduces); then the loss and the logits' gradient from them.
  OpId loss_statistics(int layer, OpId logits_op) {
    Op op;
    op.name = "loss_statistics";
    op.kind = OpKind::LossStatistics;
    op.layer = layer;
    op.tp_split = TpSplit::Vocab;
    // Two reads of the logits (the maximum first, for exponentials that cannot overflow); the
    // statistics written are three fp32 values a row. No backward: the loss's gradient needs
    // none, and nothing is kept for it.
    op.fwd_bytes = 4.0 * logits() * 2.0;
    return add(std::move(op), {logits_op});
  }

  void loss(int layer, OpId logits_op, OpId statistics) {
    Op op;
    op.name = "loss";
    op.kind = OpKind::Loss;
    op.layer = layer;
    op.tp_split = TpSplit::Vocab;
    op.saved_tp_split = true;
    // Forward: read the logits, write their gradient (kept for the backward: Korthikanti et
    // al. §4.3, 4sbV/t bytes); backward: read and scale it.
    op.fwd_bytes = 4.0 * logits() * 2.0;
    op.bwd_bytes = 4.0 * logits() * 2.0;
    op.saved_bytes = 4 * T() * static_cast<u64>(m_.vocab_rows());
    add(std::move(op), {logits_op, statistics});
  }

  double logits() const { return tokens_ * static_cast<double>(m_.vocab_rows()); }
};

}  // namespace

ModelGraph::ModelGraph(ModelSpec spec, std::int64_t micro_batch, std::int64_t seq_len,
                       int activation_bytes, AttentionKernel attention)
    : spec_(std::move(spec)), micro_batch_(micro_batch), seq_len_(seq_len), attention_(attention) {
  DTSIM_ASSERT(micro_batch > 0 && seq_len > 0, "ModelGraph needs a positive batch and length");
  Builder builder(spec_, micro_batch, seq_len, activation_bytes, attention);
  builder.build();
  ops_ = std::move(builder.ops);

  impl_ = std::make_unique<Impl>();
  impl_->graph = decltype(impl_->graph)(ops_.size());
  for (const auto& [from, to] : builder.edges) boost::add_edge(from, to, impl_->graph);

  std::vector<OpId> reversed;
  boost::topological_sort(impl_->graph, std::back_inserter(reversed));
  topo_.assign(reversed.rbegin(), reversed.rend());

  groups_.resize(static_cast<std::size_t>(spec_.layers) + 2);
  for (OpId id = 0; id < ops_.size(); ++id) {
    groups_.at(static_cast<std::size_t>(ops_[id].layer + 1)).push_back(id);
  }
}

ModelGraph::~ModelGraph() = default;
ModelGraph::ModelGraph(ModelGraph&&) noexcept = default;
ModelGraph& ModelGraph::operator=(ModelGraph&&) noexcept = default;

std::vector<OpId> ModelGraph::predecessors(OpId id) const {
  std::vector<OpId> out;
  for (auto [it, end] = boost::in_edges(id, impl_->graph); it != end; ++it) {
    out.push_back(boost::source(*it, impl_->graph));
  }
  return out;
}

std::vector<OpId> ModelGraph::successors(OpId id) const {
  std::vector<OpId> out;
  for (auto [it, end] = boost::out_edges(id, impl_->graph); it != end; ++it) {
    out.push_back(boost::target(*it, impl_->graph));
  }
  return out;
}

const std::vector<OpId>& ModelGraph::layer_ops(int layer) const {
  DTSIM_ASSERT(layer >= -1 && layer <= spec_.layers, fmt::format("no layer {}", layer));
  return groups_[static_cast<std::size_t>(layer + 1)];
}

namespace {
void accumulate(GraphTotals& t, const Op& op) {
  t.params += op.params;
  t.fwd_flops += op.fwd_flops;
  t.bwd_flops += op.bwd_input_flops + op.bwd_weight_flops;
  t.saved_bytes += op.saved_bytes;
}
}  // namespace

GraphTotals ModelGraph::layer_totals(int layer) const {
  GraphTotals t;
  for (OpId id : layer_ops(layer)) accumulate(t, ops_[id]);
  return t;
}

GraphTotals ModelGraph::totals() const {
  GraphTotals t;
  for (const Op& op : ops_) accumulate(t, op);
  return t;
}

std::uint64_t count_params(const ModelSpec& spec) {
  return ModelGraph(spec, 1, 1).totals().params;
}

bool matches_published_params(const ModelSpec& spec, std::uint64_t params) {
  if (!spec.published_params) return false;
  const std::uint64_t unit = spec.published_params_precision;
  return (params + unit / 2) / unit * unit == *spec.published_params;
}

double megatron_train_flops_per_token(const ModelSpec& spec, std::int64_t seq_len,
                                      bool full_recompute) {
  const double l = static_cast<double>(spec.layers);
  const double h = static_cast<double>(spec.hidden);
  const double s = static_cast<double>(seq_len);
  const double v = static_cast<double>(spec.vocab_rows());
  if (full_recompute) return 96.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h));
  return 72.0 * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * l * h));
}

}  // namespace dtsim::model
