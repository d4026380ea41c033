#include "sim/model/model_graph.hpp"

#include <map>
#include <string>
#include <vector>

#include "sim/common/data_files.hpp"
#include "tests/test_util.hpp"

using dtsim::model::load_model;
using dtsim::model::ModelGraph;
using dtsim::model::OpKind;

TEST_CASE("training FLOPs equal Megatron-LM's formula for GPT models", "[model][graph]") {
  // Forward per block: QKV 6·T·h², scores and P·V 4·T·s·h, projection 2·T·h², MLP 16·T·h²
  // (T = b·s tokens), LM head 2·T·h·V; backward twice the forward. So training per token is
  // 72·l·h²·(1 + s/(6h) + V/(12·l·h)) (Narayanan et al. 2021 §5.1), and with full recompute
  // (one more forward of the blocks) 96·l·h²·(1 + s/(6h) + V/(16·l·h)) (Eq. 3).
  for (const char* name : {"gpt2-124m", "megatron-1.7b", "megatron-145.6b", "gpt3-175b"}) {
    const auto spec = load_model(name);
    REQUIRE(spec.is_megatron_gpt());
    const std::int64_t b = 2, s = spec.seq_len;
    const ModelGraph g(spec, b, s);
    const auto t = g.totals();
    const double tokens = static_cast<double>(b * s);
    CHECK((t.fwd_flops + t.bwd_flops) / tokens ==
          Approx(dtsim::model::megatron_train_flops_per_token(spec, s, false)).epsilon(1e-12));
    double block_fwd = 0;
    for (int l = 0; l < spec.layers; ++l) block_fwd += g.layer_totals(l).fwd_flops;
    CHECK((t.fwd_flops + t.bwd_flops + block_fwd) / tokens ==
          Approx(dtsim::model::megatron_train_flops_per_token(spec, s, true)).epsilon(1e-12));
  }
}

TEST_CASE("GQA, SwiGLU and MoE FLOPs", "[model][graph]") {
  const auto llama = load_model("llama3-8b");
  const ModelGraph g(llama, 1, 1024);
  // QKV of one block: 2·T·h·(h + 2·kv·d) = 2·1024·4096·(4096 + 2·1024).
  CHECK(g.op(g.layer_ops(0)[1]).kind == OpKind::QkvProj);
  CHECK(g.op(g.layer_ops(0)[1]).fwd_flops == 2.0 * 1024 * 4096 * (4096 + 2048));
  // SwiGLU MLP: three h x f GEMMs, 6·T·h·f.
  double mlp = 0;
  for (auto id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    if (op.kind == OpKind::MlpUp || op.kind == OpKind::MlpDown) mlp += op.fwd_flops;
  }
  CHECK(mlp == 6.0 * 1024 * 4096 * 14336);

  const auto mixtral = load_model("mixtral-8x7b");
  const ModelGraph m(mixtral, 1, 1024);
  double experts = 0;
  for (auto id : m.layer_ops(0)) {
    const auto& op = m.op(id);
    if (op.expert) experts += op.fwd_flops;
  }
  // Each token goes through top_k = 2 experts: 2 x 6·T·h·f_e.
  CHECK(experts == 2 * 6.0 * 1024 * 4096 * 14336);
}

TEST_CASE("an MoE block moves its tokens to their experts and back", "[model][graph]") {
  // bf16 (2 bytes): the dispatch reads T·h and writes top_k copies; the combine reads the
  // copies and writes T·h; the combine's backward reads the output gradient and the copies
  // and writes the copies' gradients. No other op moves tokens, and a dense model none.
  const auto mixtral = load_model("mixtral-8x7b");
  const double T = 1024, h = 4096, k = 2, a = 2;
  const ModelGraph m(mixtral, 1, 1024);
  int movers = 0;
  for (const auto& op : m.ops()) {
    if (op.fwd_move_bytes == 0 && op.bwd_move_bytes == 0) continue;
    ++movers;
    INFO(op.name);
    if (op.kind == OpKind::Router) {
      CHECK(op.fwd_move_bytes == a * T * h * (1 + k));
      CHECK(op.bwd_move_bytes == a * T * h * (1 + k));
    } else {
      CHECK(op.kind == OpKind::MlpDown);
      CHECK(op.fwd_move_bytes == a * T * h * (1 + k));
      CHECK(op.bwd_move_bytes == a * T * h * (1 + 2 * k));
    }
  }
  CHECK(movers == 2 * mixtral.layers);
  const ModelGraph dense(load_model("llama3-8b"), 1, 1024);
  for (const auto& op : dense.ops()) CHECK(op.fwd_move_bytes + op.bwd_move_bytes == 0);
}

