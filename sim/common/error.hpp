// Error types of dtsim. Bad input throws InputError (exit code 2), a feature the model does not
// cover throws UnsupportedError (exit code 2), a broken invariant throws InternalError (exit 1).
// Only the programs' main() catch them (sim/cli, exec/cli).
#pragma once

#include <stdexcept>
#include <string>

namespace dtsim {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The user gave something malformed or inconsistent: the message names file, field, expectation.
class InputError : public Error {
 public:
  using Error::Error;
};

// Well-formed input that dtsim does not model (e.g. fp8 on a device without fp8).
class UnsupportedError : public Error {
 public:
  using Error::Error;
};

// A programmer invariant failed: a bug in dtsim, never the user's fault.
class InternalError : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void fail_assert(const char* expr, const char* file, int line, const std::string& msg);

// A program's exit code once its standard output is flushed: `code`; where a write to stdout
// failed (a full disk: the output is cut short), a message on stderr naming `who`, and 2 in
// place of a 0 that would say it succeeded. For the programs' main() only.
int exit_code_after_output(const std::string& who, int code);

}  // namespace dtsim

// Always-on invariant check with context (not compiled out in release builds).
#define DTSIM_ASSERT(cond, msg)                                                     \
  do {                                                                              \
    if (!(cond)) ::dtsim::fail_assert(#cond, __FILE__, __LINE__, std::string(msg)); \
  } while (false)
