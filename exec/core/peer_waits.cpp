#include "exec/core/peer_waits.hpp"

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <tuple>
#include <utility>

#include "sim/common/error.hpp"

namespace dtsim::exec {

void start_when_peers_ready(const lower::Program& program,
                            std::vector<std::vector<TaskSpan>>& spans) {
  DTSIM_ASSERT(spans.size() == program.ranks.size(), "one list of spans per program");
  using Party = std::pair<std::size_t, std::size_t>;  // program, task
  // Each: the tasks that start together (a transfer: its send, then its receive).
  std::vector<std::vector<Party>> parties;
  // Sends waiting for their receive, per (sender, receiver, tag), in program order; and the
  // receives waiting for their send.
  std::map<std::tuple<std::size_t, std::size_t, std::int64_t>, std::deque<std::size_t>> sends,
      recvs;
  std::map<std::pair<std::int32_t, std::int64_t>, std::size_t> collectives;  // (group, k) -> at
  for (std::size_t p = 0; p < program.ranks.size(); ++p) {
    const auto& tasks = program.ranks[p].tasks;
    DTSIM_ASSERT(spans[p].size() == tasks.size(), "one span per task");
    std::map<std::int32_t, std::int64_t> seen;  // group -> collectives of it so far
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      const lower::Task& t = tasks[i];
      if (t.kind == lower::TaskKind::Collective) {
        const auto [it, fresh] =
            collectives.try_emplace({t.group, seen[t.group]++}, parties.size());
        if (fresh) parties.emplace_back();
        parties[it->second].emplace_back(p, i);
      } else if (t.kind == lower::TaskKind::Send || t.kind == lower::TaskKind::Recv) {
        const bool send = t.kind == lower::TaskKind::Send;
        const auto peer = static_cast<std::size_t>(t.peer);
        const auto key = send ? std::make_tuple(p, peer, t.tag) : std::make_tuple(peer, p, t.tag);
        auto& other = send ? recvs[key] : sends[key];
        if (other.empty()) {
          (send ? sends : recvs)[key].push_back(i);
          continue;
        }
        const Party mine{p, i}, theirs{peer, other.front()};
        parties.push_back(send ? std::vector<Party>{mine, theirs}
                               : std::vector<Party>{theirs, mine});
        other.pop_front();
      }
    }
  }
  const bool eager_sends = program.plan.overlap_p2p_comm;
  auto kind = [&](const Party& party) {
    return program.ranks[party.first].tasks[party.second].kind;
  };
  for (const auto& together : parties) {
    double latest = -1e300;
    bool any = false;
    for (const auto& [p, i] : together) {
      const TaskSpan& s = spans[p][i];
      if (!s.timed) continue;
      latest = std::max(latest, s.start_s);
      any = true;
    }
    if (!any) continue;
    for (const auto& [p, i] : together) {
      TaskSpan& s = spans[p][i];
      if (!s.timed || (eager_sends && kind({p, i}) == lower::TaskKind::Send)) {
        continue;
      }
      s.start_s = std::min(std::max(s.start_s, latest), s.end_s);
    }
    // A blocking send ends with its transfer, when its receive has the data: the runner sees
    // it done only where it next waits for its sends, which can be after later tasks.
    if (kind(together.front()) == lower::TaskKind::Send && !eager_sends) {
      TaskSpan& send = spans[together[0].first][together[0].second];
      const TaskSpan& recv = spans[together[1].first][together[1].second];
      if (send.timed && recv.timed) {
        send.end_s = std::max(send.start_s, std::min(send.end_s, recv.end_s));
      }
    }
  }
}

void leave_out_compute(const lower::Program& program, std::vector<std::vector<TaskSpan>>& spans) {
  DTSIM_ASSERT(spans.size() == program.ranks.size(), "one list of spans per program");
  for (std::size_t p = 0; p < program.ranks.size(); ++p) {
    const auto& tasks = program.ranks[p].tasks;
    DTSIM_ASSERT(spans[p].size() == tasks.size(), "one span per task");
    // The rank's timed compute, in order of start (a rank runs one task at a time).
    std::vector<std::pair<double, double>> compute;
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      if (tasks[i].kind == lower::TaskKind::Compute && spans[p][i].timed) {
        compute.emplace_back(spans[p][i].start_s, spans[p][i].end_s);
      }
    }
    std::sort(compute.begin(), compute.end());
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      TaskSpan& s = spans[p][i];
      if (tasks[i].kind != lower::TaskKind::Collective || !s.timed) continue;
      double inside = 0;
      auto c = std::lower_bound(compute.begin(), compute.end(), std::make_pair(s.start_s, -1e300));
      for (; c != compute.end() && c->first < s.end_s; ++c) {
        if (c->second <= s.end_s) inside += c->second - c->first;
      }
      s.start_s = std::min(s.start_s + inside, s.end_s);
    }
  }
}

}  // namespace dtsim::exec
