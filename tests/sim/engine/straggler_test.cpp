// The straggler model of the engine, and its pipeline transfers: a rendezvous waits for its last
// rank, each rank late or early by cv·T (T the compute it did since it last met the others: the
// group's previous collective or their last transfer between them), E[max of n normals]·cv·T
// where all come together after the same T, nothing where the last comes long after the others.
#include <algorithm>
#include <cmath>
#include <numbers>

#include "sim/engine/engine.hpp"
#include "sim/engine/simulator.hpp"
#include "tests/test_util.hpp"

using dtsim::lower::Task;
using dtsim::lower::TaskKind;

namespace {

// Compute tasks last op_end - op_begin units of `unit_s` seconds (1 s unless given);
// collectives 0.5 s.
class Fixed final : public dtsim::engine::Durations {
 public:
  explicit Fixed(double unit_s = 1) : unit_s_(unit_s) {}
  double compute_s(const Task& t) override { return (t.op_end - t.op_begin) * unit_s_; }
  double collective_s(const dtsim::lower::Group&, const Task&) override { return 0.5; }
  double p2p_s(std::int64_t, std::int64_t, std::uint64_t) override { return 0; }

 private:
  double unit_s_;
};

Task compute(int seconds, dtsim::lower::Deps deps) {
  Task t;
  t.kind = TaskKind::Compute;
  t.stream = dtsim::lower::Stream::Compute;
  t.phase = dtsim::lower::Phase::Forward;
  t.op_end = seconds;
  t.deps = std::move(deps);
  return t;
}

// A pipeline send or receive.
Task transfer(TaskKind kind, std::int32_t peer, std::int64_t tag, dtsim::lower::Deps deps) {
  Task t;
  t.kind = kind;
  t.stream = dtsim::lower::Stream::Pp;
  t.peer = peer;
  t.tag = tag;
  t.deps = std::move(deps);
  return t;
}

// Compute tasks last op_end - op_begin seconds; a pipeline transfer 0.5 s alone.
class Transfers final : public dtsim::engine::Durations {
 public:
  double compute_s(const Task& t) override { return t.op_end - t.op_begin; }
  double collective_s(const dtsim::lower::Group&, const Task&) override { return 0; }
  double p2p_s(std::int64_t, std::int64_t, std::uint64_t) override { return 0.5; }
};

Task collective(std::int32_t group, dtsim::lower::Deps deps) {
  Task t;
  t.kind = TaskKind::Collective;
  t.stream = dtsim::lower::Stream::Tp;
  t.group = group;
  t.deps = std::move(deps);
  return t;
}

// One representative program standing for `ranks` ranks of one tp group: compute 1 s,
// all-reduce, compute 2 s, all-reduce.
dtsim::lower::Program two_syncs(int ranks) {
  dtsim::lower::Program p;
  dtsim::lower::Group g;
  for (int r = 0; r < ranks; ++r) g.ranks.push_back(r);
  g.programs = {0};
  p.groups.push_back(g);
  dtsim::lower::RankProgram rp;
  rp.represents = g.ranks;
  rp.tasks = {compute(1, {}), collective(0, {0}), compute(2, {1}), collective(0, {2})};
  p.ranks.push_back(rp);
  return p;
}

// Ranks 0 and 1 with these tasks, group 0 the two of them, eager sends (or blocking ones),
// jitter 0.1, Fixed durations (collectives 0.5 s, transfers none).
dtsim::engine::Timeline run_pair_with_jitter(std::vector<Task> rank0, std::vector<Task> rank1,
                                             bool eager = true) {
  dtsim::lower::Program p;
  p.plan.overlap_p2p_comm = eager;
  dtsim::lower::Group g;
  g.ranks = {0, 1};
  g.programs = {0, 1};
  p.groups = {g};
  dtsim::lower::RankProgram r0, r1;
  r0.rank = 0;
  r1.rank = 1;
  r0.tasks = std::move(rank0);
  r1.tasks = std::move(rank1);
  p.ranks = {r0, r1};
  Fixed d;
  dtsim::engine::EngineOptions options;
  options.jitter_cv = 0.1;
  return dtsim::engine::run(p, d, options);
}

}  // namespace

