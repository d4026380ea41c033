// dtsim validate: join a predicted and a measured trace (DESIGN.md "Traces": one complete event
// per task, pid = rank, tid = stream, args.task = task id) task by task, and report the error
// per task kind, per stream and for the step.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace dtsim::report {

struct TraceTask {
  std::int64_t rank = 0;
  std::int64_t task = 0;
  int stream = 0;
  std::string name;        // the event's name ("fwd L3.norm1..L3.mlp_residual mb1")
  std::string kind;        // "fwd", "bwd", ... for compute (args.phase), else args.kind / category
  std::string collective;  // a collective's args.collective ("all_reduce"; "" in older traces)
  bool communication = false;  // a collective or transfer: an event without args.phase
  double start_s = 0;
  double duration_s = 0;
  // The straggler model's expected wait for a late rank inside the span (args.straggler_wait_us,
  // written by dtsim simulate for a collective or a receive; 0 where absent).
  double wait_s = 0;
};

struct Trace {
  std::string file;
  std::map<int, std::string> stream_names;  // tid -> name (thread_name metadata)
  // rank -> the rank whose program stands for it (process_name metadata "represents", written
  // by dtsim simulate for a stage's representative)
  std::map<std::int64_t, std::int64_t> representative;
  std::vector<TraceTask> tasks;
  // What ran (otherData; empty and null in traces written before it): the model's name, and the
  // plan's JSON.
  std::string model;
  nlohmann::json plan;
  // Who wrote it and for which device (otherData; empty in traces written before 2026-12-04).
  std::string producer;
  std::string device;
  // dtexec run --only-rank's rank (otherData only_rank): its communication tasks were waits of
  // the predicted lengths, and no other rank ran.
  std::optional<std::int64_t> only_rank;
  // "predicted", "measured" (a --predicted trace that dtexec run wrote) or "zero" (otherData
  // only_rank_waits).
  std::string only_rank_waits;
  double span_s() const;  // last end - first start
  // The time in which some task of some rank runs (the union of the tasks' spans).
  double busy_s() const;
};

// A note where a trace's span is mostly time in which no task of any rank runs (a task's ts far
// from the others': an edited or damaged trace), or where its tasks all last 0: the step row
// then says little. Nothing for a trace of one step as dtsim and dtexec write them (waits,
// transfers and bubbles are tasks or lie between tasks of another rank).
std::optional<std::string> span_note(const Trace& trace);

// Notes on what the two traces say of their origin: a prediction for one device against a
// measurement on another, traces given the wrong way round (the predicted one written by dtexec
// run, the measured one by dtsim simulate), and what the step row of a dtexec run's trace is.
std::vector<std::string> origin_notes(const Trace& predicted, const Trace& measured);

// Throws InputError naming the file and the event/field that is malformed.
Trace read_trace(const std::string& path);

// A measured time below this is no time to compare a prediction with: no clock that times
// tasks resolves it (steady_clock's nanosecond; CUDA events about half a microsecond). The
// errors are left unset, as for a time of 0 (a trace's durations of 1e-317 us gave +inf%).
inline constexpr double kShortestMeasured_s = 1e-9;

struct ErrorRow {
  std::string group;  // "kind fwd", "stream comm_tp", "step"
  std::int64_t tasks = 0;
  double predicted_s = 0;  // summed durations (for "step": the span)
  double measured_s = 0;
  // measured total against predicted: predicted / measured - 1; unset when nothing of the group
  // took measurable time.
  std::optional<double> error;
  // mean over the tasks that took measurable time of |predicted / measured - 1|; unset when none
  // did.
  std::optional<double> mean_abs_error;
};

