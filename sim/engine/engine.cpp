#include "sim/engine/engine.hpp"

#include <fmt/format.h>

#include <map>
#include <queue>
#include <tuple>

#include "sim/common/error.hpp"

namespace dtsim::engine {

namespace {

using lower::Task;
using lower::TaskId;
using lower::TaskKind;

struct Event {
  double time;
  std::uint64_t seq;
  std::int32_t program;
  TaskId task;
  bool operator>(const Event& o) const { return std::tie(time, seq) > std::tie(o.time, o.seq); }
};

class Engine {
 public:
  Engine(const lower::Program& program, Durations& durations)
      : program_(program), durations_(durations) {
    const std::size_t n = program.ranks.size();
    pending_.resize(n);
    dependents_.resize(n);
    eligible_.resize(n);
    timeline_.tasks.resize(n);
    group_seq_.resize(n);
    for (std::size_t p = 0; p < n; ++p) {
      const auto& tasks = program.ranks[p].tasks;
      pending_[p].assign(tasks.size(), 0);
      dependents_[p].resize(tasks.size());
      eligible_[p].assign(tasks.size(), -1.0);
      timeline_.tasks[p].assign(tasks.size(), TaskTime{-1.0, -1.0});
      std::array<TaskId, lower::kStreamCount> last{};
      last.fill(-1);
      for (TaskId t = 0; t < static_cast<TaskId>(tasks.size()); ++t) {
        const Task& task = tasks[static_cast<std::size_t>(t)];
        for (TaskId d : task.deps) {
          DTSIM_ASSERT(d >= 0 && d < t, fmt::format("task {} depends on later task {}", t, d));
          dependents_[p][static_cast<std::size_t>(d)].push_back(t);
          ++pending_[p][static_cast<std::size_t>(t)];
        }
        // A receive occupies no stream: the sender's transfer carries its time.
        if (task.kind == TaskKind::Recv) continue;
        auto& prev = last[static_cast<std::size_t>(task.stream)];
        if (prev >= 0) {
          dependents_[p][static_cast<std::size_t>(prev)].push_back(t);
          ++pending_[p][static_cast<std::size_t>(t)];
        }
        prev = t;
      }
    }
  }

  Timeline run() {
    for (std::size_t p = 0; p < program_.ranks.size(); ++p) {
      for (std::size_t t = 0; t < pending_[p].size(); ++t) {
        if (pending_[p][t] == 0)
          eligible(static_cast<std::int32_t>(p), static_cast<TaskId>(t), 0.0);
      }
    }
    while (!queue_.empty()) {
      const Event e = queue_.top();
      queue_.pop();
      ++timeline_.events;
      finish(e.program, e.task, e.time);
    }
    for (std::size_t p = 0; p < program_.ranks.size(); ++p) {
      for (std::size_t t = 0; t < timeline_.tasks[p].size(); ++t) {
        if (timeline_.tasks[p][t].end_s < 0) {
          throw InternalError(fmt::format(
              "simulation stuck: rank {} task {} ({}) never ran; the program has a dependency "
              "cycle or an unmatched send/receive/collective",
              program_.ranks[p].rank, t, program_.ranks[p].tasks[t].label));
        }
        timeline_.makespan_s = std::max(timeline_.makespan_s, timeline_.tasks[p][t].end_s);
      }
    }
    return std::move(timeline_);
  }

 private:
  const Task& task(std::int32_t p, TaskId t) const {
    return program_.ranks[static_cast<std::size_t>(p)].tasks[static_cast<std::size_t>(t)];
  }
  TaskTime& time(std::int32_t p, TaskId t) {
    return timeline_.tasks[static_cast<std::size_t>(p)][static_cast<std::size_t>(t)];
  }

  void schedule(std::int32_t p, TaskId t, double start, double end) {
    time(p, t) = TaskTime{start, end};
    queue_.push(Event{end, seq_++, p, t});
  }

  void eligible(std::int32_t p, TaskId t, double now) {
    eligible_[static_cast<std::size_t>(p)][static_cast<std::size_t>(t)] = now;
    const Task& k = task(p, t);
    switch (k.kind) {
      case TaskKind::Compute:
        schedule(p, t, now, now + durations_.compute_s(k));
        break;
      case TaskKind::Collective:
        arrive(p, t, now);
        break;
      case TaskKind::Send: {
        const double end =
            now + durations_.p2p_s(program_.ranks[static_cast<std::size_t>(p)].rank,
                                   program_.ranks[static_cast<std::size_t>(k.peer)].rank, k.bytes);
        schedule(p, t, now, end);
        const auto key = std::make_tuple(k.peer, p, k.tag);
        sends_[key] = TaskTime{now, end};
        if (auto it = recvs_.find(key); it != recvs_.end()) {
          complete_recv(k.peer, it->second, TaskTime{now, end});
          recvs_.erase(it);
        }
        break;
      }
      case TaskKind::Recv: {
        const auto key = std::make_tuple(p, k.peer, k.tag);
        if (auto it = sends_.find(key); it != sends_.end()) {
          complete_recv(p, t, it->second);
          sends_.erase(it);
        } else {
          recvs_[key] = t;
        }
        break;
      }
    }
  }

  // The receive spans the part of the transfer after it was posted.
  void complete_recv(std::int32_t p, TaskId t, TaskTime transfer) {
    const double posted = eligible_[static_cast<std::size_t>(p)][static_cast<std::size_t>(t)];
    schedule(p, t, std::max(posted, transfer.start_s), std::max(posted, transfer.end_s));
  }

  void arrive(std::int32_t p, TaskId t, double now) {
    const Task& k = task(p, t);
    const lower::Group& g = program_.groups.at(static_cast<std::size_t>(k.group));
    // Members reach the group's collectives in the same order (one stream per group kind).
    const std::int64_t seq = group_seq_[static_cast<std::size_t>(p)][k.group]++;
    Rendezvous& r = collectives_[{k.group, seq}];
    r.start_s = std::max(r.start_s, now);
    r.members.emplace_back(p, t);
    if (r.members.size() < g.programs.size()) return;
    const double end = r.start_s + durations_.collective_s(g, k);
    for (const auto& [mp, mt] : r.members) schedule(mp, mt, r.start_s, end);
    collectives_.erase({k.group, seq});
  }

  void finish(std::int32_t p, TaskId t, double now) {
    for (TaskId d : dependents_[static_cast<std::size_t>(p)][static_cast<std::size_t>(t)]) {
      if (--pending_[static_cast<std::size_t>(p)][static_cast<std::size_t>(d)] == 0) {
        eligible(p, d, now);
      }
    }
  }

  const lower::Program& program_;
  Durations& durations_;
  std::vector<std::vector<int>> pending_;
  std::vector<std::vector<std::vector<TaskId>>> dependents_;
  std::vector<std::vector<double>> eligible_;
  std::vector<std::map<std::int32_t, std::int64_t>> group_seq_;
  // A collective instance (group, sequence number) waiting for its members.
  struct Rendezvous {
    double start_s = 0;
    std::vector<std::pair<std::int32_t, TaskId>> members;
  };
  std::map<std::pair<std::int32_t, std::int64_t>, Rendezvous> collectives_;
  std::map<std::tuple<std::int32_t, std::int32_t, std::int64_t>, TaskTime> sends_;
  std::map<std::tuple<std::int32_t, std::int32_t, std::int64_t>, TaskId> recvs_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  std::uint64_t seq_ = 0;
  Timeline timeline_;
};

}  // namespace

Timeline run(const lower::Program& program, Durations& durations) {
  return Engine(program, durations).run();
}

}  // namespace dtsim::engine
