#include "exec/core/runner.hpp"

#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "exec/core/checkpoint.hpp"
#include "exec/cpu/bf16_device.hpp"
#include "exec/cpu/kernels.hpp"
#include "sim/cluster/topology.hpp"
#include "sim/common/error.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/plan/memory_model.hpp"
#include "tests/test_util.hpp"

namespace {

dtsim::plan::Plan single_rank(std::int64_t micro_batch, std::int64_t global_batch) {
  dtsim::plan::Plan p;
  p.micro_batch_size = micro_batch;
  p.global_batch_size = global_batch;
  p.seq_len = 32;
  return p;
}

// Every rank's program of plan `p` (lowered for all ranks, as under mpirun).
dtsim::lower::Program all_ranks(const dtsim::model::ModelGraph& g, const dtsim::plan::Plan& p) {
  dtsim::lower::LowerOptions lowering;
  lowering.mode = dtsim::lower::Lowering::AllRanks;
  return dtsim::lower::lower(g, p, lowering);
}

dtsim::exec::RunResult run(const char* model, dtsim::plan::Plan p, int steps,
                           dtsim::exec::RunOptions o = {}, dtsim::exec::Device* device = nullptr) {
  const auto spec = dtsim::model::load_model(model);
  const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 4, p.attention);
  const auto program = dtsim::lower::lower(g, p);
  o.steps = steps;
  o.lr.max_lr = 3e-3f;
  dtsim::exec::SingleRankComm comm;
  if (device != nullptr) return dtsim::exec::run_program(g, program, o, comm, *device);
  return dtsim::exec::run_program(g, program, o, comm);
}

}  // namespace

TEST_CASE("the executor trains: the loss falls on a learnable stream", "[exec][runner]") {
  const auto r = run("tiny-gpt", single_rank(4, 4), 60);
  REQUIRE(r.losses.size() == 60);
  INFO("first loss " << r.losses.front() << ", last " << r.losses.back());
  // log(256) = 5.55 at random initialisation; nine tokens in ten are predictable.
  CHECK(r.losses.front() == Approx(std::log(256.0)).epsilon(0.05));
  CHECK(r.losses.back() < r.losses.front() - 1.5);
  CHECK(r.step_time_s > 0);
  CHECK(!r.tasks.empty());
}

TEST_CASE("a Llama-style model with RoPE, GQA and SwiGLU trains", "[exec][runner]") {
  const auto r = run("tiny", single_rank(4, 4), 60);
  INFO("first loss " << r.losses.front() << ", last " << r.losses.back());
  CHECK(r.losses.front() == Approx(std::log(256.0)).epsilon(0.05));
  CHECK(r.losses.back() < r.losses.front() - 1.5);
}

