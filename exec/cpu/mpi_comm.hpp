// The MPI backend of the runner's communication (exec/core/comm.hpp): one MPI process per
// rank, a communicator per Program group this rank belongs to (MPI_Comm_create_group, in group
// order on every rank), MPI collectives and point-to-point on MPI_COMM_WORLD.
//
// Every MPI call is checked; a failure prints the call, the rank and the host and aborts the
// whole job (MPI_Abort), so no rank is left waiting. A rank that dies is detected by mpirun,
// which ends the others.
#pragma once

#include <memory>

#include "exec/core/comm.hpp"
#include "sim/lower/program.hpp"

namespace dtsim::exec::cpu {

// True when this process was started by mpirun (OpenMPI, MPICH or PMIx environment).
bool under_mpirun();

// Initialises MPI (once per process) and finalises it when destroyed.
class MpiSession {
 public:
  MpiSession();
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& host() const { return host_; }
  // Ends every rank of the job with `code` (for a failure that may leave peers waiting).
  [[noreturn]] void abort(int code) const;

 private:
  int rank_ = 0, size_ = 1;
  std::string host_;
};

// A Comm over `program`'s groups. The program must be lowered with Lowering::AllRanks and
// have as many ranks as the MPI world.
std::unique_ptr<Comm> make_mpi_comm(const MpiSession& session, const lower::Program& program);

}  // namespace dtsim::exec::cpu
