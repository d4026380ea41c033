// Chrome trace event format (DESIGN.md "Traces"): one process per rank, one thread per stream,
// one complete event per task with args.task = the task id. Opens in Perfetto
// (ui.perfetto.dev) and chrome://tracing. The simulator and dtexec write the same schema.
// "otherData" (the format's free-form object) says what ran: {"model": name, "plan": the plan's
// JSON}, so that dtsim validate and dtexec run --predicted refuse traces of different plans; and
// who wrote it for which device ({"producer": "dtsim simulate" or "dtexec run", "device": the
// catalog device's name}), so that dtsim validate can say when a prediction for one device
// meets a measurement on another, or the two traces are given the wrong way round; and a
// dtexec run --only-rank's rank ({"only_rank": R}), whose communication was replayed waits.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

#include "sim/engine/engine.hpp"
#include "sim/lower/program.hpp"

namespace dtsim::report {

// What a trace says about its run besides the plan (otherData); empty fields are left out.
struct TraceInfo {
  std::string model;     // the model's name
  std::string producer;  // kProducedBySimulate or kProducedByRun
  std::string device;    // the device catalog's name (h200, cpu-host), else what the run knew
  // dtexec run --only-rank R: R, the one rank that ran, its communication replaced by waits of
  // the predicted lengths (only_rank_waits "predicted", with --predicted), of another run's
  // measured ones ("measured", a --predicted trace that dtexec run wrote) or of none ("zero").
  std::optional<std::int64_t> only_rank;
  std::string only_rank_waits;
};
inline constexpr const char* kProducedBySimulate = "dtsim simulate";
inline constexpr const char* kProducedByRun = "dtexec run";

nlohmann::json chrome_trace(const lower::Program& program, const engine::Timeline& timeline,
                            const TraceInfo& info);
// A note for stderr before a trace of a million tasks or more is built and written (it takes
// tens of seconds and gigabytes): so that a long wait is not taken for a hang. None below.
std::optional<std::string> large_trace_note(std::size_t tasks, const std::string& path);

// Writes chrome_trace() to `path` (large_trace_note first, on stderr); throws InputError if
// the file cannot be written.
void write_chrome_trace(const std::string& path, const lower::Program& program,
                        const engine::Timeline& timeline, const TraceInfo& info);

}  // namespace dtsim::report
