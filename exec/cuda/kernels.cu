// The GPU kernels of exec/cuda/kernels.hpp. Each kernel mirrors its CPU reference in
// exec/cpu/kernels.cpp (same formulas, same order of the terms where the result depends on it);
// the activation type T is float or __nv_bfloat16, loaded to and computed in fp32.
//
// This file: the device buffers and the stream, host transfers, the GEMM, linear layers,
// norms, element-wise ops, dropout and the optimizer. Attention, context parallelism and
// rotary positions are in kernels_attention.cu, the mixture of experts in kernels_moe.cu,
// the embedding and the cross-entropy in kernels_vocab.cu; what they share in
// kernels_common.cuh.

#include <type_traits>
#include <utility>

#include "exec/cuda/kernels_common.cuh"

namespace dtsim::exec::cuda {

namespace kernels_detail {

void gemm(cublasHandle_t blas, bool ta, bool tb, int M, int N, int K, float alpha, Operand a,
          Operand b, float beta, void* c, cudaDataType_t ctype, int ldc, long long cstride,
          int batch) {
  const cublasComputeType_t compute =
      a.type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  check(cublasGemmStridedBatchedEx(blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, b.p, b.type,
                                   b.ld, b.stride, a.p, a.type, a.ld, a.stride, &beta, c, ctype,
                                   ldc, cstride, batch, compute, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx");
}

}  // namespace kernels_detail

using namespace kernels_detail;  // the helpers of kernels_common.cuh

namespace {

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kNormEps = 1e-5f;

// ---- element-wise ---------------------------------------------------------------------------

template <class T>
__global__ void cast_kernel(T* out, const float* in, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) store(out, i, in[i]);
}

template <class T>
__global__ void fill_random_kernel(T* out, std::int64_t n, unsigned seed, float scale) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    unsigned h = static_cast<unsigned>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 0x2c1b3c6du;
    h ^= h >> 12;
    store(out, i, scale * (static_cast<float>(h & 0xffffu) / 65536.0f - 0.5f));
  }
}

template <class T>
__global__ void widen_kernel(float* out, const T* in, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) out[i] = load(in, i);
}

template <class T>
__global__ void add_kernel(T* out, const T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride())
    store(out, i, load(a, i) + load(b, i));
}

template <class T>
__global__ void accumulate_kernel(T* d, const T* x, std::int64_t n, float scale) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride())
    store(d, i, load(d, i) + scale * load(x, i));
}

// out[0] = mean of in[n]: one block; each thread sums a fixed stride, then the block's sum.
__global__ void mean_kernel(float* out, const float* in, std::int64_t n) {
  float s = 0;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) s += in[i];
  s = block_sum(s);
  if (threadIdx.x == 0) out[0] = n > 0 ? s / static_cast<float>(n) : 0.0f;
}

template <class T>
__global__ void gelu_forward_kernel(T* out, const T* in, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const float x = load(in, i);
    store(out, i, 0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x))));
  }
}

template <class T>
__global__ void gelu_backward_kernel(T* din, const T* in, const T* dout, std::int64_t n) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const float x = load(in, i);
    const float th = tanhf(kGeluScale * (x + 0.044715f * x * x * x));
    const float du = kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    const float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
    store(din, i, grad * load(dout, i));
  }
}

// in[T, 2F] = [gate | up] -> out[T, F] = silu(gate) · up.
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* in, std::int64_t T_, int F) {
  const std::int64_t n = T_ * F;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const std::int64_t t = i / F, f = i % F;
    const float g = load(in, t * 2 * F + f), u = load(in, t * 2 * F + F + f);
    store(out, i, g / (1.0f + expf(-g)) * u);
  }
}

template <class T>
__global__ void swiglu_backward_kernel(T* din, const T* in, const T* dout, std::int64_t T_, int F) {
  const std::int64_t n = T_ * F;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const std::int64_t t = i / F, f = i % F;
    const std::int64_t gi = t * 2 * F + f, ui = gi + F;
    const float g = load(in, gi), u = load(in, ui);
    const float sig = 1.0f / (1.0f + expf(-g));
    const float dy = load(dout, i);
    store(din, ui, dy * g * sig);
    store(din, gi, dy * u * (sig + g * sig * (1.0f - sig)));
  }
}