TEST_CASE("the expected maximum of n standard normals", "[engine][stragglers]") {
  CHECK(dtsim::engine::expected_max_normal(1) == 0);
  // Known values (order statistics of the normal distribution).
  CHECK(dtsim::engine::expected_max_normal(2) == Approx(1 / std::sqrt(std::numbers::pi)));
  CHECK(dtsim::engine::expected_max_normal(4) == Approx(1.0293754).epsilon(1e-6));
  CHECK(dtsim::engine::expected_max_normal(8) == Approx(1.4236003).epsilon(1e-6));
  CHECK(dtsim::engine::expected_max_normal(1000) == Approx(3.2414).epsilon(1e-4));
}

TEST_CASE("the expected lateness of the last of several arrivals", "[engine][stragglers]") {
  using dtsim::engine::Arrival;
  using dtsim::engine::expected_lateness;
  const double e8 = dtsim::engine::expected_max_normal(8);
  // Together, with one spread: E[max of n normals] spreads.
  CHECK(expected_lateness({Arrival{2, 0.5, 8}}) == Approx(0.5 * e8));
  CHECK(expected_lateness({Arrival{2, 0.5, 3}, Arrival{2, 0.5, 5}}) == Approx(0.5 * e8));
  // Two ranks together with spreads 0.3 and 0.4: theta·phi(0) for theta = 0.5 (Clark).
  CHECK(expected_lateness(Arrival{1, 0.3}, Arrival{1, 0.4}) ==
        Approx(0.5 / std::sqrt(2 * std::numbers::pi)));
  // One unit of theta apart: phi(1) - Phi(-1) = 0.2419707 - 0.1586553.
  const double s = 1 / std::numbers::sqrt2;
  CHECK(expected_lateness(Arrival{0, s}, Arrival{1, s}) == Approx(0.0833154).epsilon(1e-6));
  CHECK(expected_lateness(Arrival{1, s}, Arrival{0, s}) ==
        expected_lateness(Arrival{0, s}, Arrival{1, s}));
  // The last long after the others: it waits for nobody, and its own spread is no wait.
  CHECK(expected_lateness({Arrival{0, 0.1, 8}, Arrival{10, 0.1, 1}}) == Approx(0).margin(1e-12));
  CHECK(expected_lateness(Arrival{0, 0.1}, Arrival{10, 0.1}) == Approx(0).margin(1e-12));
  // A wider gap, less lateness.
  double before = expected_lateness(Arrival{0, 0.2}, Arrival{0, 0.2});
  for (const double gap : {0.05, 0.1, 0.2, 0.4, 0.8}) {
    const double late = expected_lateness(Arrival{0, 0.2}, Arrival{gap, 0.2});
    CHECK(late < before);
    before = late;
  }
  // The numerical integral (an early rank without spread, which cannot be the last, makes the
  // set need it) against the closed forms: Clark's, and E[max of 8 normals].
  for (const double gap : {0.0, 0.1, 0.5, 2.0}) {
    INFO("gap " << gap);
    CHECK(expected_lateness({Arrival{0, 0.3}, Arrival{gap, 0.4}, Arrival{-50, 0}}) ==
          Approx(expected_lateness(Arrival{0, 0.3}, Arrival{gap, 0.4})).margin(1e-6));
  }
  CHECK(expected_lateness({Arrival{0, 1, 8}, Arrival{-50, 0}}) == Approx(e8).epsilon(1e-6));
  // Sets of several ranks at different times, with different spreads: against an adaptive
  // quadrature of the same expectation (mpmath.quad at 30 digits).
  CHECK(expected_lateness({Arrival{0, 0.3, 3}, Arrival{0.2, 0.5, 2}}) ==
        Approx(0.3759460229).epsilon(1e-6));
  // Spreads far apart: one rank's 1% of the other's, and one at 0.02%, which counts as none.
  CHECK(expected_lateness({Arrival{0, 1}, Arrival{0, 0.01}, Arrival{-50, 0}}) ==
        Approx(expected_lateness(Arrival{0, 1}, Arrival{0, 0.01})).epsilon(1e-3));
  CHECK(expected_lateness({Arrival{0, 1}, Arrival{0, 0.0002}, Arrival{-50, 0}}) ==
        Approx(expected_lateness(Arrival{0, 1}, Arrival{0, 0.0002})).epsilon(1e-3));
  // A rank without spread at the latest mean: max(0, Z), phi(0).
  CHECK(expected_lateness({Arrival{0, 0}, Arrival{0, 1}, Arrival{-50, 0}}) ==
        Approx(1 / std::sqrt(2 * std::numbers::pi)).epsilon(1e-6));
  // No spread, no ranks: no lateness.
  CHECK(expected_lateness({Arrival{0, 0, 4}, Arrival{1, 0, 4}}) == 0);
  CHECK(expected_lateness(std::vector<Arrival>{}) == 0);
  CHECK(expected_lateness({Arrival{0, 1, 0}}) == 0);
}

