// dtexec calibrate: measures GEMMs, the non-GEMM ops, memory bandwidth, jitter, collectives
// and training steps on this host (CPU) or GPU (CUDA) into a profile for dtsim --profile, and
// with --cluster-out this host as a cluster.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "exec/cli/commands.hpp"
#include "exec/core/checkpoint.hpp"
#include "exec/core/in_run.hpp"
#include "exec/core/runner.hpp"
#include "exec/core/timing_stats.hpp"
#include "exec/cpu/bf16_device.hpp"
#include "exec/cpu/calibrate.hpp"
#include "exec/cpu/device.hpp"
#include "exec/cpu/kernels.hpp"
#include "exec/cpu/mpi_comm.hpp"
#include "sim/cli/options.hpp"
#include "sim/cluster/device_catalog.hpp"
#include "sim/cluster/topology.hpp"
#include "sim/common/error.hpp"
#include "sim/common/launcher.hpp"
#include "sim/cost/compute_cost.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/report/table.hpp"

#ifdef DTEXEC_HAVE_CUDA
#include "exec/cuda/calibrate_cuda.hpp"
#include "exec/cuda/device.hpp"
#include "exec/cuda/gpu_probe.hpp"
#endif

namespace dtsim::exec::cli {

namespace {

// A profile's notes with `note` added.
void add_note(nlohmann::json& profile, const std::string& note) {
  const std::string before = profile.value("notes", std::string());
  profile["notes"] = before.empty() ? note : before + "; " + note;
}

// A figure of a topology file: {"value", "source"}.
nlohmann::json figure(double value, const std::string& source) {
  return {{"value", value}, {"source", source}};
}

// --cluster-out DIR, checked before minutes of measuring: a directory, or one that can be made
// (write_host_topology makes the missing ones) in the nearest existing directory above it; and
// that one writable.
void check_cluster_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty() && p.has_parent_path()) p = p.parent_path();  // "out/"
  fs::path existing = p;
  while (!existing.empty() && !fs::exists(existing, ec)) existing = existing.parent_path();
  if (existing.empty()) existing = ".";
  if (!fs::is_directory(existing, ec)) {
    throw dtsim::InputError(
        fmt::format("--cluster-out {}: {} is not a directory; expected one for its files", dir,
                    existing.string()));
  }
  if (::access(existing.c_str(), W_OK | X_OK) != 0) {
    throw dtsim::InputError(fmt::format("--cluster-out {}: cannot write in {} (permission denied)",
                                        dir, existing.string()));
  }
  // What access() lets root do, a file system may not (/proc): the folders made and taken
  // away again, as a probe, also where making them fails part way. By the launcher's rank 0
  // alone under mpirun (another rank's removal would pull the folders from under its making;
  // rank 0 writes them in the end).
  if (existing == p || dtsim::launcher_rank() != 0) return;
  fs::path first = p;
  while (first.parent_path() != existing && first.has_parent_path()) first = first.parent_path();
  fs::create_directories(p / "devices", ec);
  std::error_code ignored;
  fs::remove_all(first, ignored);
  if (ec) {
    throw dtsim::InputError(fmt::format("--cluster-out {}: cannot create it in {}: {}", dir,
                                        existing.string(), ec.message()));
  }
}

