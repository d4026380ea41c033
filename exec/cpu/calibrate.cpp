#include "exec/cpu/calibrate.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <ctime>
#include <fstream>
#include <string>
#include <vector>

#include "exec/cpu/kernels.hpp"

namespace dtsim::exec::cpu {

namespace {

template <typename F>
double best_of(int repeats, F&& f) {
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

std::string cpu_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

}  // namespace

nlohmann::json calibrate(const CalibrateOptions& options) {
  using nlohmann::json;
  // Square GEMMs and transformer-like shapes (tokens x hidden by hidden x 3·hidden, 4·hidden).
  std::vector<std::array<int, 3>> shapes = {{64, 64, 64},    {128, 128, 128},    {256, 256, 256},
                                            {512, 512, 512}, {1024, 1024, 1024}, {256, 64, 192},
                                            {256, 64, 256},  {1024, 256, 768},   {1024, 256, 1024}};
  if (options.quick) shapes = {{32, 32, 32}, {128, 128, 128}, {256, 64, 256}};
  json gemm = json::array();
  for (const auto& [m, k, n] : shapes) {
    std::vector<float> a(static_cast<std::size_t>(m) * k, 1.0f),
        b(static_cast<std::size_t>(k) * n, 0.5f), c(static_cast<std::size_t>(m) * n);
    matmul_forward(c, a, b, {}, m, k, n);  // warm up
    const double s = best_of(options.repeats, [&] { matmul_forward(c, a, b, {}, m, k, n); });
    gemm.push_back({{"m", m}, {"n", n}, {"k", k}, {"seconds", s}});
  }
  // Streaming bandwidth: copy a buffer much larger than the caches (read + write).
  const std::size_t n = options.quick ? (4u << 20) : (32u << 20);
  std::vector<float> src(n, 1.0f), dst(n);
  const double copy_s =
      best_of(options.repeats, [&] { std::copy(src.begin(), src.end(), dst.begin()); });
  const double bw = 2.0 * static_cast<double>(n) * sizeof(float) / copy_s;
  std::vector<float> x(64, 1.0f), y(64);
  const double tiny_s =
      best_of(options.repeats * 10, [&] { matmul_forward(y, x, x, {}, 8, 8, 8); });
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%d", std::gmtime(&now));
  return {{"device", "cpu-host"},
          {"source", fmt::format("dtexec calibrate --backend cpu on {} ({}), {}, OpenBLAS sgemm "
                                 "with its default threads, best of {}",
                                 host, cpu_name(), date, options.repeats)},
          {"precision", "fp32"},
          {"gemm", gemm},
          {"memory_bw_bytes_per_s", bw},
          {"launch_overhead_s", tiny_s}};
}

}  // namespace dtsim::exec::cpu