// out[t, n] += bias[n].
template <class T>
__global__ void add_bias_kernel(T* out, const float* bias, std::int64_t T_, int N) {
  const std::int64_t n = T_ * N;
  for (std::int64_t i = first_index(); i < n; i += grid_stride())
    store(out, i, load(out, i) + bias[i % N]);
}

// Column sums of a [T, N] matrix (bias and norm weight gradients) in two passes that give the
// same bits however the grid runs: pass 1, one thread per (chunk of rows, column), sums its
// chunk's rows in order; pass 2, one thread per column, adds the chunks' sums in order. A thread
// per column alone would leave most of the GPU idle (GPT-2's 768 columns: 3 blocks).
struct RowChunks {
  int count = 1;  // chunks
  int rows = 1;   // rows per chunk (the last one may have fewer)
};

// About 64k threads in pass 1, at least 32 rows a chunk: count·N <= max(65536, N).
RowChunks row_chunks(int T, int N) {
  const std::int64_t by_threads = std::max<std::int64_t>(1, 65536 / std::max(N, 1));
  const std::int64_t by_rows = std::max<std::int64_t>(1, (T + 31) / 32);
  const std::int64_t want = std::min(by_threads, by_rows);
  RowChunks c;
  c.rows = static_cast<int>(std::max<std::int64_t>(1, (T + want - 1) / want));
  c.count = std::max(1, (T + c.rows - 1) / c.rows);
  return c;
}

// Pass 1's element i of chunks.count x N: column c, rows [t0, t1) of chunk i / N.
struct ChunkCell {
  std::int64_t c, t0, t1;
};
__device__ __forceinline__ ChunkCell chunk_cell(std::int64_t i, int N, int T_, RowChunks chunks) {
  const std::int64_t t0 = i / N * chunks.rows;
  return {i % N, t0, t0 + chunks.rows < T_ ? t0 + chunks.rows : T_};
}

// Pass 1 of a bias gradient: partial[k, n] = sum over the rows of chunk k of dout[t, n].
template <class T>
__global__ void column_partial_kernel(float* partial, const T* dout, int T_, int N,
                                      RowChunks chunks) {
  const std::int64_t n = static_cast<std::int64_t>(chunks.count) * N;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const ChunkCell cell = chunk_cell(i, N, T_, chunks);
    float s = 0;
    for (std::int64_t t = cell.t0; t < cell.t1; ++t) s += load(dout, t * N + cell.c);
    partial[i] = s;
  }
}

// Pass 2: out[n] += sum over k of partial[k, n], k in order.
__global__ void add_partials_kernel(float* out, const float* partial, int count, int N) {
  for (std::int64_t c = first_index(); c < N; c += grid_stride()) {
    float s = 0;
    for (int k = 0; k < count; ++k) s += partial[static_cast<std::int64_t>(k) * N + c];
    out[c] += s;
  }
}

// ---- norms ----------------------------------------------------------------------------------

// One block per row.
template <class T>
__global__ void norm_forward_kernel(T* out, float* mean, float* rstd, const T* in, const float* w,
                                    const float* b, int C, bool rms) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * C;
  float mu = 0;
  if (!rms) {
    float s = 0;
    for (int c = threadIdx.x; c < C; c += blockDim.x) s += load(in, row + c);
    mu = block_sum(s) / static_cast<float>(C);
  }
  float s2 = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = load(in, row + c) - mu;
    s2 += d * d;
  }
  const float r = 1.0f / sqrtf(block_sum(s2) / static_cast<float>(C) + kNormEps);
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    store(out, row + c, (load(in, row + c) - mu) * r * w[c] + (b ? b[c] : 0.0f));
  }
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = mu;
    rstd[blockIdx.x] = r;
  }
}

// The input gradient, one block per row:
// dx += r (dy w - mean(dy w) - xhat mean(dy w xhat)) (RMSNorm: no mean(dy w) term).
template <class T>
__global__ void norm_backward_input_kernel(T* din, const T* dout, const T* in, const float* w,
                                           const float* mean, const float* rstd, int C, bool rms) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * C;
  const float mu = mean[blockIdx.x], r = rstd[blockIdx.x];
  float sum_d = 0, sum_dx = 0;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float xhat = (load(in, row + c) - mu) * r;
    const float d = load(dout, row + c) * w[c];
    sum_d += d;
    sum_dx += d * xhat;
  }
  sum_d = block_sum(sum_d);
  sum_dx = block_sum(sum_dx);
  const float mean_d = rms ? 0.0f : sum_d / static_cast<float>(C);
  const float mean_dx = sum_dx / static_cast<float>(C);
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    const float xhat = (load(in, row + c) - mu) * r;
    store(din, row + c,
          load(din, row + c) + r * (load(dout, row + c) * w[c] - mean_d - xhat * mean_dx));
  }
}

