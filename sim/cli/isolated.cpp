#include "sim/cli/isolated.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "sim/common/error.hpp"
#include "sim/report/breakdown_json.hpp"
#include "sim/report/json_values.hpp"

namespace dtsim::cli {

std::string error_kind(const std::exception& e) {
  if (dynamic_cast<const InputError*>(&e)) return "input";
  if (dynamic_cast<const UnsupportedError*>(&e)) return "unsupported";
  return "internal";
}

[[noreturn]] void rethrow_error(const std::string& kind, const std::string& what) {
  if (kind == "input") throw InputError(what);
  if (kind == "unsupported") throw UnsupportedError(what);
  throw InternalError(what);
}

engine::Prediction simulate_on_simgrid(const model::ModelSpec& spec, const plan::Plan& plan,
                                       const cluster::Cluster& cluster,
                                       const engine::SimulateOptions& options) {
  const model::ModelGraph graph = plan::graph_of(spec, plan);
  auto analytical = network::make_analytical(cluster);
  engine::Prediction pred = engine::simulate(graph, plan, cluster, *analytical, options).prediction;
  const auto timed = nlohmann::json::parse(run_isolated([&] {
    auto net = network::make_simgrid(cluster, plan);
    const engine::Prediction p = engine::simulate(graph, plan, cluster, *net, options).prediction;
    nlohmann::json stages = nlohmann::json::array();
    for (const auto& s : p.stages) stages.push_back(report::stage_json(s));
    return nlohmann::json{{"step_time_s", p.step_time_s},
                          {"tokens_per_s", p.tokens_per_s},
                          {"tflops_per_gpu", p.tflops_per_gpu},
                          {"model_tflops_per_gpu", p.model_tflops_per_gpu},
                          {"mfu", p.mfu},
                          {"hfu", p.hfu},
                          {"bottleneck_stage", p.bottleneck_stage},
                          {"breakdown", report::breakdown_json(p.breakdown)},
                          {"stages", stages},
                          {"serial_fraction", p.serial_fraction},
                          {"max_speedup", p.max_speedup},
                          {"straggler_cost_s", report::value_or_null(p.straggler_cost_s)},
                          {"slow_rank_cost_s", report::value_or_null(p.slow_rank_cost_s)},
                          {"network", p.network},
                          {"tasks", p.tasks},
                          {"events", p.events},
                          {"notes", p.notes}}
        .dump();
  }));
  pred.step_time_s = timed.at("step_time_s").get<double>();
  pred.tokens_per_s = timed.at("tokens_per_s").get<double>();
  pred.tflops_per_gpu = timed.at("tflops_per_gpu").get<double>();
  pred.model_tflops_per_gpu = timed.at("model_tflops_per_gpu").get<double>();
  pred.mfu = timed.at("mfu").get<double>();
  pred.hfu = timed.at("hfu").get<double>();
  pred.bottleneck_stage = timed.at("bottleneck_stage").get<int>();
  pred.breakdown = report::breakdown_from_json(timed.at("breakdown"));
  pred.stages.clear();
  for (const auto& s : timed.at("stages")) {
    pred.stages.push_back({s.at("stage").get<int>(), s.at("rank").get<std::int64_t>(),
                           report::breakdown_from_json(s.at("breakdown"))});
  }
  pred.serial_fraction = timed.at("serial_fraction").get<double>();
  pred.max_speedup = timed.at("max_speedup").get<double>();
  const auto optional = [&](const char* key) -> std::optional<double> {
    if (timed.at(key).is_null()) return std::nullopt;
    return timed.at(key).get<double>();
  };
  pred.straggler_cost_s = optional("straggler_cost_s");
  pred.slow_rank_cost_s = optional("slow_rank_cost_s");
  pred.network = timed.at("network").get<std::string>();
  pred.tasks = timed.at("tasks").get<std::uint64_t>();
  pred.events = timed.at("events").get<std::uint64_t>();
  pred.notes = timed.at("notes").get<std::vector<std::string>>();
  return pred;
}

std::string run_isolated(const std::function<std::string()>& work) {
  int fds[2];
  // (Close-on-exec: a child of another thread's fork does not hold this pipe open.)
  if (pipe2(fds, O_CLOEXEC) != 0) {
    throw InternalError(fmt::format("pipe: {}", std::strerror(errno)));
  }
  // (What is buffered would be written twice, by each process.)
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(fds[0]);
    close(fds[1]);
    throw InternalError(fmt::format("fork: {}", std::strerror(err)));
  }
  if (pid == 0) {
    // Dies with its parent (mpirun ending a rank, a Ctrl-C) rather than simulating on alone.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(fds[0]);
    std::string out;
    try {
      out = "ok\n" + work();
    } catch (const std::exception& e) {
      out = error_kind(e) + "\n" + e.what();
    } catch (...) {
      out = "internal\nan exception of no known type";
    }
    for (std::size_t at = 0; at < out.size();) {
      const ssize_t n = write(fds[1], out.data() + at, out.size() - at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) _exit(3);
      at += static_cast<std::size_t>(n);
    }
    close(fds[1]);
    // Without the parent's exit handlers and buffers: they are the parent's to run.
    _exit(0);
  }
  close(fds[1]);
  std::string in;
  char buf[65536];
  for (;;) {
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    in.append(buf, static_cast<std::size_t>(n));
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) {
    throw InternalError(fmt::format("a child process (pid {}) was killed by signal {} ({})", pid,
                                    WTERMSIG(status), strsignal(WTERMSIG(status))));
  }
  const std::size_t eol = in.find('\n');
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || eol == std::string::npos) {
    throw InternalError(
        fmt::format("a child process (pid {}) ended with exit code {} before "
                    "it had returned its result",
                    pid, WIFEXITED(status) ? WEXITSTATUS(status) : -1));
  }
  const std::string kind = in.substr(0, eol);
  std::string rest = in.substr(eol + 1);
  if (kind == "ok") return rest;
  rethrow_error(kind, rest);
}

}  // namespace dtsim::cli
