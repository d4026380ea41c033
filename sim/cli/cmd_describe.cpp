// dtsim describe: parameters, FLOPs per token and a per-layer table of one model.
#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/common/units.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/plan/plan.hpp"
#include "sim/report/table.hpp"

namespace dtsim::cli {

namespace {

using nlohmann::json;

// Block numbers as runs ("0-2", "0, 2, 4, ... 46" for every other one).
std::string block_list(const std::vector<std::int64_t>& blocks) {
  const std::size_t n = blocks.size();
  if (n >= 4) {
    const std::int64_t step = blocks[1] - blocks[0];
    bool even = true;
    for (std::size_t i = 1; i < n; ++i) even = even && blocks[i] - blocks[i - 1] == step;
    if (even && step == 1) return fmt::format("blocks {}-{}", blocks.front(), blocks.back());
    if (even) {
      return fmt::format("blocks {}, {}, {}, ... {}", blocks[0], blocks[1], blocks[2],
                         blocks.back());
    }
  }
  return fmt::format("block{} {}", n == 1 ? "" : "s", fmt::join(blocks, ", "));
}

std::string architecture(const model::ModelSpec& m) {
  std::string s = fmt::format("{} layers, hidden {}, {} heads", m.layers, m.hidden, m.heads);
  if (m.kv_heads != m.heads) s += fmt::format(" ({} KV heads)", m.kv_heads);
  if (m.mla) {
    const model::MlaSpec& a = *m.mla;
    s += ", multi-head latent attention (";
    if (a.q_lora_rank > 0) s += fmt::format("query latent {}, ", a.q_lora_rank);
    s += fmt::format("key-value latent {}, query and key heads {} + {} RoPE, value heads {}), ",
                     a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim);
  } else {
    s += fmt::format(", head dim {}, ", m.head_dim);
  }
  if (m.moe) {
    s += fmt::format("MoE {} experts top-{} of {} FFN {}, ", m.moe->experts, m.moe->top_k,
                     to_string(m.activation), m.moe->expert_ffn_hidden);
    if (m.shared_ffn() > 0) s += fmt::format("shared experts FFN {}, ", m.shared_ffn());
    if (m.mixed_blocks()) {
      const std::size_t dense = m.moe->dense_blocks.size();
      s += fmt::format("in {} of the blocks, {} dense block{} of FFN {} ({}), ", m.expert_blocks(),
                       dense, dense == 1 ? "" : "s", m.moe->dense_ffn_hidden,
                       block_list(m.moe->dense_blocks));
    }
  } else {
    s += fmt::format("{} FFN {}, ", to_string(m.activation), m.ffn_hidden);
  }
  s += fmt::format("vocab {}, {}, {} positions (max {}), {} embeddings", m.vocab, to_string(m.norm),
                   to_string(m.positions), m.max_positions, m.tied_embeddings ? "tied" : "untied");
  if (m.dropout) s += ", dropout";
  return s;
}

// Row label for layer groups: -1 embedding, L head, else block index.
std::string group_name(int layer, std::int64_t layers) {
  if (layer < 0) return "embedding";
  if (layer == layers) return "head";
  return fmt::format("{}", layer);
}

}  // namespace

int cmd_describe(const std::vector<std::string>& args) {
  po::options_description desc("dtsim describe options");
  desc.add_options()("help,h", "show this help");
  add_model_options(desc, /*with_cluster=*/false);
  desc.add_options()("seq-len", po::value<std::int64_t>(),
                     "sequence length for FLOPs and activations (default: the model's)")(
      "json", po::bool_switch(), "print JSON instead of tables");
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtsim describe --model M [--seq-len S] [--json]\n\n"
             "Parameters, training FLOPs per token and a per-layer table (parameters, forward "
             "FLOPs, saved activations) of a model.",
             vm)) {
    return 0;
  }
  const model::ModelSpec spec = model_from_options(vm);
  std::int64_t seq = spec.seq_len;
  if (vm.count("seq-len")) {
    seq = vm["seq-len"].as<std::int64_t>();
    if (seq < 1 || seq > spec.max_positions) {
      throw InputError(fmt::format("--seq-len: expected 1..{} (max_positions of {}), got {}",
                                   spec.max_positions, spec.name, seq));
    }
  }
  if (const std::string problem = model::size_problem(spec, 1, seq); !problem.empty()) {
    throw InputError(fmt::format("--seq-len: {}", problem));
  }
  // One sequence: per-token figures divide by seq.
  const model::ModelGraph graph(spec, 1, seq);
  const model::GraphTotals totals = graph.totals();
  const double tokens = static_cast<double>(seq);
  const double fwd_per_token = totals.fwd_flops / tokens;
  const double train_per_token = (totals.fwd_flops + totals.bwd_flops) / tokens;

  // Training pads the vocabulary (Megatron-LM's --make-vocab-size-divisible-by, default 128 x
  // tp): the FLOPs per token of a plan at tp 1 where that adds rows.
  const plan::Plan tp1;
  const std::int64_t padded_rows = plan::padded_vocab(spec.vocab, tp1);
  std::optional<double> padded_per_token;
  if (padded_rows != spec.vocab) {
    const model::GraphTotals padded =
        model::ModelGraph(plan::with_padded_vocab(spec, tp1), 1, seq).totals();
    padded_per_token = (padded.fwd_flops + padded.bwd_flops) / tokens;
  }

  std::uint64_t embedding_params = graph.layer_totals(-1).params;
  std::uint64_t head_params = graph.layer_totals(static_cast<int>(spec.layers)).params;
  const std::uint64_t block_params = totals.params - embedding_params - head_params;
  // Kaplan et al. 2020's C = 6N, N the non-embedding parameters a token meets (no token or
  // position embedding, no LM head; with a mixture of experts its top_k experts' of each
  // block, not all of them). An expert op's parameters are every expert's. With the embedding
  // and the head, the "activated" parameters that mixture-of-experts model cards give (Qwen3
  // 30B-A3B: 3.3B; Mixtral 8x7B: 12.9B).
  double active = 0, tables = 0;
  for (model::OpId id = 0; id < graph.size(); ++id) {
    const model::Op& op = graph.op(id);
    if (op.kind == model::OpKind::Embedding || op.kind == model::OpKind::LmHead) {
      tables += static_cast<double>(op.params);
      continue;
    }
    active += static_cast<double>(op.params) *
              (op.expert && spec.moe
                   ? static_cast<double>(spec.moe->top_k) / static_cast<double>(spec.moe->experts)
                   : 1.0);
  }

  if (vm["json"].as<bool>()) {
    json out = {
        {"name", spec.name},
        {"description", spec.description},
        {"source", spec.source},
        {"params", totals.params},
        {"params_breakdown",
         {{"embedding", embedding_params}, {"blocks", block_params}, {"head", head_params}}},
        // (A dense model's are all of them.)
        {"active_params",
         spec.moe ? static_cast<std::uint64_t>(std::llround(active + tables)) : totals.params},
        {"seq_len", seq},
        {"fwd_flops_per_token", fwd_per_token},
        {"flops_per_token", train_per_token},
        {"flops_per_token_note",
         "training (forward + backward) matrix-multiply FLOPs per token, 2 FLOPs per "
         "multiply-add, dense attention, no recompute"}};
    // The shapes the counts come from, as read (a Hugging Face config's included).
    out["architecture"] = model::architecture_json(spec);
    // (The vocabulary's own where training pads nothing.)
    out["padded_vocab"] = padded_rows;
    out["flops_per_token_padded_vocab"] = padded_per_token.value_or(train_per_token);
    if (spec.published_params) {
      out["published_params"] = *spec.published_params;
      out["published_params_precision"] = spec.published_params_precision;
      out["published_params_source"] = spec.published_params_source;
    }
    if (spec.is_megatron_gpt()) {
      out["megatron_flops_per_token"] = model::megatron_train_flops_per_token(spec, seq, false);
      out["megatron_flops_per_token_full_recompute"] =
          model::megatron_train_flops_per_token(spec, seq, true);
    }
    json layers = json::array();
    for (int l = -1; l <= spec.layers; ++l) {
      const model::GraphTotals t = graph.layer_totals(l);
      json ops = json::array();
      for (model::OpId id : graph.layer_ops(l)) {
        const model::Op& op = graph.op(id);
        ops.push_back({{"name", op.name},
                       {"kind", to_string(op.kind)},
                       {"params", op.params},
                       {"fwd_flops_per_token", op.fwd_flops / tokens},
                       {"bwd_flops_per_token", (op.bwd_input_flops + op.bwd_weight_flops) / tokens},
                       {"saved_bytes_per_sequence", op.saved_bytes}});
      }
      layers.push_back({{"layer", group_name(l, spec.layers)},
                        {"params", t.params},
                        {"fwd_flops_per_token", t.fwd_flops / tokens},
                        {"saved_bytes_per_sequence", t.saved_bytes},
                        {"ops", ops}});
    }
    out["layers"] = layers;
    std::cout << json_text(out, 2) << "\n";
    return 0;
  }

  std::cout << fmt::format("model {}: {}\n", spec.name, spec.description);
  std::cout << fmt::format("source: {}\n", spec.source);
  std::cout << fmt::format("architecture: {}\n\n", architecture(spec));
  std::cout << fmt::format("parameters: {} ({})\n", format_count(totals.params),
                           format_si(static_cast<double>(totals.params)));
  if (spec.published_params) {
    const auto p = spec.published_params_precision;
    const bool match = model::matches_published_params(spec, totals.params);
    std::cout << fmt::format("  published: {}{} — {} ({})\n", format_count(*spec.published_params),
                             p == 1 ? "" : fmt::format(" (rounded to {})", format_si(double(p))),
                             match ? "matches" : "DIFFERS", spec.published_params_source);
  }
  std::cout << fmt::format("  embedding {}, {} blocks {}, head {}\n",
                           format_count(embedding_params), spec.layers, format_count(block_params),
                           format_count(head_params));
  if (spec.moe) {
    std::cout << fmt::format(
        "  activated per token: {} ({:.1f}% of them: {} of {} experts a block{}{}{}, the "
        "embedding and head included)\n",
        format_si(active + tables), 100 * (active + tables) / static_cast<double>(totals.params),
        spec.moe->top_k, spec.moe->experts, spec.mixed_blocks() ? " with experts" : "",
        spec.shared_ffn() > 0 ? " and the shared ones" : "",
        spec.mixed_blocks() ? ", the dense blocks whole" : "");
  }
  std::cout << fmt::format(
      "\ntraining FLOPs per token at seq_len {}: {} (forward {}; Kaplan et al.'s 6N, N = {} {}"
      "non-embedding params: {})\n",
      seq, format_si(train_per_token), format_si(fwd_per_token), format_si(active),
      spec.moe ? "active " : "", format_si(6.0 * active));
  if (spec.is_megatron_gpt()) {
    std::cout << fmt::format(
        "  Megatron-LM formula 72·l·h²·(1 + s/6h + V/12lh): {}; with full recompute (Eq. 3, "
        "96·l·h²·(...)): {}\n",
        format_si(model::megatron_train_flops_per_token(spec, seq, false)),
        format_si(model::megatron_train_flops_per_token(spec, seq, true)));
  }
  if (padded_per_token) {
    std::cout << fmt::format(
        "  trained with the {} ({} per token; at tp > 1 the multiple grows with tp: dtsim "
        "simulate says)\n",
        *plan::vocab_padding_note(spec, tp1), format_si(*padded_per_token));
  }
  std::cout << "  (2 FLOPs per multiply-add; matrix multiplications only; dense attention)\n\n";

  report::Table table({"layer", "params", "fwd FLOPs/token", "saved activations/sequence"});
  table.set_units({"", "", "", "MiB (16-bit, no recompute, no parallelism)"});
  table.align_left(0);
  // Identical consecutive blocks are shown as one row ("0-31").
  int first = 0;
  for (int l = -1; l <= spec.layers; ++l) {
    const model::GraphTotals t = graph.layer_totals(l);
    const bool block = l >= 0 && l < spec.layers;
    if (block && l + 1 < spec.layers) {
      const model::GraphTotals next = graph.layer_totals(l + 1);
      if (next.params == t.params && next.fwd_flops == t.fwd_flops &&
          next.saved_bytes == t.saved_bytes) {
        continue;
      }
    }
    std::string label = group_name(l, spec.layers);
    if (block && first != l) label = fmt::format("{}-{}", first, l);
    table.add_row({label, format_count(t.params), format_si(t.fwd_flops / tokens),
                   fmt::format("{:.1f}", static_cast<double>(t.saved_bytes) / kMiB)});
    first = l + 1;
  }
  std::cout << table.render();
  return 0;
}

}  // namespace dtsim::cli
