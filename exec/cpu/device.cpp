#include "exec/cpu/device.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

#include "exec/cpu/kernels.hpp"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace dtsim::exec::cpu {

void keep_freed_host_memory() {
#if defined(__GLIBC__)
  // mallopt(3): M_MMAP_MAX 0 serves every block from the heap; M_TRIM_THRESHOLD -1 never gives
  // the heap's top back. Both only tune the allocator; a refusal leaves glibc's defaults.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);
#endif
}

std::span<float> floats(View v) {
  if (v.empty()) return {};
  DTSIM_ASSERT(v.type == Dtype::F32, "an fp32 view");
  return {static_cast<float*>(v.p), static_cast<std::size_t>(v.n)};
}

namespace {

std::span<const int> ints(View v) {
  if (v.empty()) return {};
  DTSIM_ASSERT(v.type == Dtype::I32, "an int32 view");
  return {static_cast<const int*>(v.p), static_cast<std::size_t>(v.n)};
}

}  // namespace

View CpuDevice::take(std::int64_t n, Dtype type, bool zeros) {
  DTSIM_ASSERT(n >= 0 && type != Dtype::BF16, "the CPU device holds fp32, int32 and masks");
  // Words of 4 bytes (a mask of n bytes takes n/4 of them, rounded up).
  const auto words = static_cast<std::size_t>(
      std::max<std::int64_t>((n * static_cast<std::int64_t>(bytes_of(type)) + 3) / 4, 1));
  std::unique_ptr<float[]> block;
  std::size_t capacity = words;
  const auto it = free_.lower_bound(words);
  const bool reused = it != free_.end();
  if (reused) {
    capacity = it->first;
    block = std::move(it->second);
    free_.erase(it);
  } else {
    block = std::make_unique_for_overwrite<float[]>(words);
  }
  // Zeros, or for a tensor for overwrite nothing, or bytes 0xff (NaN) where asked, so that a
  // read before the write shows (Device::allocate_for_overwrite).
  if (zeros || poison_unwritten_) std::memset(block.get(), zeros ? 0 : 0xff, words * sizeof(float));
  void* p = block.get();
  live_.emplace(p, Live{std::move(block), capacity, words});
  if (!reused) memory_.reserved += static_cast<std::int64_t>(capacity);
  memory_.in_use += static_cast<std::int64_t>(words);
  memory_.peak = std::max(memory_.peak, memory_.in_use);
  return {p, n, type};
}

Device::MemoryUse CpuDevice::memory_use() const {
  constexpr std::int64_t word = sizeof(float);
  return {memory_.in_use * word, memory_.peak * word, memory_.reserved * word};
}

void CpuDevice::release(View v) {
  if (v.p == nullptr) return;
  const auto it = live_.find(v.p);
  DTSIM_ASSERT(it != live_.end(), "release of a view that was not allocated whole");
  memory_.in_use -= static_cast<std::int64_t>(it->second.words);
  free_.emplace(it->second.capacity, std::move(it->second.block));
  live_.erase(it);
}

void CpuDevice::zero(View v) {
  if (!v.empty()) std::memset(v.p, 0, static_cast<std::size_t>(v.n) * bytes_of(v.type));
}

void CpuDevice::copy(View dst, View src) {
  DTSIM_ASSERT(dst.n == src.n && dst.type == src.type, "copy between views of one shape");
  if (!dst.empty())
    std::memmove(dst.p, src.p, static_cast<std::size_t>(dst.n) * bytes_of(dst.type));
}

void CpuDevice::upload(View dst, const float* host) {
  std::copy_n(host, dst.n, floats(dst).begin());
}

void CpuDevice::upload_ints(View dst, const int* host) {
  DTSIM_ASSERT(dst.type == Dtype::I32, "an int32 view");
  std::copy_n(host, dst.n, static_cast<int*>(dst.p));
}

void CpuDevice::download(float* host, View src) {
  const auto s = floats(src);
  std::copy(s.begin(), s.end(), host);
}