// The device and cluster files of this host, from a profile (topologies/README.md format):
// ranks as devices on one node, shared-memory MPI as the fabric.
void write_host_topology(const std::string& dir, const nlohmann::json& profile, int ranks) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(fs::path(dir) / "devices", ec);
  if (ec)
    throw dtsim::InputError(fmt::format("--cluster-out {}: cannot create: {}", dir, ec.message()));
  const std::string source = "dtexec calibrate: " + profile.at("source").get<std::string>();
  double peak = 0, attention = 0;
  for (const auto& g : profile.at("gemm")) {
    peak = std::max(peak, 2.0 * g.at("m").get<double>() * g.at("n").get<double>() *
                              g.at("k").get<double>() / g.at("seconds").get<double>());
  }
  for (const auto& o : profile.at("ops")) {
    if (o.at("op") == "attention" && o.at("phase") == "fwd") {
      attention = o.at("flops_per_s").get<double>();
    }
  }
  double memory = 0;
  {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    double kib = 0;
    while (meminfo >> key >> kib) {
      if (key == "MemTotal:") memory = kib * 1024.0 / ranks;
      meminfo.ignore(256, '\n');
    }
  }
  // Shared-memory MPI: bus bandwidth of the largest all-reduce; per-hop latency from the
  // smallest (a ring all-reduce takes 2(n-1) steps).
  double busbw = profile.at("memory_bw_bytes_per_s").get<double>(), latency = 1e-6;
  if (profile.contains("collectives")) {
    std::size_t smallest = SIZE_MAX, largest = 0;
    for (const auto& c : profile.at("collectives")) {
      if (c.at("kind") != "all_reduce" || c.at("ranks").get<int>() != ranks) continue;
      const auto bytes = c.at("bytes").get<std::size_t>();
      if (bytes > largest) {
        largest = bytes;
        busbw = c.at("busbw_bytes_per_s").get<double>();
      }
      if (bytes < smallest) {
        smallest = bytes;
        latency = c.at("seconds").get<double>() / (2.0 * std::max(1, ranks - 1));
      }
    }
  }
  // The attention core's share of the GEMM peak, as device files hold it: not under their
  // floor (dtsim::cluster::kLeastEfficiency, 1%, which catches slips in files written by hand),
  // which tiny shapes on a loaded host can reach (--quick over 4 ranks on 2 cores: 0.92%). The
  // profile (--profile) prices the core at its measured rate whatever this holds.
  const double attention_share = std::min(1.0, attention / peak);
  const bool floored = attention_share < dtsim::cluster::kLeastEfficiency;
  const std::string attention_source =
      floored ? fmt::format(
                    "{}; attention core forward at {:.3g} of the GEMM peak, raised to "
                    "device files' least, {:g} (the profile prices it as measured)",
                    source, attention_share, dtsim::cluster::kLeastEfficiency)
              : source + "; attention core forward";
  if (floored) {
    std::cerr << fmt::format(
        "dtexec calibrate: the attention core ran at {:.3g} of the GEMM peak; {}/devices/"
        "cpu-host.json says {:g}, the least a device file holds (the profile has its rate)\n",
        attention_share, dir, dtsim::cluster::kLeastEfficiency);
  }
  const nlohmann::json device = {
      {"name", "cpu-host"},
      {"display_name", "CPU rank (one MPI process, fp32 OpenBLAS)"},
      {"vendor", "cpu"},
      {"peak_flops", {{"fp32", figure(peak, source + "; the fastest GEMM measured")}}},
      {"memory_bytes", figure(memory, "/proc/meminfo MemTotal divided among the ranks")},
      {"memory_bw_bytes_per_s",
       figure(profile.at("memory_bw_bytes_per_s").get<double>(), source + "; streaming copy")},
      {"intra_node_bw_bytes_per_s", figure(busbw, source + "; MPI all-reduce bus bandwidth")},
      {"efficiency",
       {{"gemm", figure(1.0, "the peak above is the measured GEMM rate")},
        {"attention",
         figure(std::max(attention_share, dtsim::cluster::kLeastEfficiency), attention_source)},
        {"memory_bw", figure(1.0, "the bandwidth above is measured")},
        {"launch_overhead_s",
         figure(profile.at("launch_overhead_s").get<double>(), source + "; a tiny GEMM")}}},
      {"framework_overhead_bytes",
       figure(0.0,
              "a CPU rank has no CUDA context or GPU library workspaces, and dtexec's pool "
              "holds what dtsim memory predicts without an allowance "
              "(bench/memory_validation.sh)")},
      {"notes",
       "written by dtexec calibrate --cluster-out; a calibration profile (--profile) "
       "gives the per-op rates this entry cannot hold"}};
  const std::string device_path =
      fs::absolute(fs::path(dir) / "devices" / "cpu-host.json").string();
  const nlohmann::json cluster = {
      {"name", "cpu-host"},
      {"description", fmt::format("This host: {} CPU ranks (MPI processes) on one node, shared "
                                  "memory between them",
                                  ranks)},
      {"source", source},
      {"device", device_path},
      {"nodes", 1},
      {"devices_per_node", ranks},
      {"intra_node",
       {{"fabric", "shared_memory"},
        {"bw_bytes_per_s", figure(busbw, source + "; MPI all-reduce bus bandwidth, largest size")},
        {"latency_s", figure(latency, source + "; smallest MPI all-reduce / 2(n-1) ring steps")}}},
      {"inter_node", {{"fabric", "none"}, {"transport", "none"}}},
      {"communication",
       {{"overlaps_compute", false},
        {"source",
         "dtexec's CPU backend: MPI moves a non-blocking collective's data only inside MPI "
         "calls, which dtexec makes between tasks, not during a kernel (no progress thread)"}}}};
  const std::string cluster_path = (fs::path(dir) / "cpu-host.json").string();
  for (const auto& [path, j] : {std::pair{device_path, device}, std::pair{cluster_path, cluster}}) {
    std::ofstream file(path);
    if (!file || !(file << json_text(j, 2) << "\n" << std::flush)) {
      throw dtsim::InputError(fmt::format("--cluster-out: cannot write {}", path));
    }
  }
  // Read back as dtsim reads them, so that a figure out of a reader's range is said here and
  // not at the first dtsim run.
  try {
    dtsim::cluster::load_cluster(cluster_path);
  } catch (const dtsim::InputError& e) {
    throw dtsim::InputError(
        fmt::format("--cluster-out {}: the files written do not read back: {}", dir, e.what()));
  }
}

