// The MPI backend of the runner's communication (exec/core/comm.hpp): one MPI process per
// rank, a communicator per Program group this rank belongs to (MPI_Comm_create_group, in group
// order on every rank), MPI collectives and point-to-point on MPI_COMM_WORLD.
//
// Every MPI call is checked; a failure prints the call, the rank and the host and aborts the
// whole job (MPI_Abort), so no rank is left waiting. A rank that dies is detected by mpirun,
// which ends the others.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "exec/core/comm.hpp"
#include "sim/common/launcher.hpp"
#include "sim/lower/program.hpp"

namespace dtsim::exec::cpu {

// True when this process was started by mpirun (OpenMPI, MPICH or PMIx environment).
using dtsim::under_mpirun;

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
  // This rank among the ranks of its host, and how many there are.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  // Ends every rank of the job with `code` (for a failure that may leave peers waiting).
  [[noreturn]] void abort(int code) const;
  void barrier() const;
  // The mean, and the largest, of `value` over all ranks (every rank gets it).
  double mean(double value) const;
  double max(double value) const;
  // Rank 0's `bytes` at `data` on every rank.
  void broadcast(void* data, std::size_t bytes) const;
  // Every rank's `mine` (the same length on every rank), rank by rank, on every rank.
  std::vector<double> all_gather(const std::vector<double>& mine) const;
  // Every rank's `mine`, rank by rank, on rank 0 (the others get none).
  std::vector<std::string> gather_to_root(const std::string& mine) const;

 private:
  int rank_ = 0, size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::string host_;
};

// nccl-tests-style measurements over the ranks of the session: all-reduce, all-gather,
// reduce-scatter and all-to-all by size (the size as nccl-tests counts it: the buffer reduced,
// the gathered output, the scattered input, what a rank sends) and group size (2, 4, ... that
// divide the job, in groups of consecutive ranks all at once, and the whole job), and a
// send/recv between ranks 0 and 1, each with its median time, algorithm bandwidth (size /
// time) and bus bandwidth (algbw x 2(n-1)/n for all-reduce, x (n-1)/n for the others, n the
// group's size). Every rank takes part; the table is the same on every rank. A
// measurement that takes longer than `timeout_s` (0: no limit) ends the process with a message
// (exit code 3): MPI's calls have no time limit of their own.
nlohmann::json measure_collectives(const MpiSession& session, bool quick, int repeats,
                                   double timeout_s);

// A Comm over `program`'s groups. The program must be lowered with Lowering::AllRanks and
// have as many ranks as the MPI world.
std::unique_ptr<Comm> make_mpi_comm(const MpiSession& session, const lower::Program& program);

}  // namespace dtsim::exec::cpu
