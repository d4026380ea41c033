#include "sim/model/model_spec.hpp"

#include <fmt/format.h>

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

bool ModelSpec::is_megatron_gpt() const {
  return activation == Activation::Gelu && !moe && kv_heads == heads &&
         head_dim * heads == hidden && ffn_hidden == 4 * hidden;
}

ModelSpec model_from_json(const json& j, const std::string& file) {
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
                 "tied_embeddings",
                 "bias",
                 "dropout",
                 "moe",
                 "published_params",
                 "published_params_precision",
                 "published_params_source"});
  ModelSpec m;
  m.file = file;
  m.name = r.string("name");
  m.description = r.string_or("description", "");
  m.source = r.string("source");
  m.layers = r.positive_int("layers");
  m.hidden = r.positive_int("hidden");
  m.heads = r.positive_int("heads");
  m.kv_heads = r.positive_int_or("kv_heads", m.heads);
  if (r.has("head_dim")) {
    m.head_dim = r.positive_int("head_dim");
  } else {
    if (m.hidden % m.heads != 0) {
      r.fail("heads", fmt::format("hidden = {} is not divisible by heads = {} (give head_dim "
                                  "if the model's head width differs)",
                                  m.hidden, m.heads));
    }
    m.head_dim = m.hidden / m.heads;
  }
  m.ffn_hidden = r.positive_int("ffn_hidden");
  m.vocab = r.positive_int("vocab");
  m.max_positions = r.positive_int("max_positions");
  m.seq_len = r.positive_int_or("seq_len", m.max_positions);
  m.activation =
      r.choice("activation", {"gelu", "swiglu"}) == "gelu" ? Activation::Gelu : Activation::SwiGlu;
  m.norm =
      r.choice("norm", {"layernorm", "rmsnorm"}) == "layernorm" ? Norm::LayerNorm : Norm::RmsNorm;
  m.positions = r.choice("positions", {"learned", "rope"}) == "learned" ? Positions::Learned
                                                                        : Positions::Rope;
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
  if (r.has("moe")) {
    const JsonReader e = r.object("moe");
    e.expect_only({"experts", "top_k", "expert_ffn_hidden"});
    m.moe = MoeSpec{e.positive_int("experts"), e.positive_int("top_k"),
                    e.positive_int("expert_ffn_hidden")};
  }
  if (r.has("published_params")) {
    m.published_params = static_cast<std::uint64_t>(r.positive_int("published_params"));
    m.published_params_precision =
        static_cast<std::uint64_t>(r.positive_int_or("published_params_precision", 1));
    m.published_params_source = r.string("published_params_source");
  }
  validate_model(m);
  return m;
}

void validate_model(const ModelSpec& m) {
  auto bad = [&](std::string_view field, const std::string& msg) {
    throw InputError(fmt::format("{}: {}: {}", m.file, field, msg));
  };
  if (m.heads % m.kv_heads != 0) {
    bad("kv_heads", fmt::format("kv_heads = {} must divide heads = {}", m.kv_heads, m.heads));
  }
  if (m.seq_len > m.max_positions) {
    bad("seq_len",
        fmt::format("seq_len = {} exceeds max_positions = {}", m.seq_len, m.max_positions));
  }
  if (m.moe) {
    if (m.moe->top_k > m.moe->experts) {
      bad("moe.top_k",
          fmt::format("top_k = {} exceeds experts = {}", m.moe->top_k, m.moe->experts));
    }
  }
}

namespace {

// First present key among `keys` as a positive integer.
std::int64_t hf_int(const JsonReader& r, std::initializer_list<std::string_view> keys) {
  for (std::string_view k : keys) {
    if (r.has(k)) return r.positive_int(k);
  }
  r.fail(*keys.begin(), "required field is missing");
}

}  // namespace

ModelSpec model_from_hf_config(const json& j, const std::string& file) {
  const JsonReader r(j, file);
  const std::string type = r.string("model_type");
  static constexpr std::string_view kSupported = "gpt2, llama, mistral, mixtral, qwen2";
  if (type != "gpt2" && type != "llama" && type != "mistral" && type != "mixtral" &&
      type != "qwen2") {
    r.fail("model_type", fmt::format("unsupported Hugging Face model_type \"{}\" (supported: {})",
                                     type, kSupported));
  }
  ModelSpec m;
  m.file = file;
  m.name =
      r.string_or("_name_or_path", std::filesystem::path(file).parent_path().filename().string());
  if (m.name.empty()) m.name = type;
  m.source = fmt::format("Hugging Face config.json ({})", file);
  m.description = fmt::format("imported from a Hugging Face {} config", type);
  if (type == "gpt2") {
    m.layers = hf_int(r, {"n_layer", "num_hidden_layers"});
    m.hidden = hf_int(r, {"n_embd", "hidden_size"});
    m.heads = hf_int(r, {"n_head", "num_attention_heads"});
    m.kv_heads = m.heads;
    m.ffn_hidden = r.has("n_inner") ? r.positive_int("n_inner") : 4 * m.hidden;
    m.vocab = r.positive_int("vocab_size");
    m.max_positions = hf_int(r, {"n_positions", "max_position_embeddings"});
    m.activation = Activation::Gelu;
    m.norm = Norm::LayerNorm;
    m.positions = Positions::Learned;
    m.tied_embeddings = r.boolean_or("tie_word_embeddings", true);
    m.bias = BiasSpec{true, true, true, true};
    m.dropout = true;
  } else {
    m.layers = r.positive_int("num_hidden_layers");
    m.hidden = r.positive_int("hidden_size");
    m.heads = r.positive_int("num_attention_heads");
    m.kv_heads = r.positive_int_or("num_key_value_heads", m.heads);
    m.ffn_hidden = r.positive_int("intermediate_size");
    m.vocab = r.positive_int("vocab_size");
    m.max_positions = r.positive_int("max_position_embeddings");
    m.activation = Activation::SwiGlu;
    m.norm = Norm::RmsNorm;
    m.positions = Positions::Rope;
    m.tied_embeddings = r.boolean_or("tie_word_embeddings", false);
    // qwen2 always has q/k/v biases (Qwen2Attention: bias=True on q,k,v; False on o_proj).
    const bool attention_bias = r.boolean_or("attention_bias", false);
    m.bias.qkv = type == "qwen2" || attention_bias;
    m.bias.attn_out = attention_bias;
    m.bias.mlp = r.boolean_or("mlp_bias", false);
    if (type == "mixtral") {
      m.moe = MoeSpec{r.positive_int("num_local_experts"), r.positive_int("num_experts_per_tok"),
                      m.ffn_hidden};
    }
  }
  if (r.has("head_dim")) {
    m.head_dim = r.positive_int("head_dim");
  } else {
    if (m.hidden % m.heads != 0) {
      r.fail("num_attention_heads",
             fmt::format("hidden size {} is not divisible by {} heads", m.hidden, m.heads));
    }
    m.head_dim = m.hidden / m.heads;
  }
  m.seq_len = m.max_positions;
  validate_model(m);
  return m;
}

ModelSpec load_model(std::string_view name_or_path) {
  const auto path = resolve_data_file("model", "models", name_or_path);
  const json j = JsonReader::parse_file(path);
  if (j.is_object() && j.contains("model_type")) return model_from_hf_config(j, path.string());
  return model_from_json(j, path.string());
}

}  // namespace dtsim::model
