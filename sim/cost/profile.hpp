// Calibration profiles: measured kernel times that replace the catalog's efficiencies in the
// compute cost model (`dtsim simulate --profile P.json`; written by `dtexec calibrate`).
//
// {
//   "device": "a100-sxm4-80gb",            the device it was measured on
//   "source": "dtexec calibrate, 2026-..",  how and when
//   "precision": "bf16",
//   "gemm": [ {"m": 4096, "n": 4096, "k": 4096, "seconds": 6.2e-4}, ... ],
//   "memory_bw_bytes_per_s": 1.7e12,        achieved by streaming kernels (optional)
//   "launch_overhead_s": 4e-6,              (optional)
//   "ops": [ {"op": "attention", "phase": "fwd", "flops_per_s": 2e9, "seconds": ...},
//            {"op": "layernorm", "phase": "bwd", "bytes_per_s": 5e9, ...},
//            {"op": "optimizer", "phase": "step", "bytes_per_s": 6e9, ...} ],   (optional)
//   "collectives": [ {"kind": "all_reduce", "ranks": 2, "bytes": 4096, "seconds": 3e-6, ...} ],
//   "ranks_per_host": 2,                    how many ranks measured at once (informative)
//   "jitter_cv": 0.05,                      spread of a compute segment's time across runs and
//                                           ranks (a coefficient of variation, below 1), for the
//                                           straggler model (optional)
//   "in_run": {"forward": 1.08, "backward": 1.15, "optimizer": 1.0, "tasks": 31,
//              "rank_spread_cv": 0.08, "transient_cv": 0.01}
//                                           measured over predicted time of the calibration
//                                           model's forward, backward and optimizer tasks in a
//                                           training step that dtexec ran (optional); with
//                                           several ranks at once, the spread of their lasting
//                                           speeds (rank_spread_cv, the slow rank; optional)
//                                           and of a phase's time from round to round once
//                                           those and the host's drift are out (transient_cv;
//                                           optional, recorded, not used yet)
// }
// Kernels timed alone run faster than in a training step, where their operands come from other
// kernels (caches) and the executor works between them: "in_run" holds that ratio, measured by
// `dtexec calibrate` (steps of its model on one rank per process, every compute task against
// this profile's prediction of it with the step's GEMMs timed again right after it; the median
// over rounds), and the compute cost multiplies its times by it.
// "ops" gives measured rates of the non-GEMM ops in the model graph's own units: FLOP/s of
// the graph's FLOPs for the attention core, bytes/s of the graph's bytes for the others (ops:
// attention (unfused), flash_attention, layernorm, rmsnorm, gelu, swiglu, residual, embedding,
// loss_statistics (forward only), loss; phases fwd, bwd),
// and for the optimizer bytes/s (the executors' AdamW moves 28 bytes per parameter, all fp32;
// the simulator divides the plan's own bytes by it, ComputeCost::optimizer_seconds; phase
// step only). A rate in the other unit, for a phase the op lacks, or given twice is refused.
// An op with a rate is priced by it instead of the roofline. "collectives" (kinds all_reduce,
// all_gather, reduce_scatter, all_to_all, send_recv; one sample per kind, ranks and bytes) replace
// the network model for groups of a measured size inside one node: time from the measured
// throughput interpolated in log(bytes), never below the smallest size's time (latency). A row
// with "started": true (all_reduce, all_gather, reduce_scatter; CPU calibrations) times the
// collective started and then waited for (MPI_Iallreduce and MPI_Wait, Open MPI's libnbc),
// as dtexec runs the data-parallel stream's: the simulator prices that stream's collectives
// by those rows where the profile has them (2 ranks, cpu-small's 14.9 MB of gradients: 3-5 ms
// blocking, 7-9 ms started).
// Fields recorded but not read (notes, ranks_per_host, in_run.tasks, an op's seconds, a
// collective's algbw and busbw) are still refused when their type is not calibrate's.
//
// A GEMM of a measured shape takes its measured time (`dtexec calibrate` times the model's own
// GEMMs, forward and backward, whole and split over tp, and on CPU ranks over cp); any other
// GEMM's time comes from the measured throughput (FLOP/s) interpolated linearly in log(FLOPs)
// between the two measured sizes around it, a size's throughput the median of its layouts'
// (calibrate times each in three: the forward's and the two gradients'); beyond the measured
// sizes, the nearest size's throughput (an extrapolation, which simulate and plan say:
// ComputeCost::profile_coverage).
#pragma once

#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "sim/common/precision.hpp"

