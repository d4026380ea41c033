// The discrete-event engine: runs a Program's tasks in time. Each rank has streams that run
// their tasks one at a time in issue order; a task starts when its stream is free and its
// dependencies are done. Collectives start when every simulated member of their group has
// reached them; a receive completes when the matching send's data has arrived. Pipeline
// transfers follow the plan's overlap_p2p_comm: overlapped, a send is eager (it leaves when its
// tensor exists and occupies the rank's pipeline stream); blocking (Megatron-LM's default), a
// transfer starts when the send is ready and the receive posted, and both tasks span it.
// Deterministic: ties in time are broken by the order events were created.
//
// Stragglers (EngineOptions::jitter_cv): ranks that run the same compute do not finish it at
// the same moment. Each rank's compute since it last met the others (the group's previous
// collective, or its last pipeline transfer with one of them) takes T·(1 + e), e normal with
// standard deviation cv and independent across ranks, so it arrives early or late by a normal
// spread of cv·T around the simulated time. A collective or a transfer waits for the last of
// its ranks: on average that long after the latest simulated arrival (expected_lateness),
// E[max of n standard normals]·cv·T for n ranks that come together after the same T, nothing
// for a rank that comes long after the others. A collective waits before it starts (its
// members' tasks span the wait, as a measured trace shows it); a blocking transfer starts that
// late; an eager send's data reaches its receive that late (the sender never waits). An
// approximation: real noise is neither normal nor independent across ranks; the spread is
// taken as proportional to T (noise correlated along one rank's segment; were it independent
// from op to op, long segments would spread less, as sqrt(T)).
//
// A slow rank (EngineOptions::slow_program, slow_factor): ranks whose speeds differ for good
// (a slower chip, a hotter one, a busier host) rather than from one segment to the next. One
// program computes slow_factor times longer; the others wait for it where they meet it (its
// collectives, its transfers), so that it paces the step as the slowest of many ranks does.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "sim/lower/program.hpp"

namespace dtsim::engine {

struct TaskTime {
  double start_s = 0;
  double end_s = 0;
  // The straggler model's wait for the last rank, [wait_from_s, wait_from_s + wait_s): inside
  // the span of a collective and of a receive, before it for a blocking transfer (both ends
  // idle; the link queue may start the transfer later still). 0 without the model, and in a
  // measured trace, which cannot tell such waits apart (dtexec counts a task from when its last
  // party reached it, and the wait before that as bubble).
  double wait_from_s = 0;
  double wait_s = 0;
};

struct Timeline {
  std::vector<std::vector<TaskTime>> tasks;  // [rank program][task]
  double makespan_s = 0;
  std::uint64_t events = 0;
};

// What the engine asks about durations (compute cost model + network model).
class Durations {
 public:
  virtual ~Durations() = default;
  virtual double compute_s(const lower::Task& task) = 0;
  virtual double collective_s(const lower::Group& group, const lower::Task& task) = 0;
  virtual double p2p_s(std::int64_t src_rank, std::int64_t dst_rank, std::uint64_t bytes) = 0;
};

struct EngineOptions {
  // Coefficient of variation of a rank's compute time between two meetings with the others (a
  // collective, a pipeline transfer; 0: none).
  double jitter_cv = 0;
  // A rank runs one task at a time, in program order, on all its streams together (its
  // communication cannot progress while it computes: cluster::Cluster::serial_ranks_source).
  // Pipeline sends and receives keep their own rules.
  bool serial_ranks = false;
  // The program whose compute tasks take slow_factor (>= 1) times their duration; -1: none.
  std::int32_t slow_program = -1;
  double slow_factor = 1.0;
  // Called now and then with the events handled so far and the program's tasks (each ends in
  // one), and once at the end with (tasks, tasks): for a progress bar. Empty: not called.
  std::function<void(std::uint64_t done, std::uint64_t total)> progress;
};

// E[max of n independent standard normal variables] (0 for n = 1; 0.5642 for n = 2).
double expected_max_normal(std::int64_t n);

// Ranks that reach a rendezvous (a collective, the two ends of a pipeline transfer) at `at_s`
// on average, each early or late by its own normal spread of standard deviation `sigma_s`,
// independently; `ranks` of them (a program that stands for several).
struct Arrival {
  double at_s = 0;
  double sigma_s = 0;
  double ranks = 1;
};

// How long after the latest average arrival the last rank comes, on average: E[max over all
// ranks] - max at_s. Arrivals together with one spread give E[max of n normals]·sigma; a rank
// that comes long after the others waits for nobody (0). The maximum's distribution is the
// product of the normal distributions, integrated numerically: to about 0.5% of the largest
// spread where one spread is far narrower than another (under 0.1% of the largest, it counts
// as none), far closer where they are alike. Two single ranks, and ranks together with one
// spread, take the closed forms.
double expected_lateness(std::vector<Arrival> arrivals);

// The same for two single ranks, in closed form (Clark 1961, "The greatest of a finite set of
// random variables", Operations Research 9(2): E[max] of two normals).
double expected_lateness(const Arrival& a, const Arrival& b);

// Throws InternalError naming a stuck task if the program cannot finish (a lowering bug).
Timeline run(const lower::Program& program, Durations& durations,
             const EngineOptions& options = {});

}  // namespace dtsim::engine
