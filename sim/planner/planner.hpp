// dtsim plan: search the parallel configurations of a model on a cluster, rank them, explain.
//
// Two tiers (issue 4): a closed-form estimate of every candidate's step time (per-stage pass
// times from the same compute cost and network models the simulator uses, run through the
// schedule's pass order with each pipeline hop on its own links (pass_timeline.hpp), a
// data-parallel overlap rule and the dp stream's whole work as a bound), with candidates that
// do not fit in memory pruned by the memory model (of those, only the ones that may be the
// fastest or the closest over memory are estimated in full; the rest get a bound below their
// estimate); then the discrete-event simulator on the best `refine` of them, whose simulated
// times give the final order.
// bench/planner_accuracy.cpp measures the first tier against the second.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "sim/cluster/topology.hpp"
#include "sim/engine/simulator.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/model/model_spec.hpp"
#include "sim/plan/plan.hpp"

namespace dtsim::planner {

enum class Objective { Time, Cost };

inline constexpr int kDefaultMaxCp = 8;  // SearchSpace::max_cp, dtsim plan --max-cp
// SearchOptions::balance_stages (dtsim plan --balance-stages); the most chunks (pp x virtual
// stages) a split is searched for, and its rounds (each estimates about 4 x chunks moves).
inline constexpr int kDefaultBalanceStages = 8;
inline constexpr int kMostBalancedChunks = 64;
inline constexpr int kMostBalanceRounds = 8;
// The least share of a step that an uneven split must save to replace the even one.
inline constexpr double kBalanceGain = 0.01;

struct SearchSpace {
  std::int64_t global_batch_size = 0;  // sequences per step (required)
  std::int64_t seq_len = 0;            // 0: the model's
  int max_tp = 0;                      // 0: devices per node
  int max_pp = 0;                      // 0: no limit
  // Context parallelism is searched by default: it splits the tokens, so the activations, and
  // leaves more micro-batches per pipeline at a given batch. NeMo's Llama 3 8B pre-training
  // recipe (nemo/collections/llm/recipes/llama3_8b.py) runs cp 2 at 8,192 tokens; Llama 3 405B
  // ran cp 16 at 128K (Llama Team 2024, Table 4). 8 bounds the search's size; 1: not searched.
  int max_cp = kDefaultMaxCp;
  std::vector<std::int64_t> micro_batch_sizes = {1, 2, 4, 8};
  std::vector<plan::Schedule> schedules = {plan::Schedule::OneFOneB, plan::Schedule::Interleaved,
                                           plan::Schedule::ZeroBubble};
  std::vector<int> virtual_stages = {2, 4};
  std::vector<int> zero_stages = {0, 1, 2, 3};
  std::vector<plan::Recompute> recomputes = {plan::Recompute::None, plan::Recompute::Selective,
                                             plan::Recompute::Full};
  Precision precision = Precision::Bf16;
  // The attention kernel every candidate runs (a given, not searched).
  model::AttentionKernel attention = model::AttentionKernel::Unfused;
  // ZeRO-1/2 candidates overlap their weight gather with the next forward (plan
  // overlap_param_gather).
  bool overlap_param_gather = false;
  // ZeRO-1 candidates reduce and gather in place (plan zero_in_place).
  bool zero_in_place = false;
  // Every candidate clips its gradients to this global norm (plan clip_grad; 0: none).
  double clip_grad = 0;
  // Fixed values ("--fixed tp=8"): -1 = free.
  int fixed_tp = -1, fixed_pp = -1, fixed_dp = -1, fixed_cp = -1, fixed_ep = -1;
  double memory_headroom = 0.0;  // fraction of device memory kept free
  // Expert parallelism's routing (plan::Plan::expert_load) for candidates with ep > 1, capped
  // at what routing can make at their ep (plan::max_expert_load); 1: even.
  double expert_load = 1.0;
  // The framework allowance, and the device memory when it overrides the catalog's
  // (--framework-overhead-gib, --device-memory-gib); the headroom applies to that memory.
  plan::MemoryOptions memory;
};

struct Candidate {
  plan::Plan plan;
  double estimate_s = 0;   // closed-form step time
  double step_time_s = 0;  // simulated when refined, else the estimate
  bool refined = false;
  double memory_bytes = 0;  // worst rank
  double capacity_bytes = 0;
  bool fits = false;
  double cost_per_step_usd = -1;  // when the cluster has a price
  engine::Prediction prediction;  // when refined
  // Closed-form breakdown (seconds): compute, recompute, bubble, exposed tp/cp/ep/dp/pp,
  // optimizer; for unrefined candidates the "dominant" term comes from here.
  engine::Breakdown estimate;
};

struct SearchResult {
  std::uint64_t evaluated = 0;                // valid candidates, their memory estimated
  std::uint64_t feasible = 0;                 // of those, valid and fitting in memory
  std::vector<Candidate> ranked;              // feasible, best first (refined ones on top)
  std::optional<Candidate> best_not_fitting;  // fastest estimate among those over memory
  // The one over memory that needs the least (then the fastest): how far the cluster is from
  // holding the model at all, when nothing fits.
  std::optional<Candidate> closest_not_fitting;
  // What more memory per device would buy: those over memory whose estimate beats every
  // fitting candidate's and every one needing less memory, by memory (the memory-time Pareto
  // front over memory; ties in memory: the fastest). The last is the fastest over memory, up to
  // a tie. When nothing fits, the first is the closest to fitting (or as close and faster).
  // Empty when every candidate fits or none over memory is faster than the fastest that fits.
  std::vector<Candidate> memory_frontier;
  int refined = 0;
  // Tier agreement among the refined candidates: pairs whose order the estimate got wrong
  // (ties in either tier excluded), how far apart the simulator puts the farthest of them
  // (slower / faster - 1), and the largest estimate error.
  int order_disagreements = 0;
  double max_disagreement_gap = 0;
  double max_estimate_error = 0;
};

struct SearchOptions {
  int refine = 8;
  int threads = 0;  // 0: hardware concurrency
  Objective objective = Objective::Time;
  // Progress, called from the search's threads: `progress` as candidates are estimated,
  // `simulated` as the simulator finishes each of the best `refine` (done of total).
  std::function<void(std::uint64_t done, std::uint64_t total)> progress;
  std::function<void(std::uint64_t done, std::uint64_t total)> simulated;
  const cost::Profile* profile = nullptr;  // calibration profile for both tiers
  // The straggler model of both tiers (engine::SimulateOptions::jitter_cv; the closed form
  // adds the engine's waits per group kind). Unset: the profile's jitter_cv, else none.
  std::optional<double> jitter_cv;
  // The slow rank of both tiers (engine::SimulateOptions::rank_spread_cv; the closed form slows
  // the busiest stage's compute the same way). Unset: the profile's rank_spread_cv, else none.
  std::optional<double> rank_spread_cv;
  // Where set, tier 2's simulator in place of the in-process one with the analytical network:
  // the candidate's prediction under these options (dtsim plan --network simgrid runs each on
  // SimGrid, in a process of its own). Called from the calling thread, one candidate after
  // another.
  std::function<engine::Prediction(const plan::Plan&, const engine::SimulateOptions&)> simulate;
  // Whether to find SearchResult::memory_frontier (more estimates of plans over memory; whatif,
  // which does not show it, leaves it out).
  bool memory_frontier = true;
  // One candidate per layout (dp, tp, pp, cp, ep, micro-batch, schedule, virtual stages) in the
  // ranking and among those simulated: the first of each by the estimate (dtsim plan
  // --distinct). Its ZeRO-stage, recompute and overlap variants often tie with it.
  bool distinct_layouts = false;
  // Uneven pipeline stages: the layer split of this many of the best candidates with pp > 1,
  // searched by the estimate (dtsim plan --balance-stages); 0: every candidate's layers split
  // evenly.
  int balance_stages = kDefaultBalanceStages;
};

SearchResult search(const model::ModelSpec& model, const cluster::Cluster& cluster,
                    const SearchSpace& space, const SearchOptions& options);

// Where the search has no candidate on the whole cluster (its device count has no split into
// degrees that the space allows): the most devices, fewer, that it has candidates on (as --gpus
// takes them: whole nodes, or part of one node), or 0 if none.
std::int64_t largest_searchable_devices(const model::ModelSpec& model,
                                        const cluster::Cluster& cluster, const SearchSpace& space);

// A ranking key (step time, or cost per step) as the search compares it: its mantissa rounded to
// 30 bits, so that keys agreeing to about a part in 10^9 (ZeRO-1 and ZeRO-2 often take the same
// time, apart from rounding) tie, and plans that tie rank by memory, the less first. (Rounding
// keeps the order a strict weak one, which a tolerance would not.)
double ranking_key(double key);

// What a tier-1 estimate holds: the step time, or a bound at most that (the estimate without
// the pipeline timeline), which the search gives candidates over memory first.
enum class Detail { Full, Bound };

// One plan's tier-1 estimate (Candidate::estimate_s) or its bound, as the search computes them
// with `options`' profile and straggler model.
double estimate_s(const model::ModelGraph& graph, const plan::Plan& plan,
                  const cluster::Cluster& cluster, const SearchOptions& options,
                  Detail detail = Detail::Full);

// The uneven layer split the search gives a candidate (SearchOptions::balance_stages) for
// `plan` with pp > 1, by the estimate with `options`' profile and straggler model and the
// memory model with `memory`: the split (pp x virtual stages entries) and the estimates with
// it and with the even split, where one saves kBalanceGain of the step or more and fits; else
// none (dtsim simulate --layers-per-stage balanced).
struct BalancedSplit {
  std::vector<int> layers_per_stage;
  double estimate_s = 0, even_estimate_s = 0;
};
std::optional<BalancedSplit> balanced_split(const model::ModelGraph& graph, const plan::Plan& plan,
                                            const cluster::Cluster& cluster,
                                            const SearchOptions& options,
                                            const plan::MemoryOptions& memory);

// The largest term of a breakdown but compute, as text with its share of the step:
// "exposed TP communication 18%", "pipeline bubble 0.4%" (to a tenth under 1%), or
// "compute only" where none reaches 0.05%.
std::string dominant_term(const engine::Breakdown& b, double step_s);

}  // namespace dtsim::planner
