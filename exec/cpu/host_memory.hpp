// How much memory this host can still give the processes of a CPU run: the kernel's
// MemAvailable, or less where the run's memory cgroup (a container's, a batch job's) limits it.
// dtexec refuses a CPU plan whose tensors cannot fit, instead of a rank killed part-way by the
// kernel's or the cgroup's out-of-memory killer.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

namespace dtsim::exec::cpu {

// Where the figures are read; a test points them at a tree of its own.
struct HostMemoryFiles {
  std::filesystem::path meminfo = "/proc/meminfo";
  std::filesystem::path self_cgroup = "/proc/self/cgroup";
  std::filesystem::path cgroup_mount = "/sys/fs/cgroup";
};

struct HostMemory {
  double bytes = 0;
  std::string source;  // where the figure comes from, for messages
};

// The least of: MemAvailable in meminfo; for each cgroup from this process's up to the mount
// that sets a memory limit, the limit less what the cgroup uses beyond the page cache the
// kernel reclaims before it kills (active and inactive file pages): cgroup v2's memory.max,
// memory.current and memory.stat, v1's memory.limit_in_bytes, memory.usage_in_bytes and
// memory.stat's total_ figures, and v1's hierarchical_memory_limit for the ones above that are
// not visible. Where the cgroup's own directory is not visible (a cgroup namespace shows its
// root at the mount), the mount's files are read. None where no file says.
std::optional<HostMemory> available_host_memory(const HostMemoryFiles& files = {});

}  // namespace dtsim::exec::cpu
