// The Program: what every rank does in one training step, as ordered tasks on streams with
// dependencies. Shared by the simulator (which asks cost models how long each task takes) and
// the executor (which runs each task). A task says *what* happens, never how long it takes.
//
// Symmetry: all ranks of one pipeline stage (its tp x cp x dp ranks) run the same tasks, with
// different group members. A Program built with `Lowering::Representatives` holds one
// RankProgram per pipeline stage, standing for all `represents` ranks of that stage; collectives
// inside a stage then involve ranks whose programs, placement (every group of a kind has the
// same shape on a symmetric cluster) and timing are identical, so every member becomes ready at
// the same instant and the representative's timeline is every member's timeline. A Program built
// with `Lowering::AllRanks` has one RankProgram per rank; tests simulate both and compare.
#pragma once

#include <boost/container/small_vector.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "sim/plan/plan.hpp"

namespace dtsim::lower {

// Streams of a rank: compute, and one communication stream per group kind.
enum class Stream : std::uint8_t { Compute, Tp, Cp, Ep, Dp, Pp };
inline constexpr int kStreamCount = 6;

enum class GroupKind : std::uint8_t { Tp, Cp, Ep, Dp, ExpertDp, Pp };

enum class Phase : std::uint8_t {
  Forward,
  Backward,        // input and weight gradients together
  BackwardInput,   // zero-bubble: input gradients only
  BackwardWeight,  // zero-bubble: weight gradients only
  Recompute,       // forward again before backward (selective or full recompute)
  Optimizer,
  // Gradient clipping (plan.clip_grad): the sum of the squares of the rank's gradients
  // (compute, `params` of them read) and the all-reduces of that sum (communication).
  GradNorm,
  None  // other communication tasks
};

// The tasks of the optimizer step, once the gradients are final: the update, and with clipping
// the gradients' norm (Megatron-LM's optimizer.step computes it); no micro-batch's.
inline bool in_optimizer_step(Phase p) {
  return p == Phase::Optimizer || p == Phase::GradNorm;
}

enum class CollectiveKind : std::uint8_t { AllReduce, AllGather, ReduceScatter, AllToAll };

enum class TaskKind : std::uint8_t { Compute, Collective, Send, Recv };

using TaskId = std::int32_t;
// Most tasks wait for one to three others: kept inside the task, not in an allocation of its own
// (a program has millions of tasks).
using Deps = boost::container::small_vector<TaskId, 3>;

struct Task {
  TaskKind kind = TaskKind::Compute;
  Stream stream = Stream::Compute;
  Phase phase = Phase::None;
  std::int32_t micro_batch = -1;
  std::int32_t chunk = -1;  // model chunk of this rank (virtual stage), -1 if none
  // Compute: ModelGraph ops [op_begin, op_end) in the graph's numbering, run in `phase`.
  // Recompute of the attention core only (selective) uses the same range with phase Recompute.
  // Communication: the tensor it carries, named by ops (the executor's meaning of the task):
  // - tp collectives: op_begin is the boundary op; after a row-parallel op or the embedding its
  //   output is reduced (forward), before a column-parallel op the gradient of its input
  //   (backward), after the loss statistics op the vocab-parallel softmax statistics; with sequence
  //   parallelism, a Backward-phase all-gather before a column-parallel op gathers its input
  //   again for the weight gradient;
  // - dp buckets: the gradients of the parameters of ops [op_begin, op_end);
  // - the sequence-parallel norm-gradient all-reduce (tp, no micro-batch): the norms' weight
  //   gradients of ops [op_begin, op_end) (and the routers' under plan::moe_local_dispatch);
  // - ZeRO-3 weight gathers: the weights of ops [op_begin, op_end) (one chunk);
  // - the tied-embedding all-reduce: the gradient of op_begin's embedding matrix;
  // - send / recv: op_begin's output (activations) or its gradient (gradients);
  // - the tp all-reduce of a mixture of experts' gate gradients: op_begin is its experts' up op;
  // - under plan::moe_local_dispatch, a tp all-gather at an experts' up op gathers their input
  //   copies (its reduce-scatter, backward: their gradients), a tp reduce-scatter at an
  //   experts' down op their outputs (its all-gather, backward: their gradients);
  // - ep all-to-alls: the tokens' copies before op_begin's expert up GEMMs (dispatch) or after
  //   its down GEMMs (combine); tag 0 in the forward pass, 1 in the backward.
  // ZeRO-1/2's all-gather of updated weights covers every parameter of the rank (no ops).
  // Gradient clipping's all-reduces (phase GradNorm, no ops) carry the squared norm's sum.
  std::int32_t op_begin = 0;
  std::int32_t op_end = 0;
  // Collective: kind, group (index into Program::groups), payload bytes per rank (the size of
  // the tensor being reduced / gathered, as nccl-tests count it).
  CollectiveKind collective = CollectiveKind::AllReduce;
  std::int32_t group = -1;
  std::uint64_t bytes = 0;
  // A compressed gradient reduction (plan.grad_compression < 1): the bytes before compression,
  // which the codec reads and writes on both ends; 0 when not compressed.
  std::uint64_t uncompressed_bytes = 0;
  // Send / Recv: the peer's RankProgram index and a tag matching the two sides.
  std::int32_t peer = -1;
  std::int64_t tag = -1;
  // Optimizer: parameters this rank updates.
  std::uint64_t params = 0;
  // Optimizer: gradients it clears for the next step (plan::optimizer_clears_gradients: the
  // rank's whole gradient buffer, as Megatron-LM's zero_grad_buffer; dtexec clears it after
  // the update; optimizer_clears_expert_gradients: the experts'), else 0.
  std::uint64_t cleared_params = 0;
  Deps deps;  // tasks of the same rank that must finish first
  // "fwd L8.norm1..L8.attn_out mb0", "tp all-reduce L4 mb2", "dp reduce-scatter bucket 2": a
  // view of its Program's label_text (or of a literal, in a program built by hand).
  std::string_view label;
};

struct Group {
  GroupKind kind = GroupKind::Tp;
  std::vector<std::int64_t> ranks;  // global ranks (devices), in ring order
  // The RankPrograms that take part (with Representatives: only the stage's representative,
  // which stands for all members; with AllRanks: every member).
  std::vector<std::int32_t> programs;
};

struct RankProgram {
  std::int64_t rank = 0;                 // the global rank this program runs on (representative)
  int stage = 0;                         // pipeline stage
  std::vector<std::int64_t> represents;  // global ranks with the same program (incl. `rank`)
  std::vector<Task> tasks;               // in issue order; per stream, tasks run in this order
};

enum class Lowering { Representatives, AllRanks };

// The text of a Program's task labels: in blocks of 64 KiB rather than an allocation per label
// (a program has millions of tasks). Text once kept never moves.
class LabelText {
 public:
  std::string_view keep(std::string_view text);

 private:
  std::vector<std::unique_ptr<char[]>> blocks_;
  char* next_ = nullptr;  // the last block's free bytes: [next_, next_ + left_)
  std::size_t left_ = 0;
};

struct Program {
  plan::Plan plan;
  std::vector<Group> groups;
  std::vector<RankProgram> ranks;
  Lowering lowering = Lowering::Representatives;
  // What the tasks' labels view; copies of the Program share it.
  std::shared_ptr<LabelText> label_text = std::make_shared<LabelText>();
  std::size_t task_count() const;
};

std::string_view to_string(Stream s);
std::string_view to_string(GroupKind k);
std::string_view to_string(Phase p);
std::string_view to_string(CollectiveKind k);
std::string_view to_string(TaskKind k);

}  // namespace dtsim::lower

#include <nlohmann/json_fwd.hpp>

namespace dtsim::lower {
// The Program as JSON (dtsim lower --json): groups, and per rank program its tasks.
nlohmann::json to_json(const Program& program);
}  // namespace dtsim::lower
