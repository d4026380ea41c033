// The GPU's mixed precision on the CPU: a Device that stores activations in bf16 in host memory
// and computes with the CPU's fp32 kernels, for running a bf16 plan's path through the runner
// (the GPU's: bf16 activations, fp32 masters, working copies of the weights, fp32 statistics)
// where there is no GPU: `dtexec run --backend cpu --precision bf16`, and the tests. Each op
// checks the type of every view as the GPU device does (activations bf16; weights, their
// gradients, statistics and optimizer state fp32; tokens int32), widens the bf16 ones into fp32
// scratch, runs the CPU kernel and rounds them back (round to nearest even, as CUDA's
// __float2bfloat16), so that a view of the wrong type fails here as it would on the GPU, naming
// the op. The numerics are an emulation: the GPU's GEMMs accumulate bf16 products in fp32 in an
// order of cuBLAS's choosing, its element-wise kernels round where these do. The MPI backend moves
// its bf16 views (exec/cpu/mpi_comm.cpp: bf16 sums rounded at each step, as NCCL's).
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <source_location>
#include <string>
#include <utility>
#include <vector>

#include "exec/cpu/device.hpp"
#include "sim/common/error.hpp"

namespace dtsim::exec::cpu {

inline std::uint16_t to_bf16(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, 4);
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<std::uint16_t>(bits >> 16);
}

inline float from_bf16(std::uint16_t h) {
  const std::uint32_t bits = static_cast<std::uint32_t>(h) << 16;
  float x = 0;
  std::memcpy(&x, &bits, 4);
  return x;
}

class Bf16Device final : public Device {
 public:
  std::string name() const override { return "cpu-bf16-emulation"; }
  Dtype activations() const override { return Dtype::BF16; }
  // host_memory false: the views count as a GPU's, and the runner takes the path of a device
  // that queues its work (for the tests of that path); the MPI backend then refuses them.
  // `without`: features it says it lacks (for tests of the runner's refusal), else it has the
  // GPU device's, all of them.
  explicit Bf16Device(bool host_memory = true, std::vector<Feature> without = {})
      : host_memory_(host_memory), without_(std::move(without)) {}
  bool host_memory() const override { return host_memory_; }

  View allocate(std::int64_t n, Dtype type) override {
    if (type != Dtype::BF16) return cpu_.allocate(n, type);
    const View words = cpu_.allocate((n + 1) / 2, Dtype::F32);  // zeros: bf16 zeros too
    return {words.p, n, Dtype::BF16};
  }
  View allocate_for_overwrite(std::int64_t n, Dtype type) override {
    if (type != Dtype::BF16) return cpu_.allocate_for_overwrite(n, type);
    return {cpu_.allocate_for_overwrite((n + 1) / 2, Dtype::F32).p, n, Dtype::BF16};
  }
  void release(View v) override { cpu_.release(v); }
  MemoryUse memory_use() const override { return cpu_.memory_use(); }
  void zero(View v) override { cpu_.zero(v); }
  void copy(View dst, View src) override { cpu_.copy(dst, src); }
  void upload(View dst, const float* host) override {
    if (dst.type != Dtype::BF16) return cpu_.upload(dst, host);
    auto* h = static_cast<std::uint16_t*>(dst.p);
    for (std::int64_t i = 0; i < dst.n; ++i) h[i] = to_bf16(host[i]);
  }
  void upload_ints(View dst, const int* host) override { cpu_.upload_ints(dst, host); }
  void download(float* host, View src) override {
    if (src.type != Dtype::BF16) return cpu_.download(host, src);
    const auto* h = static_cast<const std::uint16_t*>(src.p);
    for (std::int64_t i = 0; i < src.n; ++i) host[i] = from_bf16(h[i]);
  }
  void synchronize() override {}
  int mark() override { return cpu_.mark(); }
  double elapsed(int a, int b) override { return cpu_.elapsed(a, b); }
  void clear_marks() override { cpu_.clear_marks(); }

