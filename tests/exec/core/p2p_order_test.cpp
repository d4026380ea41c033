// Untagged point-to-point (NCCL): every schedule's transfers between two ranks are received in
// the order they are sent, and a program where they are not is caught.
#include "exec/core/p2p_order.hpp"

#include <algorithm>

#include "sim/lower/lowering.hpp"
#include "sim/plan/plan.hpp"
#include "tests/test_util.hpp"

using dtsim::lower::TaskKind;
using dtsim::plan::Schedule;

namespace {

dtsim::lower::Program lowered(Schedule schedule, int pp, int v, int tp, int dp) {
  auto spec = dtsim::model::load_model("tiny-gpt");
  spec.layers = 8;
  const dtsim::model::ModelGraph g(spec, 1, 16);
  dtsim::plan::Plan p;
  p.dp = dp;
  p.tp = tp;
  p.pp = pp;
  p.schedule = schedule;
  p.virtual_stages = v;
  p.seq_len = 16;
  p.micro_batch_size = 1;
  p.global_batch_size = 4 * dp;
  REQUIRE(dtsim::plan::check_plan(p, spec, p.devices()).ok());
  dtsim::lower::LowerOptions options;
  options.mode = dtsim::lower::Lowering::AllRanks;
  return dtsim::lower::lower(g, p, options);
}

}  // namespace

TEST_CASE("every pipeline schedule receives in the order it sends", "[exec][p2p]") {
  struct Case {
    Schedule schedule;
    int pp, v;
  };
  for (const Case c : {Case{Schedule::GPipe, 2, 1}, Case{Schedule::OneFOneB, 4, 1},
                       Case{Schedule::Interleaved, 2, 2}, Case{Schedule::Interleaved, 4, 2},
                       Case{Schedule::ZeroBubble, 4, 1}, Case{Schedule::PipeDreamAsync, 2, 1}}) {
    const auto program = lowered(c.schedule, c.pp, c.v, 2, 2);
    INFO(dtsim::plan::to_string(c.schedule) << " pp " << c.pp << " v " << c.v);
    const auto mismatch = dtsim::exec::untagged_p2p_mismatch(program);
    CHECK(!mismatch.has_value());
  }
}

TEST_CASE("sends out of the receiver's order are found", "[exec][p2p]") {
  auto program = lowered(Schedule::GPipe, 2, 1, 1, 1);
  CHECK(!dtsim::exec::untagged_p2p_mismatch(program));
  // Stage 0 sends the activations of micro-batches 0 and 1 the other way round.
  auto& tasks = program.ranks[0].tasks;
  std::vector<std::size_t> sends;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    if (tasks[i].kind == TaskKind::Send) sends.push_back(i);
  }
  REQUIRE(sends.size() >= 2);
  std::swap(tasks[sends[0]].tag, tasks[sends[1]].tag);
  const auto mismatch = dtsim::exec::untagged_p2p_mismatch(program);
  REQUIRE(mismatch.has_value());
  CHECK_THAT(*mismatch, Catch::Matchers::Contains("rank 0 sends 4 tensors to rank 1") &&
                            Catch::Matchers::Contains("transfer 0 differs"));
  // A send nobody receives.
  tasks.erase(tasks.begin() + static_cast<std::ptrdiff_t>(sends[1]));
  CHECK_THAT(*dtsim::exec::untagged_p2p_mismatch(program),
             Catch::Matchers::Contains("sends 3 tensors to rank 1, which receives 4"));
}
