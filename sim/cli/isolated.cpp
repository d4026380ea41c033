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
#include <optional>
#include <utility>

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

namespace {

// A prediction's fields but its memory report, as the child sends them.
constexpr std::pair<const char*, double engine::Prediction::*> kTimes[] = {
    {"step_time_s", &engine::Prediction::step_time_s},
    {"tokens_per_s", &engine::Prediction::tokens_per_s},
    {"model_flops", &engine::Prediction::model_flops},
    {"hardware_flops", &engine::Prediction::hardware_flops},
    {"executed_flops", &engine::Prediction::executed_flops},
    {"tflops_per_gpu", &engine::Prediction::tflops_per_gpu},
    {"model_tflops_per_gpu", &engine::Prediction::model_tflops_per_gpu},
    {"mfu", &engine::Prediction::mfu},
    {"hfu", &engine::Prediction::hfu},
    {"serial_fraction", &engine::Prediction::serial_fraction},
    {"max_speedup", &engine::Prediction::max_speedup}};
constexpr std::pair<const char*, std::optional<double> engine::Prediction::*> kCosts[] = {
    {"straggler_cost_s", &engine::Prediction::straggler_cost_s},
    {"slow_rank_cost_s", &engine::Prediction::slow_rank_cost_s}};

nlohmann::json prediction_json(const engine::Prediction& p) {
  nlohmann::json j = {{"gpus", p.gpus},
                      {"bottleneck_stage", p.bottleneck_stage},
                      {"breakdown", report::breakdown_json(p.breakdown)},
                      {"stages", nlohmann::json::array()},
                      {"network", p.network},
                      {"tasks", p.tasks},
                      {"events", p.events},
                      {"notes", p.notes}};
  for (const auto& [key, field] : kTimes) j[key] = p.*field;
  for (const auto& [key, field] : kCosts) j[key] = report::value_or_null(p.*field);
  for (const auto& s : p.stages) j["stages"].push_back(report::stage_json(s));
  return j;
}

engine::Prediction prediction_from_json(const nlohmann::json& j) {
  engine::Prediction p;
  for (const auto& [key, field] : kTimes) p.*field = j.at(key).get<double>();
  for (const auto& [key, field] : kCosts) {
    if (!j.at(key).is_null()) p.*field = j.at(key).get<double>();
  }
  p.gpus = j.at("gpus").get<std::int64_t>();
  p.bottleneck_stage = j.at("bottleneck_stage").get<int>();
  p.breakdown = report::breakdown_from_json(j.at("breakdown"));
  for (const auto& s : j.at("stages")) {
    p.stages.push_back({s.at("stage").get<int>(), s.at("rank").get<std::int64_t>(),
                        report::breakdown_from_json(s.at("breakdown"))});
  }
  p.network = j.at("network").get<std::string>();
  p.tasks = j.at("tasks").get<std::uint64_t>();
  p.events = j.at("events").get<std::uint64_t>();
  p.notes = j.at("notes").get<std::vector<std::string>>();
  return p;
}

}  // namespace

engine::Prediction simulate_on_simgrid(const model::ModelSpec& spec, const plan::Plan& plan,
                                       const cluster::Cluster& cluster,
                                       const engine::SimulateOptions& options) {
  const model::ModelGraph graph = plan::graph_of(spec, plan);
  engine::Prediction pred = prediction_from_json(nlohmann::json::parse(run_isolated([&] {
    auto net = network::make_simgrid(cluster, plan);
    return json_text(
        prediction_json(engine::simulate(graph, plan, cluster, *net, options).prediction));
  })));
  // The memory report as engine::simulate makes it (the network has no part in it).
  pred.memory = plan::estimate_memory(graph, plan, cluster, options.memory);
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
