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

// The page cache a cgroup's use includes that the kernel reclaims before it kills (its file
// pages, active and inactive; shmem is not among them): `prefix` "" for v2's memory.stat,
// "total_" for v1's (the cgroup and those below it).
double reclaimable(const fs::path& stat, const std::string& prefix) {
  return read_key(stat, prefix + "inactive_file").value_or(0.0) +
         read_key(stat, prefix + "active_file").value_or(0.0);
}

// Every cgroup from `own` up to `mount` that sets a limit (file `limit_file`, its use in
// `usage_file`): its limit less its use beyond reclaimable page cache.
void walk_up(const fs::path& own, const fs::path& mount, const char* limit_file,
             const char* usage_file, const std::string& stat_prefix,
             std::optional<HostMemory>& least) {
  for (fs::path dir = own;; dir = dir.parent_path()) {
    const auto limit = read_number(dir / limit_file);
    const auto usage = read_number(dir / usage_file);
    if (limit && usage && *limit < kNoLimit) {
      const double cache = reclaimable(dir / "memory.stat", stat_prefix);
      keep_least(
          least, *limit - std::max(0.0, *usage - cache),
          fmt::format("the memory cgroup's limit less its use, {}", (dir / limit_file).string()));
    }
    if (dir == mount || !dir.has_relative_path() || dir.parent_path() == dir) break;
  }
}

// cgroup v2: every cgroup from this process's up to the mount that sets memory.max.
void cgroup_v2(const HostMemoryFiles& files, std::optional<HostMemory>& least) {
  const fs::path mount = tidy(files.cgroup_mount);
  if (const auto own = cgroup_dir(files, mount, /*v2=*/true)) {
    walk_up(*own, mount, "memory.max", "memory.current", "", least);
  }
}

// cgroup v1: the memory controller's cgroups from this process's up to the mount (each
// ancestor's use includes its other children's), and the least limit of those above that are
// not visible (memory.stat's hierarchical_memory_limit), less this cgroup's use.
void cgroup_v1(const HostMemoryFiles& files, std::optional<HostMemory>& least) {
  const fs::path mount = tidy(files.cgroup_mount / "memory");
  const auto own = cgroup_dir(files, mount, /*v2=*/false);
  if (!own) return;
  walk_up(*own, mount, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_", least);
  const fs::path stat = *own / "memory.stat";
  const auto above = read_key(stat, "hierarchical_memory_limit");
  const auto usage = read_number(*own / "memory.usage_in_bytes");
  if (above && usage && *above < kNoLimit) {
    keep_least(
        least, *above - std::max(0.0, *usage - reclaimable(stat, "total_")),
        fmt::format("the memory cgroup's hierarchical limit less its use, {}", stat.string()));
  }
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
