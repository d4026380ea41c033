#include "sim/plan/plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "sim/common/error.hpp"
#include "sim/model/model_graph.hpp"
#include "tests/test_util.hpp"

using dtsim::InputError;
using dtsim::model::load_model;
using dtsim::plan::check_plan;
using dtsim::plan::Plan;
using dtsim::plan::Schedule;

namespace {
Plan base_plan() {
  Plan p;
  p.dp = 4;
  p.tp = 8;
  p.pp = 2;
  p.micro_batch_size = 1;
  p.global_batch_size = 64;
  p.seq_len = 2048;
  return p;
}

bool has_rule(const dtsim::plan::PlanCheck& c, const std::string& rule, const std::string& text) {
  for (const auto& v : c.errors) {
    if (v.rule == rule && v.message.find(text) != std::string::npos) return true;
  }
  return false;
}
}  // namespace

TEST_CASE("a valid plan passes", "[plan]") {
  const auto m = load_model("megatron-18.4b");  // 48 heads, 40 layers
  CHECK(check_plan(base_plan(), m, 64).ok());
}

TEST_CASE("each broken rule says which one and why", "[plan][bad-input]") {
  const auto m = load_model("llama2-70b");  // 64 heads, 8 KV heads, 80 layers
  Plan p = base_plan();
  p.seq_len = 4096;
  SECTION("devices") {
    CHECK(has_rule(check_plan(p, m, 128), "devices", "= 64 but the cluster has 128 devices"));
  }
  SECTION("tp must divide heads") {
    p.tp = 3;
    p.dp = 1;
    const auto c = check_plan(p, m, 6);
    CHECK(has_rule(c, "tp-heads", "tp = 3 does not divide 64 attention heads"));
    CHECK(has_rule(c, "tp-kv-heads", "tp = 3 does not divide 8 key/value heads"));
  }
  SECTION("tp must divide kv heads") {
    p.tp = 16;
    p.dp = 2;
    CHECK(has_rule(check_plan(p, m, 64), "tp-kv-heads", "does not divide 8 key/value heads"));
  }
  SECTION("scatter/gather of pipeline transfers needs tp > 1 without sequence parallelism") {
    p.scatter_gather_p2p = true;
    CHECK(check_plan(p, m, 64).ok());
    p.sequence_parallel = true;
    CHECK(has_rule(check_plan(p, m, 64), "scatter-gather", "needs tp > 1 without sequence"));
    p.sequence_parallel = false;
    p.tp = 1;
    p.dp = 32;
    CHECK(has_rule(check_plan(p, m, 64), "scatter-gather", "needs tp > 1"));
  }
  SECTION("gradient compression is a fraction of the bytes") {
    p.grad_compression = 1.5;
    CHECK(has_rule(
        check_plan(p, m, 64), "grad-compression",
        "gradient compression 1.5: expected the fraction of the bytes sent, from 1e-06 to 1"));
  }
  SECTION("an expert load above 1 needs experts, split over ep > 1") {
    p.expert_load = 1.5;
    CHECK(has_rule(check_plan(p, m, 64), "expert-load",
                   "expert load 1.5 needs a mixture of experts; llama2-70b has none"));
    const auto mixtral = load_model("mixtral-8x7b");
    CHECK(has_rule(check_plan(p, mixtral, 64), "expert-load",
                   "expert load 1.5 needs experts split over ep > 1 (one rank holds every expert"));
  }
  SECTION("no overlapped gradient reduction with ZeRO-2/3") {
    p.overlap_grad_reduce = false;
    p.zero_stage = 1;
    CHECK(check_plan(p, m, 64).ok());
    p.zero_stage = 2;
    CHECK(has_rule(check_plan(p, m, 64), "no-overlap-zero",
                   "ZeRO-2 reduce-scatters the gradients of every micro-batch"));
  }
  SECTION("global batch") {
    p.global_batch_size = 30;
    CHECK(has_rule(check_plan(p, m, 64), "batch", "global batch 30"));
  }
  SECTION("interleaved needs micro-batches divisible by pp") {
    p.schedule = Schedule::Interleaved;
    p.virtual_stages = 2;
    p.pp = 4;
    p.dp = 2;
    p.global_batch_size = 6;  // 3 micro-batches
    CHECK(has_rule(check_plan(p, m, 64), "interleaved-m", "micro-batches (3)"));
  }
  SECTION("virtual stages need the interleaved schedule") {
    p.virtual_stages = 2;
    CHECK(has_rule(check_plan(p, m, 64), "virtual-stages", "needs --schedule interleaved"));
  }
  SECTION("sequence parallelism needs tp > 1") {
    p.tp = 1;
    p.dp = 32;
    p.sequence_parallel = true;
    CHECK(has_rule(check_plan(p, m, 64), "sp-needs-tp", "needs tp > 1"));
  }
  SECTION("explicit layer partition must add up") {
    p.layers_per_stage = {30, 40};
    CHECK(has_rule(check_plan(p, m, 64), "layers", "sums to 70, the model has 80 layers"));
  }
  SECTION("tp must divide the MLP width") {
    auto odd = m;
    odd.ffn_hidden = 28676;  // 4 x 7169
    CHECK(has_rule(check_plan(p, odd, 64), "tp-ffn", "tp = 8 does not divide ffn_hidden = 28676"));
    odd.moe = dtsim::test::mixture(8, 2, 1004);
    CHECK(has_rule(check_plan(p, odd, 64), "tp-ffn",
                   "tp = 8 does not divide expert_ffn_hidden = 1004"));
    odd.moe = dtsim::test::mixture(8, 2, 1024, 1004);  // shared experts' width
    CHECK(has_rule(check_plan(p, odd, 64), "tp-ffn",
                   "tp = 8 does not divide shared_ffn_hidden = 1004"));
  }
  SECTION("one micro-batch must stay within 2^31 tokens") {
    p.micro_batch_size = 1000000000000;  // 10^12 sequences
    p.global_batch_size = 4000000000000;
    const auto c = check_plan(p, m, 64);
    CHECK(has_rule(c, "size", "micro-batch x seq_len = 1000000000000 x 4096"));
    CHECK(has_rule(c, "size", "exceeds dtsim's limit of 2^31"));
  }
  SECTION("at most 2^24 micro-batches per step") {
    p.global_batch_size = std::int64_t{4} << 25;  // dp 4 x 2^25 micro-batches
    CHECK(has_rule(check_plan(p, m, 64), "batch", "33554432 micro-batches per step exceed"));
  }
  SECTION("huge degrees do not wrap around") {
    p.dp = p.tp = p.pp = 1 << 30;
    p.cp = 4;  // dp x tp x pp x cp = 2^92
    CHECK(has_rule(check_plan(p, m, 64), "devices", "but the cluster has 64 devices"));
    Plan q;
    q.dp = 0;
    q.tp = q.pp = q.cp = 1 << 30;
    DTSIM_REQUIRE_THROWS_CONTAINING(
        dtsim::plan::complete_plan(q, m, 64), InputError,
        "cannot derive dp: tp x pp x cp = 1237940039285380274899124224");
  }
  SECTION("expert parallelism needs experts") {
    p.ep = 2;
    CHECK(has_rule(check_plan(p, m, 64), "ep-needs-moe", "has no experts"));
  }
  SECTION("ZeRO-2 with pipelining is allowed but flagged") {
    p.zero_stage = 2;
    const auto c = check_plan(p, m, 64);
    CHECK(c.ok());
    REQUIRE(c.warnings.size() == 1);
    CHECK(c.warnings[0].find("unusual") != std::string::npos);
  }
  SECTION("require_valid lists every violation") {
    p.tp = 3;
    DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::plan::require_valid(p, m, 64), InputError,
                                    "tp = 3 does not divide 64 attention heads [tp-heads]");
  }
}

