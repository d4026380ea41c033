// The Program runner (exec/core/runner_internal.hpp): checkpoints: saving (synchronous and
// asynchronous) and resuming.
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "exec/core/runner_internal.hpp"

namespace dtsim::exec {

std::string vocab_padding_refusal(const std::string& what, std::int64_t rows, std::int64_t vocab,
                                  const plan::Plan& plan, std::int64_t written_multiple) {
  // The padded rows take part in the softmax (as in Megatron-LM), so another padding would not
  // continue the run: the multiple that pads the vocabulary to the checkpoint's rows at this
  // tp, the checkpoint's own where it does, else the largest (the most aligned).
  const std::int64_t tp = plan.tp;
  auto pads_to_rows = [&](std::int64_t d) {
    return d >= 1 && rows % (d * tp) == 0 && rows >= vocab && rows - vocab < d * tp;
  };
  std::int64_t fits = 0;
  if (written_multiple > 0 && written_multiple % tp == 0 && pads_to_rows(written_multiple / tp)) {
    fits = written_multiple / tp;
  }
  for (std::int64_t d = rows / tp; d >= 1 && fits == 0; --d) {
    if (pads_to_rows(d)) fits = d;
  }
  const std::string head = fmt::format(
      "{} has {} rows, this plan {}: the vocabulary of {} padded to a multiple of {} x tp {} "
      "(--make-vocab-size-divisible-by), and the padded rows take part in the softmax, so the "
      "run would not continue",
      what, rows, plan::padded_vocab(vocab, plan), vocab, plan.make_vocab_size_divisible_by, tp);
  if (fits > 0) {
    return fmt::format("{}; give --make-vocab-size-divisible-by {} (x tp {}: {} rows)", head, fits,
                       tp, rows);
  }
  return fmt::format(
      "{}; no --make-vocab-size-divisible-by pads it to {} rows at tp {}: resume at the "
      "checkpoint's tp, or one whose multiple does",
      head, rows, tp);
}

void check_resume(const CheckpointInfo& c, const std::string& where, const model::ModelSpec& model,
                  const RunOptions& options, double clip_grad) {
  if (c.model != model.name) {
    throw InputError(fmt::format("{}: model: the checkpoint is of {}, this run trains {}", where,
                                 c.model, model.name));
  }
  // The same name, another model (a config edited: its top_k, rope_theta or norm changed):
  // the tensors would load and train on as another model's.
  if (const auto differ = architecture_differences(
          c.architecture, checkpoint_architecture(model::architecture_json(model)));
      !differ.empty()) {
    throw InputError(fmt::format(
        "{}: architecture: the checkpoint's {} is not this run's: {} (the checkpoint's against "
        "this run's)",
        where, c.model, fmt::join(differ, "; ")));
  }
  // Dropout changes what a step computes, as the seed does (resumed under --no-dropout, a
  // dropout-trained run went on as another: its losses 0.038 off the uninterrupted run's).
  if (c.dropout && *c.dropout != model.dropout) {
    throw InputError(fmt::format(
        "{}: dropout: the checkpoint was trained {} dropout, this run trains {} it; {} to "
        "continue it",
        where, *c.dropout ? "with" : "without", model.dropout ? "with" : "without",
        *c.dropout ? "leave out --no-dropout (and a plan file's no_dropout)"
                   : "give --no-dropout"));
  }
  // The data stream and its token mapping come from the seed, and the optimizer from the
  // learning rate: a run resumed with others would not continue the checkpointed one.
  if (c.seed != options.seed) {
    throw InputError(
        fmt::format("{}: seed: the checkpoint was trained with --seed {}, this run "
                    "has --seed {}; give --seed {} to continue it",
                    where, c.seed, options.seed, c.seed));
  }
  if (static_cast<float>(c.learning_rate) != options.lr.max_lr) {
    throw InputError(
        fmt::format("{}: learning_rate: the checkpoint was trained with --lr {}, "
                    "this run has --lr {}; give --lr {} to continue it",
                    where, static_cast<float>(c.learning_rate), options.lr.max_lr,
                    static_cast<float>(c.learning_rate)));
  }
  if (static_cast<float>(c.weight_decay) != options.weight_decay) {
    throw InputError(
        fmt::format("{}: weight_decay: the checkpoint was trained with --weight-decay {}, "
                    "this run has --weight-decay {}; give --weight-decay {} to continue it",
                    where, static_cast<float>(c.weight_decay), options.weight_decay,
                    static_cast<float>(c.weight_decay)));
  }
  // (read_info checked that the plan is an object, and its clip_grad a number >= 0.)
  const double clipped = c.plan.value("clip_grad", 0.0);
  if (clipped != clip_grad) {
    throw InputError(
        fmt::format("{}: clip_grad: the checkpoint was trained with --clip-grad {:g}, this run has "
                    "--clip-grad {:g}; give --clip-grad {:g} to continue it",
                    where, clipped, clip_grad, clipped));
  }
  // Checkpoints from before schedules trained at a constant rate.
  LrSchedule trained;
  trained.max_lr = static_cast<float>(c.learning_rate);
  if (!c.lr_schedule.is_null()) trained = lr_schedule_from_json(c.lr_schedule, where);
  if (!(trained == options.lr)) {
    throw InputError(fmt::format(
        "{}: lr_schedule: the checkpoint was trained with a learning rate of {}, this run "
        "has {}; give the same --lr-warmup-steps, --lr-decay-style, --lr-decay-steps and "
        "--min-lr to continue it",
        where, trained.describe(), options.lr.describe()));
  }
  // A fault set for a step that the checkpoint holds would never happen.
  for (const auto& [flag, step] :
       {std::pair{"--fail-at", options.fail_step}, std::pair{"--hang-at", options.hang_step}}) {
    if (step > 0 && step <= c.step) {
      throw InputError(
          fmt::format("{}: step: the checkpoint is at step {}; {} at step {} never "
                      "happens in this run",
                      where, c.step, flag, step));
    }
  }
  if (c.step >= options.steps) {
    throw InputError(
        fmt::format("{}: step: the checkpoint is at step {}; --steps {} leaves "
                    "nothing to run",
                    where, c.step, options.steps));
  }
}

}  // namespace dtsim::exec

