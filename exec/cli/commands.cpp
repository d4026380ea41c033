// What dtexec's commands share (exec/cli/commands.hpp).
#include "exec/cli/commands.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <iostream>
#include <limits>
#include <new>
#include <sstream>
#include <thread>

#include "sim/cli/options.hpp"
#include "sim/common/error.hpp"
#include "sim/common/launcher.hpp"

namespace dtsim::exec::cli {

bool parse(const std::vector<std::string>& args, const po::options_description& desc,
           const char* usage, po::variables_map& vm) {
  dtsim::cli::store_options(args, desc, vm);
  if (vm.count("help")) {
    std::cout << usage << "\n\n" << desc;
    return false;
  }
  return true;
}

// The launcher's numbering until MPI starts: a bad option is printed by rank 0 alone.
int g_rank = dtsim::launcher_rank();

std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t h = 14695981039346656037ull;
  for (const unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

void check_same_arguments(const cpu::MpiSession& mpi, const po::variables_map& vm,
                          const char* command) {
  // Each option as key=value, in the variables map's order (by key): the same however the
  // command line ordered or spelt them (--seed 7, --seed=7), and a value stays with its key.
  std::string text;
  for (const auto& [key, value] : vm) {
    const boost::any& v = value.value();
    std::string shown;
    if (const auto* s = boost::any_cast<std::string>(&v)) {
      shown = *s;
    } else if (const auto* i = boost::any_cast<int>(&v)) {
      shown = std::to_string(*i);
    } else if (const auto* l = boost::any_cast<std::int64_t>(&v)) {
      shown = std::to_string(*l);
    } else if (const auto* d = boost::any_cast<double>(&v)) {
      shown = fmt::format("{}", *d);
    } else if (const auto* f = boost::any_cast<float>(&v)) {
      shown = fmt::format("{}", *f);
    } else if (const auto* b = boost::any_cast<bool>(&v)) {
      shown = *b ? "true" : "false";
    } else if (const auto* list = boost::any_cast<std::vector<std::string>>(&v)) {
      shown = fmt::format("{}", fmt::join(*list, "\x1f"));
    } else {
      throw InternalError(fmt::format("--{}: an option type the ranks' check does not know", key));
    }
    text += key + '=' + shown + '\0';
  }
  const std::uint64_t hash = fnv1a(text);
  // As two 32-bit halves, which doubles hold exactly.
  const auto all =
      mpi.all_gather({static_cast<double>(hash >> 32), static_cast<double>(hash & 0xffffffffull)});
  for (int r = 1; r < mpi.size(); ++r) {
    const auto at = static_cast<std::size_t>(2 * r);
    if (all[at] != all[0] || all[at + 1] != all[1]) {
      throw InputError(fmt::format(
          "rank {} was started with other arguments than rank 0: every rank of a dtexec {} "
          "job takes the same ones (an mpirun of several programs, with ':', gave the ranks "
          "different seeds, plans or models)",
          r, command));
    }
  }
}

void end_all_ranks(const std::exception& e, const dtsim::exec::cpu::MpiSession* mpi,
                   const char* command, Comm* comm) {
  if (mpi == nullptr || mpi->size() <= 1) return;
  const bool memory = dynamic_cast<const std::bad_alloc*>(&e) != nullptr;
  const bool input = dynamic_cast<const dtsim::InputError*>(&e) != nullptr ||
                     dynamic_cast<const dtsim::UnsupportedError*>(&e) != nullptr || memory;
  std::cerr << fmt::format("dtexec {}: rank {} on {}: {}: {}\n", command, mpi->rank(), mpi->host(),
                           input ? "error" : "internal error",
                           memory ? kOutOfHostMemory : e.what());
  if (comm != nullptr) comm->abort_communicators();
  mpi->abort(input ? 2 : 1);
}

namespace {

// `failed` (every rank's step failed), on rank 0 with the other ranks' reasons where they
// differ from its own (a file that is missing on one node and malformed on another), so that
// the one message the job prints does not hide them; on the other ranks as it is.
[[noreturn]] void rethrow_with_others(const std::exception_ptr& failed,
                                      const dtsim::exec::cpu::MpiSession& mpi) {
  std::string mine = "(not a standard exception)";
  try {
    std::rethrow_exception(failed);
  } catch (const std::exception& e) {
    mine = e.what();
  } catch (...) {
  }
  const auto all = mpi.gather_to_root(mpi.host() + '\n' + mine);
  // Each other reason once, with the ranks that gave it (all is empty off rank 0).
  std::vector<std::pair<std::string, std::vector<std::string>>> others;
  for (std::size_t r = 1; r < all.size(); ++r) {
    const std::size_t cut = all[r].find('\n');
    const std::string host = all[r].substr(0, cut), reason = all[r].substr(cut + 1);
    if (reason == mine) continue;
    auto it = std::find_if(others.begin(), others.end(),
                           [&](const auto& o) { return o.first == reason; });
    if (it == others.end()) it = others.insert(others.end(), {reason, {}});
    it->second.push_back(fmt::format("{} on {}", r, host));
  }
  if (others.empty()) std::rethrow_exception(failed);
  // (At most 8 reasons, each with at most 8 ranks: a reason that names its host differs on
  // every node of a large job.)
  constexpr std::size_t kMost = 8;
  std::string text = mine + "\n  and on other ranks:";
  for (std::size_t i = 0; i < others.size() && i < kMost; ++i) {
    const auto& [reason, ranks] = others[i];
    const std::vector<std::string> shown(ranks.begin(),
                                         ranks.begin() + std::min(ranks.size(), kMost));
    text += fmt::format(
        "\n  rank{} {}{}: {}", ranks.size() == 1 ? "" : "s", fmt::join(shown, ", "),
        ranks.size() > kMost ? fmt::format(" and {} more", ranks.size() - kMost) : "", reason);
  }
  if (others.size() > kMost) {
    text += fmt::format("\n  and {} other reasons", others.size() - kMost);
  }
  try {
    std::rethrow_exception(failed);
  } catch (const dtsim::InputError&) {
    throw dtsim::InputError(text);
  } catch (const dtsim::UnsupportedError&) {
    throw dtsim::UnsupportedError(text);
  }
  // (Another kind is an internal error: rank 0's alone.)
}

}  // namespace

void alike_on_every_rank(const dtsim::exec::cpu::MpiSession* mpi, const char* command,
                         const std::function<void()>& step) {
  std::exception_ptr failed;
  try {
    step();
  } catch (...) {
    failed = std::current_exception();
  }
  if (mpi == nullptr || mpi->size() <= 1) {
    if (failed) std::rethrow_exception(failed);
    return;
  }
  const double mine = failed ? 1.0 : 0.0;
  const double any = mpi->max(mine);
  const double all = -mpi->max(-mine);
  if (any == 0) return;
  if (all > 0) rethrow_with_others(failed, *mpi);
  if (failed) {
    try {
      std::rethrow_exception(failed);
    } catch (const std::exception& e) {
      end_all_ranks(e, mpi, command);
      throw;
    }
  }
  // Another rank failed and is ending the job (MPI_Abort ends this process too); should that
  // end not come, this rank ends it.
  std::this_thread::sleep_for(std::chrono::seconds(30));
  mpi->abort(2);
}

std::ostream& out(int rank) {
  static std::ostringstream discard;
  return rank == 0 ? std::cout : discard;
}

std::optional<dtsim::exec::cpu::HostMemory> host_memory_per_rank(int ranks_here) {
  auto available = dtsim::exec::cpu::available_host_memory();
  if (available) available->bytes /= std::max(1, ranks_here);
  return available;
}

void require_host_memory(double bytes, int ranks_here, const dtsim::exec::cpu::MpiSession* mpi) {
  const auto mine = host_memory_per_rank(ranks_here);
  double available = mine ? mine->bytes : std::numeric_limits<double>::infinity();
  if (mpi != nullptr) available = -mpi->max(-available);
  if (bytes <= available) return;
  constexpr double gib = 1024.0 * 1024 * 1024;
  const std::string source =
      mine && mine->bytes == available ? mine->source : "on another rank of this run";
  throw dtsim::InputError(fmt::format(
      "the plan needs {:.1f} GiB of tensors per rank (dtsim memory), more than this host's "
      "available memory gives each of its {} rank{} ({:.1f} GiB: {}); a smaller "
      "--micro-batch-size or --seq-len, --recompute, or more ranks over tp, pp or ZeRO need "
      "less (`dtsim memory` prints where it goes)",
      bytes / gib, ranks_here, ranks_here == 1 ? "" : "s", available / gib, source));
}

}  // namespace dtsim::exec::cli
