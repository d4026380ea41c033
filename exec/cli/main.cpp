// dtexec: runs dtsim plans for real. `run` executes a lowered Program on CPU ranks (MPI) or
// GPUs and reports losses and step times; `compare` checks two checkpoints against each other;
// `calibrate` measures a profile for `dtsim --profile` (CPU or CUDA); `devices` reports what the
// GPU backend sees. Each command is in its own file (cmd_*.cpp).
#include <fmt/format.h>

#include <csignal>
#include <iostream>
#include <string>
#include <vector>

#include "exec/cli/commands.hpp"
#include "exec/core/in_run.hpp"
#include "exec/cpu/device.hpp"
#include "sim/common/error.hpp"
#include "sim/common/launcher.hpp"

#ifdef DTEXEC_HAVE_CUDA
#include "exec/cuda/gpu_probe.hpp"
#endif

namespace dtsim::exec::cli {

namespace {

void usage(std::ostream& os) {
  os << "dtexec: run dtsim plans for real (CPU ranks over MPI, GPUs over CUDA + NCCL)\n\n"
        "usage: dtexec <command> [options]\n\n"
        "commands:\n"
        "  run --model M [plan flags | --plan P.json] [--steps N] [--checkpoint DIR]\n"
        "      [--resume DIR] [--trace T.json] [--json]\n"
        "                         train M following the Program dtsim lowers the plan to: on\n"
        "                         CPU ranks (mpirun -np N) or GPUs (--backend cuda)\n"
        "  compare A B            two checkpoints: losses and weights, within\n"
        "                         --loss-tolerance and --weight-tolerance\n"
        "  calibrate --out P.json [--backend cpu] [--quick]\n"
        "                         measure GEMM times by shape, memory bandwidth and kernel\n"
        "                         overhead; a profile for dtsim --profile\n"
        "  devices [--selftest]   GPUs visible to the CUDA backend, library versions; with\n"
        "                         --selftest, run a check kernel on each GPU\n";
}

}  // namespace

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
    // Without a driver the runtime says "driver version is insufficient": there is none to
    // upgrade, so that is said first.
    std::cout << "no GPU: "
              << (p.cuda_driver_version == 0
                      ? "no NVIDIA driver found (libcuda is not installed, or no GPU is "
                        "attached); CUDA said: "
                      : "")
              << p.why_none << "\n";
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

}  // namespace dtsim::exec::cli

int main(int argc, char** argv) {
  using namespace dtsim::exec::cli;
  // A reader that closes stdout (dtexec run ... | head) would kill a run with SIGPIPE, its
  // checkpoint unwritten and nothing said: the writes fail instead, the run goes on, and its
  // end says the output was cut (exit_code_after_output, exit 2), as on a full disk.
  std::signal(SIGPIPE, SIG_IGN);
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    // No command is an error: the usage goes to stderr, as errors do.
    usage(args.empty() ? std::cerr : std::cout);
    return dtsim::exit_code_after_output("dtexec", args.empty() ? 2 : 0);
  }
  if (args[0] == "run" || args[0] == "calibrate" || args[0] == "compare") {
    if (args[0] != "compare") dtsim::exec::cpu::keep_freed_host_memory();
    const int code = [&] {
      try {
        const std::vector<std::string> rest(args.begin() + 1, args.end());
        if (args[0] == "compare") return compare(rest);
        return args[0] == "run" ? run(rest) : calibrate(rest);
      } catch (const dtsim::InputError& e) {
        // Under mpirun every rank meets bad input alike (options, a plan that does not
        // fit the ranks).
        dtsim::say_once_per_job("dtexec " + args[0], "error", e.what(), g_rank);
        return 2;
      } catch (const dtsim::UnsupportedError& e) {
        dtsim::say_once_per_job("dtexec " + args[0], "unsupported", e.what(), g_rank);
        return 2;
      } catch (const std::bad_alloc&) {
        std::cerr << "dtexec " << args[0] << ": error: " << kOutOfHostMemory << "\n";
        return 2;
      } catch (const dtsim::exec::MeasurementError& e) {
        std::cerr << "dtexec " << args[0] << ": error: " << e.what() << "\n";
        return 1;
      } catch (const std::exception& e) {
        std::cerr << "dtexec " << args[0] << ": internal error: " << e.what() << "\n";
        return 1;
      }
    }();
    return dtsim::exit_code_after_output("dtexec " + args[0], code);
  }
  if (args[0] == "devices") {
    bool selftest = false;
    for (std::size_t i = 1; i < args.size(); ++i) {
      if (args[i] == "--selftest") {
        selftest = true;
      } else if (args[i] == "--help" || args[i] == "-h") {
        std::cout << "usage: dtexec devices [--selftest]\n\n"
                     "Lists the GPUs the CUDA backend sees (name, memory, compute capability) and "
                     "the\nCUDA, cuBLAS and NCCL versions; --selftest runs a check kernel on each "
                     "(exit code 1\nwhen one fails). Without a GPU, or built without the CUDA "
                     "backend, it says so and\nexits 0.\n";
        return dtsim::exit_code_after_output("dtexec devices", 0);
      } else {
        std::cerr << fmt::format("dtexec devices: error: unknown option \"{}\"\n", args[i]);
        return 2;
      }
    }
    return dtsim::exit_code_after_output("dtexec devices", devices(selftest));
  }
  std::cerr << fmt::format("dtexec: unknown command \"{}\"\n\n", args[0]);
  usage(std::cerr);
  return 2;
}
