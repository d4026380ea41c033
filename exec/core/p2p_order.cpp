#include "exec/core/p2p_order.hpp"

#include <fmt/format.h>

#include <map>
#include <utility>
#include <vector>

namespace dtsim::exec {

std::optional<std::string> untagged_p2p_mismatch(const lower::Program& program) {
  using Pair = std::pair<std::int64_t, std::int64_t>;  // (sender, receiver) global ranks
  std::map<Pair, std::vector<std::int64_t>> sent, received;
  for (const auto& rp : program.ranks) {
    for (const auto& t : rp.tasks) {
      if (t.kind != lower::TaskKind::Send && t.kind != lower::TaskKind::Recv) continue;
      const std::int64_t peer = program.ranks.at(static_cast<std::size_t>(t.peer)).rank;
      if (t.kind == lower::TaskKind::Send) {
        sent[{rp.rank, peer}].push_back(t.tag);
      } else {
        received[{peer, rp.rank}].push_back(t.tag);
      }
    }
  }
  auto describe = [](const Pair& pair, const std::vector<std::int64_t>& s,
                     const std::vector<std::int64_t>& r) {
    std::size_t i = 0;
    while (i < s.size() && i < r.size() && s[i] == r[i]) ++i;
    return fmt::format(
        "rank {} sends {} tensors to rank {}, which receives {}; transfer {} differs (tag {} "
        "sent, tag {} received)",
        pair.first, s.size(), pair.second, r.size(), i,
        i < s.size() ? fmt::format("{}", s[i]) : std::string("none"),
        i < r.size() ? fmt::format("{}", r[i]) : std::string("none"));
  };
  static const std::vector<std::int64_t> none;
  for (const auto& [pair, tags] : sent) {
    const auto it = received.find(pair);
    const auto& got = it == received.end() ? none : it->second;
    if (got != tags) return describe(pair, tags, got);
  }
  for (const auto& [pair, tags] : received) {
    if (!sent.contains(pair)) return describe(pair, none, tags);
  }
  return std::nullopt;
}

}  // namespace dtsim::exec
