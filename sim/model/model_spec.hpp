// The description of a decoder-only transformer (models/README.md) and its loaders: dtsim's own
// JSON format and Hugging Face config.json files.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtsim::model {

enum class Activation { Gelu, SwiGlu };
enum class Norm { LayerNorm, RmsNorm };
enum class Positions { Learned, Rope };
// How the attention core runs, a plan's choice (plan::Plan::attention) that its ModelGraph's
// ops describe. Unfused: scores, masked softmax and probabilities x values as separate
// kernels, the s² tensors written to device memory and kept for the backward (Megatron-LM
// before fused kernels; Korthikanti et al. 2022). Flash: FlashAttention (Dao et al. 2022,
// Dao 2023): tiled on chip, only the output and a log-sum-exp per row written, the scores
// recomputed in the backward, and key blocks that the causal mask hides skipped.
enum class AttentionKernel { Unfused, Flash };

struct BiasSpec {
  bool qkv = false;
  bool attn_out = false;
  bool mlp = false;
  bool norm = false;
};

// Mixture of experts: every block's MLP becomes `experts` MLPs of width `expert_ffn_hidden`
// (same activation), each token routed to `top_k` of them by an h x experts router. Where
// `shared_ffn_hidden` > 0, a dense MLP of that width beside them takes every token, and its
// output is added to theirs (the shared experts of DeepSeekMoE, Dai et al. 2024, and
// Qwen1.5/Qwen2-MoE; several shared experts of width f are one of width n x f). Tensor
// parallelism splits it like a dense MLP; expert parallelism does not split it.
// The gates that weight a token's experts: the softmax of their top_k logits (`normalize_top_k`:
// Mixtral's, Jiang et al. 2024; the softmax over all experts renormalized over the top k,
// alike), or their probabilities in the softmax over all experts (Switch Transformer's, Fedus
// et al. 2022; Hugging Face's norm_topk_prob false, Qwen-MoE's default). The same cost; the
// gradient of the second reaches every expert's logit, and at top_k 1 the first's gate is 1.
// With `sigmoid_gates` each chosen expert's score is its logit's sigmoid, divided by their sum
// over the top k (`normalize_top_k`) or not (DeepSeek-V3's, Liu et al. 2024, and GLM-4.5's);
// every gate is then multiplied by `routed_scale` (their routed_scaling_factor). The same cost.
// Blocks whose MLP is dense (`dense_blocks`, ascending block numbers from 0, of width
// `dense_ffn_hidden`) where the others have experts: DeepSeek-V2/V3's first blocks
// (first_k_dense_replace), Llama 4 Maverick's every other block (interleave_moe_layer_step 2),
// Qwen-MoE's mlp_only_layers. Empty: experts in every block.
struct MoeSpec {
  std::int64_t experts = 0;
  std::int64_t top_k = 0;
  std::int64_t expert_ffn_hidden = 0;
  std::int64_t shared_ffn_hidden = 0;
  bool normalize_top_k = true;
  bool sigmoid_gates = false;
  double routed_scale = 1.0;
  std::vector<std::int64_t> dense_blocks;
  std::int64_t dense_ffn_hidden = 0;
};

// Multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024, Sec. 2.1; DeepSeek-V3): keys and
// values come from a latent of `kv_lora_rank` per token, an h x (kv_lora_rank + qk_rope_head_dim)
// down projection followed by an RMSNorm of the latent and a kv_lora_rank x heads x
// (qk_nope_head_dim + v_head_dim) up projection; the queries likewise from a latent of
// `q_lora_rank` (0: one h x heads x (qk_nope_head_dim + qk_rope_head_dim) projection, as
// DeepSeek-V2-Lite). Each head's query and key are qk_nope_head_dim wide without positions and
// qk_rope_head_dim with RoPE, the key's RoPE part one for all heads (from the down projection);
// its value is v_head_dim wide. Training computes the heads' keys and values whole (the
// absorbed form is an inference kernel's). Tensor parallelism splits the up projections and
// the output projection by heads; the down projections and the latents' norms are replicated
// (Megatron-Core's MLASelfAttention: with sequence parallelism they run on the rank's share of
// the sequence and their latents are all-gathered, so their weights' gradients are all-reduced
// over tp as the norms' are).
struct MlaSpec {
  std::int64_t q_lora_rank = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
};

