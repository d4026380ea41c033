// The breakdown of a step as JSON (DESIGN.md "JSON results": compute_s, recompute_s,
// exposed_comm_s {dp, tp, pp, cp, ep}, bubble_s, optimizer_s; and straggler_wait_s {dp, tp, pp,
// cp, ep}), shared by simulate, plan and dtexec run.
#pragma once

#include <nlohmann/json.hpp>
#include <tuple>

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
                        {"ep", b.exposed_ep_s}}},
                      // (Part of the three compute terms, not a term of its own.)
                      {"overlapped_compute_s", b.overlapped_s}};
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
  b.overlapped_s = j.at("overlapped_compute_s").get<double>();
  using B = engine::Breakdown;
  // Each kind's exposed communication and straggler wait.
  constexpr std::tuple<const char*, double B::*, double B::*> kinds[] = {
      {"dp", &B::exposed_dp_s, &B::straggler_dp_s},
      {"tp", &B::exposed_tp_s, &B::straggler_tp_s},
      {"pp", &B::exposed_pp_s, &B::straggler_pp_s},
      {"cp", &B::exposed_cp_s, &B::straggler_cp_s},
      {"ep", &B::exposed_ep_s, &B::straggler_ep_s}};
  for (const auto& [kind, exposed, waits] : kinds) {
    b.*exposed = j.at("exposed_comm_s").at(kind).get<double>();
    b.*waits = j.at("straggler_wait_s").at(kind).get<double>();
  }
  return b;
}

// One stage's entry of `per_stage`: its stage, the rank it was taken on, its breakdown.
inline nlohmann::json stage_json(const engine::StagePrediction& s, bool predicted = true) {
  return {
      {"stage", s.stage}, {"rank", s.rank}, {"breakdown", breakdown_json(s.breakdown, predicted)}};
}

}  // namespace dtsim::report
