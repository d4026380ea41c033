// Speed of dtsim's simulator itself (issue 3 targets): wall time of lowering + simulation of one
// training step, events per second and peak memory, from 64 to 16,384 devices.
//   build/bench/dtsim_bench [--repeat N]
// Run it by hand on an idle machine; the note of the issue records the figures.
#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <string>
#include <vector>

#include "sim/engine/simulator.hpp"
#include "sim/planner/planner.hpp"

namespace {

struct Case {
  const char* name;
  const char* model;
  const char* cluster;
  int gpus, tp, pp, v;
  std::int64_t global_batch;
  dtsim::plan::Schedule schedule;
  int cp = 1;
  std::int64_t seq_len = 2048;
  dtsim::plan::Recompute recompute = dtsim::plan::Recompute::Full;
};

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 5;
  if (argc > 1) {
    // --repeat N, the only flag; anything else is a usage error (not a run with defaults).
    const std::string flag = argv[1];
    std::size_t used = 0;
    if (argc == 3 && flag == "--repeat") {
      try {
        repeat = std::stoi(argv[2], &used);
      } catch (const std::exception&) {
        used = 0;
      }
    }
    if (argc != 3 || flag != "--repeat" || used != std::string(argv[2]).size() || repeat < 1) {
      const bool help = argc == 2 && (flag == "--help" || flag == "-h");
      fmt::print(help ? stdout : stderr, "usage: dtsim_bench [--repeat N]   (N >= 1, default 5)\n");
      return help ? 0 : 2;
    }
  }
  using S = dtsim::plan::Schedule;
  const std::vector<Case> cases = {
      {"GPT-3 175B, 64 A100, tp8 pp8, 8 micro-batches", "gpt3-175b", "selene", 64, 8, 8, 1, 8,
       S::OneFOneB},
      {"GPT-3 175B, 1024 A100, tp8 pp16 dp8 interleaved v2", "gpt3-175b", "selene", 1024, 8, 16, 2,
       1536, S::Interleaved},
      {"Llama-3 405B, 1024 H100, tp8 pp16 dp8", "llama3-405b", "h100-roce", 1024, 8, 16, 1, 128,
       S::OneFOneB},
      {"Llama-3 405B, 4096 H100, tp8 pp16 dp32", "llama3-405b", "h100-roce", 4096, 8, 16, 1, 512,
       S::OneFOneB},
      {"Llama-3 405B, 16384 H100, tp8 pp16 dp128", "llama3-405b", "h100-roce", 16384, 8, 16, 1,
       2048, S::OneFOneB},
      // dtsim plan's choice for 405B on 512 H100 at batch 1,024 and 8,192 tokens: 1,024
      // micro-batches through 32 stages, the largest program a default search simulates.
      {"Llama-3 405B, 512 H100, tp4 pp32 cp4, 8k tokens", "llama3-405b", "h100-roce", 512, 4, 32, 1,
       1024, S::OneFOneB, 4, 8192, dtsim::plan::Recompute::Selective},
  };
  fmt::print("{:<55} {:>9} {:>10} {:>12} {:>11} {:>9}\n", "case", "wall", "tasks", "events/s",
             "peak RSS", "step");
  fmt::print("{:<55} {:>9} {:>10} {:>12} {:>11} {:>9}\n", "", "s (min)", "", "", "MiB", "s");
  for (const Case& c : cases) {
    const auto spec = dtsim::model::load_model(c.model);
    const auto cluster =
        dtsim::cluster::with_devices(dtsim::cluster::load_cluster(c.cluster), c.gpus);
    dtsim::plan::Plan p;
    p.tp = c.tp;
    p.pp = c.pp;
    p.cp = c.cp;
    p.dp = c.gpus / (c.tp * c.pp * c.cp);
    p.micro_batch_size = 1;
    p.global_batch_size = c.global_batch;
    p.seq_len = c.seq_len;
    p.schedule = c.schedule;
    p.virtual_stages = c.v;
    p.recompute = c.recompute;
    p.sequence_parallel = true;
    dtsim::plan::require_valid(p, spec, cluster.devices());
    double best = 1e30;
    dtsim::engine::Prediction pred;
    for (int r = 0; r < repeat; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      // Everything a `dtsim simulate` run does after reading its inputs: graph, lowering,
      // engine, breakdown and memory.
      const dtsim::model::ModelGraph g = dtsim::plan::graph_of(spec, p);
      auto net = dtsim::network::make_analytical(cluster);
      const auto sim = dtsim::engine::simulate(g, p, cluster, *net);
      const auto t1 = std::chrono::steady_clock::now();
      best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
      pred = sim.prediction;
    }
    fmt::print("{:<55} {:>9.4f} {:>10} {:>12.3g} {:>11.1f} {:>9.2f}\n", c.name, best, pred.tasks,
               static_cast<double>(pred.events) / best, peak_rss_mib(), pred.step_time_s);
  }

  // Planner (issue 4): the closed-form tier alone (refine 0) and the whole search (refine 8);
  // the first row without the memory frontier (the plans over memory estimated for it).
  fmt::print("\n{:<55} {:>9} {:>10} {:>12} {:>11}\n", "planner", "wall", "evaluated",
             "candidates/s", "threads");
  struct Search {
    const char* name;
    const char* model;
    int gpus;
    std::int64_t batch;
  };
  for (const Search& s : {Search{"GPT-3 175B, 64 A100", "gpt3-175b", 64, 1536},
                          Search{"GPT-3 175B, 1024 A100", "gpt3-175b", 1024, 1536}}) {
    const auto spec = dtsim::model::load_model(s.model);
    const auto cluster =
        dtsim::cluster::with_devices(dtsim::cluster::load_cluster("selene"), s.gpus);
    dtsim::planner::SearchSpace space;
    space.global_batch_size = s.batch;
    space.seq_len = 2048;
    struct Run {
      int refine, threads;
      bool frontier;
    };
    for (const Run run : {Run{0, 1, false}, Run{0, 1, true}, Run{0, 0, true}, Run{8, 0, true}}) {
      const int refine = run.refine;
      const int threads = run.threads;
      dtsim::planner::SearchOptions options;
      options.refine = refine;
      options.threads = threads;
      options.memory_frontier = run.frontier;
      double best = 1e30;
      std::uint64_t evaluated = 0;
      for (int r = 0; r < repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        evaluated = dtsim::planner::search(spec, cluster, space, options).evaluated;
        best = std::min(
            best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      fmt::print("{:<55} {:>9.3f} {:>10} {:>12.0f} {:>11}\n",
                 fmt::format("{}, refine {}{}", s.name, refine,
                             run.frontier ? "" : ", no memory frontier"),
                 best, evaluated, static_cast<double>(evaluated) / best,
                 threads == 0 ? "all" : fmt::format("{}", threads));
    }
  }
  return 0;
}