  void matmul_forward(View out, View in, View w, View bias, int T, int K, int N,
                      bool w_transposed) override {
    Scope s;
    cpu_.matmul_forward(s.act(out), s.act(in), s.act(w), s.f32_or_null(bias), T, K, N,
                        w_transposed);
  }
  void matmul_backward(View din, View dw, View dbias, View dout, View in, View w, int T, int K,
                       int N, bool w_transposed) override {
    Scope s;
    cpu_.matmul_backward(s.act_or_null(din), s.f32_or_null(dw), s.f32_or_null(dbias), s.act(dout),
                         s.act_or_null(in), s.act(w), T, K, N, w_transposed);
  }
  void matmul_input_grad(View din, View dout, View w, int T, int K, int N,
                         bool w_transposed) override {
    Scope s;
    cpu_.matmul_input_grad(s.act(din), s.act(dout), s.act(w), T, K, N, w_transposed);
  }
  void norm_forward(View out, View mean, View rstd, View in, View w, View b, int T, int C,
                    bool rms) override {
    Scope s;
    cpu_.norm_forward(s.act(out), s.f32(mean), s.f32(rstd), s.act(in), s.f32(w), s.f32_or_null(b),
                      T, C, rms);
  }
  void norm_backward(View din, View dw, View db, View dout, View in, View w, View mean, View rstd,
                     int T, int C, bool rms) override {
    Scope s;
    cpu_.norm_backward(s.act_or_null(din), s.f32_or_null(dw), s.f32_or_null(db), s.act(dout),
                       s.act(in), s.f32(w), s.f32(mean), s.f32(rstd), T, C, rms);
  }
  void add_forward(View out, View a, View b) override {
    Scope s;
    cpu_.add_forward(s.act(out), s.act(a), s.act(b));
  }
  void accumulate(View d, View x, float scale) override {
    Scope s;
    if (d.type == Dtype::F32) {
      cpu_.accumulate(s.f32(d), s.f32(x), scale);  // gradient buffers
    } else {
      cpu_.accumulate(s.act(d), s.act(x), scale);
    }
  }
  void gelu_forward(View out, View in) override {
    Scope s;
    cpu_.gelu_forward(s.act(out), s.act(in));
  }
  void gelu_backward(View din, View in, View dout) override {
    Scope s;
    cpu_.gelu_backward(s.act(din), s.act(in), s.act(dout));
  }
  void swiglu_forward(View out, View in, int T, int F) override {
    Scope s;
    cpu_.swiglu_forward(s.act(out), s.act(in), T, F);
  }
  void swiglu_backward(View din, View in, View dout, int T, int F) override {
    Scope s;
    cpu_.swiglu_backward(s.act(din), s.act(in), s.act(dout), T, F);
  }
  void attention_forward(View out, View probs, View qkv, int B, int S, int H, int G,
                         int D) override {
    Scope s;
    cpu_.attention_forward(s.act(out), s.act(probs), s.act(qkv), B, S, H, G, D);
  }
  void attention_backward(View dqkv, View dout, View qkv, View probs, int B, int S, int H, int G,
                          int D) override {
    Scope s;
    cpu_.attention_backward(s.act(dqkv), s.act(dout), s.act(qkv), s.act(probs), B, S, H, G, D);
  }
  void rope_forward(View out, View qkv, int B, int S, int H, int G, int D, double theta,
                    View positions) override {
    Scope s;
    cpu_.rope_forward(s.act(out), s.act(qkv), B, S, H, G, D, theta, s.ints_or_null(positions));
  }
  void rope_backward(View dqkv, View dout, int B, int S, int H, int G, int D, double theta,
                     View positions) override {
    Scope s;
    cpu_.rope_backward(s.act(dqkv), s.act(dout), B, S, H, G, D, theta, s.ints_or_null(positions));
  }
  void embedding_forward(View out, View tokens, View wte, View wpe, int B, int S, int C,
                         int vocab_begin, View positions) override {
    Scope s;
    cpu_.embedding_forward(s.act(out), s.ints(tokens), s.f32(wte), s.f32_or_null(wpe), B, S, C,
                           vocab_begin, s.ints_or_null(positions));
  }
  void embedding_backward(View dwte, View dwpe, View dout, View tokens, int B, int S, int C,
                          int vocab_begin, View positions) override {
    Scope s;
    cpu_.embedding_backward(s.f32(dwte), s.f32_or_null(dwpe), s.act(dout), s.ints(tokens), B, S, C,
                            vocab_begin, s.ints_or_null(positions));
  }
  // Context parallelism, dropout (masks: bytes), mixtures of experts and FlashAttention's
  // memory (the log-sum-exp: fp32), with the GPU device's types.
  bool has(Feature f) const override {
    return std::find(without_.begin(), without_.end(), f) == without_.end();
  }
  void mla_pack_forward(View qkv, View q, View kv, View k_rope, int B, int S, int H, int Dn, int Dr,
                        int Dv, double theta, View positions) override {
    Scope s;
    cpu_.mla_pack_forward(s.act(qkv), s.act_or_null(q), s.act(kv), s.act(k_rope), B, S, H, Dn, Dr,
                          Dv, theta, s.ints_or_null(positions));
  }
  void mla_pack_backward(View dq, View dkv, View dk_rope, View dqkv, int B, int S, int H, int Dn,
                         int Dr, int Dv, double theta, View positions) override {
    Scope s;
    cpu_.mla_pack_backward(s.act_or_null(dq), s.act(dkv), s.act(dk_rope), s.act(dqkv), B, S, H, Dn,
                           Dr, Dv, theta, s.ints_or_null(positions));
  }
  void copy_columns(View dst, View src, int T, int src_width, int begin, int width) override {
    Scope s;
    cpu_.copy_columns(s.act(dst), s.act(src), T, src_width, begin, width);
  }
  void add_columns(View dst, View src, int T, int dst_width, int begin, int width) override {
    Scope s;
    cpu_.add_columns(s.act(dst), s.act(src), T, dst_width, begin, width);
  }
  void moe_route(View experts, View gates, View logits, int T, int E, int k,
                 const Gating& gating) override {
    Scope s;
    cpu_.moe_route(s.ints(experts), s.f32(gates), s.act(logits), T, E, k, gating);
  }
  void moe_route_backward(View dlogits, View dgates, View gates, View experts, View logits, int T,
                          int E, int k, const Gating& gating) override {
    Scope s;
    cpu_.moe_route_backward(s.act(dlogits), s.f32(dgates), s.f32(gates), s.ints(experts),
                            s.act_or_null(logits), T, E, k, gating);
  }
  void moe_dispatch(View dispatched, View order, View rows, View x, View experts, int T, int C,
                    int k, int E) override {
    Scope s;
    cpu_.moe_dispatch(s.act(dispatched), s.ints(order), s.f32(rows), s.act(x), s.ints(experts), T,
                      C, k, E);
  }
  void moe_dispatch_backward(View dx, View ddispatched, View order, int T, int C, int k) override {
    Scope s;
    cpu_.moe_dispatch_backward(s.act(dx), s.act(ddispatched), s.ints(order), T, C, k);
  }
  void moe_combine(View out, View y, View gates, View order, int T, int C, int k) override {
    Scope s;
    cpu_.moe_combine(s.act(out), s.act(y), s.f32(gates), s.ints(order), T, C, k);
  }
  void moe_combine_backward(View dy, View dgates, View dout, View y, View gates, View order, int T,
                            int C, int k) override {
    Scope s;
    cpu_.moe_combine_backward(s.act(dy), s.f32(dgates), s.act(dout), s.act(y), s.f32(gates),
                              s.ints(order), T, C, k);
  }
  void attention_forward_ex(View out, View probs, View qkv, int B, int Sq, int H, int G, int D,
                            const Attention& a) override {
    Scope s;
    const Attention x = extras(s, a);
    const View p = a.lse.empty() ? s.act(probs) : View{};  // FlashAttention's: none
    cpu_.attention_forward_ex(s.act(out), p, s.act(qkv), B, Sq, H, G, D, x);
  }
  void attention_backward_ex(View dqkv, View dkv, View dout, View qkv, View probs, int B, int Sq,
                             int H, int G, int D, const Attention& a) override {
    Scope s;
    const Attention x = extras(s, a);
    const View p = a.lse.empty() ? s.act(probs) : View{};  // FlashAttention's: none
    cpu_.attention_backward_ex(s.act(dqkv), s.act(dkv), s.act(dout), s.act(qkv), p, B, Sq, H, G, D,
                               x);
  }
  void dropout_forward(View out, View mask, View in, const DropoutSite& d, int T, int C) override {
    Scope s;
    cpu_.dropout_forward(s.act(out), s.u8(mask), s.act(in), d, T, C);
  }
  void dropout_add_forward(View out, View mask, View branch, View skip, const DropoutSite& d, int T,
                           int C) override {
    Scope s;
    cpu_.dropout_add_forward(s.act(out), s.u8(mask), s.act(branch), s.act(skip), d, T, C);
  }
  void dropout_backward(View din, View mask, View dout, float rate) override {
    Scope s;
    cpu_.dropout_backward(s.act(din), s.u8(mask), s.act(dout), rate);
  }
  void cross_entropy_max(View rowmax, View logits, int T, int V) override {
    Scope s;
    cpu_.cross_entropy_max(s.f32(rowmax), s.act(logits), T, V);
  }
  void cross_entropy_sums(View sums, View logits, View rowmax, View targets, int T, int V,
                          int vocab_begin) override {
    Scope s;
    cpu_.cross_entropy_sums(s.f32(sums), s.act(logits), s.f32(rowmax), s.ints(targets), T, V,
                            vocab_begin);
  }
  void cross_entropy_rescale(View sums, View local_max, View global_max, int T) override {
    Scope s;
    cpu_.cross_entropy_rescale(s.f32(sums), s.f32(local_max), s.f32(global_max), T);
  }
  void cross_entropy_sharded(View dlogits, View loss, View logits, View rowmax, View sums,
                             View targets, int T, int V, int vocab_begin) override {
    Scope s;
    cpu_.cross_entropy_sharded(s.act(dlogits), s.f32(loss), s.act(logits), s.f32(rowmax),
                               s.f32(sums), s.ints(targets), T, V, vocab_begin);
  }
  void sum_squares(View acc, View x) override {
    Scope s;
    cpu_.sum_squares(s.f32(acc), s.f32(x));
  }
  void clip_scale(View x, View norm_sq, float max_norm) override {
    Scope s;
    cpu_.clip_scale(s.f32(x), s.f32(norm_sq), max_norm);
  }
  void adamw(View params, View grads, View m, View v, float lr, float beta1, float beta2, float eps,
             float weight_decay, int t) override {
    Scope s;
    cpu_.adamw(s.f32(params), s.f32(grads), s.f32(m), s.f32(v), lr, beta1, beta2, eps, weight_decay,
               t);
  }
  void cast(View out, View in) override {
    Scope s;
    cpu_.copy(s.act(out), s.f32(in));
  }

