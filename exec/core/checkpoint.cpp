#include "exec/core/checkpoint.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <boost/crc.hpp>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "exec/core/lr_schedule.hpp"
#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"

namespace dtsim::exec {

namespace fs = std::filesystem;

namespace {

// Flushes a file's data, or a folder's names (a rename in it), to its storage (fsync): a
// checkpoint in place survives a crash of its node, which the previous one, removed once this
// one is in place, would not. A file system that has no such flush (EINVAL, ENOTSUP, EROFS) is
// left as is, and so is a folder that cannot be opened to read (its names are flushed with it
// where the file system orders renames).
void flush_to_storage(const fs::path& path, bool folder = false) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (folder) return;
    throw InputError(
        fmt::format("{}: cannot open it to flush it: {}", path.string(), std::strerror(errno)));
  }
  const int rc = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (rc != 0 && error != EINVAL && error != EROFS && error != ENOTSUP && error != EOPNOTSUPP) {
    throw InputError(
        fmt::format("{}: cannot flush it to storage: {}", path.string(), std::strerror(error)));
  }
}

// The first format: one tensors.bin of whole tensors, written by rank 0 after a gather.
constexpr const char* kFormatWhole = "dtexec-checkpoint-1";
constexpr const char* kFormat = "dtexec-checkpoint-2";
constexpr std::uint64_t kBytesPerElement = 3 * sizeof(float);  // weight, AdamW's m and v

fs::path temporary(const std::string& dir) {
  return fs::path(dir + ".tmp");
}

// Whether `p` is a folder that a checkpoint writer made, or is making: nothing in it but
// checkpoint.json, tensors.bin and rank-NNNNN.bin files. Writing a checkpoint replaces such a
// folder, and no other: a path that names anything else is the user's.
bool written_by_checkpoint(const fs::path& p) {
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(p, ec))) return false;
  for (fs::directory_iterator it(p, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const bool ours = name == "checkpoint.json" || name == "tensors.bin" ||
                      (name.starts_with("rank-") && name.ends_with(".bin"));
    if (!ours || !fs::is_regular_file(it->symlink_status(ec))) return false;
  }
  return !ec;
}

// Throws unless `p` is absent or a checkpoint writer's folder.
void require_replaceable(const fs::path& p, const std::string& flag, const std::string& dir) {
  std::error_code ec;
  const auto status = fs::symlink_status(p, ec);
  if (!fs::exists(status) || written_by_checkpoint(p)) return;
  const std::string what = p.string() == dir ? "" : p.string() + " ";
  // Writing renames the link, not the folder it points to, which would keep the old checkpoint.
  if (fs::is_symlink(status)) {
    throw InputError(fmt::format(
        "{} {}: {}is a symbolic link; give the folder it points to ({}), since writing a "
        "checkpoint renames the path it is given",
        flag, dir, what, fs::read_symlink(p, ec).string()));
  }
  throw InputError(fmt::format(
      "{} {}: {}exists and is not a dtexec checkpoint folder (it holds other files, or is not "
      "a folder, or cannot be listed); writing a checkpoint replaces it, so give a new path or "
      "remove it",
      flag, dir, what));
}

// `given` without trailing separators: "ck/" is the folder "ck", whose siblings DIR.tmp and
// DIR.old are "ck.tmp" and "ck.old" (not "ck/.tmp"). Nothing else is rewritten: "a/../ck" is
// what the OS makes of it, through a link or not.
fs::path without_trailing_separators(const std::string& given) {
  std::string s = given;
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return fs::path(s);
}

// A whole number at j[field] (a float, a string or one out of range is an InputError naming the
// field, not a truncated or wrapped value).
std::int64_t whole_number(const nlohmann::json& j, const std::string& field,
                          const std::string& where) {
  const auto& v = JsonReader(j, where).at(field);
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX))) {
    throw InputError(
        fmt::format("{}: {}: expected a whole number, got {}", where, field, brief_json(v)));
  }
  return v.get<std::int64_t>();
}

// A list of whole numbers (`field` names it in messages), of `size` entries unless size is 0.
std::vector<std::int64_t> whole_numbers(const nlohmann::json& v, const std::string& field,
                                        const std::string& where, std::size_t size = 0) {
  if (!v.is_array() || (size > 0 && v.size() != size)) {
    throw InputError(fmt::format("{}: {}: expected a list of {}whole numbers, got {}", where, field,
                                 size > 0 ? std::to_string(size) + " " : "", brief_json(v)));
  }
  std::vector<std::int64_t> out;
  for (const auto& x : v) out.push_back(whole_number(nlohmann::json{{field, x}}, field, where));
  return out;
}

void write_info(nlohmann::json& j, const CheckpointInfo& c) {
  j["model"] = c.model;
  if (!c.architecture.is_null()) j["architecture"] = c.architecture;
  j["plan"] = c.plan;
  j["step"] = c.step;
  j["seed"] = c.seed;
  j["learning_rate"] = c.learning_rate;
  if (!c.lr_schedule.is_null()) j["lr_schedule"] = c.lr_schedule;
  j["weight_decay"] = c.weight_decay;
  if (c.dropout) j["dropout"] = *c.dropout;
  j["losses"] = c.losses;
}