// Pass 1 of the weight and bias gradients (column sums, as the bias gradient's):
// pw[k, c] = sum over chunk k's rows of dy·xhat, pb[k, c] = sum of dy.
template <class T>
__global__ void norm_weight_partial_kernel(float* pw, float* pb, const T* dout, const T* in,
                                           const float* mean, const float* rstd, int T_, int C,
                                           RowChunks chunks) {
  const std::int64_t n = static_cast<std::int64_t>(chunks.count) * C;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const ChunkCell cell = chunk_cell(i, C, T_, chunks);
    float sw = 0, sb = 0;
    for (std::int64_t t = cell.t0; t < cell.t1; ++t) {
      const float dy = load(dout, t * C + cell.c);
      sw += dy * (load(in, t * C + cell.c) - mean[t]) * rstd[t];
      sb += dy;
    }
    pw[i] = sw;
    pb[i] = sb;
  }
}

// ---- dropout --------------------------------------------------------------------------------

// One thread per element of rows [T, C].
template <class T>
__global__ void dropout_kernel(T* out, std::uint8_t* mask, const T* in, const T* skip,
                               std::int64_t n, int C, Kernels::DropoutSite d) {
  const float keep_scale = 1.0f / (1.0f - d.rate);
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t row = d.first_row + e / C;
    const auto c = static_cast<std::uint64_t>(e % C);
    const std::int64_t s = row % d.Sq;
    const std::int64_t position = d.positions != nullptr ? d.positions[s] : s;
    const bool keep =
        keeps(d, d.first_sequence + row / d.Sq,
              static_cast<std::uint64_t>(position) * static_cast<std::uint64_t>(C) + c);
    mask[e] = keep ? 1 : 0;
    float y = keep ? load(in, e) * keep_scale : 0.0f;
    if (skip != nullptr) y += load(skip, e);
    store(out, e, y);
  }
}

template <class T>
__global__ void dropout_backward_kernel(T* din, const std::uint8_t* mask, const T* dout,
                                        std::int64_t n, float keep_scale) {
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    if (mask[e]) store(din, e, load(din, e) + load(dout, e) * keep_scale);
  }
}

// ---- optimizer ------------------------------------------------------------------------------

__global__ void adamw_kernel(float* params, const float* grads, float* m, float* v, std::int64_t n,
                             float lr, float beta1, float beta2, float eps, float weight_decay,
                             float c1, float c2) {
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const float g = grads[i];
    m[i] = beta1 * m[i] + (1 - beta1) * g;
    v[i] = beta2 * v[i] + (1 - beta2) * g * g;
    const float mhat = m[i] / c1, vhat = v[i] / c2;
    params[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * params[i]);
  }
}

// Gradient clipping. A fixed grid (kNormBlocks x kThreads, whatever n): each block's threads
// sum a strided share in double, the block reduces them in shared memory in a fixed tree, and
// one block then adds the blocks' sums in order into acc: deterministic, unlike atomics.
constexpr int kNormBlocks = 256;

__global__ void sum_squares_blocks_kernel(double* partial, const float* x, std::int64_t n) {
  __shared__ double s[kThreads];
  double t = 0;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const double v = x[i];
    t += v * v;
  }
  s[threadIdx.x] = t;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) s[threadIdx.x] += s[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

__global__ void sum_squares_total_kernel(float* acc, const double* partial, int blocks) {
  double t = 0;
  for (int b = 0; b < blocks; ++b) t += partial[b];
  acc[0] += static_cast<float>(t);
}

__global__ void clip_scale_kernel(float* x, std::int64_t n, const float* norm_sq, float max_norm) {
  // Megatron-LM's coefficient, as the CPU's: max_norm / (norm + 1e-6) when below 1.
  const double coeff =
      static_cast<double>(max_norm) / (sqrt(static_cast<double>(norm_sq[0])) + 1e-6);
  if (!(coeff < 1.0)) return;
  const auto c = static_cast<float>(coeff);
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) x[i] *= c;
}

}  // namespace