 private:
  // A view's type checked where the op that reads it is called, as the GPU device checks it:
  // the failure names that op (the caller's line), not this one.
  using Where = std::source_location;
  static void expect(View v, Dtype want, Where where) {
    if (v.type != want) {
      fail_assert("v.type == want", where.file_name(), static_cast<int>(where.line()),
                  fmt::format("a {} view expected, given a {} view of {} elements, in {}",
                              to_string(want), to_string(v.type), v.n, where.function_name()));
    }
  }

  class Scope;
  // An attention's extras with their types checked as the GPU device checks them, the bf16
  // ones widened in `s`.
  static Attention extras(Scope& s, const Attention& a);

  // The fp32 copies of one op's bf16 views: widened on the way in, rounded back on the way out
  // (an input comes back unchanged: a bf16 value widens and rounds to itself). A view passed
  // twice shares one copy. The copies are scratch outside the device's pool: its memory use
  // counts the runner's tensors only, as the GPU's does.
  class Scope {
   public:
    Scope() = default;
    ~Scope() {
      for (const Copy& c : copies_) {
        auto* h = static_cast<std::uint16_t*>(c.bf16.p);
        for (std::int64_t i = 0; i < c.bf16.n; ++i) h[i] = to_bf16(c.f32[i]);
      }
    }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

