#include "sim/report/trace.hpp"

#include <fmt/format.h>

#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "sim/common/error.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::report {

using nlohmann::json;

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
    for (int s = 0; s < lower::kStreamCount; ++s) {
      events.push_back({{"ph", "M"},
                        {"name", "thread_name"},
                        {"pid", rp.rank},
                        {"tid", s},
                        {"args", {{"name", to_string(static_cast<lower::Stream>(s))}}}});
    }
    for (std::size_t t = 0; t < rp.tasks.size(); ++t) {
      const lower::Task& task = rp.tasks[t];
      const engine::TaskTime& tt = timeline.tasks[p][t];
      json args = {{"task", t}, {"kind", to_string(task.kind)}};
      if (task.micro_batch >= 0) args["micro_batch"] = task.micro_batch;
      if (task.kind == lower::TaskKind::Compute) args["phase"] = to_string(task.phase);
      if (task.bytes > 0) args["bytes"] = task.bytes;
      // The straggler model's wait for a late rank: from when, how long (inside the span, or
      // before a blocking transfer's).
      if (tt.wait_s > 0) {
        args["straggler_wait_from_us"] = tt.wait_from_s * 1e6;
        args["straggler_wait_us"] = tt.wait_s * 1e6;
      }
      events.push_back({{"ph", "X"},
                        {"name", task.label},
                        {"cat", to_string(task.kind)},
                        {"pid", rp.rank},
                        {"tid", static_cast<int>(task.stream)},
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