TEST_CASE("shared experts: a dense MLP over every token beside the routed experts",
          "[model][graph]") {
  // Qwen2 57B-A14B: 8 of 64 experts of 2560 a token, and shared experts of 20480.
  const auto qwen = load_model("qwen2-57b-a14b");
  const double T = 1024, h = 3584, a = 2;
  const ModelGraph g(qwen, 1, 1024);
  std::vector<std::string> names;
  double routed = 0, shared = 0;
  for (auto id : g.layer_ops(0)) {
    const auto& op = g.op(id);
    names.push_back(op.name);
    if (op.kind != OpKind::MlpUp && op.kind != OpKind::MlpDown) continue;
    (op.expert ? routed : shared) += op.fwd_flops;
  }
  CHECK(routed == 8 * 6.0 * T * h * 2560);
  CHECK(shared == 6.0 * T * h * 20480);
  // After the routed experts in forward order; the down projection adds their output to its
  // own (reads both, writes one) and feeds the residual.
  const std::vector<std::string> mlp(names.end() - 8, names.end());
  CHECK(mlp == std::vector<std::string>{"L0.router", "L0.experts_up", "L0.experts_act",
                                        "L0.experts_down", "L0.shared_up", "L0.shared_act",
                                        "L0.shared_down", "L0.mlp_residual"});
  const auto ops = g.layer_ops(0);
  const auto at = [&](std::size_t from_end) { return ops[ops.size() - from_end]; };
  const dtsim::model::OpId norm2 = ops[ops.size() - 9], experts_down = at(5), shared_up = at(4),
                           shared_down = at(2);
  CHECK(g.op(norm2).kind == OpKind::Norm);
  CHECK(g.predecessors(shared_up) == std::vector<dtsim::model::OpId>{norm2});
  CHECK(g.predecessors(shared_down) == std::vector<dtsim::model::OpId>{at(3), experts_down});
  CHECK(g.predecessors(at(1)).front() == shared_down);
  CHECK(g.op(shared_down).fwd_move_bytes == 3 * a * T * h);
  CHECK(g.op(shared_down).bwd_move_bytes == 2 * a * T * h);
  // Dense ops: split over tp like a dense MLP, not over ep; the input is the router's, kept
  // once.
  CHECK_FALSE(g.op(shared_up).expert);
  CHECK(g.op(shared_up).tp_split == dtsim::model::TpSplit::Column);
  CHECK(g.op(shared_down).tp_split == dtsim::model::TpSplit::Row);
  CHECK(g.op(shared_up).saved_bytes == 0);
  CHECK(g.op(shared_up).params == static_cast<std::uint64_t>(h) * 2 * 20480);
}

TEST_CASE("dense blocks among the experts' have a dense MLP of their own width", "[model][graph]") {
  // Llama 4 Maverick: experts (128 of 8192, one a token, beside a shared one) in the odd
  // blocks, dense MLPs of 16384 in the even ones.
  const auto maverick = load_model("llama4-maverick-17b-128e");
  const ModelGraph g(maverick, 1, 256);
  const auto names = [&](int layer) {
    std::vector<std::string> out;
    for (auto id : g.layer_ops(layer)) out.push_back(g.op(id).name);
    return std::vector<std::string>(out.end() - 4, out.end());
  };
  CHECK(names(0) ==
        std::vector<std::string>{"L0.mlp_up", "L0.mlp_act", "L0.mlp_down", "L0.mlp_residual"});
  CHECK(names(1) == std::vector<std::string>{"L1.shared_up", "L1.shared_act", "L1.shared_down",
                                             "L1.mlp_residual"});
  const double h = 5120;
  const auto params = [&](int layer, OpKind kind, bool expert) {
    for (auto id : g.layer_ops(layer)) {
      const auto& op = g.op(id);
      if (op.kind == kind && op.expert == expert) return static_cast<double>(op.params);
    }
    return 0.0;
  };
  CHECK(params(0, OpKind::MlpUp, false) == h * 2 * 16384);
  CHECK(params(0, OpKind::Router, false) == 0);
  CHECK(params(0, OpKind::MlpUp, true) == 0);
  CHECK(params(47, OpKind::MlpUp, true) == 128 * h * 2 * 8192);
  CHECK(params(47, OpKind::MlpUp, false) == h * 2 * 8192);  // the shared expert
  // 400.7B in all (Meta's 400B total, with the vision model not modelled here), of which a
  // token activates 17.2B (Meta's 17B).
  CHECK(dtsim::model::count_params(maverick) == 400711848960ULL);
}

