#include "exec/core/in_run.hpp"

#include <algorithm>

#include "sim/cluster/topology.hpp"
#include "sim/plan/memory_model.hpp"

namespace dtsim::exec {

plan::Plan in_run_plan(const model::ModelGraph& graph, Precision precision) {
  plan::Plan p;
  p.dp = 1;
  p.micro_batch_size = graph.micro_batch();
  p.global_batch_size = graph.micro_batch();
  p.seq_len = graph.seq_len();
  p.precision = precision;
  p.attention = graph.attention();
  plan::require_valid(p, graph.spec(), 1);
  return p;
}

std::optional<model::ModelGraph> in_run_graph(const model::ModelSpec& spec,
                                              std::int64_t micro_batch, std::int64_t seq_len,
                                              Precision precision, double capacity_bytes,
                                              std::int64_t max_blocks) {
  plan::MemoryOptions memory;
  memory.framework_overhead_bytes = 0;
  memory.capacity_bytes = capacity_bytes;
  const cluster::Cluster any;  // the capacity above is the only figure the estimate reads
  for (std::int64_t blocks = std::min(spec.layers, max_blocks); blocks >= 1; --blocks) {
    model::ModelSpec part = spec;
    part.layers = blocks;
    model::ModelGraph graph(part, micro_batch, seq_len,
                            plan::activation_bytes_per_element(precision));
    if (plan::estimate_memory(graph, in_run_plan(graph, precision), any, memory).fits) {
      return graph;
    }
  }
  return std::nullopt;
}

}  // namespace dtsim::exec
