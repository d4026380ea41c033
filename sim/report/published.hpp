// Published experiments re-run through dtsim with catalog defaults and no per-row tuning: the
// predictions that bench/dtsim_validation prints and the tests check (validation/*.csv).
#pragma once

#include <string>
#include <string_view>

#include "sim/common/csv.hpp"
#include "sim/engine/simulator.hpp"

namespace dtsim::report {

// One GPT block as in Korthikanti et al. 2022 (Table 3's 22B model: h 6144, 64 heads of 96,
// GELU MLP of 4h, dropout, learned positions): Megatron's GPT family at that size, one layer.
model::ModelSpec korthikanti_22b_spec();

struct LayerTimes {
  double forward_s = 0;
  double backward_s = 0;  // with the recompute, as Table 4 counts it
};

// Korthikanti et al. 2022, Table 4: one GPT 22B layer (h 6144, 64 heads, sequence 2048,
// micro-batch 4) on 8 A100 of Selene with tp 8. The compute cost of the layer's ops plus its
// tensor-parallel collectives: per pass two all-reduces, or with sequence parallelism two
// all-gathers and two reduce-scatters. Full recompute adds the forward to the backward,
// selective the attention core's forward.
LayerTimes korthikanti_22b_layer(plan::Recompute recompute, bool sequence_parallel);

// Table 4's "recompute" column ("none, no SP", "selective + SP", "full, no SP", ...).
struct Table4Setting {
  plan::Recompute recompute = plan::Recompute::None;
  bool sequence_parallel = false;
};
Table4Setting table4_setting(std::string_view column);

// Narayanan et al. SC'21, Table 1: one row's run (validation/megatron_sc21_table1.csv, metric
// achieved_tflops_per_gpu) on Selene. The plan: the paper's tp, pp, dp, global batch and
// sequence; micro-batch 1 with pipelining and 4 without (Table 1 does not say; Korthikanti et
// al. 2022, Table 3, the same group on the same cluster, does so); full recompute; interleaved
// 1F1B with the smallest v >= 2 that gives equal chunks (1F1B without pipelining); pipeline
// transfers scattered and gathered over tp (Sec. 4.1); Megatron-LM of 2021 otherwise: dp
// gradients all-reduced after the last backward pass (megatron/training.py, train_step), tp
// input-gradient all-reduces after the weight gradients, weight gradients accumulated by a
// kernel of their own.
struct Table1Case {
  std::string model;  // models/<name>.json
  model::ModelSpec spec;
  cluster::Cluster cluster;  // Selene, the row's GPUs
  plan::Plan plan;           // valid for spec and cluster
};
Table1Case megatron_table1_case(const CsvRow& row);

// The case simulated (analytical network).
engine::Prediction simulate_case(const Table1Case& c);

struct Table1Run {
  std::string model;
  plan::Plan plan;
  engine::Prediction prediction;
};
Table1Run megatron_table1_run(const CsvRow& row);

// Llama Team 2024, "The Llama 3 Herd of Models", Table 4: Llama 3 405B pre-training on 8,192
// and 16,384 H100s of Meta's RoCE cluster (topologies/h100-roce.json, from the same paper), one
// row of validation/llama3_table4_scaling.csv (metric achieved_tflops_per_gpu). The paper gives
// tp, cp, pp, dp and the batch; what it leaves out (the schedule and its virtual stages, the
// ZeRO stage, recompute, the micro-batch) dtsim's planner chooses among the plans that fit in
// 80 GB, at those degrees, with FlashAttention (assumed: the paper does not name its kernel). The
// 131,072-token row runs models/llama3.1-405b.json (the same model with Llama 3.1's context).
struct Llama3Table4Run {
  plan::Plan plan;
  engine::Prediction prediction;
  // Model TFLOP/s per GPU with the attention core counted causal (half of its dense FLOPs): the
  // paper does not say which count its figures use.
  double causal_model_tflops_per_gpu = 0;
};
Llama3Table4Run llama3_table4_run(const CsvRow& row);

}  // namespace dtsim::report