// ---- DeviceBuffer ---------------------------------------------------------------------------

DeviceBuffer::DeviceBuffer(std::size_t bytes, void* stream) : bytes_(bytes), stream_(stream) {
  const std::size_t size = std::max<std::size_t>(bytes, 16);
  const cudaError_t e = stream != nullptr
                            ? cudaMallocAsync(&p_, size, static_cast<cudaStream_t>(stream))
                            : cudaMalloc(&p_, size);
  if (e != cudaSuccess) {
    // An allocation failure is also the runtime's "last error": clear it, so that the next
    // kernel launch's check does not report it again (the caller may free memory and retry).
    p_ = nullptr;
    int device = -1;
    (void)cudaGetDevice(&device);
    cudaGetLastError();
    check(e, (std::string(stream != nullptr ? "cudaMallocAsync" : "cudaMalloc") + " of " +
              std::to_string(bytes) + " bytes on GPU " + std::to_string(device))
                 .c_str());
  }
}

DeviceBuffer::~DeviceBuffer() {
  free();
}

void DeviceBuffer::free() noexcept {
  if (p_ == nullptr) return;
  if (stream_ != nullptr) {
    teardown(cudaFreeAsync(p_, static_cast<cudaStream_t>(stream_)), "cudaFreeAsync");
  } else {
    teardown(cudaFree(p_), "cudaFree");
  }
  p_ = nullptr;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : p_(std::exchange(other.p_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      stream_(std::exchange(other.stream_, nullptr)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    free();
    p_ = std::exchange(other.p_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ = std::exchange(other.stream_, nullptr);
  }
  return *this;
}

// ---- Kernels --------------------------------------------------------------------------------

void* Kernels::stream() const {
  return impl_->stream;
}

Kernels::Kernels(int gpu, Dtype activations) : impl_(std::make_unique<Impl>()), act_(activations) {
  check(cudaSetDevice(gpu), "cudaSetDevice");
  check(cudaStreamCreate(&impl_->stream), "cudaStreamCreate");
  check(cublasCreate(&impl_->blas), "cublasCreate");
  check(cublasSetStream(impl_->blas, impl_->stream), "cublasSetStream");
  // cuBLAS's workspace, made here rather than by cuBLAS at its first GEMM inside a step (after
  // cublasSetStream, which resets it): 32 MiB, the size cuBLAS's documentation recommends for
  // Hopper (cublasSetWorkspace; 4 MiB would do before it).
  impl_->workspace = DeviceBuffer(std::size_t{32} << 20);
  check(cublasSetWorkspace(impl_->blas, impl_->workspace.get(), impl_->workspace.bytes()),
        "cublasSetWorkspace");
  // Stream-ordered allocations (DeviceBuffer with a stream) come from the GPU's default pool;
  // with its default release threshold (0) it would give memory back at every synchronization
  // and map it again at the next allocation. A GPU without memory pools (some virtual GPUs)
  // gets plain cudaMalloc and cudaFree (allocation_stream() is null).
  int pools = 0;
  check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, gpu),
        "cudaDeviceGetAttribute(cudaDevAttrMemoryPoolsSupported)");
  if (pools == 0) return;
  cudaMemPool_t pool = nullptr;
  check(cudaDeviceGetDefaultMemPool(&pool, gpu), "cudaDeviceGetDefaultMemPool");
  std::uint64_t keep = std::numeric_limits<std::uint64_t>::max();
  check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
        "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)");
  impl_->pool = pool;
}

Kernels::~Kernels() = default;

void Kernels::synchronize() {
  check(cudaStreamSynchronize(impl_->stream), "cudaStreamSynchronize");
}

void Kernels::return_free_memory() {
  synchronize();
  if (impl_->pool == nullptr) return;
  check(cudaMemPoolTrimTo(impl_->pool, 0), "cudaMemPoolTrimTo");
}

void* Kernels::allocation_stream() const {
  return impl_->allocation_stream();
}

void Kernels::set_out_of_memory(std::function<void()> free_released) {
  impl_->out_of_memory = std::move(free_released);
}