int CpuDevice::mark() {
  marks_.push_back(std::chrono::steady_clock::now());
  return static_cast<int>(marks_.size()) - 1;
}

double CpuDevice::elapsed(int a, int b) {
  DTSIM_ASSERT(a >= 0 && b >= 0 && static_cast<std::size_t>(std::max(a, b)) < marks_.size(),
               "a mark of this device");
  return std::chrono::duration<double>(marks_[static_cast<std::size_t>(b)] -
                                       marks_[static_cast<std::size_t>(a)])
      .count();
}

void CpuDevice::matmul_forward(View out, View in, View w, View bias, int T, int K, int N,
                               bool w_transposed) {
  cpu::matmul_forward(floats(out), floats(in), floats(w), floats(bias), T, K, N, w_transposed);
}

void CpuDevice::matmul_backward(View din, View dw, View dbias, View dout, View in, View w, int T,
                                int K, int N, bool w_transposed) {
  cpu::matmul_backward(floats(din), floats(dw), floats(dbias), floats(dout), floats(in), floats(w),
                       T, K, N, w_transposed);
}

void CpuDevice::matmul_input_grad(View din, View dout, View w, int T, int K, int N,
                                  bool w_transposed) {
  cpu::matmul_input_grad(floats(din), floats(dout), floats(w), T, K, N, w_transposed);
}

void CpuDevice::norm_forward(View out, View mean, View rstd, View in, View w, View b, int T, int C,
                             bool rms) {
  cpu::norm_forward(floats(out), floats(mean), floats(rstd), floats(in), floats(w), floats(b), T, C,
                    rms);
}

void CpuDevice::norm_backward(View din, View dw, View db, View dout, View in, View w, View mean,
                              View rstd, int T, int C, bool rms) {
  cpu::norm_backward(floats(din), floats(dw), floats(db), floats(dout), floats(in), floats(w),
                     floats(mean), floats(rstd), T, C, rms);
}

void CpuDevice::add_forward(View out, View a, View b) {
  cpu::add_forward(floats(out), floats(a), floats(b));
}

void CpuDevice::accumulate(View d, View x, float scale) {
  cpu::accumulate(floats(d), floats(x), scale);
}

void CpuDevice::gelu_forward(View out, View in) {
  cpu::gelu_forward(floats(out), floats(in), in.n);
}

void CpuDevice::gelu_backward(View din, View in, View dout) {
  cpu::gelu_backward(floats(din), floats(in), floats(dout), in.n);
}

void CpuDevice::swiglu_forward(View out, View in, int T, int F) {
  cpu::swiglu_forward(floats(out), floats(in), T, F);
}

void CpuDevice::swiglu_backward(View din, View in, View dout, int T, int F) {
  cpu::swiglu_backward(floats(din), floats(in), floats(dout), T, F);
}

void CpuDevice::attention_forward(View out, View probs, View qkv, int B, int S, int H, int G,
                                  int D) {
  cpu::attention_forward(floats(out), floats(probs), floats(qkv), B, S, H, G, D);
}

void CpuDevice::attention_backward(View dqkv, View dout, View qkv, View probs, int B, int S, int H,
                                   int G, int D) {
  cpu::attention_backward(floats(dqkv), floats(dout), floats(qkv), floats(probs), B, S, H, G, D);
}

namespace {

std::span<std::uint8_t> bytes(View v) {
  if (v.empty()) return {};
  DTSIM_ASSERT(v.type == Dtype::U8, "a mask (uint8) view");
  return {static_cast<std::uint8_t*>(v.p), static_cast<std::size_t>(v.n)};
}

cpu::Dropout dropout_of(const Device::DropoutSite& d) {
  cpu::Dropout out;
  out.stream = d.stream;
  out.rate = d.rate;
  out.first_sequence = d.first_sequence;
  out.first_row = d.first_row;
  out.Sq = d.Sq;
  out.positions = ints(d.positions);
  out.head_offset = d.head_offset;
  return out;
}

// The kernels' options for an Attention (its dropout held in `holder`).
cpu::AttentionOptions options_of(const Device::Attention& a, std::optional<cpu::Dropout>& holder) {
  if (a.dropout) holder = dropout_of(*a.dropout);
  return {floats(a.kv),
          a.cp,
          ints(a.qpos),
          ints(a.order),
          holder ? &*holder : nullptr,
          bytes(a.mask),
          floats(a.dropped),
          floats(a.lse),
          a.v_dim};
}

}  // namespace