// The calibration profile as tables: GEMMs, op rates, collectives, the rest.
void print_profile(const nlohmann::json& profile, const std::string& path) {
  dtsim::report::Table gemms({"m", "n", "k", "seconds", "rate"});
  gemms.set_units({"", "", "", "", "GFLOP/s"});
  for (const auto& g : profile.at("gemm")) {
    const double flops =
        2.0 * g.at("m").get<double>() * g.at("n").get<double>() * g.at("k").get<double>();
    gemms.add_row({fmt::format("{}", g.at("m").get<int>()), fmt::format("{}", g.at("n").get<int>()),
                   fmt::format("{}", g.at("k").get<int>()),
                   fmt::format("{:.3g}", g.at("seconds").get<double>()),
                   fmt::format("{:.1f}", flops / g.at("seconds").get<double>() / 1e9)});
  }
  std::cout << gemms.render();
  if (profile.contains("ops")) {
    dtsim::report::Table ops({"op", "phase", "seconds", "rate", ""});
    ops.align_left(0);
    ops.align_left(1);
    ops.align_left(4);
    for (const auto& o : profile.at("ops")) {
      const bool flops = o.contains("flops_per_s");
      ops.add_row(
          {o.at("op").get<std::string>(), o.at("phase").get<std::string>(),
           fmt::format("{:.3g}", o.at("seconds").get<double>()),
           fmt::format("{:.2f}",
                       (flops ? o.at("flops_per_s") : o.at("bytes_per_s")).get<double>() / 1e9),
           flops ? "GFLOP/s" : "GB/s"});
    }
    std::cout << "\n" << ops.render();
  }
  if (profile.contains("collectives") && !profile.at("collectives").empty()) {
    dtsim::report::Table collectives(
        {"collective", "ranks", "bytes", "seconds", "algbw GB/s", "busbw GB/s"});
    collectives.align_left(0);
    for (const auto& c : profile.at("collectives")) {
      collectives.add_row(
          {c.at("kind").get<std::string>() + (c.value("started", false) ? " (started)" : ""),
           fmt::format("{}", c.at("ranks").get<int>()),
           fmt::format("{}", c.at("bytes").get<std::size_t>()),
           fmt::format("{:.3g}", c.at("seconds").get<double>()),
           fmt::format("{:.2f}", c.at("algbw_bytes_per_s").get<double>() / 1e9),
           fmt::format("{:.2f}", c.at("busbw_bytes_per_s").get<double>() / 1e9)});
    }
    std::cout << "\n" << collectives.render();
  }
  std::cout << fmt::format(
      "\nmemory bandwidth {:.1f} GB/s, launch overhead {:.2f} us, compute jitter {:.1f}%\n"
      "profile written to {}\n",
      profile.at("memory_bw_bytes_per_s").get<double>() / 1e9,
      profile.at("launch_overhead_s").get<double>() * 1e6,
      100 * profile.at("jitter_cv").get<double>(), path);
  if (profile.contains("in_run")) {
    const auto& r = profile.at("in_run");
    std::cout << fmt::format(
        "in a training step, measured / predicted from these kernels: forward {:.3f}, backward "
        "{:.3f}, optimizer {:.3f} (over {} tasks; dtsim --profile applies them)\n",
        r.at("forward").get<double>(), r.at("backward").get<double>(),
        r.at("optimizer").get<double>(), r.at("tasks").get<int>());
    if (r.contains("transient_cv")) {
      std::cout << fmt::format(
          "ranks' spread: lasting {:.2f}% (the simulator's slow rank), transient {:.2f}% per "
          "phase of a step, against the GEMM's {:.1f}% (jitter_cv, the straggler model's)\n",
          100 * r.at("rank_spread_cv").get<double>(), 100 * r.at("transient_cv").get<double>(),
          100 * profile.at("jitter_cv").get<double>());
    }
  }
  std::optional<double> transient, lasting;
  if (profile.contains("in_run") && profile.at("in_run").contains("transient_cv")) {
    transient = profile.at("in_run").at("transient_cv").get<double>();
  }
  if (profile.contains("in_run") && profile.at("in_run").contains("rank_spread_cv")) {
    lasting = profile.at("in_run").at("rank_spread_cv").get<double>();
  }
  if (auto w = dtsim::exec::noisy_host_warning(profile.at("jitter_cv").get<double>(), transient,
                                               lasting)) {
    std::cerr << *w << "\n";
  }
}

