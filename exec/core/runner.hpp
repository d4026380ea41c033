// The Program runner: executes the tasks of a lowered Program on real tensors on a Device
// (exec/core/device.hpp: the CPU's fp32 kernels today), and times each task. It interprets the same
// Program the simulator predicts (compute tasks are ModelGraph op ranges in a phase; communication
// tasks name the tensors they carry), so a measurement joins the prediction task by task (dtsim
// validate).
//
// One runner per rank; a Comm (exec/core/comm.hpp) carries its collectives and transfers:
// - data parallelism: gradient buckets all-reduced (ZeRO-0) or reduce-scattered (ZeRO >= 1)
//   over the dp group; under ZeRO >= 1 each dp rank updates its slice of every tensor (AdamW is
//   element-wise) and the updated weights are all-gathered (ZeRO-1/2 after the step, ZeRO-3
//   per chunk before each pass);
// - tensor parallelism (Megatron-LM): vocab-parallel embedding, column-parallel QKV and MLP-up,
//   row-parallel attention-out and MLP-down (their bias added once), vocab-parallel head and
//   cross-entropy; the all-reduces of the Program at the f/g points, or with sequence
//   parallelism its all-gathers and reduce-scatters (norms and residuals on 1/tp of the
//   tokens, their weight gradients all-reduced over tp);
// - pipeline parallelism: activations and gradients sent between stages (GPipe, 1F1B,
//   interleaved 1F1B, zero-bubble with its separate input- and weight-gradient passes), and
//   the tied embedding's gradients all-reduced between the first and last stage.
// Memory follows the plan: a rank holds its tensor-parallel share of the weights, gradients
// and AdamW state as its ZeRO stage shards them (stage 1: the AdamW state of its dp slice;
// 2: gradients only from a micro-batch's first weight gradient to their bucket's
// reduce-scatter; 3: the fp32 master of its slice, the whole weights from the Program's
// all-gather to the last task that reads them), and a micro-batch's tensors only until the
// last event of the step that reads them (an op of a compute task, or a communication task),
// so that recompute keeps what its checkpoints keep. The device counts the tensor bytes it
// hands out (Device::memory_use), which `dtexec run` sets against dtsim memory's prediction.
//
// Not executed yet (refused with a message): context parallelism, experts,
// the PipeDream (asynchronous) schedule, dropout.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "exec/core/comm.hpp"
#include "exec/core/device.hpp"
#include "exec/core/lr_schedule.hpp"
#include "sim/lower/program.hpp"
#include "sim/model/model_graph.hpp"

