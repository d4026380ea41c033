#include "sim/common/units.hpp"

#include <fmt/format.h>

#include <cmath>

namespace dtsim {

std::string format_gib(double bytes) {
  // Under a GiB (a CPU rank's model), in MiB: 0.07 GiB would say little.
  if (std::fabs(bytes) < kGiB && bytes != 0) {
    return fmt::format("{:.1f} MiB", bytes / kMiB);
  }
  return fmt::format("{:.2f} GiB", bytes / kGiB);
}

std::string format_count(std::uint64_t n) {
  std::string digits = std::to_string(n);
  std::string out;
  const std::size_t lead = digits.size() % 3;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && i >= lead && (i - lead) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string format_si(double value) {
  const double a = std::fabs(value);
  if (a >= 1e15) return fmt::format("{:.2f} P", value / 1e15);
  if (a >= 1e12) return fmt::format("{:.2f} T", value / 1e12);
  if (a >= 1e9) return fmt::format("{:.2f} G", value / 1e9);
  if (a >= 1e6) return fmt::format("{:.2f} M", value / 1e6);
  if (a >= 1e3) return fmt::format("{:.2f} K", value / 1e3);
  return fmt::format("{:.0f}", value);
}

std::string format_seconds(double seconds) {
  // (Below 0.1 s three significant digits, their trailing zeros kept: a column of them lines up.)
  return std::fabs(seconds) >= 0.1 || seconds == 0 ? fmt::format("{:.3f}", seconds)
                                                   : fmt::format("{:#.3g}", seconds);
}

std::string format_rate(double per_second) {
  return std::fabs(per_second) >= 99.95 || per_second == 0 ? fmt::format("{:.0f}", per_second)
                                                           : fmt::format("{:.3g}", per_second);
}

std::string format_percent(double share) {
  const double percent = 100 * share;
  return (std::fabs(percent) >= 0.09995 || percent == 0 ? fmt::format("{:.1f}", percent)
                                                        : fmt::format("{:.3g}", percent)) +
         "%";
}

std::string format_duration(double seconds) {
  const double a = std::fabs(seconds);
  if (a == 0) return "0 s";
  // Each unit from where three digits round up into it (0.09996 s reads 0.100 s, not 100. ms).
  if (a >= 0.09995) return format_seconds(seconds) + " s";
  if (a >= 9.995e-5) return fmt::format("{:#.3g} ms", seconds * 1e3);
  if (a >= 9.995e-8) return fmt::format("{:#.3g} us", seconds * 1e6);
  return fmt::format("{:#.3g} ns", seconds * 1e9);
}

}  // namespace dtsim