TEST_CASE("a mixture of experts trains", "[exec][runner]") {
  const auto r = run(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_moe.json", single_rank(4, 4), 60);
  INFO("first loss " << r.losses.front() << ", last " << r.losses.back());
  CHECK(r.losses.front() == Approx(std::log(256.0)).epsilon(0.05));
  CHECK(r.losses.back() < r.losses.front() - 1.5);
}

namespace {

// The whole model's gradients against central finite differences of its loss: for each tensor
// of `moves`, its element of the largest gradient moved by ±eps. A step's gradient is read from
// AdamW's first moment (m = 0.9 m' + 0.1 g); the loss at weights moved from a resumed
// checkpoint's. An eps too large flips a token's choice of experts in a block after it (a step
// in the loss); one too small drowns in the loss's fp32 rounding (about 5e-7 / (2 eps)).
struct Move {
  const char* tensor;
  float eps;
};
void check_gradients_by_finite_differences(const char* model, const std::vector<Move>& moves) {
  namespace fs = std::filesystem;
  const auto p = single_rank(2, 4);
  // (One folder per model: ctest runs the test cases side by side.)
  const fs::path base =
      fs::temp_directory_path() / ("dtexec_runner_test_fd_" + fs::path(model).stem().string() +
                                   "_" + std::to_string(::getpid()));
  fs::remove_all(base);
  fs::create_directories(base);
  const std::string first = (base / "first").string(), second = (base / "second").string();
  dtsim::exec::RunOptions o;
  o.checkpoint_dir = first;
  run(model, p, 1, o);
  o.checkpoint_dir = second;
  o.resume_dir = first;
  run(model, p, 2, o);
  const auto before = dtsim::exec::read_checkpoint(first);
  const auto after = dtsim::exec::read_checkpoint(second);
  // The loss at step 2 where one element of `tensor` moves by `delta` from the first checkpoint.
  auto loss_moved = [&](std::size_t tensor, std::size_t at, float delta) {
    auto moved = before;
    moved.tensors[tensor].data[at] += delta;
    const std::string dir = (base / "moved").string();
    fs::remove_all(dir);
    dtsim::exec::write_checkpoint(dir, moved);
    dtsim::exec::RunOptions r;
    r.resume_dir = dir;
    return run(model, p, 2, r).losses.back();
  };
  int checked = 0;
  for (const auto& [name, eps] : moves) {
    INFO(name);
    std::size_t t = 0;
    while (t < before.tensors.size() && before.tensors[t].name != name) ++t;
    REQUIRE(t < before.tensors.size());
    // Its element of the largest gradient at step 2.
    const auto& m1 = before.tensors[t].m;
    const auto& m2 = after.tensors[t].m;
    std::size_t at = 0;
    double grad = 0;
    for (std::size_t i = 0; i < m1.size(); ++i) {
      const double g = (static_cast<double>(m2[i]) - 0.9 * m1[i]) / 0.1;
      if (std::abs(g) > std::abs(grad)) {
        grad = g;
        at = i;
      }
    }
    REQUIRE(grad != 0);
    const double fd = (loss_moved(t, at, eps) - loss_moved(t, at, -eps)) / (2.0 * eps);
    CHECK(fd == Approx(grad).epsilon(0.05).margin(1e-4));
    ++checked;
  }
  CHECK(checked == static_cast<int>(moves.size()));
  fs::remove_all(base);
}

}  // namespace

// Through a mixture of experts beside shared experts (a Hugging Face qwen2_moe config, its
// gates over all experts): the shared experts' down projection adds the routed output, and the
// block's input gradient sums the router's, the experts' and the shared experts' shares.
TEST_CASE("shared experts beside routed ones: gradients match finite differences of the loss",
          "[exec][runner]") {
  // (Its router's weight moved by 1e-2 flips a token's choice of experts.)
  check_gradients_by_finite_differences(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_qwen2_moe.json",
                                        {{"L1.shared_up.weight", 1e-2f},
                                         {"L1.shared_down.weight", 1e-2f},
                                         {"L0.shared_up.weight", 1e-2f},
                                         {"L1.experts_up.e0.weight", 1e-2f},
                                         {"L0.experts_down.e1.weight", 1e-2f},
                                         {"L0.router.weight", 3e-3f},
                                         {"L0.norm2.weight", 1e-2f},
                                         {"L0.qkv.weight", 1e-2f}});
}

// A dense first block, then experts weighted by their logits' sigmoids over their sum, times
// 2.5, beside shared experts twice an expert's width (a Hugging Face glm4_moe config). The
// dense block's up projection and the first expert block's QKV bias moved by 1e-2 flip a
// choice of experts after them (measured: 17% and 7% apart; at 1e-3, 0.7% and 0.3%). Its
// routers' largest gradients (8e-4, 6e-4) are below what the loss's rounding resolves at an
// eps that flips no choice: the sigmoid gates' logit gradient is checked by the kernels' test
// (kernels_test.cpp), the router's weight gradient is its GEMM's.
TEST_CASE("sigmoid gates and a dense block: gradients match finite differences of the loss",
          "[exec][runner]") {
  check_gradients_by_finite_differences(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_glm4_moe.json",
                                        {{"L1.experts_up.e0.weight", 1e-2f},
                                         {"L2.experts_down.e1.weight", 1e-2f},
                                         {"L1.shared_down.weight", 1e-2f},
                                         {"L0.mlp_up.weight", 1e-3f},
                                         {"L0.mlp_down.weight", 1e-2f},
                                         {"L1.qkv.bias", 1e-3f}});
}

// Multi-head latent attention (a Hugging Face deepseek_v3 config): the down projection's three
// parts, the latents' two norms, the up projections of the queries and of the keys and values,
// the core with values narrower than its keys, the keys' RoPE part shared by the heads. (The
// first block's down projection, kv_up and attn_out, and the last's kv_up, moved by 1e-2, flip a
// choice of experts after them: 1e-3.)
TEST_CASE("latent attention with a query latent: gradients match finite differences of the loss",
          "[exec][runner]") {
  check_gradients_by_finite_differences(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_deepseek_v3.json",
                                        {{"L0.latent_down.weight", 1e-3f},
                                         {"L0.latent_norm.weight", 1e-2f},
                                         {"L0.q_up.weight", 1e-2f},
                                         {"L0.kv_up.weight", 1e-3f},
                                         {"L0.attn_out.weight", 1e-3f},
                                         {"L2.latent_down.weight", 1e-2f},
                                         {"L2.kv_up.weight", 1e-3f}});
}

// Without a query latent (DeepSeek-V2-Lite's): the queries from the block's input, whose
// gradient sums theirs and the down projection's; values wider than the keys.
TEST_CASE("latent attention without a query latent: gradients match finite differences",
          "[exec][runner]") {
  check_gradients_by_finite_differences(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_mla.json",
                                        {{"L0.latent_down.weight", 1e-2f},
                                         {"L0.latent_norm.weight", 1e-2f},
                                         {"L0.q_proj.weight", 1e-2f},
                                         {"L0.kv_up.weight", 1e-2f},
                                         {"L3.attn_out.weight", 1e-2f},
                                         {"L1.norm1.weight", 1e-2f}});
}

TEST_CASE("gradient accumulation over micro-batches equals one large micro-batch",
          "[exec][runner]") {
  // The same four sequences per step, as one micro-batch of 4 or four of 1 (the Program then
  // has four forward and backward passes and one optimizer step).
  const auto one = run("tiny-gpt", single_rank(4, 4), 8);
  const auto four = run("tiny-gpt", single_rank(1, 4), 8);
  for (std::size_t i = 0; i < one.losses.size(); ++i) {
    CHECK(four.losses[i] == Approx(one.losses[i]).epsilon(1e-4));
  }
}

TEST_CASE("runs are deterministic", "[exec][runner]") {
  const auto a = run("tiny-gpt", single_rank(2, 4), 5);
  const auto b = run("tiny-gpt", single_rank(2, 4), 5);
  CHECK(a.losses == b.losses);  // bitwise
}

TEST_CASE("what the runner does not execute is refused", "[exec][runner]") {
  auto p = single_rank(1, 2);
  p.schedule = dtsim::plan::Schedule::PipeDreamAsync;
  REQUIRE_THROWS_AS(run("tiny-gpt", p, 1), dtsim::UnsupportedError);
  // A device without context parallelism's kernels (here the bf16 device, told so) refuses it
  // whole. (A sequence that 2 x cp does not divide is an invalid plan: plan::check_plan.)
  auto cp = single_rank(1, 2);
  cp.cp = 2;
  cp.seq_len = 32;
  dtsim::exec::cpu::Bf16Device bf16(true, {dtsim::exec::Device::Feature::ContextParallelism});
  dtsim::exec::RunOptions alone;
  alone.replay_communication = true;  // one of the two ranks' programs
  REQUIRE_THROWS_WITH(run("tiny-gpt", cp, 1, alone, &bf16),
                      Catch::Contains("context parallelism (cp 2) is not executed on"));
  auto flash = single_rank(1, 2);
  flash.attention = dtsim::model::AttentionKernel::Flash;
  dtsim::exec::cpu::Bf16Device no_flash(true, {dtsim::exec::Device::Feature::FlashAttention});
  REQUIRE_THROWS_WITH(run("tiny-gpt", flash, 1, {}, &no_flash),
                      Catch::Contains("FlashAttention's memory (plan attention flash; --attention "
                                      "unfused runs without it) is not executed on"));
  // Gradient clipping, on a device without it.
  auto clip = single_rank(1, 2);
  clip.clip_grad = 1.0;
  dtsim::exec::cpu::Bf16Device no_clip(true, {dtsim::exec::Device::Feature::GradClip});
  REQUIRE_THROWS_WITH(run("tiny-gpt", clip, 1, {}, &no_clip),
                      Catch::Contains("gradient clipping (--clip-grad 1) is not executed on"));
  // Multi-head latent attention on a device without its kernels.
  const char* mla = DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_mla.json";
  dtsim::exec::cpu::Bf16Device no_mla(true, {dtsim::exec::Device::Feature::LatentAttention});
  REQUIRE_THROWS_WITH(
      run(mla, single_rank(1, 2), 1, {}, &no_mla),
      Catch::Contains("multi-head latent attention (model tiny-mla) is not executed on"));
}

// AdamW's decoupled weight decay (Megatron-LM's --weight-decay): after one step from the same
// initial weights, the same gradients (the first step's do not depend on it) move biases and
// norms' weights identically, and matrices by lr x decay x weight more.
TEST_CASE("weight decay shrinks matrices only", "[exec][runner]") {
  namespace fs = std::filesystem;
  const auto p = single_rank(1, 2);
  std::map<std::string, std::vector<float>> after[2];
  for (int k = 0; k < 2; ++k) {
    const fs::path dir = fs::temp_directory_path() / ("dtexec_runner_test_wd" + std::to_string(k));
    fs::remove_all(dir);
    dtsim::exec::RunOptions o;
    o.checkpoint_dir = dir.string();
    o.weight_decay = k == 0 ? 0.0f : 0.1f;
    run("tiny-gpt", p, 1, o);
    for (auto& t : dtsim::exec::read_checkpoint(dir.string()).tensors) after[k][t.name] = t.data;
    fs::remove_all(dir);
  }
  int matrices = 0, others = 0;
  for (const auto& [name, plain] : after[0]) {
    const auto& decayed = after[1].at(name);
    // Biases and norms' weights and biases are 1-D; the embedding's second tensor is the
    // learned positions' table, a matrix.
    const bool one_dim = name.find("norm") != std::string::npos ||
                         (name.find(".bias") != std::string::npos && name != "embedding.bias");
    INFO(name);
    if (!one_dim) {
      ++matrices;
      CHECK(decayed != plain);
    } else {
      ++others;
      CHECK(decayed == plain);
    }
  }
  CHECK(matrices > 0);
  CHECK(others > 0);
}

// Gradient clipping (Megatron-LM's clip_grad_norm_fp32) on one rank: the norm it reports is
// the gradients' own (their sum of squares as the kernels give it), a limit above every
// step's norm trains as no clipping at all, and one below scales every step.
TEST_CASE("gradient clipping reports the norm and clips only above it", "[exec][runner]") {
  auto p = single_rank(1, 2);
  const auto free_run = run("tiny-gpt", p, 3);
  p.clip_grad = 1e6;
  const auto loose = run("tiny-gpt", p, 3);
  REQUIRE(loose.grad_norms.size() == 3);
  CHECK(loose.losses == free_run.losses);  // bitwise: the coefficient is never applied
  for (double n : loose.grad_norms) CHECK(n > 0);
  p.clip_grad = 0.1;
  const auto tight = run("tiny-gpt", p, 3);
  CHECK(tight.grad_norms.front() == loose.grad_norms.front());  // the first step's, before any
  CHECK(tight.losses.front() == loose.losses.front());
  CHECK(tight.losses.back() != loose.losses.back());
  // cpu::clip_scale: max_norm / (norm + 1e-6) when below 1.
  std::vector<float> g = {3.0f, 4.0f};
  dtsim::exec::cpu::clip_scale(g, 2, 5.0, 1.0f);
  CHECK(g[0] == Approx(3.0 / (5.0 + 1e-6)));
  CHECK(g[1] == Approx(4.0 / (5.0 + 1e-6)));
  CHECK(dtsim::exec::cpu::sum_squares(g, 2) == Approx(1.0).epsilon(1e-6));
  std::vector<float> small = {0.3f, 0.4f};
  dtsim::exec::cpu::clip_scale(small, 2, 0.5, 1.0f);  // under the limit: unchanged
  CHECK(small[0] == 0.3f);
}

// FlashAttention's memory trains as the unfused kernel: its forward is the same, its
// backward's probabilities come from the rows' log-sum-exp (rounding), so the losses agree to
// fp32 rounding over steps; with dropout (masks drawn again) and context parallelism.
TEST_CASE("FlashAttention's memory trains as the unfused attention", "[exec][runner]") {
  for (const bool cp : {false, true}) {
    auto p = single_rank(2, 4);
    if (cp) p.cp = 2;
    INFO((cp ? "cp 2, one rank's program" : "one rank"));
    dtsim::exec::RunOptions o;
    o.replay_communication = cp;
    const auto unfused = run(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_gpt_dropout.json", p, 6, o);
    p.attention = dtsim::model::AttentionKernel::Flash;
    const auto flash = run(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_gpt_dropout.json", p, 6, o);
    REQUIRE(flash.losses.size() == unfused.losses.size());
    CHECK(flash.losses.front() == unfused.losses.front());  // the same forward
    for (std::size_t i = 0; i < flash.losses.size(); ++i) {
      CHECK(flash.losses[i] == Approx(unfused.losses[i]).epsilon(1e-5));
    }
  }
  // The GPU device's path (bf16 activations, fp32 log-sum-exp), emulated: the same first loss,
  // then within bf16's rounding of the unfused run.
  auto p = single_rank(2, 4);
  p.precision = dtsim::Precision::Bf16;
  dtsim::exec::cpu::Bf16Device bf16;
  const auto unfused =
      run(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_gpt_dropout.json", p, 6, {}, &bf16);
  p.attention = dtsim::model::AttentionKernel::Flash;
  dtsim::exec::cpu::Bf16Device bf16_flash;
  const auto flash =
      run(DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_gpt_dropout.json", p, 6, {}, &bf16_flash);
  CHECK(flash.losses.front() == unfused.losses.front());
  for (std::size_t i = 0; i < flash.losses.size(); ++i) {
    CHECK(flash.losses[i] == Approx(unfused.losses[i]).epsilon(1e-2));
  }
}

TEST_CASE("a resumed run continues with bitwise-identical losses", "[exec][runner]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "dtexec_runner_test_ckpt";
  // A dense model, and a mixture of experts (whose experts' tensors are saved by name each).
  for (const char* model : {"tiny-gpt", DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_moe.json"}) {
    INFO(model);
    fs::remove_all(dir);
    const auto whole = run(model, single_rank(2, 4), 6);
    dtsim::exec::RunOptions first;
    first.checkpoint_dir = dir.string();
    first.checkpoint_every = 3;
    first.warmup_steps = 0;
    run(model, single_rank(2, 4), 3, first);
    const auto saved = dtsim::exec::read_checkpoint(dir.string());
    CHECK(saved.step == 3);
    CHECK(saved.losses.size() == 3);
    std::set<std::string> names;
    for (const auto& t : saved.tensors) CHECK(names.insert(t.name).second);  // no name twice
    dtsim::exec::RunOptions second;
    second.resume_dir = dir.string();
    second.warmup_steps = 0;
    const auto resumed = run(model, single_rank(2, 4), 6, second);
    CHECK(resumed.first_step == 3);
    REQUIRE(resumed.losses.size() == 6);
    CHECK(resumed.losses == whole.losses);  // bitwise, the first three from the checkpoint
  }
  fs::remove_all(dir);
}

TEST_CASE("a checkpoint that does not fit the run is refused", "[exec][runner]") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / "dtexec_runner_test_ckpt2";
  fs::remove_all(dir);
  dtsim::exec::RunOptions o;
  o.checkpoint_dir = dir.string();
  o.warmup_steps = 0;
  run("tiny-gpt", single_rank(1, 1), 2, o);
  dtsim::exec::RunOptions again;
  again.resume_dir = dir.string();
  again.warmup_steps = 0;
  // Nothing left to run.
  DTSIM_REQUIRE_THROWS_CONTAINING(run("tiny-gpt", single_rank(1, 1), 2, again), dtsim::InputError,
                                  "step: the checkpoint is at step 2");
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::exec::read_checkpoint((dir / "nope").string()),
                                  dtsim::InputError, "nope: no such checkpoint folder");
  // A tensor whose shape claims more than the shards hold: refused before it is allocated.
  auto c = dtsim::exec::read_checkpoint(dir.string());
  nlohmann::json meta;
  {
    std::ifstream in(dir / "checkpoint.json");
    in >> meta;
  }
  meta["tensors"][0]["shape"] = {1000000000, 1000000000};
  {
    std::ofstream out(dir / "checkpoint.json");
    out << meta.dump();
  }
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::exec::read_checkpoint(dir.string()), dtsim::InputError,
                                  "expected positive sizes, with no more elements than");
  meta["tensors"][0]["shape"] = {-1, 4};
  {
    std::ofstream out(dir / "checkpoint.json");
    out << meta.dump();
  }
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::exec::read_checkpoint(dir.string()), dtsim::InputError,
                                  "expected positive sizes");
  fs::remove_all(dir);
}

// The GPU's mixed precision (bf16 activations, fp32 masters and statistics, weight copies for
// the GEMMs), emulated on the CPU with the GPU device's type checks: the runner's bf16 path
// trains and stays near the fp32 run.
TEST_CASE("the runner's bf16 path trains and tracks the fp32 run", "[exec][runner]") {
  for (const char* model : {"tiny-gpt", "tiny"}) {
    INFO(model);
    dtsim::exec::cpu::Bf16Device bf16;
    const auto half = run(model, single_rank(2, 4), 40, {}, &bf16);
    const auto full = run(model, single_rank(2, 4), 40);
    INFO("bf16 " << half.losses.front() << " -> " << half.losses.back() << ", fp32 "
                 << full.losses.front() << " -> " << full.losses.back());
    CHECK(half.losses.front() == Approx(full.losses.front()).epsilon(0.01));
    CHECK(half.losses.back() < half.losses.front() - 1.0);
    CHECK(half.losses.back() == Approx(full.losses.back()).epsilon(0.02));
  }
}

// --only-rank's path on a device whose memory is not the host's: every communication task
// replaced by a wait, sequence parallelism's local copies, and the loss from its local
// statistics, in bf16.
TEST_CASE("one rank of a tp2 pp2 dp2 plan runs alone on the bf16 path", "[exec][runner]") {
  const auto spec = dtsim::model::load_model("tiny");
  dtsim::plan::Plan p;
  p.tp = 2;
  p.pp = 2;
  p.dp = 2;
  p.micro_batch_size = 2;
  p.global_batch_size = 8;
  p.seq_len = 32;
  p.sequence_parallel = true;
  p.zero_stage = 1;
  const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 2);
  const auto program = dtsim::lower::lower(g, p);
  for (std::size_t index = 0; index < program.ranks.size(); ++index) {
    INFO("program " << index << " (stage " << program.ranks[index].stage << ")");
    dtsim::exec::cpu::Bf16Device bf16(/*host_memory=*/false);
    dtsim::exec::RunOptions o;
    o.steps = 2;
    o.warmup_steps = 0;
    o.program_index = static_cast<int>(index);
    o.replay_communication = true;
    dtsim::exec::SingleRankComm comm;
    const auto r = dtsim::exec::run_program(g, program, o, comm, bf16);
    CHECK(r.step_times_s.size() == 2);
    // Replayed receives copy one made-up tensor of a transfer's size (every stage receives:
    // activations forward, gradients backward).
    const auto& tasks = program.ranks[index].tasks;
    const auto recv = std::find_if(tasks.begin(), tasks.end(), [](const dtsim::lower::Task& t) {
      return t.kind == dtsim::lower::TaskKind::Recv;
    });
    REQUIRE(recv != tasks.end());
    CHECK(r.replay_input_bytes == Approx(static_cast<double>(recv->bytes)));
    REQUIRE(r.step_begins_s.size() == 2);
    REQUIRE(!r.tasks.empty());
    // Timed with the device's marks (the queued-device path): each task after the one before,
    // within its step (dtexec's breakdown and trace count from the step's begin).
    for (std::size_t i = 0; i < r.tasks.size(); ++i) {
      const auto step = static_cast<std::size_t>(r.tasks[i].step);
      CHECK(r.step_begins_s.at(step) <= r.tasks[i].start_s);
      CHECK(r.tasks[i].end_s <= r.step_begins_s.at(step) + r.step_times_s.at(step) + 1e-9);
      CHECK(r.tasks[i].start_s <= r.tasks[i].end_s);
      if (i > 0 && r.tasks[i].step == r.tasks[i - 1].step) {
        CHECK(r.tasks[i - 1].end_s <= r.tasks[i].start_s + 1e-9);
      }
    }
  }
}

// The GPU's type rules over the executor's plan space (cp included): each plan's every
// representative rank on the bf16 path (communication replayed as waits), so that a runner path
// handing a kernel a view of the wrong type fails here, not first on a GPU.
TEST_CASE("every rank of a matrix of plans runs alone on the bf16 path", "[exec][runner]") {
  using dtsim::plan::Plan;
  using dtsim::plan::Recompute;
  using dtsim::plan::Schedule;
  struct Case {
    const char* model;
    const char* what;
    void (*set)(Plan&);
  };
  const char* llama = DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_llama_4l.json";
  const char* llama_tp8 = DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_llama_tp8.json";
  const char* moe = DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_moe.json";
  const std::vector<Case> cases = {
      {"tiny-gpt", "tp2 pp2 gpipe",
       [](Plan& p) { p.tp = 2, p.pp = 2, p.schedule = Schedule::GPipe; }},
      {"tiny-gpt", "tp2 pp2 1f1b, tp backward after the layer",
       [](Plan& p) { p.tp = 2, p.pp = 2, p.overlap_tp_backward = false; }},
      {"tiny-gpt", "tp2 scatter-gather p2p pp2",
       [](Plan& p) { p.tp = 2, p.pp = 2, p.scatter_gather_p2p = true; }},
      {"tiny-gpt", "tp2 sp, selective recompute",
       [](Plan& p) { p.tp = 2, p.sequence_parallel = true, p.recompute = Recompute::Selective; }},
      {"tiny-gpt", "dp2 zero1, full recompute",
       [](Plan& p) { p.dp = 2, p.zero_stage = 1, p.recompute = Recompute::Full; }},
      {"tiny-gpt", "dp2 zero2, no gradient-accumulation fusion",
       [](Plan& p) { p.dp = 2, p.zero_stage = 2, p.grad_accumulation_fusion = false; }},
      {"tiny-gpt", "dp2 zero3 tp2", [](Plan& p) { p.dp = 2, p.zero_stage = 3, p.tp = 2; }},
      {"tiny-gpt", "dp2 pp2, reduction after the backward",
       [](Plan& p) { p.dp = 2, p.pp = 2, p.overlap_grad_reduce = false; }},
      {llama, "tp2 pp2 interleaved",
       [](Plan& p) {
         p.tp = 2, p.pp = 2, p.schedule = Schedule::Interleaved, p.virtual_stages = 2;
       }},
      {llama, "pp2 zero-bubble", [](Plan& p) { p.pp = 2, p.schedule = Schedule::ZeroBubble; }},
      {llama, "tp2 pp2 sp, p2p overlapped, full recompute",
       [](Plan& p) {
         p.tp = 2, p.pp = 2, p.sequence_parallel = true, p.overlap_p2p_comm = true,
         p.recompute = Recompute::Full;
       }},
      {llama, "dp2 tp2 zero3 sp",
       [](Plan& p) { p.dp = 2, p.tp = 2, p.zero_stage = 3, p.sequence_parallel = true; }},
      {llama, "cp2 selective recompute",
       [](Plan& p) { p.cp = 2, p.recompute = Recompute::Selective; }},
      {"tiny-gpt", "tp2 cp2 sp", [](Plan& p) { p.tp = 2, p.cp = 2, p.sequence_parallel = true; }},
      // FlashAttention's memory (fp32 log-sum-exp beside bf16 activations).
      {llama, "cp2 pp2 flash",
       [](Plan& p) { p.cp = 2, p.pp = 2, p.attention = dtsim::model::AttentionKernel::Flash; }},
      // Llama-3 70B's tp 8 pp 8 plan in miniature (one KV head and two query heads per tp
      // rank): on an H200 its last stage met a mistyped view, which the emulation now finds.
      {llama_tp8, "tp8 pp8", [](Plan& p) { p.tp = 8, p.pp = 8; }},
      {llama_tp8, "tp8 pp8 sp", [](Plan& p) { p.tp = 8, p.pp = 8, p.sequence_parallel = true; }},
      {moe, "tp2 pp2 (a mixture of experts)", [](Plan& p) { p.tp = 2, p.pp = 2; }},
      {moe, "tp2 sp (a mixture of experts)", [](Plan& p) { p.tp = 2, p.sequence_parallel = true; }},
      {moe, "dp2 zero2 (a mixture of experts)", [](Plan& p) { p.dp = 2, p.zero_stage = 2; }},
      {moe, "dp4 ep2 zero1 tp2 sp (a mixture of experts)",
       [](Plan& p) { p.dp = 4, p.ep = 2, p.zero_stage = 1, p.tp = 2, p.sequence_parallel = true; }},
  };
  for (const Case& c : cases) {
    Plan p;
    p.micro_batch_size = 2;
    p.seq_len = 32;
    c.set(p);
    p.global_batch_size = 2 * p.dp * 4;  // four micro-batches per replica
    const auto spec = dtsim::model::load_model(c.model);
    const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 2, p.attention);
    const auto program = dtsim::lower::lower(g, p);
    for (std::size_t index = 0; index < program.ranks.size(); ++index) {
      INFO(c.model << ", " << c.what << ": program " << index << " (stage "
                   << program.ranks[index].stage << ")");
      dtsim::exec::cpu::Bf16Device bf16;
      dtsim::exec::RunOptions o;
      o.steps = 2;
      o.warmup_steps = 0;
      o.program_index = static_cast<int>(index);
      o.replay_communication = true;
      dtsim::exec::SingleRankComm comm(&bf16);
      const auto r = dtsim::exec::run_program(g, program, o, comm, bf16);
      CHECK(r.step_times_s.size() == 2);
    }
  }
}