int Kernels::mark(void* stream) {
  if (static_cast<std::size_t>(impl_->marks) == impl_->events.size()) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreate(&e), "cudaEventCreate");
    impl_->events.push_back(e);
  }
  check(cudaEventRecord(impl_->events[static_cast<std::size_t>(impl_->marks)],
                        stream != nullptr ? static_cast<cudaStream_t>(stream) : impl_->stream),
        "cudaEventRecord");
  return impl_->marks++;
}

double Kernels::seconds(int a, int b) {
  if (a < 0 || b < 0 || a >= impl_->marks || b >= impl_->marks) {
    throw CudaError("Kernels::seconds: no such mark");
  }
  cudaEvent_t end = impl_->events[static_cast<std::size_t>(b)];
  check(cudaEventSynchronize(end), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, impl_->events[static_cast<std::size_t>(a)], end),
        "cudaEventElapsedTime");
  return static_cast<double>(ms) * 1e-3;
}

void Kernels::clear_marks() {
  impl_->marks = 0;
}

void Kernels::upload_f32(float* dst, const float* host, std::int64_t n) {
  check(cudaMemcpyAsync(dst, host, static_cast<std::size_t>(n) * 4, cudaMemcpyHostToDevice,
                        impl_->stream),
        "cudaMemcpyAsync (to the GPU)");
  synchronize();  // the host buffer may go away when this returns
}

void Kernels::upload_i32(int* dst, const int* host, std::int64_t n) {
  check(cudaMemcpyAsync(dst, host, static_cast<std::size_t>(n) * 4, cudaMemcpyHostToDevice,
                        impl_->stream),
        "cudaMemcpyAsync (to the GPU)");
  synchronize();
}

void Kernels::upload(void* dst, const float* host, std::int64_t n) {
  if (act_ == Dtype::F32) {
    upload_f32(static_cast<float*>(dst), host, n);
    return;
  }
  float* staged = impl_->room(impl_->staging, static_cast<std::size_t>(n) * 4);
  upload_f32(staged, host, n);
  cast(dst, staged, n);
}

void Kernels::download_f32(float* host, const float* src, std::int64_t n) {
  check(cudaMemcpyAsync(host, src, static_cast<std::size_t>(n) * 4, cudaMemcpyDeviceToHost,
                        impl_->stream),
        "cudaMemcpyAsync (from the GPU)");
  synchronize();
}

void Kernels::download_bytes(void* host, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, impl_->stream),
        "cudaMemcpyAsync (from the GPU)");
  synchronize();
}

void Kernels::download(float* host, const void* src, std::int64_t n) {
  if (act_ == Dtype::F32) {
    download_f32(host, static_cast<const float*>(src), n);
    return;
  }
  float* staged = impl_->room(impl_->staging, static_cast<std::size_t>(n) * 4);
  widen_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(staged, static_cast<const bf16*>(src),
                                                              n);
  launched("widen_kernel");
  download_f32(host, staged, n);
}

void Kernels::copy(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, impl_->stream),
        "cudaMemcpyAsync (on the GPU)");
}

void Kernels::zero(void* dst, std::size_t bytes) {
  fill_bytes(dst, bytes, 0);
}

void Kernels::fill_bytes(void* dst, std::size_t bytes, unsigned char value) {
  check(cudaMemsetAsync(dst, value, bytes, impl_->stream), "cudaMemsetAsync");
}

void Kernels::fill_random(void* dst, std::int64_t n, unsigned seed, float scale) {
  with_type(act_, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fill_random_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(static_cast<T*>(dst), n, seed,
                                                                      scale);
  });
  launched("fill_random_kernel");
}

void Kernels::fill_random_f32(float* dst, std::int64_t n, unsigned seed, float scale) {
  fill_random_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(dst, n, seed, scale);
  launched("fill_random_kernel");
}

void Kernels::cast(void* out, const float* in, std::int64_t n) {
  with_type(act_, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    cast_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(static_cast<T*>(out), in, n);
  });
  launched("cast_kernel");
}

void Kernels::matmul_forward(void* out, const void* in, const void* w, const float* bias, int T,
                             int K, int N, bool w_transposed) {
  const cudaDataType_t t = cuda_type(act_);
  // w is [K,N], or [N,K] read transposed.
  gemm(impl_->blas, false, w_transposed, T, N, K, 1.0f, {in, t, K}, {w, t, w_transposed ? K : N},
       0.0f, out, t, N, 0);
  if (bias != nullptr) {
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      add_bias_kernel<<<blocks_for(static_cast<std::int64_t>(T) * N), kThreads, 0, impl_->stream>>>(
          static_cast<A*>(out), bias, T, N);
    });
    launched("add_bias_kernel");
  }
}

