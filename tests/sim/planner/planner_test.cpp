#include "sim/planner/planner.hpp"

#include "sim/plan/memory_model.hpp"
#include "tests/test_util.hpp"

using dtsim::planner::SearchOptions;
using dtsim::planner::SearchSpace;

namespace {

SearchSpace small_space() {
  SearchSpace s;
  s.global_batch_size = 32;
  s.seq_len = 1024;
  s.micro_batch_sizes = {1, 2, 4};
  return s;
}

}  // namespace

TEST_CASE("two tiers find the plan that brute-force simulation finds", "[planner]") {
  // GPT-2 on 8 A100s: every feasible candidate simulated vs the default refinement.
  const auto spec = dtsim::model::load_model("gpt2-124m");
  const auto cluster = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("default"), 8);
  SearchOptions all;
  all.refine = 1 << 20;
  const auto brute = dtsim::planner::search(spec, cluster, small_space(), all);
  const auto fast = dtsim::planner::search(spec, cluster, small_space(), SearchOptions{});
  REQUIRE(brute.feasible > 50);
  CHECK(brute.refined == static_cast<int>(brute.feasible));
  INFO("brute force best " << dtsim::plan::summary(brute.ranked[0].plan) << " "
                           << brute.ranked[0].step_time_s << " s; two tiers "
                           << dtsim::plan::summary(fast.ranked[0].plan) << " "
                           << fast.ranked[0].step_time_s << " s");
  CHECK(fast.ranked[0].step_time_s == brute.ranked[0].step_time_s);
  CHECK(fast.evaluated == brute.evaluated);
}

TEST_CASE("what the planner says fits, the memory model says fits", "[planner][memory]") {
  const auto spec = dtsim::model::load_model("llama2-13b");
  const auto cluster = dtsim::cluster::with_devices(dtsim::cluster::load_cluster("default"), 16);
  SearchSpace space;
  space.global_batch_size = 64;
  space.seq_len = 4096;
  SearchOptions options;
  options.refine = 2;
  const auto r = dtsim::planner::search(spec, cluster, space, options);
  REQUIRE(!r.ranked.empty());
  REQUIRE(r.best_not_fitting);
  for (const auto& c : r.ranked) {
    const dtsim::model::ModelGraph g(spec, c.plan.micro_batch_size, c.plan.seq_len);
    CHECK(dtsim::plan::estimate_memory(g, c.plan, cluster).fits);
  }
  const auto& c = *r.best_not_fitting;
  const dtsim::model::ModelGraph g(spec, c.plan.micro_batch_size, c.plan.seq_len);
  CHECK_FALSE(dtsim::plan::estimate_memory(g, c.plan, cluster).fits);
}

TEST_CASE("the result is the same for any thread count", "[planner]") {
  const auto spec = dtsim::model::load_model("llama3-8b");
  const auto cluster = dtsim::cluster::load_cluster("default");
  SearchSpace space;
  space.global_batch_size = 128;
  SearchOptions one, two;
  one.threads = 1;
  two.threads = 2;
  one.refine = two.refine = 3;
  const auto a = dtsim::planner::search(spec, cluster, space, one);
  const auto b = dtsim::planner::search(spec, cluster, space, two);
  REQUIRE(a.ranked.size() == b.ranked.size());
  for (std::size_t i = 0; i < a.ranked.size(); ++i) {
    CHECK(dtsim::plan::summary(a.ranked[i].plan) == dtsim::plan::summary(b.ranked[i].plan));
    CHECK(a.ranked[i].step_time_s == b.ranked[i].step_time_s);
  }
}

TEST_CASE("Megatron SC'21 rows: the best plan fits and beats the paper's configuration",
          "[planner][validation]") {
  // Table 1 rows 1 and 4: GPT 1.7B on 32 GPUs (tp 1, pp 1) and 18.4B on 256 (tp 8, pp 1),
  // global batch 512 and 1024, sequence 2048. The paper's configuration: its tp/pp/dp,
  // micro-batch 1, full recompute.
  struct Row {
    const char* model;
    int gpus, tp, pp;
    std::int64_t batch;
  };
  for (const Row& row :
       {Row{"megatron-1.7b", 32, 1, 1, 512}, Row{"megatron-18.4b", 256, 8, 1, 1024}}) {
    DYNAMIC_SECTION(row.model) {
      const auto spec = dtsim::model::load_model(row.model);
      const auto cluster =
          dtsim::cluster::with_devices(dtsim::cluster::load_cluster("selene"), row.gpus);
      SearchSpace space;
      space.global_batch_size = row.batch;
      SearchOptions options;
      options.refine = 4;
      const auto r = dtsim::planner::search(spec, cluster, space, options);
      REQUIRE(!r.ranked.empty());
      const auto& best = r.ranked.front();
      CHECK(best.fits);
      dtsim::plan::Plan paper;
      paper.tp = row.tp;
      paper.pp = row.pp;
      paper.dp = row.gpus / (row.tp * row.pp);
      paper.micro_batch_size = 1;
      paper.global_batch_size = row.batch;
      paper.seq_len = 2048;
      paper.recompute = dtsim::plan::Recompute::Full;
      const dtsim::model::ModelGraph g(spec, 1, 2048);
      auto net = dtsim::network::make_analytical(cluster);
      const auto theirs = dtsim::engine::simulate(g, paper, cluster, *net).prediction;
      INFO("planner " << dtsim::plan::summary(best.plan) << " " << best.step_time_s
                      << " s; paper's plan " << theirs.step_time_s << " s");
      CHECK(best.step_time_s <= theirs.step_time_s);
    }
  }
}
