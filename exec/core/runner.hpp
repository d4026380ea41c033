// The Program runner: executes the tasks of a lowered Program on real tensors, in fp32 on the
// CPU, and times each task. It interprets the same Program the simulator predicts (compute
// tasks are ModelGraph op ranges in a phase), so a measurement joins the prediction task by
// task (dtsim validate).
//
// This version runs one rank (dp = tp = pp = cp = 1): plans that need communication between
// ranks wait for the MPI runner. Models: GELU or SwiGLU MLPs, LayerNorm or RMSNorm, learned
// positions, multi-head or grouped-query attention, tied or untied embeddings; no RoPE, no MoE,
// no dropout (each is refused with a message).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim/lower/program.hpp"
#include "sim/model/model_graph.hpp"

namespace dtsim::exec {

struct RunOptions {
  int steps = 10;
  int warmup_steps = 1;  // excluded from the median step time
  float learning_rate = 1e-3f;
  std::uint64_t seed = 1234;
};

struct TaskRecord {
  std::int64_t rank = 0;
  std::int32_t task = 0;
  double start_s = 0;  // from the start of the run
  double end_s = 0;
  int step = 0;
};

struct RunResult {
  std::vector<double> losses;        // mean loss of each step
  std::vector<double> step_times_s;  // wall time of each step
  double step_time_s = 0;            // median after warm-up
  std::vector<TaskRecord> tasks;     // every task of every step after warm-up
};

// Throws UnsupportedError for plans or models this runner does not execute yet.
RunResult run_program(const model::ModelGraph& graph, const lower::Program& program,
                      const RunOptions& options);

}  // namespace dtsim::exec
