// The GPU kernels of exec/cuda/kernels.hpp. Each kernel mirrors its CPU reference in
// exec/cpu/kernels.cpp (same formulas, same order of the terms where the result depends on it);
// the activation type T is float or __nv_bfloat16, loaded to and computed in fp32.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "exec/core/counter_hash.hpp"
#include "exec/cuda/check.cuh"
#include "exec/cuda/kernels.hpp"

namespace dtsim::exec::cuda {

namespace {

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
__device__ float block_sum(float v) {
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

__device__ float block_max(float v) {
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
    store(din, i, load(din, i) + grad * load(dout, i));
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
    store(din, ui, load(din, ui) + dy * g * sig);
    store(din, gi, load(din, gi) + dy * u * (sig + g * sig * (1.0f - sig)));
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

// The CPU's keep rule (exec/core/counter_hash.hpp): the GPU draws the CPU's masks.
__device__ bool keeps(const Kernels::DropoutSite& d, std::int64_t sequence, std::uint64_t index) {
  return dropout_keeps(d.stream, d.rate, sequence, index);
}

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

// Attention dropout of one sequence's probabilities [H, Sq, S] (its queries at positions qpos,
// or 0 ... Sq-1 where null): one thread per element.
template <class T>
__global__ void attention_dropout_kernel(T* dropped, std::uint8_t* mask, const T* probs, int H,
                                         int Sq, int S, const int* qpos, std::int64_t sequence,
                                         Kernels::DropoutSite d) {
  const auto SS = static_cast<std::int64_t>(S) * S, QS = static_cast<std::int64_t>(Sq) * S;
  const std::int64_t n = H * QS;
  const float keep_scale = 1.0f / (1.0f - d.rate);
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t h = e / QS, i = e / S % Sq, j = e % S;
    const std::int64_t q = qpos != nullptr ? qpos[i] : i;
    const auto index = static_cast<std::uint64_t>((d.head_offset + h) * SS + q * S + j);
    const bool keep = j <= q && keeps(d, sequence, index);
    if (mask != nullptr) mask[e] = keep ? 1 : 0;  // (FlashAttention's forward keeps none)
    store(dropped, e, keep ? load(probs, e) * keep_scale : 0.0f);
  }
}

// ---- mixture of experts -------------------------------------------------------------------

// One thread per token: its top k of E logits (ties to the lower index) by repeated selection,
// and their softmax in double, as exec/cpu's moe_route.
template <class T>
__global__ void moe_route_kernel(int* experts, float* gates, const T* logits, std::int64_t tokens,
                                 int E, int k) {
  for (std::int64_t t = first_index(); t < tokens; t += grid_stride()) {
    const std::int64_t row = t * E;
    int* chosen = experts + t * k;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      float value = 0;
      for (int e = 0; e < E; ++e) {
        bool taken = false;
        for (int i = 0; i < j; ++i) taken = taken || chosen[i] == e;
        const float v = load(logits, row + e);
        if (!taken && (best < 0 || v > value)) {
          best = e;
          value = v;
        }
      }
      chosen[j] = best;
    }
    const float top = load(logits, row + chosen[0]);
    double sum = 0;
    for (int j = 0; j < k; ++j)
      sum += exp(static_cast<double>(load(logits, row + chosen[j]) - top));
    for (int j = 0; j < k; ++j) {
      gates[t * k + j] =
          static_cast<float>(exp(static_cast<double>(load(logits, row + chosen[j]) - top)) / sum);
    }
  }
}

// One thread per token: the logits' gradient through the softmax of its k gates.
template <class T>
__global__ void moe_route_backward_kernel(T* dlogits, const float* dgates, const float* gates,
                                          const int* experts, std::int64_t tokens, int E, int k) {
  for (std::int64_t t = first_index(); t < tokens; t += grid_stride()) {
    const std::int64_t first = t * k;
    float dot = 0;
    for (int j = 0; j < k; ++j) dot += gates[first + j] * dgates[first + j];
    for (int j = 0; j < k; ++j) {
      const std::int64_t i = t * E + experts[first + j];
      store(dlogits, i, load(dlogits, i) + gates[first + j] * (dgates[first + j] - dot));
    }
  }
}

// One block: a stable sort of the slots by expert, as exec/cpu's moe_dispatch. Each thread
// takes a contiguous chunk of slots and counts its copies per expert (count[e * threads + t],
// in dynamic shared memory: E x threads + E ints); each expert's counts become the first row of
// each chunk's copies (in chunk order, after the experts before it); then each thread places its
// chunk's slots in slot order. Every expert's rows keep slot order, whatever the thread count.
__global__ void moe_order_kernel(int* order, float* rows, const int* experts, std::int64_t slots,
                                 int E) {
  extern __shared__ int shared[];
  const int threads = static_cast<int>(blockDim.x), t = static_cast<int>(threadIdx.x);
  int* count = shared;                // [E][threads]
  int* total = shared + E * threads;  // [E]
  const std::int64_t chunk = (slots + threads - 1) / threads;
  const std::int64_t begin = t * chunk < slots ? t * chunk : slots;
  const std::int64_t end = begin + chunk < slots ? begin + chunk : slots;
  for (int e = 0; e < E; ++e) count[e * threads + t] = 0;
  for (std::int64_t i = begin; i < end; ++i) ++count[experts[i] * threads + t];
  __syncthreads();
  // Each expert's chunks in order: their exclusive running sum (one thread per expert).
  for (int e = t; e < E; e += threads) {
    int at = 0;
    for (int c = 0; c < threads; ++c) {
      const int n = count[e * threads + c];
      count[e * threads + c] = at;
      at += n;
    }
    total[e] = at;
  }
  __syncthreads();
  if (t == 0) {
    int at = 0;
    for (int e = 0; e < E; ++e) {
      rows[e] = static_cast<float>(total[e]);
      const int n = total[e];
      total[e] = at;
      at += n;
    }
  }
  __syncthreads();
  for (int e = 0; e < E; ++e) count[e * threads + t] += total[e];
  for (std::int64_t i = begin; i < end; ++i) {
    order[count[experts[i] * threads + t]++] = static_cast<int>(i);
  }
}

// where[order[p]] = p: the row of each slot's copy.
__global__ void moe_where_kernel(int* where, const int* order, std::int64_t slots) {
  for (std::int64_t p = first_index(); p < slots; p += grid_stride())
    where[order[p]] = static_cast<int>(p);
}

// dispatched[p] = x[the token of slot order[p]]; one thread per element.
template <class T>
__global__ void moe_gather_kernel(T* dispatched, const T* x, const int* order, std::int64_t slots,
                                  int C, int k) {
  const std::int64_t n = slots * C;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t p = e / C, c = e % C;
    dispatched[e] = x[static_cast<std::int64_t>(order[p] / k) * C + c];
  }
}

// The row of a token's copy that comes after row `after` (the next in rows' order).
__device__ int next_row(const int* where, std::int64_t token, int k, int after) {
  int next = 0x7fffffff;
  for (int i = 0; i < k; ++i) {
    const int p = where[token * k + i];
    if (p > after && p < next) next = p;
  }
  return next;
}

// One thread per element of [T, C]: a token's k copies' rows summed in rows' order, into dx
// (add) or out (combine: weighted by their gates, from zero), as exec/cpu sums them.
template <class T>
__global__ void moe_token_sum_kernel(T* dst, const T* rows, const int* where, const float* gates,
                                     const int* order, std::int64_t tokens, int C, int k,
                                     bool add) {
  const std::int64_t n = tokens * C;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t t = e / C, c = e % C;
    float v = add ? load(dst, e) : 0.0f;
    int p = -1;
    for (int j = 0; j < k; ++j) {
      p = next_row(where, t, k, p);
      const float x = load(rows, static_cast<std::int64_t>(p) * C + c);
      v += gates != nullptr ? gates[order[p]] * x : x;
    }
    store(dst, e, v);
  }
}

