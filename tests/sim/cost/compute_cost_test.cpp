#include "sim/cost/compute_cost.hpp"

#include "sim/engine/simulator.hpp"
#include "tests/test_util.hpp"

using dtsim::lower::Phase;

namespace {

// One GEMM op, (m x k) by (k x n), as the model graph describes it (whole op, before tp).
dtsim::model::Op gemm_op(double m, double k, double n) {
  dtsim::model::Op op;
  op.kind = dtsim::model::OpKind::MlpUp;
  op.tp_split = dtsim::model::TpSplit::Column;
  op.gemm_m = m;
  op.gemm_k = k;
  op.gemm_n = n;
  op.fwd_flops = 2 * m * k * n;
  op.bwd_input_flops = op.fwd_flops;
  op.bwd_weight_flops = op.fwd_flops;
  return op;
}

// A plan of one sequence of 1024 tokens split over tp and cp ranks, with sequence parallelism
// or without.
dtsim::plan::Plan split_plan(int tp, int cp, bool sp) {
  dtsim::plan::Plan plan;
  plan.micro_batch_size = 1;
  plan.seq_len = 1024;
  plan.tp = tp;
  plan.cp = cp;
  plan.sequence_parallel = sp;
  return plan;
}

}  // namespace

TEST_CASE("GEMM time follows the device's waves of tiles", "[cost]") {
  // The A100's catalog entry: 108 SMs, 256 x 128 tiles, one tile per SM (NVIDIA's Matrix
  // Multiplication Background guide), at the catalog's GEMM efficiency.
  auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  REQUIRE(device.efficiency.gemm_waves);
  CHECK(device.efficiency.gemm_waves->sm_count == 108);
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  dtsim::plan::Plan plan;
  device.efficiency.launch_overhead_s.value = 0;
  const dtsim::cost::ComputeCost cost(g, plan, device);
  const double rate = device.peak_flops_for(plan.precision) * device.efficiency.gemm.value;
  const double k = 16384;  // deep enough to be compute-bound

  // 12 x 9 = 108 tiles: one full wave, the catalog's efficiency exactly.
  const auto full = gemm_op(12 * 256, k, 9 * 128);
  CHECK(cost.op_seconds(full, Phase::Forward) == Approx(full.fwd_flops / rate));
  // One more row of tiles (12 x 10 = 120): a second wave almost empty, so twice the time of
  // one wave for 10/9 of the work.
  const auto spill = gemm_op(12 * 256, k, 10 * 128);
  CHECK(cost.op_seconds(spill, Phase::Forward) == Approx(2 * full.fwd_flops / rate));
  // A ragged edge pads to whole tiles (tile quantization): n = 9·128 + 1 runs 120 tiles too.
  const auto ragged = gemm_op(12 * 256, k, 9 * 128 + 1);
  CHECK(cost.op_seconds(ragged, Phase::Forward) == Approx(2 * full.fwd_flops / rate));

  // Backward: the input gradient writes m x k, the weight gradient k x n; each half the FLOPs.
  // m x k = 12 x 128 tiles (15 waves, 1536 of 1620 slots); k x n = 64 x 9 = 576 (6 waves).
  const double in_eff = 1536.0 / 1620.0, w_eff = 576.0 / 648.0;
  CHECK(cost.op_seconds(full, Phase::BackwardInput) == Approx(full.fwd_flops / rate / in_eff));
  CHECK(cost.op_seconds(full, Phase::BackwardWeight) == Approx(full.fwd_flops / rate / w_eff));
  CHECK(cost.op_seconds(full, Phase::Backward) ==
        Approx(cost.op_seconds(full, Phase::BackwardInput) +
               cost.op_seconds(full, Phase::BackwardWeight)));

  // Tensor parallelism splits a column-parallel layer's outputs: n / tp per rank.
  plan.tp = 2;
  const dtsim::cost::ComputeCost split(g, plan, device);
  const auto wide = gemm_op(12 * 256, k, 18 * 128);
  CHECK(split.op_seconds(wide, Phase::Forward) == Approx(full.fwd_flops / rate));

  // Without waves in the catalog, the efficiency does not depend on the shape.
  device.efficiency.gemm_waves.reset();
  const dtsim::cost::ComputeCost flat(g, plan, device);
  CHECK(flat.op_seconds(spill, Phase::Forward) == Approx(spill.fwd_flops / 2 / rate));
}

