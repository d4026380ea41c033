#include "sim/cost/compute_cost.hpp"

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