// The profile's "in_run" factors (sim/cost/profile.hpp): one process trains `graph` on
// `device` on its own (one micro-batch per step; under mpirun every rank at once, as the
// profile's kernels were timed), in rounds: two steps (the first left out), then the second
// step's GEMMs timed alone again at once (`time_gemms`, the backend's matmul kernels), so
// that both see the host in the same spell (a shared host drifts by tens of percent over
// seconds). A round's ratio per phase (forward and recompute, backward, optimizer) is the
// step's compute tasks against the profile's prediction of them with this round's GEMM times;
// the factor is the median over rounds. `phase_seconds` gets each round's measured forward and
// backward time (for the spread across ranks, see calibrate).
using GemmTimer = std::function<std::vector<double>(const std::vector<dtsim::exec::ModelGemm>&)>;
nlohmann::json measure_in_run(const nlohmann::json& profile_json,
                              const dtsim::model::ModelGraph& graph, dtsim::exec::Device& device,
                              const GemmTimer& time_gemms, int rounds,
                              const std::function<void()>& sync,
                              std::vector<double>& phase_seconds) {
  using dtsim::lower::Phase;
  dtsim::cost::Profile profile = dtsim::cost::profile_from_json(profile_json, "the calibration");
  profile.in_run.reset();
  const dtsim::plan::Plan plan = dtsim::exec::in_run_plan(graph, profile.precision);
  const auto program = dtsim::lower::lower(graph, plan);
  const auto& program_tasks = program.ranks.at(0).tasks;
  // Only the profile prices these ops (GEMMs, op rates, its memory bandwidth and launch time,
  // which both calibrations always measure).
  DTSIM_ASSERT(profile.memory_bw_bytes_per_s && profile.launch_overhead_s,
               "a calibration without memory bandwidth or launch overhead");
  dtsim::cluster::DeviceSpec device_spec;
  device_spec.name = "calibrated device";
  double peak = 0;
  for (const auto& g : profile.gemm) peak = std::max(peak, g.flops() / g.seconds);
  device_spec.peak_flops[profile.precision] = {peak, "the profile's fastest GEMM"};
  device_spec.memory_bw_bytes_per_s = {*profile.memory_bw_bytes_per_s, "the profile"};
  device_spec.efficiency.gemm = device_spec.efficiency.attention =
      device_spec.efficiency.memory_bw = {1.0, ""};
  device_spec.efficiency.launch_overhead_s = {*profile.launch_overhead_s, "the profile"};
  const auto gemms = dtsim::exec::cpu::model_gemms(graph);
  phase_seconds.clear();
  std::array<std::vector<double>, 3> ratios;  // forward, backward, optimizer
  int tasks = 0;
  dtsim::exec::SingleRankComm comm(&device);
  // One run of 2 x rounds steps (the weights are made once: a large model's take seconds on
  // the host): a round is an unmeasured step, then a measured one followed at once by the
  // GEMMs timed alone; every rank starts each step at once.
  dtsim::exec::RunOptions run;
  run.steps = 2 * rounds;
  run.warmup_steps = 1;
  std::map<int, std::vector<double>> gemm_seconds;  // by the measured step (0-based)
  run.on_step = [&](int done, double, double, double) {
    if (done % 2 == 0) {
      gemm_seconds[done - 1] = time_gemms(gemms);
      DTSIM_ASSERT(gemm_seconds[done - 1].size() == gemms.size(),
                   "a GEMM timer returned the wrong count");
    }
    if (sync) sync();
  };
  if (sync) sync();
  const auto result = dtsim::exec::run_program(graph, program, run, comm, device);
  for (const auto& [step, seconds] : gemm_seconds) {
    dtsim::cost::Profile now = profile;
    for (std::size_t i = 0; i < gemms.size(); ++i) {
      const auto [m, k, n] = gemms[i].mkn();
      for (auto& sample : now.gemm) {
        if (sample.m == m && sample.n == n && sample.k == k) sample.seconds = seconds[i];
      }
    }
    dtsim::cost::ComputeCost cost(graph, plan, device_spec, &now);
    std::array<double, 3> measured{}, predicted{};
    tasks = 0;
    for (const auto& record : result.tasks) {
      const auto& task = program_tasks.at(static_cast<std::size_t>(record.task));
      if (record.step != step || task.kind != dtsim::lower::TaskKind::Compute) continue;
      const std::size_t k = task.phase == Phase::Forward || task.phase == Phase::Recompute ? 0
                            : dtsim::lower::in_optimizer_step(task.phase)                  ? 2
                                                                                           : 1;
      measured[k] += record.end_s - record.start_s;
      predicted[k] += cost.task_seconds(task);
      ++tasks;
    }
    for (std::size_t k = 0; k < 3; ++k) {
      if (!(predicted[k] > 0 && measured[k] > 0)) {
        throw dtsim::InternalError("dtexec calibrate: the training step timed no task of a phase");
      }
      ratios[k].push_back(measured[k] / predicted[k]);
    }
    phase_seconds.push_back(measured[0]);
    phase_seconds.push_back(measured[1]);
  }
  // The optimizer's prediction above priced the step's gradient clear (ComputeCost::
  // grad_clear_seconds) and, in mixed precision, the master's second read for the 16-bit copy
  // (ComputeCost::optimizer_seconds): its factor is the optimizer's alone.
  return {{"forward", median(ratios[0])},         {"backward", median(ratios[1])},
          {"optimizer", median(ratios[2])},       {"optimizer_prices_clear", true},
          {"optimizer_prices_master_copy", true}, {"tasks", tasks}};
}

// Under mpirun: the in_run factors averaged over the ranks, and the spread of the ranks'
// lasting speeds (the simulator's slow rank, engine/engine.hpp). The ranks ran the same steps
// at once, each on its own; a rank's forward (or backward) time averaged over the rounds keeps
// what stays with the rank (a slower core, a busier one) and averages away most of what
// changes from round to round (which jitter_cv and the straggler model stand for). The spread
// is the coefficient of variation of those averages across the ranks, less what of the round
// to round noise each average still holds, pooled over both phases (exec::phase_spread).
//
// With the same table (a phase's time per rank and round), `transient_cv`: what is left of a
// rank's time in a round once its lasting speed (its mean over rounds) and that round's pace on
// every rank (the host's drift, which no rank waits for) are taken out, as a coefficient of
// variation (a two-way table's interaction, pooled over both phases). That is the spread of a whole
// phase of compute that one rank has and the others do not at the same moment: what a straggler
// model needs of a pipeline stage's segment, where jitter_cv is one GEMM's spread over repeats.
// Recorded beside jitter_cv for comparison; the simulator does not use it yet.
void in_run_over_ranks(nlohmann::json& in_run, const std::vector<double>& phase_seconds,
                       dtsim::exec::cpu::MpiSession& mpi) {
  for (const char* k : {"forward", "backward", "optimizer"}) {
    in_run[k] = mpi.mean(in_run.at(k).get<double>());
  }
  const int ranks = mpi.size();
  if (ranks < 2 || phase_seconds.size() < 2) return;
  const std::size_t rounds = phase_seconds.size() / 2;
  const std::vector<double> all = mpi.all_gather(phase_seconds);  // rank by rank
  double lasting = 0, transient = 0;  // squared coefficients of variation, summed over phases
  for (std::size_t phase = 0; phase < 2; ++phase) {
    std::vector<std::vector<double>> table(static_cast<std::size_t>(ranks),
                                           std::vector<double>(rounds));
    for (std::size_t k = 0; k < table.size(); ++k) {
      for (std::size_t r = 0; r < rounds; ++r) {
        table[k][r] = all[k * phase_seconds.size() + 2 * r + phase];
      }
    }
    const dtsim::exec::PhaseSpread spread = dtsim::exec::phase_spread(table);
    lasting += spread.lasting_cv2;
    transient += spread.transient_cv2.value_or(0.0);
  }
  in_run["rank_spread_cv"] = std::sqrt(lasting / 2);
  if (rounds < 2) return;
  in_run["transient_cv"] = std::sqrt(transient / 2);
}

