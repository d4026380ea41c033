// dtexec calibrate --backend cuda: cuBLAS GEMMs, copy bandwidth, launch overhead and jitter on
// one GPU; NCCL collectives over the job's ranks. (No fmt here: nvcc 13 rejects fmt's
// compile-time format checks.)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "exec/core/deadline.hpp"
#include "exec/core/timing_stats.hpp"
#include "exec/cuda/calibrate_cuda.hpp"
#include "exec/cuda/check.cuh"

namespace dtsim::exec::cuda {

namespace {

using dtsim::exec::median;
using dtsim::exec::robust_cv;

// Device memory released on scope exit.
struct Buffer {
  void* p = nullptr;
  explicit Buffer(std::size_t bytes) {
    check(cudaMalloc(&p, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
  }
  ~Buffer() { teardown(cudaFree(p), "cudaFree"); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  Events() {
    check(cudaEventCreate(&start), "cudaEventCreate");
    check(cudaEventCreate(&stop), "cudaEventCreate");
  }
  ~Events() {
    teardown(cudaEventDestroy(start), "cudaEventDestroy");
    teardown(cudaEventDestroy(stop), "cudaEventDestroy");
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
  // Seconds between the two events, once `stop` has completed.
  double seconds() {
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return static_cast<double>(ms) * 1e-3;
  }
};

// Values in [-0.5, 0.5) from a hash of the index: the tensor cores see varied data, as in
// training (zeros draw less power and can run faster).
__global__ void fill_bf16(__nv_bfloat16* out, std::size_t n, unsigned seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    out[i] = __float2bfloat16(static_cast<float>(h & 0xffff) / 65536.0f - 0.5f);
  }
}

__global__ void fill_f32(float* out, std::size_t n, unsigned seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    out[i] = static_cast<float>(h & 0xffff) / 65536.0f - 0.5f;
  }
}

__global__ void empty_kernel() {}

void fill(void* p, std::size_t n, GemmPrecision precision, unsigned seed) {
  if (precision == GemmPrecision::Bf16) {
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  } else {
    fill_f32<<<1024, 256>>>(static_cast<float*>(p), n, seed);
  }
  check(cudaGetLastError(), "fill kernel launch");
}

class Gemm {
 public:
  explicit Gemm(GemmPrecision precision) : precision_(precision) {
    check(cublasCreate(&handle_), "cublasCreate");
  }
  ~Gemm() { teardown(cublasDestroy(handle_), "cublasDestroy"); }
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  // Row-major C (m x n) = A (m x k) · B (k x n), as column-major C^T = B^T · A^T.
  void run(const void* a, const void* b, void* c, const GemmShape& s) {
    const float alpha = 1.0f, beta = 0.0f;
    const bool bf16 = precision_ == GemmPrecision::Bf16;
    const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
    check(
        cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &alpha, b, type, s.n, a,
                     type, s.k, &beta, c, type, s.n,
                     bf16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx");
  }

 private:
  GemmPrecision precision_;
  cublasHandle_t handle_ = nullptr;
};

}  // namespace

std::string gemm_selftest(int gpu, GemmPrecision precision) {
  check(cudaSetDevice(gpu), "cudaSetDevice");
  const GemmShape s{64, 48, 32};
  // Small integers (exact in bf16); the sums stay below 2^24, exact in fp32.
  std::vector<float> a(static_cast<std::size_t>(s.m * s.k)), b(static_cast<std::size_t>(s.k * s.n));
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(static_cast<int>(i % 7) - 3);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(static_cast<int>(i % 5) - 2);
  const bool bf16 = precision == GemmPrecision::Bf16;
  const std::size_t elem = bf16 ? 2 : 4;
  auto upload = [&](const std::vector<float>& host, Buffer& dev) {
    if (bf16) {
      std::vector<__nv_bfloat16> h(host.size());
      for (std::size_t i = 0; i < host.size(); ++i) h[i] = __float2bfloat16(host[i]);
      check(cudaMemcpy(dev.p, h.data(), h.size() * elem, cudaMemcpyHostToDevice), "cudaMemcpy");
    } else {
      check(cudaMemcpy(dev.p, host.data(), host.size() * elem, cudaMemcpyHostToDevice),
            "cudaMemcpy");
    }
  };
  Buffer da(a.size() * elem), db(b.size() * elem), dc(static_cast<std::size_t>(s.m * s.n) * elem);
  upload(a, da);
  upload(b, db);
  Gemm gemm(precision);
  gemm.run(da.p, db.p, dc.p, s);
  std::vector<float> c(static_cast<std::size_t>(s.m * s.n));
  if (bf16) {
    std::vector<__nv_bfloat16> h(c.size());
    check(cudaMemcpy(h.data(), dc.p, h.size() * elem, cudaMemcpyDeviceToHost), "cudaMemcpy");
    for (std::size_t i = 0; i < c.size(); ++i) c[i] = __bfloat162float(h[i]);
  } else {
    check(cudaMemcpy(c.data(), dc.p, c.size() * elem, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }
  for (int i = 0; i < s.m; ++i) {
    for (int j = 0; j < s.n; ++j) {
      float want = 0;
      for (int k = 0; k < s.k; ++k) {
        want += a[static_cast<std::size_t>(i * s.k + k)] * b[static_cast<std::size_t>(k * s.n + j)];
      }
      // bf16 output: integers up to 256 are exact, larger ones within its 8-bit precision.
      const float got = c[static_cast<std::size_t>(i * s.n + j)];
      const float tolerance = bf16 ? std::abs(want) / 128.0f : 0.0f;
      if (std::abs(got - want) > tolerance) {
        return "C[" + std::to_string(i) + "][" + std::to_string(j) + "] = " + std::to_string(got) +
               ", expected " + std::to_string(want);
      }
    }
  }
  return "";
}

DeviceTimings time_device(int gpu, GemmPrecision precision, const std::vector<GemmShape>& shapes,
                          int repeats) {
  check(cudaSetDevice(gpu), "cudaSetDevice");
  const std::size_t elem = precision == GemmPrecision::Bf16 ? 2 : 4;
  DeviceTimings out;
  Gemm gemm(precision);
  Events ev;
  GemmShape biggest;
  for (const GemmShape& s : shapes) {
    const auto m = static_cast<std::size_t>(s.m), n = static_cast<std::size_t>(s.n),
               k = static_cast<std::size_t>(s.k);
    Buffer a(m * k * elem), b(k * n * elem), c(m * n * elem);
    fill(a.p, m * k, precision, 1);
    fill(b.p, k * n, precision, 2);
    gemm.run(a.p, b.p, c.p, s);
    std::vector<double> t;
    for (int r = 0; r < repeats; ++r) {
      check(cudaEventRecord(ev.start), "cudaEventRecord");
      gemm.run(a.p, b.p, c.p, s);
      check(cudaEventRecord(ev.stop), "cudaEventRecord");
      t.push_back(ev.seconds());
    }
    out.gemm.push_back({s, median(t)});
    if (2.0 * s.m * s.n * s.k > 2.0 * biggest.m * biggest.n * biggest.k) biggest = s;
  }

  // Jitter: the largest GEMM, many times.
  if (biggest.m > 0) {
    const auto m = static_cast<std::size_t>(biggest.m), n = static_cast<std::size_t>(biggest.n),
               k = static_cast<std::size_t>(biggest.k);
    Buffer a(m * k * elem), b(k * n * elem), c(m * n * elem);
    fill(a.p, m * k, precision, 3);
    fill(b.p, k * n, precision, 4);
    std::vector<double> t;
    for (int r = 0; r < std::max(60, 6 * repeats); ++r) {
      check(cudaEventRecord(ev.start), "cudaEventRecord");
      gemm.run(a.p, b.p, c.p, biggest);
      check(cudaEventRecord(ev.stop), "cudaEventRecord");
      t.push_back(ev.seconds());
    }
    out.jitter_cv = robust_cv(t);
  }

  // Device-to-device copy of 1 GiB: read and write.
  {
    const std::size_t bytes = std::size_t{1} << 30;
    Buffer src(bytes), dst(bytes);
    check(cudaMemset(src.p, 1, bytes), "cudaMemset");
    check(cudaMemcpy(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    std::vector<double> t;
    for (int r = 0; r < repeats; ++r) {
      check(cudaEventRecord(ev.start), "cudaEventRecord");
      check(cudaMemcpyAsync(dst.p, src.p, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
      check(cudaEventRecord(ev.stop), "cudaEventRecord");
      t.push_back(ev.seconds());
    }
    out.copy_bytes_per_s = 2.0 * static_cast<double>(bytes) / median(t);
  }

  // Launch overhead: 1000 empty kernels back to back.
  {
    constexpr int kLaunches = 1000;
    empty_kernel<<<1, 1>>>();
    check(cudaGetLastError(), "empty_kernel launch");
    std::vector<double> t;
    for (int r = 0; r < repeats; ++r) {
      check(cudaEventRecord(ev.start), "cudaEventRecord");
      for (int i = 0; i < kLaunches; ++i) empty_kernel<<<1, 1>>>();
      check(cudaGetLastError(), "empty_kernel launch");
      check(cudaEventRecord(ev.stop), "cudaEventRecord");
      t.push_back(ev.seconds() / kLaunches);
    }
    out.launch_overhead_s = median(t);
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  return out;
}

std::vector<CollectiveTiming> time_collectives(
    int gpu, int rank, int ranks, std::uint64_t max_bytes, int repeats, double timeout_s,
    const std::string& host, const std::function<void(void* data, std::size_t bytes)>& broadcast_id,
    const std::function<double(double)>& max_over_ranks) {
  std::vector<CollectiveTiming> out;
  if (ranks < 2) return out;
  const std::string who = "dtexec calibrate: rank " + std::to_string(rank) + " on " + host + ": ";
  std::ostringstream seconds;
  seconds << timeout_s;
  const std::string limit = " within " + seconds.str() +
                            " s (--collective-timeout): a peer failed, hangs or cannot be "
                            "reached; ending the job";
  check(cudaSetDevice(gpu), "cudaSetDevice");
  // The buffers outlive the communicator: on an error it is aborted before they are freed.
  Buffer send(max_bytes), recv(max_bytes);
  ncclComm_t comm = nullptr;
  {
    const Deadline setup(timeout_s, who + "the NCCL communicator was not set up" + limit);
    ncclUniqueId id;
    if (rank == 0) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    broadcast_id(&id, sizeof(id));
    check(ncclCommInitRank(&comm, ranks, id, rank), "ncclCommInitRank");
  }
  cudaStream_t stream = nullptr;
  // The stream's queued collectives on `c` done; a communicator's asynchronous error (a peer's
  // network failure, a timeout inside NCCL) thrown rather than waited through.
  auto finish = [&](ncclComm_t c) {
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) check(e, "cudaStreamQuery");
      (void)cudaGetLastError();  // not ready is no error
      ncclResult_t state = ncclSuccess;
      check(ncclCommGetAsyncError(c, &state), "ncclCommGetAsyncError");
      if (state != ncclSuccess && state != ncclInProgress) {
        check(state, "a collective (ncclCommGetAsyncError)");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  };
  std::vector<ncclComm_t> groups;  // split from `comm`; aborted or destroyed before it
  try {
    check(cudaStreamCreate(&stream), "cudaStreamCreate");
    check(cudaMemset(send.p, 0, max_bytes), "cudaMemset");
    Events ev;
    for (const int g : collective_group_sizes(ranks)) {
      ncclComm_t c = comm;
      if (g < ranks) {
        const Deadline split(timeout_s, who + "the NCCL communicators of groups of " +
                                            std::to_string(g) + " ranks were not split" + limit);
        check(ncclCommSplit(comm, rank / g, rank, &c, nullptr), "ncclCommSplit");
        groups.push_back(c);
      }
      const std::uint64_t unit = 2ull * static_cast<std::uint64_t>(g);  // bf16, split by ranks
      const auto parts = static_cast<std::size_t>(g);
      // A pipeline transfer between ranks 0 and 1 (the others idle), once.
      const bool whole = g == ranks;
      for (const char* kind :
           {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"}) {
        const std::string k = kind;
        if (k == "send_recv" && !whole) continue;
        for (std::uint64_t size = 1024; size <= max_bytes; size *= 4) {
          const std::uint64_t bytes = size / unit * unit;
          const std::size_t count = bytes / 2;
          const Deadline deadline(timeout_s, who + "the " + k + " of " + std::to_string(bytes) +
                                                 " bytes over " + std::to_string(g) +
                                                 " ranks did not finish" + limit);
          auto once = [&] {
            if (k == "all_reduce") {
              check(ncclAllReduce(send.p, recv.p, count, ncclBfloat16, ncclSum, c, stream),
                    "ncclAllReduce");
            } else if (k == "all_gather") {
              check(ncclAllGather(send.p, recv.p, count / parts, ncclBfloat16, c, stream),
                    "ncclAllGather");
            } else if (k == "reduce_scatter") {
              check(ncclReduceScatter(send.p, recv.p, count / parts, ncclBfloat16, ncclSum, c,
                                      stream),
                    "ncclReduceScatter");
            } else if (k == "all_to_all") {
              // Expert parallelism's exchange: a part to and from every rank, as grouped sends
              // and receives (the dispatcher's form; bytes: what a rank sends in all, as
              // nccl-tests' alltoall counts them).
              const std::size_t part = count / parts;
              check(ncclGroupStart(), "ncclGroupStart");
              for (int r = 0; r < g; ++r) {
                const std::size_t at = static_cast<std::size_t>(r) * part * 2;
                check(ncclSend(static_cast<char*>(send.p) + at, part, ncclBfloat16, r, c, stream),
                      "ncclSend");
                check(ncclRecv(static_cast<char*>(recv.p) + at, part, ncclBfloat16, r, c, stream),
                      "ncclRecv");
              }
              check(ncclGroupEnd(), "ncclGroupEnd");
            } else if (rank < 2) {
              check(ncclGroupStart(), "ncclGroupStart");
              check(ncclSend(send.p, count, ncclBfloat16, 1 - rank, c, stream), "ncclSend");
              check(ncclRecv(recv.p, count, ncclBfloat16, 1 - rank, c, stream), "ncclRecv");
              check(ncclGroupEnd(), "ncclGroupEnd");
            }
          };
          once();
          finish(c);
          std::vector<double> t;
          for (int r = 0; r < repeats; ++r) {
            check(cudaEventRecord(ev.start, stream), "cudaEventRecord");
            once();
            check(cudaEventRecord(ev.stop, stream), "cudaEventRecord");
            finish(c);
            t.push_back(ev.seconds());
          }
          const double slowest = max_over_ranks(median(t));
          out.push_back({k, k == "send_recv" ? 2 : g, bytes, slowest});
        }
      }
    }
  } catch (...) {
    for (auto it = groups.rbegin(); it != groups.rend(); ++it) {
      teardown(ncclCommAbort(*it), "ncclCommAbort");
    }
    teardown(ncclCommAbort(comm), "ncclCommAbort");
    if (stream != nullptr) teardown(cudaStreamDestroy(stream), "cudaStreamDestroy");
    throw;
  }
  for (auto it = groups.rbegin(); it != groups.rend(); ++it) {
    check(ncclCommDestroy(*it), "ncclCommDestroy");
  }
  check(ncclCommDestroy(comm), "ncclCommDestroy");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  return out;
}

}  // namespace dtsim::exec::cuda
