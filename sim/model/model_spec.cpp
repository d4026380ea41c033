#include "sim/model/model_spec.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"

namespace dtsim::model {

using nlohmann::json;

std::string_view to_string(Activation a) {
  return a == Activation::Gelu ? "gelu" : "swiglu";
}
std::string_view to_string(Norm n) {
  return n == Norm::LayerNorm ? "layernorm" : "rmsnorm";
}
std::string_view to_string(Positions p) {
  return p == Positions::Learned ? "learned" : "rope";
}
std::string_view to_string(AttentionKernel a) {
  return a == AttentionKernel::Unfused ? "unfused" : "flash";
}
bool parse_attention_kernel(std::string_view text, AttentionKernel& out) {
  for (const AttentionKernel a : {AttentionKernel::Unfused, AttentionKernel::Flash}) {
    if (text == to_string(a)) {
      out = a;
      return true;
    }
  }
  return false;
}

bool ModelSpec::has_experts(std::int64_t layer) const {
  return moe && !std::binary_search(moe->dense_blocks.begin(), moe->dense_blocks.end(), layer);
}

std::int64_t ModelSpec::expert_blocks() const {
  return moe ? layers - static_cast<std::int64_t>(moe->dense_blocks.size()) : 0;
}

std::int64_t ModelSpec::first_block(bool with_experts) const {
  if (!moe) return with_experts || layers == 0 ? -1 : 0;
  const auto& dense = moe->dense_blocks;
  if (!with_experts) return dense.empty() ? -1 : dense.front();
  // (The dense blocks ascend: the first number they skip.)
  std::int64_t l = 0;
  while (l < static_cast<std::int64_t>(dense.size()) && dense[static_cast<std::size_t>(l)] == l)
    ++l;
  return l < layers ? l : -1;
}

std::int64_t ModelSpec::dense_blocks_in(std::int64_t first, std::int64_t last) const {
  if (!moe) return last - first;
  const auto& dense = moe->dense_blocks;
  return std::lower_bound(dense.begin(), dense.end(), last) -
         std::lower_bound(dense.begin(), dense.end(), first);
}

std::vector<std::pair<std::string_view, std::int64_t>> ModelSpec::mlp_widths() const {
  if (!moe) return {{"ffn_hidden", ffn_hidden}};
  std::vector<std::pair<std::string_view, std::int64_t>> out = {
      {"expert_ffn_hidden", moe->expert_ffn_hidden}};
  if (moe->shared_ffn_hidden > 0) out.emplace_back("shared_ffn_hidden", moe->shared_ffn_hidden);
  if (mixed_blocks()) out.emplace_back("dense_ffn_hidden", moe->dense_ffn_hidden);
  return out;
}

std::int64_t ModelSpec::dense_ffn(std::int64_t layer) const {
  if (!moe) return ffn_hidden;
  return has_experts(layer) ? moe->shared_ffn_hidden : moe->dense_ffn_hidden;
}

bool ModelSpec::is_megatron_gpt() const {
  return activation == Activation::Gelu && !moe && !mla && kv_heads == heads &&
         head_dim * heads == hidden && ffn_hidden == 4 * hidden;
}

ModelSpec model_from_json(const json& j, const std::string& file) {
  refuse_other_kind(j, file, "model");
  const JsonReader r(j, file);
  r.expect_only({"name",
                 "description",
                 "source",
                 "layers",
                 "hidden",
                 "heads",
                 "kv_heads",
                 "head_dim",
                 "ffn_hidden",
                 "vocab",
                 "max_positions",
                 "seq_len",
                 "activation",
                 "norm",
                 "positions",
                 "rope_theta",
                 "tied_embeddings",
                 "bias",
                 "dropout",
                 "moe",
                 "mla",
                 "unmodelled_window",
                 "unmodelled",
                 "published_params",
                 "published_params_precision",
                 "published_params_source"});
  ModelSpec m;
  m.file = file;
  m.name = r.name("name");
  m.description = r.string_or("description", "");
  m.source = r.string("source");
  m.layers = r.positive_int("layers");
  m.hidden = r.positive_int("hidden");
  m.heads = r.positive_int("heads");
  m.kv_heads = r.positive_int_or("kv_heads", m.heads);
  if (r.has("mla")) {
    const JsonReader a = r.object("mla");
    a.expect_only(
        {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"});
    m.mla.emplace();
    // (Left out: queries projected from the block's input, without a latent.)
    m.mla->q_lora_rank = a.has("q_lora_rank") ? a.positive_int("q_lora_rank") : 0;
    m.mla->kv_lora_rank = a.positive_int("kv_lora_rank");
    m.mla->qk_nope_head_dim = a.positive_int("qk_nope_head_dim");
    m.mla->qk_rope_head_dim = a.positive_int("qk_rope_head_dim");
    m.mla->v_head_dim = a.positive_int("v_head_dim");
    // Every head has keys and values of its own, as wide as its query's nope and rope parts.
    if (m.kv_heads != m.heads) {
      r.fail("kv_heads", fmt::format("{} with mla, whose every head has its own keys and values: "
                                     "leave kv_heads out or give heads ({})",
                                     m.kv_heads, m.heads));
    }
    const std::int64_t qk = m.mla->qk_nope_head_dim + m.mla->qk_rope_head_dim;
    if (r.has("head_dim") && r.positive_int("head_dim") != qk) {
      r.fail("head_dim",
             fmt::format("{} with mla, whose heads' queries and keys are mla.qk_nope_head_dim + "
                         "mla.qk_rope_head_dim = {} wide: leave head_dim out or give {}",
                         r.positive_int("head_dim"), qk, qk));
    }
    m.head_dim = qk;
  } else if (r.has("head_dim")) {
    m.head_dim = r.positive_int("head_dim");
  } else {
    if (m.hidden % m.heads != 0) {
      r.fail("heads", fmt::format("hidden = {} is not divisible by heads = {} (give head_dim "
                                  "if the model's head width differs)",
                                  m.hidden, m.heads));
    }
    m.head_dim = m.hidden / m.heads;
  }
  // (Required for a dense model; a mixture of experts' MLPs are its experts, below.)
  const std::int64_t ffn_given = r.has("ffn_hidden") ? r.positive_int("ffn_hidden") : 0;
  m.vocab = r.positive_int("vocab");
  m.max_positions = r.positive_int("max_positions");
  m.seq_len = r.positive_int_or("seq_len", m.max_positions);
  m.activation =
      r.choice("activation", {"gelu", "swiglu"}) == "gelu" ? Activation::Gelu : Activation::SwiGlu;
  m.norm =
      r.choice("norm", {"layernorm", "rmsnorm"}) == "layernorm" ? Norm::LayerNorm : Norm::RmsNorm;
  m.positions = r.choice("positions", {"learned", "rope"}) == "learned" ? Positions::Learned
                                                                        : Positions::Rope;
  if (r.has("rope_theta")) {
    if (m.positions != Positions::Rope) r.fail("rope_theta", "only for positions \"rope\"");
    m.rope_theta = r.positive_number("rope_theta");
  }
  m.tied_embeddings = r.boolean("tied_embeddings");
  if (r.has("bias")) {
    const JsonReader b = r.object("bias");
    b.expect_only({"qkv", "attn_out", "mlp", "norm"});
    m.bias.qkv = b.boolean_or("qkv", false);
    m.bias.attn_out = b.boolean_or("attn_out", false);
    m.bias.mlp = b.boolean_or("mlp", false);
    m.bias.norm = b.boolean_or("norm", false);
  }
  m.dropout = r.boolean_or("dropout", false);
  if (r.has("unmodelled")) m.unmodelled = r.string_array("unmodelled");
  if (r.has("unmodelled_window")) {
    // Attention that looks back a bounded number of tokens, priced as full causal attention:
    // said where the sequence is longer (a Hugging Face config's sliding window, or Llama 4's
    // chunked attention).
    const JsonReader w = r.object("unmodelled_window");
    w.expect_only({"tokens", "kind"});
    m.unmodelled_sliding_window = w.positive_int("tokens");
    m.unmodelled_window_kind = w.name("kind");
  }
  if (r.has("moe")) {
    const JsonReader e = r.object("moe");
    e.expect_only({"experts", "top_k", "expert_ffn_hidden", "shared_ffn_hidden", "normalize_top_k",
                   "scores", "routed_scaling_factor", "dense_blocks", "dense_ffn_hidden"});
    m.moe.emplace();
    m.moe->experts = e.positive_int("experts");
    m.moe->top_k = e.positive_int("top_k");
    m.moe->expert_ffn_hidden = e.positive_int("expert_ffn_hidden");
    m.moe->shared_ffn_hidden = e.has("shared_ffn_hidden") ? e.positive_int("shared_ffn_hidden") : 0;
    m.moe->normalize_top_k = e.boolean_or("normalize_top_k", true);
    if (e.has("scores")) {
      m.moe->sigmoid_gates = e.choice("scores", {"softmax", "sigmoid"}) == "sigmoid";
    }
    // (A factor, whose bounds only a typo leaves: DeepSeek-V3's and GLM-4.5's 2.5.)
    if (e.has("routed_scaling_factor")) {
      m.moe->routed_scale = e.number_within("routed_scaling_factor", 1e-3, 1e3, "a factor");
    }
    if (e.has("dense_blocks")) {
      // Block numbers from 0, ascending (validate_model checks them against the layers).
      m.moe->dense_blocks = e.non_negative_int_array_up_to("dense_blocks", kMaxLayers);
      if (m.moe->dense_blocks.empty()) {
        e.fail("dense_blocks",
               "expected the numbers (from 0) of the blocks whose MLP is dense; "
               "leave it out where every block has experts");
      }
      m.moe->dense_ffn_hidden = e.positive_int("dense_ffn_hidden");
    } else if (e.has("dense_ffn_hidden")) {
      e.fail("dense_ffn_hidden", "given without dense_blocks (the blocks whose MLP it is)");
    }
    // The experts' width: the dense blocks' is moe.dense_ffn_hidden, and one that differs
    // would be read nowhere, in silence (cpu-small-moe said 1024 for experts of 512).
    if (ffn_given != 0 && ffn_given != m.moe->expert_ffn_hidden) {
      r.fail("ffn_hidden",
             fmt::format("{} differs from moe.expert_ffn_hidden {}: a mixture-of-experts "
                         "model's MLPs are its experts (dense blocks among them are "
                         "moe.dense_blocks of moe.dense_ffn_hidden; shared experts beside them "
                         "are moe.shared_ffn_hidden); leave ffn_hidden out or give the experts' "
                         "width",
                         ffn_given, m.moe->expert_ffn_hidden));
    }
    m.ffn_hidden = m.moe->expert_ffn_hidden;
  } else {
    if (ffn_given == 0) {
      r.fail("ffn_hidden", "required field is missing (the MLP's width of a model without moe)");
    }
    m.ffn_hidden = ffn_given;
  }
  if (!r.has("published_params")) {
    for (std::string_view k : {"published_params_precision", "published_params_source"}) {
      if (r.has(k)) r.fail(k, "given without published_params");
    }
  } else {
    m.published_params = static_cast<std::uint64_t>(r.positive_int("published_params"));
    m.published_params_precision =
        static_cast<std::uint64_t>(r.positive_int_or("published_params_precision", 1));
    // The unit the published figure is rounded to: at most the figure (1e18 matched any count).
    if (m.published_params_precision > *m.published_params) {
      r.fail("published_params_precision",
             fmt::format("expected a unit of rounding of at most published_params ({}), got {}",
                         *m.published_params, m.published_params_precision));
    }
    m.published_params_source = r.string("published_params_source");
  }
  validate_model(m);
  return m;
}

double params_upper_bound(const ModelSpec& m) {
  const double h = static_cast<double>(m.hidden);
  const double q = static_cast<double>(m.q_width());
  const double kv = static_cast<double>(m.kv_width());
  const double experts = m.moe ? static_cast<double>(m.moe->experts) : 1.0;
  const double f = static_cast<double>(m.moe ? m.moe->expert_ffn_hidden : m.ffn_hidden);
  const double fs = static_cast<double>(m.shared_ffn());
  const double fd = m.moe ? static_cast<double>(m.moe->dense_ffn_hidden) : 0.0;
  // Per block: norms (4h), attention with biases, and per expert an MLP of at most three h x f
  // matrices with biases, plus the router, the shared experts and a dense block's MLP (models/
  // README.md "Parameter count").
  // Multi-head latent attention's down projection and norm, and its up projections from the
  // latents (at most as wide as h x each: a bound, not the count).
  const double latent = static_cast<double>(m.latent_width());
  const double o = static_cast<double>(m.o_width()), v = static_cast<double>(m.v_width());
  const double mla = latent > 0 ? (h + 1) * latent + latent * (q + kv + v) : 0.0;
  const double block = 4 * h + (h + 1) * (q + kv + v) + mla + o * h + h +
                       experts * (3 * h * f + 2 * f + h) + h * experts +
                       (fs > 0 ? 3 * h * fs + 2 * fs + h : 0.0) +
                       (fd > 0 ? 3 * h * fd + 2 * fd + h : 0.0);
  return static_cast<double>(m.layers) * block +
         (2 * static_cast<double>(m.vocab_rows()) + static_cast<double>(m.max_positions) + 2) * h;
}

double saved_bytes_upper_bound(const ModelSpec& m, double micro_batch, double seq_len) {
  const double tokens = micro_batch * seq_len;
  const double h = static_cast<double>(m.hidden);
  const double q = static_cast<double>(m.q_width());
  const double kv = static_cast<double>(m.kv_width());
  const double copies = m.moe ? static_cast<double>(m.moe->top_k) : 1.0;
  const double experts = m.moe ? static_cast<double>(m.moe->experts) : 0.0;
  const double f = static_cast<double>(m.moe ? m.moe->expert_ffn_hidden : m.ffn_hidden);
  const double fs = static_cast<double>(m.shared_ffn()) +
                    (m.moe ? static_cast<double>(m.moe->dense_ffn_hidden) : 0.0);
  // Per token of a block: norm, residual and projection inputs (6h + q + 2kv), the MLP's
  // input, gate/up and down inputs and output per routed copy (2h + 3f), the shared experts'
  // or a dense block's (2h + 3fs, fs the two widths' sum), and fp32 routing probabilities; plus the
  // s² attention terms (softmax output, dropout mask and output: at most 9 bytes per score). Ends:
  // embedding mask, final norm, head input and fp32 logits.
  // (Multi-head latent attention's: values of their own width, the latents twice: the norm's
  // and the up projections' inputs.)
  const double v = static_cast<double>(m.v_width());
  const double latent = static_cast<double>(m.latent_width());
  const double per_token = 6 * h + q + kv + v + 2 * latent + copies * (2 * h + 3 * f) +
                           (fs > 0 ? 2 * h + 3 * fs : 0.0) + experts;
  const double scores = micro_batch * static_cast<double>(m.heads) * seq_len * seq_len;
  return static_cast<double>(m.layers) * (4 * tokens * per_token + 9 * scores) +
         4 * tokens * (3 * h + static_cast<double>(m.vocab_rows()));
}

std::string size_problem(const ModelSpec& m, std::int64_t micro_batch, std::int64_t seq_len) {
  constexpr double kMaxTokens = 2147483648.0;  // 2^31
  const double tokens = static_cast<double>(micro_batch) * static_cast<double>(seq_len);
  if (tokens > kMaxTokens) {
    return fmt::format(
        "micro-batch x seq_len = {} x {} = {:.0f} tokens exceeds dtsim's limit of "
        "2^31",
        micro_batch, seq_len, tokens);
  }
  const double bytes =
      saved_bytes_upper_bound(m, static_cast<double>(micro_batch), static_cast<double>(seq_len));
  if (bytes > kMaxSavedBytes) {
    return fmt::format(
        "one micro-batch of {} x {} tokens would save about {:.3g} bytes of "
        "activations, more than dtsim's limit of 2^60",
        micro_batch, seq_len, bytes);
  }
  return {};
}

void validate_model(const ModelSpec& m,
                    const std::map<std::string, std::string, std::less<>>& keys) {
  auto key = [&](std::string_view field) {
    const auto it = keys.find(field);
    return it == keys.end() ? std::string(field) : it->second;
  };
  auto bad = [&](std::string_view field, const std::string& msg) {
    throw InputError(fmt::format("{}: {}: {}", m.file, key(field), msg));
  };
  auto at_most = [&](std::string_view field, std::int64_t value, std::int64_t max) {
    if (value > max) bad(field, fmt::format("expected at most {}, got {}", max, value));
  };
  at_most("layers", m.layers, kMaxLayers);
  at_most("hidden", m.hidden, kMaxWidth);
  at_most("heads", m.heads, kMaxHeads);
  at_most("kv_heads", m.kv_heads, kMaxHeads);
  // (Latent attention's head width is its two parts': heads x head_dim below names them.)
  if (!m.mla) at_most("head_dim", m.head_dim, kMaxWidth);
  // (A mixture's is its experts' width, bounded as moe.expert_ffn_hidden below.)
  if (!m.moe) at_most("ffn_hidden", m.ffn_hidden, kMaxWidth);
  at_most("vocab", m.vocab, kMaxWidth);
  at_most("max_positions", m.max_positions, kMaxWidth);
  if (m.q_width() > kMaxWidth) {
    // (With latent attention a head's query is its two parts: their fields are named.)
    const std::string head =
        m.mla ? "(" + key("mla.qk_nope_head_dim") + " + " + key("mla.qk_rope_head_dim") + ")"
              : key("head_dim");
    bad(m.mla ? "mla.qk_nope_head_dim" : "head_dim",
        fmt::format("{} x {} = {} x {} = {} exceeds {}", key("heads"), head, m.heads, m.head_dim,
                    m.q_width(), kMaxWidth));
  }
  if (m.mla) {
    // (Named by a Hugging Face config's keys where it has them: key().)
    at_most("mla.q_lora_rank", m.mla->q_lora_rank, kMaxWidth);
    at_most("mla.kv_lora_rank", m.mla->kv_lora_rank, kMaxWidth);
    at_most("mla.qk_nope_head_dim", m.mla->qk_nope_head_dim, kMaxWidth);
    at_most("mla.qk_rope_head_dim", m.mla->qk_rope_head_dim, kMaxWidth);
    at_most("mla.v_head_dim", m.mla->v_head_dim, kMaxWidth);
    if (m.positions != Positions::Rope) {
      bad("positions",
          "expected \"rope\" with multi-head latent attention (its keys' and "
          "queries' rotary parts are qk_rope_head_dim wide)");
    }
    if (m.mla->qk_rope_head_dim % 2 != 0) {
      bad("mla.qk_rope_head_dim", fmt::format("expected an even width (RoPE turns pairs), got {}",
                                              m.mla->qk_rope_head_dim));
    }
    if (m.bias.qkv) {
      bad("bias.qkv", "biases of multi-head latent attention's projections are not modelled");
    }
    if (m.o_width() > kMaxWidth) {
      bad("mla.v_head_dim", fmt::format("{} x {} = {} exceeds {}", key("heads"), m.mla->v_head_dim,
                                        m.o_width(), kMaxWidth));
    }
  } else if (m.positions == Positions::Rope && m.head_dim % 2 != 0) {
    // RoPE turns a head's dimensions in pairs.
    bad("head_dim", fmt::format("expected an even {} with rotary positions, got {}",
                                key("head_dim"), m.head_dim));
  }
  if (m.heads % m.kv_heads != 0) {
    bad("kv_heads", fmt::format("{} = {} must divide {} = {}", key("kv_heads"), m.kv_heads,
                                key("heads"), m.heads));
  }
  if (m.seq_len > m.max_positions) {
    bad("seq_len", fmt::format("{} = {} exceeds {} = {}", key("seq_len"), m.seq_len,
                               key("max_positions"), m.max_positions));
  }
  if (m.moe) {
    at_most("moe.experts", m.moe->experts, kMaxExperts);
    at_most("moe.expert_ffn_hidden", m.moe->expert_ffn_hidden, kMaxWidth);
    at_most("moe.shared_ffn_hidden", m.moe->shared_ffn_hidden, kMaxWidth);
    at_most("moe.dense_ffn_hidden", m.moe->dense_ffn_hidden, kMaxWidth);
    const auto& dense = m.moe->dense_blocks;
    for (std::size_t i = 0; i < dense.size(); ++i) {
      const std::string field = fmt::format("moe.dense_blocks[{}]", i);
      if (dense[i] >= m.layers) {
        bad(field, fmt::format("block {} of {} (blocks are numbered from 0 to {})", dense[i],
                               m.layers, m.layers - 1));
      }
      if (i > 0 && dense[i] <= dense[i - 1]) {
        bad(field, fmt::format("{} after {}: expected block numbers in ascending order, each once",
                               dense[i], dense[i - 1]));
      }
    }
    if (static_cast<std::int64_t>(dense.size()) == m.layers) {
      bad("moe.dense_blocks",
          fmt::format("all {} blocks dense: no block has experts (describe a dense model without "
                      "moe)",
                      m.layers));
    }
    if (m.moe->top_k > m.moe->experts) {
      // In the message, dtsim's own names drop the "moe." prefix ("top_k = 4 exceeds ...").
      auto name = [&](std::string_view field) {
        return keys.count(field) ? key(field) : std::string(field.substr(4));
      };
      bad("moe.top_k", fmt::format("{} = {} exceeds {} = {}", name("moe.top_k"), m.moe->top_k,
                                   name("moe.experts"), m.moe->experts));
    }
  }
  if (const double params = params_upper_bound(m); params > kMaxParams) {
    throw InputError(
        fmt::format("{}: about {:.3g} parameters exceed dtsim's limit of 2^50 "
                    "(check {}, {} and {})",
                    m.file, params, key("layers"), key("hidden"), key("ffn_hidden")));
  }
  if (const std::string problem = size_problem(m, 1, m.seq_len); !problem.empty()) {
    bad("seq_len", problem);
  }
}

namespace {

// Hugging Face keys of the dtsim fields read so far, for validate_model's messages.
using KeyMap = std::map<std::string, std::string, std::less<>>;

// First present key among `keys` as a positive integer; records it as the key of `field`.
// Where the keys are `aliases` (names of one figure), another of them present with another
// value is a contradiction, refused (which one Hugging Face reads depends on the model class);
// else the later keys are fallbacks.
std::int64_t hf_int(const JsonReader& r, KeyMap& names, std::string_view field,
                    std::initializer_list<std::string_view> keys, bool aliases = true) {
  for (auto k = keys.begin(); k != keys.end(); ++k) {
    if (!r.has(*k)) continue;
    names[std::string(field)] = std::string(*k);
    const std::int64_t v = r.positive_int(*k);
    for (auto other = std::next(k); aliases && other != keys.end(); ++other) {
      if (r.has(*other) && r.positive_int(*other) != v) {
        r.fail(*other, fmt::format("{} here, but {} is {}: the same figure, given twice apart",
                                   r.positive_int(*other), *k, v));
      }
    }
    return v;
  }
  r.fail(*keys.begin(), "required field is missing");
}

// A mixture's routed experts as the families with moe_intermediate_size give them: their count
// (the first of `count_keys` present), num_experts_per_tok a token, and their width, which is
// the model's ffn_hidden (a dense block's width is the family's intermediate_size).
void read_routed_experts(const JsonReader& r, KeyMap& names, ModelSpec& m,
                         std::initializer_list<std::string_view> count_keys) {
  m.moe.emplace();
  m.moe->experts = hf_int(r, names, "moe.experts", count_keys);
  m.moe->top_k = hf_int(r, names, "moe.top_k", {"num_experts_per_tok"});
  m.moe->expert_ffn_hidden = hf_int(r, names, "moe.expert_ffn_hidden", {"moe_intermediate_size"});
  m.ffn_hidden = m.moe->expert_ffn_hidden;
  names["ffn_hidden"] = "moe_intermediate_size";
}

// A mixture's dense blocks: those of its `layers` where `experts` is false, their MLP's width
// read from `width_key` (required where there are some). A config whose blocks are all dense
// is refused (`blocks_key`: the field that says where the experts are).
template <class HasExperts>
void read_dense_blocks(const JsonReader& r, KeyMap& names, ModelSpec& m, HasExperts experts,
                       std::string_view blocks_key, std::string_view width_key) {
  std::vector<std::int64_t> dense;
  for (std::int64_t l = 0; l < m.layers; ++l) {
    if (!experts(l)) dense.push_back(l);
  }
  if (static_cast<std::int64_t>(dense.size()) == m.layers) {
    r.fail(blocks_key, fmt::format("no block of the {} has experts: a dense model (give its "
                                   "model_type without experts)",
                                   m.layers));
  }
  if (dense.empty()) return;
  m.moe->dense_blocks = std::move(dense);
  m.moe->dense_ffn_hidden = hf_int(r, names, "moe.dense_ffn_hidden", {width_key});
}

// A qwen2_moe or qwen3_moe config's mixture of experts (Hugging Face's Qwen2MoeSparseMoeBlock,
// Qwen3MoeSparseMoeBlock): experts of width moe_intermediate_size; qwen2_moe's beside a shared
// expert of width shared_expert_intermediate_size, whose output a sigmoid gate scales per
// token (that gate is not modelled); qwen3_moe's alone. A block is dense, an MLP of
// intermediate_size (Qwen2MoeMLP, Qwen3MoeMLP), where mlp_only_layers names it or
// decoder_sparse_step skips it (experts where (block + 1) % decoder_sparse_step is 0).
void read_qwen_moe(const JsonReader& r, KeyMap& names, ModelSpec& m, std::string_view type) {
  // (Newer transformers save num_experts as num_local_experts.)
  read_routed_experts(r, names, m, {"num_experts", "num_local_experts"});
  // (Qwen2MoeConfig's and Qwen3MoeConfig's defaults: 1, and no dense blocks.)
  const std::int64_t step =
      r.has("decoder_sparse_step") ? r.positive_int("decoder_sparse_step") : 1;
  const std::vector<std::int64_t> mlp_only =
      r.has("mlp_only_layers") ? r.non_negative_int_array_up_to("mlp_only_layers", m.layers - 1)
                               : std::vector<std::int64_t>{};
  read_dense_blocks(
      r, names, m,
      [&](std::int64_t l) {
        return (l + 1) % step == 0 &&
               std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end();
      },
      mlp_only.empty() || step > m.layers ? "decoder_sparse_step" : "mlp_only_layers",
      "intermediate_size");
  if (type == "qwen2_moe") {
    // Qwen2MoeConfig's default is 5632 (Qwen1.5-MoE-A2.7B's); a config without the key is
    // refused rather than given it in silence.
    if (!r.has("shared_expert_intermediate_size")) {
      r.fail("shared_expert_intermediate_size", "required field is missing");
    }
    if (r.raw().at("shared_expert_intermediate_size").is_null()) {
      r.fail("shared_expert_intermediate_size",
             "expected the shared expert's width, or 0 for none; got null");
    }
    if (r.non_negative_number("shared_expert_intermediate_size") > 0) {
      m.moe->shared_ffn_hidden =
          hf_int(r, names, "moe.shared_ffn_hidden", {"shared_expert_intermediate_size"});
      m.description +=
          "; its shared expert's sigmoid gate (shared_expert_gate: an h-wide projection "
          "scaling the shared expert's output per token) is not modelled";
      m.unmodelled.push_back(
          "its shared_expert_gate (the shared expert's output added unscaled instead)");
    }
  } else if (r.has("shared_expert_intermediate_size") &&
             r.non_negative_number("shared_expert_intermediate_size") > 0) {
    r.fail("shared_expert_intermediate_size",
           "Hugging Face's qwen3_moe model has no shared expert (model_type qwen2_moe has): 0 or "
           "none only");
  }
  if (!m.mixed_blocks() && r.has("intermediate_size") &&
      r.positive_int("intermediate_size") != m.ffn_hidden) {
    m.description += fmt::format(
        "; its intermediate_size ({}, the width of dense blocks' MLP) is not used: every block "
        "is a mixture of experts of width moe_intermediate_size",
        r.positive_int("intermediate_size"));
  }
  // (Qwen2MoeConfig's and Qwen3MoeConfig's default: false.)
  m.moe->normalize_top_k = r.boolean_or("norm_topk_prob", false);
}

// A glm4_moe config's blocks (Hugging Face's Glm4MoeDecoderLayer, Glm4MoeMoE; GLM-4.5 and
// 4.6): the first first_k_dense_replace blocks dense MLPs of intermediate_size, the others
// n_routed_experts experts of moe_intermediate_size, the top num_experts_per_tok a token,
// beside n_shared_experts shared ones (one MLP of n_shared_experts x moe_intermediate_size).
// Its gates: the chosen logits' sigmoids over their sum (norm_topk_prob), times
// routed_scaling_factor. Said not to be modelled: its router's selection bias
// (e_score_correction_bias) and group-limited choice (n_group, topk_group), its RMSNorm of
// each head's queries and keys (use_qk_norm), and its multi-token prediction layers
// (num_nextn_predict_layers, which Hugging Face's class leaves out too).
// The shared experts of DeepSeekMoE's families (n_shared_experts of the experts' width: one MLP
// n_shared_experts times as wide), `fallback` where the key is left out.
void read_shared_experts(const JsonReader& r, KeyMap& names, ModelSpec& m, std::int64_t fallback) {
  const std::int64_t shared = r.has("n_shared_experts")
                                  ? r.non_negative_int_up_to("n_shared_experts", kMaxExperts)
                                  : fallback;
  if (shared > 0) {
    m.moe->shared_ffn_hidden = shared * m.moe->expert_ffn_hidden;
    names["moe.shared_ffn_hidden"] = "n_shared_experts";
  }
}

// Whether a router chooses its experts within the top topk_group of n_group groups of them (a
// limit only where topk_group < n_group).
bool group_limited(const JsonReader& r) {
  return r.has("n_group") && r.positive_int("n_group") > 1 &&
         !(r.has("topk_group") && r.positive_int("topk_group") >= r.positive_int("n_group"));
}

// What a DeepSeek-style router does besides its gates: a bias added to the scores for the
// choice alone (e_score_correction_bias, zero at the start, moved by its load balancing outside
// the gradient: `selection_bias`), and the choice within groups of experts (`grouped`); and the
// multi-token prediction layers such a model trains beside its own (num_nextn_predict_layers).
// Each said not to be modelled.
void note_deepseek_routing(const JsonReader& r, ModelSpec& m, bool selection_bias, bool grouped) {
  if (selection_bias || grouped) {
    m.description += fmt::format(
        "; its router's {}{}{}{} not modelled: experts chosen by their {}scores alone",
        selection_bias ? "selection bias (e_score_correction_bias)" : "",
        selection_bias && grouped ? " and its " : "",
        grouped ? "choice within the top groups of experts (n_group, topk_group)" : "",
        selection_bias && grouped ? " are" : " is", m.moe->sigmoid_gates ? "sigmoid " : "");
  }
  if (selection_bias) {
    m.unmodelled.push_back(
        "its router's selection bias (e_score_correction_bias: experts chosen by their scores "
        "alone instead)");
  }
  if (grouped) m.unmodelled.push_back("its group-limited routing (n_group, topk_group)");
  if (r.has("num_nextn_predict_layers")) {
    if (const std::int64_t mtp = r.non_negative_int_up_to("num_nextn_predict_layers", kMaxLayers);
        mtp > 0) {
      m.description += fmt::format(
          "; its {} multi-token prediction layer{} (num_nextn_predict_layers) {} not modelled, "
          "as Hugging Face's model leaves {} out",
          mtp, mtp == 1 ? "" : "s", mtp == 1 ? "is" : "are", mtp == 1 ? "it" : "them");
      m.unmodelled.push_back(
          fmt::format("its {} multi-token prediction layer{}", mtp, mtp == 1 ? "" : "s"));
    }
  }
}

void read_glm4_moe(const JsonReader& r, KeyMap& names, ModelSpec& m) {
  // (The first Glm4MoeConfig named them num_experts.)
  read_routed_experts(r, names, m, {"n_routed_experts", "num_experts"});
  // (Glm4MoeConfig's defaults: one shared expert, the first block dense.)
  read_shared_experts(r, names, m, 1);
  const std::int64_t first_dense = r.has("first_k_dense_replace")
                                       ? r.non_negative_int_up_to("first_k_dense_replace", m.layers)
                                       : 1;
  read_dense_blocks(
      r, names, m, [&](std::int64_t l) { return l >= first_dense; }, "first_k_dense_replace",
      "intermediate_size");
  // Its gates: the chosen logits' sigmoids, over their sum (norm_topk_prob), times
  // routed_scaling_factor (Glm4MoeConfig's defaults: true, 1).
  m.moe->normalize_top_k = r.boolean_or("norm_topk_prob", true);
  m.moe->sigmoid_gates = true;
  if (r.has("routed_scaling_factor")) {
    m.moe->routed_scale = r.number_within("routed_scaling_factor", 1e-3, 1e3, "a factor");
  }
  note_deepseek_routing(r, m, /*selection_bias=*/true, group_limited(r));
  if (r.boolean_or("use_qk_norm", false)) {
    m.description +=
        "; its RMSNorm of each head's queries and keys (use_qk_norm: two weights of head_dim a "
        "block, an element-wise pass) is not modelled";
    m.unmodelled.push_back("its q_norm and k_norm (an RMSNorm of each head's queries and keys)");
  }
}

// A DeepSeek-V2 or V3 config's blocks (DeepSeek's modeling_deepseek.py, which trained them;
// Hugging Face's DeepseekV2/DeepseekV3 classes alike but where said; Kimi K2's kimi_k2 is
// V3's): multi-head latent attention (q_lora_rank, null where the queries come from the block's
// input: DeepSeek-V2-Lite;
// kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim; one key and value per head,
// whatever num_key_value_heads says); experts from block first_k_dense_replace on in every
// moe_layer_freq-th, n_routed_experts of moe_intermediate_size, the top num_experts_per_tok a
// token, beside n_shared_experts shared ones, dense MLPs of intermediate_size in the other
// blocks. Gates (scoring_func): V3's the chosen experts'
// sigmoids, over their sum (norm_topk_prob), times routed_scaling_factor; V2's their
// probabilities in the softmax over all experts, over their sum (norm_topk_prob) or else times
// routed_scaling_factor (Hugging Face's DeepseekV2Moe scales them always and reads no
// norm_topk_prob: no released V2 config tells the two apart).
void read_deepseek(const JsonReader& r, KeyMap& names, ModelSpec& m, bool v3) {
  m.mla.emplace();
  // (null: queries projected from the block's input; left out, it would be the class's default
  // of 1536, so it is required.)
  const json& raw = r.raw();
  if (!raw.contains("q_lora_rank")) {
    r.fail("q_lora_rank",
           "required field is missing (null where the queries come from the block's input)");
  }
  if (!raw.at("q_lora_rank").is_null()) {
    m.mla->q_lora_rank = hf_int(r, names, "mla.q_lora_rank", {"q_lora_rank"});
  }
  m.mla->kv_lora_rank = hf_int(r, names, "mla.kv_lora_rank", {"kv_lora_rank"});
  m.mla->qk_nope_head_dim = hf_int(r, names, "mla.qk_nope_head_dim", {"qk_nope_head_dim"});
  m.mla->qk_rope_head_dim = hf_int(r, names, "mla.qk_rope_head_dim", {"qk_rope_head_dim"});
  m.mla->v_head_dim = hf_int(r, names, "mla.v_head_dim", {"v_head_dim"});
  m.kv_heads = m.heads;
  names["kv_heads"] = names["heads"];
  if (r.has("num_key_value_heads") && r.positive_int("num_key_value_heads") != m.heads) {
    m.description += fmt::format(
        "; its num_key_value_heads ({}) is not read: latent attention gives each of its {} heads "
        "its own keys and values",
        r.positive_int("num_key_value_heads"), m.heads);
  }
  if (r.boolean_or("attention_bias", false)) {
    r.fail("attention_bias", "true: biases of latent attention's projections are not modelled");
  }
  // The experts: required, as the classes disagree where they are left out (DeepSeek's read
  // None, no experts or no shared ones; Hugging Face's DeepseekV2Config gives 64 and 2,
  // DeepseekV3Config 256 and 1). No released config is without experts: null routed experts
  // (DeepSeek's classes: every block a dense MLP) are refused, null shared ones read as none.
  for (const char* key : {"n_routed_experts", "n_shared_experts"}) {
    if (!raw.contains(key)) r.fail(key, "required field is missing");
  }
  if (raw.at("n_routed_experts").is_null()) {
    r.fail("n_routed_experts",
           "null: a model without experts is not imported (a dtsim model file with mla and no "
           "moe describes one)");
  }
  read_routed_experts(r, names, m, {"n_routed_experts"});
  read_shared_experts(r, names, m, 0);
  // (DeepseekV3Config's default: 3 dense blocks; DeepseekV2Config's none. A frequency of 1:
  // experts in every block after them.)
  const std::int64_t first_dense = r.has("first_k_dense_replace")
                                       ? r.non_negative_int_up_to("first_k_dense_replace", m.layers)
                                   : v3 ? 3
                                        : 0;
  const std::int64_t every = r.has("moe_layer_freq") ? r.positive_int("moe_layer_freq") : 1;
  read_dense_blocks(
      r, names, m, [&](std::int64_t l) { return l >= first_dense && l % every == 0; },
      every > 1 ? "moe_layer_freq" : "first_k_dense_replace", "intermediate_size");
  const std::string scoring = r.string_or("scoring_func", v3 ? "sigmoid" : "softmax");
  if (scoring != "sigmoid" && scoring != "softmax") {
    r.fail("scoring_func", fmt::format("\"{}\": expected \"sigmoid\" or \"softmax\"", scoring));
  }
  m.moe->sigmoid_gates = scoring == "sigmoid";
  m.moe->normalize_top_k = r.boolean_or("norm_topk_prob", v3);
  const double scale = r.has("routed_scaling_factor")
                           ? r.number_within("routed_scaling_factor", 1e-3, 1e3, "a factor")
                       : v3 ? 2.5
                            : 1.0;
  // (DeepSeek-V2's gate scales the probabilities only where it does not renormalize them.)
  const bool renormalized = m.moe->normalize_top_k && m.moe->top_k > 1;
  if (v3 || !renormalized) {
    m.moe->routed_scale = scale;
  } else if (scale != 1) {
    m.description += fmt::format(
        "; its routed_scaling_factor of {:g} is not applied: DeepSeek-V2's gate scales only the "
        "gates it does not renormalize (norm_topk_prob)",
        scale);
  }
  // V3's router chooses by score plus a bias of its own (topk_method noaux_tc; Hugging Face's
  // DeepseekV3TopkRouter always has it) within groups; V2's within groups where its topk_method
  // is group_limited_greedy.
  const std::string method = r.string_or("topk_method", v3 ? "noaux_tc" : "greedy");
  note_deepseek_routing(r, m, v3 || method == "noaux_tc",
                        group_limited(r) && (v3 || method != "greedy"));
}

// A Llama 4 language model's blocks (Hugging Face's Llama4TextDecoderLayer, Llama4TextMoe):
// experts of width intermediate_size, the top num_experts_per_tok of num_local_experts a
// token, beside a shared expert of the same width. Experts are in the blocks moe_layers names,
// by default one of every interleave_moe_layer_step (the last of each run: Scout's 1, every
// block; Maverick's 2, the odd ones), dense MLPs of intermediate_size_mlp in the others
// (Llama4TextConfig, Llama4TextDecoderLayer). What its attention does that dtsim does not (chunked
// attention, layers without RoPE, an L2 norm of queries and keys) and its router's sigmoid gates on
// the experts' inputs are said.
void read_llama4(const JsonReader& r, KeyMap& names, ModelSpec& m) {
  m.moe.emplace();
  m.moe->experts = hf_int(r, names, "moe.experts", {"num_local_experts"});
  m.moe->top_k = hf_int(r, names, "moe.top_k", {"num_experts_per_tok"});
  m.moe->expert_ffn_hidden = m.ffn_hidden;
  m.moe->shared_ffn_hidden = m.ffn_hidden;
  names["moe.expert_ffn_hidden"] = "intermediate_size";
  names["moe.shared_ffn_hidden"] = "intermediate_size";
  // (JsonReader::has takes a null, Hugging Face's default, for an absent key.)
  const std::int64_t step =
      r.has("interleave_moe_layer_step") ? r.positive_int("interleave_moe_layer_step") : 1;
  std::vector<std::int64_t> moe_layers;
  if (r.has("moe_layers")) {
    moe_layers = r.non_negative_int_array_up_to("moe_layers", m.layers - 1);
  } else {
    for (std::int64_t l = step - 1; l < m.layers; l += step) moe_layers.push_back(l);
  }
  read_dense_blocks(
      r, names, m,
      [&](std::int64_t l) {
        return std::find(moe_layers.begin(), moe_layers.end(), l) != moe_layers.end();
      },
      r.has("moe_layers") ? "moe_layers" : "interleave_moe_layer_step", "intermediate_size_mlp");
  if (!m.mixed_blocks() && r.has("intermediate_size_mlp")) {
    m.description += fmt::format(
        "; its intermediate_size_mlp ({}, the width of dense blocks' MLP) is not used: every "
        "block has experts, and a shared expert of intermediate_size",
        r.positive_int("intermediate_size_mlp"));
  }
  m.description +=
      "; its router's sigmoid gates, which scale each expert's input, are priced as Mixtral's "
      "softmax over the top k weighting their outputs (the same cost)";
  m.unmodelled.push_back(
      "its router's sigmoid gates on the experts' inputs (a softmax over the top k weighting "
      "their outputs instead, as Mixtral's)");
  // Llama4TextConfig's defaults: an L2 norm of queries and keys on the layers with RoPE, RoPE
  // left out of every fourth layer (no_rope_layers: 1 where a layer has it), attention within
  // chunks of 8192 tokens on the layers with RoPE.
  if (r.boolean_or("use_qk_norm", true)) {
    m.description +=
        "; its L2 norm of queries and keys on its layers with RoPE (use_qk_norm: no weights, "
        "an element-wise pass) is not modelled";
    m.unmodelled.push_back("its L2 norm of queries and keys (use_qk_norm)");
  }
  // (An empty or null no_rope_layers is Hugging Face's default, from no_rope_layer_interval:
  // Meta's Scout config has [].)
  std::int64_t without_rope = m.layers / 4;
  const nlohmann::json* given = r.has("no_rope_layers") ? &r.raw().at("no_rope_layers") : nullptr;
  if (given != nullptr && !given->is_null() && !(given->is_array() && given->empty())) {
    const nlohmann::json& flags = *given;
    const bool flag_list = flags.is_array() &&
                           static_cast<std::int64_t>(flags.size()) == m.layers &&
                           std::all_of(flags.begin(), flags.end(), [](const nlohmann::json& f) {
                             return f.is_number_integer() &&
                                    (f.get<std::int64_t>() == 0 || f.get<std::int64_t>() == 1);
                           });
    if (!flag_list) {
      r.fail("no_rope_layers",
             fmt::format("expected a 0 or 1 for each of the {} blocks (1: the block has RoPE)",
                         m.layers));
    }
    without_rope = std::count(flags.begin(), flags.end(), 0);
  } else if (r.has("no_rope_layer_interval")) {
    without_rope = m.layers / r.positive_int("no_rope_layer_interval");
  }
  if (without_rope > 0) {
    m.description += fmt::format(
        "; its {} block{} without rotary positions (no_rope_layers) are priced with RoPE, a "
        "small element-wise pass",
        without_rope, without_rope == 1 ? "" : "s");
    m.unmodelled.push_back(fmt::format("its {} block{} without RoPE (RoPE in every block instead)",
                                       without_rope, without_rope == 1 ? "" : "s"));
  }
  // Chunked attention on the blocks with RoPE (8192 tokens where not given; none where given as
  // null, as Hugging Face reads it).
  // (JsonReader::has takes a null for an absent key.)
  const json& raw = r.raw();
  const bool chunked =
      !raw.contains("attention_chunk_size") || !raw.at("attention_chunk_size").is_null();
  if (chunked && without_rope < m.layers) {
    const std::int64_t chunk =
        r.has("attention_chunk_size") ? r.positive_int("attention_chunk_size") : 8192;
    m.description += fmt::format(
        "; its chunked attention (attention_chunk_size {}: a query attends within its chunk, on "
        "its layers with RoPE) is not modelled (full causal attention, the same up to that "
        "length)",
        chunk);
    m.unmodelled_sliding_window = chunk;
    m.unmodelled_window_kind = "chunked attention (on its layers with RoPE)";
  }
  // Temperature tuning scales the queries of the blocks without RoPE from position floor_scale
  // on (8192 by default; positions counted from 1, p + 1 below from p counted from 0):
  // log(floor((p + 1) / floor_scale) + 1) x attn_scale + 1.
  // (On where not given; a null, false or 0 is off, as Hugging Face tests it.)
  const json* tuning =
      raw.contains("attn_temperature_tuning") ? &raw.at("attn_temperature_tuning") : nullptr;
  if (without_rope > 0 && (tuning == nullptr || (tuning->is_boolean() && tuning->get<bool>()) ||
                           (tuning->is_number() && tuning->get<double>() != 0))) {
    m.description +=
        "; its attention temperature tuning (attn_temperature_tuning: queries scaled on its "
        "blocks without RoPE from position floor_scale on) is not modelled";
    m.unmodelled.push_back(
        "its attention temperature tuning (queries of its blocks without RoPE scaled from "
        "position floor_scale on)");
  }
}

// Training sequence length assumed for imported configs: max_position_embeddings is what the
// model supports (131072 for Llama 3.1), rarely what one trains a step with.
constexpr std::int64_t kHfDefaultSeqLen = 4096;

}  // namespace

ModelSpec model_from_hf_config(const json& j, const std::string& file) {
  const JsonReader outer(j, file);
  const std::string outer_type = outer.string("model_type");
  static constexpr std::array<std::string_view, 17> kSupported = {
      "deepseek_v2", "deepseek_v3", "glm4_moe",    "gpt2",    "granite",  "kimi_k2",
      "llama",       "llama4",      "llama4_text", "mistral", "mixtral",  "olmo2",
      "phi3",        "qwen2",       "qwen2_moe",   "qwen3",   "qwen3_moe"};
  if (std::find(kSupported.begin(), kSupported.end(), outer_type) == kSupported.end()) {
    outer.fail("model_type",
               fmt::format("unsupported Hugging Face model_type \"{}\" (supported: {})", outer_type,
                           fmt::join(kSupported, ", ")));
  }
  // Llama 4's config (Llama4Config) nests its language model's under text_config, beside a
  // vision model's, which dtsim does not model; llama4_text is the language model's own.
  const std::string type = outer_type == "llama4_text" ? "llama4" : outer_type;
  const bool llama4 = type == "llama4";
  const JsonReader r = outer_type == "llama4" ? outer.object("text_config") : outer;
  // Qwen3's families: Qwen2's Hugging Face classes without the q/k/v biases, and with an
  // RMSNorm of each head's queries and keys (Qwen3Attention's q_norm, k_norm).
  const bool qwen3 = type == "qwen3" || type == "qwen3_moe";
  // Qwen's mixtures of experts (the blocks of qwen2 or qwen3 around experts).
  const bool qwen_moe = type == "qwen2_moe" || type == "qwen3_moe";
  // IBM's Granite: Llama's blocks (its Hugging Face class is Llama's with four scalars).
  const bool llama_like = type == "llama" || type == "granite";
  // GLM-4.5's and 4.6's mixtures of experts (Glm4MoeForCausalLM).
  const bool glm = type == "glm4_moe";
  // DeepSeek-V2's and V3's latent attention and experts (Kimi K2's config is V3's).
  const bool deepseek_v3 = type == "deepseek_v3" || type == "kimi_k2";
  const bool deepseek = deepseek_v3 || type == "deepseek_v2";
  ModelSpec m;
  m.file = file;
  // Without _name_or_path: a Hugging Face repository's folder (.../Meta-Llama-3-8B/config.json),
  // or a config saved under a name of its own (qwen-0.5b.json), that name.
  // (Its folder's name from the whole path: "./config.json" or "config.json" given in the
  // repository's folder.)
  std::error_code ec;
  std::filesystem::path path = std::filesystem::absolute(file, ec).lexically_normal();
  if (ec) path = std::filesystem::path(file);
  m.name = outer.has("_name_or_path") && !outer.string("_name_or_path").empty()
               ? outer.name("_name_or_path")
           : path.filename() == "config.json" ? path.parent_path().filename().string()
                                              : path.stem().string();
  // A _name_or_path that is a folder on the machine that saved it (/disks/.../model,
  // ./CodeLlama-7b-Instruct-hf), not a repository's name: its last part.
  if (m.name.starts_with("/") || m.name.starts_with("./") || m.name.starts_with("../") ||
      m.name.starts_with("~")) {
    std::filesystem::path folder(m.name);
    while (!folder.empty() && folder.filename().empty()) folder = folder.parent_path();
    if (!folder.filename().empty() && folder.filename() != "." && folder.filename() != "..") {
      m.name = folder.filename().string();
    }
  }
  if (m.name.empty()) m.name = type;
  m.source = fmt::format("Hugging Face config.json ({})", file);
  m.description = fmt::format("imported from a Hugging Face {} config", outer_type);
  if (outer.has("vision_config")) {
    m.description += "; its vision model (vision_config) is not modelled: the language model alone";
  }
  KeyMap names;
  // A dropout probability: from 0 to below 1.
  const auto probability = [&](const char* key) {
    const double p = r.non_negative_number(key);
    if (!(p < 1)) r.fail(key, fmt::format("expected a probability from 0 to below 1, got {:g}", p));
    return p;
  };
  if (type == "gpt2") {
    m.layers = hf_int(r, names, "layers", {"n_layer", "num_hidden_layers"});
    m.hidden = hf_int(r, names, "hidden", {"n_embd", "hidden_size"});
    m.heads = hf_int(r, names, "heads", {"n_head", "num_attention_heads"});
    m.kv_heads = m.heads;
    names["kv_heads"] = names["heads"];
    m.ffn_hidden = r.has("n_inner") ? hf_int(r, names, "ffn_hidden", {"n_inner"}) : 4 * m.hidden;
    if (!r.has("n_inner")) names["ffn_hidden"] = names["hidden"];
    m.vocab = hf_int(r, names, "vocab", {"vocab_size"});
    m.max_positions = hf_int(r, names, "max_positions", {"n_positions", "max_position_embeddings"});
    m.activation = Activation::Gelu;
    // GPT-2's MLP is modelled with GELU (its approximations cost alike); another activation
    // would be priced as GELU, so it is refused rather than misread.
    if (r.has("activation_function")) {
      const std::string act = r.string("activation_function");
      if (!act.starts_with("gelu") && act != "quick_gelu") {
        r.fail("activation_function",
               fmt::format("\"{}\": dtsim models gpt2's MLP with gelu (or one of its "
                           "approximations: gelu_new, gelu_fast, quick_gelu, ...) only",
                           act));
      }
    }
    m.norm = Norm::LayerNorm;
    m.positions = Positions::Learned;
    m.tied_embeddings = r.boolean_or("tie_word_embeddings", true);
    m.bias = BiasSpec{true, true, true, true};
    // Its dropout layers (embedding, attention probabilities, residuals: what dtsim's dropout
    // prices), from their probabilities, 0.1 each where not given (Hugging Face's GPT2Config):
    // on where any is above 0, off where all are 0. dtsim prices all three or none, so where
    // some are 0 and some not, all are priced, said in the description.
    std::vector<std::string> zero, nonzero;
    for (const char* key : {"embd_pdrop", "attn_pdrop", "resid_pdrop"}) {
      (r.has(key) && probability(key) == 0 ? zero : nonzero).emplace_back(key);
    }
    m.dropout = !nonzero.empty();
    if (m.dropout && !zero.empty()) {
      m.description += fmt::format(
          "; its {} {} 0 but its {} not: dtsim prices GPT-2's dropout layers all or none, all "
          "here",
          fmt::join(zero, " and "), zero.size() == 1 ? "is" : "are", fmt::join(nonzero, " and "));
      m.unmodelled_dropout = fmt::format("its {} of 0 (dropout in all three places instead)",
                                         fmt::join(zero, " and "));
    }
  } else {
    m.layers = hf_int(r, names, "layers", {"num_hidden_layers"});
    m.hidden = hf_int(r, names, "hidden", {"hidden_size"});
    m.heads = hf_int(r, names, "heads", {"num_attention_heads"});
    // Without num_key_value_heads, Hugging Face's default for the family: llama's and phi3's
    // is one key/value head per head (LlamaConfig: multi-head attention), mistral's and mixtral's
    // 8, qwen2's and qwen3's 32, qwen2_moe's 16, qwen3_moe's 4, llama4's and glm4_moe's 8 (their
    // configuration classes' defaults); said in the description (a misspelt key would read so too).
    const bool head_per_head = llama_like || type == "phi3" || type == "olmo2";
    if (deepseek) {
      // (read_deepseek: a key and value per head.)
    } else if (r.has("num_key_value_heads") || head_per_head) {
      m.kv_heads = hf_int(r, names, "kv_heads", {"num_key_value_heads", "num_attention_heads"},
                          /*aliases=*/false);
    } else {
      m.kv_heads = type == "qwen2" || type == "qwen3" ? 32
                   : type == "qwen2_moe"              ? 16
                   : type == "qwen3_moe"              ? 4
                                                      : 8;
      names["kv_heads"] = "num_key_value_heads";
      if (m.heads % m.kv_heads != 0) {
        r.fail("num_key_value_heads",
               fmt::format("not given, and {}'s default of {} key/value heads does not divide "
                           "num_attention_heads = {}: give it",
                           type, m.kv_heads, m.heads));
      }
    }
    if (!r.has("num_key_value_heads") && !deepseek) {
      m.description +=
          head_per_head ? fmt::format(
                              "; no num_key_value_heads: one key/value head per head (multi-head "
                              "attention), as Hugging Face's {} defaults it",
                              type == "llama"     ? "LlamaConfig"
                              : type == "granite" ? "GraniteConfig"
                              : type == "olmo2"   ? "Olmo2Config"
                                                  : "Phi3Config")
                        : fmt::format("; no num_key_value_heads: {}, Hugging Face's default for {}",
                                      m.kv_heads, type);
    }
    // (qwen2_moe, qwen3_moe and glm4_moe: their experts' width, moe_intermediate_size, below.)
    // (deepseek's where every block is dense, read_deepseek.)
    if (!qwen_moe && !glm && !deepseek) {
      m.ffn_hidden = hf_int(r, names, "ffn_hidden", {"intermediate_size"});
    }
    m.vocab = hf_int(r, names, "vocab", {"vocab_size"});
    m.max_positions = hf_int(r, names, "max_positions", {"max_position_embeddings"});
    m.activation = Activation::SwiGlu;
    // The gated MLP is modelled with SiLU (SwiGLU), what these families use; another
    // activation (a GeGLU) would be priced as SwiGLU, so it is refused rather than misread.
    if (r.has("hidden_act") && r.string("hidden_act") != "silu") {
      r.fail("hidden_act",
             fmt::format("\"{}\": dtsim models {}'s gated MLP with silu (SwiGLU) only",
                         r.string("hidden_act"), type));
    }
    // Sliding-window attention is not modelled: full causal attention, the same as long as the
    // sequence is within the window; said in the description (dtsim describe prints it).
    // (Llama's attention has no window: its configs' sliding_window, where present, is unread;
    // Qwen2's and Qwen3's use it only with use_sliding_window, false by default in Hugging
    // Face's.)
    // (Llama 4's chunked attention, read_llama4.)
    const json& raw = r.raw();
    const bool windowless = llama_like || llama4;
    if (!windowless && raw.contains("sliding_window") && !raw.at("sliding_window").is_null() &&
        !raw.at("sliding_window").is_number_integer()) {
      r.fail("sliding_window", "expected a number of tokens (an integer) or null");
    }
    if (!windowless && raw.contains("sliding_window") &&
        raw.at("sliding_window").is_number_integer() &&
        r.boolean_or("use_sliding_window", type != "qwen2" && type != "qwen2_moe" && !qwen3)) {
      // (A window said in the description is a positive one: -4, or 2^64 - 1 read as -1, is
      // no number of tokens.)
      const std::int64_t window = r.positive_int("sliding_window");
      m.description += fmt::format(
          "; its sliding_window of {} tokens is not modelled (full causal attention, the same "
          "up to that length)",
          window);
      m.unmodelled_sliding_window = window;
    } else if (type == "mistral" && !raw.contains("sliding_window")) {
      // (MistralConfig's default window, where the key is left out: 4096.)
      m.description +=
          "; no sliding_window: Hugging Face's default for mistral, 4096 tokens, which is not "
          "modelled (full causal attention, the same up to that length)";
      m.unmodelled_sliding_window = 4096;
    }
    m.norm = Norm::RmsNorm;
    m.positions = Positions::Rope;
    if (r.has("rope_theta")) m.rope_theta = r.positive_number("rope_theta");
    // RoPE scaling (llama3, yarn, linear, dynamic) changes the rotary frequencies, not what
    // computing them costs: nothing to model, said so.
    // (rope_parameters: newer transformers' name for it.)
    for (const char* key : {"rope_scaling", "rope_parameters"}) {
      if (!r.has(key)) continue;
      const JsonReader scaling = r.object(key);
      const std::string kind = scaling.has("rope_type") ? scaling.string("rope_type")
                                                        : scaling.string_or("type", "unnamed");
      if (kind == "default") continue;  // (rope_parameters holds the plain rope_theta too)
      m.description += fmt::format(
          "; its {} ({}) changes RoPE's frequencies, not its cost: not modelled", key, kind);
      m.unmodelled.push_back(fmt::format("its {} ({}: plain RoPE frequencies instead)", key, kind));
    }
    // (Glm4MoeConfig's default: 0.5.)
    const double rotary = r.has("partial_rotary_factor")
                              ? r.positive_number("partial_rotary_factor")
                          : glm ? 0.5
                                : 1.0;
    if (rotary != 1) {
      m.description += fmt::format(
          "; its partial_rotary_factor of {:g}{} (RoPE on part of each head) is not modelled: "
          "priced as RoPE on the whole head, a small element-wise pass",
          rotary, r.has("partial_rotary_factor") ? "" : fmt::format(" ({}'s default)", type));
      m.unmodelled.push_back(
          fmt::format("its partial_rotary_factor of {:g} (RoPE on whole heads instead)", rotary));
    }
    // (A composite config, Llama 4's, has it at its top level.)
    if (r.has("quantization_config") || outer.has("quantization_config")) {
      m.description +=
          "; its quantization_config (quantized weights) is not modelled: trained in the "
          "plan's precision";
      m.unmodelled.push_back("its quantization_config (weights in the plan's precision instead)");
    }
    m.tied_embeddings = r.boolean_or("tie_word_embeddings", false);
    // Biases as Hugging Face's classes build them: llama reads attention_bias (q, k, v and o)
    // and mlp_bias; qwen3 and qwen3_moe read attention_bias (Qwen3Attention) and have none in
    // the MLP; qwen2 always has q/k/v biases and none on o_proj or the MLP (Qwen2Attention,
    // Qwen2MLP), mistral, mixtral and phi3 none; what those classes do not read is said.
    const bool attention_bias = r.boolean_or("attention_bias", false);
    const bool mlp_bias = r.boolean_or("mlp_bias", false);
    // (deepseek: refused where true, read_deepseek.)
    const bool reads_attention_bias =
        llama_like || qwen3 || type == "olmo2" || llama4 || glm || deepseek;
    const bool reads_mlp_bias = llama_like;
    const bool qwen2_like = type == "qwen2" || type == "qwen2_moe";
    m.bias.qkv = qwen2_like || (reads_attention_bias && attention_bias);
    // (glm4_moe: q, k and v biases where attention_bias says so, none on o_proj: Glm4MoeAttention.)
    m.bias.attn_out = reads_attention_bias && attention_bias && !glm;
    m.bias.mlp = reads_mlp_bias && mlp_bias;
    const bool unread_attention = attention_bias && !reads_attention_bias;
    const bool unread_mlp = mlp_bias && !reads_mlp_bias;
    if (unread_attention || unread_mlp) {
      m.description +=
          fmt::format("; its {} not read: Hugging Face's {} model has {}",
                      unread_attention && unread_mlp ? "attention_bias and mlp_bias are"
                      : unread_attention             ? "attention_bias is"
                                                     : "mlp_bias is",
                      type,
                      qwen2_like                                  ? "biases on q, k and v only"
                      : qwen3 || type == "olmo2" || llama4 || glm ? "no biases in its MLP"
                                                                  : "no biases");
    }
    if (qwen3) {
      m.description +=
          "; its RMSNorm of each head's queries and keys (q_norm and k_norm: two weights of "
          "head_dim a block, an element-wise pass) is not modelled";
      m.unmodelled.push_back("its q_norm and k_norm (an RMSNorm of each head's queries and keys)");
    }
    // Their attention-probability dropout (0 in every published config of these families):
    // dtsim's dropout prices GPT-2's layers, embedding and residuals too, so it is left out,
    // said in the description.
    if (const double p = r.has("attention_dropout") ? probability("attention_dropout") : 0; p > 0) {
      m.description += fmt::format(
          "; its attention_dropout of {:g} is not modelled (priced without dropout: a dtsim model "
          "file's \"dropout\": true prices GPT-2's embedding, attention and residual dropout)",
          p);
      m.unmodelled.push_back(fmt::format("its attention_dropout of {:g}", p));
    }
    // OLMo 2's blocks (Olmo2DecoderLayer): its two RMSNorms come after attention and the MLP,
    // on their outputs before the residual adds (dtsim's and dtexec's before them, on their
    // inputs: the same count and cost), and an RMSNorm of all heads' queries and of all keys,
    // whole projections wide, which at tp > 1 also needs their sums of squares across ranks.
    if (type == "olmo2") {
      m.description +=
          "; its RMSNorms after attention and the MLP (post-norm) are priced as Llama's before "
          "them, and its q_norm and k_norm over the whole projections (a reduction across tp "
          "ranks too) are not modelled";
      m.unmodelled.push_back(
          "its RMSNorms after attention and the MLP (before them instead, as Llama's)");
      m.unmodelled.push_back(
          "its q_norm and k_norm (an RMSNorm of all heads' queries and of all keys)");
    }
    // Granite's scalars (GraniteConfig): an embedding multiplier, a residual one and the
    // logits' divisor, each an element-wise product dtsim does not price and dtexec trains
    // without (1: none); its attention scale, below.
    if (type == "granite") {
      for (const char* key : {"embedding_multiplier", "residual_multiplier", "logits_scaling"}) {
        if (!r.has(key)) continue;
        if (const double v = r.positive_number(key); v != 1) {
          m.description +=
              fmt::format("; its {} of {:g} is not modelled (a scalar product)", key, v);
          m.unmodelled.push_back(fmt::format("its {} of {:g}", key, v));
        }
      }
    }
    // Phi-3's residual and embedding dropout (0 in its published configs), as attention's.
    if (type == "phi3") {
      for (const char* key : {"resid_pdrop", "embd_pdrop"}) {
        if (!r.has(key)) continue;
        if (const double p = probability(key); p > 0) {
          m.description +=
              fmt::format("; its {} of {:g} is not modelled (priced without dropout)", key, p);
          m.unmodelled.push_back(fmt::format("its {} of {:g}", key, p));
        }
      }
    }
    // Hugging Face's llama, mistral, phi3, qwen2 and qwen3 classes have no experts, whatever
    // the config says.
    if (type != "mixtral" && !qwen_moe && !llama4 && !glm && !deepseek &&
        (r.has("num_local_experts") || r.has("num_experts_per_tok"))) {
      m.description += fmt::format(
          "; its {} not read: Hugging Face's {} model has no experts (model_type mixtral, "
          "qwen2_moe, qwen3_moe, llama4, glm4_moe, deepseek_v2 and deepseek_v3 have)",
          r.has("num_local_experts") ? "num_local_experts is" : "num_experts_per_tok is", type);
    }
    if (type == "mixtral") {
      m.moe.emplace();
      m.moe->experts = hf_int(r, names, "moe.experts", {"num_local_experts"});
      m.moe->top_k = hf_int(r, names, "moe.top_k", {"num_experts_per_tok"});
      m.moe->expert_ffn_hidden = m.ffn_hidden;
      names["moe.expert_ffn_hidden"] = "intermediate_size";
    }
    if (qwen_moe) read_qwen_moe(r, names, m, type);
    if (llama4) read_llama4(r, names, m);
    if (glm) read_glm4_moe(r, names, m);
    if (deepseek) read_deepseek(r, names, m, deepseek_v3);
  }
  if (deepseek) {
    // A head's query and key, without positions and with RoPE (Hugging Face's DeepseekV3Config
    // saves head_dim as the RoPE part's width: not this).
    m.head_dim = m.mla->qk_nope_head_dim + m.mla->qk_rope_head_dim;
  } else if (r.has("head_dim")) {
    m.head_dim = hf_int(r, names, "head_dim", {"head_dim"});
  } else if (type == "qwen3" || llama4) {
    // Qwen3Config's and Llama4TextConfig's default (Qwen3-8B's 4096 / 32 heads, not
    // hidden_size / heads elsewhere).
    m.head_dim = 128;
    names["head_dim"] = "head_dim";
    m.description += fmt::format("; no head_dim: 128, Hugging Face's default for {}", type);
  } else {
    if (m.hidden % m.heads != 0) {
      r.fail(names["heads"],
             fmt::format("hidden size {} is not divisible by {} heads", m.hidden, m.heads));
    }
    m.head_dim = m.hidden / m.heads;
  }
  if (type == "granite") {
    // Granite's attention scores are scaled by attention_multiplier (GraniteAttention's
    // scaling; 1 where not given), Llama's and dtexec's by 1/sqrt(head_dim).
    const double scale =
        r.has("attention_multiplier") ? r.positive_number("attention_multiplier") : 1.0;
    const double llama = 1 / std::sqrt(static_cast<double>(m.head_dim));
    if (std::abs(scale - llama) > 1e-9 * llama) {
      m.description += fmt::format(
          "; its attention_multiplier of {:g} is not modelled (scores scaled by 1/sqrt(head_dim) "
          "= {:g})",
          scale, llama);
      m.unmodelled.push_back(fmt::format(
          "its attention_multiplier of {:g} (scores scaled by 1/sqrt(head_dim) instead)", scale));
    }
  }
  m.seq_len = std::min(m.max_positions, kHfDefaultSeqLen);
  names["seq_len"] = names["max_positions"];  // the default derives from it
  // Fields inside Llama 4's text_config named with its path, as the reader's own messages.
  if (outer_type == "llama4") {
    for (auto& [field, key] : names) key = "text_config." + key;
  }
  validate_model(m, names);
  return m;
}

json architecture_json(const ModelSpec& m) {
  json a = {{"layers", m.layers},
            {"hidden", m.hidden},
            {"heads", m.heads},
            {"kv_heads", m.kv_heads},
            {"head_dim", m.head_dim},
            {"ffn_hidden", m.ffn_hidden},
            {"vocab", m.vocab},
            {"max_positions", m.max_positions},
            {"activation", to_string(m.activation)},
            {"norm", to_string(m.norm)},
            {"positions", to_string(m.positions)},
            {"rope_theta", m.rope_theta},
            {"tied_embeddings", m.tied_embeddings},
            {"dropout", m.dropout},
            {"bias",
             {{"qkv", m.bias.qkv},
              {"attn_out", m.bias.attn_out},
              {"mlp", m.bias.mlp},
              {"norm", m.bias.norm}}},
            {"moe", nullptr}};
  if (m.moe) {
    a["moe"] = {{"experts", m.moe->experts},
                {"top_k", m.moe->top_k},
                {"expert_ffn_hidden", m.moe->expert_ffn_hidden}};
    // (Only where there are shared experts, gates over all experts, dense blocks: checkpoints
    // written before they were modelled record none.)
    if (m.moe->shared_ffn_hidden > 0) a["moe"]["shared_ffn_hidden"] = m.moe->shared_ffn_hidden;
    if (!m.moe->normalize_top_k) a["moe"]["normalize_top_k"] = false;
    if (m.moe->sigmoid_gates) a["moe"]["scores"] = "sigmoid";
    if (m.moe->routed_scale != 1.0) a["moe"]["routed_scaling_factor"] = m.moe->routed_scale;
    if (!m.moe->dense_blocks.empty()) {
      a["moe"]["dense_blocks"] = m.moe->dense_blocks;
      a["moe"]["dense_ffn_hidden"] = m.moe->dense_ffn_hidden;
    }
  }
  if (m.mla) {
    a["mla"] = {{"q_lora_rank", m.mla->q_lora_rank},
                {"kv_lora_rank", m.mla->kv_lora_rank},
                {"qk_nope_head_dim", m.mla->qk_nope_head_dim},
                {"qk_rope_head_dim", m.mla->qk_rope_head_dim},
                {"v_head_dim", m.mla->v_head_dim}};
  }
  return a;
}

ModelSpec load_model(std::string_view name_or_path) {
  const auto path = resolve_data_file("model", "models", name_or_path);
  const json j = JsonReader::parse_file(path);
  // A Hugging Face config.json (its model_type; without it, its architectures, which dtsim's
  // own format has not, so that the message names the missing model_type).
  if (j.is_object() && (j.contains("model_type") || j.contains("architectures"))) {
    return model_from_hf_config(j, path.string());
  }
  return model_from_json(j, path.string());
}

}  // namespace dtsim::model
