// dtsim validate: predicted against measured, task by task.
#include <fmt/format.h>

#include <iostream>
#include <nlohmann/json.hpp>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/report/json_values.hpp"
#include "sim/report/table.hpp"
#include "sim/report/validate.hpp"

namespace dtsim::cli {

int cmd_validate(const std::vector<std::string>& args) {
  po::options_description desc("dtsim validate options");
  desc.add_options()("help,h", "show this help")("predicted", po::value<std::string>(),
                                                 "trace written by dtsim simulate --trace")(
      "measured", po::value<std::string>(), "trace written by dtexec run --trace")(
      "json", po::bool_switch(), "print JSON (always with every joined task)")(
      "tasks", po::bool_switch(),
      "also print every joined task: rank, task id, name, predicted, measured and error, in "
      "the measured order")(
      "by-task", po::bool_switch(),
      "also print the error per task of each predicted program (a pipeline stage's), summed "
      "over the micro-batches and the ranks it stands for: where in a stage the prediction "
      "misses");
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtsim validate --predicted A.json --measured B.json [--by-task] [--tasks] "
             "[--json]\n\n"
             "Joins two traces task by task (same rank and task id) and reports the error per "
             "task kind, per stream and for the whole step (error = predicted / measured - 1).",
             vm)) {
    return 0;
  }
  if (!vm.count("predicted") || !vm.count("measured")) {
    throw InputError("--predicted and --measured: both traces are required");
  }
  const auto predicted = report::read_trace(vm["predicted"].as<std::string>());
  const auto measured = report::read_trace(vm["measured"].as<std::string>());
  // Traces that say what ran (otherData) must say the same: a join of two plans' tasks by id
  // would compare different work.
  if (const auto differ = report::run_difference(predicted, measured)) {
    throw InputError(fmt::format(
        "{} and {}: not traces of the same run ({}, predicted against measured): simulate the "
        "plan that ran (dtexec run --json prints it)",
        predicted.file, measured.file, *differ));
  }
  const report::Validation v = report::validate(predicted, measured);
  if (v.matched == 0) {
    throw InputError(
        fmt::format("{} and {}: no task appears in both traces (they must come from "
                    "the same plan)",
                    predicted.file, measured.file));
  }
  if (v.renamed > 0) {
    throw InputError(fmt::format(
        "{} and {}: not traces of the same plan ({} of {} joined tasks are named differently; "
        "{}): simulate the plan that ran (dtexec run --json prints it)",
        predicted.file, measured.file, v.renamed, v.matched, v.first_renamed));
  }
  // What a task's time covers differs for the tasks that wait on peers.
  std::string note =
      "a predicted receive, collective or blocking send starts when all its ranks are ready; "
      "dtexec run's trace starts it so too, its ranks' times on one clock (one host's, or rank "
      "0's on several, to within the round trips its JSON's clock.error_s gives)";
  if (v.waiting_tasks > 0) {
    note += fmt::format(
        ". The straggler model (--jitter-cv, or a profile's jitter_cv) also puts an expected "
        "wait for the last rank inside {} predicted collectives and receives, {:.3f} ms in all, "
        "which a measured one has before its start: their predicted times here leave it out "
        "(the step's span holds it)",
        v.waiting_tasks, v.straggler_wait_s * 1e3);
  }
  // (Only where such tasks joined: a single rank's trace has none.)
  std::vector<std::string> notes;
  // (A run of one rank, its communication replayed, has no peers to wait for.)
  if (v.communication_tasks > 0 && !measured.only_rank) notes.push_back(note);
  for (auto& n : report::origin_notes(predicted, measured)) notes.push_back(std::move(n));
  for (const report::Trace* trace : {&predicted, &measured}) {
    if (auto n = report::span_note(*trace)) notes.push_back(std::move(*n));
  }
  if (auto n = report::scale_note(v, measured)) notes.push_back(std::move(*n));
  if (v.restreamed > 0) {
    notes.push_back(fmt::format(
        "{} of {} joined tasks ran on another stream than predicted (first: {}): an edited "
        "trace, or another program's streams; the stream rows group them by the predicted one",
        v.restreamed, v.matched, v.first_restreamed));
  }
  // (A trace that names its plan and is not a lone rank's has the note on its missing ranks,
  // which says the same.)
  if (v.step_programs > 0 && (measured.only_rank || measured.plan.is_null())) {
    notes.push_back(fmt::format(
        "{} holds tasks of {} of the {} predicted programs: the step row spans those programs' "
        "tasks in both traces, not the whole pipeline's step",
        measured.file, v.step_programs, v.predicted_programs));
  }
  if (v.only_predicted_on_joined_ranks > 0 || v.only_measured > 0) {
    // The step row spans each trace's own tasks: a task of a rank in one trace only (a trace
    // cut short, an edited one) changes one span and not the other. Ranks that the measured
    // trace leaves out whole (dtexec run --only-rank) are not that.
    notes.push_back(fmt::format(
        "the traces hold different tasks of the ranks they share ({} only predicted, {} only "
        "measured): the step row spans each trace's own, so there it compares different work",
        v.only_predicted_on_joined_ranks, v.only_measured));
  }
  auto add_rows = [](report::Table& t, const std::vector<report::ErrorRow>& rows) {
    for (const auto& r : rows) {
      t.add_row({r.group, fmt::format("{}", r.tasks), fmt::format("{:.3f}", r.predicted_s * 1e3),
                 fmt::format("{:.3f}", r.measured_s * 1e3),
                 r.error ? fmt::format("{:+.1f}%", 100 * *r.error) : "-",
                 r.mean_abs_error ? fmt::format("{:.1f}%", 100 * *r.mean_abs_error) : "-"});
    }
  };
  auto error_table = [](const char* first) {
    report::Table t({first, "tasks", "predicted", "measured", "error", "mean |task error|"});
    t.set_units({"", "", "ms", "ms", "", ""});
    t.align_left(0);
    return t;
  };
  if (vm["json"].as<bool>()) {
    auto json_rows = [](const std::vector<report::ErrorRow>& from) {
      nlohmann::json rows = nlohmann::json::array();
      for (const auto& r : from) {
        rows.push_back({{"group", r.group},
                        {"tasks", r.tasks},
                        {"predicted_s", r.predicted_s},
                        {"measured_s", r.measured_s},
                        {"error", report::value_or_null(r.error)},
                        {"mean_abs_task_error", report::value_or_null(r.mean_abs_error)}});
      }
      return rows;
    };
    nlohmann::json tasks = nlohmann::json::array();
    for (const auto& t : v.tasks) {
      tasks.push_back({{"rank", t.rank},
                       {"predicted_rank", t.predicted_rank},
                       {"task", t.task},
                       {"name", t.name},
                       {"kind", t.kind},
                       {"stream", t.stream},
                       {"predicted_s", t.predicted_s},
                       {"predicted_wait_s", t.predicted_wait_s},
                       {"measured_s", t.measured_s},
                       {"measured_start_s", t.measured_start_s},
                       {"error", report::value_or_null(t.error)}});
    }
    std::cout << json_text(nlohmann::json{{"matched", v.matched},
                                          {"only_predicted", v.only_predicted},
                                          {"only_measured", v.only_measured},
                                          {"straggler_wait",
                                           {{"tasks", v.waiting_tasks},
                                            {"predicted_s", v.straggler_wait_s}}},
                                          {"rows", json_rows(v.rows)},
                                          {"by_task", json_rows(v.by_task)},
                                          {"tasks", tasks},
                                          {"notes", notes}},
                           2)
              << "\n";
    return 0;
  }
  report::Table t = error_table("group");
  add_rows(t, v.rows);
  std::cout << t.render();
  if (vm["by-task"].as<bool>()) {
    report::Table per = error_table("program task (all micro-batches)");
    add_rows(per, v.by_task);
    std::cout << "\n" << per.render();
  }
  if (vm["tasks"].as<bool>()) {
    report::Table per({"rank", "task", "name", "kind", "stream", "start", "predicted", "measured",
                       "error", "predicted wait"});
    per.set_units({"", "", "", "", "", "ms", "ms", "ms", "", "ms"});
    per.align_left(2);
    per.align_left(3);
    per.align_left(4);
    for (const auto& task : v.tasks) {
      per.add_row({fmt::format("{}", task.rank), fmt::format("{}", task.task), task.name, task.kind,
                   task.stream, fmt::format("{:.3f}", task.measured_start_s * 1e3),
                   fmt::format("{:.3f}", task.predicted_s * 1e3),
                   fmt::format("{:.3f}", task.measured_s * 1e3),
                   task.error ? fmt::format("{:+.1f}%", 100 * *task.error) : "-",
                   fmt::format("{:.3f}", task.predicted_wait_s * 1e3)});
    }
    std::cout << "\n" << per.render();
  }
  std::cout << fmt::format("{} tasks matched; {} only predicted, {} only measured\n", v.matched,
                           v.only_predicted, v.only_measured);
  for (const auto& n : notes) std::cout << report::note_line(n) << "\n";
  return 0;
}

}  // namespace dtsim::cli
