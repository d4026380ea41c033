// The attention kernels of exec/cuda/kernels.hpp (see kernels.cu): the core with its causal
// softmax and dropout, FlashAttention's memory (probabilities made again in the backward),
// context parallelism's keys in position order, column copies, rotary positions and the packing
// of multi-head latent attention's queries, keys and values.
#include "exec/cuda/kernels_common.cuh"

namespace dtsim::exec::cuda {

using namespace kernels_detail;  // the helpers of kernels_common.cuh

namespace {

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

// kvp[p, :] = kv[key row of (b, p), :] for the S positions of sequence b; width = G·(D + Dv).
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

// Column i of a head's D turned columns at `position`, from its pair (a, b): columns k and
// k + D/2, k = i mod D/2 (the rotate-half layout, exec/cpu's rotate_row), by position ·
// theta^(-2k/D); sign -1 turns back.
__device__ float turn_pair(float a, float b, int i, int D, double position, double theta,
                           float sign) {
  const int half = D / 2;
  const int k = i < half ? i : i - half;
  const double angle = position * pow(theta, -2.0 * k / D);
  const auto c = static_cast<float>(cos(angle));
  const auto sn = sign * static_cast<float>(sin(angle));
  return i < half ? a * c - b * sn : a * sn + b * c;
}

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
      y = turn_pair(load(in, base + k), load(in, base + k + half), i, D,
                    static_cast<double>(positions != nullptr ? positions[s] : s), theta, sign);
    } else {
      y = load(in, e);
    }
    store(out, e, accumulate ? load(out, e) + y : y);
  }
}

// ---- multi-head latent attention ------------------------------------------------------------

// Column j of the Dr columns x[at ...] turned by position `position` (rope_kernel's rotate-half
// pairs, exec/cpu's rotate_row): the turn of one element, read from its pair.
template <class T>
__device__ float turned_column(const T* x, std::int64_t at, int j, int Dr, int position,
                               double theta, float sign) {
  const int half = Dr / 2;
  const int k = j < half ? j : j - half;
  return turn_pair(load(x, at + k), load(x, at + k + half), j, Dr, position, theta, sign);
}

// exec/cpu's mla_pack_forward, one thread per element of qkv[rows, 2·H·(Dn + Dr) + H·Dv]: a
// head's query (its Dr columns turned), its key (Dn columns of kv, then k_rope turned: one for
// all heads) and its value (Dv columns of kv). Without q (null) its columns stay as they were.
template <class T>
__global__ void mla_pack_kernel(T* qkv, const T* q, const T* kv, const T* k_rope, std::int64_t rows,
                                int S, const int* positions, int H, int Dn, int Dr, int Dv,
                                double theta) {
  const int Dqk = Dn + Dr;
  const std::int64_t q_width = static_cast<std::int64_t>(H) * Dqk;
  const std::int64_t kv_width = static_cast<std::int64_t>(H) * (Dn + Dv);
  const std::int64_t width = 2 * q_width + static_cast<std::int64_t>(H) * Dv;
  const std::int64_t n = rows * width;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t r = e / width, col = e % width;
    const int s = static_cast<int>(r % S);
    const int position = positions != nullptr ? positions[s] : s;
    float y;
    if (col < q_width) {
      if (q == nullptr) continue;
      const std::int64_t head = r * q_width + col / Dqk * Dqk;
      const int i = static_cast<int>(col % Dqk);
      y = i < Dn ? load(q, head + i) : turned_column(q, head + Dn, i - Dn, Dr, position, theta, 1);
    } else if (col < 2 * q_width) {
      const std::int64_t h = (col - q_width) / Dqk;
      const int i = static_cast<int>((col - q_width) % Dqk);
      y = i < Dn ? load(kv, r * kv_width + h * (Dn + Dv) + i)
                 : turned_column(k_rope, r * Dr, i - Dn, Dr, position, theta, 1);
    } else {
      const std::int64_t h = (col - 2 * q_width) / Dv, d = (col - 2 * q_width) % Dv;
      y = load(kv, r * kv_width + h * (Dn + Dv) + Dn + d);
    }
    store(qkv, e, y);
  }
}