CheckpointInfo read_info(const nlohmann::json& j, const std::string& where) {
  const JsonReader r(j, where);
  CheckpointInfo c;
  c.model = r.name("model");
  if (r.has("architecture")) c.architecture = r.object("architecture").raw();
  // The plan is read whole where it is used (dtsim's plan reader); what a resumed run compares
  // directly is typed here.
  c.plan = r.object("plan").raw();
  const JsonReader plan(c.plan, where, "plan");
  if (plan.has("clip_grad")) plan.non_negative_number("clip_grad");
  const std::int64_t step = whole_number(j, "step", where);
  if (step < 0 || step > INT32_MAX) {
    throw InputError(fmt::format("{}: step: expected a step count, got {}", where, step));
  }
  c.step = static_cast<int>(step);
  const auto& seed = r.at("seed");
  if (!seed.is_number_unsigned()) {
    throw InputError(
        fmt::format("{}: seed: expected a whole number >= 0, got {}", where, brief_json(seed)));
  }
  c.seed = seed.get<std::uint64_t>();
  c.learning_rate = r.positive_number("learning_rate");
  if (r.has("lr_schedule")) {
    c.lr_schedule = j.at("lr_schedule");
    lr_schedule_from_json(c.lr_schedule, where);  // (checked here: compare reads it too)
  }
  if (r.has("weight_decay")) c.weight_decay = r.non_negative_number("weight_decay");
  if (r.has("dropout")) c.dropout = r.boolean("dropout");
  const auto& losses = r.array("losses");
  for (std::size_t i = 0; i < losses.size(); ++i) {
    if (!losses[i].is_number() || !std::isfinite(losses[i].get<double>()) ||
        losses[i].get<double>() < 0) {
      throw InputError(
          fmt::format("{}: losses[{}]: expected a cross-entropy (a finite number >= "
                      "0), got {}",
                      where, i, describe_json_value(losses[i])));
    }
    c.losses.push_back(losses[i].get<double>());
  }
  if (c.step < 0 || static_cast<std::size_t>(c.step) != c.losses.size()) {
    throw InputError(fmt::format("{}: step: expected the number of losses ({}), got {}", where,
                                 c.losses.size(), c.step));
  }
  return c;
}

}  // namespace

std::string checkpoint_folder(const std::string& given, const std::string& flag) {
  const fs::path p = without_trailing_separators(given);
  const std::string name = p.filename().string();
  if (name.empty() || name == "." || name == "..") {
    throw InputError(fmt::format(
        "{}: expected a folder of its own, got \"{}\" (a checkpoint is written beside it, as "
        "DIR.tmp, and renamed into place)",
        flag, given));
  }
  return p.string();
}

void check_checkpoint_folder(const std::string& dir, const std::string& flag) {
  const fs::path p(dir);
  const fs::path parent = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) {
    throw InputError(fmt::format("{} {}: no directory {}", flag, dir, parent.string()));
  }
  for (const fs::path& q : {p, temporary(dir), fs::path(dir + ".old")}) {
    require_replaceable(q, flag, dir);
  }
  // The parent takes a new folder (what begin_checkpoint makes): tried now, not after training.
  const fs::path tmp = temporary(dir);
  if (!fs::exists(tmp, ec)) {
    if (!fs::create_directory(tmp, ec) || ec) {
      throw InputError(fmt::format("{} {}: cannot create {}: {}", flag, dir, tmp.string(),
                                   ec ? ec.message() : "not created"));
    }
    fs::remove(tmp, ec);
  }
}

bool in_checkpoint_folders(const std::string& given, const std::string& path) {
  // ("ck/" is "ck": its DIR.old is ck.old.)
  const std::string dir = without_trailing_separators(given).string();
  std::error_code ec;
  const fs::path file = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) return false;
  for (const fs::path& q : {fs::path(dir), temporary(dir), fs::path(dir + ".old")}) {
    const fs::path folder = fs::weakly_canonical(fs::absolute(q), ec);
    if (ec) continue;
    // (Component by component: "ck2/x" is not in "ck".)
    if (std::mismatch(folder.begin(), folder.end(), file.begin(), file.end()).first ==
        folder.end()) {
      return true;
    }
  }
  return false;
}

void begin_checkpoint(const std::string& dir) {
  const fs::path tmp = temporary(dir);
  require_replaceable(tmp, "checkpoint", dir);
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directory(tmp, ec);
  if (ec)
    throw InputError(fmt::format("{}: cannot create the folder: {}", tmp.string(), ec.message()));
}

ShardWriter::ShardWriter(const std::string& dir, int rank)
    : folder_(temporary(dir).string()), file_(fmt::format("rank-{:05d}.bin", rank)) {}