TEST_CASE("each split of a GEMM shapes the rank's tiles before its waves", "[cost]") {
  // Every case is built so that the rank's share is the one-wave 12 x 9 tiles of the A100
  // (108 SMs, 256 x 128) only if the split is applied to the right dimension.
  auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  device.efficiency.launch_overhead_s.value = 0;
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  const double rate = device.peak_flops_for(dtsim::Precision::Bf16) * device.efficiency.gemm.value;
  const double k = 16384;
  // (ComputeCost keeps a reference to its plan: the plans outlive the costs.)
  auto plan_with = [](int tp, int cp, bool sp) {
    dtsim::plan::Plan plan;
    plan.tp = tp;
    plan.cp = cp;
    plan.sequence_parallel = sp;
    return plan;
  };
  const auto plain = plan_with(1, 1, false), tp2_plan = plan_with(2, 1, false),
             cp2_plan = plan_with(1, 2, false), sp_plan = plan_with(2, 1, true);
  // One full wave's time for the rank's share of `op` (its FLOPs over the split).
  auto one_wave = [&](const dtsim::model::Op& op, double split) {
    return op.fwd_flops / split / rate;
  };

  // Row-parallel (attention out, MLP down): tp splits k, the inner dimension. The forward
  // output m x n stays whole (one wave); the input gradient m x (k/tp) = 12 x 64 tiles.
  auto row = gemm_op(12 * 256, 2 * 8192, 9 * 128);
  row.kind = dtsim::model::OpKind::MlpDown;
  row.tp_split = dtsim::model::TpSplit::Row;
  const dtsim::cost::ComputeCost tp2(g, tp2_plan, device);
  CHECK(tp2.op_seconds(row, Phase::Forward) == Approx(one_wave(row, 2)));
  CHECK(tp2.op_seconds(row, Phase::BackwardInput) ==
        Approx(one_wave(row, 2) / (768.0 / 864.0)));  // 768 tiles in 8 waves of 108

  // Vocabulary-parallel head: tp splits the vocabulary (n), as a column-parallel layer.
  auto head = gemm_op(12 * 256, k, 18 * 128);
  head.kind = dtsim::model::OpKind::LmHead;
  head.tp_split = dtsim::model::TpSplit::Vocab;
  CHECK(tp2.op_seconds(head, Phase::Forward) == Approx(one_wave(head, 2)));

  // Context parallelism splits the tokens (m) of every GEMM.
  const auto tall = gemm_op(24 * 256, k, 9 * 128);
  const dtsim::cost::ComputeCost cp2(g, cp2_plan, device);
  CHECK(cp2.op_seconds(tall, Phase::Forward) == Approx(one_wave(tall, 2)));

  // Sequence parallelism splits the tokens of the GEMMs tensor parallelism leaves whole.
  auto whole = gemm_op(24 * 256, k, 9 * 128);
  whole.kind = dtsim::model::OpKind::Router;
  whole.tp_split = dtsim::model::TpSplit::None;
  const dtsim::cost::ComputeCost sp(g, sp_plan, device);
  CHECK(sp.op_seconds(whole, Phase::Forward) == Approx(one_wave(whole, 2)));
  // ... and not those it splits already (a column-parallel layer: n / tp, m whole).
  const auto column = gemm_op(12 * 256, k, 18 * 128);
  CHECK(sp.op_seconds(column, Phase::Forward) == Approx(one_wave(column, 2)));

  // Expert GEMMs run at the flat efficiency (their token counts vary with the routing).
  auto expert = gemm_op(12 * 256, k, 10 * 128);
  expert.expert = true;
  const dtsim::cost::ComputeCost flat(g, plain, device);
  CHECK(flat.op_seconds(expert, Phase::Forward) == Approx(one_wave(expert, 1)));
}

