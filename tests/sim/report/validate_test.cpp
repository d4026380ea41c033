#include "sim/report/validate.hpp"

#include "sim/common/error.hpp"
#include "sim/report/trace.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::test::TempFile;

namespace {
// A predicted trace of one program standing for ranks 0 and 4, with two tasks.
const char* kPredicted = R"({"traceEvents": [
  {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0", "represents": [0, 4]}},
  {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "compute"}},
  {"ph": "X", "name": "fwd", "pid": 0, "tid": 0, "ts": 0, "dur": 100, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
  {"ph": "X", "name": "bwd", "pid": 0, "tid": 0, "ts": 100, "dur": 200, "args": {"task": 1, "kind": "compute", "phase": "bwd"}}]})";

// A trace of one task whose otherData is `other`, read from file `name`.
dtsim::report::Trace trace_with(const char* name, const char* other) {
  TempFile f(name, std::string(R"({"traceEvents": [{"ph": "X", "pid": 0, "tid": 0, "ts": 0,
    "dur": 1, "args": {"task": 0}}], "otherData": )") +
                       other + "}");
  return dtsim::report::read_trace(f.path());
}
}  // namespace

TEST_CASE("validate joins every rank a predicted program stands for", "[report][validate]") {
  TempFile p("predicted.json", kPredicted);
  // Ranks 0 and 4 measured (4 has no program of its own in the prediction), rank 9 is not
  // represented.
  TempFile m("measured.json", R"({"traceEvents": [
    {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 125, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "pid": 4, "tid": 0, "ts": 0, "dur": 75, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "pid": 9, "tid": 0, "ts": 0, "dur": 50, "args": {"task": 0, "kind": "compute", "phase": "fwd"}}]})");
  const auto predicted = dtsim::report::read_trace(p.path());
  CHECK(predicted.representative.at(4) == 0);
  const auto v = dtsim::report::validate(predicted, dtsim::report::read_trace(m.path()));
  CHECK(v.matched == 2);
  CHECK(v.only_measured == 1);
  CHECK(v.only_predicted == 1);  // task 1 was not measured
  bool found = false;
  for (const auto& row : v.rows) {
    if (row.group != "kind fwd") continue;
    found = true;
    CHECK(row.tasks == 2);
    CHECK(row.predicted_s == Approx(200e-6));  // once per joined measurement
    CHECK(row.measured_s == Approx(200e-6));
    REQUIRE(row.error.has_value());
    CHECK(*row.error == Approx(0.0).margin(1e-12));
    CHECK(*row.mean_abs_error == Approx((0.2 + 1.0 / 3.0) / 2));  // |100/125-1|, |100/75-1|
  }
  CHECK(found);
  // Every joined pair, by measured rank: rank 0's fwd (100 against 125 µs), then rank 4's,
  // joined to rank 0's program.
  REQUIRE(v.tasks.size() == 2);
  CHECK(v.tasks[0].rank == 0);
  CHECK(v.tasks[1].rank == 4);
  CHECK(v.tasks[1].predicted_rank == 0);
  CHECK(v.tasks[1].name == "fwd");
  CHECK(v.tasks[1].stream == "compute");
  CHECK(v.tasks[0].predicted_s == Approx(100e-6));
  CHECK(v.tasks[0].measured_s == Approx(125e-6));
  REQUIRE(v.tasks[0].error.has_value());
  CHECK(*v.tasks[0].error == Approx(-0.2));
  CHECK(*v.tasks[1].error == Approx(1.0 / 3.0));
}

