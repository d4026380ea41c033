#include "sim/common/launcher.hpp"

#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <initializer_list>
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

namespace {
// The first of `vars` set, read as a number >= 0; `fallback` where none is set or its value is
// not one.
int first_count(std::initializer_list<const char*> vars, int fallback) {
  for (const char* var : vars) {
    const char* value = std::getenv(var);
    if (value == nullptr) continue;
    const std::string_view text(value);
    int n = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
    return ec == std::errc() && end == text.data() + text.size() && n >= 0 ? n : fallback;
  }
  return fallback;
}
}  // namespace

int launcher_rank() {
  return first_count({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}, 0);
}

int launcher_size() {
  if (!under_mpirun()) return 1;
  return first_count({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}, 0);
}

void say_once_per_job(const std::string& who, const char* what, const char* message, int rank) {
  if (rank != 0) std::this_thread::sleep_for(std::chrono::seconds(2));
  std::cerr << fmt::format("{}{}: {}: {}\n", who, rank == 0 ? "" : fmt::format(" (rank {})", rank),
                           what, message);
}

}  // namespace dtsim
