// What the CUDA backend sees: the GPUs of this host, the CUDA/cuBLAS/NCCL versions, and a
// self-test kernel. Plain C++ interface: no CUDA types leak out of exec/cuda.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtsim::exec::cuda {

struct GpuInfo {
  int index = 0;
  std::string name;
  std::uint64_t memory_bytes = 0;
  int sm_count = 0;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
};

struct Probe {
  std::vector<GpuInfo> gpus;
  std::string why_none;          // set when gpus is empty: the CUDA error that said so
  int cuda_runtime_version = 0;  // 0 when cudaRuntimeGetVersion fails
  int cuda_driver_version = 0;   // 0 without a driver
  std::string nccl_version;      // "2.28.9"
  int cublas_version = 0;
};

// Never throws: a machine without a GPU is an expected outcome, reported in why_none.
Probe probe();

// "major.minor.patch" of an ncclGetVersion() code: major·10000 + minor·100 + patch since NCCL
// 2.9, major·1000 + minor·100 + patch before (nccl.h, NCCL_VERSION_CODE).
std::string nccl_version_string(int code);

// Runs a kernel on `gpu` that writes i*3+1 into n integers and checks them on the host.
// Returns an empty string on success, else what failed (CUDA call, error string).
std::string selftest(int gpu, int n = 1 << 20);

}  // namespace dtsim::exec::cuda