TEST_CASE("the step row spans the ranks the measured trace holds", "[report][validate]") {
  // Two stages: rank 0 from 0 to 300 us, rank 1 from 100 to 250. A trace of rank 1 alone
  // (dtexec run --only-rank 1, or a trace cut down) compared with the whole pipeline's span
  // was +192% for a lone rank of pp 2.
  TempFile p("predicted_pp2.json", R"({"traceEvents": [
    {"ph": "X", "name": "fwd", "pid": 0, "tid": 0, "ts": 0, "dur": 300, "args": {"task": 0}},
    {"ph": "X", "name": "fwd", "pid": 1, "tid": 0, "ts": 100, "dur": 150, "args": {"task": 0}}]})");
  TempFile m("measured_rank1.json", R"({"traceEvents": [
    {"ph": "X", "name": "fwd", "pid": 1, "tid": 0, "ts": 1000, "dur": 200, "args": {"task": 0}}]})");
  const auto v = dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                         dtsim::report::read_trace(m.path()));
  REQUIRE(v.rows.back().group == "step");
  CHECK(v.rows.back().predicted_s == Approx(150e-6));
  CHECK(v.rows.back().measured_s == Approx(200e-6));
  CHECK(v.step_programs == 1);
  CHECK(v.predicted_programs == 2);
  // Both ranks measured: the whole span, and no scope to say.
  TempFile both("measured_both.json", R"({"traceEvents": [
    {"ph": "X", "name": "fwd", "pid": 0, "tid": 0, "ts": 0, "dur": 280, "args": {"task": 0}},
    {"ph": "X", "name": "fwd", "pid": 1, "tid": 0, "ts": 90, "dur": 200, "args": {"task": 0}}]})");
  const auto w = dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                         dtsim::report::read_trace(both.path()));
  CHECK(w.rows.back().predicted_s == Approx(300e-6));
  CHECK(w.rows.back().measured_s == Approx(290e-6));
  CHECK(w.step_programs == 0);
}

TEST_CASE("a measured step hundreds of times the predicted one is said", "[report][validate]") {
  // A trace written in ms where Chrome's µs go read +99,900% and nothing more.
  TempFile p("scale_pred.json", kPredicted);
  TempFile ms("scale_ms.json", R"({"traceEvents": [
    {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 100000, "args": {"task": 0}},
    {"ph": "X", "pid": 0, "tid": 0, "ts": 100000, "dur": 200000, "args": {"task": 1}}]})");
  const auto predicted = dtsim::report::read_trace(p.path());
  const auto measured = dtsim::report::read_trace(ms.path());
  const auto note =
      dtsim::report::scale_note(dtsim::report::validate(predicted, measured), measured);
  REQUIRE(note);
  CHECK_THAT(*note, Catch::Contains("its step is 1e+03 times the predicted one: a trace in "
                                    "another time unit"));
  // Within tens of percent: nothing to say.
  TempFile near("scale_near.json", R"({"traceEvents": [
    {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 120, "args": {"task": 0}},
    {"ph": "X", "pid": 0, "tid": 0, "ts": 120, "dur": 230, "args": {"task": 1}}]})");
  const auto close = dtsim::report::read_trace(near.path());
  CHECK_FALSE(dtsim::report::scale_note(dtsim::report::validate(predicted, close), close));
}

TEST_CASE("validate counts the joined tasks that another plan names differently",
          "[report][validate]") {
  TempFile p("predicted.json", kPredicted);
  // Task 0 of another plan: a backward where this one has a forward; task 1 unnamed (a
  // hand-written trace), not counted.
  TempFile m("measured.json", R"({"traceEvents": [
    {"ph": "X", "name": "bwd", "pid": 0, "tid": 0, "ts": 0, "dur": 125, "args": {"task": 0, "kind": "compute", "phase": "bwd"}},
    {"ph": "X", "pid": 0, "tid": 0, "ts": 125, "dur": 50, "args": {"task": 1, "kind": "compute", "phase": "bwd"}}]})");
  const auto v = dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                         dtsim::report::read_trace(m.path()));
  CHECK(v.matched == 2);
  CHECK(v.renamed == 1);
  CHECK(v.first_renamed == "rank 0 task 0: name \"fwd\" predicted, \"bwd\" measured");
}