TEST_CASE("a collective waits for its slowest rank", "[engine][stragglers]") {
  Fixed d;
  const auto program = two_syncs(8);
  const auto plain = dtsim::engine::run(program, d);
  CHECK(plain.makespan_s == Approx(1 + 0.5 + 2 + 0.5));
  dtsim::engine::EngineOptions options;
  options.jitter_cv = 0.1;
  const auto t = dtsim::engine::run(program, d, options);
  // Eight ranks (one program stands for them): the first all-reduce waits 0.1·e(8)·1 s, the
  // second 0.1·e(8)·2 s (the compute since the first).
  const double e8 = dtsim::engine::expected_max_normal(8);
  CHECK(t.tasks[0][1].start_s == Approx(1));
  CHECK(t.tasks[0][1].end_s == Approx(1 + 0.1 * e8 * 1 + 0.5));
  CHECK(t.tasks[0][3].end_s - t.tasks[0][3].start_s == Approx(0.1 * e8 * 2 + 0.5));
  CHECK(t.makespan_s == Approx(plain.makespan_s + 0.1 * e8 * 3));
  // A group of one rank never waits.
  const auto alone = dtsim::engine::run(two_syncs(1), d, options);
  CHECK(alone.makespan_s == Approx(plain.makespan_s));
}

TEST_CASE("the breakdown tells a wait for the last rank apart from the communication",
          "[engine][stragglers]") {
  Fixed d;
  const auto program = two_syncs(8);
  dtsim::engine::EngineOptions options;
  options.jitter_cv = 0.1;
  const auto t = dtsim::engine::run(program, d, options);
  const double e8 = dtsim::engine::expected_max_normal(8);
  // Each all-reduce's wait comes first in its span: 0.1·e(8) times the compute before it.
  CHECK(t.tasks[0][1].wait_from_s == Approx(1));
  CHECK(t.tasks[0][1].wait_s == Approx(0.1 * e8 * 1));
  CHECK(t.tasks[0][3].wait_from_s == Approx(t.tasks[0][3].start_s));
  CHECK(t.tasks[0][3].wait_s == Approx(0.1 * e8 * 2));
  const auto b = dtsim::engine::breakdown_of(program.ranks[0], t.tasks[0], t.makespan_s);
  CHECK(b.compute_s == Approx(3));
  CHECK(b.exposed_tp_s == Approx(2 * 0.5));
  CHECK(b.straggler_tp_s == Approx(0.1 * e8 * 3));
  CHECK(b.straggler_s() == Approx(b.straggler_tp_s));
  CHECK(b.bubble_s == Approx(0).margin(1e-12));
  CHECK(b.total_s() == Approx(t.makespan_s));
  // Without the model the same span is communication alone.
  const auto plain = dtsim::engine::run(program, d);
  CHECK(plain.tasks[0][1].wait_s == 0);
  const auto calm = dtsim::engine::breakdown_of(program.ranks[0], plain.tasks[0], plain.makespan_s);
  CHECK(calm.straggler_s() == 0);
  CHECK(calm.exposed_tp_s == Approx(2 * 0.5));
}

TEST_CASE("a wait for a late rank that compute hides is not in the breakdown",
          "[engine][stragglers]") {
  // Both ranks compute 1 s, then reduce on the dp stream while computing 3 s more: the
  // reduction's wait (0.1·e(2)·1 s) and its 0.5 s run beside that compute.
  Task reduce = collective(0, {0});
  reduce.stream = dtsim::lower::Stream::Dp;
  const auto t = run_pair_with_jitter({compute(1, {}), reduce, compute(3, {0})},
                                      {compute(1, {}), reduce, compute(3, {0})});
  CHECK(t.tasks[0][1].wait_s == Approx(0.1 * dtsim::engine::expected_max_normal(2)));
  dtsim::lower::RankProgram rank;
  rank.tasks = {compute(1, {}), reduce, compute(3, {0})};
  const auto b = dtsim::engine::breakdown_of(rank, t.tasks[0], t.makespan_s);
  CHECK(b.compute_s == Approx(4));
  CHECK(b.straggler_s() == 0);
  CHECK(b.exposed_dp_s == 0);
}

