#include "sim/planner/pass_timeline.hpp"

#include <algorithm>
#include <numeric>
#include <vector>

#include "tests/test_util.hpp"

using dtsim::plan::Plan;
using dtsim::plan::Schedule;
using dtsim::planner::ChunkPasses;
using dtsim::planner::pipeline_timeline;

namespace {

Plan pipeline(Schedule schedule, int pp, int micro_batches, int virtual_stages = 1) {
  Plan p;
  p.pp = pp;
  p.schedule = schedule;
  p.virtual_stages = virtual_stages;
  p.global_batch_size = micro_batches;
  return p;
}

// The plan's timeline with its transfers blocking (Megatron-LM's default) or overlapped.
dtsim::planner::PipelineTimeline timeline(Plan p, const std::vector<ChunkPasses>& chunks,
                                          const std::vector<double>& hops, bool blocking) {
  p.overlap_p2p_comm = !blocking;
  return pipeline_timeline(p, chunks, hops);
}

std::vector<ChunkPasses> even(const Plan& p, double forward, double backward, double weight = 0) {
  return std::vector<ChunkPasses>(static_cast<std::size_t>(p.pp * p.virtual_stages),
                                  ChunkPasses{forward, backward, weight});
}

}  // namespace

// With even chunks and free transfers the timeline is the schedules' textbook length: GPipe's
// and 1F1B's (m + p - 1)(f + b), the interleaved schedule's bubble of (p - 1) chunk passes
// (Narayanan et al. 2021, Sec. 2.2: (p - 1)/v of a stage's), zero-bubble's (p - 1)(f + b - w)
// at most, with W deferred into the cool-down (Qi et al. 2023).
TEST_CASE("even chunks without transfer times give the schedules' textbook lengths",
          "[planner][pipeline]") {
  const int pp = 4, m = 8;
  const std::vector<double> no_hops(pp, 0.0);
  for (const bool blocking : {false, true}) {
    INFO("blocking " << blocking);
    for (const Schedule s : {Schedule::GPipe, Schedule::OneFOneB}) {
      const Plan p = pipeline(s, pp, m);
      const auto t = timeline(p, even(p, 1, 2), no_hops, blocking);
      CHECK(t.makespan_s == Approx((m + pp - 1) * 3.0));
      for (double busy : t.busy_s) CHECK(busy == Approx(m * 3.0));
    }
    const Plan interleaved = pipeline(Schedule::Interleaved, pp, m, 2);
    const auto t = timeline(interleaved, even(interleaved, 0.5, 1), no_hops, blocking);
    CHECK(t.makespan_s == Approx(m * 2 * 1.5 + (pp - 1) * 1.5));
    const Plan zb = pipeline(Schedule::ZeroBubble, pp, m);
    const auto z = timeline(zb, even(zb, 1, 1, 1), no_hops, blocking);
    CHECK(z.makespan_s >= m * 3.0);
    CHECK(z.makespan_s <= m * 3.0 + (pp - 1) * 1.0 + 1e-9);
    CHECK(z.makespan_s < (m + pp - 1) * 3.0);
  }
}

// pp 2, one micro-batch, f = b = 1, a hop of 0.5 s: the activations cross after stage 0's
// forward, the gradients after stage 1's backward, each in full: 4 s of passes and 1 s of
// transfers, blocking or not.
TEST_CASE("a pipeline transfer delays the pass that needs it by its length",
          "[planner][pipeline]") {
  const Plan p = pipeline(Schedule::OneFOneB, 2, 1);
  for (const bool blocking : {false, true}) {
    const auto t = timeline(p, even(p, 1, 1), {0.5, 0.5}, blocking);
    CHECK(t.makespan_s == Approx(5.0));
  }
}

// Overlapped transfers run beside the passes; blocking ones (Megatron-LM's default) wait for
// the receiver to post its receive and hold the sender until they are received. Either way the
// fill and drain pay the hops down and up the pipeline, and in 1F1B each group of pp
// micro-batches waits for its first one's round trip.
TEST_CASE("transfers lengthen the pipeline, blocking ones more than overlapped ones",
          "[planner][pipeline]") {
  const int pp = 4, m = 16;
  const Plan p = pipeline(Schedule::OneFOneB, pp, m);
  const std::vector<double> hops(pp, 0.2);
  const double textbook = (m + pp - 1) * 3.0;
  const auto overlapped = timeline(p, even(p, 1, 2), hops, false);
  const auto blocking = timeline(p, even(p, 1, 2), hops, true);
  CHECK(overlapped.makespan_s >= textbook + 2 * (pp - 1) * 0.2 - 1e-9);
  CHECK(overlapped.makespan_s <= textbook + 2 * m * 0.2);
  CHECK(blocking.makespan_s > overlapped.makespan_s);
}

