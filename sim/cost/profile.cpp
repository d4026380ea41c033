#include "sim/cost/profile.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <tuple>

#include "sim/cluster/device_catalog.hpp"
#include "sim/common/error.hpp"
#include "sim/common/json_reader.hpp"

namespace dtsim::cost {

std::string Profile::precision_said() const {
  return precision_stated ? fmt::format("the profile was measured at {}", to_string(precision))
                          : std::string(
                                "the profile does not say its precision (taken as bf16; dtexec "
                                "calibrate writes it)");
}

void Profile::index_sizes() {
  // A size's rate is the median of its samples (calibrate times each size in three layouts,
  // the forward's and the two gradients'), so that no one layout, by the order of the shapes,
  // stands for the size (the first of them, or the last beyond the largest, moved a quick
  // profile's prediction of GPT-2 by 27%). Once per profile: the planner prices millions of
  // GEMMs with it.
  sizes.clear();
  for (std::size_t i = 0; i < gemm.size();) {
    std::vector<double> rates;
    const double flops = gemm[i].flops();
    for (; i < gemm.size() && gemm[i].flops() == flops; ++i) {
      rates.push_back(flops / gemm[i].seconds);
    }
    std::sort(rates.begin(), rates.end());
    const std::size_t n = rates.size();
    sizes.emplace_back(flops, n % 2 == 1 ? rates[n / 2] : 0.5 * (rates[n / 2 - 1] + rates[n / 2]));
  }
}

double Profile::gemm_seconds(double flops) const {
  DTSIM_ASSERT(!sizes.empty(), "profile without GEMM sizes (index_sizes)");
  if (flops <= sizes.front().first) return flops / sizes.front().second;
  if (flops >= sizes.back().first) return flops / sizes.back().second;
  const auto hi = std::lower_bound(sizes.begin(), sizes.end(), flops,
                                   [](const auto& s, double f) { return s.first < f; });
  if (hi->first == flops) return flops / hi->second;
  const auto lo = hi - 1;
  const double t =
      (std::log(flops) - std::log(lo->first)) / (std::log(hi->first) - std::log(lo->first));
  return flops / (lo->second + t * (hi->second - lo->second));
}

double Profile::gemm_seconds(double m, double n, double k) const {
  std::optional<double> measured;
  for (const GemmSample& s : gemm) {
    if (s.m == m && s.n == n && s.k == k)
      measured = std::min(measured.value_or(s.seconds), s.seconds);
  }
  return measured ? *measured : gemm_seconds(2.0 * m * n * k);
}

std::optional<double> Profile::collective_seconds(const std::string& kind, int ranks, double bytes,
                                                  bool started) const {
  // The started table's samples where asked for and measured, else the blocking one's.
  const auto samples_in = [&](const auto& table) -> const std::vector<CollectiveSample>* {
    const auto it = table.find({kind, ranks});
    return it == table.end() || it->second.empty() ? nullptr : &it->second;
  };
  const std::vector<CollectiveSample>* samples =
      started ? samples_in(started_collectives) : nullptr;
  if (samples == nullptr) samples = samples_in(collectives);
  if (samples == nullptr) return std::nullopt;
  const auto& s = *samples;
  if (bytes <= s.front().bytes) return s.front().seconds;  // latency-bound below
  auto rate = [](const CollectiveSample& c) { return c.bytes / c.seconds; };
  if (bytes >= s.back().bytes) return bytes / rate(s.back());
  const auto hi = std::lower_bound(s.begin(), s.end(), bytes,
                                   [](const CollectiveSample& c, double b) { return c.bytes < b; });
  const auto lo = hi - 1;
  const double t =
      (std::log(bytes) - std::log(lo->bytes)) / (std::log(hi->bytes) - std::log(lo->bytes));
  return bytes / (rate(*lo) + t * (rate(*hi) - rate(*lo)));
}

std::optional<double> Profile::largest_collective_bytes(const std::string& kind, int ranks) const {
  const auto it = collectives.find({kind, ranks});
  if (it == collectives.end() || it->second.empty()) return std::nullopt;
  return it->second.back().bytes;
}

Profile load_profile(const std::string& path) {
  return profile_from_json(JsonReader::parse_file(path), path);
}

Profile profile_from_json(const nlohmann::json& j, const std::string& path) {
  refuse_other_kind(j, path, "calibration profile");
  const JsonReader r(j, path);
  r.expect_only({"device", "source", "precision", "gemm", "memory_bw_bytes_per_s",
                 "launch_overhead_s", "collectives", "notes", "ops", "ranks_per_host", "jitter_cv",
                 "in_run"});
  r.refuse_nulls();
  Profile p;
  p.file = path;
  p.device = r.name("device");
  p.source = r.string("source");
  // Fields that the model does not read still have their types checked: a profile is written
  // by dtexec calibrate, and a wrong type means a file that it did not write.
  if (r.has("notes")) r.string("notes");
  if (r.has("ranks_per_host")) p.ranks_per_host = r.positive_int("ranks_per_host");
  if (r.has("precision")) {
    p.precision = *parse_precision(r.choice("precision", {"fp32", "tf32", "bf16", "fp16", "fp8"}));
    p.precision_stated = true;
  }
  const auto& samples = r.raw().contains("gemm") ? r.raw().at("gemm") : nlohmann::json();
  if (!samples.is_array() || samples.empty()) {
    r.fail("gemm", "expected a non-empty array of {\"m\", \"n\", \"k\", \"seconds\"} samples");
  }
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const JsonReader s(samples[i], path, fmt::format("gemm[{}]", i));
    s.expect_only({"m", "n", "k", "seconds"});
    s.refuse_nulls();
    const GemmSample sample{static_cast<double>(s.positive_int("m")),
                            static_cast<double>(s.positive_int("n")),
                            static_cast<double>(s.positive_int("k")), s.positive_number("seconds")};
    // A timing no device can give: far beyond the catalog's fastest (a unit mistake, a clock
    // read wrong), which would price the step at nearly nothing.
    if (sample.flops() / sample.seconds > kFastestGemmFlops) {
      s.fail("seconds",
             fmt::format("m={:.0f} n={:.0f} k={:.0f} in {:g} s is {:.3g} FLOP/s, above the "
                         "{:g} that no device comes near (a timing error?)",
                         sample.m, sample.n, sample.k, sample.seconds,
                         sample.flops() / sample.seconds, kFastestGemmFlops));
    }
    // Nor one slower than the least rate an op may have (below): a GEMM of 1e21 s priced the
    // step at 9e21 s.
    if (sample.flops() / sample.seconds < kSlowestRate) {
      s.fail("seconds", fmt::format("m={:.0f} n={:.0f} k={:.0f} in {:g} s is {:.3g} FLOP/s, below "
                                    "{:g} (a timing error?)",
                                    sample.m, sample.n, sample.k, sample.seconds,
                                    sample.flops() / sample.seconds, kSlowestRate));
    }
    // Two times for one shape: which one the simulator took would depend on their order.
    for (std::size_t before = 0; before < p.gemm.size(); ++before) {
      const GemmSample& o = p.gemm[before];
      if (o.m == sample.m && o.n == sample.n && o.k == sample.k) {
        s.fail("m", fmt::format("m={} n={} k={} is given twice (also gemm[{}]): one time per shape",
                                sample.m, sample.n, sample.k, before));
      }
    }
    p.gemm.push_back(sample);
  }
  // By FLOPs, shapes of equal FLOPs by shape: an order that the file's does not change.
  std::sort(p.gemm.begin(), p.gemm.end(), [](const GemmSample& a, const GemmSample& b) {
    return std::tuple(a.flops(), a.m, a.n, a.k) < std::tuple(b.flops(), b.m, b.n, b.k);
  });
  p.index_sizes();
  // The bounds of a device file's bandwidths: beyond them only a unit mistake.
  if (r.has("memory_bw_bytes_per_s")) {
    p.memory_bw_bytes_per_s = r.number_within("memory_bw_bytes_per_s", cluster::kLeastBandwidth,
                                              cluster::kMostBandwidth, "bytes/s");
  }
  if (r.has("launch_overhead_s")) {
    // The bounds of a device file's launch overhead.
    p.launch_overhead_s = r.number_within("launch_overhead_s", cluster::kLeastLatency,
                                          cluster::kMostLatency, "seconds", /*allow_zero=*/true);
  }
  auto coefficient_of_variation = [](const JsonReader& reader, std::string_view key) {
    const double cv = reader.non_negative_number(key);
    if (cv >= 1) {
      reader.fail(key, fmt::format("expected a coefficient of variation below 1, got {}", cv));
    }
    return cv;
  };
  if (r.has("jitter_cv")) p.jitter_cv = coefficient_of_variation(r, "jitter_cv");
  if (r.has("in_run")) {
    const JsonReader f = r.object("in_run");
    f.expect_only({"forward", "backward", "optimizer", "tasks", "rank_spread_cv", "transient_cv",
                   "optimizer_prices_clear", "optimizer_prices_master_copy"});
    f.refuse_nulls();
    if (f.has("rank_spread_cv")) p.rank_spread_cv = coefficient_of_variation(f, "rank_spread_cv");
    // Recorded by dtexec calibrate for comparison with jitter_cv; not used by the model yet.
    if (f.has("transient_cv")) coefficient_of_variation(f, "transient_cv");
    if (f.has("tasks")) f.positive_int("tasks");
    auto factor = [&](std::string_view key) {
      const double v = f.positive_number(key);
      if (v < 0.1 || v > 100) {
        f.fail(key, fmt::format(
                        "expected a ratio of measured to predicted time in [0.1, 100], got {}", v));
      }
      return v;
    };
    p.in_run = Profile::InRun{factor("forward"), factor("backward"), factor("optimizer"),
                              f.boolean_or("optimizer_prices_clear", false),
                              f.boolean_or("optimizer_prices_master_copy", false)};
  }
  if (r.has("ops")) {
    const auto& ops = r.raw().at("ops");
    if (!ops.is_array()) r.fail("ops", "expected an array of {\"op\", \"phase\", rate} entries");
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const JsonReader o(ops[i], path, fmt::format("ops[{}]", i));
      o.expect_only({"op", "phase", "flops_per_s", "bytes_per_s", "seconds"});
      o.refuse_nulls();
      const std::string op =
          o.choice("op", {"attention", "flash_attention", "layernorm", "rmsnorm", "gelu", "swiglu",
                          "residual", "embedding", "loss_statistics", "loss", "optimizer"});
      const std::string phase = o.choice("phase", {"fwd", "bwd", "step"});
      // The passes each op has (the optimizer its step, the loss statistics no backward), and
      // the unit of its work in the model graph (the attention core's FLOPs, else bytes):
      // anything else would be read by nothing, or as the wrong quantity.
      const bool step = op == "optimizer";
      if ((phase == "step") != step || (op == "loss_statistics" && phase == "bwd")) {
        o.fail("phase", fmt::format("{} has no \"{}\" rate (its phases: {})", op, phase,
                                    step                      ? "step"
                                    : op == "loss_statistics" ? "fwd"
                                                              : "fwd, bwd"));
      }
      if (o.has("flops_per_s") == o.has("bytes_per_s")) {
        o.fail("flops_per_s", "give exactly one of flops_per_s and bytes_per_s");
      }
      const bool flops = o.has("flops_per_s");
      const bool flops_op = op == "attention" || op == "flash_attention";
      if (flops != flops_op) {
        o.fail(flops ? "flops_per_s" : "bytes_per_s",
               fmt::format("{} is rated in {}", op, flops_op ? "flops_per_s" : "bytes_per_s"));
      }
      if (p.ops.count({op, phase})) {
        o.fail("op", fmt::format("{} {} is given twice", op, phase));
      }
      // Up to a device file's bounds (a faster rate is a unit or timing mistake); no least one,
      // as a small op's rate on a busy host may be low.
      const double rate =
          flops ? o.number_within("flops_per_s", kSlowestRate, cluster::kMostFlops, "FLOP/s")
                : o.number_within("bytes_per_s", kSlowestRate, cluster::kMostBandwidth, "bytes/s");
      p.ops[{op, phase}] = {rate, flops};
      if (o.has("seconds")) o.positive_number("seconds");
    }
    const auto loss = p.ops.find({"loss", "fwd"});
    if (loss != p.ops.end() && !p.ops.count({"loss_statistics", "fwd"})) {
      loss->second.rate *= 2;
      p.ops[{"loss_statistics", "fwd"}] = loss->second;
      p.loss_split_evenly = true;
    }
  }
  if (r.has("collectives")) {
    const auto& table = r.raw().at("collectives");
    if (!table.is_array()) r.fail("collectives", "expected an array of measurements");
    for (std::size_t i = 0; i < table.size(); ++i) {
      const JsonReader c(table[i], path, fmt::format("collectives[{}]", i));
      c.expect_only({"kind", "ranks", "bytes", "seconds", "started", "algbw_bytes_per_s",
                     "busbw_bytes_per_s"});
      c.refuse_nulls();
      const std::string kind = c.choice(
          "kind", {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"});
      const bool started = c.has("started") && c.boolean("started");
      if (started && kind != "all_reduce" && kind != "all_gather" && kind != "reduce_scatter") {
        c.fail("started", fmt::format("{} is not a collective that dtexec starts (all_reduce, "
                                      "all_gather and reduce_scatter are)",
                                      kind));
      }
      const auto ranks = static_cast<int>(c.positive_int_up_to("ranks", 1 << 24));
      if (ranks < 2) c.fail("ranks", fmt::format("expected at least 2, got {}", ranks));
      const auto bytes = static_cast<double>(c.positive_int("bytes"));
      auto& measured = (started ? p.started_collectives : p.collectives)[{kind, ranks}];
      if (std::any_of(measured.begin(), measured.end(),
                      [&](const Profile::CollectiveSample& s) { return s.bytes == bytes; })) {
        c.fail("bytes", fmt::format("{}{} over {} ranks at {} bytes is given twice", kind,
                                    started ? " (started)" : "", ranks, c.positive_int("bytes")));
      }
      const double seconds = c.positive_number("seconds");
      // Within a device file's bandwidths at most (beyond: a unit or timing mistake; 2^62 bytes
      // in a picosecond took the dp communication off the step), and the least rate an op may
      // have.
      if (bytes / seconds > cluster::kMostBandwidth || bytes / seconds < kSlowestRate) {
        c.fail("seconds",
               fmt::format("{:g} bytes in {:g} s is {:.3g} bytes/s: expected from {:g} "
                           "to {:g} (a timing error?)",
                           bytes, seconds, bytes / seconds, kSlowestRate, cluster::kMostBandwidth));
      }
      measured.push_back({bytes, seconds});
      for (const char* rate : {"algbw_bytes_per_s", "busbw_bytes_per_s"}) {
        if (c.has(rate)) c.positive_number(rate);
      }
    }
    for (auto* table_of : {&p.collectives, &p.started_collectives}) {
      for (auto& entry : *table_of) {
        auto& measured = entry.second;
        std::sort(measured.begin(), measured.end(),
                  [](const Profile::CollectiveSample& a, const Profile::CollectiveSample& b) {
                    return a.bytes < b.bytes;
                  });
      }
    }
  }
  return p;
}

}  // namespace dtsim::cost