TEST_CASE("validate counts the joined tasks measured on another stream than predicted",
          "[report][validate]") {
  TempFile p("predicted_streams.json", kPredicted);
  // Named threads: task 1 on "dp" where the program has it on "compute"; task 0 on another tid
  // of the same name, not counted (lanes of one stream, as dtsim writes overlapping tasks).
  TempFile named("measured_streams.json", R"({"traceEvents": [
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 0, "args": {"name": "dp"}},
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 3, "args": {"name": "compute"}},
    {"ph": "X", "name": "fwd", "pid": 0, "tid": 3, "ts": 0, "dur": 125, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "name": "bwd", "pid": 0, "tid": 0, "ts": 125, "dur": 50, "args": {"task": 1, "kind": "compute", "phase": "bwd"}}]})");
  const auto v = dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                         dtsim::report::read_trace(named.path()));
  CHECK(v.matched == 2);
  CHECK(v.restreamed == 1);
  CHECK(v.first_restreamed ==
        "rank 0 task 1 \"bwd\": stream \"compute\" predicted, \"dp\" measured");
  // Unnamed threads compare by tid, a lane (tid + kStreamCount) as its stream.
  TempFile bare("measured_tids.json", R"({"traceEvents": [
    {"ph": "X", "name": "fwd", "pid": 0, "tid": 6, "ts": 0, "dur": 125, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "name": "bwd", "pid": 0, "tid": 2, "ts": 125, "dur": 50, "args": {"task": 1, "kind": "compute", "phase": "bwd"}}]})");
  const auto by_tid = dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                              dtsim::report::read_trace(bare.path()));
  CHECK(by_tid.restreamed == 1);
  CHECK(by_tid.first_restreamed == "rank 0 task 1 \"bwd\": stream \"0\" predicted, \"2\" measured");
  // The same streams: none.
  CHECK(dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                dtsim::report::read_trace(p.path()))
            .restreamed == 0);
}

TEST_CASE("a task measured as taking no time has no error", "[report][validate]") {
  TempFile p("predicted0.json", kPredicted);
  TempFile m("measured0.json", R"({"traceEvents": [
    {"ph": "X", "pid": 0, "tid": 0, "ts": 5, "dur": 0, "args": {"task": 1}},
    {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 50, "args": {"task": 0}}]})");
  const auto v = dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                         dtsim::report::read_trace(m.path()));
  REQUIRE(v.tasks.size() == 2);
  // In the measured order: task 0 started first.
  CHECK(v.tasks[0].task == 0);
  CHECK(v.tasks[0].error.has_value());
  CHECK(v.tasks[1].task == 1);
  CHECK(v.tasks[1].measured_start_s == Approx(5e-6));
  CHECK_FALSE(v.tasks[1].error.has_value());
}

TEST_CASE("a malformed represents list is rejected naming the event",
          "[report][validate][bad-input]") {
  TempFile p("bad_rep.json", R"({"traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "x", "represents": ["a"]}},
    {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1, "args": {"task": 0}}]})");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::report::read_trace(p.path()), InputError,
      "bad_rep.json: traceEvents[0].args.represents: expected ranks from 0 to 16777215, got \"a\"");
}

TEST_CASE("a rank past the trace's own plan is refused", "[report][validate][bad-input]") {
  // dp 2 x tp 1 x pp 1: ranks 0 and 1. An --only-rank of 5, a program standing for rank 5, a
  // task of rank 2 are no run of that plan (validate said "dtexec run --only-rank 5").
  const char* plan = R"({"plan": {"dp": 2, "tp": 1, "pp": 1}, "only_rank": 1})";
  CHECK(trace_with("plan_rank1.json", plan).only_rank == 1);
  DTSIM_REQUIRE_THROWS_CONTAINING(
      trace_with("plan_rank5.json", R"({"plan": {"dp": 2, "tp": 1, "pp": 1}, "only_rank": 5})"),
      InputError,
      "plan_rank5.json: otherData.only_rank: rank 5, but the trace's plan (otherData.plan) has "
      "ranks 0 to 1");
  TempFile rep("plan_represents.json", R"({"traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "x", "represents": [0, 5]}},
    {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1, "args": {"task": 0}}],
    "otherData": {"plan": {"dp": 2, "tp": 1, "pp": 1, "cp": 1}}})");
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::report::read_trace(rep.path()), InputError,
                                  "plan_represents.json: the process_name event of pid 0: "
                                  "args.represents: rank 5, but the trace's plan");
  TempFile task("plan_task_rank.json", R"({"traceEvents": [
    {"ph": "X", "pid": 2, "tid": 0, "ts": 0, "dur": 1, "args": {"task": 0}}],
    "otherData": {"plan": {"dp": 2, "tp": 1, "pp": 1}}})");
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::report::read_trace(task.path()), InputError,
                                  "plan_task_rank.json: a task event of pid (rank) 2, but");
}

