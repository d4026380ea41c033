// The mixture-of-experts kernels of exec/cuda/kernels.hpp (see kernels.cu): routing, the
// sort of the token copies by expert, their dispatch and combine, and the backwards.
#include "exec/cuda/kernels_common.cuh"

namespace dtsim::exec::cuda {

using namespace kernels_detail;  // the helpers of kernels_common.cuh

namespace {

// ---- mixture of experts -------------------------------------------------------------------

// What a sum of sigmoid scores starts from (exec/cpu's kSigmoidFloor: DeepSeek-V3's 1e-20).
constexpr double kSigmoidFloor = 1e-20;

// A router logit's sigmoid score, in double (exec/cpu's sigmoid_of).
__device__ double sigmoid_score(float logit) {
  return 1.0 / (1.0 + exp(-static_cast<double>(logit)));
}

// One thread per token: its top k of E logits (ties to the lower index) by repeated selection,
// and their gates in double (exec/core/gating.hpp), as exec/cpu's moe_route.
template <class T>
__global__ void moe_route_kernel(int* experts, float* gates, const T* logits, std::int64_t tokens,
                                 int E, int k, Gating gating) {
  const bool normalize = gating.normalize;
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
    if (gating.sigmoid) {
      double sum = kSigmoidFloor;
      for (int j = 0; j < k; ++j) sum += sigmoid_score(load(logits, row + chosen[j]));
      for (int j = 0; j < k; ++j) {
        const double s = sigmoid_score(load(logits, row + chosen[j]));
        gates[t * k + j] = static_cast<float>(gating.scale * (normalize ? s / sum : s));
      }
      continue;
    }
    const float top = load(logits, row + chosen[0]);
    double sum = 0;
    for (int j = 0; j < (normalize ? k : E); ++j) {
      sum += exp(static_cast<double>(load(logits, row + (normalize ? chosen[j] : j)) - top));
    }
    for (int j = 0; j < k; ++j) {
      const double p = exp(static_cast<double>(load(logits, row + chosen[j]) - top)) / sum;
      gates[t * k + j] = static_cast<float>(gating.scale == 1.0f ? p : gating.scale * p);
    }
  }
}

// One thread per token: the logits' gradient through its k gates: their sigmoids, the softmax
// over all E, or the softmax over the k (exec/cpu's moe_route_backward).
template <class T>
__global__ void moe_route_backward_kernel(T* dlogits, const float* dgates, const float* gates,
                                          const int* experts, const T* logits, std::int64_t tokens,
                                          int E, int k, Gating gating) {
  for (std::int64_t t = first_index(); t < tokens; t += grid_stride()) {
    const std::int64_t first = t * k;
    float dot = 0;
    for (int j = 0; j < k; ++j) dot += gates[first + j] * dgates[first + j];
    if (gating.sigmoid) {
      const std::int64_t row = t * E;
      double sum = kSigmoidFloor;
      for (int j = 0; j < k; ++j) sum += sigmoid_score(load(logits, row + experts[first + j]));
      for (int j = 0; j < k; ++j) {
        const std::int64_t i = row + experts[first + j];
        const double s = sigmoid_score(load(logits, i));
        const double ds = gating.normalize
                              ? (gating.scale * static_cast<double>(dgates[first + j]) - dot) / sum
                              : gating.scale * static_cast<double>(dgates[first + j]);
        store(dlogits, i, load(dlogits, i) + static_cast<float>(ds * s * (1.0 - s)));
      }
      continue;
    }
    if (logits != nullptr) {
      const std::int64_t row = t * E;
      float top = load(logits, row);
      for (int e = 1; e < E; ++e) top = fmaxf(top, load(logits, row + e));
      double sum = 0;
      for (int e = 0; e < E; ++e) sum += exp(static_cast<double>(load(logits, row + e) - top));
      // Each element in fp32 and stored once (a chosen expert's two terms nearly cancel: a
      // bf16 rounding between them would cost most of its gradient).
      for (int e = 0; e < E; ++e) {
        const float p =
            static_cast<float>(exp(static_cast<double>(load(logits, row + e) - top)) / sum);
        float v = load(dlogits, row + e) - p * dot;
        for (int j = 0; j < k; ++j) {
          if (experts[first + j] == e) v += gates[first + j] * dgates[first + j];
        }
        store(dlogits, row + e, v);
      }
      continue;
    }
    const float per_gate = gating.scale == 1.0f ? dot : dot / gating.scale;
    for (int j = 0; j < k; ++j) {
      const std::int64_t i = t * E + experts[first + j];
      store(dlogits, i, load(dlogits, i) + gates[first + j] * (dgates[first + j] - per_gate));
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

// One block per copy (row p): dy[p] = gate · dout[token] (written whole); dgates[slot] +=
// dout[token] · y[p].
template <class T>
__global__ void moe_combine_backward_kernel(T* dy, float* dgates, const T* dout, const T* y,
                                            const float* gates, const int* order, int C, int k) {
  const std::int64_t p = blockIdx.x;
  const int slot = order[p];
  const std::int64_t token = slot / k;
  float dot = 0;
  for (int c = static_cast<int>(threadIdx.x); c < C; c += static_cast<int>(blockDim.x)) {
    const float d = load(dout, token * C + c);
    store(dy, p * C + c, gates[slot] * d);
    dot += d * load(y, p * C + c);
  }
  dot = block_sum(dot);
  if (threadIdx.x == 0) dgates[slot] += dot;
}

}  // namespace

void Kernels::moe_route(int* experts, float* gates, const void* logits, int T, int E, int k,
                        const Gating& gating) {
  if (T == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_route_kernel<<<blocks_for(T), kThreads, 0, impl_->stream>>>(
        experts, gates, static_cast<const A*>(logits), T, E, k, gating);
  });
  launched("moe_route_kernel");
}

void Kernels::moe_route_backward(void* dlogits, const float* dgates, const float* gates,
                                 const int* experts, const void* logits, int T, int E, int k,
                                 const Gating& gating) {
  // (One expert a token, its gate normalized: a constant, no gradient; exec/cpu's.)
  if (T == 0 || (gating.normalize && k == 1)) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    moe_route_backward_kernel<<<blocks_for(T), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(dlogits), dgates, gates, experts, static_cast<const A*>(logits), T, E, k,
        gating);
  });
  launched("moe_route_backward_kernel");
}

void Kernels::moe_dispatch(void* dispatched, int* order, float* rows, const void* x,
                           const int* experts, int T, int C, int k, int E) {
  const std::int64_t slots = static_cast<std::int64_t>(T) * k;
  const int threads = moe_order_threads(E);
  if (threads == 0) {
    throw CudaError("moe_dispatch: " + std::to_string(E) +
                    " experts: their counts for a warp of threads do not fit in 48 KiB of "
                    "shared memory (at most 372 experts)");
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
  moe_token_sums(dx, ddispatched, nullptr, order, T, C, k, true);
}

void Kernels::moe_combine(void* out, const void* y, const float* gates, const int* order, int T,
                          int C, int k) {
  moe_token_sums(out, y, gates, order, T, C, k, false);
}

void Kernels::moe_token_sums(void* dst, const void* rows, const float* gates, const int* order,
                             int T, int C, int k, bool add) {
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
                           impl_->stream>>>(static_cast<A*>(dst), static_cast<const A*>(rows),
                                            where, gates, order, T, C, k, add);
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

}  // namespace dtsim::exec::cuda
