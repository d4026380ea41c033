// The in_run steps of dtexec calibrate on a device of bounded memory: as many of the model's
// blocks as dtsim memory says fit, at most the cap, none when one does not fit.
#include "exec/core/in_run.hpp"

#include "sim/plan/memory_model.hpp"
#include "tests/test_util.hpp"

namespace {

double needs(const dtsim::model::ModelGraph& g) {
  dtsim::plan::MemoryOptions memory;
  memory.framework_overhead_bytes = 0;
  return dtsim::plan::estimate_memory(g, dtsim::exec::in_run_plan(g, dtsim::Precision::Bf16),
                                      dtsim::cluster::Cluster{}, memory)
      .worst()
      .total_bytes;
}

}  // namespace

TEST_CASE("in_run trains as many blocks as fit, up to the cap", "[runner]") {
  const auto spec = dtsim::model::load_model("llama3-8b");
  const double gib = 1024.0 * 1024 * 1024;
  using dtsim::exec::in_run_graph;
  // An H200's 80%: the cap, 8 of 32 blocks, well inside it.
  const auto h200 = in_run_graph(spec, 1, 4096, dtsim::Precision::Bf16, 0.8 * 141 * gib);
  REQUIRE(h200);
  CHECK(h200->spec().layers == 8);
  CHECK(h200->seq_len() == 4096);
  CHECK(needs(*h200) < 0.8 * 141 * gib);
  // 40 GiB: fewer, and the largest count that fits.
  const auto small = in_run_graph(spec, 1, 4096, dtsim::Precision::Bf16, 40 * gib);
  REQUIRE(small);
  const std::int64_t blocks = small->spec().layers;
  CHECK(blocks >= 1);
  CHECK(blocks < 8);
  CHECK(needs(*small) <= 40 * gib);
  auto more = spec;
  more.layers = blocks + 1;
  CHECK(needs(dtsim::model::ModelGraph(more, 1, 4096, 2)) > 40 * gib);
  // 4 GiB: not even the embedding, the head and one block with their AdamW state.
  CHECK_FALSE(in_run_graph(spec, 1, 4096, dtsim::Precision::Bf16, 4 * gib));
  // A model with fewer blocks than the cap trains them all.
  const auto tiny = dtsim::model::load_model("tiny-gpt");
  const auto all = in_run_graph(tiny, 1, 32, dtsim::Precision::Bf16, gib);
  REQUIRE(all);
  CHECK(all->spec().layers == std::min<std::int64_t>(tiny.layers, 8));
}
