// Bad input never crashes and never yields a silent number: every field of shipped inputs
// (models, a Hugging Face config, clusters, devices, plans, calibration profiles, traces) is
// replaced, one at a time, by a value of the wrong kind or out of range, or removed, and the
// commands that read it run in-process. Each either runs, printing no NaN or infinity, or
// refuses with an InputError or UnsupportedError (exit code 2) whose message names the file and
// the field changed; never another exception (exit code 1: an internal error) nor a crash.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "sim/cli/commands.hpp"
#include "sim/common/error.hpp"
#include "tests/json_mutants.hpp"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path repo() {
  return fs::path(DTSIM_TEST_REPO_DIR);
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

// A folder of this test's files, removed with the object.
class Scratch {
 public:
  explicit Scratch(const std::string& name)
      : dir_(fs::temp_directory_path() /
             fmt::format("dtsim_mutation_{}_{}", name, static_cast<long>(::getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  ~Scratch() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  fs::path write(const std::string& name, const json& j) const {
    const fs::path path = dir_ / name;
    std::ofstream(path) << j.dump(2);
    return path;
  }
  fs::path path(const std::string& name) const { return dir_ / name; }

 private:
  fs::path dir_;
};

// What a command did with an input.
struct Outcome {
  enum Kind { Ran, Refused, Failed } kind = Ran;
  std::string text;  // the exception's message, or what the command printed
};

// Runs the dtsim program with `args` (a subcommand first), stdout and stderr in `capture`:
// exit code 0 ran, 2 refused, anything else (1, a signal) failed.
Outcome run_program(const std::vector<std::string>& args, const fs::path& capture) {
  std::string line = "'" DTSIM_PROGRAM "'";
  for (const std::string& a : args) line += " '" + a + "'";
  line += " >'" + capture.string() + "' 2>&1";
  const int status = std::system(line.c_str());
  std::ifstream in(capture);
  std::stringstream text;
  text << in.rdbuf();
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (code == 0) return {Outcome::Ran, text.str()};
  // The message after "error: " or "unsupported: " (an empty one is reported as such).
  const std::string out = text.str();
  for (const char* tag : {"error: ", "unsupported: "}) {
    if (const auto at = out.find(tag); code == 2 && at != std::string::npos) {
      return {Outcome::Refused, out.substr(at + std::string(tag).size())};
    }
  }
  return {Outcome::Failed,
          fmt::format("exit status {:#x} (code {}): {}", status, code, out.substr(0, 2000))};
}

// While it lives, stdout and stderr (the descriptors and their streams) go to a file; put back
// however the scope ends.
class Redirect {
 public:
  explicit Redirect(const fs::path& file) {
    flush();
    saved_out_ = ::dup(1);
    saved_err_ = ::dup(2);
    const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ok_ = saved_out_ >= 0 && saved_err_ >= 0 && fd >= 0 && ::dup2(fd, 1) >= 0 && ::dup2(fd, 2) >= 0;
    if (fd >= 0) ::close(fd);
  }
  ~Redirect() {
    flush();
    for (auto [saved, fd] : {std::pair{saved_out_, 1}, std::pair{saved_err_, 2}}) {
      if (saved >= 0) {
        ::dup2(saved, fd);
        ::close(saved);
      }
    }
  }
  Redirect(const Redirect&) = delete;
  Redirect& operator=(const Redirect&) = delete;
  bool ok() const { return ok_; }

 private:
  static void flush() {
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
  }
  int saved_out_ = -1, saved_err_ = -1;
  bool ok_ = false;
};

// Runs `command` with stdout and stderr in a file (read back into the outcome where it ran or
// returned a code); a null command runs the dtsim program instead (run_program). Exit codes as
// main() gives them: 0 ran, an input error or 2 refused, anything else failed.
Outcome run(int (*command)(const std::vector<std::string>&), const std::vector<std::string>& args,
            const fs::path& capture) {
  if (command == nullptr) return run_program(args, capture);
  Outcome outcome;
  int code = 0;
  {
    const Redirect redirect(capture);
    if (!redirect.ok()) return {Outcome::Failed, "could not redirect stdout and stderr"};
    try {
      code = command(args);
    } catch (const dtsim::InputError& e) {
      outcome = {Outcome::Refused, e.what()};
    } catch (const dtsim::UnsupportedError& e) {
      outcome = {Outcome::Refused, e.what()};
    } catch (const std::exception& e) {
      outcome = {Outcome::Failed, fmt::format("internal error: {}", e.what())};
    } catch (...) {
      outcome = {Outcome::Failed, "an exception that is not a std::exception"};
    }
  }
  if (outcome.kind == Outcome::Ran) {
    std::ifstream in(capture);
    std::stringstream text;
    text << in.rdbuf();
    outcome.text = text.str();
    if (code == 2) outcome.kind = Outcome::Refused;
    if (code != 0 && code != 2) {
      outcome = {Outcome::Failed,
                 fmt::format("returned {}: {}", code, outcome.text.substr(0, 2000))};
    }
  }
  return outcome;
}

// A number printed as NaN or infinity ("nan", "-inf", "Infinity", any case), as fmt and
// iostreams spell them, not inside a word ("InfiniBand", "info"). (JSON output writes them as
// null, which this cannot tell from a field that is null by design: the checks read tables.)
bool prints_non_finite(const std::string& text) {
  static const std::regex word(R"((^|[^A-Za-z_])-?(nan|inf|infinity)([^A-Za-z_]|$))",
                               std::regex::icase);
  return std::regex_search(text, word);
}

using Command = int (*)(const std::vector<std::string>&);
struct Invocation {
  const char* name;
  Command command;  // null: the dtsim program, args starting with its subcommand
  std::vector<std::string> args;
  // Where it refuses, the later invocations are not run (a cheap in-process reading of the
  // input in front of a process started for each).
  bool stop_if_refused = false;
};

// What is wrong with an outcome; nothing where it ran printing finite numbers or refused
// with a message, which for a changed `file` and `field` (where given) must name them: the
// standard's "a clear message naming file, field and expectation".
std::optional<std::string> problem(const Outcome& o, const std::string& file = "",
                                   const std::string& field = "") {
  if (o.kind == Outcome::Failed) return o.text;
  if (o.kind == Outcome::Ran && prints_non_finite(o.text)) return "printed a NaN or infinity";
  if (o.kind != Outcome::Refused) return std::nullopt;
  if (o.text.empty()) return "refused without a message";
  if (o.text.find(file) == std::string::npos) {
    return fmt::format("refused without naming {}: {}", file, o.text.substr(0, 300));
  }
  // (A plan's rules across fields, "invalid plan (dp=2 ... gbs=16 ...): - ...", name the
  // plan's every value and the rule broken, in the terms of the flags.)
  // (As a word: "tp" inside "output" names nothing.)
  std::string escaped;
  for (const char c : field) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') escaped += '\\';
    escaped += c;
  }
  const std::regex word("(^|[^A-Za-z0-9_])" + escaped + "([^A-Za-z0-9_]|$)");
  if (!std::regex_search(o.text, word) && o.text.find("invalid plan (") == std::string::npos) {
    return fmt::format("refused without naming the field {}: {}", field, o.text.substr(0, 300));
  }
  return std::nullopt;
}

// A count of runs and refusals, and the first failures, one a line.
std::string summary(int runs, int refusals, const std::vector<std::string>& failures) {
  std::string text =
      fmt::format("{} runs, {} refusals, {} failures", runs, refusals, failures.size());
  for (std::size_t i = 0; i < failures.size() && i < 25; ++i) text += "\n" + failures[i];
  return text;
}

// Runs every invocation on every mutant of `base` (written to `file` in `scratch`; the
// invocations name it as `file`'s path) and checks the outcomes. The unchanged input must run.
void check_mutants(const Scratch& scratch, const std::string& file, const json& base,
                   const std::vector<Invocation>& invocations) {
  const fs::path capture = scratch.path("output.txt");
  scratch.write(file, base);
  for (const Invocation& inv : invocations) {
    const Outcome as_shipped = run(inv.command, inv.args, capture);
    INFO(inv.name << " on the unchanged " << file << ": " << as_shipped.text.substr(0, 2000));
    REQUIRE(as_shipped.kind == Outcome::Ran);
    REQUIRE(!problem(as_shipped));
  }
  std::vector<std::string> failures;
  int ran = 0, refused = 0;
  for (const dtsim::test::Mutant& m : dtsim::test::mutants(base)) {
    scratch.write(file, m.value);
    for (const Invocation& inv : invocations) {
      const Outcome o = run(inv.command, inv.args, capture);
      if (const auto what = problem(o, file, m.field)) {
        failures.push_back(fmt::format("{} with {}: {}", inv.name, m.change, *what));
      }
      (o.kind == Outcome::Ran ? ran : refused) += 1;
      if (o.kind == Outcome::Refused && inv.stop_if_refused) break;
    }
  }
  INFO(file << ": " << summary(ran, refused, failures));
  CHECK(failures.empty());
  CHECK(refused > 0);  // the wrong values were read
}

}  // namespace

TEST_CASE("mutated models: simulate, plan and describe refuse or run", "[mutation][model]") {
  Scratch scratch("model");
  const std::string model = scratch.path("model.json").string();
  const std::vector<std::string> plan = {"--cluster", "dgx-h100-superpod",   "--gpus",
                                         "16",        "--global-batch-size", "16"};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.end(), plan.begin(), plan.end());
    return a;
  };
  const std::vector<Invocation> commands = {
      {"simulate", dtsim::cli::cmd_simulate,
       with({"--model", model, "--tp", "2", "--pp", "2", "--seq-len", "64"})},
      {"plan", dtsim::cli::cmd_plan, with({"--model", model, "--seq-len", "64"})},
      {"describe", dtsim::cli::cmd_describe, {"--model", model}}};
  for (const char* name : {"tiny-gpt", "llama3-8b", "mixtral-8x7b"}) {
    INFO(name);
    check_mutants(scratch, "model.json",
                  read_json(repo() / "models" / (std::string(name) + ".json")), commands);
  }
  // Mixtral with dense blocks among the experts' (moe.dense_blocks, moe.dense_ffn_hidden).
  json mixed = read_json(repo() / "models" / "mixtral-8x7b.json");
  mixed["moe"]["dense_blocks"] = {0, 2};
  mixed["moe"]["dense_ffn_hidden"] = 28672;
  check_mutants(scratch, "model.json", mixed, commands);
  // Multi-head latent attention (mla), with a query latent, beside dense blocks and experts.
  json latent = read_json(repo() / "models" / "deepseek-v2-lite-16b.json");
  latent["mla"]["q_lora_rank"] = 1536;
  check_mutants(scratch, "model.json", latent, commands);
}