void ShardWriter::add(const std::string& name, const Slice& slice, std::int64_t begin,
                      std::span<const float> weights, std::span<const float> m,
                      std::span<const float> v) {
  DTSIM_ASSERT(weights.size() == m.size() && m.size() == v.size() &&
                   begin + static_cast<std::int64_t>(weights.size()) <= slice.local_size(),
               fmt::format("checkpoint piece of {}: sizes", name));
  if (!out_.is_open()) {
    out_.open(fs::path(folder_) / file_, std::ios::binary | std::ios::trunc);
    if (!out_) {
      throw InputError(fmt::format(
          "{}/{}: cannot create (rank 0 makes the folder: is it on a file system that every rank "
          "sees?)",
          folder_, file_));
    }
  }
  boost::crc_32_type crc;
  for (const auto part : {weights, m, v}) {
    out_.write(reinterpret_cast<const char*>(part.data()),
               static_cast<std::streamsize>(part.size_bytes()));
    crc.process_bytes(part.data(), part.size_bytes());
  }
  nlohmann::json cols = nlohmann::json::array();
  for (const auto& [first, n] : slice.col_ranges) cols.push_back({first, n});
  pieces_.push_back({{"tensor", name},
                     {"shape", {slice.rows, slice.cols}},
                     {"rows", {slice.row_begin, slice.row_count}},
                     {"cols", cols},
                     {"begin", begin},
                     {"count", weights.size()},
                     {"offset", bytes_},
                     {"crc32", crc.checksum()}});
  bytes_ += kBytesPerElement * weights.size();
}

nlohmann::json ShardWriter::close() {
  if (!out_.is_open()) return nullptr;
  out_.close();
  if (!out_) throw InputError(fmt::format("{}/{}: cannot write", folder_, file_));
  flush_to_storage(fs::path(folder_) / file_);
  return {{"file", file_}, {"bytes", bytes_}, {"pieces", std::move(pieces_)}};
}

std::uint64_t finish_checkpoint(const std::string& dir, const CheckpointInfo& info,
                                const std::vector<nlohmann::json>& shards) {
  const fs::path tmp = temporary(dir);
  nlohmann::json tensors = nlohmann::json::array(), listed = nlohmann::json::array();
  std::set<std::string> seen;
  std::uint64_t bytes = 0;
  for (const auto& given : shards) {
    if (given.is_null()) continue;
    nlohmann::json shard = given;
    const auto file = shard.at("file").get<std::string>();
    const auto expected = shard.at("bytes").get<std::uint64_t>();
    std::error_code ec;
    const auto size = fs::file_size(tmp / file, ec);
    if (ec || size != expected) {
      throw InputError(fmt::format(
          "{}: a rank's shard is {} ({} bytes expected): is {} on a file system that every "
          "rank sees?",
          (tmp / file).string(), ec ? "missing" : fmt::format("{} bytes", size), expected, dir));
    }
    bytes += expected;
    for (auto& piece : shard.at("pieces")) {
      const auto name = piece.at("tensor").get<std::string>();
      if (seen.insert(name).second) {
        tensors.push_back({{"name", name}, {"shape", piece.at("shape")}});
      }
      piece.erase("shape");
    }
    listed.push_back(std::move(shard));
  }
  {
    std::ofstream meta(tmp / "checkpoint.json");
    nlohmann::json j{{"format", kFormat}};
    write_info(j, info);
    j["tensors"] = std::move(tensors);
    j["shards"] = std::move(listed);
    meta << json_text(j, 1) << "\n" << std::flush;
    if (!meta)
      throw InputError(fmt::format("{}: cannot write", (tmp / "checkpoint.json").string()));
  }
  flush_to_storage(tmp / "checkpoint.json");
  flush_to_storage(tmp, true);
  // The previous checkpoint stays readable (as DIR.old) until the new one is in place.
  const fs::path final_dir(dir);
  const fs::path old = dir + ".old";
  // (Checked before the run; something put there since would be replaced.)
  try {
    require_replaceable(final_dir, "checkpoint", dir);
    require_replaceable(old, "checkpoint", dir);
  } catch (const InputError& e) {
    throw InputError(
        fmt::format("{}; this checkpoint is left in {}", e.what(), temporary(dir).string()));
  }
  std::error_code ec;
  auto failed = [&](const std::string& what) {
    return InputError(fmt::format("{}: cannot {}: {}; this checkpoint is left in {}", dir, what,
                                  ec.message(), tmp.string()));
  };
  fs::remove_all(old, ec);
  if (ec) throw failed(fmt::format("remove {}", old.string()));
  if (fs::exists(final_dir)) {
    fs::rename(final_dir, old, ec);
    if (ec) throw failed(fmt::format("move the previous checkpoint to {}", old.string()));
  }
  fs::rename(tmp, final_dir, ec);
  if (ec) throw failed("move the checkpoint into place");
  // Its name in place on storage before the previous checkpoint goes.
  try {
    flush_to_storage(final_dir.parent_path().empty() ? fs::path(".") : final_dir.parent_path(),
                     true);
  } catch (const InputError& e) {
    throw InputError(
        fmt::format("{} (the checkpoint is in place in {}, the previous one kept in "
                    "{})",
                    e.what(), dir, old.string()));
  }
  fs::remove_all(old, ec);
  if (ec) {
    throw InputError(
        fmt::format("{}: the checkpoint is in place, but the previous one, {}, "
                    "cannot be removed: {}",
                    dir, old.string(), ec.message()));
  }
  return bytes;
}

