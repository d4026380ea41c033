// Finding the data shipped with dtsim (models/, topologies/) by name or by path.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dtsim {

// $DTSIM_DATA_DIR if set, else the source tree this binary was built from.
std::filesystem::path data_dir();

// Sorted names (file stems) of the *.json files in data_dir()/subdir.
std::vector<std::string> list_data_names(std::string_view subdir);

// Whether `text` reads as a file's path rather than a name: it contains '/' or ends in ".json".
bool names_a_path(std::string_view text);

// `name_or_path` is a path when it names an existing file or names_a_path(name_or_path);
// otherwise it is a name looked up as data_dir()/subdir/<name>.json. An unknown name throws
// InputError listing the known ones; `what` ("model", "cluster") goes in the message.
std::filesystem::path resolve_data_file(std::string_view what, std::string_view subdir,
                                        std::string_view name_or_path);

}  // namespace dtsim