namespace {

// Two ranks that exchange nothing: a stand-in for a backend that moves host memory only.
class HostOnlyComm : public dtsim::exec::Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  // The peer holds what this rank holds: a gather's pieces are this rank's, a reduction's
  // result its own part (what the collectives write is written: the device poisons it).
  void all_reduce(int, dtsim::exec::View, dtsim::exec::Reduce) override {}
  void reduce_scatter(int, dtsim::exec::View in, dtsim::exec::View out,
                      std::span<const int>) override {
    std::memcpy(out.p, in.p, bytes(out));
  }
  // Each member's part this rank's (as much of it as fits, zeros after), in place or not.
  void all_gather(int, dtsim::exec::View in, dtsim::exec::View out,
                  std::span<const int> counts) override {
    const std::vector<std::byte> mine(static_cast<const std::byte*>(in.p),
                                      static_cast<const std::byte*>(in.p) + bytes(in));
    std::int64_t at = 0;
    for (const int count : counts) {
      const dtsim::exec::View part = out.sub(at, count);
      std::memset(part.p, 0, bytes(part));
      std::memcpy(part.p, mine.data(), std::min(bytes(part), bytes(in)));
      at += count;
    }
  }
  Handle start_all_reduce(int, dtsim::exec::View) override { return 0; }
  Handle start_reduce_scatter(int group, dtsim::exec::View in, dtsim::exec::View out,
                              std::span<const int> counts) override {
    reduce_scatter(group, in, out, counts);
    return 0;
  }
  Handle start_all_gather(int group, dtsim::exec::View in, dtsim::exec::View out,
                          std::span<const int> counts) override {
    all_gather(group, in, out, counts);
    return 0;
  }
  void finish(Handle) override {}
  void send(int, std::int64_t, dtsim::exec::View) override {}
  void recv(int, std::int64_t, dtsim::exec::View v) override { std::memset(v.p, 0, bytes(v)); }
  Handle start_recv(int, std::int64_t, dtsim::exec::View) override { return -1; }
  void wait_sends() override {}
  void all_ranks(std::span<double>, dtsim::exec::Reduce) override {}
  std::vector<std::string> gather_to_root(std::string mine) override {
    std::vector<std::string> out;
    out.push_back(std::move(mine));
    return out;
  }
  void barrier() override {}
  dtsim::exec::ClockOffsets clock_offsets(const std::function<double()>&) override {
    return {{0.0, 0.0}, 0.0};
  }

