#include "sim/model/model_graph.hpp"

#include <map>

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
