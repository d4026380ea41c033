// dtexec run: trains a model following the Program dtsim lowers a plan to, on CPU ranks (MPI)
// or GPUs (CUDA + NCCL); reports losses, step times and the measured breakdown against the
// prediction, and writes traces and checkpoints.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "exec/cli/commands.hpp"
#include "exec/core/checkpoint.hpp"
#include "exec/core/peer_waits.hpp"
#include "exec/core/runner.hpp"
#include "exec/cpu/bf16_device.hpp"
#include "exec/cpu/calibrate.hpp"
#include "exec/cpu/device.hpp"
#include "exec/cpu/kernels.hpp"
#include "exec/cpu/mpi_comm.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"
#include "sim/engine/simulator.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/plan/memory_model.hpp"
#include "sim/report/breakdown_json.hpp"
#include "sim/report/json_values.hpp"
#include "sim/report/table.hpp"
#include "sim/report/trace.hpp"
#include "sim/report/validate.hpp"

#ifdef DTEXEC_HAVE_CUDA
#include "exec/cuda/device.hpp"
#include "exec/cuda/gpu_probe.hpp"
#include "exec/cuda/nccl_comm.hpp"
#endif

namespace dtsim::exec::cli {

namespace {

// What resuming `dir` under `plan` changes: the checkpoint read from DIR.old (where DIR holds
// none), and one written under another plan (the plan's summary or sequence length differ).
// Throws InputError when the folder is not a readable checkpoint, or one that this run of
// `model` with `options` would not continue (check_resume). The warm-up counts this run's
// steps, those after the checkpoint's: unless `warmup_given`, the one-step default (none when
// one step is left), else refused where it leaves no step timed.
std::vector<std::string> resume_notes(const std::string& dir, const dtsim::model::ModelSpec& spec,
                                      dtsim::exec::RunOptions& options,
                                      const dtsim::plan::Plan& plan, bool warmup_given) {
  const dtsim::exec::CheckpointReader checkpoint(dir);
  dtsim::exec::check_resume(checkpoint.info(), checkpoint.where(), spec, options, plan.clip_grad);
  const int left = options.steps - checkpoint.info().step;  // >= 1 (check_resume)
  if (!warmup_given) {
    options.warmup_steps = std::min(1, left - 1);
  } else if (options.warmup_steps >= left) {
    throw dtsim::InputError(fmt::format(
        "--warmup {}: {} is at step {}, so --steps {} runs {} step(s) here, {} of them warm-up: "
        "none would be timed; give more --steps or a shorter --warmup",
        options.warmup_steps, checkpoint.where(), checkpoint.info().step, options.steps, left,
        options.warmup_steps));
  }
  std::vector<std::string> notes;
  if (checkpoint.from_old()) {
    notes.push_back(fmt::format(
        "{} holds no checkpoint: resuming {} (step {}), the one before it, which a checkpoint "
        "stopped between its two renames left there",
        dir, checkpoint.dir(), checkpoint.info().step));
  }
  // The plan it was written under, whole as dtexec writes it (a hand edit is refused, as any
  // other field of the checkpoint is: its notes would describe a plan that never ran).
  const dtsim::plan::Plan written =
      dtsim::plan::plan_from_json(checkpoint.info().plan, checkpoint.where() + ": plan");
  if (written.dp < 1 || written.global_batch_size < 1 || written.seq_len < 1) {
    throw dtsim::InputError(
        fmt::format("{}: plan: expected the whole plan the checkpoint was written under (dp, "
                    "global_batch_size and seq_len among its fields), as dtexec run writes it",
                    checkpoint.where()));
  }
  // And one that could have run (an edited dp of 4 with a global batch of 2 was resumed).
  if (const auto check = dtsim::plan::check_plan(written, spec, written.devices()); !check.ok()) {
    throw dtsim::InputError(
        fmt::format("{}: plan: not a plan dtexec could have run ({}); expected the plan the "
                    "checkpoint was written under, as dtexec run writes it",
                    checkpoint.where(), check.errors.front().message));
  }
  // Another vocabulary padding: refused before the run says it resumes (each rank would also
  // find the embedding's rows differ as it reads the tensors).
  if (const std::int64_t rows = dtsim::plan::padded_vocab(spec.vocab, written);
      rows != dtsim::plan::padded_vocab(spec.vocab, plan)) {
    throw dtsim::InputError(dtsim::exec::vocab_padding_refusal(
        checkpoint.where() + ": plan: its embedding", rows, spec.vocab, plan,
        std::int64_t{written.make_vocab_size_divisible_by} * written.tp));
  }
  if (dtsim::plan::summary(written) == dtsim::plan::summary(plan) &&
      written.seq_len == plan.seq_len) {
    return notes;
  }
  const bool same_batch = written.global_batch_size == plan.global_batch_size &&
                          written.seq_len == plan.seq_len && written.precision == plan.precision;
  notes.push_back(fmt::format(
      "resuming a checkpoint of another plan ({}, sequence {}): its tensors resharded to this "
      "one; {}",
      dtsim::plan::summary(written), written.seq_len,
      same_batch ? "the same batch and precision, so the losses continue within fp32 rounding "
                   "(bitwise under the same plan)"
                 : "the steps from here train on another batch or precision than the "
                   "checkpoint's"));
  return notes;
}

// A fault-injection option RANK:STEP (--fail-at, --hang-at), when given; with `suffix`, also
// RANK:STEP:SUFFIX (--hang-at 1:2:checkpoint), or for the suffix "start" RANK:start, step 0
// (--fail-at 1:start); `suffixed`, where given, says whether it was given so.
void rank_and_step(const po::variables_map& vm, const char* key, std::int64_t ranks, int steps,
                   int& rank, int& step, const char* suffix = nullptr, bool* suffixed = nullptr) {
  if (!vm.count(key)) return;
  const std::string given = vm[key].as<std::string>();
  const std::string tail = suffix ? fmt::format(":{}", suffix) : std::string();
  const bool with_suffix = suffix && given.size() > tail.size() && given.ends_with(tail);
  if (suffixed) *suffixed = with_suffix;
  const std::string text = with_suffix ? given.substr(0, given.size() - tail.size()) : given;
  const bool start_form = suffix && std::string_view(suffix) == "start";  // RANK:start
  const bool at_start = with_suffix && start_form;                        // (no step)
  char rest = 0;
  const bool read = at_start ? std::sscanf(text.c_str(), "%d%c", &rank, &rest) == 1
                             : std::sscanf(text.c_str(), "%d:%d%c", &rank, &step, &rest) == 2;
  if (at_start) step = 0;
  if (!read || rank < 0 || (!at_start && step < 1)) {
    throw dtsim::InputError(fmt::format("--{} {}: expected RANK:STEP (a rank >= 0, a step >= 1){}",
                                        key, given,
                                        !suffix      ? std::string()
                                        : start_form ? fmt::format(" or RANK:{}", suffix)
                                                     : fmt::format(" or RANK:STEP:{}", suffix)));
  }
  // A fault that could not happen would let a test that relies on it pass without it.
  if (rank >= ranks || step > steps) {
    throw dtsim::InputError(
        fmt::format("--{} {}: never happens in this run: expected a rank below {} and a step up "
                    "to --steps {}",
                    key, given, ranks, steps));
  }
}

// The breakdown averages the last timed steps, at most this many: what rank 0 gathers of every
// rank stays bounded on long runs (a bound of dtexec's, not a modelling figure).
constexpr std::size_t kBreakdownSteps = 8;

// This machine's boot, hashed to 52 bits (exact in a double): CLOCK_MONOTONIC, the steady
// clock, counts from it, for every process and container on the machine. 0 when unknown.
double boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (!(in >> id) || id.empty()) return 0;
  const std::uint64_t h = fnv1a(id);
  return static_cast<double>((h & ((std::uint64_t{1} << 52) - 1)) | 1);
}

// For tests of ranks on several machines, on one: DTEXEC_TEST_CLOCK_SKEW_S=X moves rank r's
// clock r·X seconds ahead (the seconds returned), as another machine's clock would be.
double clock_skew_s(int rank) {
  const char* v = std::getenv("DTEXEC_TEST_CLOCK_SKEW_S");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (*end != '\0' || !std::isfinite(x)) {
    throw dtsim::InputError(
        fmt::format("DTEXEC_TEST_CLOCK_SKEW_S: expected a number of seconds, got \"{}\"", v));
  }
  return x * rank;
}

// Every rank's last kBreakdownSteps timed steps, gathered on rank 0 (empty elsewhere), on one
// clock: their host's where the ranks share one, else rank 0's, to which the others' were put.
struct Timings {
  // The ranks share one machine's clock; else theirs were put on rank 0's
  // (Comm::clock_offsets), each within clock_error_s.
  bool shared_clock = true;
  double clock_error_s = 0;
  // Comm::progresses_while_computing: else a collective's time leaves out the compute that ran
  // while it was pending (exec::leave_out_compute).
  bool comm_progresses = true;
  std::vector<double> origin_s;               // per rank: its clock's zero on the one clock
  std::vector<std::vector<double>> begins_s;  // per rank: its start of each step (its clock)
  std::vector<std::map<int, std::vector<dtsim::exec::TaskRecord>>> by_step;  // per rank
  // Rank r's start of the step at `index` (step - first_step) on its clock; 0 if not known.
  double begin(std::size_t r, std::size_t index) const {
    return r < begins_s.size() && index < begins_s[r].size() ? begins_s[r][index] : 0.0;
  }
};

// `skew`: clock_skew_s of this rank.
Timings gather_timings(const dtsim::exec::RunResult& result, dtsim::exec::Comm& comm, double skew) {
  // This rank's clock; its times count from `origin`.
  const double origin = result.clock_origin_s + skew;
  // One clock: one boot, and origins within a minute of each other (the ranks start together;
  // a clock offset, as a time namespace gives, would show there). A rank whose clock the test
  // hook moved counts as another machine's, however little it moved it.
  const double boot = skew != 0 ? 0 : boot_id();
  std::array<double, 4> clock = {boot, -boot, origin, -origin};
  comm.all_ranks(clock, dtsim::exec::Reduce::Max);
  const bool shared =
      comm.size() == 1 || (boot != 0 && clock[0] == -clock[1] && clock[2] + clock[3] < 60.0);
  // Else: each rank's clock against rank 0's, now, just after the steps that are measured.
  dtsim::exec::ClockOffsets offsets;
  if (!shared) {
    offsets = comm.clock_offsets([skew] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
                 .count() +
             skew;
    });
  }
  std::set<int> timed;
  for (const auto& t : result.tasks) timed.insert(t.step);
  std::set<int> send;
  auto it = timed.end();
  for (std::size_t k = 0; k < kBreakdownSteps && it != timed.begin(); ++k) send.insert(*--it);
  std::vector<double> mine = {origin, static_cast<double>(result.step_begins_s.size())};
  mine.insert(mine.end(), result.step_begins_s.begin(), result.step_begins_s.end());
  for (const auto& t : result.tasks) {
    if (!send.count(t.step)) continue;
    mine.insert(mine.end(),
                {static_cast<double>(t.task), static_cast<double>(t.step), t.start_s, t.end_s});
  }
  std::string bytes(reinterpret_cast<const char*>(mine.data()), mine.size() * sizeof(double));
  const auto parts = comm.gather_to_root(std::move(bytes));
  Timings all;
  if (comm.rank() != 0) return all;
  all.shared_clock = shared;
  all.clock_error_s = offsets.error_s;
  all.comm_progresses = comm.progresses_while_computing();
  for (std::size_t r = 0; r < parts.size(); ++r) {
    std::vector<double> v(parts[r].size() / sizeof(double));
    std::memcpy(v.data(), parts[r].data(), v.size() * sizeof(double));
    // On rank 0's clock where the ranks' clocks differ.
    all.origin_s.push_back(v.at(0) - (shared ? 0.0 : offsets.offset_s.at(r)));
    const auto steps = static_cast<std::size_t>(v.at(1));
    all.begins_s.emplace_back(v.begin() + 2, v.begin() + 2 + static_cast<std::ptrdiff_t>(steps));
    auto& by_step = all.by_step.emplace_back();
    for (std::size_t at = 2 + steps; at + 4 <= v.size(); at += 4) {
      const int step = static_cast<int>(v[at + 1]);
      by_step[step].push_back({static_cast<std::int64_t>(r), static_cast<std::int32_t>(v[at]),
                               v[at + 2], v[at + 3], step});
    }
  }
  return all;
}