TEST_CASE("each group waits for the compute since its own last collective",
          "[engine][stragglers]") {
  // Two programs (ranks 0 and 1), a group of both (2 ranks) and a group of rank 0 with 3 ranks
  // it represents alone (4 ranks). Rank 0: compute 1 s, collective A, compute 2 s,
  // collective B, compute 1 s, collective A. Rank 1: compute 1 s, A, compute 3 s, A.
  dtsim::lower::Program p;
  dtsim::lower::Group a, b;
  a.ranks = {0, 1};
  a.programs = {0, 1};
  b.ranks = {0, 2, 3, 4};
  b.programs = {0};
  p.groups = {a, b};
  dtsim::lower::RankProgram r0, r1;
  r0.tasks = {compute(1, {}),     collective(0, {0}), compute(2, {1}),
              collective(1, {2}), compute(1, {3}),    collective(0, {4})};
  r1.tasks = {compute(1, {}), collective(0, {0}), compute(3, {1}), collective(0, {2})};
  p.ranks = {r0, r1};
  Fixed d;
  dtsim::engine::EngineOptions options;
  options.jitter_cv = 0.1;
  const auto t = dtsim::engine::run(p, d, options);
  const double e2 = dtsim::engine::expected_max_normal(2);
  const double e4 = dtsim::engine::expected_max_normal(4);
  // A #1 after 1 s of compute on both.
  CHECK(t.tasks[0][1].end_s == Approx(1 + 0.1 * e2 * 1 + 0.5));
  const double a1 = t.tasks[0][1].end_s;
  // B: never synced before, so all 3 s of rank 0's compute count.
  CHECK(t.tasks[0][3].end_s - t.tasks[0][3].start_s == Approx(0.1 * e4 * 3 + 0.5));
  // A #2: since A #1, rank 0 computed 2 + 1 = 3 s, rank 1 3 s. Rank 0 arrives last (its B in
  // between), at a1 + 2 + B + 1, B's length after rank 1: less lateness than if together.
  const double b_len = 0.1 * e4 * 3 + 0.5;
  CHECK(t.tasks[0][5].start_s == Approx(a1 + 2 + b_len + 1));
  const double late = dtsim::engine::expected_lateness(dtsim::engine::Arrival{a1 + 3, 0.3},
                                                       dtsim::engine::Arrival{a1 + 3 + b_len, 0.3});
  CHECK(late < 0.1 * e2 * 3 / 4);
  CHECK(t.tasks[0][5].end_s == Approx(a1 + 2 + b_len + 1 + late + 0.5));
  CHECK(t.tasks[1][3].end_s == Approx(t.tasks[0][5].end_s));
}

TEST_CASE("a pipeline transfer waits for the later of its two ends", "[engine][stragglers]") {
  // Both ranks compute 2 s; rank 0 sends to rank 1, which receives, computes 1 s and sends back;
  // rank 0 receives at once. Transfers take no time here (Fixed::p2p_s).
  for (const bool eager : {true, false}) {
    INFO((eager ? "eager" : "blocking") << " sends");
    const auto t = run_pair_with_jitter(
        {compute(2, {}), transfer(TaskKind::Send, 1, 0, {0}), transfer(TaskKind::Recv, 1, 1, {1})},
        {compute(2, {}), transfer(TaskKind::Recv, 0, 0, {0}), compute(1, {1}),
         transfer(TaskKind::Send, 0, 1, {2})},
        eager);
    const double e2 = dtsim::engine::expected_max_normal(2);
    // The first transfer: both come at 2 s after 2 s of compute, the later 0.1·e(2)·2 late.
    const double first = 2 + 0.1 * e2 * 2;
    CHECK(t.tasks[1][1].end_s == Approx(first));
    // An eager sender does not wait; a blocking one ends with the transfer.
    CHECK(t.tasks[0][1].end_s == Approx(eager ? 2 : first));
    // Back: rank 0 has waited at its receive since, with no compute to spread it; rank 1's
    // send comes 1 s after, late or early by 0.1 s: the receive waits for it alone, on
    // average not late (0.1·e(2)·1 if they came together).
    CHECK(t.tasks[0][2].end_s == Approx(first + 1).margin(1e-9));
    // The first transfer's wait: inside the receive's span when the data came ahead, before
    // both ends' spans when they start it together; in either case the receiver's breakdown
    // has it, and a blocking sender's too.
    CHECK(t.tasks[1][1].wait_from_s == Approx(2));
    CHECK(t.tasks[1][1].wait_s == Approx(0.1 * e2 * 2));
    dtsim::lower::RankProgram receiver;
    receiver.tasks = {compute(2, {}), transfer(TaskKind::Recv, 0, 0, {0}), compute(1, {1}),
                      transfer(TaskKind::Send, 0, 1, {2})};
    const auto b = dtsim::engine::breakdown_of(receiver, t.tasks[1], t.makespan_s);
    CHECK(b.compute_s == Approx(3));
    CHECK(b.straggler_pp_s == Approx(0.1 * e2 * 2));
    CHECK(b.total_s() == Approx(t.makespan_s));
    dtsim::lower::RankProgram sender;
    sender.tasks = {compute(2, {}), transfer(TaskKind::Send, 1, 0, {0}),
                    transfer(TaskKind::Recv, 1, 1, {1})};
    const auto a = dtsim::engine::breakdown_of(sender, t.tasks[0], t.makespan_s);
    CHECK(a.straggler_pp_s == Approx(eager ? 0 : 0.1 * e2 * 2).margin(1e-9));
  }
}

