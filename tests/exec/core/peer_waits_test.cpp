// A measured communication task starts when all its parties have reached it, as the
// simulator's do (the wait before is idle time).
#include "exec/core/peer_waits.hpp"

#include "tests/test_util.hpp"

using dtsim::exec::TaskSpan;
using dtsim::lower::TaskKind;

namespace {

dtsim::lower::Task p2p(TaskKind kind, int peer, std::int64_t tag) {
  dtsim::lower::Task t;
  t.kind = kind;
  t.stream = dtsim::lower::Stream::Pp;
  t.peer = peer;
  t.tag = tag;
  return t;
}

dtsim::lower::Task collective(int group) {
  dtsim::lower::Task t;
  t.kind = TaskKind::Collective;
  t.stream = dtsim::lower::Stream::Tp;
  t.group = group;
  return t;
}

}  // namespace

TEST_CASE("a measured communication task starts when its parties are all ready",
          "[exec][peer_waits]") {
  dtsim::lower::Program program;
  program.lowering = dtsim::lower::Lowering::AllRanks;
  program.groups.resize(1);
  program.groups[0].programs = {0, 1};
  program.ranks.resize(2);
  dtsim::lower::Task compute;
  // Program 0: compute, two sends with one tag (matched in order), the group's two collectives.
  program.ranks[0].tasks = {compute, p2p(TaskKind::Send, 1, 7), p2p(TaskKind::Send, 1, 7),
                            collective(0), collective(0)};
  // Program 1: the receives, then the collectives.
  program.ranks[1].tasks = {p2p(TaskKind::Recv, 0, 7), p2p(TaskKind::Recv, 0, 7), compute,
                            collective(0), collective(0)};
  std::vector<std::vector<TaskSpan>> spans = {
      // The second send was seen done at 6.5, after its receive had the data (6).
      {{0, 2, true}, {2, 3, true}, {3, 6.5, true}, {6, 8, true}, {9, 10, true}},
      // The first receive was posted at 0.5 and waited for the send (2); the second was posted
      // after its send (4 > 3); the first collective reached last here; the second not timed.
      {{0.5, 3, true}, {4, 6, true}, {6, 7, true}, {7, 8, true}, {0, 0, false}},
  };
  dtsim::exec::start_when_peers_ready(program, spans);
  CHECK(spans[0][0].start_s == 0);  // compute: as measured
  CHECK(spans[1][0].start_s == 2);  // the wait for the sender is not the receive's
  CHECK(spans[0][1].start_s == 2);
  CHECK(spans[0][2].start_s == 4);  // the sender waited for the receive to be posted
  CHECK(spans[0][2].end_s == 6);    // and its transfer ended with the receive
  CHECK(spans[1][1].start_s == 4);
  CHECK(spans[0][1].end_s == 3);
  CHECK(spans[0][3].start_s == 7);  // the group's first collective: its latest member
  CHECK(spans[1][3].start_s == 7);
  CHECK(spans[0][4].start_s == 9);  // a party that did not run does not move the others
  CHECK(spans[1][4].start_s == 0);
  CHECK(spans[1][4].end_s == 0);
  for (const auto& rank : spans) {
    for (const auto& s : rank) CHECK(s.start_s <= s.end_s);
  }
  SECTION("overlapped transfers: the sends are eager, the receives wait for them") {
    program.plan.overlap_p2p_comm = true;
    spans[0][1] = {2, 3, true};
    spans[1][0] = {0.5, 3, true};
    spans[0][2] = {3, 7, true};  // handed off before its receive was posted (4)
    spans[1][1] = {4, 6, true};
    dtsim::exec::start_when_peers_ready(program, spans);
    CHECK(spans[1][0].start_s == 2);
    CHECK(spans[0][1].start_s == 2);
    CHECK(spans[0][2].start_s == 3);  // not moved to its receive's start
    CHECK(spans[0][2].end_s == 7);    // an eager send's end is its own
    CHECK(spans[1][1].start_s == 4);
  }
}

TEST_CASE("a start never passes the task's own end (clocks a little apart)", "[exec][peer_waits]") {
  dtsim::lower::Program program;
  program.lowering = dtsim::lower::Lowering::AllRanks;
  program.ranks.resize(2);
  program.ranks[0].tasks = {p2p(TaskKind::Send, 1, 0)};
  program.ranks[1].tasks = {p2p(TaskKind::Recv, 0, 0)};
  std::vector<std::vector<TaskSpan>> spans = {{{0, 1, true}}, {{1.5, 2, true}}};
  dtsim::exec::start_when_peers_ready(program, spans);
  CHECK(spans[0][0].start_s == 1);  // ended before its receive's start: begins at its end
  CHECK(spans[1][0].start_s == 1.5);
}

TEST_CASE("without progress during compute a collective leaves out the compute beside it",
          "[exec][peer_waits]") {
  // MPI on CPU ranks: an all-reduce started before the weight-gradient GEMM moves its data
  // after it, in the wait that ends it.
  dtsim::lower::Program program;
  program.lowering = dtsim::lower::Lowering::AllRanks;
  program.ranks.resize(1);
  dtsim::lower::Task compute;
  program.ranks[0].tasks = {compute,       collective(0), compute,      compute,
                            collective(0), compute,       collective(0)};
  std::vector<std::vector<TaskSpan>> spans = {{
      {0, 1, true},     // input gradient
      {1, 4.5, true},   // started at 1, completed at 4.5 (in the wait after the next two)
      {1.1, 2, true},   // inside
      {2, 4, true},     // inside
      {5, 6, true},     // started after the next one: a collective with nothing inside
      {6, 7, true},     // a compute task after the second collective's end
      {7, 7.5, false},  // not timed: not moved
  }};
  std::vector<std::vector<TaskSpan>> serial = spans;
  dtsim::exec::leave_out_compute(program, serial);
  CHECK(serial[0][1].start_s == Approx(1 + 0.9 + 2.0));  // after the compute inside
  CHECK(serial[0][1].end_s == 4.5);
  CHECK(serial[0][4].start_s == 5);  // nothing inside
  CHECK(serial[0][6].start_s == 7);
  for (std::size_t i : {0, 2, 3, 5}) {  // compute as measured
    CHECK(serial[0][i].start_s == spans[0][i].start_s);
    CHECK(serial[0][i].end_s == spans[0][i].end_s);
  }
  SECTION("at most to its end (clocks rounding)") {
    spans[0][1] = {1, 3.9, true};
    spans[0][2] = {1, 2.5, true};  // overlapping its neighbour: 3.4 s inside a 2.9 s span
    spans[0][3] = {2, 3.9, true};
    dtsim::exec::leave_out_compute(program, spans);
    CHECK(spans[0][1].start_s == 3.9);
  }
}
