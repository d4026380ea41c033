// Checkpoints of dtexec runs: the tensors of the model with their AdamW state, the step reached
// and every step's loss, whatever the plan that wrote them, so that a run can resume under the
// same plan or another one (its tensors resharded) and two runs with different plans can be
// compared.
//
// On disk, a folder: `checkpoint.json` (format, model, plan, step, seed, learning rate and its
// schedule, weight decay, losses, the full tensors' names and shapes, and the shards) and one
// shard file per rank that holds something, `rank-NNNNN.bin`. Every rank writes its own shard
// (no rank gathers the others' tensors); a shard is a list of pieces, each a range of a rank's
// slice of one tensor (exec/core/slice.hpp): its weights, then AdamW's m, then v, little-endian
// fp32. `checkpoint.json` says where each piece lies and which elements of the full tensor it
// holds, so that a reader assembles any tensor from the shards of any plan. A checkpoint is
// written to a sibling temporary folder and renamed into place, so a reader never sees half of
// one. The folder must be on a file system that every rank sees. Checkpoints of the first
// format (one `tensors.bin` of whole tensors, written by rank 0) are still read.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "exec/core/slice.hpp"

namespace dtsim::exec {

struct CheckpointTensor {
  std::string name;                 // "<op name>.weight" or "<op name>.bias"
  std::vector<std::int64_t> shape;  // full, unsharded
  std::vector<float> data, m, v;    // product(shape) each
};

// Whether a tensor holds what training can leave: finite weights and AdamW moments, second
// moments >= 0 (else a damaged shard, which resuming and comparing refuse).
bool trainable(const CheckpointTensor& t);

// A checkpoint but for its tensors' values.
struct CheckpointInfo {
  std::string model;
  // What the model computes with beyond its tensors' names and shapes (model::architecture_json
  // less dropout, which `dropout` holds, and max_positions, which RoPE does not compute with:
  // a Hugging Face config edited under the same name, its top_k or rope_theta changed); null
  // in checkpoints written before it was recorded.
  nlohmann::json architecture;
  nlohmann::json plan;
  int step = 0;  // steps completed
  std::uint64_t seed = 0;
  double learning_rate = 0;  // the schedule's max_lr
  double weight_decay = 0;   // AdamW's (0 in checkpoints written before it was recorded)
  // The learning-rate schedule (exec/core/lr_schedule.hpp's JSON); null in checkpoints written
  // before schedules (a constant learning_rate).
  nlohmann::json lr_schedule;
  // Whether it trained with the model's dropout (false under --no-dropout, or for a model
  // without any); unset in checkpoints written before it was recorded.
  std::optional<bool> dropout;
  std::vector<double> losses;  // one per completed step
};

struct Checkpoint : CheckpointInfo {
  std::vector<CheckpointTensor> tensors;
};

// The folder a checkpoint is written to, as given (`flag` names it in messages): "ck/" is "ck".
// Throws InputError for an empty path, or one without a folder name of its own ("/", ".").
std::string checkpoint_folder(const std::string& given, const std::string& flag);

// Checks before a run that a checkpoint can be written to `dir` (checkpoint_folder's): its
// parent folder exists and takes a new folder, and DIR, DIR.tmp and DIR.old are each absent or a
// folder that a checkpoint writer made (only checkpoint.json, tensors.bin and rank-NNNNN.bin
// files), since writing one replaces them. Throws InputError naming `flag` otherwise.
void check_checkpoint_folder(const std::string& dir, const std::string& flag);

// Whether `path` is in checkpoint folder `dir` (checkpoint_folder's), DIR.tmp or DIR.old, or is
// one of them: a file written there would be lost when a checkpoint replaces the folder, or
// overwrite the checkpoint's own files.
bool in_checkpoint_folders(const std::string& dir, const std::string& path);

// Writing a checkpoint from many ranks, each its own shard:
//   1. rank 0: begin_checkpoint(dir), a clean DIR.tmp; then a barrier;
//   2. every rank: a ShardWriter adds its pieces and close() gives their index;
//   3. rank 0, with every rank's index: finish_checkpoint writes checkpoint.json and renames
//      DIR.tmp to DIR.
void begin_checkpoint(const std::string& dir);

class ShardWriter {
 public:
  // The shard of `rank` in DIR.tmp (its file is made at the first piece).
  ShardWriter(const std::string& dir, int rank);
  // Elements [begin, begin + weights.size()) of `slice` of tensor `name` (full shape
  // slice.rows x slice.cols): weights and AdamW's m and v, one value each per element.
  void add(const std::string& name, const Slice& slice, std::int64_t begin,
           std::span<const float> weights, std::span<const float> m, std::span<const float> v);
  // Flushes the file; returns the shard's index (null when nothing was added). Throws
  // InputError when the file cannot be written.
  nlohmann::json close();

