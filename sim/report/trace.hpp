// Chrome trace event format (DESIGN.md "Traces"): one process per rank, one thread per stream,
// one complete event per task with args.task = the task id. Opens in Perfetto
// (ui.perfetto.dev) and chrome://tracing. The simulator and dtexec write the same schema.
// "otherData" (the format's free-form object) says what ran: {"model": name, "plan": the plan's
// JSON}, so that dtsim validate and dtexec run --predicted refuse traces of different plans.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "sim/engine/engine.hpp"
#include "sim/lower/program.hpp"

namespace dtsim::report {

nlohmann::json chrome_trace(const lower::Program& program, const engine::Timeline& timeline,
                            const std::string& model);
// Writes chrome_trace() to `path`; throws InputError if the file cannot be written.
void write_chrome_trace(const std::string& path, const lower::Program& program,
                        const engine::Timeline& timeline, const std::string& model);

}  // namespace dtsim::report