TEST_CASE("unset values get documented defaults", "[plan]") {
  const auto m = load_model("llama3-8b");
  Plan p;
  p.dp = 0;
  p.global_batch_size = 0;
  p.seq_len = 0;
  p.tp = 8;
  p.pp = 2;
  const auto notes = dtsim::plan::complete_plan(p, m, 64);
  CHECK(p.dp == 4);
  CHECK(p.seq_len == 8192);
  CHECK(p.micro_batches() == 8);  // 4 x pp
  CHECK(notes.size() == 3);
  Plan q;
  q.dp = 0;
  q.tp = 3;
  q.zero_stage = 9;
  // Every rule broken whatever dp would be is said with it; none that dp's value decides.
  try {
    dtsim::plan::complete_plan(q, m, 64);
    FAIL("no error");
  } catch (const InputError& e) {
    const std::string what = e.what();
    CHECK_THAT(what, Catch::Contains("cannot derive dp: tp x pp x cp = 3 does not divide the 64 "
                                     "devices [devices]"));
    CHECK_THAT(what, Catch::Contains("tp = 3 does not divide 32 attention heads [tp-heads]"));
    CHECK_THAT(what, Catch::Contains("zero stage 9 is not one of 0, 1, 2, 3 [zero]"));
    CHECK_THAT(what, !Catch::Contains("[batch]") && !Catch::Contains("dp x tp x pp x cp ="));
  }
}