TEST_CASE("without gradient-accumulation fusion each backward adds a pass over the weights",
          "[cost]") {
  auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  dtsim::plan::Plan fused;
  fused.tp = 2;
  dtsim::plan::Plan separate = fused;
  separate.grad_accumulation_fusion = false;
  const dtsim::cost::ComputeCost with(g, fused, device), without(g, separate, device);
  const double bw = device.memory_bw_bytes_per_s.value * device.efficiency.memory_bw.value;
  const double launch = device.efficiency.launch_overhead_s.value;
  auto op = gemm_op(2048, 4096, 4096);
  op.params = 4096 * 4096;
  // The rank's half of the weights (column-parallel over tp 2): read the fresh bf16 gradient
  // (2 bytes) and the fp32 accumulator (4, bf16's default gradient precision), write the
  // accumulator (4).
  const double pass = 4096.0 * 4096 / 2 * (2 + 4 + 4) / bw + launch;
  CHECK(without.accumulation_seconds(op, Phase::BackwardWeight) == Approx(pass));
  CHECK(without.op_seconds(op, Phase::BackwardWeight) ==
        Approx(with.op_seconds(op, Phase::BackwardWeight) + pass));
  CHECK(without.op_seconds(op, Phase::Backward) ==
        Approx(with.op_seconds(op, Phase::Backward) + pass));
  // The input gradient and the forward pass do not touch the accumulator; with fusion nothing
  // is added.
  CHECK(without.op_seconds(op, Phase::BackwardInput) == with.op_seconds(op, Phase::BackwardInput));
  CHECK(without.op_seconds(op, Phase::Forward) == with.op_seconds(op, Phase::Forward));
  CHECK(with.accumulation_seconds(op, Phase::Backward) == 0);
  // A norm's weights have no weight-gradient GEMM: their gradient comes with the input's, and
  // is not split over tp (replicated).
  dtsim::model::Op norm;
  norm.kind = dtsim::model::OpKind::Norm;
  norm.params = 4096;
  norm.tp_replicated_params = 4096;
  CHECK(without.accumulation_seconds(norm, Phase::BackwardInput) ==
        Approx(4096.0 * 10 / bw + launch));
  CHECK(without.accumulation_seconds(norm, Phase::BackwardWeight) == 0);

  // A whole step: the backward grows by one pass per weight-bearing op per micro-batch.
  dtsim::plan::Plan whole;
  whole.micro_batch_size = 1;
  whole.global_batch_size = 4;
  whole.seq_len = 32;
  dtsim::plan::Plan unfused = whole;
  unfused.grad_accumulation_fusion = false;
  const auto cluster = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("default"), 1);
  whole.dp = unfused.dp = 1;
  auto net = dtsim::network::make_analytical(cluster);
  const double a = dtsim::engine::simulate(g, whole, cluster, *net).prediction.step_time_s;
  const double b = dtsim::engine::simulate(g, unfused, cluster, *net).prediction.step_time_s;
  double passes = 0;
  const dtsim::cost::ComputeCost step_cost(g, unfused, cluster.device);
  for (std::size_t id = 0; id < g.ops().size(); ++id) {
    passes +=
        step_cost.accumulation_seconds(g.op(static_cast<dtsim::model::OpId>(id)), Phase::Backward);
  }
  CHECK(passes > 0);
  CHECK(b - a == Approx(4 * passes).epsilon(1e-6));
}

