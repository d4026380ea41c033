// GPU kernels of the reference executor: the forward and backward of every op of a GPT-style
// decoder, the CUDA counterparts of exec/cpu/kernels.hpp (same shapes, same layouts, same
// arithmetic), which are their numerical reference (tests/exec/cuda/kernels_cuda_test.cpp).
//
// Mixed precision as Megatron-LM trains: activations and their gradients in the run's
// activation type (bf16, or fp32 for checks), GEMMs on the tensor cores with fp32 accumulation
// (cublasGemmEx, CUBLAS_COMPUTE_32F; fp32 runs use CUBLAS_COMPUTE_32F_PEDANTIC, without TF32),
// every reduction (norm statistics, softmax sums, loss) in fp32, and weights, weight gradients
// and AdamW state in fp32 (the master copy). A linear op reads an activation-typed working copy
// of its weight (`cast`), as Megatron's fp16/bf16 modules do; its weight gradient accumulates
// in fp32.
//
// Plain C++ interface: pointers are device pointers; no CUDA type leaks out of exec/cuda. All
// work of one Kernels object goes to its own stream, in order. What waits for the GPU: the host
// transfers (upload*, download*), synchronize, and seconds (for its end mark). A scratch buffer
// grows in the stream's order (the old one freed after the kernels queued before; on a GPU
// without memory pools, cudaFree, which waits for the device). Every CUDA and cuBLAS call is
// checked: a failure throws CudaError naming the call (kernel launches included).
//
// Determinism: no atomics. Column reductions (bias, norm weight, embedding gradients) sum in a
// fixed order: each chunk of rows in order, then the chunks' sums in order (kernels.cu), so a
// run repeats bit for bit on the same GPU.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "exec/core/gating.hpp"
#include "exec/cuda/calibrate_cuda.hpp"  // CudaError