TEST_CASE("a pipeline transfer ties its two ranks as a collective does", "[engine][stragglers]") {
  // Both compute 3 s and rank 0 sends to rank 1; both compute 2 s and meet in a collective
  // (0.5 s); both compute 1 s, and rank 1 sends back. Eager sends; transfers take no time
  // (Fixed::p2p_s).
  const auto t = run_pair_with_jitter(
      {compute(3, {}), transfer(TaskKind::Send, 1, 0, {0}), compute(2, {0}), collective(0, {2}),
       compute(1, {3}), transfer(TaskKind::Recv, 1, 1, {4})},
      {compute(3, {}), transfer(TaskKind::Recv, 0, 0, {0}), compute(2, {1}), collective(0, {2}),
       compute(1, {3}), transfer(TaskKind::Send, 0, 1, {4})});
  using dtsim::engine::Arrival;
  const double e2 = dtsim::engine::expected_max_normal(2);
  // The transfer: both come after 3 s of compute.
  const double late = 0.1 * e2 * 3;
  CHECK(t.tasks[1][1].end_s == Approx(3 + late));
  // The collective: rank 0 at 5 s, rank 1 the transfer's lateness after; each after 2 s of
  // compute since the transfer (the 3 s before it are not counted again: the transfer absorbed
  // them).
  CHECK(t.tasks[0][3].start_s == Approx(3 + late + 2));
  const double collective_end =
      3 + late + 2 + dtsim::engine::expected_lateness(Arrival{5, 0.2}, Arrival{5 + late, 0.2}) +
      0.5;
  CHECK(t.tasks[0][3].end_s == Approx(collective_end));
  CHECK(t.tasks[1][3].end_s == Approx(collective_end));
  // The transfer back: 1 s of compute on each since the collective, not the 3 s since the
  // pair's last transfer.
  CHECK(t.tasks[0][5].end_s == Approx(collective_end + 1 + 0.1 * e2 * 1));
}

TEST_CASE("a collective ties two ranks before their first transfer", "[engine][stragglers]") {
  // Both compute 2 s and meet in a collective (0.5 s); both then compute 1 s, and rank 0 sends
  // to rank 1. Eager sends; transfers take no time.
  const auto t = run_pair_with_jitter(
      {compute(2, {}), collective(0, {0}), compute(1, {1}), transfer(TaskKind::Send, 1, 0, {2})},
      {compute(2, {}), collective(0, {0}), compute(1, {1}), transfer(TaskKind::Recv, 0, 0, {2})});
  const double e2 = dtsim::engine::expected_max_normal(2);
  const double collective_end = 2 + 0.1 * e2 * 2 + 0.5;
  CHECK(t.tasks[0][1].end_s == Approx(collective_end));
  // The transfer: 1 s of compute on each since the collective, not 3 s since the step began.
  CHECK(t.tasks[1][3].end_s == Approx(collective_end + 1 + 0.1 * e2 * 1));
}