// FlashAttention's core: compute-bound at the device's attention efficiency over the FLOPs it
// executes (the causal half, five GEMMs' worth in the backward); the unfused core moves its s²
// tensors through memory and takes longer at long sequences. A profile's flash_attention rate
// replaces the roofline.
TEST_CASE("FlashAttention's core is priced by the FLOPs it executes", "[cost]") {
  using dtsim::model::AttentionKernel;
  auto device = dtsim::cluster::load_device("h100-sxm");
  device.efficiency.launch_overhead_s.value = 0;
  const auto spec = dtsim::model::load_model("llama3-8b");
  dtsim::plan::Plan plan;
  plan.micro_batch_size = 1;
  plan.seq_len = 8192;
  plan.tp = 2;
  plan.attention = AttentionKernel::Flash;
  const auto flash = dtsim::plan::graph_of(spec, plan);
  dtsim::plan::Plan unfused_plan = plan;
  unfused_plan.attention = AttentionKernel::Unfused;
  const auto unfused = dtsim::plan::graph_of(spec, unfused_plan);
  const auto core_of = [](const dtsim::model::ModelGraph& g) {
    for (auto id : g.layer_ops(0)) {
      if (g.op(id).kind == dtsim::model::OpKind::AttentionCore) return g.op(id);
    }
    FAIL("no attention core");
    return dtsim::model::Op{};
  };
  const auto core = core_of(flash);
  const dtsim::cost::ComputeCost cost(flash, plan, device);
  const double rate = device.peak_flops_for(plan.precision) * device.efficiency.attention.value;
  // 8192 rows: 64 blocks, 64·65/2 of 64² block pairs; tp 2 halves the heads.
  const double executed = core.fwd_flops * (65.0 / 128.0) / 2;
  CHECK(cost.op_seconds(core, Phase::Forward) == Approx(executed / rate).epsilon(1e-12));
  CHECK(cost.op_seconds(core, Phase::Backward) == Approx(2.5 * executed / rate).epsilon(1e-12));
  CHECK(cost.op_seconds(core, Phase::BackwardInput) == cost.op_seconds(core, Phase::Backward));
  CHECK(cost.op_seconds(core, Phase::BackwardWeight) == 0);
  // The counted FLOPs stay the model's.
  CHECK(cost.op_flops(core, Phase::Forward) == core.fwd_flops / 2);
  const dtsim::cost::ComputeCost unfused_cost(unfused, unfused_plan, device);
  const auto unfused_core = core_of(unfused);
  CHECK(unfused_cost.op_seconds(unfused_core, Phase::Forward) >
        2 * cost.op_seconds(core, Phase::Forward));

  dtsim::cost::Profile profile;
  profile.file = "p.json";
  profile.precision = plan.precision;
  profile.gemm = {{1024, 1024, 1024, 1e-4}, {4096, 4096, 4096, 4e-3}};
  profile.index_sizes();
  profile.ops[{"flash_attention", "fwd"}] = {1e14, true};
  profile.ops[{"attention", "fwd"}] = {1e12, true};
  const dtsim::cost::ComputeCost measured(flash, plan, device, &profile);
  CHECK(measured.op_seconds(core, Phase::Forward) == Approx(core.fwd_flops / 2 / 1e14));
}

TEST_CASE("an MoE's token moves are memory-bound kernels after the router and the experts",
          "[cost]") {
  auto device = dtsim::cluster::load_device("h100-sxm");
  const double launch = device.efficiency.launch_overhead_s.value;
  const double hbm = device.memory_bw_bytes_per_s.value * device.efficiency.memory_bw.value;
  // With and without the moves: the difference is their bytes at the device's bandwidth, one
  // launch each, in the forward, the backward and its input-gradient pass only.
  auto check = [&](int tp, int cp, bool sp, double split) {
    dtsim::plan::Plan plan = split_plan(tp, cp, sp);
    plan.expert_load = 1.5;  // the busiest experts' compute, not the moves of own tokens
    const auto graph = dtsim::plan::graph_of(dtsim::model::load_model("mixtral-8x7b"), plan);
    const dtsim::cost::ComputeCost cost(graph, plan, device);
    int seen = 0;
    for (const auto& op : graph.ops()) {
      if (op.fwd_move_bytes == 0) continue;
      ++seen;
      auto still = op;
      still.fwd_move_bytes = still.bwd_move_bytes = 0;
      INFO(op.name << " tp " << tp << " cp " << cp << " sp " << sp);
      CHECK(cost.op_seconds(op, Phase::Forward) - cost.op_seconds(still, Phase::Forward) ==
            Approx(op.fwd_move_bytes / split / hbm + launch));
      CHECK(cost.op_seconds(op, Phase::Backward) - cost.op_seconds(still, Phase::Backward) ==
            Approx(op.bwd_move_bytes / split / hbm + launch));
      CHECK(cost.op_seconds(op, Phase::BackwardInput) -
                cost.op_seconds(still, Phase::BackwardInput) ==
            Approx(op.bwd_move_bytes / split / hbm + launch));
      CHECK(cost.op_seconds(op, Phase::BackwardWeight) ==
            cost.op_seconds(still, Phase::BackwardWeight));
    }
    CHECK(seen == 64);  // 32 blocks: a router and a down projection each
  };
  check(1, 1, false, 1);
  check(2, 1, false, 1);  // every tp rank routes the whole sequence
  check(2, 1, true, 2);   // under sequence parallelism its own half
  check(1, 2, false, 2);  // cp splits the tokens
}