void CpuDevice::attention_forward_ex(View out, View probs, View qkv, int B, int Sq, int H, int G,
                                     int D, const Attention& a) {
  std::optional<cpu::Dropout> dropout;
  cpu::attention_forward(floats(out), floats(probs), floats(qkv), B, Sq, H, G, D,
                         options_of(a, dropout));
}

void CpuDevice::attention_backward_ex(View dqkv, View dkv, View dout, View qkv, View probs, int B,
                                      int Sq, int H, int G, int D, const Attention& a) {
  std::optional<cpu::Dropout> dropout;
  cpu::attention_backward(floats(dqkv), floats(dkv), floats(dout), floats(qkv), floats(probs), B,
                          Sq, H, G, D, options_of(a, dropout));
}

void CpuDevice::dropout_forward(View out, View mask, View in, const DropoutSite& d, int T, int C) {
  cpu::dropout_forward(floats(out), bytes(mask), floats(in), dropout_of(d), T, C);
}

void CpuDevice::dropout_add_forward(View out, View mask, View branch, View skip,
                                    const DropoutSite& d, int T, int C) {
  cpu::dropout_add_forward(floats(out), bytes(mask), floats(branch), floats(skip), dropout_of(d), T,
                           C);
}

void CpuDevice::dropout_backward(View din, View mask, View dout, float rate) {
  cpu::dropout_backward(floats(din), bytes(mask), floats(dout), rate);
}

namespace {

std::span<int> mutable_ints(View v) {
  if (v.empty()) return {};
  DTSIM_ASSERT(v.type == Dtype::I32, "an int32 view");
  return {static_cast<int*>(v.p), static_cast<std::size_t>(v.n)};
}

}  // namespace

void CpuDevice::moe_route(View experts, View gates, View logits, int T, int E, int k,
                          const Gating& gating) {
  cpu::moe_route(mutable_ints(experts), floats(gates), floats(logits), T, E, k, gating);
}

void CpuDevice::moe_route_backward(View dlogits, View dgates, View gates, View experts, View logits,
                                   int T, int E, int k, const Gating& gating) {
  cpu::moe_route_backward(floats(dlogits), floats(dgates), floats(gates), ints(experts),
                          logits.empty() ? cpu::In{} : floats(logits), T, E, k, gating);
}

void CpuDevice::moe_dispatch(View dispatched, View order, View rows, View x, View experts, int T,
                             int C, int k, int E) {
  std::vector<int> counts(static_cast<std::size_t>(E));
  cpu::moe_dispatch(floats(dispatched), mutable_ints(order), counts, floats(x), ints(experts), T, C,
                    k, E);
  const auto out = floats(rows);
  for (int e = 0; e < E; ++e) out[static_cast<std::size_t>(e)] = static_cast<float>(counts[e]);
}

void CpuDevice::moe_dispatch_backward(View dx, View ddispatched, View order, int T, int C, int k) {
  cpu::moe_dispatch_backward(floats(dx), floats(ddispatched), ints(order), T, C, k);
}

void CpuDevice::moe_combine(View out, View y, View gates, View order, int T, int C, int k) {
  cpu::moe_combine(floats(out), floats(y), floats(gates), ints(order), T, C, k);
}

void CpuDevice::moe_combine_backward(View dy, View dgates, View dout, View y, View gates,
                                     View order, int T, int C, int k) {
  cpu::moe_combine_backward(floats(dy), floats(dgates), floats(dout), floats(y), floats(gates),
                            ints(order), T, C, k);
}

