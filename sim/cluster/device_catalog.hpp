// The device catalog (topologies/devices/*.json, format in topologies/README.md): peak FLOP/s
// per precision, memory, bandwidths and default efficiencies, each figure with its source.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sim/common/json_reader.hpp"
#include "sim/common/precision.hpp"

namespace dtsim::cluster {

// What device and cluster files may say, so that a value in another unit is refused rather
// than priced (400 for a 400 Gbit/s NIC, 5 for 5 microseconds, 362 for 362 TFLOP/s). Sanity
// bounds, orders of magnitude beyond the hardware of the catalog (a CPU rank's 77 GFLOP/s,
// 9.5 GB/s and 1.3 GB/s to a B200's 4.5 PFLOP/s and 7.7 TB/s), not model constants.
inline constexpr double kLeastFlops = 1e9;        // FLOP/s: 1 GFLOP/s
inline constexpr double kMostFlops = 1e17;        // 100 PFLOP/s
inline constexpr double kLeastMemory = 0x1p27;    // bytes: 128 MiB
inline constexpr double kMostMemory = 0x1p45;     // 32 TiB
inline constexpr double kLeastOverhead = 0x1p20;  // bytes: 1 MiB (or none)
inline constexpr double kLeastBandwidth = 1e7;    // bytes/s: 10 MB/s
inline constexpr double kMostBandwidth = 1e14;    // 100 TB/s
inline constexpr double kLeastLatency = 1e-9;     // seconds: 1 ns
inline constexpr double kMostLatency = 1e-2;      // 10 ms
// Bounds that catch a unit mistake, not limits of any device: a device's share of power (1 W to
// 100 kW), its price per hour (a millionth of a dollar to 10,000 USD), and an efficiency (1% of
// peak or more: below that a figure is more likely a slip than a measurement).
inline constexpr double kLeastPower = 1;     // W
inline constexpr double kMostPower = 1e5;    // W
inline constexpr double kLeastPrice = 1e-6;  // USD per device-hour
inline constexpr double kMostPrice = 1e4;    // USD per device-hour
inline constexpr double kLeastEfficiency = 0.01;

// Wave quantization of a GEMM (NVIDIA, "Matrix Multiplication Background User's Guide", Wave
// Quantization): the output is cut into tile_m x tile_n tiles, one thread block each, and
// sm_count of them run at a time; a last, partly filled wave takes as long as a full one.
struct GemmWaves {
  std::int64_t sm_count = 0;
  std::int64_t tile_m = 0;
  std::int64_t tile_n = 0;
  std::string source;
};

struct DeviceEfficiency {
  Figure gemm;               // fraction of dense peak reached by large matrix multiplications
  Figure attention;          // fraction of dense peak reached by the attention core
  Figure memory_bw;          // fraction of HBM bandwidth reached by element-wise kernels
  Figure launch_overhead_s;  // fixed time per kernel
  // Fraction of the scale-up link bandwidth that collectives reach (absent: all of it).
  std::optional<Figure> intra_node_bw;
  // Absent: GEMMs run at `gemm` whatever their shape.
  std::optional<GemmWaves> gemm_waves;
};

struct DeviceSpec {
  std::string name;
  std::string display_name;
  std::string vendor;
  std::string notes;
  std::string file;
  std::vector<std::string> aliases;
  std::map<Precision, Figure> peak_flops;  // dense FLOP/s, per device
  Figure memory_bytes;
  Figure memory_bw_bytes_per_s;
  Figure intra_node_bw_bytes_per_s;  // scale-up link, per direction
  DeviceEfficiency efficiency;
  std::optional<Figure> power_w;
  // What a rank holds beside its tensors (a GPU's CUDA context, library workspaces, allocator
  // fragmentation): the memory model's framework allowance unless --framework-overhead-gib
  // says otherwise. Absent from the file: 1 GiB, a dtsim assumption.
  std::optional<Figure> framework_overhead_bytes;

  bool supports(Precision p) const { return peak_flops.count(p) != 0; }
  // Dense peak for `p`; throws UnsupportedError naming the precisions the device has.
  double peak_flops_for(Precision p) const;
};

DeviceSpec device_from_json(const nlohmann::json& j, const std::string& file);

// Reads the figures of `efficiency` present in `r` (an efficiency object: gemm, attention,
// memory_bw, launch_overhead_s, intra_node_bw, gemm_waves) over those already in `efficiency`;
// returns the keys read. `required`: gemm, attention, memory_bw and launch_overhead_s must be
// there (a device's own object) or may be missing (a cluster's overrides).
std::vector<std::string> read_efficiency(const JsonReader& r, DeviceEfficiency& efficiency,
                                         bool required);
// By file name, alias (case-insensitive) or path. A relative path is looked for in `beside`
// first where given (a cluster file's folder), then from the working folder.
DeviceSpec load_device(std::string_view name_alias_or_path,
                       const std::filesystem::path& beside = {});
std::vector<std::string> list_devices();

}  // namespace dtsim::cluster