TEST_CASE("every tp rank writes the whole output of the vocabulary-parallel embedding", "[cost]") {
  auto device = dtsim::cluster::load_device("h100-sxm");
  device.efficiency.launch_overhead_s.value = 0;
  // Learned positions (GPT-2) read a second table; rotary ones (Llama) none.
  for (const auto& [model, p] : {std::pair{"gpt2-124m", 1.0}, {"llama3-8b", 0.0}}) {
    auto seconds = [&](int tp, int cp, bool sp, Phase phase) {
      const dtsim::plan::Plan plan = split_plan(tp, cp, sp);
      const auto graph = dtsim::plan::graph_of(dtsim::model::load_model(model), plan);
      const dtsim::cost::ComputeCost cost(graph, plan, device);
      for (const auto& op : graph.ops()) {
        if (op.kind == dtsim::model::OpKind::Embedding) return cost.op_seconds(op, phase);
      }
      FAIL("no embedding");
      return 0.0;
    };
    INFO(model);
    const double fwd = seconds(1, 1, false, Phase::Forward);
    const double bwd = seconds(1, 1, false, Phase::Backward);
    REQUIRE(fwd > 0);
    REQUIRE(bwd > 0);
    for (const int tp : {2, 4}) {
      INFO("tp " << tp);
      // The forward, in units of the output: the shard's table rows (1/tp) and the positions
      // (p) read, the whole output written; at tp 1, 2 + p.
      const double f = (1.0 / tp + p + 1.0) / (2.0 + p);
      CHECK(seconds(tp, 1, false, Phase::Forward) / fwd == Approx(f).epsilon(1e-9));
      // The backward: the output gradient's rows read (the shard's tokens', or all of them for
      // the positions' gradient), the shard's table-gradient rows (2/tp) and the positions'
      // (2p) updated; at tp 1, 3 + 2p.
      const double b = ((p > 0 ? 1.0 : 1.0 / tp) + 2.0 / tp + 2.0 * p) / (3.0 + 2.0 * p);
      CHECK(seconds(tp, 1, false, Phase::Backward) / bwd == Approx(b).epsilon(1e-9));
      // Sequence parallelism changes none of it: the lookup is whole before the
      // reduce-scatter.
      CHECK(seconds(tp, 1, true, Phase::Forward) == seconds(tp, 1, false, Phase::Forward));
      CHECK(seconds(tp, 1, true, Phase::Backward) == seconds(tp, 1, false, Phase::Backward));
      // Context parallelism splits the tokens, so all of it.
      CHECK(seconds(tp, 2, false, Phase::Forward) / fwd == Approx(f / 2).epsilon(1e-9));
      CHECK(seconds(tp, 2, false, Phase::Backward) / bwd == Approx(b / 2).epsilon(1e-9));
    }
  }
}

