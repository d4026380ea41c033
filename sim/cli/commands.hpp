// dtsim's sub-commands: each takes the arguments after its name and returns the exit code.
// Errors are thrown (InputError, UnsupportedError, InternalError) and handled in main().
#pragma once

#include <string>
#include <vector>

namespace dtsim::cli {

int cmd_describe(const std::vector<std::string>& args);
int cmd_memory(const std::vector<std::string>& args);
int cmd_list(const std::vector<std::string>& args);
int cmd_simulate(const std::vector<std::string>& args);
int cmd_lower(const std::vector<std::string>& args);
int cmd_export_platform(const std::vector<std::string>& args);
int cmd_plan(const std::vector<std::string>& args);
int cmd_whatif(const std::vector<std::string>& args);
int cmd_validate(const std::vector<std::string>& args);

}  // namespace dtsim::cli
