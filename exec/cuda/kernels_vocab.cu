// The kernels at the vocabulary's ends of exec/cuda/kernels.hpp (see kernels.cu): the token
// (and position) embedding and the cross-entropy over a vocabulary sharded or not.
#include "exec/cuda/kernels_common.cuh"

namespace dtsim::exec::cuda {

using namespace kernels_detail;  // the helpers of kernels_common.cuh

namespace {

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

}  // namespace

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

}  // namespace dtsim::exec::cuda
