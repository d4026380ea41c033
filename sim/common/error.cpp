#include "sim/common/error.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

namespace dtsim {

int exit_code_after_output(const std::string& who, int code) {
  // (std::cout is synchronised with stdio: its flush is stdout's fflush, where a write that
  // fails sets errno. A write that failed earlier, when the buffer filled, left ferror set.)
  errno = 0;
  std::cout.flush();
  const bool flushed = std::fflush(stdout) == 0;
  const int error = errno;
  if (flushed && !std::ferror(stdout) && std::cout.good()) return code;
  std::cerr << who << ": error: cannot write the output to stdout"
            << (error != 0 ? fmt::format(" ({})", std::strerror(error)) : std::string()) << "\n";
  return code != 0 ? code : 2;  // (a failure already said keeps its code)
}

void fail_assert(const char* expr, const char* file, int line, const std::string& msg) {
  throw InternalError(fmt::format("internal error: {} ({}:{}): {}", msg, file, line, expr));
}

}  // namespace dtsim
