// dtexec calibrate --backend cpu: measures what the compute cost model needs on this host and
// returns it as a calibration profile (sim/cost/profile.hpp format):
// - fp32 GEMM times by shape (OpenBLAS): square sizes and the GEMMs of the calibration model,
//   forward and backward;
// - each non-GEMM op of the calibration model, timed with the very kernels `dtexec run` uses,
//   forward and backward (the loss statistics have none), as a rate of the model graph's own
//   measure of its work (FLOP/s for the attention core, bytes/s of the graph's byte counts for
//   norms, activations, residual adds, embedding, loss statistics, loss) and the optimizer's
//   bytes/s (28 bytes per parameter);
// - streaming memory bandwidth and the fixed cost of a tiny kernel;
// - jitter_cv: the spread of a compute segment's time over many runs (1.4826 x median absolute
//   deviation / median), which the simulator's straggler model uses (the caller averages it
//   over ranks).
// Times are medians of `repeats` runs. Under mpirun every rank measures at the same time (one
// GEMM thread each, as `dtexec run` does), so that the rates include the sharing of cores and
// memory that a multi-rank run sees; the caller adds the collectives.
#pragma once

#include <array>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "exec/core/timing_stats.hpp"
#include "sim/model/model_graph.hpp"

namespace dtsim::exec::cpu {

struct CalibrateOptions {
  int repeats = 5;
  bool quick = false;               // fewer, smaller shapes (tests)
  std::string model = "cpu-small";  // whose op shapes to time
  std::int64_t micro_batch_size = 4;
  std::int64_t seq_len = 0;  // 0: the model's
  int gemm_threads = 0;      // 0: OpenBLAS's default
  int ranks_per_host = 1;
  std::function<void()> sync;  // called before every timed run (under mpirun: a barrier)
};

nlohmann::json calibrate(const CalibrateOptions& options);
// The calibration model at the shapes `options` time it with (fp32; --quick: micro-batch 1 and
// at most 32 tokens).
model::ModelGraph calibration_graph(const CalibrateOptions& options);

// Where and when a calibration ran, for its profile's "source": this host's name and today's
// date (UTC, YYYY-MM-DD). Both backends stamp their profiles with it.
struct CalibrationStamp {
  std::string host, date;
};
CalibrationStamp calibration_stamp();

// The profile's "ops" rows (sim/cost/profile.hpp) of ops timed at `graph`'s shapes: forward and
// backward, each as a rate of the graph's own measure of the op's work (FLOP/s for the attention
// core, bytes/s of the graph's byte counts for the others); no backward row for an op without
// backward work (a timing's bwd_s is then 0). The op of a name is layer 0's (its first norm
// and residual), the embedding, the loss statistics or the loss. Both backends report through
// it.
nlohmann::json op_rate_rows(const model::ModelGraph& graph, const std::vector<OpTiming>& timings);

// The shape of the activation whose rate op_rate_rows prices (layer 0's first): its rows (a
// mixture's experts' run on the top_k copies of each token) and its width (the experts', or the
// dense MLP's of block 0: a dense model's, the shared experts', a mixture's dense block's). Both
// backends time the activation at it.
struct ActivationShape {
  std::int64_t rows = 0, width = 0;
};
ActivationShape priced_activation(const model::ModelGraph& graph);

using exec::GemmPass;  // exec/core/timing_stats.hpp
using exec::ModelGemm;

// The distinct GEMMs of one block and the head of `graph`, forward and backward, whole and as
// tensor parallelism of each degree 2, 4, ... up to `max_tp` splits them on a rank (column-
// parallel layers' N, row-parallel layers' K) where the degree divides the split dimension, and
// as context parallelism of each degree 2, 4, ... up to `max_cp` splits their rows (the tokens:
// 1/cp of each sequence on a rank), with tp too where tp x cp is at most the larger maximum.
std::vector<ModelGemm> model_gemms(const model::ModelGraph& graph, int max_tp = 1, int max_cp = 1);
// The median time of `repeats` timed runs of one of them with the CPU kernels the executor
// runs (each run repeated for at least 20 ms).
double time_gemm(const ModelGemm& gemm, int repeats);
// Those a calibration times besides shapes of its own (`timed`, as {m, k, n}): one per
// {m, k, n} not in `timed`, the first of model_gemms' order (a profile row names a GEMM by its
// {m, k, n} only). Both backends time these.
std::vector<ModelGemm> gemms_to_time(const model::ModelGraph& graph, int max_tp,
                                     std::vector<std::array<int, 3>> timed, int max_cp = 1);

}  // namespace dtsim::exec::cpu
