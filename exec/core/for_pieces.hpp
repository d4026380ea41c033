// Work over [0, n) split into pieces on the host's cores (header-only).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

namespace dtsim::exec {

// Calls body(begin, end) on consecutive pieces of [0, n), each at least `min_piece` long, on up
// to one thread per core (the calling thread takes the first piece), and returns once all are
// done; one call for the whole range when n < 2 x min_piece or the host has one core. For work
// whose every element depends on its index alone (a model's initial weights take tens of
// nanoseconds per value on one core), so that the result does not depend on the thread count.
// `body` must not throw.
inline void for_pieces(std::int64_t n, const std::function<void(std::int64_t, std::int64_t)>& body,
                       std::int64_t min_piece = std::int64_t{1} << 20) {
  const std::int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  const std::int64_t threads = std::min(cores, n / std::max<std::int64_t>(min_piece, 1));
  if (threads <= 1) {
    body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  for (std::int64_t t = 1; t < threads; ++t) {
    pool.emplace_back(body, n * t / threads, n * (t + 1) / threads);
  }
  body(0, n / threads);
  for (std::thread& t : pool) t.join();
}

}  // namespace dtsim::exec