TEST_CASE("programs that stand for several ranks wait for the last of all of them",
          "[engine][stragglers]") {
  // Two programs, each for 2 of the group's 4 ranks: program 0 computes 1 s, program 1 1.1 s,
  // and they meet in a collective (0.5 s). The last of 2 ranks at 1 s and 2 at 1.1 s, spreads
  // 0.1 and 0.11 s: 0.0752235 s after 1.1 s on average (mpmath.quad at 30 digits).
  dtsim::lower::Program p;
  dtsim::lower::Group g;
  g.ranks = {0, 1, 2, 3};
  g.programs = {0, 1};
  p.groups = {g};
  dtsim::lower::RankProgram r0, r1;
  r0.rank = 0;
  r0.represents = {0, 2};
  r1.rank = 1;
  r1.represents = {1, 3};
  r0.tasks = {compute(10, {}), collective(0, {0})};
  r1.tasks = {compute(11, {}), collective(0, {0})};
  p.ranks = {r0, r1};
  Fixed d(0.1);  // compute in tenths of a second
  dtsim::engine::EngineOptions options;
  options.jitter_cv = 0.1;
  const auto t = dtsim::engine::run(p, d, options);
  CHECK(t.tasks[0][1].start_s == Approx(1.1));
  CHECK(t.tasks[0][1].end_s == Approx(1.1 + 0.0752235227 + 0.5).epsilon(1e-7));
  CHECK(t.tasks[1][1].end_s == t.tasks[0][1].end_s);
}

TEST_CASE("a receiver's spread counts its compute until it posts the receive",
          "[engine][stragglers]") {
  // Rank 0 computes 3 s, sends to rank 1, computes 1 s and receives from rank 1. Rank 1
  // computes 2 s, posts its receive, computes 2 s meanwhile (a receive holds no stream), and
  // sends back. Eager sends, then blocking ones; transfers take no time.
  for (const bool eager : {true, false}) {
    INFO((eager ? "eager" : "blocking") << " sends");
    const auto t = run_pair_with_jitter({compute(3, {}), transfer(TaskKind::Send, 1, 0, {0}),
                                         compute(1, {0}), transfer(TaskKind::Recv, 1, 1, {2})},
                                        {compute(2, {}), transfer(TaskKind::Recv, 0, 0, {0}),
                                         compute(2, {0}), transfer(TaskKind::Send, 0, 1, {2})},
                                        eager);
    using dtsim::engine::Arrival;
    // The first transfer: rank 1 at its receive at 2 s after 2 s of compute (the 2 s it issues
    // after posting it do not count), rank 0's data at 3 s after 3 s.
    CHECK(t.tasks[1][1].end_s ==
          Approx(3 + dtsim::engine::expected_lateness(Arrival{3, 0.3}, Arrival{2, 0.2})));
    // Back: both at 4 s; rank 1 after its 2 s since it posted the receive (they count here),
    // rank 0 after its 1 s since its send: theta·phi(0), theta = sqrt(0.2² + 0.1²).
    CHECK(t.tasks[0][3].end_s == Approx(4 + std::sqrt(0.05) / std::sqrt(2 * std::numbers::pi)));
  }
}

TEST_CASE("a rank's compute after it reaches a collective counts towards the next",
          "[engine][stragglers]") {
  // Both compute 1 s and meet in a collective (0.5 s, on another stream than the compute);
  // both start 5 s of compute beside it at once, and meet again after it. Both arrive at the
  // first at 1 s after 1 s of compute, at the second at 6 s after 5 s more.
  const auto t = run_pair_with_jitter(
      {compute(1, {}), collective(0, {0}), compute(5, {0}), collective(0, {2})},
      {compute(1, {}), collective(0, {0}), compute(5, {0}), collective(0, {2})});
  const double e2 = dtsim::engine::expected_max_normal(2);
  CHECK(t.tasks[0][1].end_s == Approx(1 + 0.1 * e2 * 1 + 0.5));
  CHECK(t.tasks[1][1].end_s == t.tasks[0][1].end_s);
  CHECK(t.tasks[0][3].start_s == Approx(6));
  CHECK(t.tasks[0][3].end_s == Approx(6 + 0.1 * e2 * 5 + 0.5));
}

