// dtexec calibrate --backend cuda: what the compute cost model needs, measured on one GPU, and
// the collectives of NCCL over the ranks of an mpirun job (one GPU per rank). Plain C++
// interface: no CUDA types leak out of exec/cuda. Every CUDA, cuBLAS and NCCL call is checked;
// a failure throws CudaError naming the call.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "exec/core/timing_stats.hpp"

namespace dtsim::exec::cuda {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The one failure a caller may recover from: an allocation that found the GPU full
// (cudaErrorMemoryAllocation). The executor frees its cached buffers and tries once more;
// any other error (a launch failure, an illegal address) is not retried.
struct CudaOutOfMemory : CudaError {
  using CudaError::CudaError;
};

// GEMM precisions: bf16 inputs with fp32 accumulation (cublasGemmEx, CUBLAS_COMPUTE_32F), or
// fp32 throughout (CUBLAS_COMPUTE_32F_PEDANTIC: no TF32).
enum class GemmPrecision { Bf16, Fp32 };

struct GemmShape {
  int m = 0, n = 0, k = 0;
};

struct GemmTiming {
  GemmShape shape;
  double seconds = 0;  // median of the timed runs, CUDA events around each
};

struct DeviceTimings {
  std::vector<GemmTiming> gemm;
  double copy_bytes_per_s = 0;   // device-to-device copy: bytes read + written per second
  double launch_overhead_s = 0;  // an empty kernel, launched back to back
  // Robust spread of one GEMM's time over many runs: 1.4826 x median absolute deviation over
  // the median (the straggler model's jitter_cv).
  double jitter_cv = 0;
};

// Times `shapes` (C = A·B, row-major, m x k by k x n) and the other figures on `gpu`. Each
// measurement: one warm-up run, then `repeats` runs timed with CUDA events; the median counts.
DeviceTimings time_device(int gpu, GemmPrecision precision, const std::vector<GemmShape>& shapes,
                          int repeats);

// Checks the GEMM that time_device times: a small product (m 64, n 48, k 32, values exact in
// bf16 and in their fp32 sums) against the host's. Empty on success, else what differed.
std::string gemm_selftest(int gpu, GemmPrecision precision);

// The shapes of a calibration model's non-GEMM ops: one micro-batch of B sequences of S tokens,
// hidden C, vocabulary V, H query and G kv heads of D, MLP width F; no parallelism. The MLP's
// activation runs on activation_rows rows (0: B x S; a mixture of experts' on the top_k copies
// of each token, as the graph's first activation op that its rate is priced by).
struct OpShapes {
  int B = 1, S = 1, C = 1, V = 1, H = 1, G = 1, D = 1, F = 1;
  std::int64_t activation_rows = 0;
  bool rms = false, gelu = true, rope = false, learned_positions = true;
  double rope_theta = 10000;
  // Multi-head latent attention (Dn > 0): a head's query and key columns without and with
  // positions (D = Dn + Dr) and its values' width; the core then packs q, kv and the keys'
  // RoPE part (Kernels::mla_pack_forward) in place of RoPE's turn.
  int Dn = 0, Dr = 0, Dv = 0;
};

struct OpTimes {
  std::vector<OpTiming> ops;  // layernorm/rmsnorm, attention, gelu/swiglu, residual, embedding,
                              // loss_statistics, loss (exec/core/timing_stats.hpp)
  double adamw_s = 0;         // AdamW over adamw_params fp32 parameters
  std::int64_t adamw_params = 0;
};

// Times the executor's own GPU kernels (exec/cuda/kernels.hpp) for the non-GEMM ops at these
// shapes, forward and backward as `dtexec run` calls them, activations in bf16 or fp32; and
// AdamW over `adamw_params` fp32 parameters. Each figure: one warm-up run, then the median of
// `repeats` runs timed with CUDA events.
OpTimes time_ops(int gpu, GemmPrecision precision, const OpShapes& shapes, int repeats,
                 std::int64_t adamw_params);

// The GEMMs of a model's linear ops as `dtexec run` calls them (Kernels::matmul_forward and
// matmul_backward: activations in `precision`, the input gradient written whole as a step's
// first contribution to it is (matmul_input_grad), the weight gradient added into an fp32 one), in
// the order given. Each: one warm-up run, then the median of `repeats` runs timed with CUDA events.
std::vector<double> time_model_gemms(int gpu, GemmPrecision precision,
                                     const std::vector<ModelGemm>& gemms, int repeats);

struct CollectiveTiming {
  std::string
      kind;  // all_reduce, all_gather, reduce_scatter, all_to_all, send_recv (profile names)
  int ranks = 0;
  std::uint64_t bytes = 0;  // as nccl-tests count them
  double seconds = 0;       // median over the timed runs, the slowest rank's
};

// NCCL collectives over `ranks` ranks, this one `rank`, on `gpu`, bf16 elements, sizes from
// 1 KiB to max_bytes by factors of 4, over groups of 2, 4, ... consecutive ranks that divide
// the job (communicators split from the job's, every group at once) and over the job.
// `broadcast_id` sends the 128-byte ncclUniqueId from rank 0 to every rank (the caller's MPI);
// `max_over_ranks` returns the largest of a value over all ranks. send_recv runs between ranks 0
// and 1. Setting up the communicator, or measuring one collective at one size, for longer than
// `timeout_s` (0: no limit) ends the process with a message naming the rank, `host` and what hung
// (exit code 3); an asynchronous NCCL error throws CudaError.
std::vector<CollectiveTiming> time_collectives(
    int gpu, int rank, int ranks, std::uint64_t max_bytes, int repeats, double timeout_s,
    const std::string& host, const std::function<void(void* data, std::size_t bytes)>& broadcast_id,
    const std::function<double(double)>& max_over_ranks);

}  // namespace dtsim::exec::cuda
