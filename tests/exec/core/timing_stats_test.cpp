#include "exec/core/timing_stats.hpp"

#include "tests/test_util.hpp"

TEST_CASE("median: the middle timing, of an even count the mean of the middle two",
          "[exec][timing]") {
  using dtsim::exec::median;
  CHECK(median({}) == 0);
  CHECK(median({3.0}) == 3.0);
  CHECK(median({7.3, 3.9}) == Approx(5.6));
  CHECK(median({4.0, 1.0, 9.0}) == 4.0);
  CHECK(median({4.0, 1.0, 9.0, 2.0}) == Approx(3.0));
}

TEST_CASE("robust_cv: the median absolute deviation, not swayed by one preempted sample",
          "[exec][timing]") {
  using dtsim::exec::robust_cv;
  // Deviations from the median 10: 1, 0, 1, 90, 0 -> their median (the MAD) 1.
  CHECK(robust_cv({9.0, 10.0, 11.0, 100.0, 10.0}) == Approx(1.4826 * 1.0 / 10.0));
  CHECK(robust_cv({5.0, 5.0, 5.0}) == 0);
  CHECK(robust_cv({}) == 0);
  CHECK(robust_cv({1.0, 100.0, 1000.0}) == Approx(0.99));  // capped below 1
}

TEST_CASE("collective_group_sizes: 2, 4, ... dividing the job, and the job", "[exec][timing]") {
  using dtsim::exec::collective_group_sizes;
  CHECK(collective_group_sizes(2) == std::vector<int>{2});
  CHECK(collective_group_sizes(3) == std::vector<int>{3});
  CHECK(collective_group_sizes(4) == std::vector<int>{2, 4});
  CHECK(collective_group_sizes(6) == std::vector<int>{2, 6});
  CHECK(collective_group_sizes(8) == std::vector<int>{2, 4, 8});
}