// One block per copy (row p): dy[p] += gate · dout[token]; dgates[slot] += dout[token] · y[p].
template <class T>
__global__ void moe_combine_backward_kernel(T* dy, float* dgates, const T* dout, const T* y,
                                            const float* gates, const int* order, int C, int k) {
  const std::int64_t p = blockIdx.x;
  const int slot = order[p];
  const std::int64_t token = slot / k;
  float dot = 0;
  for (int c = static_cast<int>(threadIdx.x); c < C; c += static_cast<int>(blockDim.x)) {
    const float d = load(dout, token * C + c);
    store(dy, p * C + c, load(dy, p * C + c) + gates[slot] * d);
    dot += d * load(y, p * C + c);
  }
  dot = block_sum(dot);
  if (threadIdx.x == 0) dgates[slot] += dot;
}

// ---- attention ------------------------------------------------------------------------------

// probs[h, i, :] = softmax over j <= i of scores[h, i, j] (already scaled), 0 for j > i, for
// Sq query rows of S keys; with qpos (context parallelism) query i is at position qpos[i] and
// reads keys up to it. One block per (row i, head h).
template <class T>
__global__ void causal_softmax_kernel(T* probs, const float* scores, int Sq, int S, const int* qpos,
                                      float* lse) {
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.y) * Sq + blockIdx.x) * S;
  const int i = qpos != nullptr ? qpos[blockIdx.x] : static_cast<int>(blockIdx.x);
  float m = -INFINITY;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) m = fmaxf(m, scores[row + j]);
  m = block_max(m);
  float s = 0;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) s += expf(scores[row + j] - m);
  s = block_sum(s);
  for (int j = threadIdx.x; j < S; j += blockDim.x) {
    store(probs, row + j, j <= i ? expf(scores[row + j] - m) / s : 0.0f);
  }
  // FlashAttention's memory: the row's log-sum-exp, [H, Sq] for the sequence.
  if (lse != nullptr && threadIdx.x == 0) {
    lse[static_cast<std::int64_t>(blockIdx.y) * Sq + blockIdx.x] = m + logf(s);
  }
}

// FlashAttention's backward: the probabilities again from the scores computed again and the
// rows' log-sum-exp, exp(score - lse); zero above the diagonal.
template <class T>
__global__ void softmax_from_lse_kernel(T* probs, const float* scores, const float* lse, int Sq,
                                        int S, const int* qpos) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.y) * Sq + blockIdx.x;
  const std::int64_t row = r * S;
  const int i = qpos != nullptr ? qpos[blockIdx.x] : static_cast<int>(blockIdx.x);
  const float l = lse[r];
  for (int j = threadIdx.x; j < S; j += blockDim.x) {
    store(probs, row + j, j <= i ? expf(scores[row + j] - l) : 0.0f);
  }
}

// dS = P ⊙ (dP - sum_j dP ⊙ P) · scale, per (row i, head h); zero above the diagonal. With
// attention dropout (mask not null) dP is the gradient through it: the dropped probabilities'
// gradient, masked and scaled.
template <class T>
__global__ void softmax_backward_kernel(T* dscores, const float* dprobs, const T* probs, int Sq,
                                        int S, const int* qpos, float scale,
                                        const std::uint8_t* mask, float keep_scale) {
  const std::int64_t row = (static_cast<std::int64_t>(blockIdx.y) * Sq + blockIdx.x) * S;
  const int i = qpos != nullptr ? qpos[blockIdx.x] : static_cast<int>(blockIdx.x);
  auto dp = [&](int j) {
    const float g = dprobs[row + j];
    return mask == nullptr ? g : (mask[row + j] ? g * keep_scale : 0.0f);
  };
  float dot = 0;
  for (int j = threadIdx.x; j <= i; j += blockDim.x) dot += dp(j) * load(probs, row + j);
  dot = block_sum(dot);
  for (int j = threadIdx.x; j < S; j += blockDim.x) {
    store(dscores, row + j, j <= i ? load(probs, row + j) * (dp(j) - dot) * scale : 0.0f);
  }
}

// ---- context parallelism --------------------------------------------------------------------

// The kv row of sequence b's key at position p (exec/cpu's Attention::key_row): key j = order[p]
// of the sequence's cp·Sq is token j % Sq of cp rank j / Sq, whose B·Sq rows come r-th.
__device__ std::int64_t cp_key_row(const int* order, int b, std::int64_t p, int B, int Sq) {
  const int j = order != nullptr ? order[p] : static_cast<int>(p);
  return (static_cast<std::int64_t>(j / Sq) * B + b) * Sq + j % Sq;
}

// kvp[p, :] = kv[key row of (b, p), :] for the S positions of sequence b; width = 2·G·D.
template <class T>
__global__ void cp_gather_kernel(T* kvp, const T* kv, const int* order, int b, int B, int Sq, int S,
                                 int width) {
  const std::int64_t n = static_cast<std::int64_t>(S) * width;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t p = e / width, c = e % width;
    kvp[e] = kv[cp_key_row(order, b, p, B, Sq) * width + c];
  }
}

