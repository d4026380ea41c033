// Finding the data shipped with dtsim (models/, topologies/) by name or by path.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dtsim {

// Where names are looked up, in order: the folder $DTSIM_DATA_DIR names, where set (a user's
// own models/ and topologies/, which add to the shipped ones and take precedence over those
// of the same name), then the source tree this binary was built from.
std::vector<std::filesystem::path> data_dirs();

// `relative` (such as "validation", "topologies/devices/h100-sxm.json") in the first of
// data_dirs() that has it, else under the shipped folder (for a message that names it).
std::filesystem::path data_path(const std::filesystem::path& relative);

// Sorted names (file stems) of the *.json files in each data_dirs()/subdir, each name once.
std::vector<std::string> list_data_names(std::string_view subdir);

// Whether `text` reads as a file's path rather than a name: it contains '/' or ends in ".json".
bool names_a_path(std::string_view text);

// `name_or_path` is a path when it names an existing file or names_a_path(name_or_path);
// otherwise it is a name looked up as data_path(subdir/<name>.json). An unknown name throws
// InputError listing the known ones; `what` ("model", "cluster") goes in the message.
std::filesystem::path resolve_data_file(std::string_view what, std::string_view subdir,
                                        std::string_view name_or_path);

}  // namespace dtsim