namespace dtsim::exec::runner_internal {

CheckpointRecord Runner::save(int steps_done, const std::vector<double>& losses) {
  if (comm_.rank() == 0) begin_checkpoint(options_.checkpoint_dir);
  comm_.barrier();
  // Each piece copied to host memory, then written. The copies are timed apart: they are what
  // an asynchronous save stops training for (dtsim --checkpoint-async-gbs-per-gpu), into
  // buffers sized once, as such a save keeps its host buffers from one checkpoint to the next.
  ShardWriter shard(options_.checkpoint_dir, comm_.rank());
  std::size_t largest = 0;
  for (const auto& [key, p] : params_) {
    if (in_checkpoint(p)) {
      largest = std::max(largest, static_cast<std::size_t>(p.own_end - p.own_begin));
    }
  }
  std::vector<float> weights(largest), m(largest), v(largest);
  double copy_s = 0, copied_bytes = 0;
  for (const auto& [key, p] : params_) {
    if (!in_checkpoint(p)) continue;
    const auto n = static_cast<std::size_t>(p.own_end - p.own_begin);
    const auto copy_start = std::chrono::steady_clock::now();
    for (auto [host, part] : {std::pair{&weights, master_slice(p)}, {&m, p.m}, {&v, p.v}}) {
      dev_.download(host->data(), part);
    }
    copy_s += seconds_since(copy_start);
    copied_bytes += 3.0 * sizeof(float) * static_cast<double>(n);
    shard.add(p.name, p.slice, p.own_begin, std::span(weights).first(n), std::span(m).first(n),
              std::span(v).first(n));
  }
  return put_in_place(steps_done, shard.close(), copy_s, copied_bytes, 0.0, 0.0, losses);
}

CheckpointRecord Runner::put_in_place(int step, const nlohmann::json& index, double copy_s,
                                      double copied_bytes, double write_s, double blocking_s,
                                      const std::vector<double>& losses) {
  const auto indices = comm_.gather_to_root(json_text(index));
  CheckpointRecord record{.step = step};
  // The slowest rank's copy, write and wait, and the lowest rate of a rank that copied anything.
  std::array<double, 4> slowest = {copy_s,
                                   copy_s > 0 && copied_bytes > 0
                                       ? -copied_bytes / copy_s
                                       : -std::numeric_limits<double>::infinity(),
                                   write_s, blocking_s};
  comm_.all_ranks(slowest, Reduce::Max);
  record.copy_s = slowest[0];
  record.copy_bytes_per_s = std::isfinite(slowest[1]) ? -slowest[1] : 0.0;  // 0: none copied
  record.write_s = slowest[2];
  record.blocking_s = slowest[3];
  if (comm_.rank() != 0) return record;
  std::vector<nlohmann::json> shards;
  for (const auto& shard : indices) {
    shards.push_back(nlohmann::json::parse(shard));
    if (!shards.back().is_null()) ++record.shards;
  }
  CheckpointInfo c;
  c.model = m_.name;
  c.architecture = checkpoint_architecture(model::architecture_json(m_));
  c.plan = plan::to_json(p_);
  c.step = step;
  c.seed = options_.seed;
  // As the shortest decimals that read back as the same floats (1e-12, not 9.99999996e-13,
  // which the reader would refuse as below its smallest figure).
  c.learning_rate = decimal(options_.lr.max_lr);
  c.weight_decay = decimal(options_.weight_decay);
  c.dropout = m_.dropout;
  c.lr_schedule = options_.lr.to_json();
  c.losses = losses;
  record.bytes = finish_checkpoint(options_.checkpoint_dir, c, shards);
  return record;
}

void Runner::prepare_async_saves(RunResult& result) {
  const auto started = std::chrono::steady_clock::now();
  std::size_t total = 0;
  for (const auto& [key, p] : params_) {
    if (!in_checkpoint(p)) continue;
    const auto n = static_cast<std::size_t>(p.own_end - p.own_begin);
    async_.pieces.push_back({&p, total, n});
    total += 3 * n;
  }
  async_.host.assign(total, 0.0f);
  std::array<double, 2> largest = {sizeof(float) * static_cast<double>(total),
                                   seconds_since(started)};
  comm_.all_ranks(largest, Reduce::Max);
  result.checkpoint_host_bytes = largest[0];
  result.checkpoint_host_seconds = largest[1];
}

void Runner::start_async_save(int steps_done, RunResult& result) {
  // The save before it still writing: training waits for it here (its blocking time).
  if (async_.active) put_async_in_place(steps_done, result);
  const auto started = std::chrono::steady_clock::now();
  if (comm_.rank() == 0) begin_checkpoint(options_.checkpoint_dir);
  comm_.barrier();
  const auto copy_start = std::chrono::steady_clock::now();
  for (const SnapshotPiece& piece : async_.pieces) {
    float* at = async_.host.data() + piece.at;
    dev_.download(at, master_slice(*piece.p));
    dev_.download(at + piece.n, piece.p->m);
    dev_.download(at + 2 * piece.n, piece.p->v);
  }
  async_.copy_s = seconds_since(copy_start);
  async_.step = steps_done;
  async_.losses = result.losses;
  async_.started = started;
  async_.index = nullptr;
  async_.error = nullptr;
  async_.write_s = 0;
  async_.written.store(false);
  async_.active = true;
  async_.blocking_s = seconds_since(started);
  async_.writer = std::jthread([this, dir = options_.checkpoint_dir, rank = comm_.rank()] {
    const auto start = std::chrono::steady_clock::now();
    try {
      ShardWriter shard(dir, rank);
      for (const auto& piece : async_.pieces) {
        const std::span<const float> all(async_.host.data() + piece.at, 3 * piece.n);
        shard.add(piece.p->name, piece.p->slice, piece.p->own_begin, all.first(piece.n),
                  all.subspan(piece.n, piece.n), all.subspan(2 * piece.n, piece.n));
      }
      async_.index = shard.close();
    } catch (...) {
      async_.error = std::current_exception();
    }
    async_.write_s = seconds_since(start);
    async_.written.store(true, std::memory_order_release);
  });
}

void Runner::put_async_in_place(int done, RunResult& result) {
  const auto started = std::chrono::steady_clock::now();
  async_.writer.join();
  async_.active = false;
  if (async_.error) std::rethrow_exception(async_.error);
  CheckpointRecord record = put_in_place(async_.step, async_.index, async_.copy_s,
                                         sizeof(float) * static_cast<double>(async_.host.size()),
                                         async_.write_s, async_.blocking_s, async_.losses);
  record.asynchronous = true;
  record.blocking_s += seconds_since(started);
  record.seconds = seconds_since(async_.started);
  record.in_place_after = done;
  checkpoint_done(record, result);
}

int Runner::resume(RunResult& result) {
  const CheckpointReader checkpoint(options_.resume_dir);
  const CheckpointInfo& c = checkpoint.info();
  const std::string& where = checkpoint.where();
  check_resume(c, where, m_, options_, p_.clip_grad);
  // Every tensor of the checkpoint is one of the model's: a model file changed under the same
  // name (positions, biases or norms dropped) would otherwise leave some unread, silently.
  std::set<std::string> model_tensors;
  for (OpId id = 0; id < static_cast<OpId>(g_.size()); ++id) {
    for (const auto& [which, slice] : slices(g_.op(id), 0)) {
      model_tensors.insert(tensor_name(saved_as(id), which));
    }
  }
  for (const auto& name : checkpoint.names()) {
    if (!model_tensors.count(name)) {
      throw InputError(fmt::format(
          "{}: tensors: {} is no tensor of model {} (a checkpoint of another model under its "
          "name?)",
          where, name, m_.name));
    }
  }
  // Each tensor's tp slice read from the pieces that hold it, whatever plan wrote them (one
  // tensor at a time: a rank never holds the whole checkpoint, nor reads other tp slices).
  for (auto& [key, p] : params_) {
    const auto* shape = checkpoint.shape(p.name);
    if (shape != nullptr && shape->size() == 2 && (*shape)[1] == p.slice.cols &&
        p.slice.rows == m_.vocab_rows() && (*shape)[0] != p.slice.rows) {
      throw InputError(vocab_padding_refusal(fmt::format("{}: tensors: {}", where, p.name),
                                             (*shape)[0], m_.vocab, p_));
    }
    if (shape == nullptr || *shape != std::vector<std::int64_t>{p.slice.rows, p.slice.cols}) {
      throw InputError(fmt::format("{}: tensors: no {} of shape [{}, {}]", where, p.name,
                                   p.slice.rows, p.slice.cols));
    }
    const CheckpointTensor t = checkpoint.read_slice(p.name, p.slice);
    // Values that training could not have left: they would surface steps later as a diverged
    // loss, blaming the learning rate.
    if (!trainable(t)) {
      throw InputError(fmt::format(
          "{}: tensors: {}: a weight or AdamW moment that is not finite, or a negative second "
          "moment (a damaged shard?)",
          where, p.name));
    }
    // Of its tp slice, each rank keeps its dp slice where it holds only that.
    load_weights(p, t.data.data());
    dev_.upload(p.m, t.m.data() + p.own_begin);
    dev_.upload(p.v, t.v.data() + p.own_begin);
  }
  adam_step_ = c.step;
  result.losses = c.losses;
  return c.step;
}

}  // namespace dtsim::exec::runner_internal
