#include "sim/cli/mpi_split.hpp"

#include <fmt/format.h>
#include <mpi.h>

#include "sim/common/error.hpp"
#include "sim/common/launcher.hpp"

namespace dtsim::cli {

namespace {
void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw InternalError(fmt::format("{} failed with MPI error {}", call, rc));
}
}  // namespace

MpiSplit::MpiSplit() {
  if (!under_mpirun()) return;
  check(MPI_Init(nullptr, nullptr), "MPI_Init");
  initialized_ = true;
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
}

MpiSplit::~MpiSplit() {
  if (initialized_) MPI_Finalize();
}

std::vector<std::string> MpiSplit::gather(const std::vector<std::string>& mine) const {
  if (size_ == 1) return mine;
  // Strings are sent as one buffer with '\0' separators.
  std::string buffer;
  for (const auto& s : mine) buffer += s + '\0';
  int length = static_cast<int>(buffer.size());
  std::vector<int> lengths(static_cast<std::size_t>(size_));
  check(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, MPI_COMM_WORLD),
        "MPI_Gather");
  std::vector<int> offsets(static_cast<std::size_t>(size_), 0);
  int total = 0;
  for (int r = 0; r < size_; ++r) {
    offsets[static_cast<std::size_t>(r)] = total;
    total += lengths[static_cast<std::size_t>(r)];
  }
  std::string all(static_cast<std::size_t>(rank_ == 0 ? total : 0), '\0');
  check(MPI_Gatherv(buffer.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(),
                    MPI_CHAR, 0, MPI_COMM_WORLD),
        "MPI_Gatherv");
  std::vector<std::string> out;
  if (rank_ != 0) return out;
  std::size_t start = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i] == '\0') {
      out.push_back(all.substr(start, i - start));
      start = i + 1;
    }
  }
  return out;
}

}  // namespace dtsim::cli