// dkv[key row of (b, p), :] += dkvp[p, :] (each key row is one position's: one writer).
template <class T>
__global__ void cp_scatter_add_kernel(T* dkv, const T* dkvp, const int* order, int b, int B, int Sq,
                                      int S, int width) {
  const std::int64_t n = static_cast<std::int64_t>(S) * width;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t p = e / width, c = e % width;
    const std::int64_t at = cp_key_row(order, b, p, B, Sq) * width + c;
    store(dkv, at, load(dkv, at) + load(dkvp, e));
  }
}

// Columns [begin, begin + width) of rows [T, wide]: copied out (add false: dst[T, width] =) or
// added in (add true: wide[T, ...] +=).
template <class T>
__global__ void columns_kernel(T* narrow, T* wide, std::int64_t rows, int wide_width, int begin,
                               int width, bool add) {
  const std::int64_t n = rows * width;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t at = (e / width) * wide_width + begin + e % width;
    if (add) {
      store(wide, at, load(wide, at) + load(narrow, e));
    } else {
      store(narrow, e, load(wide, at));
    }
  }
}

// ---- rotary positions -----------------------------------------------------------------------

// One thread per element of qkv[B·S, (H + 2G)·D]. In the q and k heads the pair
// (x_i, x_{i+D/2}) at position s turns by s·theta^(-2i/D) (sign -1: back); v passes through.
// Forward writes out; backward (accumulate) adds into out.
template <class T>
__global__ void rope_kernel(T* out, const T* in, std::int64_t rows, int S, const int* positions,
                            int HG, int width, int D, double theta, float sign, bool accumulate) {
  const std::int64_t n = rows * width;
  const int half = D / 2;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t r = e / width;
    const int col = static_cast<int>(e % width);
    float y;
    if (col < HG * D) {
      const int i = col % D;
      const int k = i < half ? i : i - half;
      const std::int64_t base = e - i;  // the head's first element
      const std::int64_t s = r % S;
      const double angle =
          static_cast<double>(positions != nullptr ? positions[s] : s) * pow(theta, -2.0 * k / D);
      const auto c = static_cast<float>(cos(angle));
      const auto sn = sign * static_cast<float>(sin(angle));
      const float a = load(in, base + k), b = load(in, base + k + half);
      y = i < half ? a * c - b * sn : a * sn + b * c;
    } else {
      y = load(in, e);
    }
    store(out, e, accumulate ? load(out, e) + y : y);
  }
}

// ---- embedding ------------------------------------------------------------------------------

template <class T>
__global__ void embedding_forward_kernel(T* out, const int* tokens, const float* wte, int rows,
                                         const float* wpe, int S, const int* positions,
                                         std::int64_t BS, int C, int vocab_begin) {
  const std::int64_t n = BS * C;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t r = e / C;
    const int c = static_cast<int>(e % C);
    const int local = tokens[r] - vocab_begin;
    float y = local >= 0 && local < rows ? wte[static_cast<std::int64_t>(local) * C + c] : 0.0f;
    if (wpe) y += wpe[(positions != nullptr ? positions[r % S] : r % S) * C + c];
    store(out, e, y);
  }
}

// The token table's gradient, one thread per (slice of the table's rows, column): it adds the
// gradient rows of its slice's tokens (local row % slices) in order, so every element has one
// writer and sums in row order, without atomics (deterministic), and the threads scan the
// tokens rather than wait on one another's updates.
template <class T>
__global__ void embedding_backward_kernel(float* dwte, int rows, const T* dout, const int* tokens,
                                          std::int64_t BS, int C, int vocab_begin, int slices) {
  const std::int64_t n = static_cast<std::int64_t>(slices) * C;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    const auto slice = static_cast<int>(i / C);
    const std::int64_t c = i % C;
    for (std::int64_t r = 0; r < BS; ++r) {
      const int local = tokens[r] - vocab_begin;
      if (local < 0 || local >= rows || local % slices != slice) continue;
      dwte[static_cast<std::int64_t>(local) * C + c] += load(dout, r * C + c);
    }
  }
}

// The learned positions' gradient, one thread per (position, column): dwpe[s, c] += dout[b, s, c]
// over the sequences b in order.
template <class T>
__global__ void position_backward_kernel(float* dwpe, const T* dout, int B, int S, int C,
                                         const int* positions) {
  const std::int64_t n = static_cast<std::int64_t>(S) * C;
  for (std::int64_t i = first_index(); i < n; i += grid_stride()) {
    // Row s of a sequence is at position positions[s] (context parallelism), or s.
    const std::int64_t at =
        positions != nullptr ? static_cast<std::int64_t>(positions[i / C]) * C + i % C : i;
    float acc = dwpe[at];
    for (int b = 0; b < B; ++b) acc += load(dout, static_cast<std::int64_t>(b) * n + i);
    dwpe[at] = acc;
  }
}

// ---- cross-entropy --------------------------------------------------------------------------

// One block per row of logits[T, V].
template <class T>
__global__ void row_max_kernel(float* rowmax, const T* logits, int V) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * V;
  float m = -INFINITY;
  for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, load(logits, row + v));
  m = block_max(m);
  if (threadIdx.x == 0) rowmax[blockIdx.x] = m;
}

// sums[t] = sum_v exp(z - rowmax[t]); sums[T + t] = the target's logit where this shard holds it.
template <class T>
__global__ void exp_sums_kernel(float* sums, const T* logits, const float* rowmax,
                                const int* targets, int T_, int V, int vocab_begin) {
  const int t = static_cast<int>(blockIdx.x);
  const std::int64_t row = static_cast<std::int64_t>(t) * V;
  float s = 0;
  for (int v = threadIdx.x; v < V; v += blockDim.x) s += expf(load(logits, row + v) - rowmax[t]);
  s = block_sum(s);
  if (threadIdx.x == 0) {
    const int y = targets[t] - vocab_begin;
    sums[t] = s;
    sums[T_ + t] = y >= 0 && y < V ? load(logits, row + y) : 0.0f;
  }
}

// sums[t] *= exp(local[t] - global[t]): a shard's sums of exponentials to its own maximum,
// made sums to the maximum over all shards.
__global__ void rescale_sums_kernel(float* sums, const float* local, const float* global, int T) {
  for (std::int64_t i = first_index(); i < T; i += grid_stride())
    sums[i] *= expf(local[i] - global[i]);
}