TEST_CASE("multi-head latent attention: latents down, their norm, then heads up",
          "[model][graph]") {
  // DeepSeek-V3: h 7168, 128 heads; latents of 1536 (queries) and 512 (keys and values) beside
  // the keys' RoPE part of 64; queries and keys 128 + 64 a head, values 128.
  const auto v3 = load_model("deepseek-v3-671b");
  const std::int64_t b = 1, s = 4096;
  const ModelGraph g(v3, b, s);
  const double T = static_cast<double>(b * s), h = 7168, heads = 128;
  std::map<std::string, const dtsim::model::Op*> op;
  std::vector<std::string> order;
  for (auto id : g.layer_ops(3)) {
    op[g.op(id).name] = &g.op(id);
    order.push_back(g.op(id).name);
  }
  CHECK(std::vector<std::string>(order.begin(), order.begin() + 8) ==
        std::vector<std::string>{"L3.norm1", "L3.latent_down", "L3.latent_norm", "L3.q_up",
                                 "L3.kv_up", "L3.attention", "L3.attn_out", "L3.attn_residual"});
  // The down projection: every latent at once, its weights whole on every tp rank.
  const auto& down = *op.at("L3.latent_down");
  CHECK(down.kind == OpKind::LatentDown);
  CHECK(down.tp_split == dtsim::model::TpSplit::None);
  CHECK(down.params == 7168ULL * (1536 + 512 + 64));
  CHECK(down.tp_replicated_params == down.params);
  CHECK(down.fwd_flops == 2 * T * h * (1536 + 512 + 64));
  // The latents' RMSNorms (not the RoPE part's), replicated too.
  const auto& norm = *op.at("L3.latent_norm");
  CHECK(norm.kind == OpKind::Norm);
  CHECK(norm.params == 1536 + 512);
  CHECK(norm.tp_replicated_params == norm.params);
  // The up projections split by heads, each entering tp's region with its latent.
  const auto& q = *op.at("L3.q_up");
  const auto& kv = *op.at("L3.kv_up");
  for (const auto* up : {&q, &kv}) {
    CHECK(up->kind == OpKind::QkvProj);
    CHECK(up->tp_split == dtsim::model::TpSplit::Column);
  }
  CHECK(q.params == 1536ULL * 128 * 192);
  CHECK(q.tp_enter_width == 1536);
  CHECK(q.fwd_flops == 2 * T * 1536 * heads * 192);
  CHECK(kv.params == 512ULL * 128 * (128 + 128));
  CHECK(kv.tp_enter_width == 512 + 64);
  // The core: Q·K^T over 192-wide heads, P·V over 128-wide values.
  const auto& core = *op.at("L3.attention");
  CHECK(core.fwd_flops == 2.0 * b * heads * s * s * (192 + 128));
  CHECK(g.predecessors(g.layer_ops(3)[5]) ==
        std::vector<dtsim::model::OpId>{g.layer_ops(3)[3], g.layer_ops(3)[4]});
  // It keeps Q, K and V (and the s² terms): 2 bytes x T x (128·192 + 128·192 + 128·128).
  CHECK(core.saved_bytes - core.saved_quadratic_bytes ==
        2ULL * 4096 * (128 * 192 + 128 * 192 + 128 * 128));
  // The output projection reads the heads' values.
  const auto& out = *op.at("L3.attn_out");
  CHECK(out.params == 128ULL * 128 * 7168);
  CHECK(out.gemm_k == 128 * 128);
  // DeepSeek-V2-Lite: queries projected from the block's input (which enters tp's region as a
  // QKV projection's does), keys and values from their latent.
  const auto lite = load_model("deepseek-v2-lite-16b");
  const ModelGraph l(lite, b, s);
  const auto& ops = l.layer_ops(1);
  CHECK(l.op(ops[3]).name == "L1.q_proj");
  CHECK(l.op(ops[3]).tp_enter_width == 0);                                   // the hidden width
  CHECK(l.predecessors(ops[3]) == std::vector<dtsim::model::OpId>{ops[0]});  // norm1
  CHECK(l.op(ops[1]).params == 2048ULL * (512 + 64));
  CHECK(l.op(ops[2]).params == 512);
}

