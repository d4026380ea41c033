#include "exec/core/checkpoint.hpp"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "sim/common/error.hpp"

namespace dtsim::exec {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "dtexec-checkpoint-1";

std::int64_t elements(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace

void write_checkpoint(const std::string& dir, const Checkpoint& c) {
  const fs::path final_dir(dir);
  const fs::path tmp = final_dir.string() + ".tmp";
  std::error_code ec;
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec)
    throw InputError(fmt::format("{}: cannot create the folder: {}", tmp.string(), ec.message()));
  nlohmann::json tensors = nlohmann::json::array();
  std::int64_t offset = 0;
  {
    std::ofstream bin(tmp / "tensors.bin", std::ios::binary);
    for (const auto& t : c.tensors) {
      const auto n = elements(t.shape);
      DTSIM_ASSERT(static_cast<std::int64_t>(t.data.size()) == n &&
                       static_cast<std::int64_t>(t.m.size()) == n &&
                       static_cast<std::int64_t>(t.v.size()) == n,
                   fmt::format("checkpoint tensor {}: sizes", t.name));
      for (const auto* part : {&t.data, &t.m, &t.v}) {
        bin.write(reinterpret_cast<const char*>(part->data()),
                  static_cast<std::streamsize>(part->size() * sizeof(float)));
      }
      tensors.push_back({{"name", t.name}, {"shape", t.shape}, {"offset", offset}});
      offset += 3 * n;
    }
    if (!bin) throw InputError(fmt::format("{}: cannot write", (tmp / "tensors.bin").string()));
  }
  {
    std::ofstream meta(tmp / "checkpoint.json");
    nlohmann::json j{{"format", kFormat},  {"model", c.model},  {"plan", c.plan},
                     {"step", c.step},     {"seed", c.seed},    {"learning_rate", c.learning_rate},
                     {"losses", c.losses}, {"tensors", tensors}};
    if (!c.lr_schedule.is_null()) j["lr_schedule"] = c.lr_schedule;
    j["weight_decay"] = c.weight_decay;
    meta << j.dump(1) << "\n";
    if (!meta)
      throw InputError(fmt::format("{}: cannot write", (tmp / "checkpoint.json").string()));
  }
  // The previous checkpoint stays readable (as DIR.old) until the new one is in place.
  const fs::path old = final_dir.string() + ".old";
  fs::remove_all(old, ec);
  if (fs::exists(final_dir)) fs::rename(final_dir, old, ec);
  fs::rename(tmp, final_dir, ec);
  if (!ec) fs::remove_all(old, ec);
  if (ec) {
    throw InputError(
        fmt::format("{}: cannot move the checkpoint into place: {}", dir, ec.message()));
  }
}

Checkpoint read_checkpoint(const std::string& dir_given) {
  // A writer stopped between its two renames leaves the previous checkpoint as DIR.old.
  std::string dir = dir_given;
  if (!fs::exists(fs::path(dir) / "checkpoint.json") &&
      fs::exists(fs::path(dir + ".old") / "checkpoint.json")) {
    dir += ".old";
  }
  const fs::path meta_path = fs::path(dir) / "checkpoint.json";
  std::ifstream meta(meta_path);
  if (!meta)
    throw InputError(fmt::format("{}: cannot open (not a dtexec checkpoint?)", meta_path.string()));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(meta);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: malformed JSON: {}", meta_path.string(), e.what()));
  }
  Checkpoint c;
  std::ifstream bin(fs::path(dir) / "tensors.bin", std::ios::binary);
  const std::string bin_name = (fs::path(dir) / "tensors.bin").string();
  if (!bin) throw InputError(fmt::format("{}: cannot open", bin_name));
  std::error_code size_error;
  const auto bin_bytes = fs::file_size(fs::path(dir) / "tensors.bin", size_error);
  if (size_error) throw InputError(fmt::format("{}: cannot read its size", bin_name));
  const auto floats_in_file = static_cast<std::int64_t>(bin_bytes / sizeof(float));
  try {
    if (j.at("format").get<std::string>() != kFormat) {
      throw InputError(fmt::format("{}: format: expected \"{}\", got {}", meta_path.string(),
                                   kFormat, j.at("format").dump()));
    }
    c.model = j.at("model").get<std::string>();
    c.plan = j.at("plan");
    c.step = j.at("step").get<int>();
    c.seed = j.at("seed").get<std::uint64_t>();
    c.learning_rate = j.at("learning_rate").get<double>();
    if (j.contains("lr_schedule")) c.lr_schedule = j.at("lr_schedule");
    if (j.contains("weight_decay")) c.weight_decay = j.at("weight_decay").get<double>();
    c.losses = j.at("losses").get<std::vector<double>>();
    if (c.step < 0 || static_cast<std::size_t>(c.step) != c.losses.size()) {
      throw InputError(fmt::format("{}: step: expected the number of losses ({}), got {}",
                                   meta_path.string(), c.losses.size(), c.step));
    }
    for (const auto& t : j.at("tensors")) {
      CheckpointTensor ct;
      ct.name = t.at("name").get<std::string>();
      ct.shape = t.at("shape").get<std::vector<std::int64_t>>();
      // The tensor (weights, then both Adam moments) must lie inside tensors.bin: checked
      // before anything is allocated, without overflow for absurd shapes.
      std::int64_t n = 1;
      for (const std::int64_t d : ct.shape) {
        if (d <= 0 || n > floats_in_file / d) {
          throw InputError(fmt::format(
              "{}: tensors: {}: shape {}: expected positive sizes that fit in {} ({} floats)",
              meta_path.string(), ct.name, t.at("shape").dump(), bin_name, floats_in_file));
        }
        n *= d;
      }
      if (ct.shape.empty()) {
        throw InputError(
            fmt::format("{}: tensors: {} has an empty shape", meta_path.string(), ct.name));
      }
      const auto offset = t.at("offset").get<std::int64_t>();
      if (offset < 0 || offset > floats_in_file || 3 * n > floats_in_file - offset) {
        throw InputError(
            fmt::format("{}: tensor {} runs past the end of the file", bin_name, ct.name));
      }
      bin.seekg(static_cast<std::streamoff>(offset * static_cast<std::int64_t>(sizeof(float))));
      for (auto* part : {&ct.data, &ct.m, &ct.v}) {
        part->resize(static_cast<std::size_t>(n));
        bin.read(reinterpret_cast<char*>(part->data()),
                 static_cast<std::streamsize>(part->size() * sizeof(float)));
      }
      if (!bin) {
        throw InputError(
            fmt::format("{}: tensor {} runs past the end of the file", bin_name, ct.name));
      }
      c.tensors.push_back(std::move(ct));
    }
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: {}", meta_path.string(), e.what()));
  }
  return c;
}