#ifdef DTEXEC_HAVE_CUDA
// dtexec calibrate --backend cuda: one GPU per rank (the node-local rank's), cuBLAS GEMMs at
// the model's shapes, copy bandwidth, launch overhead, jitter, and NCCL collectives over the
// ranks of an mpirun job.
nlohmann::json calibrate_cuda(const po::variables_map& vm, const std::string& precision,
                              double collective_timeout, dtsim::exec::cpu::MpiSession* mpi) {
  namespace cu = dtsim::exec::cuda;
  const auto p = cu::probe();
  if (p.gpus.empty()) {
    throw dtsim::UnsupportedError(
        fmt::format("--backend cuda: no GPU on this machine ({})", p.why_none));
  }
  const int rank = mpi ? mpi->rank() : 0;
  const int ranks = mpi ? mpi->size() : 1;
  const int local = mpi ? mpi->local_rank() : 0;
  const cu::GpuInfo& gpu = p.gpus[static_cast<std::size_t>(local) % p.gpus.size()];
  const bool quick = vm["quick"].as<bool>();
  const int repeats = vm["repeats"].as<int>();
  // Square GEMMs (cuBLAS alone), and the model's GEMMs forward and backward (below).
  std::vector<cu::GemmShape> shapes;
  for (int s :
       quick ? std::vector<int>{256, 1024} : std::vector<int>{512, 1024, 2048, 4096, 8192}) {
    shapes.push_back({s, s, s});
  }
  // The calibration model at its shapes (quick: one short sequence).
  // The vocabulary padded as a one-device plan pads it (Plan::make_vocab_size_divisible_by):
  // the LM head's GEMMs at the shapes `dtexec run` trains.
  const auto spec = dtsim::plan::with_padded_vocab(
      dtsim::model::load_model(vm["model"].as<std::string>()), dtsim::plan::Plan{});
  const std::int64_t seq = vm.count("seq-len") ? vm["seq-len"].as<std::int64_t>() : spec.seq_len;
  const dtsim::model::ModelGraph graph(spec, quick ? 1 : vm["micro-batch-size"].as<std::int64_t>(),
                                       quick ? std::min<std::int64_t>(seq, 128) : seq);
  const auto gemm_precision =
      precision == "bf16" ? cu::GemmPrecision::Bf16 : cu::GemmPrecision::Fp32;
  const auto device = cu::time_device(gpu.index, gemm_precision, shapes, repeats);
  // The model's GEMMs as `dtexec run` calls them (each pass in its own layout, the weight
  // gradient accumulated in fp32), whole and split over tp up to 8 (one node's GPUs, for
  // --only-rank slices of tp plans), over cp up to 8 (a rank's 1/cp of the tokens) and over
  // both up to 8 ranks, as the CPU calibration splits them up to its ranks (which prices cp 2
  // on cpu-small within 4% where interpolated shapes were 10% off); one row per {m, k, n}, the
  // first timed. The splits are smaller GEMMs: the cp ones add about 3/4 of the whole and tp
  // ones' GPU time.
  std::vector<std::array<int, 3>> squares;
  for (const cu::GemmShape& s : shapes) squares.push_back({s.m, s.k, s.n});
  const int split = quick ? 1 : 8;
  const auto model_gemms = dtsim::exec::cpu::gemms_to_time(graph, split, squares, split);
  const auto model_seconds = cu::time_model_gemms(gpu.index, gemm_precision, model_gemms, repeats);
  // The non-GEMM ops with the executor's GPU kernels, as rates of the graph's own work.
  cu::OpShapes op_shapes;
  op_shapes.B = static_cast<int>(graph.micro_batch());
  op_shapes.S = static_cast<int>(graph.seq_len());
  op_shapes.C = static_cast<int>(spec.hidden);
  op_shapes.V = static_cast<int>(spec.vocab_rows());
  op_shapes.H = static_cast<int>(spec.heads);
  op_shapes.G = static_cast<int>(spec.kv_heads);
  op_shapes.D = static_cast<int>(spec.head_dim);
  // (The activation at the shape of the op its rate is priced by.)
  const auto activation = dtsim::exec::cpu::priced_activation(graph);
  op_shapes.F = static_cast<int>(activation.width);
  op_shapes.activation_rows = activation.rows;
  op_shapes.rms = spec.norm == dtsim::model::Norm::RmsNorm;
  op_shapes.gelu = spec.activation == dtsim::model::Activation::Gelu;
  op_shapes.rope = spec.positions == dtsim::model::Positions::Rope;
  op_shapes.learned_positions = spec.positions == dtsim::model::Positions::Learned;
  op_shapes.rope_theta = spec.rope_theta;
  if (spec.mla) {
    op_shapes.Dn = static_cast<int>(spec.mla->qk_nope_head_dim);
    op_shapes.Dr = static_cast<int>(spec.mla->qk_rope_head_dim);
    op_shapes.Dv = static_cast<int>(spec.mla->v_head_dim);
  }
  const auto op_times = cu::time_ops(gpu.index, gemm_precision, op_shapes, repeats,
                                     quick ? (std::int64_t{1} << 20) : (std::int64_t{1} << 26));
  nlohmann::json ops = dtsim::exec::cpu::op_rate_rows(graph, op_times.ops);
  // AdamW: 28 bytes per parameter (the CPU backend's count: read p, g, m, v; write p, m, v).
  ops.push_back(
      {{"op", "optimizer"},
       {"phase", "step"},
       {"bytes_per_s", 28.0 * static_cast<double>(op_times.adamw_params) / op_times.adamw_s},
       {"seconds", op_times.adamw_s}});
  std::vector<cu::CollectiveTiming> collectives;
  if (mpi && ranks > 1) {
    collectives = cu::time_collectives(
        gpu.index, rank, ranks, quick ? (1u << 20) : (256u << 20), repeats, collective_timeout,
        mpi->host(), [&](void* data, std::size_t bytes) { mpi->broadcast(data, bytes); },
        [&](double v) { return mpi->max(v); });
  }
  nlohmann::json gemm = nlohmann::json::array();
  for (const auto& g : device.gemm) {
    gemm.push_back({{"m", g.shape.m}, {"n", g.shape.n}, {"k", g.shape.k}, {"seconds", g.seconds}});
  }
  for (std::size_t i = 0; i < model_gemms.size(); ++i) {
    const auto [m, k, n] = model_gemms[i].mkn();
    gemm.push_back({{"m", m}, {"n", n}, {"k", k}, {"seconds", model_seconds[i]}});
  }
  nlohmann::json table = nlohmann::json::array();
  for (const auto& c : collectives) {
    const double n = c.ranks;
    const double factor = c.kind == "all_reduce"  ? 2 * (n - 1) / n
                          : c.kind == "send_recv" ? 1.0
                                                  : (n - 1) / n;
    const double algbw = static_cast<double>(c.bytes) / c.seconds;
    table.push_back({{"kind", c.kind},
                     {"ranks", c.ranks},
                     {"bytes", c.bytes},
                     {"seconds", c.seconds},
                     {"algbw_bytes_per_s", algbw},
                     {"busbw_bytes_per_s", algbw * factor}});
  }
  const auto [host, date] = dtsim::exec::cpu::calibration_stamp();
  // The jitter of every rank's GPU, averaged.
  const double jitter = mpi ? mpi->mean(device.jitter_cv) : device.jitter_cv;
  nlohmann::json profile = {
      {"device", gpu.name},
      {"source", fmt::format("dtexec calibrate --backend cuda on {} ({}, {} SMs, CUDA runtime {}, "
                             "cuBLAS {}, NCCL {}), {}: cublasGemmEx {} (fp32 accumulation), "
                             "medians of {} runs timed with CUDA events; {} rank(s), one GPU each",
                             host, gpu.name, gpu.sm_count, p.cuda_runtime_version, p.cublas_version,
                             p.nccl_version, date, precision, repeats, ranks)},
      {"precision", precision},
      {"ranks_per_host", mpi ? mpi->local_size() : 1},
      {"gemm", gemm},
      {"memory_bw_bytes_per_s", device.copy_bytes_per_s},
      {"launch_overhead_s", device.launch_overhead_s},
      {"jitter_cv", jitter},
      {"ops", ops},
      {"collectives", table},
      {"notes",
       fmt::format("non-GEMM ops timed with dtexec's own GPU kernels at the shapes of {} "
                   "(micro-batch {}, sequence {}); its attention is unfused, as Megatron-LM's "
                   "before fused kernels (scores, masked softmax, probs x v on cuBLAS), not "
                   "FlashAttention",
                   spec.name, graph.micro_batch(), graph.seq_len())}};
  if (!vm["no-in-run"].as<bool>()) {
    // The training step on this GPU: the calibration model's shapes with as many of its blocks
    // as fit, at most 8 (Llama-3 8B whole, with AdamW's fp32 state, does not fit one GPU). The
    // factors are ratios per phase; with a few blocks the head weighs more in them than in the
    // whole model (every block has the same shapes). dtsim's memory model picks the count: at
    // most 80% of the smallest GPU's memory (the rest for cuBLAS, NCCL and the pool's slack).
    const auto step_precision = *dtsim::parse_precision(precision);
    double capacity = static_cast<double>(gpu.memory_bytes);
    if (mpi) capacity = -mpi->max(-capacity);
    const auto step_graph = dtsim::exec::in_run_graph(spec, graph.micro_batch(), graph.seq_len(),
                                                      step_precision, 0.8 * capacity);
    if (!step_graph) {
      // The profile is whole without the factors: say so, and go on.
      const std::string why = fmt::format(
          "in_run not measured: a training step of {} with one block does not fit in 80% of "
          "this GPU's {:.0f} GiB (dtsim memory); the profile prices tasks by the kernels alone",
          spec.name, capacity / (1024.0 * 1024 * 1024));
      if (rank == 0) std::cerr << "dtexec calibrate: " << why << "\n";
      add_note(profile, why);
      return profile;
    }
    auto step_device = cu::make_device(
        gpu.index, precision == "bf16" ? dtsim::exec::Dtype::BF16 : dtsim::exec::Dtype::F32);
    const GemmTimer time_gemms = [&](const std::vector<dtsim::exec::ModelGemm>& gemms) {
      return cu::time_model_gemms(gpu.index, gemm_precision, gemms, 1);
    };
    std::function<void()> sync;
    if (mpi) sync = [mpi] { mpi->barrier(); };
    std::vector<double> phase_seconds;
    auto in_run = measure_in_run(profile, *step_graph, *step_device, time_gemms, quick ? 2 : 5,
                                 sync, phase_seconds);
    if (mpi) in_run_over_ranks(in_run, phase_seconds, *mpi);
    profile["in_run"] = in_run;
    add_note(profile, fmt::format("in_run: {} with {} of its {} blocks, one micro-batch per step",
                                  spec.name, step_graph->spec().layers, spec.layers));
  }
  return profile;
}
#endif

}  // namespace