TEST_CASE("a mutated Hugging Face config.json: describe and simulate refuse or run",
          "[mutation][model]") {
  Scratch scratch("hf");
  const std::string config = scratch.path("config.json").string();
  const json llama = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"hidden_size", 1024},
                      {"intermediate_size", 2816},
                      {"num_hidden_layers", 4},
                      {"num_attention_heads", 16},
                      {"num_key_value_heads", 4},
                      {"vocab_size", 32000},
                      {"max_position_embeddings", 2048},
                      {"rope_theta", 10000.0},
                      {"tie_word_embeddings", false}};
  check_mutants(scratch, "config.json", llama,
                {{"describe", dtsim::cli::cmd_describe, {"--model", config}},
                 {"simulate",
                  dtsim::cli::cmd_simulate,
                  {"--model", config, "--cluster", "dgx-h100-superpod", "--gpus", "8", "--tp", "2",
                   "--global-batch-size", "8"}}});
  // A qwen3_moe one: experts of moe_intermediate_size, heads wider than the model, the keys
  // that place dense blocks among the experts' (intermediate_size their width) and refuse
  // shared experts.
  const json qwen3_moe = {{"architectures", {"Qwen3MoeForCausalLM"}},
                          {"model_type", "qwen3_moe"},
                          {"hidden_size", 512},
                          {"intermediate_size", 1536},
                          {"moe_intermediate_size", 192},
                          {"num_hidden_layers", 4},
                          {"num_attention_heads", 8},
                          {"num_key_value_heads", 2},
                          {"head_dim", 128},
                          {"num_experts", 16},
                          {"num_experts_per_tok", 4},
                          {"decoder_sparse_step", 1},
                          {"mlp_only_layers", json::array()},
                          {"norm_topk_prob", true},
                          {"vocab_size", 32000},
                          {"max_position_embeddings", 2048},
                          {"tie_word_embeddings", false}};
  // (Both mixtures described, and simulated with tp and ep.)
  const std::vector<Invocation> mixture_commands = {
      {"describe", dtsim::cli::cmd_describe, {"--model", config}},
      {"simulate",
       dtsim::cli::cmd_simulate,
       {"--model", config, "--cluster", "dgx-h100-superpod", "--gpus", "8", "--tp", "2", "--ep",
        "2", "--global-batch-size", "8"}}};
  check_mutants(scratch, "config.json", qwen3_moe, mixture_commands);
  // A glm4_moe one: dense first blocks, shared experts by count, the router's figures.
  const json glm4_moe = {{"architectures", {"Glm4MoeForCausalLM"}},
                         {"model_type", "glm4_moe"},
                         {"hidden_size", 512},
                         {"intermediate_size", 1536},
                         {"moe_intermediate_size", 192},
                         {"num_hidden_layers", 4},
                         {"num_attention_heads", 8},
                         {"num_key_value_heads", 2},
                         {"head_dim", 64},
                         {"n_routed_experts", 16},
                         {"n_shared_experts", 1},
                         {"num_experts_per_tok", 4},
                         {"first_k_dense_replace", 1},
                         {"routed_scaling_factor", 2.5},
                         {"n_group", 1},
                         {"partial_rotary_factor", 0.5},
                         {"attention_bias", true},
                         {"use_qk_norm", true},
                         {"num_nextn_predict_layers", 1},
                         {"vocab_size", 32000},
                         {"max_position_embeddings", 2048}};
  check_mutants(scratch, "config.json", glm4_moe, mixture_commands);
  // A deepseek_v3 one: glm4_moe's experts and router figures, latent attention instead of its
  // heads' projections, its groups and scores said.
  json deepseek = glm4_moe;
  for (const char* key : {"head_dim", "partial_rotary_factor", "use_qk_norm"}) deepseek.erase(key);
  deepseek.update({{"architectures", {"DeepseekV3ForCausalLM"}},
                   {"model_type", "deepseek_v3"},
                   {"attention_bias", false},
                   {"num_key_value_heads", 8},
                   {"q_lora_rank", 96},
                   {"kv_lora_rank", 64},
                   {"qk_nope_head_dim", 32},
                   {"qk_rope_head_dim", 16},
                   {"v_head_dim", 32},
                   {"moe_layer_freq", 1},
                   {"n_group", 4},
                   {"topk_group", 2},
                   {"scoring_func", "sigmoid"},
                   {"topk_method", "noaux_tc"},
                   {"norm_topk_prob", true}});
  check_mutants(scratch, "config.json", deepseek, mixture_commands);
}