void write_checkpoint(const std::string& dir, const Checkpoint& c) {
  begin_checkpoint(dir);
  ShardWriter shard(dir, 0);
  for (const auto& t : c.tensors) {
    DTSIM_ASSERT(t.shape.size() == 2, fmt::format("checkpoint tensor {}: shape", t.name));
    shard.add(t.name, whole(t.shape[0], t.shape[1]), 0, t.data, t.m, t.v);
  }
  finish_checkpoint(dir, c, {shard.close()});
}

CheckpointReader::CheckpointReader(const std::string& dir_given) {
  // A writer stopped between its two renames leaves the previous checkpoint as DIR.old.
  dir_ = without_trailing_separators(dir_given).string();
  // (Paths that cannot be looked at, a name too long or links in a loop, are said below.)
  std::error_code unseen;
  if (!fs::exists(fs::path(dir_) / "checkpoint.json", unseen) &&
      fs::exists(fs::path(dir_ + ".old") / "checkpoint.json", unseen)) {
    dir_ += ".old";
    from_old_ = true;
  }
  where_ = (fs::path(dir_) / "checkpoint.json").string();
  std::error_code missing;
  (void)fs::status(dir_, missing);
  if (missing && missing != std::errc::no_such_file_or_directory &&
      missing != std::errc::not_a_directory) {
    throw InputError(fmt::format("{}: cannot look at it ({}); expected a dtexec checkpoint folder",
                                 dir_, missing.message()));
  }
  if (!fs::is_directory(dir_, missing) && fs::exists(dir_, missing)) {
    throw InputError(fmt::format("{}: is a file; expected a dtexec checkpoint folder", dir_));
  }
  if (!fs::exists(dir_, missing) && !missing) {
    throw InputError(fmt::format("{}: no such checkpoint folder", dir_));
  }
  if (!fs::exists(where_, missing)) {
    throw InputError(fmt::format("{}: cannot open (not a dtexec checkpoint?)", where_));
  }
  const nlohmann::json j = JsonReader::parse_file(where_);
  try {
    const JsonReader index(j, where_);
    const auto format = index.string("format");
    if (format != kFormat && format != kFormatWhole) {
      throw InputError(fmt::format("{}: format: expected \"{}\" (or \"{}\"), got {}", where_,
                                   kFormat, kFormatWhole, brief_json(j.at("format"))));
    }
    // (A field of another version, or a hand edit, would otherwise be ignored in silence.)
    index.expect_only({"format", "model", "architecture", "plan", "step", "seed", "learning_rate",
                       "lr_schedule", "weight_decay", "dropout", "losses", "tensors", "shards"});
    info_ = read_info(j, where_);
    // The shard files, each present with the size its index gives: their floats bound every
    // shape and offset below, checked before anything is allocated.
    std::vector<std::uint64_t> sizes;
    auto add_file = [&](const std::string& file, std::optional<std::uint64_t> expected) {
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        throw InputError(fmt::format(
            "{}: shards: file: expected a file name in the folder, got \"{}\"", where_, file));
      }
      const fs::path path = fs::path(dir_) / file;
      std::error_code ec;
      const auto size = fs::file_size(path, ec);
      if (ec) {
        throw InputError(fmt::format("{}: cannot open ({}): a shard {} lists", path.string(),
                                     ec.message(), where_));
      }
      if (expected && size != *expected) {
        throw InputError(fmt::format(
            "{}: {} bytes, expected {} ({})", path.string(), size, *expected,
            size < *expected ? "a shard cut short?" : "a shard of another checkpoint?"));
      }
      if (std::find(files_.begin(), files_.end(), file) != files_.end()) {
        throw InputError(fmt::format("{}: shards: {} is listed twice", where_, file));
      }
      files_.push_back(file);
      sizes.push_back(size);
    };
    const bool whole_format = format == kFormatWhole;
    if (whole_format) {
      add_file("tensors.bin", std::nullopt);
    } else {
      for (const auto& shard : index.array("shards")) {
        const std::int64_t bytes = whole_number(shard, "bytes", where_ + ": shards");
        if (bytes < 0) {
          throw InputError(fmt::format("{}: shards: bytes: expected >= 0, got {}", where_, bytes));
        }
        const JsonReader listed(shard, where_ + ": shards");
        listed.expect_only({"file", "bytes", "pieces"});
        add_file(listed.string("file"), static_cast<std::uint64_t>(bytes));
      }
    }
    std::uint64_t stored = 0;  // elements held by all the files together
    for (const auto size : sizes) stored += size / kBytesPerElement;
    for (const auto& t : index.array("tensors")) {
      // (A field of another version, or a hand edit, would be ignored in silence: refused, as
      // at the index's top level.)
      const JsonReader tensor(t, where_ + ": tensors");
      tensor.expect_only(whole_format
                             ? std::initializer_list<std::string_view>{"name", "shape", "offset"}
                             : std::initializer_list<std::string_view>{"name", "shape"});
      const auto name = tensor.string("name");
      auto shape = whole_numbers(JsonReader(t, where_ + ": tensors: " + name).at("shape"), "shape",
                                 where_ + ": tensors: " + name);
      std::int64_t n = 1;
      for (const std::int64_t d : shape) {
        if (d <= 0 || static_cast<std::uint64_t>(n) > stored / static_cast<std::uint64_t>(d)) {
          throw InputError(fmt::format(
              "{}: tensors: {}: shape {}: expected positive sizes, with no more elements than "
              "the checkpoint's files hold ({})",
              where_, name, brief_json(t.at("shape")), stored));
        }
        n *= d;
      }
      if (shape.empty() || (!whole_format && shape.size() != 2)) {
        throw InputError(fmt::format("{}: tensors: {}: shape {}: expected [rows, cols]", where_,
                                     name, brief_json(t.at("shape"))));
      }
      if (shapes_.count(name)) {
        throw InputError(fmt::format("{}: tensors: {} is listed twice", where_, name));
      }
      names_.push_back(name);
      shapes_[name] = shape;
      if (whole_format) {
        // A whole tensor (weights, m, v) from `offset` floats into tensors.bin.
        const auto offset = whole_number(t, "offset", where_ + ": tensors: " + name);
        const auto floats = static_cast<std::int64_t>(sizes[0] / sizeof(float));
        if (offset < 0 || offset > floats || 3 * n > floats - offset) {
          throw InputError(
              fmt::format("{}/tensors.bin: tensor {} runs past the end of the file", dir_, name));
        }
        pieces_[name].push_back({0, whole(n / shape.back(), shape.back()), 0, n,
                                 static_cast<std::uint64_t>(offset) * sizeof(float), std::nullopt});
      }
    }
    if (!whole_format) {
      std::size_t f = 0;
      for (const auto& shard : j.at("shards")) {
        std::uint64_t next = 0;  // where the shard's next piece starts
        const std::string in_shard = where_ + ": shards: " + files_[f];
        for (const auto& piece : JsonReader(shard, in_shard).array("pieces")) {
          const auto name = JsonReader(piece, in_shard).string("tensor");
          const auto it = shapes_.find(name);
          if (it == shapes_.end()) {
            throw InputError(fmt::format("{}: shards: {}: a piece of {}, which is not in tensors",
                                         where_, files_[f], name));
          }
          const auto bad = [&](const std::string& what) {
            return InputError(
                fmt::format("{}: shards: {}: a piece of {}: {}", where_, files_[f], name, what));
          };
          Piece p;
          p.file = f;
          p.slice.rows = it->second[0];
          p.slice.cols = it->second[1];
          const std::string field =
              fmt::format("{}: shards: {}: a piece of {}", where_, files_[f], name);
          const JsonReader piece_reader(piece, field);
          piece_reader.expect_only(
              {"tensor", "shape", "rows", "cols", "begin", "count", "offset", "crc32"});
          const auto rows = whole_numbers(piece_reader.at("rows"), "rows", field);
          if (rows.size() != 2 || rows[0] < 0 || rows[1] <= 0 || rows[0] > p.slice.rows ||
              rows[1] > p.slice.rows - rows[0]) {
            throw bad(fmt::format("rows {}: expected [first, count] inside {} rows",
                                  brief_json(piece.at("rows")), p.slice.rows));
          }
          p.slice.row_begin = rows[0];
          p.slice.row_count = rows[1];
          for (const auto& range : piece_reader.array("cols")) {
            const auto r = whole_numbers(range, "cols", field, 2);
            if (r.size() != 2 || r[0] < 0 || r[1] <= 0 || r[0] > p.slice.cols ||
                r[1] > p.slice.cols - r[0] || p.slice.local_cols() > p.slice.cols - r[1]) {
              throw bad(fmt::format(
                  "cols {}: expected [first, count] ranges inside {} columns, {} at most in all",
                  brief_json(piece.at("cols")), p.slice.cols, p.slice.cols));
            }
            p.slice.col_ranges.push_back({r[0], r[1]});
          }
          if (p.slice.col_ranges.empty()) throw bad("cols: expected at least one range");
          p.begin = whole_number(piece, "begin", field);
          p.count = whole_number(piece, "count", field);
          if (p.begin < 0 || p.count < 0 || p.begin > p.slice.local_size() ||
              p.count > p.slice.local_size() - p.begin) {
            throw bad(fmt::format("begin {}, count {}: expected a range of its slice's {} elements",
                                  p.begin, p.count, p.slice.local_size()));
          }
          // The writer lays a shard's pieces one after the other: an offset elsewhere (into
          // another piece, or between floats) would read wrong numbers.
          const std::int64_t offset = whole_number(piece, "offset", field);
          const std::uint64_t need = kBytesPerElement * static_cast<std::uint64_t>(p.count);
          if (offset < 0 || static_cast<std::uint64_t>(offset) != next || need > sizes[f] - next) {
            throw bad(fmt::format(
                "offset {}: expected {}, where the piece before it ends, with its {} bytes "
                "inside the file ({})",
                offset, next, need, sizes[f]));
          }
          p.offset = next;
          next += need;
          // Checkpoints from before CRCs have no crc32: their pieces are read unchecked.
          if (piece.contains("crc32")) {
            const std::int64_t crc = whole_number(piece, "crc32", field);
            if (crc < 0 || crc > 0xffffffffLL) {
              throw bad(fmt::format("crc32 {}: expected a 32-bit checksum", crc));
            }
            p.crc32 = static_cast<std::uint32_t>(crc);
          }
          pieces_[name].push_back(std::move(p));
        }
        if (next != sizes[f]) {
          throw InputError(fmt::format("{}: shards: {}: its pieces hold {} bytes, the file {}",
                                       where_, files_[f], next, sizes[f]));
        }
        ++f;
      }
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: {}", where_, e.what()));
  }
}

