#include "sim/report/validate.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <tuple>

#include "sim/cluster/topology.hpp"
#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"
#include "sim/plan/plan.hpp"
#include "sim/report/trace.hpp"

namespace dtsim::report {

using nlohmann::json;

double Trace::span_s() const {
  if (tasks.empty()) return 0;
  double first = tasks.front().start_s, last = first + tasks.front().duration_s;
  for (const auto& t : tasks) {
    first = std::min(first, t.start_s);
    last = std::max(last, t.start_s + t.duration_s);
  }
  return last - first;
}

double Trace::busy_s() const {
  std::vector<std::pair<double, double>> spans;
  spans.reserve(tasks.size());
  for (const auto& t : tasks) spans.emplace_back(t.start_s, t.start_s + t.duration_s);
  std::sort(spans.begin(), spans.end());
  double busy = 0, from = 0, to = 0;
  bool open = false;
  for (const auto& [begin, end] : spans) {
    if (open && begin <= to) {
      to = std::max(to, end);
      continue;
    }
    if (open) busy += to - from;
    from = begin, to = end, open = true;
  }
  return open ? busy + (to - from) : 0.0;
}

std::optional<std::string> span_note(const Trace& trace) {
  // In one step some task of some rank runs nearly all the time (a pipeline's bubbles on one
  // stage are another stage's passes); a tenth is far below any schedule's.
  constexpr double kLeastBusyShare = 0.1;
  const double span = trace.span_s(), busy = trace.busy_s();
  if (span > 0 && busy == 0) {
    return fmt::format("{}: every task lasts 0: its step row is only the tasks' spread",
                       trace.file);
  }
  if (busy >= kLeastBusyShare * span) return std::nullopt;
  return fmt::format(
      "{}: its tasks span {:.6g} ms, in only {:.6g} ms of which ({:.2g}%) a task runs: a task's "
      "ts out of place? The step row compares that span",
      trace.file, span * 1e3, busy * 1e3, 100 * busy / span);
}

std::optional<std::string> scale_note(const Validation& v, const Trace& measured) {
  // A thousand is a unit off (ms for µs); a prediction of the same device and plan is within
  // tens of percent (README's validation tables), another device's within tens of times.
  constexpr double kFarApart = 300;
  if (v.rows.empty() || v.rows.back().group != "step") return std::nullopt;
  const ErrorRow& step = v.rows.back();
  if (step.predicted_s <= 0 || step.measured_s <= 0) return std::nullopt;
  const double ratio = step.measured_s / step.predicted_s;
  if (ratio < kFarApart && ratio > 1 / kFarApart) return std::nullopt;
  return fmt::format(
      "{}: its step is {:.3g} times the predicted one: a trace in another time unit (a Chrome "
      "trace's ts and dur are in microseconds), or of another device or plan?",
      measured.file, ratio);
}

namespace {
// dp x tp x pp x cp of a trace's plan JSON; none where it does not say (an older trace).
std::optional<std::int64_t> plan_ranks(const json& plan) {
  if (!plan.is_object()) return std::nullopt;
  std::int64_t ranks = 1;
  for (const char* key : {"dp", "tp", "pp", "cp"}) {
    if (!plan.contains(key)) {
      if (std::string_view(key) == "cp") continue;  // (before context parallelism: 1)
      return std::nullopt;
    }
    const json& v = plan.at(key);
    if (!v.is_number_integer() || v.get<std::int64_t>() < 1 ||
        v.get<std::int64_t>() > cluster::kMaxDevices) {
      return std::nullopt;
    }
    ranks *= v.get<std::int64_t>();
    if (ranks > cluster::kMaxDevices) return std::nullopt;
  }
  return ranks;
}

// The ranks of its own plan that a trace holds no task of, nor names a rank standing for them
// (a trace cut by hand, a run's gather that lost a rank): its step row would compare the ranks
// left as if they were the run. Listed up to 8; none for an --only-rank trace.
std::optional<std::string> missing_ranks_note(const Trace& trace) {
  const auto ranks = plan_ranks(trace.plan);
  if (!ranks || trace.only_rank) return std::nullopt;
  std::set<std::int64_t> held;
  for (const TraceTask& t : trace.tasks) held.insert(t.rank);
  for (const auto& [rank, pid] : trace.representative) held.insert(rank);
  if (static_cast<std::int64_t>(held.size()) >= *ranks) return std::nullopt;
  std::vector<std::int64_t> missing;
  std::int64_t count = 0;
  for (std::int64_t r = 0; r < *ranks; ++r) {
    if (held.count(r) == 0 && count++ < 8) missing.push_back(r);
  }
  return fmt::format(
      "{} holds no task of {} of its plan's {} ranks (rank{} {}{}): its step and stream rows "
      "compare the ranks it holds only",
      trace.file, count, *ranks, count == 1 ? "" : "s", fmt::join(missing, ", "),
      count > 8 ? ", ..." : "");
}
}  // namespace

std::vector<std::string> origin_notes(const Trace& predicted, const Trace& measured) {
  std::vector<std::string> notes;
  for (const Trace* t : {&predicted, &measured}) {
    if (auto note = missing_ranks_note(*t)) notes.push_back(std::move(*note));
  }
  if (predicted.producer == kProducedByRun && measured.producer == kProducedBySimulate) {
    notes.push_back(fmt::format(
        "{} was written by {} and {} by {}: given the wrong way round? (error = predicted / "
        "measured - 1)",
        predicted.file, predicted.producer, measured.file, measured.producer));
  }
  if (!predicted.device.empty() && !measured.device.empty() &&
      predicted.device != measured.device) {
    notes.push_back(fmt::format(
        "{} is for device {}, {} ran on {}: the errors compare different hardware (simulate on "
        "the cluster the run used, e.g. --cluster cpu-host for CPU ranks)",
        predicted.file, predicted.device, measured.file, measured.device));
  }
  // A trace that does not say what ran (otherData's plan: written by hand, by another tool, or
  // before 2026-12-03) leaves the check that both are of one run undone; only the tasks' names
  // were compared.
  std::vector<std::string> unsaid;
  for (const Trace* t : {&predicted, &measured}) {
    if (t->plan.is_null()) unsaid.push_back(t->file);
  }
  if (!unsaid.empty()) {
    notes.push_back(fmt::format(
        "{} {} not say which model and plan ran (otherData): that both traces are of one run "
        "was checked only by their tasks' names",
        fmt::join(unsaid, " and "), unsaid.size() == 1 ? "does" : "do"));
  }
  if (measured.only_rank) {
    notes.push_back(fmt::format(
        "{} is dtexec run --only-rank {}: its communication tasks were waits {}, not transfers "
        "({}), and the other ranks did not run (their tasks are only predicted; nor did it wait "
        "for their compute, so its step row leaves out the pipeline bubble that the predicted "
        "span of its program holds)",
        measured.file, *measured.only_rank,
        measured.only_rank_waits == "zero"       ? "of zero length (no --predicted)"
        : measured.only_rank_waits == "measured" ? "of the lengths another run measured"
                                                 : "of the predicted lengths",
        measured.only_rank_waits == "zero" ? "their rows compare the prediction with nothing"
                                           : "their rows measure how closely the waits kept them"));
  }
  if (measured.producer == kProducedByRun) {
    notes.push_back(fmt::format(
        "the step row is the one step {} holds, the run's last (dtexec run's median step time is "
        "over all its steps after the warm-up)",
        measured.file));
  }
  return notes;
}

Trace read_trace(const std::string& path) {
  const json j = JsonReader::parse_file(path);
  if (j.is_array()) {
    throw InputError(fmt::format(
        "{}: expected a JSON object with traceEvents (the Chrome trace's object format, which "
        "dtsim simulate --trace and dtexec run --trace write), got an array (its array format "
        "is not read)",
        path));
  }
  if (!j.is_object() || !j.contains("traceEvents")) {
    throw InputError(fmt::format(
        "{}: traceEvents: missing; expected a Chrome trace (dtsim simulate --trace, dtexec run "
        "--trace){}",
        path,
        j.is_object() && j.contains("ranks") && j.contains("plan")
            ? ": this looks like dtsim lower's program, which has tasks but no times"
            : ""));
  }
  if (!j.at("traceEvents").is_array()) {
    throw InputError(
        fmt::format("{}: traceEvents: expected an array of Chrome trace events", path));
  }
  Trace trace;
  trace.file = path;
  if (j.contains("otherData")) {
    const JsonReader other(j, path);
    const JsonReader what = other.object("otherData");
    // (A null would be taken as absent: what ran, unsaid in silence.)
    what.refuse_nulls();
    if (what.has("model")) trace.model = what.string("model");
    if (what.has("plan")) {
      // Read as a plan file is (an unknown field or a wrong type refused: a field of another
      // tool, or an edit, would be compared in silence). Fields it lacks (a trace of an older
      // dtsim) are compared where both traces have them.
      what.object("plan").refuse_nulls();
      trace.plan = what.object("plan").raw();
      (void)plan::plan_from_json(trace.plan, path + ": otherData.plan");
    }
    if (what.has("producer")) trace.producer = what.string("producer");
    if (what.has("device")) trace.device = what.string("device");
    if (what.has("only_rank")) {
      const json& r = j.at("otherData").at("only_rank");
      if (!r.is_number_integer() || r.get<std::int64_t>() < 0) {
        what.fail("only_rank", "expected a rank (an integer from 0)");
      }
      trace.only_rank = r.get<std::int64_t>();
    }
    if (what.has("only_rank_waits")) {
      trace.only_rank_waits = what.choice("only_rank_waits", {"predicted", "measured", "zero"});
    }
  }
  const json& events = j.at("traceEvents");
  // (rank, task) -> its event: a trace holds one step, so one event per task.
  std::map<std::pair<std::int64_t, std::int64_t>, std::size_t> seen;
  for (std::size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    const std::string where = fmt::format("traceEvents[{}]", i);
    if (!e.is_object()) {
      throw InputError(fmt::format("{}: {}: expected an object (a trace event), got {}", path,
                                   where, describe_json_value(e)));
    }
    if (!e.contains("ph") || !e.at("ph").is_string()) {
      throw InputError(fmt::format("{}: {}.ph: expected a string", path, where));
    }
    const std::string ph = e.at("ph").get<std::string>();
    if (ph == "B" || ph == "E") {
      // A task as a begin/end pair would be dropped, and counted as only predicted.
      throw InputError(fmt::format(
          "{}: {}.ph: \"{}\": begin and end events are not read; expected complete events (ph "
          "\"X\" with dur), as dtsim simulate --trace and dtexec run --trace write",
          path, where, ph));
    }
    if (ph == "M") {
      const JsonReader r(e, path, where);
      const std::string name = r.string_or("name", "");
      if (name == "thread_name" && e.contains("tid") && e.contains("args")) {
        if (!e.at("tid").is_number_integer() || e.at("tid").get<std::int64_t>() < 0 ||
            e.at("tid").get<std::int64_t>() > std::numeric_limits<int>::max()) {
          r.fail("tid", "expected a thread id from 0 to 2^31 - 1");
        }
        trace.stream_names[e.at("tid").get<int>()] = r.object("args").string_or("name", "");
      }
      if (name == "process_name" && e.contains("pid") && e.contains("args") &&
          r.object("args").has("represents")) {
        const json& ranks = e.at("args").at("represents");
        if (!e.at("pid").is_number_integer() || e.at("pid").get<std::int64_t>() < 0) {
          r.fail("pid", fmt::format("expected a process id (a rank: a whole number >= 0), got {}",
                                    describe_json_value(e.at("pid"))));
        }
        if (!ranks.is_array()) {
          throw InputError(
              fmt::format("{}: {}.args.represents: expected an array of ranks", path, where));
        }
        for (const json& rank : ranks) {
          if (!rank.is_number_integer() || rank.get<std::int64_t>() < 0 ||
              rank.get<std::int64_t>() >= cluster::kMaxDevices) {
            throw InputError(
                fmt::format("{}: {}.args.represents: expected ranks from 0 to {}, got {}", path,
                            where, cluster::kMaxDevices - 1, describe_json_value(rank)));
          }
          // A rank stands for one process: a second claim would drop the first in silence.
          const auto [it, fresh] = trace.representative.try_emplace(
              rank.get<std::int64_t>(), e.at("pid").get<std::int64_t>());
          if (!fresh) {
            throw InputError(fmt::format(
                "{}: {}.args.represents: rank {} is given twice (also by pid {}); expected each "
                "rank once",
                path, where, it->first, it->second));
          }
        }
      }
      continue;
    }
    if (ph != "X") continue;
    const JsonReader r(e, path, where);
    auto number = [&](const char* key) {
      if (!r.has(key) || !e.at(key).is_number() || !std::isfinite(e.at(key).get<double>())) {
        r.fail(key, "expected a number");
      }
      return e.at(key).get<double>();
    };
    auto id = [&](const char* key) {
      if (!r.has(key) || !e.at(key).is_number_integer()) r.fail(key, "expected an integer id");
      return e.at(key).get<std::int64_t>();
    };
    TraceTask t;
    t.rank = id("pid");
    if (t.rank < 0) r.fail("pid", fmt::format("expected a rank (>= 0), got {}", t.rank));
    if (id("tid") < 0 || id("tid") > std::numeric_limits<int>::max()) {
      r.fail("tid", "expected a thread id from 0 to 2^31 - 1");
    }
    t.stream = static_cast<int>(id("tid"));
    // Times in microseconds, as Chrome's trace format has them. A trace spans one step: past
    // 1e15 us (31 years) a double no longer resolves a tenth of a microsecond, and sums of such
    // times would print as silent nonsense.
    constexpr double kMaxMicroseconds = 1e15;
    const double ts = number("ts"), dur = number("dur");
    if (std::abs(ts) > kMaxMicroseconds) {
      r.fail("ts", "expected a time in microseconds within +-1e15 (31 years)");
    }
    if (dur < 0 || dur > kMaxMicroseconds) {
      r.fail("dur", "expected a duration in microseconds from 0 to 1e15 (31 years)");
    }
    t.start_s = ts * 1e-6;
    t.duration_s = dur * 1e-6;
    const JsonReader args = r.object("args");
    if (!args.has("task") || !e.at("args").at("task").is_number_integer()) {
      args.fail("task", "expected the task id (an integer)");
    }
    t.task = e.at("args").at("task").get<std::int64_t>();
    if (t.task < 0) args.fail("task", fmt::format("expected a task id (>= 0), got {}", t.task));
    if (const auto [it, fresh] = seen.emplace(std::make_pair(t.rank, t.task), i); !fresh) {
      throw InputError(fmt::format(
          "{}: {}: task {} of rank {} again (first at traceEvents[{}]); expected one event per "
          "task (a trace of one step)",
          path, where, t.task, t.rank, it->second));
    }
    t.name = r.string_or("name", "");
    t.communication = !args.has("phase");
    t.kind =
        t.communication ? args.string_or("kind", r.string_or("cat", "?")) : args.string("phase");
    // A collective's own kind (traces since 2026-12-06): its rows apart, all-reduces from
    // all-gathers.
    if (t.communication && args.has("collective")) t.collective = args.string("collective");
    // The straggler model's wait, [from, from + wait): the part inside the span (a collective's
    // or a receive's; a blocking transfer's is before it).
    if (args.has("straggler_wait_us")) {
      auto time_at = [&](const char* key, double least, const char* expected) {
        const json& v = e.at("args").contains(key) ? e.at("args").at(key) : json();
        if (!v.is_number() || !(v.get<double>() >= least && v.get<double>() <= kMaxMicroseconds)) {
          args.fail(key, expected);
        }
        return v.get<double>();
      };
      const double wait = time_at("straggler_wait_us", 0,
                                  "expected a wait in microseconds from 0 to 1e15 (31 years)");
      const double from =
          time_at("straggler_wait_from_us", -kMaxMicroseconds,
                  "expected the wait's start in microseconds, within +-1e15 (31 years), as "
                  "straggler_wait_us has");
      const double begin = std::max(from, ts);
      const double end = std::min(from + wait, ts + dur);
      // (At most the span: a span all wait leaves exactly 0, not a rounding's -1e-18.)
      t.wait_s = std::clamp(end - begin, 0.0, dur) * 1e-6;
    }
    trace.tasks.push_back(std::move(t));
  }
  if (trace.tasks.empty()) {
    throw InputError(fmt::format("{}: traceEvents: no complete (\"X\") task events", path));
  }
  // A rank the trace's own plan does not have (an edited trace, another plan's): its rows would
  // join nothing, or the note would name a rank no run had.
  if (const auto ranks = plan_ranks(trace.plan)) {
    const auto past = [&](std::int64_t rank) { return rank >= *ranks; };
    const std::string of =
        fmt::format("the trace's plan (otherData.plan) has ranks 0 to {}", *ranks - 1);
    if (trace.only_rank && past(*trace.only_rank)) {
      throw InputError(
          fmt::format("{}: otherData.only_rank: rank {}, but {}", path, *trace.only_rank, of));
    }
    for (const auto& [rank, pid] : trace.representative) {
      if (past(rank)) {
        throw InputError(
            fmt::format("{}: the process_name event of pid {}: args.represents: rank {}, but {}",
                        path, pid, rank, of));
      }
    }
    for (const TraceTask& t : trace.tasks) {
      if (past(t.rank)) {
        throw InputError(
            fmt::format("{}: a task event of pid (rank) {}, but {}", path, t.rank, of));
      }
    }
  }
  return trace;
}

std::string without_micro_batch(const std::string& name) {
  std::istringstream words(name);
  std::string word, out;
  while (words >> word) {
    const bool micro_batch = word.size() > 2 && word.compare(0, 2, "mb") == 0 &&
                             std::all_of(word.begin() + 2, word.end(),
                                         [](unsigned char c) { return std::isdigit(c) != 0; });
    if (micro_batch) continue;
    if (!out.empty()) out += ' ';
    out += word;
  }
  return out;
}

std::optional<std::string> run_difference(const Trace& a, const Trace& b) {
  if (!a.model.empty() && !b.model.empty() && a.model != b.model) {
    return fmt::format("model {} against {}", a.model, b.model);
  }
  if (a.plan.is_null() || b.plan.is_null()) return std::nullopt;
  // A plan's JSON leaves out some fields at their defaults (plan::to_json): where one trace has
  // such a field and the other not, the other's is the Plan's default. Fields whose absence means
  // "derived" (layers_per_stage: the even split; grad_precision, comm_precision: from precision)
  // are compared only where both have them: either way the other trace's run is the same one.
  // (plan::Plan's defaults, written as to_json would write them.)
  static const json kDefaults = {{"clip_grad", 0}, {"grad_compression", 1}};
  std::set<std::string> keys;
  for (const json* plan : {&a.plan, &b.plan}) {
    for (const auto& item : plan->items()) keys.insert(item.key());
  }
  std::vector<std::string> fields;
  for (const auto& key : keys) {
    // The simulator's assumption of how unevenly tokens route (dtexec routes them for real, and
    // a prediction at the load a run measured is the same run's).
    if (key == "expert_load") continue;
    const json& fallback = kDefaults.contains(key) ? kDefaults.at(key) : json();
    const json& x = a.plan.contains(key) ? a.plan.at(key) : fallback;
    const json& y = b.plan.contains(key) ? b.plan.at(key) : fallback;
    // (JSON values compare numbers by value: 1 and 1.0 are one number.)
    if (!x.is_null() && !y.is_null() && x != y) {
      fields.push_back(fmt::format("{} {} against {}", key, brief_json(x), brief_json(y)));
    }
  }
  if (fields.empty()) return std::nullopt;
  return fmt::format("plan: {}", fmt::join(fields, ", "));
}

Validation validate(const Trace& predicted, const Trace& measured) {
  std::map<std::pair<std::int64_t, std::int64_t>, const TraceTask*> by_id;
  for (const auto& t : predicted.tasks) by_id[{t.rank, t.task}] = &t;
  struct Acc {
    std::int64_t n = 0;
    double p = 0, m = 0, abs_err = 0;
    std::int64_t with_time = 0;
  };
  std::map<std::string, Acc> groups;
  // Per program task: (predicted rank, name without micro-batch) -> its sums, first task id.
  std::map<std::pair<std::int64_t, std::string>, std::pair<Acc, std::int64_t>> per_task;
  auto add = [](Acc& a, double p, double m) {
    ++a.n;
    a.p += p;
    a.m += m;
    if (m >= kShortestMeasured_s) {
      a.abs_err += std::abs(p / m - 1);
      ++a.with_time;
    }
  };
  auto row = [](std::string group, const Acc& a) {
    return ErrorRow{
        std::move(group),
        a.n,
        a.p,
        a.m,
        a.m >= kShortestMeasured_s ? std::optional<double>(a.p / a.m - 1) : std::nullopt,
        a.with_time > 0 ? std::optional<double>(a.abs_err / static_cast<double>(a.with_time))
                        : std::nullopt};
  };
  Validation v;
  std::map<std::pair<std::int64_t, std::int64_t>, bool> seen;
  double first_measured = 0;
  if (!measured.tasks.empty()) {
    first_measured = measured.tasks.front().start_s;
    for (const auto& m : measured.tasks) first_measured = std::min(first_measured, m.start_s);
  }
  for (const auto& m : measured.tasks) {
    auto it = by_id.find({m.rank, m.task});
    if (it == by_id.end()) {
      const auto rep = predicted.representative.find(m.rank);
      if (rep != predicted.representative.end()) it = by_id.find({rep->second, m.task});
    }
    if (it == by_id.end()) continue;
    const TraceTask& p = *it->second;
    seen[{p.rank, p.task}] = true;
    ++v.matched;
    if (!p.name.empty() && !m.name.empty() && p.name != m.name && v.renamed++ == 0) {
      v.first_renamed = fmt::format("rank {} task {}: name \"{}\" predicted, \"{}\" measured",
                                    m.rank, m.task, p.name, m.name);
    }
    const auto stream = predicted.stream_names.count(p.stream) ? predicted.stream_names.at(p.stream)
                                                               : fmt::format("{}", p.stream);
    const bool both_named =
        predicted.stream_names.count(p.stream) != 0 && measured.stream_names.count(m.stream) != 0;
    const std::string measured_stream =
        both_named ? measured.stream_names.at(m.stream) : fmt::format("{}", m.stream);
    // (Unnamed, a stream's lanes are its tid plus multiples of lower::kStreamCount.)
    const bool moved = both_named
                           ? measured_stream != stream
                           : m.stream % lower::kStreamCount != p.stream % lower::kStreamCount;
    if (moved && v.restreamed++ == 0) {
      v.first_restreamed = fmt::format(
          "rank {} task {} \"{}\": stream \"{}\" predicted, \"{}\" measured", m.rank, m.task,
          p.name, both_named ? stream : fmt::format("{}", p.stream), measured_stream);
    }
    // (A simulated "measurement" holds its own straggler waits, and leaves them out alike.)
    const double predicted_s = p.duration_s - p.wait_s;
    const double measured_s = m.duration_s - m.wait_s;
    if (p.communication) ++v.communication_tasks;
    if (p.wait_s > 0) {
      v.straggler_wait_s += p.wait_s;
      ++v.waiting_tasks;
    }
    TaskError te{m.rank,      p.rank,      m.task,   p.name,     p.kind,
                 stream,      predicted_s, p.wait_s, measured_s, m.start_s - first_measured,
                 std::nullopt};
    if (measured_s >= kShortestMeasured_s) te.error = predicted_s / measured_s - 1;
    v.tasks.push_back(std::move(te));
    for (const std::string& g : {"kind " + p.kind, "stream " + stream}) {
      add(groups[g], predicted_s, measured_s);
    }
    // And each kind of collective apart (all-reduces, all-gathers, ...), where the trace says.
    if (!p.collective.empty()) add(groups["collective " + p.collective], predicted_s, measured_s);
    const std::string task_name =
        p.name.empty() ? fmt::format("({} task, unnamed)", p.kind) : without_micro_batch(p.name);
    auto [at, added] = per_task.try_emplace({p.rank, task_name}, Acc{}, p.task);
    if (!added) at->second.second = std::min(at->second.second, p.task);
    add(at->second.first, predicted_s, measured_s);
  }
  v.only_predicted =
      static_cast<std::int64_t>(predicted.tasks.size()) - static_cast<std::int64_t>(seen.size());
  v.only_measured = static_cast<std::int64_t>(measured.tasks.size()) - v.matched;
  std::set<std::int64_t> joined_ranks;
  for (const auto& [key, _] : seen) joined_ranks.insert(key.first);
  for (const auto& p : predicted.tasks) {
    if (joined_ranks.count(p.rank) != 0 && seen.count({p.rank, p.task}) == 0) {
      ++v.only_predicted_on_joined_ranks;
    }
  }
  for (const auto& [name, a] : groups) v.rows.push_back(row(name, a));
  std::vector<std::tuple<std::int64_t, std::int64_t, ErrorRow>> by_task;
  for (const auto& [key, sums] : per_task) {
    by_task.emplace_back(key.first, sums.second,
                         row(fmt::format("rank {}: {}", key.first, key.second), sums.first));
  }
  std::stable_sort(by_task.begin(), by_task.end(), [](const auto& a, const auto& b) {
    return std::tie(std::get<0>(a), std::get<1>(a)) < std::tie(std::get<0>(b), std::get<1>(b));
  });
  for (auto& t : by_task) v.by_task.push_back(std::move(std::get<2>(t)));
  std::stable_sort(v.tasks.begin(), v.tasks.end(), [](const TaskError& a, const TaskError& b) {
    return std::tie(a.rank, a.measured_start_s, a.task) <
           std::tie(b.rank, b.measured_start_s, b.task);
  });
  // The step over the ranks both traces hold: a measured trace of some ranks (--only-rank, one
  // cut down) against the whole pipeline's span compared different work (+192% for a lone
  // rank of pp 2).
  std::set<std::int64_t> measured_ranks, predicted_ranks;
  for (const TaskError& t : v.tasks) measured_ranks.insert(t.rank);
  for (const auto& p : predicted.tasks) predicted_ranks.insert(p.rank);
  Trace predicted_joined, measured_joined;
  for (const auto& p : predicted.tasks) {
    if (joined_ranks.count(p.rank) != 0) predicted_joined.tasks.push_back(p);
  }
  for (const auto& m : measured.tasks) {
    if (measured_ranks.count(m.rank) != 0) measured_joined.tasks.push_back(m);
  }
  if (!joined_ranks.empty() && joined_ranks.size() < predicted_ranks.size()) {
    v.step_programs = static_cast<std::int64_t>(joined_ranks.size());
    v.predicted_programs = static_cast<std::int64_t>(predicted_ranks.size());
  }
  const double ps = predicted_joined.span_s(), ms = measured_joined.span_s();
  v.rows.push_back({"step", v.matched, ps, ms,
                    ms >= kShortestMeasured_s ? std::optional<double>(ps / ms - 1) : std::nullopt,
                    std::nullopt});
  return v;
}

}  // namespace dtsim::report