// Megatron-LM's rule (megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding): the
// next multiple of make_vocab_size_divisible_by x tp.
TEST_CASE("the vocabulary is padded as Megatron-LM pads it", "[plan]") {
  using dtsim::plan::padded_vocab;
  Plan p;
  CHECK(padded_vocab(50257, p) == 50304);  // GPT-2: nanoGPT's and llm.c's padded size
  CHECK(padded_vocab(51200, p) == 51200);  // Megatron-LM's GPT-3 runs: already a multiple
  p.tp = 8;
  CHECK(padded_vocab(128256, p) == 129024);  // Llama 3 at tp 8: a multiple of 1024
  CHECK(padded_vocab(51200, p) == 51200);
  p.make_vocab_size_divisible_by = 1;
  CHECK(padded_vocab(50257, p) == 50264);  // a multiple of tp only
  p.tp = 1;
  CHECK(padded_vocab(50257, p) == 50257);

  auto spec = dtsim::model::load_model("gpt2-124m");
  p.make_vocab_size_divisible_by = 128;
  const auto padded = dtsim::plan::with_padded_vocab(spec, p);
  CHECK(padded.vocab == 50257);  // the data's vocabulary
  CHECK(padded.vocab_rows() == 50304);
  // The graph's embedding and LM head have the padded rows (GPT-2 ties them: one table).
  CHECK(dtsim::model::count_params(padded) - dtsim::model::count_params(spec) ==
        (50304 - 50257) * 768);
  CHECK(dtsim::plan::vocab_padding_note(spec, p).value_or("").find("50257 padded to 50304") !=
        std::string::npos);
  p.make_vocab_size_divisible_by = 1;
  CHECK(!dtsim::plan::vocab_padding_note(spec, p));
}

TEST_CASE("even layer split gives the remainder to the first chunks", "[plan]") {
  Plan p = base_plan();
  p.pp = 4;
  CHECK(dtsim::plan::chunk_layers(p, 10) == std::vector<int>{3, 3, 2, 2});
}

