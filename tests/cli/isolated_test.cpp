// run_isolated: work in a child process, its result or its error back in the parent.
#include "sim/cli/isolated.hpp"

#include <csignal>

#include "sim/common/error.hpp"
#include "tests/test_util.hpp"

TEST_CASE("run_isolated returns what the child returns, and throws what it threw, by kind",
          "[cli]") {
  int here = 1;
  // The child works on its own copy of this process: its writes stay there.
  CHECK(dtsim::cli::run_isolated([&] {
          here = 2;
          return std::string("line one\nline two");
        }) == "line one\nline two");
  CHECK(here == 1);
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cli::run_isolated([]() -> std::string {
                                    throw dtsim::InputError("model.json: layers: expected >= 1");
                                  }),
                                  dtsim::InputError, "model.json: layers: expected >= 1");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::cli::run_isolated([]() -> std::string { throw dtsim::UnsupportedError("a torus"); }),
      dtsim::UnsupportedError, "a torus");
  DTSIM_REQUIRE_THROWS_CONTAINING(
      dtsim::cli::run_isolated([]() -> std::string { throw std::runtime_error("a bug"); }),
      dtsim::InternalError, "a bug");
  // A child that dies says how.
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::cli::run_isolated([]() -> std::string {
                                    std::raise(SIGKILL);
                                    return "";
                                  }),
                                  dtsim::InternalError, "killed by signal 9");
}