const std::vector<std::int64_t>* CheckpointReader::shape(const std::string& name) const {
  const auto it = shapes_.find(name);
  return it == shapes_.end() ? nullptr : &it->second;
}

CheckpointTensor CheckpointReader::read(const std::string& name) const {
  const auto* full_shape = shape(name);
  DTSIM_ASSERT(full_shape != nullptr, fmt::format("checkpoint: no tensor {}", name));
  const std::int64_t cols = full_shape->back();
  std::int64_t n = 1;
  for (const auto d : *full_shape) n *= d;
  CheckpointTensor t = read_slice(name, whole(n / cols, cols));
  t.shape = *full_shape;
  return t;
}

CheckpointTensor CheckpointReader::read_slice(const std::string& name, const Slice& want) const {
  const auto* full_shape = shape(name);
  DTSIM_ASSERT(full_shape != nullptr, fmt::format("checkpoint: no tensor {}", name));
  std::int64_t elements = 1;
  for (const auto d : *full_shape) elements *= d;
  DTSIM_ASSERT(want.cols == full_shape->back() && want.rows * want.cols == elements,
               fmt::format("checkpoint: a slice of {} of another shape", name));
  CheckpointTensor t;
  t.name = name;
  const std::int64_t n = want.local_size();
  t.shape = {n};
  for (auto* part : {&t.data, &t.m, &t.v}) part->assign(static_cast<std::size_t>(n), 0.0f);
  std::vector<std::uint8_t> covered(static_cast<std::size_t>(n), 0);
  std::int64_t filled = 0;
  // The wanted column ranges with where each starts among the slice's local columns.
  const std::int64_t lc = want.local_cols();
  std::vector<std::array<std::int64_t, 3>> ranges;  // first column, count, local offset
  for (std::int64_t at = 0; const auto& [first, count] : want.col_ranges) {
    ranges.push_back({first, count, at});
    at += count;
  }
  // Whether a piece may hold some of it: the rows its range spans (a dp range of its slice
  // spans only some of the slice's rows) and its slice's columns meet the wanted ones.
  const auto shares = [&](const Piece& p) {
    const Slice& s = p.slice;
    if (p.count == 0) return false;
    const std::int64_t first_row = s.row_begin + p.begin / s.local_cols();
    const std::int64_t last_row = s.row_begin + (p.begin + p.count - 1) / s.local_cols();
    if (first_row >= want.row_begin + want.row_count || want.row_begin > last_row) {
      return false;
    }
    for (const auto& [a, an] : s.col_ranges) {
      for (const auto& [b, bn, at] : ranges) {
        if (a < b + bn && b < a + an) return true;
      }
    }
    return false;
  };
  std::vector<float> buffer;
  static const std::vector<Piece> none;
  const auto it = pieces_.find(name);
  for (const Piece& p : it == pieces_.end() ? none : it->second) {
    if (!shares(p)) continue;  // only the pieces that hold some of it are read
    const fs::path path = fs::path(dir_) / files_[p.file];
    std::ifstream in(path, std::ios::binary);
    buffer.resize(3 * static_cast<std::size_t>(p.count));
    in.seekg(static_cast<std::streamoff>(p.offset));
    in.read(reinterpret_cast<char*>(buffer.data()),
            static_cast<std::streamsize>(buffer.size() * sizeof(float)));
    if (!in) throw InputError(fmt::format("{}: cannot read {}'s piece", path.string(), name));
    if (p.crc32) {
      boost::crc_32_type crc;
      crc.process_bytes(buffer.data(), buffer.size() * sizeof(float));
      if (crc.checksum() != *p.crc32) {
        throw InputError(fmt::format(
            "{}: a piece of {} does not match its checksum in {} (crc32 {:08x}, the bytes read "
            "{:08x}): a damaged shard, or one of another checkpoint",
            path.string(), name, where_, *p.crc32, crc.checksum()));
      }
    }
    // Each run of the piece lies in one row: its columns' overlap with each wanted range is a
    // run of the wanted slice.
    p.slice.for_runs(
        p.begin, p.count, [&](std::int64_t local, std::int64_t full, std::int64_t length) {
          const std::int64_t row = full / want.cols, col = full % want.cols;
          if (row < want.row_begin || row >= want.row_begin + want.row_count) return;
          for (const auto& [first, count, at] : ranges) {
            const std::int64_t lo = std::max(col, first),
                               hi = std::min(col + length, first + count);
            if (lo >= hi) continue;
            const std::int64_t to = (row - want.row_begin) * lc + at + (lo - first);
            auto* mark = covered.data() + to;
            if (std::find(mark, mark + (hi - lo), 1) != mark + (hi - lo)) {
              throw InputError(fmt::format("{}: shards: {}: an element of {} is in two pieces",
                                           where_, files_[p.file], name));
            }
            std::fill(mark, mark + (hi - lo), 1);
            const auto bytes = static_cast<std::size_t>(hi - lo) * sizeof(float);
            for (int k = 0; k < 3; ++k) {
              auto& into = k == 0 ? t.data : (k == 1 ? t.m : t.v);
              std::memcpy(into.data() + to, buffer.data() + k * p.count + local + (lo - col),
                          bytes);
            }
            filled += hi - lo;
          }
        });
  }
  if (filled != n) {
    throw InputError(fmt::format("{}: shards: {}: {} of the {} elements read are in no shard",
                                 where_, name, n - filled, n));
  }
  return t;
}

