#include "sim/plan/plan.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <numeric>

#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"

namespace dtsim::plan {

using nlohmann::json;

std::string_view to_string(Schedule s) {
  switch (s) {
    case Schedule::GPipe:
      return "gpipe";
    case Schedule::OneFOneB:
      return "1f1b";
    case Schedule::Interleaved:
      return "interleaved";
    case Schedule::ZeroBubble:
      return "zero-bubble";
    case Schedule::PipeDreamAsync:
      return "pipedream";
  }
  return "?";
}

std::string_view to_string(Recompute r) {
  switch (r) {
    case Recompute::None:
      return "none";
    case Recompute::Selective:
      return "selective";
    case Recompute::Full:
      return "full";
  }
  return "?";
}

std::string_view to_string(Optimizer o) {
  return o == Optimizer::Adam ? "adam" : "sgd";
}

bool parse_schedule(std::string_view text, Schedule& out) {
  for (Schedule s : {Schedule::GPipe, Schedule::OneFOneB, Schedule::Interleaved,
                     Schedule::ZeroBubble, Schedule::PipeDreamAsync}) {
    if (to_string(s) == text) {
      out = s;
      return true;
    }
  }
  return false;
}

bool parse_recompute(std::string_view text, Recompute& out) {
  for (Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
    if (to_string(r) == text) {
      out = r;
      return true;
    }
  }
  return false;
}

bool parse_optimizer(std::string_view text, Optimizer& out) {
  for (Optimizer o : {Optimizer::Adam, Optimizer::Sgd}) {
    if (to_string(o) == text) {
      out = o;
      return true;
    }
  }
  return false;
}

std::int64_t padded_vocab(std::int64_t vocab, const Plan& plan) {
  const std::int64_t multiple = std::int64_t{plan.make_vocab_size_divisible_by} * plan.tp;
  DTSIM_ASSERT(multiple > 0, "a positive vocabulary multiple");
  return (vocab + multiple - 1) / multiple * multiple;
}

model::ModelSpec with_padded_vocab(model::ModelSpec spec, const Plan& plan) {
  const std::int64_t rows = padded_vocab(spec.vocab, plan);
  spec.padded_vocab = rows == spec.vocab ? 0 : rows;
  return spec;
}

std::optional<std::string> vocab_padding_note(const model::ModelSpec& spec, const Plan& plan) {
  const std::int64_t rows = padded_vocab(spec.vocab, plan);
  if (rows == spec.vocab) return std::nullopt;
  return fmt::format(
      "vocabulary {} padded to {} rows of the embedding and LM head (a multiple of {} x tp {}, "
      "as Megatron-LM pads it; --make-vocab-size-divisible-by)",
      spec.vocab, rows, plan.make_vocab_size_divisible_by, plan.tp);
}

std::optional<std::string> sliding_window_note(const model::ModelSpec& model,
                                               std::int64_t seq_len) {
  const auto window = model.unmodelled_sliding_window;
  if (!window || seq_len <= *window) return std::nullopt;
  return fmt::format(
      "{}'s {} of {} tokens is not modelled: attention is priced as full causal attention over "
      "all {} (its keys per query at most {})",
      model.name, model.unmodelled_window_kind, *window, seq_len, *window);
}

std::optional<std::string> uneven_layers_note(const model::ModelSpec& spec, const Plan& plan) {
  const std::int64_t chunks = std::int64_t{plan.pp} * plan.virtual_stages;
  if (!plan.layers_per_stage.empty() || chunks <= 1 || spec.layers % chunks == 0) {
    return std::nullopt;
  }
  const std::int64_t fewer = spec.layers / chunks, more = chunks - spec.layers % chunks;
  return fmt::format(
      "{} layers over {} {}: {} of {} and {} of {}, the first taking one more "
      "(--layers-per-stage sets them)",
      spec.layers, chunks,
      plan.virtual_stages > 1
          ? fmt::format("chunks (pp {} x {} virtual stages)", plan.pp, plan.virtual_stages)
          : std::string("pipeline stages"),
      chunks - more, fewer + 1, more, fewer);
}

std::string summary(const Plan& p) {
  std::string s = fmt::format("dp={} tp={} pp={}", p.dp, p.tp, p.pp);
  if (p.cp > 1) s += fmt::format(" cp={}", p.cp);
  if (p.ep > 1) s += fmt::format(" ep={}", p.ep);
  // (A global batch of 0: not derived, its product too large; the plan's errors say why.)
  s += fmt::format(
      " mbs={} gbs={} {}", p.micro_batch_size,
      p.global_batch_size == 0 ? std::string("?") : fmt::format("{}", p.global_batch_size),
      to_string(p.schedule));
  if (p.virtual_stages > 1) s += fmt::format(" v={}", p.virtual_stages);
  if (!p.layers_per_stage.empty()) {
    // Runs of three or more alike as "2(x62)": 64 chunks' counts stay readable.
    std::vector<std::string> runs;
    const auto& l = p.layers_per_stage;
    for (std::size_t i = 0, j = 0; i < l.size(); i = j) {
      while (j < l.size() && l[j] == l[i]) ++j;
      if (j - i >= 3) {
        runs.push_back(fmt::format("{}(x{})", l[i], j - i));
      } else {
        for (std::size_t k = i; k < j; ++k) runs.push_back(fmt::format("{}", l[k]));
      }
    }
    s += fmt::format(" layers={}", fmt::join(runs, ","));
  }
  if (p.zero_stage > 0) s += fmt::format(" zero={}", p.zero_stage);
  if (p.recompute != Recompute::None) s += fmt::format(" recompute={}", to_string(p.recompute));
  if (p.attention == model::AttentionKernel::Flash) s += " flash";
  if (p.sequence_parallel) s += " sp";
  if (!p.overlap_grad_reduce) s += " no-overlap-grad-reduce";
  if (p.overlap_param_gather) s += " overlap-param-gather";
  if (p.zero_in_place) s += " zero-in-place";
  if (!p.overlap_tp_backward && p.tp > 1) s += " no-overlap-tp-backward";
  if (!p.grad_accumulation_fusion) s += " no-grad-accumulation-fusion";
  if (p.overlap_p2p_comm) s += " overlap-p2p-comm";
  if (p.scatter_gather_p2p) s += " scatter-gather-p2p";
  if (p.make_vocab_size_divisible_by != kDefaultVocabMultiple) {
    s += fmt::format(" vocab-multiple={}", p.make_vocab_size_divisible_by);
  }
  s += fmt::format(" {}", to_string(p.precision));
  if (p.grad_precision) s += fmt::format(" grads={}", to_string(*p.grad_precision));
  if (p.comm_precision) s += fmt::format(" comm={}", to_string(*p.comm_precision));
  if (p.grad_compression < 1) s += fmt::format(" grad-compression={:g}", p.grad_compression);
  if (p.expert_load != 1) s += fmt::format(" expert-load={}", p.expert_load);
  if (p.clip_grad > 0) s += fmt::format(" clip-grad={:g}", p.clip_grad);
  return s;
}

Precision gradient_precision(const Plan& plan) {
  if (plan.grad_precision) return *plan.grad_precision;
  switch (plan.precision) {
    case Precision::Bf16:
    case Precision::Fp8:
    case Precision::Fp32:
    case Precision::Tf32:
      return Precision::Fp32;
    case Precision::Fp16:
      return Precision::Fp16;
  }
  return Precision::Fp32;
}

std::vector<int> chunk_layers(const Plan& plan, std::int64_t layers) {
  const std::size_t chunks = static_cast<std::size_t>(plan.pp) * plan.virtual_stages;
  if (!plan.layers_per_stage.empty()) return plan.layers_per_stage;
  std::vector<int> out(chunks, static_cast<int>(layers / static_cast<std::int64_t>(chunks)));
  const auto extra = static_cast<std::size_t>(layers % static_cast<std::int64_t>(chunks));
  for (std::size_t i = 0; i < extra; ++i) ++out[i];
  return out;
}

namespace {

// The rules of check_plan. Without `dp_known` (complete_plan could not derive dp) the rules
// that read dp are left out: devices, ep-dp, batch, and interleaved-m, which needs the batch.
PlanCheck check_rules(const Plan& p, const model::ModelSpec& m, std::int64_t devices,
                      bool dp_known) {
  PlanCheck check;
  auto error = [&](std::string rule, std::string message) {
    check.errors.push_back({std::move(rule), std::move(message)});
  };
  if ((dp_known && p.dp < 1) || p.tp < 1 || p.pp < 1 || p.cp < 1 || p.ep < 1) {
    error("positive-degrees", "dp, tp, pp, cp and ep must all be >= 1");
    return check;
  }
  // In double, exact below 2^53: the product of four ints cannot wrap around.
  const double product = static_cast<double>(p.dp) * p.tp * p.pp * p.cp;
  if (dp_known && product != static_cast<double>(devices)) {
    error("devices", fmt::format("dp x tp x pp x cp = {} x {} x {} x {} = {:.0f} but the cluster "
                                 "has {} devices",
                                 p.dp, p.tp, p.pp, p.cp, product, devices));
  }
  // Bounds micro-batch x seq_len (so micro-batch x dp below cannot wrap around).
  const std::string size = model::size_problem(m, p.micro_batch_size, p.seq_len);
  if (!size.empty()) error("size", size);
  if (m.heads % p.tp != 0) {
    error("tp-heads", fmt::format("tp = {} does not divide {} attention heads", p.tp, m.heads));
  }
  if (m.kv_heads % p.tp != 0) {
    error("tp-kv-heads",
          fmt::format("tp = {} does not divide {} key/value heads", p.tp, m.kv_heads));
  }
  // Megatron-LM splits the MLP's inner dimension over tp (column- then row-parallel).
  for (const auto& [name, width] : m.mlp_widths()) {
    if (width % p.tp != 0) {
      error("tp-ffn", fmt::format("tp = {} does not divide {} = {}", p.tp, name, width));
    }
  }
  if (p.seq_len < 1 || p.seq_len > m.max_positions) {
    error("seq-len", fmt::format("seq_len = {} must be in 1..{} (the model's max_positions)",
                                 p.seq_len, m.max_positions));
  }
  if (!cp_splits_sequence(p.seq_len, p.cp)) {
    error("cp-seq", fmt::format("2 x cp = {} does not divide seq_len = {} (each cp rank takes two "
                                "of 2 x cp chunks of a sequence)",
                                2 * p.cp, p.seq_len));
  }
  if (p.sequence_parallel && p.tp < 2) {
    error("sp-needs-tp", "sequence parallelism needs tp > 1");
  }
  if (p.scatter_gather_p2p && (p.tp < 2 || p.sequence_parallel)) {
    error("scatter-gather",
          "scatter/gather of pipeline transfers needs tp > 1 without sequence parallelism (which "
          "already sends 1/tp of the tensor)");
  }
  if (p.sequence_parallel && (p.seq_len / p.cp) % p.tp != 0) {
    error("sp-seq", fmt::format("sequence parallelism needs tp = {} to divide the sequence "
                                "length per cp rank ({})",
                                p.tp, p.seq_len / p.cp));
  }
  if (const auto why = clip_grad_problem(p.clip_grad)) {
    error("clip-grad", fmt::format("gradient clipping at norm {:g}: {}", p.clip_grad, *why));
  }
  if (!(p.grad_compression >= kLeastGradCompression && p.grad_compression <= 1)) {
    error("grad-compression",
          fmt::format("gradient compression {:g}: expected the fraction of the bytes sent, from "
                      "{:g} to 1",
                      p.grad_compression, kLeastGradCompression));
  }
  if (!(p.expert_load >= 1 && p.expert_load <= max_expert_load(m, p))) {
    if (p.ep > 1 && m.moe) {
      // Why routing bounds it, where ep splits the experts evenly (else the ep rule says so).
      const std::string why =
          m.moe->experts % p.ep == 0
              ? fmt::format(
                    " (a token sends one copy to each of its top {} of the {} experts, "
                    "and a rank at ep {} holds {} of them)",
                    m.moe->top_k, m.moe->experts, p.ep, m.moe->experts / p.ep)
              : std::string();
      error("expert-load",
            fmt::format("expert load {}: expected the busiest ep rank's token copies over the "
                        "even share, in [1, {:g}]{}",
                        p.expert_load, max_expert_load(m, p), why));
    } else if (!(p.expert_load >= 1)) {
      error("expert-load", fmt::format("expert load {}: {}, 1 without expert parallelism",
                                       p.expert_load, kExpertLoadExpected));
    } else if (!m.moe) {
      error("expert-load", fmt::format("expert load {} needs a mixture of experts; {} has none",
                                       p.expert_load, m.name));
    } else {
      error("expert-load", fmt::format("expert load {} needs experts split over ep > 1 (one "
                                       "rank holds every expert, so its share is even)",
                                       p.expert_load));
    }
  }
  if (p.overlap_param_gather && p.zero_stage != 1 && p.zero_stage != 2) {
    error("overlap-param-gather",
          fmt::format(
              "overlap_param_gather overlaps ZeRO-1/2's all-gather of the updated weights "
              "(Megatron-LM's distributed optimizer); with ZeRO-{} there is none{}",
              p.zero_stage,
              p.zero_stage == 3 ? " (ZeRO-3 gathers each block's weights ahead already)" : ""));
  }
  if (p.zero_in_place && p.zero_stage != 1) {
    error("zero-in-place",
          fmt::format("zero_in_place is ZeRO-1 as Megatron-LM's distributed optimizer runs it "
                      "(its gradients and weights in contiguous buffers); ZeRO-{} has no such "
                      "form here (Megatron-FSDP is not modelled)",
                      p.zero_stage));
  }
  if (!p.overlap_grad_reduce && p.zero_stage >= 2) {
    error("no-overlap-zero",
          fmt::format("ZeRO-{} reduce-scatters the gradients of every micro-batch as backward "
                      "produces them (that is what frees them); without overlap use ZeRO-0 or 1",
                      p.zero_stage));
  }
  if (p.ep > 1 && !m.moe)
    error("ep-needs-moe", fmt::format("ep = {} but {} has no experts", p.ep, m.name));
  if (dp_known && p.dp % p.ep != 0) {
    error("ep-dp", fmt::format("ep = {} must divide dp = {} (experts are spread over data-"
                               "parallel ranks)",
                               p.ep, p.dp));
  }
  if (m.moe && m.moe->experts % p.ep != 0) {
    error("ep-experts", fmt::format("ep = {} does not divide {} experts", p.ep, m.moe->experts));
  }
  // With one micro-batch's tokens bounded (the "size" rule), micro-batch x dp cannot wrap;
  // otherwise the batch is not checked ("size" says what is wrong).
  const bool bounded = dp_known && size.empty() && p.seq_len >= 1;
  bool batch_ok = false;
  if (bounded && (p.micro_batch_size < 1 || p.global_batch_size < 1)) {
    error("batch", "micro-batch and global batch sizes must be >= 1");
  } else if (bounded && p.global_batch_size % (p.micro_batch_size * p.dp) != 0) {
    error("batch", fmt::format("global batch {} is not micro-batch {} x dp {} x a whole number of "
                               "micro-batches",
                               p.global_batch_size, p.micro_batch_size, p.dp));
  } else if (bounded && p.micro_batches() > kMaxMicroBatches) {
    error("batch",
          fmt::format("{} micro-batches per step exceed dtsim's limit of 2^24", p.micro_batches()));
  } else {
    batch_ok = bounded;
  }
  if (p.zero_stage < 0 || p.zero_stage > 3) {
    error("zero", fmt::format("zero stage {} is not one of 0, 1, 2, 3", p.zero_stage));
  }
  if (p.virtual_stages < 1) error("virtual-stages", "virtual stages must be >= 1");
  if (p.schedule == Schedule::Interleaved) {
    if (p.pp < 2) error("interleaved-pp", "the interleaved schedule needs pp > 1");
    if (p.virtual_stages < 2) {
      error("interleaved-v", "the interleaved schedule needs --virtual-stages >= 2");
    }
    if (batch_ok && p.micro_batches() % p.pp != 0) {
      error("interleaved-m", fmt::format("the interleaved schedule needs the number of "
                                         "micro-batches ({}) to be divisible by pp = {}",
                                         p.micro_batches(), p.pp));
    }
  } else if (p.virtual_stages != 1) {
    error("virtual-stages",
          fmt::format("--virtual-stages {} needs --schedule interleaved", p.virtual_stages));
  }
  const std::int64_t chunks = std::int64_t{p.pp} * p.virtual_stages;
  if (p.layers_per_stage.empty()) {
    if (chunks > m.layers) {
      error("layers", fmt::format("pp x virtual stages = {} exceeds the model's {} layers", chunks,
                                  m.layers));
    }
  } else {
    if (static_cast<std::int64_t>(p.layers_per_stage.size()) != chunks) {
      error("layers", fmt::format("layers_per_stage has {} entries, expected pp x virtual stages "
                                  "= {}",
                                  p.layers_per_stage.size(), chunks));
    }
    const std::int64_t sum =
        std::accumulate(p.layers_per_stage.begin(), p.layers_per_stage.end(), std::int64_t{0});
    bool positive = true;
    for (int n : p.layers_per_stage) positive = positive && n >= 1;
    if (!positive) error("layers", "every entry of layers_per_stage must be >= 1");
    if (sum != m.layers) {
      error("layers",
            fmt::format("layers_per_stage sums to {}, the model has {} layers", sum, m.layers));
    }
  }
  if (p.zero_stage >= 2 && p.pp > 1) {
    check.warnings.push_back(fmt::format(
        "ZeRO-{} with pipeline parallelism is unusual: gradients are reduce-scattered (and "
        "weights gathered) once per micro-batch instead of once per step",
        p.zero_stage));
  }
  if (p.schedule == Schedule::ZeroBubble && p.pp == 1) {
    check.warnings.push_back(
        "the zero-bubble schedule at pp 1 has no bubble to fill: it still splits each backward "
        "pass into input gradients and then weight gradients, so the dp reduction, which starts "
        "with the weight gradients, overlaps less of it than under 1f1b");
  }
  if (p.recompute == Recompute::Selective && p.attention == model::AttentionKernel::Flash) {
    check.warnings.push_back(
        "selective recompute with FlashAttention runs each attention core's forward again for "
        "almost nothing: FlashAttention keeps no s² tensor to drop (Megatron-LM still does it "
        "when asked)");
  }
  return check;
}

}  // namespace

PlanCheck check_plan(const Plan& p, const model::ModelSpec& m, std::int64_t devices) {
  return check_rules(p, m, devices, /*dp_known=*/true);
}

std::vector<std::string> require_valid(const Plan& plan, const model::ModelSpec& model,
                                       std::int64_t devices) {
  PlanCheck check = check_plan(plan, model, devices);
  if (!check.ok()) {
    std::string msg = fmt::format("invalid plan ({}):", summary(plan));
    for (const auto& v : check.errors) msg += fmt::format("\n  - {} [{}]", v.message, v.rule);
    throw InputError(msg);
  }
  return check.warnings;
}

std::vector<std::string> complete_plan(Plan& plan, const model::ModelSpec& model,
                                       std::int64_t devices) {
  std::vector<std::string> notes;
  if (plan.dp == 0) {
    // In double: three ints may not fit a 64-bit product.
    const double others = static_cast<double>(plan.tp) * plan.pp * plan.cp;
    if (others < 1 || others > static_cast<double>(devices) ||
        devices % static_cast<std::int64_t>(others) != 0) {
      const std::string derive =
          fmt::format("cannot derive dp: tp x pp x cp = {:.0f} does not divide the {} devices",
                      others, devices);
      if (others < 1) throw InputError(derive);
      // With it, every rule that does not read dp, so that every broken rule is said at once.
      Plan probe = plan;
      if (probe.seq_len == 0) probe.seq_len = model.seq_len;
      std::string msg =
          fmt::format("invalid plan (tp={} pp={} cp={} on {} devices):\n  - {} [devices]", plan.tp,
                      plan.pp, plan.cp, devices, derive);
      for (const auto& v : check_rules(probe, model, devices, /*dp_known=*/false).errors) {
        msg += fmt::format("\n  - {} [{}]", v.message, v.rule);
      }
      throw InputError(msg);
    }
    plan.dp = static_cast<int>(devices / static_cast<std::int64_t>(others));
    notes.push_back(fmt::format("dp = {} (devices / (tp x pp x cp))", plan.dp));
  }
  if (plan.seq_len == 0) {
    plan.seq_len = model.seq_len;
    notes.push_back(fmt::format("seq_len = {} (the model's default)", plan.seq_len));
  }
  if (auto note = sliding_window_note(model, plan.seq_len)) notes.push_back(std::move(*note));
  const std::int64_t m = plan.pp > 1 ? 4 * std::int64_t{plan.pp} : 1;
  // Left unset when the product would wrap around: check_plan then reports the oversized
  // micro-batch ("size") or degrees ("devices").
  const double batch = static_cast<double>(plan.micro_batch_size) * plan.dp * m;
  if (plan.global_batch_size == 0 && batch <= 4611686018427387904.0) {  // 2^62
    plan.global_batch_size = plan.micro_batch_size * plan.dp * m;
    notes.push_back(
        fmt::format("global batch = {} ({} micro-batch{} of {} sequence{} per data-parallel rank)",
                    plan.global_batch_size, m, m == 1 ? "" : "es", plan.micro_batch_size,
                    plan.micro_batch_size == 1 ? "" : "s"));
  }
  return notes;
}

double max_expert_load(const model::ModelSpec& spec, const Plan& plan) {
  if (!spec.moe || plan.ep <= 1) return 1.0;
  return std::min(static_cast<double>(plan.ep),
                  static_cast<double>(spec.moe->experts) / static_cast<double>(spec.moe->top_k));
}

bool moe_local_dispatch(const model::ModelSpec& spec, const Plan& plan) {
  return spec.moe.has_value() && plan.sequence_parallel && plan.tp > 1;
}

bool mlp_tp_enter(const model::ModelSpec& spec, const Plan& plan, const model::Op& op) {
  const bool local = moe_local_dispatch(spec, plan);
  return (op.kind == model::OpKind::Router && !local) ||
         (op.kind == model::OpKind::MlpUp && !op.expert && (!spec.has_experts(op.layer) || local));
}

bool mlp_tp_exit(const model::ModelSpec& spec, const Plan& plan, const model::Op& op) {
  return op.kind == model::OpKind::MlpDown &&
         (!op.expert || (!moe_local_dispatch(spec, plan) && spec.shared_ffn() == 0));
}

std::uint64_t cp_kv_bytes(const model::ModelSpec& spec, const Plan& plan,
                          std::uint64_t hidden_bytes) {
  const auto width =
      static_cast<std::uint64_t>(spec.kv_width() / plan.tp + spec.v_width() / plan.tp);
  return static_cast<std::uint64_t>(plan.cp) *
         (hidden_bytes / static_cast<std::uint64_t>(spec.hidden)) * width;
}

std::uint64_t tp_enter_bytes(const model::ModelSpec& spec, const model::Op& op,
                             std::uint64_t hidden_bytes) {
  if (op.tp_enter_width == 0) return hidden_bytes;
  return hidden_bytes / static_cast<std::uint64_t>(spec.hidden) * op.tp_enter_width;
}

std::uint64_t tp_regather_bytes(const model::ModelSpec& spec, const model::Op& op,
                                std::uint64_t hidden_bytes) {
  // (hidden_bytes is a whole number of tokens x h elements: exact.)
  return hidden_bytes / static_cast<std::uint64_t>(spec.hidden) *
         static_cast<std::uint64_t>(op.gemm_k);
}

bool sp_partial_gradients(const model::ModelSpec& spec, const Plan& plan, const model::Op& op) {
  return op.kind == model::OpKind::Norm || op.kind == model::OpKind::LatentDown ||
         (op.kind == model::OpKind::Router && moe_local_dispatch(spec, plan));
}

std::uint64_t expert_copies_bytes(const model::ModelSpec& spec, const Plan& plan,
                                  std::uint64_t hidden_bytes) {
  const std::uint64_t even =
      hidden_bytes * static_cast<std::uint64_t>(spec.moe ? spec.moe->top_k : 1);
  return static_cast<std::uint64_t>(std::llround(static_cast<double>(even) * plan.expert_load));
}

std::uint64_t ep_all_to_all_bytes(const model::ModelSpec& spec, const Plan& plan,
                                  std::uint64_t hidden_bytes) {
  const std::uint64_t tp = moe_local_dispatch(spec, plan) ? static_cast<std::uint64_t>(plan.tp) : 1;
  return expert_copies_bytes(spec, plan, hidden_bytes / tp);
}

json to_json(const Plan& p) {
  json j = {{"dp", p.dp},
            {"tp", p.tp},
            {"pp", p.pp},
            {"cp", p.cp},
            {"ep", p.ep},
            {"micro_batch_size", p.micro_batch_size},
            {"global_batch_size", p.global_batch_size},
            {"seq_len", p.seq_len},
            {"schedule", to_string(p.schedule)},
            {"virtual_stages", p.virtual_stages},
            {"zero_stage", p.zero_stage},
            {"recompute", to_string(p.recompute)},
            {"attention", model::to_string(p.attention)},
            {"sequence_parallel", p.sequence_parallel},
            {"overlap_grad_reduce", p.overlap_grad_reduce},
            {"overlap_param_gather", p.overlap_param_gather},
            {"zero_in_place", p.zero_in_place},
            {"overlap_tp_backward", p.overlap_tp_backward},
            {"grad_accumulation_fusion", p.grad_accumulation_fusion},
            {"overlap_p2p_comm", p.overlap_p2p_comm},
            {"scatter_gather_p2p", p.scatter_gather_p2p},
            {"make_vocab_size_divisible_by", p.make_vocab_size_divisible_by},
            {"precision", to_string(p.precision)},
            {"optimizer", to_string(p.optimizer)},
            {"order", cluster::Placement::to_string(p.order)}};
  if (!p.layers_per_stage.empty()) j["layers_per_stage"] = p.layers_per_stage;
  if (p.grad_precision) j["grad_precision"] = to_string(*p.grad_precision);
  if (p.comm_precision) j["comm_precision"] = to_string(*p.comm_precision);
  if (p.grad_compression != 1.0) j["grad_compression"] = p.grad_compression;
  if (p.expert_load != 1.0) j["expert_load"] = p.expert_load;
  if (p.clip_grad > 0) j["clip_grad"] = p.clip_grad;
  return j;
}

std::optional<std::string> clip_grad_problem(double norm) {
  if (norm == 0 || (norm >= kSmallestFigure && norm <= kLargestFigure)) return std::nullopt;
  return fmt::format("expected a norm from {:g} to {:g}, or 0 for none", kSmallestFigure,
                     kLargestFigure);
}

std::optional<double> plan_file_spread(const json& j, const std::string& file,
                                       std::string_view key) {
  if (!j.is_object() || !JsonReader(j, file).has(key)) return std::nullopt;
  const JsonReader r(j, file);
  const json& v = j.at(key);
  const double cv = v.is_number() ? v.get<double>() : -1;
  if (!(cv >= 0 && cv < 1)) {
    r.fail(key, fmt::format("expected a fraction in [0, 1) (a whatif point's {}), got {}", key,
                            describe_json_value(v)));
  }
  return cv;
}

Plan plan_from_json(const json& j, const std::string& file) {
  refuse_other_kind(j, file, "plan");
  const JsonReader r(j, file);
  r.expect_only({"dp", "tp", "pp", "cp", "ep", "micro_batch_size", "global_batch_size", "seq_len",
                 "schedule", "virtual_stages", "zero_stage", "recompute", "attention",
                 "sequence_parallel", "overlap_grad_reduce", "overlap_param_gather",
                 "zero_in_place", "overlap_tp_backward", "grad_accumulation_fusion",
                 "overlap_p2p_comm", "scatter_gather_p2p", "make_vocab_size_divisible_by",
                 "precision", "grad_precision", "comm_precision", "grad_compression", "expert_load",
                 "clip_grad", "optimizer", "layers_per_stage", "order",
                 // What dtsim plan --out made it for, which the tools take where --model and
                 // --cluster are not given, what a whatif point changed in that cluster, the
                 // straggler figures it set, the profile that timed it, a model without
                 // dropout, the memory figures it fit in and the network model that ranked it (not
                 // the plan's: read by the CLI).
                 "model", "cluster", "cluster_changes", "jitter_cv", "rank_spread_cv", "profile",
                 "no_dropout", "device_memory_gib", "framework_overhead_gib", "network"});
  if (r.has("no_dropout")) r.boolean("no_dropout");  // (a boolean, or an error naming it)
  if (r.has("network")) r.choice("network", {"analytical", "simgrid"});
  if (r.has("device_memory_gib")) r.positive_number("device_memory_gib");
  if (r.has("framework_overhead_gib")) r.non_negative_number("framework_overhead_gib");
  for (const char* made_for : {"model", "cluster", "profile"}) {
    if (r.has(made_for)) r.string(made_for);  // a string, or an error naming the field
  }
  if (r.has("cluster_changes") && !j.at("cluster_changes").is_object()) {
    r.fail("cluster_changes", "expected an object (a whatif point's cluster values)");
  }
  for (const char* spread : {"jitter_cv", "rank_spread_cv"}) plan_file_spread(j, file, spread);
  Plan p;
  auto degree = [&](std::string_view key, int fallback) {
    return static_cast<int>(r.positive_int_up_to_or(key, kMaxDegree, fallback));
  };
  p.dp = degree("dp", 0);
  p.tp = degree("tp", 1);
  p.pp = degree("pp", 1);
  p.cp = degree("cp", 1);
  p.ep = degree("ep", 1);
  p.micro_batch_size = r.positive_int_or("micro_batch_size", 1);
  p.global_batch_size = r.positive_int_or("global_batch_size", 0);
  p.seq_len = r.positive_int_or("seq_len", 0);
  if (r.has("schedule") && !parse_schedule(r.choice("schedule", {"gpipe", "1f1b", "interleaved",
                                                                 "zero-bubble", "pipedream"}),
                                           p.schedule)) {
    r.fail("schedule", "unknown schedule");
  }
  p.virtual_stages = degree("virtual_stages", 1);
  if (r.has("zero_stage")) {
    const json& z = r.raw().at("zero_stage");
    // (1.0 is refused with the rest: a stage is written as an integer.)
    if (!z.is_number_integer() || z.get<std::int64_t>() < 0 || z.get<std::int64_t>() > 3) {
      r.fail("zero_stage", fmt::format("expected 0, 1, 2 or 3, got {}", describe_json_value(z)));
    }
    p.zero_stage = z.get<int>();
  }
  if (r.has("recompute")) {
    parse_recompute(r.choice("recompute", {"none", "selective", "full"}), p.recompute);
  }
  if (r.has("attention")) {
    model::parse_attention_kernel(r.choice("attention", {"unfused", "flash"}), p.attention);
  }
  p.sequence_parallel = r.boolean_or("sequence_parallel", false);
  p.overlap_grad_reduce = r.boolean_or("overlap_grad_reduce", true);
  p.overlap_param_gather = r.boolean_or("overlap_param_gather", false);
  p.zero_in_place = r.boolean_or("zero_in_place", false);
  p.overlap_tp_backward = r.boolean_or("overlap_tp_backward", true);
  p.grad_accumulation_fusion = r.boolean_or("grad_accumulation_fusion", true);
  p.overlap_p2p_comm = r.boolean_or("overlap_p2p_comm", false);
  p.scatter_gather_p2p = r.boolean_or("scatter_gather_p2p", false);
  p.make_vocab_size_divisible_by = static_cast<int>(r.positive_int_up_to_or(
      "make_vocab_size_divisible_by", kMaxVocabMultiple, p.make_vocab_size_divisible_by));
  if (r.has("precision")) {
    p.precision = *parse_precision(r.choice("precision", {"fp32", "tf32", "bf16", "fp16", "fp8"}));
  }
  if (r.has("grad_precision")) {
    p.grad_precision = *parse_precision(r.choice("grad_precision", {"fp32", "bf16", "fp16"}));
  }
  if (r.has("comm_precision")) {
    p.comm_precision =
        *parse_precision(r.choice("comm_precision", {"fp32", "tf32", "bf16", "fp16", "fp8"}));
  }
  if (r.has("grad_compression")) {
    p.grad_compression = r.positive_number("grad_compression");
    if (!(p.grad_compression >= kLeastGradCompression && p.grad_compression <= 1)) {
      r.fail("grad_compression", fmt::format("expected the fraction of the gradient bytes sent, "
                                             "from {:g} to 1, got {:g}",
                                             kLeastGradCompression, p.grad_compression));
    }
  }
  if (r.has("expert_load")) {
    p.expert_load = r.positive_number("expert_load");
    if (p.expert_load < 1) {
      r.fail("expert_load", std::string(kExpertLoadExpected));
    }
  }
  if (r.has("clip_grad")) p.clip_grad = r.non_negative_number("clip_grad");
  if (r.has("optimizer")) parse_optimizer(r.choice("optimizer", {"adam", "sgd"}), p.optimizer);
  if (r.has("layers_per_stage")) {
    for (std::int64_t n : r.positive_int_array_up_to("layers_per_stage", kMaxDegree)) {
      p.layers_per_stage.push_back(static_cast<int>(n));
    }
  }
  if (r.has("order")) {
    try {
      p.order = cluster::Placement::parse_order(r.string("order"));
    } catch (const InputError& e) {
      r.fail("order", e.what());
    }
  }
  return p;
}

Plan load_plan(const std::string& path) {
  return plan_from_json(JsonReader::parse_file(path), path);
}

}  // namespace dtsim::plan
