#include "sim/engine/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <numbers>
#include <queue>
#include <set>
#include <tuple>
#include <utility>

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
  Engine(const lower::Program& program, Durations& durations, const EngineOptions& options)
      : program_(program),
        durations_(durations),
        jitter_cv_(options.jitter_cv),
        slow_program_(options.slow_program),
        slow_factor_(options.slow_factor),
        eager_p2p_(program.plan.overlap_p2p_comm),
        serial_(options.serial_ranks) {
    const std::size_t n = program.ranks.size();
    compute_total_.assign(n, 0.0);
    spread_.assign(program.groups.size(), -1.0);
    synced_at_.resize(n);
    paired_at_.resize(n);
    peers_.resize(n);
    link_out_free_.assign(n, 0.0);
    link_in_free_.assign(n, 0.0);
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
        if (task.kind == TaskKind::Send || task.kind == TaskKind::Recv) {
          peers_[p].insert(task.peer);
        }
        // A receive occupies no stream: the sender's transfer carries its time. Without p2p
        // overlap a send leaves the pipeline stream too: it waits for its receiver, and a
        // later send to the other neighbour must not queue behind that wait.
        if (task.kind == TaskKind::Recv) continue;
        if (task.kind == TaskKind::Send && !eager_p2p_) continue;
        auto& prev = last[serial_ ? 0 : static_cast<std::size_t>(task.stream)];
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
      case TaskKind::Compute: {
        const double d = durations_.compute_s(k) * (p == slow_program_ ? slow_factor_ : 1.0);
        compute_total_[static_cast<std::size_t>(p)] += d;
        schedule(p, t, now, now + d);
        break;
      }
      case TaskKind::Collective:
        arrive(p, t, now);
        break;
      case TaskKind::Send: {
        // Stragglers: the receiver gets the data as late as the sender is, on average.
        const double late = jitter_cv_ > 0 ? pair_wait(p, k.peer) : 0.0;
        const auto key = std::make_tuple(k.peer, p, k.tag);
        const auto posted = recvs_.find(key);
        if (!eager_p2p_) {
          // Rendezvous: the transfer starts once the receiver has posted its receive.
          if (posted == recvs_.end()) {
            waiting_sends_[key] = {t, now + late};
            break;
          }
          rendezvous(p, t, now + late, k.peer, posted->second);
          recvs_.erase(posted);
          break;
        }
        // The data travels as late as the sender is; the sender's own task is not shifted.
        const auto [start, end] = reserve_link(p, k.peer, now + late, transfer_s(p, k));
        schedule(p, t, now, end - late);  // eager: the sender does not wait for the receiver
        const TaskTime arrival{start, end};
        sends_[key] = arrival;
        if (posted != recvs_.end()) {
          complete_recv(k.peer, posted->second, arrival);
          recvs_.erase(posted);
        }
        break;
      }
      case TaskKind::Recv: {
        const auto key = std::make_tuple(p, k.peer, k.tag);
        if (auto it = waiting_sends_.find(key); it != waiting_sends_.end()) {
          rendezvous(k.peer, it->second.first, it->second.second, p, t);
          waiting_sends_.erase(it);
        } else if (auto sent = sends_.find(key); sent != sends_.end()) {
          complete_recv(p, t, sent->second);
          sends_.erase(sent);
        } else {
          recvs_[key] = t;
        }
        break;
      }
    }
  }

  double transfer_s(std::int32_t sender, const Task& send) {
    return durations_.p2p_s(program_.ranks[static_cast<std::size_t>(sender)].rank,
                            program_.ranks[static_cast<std::size_t>(send.peer)].rank, send.bytes);
  }

  // A blocking transfer: it starts when the sender is ready and the receive is posted, and
  // both tasks end with it.
  void rendezvous(std::int32_t sender, TaskId send, double ready, std::int32_t receiver,
                  TaskId recv) {
    const double posted =
        eligible_[static_cast<std::size_t>(receiver)][static_cast<std::size_t>(recv)];
    const auto [start, end] = reserve_link(sender, receiver, std::max(ready, posted),
                                           transfer_s(sender, task(sender, send)));
    schedule(sender, send, start, end);
    schedule(receiver, recv, start, end);
  }

  // A device's link carries one pipeline transfer at a time each way: a stage that sends to
  // both neighbours at once (Megatron-LM's exchange between two rounds) sends at half the
  // bandwidth, and queueing the second transfer behind the first gives the pair the same end.
  // Transfers book the links in the order the engine meets them (the later end's readiness),
  // which is their order of readiness except where a straggler delay pushes a start later
  // than a transfer met after it. Returns the transfer's start and end.
  std::pair<double, double> reserve_link(std::int32_t sender, std::int32_t receiver, double ready,
                                         double seconds) {
    double& out = link_out_free_[static_cast<std::size_t>(sender)];
    double& in = link_in_free_[static_cast<std::size_t>(receiver)];
    const double start = std::max({ready, out, in});
    out = in = start + seconds;
    return {start, start + seconds};
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
    const double wait = jitter_cv_ > 0 ? straggler_wait(r.members, g, k.group) : 0.0;
    const double end = r.start_s + wait + durations_.collective_s(g, k);
    for (const auto& [mp, mt] : r.members) schedule(mp, mt, r.start_s, end);
    collectives_.erase({k.group, seq});
  }

  // Stragglers: the slowest of the group's ranks (not programs: a representative stands for
  // several) arrives late by the spread of the compute its members did since they were last
  // tied: at the group's last collective, or where a member last exchanged a pipeline transfer
  // with another member (a blocking transfer waits for the later of the two, so a lead or lag
  // from before is spent; an eager send ties only a receiver that was ahead, which this takes
  // as a tie as well). So at pp 2, or with interleaved chunks, the first and last stages'
  // tied-embedding all-reduce follows their last transfers, not a whole step of compute; at
  // pp > 2 without interleaving those two stages exchange nothing directly, and the ties along
  // the stages between them are not followed. The collective is now their last tie, and the
  // last tie of each pair of its members that exchange pipeline transfers (its group's or not).
  double straggler_wait(const std::vector<std::pair<std::int32_t, TaskId>>& members,
                        const lower::Group& g, std::int32_t group) {
    std::vector<std::int32_t> programs;
    for (const auto& member : members) programs.push_back(member.first);
    std::sort(programs.begin(), programs.end());
    auto is_member = [&](std::int32_t p) {
      return std::binary_search(programs.begin(), programs.end(), p);
    };
    double since = 0;
    for (const std::int32_t p : programs) {
      const auto i = static_cast<std::size_t>(p);
      const auto it = synced_at_[i].find(group);
      double tied = it == synced_at_[i].end() ? 0 : it->second;
      for (const auto& [peer, at] : paired_at_[i]) {
        if (is_member(peer)) tied = std::max(tied, at);
      }
      since = std::max(since, compute_total_[i] - tied);
    }
    for (const std::int32_t p : programs) {
      const auto i = static_cast<std::size_t>(p);
      synced_at_[i][group] = compute_total_[i];
      for (const std::int32_t peer : peers_[i]) {
        if (is_member(peer)) paired_at_[i][peer] = compute_total_[i];
      }
    }
    double& e = spread_[static_cast<std::size_t>(group)];  // computed once per group
    if (e < 0) e = expected_max_normal(static_cast<std::int64_t>(g.ranks.size()));
    return jitter_cv_ * e * since;
  }

  // Stragglers between the two ranks of a transfer: the sender is late past the receiver by
  // E[max(0, X - Y)] = e(2)·cv·T for X, Y their normal spreads (e(2) = 1/sqrt(pi), the same
  // as the later of two), T the compute either did since the pair's previous tie (a transfer,
  // or a collective of both). This is their new tie, marked with the compute each has issued
  // when the send is ready: a receiver not at its receive yet may have some of it under way
  // (an approximation; marking the receiver where it posts the receive instead would count a
  // wait for each direction of Megatron-LM's paired exchanges, where now the second of the
  // pair, ready at the same moment, finds the two just tied).
  double pair_wait(std::int32_t sender, std::int32_t receiver) {
    const auto s = static_cast<std::size_t>(sender), r = static_cast<std::size_t>(receiver);
    const double since = std::max(compute_total_[s] - paired_at_[s][receiver],
                                  compute_total_[r] - paired_at_[r][sender]);
    paired_at_[s][receiver] = compute_total_[s];
    paired_at_[r][sender] = compute_total_[r];
    if (pair_spread_ < 0) pair_spread_ = expected_max_normal(2);
    return jitter_cv_ * pair_spread_ * since;
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
  double jitter_cv_;
  std::int32_t slow_program_;
  double slow_factor_;
  // The straggler model, per program: compute seconds issued so far, and that total when the
  // program last completed a collective of each group.
  std::vector<double> compute_total_;
  std::vector<std::map<std::int32_t, double>> synced_at_;
  // ... and when it last exchanged a transfer with each peer program (or met it in a
  // collective after that); its peers, from its sends and receives.
  std::vector<std::map<std::int32_t, double>> paired_at_;
  std::vector<std::set<std::int32_t>> peers_;
  double pair_spread_ = -1;     // expected_max_normal(2), once needed
  std::vector<double> spread_;  // per group: expected_max_normal(ranks), -1 until needed
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
  // Blocking transfers whose receive is not posted yet: the send and when its sender was ready.
  std::map<std::tuple<std::int32_t, std::int32_t, std::int64_t>, std::pair<TaskId, double>>
      waiting_sends_;
  bool eager_p2p_;
  bool serial_;
  // Per program: when its link is next free to send and to receive a pipeline transfer.
  std::vector<double> link_out_free_, link_in_free_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  std::uint64_t seq_ = 0;
  Timeline timeline_;
};

}  // namespace