TEST_CASE("a rank that comes long after the others waits for nobody", "[engine][stragglers]") {
  // Rank 0 computes 1 s, rank 1 5 s, and they meet in a collective (0.5 s): rank 1, 4 s after
  // rank 0, is the last whatever its 0.5 s spread, and ends the collective on time.
  const auto t = run_pair_with_jitter({compute(1, {}), collective(0, {0})},
                                      {compute(5, {}), collective(0, {0})});
  CHECK(t.tasks[0][1].start_s == Approx(5));
  CHECK(t.tasks[0][1].end_s == Approx(5.5).margin(1e-12));
  CHECK(t.tasks[1][1].end_s == Approx(5.5).margin(1e-12));
}

TEST_CASE("without p2p overlap a transfer starts when both ends are ready", "[engine][pipeline]") {
  // Rank 0 computes 2 s and sends; rank 1 computes 3 s, then posts its receive and computes
  // 1 s on the data. A transfer takes 0.5 s.
  dtsim::lower::Program p;
  dtsim::lower::RankProgram r0, r1;
  r0.rank = 0;
  r1.rank = 1;
  r0.tasks = {compute(2, {}), transfer(TaskKind::Send, 1, 0, {0})};
  r1.tasks = {compute(3, {}), transfer(TaskKind::Recv, 0, 0, {0}), compute(1, {1})};
  p.ranks = {r0, r1};
  Transfers d;

  // Overlapped: the data left at 2 s and is there at 2.5 s, before rank 1 asks for it.
  p.plan.overlap_p2p_comm = true;
  const auto eager = dtsim::engine::run(p, d);
  CHECK(eager.tasks[0][1].start_s == Approx(2));
  CHECK(eager.tasks[0][1].end_s == Approx(2.5));
  CHECK(eager.tasks[1][1].end_s == Approx(3));
  CHECK(eager.makespan_s == Approx(4));

  // Blocking (Megatron-LM's default): the transfer waits for the receive, posted at 3 s, and
  // both ends hold until it is done.
  p.plan.overlap_p2p_comm = false;
  const auto blocking = dtsim::engine::run(p, d);
  for (int rank : {0, 1}) {
    const auto& t = blocking.tasks[static_cast<std::size_t>(rank)][1];
    CHECK(t.start_s == Approx(3));
    CHECK(t.end_s == Approx(3.5));
  }
  CHECK(blocking.makespan_s == Approx(4.5));

  // The receive posted first: the transfer starts when the sender is ready.
  p.ranks[1].tasks[0].op_end = 1;
  const auto early = dtsim::engine::run(p, d);
  CHECK(early.tasks[1][1].start_s == Approx(2));
  CHECK(early.tasks[1][1].end_s == Approx(2.5));
  CHECK(early.makespan_s == Approx(3.5));
}

TEST_CASE("a device's link carries one pipeline transfer at a time each way",
          "[engine][pipeline]") {
  // Rank 1 (a middle stage) computes 1 s, then sends to ranks 0 and 2 at once; rank 3 sends to
  // rank 1 at the same time. A transfer takes 0.5 s alone.
  dtsim::lower::Program p;
  std::vector<dtsim::lower::RankProgram> ranks(4);
  for (int r = 0; r < 4; ++r) ranks[static_cast<std::size_t>(r)].rank = r;
  ranks[0].tasks = {transfer(TaskKind::Recv, 1, 0, {})};
  ranks[1].tasks = {compute(1, {}), transfer(TaskKind::Send, 0, 0, {0}),
                    transfer(TaskKind::Send, 2, 1, {0}), transfer(TaskKind::Recv, 3, 2, {0})};
  ranks[2].tasks = {transfer(TaskKind::Recv, 1, 1, {})};
  ranks[3].tasks = {compute(1, {}), transfer(TaskKind::Send, 1, 2, {0})};
  p.ranks = ranks;
  Transfers d;
  for (const bool overlap : {false, true}) {
    INFO((overlap ? "overlapped" : "blocking"));
    p.plan.overlap_p2p_comm = overlap;
    const auto t = dtsim::engine::run(p, d);
    // Rank 1's two sends share its link: one after the other, the pair done at 2 s, as with
    // half the bandwidth each.
    const double first = std::min(t.tasks[0][0].end_s, t.tasks[2][0].end_s);
    const double second = std::max(t.tasks[0][0].end_s, t.tasks[2][0].end_s);
    CHECK(first == Approx(1.5));
    CHECK(second == Approx(2));
    // Its receive comes in the other way, alongside them.
    CHECK(t.tasks[1][3].end_s == Approx(1.5));
  }

  // Two senders, one receiver: ranks 0 and 2 send to rank 1 at 1 s; its link takes one
  // transfer, then the other, in both modes (eager sends are on different ranks' streams).
  ranks[0].tasks = {compute(1, {}), transfer(TaskKind::Send, 1, 0, {0})};
  ranks[1].tasks = {transfer(TaskKind::Recv, 0, 0, {}), transfer(TaskKind::Recv, 2, 1, {})};
  ranks[2].tasks = {compute(1, {}), transfer(TaskKind::Send, 1, 1, {0})};
  ranks[3].tasks = {};
  p.ranks = ranks;
  for (const bool overlap : {false, true}) {
    INFO((overlap ? "overlapped" : "blocking"));
    p.plan.overlap_p2p_comm = overlap;
    const auto t = dtsim::engine::run(p, d);
    CHECK(std::min(t.tasks[1][0].end_s, t.tasks[1][1].end_s) == Approx(1.5));
    CHECK(std::max(t.tasks[1][0].end_s, t.tasks[1][1].end_s) == Approx(2));
  }
}

