// What the kernel files of exec/cuda (kernels.cu, kernels_attention.cu, kernels_moe.cu,
// kernels_vocab.cu) share, and nothing outside them includes: the element loads and stores of
// either activation type, grid-stride loops and block reductions, the launch helpers,
// Kernels::Impl (the stream, cuBLAS and scratch behind exec/cuda/kernels.hpp) and the GEMM.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "exec/core/counter_hash.hpp"
#include "exec/cuda/check.cuh"
#include "exec/cuda/kernels.hpp"

namespace dtsim::exec::cuda {

namespace kernels_detail {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 256;      // threads per block (a multiple of the warp)
constexpr int kMaxBlocks = 65535;  // grid-stride loops cover the rest

__device__ __forceinline__ float load(const float* p, std::int64_t i) {
  return p[i];
}
__device__ __forceinline__ float load(const bf16* p, std::int64_t i) {
  return __bfloat162float(p[i]);
}
__device__ __forceinline__ void store(float* p, std::int64_t i, float v) {
  p[i] = v;
}
__device__ __forceinline__ void store(bf16* p, std::int64_t i, float v) {
  p[i] = __float2bfloat16(v);
}

__device__ __forceinline__ std::int64_t first_index() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::int64_t grid_stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

// Sum (or max) of one value per thread over the block, returned to every thread. The leading
// barrier lets a block call it several times in a row.
__device__ inline float block_sum(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) partial[0] = v;
  }
  __syncthreads();
  return partial[0];
}

__device__ inline float block_max(float v) {
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < (blockDim.x + 31) / 32 ? partial[threadIdx.x] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) partial[0] = v;
  }
  __syncthreads();
  return partial[0];
}

// The CPU's keep rule (exec/core/counter_hash.hpp): the GPU draws the CPU's masks.
__device__ __forceinline__ bool keeps(const Kernels::DropoutSite& d, std::int64_t sequence,
                                      std::uint64_t index) {
  return dropout_keeps(d.stream, d.rate, sequence, index);
}

inline unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(
      std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// Calls f with a null pointer of the activation type (float or bf16).
template <class F>
void with_type(Dtype t, F&& f) {
  if (t == Dtype::F32) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<bf16*>(nullptr));
  }
}

inline cudaDataType_t cuda_type(Dtype t) {
  return t == Dtype::F32 ? CUDA_R_32F : CUDA_R_16BF;
}

inline void launched(const char* kernel) {
  check(cudaGetLastError(), kernel);
}

// Row-major C = alpha · op(A) · op(B) + beta · C, `batch` times with the given element strides,
// as the column-major C^T = op(B)^T · op(A)^T that cuBLAS computes. M x N output, K inner; lda,
// ldb, ldc are row strides. bf16 inputs accumulate in fp32 on the tensor cores; fp32 inputs use
// the pedantic fp32 path (no TF32), so that fp32 runs check against the CPU reference.
struct Operand {
  const void* p;
  cudaDataType_t type;
  int ld;
  long long stride = 0;
};

void gemm(cublasHandle_t blas, bool ta, bool tb, int M, int N, int K, float alpha, Operand a,
          Operand b, float beta, void* c, cudaDataType_t ctype, int ldc, long long cstride,
          int batch = 1);

}  // namespace kernels_detail

struct Kernels::Impl {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  cudaMemPool_t pool = nullptr;  // the GPU's default pool (stream-ordered allocations)
  // Scratch, grown on demand in the stream's order (the old one is freed after the kernels
  // that used it): host transfers, attention scores and their gradients, column sums' chunks.
  DeviceBuffer staging, scores, dscores, partials;
  DeviceBuffer slots;          // mixture of experts: each copy's row (the inverse of the order)
  DeviceBuffer cp_kv, cp_dkv;  // context parallelism: one sequence's keys in position order
  // FlashAttention's memory: one sequence's probabilities, dropout mask and dropped
  // probabilities, made again in its backward (the runner keeps only the log-sum-exp); the
  // backward's scores again go where their gradient goes next (`scores`).
  DeviceBuffer flash_probs, flash_mask, flash_dropped;
  DeviceBuffer norm_partials;  // gradient clipping: the blocks' sums of squares (double)
  DeviceBuffer workspace;      // cuBLAS's, given at construction (no allocation at a first GEMM)
  std::vector<cudaEvent_t> events;  // mark() numbers [0, marks) in use
  int marks = 0;
  // What the owner frees when scratch cannot grow (set_out_of_memory): its pool's released
  // buffers, given back to the GPU.
  std::function<void()> out_of_memory;