TEST_CASE("mutated clusters: simulate, memory and export-platform refuse or run",
          "[mutation][cluster]") {
  Scratch scratch("cluster");
  const std::string cluster = scratch.path("cluster.json").string();
  for (const char* name : {"dgx-h100-superpod", "cpu-host"}) {
    INFO(name);
    const std::string gpus = std::string(name) == "cpu-host" ? "2" : "16";
    const std::vector<std::string> common = {
        "--model", "tiny-gpt", "--cluster",           cluster, "--gpus", gpus,
        "--tp",    "2",        "--global-batch-size", "8"};
    auto with = [&](std::vector<std::string> a) {
      a.insert(a.begin(), common.begin(), common.end());
      return a;
    };
    check_mutants(scratch, "cluster.json",
                  read_json(repo() / "topologies" / (std::string(name) + ".json")),
                  {{"simulate", dtsim::cli::cmd_simulate, with({})},
                   {"memory", dtsim::cli::cmd_memory, with({})},
                   {"export-platform", dtsim::cli::cmd_export_platform, with({})}});
  }
}

// SimGrid builds one platform per process: each cluster that dtsim memory accepts in-process
// is simulated by a dtsim process of its own.
TEST_CASE("a mutated cluster: simulate --network simgrid refuses or runs",
          "[mutation][cluster][simgrid]") {
  Scratch scratch("simgrid");
  const std::vector<std::string> args = {"--model",
                                         "tiny-gpt",
                                         "--cluster",
                                         scratch.path("cluster.json").string(),
                                         "--gpus",
                                         "16",
                                         "--tp",
                                         "2",
                                         "--global-batch-size",
                                         "8"};
  std::vector<std::string> simulate = {"simulate", "--network", "simgrid"};
  simulate.insert(simulate.end(), args.begin(), args.end());
  check_mutants(scratch, "cluster.json", read_json(repo() / "topologies/dgx-h100-superpod.json"),
                {{"memory", dtsim::cli::cmd_memory, args, /*stop_if_refused=*/true},
                 {"dtsim simulate --network simgrid", nullptr, simulate}});
}