nlohmann::json checkpoint_architecture(const nlohmann::json& architecture_json) {
  nlohmann::json a = architecture_json;
  a.erase("dropout");
  a.erase("max_positions");
  return a;
}

namespace {

// A mixture's fields that model::architecture_json records only where they differ from a model
// without them (shared experts; gates over all experts; sigmoid scores and their scale; dense
// blocks), as that model has them: a checkpoint
// from before they were recorded compares as one of such a model.
nlohmann::json with_moe_defaults(nlohmann::json a) {
  if (a.is_object() && a.contains("moe") && a.at("moe").is_object()) {
    nlohmann::json& moe = a["moe"];
    if (!moe.contains("shared_ffn_hidden")) moe["shared_ffn_hidden"] = 0;
    if (!moe.contains("normalize_top_k")) moe["normalize_top_k"] = true;
    if (!moe.contains("scores")) moe["scores"] = "softmax";
    if (!moe.contains("routed_scaling_factor")) moe["routed_scaling_factor"] = 1.0;
    if (!moe.contains("dense_blocks")) moe["dense_blocks"] = nlohmann::json::array();
    if (!moe.contains("dense_ffn_hidden")) moe["dense_ffn_hidden"] = 0;
  }
  return a;
}

}  // namespace

std::vector<std::string> architecture_differences(const nlohmann::json& recorded,
                                                  const nlohmann::json& other) {
  std::vector<std::string> out;
  if (!recorded.is_object() || !other.is_object()) return out;
  // (Between two mixtures: a dense model's null moe differs in its fields as recorded.)
  const auto mixture = [](const nlohmann::json& x) {
    return x.contains("moe") && x.at("moe").is_object();
  };
  const bool both = mixture(recorded) && mixture(other);
  const nlohmann::json a = both ? with_moe_defaults(recorded) : recorded;
  const nlohmann::json b = both ? with_moe_defaults(other) : other;
  // The fields both recorded (one that a later version adds is no difference), each that
  // differs flattened ("moe.top_k"; a side's missing part of it as null; a list whole:
  // "moe.dense_blocks [] against [0,2]").
  for (const auto& [field, va] : a.items()) {
    if (!b.contains(field) || b.at(field) == va) continue;
    std::map<std::string, std::array<nlohmann::json, 2>> leaves;
    const auto flatten = [&](const auto& self, const std::string& name, const nlohmann::json& v,
                             std::size_t side) -> void {
      if (v.is_object()) {
        for (const auto& [k, x] : v.items()) self(self, name + "." + k, x, side);
      } else {
        leaves[name][side] = v;
      }
    };
    flatten(flatten, field, va, 0);
    flatten(flatten, field, b.at(field), 1);
    for (const auto& [name, sides] : leaves) {
      if (sides[0] == sides[1]) continue;
      out.push_back(fmt::format("{} {} against {}", name, sides[0].dump(), sides[1].dump()));
    }
  }
  return out;
}

