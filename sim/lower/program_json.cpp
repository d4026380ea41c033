#include <nlohmann/json.hpp>

#include "sim/lower/program.hpp"

namespace dtsim::lower {

nlohmann::json to_json(const Program& program) {
  using nlohmann::json;
  json groups = json::array();
  for (std::size_t i = 0; i < program.groups.size(); ++i) {
    const Group& g = program.groups[i];
    groups.push_back({{"id", i}, {"kind", to_string(g.kind)}, {"ranks", g.ranks}});
  }
  json ranks = json::array();
  for (const RankProgram& rp : program.ranks) {
    json tasks = json::array();
    for (std::size_t i = 0; i < rp.tasks.size(); ++i) {
      const Task& t = rp.tasks[i];
      json task = {{"id", i},
                   {"kind", to_string(t.kind)},
                   {"stream", to_string(t.stream)},
                   {"label", t.label},
                   {"deps", t.deps}};
      if (t.micro_batch >= 0) task["micro_batch"] = t.micro_batch;
      if (t.chunk >= 0) task["chunk"] = t.chunk;
      switch (t.kind) {
        case TaskKind::Compute:
          task["phase"] = to_string(t.phase);
          if (in_optimizer_step(t.phase)) {
            task["params"] = t.params;
            if (t.cleared_params > 0) task["cleared_params"] = t.cleared_params;
          } else {
            task["ops"] = {t.op_begin, t.op_end};
          }
          break;
        case TaskKind::Collective:
          task["collective"] = to_string(t.collective);
          task["group"] = t.group;
          task["bytes"] = t.bytes;
          if (t.uncompressed_bytes > 0) task["uncompressed_bytes"] = t.uncompressed_bytes;
          if (t.op_end > t.op_begin) task["ops"] = {t.op_begin, t.op_end};
          // Gradient clipping's all-reduces of the squared norm (no tensor of ops).
          if (t.phase == Phase::GradNorm) task["phase"] = to_string(t.phase);
          break;
        case TaskKind::Send:
        case TaskKind::Recv:
          task["peer"] = program.ranks.at(static_cast<std::size_t>(t.peer)).rank;
          task["tag"] = t.tag;
          task["bytes"] = t.bytes;
          task["ops"] = {t.op_begin, t.op_end};
          break;
      }
      tasks.push_back(std::move(task));
    }
    ranks.push_back({{"rank", rp.rank},
                     {"stage", rp.stage},
                     {"represents", rp.represents.size()},
                     // (The ranks themselves, as a trace's process_name "represents" lists them;
                     // represents stays their count, as it always was.)
                     {"represented_ranks", rp.represents},
                     {"tasks", std::move(tasks)}});
  }
  return {
      {"lowering", program.lowering == Lowering::Representatives ? "representatives" : "all_ranks"},
      {"groups", std::move(groups)},
      {"ranks", std::move(ranks)}};
}

}  // namespace dtsim::lower