// The harness itself: an exception other than an input error is a failure, as is a NaN or
// an infinity printed; an input error is a refusal.
TEST_CASE("the mutation harness tells refusals, failures and non-finite output apart",
          "[mutation]") {
  Scratch scratch("harness");
  const fs::path capture = scratch.path("output.txt");
  const auto refuses = [](const std::vector<std::string>&) -> int {
    throw dtsim::InputError("x.json: field: expected a number");
  };
  const auto breaks = [](const std::vector<std::string>&) -> int {
    throw std::out_of_range("vector::at");
  };
  const auto prints_nan = [](const std::vector<std::string>&) {
    fmt::print("step time {} s\n", std::numeric_limits<double>::quiet_NaN());
    return 0;
  };
  const auto prints_fine = [](const std::vector<std::string>&) {
    fmt::print("InfiniBand, info: 1.5 s\n");
    return 0;
  };
  const Outcome refused = run(refuses, {}, capture);
  CHECK(refused.kind == Outcome::Refused);
  CHECK(!problem(refused));
  CHECK(!problem(refused, "x.json", "field"));
  // A refusal that names neither the file nor the field changed is a failure.
  CHECK(problem(refused, "y.json", "field") ==
        std::optional<std::string>("refused without naming y.json: x.json: field: expected a "
                                   "number"));
  CHECK(problem(refused, "x.json", "other") ==
        std::optional<std::string>("refused without naming the field other: x.json: field: "
                                   "expected a number"));
  CHECK(run(breaks, {}, capture).kind == Outcome::Failed);
  CHECK(problem(run(prints_nan, {}, capture)) ==
        std::optional<std::string>("printed a NaN or infinity"));
  const Outcome fine = run(prints_fine, {}, capture);
  CHECK(fine.kind == Outcome::Ran);
  CHECK(fine.text == "InfiniBand, info: 1.5 s\n");
  CHECK(!problem(fine));
  const Outcome refused_program = run(nullptr, {"simulate", "--model", "no-such-model"}, capture);
  CHECK(refused_program.kind == Outcome::Refused);
  CHECK(refused_program.text.find("no-such-model") != std::string::npos);
}