namespace dtsim::exec {

struct CheckpointRecord;

struct RunOptions {
  int steps = 10;        // the step number to stop after (counted from the first step ever)
  int warmup_steps = 1;  // steps of this run left out of the median step time
  LrSchedule lr;         // the learning rate of each step
  // AdamW's decoupled weight decay, on matrices and embedding tables (not biases or norms).
  float weight_decay = 0.0f;
  std::uint64_t seed = 1234;
  std::string checkpoint_dir;  // where to write checkpoints ("" = none)
  int checkpoint_every = 0;    // steps between checkpoints (0 = only after the last step)
  // Save asynchronously: training stops only while each rank copies its pieces to host memory
  // (a copy it keeps from one save to the next); a thread of the rank writes its shard while
  // the next steps run, and the index that puts the checkpoint in place is written at the end
  // of the first step by which every rank's shard is written (a save still writing when the
  // next one is due is waited for).
  bool checkpoint_async = false;
  std::string resume_dir;  // a checkpoint to continue from ("" = start at step 0)
  // Fault injection (tests): rank fail_rank kills itself with SIGKILL as step fail_step (1-based)
  // starts, as a crashed node would.
  int fail_rank = -1, fail_step = 0;
  // A task that runs longer than this (a collective whose peers never come, a hung transfer)
  // ends the run: on_hang is called with a message naming the rank, the task and the time,
  // from a watchdog thread (the CLI aborts every rank). 0: no watchdog.
  double task_timeout_s = 0;
  // The same for a checkpoint's save (its shards' writes and the ranks' agreement on them; an
  // asynchronous save's putting in place). 0: not watched.
  double checkpoint_timeout_s = 0;
  std::function<void(const std::string&)> on_hang;
  // A hang on purpose (tests): rank hang_rank stops answering as step hang_step starts, or with
  // hang_in_checkpoint, as it writes the checkpoint after that step.
  int hang_rank = -1, hang_step = 0;
  bool hang_in_checkpoint = false;
  // Called on every rank after each step with the step number (1-based), its mean loss, the
  // slowest rank's time (both reduced over all ranks, outside the step's timing) and, with
  // gradient clipping, the gradients' global norm before clipping (else -1): progress.
  std::function<void(int, double, double, double)> on_step;
  // Called on every rank when a checkpoint is in place (progress; the bytes on rank 0 only).
  std::function<void(const CheckpointRecord&)> on_checkpoint;
  // --only-rank: run program `program_index` alone (one rank's share of a plan whose other
  // ranks do not run), every communication task replaced by a wait of its predicted length
  // (predicted_comm_s, by task id; empty: no wait). Received tensors hold made-up values
  // (standard normal, not zeros, whose GEMMs draw less power and run faster), reductions keep
  // the local values, so losses mean nothing; compute times are real.
  int program_index = -1;  // -1: comm.rank()
  bool replay_communication = false;
  std::vector<double> predicted_comm_s;
  // Tests: keep each tensor of a micro-batch until the micro-batch's last task instead of
  // releasing it once nothing later reads it (the numbers must be the same).
  bool keep_tensors = false;
};

struct TaskRecord {
  std::int64_t rank = 0;
  std::int32_t task = 0;
  double start_s = 0;  // from the start of the run
  double end_s = 0;
  int step = 0;
};

// A checkpoint this run wrote: after which step, how long it took (each rank writing its
// shard, then rank 0 the index; asynchronous: from the copy to host memory to its index), and
// on rank 0 the bytes of the shards and their number.
struct CheckpointRecord {
  int step = 0;
  double seconds = 0;
  std::uint64_t bytes = 0;
  int shards = 0;
  // Of `seconds`, the copy of the tensors to host memory before they are written: the slowest
  // rank's, and the lowest rate of a rank (bytes per second) among those that copied any.
  double copy_s = 0;
  double copy_bytes_per_s = 0;
  // What training stopped for (the slowest rank's): the whole save when synchronous; when
  // asynchronous, the wait for the save before it still writing, the copy and the gather that
  // puts it in place. write_s: the slowest rank's time writing its shard (asynchronous: behind
  // training). in_place_after: the step at whose end it was put in place (the step itself
  // when synchronous), a crash before which leaves the checkpoint before it.
  bool asynchronous = false;
  double blocking_s = 0;
  double write_s = 0;
  int in_place_after = 0;
};

struct RunResult {
  int first_step = 0;                // 0, or the step a resumed run started at
  std::vector<double> losses;        // mean loss of every step so far (all ranks agree)
  std::vector<double> step_times_s;  // wall time of each step of this run (slowest rank)
  // When this rank began each step of this run, from the start of the run (TaskRecord's clock;
  // index: step - first_step).
  std::vector<double> step_begins_s;
  // That clock's zero on the host's steady clock (seconds since its epoch): ranks on one host
  // share it, so their times can be put on one clock (on several, with Comm::clock_offsets).
  double clock_origin_s = 0;
  // With gradient clipping (plan.clip_grad): each step's global gradient norm before clipping
  // (of this run's steps; with --only-rank this rank's share alone).
  std::vector<double> grad_norms;
  std::vector<CheckpointRecord> checkpoints;
  // Asynchronous saves: the host copy of the busiest rank (bytes) and the longest time a rank
  // took to allocate and touch it, before the first step.
  double checkpoint_host_bytes = 0, checkpoint_host_seconds = 0;
  double step_time_s = 0;         // median after warm-up
  std::vector<TaskRecord> tasks;  // this rank's tasks of every step after warm-up
  // Expert parallelism: the token copies this rank's experts got, over the even share
  // (micro-batch tokens x top_k), on average over a micro-batch's MoE blocks: the mean over
  // micro-batches (what its experts compute and receive, on average) and the largest (what
  // they keep at once, at most). 1 when routing is even, as dtsim assumes by default
  // (plan.expert_load); 0 without ep.
  double expert_load = 0;
  double expert_load_peak = 0;
  // --only-rank: the bytes of the values replayed receives copy (one transfer's tensor, held
  // from the first replayed receive to the end: in the peak, and in no plan's).
  double replay_input_bytes = 0;
};

// Throws UnsupportedError naming what the runner does not execute in this model or plan (every
// rank reaches the same verdict, so it can be asked before any communication).
void check_runnable(const model::ModelGraph& graph, const lower::Program& program,
                    bool one_program_alone = false);
// What a run of this model and plan does that a reader of its figures should know (dropout's
// rate, how experts are routed, how context parallelism splits the sequences), one line each.
std::vector<std::string> execution_notes(const model::ModelSpec& spec, const plan::Plan& plan);
// The same for what `device` lacks (context parallelism, dropout, a mixture of experts: the CPU
// device has them, a GPU not yet); asked once the device is made, before any communicator.
void check_device(const model::ModelGraph& graph, const lower::Program& program,
                  const Device& device);

struct CheckpointInfo;  // exec/core/checkpoint.hpp

// Throws InputError naming the field where resuming the checkpoint `c` (read from `where`) with
// this run's model, options and clip_grad would not continue the run that wrote it (another
// model, seed, learning rate or schedule, weight decay or clipping), or where --steps or a
// fault step leaves nothing to do. Runner::resume asks it; dtexec run asks it first, before it
// says anything of the run.
// Why a checkpoint whose embedding and LM head have `rows` rows (`what`: where that is said)
// cannot continue under `plan`'s padding of a vocabulary of `vocab`, and the
// --make-vocab-size-divisible-by that pads as it did: the checkpoint's own
// (`written_multiple`: its multiple x its tp, where known) if it does at this tp, else the
// largest that does.
std::string vocab_padding_refusal(const std::string& what, std::int64_t rows, std::int64_t vocab,
                                  const plan::Plan& plan, std::int64_t written_multiple = 0);

void check_resume(const CheckpointInfo& c, const std::string& where, const model::ModelSpec& model,
                  const RunOptions& options, double clip_grad);

// Runs this rank's program (program.ranks[comm.rank()]) on `device`. A single-rank plan may use
// any lowering; a multi-rank plan needs Lowering::AllRanks and a Comm with one rank per device.
// The communication backends move host memory (MPI): a device whose memory is not the host's
// runs single-program plans only, until a Comm moves device memory. Task times: the host's
// clock around each task on the CPU; on a device that queues work (a GPU), its marks (CUDA
// events) around each task, read when the step is done, so the step has no wait inside it
// (but before --only-rank's predicted waits, which follow the queued work).
// Throws UnsupportedError for plans or models this runner does not execute yet.
RunResult run_program(const model::ModelGraph& graph, const lower::Program& program,
                      const RunOptions& options, Comm& comm, Device& device);
// The same on the CPU (exec/cpu/device.hpp).
RunResult run_program(const model::ModelGraph& graph, const lower::Program& program,
                      const RunOptions& options, Comm& comm);

}  // namespace dtsim::exec
