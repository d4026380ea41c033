// The collectives' view shapes that both communication backends assert before calling MPI or
// NCCL (exec/core/comm.hpp): what the runner passes holds, a mismatch is an internal error.
#include <vector>

#include "exec/core/comm.hpp"
#include "sim/common/error.hpp"
#include "tests/test_util.hpp"

using dtsim::exec::Dtype;
using dtsim::exec::View;

namespace {

View view(std::int64_t n, Dtype type = Dtype::F32) {
  return {nullptr, n, type};
}

}  // namespace

TEST_CASE("collective view shapes: whole and part, per member", "[runner]") {
  const std::vector<int> counts = {3, 2, 4};  // unequal shards, 9 in all
  for (int member = 0; member < 3; ++member) {
    CHECK_NOTHROW(dtsim::exec::expect_shapes(
        "reduce-scatter", view(9), view(counts[static_cast<std::size_t>(member)]), counts, member));
  }
  // The whole short of the counts' sum, the part another member's, a type that differs, a
  // member outside the group.
  CHECK_THROWS_AS(dtsim::exec::expect_shapes("all-gather", view(8), view(3), counts, 0),
                  dtsim::InternalError);
  CHECK_THROWS_AS(dtsim::exec::expect_shapes("all-gather", view(9), view(2), counts, 0),
                  dtsim::InternalError);
  CHECK_THROWS_AS(
      dtsim::exec::expect_shapes("reduce-scatter", view(9, Dtype::BF16), view(3), counts, 0),
      dtsim::InternalError);
  CHECK_THROWS_AS(dtsim::exec::expect_shapes("reduce-scatter", view(9), view(3), counts, 3),
                  dtsim::InternalError);
}

TEST_CASE("all-to-all view shapes: the pieces sent and received", "[runner]") {
  const std::vector<int> sent = {1, 0, 5}, received = {2, 2, 2};
  CHECK_NOTHROW(dtsim::exec::expect_all_to_all_shapes(view(6), sent, view(6), received));
  CHECK_THROWS_AS(dtsim::exec::expect_all_to_all_shapes(view(7), sent, view(6), received),
                  dtsim::InternalError);
  CHECK_THROWS_AS(
      dtsim::exec::expect_all_to_all_shapes(view(6), sent, view(6, Dtype::BF16), received),
      dtsim::InternalError);
  CHECK_THROWS_AS(
      dtsim::exec::expect_all_to_all_shapes(view(6), sent, view(4), std::vector<int>{2, 2}),
      dtsim::InternalError);
}
