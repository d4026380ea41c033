#include "exec/cpu/host_memory.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

namespace dtsim::exec::cpu {

namespace fs = std::filesystem;

namespace {

// cgroup v1 writes its "no limit" as the largest page-aligned signed 64-bit value; anything
// from 2^60 bytes (an exbibyte) on is taken as none.
constexpr double kNoLimit = 1152921504606846976.0;

// The first number in `file`; none where it is missing, unreadable, or "max" (cgroup v2's
// no limit).
std::optional<double> read_number(const fs::path& file) {
  std::ifstream in(file);
  std::string word;
  if (!(in >> word)) return std::nullopt;
  try {
    std::size_t used = 0;
    const double value = std::stod(word, &used);
    if (used != word.size() || !(value >= 0)) return std::nullopt;
    return value;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// The value of `key` in a "key value" file (memory.stat, meminfo without its unit).
std::optional<double> read_key(const fs::path& file, std::string_view key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string k;
    double value = 0;
    if (words >> k >> value && k == key) return value;
  }
  return std::nullopt;
}

// `p` without "." or ".." steps and without a trailing separator.
fs::path tidy(const fs::path& p) {
  fs::path t = p.lexically_normal();
  if (!t.has_filename() && t.has_relative_path()) t = t.parent_path();
  return t;
}

// The cgroup directory under `base` that /proc/self/cgroup names for the controllers line
// of cgroup v2 (id 0, no controllers) or of v1's memory controller; the mount's own where that
// directory is not visible or not under it (a cgroup namespace); none where no line matches.
std::optional<fs::path> cgroup_dir(const HostMemoryFiles& files, const fs::path& base, bool v2) {
  std::ifstream in(files.self_cgroup);
  std::string line;
  while (std::getline(in, line)) {
    const auto first = line.find(':');
    const auto second = first == std::string::npos ? first : line.find(':', first + 1);
    if (second == std::string::npos) continue;
    const std::string id = line.substr(0, first);
    const std::string controllers = line.substr(first + 1, second - first - 1);
    bool match = v2 ? id == "0" && controllers.empty() : false;
    if (!v2) {
      std::istringstream list(controllers);
      std::string c;
      while (std::getline(list, c, ',')) match = match || c == "memory";
    }
    if (!match) continue;
    const fs::path dir = tidy(base / fs::path(line.substr(second + 1)).relative_path());
    const fs::path inside = dir.lexically_relative(tidy(base));
    const bool under = !inside.empty() && *inside.begin() != "..";
    std::error_code ec;
    return under && fs::is_directory(dir, ec) ? dir : tidy(base);
  }
  return std::nullopt;
}

void keep_least(std::optional<HostMemory>& least, double bytes, std::string source) {
  bytes = std::max(0.0, bytes);
  if (!least || bytes < least->bytes) least = HostMemory{bytes, std::move(source)};
}

// cgroup v2: every cgroup from this process's up to the mount that sets memory.max.
void cgroup_v2(const HostMemoryFiles& files, std::optional<HostMemory>& least) {
  const fs::path mount = tidy(files.cgroup_mount);
  const auto own = cgroup_dir(files, mount, /*v2=*/true);
  if (!own) return;
  for (fs::path dir = *own;; dir = dir.parent_path()) {
    const auto limit = read_number(dir / "memory.max");
    const auto current = read_number(dir / "memory.current");
    if (limit && current && *limit < kNoLimit) {
      const double cache = read_key(dir / "memory.stat", "inactive_file").value_or(0.0);
      keep_least(
          least, *limit - std::max(0.0, *current - cache),
          fmt::format("the memory cgroup's limit less its use, {}", (dir / "memory.max").string()));
    }
    if (dir == mount || !dir.has_relative_path() || dir.parent_path() == dir) break;
  }
}

// cgroup v1: the memory controller's hierarchy, whose memory.stat gives the least limit of
// the cgroups above as well.
void cgroup_v1(const HostMemoryFiles& files, std::optional<HostMemory>& least) {
  const auto dir = cgroup_dir(files, files.cgroup_mount / "memory", /*v2=*/false);
  if (!dir) return;
  auto limit = read_number(*dir / "memory.limit_in_bytes");
  const auto usage = read_number(*dir / "memory.usage_in_bytes");
  const fs::path stat = *dir / "memory.stat";
  if (const auto above = read_key(stat, "hierarchical_memory_limit")) {
    limit = std::min(limit.value_or(*above), *above);
  }
  if (!limit || !usage || *limit >= kNoLimit) return;
  const double cache = read_key(stat, "total_inactive_file").value_or(0.0);
  keep_least(least, *limit - std::max(0.0, *usage - cache),
             fmt::format("the memory cgroup's limit less its use, {}",
                         (*dir / "memory.limit_in_bytes").string()));
}

}  // namespace

std::optional<HostMemory> available_host_memory(const HostMemoryFiles& files) {
  std::optional<HostMemory> least;
  if (const auto kib = read_key(files.meminfo, "MemAvailable:")) {
    keep_least(least, *kib * 1024.0, fmt::format("MemAvailable in {}", files.meminfo.string()));
  }
  cgroup_v2(files, least);
  cgroup_v1(files, least);
  return least;
}

}  // namespace dtsim::exec::cpu
