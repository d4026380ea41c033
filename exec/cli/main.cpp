// dtexec: runs dtsim plans for real. This version has one command, `devices`, which reports
// what the GPU backend sees on this host; `run` and `calibrate` come with the executor.
#include <fmt/format.h>

#include <iostream>
#include <string>

#ifdef DTEXEC_HAVE_CUDA
#include "exec/cuda/gpu_probe.hpp"
#endif

namespace {

void usage(std::ostream& os) {
  os << "dtexec: run dtsim plans for real (CPU ranks over MPI, GPUs over CUDA + NCCL)\n\n"
        "usage: dtexec <command> [options]\n\n"
        "commands:\n"
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

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    usage(std::cout);
    return args.empty() ? 2 : 0;
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