 private:
  static std::size_t bytes(dtsim::exec::View v) {
    return static_cast<std::size_t>(v.n) * dtsim::exec::bytes_of(v.type);
  }
};

}  // namespace

namespace {

// tiny-gpt's parameters: all of them, and the linear layers' weights (qkv, out, up, down).
struct TinyGptParams {
  std::int64_t all = 0, gemm = 0;
};
TinyGptParams tiny_gpt_params(const dtsim::model::ModelSpec& spec) {
  const auto C = static_cast<std::int64_t>(spec.hidden);
  const auto F = static_cast<std::int64_t>(spec.ffn_hidden);
  return {static_cast<std::int64_t>(dtsim::model::count_params(spec)),
          spec.layers * (4 * C * C + 2 * C * F)};
}

// One step of comm.rank()'s share of tiny-gpt at dp 2 (micro-batches of 1, 2 per replica).
void run_dp2_step(const dtsim::model::ModelSpec& spec, int zero_stage, bool zero_in_place,
                  dtsim::exec::Comm& comm, dtsim::exec::Device& device) {
  auto p = single_rank(1, 2);
  p.dp = 2;
  p.zero_stage = zero_stage;
  p.zero_in_place = zero_in_place;
  const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 2);
  const auto program = all_ranks(g, p);
  dtsim::exec::RunOptions o;
  o.steps = 1;
  o.warmup_steps = 0;
  dtsim::exec::run_program(g, program, o, comm, device);
}

}  // namespace