int calibrate(const std::vector<std::string>& args) {
  po::options_description desc("dtexec calibrate options");
  desc.add_options()("help,h", "show this help")(
      "backend", po::value<std::string>()->default_value("cpu"), "cpu or cuda")(
      "precision", po::value<std::string>(),
      "GEMMs: bf16 (fp32 accumulation; cuda's default) or fp32 (the CPU backend measures fp32 "
      "only)")("out", po::value<std::string>(), "write the profile here (required)")(
      "model", po::value<std::string>()->default_value("cpu-small"),
      "time the ops at this model's shapes")(
      "micro-batch-size", po::value<std::int64_t>()->default_value(4), "for the op shapes")(
      "seq-len", po::value<std::int64_t>(), "for the op shapes (default: the model's)")(
      "repeats", po::value<int>()->default_value(5), "runs per measurement (the median counts)")(
      "cluster-out", po::value<std::string>(),
      "also write this host as a cluster (DIR/cpu-host.json, DIR/devices/cpu-host.json)")(
      "quick", po::bool_switch(),
      "a few small shapes only (seconds with the default model; for tests): micro-batch 1, "
      "short sequences, few repeats (not with --micro-batch-size, --seq-len or --repeats); a "
      "larger --model's own widths still take minutes on a CPU (Llama-3 8B's)")(
      "no-in-run", po::bool_switch(),
      "skip the training steps that measure the in_run factors (the profile then prices a "
      "step's tasks from its kernels timed alone)")(
      "collective-timeout", po::value<double>()->default_value(600),
      "under mpirun: seconds that measuring one collective at one size (or setting up NCCL's "
      "communicator) may take before this rank says what hung and the job is ended, exit code "
      "3 (0: never; MPI's and NCCL's calls have no limit of their own)");
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtexec calibrate --out P.json [--model M] [--cluster-out DIR] [--quick]\n"
             "       mpirun -np N dtexec calibrate ...   (ranks measure at once; collectives)",
             vm)) {
    return 0;
  }
  const std::string backend = vm["backend"].as<std::string>();
  if (backend != "cpu" && backend != "cuda") {
    throw dtsim::InputError(fmt::format("--backend: expected cpu or cuda, got \"{}\"", backend));
  }
  if (!vm.count("out")) throw dtsim::InputError("--out: required (where to write the profile)");
  dtsim::cli::check_writable(vm["out"].as<std::string>(), "--out", &vm);
  const std::string precision = vm.count("precision") ? vm["precision"].as<std::string>()
                                : backend == "cuda"   ? "bf16"
                                                      : "fp32";
  if (backend == "cpu" && precision != "fp32") {
    throw dtsim::InputError(
        fmt::format("--precision {}: the CPU backend measures fp32 only", precision));
  }
  if (backend == "cuda" && precision != "bf16" && precision != "fp32") {
    throw dtsim::InputError(
        fmt::format("--precision: expected bf16 or fp32 for cuda, got \"{}\"", precision));
  }
  if (backend == "cuda" && vm.count("cluster-out")) {
    throw dtsim::InputError(
        "--cluster-out: only with --backend cpu (a GPU cluster is in "
        "topologies/; --profile applies the measurements to it)");
  }
  if (vm.count("cluster-out")) check_cluster_dir(vm["cluster-out"].as<std::string>());
