// Launch shapes of the CUDA kernels that are plain arithmetic, checked where there is no GPU.
#include <catch2/catch.hpp>

#include "exec/cuda/kernels.hpp"

using dtsim::exec::cuda::moe_order_threads;

// moe_dispatch asks for E x (threads + 1) ints of shared memory. Its check once tested
// (E + 1) x threads, refusing 16 experts (DBRX, Phi-3.5-MoE) that fit, and letting 373-383
// through to a launch over the limit.
TEST_CASE("moe_dispatch's counting block fits 48 KiB for every expert count it takes",
          "[exec][cuda]") {
  constexpr long kLimit = 48 * 1024;
  for (int experts = 1; experts <= 400; ++experts) {
    INFO(experts << " experts");
    const int threads = moe_order_threads(experts);
    if (experts > 372) {
      CHECK(threads == 0);
      continue;
    }
    REQUIRE(threads >= 32);
    CHECK(threads <= 1024);
    CHECK(threads % 32 == 0);
    CHECK(long{experts} * (threads + 1) * 4 <= kLimit);
    // The most that fit: a warp more would not (or the block is at its 1024 threads).
    CHECK((threads == 1024 || long{experts} * (threads + 33) * 4 > kLimit));
  }
  CHECK(moe_order_threads(8) == 1024);  // Mixtral
  CHECK(moe_order_threads(16) == 736);  // 16 x 737 x 4 = 47,168 bytes
  CHECK(moe_order_threads(372) == 32);  // 372 x 33 x 4 = 49,104
}
