#include "sim/model/model_spec.hpp"

#include <nlohmann/json.hpp>

#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"
#include "sim/model/model_graph.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::model::architecture_json;
using dtsim::model::count_params;
using dtsim::model::load_model;
using dtsim::test::TempFile;

// Every shipped model with a published parameter count reproduces it exactly (or, where the
// publication rounds, e.g. "1.7B", to the publication's precision).
TEST_CASE("shipped models match their published parameter counts", "[model]") {
  for (const std::string& name : dtsim::list_data_names("models")) {
    DYNAMIC_SECTION(name) {
      const auto spec = load_model(name);
      CHECK(spec.name == name);
      if (spec.published_params) {
        INFO("computed " << count_params(spec) << ", published " << *spec.published_params);
        CHECK(dtsim::model::matches_published_params(spec, count_params(spec)));
      }
    }
  }
}

TEST_CASE("exact parameter counts of well-known models", "[model]") {
  // Published totals (Hugging Face safetensors metadata; Radford et al. 2019 for GPT-2).
  CHECK(count_params(load_model("gpt2-124m")) == 124439808ULL);
  CHECK(count_params(load_model("llama2-7b")) == 6738415616ULL);
  CHECK(count_params(load_model("llama2-13b")) == 13015864320ULL);
  CHECK(count_params(load_model("llama2-70b")) == 68976648192ULL);
  CHECK(count_params(load_model("llama3-8b")) == 8030261248ULL);
  CHECK(count_params(load_model("llama3-70b")) == 70553706496ULL);
  CHECK(count_params(load_model("llama3-405b")) == 405853388800ULL);
  CHECK(count_params(load_model("mixtral-8x7b")) == 46702792704ULL);
  CHECK(count_params(load_model("mistral-7b")) == 7241732096ULL);
  CHECK(count_params(load_model("qwen2-7b")) == 7615616512ULL);
}

TEST_CASE("Megatron family: paper's formula and ours round to the published size", "[model]") {
  // Narayanan et al. 2021 §5.1: P = 12·l·h²·(1 + 13/(12h) + (V+s)/(12·l·h)). dtsim also counts
  // the final LayerNorm (2h), which the formula omits.
  for (const char* name : {"megatron-1.7b", "megatron-18.4b", "megatron-1t"}) {
    const auto m = load_model(name);
    const double l = static_cast<double>(m.layers), h = static_cast<double>(m.hidden);
    const double paper =
        12 * l * h * h *
        (1 + 13 / (12 * h) + static_cast<double>(m.vocab + m.max_positions) / (12 * l * h));
    CHECK(static_cast<double>(count_params(m)) == Approx(paper + 2 * h).epsilon(1e-12));
  }
}

