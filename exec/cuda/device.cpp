#include "exec/cuda/device.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <source_location>
#include <string>
#include <unordered_map>
#include <utility>

#include "exec/cuda/kernels.hpp"

namespace dtsim::exec::cuda {

namespace {

class CudaDevice final : public Device {
 public:
  CudaDevice(int gpu, exec::Dtype activations)
      : act_(activations),
        k_(gpu, activations == exec::Dtype::BF16 ? cuda::Dtype::BF16 : cuda::Dtype::F32),
        gpu_(gpu) {
    DTSIM_ASSERT(activations != exec::Dtype::I32, "activations are floating point");
    k_.set_out_of_memory([this] { give_back_released(); });
  }
  // (The scratch's out-of-memory hook holds `this`.)
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  std::string name() const override { return "cuda:" + std::to_string(gpu_); }
  void* stream() const { return k_.stream(); }
  int gpu() const { return gpu_; }
  exec::Dtype activations() const override { return act_; }
  bool host_memory() const override { return false; }

  View allocate(std::int64_t n, exec::Dtype type) override { return take(n, type, true); }
  View allocate_for_overwrite(std::int64_t n, exec::Dtype type) override {
    return take(n, type, false);
  }

  MemoryUse memory_use() const override { return memory_; }

  void release(View v) override {
    if (v.p == nullptr) return;
    const auto it = live_.find(v.p);
    DTSIM_ASSERT(it != live_.end(), "release of a view that was not allocated whole");
    const std::size_t capacity = it->second.first.bytes();
    memory_.in_use -= static_cast<std::int64_t>(it->second.second);
    free_.emplace(capacity, std::move(it->second.first));
    live_.erase(it);
  }

  void zero(View v) override {
    if (!v.empty()) k_.zero(v.p, bytes(v));
  }

  void copy(View dst, View src) override {
    DTSIM_ASSERT(dst.n == src.n && dst.type == src.type, "copy between views of one shape");
    // In place (a one-rank group's collective on its own buffer): nothing to move, and
    // cudaMemcpyAsync does not define copies whose regions overlap.
    if (!dst.empty() && dst.p != src.p) k_.copy(dst.p, src.p, bytes(dst));
  }

  void upload(View dst, const float* host) override {
    if (dst.type == exec::Dtype::F32) {
      k_.upload_f32(f32(dst), host, dst.n);
    } else {
      k_.upload(act(dst), host, dst.n);
    }
  }

  void upload_ints(View dst, const int* host) override {
    DTSIM_ASSERT(dst.type == exec::Dtype::I32, "an int32 view");
    k_.upload_i32(static_cast<int*>(dst.p), host, dst.n);
  }

  void download(float* host, View src) override {
    if (src.type == exec::Dtype::F32) {
      k_.download_f32(host, f32(src), src.n);
    } else {
      k_.download(host, act(src), src.n);
    }
  }

  void synchronize() override { k_.synchronize(); }
  int mark() override { return k_.mark(); }
  int mark_on(void* stream) { return k_.mark(stream); }
  double elapsed(int a, int b) override { return k_.seconds(a, b); }
  void clear_marks() override { k_.clear_marks(); }

