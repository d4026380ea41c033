// dtexec calibrate --backend cpu: measures what the compute cost model needs on this host —
// fp32 GEMM times by shape (OpenBLAS), streaming memory bandwidth, and the fixed cost of a
// tiny kernel — and returns them as a calibration profile (sim/cost/profile.hpp format).
#pragma once

#include <nlohmann/json.hpp>

namespace dtsim::exec::cpu {

struct CalibrateOptions {
  int repeats = 3;     // best of N per measurement
  bool quick = false;  // fewer, smaller shapes (tests)
};

nlohmann::json calibrate(const CalibrateOptions& options);

}  // namespace dtsim::exec::cpu