TEST_CASE("Hugging Face config.json files are read directly", "[model][hf]") {
  SECTION("llama") {
    TempFile f("config.json", R"({"model_type": "llama", "hidden_size": 4096,
      "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
      "tie_word_embeddings": false})");
    CHECK(count_params(load_model(f.path())) == 6738415616ULL);
  }
  SECTION("mixtral") {
    TempFile f("config.json", R"({"model_type": "mixtral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
      "num_local_experts": 8, "num_experts_per_tok": 2})");
    const auto m = load_model(f.path());
    REQUIRE(m.moe);
    CHECK(m.moe->experts == 8);
    CHECK(count_params(m) == 46702792704ULL);
  }
  SECTION("named by _name_or_path, a repository's folder, or the file's own name") {
    const std::string fields = R"("model_type": "mistral", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64)";
    TempFile repo("config.json", "{" + fields + "}");
    const std::string folder = std::filesystem::path(repo.path()).parent_path().filename().string();
    CHECK(load_model(repo.path()).name == folder);
    {
      // Given from inside the folder: its name still (it named the model "." and "mistral").
      const auto here = std::filesystem::current_path();
      std::filesystem::current_path(std::filesystem::path(repo.path()).parent_path());
      const std::string plain = load_model("config.json").name;
      const std::string dotted = load_model("./config.json").name;
      std::filesystem::current_path(here);
      CHECK(plain == folder);
      CHECK(dotted == folder);
    }
    TempFile own("mistral-tiny.json", "{" + fields + "}");
    CHECK(load_model(own.path()).name == "mistral-tiny");
    TempFile named("config.json", "{" + fields + R"(, "_name_or_path": "org/Tiny")" + "}");
    CHECK(load_model(named.path()).name == "org/Tiny");
  }
  SECTION("mistral") {
    TempFile f("config.json", R"({"model_type": "mistral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768})");
    CHECK(count_params(load_model(f.path())) == 7241732096ULL);
  }
  SECTION("qwen2 has QKV biases") {
    TempFile f("config.json", R"({"model_type": "qwen2", "hidden_size": 3584,
      "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
      "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
      "tie_word_embeddings": false})");
    const auto m = load_model(f.path());
    CHECK(m.bias.qkv);
    CHECK_FALSE(m.bias.attn_out);
    CHECK(count_params(m) == 7615616512ULL);
  }
  SECTION("granite: Llama's blocks, its four scalars said not modelled") {
    // ibm-granite/granite-3.1-8b-base's config.json (8.17B).
    TempFile f("config.json", R"({"model_type": "granite", "hidden_size": 4096,
      "intermediate_size": 12800, "num_attention_heads": 32, "num_key_value_heads": 8,
      "num_hidden_layers": 40, "vocab_size": 49155, "max_position_embeddings": 131072,
      "tie_word_embeddings": true, "attention_bias": false, "mlp_bias": false,
      "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
      "attention_multiplier": 0.0078125, "logits_scaling": 16.0})");
    const auto m = load_model(f.path());
    CHECK(count_params(m) == 8170848256ULL);
    REQUIRE(m.unmodelled.size() == 4);
    CHECK(m.unmodelled[0] == "its embedding_multiplier of 12");
    CHECK(m.unmodelled[3] ==
          "its attention_multiplier of 0.0078125 (scores scaled by 1/sqrt(head_dim) instead)");
    // Biases read as Llama's; a multiplier of 1 is Llama's own, and an attention scale of
    // 1/sqrt(head_dim) (1/4 at 16) too; none given is 1, which is not.
    TempFile biased("config.json", R"({"model_type": "granite", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "vocab_size": 256, "max_position_embeddings": 64, "attention_bias": true,
      "mlp_bias": true, "residual_multiplier": 1.0, "attention_multiplier": 0.25})");
    const auto b = load_model(biased.path());
    CHECK(b.bias.qkv);
    CHECK(b.bias.mlp);
    CHECK(b.kv_heads == 4);
    CHECK(b.unmodelled.empty());
    TempFile unscaled("config.json", R"({"model_type": "granite", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "vocab_size": 256, "max_position_embeddings": 64})");
    REQUIRE(load_model(unscaled.path()).unmodelled.size() == 1);
    CHECK(load_model(unscaled.path()).unmodelled[0].starts_with("its attention_multiplier of 1 "));
  }
  SECTION("olmo2: Llama's blocks, its post-norms and whole-width q/k norms said") {
    // allenai/OLMo-2-1124-7B's config.json (7.3B with its q/k norms' 262,144).
    TempFile f("config.json", R"({"model_type": "olmo2", "hidden_size": 4096,
      "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
      "vocab_size": 100352, "max_position_embeddings": 4096, "rope_theta": 500000,
      "attention_bias": false, "tie_word_embeddings": false})");
    const auto m = load_model(f.path());
    CHECK(m.kv_heads == 32);
    CHECK(count_params(m) + 32 * 2 * 4096 == 7298617344ULL);
    REQUIRE(m.unmodelled.size() == 2);
    CHECK(m.unmodelled[0].starts_with("its RMSNorms after attention and the MLP"));
  }
  SECTION("phi3: Phi-3 mini and Phi-4, one key/value head per head by default") {
    // microsoft/Phi-3-mini-4k-instruct's config.json (3.8B), its window said not modelled.
    TempFile mini("config.json", R"({"model_type": "phi3", "hidden_size": 3072,
      "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 32,
      "vocab_size": 32064, "max_position_embeddings": 4096, "sliding_window": 2047,
      "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
      "tie_word_embeddings": false})");
    const auto m = load_model(mini.path());
    CHECK(m.kv_heads == 32);
    CHECK(m.description.find("as Hugging Face's Phi3Config defaults it") != std::string::npos);
    CHECK(m.unmodelled_sliding_window == 2047);
    CHECK(m.unmodelled.empty());
    CHECK_FALSE(m.bias.qkv);
    CHECK(count_params(m) == 3821079552ULL);
    // microsoft/phi-4's (14.7B): grouped-query attention, a 100k vocabulary.
    TempFile phi4("config.json", R"({"model_type": "phi3", "hidden_size": 5120,
      "intermediate_size": 17920, "num_attention_heads": 40, "num_key_value_heads": 10,
      "num_hidden_layers": 40, "vocab_size": 100352, "max_position_embeddings": 16384,
      "tie_word_embeddings": false, "resid_pdrop": 0.1})");
    const auto p4 = load_model(phi4.path());
    CHECK(count_params(p4) == 14659507200ULL);
    REQUIRE(p4.unmodelled.size() == 1);
    CHECK(p4.unmodelled[0] == "its resid_pdrop of 0.1");
  }
  SECTION("qwen3: no biases but attention_bias's, head_dim 128 by default") {
    // Qwen/Qwen3-8B's config.json, less its head_dim (128, Qwen3Config's default too).
    const std::string fields = R"("model_type": "qwen3", "hidden_size": 4096,
      "intermediate_size": 12288, "num_attention_heads": 32, "num_hidden_layers": 36,
      "num_key_value_heads": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
      "tie_word_embeddings": false, "use_sliding_window": false, "sliding_window": null)";
    TempFile f("config.json", "{" + fields + "}");
    const auto m = load_model(f.path());
    CHECK(m.head_dim == 128);
    CHECK_FALSE(m.bias.qkv);
    CHECK(m.description.find("no head_dim: 128") != std::string::npos);
    CHECK(m.description.find("q_norm and k_norm") != std::string::npos);
    // What dtexec then trains without, a phrase each.
    REQUIRE(m.unmodelled.size() == 1);
    CHECK(m.unmodelled[0].find("q_norm and k_norm") != std::string::npos);
    CHECK(load_model("qwen3-8b").unmodelled == m.unmodelled);  // (a model file's "unmodelled")
    // The shipped model, whose published 8.2B it matches (less the q/k norms' 9,216).
    CHECK(count_params(m) == count_params(load_model("qwen3-8b")));
    CHECK(count_params(m) == 8190726144ULL);
    TempFile biased("config.json", "{" + fields + R"(, "attention_bias": true})");
    const auto b = load_model(biased.path());
    CHECK(b.bias.qkv);
    CHECK(b.bias.attn_out);
    CHECK_FALSE(b.bias.mlp);
  }
  SECTION("qwen3_moe: experts of moe_intermediate_size in every block") {
    // Qwen/Qwen3-30B-A3B's config.json.
    const std::string fields = R"("model_type": "qwen3_moe", "hidden_size": 2048,
      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
      "num_hidden_layers": 48, "num_key_value_heads": 4, "head_dim": 128,
      "vocab_size": 151936, "max_position_embeddings": 40960, "num_experts_per_tok": 8,
      "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": true,
      "tie_word_embeddings": false)";
    TempFile f("config.json", "{" + fields + R"(, "num_experts": 128})");
    const auto m = load_model(f.path());
    REQUIRE(m.moe);
    CHECK(m.moe->experts == 128);
    CHECK(m.moe->top_k == 8);
    CHECK(m.moe->expert_ffn_hidden == 768);
    CHECK(m.ffn_hidden == 768);
    CHECK(m.q_width() == 4096);
    CHECK(m.description.find("intermediate_size (6144") != std::string::npos);
    CHECK(count_params(m) == count_params(load_model("qwen3-30b-a3b")));
    CHECK(count_params(m) == 30532110336ULL);
    // Newer transformers save the count as num_local_experts; two that disagree are refused.
    TempFile local("config.json", "{" + fields + R"(, "num_local_experts": 128})");
    CHECK(load_model(local.path()).moe->experts == 128);
    TempFile both("config.json",
                  "{" + fields + R"(, "num_experts": 128, "num_local_experts": 64})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(both.path()), InputError,
        "num_local_experts: 64 here, but num_experts is 128: the same figure, given twice apart");
    // Dense blocks among the experts' (Qwen3MoeMLP of intermediate_size); shared experts are
    // refused (qwen3_moe has none).
    const std::string base = R"("model_type": "qwen3_moe", "hidden_size": 64,
      "moe_intermediate_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4,
      "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
      "num_experts": 4, "num_experts_per_tok": 2)";
    TempFile plain("config.json", "{" + base + "}");
    const auto small = load_model(plain.path());
    CHECK(small.head_dim == 16);  // hidden_size / heads without head_dim (Qwen3MoeAttention)
    CHECK(small.kv_heads == 2);
    // Its gates over all experts by default (norm_topk_prob false), Switch's; 30B-A3B's true.
    CHECK_FALSE(small.moe->normalize_top_k);
    CHECK(m.moe->normalize_top_k);
    CHECK(small.unmodelled.size() == 1);  // q_norm and k_norm
    CHECK(architecture_json(small)["moe"]["normalize_top_k"] == false);
    CHECK_FALSE(architecture_json(m)["moe"].contains("normalize_top_k"));
    // Experts where (block + 1) % decoder_sparse_step is 0 and mlp_only_layers leaves them.
    TempFile sparse("config.json",
                    "{" + base + R"(, "decoder_sparse_step": 2, "intermediate_size": 96})");
    const auto every_other = load_model(sparse.path());
    CHECK(every_other.moe->dense_blocks == std::vector<std::int64_t>{0, 2});
    CHECK(every_other.moe->dense_ffn_hidden == 96);
    CHECK(every_other.expert_blocks() == 2);
    CHECK(every_other.has_experts(1));
    CHECK_FALSE(every_other.has_experts(2));
    CHECK(every_other.dense_ffn(2) == 96);
    CHECK(every_other.dense_ffn(1) == 0);
    CHECK(every_other.description.find("intermediate_size (96") == std::string::npos);
    TempFile dense("config.json",
                   "{" + base + R"(, "mlp_only_layers": [0, 3], "intermediate_size": 96})");
    CHECK(load_model(dense.path()).moe->dense_blocks == std::vector<std::int64_t>{0, 3});
    CHECK(architecture_json(load_model(dense.path()))["moe"]["dense_blocks"] ==
          nlohmann::json::array({0, 3}));
    // Their width is required (Qwen3MoeConfig's default, 22016, is not assumed); a block past
    // the last, or every block dense, is refused.
    TempFile unsized("config.json", "{" + base + R"(, "mlp_only_layers": [1]})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(unsized.path()), InputError,
                                    "config.json: intermediate_size: required field is missing");
    TempFile past("config.json",
                  "{" + base + R"(, "mlp_only_layers": [4], "intermediate_size": 96})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(past.path()), InputError,
                                    "config.json: mlp_only_layers[0]: expected a whole number "
                                    "from 0 to 3, got 4");
    TempFile all_dense("config.json",
                       "{" + base + R"(, "decoder_sparse_step": 5, "intermediate_size": 96})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(all_dense.path()), InputError,
                                    "config.json: decoder_sparse_step: no block of the 4 has "
                                    "experts");
    TempFile shared("config.json", "{" + base + R"(, "shared_expert_intermediate_size": 128})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(shared.path()), InputError,
                                    "config.json: shared_expert_intermediate_size: Hugging "
                                    "Face's qwen3_moe model has no shared expert");
    TempFile none("config.json", "{" + base + R"(, "shared_expert_intermediate_size": 0,
      "mlp_only_layers": null})");
    CHECK(count_params(load_model(none.path())) == count_params(small));
    TempFile missing("config.json", R"({"model_type": "qwen3_moe", "hidden_size": 64,
      "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2,
      "vocab_size": 256, "max_position_embeddings": 64, "num_experts": 4,
      "num_experts_per_tok": 2})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(missing.path()), InputError,
                                    "moe_intermediate_size: required field is missing");
  }
  SECTION("qwen2_moe: experts beside a shared expert, q/k/v biases") {
    // Qwen/Qwen2-57B-A14B's config.json.
    const std::string fields = R"("model_type": "qwen2_moe", "hidden_size": 3584,
      "intermediate_size": 18944, "moe_intermediate_size": 2560, "num_attention_heads": 28,
      "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 151936,
      "max_position_embeddings": 131072, "num_experts": 64, "num_experts_per_tok": 8,
      "decoder_sparse_step": 1, "norm_topk_prob": false, "rope_theta": 1000000.0,
      "sliding_window": 131072, "use_sliding_window": false, "tie_word_embeddings": false)";
    TempFile f("config.json", "{" + fields + R"(, "shared_expert_intermediate_size": 20480})");
    const auto m = load_model(f.path());
    REQUIRE(m.moe);
    CHECK(m.moe->experts == 64);
    CHECK(m.moe->expert_ffn_hidden == 2560);
    CHECK(m.moe->shared_ffn_hidden == 20480);
    CHECK(m.shared_ffn() == 20480);
    CHECK(m.dense_ffn(0) == 20480);
    CHECK(m.bias.qkv);
    CHECK_FALSE(m.bias.attn_out);
    CHECK_FALSE(m.unmodelled_sliding_window);
    // The shipped model's count: Hugging Face's 57,408,658,944 less the shared experts' gates
    // (3,584 a block), which are said not to be modelled.
    CHECK(count_params(m) == count_params(load_model("qwen2-57b-a14b")));
    CHECK(count_params(m) == 57408558592ULL);
    CHECK(m.unmodelled == load_model("qwen2-57b-a14b").unmodelled);
    CHECK(m.description.find("shared_expert_gate") != std::string::npos);
    // Its architecture records the shared experts' width (where there are some only).
    CHECK(architecture_json(m)["moe"]["shared_ffn_hidden"] == 20480);
    CHECK_FALSE(architecture_json(load_model("mixtral-8x7b"))["moe"].contains("shared_ffn_hidden"));
    // Without shared experts (0): Qwen3-MoE-like blocks with q/k/v biases, and no gate said.
    TempFile none("config.json", "{" + fields + R"(, "shared_expert_intermediate_size": 0})");
    const auto plain = load_model(none.path());
    CHECK(plain.shared_ffn() == 0);
    CHECK(count_params(plain) == 57408558592ULL - 28ULL * 3 * 3584 * 20480);
    CHECK(plain.description.find("shared_expert_gate") == std::string::npos);
    // Qwen2MoeConfig's default width (5632) is not assumed; 16 key/value heads are, as its.
    TempFile missing("config.json", "{" + fields + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(missing.path()), InputError,
        "config.json: shared_expert_intermediate_size: required field is missing");
    TempFile mha("config.json", R"({"model_type": "qwen2_moe", "hidden_size": 64,
      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
      "num_attention_heads": 16, "num_hidden_layers": 2, "vocab_size": 256,
      "max_position_embeddings": 64, "num_experts": 4, "num_experts_per_tok": 2})");
    CHECK(load_model(mha.path()).kv_heads == 16);
    // A dense block (Qwen2MoeMLP of intermediate_size, no shared expert) among the experts'.
    TempFile sparse("config.json", "{" + fields + R"(, "shared_expert_intermediate_size": 20480,
      "mlp_only_layers": [1]})");
    const auto one_dense = load_model(sparse.path());
    CHECK(one_dense.moe->dense_blocks == std::vector<std::int64_t>{1});
    CHECK(one_dense.moe->dense_ffn_hidden == 18944);
    CHECK(one_dense.dense_ffn(1) == 18944);
    CHECK(one_dense.dense_ffn(0) == 20480);  // the shared experts'
  }
  SECTION("glm4_moe: dense first blocks, then experts beside shared ones") {
    // zai-org/GLM-4.5-Air's config.json.
    const std::string fields = R"("architectures": ["Glm4MoeForCausalLM"],
      "attention_bias": true, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
      "partial_rotary_factor": 0.5, "intermediate_size": 10944, "max_position_embeddings": 131072,
      "model_type": "glm4_moe", "moe_intermediate_size": 1408, "norm_topk_prob": true,
      "num_attention_heads": 96, "n_group": 1, "topk_group": 1, "n_routed_experts": 128,
      "n_shared_experts": 1, "routed_scaling_factor": 1.0, "num_experts_per_tok": 8,
      "num_hidden_layers": 46, "num_key_value_heads": 8, "rope_theta": 1000000,
      "num_nextn_predict_layers": 1, "tie_word_embeddings": false, "use_qk_norm": false,
      "vocab_size": 151552)";
    TempFile f("config.json", "{" + fields + R"(, "first_k_dense_replace": 1})");
    const auto m = load_model(f.path());
    REQUIRE(m.moe);
    CHECK(m.moe->experts == 128);
    CHECK(m.moe->top_k == 8);
    CHECK(m.moe->expert_ffn_hidden == 1408);
    CHECK(m.shared_ffn() == 1408);
    CHECK(m.moe->dense_blocks == std::vector<std::int64_t>{0});
    CHECK(m.moe->dense_ffn_hidden == 10944);
    CHECK(m.moe->normalize_top_k);
    // Its gates: the chosen logits' sigmoids over their sum, times routed_scaling_factor.
    CHECK(m.moe->sigmoid_gates);
    CHECK(m.moe->routed_scale == 1.0);
    CHECK(architecture_json(m)["moe"]["scores"] == "sigmoid");
    CHECK_FALSE(architecture_json(m)["moe"].contains("routed_scaling_factor"));
    // q, k and v biases, none on o (Glm4MoeAttention).
    CHECK(m.bias.qkv);
    CHECK_FALSE(m.bias.attn_out);
    // Its language model: 106.85B (GLM-4.5-Air's "106B total"; its multi-token prediction
    // layer, which Hugging Face's class leaves out, not counted).
    CHECK(count_params(m) == 106852245504ULL);
    // Half-head RoPE, the router's selection bias, the multi-token prediction layer.
    REQUIRE(m.unmodelled.size() == 3);
    CHECK(m.unmodelled[0] == "its partial_rotary_factor of 0.5 (RoPE on whole heads instead)");
    CHECK(m.unmodelled[1].find("e_score_correction_bias") != std::string::npos);
    CHECK(m.unmodelled[2] == "its 1 multi-token prediction layer");
    // GLM-4.5's three dense blocks; Glm4MoeConfig's defaults (one dense block, one shared
    // expert, RoPE on half of each head) where the keys are left out.
    // (The Air's fields with others: GLM-4.5's routed_scaling_factor, grouped routing.)
    const auto scaled = [&fields](const std::string& factor, const std::string& groups) {
      std::string out = fields;
      for (const auto& [from, to] :
           {std::pair<std::string, std::string>{R"("routed_scaling_factor": 1.0)",
                                                R"("routed_scaling_factor": )" + factor},
            {R"("n_group": 1)", R"("n_group": )" + groups}}) {
        out.replace(out.find(from), from.size(), to);
      }
      return out;
    };
    TempFile three("config.json", "{" + scaled("2.5", "8") + R"(, "first_k_dense_replace": 3})");
    const auto glm45 = load_model(three.path());
    CHECK(glm45.moe->dense_blocks == std::vector<std::int64_t>{0, 1, 2});
    CHECK(glm45.moe->routed_scale == 2.5);
    CHECK(std::count(glm45.unmodelled.begin(), glm45.unmodelled.end(),
                     "its group-limited routing (n_group, topk_group)") == 1);
    TempFile huge("config.json", "{" + scaled("2500", "1") + R"(, "first_k_dense_replace": 1})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(huge.path()), InputError,
                                    "routed_scaling_factor: expected a factor from 0.001 to 1000");
    TempFile defaults("config.json", R"({"model_type": "glm4_moe", "hidden_size": 64,
      "intermediate_size": 160, "moe_intermediate_size": 32, "num_attention_heads": 8,
      "num_hidden_layers": 3, "n_routed_experts": 4, "num_experts_per_tok": 2,
      "vocab_size": 256, "max_position_embeddings": 64})");
    const auto small = load_model(defaults.path());
    CHECK(small.moe->dense_blocks == std::vector<std::int64_t>{0});
    CHECK(small.shared_ffn() == 32);
    CHECK(small.kv_heads == 8);  // Glm4MoeConfig's default
    CHECK(small.head_dim == 8);  // hidden_size / heads
    CHECK(small.unmodelled.front() ==
          "its partial_rotary_factor of 0.5 (RoPE on whole heads "
          "instead)");
    // Every block dense: refused.
    TempFile dense("config.json", "{" + fields + R"(, "first_k_dense_replace": 46})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(dense.path()), InputError,
                                    "first_k_dense_replace: no block of the 46 has experts");
  }
  SECTION("deepseek_v3: latent attention, dense first blocks, sigmoid gates") {
    // deepseek-ai/DeepSeek-V3's config.json (its auto_map and token ids left out).
    const std::string fields = R"("architectures": ["DeepseekV3ForCausalLM"],
      "attention_bias": false, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
      "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
      "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
      "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
      "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
      "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
      "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
      "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
      "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
      "seq_aux": true, "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc",
      "v_head_dim": 128, "vocab_size": 129280)";
    TempFile f("config.json", "{" + fields + "}");
    const auto m = load_model(f.path());
    REQUIRE(m.mla);
    CHECK(m.mla->q_lora_rank == 1536);
    CHECK(m.mla->kv_lora_rank == 512);
    CHECK(m.mla->qk_nope_head_dim == 128);
    CHECK(m.mla->qk_rope_head_dim == 64);
    CHECK(m.mla->v_head_dim == 128);
    CHECK(m.heads == 128);
    CHECK(m.kv_heads == 128);
    CHECK(m.head_dim == 192);  // a head's query and key: 128 without positions, 64 with RoPE
    CHECK(m.v_width() == 128 * 128);
    CHECK(m.latent_width() == 1536 + 512 + 64);
    REQUIRE(m.moe);
    CHECK(m.moe->experts == 256);
    CHECK(m.moe->top_k == 8);
    CHECK(m.shared_ffn() == 2048);
    CHECK(m.moe->dense_blocks == std::vector<std::int64_t>{0, 1, 2});
    CHECK(m.moe->dense_ffn_hidden == 18432);
    CHECK(m.moe->sigmoid_gates);
    CHECK(m.moe->normalize_top_k);
    CHECK(m.moe->routed_scale == 2.5);
    // The shipped model file describes the same model: 671.0B (DeepSeek's 671B, without its
    // multi-token prediction module).
    const auto shipped = load_model("deepseek-v3-671b");
    CHECK(count_params(m) == 671026404352ULL);
    CHECK(count_params(shipped) == count_params(m));
    CHECK(architecture_json(shipped) == architecture_json(m));
    CHECK(architecture_json(m)["mla"]["kv_lora_rank"] == 512);
    // YaRN, the router's selection bias, its groups, the multi-token prediction layer.
    REQUIRE(m.unmodelled.size() == 4);
    CHECK(m.unmodelled[0] == "its rope_scaling (yarn: plain RoPE frequencies instead)");
    CHECK(m.unmodelled[1].find("e_score_correction_bias") != std::string::npos);
    CHECK(m.unmodelled[2] == "its group-limited routing (n_group, topk_group)");
    CHECK(m.unmodelled[3] == "its 1 multi-token prediction layer");
    // Kimi K2 (moonshotai/Kimi-K2-Instruct's config, as V3's with its own figures): 1.03T.
    std::string kimi = fields;
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {R"("model_type": "deepseek_v3")", R"("model_type": "kimi_k2")"},
             {R"("first_k_dense_replace": 3)", R"("first_k_dense_replace": 1)"},
             {R"("n_routed_experts": 256)", R"("n_routed_experts": 384)"},
             {R"("num_attention_heads": 128)", R"("num_attention_heads": 64)"},
             {R"("num_key_value_heads": 128)", R"("num_key_value_heads": 64)"},
             {R"("n_group": 8)", R"("n_group": 1)"},
             {R"("topk_group": 4)", R"("topk_group": 1)"},
             {R"("routed_scaling_factor": 2.5)", R"("routed_scaling_factor": 2.827)"},
             {R"("num_nextn_predict_layers": 1)", R"("num_nextn_predict_layers": 0)"},
             {R"("vocab_size": 129280)", R"("vocab_size": 163840)"}}) {
      REQUIRE(kimi.find(from) != std::string::npos);
      kimi.replace(kimi.find(from), from.size(), to);
    }
    TempFile k2("config.json", "{" + kimi + "}");
    const auto moonshot = load_model(k2.path());
    CHECK(count_params(moonshot) == 1026408209408ULL);
    CHECK(moonshot.moe->routed_scale == 2.827);
    CHECK(moonshot.unmodelled.size() == 2);  // YaRN and the selection bias: no groups, no MTP
    // What latent attention cannot be without: a statement of q_lora_rank (null: none).
    std::string no_q = fields;
    no_q.erase(no_q.find(R"("q_lora_rank": 1536,)"), std::string(R"("q_lora_rank": 1536,)").size());
    TempFile missing("config.json", "{" + no_q + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(missing.path()), InputError,
                                    "config.json: q_lora_rank: required field is missing (null "
                                    "where the queries come from the block's input)");
    // (The fields with one of theirs given another value.)
    const auto with = [&fields](const std::string& from, const std::string& to) {
      std::string out = fields;
      out.replace(out.find(from), from.size(), to);
      return "{" + out + "}";
    };
    TempFile biased("config.json", with(R"("attention_bias": false)", R"("attention_bias": true)"));
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(biased.path()), InputError,
                                    "attention_bias: true: biases of latent attention's "
                                    "projections are not modelled");
    TempFile tanh("config.json", with(R"("scoring_func": "sigmoid")", R"("scoring_func": "tanh")"));
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(tanh.path()), InputError,
                                    "scoring_func: \"tanh\": expected \"sigmoid\" or \"softmax\"");
    TempFile odd("config.json", with(R"("qk_rope_head_dim": 64)", R"("qk_rope_head_dim": 63)"));
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(odd.path()), InputError,
                                    "config.json: qk_rope_head_dim: expected an even width (RoPE "
                                    "turns pairs), got 63");
    TempFile wide("config.json", with(R"("kv_lora_rank": 512)", R"("kv_lora_rank": 33554432)"));
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(wide.path()), InputError,
                                    "config.json: kv_lora_rank: expected at most 16777216");
  }
  SECTION("deepseek_v2: queries from the block's input, softmax gates") {
    // deepseek-ai/DeepSeek-V2-Lite's config.json.
    const std::string fields = R"("architectures": ["DeepseekV2ForCausalLM"],
      "attention_bias": false, "first_k_dense_replace": 1, "hidden_act": "silu",
      "hidden_size": 2048, "intermediate_size": 10944, "kv_lora_rank": 512,
      "max_position_embeddings": 163840, "model_type": "deepseek_v2",
      "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
      "n_shared_experts": 2, "num_attention_heads": 16, "num_experts_per_tok": 6,
      "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": null,
      "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rope_theta": 10000,
      "scoring_func": "softmax", "tie_word_embeddings": false, "topk_group": 1,
      "topk_method": "greedy", "v_head_dim": 128, "vocab_size": 102400)";
    TempFile f("config.json", "{" + fields + R"(, "norm_topk_prob": false,
      "routed_scaling_factor": 1.0})");
    const auto m = load_model(f.path());
    REQUIRE(m.mla);
    CHECK(m.mla->q_lora_rank == 0);
    CHECK(m.latent_width() == 512 + 64);
    CHECK_FALSE(m.moe->sigmoid_gates);
    CHECK_FALSE(m.moe->normalize_top_k);
    CHECK(m.shared_ffn() == 2 * 1408);
    CHECK(m.unmodelled.empty());
    CHECK(count_params(m) == 15706484224ULL);  // DeepSeek's 15.7B
    CHECK(architecture_json(load_model("deepseek-v2-lite-16b")) == architecture_json(m));
    // DeepSeek-V2's gate scales the probabilities it does not renormalize, and only those.
    TempFile scaled("config.json", "{" + fields + R"(, "norm_topk_prob": false,
      "routed_scaling_factor": 16.0})");
    CHECK(load_model(scaled.path()).moe->routed_scale == 16.0);
    TempFile renormalized("config.json", "{" + fields + R"(, "norm_topk_prob": true,
      "routed_scaling_factor": 16.0})");
    const auto unscaled = load_model(renormalized.path());
    CHECK(unscaled.moe->routed_scale == 1.0);
    CHECK_THAT(unscaled.description,
               Catch::Contains("its routed_scaling_factor of 16 is not applied"));
    // DeepSeek-V2's group-limited routing where its topk_method says so.
    std::string grouped = fields;
    for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
             {R"("n_group": 1)", R"("n_group": 8)"},
             {R"("topk_group": 1)", R"("topk_group": 3)"},
             {R"("topk_method": "greedy")", R"("topk_method": "group_limited_greedy")"}}) {
      grouped.replace(grouped.find(from), from.size(), to);
    }
    TempFile groups("config.json", "{" + grouped + "}");
    CHECK(load_model(groups.path()).unmodelled ==
          std::vector<std::string>{"its group-limited routing (n_group, topk_group)"});
    // n_routed_experts null (DeepSeek's classes: no experts, a model no release has): refused,
    // as the key left out (the classes disagree on what that means); n_shared_experts alike.
    std::string dense = fields;
    dense.replace(dense.find(R"("n_routed_experts": 64,)"),
                  std::string(R"("n_routed_experts": 64,)").size(), R"("n_routed_experts": null,)");
    TempFile all_dense("config.json", "{" + dense + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(all_dense.path()), InputError,
                                    "n_routed_experts: null: a model without experts is not "
                                    "imported");
    std::string unsaid = fields;
    unsaid.erase(unsaid.find(R"("n_shared_experts": 2,)"),
                 std::string(R"("n_shared_experts": 2,)").size());
    TempFile no_shared("config.json", "{" + unsaid + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(no_shared.path()), InputError,
                                    "n_shared_experts: required field is missing");
    // Experts in every other block from the first on (moe_layer_freq 2): a frequency past the
    // blocks leaves none, and is named.
    const auto every = [&fields](const std::string& freq) {
      std::string out = fields;
      const std::string key = R"("moe_layer_freq": 1)";
      out.replace(out.find(key), key.size(), R"("moe_layer_freq": )" + freq);
      return "{" + out + "}";
    };
    TempFile sparse("config.json", every("2"));
    CHECK(load_model(sparse.path()).moe->dense_blocks.size() == 14);
    TempFile none("config.json", every("100"));
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(none.path()), InputError,
                                    "moe_layer_freq: no block of the 27 has experts");
  }
  SECTION("llama4: its text_config, experts beside a shared expert in every block") {
    // meta-llama/Llama-4-Scout-17B-16E's config.json (its vision_config cut short).
    const std::string text = R"("attention_bias": false, "attention_chunk_size": 8192,
      "attn_temperature_tuning": true, "floor_scale": 8192, "head_dim": 128,
      "hidden_act": "silu", "hidden_size": 5120, "interleave_moe_layer_step": 1,
      "intermediate_size": 8192, "intermediate_size_mlp": 16384,
      "max_position_embeddings": 10485760, "model_type": "llama4_text",
      "num_attention_heads": 40, "num_experts_per_tok": 1, "num_hidden_layers": 48,
      "num_key_value_heads": 8, "num_local_experts": 16, "rope_theta": 500000.0,
      "rope_scaling": {"factor": 16.0, "rope_type": "llama3"}, "tie_word_embeddings": false,
      "use_qk_norm": true, "no_rope_layers": [], "vocab_size": 202048)";
    const std::string outer = R"("model_type": "llama4", "tie_word_embeddings": false,
      "_name_or_path": "meta-llama/Llama-4-Scout-17B-16E", "vision_config": {"hidden_size": 1408})";
    TempFile f("config.json", "{" + outer + R"(, "text_config": {)" + text + "}}");
    const auto m = load_model(f.path());
    CHECK(m.name == "meta-llama/Llama-4-Scout-17B-16E");
    REQUIRE(m.moe);
    CHECK(m.moe->experts == 16);
    CHECK(m.moe->top_k == 1);
    CHECK(m.moe->expert_ffn_hidden == 8192);
    CHECK(m.shared_ffn() == 8192);
    CHECK(m.kv_heads == 8);
    CHECK(m.rope_theta == 500000.0);
    CHECK_FALSE(m.bias.qkv);
    // Its language model's count (Hugging Face's too: its router has no bias and its q/k norm
    // no weights): of the 109B that Meta gives Scout with its vision model, 17B activated.
    CHECK(count_params(m) == 107769861120ULL);
    CHECK(count_params(m) == count_params(load_model("llama4-scout-17b-16e")));
    const auto shipped = load_model("llama4-scout-17b-16e");
    CHECK(m.unmodelled == shipped.unmodelled);
    CHECK(m.unmodelled_sliding_window == shipped.unmodelled_sliding_window);
    CHECK(m.unmodelled_window_kind == shipped.unmodelled_window_kind);
    // Every fourth block without RoPE by default; chunked attention said past 8192 tokens.
    CHECK(m.unmodelled_sliding_window == 8192);
    CHECK(m.unmodelled_window_kind.find("chunked attention") != std::string::npos);
    // RoPE scaling, the router's gates, the q/k norm, blocks without RoPE (Meta's config says
    // [], Hugging Face's default: every fourth), their temperature tuning.
    REQUIRE(m.unmodelled.size() == 5);
    CHECK(m.unmodelled[3] == "its 12 blocks without RoPE (RoPE in every block instead)");
    for (const char* said : {"vision model", "intermediate_size_mlp (16384", "sigmoid gates",
                             "use_qk_norm", "attention temperature tuning", "rope_scaling"}) {
      INFO(said);
      CHECK(m.description.find(said) != std::string::npos);
    }
    // The language model's own config reads alike.
    TempFile plain("config.json", "{" + text + "}");
    CHECK(count_params(load_model(plain.path())) == count_params(m));
    // The text fields with one value changed (`key` as it is written, then its new value).
    auto with = [&text](const std::string& key, const std::string& value) {
      std::string t = text;
      const std::size_t at = t.find("\"" + key + "\": ");
      REQUIRE(at != std::string::npos);
      const std::size_t from = at + key.size() + 4;
      t.replace(from, t.find_first_of(",\n", from) - from, value);
      return t;
    };
    // Its fields named where they are: inside text_config.
    TempFile bad("config.json",
                 "{" + outer + R"(, "text_config": {)" + with("num_local_experts", "0") + "}}");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(bad.path()), InputError,
                                    "config.json: text_config.num_local_experts: ");
    // Maverick's blocks: experts in every other one (the odd ones), dense MLPs of
    // intermediate_size_mlp between them.
    TempFile maverick("config.json", "{" + outer + R"(, "text_config": {)" +
                                         with("interleave_moe_layer_step", "2") + "}}");
    const auto alternate = load_model(maverick.path());
    CHECK(alternate.expert_blocks() == 24);
    CHECK_FALSE(alternate.has_experts(0));
    CHECK(alternate.has_experts(47));
    CHECK(alternate.moe->dense_ffn_hidden == 16384);
    CHECK(alternate.description.find("intermediate_size_mlp (16384") == std::string::npos);
    TempFile some("config.json", "{" + text + R"(, "moe_layers": [1, 3]})");
    CHECK(load_model(some.path()).expert_blocks() == 2);
    TempFile narrow("config.json",
                    "{" + with("intermediate_size_mlp", "2") + R"(, "moe_layers": [1, 3]})");
    CHECK(load_model(narrow.path()).moe->dense_ffn_hidden == 2);
    TempFile none("config.json", "{" + text + R"(, "moe_layers": []})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(none.path()), InputError,
                                    "moe_layers: no block of the 48 has experts");
    TempFile past("config.json", "{" + text + R"(, "moe_layers": [48]})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(past.path()), InputError,
                                    "moe_layers[0]: expected a whole number from 0 to 47, got 48");
    TempFile flags("config.json", "{" + with("no_rope_layers", "[1, 0]") + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(flags.path()), InputError,
                                    "no_rope_layers: expected a 0 or 1 for each of the 48 blocks");
    std::string ones = "1";
    for (int i = 1; i < 48; ++i) ones += ", 1";
    TempFile all_rope("config.json", "{" + with("no_rope_layers", "[" + ones + "]") + "}");
    // RoPE scaling, the gates and the q/k norm: no block without RoPE, none tuned.
    CHECK(load_model(all_rope.path()).unmodelled.size() == 3);
    // Every block without RoPE: no chunked attention (it is on the blocks with RoPE).
    std::string zeros = "0";
    for (int i = 1; i < 48; ++i) zeros += ", 0";
    TempFile no_rope("config.json", "{" + with("no_rope_layers", "[" + zeros + "]") + "}");
    CHECK_FALSE(load_model(no_rope.path()).unmodelled_sliding_window);
    // A chunk size of null is no chunked attention, as Hugging Face reads it.
    TempFile unchunked("config.json", "{" + with("attention_chunk_size", "null") + "}");
    CHECK_FALSE(load_model(unchunked.path()).unmodelled_sliding_window);
    TempFile untuned("config.json", "{" + with("attn_temperature_tuning", "null") + "}");
    CHECK(load_model(untuned.path()).unmodelled.size() == 4);  // no temperature tuning
    // validate_model's messages name the nested keys too.
    TempFile kv("config.json",
                "{" + outer + R"(, "text_config": {)" + with("num_key_value_heads", "3") + "}}");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(kv.path()), InputError,
                                    "config.json: text_config.num_key_value_heads: ");
    // A quantized checkpoint's quantization_config, at the composite config's top level.
    TempFile fp8("config.json", "{" + outer + R"(, "quantization_config": {"quant_method": "fp8"},
      "text_config": {)" + text + "}}");
    CHECK(load_model(fp8.path()).description.find("quantization_config") != std::string::npos);
    TempFile no_text("config.json", "{" + outer + "}");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(no_text.path()), InputError,
                                    "config.json: text_config: required field is missing");
  }
  SECTION("gpt2") {
    TempFile f("config.json", R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 12, "n_positions": 1024, "vocab_size": 50257})");
    CHECK(count_params(load_model(f.path())) == 124439808ULL);
    // GELU's approximations price alike; another activation is refused, not priced as GELU.
    TempFile tanh("config.json", R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 12, "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"})");
    CHECK(count_params(load_model(tanh.path())) == 124439808ULL);
    TempFile relu("config.json", R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 12, "n_positions": 1024, "vocab_size": 50257, "activation_function": "relu"})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(relu.path()), InputError,
        "activation_function: \"relu\": dtsim models gpt2's MLP with gelu");
    // Two names of one figure that disagree: which one counts depends on the model class.
    TempFile both("config.json", R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 2, "num_hidden_layers": 5, "n_positions": 1024, "vocab_size": 50257})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(both.path()), InputError,
        "num_hidden_layers: 5 here, but n_layer is 2: the same figure, given twice apart");
    TempFile agree("config.json", R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 12, "num_hidden_layers": 12, "n_positions": 1024, "vocab_size": 50257})");
    CHECK(count_params(load_model(agree.path())) == 124439808ULL);
  }
  SECTION("gpt2's dropout from its probabilities; others' attention_dropout and experts said") {
    const std::string gpt2 = R"("model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 12, "n_positions": 1024, "vocab_size": 50257)";
    // Hugging Face's GPT2Config: 0.1 each where not given.
    TempFile stock("config.json", "{" + gpt2 + "}");
    CHECK(load_model(stock.path()).dropout);
    TempFile off("config.json",
                 "{" + gpt2 + R"(, "embd_pdrop": 0, "attn_pdrop": 0.0, "resid_pdrop": 0})");
    CHECK_FALSE(load_model(off.path()).dropout);
    TempFile some("config.json", "{" + gpt2 + R"(, "embd_pdrop": 0, "attn_pdrop": 0})");
    const auto mixed = load_model(some.path());
    CHECK(mixed.dropout);
    CHECK_THAT(mixed.description,
               Catch::Contains("its embd_pdrop and attn_pdrop are 0 but its resid_pdrop not"));
    for (const std::string bad : {"-0.5", "1", "\"0.1\""}) {
      INFO(bad);
      TempFile f("config.json", "{" + gpt2 + R"(, "attn_pdrop": )" + bad + "}");
      DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError, "attn_pdrop: expected");
    }
    const std::string llama = R"("model_type": "llama", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64)";
    TempFile attention("config.json", "{" + llama + R"(, "attention_dropout": 0.1})");
    const auto a = load_model(attention.path());
    CHECK_FALSE(a.dropout);
    CHECK_THAT(a.description, Catch::Contains("its attention_dropout of 0.1 is not modelled"));
    TempFile none("config.json", "{" + llama + R"(, "attention_dropout": 0.0})");
    CHECK_THAT(load_model(none.path()).description, !Catch::Contains("attention_dropout"));
    TempFile wrong("config.json", "{" + llama + R"(, "attention_dropout": 2})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(wrong.path()), InputError,
        "attention_dropout: expected a probability from 0 to below 1, got 2");
    TempFile experts("config.json", "{" + llama + R"(, "num_local_experts": 8})");
    const auto dense = load_model(experts.path());
    CHECK_FALSE(dense.moe);
    CHECK_THAT(dense.description,
               Catch::Contains("its num_local_experts is not read: Hugging Face's llama model has "
                               "no experts"));
  }
  SECTION("a sliding window is said not to be modelled; a gated MLP other than SiLU refused") {
    TempFile text("config.json", R"({"model_type": "mistral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
      "sliding_window": "abc"})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(text.path()), InputError,
                                    "sliding_window: expected a number of tokens (an integer) or "
                                    "null");
    TempFile none("config.json", R"({"model_type": "mistral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
      "sliding_window": null})");
    CHECK_THAT(load_model(none.path()).description, !Catch::Contains("sliding_window"));
    // A window of no tokens was said as one ("its sliding_window of -4 tokens").
    TempFile negative("config.json", R"({"model_type": "mistral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
      "sliding_window": -4})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(negative.path()), InputError,
                                    "sliding_window: expected a positive integer, got -4");
    TempFile f("config.json", R"({"model_type": "mistral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
      "hidden_act": "silu", "sliding_window": 4096})");
    CHECK_THAT(load_model(f.path()).description,
               Catch::Contains("sliding_window of 4096 tokens is not modelled"));
    TempFile off("config.json", R"({"model_type": "qwen2", "hidden_size": 3584,
      "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
      "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
      "sliding_window": 131072, "use_sliding_window": false})");
    CHECK_THAT(load_model(off.path()).description, !Catch::Contains("sliding_window"));
    // Qwen2 uses its window only with use_sliding_window (false by default); Llama never.
    for (const char* type : {"qwen2", "llama"}) {
      INFO(type);
      TempFile unused("config.json",
                      std::string(R"({"model_type": ")") + type + R"(", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072,
        "sliding_window": 4096})");
      CHECK_THAT(load_model(unused.path()).description, !Catch::Contains("sliding_window"));
    }
    TempFile geglu("config.json", R"({"model_type": "llama", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "vocab_size": 32000, "max_position_embeddings": 8192, "hidden_act": "gelu"})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(geglu.path()), InputError,
        "hidden_act: \"gelu\": dtsim models llama's gated MLP with silu (SwiGLU) only");
  }
  SECTION("RoPE scaling and defaulted key/value heads are said in the description") {
    TempFile f("config.json", R"({"model_type": "llama", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "vocab_size": 128256, "max_position_embeddings": 131072,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})");
    const auto m = load_model(f.path());
    CHECK(m.kv_heads == 32);
    CHECK_THAT(m.description, Catch::Contains("no num_key_value_heads: one key/value head per "
                                              "head (multi-head attention)"));
    CHECK_THAT(m.description, Catch::Contains("its rope_scaling (llama3) changes RoPE's "
                                              "frequencies, not its cost: not modelled"));
  }
  SECTION("a family's own default key/value heads, biases it reads, and fields not modelled") {
    // Without num_key_value_heads: MistralConfig's and MixtralConfig's default is 8, Qwen2's 32
    // (it was one per head for every family, Mistral 7B 8.05B instead of 7.24B).
    const std::string mistral = R"("model_type": "mistral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "vocab_size": 32000, "max_position_embeddings": 32768)";
    TempFile no_kv("config.json", "{" + mistral + "}");
    const auto m = load_model(no_kv.path());
    CHECK(m.kv_heads == 8);
    CHECK(count_params(m) == 7241732096ULL);
    CHECK(m.unmodelled_sliding_window == 4096);  // (MistralConfig's default window too)
    CHECK_THAT(m.description,
               Catch::Contains("no num_key_value_heads: 8, Hugging Face's default for mistral"));
    TempFile few_heads("config.json", R"({"model_type": "mistral", "hidden_size": 512,
      "intermediate_size": 1024, "num_attention_heads": 4, "num_hidden_layers": 2,
      "vocab_size": 1024, "max_position_embeddings": 8192})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(few_heads.path()), InputError,
                                    "num_key_value_heads: not given, and mistral's default of 8 "
                                    "key/value heads does not divide num_attention_heads = 4");
    // attention_bias and mlp_bias are llama's; Qwen2Attention has q/k/v biases only and
    // MistralAttention none, whatever the config says.
    TempFile biased("config.json", "{" + mistral + R"(, "num_key_value_heads": 8,
      "attention_bias": true})");
    const auto b = load_model(biased.path());
    CHECK(count_params(b) == 7241732096ULL);
    CHECK_THAT(b.description, Catch::Contains("its attention_bias is not read: Hugging Face's "
                                              "mistral model has no biases"));
    TempFile llama_bias("config.json", R"({"model_type": "llama", "hidden_size": 64,
      "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
      "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
      "attention_bias": true, "mlp_bias": true})");
    const auto lb = load_model(llama_bias.path());
    CHECK(lb.bias.qkv);
    CHECK(lb.bias.attn_out);
    CHECK(lb.bias.mlp);
    // Fields that change nothing dtsim prices, or that it does not model, are said.
    TempFile other("config.json", "{" + mistral + R"(, "num_key_value_heads": 8,
      "partial_rotary_factor": 0.5, "quantization_config": {"bits": 4},
      "rope_parameters": {"rope_type": "yarn", "factor": 4}})");
    const auto o = load_model(other.path());
    CHECK_THAT(o.description, Catch::Contains("its partial_rotary_factor of 0.5"));
    CHECK_THAT(o.description, Catch::Contains("its quantization_config (quantized weights) is "
                                              "not modelled"));
    CHECK_THAT(o.description, Catch::Contains("its rope_parameters (yarn) changes RoPE's"));
    // A window is kept for the plans whose sequence is longer (simulate says so there).
    TempFile window("config.json", "{" + mistral + R"(, "sliding_window": 4096})");
    CHECK(load_model(window.path()).unmodelled_sliding_window == 4096);
    // A _name_or_path that is a folder of the machine that saved the config: its last part.
    TempFile saved("config.json",
                   "{" + mistral + R"(, "_name_or_path": "/disks/a/CodeThing-7b/"})");
    CHECK(load_model(saved.path()).name == "CodeThing-7b");
    TempFile repo("config.json",
                  "{" + mistral + R"(, "_name_or_path": "mistralai/Mistral-7B-v0.1"})");
    CHECK(load_model(repo.path()).name == "mistralai/Mistral-7B-v0.1");
  }
  SECTION("unsupported model_type lists the supported ones") {
    TempFile f("config.json", R"({"model_type": "bert", "hidden_size": 768})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(f.path()), InputError,
        "model_type: unsupported Hugging Face model_type \"bert\" (supported: deepseek_v2, "
        "deepseek_v3, glm4_moe, gpt2, granite, kimi_k2, llama, llama4, llama4_text, mistral, "
        "mixtral, olmo2, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe)");
  }
  SECTION("missing field") {
    TempFile f("config.json", R"({"model_type": "llama", "hidden_size": 4096})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError,
                                    "num_hidden_layers: required field is missing");
  }
  SECTION("mistyped field") {
    TempFile f("config.json", R"({"model_type": "llama", "hidden_size": "4096",
      "num_hidden_layers": 32})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError,
                                    "config.json: hidden_size: expected a positive integer, got "
                                    "\"4096\"");
  }
  SECTION("inconsistent or oversized fields are named by their Hugging Face keys") {
    TempFile gqa("config.json", R"({"model_type": "llama", "hidden_size": 4096,
      "intermediate_size": 11008, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 3, "vocab_size": 32000, "max_position_embeddings": 4096})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(gqa.path()), InputError,
        "config.json: num_key_value_heads: num_key_value_heads = 3 must divide "
        "num_attention_heads = 32");
    TempFile deep("config.json", R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 1000000, "n_positions": 1024, "vocab_size": 50257})");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(deep.path()), InputError,
                                    "config.json: n_layer: expected at most 100000, got 1000000");
    TempFile moe("config.json", R"({"model_type": "mixtral", "hidden_size": 4096,
      "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
      "num_local_experts": 2, "num_experts_per_tok": 4})");
    DTSIM_REQUIRE_THROWS_CONTAINING(
        load_model(moe.path()), InputError,
        "config.json: num_experts_per_tok: num_experts_per_tok = 4 exceeds num_local_experts = 2");
  }
  SECTION("the default sequence length is max_position_embeddings, at most 4096") {
    TempFile qwen("config.json", R"({"model_type": "qwen2", "hidden_size": 3584,
      "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28,
      "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 131072})");
    CHECK(load_model(qwen.path()).seq_len == 4096);
    CHECK(load_model(qwen.path()).max_positions == 131072);
    TempFile gpt2("config.json", R"({"model_type": "gpt2", "n_embd": 768, "n_head": 12,
      "n_layer": 12, "n_positions": 1024, "vocab_size": 50257})");
    CHECK(load_model(gpt2.path()).seq_len == 1024);
  }
}