  void matmul_forward(View out, View in, View w, View bias, int T, int K, int N,
                      bool w_transposed) override {
    k_.matmul_forward(act(out), act(in), act(w), f32_or_null(bias), T, K, N, w_transposed);
  }
  void matmul_backward(View din, View dw, View dbias, View dout, View in, View w, int T, int K,
                       int N, bool w_transposed) override {
    // `in` is read for the weight gradient only: empty when the input gradient runs apart
    // (its tensor-parallel all-reduce overlapping the weight gradient's GEMM).
    k_.matmul_backward(act_or_null(din), f32_or_null(dw), f32_or_null(dbias), act(dout),
                       act_or_null(in), act(w), T, K, N, w_transposed);
  }
  void matmul_input_grad(View din, View dout, View w, int T, int K, int N,
                         bool w_transposed) override {
    k_.matmul_input_grad(act(din), act(dout), act(w), T, K, N, w_transposed);
  }
  void norm_forward(View out, View mean, View rstd, View in, View w, View b, int T, int C,
                    bool rms) override {
    k_.norm_forward(act(out), f32(mean), f32(rstd), act(in), f32(w), f32_or_null(b), T, C, rms);
  }
  void norm_backward(View din, View dw, View db, View dout, View in, View w, View mean, View rstd,
                     int T, int C, bool rms) override {
    k_.norm_backward(act_or_null(din), f32_or_null(dw), f32_or_null(db), act(dout), act(in), f32(w),
                     f32(mean), f32(rstd), T, C, rms);
  }
  void add_forward(View out, View a, View b) override {
    k_.add_forward(act(out), act(a), act(b), out.n);
  }
  void accumulate(View d, View x, float scale) override {
    DTSIM_ASSERT(d.n == x.n && d.type == x.type, "accumulate views of one size and type");
    if (d.type == exec::Dtype::F32) {
      k_.accumulate_f32(f32(d), f32(x), d.n, scale);  // gradient buffers
    } else {
      k_.accumulate(act(d), act(x), d.n, scale);
    }
  }
  void gelu_forward(View out, View in) override { k_.gelu_forward(act(out), act(in), in.n); }
  void gelu_backward(View din, View in, View dout) override {
    k_.gelu_backward(act(din), act(in), act(dout), in.n);
  }
  void swiglu_forward(View out, View in, int T, int F) override {
    k_.swiglu_forward(act(out), act(in), T, F);
  }
  void swiglu_backward(View din, View in, View dout, int T, int F) override {
    k_.swiglu_backward(act(din), act(in), act(dout), T, F);
  }
  void attention_forward(View out, View probs, View qkv, int B, int S, int H, int G,
                         int D) override {
    k_.attention_forward(act(out), act(probs), act(qkv), B, S, H, G, D);
  }
  void attention_backward(View dqkv, View dout, View qkv, View probs, int B, int S, int H, int G,
                          int D) override {
    k_.attention_backward(act(dqkv), act(dout), act(qkv), act(probs), B, S, H, G, D);
  }
  // Positions other than 0 ... S-1 come with context parallelism (empty: 0 ... S-1).
  void rope_forward(View out, View qkv, int B, int S, int H, int G, int D, double theta,
                    View positions) override {
    k_.rope_forward(act(out), act(qkv), B, S, H, G, D, theta, ints_or_null(positions));
  }
  void rope_backward(View dqkv, View dout, int B, int S, int H, int G, int D, double theta,
                     View positions) override {
    k_.rope_backward(act(dqkv), act(dout), B, S, H, G, D, theta, ints_or_null(positions));
  }
  void embedding_forward(View out, View tokens, View wte, View wpe, int B, int S, int C,
                         int vocab_begin, View positions) override {
    k_.embedding_forward(act(out), ints(tokens), f32(wte), static_cast<int>(wte.n / C),
                         f32_or_null(wpe), B, S, C, vocab_begin, ints_or_null(positions));
  }
  void embedding_backward(View dwte, View dwpe, View dout, View tokens, int B, int S, int C,
                          int vocab_begin, View positions) override {
    k_.embedding_backward(f32(dwte), static_cast<int>(dwte.n / C), f32_or_null(dwpe), act(dout),
                          ints(tokens), B, S, C, vocab_begin, ints_or_null(positions));
  }
  // Context parallelism, dropout (the CPU's masks: exec/cuda/kernels.hpp), mixtures of experts
  // (the CPU's routing), FlashAttention's memory, gradient clipping and multi-head latent
  // attention (its packing, values of their own width: exec/cuda/kernels.hpp).
  bool has(Feature f) const override {
    switch (f) {  // (no default: a feature added later is a warning here until it is decided)
      case Feature::ContextParallelism:
      case Feature::Dropout:
      case Feature::MixtureOfExperts:
      case Feature::FlashAttention:
      case Feature::GradClip:
      case Feature::LatentAttention:
        return true;
    }
    return false;
  }
  void mla_pack_forward(View qkv, View q, View kv, View k_rope, int B, int S, int H, int Dn, int Dr,
                        int Dv, double theta, View positions) override {
    k_.mla_pack_forward(act(qkv), act_or_null(q), act(kv), act(k_rope), B, S, H, Dn, Dr, Dv, theta,
                        ints_or_null(positions));
  }
  void mla_pack_backward(View dq, View dkv, View dk_rope, View dqkv, int B, int S, int H, int Dn,
                         int Dr, int Dv, double theta, View positions) override {
    k_.mla_pack_backward(act_or_null(dq), act(dkv), act(dk_rope), act(dqkv), B, S, H, Dn, Dr, Dv,
                         theta, ints_or_null(positions));
  }
  void copy_columns(View dst, View src, int T, int src_width, int begin, int width) override {
    k_.copy_columns(act(dst), act(src), T, src_width, begin, width);
  }
  void add_columns(View dst, View src, int T, int dst_width, int begin, int width) override {
    k_.add_columns(act(dst), act(src), T, dst_width, begin, width);
  }
  void moe_route(View experts, View gates, View logits, int T, int E, int k,
                 const Gating& gating) override {
    k_.moe_route(ints(experts), f32(gates), act(logits), T, E, k, gating);
  }
  void moe_route_backward(View dlogits, View dgates, View gates, View experts, View logits, int T,
                          int E, int k, const Gating& gating) override {
    k_.moe_route_backward(act(dlogits), f32(dgates), f32(gates), ints(experts), act_or_null(logits),
                          T, E, k, gating);
  }
  void moe_dispatch(View dispatched, View order, View rows, View x, View experts, int T, int C,
                    int k, int E) override {
    k_.moe_dispatch(act(dispatched), ints(order), f32(rows), act(x), ints(experts), T, C, k, E);
  }
  void moe_dispatch_backward(View dx, View ddispatched, View order, int T, int C, int k) override {
    k_.moe_dispatch_backward(act(dx), act(ddispatched), ints(order), T, C, k);
  }
  void moe_combine(View out, View y, View gates, View order, int T, int C, int k) override {
    k_.moe_combine(act(out), act(y), f32(gates), ints(order), T, C, k);
  }
  void moe_combine_backward(View dy, View dgates, View dout, View y, View gates, View order, int T,
                            int C, int k) override {
    k_.moe_combine_backward(act(dy), f32(dgates), act(dout), act(y), f32(gates), ints(order), T, C,
                            k);
  }
  // Attention with dropout and, where kv is given, context parallelism.
  void attention_forward_ex(View out, View probs, View qkv, int B, int Sq, int H, int G, int D,
                            const Attention& a) override {
    Kernels::DropoutSite site;
    if (a.dropout != nullptr) site = site_of(*a.dropout);
    const Kernels::DropoutSite* dropout = a.dropout != nullptr ? &site : nullptr;
    // FlashAttention's memory: the rows' log-sum-exp kept, no probabilities or masks.
    const bool flash = !a.lse.empty();
    float* lse = flash ? f32(a.lse) : nullptr;
    void* p = flash ? nullptr : act(probs);
    std::uint8_t* mask = a.dropout != nullptr && !flash ? u8(a.mask) : nullptr;
    void* dropped = a.dropout != nullptr && !flash ? act(a.dropped) : nullptr;
    if (a.kv.empty()) {
      DTSIM_ASSERT(a.cp == 1 && a.qpos.empty() && a.order.empty(), "a query's keys its own");
      k_.attention_forward(act(out), p, act(qkv), B, Sq, H, G, D, dropout, mask, dropped, lse,
                           a.v_dim);
      return;
    }
    k_.attention_forward_cp(act(out), p, act(qkv), act(a.kv), ints_or_null(a.qpos),
                            ints_or_null(a.order), a.cp, B, Sq, H, G, D, dropout, mask, dropped,
                            lse, a.v_dim);
  }
  void attention_backward_ex(View dqkv, View dkv, View dout, View qkv, View probs, int B, int Sq,
                             int H, int G, int D, const Attention& a) override {
    const float rate = a.dropout != nullptr ? a.dropout->rate : 0.0f;
    Kernels::DropoutSite site;
    if (a.dropout != nullptr) site = site_of(*a.dropout);
    const bool flash = !a.lse.empty();
    // FlashAttention's backward draws the masks again from the site.
    const Kernels::DropoutSite* dropout = a.dropout != nullptr && flash ? &site : nullptr;
    const float* lse = flash ? f32(a.lse) : nullptr;
    const void* p = flash ? nullptr : act(probs);
    const std::uint8_t* mask = a.dropout != nullptr && !flash ? u8(a.mask) : nullptr;
    const void* dropped = a.dropout != nullptr && !flash ? act(a.dropped) : nullptr;
    if (a.kv.empty()) {
      DTSIM_ASSERT(dkv.p == dqkv.p, "k and v gradients in dqkv (a query's keys its own)");
      k_.attention_backward(act(dqkv), act(dout), act(qkv), p, B, Sq, H, G, D, rate, mask, dropped,
                            lse, dropout, a.v_dim);
      return;
    }
    k_.attention_backward_cp(act(dqkv), act(dkv), act(dout), act(qkv), act(a.kv), p,
                             ints_or_null(a.qpos), ints_or_null(a.order), a.cp, B, Sq, H, G, D,
                             rate, mask, dropped, lse, dropout, a.v_dim);
  }
  void dropout_forward(View out, View mask, View in, const DropoutSite& d, int T, int C) override {
    k_.dropout_forward(act(out), u8(mask), act(in), nullptr, site_of(d), T, C);
  }
  void dropout_add_forward(View out, View mask, View branch, View skip, const DropoutSite& d, int T,
                           int C) override {
    k_.dropout_forward(act(out), u8(mask), act(branch), act(skip), site_of(d), T, C);
  }
  void dropout_backward(View din, View mask, View dout, float rate) override {
    DTSIM_ASSERT(din.n == mask.n && dout.n == mask.n, "dropout views of one size");
    k_.dropout_backward(act(din), u8(mask), act(dout), rate, din.n);
  }
  void cross_entropy_max(View rowmax, View logits, int T, int V) override {
    k_.cross_entropy_max(f32(rowmax), act(logits), T, V);
  }
  void cross_entropy_sums(View sums, View logits, View rowmax, View targets, int T, int V,
                          int vocab_begin) override {
    k_.cross_entropy_sums(f32(sums), act(logits), f32(rowmax), ints(targets), T, V, vocab_begin);
  }
  void cross_entropy_rescale(View sums, View local_max, View global_max, int T) override {
    k_.cross_entropy_rescale(f32(sums), f32(local_max), f32(global_max), T);
  }
  void cross_entropy_sharded(View dlogits, View loss, View logits, View rowmax, View sums,
                             View targets, int T, int V, int vocab_begin) override {
    k_.cross_entropy_sharded(act(dlogits), rows(T), act(logits), f32(rowmax), f32(sums),
                             ints(targets), T, V, vocab_begin);
    k_.mean(f32(loss), rows_.f32(), T);
  }
  void sum_squares(View acc, View x) override { k_.sum_squares(f32(acc), f32(x), x.n); }
  void clip_scale(View x, View norm_sq, float max_norm) override {
    k_.clip_scale(f32(x), x.n, f32(norm_sq), max_norm);
  }
  void adamw(View params, View grads, View m, View v, float lr, float beta1, float beta2, float eps,
             float weight_decay, int t) override {
    k_.adamw(f32(params), f32(grads), f32(m), f32(v), params.n, lr, beta1, beta2, eps, weight_decay,
             t);
  }
  void cast(View out, View in) override { k_.cast(act(out), f32(in), in.n); }