Checkpoint read_checkpoint(const std::string& dir) {
  const CheckpointReader reader(dir);
  Checkpoint c;
  static_cast<CheckpointInfo&>(c) = reader.info();
  for (const auto& name : reader.names()) c.tensors.push_back(reader.read(name));
  return c;
}

namespace {

void compare_info(const CheckpointInfo& a, const CheckpointInfo& b, CheckpointDiff& d) {
  if (a.model != b.model) {
    d.problems.push_back(fmt::format("models differ: {} and {}", a.model, b.model));
  }
  if (const auto differ = architecture_differences(a.architecture, b.architecture);
      !differ.empty()) {
    d.problems.push_back(
        fmt::format("the models' architectures differ: {}", fmt::join(differ, "; ")));
  }
  if (a.step != b.step)
    d.problems.push_back(fmt::format("steps differ: {} and {}", a.step, b.step));
  d.steps_compared = static_cast<int>(std::min(a.losses.size(), b.losses.size()));
  for (int i = 0; i < d.steps_compared; ++i) {
    d.max_loss_diff = std::max(d.max_loss_diff, std::abs(a.losses[static_cast<std::size_t>(i)] -
                                                         b.losses[static_cast<std::size_t>(i)]));
  }
}

void compare_tensor(const CheckpointTensor& x, const CheckpointTensor& y, CheckpointDiff& d) {
  if (x.shape != y.shape) {
    // (The embedding and LM head of plans whose vocabulary padding, a multiple of
    // --make-vocab-size-divisible-by x tp, differs.)
    d.problems.push_back(fmt::format("tensor {}: shapes differ ([{}] and [{}])", x.name,
                                     fmt::join(x.shape, ", "), fmt::join(y.shape, ", ")));
    return;
  }
  bool finite = true;
  for (std::size_t k = 0; k < x.data.size(); ++k) {
    const double diff = std::abs(static_cast<double>(x.data[k]) - y.data[k]);
    finite = finite && std::isfinite(x.data[k]) && std::isfinite(y.data[k]);
    if (diff > d.max_weight_diff || std::isnan(diff)) {
      d.max_weight_diff = std::isnan(diff) ? INFINITY : diff;
      d.worst_tensor = x.name;
    }
  }
  // A weight that is NaN or infinite is no difference to measure: said so, as a mismatch.
  if (!finite) d.problems.push_back(fmt::format("tensor {}: a weight is not finite", x.name));
}

// Tensors matched by name (plans write them in other orders): compare(name in both) for each
// of a's in its order, then a problem for each name in one only.
void match_names(const std::vector<std::string>& a, const std::vector<std::string>& b,
                 CheckpointDiff& d, const std::function<void(const std::string&)>& compare) {
  std::map<std::string, bool> in_b;
  for (const auto& name : b) in_b[name] = false;
  for (const auto& name : a) {
    const auto it = in_b.find(name);
    if (it == in_b.end()) {
      d.problems.push_back(fmt::format("tensor {} is in the first only", name));
      continue;
    }
    it->second = true;
    compare(name);
  }
  for (const auto& [name, matched] : in_b) {
    if (!matched) d.problems.push_back(fmt::format("tensor {} is in the second only", name));
  }
}

}  // namespace

