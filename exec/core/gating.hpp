// How a mixture of experts' router weights each token's chosen experts (model::MoeSpec's
// gates): one definition for the CPU kernels, the devices and the GPU kernels (nvcc compiles it
// as host and device code).
#pragma once

namespace dtsim::exec {

// The k experts with the largest router logits (ties to the lower index) are weighted by
//   softmax scores (`sigmoid` false): the softmax of their k logits (`normalize`: Mixtral's), or
//     their probabilities in the softmax over all E (Switch Transformer's; Qwen-MoE's
//     norm_topk_prob false);
//   sigmoid scores (`sigmoid`: DeepSeek-V3's and GLM-4.5's): each logit's sigmoid, divided by
//     their sum over the k (`normalize`) or not;
// each times `scale` (routed_scaling_factor: DeepSeek's and GLM-4.5's 2.5).
struct Gating {
  bool sigmoid = false;
  bool normalize = true;
  float scale = 1.0f;
  // Whether the backward reads the logits again (all gates but the softmax over the k, whose
  // gradient the gates themselves give).
  constexpr bool reads_logits() const { return sigmoid || !normalize; }
};

}  // namespace dtsim::exec