 private:
  // allocate's work: a released buffer that fits or a new one, zeroed only with `zeros`.
  // The pool's released buffers back to the GPU (after the stream's work), for an allocation
  // that found it full.
  void give_back_released() {
    for (const auto& entry : free_) memory_.reserved -= static_cast<std::int64_t>(entry.first);
    free_.clear();
    k_.return_free_memory();
  }

  View take(std::int64_t n, exec::Dtype type, bool zeros) {
    DTSIM_ASSERT(n >= 0, "a size");
    const std::size_t bytes =
        static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * bytes_of(type);
    DeviceBuffer block;
    const auto it = free_.lower_bound(bytes);
    if (it != free_.end()) {
      block = std::move(it->second);
      free_.erase(it);
    } else {
      try {
        block = DeviceBuffer(bytes, k_.allocation_stream());
      } catch (const CudaOutOfMemory&) {
        // Out of memory with released buffers in the pool (none large enough), or freed
        // memory in the GPU's pool (scratch that grew): give them back to the GPU and try once
        // more, as a caching allocator does. The one wait of this path: for the compute
        // stream, before the GPU's pool lets the freed memory go.
        if (free_.empty() && k_.allocation_stream() == nullptr) throw;
        give_back_released();
        block = DeviceBuffer(bytes, k_.allocation_stream());
      }
      memory_.reserved += static_cast<std::int64_t>(block.bytes());
    }
    if (zeros) {
      k_.zero(block.get(), bytes);
    } else if (poison_unwritten_) {
      k_.fill_bytes(block.get(), bytes, 0xff);
    }
    memory_.in_use += static_cast<std::int64_t>(bytes);
    memory_.peak = std::max(memory_.peak, memory_.in_use);
    void* p = block.get();
    live_.emplace(p, std::make_pair(std::move(block), bytes));
    return {p, n, type};
  }