// One step's tasks of every program, each from `origin(rank)` on its rank's clock (untimed ones
// {0, 0}); each communication task starts when its parties are all ready, as the simulator's do,
// and with a backend that moves data only inside its calls a collective leaves out the compute
// run while it was pending.
template <class Origin>
std::vector<std::vector<dtsim::engine::TaskTime>> step_times(const Timings& all,
                                                             const dtsim::lower::Program& program,
                                                             int step, const Origin& origin) {
  std::vector<std::vector<dtsim::exec::TaskSpan>> spans(program.ranks.size());
  for (std::size_t r = 0; r < program.ranks.size(); ++r) {
    spans[r].resize(program.ranks[r].tasks.size());
    if (r >= all.by_step.size()) continue;
    const auto it = all.by_step[r].find(step);
    if (it == all.by_step[r].end()) continue;
    for (const auto& t : it->second) {
      spans[r].at(static_cast<std::size_t>(t.task)) = {t.start_s + all.origin_s[r],
                                                       t.end_s + all.origin_s[r], true};
    }
  }
  if (!all.comm_progresses) dtsim::exec::leave_out_compute(program, spans);
  if (program.ranks.size() > 1) dtsim::exec::start_when_peers_ready(program, spans);
  std::vector<std::vector<dtsim::engine::TaskTime>> times(program.ranks.size());
  for (std::size_t r = 0; r < spans.size(); ++r) {
    const double zero = r < all.origin_s.size() ? all.origin_s[r] + origin(r) : 0.0;
    for (const auto& s : spans[r]) {
      times[r].push_back(s.timed ? dtsim::engine::TaskTime{s.start_s - zero, s.end_s - zero}
                                 : dtsim::engine::TaskTime{});
    }
  }
  return times;
}

// Where a stage's last timed steps (kBreakdownSteps at most) went, on average, on its first
// rank: the simulator's rule (engine::breakdown_of) over each step's tasks, from the rank's
// start of the step to the end of the slowest rank's step; every stage (rank 0 has all ranks'
// times).
std::vector<dtsim::engine::StagePrediction> measured_stages(const Timings& all,
                                                            const dtsim::exec::RunResult& result,
                                                            const dtsim::lower::Program& program) {
  std::vector<dtsim::engine::StagePrediction> stages;
  if (all.by_step.empty()) return stages;
  // Each stage's first program with times, in stage order.
  std::map<int, std::size_t> first_of;
  for (std::size_t r = 0; r < program.ranks.size() && r < all.by_step.size(); ++r) {
    if (!all.by_step[r].empty()) first_of.try_emplace(program.ranks[r].stage, r);
  }
  std::vector<std::size_t> firsts;
  for (const auto& [stage, r] : first_of) {
    firsts.push_back(r);
    stages.push_back({stage, program.ranks[r].rank, {}});
  }
  const double n = static_cast<double>(std::max<std::size_t>(1, all.by_step[0].size()));
  for (const auto& [step, records] : all.by_step[0]) {
    const auto index = static_cast<std::size_t>(step - result.first_step);
    // Each rank from its own start of the step.
    const auto times =
        step_times(all, program, step, [&](std::size_t r) { return all.begin(r, index); });
    for (std::size_t k = 0; k < firsts.size(); ++k) {
      const dtsim::engine::Breakdown b = dtsim::engine::breakdown_of(
          program.ranks[firsts[k]], times[firsts[k]], result.step_times_s.at(index));
      for (auto term :
           {&dtsim::engine::Breakdown::compute_s, &dtsim::engine::Breakdown::recompute_s,
            &dtsim::engine::Breakdown::optimizer_s, &dtsim::engine::Breakdown::bubble_s,
            &dtsim::engine::Breakdown::exposed_tp_s, &dtsim::engine::Breakdown::exposed_cp_s,
            &dtsim::engine::Breakdown::exposed_ep_s, &dtsim::engine::Breakdown::exposed_dp_s,
            &dtsim::engine::Breakdown::exposed_pp_s,
            &dtsim::engine::Breakdown::overlapped_s}) {  // (no straggler terms: 0 measured)
        stages[k].breakdown.*term += b.*term / n;
      }
    }
  }
  return stages;
}

// The time rank r spent between its tasks, the mean over its gathered steps: from the rank's
// start of the step to its last task's end, what none of its tasks covers as the rank timed
// them. On a host-memory device a communication task lasts from when this rank reached it to
// its completion, so waits for peers are inside tasks, and this is the runner's own work
// between tasks (and what the OS took), which the measured bubble holds along with the waits.
// A lower bound of it: work done while a blocking send is open (its end is where the runner
// next waits for sends) is covered by that send. (On a device that queues work, the spans are
// the compute stream's, and its waits for collectives and sends fall between them: not this.)
double runner_work_s(const Timings& all, const dtsim::exec::RunResult& result, std::size_t r) {
  if (r >= all.by_step.size() || all.by_step[r].empty()) return 0;
  double sum = 0;
  for (const auto& [step, records] : all.by_step[r]) {
    std::vector<std::pair<double, double>> spans;
    for (const auto& t : records) spans.emplace_back(t.start_s, t.end_s);
    std::sort(spans.begin(), spans.end());
    double covered = all.begin(r, static_cast<std::size_t>(step - result.first_step));
    for (const auto& [start, end] : spans) {
      if (start > covered) sum += start - covered;
      covered = std::max({covered, start, end});
    }
  }
  return sum / static_cast<double>(all.by_step[r].size());
}

// The fastest and slowest step after warm-up.
std::pair<double, double> spread(const dtsim::exec::RunResult& result, int warmup) {
  const auto& t = result.step_times_s;
  const auto from =
      t.begin() + std::min<std::ptrdiff_t>(warmup, static_cast<std::ptrdiff_t>(t.size()) - 1);
  return {*std::min_element(from, t.end()), *std::max_element(from, t.end())};
}

// A rate flag (--lr, --min-lr, --weight-decay) as the optimizer keeps it (a float), within
// what a checkpoint's reader takes back (JsonReader::positive_number, or 0 where `zero` is
// allowed): a run whose checkpoint it would refuse on --resume is refused before it starts.
float rate_flag(const po::variables_map& vm, const char* flag, bool zero) {
  const double given = vm[flag].as<double>();
  if (!((zero && given == 0) || dtsim::is_figure(given))) {
    throw dtsim::InputError(fmt::format("--{}: expected {}from {:g} to {:g}, got {:g}", flag,
                                        zero ? "0, or a rate " : "a rate ", dtsim::kSmallestFigure,
                                        dtsim::kLargestFigure, given));
  }
  return static_cast<float>(given);
}

// The learning-rate schedule of --lr and its warm-up and decay flags; a decay ends at --steps
// unless --lr-decay-steps says otherwise.
dtsim::exec::LrSchedule lr_schedule_of(const po::variables_map& vm, int steps) {
  dtsim::exec::LrSchedule s;
  s.max_lr = rate_flag(vm, "lr", false);
  s.warmup_steps = vm["lr-warmup-steps"].as<int>();
  const auto style = vm["lr-decay-style"].as<std::string>();
  const auto decay = dtsim::exec::parse_lr_decay(style);
  if (!decay) {
    throw dtsim::InputError(
        fmt::format("--lr-decay-style: expected constant, linear or cosine, got \"{}\"", style));
  }
  s.decay = *decay;
  if (s.decay == dtsim::exec::LrDecay::Constant) {
    for (const char* flag : {"lr-decay-steps", "min-lr"}) {
      if (vm.count(flag)) {
        throw dtsim::InputError(
            fmt::format("--{}: only with --lr-decay-style linear or cosine", flag));
      }
    }
  } else {
    s.decay_steps = vm.count("lr-decay-steps") ? vm["lr-decay-steps"].as<int>() : steps;
    if (vm.count("min-lr")) s.min_lr = rate_flag(vm, "min-lr", true);
  }
  s.check();
  return s;
}

// The devices a plan given by --plan and the degree flags needs (dp defaults to 1).
std::int64_t requested_devices(const po::variables_map& vm) {
  dtsim::plan::Plan p;
  p.dp = 1;
  if (vm.count("plan")) p = dtsim::cli::load_plan_file(vm["plan"].as<std::string>());
  for (auto [key, field] : {std::pair{"tp", &p.tp}, std::pair{"pp", &p.pp}, std::pair{"dp", &p.dp},
                            std::pair{"cp", &p.cp}}) {
    if (vm.count(key)) *field = vm[key].as<int>();
  }
  return std::max<std::int64_t>(1,
                                static_cast<std::int64_t>(p.tp) * p.pp * p.cp * std::max(1, p.dp));
}

// Writes the last step's tasks of every rank as one Chrome trace, in the simulator's trace
// schema, on one clock from the first rank's start of the step.
void write_trace(const std::string& path, const dtsim::report::TraceInfo& info,
                 const dtsim::lower::Program& program, const Timings& all, int last_step,
                 int first_step) {
  const auto index = static_cast<std::size_t>(std::max(0, last_step - first_step));
  double first = std::numeric_limits<double>::infinity();
  for (std::size_t r = 0; r < all.origin_s.size(); ++r) {
    first = std::min(first, all.origin_s[r] + all.begin(r, index));
  }
  dtsim::engine::Timeline timeline;
  timeline.tasks = step_times(all, program, last_step, [&](std::size_t r) {
    return r < all.origin_s.size() ? first - all.origin_s[r] : 0.0;
  });
  dtsim::report::write_chrome_trace(path, program, timeline, info);
}

