// Checks for CUDA, cuBLAS and NCCL results, shared by the .cu files of exec/cuda: a failure
// throws CudaError naming the call and the library's own description of the error. (No fmt in
// .cu files: nvcc 13 rejects fmt's compile-time format checks.)
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <string>

#include "exec/cuda/calibrate_cuda.hpp"  // CudaError, CudaOutOfMemory

namespace dtsim::exec::cuda {

inline void check(cudaError_t e, const char* call) {
  if (e != cudaSuccess) {
    std::string what = std::string(call) + ": " + cudaGetErrorString(e) + " (error " +
                       std::to_string(static_cast<int>(e)) + ")";
    if (e == cudaErrorMemoryAllocation) throw CudaOutOfMemory(what);
    throw CudaError(what);
  }
}

inline void check(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    throw CudaError(std::string(call) + ": " + cublasGetStatusString(s) + " (status " +
                    std::to_string(static_cast<int>(s)) + ")");
  }
}

inline void check(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) {
    throw CudaError(std::string(call) + ": " + ncclGetErrorString(r) + " (result " +
                    std::to_string(static_cast<int>(r)) + ")");
  }
}

// Where nothing may throw (a destructor, a release inside a step): a failed call is said on
// stderr, not lost; the next checked call meets a sticky error and ends the run.
inline void teardown(cudaError_t e, const char* call) noexcept {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "dtexec: warning: %s: %s (error %d)\n", call, cudaGetErrorString(e),
                 static_cast<int>(e));
  }
}
inline void teardown(cublasStatus_t s, const char* call) noexcept {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "dtexec: warning: %s: %s (status %d)\n", call, cublasGetStatusString(s),
                 static_cast<int>(s));
  }
}
inline void teardown(ncclResult_t r, const char* call) noexcept {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "dtexec: warning: %s: %s (result %d)\n", call, ncclGetErrorString(r),
                 static_cast<int>(r));
  }
}

}  // namespace dtsim::exec::cuda
