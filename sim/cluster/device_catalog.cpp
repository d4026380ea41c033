#include "sim/cluster/device_catalog.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>

#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"

namespace dtsim::cluster {

using nlohmann::json;

double DeviceSpec::peak_flops_for(Precision p) const {
  if (auto it = peak_flops.find(p); it != peak_flops.end()) return it->second.value;
  std::vector<std::string_view> have;
  for (const auto& [q, f] : peak_flops) have.push_back(to_string(q));
  throw UnsupportedError(
      fmt::format("device {} has no {} peak in the catalog ({}); it supports: {}", name,
                  to_string(p), file, fmt::join(have, ", ")));
}

DeviceSpec device_from_json(const json& j, const std::string& file) {
  refuse_other_kind(j, file, "device");
  const JsonReader r(j, file);
  r.expect_only({"name", "display_name", "vendor", "aliases", "peak_flops", "memory_bytes",
                 "memory_bw_bytes_per_s", "intra_node_bw_bytes_per_s", "efficiency", "power_w",
                 "framework_overhead_bytes", "notes"});
  DeviceSpec d;
  d.file = file;
  d.name = r.name("name");
  d.display_name = r.string("display_name");
  d.vendor = r.string("vendor");
  d.notes = r.string_or("notes", "");
  if (r.has("aliases")) d.aliases = r.string_array("aliases");
  for (const std::string& alias : d.aliases) {
    if (alias.empty()) r.fail("aliases", "expected names, got an empty one");
  }
  const JsonReader peaks = r.object("peak_flops");
  peaks.expect_only({"fp32", "tf32", "bf16", "fp16", "fp8"});
  for (Precision p : kAllPrecisions) {
    if (peaks.has(to_string(p))) {
      d.peak_flops[p] = peaks.figure_within(to_string(p), kLeastFlops, kMostFlops, "FLOP/s");
    }
  }
  if (d.peak_flops.empty()) r.fail("peak_flops", "expected at least one precision");
  d.memory_bytes = r.figure_within("memory_bytes", kLeastMemory, kMostMemory, "bytes");
  d.memory_bw_bytes_per_s =
      r.figure_within("memory_bw_bytes_per_s", kLeastBandwidth, kMostBandwidth, "bytes/s");
  d.intra_node_bw_bytes_per_s =
      r.figure_within("intra_node_bw_bytes_per_s", kLeastBandwidth, kMostBandwidth, "bytes/s");
  read_efficiency(r.object("efficiency"), d.efficiency, /*required=*/true);
  if (r.has("power_w")) d.power_w = r.figure_within("power_w", kLeastPower, kMostPower, "W");
  if (r.has("framework_overhead_bytes")) {
    d.framework_overhead_bytes = r.figure_within("framework_overhead_bytes", kLeastOverhead,
                                                 kMostMemory, "bytes", /*allow_zero=*/true);
  }
  return d;
}

std::vector<std::string> read_efficiency(const JsonReader& eff, DeviceEfficiency& e,
                                         bool required) {
  eff.expect_only(
      {"gemm", "attention", "memory_bw", "launch_overhead_s", "intra_node_bw", "gemm_waves"});
  std::vector<std::string> read;
  auto fraction = [&](std::string_view key, Figure& out) {
    if (!required && !eff.has(key)) return;
    out = eff.figure(key);
    if (out.value > 1.0) {
      eff.fail(key, fmt::format("expected a fraction in (0, 1], got {}", out.value));
    }
    if (out.value < kLeastEfficiency) {
      eff.fail(key, fmt::format("expected a fraction of peak from {:g} to 1, got {:g} (a slip? "
                                "a device reaching under 1% of its peak is no device to plan for)",
                                kLeastEfficiency, out.value));
    }
    read.emplace_back(key);
  };
  fraction("gemm", e.gemm);
  fraction("attention", e.attention);
  fraction("memory_bw", e.memory_bw);
  if (required || eff.has("launch_overhead_s")) {
    e.launch_overhead_s = eff.figure_within("launch_overhead_s", kLeastLatency, kMostLatency,
                                            "seconds", /*allow_zero=*/true);
    read.emplace_back("launch_overhead_s");
  }
  if (eff.has("intra_node_bw")) fraction("intra_node_bw", e.intra_node_bw.emplace());
  if (eff.has("gemm_waves")) {
    const JsonReader w = eff.object("gemm_waves");
    w.expect_only({"sm_count", "tile_m", "tile_n", "source"});
    e.gemm_waves = GemmWaves{w.positive_int_up_to("sm_count", 1 << 16),
                             w.positive_int_up_to("tile_m", 1 << 16),
                             w.positive_int_up_to("tile_n", 1 << 16), w.string("source")};
    read.emplace_back("gemm_waves");
  }
  return read;
}

namespace {
std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}
}  // namespace

std::vector<std::string> list_devices() {
  return list_data_names("topologies/devices");
}

DeviceSpec load_device(std::string_view name, const std::filesystem::path& beside) {
  const bool looks_like_path = names_a_path(name);
  if (!looks_like_path) {
    // Names, then aliases, case-insensitive; a DTSIM_DATA_DIR's devices before the shipped
    // ones (a user's device that shares an alias with a shipped one is the one found).
    const std::string wanted = lower(name);
    std::vector<std::filesystem::path> files;
    for (const auto& dir : data_dirs()) {
      std::vector<std::filesystem::path> here;
      std::error_code ec;
      for (const auto& entry :
           std::filesystem::directory_iterator(dir / "topologies" / "devices", ec)) {
        if (entry.is_regular_file() && entry.path().extension() == ".json") {
          here.push_back(entry.path());
        }
      }
      std::sort(here.begin(), here.end());
      files.insert(files.end(), here.begin(), here.end());
    }
    std::vector<DeviceSpec> devices;
    for (const auto& path : files) {
      devices.push_back(device_from_json(JsonReader::parse_file(path), path.string()));
    }
    for (const DeviceSpec& d : devices) {
      if (lower(d.name) == wanted) return d;
    }
    for (const DeviceSpec& d : devices) {
      for (const std::string& alias : d.aliases) {
        if (lower(alias) == wanted) return d;
      }
    }
  }
  if (looks_like_path && !beside.empty() && std::filesystem::path(name).is_relative()) {
    const auto there = beside / name;
    std::error_code ec;
    if (std::filesystem::is_regular_file(there, ec)) {
      return device_from_json(JsonReader::parse_file(there), there.string());
    }
  }
  const auto path = resolve_data_file("device", "topologies/devices", name);
  return device_from_json(JsonReader::parse_file(path), path.string());
}

}  // namespace dtsim::cluster