// row_loss[t] = log(sum) - (z_y - max); dz = (softmax - onehot) / T, from the statistics.
template <class T>
__global__ void softmax_loss_kernel(T* dlogits, float* row_loss, const T* logits,
                                    const float* rowmax, const float* sums, const int* targets,
                                    int T_, int V, int vocab_begin) {
  const int t = static_cast<int>(blockIdx.x);
  const std::int64_t row = static_cast<std::int64_t>(t) * V;
  const float m = rowmax[t], s = sums[t];
  const int y = targets[t] - vocab_begin;
  if (threadIdx.x == 0) row_loss[t] = logf(s) - (sums[T_ + t] - m);
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    const float p = expf(load(logits, row + v) - m) / s;
    store(dlogits, row + v, (p - (v == y ? 1.0f : 0.0f)) / static_cast<float>(T_));
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

unsigned blocks_for(std::int64_t n) {
  return static_cast<unsigned>(
      std::clamp<std::int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
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
    cudaFreeAsync(p_, static_cast<cudaStream_t>(stream_));
  } else {
    cudaFree(p_);
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

  ~Impl() {
    // The scratch goes back on the stream, before the stream does; then the pool gives it to
    // the GPU (its release threshold keeps it otherwise, where cudaMalloc cannot reach it).
    for (DeviceBuffer* b : {&staging, &scores, &dscores, &partials, &slots, &cp_kv, &cp_dkv,
                            &flash_probs, &flash_mask, &flash_dropped, &norm_partials})
      *b = DeviceBuffer();
    for (cudaEvent_t e : events) cudaEventDestroy(e);
    if (blas != nullptr) cublasDestroy(blas);
    workspace = DeviceBuffer();
    if (stream != nullptr) {
      cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
    }
    if (pool != nullptr) cudaMemPoolTrimTo(pool, 0);
  }

  // The stream of in-step allocations: this one, where the GPU has memory pools.
  void* allocation_stream() const { return pool != nullptr ? stream : nullptr; }

  float* room(DeviceBuffer& b, std::size_t bytes) {
    if (b.bytes() < bytes) b = DeviceBuffer(bytes, allocation_stream());
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

namespace {

// Calls f with a null pointer of the activation type (float or bf16).
template <class F>
void with_type(Dtype t, F&& f) {
  if (t == Dtype::F32) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<bf16*>(nullptr));
  }
}

cudaDataType_t cuda_type(Dtype t) {
  return t == Dtype::F32 ? CUDA_R_32F : CUDA_R_16BF;
}

void launched(const char* kernel) {
  check(cudaGetLastError(), kernel);
}

}  // namespace

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

int Kernels::mark() {
  if (static_cast<std::size_t>(impl_->marks) == impl_->events.size()) {
    cudaEvent_t e = nullptr;
    check(cudaEventCreate(&e), "cudaEventCreate");
    impl_->events.push_back(e);
  }
  check(cudaEventRecord(impl_->events[static_cast<std::size_t>(impl_->marks)], impl_->stream),
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
  check(cudaMemsetAsync(dst, 0, bytes, impl_->stream), "cudaMemsetAsync");
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

namespace {

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
          int batch = 1) {
  const cublasComputeType_t compute =
      a.type == CUDA_R_32F ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  check(cublasGemmStridedBatchedEx(blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, b.p, b.type,
                                   b.ld, b.stride, a.p, a.type, a.ld, a.stride, &beta, c, ctype,
                                   ldc, cstride, batch, compute, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx");
}

// The heads of one attention GEMM call: `count` heads from `head` on, `head_step` apart,
// reading kv heads from `kv` on, `kv_step` apart. Either the `group` query heads of one kv
// head (kv_step 0: the shared k and v) or one head of every kv group (G calls' worth in one),
// whichever makes fewer calls: one per sequence for multi-head attention, `group` for GQA with
// more kv heads than that.
struct HeadBatch {
  int head, count, head_step, kv, kv_step;
};

std::vector<HeadBatch> head_batches(int H, int G) {
  const int group = H / G;
  std::vector<HeadBatch> batches;
  if (group <= G) {
    for (int r = 0; r < group; ++r) batches.push_back({r, G, group, 0, 1});
  } else {
    for (int kv = 0; kv < G; ++kv) batches.push_back({kv * group, group, 1, kv, 0});
  }
  return batches;
}

// For one sequence, per query head h (fp32 out, [M, S] per head, the heads M·S apart):
// out_h = alpha · a_h · b_{kv(h)}^T, a_h the D columns of head h in rows of a_ld values, b_kv
// those of kv head kv in rows of b_ld values: the scores q·k^T, and dP = dO·v^T, batched by
// head_batches.
void heads_by_kv(cublasHandle_t blas, cudaDataType_t t, std::size_t e,
                 const std::vector<HeadBatch>& batches, int M, int S, int D, float alpha,
                 const char* a, int a_ld, const char* b, int b_ld, float* out) {
  const auto MS = static_cast<long long>(M) * S;
  for (const HeadBatch& hb : batches) {
    gemm(blas, false, true, M, S, D, alpha,
         {a + hb.head * D * e, t, a_ld, static_cast<long long>(hb.head_step) * D},
         {b + hb.kv * D * e, t, b_ld, static_cast<long long>(hb.kv_step) * D}, 0.0f,
         out + hb.head * MS, CUDA_R_32F, S, hb.head_step * MS, hb.count);
  }
}

}  // namespace

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

void Kernels::matmul_backward(void* din, float* dw, float* dbias, const void* dout, const void* in,
                              const void* w, int T, int K, int N, bool w_transposed) {
  const cudaDataType_t t = cuda_type(act_);
  if (din != nullptr && w_transposed) {  // din[T,K] += dout[T,N] · w[N,K]
    gemm(impl_->blas, false, false, T, K, N, 1.0f, {dout, t, N}, {w, t, K}, 1.0f, din, t, K, 0);
  } else if (din != nullptr) {  // din[T,K] += dout[T,N] · w[K,N]^T
    gemm(impl_->blas, false, true, T, K, N, 1.0f, {dout, t, N}, {w, t, N}, 1.0f, din, t, K, 0);
  }
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

void Kernels::moe_route(int* experts, float* gates, const void* logits, int T, int E, int k) {
  if (T == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_route_kernel<<<blocks_for(T), kThreads, 0, impl_->stream>>>(
        experts, gates, static_cast<const A*>(logits), T, E, k);
  });
  launched("moe_route_kernel");
}

void Kernels::moe_route_backward(void* dlogits, const float* dgates, const float* gates,
                                 const int* experts, int T, int E, int k) {
  if (T == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_route_backward_kernel<<<blocks_for(T), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(dlogits), dgates, gates, experts, T, E, k);
  });
  launched("moe_route_backward_kernel");
}

void Kernels::moe_dispatch(void* dispatched, int* order, float* rows, const void* x,
                           const int* experts, int T, int C, int k, int E) {
  const std::int64_t slots = static_cast<std::int64_t>(T) * k;
  // As many threads as the counts fit in 48 KiB of shared memory (the default most a block
  // gets), up to 1024, a multiple of 32; at least one warp.
  const int fit = static_cast<int>((48 * 1024 / 4 - E) / std::max(E, 1));
  const int threads = std::clamp(fit / 32 * 32, 32, 1024);
  if (static_cast<std::int64_t>(E + 1) * threads * 4 > 48 * 1024) {
    throw CudaError("moe_dispatch: " + std::to_string(E) +
                    " experts: their counts for a warp of threads do not fit in 48 KiB of "
                    "shared memory (at most 383 experts)");
  }
  moe_order_kernel<<<1, threads, static_cast<std::size_t>(E) * (threads + 1) * 4, impl_->stream>>>(
      order, rows, experts, slots, E);
  launched("moe_order_kernel");
  if (slots == 0 || C == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_gather_kernel<<<blocks_for(slots * C), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(dispatched), static_cast<const A*>(x), order, slots, C, k);
  });
  launched("moe_gather_kernel");
}

void Kernels::moe_dispatch_backward(void* dx, const void* ddispatched, const int* order, int T,
                                    int C, int k) {
  const std::int64_t slots = static_cast<std::int64_t>(T) * k;
  if (slots == 0 || C == 0) return;
  // The row of each slot's copy (the inverse of the order), in scratch.
  auto* where =
      reinterpret_cast<int*>(impl_->room(impl_->slots, static_cast<std::size_t>(slots) * 4));
  moe_where_kernel<<<blocks_for(slots), kThreads, 0, impl_->stream>>>(where, order, slots);
  launched("moe_where_kernel");
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_token_sum_kernel<<<blocks_for(static_cast<std::int64_t>(T) * C), kThreads, 0,
                           impl_->stream>>>(static_cast<A*>(dx), static_cast<const A*>(ddispatched),
                                            where, nullptr, order, T, C, k, true);
  });
  launched("moe_token_sum_kernel");
}