TEST_CASE("the optimizer clears the gradient buffer where it persists and reduces in place",
          "[cost]") {
  // Megatron-LM's zero_grad_buffer: one memset of the rank's gradients each step, where they
  // live in one buffer reduced in place (ZeRO-0, ZeRO-1 in place, one dp rank); staged ZeRO-1
  // clears a bucket when its reduce-scatter packs it, and ZeRO-2/3 free theirs.
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  const auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  const auto params = dtsim::model::count_params(spec);
  struct Case {
    int dp, zero;
    bool in_place;
    std::uint64_t cleared;
  };
  for (const Case c :
       {Case{2, 0, false, params}, Case{2, 1, true, params}, Case{1, 1, false, params},
        Case{2, 1, false, 0}, Case{2, 2, false, 0}, Case{2, 3, false, 0}}) {
    INFO("dp " << c.dp << " ZeRO-" << c.zero << (c.in_place ? " in place" : ""));
    dtsim::plan::Plan plan;
    plan.dp = c.dp;
    plan.global_batch_size = c.dp;
    plan.seq_len = 32;
    plan.zero_stage = c.zero;
    plan.zero_in_place = c.in_place;
    const auto program = dtsim::lower::lower(g, plan);
    const dtsim::lower::Task* opt = nullptr;
    for (const auto& t : program.ranks[0].tasks) {
      if (t.phase == Phase::Optimizer) opt = &t;
    }
    REQUIRE(opt != nullptr);
    CHECK(opt->cleared_params == c.cleared);
    dtsim::cost::ComputeCost cost(g, plan, device);
    // One write of the fp32 gradients (bf16's default) at the element-wise kernels' share of
    // the memory bandwidth, plus a launch, in the optimizer task's time.
    const double clear =
        c.cleared == 0
            ? 0.0
            : static_cast<double>(c.cleared) * 4 /
                      (device.memory_bw_bytes_per_s.value * device.efficiency.memory_bw.value) +
                  device.efficiency.launch_overhead_s.value;
    CHECK(cost.grad_clear_seconds(c.cleared) == Approx(clear).epsilon(1e-12));
    CHECK(cost.task_seconds(*opt) ==
          Approx(cost.optimizer_seconds(opt->params) + clear).epsilon(1e-12));
  }
}

TEST_CASE("a ZeRO weight gather copies in the rank's slice only where its master lies apart",
          "[cost]") {
  // dtexec gathers each tensor in place: the rank's slice of the fp32 master is copied (or
  // cast) into the gathered tensor, the rest arrives; at ZeRO-1/2 in fp32 the master slice
  // already lies in the gathered tensor and nothing is copied. A reduce-scatter packs its
  // bucket whatever the precision.
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  const auto device = dtsim::cluster::load_device("a100-sxm4-80gb");
  const double bw = device.memory_bw_bytes_per_s.value * device.efficiency.memory_bw.value;
  const double launch = device.efficiency.launch_overhead_s.value;
  using dtsim::lower::CollectiveKind;
  const std::uint64_t bytes = 1 << 24;
  for (const int zero : {1, 2, 3}) {
    for (const auto precision : {dtsim::Precision::Fp32, dtsim::Precision::Bf16}) {
      INFO("ZeRO-" << zero << " " << dtsim::to_string(precision));
      dtsim::plan::Plan plan;
      plan.dp = 4;
      plan.zero_stage = zero;
      plan.precision = precision;
      const dtsim::cost::ComputeCost cost(g, plan, device);
      const bool copies = zero == 3 || precision != dtsim::Precision::Fp32;
      CHECK(cost.gather_copies_in() == copies);
      CHECK(cost.staging_seconds(CollectiveKind::AllGather, bytes, 4) ==
            Approx(copies ? 2.0 * bytes / 4 / bw + launch : 0.0).epsilon(1e-12));
      CHECK(cost.staging_seconds(CollectiveKind::ReduceScatter, bytes, 4) > 0);
      CHECK(cost.staging_seconds(CollectiveKind::AllGather, bytes, 1) == 0);
    }
  }
}