// The GPU of this rank (the node-local rank's; the first one without mpirun), with activations in
// the plan's precision; says which in `where`, and its product name (the catalog's alias for it)
// in `product`. Exit code 2 with the reason where there is none. `share` (--share-gpus): a
// host's ranks share its GPUs, each rank a host of its own to NCCL.
std::unique_ptr<dtsim::exec::Device> make_gpu_device(dtsim::Precision precision, int local_rank,
                                                     int local_size, const std::string& host,
                                                     bool share, std::string& where,
                                                     std::string& product) {
#ifdef DTEXEC_HAVE_CUDA
  const auto p = dtsim::exec::cuda::probe();
  if (p.gpus.empty()) {
    throw dtsim::UnsupportedError(
        fmt::format("--backend cuda: no GPU on this machine ({})", p.why_none));
  }
  // A launcher that gives each rank its own GPU (srun --gpus-per-task=1) shows it one, through
  // CUDA_VISIBLE_DEVICES: that one is the rank's (NCCL refuses two ranks on one GPU, by name).
  const bool own_gpu = p.gpus.size() == 1 && std::getenv("CUDA_VISIBLE_DEVICES") != nullptr;
  if (static_cast<std::size_t>(local_size) > p.gpus.size() && !own_gpu && !share) {
    throw dtsim::UnsupportedError(fmt::format(
        "--backend cuda: {} ranks on {} but {} GPU{}: NCCL needs a GPU per rank (--share-gpus "
        "to test on fewer)",
        local_size, host, p.gpus.size(), p.gpus.size() == 1 ? "" : "s"));
  }
  const auto& g = p.gpus[static_cast<std::size_t>(local_rank) % p.gpus.size()];
  const bool bf16 = precision == dtsim::Precision::Bf16;
  where = fmt::format("GPU {} ({}), {} activations", g.index, g.name, bf16 ? "bf16" : "fp32");
  product = g.name;
  if (share && static_cast<std::size_t>(local_size) > p.gpus.size()) {
    // NCCL tells hosts apart by a hash of NCCL_HOSTID where it is set: a rank of its own host
    // is no duplicate of the ranks on its GPU, and reaches them over its network transport
    // (sockets; loopback and no InfiniBand unless the user chose otherwise). Set before the
    // communicators are made.
    setenv("NCCL_HOSTID", fmt::format("{}-local-rank-{}", host, local_rank).c_str(), 1);
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_IB_DISABLE", "1", 0);
    where += fmt::format(", shared by {} ranks (--share-gpus: NCCL over sockets)", local_size);
  }
  return dtsim::exec::cuda::make_device(g.index,
                                        bf16 ? dtsim::exec::Dtype::BF16 : dtsim::exec::Dtype::F32);
#else
  (void)precision;
  (void)local_rank;
  (void)local_size;
  (void)host;
  (void)share;
  (void)where;
  (void)product;
  throw dtsim::UnsupportedError(
      "--backend cuda: this dtexec was built without the CUDA backend (CUDA toolkit or NCCL "
      "not found at build time)");
#endif
}

// What dtsim memory predicts for the plan on --cluster (default cpu-host), without its framework
// allowance (a device pool holds tensors only); none where the memory model does not apply.
std::optional<dtsim::plan::MemoryReport> predicted_memory_report(
    const po::variables_map& vm, const dtsim::model::ModelGraph& graph,
    const dtsim::plan::Plan& plan) {
  try {
    const auto c = vm.count("cluster")
                       ? dtsim::cluster::load_cluster(vm["cluster"].as<std::string>())
                       : dtsim::cluster::load_cluster("cpu-host");
    dtsim::plan::MemoryOptions no_allowance;
    no_allowance.framework_overhead_bytes = 0;
    // (Per-rank memory needs only the device; the cluster may have fewer of them than the
    // plan, as cpu-host has this host's cores where mpirun oversubscribes them.)
    return dtsim::plan::estimate_memory(graph, plan, c, no_allowance);
  } catch (const dtsim::InputError&) {
  } catch (const dtsim::UnsupportedError&) {
  }
  return std::nullopt;
}

// dtexec run --only-rank R: the program of R's pipeline stage (every rank of a stage runs the
// same tasks) on this machine alone; communication tasks wait their predicted times.
// `device_name`: the device catalog's name for `device`, for the trace.
// A JSON "memory" object's routing figures (expert parallelism), measured on `whose` experts.
void add_expert_load(nlohmann::json& memory, double load, double peak, const char* whose) {
  memory["expert_load"] = load;
  memory["expert_load_peak"] = peak;
  memory["note"] = fmt::format(
      "{}; expert_load: the token copies {} experts got over the even share, on average over a "
      "micro-batch's MoE blocks, the mean over its micro-batches (expert_load_peak: the "
      "largest), dtsim's --expert-load",
      memory["note"].get<std::string>(), whose);
}