void Kernels::matmul_input_grad(void* din, const void* dout, const void* w, int T, int K, int N,
                                bool w_transposed) {
  input_grad(din, dout, w, T, K, N, w_transposed, 0.0f);
}

// din[T,K] = dout[T,N] · w^T + beta · din: w [N,K] when transposed, else [K,N].
void Kernels::input_grad(void* din, const void* dout, const void* w, int T, int K, int N,
                         bool w_transposed, float beta) {
  const cudaDataType_t t = cuda_type(act_);
  gemm(impl_->blas, false, !w_transposed, T, K, N, 1.0f, {dout, t, N}, {w, t, w_transposed ? K : N},
       beta, din, t, K, 0);
}

void Kernels::matmul_backward(void* din, float* dw, float* dbias, const void* dout, const void* in,
                              const void* w, int T, int K, int N, bool w_transposed) {
  const cudaDataType_t t = cuda_type(act_);
  if (din != nullptr) input_grad(din, dout, w, T, K, N, w_transposed, 1.0f);
  if (dw != nullptr && w_transposed) {  // dw[N,K] += dout[T,N]^T · in[T,K], in fp32
    gemm(impl_->blas, true, false, N, K, T, 1.0f, {dout, t, N}, {in, t, K}, 1.0f, dw, CUDA_R_32F, K,
         0);
  } else if (dw != nullptr) {  // dw[K,N] += in[T,K]^T · dout[T,N], in fp32
    gemm(impl_->blas, true, false, K, N, T, 1.0f, {in, t, K}, {dout, t, N}, 1.0f, dw, CUDA_R_32F, N,
         0);
  }
  if (dbias != nullptr && T > 0 && N > 0) {
    const RowChunks chunks = row_chunks(T, N);
    float* partial = impl_->partials_room(N);
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      column_partial_kernel<<<blocks_for(static_cast<std::int64_t>(chunks.count) * N), kThreads, 0,
                              impl_->stream>>>(partial, static_cast<const A*>(dout), T, N, chunks);
    });
    launched("column_partial_kernel");
    add_partials_kernel<<<blocks_for(N), kThreads, 0, impl_->stream>>>(dbias, partial, chunks.count,
                                                                       N);
    launched("add_partials_kernel");
  }
}

void Kernels::norm_forward(void* out, float* mean, float* rstd, const void* in, const float* w,
                           const float* b, int T, int C, bool rms) {
  if (T == 0 || C == 0) return;  // (a grid of no blocks is a launch error)
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    norm_forward_kernel<<<T, kThreads, 0, impl_->stream>>>(static_cast<A*>(out), mean, rstd,
                                                           static_cast<const A*>(in), w, b, C, rms);
  });
  launched("norm_forward_kernel");
}

void Kernels::norm_backward(void* din, float* dw, float* db, const void* dout, const void* in,
                            const float* w, const float* mean, const float* rstd, int T, int C,
                            bool rms) {
  if (T == 0 || C == 0) return;  // (a grid of no blocks is a launch error)
  const RowChunks chunks = row_chunks(T, C);
  const std::size_t part = static_cast<std::size_t>(chunks.count) * C;
  float* pw = dw != nullptr || db != nullptr ? impl_->partials_room(C) : nullptr;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    if (pw != nullptr) {
      norm_weight_partial_kernel<<<blocks_for(static_cast<std::int64_t>(part)), kThreads, 0,
                                   impl_->stream>>>(pw, pw + part, static_cast<const A*>(dout),
                                                    static_cast<const A*>(in), mean, rstd, T, C,
                                                    chunks);
    }
    if (din != nullptr) {
      norm_backward_input_kernel<<<T, kThreads, 0, impl_->stream>>>(
          static_cast<A*>(din), static_cast<const A*>(dout), static_cast<const A*>(in), w, mean,
          rstd, C, rms);
    }
  });
  if (dw != nullptr) {
    add_partials_kernel<<<blocks_for(C), kThreads, 0, impl_->stream>>>(dw, pw, chunks.count, C);
  }
  if (db != nullptr) {
    add_partials_kernel<<<blocks_for(C), kThreads, 0, impl_->stream>>>(db, pw + part, chunks.count,
                                                                       C);
  }
  launched("norm_backward kernels");
}