TEST_CASE("a rank whose communication cannot progress while it computes runs one task at a time",
          "[engine]") {
  // One rank (a group of 2 it stands for): compute 1 s; a collective on the tp stream beside a
  // compute of 2 s that does not depend on it; then a compute waiting for both.
  dtsim::lower::Program p;
  dtsim::lower::Group g;
  g.ranks = {0, 1};
  g.programs = {0};
  p.groups.push_back(g);
  dtsim::lower::RankProgram rp;
  rp.represents = g.ranks;
  rp.tasks = {compute(1, {}), collective(0, {0}), compute(2, {0}), compute(1, {1, 2})};
  p.ranks.push_back(rp);
  Fixed d;  // collectives 0.5 s
  const auto overlapped = dtsim::engine::run(p, d);
  CHECK(overlapped.makespan_s == Approx(1 + 2 + 1));  // the collective hides behind the 2 s
  dtsim::engine::EngineOptions options;
  options.serial_ranks = true;
  const auto serial = dtsim::engine::run(p, d, options);
  CHECK(serial.makespan_s == Approx(1 + 0.5 + 2 + 1));
  // In program order: the collective first, then the compute it could have hidden behind.
  CHECK(serial.tasks[0][1].end_s == Approx(1.5));
  CHECK(serial.tasks[0][2].start_s == Approx(1.5));
}

TEST_CASE("a slow rank computes longer and the others wait for it", "[engine][slow-rank]") {
  // Two ranks of one group: compute 1 s, all-reduce, compute 2 s, all-reduce. Rank 1 computes
  // 1.5 times longer: rank 0 waits for it before both collectives.
  dtsim::lower::Program p;
  dtsim::lower::Group g;
  g.ranks = {0, 1};
  g.programs = {0, 1};
  p.groups = {g};
  dtsim::lower::RankProgram r0, r1;
  r0.tasks = r1.tasks = {compute(1, {}), collective(0, {0}), compute(2, {1}), collective(0, {2})};
  p.ranks = {r0, r1};
  Fixed d;
  dtsim::engine::EngineOptions options;
  options.slow_program = 1;
  options.slow_factor = 1.5;
  const auto t = dtsim::engine::run(p, d, options);
  CHECK(t.tasks[0][0].end_s == Approx(1));      // rank 0 at its own pace
  CHECK(t.tasks[1][0].end_s == Approx(1.5));    // rank 1 slower
  CHECK(t.tasks[0][1].start_s == Approx(1.5));  // when the slow rank reaches it
  CHECK(t.tasks[0][1].end_s == Approx(1.5 + 0.5));
  CHECK(t.tasks[0][2].end_s - t.tasks[0][2].start_s == Approx(2));
  CHECK(t.tasks[1][2].end_s - t.tasks[1][2].start_s == Approx(3));
  CHECK(t.makespan_s == Approx(1.5 + 0.5 + 3 + 0.5));
  // No slow rank: the plain times.
  CHECK(dtsim::engine::run(p, d).makespan_s == Approx(1 + 0.5 + 2 + 0.5));
  // A slow program that does not exist, or one faster than the rest, is a caller's bug.
  options.slow_program = 2;
  CHECK_THROWS_AS(dtsim::engine::run(p, d, options), dtsim::InternalError);
  options.slow_program = 0;
  options.slow_factor = 0.5;
  CHECK_THROWS_AS(dtsim::engine::run(p, d, options), dtsim::InternalError);
}