int run_only_rank(const po::variables_map& vm, const dtsim::model::ModelSpec& spec,
                  const dtsim::plan::Plan& plan, const dtsim::model::ModelGraph& graph,
                  const dtsim::lower::Program& program, dtsim::exec::RunOptions options,
                  dtsim::exec::Device& device, const std::string& where,
                  const std::string& device_name) {
  const std::int64_t r = vm["only-rank"].as<std::int64_t>();
  if (r < 0 || r >= plan.devices()) {
    throw dtsim::InputError(
        fmt::format("--only-rank {}: the plan has ranks 0..{}", r, plan.devices() - 1));
  }
  int index = -1;
  for (std::size_t i = 0; i < program.ranks.size(); ++i) {
    const auto& rep = program.ranks[i].represents;
    if (std::find(rep.begin(), rep.end(), r) != rep.end()) index = static_cast<int>(i);
  }
  DTSIM_ASSERT(index >= 0, "every rank belongs to a stage");
  const auto& rp = program.ranks[static_cast<std::size_t>(index)];
  if (device.host_memory()) {
    if (const auto report = predicted_memory_report(vm, graph, plan)) {
      require_host_memory(report->stages.at(static_cast<std::size_t>(rp.stage)).total_bytes, 1,
                          nullptr);
    }
  }
  std::size_t comm_tasks = 0;
  for (const auto& t : rp.tasks) comm_tasks += t.kind == dtsim::lower::TaskKind::Compute ? 0 : 1;
  std::string waits = "of zero length (no --predicted)";
  std::string waits_from = "zero";       // the trace's otherData.only_rank_waits
  std::vector<std::string> trace_notes;  // on the --predicted trace: stderr, and the JSON's notes
  options.predicted_comm_s.assign(rp.tasks.size(), 0.0);
  if (vm.count("predicted")) {
    const std::string path = vm["predicted"].as<std::string>();
    const auto trace = dtsim::report::read_trace(path);
    // A prediction of another run (model or plan) would time the waits wrongly.
    dtsim::report::Trace self;
    self.model = spec.name;
    self.plan = dtsim::plan::to_json(plan);
    if (const auto differ = dtsim::report::run_difference(trace, self)) {
      throw dtsim::InputError(fmt::format(
          "--predicted {}: a trace of another run ({}, the trace's against this run's): "
          "simulate this plan: dtsim simulate ... --trace {}",
          path, *differ, path));
    }
    const bool measured = trace.producer == dtsim::report::kProducedByRun;
    if (measured) {
      trace_notes.push_back(fmt::format(
          "--predicted {}: measured by dtexec run, not predicted by dtsim simulate: its "
          "communication tasks' times include their waits for peers, which the waits here "
          "replay",
          path));
    }
    // (dtsim validate says the same of such a trace.)
    if (trace.plan.is_null()) {
      trace_notes.push_back(fmt::format(
          "--predicted {} does not say which model and plan it is of (otherData): that it is "
          "of this run was checked only by its tasks' kinds and count",
          path));
    }
    for (const std::string& n : trace_notes) std::cerr << "note: " << n << "\n";
    std::size_t found = 0;
    for (const auto& t : trace.tasks) {
      if (t.rank != rp.rank || t.task < 0 || static_cast<std::size_t>(t.task) >= rp.tasks.size()) {
        continue;
      }
      // The same task in both: a communication task of the same kind.
      const auto& task = rp.tasks[static_cast<std::size_t>(t.task)];
      if (task.kind == dtsim::lower::TaskKind::Compute || t.kind != to_string(task.kind)) continue;
      // A wait is a sleep that nothing ends early (no communicator, no watchdog here): one
      // longer than --task-timeout lets a task take is refused rather than slept (a trace in
      // the wrong unit, an edited one).
      if (options.task_timeout_s > 0 && t.duration_s > options.task_timeout_s) {
        throw dtsim::InputError(fmt::format(
            "--predicted {}: task {} of rank {} ({}) lasts {:.6g} s, longer than --task-timeout "
            "({:.6g} s) lets a task take; expected a dtsim simulate --trace of this plan",
            path, t.task, rp.rank, t.name, t.duration_s, options.task_timeout_s));
      }
      options.predicted_comm_s[static_cast<std::size_t>(t.task)] = t.duration_s;
      ++found;
    }
    if (found != comm_tasks) {
      throw dtsim::InputError(fmt::format(
          "--predicted {}: it holds {} of the {} communication tasks of rank {}'s program (stage "
          "{}, the trace's rank {}); simulate the same plan: dtsim simulate ... --trace {}",
          path, found, comm_tasks, r, rp.stage, rp.rank, path));
    }
    waits = fmt::format("of their {} length ({})", measured ? "measured" : "predicted", path);
    waits_from = measured ? "measured" : "predicted";
    // The waits are the predicted cluster's communication (the point of --only-rank: a large
    // plan's rank on one device); said where its device is not this one's.
    if (!trace.device.empty() && trace.device != device_name) {
      waits += fmt::format(", {} on a cluster of {} while this rank computes on {}",
                           measured ? "measured" : "predicted", trace.device, device_name);
    }
  }
  options.program_index = index;
  options.replay_communication = true;
  dtsim::exec::SingleRankComm comm(&device);
  const auto result = dtsim::exec::run_program(graph, program, options, comm, device);
  // Compute and waits per step, from the recorded tasks of the last step.
  const int last = options.steps - 1;
  double compute = 0, waited = 0;
  dtsim::engine::Timeline timeline;
  timeline.tasks.assign(1, std::vector<dtsim::engine::TaskTime>(rp.tasks.size()));
  double begin = -1;
  for (const auto& t : result.tasks) {
    if (t.step != last) continue;
    if (begin < 0) begin = t.start_s;
    timeline.tasks[0][static_cast<std::size_t>(t.task)] = {t.start_s - begin, t.end_s - begin};
    const bool is_compute =
        rp.tasks[static_cast<std::size_t>(t.task)].kind == dtsim::lower::TaskKind::Compute;
    (is_compute ? compute : waited) += t.end_s - t.start_s;
  }
  if (vm.count("trace")) {
    dtsim::lower::Program one;
    one.plan = program.plan;
    one.lowering = program.lowering;
    one.groups = program.groups;
    one.ranks = {rp};
    dtsim::report::write_chrome_trace(
        vm["trace"].as<std::string>(), one, timeline,
        {spec.name, dtsim::report::kProducedByRun, device_name, r, waits_from});
  }
  // Memory: this rank's peak of tensors against dtsim memory's prediction for its stage.
  const double peak = static_cast<double>(device.memory_use().peak);
  std::optional<double> predicted;
  if (const auto report = predicted_memory_report(vm, graph, plan)) {
    predicted = report->stages.at(static_cast<std::size_t>(rp.stage)).total_bytes;
  }
  std::vector<std::string> notes = dtsim::exec::execution_notes(spec, plan);
  // (On stderr already; in the JSON too, where a script reads them.)
  if (vm["json"].as<bool>()) notes.insert(notes.end(), trace_notes.begin(), trace_notes.end());
  // What dtsim's --expert-load stands for, as this rank's experts got it (its tokens' routing
  // taken for every ep rank's): the mean over micro-batches and the largest.
  std::optional<double> expert_load, expert_load_peak;
  const bool local_dispatch = dtsim::plan::moe_local_dispatch(spec, plan);
  // (Not on a stage whose blocks have no experts: a mixture's dense blocks alone.)
  bool stage_experts = false;
  {
    const std::vector<int> chunks = dtsim::plan::chunk_layers(plan, spec.layers);
    int first = 0;
    for (std::size_t k = 0; k < chunks.size(); ++k) {
      const bool here = static_cast<int>(k) % plan.pp == rp.stage;
      for (int l = first; here && l < first + chunks[k]; ++l) {
        stage_experts = stage_experts || spec.has_experts(l);
      }
      first += chunks[k];
    }
  }
  if ((plan.ep > 1 || local_dispatch) && stage_experts) {
    // Under sequence parallelism the tp ranks route their own shares and gather the copies.
    const std::int64_t peers = plan.ep * (local_dispatch ? plan.tp : 1);
    notes.push_back(fmt::format(
        "{} alone: each of the {} {}ranks is taken to route its tokens as this rank does, so "
        "this rank's experts get {} times its own copies for them (even routing across "
        "replicas)",
        plan.ep > 1 ? "expert parallelism" : "a mixture of experts", peers,
        plan.ep > 1 && local_dispatch ? "ep x tp " : (plan.ep > 1 ? "ep " : "tp "), peers));
    if (result.expert_load > 0) {
      expert_load = result.expert_load;
      expert_load_peak = result.expert_load_peak;
      notes.push_back(fmt::format(
          "this rank's experts got {:.3f}x the even share of token copies (up to {:.3f}x in a "
          "micro-batch), where dtsim assumes {:g}x (--expert-load)",
          *expert_load, *expert_load_peak, plan.expert_load));
    }
  }
  if (vm["json"].as<bool>()) {
    nlohmann::json memory = {
        {"peak_bytes", dtsim::report::byte_count(peak)},
        {"replay_input_bytes", dtsim::report::byte_count(result.replay_input_bytes)},
        {"predicted_bytes", predicted ? dtsim::report::byte_count(*predicted) : nlohmann::json()},
        {"note",
         "peak_bytes: the most tensor bytes this rank held at once (replay_input_bytes of them "
         "the values replayed receives copy); predicted_bytes: dtsim memory's figure for its "
         "stage without its framework allowance"}};
    // With experts, where a whole run's JSON has them too (and at the top level, below).
    if (expert_load) add_expert_load(memory, *expert_load, *expert_load_peak, "this rank's");
    std::cout << dtsim::json_text(
                     nlohmann::json{
                         {"model", spec.name},
                         {"backend", vm["backend"].as<std::string>()},
                         {"device", device.name()},
                         {"catalog_device", device_name},
                         {"memory", memory},
                         {"only_rank", r},
                         {"program_rank", rp.rank},
                         {"stage", rp.stage},
                         {"plan", dtsim::plan::to_json(plan)},
                         {"step_times_s", result.step_times_s},
                         {"step_time_s", result.step_time_s},
                         {"step_time_min_s", spread(result, options.warmup_steps).first},
                         {"step_time_max_s", spread(result, options.warmup_steps).second},
                         {"compute_s", compute},
                         {"communication_waits_s", waited},
                         {"communication", "replaced by waits " + waits},
                         {"expert_load", dtsim::report::value_or_null(expert_load)},
                         {"expert_load_peak", dtsim::report::value_or_null(expert_load_peak)},
                         {"notes", notes}},
                     2)
              << "\n";
    return 0;
  }
  std::cout << fmt::format(
      "{}, plan {}: rank {} alone on {} (stage {}; its program stands for {} rank{}), {} step{}\n"
      "compute measured; {}\n",
      spec.name, dtsim::plan::summary(plan), r, where, rp.stage, rp.represents.size(),
      rp.represents.size() == 1 ? "" : "s", options.steps, options.steps == 1 ? "" : "s",
      comm_tasks == 0
          ? std::string("no communication task to replace (the plan's rank has none)")
          : fmt::format("{} communication task{} replaced by waits {}; received tensors hold "
                        "made-up values (standard normal), so losses mean nothing",
                        comm_tasks, comm_tasks == 1 ? "" : "s", waits));
  for (const auto& note : notes) std::cout << dtsim::report::note_line(note) << "\n";
  std::cout << fmt::format(
      "median step time {:.1f} ms after {} warm-up step(s); last step: compute {:.1f} ms, "
      "waits {:.1f} ms (one after the other: the waits do not overlap compute here)\n",
      result.step_time_s * 1e3, options.warmup_steps, compute * 1e3, waited * 1e3);
  constexpr double mib = 1024.0 * 1024.0;
  std::cout << fmt::format(
      "memory: peak {:.1f} MiB of tensors{}{}\n", peak / mib,
      result.replay_input_bytes > 0
          ? fmt::format(" (of which {} the values replayed receives copy)",
                        // (A few KiB on a small model read 0.0 MiB.)
                        result.replay_input_bytes < 0.05 * mib
                            ? fmt::format("{:.1f} KiB", result.replay_input_bytes / 1024.0)
                            : fmt::format("{:.1f} MiB", result.replay_input_bytes / mib))
          : std::string(),
      predicted ? fmt::format("; dtsim memory predicts {:.1f} MiB for stage {} (without its "
                              "framework allowance)",
                              *predicted / mib, rp.stage)
                : fmt::format("; for dtsim memory's figure give --cluster C of {} devices",
                              plan.devices()));
  return 0;
}

// The flags of dtexec run: its own, then the plan's (dtsim's).
po::options_description run_options_description() {
  po::options_description desc("dtexec run options");
  desc.add_options()("help,h", "show this help")(
      "model", po::value<std::string>()->default_value("tiny-gpt"), "model name or path")(
      "backend", po::value<std::string>()->default_value("cpu"),
      "cpu (fp32, MPI ranks; --precision bf16 emulates the GPU's bf16 activations) or cuda (a GPU "
      "per MPI rank over NCCL, or one GPU: a one-device plan or "
      "--only-rank; bf16 by default, --precision fp32)")(
      "steps", po::value<int>()->default_value(10),
      "train until this many steps are done (counting a resumed checkpoint's)")(
      "warmup", po::value<int>()->default_value(1),
      "steps left out of the median step time (0 when --steps is 1 and this is not given)")(
      "lr", po::value<double>()->default_value(3e-3, "3e-3"),
      "AdamW learning rate (the peak, with a warm-up or decay)")(
      "lr-warmup-steps", po::value<int>()->default_value(0),
      "raise the rate linearly over this many steps (step s of them at lr x s / N), as "
      "Megatron-LM's --lr-warmup-iters")(
      "lr-decay-style", po::value<std::string>()->default_value("constant"),
      "after the warm-up: constant, or linear or cosine decay from --lr to --min-lr at "
      "--lr-decay-steps (Megatron-LM's --lr-decay-style)")(
      "lr-decay-steps", po::value<int>(),
      "with a decay: the step at which the rate reaches --min-lr (default: --steps)")(
      "min-lr", po::value<double>(), "with a decay: the rate it ends at (default 0)")(
      "weight-decay", po::value<double>()->default_value(0.0, "0"),
      "AdamW's decoupled weight decay on matrices and embedding tables, not biases or norms "
      "(Megatron-LM's --weight-decay, whose default is 0.01)")(
      "seed", po::value<std::string>()->default_value("1234"),
      "initialisation and data seed, a whole number from 0 to 2^64 - 1")(
      "cluster", po::value<std::string>(),
      "the cluster (name or path) whose device's peak the measured MFU is taken against "
      "(default: cpu-host for the CPU backend; for a GPU, the catalog device of its name)")(
      "checkpoint", po::value<std::string>(),
      "write a checkpoint folder here after the last step (and see --checkpoint-every): a shard "
      "per rank and an index, on a file system every rank sees")(
      "checkpoint-every", po::value<int>()->default_value(0),
      "also write the checkpoint every N steps (0: only at the end)")(
      "checkpoint-async", po::bool_switch(),
      "save asynchronously: training stops only while each rank copies its weights and AdamW "
      "state to host memory (a copy of 12 bytes per parameter it writes, kept for the run); a "
      "thread writes its shard while the next steps run, and the checkpoint is in place at the "
      "end of the first step by which every shard is written (a crash before that leaves the "
      "one before it)")(
      "resume", po::value<std::string>(),
      "continue from this checkpoint folder (written under this plan or another: its tensors "
      "are resharded)")("trace", po::value<std::string>(),
                        "write the last step's tasks as a Chrome trace")("json", po::bool_switch(),
                                                                         "print JSON")(
      "only-rank", po::value<std::int64_t>(),
      "run only this rank's share of the plan, on this machine, its communication replaced by "
      "waits (see --predicted); for checking the compute of plans larger than the machine")(
      "predicted", po::value<std::string>(),
      "with --only-rank: a dtsim simulate --trace of the same plan, whose communication task "
      "times become the waits")(
      "share-gpus", po::bool_switch(),
      "with --backend cuda under mpirun, for testing the multi-GPU code on fewer GPUs: a host's "
      "ranks share its GPUs (local rank i takes GPU i mod their number). NCCL sees each rank as "
      "a host of its own (NCCL_HOSTID) and moves data through sockets (NCCL_SOCKET_IFNAME=lo, "
      "NCCL_IB_DISABLE=1 unless set); the GPU time-slices the ranks' kernels: slow, not for "
      "timing")("task-timeout", po::value<double>()->default_value(600),
                "seconds a single task may take before the run is declared hung and every rank is "
                "ended (0: never); on GPUs over NCCL, the seconds a step's queued work may take")(
      "checkpoint-timeout", po::value<double>()->default_value(600),
      "with --checkpoint: seconds a checkpoint's save (every rank's shard written and the ranks' "
      "agreement on them; an asynchronous save's putting in place) may take before the run is "
      "declared hung and every rank is ended (0: never); set apart from --task-timeout, so that "
      "a short one finds a hung peer quickly and a large checkpoint on slow storage still "
      "saves")(
      "hang-at", po::value<std::string>(),
      "fault injection for tests, RANK:STEP: that rank stops answering when the step starts; "
      "RANK:STEP:checkpoint: when it writes the checkpoint after the step")(
      "fail-at", po::value<std::string>(),
      "fault injection for tests, RANK:STEP: that rank kills itself (SIGKILL) when the step "
      "starts; RANK:start: it fails with an error as it starts, as on a host without its GPU");
  desc.add_options()("no-dropout", po::bool_switch(),
                     "train the model without its dropout layers (dtsim --no-dropout predicts "
                     "the same model); with them (CPU), dropout at rate 0.1 on the embedding, "
                     "the attention probabilities and both residual branches, its masks the same "
                     "for every plan");
  dtsim::cli::add_plan_options(
      desc, "fp32 (the CPU's default) or bf16 (the GPU's default; on the CPU, its emulation)");
  return desc;
}

