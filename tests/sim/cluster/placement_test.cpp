#include "sim/cluster/placement.hpp"

#include <algorithm>

#include "sim/common/error.hpp"
#include "tests/test_util.hpp"

using dtsim::cluster::group_span;
using dtsim::cluster::ParallelDim;
using dtsim::cluster::Placement;

TEST_CASE("Megatron order puts tp fastest, then cp, ep, dp, pp", "[cluster][placement]") {
  // tp=8, dp=4, pp=2 on 64 devices: rank = tp + 8·dp + 32·pp.
  const Placement p({8, 1, 1, 4, 2});
  CHECK(p.group(ParallelDim::Tp, 0) == std::vector<std::int64_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(p.group(ParallelDim::Dp, 3) == std::vector<std::int64_t>{3, 11, 19, 27});
  CHECK(p.group(ParallelDim::Pp, 9) == std::vector<std::int64_t>{9, 41});
  for (std::int64_t r = 0; r < 64; ++r) CHECK(p.rank(p.coords(r)) == r);
  const auto c = p.coords(45);  // 45 = 5 + 8·1 + 32·1
  CHECK(c.tp == 5);
  CHECK(c.dp_outer == 1);
  CHECK(c.pp == 1);
}

TEST_CASE("expert parallelism lives inside data parallelism", "[cluster][placement]") {
  // tp=2, ep=2, dp=4 (2 expert groups), pp=1: rank = tp + 2·ep + 4·dp_outer.
  const Placement p({2, 1, 2, 4, 1});
  CHECK(p.group(ParallelDim::Ep, 0) == std::vector<std::int64_t>{0, 2});
  CHECK(p.group(ParallelDim::Dp, 0) == std::vector<std::int64_t>{0, 2, 4, 6});
  REQUIRE_THROWS_AS(Placement({1, 1, 3, 4, 1}), dtsim::InputError);
}

TEST_CASE("a group's first rank is the one with its varied coordinates 0", "[cluster][placement]") {
  // Every order of the five dimensions with all degrees above 1: first_of_* says of a rank
  // what building its group and taking the smallest member says.
  std::vector<ParallelDim> order = Placement::default_order();
  std::sort(order.begin(), order.end());
  int orders = 0;
  do {
    const Placement p({2, 2, 2, 4, 3}, order);
    for (std::int64_t r = 0; r < p.degrees().ranks(); ++r) {
      INFO(Placement::to_string(order) << ", rank " << r);
      auto first = [r](const std::vector<std::int64_t>& g) {
        return *std::min_element(g.begin(), g.end()) == r;
      };
      for (ParallelDim d :
           {ParallelDim::Tp, ParallelDim::Cp, ParallelDim::Ep, ParallelDim::Dp, ParallelDim::Pp}) {
        CHECK(p.first_of_group(d, r) == first(p.group(d, r)));
      }
      CHECK(p.first_of_gradient_group(r) == first(p.gradient_group(r)));
      CHECK(p.first_of_expert_gradient_group(r) == first(p.expert_gradient_group(r)));
    }
    ++orders;
  } while (std::next_permutation(order.begin(), order.end()));
  CHECK(orders == 120);
}

TEST_CASE("gradient groups and stages are the ranks with the same fixed coordinates, in order",
          "[cluster][placement]") {
  // Made in increasing order without a sort: in every order of the five dimensions they are
  // what a walk over all ranks finds.
  std::vector<ParallelDim> order = Placement::default_order();
  std::sort(order.begin(), order.end());
  do {
    const Placement p({2, 3, 2, 4, 3}, order);
    const std::int64_t ranks = p.degrees().ranks();
    for (std::int64_t r = 0; r < ranks; ++r) {
      INFO(Placement::to_string(order) << ", rank " << r);
      const auto c = p.coords(r);
      std::vector<std::int64_t> dense, expert, stage;
      for (std::int64_t q = 0; q < ranks; ++q) {
        const auto o = p.coords(q);
        if (o.tp == c.tp && o.pp == c.pp) dense.push_back(q);
        if (o.tp == c.tp && o.pp == c.pp && o.ep == c.ep) expert.push_back(q);
        if (o.pp == c.pp) stage.push_back(q);
      }
      CHECK(p.gradient_group(r) == dense);
      CHECK(p.expert_gradient_group(r) == expert);
      CHECK(p.stage_ranks(c.pp) == stage);
    }
  } while (std::next_permutation(order.begin(), order.end()));
}

TEST_CASE("a custom order and its parsing", "[cluster][placement]") {
  const auto order = Placement::parse_order("dp-tp-cp-ep-pp");
  const Placement p({2, 1, 1, 4, 1}, order);
  CHECK(p.group(ParallelDim::Dp, 0) == std::vector<std::int64_t>{0, 1, 2, 3});
  CHECK(Placement::to_string(order) == "dp-tp-cp-ep-pp");
  REQUIRE_THROWS_WITH(Placement::parse_order("tp-dp"), Catch::Matchers::Contains("exactly once"));
  REQUIRE_THROWS_WITH(Placement::parse_order("tp-xp-cp-ep-pp"),
                      Catch::Matchers::Contains("unknown dimension \"xp\""));
}

TEST_CASE("a stage's ranks are those whose pp coordinate is the stage's", "[cluster][placement]") {
  // Each layout: tp, cp, ep, dp, pp, in Megatron's order and with pp fastest.
  for (const auto& order : {Placement::default_order(), Placement::parse_order("pp-tp-cp-ep-dp")}) {
    const Placement p({2, 2, 2, 4, 3}, order);
    std::int64_t seen = 0;
    for (int stage = 0; stage < 3; ++stage) {
      std::vector<std::int64_t> expected;
      for (std::int64_t r = 0; r < p.degrees().ranks(); ++r) {
        if (p.coords(r).pp == stage) expected.push_back(r);
      }
      CHECK(p.stage_ranks(stage) == expected);
      seen += static_cast<std::int64_t>(expected.size());
    }
    CHECK(seen == 48);
  }
}

TEST_CASE("which links and switches a group crosses", "[cluster][placement]") {
  const auto selene = dtsim::cluster::load_cluster("selene");  // 8 GPUs/node, 20 nodes/rail group
  const Placement p({8, 1, 1, 64, 1});                         // 512 GPUs
  const auto tp = p.group(ParallelDim::Tp, 0);
  const auto tp_span = group_span(selene, tp);
  CHECK(tp_span.intra_node_only);
  CHECK(tp_span.nodes == 1);
  CHECK(tp_span.max_devices_per_node == 8);

  const auto dp = p.group(ParallelDim::Dp, 0);  // local GPU 0 of 64 nodes
  const auto dp_span = group_span(selene, dp);
  CHECK_FALSE(dp_span.intra_node_only);
  CHECK(dp_span.nodes == 64);
  CHECK(dp_span.single_rail);
  CHECK(dp_span.leaf_groups == 4);  // 64 nodes / 20 per scalable unit
  CHECK(dp_span.crosses_spine);

  const std::vector<std::int64_t> two_nodes = {0, 8};
  const auto near = group_span(selene, two_nodes);
  CHECK_FALSE(near.crosses_spine);
  CHECK(near.single_rail);

  const auto tpu = dtsim::cluster::load_cluster("tpu-v4-slice");
  const std::vector<std::int64_t> corners = {0, tpu.devices() - 1};
  CHECK(group_span(tpu, corners).max_torus_hops >= 1);
}

TEST_CASE("a torus group's largest hop count is that of its farthest pair, however found",
          "[cluster][placement]") {
  using dtsim::cluster::torus_diameter;
  using dtsim::cluster::torus_hops;
  // Hop counts by hand on a 4x3x5 torus (x fastest): device 0 = (0,0,0), 2 = (2,0,0),
  // 3 = (3,0,0) one hop from 0 round the ring, 59 = (3,2,4) one hop in each dimension.
  const std::vector<std::int64_t> dims = {4, 3, 5};
  CHECK(torus_hops(dims, 0, 2) == 2);
  CHECK(torus_hops(dims, 0, 3) == 1);
  CHECK(torus_hops(dims, 0, 59) == 3);
  CHECK(torus_hops(dims, 59, 0) == 3);
  // Against every pair, for groups small (pairs) and large (the per-dimension transform), on
  // tori of odd and even sizes and with a dimension of 1.
  std::uint64_t state = 12345;
  const auto next = [&] {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    return state >> 33;
  };
  for (const std::vector<std::int64_t>& shape : std::vector<std::vector<std::int64_t>>{
           {4, 3, 5}, {2, 2, 2}, {8, 1, 6}, {7, 7, 7}, {16, 4, 1}}) {
    const std::int64_t cells = shape[0] * shape[1] * shape[2];
    for (const std::int64_t members : {std::int64_t{2}, std::int64_t{5}, cells / 3, cells}) {
      if (members < 2) continue;
      std::vector<std::int64_t> all(static_cast<std::size_t>(cells));
      for (std::int64_t d = 0; d < cells; ++d) all[static_cast<std::size_t>(d)] = d;
      for (std::size_t i = all.size() - 1; i > 0; --i) std::swap(all[i], all[next() % (i + 1)]);
      const std::vector<std::int64_t> group(all.begin(), all.begin() + members);
      std::int64_t brute = 0;
      for (const std::int64_t a : group) {
        for (const std::int64_t b : group) brute = std::max(brute, torus_hops(shape, a, b));
      }
      INFO("torus " << shape[0] << "x" << shape[1] << "x" << shape[2] << ", " << members
                    << " members");
      CHECK(torus_diameter(shape, group) == brute);
    }
  }
}
