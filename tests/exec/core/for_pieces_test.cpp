// for_pieces: the pieces cover [0, n) once each, none shorter than asked, whatever the split.
#include "exec/core/for_pieces.hpp"

#include <atomic>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "tests/test_util.hpp"

TEST_CASE("for_pieces covers the range once, in pieces no shorter than asked", "[runner]") {
  const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  for (const std::int64_t n : {std::int64_t{0}, std::int64_t{1}, std::int64_t{31}, std::int64_t{32},
                               std::int64_t{1000}, std::int64_t{4099}}) {
    std::vector<std::atomic<int>> seen(static_cast<std::size_t>(n));
    std::mutex m;
    std::vector<std::pair<std::int64_t, std::int64_t>> pieces;
    dtsim::exec::for_pieces(
        n,
        [&](std::int64_t begin, std::int64_t end) {
          for (std::int64_t i = begin; i < end; ++i) ++seen[static_cast<std::size_t>(i)];
          const std::lock_guard<std::mutex> lock(m);
          pieces.emplace_back(begin, end);
        },
        16);
    INFO("n = " << n);
    for (const auto& s : seen) CHECK(s.load() == 1);
    // One piece below two minimum pieces or on one core; else one per core, at most n / 16.
    const std::int64_t want = std::max<std::int64_t>(1, std::min(cores, n / 16));
    CHECK(static_cast<std::int64_t>(pieces.size()) == want);
    if (pieces.size() > 1) {
      for (const auto& [begin, end] : pieces) CHECK(end - begin >= 16);
    }
  }
}