// The plan of the flags, in a precision this backend trains in, checked for `devices` (which
// `devices_are` describes: plan_from_options).
dtsim::plan::Plan backend_plan(const po::variables_map& vm, const dtsim::model::ModelSpec& spec,
                               std::int64_t devices, bool gpu, const std::string& devices_are) {
  std::vector<std::string> notes;  // what dtsim says it completed; the run reports its own
  if (dtsim::cli::layers_balanced(vm)) {
    throw dtsim::InputError(
        "--layers-per-stage balanced: the split depends on the cluster the plan is priced for; "
        "dtsim simulate --layers-per-stage balanced (or dtsim plan) prints it: give its "
        "numbers, or --plan P.json from dtsim plan --out");
  }
  // The CPU backend trains in fp32 where neither --precision nor a plan file says bf16: the plan
  // is completed and checked in it.
  std::optional<dtsim::cli::PrecisionDefault> fallback;
  if (!gpu) fallback = dtsim::cli::PrecisionDefault{dtsim::Precision::Fp32, "the CPU backend"};
  dtsim::plan::Plan plan =
      dtsim::cli::plan_from_options(vm, spec, devices, notes, fallback, devices_are);
  if (gpu) {
    if (plan.precision != dtsim::Precision::Bf16 && plan.precision != dtsim::Precision::Fp32) {
      throw dtsim::UnsupportedError(
          fmt::format("precision {}: the GPU backend trains in bf16 or fp32",
                      dtsim::to_string(plan.precision)));
    }
  } else if (plan.precision != dtsim::Precision::Fp32 && plan.precision != dtsim::Precision::Bf16) {
    // bf16, asked for on the command line or by a plan file (dtsim plan --out for a GPU
    // cluster): the GPU's mixed precision, emulated (bf16_device.hpp), so that the run is the
    // plan that dtsim predicted (its memory, its trace's precision).
    const bool asked = vm.count("precision") > 0;
    throw dtsim::UnsupportedError(fmt::format(
        "{}: the CPU backend trains in fp32, or bf16 emulated{}",
        asked ? fmt::format("--precision {}", vm["precision"].as<std::string>())
              : fmt::format("{}: precision {}",
                            vm.count("plan") ? vm["plan"].as<std::string>() : "the plan",
                            dtsim::to_string(plan.precision)),
        asked ? "" : " (give --precision fp32 or bf16)"));
  }
  if (plan.optimizer != dtsim::plan::Optimizer::Adam) {
    throw dtsim::UnsupportedError(fmt::format(
        "{}optimizer {}: dtexec trains with AdamW only (give \"optimizer\": \"adam\", or none)",
        vm.count("plan") ? vm["plan"].as<std::string>() + ": " : "",
        dtsim::plan::to_string(plan.optimizer)));
  }
  // (The cluster it names is not this run's, which measures on this host: checked all the
  // same, as dtsim checks it, rather than passed over.)
  if (vm.count("plan")) dtsim::cli::check_plan_file_cluster(vm["plan"].as<std::string>());
  dtsim::plan::require_valid(plan, spec, devices);
  return plan;
}

// The run's steps, warm-up, learning rate, checkpoints and fault injection, checked.
dtsim::exec::RunOptions run_options_of(const po::variables_map& vm, std::int64_t ranks) {
  const int steps = vm["steps"].as<int>();
  if (steps < 1) throw dtsim::InputError(fmt::format("--steps {}: expected 1 or more", steps));
  const int warmup = vm["warmup"].defaulted() ? std::min(1, steps - 1) : vm["warmup"].as<int>();
  if (warmup < 0 || warmup >= steps) {
    throw dtsim::InputError(
        fmt::format("--steps {} / --warmup {}: need 0 <= warmup < steps", steps, warmup));
  }
  const int every = vm["checkpoint-every"].as<int>();
  if (every < 0) {
    throw dtsim::InputError(fmt::format("--checkpoint-every: expected 0 or more, got {}", every));
  }
  if (every > 0 && !vm.count("checkpoint")) {
    throw dtsim::InputError("--checkpoint-every: give --checkpoint DIR as well");
  }
  if (vm["checkpoint-async"].as<bool>() && !vm.count("checkpoint")) {
    throw dtsim::InputError("--checkpoint-async: give --checkpoint DIR as well");
  }
  if (!vm["checkpoint-timeout"].defaulted() && !vm.count("checkpoint")) {
    throw dtsim::InputError("--checkpoint-timeout: give --checkpoint DIR as well");
  }
  dtsim::exec::RunOptions options;
  options.steps = steps;
  options.warmup_steps = warmup;
  options.lr = lr_schedule_of(vm, steps);
  options.weight_decay = rate_flag(vm, "weight-decay", true);
  // AdamW's decoupled decay multiplies the weights by 1 - lr x decay each step: from 1 on it
  // zeroes them or flips their sign (1e9 at the default lr ended at a loss of 1.3 million).
  if (const double shrink = static_cast<double>(options.lr.max_lr) * options.weight_decay;
      shrink >= 1) {
    throw dtsim::InputError(fmt::format(
        "--weight-decay {:g} with a peak --lr of {:g}: their product is {:g}, and AdamW multiplies "
        "the weights by 1 - that each step (expected below 1; Megatron-LM's default decay is "
        "0.01)",
        options.weight_decay, options.lr.max_lr, shrink));
  }
  // Read here, not by program_options, whose unsigned parse wraps "-1" to 2^64 - 1.
  const std::string seed = vm["seed"].as<std::string>();
  const auto [end, error] = std::from_chars(seed.data(), seed.data() + seed.size(), options.seed);
  if (seed.empty() || error != std::errc() || end != seed.data() + seed.size()) {
    throw dtsim::InputError(
        fmt::format("--seed {}: expected a whole number from 0 to 2^64 - 1", seed));
  }
  if (vm.count("checkpoint")) {
    options.checkpoint_dir =
        dtsim::exec::checkpoint_folder(vm["checkpoint"].as<std::string>(), "--checkpoint");
  }
  options.checkpoint_every = every;
  options.checkpoint_async = vm["checkpoint-async"].as<bool>();
  if (vm.count("resume")) options.resume_dir = vm["resume"].as<std::string>();
  // (--fail-at RANK:start: step 0, which run() reads as a failure at the start.)
  rank_and_step(vm, "fail-at", ranks, steps, options.fail_rank, options.fail_step, "start");
  rank_and_step(vm, "hang-at", ranks, steps, options.hang_rank, options.hang_step, "checkpoint",
                &options.hang_in_checkpoint);
  if (options.hang_in_checkpoint) {
    const int h = options.hang_step;
    if (options.checkpoint_dir.empty() ||
        !(h == steps || (options.checkpoint_every > 0 && h % options.checkpoint_every == 0))) {
      throw dtsim::InputError(fmt::format(
          "--hang-at {}: never happens in this run: no checkpoint is written after step {} "
          "(give --checkpoint DIR, with --checkpoint-every dividing {}, or step {})",
          vm["hang-at"].as<std::string>(), h, h, steps));
    }
  }
  // The hung rank waits outside any task; its peers' collectives and transfers find it.
  if (vm.count("hang-at") && ranks == 1) {
    throw dtsim::InputError(
        "--hang-at: a run of one rank has no peer to find it hung (--task-timeout, or "
        "--checkpoint-timeout in a checkpoint, times the peers' waits for it), so it would wait "
        "for ever; run it under mpirun -np 2 or more");
  }
  if (options.hang_rank >= 0) {
    const char* timeout = options.hang_in_checkpoint ? "checkpoint-timeout" : "task-timeout";
    if (vm[timeout].as<double>() == 0) {
      throw dtsim::InputError(fmt::format(
          "--hang-at {}: with --{} 0 nothing times its peers' waits for it, so the run would "
          "wait for ever; give --{} a number of seconds",
          vm["hang-at"].as<std::string>(), timeout, timeout));
    }
  }
  return options;
}

// This rank's device for the plan's precision: a GPU with --backend cuda (`mpi`'s node-local
// rank's), else the CPU, emulating bf16 where the plan has it. Says which in `where`, and in
// `product` the name the device catalog knows it by (a GPU's product name, or cpu-host).
std::unique_ptr<dtsim::exec::Device> make_device(const dtsim::plan::Plan& plan, bool gpu,
                                                 const dtsim::exec::cpu::MpiSession* mpi,
                                                 bool share_gpus, std::string& where,
                                                 std::string& product) {
  where = "the CPU";
  product = "cpu-host";
  std::unique_ptr<dtsim::exec::Device> device;
  if (gpu) {
    device = mpi ? make_gpu_device(plan.precision, mpi->local_rank(), mpi->local_size(),
                                   mpi->host(), share_gpus, where, product)
                 : make_gpu_device(plan.precision, 0, 1, "this host", false, where, product);
  } else if (plan.precision == dtsim::Precision::Bf16) {
    device = std::make_unique<dtsim::exec::cpu::Bf16Device>();
    where = "the CPU (bf16 activations emulated: fp32 kernels, bf16 storage)";
  } else {
    device = std::make_unique<dtsim::exec::cpu::CpuDevice>();
  }
  return device;
}