void Kernels::add_forward(void* out, const void* a, const void* b, std::int64_t n) {
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    add_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(out), static_cast<const A*>(a), static_cast<const A*>(b), n);
  });
  launched("add_kernel");
}

void Kernels::accumulate(void* d, const void* dout, std::int64_t n, float scale) {
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    accumulate_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(d), static_cast<const A*>(dout), n, scale);
  });
  launched("accumulate_kernel");
}

void Kernels::accumulate_f32(float* d, const float* x, std::int64_t n, float scale) {
  accumulate_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(d, x, n, scale);
  launched("accumulate_kernel");
}

void Kernels::mean(float* out, const float* in, std::int64_t n) {
  mean_kernel<<<1, kThreads, 0, impl_->stream>>>(out, in, n);
  launched("mean_kernel");
}

void Kernels::gelu_forward(void* out, const void* in, std::int64_t n) {
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    gelu_forward_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(out), static_cast<const A*>(in), n);
  });
  launched("gelu_forward_kernel");
}

void Kernels::gelu_backward(void* din, const void* in, const void* dout, std::int64_t n) {
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    gelu_backward_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(din), static_cast<const A*>(in), static_cast<const A*>(dout), n);
  });
  launched("gelu_backward_kernel");
}

void Kernels::swiglu_forward(void* out, const void* in, int T, int F) {
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    swiglu_forward_kernel<<<blocks_for(static_cast<std::int64_t>(T) * F), kThreads, 0,
                            impl_->stream>>>(static_cast<A*>(out), static_cast<const A*>(in), T, F);
  });
  launched("swiglu_forward_kernel");
}

void Kernels::swiglu_backward(void* din, const void* in, const void* dout, int T, int F) {
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    swiglu_backward_kernel<<<blocks_for(static_cast<std::int64_t>(T) * F), kThreads, 0,
                             impl_->stream>>>(static_cast<A*>(din), static_cast<const A*>(in),
                                              static_cast<const A*>(dout), T, F);
  });
  launched("swiglu_backward_kernel");
}

void Kernels::dropout_forward(void* out, std::uint8_t* mask, const void* in, const void* skip,
                              const DropoutSite& d, int T, int C) {
  const std::int64_t n = static_cast<std::int64_t>(T) * C;
  if (n == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    dropout_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(out), mask, static_cast<const A*>(in), static_cast<const A*>(skip), n, C,
        d);
  });
  launched("dropout_kernel");
}

void Kernels::dropout_backward(void* din, const std::uint8_t* mask, const void* dout, float rate,
                               std::int64_t n) {
  if (n == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    dropout_backward_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(din), mask, static_cast<const A*>(dout), n, 1.0f / (1.0f - rate));
  });
  launched("dropout_backward_kernel");
}

void Kernels::sum_squares(float* acc, const float* x, std::int64_t n) {
  // Scratch kept from call to call (one stream: the next call's kernels follow these).
  auto* p =
      reinterpret_cast<double*>(impl_->room(impl_->norm_partials, kNormBlocks * sizeof(double)));
  sum_squares_blocks_kernel<<<kNormBlocks, kThreads, 0, impl_->stream>>>(p, x, n);
  launched("sum_squares_blocks_kernel");
  sum_squares_total_kernel<<<1, 1, 0, impl_->stream>>>(acc, p, kNormBlocks);
  launched("sum_squares_total_kernel");
}

void Kernels::clip_scale(float* x, std::int64_t n, const float* norm_sq, float max_norm) {
  clip_scale_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(x, n, norm_sq, max_norm);
  launched("clip_scale_kernel");
}

void Kernels::adamw(float* params, const float* grads, float* m, float* v, std::int64_t n, float lr,
                    float beta1, float beta2, float eps, float weight_decay, int t) {
  const float c1 = 1.0f - std::pow(beta1, static_cast<float>(t));
  const float c2 = 1.0f - std::pow(beta2, static_cast<float>(t));
  adamw_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(params, grads, m, v, n, lr, beta1,
                                                              beta2, eps, weight_decay, c1, c2);
  launched("adamw_kernel");
}

}  // namespace dtsim::exec::cuda