void Kernels::moe_combine(void* out, const void* y, const float* gates, const int* order, int T,
                          int C, int k) {
  const std::int64_t slots = static_cast<std::int64_t>(T) * k;
  if (slots == 0 || C == 0) return;
  // The row of each slot's copy (the inverse of the order), in scratch.
  auto* where =
      reinterpret_cast<int*>(impl_->room(impl_->slots, static_cast<std::size_t>(slots) * 4));
  moe_where_kernel<<<blocks_for(slots), kThreads, 0, impl_->stream>>>(where, order, slots);
  launched("moe_where_kernel");
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_token_sum_kernel<<<blocks_for(static_cast<std::int64_t>(T) * C), kThreads, 0,
                           impl_->stream>>>(static_cast<A*>(out), static_cast<const A*>(y), where,
                                            gates, order, T, C, k, false);
  });
  launched("moe_token_sum_kernel");
}

void Kernels::moe_combine_backward(void* dy, float* dgates, const void* dout, const void* y,
                                   const float* gates, const int* order, int T, int C, int k) {
  const std::int64_t slots = static_cast<std::int64_t>(T) * k;
  if (slots == 0 || C == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_combine_backward_kernel<<<static_cast<unsigned>(slots), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(dy), dgates, static_cast<const A*>(dout), static_cast<const A*>(y), gates,
        order, C, k);
  });
  launched("moe_combine_backward_kernel");
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

// Per sequence b: scores[h] = scale · q_h · k_{kv(h)}^T, the heads batched by head_batches, the
// causal softmax of every head's rows, then out_h = probs_h · v_{kv(h)}. qkv rows hold
// [q heads | k heads | v heads], D values each.
void Kernels::attention_forward(void* out, void* probs, const void* qkv, int B, int S, int H, int G,
                                int D, const DropoutSite* dropout, std::uint8_t* mask,
                                void* dropped, float* lse) {
  if (B == 0 || S == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int width = (H + 2 * G) * D;
  const std::size_t e = dtype_bytes(act_);
  const auto SS = static_cast<long long>(S) * S;
  const std::vector<HeadBatch> batches = head_batches(H, G);
  float* scores = impl_->room(impl_->scores, static_cast<std::size_t>(H) * SS * 4);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const auto* base = static_cast<const char*>(qkv);
  // FlashAttention's memory: the sequence's probabilities (and dropout's) in scratch.
  const bool flash = lse != nullptr;
  const Impl::FlashRooms rooms =
      flash ? impl_->flash_rooms(static_cast<std::size_t>(H) * SS, e, dropout != nullptr, false)
            : Impl::FlashRooms{};
  for (int b = 0; b < B; ++b) {
    const char* rows = base + static_cast<std::size_t>(b) * S * width * e;
    char* p =
        flash ? rooms.probs : static_cast<char*>(probs) + static_cast<std::size_t>(b) * H * SS * e;
    float* row_lse = flash ? lse + static_cast<std::size_t>(b) * H * S : nullptr;
    char* o = static_cast<char*>(out) + static_cast<std::size_t>(b) * S * H * D * e;
    heads_by_kv(impl_->blas, t, e, batches, S, S, D, scale, rows, width, rows + H * D * e, width,
                scores);
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      causal_softmax_kernel<<<dim3(S, H), kThreads, 0, impl_->stream>>>(
          reinterpret_cast<A*>(p), scores, S, S, nullptr, row_lse);
    });
    launched("causal_softmax_kernel");
    // The values read the probabilities after dropout, if any.
    const char* weights = p;
    if (dropout != nullptr) {
      char* kept = flash ? rooms.dropped
                         : static_cast<char*>(dropped) + static_cast<std::size_t>(b) * H * SS * e;
      std::uint8_t* m = flash ? rooms.mask : mask + static_cast<std::size_t>(b) * H * SS;
      with_type(act_, [&](auto* tag) {
        using A = std::remove_pointer_t<decltype(tag)>;
        attention_dropout_kernel<<<blocks_for(H * SS), kThreads, 0, impl_->stream>>>(
            reinterpret_cast<A*>(kept), m, reinterpret_cast<const A*>(p), H, S, S, nullptr,
            dropout->first_sequence + b, *dropout);
      });
      launched("attention_dropout_kernel");
      weights = kept;
    }
    for (const HeadBatch& hb : batches) {
      gemm(impl_->blas, false, false, S, D, S, 1.0f,
           {weights + hb.head * SS * e, t, S, hb.head_step * SS},
           {rows + (H + G + hb.kv) * D * e, t, width, static_cast<long long>(hb.kv_step) * D}, 0.0f,
           o + hb.head * D * e, t, H * D, static_cast<long long>(hb.head_step) * D, hb.count);
    }
  }
}

