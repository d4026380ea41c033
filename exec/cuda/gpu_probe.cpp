#include "exec/cuda/gpu_probe.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

namespace dtsim::exec::cuda {

Probe probe() {
  Probe p;
  cudaRuntimeGetVersion(&p.cuda_runtime_version);
  if (cudaDriverGetVersion(&p.cuda_driver_version) != cudaSuccess) p.cuda_driver_version = 0;
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
    p.nccl_version = fmt::format("{}.{}.{}", nccl / 10000, (nccl % 10000) / 100, nccl % 100);
  }
  p.cublas_version =
      static_cast<int>(cublasGetProperty(MAJOR_VERSION, &p.cublas_version) == CUBLAS_STATUS_SUCCESS
                           ? p.cublas_version
                           : 0);
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    p.why_none = fmt::format("cudaGetDeviceCount: {} (error {})", cudaGetErrorString(err),
                             static_cast<int>(err));
    return p;
  }
  if (count == 0) p.why_none = "cudaGetDeviceCount: 0 devices";
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    p.gpus.push_back(GpuInfo{i, prop.name, static_cast<std::uint64_t>(prop.totalGlobalMem),
                             prop.multiProcessorCount, prop.major, prop.minor});
  }
  return p;
}

}  // namespace dtsim::exec::cuda