CheckpointDiff compare_checkpoints(const Checkpoint& a, const Checkpoint& b) {
  CheckpointDiff d;
  compare_info(a, b, d);
  std::map<std::string, const CheckpointTensor*> by_name[2];
  std::vector<std::string> names[2];
  for (int k = 0; k < 2; ++k) {
    for (const auto& t : (k == 0 ? a : b).tensors) {
      by_name[k][t.name] = &t;
      names[k].push_back(t.name);
    }
  }
  match_names(names[0], names[1], d, [&](const std::string& name) {
    compare_tensor(*by_name[0].at(name), *by_name[1].at(name), d);
  });
  return d;
}

CheckpointDiff compare_checkpoints(const CheckpointReader& a, const CheckpointReader& b) {
  CheckpointDiff d;
  compare_info(a.info(), b.info(), d);
  // A damaged tensor is bad input, as resuming from it is, not a difference to measure.
  const auto read = [](const CheckpointReader& r, const std::string& name) {
    CheckpointTensor t = r.read(name);
    if (!trainable(t)) {
      throw InputError(fmt::format(
          "{}: tensors: {}: a weight or AdamW moment that is not finite, or a negative second "
          "moment (a damaged shard?)",
          r.dir(), name));
    }
    return t;
  };
  match_names(a.names(), b.names(), d,
              [&](const std::string& name) { compare_tensor(read(a, name), read(b, name), d); });
  return d;
}

bool trainable(const CheckpointTensor& t) {
  const auto finite = [](const std::vector<float>& x) {
    return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
  };
  return finite(t.data) && finite(t.m) && finite(t.v) &&
         std::none_of(t.v.begin(), t.v.end(), [](float v) { return v < 0; });
}

}  // namespace dtsim::exec