TEST_CASE("traces in another form than dtsim's and dtexec's are refused, saying which",
          "[report][validate][bad-input]") {
  auto refused = [](const char* name, const char* text, const char* message) {
    TempFile f(name, text);
    DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::report::read_trace(f.path()), InputError, message);
  };
  // Chrome's array format, legal JSON: said as such (it read "expected an array").
  refused("array_form.json", R"([{"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1}])",
          "array_form.json: expected a JSON object with traceEvents");
  // dtsim lower's program given as a trace.
  refused("lowered.json", R"({"plan": {}, "ranks": [], "groups": []})",
          "lowered.json: traceEvents: missing; expected a Chrome trace (dtsim simulate --trace, "
          "dtexec run --trace): this looks like dtsim lower's program");
  refused("number_event.json", R"({"traceEvents": [5]})",
          "number_event.json: traceEvents[0]: expected an object (a trace event), got 5");
  // A task as a begin/end pair was dropped and counted as only predicted.
  refused("begin_end.json", R"({"traceEvents": [
    {"ph": "B", "pid": 0, "tid": 0, "ts": 0, "args": {"task": 0}},
    {"ph": "E", "pid": 0, "tid": 0, "ts": 5}]})",
          "begin_end.json: traceEvents[0].ph: \"B\": begin and end events are not read");
  // The plan it names is read as a plan file: an unknown field is no field of dtsim's.
  DTSIM_REQUIRE_THROWS_CONTAINING(
      trace_with("plan_bogus.json", R"({"plan": {"pp": 2, "bogus": 1}})"), InputError,
      "plan_bogus.json: otherData.plan: bogus: unknown field");
}

TEST_CASE("a negative rank or task id is rejected naming the event",
          "[report][validate][bad-input]") {
  TempFile rank("bad_pid.json", R"({"traceEvents": [
    {"ph": "X", "pid": -1, "tid": 0, "ts": 0, "dur": 1, "args": {"task": 0}}]})");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::report::read_trace(rank.path()), InputError,
      "bad_pid.json: traceEvents[0].pid: expected a rank (>= 0), got -1");
  TempFile task("bad_task.json", R"({"traceEvents": [
    {"ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1, "args": {"task": -3}}]})");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::report::read_trace(task.path()), InputError,
      "bad_task.json: traceEvents[0].args.task: expected a task id (>= 0), got -3");
}

TEST_CASE("validate sums each program task over its micro-batches and ranks",
          "[report][validate]") {
  using dtsim::report::without_micro_batch;
  CHECK(without_micro_batch("fwd L2.norm1..loss mb3") == "fwd L2.norm1..loss");
  CHECK(without_micro_batch("send activations mb12 chunk 1") == "send activations chunk 1");
  CHECK(without_micro_batch("optimizer step") == "optimizer step");
  CHECK(without_micro_batch("mb") == "mb");              // no number: not a micro-batch
  CHECK(without_micro_batch("fwd mb1x") == "fwd mb1x");  // not a number
  // Rank 0's program stands for ranks 0 and 4: two micro-batches of one forward and a
  // backward, then rank 1's own program.
  TempFile p("predicted_by_task.json", R"({"traceEvents": [
    {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0", "represents": [0, 4]}},
    {"ph": "X", "name": "fwd L0 mb0", "pid": 0, "tid": 0, "ts": 0, "dur": 100, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "name": "fwd L0 mb1", "pid": 0, "tid": 0, "ts": 100, "dur": 100, "args": {"task": 1, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "name": "bwd L0 mb0", "pid": 0, "tid": 0, "ts": 200, "dur": 200, "args": {"task": 2, "kind": "compute", "phase": "bwd"}},
    {"ph": "X", "name": "fwd L1 mb0", "pid": 1, "tid": 0, "ts": 100, "dur": 50, "args": {"task": 0, "kind": "compute", "phase": "fwd"}}]})");
  TempFile m("measured_by_task.json", R"({"traceEvents": [
    {"ph": "X", "name": "fwd L0 mb0", "pid": 0, "tid": 0, "ts": 0, "dur": 80, "args": {"task": 0}},
    {"ph": "X", "name": "fwd L0 mb1", "pid": 0, "tid": 0, "ts": 80, "dur": 120, "args": {"task": 1}},
    {"ph": "X", "name": "bwd L0 mb0", "pid": 0, "tid": 0, "ts": 200, "dur": 250, "args": {"task": 2}},
    {"ph": "X", "name": "fwd L0 mb0", "pid": 4, "tid": 0, "ts": 0, "dur": 100, "args": {"task": 0}},
    {"ph": "X", "name": "fwd L1 mb0", "pid": 1, "tid": 0, "ts": 80, "dur": 40, "args": {"task": 0}}]})");
  const auto v = dtsim::report::validate(dtsim::report::read_trace(p.path()),
                                         dtsim::report::read_trace(m.path()));
  REQUIRE(v.by_task.size() == 3);
  // By predicted rank, then program order.
  CHECK(v.by_task[0].group == "rank 0: fwd L0");
  CHECK(v.by_task[0].tasks == 3);  // mb0 and mb1 on rank 0, mb0 on rank 4
  CHECK(v.by_task[0].predicted_s == Approx(300e-6));
  CHECK(v.by_task[0].measured_s == Approx(300e-6));
  CHECK(*v.by_task[0].error == Approx(0.0).margin(1e-12));
  CHECK(*v.by_task[0].mean_abs_error == Approx((0.25 + 1.0 / 6.0 + 0.0) / 3));
  CHECK(v.by_task[1].group == "rank 0: bwd L0");
  CHECK(*v.by_task[1].error == Approx(-0.2));
  CHECK(v.by_task[2].group == "rank 1: fwd L1");
  CHECK(*v.by_task[2].error == Approx(0.25));
}

