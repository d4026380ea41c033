#include "sim/common/data_files.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>

#include "sim/common/error.hpp"

namespace dtsim {

namespace fs = std::filesystem;

std::vector<fs::path> data_dirs() {
  std::vector<fs::path> dirs;
  if (const char* env = std::getenv("DTSIM_DATA_DIR"); env != nullptr && *env != '\0') {
    // A folder that is not there is a mistake (a typo would otherwise go unseen).
    std::error_code ec;
    if (!fs::is_directory(env, ec)) {
      throw InputError(fmt::format(
          "DTSIM_DATA_DIR={}: no such folder; expected one with models/ and topologies/ of "
          "your own (or unset it to use the shipped ones only)",
          env));
    }
    dirs.emplace_back(env);
  }
  dirs.emplace_back(DTSIM_DATA_DIR);
  return dirs;
}

fs::path data_path(const fs::path& relative) {
  const auto dirs = data_dirs();
  for (const fs::path& dir : dirs) {
    std::error_code ec;
    if (fs::exists(dir / relative, ec)) return dir / relative;
  }
  return dirs.back() / relative;
}

std::vector<std::string> list_data_names(std::string_view subdir) {
  std::vector<std::string> names;
  for (const fs::path& dir : data_dirs()) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir / subdir, ec)) {
      if (entry.is_regular_file() && entry.path().extension() == ".json") {
        names.push_back(entry.path().stem().string());
      }
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
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
    for (const fs::path& dir : data_dirs()) {
      const fs::path candidate = dir / subdir / (std::string(name_or_path) + ".json");
      std::error_code unseen;  // a name too long for a file's: not a shipped one
      if (fs::is_regular_file(candidate, unseen)) return candidate;
    }
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
