// The breakdown of a step as JSON (DESIGN.md "JSON results": compute_s, recompute_s,
// exposed_comm_s {dp, tp, pp, cp, ep}, bubble_s, optimizer_s), shared by simulate and plan.
#pragma once

#include <nlohmann/json.hpp>

#include "sim/engine/simulator.hpp"

namespace dtsim::report {

inline nlohmann::json breakdown_json(const engine::Breakdown& b) {
  return {{"compute_s", b.compute_s},
          {"recompute_s", b.recompute_s},
          {"optimizer_s", b.optimizer_s},
          {"bubble_s", b.bubble_s},
          {"exposed_comm_s",
           {{"dp", b.exposed_dp_s},
            {"tp", b.exposed_tp_s},
            {"pp", b.exposed_pp_s},
            {"cp", b.exposed_cp_s},
            {"ep", b.exposed_ep_s}}}};
}

// One stage's entry of `per_stage`: its stage, the rank it was taken on, its breakdown.
inline nlohmann::json stage_json(const engine::StagePrediction& s) {
  return {{"stage", s.stage}, {"rank", s.rank}, {"breakdown", breakdown_json(s.breakdown)}};
}

}  // namespace dtsim::report
