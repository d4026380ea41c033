#include "sim/common/launcher.hpp"

#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string_view>
#include <thread>

namespace dtsim {

bool under_mpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    const char* value = std::getenv(var);
    if (value == nullptr) continue;
    const std::string_view text(value);
    int rank = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), rank);
    return ec == std::errc() && end == text.data() + text.size() && rank >= 0 ? rank : 0;
  }
  return 0;
}

void say_once_per_job(const std::string& who, const char* what, const char* message, int rank) {
  if (rank != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
  std::cerr << fmt::format("{}{}: {}: {}\n", who, rank == 0 ? "" : fmt::format(" (rank {})", rank),
                           what, message);
}

}  // namespace dtsim
