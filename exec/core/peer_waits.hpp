// Measured communication tasks, read as the simulator reads its own. A rank's receive,
// collective or blocking send lasts, as measured, from when that rank reached it until it
// completed: the wait for the peers that reach it later is inside. The simulator starts such a
// task when all its parties are ready (engine.cpp: a collective at its members' latest arrival,
// a transfer when the sender is ready and the receive is posted), and counts the wait before it
// as idle time (the pipeline bubble, or waiting for a straggler). Given every rank's times on
// one clock, this moves each communication task's start to its parties' latest start, so that
// a measured trace and breakdown split a step as a predicted one does.
#pragma once

#include <vector>

#include "sim/lower/program.hpp"

namespace dtsim::exec {

struct TaskSpan {
  double start_s = 0;
  double end_s = 0;
  bool timed = false;  // not timed (not run in this step): neither moved nor a party's start
};

// `spans[p][i]`: task i of program p (program.ranks[p]), every program's on one clock, one
// step. Parties: a send and the receive it matches (same pair of programs and tag, matched in
// program order), and a group's k-th collective on each of its programs (members reach a group's
// collectives in the same order). A task's start becomes the latest start of its timed parties,
// at most its own end. Compute tasks are left as they are, and so are sends with overlapped
// transfers (plan.overlap_p2p_comm): the simulator has them eager, not waiting for the receive
// (their start still counts for the receive's). A blocking send also ends at the latest when
// its receive does: it is done when the data is in, while the runner sees it done only where it
// next waits for its sends, possibly after later tasks. Needs a Program lowered with
// Lowering::AllRanks (every party has its own program).
void start_when_peers_ready(const lower::Program& program,
                            std::vector<std::vector<TaskSpan>>& spans);

// A backend whose communication progresses only inside its own calls (Comm::
// progresses_while_computing false: MPI on CPU ranks) moves a started collective's data after
// the compute tasks that the rank runs while it is pending, in the calls between and after
// them. Measured from its start to its completion, the collective's span holds those tasks,
// which the simulator (a cluster whose ranks compute and communicate one task at a time,
// cpu-host) runs apart. This moves each timed collective's start later by the time of the
// timed compute tasks of its program that ran inside its span, at most to its end. Before
// start_when_peers_ready.
void leave_out_compute(const lower::Program& program, std::vector<std::vector<TaskSpan>>& spans);

}  // namespace dtsim::exec