TEST_CASE("traces say what ran, and traces of different runs are told apart",
          "[report][validate]") {
  const auto a = trace_with("run_a.json", R"({"model": "tiny", "plan": {"dp": 1, "seq_len": 32}})");
  CHECK(a.model == "tiny");
  CHECK(a.plan.at("seq_len") == 32);
  CHECK_FALSE(dtsim::report::run_difference(a, a));
  const auto b = trace_with("run_b.json", R"({"model": "tiny", "plan": {"dp": 2, "seq_len": 8}})");
  CHECK(dtsim::report::run_difference(a, b) == "plan: dp 1 against 2, seq_len 32 against 8");
  const auto c = trace_with("run_c.json", R"({"model": "tiny-gpt", "plan": {"dp": 1}})");
  CHECK(dtsim::report::run_difference(a, c) == "model tiny against tiny-gpt");
  // The simulator's routing assumption is no difference of the run; a trace that does not say
  // (written before otherData) compares with any.
  const auto d = trace_with(
      "run_d.json", R"({"model": "tiny", "plan": {"dp": 1, "seq_len": 32, "expert_load": 2}})");
  CHECK_FALSE(dtsim::report::run_difference(a, d));
  const auto e = trace_with("run_e.json", "{}");
  CHECK_FALSE(dtsim::report::run_difference(a, e));
  // A field that one plan leaves derived (the even split of layers) is the other's run too; one
  // left out at its default is that default.
  const auto f = trace_with("run_f.json", R"({"model": "tiny", "plan": {"dp": 1, "seq_len": 32,
    "layers_per_stage": [1, 1]}})");
  CHECK_FALSE(dtsim::report::run_difference(a, f));
  const auto g = trace_with("run_g.json", R"({"model": "tiny", "plan": {"dp": 1, "seq_len": 32,
    "clip_grad": 1.0}})");
  CHECK(dtsim::report::run_difference(a, g) == "plan: clip_grad 0 against 1.0");
  const auto h = trace_with("run_h.json", R"({"model": "tiny", "plan": {"dp": 1, "seq_len": 32,
    "clip_grad": 0}})");
  CHECK_FALSE(dtsim::report::run_difference(a, h));
  TempFile bad("run_bad.json", R"({"traceEvents": [], "otherData": {"model": 3}})");
  // (otherData is read before the events.)
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::report::read_trace(bad.path()), InputError,
                                  "run_bad.json: otherData.model: expected a string");
}

