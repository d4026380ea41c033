// Where the Program runner's tensors live and what computes on them: the interface a backend
// implements for the runner (exec/core/runner.hpp). The CPU implements it with its fp32 kernels
// (exec/cpu/device.hpp); a GPU implements it with exec/cuda/kernels.hpp.
//
// The runner holds views: ranges of a device's memory with a type. Activations and their
// gradients are in the device's activation type (fp32 on the CPU; bf16 or fp32 on a GPU);
// weights, weight gradients and optimizer state are fp32 (the master copy); token ids are
// int32, dropout masks a byte per element. The ops have the shapes and layouts of
// exec/cpu/kernels.hpp, and accumulate (+=) into gradients as those do. A device may queue work and
// run it later in order (a GPU stream): only download() and synchronize() wait for it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "exec/core/gating.hpp"
#include "sim/common/error.hpp"

namespace dtsim::exec {

enum class Dtype { F32, BF16, I32, U8 };  // U8: masks

inline const char* to_string(Dtype t) {
  switch (t) {
    case Dtype::F32:
      return "fp32";
    case Dtype::BF16:
      return "bf16";
    case Dtype::I32:
      return "int32";
    case Dtype::U8:
      return "uint8";
  }
  return "?";
}

inline std::size_t bytes_of(Dtype t) {
  return t == Dtype::U8 ? 1 : t == Dtype::BF16 ? 2 : 4;
}

// n elements of one type in a device's memory. A view does not own what it points to.
struct View {
  void* p = nullptr;
  std::int64_t n = 0;
  Dtype type = Dtype::F32;

  bool empty() const { return n == 0; }
  std::int64_t size() const { return n; }
  View sub(std::int64_t offset, std::int64_t count) const {
    DTSIM_ASSERT(offset >= 0 && count >= 0 && offset + count <= n, "view range");
    return {static_cast<char*>(p) + static_cast<std::size_t>(offset) * bytes_of(type), count, type};
  }
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;
  virtual Dtype activations() const = 0;
  // True when views are host memory (the MPI backend reads and writes them as it is).
  virtual bool host_memory() const = 0;

  // ---- memory ----------------------------------------------------------------------------
  // n zeros of `type`: from the buffers released earlier where one is large enough (as a
  // framework's caching allocator does), else new.
  virtual View allocate(std::int64_t n, Dtype type) = 0;
  // As allocate, without the zeros, for a tensor that the caller writes whole before anything
  // reads it (an op's output, a collective's or a packing's destination): its values are
  // whatever the buffer last held, and the zeros' pass over memory, which no framework's
  // allocator makes (PyTorch's torch.empty) and no cost model prices, is saved. Under
  // DTEXEC_TEST_POISON_UNWRITTEN=1 (poison_unwritten_from_env) the devices fill it with bytes
  // 0xff instead (NaN in fp32 and bf16, -1 in int32), so that a kernel that reads such a tensor
  // before writing it, or a task that reads a collective's output before waiting for it, shows
  // in the loss: every test runs so (tests/exec/CMakeLists.txt), as do scripts/gpu_check.sh's
  // correctness checks; runs and benchmarks do not pay the pass.
  virtual View allocate_for_overwrite(std::int64_t n, Dtype type) { return allocate(n, type); }
  // Whether DTEXEC_TEST_POISON_UNWRITTEN asks for allocate_for_overwrite's poison (set, not
  // "0").
  static bool poison_unwritten_from_env() {
    const char* v = std::getenv("DTEXEC_TEST_POISON_UNWRITTEN");
    return v != nullptr && *v != '\0' && *v != '0';
  }
  virtual void release(View v) = 0;
  // Bytes of the tensors handed out (the sizes asked for, from allocate until release): now, and
  // the most since the device was made; and what its pool holds (its buffers, handed out or
  // kept for reuse: a tensor may take a larger released buffer whole).
  struct MemoryUse {
    std::int64_t in_use = 0, peak = 0, reserved = 0;
  };
  virtual MemoryUse memory_use() const = 0;
  virtual void zero(View v) = 0;
  virtual void copy(View dst, View src) = 0;  // same type and size
  // Host values into a view (converted to its type; ints into I32 views), and back.
  virtual void upload(View dst, const float* host) = 0;
  virtual void upload_ints(View dst, const int* host) = 0;
  virtual void download(float* host, View src) = 0;  // waits for the work queued before
  virtual void synchronize() = 0;