TEST_CASE("a device's memory is not handed to a backend that moves host memory only",
          "[exec][runner]") {
  const auto spec = dtsim::model::load_model("tiny-gpt");
  auto p = single_rank(1, 2);
  p.dp = 2;
  const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 2);
  const auto program = all_ranks(g, p);
  dtsim::exec::cpu::Bf16Device device(/*host_memory=*/false);  // counts as a GPU's
  HostOnlyComm comm;
  dtsim::exec::RunOptions o;
  o.steps = 1;
  DTSIM_REQUIRE_THROWS_CONTAINING(dtsim::exec::run_program(g, program, o, comm, device),
                                  dtsim::UnsupportedError,
                                  "2 ranks on cpu-bf16-emulation: this communication backend "
                                  "moves host memory only");
}

namespace {

// Rank 0 of a data-parallel pair, its peer a stand-in: the elements each all-gather fills, by
// type.
class GatherRecordingComm final : public HostOnlyComm {
 public:
  std::map<dtsim::exec::Dtype, std::int64_t> gathered;
  void all_gather(int group, dtsim::exec::View in, dtsim::exec::View out,
                  std::span<const int> counts) override {
    gathered[out.type] += out.n;
    HostOnlyComm::all_gather(group, in, out, counts);
  }
};

}  // namespace

TEST_CASE("ZeRO gathers the GEMMs' weights in the activation type and the rest in fp32",
          "[exec][runner]") {
  // tiny-gpt at dp 2 on the bf16 path: the step's all-gather of updated weights (ZeRO-1) and
  // ZeRO-3's gathers before each pass move a linear layer's weight as its 16-bit working copy
  // (Megatron-LM's and FSDP2's 16-bit weights, half the bytes of the fp32 master), and the
  // tensors read in fp32 (the tied embedding table, positions, norms, biases) in fp32.
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const auto [all, gemm] = tiny_gpt_params(spec);
  for (const int stage : {1, 3}) {
    INFO("ZeRO-" << stage);
    dtsim::exec::cpu::Bf16Device device;
    GatherRecordingComm comm;
    run_dp2_step(spec, stage, /*zero_in_place=*/false, comm, device);
    REQUIRE(comm.gathered.size() == 2);
    // ZeRO-1: every weight once, after the optimizer step; ZeRO-3: every weight before each of
    // the micro-batch's two passes (the tied table once a pass, held from the embedding to the
    // head), but the head's own (the final norm's, in fp32), which its backward keeps from its
    // forward.
    const std::int64_t passes = stage == 1 ? 1 : 2;
    const std::int64_t final_norm = stage == 1 ? 0 : 2 * static_cast<std::int64_t>(spec.hidden);
    CHECK(comm.gathered[dtsim::exec::Dtype::BF16] == passes * gemm);
    CHECK(comm.gathered[dtsim::exec::Dtype::F32] == passes * (all - gemm) - final_norm);
  }
}

namespace {

// Rank 0 of a data-parallel pair, its peer a stand-in whose started all-gathers land only when
// finished (what a started collective's output holds before that is undefined): a task that
// read gathered weights before waiting for their gather would read the CPU device's poison.
class DeferredGatherComm final : public HostOnlyComm {
 public:
  int started = 0, blocking = 0;
  Handle start_all_gather(int group, dtsim::exec::View in, dtsim::exec::View out,
                          std::span<const int> counts) override {
    ++started;
    deferred_.push_back({group, in, out, {counts.begin(), counts.end()}, false});
    return kFirst + static_cast<Handle>(deferred_.size() - 1);
  }
  void all_gather(int group, dtsim::exec::View in, dtsim::exec::View out,
                  std::span<const int> counts) override {
    ++blocking;
    HostOnlyComm::all_gather(group, in, out, counts);
  }
  void finish(Handle handle) override {
    if (handle < kFirst) return;
    Gather& g = deferred_.at(static_cast<std::size_t>(handle - kFirst));
    if (!g.done) HostOnlyComm::all_gather(g.group, g.in, g.out, g.counts);
    g.done = true;
  }
  bool all_finished() const {
    return std::all_of(deferred_.begin(), deferred_.end(), [](const Gather& g) { return g.done; });
  }

 private:
  static constexpr Handle kFirst = 1000;  // the stand-in's other handles are 0
  struct Gather {
    int group;
    dtsim::exec::View in, out;
    std::vector<int> counts;
    bool done;
  };
  std::vector<Gather> deferred_;
};

}  // namespace

TEST_CASE("ZeRO's weight gathers start ahead and are waited for before their weights are read",
          "[exec][runner]") {
  // tiny-gpt at dp 2, two steps: ZeRO-3's gathers before each unit and ZeRO-1's of the updated
  // weights at the step's end start, and land only when the runner waits for them (at the
  // first task that depends on them, or the step's end): the losses are those of a peer whose
  // gathers land at once, bit for bit, and finite (the CPU device fills tensors made for
  // overwriting with NaN). Where the next unit is the same layer's (the head's for its
  // backward, the embedding's for the next micro-batch) it keeps the weights the unit before
  // read: nothing is gathered again, so no gather blocks. A mixture of experts gathers a unit's
  // dense and expert weights apart, its first task waiting for the experts' gather, issued second
  // on the data-parallel stream: done in that order.
  const char* moe = DTSIM_TEST_REPO_DIR "/tests/exec/mpi/tiny_moe.json";
  for (const char* model : {"tiny-gpt", moe}) {
    const auto spec = dtsim::model::load_model(model);
    auto p = single_rank(1, 4);
    p.dp = 2;
    const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 2);
    for (const int stage : {1, 3}) {
      INFO(model << ", ZeRO-" << stage);
      p.zero_stage = stage;
      const auto program = all_ranks(g, p);
      dtsim::exec::RunOptions o;
      o.steps = 2;
      o.warmup_steps = 0;
      dtsim::exec::cpu::CpuDevice at_once_device(/*poison_unwritten=*/true),
          deferred_device(/*poison_unwritten=*/true);
      HostOnlyComm at_once;
      DeferredGatherComm deferred;
      const auto expected = dtsim::exec::run_program(g, program, o, at_once, at_once_device);
      const auto r = dtsim::exec::run_program(g, program, o, deferred, deferred_device);
      REQUIRE(r.losses.size() == 2);
      CHECK(std::isfinite(r.losses[1]));
      CHECK(r.losses == expected.losses);
      CHECK(deferred.all_finished());
      CHECK(deferred.started > 0);
      CHECK(deferred.blocking == 0);
    }
  }
}

namespace {

// Rank 0 of a data-parallel pair, its peer a stand-in: the bytes its device holds when the
// first step is over (at the first report of the step's loss).
class ResidentRecordingComm final : public HostOnlyComm {
 public:
  explicit ResidentRecordingComm(const dtsim::exec::Device& device) : device_(device) {}
  std::optional<std::int64_t> resident;
  void all_ranks(std::span<double>, dtsim::exec::Reduce) override {
    if (!resident) resident = device_.memory_use().in_use;
  }

 private:
  const dtsim::exec::Device& device_;
};

}  // namespace

