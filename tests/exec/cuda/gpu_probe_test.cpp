#include "exec/cuda/gpu_probe.hpp"

#include <catch2/catch.hpp>
#include <iostream>

#include "exec/cuda/calibrate_cuda.hpp"

TEST_CASE("the CUDA backend links and reports its libraries", "[exec][cuda]") {
  const auto p = dtsim::exec::cuda::probe();
  CHECK(p.cuda_runtime_version > 0);
  CHECK_FALSE(p.nccl_version.empty());
}

TEST_CASE("NCCL version codes decode in both encodings", "[exec][cuda]") {
  using dtsim::exec::cuda::nccl_version_string;
  CHECK(nccl_version_string(22809) == "2.28.9");  // 2·10000 + 28·100 + 9 (NCCL >= 2.9)
  CHECK(nccl_version_string(20900) == "2.9.0");
  CHECK(nccl_version_string(2804) == "2.8.4");  // 2·1000 + 8·100 + 4 (NCCL < 2.9)
}

TEST_CASE("the self-test kernel runs on every GPU", "[exec][cuda][gpu]") {
  const auto p = dtsim::exec::cuda::probe();
  if (p.gpus.empty()) {
    // Catch2 v2 has no SKIP: say why and stop (the machine has no GPU; not a failure).
    WARN("skipped: no GPU on this machine (" << p.why_none << ")");
    return;
  }
  for (const auto& g : p.gpus) CHECK(dtsim::exec::cuda::selftest(g.index).empty());
}

TEST_CASE("the timed GEMM computes row-major C = A·B in bf16 and fp32", "[exec][cuda][gpu]") {
  const auto p = dtsim::exec::cuda::probe();
  if (p.gpus.empty()) {
    WARN("skipped: no GPU on this machine (" << p.why_none << ")");
    return;
  }
  using dtsim::exec::cuda::GemmPrecision;
  for (GemmPrecision precision : {GemmPrecision::Bf16, GemmPrecision::Fp32}) {
    CHECK(dtsim::exec::cuda::gemm_selftest(p.gpus.front().index, precision).empty());
  }
}
