#include "sim/common/data_files.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "sim/common/error.hpp"

namespace dtsim {

namespace fs = std::filesystem;

fs::path data_dir() {
  if (const char* env = std::getenv("DTSIM_DATA_DIR"); env != nullptr && *env != '\0') {
    // A folder that is not there would list no models or clusters and call every name unknown.
    std::error_code ec;
    if (!fs::is_directory(env, ec)) {
      throw InputError(fmt::format(
          "DTSIM_DATA_DIR={}: no such folder; expected one with models/ and topologies/ (or "
          "unset it to use the shipped ones)",
          env));
    }
    return fs::path(env);
  }
  return fs::path(DTSIM_DATA_DIR);
}

std::vector<std::string> list_data_names(std::string_view subdir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(data_dir() / subdir, ec)) {
    if (entry.is_regular_file() && entry.path().extension() == ".json") {
      names.push_back(entry.path().stem().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

bool names_a_path(std::string_view text) {
  return text.find('/') != std::string_view::npos || text.ends_with(".json");
}

fs::path resolve_data_file(std::string_view what, std::string_view subdir,
                           std::string_view name_or_path) {
  const fs::path as_path{std::string(name_or_path)};
  const bool looks_like_path = names_a_path(name_or_path);
  std::error_code ec;
  const fs::file_status status = fs::status(as_path, ec);
  if (fs::is_regular_file(status)) return as_path;
  // A name: a shipped file (before a directory of that name here).
  if (!looks_like_path) {
    const fs::path candidate = data_dir() / subdir / (std::string(name_or_path) + ".json");
    std::error_code unseen;  // a name too long for a file's: not a shipped one
    if (fs::is_regular_file(candidate, unseen)) return candidate;
  }
  // A path that cannot be looked at: a name too long, links in a loop, a folder not readable.
  if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
    throw InputError(fmt::format("{}: cannot look at it ({}); expected a {} name or a JSON file",
                                 name_or_path, ec.message(), what));
  }
  // Say what is there instead, where something is.
  if (fs::is_directory(status)) {
    throw InputError(
        fmt::format("{}: is a directory; expected a {} name or a JSON file", name_or_path, what));
  }
  if (looks_like_path) {
    if (fs::exists(status)) {
      throw InputError(
          fmt::format("{}: not a regular file; expected a {} JSON file", name_or_path, what));
    }
    throw InputError(fmt::format("{}: no such {} file", name_or_path, what));
  }
  throw InputError(fmt::format("unknown {} \"{}\" (known: {}; or give a path to a JSON file)", what,
                               name_or_path, fmt::join(list_data_names(subdir), ", ")));
}

}  // namespace dtsim