  static std::size_t bytes(View v) { return static_cast<std::size_t>(v.n) * bytes_of(v.type); }
  static Kernels::DropoutSite site_of(const DropoutSite& d) {
    return {d.stream, d.rate,        d.first_sequence,         d.first_row,
            d.Sq,     d.head_offset, ints_or_null(d.positions)};
  }
  // A view's type checked where the kernel that reads it is called: the failure names that
  // line (the caller's), not this one.
  using Where = std::source_location;
  static void expect(View v, exec::Dtype want, Where where) {
    if (v.type != want) {
      fail_assert(
          "v.type == want", where.file_name(), static_cast<int>(where.line()),
          fmt::format("a {} view expected, given a {} view of {} elements, in {}",
                      exec::to_string(want), exec::to_string(v.type), v.n, where.function_name()));
    }
  }
  void* act(View v, Where where = Where::current()) const {
    expect(v, act_, where);
    return v.p;
  }
  void* act_or_null(View v, Where where = Where::current()) const {
    return v.empty() ? nullptr : act(v, where);
  }
  static float* f32(View v, Where where = Where::current()) {
    expect(v, exec::Dtype::F32, where);
    return static_cast<float*>(v.p);
  }
  static float* f32_or_null(View v, Where where = Where::current()) {
    return v.empty() ? nullptr : f32(v, where);
  }
  static std::uint8_t* u8(View v, Where where = Where::current()) {
    expect(v, exec::Dtype::U8, where);
    return static_cast<std::uint8_t*>(v.p);
  }
  static int* ints(View v, Where where = Where::current()) {
    expect(v, exec::Dtype::I32, where);
    return static_cast<int*>(v.p);
  }
  static int* ints_or_null(View v, Where where = Where::current()) {
    return v.empty() ? nullptr : ints(v, where);
  }
  // Scratch for the per-row losses of T rows.
  float* rows(int T) {
    const auto need = static_cast<std::size_t>(T) * 4;
    if (rows_.bytes() < need) rows_ = DeviceBuffer(need, k_.allocation_stream());
    return rows_.f32();
  }