TEST_CASE("ZeRO-1/2 keep a GEMM weight's fp32 master as the rank's slice on the bf16 path",
          "[exec][runner]") {
  // tiny-gpt at dp 2 on the bf16 path, between steps: against ZeRO-0, ZeRO-1 holds half of
  // every tensor's AdamW moments (8 bytes an element) and half of a linear layer's fp32 master
  // (4 bytes), its 16-bit working copy whole, as Megatron-LM's distributed optimizer keeps an
  // fp32 shard beside full 16-bit weights; the tensors read in fp32 (the embedding table,
  // positions, norms, biases) stay whole. ZeRO-2 also keeps half of the gradients, as
  // their reduced slices. (tiny-gpt's tensors have even sizes: rank 0's slice is half.)
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const auto [all, gemm] = tiny_gpt_params(spec);
  std::map<int, std::int64_t> resident;
  for (const int stage : {0, 1, 2}) {
    dtsim::exec::cpu::Bf16Device device;
    ResidentRecordingComm comm(device);
    run_dp2_step(spec, stage, /*zero_in_place=*/false, comm, device);
    REQUIRE(comm.resident.has_value());
    resident[stage] = *comm.resident;
  }
  CHECK(resident[0] - resident[1] == 8 * all / 2 + 4 * gemm / 2);
  CHECK(resident[1] - resident[2] == 4 * all - 4 * all / 2);
}

namespace {

// Rank 1 of a data-parallel pair, its peer a stand-in: whether each ZeRO reduce-scatter and
// all-gather ran in place (this rank's part at its place in the whole), and their elements.
class InPlaceRecordingComm final : public HostOnlyComm {
 public:
  int rank() const override { return 1; }
  std::int64_t scattered = 0, gathered = 0;
  bool all_in_place = true;
  Handle start_reduce_scatter(int, dtsim::exec::View in, dtsim::exec::View out,
                              std::span<const int> counts) override {
    scattered += in.n;
    all_in_place = all_in_place && out.p == in.sub(counts[0], counts[1]).p;
    return 0;
  }
  void all_gather(int, dtsim::exec::View in, dtsim::exec::View out,
                  std::span<const int> counts) override {
    gathered += out.n;
    all_in_place = all_in_place && in.p == out.sub(counts[0], counts[1]).p;
  }
};

}  // namespace

TEST_CASE("ZeRO-1 in place reduce-scatters and gathers where the tensors lie", "[exec][runner]") {
  // tiny-gpt at dp 2 with zero_in_place (Megatron-LM's distributed optimizer): every gradient
  // reduce-scatter leaves rank 1's sums at its place in the gradient buffer and every gather
  // of the updated weights takes its part from its place in the weight buffer, on the fp32
  // and bf16 paths; each carries every tensor once a step.
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const std::int64_t all = tiny_gpt_params(spec).all;
  for (const bool bf16 : {false, true}) {
    INFO((bf16 ? "bf16" : "fp32"));
    dtsim::exec::cpu::Bf16Device bf16_device;
    dtsim::exec::cpu::CpuDevice fp32_device;
    InPlaceRecordingComm comm;
    run_dp2_step(spec, 1, /*zero_in_place=*/true, comm,
                 bf16 ? static_cast<dtsim::exec::Device&>(bf16_device) : fp32_device);
    CHECK(comm.all_in_place);
    CHECK(comm.scattered == all);
    CHECK(comm.gathered == all);
  }
}

namespace {

// Rank 0 of two pipeline stages, its peer a stand-in (receives leave the buffers as they are):
// records the point-to-point calls in order.
class RecordingComm final : public HostOnlyComm {
 public:
  std::vector<std::string> calls;
  void send(int, std::int64_t, dtsim::exec::View) override { calls.emplace_back("send"); }
  void recv(int, std::int64_t, dtsim::exec::View) override { calls.emplace_back("recv"); }
  Handle start_recv(int, std::int64_t, dtsim::exec::View) override {
    calls.emplace_back("start_recv");
    return 0;
  }
  void finish_sends() override { calls.emplace_back("finish_sends"); }
};

}  // namespace

TEST_CASE("without p2p overlap the sender waits for its sends where the program says so",
          "[exec][runner]") {
  const auto spec = dtsim::model::load_model("tiny-gpt");
  auto p = single_rank(1, 4);
  p.pp = 2;
  p.schedule = dtsim::plan::Schedule::OneFOneB;
  const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 2);
  for (const bool overlap : {false, true}) {
    INFO((overlap ? "overlapped" : "blocking"));
    p.overlap_p2p_comm = overlap;
    const auto program = all_ranks(g, p);
    // The compute tasks of rank 0 that wait for sends (the lowering's blocking exchange).
    const auto& tasks = program.ranks[0].tasks;
    int holding = 0;
    for (const auto& t : tasks) {
      if (t.kind != dtsim::lower::TaskKind::Compute) continue;
      holding += std::any_of(t.deps.begin(), t.deps.end(), [&](dtsim::lower::TaskId d) {
        return tasks[static_cast<std::size_t>(d)].kind == dtsim::lower::TaskKind::Send;
      });
    }
    CHECK((holding > 0) == !overlap);
    RecordingComm comm;
    dtsim::exec::RunOptions o;
    o.steps = 1;
    dtsim::exec::run_program(g, program, o, comm);
    CHECK(std::count(comm.calls.begin(), comm.calls.end(), "finish_sends") == holding);
    // Stage 0 sends 4 micro-batches' activations, and each wait comes right after a send (the
    // exchange after a forward pass: its send, then the wait before the backward pass).
    CHECK(std::count(comm.calls.begin(), comm.calls.end(), "send") == 4);
    for (std::size_t i = 0; i < comm.calls.size(); ++i) {
      if (comm.calls[i] != "finish_sends") continue;
      REQUIRE(i > 0);
      CHECK((comm.calls[i - 1] == "send" || comm.calls[i - 1] == "recv"));
    }
  }
}

namespace {

// Rank 0 of two, whose peer is slow: a started collective and the blocking sends complete only
// 30 ms after the runner waits for them.
class SlowPeerComm final : public HostOnlyComm {
 public:
  void finish(Handle) override { std::this_thread::sleep_for(std::chrono::milliseconds(30)); }
  void finish_sends() override { std::this_thread::sleep_for(std::chrono::milliseconds(30)); }
  void wait_sends() override { std::this_thread::sleep_for(std::chrono::milliseconds(30)); }
};

// The shortest measured time of rank 0's tasks of `kind` in one step of tiny-gpt under `p`,
// over `comm`, on `device` (else the CPU).
double shortest(const dtsim::plan::Plan& p, dtsim::lower::TaskKind kind, dtsim::exec::Comm& comm,
                dtsim::exec::Device* device = nullptr) {
  const dtsim::model::ModelGraph g(dtsim::model::load_model("tiny-gpt"), p.micro_batch_size,
                                   p.seq_len, 2);
  const auto program = all_ranks(g, p);
  dtsim::exec::RunOptions o;
  o.steps = 1;
  o.warmup_steps = 0;
  const auto r = device ? dtsim::exec::run_program(g, program, o, comm, *device)
                        : dtsim::exec::run_program(g, program, o, comm);
  double s = 1e9;
  for (const auto& t : r.tasks) {
    if (program.ranks[0].tasks[static_cast<std::size_t>(t.task)].kind == kind) {
      s = std::min(s, t.end_s - t.start_s);
    }
  }
  CHECK(s < 1e9);  // there was one
  return s;
}

// Data-parallel buckets, their collectives started and overlapped with the backward pass.
dtsim::plan::Plan dp2_buckets() {
  auto p = single_rank(1, 2);
  p.dp = 2;
  p.global_batch_size = 4;
  return p;
}

// Blocking pipeline sends that the next round waits for.
dtsim::plan::Plan pp2_sends() {
  auto p = single_rank(1, 4);
  p.pp = 2;
  p.schedule = dtsim::plan::Schedule::OneFOneB;
  return p;
}

}  // namespace

TEST_CASE("a started collective and a blocking send are timed until they complete",
          "[exec][runner]") {
  SlowPeerComm comm;
  CHECK(shortest(dp2_buckets(), dtsim::lower::TaskKind::Collective, comm) >= 0.03);
  CHECK(shortest(pp2_sends(), dtsim::lower::TaskKind::Send, comm) >= 0.03);
}

namespace {

// Rank 0 of two on a device that queues its work (a GPU's stand-in), whose started collectives
// and sends go to a stream of their own: with `marks`, the device marks there (two taken at
// once: the transfer takes no time), and then 0.1 s more of launching, which the marks around
// the launch on the device's own stream count.
class StreamedComm final : public HostOnlyComm {
 public:
  StreamedComm(dtsim::exec::Device& device, bool marks) : device_(device), marks_(marks) {}
  bool moves_device_memory() const override { return true; }
  Handle start_all_reduce(int, dtsim::exec::View) override {
    queue();
    return 0;
  }
  Handle start_reduce_scatter(int, dtsim::exec::View, dtsim::exec::View,
                              std::span<const int>) override {
    queue();
    return 0;
  }
  void send(int, std::int64_t, dtsim::exec::View) override { queue(); }
  std::optional<TransferMarks> take_transfer_marks() override {
    return std::exchange(taken_, std::nullopt);
  }

