// The training steps behind `dtexec calibrate`'s in_run factors (sim/cost/profile.hpp): their
// plan, and on a device of bounded memory (a GPU), how much of the calibration model they train.
#pragma once

#include <cstdint>
#include <optional>

#include "sim/common/precision.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::exec {

// One rank, one micro-batch of `graph` per step, in `precision`.
plan::Plan in_run_plan(const model::ModelGraph& graph, Precision precision);

// `spec` at one micro-batch of `micro_batch` x `seq_len` tokens with as many of its blocks as
// dtsim's memory model says fit in `capacity_bytes` (no framework allowance: the caller leaves
// room for it), at most `max_blocks`; nothing when one block does not fit. Every block has the
// same shapes, so a few stand for the model in per-phase ratios (with the head weighing more).
std::optional<model::ModelGraph> in_run_graph(const model::ModelSpec& spec,
                                              std::int64_t micro_batch, std::int64_t seq_len,
                                              Precision precision, double capacity_bytes,
                                              std::int64_t max_blocks = 8);

}  // namespace dtsim::exec