  exec::Dtype act_;
  Kernels k_;
  int gpu_;
  // Tensors for overwrite filled with bytes 0xff, as the CPU device's are (Device): for checks.
  bool poison_unwritten_ = poison_unwritten_from_env();
  std::unordered_map<void*, std::pair<DeviceBuffer, std::size_t>> live_;  // and bytes asked
  std::multimap<std::size_t, DeviceBuffer> free_;
  MemoryUse memory_;
  DeviceBuffer rows_;
};

}  // namespace

std::unique_ptr<Device> make_device(int gpu, exec::Dtype activations) {
  return std::make_unique<CudaDevice>(gpu, activations);
}

void* stream_of(Device& device) {
  auto* d = dynamic_cast<CudaDevice*>(&device);
  DTSIM_ASSERT(d != nullptr, "a GPU stream of a device that is not a GPU");
  return d->stream();
}

int mark_on(Device& device, void* stream) {
  auto* d = dynamic_cast<CudaDevice*>(&device);
  DTSIM_ASSERT(d != nullptr, "a GPU mark on a device that is not a GPU");
  return d->mark_on(stream);
}

int gpu_of(const Device& device) {
  const auto* d = dynamic_cast<const CudaDevice*>(&device);
  DTSIM_ASSERT(d != nullptr, "the GPU of a device that is not a GPU");
  return d->gpu();
}

}  // namespace dtsim::exec::cuda