double expected_max_normal(std::int64_t n) {
  if (n <= 1) return 0;
  static std::mutex mutex;
  static std::map<std::int64_t, double> memo;
  const std::lock_guard<std::mutex> lock(mutex);
  if (auto it = memo.find(n); it != memo.end()) return it->second;
  // E[max] = integral of x · n·phi(x)·Phi(x)^(n-1) dx; Simpson's rule on [-12, 12], where the
  // density of the maximum of up to 2^24 normals is negligible outside.
  const int steps = 24000;
  const double lo = -12, hi = 12, h = (hi - lo) / steps;
  const double nd = static_cast<double>(n);
  auto density = [&](double x) {
    const double phi = std::exp(-0.5 * x * x) / std::sqrt(2 * std::numbers::pi);
    const double cdf = 0.5 * std::erfc(-x / std::numbers::sqrt2);
    return x * nd * phi * std::pow(cdf, nd - 1);
  };
  double sum = density(lo) + density(hi);
  for (int i = 1; i < steps; ++i) sum += density(lo + i * h) * (i % 2 == 1 ? 4 : 2);
  const double e = sum * h / 3;
  memo.emplace(n, e);
  return e;
}

Timeline run(const lower::Program& program, Durations& durations, const EngineOptions& options) {
  DTSIM_ASSERT(options.slow_program >= -1 &&
                   options.slow_program < static_cast<std::int32_t>(program.ranks.size()) &&
                   options.slow_factor >= 1.0,
               "engine: a slow program out of range, or faster than the others");
  return Engine(program, durations, options).run();
}

}  // namespace dtsim::engine