  // ---- timing ------------------------------------------------------------------------------
  // mark() notes the point the device has reached in the work queued so far (a CUDA event; the
  // clock, on a device that runs work as it is called) and returns its number; elapsed(a, b)
  // is the seconds between marks a and b (it waits for b). clear_marks() numbers from 0 again.
  virtual int mark() = 0;
  virtual double elapsed(int a, int b) = 0;
  virtual void clear_marks() = 0;

  // ---- ops (shapes: exec/cpu/kernels.hpp; "act" = the activation type) ----------------------
  // w: the weight as the GEMM reads it (act), [K,N], or [N,K] when transposed (a tied head
  // reading the embedding table). bias, dw and dbias fp32; empty views are not wanted.
  virtual void matmul_forward(View out, View in, View w, View bias, int T, int K, int N,
                              bool w_transposed) = 0;
  virtual void matmul_backward(View din, View dw, View dbias, View dout, View in, View w, int T,
                               int K, int N, bool w_transposed) = 0;
  // din = dout · w^T written whole, for a gradient this GEMM makes first (matmul_backward adds
  // into one): no zeros before it and no read of them. By default as those two.
  virtual void matmul_input_grad(View din, View dout, View w, int T, int K, int N,
                                 bool w_transposed) {
    zero(din);
    matmul_backward(din, View{}, View{}, dout, View{}, w, T, K, N, w_transposed);
  }
  virtual void norm_forward(View out, View mean, View rstd, View in, View w, View b, int T, int C,
                            bool rms) = 0;
  virtual void norm_backward(View din, View dw, View db, View dout, View in, View w, View mean,
                             View rstd, int T, int C, bool rms) = 0;
  virtual void add_forward(View out, View a, View b) = 0;
  // d += scale · x.
  virtual void accumulate(View d, View x, float scale = 1.0f) = 0;
  virtual void gelu_forward(View out, View in) = 0;
  // The activations' backwards write din whole (not added into).
  virtual void gelu_backward(View din, View in, View dout) = 0;
  virtual void swiglu_forward(View out, View in, int T, int F) = 0;
  virtual void swiglu_backward(View din, View in, View dout, int T, int F) = 0;
  // probs[B,H,S,S] in act.
  virtual void attention_forward(View out, View probs, View qkv, int B, int S, int H, int G,
                                 int D) = 0;
  virtual void attention_backward(View dqkv, View dout, View qkv, View probs, int B, int S, int H,
                                  int G, int D) = 0;
  // positions: I32 [S], the position in its sequence of each of a sequence's S rows; empty:
  // 0 ... S-1 (context parallelism gives a rank other positions).
  virtual void rope_forward(View out, View qkv, int B, int S, int H, int G, int D, double theta,
                            View positions) = 0;
  virtual void rope_backward(View dqkv, View dout, int B, int S, int H, int G, int D, double theta,
                             View positions) = 0;
  // tokens I32; wte fp32 [rows, C] for vocabulary rows [vocab_begin, vocab_begin + rows); wpe
  // fp32 or empty, read at the rows' positions (as rope's).
  virtual void embedding_forward(View out, View tokens, View wte, View wpe, int B, int S, int C,
                                 int vocab_begin, View positions) = 0;
  virtual void embedding_backward(View dwte, View dwpe, View dout, View tokens, int B, int S, int C,
                                  int vocab_begin, View positions) = 0;