namespace {
// A valid model in dtsim's format with one field replaced (or removed when value is null).
std::string model_with(const std::string& key, const nlohmann::json& value) {
  nlohmann::json j = nlohmann::json::parse(R"({"name": "m", "source": "test", "layers": 2,
    "hidden": 64, "heads": 4, "ffn_hidden": 256, "vocab": 100, "max_positions": 32,
    "activation": "gelu", "norm": "layernorm", "positions": "learned", "tied_embeddings": true})");
  if (value.is_null()) {
    j.erase(key);
  } else {
    j[key] = value;
  }
  return j.dump();
}
}  // namespace

TEST_CASE("multi-head latent attention in a model file", "[model][mla]") {
  // Two blocks of 4 heads with RoPE: queries from a latent of 24, keys and values from one of
  // 16, heads' queries and keys 8 + 4 wide, values 6.
  nlohmann::json j = nlohmann::json::parse(model_with("positions", "rope"));
  j["mla"] = {{"q_lora_rank", 24},
              {"kv_lora_rank", 16},
              {"qk_nope_head_dim", 8},
              {"qk_rope_head_dim", 4},
              {"v_head_dim", 6}};
  {
    TempFile f("mla.json", j.dump());
    const auto m = load_model(f.path());
    REQUIRE(m.mla);
    CHECK(m.head_dim == 12);
    CHECK(m.kv_heads == 4);
    CHECK(m.q_width() == 48);
    CHECK(m.kv_width() == 48);
    CHECK(m.v_width() == 24);
    CHECK(m.o_width() == 24);
    CHECK(m.latent_width() == 24 + 16 + 4);
    CHECK_FALSE(m.is_megatron_gpt());
    // Per block (no biases): the down projection 64 x 44, the latents' norm 24 + 16, the up
    // projections 24 x 48 and 16 x (4 x (8 + 6)), the output projection 24 x 64, two norms of
    // 64, the MLP 64 x 256 x 2.
    const std::uint64_t attention = 64 * 44 + 40 + 24 * 48 + 16 * 56 + 24 * 64;
    const std::uint64_t block = attention + 2 * 64 + 2 * 64 * 256;
    const auto params = count_params(m);
    // The embedding (tied: the head has none) and the final norm.
    CHECK(params == 2 * block + 100 * 64 + 64);
    // Without q_lora_rank the queries come from the block's input: no query latent in the
    // down projection or the norm, a 64 x 48 projection for the 24 x 48 one.
    auto direct = j;
    direct["mla"].erase("q_lora_rank");
    TempFile g("mla_direct.json", direct.dump());
    const auto d = load_model(g.path());
    CHECK(d.mla->q_lora_rank == 0);
    CHECK(count_params(d) == params - 2 * (64 * 24 + 24 + 24 * 48) + 2 * 64 * 48);
  }
  struct Case {
    std::string what;
    nlohmann::json change;  // merged into the model
    std::string message;
  };
  const std::vector<Case> cases = {
      {"kv heads",
       {{"kv_heads", 2}},
       "kv_heads: 2 with mla, whose every head has its own keys and values: leave kv_heads out "
       "or give heads (4)"},
      {"head dim",
       {{"head_dim", 16}},
       "head_dim: 16 with mla, whose heads' queries and keys are mla.qk_nope_head_dim + "
       "mla.qk_rope_head_dim = 12 wide: leave head_dim out or give 12"},
      {"positions",
       {{"positions", "learned"}},
       "positions: expected \"rope\" with multi-head latent attention"},
      {"odd rope",
       {{"mla", {{"qk_rope_head_dim", 5}}}},
       "mla.qk_rope_head_dim: expected an even width (RoPE turns pairs), got 5"},
      {"missing",
       {{"mla", {{"kv_lora_rank", nullptr}}}},
       "mla.kv_lora_rank: required field is missing"},
      {"zero",
       {{"mla", {{"v_head_dim", 0}}}},
       "mla.v_head_dim: expected a positive integer, got 0"},
      {"unknown", {{"mla", {{"kv_lora", 16}}}}, "mla.kv_lora: unknown field"},
      {"oversized",
       {{"mla", {{"kv_lora_rank", 1 << 25}}}},
       "mla.kv_lora_rank: expected at most 16777216, got 33554432"},
      {"oversized queries",
       {{"mla", {{"qk_nope_head_dim", 1 << 23}}}},
       "mla.qk_nope_head_dim: heads x (mla.qk_nope_head_dim + mla.qk_rope_head_dim) = 4 x "
       "8388612 = 33554448 exceeds 16777216"},
      {"oversized values",
       {{"heads", 64}, {"mla", {{"v_head_dim", 1 << 20}}}},
       "mla.v_head_dim: heads x 1048576 = 67108864 exceeds 16777216"},
      {"qkv bias",
       {{"bias", {{"qkv", true}}}},
       "bias.qkv: biases of multi-head latent attention's projections are not modelled"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.what) {
      auto bad = j;
      bad.merge_patch(c.change);
      TempFile f("bad_mla.json", bad.dump());
      DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError, "bad_mla.json: ");
      DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError, c.message);
    }
  }
}

