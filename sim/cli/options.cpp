#include "sim/cli/options.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string_view>
#include <system_error>

#include "sim/cluster/device_catalog.hpp"
#include "sim/common/data_files.hpp"
#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"
#include "sim/common/launcher.hpp"
#include "sim/common/units.hpp"
#include "sim/plan/memory_model.hpp"
#include "sim/report/json_values.hpp"

namespace dtsim::cli {

namespace {

constexpr const char* kAttentionHelp =
    "the attention core's kernels: unfused (default; scores and softmax in device memory, as "
    "in Megatron-LM's published runs) or flash (FlashAttention: no s² tensors kept, the scores "
    "computed again in the backward; dtsim prices its kernels skipping the causal half)";

// --attention into `out` when given.
void attention_from_options(const po::variables_map& vm, model::AttentionKernel& out) {
  if (vm.count("attention") &&
      !model::parse_attention_kernel(vm["attention"].as<std::string>(), out)) {
    throw InputError(fmt::format("--attention: expected unfused or flash, got \"{}\"",
                                 vm["attention"].as<std::string>()));
  }
}

}  // namespace

void add_model_options(po::options_description& desc, bool with_cluster, const char* plan_flag) {
  desc.add_options()(
      "model", po::value<std::string>()->default_value(kDefaultModel),
      "model: a name in models/ (e.g. llama3-70b), a path to a dtsim model JSON, or a Hugging "
      "Face config.json")(
      "no-dropout", po::bool_switch(),
      "train the model without its dropout layers (their masks, memory and traffic)");
  if (with_cluster) {
    desc.add_options()("cluster", po::value<std::string>()->default_value(kDefaultCluster),
                       "cluster: a name in topologies/ (e.g. selene) or a path")(
        "gpus", po::value<std::int64_t>(),
        fmt::format("use this many devices of the cluster (whole nodes, or part of one node); "
                    "default: all of them{}",
                    plan_flag ? fmt::format(" (with {} P.json: as many as its dp x tp x pp x "
                                            "cp, where that is fewer)",
                                            plan_flag)
                              : std::string())
            .c_str());
  }
}

void add_plan_options(po::options_description& desc, const char* precision_help) {
  po::options_description plan("Plan (Megatron-LM vocabulary; unset values get defaults)");
  plan.add_options()("plan", po::value<std::string>(),
                     "plan JSON file (flags given as well override its fields)")(
      "tp", po::value<int>(), "tensor-parallel degree (default 1)")(
      "pp", po::value<int>(), "pipeline-parallel degree (default 1)")(
      "dp", po::value<int>(), "data-parallel degree (default: devices / (tp x pp x cp))")(
      "cp", po::value<int>(), "context-parallel degree (default 1)")(
      "ep", po::value<int>(), "expert-parallel degree, inside dp (default 1)")(
      "micro-batch-size", po::value<std::int64_t>(), "sequences per micro-batch (default 1)")(
      "global-batch-size", po::value<std::int64_t>(),
      "sequences per step (default: micro-batch x dp x (1, or 4 x pp when pipelining))")(
      "global-batch", po::value<std::int64_t>(), "the same as --global-batch-size")(
      "seq-len", po::value<std::int64_t>(), "sequence length (default: the model's)")(
      "schedule", po::value<std::string>(),
      "pipeline schedule: gpipe, 1f1b (default), interleaved, zero-bubble, pipedream")(
      "virtual-stages", po::value<int>(), "model chunks per pipeline rank (interleaved)")(
      "zero-stage", po::value<int>(), "ZeRO stage 0-3 (default 0)")(
      "recompute", po::value<std::string>(),
      "activation recompute: none (default), selective, full")(
      "attention", po::value<std::string>(), kAttentionHelp)(
      "sequence-parallel", po::bool_switch(), "Megatron sequence parallelism (needs tp > 1)")(
      "overlap-param-gather", po::bool_switch(),
      "with ZeRO-1/2, all-gather the updated weights during the next step's forward, a block "
      "ahead (Megatron-LM --overlap-param-gather) instead of after the optimizer step")(
      "zero-in-place", po::bool_switch(),
      "ZeRO-1 as Megatron-LM's distributed optimizer runs it: gradients reduce-scattered and "
      "weights all-gathered in place in contiguous buffers, the reduce-scatter without the "
      "packed copy of staged ZeRO (FSDP2's, and dtexec's without this flag)")(
      "no-overlap-grad-reduce", po::bool_switch(),
      "start the data-parallel gradient reduction after the last backward pass instead of "
      "overlapping it (Megatron-LM before --overlap-grad-reduce)")(
      "no-overlap-tp-backward", po::bool_switch(),
      "run the backward's tensor-parallel all-reduce (reduce-scatter with sequence "
      "parallelism) of a column-parallel layer's input gradient after its weight-gradient GEMM "
      "instead of during it (Megatron-LM in 2021, before its asynchronous all-reduce)")(
      "no-grad-accumulation-fusion", po::bool_switch(),
      "accumulate each weight gradient over micro-batches with a separate kernel (a memory "
      "pass per parameter per micro-batch, as PyTorch autograd and Megatron-LM in 2021) instead "
      "of inside the weight-gradient GEMM (Megatron-LM --gradient-accumulation-fusion)")(
      "overlap-p2p-comm", po::bool_switch(),
      // (The flag's name first: boost cuts a word that long where a line ends in it.)
      "--overlap-p2p-communication of Megatron-LM: overlap pipeline sends and receives with "
      "compute; by default a stage exchanges its pipeline tensors in blocking batches between "
      "compute passes, as Megatron-LM does")(
      "expert-load", po::value<double>(),
      "expert parallelism's routing: the token copies the busiest ep rank's experts get over "
      "the even share, from 1 to min(ep, experts / top k), what routing can make (default 1: "
      "even); its experts' compute, tensors and "
      "all-to-all bytes scale by it (dtexec run reports the measured expert_load)")(
      "make-vocab-size-divisible-by", po::value<std::int64_t>(),
      "pad the vocabulary (the embedding's and LM head's rows) to a multiple of this x tp, as "
      "Megatron-LM does (default 128; 1: a multiple of tp only)")(
      "scatter-gather-p2p", po::bool_switch(),
      "Megatron-LM's scatter/gather of pipeline transfers (its 2021 default): each tp rank "
      "sends 1/tp of the activations and the receivers all-gather them over tp (needs tp > 1, "
      "no sequence parallelism)")("precision", po::value<std::string>(), precision_help)(
      "grad-precision", po::value<std::string>(),
      "precision of the weight gradients (their accumulation over micro-batches, memory and "
      "data-parallel reduction): fp32, bf16 or fp16 (default: fp32 with bf16, fp8 and fp32 "
      "training, as Megatron-LM accumulates and all-reduces bf16 models' gradients; fp16 with "
      "fp16)")("comm-precision", po::value<std::string>(),
               "precision of communicated activations and gradients: bf16, fp16, fp8, fp32 or tf32 "
               "(default: --precision, and --grad-precision for gradients)")(
      "grad-compression", po::value<double>(),
      "fraction of the data-parallel gradient bytes sent, from 1e-6 to 1 (default 1: none); "
      "compressing and decompressing cost memory passes")("optimizer", po::value<std::string>(),
                                                          "adam (default) or sgd (with momentum)")(
      "clip-grad", po::value<double>(),
      "clip the gradients to this global norm before the optimizer step (Megatron-LM "
      "--clip-grad, whose default is 1.0); default 0: none")(
      "layers-per-stage", po::value<std::string>(),
      "blocks per model chunk, comma-separated (default: even split), or balanced: the split "
      "dtsim plan's search finds for this plan (dtsim only)")(
      "order", po::value<std::string>(),
      "rank order, fastest first (default tp-cp-ep-dp-pp: tp inside a node)");
  desc.add(plan);
}

void add_jitter_option(po::options_description& desc, const char* where) {
  desc.add_options()(
      "jitter-cv", po::value<double>(),
      fmt::format("straggler model{}: spread (std/mean) of each rank's compute time; every "
                  "collective and pipeline transfer waits for the last of its ranks, each early "
                  "or late by this spread of its compute since they last met (default: the "
                  "profile's measured jitter_cv, else 0)",
                  where)
          .c_str())(
      "rank-spread-cv", po::value<double>(),
      fmt::format("slow rank: spread (std/mean) of the ranks' lasting speeds; the slowest of the "
                  "plan's n ranks computes E[max of n normals] x this slower, on the busiest "
                  "stage, and paces the step{} (default: the profile's measured in_run "
                  "rank_spread_cv, else 0)",
                  where)
          .c_str());
}

double checked_jitter(double cv, const std::string& what) {
  if (!(cv >= 0 && cv < 1)) {
    throw InputError(fmt::format("{}: expected a fraction in [0, 1), got {}", what, cv));
  }
  return cv;
}

namespace {
// The flag's figure, else a --plan file's (a dtsim whatif point's, said in a note), else none.
std::optional<double> spread_from_options(const po::variables_map& vm, const char* flag,
                                          const char* key) {
  if (vm.count(flag)) return checked_jitter(vm[flag].as<double>(), fmt::format("--{}", flag));
  if (!vm.count("plan")) return std::nullopt;
  const std::string file = vm["plan"].as<std::string>();
  const auto cv = plan::plan_file_spread(plan_file_json(file), file, key);
  if (cv && launcher_rank() == 0) {
    std::cerr << fmt::format("note: {}: {} {:g} from the file (--{} sets another)\n", file, key,
                             *cv, flag);
  }
  return cv;
}
}  // namespace

std::optional<double> jitter_from_options(const po::variables_map& vm) {
  return spread_from_options(vm, "jitter-cv", "jitter_cv");
}

std::optional<double> rank_spread_from_options(const po::variables_map& vm) {
  return spread_from_options(vm, "rank-spread-cv", "rank_spread_cv");
}

namespace {

template <class T>
bool takes(const po::value_semantic* semantic) {
  return dynamic_cast<const po::typed_value<T>*>(semantic) != nullptr;
}

// What the option `name` (as Boost names it in errors: "--tp") takes, from its value's type:
// ": expected ..." or nothing.
std::string expected_value(const po::options_description& desc, const std::string& name) {
  const std::string key = name.starts_with("--") ? name.substr(2) : name;
  const po::option_description* option = desc.find_nothrow(key, false);
  if (option == nullptr) return "";
  const po::value_semantic* semantic = option->semantic().get();
  if (takes<int>(semantic)) {
    return fmt::format(": expected an integer (at most {})", std::numeric_limits<int>::max());
  }
  if (takes<std::int64_t>(semantic)) {
    return fmt::format(": expected an integer (at most {})",
                       std::numeric_limits<std::int64_t>::max());
  }
  if (takes<double>(semantic) || takes<float>(semantic)) return ": expected a number";
  return "";
}

}  // namespace

void store_options(const std::vector<std::string>& args, const po::options_description& desc,
                   po::variables_map& vm, const po::positional_options_description* positional) {
  try {
    po::command_line_parser parser(args);
    parser.options(desc).style(kNoGuessing);
    if (positional != nullptr) parser.positional(*positional);
    const po::parsed_options parsed = parser.run();
    // Without a positional description Boost keeps a loose word as an option without a name,
    // which po::store skips: say so instead.
    for (const po::option& o : parsed.options) {
      if (o.string_key.empty() && o.position_key >= 0 && !o.original_tokens.empty()) {
        throw InputError(
            fmt::format("unexpected argument \"{}\": a value follows its option's name (--model "
                        "NAME, --tp N); see --help",
                        o.original_tokens.front()));
      }
    }
    po::store(parsed, vm);
    po::notify(vm);
  } catch (const po::invalid_option_value& e) {
    // Boost names the option and the word, not what it takes.
    throw InputError(
        fmt::format("{}{} (see --help)", e.what(), expected_value(desc, e.get_option_name())));
  } catch (const po::error& e) {
    throw InputError(fmt::format("{} (see --help)", e.what()));
  }
  // No option takes an empty word ("--plan ''" from an unset shell variable): said here, with
  // its name, rather than as a file "" that cannot be opened.
  // (--help takes no value; program_options stores an empty string for it.)
  for (const auto& [name, value] : vm) {
    if (value.defaulted() || name == "help") continue;
    const auto* text = boost::any_cast<std::string>(&value.value());
    const auto* words = boost::any_cast<std::vector<std::string>>(&value.value());
    if ((text != nullptr && text->empty()) ||
        (words != nullptr &&
         std::any_of(words->begin(), words->end(), [](const auto& w) { return w.empty(); }))) {
      // A positional argument is not typed after its option's name: named as the usage has it.
      const bool by_position = positional != nullptr && positional->max_total_count() > 0 &&
                               positional->name_for_position(0) == name;
      throw InputError(fmt::format("{}: expected a value, got an empty one (\"\")",
                                   by_position ? "the " + name + " argument" : "--" + name));
    }
  }
}

bool parse(const std::vector<std::string>& args, const po::options_description& desc,
           const std::string& usage, po::variables_map& vm) {
  store_options(args, desc, vm);
  if (vm.count("help")) {
    std::ostringstream os;
    os << desc;
    std::cout << usage << "\n\n" << os.str();
    return false;
  }
  return true;
}

void check_one_format(const po::variables_map& vm) {
  if (vm["json"].as<bool>() && vm["csv"].as<bool>()) {
    throw InputError("--json and --csv: one output format, give one");
  }
}

namespace {
// "Read-only file system" as the messages around it say things: "(read-only file system)".
std::string lowercase_first(std::string text) {
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

std::optional<std::string> named_in_plan_file(const nlohmann::json& j, const std::string& file,
                                              const char* key);

// The files that option `key` with `value` has a command read, each with what reads it: the
// value itself; the shipped file a --model or --cluster name stands for; the model, cluster,
// profile and device file that a plan file names.
std::vector<std::pair<std::string, std::filesystem::path>> files_read(const std::string& key,
                                                                      const std::string& value) {
  std::vector<std::pair<std::string, std::filesystem::path>> out = {
      {fmt::format("the file that --{} reads", key), value}};
  const auto data = [&](std::string_view kind, const std::string& name) {
    try {
      return std::optional(data_file(kind, name));
    } catch (const InputError&) {
      return std::optional<std::filesystem::path>();  // (its reading says why)
    }
  };
  // A cluster's device file, which the cluster file names (beside it, or in the catalog).
  const auto device_of = [&](const std::filesystem::path& cluster_file, const std::string& what) {
    try {
      const std::string device = cluster::load_cluster(cluster_file.string()).device.file;
      if (!device.empty()) out.emplace_back(what, device);
    } catch (const InputError&) {
      // (its reading says why)
    }
  };
  if (key == "model" || key == "cluster") {
    if (const auto f = data(key, value)) {
      out.emplace_back(out.front().first, *f);
      if (key == "cluster") {
        device_of(*f, fmt::format("the device file that --cluster {} names", value));
      }
    }
  }
  if (key != "plan" && key != "fixed-plan") return out;
  nlohmann::json j;
  try {
    j = plan_file_json(value);
  } catch (const InputError&) {
    return out;  // (its reading says why)
  }
  if (!j.is_object()) return out;
  // (A field that is not a name: its reading says why.)
  const auto named = [&](const char* field,
                         const nlohmann::json& in) -> std::optional<std::string> {
    try {
      return named_in_plan_file(in, value, field);
    } catch (const InputError&) {
      return std::nullopt;
    }
  };
  const auto from = [&](const char* field) {
    return fmt::format("the file that --{} {} names as its {}", key, value, field);
  };
  for (const char* field : {"model", "cluster"}) {
    if (const auto n = named(field, j)) {
      if (const auto f = data(field, *n)) {
        out.emplace_back(from(field), *f);
        if (std::string_view(field) == "cluster") device_of(*f, from("cluster's device"));
      }
    }
  }
  if (const auto n = named("profile", j)) out.emplace_back(from("profile"), *n);
  if (j.contains("cluster_changes")) {
    if (const auto n = named("device", j.at("cluster_changes"))) {
      out.emplace_back(from("cluster_changes.device"), *n);
    }
  }
  return out;
}
}  // namespace

void check_writable(const std::string& path, const std::string& flag,
                    const po::variables_map* inputs) {
  namespace fs = std::filesystem;
  if (path.empty()) throw InputError(fmt::format("{}: expected a file name, got \"\"", flag));
  std::error_code ec;
  const fs::path file(path);
  if (inputs != nullptr) {
    for (const auto& [key, value] : *inputs) {
      const auto* named = boost::any_cast<std::string>(&value.value());
      if (named == nullptr || "--" + key == flag || named->empty()) continue;
      for (const auto& [what, read] : files_read(key, *named)) {
        std::error_code unseen;  // (neither there, or not a file: not the same one)
        if (fs::equivalent(file, read, unseen)) {
          throw InputError(fmt::format("{} {}: {}; write it elsewhere", flag, path, what));
        }
      }
    }
  }
  if (fs::is_directory(file, ec)) {
    throw InputError(fmt::format("{} {}: is a directory; expected a file name", flag, path));
  }
  // An existing file (a link to one, /dev/null) needs only to be writable itself. A regular
  // one is opened for appending, which leaves it as it is: access() answers yes to root for
  // every file, where a read-only file system or /proc refuses the write itself.
  if (fs::exists(file, ec)) {
    if (::access(file.c_str(), W_OK) != 0) {
      throw InputError(fmt::format("{} {}: cannot write it (permission denied)", flag, path));
    }
    if (fs::is_regular_file(file, ec)) {
      const int fd = ::open(file.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
      if (fd < 0) {
        throw InputError(fmt::format("{} {}: cannot write it ({})", flag, path,
                                     lowercase_first(std::strerror(errno))));
      }
      ::close(fd);
    }
    return;
  }
  // A new file, or the target of a link to none: its directory must take it.
  fs::path target = file;
  if (fs::is_symlink(fs::symlink_status(file, ec))) {
    const fs::path to = fs::read_symlink(file, ec);
    target = to.is_absolute() || !file.has_parent_path() ? to : file.parent_path() / to;
  }
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  if (!fs::is_directory(dir, ec)) {
    throw InputError(fmt::format("{} {}: no directory {}", flag, path, dir.string()));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw InputError(
        fmt::format("{} {}: cannot create it in {} (permission denied)", flag, path, dir.string()));
  }
  // Created and removed at once, so that a long run does not learn at its end that its output
  // cannot be written (root passes access() where the file system still refuses: read-only,
  // /proc, a full disk's inodes). One that another process made meanwhile is left alone.
  const int fd = ::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    if (errno == EEXIST) return;
    throw InputError(fmt::format("{} {}: cannot create it in {} ({})", flag, path, dir.string(),
                                 lowercase_first(std::strerror(errno))));
  }
  ::close(fd);
  ::unlink(target.c_str());
}

std::filesystem::path data_file(std::string_view key, const std::string& value) {
  const auto file = resolve_data_file(key, key == "model" ? "models" : "topologies", value);
  std::error_code ec;
  const auto canonical = std::filesystem::weakly_canonical(file, ec);
  return ec ? file : canonical;
}

namespace {

// Whether two --model (or --cluster) values name one file; false where either names none.
bool same_data_file(std::string_view key, const std::string& a, const std::string& b) {
  if (a == b) return true;
  try {
    return data_file(key, a) == data_file(key, b);
  } catch (const InputError&) {
    return false;
  }
}

// "nic_gbps=800, nodes=64": a plan file's cluster_changes as the notes show them; "" where
// it has none (no object, or only nulls, which the reading takes as absent).
std::string changes_text(const nlohmann::json& plan_file) {
  if (!plan_file.is_object() || !plan_file.contains("cluster_changes") ||
      !plan_file.at("cluster_changes").is_object()) {
    return "";
  }
  std::vector<std::string> parts;
  for (const auto& [name, value] : plan_file.at("cluster_changes").items()) {
    if (value.is_null()) continue;  // (absent, as the reading takes it)
    parts.push_back(name + "=" + (value.is_string() ? value.get<std::string>() : json_text(value)));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

// A --fixed-plan file from a dtsim whatif point that changed its cluster (--vary nic_gbps=800):
// whatif's points set the cluster's figures themselves, so the file's changes are not applied,
// which the user is told. (dtsim simulate --plan applies them: cluster_from_options.)
void note_cluster_changes(std::string_view key, std::string_view flag, const std::string& file,
                          const nlohmann::json& j, const std::string& cluster) {
  // (Not an object: the plan's reading refuses it.)
  if (key != "cluster" || flag != "fixed-plan" || changes_text(j).empty() || launcher_rank() != 0) {
    return;
  }
  std::cerr << fmt::format(
      "note: {} was made by dtsim whatif for {} with {}; whatif's points read {} as its file "
      "has it (give those as --vary to run them)\n",
      file, cluster, changes_text(j), cluster);
}

// A relative path that plan file `file` holds, taken from the file's folder (dtsim plan --out
// writes absolute ones; one written by hand beside its model reads the same from any folder).
std::string from_plan_folder(const std::string& file, const std::string& path) {
  if (!std::filesystem::path(path).is_relative()) return path;
  return (std::filesystem::path(file).parent_path() / path).lexically_normal().string();
}

// The model, cluster or device a plan file names (`key`), a path from the file's folder;
// none where it names none.
std::optional<std::string> named_in_plan_file(const nlohmann::json& j, const std::string& file,
                                              const char* key) {
  if (!j.is_object() || !JsonReader(j, file).has(key)) return std::nullopt;
  const std::string named = JsonReader(j, file).string(key);
  return names_a_path(named) ? from_plan_folder(file, named) : named;
}

}  // namespace

nlohmann::json plan_file_json(const std::string& path) {
  // A pipe (--plan <(...), /dev/stdin) can be read once: its JSON is kept for the process. A
  // regular file is read each time, as it is now (a command run twice in one process, as the
  // tests do, may find it rewritten).
  static std::map<std::string, nlohmann::json> piped;
  std::error_code ec;
  if (std::filesystem::is_regular_file(path, ec)) return JsonReader::parse_file(path);
  if (!std::filesystem::exists(path, ec) && !ec) {
    throw InputError(fmt::format("{}: no such plan file", path));
  }
  auto it = piped.find(path);
  if (it == piped.end()) it = piped.emplace(path, JsonReader::parse_file(path)).first;
  return it->second;
}

plan::Plan load_plan_file(const std::string& path) {
  const nlohmann::json j = plan_file_json(path);
  plan::Plan p = plan::plan_from_json(j, path);
  // A null field reads as left out (a Hugging Face config's convention, which a script's None
  // writes too), its default: said once per file, since the default may not be what was meant
  // (zero_stage null is ZeRO-0, twice the memory of ZeRO-1's for Llama-3 8B).
  static std::set<std::string> told;
  std::vector<std::string> nulls;
  for (const auto& [name, value] : j.items()) {
    if (value.is_null()) nulls.push_back(name);
  }
  if (!nulls.empty() && told.insert(path).second && launcher_rank() == 0) {
    std::cerr << fmt::format("note: {}: {} null, read as left out (the default{})\n", path,
                             fmt::join(nulls, ", "), nulls.size() == 1 ? "" : "s");
  }
  return p;
}

std::string data_argument(const po::variables_map& vm, const char* key) {
  const std::string given = vm[key].as<std::string>();
  const char* flag = vm.count("plan") ? "plan" : vm.count("fixed-plan") ? "fixed-plan" : nullptr;
  if (!flag) return given;
  const std::string file = vm[flag].as<std::string>();
  const nlohmann::json j = plan_file_json(file);
  const auto named = named_in_plan_file(j, file, key);
  if (!named) return given;
  if (vm[key].defaulted()) {
    try {
      data_file(key, *named);
    } catch (const InputError& e) {
      throw InputError(fmt::format("{}: {}: {} (or give --{})", file, key, e.what(), key));
    }
    note_cluster_changes(key, flag, file, j, *named);
    return *named;
  }
  if (!same_data_file(key, given, *named)) {
    if (launcher_rank() == 0) {
      const bool changed = std::string_view(key) == "cluster" && !changes_text(j).empty();
      std::cerr << fmt::format("note: {} was made for {} {}{}; --{} {} as given{}\n", file, key,
                               *named, changed ? " with " + changes_text(j) : "", key, given,
                               changed ? ", without those changes" : "");
    }
  } else {
    note_cluster_changes(key, flag, file, j, *named);
  }
  return given;
}

void apply_cluster_changes(cluster::Cluster& c, const JsonReader& changes) {
  changes.expect_only({"device", "nic_gbps", "latency_us", "oversubscription", "nodes"});
  // In whatif's order: the device (and its price), then the network, then the nodes.
  if (changes.has("device")) {
    cluster::DeviceSpec device;
    // (A device file's relative path from the plan file's folder, as the cluster's.)
    const std::string named = changes.string("device");
    try {
      device = cluster::load_device(names_a_path(named) ? from_plan_folder(changes.file(), named)
                                                        : named);
    } catch (const InputError& e) {
      changes.fail("device", e.what());
    }
    c = cluster::with_device(std::move(c), std::move(device));
  }
  const bool network = changes.has("nic_gbps") || changes.has("oversubscription");
  // (A cluster of one node has no network: its point ran as if none were given, as here.)
  if (network && !cluster::is_switched(c.inter.fabric) &&
      c.inter.fabric != cluster::InterFabric::None) {
    changes.fail(changes.has("nic_gbps") ? "nic_gbps" : "oversubscription",
                 fmt::format("{}'s inter-node fabric is {}, which has no {}", c.name,
                             cluster::to_string(c.inter.fabric),
                             changes.has("nic_gbps") ? "NICs" : "oversubscribed uplinks"));
  }
  const std::string source = fmt::format("dtsim whatif, by {}", changes.file());
  if (changes.has("nic_gbps")) {
    // Gbit/s, within a cluster file's bounds on the bytes/s it sets.
    const double gbps = changes.number_within("nic_gbps", cluster::kLeastBandwidth * 8 / 1e9,
                                              cluster::kMostBandwidth * 8 / 1e9, "Gbit/s");
    c.inter.nic_bw_bytes_per_s = {gbps * 1e9 / 8, source};
  }
  if (changes.has("latency_us")) {
    const double us = changes.number_within("latency_us", cluster::kLeastLatency * 1e6,
                                            cluster::kMostLatency * 1e6, "microseconds");
    c.inter.latency_s = {us * 1e-6, source};
  }
  if (changes.has("oversubscription")) {
    const double o = changes.positive_number("oversubscription");
    if (!(o >= 1 && o <= cluster::kMostOversubscription)) {
      changes.fail("oversubscription", fmt::format("expected a ratio from 1 to {:g}, got {:g}",
                                                   cluster::kMostOversubscription, o));
    }
    c.inter.oversubscription = {o, source};
  }
  if (changes.has("nodes")) {
    const std::int64_t nodes =
        changes.positive_int_up_to("nodes", cluster::kMaxDevices / c.node_size());
    try {
      c = cluster::with_nodes(c, nodes);
    } catch (const InputError& e) {
      changes.fail("nodes", e.what());
    }
  }
}

std::optional<std::string> profile_argument(const po::variables_map& vm) {
  if (vm.count("profile")) return vm["profile"].as<std::string>();
  const char* flag = vm.count("plan") ? "plan" : vm.count("fixed-plan") ? "fixed-plan" : nullptr;
  if (!flag) return std::nullopt;
  const std::string file = vm[flag].as<std::string>();
  const nlohmann::json j = plan_file_json(file);
  if (!j.is_object() || !JsonReader(j, file).has("profile")) return std::nullopt;
  // (Always a path: from the file's folder where relative, as its model's and cluster's.)
  const std::string named = from_plan_folder(file, JsonReader(j, file).string("profile"));
  std::error_code ec;
  if (!std::filesystem::is_regular_file(named, ec)) {
    throw InputError(fmt::format("{}: profile: {}: {} (or give --profile)", file, named,
                                 std::filesystem::is_directory(named, ec)
                                     ? "is a directory; expected a profile file"
                                     : "no such file"));
  }
  if (launcher_rank() == 0) {
    std::cerr << fmt::format(
        "note: {}: calibration profile {} from the file, which the plan was made with "
        "(--profile sets another)\n",
        file, named);
  }
  return named;
}

std::string network_argument(const po::variables_map& vm) {
  const std::string given = vm["network"].as<std::string>();
  const char* flag = vm.count("plan") ? "plan" : vm.count("fixed-plan") ? "fixed-plan" : nullptr;
  if (!flag) return given;
  const std::string file = vm[flag].as<std::string>();
  const nlohmann::json j = plan_file_json(file);
  if (!j.is_object() || !JsonReader(j, file).has("network")) return given;
  const std::string named = JsonReader(j, file).choice("network", {"analytical", "simgrid"});
  const bool from_file = vm["network"].defaulted();
  if (named != given && launcher_rank() == 0) {
    std::cerr << (from_file ? fmt::format("note: {}: network model {} from the file, which the "
                                          "plan was ranked with (--network sets another)\n",
                                          file, named)
                            : fmt::format("note: {} was ranked on the {} network; --network {} "
                                          "as given\n",
                                          file, named, given));
  }
  return from_file ? named : given;
}

std::string data_reference(std::string_view key, const std::string& given) {
  const std::filesystem::path file = std::filesystem::absolute(data_file(key, given));
  // A shipped one by its name (given so, or by its path in models/ or topologies/), which reads
  // the same in another checkout; another file by its absolute path.
  const std::string stem = file.stem().string();
  try {
    if (std::filesystem::absolute(data_file(key, stem)) == file) return stem;
  } catch (const InputError&) {
    // (no shipped one of that name)
  }
  return file.string();
}

model::ModelSpec model_from_options(const po::variables_map& vm) {
  return model_with_options(model::load_model(data_argument(vm, "model")), vm);
}

std::optional<std::string> dropout_off_by(const po::variables_map& vm) {
  if (vm.count("no-dropout") && vm["no-dropout"].as<bool>()) return "--no-dropout";
  const char* flag = vm.count("plan") ? "plan" : vm.count("fixed-plan") ? "fixed-plan" : nullptr;
  if (!flag) return std::nullopt;
  const std::string file = vm[flag].as<std::string>();
  const nlohmann::json j = plan_file_json(file);
  if (j.is_object() && JsonReader(j, file).boolean_or("no_dropout", false)) {
    return fmt::format("{}: no_dropout", file);
  }
  return std::nullopt;
}

model::ModelSpec model_with_options(model::ModelSpec spec, const po::variables_map& vm) {
  if (dropout_off_by(vm)) spec.dropout = false;
  return spec;
}

// "--fixed tp=8" (repeatable).
static void apply_fixed(const std::vector<std::string>& fixed, planner::SearchSpace& space) {
  std::map<std::string, std::string> seen;  // key -> the --fixed that set it
  for (const std::string& f : fixed) {
    const auto eq = f.find('=');
    int value = 0;
    try {
      if (eq == std::string::npos) throw std::invalid_argument(f);
      std::size_t used = 0;
      value = std::stoi(f.substr(eq + 1), &used);
      if (used != f.size() - eq - 1 || value < 1) throw std::invalid_argument(f);
    } catch (const std::exception&) {
      throw InputError(
          fmt::format("--fixed {}: expected KEY=N with N >= 1 (KEY: tp, pp, dp, cp, "
                      "ep)",
                      f));
    }
    const std::string key = f.substr(0, eq);
    if (const auto [it, fresh] = seen.emplace(key, f); !fresh) {
      throw InputError(
          fmt::format("--fixed {}: {} is already fixed by --fixed {}", f, key, it->second));
    }
    if (key == "tp") {
      space.fixed_tp = value;
    } else if (key == "pp") {
      space.fixed_pp = value;
    } else if (key == "dp") {
      space.fixed_dp = value;
    } else if (key == "cp") {
      space.fixed_cp = value;
      space.max_cp = std::max(space.max_cp, value);
    } else if (key == "ep") {
      space.fixed_ep = value;
    } else {
      throw InputError(
          fmt::format("--fixed {}: unknown key \"{}\" (expected tp, pp, dp, cp, ep)", f, key));
    }
  }
}

void add_search_space_options(po::options_description& desc) {
  desc.add_options()("max-tp", po::value<int>(),
                     "largest tensor-parallel degree (default: devices per node)")(
      "max-pp", po::value<int>(), "largest pipeline-parallel degree")(
      "max-cp", po::value<int>()->default_value(planner::kDefaultMaxCp),
      "largest context-parallel degree (1: context parallelism not searched)")(
      "fixed", po::value<std::vector<std::string>>()->composing(),
      "fix a degree, e.g. --fixed tp=8 (repeatable; tp, pp, dp, cp, ep)")(
      "attention", po::value<std::string>(), kAttentionHelp)(
      "overlap-param-gather", po::bool_switch(),
      "ZeRO-1/2 candidates all-gather the updated weights during the next step's forward "
      "(Megatron-LM --overlap-param-gather)")(
      "zero-in-place", po::bool_switch(),
      "ZeRO-1 candidates reduce-scatter and all-gather in place, as Megatron-LM's distributed "
      "optimizer (no packed copy for the reduce-scatter)")(
      "clip-grad", po::value<double>(),
      "every candidate clips its gradients to this global norm (Megatron-LM --clip-grad, "
      "whose default is 1.0; default 0: none)");
}

void search_space_from_options(const po::variables_map& vm, planner::SearchSpace& space) {
  for (const char* flag : {"max-tp", "max-pp", "max-cp"}) {
    if (vm.count(flag) && vm[flag].as<int>() < 1) {
      throw InputError(
          fmt::format("--{}: expected a positive integer, got {}", flag, vm[flag].as<int>()));
    }
  }
  if (vm.count("max-tp")) space.max_tp = vm["max-tp"].as<int>();
  if (vm.count("max-pp")) space.max_pp = vm["max-pp"].as<int>();
  space.max_cp = vm["max-cp"].as<int>();
  if (vm.count("fixed")) apply_fixed(vm["fixed"].as<std::vector<std::string>>(), space);
  attention_from_options(vm, space.attention);
  space.overlap_param_gather = vm["overlap-param-gather"].as<bool>();
  space.zero_in_place = vm["zero-in-place"].as<bool>();
  if (vm.count("clip-grad")) {
    space.clip_grad = vm["clip-grad"].as<double>();
    if (const auto why = plan::clip_grad_problem(space.clip_grad)) {
      throw InputError(fmt::format("--clip-grad: {}, got {}", *why, space.clip_grad));
    }
  }
}

void add_reliability_options(po::options_description& desc) {
  const plan::Reliability d;
  desc.add_options()(
      "interruptions-per-gpu-hour",
      po::value<double>()->default_value(d.interruptions_per_device_hour, "1.9733e-5"),
      "with --tokens: job interruptions per device and hour, of any cause (default: Llama 3 "
      "405B's 419 in 54 days on 16,384 H100s, Dubey et al. 2024)")(
      "restart-minutes", po::value<double>()->default_value(0),
      "with --tokens: minutes from an interruption to training again (detection, a new node, "
      "start-up, loading the checkpoint; default 0: not counted, no published figure)")(
      "checkpoint-write-gbs-per-gpu",
      po::value<double>()->default_value(d.checkpoint_write_bytes_per_s_per_device / 1e9, "0.122"),
      "with --tokens: checkpoint write bandwidth per device, GB/s (default: Llama 3's storage, "
      "2 TB/s sustained over 16,384 GPUs)")(
      "checkpoint-write-gbs-total", po::value<double>(),
      "with --tokens: the storage's sustained write bandwidth in all, GB/s, capping the "
      "devices' sum (default: none, the per-device figure scales with the job; Llama 3's "
      "storage sustains 2000)")(
      "checkpoint-async-gbs-per-gpu", po::value<double>(),
      "with --tokens: asynchronous checkpoints (Megatron-LM --async-save): training stops only "
      "while each device copies its state to host memory at this many GB/s (a device-to-host "
      "copy; dtexec run --checkpoint measures it as the snapshot), the write runs behind it "
      "(default: synchronous)");
}

void add_price_option(po::options_description& desc, bool objective) {
  desc.add_options()(
      "price-per-gpu-hour", po::value<double>(),
      objective ? "USD per device and hour, for the cost to train and --objective cost "
                  "(default: the cluster's price_per_device_hour_usd, which only aws-p4d and "
                  "aws-p5 ship)"
                : "with --tokens: USD per device and hour, for the cost to train (default: the "
                  "cluster's price_per_device_hour_usd, which only aws-p4d and aws-p5 ship)");
}

void apply_price(const po::variables_map& vm, cluster::Cluster& c) {
  if (!vm.count("price-per-gpu-hour")) return;
  const double usd = vm["price-per-gpu-hour"].as<double>();
  if (!(usd >= cluster::kLeastPrice && usd <= cluster::kMostPrice)) {
    throw InputError(fmt::format(
        "--price-per-gpu-hour: expected USD per device and hour from {:g} to {:g}, got {} (a "
        "unit mistake?)",
        cluster::kLeastPrice, cluster::kMostPrice, usd));
  }
  // Where nothing reads it, refused as the reliability flags are.
  const bool objective = vm.count("objective") > 0;
  if (!vm.count("tokens") && !(objective && vm["objective"].as<std::string>() == "cost")) {
    throw InputError(fmt::format("--price-per-gpu-hour: only with --tokens (the cost to train){}",
                                 objective ? " or --objective cost" : ""));
  }
  c.price_per_device_hour_usd = Figure{usd, "--price-per-gpu-hour"};
}

std::string unpriced_note(const std::string& cluster) {
  return fmt::format(
      "(cost: cluster {} has no price per device-hour; --price-per-gpu-hour gives one)", cluster);
}

void add_global_batch_options(po::options_description& desc, const char* help) {
  desc.add_options()("global-batch-size", po::value<std::int64_t>(), help)(
      "global-batch", po::value<std::int64_t>(), "the same as --global-batch-size");
}

std::optional<std::int64_t> global_batch_from_options(const po::variables_map& vm) {
  if (vm.count("global-batch-size") && vm.count("global-batch")) {
    throw InputError("--global-batch and --global-batch-size: the same setting, give one");
  }
  const char* flag = vm.count("global-batch") ? "global-batch" : "global-batch-size";
  if (!vm.count(flag)) return std::nullopt;
  const std::int64_t batch = vm[flag].as<std::int64_t>();
  if (batch < 1) {
    throw InputError(fmt::format("--{}: expected a positive integer, got {}", flag, batch));
  }
  return batch;
}

double training_tokens(const po::variables_map& vm) {
  if (!vm.count("tokens")) return 0;
  const double tokens = vm["tokens"].as<double>();
  // Up to 1e18: 64,000 times Llama 3's 15.6e12 (Llama Team 2024); beyond, a typo.
  if (!(tokens >= 1 && tokens <= 1e18)) {
    throw InputError(
        fmt::format("--tokens: expected a number of tokens from 1 to 1e18, got {}", tokens));
  }
  return tokens;
}

void set_reliability(plan::Reliability& r, const std::string& key, double value,
                     const std::string& what) {
  // Every figure within a cluster file's bounds (kSmallestFigure to kLargestFigure): finite in
  // the model's units too, and its results finite (1e300 GB/s overflowed bytes/s to infinity,
  // pricing checkpoints at 0 s; 1e-320 interruptions an hour made the job's MTBF infinite).
  const bool within = std::isfinite(value) && value >= kSmallestFigure && value <= kLargestFigure;
  auto bandwidth = [&] {
    if (!within) {
      throw InputError(
          fmt::format("{}: expected a finite positive bandwidth, got {} (GB/s, from "
                      "{:g} to {:g})",
                      what, value, kSmallestFigure, kLargestFigure));
    }
    return value * 1e9;
  };
  if (key == "interruptions_per_gpu_hour") {
    if (!within) {
      throw InputError(
          fmt::format("{}: expected a finite positive rate, got {} (from {:g} to {:g})", what,
                      value, kSmallestFigure, kLargestFigure));
    }
    r.interruptions_per_device_hour = value;
  } else if (key == "restart_minutes") {
    if (!(std::isfinite(value) && value >= 0 && value <= kLargestFigure)) {
      throw InputError(fmt::format("{}: expected a finite number >= 0, got {}", what, value));
    }
    r.restart_s = value * 60;
  } else if (key == "checkpoint_write_gbs_per_gpu") {
    r.checkpoint_write_bytes_per_s_per_device = bandwidth();
  } else if (key == "checkpoint_write_gbs_total") {
    r.checkpoint_write_bytes_per_s_total = bandwidth();
  } else if (key == "checkpoint_async_gbs_per_gpu") {
    r.checkpoint_snapshot_bytes_per_s_per_device = bandwidth();
  } else {
    throw InternalError(fmt::format("set_reliability: no reliability figure \"{}\"", key));
  }
}

plan::Reliability reliability_from_options(const po::variables_map& vm) {
  plan::Reliability r;
  for (const char* key : kReliabilityKeys) {
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    if (!vm.count(flag)) continue;
    if (!vm[flag].defaulted() && !vm.count("tokens")) {
      throw InputError(fmt::format("--{}: only with --tokens (the time to train)", flag));
    }
    set_reliability(r, key, vm[flag].as<double>(), "--" + flag);
  }
  return r;
}

std::string interruptions_note(const plan::Reliability& r) {
  const plan::Reliability d;
  return fmt::format(
      "(train and cost with interruptions: {:.3g} per GPU-hour{}, each losing the work since the "
      "last checkpoint{}; checkpoints (weights and optimizer state) written at {:.3g} GB/s per "
      "GPU{}{}{} every Young's interval sqrt(2 x {} x MTBF); goodput: the failure-free time over "
      "that, the devices paid for the whole time; a first-order model (Young 1974, Daly 2006))",
      r.interruptions_per_device_hour,
      r.interruptions_per_device_hour == d.interruptions_per_device_hour
          ? " (Llama 3's; --interruptions-per-gpu-hour)"
          : "",
      r.restart_s > 0 ? fmt::format(" and {:.3g} min to restart", r.restart_s / 60)
                      : " (restarts not counted: --restart-minutes)",
      r.checkpoint_write_bytes_per_s_per_device / 1e9,
      r.checkpoint_write_bytes_per_s_per_device == d.checkpoint_write_bytes_per_s_per_device
          ? " (Llama 3's storage; --checkpoint-write-gbs-per-gpu)"
          : "",
      r.checkpoint_write_bytes_per_s_total
          ? fmt::format(", at most {:.4g} GB/s in all (--checkpoint-write-gbs-total)",
                        *r.checkpoint_write_bytes_per_s_total / 1e9)
          : std::string(),
      r.checkpoint_snapshot_bytes_per_s_per_device
          ? fmt::format(
                ", asynchronously: training stops only for a copy to host memory at "
                "{:.3g} GB/s per GPU, and a failure also loses the checkpoint being written,",
                *r.checkpoint_snapshot_bytes_per_s_per_device / 1e9)
          : std::string(),
      r.checkpoint_snapshot_bytes_per_s_per_device ? "copy" : "write");
}

std::string span_text(double seconds) {
  if (seconds >= 86400) return fmt::format("{:.1f} days", seconds / 86400);
  if (seconds >= 3600) return fmt::format("{:.1f} h", seconds / 3600);
  if (seconds >= 60) return fmt::format("{:.1f} min", seconds / 60);
  if (seconds >= 1) return fmt::format("{:.1f} s", seconds);
  return format_duration(seconds);
}

std::string training_time_text(const plan::TrainingTime& tt, std::optional<double> cost_usd) {
  // (Whole dollars from 100, three significant digits below: a run of a few steps cost "0 USD".)
  const auto usd = [](double v) { return format_rate(v) + " USD"; };
  std::string s = span_text(tt.work_s);
  if (cost_usd) s += ", " + usd(*cost_usd);
  if (tt.goodput <= 0) {
    return s + fmt::format(
                   "; with interruptions never: one every {}, sooner than a restart and "
                   "half a checkpoint interval{}",
                   span_text(tt.job_mtbf_s), tt.asynchronous ? " and a write" : "");
  }
  return s + fmt::format(
                 "; with interruptions {}{} (goodput {:.1f}%: one every {}, a "
                 "checkpoint every {} step{} taking {}{})",
                 span_text(tt.wall_s),
                 cost_usd ? ", " + usd(*cost_usd / tt.goodput) : std::string(), 100 * tt.goodput,
                 span_text(tt.job_mtbf_s), tt.checkpoint_every_steps,
                 tt.checkpoint_every_steps == 1 ? "" : "s", span_text(tt.checkpoint_write_s),
                 tt.asynchronous ? fmt::format(" behind training, which stops {} for the copy",
                                               span_text(tt.checkpoint_blocking_s))
                                 : std::string());
}

nlohmann::json training_time_json(const plan::TrainingTime& tt, std::optional<double> cost_usd) {
  const auto interrupted = [&](double x) {
    return report::value_or_null(tt.goodput > 0 ? std::optional(x / tt.goodput) : std::nullopt);
  };
  nlohmann::json j = {{"steps", report::byte_count(tt.steps)},
                      {"time_to_train_s", tt.work_s},
                      {"goodput", tt.goodput},
                      {"time_to_train_with_interruptions_s", interrupted(tt.work_s)},
                      {"checkpoint_every_steps", tt.checkpoint_every_steps},
                      {"checkpoints", report::byte_count(tt.checkpoints)},
                      {"checkpoint_write_s", tt.checkpoint_write_s},
                      {"checkpoint_blocking_s", tt.checkpoint_blocking_s},
                      {"checkpoint_asynchronous", tt.asynchronous},
                      {"checkpoint_bytes", report::byte_count(tt.checkpoint_bytes)},
                      {"job_mtbf_s", tt.job_mtbf_s}};
  if (cost_usd) {
    j["cost_to_train_usd"] = *cost_usd;
    j["cost_to_train_with_interruptions_usd"] = interrupted(*cost_usd);
  }
  return j;
}

namespace {
// Whether a progress bar's line is open on stderr (drawn, not yet ended): an error ends it
// first (end_progress_line), so that its message starts a line of its own.
std::atomic<bool> bar_line_open{false};
}  // namespace

std::function<void(std::uint64_t, std::uint64_t)> progress_bar(
    std::chrono::steady_clock::time_point started, const char* what) {
  if (!isatty(fileno(stderr))) return {};
  // Called from the planner's threads: one draws at a time, and a count lower than one drawn
  // (a slower thread's) is not drawn back.
  struct State {
    std::mutex mutex;
    bool drawn = false;  // (a run under a second draws nothing)
    std::uint64_t last = 0;
  };
  auto state = std::make_shared<State>();
  return [started, what, state](std::uint64_t done, std::uint64_t total) {
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const std::lock_guard<std::mutex> lock(state->mutex);
    if (elapsed < 1.0 && !state->drawn) return;
    if (state->drawn && done < state->last) return;
    state->drawn = true;
    state->last = done;
    const int width = 30;
    const int filled =
        static_cast<int>(width * std::min(done, total) / std::max<std::uint64_t>(total, 1));
    std::fprintf(stderr, "\r[%s%s] %llu/%llu %s", std::string(filled, '#').c_str(),
                 std::string(width - filled, ' ').c_str(), static_cast<unsigned long long>(done),
                 static_cast<unsigned long long>(total), what);
    const bool end = done >= total;
    if (end) std::fprintf(stderr, "\n");
    bar_line_open = !end;
  };
}

void end_progress_line() {
  if (bar_line_open.exchange(false)) std::fprintf(stderr, "\n");
}

void add_price_json(nlohmann::json& j, const cluster::Cluster& cluster) {
  if (!cluster.price_per_device_hour_usd) return;
  j["price_per_device_hour_usd"] = cluster.price_per_device_hour_usd->value;
  j["price_source"] = cluster.price_per_device_hour_usd->source;
}

void check_plan_file_cluster(const std::string& file) {
  const nlohmann::json j = plan_file_json(file);
  const auto named = named_in_plan_file(j, file, "cluster");
  if (!named) return;
  cluster::Cluster c;
  try {
    data_file("cluster", *named);
    c = cluster::load_cluster(*named);
  } catch (const InputError& e) {
    throw InputError(fmt::format("{}: cluster: {}", file, e.what()));
  }
  if (j.contains("cluster_changes") && j.at("cluster_changes").is_object()) {
    apply_cluster_changes(c, JsonReader(j, file).object("cluster_changes"));
  }
}

cluster::Cluster cluster_from_options(const po::variables_map& vm) {
  const std::string name = data_argument(vm, "cluster");
  cluster::Cluster c = cluster::load_cluster(name);
  // A plan file from a dtsim whatif point that changed its cluster (--vary nic_gbps=800) runs on
  // the cluster as the point had it, where the cluster is the one the file names.
  nlohmann::json j;  // (the plan file's, which `changes` reads)
  std::optional<JsonReader> changes;
  if (vm.count("plan")) {
    const std::string file = vm["plan"].as<std::string>();
    j = plan_file_json(file);
    const auto named = named_in_plan_file(j, file, "cluster");
    if (named && !changes_text(j).empty() && same_data_file("cluster", name, *named)) {
      changes = JsonReader(j, file).object("cluster_changes");
      apply_cluster_changes(c, *changes);
      if (launcher_rank() == 0) {
        std::cerr << fmt::format("note: {}: {} with {}, as the dtsim whatif point it was made at\n",
                                 file, c.name, changes_text(j));
      }
    }
  }
  // Where the devices it runs on leave a change without effect, as whatif's row notes say.
  const auto said = [&](const cluster::Cluster& on) {
    if (!changes || launcher_rank() != 0) return on;
    const bool network =
        changes->has("nic_gbps") || changes->has("latency_us") || changes->has("oversubscription");
    if (network && on.nodes <= 1) {
      std::cerr << fmt::format(
          "note: {}: {} runs in one node here: its network's figures change nothing\n",
          changes->file(), on.name);
    } else if (changes->has("oversubscription") && !cluster::crosses_uplinks(on)) {
      std::cerr << fmt::format(
          "note: {}: {}'s nodes here share one leaf switch: no traffic crosses the uplinks that "
          "oversubscription slows\n",
          changes->file(), on.name);
    }
    return on;
  };
  apply_price(vm, c);
  if (vm.count("gpus")) return said(cluster::with_devices(c, vm["gpus"].as<std::int64_t>()));
  // A plan file (dtsim plan --out) that uses fewer devices than the cluster has runs on as many
  // as it uses, its flags' overrides included, as if --gpus said so.
  if (vm.count("plan")) {
    const plan::Plan p = load_plan_file(vm["plan"].as<std::string>());
    auto degree = [&](const char* key, int value) {
      return static_cast<std::int64_t>(vm.count(key) ? vm[key].as<int>() : value);
    };
    const std::int64_t devices =
        degree("dp", p.dp) * degree("tp", p.tp) * degree("pp", p.pp) * degree("cp", p.cp);
    if (devices > 0 && devices < c.devices()) {
      c = with_devices_for(
          c, devices,
          fmt::format("{}: its {} devices on {}", vm["plan"].as<std::string>(), devices, c.name));
    }
  }
  return said(c);
}

cluster::Cluster with_devices_for(const cluster::Cluster& c, std::int64_t devices,
                                  const std::string& who) {
  try {
    return cluster::with_devices(c, devices);
  } catch (const InputError& e) {
    std::string why = e.what();
    const std::string flag = fmt::format("--gpus {}: ", devices);
    if (why.rfind(flag, 0) == 0) why = why.substr(flag.size());
    throw InputError(fmt::format("{}: {}", who, why));
  }
}

namespace {
template <typename T>
void override_if(const po::variables_map& vm, const char* key, T& field) {
  if (vm.count(key) && !vm[key].defaulted()) field = vm[key].as<T>();
}

void positive(const char* flag, std::int64_t value) {
  if (value < 1) {
    throw InputError(fmt::format("--{}: expected a positive integer, got {}", flag, value));
  }
}

// "4,4,3,3": positive integers up to plan::kMaxDegree, no empty parts.
std::vector<int> parse_layers_per_stage(const std::string& text) {
  auto bad = [&]() {
    return InputError(fmt::format(
        "--layers-per-stage: expected positive integers separated by commas, got \"{}\"", text));
  };
  std::vector<int> out;
  std::size_t begin = 0;
  while (true) {
    const std::size_t end = std::min(text.find(',', begin), text.size());
    const std::string_view part(text.data() + begin, end - begin);
    std::int64_t n = 0;
    const auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), n);
    if (part.empty() || ec != std::errc() || ptr != part.data() + part.size() || n < 1 ||
        n > plan::kMaxDegree) {
      throw bad();
    }
    out.push_back(static_cast<int>(n));
    if (end == text.size()) return out;
    begin = end + 1;
  }
}
}  // namespace

plan::Plan plan_from_options(const po::variables_map& vm, const model::ModelSpec& model,
                             std::int64_t devices, std::vector<std::string>& notes,
                             const std::optional<PrecisionDefault>& precision_default,
                             const std::string& devices_are) {
  plan::Plan p;
  p.dp = 0;  // derived unless given
  p.global_batch_size = 0;
  if (vm.count("plan")) p = load_plan_file(vm["plan"].as<std::string>());
  for (const char* key : {"tp", "pp", "dp", "cp", "ep", "virtual-stages"}) {
    if (!vm.count(key)) continue;
    const int value = vm[key].as<int>();
    positive(key, value);
    if (value > plan::kMaxDegree) {
      throw InputError(
          fmt::format("--{}: expected at most {}, got {}", key, plan::kMaxDegree, value));
    }
  }
  for (const char* key : {"micro-batch-size", "seq-len"}) {
    if (vm.count(key)) positive(key, vm[key].as<std::int64_t>());
  }
  const auto global_batch = global_batch_from_options(vm);  // or --global-batch
  override_if(vm, "tp", p.tp);
  override_if(vm, "pp", p.pp);
  override_if(vm, "dp", p.dp);
  override_if(vm, "cp", p.cp);
  override_if(vm, "ep", p.ep);
  override_if(vm, "micro-batch-size", p.micro_batch_size);
  if (global_batch) p.global_batch_size = *global_batch;
  override_if(vm, "seq-len", p.seq_len);
  override_if(vm, "virtual-stages", p.virtual_stages);
  override_if(vm, "zero-stage", p.zero_stage);
  if (vm.count("schedule") && !plan::parse_schedule(vm["schedule"].as<std::string>(), p.schedule)) {
    throw InputError(
        fmt::format("--schedule: expected gpipe, 1f1b, interleaved, zero-bubble or "
                    "pipedream, got \"{}\"",
                    vm["schedule"].as<std::string>()));
  }
  if (vm.count("recompute") &&
      !plan::parse_recompute(vm["recompute"].as<std::string>(), p.recompute)) {
    throw InputError(fmt::format("--recompute: expected none, selective or full, got \"{}\"",
                                 vm["recompute"].as<std::string>()));
  }
  attention_from_options(vm, p.attention);
  if (vm.count("optimizer") &&
      !plan::parse_optimizer(vm["optimizer"].as<std::string>(), p.optimizer)) {
    throw InputError(fmt::format("--optimizer: expected adam or sgd, got \"{}\"",
                                 vm["optimizer"].as<std::string>()));
  }
  // --precision and --comm-precision take the same names.
  auto precision_flag = [&vm](const char* flag) {
    return precision_of_flag(flag, vm[flag].as<std::string>());
  };
  if (vm.count("precision")) p.precision = precision_flag("precision");
  const bool precision_given =
      vm.count("precision") ||
      (vm.count("plan") && JsonReader(plan_file_json(vm["plan"].as<std::string>()),
                                      vm["plan"].as<std::string>())
                               .has("precision"));  // (null: absent, as the plan reads it)
  if (!precision_given && precision_default && p.precision != precision_default->precision) {
    p.precision = precision_default->precision;
    notes.push_back(
        fmt::format("precision = {} ({})", to_string(p.precision), precision_default->why));
  }
  if (vm.count("comm-precision")) p.comm_precision = precision_flag("comm-precision");
  if (vm.count("grad-precision")) {
    const std::string& text = vm["grad-precision"].as<std::string>();
    const auto prec = parse_precision(text);
    if (!prec ||
        (*prec != Precision::Fp32 && *prec != Precision::Bf16 && *prec != Precision::Fp16)) {
      throw InputError(
          fmt::format("--grad-precision: expected fp32, bf16 or fp16, got \"{}\"", text));
    }
    p.grad_precision = *prec;
  }
  if (vm.count("grad-compression")) p.grad_compression = vm["grad-compression"].as<double>();
  if (vm.count("expert-load")) p.expert_load = vm["expert-load"].as<double>();
  if (vm.count("clip-grad")) p.clip_grad = vm["clip-grad"].as<double>();
  if (vm.count("sequence-parallel") && vm["sequence-parallel"].as<bool>()) {
    p.sequence_parallel = true;
  } else if (vm.count("plan") && vm.count("tp") && p.tp == 1 && p.sequence_parallel) {
    // A plan file's sequence parallelism under --tp 1, which no flag turns off: dropped, as
    // there is no tp group to split the sequence over.
    p.sequence_parallel = false;
    notes.push_back(fmt::format(
        "sequence parallelism off: {} has it, and --tp 1 leaves no tp group to split the "
        "sequence over",
        vm["plan"].as<std::string>()));
  }
  if (vm.count("no-overlap-grad-reduce") && vm["no-overlap-grad-reduce"].as<bool>()) {
    p.overlap_grad_reduce = false;
  }
  if (vm.count("overlap-param-gather") && vm["overlap-param-gather"].as<bool>()) {
    p.overlap_param_gather = true;
  }
  if (vm.count("zero-in-place") && vm["zero-in-place"].as<bool>()) p.zero_in_place = true;
  if (vm.count("no-overlap-tp-backward") && vm["no-overlap-tp-backward"].as<bool>()) {
    p.overlap_tp_backward = false;
  }
  if (vm.count("no-grad-accumulation-fusion") && vm["no-grad-accumulation-fusion"].as<bool>()) {
    p.grad_accumulation_fusion = false;
  }
  if (vm.count("make-vocab-size-divisible-by")) {
    const auto m = vm["make-vocab-size-divisible-by"].as<std::int64_t>();
    if (m < 1 || m > plan::kMaxVocabMultiple) {
      throw InputError(fmt::format("--make-vocab-size-divisible-by: expected 1 to {}, got {}",
                                   plan::kMaxVocabMultiple, m));
    }
    p.make_vocab_size_divisible_by = static_cast<int>(m);
  }
  if (vm.count("scatter-gather-p2p") && vm["scatter-gather-p2p"].as<bool>()) {
    p.scatter_gather_p2p = true;
  }
  if (vm.count("overlap-p2p-comm") && vm["overlap-p2p-comm"].as<bool>()) {
    p.overlap_p2p_comm = true;
  }
  if (vm.count("layers-per-stage") && !layers_balanced(vm)) {
    p.layers_per_stage = parse_layers_per_stage(vm["layers-per-stage"].as<std::string>());
  }
  if (vm.count("order")) p.order = cluster::Placement::parse_order(vm["order"].as<std::string>());

  const bool dp_derived = p.dp == 0;
  try {
    for (auto& n : plan::complete_plan(p, model, devices)) notes.push_back(std::move(n));
    try {
      for (auto& w : plan::require_valid(p, model, devices)) notes.push_back("warning: " + w);
    } catch (const InputError& e) {
      // A dp that no flag gave, where a broken rule reads it: say where it came from; and
      // where the degrees do not match the devices, what those are.
      const auto errors = plan::check_plan(p, model, devices).errors;
      auto broken = [&](std::initializer_list<std::string_view> rules) {
        return std::any_of(errors.begin(), errors.end(), [&](const auto& v) {
          return std::find(rules.begin(), rules.end(), v.rule) != rules.end();
        });
      };
      std::string hints;
      if (dp_derived && broken({"devices", "batch", "ep-dp", "interleaved-m"})) {
        hints += fmt::format("\n  (dp = {} was derived: the {} devices over tp x pp x cp = {})",
                             p.dp, devices, static_cast<std::int64_t>(p.tp) * p.pp * p.cp);
      }
      const std::string are =
          !devices_are.empty() || !vm.count("gpus")
              ? devices_are
              : fmt::format("the {} devices are those --gpus {} takes of the cluster", devices,
                            devices);
      if (!are.empty() && broken({"devices"})) hints += fmt::format("\n  ({})", are);
      // A plan file's own dp (dtsim plan --out writes it) made for another count of devices:
      // the dp that fits them, where the plan with it breaks no rule.
      const std::int64_t others = static_cast<std::int64_t>(p.tp) * p.pp * p.cp;
      plan::Plan refit = p;
      refit.dp = static_cast<int>(devices / others);
      if (!dp_derived && vm.count("plan") && !vm.count("dp") && broken({"devices"}) &&
          devices % others == 0 && plan::check_plan(refit, model, devices).ok()) {
        hints += fmt::format("\n  (the plan file sets dp = {}; --dp {} fits these {} devices)",
                             p.dp, devices / others, devices);
      }
      if (hints.empty()) throw;
      throw InputError(e.what() + hints);
    }
  } catch (const InputError& e) {
    // A plan read from a file names the file (flags may have overridden some of its fields).
    if (!vm.count("plan")) throw;
    throw InputError(fmt::format("{}: {}", vm["plan"].as<std::string>(), e.what()));
  }
  return p;
}

void add_memory_options(po::options_description& desc) {
  desc.add_options()("framework-overhead-gib", po::value<double>(),
                     "allowance for CUDA context, library workspaces and fragmentation "
                     "(default: the device's where its file gives one, e.g. 0 for a CPU rank, "
                     "else 1, an assumption; calibrate it on your system)")(
      "device-memory-gib", po::value<double>(), "override the device's memory capacity");
}

plan::MemoryOptions memory_options_from(const po::variables_map& vm) {
  plan::MemoryOptions options;
  // Each figure from its flag, else from a --plan file that dtsim plan --out wrote with it
  // (named so in the messages and a note).
  std::optional<JsonReader> file;
  nlohmann::json j;
  if (vm.count("plan")) {
    j = plan_file_json(vm["plan"].as<std::string>());
    if (j.is_object()) file = JsonReader(j, vm["plan"].as<std::string>());
  }
  // (Read as the plan file's reading checks them: the overhead may be 0, the capacity not.)
  const auto figure = [&](const char* flag, const char* field,
                          bool zero) -> std::optional<std::pair<double, std::string>> {
    if (vm.count(flag)) return std::pair{vm[flag].as<double>(), fmt::format("--{}", flag)};
    if (!file || !file->has(field)) return std::nullopt;
    const double v = zero ? file->non_negative_number(field) : file->positive_number(field);
    if (launcher_rank() == 0) {
      std::cerr << fmt::format("note: {}: {} {:g} GiB from the file (--{} sets another)\n",
                               file->file(), field, v, flag);
    }
    return std::pair{v, file->where(field)};
  };
  if (const auto given = figure("framework-overhead-gib", "framework_overhead_gib", true)) {
    const auto& [overhead, who] = *given;
    if (!(overhead >= 0) || !std::isfinite(overhead)) {
      throw InputError(fmt::format("{}: expected a finite number >= 0, got {}", who, overhead));
    }
    // The bounds of a device file's framework_overhead_bytes (device_catalog.hpp).
    const double bytes = overhead * kGiB;
    if (bytes != 0 && !(bytes >= cluster::kLeastOverhead && bytes <= cluster::kMostMemory)) {
      throw InputError(fmt::format(
          "{}: expected 0 or from {:g} MiB to {:g} TiB, got {} GiB (a unit mistake?)", who,
          cluster::kLeastOverhead / kMiB, cluster::kMostMemory / kGiB / 1024, overhead));
    }
    options.framework_overhead_bytes = bytes;
  }
  if (const auto given = figure("device-memory-gib", "device_memory_gib", false)) {
    const auto& [cap, who] = *given;
    if (!(cap > 0) || !std::isfinite(cap)) {
      throw InputError(fmt::format("{}: expected a finite number > 0, got {}", who, cap));
    }
    // The bounds of a device file's memory_bytes (device_catalog.hpp).
    options.capacity_bytes = cap * kGiB;
    if (!(*options.capacity_bytes >= cluster::kLeastMemory &&
          *options.capacity_bytes <= cluster::kMostMemory)) {
      throw InputError(
          fmt::format("{}: expected from {:g} MiB to {:g} TiB, got {} GiB (a unit "
                      "mistake?)",
                      who, cluster::kLeastMemory / kMiB, cluster::kMostMemory / kGiB / 1024, cap));
    }
  }
  return options;
}

void require_symmetric_placement(const plan::Plan& plan, const cluster::Cluster& cluster) {
  const cluster::Placement placement(plan.degrees(), plan.order);
  if (!placement.symmetric_on(cluster.devices_per_node)) {
    throw InputError(fmt::format(
        "placement: with order {} the groups of plan {} straddle the {}-device nodes of {} "
        "unevenly (each product of degrees in that order must divide the node size or be a "
        "multiple of it); the simulator needs every group of a kind to have the same shape",
        cluster::Placement::to_string(plan.order), plan::summary(plan), cluster.devices_per_node,
        cluster.name));
  }
}

std::optional<std::string> profile_host_note(const cost::Profile& profile,
                                             const cluster::Cluster& cluster,
                                             std::string_view runs) {
  // Ranks of one host share its cores and memory bandwidth: rates measured by another number
  // of ranks at once are not this plan's (on a 2-core VM a one-rank profile's GEMMs ran
  // OpenBLAS on both cores, a rank of two on one).
  if (cluster.intra.fabric != cluster::IntraFabric::SharedMemory || profile.ranks_per_host <= 0) {
    return std::nullopt;
  }
  const std::int64_t here = std::min(cluster.devices_per_node, cluster.devices());
  if (here == profile.ranks_per_host) return std::nullopt;
  return fmt::format(
      "profile {} was measured by {} rank{} at once on its host, sharing its cores and memory "
      "bandwidth; {} {} on each host: its rates may be off (calibrate with mpirun -np {} dtexec "
      "calibrate)",
      profile.file, profile.ranks_per_host, profile.ranks_per_host == 1 ? "" : "s", runs, here,
      here);
}

std::vector<std::string> profile_notes(const cost::Profile& profile,
                                       const cluster::Cluster* cluster) {
  std::vector<std::string> notes;
  notes.push_back(
      fmt::format("compute cost from calibration profile {} ({})", profile.file, profile.source));
  if (cluster != nullptr) {
    if (auto note = profile_host_note(profile, *cluster)) notes.push_back(std::move(*note));
  }
  if (profile.in_run) {
    notes.push_back(fmt::format(
        "the profile's kernel times scaled by what they measured in a training step: forward "
        "x{:.3f}, backward x{:.3f}, optimizer x{:.3f} (its in_run)",
        profile.in_run->forward, profile.in_run->backward, profile.in_run->optimizer));
  }
  if (profile.loss_split_evenly) {
    notes.push_back(
        "the profile times the cross-entropy whole (dtexec calibrate before 2026-12-03): its "
        "forward time is split evenly between the loss statistics and the loss");
  }
  return notes;
}

std::vector<std::string> profile_warnings(const cost::Profile& profile,
                                          const cluster::DeviceSpec& device) {
  auto lower = [](std::string text) {
    for (char& ch : text) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    return text;
  };
  const std::string measured = lower(profile.device);
  const bool same = measured == lower(device.name) ||
                    std::any_of(device.aliases.begin(), device.aliases.end(),
                                [&](const std::string& alias) { return measured == lower(alias); });
  if (!same) {
    return {fmt::format(
        "warning: profile {} was measured on {}, the cluster's devices are {}: its times are "
        "used as if measured there",
        profile.file, profile.device, device.name)};
  }
  // Rates against the catalog's figures where those are a datasheet's (a peak that dtexec
  // calibrate measured, a CPU host's, is one host's rate, not a ceiling): past them a timing went
  // wrong, and far below them (under 1% of the figure) the profile times something else than the
  // device, a unit mistake or a host that was busy. Sanity bounds for a warning, not model
  // constants: 5% over a peak is beyond what clocks above the rated boost give, and an op's
  // bytes may run up to 3x the memory bandwidth from cache, no more.
  std::vector<std::string> warnings;
  if (!profile.precision_stated) {
    // (dtexec calibrate writes it: a file without it was written by hand or by an older tool.)
    warnings.push_back(fmt::format(
        "warning: profile {} does not say the precision it measured (no \"precision\"): taken "
        "as bf16",
        profile.file));
  }
  const auto datasheet = [](const Figure& f) { return f.source.rfind("dtexec calibrate", 0) != 0; };
  const auto warn = [&](const std::string& what, double rate, double figure, const char* unit,
                        const std::string& whose) {
    warnings.push_back(fmt::format(
        "warning: profile {}: {} ran at {:.4g} {}, {} the {} {} of {:.4g} {} ({}); its times are "
        "used as measured",
        profile.file, what, rate, unit, rate > figure ? "above" : "under 1% of", device.name, whose,
        figure, unit, rate > figure ? "a timing error?" : "a unit mistake or a busy host?"));
  };
  if (device.supports(profile.precision) && datasheet(device.peak_flops.at(profile.precision))) {
    const double peak = device.peak_flops.at(profile.precision).value / 1e12;
    const std::string whose = fmt::format("peak at {}", to_string(profile.precision));
    const auto rate = [](const cost::GemmSample& g) { return g.flops() / g.seconds / 1e12; };
    const auto fastest =
        std::max_element(profile.gemm.begin(), profile.gemm.end(),
                         [&](const auto& a, const auto& b) { return rate(a) < rate(b); });
    if (fastest != profile.gemm.end() &&
        (rate(*fastest) > 1.05 * peak || rate(*fastest) < 0.01 * peak)) {
      warn(fmt::format("its fastest GEMM m={:g} n={:g} k={:g}", fastest->m, fastest->n, fastest->k),
           rate(*fastest), peak, "TFLOP/s", whose);
    }
    for (const auto& [key, op] : profile.ops) {
      const double r = op.rate / 1e12;
      if (op.flops && (r > 1.05 * peak || r < 0.01 * peak)) {
        warn(fmt::format("its {} {}", key.first, key.second), r, peak, "TFLOP/s", whose);
      }
    }
  }
  if (datasheet(device.memory_bw_bytes_per_s)) {
    const double bw = device.memory_bw_bytes_per_s.value / 1e9;
    if (profile.memory_bw_bytes_per_s) {
      const double r = *profile.memory_bw_bytes_per_s / 1e9;
      if (r > 1.05 * bw || r < 0.01 * bw) {
        warn("its streaming kernels", r, bw, "GB/s", "memory bandwidth");
      }
    }
    for (const auto& [key, op] : profile.ops) {
      const double r = op.rate / 1e9;
      if (!op.flops && (r > 3 * bw || r < 0.01 * bw)) {
        warn(fmt::format("its {} {}", key.first, key.second), r, bw, "GB/s", "memory bandwidth");
      }
    }
  }
  return warnings;
}

Precision precision_of_flag(std::string_view flag, const std::string& text) {
  const auto prec = parse_precision(text);
  if (!prec) {
    throw InputError(
        fmt::format("--{}: expected bf16, fp16, fp8, fp32 or tf32, got \"{}\"", flag, text));
  }
  return *prec;
}

Precision default_precision(const cluster::DeviceSpec& device) {
  // Mixed precision where the device has a 16-bit format: bf16, else fp16 (a V100 or T4, which
  // Megatron-LM trains with --fp16 and loss scaling); a device with neither (a CPU host) fp32.
  // One with none of the three keeps bf16, whose refusal names what it has.
  for (const Precision p : {Precision::Bf16, Precision::Fp16, Precision::Fp32}) {
    if (device.supports(p)) return p;
  }
  return Precision::Bf16;
}

bool layers_balanced(const po::variables_map& vm) {
  return vm.count("layers-per-stage") && vm["layers-per-stage"].as<std::string>() == "balanced";
}

PlanSetup setup_from_options(const po::variables_map& vm) {
  model::ModelSpec spec = model_from_options(vm);
  cluster::Cluster cluster = cluster_from_options(vm);
  std::vector<std::string> notes;
  if (const auto off = dropout_off_by(vm)) {
    notes.push_back(fmt::format("{} without its dropout layers ({})", spec.name, *off));
  }
  // The default precision (bf16) on a device without it: fp16 (a V100), or fp32 (a CPU host),
  // said so. A precision asked for explicitly is checked as given.
  const Precision usual = plan::Plan{}.precision;
  const Precision fitting = default_precision(cluster.device);
  std::optional<PrecisionDefault> fallback;
  if (fitting != usual) {
    fallback = PrecisionDefault{
        fitting, fmt::format("device {} has no {}", cluster.device.name, to_string(usual))};
  }
  plan::Plan plan = plan_from_options(vm, spec, cluster.devices(), notes, fallback);
  if (!plan.grad_precision && plan::gradient_precision(plan) != plan.precision &&
      plan.precision != Precision::Tf32) {
    notes.push_back(fmt::format(
        "gradients in {} (as Megatron-LM accumulates and all-reduces them when training in {}; "
        "--grad-precision bf16 for 16-bit ones)",
        to_string(plan::gradient_precision(plan)), to_string(plan.precision)));
  }
  cluster.device.peak_flops_for(plan.precision);
  if (auto note = plan::vocab_padding_note(spec, plan)) notes.push_back(std::move(*note));
  model::ModelGraph graph = plan::graph_of(spec, plan);
  if (layers_balanced(vm)) {
    // dtsim plan's split for this plan (planner::balanced_split), by the closed-form estimate
    // with --profile where given, and the memory model.
    std::optional<cost::Profile> profile;
    planner::SearchOptions search;
    if (const auto file = profile_argument(vm)) {
      profile = cost::load_profile(*file);
      search.profile = &*profile;
    }
    if (plan.pp < 2) {
      notes.push_back("--layers-per-stage balanced: one pipeline stage, nothing to balance");
    } else if (const auto split =
                   planner::balanced_split(graph, plan, cluster, search, memory_options_from(vm))) {
      plan.layers_per_stage = split->layers_per_stage;
      notes.push_back(fmt::format(
          "--layers-per-stage balanced: {} (dtsim plan's search by the closed-form estimate: "
          "{:.4g} s a step against {:.4g} s with the even split)",
          fmt::join(plan.layers_per_stage, ","), split->estimate_s, split->even_estimate_s));
    } else {
      notes.push_back(fmt::format(
          "--layers-per-stage balanced: the even split (no uneven one that fits saves {:g}% of "
          "the estimated step)",
          100 * planner::kBalanceGain));
    }
  }
  if (auto note = plan::uneven_layers_note(spec, plan)) notes.push_back(std::move(*note));
  return PlanSetup{std::move(spec), std::move(cluster), std::move(plan), std::move(notes),
                   std::move(graph)};
}

}  // namespace dtsim::cli
