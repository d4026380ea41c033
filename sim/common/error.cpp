#include "sim/common/error.hpp"

#include <fmt/format.h>

namespace dtsim {

void fail_assert(const char* expr, const char* file, int line, const std::string& msg) {
  throw InternalError(fmt::format("internal error: {} ({}:{}): {}", msg, file, line, expr));
}

}  // namespace dtsim