  // ---- context parallelism and dropout (exec/cpu/kernels.hpp: AttentionOptions, Dropout) ----
  // A device that has these says so (has()); the runner refuses a plan that needs what its
  // device lacks before it starts.
  enum class Feature {
    ContextParallelism,
    Dropout,
    MixtureOfExperts,
    FlashAttention,
    GradClip,
    LatentAttention
  };
  virtual bool has(Feature) const { return false; }
  // Dropout: the kernels' Dropout, its positions an I32 view (empty: 0 ... Sq-1).
  struct DropoutSite {
    std::uint64_t stream = 0;
    float rate = 0;
    std::int64_t first_sequence = 0;
    int first_row = 0;
    int Sq = 1;
    View positions;
    int head_offset = 0;
  };
  // The attention core with what attention_forward lacks: kv (act, [cp·B·Sq, G·(D + v_dim)];
  // empty: the keys of qkv), qpos and order (I32) for context parallelism; attention dropout when
  // `dropout` is set, its mask (U8) and the probabilities after it (act) [B, H, Sq, S].
  // FlashAttention's memory (Feature::FlashAttention) when lse (fp32 [B, H, Sq]) is given: the
  // rows' log-sum-exp kept instead of the probabilities (probs, mask and dropped empty; the
  // backward computes them again).
  // v_dim: the values' head width where it is not D (multi-head latent attention's,
  // Feature::LatentAttention; the kernels' AttentionOptions::v_dim); 0: D.
  struct Attention {
    View kv;
    int cp = 1;
    View qpos, order;
    const DropoutSite* dropout = nullptr;
    View mask, dropped;
    View lse;
    int v_dim = 0;
  };
  virtual void attention_forward_ex(View out, View probs, View qkv, int B, int Sq, int H, int G,
                                    int D, const Attention& a);
  // dkv: kv's gradient (dqkv itself when kv is empty).
  virtual void attention_backward_ex(View dqkv, View dkv, View dout, View qkv, View probs, int B,
                                     int Sq, int H, int G, int D, const Attention& a);
  // Multi-head latent attention (Feature::LatentAttention): the kernels' mla_pack_forward and
  // mla_pack_backward (act; positions I32 or empty, as rope's).
  virtual void mla_pack_forward(View qkv, View q, View kv, View k_rope, int B, int S, int H, int Dn,
                                int Dr, int Dv, double theta, View positions);
  virtual void mla_pack_backward(View dq, View dkv, View dk_rope, View dqkv, int B, int S, int H,
                                 int Dn, int Dr, int Dv, double theta, View positions);
  // dst[T, width] = columns [begin, begin + width) of src[T, src_width]; add_columns adds
  // src[T, width] into those columns of dst[T, dst_width]. Activations.
  virtual void copy_columns(View dst, View src, int T, int src_width, int begin, int width);
  virtual void add_columns(View dst, View src, int T, int dst_width, int begin, int width);
  // Hidden dropout on residual-stream rows [T, C] (act; mask U8): out = dropout(in) (out may
  // be in); out = skip + dropout(branch); din += dout ⊙ mask / (1 - rate).
  virtual void dropout_forward(View out, View mask, View in, const DropoutSite& d, int T, int C);
  virtual void dropout_add_forward(View out, View mask, View branch, View skip,
                                   const DropoutSite& d, int T, int C);
  virtual void dropout_backward(View din, View mask, View dout, float rate);