TEST_CASE("a mutated device: simulate refuses or runs", "[mutation][cluster]") {
  Scratch scratch("device");
  json cluster = read_json(repo() / "topologies" / "dgx-h100-superpod.json");
  cluster["device"] = scratch.path("device.json").string();
  const std::string cluster_file = scratch.write("cluster.json", cluster).string();
  check_mutants(scratch, "device.json", read_json(repo() / "topologies/devices/h100-sxm.json"),
                {{"simulate",
                  dtsim::cli::cmd_simulate,
                  {"--model", "tiny-gpt", "--cluster", cluster_file, "--gpus", "8", "--tp", "2",
                   "--global-batch-size", "8"}}});
}

TEST_CASE("a mutated plan: simulate, memory and lower refuse or run", "[mutation][plan]") {
  Scratch scratch("plan");
  const std::string plan_file = scratch.path("plan.json").string();
  const json plan = {{"dp", 2},
                     {"tp", 2},
                     {"pp", 2},
                     {"micro_batch_size", 1},
                     {"global_batch_size", 16},
                     {"seq_len", 64},
                     {"schedule", "interleaved"},
                     {"virtual_stages", 2},
                     {"sequence_parallel", true},
                     {"zero_stage", 1},
                     {"recompute", "selective"},
                     {"overlap_grad_reduce", true},
                     {"precision", "bf16"},
                     {"clip_grad", 1.0}};
  const std::vector<std::string> common = {"--model",           "cpu-small", "--cluster",
                                           "dgx-h100-superpod", "--plan",    plan_file};
  check_mutants(scratch, "plan.json", plan,
                {{"simulate", dtsim::cli::cmd_simulate, common},
                 {"memory", dtsim::cli::cmd_memory, common},
                 {"lower", dtsim::cli::cmd_lower, common}});
}