struct ModelSpec {
  std::string name;
  std::string description;
  std::string source;
  std::string file;  // where it was read from (for messages)

  std::int64_t layers = 0;
  std::int64_t hidden = 0;
  std::int64_t heads = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t ffn_hidden = 0;
  std::int64_t vocab = 0;
  // Rows of the embedding table and the LM head when a plan pads the vocabulary
  // (plan::with_padded_vocab); 0: the vocabulary's own size. Tokens stay below `vocab`.
  std::int64_t padded_vocab = 0;
  std::int64_t max_positions = 0;
  std::int64_t seq_len = 0;  // default training sequence length
  Activation activation = Activation::Gelu;
  Norm norm = Norm::LayerNorm;
  Positions positions = Positions::Learned;
  // RoPE base: theta_i = rope_theta^(-2i/head_dim). Default 10000 (Su et al. 2021, RoFormer,
  // Sec. 3.3); Llama 3 uses 500000 (its config.json).
  double rope_theta = 10000.0;
  bool tied_embeddings = false;
  BiasSpec bias;
  bool dropout = false;
  std::optional<MoeSpec> moe;
  // Multi-head latent attention (then kv_heads = heads and head_dim = qk_nope_head_dim +
  // qk_rope_head_dim, the width of a head's query and key).
  std::optional<MlaSpec> mla;
  // A Hugging Face config's sliding-window attention, which dtsim does not model (full causal
  // attention is priced): said where a plan's sequence is longer than the window. Its kind, as
  // messages name it: "sliding window", or Llama 4's "chunked attention (on its layers with
  // RoPE)", whose queries attend within their chunk of that many tokens.
  std::optional<std::int64_t> unmodelled_sliding_window;
  std::string unmodelled_window_kind = "sliding window";
  // What of the published model dtsim leaves out (a phrase each, said in the description too):
  // the model that dtsim prices and dtexec trains is without it ("its q_norm and k_norm (an
  // RMSNorm of each head's queries and keys)"). From a Hugging Face config's import, or a model
  // file's "unmodelled". (The sliding window above, and the dropout below, apply only where
  // the sequence passes the window, and where the model trains with dropout.)
  std::vector<std::string> unmodelled;
  // GPT-2's dropout layers that its config turns off while others are on: dtsim and dtexec
  // put dropout in all three places; empty where none is.
  std::string unmodelled_dropout;

  std::optional<std::uint64_t> published_params;
  std::uint64_t published_params_precision = 1;
  std::string published_params_source;

  // Width of the attention projections: heads x head_dim (q) and kv_heads x head_dim (k, v).
  std::int64_t q_width() const { return heads * head_dim; }
  std::int64_t vocab_rows() const { return padded_vocab > 0 ? padded_vocab : vocab; }
  std::int64_t kv_width() const { return kv_heads * head_dim; }
  // A value head's width: head_dim, or multi-head latent attention's v_head_dim.
  std::int64_t v_head_dim() const { return mla ? mla->v_head_dim : head_dim; }
  // The attention core's values (kv_width, as its keys, or multi-head latent attention's
  // heads x v_head_dim), and its output, the output projection's input (q_width, or heads x
  // v_head_dim).
  std::int64_t v_width() const { return kv_heads * v_head_dim(); }
  std::int64_t o_width() const { return heads * v_head_dim(); }
  // Multi-head latent attention's latents, as its down projection writes them per token: the
  // queries' (q_lora_rank, 0 without), the keys' and values' (kv_lora_rank) and the keys' RoPE
  // part (qk_rope_head_dim); 0 without it.
  std::int64_t latent_width() const {
    return mla ? mla->q_lora_rank + mla->kv_lora_rank + mla->qk_rope_head_dim : 0;
  }
  // Width of the shared experts' MLP; 0 where there is none.
  std::int64_t shared_ffn() const { return moe ? moe->shared_ffn_hidden : 0; }
  // Whether block `layer`'s MLP is a mixture of experts (not one of MoeSpec::dense_blocks).
  bool has_experts(std::int64_t layer) const;
  // The blocks with experts: all of a mixture's but its dense blocks; 0 for a dense model.
  std::int64_t expert_blocks() const;
  // Whether a mixture has dense blocks among the experts' (its blocks differ).
  bool mixed_blocks() const { return moe && !moe->dense_blocks.empty(); }
  // The first block with experts (`with_experts`) or without; -1 where there is none.
  std::int64_t first_block(bool with_experts) const;
  // How many of blocks [first, last) are dense (a dense model's: all).
  std::int64_t dense_blocks_in(std::int64_t first, std::int64_t last) const;
  // The MLP widths that tensor parallelism splits, by their field's name: the dense MLP's
  // (ffn_hidden) or the experts' (expert_ffn_hidden), the shared experts', the dense blocks'.
  std::vector<std::pair<std::string_view, std::int64_t>> mlp_widths() const;
  // Width of the MLP that every token of block `layer` passes whole: a dense model's, a
  // mixture's dense block's, or its shared experts' beside the experts (0 where it has none).
  std::int64_t dense_ffn(std::int64_t layer) const;
  // The classic GPT block that Megatron-LM's FLOP formula describes exactly: multi-head
  // attention with head_dim = hidden/heads, GELU MLP of 4h, no MoE.
  bool is_megatron_gpt() const;
};