    // Strict, as the GPU device: an empty view is checked too (a default View is fp32); the
    // _or_null forms take an empty view of any type where the GPU's kernel takes a null.
    View act(View v, Where where = Where::current()) {
      expect(v, Dtype::BF16, where);
      if (v.empty()) return {};
      for (const Copy& c : copies_) {
        if (c.bf16.p == v.p && c.bf16.n == v.n) return {c.f32.get(), v.n, Dtype::F32};
      }
      Copy c{v, std::make_unique<float[]>(static_cast<std::size_t>(v.n))};
      const auto* h = static_cast<const std::uint16_t*>(v.p);
      for (std::int64_t i = 0; i < v.n; ++i) c.f32[i] = from_bf16(h[i]);
      copies_.push_back(std::move(c));
      return {copies_.back().f32.get(), v.n, Dtype::F32};
    }
    View act_or_null(View v, Where where = Where::current()) {
      return v.empty() ? View{} : act(v, where);
    }
    static View f32(View v, Where where = Where::current()) {
      expect(v, Dtype::F32, where);
      return v;
    }
    static View f32_or_null(View v, Where where = Where::current()) {
      return v.empty() ? View{} : f32(v, where);
    }
    static View u8(View v, Where where = Where::current()) {
      expect(v, Dtype::U8, where);
      return v;
    }
    static View ints(View v, Where where = Where::current()) {
      expect(v, Dtype::I32, where);
      return v;
    }
    static View ints_or_null(View v, Where where = Where::current()) {
      return v.empty() ? View{} : ints(v, where);
    }

   private:
    struct Copy {
      View bf16;
      std::unique_ptr<float[]> f32;
    };
    std::vector<Copy> copies_;
  };

  cpu::CpuDevice cpu_;
  bool host_memory_;
  std::vector<Feature> without_;
};

inline Device::Attention Bf16Device::extras(Scope& s, const Attention& a) {
  Attention x = a;
  x.kv = s.act_or_null(a.kv);
  x.qpos = Scope::ints_or_null(a.qpos);
  x.order = Scope::ints_or_null(a.order);
  x.lse = Scope::f32_or_null(a.lse);
  if (a.dropout != nullptr && a.lse.empty()) {  // FlashAttention's memory keeps no masks
    x.mask = s.u8(a.mask);
    x.dropped = s.act(a.dropped);
  }
  return x;
}

}  // namespace dtsim::exec::cpu