TEST_CASE("a mutated calibration profile: simulate refuses or runs", "[mutation][profile]") {
  Scratch scratch("profile");
  check_mutants(
      scratch, "profile.json", read_json(repo() / "tests/cli/data/profile_cpu_tiny.json"),
      {{"simulate",
        dtsim::cli::cmd_simulate,
        {"--model", "tiny-gpt", "--cluster", "cpu-host", "--dp", "2", "--global-batch-size", "4",
         "--profile", scratch.path("profile.json").string()}}});
}

TEST_CASE("a mutated trace: validate refuses or runs", "[mutation][trace]") {
  Scratch scratch("trace");
  const json trace = {{"traceEvents",
                       {{{"ph", "M"},
                         {"name", "thread_name"},
                         {"pid", 0},
                         {"tid", 0},
                         {"args", {{"name", "compute"}}}},
                        {{"ph", "M"},
                         {"name", "process_name"},
                         {"pid", 0},
                         {"args", {{"name", "rank 0"}, {"represents", {0, 1}}}}},
                        {{"ph", "X"},
                         {"name", "fwd"},
                         {"pid", 0},
                         {"tid", 0},
                         {"ts", 0},
                         {"dur", 5},
                         {"args", {{"task", 0}, {"phase", "fwd"}, {"step", 0}}}},
                        {{"ph", "X"},
                         {"name", "all_reduce"},
                         {"pid", 0},
                         {"tid", 1},
                         {"ts", 5},
                         {"dur", 3},
                         {"args", {{"task", 1}, {"phase", "dp"}, {"step", 0}}}}}}};
  const std::string other = scratch.write("other.json", trace).string();
  const std::string mutated = scratch.path("trace.json").string();
  check_mutants(scratch, "trace.json", trace,
                {{"validate --measured",
                  dtsim::cli::cmd_validate,
                  {"--predicted", other, "--measured", mutated, "--tasks"}},
                 {"validate --predicted",
                  dtsim::cli::cmd_validate,
                  {"--predicted", mutated, "--measured", other}}});
}

namespace {

// The flags taking a value that `command --help` lists.
std::vector<std::string> flags_of(Command command, const fs::path& capture) {
  const Outcome help = run(command, {"--help"}, capture);
  REQUIRE(help.kind == Outcome::Ran);
  std::vector<std::string> flags;
  static const std::regex flag(R"(\n  --([a-z0-9-]+) arg)");
  for (auto it = std::sregex_iterator(help.text.begin(), help.text.end(), flag);
       it != std::sregex_iterator(); ++it) {
    flags.push_back("--" + (*it)[1].str());
  }
  return flags;
}

// `base` with flag's value set to `value` (replaced where base gives it, else added).
std::vector<std::string> with_flag(std::vector<std::string> base, const std::string& flag,
                                   const std::string& value) {
  for (std::size_t i = 0; i + 1 < base.size(); ++i) {
    if (base[i] == flag) {
      base[i + 1] = value;
      return base;
    }
  }
  base.push_back(flag);
  base.push_back(value);
  return base;
}

}  // namespace