 private:
  std::string folder_, file_;
  std::ofstream out_;
  std::uint64_t bytes_ = 0;
  nlohmann::json pieces_ = nlohmann::json::array();
};

// Returns the bytes of the shards (weights and AdamW state). Throws InputError when a shard is
// missing from the folder or has another size than its index says (a folder that not every rank
// sees), or the folder cannot be moved into place.
std::uint64_t finish_checkpoint(const std::string& dir, const CheckpointInfo& info,
                                const std::vector<nlohmann::json>& shards);

// One writer, whole tensors (tests, tools): the three steps above on this process.
void write_checkpoint(const std::string& dir, const Checkpoint& checkpoint);

// Reads checkpoint.json (checked, every shard's size included) and, on demand, one full tensor
// assembled from the pieces that hold it. Throws InputError naming the file and field when the
// folder is not a readable checkpoint.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir);
  const CheckpointInfo& info() const { return info_; }
  // The tensors' names, in the checkpoint's order.
  const std::vector<std::string>& names() const { return names_; }
  // Its full shape, or nullptr when the checkpoint has no tensor of that name.
  const std::vector<std::int64_t>* shape(const std::string& name) const;
  // The full tensor; throws InputError when a piece cannot be read or some element is in none.
  CheckpointTensor read(const std::string& name) const;
  // A rank's slice of it (its local elements, in the slice's order; shape {local size}),
  // reading only the pieces that share rows and columns with the slice.
  CheckpointTensor read_slice(const std::string& name, const Slice& want) const;
  // "DIR/checkpoint.json", for messages.
  const std::string& where() const { return where_; }
  // The folder read: the one given, or DIR.old where DIR holds no checkpoint and DIR.old does
  // (a writer stopped between its two renames; `from_old`).
  const std::string& dir() const { return dir_; }
  bool from_old() const { return from_old_; }
  int shards() const { return static_cast<int>(files_.size()); }

 private:
  struct Piece {
    std::size_t file = 0;  // index into files_
    Slice slice;
    std::int64_t begin = 0, count = 0;
    std::uint64_t offset = 0;            // bytes into the file
    std::optional<std::uint32_t> crc32;  // of its bytes (weights, m, v), where written
  };
  std::string dir_, where_;
  bool from_old_ = false;
  CheckpointInfo info_;
  std::vector<std::string> names_;
  std::map<std::string, std::vector<std::int64_t>> shapes_;
  std::vector<std::string> files_;
  std::map<std::string, std::vector<Piece>> pieces_;  // by tensor
};

// Every tensor, read whole (small models, `dtexec compare`, tests).
Checkpoint read_checkpoint(const std::string& dir);

// The architecture a checkpoint records for `model` (CheckpointInfo::architecture).
nlohmann::json checkpoint_architecture(const nlohmann::json& architecture_json);
// Where two recorded architectures differ, "moe.top_k 1 against 2" each, in the fields both
// recorded (one a later version adds is no difference); empty where they agree or either is
// null (a checkpoint from before they were recorded).
std::vector<std::string> architecture_differences(const nlohmann::json& recorded,
                                                  const nlohmann::json& other);

// Differences between two checkpoints of the same model: losses step by step, weights tensor by
// tensor, matched by name (the largest absolute difference, and the tensor where it occurs).
struct CheckpointDiff {
  int steps_compared = 0;
  double max_loss_diff = 0;
  double max_weight_diff = 0;
  std::string worst_tensor;
  std::vector<std::string> problems;  // mismatched models, steps, names or shapes
};
CheckpointDiff compare_checkpoints(const Checkpoint& a, const Checkpoint& b);
// The same, reading one tensor of each at a time (what `dtexec compare` holds: two tensors).
CheckpointDiff compare_checkpoints(const CheckpointReader& a, const CheckpointReader& b);

}  // namespace dtsim::exec