#ifndef DTEXEC_HAVE_CUDA
  if (backend == "cuda") {
    throw dtsim::UnsupportedError(
        "--backend cuda: this dtexec was built without the CUDA backend (CUDA toolkit or NCCL "
        "not found at configure time; set CUDA_HOME)");
  }
#endif
  const int repeats = vm["repeats"].as<int>();
  if (repeats < 1)
    throw dtsim::InputError(fmt::format("--repeats: expected >= 1, got {}", repeats));
  // As dtexec run's --task-timeout: 0 (never), or a finite wait from a millisecond.
  const double collective_timeout = vm["collective-timeout"].as<double>();
  if (!(collective_timeout == 0 || (collective_timeout >= 1e-3 && collective_timeout <= 1e6))) {
    throw dtsim::InputError(
        fmt::format("--collective-timeout: expected 0 (never) or a number of seconds from 0.001 "
                    "to 1e6, got {}",
                    collective_timeout));
  }
  std::unique_ptr<dtsim::exec::cpu::MpiSession> mpi;
  if (dtsim::exec::cpu::under_mpirun()) mpi = std::make_unique<dtsim::exec::cpu::MpiSession>();
  const int rank = mpi ? mpi->rank() : 0;
  const int ranks = mpi ? mpi->size() : 1;
  g_rank = rank;
  if (mpi) check_same_arguments(*mpi, vm, "calibrate");
  dtsim::exec::cpu::CalibrateOptions options;
  options.quick = vm["quick"].as<bool>();
  options.repeats = repeats;
  options.model = vm["model"].as<std::string>();
  options.micro_batch_size = vm["micro-batch-size"].as<std::int64_t>();
  if (options.micro_batch_size < 1 || options.micro_batch_size > 65536) {
    throw dtsim::InputError(
        fmt::format("--micro-batch-size: expected 1..65536, got {}", options.micro_batch_size));
  }
  if (vm.count("seq-len")) {
    options.seq_len = vm["seq-len"].as<std::int64_t>();
    // (A model file that one node does not see fails there alone: see alike_on_every_rank.)
    alike_on_every_rank(mpi.get(), "calibrate", [&] {
      const auto spec = dtsim::model::load_model(options.model);
      if (options.seq_len < 1 || options.seq_len > spec.max_positions) {
        throw dtsim::InputError(
            fmt::format("--seq-len: expected 1..{} (max_positions of {}), got {}",
                        spec.max_positions, spec.name, options.seq_len));
      }
    });
  }
  // --quick measures its own few shapes: a flag it would not read is refused, not ignored.
  if (vm["quick"].as<bool>()) {
    for (const char* flag : {"micro-batch-size", "seq-len", "repeats"}) {
      if (vm.count(flag) && !vm[flag].defaulted()) {
        throw dtsim::InputError(fmt::format(
            "--{}: not with --quick, which measures a few small shapes of its own (micro-batch "
            "1, short sequences, few repeats)",
            flag));
      }
    }
  }
  options.ranks_per_host = ranks;
  options.gemm_threads = ranks > 1 ? 1 : 0;  // as dtexec run sets them
  if (mpi) options.sync = [&mpi] { mpi->barrier(); };
  nlohmann::json profile;
  try {
#ifdef DTEXEC_HAVE_CUDA
    if (backend == "cuda") profile = calibrate_cuda(vm, precision, collective_timeout, mpi.get());
#endif
    if (backend == "cpu") {
      // What it is doing, as it goes (the tables come at the end; a large --model's shapes take
      // minutes on a CPU).
      const auto doing = [rank](const std::string& what) {
        if (rank == 0) std::cerr << "dtexec calibrate: " << what << "\n" << std::flush;
      };
      doing(fmt::format("timing GEMMs, kernels and memory bandwidth at {}'s shapes{}",
                        options.model, options.quick ? " (--quick)" : ""));
      profile = dtsim::exec::cpu::calibrate(options);
      if (mpi) {
        doing(fmt::format("timing collectives over {} ranks", ranks));
        profile["collectives"] =
            dtsim::exec::cpu::measure_collectives(*mpi, options.quick, repeats, collective_timeout);
        profile["jitter_cv"] = mpi->mean(profile.at("jitter_cv").get<double>());
      }
      if (!vm["no-in-run"].as<bool>()) {
        std::vector<double> phase_seconds;
        dtsim::exec::cpu::CpuDevice device;
        const GemmTimer time_gemms = [](const std::vector<dtsim::exec::ModelGemm>& gemms) {
          std::vector<double> seconds;
          for (const auto& g : gemms) seconds.push_back(dtsim::exec::cpu::time_gemm(g, 1));
          return seconds;
        };
        // The calibration model's step with as many of its blocks as fit in 80% of this host's
        // available memory shared by the ranks measuring at once (as on the GPU: the factors
        // are ratios per phase); the whole model where it fits. (GPT-2 124M at its sequence of
        // 1024 held 11.6 GB per rank, and the kernel killed one of two on a 24 GB host.)
        const dtsim::model::ModelGraph whole = dtsim::exec::cpu::calibration_graph(options);
        const auto available = host_memory_per_rank(mpi ? mpi->local_size() : 1);
        double capacity =
            0.8 * (available ? available->bytes : std::numeric_limits<double>::infinity());
        if (mpi) capacity = -mpi->max(-capacity);  // the least any rank has
        auto step_graph =
            dtsim::exec::in_run_graph(whole.spec(), whole.micro_batch(), whole.seq_len(),
                                      dtsim::Precision::Fp32, capacity, whole.spec().layers);
        if (step_graph) {
          doing(
              fmt::format("in_run: training steps of {} ({} of its {} blocks) to time a step's "
                          "phases against its kernels",
                          whole.spec().name, step_graph->spec().layers, whole.spec().layers));
          auto in_run = measure_in_run(profile, *step_graph, device, time_gemms,
                                       options.quick ? 2 : 5, options.sync, phase_seconds);
          if (mpi) in_run_over_ranks(in_run, phase_seconds, *mpi);
          profile["in_run"] = in_run;
          if (step_graph->spec().layers < whole.spec().layers) {
            const std::string what = fmt::format(
                "in_run: {} with {} of its {} blocks (what fits in 80% of this host's available "
                "memory per rank, dtsim memory)",
                whole.spec().name, step_graph->spec().layers, whole.spec().layers);
            if (rank == 0) std::cerr << "dtexec calibrate: " << what << "\n";
            add_note(profile, what);
          }
        } else {
          const std::string why = fmt::format(
              "in_run not measured: a training step of {} with one block does not fit in 80% of "
              "this host's available memory per rank ({:.1f} GiB, dtsim memory); the profile "
              "prices tasks by the kernels alone",
              whole.spec().name, capacity / (1024.0 * 1024 * 1024));
          if (rank == 0) std::cerr << "dtexec calibrate: " << why << "\n";
          add_note(profile, why);
        }
      }
    }
  } catch (const std::exception& e) {
    end_all_ranks(e, mpi.get(), "calibrate");
    throw;
  }
  if (rank != 0) return 0;
  const std::string path = vm["out"].as<std::string>();
  dtsim::exec::check_profile_readable(profile, path);
  std::ofstream file(path);
  if (!file || !(file << json_text(profile, 2) << "\n" << std::flush)) {
    throw dtsim::InputError(fmt::format("--out {}: cannot write", path));
  }
  if (vm.count("cluster-out"))
    write_host_topology(vm["cluster-out"].as<std::string>(), profile, ranks);
  print_profile(profile, path);
  if (vm.count("cluster-out")) {
    std::cout << fmt::format(
        "cluster written to {}/cpu-host.json (use --cluster {}/cpu-host.json)\n",
        vm["cluster-out"].as<std::string>(), vm["cluster-out"].as<std::string>());
  }
  return 0;
}

}  // namespace dtsim::exec::cli
