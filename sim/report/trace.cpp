#include "sim/report/trace.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <tuple>
#include <vector>

#include "sim/common/error.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::report {

using nlohmann::json;

namespace {

// Each task's lane on its stream: the first whose tasks so far end, to the nanosecond, by its
// start (tasks taken by start, the longer first at one start).
std::vector<int> stream_lanes(const lower::RankProgram& rp,
                              const std::vector<engine::TaskTime>& times) {
  auto ns = [](double seconds) { return std::llround(seconds * 1e9); };
  // (stream, start, -end, task), each time rounded once: the sort's keys.
  std::vector<std::tuple<lower::Stream, long long, long long, std::size_t>> order;
  order.reserve(rp.tasks.size());
  for (std::size_t t = 0; t < rp.tasks.size(); ++t) {
    const long long start = ns(times[t].start_s);
    order.emplace_back(rp.tasks[t].stream, start, -std::max(start, ns(times[t].end_s)), t);
  }
  std::sort(order.begin(), order.end());
  std::vector<int> lane(rp.tasks.size(), 0);
  std::vector<std::vector<long long>> ends(lower::kStreamCount);  // per stream, per lane
  for (const auto& [stream, start, minus_end, t] : order) {
    auto& free_at = ends[static_cast<std::size_t>(stream)];
    const long long end = -minus_end;
    std::size_t l = 0;
    while (l < free_at.size() && free_at[l] > start) ++l;
    if (l == free_at.size()) free_at.push_back(end);
    free_at[l] = end;
    lane[t] = static_cast<int>(l);
  }
  return lane;
}

}  // namespace

json chrome_trace(const lower::Program& program, const engine::Timeline& timeline,
                  const TraceInfo& info) {
  json events = json::array();
  for (std::size_t p = 0; p < program.ranks.size(); ++p) {
    const lower::RankProgram& rp = program.ranks[p];
    const std::string name = rp.represents.size() > 1
                                 ? fmt::format("rank {} (stage {}, stands for {} ranks)", rp.rank,
                                               rp.stage, rp.represents.size())
                                 : fmt::format("rank {} (stage {})", rp.rank, rp.stage);
    json process_args = {{"name", name}};
    // The ranks this program stands for, so that a measurement of any of them joins it.
    if (rp.represents.size() > 1) process_args["represents"] = rp.represents;
    events.push_back({{"ph", "M"},
                      {"name", "process_name"},
                      {"pid", rp.rank},
                      {"args", std::move(process_args)}});
    events.push_back({{"ph", "M"},
                      {"name", "process_sort_index"},
                      {"pid", rp.rank},
                      {"args", {{"sort_index", rp.rank}}}});
    // A stream's tasks may overlap (a send beside a receive, a reduce-scatter beside a gather),
    // which a viewer's thread cannot show (Perfetto: complete events on a thread nest or are
    // disjoint): those that overlap the ones before them go to further lanes of the stream,
    // threads of the same name (tid stream + lane x kStreamCount), at the first lane free by
    // then, to the nanosecond.
    const std::vector<int> lane = stream_lanes(rp, timeline.tasks[p]);
    std::vector<int> lanes(lower::kStreamCount, 1);
    for (std::size_t t = 0; t < lane.size(); ++t) {
      int& n = lanes[static_cast<std::size_t>(rp.tasks[t].stream)];
      n = std::max(n, lane[t] + 1);
    }
    const int most_lanes = *std::max_element(lanes.begin(), lanes.end());
    for (int s = 0; s < lower::kStreamCount; ++s) {
      for (int l = 0; l < lanes[static_cast<std::size_t>(s)]; ++l) {
        const int tid = s + l * lower::kStreamCount;
        events.push_back({{"ph", "M"},
                          {"name", "thread_name"},
                          {"pid", rp.rank},
                          {"tid", tid},
                          {"args", {{"name", to_string(static_cast<lower::Stream>(s))}}}});
        // (A stream's lanes side by side, the streams in their order.)
        events.push_back({{"ph", "M"},
                          {"name", "thread_sort_index"},
                          {"pid", rp.rank},
                          {"tid", tid},
                          {"args", {{"sort_index", s * most_lanes + l}}}});
      }
    }
    for (std::size_t t = 0; t < rp.tasks.size(); ++t) {
      const lower::Task& task = rp.tasks[t];
      const engine::TaskTime& tt = timeline.tasks[p][t];
      json args = {{"task", t}, {"kind", to_string(task.kind)}};
      if (task.micro_batch >= 0) args["micro_batch"] = task.micro_batch;
      if (task.kind == lower::TaskKind::Compute) args["phase"] = to_string(task.phase);
      if (task.kind == lower::TaskKind::Collective) args["collective"] = to_string(task.collective);
      if (task.bytes > 0) args["bytes"] = task.bytes;
      // The straggler model's wait for a late rank: from when, how long (inside the span, or
      // before a blocking transfer's). Under a picosecond it is the rounding of the engine's
      // sums, not a wait (traces held 1.8e-50 us), and no clock could show it: left out.
      if (tt.wait_s >= 1e-12) {
        args["straggler_wait_from_us"] = tt.wait_from_s * 1e6;
        args["straggler_wait_us"] = tt.wait_s * 1e6;
      }
      events.push_back({{"ph", "X"},
                        {"name", task.label},
                        {"cat", to_string(task.kind)},
                        {"pid", rp.rank},
                        {"tid", static_cast<int>(task.stream) + lane[t] * lower::kStreamCount},
                        {"ts", tt.start_s * 1e6},
                        {"dur", (tt.end_s - tt.start_s) * 1e6},
                        {"args", std::move(args)}});
    }
  }
  nlohmann::json other = {{"model", info.model}, {"plan", plan::to_json(program.plan)}};
  if (!info.producer.empty()) other["producer"] = info.producer;
  if (!info.device.empty()) other["device"] = info.device;
  if (info.only_rank) other["only_rank"] = *info.only_rank;
  if (!info.only_rank_waits.empty()) other["only_rank_waits"] = info.only_rank_waits;
  return {{"traceEvents", std::move(events)},
          {"displayTimeUnit", "ms"},
          {"otherData", std::move(other)}};
}

std::optional<std::string> large_trace_note(std::size_t tasks, const std::string& path) {
  // Llama-3 70B, tp 8, pp 4, global batch 2,048 on the default cluster: 2.0 million tasks,
  // 426 MB, 23 s and 4.0 GB of memory on this project's host (2026-12-05).
  if (tasks < 1'000'000) return std::nullopt;
  return fmt::format(
      "note: writing a trace of {:.1f} million tasks to {}: expect tens of seconds or more and "
      "gigabytes of memory here, and a viewer that struggles to open it (a smaller "
      "--global-batch-size shows the same per-step pattern)",
      static_cast<double>(tasks) / 1e6, path);
}

void write_chrome_trace(const std::string& path, const lower::Program& program,
                        const engine::Timeline& timeline, const TraceInfo& info) {
  std::ofstream out(path);
  if (!out) throw InputError(fmt::format("--trace {}: cannot write the file", path));
  std::size_t tasks = 0;
  for (const auto& rank : timeline.tasks) tasks += rank.size();
  if (const auto note = large_trace_note(tasks, path)) std::cerr << *note << "\n";
  out << json_text(chrome_trace(program, timeline, info)) << "\n" << std::flush;
  if (!out) throw InputError(fmt::format("--trace {}: write failed", path));
}

}  // namespace dtsim::report