TEST_CASE("plans round-trip through JSON, and bad plan files are rejected", "[plan][bad-input]") {
  Plan p = base_plan();
  p.schedule = Schedule::Interleaved;
  p.virtual_stages = 2;
  p.zero_stage = 1;
  p.recompute = dtsim::plan::Recompute::Selective;
  p.sequence_parallel = true;
  p.overlap_grad_reduce = false;
  p.overlap_p2p_comm = true;
  p.overlap_tp_backward = false;
  p.grad_accumulation_fusion = false;
  p.scatter_gather_p2p = true;
  p.layers_per_stage = {10, 10, 10, 10};
  p.comm_precision = dtsim::Precision::Fp8;
  p.grad_precision = dtsim::Precision::Bf16;
  p.grad_compression = 0.25;
  p.make_vocab_size_divisible_by = 64;
  p.expert_load = 1.25;
  p.attention = dtsim::model::AttentionKernel::Flash;
  p.overlap_param_gather = true;
  p.zero_in_place = true;
  const Plan q = dtsim::plan::plan_from_json(dtsim::plan::to_json(p), "p.json");
  CHECK(q.overlap_param_gather);  // with ZeRO-1: allowed
  CHECK(q.zero_in_place);
  CHECK(!has_rule(check_plan(q, load_model("megatron-18.4b"), q.devices()), "zero-in-place", ""));
  CHECK(dtsim::plan::summary(q).find(" zero-in-place") != std::string::npos);
  CHECK(!has_rule(check_plan(q, load_model("megatron-18.4b"), q.devices()), "overlap-param-gather",
                  ""));
  CHECK(q.attention == dtsim::model::AttentionKernel::Flash);
  CHECK(dtsim::plan::summary(q).find(" flash") != std::string::npos);
  // Selective recompute has nothing to drop with FlashAttention: allowed, with a warning.
  const auto check = check_plan(q, load_model("megatron-18.4b"), q.devices());
  CHECK(std::count_if(check.warnings.begin(), check.warnings.end(), [](const std::string& w) {
          return w.find("FlashAttention keeps no s² tensor") != std::string::npos;
        }) == 1);
  CHECK(q.make_vocab_size_divisible_by == 64);
  CHECK(dtsim::plan::to_json(q) == dtsim::plan::to_json(p));
  CHECK(q.comm_precision == dtsim::Precision::Fp8);
  CHECK(q.grad_precision == dtsim::Precision::Bf16);
  CHECK(q.grad_compression == 0.25);
  CHECK(q.expert_load == 1.25);
  CHECK(q.overlap_p2p_comm);
  CHECK(!q.overlap_tp_backward);
  CHECK(!q.grad_accumulation_fusion);
  CHECK(q.scatter_gather_p2p);

  auto bad = [](const char* text, const char* message) {
    dtsim::test::TempFile f("plan.json", text);
    DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::plan::load_plan(f.path()), InputError, message);
  };
  bad(R"({"tp": 0})", "plan.json: tp: expected a positive integer, got 0");
  // Degrees are ints: 2^32 + 2 must not run as tp = 2.
  bad(R"({"tp": 4294967298})", "plan.json: tp: expected at most 1048576, got 4294967298");
  bad(R"({"virtual_stages": 2000000})", "plan.json: virtual_stages: expected at most 1048576");
  bad(R"({"layers_per_stage": [1, 4294967297]})",
      "plan.json: layers_per_stage[1]: expected at most 1048576, got 4294967297");
  bad(R"({"dp": 2, "tp": )", "plan.json: malformed JSON");
  bad(R"({"order": 3})", "plan.json: order: expected a string, got 3");
  bad(R"({"sequence_parallel": "yes"})", "plan.json: sequence_parallel: expected true or false");
  bad(R"({"overlap_grad_reduce": 0})", "plan.json: overlap_grad_reduce: expected true or false");
  bad(R"({"overlap_p2p_comm": "yes"})", "plan.json: overlap_p2p_comm: expected true or false");
  bad(R"({"overlap_tp_backward": 1})", "plan.json: overlap_tp_backward: expected true or false");
  bad(R"({"grad_accumulation_fusion": "no"})",
      "plan.json: grad_accumulation_fusion: expected true or false");
  bad(R"({"scatter_gather_p2p": "on"})", "plan.json: scatter_gather_p2p: expected true or false");
  bad(R"({"zero_stage": 4})", "plan.json: zero_stage: expected 0, 1, 2 or 3, got 4");
  bad(R"({"make_vocab_size_divisible_by": 0})",
      "plan.json: make_vocab_size_divisible_by: expected a positive integer, got 0");
  bad(R"({"make_vocab_size_divisible_by": 131072})",
      "plan.json: make_vocab_size_divisible_by: expected at most 65536, got 131072");
  bad(R"({"grad_compression": 2})",
      "plan.json: grad_compression: expected the fraction of the gradient bytes sent, from 1e-06 "
      "to "
      "1, got 2");
  bad(R"({"grad_compression": 0})", "plan.json: grad_compression: expected a positive number");
  bad(R"({"expert_load": 0.5})",
      "plan.json: expert_load: expected the busiest ep rank's token copies over the even share, "
      "at least 1");
  bad(R"({"comm_precision": "fp4"})", "plan.json: comm_precision: expected one of");
  bad(R"({"grad_precision": "fp8"})",
      "plan.json: grad_precision: expected one of fp32, bf16, fp16, got \"fp8\"");
  bad(R"({"schedule": "looped"})", "schedule: expected one of gpipe, 1f1b, interleaved");
  bad(R"({"overlap_param_gather": "yes"})",
      "plan.json: overlap_param_gather: expected true or false");
  for (const int zero : {0, 3}) {
    Plan z = base_plan();
    z.zero_stage = zero;
    z.overlap_param_gather = true;
    CHECK(has_rule(check_plan(z, load_model("megatron-18.4b"), 64), "overlap-param-gather",
                   fmt::format("with ZeRO-{} there is none", zero)));
  }
  bad(R"({"zero_in_place": 1})", "plan.json: zero_in_place: expected true or false");
  for (const int zero : {0, 2, 3}) {
    Plan z = base_plan();
    z.zero_stage = zero;
    z.zero_in_place = true;
    CHECK(has_rule(check_plan(z, load_model("megatron-18.4b"), 64), "zero-in-place",
                   fmt::format("ZeRO-{} has no such form here", zero)));
  }
  bad(R"({"attention": "fused"})",
      "plan.json: attention: expected one of unfused, flash, got \"fused\"");
  bad(R"({"order": "tp-dp"})", "plan.json: order: ");
  bad(R"({"tensor_parallel": 2})", "tensor_parallel: unknown field");
  bad(R"([1, 2])", "plan.json: expected a JSON object");
}

