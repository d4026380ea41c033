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

// The least of: MemAvailable in meminfo; for a cgroup v2 memory controller (memory.max), at
// this process's cgroup and every cgroup above it that has a limit, the limit less what the
// cgroup uses other than reclaimable page cache (memory.current less memory.stat's
// inactive_file); for cgroup v1 (memory.limit_in_bytes, memory.stat's
// hierarchical_memory_limit), the same with memory.usage_in_bytes and total_inactive_file.
// Where the cgroup's own directory is not visible (a cgroup namespace shows its root at the
// mount), the mount's files are read. None where no file says.
std::optional<HostMemory> available_host_memory(const HostMemoryFiles& files = {});

}  // namespace dtsim::exec::cpu