// Loads a model by name (models/<name>.json) or path; a file with a top-level "model_type" is
// read as a Hugging Face config.json. Throws InputError naming file and field.
ModelSpec load_model(std::string_view name_or_path);

// Parses dtsim's model format; `file` is used in messages.
ModelSpec model_from_json(const nlohmann::json& j, const std::string& file);

// The shapes and choices a model computes with, as dtsim describe --json's `architecture`
// gives them (layers, hidden, heads, kv_heads, head_dim, ffn_hidden, vocab, max_positions,
// activation, norm, positions, rope_theta, tied_embeddings, dropout, bias, moe).
nlohmann::json architecture_json(const ModelSpec& m);

// Parses a Hugging Face config.json (model_type gpt2, granite, llama, llama4 (its text_config)
// or llama4_text, mistral, mixtral, olmo2, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe).
ModelSpec model_from_hf_config(const nlohmann::json& j, const std::string& file);

// Sanity bounds on a model's dimensions. With them, and the size limits below, every count of
// the ModelGraph (parameters, saved bytes) stays far inside 64 bits.
inline constexpr std::int64_t kMaxLayers = 100000;
inline constexpr std::int64_t kMaxWidth = std::int64_t{1} << 24;  // hidden, ffn, vocab, positions
inline constexpr std::int64_t kMaxHeads = std::int64_t{1} << 16;  // heads, kv_heads
inline constexpr std::int64_t kMaxExperts = std::int64_t{1} << 16;
inline constexpr double kMaxParams = 1125899906842624.0;         // 2^50, ~1000x the largest
inline constexpr double kMaxSavedBytes = 1152921504606846976.0;  // 2^60 per micro-batch

// Upper bounds, computed in double (no wrap-around), of the model's parameters and of the
// activation bytes one micro-batch of `micro_batch` x `seq_len` tokens saves over all blocks
// (4-byte elements, no parallelism, no recompute).
double params_upper_bound(const ModelSpec& m);
double saved_bytes_upper_bound(const ModelSpec& m, double micro_batch, double seq_len);
// Why one micro-batch of this shape is too large for dtsim's 64-bit counts; empty when it fits.
std::string size_problem(const ModelSpec& m, std::int64_t micro_batch, std::int64_t seq_len);

// Checks dimensions for bounds and consistency (kv_heads dividing heads, ...). Messages name
// the fields by `keys` (dtsim field -> the key in the file, for Hugging Face configs); a field
// not in `keys` is named as in dtsim's format.
void validate_model(const ModelSpec& m,
                    const std::map<std::string, std::string, std::less<>>& keys = {});

std::string_view to_string(Activation a);
std::string_view to_string(Norm n);
std::string_view to_string(Positions p);
std::string_view to_string(AttentionKernel a);
// "unfused" or "flash"; false for anything else.
bool parse_attention_kernel(std::string_view text, AttentionKernel& out);

}  // namespace dtsim::model
