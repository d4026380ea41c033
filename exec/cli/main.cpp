// dtexec: runs dtsim plans for real. `run` executes a lowered Program on the CPU (single rank in
// this version) and reports losses and step times; `devices` reports what the GPU backend sees.
#include <fmt/format.h>

#include <boost/program_options.hpp>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "exec/core/runner.hpp"
#include "exec/cpu/calibrate.hpp"
#include "sim/common/error.hpp"
#include "sim/lower/lowering.hpp"
#include "sim/plan/memory_model.hpp"
#include "sim/report/trace.hpp"

#ifdef DTEXEC_HAVE_CUDA
#include "exec/cuda/gpu_probe.hpp"
#endif

namespace {

void usage(std::ostream& os) {
  os << "dtexec: run dtsim plans for real (CPU ranks over MPI, GPUs over CUDA + NCCL)\n\n"
        "usage: dtexec <command> [options]\n\n"
        "commands:\n"
        "  run --model M [--steps N] [--micro-batch-size B] [--global-batch-size G]\n"
        "      [--seq-len S] [--lr X] [--seed N] [--trace T.json] [--json]\n"
        "                         train M for N steps on the CPU (one rank), following the\n"
        "                         Program dtsim lowers the plan to; losses and step times\n"
        "  calibrate --out P.json [--backend cpu] [--quick]\n"
        "                         measure GEMM times by shape, memory bandwidth and kernel\n"
        "                         overhead; a profile for dtsim --profile\n"
        "  devices [--selftest]   GPUs visible to the CUDA backend, library versions; with\n"
        "                         --selftest, run a check kernel on each GPU\n";
}

int devices(bool selftest) {
#ifdef DTEXEC_HAVE_CUDA
  const auto p = dtsim::exec::cuda::probe();
  // CUDA encodes versions as major·1000 + minor·10; 0 means the call failed.
  auto cuda_version = [](int v, const char* unknown) {
    return v == 0 ? std::string(unknown) : fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
  };
  std::cout << fmt::format("CUDA runtime {}, driver {}, cuBLAS {}, NCCL {}\n",
                           cuda_version(p.cuda_runtime_version, "?"),
                           cuda_version(p.cuda_driver_version, "none"), p.cublas_version,
                           p.nccl_version.empty() ? "?" : p.nccl_version);
  if (p.gpus.empty()) {
    std::cout << "no GPU: " << p.why_none << "\n";
    return 0;
  }
  int failures = 0;
  for (const auto& g : p.gpus) {
    std::cout << fmt::format("GPU {}: {} ({:.1f} GiB, {} SMs, compute capability {}.{})", g.index,
                             g.name, static_cast<double>(g.memory_bytes) / (1 << 30), g.sm_count,
                             g.compute_capability_major, g.compute_capability_minor);
    if (selftest) {
      const std::string err = dtsim::exec::cuda::selftest(g.index);
      std::cout << (err.empty() ? "  selftest: ok" : "  selftest FAILED: " + err);
      failures += err.empty() ? 0 : 1;
    }
    std::cout << "\n";
  }
  return failures == 0 ? 0 : 1;
#else
  (void)selftest;
  std::cout << "this dtexec was built without the CUDA backend (CUDA toolkit or NCCL not found "
               "at configure time; set CUDA_HOME)\n";
  return 0;
#endif
}

namespace po = boost::program_options;

// Parses a sub-command's options; on --help prints the usage and returns false. Malformed
// options are bad input (exit code 2).
bool parse(const std::vector<std::string>& args, const po::options_description& desc,
           const char* usage, po::variables_map& vm) {
  try {
    po::store(po::command_line_parser(args).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw dtsim::InputError(fmt::format("{} (see --help)", e.what()));
  }
  if (vm.count("help")) {
    std::cout << usage << "\n\n" << desc;
    return false;
  }
  return true;
}

int run(const std::vector<std::string>& args) {
  po::options_description desc("dtexec run options");
  desc.add_options()("help,h", "show this help")(
      "model", po::value<std::string>()->default_value("tiny-gpt"), "model name or path")(
      "backend", po::value<std::string>()->default_value("cpu"), "cpu (cuda: not yet)")(
      "steps", po::value<int>()->default_value(10), "training steps")(
      "warmup", po::value<int>()->default_value(1), "steps left out of the median step time")(
      "micro-batch-size", po::value<std::int64_t>()->default_value(4), "sequences per micro-batch")(
      "global-batch-size", po::value<std::int64_t>(),
      "sequences per step (default: one micro-batch)")("seq-len", po::value<std::int64_t>(),
                                                       "sequence length (default: the model's)")(
      "lr", po::value<float>()->default_value(3e-3f), "AdamW learning rate")(
      "seed", po::value<std::uint64_t>()->default_value(1234), "initialisation and data seed")(
      "trace", po::value<std::string>(), "write the last step's tasks as a Chrome trace")(
      "json", po::bool_switch(), "print JSON");
  po::variables_map vm;
  if (!parse(args, desc, "usage: dtexec run --model M [options]", vm)) return 0;
  if (vm["backend"].as<std::string>() != "cpu") {
    throw dtsim::UnsupportedError(fmt::format("--backend {}: only cpu runs plans in this version",
                                              vm["backend"].as<std::string>()));
  }
  const auto spec = dtsim::model::load_model(vm["model"].as<std::string>());
  dtsim::plan::Plan plan;
  plan.precision = dtsim::Precision::Fp32;
  plan.micro_batch_size = vm["micro-batch-size"].as<std::int64_t>();
  plan.global_batch_size = vm.count("global-batch-size")
                               ? vm["global-batch-size"].as<std::int64_t>()
                               : plan.micro_batch_size;
  plan.seq_len = vm.count("seq-len") ? vm["seq-len"].as<std::int64_t>() : spec.seq_len;
  dtsim::plan::require_valid(plan, spec, 1);
  const int steps = vm["steps"].as<int>();
  const int warmup = vm["warmup"].as<int>();
  if (steps < 1 || warmup < 0 || warmup >= steps) {
    throw dtsim::InputError(fmt::format(
        "--steps {} / --warmup {}: need steps >= 1 and 0 <= warmup < steps", steps, warmup));
  }
  const dtsim::model::ModelGraph graph(spec, plan.micro_batch_size, plan.seq_len,
                                       dtsim::plan::activation_bytes_per_element(plan.precision));
  const auto program = dtsim::lower::lower(graph, plan);
  dtsim::exec::RunOptions options;
  options.steps = steps;
  options.warmup_steps = warmup;
  options.learning_rate = vm["lr"].as<float>();
  options.seed = vm["seed"].as<std::uint64_t>();
  const auto result = dtsim::exec::run_program(graph, program, options);
  if (vm.count("trace")) {
    // The last step, times from its start, in the simulator's trace schema.
    dtsim::engine::Timeline timeline;
    timeline.tasks.assign(1, std::vector<dtsim::engine::TaskTime>(program.ranks[0].tasks.size()));
    double begin = -1;
    for (const auto& t : result.tasks) {
      if (t.step != steps - 1) continue;
      if (begin < 0) begin = t.start_s;
      timeline.tasks[0][static_cast<std::size_t>(t.task)] = {t.start_s - begin, t.end_s - begin};
    }
    dtsim::report::write_chrome_trace(vm["trace"].as<std::string>(), program, timeline);
  }
  const double tokens = static_cast<double>(plan.global_batch_size * plan.seq_len);
  if (vm["json"].as<bool>()) {
    std::cout << nlohmann::json{{"model", spec.name},
                                {"backend", "cpu"},
                                {"plan", dtsim::plan::to_json(plan)},
                                {"losses", result.losses},
                                {"step_times_s", result.step_times_s},
                                {"step_time_s", result.step_time_s},
                                {"tokens_per_s", tokens / result.step_time_s},
                                {"warmup_steps", warmup}}
                     .dump(2)
              << "\n";
    return 0;
  }
  std::cout << fmt::format(
      "{} on the CPU, one rank: {} steps of {} x {} tokens ({} micro-batches)\n", spec.name, steps,
      plan.global_batch_size, plan.seq_len, plan.micro_batches());
  for (int i = 0; i < steps; ++i) {
    std::cout << fmt::format("step {:>4}  loss {:.4f}  {:.1f} ms\n", i + 1,
                             result.losses[static_cast<std::size_t>(i)],
                             result.step_times_s[static_cast<std::size_t>(i)] * 1e3);
  }
  std::cout << fmt::format("median step time {:.1f} ms after {} warm-up step(s), {:.0f} tokens/s\n",
                           result.step_time_s * 1e3, warmup, tokens / result.step_time_s);
  return 0;
}

int calibrate(const std::vector<std::string>& args) {
  po::options_description desc("dtexec calibrate options");
  desc.add_options()("help,h", "show this help")(
      "backend", po::value<std::string>()->default_value("cpu"), "cpu (cuda: not yet)")(
      "out", po::value<std::string>(), "write the profile here (required)")(
      "quick", po::bool_switch(), "a few small shapes only (seconds; for tests)");
  po::variables_map vm;
  if (!parse(args, desc, "usage: dtexec calibrate --out P.json [--backend cpu] [--quick]", vm)) {
    return 0;
  }
  if (vm["backend"].as<std::string>() != "cpu") {
    throw dtsim::UnsupportedError(fmt::format("--backend {}: only cpu calibrates in this version",
                                              vm["backend"].as<std::string>()));
  }
  if (!vm.count("out")) throw dtsim::InputError("--out: required (where to write the profile)");
  dtsim::exec::cpu::CalibrateOptions options;
  options.quick = vm["quick"].as<bool>();
  const auto profile = dtsim::exec::cpu::calibrate(options);
  const std::string path = vm["out"].as<std::string>();
  std::ofstream out(path);
  if (!out || !(out << profile.dump(2) << "\n")) {
    throw dtsim::InputError(fmt::format("--out {}: cannot write", path));
  }
  std::cout << fmt::format("{:>6} {:>6} {:>6} {:>12} {:>10}\n", "m", "n", "k", "seconds",
                           "GFLOP/s");
  for (const auto& g : profile.at("gemm")) {
    const double flops =
        2.0 * g.at("m").get<double>() * g.at("n").get<double>() * g.at("k").get<double>();
    std::cout << fmt::format("{:>6} {:>6} {:>6} {:>12.3g} {:>10.1f}\n", g.at("m").get<int>(),
                             g.at("n").get<int>(), g.at("k").get<int>(),
                             g.at("seconds").get<double>(),
                             flops / g.at("seconds").get<double>() / 1e9);
  }
  std::cout << fmt::format(
      "memory bandwidth {:.1f} GB/s, tiny kernel {:.2f} us\nprofile written to {}\n",
      profile.at("memory_bw_bytes_per_s").get<double>() / 1e9,
      profile.at("launch_overhead_s").get<double>() * 1e6, path);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    usage(std::cout);
    return args.empty() ? 2 : 0;
  }
  if (args[0] == "run" || args[0] == "calibrate") {
    try {
      return args[0] == "run" ? run({args.begin() + 1, args.end()})
                              : calibrate({args.begin() + 1, args.end()});
    } catch (const dtsim::InputError& e) {
      std::cerr << "dtexec " << args[0] << ": error: " << e.what() << "\n";
      return 2;
    } catch (const dtsim::UnsupportedError& e) {
      std::cerr << "dtexec " << args[0] << ": unsupported: " << e.what() << "\n";
      return 2;
    } catch (const std::exception& e) {
      std::cerr << "dtexec " << args[0] << ": internal error: " << e.what() << "\n";
      return 1;
    }
  }
  if (args[0] == "devices") {
    bool selftest = false;
    for (std::size_t i = 1; i < args.size(); ++i) {
      if (args[i] == "--selftest") {
        selftest = true;
      } else {
        std::cerr << fmt::format("dtexec devices: error: unknown option \"{}\"\n", args[i]);
        return 2;
      }
    }
    return devices(selftest);
  }
  std::cerr << fmt::format("dtexec: unknown command \"{}\"\n\n", args[0]);
  usage(std::cerr);
  return 2;
}