// exec/cpu's mla_pack_backward, one thread per element of a row's [dq (H·(Dn + Dr), where dq is
// not null) | dkv (H·(Dn + Dv)) | dk_rope (Dr)], each added into: dq's Dr columns turned back,
// dk_rope's the sum over the heads of their keys' Dr columns (in head order, as the CPU sums),
// turned back.
template <class T>
__global__ void mla_unpack_kernel(T* dq, T* dkv, T* dk_rope, const T* dqkv, std::int64_t rows,
                                  int S, const int* positions, int H, int Dn, int Dr, int Dv,
                                  double theta) {
  const int Dqk = Dn + Dr, half = Dr / 2;
  const std::int64_t q_width = static_cast<std::int64_t>(H) * Dqk;
  const std::int64_t kv_width = static_cast<std::int64_t>(H) * (Dn + Dv);
  const std::int64_t width = 2 * q_width + static_cast<std::int64_t>(H) * Dv;
  const std::int64_t dq_width = dq != nullptr ? q_width : 0;
  const std::int64_t part = dq_width + kv_width + Dr;
  const std::int64_t n = rows * part;
  for (std::int64_t e = first_index(); e < n; e += grid_stride()) {
    const std::int64_t r = e / part, col = e % part;
    const int s = static_cast<int>(r % S);
    const int position = positions != nullptr ? positions[s] : s;
    const std::int64_t g = r * width;  // the row's gradient
    if (col < dq_width) {
      const std::int64_t head = g + col / Dqk * Dqk;
      const int i = static_cast<int>(col % Dqk);
      const float v = i < Dn ? load(dqkv, head + i)
                             : turned_column(dqkv, head + Dn, i - Dn, Dr, position, theta, -1);
      const std::int64_t at = r * q_width + col;
      store(dq, at, load(dq, at) + v);
    } else if (col < dq_width + kv_width) {
      const std::int64_t c = col - dq_width, h = c / (Dn + Dv);
      const int i = static_cast<int>(c % (Dn + Dv));
      const float v = i < Dn ? load(dqkv, g + q_width + h * Dqk + i)
                             : load(dqkv, g + 2 * q_width + h * Dv + (i - Dn));
      const std::int64_t at = r * kv_width + c;
      store(dkv, at, load(dkv, at) + v);
    } else {
      const int j = static_cast<int>(col - dq_width - kv_width);
      const int k = j < half ? j : j - half;
      float a = 0, b = 0;
      for (int h = 0; h < H; ++h) {
        const std::int64_t at = g + q_width + static_cast<std::int64_t>(h) * Dqk + Dn;
        a += load(dqkv, at + k);
        b += load(dqkv, at + k + half);
      }
      const std::int64_t at = r * Dr + j;
      store(dk_rope, at, load(dk_rope, at) + turn_pair(a, b, j, Dr, position, theta, -1));
    }
  }
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

// Per sequence b: scores[h] = scale · q_h · k_{kv(h)}^T, the heads batched by head_batches, the
// causal softmax of every head's rows, then out_h = probs_h · v_{kv(h)}. qkv rows hold
// [q heads | k heads | v heads], D values each but the values' Dv (v_dim, or D).
void Kernels::attention_forward(void* out, void* probs, const void* qkv, int B, int S, int H, int G,
                                int D, const DropoutSite* dropout, std::uint8_t* mask,
                                void* dropped, float* lse, int v_dim) {
  if (B == 0 || S == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int Dv = v_dim > 0 ? v_dim : D, width = (H + G) * D + G * Dv;
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
    char* o = static_cast<char*>(out) + static_cast<std::size_t>(b) * S * H * Dv * e;
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
      gemm(impl_->blas, false, false, S, Dv, S, 1.0f,
           {weights + hb.head * SS * e, t, S, hb.head_step * SS},
           {rows + ((H + G) * D + hb.kv * Dv) * e, t, width,
            static_cast<long long>(hb.kv_step) * Dv},
           0.0f, o + hb.head * Dv * e, t, H * Dv, static_cast<long long>(hb.head_step) * Dv,
           hb.count);
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
                                 const DropoutSite* dropout, int v_dim) {
  if (B == 0 || S == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int Dv = v_dim > 0 ? v_dim : D, width = (H + G) * D + G * Dv, group = H / G;
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
    const char* dO = static_cast<const char*>(dout) + static_cast<std::size_t>(b) * S * H * Dv * e;
    const char* ds = static_cast<const char*>(dscores);
    // dP_h = dO_h · v_{kv(h)}^T: heads of Dv values on both sides.
    heads_by_kv(impl_->blas, t, e, batches, S, S, Dv, 1.0f, dO, H * Dv, rows + (H + G) * D * e,
                width, dprobs);
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
      gemm(impl_->blas, true, false, S, Dv, S, 1.0f, {weights + r * SS * e, t, S, group * SS},
           {dO + r * Dv * e, t, H * Dv, static_cast<long long>(group) * Dv}, 1.0f,
           drows + (H + G) * D * e, t, width, Dv, G);
    }
  }
}

void Kernels::attention_forward_cp(void* out, void* probs, const void* qkv, const void* kv,
                                   const int* qpos, const int* order, int cp, int B, int Sq, int H,
                                   int G, int D, const DropoutSite* dropout, std::uint8_t* mask,
                                   void* dropped, float* lse, int v_dim) {
  if (B == 0 || Sq == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int Dv = v_dim > 0 ? v_dim : D;
  const int S = cp * Sq, width = (H + G) * D + G * Dv, kv_width = G * (D + Dv);
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
    char* o = static_cast<char*>(out) + static_cast<std::size_t>(b) * Sq * H * Dv * e;
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
      gemm(impl_->blas, false, false, Sq, Dv, S, 1.0f,
           {weights + hb.head * QS * e, t, S, hb.head_step * QS},
           {kvp + (G * D + hb.kv * Dv) * e, t, kv_width, static_cast<long long>(hb.kv_step) * Dv},
           0.0f, o + hb.head * Dv * e, t, H * Dv, static_cast<long long>(hb.head_step) * Dv,
           hb.count);
    }
  }
}