// One measured task and the predicted task it joins.
struct TaskError {
  std::int64_t rank = 0;            // the measured rank
  std::int64_t predicted_rank = 0;  // the rank whose predicted program it joined
  std::int64_t task = 0;
  std::string name;  // the predicted event's name
  std::string kind;
  std::string stream;
  double predicted_s = 0;       // without the predicted straggler wait (predicted_wait_s)
  double predicted_wait_s = 0;  // the predicted task's expected wait for a late rank
  double measured_s = 0;        // without a wait it says it has (a simulated trace's)
  double measured_start_s = 0;  // from the measured trace's first task
  // predicted / measured - 1; unset when the measured time is below kShortestMeasured_s.
  std::optional<double> error;
};

struct Validation {
  std::vector<ErrorRow> rows;  // per kind, per stream, then the step
  // Per task of a predicted program, summed over its micro-batches and the ranks the program
  // stands for: where in a stage the prediction misses (the LM head's stage, a chunk). Group
  // "rank R: NAME", R the predicted rank and NAME the task's name without its " mbN" word; by
  // R, then by each group's first task id.
  std::vector<ErrorRow> by_task;
  // Every joined pair, by measured rank, then measured start, then task id.
  std::vector<TaskError> tasks;
  std::int64_t matched = 0;
  // The predicted straggler waits of the joined tasks, summed, and how many tasks have one:
  // left out of the tasks' and rows' predicted times (the step's span holds them). A measured
  // collective or receive starts when its last rank reaches it (exec/core/peer_waits.hpp), so
  // its wait for a late rank is before its start, not in its span.
  double straggler_wait_s = 0;
  std::int64_t waiting_tasks = 0;
  std::int64_t only_predicted = 0;
  std::int64_t only_measured = 0;
  // Joined pairs whose predicted task is a collective or transfer (waits on peers).
  std::int64_t communication_tasks = 0;
  // Of only_predicted, those of a predicted rank that some measured task joined (not of a rank
  // that the measured trace leaves out, as a dtexec run --only-rank trace leaves all but one).
  std::int64_t only_predicted_on_joined_ranks = 0;
  // Joined pairs whose names differ (traces of different plans: a task id names another task),
  // and the first of them, as "rank R task T: "predicted name" predicted, "measured" measured".
  std::int64_t renamed = 0;
  std::string first_renamed;
  // Joined pairs whose streams differ (by name where both traces name their threads, else by
  // tid): a trace edited, or of another program's streams. The stream rows take the predicted
  // task's. The first, as "rank R task T "name": "predicted" predicted, "measured" measured".
  std::int64_t restreamed = 0;
  std::string first_restreamed;
  // The step row's scope where the measured trace leaves out ranks (dtexec run --only-rank, a
  // trace cut down): how many of the predicted programs it spans, of how many (0 of 0 where it
  // spans them all). Both spans are then of those programs' and ranks' tasks alone.
  std::int64_t step_programs = 0, predicted_programs = 0;
};

// A task's name without its micro-batch word: "fwd L2.norm1..loss mb3" -> "fwd L2.norm1..loss",
// "send activations mb0 chunk 1" -> "send activations chunk 1".
std::string without_micro_batch(const std::string& name);

// How two traces' runs differ, as "model a against b" or "plan: seq_len 8 against 32, ..."
// (every differing field but expert_load, the simulator's routing assumption); nothing where
// they agree or either does not say.
std::optional<std::string> run_difference(const Trace& a, const Trace& b);

// Every measured task joins the predicted task of the same id on its rank, or on the rank
// whose program stands for it (so all ranks of a multi-rank run compare with one simulated
// program per stage); the rows sum over the joined pairs. A predicted task's time is its span
// less its straggler wait (TraceTask::wait_s), the part a measured task's span holds too (a
// simulated "measured" trace's tasks leave out their own waits alike). Traces of
// one plan name a task alike (both write the Program's names); `renamed` counts the pairs that do
// not (where both have a name).
Validation validate(const Trace& predicted, const Trace& measured);

// A note where the measured step is hundreds of times the predicted one or a hundredth of it
// (kFarApart): a trace in another time unit (ms written where Chrome's µs go), or of another
// device or plan; nothing otherwise.
std::optional<std::string> scale_note(const Validation& v, const Trace& measured);

}  // namespace dtsim::report