TEST_CASE("bad model files are rejected naming file and field", "[model][bad-input]") {
  struct Case {
    std::string key;
    nlohmann::json value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"layers", nullptr, "layers: required field is missing"},
      {"layers", 0, "layers: expected a positive integer, got 0"},
      {"hidden", -64, "hidden: expected a positive integer, got -64"},
      {"hidden", "64", "hidden: expected a positive integer, got \"64\""},
      {"heads", 5, "heads: hidden = 64 is not divisible by heads = 5"},
      {"kv_heads", 3, "kv_heads: kv_heads = 3 must divide heads = 4"},
      {"activation", "relu", "activation: expected one of gelu, swiglu, got \"relu\""},
      {"norm", 1, "norm: expected one of layernorm, rmsnorm, got 1"},
      {"tied_embeddings", "yes", "tied_embeddings: expected true or false"},
      {"seq_len", 64, "seq_len: seq_len = 64 exceeds max_positions = 32"},
      {"hiden", 64, "hiden: unknown field"},
      // A name that tables print: a newline split a header, a NUL cut it.
      {"name", "", "name: expected a name, got an empty string"},
      {"name", "two\nlines", "name: expected a name without control characters"},
      {"name", std::string("nul\0byte", 8), "name: expected a name without control characters"},
      {"moe", nlohmann::json{{"experts", 2}, {"top_k", 4}, {"expert_ffn_hidden", 256}},
       "moe.top_k: top_k = 4 exceeds experts = 2"},
      // A mixture's MLPs are its experts (dense blocks among them have a width of their own):
      // another ffn_hidden would be read nowhere.
      {"moe", nlohmann::json{{"experts", 2}, {"top_k", 1}, {"expert_ffn_hidden", 8}},
       "ffn_hidden: 256 differs from moe.expert_ffn_hidden 8: a mixture-of-experts model's MLPs"},
      // Dense blocks among the experts': block numbers from 0, ascending, not all, with their
      // width.
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"dense_blocks", {2}},
                      {"dense_ffn_hidden", 64}},
       "moe.dense_blocks[0]: block 2 of 2 (blocks are numbered from 0 to 1)"},
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"dense_blocks", {1, 0}},
                      {"dense_ffn_hidden", 64}},
       "moe.dense_blocks[1]: 0 after 1: expected block numbers in ascending order, each once"},
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"dense_blocks", {0, 1}},
                      {"dense_ffn_hidden", 64}},
       "moe.dense_blocks: all 2 blocks dense: no block has experts"},
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"dense_blocks", nlohmann::json::array()},
                      {"dense_ffn_hidden", 64}},
       "moe.dense_blocks: expected the numbers (from 0) of the blocks whose MLP is dense"},
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"dense_blocks", {-1}},
                      {"dense_ffn_hidden", 64}},
       "moe.dense_blocks[0]: expected a whole number from 0 to 100000, got -1"},
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"dense_blocks", "0"},
                      {"dense_ffn_hidden", 64}},
       "moe.dense_blocks: expected an array of whole numbers from 0 to 100000, got \"0\""},
      {"moe",
       nlohmann::json{
           {"experts", 2}, {"top_k", 1}, {"expert_ffn_hidden", 256}, {"dense_blocks", {0}}},
       "moe.dense_ffn_hidden: required field is missing"},
      {"moe",
       nlohmann::json{
           {"experts", 2}, {"top_k", 1}, {"expert_ffn_hidden", 256}, {"dense_ffn_hidden", 64}},
       "moe.dense_ffn_hidden: given without dense_blocks"},
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"dense_blocks", {0}},
                      {"dense_ffn_hidden", 1LL << 25}},
       "moe.dense_ffn_hidden: expected at most 16777216"},
      // The gates' scores and their scale.
      {"moe",
       nlohmann::json{{"experts", 2}, {"top_k", 1}, {"expert_ffn_hidden", 256}, {"scores", "relu"}},
       "moe.scores: expected one of softmax, sigmoid, got \"relu\""},
      {"moe",
       nlohmann::json{
           {"experts", 2}, {"top_k", 1}, {"expert_ffn_hidden", 256}, {"routed_scaling_factor", 0}},
       "moe.routed_scaling_factor: expected a factor from 0.001 to 1000, got 0"},
      // Sanity bounds keep every count inside 64 bits (a wrapped product, or bad_alloc for
      // 2^31 blocks, is never the answer).
      {"layers", 2147483653LL, "layers: expected at most 100000, got 2147483653"},
      {"hidden", 1LL << 40, "hidden: expected at most 16777216, got 1099511627776"},
      {"vocab", 1LL << 30, "vocab: expected at most 16777216, got 1073741824"},
      {"ffn_hidden", 1LL << 25, "ffn_hidden: expected at most 16777216"},
      {"max_positions", 1LL << 25, "max_positions: expected at most 16777216"},
      {"kv_heads", 1LL << 17, "kv_heads: expected at most 65536, got 131072"},
      {"moe", nlohmann::json{{"experts", 1 << 17}, {"top_k", 2}, {"expert_ffn_hidden", 256}},
       "moe.experts: expected at most 65536, got 131072"},
      // Attention bounded to a window, said where the sequence passes it.
      {"unmodelled_window", nlohmann::json{{"tokens", 0}, {"kind", "sliding window"}},
       "unmodelled_window.tokens: expected a positive integer, got 0"},
      {"unmodelled_window", nlohmann::json{{"tokens", 16}, {"kind", ""}},
       "unmodelled_window.kind: expected a name, got an empty string"},
      {"unmodelled_window", nlohmann::json{{"tokens", 16}},
       "unmodelled_window.kind: required field is missing"},
      // Shared experts: a width of their own, positive where given.
      {"moe",
       nlohmann::json{
           {"experts", 2}, {"top_k", 1}, {"expert_ffn_hidden", 256}, {"shared_ffn_hidden", 0}},
       "moe.shared_ffn_hidden: expected a positive integer, got 0"},
      {"moe",
       nlohmann::json{{"experts", 2},
                      {"top_k", 1},
                      {"expert_ffn_hidden", 256},
                      {"shared_ffn_hidden", 1LL << 25}},
       "moe.shared_ffn_hidden: expected at most 16777216"},
      {"published_params_precision", 1000,
       "published_params_precision: given without "
       "published_params"},
  };
  for (const Case& c : cases) {
    DYNAMIC_SECTION(c.key << " -> " << c.message) {
      TempFile f("bad_model.json", model_with(c.key, c.value));
      DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError, "bad_model.json: ");
      DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError, c.message);
    }
  }
  SECTION("a published figure's unit of rounding is at most the figure") {
    auto j = nlohmann::json::parse(model_with("published_params", 120000));
    j["published_params_source"] = "test";
    j["published_params_precision"] = 1000000000000000000LL;
    TempFile f("bad_model.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError,
                                    "bad_model.json: published_params_precision: expected a unit "
                                    "of rounding of at most published_params (120000), got "
                                    "1000000000000000000");
  }
  SECTION("bounded fields that multiply past dtsim's limits") {
    auto j = nlohmann::json::parse(model_with("layers", 100000));
    j["hidden"] = 1 << 24;
    j["ffn_hidden"] = 1 << 24;
    j["heads"] = 1 << 16;
    TempFile f("bad_model.json", j.dump());
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError,
                                    "parameters exceed dtsim's limit of 2^50");
  }
  SECTION("malformed JSON") {
    TempFile f("bad_model.json", R"({"name": "m", "layers": })");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model(f.path()), InputError,
                                    "bad_model.json: malformed JSON");
  }
  SECTION("unknown name lists the known ones") {
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model("llama9"), InputError, "unknown model \"llama9\"");
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model("llama9"), InputError, "llama3-8b");
  }
  SECTION("a path that does not exist") {
    DTSIM_REQUIRE_THROWS_CONTAINING(load_model("/no/such/model.json"), InputError,
                                    "no such model file");
  }
}
