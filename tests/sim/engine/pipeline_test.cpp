// Pipeline schedules on the engine, with equal stages and free communication: the bubble
// formulas of Narayanan et al. 2021 (GPipe, 1F1B, interleaved) and Qi et al. 2023 (ZB-H1).
#include <algorithm>
#include <cmath>

#include "sim/engine/engine.hpp"
#include "sim/engine/simulator.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/lower/schedule.hpp"
#include "tests/test_util.hpp"

using dtsim::lower::Phase;
using dtsim::plan::Plan;
using dtsim::plan::Schedule;

namespace {

// Forward of a whole stage takes f, input gradients b, weight gradients w, spread evenly over
// the stage's transformer-block ops (embedding, head, communication and the optimizer are
// free), so that stages are equal however the lowering splits a pass into tasks.
class StageDurations final : public dtsim::engine::Durations {
 public:
  StageDurations(const dtsim::model::ModelGraph& g, int stages, double f, double b, double w)
      : g_(g) {
    int block_ops = 0;
    for (const auto& op : g.ops()) block_ops += is_block(op) ? 1 : 0;
    const double per_stage = static_cast<double>(block_ops) / stages;
    f_ = f / per_stage;
    b_ = b / per_stage;
    w_ = w / per_stage;
  }
  double compute_s(const dtsim::lower::Task& t) override {
    double per_op = 0;
    switch (t.phase) {
      case Phase::Forward:
        per_op = f_;
        break;
      case Phase::Backward:
        per_op = b_ + w_;
        break;
      case Phase::BackwardInput:
        per_op = b_;
        break;
      case Phase::BackwardWeight:
        per_op = w_;
        break;
      default:
        return 0;
    }
    int ops = 0;
    for (auto id = t.op_begin; id < t.op_end; ++id) {
      ops += is_block(g_.op(static_cast<std::size_t>(id))) ? 1 : 0;
    }
    return per_op * ops;
  }
  double collective_s(const dtsim::lower::Group&, const dtsim::lower::Task&) override { return 0; }
  double p2p_s(std::int64_t, std::int64_t, std::uint64_t) override { return 0; }

 private:
  bool is_block(const dtsim::model::Op& op) const {
    return op.layer >= 0 && op.layer < g_.spec().layers;
  }
  const dtsim::model::ModelGraph& g_;
  double f_ = 0, b_ = 0, w_ = 0;
};

// Bubble of every stage divided by the ideal time m·(f + b + w).
std::vector<double> bubble_ratios(Schedule schedule, int p, int m, int v, double f, double b,
                                  double w) {
  auto spec = dtsim::model::load_model("tiny");
  spec.layers = 24;
  const dtsim::model::ModelGraph g(spec, 1, 16);
  Plan plan;
  plan.pp = p;
  plan.dp = 1;
  plan.seq_len = 16;
  plan.micro_batch_size = 1;
  plan.global_batch_size = m;
  plan.schedule = schedule;
  plan.virtual_stages = v;
  REQUIRE(dtsim::plan::check_plan(plan, spec, p).ok());
  const auto program = dtsim::lower::lower(g, plan);
  StageDurations d(g, p, f, b, w);
  const auto timeline = dtsim::engine::run(program, d);
  std::vector<double> out;
  for (std::size_t s = 0; s < program.ranks.size(); ++s) {
    const auto bd =
        dtsim::engine::breakdown_of(program.ranks[s], timeline.tasks[s], timeline.makespan_s);
    out.push_back(bd.bubble_s / (m * (f + b + w)));
  }
  return out;
}

}  // namespace

TEST_CASE("passes run in rounds: one each, or a forward and a backward pass when interleaved",
          "[engine][pipeline]") {
  // Megatron-LM exchanges pipeline tensors between rounds; its interleaved steady state runs a
  // forward and a backward pass before each exchange.
  for (const auto schedule :
       {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved, Schedule::ZeroBubble}) {
    Plan p;
    p.pp = 4;
    p.schedule = schedule;
    p.virtual_stages = schedule == Schedule::Interleaved ? 2 : 1;
    p.micro_batch_size = 1;
    p.global_batch_size = 8;
    for (int stage = 0; stage < p.pp; ++stage) {
      INFO(dtsim::plan::to_string(schedule) << " stage " << stage);
      const auto passes = dtsim::lower::stage_passes(p, stage);
      REQUIRE(!passes.empty());
      CHECK(passes.front().round == 0);
      int pairs = 0;
      for (std::size_t i = 1; i < passes.size(); ++i) {
        const int step = passes[i].round - passes[i - 1].round;
        CHECK((step == 0 || step == 1));
        if (step == 0) {
          ++pairs;
          CHECK(passes[i - 1].kind == dtsim::lower::PassKind::Forward);
          CHECK(passes[i].kind == dtsim::lower::PassKind::Backward);
        }
      }
      // Interleaved: 16 virtual micro-batches, less the stage's warm-up forward passes
      // (2(pp - stage - 1) + (v - 1)pp), run as forward-backward pairs.
      const int pipelined =
          schedule == Schedule::Interleaved ? std::max(0, 16 - (2 * (p.pp - stage - 1) + p.pp)) : 0;
      CHECK(pairs == pipelined);
    }
  }
}

