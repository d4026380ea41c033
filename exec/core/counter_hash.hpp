// The counter-based hash behind the executor's parameters, data and dropout masks, and
// dropout's keep rule: one definition for the CPU kernels, the runner and the GPU kernels
// (nvcc compiles it as host and device code), so that every backend draws the same masks.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DTSIM_HOST_DEVICE __host__ __device__
#else
#define DTSIM_HOST_DEVICE
#endif

namespace dtsim::exec {

// A hash of three words (splitmix64's finaliser, Steele et al. 2014): values that do not depend
// on which rank makes them or in which order.
DTSIM_HOST_DEVICE inline std::uint64_t counter_hash(std::uint64_t seed, std::uint64_t a,
                                                    std::uint64_t b) {
  std::uint64_t z = seed ^ (a + 1) * 0x9e3779b97f4a7c15ULL ^ (b + 1) * 0xc2b2ae3d27d4eb4fULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Dropout keeps element `index` of global sequence `sequence` when the top 24 bits of
// counter_hash(stream, sequence, index) over 2^24 are >= rate.
DTSIM_HOST_DEVICE inline bool dropout_keeps(std::uint64_t stream, float rate, std::int64_t sequence,
                                            std::uint64_t index) {
  const std::uint64_t u = counter_hash(stream, static_cast<std::uint64_t>(sequence), index) >> 40;
  return static_cast<float>(u) * (1.0f / 16777216.0f) >= rate;
}

}  // namespace dtsim::exec
