#include "sim/common/launcher.hpp"

#include <catch2/catch.hpp>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

namespace {

// Sets the launcher's variables for one test and puts back what was there.
class LauncherEnv {
 public:
  LauncherEnv() {
    for (const char* var : kVars) {
      const char* value = std::getenv(var);
      saved_.push_back(value ? std::optional<std::string>(value) : std::nullopt);
      unsetenv(var);
    }
  }
  ~LauncherEnv() {
    for (std::size_t i = 0; i < saved_.size(); ++i) {
      if (saved_[i]) {
        setenv(kVars[i], saved_[i]->c_str(), 1);
      } else {
        unsetenv(kVars[i]);
      }
    }
  }
  LauncherEnv(const LauncherEnv&) = delete;
  LauncherEnv& operator=(const LauncherEnv&) = delete;

  static constexpr const char* kVars[] = {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
                                          "PMIX_RANK", "PMI_SIZE", "PMI_RANK"};

 private:
  std::vector<std::optional<std::string>> saved_;
};

}  // namespace

TEST_CASE("the launcher's rank is read from its environment, 0 without one", "[common]") {
  const LauncherEnv env;
  CHECK_FALSE(dtsim::under_mpirun());
  CHECK(dtsim::launcher_rank() == 0);
  CHECK(dtsim::launcher_size() == 1);

  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  CHECK(dtsim::under_mpirun());
  CHECK(dtsim::launcher_rank() == 3);
  CHECK(dtsim::launcher_size() == 4);
  unsetenv("OMPI_COMM_WORLD_SIZE");
  unsetenv("OMPI_COMM_WORLD_RANK");

  setenv("PMIX_RANK", "2", 1);  // PMIx (Slurm, PRRTE): its rank says there is a launcher
  CHECK(dtsim::under_mpirun());
  CHECK(dtsim::launcher_rank() == 2);
  CHECK(dtsim::launcher_size() == 0);  // (no size in its environment: unknown)
  unsetenv("PMIX_RANK");

  setenv("PMI_SIZE", "8", 1);  // MPICH's Hydra
  setenv("PMI_RANK", "7", 1);
  CHECK(dtsim::under_mpirun());
  CHECK(dtsim::launcher_rank() == 7);
  CHECK(dtsim::launcher_size() == 8);

  // Not a rank: treated as rank 0, so that a message is printed rather than lost.
  for (const char* bad : {"", "x", "-1", "3x", "99999999999"}) {
    setenv("PMI_RANK", bad, 1);
    INFO("PMI_RANK=\"" << bad << "\"");
    CHECK(dtsim::launcher_rank() == 0);
  }
}