namespace dtsim::exec::cuda {

// The activation type of a run.
enum class Dtype { F32, BF16 };

inline std::size_t dtype_bytes(Dtype t) {
  return t == Dtype::F32 ? 4 : 2;
}

// The threads of moe_dispatch's counting block for E experts: as many as the counts fit in 48
// KiB of shared memory (the most a block gets without opting in), one int per expert and
// thread and one per expert, E x (threads + 1) x 4 bytes; a multiple of 32, at most 1024; 0
// where not even a warp's fit (over 372 experts).
constexpr int moe_order_threads(int experts) {
  constexpr int kInts = 48 * 1024 / 4;
  if (experts <= 0) return 32;
  const int fit = (kInts / experts - 1) / 32 * 32;
  if (fit < 32) return 0;
  return fit < 1024 ? fit : 1024;
}

// Device memory, released on destruction. Given a stream (a cudaStream_t), it is allocated
// and freed in that stream's order (cudaMallocAsync, cudaFreeAsync), which never waits for the
// device. cudaFree does: a rank whose host waits there for its NCCL kernels, while they wait
// for a peer that waits for this rank's next collective, hangs (NCCL's documentation warns of
// it). The executor's buffers, allocated and freed inside steps, take the compute stream;
// without one (calibration, tests) it is plain cudaMalloc and cudaFree.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes, void* stream = nullptr);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return p_; }
  float* f32() const { return static_cast<float*>(p_); }
  int* i32() const { return static_cast<int*>(p_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void free() noexcept;

  void* p_ = nullptr;
  std::size_t bytes_ = 0;
  void* stream_ = nullptr;
};

class Kernels {
 public:
  // Binds to `gpu` and creates a stream and a cuBLAS handle on it.
  Kernels(int gpu, Dtype activations);
  ~Kernels();
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;

  Dtype activations() const { return act_; }
  // The stream all of this object's work goes to (a cudaStream_t), for a communication
  // backend that orders its own streams after it with events.
  void* stream() const;

  // ---- host transfers (ordered on the stream; download waits for it) --------------------
  // n floats from the host into activation-typed `dst` (rounded to bf16 when that is the type).
  void upload(void* dst, const float* host, std::int64_t n);
  void upload_f32(float* dst, const float* host, std::int64_t n);
  void upload_i32(int* dst, const int* host, std::int64_t n);
  // n activation-typed values of `src` to the host, as floats.
  void download(float* host, const void* src, std::int64_t n);
  void download_f32(float* host, const float* src, std::int64_t n);
  void download_bytes(void* host, const void* src, std::size_t bytes);  // masks
  void zero(void* dst, std::size_t bytes);
  void fill_bytes(void* dst, std::size_t bytes, unsigned char value);
  void copy(void* dst, const void* src, std::size_t bytes);  // device to device
  void synchronize();
  // Waits for the stream, then gives the memory that stream-ordered frees returned to the
  // GPU's pool back to the GPU (cudaMemPoolTrimTo), so that an allocation larger than any freed
  // block can succeed: the pool keeps what it is given (a release threshold of all memory, set
  // by the constructor, as a caching allocator would) until this is called.
  void return_free_memory();
  // The stream to give DeviceBuffers allocated and freed inside steps (this object's stream),
  // or null where the GPU has no memory pools (plain cudaMalloc and cudaFree).
  void* allocation_stream() const;
  // Called when scratch that grows inside a step finds the GPU full, before one more try: the
  // owner's pool gives its released buffers back (CudaDevice's, then return_free_memory).
  void set_out_of_memory(std::function<void()> free_released);

  // Timing on the stream with CUDA events: mark() records an event after the work queued so
  // far and returns its number; seconds(a, b) is the GPU time between marks a and b (it waits
  // for b). clear_marks() starts the numbering again (the events are reused). mark(stream)
  // records on another stream of this GPU (a cudaStream_t: a collective's), numbered with the
  // others, so that its work is timed on the same clock.
  int mark(void* stream = nullptr);
  double seconds(int a, int b);
  void clear_marks();

  // Values in [-scale/2, scale/2) from a hash of (seed, index): data for timings and tests
  // (the tensor cores see varied bits, as in training; zeros draw less power).
  void fill_random(void* dst, std::int64_t n, unsigned seed, float scale = 1.0f);
  void fill_random_f32(float* dst, std::int64_t n, unsigned seed, float scale = 1.0f);

  // out[n] = in[n] in the activation type: a weight's working copy from its fp32 master.
  void cast(void* out, const float* in, std::int64_t n);

  // ---- the ops (shapes as exec/cpu/kernels.hpp; `void*` = activation type) ---------------
  // out[T,N] = in[T,K] · w[K,N] (+ bias[N]); with w_transposed w is stored [N,K] (a tied head
  // reading the embedding table).
  void matmul_forward(void* out, const void* in, const void* w, const float* bias, int T, int K,
                      int N, bool w_transposed = false);
  // din[T,K] += dout · w^T;  dw[K,N] += in^T · dout (fp32; transposed: dw[N,K] += dout^T · in);
  // dbias[N] += column sums of dout. Any of din, dw, dbias may be null (not wanted).
  void matmul_backward(void* din, float* dw, float* dbias, const void* dout, const void* in,
                       const void* w, int T, int K, int N, bool w_transposed = false);
  // din[T,K] = dout · w^T, written whole (beta 0: din is not read).
  void matmul_input_grad(void* din, const void* dout, const void* w, int T, int K, int N,
                         bool w_transposed = false);

  // LayerNorm (eps 1e-5) or RMSNorm over C; mean[T] and rstd[T] kept in fp32.
  void norm_forward(void* out, float* mean, float* rstd, const void* in, const float* w,
                    const float* b, int T, int C, bool rms);
  // din, dw and db may each be null.
  void norm_backward(void* din, float* dw, float* db, const void* dout, const void* in,
                     const float* w, const float* mean, const float* rstd, int T, int C, bool rms);

  void add_forward(void* out, const void* a, const void* b, std::int64_t n);
  // d[n] += scale · dout (a residual's backward; the loss gradient's 1/(m·dp) scaling).
  void accumulate(void* d, const void* dout, std::int64_t n, float scale = 1.0f);

  // The same in fp32 (gradient buffers), whatever the activation type.
  void accumulate_f32(float* d, const float* x, std::int64_t n, float scale = 1.0f);
  // out[0] = the mean of in[n], summed in a fixed order (one block).
  void mean(float* out, const float* in, std::int64_t n);

  void gelu_forward(void* out, const void* in, std::int64_t n);
  // The activations' backwards write din whole (exec/cpu/kernels.hpp).
  void gelu_backward(void* din, const void* in, const void* dout, std::int64_t n);
  void swiglu_forward(void* out, const void* in, int T, int F);
  void swiglu_backward(void* din, const void* in, const void* dout, int T, int F);

  // Dropout (exec/cpu/kernels.hpp: Dropout), its masks the CPU's: element i of sequence s is
  // kept when the top 24 bits of counter_hash(stream, s, i) over 2^24 are >= rate. A row's
  // position is positions[row % Sq] (context parallelism), else row % Sq.
  struct DropoutSite {
    std::uint64_t stream = 0;
    float rate = 0;
    std::int64_t first_sequence = 0;  // of the micro-batch's first sequence
    int first_row = 0;                // of the rows given, among the micro-batch's B·Sq
    int Sq = 1;
    int head_offset = 0;  // attention: this rank's first head among all (tensor parallelism)
    // The positions of a sequence's Sq rows (device, int; context parallelism), or null: 0 ...
    const int* positions = nullptr;
  };
  // Rows [T, C] of the residual stream (element (position, c) has index position·C + c):
  // out = dropout(in), plus skip where skip is not null (the residual connection after a
  // block); out may be in. mask[T·C]: a byte per element, 1 where kept.
  void dropout_forward(void* out, std::uint8_t* mask, const void* in, const void* skip,
                       const DropoutSite& d, int T, int C);
  // din += dout ⊙ mask / (1 - rate).
  void dropout_backward(void* din, const std::uint8_t* mask, const void* dout, float rate,
                        std::int64_t n);

  // Causal attention with grouped KV heads, as Megatron-LM computed it before fused kernels:
  // per (sequence, head) the scores q·k^T (fp32), a masked softmax into probs[B,H,S,S]
  // (activation type, kept for backward), and probs · v. GEMMs on cuBLAS. With `dropout`:
  // attention dropout of the probabilities (element (head, query, key) has index
  // (head_offset + h)·S² + q·S + k in its sequence), its mask and the probabilities after it
  // in mask and dropped [B,H,S,S]; the values read dropped, as exec/cpu's attention does.
  // FlashAttention's memory (exec/cpu/kernels.hpp: AttentionOptions::lse) where lse (fp32
  // [B,H,S]) is given: probs, mask and dropped are null, one sequence's probabilities live in
  // scratch while it computes, the forward writes each row's log-sum-exp, and the backward
  // computes the scores again (cuBLAS), the probabilities from lse and the masks from `dropout`
  // (its site, whose rate the backward uses). The same GEMMs as the unfused path, on one
  // sequence's s² scratch (its probabilities, and dropout's; with the fp32 scores the unfused
  // path has too, scratch that the device's memory use does not count): FlashAttention's
  // memory between the passes, not its fused kernel's speed.
  // v_dim (0: D): the values' head width, multi-head latent attention's where it is not D
  // (exec/cpu/kernels.hpp: AttentionOptions::v_dim): qkv's rows (H + G)·D + G·v_dim wide, out's
  // H·v_dim, the scores' scale 1/sqrt(D).
  void attention_forward(void* out, void* probs, const void* qkv, int B, int S, int H, int G, int D,
                         const DropoutSite* dropout = nullptr, std::uint8_t* mask = nullptr,
                         void* dropped = nullptr, float* lse = nullptr, int v_dim = 0);
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* probs, int B,
                          int S, int H, int G, int D, float dropout_rate = 0,
                          const std::uint8_t* mask = nullptr, const void* dropped = nullptr,
                          const float* lse = nullptr, const DropoutSite* dropout = nullptr,
                          int v_dim = 0);
  // Context parallelism (exec/cpu/kernels.hpp: AttentionOptions): this rank's Sq queries of
  // each of B sequences, at positions qpos[Sq], attend the keys up to their positions among
  // the S = cp·Sq keys of kv [cp·B·Sq, G·(D + v_dim)] (cp rank r's B·Sq rows r-th, each row K
  // then V);
  // order[p] is position p's key as an index into a sequence's cp·Sq (rank r's token s:
  // r·Sq + s). The keys are gathered into position order first (scratch), so the GEMMs are
  // attention_forward's. probs, mask, dropped [B, H, Sq, S]. The backward adds dq into dqkv's
  // q columns and dk, dv into dkv (kv's layout).
  // lse [B, H, Sq], dropout and v_dim as attention_forward's and attention_backward's.
  void attention_forward_cp(void* out, void* probs, const void* qkv, const void* kv,
                            const int* qpos, const int* order, int cp, int B, int Sq, int H, int G,
                            int D, const DropoutSite* dropout, std::uint8_t* mask, void* dropped,
                            float* lse = nullptr, int v_dim = 0);
  void attention_backward_cp(void* dqkv, void* dkv, const void* dout, const void* qkv,
                             const void* kv, const void* probs, const int* qpos, const int* order,
                             int cp, int B, int Sq, int H, int G, int D, float dropout_rate,
                             const std::uint8_t* mask, const void* dropped,
                             const float* lse = nullptr, const DropoutSite* dropout = nullptr,
                             int v_dim = 0);
  // Multi-head latent attention (exec/cpu/kernels.hpp: mla_pack_forward, mla_pack_backward, the
  // same layouts): q, kv and k_rope packed into qkv [B·S, 2·H·(Dn + Dr) + H·Dv] for the core
  // (G = H, D = Dn + Dr, v_dim = Dv), each head's last Dr query and key columns turned (RoPE's
  // rotate-half over those columns); the backward adds into dq, dkv and dk_rope (summed over
  // the heads), turned back. q and dq may be null (context parallelism's keys and values alone:
  // qkv's q columns then left as they were). positions as rope_forward's.
  void mla_pack_forward(void* qkv, const void* q, const void* kv, const void* k_rope, int B, int S,
                        int H, int Dn, int Dr, int Dv, double theta,
                        const int* positions = nullptr);
  void mla_pack_backward(void* dq, void* dkv, void* dk_rope, const void* dqkv, int B, int S, int H,
                         int Dn, int Dr, int Dv, double theta, const int* positions = nullptr);
  // dst[T, width] = columns [begin, begin + width) of src[T, src_width]; add_columns adds
  // src[T, width] into those columns of dst[T, dst_width] (activations).
  void copy_columns(void* dst, const void* src, int T, int src_width, int begin, int width);
  void add_columns(void* dst, const void* src, int T, int dst_width, int begin, int width);

  // positions (device, int [S]): the position of each of a sequence's S rows (context
  // parallelism), or null: 0 ... S-1. So for the embedding's learned positions.
  void rope_forward(void* out, const void* qkv, int B, int S, int H, int G, int D, double theta,
                    const int* positions = nullptr);
  void rope_backward(void* dqkv, const void* dout, int B, int S, int H, int G, int D, double theta,
                     const int* positions = nullptr);

  // tokens[B·S] on the device; wte holds rows [vocab_begin, vocab_begin + rows) (fp32 master);
  // wpe may be null.
  void embedding_forward(void* out, const int* tokens, const float* wte, int rows, const float* wpe,
                         int B, int S, int C, int vocab_begin, const int* positions = nullptr);
  void embedding_backward(float* dwte, int rows, float* dwpe, const void* dout, const int* tokens,
                          int B, int S, int C, int vocab_begin, const int* positions = nullptr);

  // Softmax cross-entropy, vocab-parallel, in steps as exec/cpu: rowmax[T]; sums[2T] (sum of
  // exp(z - rowmax), and the target logit where this shard holds it); then row_loss[T] (fp32,
  // on the device; their mean is the loss) and dlogits = (softmax - onehot) / T from the
  // (tp-reduced) statistics. cross_entropy_rescale: sums[T] *= exp(local_max - global_max).
  void cross_entropy_max(float* rowmax, const void* logits, int T, int V);
  void cross_entropy_sums(float* sums, const void* logits, const float* rowmax, const int* targets,
                          int T, int V, int vocab_begin);
  void cross_entropy_sharded(void* dlogits, float* row_loss, const void* logits,
                             const float* rowmax, const float* sums, const int* targets, int T,
                             int V, int vocab_begin);
  void cross_entropy_rescale(float* sums, const float* local_max, const float* global_max, int T);

  // Mixture of experts (exec/cpu/kernels.hpp: moe_route ...), the CPU's choices and orders, so
  // that the GPU routes every token as the CPU does: slot j of token t is t·k + j. experts and
  // order int [T·k]; gates and dgates fp32 [T·k]; rows fp32 [E] (each expert's copies);
  // logits, dlogits [T, E], x, dispatched, y and their gradients: activations. A token's
  // copies are summed in their rows' order, as the CPU sums them.
  // (The gating, and the logits read again where gating.reads_logits(): null where not.)
  void moe_route(int* experts, float* gates, const void* logits, int T, int E, int k,
                 const Gating& gating);
  void moe_route_backward(void* dlogits, const float* dgates, const float* gates,
                          const int* experts, const void* logits, int T, int E, int k,
                          const Gating& gating);
  void moe_dispatch(void* dispatched, int* order, float* rows, const void* x, const int* experts,
                    int T, int C, int k, int E);
  void moe_dispatch_backward(void* dx, const void* ddispatched, const int* order, int T, int C,
                             int k);
  void moe_combine(void* out, const void* y, const float* gates, const int* order, int T, int C,
                   int k);
  void moe_combine_backward(void* dy, float* dgates, const void* dout, const void* y,
                            const float* gates, const int* order, int T, int C, int k);

  // Gradient clipping (exec/cpu/kernels.hpp): acc[0] (fp32) += the sum of the squares of x's n
  // fp32 values, summed in double in a fixed order (per block, then the blocks in order: the
  // same bits every run); x *= min(1, max_norm / (sqrt(norm_sq[0]) + 1e-6)), the coefficient
  // computed on the device from norm_sq (no wait on the host).
  void sum_squares(float* acc, const float* x, std::int64_t n);
  void clip_scale(float* x, std::int64_t n, const float* norm_sq, float max_norm);

  // AdamW on fp32 masters, step t >= 1 (bias corrections computed here).
  void adamw(float* params, const float* grads, float* m, float* v, std::int64_t n, float lr,
             float beta1, float beta2, float eps, float weight_decay, int t);

 private:
  // din[T,K] = dout · w^T + beta · din (beta 0: din not read); w as matmul_backward's.
  void input_grad(void* din, const void* dout, const void* w, int T, int K, int N,
                  bool w_transposed, float beta);
  // moe_dispatch_backward (add: into dst, no gates) and moe_combine (from zero, weighted by the
  // gates): each token's row of dst [T, C], the sum of its k copies' rows in `rows`' order.
  void moe_token_sums(void* dst, const void* rows, const float* gates, const int* order, int T,
                      int C, int k, bool add);
  // FlashAttention's backward, sequence b (of the micro-batch): its H·Sq rows of S
  // probabilities again into probs from the scores made again (fp32, scores) and the rows'
  // log-sum-exp (lse, the sequence's [H, Sq]), and with `dropout` its mask and dropped
  // probabilities; qpos as attention_forward_cp's (null: 0 ... Sq-1).
  void remake_probabilities(void* probs, std::uint8_t* mask, void* dropped, const float* scores,
                            const float* lse, int H, int Sq, int S, const int* qpos,
                            const DropoutSite* dropout, int b);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  Dtype act_;
};

}  // namespace dtsim::exec::cuda
