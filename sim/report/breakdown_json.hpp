// The breakdown of a step as JSON (DESIGN.md "JSON results": compute_s, recompute_s,
// exposed_comm_s {dp, tp, pp, cp, ep}, bubble_s, optimizer_s; and straggler_wait_s {dp, tp, pp,
// cp, ep}), shared by simulate, plan and dtexec run.
#pragma once

#include <nlohmann/json.hpp>

#include "sim/engine/simulator.hpp"

namespace dtsim::report {

// `predicted`: the straggler model's waits are told apart from the communication; a measured
// breakdown (dtexec run) has its waits for peers in bubble_s, not told apart: straggler_wait_s
// null.
inline nlohmann::json breakdown_json(const engine::Breakdown& b, bool predicted = true) {
  nlohmann::json j = {{"compute_s", b.compute_s},
                      {"recompute_s", b.recompute_s},
                      {"optimizer_s", b.optimizer_s},
                      {"bubble_s", b.bubble_s},
                      {"exposed_comm_s",
                       {{"dp", b.exposed_dp_s},
                        {"tp", b.exposed_tp_s},
                        {"pp", b.exposed_pp_s},
                        {"cp", b.exposed_cp_s},
                        {"ep", b.exposed_ep_s}}}};
  j["straggler_wait_s"] = predicted ? nlohmann::json{{"dp", b.straggler_dp_s},
                                                     {"tp", b.straggler_tp_s},
                                                     {"pp", b.straggler_pp_s},
                                                     {"cp", b.straggler_cp_s},
                                                     {"ep", b.straggler_ep_s}}
                                    : nlohmann::json(nullptr);
  return j;
}

// A breakdown read back from breakdown_json's (predicted) form.
inline engine::Breakdown breakdown_from_json(const nlohmann::json& j) {
  engine::Breakdown b;
  b.compute_s = j.at("compute_s").get<double>();
  b.recompute_s = j.at("recompute_s").get<double>();
  b.optimizer_s = j.at("optimizer_s").get<double>();
  b.bubble_s = j.at("bubble_s").get<double>();
  const auto& comm = j.at("exposed_comm_s");
  b.exposed_dp_s = comm.at("dp").get<double>();
  b.exposed_tp_s = comm.at("tp").get<double>();
  b.exposed_pp_s = comm.at("pp").get<double>();
  b.exposed_cp_s = comm.at("cp").get<double>();
  b.exposed_ep_s = comm.at("ep").get<double>();
  const auto& waits = j.at("straggler_wait_s");
  b.straggler_dp_s = waits.at("dp").get<double>();
  b.straggler_tp_s = waits.at("tp").get<double>();
  b.straggler_pp_s = waits.at("pp").get<double>();
  b.straggler_cp_s = waits.at("cp").get<double>();
  b.straggler_ep_s = waits.at("ep").get<double>();
  return b;
}

// One stage's entry of `per_stage`: its stage, the rank it was taken on, its breakdown.
inline nlohmann::json stage_json(const engine::StagePrediction& s, bool predicted = true) {
  return {
      {"stage", s.stage}, {"rank", s.rank}, {"breakdown", breakdown_json(s.breakdown, predicted)}};
}

}  // namespace dtsim::report