void Kernels::remake_probabilities(void* probs, std::uint8_t* mask, void* dropped,
                                   const float* scores, const float* lse, int H, int Sq, int S,
                                   const int* qpos, const DropoutSite* dropout, int b) {
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    softmax_from_lse_kernel<<<dim3(Sq, H), kThreads, 0, impl_->stream>>>(static_cast<A*>(probs),
                                                                         scores, lse, Sq, S, qpos);
    launched("softmax_from_lse_kernel");
    if (dropout != nullptr) {
      attention_dropout_kernel<<<blocks_for(static_cast<std::int64_t>(H) * Sq * S), kThreads, 0,
                                 impl_->stream>>>(static_cast<A*>(dropped), mask,
                                                  static_cast<const A*>(probs), H, Sq, S, qpos,
                                                  dropout->first_sequence + b, *dropout);
      launched("attention_dropout_kernel");
    }
  });
}

// dP_h = dO_h · v^T (fp32), dS_h = softmax backward · scale, then dq_h += dS_h · k (these
// batched by head_batches), dk += dS_h^T · q_h and dv += P_h^T · dO_h. The k and v gradients of
// a kv group sum over its heads, so those GEMMs batch over the groups, one of each group's
// heads at a time (beta = 1): never two writing one buffer.
void Kernels::attention_backward(void* dqkv, const void* dout, const void* qkv, const void* probs,
                                 int B, int S, int H, int G, int D, float dropout_rate,
                                 const std::uint8_t* mask, const void* dropped, const float* lse,
                                 const DropoutSite* dropout) {
  if (B == 0 || S == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int width = (H + 2 * G) * D, group = H / G;
  const std::size_t e = dtype_bytes(act_);
  const auto SS = static_cast<long long>(S) * S;
  const std::vector<HeadBatch> batches = head_batches(H, G);
  float* dprobs = impl_->room(impl_->scores, static_cast<std::size_t>(H) * SS * 4);
  void* dscores = impl_->room(impl_->dscores, static_cast<std::size_t>(H) * SS * e);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // FlashAttention's memory: the sequence's probabilities (and dropout's) made again.
  const bool flash = lse != nullptr;
  // FlashAttention's masks are drawn at the site's rate: its keep scale too.
  const float rate = flash && dropout != nullptr ? dropout->rate : dropout_rate;
  const Impl::FlashRooms rooms =
      flash ? impl_->flash_rooms(static_cast<std::size_t>(H) * SS, e, dropout != nullptr, true)
            : Impl::FlashRooms{};
  for (int b = 0; b < B; ++b) {
    const char* rows = static_cast<const char*>(qkv) + static_cast<std::size_t>(b) * S * width * e;
    char* drows = static_cast<char*>(dqkv) + static_cast<std::size_t>(b) * S * width * e;
    if (flash) {
      // The scores again, as the forward made them.
      heads_by_kv(impl_->blas, t, e, batches, S, S, D, scale, rows, width, rows + H * D * e, width,
                  dprobs);
      remake_probabilities(rooms.probs, rooms.mask, rooms.dropped, dprobs,
                           lse + static_cast<std::size_t>(b) * H * S, H, S, S, nullptr, dropout, b);
    }
    // With dropout the values read the dropped probabilities: dv takes those, and dP comes
    // back through the mask.
    const Impl::BackwardInputs in =
        Impl::backward_inputs(flash, rooms, dropout != nullptr, probs, mask, dropped, b,
                              static_cast<std::size_t>(H) * SS, e);
    const char* p = in.probs;
    const std::uint8_t* m = in.mask;
    const char* weights = in.weights;
    const bool drop = in.dropout;
    const char* dO = static_cast<const char*>(dout) + static_cast<std::size_t>(b) * S * H * D * e;
    const char* ds = static_cast<const char*>(dscores);
    heads_by_kv(impl_->blas, t, e, batches, S, S, D, 1.0f, dO, H * D, rows + (H + G) * D * e, width,
                dprobs);
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      softmax_backward_kernel<<<dim3(S, H), kThreads, 0, impl_->stream>>>(
          static_cast<A*>(dscores), dprobs, reinterpret_cast<const A*>(p), S, S, nullptr, scale, m,
          drop ? 1.0f / (1.0f - rate) : 1.0f);
    });
    launched("softmax_backward_kernel");
    for (const HeadBatch& hb : batches) {
      gemm(impl_->blas, false, false, S, D, S, 1.0f,
           {ds + hb.head * SS * e, t, S, hb.head_step * SS},
           {rows + (H + hb.kv) * D * e, t, width, static_cast<long long>(hb.kv_step) * D}, 1.0f,
           drows + hb.head * D * e, t, width, static_cast<long long>(hb.head_step) * D, hb.count);
    }
    // Head r of every kv group at once (batched over the G groups: each writes its own kv
    // head), then the next r accumulates (beta = 1): never two writers of one buffer.
    for (int r = 0; r < group; ++r) {
      gemm(impl_->blas, true, false, S, D, S, 1.0f, {ds + r * SS * e, t, S, group * SS},
           {rows + r * D * e, t, width, static_cast<long long>(group) * D}, 1.0f, drows + H * D * e,
           t, width, D, G);
      gemm(impl_->blas, true, false, S, D, S, 1.0f, {weights + r * SS * e, t, S, group * SS},
           {dO + r * D * e, t, H * D, static_cast<long long>(group) * D}, 1.0f,
           drows + (H + G) * D * e, t, width, D, G);
    }
  }
}