// The ranks' communicators: MPI's between CPU ranks, NCCL's between GPUs, none for one rank.
std::unique_ptr<dtsim::exec::Comm> make_comm(dtsim::exec::cpu::MpiSession* mpi, bool gpu,
                                             const dtsim::lower::Program& program,
                                             dtsim::exec::Device& device, double task_timeout_s) {
  std::unique_ptr<dtsim::exec::Comm> comm;
  // One process under mpirun (mpirun -np 1) runs as one without it.
  if (mpi && mpi->size() > 1 && !gpu) {
    try {
      comm = dtsim::exec::cpu::make_mpi_comm(*mpi, program);
    } catch (const std::exception& e) {
      end_all_ranks(e, mpi, "run");
      throw;
    }
    dtsim::exec::cpu::set_gemm_threads(1);
  } else if (mpi && mpi->size() > 1) {
#ifdef DTEXEC_HAVE_CUDA
    try {
      comm = dtsim::exec::cuda::make_nccl_comm(*mpi, program, device, task_timeout_s);
    } catch (const std::exception& e) {
      end_all_ranks(e, mpi, "run");
      throw;
    }
#endif
  } else {
    comm = std::make_unique<dtsim::exec::SingleRankComm>(&device);
  }
  return comm;
}

// Rank 0's header (the text output).
void announce_run(int rank, const dtsim::model::ModelSpec& spec, const std::string& where,
                  std::int64_t devices, const dtsim::plan::Plan& plan,
                  const std::vector<std::string>& run_notes,
                  const dtsim::exec::RunOptions& options) {
  const int steps = options.steps;
  out(rank) << fmt::format(
      "{} on {}, {} rank{}, plan {}: {} x {} tokens per step ({} micro-batch{} per "
      "replica), until step {}{}\n",
      spec.name, where, devices, devices == 1 ? "" : "s", dtsim::plan::summary(plan),
      plan.global_batch_size, plan.seq_len, plan.micro_batches(),
      plan.micro_batches() == 1 ? "" : "es", steps,
      options.resume_dir.empty() ? "" : ", resuming " + options.resume_dir);
  for (const auto& note : run_notes) out(rank) << dtsim::report::note_line(note) << "\n";
  if (options.lr.warmup_steps > 0 || options.lr.decay != dtsim::exec::LrDecay::Constant) {
    out(rank) << "learning rate: " << options.lr.describe() << "\n";
  }
}

// Has rank 0 print each step and checkpoint as it ends (the text output).
void report_progress(int rank, dtsim::exec::RunOptions& options) {
  options.on_step = [rank, lr = options.lr](int step, double loss, double seconds,
                                            double grad_norm) {
    out(rank) << fmt::format(
                     "step {:>4}  loss {:.4f}  {:.1f} ms  lr {:.3g}{}\n", step, loss, seconds * 1e3,
                     lr.at(step),
                     grad_norm >= 0 ? fmt::format("  grad norm {:.4g}", grad_norm) : std::string())
              << std::flush;
  };
  options.on_checkpoint = [rank,
                           dir = options.checkpoint_dir](const dtsim::exec::CheckpointRecord& c) {
    out(rank) << (c.asynchronous
                      ? fmt::format("checkpoint of step {} in place in {} after step {}: "
                                    "{:.1f} MiB, training stopped {:.3f} s, written behind "
                                    "it in {:.3f} s\n",
                                    c.step, dir, c.in_place_after, c.bytes / (1024.0 * 1024.0),
                                    c.blocking_s, c.write_s)
                      : fmt::format("checkpoint of step {} in place in {}: {:.1f} MiB in "
                                    "{:.3f} s\n",
                                    c.step, dir, c.bytes / (1024.0 * 1024.0), c.seconds))
              << std::flush;
  };
}

// The device whose peak the measured MFU is taken against, and its peak in the plan's precision.
struct Peak {
  std::optional<double> flops_per_s;
  std::optional<std::string> device;
  bool shipped_cpu = false;  // the catalog's cpu-host (no --cluster on the CPU): another host's
};

// The peak of `against` (--cluster's device, checked before the run; else this device's catalog
// entry, if it has one) at the plan's precision: unknown where there is none.
Peak peak_of(const std::optional<dtsim::cluster::DeviceSpec>& against, bool shipped_cpu,
             const dtsim::plan::Plan& plan) {
  Peak peak;
  if (!against || !against->supports(plan.precision)) return peak;
  peak.flops_per_s = against->peak_flops_for(plan.precision);
  peak.device = against->name;
  peak.shipped_cpu = shipped_cpu;
  return peak;
}

// The memory the busiest rank held, gathered over the ranks: its peak of tensors, its pool's
// bytes, and (expert parallelism) its experts' load over the even share, mean and peak.
struct HeldMemory {
  double peak_bytes = 0;
  double reserved_bytes = 0;
  double expert_load = 0;
  double expert_load_peak = 0;
};

// The JSON "memory" object, against dtsim memory's prediction where it applies.
nlohmann::json memory_json(const HeldMemory& held, std::optional<double> predicted,
                           const dtsim::plan::Plan& plan) {
  nlohmann::json memory = {
      {"peak_bytes", dtsim::report::byte_count(held.peak_bytes)},
      {"reserved_bytes", dtsim::report::byte_count(held.reserved_bytes)},
      {"predicted_bytes", predicted ? dtsim::report::byte_count(*predicted) : nlohmann::json()},
      {"note",
       "peak_bytes: the most tensor bytes the device held at once on the busiest rank; "
       "reserved_bytes: what its pool of buffers held; predicted_bytes: dtsim memory's busiest "
       "stage without its framework allowance (null where the memory model does not apply)"}};
  if (plan.ep > 1) {
    add_expert_load(memory, held.expert_load, held.expert_load_peak, "the busiest rank's");
  }
  return memory;
}

// The JSON "checkpoints": each checkpoint the run wrote, with what it cost.
nlohmann::json checkpoints_json(const dtsim::exec::RunResult& result) {
  nlohmann::json checkpoints = nlohmann::json::array();
  for (const auto& c : result.checkpoints) {
    checkpoints.push_back({{"step", c.step},
                           {"seconds", c.seconds},
                           {"bytes", c.bytes},
                           {"shards", c.shards},
                           {"copy_to_host_seconds", c.copy_s},
                           {"copy_to_host_bytes_per_s_per_rank", c.copy_bytes_per_s},
                           {"asynchronous", c.asynchronous},
                           {"blocking_seconds", c.blocking_s},
                           {"write_seconds", c.write_s},
                           {"in_place_after_step", c.in_place_after}});
  }
  return checkpoints;
}

// What simulate predicts, measured: FLOP rates, and where the step went on the stage that
// computes the most (rank 0 has the ranks' times; the other ranks return an empty breakdown).
nlohmann::json measured_json(int rank, const dtsim::exec::RunResult& result, const Timings& timings,
                             const dtsim::model::ModelGraph& graph,
                             const dtsim::lower::Program& program, const dtsim::plan::Plan& plan,
                             std::int64_t devices, bool host_memory, const Peak& peak,
                             double peak_bytes) {
  const auto flops = dtsim::engine::step_flops(graph, plan);
  const double gpus = static_cast<double>(devices);
  // Rank 0 prints the JSON, and has the ranks' times. As simulate, the breakdown reported is the
  // stage that computes the most (ties: the first).
  const auto stages = rank == 0 ? measured_stages(timings, result, program)
                                : std::vector<dtsim::engine::StagePrediction>{};
  const std::size_t busiest = dtsim::engine::busiest_stage(stages);
  const dtsim::engine::Breakdown spent =
      stages.empty() ? dtsim::engine::Breakdown{} : stages[busiest].breakdown;
  const int spent_stage = stages.empty() ? 0 : stages[busiest].stage;
  const std::int64_t spent_rank = stages.empty() ? 0 : stages[busiest].rank;
  const double step = result.step_time_s;
  std::optional<double> mfu, hfu;
  if (peak.flops_per_s) {
    mfu = flops.model / (step * gpus * *peak.flops_per_s);
    hfu = flops.hardware / (step * gpus * *peak.flops_per_s);
  }
  nlohmann::json breakdown = dtsim::report::breakdown_json(spent, /*predicted=*/false);
  // Before the simulator's terms were measured, the rest of the (median) step was one figure.
  breakdown["other_s"] =
      std::max(0.0, step - spent.compute_s - spent.recompute_s - spent.optimizer_s);
  // Measured only: the part of the bubble that is the runner's own work between tasks; null
  // where a device queues work and has peers to wait for (runner_work_s).
  std::optional<double> runner_s;
  if (host_memory || program.ranks.size() == 1) {
    runner_s = 0.0;
    for (std::size_t r = 0; r < program.ranks.size() && !stages.empty(); ++r) {
      if (program.ranks[r].rank == spent_rank) runner_s = runner_work_s(timings, result, r);
    }
  }
  breakdown["runner_s"] = dtsim::report::value_or_null(runner_s);
  // Amdahl's bound from the measured split (simulate's rule), the waits for peers counted as
  // idle.
  const double mean_step = spent.total_s();
  nlohmann::json per_stage = nlohmann::json::array();
  for (const auto& s : stages) per_stage.push_back(dtsim::report::stage_json(s, false));
  nlohmann::json amdahl;  // null where not measured
  if (mean_step > 0) {
    const double serial = dtsim::engine::serial_fraction(spent, plan, mean_step);
    amdahl = {{"serial_fraction", serial}, {"max_speedup", serial > 0 ? 1.0 / serial : 0.0}};
  }
  breakdown["note"] =
      result.tasks.empty()
          ? std::string(
                "no step of this run came after its warm-up (a resumed run with no more "
                "steps left than --warmup): nothing was timed, so every term is 0")
          : fmt::format(
                "rank {}'s tasks ({}), the mean over the last (up to 8) steps after warm-up, "
                "each from the rank's start of the step to the end of the slowest rank's, split "
                "as dtsim simulate splits a step{}; bubble_s also holds the runner's own work "
                "between tasks, at least runner_s of it (what none of the rank's tasks covers, "
                "as it timed them; null on GPUs with peers, where the compute stream's gaps "
                "hold its waits); other_s: the median step less compute, recompute and "
                "optimizer; straggler_wait_s is null: a wait for a late rank is not told "
                "apart from other waits for peers",
                spent_rank,
                stages.size() > 1 ? fmt::format("stage {}, the stage that computes the most, as "
                                                "simulate reports; per_stage has each stage's "
                                                "first rank",
                                                spent_stage)
                                  : fmt::format("stage {}", spent_stage),
                program.ranks.size() == 1 ? ""
                : timings.shared_clock
                    ? ": a receive, collective or blocking send counted from when all its ranks "
                      "had reached it (the ranks share this machine's clock), the wait before "
                      "that as bubble"
                    : fmt::format(
                          ": a receive, collective or blocking send counted from when all its "
                          "ranks had reached it, the wait before that as bubble; the ranks' "
                          "clocks (several machines) were put on rank 0's by round trips, each "
                          "within {:.1f} us",
                          timings.clock_error_s * 1e6)) +
                (program.ranks.size() == 1 || timings.comm_progresses
                     ? ""
                     : "; a started collective's time leaves out the compute tasks its rank ran "
                       "while it was pending (MPI moves its data only inside its calls, between "
                       "tasks)");
  nlohmann::json measured = {{"gpus", devices},
                             {"model_flops", flops.model},
                             {"hardware_flops", flops.hardware},
                             {"model_flops_per_step", flops.model},
                             {"hardware_flops_per_step", flops.hardware},
                             {"memory_per_gpu_bytes", dtsim::report::byte_count(peak_bytes)},
                             {"breakdown_stage", spent_stage},
                             {"per_stage", per_stage},
                             {"amdahl", amdahl},
                             {"clock",
                              {{"shared", timings.shared_clock},
                               {"error_s", timings.clock_error_s},
                               {"note",
                                "shared: the ranks read one machine's clock; else each rank's "
                                "was put on rank 0's by round trips (Cristian's method), each "
                                "within error_s"}}},
                             {"tflops_per_gpu", flops.hardware / (step * gpus) / 1e12},
                             {"model_tflops_per_gpu", flops.model / (step * gpus) / 1e12},
                             {"mfu", dtsim::report::value_or_null(mfu)},
                             {"hfu", dtsim::report::value_or_null(hfu)},
                             {"peak_device", dtsim::report::value_or_null(peak.device)},
                             {"breakdown", breakdown}};
  return measured;
}