TEST_CASE("GPipe and 1F1B bubbles are (p-1)/m of the ideal time", "[engine][pipeline]") {
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB}) {
    for (auto [p, m] : {std::pair{4, 8}, std::pair{8, 16}, std::pair{2, 12}, std::pair{4, 4}}) {
      DYNAMIC_SECTION(to_string(s) << " p=" << p << " m=" << m) {
        for (double r : bubble_ratios(s, p, m, 1, 1.0, 1.3, 0.7)) {
          CHECK(r == Approx(static_cast<double>(p - 1) / m).epsilon(0.005));
        }
      }
    }
  }
}

TEST_CASE("interleaved 1F1B divides the bubble by v: (p-1)/(v·m)", "[engine][pipeline]") {
  for (auto [p, m, v] :
       {std::tuple{4, 8, 2}, std::tuple{4, 8, 3}, std::tuple{2, 8, 4}, std::tuple{4, 16, 2}}) {
    DYNAMIC_SECTION("p=" << p << " m=" << m << " v=" << v) {
      for (double r : bubble_ratios(Schedule::Interleaved, p, m, v, 1.0, 1.3, 0.7)) {
        CHECK(r == Approx(static_cast<double>(p - 1) / (v * m)).epsilon(0.005));
      }
    }
  }
}

TEST_CASE("ZB-H1's bubble is (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W)", "[engine][pipeline]") {
  // Qi et al. 2023 §3: with T_B the input-gradient and T_W the weight-gradient time, in their
  // setting T_F = T_B (a GEMM's input-gradient pass costs its forward); T_W <= T_F.
  for (auto [p, m] : {std::pair{4, 8}, std::pair{4, 12}, std::pair{8, 16}}) {
    for (auto [f, b, w] :
         {std::tuple{1.0, 1.0, 1.0}, std::tuple{1.0, 1.0, 0.5}, std::tuple{2.0, 2.0, 1.0}}) {
      DYNAMIC_SECTION("p=" << p << " m=" << m << " F=" << f << " B=" << b << " W=" << w) {
        const double ideal = m * (f + b + w);
        const auto zb = bubble_ratios(Schedule::ZeroBubble, p, m, 1, f, b, w);
        const auto base = bubble_ratios(Schedule::OneFOneB, p, m, 1, f, b, w);
        for (double r : zb) CHECK(r * ideal == Approx((p - 1) * (f + b - w)).epsilon(0.005));
        for (double r : base) CHECK(r * ideal == Approx((p - 1) * (f + b + w)).epsilon(0.005));
      }
    }
  }
}

TEST_CASE("1F1B keeps at most p micro-batches in flight on stage 0, GPipe keeps m",
          "[engine][pipeline][memory]") {
  Plan plan;
  plan.pp = 4;
  plan.dp = 1;
  plan.micro_batch_size = 1;
  plan.global_batch_size = 12;
  auto peak = [&](Schedule s, int stage) {
    plan.schedule = s;
    int live = 0, most = 0;
    for (const auto& pass : dtsim::lower::stage_passes(plan, stage)) {
      if (pass.kind == dtsim::lower::PassKind::Forward) most = std::max(most, ++live);
      if (pass.kind == dtsim::lower::PassKind::Backward ||
          pass.kind == dtsim::lower::PassKind::BackwardWeight) {
        --live;
      }
    }
    return most;
  };
  CHECK(peak(Schedule::OneFOneB, 0) == 4);
  CHECK(peak(Schedule::OneFOneB, 3) == 1);
  CHECK(peak(Schedule::GPipe, 0) == 12);
  // The memory model counts the same.
  CHECK(dtsim::plan::in_flight(plan, 0) == 12);
  plan.schedule = Schedule::OneFOneB;
  CHECK(dtsim::plan::in_flight(plan, 0) == 4);
  // Without pipelining every schedule accumulates gradients one micro-batch at a time (GPipe's
  // forwards-first order held all 12 where the memory model counted one).
  plan.pp = 1;
  for (const auto s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::PipeDreamAsync}) {
    INFO(dtsim::plan::to_string(s));
    CHECK(peak(s, 0) == 1);
    CHECK(dtsim::plan::in_flight(plan, 0) == 1);
  }
}