void CpuDevice::copy_columns(View dst, View src, int T, int src_width, int begin, int width) {
  cpu::copy_columns(floats(dst), floats(src), T, src_width, begin, width);
}

void CpuDevice::add_columns(View dst, View src, int T, int dst_width, int begin, int width) {
  cpu::add_columns(floats(dst), floats(src), T, dst_width, begin, width);
}

void CpuDevice::mla_pack_forward(View qkv, View q, View kv, View k_rope, int B, int S, int H,
                                 int Dn, int Dr, int Dv, double theta, View positions) {
  cpu::mla_pack_forward(floats(qkv), floats(q), floats(kv), floats(k_rope), B, S, H, Dn, Dr, Dv,
                        theta, ints(positions));
}

void CpuDevice::mla_pack_backward(View dq, View dkv, View dk_rope, View dqkv, int B, int S, int H,
                                  int Dn, int Dr, int Dv, double theta, View positions) {
  cpu::mla_pack_backward(floats(dq), floats(dkv), floats(dk_rope), floats(dqkv), B, S, H, Dn, Dr,
                         Dv, theta, ints(positions));
}

void CpuDevice::rope_forward(View out, View qkv, int B, int S, int H, int G, int D, double theta,
                             View positions) {
  cpu::rope_forward(floats(out), floats(qkv), B, S, H, G, D, theta, ints(positions));
}

void CpuDevice::rope_backward(View dqkv, View dout, int B, int S, int H, int G, int D, double theta,
                              View positions) {
  cpu::rope_backward(floats(dqkv), floats(dout), B, S, H, G, D, theta, ints(positions));
}

void CpuDevice::embedding_forward(View out, View tokens, View wte, View wpe, int B, int S, int C,
                                  int vocab_begin, View positions) {
  cpu::embedding_forward(floats(out), ints(tokens), floats(wte), floats(wpe), B, S, C, vocab_begin,
                         ints(positions));
}

void CpuDevice::embedding_backward(View dwte, View dwpe, View dout, View tokens, int B, int S,
                                   int C, int vocab_begin, View positions) {
  cpu::embedding_backward(floats(dwte), floats(dwpe), floats(dout), ints(tokens), B, S, C,
                          vocab_begin, ints(positions));
}

void CpuDevice::cross_entropy_max(View rowmax, View logits, int T, int V) {
  cpu::cross_entropy_max(floats(rowmax), floats(logits), T, V);
}

void CpuDevice::cross_entropy_sums(View sums, View logits, View rowmax, View targets, int T, int V,
                                   int vocab_begin) {
  cpu::cross_entropy_sums(floats(sums), floats(logits), floats(rowmax), ints(targets), T, V,
                          vocab_begin);
}

void CpuDevice::cross_entropy_rescale(View sums, View local_max, View global_max, int T) {
  cpu::cross_entropy_rescale(floats(sums), floats(local_max), floats(global_max), T);
}

void CpuDevice::cross_entropy_sharded(View dlogits, View loss, View logits, View rowmax, View sums,
                                      View targets, int T, int V, int vocab_begin) {
  floats(loss)[0] = static_cast<float>(
      cpu::cross_entropy_sharded(floats(dlogits), floats(logits), floats(rowmax), floats(sums),
                                 ints(targets), T, V, vocab_begin));
}

void CpuDevice::sum_squares(View acc, View x) {
  floats(acc)[0] += static_cast<float>(cpu::sum_squares(floats(x), x.n));
}

void CpuDevice::clip_scale(View x, View norm_sq, float max_norm) {
  cpu::clip_scale(floats(x), x.n, std::sqrt(static_cast<double>(floats(norm_sq)[0])), max_norm);
}

void CpuDevice::adamw(View params, View grads, View m, View v, float lr, float beta1, float beta2,
                      float eps, float weight_decay, int t) {
  cpu::adamw(floats(params), floats(grads), floats(m), floats(v), params.n, lr, beta1, beta2, eps,
             weight_decay, t);
}

void CpuDevice::cast(View out, View in) {
  copy(out, in);
}

}  // namespace dtsim::exec::cpu