// The text output's closing lines: the step time, memory, and the last checkpoint's cost.
void print_summary(int rank, const dtsim::exec::RunResult& result,
                   const dtsim::exec::RunOptions& options, const dtsim::plan::Plan& plan,
                   const HeldMemory& held, std::optional<double> predicted_memory) {
  const int warmup = options.warmup_steps;
  const double tokens = static_cast<double>(plan.global_batch_size * plan.seq_len);
  // What dtsim's --expert-load assumes, against what the busiest rank's experts got.
  const std::string load_note =
      plan.ep > 1
          ? fmt::format(
                "; the busiest rank's experts got {:.3f}x the even share of token copies (up to "
                "{:.3f}x in a micro-batch), where dtsim assumes {:g}x (--expert-load)",
                held.expert_load, held.expert_load_peak, plan.expert_load)
          : std::string();
  const auto [fastest, slowest] = spread(result, warmup);
  out(rank) << fmt::format(
      "median step time {:.1f} ms after {} warm-up step(s) (from {:.1f} to {:.1f} ms), {:.0f} "
      "tokens/s\n",
      result.step_time_s * 1e3, warmup, fastest * 1e3, slowest * 1e3, tokens / result.step_time_s);
  constexpr double mib = 1024.0 * 1024.0;
  out(rank) << fmt::format(
      "memory: peak {:.1f} MiB of tensors on the busiest rank ({:.1f} MiB held "
      "by its pool){}\n",
      held.peak_bytes / mib, held.reserved_bytes / mib,
      predicted_memory ? fmt::format("; dtsim memory predicts {:.1f} MiB "
                                     "(without its framework allowance){}",
                                     *predicted_memory / mib, load_note)
                       : std::string());
  if (!options.checkpoint_dir.empty() && !result.checkpoints.empty()) {
    // What a checkpoint cost here: dtsim's time to train with interruptions takes a write
    // bandwidth (--checkpoint-write-gbs-per-gpu).
    const auto& last = result.checkpoints.back();
    if (last.asynchronous) {
      out(rank) << fmt::format(
          "checkpoint written to {} asynchronously ({} time{}; the last: {:.1f} MiB of weights "
          "and AdamW state, training stopped {:.3f} s for it, of that the copy to host memory "
          "{:.3f} s, {:.2f} GB/s per rank: dtsim --checkpoint-async-gbs-per-gpu; its {} "
          "shard{} written behind training in {:.3f} s, {:.0f} MB/s; in place after step {}; "
          "the host copy {:.1f} MiB on the busiest rank, allocated before the first step in "
          "{:.3f} s)\n",
          options.checkpoint_dir, result.checkpoints.size(),
          result.checkpoints.size() == 1 ? "" : "s", last.bytes / (1024.0 * 1024.0),
          last.blocking_s, last.copy_s, last.copy_bytes_per_s / 1e9, last.shards,
          last.shards == 1 ? "" : "s", last.write_s,
          last.write_s > 0 ? last.bytes / last.write_s / 1e6 : 0.0, last.in_place_after,
          result.checkpoint_host_bytes / (1024.0 * 1024.0), result.checkpoint_host_seconds);
      return;
    }
    out(rank) << fmt::format(
        "checkpoint written to {} ({} time{}; the last: {:.1f} MiB of weights and AdamW state "
        "in {:.3f} s, {:.0f} MB/s, {} shard{} written by {}; of that the copy to host memory "
        "{:.3f} s, {:.2f} GB/s per rank, what an asynchronous save stops for: dtsim "
        "--checkpoint-async-gbs-per-gpu)\n",
        options.checkpoint_dir, result.checkpoints.size(),
        result.checkpoints.size() == 1 ? "" : "s", last.bytes / (1024.0 * 1024.0), last.seconds,
        last.seconds > 0 ? last.bytes / last.seconds / 1e6 : 0.0, last.shards,
        last.shards == 1 ? "" : "s", last.shards == 1 ? "one rank" : "as many ranks at once",
        last.copy_s, last.copy_bytes_per_s / 1e9);
  }
}

}  // namespace