TEST_CASE("traces say who wrote them for which device: notes where they differ",
          "[report][validate]") {
  const auto sim = trace_with(
      "origin_sim.json",
      R"({"model": "tiny", "plan": {"dp": 1}, "producer": "dtsim simulate", "device": "a100"})");
  const auto run = trace_with(
      "origin_run.json",
      R"({"model": "tiny", "plan": {"dp": 1}, "producer": "dtexec run", "device": "cpu-host"})");
  const auto sim_cpu = trace_with(
      "origin_sim_cpu.json",
      R"({"model": "tiny", "plan": {"dp": 1}, "producer": "dtsim simulate", "device": "cpu-host"})");
  CHECK(sim.producer == "dtsim simulate");
  CHECK(run.device == "cpu-host");
  // The same device: only what the measured step row is.
  auto notes = dtsim::report::origin_notes(sim_cpu, run);
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0], Catch::StartsWith("the step row is the one step " + run.file +
                                         " holds, the run's last"));
  // Another device.
  notes = dtsim::report::origin_notes(sim, run);
  REQUIRE(notes.size() == 2);
  CHECK_THAT(notes[0], Catch::StartsWith(sim.file + " is for device a100, " + run.file +
                                         " ran on cpu-host: the errors compare different "
                                         "hardware"));
  // Given the wrong way round.
  notes = dtsim::report::origin_notes(run, sim_cpu);
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0],
             Catch::StartsWith(run.file + " was written by dtexec run and " + sim_cpu.file +
                               " by dtsim simulate: given the wrong way round?"));
  // Traces written before producer and device: nothing to say.
  const auto old = trace_with("origin_old.json", R"({"model": "tiny", "plan": {"dp": 1}})");
  CHECK(dtsim::report::origin_notes(old, old).empty());
  CHECK(dtsim::report::origin_notes(sim, old).empty());
  // dtexec run --only-rank's: its communication was replayed, the other ranks did not run.
  const auto alone = trace_with("origin_alone.json", R"({"model": "tiny", "plan": {"dp": 1},
      "producer": "dtexec run", "device": "a100", "only_rank": 3})");
  CHECK(alone.only_rank == 3);
  notes = dtsim::report::origin_notes(sim, alone);
  REQUIRE(notes.size() == 2);
  CHECK_THAT(notes[0], Catch::StartsWith(alone.file + " is dtexec run --only-rank 3: its "
                                                      "communication tasks were waits of the "
                                                      "predicted lengths"));
  // Without --predicted its waits lasted nothing: said so.
  const auto zero = trace_with("origin_zero.json", R"({"model": "tiny", "plan": {"dp": 1},
      "producer": "dtexec run", "only_rank": 3, "only_rank_waits": "zero"})");
  notes = dtsim::report::origin_notes(sim, zero);
  REQUIRE(notes.size() == 2);
  CHECK_THAT(notes[0], Catch::Contains("its communication tasks were waits of zero length (no "
                                       "--predicted), not transfers (their rows compare the "
                                       "prediction with nothing)"));
  for (const char* bad : {"-1", "1.5", "\"3\""}) {
    DTSIM_REQUIRE_THROWS_CONTAINING(
        trace_with("origin_bad_rank.json",
                   (std::string(R"({"model": "tiny", "only_rank": )") + bad + "}").c_str()),
        InputError,
        "origin_bad_rank.json: otherData.only_rank: expected a rank (an integer from 0)");
  }
  // One that does not say which plan ran: the same-run check was only the tasks' names.
  const auto unsaid = trace_with("origin_unsaid.json", R"({"model": "tiny"})");
  notes = dtsim::report::origin_notes(sim, unsaid);
  REQUIRE(notes.size() == 1);
  CHECK_THAT(notes[0], Catch::StartsWith(unsaid.file + " does not say which model and plan ran "
                                                       "(otherData): that both traces are of "
                                                       "one run was checked only by their "
                                                       "tasks' names"));
}

