// What dtexec's commands share: their options, rank 0 speaking for the job, ending every rank
// on an error, and the host memory a run may take; and the commands themselves.
#pragma once

#include <boost/program_options.hpp>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "exec/core/comm.hpp"
#include "exec/cpu/host_memory.hpp"
#include "exec/cpu/mpi_comm.hpp"

namespace dtsim::exec::cli {

namespace po = boost::program_options;

// dtexec run: train a model following the Program dtsim lowers a plan to.
int run(const std::vector<std::string>& args);
// dtexec compare A B: two checkpoints, losses and weights within tolerances.
int compare(const std::vector<std::string>& args);
// dtexec calibrate: a profile for dtsim --profile (CPU or CUDA).
int calibrate(const std::vector<std::string>& args);
// dtexec devices: the GPUs the CUDA backend sees; a check kernel on each with `selftest`.
int devices(bool selftest);

// Parses a sub-command's options; on --help prints the usage and returns false. Malformed
// options are bad input (exit code 2).
bool parse(const std::vector<std::string>& args, const po::options_description& desc,
           const char* usage, po::variables_map& vm);

// This process's rank under mpirun (set by run and calibrate): errors every rank meets alike
// (bad options, a plan that does not fit the ranks) are printed by rank 0 only.
extern int g_rank;

// FNV-1a, 64 bits (Fowler, Noll and Vo): a hash of `text` that every process computes alike.
std::uint64_t fnv1a(std::string_view text);

// Under mpirun, every rank must have been started with the same options (`vm`, parsed: in any
// order or spelling): an mpirun of several programs (`mpirun -np 1 dtexec run ... : -np 1
// dtexec run --seed 7 ...`) trained replicas of different initial weights in silence, and
// other plans or models hung or failed in MPI. Throws InputError, on every rank alike, naming
// the first rank that differs.
void check_same_arguments(const cpu::MpiSession& mpi, const po::variables_map& vm,
                          const char* command);

// What a rank says when the host's memory ran out (std::bad_alloc): input too large for the
// host, not a fault of dtexec's (exit code 2).
inline constexpr const char* kOutOfHostMemory =
    "out of host memory (std::bad_alloc): the model, micro-batch or sequence is too large for "
    "this host's memory; `dtsim memory` estimates what a plan needs, and --only-rank runs one "
    "rank's share";

// Under mpirun, peers may be waiting for this rank (a collective, a barrier, NCCL's set-up):
// on an error, say which rank failed and end them all (exit 2 for bad input or a host out of
// memory, else 1), after aborting `comm`'s own communicators where one is given (NCCL's: their
// kernels return). Alone, it returns and the caller rethrows.
void end_all_ranks(const std::exception& e, const cpu::MpiSession* mpi, const char* command,
                   Comm* comm = nullptr);

// Runs `step` on this rank, then agrees with the others (a collective) whether it failed. Where
// it failed on every rank (bad input, alike everywhere), its error is thrown on each (rank 0
// says it once, with the other ranks' reasons where they differ from its own); where on some ranks
// only (their host's fault: no GPU there, a file their node does not see), those ranks end the job
// (end_all_ranks: rank, host, message) and the others wait for that end, where they would have
// waited in their next collective for ever. Alone, it runs `step`. Every rank must call it at the
// same point.
void alike_on_every_rank(const cpu::MpiSession* mpi, const char* command,
                         const std::function<void()>& step);

// Rank 0 speaks for the job; the other ranks stay quiet.
std::ostream& out(int rank);

// The memory this host can still give its processes (MemAvailable, or its memory cgroup's
// limit less its use where that is less: exec/cpu/host_memory.hpp), shared by `ranks_here`
// ranks; none where no file says.
std::optional<cpu::HostMemory> host_memory_per_rank(int ranks_here);

// Refuses a run on host memory whose tensors (`bytes` per rank: dtsim memory's figure, which
// dtexec's pool holds within a few percent, bench/memory_validation.sh) need more than this
// host's available memory gives each of its `ranks_here` ranks: refused now, where the kernel
// would kill a rank part-way with no word of why. Under mpirun every rank calls it: the least
// any rank was given decides, so that all refuse together. The rest of a rank (MPI, libraries)
// is not counted.
void require_host_memory(double bytes, int ranks_here, const cpu::MpiSession* mpi);

}  // namespace dtsim::exec::cli
