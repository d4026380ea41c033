// Shared pieces of dtsim's sub-commands: the plan flags (Megatron-LM vocabulary, DESIGN.md),
// option parsing with dtsim's error conventions, and loading model/cluster from options.
#pragma once

#include <array>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sim/cluster/topology.hpp"
#include "sim/common/json_reader.hpp"
#include "sim/cost/profile.hpp"
#include "sim/model/model_graph.hpp"
#include "sim/model/model_spec.hpp"
#include "sim/plan/goodput.hpp"
#include "sim/plan/memory_model.hpp"
#include "sim/plan/plan.hpp"
#include "sim/planner/planner.hpp"

namespace dtsim::cli {

namespace po = boost::program_options;

// Long options are matched whole: Boost's default style also takes a unique prefix (--fixed
// for --fixed-plan, --re for --recompute), which turns a mistyped flag into another one.
inline constexpr int kNoGuessing =
    po::command_line_style::default_style & ~po::command_line_style::allow_guessing;

inline constexpr const char* kDefaultModel = "llama3-8b";
inline constexpr const char* kDefaultCluster = "default";

// Adds --model (and --cluster, --gpus when `with_cluster`; `plan_flag`: the command's flag for
// a plan file, whose devices are --gpus's default).
void add_model_options(po::options_description& desc, bool with_cluster,
                       const char* plan_flag = nullptr);
// Adds the planner's search limits: --max-tp, --max-pp, --max-cp and --fixed (dtsim plan and
// whatif).
void add_search_space_options(po::options_description& desc);
// Applies them to `space` (InputError naming the flag for a bad value).
void search_space_from_options(const po::variables_map& vm, planner::SearchSpace& space);

// Adds --price-per-gpu-hour (dtsim plan, simulate, whatif), which apply_price sets on a cluster
// (checked: InputError naming the flag for a bad value, or one given where nothing reads it:
// without --tokens or plan's --objective cost); unpriced_note says, for a table's footnote, that a
// cluster has none.
// `objective`: the command has --objective (dtsim plan), which the help names.
void add_price_option(po::options_description& desc, bool objective = false);
void apply_price(const po::variables_map& vm, cluster::Cluster& c);
std::string unpriced_note(const std::string& cluster);

// Adds --global-batch-size (sequences per optimizer step; `help` says when it is needed) and
// --global-batch, DESIGN.md's name for it in dtsim plan's synopsis (dtsim plan and whatif).
void add_global_batch_options(po::options_description& desc, const char* help);
// Its value from either name, checked positive (InputError naming the flag; both names given:
// InputError); none given: nullopt.
std::optional<std::int64_t> global_batch_from_options(const po::variables_map& vm);

// A time to train in the largest unit it fills (a short run is not "0.0 days").
std::string span_text(double seconds);

// Adds the reliability flags of time to train with failures (--tokens of dtsim plan and whatif):
// --interruptions-per-gpu-hour, --restart-minutes, --checkpoint-write-gbs-per-gpu.
void add_reliability_options(po::options_description& desc);
// Their values over plan::Reliability's defaults (InputError naming the flag for a bad value,
// or one given without --tokens, which nothing would read).
plan::Reliability reliability_from_options(const po::variables_map& vm);
// The reliability figures by their flags' names with underscores (restart_minutes for
// --restart-minutes): dtsim whatif's --vary keys for them.
inline constexpr std::array<const char*, 5> kReliabilityKeys = {
    "interruptions_per_gpu_hour", "restart_minutes", "checkpoint_write_gbs_per_gpu",
    "checkpoint_write_gbs_total", "checkpoint_async_gbs_per_gpu"};
// Sets the figure of one of those keys to a flag's value (rate per device-hour, minutes, GB/s),
// checked: InputError naming it as `what` says ("--restart-minutes", "--vary ...").
void set_reliability(plan::Reliability& r, const std::string& key, double value,
                     const std::string& what);
// --tokens, the training tokens for the time to train: 0 without it (InputError unless a
// finite positive number).
double training_tokens(const po::variables_map& vm);
// What a time to train with interruptions assumed, for a table's footnote.
std::string interruptions_note(const plan::Reliability& r);
// "X days, Y USD; with interruptions ... (goodput ...)": a training time, failure-free and with
// interruptions, and the failure-free cost when the cluster has a price.
std::string training_time_text(const plan::TrainingTime& tt, std::optional<double> cost_usd);
// The same as JSON: time_to_train_s, goodput, time_to_train_with_interruptions_s (null when
// the job never finishes), checkpoint_every_steps, checkpoint_write_s, checkpoint_bytes,
// job_mtbf_s, and with a price cost_to_train_usd and cost_to_train_with_interruptions_usd.
nlohmann::json training_time_json(const plan::TrainingTime& tt, std::optional<double> cost_usd);
// The price the costs are at, so that a reader checks them from the JSON alone:
// price_per_device_hour_usd and price_source (the cluster file's, or --price-per-gpu-hour), set
// in `j` where the cluster has a price.
void add_price_json(nlohmann::json& j, const cluster::Cluster& cluster);

// A progress bar on standard error where it is a terminal (empty otherwise): called with
// (done, total), it draws "[####   ] done/total what" from a second after `started` on, and
// ends its line when done reaches total (a run done within the second draws nothing). For runs long
// enough to wonder about (plan's search, whatif's points).
std::function<void(std::uint64_t, std::uint64_t)> progress_bar(
    std::chrono::steady_clock::time_point started, const char* what);
// Ends a progress bar's line left open (a run that stopped on an error), so that what follows
// starts a line of its own.
void end_progress_line();

// Adds the plan flags and --plan (`precision_help`: --precision's values and default).
void add_plan_options(po::options_description& desc,
                      const char* precision_help =
                          "bf16, fp16, fp8, fp32, tf32 (default bf16; fp16 on a "
                          "device without bf16, fp32 on one with neither)");
// Adds --jitter-cv (the straggler model) and --rank-spread-cv (the slow rank); `where` says
// which parts of the command use them.
void add_jitter_option(po::options_description& desc, const char* where = "");
// --jitter-cv's value, checked to be a fraction in [0, 1) (unset: none given).
std::optional<double> jitter_from_options(const po::variables_map& vm);
// --rank-spread-cv's value, checked the same way.
std::optional<double> rank_spread_from_options(const po::variables_map& vm);
// A straggler spread named `what` (a flag or a --vary value), checked: a fraction in [0, 1).
double checked_jitter(double cv, const std::string& what);

// Stores `args` parsed against `desc` into `vm`: long options matched whole, and the words that
// are not options named by `positional` (none when null). Unknown or malformed options, and a
// word that nothing takes (`dtsim describe llama3-70b`, which would otherwise describe the
// default model), throw InputError (exit code 2).
void store_options(const std::vector<std::string>& args, const po::options_description& desc,
                   po::variables_map& vm,
                   const po::positional_options_description* positional = nullptr);

// Parses `args` against `desc` (store_options, no positional words); on --help prints `usage`
// and the options to stdout and returns false.
bool parse(const std::vector<std::string>& args, const po::options_description& desc,
           const std::string& usage, po::variables_map& vm);

// --json and --csv are one output or the other: InputError when both are given.
void check_one_format(const po::variables_map& vm);

// Checks, before the work that fills it, that `path` (given by `flag`, e.g. "--trace") can be
// written: not empty, not a directory; if it exists, writable itself; else (a link to nothing
// included) in a directory that exists and takes a new file. InputError naming the flag
// otherwise. Creates nothing. With `inputs`, also that it is none of the files their other
// options name (a --trace given the --plan file's path would overwrite the plan).
void check_writable(const std::string& path, const std::string& flag,
                    const po::variables_map* inputs = nullptr);

// --model's or --cluster's value (`key`): as given, or where the flag is left at its default,
// what the --plan (or --fixed-plan) file names, which dtsim plan --out writes; a note on stderr
// where both are given and name other files.
std::string data_argument(const po::variables_map& vm, const char* key);
// The calibration profile: --profile, else the one a --plan (or --fixed-plan) file was made with
// (dtsim plan --out and whatif's plan_spec write it), said in a note; none without either.
std::optional<std::string> profile_argument(const po::variables_map& vm);
// The average slowdown of compute that overlaps communication on a GPU, which dtsim does not
// model (README "Not modelled"): Lee et al. 2025, "Characterizing Compute-Communication Overlap
// in GPU-Accelerated Distributed Deep Learning", arXiv:2507.03114 (A100, H100, MI210, MI250).
// Only to say what a plan's overlapped compute could cost, never in a step time.
inline constexpr double kMeanOverlapSlowdown = 0.189;

// The network model: --network where given (a note where a --plan or --fixed-plan file was
// simulated on another), else the one the file was simulated with (dtsim plan --out and
// whatif's plan_spec write a non-default one), said in a note; else --network's default.
std::string network_argument(const po::variables_map& vm);
// A plan file's JSON (--plan, --fixed-plan), and the plan it holds (plan::plan_from_json): a pipe
// is read once per process however often the options ask (it can be read once), a regular file
// each time.
nlohmann::json plan_file_json(const std::string& path);
plan::Plan load_plan_file(const std::string& path);
// The file a --model or --cluster value (`key`) names, canonical where it can be (tiny-gpt and
// models/tiny-gpt.json are one); InputError where it names none.
std::filesystem::path data_file(std::string_view key, const std::string& value);
// How a plan file names the model or cluster (`key`) that `given` names: a shipped one by its
// name, a file by its absolute path (InputError where it names none).
std::string data_reference(std::string_view key, const std::string& given);
model::ModelSpec model_from_options(const po::variables_map& vm);
// What turns the model's dropout off: "--no-dropout", or a --plan (--fixed-plan) file's
// "no_dropout": true ("P.json: no_dropout"); none where neither does.
std::optional<std::string> dropout_off_by(const po::variables_map& vm);
// `spec` with the model flags applied (--no-dropout, or a plan file's no_dropout).
model::ModelSpec model_with_options(model::ModelSpec spec, const po::variables_map& vm);
// The cluster, resized by --gpus when given; with a --plan file's cluster_changes (a dtsim
// whatif point's) where it runs the cluster the file names.
cluster::Cluster cluster_from_options(const po::variables_map& vm);
// A whatif point's cluster values as a plan file's cluster_changes has them (device, nic_gbps,
// latency_us, oversubscription, nodes), applied to `c` as the point applied them; InputError
// naming the file and field where one is not a value the point could have had.
void apply_cluster_changes(cluster::Cluster& c, const JsonReader& changes);
// A plan file's cluster and cluster_changes read and checked as simulate reads them, for a
// command that does not run on that cluster (dtexec run): a bad one is an error there too.
void check_plan_file_cluster(const std::string& file);
// cluster::with_devices(c, devices), its error named by `who` (an axis, a plan file) rather
// than the --gpus flag it names itself.
cluster::Cluster with_devices_for(const cluster::Cluster& c, std::int64_t devices,
                                  const std::string& who);

// The plan from --plan and/or the flags (flags given on the command line override the file),
// completed with defaults (plan::complete_plan) and validated against model and devices.
// `notes` receives what was defaulted and any warnings. `precision_default`, when given, is the
// precision where neither --precision nor the plan file names one, with why (a note says so):
// the plan is validated in the precision it will run in. `devices_are`, said where the plan's
// degrees do not match the devices, tells what they are ("the devices are the 2 ranks that
// mpirun started"); by default, where --gpus is given, that --gpus took them.
struct PrecisionDefault {
  Precision precision;
  std::string why;
};
plan::Plan plan_from_options(const po::variables_map& vm, const model::ModelSpec& model,
                             std::int64_t devices, std::vector<std::string>& notes,
                             const std::optional<PrecisionDefault>& precision_default = {},
                             const std::string& devices_are = {});

// The precision a search uses unless told: bf16, else fp16 (a V100), else fp32 (a CPU host).
Precision default_precision(const cluster::DeviceSpec& device);
// The precision a flag names (--precision, --comm-precision), or an InputError naming the flag.
Precision precision_of_flag(std::string_view flag, const std::string& text);

// What prices the compute with a calibration profile, for simulate's, plan's and whatif's
// notes: the file and its source, its in_run factors, an older file's loss split.
// `cluster`: the plan's, for a profile measured by another number of ranks per host than the
// plan runs (ranks sharing a host's cores: a CPU cluster).
std::vector<std::string> profile_notes(const cost::Profile& profile,
                                       const cluster::Cluster* cluster = nullptr);
// profile_notes' note on a shared-memory cluster (CPU ranks) whose ranks per host differ from
// those that measured the profile ("... bandwidth; `runs` N on each host: ..."); none otherwise.
std::optional<std::string> profile_host_note(const cost::Profile& profile,
                                             const cluster::Cluster& cluster,
                                             std::string_view runs = "this plan runs");
// Warnings on a calibration profile for a cluster's device: measured on another device (its
// "device" is neither the catalog name nor an alias, compared without case: its times then stand
// for a device they were not measured on); else GEMMs that ran above the device's peak at the
// profile's precision (a timing error, or the wrong device named).
std::vector<std::string> profile_warnings(const cost::Profile& profile,
                                          const cluster::DeviceSpec& device);

// --framework-overhead-gib and --device-memory-gib, and the memory options they set.
void add_memory_options(po::options_description& desc);
plan::MemoryOptions memory_options_from(const po::variables_map& vm);

// The simulator runs one program per pipeline stage; that is exact only when every group of a
// kind has the same shape on the nodes (cluster::Placement::symmetric_on). Throws InputError
// naming the degrees otherwise.
void require_symmetric_placement(const plan::Plan& plan, const cluster::Cluster& cluster);

// What memory, simulate, lower start from: the model, the cluster (--gpus applied), the
// completed and validated plan with its notes, and the model graph for the plan's micro-batch
// and precision. Fails when the device lacks the plan's precision.
struct PlanSetup {
  model::ModelSpec spec;
  cluster::Cluster cluster;
  plan::Plan plan;
  std::vector<std::string> notes;
  model::ModelGraph graph;
};
PlanSetup setup_from_options(const po::variables_map& vm);
// --layers-per-stage balanced: setup_from_options sets the split that dtsim plan's search finds
// for the plan (planner::balanced_split), plan_from_options leaves it even.
bool layers_balanced(const po::variables_map& vm);

}  // namespace dtsim::cli