 private:
  void queue() {
    if (marks_) {
      const int start = device_.mark(), end = device_.mark();
      if (!taken_) taken_ = TransferMarks{start, start};
      taken_->end = end;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  dtsim::exec::Device& device_;
  bool marks_;
  std::optional<TransferMarks> taken_;
};

}  // namespace

TEST_CASE(
    "on a device that queues work, a started collective and a send are timed by their "
    "own stream's marks",
    "[exec][runner]") {
  // With the backend's marks on its stream, or without (the marks around the launch).
  auto shortest_of = [](const dtsim::plan::Plan& p, dtsim::lower::TaskKind kind, bool marks) {
    dtsim::exec::cpu::Bf16Device device(/*host_memory=*/false);  // queued: timed by marks
    StreamedComm comm(device, marks);
    return shortest(p, kind, comm, &device);
  };
  CHECK(shortest_of(dp2_buckets(), dtsim::lower::TaskKind::Collective, true) < 0.05);
  CHECK(shortest_of(dp2_buckets(), dtsim::lower::TaskKind::Collective, false) >= 0.1);
  CHECK(shortest_of(pp2_sends(), dtsim::lower::TaskKind::Send, true) < 0.05);
  CHECK(shortest_of(pp2_sends(), dtsim::lower::TaskKind::Send, false) >= 0.1);
}

TEST_CASE("the CPU device counts the memory it hands out, its peak and its pool", "[exec][cpu]") {
  dtsim::exec::cpu::CpuDevice device;
  using Dtype = dtsim::exec::Dtype;
  CHECK(device.memory_use().peak == 0);
  const auto a = device.allocate(1000, Dtype::F32);
  const auto b = device.allocate(500, Dtype::F32);
  CHECK(device.memory_use().in_use == 1500 * 4);
  device.release(a);
  CHECK(device.memory_use().in_use == 500 * 4);
  // A smaller request reuses the released buffer whole: the pool does not grow, and what is in
  // use is the tensors' bytes.
  const auto c = device.allocate(800, Dtype::F32);
  const auto use = device.memory_use();
  CHECK(use.in_use == 1300 * 4);
  CHECK(use.peak == 1500 * 4);
  CHECK(use.reserved == 1500 * 4);
  device.release(b);
  device.release(c);
  CHECK(device.memory_use().in_use == 0);
  CHECK(device.memory_use().reserved == 1500 * 4);
}

namespace {

// One step of every program of plan `p` (model `name`, fp32) run alone with its communication
// replayed (--only-rank), each on a CPU device of its own: the steps' losses, program after
// program, and the largest peak of tensor bytes.
struct Replayed {
  std::vector<double> losses;
  std::int64_t peak_bytes = 0;
};
// A model as loaded, with dropout, or with its MLPs as a mixture of 4 experts (top 2, each
// half the MLP's width).
// ManyExperts: 64 experts of a quarter the MLP's width, top 1, so that some get no token.
// SharedMoe: Moe's experts with gates over all of them (their logits kept for the backward),
// beside shared experts of the MLP's width.
// MixedMoe: SharedMoe's blocks in the odd blocks, dense MLPs of 1.5 times the MLP's width in the
// even ones (Llama 4 Maverick's layout).
enum class Variant { AsIs, Dropout, Moe, ManyExperts, SharedMoe, MixedMoe };

dtsim::model::ModelSpec load(const char* name, Variant variant) {
  auto spec = dtsim::model::load_model(name);
  if (variant == Variant::Dropout) spec.dropout = true;
  if (variant == Variant::Moe) spec.moe = dtsim::test::mixture(4, 2, spec.ffn_hidden / 2);
  if (variant == Variant::ManyExperts) spec.moe = dtsim::test::mixture(64, 1, spec.ffn_hidden / 4);
  if (variant == Variant::SharedMoe || variant == Variant::MixedMoe) {
    const std::int64_t f = spec.ffn_hidden;
    spec.moe = dtsim::test::mixture(4, 2, f / 2, f, false);
    if (variant == Variant::MixedMoe) {
      for (std::int64_t l = 0; l < spec.layers; l += 2) spec.moe->dense_blocks.push_back(l);
      spec.moe->dense_ffn_hidden = f + f / 2;
    }
  }
  return spec;
}

Replayed replay_every_program(const char* name, dtsim::plan::Plan p, bool keep_tensors,
                              int steps = 1, Variant variant = Variant::AsIs) {
  p.precision = dtsim::Precision::Fp32;
  const auto spec = load(name, variant);
  const dtsim::model::ModelGraph g(spec, p.micro_batch_size, p.seq_len, 4, p.attention);
  const auto program = dtsim::lower::lower(g, p);
  Replayed out;
  for (std::size_t index = 0; index < program.ranks.size(); ++index) {
    dtsim::exec::cpu::CpuDevice device;
    dtsim::exec::RunOptions o;
    o.steps = steps;
    o.warmup_steps = 0;
    o.program_index = static_cast<int>(index);
    o.replay_communication = p.devices() > 1;
    o.keep_tensors = keep_tensors;
    dtsim::exec::SingleRankComm comm;
    const auto r = dtsim::exec::run_program(g, program, o, comm, device);
    out.losses.insert(out.losses.end(), r.losses.begin(), r.losses.end());
    out.peak_bytes = std::max(out.peak_bytes, device.memory_use().peak);
  }
  return out;
}

dtsim::plan::Plan cpu_plan(std::int64_t tp, std::int64_t pp, std::int64_t dp) {
  dtsim::plan::Plan p;
  p.tp = tp;
  p.pp = pp;
  p.dp = dp;
  p.micro_batch_size = 4;
  p.global_batch_size = 8;
  p.seq_len = 128;
  return p;
}

}  // namespace

TEST_CASE("tensors go back once nothing later reads them: the same numbers, less memory",
          "[exec][runner]") {
  // Each plan once with every tensor of a micro-batch kept to its last task, once with the
  // early releases: bit-identical losses (a tensor released too early would be read as
  // another's data or made again as zeros), and a lower peak.
  struct Case {
    const char* label;
    const char* model;
    dtsim::plan::Plan plan;
    Variant variant = Variant::AsIs;
  };
  std::vector<Case> cases;
  auto add = [&](const char* label, const char* model, auto&& change,
                 Variant variant = Variant::AsIs) {
    dtsim::plan::Plan p = single_rank(2, 4);
    change(p);
    cases.push_back({label, model, p, variant});
  };
  add("one rank", "tiny-gpt", [](auto&) {});
  add("full recompute", "tiny-gpt", [](auto& p) { p.recompute = dtsim::plan::Recompute::Full; });
  add("selective recompute, RoPE", "tiny",
      [](auto& p) { p.recompute = dtsim::plan::Recompute::Selective; });
  add("tp 2, sequence parallel", "tiny", [](auto& p) {
    p.tp = 2;
    p.sequence_parallel = true;
  });
  add("pp 2 zero-bubble, sequence parallel", "tiny", [](auto& p) {
    p.tp = 2;
    p.pp = 2;
    p.sequence_parallel = true;
    p.schedule = dtsim::plan::Schedule::ZeroBubble;
    p.global_batch_size = 8;
  });
  add("pp 2 interleaved", "tiny", [](auto& p) {
    p.pp = 2;
    p.virtual_stages = 2;
    p.schedule = dtsim::plan::Schedule::Interleaved;
    p.global_batch_size = 8;
  });
  add("dp 2 ZeRO-3, full recompute", "tiny-gpt", [](auto& p) {
    p.dp = 2;
    p.zero_stage = 3;
    p.recompute = dtsim::plan::Recompute::Full;
  });
  add("cp 2, learned positions", "tiny-gpt", [](auto& p) { p.cp = 2; });
  add("cp 2 tp 2, RoPE, selective recompute", "tiny", [](auto& p) {
    p.cp = 2;
    p.tp = 2;
    p.recompute = dtsim::plan::Recompute::Selective;
  });
  // Dropout's masks: made by the embedding (one rank), after its tp all-reduce or its
  // sequence-parallel reduce-scatter, by the residuals and the attention core.
  add(
      "dropout", "tiny-gpt", [](auto&) {}, Variant::Dropout);
  add(
      "dropout, tp 2", "tiny-gpt", [](auto& p) { p.tp = 2; }, Variant::Dropout);
  add(
      "dropout, tp 2 sequence parallel, cp 2, selective recompute", "tiny-gpt",
      [](auto& p) {
        p.tp = 2;
        p.cp = 2;
        p.sequence_parallel = true;
        p.recompute = dtsim::plan::Recompute::Selective;
      },
      Variant::Dropout);
  // A mixture of experts: the router's routing, the experts' copies and their gates' gradient;
  // ZeRO-3 gathers dense and expert weights in gathers of their own.
  add(
      "mixture of experts, pp 2 zero-bubble", "tiny",
      [](auto& p) {
        p.pp = 2;
        p.schedule = dtsim::plan::Schedule::ZeroBubble;
        p.global_batch_size = 8;
      },
      Variant::Moe);
  add(
      "mixture of experts, dp 2 ZeRO-3, full recompute", "tiny",
      [](auto& p) {
        p.dp = 2;
        p.zero_stage = 3;
        p.recompute = dtsim::plan::Recompute::Full;
      },
      Variant::Moe);
  // Shared experts beside them, and gates over all experts: the router's logits kept from the
  // forward (routed again by full recompute) to the backward, both zero-bubble passes.
  add(
      "shared experts, gates over all, pp 2 zero-bubble", "tiny",
      [](auto& p) {
        p.pp = 2;
        p.schedule = dtsim::plan::Schedule::ZeroBubble;
        p.global_batch_size = 8;
      },
      Variant::SharedMoe);
  add(
      "shared experts, gates over all, dp 2 ZeRO-3, full recompute", "tiny",
      [](auto& p) {
        p.dp = 2;
        p.zero_stage = 3;
        p.recompute = dtsim::plan::Recompute::Full;
      },
      Variant::SharedMoe);
  // Dense blocks between the experts': a stage of each kind at pp 2 (tiny's two blocks).
  add(
      "dense blocks among the experts', pp 2 1F1B, tp 2 with sequence parallelism", "tiny",
      [](auto& p) {
        p.pp = 2;
        p.tp = 2;
        p.sequence_parallel = true;
        p.global_batch_size = 8;
      },
      Variant::MixedMoe);
  // Experts without tokens in a micro-batch: no GEMM, and under ZeRO-2 a gradient made (as
  // zeros) only when its bucket is reduce-scattered.
  add(
      "64 experts, top 1, dp 2 ZeRO-2", "tiny",
      [](auto& p) {
        p.dp = 2;
        p.zero_stage = 2;
      },
      Variant::ManyExperts);
  for (const auto& c : cases) {
    INFO(c.label);
    const auto kept = replay_every_program(c.model, c.plan, /*keep_tensors=*/true, 2, c.variant);
    const auto released =
        replay_every_program(c.model, c.plan, /*keep_tensors=*/false, 2, c.variant);
    REQUIRE(kept.losses.size() == released.losses.size());
    for (std::size_t i = 0; i < kept.losses.size(); ++i) {
      CHECK(released.losses[i] == kept.losses[i]);
    }
    CHECK(released.peak_bytes < kept.peak_bytes);
  }
}

TEST_CASE("the executor holds what dtsim memory predicts for the CPU plans", "[exec][runner]") {
  // The peak of tensor bytes of the busiest program (one step, communication replayed, a ZeRO
  // reduce-scatter's buffers held as the real one holds them) against dtsim memory's busiest
  // stage without its framework allowance, on the CPU benchmark model: weights, gradients and
  // AdamW state as ZeRO shards them, activations as the schedule and recompute keep them, and
  // the moment of the peak. Measured on this model (sixteenth session, predicted against
  // measured): -3.5% (zero-bubble) to +2.1% (full recompute), most within 0.1%; the same as
  // the MPI runs of bench/memory_validation.sh.
  using dtsim::plan::Recompute;
  using dtsim::plan::Schedule;
  struct Case {
    const char* label;
    dtsim::plan::Plan plan;
    Variant variant = Variant::AsIs;
  };
  std::vector<Case> cases;
  auto add = [&](const char* label, std::int64_t tp, std::int64_t pp, std::int64_t dp,
                 auto&& change, Variant variant = Variant::AsIs) {
    dtsim::plan::Plan p = cpu_plan(tp, pp, dp);
    change(p);
    cases.push_back({label, p, variant});
  };
  add("one rank", 1, 1, 1, [](auto&) {});
  add("full recompute", 1, 1, 1, [](auto& p) { p.recompute = Recompute::Full; });
  add("selective recompute", 1, 1, 1, [](auto& p) { p.recompute = Recompute::Selective; });
  add("dp 2 ZeRO-1", 1, 1, 2, [](auto& p) { p.zero_stage = 1; });
  add("dp 2 ZeRO-2", 1, 1, 2, [](auto& p) { p.zero_stage = 2; });
  add("dp 2 ZeRO-3", 1, 1, 2, [](auto& p) { p.zero_stage = 3; });
  // ZeRO-2's full gradients of a bucket outgrow what full recompute keeps (the model adds the
  // difference; it was +16% without it).
  add("dp 2 ZeRO-2, full recompute", 1, 1, 2, [](auto& p) {
    p.zero_stage = 2;
    p.recompute = Recompute::Full;
  });
  add("tp 2 sequence parallel", 2, 1, 1, [](auto& p) { p.sequence_parallel = true; });
  add("pp 2 GPipe", 1, 2, 1, [](auto& p) { p.schedule = Schedule::GPipe; });
  add("pp 2 1F1B", 1, 2, 1, [](auto&) {});
  add("pp 2 zero-bubble", 1, 2, 1, [](auto& p) { p.schedule = Schedule::ZeroBubble; });
  add("cp 2", 1, 1, 1, [](auto& p) { p.cp = 2; });
  // Dropout's masks (a byte per element) and the attention probabilities after it.
  add(
      "dropout", 1, 1, 1, [](auto&) {}, Variant::Dropout);
  add(
      "dropout, tp 2 sequence parallel", 2, 1, 1, [](auto& p) { p.sequence_parallel = true; },
      Variant::Dropout);
  // FlashAttention: the rows' log-sum-exp instead of the probabilities (and their masks).
  const auto flash = [](auto& p) { p.attention = dtsim::model::AttentionKernel::Flash; };
  add("flash attention", 1, 1, 1, flash);
  add("flash attention, pp 2 1F1B", 1, 2, 1, flash);
  add("flash attention, dropout", 1, 1, 1, flash, Variant::Dropout);
  // The router's state and the experts' copies (top 2 of 4, each half the MLP's width).
  add(
      "mixture of experts", 1, 1, 1, [](auto&) {}, Variant::Moe);
  add(
      "mixture of experts, dp 2 ZeRO-1, full recompute", 1, 1, 2,
      [](auto& p) {
        p.zero_stage = 1;
        p.recompute = Recompute::Full;
      },
      Variant::Moe);
  // Dense blocks between the experts' (shared ones beside them): each block's own MLP.
  add(
      "dense blocks among the experts'", 1, 1, 1, [](auto&) {}, Variant::MixedMoe);
  add(
      "dense blocks among the experts', pp 2", 1, 2, 1, [](auto&) {}, Variant::MixedMoe);
  const auto cluster = dtsim::cluster::load_cluster("cpu-host");
  dtsim::plan::MemoryOptions no_allowance;
  no_allowance.framework_overhead_bytes = 0;
  for (auto& c : cases) {
    c.plan.precision = dtsim::Precision::Fp32;
    const auto spec = load("cpu-small", c.variant);
    const dtsim::model::ModelGraph g(spec, c.plan.micro_batch_size, c.plan.seq_len, 4,
                                     c.plan.attention);
    const double predicted =
        dtsim::plan::estimate_memory(
            g, c.plan, dtsim::cluster::with_devices(cluster, c.plan.devices()), no_allowance)
            .worst()
            .total_bytes;
    const auto measured =
        replay_every_program("cpu-small", c.plan, /*keep_tensors=*/false, 1, c.variant);
    INFO(c.label << ": measured " << measured.peak_bytes / 1048576.0 << " MiB, predicted "
                 << predicted / 1048576.0 << " MiB");
    CHECK(static_cast<double>(measured.peak_bytes) == Approx(predicted).epsilon(0.10));
  }
}
