// Sharing a sweep between processes started by mpirun: each rank takes every size-th point and
// rank 0 gathers the results, so that `mpirun -np N dtsim whatif ...` prints exactly what the
// single-process run prints. Outside mpirun nothing is initialised and there is one rank.
#pragma once

#include <string>
#include <vector>

namespace dtsim::cli {

class MpiSplit {
 public:
  MpiSplit();
  ~MpiSplit();
  MpiSplit(const MpiSplit&) = delete;
  MpiSplit& operator=(const MpiSplit&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // Every rank's strings, concatenated in rank order, on rank 0 (empty elsewhere).
  std::vector<std::string> gather(const std::vector<std::string>& mine) const;

 private:
  bool initialized_ = false;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace dtsim::cli
