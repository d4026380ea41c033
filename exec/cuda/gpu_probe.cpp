#include "exec/cuda/gpu_probe.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

namespace dtsim::exec::cuda {

std::string nccl_version_string(int code) {
  if (code < 20900) return fmt::format("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100);
  return fmt::format("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100);
}

Probe probe() {
  Probe p;
  if (cudaRuntimeGetVersion(&p.cuda_runtime_version) != cudaSuccess) p.cuda_runtime_version = 0;
  if (cudaDriverGetVersion(&p.cuda_driver_version) != cudaSuccess) p.cuda_driver_version = 0;
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) p.nccl_version = nccl_version_string(nccl);
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
    if (const cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
      p.why_none = fmt::format("cudaGetDeviceProperties of GPU {}: {} (error {})", i,
                               cudaGetErrorString(e), static_cast<int>(e));
      continue;
    }
    p.gpus.push_back(GpuInfo{i, prop.name, static_cast<std::uint64_t>(prop.totalGlobalMem),
                             prop.multiProcessorCount, prop.major, prop.minor});
  }
  if (!p.gpus.empty()) p.why_none.clear();
  return p;
}

}  // namespace dtsim::exec::cuda
