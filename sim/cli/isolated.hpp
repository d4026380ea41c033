// Work in a process of its own. SimGrid allows one platform per process (network/
// network_model.hpp: make_simgrid), so a command that simulates several plans or clusters on
// SimGrid (whatif's points) runs each in a fork of itself: the child returns a string (a result
// as JSON) or the error it threw, which the parent throws again as the same kind (exit code 2
// for bad input, 1 for a bug). Error kinds also carry a point's error between mpirun's ranks.
#pragma once

#include <exception>
#include <functional>
#include <string>

#include "sim/engine/simulator.hpp"

namespace dtsim::cli {

// What `work` returns, run in a child process; its error rethrown here. A child that dies (a
// signal, SimGrid's own abort) is an InternalError naming how it ended.
std::string run_isolated(const std::function<std::string()>& work);

// The plan simulated with its collectives and pipeline transfers on SimGrid, in a child process
// (run_isolated) that sends back all but the memory report, which is made here.
engine::Prediction simulate_on_simgrid(const model::ModelSpec& spec, const plan::Plan& plan,
                                       const cluster::Cluster& cluster,
                                       const engine::SimulateOptions& options);

// An error by name ("input", "unsupported", "internal"), and back.
std::string error_kind(const std::exception& e);
[[noreturn]] void rethrow_error(const std::string& kind, const std::string& what);

}  // namespace dtsim::cli
