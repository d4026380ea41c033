// Point-to-point transfers without tags. NCCL's send and receive carry no tag: the transfers
// from one rank to another are received in the order they were sent. The Program runner issues
// each rank's tasks in program order, so a backend without tags is correct only when, for every
// ordered pair of ranks, the sender's sends to the receiver come in the same order (by tag) as
// the receiver's receives from the sender. MPI matches by tag and needs no such check.
#pragma once

#include <optional>
#include <string>

#include "sim/lower/program.hpp"

namespace dtsim::exec {

// The first ordered pair (by sender, then receiver) whose sends and receives differ in order,
// number or size, described for an error message; nothing when every pair agrees.
std::optional<std::string> untagged_p2p_mismatch(const lower::Program& program);

}  // namespace dtsim::exec
