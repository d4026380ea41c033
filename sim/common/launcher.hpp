// What an MPI launcher (mpirun, srun) tells a process through its environment, readable before
// MPI starts: whether there is one, and this process's rank. Errors that every rank meets alike
// (a bad option, before MPI_Init) are then printed once, by rank 0, not once per rank.
#pragma once

#include <string>

namespace dtsim {

// True when an MPI launcher started this process (OpenMPI's OMPI_COMM_WORLD_SIZE, MPICH's and
// Slurm's PMI_SIZE, PMIx's PMIX_RANK).
bool under_mpirun();

// This process's rank as the launcher numbered it (OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK,
// the first one set); 0 outside a launcher, or where the value is not a rank.
int launcher_rank();

// How many ranks the launcher started (OMPI_COMM_WORLD_SIZE, PMI_SIZE); 0 where it does not say
// (PMIx's environment gives a rank only), 1 outside a launcher.
int launcher_size();

// Prints an error that every rank is expected to meet alike (bad input) to stderr as
// "WHO: WHAT: MESSAGE", once per job: at once on rank 0 (and outside a launcher); on another
// rank only after waiting 2 s for the launcher to end this process, as mpirun does once rank 0
// has printed the error and exited non-zero, and then as "WHO (rank R): ...". A rank that
// exited first could have the job killed before rank 0 had said why (4 of 30 runs of three
// ranks printed nothing); a rank still running after the wait belongs to a job whose rank 0
// did not meet this error. `rank`: this process's (the launcher's, until MPI has started).
void say_once_per_job(const std::string& who, const char* what, const char* message,
                      int rank = launcher_rank());

}  // namespace dtsim