TEST_CASE("every flag of simulate, memory, plan and whatif given a wrong value refuses or runs",
          "[mutation][flags]") {
  Scratch scratch("flags");
  const fs::path capture = scratch.path("output.txt");
  struct Base {
    const char* name;
    Command command;
    std::vector<std::string> args;
  };
  const std::vector<std::string> common = {
      "--model", "tiny-gpt", "--cluster",           "dgx-h100-superpod",
      "--gpus",  "16",       "--global-batch-size", "16"};
  auto with = [&](std::vector<std::string> a) {
    a.insert(a.begin(), common.begin(), common.end());
    return a;
  };
  const std::vector<Base> bases = {
      {"simulate", dtsim::cli::cmd_simulate, with({"--tp", "2", "--tokens", "1e9"})},
      {"memory", dtsim::cli::cmd_memory, with({"--tp", "2"})},
      {"plan", dtsim::cli::cmd_plan, with({"--tokens", "1e9", "--top", "2"})},
      {"whatif", dtsim::cli::cmd_whatif, with({"--vary", "gpus=8,16", "--tokens", "1e9"})},
  };
  // Values of the wrong kind or range; files written by a flag (--trace, --out) are left out.
  const std::vector<std::string> values = {"0",    "-1",  "0.5",       "1e300", "1e-300",
                                           "1e19", "nan", "inf",       "-inf",  "x",
                                           "",     "1,2", "2147483648"};
  // And the swept inputs of whatif --vary.
  const std::vector<std::string> sweeps = {"gpus=0",
                                           "gpus=x",
                                           "gpus=7,nan",
                                           "nic_gbps=-1",
                                           "nic_gbps=inf",
                                           "latency_us=nan",
                                           "oversubscription=0",
                                           "device=no-such-gpu",
                                           "global_batch_size=0",
                                           "seq_len=1e19",
                                           "cluster=",
                                           "attention=x",
                                           "model=",
                                           "=8",
                                           "gpus",
                                           "no_such_key=1"};
  std::vector<std::string> failures;
  int runs = 0, refusals = 0;
  auto check = [&](const Base& b, const std::vector<std::string>& args, const std::string& change) {
    const Outcome o = run(b.command, args, capture);
    if (const auto what = problem(o)) {
      failures.push_back(fmt::format("{} {}: {}", b.name, change, *what));
    }
    (o.kind == Outcome::Ran ? runs : refusals) += 1;
  };
  for (const Base& b : bases) {
    const Outcome as_given = run(b.command, b.args, capture);
    INFO(b.name << " as given: " << as_given.text.substr(0, 2000));
    REQUIRE(as_given.kind == Outcome::Ran);
    REQUIRE(!problem(as_given));
    const std::vector<std::string> flags = flags_of(b.command, capture);
    CHECK(flags.size() > 10);
    for (const std::string& flag : flags) {
      if (flag == "--trace" || flag == "--out") continue;
      for (const std::string& v : values) {
        check(b, with_flag(b.args, flag, v), fmt::format("{} '{}'", flag, v));
      }
    }
  }
  for (const std::string& sweep : sweeps) {
    check(bases[3], with_flag(bases[3].args, "--vary", sweep), fmt::format("--vary '{}'", sweep));
  }
  INFO(summary(runs, refusals, failures));
  CHECK(failures.empty());
  CHECK(refusals > 0);
}

