#include "exec/core/p2p_order.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <map>
#include <utility>
#include <vector>

namespace dtsim::exec {

std::optional<std::string> untagged_p2p_mismatch(const lower::Program& program) {
  using Pair = std::pair<std::int64_t, std::int64_t>;       // (sender, receiver) global ranks
  using Transfer = std::pair<std::int64_t, std::uint64_t>;  // tag, bytes
  std::map<Pair, std::vector<Transfer>> sent, received;
  for (const auto& rp : program.ranks) {
    for (const auto& t : rp.tasks) {
      if (t.kind != lower::TaskKind::Send && t.kind != lower::TaskKind::Recv) continue;
      const std::int64_t peer = program.ranks.at(static_cast<std::size_t>(t.peer)).rank;
      if (t.kind == lower::TaskKind::Send) {
        sent[{rp.rank, peer}].emplace_back(t.tag, t.bytes);
      } else {
        received[{peer, rp.rank}].emplace_back(t.tag, t.bytes);
      }
    }
  }
  auto describe = [](const Pair& pair, const std::vector<Transfer>& s,
                     const std::vector<Transfer>& r) {
    std::size_t i = 0;
    while (i < s.size() && i < r.size() && s[i] == r[i]) ++i;
    auto what = [](const std::vector<Transfer>& v, std::size_t k) {
      return k < v.size() ? fmt::format("tag {} of {} bytes", v[k].first, v[k].second)
                          : std::string("nothing");
    };
    return fmt::format(
        "rank {} sends {} tensors to rank {}, which receives {}; transfer {} differs ({} sent, "
        "{} received)",
        pair.first, s.size(), pair.second, r.size(), i, what(s, i), what(r, i));
  };
  static const std::vector<Transfer> none;
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
