// The NCCL backend of the runner's communication (exec/core/comm.hpp): one GPU per MPI rank
// (dtexec run --backend cuda under mpirun), device memory moved by NCCL, no host wait inside a
// step.
//
// Communicators: one over the job (ncclCommInitRank, its id broadcast over MPI), split
// (ncclCommSplit) into one per Program group, in group order on every rank, a member's NCCL rank
// its place in the group's ring order; and one of two ranks per direction of each pipeline pair
// that exchanges tensors (from sender to receiver). Setup is O(groups + pairs) splits of the
// job's communicator: meant for dtexec's scale (a few nodes), not for thousands of GPUs.
//
// Streams: each communicator is used from one stream only, ordered after the compute stream
// with CUDA events. A group's collectives run on the group's stream, and the compute stream waits
// for them (start_* defers that wait to finish()). A send copies the tensor into a staging
// buffer on the compute stream and leaves on the pair's stream, so the sender does not wait (as
// MPI_Isend of a copy); a receive runs on the compute stream and holds it until the data is there.
// A started collective and a send are timed with the device's marks on their own stream
// (Comm::take_transfer_marks), the others by the compute stream's around them.
// NCCL transfers carry no tag: a program whose transfers between two ranks are not received in
// the order they are sent is refused (exec/core/p2p_order.hpp).
//
// Unequal ZeRO shards: reduce-scatter and all-gather with unequal counts become grouped
// ncclReduce / ncclBroadcast calls, one per member.
//
// Failures: every CUDA and NCCL call is checked; a failure prints the call, the rank and the
// host, aborts every communicator (ncclCommAbort) and ends the job. A thread polls the
// communicators' asynchronous errors (ncclCommGetAsyncError), and the step's end (wait_sends)
// gives the queued work `timeout_s` to finish: past it the rank reports a hang, aborts its
// communicators and exits, and mpirun ends the others.
//
// Not run on several GPUs: the device machine of this project has one, and NCCL refuses two ranks
// of a communicator on one GPU but for ranks that are hosts of their own (dtexec run
// --share-gpus: data through sockets; scripts/gpu_check.sh section 6, exec/README.md). The logic
// shared with the MPI backend (the Program's groups, counts and transfer order) is tested on the
// CPU.
#pragma once

#include <memory>

#include "exec/core/comm.hpp"
#include "exec/cpu/mpi_comm.hpp"
#include "sim/lower/program.hpp"

namespace dtsim::exec::cuda {

// A Comm over `program`'s groups for `device` (made by make_device: its GPU and stream). Every
// rank of the MPI job must call it. The program must be lowered with Lowering::AllRanks and have
// as many ranks as the job; UnsupportedError when its transfers are not in order.
std::unique_ptr<Comm> make_nccl_comm(const cpu::MpiSession& session, const lower::Program& program,
                                     Device& device, double timeout_s);

}  // namespace dtsim::exec::cuda