int run(const std::vector<std::string>& args) {
  const po::options_description desc = run_options_description();
  po::variables_map vm;
  if (!parse(args, desc,
             "usage: dtexec run --model M [plan flags or --plan P.json] [options]\n"
             "       mpirun -np N dtexec run ...   (N = dp x tp x pp x cp ranks)\n\n"
             "Trains M on the CPU (fp32, OpenBLAS), one MPI process per rank, following the\n"
             "Program dtsim lowers the plan to: the same tasks the simulator predicts.\n"
             "--precision bf16 on the CPU stores activations in bf16 and checks every tensor's\n"
             "type as the GPU does (fp32 kernels; MPI moves and sums bf16): the GPU's\n"
             "mixed-precision path, checked where there is no GPU.\n"
             "--backend cuda trains on GPUs (cuBLAS and dtexec's kernels, bf16 activations\n"
             "with fp32 master weights): one per MPI rank (the node-local rank's), NCCL\n"
             "communicators per group (not yet run on more than one GPU); or one GPU alone: a\n"
             "one-device plan, or one rank of a larger plan with --only-rank. GPU tasks are\n"
             "timed with CUDA events.",
             vm)) {
    return 0;
  }
  const std::string backend = vm["backend"].as<std::string>();
  if (backend != "cpu" && backend != "cuda") {
    throw dtsim::InputError(fmt::format("--backend: expected cpu or cuda, got \"{}\"", backend));
  }
  const bool gpu = backend == "cuda";
  const bool only_rank = vm.count("only-rank") > 0;
  if (vm.count("predicted") && !only_rank) {
    throw dtsim::InputError("--predicted: only with --only-rank");
  }
  for (const char* fault : {"fail-at", "hang-at"}) {
    if (vm.count(fault) && only_rank) {
      throw dtsim::InputError(fmt::format(
          "--{}: not with --only-rank (fault injection is for runs of every rank)", fault));
    }
  }
  if (vm.count("resume") && only_rank) {
    throw dtsim::InputError(
        "--resume: not with --only-rank (it times one rank's share of a plan from freshly "
        "initialized weights, and would not read the checkpoint)");
  }
  if (vm.count("checkpoint") && only_rank) {
    throw dtsim::InputError(
        "--checkpoint: not with --only-rank (one rank's share of a plan is not a checkpoint of "
        "it)");
  }
  const bool share_gpus = vm["share-gpus"].as<bool>();
  if (share_gpus && !gpu) throw dtsim::InputError("--share-gpus: only with --backend cuda");
  if (gpu && dtsim::exec::cpu::under_mpirun()) {
    // NCCL's kernels wait for their peers: with the CUDA default of 8 hardware queues, a
    // kernel queued behind a waiting receive could hold back a send on another stream. More
    // queues, unless the user chose a number; before MPI_Init, since a CUDA-aware MPI (UCX's
    // cuda_ipc, HPC-X) creates the process's CUDA context there.
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  }
  std::unique_ptr<dtsim::exec::cpu::MpiSession> mpi;
  if (dtsim::exec::cpu::under_mpirun()) mpi = std::make_unique<dtsim::exec::cpu::MpiSession>();
  const int rank = mpi ? mpi->rank() : 0;
  g_rank = rank;
  if (mpi) check_same_arguments(*mpi, vm, "run");
  const double clock_skew = clock_skew_s(rank);
  if (only_rank && mpi && mpi->size() > 1) {
    throw dtsim::InputError("--only-rank: runs one process; start it without mpirun");
  }
  // (A model file that one node does not see fails there alone: see alike_on_every_rank.)
  const auto spec = [&] {
    std::optional<dtsim::model::ModelSpec> read;
    alike_on_every_rank(mpi.get(), "run", [&] { read = dtsim::cli::model_from_options(vm); });
    return std::move(*read);
  }();
  const std::int64_t devices = mpi && !only_rank ? mpi->size() : requested_devices(vm);
  // The plan's check of its degrees against the devices speaks of a cluster's: here they are
  // mpirun's ranks.
  const std::string devices_are =
      mpi && !only_rank ? fmt::format(
                              "the devices are the {} rank{} that mpirun started, one "
                              "per device: start dp x tp x pp x cp ranks, mpirun -np N "
                              "dtexec run ...",
                              devices, devices == 1 ? "" : "s")
                        : std::string();
  // Checked first: a plan that no count of ranks can run says why before asking for ranks.
  const dtsim::plan::Plan plan = backend_plan(vm, spec, devices, gpu, devices_are);
  if (!mpi && devices > 1 && !only_rank) {
    throw dtsim::InputError(fmt::format(
        "the plan needs {} ranks: start them with mpirun -np {} dtexec run ...", devices, devices));
  }
  dtsim::exec::RunOptions options = run_options_of(vm, devices);
  // Rank 0 writes the trace after the run, and makes the checkpoint's folder after steps: a
  // path it cannot take (or one holding what a checkpoint would replace) ends the job now, on
  // every rank (the others may already wait for rank 0 in a collective).
  if (rank == 0) {
    try {
      if (vm.count("trace")) {
        const std::string trace = vm["trace"].as<std::string>();
        // Written after the run, it would overwrite a checkpoint's files, or be lost with the
        // folder that the next checkpoint replaces (and keep it from being replaced).
        for (const auto& [flag, dir] : {std::pair{"--checkpoint", options.checkpoint_dir},
                                        std::pair{"--resume", options.resume_dir}}) {
          if (!dir.empty() && dtsim::exec::in_checkpoint_folders(dir, trace)) {
            throw dtsim::InputError(fmt::format(
                "--trace {}: inside {} {}, {}: write the trace elsewhere", trace, flag, dir,
                std::string_view(flag) == "--resume"
                    ? "the checkpoint this run continues from (its files are the checkpoint's)"
                    : "where checkpoints go (a checkpoint's files are its own, and each "
                      "replaces the folder whole)"));
          }
        }
        dtsim::cli::check_writable(trace, "--trace", &vm);
      }
      if (!options.checkpoint_dir.empty()) {
        dtsim::exec::check_checkpoint_folder(options.checkpoint_dir, "--checkpoint");
      }
    } catch (const std::exception& e) {
      end_all_ranks(e, mpi.get(), "run");
      throw;
    }
  }
  // The kernels count a micro-batch's tokens in an int.
  if (plan.micro_batch_size * plan.seq_len > std::numeric_limits<int>::max()) {
    throw dtsim::InputError(fmt::format(
        "--micro-batch-size {} x --seq-len {}: expected at most {} tokens per micro-batch",
        plan.micro_batch_size, plan.seq_len, std::numeric_limits<int>::max()));
  }
  // A --cluster that does not load, or whose device has no peak at the plan's precision (the
  // MFU's), is refused before anything runs or prints (later reads of it leave out what they
  // cannot price).
  // (A file that one node does not see fails there alone: see alike_on_every_rank.)
  std::optional<dtsim::cluster::DeviceSpec> cluster_device;
  if (vm.count("cluster")) {
    alike_on_every_rank(mpi.get(), "run", [&] {
      cluster_device = dtsim::cluster::load_cluster(vm["cluster"].as<std::string>()).device;
      cluster_device->peak_flops_for(plan.precision);
    });
  }
  const dtsim::model::ModelGraph graph = dtsim::plan::graph_of(spec, plan);
  dtsim::lower::LowerOptions lower_options;
  lower_options.mode = devices > 1 && !only_rank ? dtsim::lower::Lowering::AllRanks
                                                 : dtsim::lower::Lowering::Representatives;
  const auto program = dtsim::lower::lower(graph, plan, lower_options);
  dtsim::exec::check_runnable(graph, program, only_rank);
  // A device is a host's own (no GPU there, its memory): a rank whose host fails here ends the
  // job, where its peers would wait for it in their first collective for ever.
  std::string where, product;
  std::unique_ptr<dtsim::exec::Device> device;
  alike_on_every_rank(mpi.get(), "run", [&] {
    if (options.fail_step == 0 && options.fail_rank == rank) {
      throw dtsim::InputError(
          fmt::format("--fail-at {}: rank {} fails as it starts, as on a host without its GPU",
                      vm["fail-at"].as<std::string>(), rank));
    }
    device = make_device(plan, gpu, mpi.get(), share_gpus, where, product);
    dtsim::exec::check_device(graph, program, *device);
  });
  if (device->host_memory() && !only_rank) {
    // Every rank takes part in the check's collective, with a prediction or without one.
    const auto report = predicted_memory_report(vm, graph, plan);
    require_host_memory(report ? report->worst().total_bytes : 0.0, mpi ? mpi->local_size() : 1,
                        mpi.get());
  }
  const auto seconds = [&](const char* flag) {
    // 0 (never), or from a millisecond (the watchdog's own wake-ups are that fine) to a
    // million seconds (a finite wait: 1e-300 and inf were taken).
    const double s = vm[flag].as<double>();
    if (!(s == 0 || (s >= 1e-3 && s <= 1e6))) {
      throw dtsim::InputError(fmt::format(
          "--{}: expected 0 (never) or a number of seconds from 0.001 to 1e6, got {}", flag, s));
    }
    return s;
  };
  options.task_timeout_s = seconds("task-timeout");
  const double checkpoint_timeout = seconds("checkpoint-timeout");
  // (Without checkpoints nothing is watched by it: --task-timeout 0 is no watchdog at all.)
  if (!options.checkpoint_dir.empty()) options.checkpoint_timeout_s = checkpoint_timeout;
  // What this device is in the device catalog (a trace says what it ran on, whatever --cluster
  // says for the MFU's peak): its entry's name, else its product name.
  std::optional<dtsim::cluster::DeviceSpec> catalog_device;
  try {
    catalog_device = dtsim::cluster::load_device(product);
  } catch (const dtsim::InputError&) {
  }
  const std::string device_name = catalog_device ? catalog_device->name : product;
  if (only_rank) {
    return run_only_rank(vm, spec, plan, graph, program, options, *device, where, device_name);
  }
  // From the watchdog thread: no MPI call there; the process exits and mpirun ends the others.
  const std::string host = mpi ? mpi->host() : std::string();
  options.on_hang = [host](const std::string& what) {
    std::cerr << "dtexec run: hung: " << what << (host.empty() ? "" : " (on " + host + ")")
              << "; ending the job\n";
    std::cerr.flush();
    std::_Exit(3);
  };
  const std::unique_ptr<dtsim::exec::Comm> comm =
      make_comm(mpi.get(), gpu, program, *device, options.task_timeout_s);
  const bool json_out = vm["json"].as<bool>();
  // What this run does that its figures depend on (dropout, routing, context parallelism).
  std::vector<std::string> run_notes = dtsim::exec::execution_notes(spec, plan);
  if (!options.resume_dir.empty()) {
    // A checkpoint of another plan resumes too: each rank reads its slices of the full tensors.
    // Where every rank refuses it (the same checkpoint.json), rank 0 says why; a rank that alone
    // cannot read it (a folder its node does not see) ends every rank.
    alike_on_every_rank(mpi.get(), "run", [&] {
      for (std::string& note :
           resume_notes(options.resume_dir, spec, options, plan, !vm["warmup"].defaulted())) {
        run_notes.push_back(std::move(note));
      }
    });
  }
  if (!json_out) {
    announce_run(rank, spec, where, devices, plan, run_notes, options);
    report_progress(rank, options);
  }
  const Peak peak =
      cluster_device ? peak_of(cluster_device, false, plan) : peak_of(catalog_device, !gpu, plan);
  dtsim::exec::RunResult result;
  Timings timings;
  try {
    result = dtsim::exec::run_program(graph, program, options, *comm, *device);
    timings = gather_timings(result, *comm, clock_skew);
    if (vm.count("trace") && rank == 0) {
      write_trace(vm["trace"].as<std::string>(),
                  {spec.name, dtsim::report::kProducedByRun, device_name, std::nullopt, ""},
                  program, timings, options.steps - 1, result.first_step);
    }
  } catch (const std::exception& e) {
    end_all_ranks(e, mpi.get(), "run", comm.get());
    throw;
  }
  // Memory: the peak of tensor bytes on the busiest rank, and the memory model's busiest stage
  // without its framework allowance (the pool holds tensors only). Every rank takes part.
  const auto use = device->memory_use();
  std::array<double, 4> gathered = {static_cast<double>(use.peak),
                                    static_cast<double>(use.reserved), result.expert_load,
                                    result.expert_load_peak};
  comm->all_ranks(gathered, dtsim::exec::Reduce::Max);
  const HeldMemory held{gathered[0], gathered[1], gathered[2], gathered[3]};
  std::optional<double> predicted_memory;
  if (const auto report = predicted_memory_report(vm, graph, plan)) {
    predicted_memory = report->worst().total_bytes;
  }
  if (!json_out) {
    print_summary(rank, result, options, plan, held, predicted_memory);
    return 0;
  }
  const double tokens = static_cast<double>(plan.global_batch_size * plan.seq_len);
  const int first = result.first_step;
  const int warmup = options.warmup_steps;
  // The rate each step of `losses` trained at (the checkpointed steps' too: one schedule).
  std::vector<double> learning_rates;
  for (std::size_t s = 1; s <= result.losses.size(); ++s) {
    learning_rates.push_back(dtsim::exec::decimal(options.lr.at(static_cast<int>(s))));
  }
  nlohmann::json j{{"model", spec.name},
                   {"backend", backend},
                   {"device", device->name()},
                   {"catalog_device", device_name},
                   {"ranks", devices},
                   {"plan", dtsim::plan::to_json(plan)},
                   {"first_step", first},
                   {"losses", result.losses},
                   {"lr_schedule", options.lr.to_json()},
                   {"weight_decay", dtsim::exec::decimal(options.weight_decay)},
                   {"learning_rates", learning_rates},
                   {"grad_norms", result.grad_norms},
                   {"checkpoints", checkpoints_json(result)},
                   {"checkpoint_host_copy",
                    options.checkpoint_async
                        ? nlohmann::json{{"bytes", result.checkpoint_host_bytes},
                                         {"allocate_seconds", result.checkpoint_host_seconds}}
                        : nlohmann::json()},
                   {"step_times_s", result.step_times_s},
                   {"step_time_s", result.step_time_s},
                   {"step_time_min_s", spread(result, warmup).first},
                   {"step_time_max_s", spread(result, warmup).second},
                   {"tokens_per_s", tokens / result.step_time_s},
                   {"warmup_steps", warmup},
                   {"notes", run_notes}};
  j.update(measured_json(rank, result, timings, graph, program, plan, devices,
                         device->host_memory(), peak, held.peak_bytes));
  // More than the device's peak: the peak is wrong (a device file's), not the run.
  if (j["mfu"].is_number() && j["mfu"].get<double>() > 1) {
    j["notes"].push_back(fmt::format(
        "mfu {:.3g} is above 1: the run did more FLOP/s than {}'s peak of {:.3g} FLOP/s in {} "
        "(check its device file's peak_flops)",
        j["mfu"].get<double>(), *peak.device, *peak.flops_per_s, dtsim::to_string(plan.precision)));
  }
  if (peak.shipped_cpu && peak.flops_per_s) {
    j["notes"].push_back(fmt::format(
        "mfu and hfu: against the catalog's cpu-host peak of {:.3g} FLOP/s in {}, calibrated on "
        "another host; for this host's, give --cluster DIR/cpu-host.json as dtexec calibrate "
        "--cluster-out DIR writes it",
        *peak.flops_per_s, dtsim::to_string(plan.precision)));
  }
  j["memory"] = memory_json(held, predicted_memory, plan);
  out(rank) << json_text(j, 2) << "\n";
  return 0;
}

}  // namespace dtsim::exec::cli
