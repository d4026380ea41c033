#include "exec/cpu/calibrate.hpp"

#include <algorithm>
#include <catch2/catch.hpp>

#include "sim/model/model_graph.hpp"

using dtsim::exec::cpu::GemmPass;
using dtsim::exec::cpu::ModelGemm;

TEST_CASE("calibration times each linear op's three GEMMs, whole and split over tp and cp",
          "[calibrate]") {
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  const int T = 32, C = static_cast<int>(spec.hidden), F = static_cast<int>(spec.ffn_hidden);
  auto has = [](const std::vector<ModelGemm>& gemms, ModelGemm want) {
    return std::any_of(gemms.begin(), gemms.end(), [&](const ModelGemm& x) {
      return x.pass == want.pass && x.mkn() == want.mkn();
    });
  };
  const auto whole = dtsim::exec::cpu::model_gemms(g);
  const auto split = dtsim::exec::cpu::model_gemms(g, 2);
  // MLP up [T,C]x[C,F]: forward, input gradient [T,F]x[F,C], weight gradient [C,T]x[T,F].
  CHECK(ModelGemm{T, C, F, GemmPass::Forward}.mkn() == std::array<int, 3>{T, C, F});
  CHECK(ModelGemm{T, C, F, GemmPass::InputGrad}.mkn() == std::array<int, 3>{T, F, C});
  CHECK(ModelGemm{T, C, F, GemmPass::WeightGrad}.mkn() == std::array<int, 3>{C, T, F});
  for (const GemmPass pass : {GemmPass::Forward, GemmPass::InputGrad, GemmPass::WeightGrad}) {
    CHECK(has(whole, {T, C, F, pass}));
    CHECK(!has(whole, {T, C, F / 2, pass}));
    // Column-parallel on tp 2: F / 2 outputs; MLP down row-parallel: F / 2 inputs.
    CHECK(has(split, {T, C, F / 2, pass}));
    CHECK(has(split, {T, F / 2, C, pass}));
  }
  // No duplicates of one GEMM.
  for (std::size_t i = 0; i < split.size(); ++i) {
    for (std::size_t j = i + 1; j < split.size(); ++j) {
      CHECK(!(split[i].pass == split[j].pass && split[i].mkn() == split[j].mkn()));
    }
  }
  // Context parallelism splits the rows (tokens); on 2 ranks cp 2 or tp 2, not both.
  const auto with_cp = dtsim::exec::cpu::model_gemms(g, 2, 2);
  for (const GemmPass pass : {GemmPass::Forward, GemmPass::InputGrad, GemmPass::WeightGrad}) {
    CHECK(has(with_cp, {T, C, F, pass}));
    CHECK(has(with_cp, {T / 2, C, F, pass}));
    CHECK(has(with_cp, {T, C, F / 2, pass}));
    CHECK(!has(with_cp, {T / 2, C, F / 2, pass}));
    CHECK(!has(split, {T / 2, C, F, pass}));
  }
  const auto four = dtsim::exec::cpu::model_gemms(g, 4, 4);
  CHECK(has(four, {T / 2, C, F / 2, GemmPass::Forward}));
  CHECK(has(four, {T / 4, C, F, GemmPass::Forward}));
  CHECK(!has(four, {T / 4, C, F / 2, GemmPass::Forward}));
  // What a calibration times besides its own squares: one GEMM per {m, k, n}, none of theirs,
  // every {m, k, n} of the split GEMMs covered.
  const std::vector<std::array<int, 3>> squares = {{T, C, F}, {64, 64, 64}};
  const auto timed = dtsim::exec::cpu::gemms_to_time(g, 2, squares);
  for (std::size_t i = 0; i < timed.size(); ++i) {
    CHECK(std::find(squares.begin(), squares.end(), timed[i].mkn()) == squares.end());
    for (std::size_t j = i + 1; j < timed.size(); ++j) CHECK(timed[i].mkn() != timed[j].mkn());
  }
  for (const ModelGemm& x : split) {
    const bool covered = std::find(squares.begin(), squares.end(), x.mkn()) != squares.end() ||
                         std::any_of(timed.begin(), timed.end(),
                                     [&](const ModelGemm& y) { return y.mkn() == x.mkn(); });
    CHECK(covered);
  }
}

TEST_CASE("op rates: the loss statistics have a forward row only", "[calibrate]") {
  const auto spec = dtsim::model::load_model("tiny-gpt");
  const dtsim::model::ModelGraph g(spec, 1, 32);
  const auto rows =
      dtsim::exec::cpu::op_rate_rows(g, {{"loss_statistics", 2e-3, 0.0}, {"loss", 4e-3, 1e-3}});
  REQUIRE(rows.size() == 3);
  const auto& head = g.layer_ops(static_cast<int>(spec.layers));
  const auto& statistics = g.op(head[2]);
  const auto& loss = g.op(head[3]);
  CHECK(rows[0]["op"] == "loss_statistics");
  CHECK(rows[0]["phase"] == "fwd");
  CHECK(rows[0]["bytes_per_s"].get<double>() == Approx(statistics.fwd_bytes / 2e-3));
  CHECK(rows[1]["phase"] == "fwd");
  CHECK(rows[1]["bytes_per_s"].get<double>() == Approx(loss.fwd_bytes / 4e-3));
  CHECK(rows[2]["op"] == "loss");
  CHECK(rows[2]["phase"] == "bwd");
  CHECK(rows[2]["bytes_per_s"].get<double>() == Approx(loss.bwd_bytes / 1e-3));
}

TEST_CASE("the activation is timed at the shape of the op its rate is priced by", "[calibrate]") {
  // Layer 0's first activation: a dense model's MLP, a mixture's experts on the top_k copies of
  // each token, or a dense block's MLP of its own width where block 0 is dense (Maverick's).
  const auto shape = [](const char* model) {
    const dtsim::model::ModelGraph g(dtsim::model::load_model(model), 2, 16);
    const auto s = dtsim::exec::cpu::priced_activation(g);
    return std::pair{s.rows, s.width};
  };
  CHECK(shape("llama3-8b") == std::pair<std::int64_t, std::int64_t>{32, 14336});
  CHECK(shape("qwen2-57b-a14b") == std::pair<std::int64_t, std::int64_t>{32 * 8, 2560});
  CHECK(shape("llama4-maverick-17b-128e") == std::pair<std::int64_t, std::int64_t>{32, 16384});
}

TEST_CASE("calibration times the GEMMs of each kind of block", "[calibrate]") {
  // Maverick's block 0 is dense: the router and the shared experts of block 1 have GEMMs of
  // their own shapes (the experts' are not timed).
  const auto spec = dtsim::model::load_model("llama4-maverick-17b-128e");
  const dtsim::model::ModelGraph g(spec, 1, 64);
  const auto gemms = dtsim::exec::cpu::model_gemms(g);
  const auto has = [&](int K, int N) {
    return std::any_of(gemms.begin(), gemms.end(), [&](const ModelGemm& m) {
      return m.pass == GemmPass::Forward && m.T == 64 && m.K == K && m.N == N;
    });
  };
  CHECK(has(5120, 2 * 16384));  // the dense blocks' MLP up (gate and up)
  CHECK(has(5120, 128));        // the router
  CHECK(has(5120, 2 * 8192));   // the shared expert's up
  CHECK(has(8192, 5120));       // and down
}
