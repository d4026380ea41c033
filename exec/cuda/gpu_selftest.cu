// A self-test kernel: proves that the code nvcc built runs on this GPU and that device memory
// round-trips. Values are integers so the check is exact.
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "exec/cuda/gpu_probe.hpp"

namespace dtsim::exec::cuda {

namespace {

__global__ void fill_affine(int* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = 3 * i + 1;
}

std::string failed(const char* call, cudaError_t err) {
  // (no fmt here: nvcc 13 rejects fmt's compile-time format checks)
  return std::string(call) + ": " + cudaGetErrorString(err) + " (error " +
         std::to_string(static_cast<int>(err)) + ")";
}

}  // namespace

std::string selftest(int gpu, int n) {
  if (cudaError_t e = cudaSetDevice(gpu); e != cudaSuccess) return failed("cudaSetDevice", e);
  int* d = nullptr;
  if (cudaError_t e = cudaMalloc(&d, sizeof(int) * static_cast<size_t>(n)); e != cudaSuccess) {
    return failed("cudaMalloc", e);
  }
  constexpr int kThreads = 256;
  fill_affine<<<(n + kThreads - 1) / kThreads, kThreads>>>(d, n);
  std::string result;
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    result = failed("fill_affine launch", e);
  std::vector<int> host(static_cast<size_t>(n));
  if (result.empty()) {
    if (cudaError_t e =
            cudaMemcpy(host.data(), d, sizeof(int) * host.size(), cudaMemcpyDeviceToHost);
        e != cudaSuccess) {
      result = failed("cudaMemcpy", e);
    }
  }
  for (int i = 0; result.empty() && i < n; ++i) {
    if (host[static_cast<size_t>(i)] != 3 * i + 1) {
      result = "element " + std::to_string(i) + ": got " +
               std::to_string(host[static_cast<size_t>(i)]) + ", expected " +
               std::to_string(3 * i + 1);
    }
  }
  if (cudaError_t e = cudaFree(d); e != cudaSuccess && result.empty()) {
    result = failed("cudaFree", e);
  }
  return result;
}

}  // namespace dtsim::exec::cuda