void Kernels::attention_forward_cp(void* out, void* probs, const void* qkv, const void* kv,
                                   const int* qpos, const int* order, int cp, int B, int Sq, int H,
                                   int G, int D, const DropoutSite* dropout, std::uint8_t* mask,
                                   void* dropped, float* lse) {
  if (B == 0 || Sq == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int S = cp * Sq, width = (H + 2 * G) * D, kv_width = 2 * G * D;
  const std::size_t e = dtype_bytes(act_);
  const auto QS = static_cast<long long>(Sq) * S;
  const std::vector<HeadBatch> batches = head_batches(H, G);
  float* scores = impl_->room(impl_->scores, static_cast<std::size_t>(H) * QS * 4);
  char* kvp = reinterpret_cast<char*>(
      impl_->room(impl_->cp_kv, static_cast<std::size_t>(S) * kv_width * e));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const bool flash = lse != nullptr;
  const Impl::FlashRooms rooms =
      flash ? impl_->flash_rooms(static_cast<std::size_t>(H) * QS, e, dropout != nullptr, false)
            : Impl::FlashRooms{};
  for (int b = 0; b < B; ++b) {
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      cp_gather_kernel<<<blocks_for(static_cast<std::int64_t>(S) * kv_width), kThreads, 0,
                         impl_->stream>>>(reinterpret_cast<A*>(kvp), static_cast<const A*>(kv),
                                          order, b, B, Sq, S, kv_width);
    });
    launched("cp_gather_kernel");
    const char* rows = static_cast<const char*>(qkv) + static_cast<std::size_t>(b) * Sq * width * e;
    char* p =
        flash ? rooms.probs : static_cast<char*>(probs) + static_cast<std::size_t>(b) * H * QS * e;
    float* row_lse = flash ? lse + static_cast<std::size_t>(b) * H * Sq : nullptr;
    char* o = static_cast<char*>(out) + static_cast<std::size_t>(b) * Sq * H * D * e;
    heads_by_kv(impl_->blas, t, e, batches, Sq, S, D, scale, rows, width, kvp, kv_width, scores);
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      causal_softmax_kernel<<<dim3(Sq, H), kThreads, 0, impl_->stream>>>(
          reinterpret_cast<A*>(p), scores, Sq, S, qpos, row_lse);
    });
    launched("causal_softmax_kernel");
    const char* weights = p;
    if (dropout != nullptr) {
      char* kept = flash ? rooms.dropped
                         : static_cast<char*>(dropped) + static_cast<std::size_t>(b) * H * QS * e;
      std::uint8_t* m = flash ? rooms.mask : mask + static_cast<std::size_t>(b) * H * QS;
      with_type(act_, [&](auto* tag) {
        using A = std::remove_pointer_t<decltype(tag)>;
        attention_dropout_kernel<<<blocks_for(H * QS), kThreads, 0, impl_->stream>>>(
            reinterpret_cast<A*>(kept), m, reinterpret_cast<const A*>(p), H, Sq, S, qpos,
            dropout->first_sequence + b, *dropout);
      });
      launched("attention_dropout_kernel");
      weights = kept;
    }
    for (const HeadBatch& hb : batches) {
      gemm(impl_->blas, false, false, Sq, D, S, 1.0f,
           {weights + hb.head * QS * e, t, S, hb.head_step * QS},
           {kvp + (G + hb.kv) * D * e, t, kv_width, static_cast<long long>(hb.kv_step) * D}, 0.0f,
           o + hb.head * D * e, t, H * D, static_cast<long long>(hb.head_step) * D, hb.count);
    }
  }
}

void Kernels::attention_backward_cp(void* dqkv, void* dkv, const void* dout, const void* qkv,
                                    const void* kv, const void* probs, const int* qpos,
                                    const int* order, int cp, int B, int Sq, int H, int G, int D,
                                    float dropout_rate, const std::uint8_t* mask,
                                    const void* dropped, const float* lse,
                                    const DropoutSite* dropout) {
  if (B == 0 || Sq == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int S = cp * Sq, width = (H + 2 * G) * D, kv_width = 2 * G * D, group = H / G;
  const std::size_t e = dtype_bytes(act_);
  const auto QS = static_cast<long long>(Sq) * S;
  const std::vector<HeadBatch> batches = head_batches(H, G);
  float* dprobs = impl_->room(impl_->scores, static_cast<std::size_t>(H) * QS * 4);
  void* dscores = impl_->room(impl_->dscores, static_cast<std::size_t>(H) * QS * e);
  const std::size_t kv_bytes = static_cast<std::size_t>(S) * kv_width * e;
  char* kvp = reinterpret_cast<char*>(impl_->room(impl_->cp_kv, kv_bytes));
  char* dkvp = reinterpret_cast<char*>(impl_->room(impl_->cp_dkv, kv_bytes));
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const bool flash = lse != nullptr;
  // FlashAttention's masks are drawn at the site's rate: its keep scale too.
  const float rate = flash && dropout != nullptr ? dropout->rate : dropout_rate;
  const Impl::FlashRooms rooms =
      flash ? impl_->flash_rooms(static_cast<std::size_t>(H) * QS, e, dropout != nullptr, true)
            : Impl::FlashRooms{};
  for (int b = 0; b < B; ++b) {
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      cp_gather_kernel<<<blocks_for(static_cast<std::int64_t>(S) * kv_width), kThreads, 0,
                         impl_->stream>>>(reinterpret_cast<A*>(kvp), static_cast<const A*>(kv),
                                          order, b, B, Sq, S, kv_width);
    });
    launched("cp_gather_kernel");
    zero(dkvp, kv_bytes);
    const char* rows = static_cast<const char*>(qkv) + static_cast<std::size_t>(b) * Sq * width * e;
    char* drows = static_cast<char*>(dqkv) + static_cast<std::size_t>(b) * Sq * width * e;
    if (flash) {
      // The scores again, as the forward made them.
      heads_by_kv(impl_->blas, t, e, batches, Sq, S, D, scale, rows, width, kvp, kv_width, dprobs);
      remake_probabilities(rooms.probs, rooms.mask, rooms.dropped, dprobs,
                           lse + static_cast<std::size_t>(b) * H * Sq, H, Sq, S, qpos, dropout, b);
    }
    const Impl::BackwardInputs in =
        Impl::backward_inputs(flash, rooms, dropout != nullptr, probs, mask, dropped, b,
                              static_cast<std::size_t>(H) * QS, e);
    const char* p = in.probs;
    const std::uint8_t* m = in.mask;
    const char* weights = in.weights;
    const bool drop = in.dropout;
    const char* dO = static_cast<const char*>(dout) + static_cast<std::size_t>(b) * Sq * H * D * e;
    const char* ds = static_cast<const char*>(dscores);
    // dP = dO · v^T
    heads_by_kv(impl_->blas, t, e, batches, Sq, S, D, 1.0f, dO, H * D, kvp + G * D * e, kv_width,
                dprobs);
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      softmax_backward_kernel<<<dim3(Sq, H), kThreads, 0, impl_->stream>>>(
          static_cast<A*>(dscores), dprobs, reinterpret_cast<const A*>(p), Sq, S, qpos, scale, m,
          drop ? 1.0f / (1.0f - rate) : 1.0f);
    });
    launched("softmax_backward_kernel");
    for (const HeadBatch& hb : batches) {  // dq += dS · k
      gemm(impl_->blas, false, false, Sq, D, S, 1.0f,
           {ds + hb.head * QS * e, t, S, hb.head_step * QS},
           {kvp + hb.kv * D * e, t, kv_width, static_cast<long long>(hb.kv_step) * D}, 1.0f,
           drows + hb.head * D * e, t, width, static_cast<long long>(hb.head_step) * D, hb.count);
    }
    // dk += dS^T · q and dv += P^T · dO in position order, head r of every kv group at once
    // (each group writes its own kv head), then into dkv at the keys' rows.
    for (int r = 0; r < group; ++r) {
      gemm(impl_->blas, true, false, S, D, Sq, 1.0f, {ds + r * QS * e, t, S, group * QS},
           {rows + r * D * e, t, width, static_cast<long long>(group) * D}, 1.0f, dkvp, t, kv_width,
           D, G);
      gemm(impl_->blas, true, false, S, D, Sq, 1.0f, {weights + r * QS * e, t, S, group * QS},
           {dO + r * D * e, t, H * D, static_cast<long long>(group) * D}, 1.0f, dkvp + G * D * e, t,
           kv_width, D, G);
    }
    with_type(act_, [&](auto* tag) {
      using A = std::remove_pointer_t<decltype(tag)>;
      cp_scatter_add_kernel<<<blocks_for(static_cast<std::int64_t>(S) * kv_width), kThreads, 0,
                              impl_->stream>>>(
          static_cast<A*>(dkv), reinterpret_cast<const A*>(dkvp), order, b, B, Sq, S, kv_width);
    });
    launched("cp_scatter_add_kernel");
  }
}

