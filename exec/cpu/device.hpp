// The CPU as a Device (exec/core/device.hpp) for the Program runner: fp32 activations in host
// memory, the kernels of exec/cpu/kernels.hpp, and a pool of released buffers that later
// tensors reuse (the smallest that fits), so that a step allocates no fresh pages.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "exec/core/device.hpp"

namespace dtsim::exec::cpu {

// Keeps the host memory that this process frees for its later allocations (glibc's malloc:
// no mmap for large blocks, no trimming of the heap), as a GPU framework's caching allocator
// keeps device memory. Without it a block of 32 MiB or more goes back to the kernel when freed
// and is faulted in again when next allocated: Open MPI allocates a temporary of the message's
// size in each large all-reduce (MPI_Allreduce, MPI_Iallreduce), so a large gradient bucket paid
// a fresh page-in every step (on this project's VM a 47 MB bucket's all-reduce took 200-240 ms
// instead of about 25, the step 976 ms instead of 570), which no device of the simulator pays.
// Called before anything is allocated; run and calibrate both, so that a profile measures
// what a run sees. A no-op where the C library is not glibc.
void keep_freed_host_memory();

class CpuDevice final : public Device {
 public:
  // `poison_unwritten`: fill tensors for overwrite with bytes 0xff
  // (Device::allocate_for_overwrite).
  explicit CpuDevice(bool poison_unwritten = poison_unwritten_from_env())
      : poison_unwritten_(poison_unwritten) {}
  std::string name() const override { return "cpu"; }
  Dtype activations() const override { return Dtype::F32; }
  bool host_memory() const override { return true; }

  View allocate(std::int64_t n, Dtype type) override { return take(n, type, /*zeros=*/true); }
  View allocate_for_overwrite(std::int64_t n, Dtype type) override {
    return take(n, type, /*zeros=*/false);
  }
  void release(View v) override;
  MemoryUse memory_use() const override;
  void zero(View v) override;
  void copy(View dst, View src) override;
  void upload(View dst, const float* host) override;
  void upload_ints(View dst, const int* host) override;
  void download(float* host, View src) override;
  void synchronize() override {}
  int mark() override;
  double elapsed(int a, int b) override;
  void clear_marks() override { marks_.clear(); }

  void matmul_forward(View out, View in, View w, View bias, int T, int K, int N,
                      bool w_transposed) override;
  void matmul_backward(View din, View dw, View dbias, View dout, View in, View w, int T, int K,
                       int N, bool w_transposed) override;
  void matmul_input_grad(View din, View dout, View w, int T, int K, int N,
                         bool w_transposed) override;
  void norm_forward(View out, View mean, View rstd, View in, View w, View b, int T, int C,
                    bool rms) override;
  void norm_backward(View din, View dw, View db, View dout, View in, View w, View mean, View rstd,
                     int T, int C, bool rms) override;
  void add_forward(View out, View a, View b) override;
  void accumulate(View d, View x, float scale) override;
  void gelu_forward(View out, View in) override;
  void gelu_backward(View din, View in, View dout) override;
  void swiglu_forward(View out, View in, int T, int F) override;
  void swiglu_backward(View din, View in, View dout, int T, int F) override;
  void attention_forward(View out, View probs, View qkv, int B, int S, int H, int G,
                         int D) override;
  void attention_backward(View dqkv, View dout, View qkv, View probs, int B, int S, int H, int G,
                          int D) override;
  void rope_forward(View out, View qkv, int B, int S, int H, int G, int D, double theta,
                    View positions) override;
  void rope_backward(View dqkv, View dout, int B, int S, int H, int G, int D, double theta,
                     View positions) override;
  void embedding_forward(View out, View tokens, View wte, View wpe, int B, int S, int C,
                         int vocab_begin, View positions) override;
  void embedding_backward(View dwte, View dwpe, View dout, View tokens, int B, int S, int C,
                          int vocab_begin, View positions) override;
  bool has(Feature) const override { return true; }
  void attention_forward_ex(View out, View probs, View qkv, int B, int Sq, int H, int G, int D,
                            const Attention& a) override;
  void attention_backward_ex(View dqkv, View dkv, View dout, View qkv, View probs, int B, int Sq,
                             int H, int G, int D, const Attention& a) override;
  void dropout_forward(View out, View mask, View in, const DropoutSite& d, int T, int C) override;
  void dropout_add_forward(View out, View mask, View branch, View skip, const DropoutSite& d, int T,
                           int C) override;
  void dropout_backward(View din, View mask, View dout, float rate) override;
  void moe_route(View experts, View gates, View logits, int T, int E, int k,
                 const Gating& gating) override;
  void moe_route_backward(View dlogits, View dgates, View gates, View experts, View logits, int T,
                          int E, int k, const Gating& gating) override;
  void moe_dispatch(View dispatched, View order, View rows, View x, View experts, int T, int C,
                    int k, int E) override;
  void moe_dispatch_backward(View dx, View ddispatched, View order, int T, int C, int k) override;
  void moe_combine(View out, View y, View gates, View order, int T, int C, int k) override;
  void moe_combine_backward(View dy, View dgates, View dout, View y, View gates, View order, int T,
                            int C, int k) override;
  void mla_pack_forward(View qkv, View q, View kv, View k_rope, int B, int S, int H, int Dn, int Dr,
                        int Dv, double theta, View positions) override;
  void mla_pack_backward(View dq, View dkv, View dk_rope, View dqkv, int B, int S, int H, int Dn,
                         int Dr, int Dv, double theta, View positions) override;
  void copy_columns(View dst, View src, int T, int src_width, int begin, int width) override;
  void add_columns(View dst, View src, int T, int dst_width, int begin, int width) override;
  void cross_entropy_max(View rowmax, View logits, int T, int V) override;
  void cross_entropy_sums(View sums, View logits, View rowmax, View targets, int T, int V,
                          int vocab_begin) override;
  void cross_entropy_rescale(View sums, View local_max, View global_max, int T) override;
  void cross_entropy_sharded(View dlogits, View loss, View logits, View rowmax, View sums,
                             View targets, int T, int V, int vocab_begin) override;
  void sum_squares(View acc, View x) override;
  void clip_scale(View x, View norm_sq, float max_norm) override;
  void adamw(View params, View grads, View m, View v, float lr, float beta1, float beta2, float eps,
             float weight_decay, int t) override;
  void cast(View out, View in) override;

 private:
  // allocate's work: a released buffer that fits (its old values zeroed only with `zeros`), or a
  // new one (zeros).
  View take(std::int64_t n, Dtype type, bool zeros);

  // Buffers of 4-byte words: handed out (by address) and released (by capacity).
  // A buffer handed out: its block, the block's size and the size asked for (words).
  struct Live {
    std::unique_ptr<float[]> block;
    std::size_t capacity, words;
  };
  std::unordered_map<void*, Live> live_;
  std::multimap<std::size_t, std::unique_ptr<float[]>> free_;
  bool poison_unwritten_;
  MemoryUse memory_;  // in 4-byte words until memory_use()
  std::vector<std::chrono::steady_clock::time_point> marks_;
};

// A view of host fp32 memory as a span (empty for an empty view).
std::span<float> floats(View v);

}  // namespace dtsim::exec::cpu