namespace dtsim::cost {

// The fastest GEMM rate a profile may hold, FLOP/s per device: 20x the catalog's fastest dense
// figure (B200's fp8, 4.5 PFLOP/s, NVIDIA's HGX B200 specifications), a sanity bound against
// timing errors (a sample of 2^60 FLOPs in a second priced a CPU step at half), not a model
// constant.
inline constexpr double kFastestGemmFlops = 1e17;
// The least rate a measured time may give (a GEMM's FLOP/s, an op's FLOP/s or bytes/s, a
// collective's bytes/s): 1 per second, below anything a device measures even for a small op on
// a busy host; a sanity bound against timing errors, not a model constant.
inline constexpr double kSlowestRate = 1;

struct GemmSample {
  double m = 0, n = 0, k = 0;
  double seconds = 0;
  double flops() const { return 2.0 * m * n * k; }
};

struct Profile {
  std::string device;
  std::string source;
  std::string file;
  Precision precision = Precision::Bf16;
  bool precision_stated = false;  // the file's "precision" (else bf16, said as a warning)
  // How many ranks measured at once on the calibrating host (dtexec calibrate under mpirun: they
  // shared its cores and memory bandwidth); 0 where the file does not say.
  std::int64_t ranks_per_host = 0;
  std::vector<GemmSample> gemm;  // sorted by FLOPs
  // Each measured size's FLOPs and throughput (the median of its layouts'), by FLOPs: what
  // gemm_seconds interpolates. Derived from `gemm` by index_sizes(), which load_profile calls.
  std::vector<std::pair<double, double>> sizes;
  void index_sizes();
  std::optional<double> memory_bw_bytes_per_s;
  std::optional<double> launch_overhead_s;
  // Coefficient of variation of compute time (engine/engine.hpp, stragglers).
  std::optional<double> jitter_cv;
  // The spread of the ranks' lasting speeds ("in_run": "rank_spread_cv"; engine/engine.hpp, a
  // slow rank).
  std::optional<double> rank_spread_cv;
  // Measured over predicted compute time in a training step, by phase (the "in_run" object).
  struct InRun {
    double forward = 1, backward = 1, optimizer = 1;
    // Whether the optimizer factor was measured against a prediction that prices the gradient
    // clear ("optimizer_prices_clear", dtexec calibrate since 2026-12). Before, the training
    // step's clear was inside the measured optimizer time but not in the prediction, so the
    // factor holds it: ComputeCost then leaves the clear unpriced instead of counting it twice.
    bool prices_clear = false;
    // Whether it was measured against a price of the mixed-precision step that reads the fp32
    // master again to write the 16-bit weights ("optimizer_prices_master_copy", dtexec
    // calibrate since 2026-12-04; ComputeCost::optimizer_seconds). Before, that read (4 of 34
    // bytes per parameter) was inside the measured time only, so the factor holds it.
    bool prices_master_copy = false;
  };
  std::optional<InRun> in_run;
  struct OpRate {
    double rate = 0;     // per second
    bool flops = false;  // FLOP/s (else bytes/s)
  };
  std::map<std::pair<std::string, std::string>, OpRate> ops;  // (op, phase) -> rate
  // A profile from before the loss's softmax statistics were an op of their own (dtexec
  // calibrate before 2026-12-03) timed the whole cross-entropy as the loss's forward: load_profile
  // splits that time evenly between the two ops, whose byte counts are equal (two passes over
  // the logits each), and sets this.
  bool loss_split_evenly = false;
  struct CollectiveSample {
    double bytes = 0, seconds = 0;
  };
  // (kind, ranks) -> samples sorted by bytes; the started ones ("started": true) apart
  std::map<std::pair<std::string, int>, std::vector<CollectiveSample>> collectives,
      started_collectives;
  // Seconds for a measured kind and group size; nullopt when the profile has none. `started`:
  // the started rows where the profile has that kind and group size started, else the others.
  std::optional<double> collective_seconds(const std::string& kind, int ranks, double bytes,
                                           bool started = false) const;
  // The largest size measured of a kind and group size (nullopt where none is): beyond it a
  // collective takes that size's throughput, an extrapolation that simulate says.
  std::optional<double> largest_collective_bytes(const std::string& kind, int ranks) const;

  // What a message says of its precision: "the profile was measured at bf16", or, for a file
  // without "precision", that it does not say (taken as bf16).
  std::string precision_said() const;
  // Seconds for a GEMM of `flops` FLOPs from the measured throughput.
  double gemm_seconds(double flops) const;
  // Seconds for the GEMM [m,k]x[k,n]: its measured time where the profile has that shape
  // (the fastest of its rows), else gemm_seconds of its FLOPs.
  double gemm_seconds(double m, double n, double k) const;
};

// Throws InputError naming the file and field.
Profile load_profile(const std::string& path);
// The same from parsed JSON (`file` names it in errors).
Profile profile_from_json(const nlohmann::json& j, const std::string& file);

}  // namespace dtsim::cost