// Plans drawn at random (a fixed seed) from every plan flag's values, on a dense and a
// mixture-of-experts model: each is simulated or refused as invalid, never an internal error
// (a broken invariant of the lowering, schedule or simulator that check_plan let through).
TEST_CASE("random plan combinations simulate or are refused, never an internal error",
          "[mutation][combinations]") {
  Scratch scratch("combinations");
  const fs::path capture = scratch.path("output.txt");
  std::mt19937 rng(20261201);
  auto pick = [&rng](const std::vector<std::string>& values) {
    return values[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)];
  };
  auto coin = [&rng](double p) { return std::bernoulli_distribution(p)(rng); };
  const std::vector<std::string> models = {"cpu-small", "mixtral-8x7b",
                                           (repo() / "tests/exec/mpi/tiny_moe.json").string(),
                                           (repo() / "tests/exec/mpi/tiny_llama_4l.json").string()};
  const int draws = 400;
  std::vector<std::string> failures;
  int runs = 0, refusals = 0;
  for (int i = 0; i < draws; ++i) {
    std::vector<std::string> args = {"--model",   pick(models),
                                     "--cluster", "dgx-h100-superpod",
                                     "--gpus",    pick({"8", "16", "32"}),
                                     "--seq-len", pick({"32", "64"})};
    auto maybe = [&](const char* flag, const std::vector<std::string>& values, double p = 0.5) {
      if (coin(p)) {
        args.push_back(flag);
        args.push_back(pick(values));
      }
    };
    maybe("--tp", {"1", "2", "4", "8"}, 0.7);
    maybe("--pp", {"1", "2", "4"}, 0.6);
    maybe("--cp", {"1", "2"}, 0.3);
    maybe("--ep", {"1", "2", "4", "8"}, 0.3);
    maybe("--micro-batch-size", {"1", "2", "4"});
    maybe("--global-batch-size", {"8", "16", "32", "64"}, 0.9);
    maybe("--schedule", {"gpipe", "1f1b", "interleaved", "zero-bubble", "pipedream"});
    maybe("--virtual-stages", {"1", "2"}, 0.3);
    maybe("--zero-stage", {"0", "1", "2", "3"});
    maybe("--recompute", {"none", "selective", "full"});
    maybe("--attention", {"unfused", "flash"}, 0.3);
    maybe("--precision", {"bf16", "fp16", "fp8", "fp32", "tf32"}, 0.3);
    maybe("--grad-precision", {"fp32", "bf16", "fp16"}, 0.2);
    maybe("--comm-precision", {"bf16", "fp16", "fp8", "fp32"}, 0.2);
    maybe("--grad-compression", {"0.25", "1"}, 0.15);
    maybe("--optimizer", {"adam", "sgd"}, 0.2);
    maybe("--clip-grad", {"0", "1"}, 0.3);
    maybe("--expert-load", {"1", "1.5"}, 0.2);
    maybe("--order", {"tp-cp-ep-dp-pp", "dp-tp-cp-ep-pp", "pp-dp-tp-cp-ep"}, 0.15);
    maybe("--layers-per-stage", {"1,3", "2,2", "3,1", "16,16", "10,22", "1,1,1,1"}, 0.15);
    for (const char* flag :
         {"--sequence-parallel", "--overlap-param-gather", "--no-overlap-grad-reduce",
          "--no-overlap-tp-backward", "--no-grad-accumulation-fusion", "--overlap-p2p-comm",
          "--scatter-gather-p2p", "--no-dropout", "--zero-in-place"}) {
      if (coin(0.2)) args.push_back(flag);
    }
    const std::string line = fmt::format("{}", fmt::join(args, " "));
    const std::vector<std::pair<std::string, Command>> commands = {
        {"simulate", dtsim::cli::cmd_simulate}, {"memory", dtsim::cli::cmd_memory}};
    for (const auto& [name, command] : commands) {
      const Outcome o = run(command, args, capture);
      if (const auto what = problem(o)) {
        failures.push_back(fmt::format("{} {}: {}", name, line, *what));
      }
      (o.kind == Outcome::Ran ? runs : refusals) += 1;
    }
  }
  INFO(summary(runs, refusals, failures));
  CHECK(failures.empty());
  // Each draw runs two commands; most draws are refused as invalid plans, and the check wants
  // a tenth of them at least to run.
  CHECK(runs / 2 > draws / 10);
}