TEST_CASE("a predicted straggler wait is left out of the task's predicted time",
          "[report][validate]") {
  // A collective predicted to last 150 µs of which 50 are the straggler model's expected wait
  // for its last rank; measured, it starts when that rank came (the wait is before its start).
  TempFile p("predicted_wait.json", R"({"traceEvents": [
    {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "comm_tp"}},
    {"ph": "X", "name": "fwd", "pid": 0, "tid": 0, "ts": 0, "dur": 100, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "name": "all-reduce", "pid": 0, "tid": 1, "ts": 100, "dur": 150, "args": {"task": 1, "kind": "collective", "straggler_wait_from_us": 100, "straggler_wait_us": 50}}]})");
  TempFile m("measured_wait.json", R"({"traceEvents": [
    {"ph": "X", "name": "fwd", "pid": 0, "tid": 0, "ts": 0, "dur": 100, "args": {"task": 0, "kind": "compute", "phase": "fwd"}},
    {"ph": "X", "name": "all-reduce", "pid": 0, "tid": 1, "ts": 160, "dur": 80, "args": {"task": 1, "kind": "collective"}}]})");
  const auto predicted = dtsim::report::read_trace(p.path());
  CHECK(predicted.tasks[1].wait_s == Approx(50e-6));
  CHECK(predicted.tasks[0].wait_s == 0);
  const auto v = dtsim::report::validate(predicted, dtsim::report::read_trace(m.path()));
  CHECK(v.waiting_tasks == 1);
  CHECK(v.straggler_wait_s == Approx(50e-6));
  REQUIRE(v.tasks.size() == 2);
  CHECK(v.tasks[1].predicted_s == Approx(100e-6));
  CHECK(v.tasks[1].predicted_wait_s == Approx(50e-6));
  CHECK(*v.tasks[1].error == Approx(0.25));  // 100 against 80
  bool found = false;
  for (const auto& row : v.rows) {
    if (row.group == "stream comm_tp") {
      found = true;
      CHECK(row.predicted_s == Approx(100e-6));
    }
    // The step's span holds the wait: 250 µs predicted against 240 measured.
    if (row.group == "step") CHECK(row.predicted_s == Approx(250e-6));
  }
  CHECK(found);
  // A simulated trace as the measurement leaves out its own waits too.
  const auto self = dtsim::report::validate(predicted, predicted);
  CHECK(self.tasks[1].measured_s == Approx(100e-6));
  CHECK(*self.tasks[1].error == Approx(0.0).margin(1e-12));
}

TEST_CASE("only the part of a straggler wait inside a task's span is left out",
          "[report][validate]") {
  // A blocking transfer's wait is before its span (both ends idle), a collective's inside it,
  // a receive's at its end.
  TempFile p("predicted_waits.json", R"({"traceEvents": [
    {"ph": "X", "pid": 0, "tid": 5, "ts": 200, "dur": 30, "args": {"task": 0, "kind": "send", "straggler_wait_from_us": 100, "straggler_wait_us": 100}},
    {"ph": "X", "pid": 0, "tid": 5, "ts": 300, "dur": 50, "args": {"task": 1, "kind": "recv", "straggler_wait_from_us": 330, "straggler_wait_us": 20}},
    {"ph": "X", "pid": 0, "tid": 1, "ts": 400, "dur": 50, "args": {"task": 2, "kind": "collective", "straggler_wait_from_us": 390, "straggler_wait_us": 30}}]})");
  const auto t = dtsim::report::read_trace(p.path()).tasks;
  CHECK(t[0].wait_s == 0);
  CHECK(t[1].wait_s == Approx(20e-6));
  CHECK(t[2].wait_s == Approx(20e-6));  // 10 of its 30 µs before the span
  // A span that is all wait leaves exactly no time, whatever the rounding of its ends.
  TempFile all("predicted_all_wait.json", R"({"traceEvents": [
    {"ph": "X", "pid": 0, "tid": 1, "ts": 0.1, "dur": 0.2, "args": {"task": 0, "kind": "collective", "straggler_wait_from_us": 0.1, "straggler_wait_us": 0.2}}]})");
  const auto w = dtsim::report::read_trace(all.path()).tasks[0];
  CHECK(w.duration_s - w.wait_s == 0);
}