CheckpointDiff compare_checkpoints(const Checkpoint& a, const Checkpoint& b) {
  CheckpointDiff d;
  if (a.model != b.model) {
    d.problems.push_back(fmt::format("models differ: {} and {}", a.model, b.model));
  }
  if (a.step != b.step)
    d.problems.push_back(fmt::format("steps differ: {} and {}", a.step, b.step));
  d.steps_compared = static_cast<int>(std::min(a.losses.size(), b.losses.size()));
  for (int i = 0; i < d.steps_compared; ++i) {
    d.max_loss_diff = std::max(d.max_loss_diff, std::abs(a.losses[static_cast<std::size_t>(i)] -
                                                         b.losses[static_cast<std::size_t>(i)]));
  }
  if (a.tensors.size() != b.tensors.size()) {
    d.problems.push_back(
        fmt::format("tensor counts differ: {} and {}", a.tensors.size(), b.tensors.size()));
    return d;
  }
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    const auto& x = a.tensors[i];
    const auto& y = b.tensors[i];
    if (x.name != y.name || x.shape != y.shape) {
      d.problems.push_back(fmt::format("tensor {}: {} in one, {} in the other", i, x.name, y.name));
      continue;
    }
    for (std::size_t k = 0; k < x.data.size(); ++k) {
      const double diff = std::abs(static_cast<double>(x.data[k]) - y.data[k]);
      if (diff > d.max_weight_diff || std::isnan(diff)) {
        d.max_weight_diff = std::isnan(diff) ? INFINITY : diff;
        d.worst_tensor = x.name;
      }
    }
  }
  return d;
}

}  // namespace dtsim::exec