  ~Impl() {
    // The scratch goes back on the stream, before the stream does; then the pool gives it to
    // the GPU (its release threshold keeps it otherwise, where cudaMalloc cannot reach it).
    for (DeviceBuffer* b : {&staging, &scores, &dscores, &partials, &slots, &cp_kv, &cp_dkv,
                            &flash_probs, &flash_mask, &flash_dropped, &norm_partials})
      *b = DeviceBuffer();
    for (cudaEvent_t e : events) teardown(cudaEventDestroy(e), "cudaEventDestroy");
    if (blas != nullptr) teardown(cublasDestroy(blas), "cublasDestroy");
    workspace = DeviceBuffer();
    if (stream != nullptr) {
      // (A kernel's failure not met by a checked call yet is said here.)
      teardown(cudaStreamSynchronize(stream), "cudaStreamSynchronize at the end");
      teardown(cudaStreamDestroy(stream), "cudaStreamDestroy");
    }
    if (pool != nullptr) teardown(cudaMemPoolTrimTo(pool, 0), "cudaMemPoolTrimTo");
  }

  // The stream of in-step allocations: this one, where the GPU has memory pools.
  void* allocation_stream() const { return pool != nullptr ? stream : nullptr; }

  // Scratch that grows inside a step, near the peak (a backward's score gradients): out of
  // memory, the owner gives its released buffers back and it is tried once more, as the
  // device's own allocations are.
  float* room(DeviceBuffer& b, std::size_t bytes) {
    if (b.bytes() >= bytes) return b.f32();
    try {
      b = DeviceBuffer(bytes, allocation_stream());
    } catch (const CudaOutOfMemory&) {
      if (!out_of_memory) throw;
      b = DeviceBuffer();  // (its contents are not kept in any case)
      out_of_memory();
      b = DeviceBuffer(bytes, allocation_stream());
    }
    return b.f32();
  }

  // FlashAttention's memory, one sequence of H·Q·S probabilities (Q queries, S keys) at a
  // time: where the probabilities and, with dropout, the dropped probabilities go, and in the
  // backward the mask (which the softmax's backward reads; the forward keeps none).
  struct FlashRooms {
    char* probs = nullptr;
    std::uint8_t* mask = nullptr;
    char* dropped = nullptr;
  };
  FlashRooms flash_rooms(std::size_t quad, std::size_t e, bool dropout, bool backward) {
    FlashRooms r;
    r.probs = reinterpret_cast<char*>(room(flash_probs, quad * e));
    if (dropout) {
      r.dropped = reinterpret_cast<char*>(room(flash_dropped, quad * e));
      if (backward) r.mask = reinterpret_cast<std::uint8_t*>(room(flash_mask, quad));
    }
    return r;
  }

  // What the attention backward of sequence b reads: the probabilities (made again into
  // `rooms` with FlashAttention's memory, else the forward's), the dropout mask (null without
  // dropout) and what the values were multiplied by (the dropped probabilities with dropout,
  // else the probabilities). quad: elements of one sequence's H x Sq x S tensors; e: bytes per
  // activation.
  struct BackwardInputs {
    const char* probs = nullptr;
    const std::uint8_t* mask = nullptr;
    const char* weights = nullptr;
    bool dropout = false;
  };
  static BackwardInputs backward_inputs(bool flash, const FlashRooms& rooms, bool flash_dropout,
                                        const void* probs, const std::uint8_t* mask,
                                        const void* dropped, int b, std::size_t quad,
                                        std::size_t e) {
    BackwardInputs in;
    const std::size_t at = static_cast<std::size_t>(b) * quad;
    in.probs = flash ? rooms.probs : static_cast<const char*>(probs) + at * e;
    in.dropout = flash ? flash_dropout : mask != nullptr;
    if (!in.dropout) {
      in.weights = in.probs;
    } else if (flash) {
      in.mask = rooms.mask;
      in.weights = rooms.dropped;
    } else {
      in.mask = mask + at;
      in.weights = static_cast<const char*>(dropped) + at * e;
    }
    return in;
  }

  // Two column sums' chunk partials of N columns (row_chunks: at most max(65536, N) floats
  // each), sized once for every N up to 65536, so that no step waits on a reallocation.
  float* partials_room(int N) {
    return room(partials, 2 * static_cast<std::size_t>(std::max(N, 65536)) * sizeof(float));
  }
};

}  // namespace dtsim::exec::cuda
