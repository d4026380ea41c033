// dtsim: describe models, estimate memory, plan, simulate. The only place that catches errors
// and turns them into exit codes: 2 for bad input, 1 for internal errors, 0 for success.
#include <fmt/format.h>

#include <iostream>
#include <map>
#include <new>
#include <string>
#include <vector>

#include "sim/cli/commands.hpp"
#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/common/launcher.hpp"

namespace {

struct Command {
  int (*run)(const std::vector<std::string>&);
  const char* summary;
};

const std::map<std::string, Command>& commands() {
  static const std::map<std::string, Command> table = {
      {"describe", {dtsim::cli::cmd_describe, "parameters, FLOPs per token, per-layer table"}},
      {"plan", {dtsim::cli::cmd_plan, "search plans, rank them by predicted step time"}},
      {"whatif", {dtsim::cli::cmd_whatif, "sweeps: GPUs, device, network, batch; time and cost"}},
      {"validate", {dtsim::cli::cmd_validate, "predicted against measured traces, task by task"}},
      {"memory", {dtsim::cli::cmd_memory, "memory per rank of a plan; fits or not, and why"}},
      {"list", {dtsim::cli::cmd_list, "shipped models, clusters and devices"}},
      {"simulate", {dtsim::cli::cmd_simulate, "predicted step time, breakdown, MFU, memory"}},
      {"lower", {dtsim::cli::cmd_lower, "the per-rank program a plan lowers to (JSON)"}},
      {"export-platform",
       {dtsim::cli::cmd_export_platform, "the cluster as a SimGrid platform (XML)"}},
  };
  return table;
}

void usage(std::ostream& os) {
  os << "dtsim: planner and simulator for distributed deep-learning training\n\n"
        "usage: dtsim <command> [options]   (dtsim <command> --help for its options)\n\n"
        "commands:\n";
  for (const auto& [name, cmd] : commands()) os << fmt::format("  {:<16} {}\n", name, cmd.summary);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    // No command is an error: the usage goes to stderr, as errors do.
    usage(args.empty() ? std::cerr : std::cout);
    return dtsim::exit_code_after_output("dtsim", args.empty() ? 2 : 0);
  }
  const auto it = commands().find(args[0]);
  if (it == commands().end()) {
    std::cerr << fmt::format("dtsim: unknown command \"{}\"\n\n", args[0]);
    usage(std::cerr);
    return 2;
  }
  // Under mpirun only whatif shares its work among the ranks (its points). Any other command
  // runs on rank 0 alone, said once, and the other ranks end at once: a copy of the output per
  // rank is no JSON document, and each would write --out and --trace over the others.
  if (args[0] != "whatif" && dtsim::launcher_size() != 1) {
    if (dtsim::launcher_rank() != 0) return 0;
    std::cerr << fmt::format(
        "note: dtsim {} runs on rank 0 alone under mpirun; the other ranks did nothing (only "
        "whatif shares its points among ranks{})\n",
        args[0], args[0] == "plan" ? "; plan's search uses --threads" : "");
  }
  const int code = [&] {
    try {
      return it->second.run({args.begin() + 1, args.end()});
    } catch (...) {
      dtsim::cli::end_progress_line();  // (the message below on a line of its own)
      try {
        throw;
      } catch (const dtsim::InputError& e) {
        // Under mpirun every rank meets bad input alike (whatif's ranks send rank 0 their bad
        // points).
        dtsim::say_once_per_job("dtsim " + args[0], "error", e.what());
        return 2;
      } catch (const dtsim::UnsupportedError& e) {
        dtsim::say_once_per_job("dtsim " + args[0], "unsupported", e.what());
        return 2;
      } catch (const std::bad_alloc&) {
        // A job too large for this host (lower --all-ranks of a huge plan), not a fault.
        std::cerr << "dtsim " << args[0]
                  << ": error: out of memory (std::bad_alloc): the job is too large for this "
                     "host's memory (fewer ranks, layers or points)\n";
        return 2;
      } catch (const std::exception& e) {
        std::cerr << "dtsim " << args[0] << ": internal error: " << e.what() << "\n";
        return 1;
      }
    }
  }();
  return dtsim::exit_code_after_output("dtsim " + args[0], code);
}