TEST_CASE("the graph is a DAG in topological order with per-layer groups", "[model][graph]") {
  const auto spec = load_model("tiny");
  const ModelGraph g(spec, 1, 16);
  std::map<dtsim::model::OpId, std::size_t> position;
  for (std::size_t i = 0; i < g.topological_order().size(); ++i) {
    position[g.topological_order()[i]] = i;
  }
  REQUIRE(position.size() == g.size());
  for (dtsim::model::OpId id = 0; id < g.size(); ++id) {
    for (auto next : g.successors(id)) CHECK(position[id] < position[next]);
  }
  std::size_t grouped = 0;
  for (int l = -1; l <= spec.layers; ++l) grouped += g.layer_ops(l).size();
  CHECK(grouped == g.size());
  CHECK(g.op(g.layer_ops(-1).front()).kind == OpKind::Embedding);
  CHECK(g.op(g.layer_ops(static_cast<int>(spec.layers)).back()).kind == OpKind::Loss);
  // The loss reads the logits and their softmax statistics, which need no backward.
  const auto head = g.layer_ops(static_cast<int>(spec.layers));
  REQUIRE(head.size() == 4);
  const dtsim::model::OpId lm_head = head[1], statistics = head[2], loss = head[3];
  CHECK(g.op(statistics).kind == OpKind::LossStatistics);
  CHECK(g.predecessors(statistics) == std::vector<dtsim::model::OpId>{lm_head});
  CHECK(g.predecessors(loss) == std::vector<dtsim::model::OpId>{lm_head, statistics});
  CHECK(g.op(statistics).fwd_bytes > 0);
  CHECK(g.op(statistics).bwd_bytes == 0);
  CHECK(g.op(statistics).saved_bytes == 0);
  // The residual add of attention consumes both the projection and the block input.
  for (auto id : g.layer_ops(1)) {
    if (g.op(id).name == "L1.attn_residual") CHECK(g.predecessors(id).size() == 2);
  }
}

TEST_CASE("every shipped model builds a graph whose parameters add up", "[model][graph]") {
  for (const std::string& name : dtsim::list_data_names("models")) {
    DYNAMIC_SECTION(name) {
      const auto spec = load_model(name);
      const ModelGraph g(spec, 1, 8);
      CHECK(g.totals().params == dtsim::model::count_params(spec));
      CHECK(g.size() > static_cast<std::size_t>(spec.layers));
    }
  }
}

TEST_CASE("FlashAttention keeps no s² tensor and executes the causal half, scores again",
          "[model][graph]") {
  using dtsim::model::AttentionKernel;
  const auto spec = load_model("gpt3-175b");  // with dropout: its masks go too
  REQUIRE(spec.dropout);
  const std::int64_t b = 2, s = 2048;
  const ModelGraph unfused(spec, b, s);
  const ModelGraph flash(spec, b, s, 2, AttentionKernel::Flash);
  CHECK(flash.attention() == AttentionKernel::Flash);
  // The model's FLOPs are the same (MFU counts them so); only the core's kernels differ.
  CHECK(flash.totals().fwd_flops == unfused.totals().fwd_flops);
  CHECK(flash.totals().bwd_flops == unfused.totals().bwd_flops);
  REQUIRE(flash.size() == unfused.size());
  const double T = static_cast<double>(b * s), h = static_cast<double>(spec.hidden);
  const double rows = static_cast<double>(b * spec.heads * s);
  int cores = 0;
  for (std::size_t i = 0; i < flash.size(); ++i) {
    const auto& f = flash.op(i);
    const auto& u = unfused.op(i);
    if (f.kind != OpKind::AttentionCore) {
      CHECK(f.saved_bytes == u.saved_bytes);
      CHECK(f.fwd_bytes == u.fwd_bytes);
      CHECK(f.kernel_fwd_flops == 0);
      continue;
    }
    ++cores;
    CHECK(u.kernel_fwd_flops == 0);
    CHECK(f.saved_quadratic_bytes == 0);
    // Korthikanti's 4sbh of Q, K, V... plus FlashAttention's fp32 log-sum-exp per row and head,
    // against the unfused core's 5as²b more (softmax, dropout mask and output).
    CHECK(static_cast<double>(f.saved_bytes) == 2 * T * 3 * h + 4 * rows);
    CHECK(static_cast<double>(u.saved_bytes) == 2 * T * 3 * h + 5 * rows * static_cast<double>(s));
    // 2048 rows in blocks of 128: 16 blocks, 16·17/2 of the 256 block pairs run.
    CHECK(f.kernel_fwd_flops == Approx(f.fwd_flops * 136.0 / 256.0).epsilon(1e-12));
    CHECK(f.kernel_bwd_flops == Approx(2.5 * f.kernel_fwd_flops).epsilon(1e-12));
    // Linear traffic: Q, K, V read and the output written (2 bytes each), the log-sum-exp
    // written; no pass over the s² scores.
    CHECK(f.fwd_bytes == 2 * T * 4 * h + 4 * rows);
    CHECK(f.fwd_bytes < u.fwd_bytes / 10);
  }
  CHECK(cores == spec.layers);
}
