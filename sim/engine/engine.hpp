// The discrete-event engine: runs a Program's tasks in time. Each rank has streams that run
// their tasks one at a time in issue order; a task starts when its stream is free and its
// dependencies are done. Collectives start when every simulated member of their group has
// reached them; a receive completes when the matching send's data has arrived (sends are
// eager: they do not wait for the receiver, as Megatron-LM posts both sides together).
// Deterministic: ties in time are broken by the order events were created.
#pragma once

#include <cstdint>
#include <vector>

#include "sim/lower/program.hpp"

namespace dtsim::engine {

struct TaskTime {
  double start_s = 0;
  double end_s = 0;
};

struct Timeline {
  std::vector<std::vector<TaskTime>> tasks;  // [rank program][task]
  double makespan_s = 0;
  std::uint64_t events = 0;
};

// What the engine asks about durations (compute cost model + network model).
class Durations {
 public:
  virtual ~Durations() = default;
  virtual double compute_s(const lower::Task& task) = 0;
  virtual double collective_s(const lower::Group& group, const lower::Task& task) = 0;
  virtual double p2p_s(std::int64_t src_rank, std::int64_t dst_rank, std::uint64_t bytes) = 0;
};

// Throws InternalError naming a stuck task if the program cannot finish (a lowering bug).
Timeline run(const lower::Program& program, Durations& durations);

}  // namespace dtsim::engine