  // ---- mixture of experts (exec/cpu/kernels.hpp: moe_route ...) ---------------------------
  // experts and order I32 [T·k]; gates and dgates fp32 [T·k]; logits, dlogits, x, dispatched,
  // y and their gradients act. moe_dispatch's rows: fp32 [E], each expert's row count (the
  // runner reads it to size the experts' GEMMs). moe_route's gating, and the logits that
  // moe_route_backward reads again where gating.reads_logits() (empty where not): as the CPU
  // kernels.
  virtual void moe_route(View experts, View gates, View logits, int T, int E, int k,
                         const Gating& gating);
  virtual void moe_route_backward(View dlogits, View dgates, View gates, View experts, View logits,
                                  int T, int E, int k, const Gating& gating);
  virtual void moe_dispatch(View dispatched, View order, View rows, View x, View experts, int T,
                            int C, int k, int E);
  virtual void moe_dispatch_backward(View dx, View ddispatched, View order, int T, int C, int k);
  virtual void moe_combine(View out, View y, View gates, View order, int T, int C, int k);
  virtual void moe_combine_backward(View dy, View dgates, View dout, View y, View gates, View order,
                                    int T, int C, int k);
  // Cross-entropy, vocab-parallel (exec/cpu/kernels.hpp): rowmax[T], then sums[2T] (fp32), over
  // tp the sums rescaled to the reduced maxima (sums[T] *= exp(local_max - global_max)), then
  // loss (one fp32, the mean over the T rows) and dlogits = (softmax - onehot) / T from the
  // reduced statistics. targets I32.
  virtual void cross_entropy_max(View rowmax, View logits, int T, int V) = 0;
  virtual void cross_entropy_sums(View sums, View logits, View rowmax, View targets, int T, int V,
                                  int vocab_begin) = 0;
  virtual void cross_entropy_rescale(View sums, View local_max, View global_max, int T) = 0;
  virtual void cross_entropy_sharded(View dlogits, View loss, View logits, View rowmax, View sums,
                                     View targets, int T, int V, int vocab_begin) = 0;
  // Gradient clipping (Feature::GradClip): acc (fp32, one element) += the sum of the squares of
  // x (fp32); x (fp32) *= min(1, max_norm / (sqrt(norm_sq[0]) + 1e-6)), norm_sq read where it
  // lies (no wait on the host for it on a GPU).
  virtual void sum_squares(View acc, View x);
  virtual void clip_scale(View x, View norm_sq, float max_norm);
  // AdamW on fp32 views of one size.
  virtual void adamw(View params, View grads, View m, View v, float lr, float beta1, float beta2,
                     float eps, float weight_decay, int t) = 0;
  // out (act) = in (fp32): a weight's working copy for the GEMMs.
  virtual void cast(View out, View in) = 0;

 private:
  [[noreturn]] void lacks(const std::string& what) const {
    throw UnsupportedError(what + " is not executed on " + name() + " yet");
  }
};

inline void Device::attention_forward_ex(View, View, View, int, int, int, int, int,
                                         const Attention&) {
  lacks("attention with context parallelism or dropout");
}
inline void Device::attention_backward_ex(View, View, View, View, View, int, int, int, int, int,
                                          const Attention&) {
  lacks("attention with context parallelism or dropout");
}
inline void Device::mla_pack_forward(View, View, View, View, int, int, int, int, int, int, double,
                                     View) {
  lacks("multi-head latent attention");
}
inline void Device::mla_pack_backward(View, View, View, View, int, int, int, int, int, int, double,
                                      View) {
  lacks("multi-head latent attention");
}
inline void Device::copy_columns(View, View, int, int, int, int) {
  lacks("context parallelism");
}
inline void Device::add_columns(View, View, int, int, int, int) {
  lacks("context parallelism");
}
inline void Device::dropout_forward(View, View, View, const DropoutSite&, int, int) {
  lacks("dropout");
}
inline void Device::dropout_add_forward(View, View, View, View, const DropoutSite&, int, int) {
  lacks("dropout");
}
inline void Device::dropout_backward(View, View, View, float) {
  lacks("dropout");
}
inline void Device::sum_squares(View, View) {
  lacks("gradient clipping");
}
inline void Device::clip_scale(View, View, float) {
  lacks("gradient clipping");
}
inline void Device::moe_route(View, View, View, int, int, int, const Gating&) {
  lacks("a mixture of experts");
}
inline void Device::moe_route_backward(View, View, View, View, View, int, int, int, const Gating&) {
  lacks("a mixture of experts");
}
inline void Device::moe_dispatch(View, View, View, View, View, int, int, int, int) {
  lacks("a mixture of experts");
}
inline void Device::moe_dispatch_backward(View, View, View, int, int, int) {
  lacks("a mixture of experts");
}
inline void Device::moe_combine(View, View, View, View, int, int, int) {
  lacks("a mixture of experts");
}
inline void Device::moe_combine_backward(View, View, View, View, View, View, int, int, int) {
  lacks("a mixture of experts");
}

}  // namespace dtsim::exec
