#include "sim/engine/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
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
        serial_(options.serial_ranks),
        progress_(options.progress) {
    const std::size_t n = program.ranks.size();
    compute_total_.assign(n, 0.0);
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
      eligible_[p].assign(tasks.size(), -1.0);
      timeline_.tasks[p].assign(tasks.size(), TaskTime{-1.0, -1.0});
      for (const Task& task : tasks) {
        if (task.kind == TaskKind::Send || task.kind == TaskKind::Recv) {
          peers_[p].insert(task.peer);
        }
      }
      // The dependents of each task, in one array (a rank has millions of tasks at 1,000
      // micro-batches): counted, then filled in the same order.
      Dependents& out = dependents_[p];
      out.begin.assign(tasks.size() + 1, 0);
      for_each_edge(tasks, [&](TaskId from, TaskId to) {
        ++out.begin[static_cast<std::size_t>(from) + 1];
        ++pending_[p][static_cast<std::size_t>(to)];
      });
      for (std::size_t t = 0; t < tasks.size(); ++t) out.begin[t + 1] += out.begin[t];
      out.tasks.resize(out.begin.back());
      std::vector<std::uint32_t> filled(out.begin.begin(), out.begin.end() - 1);
      for_each_edge(tasks, [&](TaskId from, TaskId to) {
        out.tasks[filled[static_cast<std::size_t>(from)]++] = to;
      });
    }
  }

  Timeline run() {
    for (std::size_t p = 0; p < program_.ranks.size(); ++p) {
      for (std::size_t t = 0; t < pending_[p].size(); ++t) {
        if (pending_[p][t] == 0)
          eligible(static_cast<std::int32_t>(p), static_cast<TaskId>(t), 0.0);
      }
    }
    const auto total = static_cast<std::uint64_t>(program_.task_count());
    while (!queue_.empty()) {
      const Event e = queue_.top();
      queue_.pop();
      ++timeline_.events;
      finish(e.program, e.task, e.time);
      if (progress_ && timeline_.events % 65536 == 0) {
        progress_(std::min<std::uint64_t>(timeline_.events, total), total);
      }
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
    if (progress_) progress_(total, total);  // (after the check: a stuck run is not 100%)
    return std::move(timeline_);
  }

 private:
  // A pipeline transfer's two ends: the spread of each's arrival (pair_spreads).
  struct Spreads {
    double sender_s = 0, receiver_s = 0;
  };
  // An eager send's data on its way: when it travels, and the two ends' spreads.
  struct Sent {
    TaskTime transfer;
    Spreads spreads;
  };
  // A blocking send whose receive is not posted yet.
  struct WaitingSend {
    TaskId send;
    double ready_s;
    Spreads spreads;
  };
  // A receive posted before its send: the task, and the compute its rank had issued then.
  struct PostedRecv {
    TaskId recv;
    double issued_s;
  };
  // A collective's member that has arrived: its program, task, and compute issued then.
  struct Member {
    std::int32_t program;
    TaskId task;
    double issued_s;
  };

  const Task& task(std::int32_t p, TaskId t) const {
    return program_.ranks[static_cast<std::size_t>(p)].tasks[static_cast<std::size_t>(t)];
  }
  TaskTime& time(std::int32_t p, TaskId t) {
    return timeline_.tasks[static_cast<std::size_t>(p)][static_cast<std::size_t>(t)];
  }

  // The task spans [start, end); its straggler wait, if any, is [wait_from, wait_from + wait).
  void schedule(std::int32_t p, TaskId t, double start, double end, double wait_from = 0,
                double wait = 0) {
    time(p, t) = TaskTime{start, end, wait_from, wait};
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
        const auto key = std::make_tuple(k.peer, p, k.tag);
        const auto posted = recvs_.find(key);
        // A receiver at its receive already: the compute it had issued when it posted it.
        const Spreads spreads =
            jitter_cv_ > 0 ? pair_spreads(p, k.peer,
                                          posted != recvs_.end()
                                              ? posted->second.issued_s
                                              : compute_total_[static_cast<std::size_t>(k.peer)])
                           : Spreads{};
        if (!eager_p2p_) {
          // Rendezvous: the transfer starts once the receiver has posted its receive.
          if (posted == recvs_.end()) {
            waiting_sends_[key] = {t, now, spreads};
            break;
          }
          rendezvous(p, t, now, spreads, k.peer, posted->second.recv);
          recvs_.erase(posted);
          break;
        }
        const auto [start, end] = reserve_link(p, k.peer, now, transfer_s(p, k));
        schedule(p, t, now, end);  // eager: the sender does not wait for the receiver
        const Sent sent{TaskTime{start, end}, spreads};
        if (posted != recvs_.end()) {
          complete_recv(k.peer, posted->second.recv, sent);
          recvs_.erase(posted);
        } else {
          sends_[key] = sent;
        }
        break;
      }
      case TaskKind::Recv: {
        const auto key = std::make_tuple(p, k.peer, k.tag);
        if (auto it = waiting_sends_.find(key); it != waiting_sends_.end()) {
          rendezvous(k.peer, it->second.send, it->second.ready_s, it->second.spreads, p, t);
          waiting_sends_.erase(it);
        } else if (auto sent = sends_.find(key); sent != sends_.end()) {
          complete_recv(p, t, sent->second);
          sends_.erase(sent);
        } else {
          recvs_[key] = PostedRecv{t, compute_total_[static_cast<std::size_t>(p)]};
        }
        break;
      }
    }
  }

  double transfer_s(std::int32_t sender, const Task& send) {
    return durations_.p2p_s(program_.ranks[static_cast<std::size_t>(sender)].rank,
                            program_.ranks[static_cast<std::size_t>(send.peer)].rank, send.bytes);
  }

  // A blocking transfer: it starts when the sender is ready and the receive is posted (the
  // later of the two, on average later still by their spreads), and both tasks end with it.
  void rendezvous(std::int32_t sender, TaskId send, double ready, Spreads spreads,
                  std::int32_t receiver, TaskId recv) {
    const double posted =
        eligible_[static_cast<std::size_t>(receiver)][static_cast<std::size_t>(recv)];
    const double late =
        expected_lateness(Arrival{ready, spreads.sender_s}, Arrival{posted, spreads.receiver_s});
    const double both = std::max(ready, posted);
    const auto [start, end] =
        reserve_link(sender, receiver, both + late, transfer_s(sender, task(sender, send)));
    schedule(sender, send, start, end, both, late);
    schedule(receiver, recv, start, end, both, late);
  }

  // A device's link carries one pipeline transfer at a time each way: a stage that sends to
  // both neighbours at once (Megatron-LM's exchange between two rounds) sends at half the
  // bandwidth, and queueing the second transfer behind the first gives the pair the same end.
  // Transfers book the links in the order the engine meets them (an eager send's readiness, a
  // blocking transfer's later end's), which is their order of readiness except where a
  // straggler delay pushes a blocking transfer's start later than a transfer met after it.
  // Returns the transfer's start and end.
  std::pair<double, double> reserve_link(std::int32_t sender, std::int32_t receiver, double ready,
                                         double seconds) {
    double& out = link_out_free_[static_cast<std::size_t>(sender)];
    double& in = link_in_free_[static_cast<std::size_t>(receiver)];
    const double start = std::max({ready, out, in});
    out = in = start + seconds;
    return {start, start + seconds};
  }

  // The receive spans the part of the transfer after it was posted. It ends when the data is
  // there and the receiver is at it (the later of the two, on average later still by their
  // spreads). The data's mean arrival is the transfer's end on the link, its spread the
  // sender's: where the link queue held the transfer back, part of the sender's lateness would
  // be absorbed there, which this does not count. The expected wait holds the receive, not the
  // link: a transfer booked after this one does not wait for it.
  void complete_recv(std::int32_t p, TaskId t, const Sent& sent) {
    const double posted = eligible_[static_cast<std::size_t>(p)][static_cast<std::size_t>(t)];
    const double late = expected_lateness(Arrival{sent.transfer.end_s, sent.spreads.sender_s},
                                          Arrival{posted, sent.spreads.receiver_s});
    const double there = std::max(posted, sent.transfer.end_s);
    schedule(p, t, std::max(posted, sent.transfer.start_s), there + late, there, late);
  }

  void arrive(std::int32_t p, TaskId t, double now) {
    const Task& k = task(p, t);
    const lower::Group& g = program_.groups.at(static_cast<std::size_t>(k.group));
    // Members reach the group's collectives in the same order (one stream per group kind).
    const std::int64_t seq = group_seq_[static_cast<std::size_t>(p)][k.group]++;
    Rendezvous& r = collectives_[{k.group, seq}];
    r.start_s = std::max(r.start_s, now);
    r.members.push_back(Member{p, t, compute_total_[static_cast<std::size_t>(p)]});
    if (r.members.size() < g.programs.size()) return;
    const double wait = jitter_cv_ > 0 ? straggler_wait(r.members, g, k.group) : 0.0;
    const double end = r.start_s + wait + durations_.collective_s(g, k);
    for (const Member& m : r.members) schedule(m.program, m.task, r.start_s, end, r.start_s, wait);
    collectives_.erase({k.group, seq});
  }

  // Stragglers: the slowest of the group's ranks (not programs: a representative stands for
  // several) comes after the others by the spread of the compute each did since its members
  // were last tied, cv times that compute: at the group's last collective, or where a member
  // last exchanged a pipeline transfer with another member (a blocking transfer waits for the
  // later of the two, so a lead or lag from before is spent; an eager send ties only a
  // receiver that was ahead, which this takes as a tie as well). So at pp 2, or with
  // interleaved chunks, the first and last stages' tied-embedding all-reduce follows their last
  // transfers, not a whole step of compute; at pp > 2 without interleaving those two stages
  // exchange nothing directly, and the ties along the stages between them are not followed.
  // The wait is the expected lateness of the last of them past the latest average arrival:
  // E[max of n normals]·cv·T where they arrive together after the same compute T, nothing for
  // a member that arrives long after the others. Each member's compute counts up to its arrival
  // (what it issues while it waits for the others, on other streams, counts towards the next
  // tie). Its arrival is when the collective can start on its side, its stream's previous task
  // done too: one queued behind another collective of its stream counts the compute issued
  // while it queued. The collective is now their last tie, and the last tie of each pair of its
  // members that exchange pipeline transfers (its group's or not).
  double straggler_wait(const std::vector<Member>& members, const lower::Group& g,
                        std::int32_t group) {
    std::vector<std::int32_t> programs;
    for (const Member& m : members) programs.push_back(m.program);
    std::sort(programs.begin(), programs.end());
    auto is_member = [&](std::int32_t p) {
      return std::binary_search(programs.begin(), programs.end(), p);
    };
    // Each program stands for an equal share of the group's ranks.
    const double ranks_each =
        static_cast<double>(g.ranks.size()) / static_cast<double>(members.size());
    std::vector<Arrival> arrivals;
    for (const Member& m : members) {
      const auto i = static_cast<std::size_t>(m.program);
      const auto it = synced_at_[i].find(group);
      double tied = it == synced_at_[i].end() ? 0 : it->second;
      for (const auto& [peer, at] : paired_at_[i]) {
        if (is_member(peer)) tied = std::max(tied, at);
      }
      arrivals.push_back(Arrival{eligible_[i][static_cast<std::size_t>(m.task)],
                                 jitter_cv_ * std::max(0.0, m.issued_s - tied), ranks_each});
    }
    for (const Member& m : members) {
      const auto i = static_cast<std::size_t>(m.program);
      synced_at_[i][group] = m.issued_s;
      for (const std::int32_t peer : peers_[i]) {
        if (is_member(peer)) {
          double& at = paired_at_[i][peer];
          at = std::max(at, m.issued_s);
        }
      }
    }
    return expected_lateness(std::move(arrivals));
  }

  // Stragglers between the two ranks of a transfer: the spread of each's arrival, cv times the
  // compute it did since the pair's previous tie (a transfer, or a collective of both). Where
  // both come at once after the same compute T, the later is e(2)·cv·T late (e(2) = 1/sqrt(pi));
  // a receive posted long before the send is ready waits for the send alone, on average not
  // late. This is their new tie, marked with the compute each has issued when it came: the
  // sender when its send is ready, the receiver when it posted its receive (`receiver_issued`;
  // what it computes while the receive waits, on its compute stream, counts towards the next
  // tie). A receiver not at its receive yet is marked when the send is ready, and may have
  // some of its compute before the receive still to issue (an approximation; marking it where
  // it posts the receive instead would count a wait for each direction of Megatron-LM's
  // paired exchanges, where now the second of the pair, ready at the same moment, finds the
  // two just tied).
  Spreads pair_spreads(std::int32_t sender, std::int32_t receiver, double receiver_issued) {
    const auto s = static_cast<std::size_t>(sender), r = static_cast<std::size_t>(receiver);
    double& sender_tied = paired_at_[s][receiver];
    double& receiver_tied = paired_at_[r][sender];
    const Spreads spreads{jitter_cv_ * std::max(0.0, compute_total_[s] - sender_tied),
                          jitter_cv_ * std::max(0.0, receiver_issued - receiver_tied)};
    sender_tied = compute_total_[s];
    receiver_tied = std::max(receiver_tied, receiver_issued);
    return spreads;
  }
  void finish(std::int32_t p, TaskId t, double now) {
    const Dependents& of = dependents_[static_cast<std::size_t>(p)];
    for (std::uint32_t i = of.begin[static_cast<std::size_t>(t)];
         i < of.begin[static_cast<std::size_t>(t) + 1]; ++i) {
      const TaskId d = of.tasks[i];
      if (--pending_[static_cast<std::size_t>(p)][static_cast<std::size_t>(d)] == 0) {
        eligible(p, d, now);
      }
    }
  }

  // Calls edge(from, to) for each task `to` of `tasks` and each task it waits for: its
  // dependencies, then the previous task of its stream.
  template <typename Edge>
  void for_each_edge(const std::vector<Task>& tasks, Edge edge) const {
    std::array<TaskId, lower::kStreamCount> last{};
    last.fill(-1);
    for (TaskId t = 0; t < static_cast<TaskId>(tasks.size()); ++t) {
      const Task& task = tasks[static_cast<std::size_t>(t)];
      for (TaskId d : task.deps) {
        DTSIM_ASSERT(d >= 0 && d < t, fmt::format("task {} depends on later task {}", t, d));
        edge(d, t);
      }
      // A receive occupies no stream: the sender's transfer carries its time. Without p2p
      // overlap a send leaves the pipeline stream too: it waits for its receiver, and a
      // later send to the other neighbour must not queue behind that wait.
      if (task.kind == TaskKind::Recv) continue;
      if (task.kind == TaskKind::Send && !eager_p2p_) continue;
      auto& prev = last[serial_ ? 0 : static_cast<std::size_t>(task.stream)];
      if (prev >= 0) edge(prev, t);
      prev = t;
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
  std::vector<std::vector<int>> pending_;
  // Per program, the tasks waiting for task t: tasks[begin[t], begin[t + 1]).
  struct Dependents {
    std::vector<std::uint32_t> begin;
    std::vector<TaskId> tasks;
  };
  std::vector<Dependents> dependents_;
  std::vector<std::vector<double>> eligible_;
  std::vector<std::map<std::int32_t, std::int64_t>> group_seq_;
  // A collective instance (group, sequence number) waiting for its members.
  struct Rendezvous {
    double start_s = 0;
    std::vector<Member> members;
  };
  std::map<std::pair<std::int32_t, std::int64_t>, Rendezvous> collectives_;
  std::map<std::tuple<std::int32_t, std::int32_t, std::int64_t>, Sent> sends_;
  std::map<std::tuple<std::int32_t, std::int32_t, std::int64_t>, PostedRecv> recvs_;
  std::map<std::tuple<std::int32_t, std::int32_t, std::int64_t>, WaitingSend> waiting_sends_;
  bool eager_p2p_;
  bool serial_;
  std::function<void(std::uint64_t, std::uint64_t)> progress_;
  // Per program: when its link is next free to send and to receive a pipeline transfer.
  std::vector<double> link_out_free_, link_in_free_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> queue_;
  std::uint64_t seq_ = 0;
  Timeline timeline_;
};

double normal_cdf(double x) {
  return 0.5 * std::erfc(-x / std::numbers::sqrt2);
}
double normal_pdf(double x) {
  return std::exp(-0.5 * x * x) / std::sqrt(2 * std::numbers::pi);
}

}  // namespace