void Kernels::copy_columns(void* dst, const void* src, int T, int src_width, int begin, int width) {
  const std::int64_t n = static_cast<std::int64_t>(T) * width;
  if (n == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    columns_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(dst), const_cast<A*>(static_cast<const A*>(src)), T, src_width, begin,
        width, false);
  });
  launched("columns_kernel");
}

void Kernels::add_columns(void* dst, const void* src, int T, int dst_width, int begin, int width) {
  const std::int64_t n = static_cast<std::int64_t>(T) * width;
  if (n == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    columns_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        const_cast<A*>(static_cast<const A*>(src)), static_cast<A*>(dst), T, dst_width, begin,
        width, true);
  });
  launched("columns_kernel");
}

void Kernels::rope_forward(void* out, const void* qkv, int B, int S, int H, int G, int D,
                           double theta, const int* positions) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * S;
  const int width = (H + 2 * G) * D;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    rope_kernel<<<blocks_for(rows * width), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(out), static_cast<const A*>(qkv), rows, S, positions, H + G, width, D,
        theta, 1.0f, false);
  });
  launched("rope_kernel");
}

void Kernels::rope_backward(void* dqkv, const void* dout, int B, int S, int H, int G, int D,
                            double theta, const int* positions) {
  const std::int64_t rows = static_cast<std::int64_t>(B) * S;
  const int width = (H + 2 * G) * D;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    rope_kernel<<<blocks_for(rows * width), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(dqkv), static_cast<const A*>(dout), rows, S, positions, H + G, width, D,
        theta, -1.0f, true);
  });
  launched("rope_kernel");
}

void Kernels::embedding_forward(void* out, const int* tokens, const float* wte, int rows,
                                const float* wpe, int B, int S, int C, int vocab_begin,
                                const int* positions) {
  const std::int64_t BS = static_cast<std::int64_t>(B) * S;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    embedding_forward_kernel<<<blocks_for(BS * C), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(out), tokens, wte, rows, wpe, S, positions, BS, C, vocab_begin);
  });
  launched("embedding_forward_kernel");
}

void Kernels::embedding_backward(float* dwte, int rows, float* dwpe, const void* dout,
                                 const int* tokens, int B, int S, int C, int vocab_begin,
                                 const int* positions) {
  const std::int64_t BS = static_cast<std::int64_t>(B) * S;
  if (BS == 0 || C == 0) return;  // (a grid of no blocks is a launch error)
  // About 64k threads, each scanning every token, at most one slice per table row.
  const int slices =
      static_cast<int>(std::clamp<std::int64_t>(65536 / C, 1, std::max<std::int64_t>(rows, 1)));
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    if (dwte != nullptr && rows > 0) {
      embedding_backward_kernel<<<blocks_for(static_cast<std::int64_t>(slices) * C), kThreads, 0,
                                  impl_->stream>>>(dwte, rows, static_cast<const A*>(dout), tokens,
                                                   BS, C, vocab_begin, slices);
    }
    if (dwpe != nullptr) {
      position_backward_kernel<<<blocks_for(static_cast<std::int64_t>(S) * C), kThreads, 0,
                                 impl_->stream>>>(dwpe, static_cast<const A*>(dout), B, S, C,
                                                  positions);
    }
  });
  launched("embedding_backward_kernel");
}

void Kernels::cross_entropy_max(float* rowmax, const void* logits, int T, int V) {
  if (T == 0) return;  // (a grid of no blocks is a launch error)
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    row_max_kernel<<<T, kThreads, 0, impl_->stream>>>(rowmax, static_cast<const A*>(logits), V);
  });
  launched("row_max_kernel");
}

void Kernels::cross_entropy_sums(float* sums, const void* logits, const float* rowmax,
                                 const int* targets, int T, int V, int vocab_begin) {
  if (T == 0) return;  // (a grid of no blocks is a launch error)
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    exp_sums_kernel<<<T, kThreads, 0, impl_->stream>>>(sums, static_cast<const A*>(logits), rowmax,
                                                       targets, T, V, vocab_begin);
  });
  launched("exp_sums_kernel");
}

void Kernels::cross_entropy_sharded(void* dlogits, float* row_loss, const void* logits,
                                    const float* rowmax, const float* sums, const int* targets,
                                    int T, int V, int vocab_begin) {
  if (T == 0) return;  // (a grid of no blocks is a launch error)
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    softmax_loss_kernel<<<T, kThreads, 0, impl_->stream>>>(static_cast<A*>(dlogits), row_loss,
                                                           static_cast<const A*>(logits), rowmax,
                                                           sums, targets, T, V, vocab_begin);
  });
  launched("softmax_loss_kernel");
}

void Kernels::cross_entropy_rescale(float* sums, const float* local_max, const float* global_max,
                                    int T) {
  if (T == 0) return;  // (a grid of no blocks is a launch error)
  rescale_sums_kernel<<<blocks_for(T), kThreads, 0, impl_->stream>>>(sums, local_max, global_max,
                                                                     T);
  launched("rescale_sums_kernel");
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