// A token sends one copy to each of its top k experts: an ep rank holding E / ep of them gets
// at most min(k, E / ep) of its copies, min(ep, E / k) times the even share.
TEST_CASE("routing bounds the expert load", "[plan]") {
  const auto mixtral = dtsim::model::load_model("mixtral-8x7b");  // top 2 of 8
  Plan p;
  p.ep = 2;
  CHECK(dtsim::plan::max_expert_load(mixtral, p) == 2.0);  // every copy to one rank's 4
  p.ep = 8;
  CHECK(dtsim::plan::max_expert_load(mixtral, p) == 4.0);  // one expert a rank
  p.ep = 1;
  CHECK(dtsim::plan::max_expert_load(mixtral, p) == 1.0);
  p.ep = 8;
  CHECK(dtsim::plan::max_expert_load(dtsim::model::load_model("llama3-8b"), p) == 1.0);
}

// Without sequence parallelism every tp rank routes the whole sequence and sends its copies to
// its ep peers; with it (Megatron-Core's all-to-all dispatcher) each sends its 1/tp share's,
// and the copies an ep rank's experts got are all-gathered over tp.
TEST_CASE("the ep all-to-all moves a tp rank's share of the copies under sequence parallelism",
          "[plan]") {
  const auto mixtral = dtsim::model::load_model("mixtral-8x7b");
  Plan p;
  p.tp = 2;
  p.ep = 8;
  const std::uint64_t hidden = 4096ull * 4096 * 2;
  CHECK_FALSE(dtsim::plan::moe_local_dispatch(mixtral, p));
  const std::uint64_t plain = dtsim::plan::ep_all_to_all_bytes(mixtral, p, hidden);
  CHECK(plain == 2 * hidden);  // top 2
  CHECK(dtsim::plan::expert_copies_bytes(mixtral, p, hidden) == plain);
  p.sequence_parallel = true;
  CHECK(dtsim::plan::moe_local_dispatch(mixtral, p));
  CHECK(dtsim::plan::ep_all_to_all_bytes(mixtral, p, hidden) == plain / 2);
  CHECK(dtsim::plan::expert_copies_bytes(mixtral, p, hidden) == plain);
  p.expert_load = 1.5;
  CHECK(dtsim::plan::ep_all_to_all_bytes(mixtral, p, hidden) == 3 * hidden / 2);
  CHECK(dtsim::plan::expert_copies_bytes(mixtral, p, hidden) == 3 * hidden);
  // A dense model has no dispatch.
  CHECK_FALSE(dtsim::plan::moe_local_dispatch(dtsim::model::load_model("llama3-8b"), p));
}