double expected_max_normal(std::int64_t n) {
  if (n <= 1) return 0;
  // Per thread: every collective of a jittered simulation asks, and the planner simulates on
  // many threads; each computes a group size once.
  thread_local std::map<std::int64_t, double> memo;
  if (auto it = memo.find(n); it != memo.end()) return it->second;
  // E[max] = integral of x · n·phi(x)·Phi(x)^(n-1) dx; Simpson's rule on [-12, 12], where the
  // density of the maximum of up to 2^24 normals is negligible outside.
  const int steps = 24000;
  const double lo = -12, hi = 12, h = (hi - lo) / steps;
  const double nd = static_cast<double>(n);
  auto density = [&](double x) { return x * nd * normal_pdf(x) * std::pow(normal_cdf(x), nd - 1); };
  double sum = density(lo) + density(hi);
  for (int i = 1; i < steps; ++i) sum += density(lo + i * h) * (i % 2 == 1 ? 4 : 2);
  const double e = sum * h / 3;
  memo.emplace(n, e);
  return e;
}

double expected_lateness(const Arrival& a, const Arrival& b) {
  const double theta = std::hypot(a.sigma_s, b.sigma_s);
  if (!(theta > 0)) return 0;
  // Clark: E[max] = mu1·Phi(alpha) + mu2·Phi(-alpha) + theta·phi(alpha), alpha = (mu1 - mu2) /
  // theta; less the later mean mu1: theta·(phi(alpha) - alpha·Phi(-alpha)).
  const double alpha = std::abs(a.at_s - b.at_s) / theta;
  return std::max(0.0, theta * (normal_pdf(alpha) - alpha * normal_cdf(-alpha)));
}