void Kernels::attention_backward_cp(void* dqkv, void* dkv, const void* dout, const void* qkv,
                                    const void* kv, const void* probs, const int* qpos,
                                    const int* order, int cp, int B, int Sq, int H, int G, int D,
                                    float dropout_rate, const std::uint8_t* mask,
                                    const void* dropped, const float* lse,
                                    const DropoutSite* dropout, int v_dim) {
  if (B == 0 || Sq == 0) return;  // (a grid of no blocks is a launch error)
  const cudaDataType_t t = cuda_type(act_);
  const int Dv = v_dim > 0 ? v_dim : D;
  const int S = cp * Sq, width = (H + G) * D + G * Dv, kv_width = G * (D + Dv), group = H / G;
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
    const char* dO = static_cast<const char*>(dout) + static_cast<std::size_t>(b) * Sq * H * Dv * e;
    const char* ds = static_cast<const char*>(dscores);
    // dP = dO · v^T
    heads_by_kv(impl_->blas, t, e, batches, Sq, S, Dv, 1.0f, dO, H * Dv, kvp + G * D * e, kv_width,
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
      gemm(impl_->blas, true, false, S, Dv, Sq, 1.0f, {weights + r * QS * e, t, S, group * QS},
           {dO + r * Dv * e, t, H * Dv, static_cast<long long>(group) * Dv}, 1.0f, dkvp + G * D * e,
           t, kv_width, Dv, G);
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

void Kernels::mla_pack_forward(void* qkv, const void* q, const void* kv, const void* k_rope, int B,
                               int S, int H, int Dn, int Dr, int Dv, double theta,
                               const int* positions) {
  // (RoPE turns pairs of columns: model specs refuse an odd qk_rope_head_dim.)
  if (Dr % 2 != 0) throw CudaError("Kernels::mla_pack: an odd number of turned columns");
  const std::int64_t rows = static_cast<std::int64_t>(B) * S;
  const std::int64_t n = rows * H * (2 * (Dn + Dr) + Dv);
  if (n == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    mla_pack_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(qkv), static_cast<const A*>(q), static_cast<const A*>(kv),
        static_cast<const A*>(k_rope), rows, S, positions, H, Dn, Dr, Dv, theta);
  });
  launched("mla_pack_kernel");
}

void Kernels::mla_pack_backward(void* dq, void* dkv, void* dk_rope, const void* dqkv, int B, int S,
                                int H, int Dn, int Dr, int Dv, double theta, const int* positions) {
  // (RoPE turns pairs of columns: model specs refuse an odd qk_rope_head_dim.)
  if (Dr % 2 != 0) throw CudaError("Kernels::mla_pack: an odd number of turned columns");
  const std::int64_t rows = static_cast<std::int64_t>(B) * S;
  const std::int64_t n = rows * ((dq != nullptr ? static_cast<std::int64_t>(H) * (Dn + Dr) : 0) +
                                 static_cast<std::int64_t>(H) * (Dn + Dv) + Dr);
  if (n == 0) return;
  with_type(act_, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    mla_unpack_kernel<<<blocks_for(n), kThreads, 0, impl_->stream>>>(
        static_cast<A*>(dq), static_cast<A*>(dkv), static_cast<A*>(dk_rope),
        static_cast<const A*>(dqkv), rows, S, positions, H, Dn, Dr, Dv, theta);
  });
  launched("mla_unpack_kernel");
}

}  // namespace dtsim::exec::cuda