TEST_CASE("a malformed straggler wait is rejected naming the event",
          "[report][validate][bad-input]") {
  auto trace = [](const char* name, const char* args) {
    return TempFile(name, std::string(R"({"traceEvents": [{"ph": "X", "pid": 0, "tid": 0,
      "ts": 0, "dur": 10, "args": {"task": 0, )") +
                              args + "}}]}");
  };
  for (const char* wait : {"-1", "1e16", "\"5\""}) {
    INFO(wait);
    const TempFile f = trace(
        "bad_wait.json",
        (std::string(R"("straggler_wait_from_us": 0, "straggler_wait_us": )") + wait).c_str());
    DTSIM_REQUIRE_THROWS_CONTAINING(
        dtsim::report::read_trace(f.path()), InputError,
        "traceEvents[0].args.straggler_wait_us: expected a wait in microseconds from 0 to 1e15");
  }
  for (const char* from : {R"("straggler_wait_from_us": "0", )", ""}) {
    INFO(from);
    const TempFile f =
        trace("bad_from.json", (std::string(from) + R"("straggler_wait_us": 5)").c_str());
    DTSIM_REQUIRE_THROWS_CONTAINING(
        dtsim::report::read_trace(f.path()), InputError,
        "traceEvents[0].args.straggler_wait_from_us: expected the wait's start in microseconds");
  }
  const TempFile ok =
      trace("ok_wait.json", R"("straggler_wait_from_us": 0, "straggler_wait_us": 10)");
  CHECK(dtsim::report::read_trace(ok.path()).tasks[0].wait_s == Approx(10e-6));
}

// A trace of millions of tasks takes tens of seconds and gigabytes to write: said before.
TEST_CASE("a trace of a million tasks or more is said to take a while", "[report][trace]") {
  CHECK_FALSE(dtsim::report::large_trace_note(999'999, "t.json"));
  const auto note = dtsim::report::large_trace_note(2'034'000, "t.json");
  REQUIRE(note);
  CHECK(
      note->find("note: writing a trace of 2.0 million tasks to t.json: expect tens of seconds") !=
      std::string::npos);
}

TEST_CASE("a wait under a picosecond is not written into a trace", "[report][trace]") {
  // The engine's sums leave waits of 1e-56 s where none is (traces held 1.8e-50 us).
  dtsim::lower::Program program;
  program.plan.seq_len = 32;
  dtsim::lower::RankProgram rank;
  rank.represents = {0};
  dtsim::lower::Task recv;
  recv.kind = dtsim::lower::TaskKind::Recv;
  recv.stream = dtsim::lower::Stream::Pp;
  recv.label = "recv";
  rank.tasks = {recv, recv};
  program.ranks.push_back(rank);
  dtsim::engine::Timeline timeline;
  timeline.tasks = {{{0, 10e-6}, {10e-6, 20e-6}}};
  timeline.tasks[0][0].wait_s = 1e-56;
  timeline.tasks[0][1].wait_s = 2e-6;
  timeline.tasks[0][1].wait_from_s = 10e-6;
  timeline.makespan_s = 20e-6;
  dtsim::report::TraceInfo info;
  info.model = "tiny";
  const auto trace = dtsim::report::chrome_trace(program, timeline, info);
  std::vector<bool> waits;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X") waits.push_back(e.at("args").contains("straggler_wait_us"));
  }
  CHECK(waits == std::vector<bool>{false, true});
}

TEST_CASE("a stream's overlapping tasks go to lanes of its name, which validate reads as one",
          "[report][trace]") {
  // A stage's pipeline stream: a send [0, 10) us, a receive [5, 15) beside it, a send [20, 30)
  // after both. A viewer's thread shows only nested or disjoint events (Perfetto), so the
  // receive takes a second lane: tid comm_pp + kStreamCount, named comm_pp too.
  using dtsim::lower::Stream;
  dtsim::lower::Program program;
  program.plan.seq_len = 32;  // (a plan that validate reads back as one)
  dtsim::lower::RankProgram rank;
  rank.represents = {0};
  for (const auto kind :
       {dtsim::lower::TaskKind::Send, dtsim::lower::TaskKind::Recv, dtsim::lower::TaskKind::Send}) {
    dtsim::lower::Task t;
    t.kind = kind;
    t.stream = Stream::Pp;
    t.label = kind == dtsim::lower::TaskKind::Send ? "send" : "recv";
    rank.tasks.push_back(t);
  }
  program.ranks.push_back(rank);
  dtsim::engine::Timeline timeline;
  timeline.tasks = {{{0, 10e-6}, {5e-6, 15e-6}, {20e-6, 30e-6}}};
  timeline.makespan_s = 30e-6;
  dtsim::report::TraceInfo info;
  info.model = "tiny";
  const auto trace = dtsim::report::chrome_trace(program, timeline, info);
  const int pp = static_cast<int>(Stream::Pp), second = pp + dtsim::lower::kStreamCount;
  std::vector<int> tids;
  bool named = false;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "X") tids.push_back(e.at("tid").get<int>());
    if (e.at("ph") == "M" && e.at("name") == "thread_name" && e.at("tid") == second) {
      named = e.at("args").at("name") == "comm_pp";
    }
  }
  CHECK(tids == std::vector<int>{pp, second, pp});
  CHECK(named);
  TempFile f("lanes.json", trace.dump());
  const auto read = dtsim::report::read_trace(f.path());
  const auto v = dtsim::report::validate(read, read);
  bool one_stream = false;
  for (const auto& row : v.rows)
    one_stream = one_stream || (row.group == "stream comm_pp" && row.tasks == 3);
  CHECK(one_stream);
}