double expected_lateness(std::vector<Arrival> arrivals) {
  std::erase_if(arrivals, [](const Arrival& a) { return !(a.ranks > 0); });
  if (arrivals.empty()) return 0;
  double latest = arrivals.front().at_s, widest = 0;
  for (const Arrival& a : arrivals) {
    latest = std::max(latest, a.at_s);
    widest = std::max(widest, a.sigma_s);
  }
  if (!(widest > 0)) return 0;
  // Spreads too narrow for the integral's steps count as none.
  constexpr double kNarrow = 1e-3;
  for (Arrival& a : arrivals) {
    if (a.sigma_s < kNarrow * widest) a.sigma_s = 0;
  }
  // Ranks alike in arrival and spread are one set of ranks.
  std::sort(arrivals.begin(), arrivals.end(), [](const Arrival& a, const Arrival& b) {
    return std::tie(a.at_s, a.sigma_s) < std::tie(b.at_s, b.sigma_s);
  });
  std::vector<Arrival> sets;
  for (const Arrival& a : arrivals) {
    if (!sets.empty() && sets.back().at_s == a.at_s && sets.back().sigma_s == a.sigma_s) {
      sets.back().ranks += a.ranks;
    } else {
      sets.push_back(a);
    }
  }
  if (sets.size() == 1) {
    const double n = sets.front().ranks;
    if (n == std::round(n)) return sets.front().sigma_s * expected_max_normal(std::llround(n));
  }
  if (sets.size() == 2 && sets[0].ranks == 1 && sets[1].ranks == 1) {
    return expected_lateness(sets[0], sets[1]);
  }
  // Ranks without a spread arrive at their mean: the maximum is at least the latest of those.
  // Every other set is past its mean by more than 13 spreads with a negligible probability
  // (6e-39 for one rank, 1e-31 for 2^24 of them).
  constexpr double kTail = 13;
  double lo = -std::numeric_limits<double>::infinity(), hi = lo;
  std::vector<Arrival> spread;
  for (const Arrival& a : sets) {
    if (a.sigma_s == 0) {
      lo = std::max(lo, a.at_s);
    } else {
      spread.push_back(a);
    }
  }
  for (const Arrival& a : spread) {
    lo = std::max(lo, a.at_s - kTail * a.sigma_s);
    hi = std::max(hi, a.at_s + kTail * a.sigma_s);
  }
  // E[max] = lo + the integral over [lo, hi] of P(max > x), where P(max <= x) is the product of
  // each set's Phi((x - at) / sigma)^ranks (Simpson's rule).
  double mean = lo;
  if (hi > lo) {
    auto above = [&](double x) {
      double below = 1;
      for (const Arrival& a : spread)
        below *= std::pow(normal_cdf((x - a.at_s) / a.sigma_s), a.ranks);
      return 1 - below;
    };
    constexpr int kSteps = 4000;
    const double h = (hi - lo) / kSteps;
    double sum = above(lo) + above(hi);
    for (int i = 1; i < kSteps; ++i) sum += above(lo + i * h) * (i % 2 == 1 ? 4 : 2);
    mean += sum * h / 3;
  }
  return std::max(0.0, mean - latest);
}

Timeline run(const lower::Program& program, Durations& durations, const EngineOptions& options) {
  DTSIM_ASSERT(options.slow_program >= -1 &&
                   options.slow_program < static_cast<std::int32_t>(program.ranks.size()) &&
                   options.slow_factor >= 1.0,
               "engine: a slow program out of range, or faster than the others");
  return Engine(program, durations, options).run();
}

}  // namespace dtsim::engine