// 96 layers in 32 x 2 chunks (Megatron-LM's interleaving of GPT-3 at pp 32, v 2): chunk 0 of
// each stage has 2 layers, chunk 1 one. Every stage does the same work, yet the one-layer
// chunks wait at each chunk transition for the two-layer chunks that feed them, which a bubble
// formula over the stages' work cannot see.
TEST_CASE("interleaved chunks of unequal layers wait for each other", "[planner][pipeline]") {
  const int pp = 32, m = 64;
  const Plan p = pipeline(Schedule::Interleaved, pp, m, 2);
  std::vector<ChunkPasses> chunks;
  for (int k = 0; k < 2 * pp; ++k) {
    const double layers = k < pp ? 2 : 1;
    chunks.push_back({layers * 1.0, layers * 2.0, 0});
  }
  const auto t = timeline(p, chunks, std::vector<double>(pp, 0.0), false);
  const double busy = *std::max_element(t.busy_s.begin(), t.busy_s.end());
  CHECK(busy == Approx(m * 9.0));
  // The formula's bubble: (p - 1) x the stage's passes of one micro-batch / v.
  const double formula = busy + (pp - 1) * 9.0 / 2;
  CHECK(t.makespan_s > formula * 1.05);
}

TEST_CASE("every schedule's order runs to the end, blocking or not", "[planner][pipeline]") {
  for (const Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved,
                           Schedule::ZeroBubble, Schedule::PipeDreamAsync}) {
    for (const int pp : {2, 3, 8}) {
      // Micro-batches a multiple of pp (the interleaved schedule's rule), and for the others
      // fewer than pp and one more than a multiple.
      for (const int m : {pp, 2 * pp, 5 * pp, 1, pp - 1, pp + 1}) {
        if (s == Schedule::Interleaved && m % pp != 0) continue;
        const Plan p = pipeline(s, pp, m, s == Schedule::Interleaved ? (pp == 3 ? 3 : 2) : 1);
        std::vector<ChunkPasses> chunks;
        for (int k = 0; k < pp * p.virtual_stages; ++k) {
          chunks.push_back(
              {1.0 + 0.1 * (k % 3), 2.0 + 0.3 * (k % 2), s == Schedule::ZeroBubble ? 0.7 : 0.0});
        }
        std::vector<double> hops;
        for (int i = 0; i < pp; ++i) hops.push_back(0.05 * (i + 1));
        for (const bool blocking : {false, true}) {
          INFO(dtsim::plan::to_string(s) << " pp " << pp << " m " << m << " blocking " << blocking);
          const auto t = timeline(p, chunks, hops, blocking);
          const double busiest = *std::max_element(t.busy_s.begin(), t.busy_s.end());
          const double work = std::accumulate(t.busy_s.begin(), t.busy_s.end(), 0.0);
          const double transfers =
              2.0 * m * p.virtual_stages * std::accumulate(hops.begin(), hops.end(), 0.0);
          CHECK(t.makespan_s >= busiest);
          CHECK(t.makespan_s <= work + transfers);
        }
      }
    }
  }
}

// Where each stage's chunks start their last backward passes (the planner's dp stream sends
// each chunk's last buckets from then on): the stage's last pass is its first chunk's, and
// interleaved, the chunk before it passed its last gradients round the pp stages first: pp
// backward passes earlier with free transfers, and at least a hop more each with blocking ones.
TEST_CASE("the timeline says when each chunk's last backward pass starts", "[planner][pipeline]") {
  const int pp = 4, m = 8;
  const double f = 0.5, b = 1, hop = 0.25;
  const Plan one = pipeline(Schedule::OneFOneB, pp, m);
  const auto t = timeline(one, even(one, 2 * f, 2 * b), std::vector<double>(pp, 0.0), true);
  for (int s = 0; s < pp; ++s) {
    const auto stage = static_cast<std::size_t>(s);
    REQUIRE(t.last_backward(s).size() == 1);
    CHECK(t.last_backward(s)[0] + 2 * b == Approx(t.end_s[stage]));
  }
  const Plan interleaved = pipeline(Schedule::Interleaved, pp, m, 2);
  for (const double h : {0.0, hop}) {
    INFO("hops of " << h);
    const auto i = timeline(interleaved, even(interleaved, f, b), std::vector<double>(pp, h), true);
    for (int s = 0; s < pp; ++s) {
      const auto starts = i.last_backward(s);
      REQUIRE(starts.size() == 2);
      // (A stage that sends the pass's gradients on ends once they are received.)
      const double end = i.end_s[static_cast<std::size_t>(s)];
      CHECK(starts[0] + b == Approx(s == 0 ? end : end - h));
      if (h == 0) {
        CHECK(starts[0] - starts[1] == Approx(pp * b));
      } else {
        CHECK(starts[0] - starts[1] >= pp * (b + h) - 1e-12);
      }
    }
  }
}
