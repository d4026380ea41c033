#include "exec/cpu/host_memory.hpp"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>

namespace fs = std::filesystem;
using dtsim::exec::cpu::available_host_memory;
using dtsim::exec::cpu::HostMemoryFiles;

namespace {

constexpr double kGiB = 1024.0 * 1024 * 1024;

std::string bytes(double gib) {
  return std::to_string(static_cast<long long>(gib * kGiB)) + "\n";
}

// A fake /proc and /sys/fs/cgroup under a temporary folder, removed with the object.
class FakeHost {
 public:
  explicit FakeHost(const std::string& name)
      : root_(fs::temp_directory_path() /
              ("dtexec_host_memory_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(root_);
    fs::create_directories(root_);
    files.meminfo = root_ / "meminfo";
    files.self_cgroup = root_ / "cgroup";
    files.cgroup_mount = root_ / "sys";
  }
  ~FakeHost() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  FakeHost(const FakeHost&) = delete;
  FakeHost& operator=(const FakeHost&) = delete;

  // Writes `text` to `path` (relative to the fake root), making its folders.
  void write(const fs::path& path, const std::string& text) const {
    fs::create_directories((root_ / path).parent_path());
    std::ofstream(root_ / path) << text;
  }
  void meminfo(double gib) const {
    write("meminfo", "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   " +
                         std::to_string(static_cast<long long>(gib * 1024 * 1024)) + " kB\n");
  }

  // A cgroup v2 folder under the mount: its limit file's text and what it uses.
  void cgroup_v2(const std::string& path, const std::string& max, double current_gib) const {
    write("sys/" + path + "/memory.max", max);
    write("sys/" + path + "/memory.current", bytes(current_gib));
  }
  // A cgroup v1 memory controller's folder: its limit file's text and what it uses.
  void cgroup_v1(const std::string& path, const std::string& limit, double usage_gib) const {
    write("sys/memory/" + path + "/memory.limit_in_bytes", limit);
    write("sys/memory/" + path + "/memory.usage_in_bytes", bytes(usage_gib));
  }

  HostMemoryFiles files;

 private:
  fs::path root_;
};

}  // namespace

TEST_CASE("host memory: MemAvailable where no cgroup limits the process", "[host_memory]") {
  FakeHost host("plain");
  host.meminfo(20);
  // cgroup v2 at the mount without a limit ("max"), and v1's "no limit" value.
  host.write("cgroup", "0::/user.slice\n4:memory:/user.slice\n");
  host.cgroup_v2("user.slice", "max\n", 3);
  host.cgroup_v1("user.slice", "9223372036854771712\n", 3);
  const auto m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(20 * kGiB));
  CHECK(m->source.find("MemAvailable") != std::string::npos);
}

TEST_CASE("host memory: a cgroup v2 limit less what the cgroup uses beyond its file pages",
          "[host_memory]") {
  FakeHost host("v2");
  host.meminfo(20);
  host.write("cgroup", "0::/docker/abc\n");
  host.cgroup_v2("docker/abc", bytes(8), 3);
  host.write("sys/docker/abc/memory.stat",
             "anon 1000\nfile 2000\ninactive_file " + bytes(1) + "active_file " + bytes(0.5));
  auto m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(6.5 * kGiB));  // 8 - (3 - 1 - 0.5): file pages are reclaimed first
  CHECK(m->source.find("docker/abc/memory.max") != std::string::npos);

  // A tighter limit above it applies as well.
  host.cgroup_v2("docker", bytes(5), 4);
  m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(1 * kGiB));
  CHECK(m->source.find("docker/memory.max") != std::string::npos);

  // Using more than its limit (page cache not yet reclaimed) leaves nothing, never less.
  host.write("sys/docker/memory.current", bytes(9));
  m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == 0);
}

TEST_CASE("host memory: a cgroup namespace's root at the mount", "[host_memory]") {
  FakeHost host("ns");
  host.meminfo(20);
  // Inside a cgroup namespace the process's own cgroup is "/" (or a path not under the mount).
  host.write("cgroup", "0::/\n");
  host.cgroup_v2("", bytes(4), 1);
  auto m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(3 * kGiB));

  host.write("cgroup", "0::/../../outside\n");
  m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(3 * kGiB));
}

TEST_CASE("host memory: a cgroup v1 limit, the least of its own and the hierarchy's",
          "[host_memory]") {
  FakeHost host("v1");
  host.meminfo(20);
  host.write("cgroup", "9:pids:/job\n4:cpuacct,memory:/job\n0::/\n");
  host.cgroup_v1("job", bytes(10), 4);
  host.write("sys/memory/job/memory.stat", "cache 100\nhierarchical_memory_limit " +
                                               std::to_string(7 * 1024LL * 1024 * 1024) +
                                               "\ntotal_inactive_file " + bytes(2));
  auto m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(5 * kGiB));  // min(10, 7) - (4 - 2)
  CHECK(m->source.find("memory/job/memory.stat") != std::string::npos);

  // A visible parent whose other children use most of its limit leaves less.
  host.write("cgroup", "4:memory:/slurm/job\n");
  host.cgroup_v1("slurm/job", bytes(10), 1);
  host.cgroup_v1("slurm", bytes(6), 5);
  m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(1 * kGiB));
  CHECK(m->source.find("memory/slurm/memory.limit_in_bytes") != std::string::npos);
}

TEST_CASE("host memory: none where no file says, and unreadable figures are ignored",
          "[host_memory]") {
  FakeHost host("none");
  CHECK(!available_host_memory(host.files));
  host.write("meminfo", "MemTotal: 100 kB\n");
  host.write("cgroup", "0::/x\n");
  host.cgroup_v2("x", "lots\n", 1);
  CHECK(!available_host_memory(host.files));
  host.meminfo(2);
  const auto m = available_host_memory(host.files);
  REQUIRE(m);
  CHECK(m->bytes == Approx(2 * kGiB));
}

TEST_CASE("host memory: this Linux machine has a figure", "[host_memory]") {
  const auto m = available_host_memory();
  REQUIRE(m);
  CHECK(m->bytes >= 0);  // (0 where a cgroup's use has reached its limit)
  CHECK(!m->source.empty());
}
